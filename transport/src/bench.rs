//! Measurements behind `scd bench transport`: loopback goodput of our job streams next to plain
//! quinn, frame encode + validate throughput, and pacing accuracy. They live here (not in the
//! binary) because the plain-quinn baseline needs quinn and rustls directly.
//!
//! The baseline is plain quinn on equal terms: the same transport config (flow-control windows,
//! stream limits, keep-alive) from the same [`TransportOptions`], the same mutual TLS (both sides
//! present a certificate from the cluster CA, TLS 1.3, ring), and a send that does not copy
//! (one `Bytes` block handed to quinn again and again). What differs is what our job stream
//! adds: framing, the Open frame, validation, the job rules, and the receiver's one copy of each
//! frame into an aligned buffer (rkyv validates in place; plain quinn's chunks are counted and
//! dropped).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::codec::{self, FrameBuf};
use crate::pacing::PacingOptions;
use crate::pki::{ClusterCa, Role};
use crate::wire::{CodeFrame, Message};
use crate::{Endpoint, TransportOptions};
use scd_types::{CodeDType, CodeKind, JobId, LayerCode, TraceContext};

/// Errors while benchmarking.
#[derive(Debug, thiserror::Error)]
#[error("benchmark: {0}")]
pub struct BenchError(String);

impl BenchError {
    /// An error with this message (for the benchmark's callers, e.g. argument parsing).
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError(e.to_string())
}

/// Largest payload per code frame in the goodput runs (a large layer's codes).
pub const GOODPUT_FRAME_BYTES: usize = 4 << 20;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn code_frame(job: JobId, layer: u16, len: usize) -> CodeFrame {
    CodeFrame::new(
        job,
        LayerCode {
            layer,
            kind: CodeKind::REUSE_K,
            dtype: CodeDType::U8,
            shape: vec![len as u32],
            bytes: vec![0x5a; len],
        },
    )
    .with_translator(scd_types::TranslatorHash::from_bytes([7; 32]))
}

/// A connected pair of our endpoints on loopback.
pub struct OurPair {
    server: Endpoint,
    client: Endpoint,
    to_server: crate::Connection,
    to_client: crate::Connection,
}

impl OurPair {
    /// Two nodes of a fresh cluster, connected.
    pub async fn new(opts: TransportOptions) -> Result<Self, BenchError> {
        let ca = ClusterCa::generate("bench").map_err(err)?;
        let server = Endpoint::bind(
            loopback(),
            &ca.issue("bench-a", Role::Node).map_err(err)?,
            opts.clone(),
        )
        .map_err(err)?;
        let client = Endpoint::bind(
            loopback(),
            &ca.issue("bench-b", Role::Node).map_err(err)?,
            opts,
        )
        .map_err(err)?;
        let addr = server.local_addr().map_err(err)?;
        let s = server.clone();
        let accept = tokio::spawn(async move {
            match s.accept().await {
                Some(a) => a.complete().await.map_err(err),
                None => Err(err("endpoint closed")),
            }
        });
        let to_server = client.connect(addr, "bench-a").await.map_err(err)?;
        let to_client = accept.await.map_err(err)??;
        Ok(Self {
            server,
            client,
            to_server,
            to_client,
        })
    }

    /// Send `total` payload bytes as one job of code frames; returns the wall time from opening
    /// the job until the receiver has read and validated every frame, the same end point as
    /// [`PlainPair::transfer`]. The sender's `finish()` must succeed too, but its confirmation
    /// (one more trip back) is not timed. The frames are built before the clock starts, as the
    /// plain block is: making the data is the application's work, not the transport's.
    pub async fn transfer(&self, job: u128, total: usize) -> Result<Duration, BenchError> {
        let mut frames = vec![];
        let mut built = 0usize;
        while built < total {
            let n = (total - built).min(GOODPUT_FRAME_BYTES);
            frames.push(code_frame(JobId::from_u128(job), frames.len() as u16, n));
            built += n;
        }
        let start = Instant::now();
        let mut tx = self
            .to_server
            .open_job(JobId::from_u128(job), TraceContext::new())
            .await
            .map_err(err)?;
        let conn = self.to_client.clone();
        let receiver = tokio::spawn(async move {
            let mut rx = conn.accept_job().await.map_err(err)?;
            let mut got = 0usize;
            // Read frames in place, as a consumer that copies payloads straight into its
            // tensors would.
            while let Some(frame) = rx.next_frame().await.map_err(err)? {
                if let crate::wire::ArchivedMessage::Code(f) = frame.archived() {
                    got += f.code.bytes.len();
                }
            }
            Ok::<(usize, Instant), BenchError>((got, Instant::now()))
        });
        for frame in frames {
            tx.send(frame).await.map_err(err)?;
        }
        tx.finish().await.map_err(err)?;
        let (got, end) = receiver.await.map_err(err)??;
        if got != total {
            return Err(err(format!("received {got} of {total} bytes")));
        }
        Ok(end - start)
    }

