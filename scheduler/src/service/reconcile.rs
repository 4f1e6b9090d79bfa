//! One reconciliation pass ([`reconcile`]) and its steps: the pools, the admission recount,
//! each listed job ([`JobPass`]: a lost attempt abandoned, an orphan failed, a queued job
//! assigned), the sweep of finished records.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use scd_types::{JobState, NodeId};

use super::{read_pools, PoolRecord, ReconcileReport, SchedulerConfig, SchedulerError};
use crate::admission;
use crate::assign::{choose_consumer, choose_producer, compute_pools, ExpertSpec, Pools};
use crate::envelope;
use crate::jobs::{now_ms, Blame, JobError, JobRecord, JobStore, ModeFallback, Retired};
use crate::keys::Keys;
use crate::leader::LeaderGuard;
use crate::membership::{NodeInfo, NodeMap};
use crate::store::{MetaStore, Txn, TxnOp};
use crate::translators::TranslatorRegistry;

/// One reconciliation pass as leader (see the [`crate::service`] docs). Public so an operator
/// tool or a test can run a pass by hand.
///
/// The pass's steps, in order: the pools (written where they changed, removed where their
/// expert is gone); the job listing, with the admission count recounted from it; each listed
/// job in turn (a lost attempt abandoned, an orphan failed, a queued job assigned); each
/// listed finished record moved to the archive once `config.archive.after` has passed, or
/// removed past the retention age ([`JobStore::retire`]). The archive itself is swept by the
/// replica's loop, not by a pass ([`JobStore::sweep_archive`]).
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
    report.pools_written = write_changed_pools(store, keys, guard, &previous, &pools).await?;
    report.pools_removed = remove_gone_pools(store, keys, guard, &previous, experts).await?;

    let mut pass = JobPass::new(store, keys, guard, nodes, experts, config);
    let listing = pass.list_and_recount().await?;
    pass.count_held(listing.iter().map(|(j, _)| j));
    for (job, revision) in listing {
        pass.reconcile_job(&job, &pools, &mut report).await?;
        let retired = pass
            .jobs
            .retire(
                &job,
                revision,
                now_ms(),
                config.retention,
                &config.archive,
                Some(guard),
            )
            .await?;
        match retired {
            Retired::Archived => report.jobs_archived += 1,
            Retired::Removed => report.jobs_swept += 1,
            Retired::Kept => {}
        }
    }
    Ok(report)
}

/// Writes the pool of each expert in `pools` that differs from `previous`, fenced by `guard`.
/// Returns how many were written.
async fn write_changed_pools(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    guard: &LeaderGuard,
    previous: &Pools,
    pools: &Pools,
) -> Result<usize, SchedulerError> {
    let mut written = 0;
    for (expert, producers) in pools {
        if previous.get(expert) == Some(producers) {
            continue;
        }
        let record = PoolRecord {
            expert: expert.clone(),
            producers: producers.clone(),
        };
        let txn = Txn::new()
            .when([guard.compare()])
            .and_then([TxnOp::put(keys.pool(expert)?, envelope::encode(&record)?)]);
        if !store.txn(txn).await?.succeeded {
            return Err(SchedulerError::NotLeader);
        }
        tracing::info!(expert, ?producers, "pool updated");
        written += 1;
    }
    Ok(written)
}

/// Deletes the pools of `previous` whose expert is not among `experts`, fenced by `guard`.
/// Returns how many were deleted.
///
/// A pool outlives its expert otherwise: nodes would keep counting it as load and an operator
/// listing pools would see experts that no longer exist.
async fn remove_gone_pools(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    guard: &LeaderGuard,
    previous: &Pools,
    experts: &[ExpertSpec],
) -> Result<usize, SchedulerError> {
    let mut removed = 0;
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
        removed += 1;
    }
    Ok(removed)
}

/// A job update refused for want of leadership is the pass's [`SchedulerError::NotLeader`].
fn leader_only(e: JobError) -> SchedulerError {
    match e {
        JobError::NotLeader(_) => SchedulerError::NotLeader,
        e => SchedulerError::Job(e),
    }
}

