//! Durable job records: the record and its changes as pure code ([`JobRecord`], driven by the
//! state machine of [`JobState`] from `scd-types`) and a [`JobStore`] that applies every change
//! as a compare-and-swap on the record's revision, so concurrent writers (producer, consumer,
//! leader, a user cancelling) never overwrite each other's updates.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use scd_types::{
    JobId, JobRequest, JobResult, JobState, Mode, NodeId, Ranks, StageSpan, TraceContext,
    TranslatorHash,
};
use serde::{Deserialize, Serialize};

use crate::envelope::{self, EnvelopeError};
use crate::keys::Keys;
use crate::leader::LeaderGuard;
use crate::store::{Compare, MetaStore, StoreError, Txn, TxnOp};
use crate::translators::backoff;

mod progress;
pub use progress::{Appended, FOLD_AFTER_BATCHES};

/// One state change in a job's life.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateEntry {
    /// The state entered.
    pub state: JobState,
    /// When (milliseconds since the Unix epoch).
    pub at_ms: u64,
    /// The producer at that moment.
    #[serde(default)]
    pub producer: Option<NodeId>,
}

/// The size a producer chose for an attempt's codes (their ranks, and for transform-coded
/// codes their rate), and on what grounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RanksChoice {
    /// The ranks. Transform-coded codes (`step` set) carry every component their rate pays
    /// for, so theirs are the translator's `r_max`; `kvtc`'s codes are in the base's own basis,
    /// and the ranks are not theirs.
    pub ranks: Ranks,
    /// The rate of transform-coded codes (`reuse` and `scd` in dtype `tc`, `kvtc`): the
    /// quantiser's step, coarser as it grows. `None` for codes of a fixed width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<f32>,
    /// How they were chosen.
    pub rule: RanksRule,
    /// The link throughput to the consumer the choice assumed, Mbit/s (adaptive choices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_mbit: Option<f64>,
    /// The held-out KL the translator's curve gives these ranks, or its rate table this rate
    /// (adaptive choices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub curve_kl: Option<f64>,
}

/// The documents a job names, as its producer served them (SemPIC).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentsRecord {
    /// The writer version that compiled them (every one of a job's by the same).
    pub writer: String,
    /// The positions they occupy before the prompt (boundary tokens included).
    pub rows: u64,
    /// Ids of those compiled for this job; the others came from the producer's store, with
    /// nothing computed.
    pub compiled: Vec<String>,
    /// How many came from the store.
    pub hits: u32,
}

/// A job run in a safer mode than the one it was submitted in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModeFallback {
    /// The mode it was submitted in.
    pub from: Mode,
    /// Why it did not run in it.
    pub reason: String,
}

/// How the producer resolved a job submitted in mode `auto`: the mode it chose (the record's
/// `mode` from then on), on what grounds, and what it expected of each mode it weighed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeChoice {
    /// The mode chosen.
    pub chosen: Mode,
    /// Why, in words (shown by `scd jobs show` and on the trace).
    pub reason: String,
    /// The link throughput to the consumer the estimates assumed, Mbit/s; `None` when the
    /// link was not measured yet (the estimates then assume [`ModeChoice::UNMEASURED_MBIT`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_mbit: Option<f64>,
    /// Every mode weighed.
    pub weighed: Vec<ModeEstimate>,
}

impl ModeChoice {
    /// The link speed assumed before a link is measured: slow enough that a choice made on it
    /// does not send a large payload over a slow link, and the transfer it makes measures it.
    pub const UNMEASURED_MBIT: f64 = 100.0;

    /// A choice that follows from what the job is, with nothing weighed.
    pub fn fixed(mode: Mode, why: &str) -> Self {
        Self {
            chosen: mode,
            reason: format!("{mode}: {why}"),
            link_mbit: None,
            weighed: Vec::new(),
        }
    }
}

/// What the producer expected of one mode for one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeEstimate {
    /// The mode.
    pub mode: Mode,
    /// Expected time to first token, ms; `None` when a speed it needs was not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_ms: Option<f64>,
    /// Bytes it would send.
    pub payload_bytes: u64,
    /// Its measured held-out KL to the expert's own prefill for this pair; `None`: not
    /// measured (the mode is not chosen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
}

/// Why an attempt's codes have the ranks they have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RanksRule {
    /// Chosen for the measured link under the KL ceiling.
    Adaptive,
    /// The translator's defaults, as configured.
    Default,
    /// Fixed by the producer's configuration.
    Fixed,
    /// Adaptive was configured, but the link to the consumer has not been measured yet: the
    /// translator's defaults.
    Unmeasured,
    /// Adaptive was configured, but the translator has no quality curve: its defaults.
    NoCurve,
    /// Adaptive was configured, but no ranks meet the KL ceiling: the translator's defaults.
    OverCeiling,
}

