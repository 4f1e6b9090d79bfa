//! Job stream rules and end-of-job decisions, without I/O: which job a stream carries, per-job
//! byte caps, layer ordering, and, when a job ends, what each side does about it (what to write
//! back, which half to finish, reset or stop, with which code) and what the application is told.
//!
//! The async drivers in `stream` feed every frame they send or receive, and every failure they
//! see, through a [`JobTracker`] or [`sender_end`], and carry out the [`EndAction`] they get back;
//! they decide nothing themselves. That keeps the protocol testable without sockets (the tests
//! below), the way quinn-proto keeps QUIC's state apart from quinn's I/O.

use crate::budget::BudgetError;
use crate::codec::{DecodeError, EncodeError};
use crate::wire::{ArchivedControl, ArchivedMessage, Control, Message};
use scd_types::{CodeKind, JobId};

/// QUIC application error codes used to reset or stop job streams and close connections, and
/// carried in [`Control::Error`] frames.
pub mod error_code {
    /// The stream's owner dropped it without finishing (quinn's default code).
    pub const DROPPED: u32 = 0;
    /// The job was cancelled.
    pub const CANCELLED: u32 = 1;
    /// The peer broke the job stream protocol (bad frame, wrong job, cap exceeded ...).
    pub const PROTOCOL: u32 = 2;
    /// An internal failure on the side that reset the stream.
    pub const INTERNAL: u32 = 3;
    /// The endpoint is shutting down.
    pub const SHUTDOWN: u32 = 4;
    /// The receiver has no room for the job's frames now (its receive budget is spent): try
    /// again later or elsewhere.
    pub const BUSY: u32 = 5;
    /// An admin request that is well formed but cannot be served as asked (an expert nobody
    /// serves, a prompt too long, bad sampling settings).
    pub const REFUSED: u32 = 6;
    /// An admin request about a job the cluster does not have.
    pub const NOT_FOUND: u32 = 7;
}

/// What the job stream rules need to know about a frame, read from an owned or an archived
/// message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameFacts<'a> {
    /// The job the frame names, if any.
    pub job_id: Option<JobId>,
    /// Whether it is an Open frame.
    pub is_open: bool,
    /// Layer and kind, for a code frame.
    pub code: Option<(u16, CodeKind)>,
    /// The reason, for a Cancel frame.
    pub cancel: Option<&'a str>,
}

impl<'a> FrameFacts<'a> {
    /// Facts of an owned message.
    pub fn of(msg: &'a Message) -> Self {
        Self {
            job_id: msg.job_id(),
            is_open: matches!(msg, Message::Control(Control::Open { .. })),
            code: match msg {
                Message::Code(f) => Some((f.code.layer, f.code.kind)),
                Message::Control(_) => None,
            },
            cancel: match msg {
                Message::Control(Control::Cancel { reason, .. }) => Some(reason),
                _ => None,
            },
        }
    }

    /// Facts of an archived message, read in place.
    pub fn of_archived(msg: &'a ArchivedMessage) -> Self {
        match msg {
            ArchivedMessage::Code(f) => Self {
                job_id: Some(f.job_id.get()),
                is_open: false,
                code: Some((f.code.layer.to_native(), CodeKind(f.code.kind.0))),
                cancel: None,
            },
            ArchivedMessage::Control(c) => Self {
                job_id: match c {
                    ArchivedControl::Hello { .. }
                    | ArchivedControl::Inspect { .. }
                    | ArchivedControl::Report { .. }
                    | ArchivedControl::Change { .. } => None,
                    ArchivedControl::Open { job_id, .. }
                    | ArchivedControl::JobStatus { job_id, .. }
                    | ArchivedControl::Cancel { job_id, .. }
                    | ArchivedControl::Watch { job_id }
                    | ArchivedControl::Tokens { job_id, .. } => Some(job_id.get()),
                    ArchivedControl::PrefillRequest(r) => Some(r.job_id.get()),
                    ArchivedControl::Submit(r) => Some(r.job_id.get()),
                    ArchivedControl::Error { job_id, .. } => job_id.as_ref().map(|j| j.get()),
                },
                is_open: matches!(c, ArchivedControl::Open { .. }),
                code: None,
                cancel: match c {
                    ArchivedControl::Cancel { reason, .. } => Some(reason.as_str()),
                    _ => None,
                },
            },
        }
    }
}

