//! Durable job records: a state machine as pure code ([`JobState`], [`JobRecord`]) and a
//! [`JobStore`] that applies every change as a compare-and-swap on the record's revision, so
//! concurrent writers (producer, consumer, leader) never overwrite each other's updates.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::codec::{self, CodecError};
use crate::keys::{InvalidId, Keys};
use crate::leader::LeaderGuard;
use crate::store::{Compare, MetaStore, StoreError, Txn, TxnOp};
use crate::translators::backoff;

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for a producer and a consumer.
    Queued,
    /// Producer and consumer chosen.
    Assigned,
    /// The producer runs the base model's prefill.
    Prefilling,
    /// Codes stream to the consumer.
    Transferring,
    /// The consumer decodes.
    Decoding,
    /// Finished with an answer.
    Done,
    /// Finished without one.
    Failed,
}

impl JobState {
    /// Every state, in pipeline order.
    pub const ALL: [JobState; 7] = [
        JobState::Queued,
        JobState::Assigned,
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
        JobState::Done,
        JobState::Failed,
    ];

    /// Whether a job may go from `self` to `next`: forward one step along the pipeline, back to
    /// `Queued` from any running state (a retry), or to `Failed` from any unfinished state.
    pub fn can_transition_to(self, next: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, next),
            (Queued, Assigned)
                | (Assigned, Prefilling)
                | (Prefilling, Transferring)
                | (Transferring, Decoding)
                | (Decoding, Done)
                | (Assigned | Prefilling | Transferring | Decoding, Queued)
                | (
                    Queued | Assigned | Prefilling | Transferring | Decoding,
                    Failed
                )
        )
    }

    /// Done or failed.
    pub fn is_finished(self) -> bool {
        matches!(self, JobState::Done | JobState::Failed)
    }

    /// A producer or consumer is working on it.
    pub fn is_running(self) -> bool {
        matches!(
            self,
            JobState::Assigned | JobState::Prefilling | JobState::Transferring | JobState::Decoding
        )
    }

    /// The name used in records and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Prefilling => "prefilling",
            JobState::Transferring => "transferring",
            JobState::Decoding => "decoding",
            JobState::Done => "done",
            JobState::Failed => "failed",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One state change in a job's life.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateEntry {
    /// The state entered.
    pub state: JobState,
    /// When (milliseconds since the Unix epoch).
    pub at_ms: u64,
    /// The producer at that moment.
    #[serde(default)]
    pub producer: Option<String>,
}

