//! A decoding job's output between writes of its record.
//!
//! A consumer shows its tokens as they come, a few times a second. Rewriting the whole record
//! each time (request and prompt included) made etcd's history grow with the prompt times the
//! number of writes. Instead the consumer appends each batch of new tokens as its own small key
//! under `<root>/progress/<job-id>/`, beside a head key that says how long the output is now;
//! the record is left as it was. Every change of the record through
//! [`JobStore::update`](super::JobStore::update) first folds the batches into the record's
//! output and deletes them in the same transaction, and reads ([`JobStore::get`]) show the record
//! with its batches folded in. So a record's output is what was shown, whoever reads it.
//!
//! Both writers compare what they read: an append compares the record's revision (an attempt
//! handed back or cancelled since refuses the batch) and the head's; a fold compares the head's
//! too, so a batch appended after the fold read the batches makes the fold read again rather
//! than delete a batch it did not fold.

use serde::{Deserialize, Serialize};

use scd_types::{JobId, JobResult, JobState};

use super::{patiently, JobError, JobRecord, JobStore};
use crate::envelope;
use crate::keys::Keys;
use crate::store::{Compare, KeyValue, MetaStore, Txn, TxnOp};
use crate::translators::backoff;

/// After this many batches the consumer writes the record instead, folding them in: a fold
/// deletes every batch in one transaction, and etcd caps a transaction's operations
/// (`--max-txn-ops`, 128 by default). At four batches a second that is one record write every
/// eight seconds instead of 32.
pub const FOLD_AFTER_BATCHES: u32 = 32;

/// The head key: how long the output is with every batch of the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Head {
    /// The attempt the batches belong to.
    attempt: u32,
    /// The output's length in tokens, the record's and the batches' together.
    len: usize,
    /// How many batches there are.
    batches: u32,
}

/// One batch: the output's tokens from position `from` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Batch {
    attempt: u32,
    from: usize,
    tokens: Vec<u32>,
}

fn head_key(keys: &Keys, id: JobId) -> String {
    format!("{}head", keys.job_progress(id))
}

/// Zero-padded, so that the keys sort in output order.
fn batch_key(keys: &Keys, id: JobId, from: usize) -> String {
    format!("{}t{from:010}", keys.job_progress(id))
}

/// What [`JobStore::append_output`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// The new tokens were appended.
    Written,
    /// Nothing to write: no new tokens, or the record no longer runs this attempt.
    Nothing,
    /// The record itself should be written ([`JobStore::update`]): it is not `decoding` yet, or
    /// [`FOLD_AFTER_BATCHES`] batches wait to be folded.
    WriteTheRecord,
}

/// A job's appended output as read before a change of its record.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// The head key's revision (`None`: no batches).
    head: Option<i64>,
    /// The head key's name, present or not (empty: nothing was read).
    head_name: String,
    /// Every key under the job's progress prefix.
    keys: Vec<String>,
    batches: Vec<Batch>,
}

impl Pending {
    /// Reads the batches of job `id`.
    pub(super) async fn read(
        store: &dyn MetaStore,
        keys: &Keys,
        id: JobId,
    ) -> Result<Self, JobError> {
        let head_name = head_key(keys, id);
        let prefix = keys.job_progress(id);
        let listing = patiently(|| store.get_prefix(&prefix)).await?;
        let mut pending = Pending {
            head_name: head_name.clone(),
            ..Pending::default()
        };
        for kv in listing.kvs {
            if kv.key == head_name {
                pending.head = Some(kv.mod_revision);
            } else {
                match envelope::decode::<Batch>(&kv.key, &kv.value) {
                    Ok(batch) => pending.batches.push(batch),
                    // Deleted with the rest at the fold; its tokens are lost to the display
                    // only, the consumer's final write has them all.
                    Err(e) => tracing::warn!(error = %e, "skipping an unreadable output batch"),
                }
            }
            pending.keys.push(kv.key);
        }
        pending.batches.sort_by_key(|b| b.from);
        Ok(pending)
    }

    /// `job` with the batches of its current attempt appended to its output, where they join
    /// it (a batch past a gap, which no writer makes, ends the fold).
    pub(super) fn fold_into(&self, job: &mut JobRecord) {
        for batch in self.batches.iter().filter(|b| b.attempt == job.attempts) {
            let output = job.output.get_or_insert_with(|| JobResult {
                tokens: Vec::new(),
                stop: String::new(),
            });
            let have = output.tokens.len();
            if batch.from > have {
                break;
            }
            let skip = have - batch.from;
            if skip < batch.tokens.len() {
                output.tokens.extend_from_slice(&batch.tokens[skip..]);
            }
        }
    }

