//! Job stream bookkeeping without I/O: which job a stream carries, per-job byte caps, layer
//! ordering, and how a job ended. The async drivers in [`crate::stream`] feed every frame they
//! send or receive through a [`JobTracker`].

use crate::wire::{ArchivedControl, ArchivedMessage, CodeKind, Control, JobId, Message};

/// What the job stream rules need to know about a frame, read from an owned or an archived
/// message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameFacts {
    /// The job the frame names, if any.
    pub job_id: Option<JobId>,
    /// Whether it is an Open frame.
    pub is_open: bool,
    /// Layer and kind, for a code frame.
    pub code: Option<(u16, CodeKind)>,
}

impl FrameFacts {
    /// Facts of an owned message.
    pub fn of(msg: &Message) -> Self {
        Self {
            job_id: msg.job_id(),
            is_open: matches!(msg, Message::Control(Control::Open { .. })),
            code: match msg {
                Message::Code(f) => Some((f.layer, f.kind)),
                Message::Control(_) => None,
            },
        }
    }

    /// Facts of an archived message, read in place.
    pub fn of_archived(msg: &ArchivedMessage) -> Self {
        let job = |j: &crate::wire::ArchivedJobId| JobId(j.0.to_native());
        match msg {
            ArchivedMessage::Code(f) => Self {
                job_id: Some(job(&f.job_id)),
                is_open: false,
                code: Some((f.layer.to_native(), CodeKind(f.kind.0))),
            },
            ArchivedMessage::Control(c) => Self {
                job_id: match c {
                    ArchivedControl::Hello { .. } => None,
                    ArchivedControl::Open { job_id, .. }
                    | ArchivedControl::JobStatus { job_id, .. }
                    | ArchivedControl::Cancel { job_id, .. } => Some(job(job_id)),
                    ArchivedControl::PrefillRequest(r) => Some(job(&r.job_id)),
                    ArchivedControl::Error { job_id, .. } => job_id.as_ref().map(job),
                },
                is_open: matches!(c, ArchivedControl::Open { .. }),
                code: None,
            },
        }
    }
}

/// QUIC application error codes used to reset or stop job streams and close connections.
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
    #[error("frame of job {got} on the stream of job {expected}")]
    WrongJob {
        /// The stream's job.
        expected: JobId,
        /// The frame's job (None for a message without one).
        got: String,
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

/// Checks one direction of one job stream, frame by frame.
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
        facts: FrameFacts,
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
        match facts.job_id {
            Some(id) if id == job => {}
            other => {
                return Err(ProtocolViolation::WrongJob {
                    expected: job,
                    got: other.map_or_else(|| "none".to_owned(), |j| j.to_string()),
                })
            }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodeFrame, DType};

    const J: JobId = JobId(42);

    fn open(job: JobId) -> Message {
        Message::Control(Control::Open {
            job_id: job,
            trace: vec![],
        })
    }

    fn code(job: JobId, layer: u16, kind: CodeKind) -> Message {
        Message::Code(CodeFrame {
            job_id: job,
            layer,
            kind,
            dtype: DType::F16,
            shape: vec![],
            translator: [0; 32],
            trace: vec![],
            payload: vec![],
        })
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
        assert!(matches!(
            t.admit(&code(JobId(7), 4, CodeKind::REUSE_K), 10),
            Err(ProtocolViolation::WrongJob { .. })
        ));
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
            Message::Control(Control::Cancel {
                job_id: J,
                reason: "r".into(),
            }),
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
    }
}
