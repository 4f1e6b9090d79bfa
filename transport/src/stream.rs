//! Job streams: one bidirectional QUIC stream per job, driven by async code that reads, writes
//! and carries out what [`crate::session`] decides.
//!
//! The opener ([`JobSender`]) writes an [`Control::Open`] frame and then the job's frames, layer
//! by layer, as the application hands them over; the acceptor ([`JobReceiver`]) yields them as
//! they arrive and may answer on the other half (status, error, cancel).
//!
//! Memory is bounded on both sides: the sender encodes a frame in the caller's task (a large
//! payload is not copied: the frame keeps the payload's buffer and quinn sends from it) and
//! queues it on a bounded channel (`send_queue_frames`) to a writer task, which blocks on QUIC flow
//! control when the receiver is slow, so `send` blocks in turn; the receiver holds one frame at a
//! time per job, charged to the endpoint's receive budget (see [`crate::budget`]), plus QUIC's
//! stream window. Either side may cancel: the sender resets the stream, the receiver sends a
//! Cancel frame on its half and stops the sender's. A lost connection ends every job on it with
//! [`SendError::PeerGone`] / [`RecvError::PeerGone`] on the side that noticed it and a
//! closed-connection error on the other.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::{ConnectionError, RecvStream, SendStream, VarInt, WriteError};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::budget::ReceiveBudget;
use crate::codec::{self, EncodeError, EncodedFrame};
use crate::config::TransportOptions;
use crate::framing::{
    connection_loss, write_encoded, write_one, FrameReadError, FrameReader, FrameWriteError,
    ReceivedFrame,
};
use crate::link_meter::LinkMeter;
use crate::pacing::Pacer;
use crate::pki::PeerIdentity;
use crate::session::{
    sender_end, EndAction, FrameFacts, JobTracker, ProtocolViolation, ReadFailure, RecvError,
    RecvStep, Reply, SendError, SendHalf, SenderEvent,
};
use crate::tasks::{TaskCounter, TaskGuard};
use crate::wire::{ArchivedControl, ArchivedMessage, Control, Message};
use scd_types::{JobId, TraceContext};

/// How long a side waits to write why a job ends (the peer may not be reading), and how long
/// a stopped sender waits for the receiver's reason.
const REASON_GRACE: Duration = Duration::from_millis(500);

/// Cap on frames on a job's back half (status, error, cancel): a reply carries a job id, a code
/// and a sentence, not data.
pub const CONTROL_MAX_FRAME_BYTES: u32 = 64 << 10;

/// Errors opening a job stream.
#[derive(Debug, thiserror::Error)]
pub enum OpenJobError {
    /// The connection is gone.
    #[error("opening a job stream: connection lost: {0}")]
    ConnectionLost(ConnectionError),
    /// The Open frame could not be encoded (a trace context over the frame cap).
    #[error("opening a job stream: {0}")]
    Encode(#[from] EncodeError),
    /// The Open frame alone exceeds the per-job byte cap.
    #[error("opening a job stream: {0}")]
    Protocol(#[from] ProtocolViolation),
}

/// Errors accepting a job stream.
#[derive(Debug, thiserror::Error)]
pub enum AcceptJobError {
    /// The connection is gone (peer closed it, died or timed out).
    #[error("accepting a job stream: connection lost: {0}")]
    ConnectionLost(ConnectionError),
    /// The stream did not start with a valid Open frame; it was refused as the error says.
    #[error("bad job stream opening: {0}")]
    BadOpen(RecvError),
    /// No Open frame within the open timeout.
    #[error("job stream opened but not named within {0:?}")]
    OpenTimeout(Duration),
}

/// Errors sending a report back to a job's sender.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    /// The message could not be encoded (or is over [`CONTROL_MAX_FRAME_BYTES`]).
    #[error("encoding a report: {0}")]
    Encode(#[from] EncodeError),
    /// The job already ended on this side, or the sender stopped listening.
    #[error("job stream already ended")]
    Ended,
    /// The connection to the sender is lost.
    #[error("sender gone: {0}")]
    PeerGone(String),
    /// This side closed the connection.
    #[error("connection closed locally")]
    ConnectionClosed,
}

/// What a finished job stream carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendReport {
    /// Frames sent, the Open frame included.
    pub frames: u64,
    /// Bytes sent, frame headers included.
    pub bytes: u64,
    /// Bytes of the frames written while the link, not the producer, set the pace: spells in
    /// which every frame was already queued when the writer got to it, of at least
    /// [`crate::link_meter::MIN_SPELL`] ([`crate::link_meter`] says why).
    pub backlogged_bytes: u64,
    /// Time of those spells, the last one's wait until the peer had read everything included.
    pub backlogged_busy: Duration,
    /// Time every frame's write took, plus that last wait.
    pub write_busy: Duration,
}

/// What a job stream says about its link's rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LinkRate {
    /// Measured over spells in which frames queued behind the link: the link's own rate.
    Measured(f64),
    /// No such spell: the link kept up with the producer. From every frame's write time, which
    /// after idle moments is a burst, not a rate: an upper estimate that only says "keeps up".
    KeptUp(f64),
}