/// A frame that breaks the job stream rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolViolation {
    /// The first frame on a job stream must be [`Control::Open`].
    #[error("a job stream must start with an Open frame")]
    MissingOpen,
    /// An Open frame after the first.
    #[error("a second Open frame on job {0}")]
    DuplicateOpen(JobId),
    /// A frame of another job on this job's stream.
    #[error("frame of job {} on the stream of job {expected}",
        got.map_or_else(|| "none".to_owned(), |j| j.to_string()))]
    WrongJob {
        /// The stream's job.
        expected: JobId,
        /// The frame's job (None for a message without one).
        got: Option<JobId>,
    },
    /// The job's bytes exceed the cap.
    #[error("job {job} exceeds its cap of {max} bytes ({total} bytes so far)")]
    JobTooLarge {
        /// The job.
        job: JobId,
        /// Bytes including this frame.
        total: u64,
        /// The cap.
        max: u64,
    },
    /// Layers go backwards.
    #[error("layer {got} after layer {last} on job {job}")]
    LayerOutOfOrder {
        /// The job.
        job: JobId,
        /// The last layer seen.
        last: u16,
        /// This frame's layer.
        got: u16,
    },
    /// The same (layer, kind) twice.
    #[error("layer {layer} kind {kind} sent twice on job {job}")]
    DuplicateCode {
        /// The job.
        job: JobId,
        /// The layer.
        layer: u16,
        /// The kind.
        kind: u8,
    },
    /// A frame after the job ended.
    #[error("frame after the end of job {0}")]
    AfterEnd(JobId),
}

/// How a job stream ended, as far as one side knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEnd {
    /// All frames were delivered.
    Finished,
    /// Cancelled on this side.
    CancelledLocally,
    /// Cancelled by the peer, with its reason if it sent one.
    CancelledByPeer(Option<String>),
    /// Failed.
    Failed(String),
}

/// How the connection under a job was lost, as far as the job rules care.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionLoss {
    /// This side closed it.
    ClosedLocally,
    /// The peer closed it, reset it, or stopped answering; the cause, for operators.
    Peer(String),
}

/// Why reading a job stream's next frame failed, in the terms the job rules need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadFailure {
    /// The bytes are not a valid frame.
    Malformed(DecodeError),
    /// The stream ended inside a frame.
    Truncated,
    /// The frame does not fit in the receive budget.
    OverBudget(BudgetError),
    /// The peer reset its half with this code.
    Reset(u64),
    /// The connection is gone.
    Lost(ConnectionLoss),
    /// The stream was already closed on this side.
    Closed,
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
    /// The receiver's half of the stream carried something that is not a valid reply.
    #[error("bad reply from the receiver: {0}")]
    BadReply(String),
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
    Encode(#[from] EncodeError),
    /// This side's stream or writer task failed (closed under it, or the task panicked).
    #[error("job stream writer failed: {0}")]
    Internal(String),
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
    /// A frame did not fit in the node's receive budget; the job was refused with
    /// [`error_code::BUSY`].
    #[error(transparent)]
    OverBudget(#[from] BudgetError),
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

impl From<ConnectionLoss> for SendError {
    fn from(l: ConnectionLoss) -> Self {
        match l {
            ConnectionLoss::ClosedLocally => SendError::ConnectionClosed,
            ConnectionLoss::Peer(why) => SendError::PeerGone(why),
        }
    }
}

impl From<ConnectionLoss> for RecvError {
    fn from(l: ConnectionLoss) -> Self {
        match l {
            ConnectionLoss::ClosedLocally => RecvError::ConnectionClosed,
            ConnectionLoss::Peer(why) => RecvError::PeerGone(why),
        }
    }
}

/// What to do with this side's sending half when a job ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendHalf {
    /// Leave it (already finished, or the connection is gone).
    Keep,
    /// Finish it: the peer reads what was written, then the end.
    Finish,
    /// Reset it with this code: the peer's reads fail with it.
    Reset(u32),
}

/// How a driver ends its side of a job stream, carried out in this order: write `reply` on the
/// sending half (waiting at most a short grace period: the peer may not be reading), close the
/// sending half as `send` says, then stop the peer's half with `stop`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndAction {
    /// A control frame for the peer (why the job ends).
    pub reply: Option<Control>,
    /// Our sending half.
    pub send: SendHalf,
    /// Stop the peer's sending half with this code.
    pub stop: Option<u32>,
}

impl EndAction {
    /// Nothing to do (the connection is gone, or the halves are already closed).
    pub const NOTHING: EndAction = EndAction {
        reply: None,
        send: SendHalf::Keep,
        stop: None,
    };
}

/// What a receiver does after a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecvStep {
    /// Hand the frame to the application.
    Deliver,
    /// The sender finished the job and everything was delivered.
    Finished(EndAction),
    /// The job ends with this error.
    Failed(EndAction, RecvError),
}

