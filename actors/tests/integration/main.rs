//! The node's tests against real components (etcd or the embedded store, QUIC on loopback, the
//! real model), one module per subject. They are one test binary rather than one per file:
//! each binary links and instantiates the whole dependency tree again, which was most of the
//! suite's build time. The tests that stop nodes through failpoints are a binary of their own
//! (`tests/failpoints`), so that no test here runs beside a silenced node of the same name.
//!
//! One subject: `cargo test -p scd-actors --test integration gateway::`.

#[path = "../common/mod.rs"]
mod common;

mod auto_mode;
mod cluster_jobs_metrics;
mod deploy;
mod gateway;
mod node;
mod pipeline;
mod traces;
mod user_docs;
