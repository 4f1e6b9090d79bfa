//! The node of scd, built from ractor actors: producer, encoder, transfer, aligner, decoder,
//! scheduler client and admin, under explicit supervision, plus the node configuration.
//!
//! It is the one crate that depends on `scd-models`, `scd-transport` and `scd-scheduler`; they do
//! not know each other. At this stage it holds the node configuration only; the actors arrive
//! with the cluster milestones.
#![warn(missing_docs)]