/// Checks one direction of one job stream, frame by frame, and decides how the job ends.
#[derive(Debug, Clone)]
pub struct JobTracker {
    max_job_bytes: u64,
    job: Option<JobId>,
    bytes: u64,
    frames: u64,
    layer: Option<u16>,
    kinds_at_layer: [u64; 4],
    end: Option<JobEnd>,
}

impl JobTracker {
    /// A tracker for a new stream whose frames may total `max_job_bytes`.
    pub fn new(max_job_bytes: u64) -> Self {
        Self {
            max_job_bytes,
            job: None,
            bytes: 0,
            frames: 0,
            layer: None,
            kinds_at_layer: [0; 4],
            end: None,
        }
    }

    /// The stream's job, once its Open frame passed.
    pub fn job_id(&self) -> Option<JobId> {
        self.job
    }

    /// Frame bytes (headers included) admitted so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Frames admitted so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// How the job ended, if it did.
    pub fn end(&self) -> Option<&JobEnd> {
        self.end.as_ref()
    }

    /// Whether the job ended on this side.
    pub fn is_ended(&self) -> bool {
        self.end.is_some()
    }

    /// Record the end of the job; the first end wins.
    pub fn set_end(&mut self, end: JobEnd) {
        if self.end.is_none() {
            self.end = Some(end);
        }
    }

    /// Admit a message of `frame_len` bytes, or say which rule it breaks. A refused frame
    /// changes nothing.
    pub fn admit(&mut self, msg: &Message, frame_len: usize) -> Result<(), ProtocolViolation> {
        self.admit_facts(FrameFacts::of(msg), frame_len)
    }

    /// [`admit`](Self::admit) from the facts of a frame (owned or archived).
    pub fn admit_facts(
        &mut self,
        facts: FrameFacts<'_>,
        frame_len: usize,
    ) -> Result<(), ProtocolViolation> {
        let Some(job) = self.job else {
            return match facts {
                FrameFacts {
                    is_open: true,
                    job_id: Some(job_id),
                    ..
                } => {
                    self.charge(job_id, frame_len)?;
                    self.job = Some(job_id);
                    self.frames += 1;
                    Ok(())
                }
                _ => Err(ProtocolViolation::MissingOpen),
            };
        };
        if self.end.is_some() {
            return Err(ProtocolViolation::AfterEnd(job));
        }
        if facts.is_open {
            return Err(ProtocolViolation::DuplicateOpen(job));
        }
        if facts.job_id != Some(job) {
            return Err(ProtocolViolation::WrongJob {
                expected: job,
                got: facts.job_id,
            });
        }
        if let Some((layer, kind)) = facts.code {
            self.check_order(job, layer, kind)?;
            self.charge(job, frame_len)?;
            if self.layer != Some(layer) {
                self.layer = Some(layer);
                self.kinds_at_layer = [0; 4];
            }
            self.kinds_at_layer[usize::from(kind.0 / 64)] |= 1 << (kind.0 % 64);
        } else {
            self.charge(job, frame_len)?;
        }
        self.frames += 1;
        Ok(())
    }

    fn check_order(&self, job: JobId, layer: u16, kind: CodeKind) -> Result<(), ProtocolViolation> {
        match self.layer {
            Some(last) if layer < last => Err(ProtocolViolation::LayerOutOfOrder {
                job,
                last,
                got: layer,
            }),
            Some(last)
                if layer == last
                    && self.kinds_at_layer[usize::from(kind.0 / 64)] & (1 << (kind.0 % 64))
                        != 0 =>
            {
                Err(ProtocolViolation::DuplicateCode {
                    job,
                    layer,
                    kind: kind.0,
                })
            }
            _ => Ok(()),
        }
    }

    fn charge(&mut self, job: JobId, frame_len: usize) -> Result<(), ProtocolViolation> {
        let total = self.bytes.saturating_add(frame_len as u64);
        if total > self.max_job_bytes {
            return Err(ProtocolViolation::JobTooLarge {
                job,
                total,
                max: self.max_job_bytes,
            });
        }
        self.bytes = total;
        Ok(())
    }

    // ----- receiving side -----

    /// A validated frame arrived on the receiving side: deliver it, or end the job. A Cancel
    /// frame ends the job with [`RecvError::CancelledByPeer`]; a frame that breaks the rules
    /// rejects it.
    pub fn on_frame(&mut self, facts: FrameFacts<'_>, frame_len: usize) -> RecvStep {
        if self.end.is_some() {
            return RecvStep::Failed(EndAction::NOTHING, RecvError::Ended);
        }
        if let Err(v) = self.admit_facts(facts, frame_len) {
            return self.reject(RecvError::Protocol(v));
        }
        if let Some(reason) = facts.cancel {
            let reason = Some(reason.to_owned());
            self.set_end(JobEnd::CancelledByPeer(reason.clone()));
            // Our half ends cleanly; the sender has reset or will finish its own.
            let action = EndAction {
                send: SendHalf::Finish,
                ..EndAction::NOTHING
            };
            return RecvStep::Failed(action, RecvError::CancelledByPeer { reason });
        }
        RecvStep::Deliver
    }

