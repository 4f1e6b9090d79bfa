//! The messages that cross the wire. They are rkyv archives; [`crate::codec`] frames and
//! validates them. Everything here is plain data (bytes, shapes, ids): no tensors, no model types.
//! The vocabulary (job ids and states, modes, translator hashes, trace contexts, layer codes) is
//! that of `scd-types`, so a codec's [`LayerCode`] goes into a [`CodeFrame`] as it is.

use rkyv::{Archive, Deserialize, Serialize};
use scd_types::{
    CodeDType, JobId, JobState, LayerCode, Mode, TraceContext, TraceContextError, TranslatorHash,
};

/// The wire protocol version. It is in the ALPN string (so a peer with another version fails
/// the TLS handshake) and in every frame header (so a stray frame of another version is refused).
pub const PROTOCOL_VERSION: u16 = 4;

/// One layer's codes for a job, as they go on the wire.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct CodeFrame {
    /// The job this frame belongs to.
    pub job_id: JobId,
    /// The translator version that produced the codes; `None` for modes whose codes need none
    /// (raw, q4, q2, droidspeak).
    pub translator: Option<TranslatorHash>,
    /// Trace context, so one job is one trace across nodes.
    pub trace: TraceContext,
    /// The codes: layer, kind, dtype, shape and bytes, as the codec made them.
    pub code: LayerCode,
}

impl CodeFrame {
    /// A frame for `code` of `job_id`, without translator or trace context.
    pub fn new(job_id: JobId, code: LayerCode) -> Self {
        Self {
            job_id,
            translator: None,
            trace: TraceContext::new(),
            code,
        }
    }

    /// The same frame, naming the translator version that made the codes.
    pub fn with_translator(mut self, translator: TranslatorHash) -> Self {
        self.translator = Some(translator);
        self
    }

    /// The same frame, with a trace context.
    pub fn with_trace(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
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
    /// The transfer mode.
    pub mode: Mode,
    /// The translator version the consumer expects; `None` for modes without one.
    pub translator: Option<TranslatorHash>,
    /// Trace context.
    pub trace: TraceContext,
}

/// An admin client's job: what `scd submit` sends to a node's admin endpoint. Sampling settings
/// travel in thousandths, so that the message stays plain comparable data.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct SubmitRequest {
    /// The job's id, chosen by the client (so that a retried submit is recognised).
    pub job_id: JobId,
    /// The expert that answers.
    pub expert: String,
    /// The transfer mode.
    pub mode: Mode,
    /// The prompt.
    pub prompt: Prompt,
    /// Apply the model's chat template to a text prompt (as a user message).
    pub chat: bool,
    /// At most this many new tokens.
    pub max_tokens: u32,
    /// Softmax temperature in thousandths; 0 is greedy.
    pub temperature_milli: u32,
    /// Nucleus mass in thousandths, 1 to 1000.
    pub top_p_milli: u32,
    /// Seed of the sampler.
    pub seed: u64,
    /// Trace context of the client's span.
    pub trace: TraceContext,
    /// More experts of the same base served by the same prompt (a fan-out; protocol 3).
    pub fan_out: Vec<String>,
    /// Documents placed before the prompt, by id, served compiled by the producer (SemPIC;
    /// protocol 4).
    pub documents: Vec<String>,
}

// rkyv generates one struct per struct-like variant, without docs; the allow is scoped to this
// module so the rest of the file keeps the lint.
#[allow(missing_docs)]
mod control {
    use super::{JobId, JobState, PrefillRequest, SubmitRequest, TraceContext};
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
            /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION) of the sender.
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
        /// Admin: run a job and follow it (replies: status, tokens, the end).
        Submit(SubmitRequest),
        /// Admin: follow an existing job to its end (replies as for `Submit`).
        Watch {
            /// The job.
            job_id: JobId,
        },
        /// Admin: read the cluster's state: `nodes`, `pools`, `jobs`, `job/<id>` or
        /// `documents`.
        Inspect {
            /// What to read.
            topic: String,
        },
        /// Admin reply to `Inspect`: the state as JSON.
        Report {
            /// The JSON text.
            body: String,
        },
        /// Admin: change the cluster's state: `topic` names the change
        /// (`translators/publish`, `translators/activate`, `translators/rollback`,
        /// `documents/add`), `body` its arguments as JSON. The reply is a `Report` with the result, or an `Error`.
        Change {
            /// What to change.
            topic: String,
            /// Its arguments, as JSON.
            body: String,
        },
        /// Admin reply: tokens the expert generated since the last `Tokens` of this job.
        Tokens {
            /// The job.
            job_id: JobId,
            /// The new tokens.
            tokens: Vec<u32>,
            /// Their text (what they add to the decoded reply).
            text: String,
        },
    }
}
pub use control::{ArchivedControl, Control};