impl RanksRule {
    /// The rule's name, as in the record.
    pub fn name(self) -> &'static str {
        match self {
            Self::Adaptive => "adaptive",
            Self::Default => "default",
            Self::Fixed => "fixed",
            Self::Unmeasured => "unmeasured",
            Self::NoCurve => "no-curve",
            Self::OverCeiling => "over-ceiling",
        }
    }
}

/// A job's durable record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Job id.
    pub id: JobId,
    /// Expert model that answers.
    pub expert: String,
    /// How the prompt's state reaches the expert.
    pub mode: Mode,
    /// Current state.
    pub state: JobState,
    /// The trace context of the request that created the job, so that the spans of every node
    /// that works on it join one trace (empty: no trace). Records written before the field
    /// existed read as empty.
    #[serde(default)]
    pub trace: TraceContext,
    /// Producer node, once assigned.
    #[serde(default)]
    pub producer: Option<NodeId>,
    /// Consumer node, once assigned.
    #[serde(default)]
    pub consumer: Option<NodeId>,
    /// The registration epoch ([`crate::NodeInfo::epoch`]) of the current attempt's producer,
    /// as the scheduler saw it when assigning (`None`: unknown). The same id under another
    /// epoch is a restarted node, which lost the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub producer_epoch: Option<u64>,
    /// The same for the current attempt's consumer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_epoch: Option<u64>,
    /// When the current attempt must have ended, in ms since the Unix epoch on the scheduler's
    /// clock (`None`: no deadline); past it the scheduler abandons the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_deadline_ms: Option<u64>,
    /// Assignments so far (the first is attempt 1).
    pub attempts: u32,
    /// Assignments allowed before the job fails.
    pub max_attempts: u32,
    /// Producers that lost this job; a retry avoids them while others exist.
    #[serde(default)]
    pub failed_producers: Vec<NodeId>,
    /// Consumers that lost this job; a retry avoids them while others host the expert.
    #[serde(default)]
    pub failed_consumers: Vec<NodeId>,
    /// The prompt's chained block hashes, for prefix affinity.
    #[serde(default)]
    pub prefix_hashes: Vec<String>,
    /// Every state entered, with its time.
    #[serde(default)]
    pub history: Vec<StateEntry>,
    /// Stage timings in milliseconds (prefill, encode, transfer, rebuild, first_token, total).
    #[serde(default)]
    pub timings_ms: BTreeMap<String, f64>,
    /// When each stage ran, on the wall clock of the node that ran it (milliseconds since the
    /// Unix epoch): `prefill`, `encode`, `transfer` from the producer; `arrivals` (first to
    /// last code frame), `rebuild`, `decode` from the consumer. Nodes' clocks agree only as well
    /// as they are synchronised.
    #[serde(default)]
    pub stages: BTreeMap<String, StageSpan>,
    /// Code bytes per layer, as the producer's encoder made them (payload, no frame headers).
    #[serde(default)]
    pub layer_bytes: Vec<u64>,
    /// Bytes of codes sent.
    #[serde(default)]
    pub payload_bytes: u64,
    /// The translator version the producer made the codes with (modes `reuse` and `scd`): set
    /// when it claims the attempt, so the consumer rebuilds with the same one.
    #[serde(default)]
    pub translator: Option<TranslatorHash>,
    /// Leading prompt tokens the producer took from its prefix cache instead of computing.
    #[serde(default)]
    pub cached_prefix_tokens: u64,
    /// The ranks of the attempt's `reuse` / `scd` codes and why, chosen by the producer as it
    /// claimed the attempt (for the link to its consumer) and read by the consumer to rebuild.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<RanksChoice>,
    /// More experts served by the same prompt (a fan-out): one prefill and one code stream to
    /// one consumer node hosting them all, which decodes each. `output` is `expert`'s,
    /// `outputs` the others'.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fan_out: Vec<String>,
    /// The fan-out experts' results, by expert.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, JobResult>,
    /// Set when the job was submitted in mode `auto`, by the producer that resolved it: `mode`
    /// is what it chose. Kept across attempts (a retry runs in the same mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_choice: Option<ModeChoice>,
    /// Set when the scheduler ran the job in another mode than it was submitted in (its
    /// translator was marked degraded): `mode` is what ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<ModeFallback>,
    /// How the producer served the documents the request names, once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub documents: Option<DocumentsRecord>,
    /// What the job asks for (the prompt's tokens and the generation settings); `None` for a
    /// record made only to be scheduled (the scheduler's own tests).
    #[serde(default)]
    pub request: Option<JobRequest>,
    /// What the expert generated, once done.
    #[serde(default)]
    pub output: Option<JobResult>,
    /// Why it failed or was cancelled, or why the last attempt was abandoned.
    #[serde(default)]
    pub error: Option<String>,
    /// Creation time (ms since the Unix epoch).
    pub created_at_ms: u64,
    /// Last update time (ms since the Unix epoch).
    pub updated_at_ms: u64,
}

