//! Real QUIC on loopback: mutual TLS, version negotiation, job streams, backpressure,
//! cancellation and dead peers. Every test checks that no job task is left behind.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use scd_transport::pacing::PacingOptions;
use scd_transport::{
    AcceptError, ClusterCa, CodeDType, CodeFrame, CodeKind, ConnectError, Connection, Control,
    Endpoint, Identity, JobId, JobReceiver, JobState, LayerCode, Message, RecvError, Role,
    SendError, TraceContext, TranslatorHash, TransportOptions,
};

use common::{local, open_raw_job, raw_client, serve_as_node_a};

fn jid(n: u128) -> JobId {
    JobId::from_u128(n)
}

fn no_trace() -> TraceContext {
    TraceContext::new()
}

fn frame(job: JobId, layer: u16, kind: CodeKind, len: usize) -> CodeFrame {
    CodeFrame::new(
        job,
        LayerCode {
            layer,
            kind,
            dtype: CodeDType::U8,
            shape: vec![len as u32],
            bytes: (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(layer as u8))
                .collect(),
        },
    )
    .with_translator(TranslatorHash::from_bytes([layer as u8; 32]))
}

struct Pair {
    server: Endpoint,
    client: Endpoint,
    /// The client's connection to the server.
    to_server: Connection,
    /// The server's side of the same connection.
    to_client: Connection,
}

