//! Tests that stop a node's work at a chosen point through the node's failpoints
//! (`scd_actors::node::failpoints`). A failpoint is process-wide, keyed by node id, and the
//! other tests name their nodes alike (`mail-0`): these run in a binary of their own, so that
//! no other test's node is silenced.
//!
//! - [`restarts`]: nodes killed and started again under their id, in `make test`;
//! - [`faults`]: the control plane under store and network faults, minutes each, ignored:
//!   `make faults`.

#[path = "../common/mod.rs"]
mod common;

mod faults;
mod restarts;