/// A job's durable record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Job id.
    pub id: String,
    /// Expert model that answers.
    pub expert: String,
    /// Transfer mode (oracle, raw, q4, droidspeak, reuse-only, scd).
    pub mode: String,
    /// Current state.
    pub state: JobState,
    /// Producer node, once assigned.
    #[serde(default)]
    pub producer: Option<String>,
    /// Consumer node, once assigned.
    #[serde(default)]
    pub consumer: Option<String>,
    /// Assignments so far (the first is attempt 1).
    pub attempts: u32,
    /// Assignments allowed before the job fails.
    pub max_attempts: u32,
    /// Producers that lost this job; a retry avoids them while others exist.
    #[serde(default)]
    pub failed_producers: Vec<String>,
    /// The prompt's chained block hashes, for prefix affinity.
    #[serde(default)]
    pub prefix_hashes: Vec<String>,
    /// Every state entered, with its time.
    #[serde(default)]
    pub history: Vec<StateEntry>,
    /// Stage timings in milliseconds (prefill, encode, transfer, rebuild, first_token, total).
    #[serde(default)]
    pub timings_ms: BTreeMap<String, f64>,
    /// Bytes of codes sent.
    #[serde(default)]
    pub payload_bytes: u64,
    /// Why it failed, or why the last attempt was abandoned.
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
    /// The job id is not a valid key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// The store failed.
    #[error("job store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The state machine does not allow this change.
    #[error("job {id}: cannot go from {from} to {to}")]
    InvalidTransition {
        /// Job id.
        id: String,
        /// Current state.
        from: JobState,
        /// Requested state.
        to: JobState,
    },
    /// No such job.
    #[error("job {0} not found")]
    NotFound(String),
    /// A job with this id exists already.
    #[error("job {0} already exists")]
    AlreadyExists(String),
    /// Too many concurrent writers; the compare-and-swap kept losing.
    #[error("job {id}: gave up after {attempts} conflicting updates")]
    Contention {
        /// Job id.
        id: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A leader-only write found that this replica no longer leads.
    #[error("not the leader any more; write to job {0} dropped")]
    NotLeader(String),
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl JobRecord {
    /// A new queued job.
    pub fn new(
        id: impl Into<String>,
        expert: impl Into<String>,
        mode: impl Into<String>,
        max_attempts: u32,
    ) -> Self {
        let now = now_ms();
        Self {
            id: id.into(),
            expert: expert.into(),
            mode: mode.into(),
            state: JobState::Queued,
            producer: None,
            consumer: None,
            attempts: 0,
            max_attempts: max_attempts.max(1),
            failed_producers: Vec::new(),
            prefix_hashes: Vec::new(),
            history: vec![StateEntry {
                state: JobState::Queued,
                at_ms: now,
                producer: None,
            }],
            timings_ms: BTreeMap::new(),
            payload_bytes: 0,
            error: None,
            created_at_ms: now,
            updated_at_ms: now,
        }
    }

    /// Moves to `next` if the state machine allows it.
    pub fn transition(&mut self, next: JobState, at_ms: u64) -> Result<(), JobError> {
        if !self.state.can_transition_to(next) {
            return Err(JobError::InvalidTransition {
                id: self.id.clone(),
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
    pub fn assign(&mut self, producer: &str, consumer: &str, at_ms: u64) -> Result<(), JobError> {
        if self.state != JobState::Queued {
            return Err(JobError::InvalidTransition {
                id: self.id.clone(),
                from: self.state,
                to: JobState::Assigned,
            });
        }
        self.producer = Some(producer.to_string());
        self.consumer = Some(consumer.to_string());
        self.attempts += 1;
        self.transition(JobState::Assigned, at_ms)
    }

    /// Abandons the current attempt (its producer or consumer was lost): back to queued, or
    /// failed when no attempts are left. With `producer_failed`, the producer is remembered so
    /// the next attempt avoids it while others are available.
    pub fn retry(
        &mut self,
        reason: &str,
        producer_failed: bool,
        at_ms: u64,
    ) -> Result<(), JobError> {
        if !self.state.is_running() {
            return Err(JobError::InvalidTransition {
                id: self.id.clone(),
                from: self.state,
                to: JobState::Queued,
            });
        }
        if let Some(p) = self.producer.take() {
            if producer_failed && !self.failed_producers.contains(&p) {
                self.failed_producers.push(p);
            }
        }
        self.consumer = None;
        self.error = Some(reason.to_string());
        if self.attempts >= self.max_attempts {
            let reason = format!("{reason}; gave up after {} attempts", self.attempts);
            return self.fail(&reason, at_ms);
        }
        self.transition(JobState::Queued, at_ms)
    }

    /// Fails the job.
    pub fn fail(&mut self, reason: &str, at_ms: u64) -> Result<(), JobError> {
        self.error = Some(reason.to_string());
        self.transition(JobState::Failed, at_ms)
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
        let key = self.keys.job(&job.id)?;
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([TxnOp::put(key, codec::encode(job)?)]);
        if self.store.txn(txn).await?.succeeded {
            Ok(())
        } else {
            Err(JobError::AlreadyExists(job.id.clone()))
        }
    }

    /// Reads a job.
    pub async fn get(&self, id: &str) -> Result<Option<JobRecord>, JobError> {
        let key = self.keys.job(id)?;
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(codec::decode(&kv.key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Every job with its modification revision (unreadable records are skipped and logged).
    pub async fn list(&self) -> Result<Vec<(JobRecord, i64)>, JobError> {
        let prefix = self.keys.jobs_prefix();
        let listing = self.store.get_prefix(&prefix).await?;
        let mut jobs = Vec::with_capacity(listing.kvs.len());
        for kv in listing.kvs {
            match codec::decode::<JobRecord>(&kv.key, &kv.value) {
                Ok(job) => jobs.push((job, kv.mod_revision)),
                Err(e) => tracing::warn!(error = %e, "skipping unreadable job record"),
            }
        }
        Ok(jobs)
    }

    /// Applies `change` by compare-and-swap, retrying on conflicts with capped backoff. `change`
    /// may run several times, each time on the freshest record; an error from it aborts, and a
    /// change that leaves the record as it was writes nothing.
    pub async fn update(
        &self,
        id: &str,
        change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        self.update_inner(id, None, change).await
    }

    /// Like [`JobStore::update`], but only while `guard`'s leadership holds.
    pub async fn update_as_leader(
        &self,
        id: &str,
        guard: &LeaderGuard,
        change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        self.update_inner(id, Some(guard), change).await
    }

    /// Moves a job to `next` (checked by the state machine), recording the time.
    pub async fn transition(&self, id: &str, next: JobState) -> Result<JobRecord, JobError> {
        self.update(id, |job| job.transition(next, now_ms())).await
    }

    async fn update_inner(
        &self,
        id: &str,
        guard: Option<&LeaderGuard>,
        mut change: impl FnMut(&mut JobRecord) -> Result<(), JobError>,
    ) -> Result<JobRecord, JobError> {
        let key = self.keys.job(id)?;
        for attempt in 0..self.max_attempts {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(JobError::NotFound(id.to_string()));
            };
            let before: JobRecord = codec::decode(&kv.key, &kv.value)?;
            let mut job = before.clone();
            change(&mut job)?;
            if job == before {
                // Nothing to write: a write would only wake every watcher of the job for nothing.
                return Ok(job);
            }
            job.updated_at_ms = job.updated_at_ms.max(now_ms());
            let mut compares = vec![Compare::mod_revision(key.clone(), kv.mod_revision)];
            compares.extend(guard.map(LeaderGuard::compare));
            let txn = Txn::new()
                .when(compares)
                .and_then([TxnOp::put(key.clone(), codec::encode(&job)?)]);
            if self.store.txn(txn).await?.succeeded {
                return Ok(job);
            }
            if let Some(guard) = guard {
                if !self.still_leader(guard).await? {
                    return Err(JobError::NotLeader(id.to_string()));
                }
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(JobError::Contention {
            id: id.to_string(),
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

    /// Removes finished jobs last updated more than `retention` before `now_ms`; returns how
    /// many went. A record updated meanwhile is left for the next sweep.
    pub async fn sweep_finished(
        &self,
        now_ms: u64,
        retention: Duration,
    ) -> Result<usize, JobError> {
        let retention_ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
        let mut removed = 0;
        for (job, revision) in self.list().await? {
            if job.state.is_finished() && job.updated_at_ms.saturating_add(retention_ms) <= now_ms {
                let key = self.keys.job(&job.id)?;
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.clone(), revision)])
                    .and_then([TxnOp::delete(key)]);
                if self.store.txn(txn).await?.succeeded {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    #[test]
    fn transitions_exhaustively() {
        let allowed = [
            (Queued, Assigned),
            (Queued, Failed),
            (Assigned, Prefilling),
            (Assigned, Queued),
            (Assigned, Failed),
            (Prefilling, Transferring),
            (Prefilling, Queued),
            (Prefilling, Failed),
            (Transferring, Decoding),
            (Transferring, Queued),
            (Transferring, Failed),
            (Decoding, Done),
            (Decoding, Queued),
            (Decoding, Failed),
        ];
        for from in JobState::ALL {
            for to in JobState::ALL {
                assert_eq!(
                    from.can_transition_to(to),
                    allowed.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
        for s in JobState::ALL {
            assert_eq!(s.is_finished(), matches!(s, Done | Failed));
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
    }

    #[test]
    fn a_job_runs_through_the_pipeline() {
        let mut job = JobRecord::new("j", "sotu", "scd", 3);
        assert!(matches!(
            job.transition(Prefilling, 1),
            Err(JobError::InvalidTransition { .. })
        ));
        job.assign("p1", "c1", 10).unwrap();
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
        let mut job = JobRecord::new("j", "sotu", "scd", 2);
        job.assign("p1", "c1", 1).unwrap();
        job.transition(Prefilling, 2).unwrap();
        job.retry("producer p1 lost", true, 3).unwrap();
        assert_eq!(job.state, Queued);
        assert_eq!(job.failed_producers, vec!["p1".to_string()]);
        assert!(job.producer.is_none());
        job.assign("p2", "c1", 4).unwrap();
        assert_eq!(job.attempts, 2);
        job.retry("producer p2 lost", true, 5).unwrap();
        assert_eq!(job.state, Failed);
        assert!(job
            .error
            .as_deref()
            .unwrap_or("")
            .contains("gave up after 2 attempts"));
        assert!(job.retry("again", true, 6).is_err());
    }
}