async fn pair_with(
    ca: &ClusterCa,
    server_opts: TransportOptions,
    client_opts: TransportOptions,
) -> Pair {
    let server = serve_as_node_a(ca, server_opts);
    let client = Endpoint::bind(
        local(),
        &ca.issue("node-b", Role::Node).unwrap(),
        client_opts,
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let to_server = client.connect(addr, "node-a").await.unwrap();
    let to_client = accept.await.unwrap().unwrap();
    Pair {
        server,
        client,
        to_server,
        to_client,
    }
}

async fn pair() -> Pair {
    pair_with(
        &ClusterCa::generate("test").unwrap(),
        TransportOptions::default(),
        TransportOptions::default(),
    )
    .await
}

/// Wait (bounded) until the endpoint's job tasks have all ended.
async fn no_tasks_left(ep: &Endpoint) {
    for _ in 0..1000 {
        if ep.live_tasks() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} job tasks still running", ep.live_tasks());
}

async fn expect_client_refused(
    client_id: &Identity,
    server_ca: &ClusterCa,
) -> (ConnectError, AcceptError) {
    let server = serve_as_node_a(server_ca, TransportOptions::default());
    let client = Endpoint::client(local(), client_id, TransportOptions::default()).unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let c = client.connect(addr, "node-a").await.unwrap_err();
    let s = accept.await.unwrap().unwrap_err();
    (c, s)
}

#[tokio::test]
async fn identities_and_a_job_round_trip_in_order() {
    let p = pair().await;
    assert_eq!(p.to_server.peer().name, "node-a");
    assert_eq!(p.to_client.peer().name, "node-b");
    assert_eq!(p.to_client.peer().role, Role::Node);

    let job = jid(0xabc);
    let mut trace = TraceContext::new();
    trace
        .insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .unwrap();
    let frames: Vec<CodeFrame> = (0..6u16)
        .flat_map(|l| {
            [
                frame(job, l, CodeKind::REUSE_K, 10_000 + l as usize),
                frame(job, l, CodeKind::REUSE_V, 777),
            ]
        })
        .collect();
    let mut tx = p.to_server.open_job(job, trace.clone()).await.unwrap();
    let expected = frames.clone();
    let sender = tokio::spawn(async move {
        for f in frames {
            tx.send(f).await.unwrap();
        }
        tx.finish().await
    });
    let mut rx = p.to_client.accept_job().await.unwrap();
    assert_eq!(rx.job_id(), job);
    assert_eq!(rx.trace(), &trace);
    assert_eq!(rx.peer().name, "node-b");
    let mut got = vec![];
    while let Some(m) = rx.next().await.unwrap() {
        match m {
            Message::Code(f) => got.push(f),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, expected);
    let report = sender.await.unwrap().unwrap();
    assert_eq!(report.frames, 13);
    assert_eq!(report.bytes, rx.bytes());
    assert!(matches!(rx.next().await, Err(RecvError::Ended)));
    no_tasks_left(&p.client).await;
    no_tasks_left(&p.server).await;
}

#[tokio::test]
async fn many_concurrent_jobs_on_one_connection() {
    let p = pair().await;
    let mut senders = vec![];
    for j in 0..8u128 {
        let conn = p.to_server.clone();
        senders.push(tokio::spawn(async move {
            let mut tx = conn.open_job(jid(j), no_trace()).await.unwrap();
            for l in 0..4 {
                tx.send(frame(jid(j), l, CodeKind::PATCH_H, 50_000))
                    .await
                    .unwrap();
            }
            tx.finish().await.unwrap()
        }));
    }
    let mut receivers = vec![];
    for _ in 0..8 {
        let mut rx = p.to_client.accept_job().await.unwrap();
        receivers.push(tokio::spawn(async move {
            let mut layers = vec![];
            while let Some(Message::Code(f)) = rx.next().await.unwrap() {
                assert_eq!(f.job_id, rx.job_id());
                let layer = f.code.layer;
                assert_eq!(f, frame(rx.job_id(), layer, CodeKind::PATCH_H, 50_000));
                layers.push(layer);
            }
            layers
        }));
    }
    for r in receivers {
        assert_eq!(r.await.unwrap(), vec![0, 1, 2, 3]);
    }
    for s in senders {
        s.await.unwrap();
    }
    no_tasks_left(&p.client).await;
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_at_the_handshake() {
    let ours = ClusterCa::generate("ours").unwrap();
    let theirs = ClusterCa::generate("theirs").unwrap();
    let stranger = theirs.issue("node-x", Role::Node).unwrap();
    let (client_err, server_err) = expect_client_refused(&stranger, &ours).await;
    // The stranger's CA does not sign our server either, so the client may notice first;
    // either way both sides fail in the handshake with a certificate error.
    assert!(
        matches!(
            client_err,
            ConnectError::Refused { .. } | ConnectError::UntrustedPeer { .. }
        ),
        "{client_err}"
    );
    assert!(
        matches!(
            server_err,
            AcceptError::UntrustedPeer { .. } | AcceptError::Failed { .. }
        ),
        "{server_err}"
    );

    // A client whose own certificate is foreign but who trusts our CA: only the server refuses.
    let mut forged = stranger.clone();
    forged.ca = ours.issue("node-y", Role::Node).unwrap().ca;
    let (client_err, server_err) = expect_client_refused(&forged, &ours).await;
    assert!(
        matches!(client_err, ConnectError::Refused { .. }),
        "{client_err}"
    );
    assert!(
        client_err.to_string().contains("refused our certificate"),
        "{client_err}"
    );
    assert!(
        matches!(server_err, AcceptError::UntrustedPeer { .. }),
        "{server_err}"
    );
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    use quinn::crypto::rustls::QuicClientConfig;
    let ca = ClusterCa::generate("test").unwrap();
    let server = serve_as_node_a(&ca, TransportOptions::default());
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.issue("node-z", Role::Node).unwrap().ca)
        .unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tls.alpn_protocols = vec![format!("scd/{}", scd_transport::PROTOCOL_VERSION).into_bytes()];
    let mut client = quinn::Endpoint::client(local()).unwrap();
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls).unwrap(),
    )));
    // The TLS 1.3 client may finish its half of the handshake; the server never accepts it.
    if let Ok(conn) = client.connect(addr, "node-a").unwrap().await {
        let err = conn.closed().await;
        assert!(err.to_string().contains("certificate"), "{err}");
    }
    let err = accept.await.unwrap().unwrap_err();
    assert!(matches!(err, AcceptError::UntrustedPeer { .. }), "{err}");
}

#[tokio::test]
async fn another_protocol_version_fails_with_a_clear_error() {
    let ca = ClusterCa::generate("test").unwrap();
    let server = serve_as_node_a(&ca, TransportOptions::default());
    let next = scd_transport::PROTOCOL_VERSION + 1;
    let future = TransportOptions {
        protocol_version: next,
        ..TransportOptions::default()
    };
    let client = Endpoint::bind(local(), &ca.issue("node-b", Role::Node).unwrap(), future).unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let err = client.connect(addr, "node-a").await.unwrap_err();
    assert!(
        matches!(err, ConnectError::VersionMismatch { ours, .. } if ours == next),
        "{err}"
    );
    assert!(err.to_string().contains("protocol version mismatch"));
    let err = accept.await.unwrap().unwrap_err();
    assert!(
        matches!(err, AcceptError::VersionMismatch { ours, .. } if ours == scd_transport::PROTOCOL_VERSION),
        "{err}"
    );
}

