//! The node of scd, built from ractor actors: producer, encoder, transfer, aligner, decoder,
//! scheduler client and admin, under explicit supervision, plus the node configuration.
//!
//! It is the one crate that depends on `scd-models`, `scd-transport` and `scd-scheduler`; they do
//! not know each other. At this stage it holds the node configuration and the actors of one job's
//! path (milestone M6, first slice), wired together in one process; the scheduler client, admin,
//! gateway and supervision tree arrive with the next slices.
//!
//! An actor is one file: its messages (`XxxMsg`), arguments and state, and handlers. Model
//! compute runs on blocking threads, never on the async runtime. A job's data moves through
//! bounded channels made for that job; the actors' mailboxes carry one request per stage per
//! job, with a reply port.
//!
//! Files, in the order a job passes them:
//! - [`job`]: what a job carries: its codec and translator version, the caller's request, a
//!   frame as it arrived.
//! - [`producer`]: the base model's prefill, layer by layer, each layer's capture handed on as
//!   soon as it is done.
//! - [`encoder`]: the codec's `encode_layer` per capture; codes become code frames.
//! - [`transfer`]: QUIC: the producer node's job streams out, the consumer node's accept loop
//!   and per-job forwarding in.
//! - [`decoder`]: the expert model: codes pushed into the codec's layer decoder as they arrive
//!   (the aligner's Patch work happens inside the `scd` codec's decoder today), then generation,
//!   tokens streamed back.
//! - [`timeline`]: when each stage of a job ran, and the bytes per layer.
//! - [`pipeline`]: a producer node and a consumer node in one process over QUIC on loopback,
//!   and `run_job`.
//! - `blocking`: bounded-channel waits for model threads that also end on cancellation.
//! - [`config`]: the node's TOML file (`scd node --config`): identity, roles, models, experts and
//!   translators, store, certificates, tracing, limits; parsed, checked against the roles, and
//!   checked on disk (files present, certificate signed by the cluster CA) before a node starts.
#![warn(missing_docs)]

mod blocking;
pub mod config;
pub mod decoder;
pub mod encoder;
pub mod job;
pub mod pipeline;
pub mod producer;
pub mod timeline;
pub mod transfer;

pub use config::{ConfigError, NodeConfig, NodeRole};
pub use decoder::{Decoder, DecoderError, DecoderMsg};
pub use encoder::{Encoder, EncoderError, EncoderMsg};
pub use job::{JobCodec, JobSpec};
pub use pipeline::{JobError, JobOutput, Pipeline, PipelineOptions, RunningJob, StartError};
pub use producer::{Producer, ProducerError, ProducerMsg};
pub use timeline::{FrameArrival, LayerBytes, Span, Timeline};
pub use transfer::{TransferError, TransferIn, TransferInMsg, TransferOut, TransferOutMsg};
