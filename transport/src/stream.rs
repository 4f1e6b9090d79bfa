//! Job streams: one bidirectional QUIC stream per job.
//!
//! The opener ([`JobSender`]) writes an [`Control::Open`] frame and then the job's frames, layer
//! by layer, as the application hands them over; the acceptor ([`JobReceiver`]) yields them as
//! they arrive and may answer on the other half (status, error, cancel).
//!
//! Memory is bounded on both sides: the sender encodes a frame in the caller's task (a large
//! payload is not copied: the frame keeps the payload's buffer and quinn sends from it) and
//! queues it on a bounded channel (`send_queue_frames`) to a writer task, which blocks on QUIC flow
//! control when the receiver is slow, so `send` blocks in turn; the receiver holds at most one
//! frame plus QUIC's stream window. Either side may cancel: the sender resets the stream, the
//! receiver sends a Cancel frame on its half and stops the sender's. A lost connection ends
//! every job on it with [`SendError::PeerGone`] / [`RecvError::PeerGone`] on the side that
//! noticed it and a closed-connection error on the other.

use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionError, ReadError, RecvStream, SendStream, VarInt, WriteError};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::codec::{
    self, check_header, DecodeError, EncodeError, EncodedFrame, FrameBuf, ValidatedFrame,
    HEADER_LEN,
};
use crate::endpoint::{Connection, TaskGuard};
use crate::pacing::Pacer;
use crate::session::{error_code, FrameFacts, JobTracker, ProtocolViolation};
use crate::wire::{Control, JobId, Message, TraceContext};

/// Chunk size of paced writes: small enough that the pacer's waits stay short.
const PACED_CHUNK: usize = 16 << 10;
/// How long a sender waits for the reason after the receiver stopped its stream.
const REASON_GRACE: Duration = Duration::from_millis(500);

/// Reading one frame from a stream failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameReadError {
    /// The bytes are not a valid frame.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// The peer reset the stream with an application code.
    #[error("stream reset by peer with code {0}")]
    Reset(u64),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Connection(ConnectionError),
    /// The stream was already closed locally.
    #[error("stream already closed")]
    Closed,
}

impl From<ReadError> for FrameReadError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Reset(code) => FrameReadError::Reset(code.into_inner()),
            ReadError::ConnectionLost(c) => FrameReadError::Connection(c),
            ReadError::ClosedStream
            | ReadError::IllegalOrderedRead
            | ReadError::ZeroRttRejected => FrameReadError::Closed,
        }
    }
}

/// Reads frames from a stream. Cancel-safe: partial reads are kept in the reader, so a `next`
/// dropped in a `select!` loses nothing.
#[derive(Debug)]
pub(crate) struct FrameReader {
    max_frame_bytes: u32,
    header: [u8; HEADER_LEN],
    header_have: usize,
    body: Option<FrameBuf>,
    /// Length of the body being read (valid while `body` is set).
    body_len: usize,
}

impl FrameReader {
    pub(crate) fn new(max_frame_bytes: u32) -> Self {
        Self {
            max_frame_bytes,
            header: [0; HEADER_LEN],
            header_have: 0,
            body: None,
            body_len: 0,
        }
    }

    /// The next frame, owned, and its length on the wire; `None` at a clean end of stream.
    pub(crate) async fn next(
        &mut self,
        recv: &mut RecvStream,
    ) -> Result<Option<(Message, usize)>, FrameReadError> {
        match self.next_validated(recv).await? {
            Some(f) => Ok(Some((f.to_message()?, f.frame_len()))),
            None => Ok(None),
        }
    }

