//! A decoding job's output appended beside its record: the record is not
//! rewritten for each batch of tokens, reads show the batches, the next change of the record
//! folds them in, and a fold racing appends loses no token. On both stores, and on the
//! embedded store behind a wrapper that lands a batch between a fold's read and its write.

use std::sync::{Arc, Mutex};

use crate::common::{within, Backend};
use scd_scheduler::jobs::{now_ms, Blame, FOLD_AFTER_BATCHES};
use scd_scheduler::store::HookedStore;
use scd_scheduler::{Appended, JobId, JobRecord, JobResult, JobState, JobStore, Mode};
use scd_scheduler::{EmbeddedStore, Keys, MetaStore, NodeId};

/// A job in `decoding`, attempt 1, showing `shown`.
async fn decoding(jobs: &JobStore, shown: &[u32]) -> JobId {
    let id = JobId::random();
    jobs.create(&JobRecord::new(id, "sotu", Mode::Scd, 3))
        .await
        .unwrap();
    jobs.update(id, |j| {
        j.assign(
            &NodeId::from_static("prefill-0"),
            &NodeId::from_static("sotu-0"),
            now_ms(),
        )?;
        for next in [
            JobState::Prefilling,
            JobState::Transferring,
            JobState::Decoding,
        ] {
            j.transition(next, now_ms())?;
        }
        j.output = Some(JobResult {
            tokens: shown.to_vec(),
            stop: String::new(),
        });
        Ok(())
    })
    .await
    .unwrap();
    id
}

/// Whether a record still runs attempt 1 (what the consumer's attempt checks).
fn first_attempt(j: &JobRecord) -> bool {
    j.state.is_running() && j.attempts == 1
}

fn tokens(job: &JobRecord) -> Vec<u32> {
    job.output
        .as_ref()
        .map(|o| o.tokens.clone())
        .unwrap_or_default()
}

async fn appended_output_leaves_the_record_alone_and_shows_in_reads(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let id = decoding(&jobs, &[1, 2]).await;
    let key = b.keys.job(id);
    let record = b.store.get(&key).await.unwrap().unwrap();

    let wrote = jobs.append_output(id, &[1, 2, 3, 4], first_attempt);
    assert_eq!(wrote.await.unwrap(), Appended::Written);
    let wrote = jobs.append_output(id, &[1, 2, 3, 4, 5, 6], first_attempt);
    assert_eq!(wrote.await.unwrap(), Appended::Written);
    let unchanged = b.store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        unchanged.mod_revision, record.mod_revision,
        "the record is not rewritten"
    );
    assert_eq!(
        tokens(&jobs.get(id).await.unwrap().unwrap()),
        [1, 2, 3, 4, 5, 6]
    );
    // The head and two batches; no new tokens writes nothing.
    assert_eq!(jobs.output_batches(id).await.unwrap(), 3);
    let again = jobs.append_output(id, &[1, 2, 3, 4, 5, 6], first_attempt);
    assert_eq!(again.await.unwrap(), Appended::Nothing);

    // The next change of the record folds the batches in and removes them.
    jobs.update(id, |j| {
        j.timings_ms.insert("seen".into(), 1.0);
        Ok(())
    })
    .await
    .unwrap();
    let raw = b.store.get(&key).await.unwrap().unwrap();
    let raw: JobRecord = scd_scheduler::envelope::decode(&raw.key, &raw.value).unwrap();
    assert_eq!(tokens(&raw), [1, 2, 3, 4, 5, 6]);
    assert_eq!(jobs.output_batches(id).await.unwrap(), 0);

    // A hand-back keeps what was shown; the old attempt appends nothing more.
    let back = jobs.update(id, |j| j.retry("consumer lost", Blame::Consumer, now_ms()));
    assert_eq!(back.await.unwrap().state, JobState::Queued);
    let late = jobs.append_output(id, &[1, 2, 3, 4, 5, 6, 7], first_attempt);
    assert_eq!(late.await.unwrap(), Appended::Nothing);
    assert_eq!(
        tokens(&jobs.get(id).await.unwrap().unwrap()),
        [1, 2, 3, 4, 5, 6]
    );
    assert_eq!(jobs.output_batches(id).await.unwrap(), 0);
}