    /// The sender's half ended cleanly between frames.
    pub fn on_end_of_stream(&mut self) -> RecvStep {
        if self.end.is_some() {
            return RecvStep::Failed(EndAction::NOTHING, RecvError::Ended);
        }
        if self.job.is_none() {
            return self.reject(RecvError::Protocol(ProtocolViolation::MissingOpen));
        }
        self.set_end(JobEnd::Finished);
        RecvStep::Finished(EndAction {
            send: SendHalf::Finish,
            ..EndAction::NOTHING
        })
    }

    /// Reading the next frame failed.
    pub fn on_read_failure(&mut self, failure: ReadFailure) -> RecvStep {
        if self.end.is_some() {
            return RecvStep::Failed(EndAction::NOTHING, RecvError::Ended);
        }
        let (action, error) = match failure {
            ReadFailure::Malformed(e) => return self.reject(RecvError::Decode(e)),
            ReadFailure::OverBudget(e) => return self.reject(RecvError::OverBudget(e)),
            // The sender finished inside a frame: there is nothing to tell it that it reads.
            ReadFailure::Truncated => (
                EndAction {
                    send: SendHalf::Reset(error_code::PROTOCOL),
                    ..EndAction::NOTHING
                },
                RecvError::Truncated,
            ),
            ReadFailure::Reset(code) => (
                EndAction {
                    send: SendHalf::Reset(error_code::CANCELLED),
                    ..EndAction::NOTHING
                },
                if code == u64::from(error_code::CANCELLED) {
                    RecvError::CancelledByPeer { reason: None }
                } else {
                    RecvError::Aborted(code)
                },
            ),
            ReadFailure::Lost(loss) => (EndAction::NOTHING, loss.into()),
            ReadFailure::Closed => (EndAction::NOTHING, RecvError::Ended),
        };
        self.set_end(match &error {
            RecvError::CancelledByPeer { reason } => JobEnd::CancelledByPeer(reason.clone()),
            e => JobEnd::Failed(e.to_string()),
        });
        RecvStep::Failed(action, error)
    }

    /// The job stream was accepted but not named within the open timeout.
    pub fn on_open_timeout(&mut self) -> EndAction {
        self.set_end(JobEnd::Failed("not named in time".into()));
        EndAction {
            reply: Some(Control::Error {
                job_id: None,
                code: error_code::PROTOCOL,
                message: "job stream not named in time".into(),
            }),
            send: SendHalf::Finish,
            stop: Some(error_code::PROTOCOL),
        }
    }

    /// The application on the receiving side cancels the job; `None` when it already ended.
    pub fn cancel_locally(&mut self, reason: &str) -> Option<EndAction> {
        if self.end.is_some() {
            return None;
        }
        self.set_end(JobEnd::CancelledLocally);
        Some(EndAction {
            reply: self.job.map(|job_id| Control::Cancel {
                job_id,
                reason: reason.to_owned(),
            }),
            send: SendHalf::Finish,
            stop: Some(error_code::CANCELLED),
        })
    }

    /// Refuse the rest of the job after a bad frame: tell the sender why, end our half, stop
    /// its half with [`error_code::PROTOCOL`] (or [`error_code::BUSY`] when the frame was fine
    /// but this node had no room for it).
    fn reject(&mut self, error: RecvError) -> RecvStep {
        self.set_end(JobEnd::Failed(error.to_string()));
        let code = match error {
            RecvError::OverBudget(_) => error_code::BUSY,
            _ => error_code::PROTOCOL,
        };
        let message = match &error {
            // rkyv's text names addresses in this process's heap: kept in the local error, not
            // sent to the peer.
            RecvError::Decode(DecodeError::Invalid(_)) => {
                "bad frame: the body is not a valid archive of a message".to_owned()
            }
            e => e.to_string(),
        };
        let action = EndAction {
            reply: Some(Control::Error {
                job_id: self.job,
                code,
                message,
            }),
            send: SendHalf::Finish,
            stop: Some(code),
        };
        RecvStep::Failed(action, error)
    }
}

// ----- sending side -----