    /// The next frame, validated in place; `None` at a clean end of stream.
    pub(crate) async fn next_validated(
        &mut self,
        recv: &mut RecvStream,
    ) -> Result<Option<ValidatedFrame>, FrameReadError> {
        loop {
            if let Some(body) = self.body.as_mut() {
                if body.len() == self.body_len {
                    let body = self.body.take().unwrap_or_default();
                    self.header_have = 0;
                    return Ok(Some(ValidatedFrame::new(body)?));
                }
                // quinn's chunks are appended to the reserved buffer as they come: one copy,
                // and no zero-filling of the body first. A chunk is taken and appended in the
                // same poll, so a dropped `next` loses nothing.
                match recv.read_chunk(self.body_len - body.len(), true).await? {
                    Some(chunk) => body.extend_from_slice(&chunk.bytes),
                    None => return Err(FrameReadError::Truncated),
                }
            } else if self.header_have < HEADER_LEN {
                match recv.read(&mut self.header[self.header_have..]).await? {
                    Some(n) => self.header_have += n,
                    None if self.header_have == 0 => return Ok(None),
                    None => return Err(FrameReadError::Truncated),
                }
            } else {
                // The cap is checked here, before the body is allocated.
                let header = check_header(&self.header, self.max_frame_bytes)?;
                self.body_len = header.body_len as usize;
                self.body = Some(FrameBuf::with_capacity(self.body_len));
            }
        }
    }
}

/// Read one frame from a stream (hello exchange).
pub(crate) async fn read_one(
    recv: &mut RecvStream,
    max: u32,
) -> Result<Option<Message>, FrameReadError> {
    Ok(FrameReader::new(max).next(recv).await?.map(|(m, _)| m))
}

/// Write one frame to a stream (hello exchange).
pub(crate) async fn write_one(
    send: &mut SendStream,
    msg: &Message,
    max: u32,
) -> Result<(), FrameReadError> {
    let buf = codec::encode(msg, max)
        .map_err(|e| FrameReadError::Decode(DecodeError::Invalid(e.to_string())))?;
    send.write_all(&buf).await.map_err(|e| match e {
        WriteError::ConnectionLost(c) => FrameReadError::Connection(c),
        WriteError::Stopped(code) => FrameReadError::Reset(code.into_inner()),
        WriteError::ClosedStream | WriteError::ZeroRttRejected => FrameReadError::Closed,
    })
}