    /// Close both endpoints.
    pub fn close(&self) {
        self.client.close();
        self.server.close();
    }
}

/// A connected pair of plain quinn endpoints on the same terms as [`OurPair`]: the same
/// transport config and mutual TLS (see the module doc).
pub struct PlainPair {
    server: quinn::Endpoint,
    client: quinn::Endpoint,
    to_server: quinn::Connection,
    to_client: quinn::Connection,
}

impl PlainPair {
    /// Two plain quinn endpoints with `opts`' transport config and certificates from a fresh
    /// cluster CA, connected.
    pub async fn new(opts: &TransportOptions) -> Result<Self, BenchError> {
        let ca = ClusterCa::generate("plain").map_err(err)?;
        let server_id = ca.issue("plain-a", Role::Node).map_err(err)?;
        let client_id = ca.issue("plain-b", Role::Node).map_err(err)?;
        let alpn = b"plain".to_vec();
        let server_cfg =
            crate::tls::server_config(&server_id, alpn.clone(), opts.quinn_transport())
                .map_err(err)?;
        let server = quinn::Endpoint::server(server_cfg, loopback()).map_err(err)?;
        let mut client = quinn::Endpoint::client(loopback()).map_err(err)?;
        client.set_default_client_config(
            crate::tls::client_config(&client_id, alpn, opts.quinn_transport()).map_err(err)?,
        );
        let addr = server.local_addr().map_err(err)?;
        let s = server.clone();
        let accept = tokio::spawn(async move {
            match s.accept().await {
                Some(i) => i.await.map_err(err),
                None => Err(err("endpoint closed")),
            }
        });
        let to_server = client
            .connect(addr, "plain-a")
            .map_err(err)?
            .await
            .map_err(err)?;
        let to_client = accept.await.map_err(err)??;
        Ok(Self {
            server,
            client,
            to_server,
            to_client,
        })
    }

    /// Send `total` bytes on one stream; returns the time until the receiver has read them all.
    /// The data block is made before the clock starts and handed to quinn without a copy. (A
    /// bidirectional stream: our transport config, like the job streams, allows no
    /// unidirectional ones.)
    pub async fn transfer(&self, total: usize) -> Result<Duration, BenchError> {
        let block = Bytes::from(vec![0x5au8; GOODPUT_FRAME_BYTES.min(total)]);
        let start = Instant::now();
        let conn = self.to_client.clone();
        let receiver = tokio::spawn(async move {
            let (_back, mut recv) = conn.accept_bi().await.map_err(err)?;
            let mut got = 0usize;
            while let Some(chunk) = recv.read_chunk(usize::MAX, true).await.map_err(err)? {
                got += chunk.bytes.len();
            }
            Ok::<(usize, Instant), BenchError>((got, Instant::now()))
        });
        let (mut send, _recv) = self.to_server.open_bi().await.map_err(err)?;
        let mut sent = 0;
        while sent < total {
            let n = (total - sent).min(block.len());
            send.write_chunk(block.slice(..n)).await.map_err(err)?;
            sent += n;
        }
        send.finish().map_err(err)?;
        let (got, end) = receiver.await.map_err(err)??;
        if got != total {
            return Err(err(format!("received {got} of {total} bytes")));
        }
        Ok(end - start)
    }

    /// Close both endpoints.
    pub fn close(&self) {
        self.client.close(0u32.into(), b"");
        self.server.close(0u32.into(), b"");
    }
}

/// One goodput comparison row.
#[derive(Debug, Clone, Copy)]
pub struct GoodputRow {
    /// Transfer size in bytes.
    pub bytes: usize,
    /// Our job streams, best of the runs, bytes per second.
    pub ours_bps: f64,
    /// Plain quinn, best of the runs, bytes per second.
    pub plain_bps: f64,
}