/// Errors of job operations.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The store failed.
    #[error("job store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
    /// The state machine does not allow this change.
    #[error("job {id}: cannot go from {from} to {to}")]
    InvalidTransition {
        /// Job id.
        id: JobId,
        /// Current state.
        from: JobState,
        /// Requested state.
        to: JobState,
    },
    /// No such job.
    #[error("job {0} not found")]
    NotFound(JobId),
    /// A job with this id exists already.
    #[error("job {0} already exists")]
    AlreadyExists(JobId),
    /// Too many concurrent writers; the compare-and-swap kept losing.
    #[error("job {id}: gave up after {attempts} conflicting updates")]
    Contention {
        /// Job id.
        id: JobId,
        /// Attempts made.
        attempts: u32,
    },
    /// A leader-only write found that this replica no longer leads.
    #[error("not the leader any more; write to job {0} dropped")]
    NotLeader(JobId),
    /// The cluster holds its limit of unfinished jobs; nothing was written.
    #[error(transparent)]
    Busy(#[from] crate::admission::Busy),
}

/// Store errors a job read or update waits out before failing: about 10 s in all, longer than an etcd
/// restart takes.
const STORE_OUTAGE_RETRIES: u32 = 8;

/// Runs one store call, waiting out transient errors: after the `n`th, 250 ms doubling, at
/// most 2 s, [`STORE_OUTAGE_RETRIES`] times.
async fn patiently<T, F, Fut>(mut call: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut outages = 0;
    loop {
        match call().await {
            Err(e) if e.is_transient() && outages < STORE_OUTAGE_RETRIES => {
                outages += 1;
                tokio::time::sleep(Duration::from_millis((250u64 << outages.min(3)).min(2_000)))
                    .await;
            }
            other => return other,
        }
    }
}