/// What the receiver's half of a job stream brought back that ends the job, as the sender
/// reads it. (Status reports do not end a job and are not events.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A Cancel frame, with its reason.
    Cancel(String),
    /// An Error frame.
    Error {
        /// Its code.
        code: u32,
        /// Its message.
        message: String,
    },
    /// The receiver finished its half.
    End,
    /// Reading the receiver's half failed.
    Failed(ReadFailure),
}

/// What ended the sending side of a job stream, as its writer saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEvent {
    /// The application cancelled the job (or dropped its sender).
    CancelledLocally,
    /// The receiver's half brought `reply`; `all_sent`: our half was already finished with every
    /// frame written.
    Replied {
        /// What came back.
        reply: Reply,
        /// Whether every frame was written and our half finished.
        all_sent: bool,
    },
    /// The receiver stopped our half with `code`. `reply` is what its half brought within a
    /// short grace period (a receiver writes its Cancel or Error frame before it stops us);
    /// `None` when nothing came in time.
    Stopped {
        /// The stop code.
        code: u64,
        /// What came back, if anything.
        reply: Option<Reply>,
    },
    /// Writing failed because the connection is gone.
    WriteLost(ConnectionLoss),
    /// Writing failed because our half was already closed under the writer.
    WriteClosed,
}

/// Decide how the sending side ends after `event`: what to do with the halves, and what the
/// application is told (`Ok` only for a job whose every frame the receiver read).
pub fn sender_end(event: SenderEvent) -> (EndAction, Result<(), SendError>) {
    let reset = |code| EndAction {
        send: SendHalf::Reset(code),
        ..EndAction::NOTHING
    };
    match event {
        SenderEvent::CancelledLocally => (
            EndAction {
                reply: None,
                send: SendHalf::Reset(error_code::CANCELLED),
                stop: Some(error_code::CANCELLED),
            },
            Err(SendError::Cancelled),
        ),
        SenderEvent::Replied {
            reply: Reply::End,
            all_sent: true,
        } => (EndAction::NOTHING, Ok(())),
        SenderEvent::Replied {
            reply: Reply::End,
            all_sent: false,
        } => (
            reset(error_code::CANCELLED),
            Err(SendError::Rejected {
                code: error_code::DROPPED,
                message: "receiver ended the job before reading it all".into(),
            }),
        ),
        SenderEvent::Replied { reply, .. } => match reply_error(reply) {
            // The connection is gone: there is no stream left to reset.
            e @ (SendError::PeerGone(_) | SendError::ConnectionClosed) => {
                (EndAction::NOTHING, Err(e))
            }
            e @ (SendError::CancelledByPeer { .. } | SendError::Rejected { .. }) => {
                (reset(error_code::CANCELLED), Err(e))
            }
            e => (reset(error_code::INTERNAL), Err(e)),
        },
        SenderEvent::Stopped { code, reply } => {
            // Our half is stopped already; stop theirs, which may still be sending us status.
            let action = EndAction {
                stop: Some(error_code::CANCELLED),
                ..EndAction::NOTHING
            };
            let error = match reply {
                Some(r @ (Reply::Cancel(_) | Reply::Error { .. } | Reply::Failed(_))) => {
                    reply_error(r)
                }
                _ if code == u64::from(error_code::CANCELLED) => {
                    SendError::CancelledByPeer { reason: None }
                }
                _ => SendError::Rejected {
                    code: u32::try_from(code).unwrap_or(u32::MAX),
                    message: "receiver stopped the job stream".into(),
                },
            };
            (action, Err(error))
        }
        SenderEvent::WriteLost(loss) => (EndAction::NOTHING, Err(loss.into())),
        SenderEvent::WriteClosed => (
            EndAction {
                stop: Some(error_code::INTERNAL),
                ..EndAction::NOTHING
            },
            Err(SendError::Internal(
                "the job stream was closed under its writer".into(),
            )),
        ),
    }
}