/// Small transfers are repeated until each side has moved at least this much: a 1 MB transfer
/// takes about a millisecond here, and three of them are too few to get past scheduling noise.
pub const GOODPUT_MIN_BYTES_PER_SIZE: usize = 32 << 20;

/// Transfers per side for one size: `runs`, or more for small sizes (see
/// [`GOODPUT_MIN_BYTES_PER_SIZE`]).
pub fn goodput_repetitions(bytes: usize, runs: usize) -> usize {
    runs.max(1)
        .max(GOODPUT_MIN_BYTES_PER_SIZE.div_ceil(bytes.max(1)))
}

/// Goodput for each size, ours and plain quinn alternating, best of
/// [`goodput_repetitions`] transfers each.
pub async fn goodput(sizes: &[usize], runs: usize) -> Result<Vec<GoodputRow>, BenchError> {
    let opts = TransportOptions::default();
    let ours = OurPair::new(opts.clone()).await?;
    let plain = PlainPair::new(&opts).await?;
    // Warm both connections up (congestion windows, allocator).
    ours.transfer(u128::MAX, 8 << 20).await?;
    plain.transfer(8 << 20).await?;
    let mut rows = vec![];
    let mut job = 0u128;
    for &bytes in sizes {
        let (mut best_ours, mut best_plain) = (Duration::MAX, Duration::MAX);
        for _ in 0..goodput_repetitions(bytes, runs) {
            job += 1;
            best_ours = best_ours.min(ours.transfer(job, bytes).await?);
            best_plain = best_plain.min(plain.transfer(bytes).await?);
        }
        rows.push(GoodputRow {
            bytes,
            ours_bps: bytes as f64 / best_ours.as_secs_f64(),
            plain_bps: bytes as f64 / best_plain.as_secs_f64(),
        });
    }
    ours.close();
    plain.close();
    Ok(rows)
}

/// Frame codec throughput for one payload size, in payload bytes per second.
#[derive(Debug, Clone, Copy)]
pub struct CodecRow {
    /// Payload bytes per frame.
    pub payload: usize,
    /// Encode into a reused aligned buffer, then validate the archive (bytecheck).
    pub encode_validate_bps: f64,
    /// The same plus deserialising into an owned frame (what a receiver does).
    pub full_decode_bps: f64,
}

/// Measure encode + validate, and encode + validate + deserialise, for `payload` bytes.
pub fn codec_throughput(payload: usize, min_time: Duration) -> Result<CodecRow, BenchError> {
    let msg = Message::Code(code_frame(JobId::from_u128(1), 0, payload));
    let max = u32::MAX;
    let mut buf = FrameBuf::new();
    let time = |full: bool, buf: &mut FrameBuf| -> Result<f64, BenchError> {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < min_time || n < 3 {
            codec::encode_into(&msg, max, buf).map_err(err)?;
            let header = codec::check(buf, max).map_err(err)?;
            let body = &buf[codec::HEADER_LEN..header.frame_len()];
            if full {
                std::hint::black_box(codec::decode_body(body).map_err(err)?);
            } else {
                std::hint::black_box(codec::access_body(body).map_err(err)?);
            }
            n += 1;
        }
        Ok(n as f64 * payload as f64 / start.elapsed().as_secs_f64())
    };
    let encode_validate_bps = time(false, &mut buf)?;
    let full_decode_bps = time(true, &mut buf)?;
    Ok(CodecRow {
        payload,
        encode_validate_bps,
        full_decode_bps,
    })
}

/// The receive side's frame reading for one payload size, in payload bytes per second.
#[derive(Debug, Clone, Copy)]
pub struct ReadRow {
    /// Payload bytes per frame.
    pub payload: usize,
    /// [`FrameReader`](crate::framing::FrameReader): the body buffer grows with the bytes
    /// received, then the frame is validated.
    pub growing_bps: f64,
    /// The same bytes copied into one buffer reserved at the declared length up front (the
    /// reader before the receive budget), then validated.
    pub reserved_bps: f64,
}

/// An in-memory stream handed out as quinn hands out a stream's data: 1200-byte chunks, up to
/// 64 KiB per read.
struct QuicLikeChunks<'a>(&'a [u8]);