#[tokio::test]
async fn admin_certificates_connect_but_cannot_serve() {
    let ca = ClusterCa::generate("test").unwrap();
    let admin = ca.issue("ops", Role::Admin).unwrap();
    assert!(matches!(
        Endpoint::bind(local(), &admin, TransportOptions::default()),
        Err(scd_transport::BindError::CannotServe(Role::Admin))
    ));
    let server = serve_as_node_a(&ca, TransportOptions::default());
    let client = Endpoint::client(local(), &admin, TransportOptions::default()).unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let conn = client.connect(addr, "node-a").await.unwrap();
    let at_server = accept.await.unwrap().unwrap();
    assert_eq!(conn.peer().role, Role::Node);
    assert_eq!(at_server.peer().name, "ops");
    assert_eq!(at_server.peer().role, Role::Admin);
    // Connecting under a name the server's certificate does not carry fails.
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let err = client.connect(addr, "node-q").await.unwrap_err();
    assert!(matches!(err, ConnectError::UntrustedPeer { .. }), "{err}");
    assert!(accept.await.unwrap().is_err());
}

#[tokio::test]
async fn an_admin_call_carries_one_request_and_the_replies_in_order() {
    let ca = ClusterCa::generate("test").unwrap();
    let admin = ca.issue("ops", Role::Admin).unwrap();
    let server = serve_as_node_a(&ca, TransportOptions::default());
    let client = Endpoint::client(local(), &admin, TransportOptions::default()).unwrap();
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let node = tokio::spawn(async move {
        let conn = s.accept().await.unwrap().complete().await.unwrap();
        let call = conn.accept_admin().await.unwrap();
        let job_id = call.request.job_id().unwrap();
        assert_eq!(call.request, Control::Watch { job_id });
        let mut replies = call.replies;
        for (i, piece) in ["Call", " me", " Ishmael"].into_iter().enumerate() {
            let tokens = vec![i as u32];
            let text = piece.to_owned();
            replies
                .send(Control::Tokens {
                    job_id,
                    tokens,
                    text,
                })
                .await
                .unwrap();
        }
        replies.finish();
        conn
    });
    let conn = client.connect(addr, "node-a").await.unwrap();
    let job_id = jid(7);
    let mut call = conn.call_admin(Control::Watch { job_id }).await.unwrap();
    let mut text = String::new();
    while let Some(reply) = call.next().await.unwrap() {
        match reply {
            Control::Tokens {
                job_id: j, text: t, ..
            } if j == job_id => text.push_str(&t),
            other => panic!("unexpected reply {other:?}"),
        }
    }
    assert_eq!(text, "Call me Ishmael");
    drop(node.await.unwrap());
}

#[tokio::test]
async fn a_slow_receiver_slows_the_sender_with_bounded_memory() {
    let opts = TransportOptions {
        send_queue_frames: 4,
        ..TransportOptions::default()
    };
    let stream_window = opts.link.stream_window();
    let p = pair_with(&ClusterCa::generate("t").unwrap(), opts.clone(), opts).await;
    const FRAME: usize = 256 << 10;
    const FRAMES: u16 = 64; // 16 MiB in all, well over window + queue
    let job = jid(1);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let max_queued = Arc::new(AtomicU64::new(0));
    let (a, q) = (accepted.clone(), max_queued.clone());
    let sender = tokio::spawn(async move {
        for l in 0..FRAMES {
            tx.send(frame(job, l, CodeKind::RAW_K, FRAME))
                .await
                .unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            q.fetch_max(tx.queued_frames() as u64, Ordering::SeqCst);
        }
        tx.finish().await.unwrap()
    });
    let mut rx = p.to_client.accept_job().await.unwrap();
    // Give the sender every chance to run ahead; the bound below holds however long we wait.
    let mut last = u64::MAX;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = accepted.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
    }
    let frame_bytes = (FRAME + 200) as u64;
    let bound = stream_window / frame_bytes + 4 /* queue */ + 2 /* in the writer, in send() */;
    let ahead = accepted.load(Ordering::SeqCst);
    assert!(
        ahead <= bound,
        "sender ran {ahead} frames ahead of a receiver that reads nothing (bound {bound})"
    );
    assert!(ahead < u64::from(FRAMES));
    assert!(max_queued.load(Ordering::SeqCst) <= 4);
    // Now drain: everything arrives, in order.
    let mut n = 0;
    while let Some(Message::Code(f)) = rx.next().await.unwrap() {
        assert_eq!(f.code.layer, n);
        n += 1;
    }
    assert_eq!(n, FRAMES);
    sender.await.unwrap();
    no_tasks_left(&p.client).await;
}