/// Which node lost an abandoned attempt (see [`JobRecord::retry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The producer died, left or dropped the stream.
    Producer,
    /// The consumer died or left, or had no room to receive the job (its receive budget
    /// spent by other jobs).
    Consumer,
    /// Neither (a node handing its work back as it drains, an actor restarting).
    Nobody,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl JobRecord {
    /// A new queued job without a trace. The id is the caller's (a client that picks its own
    /// id can retry a submit and learn from [`JobError::AlreadyExists`] that the first one
    /// landed) or [`JobId::random`].
    pub fn new(id: JobId, expert: impl Into<String>, mode: Mode, max_attempts: u32) -> Self {
        let now = now_ms();
        Self {
            id,
            expert: expert.into(),
            mode,
            state: JobState::Queued,
            trace: TraceContext::new(),
            producer: None,
            consumer: None,
            producer_epoch: None,
            consumer_epoch: None,
            attempt_deadline_ms: None,
            attempts: 0,
            max_attempts: max_attempts.max(1),
            failed_producers: Vec::new(),
            failed_consumers: Vec::new(),
            prefix_hashes: Vec::new(),
            history: vec![StateEntry {
                state: JobState::Queued,
                at_ms: now,
                producer: None,
            }],
            timings_ms: BTreeMap::new(),
            stages: BTreeMap::new(),
            layer_bytes: Vec::new(),
            payload_bytes: 0,
            translator: None,
            cached_prefix_tokens: 0,
            ranks: None,
            fan_out: Vec::new(),
            outputs: BTreeMap::new(),
            mode_choice: None,
            fallback: None,
            documents: None,
            request: None,
            output: None,
            error: None,
            created_at_ms: now,
            updated_at_ms: now,
        }
    }

    /// Every expert the job serves: `expert`, then the fan-out ones.
    pub fn experts(&self) -> Vec<&str> {
        std::iter::once(self.expert.as_str())
            .chain(self.fan_out.iter().map(String::as_str))
            .collect()
    }

    /// The same job serving `more` experts too (a fan-out).
    pub fn with_fan_out(mut self, more: Vec<String>) -> Self {
        self.fan_out = more;
        self
    }

    /// The same job carrying `request`.
    pub fn with_request(mut self, request: JobRequest) -> Self {
        self.request = Some(request);
        self
    }

    /// The same job carrying `trace`.
    pub fn with_trace(mut self, trace: TraceContext) -> Self {
        self.trace = trace;
        self
    }

    /// Moves to `next` if the state machine allows it.
    pub fn transition(&mut self, next: JobState, at_ms: u64) -> Result<(), JobError> {
        if !self.state.can_transition_to(next) {
            return Err(JobError::InvalidTransition {
                id: self.id,
                from: self.state,
                to: next,
            });
        }
        self.state = next;
        self.updated_at_ms = at_ms;
        self.history.push(StateEntry {
            state: next,
            at_ms,
            producer: self.producer.clone(),
        });
        Ok(())
    }

    /// Assigns a queued job (one more attempt).
    pub fn assign(
        &mut self,
        producer: &NodeId,
        consumer: &NodeId,
        at_ms: u64,
    ) -> Result<(), JobError> {
        if self.state != JobState::Queued {
            return Err(JobError::InvalidTransition {
                id: self.id,
                from: self.state,
                to: JobState::Assigned,
            });
        }
        self.producer = Some(producer.clone());
        self.consumer = Some(consumer.clone());
        // The caller stamps the new attempt's epochs and deadline, if it knows them.
        self.producer_epoch = None;
        self.consumer_epoch = None;
        self.attempt_deadline_ms = None;
        self.attempts += 1;
        self.transition(JobState::Assigned, at_ms)
    }

    /// Abandons the current attempt (its producer or consumer was lost): back to queued, or
    /// failed when no attempts are left. The node `blame` names is remembered so that the next
    /// attempt avoids it while others are available.
    pub fn retry(&mut self, reason: &str, blame: Blame, at_ms: u64) -> Result<(), JobError> {
        if !self.state.is_running() {
            return Err(JobError::InvalidTransition {
                id: self.id,
                from: self.state,
                to: JobState::Queued,
            });
        }
        if let Some(p) = self.producer.take() {
            if blame == Blame::Producer && !self.failed_producers.contains(&p) {
                self.failed_producers.push(p);
            }
        }
        if let Some(c) = self.consumer.take() {
            if blame == Blame::Consumer && !self.failed_consumers.contains(&c) {
                self.failed_consumers.push(c);
            }
        }
        self.producer_epoch = None;
        self.consumer_epoch = None;
        self.attempt_deadline_ms = None;
        self.error = Some(reason.to_string());
        if self.attempts >= self.max_attempts {
            let reason = format!("{reason}; gave up after {} attempts", self.attempts);
            return self.fail(&reason, at_ms);
        }
        self.transition(JobState::Queued, at_ms)
    }

    /// Fails an unfinished job; a refused fail leaves the record as it was.
    pub fn fail(&mut self, reason: &str, at_ms: u64) -> Result<(), JobError> {
        self.transition(JobState::Failed, at_ms)?;
        self.error = Some(reason.to_string());
        Ok(())
    }

    /// Cancels an unfinished job. Cancelling a cancelled job changes nothing (a user may repeat
    /// the request); a job that is done or failed cannot be cancelled.
    pub fn cancel(&mut self, reason: &str, at_ms: u64) -> Result<(), JobError> {
        if self.state == JobState::Cancelled {
            return Ok(());
        }
        if !self.state.can_transition_to(JobState::Cancelled) {
            return Err(JobError::InvalidTransition {
                id: self.id,
                from: self.state,
                to: JobState::Cancelled,
            });
        }
        self.error = Some(reason.to_string());
        self.transition(JobState::Cancelled, at_ms)
    }

    /// Time spent in each state so far, summed over attempts, in milliseconds.
    pub fn time_in_states(&self, now_ms: u64) -> BTreeMap<JobState, u64> {
        let mut out = BTreeMap::new();
        for (i, entry) in self.history.iter().enumerate() {
            let end = self.history.get(i + 1).map_or(
                if entry.state.is_finished() {
                    entry.at_ms
                } else {
                    now_ms
                },
                |n| n.at_ms,
            );
            *out.entry(entry.state).or_insert(0) += end.saturating_sub(entry.at_ms);
        }
        out
    }
}

/// Reads and updates job records.
#[derive(Debug, Clone)]
pub struct JobStore {
    store: Arc<dyn MetaStore>,
    keys: Keys,
    max_attempts: u32,
}

impl JobStore {
    /// A job store; a CAS update gives up after 64 conflicting attempts.
    pub fn new(store: Arc<dyn MetaStore>, keys: Keys) -> Self {
        Self {
            store,
            keys,
            max_attempts: 64,
        }
    }

    /// Creates a job record; fails if the id is taken.
    pub async fn create(&self, job: &JobRecord) -> Result<(), JobError> {
        let key = self.keys.job(job.id);
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([TxnOp::put(key, envelope::encode(job)?)]);
        if self.store.txn(txn).await?.succeeded {
            Ok(())
        } else {
            Err(JobError::AlreadyExists(job.id))
        }
    }

    /// Creates a job record if the cluster's admission bound has room (see
    /// [`crate::admission`]); fails with [`JobError::Busy`] when it has none and
    /// [`JobError::AlreadyExists`] if the id is taken.
    pub async fn create_admitted(&self, job: &JobRecord) -> Result<(), JobError> {
        crate::admission::create_admitted(self.store.as_ref(), &self.keys, job, self.max_attempts)
            .await
    }

