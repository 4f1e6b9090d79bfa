//! The consumer node's decode loop: one thread that decodes the jobs of all the node's decoders
//! together, one batched forward pass per step ([`scd_models::batch::Batch`]), so that a node
//! serving several jobs, on one expert or on several experts of the same base, streams its
//! weights once per step instead of once per job and step (BENCHMARKS.md, "Batched decode").
//!
//! A decoder hands a job here once its cache is rebuilt, with the channel its tokens go to and
//! the job's cancellation, and hears back when the job ended. It is a thread and not an actor
//! because it is a compute loop: between steps it takes new jobs from its queue without waiting,
//! and it waits only when it has nothing to step. A job whose caller is not taking its tokens
//! (its channel is full) sits out steps and holds up no other job; a cancelled job or a gone
//! caller leaves the batch at the next step.
//!
//! A decoder killed by the supervisor drops its jobs' reply ports; their pipelines cancel the
//! jobs, which then leave the batch here. A panic in model code fails the jobs of that step's
//! batch (they are handed back like any failed attempt) and the loop goes on.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use scd_models::batch::{Batch, Event};
use scd_models::{GenerateParams, KvCache, Llama, StopReason};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::decoder::DecoderError;

/// How long the loop waits for new jobs when every job in it is waiting on its caller.
const STALLED_WAIT: Duration = Duration::from_millis(2);

/// A job ready to decode: its rebuilt cache and what to decode after it.
pub(crate) struct Joining {
    pub model: Arc<Llama>,
    pub cache: KvCache,
    /// The prompt's last token (the cache holds everything before it), then any tokens an
    /// earlier attempt showed.
    pub pending: Vec<u32>,
    pub params: GenerateParams,
    pub tokens: mpsc::Sender<u32>,
    pub cancel: CancellationToken,
    pub done: oneshot::Sender<Result<Decoded, DecoderError>>,
}

/// How a job's decoding ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decoded {
    /// When its first token was produced.
    pub first_token: Option<Instant>,
    /// Why generation ended.
    pub stop: StopReason,
}

/// A handle on the node's decode loop; clones share the loop, which ends when the last handle
/// is dropped.
#[derive(Clone)]
pub struct DecodeLoop {
    tx: std_mpsc::Sender<Joining>,
    counters: Arc<Counters>,
}

/// What the loop has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Forward passes (steps).
    pub steps: u64,
    /// Rows over all steps: tokens decoded.
    pub rows: u64,
    /// The most rows one step has had.
    pub widest: u64,
}

#[derive(Default)]
struct Counters {
    steps: AtomicU64,
    rows: AtomicU64,
    widest: AtomicU64,
}

impl DecodeLoop {
    /// Starts the loop's thread.
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = std_mpsc::channel();
        let counters = Arc::new(Counters::default());
        let theirs = Arc::clone(&counters);
        std::thread::Builder::new()
            .name("scd-decode".into())
            .spawn(move || run(rx, &theirs))?;
        Ok(Self { tx, counters })
    }

    /// Steps and rows so far (rows per step above 1: jobs decoded together).
    pub fn stats(&self) -> DecodeStats {
        DecodeStats {
            steps: self.counters.steps.load(Ordering::Relaxed),
            rows: self.counters.rows.load(Ordering::Relaxed),
            widest: self.counters.widest.load(Ordering::Relaxed),
        }
    }

    /// Adds a job; false when the loop is gone (the job is dropped: its `done` sender with it).
    pub(crate) fn join(&self, job: Joining) -> bool {
        self.tx.send(job).is_ok()
    }
}

/// A job in the batch: where its tokens go, and a token its caller has not taken yet.
struct Member {
    tokens: mpsc::Sender<u32>,
    cancel: CancellationToken,
    done: oneshot::Sender<Result<Decoded, DecoderError>>,
    held: Option<u32>,
    first_token: Option<Instant>,
    /// Generation ended; the job leaves once its held token is delivered.
    ended: Option<StopReason>,
}