    /// The compare that fails if a batch was appended since the read (none when nothing was
    /// read: [`Pending::default`]).
    pub(super) fn unchanged(&self) -> Option<Compare> {
        match self.head {
            Some(revision) => Some(Compare::mod_revision(self.head_name.clone(), revision)),
            None if self.head_name.is_empty() => None,
            None => Some(Compare::absent(self.head_name.clone())),
        }
    }

    /// Deletes of every key read.
    pub(super) fn deletes(&self) -> impl Iterator<Item = TxnOp> + '_ {
        self.keys.iter().map(|k| TxnOp::delete(k.clone()))
    }
}

/// Whether a record in `state` can have batches: only a decoding one (an append needs it; the
/// change that moves it on folds them).
pub(super) fn may_have_batches(state: JobState) -> bool {
    state == JobState::Decoding
}

impl JobStore {
    /// Shows `tokens` as the output so far of the job's running attempt without rewriting its
    /// record: the tokens past those already shown go into a small key of their own (see the
    /// module doc). `holds` says whether a record still runs the caller's attempt; when it does
    /// not, nothing is written. The caller's `tokens` start with what the record already shows
    /// (the consumer of an attempt is the only writer of its output).
    pub async fn append_output(
        &self,
        id: JobId,
        tokens: &[u32],
        holds: impl Fn(&JobRecord) -> bool,
    ) -> Result<Appended, JobError> {
        let head_name = head_key(&self.keys, id);
        let record_key = self.keys.job(id);
        for round in 0..self.max_attempts {
            let Some(kv) = patiently(|| self.store.get(&record_key)).await? else {
                return Err(JobError::NotFound(id));
            };
            let job: JobRecord = envelope::decode(&kv.key, &kv.value)?;
            if !holds(&job) {
                return Ok(Appended::Nothing);
            }
            if job.state != JobState::Decoding {
                return Ok(Appended::WriteTheRecord);
            }
            let head = patiently(|| self.store.get(&head_name)).await?;
            let (shown, batches, unchanged) = match &head {
                Some(h) => {
                    let head: Head = envelope::decode(&h.key, &h.value)?;
                    if head.attempt != job.attempts {
                        return Ok(Appended::WriteTheRecord);
                    }
                    (
                        head.len,
                        head.batches,
                        Compare::mod_revision(head_name.clone(), h.mod_revision),
                    )
                }
                None => (
                    job.output.as_ref().map_or(0, |o| o.tokens.len()),
                    0,
                    Compare::absent(head_name.clone()),
                ),
            };
            if tokens.len() <= shown {
                return Ok(Appended::Nothing);
            }
            if batches >= FOLD_AFTER_BATCHES {
                return Ok(Appended::WriteTheRecord);
            }
            let batch = Batch {
                attempt: job.attempts,
                from: shown,
                tokens: tokens[shown..].to_vec(),
            };
            let head = Head {
                attempt: job.attempts,
                len: tokens.len(),
                batches: batches + 1,
            };
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(record_key.clone(), kv.mod_revision),
                    unchanged,
                ])
                .and_then([
                    TxnOp::put(batch_key(&self.keys, id, shown), envelope::encode(&batch)?),
                    TxnOp::put(head_name.clone(), envelope::encode(&head)?),
                ]);
            if patiently(|| self.store.txn(txn.clone())).await?.succeeded {
                return Ok(Appended::Written);
            }
            tokio::time::sleep(backoff(round)).await;
        }
        Err(JobError::Contention {
            id,
            attempts: self.max_attempts,
        })
    }

    /// How many keys job `id`'s appended output holds now (what a fold would delete).
    pub async fn output_batches(&self, id: JobId) -> Result<usize, JobError> {
        Ok(Pending::read(self.store.as_ref(), &self.keys, id)
            .await?
            .keys
            .len())
    }
}

/// A record read as a client sees it: with its batches folded in when it may have some.
pub(super) async fn with_batches(
    store: &dyn MetaStore,
    keys: &Keys,
    kv: &KeyValue,
) -> Result<JobRecord, JobError> {
    let mut job: JobRecord = envelope::decode(&kv.key, &kv.value)?;
    if may_have_batches(job.state) {
        Pending::read(store, keys, job.id)
            .await?
            .fold_into(&mut job);
    }
    Ok(job)
}
