//! The scheduler replica: campaigns for leadership and, while leading, reconciles the cluster
//! state on every membership change, every job change and every tick: pools per expert, retries
//! of jobs whose producer or consumer vanished, assignment of queued jobs, and removal of
//! finished records past their retention. Every write it makes carries the leader's fence.
//!
//! This file holds the replica ([`Scheduler`]), its settings and errors, and the loop that runs
//! a pass on each of those events; the pass itself and its steps are in `service/reconcile.rs`
//! ([`reconcile`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use scd_types::{Mode, NodeId};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::assign::{ExpertSpec, Pools};
use crate::envelope::{self, EnvelopeError};
use crate::jobs::{ArchiveConfig, JobError, JobStore};
use crate::keys::{InvalidId, Keys};
use crate::leader::{Candidate, ElectionConfig, ElectionError, Leadership};
use crate::membership::{LiveNodes, MembershipError};
use crate::models::{ModelError, ModelRegistry};
use crate::store::{MetaStore, StoreError};

mod reconcile;
pub use reconcile::reconcile;

/// The election the scheduler replicas share.
pub const SCHEDULER_ELECTION: &str = "scheduler";

/// What `/pools/<expert>` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    /// The expert.
    pub expert: String,
    /// Its producers, sorted.
    pub producers: Vec<NodeId>,
}

/// Scheduler settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Experts to build pools for; experts found in `/models` (models with a base) are added
    /// with `default_pool_size`.
    pub experts: Vec<ExpertSpec>,
    /// Pool size for experts found in `/models`.
    pub default_pool_size: usize,
    /// Reconcile at least this often.
    pub reconcile_every: Duration,
    /// How long finished job records are kept (live or archived), since their last update.
    pub retention: Duration,
    /// When finished records move to the archive, and how many it keeps.
    pub archive: ArchiveConfig,
    /// The bound on unfinished jobs in the cluster (see [`crate::admission`]).
    pub max_unfinished_jobs: u64,
    /// How long a queued job may wait while no live node hosts its expert before it fails
    /// with that reason (its consumers died or left and none came back).
    pub orphan_grace: Duration,
    /// Election timing.
    pub election: ElectionConfig,
    /// The mode a `reuse` / `scd` job runs in while its pair's live translator is marked
    /// degraded (the drift guard).
    pub degraded_fallback: Mode,
    /// How long an attempt may run before the scheduler abandons it.
    pub attempt_deadline: AttemptDeadline,
}

/// The bound on one attempt of a job, from its assignment: `base` plus `per_token` for each
/// token the job may generate. Past it the scheduler abandons the attempt (handed back to the
/// queue, or failed once out of attempts), so an attempt whose nodes went silent, or whose
/// final write was lost, cannot hold its admission slot for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptDeadline {
    /// Time for everything before the tokens: the claim, the prefill, the transfer, the wait
    /// for a decoder.
    pub base: Duration,
    /// Time per token of the job's `max_tokens`.
    pub per_token: Duration,
}

impl AttemptDeadline {
    /// The bound for an attempt that may generate `max_tokens` tokens.
    pub fn for_tokens(&self, max_tokens: u32) -> Duration {
        self.base
            .saturating_add(self.per_token.saturating_mul(max_tokens))
    }
}

impl Default for AttemptDeadline {
    /// 300 s plus 1 s per token: generous for a CPU model decoding a few tokens a second under
    /// load, and still a bound.
    fn default() -> Self {
        Self {
            base: Duration::from_secs(300),
            per_token: Duration::from_secs(1),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            experts: Vec::new(),
            default_pool_size: 2,
            reconcile_every: Duration::from_secs(2),
            retention: Duration::from_secs(24 * 3600),
            archive: ArchiveConfig::default(),
            max_unfinished_jobs: crate::admission::DEFAULT_LIMIT,
            orphan_grace: Duration::from_secs(30),
            election: ElectionConfig::default(),
            degraded_fallback: Mode::Raw,
            attempt_deadline: AttemptDeadline::default(),
        }
    }
}

