//! The messages that cross the wire. They are rkyv archives; [`crate::codec`] frames and
//! validates them. Everything here is plain data (bytes, shapes, ids): no tensors, no model types.

use std::fmt;
use std::str::FromStr;

use rkyv::{Archive, Deserialize, Serialize};

/// The wire protocol version. It is in the ALPN string (so a peer with another version fails
/// the TLS handshake) and in every frame header (so a stray frame of another version is refused).
pub const PROTOCOL_VERSION: u16 = 1;

/// A job's id: 128 bits, shown as 32 lower-case hex digits.
#[derive(
    Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct JobId(pub u128);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A job id string that is not 1 to 32 hex digits.
#[derive(Debug, thiserror::Error)]
#[error("job id {0:?} is not 1 to 32 hex digits")]
pub struct ParseJobIdError(String);

impl FromStr for JobId {
    type Err = ParseJobIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 32 {
            return Err(ParseJobIdError(s.to_owned()));
        }
        u128::from_str_radix(s, 16)
            .map(JobId)
            .map_err(|_| ParseJobIdError(s.to_owned()))
    }
}

/// What a code frame holds. A `u8` with named values rather than a Rust enum, so that a newer
/// peer's kinds still decode (the application decides what to do with a kind it does not know).
#[derive(
    Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct CodeKind(pub u8);

impl CodeKind {
    /// Reuse code for keys (`Z_K`).
    pub const REUSE_K: CodeKind = CodeKind(0);
    /// Reuse code for values (`Z_V`).
    pub const REUSE_V: CodeKind = CodeKind(1);
    /// Patch code for the hidden state (`Z_H`).
    pub const PATCH_H: CodeKind = CodeKind(2);
    /// Raw keys (the raw-KV baseline).
    pub const RAW_K: CodeKind = CodeKind(3);
    /// Raw values (the raw-KV baseline).
    pub const RAW_V: CodeKind = CodeKind(4);
    /// A raw hidden state.
    pub const HIDDEN: CodeKind = CodeKind(5);
    /// Quantised keys (the q4 baseline).
    pub const QUANT_K: CodeKind = CodeKind(6);
    /// Quantised values (the q4 baseline).
    pub const QUANT_V: CodeKind = CodeKind(7);
    /// Scales or other side data that go with a quantised or coded tensor.
    pub const AUX: CodeKind = CodeKind(8);

    /// A short name for logs; `None` for a kind this version does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::REUSE_K => "reuse_k",
            Self::REUSE_V => "reuse_v",
            Self::PATCH_H => "patch_h",
            Self::RAW_K => "raw_k",
            Self::RAW_V => "raw_v",
            Self::HIDDEN => "hidden",
            Self::QUANT_K => "quant_k",
            Self::QUANT_V => "quant_v",
            Self::AUX => "aux",
            _ => return None,
        })
    }
}

/// The element type of a code frame's payload. A `u8` with named values, for the same reason as
/// [`CodeKind`].
#[derive(
    Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct DType(pub u8);

impl DType {
    /// IEEE f32, little-endian.
    pub const F32: DType = DType(0);
    /// IEEE f16, little-endian.
    pub const F16: DType = DType(1);
    /// bfloat16, little-endian.
    pub const BF16: DType = DType(2);
    /// Unsigned bytes.
    pub const U8: DType = DType(3);
    /// Signed bytes.
    pub const I8: DType = DType(4);
    /// u32, little-endian.
    pub const U32: DType = DType(5);
    /// Packed 4-bit values, two per byte (quantised baselines).
    pub const Q4: DType = DType(6);

    /// Bits per element; `None` for a dtype this version does not know.
    pub fn bits(self) -> Option<usize> {
        Some(match self {
            Self::F32 | Self::U32 => 32,
            Self::F16 | Self::BF16 => 16,
            Self::U8 | Self::I8 => 8,
            Self::Q4 => 4,
            _ => return None,
        })
    }
}

/// One key/value pair of a trace context (W3C `traceparent`, `tracestate`, baggage ...).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TraceEntry {
    /// The propagation key.
    pub key: String,
    /// Its value.
    pub value: String,
}

/// A trace context as carried in frames: a short list of string pairs.
pub type TraceContext = Vec<TraceEntry>;

/// One layer's codes (or one part of them) for a job.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct CodeFrame {
    /// The job this frame belongs to.
    pub job_id: JobId,
    /// The transformer layer.
    pub layer: u16,
    /// What the payload holds.
    pub kind: CodeKind,
    /// Element type of the payload.
    pub dtype: DType,
    /// The tensor's shape, outermost first.
    pub shape: Vec<u32>,
    /// Hash of the translator version that produced the codes (zero for raw baselines).
    pub translator: [u8; 32],
    /// Trace context, so one job is one trace across nodes.
    pub trace: TraceContext,
    /// The tensor's bytes, row-major, little-endian.
    pub payload: Vec<u8>,
}