    /// Reads a job, live or archived, waiting out a brief store outage; a decoding job's
    /// output includes what its consumer appended since the record was written
    /// ([`JobStore::append_output`]).
    pub async fn get(&self, id: JobId) -> Result<Option<JobRecord>, JobError> {
        let live = self.keys.job(id);
        if let Some(kv) = patiently(|| self.store.get(&live)).await? {
            return progress::with_batches(self.store.as_ref(), &self.keys, &kv)
                .await
                .map(Some);
        }
        let archived = self.keys.archived_job(id);
        match patiently(|| self.store.get(&archived)).await? {
            Some(kv) => Ok(Some(envelope::decode(&kv.key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Every live job (unfinished, or finished and not archived yet) with its modification
    /// revision (unreadable records are skipped and logged). A decoding job's output is as its
    /// record was last written: what its consumer appended since is read by [`JobStore::get`].
    pub async fn list(&self) -> Result<Vec<(JobRecord, i64)>, JobError> {
        self.list_under(&self.keys.jobs_prefix()).await
    }

    /// Every archived job with its modification revision (unreadable records are skipped and
    /// logged).
    pub async fn list_archived(&self) -> Result<Vec<(JobRecord, i64)>, JobError> {
        self.list_under(&self.keys.archived_jobs_prefix()).await
    }

    /// The newest jobs, newest first by creation, at most `limit`: every live record, and of
    /// the archive only the `limit` records archived last (etcd sorts them; the rest of the
    /// archive is not read). What `scd jobs list` shows.
    pub async fn list_newest(&self, limit: usize) -> Result<Vec<JobRecord>, JobError> {
        let mut jobs: Vec<JobRecord> = self.list().await?.into_iter().map(|(j, _)| j).collect();
        let archived = self
            .store
            .get_prefix_newest(&self.keys.archived_jobs_prefix(), limit)
            .await?;
        for kv in archived.kvs {
            match envelope::decode::<JobRecord>(&kv.key, &kv.value) {
                Ok(job) => jobs.push(job),
                Err(e) => tracing::warn!(error = %e, "skipping unreadable job record"),
            }
        }
        jobs.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then(b.id.cmp(&a.id)));
        jobs.truncate(limit);
        Ok(jobs)
    }

    async fn list_under(&self, prefix: &str) -> Result<Vec<(JobRecord, i64)>, JobError> {
        let listing = self.store.get_prefix(prefix).await?;
        let mut jobs = Vec::with_capacity(listing.kvs.len());
        for kv in listing.kvs {
            match envelope::decode::<JobRecord>(&kv.key, &kv.value) {
                Ok(job) => jobs.push((job, kv.mod_revision)),
                Err(e) => tracing::warn!(error = %e, "skipping unreadable job record"),
            }
        }
        Ok(jobs)
    }

    /// Moves a finished record, as listed at `revision`, from the live prefix to the archive
    /// in one transaction (fenced by `guard` when given). Returns whether it moved: `false`
    /// when the record changed since (or, with a guard, leadership was lost); nothing is
    /// written then.
    pub async fn archive(
        &self,
        job: &JobRecord,
        revision: i64,
        guard: Option<&LeaderGuard>,
    ) -> Result<bool, JobError> {
        if !job.state.is_finished() {
            return Ok(false);
        }
        let key = self.keys.job(job.id);
        let mut compares = vec![Compare::mod_revision(key.clone(), revision)];
        compares.extend(guard.map(LeaderGuard::compare));
        let txn = Txn::new().when(compares).and_then([
            TxnOp::put(self.keys.archived_job(job.id), envelope::encode(job)?),
            TxnOp::delete(key),
        ]);
        Ok(self.store.txn(txn).await?.succeeded)
    }

    /// Removes a live record, as listed at `revision` (fenced by `guard` when given). Returns
    /// whether it went.
    async fn remove_live(
        &self,
        id: JobId,
        revision: i64,
        guard: Option<&LeaderGuard>,
    ) -> Result<bool, JobError> {
        let key = self.keys.job(id);
        let mut compares = vec![Compare::mod_revision(key.clone(), revision)];
        compares.extend(guard.map(LeaderGuard::compare));
        let txn = Txn::new().when(compares).and_then([TxnOp::delete(key)]);
        Ok(self.store.txn(txn).await?.succeeded)
    }

    /// One finished live record's step of the retention ([`ArchiveConfig`]): removed once
    /// older than `max_age`, else moved to the archive once `archive.after` has passed since
    /// it finished. Unfinished records are left alone.
    pub async fn retire(
        &self,
        job: &JobRecord,
        revision: i64,
        now_ms: u64,
        max_age: Duration,
        archive: &ArchiveConfig,
        guard: Option<&LeaderGuard>,
    ) -> Result<Retired, JobError> {
        if !job.state.is_finished() {
            return Ok(Retired::Kept);
        }
        if older_than(job, max_age, now_ms) {
            if self.remove_live(job.id, revision, guard).await? {
                return Ok(Retired::Removed);
            }
        } else if older_than(job, archive.after, now_ms)
            && self.archive(job, revision, guard).await?
        {
            return Ok(Retired::Archived);
        }
        Ok(Retired::Kept)
    }

    /// Applies the retention to the archive: removes the records older than `max_age` (since
    /// their last update) and, past `max_records`, the oldest. Unreadable archived records go
    /// too. Deletes are batched, each batch fenced by `guard` when given; returns how many
    /// records went.
    pub async fn sweep_archive(
        &self,
        now_ms: u64,
        max_age: Duration,
        max_records: usize,
        guard: Option<&LeaderGuard>,
    ) -> Result<usize, JobError> {
        let listing = self
            .store
            .get_prefix(&self.keys.archived_jobs_prefix())
            .await?;
        let mut kept = Vec::with_capacity(listing.kvs.len());
        let mut doomed = Vec::new();
        for kv in listing.kvs {
            match envelope::decode::<JobRecord>(&kv.key, &kv.value) {
                Ok(job) if !older_than(&job, max_age, now_ms) => {
                    kept.push((job.updated_at_ms, kv.key))
                }
                Ok(_) => doomed.push(kv.key),
                Err(e) => {
                    tracing::warn!(error = %e, "removing an unreadable archived job record");
                    doomed.push(kv.key);
                }
            }
        }
        if kept.len() > max_records {
            // Newest first; the tail past the bound goes.
            kept.sort_by(|a, b| b.cmp(a));
            doomed.extend(kept.drain(max_records..).map(|(_, key)| key));
        }
        let mut removed = 0;
        for batch in doomed.chunks(SWEEP_BATCH) {
            let txn = Txn::new()
                .when(guard.map(LeaderGuard::compare))
                .and_then(batch.iter().map(|key| TxnOp::delete(key.clone())));
            if !self.store.txn(txn).await?.succeeded {
                // Only the fence can fail: this replica no longer leads.
                break;
            }
            removed += batch.len();
        }
        Ok(removed)
    }

    /// Applies `change` by compare-and-swap, retrying on conflicts with capped backoff. `change`
    /// may run several times, each time on the freshest record; an error from it aborts, and a
    /// change that leaves the record as it was writes nothing.
    pub async fn update(
        &self,
        id: JobId,
        change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        self.update_inner(id, None, change).await
    }

    /// Like [`JobStore::update`], but only while `guard`'s leadership holds.
    pub async fn update_as_leader(
        &self,
        id: JobId,
        guard: &LeaderGuard,
        change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        self.update_inner(id, Some(guard), change).await
    }

    /// Moves a job to `next` (checked by the state machine), recording the time.
    pub async fn transition(&self, id: JobId, next: JobState) -> Result<JobRecord, JobError> {
        self.update(id, |job| job.transition(next, now_ms())).await
    }

    /// Fails an unfinished job with `reason` (see [`JobRecord::fail`]).
    pub async fn fail(&self, id: JobId, reason: &str) -> Result<JobRecord, JobError> {
        self.update(id, |job| job.fail(reason, now_ms())).await
    }

    /// Cancels an unfinished job with `reason` (see [`JobRecord::cancel`]). A producer or
    /// consumer working on it learns of it by watching the record.
    pub async fn cancel(&self, id: JobId, reason: &str) -> Result<JobRecord, JobError> {
        self.update(id, |job| job.cancel(reason, now_ms())).await
    }

    async fn update_inner(
        &self,
        id: JobId,
        guard: Option<&LeaderGuard>,
        mut change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        let key = self.keys.job(id);
        for attempt in 0..self.max_attempts {
            // etcd briefly away (a restart, a leader change) is waited out: a write lost here
            // could leave a job running for ever. Retrying is safe because `change` runs on the
            // fresh record, where a write whose answer was lost is already visible (its
            // compare then fails, and the re-read finds nothing left to change).
            let Some(kv) = patiently(|| self.store.get(&key)).await? else {
                return Err(JobError::NotFound(id));
            };
            let mut before: JobRecord = envelope::decode(&kv.key, &kv.value)?;
            // The output appended since the record was written goes into it with this change.
            let pending = if progress::may_have_batches(before.state) {
                let pending = progress::Pending::read(self.store.as_ref(), &self.keys, id).await?;
                pending.fold_into(&mut before);
                pending
            } else {
                progress::Pending::default()
            };
            let mut job = before.clone();
            change(&mut job)?;
            if job == before {
                // Nothing to write: a write would only wake every watcher of the job for nothing.
                return Ok(job);
            }
            job.updated_at_ms = job.updated_at_ms.max(now_ms());
            let mut compares = vec![Compare::mod_revision(key.clone(), kv.mod_revision)];
            compares.extend(guard.map(LeaderGuard::compare));
            compares.extend(pending.unchanged());
            let txn = Txn::new().when(compares).and_then(
                std::iter::once(TxnOp::put(key.clone(), envelope::encode(&job)?))
                    .chain(pending.deletes()),
            );
            if patiently(|| self.store.txn(txn.clone())).await?.succeeded {
                return Ok(job);
            }
            if let Some(guard) = guard {
                if !self.still_leader(guard).await? {
                    return Err(JobError::NotLeader(id));
                }
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(JobError::Contention {
            id,
            attempts: self.max_attempts,
        })
    }

    async fn still_leader(&self, guard: &LeaderGuard) -> Result<bool, JobError> {
        Ok(self
            .store
            .get(&guard.key)
            .await?
            .is_some_and(|kv| kv.create_revision == guard.create_revision))
    }

    /// Removes finished jobs, live or archived, last updated more than `retention` before
    /// `now_ms`; returns how many went. A live record updated meanwhile is left for the next
    /// sweep.
    pub async fn sweep_finished(
        &self,
        now_ms: u64,
        retention: Duration,
    ) -> Result<usize, JobError> {
        let mut removed = 0;
        for (job, revision) in self.list().await? {
            if job.state.is_finished()
                && older_than(&job, retention, now_ms)
                && self.remove_live(job.id, revision, None).await?
            {
                removed += 1;
            }
        }
        removed += self
            .sweep_archive(now_ms, retention, usize::MAX, None)
            .await?;
        Ok(removed)
    }
}

/// Deletes in one transaction of an archive sweep (etcd allows 128 operations by default).
const SWEEP_BATCH: usize = 64;

/// Whether `job` was last updated at least `age` before `now_ms`.
fn older_than(job: &JobRecord, age: Duration, now_ms: u64) -> bool {
    let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
    job.updated_at_ms.saturating_add(age_ms) <= now_ms
}

/// What [`JobStore::retire`] did with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retired {
    /// Nothing: unfinished, too recent, or changed since it was listed.
    Kept,
    /// Moved to the archive.
    Archived,
    /// Removed: past the retention's age.
    Removed,
}

/// Where finished job records go and how many are kept. Records finished within `after` stay
/// among the live ones (`<root>/jobs/`), where clients following a job and the nodes' job
/// followers see them end; then they move to `<root>/archive/jobs/`, which every job
/// listing of the scheduler and the nodes leaves out. The archive holds at most
/// `max_records`, and no record past the scheduler's retention age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchiveConfig {
    /// How long a finished record stays live before it is archived. Default 60 s.
    pub after: Duration,
    /// Most archived records kept; the oldest go first. Default 10 000.
    pub max_records: usize,
    /// How often the leader sweeps the archive (at least as often as the retention age).
    /// Default 60 s.
    pub sweep_every: Duration,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        Self {
            after: Duration::from_secs(60),
            max_records: 10_000,
            sweep_every: Duration::from_secs(60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    fn job(max_attempts: u32) -> JobRecord {
        JobRecord::new(JobId::from_u128(1), "sotu", Mode::Scd, max_attempts)
    }

    /// A record driven to `state` along allowed steps.
    fn job_in(state: JobState) -> JobRecord {
        let mut j = job(3);
        let path: &[JobState] = match state {
            Queued => &[],
            Assigned => &[Assigned],
            Prefilling => &[Assigned, Prefilling],
            Transferring => &[Assigned, Prefilling, Transferring],
            Decoding => &[Assigned, Prefilling, Transferring, Decoding],
            Done => &[Assigned, Prefilling, Transferring, Decoding, Done],
            Failed => &[Failed],
            Cancelled => &[Cancelled],
        };
        for (t, s) in path.iter().enumerate() {
            j.transition(*s, t as u64).unwrap();
        }
        assert_eq!(j.state, state);
        j
    }

    #[test]
    fn the_record_moves_exactly_as_the_state_machine_allows() {
        let allowed = [
            (Queued, Assigned),
            (Queued, Failed),
            (Queued, Cancelled),
            (Assigned, Prefilling),
            (Assigned, Queued),
            (Assigned, Failed),
            (Assigned, Cancelled),
            (Prefilling, Transferring),
            (Prefilling, Queued),
            (Prefilling, Failed),
            (Prefilling, Cancelled),
            (Transferring, Decoding),
            (Transferring, Queued),
            (Transferring, Failed),
            (Transferring, Cancelled),
            (Decoding, Done),
            (Decoding, Queued),
            (Decoding, Failed),
            (Decoding, Cancelled),
        ];
        for from in JobState::ALL {
            for to in JobState::ALL {
                let mut j = job_in(from);
                let before = j.clone();
                let moved = j.transition(to, 99).is_ok();
                assert_eq!(moved, allowed.contains(&(from, to)), "{from} -> {to}");
                if moved {
                    assert_eq!((j.state, j.history.last().map(|h| h.state)), (to, Some(to)));
                } else {
                    assert_eq!(j, before, "a refused {from} -> {to} changed the record");
                }
            }
        }
    }

    #[test]
    fn cancel_and_fail_end_an_unfinished_job_once() {
        for from in [Queued, Assigned, Prefilling, Transferring, Decoding] {
            let mut j = job_in(from);
            j.cancel("user asked", 50).unwrap();
            assert_eq!(
                (j.state, j.error.as_deref()),
                (Cancelled, Some("user asked"))
            );
            // Asking again changes nothing, not even the reason.
            let once = j.clone();
            j.cancel("asked twice", 60).unwrap();
            assert_eq!(j, once);
        }
        for from in [Done, Failed, Cancelled] {
            let mut j = job_in(from);
            let before = j.clone();
            assert!(j.fail("too late", 50).is_err());
            assert_eq!(j, before, "a refused fail changed the record");
        }
        for from in [Done, Failed] {
            let mut j = job_in(from);
            let before = j.clone();
            assert!(matches!(
                j.cancel("too late", 50),
                Err(JobError::InvalidTransition { from: f, to: Cancelled, .. }) if f == from
            ));
            assert_eq!(j, before);
        }
    }

    #[test]
    fn records_keep_their_json_field_names() {
        let mut trace = TraceContext::new();
        trace
            .insert(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .unwrap();
        let j =
            JobRecord::new(JobId::from_u128(0xab), "sotu", Mode::DroidSpeak, 2).with_trace(trace);
        let value = serde_json::to_value(&j).unwrap();
        assert_eq!(value["id"], "000000000000000000000000000000ab");
        assert_eq!(value["mode"], "droidspeak");
        assert_eq!(value["state"], "queued");
        assert_eq!(value["trace"][0]["key"], "traceparent");
        assert_eq!(serde_json::from_value::<JobRecord>(value).unwrap(), j);
        // A record written before the trace field existed still reads, with an empty trace.
        let old = r#"{"id":"00000000000000000000000000000007","expert":"sotu","mode":"scd",
            "state":"assigned","producer":"p1","consumer":"c1","attempts":1,"max_attempts":3,
            "created_at_ms":1,"updated_at_ms":2}"#;
        let old: JobRecord = serde_json::from_str(old).unwrap();
        assert_eq!(
            (old.id, old.mode, old.state, old.trace.is_empty()),
            (JobId::from_u128(7), Mode::Scd, Assigned, true)
        );
        // Ids and modes are validated on the way in.
        for bad in [
            r#"{"id":"j-1","expert":"e","mode":"scd","state":"queued","attempts":0,"max_attempts":1,"created_at_ms":0,"updated_at_ms":0}"#,
            r#"{"id":"01","expert":"e","mode":"reuse-only","state":"queued","attempts":0,"max_attempts":1,"created_at_ms":0,"updated_at_ms":0}"#,
        ] {
            assert!(serde_json::from_str::<JobRecord>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_job_runs_through_the_pipeline() {
        let mut job = job(3);
        assert!(matches!(
            job.transition(Prefilling, 1),
            Err(JobError::InvalidTransition { .. })
        ));
        job.assign(&NodeId::from_static("p1"), &NodeId::from_static("c1"), 10)
            .unwrap();
        for (s, t) in [
            (Prefilling, 20),
            (Transferring, 30),
            (Decoding, 45),
            (Done, 60),
        ] {
            job.transition(s, t).unwrap();
        }
        assert_eq!(job.attempts, 1);
        let times = job.time_in_states(100);
        assert_eq!(times[&Assigned], 10);
        assert_eq!(times[&Decoding], 15);
        assert_eq!(times[&Done], 0);
        assert!(job.transition(Queued, 70).is_err());
    }

    #[test]
    fn retries_until_attempts_run_out() {
        let mut job = job(2);
        job.assign(&NodeId::from_static("p1"), &NodeId::from_static("c1"), 1)
            .unwrap();
        job.transition(Prefilling, 2).unwrap();
        job.retry("producer p1 lost", Blame::Producer, 3).unwrap();
        assert_eq!(job.state, Queued);
        assert_eq!(job.failed_producers, vec![NodeId::from_static("p1")]);
        assert!(job.producer.is_none());
        job.assign(&NodeId::from_static("p2"), &NodeId::from_static("c1"), 4)
            .unwrap();
        assert_eq!(job.attempts, 2);
        job.retry("producer p2 lost", Blame::Producer, 5).unwrap();
        assert_eq!(job.state, Failed);
        assert!(job
            .error
            .as_deref()
            .unwrap_or("")
            .contains("gave up after 2 attempts"));
        assert!(job.retry("again", Blame::Producer, 6).is_err());
    }
}