impl Control {
    /// The job a control message is about, if any.
    pub fn job_id(&self) -> Option<JobId> {
        match self {
            Control::Hello { .. }
            | Control::Inspect { .. }
            | Control::Change { .. }
            | Control::Report { .. } => None,
            Control::PrefillRequest(r) => Some(r.job_id),
            Control::Submit(r) => Some(r.job_id),
            Control::Open { job_id, .. }
            | Control::JobStatus { job_id, .. }
            | Control::Cancel { job_id, .. }
            | Control::Watch { job_id }
            | Control::Tokens { job_id, .. } => Some(*job_id),
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

    /// Check what bytecheck cannot: a code's length agrees with its dtype and shape. (An owned
    /// [`TraceContext`] is valid by construction.)
    pub fn check(&self) -> Result<(), ContentError> {
        match self {
            Message::Code(f) => check_code_len(
                f.code.layer,
                f.code.dtype,
                &f.code.shape,
                f.code.bytes.len(),
            ),
            Message::Control(_) => Ok(()),
        }
    }
}

impl ArchivedMessage {
    /// Check what bytecheck cannot, in place: every trace context within its limits (a peer's
    /// frame may carry one built around the validation of [`TraceContext`]), and a code's
    /// length in agreement with its dtype and shape.
    pub fn check(&self) -> Result<(), ContentError> {
        match self {
            ArchivedMessage::Code(f) => {
                TraceContext::from_archived(&f.trace)?;
                let shape: Vec<u32> = f.code.shape.iter().map(|d| d.to_native()).collect();
                check_code_len(
                    f.code.layer.to_native(),
                    CodeDType(f.code.dtype.0),
                    &shape,
                    f.code.bytes.len(),
                )
            }
            ArchivedMessage::Control(ArchivedControl::Open { trace, .. }) => {
                TraceContext::from_archived(trace)?;
                Ok(())
            }
            ArchivedMessage::Control(ArchivedControl::PrefillRequest(r)) => {
                TraceContext::from_archived(&r.trace)?;
                Ok(())
            }
            ArchivedMessage::Control(ArchivedControl::Submit(r)) => {
                TraceContext::from_archived(&r.trace)?;
                Ok(())
            }
            ArchivedMessage::Control(_) => Ok(()),
        }
    }
}

/// A message whose archive is well formed but whose content breaks a rule of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContentError {
    /// A trace context over its limits.
    #[error(transparent)]
    Trace(#[from] TraceContextError),
    /// A layer code whose byte length is not what its dtype and shape make.
    #[error("layer {layer}: {len} code bytes, but dtype {dtype} and shape {shape:?} make {}",
        expected.map_or_else(|| "no valid length (a shape the dtype does not take, too large, or over the bound of a variable-length dtype)".to_owned(), |n| n.to_string()))]
    CodeLength {
        /// The layer.
        layer: u16,
        /// The dtype's number.
        dtype: u8,
        /// The shape.
        shape: Vec<u32>,
        /// The bytes carried.
        len: usize,
        /// The bytes dtype and shape make (`None`: no length is valid for them).
        expected: Option<usize>,
    },
}

/// A code of a dtype this version does not know passes: the consumer's codec decides what to
/// do with it (a newer peer's dtypes still travel).
fn check_code_len(
    layer: u16,
    dtype: CodeDType,
    shape: &[u32],
    len: usize,
) -> Result<(), ContentError> {
    if !dtype.is_known() {
        return Ok(());
    }
    let expected = LayerCode::expected_len(dtype, shape);
    let max = LayerCode::max_len(dtype, shape);
    if expected == Some(len) || (expected.is_none() && max.is_some_and(|m| len <= m)) {
        Ok(())
    } else {
        Err(ContentError::CodeLength {
            layer,
            dtype: dtype.0,
            shape: shape.to_vec(),
            len,
            expected,
        })
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