/// Errors of the scheduler.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// An id is not a valid key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// The store failed.
    #[error("scheduler store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
    /// A job operation failed.
    #[error(transparent)]
    Job(#[from] JobError),
    /// Membership failed.
    #[error(transparent)]
    Membership(#[from] MembershipError),
    /// The election could not start.
    #[error(transparent)]
    Election(#[from] ElectionError),
    /// Reading models failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Reading translator versions failed.
    #[error(transparent)]
    Translator(#[from] crate::translators::TranslatorError),
    /// This replica stopped leading during a pass.
    #[error("lost leadership during reconciliation")]
    NotLeader,
}

/// What one reconciliation pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Pools written.
    pub pools_written: usize,
    /// Pools deleted because their expert is no longer configured or registered.
    pub pools_removed: usize,
    /// Queued jobs assigned.
    pub jobs_assigned: usize,
    /// Running jobs sent back to the queue.
    pub jobs_retried: usize,
    /// Jobs failed for good.
    pub jobs_failed: usize,
    /// Finished records removed.
    pub jobs_swept: usize,
    /// Finished records moved to the archive.
    pub jobs_archived: usize,
    /// Attempts abandoned because they passed their deadline (also counted as retried or
    /// failed).
    pub attempts_expired: usize,
}

/// Reads every pool.
pub async fn read_pools(store: &dyn MetaStore, keys: &Keys) -> Result<Pools, SchedulerError> {
    let prefix = keys.pools_prefix();
    let listing = store.get_prefix(&prefix).await?;
    let mut pools = Pools::new();
    for kv in listing.kvs {
        let record: PoolRecord = envelope::decode(&kv.key, &kv.value)?;
        pools.insert(record.expert, record.producers);
    }
    Ok(pools)
}

/// A running scheduler replica. Dropping it stops it without resigning (as a crash would).
pub struct Scheduler {
    candidate: Arc<Candidate>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("candidate", &self.candidate)
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// Joins the scheduler election as `replica_id` and starts working whenever it leads.
    pub async fn start(
        store: Arc<dyn MetaStore>,
        keys: Keys,
        replica_id: &str,
        config: SchedulerConfig,
    ) -> Result<Self, SchedulerError> {
        let nodes = LiveNodes::start(store.clone(), &keys).await?;
        let candidate = Arc::new(Candidate::start(
            store.clone(),
            &keys,
            SCHEDULER_ELECTION,
            replica_id,
            config.election,
        )?);
        let task = tokio::spawn(run(store, keys, candidate.clone(), nodes, config));
        Ok(Self { candidate, task })
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        self.candidate.is_leader()
    }

    /// Follows this replica's leadership.
    pub fn leadership(&self) -> tokio::sync::watch::Receiver<Leadership> {
        self.candidate.subscribe()
    }

    /// Stops and hands leadership over at once.
    pub async fn shutdown(self) -> Result<(), StoreError> {
        self.task.abort();
        self.candidate.resign().await
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn experts_for(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    config: &SchedulerConfig,
) -> Result<Vec<ExpertSpec>, SchedulerError> {
    let mut experts: BTreeMap<String, ExpertSpec> = config
        .experts
        .iter()
        .map(|e| (e.expert.clone(), e.clone()))
        .collect();
    for model in ModelRegistry::new(store.clone(), keys.clone())
        .list()
        .await?
    {
        if let Some(base) = model.base {
            experts
                .entry(model.id.clone())
                .or_insert_with(|| ExpertSpec::new(model.id, base, config.default_pool_size));
        }
    }
    Ok(experts.into_values().collect())
}

async fn run(
    store: Arc<dyn MetaStore>,
    keys: Keys,
    candidate: Arc<Candidate>,
    nodes: LiveNodes,
    config: SchedulerConfig,
) {
    let mut leadership = candidate.subscribe();
    let mut members = nodes.subscribe();
    let mut job_events = None;
    let jobs = JobStore::new(store.clone(), keys.clone());
    // The archive is swept on the first pass as leader, then every `sweep_every` (sooner when
    // the retention age is shorter); a failed sweep is tried again on the next pass.
    let sweep_every = config.archive.sweep_every.min(config.retention);
    let mut last_sweep: Option<tokio::time::Instant> = None;
    loop {
        let current = leadership.borrow_and_update().clone();
        let guard = match current {
            Leadership::Leader(guard) => guard,
            Leadership::Follower { .. } => {
                job_events = None;
                if leadership.changed().await.is_err() {
                    return;
                }
                continue;
            }
        };
        if job_events.is_none() {
            job_events = store.watch_prefix(&keys.jobs_prefix(), 0).await.ok();
        }
        let snapshot = members.borrow_and_update().clone();
        let pass = match experts_for(&store, &keys, &config).await {
            Ok(experts) => reconcile(&store, &keys, &guard, &snapshot, &experts, &config).await,
            Err(e) => Err(e),
        };
        match pass {
            Ok(report) if report != ReconcileReport::default() => {
                tracing::debug!(?report, "reconciled")
            }
            Ok(_) => {}
            Err(SchedulerError::NotLeader) => tracing::info!("lost leadership during a pass"),
            Err(e) => tracing::warn!(error = %e, "reconciliation failed; retrying"),
        }
        if last_sweep.is_none_or(|at| at.elapsed() >= sweep_every) {
            let swept = jobs
                .sweep_archive(
                    crate::jobs::now_ms(),
                    config.retention,
                    config.archive.max_records,
                    Some(&guard),
                )
                .await;
            match swept {
                Ok(n) => {
                    last_sweep = Some(tokio::time::Instant::now());
                    if n > 0 {
                        tracing::info!(removed = n, "archived job records past the retention");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "sweeping the job archive failed; retrying"),
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(config.reconcile_every) => {}
            changed = members.changed() => if changed.is_err() { return },
            changed = leadership.changed() => if changed.is_err() { return },
            event = next_job_event(&mut job_events) => {
                if event.is_none() {
                    job_events = None;
                }
                // Let a burst of job writes settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
                if let Some(w) = job_events.as_mut() {
                    while let Ok(Some(_)) = tokio::time::timeout(Duration::ZERO, w.next()).await {}
                }
            }
        }
    }
}

async fn next_job_event(
    watch: &mut Option<crate::store::WatchStream>,
) -> Option<Result<crate::store::WatchEvent, StoreError>> {
    match watch {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}