async fn recv_all(rx: &mut JobReceiver) -> Result<usize, RecvError> {
    let mut n = 0;
    while rx.next().await?.is_some() {
        n += 1;
    }
    Ok(n)
}

#[tokio::test]
async fn the_sender_cancels_mid_job() {
    let p = pair().await;
    let job = jid(2);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 0, CodeKind::RAW_K, 1000)).await.unwrap();
    let mut rx = p.to_client.accept_job().await.unwrap();
    assert!(matches!(rx.next().await.unwrap(), Some(Message::Code(_))));
    tx.cancel().await;
    let err = recv_all(&mut rx).await.unwrap_err();
    assert_eq!(err, RecvError::CancelledByPeer { reason: None });
    no_tasks_left(&p.client).await;
}

#[tokio::test]
async fn dropping_a_sender_cancels_its_job() {
    let p = pair().await;
    let job = jid(3);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 0, CodeKind::RAW_K, 1000)).await.unwrap();
    let mut rx = p.to_client.accept_job().await.unwrap();
    drop(tx);
    let err = recv_all(&mut rx).await.unwrap_err();
    assert_eq!(err, RecvError::CancelledByPeer { reason: None });
    no_tasks_left(&p.client).await;
}

#[tokio::test]
async fn the_receiver_cancels_mid_job_with_a_reason() {
    let p = pair().await;
    let job = jid(4);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let rx = p.to_client.accept_job().await.unwrap();
    rx.cancel("expert unloaded").await;
    // The sender learns on its next send or at finish, whichever comes first.
    let mut result = Ok(());
    for l in 0..1000 {
        result = tx.send(frame(job, l, CodeKind::RAW_K, 64 << 10)).await;
        if result.is_err() {
            break;
        }
    }
    let err = match result {
        Err(e) => e,
        Ok(()) => tx.finish().await.unwrap_err(),
    };
    assert_eq!(
        err,
        SendError::CancelledByPeer {
            reason: Some("expert unloaded".into())
        }
    );
    no_tasks_left(&p.client).await;
}

#[tokio::test]
async fn status_reports_reach_the_sender_without_ending_the_job() {
    let p = pair().await;
    let job = jid(5);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let mut rx = p.to_client.accept_job().await.unwrap();
    rx.report(Control::JobStatus {
        job_id: job,
        state: JobState::Decoding,
        detail: "rebuilding".into(),
    })
    .await
    .unwrap();
    tx.send(frame(job, 0, CodeKind::HIDDEN, 10)).await.unwrap();
    let sender = tokio::spawn(tx.finish());
    assert_eq!(recv_all(&mut rx).await.unwrap(), 1);
    sender.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_sender_refuses_frames_that_break_the_rules() {
    let p = pair().await;
    let job = jid(6);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 3, CodeKind::REUSE_K, 10)).await.unwrap();
    assert!(matches!(
        tx.send(frame(job, 2, CodeKind::REUSE_K, 10)).await,
        Err(SendError::Protocol(_))
    ));
    assert!(matches!(
        tx.send(frame(jid(7), 4, CodeKind::REUSE_K, 10)).await,
        Err(SendError::Protocol(_))
    ));
    // The job goes on after a refused frame.
    tx.send(frame(job, 4, CodeKind::REUSE_K, 10)).await.unwrap();
    let sender = tokio::spawn(tx.finish());
    let mut rx = p.to_client.accept_job().await.unwrap();
    assert_eq!(recv_all(&mut rx).await.unwrap(), 2);
    sender.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_per_job_byte_cap_is_enforced() {
    let opts = TransportOptions {
        max_job_bytes: 100_000,
        ..TransportOptions::default()
    };
    let p = pair_with(&ClusterCa::generate("t").unwrap(), opts.clone(), opts).await;
    let job = jid(8);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 0, CodeKind::RAW_K, 60_000))
        .await
        .unwrap();
    let err = tx
        .send(frame(job, 1, CodeKind::RAW_K, 60_000))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SendError::Protocol(scd_transport::session::ProtocolViolation::JobTooLarge { .. })
        ),
        "{err}"
    );
    tx.cancel().await;
    no_tasks_left(&p.client).await;
}

