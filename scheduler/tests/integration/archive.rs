//! Finished job records leave the live prefix: archived after a while, still
//! readable by id, removed from the archive by age and by count, and the scheduler's loop does
//! both on its own.

use std::time::Duration;

use crate::common::{eventually, Backend, TTL};
use scd_scheduler::jobs::now_ms;
use scd_scheduler::{
    envelope, ArchiveConfig, ElectionConfig, ExpertSpec, JobId, JobRecord, JobState, JobStore,
    Mode, NodeId, Retired, Scheduler, SchedulerConfig,
};

fn sotu_job(id: JobId) -> JobRecord {
    JobRecord::new(id, "sotu", Mode::Scd, 3)
}

/// Archives now: no wait after a job finishes.
fn at_once() -> ArchiveConfig {
    ArchiveConfig {
        after: Duration::ZERO,
        ..ArchiveConfig::default()
    }
}

async fn finished_records_move_to_the_archive_and_stay_readable(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let [done, failed, running] = [JobId::random(), JobId::random(), JobId::random()];
    for id in [done, failed, running] {
        jobs.create(&sotu_job(id)).await.unwrap();
    }
    jobs.update(done, |j| {
        j.assign(
            &NodeId::from_static("p"),
            &NodeId::from_static("c"),
            now_ms(),
        )?;
        for s in [
            JobState::Prefilling,
            JobState::Transferring,
            JobState::Decoding,
            JobState::Done,
        ] {
            j.transition(s, now_ms())?;
        }
        Ok(())
    })
    .await
    .unwrap();
    jobs.fail(failed, "no expert").await.unwrap();
    let day = Duration::from_secs(24 * 3600);

    // Within `after`, nothing moves.
    let wait = ArchiveConfig {
        after: Duration::from_secs(3600),
        ..ArchiveConfig::default()
    };
    for (job, revision) in jobs.list().await.unwrap() {
        let retired = jobs
            .retire(&job, revision, now_ms(), day, &wait, None)
            .await
            .unwrap();
        assert_eq!(retired, Retired::Kept);
    }
    // Past it, the finished ones move and the running one stays.
    let mut moved = 0;
    for (job, revision) in jobs.list().await.unwrap() {
        let retired = jobs
            .retire(&job, revision, now_ms(), day, &at_once(), None)
            .await
            .unwrap();
        moved += usize::from(retired == Retired::Archived);
    }
    assert_eq!(moved, 2);
    let live: Vec<JobId> = jobs
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|(j, _)| j.id)
        .collect();
    assert_eq!(live, [running]);
    let mut archived: Vec<JobId> = jobs
        .list_archived()
        .await
        .unwrap()
        .into_iter()
        .map(|(j, _)| j.id)
        .collect();
    archived.sort();
    let mut expected = vec![done, failed];
    expected.sort();
    assert_eq!(archived, expected);
    // Read by id, an archived job is whole.
    let record = jobs.get(done).await.unwrap().unwrap();
    assert_eq!(record.state, JobState::Done);
    assert_eq!(record.history.len(), 6);
    assert_eq!(
        jobs.get(failed).await.unwrap().unwrap().state,
        JobState::Failed
    );
    // `scd jobs list` reads the live records and the newest archived ones.
    assert_eq!(jobs.list_newest(10).await.unwrap().len(), 3);
    let newest = jobs.list_newest(2).await.unwrap();
    assert_eq!(newest.len(), 2);
    assert!(newest[0].created_at_ms >= newest[1].created_at_ms);
    // A record listed before a change does not move: the change wins.
    let (listed, revision) = jobs.list().await.unwrap().remove(0);
    jobs.cancel(running, "user").await.unwrap();
    let mut stale = listed.clone();
    stale.state = JobState::Cancelled;
    assert!(!jobs.archive(&stale, revision, None).await.unwrap());
    assert_eq!(jobs.list().await.unwrap().len(), 1);
}

/// Writes an archived record finished at `updated_at_ms`.
async fn archived(b: &Backend, updated_at_ms: u64) -> JobId {
    let id = JobId::random();
    let mut job = sotu_job(id);
    job.transition(JobState::Cancelled, updated_at_ms).unwrap();
    job.updated_at_ms = updated_at_ms;
    b.store
        .put(
            &b.keys.archived_job(id),
            envelope::encode(&job).unwrap(),
            None,
        )
        .await
        .unwrap();
    id
}

async fn the_archive_is_bounded_by_age_and_count(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let now = now_ms();
    let hour = Duration::from_secs(3600);
    // Ten records, one minute apart, the newest first.
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(archived(&b, now - i * 60_000).await);
    }
    // An unreadable record goes too.
    b.store
        .put(
            &b.keys.archived_job(JobId::random()),
            b"not json".to_vec(),
            None,
        )
        .await
        .unwrap();
    // By count: the four newest stay.
    assert_eq!(jobs.sweep_archive(now, hour, 4, None).await.unwrap(), 7);
    let mut left: Vec<JobId> = jobs
        .list_archived()
        .await
        .unwrap()
        .into_iter()
        .map(|(j, _)| j.id)
        .collect();
    left.sort();
    let mut newest = ids[..4].to_vec();
    newest.sort();
    assert_eq!(left, newest);
    // By age: past a minute and a half, the two older ones go.
    let age = Duration::from_secs(90);
    assert_eq!(jobs.sweep_archive(now, age, 4, None).await.unwrap(), 2);
    assert_eq!(jobs.list_archived().await.unwrap().len(), 2);
    // sweep_finished applies the age to the archive as well.
    assert_eq!(jobs.sweep_finished(now + 3_600_000, hour).await.unwrap(), 2);
    assert!(jobs.list_archived().await.unwrap().is_empty());
    assert!(jobs.get(ids[0]).await.unwrap().is_none());
}

async fn the_scheduler_archives_and_sweeps_on_its_own(b: Backend) {
    let config = SchedulerConfig {
        experts: vec![ExpertSpec::new("sotu", "base", 2)],
        reconcile_every: Duration::from_millis(200),
        election: ElectionConfig { ttl: TTL },
        archive: ArchiveConfig {
            after: Duration::ZERO,
            max_records: 1,
            sweep_every: Duration::from_millis(200),
        },
        ..SchedulerConfig::default()
    };
    let _scheduler = Scheduler::start(b.client().await, b.keys.clone(), "s1", config)
        .await
        .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let [first, second, waiting] = [JobId::random(), JobId::random(), JobId::random()];
    for id in [first, second, waiting] {
        jobs.create(&sotu_job(id)).await.unwrap();
    }
    jobs.cancel(first, "user").await.unwrap();
    eventually("the cancelled job is archived", || async {
        jobs.list_archived()
            .await
            .unwrap()
            .iter()
            .any(|(j, _)| j.id == first)
    })
    .await;
    // Its last update is a few ms older than the next one's: the archive keeps the newer.
    tokio::time::sleep(Duration::from_millis(5)).await;
    jobs.cancel(second, "user").await.unwrap();
    eventually("the archive holds only the newer record", || async {
        let archived = jobs.list_archived().await.unwrap();
        archived.len() == 1 && archived[0].0.id == second
    })
    .await;
    // The waiting job is never archived.
    let live = jobs.list().await.unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].0.id, waiting);
    assert!(jobs.get(first).await.unwrap().is_none());
    assert_eq!(
        jobs.get(second).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
}

on_both_stores!(
    finished_records_move_to_the_archive_and_stay_readable,
    the_archive_is_bounded_by_age_and_count,
    the_scheduler_archives_and_sweeps_on_its_own,
);
