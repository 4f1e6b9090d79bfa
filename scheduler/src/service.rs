//! The scheduler replica: campaigns for leadership and, while leading, reconciles the cluster
//! state on every membership change, every job change and every tick: pools per expert, retries
//! of jobs whose producer or consumer vanished, assignment of queued jobs, and removal of
//! finished records past their retention. Every write it makes carries the leader's fence.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use scd_types::{JobState, Mode};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::admission;
use crate::assign::{choose_consumer, choose_producer, compute_pools, ExpertSpec, Pools};
use crate::codec::{self, CodecError};
use crate::jobs::{now_ms, Blame, JobError, JobStore, ModeFallback};
use crate::keys::{InvalidId, Keys};
use crate::leader::{Candidate, ElectionConfig, ElectionError, LeaderGuard, Leadership};
use crate::membership::{LiveNodes, MembershipError, NodeInfo, NodeMap};
use crate::models::{ModelError, ModelRegistry};
use crate::store::{MetaStore, StoreError, Txn, TxnOp};
use crate::translators::TranslatorRegistry;

/// The election the scheduler replicas share.
pub const SCHEDULER_ELECTION: &str = "scheduler";

/// What `/pools/<expert>` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    /// The expert.
    pub expert: String,
    /// Its producers, sorted.
    pub producers: Vec<String>,
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
    /// How long finished job records are kept.
    pub retention: Duration,
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
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            experts: Vec::new(),
            default_pool_size: 2,
            reconcile_every: Duration::from_secs(2),
            retention: Duration::from_secs(24 * 3600),
            max_unfinished_jobs: crate::admission::DEFAULT_LIMIT,
            orphan_grace: Duration::from_secs(30),
            election: ElectionConfig::default(),
            degraded_fallback: Mode::Raw,
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
    Codec(#[from] CodecError),
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
}

/// Reads every pool.
pub async fn read_pools(store: &dyn MetaStore, keys: &Keys) -> Result<Pools, SchedulerError> {
    let prefix = keys.pools_prefix();
    let listing = store.get_prefix(&prefix).await?;
    let mut pools = Pools::new();
    for kv in listing.kvs {
        let record: PoolRecord = codec::decode(&kv.key, &kv.value)?;
        pools.insert(record.expert, record.producers);
    }
    Ok(pools)
}

