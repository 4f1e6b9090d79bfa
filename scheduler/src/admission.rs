//! Cluster-wide admission: a bound on the jobs the cluster holds unfinished, so that overload
//! is answered "busy, retry after" at submission instead of growing the store without end.
//!
//! One record, `<root>/admission`, counts the unfinished jobs. A submission raises the count in
//! the same transaction that creates its job record, conditioned on the count it read, so two
//! submitters racing for the last slot cannot both win and the bound is exact. Nobody lowers
//! the count as jobs finish (that would put every finishing write in contention on one key);
//! instead the scheduler leader recounts from the job records on each pass and writes the true
//! count, unless a submission moved the record since it read it (then the next pass does).
//! The count is therefore never below the truth, and at most one pass above it. The leader also
//! writes the limit from its config and a retry hint from the recent finishing rate, so that
//! every submitter, whatever node it runs on, applies the same bound.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::envelope;
use crate::jobs::{now_ms, JobError, JobRecord};
use crate::keys::Keys;
use crate::leader::LeaderGuard;
use crate::store::{Compare, MetaStore, Txn, TxnOp};

/// The bound used until a scheduler leader has written one.
pub const DEFAULT_LIMIT: u64 = 256;

/// The retry hint used until the leader has measured a finishing rate.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(5);

/// How far back the leader looks for finished jobs when it estimates the retry hint.
const RATE_WINDOW_MS: u64 = 60_000;

/// What `<root>/admission` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionRecord {
    /// Jobs created and not yet finished (never below the truth; see the module docs).
    pub unfinished: u64,
    /// The bound on `unfinished`.
    pub limit: u64,
    /// When a refused submitter should try again, in milliseconds.
    pub retry_after_ms: u64,
}

impl Default for AdmissionRecord {
    fn default() -> Self {
        Self {
            unfinished: 0,
            limit: DEFAULT_LIMIT,
            retry_after_ms: DEFAULT_RETRY_AFTER.as_millis() as u64,
        }
    }
}

/// A submission refused because the cluster holds its limit of unfinished jobs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the cluster is busy: {unfinished} jobs unfinished, limit {limit}; retry after {}s",
    self.retry_after_secs()
)]
pub struct Busy {
    /// Unfinished jobs counted.
    pub unfinished: u64,
    /// The cluster's bound.
    pub limit: u64,
    /// When to try again.
    pub retry_after: Duration,
}

impl Busy {
    /// The retry hint in whole seconds, at least one (what `Retry-After` carries).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs().max(1)
    }
}

/// Reads the admission record and its modification revision (0 when it does not exist yet).
async fn read(store: &dyn MetaStore, key: &str) -> Result<(AdmissionRecord, i64), JobError> {
    Ok(match store.get(key).await? {
        Some(kv) => (envelope::decode(&kv.key, &kv.value)?, kv.mod_revision),
        None => (AdmissionRecord::default(), 0),
    })
}

/// Creates `job` if the cluster has room for it, raising the unfinished count in the same
/// transaction. Fails with [`JobError::Busy`] at the limit (writing nothing) and
/// [`JobError::AlreadyExists`] when the id is taken.
pub async fn create_admitted(
    store: &dyn MetaStore,
    keys: &Keys,
    job: &JobRecord,
    max_attempts: u32,
) -> Result<(), JobError> {
    let job_key = keys.job(job.id);
    let key = keys.admission();
    let value = envelope::encode(job)?;
    for attempt in 0..max_attempts {
        let (mut record, revision) = read(store, &key).await?;
        if record.unfinished >= record.limit {
            return Err(JobError::Busy(Busy {
                unfinished: record.unfinished,
                limit: record.limit,
                retry_after: Duration::from_millis(record.retry_after_ms),
            }));
        }
        record.unfinished += 1;
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key.clone(), revision),
                Compare::absent(job_key.clone()),
            ])
            .and_then([
                TxnOp::put(key.clone(), envelope::encode(&record)?),
                TxnOp::put(job_key.clone(), value.clone()),
            ]);
        if store.txn(txn).await?.succeeded {
            return Ok(());
        }
        if store.get(&job_key).await?.is_some() {
            return Err(JobError::AlreadyExists(job.id));
        }
        tokio::time::sleep(crate::translators::backoff(attempt)).await;
    }
    Err(JobError::Contention {
        id: job.id,
        attempts: max_attempts,
    })
}

/// The leader's half: from the record as read before the job listing and the listing, writes
/// the true count, the configured limit and the retry hint, unless the record moved since it
/// was read (a submission landed: the next pass recounts).
pub async fn recount<'a>(
    store: &dyn MetaStore,
    keys: &Keys,
    guard: &LeaderGuard,
    before: (AdmissionRecord, i64),
    jobs: impl Iterator<Item = &'a JobRecord>,
    limit: u64,
) -> Result<(), JobError> {
    let (old, revision) = before;
    let now = now_ms();
    let (mut unfinished, mut recent) = (0u64, 0u64);
    for j in jobs {
        if !j.state.is_finished() {
            unfinished += 1;
        } else if j.updated_at_ms + RATE_WINDOW_MS > now {
            recent += 1;
        }
    }
    // One slot frees up every window / recent on average; wait about that, within bounds a
    // client can act on.
    let retry_after_ms = RATE_WINDOW_MS
        .checked_div(recent)
        .map_or(DEFAULT_RETRY_AFTER.as_millis() as u64, |ms| {
            ms.clamp(1_000, 60_000)
        });
    let new = AdmissionRecord {
        unfinished,
        limit,
        retry_after_ms,
    };
    if new == old && revision != 0 {
        return Ok(());
    }
    let key = keys.admission();
    let txn = Txn::new()
        .when([
            Compare::mod_revision(key.clone(), revision),
            guard.compare(),
        ])
        .and_then([TxnOp::put(key, envelope::encode(&new)?)]);
    // A failed compare is a submission that landed meanwhile (or lost leadership): nothing to
    // do until the next pass.
    store.txn(txn).await?;
    Ok(())
}

/// The admission record now (the defaults before anyone wrote it): what `scd` shows and tests
/// check.
pub async fn current(store: &dyn MetaStore, keys: &Keys) -> Result<AdmissionRecord, JobError> {
    Ok(read(store, &keys.admission()).await?.0)
}

/// Reads the record as the leader does before listing jobs (see [`recount`]).
pub async fn read_before_listing(
    store: &dyn MetaStore,
    keys: &Keys,
) -> Result<(AdmissionRecord, i64), JobError> {
    read(store, &keys.admission()).await
}