impl tokio::io::AsyncRead for QuicLikeChunks<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let mut n = 0;
        while n < 64 << 10 && buf.remaining() > 0 && !self.0.is_empty() {
            let k = 1200.min(buf.remaining()).min(self.0.len());
            buf.put_slice(&self.0[..k]);
            self.0 = &self.0[k..];
            n += k;
        }
        std::task::Poll::Ready(Ok(()))
    }
}

/// Measure reading one code frame of `payload` bytes from quinn-like chunks into a validated
/// frame: the frame reader as it is, and a buffer reserved at the declared length as before.
pub fn read_throughput(payload: usize, min_time: Duration) -> Result<ReadRow, BenchError> {
    use std::future::Future;
    let msg = Message::Code(code_frame(JobId::from_u128(1), 0, payload));
    let frame = codec::encode(&msg, u32::MAX).map_err(err)?;
    let growing = || {
        let mut src = QuicLikeChunks(&frame);
        let mut reader = crate::framing::FrameReader::new(u32::MAX, None);
        let next = std::pin::pin!(reader.next(&mut src));
        // An in-memory stream never makes the reader wait: one poll finishes it.
        match next.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Ready(Ok(Some(f))) => {
                std::hint::black_box(f.archived());
                Ok(())
            }
            other => Err(err(format!("frame reader: {other:?}"))),
        }
    };
    let reserved = || {
        let header = codec::check_header(&frame, u32::MAX).map_err(err)?;
        let mut body = FrameBuf::with_capacity(header.body_len as usize);
        for chunk in frame[codec::HEADER_LEN..].chunks(1200) {
            body.extend_from_slice(chunk);
        }
        let f = codec::ValidatedFrame::new(body).map_err(err)?;
        std::hint::black_box(f.archived());
        Ok(())
    };
    // Alternating halves, so that drift in the machine's load hits both alike.
    let half = min_time / 2;
    let (mut g, mut r) = (0.0, 0.0);
    for _ in 0..2 {
        g += rate(payload, half, &growing)? / 2.0;
        r += rate(payload, half, &reserved)? / 2.0;
    }
    Ok(ReadRow {
        payload,
        growing_bps: g,
        reserved_bps: r,
    })
}

/// Payload bytes per second of `read`, run for at least `min_time` (and three times).
fn rate(
    payload: usize,
    min_time: Duration,
    read: &dyn Fn() -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < min_time || n < 3 {
        read()?;
        n += 1;
    }
    Ok(n as f64 * payload as f64 / start.elapsed().as_secs_f64())
}

/// One pacing accuracy row.
#[derive(Debug, Clone, Copy)]
pub struct PacingRow {
    /// The set rate, bits per second.
    pub set_bps: u64,
    /// The achieved rate of frame bytes at the receiver, bits per second.
    pub achieved_bps: f64,
}

/// Send about `duration` worth of data at `rate_bps` over a paced loopback connection and
/// measure the rate the receiver sees (the initial burst excluded).
pub async fn pacing_accuracy(rate_bps: u64, duration: Duration) -> Result<PacingRow, BenchError> {
    let pacing = PacingOptions::rate(rate_bps);
    let opts = TransportOptions {
        pacing: Some(pacing),
        ..TransportOptions::default()
    };
    let pair = OurPair::new(opts).await?;
    let total = ((rate_bps as f64 / 8.0) * duration.as_secs_f64()) as usize;
    let frame = (total / 64).clamp(4 << 10, 1 << 20);
    let job = JobId::from_u128(1);
    let conn = pair.to_client.clone();
    let receiver = tokio::spawn(async move {
        let mut rx = conn.accept_job().await.map_err(err)?;
        // Time from the end of the first frame, which the burst may have carried early.
        let mut first: Option<(Instant, u64)> = None;
        while let Some(_m) = rx.next().await.map_err(err)? {
            if first.is_none() {
                first = Some((Instant::now(), rx.bytes()));
            }
        }
        let (t0, b0) = first.ok_or_else(|| err("no frames"))?;
        Ok::<f64, BenchError>((rx.bytes() - b0) as f64 * 8.0 / t0.elapsed().as_secs_f64())
    });
    let mut tx = pair
        .to_server
        .open_job(job, TraceContext::new())
        .await
        .map_err(err)?;
    let mut sent = 0;
    let mut layer = 0;
    while sent < total {
        tx.send(code_frame(job, layer, frame)).await.map_err(err)?;
        sent += frame;
        layer += 1;
    }
    tx.finish().await.map_err(err)?;
    let achieved_bps = receiver.await.map_err(err)??;
    pair.close();
    Ok(PacingRow {
        set_bps: rate_bps,
        achieved_bps,
    })
}