/// One reconciliation pass as leader (see the module docs). Public so an operator tool or a
/// test can run a pass by hand.
pub async fn reconcile(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    guard: &LeaderGuard,
    nodes: &NodeMap,
    experts: &[ExpertSpec],
    config: &SchedulerConfig,
) -> Result<ReconcileReport, SchedulerError> {
    let mut report = ReconcileReport::default();

    let previous = read_pools(store.as_ref(), keys).await?;
    let pools = compute_pools(nodes, experts, &previous);
    for (expert, producers) in &pools {
        if previous.get(expert) == Some(producers) {
            continue;
        }
        let record = PoolRecord {
            expert: expert.clone(),
            producers: producers.clone(),
        };
        let txn = Txn::new()
            .when([guard.compare()])
            .and_then([TxnOp::put(keys.pool(expert)?, codec::encode(&record)?)]);
        if !store.txn(txn).await?.succeeded {
            return Err(SchedulerError::NotLeader);
        }
        tracing::info!(expert, ?producers, "pool updated");
        report.pools_written += 1;
    }

    // A pool outlives its expert otherwise: nodes would keep counting it as load and an
    // operator listing pools would see experts that no longer exist.
    for expert in previous.keys() {
        if experts.iter().any(|e| &e.expert == expert) {
            continue;
        }
        let txn = Txn::new()
            .when([guard.compare()])
            .and_then([TxnOp::delete(keys.pool(expert)?)]);
        if !store.txn(txn).await?.succeeded {
            return Err(SchedulerError::NotLeader);
        }
        tracing::info!(expert, "pool removed: the expert is gone");
        report.pools_removed += 1;
    }

    // Assignments made in this pass count as load at once, so a burst of queued jobs spreads
    // over the pool instead of piling onto whoever advertised the lowest load last.
    let mut view = nodes.clone();
    // Nodes whose entry in `view` was read again from the store in this pass (below).
    let mut refreshed = BTreeSet::new();
    let jobs = JobStore::new(store.clone(), keys.clone());
    let leader_only = |e: JobError| match e {
        JobError::NotLeader(_) => SchedulerError::NotLeader,
        e => SchedulerError::Job(e),
    };
    // The admission record is read before the listing, so that a submission landing in between
    // moves it and the recount below does not overwrite that submission's count.
    let admission_before = admission::read_before_listing(store.as_ref(), keys).await?;
    let listing = jobs.list().await?;
    let registry = TranslatorRegistry::new(store.clone(), keys.clone());
    let mut degraded = BTreeMap::new();
    admission::recount(
        store.as_ref(),
        keys,
        guard,
        admission_before,
        listing.iter().map(|(j, _)| j),
        config.max_unfinished_jobs,
    )
    .await?;
    for (job, _) in listing {
        let lost = lost_party(
            &job.state,
            job.producer.as_deref(),
            job.consumer.as_deref(),
            nodes,
        );
        if let Some((reason, _)) = lost {
            let updated = jobs
                .update_as_leader(job.id, guard, |j| {
                    // Re-check on the fresh record: someone may have moved it on meanwhile.
                    match lost_party(
                        &j.state,
                        j.producer.as_deref(),
                        j.consumer.as_deref(),
                        nodes,
                    ) {
                        Some((reason, blame)) => j.retry(&reason, blame, now_ms()),
                        None => Ok(()),
                    }
                })
                .await
                .map_err(leader_only)?;
            match updated.state {
                JobState::Queued => report.jobs_retried += 1,
                JobState::Failed => report.jobs_failed += 1,
                _ => {}
            }
            tracing::info!(job = %job.id, reason, state = %updated.state, "job attempt abandoned");
            if updated.state != JobState::Queued {
                continue;
            }
        } else if job.state != JobState::Queued {
            continue;
        }
        let Some(pool) = pools.get(&job.expert) else {
            continue;
        };
        if choose_consumer(&job.experts(), &view, &[]).is_none() {
            let waited = Duration::from_millis(now_ms().saturating_sub(job.updated_at_ms));
            if waited >= config.orphan_grace {
                let reason = format!(
                    "no live node hosts expert {} (waited {}s); start a consumer with it and submit again",
                    job.experts().join(" + "),
                    waited.as_secs()
                );
                let failed = jobs
                    .update_as_leader(job.id, guard, |j| {
                        let hosted = choose_consumer(&j.experts(), nodes, &[]).is_some();
                        if j.state == JobState::Queued && !hosted {
                            j.fail(&reason, now_ms())?;
                        }
                        Ok(())
                    })
                    .await
                    .map_err(leader_only)?;
                if failed.state == JobState::Failed {
                    tracing::info!(job = %job.id, reason, "queued job failed");
                    report.jobs_failed += 1;
                }
            }
            continue;
        }
        // The view follows a watch of the nodes and can lag the job listing: a consumer that
        // drained (advertising nothing to serve) and then handed this job back may still look
        // like a host here. Handing a job back to the consumer that lost it is where that lag
        // spends an attempt, so before that choice the node's entry is read again from the
        // store (once per node and pass, however many such jobs there are).
        while let Some(again) = choose_consumer(&job.experts(), &view, &job.failed_consumers)
            .filter(|c| job.failed_consumers.contains(c) && !refreshed.contains(c))
        {
            refreshed.insert(again.clone());
            match stored_node(store.as_ref(), keys, &again).await? {
                Some(mut info) => {
                    // Keep the assignments this pass has already counted against it.
                    if let Some(seen) = view.get(&again) {
                        info.load = info.load.max(seen.load);
                    }
                    view.insert(again, info);
                }
                None => {
                    view.remove(&again);
                }
            }
        }
        let fallback = match job.mode {
            Mode::Reuse | Mode::Scd => {
                degraded_pair(&registry, experts, &job.expert, &mut degraded).await?
            }
            _ => None,
        };
        let assigned = jobs
            .update_as_leader(job.id, guard, |j| {
                if j.state != JobState::Queued {
                    return Ok(());
                }
                if let (Some(reason), Mode::Reuse | Mode::Scd) = (&fallback, j.mode) {
                    j.fallback = Some(ModeFallback {
                        from: j.mode,
                        reason: reason.clone(),
                    });
                    j.mode = config.degraded_fallback;
                }
                // On the fresh record: a retry in this pass may have just added to the list.
                let Some(consumer) = choose_consumer(&j.experts(), &view, &j.failed_consumers)
                else {
                    return Ok(());
                };
                let excluded = if pool
                    .iter()
                    .any(|p| !j.failed_producers.contains(p) && nodes.contains_key(p))
                {
                    j.failed_producers.clone()
                } else {
                    Vec::new()
                };
                let documents = j.request.as_ref().map_or(&[][..], |r| &r.documents[..]);
                match choose_producer(pool, &view, &j.prefix_hashes, documents, &excluded) {
                    Some(choice) => j.assign(&choice.producer, &consumer, now_ms()),
                    None => Ok(()),
                }
            })
            .await
            .map_err(leader_only)?;
        if assigned.state == JobState::Assigned {
            for id in [assigned.producer.as_ref(), assigned.consumer.as_ref()]
                .into_iter()
                .flatten()
            {
                if let Some(n) = view.get_mut(id) {
                    n.load = n.load.saturating_add(1);
                }
            }
            tracing::info!(job = %assigned.id, producer = ?assigned.producer, consumer = ?assigned.consumer, attempt = assigned.attempts, "job assigned");
            report.jobs_assigned += 1;
        }
    }

    report.jobs_swept = jobs.sweep_finished(now_ms(), config.retention).await?;
    Ok(report)
}

