//! The bridge between model threads and the async runtime. Model compute runs on blocking
//! threads (`tokio::task::spawn_blocking`); it takes its input from and hands its output to
//! bounded channels, and every wait also ends when the job is cancelled, so a stage never
//! waits on a neighbour that is gone. A stage's output goes through an [`Outlet`], so that a
//! stage that fails cancels the job before its channel closes.

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Why a blocking wait on a channel ended without a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Interrupted {
    /// The job was cancelled.
    Cancelled,
    /// The other end of the channel is gone.
    Closed,
}

/// The next item of `rx` (`Ok(None)` once the sender finished), or `Err` when `cancel` fires
/// first. Call it from a blocking thread only.
pub(crate) fn recv<T>(
    rt: &Handle,
    rx: &mut mpsc::Receiver<T>,
    cancel: &CancellationToken,
) -> Result<Option<T>, Interrupted> {
    rt.block_on(async {
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(Interrupted::Cancelled),
            item = rx.recv() => Ok(item),
        }
    })
}

/// Sends `item` on `tx`, waiting while the channel is full; `Err` when the receiver is gone or
/// `cancel` fires first. Call it from a blocking thread only.
pub(crate) fn send<T>(
    rt: &Handle,
    tx: &mpsc::Sender<T>,
    item: T,
    cancel: &CancellationToken,
) -> Result<(), Interrupted> {
    rt.block_on(async {
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(Interrupted::Cancelled),
            sent = tx.send(item) => sent.map_err(|_| Interrupted::Closed),
        }
    })
}

/// A stage's output channel. Dropped without [`Outlet::finish`] (the stage failed or panicked),
/// it cancels the job before the channel closes: otherwise the next stage would see the channel
/// end as if the stage were done, and pass on a short stream that ends cleanly. The consumer
/// would then fail the job with "incomplete payload" and race the stage's own error into the
/// job's record.
pub(crate) struct Outlet<T> {
    tx: mpsc::Sender<T>,
    cancel: CancellationToken,
    finished: bool,
}

impl<T> Outlet<T> {
    /// `tx`, for the job of `cancel`.
    pub(crate) fn new(tx: mpsc::Sender<T>, cancel: CancellationToken) -> Self {
        Self {
            tx,
            cancel,
            finished: false,
        }
    }

    /// Sends `item` on as [`send`] does. Call it from a blocking thread only.
    pub(crate) fn send(&self, rt: &Handle, item: T) -> Result<(), Interrupted> {
        send(rt, &self.tx, item, &self.cancel)
    }

    /// Closes the channel: the stage is done.
    pub(crate) fn finish(mut self) {
        self.finished = true;
    }
}

impl<T> Drop for Outlet<T> {
    fn drop(&mut self) {
        // Runs before `tx` is dropped, so the job is cancelled by the time the channel closes.
        if !self.finished {
            self.cancel.cancel();
        }
    }
}

/// Runs `work` on a blocking thread (handing it the runtime's handle for the channel waits
/// above) and answers `reply` with its result. A panic in `work` becomes `internal(message)`.
/// The caller may have given up on the job; an unanswerable reply is not an error.
pub(crate) async fn run_and_reply<T, E>(
    stage: &'static str,
    reply: ractor::RpcReplyPort<Result<T, E>>,
    internal: fn(String) -> E,
    work: impl FnOnce(&Handle) -> Result<T, E> + Send + 'static,
) where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let rt = Handle::current();
    let result = tokio::task::spawn_blocking(move || work(&rt))
        .await
        .unwrap_or_else(|e| Err(internal(e.to_string())));
    if let Err(e) = &result {
        tracing::debug!(error = %e, "{stage} failed");
    }
    let _ = reply.send(result);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the next stage sees when the outlet goes: whether its channel ended, and whether
    /// the job was cancelled by then.
    async fn seen_downstream(finish: bool) -> (Option<u32>, bool) {
        let cancel = CancellationToken::new();
        let (tx, mut rx) = mpsc::channel::<u32>(1);
        let outlet = Outlet::new(tx, cancel.clone());
        let next = tokio::spawn(async move {
            let end = rx.recv().await;
            (end, cancel.is_cancelled())
        });
        match finish {
            true => outlet.finish(),
            false => drop(outlet),
        }
        next.await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stage_that_stops_unfinished_cancels_the_job_before_its_channel_closes() {
        assert_eq!(seen_downstream(false).await, (None, true));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finished_stage_closes_its_channel_without_cancelling() {
        assert_eq!(seen_downstream(true).await, (None, false));
    }
}