fn run(rx: std_mpsc::Receiver<Joining>, counters: &Counters) {
    let mut batch: Batch<u64> = Batch::new();
    let mut members: HashMap<u64, Member> = HashMap::new();
    let mut next_key = 0u64;
    loop {
        // Idle: wait for work; busy: take what has arrived; stalled: wait briefly.
        let stalled = !members.is_empty() && members.values().all(|m| m.held.is_some());
        let first = if members.is_empty() {
            match rx.recv() {
                Ok(j) => Some(j),
                Err(_) => return,
            }
        } else if stalled {
            rx.recv_timeout(STALLED_WAIT).ok()
        } else {
            None
        };
        for j in first.into_iter().chain(rx.try_iter()) {
            let key = next_key;
            next_key += 1;
            match batch.join(key, j.model, j.cache, j.pending, &j.params) {
                Ok(()) => {
                    members.insert(
                        key,
                        Member {
                            tokens: j.tokens,
                            cancel: j.cancel,
                            done: j.done,
                            held: None,
                            first_token: None,
                            ended: None,
                        },
                    );
                }
                Err(e) => {
                    let _ = j.done.send(Err(DecoderError::Generate(e)));
                }
            }
        }
        deliver(&mut batch, &mut members);
        if !members
            .values()
            .any(|m| m.held.is_none() && m.ended.is_none())
        {
            continue;
        }
        let ready = |k: &u64| members.get(k).is_some_and(|m| m.held.is_none());
        let rows = batch.keys().filter(|k| ready(k)).count() as u64;
        let stepped = catch_unwind(AssertUnwindSafe(|| batch.step(ready)));
        counters.steps.fetch_add(1, Ordering::Relaxed);
        counters.rows.fetch_add(rows, Ordering::Relaxed);
        counters.widest.fetch_max(rows, Ordering::Relaxed);
        let failure = match stepped {
            Ok(Ok(events)) => Ok(events),
            Ok(Err(e)) => Err(e.to_string()),
            Err(panic) => Err(panic_message(panic.as_ref())),
        };
        let events = match failure {
            Ok(events) => events,
            Err(reason) => {
                tracing::error!(error = %reason, jobs = members.len(), "a decode step failed");
                for (_, m) in members.drain() {
                    let _ = m.done.send(Err(DecoderError::Internal(format!(
                        "decode step: {reason}"
                    ))));
                }
                batch = Batch::new();
                continue;
            }
        };
        let now = Instant::now();
        for event in events {
            match event {
                Event::Token(k, t) => {
                    if let Some(m) = members.get_mut(&k) {
                        m.first_token.get_or_insert(now);
                        m.held = Some(t);
                    }
                }
                Event::Done(k, g) => {
                    if let Some(m) = members.get_mut(&k) {
                        m.ended = Some(g.stop);
                    }
                }
            }
        }
        deliver(&mut batch, &mut members);
    }
}

/// Hands held tokens to their callers, and ends the jobs that are cancelled, whose caller is
/// gone, or whose generation ended with every token delivered.
fn deliver(batch: &mut Batch<u64>, members: &mut HashMap<u64, Member>) {
    let mut leaving = Vec::new();
    for (&k, m) in members.iter_mut() {
        if m.cancel.is_cancelled() {
            leaving.push((k, Err(DecoderError::Cancelled)));
            continue;
        }
        if let Some(t) = m.held {
            match m.tokens.try_send(t) {
                Ok(()) => m.held = None,
                Err(mpsc::error::TrySendError::Full(_)) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    leaving.push((k, Err(DecoderError::CallerGone)));
                    continue;
                }
            }
        }
        if let (Some(stop), None) = (m.ended, m.held) {
            leaving.push((
                k,
                Ok(Decoded {
                    first_token: m.first_token,
                    stop,
                }),
            ));
        }
    }
    for (k, result) in leaving {
        batch.leave(&k);
        if let Some(m) = members.remove(&k) {
            let _ = m.done.send(result);
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic in model code".into())
}
