//! The node of scd, built from ractor actors: producer, encoder, transfer and decoder on a
//! job's path (the design's aligner is not an actor of its own yet: its work runs in the
//! decoder, see [`decoder`]), the scheduler client and admin, under explicit supervision, plus
//! the node configuration.
//!
//! It is the one crate that depends on `scd-models`, `scd-transport` and `scd-scheduler`; they do
//! not know each other. It holds the actors of a job's path, the node that runs them from its
//! config and the job records in the store under a supervisor that restarts failed actors,
//! the admin endpoint over QUIC and the OpenAI-compatible HTTP gateway, the job traces exported
//! over OTLP and the node's metrics, and the client that submits jobs through the store
//! (`docs/architecture.md`).
//!
//! An actor is one file: its messages (`XxxMsg`), arguments and state, and handlers. Model
//! compute runs on blocking threads, never on the async runtime. A job's data moves through
//! bounded channels made for that job; the actors' mailboxes carry one request per stage per
//! job, with a reply port.
//!
//! Files, in the order a job passes them:
//! - [`job`]: what a job carries: its codec and translator version, the caller's request, a
//!   frame as it arrived, its queue bounds, and why it failed ([`JobError`]).
//! - [`producer`]: the base model's prefill, layer by layer, each layer's capture handed on as
//!   soon as it is done; or, for a job that names documents, their compiled caches from the
//!   producer's store ([`documents`]), placed one after another and sent as they are.
//! - [`encoder`]: the codec's `encode_layer` per capture; codes become code frames.
//! - [`transfer`]: QUIC: the producer node's job streams out, the consumer node's accept loop
//!   and per-job forwarding in.
//! - [`decoder`]: the expert model: codes pushed into the codec's layer decoder as they arrive
//!   (the aligner's Patch work happens inside the `scd` codec's decoder today); the rebuilt
//!   cache goes to the [`decode_loop`], which decodes all the node's jobs together in one batch
//!   per step and streams each job's tokens back.
//! - [`drift_guard`]: the consumer's shadow checks of a share of translated jobs against the
//!   expert's own prefill, and the mark on a translator version whose codes drifted.
//! - [`timeline`]: when each stage of a job ran, and the bytes per layer.
//! - `halves`: a job's two halves (producer side, consumer side) as requests to a node's actors,
//!   and how their replies settle into a result or a cause; both the pipeline and the node use
//!   them.
//! - [`pipeline`]: a producer node and a consumer node in one process over QUIC on loopback,
//!   and `run_job`, without a store: the actors' own tests and benchmarks.
//! - [`lifecycle`]: a job's two halves on a node as state machines without I/O: events in
//!   (record changed, stream arrived, stages started, failed or finished, grace over), actions
//!   out (claim, start, write progress or the report, hand back with blame, fail); the node's
//!   `node::jobs` module drives them.
//! - [`node`]: a cluster node: endpoint, registration, model records, scheduler replica, the
//!   supervised actors of its roles, its share of the jobs from the records, and the admin
//!   endpoint; drains on shutdown.
//! - [`client`]: submitting a job (a record with its request) and waiting for its end.
//! - [`rank_planner`]: the producer's choice of a job's code ranks for the link to its
//!   consumer, from the translator's quality curve and measured link and prefill speeds.
//! - [`mode_planner`]: the producer's choice of the mode of a job submitted in mode `auto`
//!   (lowest expected time to first token under the quality ceiling).
//! - [`reply`]: how a job's tokens come back, one trait ([`reply::TokenSource`]) for the
//!   decoder's channel, the pipeline's job and the store, and the text they add as they come.
//! - [`follow`]: a job followed through its record in the store: the client's token source.
//! - [`metrics`]: the node's Prometheus metrics.
//! - [`telemetry`]: job traces: the root span at submission, each node's half and its stages,
//!   exported over OTLP.
//! - `blocking`: bounded-channel waits for model threads that also end on cancellation.
//! - [`config`]: the node's TOML file (`scd node --config`): identity, roles, models, experts and
//!   translators, store, certificates, tracing, limits; parsed, checked against the roles, and
//!   checked on disk (files present, certificate signed by the cluster CA) before a node starts.
#![warn(missing_docs)]

mod blocking;
pub mod client;
pub mod config;
pub mod decode_loop;
pub mod decoder;
pub mod documents;
pub mod drift_guard;
pub mod encoder;
pub mod follow;
mod halves;
pub mod job;
pub mod kv_budget;
pub mod lifecycle;
pub mod metrics;
pub mod mode_planner;
pub mod node;
pub mod pipeline;
pub mod prefix_cache;
pub mod producer;
pub mod rank_planner;
pub mod reply;
pub mod telemetry;
pub mod timeline;
pub mod transfer;

pub use client::{ClientError, ClusterClient};
pub use config::{ConfigError, NodeConfig, NodeRole};
pub use decode_loop::{DecodeLoop, DecodeStats};
pub use decoder::{Decoder, DecoderError, DecoderMsg};
pub use encoder::{Encoder, EncoderError, EncoderMsg};
pub use job::{JobCodec, JobError, JobSpec, PipelineOptions};
pub use node::{DrainReport, Node, NodeError, ServeError, Served};
pub use pipeline::{JobOutput, Pipeline, RunningJob, StartError};
pub use producer::{Producer, ProducerError, ProducerMsg};
pub use reply::{ReplyText, Step, TokenSource};
pub use timeline::{FrameArrival, LayerBytes, Span, Timeline};
pub use transfer::{TransferError, TransferIn, TransferInMsg, TransferOut, TransferOutMsg};
