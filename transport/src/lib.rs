//! The network side of scd: QUIC endpoints (quinn) with mutual TLS under a cluster CA, the rkyv
//! wire types and their validating codec, layer-by-layer code streams with backpressure and
//! cancellation, a node-wide bound on receive-side memory, and link emulation (pacing). No model
//! math: a code frame carries an [`scd_types::LayerCode`] (plain bytes and a shape) as the
//! producer's codec made it.
//!
//! How the files fit, from the bytes up (each uses only those above it):
//! - [`wire`]: the messages (code frames, control messages) as rkyv types, over the shared
//!   vocabulary of `scd-types` (re-exported here).
//! - [`codec`]: pure framing and validation over byte buffers: header, rkyv archive, content
//!   checks, the zero-copy split of a large payload.
//! - [`budget`]: the node-wide receive budget every job stream's frames are charged to.
//! - [`session`]: job stream rules and end-of-job decisions without I/O (Open first, job ids,
//!   layer order, byte caps; what to write back, which half to finish, reset or stop), and the
//!   job streams' error types.
//! - [`framing`]: whole frames on streams: a cancel-safe reader generic over `AsyncRead` whose
//!   buffer grows with the bytes received, and the writes of encoded frames to quinn.
//! - [`pacing`]: a token bucket on the send path to emulate a link's bandwidth.
//! - [`link_meter`]: the rate a job stream's link carried it at, from the spells in which the
//!   link, not the producer, set the pace.
//! - [`config`]: transport options and the quinn config derived from the link.
//! - [`pki`]: the cluster CA and node/admin certificates (`scd cert`).
//! - `tls`: rustls configurations from the cluster CA (mutual TLS), TLS alerts read back, and
//!   [`verify_signed_by_ca`], the same check made when a node starts.
//! - `handshake`: the peer's identity and the hello exchange after TLS; connect/accept errors.
//! - `stream`: job streams over QUIC: a bounded queue and a writer task per job on the sending
//!   side, the frame reader and the tracker on the receiving side; carries out what `session`
//!   decides.
//! - [`admin`]: admin calls, one request and its replies on a stream of an admin client's
//!   connection (`scd submit` and the other cluster commands).
//! - `connection`: an authenticated connection and the state its job streams share.
//! - `endpoint`: binding, connecting, accepting; builds connections from `tls` and `handshake`.
//! - [`bench`]: the measurements behind `scd bench transport`.
//! - [`fuzz`]: the receiver's path as one function of bytes, run by the cargo-fuzz target and
//!   by the bounded harness in `cargo test`.
#![warn(missing_docs)]

pub mod admin;
pub mod bench;
pub mod budget;
pub mod codec;
pub mod config;
mod connection;
mod endpoint;
pub mod framing;
pub mod fuzz;
mod handshake;
pub mod link_meter;
pub mod pacing;
pub mod pki;
pub mod session;
mod stream;
mod tasks;
mod tls;
pub mod wire;

pub use admin::{AdminCall, AdminError, AdminReplies, AdminRequest};
pub use budget::{BudgetError, BudgetStats};
pub use config::{LinkProfile, TransportOptions};
pub use connection::Connection;
pub use endpoint::{Accepting, BindError, Endpoint};
pub use framing::ReceivedFrame;
pub use handshake::{AcceptError, ConnectError};
pub use pki::{ClusterCa, Identity, PeerIdentity, Role};
pub use scd_types::{
    CodeDType, CodeKind, JobId, JobState, LayerCode, Mode, TraceContext, TranslatorHash,
};
pub use session::{error_code, RecvError, SendError};
pub use stream::{
    AcceptJobError, JobReceiver, JobSender, LinkRate, OpenJobError, ReportError, SendReport,
    CONTROL_MAX_FRAME_BYTES,
};
pub use tls::{verify_signed_by_ca, TlsConfigError};
pub use wire::{
    CodeFrame, Control, Message, PrefillRequest, Prompt, SubmitRequest, PROTOCOL_VERSION,
};