impl LinkRate {
    /// Bytes per second either way.
    pub fn bytes_per_sec(self) -> f64 {
        match self {
            Self::Measured(r) | Self::KeptUp(r) => r,
        }
    }
}

impl SendReport {
    /// Bytes per second the link carried this job at, not counting time spent waiting for
    /// the producer's next frame ([`LinkRate`]); `None` when no time was measured.
    pub fn link_rate(&self) -> Option<LinkRate> {
        let rate = |bytes: u64, busy: Duration| {
            let secs = busy.as_secs_f64();
            (bytes > 0 && secs > 0.0).then(|| bytes as f64 / secs)
        };
        rate(self.backlogged_bytes, self.backlogged_busy)
            .map(LinkRate::Measured)
            .or_else(|| rate(self.bytes, self.write_busy).map(LinkRate::KeptUp))
    }
}

/// What job streams need from the connection and endpoint they run on.
pub(crate) struct JobStreams<'a> {
    pub(crate) opts: &'a TransportOptions,
    pub(crate) tasks: &'a Arc<TaskCounter>,
    pub(crate) budget: &'a ReceiveBudget,
    pub(crate) pacer: Option<&'a Arc<Pacer>>,
}

/// Carry out an end-of-job decision on a job stream's two halves.
async fn carry_out(action: EndAction, send: &mut SendStream, recv: &mut RecvStream) {
    if let Some(reply) = action.reply {
        let msg = Message::Control(reply);
        let _ = tokio::time::timeout(REASON_GRACE, write_one(send, &msg, CONTROL_MAX_FRAME_BYTES))
            .await;
    }
    match action.send {
        SendHalf::Keep => {}
        SendHalf::Finish => {
            let _ = send.finish();
        }
        SendHalf::Reset(code) => {
            let _ = send.reset(VarInt::from_u32(code));
        }
    }
    if let Some(code) = action.stop {
        let _ = recv.stop(VarInt::from_u32(code));
    }
}

