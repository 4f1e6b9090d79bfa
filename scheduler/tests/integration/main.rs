//! The scheduler's tests against a real etcd and the embedded store, one module per subject.
//! They are one test binary rather than one per file: each binary links and instantiates the
//! dependency tree again, which was most of their build time. The harness's own test
//! (`tests/harness.rs`) runs its binary again as a child, so it stays apart.
//!
//! One subject: `cargo test -p scd-scheduler --test integration store_suite::`.

#[path = "../common/mod.rs"]
#[macro_use]
mod common;

mod archive;
mod jobs;
mod leader;
mod membership;
mod progress;
mod restarts;
mod soak;
mod store_suite;
mod translators;
