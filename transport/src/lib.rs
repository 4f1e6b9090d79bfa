//! The network side of scd: QUIC endpoints (quinn) with mutual TLS under a cluster CA, the rkyv
//! wire types and their validating codec, layer-by-layer code streams with backpressure and
//! cancellation, and link emulation (pacing). No model math: code frames carry plain bytes and
//! shapes.
//!
//! How the files fit:
//! - [`wire`]: the messages (code frames, control messages) as rkyv types.
//! - [`codec`]: pure framing and validation over byte buffers (fuzzed and property-tested).
//! - [`session`]: job stream rules without I/O (Open first, job ids, layer order, byte caps).
//! - [`pki`]: the cluster CA and node/admin certificates (`scd cert`).
//! - `endpoint`: quinn endpoints and connections with mutual TLS, typed handshake errors.
//! - `stream`: job streams over QUIC: a bounded queue and a writer task per job on the sending
//!   side, a cancel-safe frame reader on the receiving side.
//! - [`pacing`]: a token bucket on the send path to emulate a link's bandwidth.
//! - [`config`]: transport options and the quinn config derived from the link.
//! - [`bench`]: the measurements behind `scd bench transport`.
#![warn(missing_docs)]

pub mod bench;
pub mod codec;
pub mod config;
mod endpoint;
pub mod pacing;
pub mod pki;
pub mod session;
mod stream;
pub mod wire;

pub use config::{LinkProfile, TransportOptions};
pub use endpoint::{AcceptError, Accepting, BindError, ConnectError, Connection, Endpoint};
pub use pki::{ClusterCa, Identity, PeerIdentity, Role};
pub use session::error_code;
pub use stream::{
    AcceptJobError, JobReceiver, JobSender, OpenJobError, RecvError, SendError, SendReport,
};
pub use wire::{
    CodeFrame, CodeKind, Control, DType, JobId, Message, PrefillRequest, Prompt, TraceEntry,
    PROTOCOL_VERSION,
};
