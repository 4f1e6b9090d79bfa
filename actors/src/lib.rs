//! The node of scd, built from ractor actors: producer, encoder, transfer, aligner, decoder,
//! scheduler client and admin, under explicit supervision, plus the node configuration.
//!
//! It is the one crate that depends on `scd-models`, `scd-transport` and `scd-scheduler`; they do
//! not know each other. At this stage it holds the node configuration only; the actors arrive
//! with the cluster milestones.
//!
//! Files:
//! - [`config`]: the node's TOML file (`scd node --config`): identity, roles, models, experts and
//!   translators, store, certificates, tracing, limits; parsed, checked against the roles, and
//!   checked on disk (files present, certificate signed by the cluster CA) before a node starts.
#![warn(missing_docs)]

pub mod config;

pub use config::{ConfigError, NodeConfig, NodeRole};