/// What `scd bench transport` runs.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// Transfer sizes in bytes for the goodput comparison.
    pub sizes: Vec<usize>,
    /// Runs per size (the best is reported); small sizes get more, see
    /// [`goodput_repetitions`].
    pub runs: usize,
    /// Payload sizes for the codec benchmark.
    pub codec_payloads: Vec<usize>,
    /// Pacing rates in bits per second.
    pub pacing_rates: Vec<u64>,
    /// Traffic per pacing rate.
    pub pacing_time: Duration,
}

impl Default for ReportOptions {
    fn default() -> Self {
        Self {
            sizes: vec![1 << 20, 4 << 20, 16 << 20, 64 << 20],
            runs: 3,
            codec_payloads: vec![64 << 10, 1 << 20, 16 << 20],
            pacing_rates: vec![10_000_000, 100_000_000, 1_000_000_000],
            pacing_time: Duration::from_secs(2),
        }
    }
}

/// Run every transport benchmark and print Markdown tables to stdout.
pub async fn report(opts: &ReportOptions) -> Result<(), BenchError> {
    println!(
        "## goodput on loopback (best of {} runs; small sizes repeated until {} MB moved)",
        opts.runs,
        GOODPUT_MIN_BYTES_PER_SIZE >> 20
    );
    println!(
        "| size | scd job stream | plain quinn (same windows, mutual TLS, no-copy send) | ratio |"
    );
    println!("|---:|---:|---:|---:|");
    for row in goodput(&opts.sizes, opts.runs).await? {
        println!(
            "| {} MB | {:.0} MB/s | {:.0} MB/s | {:.0}% |",
            row.bytes >> 20,
            row.ours_bps / 1e6,
            row.plain_bps / 1e6,
            100.0 * row.ours_bps / row.plain_bps
        );
    }
    if !opts.codec_payloads.is_empty() {
        codec_report(&opts.codec_payloads)?;
        read_report(&opts.codec_payloads)?;
    }
    if !opts.pacing_rates.is_empty() {
        pacing_report(&opts.pacing_rates, opts.pacing_time).await?;
    }
    Ok(())
}

fn codec_report(payloads: &[usize]) -> Result<(), BenchError> {
    println!("\n## frame codec (payload bytes per second)");
    println!("| payload | encode + validate | encode + validate + deserialise |");
    println!("|---:|---:|---:|");
    for &payload in payloads {
        let row = codec_throughput(payload, Duration::from_millis(500))?;
        println!(
            "| {} KiB | {:.2} GB/s | {:.2} GB/s |",
            payload >> 10,
            row.encode_validate_bps / 1e9,
            row.full_decode_bps / 1e9
        );
    }
    Ok(())
}

fn read_report(payloads: &[usize]) -> Result<(), BenchError> {
    println!("\n## frame reading, quinn-like 1.2 KB chunks -> validated frame (payload bytes per second)");
    println!(
        "| payload | growing buffer (now) | buffer reserved at the declared length (before) |"
    );
    println!("|---:|---:|---:|");
    for &payload in payloads {
        let row = read_throughput(payload, Duration::from_millis(500))?;
        println!(
            "| {} KiB | {:.2} GB/s | {:.2} GB/s |",
            payload >> 10,
            row.growing_bps / 1e9,
            row.reserved_bps / 1e9
        );
    }
    Ok(())
}

async fn pacing_report(rates: &[u64], time: Duration) -> Result<(), BenchError> {
    println!("\n## pacing accuracy over loopback QUIC");
    println!("| set | achieved | error |");
    println!("|---:|---:|---:|");
    for &rate in rates {
        let row = pacing_accuracy(rate, time).await?;
        println!(
            "| {} Mbit/s | {:.1} Mbit/s | {:+.2}% |",
            rate / 1_000_000,
            row.achieved_bps / 1e6,
            100.0 * (row.achieved_bps / rate as f64 - 1.0)
        );
    }
    Ok(())
}
