//! The bridge between model threads and the async runtime. Model compute runs on blocking
//! threads (`tokio::task::spawn_blocking`); it takes its input from and hands its output to
//! bounded channels, and every wait also ends when the job is cancelled, so a stage never
//! waits on a neighbour that is gone.

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