/// Errors opening a job stream.
#[derive(Debug, thiserror::Error)]
pub enum OpenJobError {
    /// The connection is gone.
    #[error("opening a job stream: connection lost: {0}")]
    ConnectionLost(ConnectionError),
    /// The Open frame could not be encoded (a trace context over the frame cap).
    #[error("opening a job stream: {0}")]
    Encode(#[from] EncodeError),
}

/// Errors accepting a job stream.
#[derive(Debug, thiserror::Error)]
pub enum AcceptJobError {
    /// The connection is gone (peer closed it, died or timed out).
    #[error("accepting a job stream: connection lost: {0}")]
    ConnectionLost(ConnectionError),
    /// The stream did not start with a valid Open frame.
    #[error("bad job stream opening: {0}")]
    BadOpen(String),
    /// No Open frame within the open timeout.
    #[error("job stream opened but not named within {0:?}")]
    OpenTimeout(Duration),
}

/// Errors sending a job's frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// This side cancelled the job.
    #[error("job cancelled")]
    Cancelled,
    /// The receiver cancelled the job.
    #[error("job cancelled by the receiver{}", reason_suffix(.reason))]
    CancelledByPeer {
        /// The receiver's reason, when it arrived.
        reason: Option<String>,
    },
    /// The receiver refused the job (protocol error, cap exceeded ...) or dropped it.
    #[error("receiver rejected the job (code {code}): {message}")]
    Rejected {
        /// Error code (see [`error_code`]).
        code: u32,
        /// The receiver's message.
        message: String,
    },
    /// The connection to the receiver is lost (closed, reset, timed out).
    #[error("receiver gone: {0}")]
    PeerGone(String),
    /// This side closed the connection.
    #[error("connection closed locally")]
    ConnectionClosed,
    /// The frame breaks the job stream rules; nothing was sent.
    #[error(transparent)]
    Protocol(#[from] ProtocolViolation),
    /// The frame could not be encoded; nothing was sent.
    #[error("encoding a frame: {0}")]
    Encode(String),
}

/// Errors receiving a job's frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    /// The sender cancelled the job.
    #[error("job cancelled by the sender{}", reason_suffix(.reason))]
    CancelledByPeer {
        /// The sender's reason, when it sent one.
        reason: Option<String>,
    },
    /// The sender reset the stream with another code (it failed or dropped the job).
    #[error("sender aborted the job stream (code {0})")]
    Aborted(u64),
    /// The connection to the sender is lost (closed, reset, timed out).
    #[error("sender gone: {0}")]
    PeerGone(String),
    /// This side closed the connection.
    #[error("connection closed locally")]
    ConnectionClosed,
    /// A frame could not be decoded; the stream was stopped.
    #[error("bad frame: {0}")]
    Decode(#[from] DecodeError),
    /// A frame broke the job stream rules; the stream was stopped.
    #[error(transparent)]
    Protocol(#[from] ProtocolViolation),
    /// The stream ended inside a frame.
    #[error("job stream ended inside a frame")]
    Truncated,
    /// The job already ended on this side.
    #[error("job stream already ended")]
    Ended,
}

fn reason_suffix(reason: &Option<String>) -> String {
    reason
        .as_ref()
        .map(|r| format!(": {r}"))
        .unwrap_or_default()
}

fn conn_lost_send(c: ConnectionError) -> SendError {
    match c {
        ConnectionError::LocallyClosed => SendError::ConnectionClosed,
        other => SendError::PeerGone(other.to_string()),
    }
}

fn conn_lost_recv(c: ConnectionError) -> RecvError {
    match c {
        ConnectionError::LocallyClosed => RecvError::ConnectionClosed,
        other => RecvError::PeerGone(other.to_string()),
    }
}

/// What a finished job stream carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendReport {
    /// Frames sent, the Open frame included.
    pub frames: u64,
    /// Bytes sent, frame headers included.
    pub bytes: u64,
}

impl Connection {
    /// Open a job stream for `job_id`; frames sent on it reach the peer's
    /// [`Connection::accept_job`] in order.
    pub async fn open_job(
        &self,
        job_id: JobId,
        trace: TraceContext,
    ) -> Result<JobSender, OpenJobError> {
        let opts = &self.shared.opts;
        let (send, back) = self
            .inner
            .open_bi()
            .await
            .map_err(OpenJobError::ConnectionLost)?;
        let mut tracker = JobTracker::new(opts.max_job_bytes);
        let open = Message::Control(Control::Open { job_id, trace });
        let buf = codec::encode(&open, opts.max_frame_bytes)?;
        tracker
            .admit(&open, buf.len())
            .map_err(|e| OpenJobError::Encode(EncodeError::Serialize(e.to_string())))?;
        let (tx, rx) = mpsc::channel(opts.send_queue_frames.max(1));
        let (cancel_tx, cancel_rx) = oneshot::channel();
        // The Open frame goes first through the same queue, so the stream appears at the peer
        // even before the first layer is ready.
        tx.try_send(EncodedFrame::from(buf)).map_err(|_| {
            OpenJobError::Encode(EncodeError::Serialize("send queue unavailable".into()))
        })?;
        let guard = self.shared.tasks.enter();
        let task = tokio::spawn(writer(
            Writer {
                send,
                back,
                rx,
                pacer: self.pacer.clone(),
                max_frame_bytes: opts.max_frame_bytes,
            },
            cancel_rx,
            guard,
        ));
        Ok(JobSender {
            job_id,
            tracker,
            max_frame_bytes: opts.max_frame_bytes,
            tx: Some(tx),
            cancel: Some(cancel_tx),
            task: Some(task),
        })
    }