#[tokio::test]
async fn closing_the_peer_endpoint_mid_job_ends_the_job_on_both_sides() {
    let p = pair().await;
    let job = jid(9);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 0, CodeKind::RAW_K, 1000)).await.unwrap();
    let mut rx = p.to_client.accept_job().await.unwrap();
    assert!(rx.next().await.unwrap().is_some());
    p.server.close();
    let err = recv_all(&mut rx).await.unwrap_err();
    assert_eq!(err, RecvError::ConnectionClosed);
    // The sender's side sees its peer gone, on the next send or at finish.
    let mut result = Ok(());
    for l in 1..1000 {
        result = tx.send(frame(job, l, CodeKind::RAW_K, 64 << 10)).await;
        if result.is_err() {
            break;
        }
    }
    let err = match result {
        Err(e) => e,
        Ok(()) => tx.finish().await.unwrap_err(),
    };
    assert!(matches!(err, SendError::PeerGone(_)), "{err}");
    no_tasks_left(&p.client).await;
    no_tasks_left(&p.server).await;
}

#[test]
fn a_dead_peer_ends_its_jobs_by_idle_timeout() {
    let opts = TransportOptions {
        idle_timeout: Duration::from_millis(800),
        keep_alive: Duration::from_millis(200),
        ..TransportOptions::default()
    };
    let ca = ClusterCa::generate("t").unwrap();
    // The receiving node runs on a runtime of its own that we then shut down: its socket goes
    // silent without a close frame, like a killed process.
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server_id = ca.issue("node-a", Role::Node).unwrap();
    let (server, addr) = doomed.block_on(async {
        let server = Endpoint::bind(local(), &server_id, opts.clone()).unwrap();
        let addr = server.local_addr().unwrap();
        (server, addr)
    });
    let s = server.clone();
    let accept = doomed.spawn(async move {
        let conn = s.accept().await.unwrap().complete().await.unwrap();
        let mut rx = conn.accept_job().await.unwrap();
        rx.next().await.unwrap();
        // Hold the job open until the runtime dies.
        std::future::pending::<()>().await
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client =
            Endpoint::bind(local(), &ca.issue("node-b", Role::Node).unwrap(), opts).unwrap();
        let conn = client.connect(addr, "node-a").await.unwrap();
        let job = jid(10);
        let mut tx = conn.open_job(job, no_trace()).await.unwrap();
        tx.send(frame(job, 0, CodeKind::RAW_K, 100)).await.unwrap();
        // Let the frame reach the receiver before it dies.
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(accept);
        doomed.shutdown_background();
        drop(server);
        let err = tx.finish().await.unwrap_err();
        assert!(
            matches!(err, SendError::PeerGone(ref m) if m.contains("timed out")),
            "{err}"
        );
        no_tasks_left(&client).await;
    });
}

#[tokio::test]
async fn a_paced_connection_delivers_every_byte() {
    let opts = TransportOptions {
        pacing: Some(PacingOptions::rate(200_000_000)),
        ..TransportOptions::default()
    };
    let p = pair_with(&ClusterCa::generate("t").unwrap(), opts.clone(), opts).await;
    let job = jid(11);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let sender = tokio::spawn(async move {
        for l in 0..4 {
            tx.send(frame(job, l, CodeKind::QUANT_K, 100_000))
                .await
                .unwrap();
        }
        tx.finish().await.unwrap()
    });
    let mut rx = p.to_client.accept_job().await.unwrap();
    let mut n = 0;
    while let Some(Message::Code(f)) = rx.next().await.unwrap() {
        assert_eq!(f, frame(job, n, CodeKind::QUANT_K, 100_000));
        n += 1;
    }
    assert_eq!(n, 4);
    sender.await.unwrap();
}