/// The jobs' part of a pass: what it reads once and what it carries from one job to the next.
struct JobPass<'a> {
    store: &'a Arc<dyn MetaStore>,
    keys: &'a Keys,
    guard: &'a LeaderGuard,
    /// The live nodes as the pass began.
    nodes: &'a NodeMap,
    experts: &'a [ExpertSpec],
    config: &'a SchedulerConfig,
    jobs: JobStore,
    registry: TranslatorRegistry,
    /// `nodes` with each one's load at least the jobs the listing shows it holding, and the
    /// assignments made in this pass counted at once: a burst of queued jobs spreads over the
    /// pool instead of piling onto whoever advertised the lowest load last, and a node at its
    /// capacity is given nothing more.
    view: NodeMap,
    /// Nodes whose entry in `view` was read again from the store in this pass
    /// ([`JobPass::refresh_failed_consumers`]).
    refreshed: BTreeSet<NodeId>,
    /// Per expert, why its translator is not to be used now ([`degraded_pair`]).
    degraded: BTreeMap<String, Option<String>>,
}

impl<'a> JobPass<'a> {
    fn new(
        store: &'a Arc<dyn MetaStore>,
        keys: &'a Keys,
        guard: &'a LeaderGuard,
        nodes: &'a NodeMap,
        experts: &'a [ExpertSpec],
        config: &'a SchedulerConfig,
    ) -> Self {
        Self {
            store,
            keys,
            guard,
            nodes,
            experts,
            config,
            jobs: JobStore::new(store.clone(), keys.clone()),
            registry: TranslatorRegistry::new(store.clone(), keys.clone()),
            view: nodes.clone(),
            refreshed: BTreeSet::new(),
            degraded: BTreeMap::new(),
        }
    }

    /// Lists the jobs and recounts the admission record from that listing (fenced). Returns
    /// the listing.
    async fn list_and_recount(&self) -> Result<Vec<(JobRecord, i64)>, SchedulerError> {
        // The admission record is read before the listing, so that a submission landing in
        // between moves it and the recount below does not overwrite that submission's count.
        let admission_before =
            admission::read_before_listing(self.store.as_ref(), self.keys).await?;
        let listing = self.jobs.list().await?;
        admission::recount(
            self.store.as_ref(),
            self.keys,
            self.guard,
            admission_before,
            listing.iter().map(|(j, _)| j),
            self.config.max_unfinished_jobs,
        )
        .await?;
        Ok(listing)
    }