/// Open a job stream for `job_id` on `conn`.
pub(crate) async fn open(
    conn: &quinn::Connection,
    ctx: JobStreams<'_>,
    job_id: JobId,
    trace: TraceContext,
) -> Result<JobSender, OpenJobError> {
    let opts = ctx.opts;
    let mut tracker = JobTracker::new(opts.max_job_bytes);
    let open = Message::Control(Control::Open { job_id, trace });
    let first = codec::encode_frame(open.clone(), opts.max_frame_bytes)?;
    tracker.admit(&open, first.len())?;
    let (send, back) = conn.open_bi().await.map_err(OpenJobError::ConnectionLost)?;
    let (tx, rx) = mpsc::channel(opts.send_queue_frames.max(1));
    let (cancel_tx, cancel_rx) = oneshot::channel();
    let guard = ctx.tasks.enter();
    // The Open frame goes first, so the stream appears at the peer even before the first
    // layer is ready.
    let task = tokio::spawn(writer(
        Writer {
            send,
            back,
            rx,
            pacer: ctx.pacer.cloned(),
        },
        first,
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

/// Wait for the peer to open a job stream on `conn` and read its Open frame.
pub(crate) async fn accept(
    conn: &quinn::Connection,
    ctx: JobStreams<'_>,
    peer: PeerIdentity,
) -> Result<JobReceiver, AcceptJobError> {
    let opts = ctx.opts;
    let (mut back, mut recv) = conn
        .accept_bi()
        .await
        .map_err(AcceptJobError::ConnectionLost)?;
    let mut reader = FrameReader::new(opts.max_frame_bytes, Some(ctx.budget.clone()));
    let mut tracker = JobTracker::new(opts.max_job_bytes);
    let step = match tokio::time::timeout(opts.open_timeout, reader.next(&mut recv)).await {
        Err(_) => {
            carry_out(tracker.on_open_timeout(), &mut back, &mut recv).await;
            return Err(AcceptJobError::OpenTimeout(opts.open_timeout));
        }
        Ok(Err(FrameReadError::Connection(c))) => return Err(AcceptJobError::ConnectionLost(c)),
        Ok(Err(e)) => tracker.on_read_failure(e.into()),
        Ok(Ok(None)) => tracker.on_end_of_stream(),
        Ok(Ok(Some(first))) => {
            match tracker.on_frame(FrameFacts::of_archived(first.archived()), first.frame_len()) {
                RecvStep::Deliver => match opening(&first) {
                    Ok((job_id, trace)) => {
                        return Ok(JobReceiver {
                            job_id,
                            trace,
                            peer,
                            recv,
                            back,
                            reader,
                            tracker,
                        })
                    }
                    Err(failure) => tracker.on_read_failure(failure),
                },
                step => step,
            }
        }
    };
    let (action, error) = match step {
        RecvStep::Failed(action, error) => (action, error),
        // A stream is delivered or finished only once its Open frame passed, handled above.
        RecvStep::Deliver | RecvStep::Finished(_) => (
            EndAction::NOTHING,
            RecvError::Protocol(ProtocolViolation::MissingOpen),
        ),
    };
    carry_out(action, &mut back, &mut recv).await;
    Err(AcceptJobError::BadOpen(error))
}

/// The job and trace context of an admitted Open frame.
fn opening(frame: &ReceivedFrame) -> Result<(JobId, TraceContext), ReadFailure> {
    match frame.archived() {
        ArchivedMessage::Control(ArchivedControl::Open { job_id, trace }) => {
            let trace = TraceContext::from_archived(trace)
                .map_err(|e| ReadFailure::Malformed(codec::DecodeError::Content(e.into())))?;
            Ok((job_id.get(), trace))
        }
        // The tracker admits nothing else as a first frame.
        _ => Err(ReadFailure::Malformed(codec::DecodeError::Invalid(
            "first frame is not Open".into(),
        ))),
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
        // The rules look at ids, layers and kinds only; the facts are copied out so the message
        // can move into the encoder.
        let of = FrameFacts::of(&msg);
        let facts = FrameFacts {
            job_id: of.job_id,
            is_open: of.is_open,
            code: of.code,
            cancel: None,
        };
        // The frame keeps a large payload's own buffer (no copy); quinn sends from it.
        let frame = codec::encode_frame(msg, self.max_frame_bytes)?;
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
            Err(e) => Err(SendError::Internal(format!("writer task: {e}"))),
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
}

/// Read the receiver's half until something that ends the job (status reports are logged and
/// skipped).
async fn next_reply(back: &mut RecvStream, reader: &mut FrameReader) -> Reply {
    loop {
        let frame = match reader.next(back).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return Reply::End,
            Err(e) => return Reply::Failed(e.into()),
        };
        match frame.archived() {
            ArchivedMessage::Control(ArchivedControl::Cancel { reason, .. }) => {
                return Reply::Cancel(reason.as_str().to_owned())
            }
            ArchivedMessage::Control(ArchivedControl::Error { code, message, .. }) => {
                return Reply::Error {
                    code: code.to_native(),
                    message: message.as_str().to_owned(),
                }
            }
            other => tracing::trace!(?other, "job status from receiver"),
        }
    }
}

async fn pump(
    send: &mut SendStream,
    first: EncodedFrame,
    rx: &mut mpsc::Receiver<EncodedFrame>,
    pacer: Option<&Pacer>,
    report: &mut SendReport,
    meter: &mut LinkMeter,
) -> Result<(), WriteError> {
    let mut next = Some(first);
    loop {
        let (frame, queued) = match next.take() {
            Some(f) => (f, false),
            None => match rx.try_recv() {
                Ok(f) => (f, true),
                Err(mpsc::error::TryRecvError::Empty) => {
                    // The writer waits for the producer: a spell of the link's pace ends here.
                    meter.waiting();
                    match rx.recv().await {
                        Some(f) => (f, false),
                        None => break,
                    }
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            },
        };
        let len = frame.len();
        let started = Instant::now();
        write_encoded(send, frame, pacer).await?;
        let ended = Instant::now();
        report.write_busy += ended - started;
        meter.wrote(queued, len as u64, started, ended);
        report.frames += 1;
        report.bytes += len as u64;
    }
    send.finish().map_err(|_| WriteError::ClosedStream)
}

/// The writer task of one job: sends queued frames, watches the receiver's half, and ends the
/// job as [`sender_end`] decides.
async fn writer(
    mut w: Writer,
    first: EncodedFrame,
    mut cancel: oneshot::Receiver<()>,
    _guard: TaskGuard,
) -> Result<SendReport, SendError> {
    let mut report = SendReport::default();
    let mut meter = LinkMeter::default();
    let mut pumped_at = None;
    let mut reader = FrameReader::new(CONTROL_MAX_FRAME_BYTES, None);
    let event = {
        let pump = pump(
            &mut w.send,
            first,
            &mut w.rx,
            w.pacer.as_deref(),
            &mut report,
            &mut meter,
        );
        let watch = next_reply(&mut w.back, &mut reader);
        tokio::pin!(pump, watch);
        let mut pumped = false;
        let mut cancel_open = true;
        loop {
            tokio::select! {
                biased;
                r = &mut cancel, if cancel_open => {
                    // A dropped cancel sender means the handle is finishing, not cancelling.
                    if r.is_ok() { break Ok(SenderEvent::CancelledLocally); }
                    cancel_open = false;
                }
                reply = &mut watch => break Ok(SenderEvent::Replied { reply, all_sent: pumped }),
                r = &mut pump, if !pumped => match r {
                    Ok(()) => {
                        pumped = true;
                        pumped_at = Some(Instant::now());
                    }
                    Err(e) => break Err(e),
                },
            }
        }
    };
    let event = match event {
        Ok(ev) => ev,
        Err(WriteError::Stopped(code)) => {
            // The receiver writes its Cancel or Error frame before stopping us; fetch it.
            let reply = tokio::time::timeout(REASON_GRACE, next_reply(&mut w.back, &mut reader))
                .await
                .ok();
            SenderEvent::Stopped {
                code: code.into_inner(),
                reply,
            }
        }
        Err(WriteError::ConnectionLost(c)) => SenderEvent::WriteLost(connection_loss(c)),
        Err(WriteError::ClosedStream | WriteError::ZeroRttRejected) => SenderEvent::WriteClosed,
    };
    if let Some(t) = pumped_at {
        report.write_busy += t.elapsed();
        meter.finish(Instant::now());
    }
    (report.backlogged_bytes, report.backlogged_busy) = meter.spells();
    let (action, result) = sender_end(event);
    carry_out(action, &mut w.send, &mut w.back).await;
    result.map(|()| report)
}

/// The receiving side of a job stream.
#[derive(Debug)]
pub struct JobReceiver {
    job_id: JobId,
    trace: TraceContext,
    peer: PeerIdentity,
    recv: RecvStream,
    back: SendStream,
    reader: FrameReader,
    tracker: JobTracker,
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
    pub fn peer(&self) -> &PeerIdentity {
        &self.peer
    }

    /// Bytes received so far (frame headers included).
    pub fn bytes(&self) -> u64 {
        self.tracker.bytes()
    }

    /// The next frame, as soon as it has arrived and passed validation; `Ok(None)` when the
    /// sender finished the job. Cancel-safe while it waits for a frame.
    pub async fn next(&mut self) -> Result<Option<Message>, RecvError> {
        match self.next_frame().await? {
            // The frame's buffer, and its share of the receive budget, go when it is dropped
            // here; the owned message is the application's memory.
            Some(f) => Ok(Some(f.to_message()?)),
            None => Ok(None),
        }
    }

    /// Like [`next`](Self::next), but the frame stays in its receive buffer: read it in place
    /// with [`ReceivedFrame::archived`] (no copy of the payload). The frame holds its share of
    /// the endpoint's receive budget until it is dropped, and frames that do not fit beside
    /// the held ones are refused as busy: drop frames once used. Cancel-safe while it waits for
    /// a frame.
    pub async fn next_frame(&mut self) -> Result<Option<ReceivedFrame>, RecvError> {
        if self.tracker.is_ended() {
            return Err(RecvError::Ended);
        }
        let step = match self.reader.next(&mut self.recv).await {
            Ok(Some(frame)) => {
                let facts = FrameFacts::of_archived(frame.archived());
                match self.tracker.on_frame(facts, frame.frame_len()) {
                    RecvStep::Deliver => return Ok(Some(frame)),
                    step => step,
                }
            }
            Ok(None) => self.tracker.on_end_of_stream(),
            Err(e) => self.tracker.on_read_failure(e.into()),
        };
        match step {
            RecvStep::Deliver => Err(RecvError::Ended),
            RecvStep::Finished(action) => {
                carry_out(action, &mut self.back, &mut self.recv).await;
                Ok(None)
            }
            RecvStep::Failed(action, error) => {
                carry_out(action, &mut self.back, &mut self.recv).await;
                Err(error)
            }
        }
    }

    /// Send a status or other control message back to the sender (it sees Cancel and Error;
    /// other messages are informational).
    pub async fn report(&mut self, msg: Control) -> Result<(), ReportError> {
        if self.tracker.is_ended() {
            return Err(ReportError::Ended);
        }
        write_one(
            &mut self.back,
            &Message::Control(msg),
            CONTROL_MAX_FRAME_BYTES,
        )
        .await
        .map_err(|e| match e {
            FrameWriteError::Encode(e) => ReportError::Encode(e),
            FrameWriteError::Connection(ConnectionError::LocallyClosed) => {
                ReportError::ConnectionClosed
            }
            FrameWriteError::Connection(c) => ReportError::PeerGone(c.to_string()),
            FrameWriteError::Stopped(_) | FrameWriteError::Closed => ReportError::Ended,
        })
    }

    /// Cancel the job from the receiving side: the sender sees
    /// [`SendError::CancelledByPeer`] with `reason`.
    pub async fn cancel(mut self, reason: &str) {
        if let Some(action) = self.tracker.cancel_locally(reason) {
            carry_out(action, &mut self.back, &mut self.recv).await;
        }
    }
}