/// The store's own record of `node` (not a watch's copy), if it is registered.
async fn stored_node(
    store: &dyn MetaStore,
    keys: &Keys,
    node: &str,
) -> Result<Option<NodeInfo>, SchedulerError> {
    let key = keys.node(node)?;
    match store.get(&key).await? {
        Some(kv) => Ok(Some(codec::decode(&key, &kv.value)?)),
        None => Ok(None),
    }
}

/// Why `expert`'s jobs should not use its translator now (its live version is marked
/// degraded), read once per pass per expert into `seen`.
async fn degraded_pair(
    registry: &TranslatorRegistry,
    experts: &[ExpertSpec],
    expert: &str,
    seen: &mut BTreeMap<String, Option<String>>,
) -> Result<Option<String>, SchedulerError> {
    if let Some(known) = seen.get(expert) {
        return Ok(known.clone());
    }
    let reason = match experts.iter().find(|e| e.expert == expert) {
        Some(spec) => registry
            .active(&spec.base_model, expert)
            .await?
            .and_then(|a| {
                let d = a.degraded?;
                Some(format!(
                    "translator {} ({}) is degraded: shadow KL {:.3} over {} jobs > {:.3}, measured by {}; publish a recalibrated version",
                    a.version,
                    a.content_hash.short(),
                    d.shadow_kl,
                    d.jobs,
                    d.bound,
                    d.by
                ))
            }),
        None => None,
    };
    seen.insert(expert.to_string(), reason.clone());
    Ok(reason)
}

/// Why a running job's attempt cannot finish, if it cannot, and which node is to blame.
fn lost_party(
    state: &JobState,
    producer: Option<&str>,
    consumer: Option<&str>,
    nodes: &NodeMap,
) -> Option<(String, Blame)> {
    // Once decoding, the consumer holds everything: the producer no longer matters.
    let needs_producer = matches!(
        state,
        JobState::Assigned | JobState::Prefilling | JobState::Transferring
    );
    if needs_producer {
        match producer {
            Some(p) if nodes.contains_key(p) => {}
            Some(p) => return Some((format!("producer {p} left the cluster"), Blame::Producer)),
            None => return Some(("no producer recorded".to_string(), Blame::Nobody)),
        }
    }
    if state.is_running() {
        match consumer {
            Some(c) if nodes.contains_key(c) => {}
            Some(c) => return Some((format!("consumer {c} left the cluster"), Blame::Consumer)),
            None => return Some(("no consumer recorded".to_string(), Blame::Nobody)),
        }
    }
    None
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