    /// Wait for the peer to open a job stream.
    pub async fn accept_job(&self) -> Result<JobReceiver, AcceptJobError> {
        let opts = &self.shared.opts;
        let (mut back, mut recv) = self
            .inner
            .accept_bi()
            .await
            .map_err(AcceptJobError::ConnectionLost)?;
        let mut reader = FrameReader::new(opts.max_frame_bytes);
        let mut tracker = JobTracker::new(opts.max_job_bytes);
        let first = match tokio::time::timeout(opts.open_timeout, reader.next(&mut recv)).await {
            Err(_) => {
                let _ = recv.stop(VarInt::from_u32(error_code::PROTOCOL));
                let _ = back.reset(VarInt::from_u32(error_code::PROTOCOL));
                return Err(AcceptJobError::OpenTimeout(opts.open_timeout));
            }
            Ok(Err(FrameReadError::Connection(c))) => {
                return Err(AcceptJobError::ConnectionLost(c))
            }
            Ok(Err(e)) => {
                let _ = recv.stop(VarInt::from_u32(error_code::PROTOCOL));
                let _ = back.reset(VarInt::from_u32(error_code::PROTOCOL));
                return Err(AcceptJobError::BadOpen(e.to_string()));
            }
            Ok(Ok(None)) => {
                return Err(AcceptJobError::BadOpen(
                    "stream ended before the Open frame".into(),
                ))
            }
            Ok(Ok(Some(first))) => first,
        };
        let (msg, len) = first;
        if let Err(e) = tracker.admit(&msg, len) {
            let _ = recv.stop(VarInt::from_u32(error_code::PROTOCOL));
            let _ = back.reset(VarInt::from_u32(error_code::PROTOCOL));
            return Err(AcceptJobError::BadOpen(e.to_string()));
        }
        let Message::Control(Control::Open { job_id, trace }) = msg else {
            return Err(AcceptJobError::BadOpen("first frame is not Open".into()));
        };
        Ok(JobReceiver {
            job_id,
            trace,
            peer: self.peer().clone(),
            recv,
            back,
            reader,
            tracker,
            max_frame_bytes: opts.max_frame_bytes,
            ended: false,
        })
    }
}

/// The sending side of a job stream. Dropping it without [`finish`](Self::finish) cancels the
/// job.
#[derive(Debug)]
pub struct JobSender {
    job_id: JobId,
    tracker: JobTracker,
    max_frame_bytes: u32,
    tx: Option<mpsc::Sender<EncodedFrame>>,
    cancel: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<SendReport, SendError>>>,
}

impl JobSender {
    /// The job.
    pub fn job_id(&self) -> JobId {
        self.job_id
    }

    /// Frames queued for the writer and not yet taken by it.
    pub fn queued_frames(&self) -> usize {
        self.tx
            .as_ref()
            .map_or(0, |tx| tx.max_capacity() - tx.capacity())
    }

    /// Bytes accepted so far (frame headers included).
    pub fn bytes(&self) -> u64 {
        self.tracker.bytes()
    }

    /// Queue a frame. Waits while the queue is full, which is how a slow receiver slows the
    /// producer. A frame that breaks the job stream rules is refused before anything is sent.
    pub async fn send(&mut self, msg: impl Into<Message>) -> Result<(), SendError> {
        let msg = msg.into();
        let facts = FrameFacts::of(&msg);
        // The frame keeps a large payload's own buffer (no copy); quinn sends from it.
        let frame = codec::encode_frame(msg, self.max_frame_bytes)
            .map_err(|e| SendError::Encode(e.to_string()))?;
        self.tracker.admit_facts(facts, frame.len())?;
        let Some(tx) = self.tx.as_ref() else {
            return Err(SendError::Cancelled);
        };
        if tx.send(frame).await.is_err() {
            // The writer ended early; its result says why.
            return Err(self.join().await.err().unwrap_or(SendError::Cancelled));
        }
        Ok(())
    }

    /// Send everything queued, end the stream and wait until the receiver has read it all.
    pub async fn finish(mut self) -> Result<SendReport, SendError> {
        self.tx = None;
        self.join().await
    }

    /// Cancel the job: the stream is reset and the receiver sees
    /// [`RecvError::CancelledByPeer`]. Waits for the writer task to end.
    pub async fn cancel(mut self) {
        if let Some(c) = self.cancel.take() {
            let _ = c.send(());
        }
        let _ = self.join().await;
    }