/// The sender's error for a reply that ends the job.
fn reply_error(reply: Reply) -> SendError {
    match reply {
        Reply::Cancel(reason) => SendError::CancelledByPeer {
            reason: Some(reason),
        },
        Reply::Error { code, message } => SendError::Rejected { code, message },
        Reply::End => SendError::Rejected {
            code: error_code::DROPPED,
            message: "receiver ended the job before reading it all".into(),
        },
        Reply::Failed(ReadFailure::Reset(code)) => SendError::Rejected {
            code: u32::try_from(code).unwrap_or(u32::MAX),
            message: "receiver reset its half of the job stream".into(),
        },
        Reply::Failed(ReadFailure::Lost(loss)) => loss.into(),
        Reply::Failed(ReadFailure::Malformed(e)) => SendError::BadReply(e.to_string()),
        Reply::Failed(ReadFailure::OverBudget(e)) => SendError::BadReply(e.to_string()),
        Reply::Failed(ReadFailure::Truncated) => {
            SendError::BadReply("the receiver's half ended inside a frame".into())
        }
        Reply::Failed(ReadFailure::Closed) => {
            SendError::Internal("the receiver's half was closed on this side".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CodeFrame;
    use scd_types::{CodeDType, LayerCode, TraceContext};

    const J: JobId = JobId::from_u128(42);

    fn open(job: JobId) -> Message {
        Message::Control(Control::Open {
            job_id: job,
            trace: TraceContext::new(),
        })
    }

    fn code(job: JobId, layer: u16, kind: CodeKind) -> Message {
        Message::Code(CodeFrame::new(
            job,
            LayerCode {
                layer,
                kind,
                dtype: CodeDType::F16,
                shape: vec![],
                bytes: vec![0, 0],
            },
        ))
    }

    fn cancel(job: JobId, reason: &str) -> Message {
        Message::Control(Control::Cancel {
            job_id: job,
            reason: reason.into(),
        })
    }

    /// A tracker that has admitted the Open frame of `J`.
    fn opened(max: u64) -> JobTracker {
        let mut t = JobTracker::new(max);
        assert_eq!(t.on_frame(FrameFacts::of(&open(J)), 1), RecvStep::Deliver);
        t
    }

    fn stop_code(step: &RecvStep) -> Option<u32> {
        match step {
            RecvStep::Failed(a, _) | RecvStep::Finished(a) => a.stop,
            RecvStep::Deliver => None,
        }
    }

    #[test]
    fn open_first_then_ordered_layers() {
        let mut t = JobTracker::new(1 << 20);
        assert_eq!(
            t.admit(&code(J, 0, CodeKind::REUSE_K), 10),
            Err(ProtocolViolation::MissingOpen)
        );
        t.admit(&open(J), 10).unwrap();
        assert_eq!(t.job_id(), Some(J));
        t.admit(&code(J, 0, CodeKind::REUSE_K), 10).unwrap();
        t.admit(&code(J, 0, CodeKind::REUSE_V), 10).unwrap();
        assert!(matches!(
            t.admit(&code(J, 0, CodeKind::REUSE_K), 10),
            Err(ProtocolViolation::DuplicateCode {
                layer: 0,
                kind: 0,
                ..
            })
        ));
        t.admit(&code(J, 3, CodeKind::REUSE_K), 10).unwrap();
        assert!(matches!(
            t.admit(&code(J, 2, CodeKind::PATCH_H), 10),
            Err(ProtocolViolation::LayerOutOfOrder {
                last: 3,
                got: 2,
                ..
            })
        ));
        assert_eq!(
            t.admit(&code(JobId::from_u128(7), 4, CodeKind::REUSE_K), 10),
            Err(ProtocolViolation::WrongJob {
                expected: J,
                got: Some(JobId::from_u128(7))
            })
        );
        assert!(matches!(
            t.admit(&open(J), 10),
            Err(ProtocolViolation::DuplicateOpen(_))
        ));
        // Kinds beyond the named ones are tracked too.
        t.admit(&code(J, 3, CodeKind(200)), 10).unwrap();
        assert!(t.admit(&code(J, 3, CodeKind(200)), 10).is_err());
        assert_eq!(t.bytes(), 50);
    }

    #[test]
    fn byte_cap_and_refused_frames_change_nothing() {
        let mut t = JobTracker::new(100);
        t.admit(&open(J), 40).unwrap();
        t.admit(&code(J, 0, CodeKind::RAW_K), 50).unwrap();
        assert_eq!(
            t.admit(&code(J, 1, CodeKind::RAW_K), 11),
            Err(ProtocolViolation::JobTooLarge {
                job: J,
                total: 101,
                max: 100
            })
        );
        assert_eq!(t.bytes(), 90);
        // The refused layer 1 did not move the layer cursor.
        t.admit(&code(J, 0, CodeKind::RAW_V), 10).unwrap();
    }

    #[test]
    fn facts_agree_between_owned_and_archived() {
        let msgs = [
            open(J),
            code(J, 9, CodeKind(201)),
            Message::Control(Control::Error {
                job_id: None,
                code: 1,
                message: "x".into(),
            }),
            cancel(J, "r"),
        ];
        for m in msgs {
            let buf = crate::codec::encode(&m, u32::MAX).unwrap();
            let body = crate::codec::ValidatedFrame::new({
                let mut b = crate::codec::FrameBuf::new();
                b.extend_from_slice(&buf[crate::codec::HEADER_LEN..]);
                b
            })
            .unwrap();
            assert_eq!(FrameFacts::of_archived(body.archived()), FrameFacts::of(&m));
        }
    }

    #[test]
    fn nothing_after_the_end() {
        let mut t = JobTracker::new(100);
        t.admit(&open(J), 1).unwrap();
        t.set_end(JobEnd::CancelledLocally);
        t.set_end(JobEnd::Finished);
        assert_eq!(t.end(), Some(&JobEnd::CancelledLocally));
        assert_eq!(
            t.admit(&code(J, 0, CodeKind::RAW_K), 1),
            Err(ProtocolViolation::AfterEnd(J))
        );
        for step in [
            t.on_frame(FrameFacts::of(&code(J, 0, CodeKind::RAW_K)), 1),
            t.on_end_of_stream(),
            t.on_read_failure(ReadFailure::Truncated),
        ] {
            assert_eq!(step, RecvStep::Failed(EndAction::NOTHING, RecvError::Ended));
        }
        assert_eq!(t.cancel_locally("late"), None);
    }

    #[test]
    fn a_bad_frame_is_answered_with_an_error_and_a_stop() {
        let mut t = opened(1 << 20);
        let step = t.on_frame(FrameFacts::of(&code(J, 0, CodeKind::RAW_K)), 10);
        assert_eq!(step, RecvStep::Deliver);
        let step = t.on_frame(FrameFacts::of(&code(J, 0, CodeKind::RAW_K)), 10);
        let RecvStep::Failed(action, RecvError::Protocol(v)) = step else {
            panic!("{step:?}")
        };
        assert!(matches!(v, ProtocolViolation::DuplicateCode { .. }));
        assert_eq!(action.send, SendHalf::Finish);
        assert_eq!(action.stop, Some(error_code::PROTOCOL));
        assert_eq!(
            action.reply,
            Some(Control::Error {
                job_id: Some(J),
                code: error_code::PROTOCOL,
                message: v.to_string()
            })
        );
        assert!(matches!(t.end(), Some(JobEnd::Failed(_))));

        // Malformed bytes are rejected the same way; a spent budget says "busy", not "bad".
        let mut t = opened(1 << 20);
        let step = t.on_read_failure(ReadFailure::Malformed(DecodeError::ReservedBits));
        assert_eq!(stop_code(&step), Some(error_code::PROTOCOL));
        assert!(matches!(step, RecvStep::Failed(_, RecvError::Decode(_))));
        let mut t = opened(1 << 20);
        let step = t.on_read_failure(ReadFailure::OverBudget(BudgetError::Exhausted {
            requested: 2,
            in_use: 1,
            total: 2,
        }));
        assert_eq!(stop_code(&step), Some(error_code::BUSY));
        let RecvStep::Failed(action, _) = step else {
            panic!()
        };
        assert!(matches!(
            action.reply,
            Some(Control::Error {
                code: error_code::BUSY,
                ..
            })
        ));

        // A stream that ends before naming its job breaks the rules too; its Error has no job.
        let mut t = JobTracker::new(1 << 20);
        let RecvStep::Failed(action, e) = t.on_end_of_stream() else {
            panic!()
        };
        assert_eq!(e, RecvError::Protocol(ProtocolViolation::MissingOpen));
        assert!(matches!(
            action.reply,
            Some(Control::Error { job_id: None, .. })
        ));
    }

    #[test]
    fn clean_ends_cancels_and_resets_on_the_receiving_side() {
        let mut t = opened(1 << 20);
        assert_eq!(
            t.on_end_of_stream(),
            RecvStep::Finished(EndAction {
                send: SendHalf::Finish,
                ..EndAction::NOTHING
            })
        );
        assert_eq!(t.end(), Some(&JobEnd::Finished));

        let mut t = opened(1 << 20);
        let step = t.on_frame(FrameFacts::of(&cancel(J, "user left")), 10);
        assert_eq!(
            step,
            RecvStep::Failed(
                EndAction {
                    send: SendHalf::Finish,
                    ..EndAction::NOTHING
                },
                RecvError::CancelledByPeer {
                    reason: Some("user left".into())
                }
            )
        );

        // A reset with the cancel code is a cancel; any other code an abort. Either way our
        // half is reset: nobody will read it.
        let mut t = opened(1 << 20);
        let RecvStep::Failed(a, e) = t.on_read_failure(ReadFailure::Reset(1)) else {
            panic!()
        };
        assert_eq!(a.send, SendHalf::Reset(error_code::CANCELLED));
        assert_eq!(e, RecvError::CancelledByPeer { reason: None });
        let mut t = opened(1 << 20);
        let RecvStep::Failed(_, e) = t.on_read_failure(ReadFailure::Reset(9)) else {
            panic!()
        };
        assert_eq!(e, RecvError::Aborted(9));

        let mut t = opened(1 << 20);
        let RecvStep::Failed(a, e) = t.on_read_failure(ReadFailure::Truncated) else {
            panic!()
        };
        assert_eq!(a.send, SendHalf::Reset(error_code::PROTOCOL));
        assert_eq!(e, RecvError::Truncated);

        let mut t = opened(1 << 20);
        let RecvStep::Failed(a, e) =
            t.on_read_failure(ReadFailure::Lost(ConnectionLoss::ClosedLocally))
        else {
            panic!()
        };
        assert_eq!((a, e), (EndAction::NOTHING, RecvError::ConnectionClosed));

        // The receiver cancels: it says why, ends its half and stops the sender's.
        let mut t = opened(1 << 20);
        let a = t.cancel_locally("expert unloaded").unwrap();
        assert_eq!(
            a,
            EndAction {
                reply: Some(Control::Cancel {
                    job_id: J,
                    reason: "expert unloaded".into()
                }),
                send: SendHalf::Finish,
                stop: Some(error_code::CANCELLED),
            }
        );
        assert_eq!(t.end(), Some(&JobEnd::CancelledLocally));
        let a = JobTracker::new(1).on_open_timeout();
        assert_eq!(a.stop, Some(error_code::PROTOCOL));
    }

    #[test]
    fn the_sending_side_ends_as_the_receiver_said() {
        use SenderEvent as E;
        assert_eq!(
            sender_end(E::CancelledLocally),
            (
                EndAction {
                    reply: None,
                    send: SendHalf::Reset(error_code::CANCELLED),
                    stop: Some(error_code::CANCELLED)
                },
                Err(SendError::Cancelled)
            )
        );
        assert_eq!(
            sender_end(E::Replied {
                reply: Reply::End,
                all_sent: true
            }),
            (EndAction::NOTHING, Ok(()))
        );
        let (a, r) = sender_end(E::Replied {
            reply: Reply::End,
            all_sent: false,
        });
        assert_eq!(a.send, SendHalf::Reset(error_code::CANCELLED));
        assert!(matches!(
            r,
            Err(SendError::Rejected {
                code: error_code::DROPPED,
                ..
            })
        ));
        let (a, r) = sender_end(E::Replied {
            reply: Reply::Cancel("no room".into()),
            all_sent: false,
        });
        assert_eq!(a.send, SendHalf::Reset(error_code::CANCELLED));
        assert_eq!(
            r,
            Err(SendError::CancelledByPeer {
                reason: Some("no room".into())
            })
        );
        // A garbled reply is the receiver's fault, not a rejection, and resets as internal.
        let (a, r) = sender_end(E::Replied {
            reply: Reply::Failed(ReadFailure::Malformed(DecodeError::BadMagic(*b"XXXX"))),
            all_sent: false,
        });
        assert_eq!(a.send, SendHalf::Reset(error_code::INTERNAL));
        assert!(matches!(r, Err(SendError::BadReply(_))));
        let (a, r) = sender_end(E::Replied {
            reply: Reply::Failed(ReadFailure::Lost(ConnectionLoss::Peer("timed out".into()))),
            all_sent: true,
        });
        assert_eq!(a, EndAction::NOTHING);
        assert_eq!(r, Err(SendError::PeerGone("timed out".into())));
    }

    #[test]
    fn a_stopped_sender_reports_the_reason_the_receiver_wrote() {
        use SenderEvent as E;
        let stopped = |code, reply| sender_end(E::Stopped { code, reply });
        let (a, r) = stopped(
            2,
            Some(Reply::Error {
                code: 2,
                message: "layer 3 after layer 4".into(),
            }),
        );
        assert_eq!(
            a,
            EndAction {
                stop: Some(error_code::CANCELLED),
                ..EndAction::NOTHING
            }
        );
        assert_eq!(
            r,
            Err(SendError::Rejected {
                code: 2,
                message: "layer 3 after layer 4".into()
            })
        );
        // No reason in time: the stop code alone says what happened.
        assert_eq!(
            stopped(1, None).1,
            Err(SendError::CancelledByPeer { reason: None })
        );
        assert!(matches!(
            stopped(0, Some(Reply::End)).1,
            Err(SendError::Rejected { code: 0, .. })
        ));
        assert_eq!(
            sender_end(E::WriteLost(ConnectionLoss::ClosedLocally)),
            (EndAction::NOTHING, Err(SendError::ConnectionClosed))
        );
    }
}