/// A link paced for one peer only, and a producer that sends in bursts with pauses between
/// them (as an encoder does when its prefill is slower than the link): the report's link rate
/// is the paced rate, where bytes over the stream's whole time would be far below it.
#[tokio::test]
async fn the_send_report_measures_a_peers_paced_link_not_the_senders_pauses() {
    const RATE_BPS: u64 = 40_000_000;
    const FRAME: usize = 200_000;
    let client_opts = TransportOptions {
        pacing_to: [("node-a".to_string(), PacingOptions::rate(RATE_BPS))].into(),
        ..TransportOptions::default()
    };
    assert_eq!(client_opts.pacing_for("node-b"), None);
    let p = pair_with(
        &ClusterCa::generate("t").unwrap(),
        TransportOptions::default(),
        client_opts,
    )
    .await;
    let job = jid(13);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let started = std::time::Instant::now();
    let sender = tokio::spawn(async move {
        for burst in 0..3u16 {
            for l in 0..3 {
                tx.send(frame(job, burst * 3 + l, CodeKind::QUANT_K, FRAME))
                    .await
                    .unwrap();
            }
            // Longer than the burst takes on the link (3 x 40 ms), so the writer goes idle.
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        tx.finish().await.unwrap()
    });
    let mut rx = p.to_client.accept_job().await.unwrap();
    let mut n = 0;
    while let Some(Message::Code(_)) = rx.next().await.unwrap() {
        n += 1;
    }
    assert_eq!(n, 9);
    let report = sender.await.unwrap();
    let whole = report.bytes as f64 / started.elapsed().as_secs_f64();
    let Some(scd_transport::LinkRate::Measured(link)) = report.link_rate() else {
        panic!("frames queued behind the link: {report:?}")
    };
    let paced = RATE_BPS as f64 / 8.0;
    assert!(
        report.backlogged_bytes >= 6 * FRAME as u64,
        "{report:?}: most frames queue behind the paced link"
    );
    assert!(whole < 0.8 * paced, "pauses count in the whole: {whole}");
    assert!(
        (0.5 * paced..1.25 * paced).contains(&link),
        "link rate {link} B/s for a link paced at {paced} B/s ({report:?})"
    );
}

/// A sender slower than its link never has a frame waiting: the report does not mistake the
/// sender's pace for the link's.
#[tokio::test]
async fn a_sender_slower_than_its_link_is_not_taken_for_the_link() {
    let p = pair().await;
    let job = jid(14);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    let started = std::time::Instant::now();
    let sender = tokio::spawn(async move {
        for l in 0..3 {
            tx.send(frame(job, l, CodeKind::QUANT_K, 100_000))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tx.finish().await.unwrap()
    });
    let mut rx = p.to_client.accept_job().await.unwrap();
    while let Some(Message::Code(_)) = rx.next().await.unwrap() {}
    let report = sender.await.unwrap();
    let sender_pace = report.bytes as f64 / started.elapsed().as_secs_f64();
    assert_eq!(report.backlogged_bytes, 0, "{report:?}");
    let Some(scd_transport::LinkRate::KeptUp(link)) = report.link_rate() else {
        panic!("no frame queued, so the link only kept up: {report:?}")
    };
    assert!(
        link > 4.0 * sender_pace,
        "{link} vs the sender's {sender_pace}"
    );
}

#[tokio::test]
async fn frames_can_be_read_in_place() {
    let p = pair().await;
    let job = jid(12);
    let mut tx = p.to_server.open_job(job, no_trace()).await.unwrap();
    tx.send(frame(job, 5, CodeKind::PATCH_H, 4096))
        .await
        .unwrap();
    let sender = tokio::spawn(tx.finish());
    let mut rx = p.to_client.accept_job().await.unwrap();
    let f = rx.next_frame().await.unwrap().unwrap();
    let scd_transport::wire::ArchivedMessage::Code(code) = f.archived() else {
        panic!("not a code frame")
    };
    assert_eq!(code.code.layer.to_native(), 5);
    assert_eq!(
        code.code.bytes.as_slice(),
        frame(job, 5, CodeKind::PATCH_H, 4096).code.bytes.as_slice()
    );
    assert_eq!(
        f.to_message().unwrap(),
        Message::Code(frame(job, 5, CodeKind::PATCH_H, 4096))
    );
    assert!(rx.next_frame().await.unwrap().is_none());
    sender.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_receiver_rejects_a_bad_frame_from_the_wire() {
    use scd_transport::codec::{self, header_bytes, DecodeError};
    use scd_transport::error_code;
    let ca = ClusterCa::generate("test").unwrap();
    let opts = TransportOptions {
        max_frame_bytes: 1 << 20,
        ..TransportOptions::default()
    };
    let server = serve_as_node_a(&ca, opts);
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let raw = raw_client(&ca, &server).await;
    let conn = accept.await.unwrap().unwrap();

    let job = jid(0x5eed);
    let good = |layer| {
        codec::encode(
            &Message::Code(frame(job, layer, CodeKind::RAW_K, 64)),
            u32::MAX,
        )
        .unwrap()
    };
    let garbage_body = {
        let mut b = header_bytes(64).to_vec();
        b.extend_from_slice(&[0xff; 64]);
        b
    };
    let mut bad_magic = good(1).as_slice().to_vec();
    bad_magic[..4].copy_from_slice(b"XXXX");
    // Announces a body over the cap; nothing follows, the header alone must be refused.
    let oversized = header_bytes((1 << 20) + 1).to_vec();
    let other_job = codec::encode(
        &Message::Code(frame(jid(1), 1, CodeKind::RAW_K, 64)),
        u32::MAX,
    )
    .unwrap();
    let layer_back = good(0);
    // What is sent after a good frame, and the error the receiver must report.
    type Case = (&'static str, Vec<u8>, fn(&RecvError) -> bool);
    let cases: Vec<Case> = vec![
        ("garbage body", garbage_body, |e| {
            matches!(e, RecvError::Decode(DecodeError::Invalid(_)))
        }),
        ("bad magic", bad_magic, |e| {
            matches!(e, RecvError::Decode(DecodeError::BadMagic(_)))
        }),
        ("over the frame cap", oversized, |e| {
            matches!(e, RecvError::Decode(DecodeError::TooLarge { .. }))
        }),
        ("another job's frame", other_job.as_slice().to_vec(), |e| {
            matches!(e, RecvError::Protocol(_))
        }),
        (
            "a layer out of order",
            layer_back.as_slice().to_vec(),
            |e| matches!(e, RecvError::Protocol(_)),
        ),
    ];
    for (what, bad, expected) in cases {
        let (mut send, mut back) = open_raw_job(&raw, job).await;
        send.write_all(&good(1)).await.unwrap();
        send.write_all(&bad).await.unwrap();

        let mut rx = conn.accept_job().await.unwrap();
        assert_eq!(rx.job_id(), job, "{what}");
        assert!(
            matches!(rx.next().await, Ok(Some(Message::Code(_)))),
            "{what}"
        );
        let err = rx.next().await.unwrap_err();
        assert!(expected(&err), "{what}: {err}");
        assert!(matches!(rx.next().await, Err(RecvError::Ended)), "{what}");

        // The sender learns why on the back half, which then ends ...
        let reply = back.read_to_end(1 << 16).await.unwrap();
        match codec::decode(&reply, u32::MAX).unwrap().0 {
            Message::Control(Control::Error { code, job_id, .. }) => {
                assert_eq!(code, error_code::PROTOCOL, "{what}");
                assert_eq!(job_id, Some(job), "{what}");
            }
            other => panic!("{what}: expected an Error frame, got {other:?}"),
        }
        // ... and its own half is stopped: writing more fails with the protocol code.
        let stopped = async {
            loop {
                if let Err(e) = send.write_all(&[0u8; 1024]).await {
                    return e;
                }
            }
        };
        let e = tokio::time::timeout(Duration::from_secs(5), stopped)
            .await
            .unwrap_or_else(|_| panic!("{what}: the receiver did not stop the stream"));
        assert!(
            matches!(e, quinn::WriteError::Stopped(c) if c.into_inner() == u64::from(error_code::PROTOCOL)),
            "{what}: {e}"
        );
    }
    // Only those jobs failed: the connection still carries a good one.
    let (mut send, _back) = open_raw_job(&raw, job).await;
    send.write_all(&good(0)).await.unwrap();
    send.finish().unwrap();
    let mut rx = conn.accept_job().await.unwrap();
    assert_eq!(recv_all(&mut rx).await.unwrap(), 1);
    server.close();
}