    async fn join(&mut self) -> Result<SendReport, SendError> {
        let Some(task) = self.task.take() else {
            return Err(SendError::Cancelled);
        };
        self.tx = None;
        match task.await {
            Ok(r) => r,
            Err(e) => Err(SendError::PeerGone(format!("writer task failed: {e}"))),
        }
    }
}

impl Drop for JobSender {
    fn drop(&mut self) {
        // The writer task resets the stream and ends on its own; it is counted until it has.
        if self.task.is_some() {
            if let Some(c) = self.cancel.take() {
                let _ = c.send(());
            }
        }
    }
}

struct Writer {
    send: SendStream,
    back: RecvStream,
    rx: mpsc::Receiver<EncodedFrame>,
    pacer: Option<Arc<Pacer>>,
    max_frame_bytes: u32,
}

/// What came back on the receiver's half of a job stream.
enum BackEvent {
    Cancel(Option<String>),
    Error(u32, String),
    Eof,
    Failed(SendError),
}

/// How the writer's main loop ended.
enum Outcome {
    LocalCancel,
    Back(BackEvent),
    WriteFailed(WriteError),
}

async fn watch_back(back: &mut RecvStream, reader: &mut FrameReader) -> BackEvent {
    loop {
        match reader.next(back).await {
            Ok(Some((Message::Control(Control::Cancel { reason, .. }), _))) => {
                return BackEvent::Cancel(Some(reason))
            }
            Ok(Some((Message::Control(Control::Error { code, message, .. }), _))) => {
                return BackEvent::Error(code, message)
            }
            Ok(Some((other, _))) => tracing::trace!(?other, "job status from receiver"),
            Ok(None) => return BackEvent::Eof,
            Err(FrameReadError::Connection(c)) => return BackEvent::Failed(conn_lost_send(c)),
            Err(FrameReadError::Reset(code)) => {
                return BackEvent::Failed(SendError::Rejected {
                    code: code as u32,
                    message: "receiver reset its half of the job stream".into(),
                })
            }
            Err(e) => {
                return BackEvent::Failed(SendError::Rejected {
                    code: error_code::PROTOCOL,
                    message: format!("bad frame from receiver: {e}"),
                })
            }
        }
    }
}

async fn pump(
    send: &mut SendStream,
    rx: &mut mpsc::Receiver<EncodedFrame>,
    pacer: Option<&Pacer>,
    report: &mut SendReport,
) -> Result<(), WriteError> {
    while let Some(frame) = rx.recv().await {
        let len = frame.len();
        let mut segments = frame.into_segments();
        match pacer {
            None => send.write_all_chunks(&mut segments).await?,
            Some(p) => {
                for seg in segments {
                    for start in (0..seg.len()).step_by(PACED_CHUNK) {
                        let end = (start + PACED_CHUNK).min(seg.len());
                        p.pace((end - start) as u64).await;
                        send.write_chunk(seg.slice(start..end)).await?;
                    }
                }
            }
        }
        report.frames += 1;
        report.bytes += len as u64;
    }
    send.finish().map_err(|_| WriteError::ClosedStream)
}

async fn writer(
    mut w: Writer,
    mut cancel: oneshot::Receiver<()>,
    _guard: TaskGuard,
) -> Result<SendReport, SendError> {
    let mut report = SendReport {
        frames: 0,
        bytes: 0,
    };
    let mut reader = FrameReader::new(w.max_frame_bytes);
    let outcome = {
        let pump = pump(&mut w.send, &mut w.rx, w.pacer.as_deref(), &mut report);
        let watch = watch_back(&mut w.back, &mut reader);
        tokio::pin!(pump, watch);
        let mut pumped = false;
        let mut cancel_open = true;
        loop {
            tokio::select! {
                biased;
                r = &mut cancel, if cancel_open => {
                    // A dropped cancel sender means the handle is finishing, not cancelling.
                    if r.is_ok() { break Outcome::LocalCancel; }
                    cancel_open = false;
                }
                ev = &mut watch => break Outcome::Back(ev),
                r = &mut pump, if !pumped => match r {
                    Ok(()) => pumped = true,
                    Err(e) => break Outcome::WriteFailed(e),
                },
            }
        }
    };
    let code = |c: u32| VarInt::from_u32(c);
    match outcome {
        Outcome::LocalCancel => {
            let _ = w.send.reset(code(error_code::CANCELLED));
            let _ = w.back.stop(code(error_code::CANCELLED));
            Err(SendError::Cancelled)
        }
        Outcome::Back(BackEvent::Eof) if report_complete(&w.rx) => Ok(report),
        Outcome::Back(BackEvent::Eof) => {
            let _ = w.send.reset(code(error_code::CANCELLED));
            Err(SendError::Rejected {
                code: error_code::DROPPED,
                message: "receiver ended the job before reading it all".into(),
            })
        }
        Outcome::Back(BackEvent::Cancel(reason)) => {
            let _ = w.send.reset(code(error_code::CANCELLED));
            Err(SendError::CancelledByPeer { reason })
        }
        Outcome::Back(BackEvent::Error(c, message)) => {
            let _ = w.send.reset(code(error_code::CANCELLED));
            Err(SendError::Rejected { code: c, message })
        }
        Outcome::Back(BackEvent::Failed(e)) => {
            let _ = w.send.reset(code(error_code::INTERNAL));
            Err(e)
        }
        Outcome::WriteFailed(WriteError::Stopped(c)) => {
            // The receiver writes its Cancel or Error frame before stopping us; fetch it.
            let ev = tokio::time::timeout(REASON_GRACE, watch_back(&mut w.back, &mut reader)).await;
            let _ = w.back.stop(code(error_code::CANCELLED));
            match ev {
                Ok(BackEvent::Cancel(reason)) => Err(SendError::CancelledByPeer { reason }),
                Ok(BackEvent::Error(c, message)) => Err(SendError::Rejected { code: c, message }),
                Ok(BackEvent::Failed(e)) => Err(e),
                _ if c.into_inner() == u64::from(error_code::CANCELLED) => {
                    Err(SendError::CancelledByPeer { reason: None })
                }
                _ => Err(SendError::Rejected {
                    code: c.into_inner() as u32,
                    message: "receiver stopped the job stream".into(),
                }),
            }
        }
        Outcome::WriteFailed(WriteError::ConnectionLost(c)) => Err(conn_lost_send(c)),
        Outcome::WriteFailed(e) => Err(SendError::PeerGone(e.to_string())),
    }
}

/// Whether the pump drained and closed the queue (the sender finished).
fn report_complete(rx: &mpsc::Receiver<EncodedFrame>) -> bool {
    rx.is_closed() && rx.is_empty()
}

/// The receiving side of a job stream.
#[derive(Debug)]
pub struct JobReceiver {
    job_id: JobId,
    trace: TraceContext,
    peer: crate::pki::PeerIdentity,
    recv: RecvStream,
    back: SendStream,
    reader: FrameReader,
    tracker: JobTracker,
    max_frame_bytes: u32,
    ended: bool,
}

impl JobReceiver {
    /// The job.
    pub fn job_id(&self) -> JobId {
        self.job_id
    }

