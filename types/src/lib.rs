//! The vocabulary every scd crate shares, so that a job id, a job state, a transfer mode, a
//! translator hash, a trace context or a layer code has one type from the CLI to the wire to
//! the store, validated once where it enters the system.
//!
//! Plain data only: no tensors, no sockets, no store. Each type has one text form (for JSON,
//! logs and command lines, through `Display`/`FromStr` and serde) and one binary form (rkyv,
//! for the wire).
//!
//! Files: [`job`] (job id and state machine), [`mode`] (the transfer modes), [`translator`] (the
//! content hash that names a translator version, and the ranks of its codes), [`trace`] (the propagated trace context),
//! [`code`] (a layer's codes as bytes plus a typed description), [`document`] (the id of a
//! document that jobs reference and producers compile), [`node`] (a node's id), [`report`] (what a job's half reports
//! when it ends: its stages, one name each, for the record, the metrics and the trace).
#![warn(missing_docs)]

pub mod code;
pub mod document;
pub mod job;
pub mod mode;
pub mod node;
pub mod report;
pub mod trace;
pub mod translator;

pub use code::{CodeDType, CodeKind, LayerCode};
pub use document::{document_id, is_document_id};
pub use job::{
    split_prompt, JobId, JobRequest, JobResult, JobState, ModelLimits, ParseJobIdError,
    ParseJobStateError, RequestError,
};
pub use mode::{Mode, ParseModeError};
pub use node::{is_key_segment, InvalidNodeId, NodeId};
pub use report::{JobReport, LayerPoint, Side, Stage, StageSpan};
pub use trace::{TraceContext, TraceContextError, TraceEntry};
pub use translator::{ParseRanksError, ParseTranslatorHashError, Ranks, TranslatorHash};
