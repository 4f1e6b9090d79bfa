//! Counts the tasks this crate spawns for an endpoint (one writer per job being sent), so that
//! tests and shutdown can check that none is left behind.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The number of live tasks of one endpoint.
#[derive(Debug, Default)]
pub(crate) struct TaskCounter(AtomicUsize);

/// Held by a task for its whole life: decrements the counter when the task ends, however it
/// ends.
#[derive(Debug)]
pub(crate) struct TaskGuard(Arc<TaskCounter>);

impl TaskCounter {
    /// Count a task that is about to start.
    pub(crate) fn enter(self: &Arc<Self>) -> TaskGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        TaskGuard(Arc::clone(self))
    }

    /// Tasks running now.
    pub(crate) fn live(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, Ordering::SeqCst);
    }
}