    /// The trace context from the Open frame.
    pub fn trace(&self) -> &TraceContext {
        &self.trace
    }

    /// Who sent the job.
    pub fn peer(&self) -> &crate::pki::PeerIdentity {
        &self.peer
    }

    /// Bytes received so far (frame headers included).
    pub fn bytes(&self) -> u64 {
        self.tracker.bytes()
    }

    /// The next frame, as soon as it has arrived and passed validation; `Ok(None)` when the
    /// sender finished the job. Cancel-safe.
    pub async fn next(&mut self) -> Result<Option<Message>, RecvError> {
        match self.next_frame().await? {
            Some(f) => Ok(Some(f.to_message()?)),
            None => Ok(None),
        }
    }

    /// Like [`next`](Self::next), but the frame stays in its receive buffer: read it in place
    /// with [`ValidatedFrame::archived`] (no copy of the payload). Cancel-safe.
    pub async fn next_frame(&mut self) -> Result<Option<ValidatedFrame>, RecvError> {
        if self.ended {
            return Err(RecvError::Ended);
        }
        let r = self.reader.next_validated(&mut self.recv).await;
        match r {
            Ok(None) => {
                self.ended = true;
                let _ = self.back.finish();
                Ok(None)
            }
            Ok(Some(frame)) => {
                let facts = FrameFacts::of_archived(frame.archived());
                if let Err(v) = self.tracker.admit_facts(facts, frame.frame_len()) {
                    self.reject(&v.to_string()).await;
                    return Err(RecvError::Protocol(v));
                }
                if let crate::wire::ArchivedMessage::Control(
                    crate::wire::ArchivedControl::Cancel { reason, .. },
                ) = frame.archived()
                {
                    self.ended = true;
                    let _ = self.back.finish();
                    return Err(RecvError::CancelledByPeer {
                        reason: Some(reason.as_str().to_owned()),
                    });
                }
                Ok(Some(frame))
            }
            Err(FrameReadError::Decode(e)) => {
                self.reject(&e.to_string()).await;
                Err(RecvError::Decode(e))
            }
            Err(FrameReadError::Truncated) => {
                self.ended = true;
                let _ = self.back.reset(VarInt::from_u32(error_code::PROTOCOL));
                Err(RecvError::Truncated)
            }
            Err(FrameReadError::Reset(code)) => {
                self.ended = true;
                let _ = self.back.reset(VarInt::from_u32(error_code::CANCELLED));
                if code == u64::from(error_code::CANCELLED) {
                    Err(RecvError::CancelledByPeer { reason: None })
                } else {
                    Err(RecvError::Aborted(code))
                }
            }
            Err(FrameReadError::Connection(c)) => {
                self.ended = true;
                Err(conn_lost_recv(c))
            }
            Err(FrameReadError::Closed) => {
                self.ended = true;
                Err(RecvError::Ended)
            }
        }
    }