async fn the_record_is_written_where_a_batch_cannot_be(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    // Not decoding yet: the record moves on with its first tokens.
    let id = JobId::random();
    jobs.create(&JobRecord::new(id, "sotu", Mode::Scd, 3))
        .await
        .unwrap();
    jobs.update(id, |j| {
        j.assign(
            &NodeId::from_static("prefill-0"),
            &NodeId::from_static("sotu-0"),
            now_ms(),
        )
    })
    .await
    .unwrap();
    let early = jobs.append_output(id, &[1], first_attempt);
    assert_eq!(early.await.unwrap(), Appended::WriteTheRecord);

    // Past the batch bound: the record takes them (a fold deletes each in one transaction).
    let id = decoding(&jobs, &[]).await;
    let mut shown = Vec::new();
    for t in 0..FOLD_AFTER_BATCHES {
        shown.push(t);
        let wrote = jobs.append_output(id, &shown, first_attempt);
        assert_eq!(wrote.await.unwrap(), Appended::Written);
    }
    shown.push(FOLD_AFTER_BATCHES);
    let full = jobs.append_output(id, &shown, first_attempt);
    assert_eq!(full.await.unwrap(), Appended::WriteTheRecord);
    assert_eq!(
        tokens(&jobs.get(id).await.unwrap().unwrap()),
        shown[..shown.len() - 1]
    );
}

async fn a_fold_racing_appends_loses_no_token(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let id = decoding(&jobs, &[]).await;
    const TOKENS: u32 = 120;
    // The consumer: one token at a time, the record written where a batch cannot go.
    let consumer = {
        let jobs = JobStore::new(b.client().await, b.keys.clone());
        tokio::spawn(async move {
            let mut shown = Vec::new();
            for t in 0..TOKENS {
                shown.push(t);
                match jobs.append_output(id, &shown, first_attempt).await.unwrap() {
                    Appended::Written => {}
                    Appended::WriteTheRecord => {
                        jobs.update(id, |j| {
                            j.output = Some(JobResult {
                                tokens: shown.clone(),
                                stop: String::new(),
                            });
                            Ok(())
                        })
                        .await
                        .unwrap();
                    }
                    Appended::Nothing => panic!("the attempt still runs"),
                }
            }
        })
    };
    // Another writer changing the record meanwhile (a scheduler's deadline, a report): each
    // of its writes folds whatever was appended.
    let other = {
        let jobs = JobStore::new(b.client().await, b.keys.clone());
        tokio::spawn(async move {
            for i in 0..60 {
                jobs.update(id, |j| {
                    j.timings_ms.insert("other".into(), f64::from(i));
                    Ok(())
                })
                .await
                .unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    within("appends", consumer).await.unwrap();
    within("updates", other).await.unwrap();
    let expected: Vec<u32> = (0..TOKENS).collect();
    assert_eq!(tokens(&jobs.get(id).await.unwrap().unwrap()), expected);
    let done = jobs.update(id, |j| j.transition(JobState::Done, now_ms()));
    assert_eq!(tokens(&done.await.unwrap()), expected);
    assert_eq!(jobs.output_batches(id).await.unwrap(), 0);
}

/// A hand-back whose read of the batches is overtaken by one more: the compare on the head
/// makes it read again, so the retried record shows that batch too and no key is left behind.
#[tokio::test]
async fn a_batch_landing_during_a_fold_is_folded_not_orphaned() {
    let keys = Keys::new("/t");
    let inner: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let plain = JobStore::new(inner.clone(), keys.clone());
    let id = decoding(&plain, &[1]).await;
    let wrote = plain.append_output(id, &[1, 2], first_attempt);
    assert_eq!(wrote.await.unwrap(), Appended::Written);

    // Once armed, the next transaction is preceded by another writer's batch: one landing
    // between a fold's read and its write, every time.
    let armed: Arc<Mutex<Option<Vec<u32>>>> = Arc::new(Mutex::new(Some(vec![1, 2, 3])));
    let racing = HookedStore::new(inner.clone()).before_txn({
        let (armed, other) = (armed.clone(), plain.clone());
        move || {
            let (tokens, other) = (armed.lock().unwrap().take(), other.clone());
            async move {
                if let Some(tokens) = tokens {
                    let wrote = other.append_output(id, &tokens, first_attempt).await;
                    assert_eq!(wrote.unwrap(), Appended::Written);
                }
                Ok(())
            }
        }
    });
    let scheduler = JobStore::new(Arc::new(racing), keys.clone());
    let back = scheduler
        .update(id, |j| j.retry("consumer lost", Blame::Consumer, now_ms()))
        .await
        .unwrap();
    assert!(armed.lock().unwrap().is_none(), "the batch landed");
    assert_eq!(back.state, JobState::Queued);
    assert_eq!(
        tokens(&back),
        [1, 2, 3],
        "the retried record shows every batch"
    );
    assert_eq!(
        plain.output_batches(id).await.unwrap(),
        0,
        "no batch left behind"
    );
}

on_both_stores!(
    appended_output_leaves_the_record_alone_and_shows_in_reads,
    the_record_is_written_where_a_batch_cannot_be,
    a_fold_racing_appends_loses_no_token,
);