impl CodeFrame {
    /// The payload length implied by shape and dtype, when the dtype is known and it fits.
    pub fn expected_payload_len(&self) -> Option<usize> {
        let bits = self.dtype.bits()?;
        let mut n: usize = 1;
        for &d in &self.shape {
            n = n.checked_mul(d as usize)?;
        }
        Some(n.checked_mul(bits)?.div_ceil(8))
    }
}

/// The prompt of a prefill request.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Prompt {
    /// Already tokenised with the base model's tokenizer.
    Tokens(Vec<u32>),
    /// Plain text; the producer tokenises it.
    Text(String),
}

/// Ask a producer to prefill a prompt and stream its codes to a consumer.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PrefillRequest {
    /// The job.
    pub job_id: JobId,
    /// The base model the producer runs.
    pub base_model: String,
    /// The expert model that will decode.
    pub expert: String,
    /// The prompt.
    pub prompt: Prompt,
    /// The transfer mode (`scd`, `raw`, `q4`, `droidspeak`, ...), as named by the application.
    pub mode: String,
    /// Hash of the translator version the consumer expects.
    pub translator: [u8; 32],
    /// Trace context.
    pub trace: TraceContext,
}

/// Where a job stands, as reported by the side doing the work.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct JobState(pub u8);

impl JobState {
    /// Accepted, not started.
    pub const QUEUED: JobState = JobState(0);
    /// Work in progress.
    pub const RUNNING: JobState = JobState(1);
    /// Finished successfully.
    pub const DONE: JobState = JobState(2);
    /// Failed.
    pub const FAILED: JobState = JobState(3);
    /// Cancelled.
    pub const CANCELLED: JobState = JobState(4);
}

// rkyv generates one struct per struct-like variant, without docs; the allow is scoped to this
// module so the rest of the file keeps the lint.
#[allow(missing_docs)]
mod control {
    use super::{JobId, JobState, PrefillRequest, TraceContext};
    use rkyv::{Archive, Deserialize, Serialize};

    /// Control messages: requests, status, errors, cancellation, greeting.
    #[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    pub enum Control {
        /// The first frame of every job stream: names the job the stream carries.
        Open {
            /// The job.
            job_id: JobId,
            /// Trace context of the span that opened the stream.
            trace: TraceContext,
        },
        /// Greeting: who is speaking and which protocol it speaks.
        Hello {
            /// [`PROTOCOL_VERSION`] of the sender.
            protocol: u16,
            /// The sender's node id.
            node_id: String,
        },
        /// Start a prefill.
        PrefillRequest(PrefillRequest),
        /// Progress of a job.
        JobStatus {
            /// The job.
            job_id: JobId,
            /// Its state.
            state: JobState,
            /// Free text for operators.
            detail: String,
        },
        /// Something went wrong.
        Error {
            /// The job, when the error is about one.
            job_id: Option<JobId>,
            /// A machine-readable code (see [`crate::error_code`] for the values used by this crate).
            code: u32,
            /// What happened, for operators.
            message: String,
        },
        /// Stop working on a job.
        Cancel {
            /// The job.
            job_id: JobId,
            /// Why.
            reason: String,
        },
    }
}
pub use control::{ArchivedControl, Control};

impl Control {
    /// The job a control message is about, if any.
    pub fn job_id(&self) -> Option<JobId> {
        match self {
            Control::Hello { .. } => None,
            Control::PrefillRequest(r) => Some(r.job_id),
            Control::Open { job_id, .. }
            | Control::JobStatus { job_id, .. }
            | Control::Cancel { job_id, .. } => Some(*job_id),
            Control::Error { job_id, .. } => *job_id,
        }
    }
}

/// One frame's content: a control message or a code frame.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Message {
    /// A control message.
    Control(Control),
    /// A code frame.
    Code(CodeFrame),
}

impl Message {
    /// The job this message is about, if any.
    pub fn job_id(&self) -> Option<JobId> {
        match self {
            Message::Control(c) => c.job_id(),
            Message::Code(f) => Some(f.job_id),
        }
    }
}

impl From<Control> for Message {
    fn from(c: Control) -> Self {
        Message::Control(c)
    }
}

impl From<CodeFrame> for Message {
    fn from(f: CodeFrame) -> Self {
        Message::Code(f)
    }
}