    /// Send a status or other control message back to the sender (it sees Cancel and Error;
    /// other messages are informational).
    pub async fn report(&mut self, msg: Control) -> Result<(), RecvError> {
        self.write_back(&Message::Control(msg)).await
    }

    async fn write_back(&mut self, msg: &Message) -> Result<(), RecvError> {
        let buf = codec::encode(msg, self.max_frame_bytes)
            .map_err(|e| RecvError::Decode(DecodeError::Invalid(e.to_string())))?;
        self.back.write_all(&buf).await.map_err(|e| match e {
            WriteError::ConnectionLost(c) => conn_lost_recv(c),
            _ => RecvError::Ended,
        })
    }

    /// Refuse the rest of the job after a bad frame: tell the sender why, then stop its stream.
    async fn reject(&mut self, message: &str) {
        self.ended = true;
        let err = Message::Control(Control::Error {
            job_id: Some(self.job_id),
            code: error_code::PROTOCOL,
            message: message.to_owned(),
        });
        let _ = tokio::time::timeout(REASON_GRACE, self.write_back(&err)).await;
        let _ = self.back.finish();
        let _ = self.recv.stop(VarInt::from_u32(error_code::PROTOCOL));
    }

    /// Cancel the job from the receiving side: the sender sees
    /// [`SendError::CancelledByPeer`] with `reason`.
    pub async fn cancel(mut self, reason: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        let msg = Message::Control(Control::Cancel {
            job_id: self.job_id,
            reason: reason.to_owned(),
        });
        let _ = tokio::time::timeout(REASON_GRACE, self.write_back(&msg)).await;
        let _ = self.back.finish();
        let _ = self.recv.stop(VarInt::from_u32(error_code::CANCELLED));
    }
}