    /// Raises each node's load in the view to the number of `jobs` it holds: a node's own
    /// count reaches the store a moment after it changes, and the listing is what this pass
    /// assigns against.
    fn count_held<'j>(&mut self, jobs: impl Iterator<Item = &'j JobRecord>) {
        let mut held: BTreeMap<&str, u32> = BTreeMap::new();
        for job in jobs {
            for id in holders(job) {
                *held.entry(id).or_default() += 1;
            }
        }
        for (id, n) in held {
            if let Some(node) = self.view.get_mut(id) {
                node.load = node.load.max(n);
            }
        }
    }

    /// One listed job: its attempt abandoned if a party to it left; then, if it is queued
    /// and its expert has a pool, failed if no live node has hosted its expert for the
    /// orphan grace, or else assigned (in the degraded-translator fallback mode where that
    /// applies). Counts what it did in `report`.
    ///
    /// `job` is the listing's copy; every change is made on the fresh record.
    async fn reconcile_job(
        &mut self,
        job: &JobRecord,
        pools: &Pools,
        report: &mut ReconcileReport,
    ) -> Result<(), SchedulerError> {
        if !self.abandon_lost_attempt(job, report).await? {
            return Ok(());
        }
        let Some(pool) = pools.get(&job.expert) else {
            return Ok(());
        };
        if choose_consumer(&job.experts(), &self.view, &[]).is_none() {
            return self.fail_if_orphaned(job, report).await;
        }
        self.refresh_failed_consumers(job).await?;
        // Auto could pick codes: it too runs in the fallback while the pair is degraded.
        let fallback = match job.mode.may_use_translator_codes() {
            true => {
                degraded_pair(
                    &self.registry,
                    self.experts,
                    &job.expert,
                    &mut self.degraded,
                )
                .await?
            }
            false => None,
        };
        self.assign(job, pool, fallback, report).await
    }

    /// If `job`'s attempt cannot finish ([`lost_attempt`]: its producer or consumer left or
    /// restarted, or it passed its deadline; checked again on the fresh record), sends it back
    /// to the queue or, out of attempts, fails it, and counts which. Returns whether the job is
    /// queued now (the listing's state where nothing was lost).
    async fn abandon_lost_attempt(
        &self,
        job: &JobRecord,
        report: &mut ReconcileReport,
    ) -> Result<bool, SchedulerError> {
        let nodes = self.nodes;
        let Some(lost) = lost_attempt(job, nodes, now_ms()) else {
            return Ok(job.state == JobState::Queued);
        };
        let mut expired = false;
        let updated = self
            .jobs
            .update_as_leader(job.id, self.guard, |j| {
                // Re-check on the fresh record: someone may have moved it on meanwhile.
                expired = false;
                match lost_attempt(j, nodes, now_ms()) {
                    Some(lost) => {
                        expired = lost.expired;
                        j.retry(&lost.reason, lost.blame, now_ms())
                    }
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
        if expired {
            report.attempts_expired += 1;
        }
        tracing::info!(job = %job.id, reason = lost.reason, state = %updated.state, "job attempt abandoned");
        Ok(updated.state == JobState::Queued)
    }

    /// A queued job that no node in the pass's view hosts: fails it once it has waited
    /// `orphan_grace` since its last change (if, on the fresh record, it is still queued and
    /// no live node hosts its expert), and counts that.
    async fn fail_if_orphaned(
        &self,
        job: &JobRecord,
        report: &mut ReconcileReport,
    ) -> Result<(), SchedulerError> {
        let waited = Duration::from_millis(now_ms().saturating_sub(job.updated_at_ms));
        if waited >= self.config.orphan_grace {
            let reason = format!(
                "no live node hosts expert {} (waited {}s); start a consumer with it and submit again",
                job.experts().join(" + "),
                waited.as_secs()
            );
            let nodes = self.nodes;
            let failed = self
                .jobs
                .update_as_leader(job.id, self.guard, |j| {
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
        Ok(())
    }

    /// Reads again from the store the entry in `view` of each consumer that already failed
    /// `job` and that the view would choose for it, once per node and pass.
    ///
    /// The view follows a watch of the nodes and can lag the job listing: a consumer that
    /// drained (advertising nothing to serve) and then handed this job back may still look
    /// like a host here. Handing a job back to the consumer that lost it is where that lag
    /// spends an attempt, so before that choice the node's entry is read again from the store
    /// (once per node and pass, however many such jobs there are).
    async fn refresh_failed_consumers(&mut self, job: &JobRecord) -> Result<(), SchedulerError> {
        while let Some(again) = choose_consumer(&job.experts(), &self.view, &job.failed_consumers)
            .filter(|c| job.failed_consumers.contains(c) && !self.refreshed.contains(c))
        {
            self.refreshed.insert(again.clone());
            match stored_node(self.store.as_ref(), self.keys, &again).await? {
                Some(mut info) => {
                    // Keep the assignments this pass has already counted against it.
                    if let Some(seen) = self.view.get(&again) {
                        info.load = info.load.max(seen.load);
                    }
                    self.view.insert(again, info);
                }
                None => {
                    self.view.remove(&again);
                }
            }
        }
        Ok(())
    }

    /// Assigns `job`, if it is still queued on the fresh record, to a consumer and a producer
    /// of `pool` chosen on the view (the consumer avoiding those that failed it; the producer
    /// avoiding those that failed it while the pool has another live one); with `fallback`
    /// (why its translator is degraded) it runs in the configured fallback mode instead of a
    /// translator's. Counts the assignment against both nodes in the view, and in `report`.
    async fn assign(
        &mut self,
        job: &JobRecord,
        pool: &[NodeId],
        fallback: Option<String>,
        report: &mut ReconcileReport,
    ) -> Result<(), SchedulerError> {
        let (nodes, config) = (self.nodes, self.config);
        // Only nodes with room are given work: a job waits in the queue rather than on a node
        // that is full (the next pass after one of them finishes assigns it).
        let view: NodeMap = self
            .view
            .iter()
            .filter(|(_, n)| n.load < n.capacity)
            .map(|(id, n)| (id.clone(), n.clone()))
            .collect();
        let view = &view;
        let assigned = self
            .jobs
            .update_as_leader(job.id, self.guard, |j| {
                if j.state != JobState::Queued {
                    return Ok(());
                }
                if let (Some(reason), true) = (&fallback, j.mode.may_use_translator_codes()) {
                    j.fallback = Some(ModeFallback {
                        from: j.mode,
                        reason: reason.clone(),
                    });
                    j.mode = config.degraded_fallback;
                }
                // On the fresh record: a retry in this pass may have just added to the list.
                let Some(consumer) = choose_consumer(&j.experts(), view, &j.failed_consumers)
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
                let Some(choice) =
                    choose_producer(pool, view, &j.prefix_hashes, documents, &excluded)
                else {
                    return Ok(());
                };
                let now = now_ms();
                j.assign(&choice.producer, &consumer, now)?;
                // The incarnations this attempt is given to, and how long it may take.
                let epoch = |id: &str| view.get(id).map(|n| n.epoch).filter(|e| *e != 0);
                j.producer_epoch = epoch(&choice.producer);
                j.consumer_epoch = epoch(&consumer);
                let max_tokens = j.request.as_ref().map_or(0, |r| r.max_tokens);
                let bound = config.attempt_deadline.for_tokens(max_tokens);
                j.attempt_deadline_ms =
                    Some(now.saturating_add(u64::try_from(bound.as_millis()).unwrap_or(u64::MAX)));
                Ok(())
            })
            .await
            .map_err(leader_only)?;
        if assigned.state == JobState::Assigned {
            for id in holders(&assigned) {
                if let Some(n) = self.view.get_mut(id) {
                    n.load = n.load.saturating_add(1);
                }
            }
            tracing::info!(job = %assigned.id, producer = ?assigned.producer, consumer = ?assigned.consumer, attempt = assigned.attempts, "job assigned");
            report.jobs_assigned += 1;
        }
        Ok(())
    }
}

/// The nodes working on `job` now, each once: the producer until its codes are sent, the
/// consumer until the job ends.
fn holders(job: &JobRecord) -> impl Iterator<Item = &str> {
    let producing = matches!(
        job.state,
        JobState::Assigned | JobState::Prefilling | JobState::Transferring
    );
    let consuming = producing || job.state == JobState::Decoding;
    let producer = job.producer.as_deref().filter(|_| producing);
    let consumer = job
        .consumer
        .as_deref()
        .filter(|c| consuming && Some(*c) != producer);
    producer.into_iter().chain(consumer)
}

/// The store's own record of `node` (not a watch's copy), if it is registered.
async fn stored_node(
    store: &dyn MetaStore,
    keys: &Keys,
    node: &str,
) -> Result<Option<NodeInfo>, SchedulerError> {
    let key = keys.node(node)?;
    match store.get(&key).await? {
        Some(kv) => Ok(Some(envelope::decode(&key, &kv.value)?)),
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

/// Why a running job's attempt cannot finish, and which node is to blame.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LostAttempt {
    /// As the record shows it.
    reason: String,
    /// Whose fault.
    blame: Blame,
    /// Whether the attempt passed its deadline (rather than losing a node).
    expired: bool,
}

/// Why `job`'s running attempt cannot finish, if it cannot: a party it still needs is not
/// among `nodes`, or is there under another epoch than the one the attempt was given to (it
/// restarted under the same id: its new incarnation knows nothing of the attempt), or the
/// attempt is past its deadline at `now_ms`.
fn lost_attempt(job: &JobRecord, nodes: &NodeMap, now_ms: u64) -> Option<LostAttempt> {
    let lost = |reason: String, blame| {
        Some(LostAttempt {
            reason,
            blame,
            expired: false,
        })
    };
    // Once decoding, the consumer holds everything: the producer no longer matters.
    let needs_producer = matches!(
        job.state,
        JobState::Assigned | JobState::Prefilling | JobState::Transferring
    );
    let parties = [
        (
            needs_producer,
            "producer",
            &job.producer,
            job.producer_epoch,
            Blame::Producer,
        ),
        (
            job.state.is_running(),
            "consumer",
            &job.consumer,
            job.consumer_epoch,
            Blame::Consumer,
        ),
    ];
    for (needed, side, node, epoch, blame) in parties {
        if !needed {
            continue;
        }
        let Some(id) = node else {
            return lost(format!("no {side} recorded"), Blame::Nobody);
        };
        match (nodes.get(id), epoch) {
            (None, _) => return lost(format!("{side} {id} left the cluster"), blame),
            (Some(n), Some(e)) if n.epoch != 0 && n.epoch != e => {
                return lost(
                    format!("{side} {id} restarted (epoch {e}, now {})", n.epoch),
                    blame,
                )
            }
            _ => {}
        }
    }
    let deadline = job.attempt_deadline_ms.filter(|_| job.state.is_running())?;
    if now_ms < deadline {
        return None;
    }
    let blame = match job.state {
        JobState::Assigned | JobState::Prefilling => Blame::Producer,
        JobState::Decoding => Blame::Consumer,
        _ => Blame::Nobody,
    };
    let over = Duration::from_millis(now_ms.saturating_sub(deadline));
    Some(LostAttempt {
        reason: format!(
            "attempt {} passed its deadline in state {} ({}s over)",
            job.attempts,
            job.state,
            over.as_secs()
        ),
        blame,
        expired: true,
    })
}
