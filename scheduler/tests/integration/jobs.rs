//! Durable jobs: compare-and-swap updates under contention, the state machine through the
//! store, retention, and the leader retrying a job whose producer vanished.

use std::time::Duration;

use crate::common::{eventually, within, Backend, TTL};
use scd_scheduler::admission;
use scd_scheduler::jobs::now_ms;
use scd_scheduler::jobs::Blame;
use scd_scheduler::service::{read_pools, reconcile};
use scd_scheduler::{
    Candidate, ElectionConfig, ExpertSpec, JobError, JobId, JobRecord, JobState, JobStore, Mode,
    ModelRecord, ModelRegistry, NodeId, NodeInfo, NodeMap, Registration, RegistrationConfig,
    Scheduler, SchedulerConfig,
};

/// Waits (bounded) until the job is in `state`.
async fn reaches(jobs: &JobStore, id: JobId, state: JobState) {
    eventually(state.as_str(), || async {
        jobs.get(id).await.unwrap().unwrap().state == state
    })
    .await;
}

/// A queued job for the expert `sotu`.
fn sotu_job(id: JobId, max_attempts: u32) -> JobRecord {
    JobRecord::new(id, "sotu", Mode::Scd, max_attempts)
}

async fn concurrent_updates_lose_nothing(b: Backend) {
    let j1 = JobId::random();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(j1, 3)).await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..8 {
        let jobs = JobStore::new(b.client().await, b.keys.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..6 {
                jobs.update(j1, |j| {
                    j.timings_ms
                        .insert(format!("t{t}-{i}"), f64::from(t * 10 + i));
                    j.payload_bytes += 1;
                    Ok(())
                })
                .await
                .unwrap();
            }
        }));
    }
    for t in tasks {
        within("updates", t).await.unwrap();
    }
    let job = jobs.get(j1).await.unwrap().unwrap();
    assert_eq!(job.timings_ms.len(), 48);
    assert_eq!(job.payload_bytes, 48);
    for t in 0..8 {
        for i in 0..6 {
            assert_eq!(job.timings_ms[&format!("t{t}-{i}")], f64::from(t * 10 + i));
        }
    }
}

async fn the_state_machine_guards_the_record(b: Backend) {
    let j2 = JobId::random();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let job = sotu_job(j2, 3);
    jobs.create(&job).await.unwrap();
    assert!(matches!(
        jobs.create(&job).await,
        Err(JobError::AlreadyExists(_))
    ));
    let err = jobs.transition(j2, JobState::Decoding).await.unwrap_err();
    assert!(matches!(
        err,
        JobError::InvalidTransition {
            from: JobState::Queued,
            to: JobState::Decoding,
            ..
        }
    ));
    // A refused change is not written.
    assert_eq!(jobs.get(j2).await.unwrap().unwrap(), job);
    jobs.update(j2, |j| {
        j.assign(
            &NodeId::from_static("p1"),
            &NodeId::from_static("c1"),
            now_ms(),
        )
    })
    .await
    .unwrap();
    for s in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
        JobState::Done,
    ] {
        assert_eq!(jobs.transition(j2, s).await.unwrap().state, s);
    }
    let done = jobs.get(j2).await.unwrap().unwrap();
    let states: Vec<JobState> = done.history.iter().map(|h| h.state).collect();
    assert_eq!(
        states,
        [
            JobState::Queued,
            JobState::Assigned,
            JobState::Prefilling,
            JobState::Transferring,
            JobState::Decoding,
            JobState::Done
        ]
    );
    assert!(matches!(
        jobs.transition(JobId::random(), JobState::Done).await,
        Err(JobError::NotFound(_))
    ));
}

async fn finished_records_are_kept_for_the_retention_only(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let [done, failed, running] = [JobId::random(), JobId::random(), JobId::random()];
    for id in [done, failed, running] {
        jobs.create(&sotu_job(id, 3)).await.unwrap();
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
    let retention = Duration::from_secs(3600);
    // Within the retention nothing goes.
    assert_eq!(jobs.sweep_finished(now_ms(), retention).await.unwrap(), 0);
    // Past it, the finished ones go and the running one stays.
    let later = now_ms() + 3600 * 1000 + 1;
    assert_eq!(jobs.sweep_finished(later, retention).await.unwrap(), 2);
    let left: Vec<JobId> = jobs
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|(j, _)| j.id)
        .collect();
    assert_eq!(left, [running]);
}

async fn cancel_is_a_compare_and_swap(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let id = JobId::random();
    jobs.create(&sotu_job(id, 3)).await.unwrap();
    // Writers record timings while another client cancels: the cancel lands and no write is lost.
    let mut tasks = Vec::new();
    for t in 0..4u32 {
        let jobs = JobStore::new(b.client().await, b.keys.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..6u32 {
                jobs.update(id, |j| {
                    j.timings_ms.insert(format!("t{t}-{i}"), 1.0);
                    Ok(())
                })
                .await
                .unwrap();
            }
        }));
    }
    let canceller = JobStore::new(b.client().await, b.keys.clone());
    let cancelled = within("the cancel", canceller.cancel(id, "user asked"))
        .await
        .unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    for t in tasks {
        within("updates", t).await.unwrap();
    }
    let job = jobs.get(id).await.unwrap().unwrap();
    assert_eq!(
        (job.state, job.error.as_deref(), job.timings_ms.len()),
        (JobState::Cancelled, Some("user asked"), 24)
    );
    let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
    assert_eq!(states, [JobState::Queued, JobState::Cancelled]);

    // Cancelling again answers with the record and writes nothing.
    let key = b.keys.job(id);
    let revision = b.store.get(&key).await.unwrap().unwrap().mod_revision;
    assert_eq!(jobs.cancel(id, "again").await.unwrap(), job);
    assert_eq!(
        b.store.get(&key).await.unwrap().unwrap().mod_revision,
        revision
    );
    // A finished job cannot be cancelled, and a refused cancel is not written.
    let failed = JobId::random();
    jobs.create(&sotu_job(failed, 3)).await.unwrap();
    let failed_record = jobs.fail(failed, "no expert").await.unwrap();
    assert!(matches!(
        jobs.cancel(failed, "too late").await,
        Err(JobError::InvalidTransition {
            from: JobState::Failed,
            to: JobState::Cancelled,
            ..
        })
    ));
    assert_eq!(jobs.get(failed).await.unwrap().unwrap(), failed_record);
    assert!(matches!(
        jobs.cancel(JobId::random(), "no such job").await,
        Err(JobError::NotFound(_))
    ));
}

async fn cancel_and_fail_racing_have_one_winner(b: Backend) {
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let user = JobStore::new(b.client().await, b.keys.clone());
    let producer = JobStore::new(b.client().await, b.keys.clone());
    for _ in 0..8 {
        let id = JobId::random();
        jobs.create(&sotu_job(id, 3)).await.unwrap();
        let (cancel, fail) = within("the race", async {
            tokio::join!(
                user.cancel(id, "user asked"),
                producer.fail(id, "producer error")
            )
        })
        .await;
        let winner = match (cancel, fail) {
            (
                Ok(won),
                Err(JobError::InvalidTransition {
                    from: JobState::Cancelled,
                    to: JobState::Failed,
                    ..
                }),
            )
            | (
                Err(JobError::InvalidTransition {
                    from: JobState::Failed,
                    to: JobState::Cancelled,
                    ..
                }),
                Ok(won),
            ) => won,
            other => panic!("expected exactly one winner, got {other:?}"),
        };
        let stored = jobs.get(id).await.unwrap().unwrap();
        assert_eq!(stored, winner);
        let finished = stored.history.iter().filter(|h| h.state.is_finished());
        assert_eq!(finished.count(), 1);
    }
}

async fn a_cancelled_job_is_never_assigned_or_retried(b: Backend) {
    let p1 = register(&b, producer("p1")).await;
    let _c = register(&b, consumer("c1")).await;
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let (cancelled, queued) = (JobId::random(), JobId::random());
    jobs.create(&sotu_job(cancelled, 3)).await.unwrap();
    jobs.cancel(cancelled, "user asked").await.unwrap();
    jobs.create(&sotu_job(queued, 3)).await.unwrap();
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    // Both were written before the scheduler started, so the pass that assigns one reads both.
    reaches(&jobs, queued, JobState::Assigned).await;
    let job = jobs.get(cancelled).await.unwrap().unwrap();
    assert_eq!(
        (job.state, job.attempts, job.producer),
        (JobState::Cancelled, 0, None)
    );

    // An assigned job cancelled, then its producer leaves: it is not sent back to the queue.
    jobs.cancel(queued, "user changed their mind")
        .await
        .unwrap();
    p1.deregister().await.unwrap();
    let _p2 = register(&b, producer("p2")).await;
    let probe = JobId::random();
    jobs.create(&sotu_job(probe, 3)).await.unwrap();
    // A pass that assigns the probe to p2 saw p1 gone.
    eventually("the probe is assigned to p2", || async {
        jobs.get(probe).await.unwrap().unwrap().producer.as_deref() == Some("p2")
    })
    .await;
    let job = jobs.get(queued).await.unwrap().unwrap();
    assert_eq!(
        (job.state, job.attempts, job.error.as_deref()),
        (JobState::Cancelled, 1, Some("user changed their mind"))
    );
}

fn producer(id: &str) -> NodeInfo {
    let mut n = NodeInfo::new(NodeId::new(id).unwrap(), "127.0.0.1:1", 4);
    n.producer_models = vec!["base".into()];
    n
}

fn consumer(id: &str) -> NodeInfo {
    let mut n = NodeInfo::new(NodeId::new(id).unwrap(), "127.0.0.1:2", 4);
    n.consumer_models = vec!["sotu".into()];
    n
}

fn scheduler_config(retention: Duration) -> SchedulerConfig {
    SchedulerConfig {
        experts: vec![ExpertSpec::new("sotu", "base", 2)],
        default_pool_size: 2,
        reconcile_every: Duration::from_millis(200),
        retention,
        archive: Default::default(),
        max_unfinished_jobs: 256,
        orphan_grace: Duration::from_secs(30),
        election: ElectionConfig { ttl: TTL },
        degraded_fallback: Mode::Raw,
        attempt_deadline: Default::default(),
    }
}

async fn register(b: &Backend, info: NodeInfo) -> Registration {
    Registration::register(
        b.client().await,
        &b.keys,
        info,
        RegistrationConfig {
            ttl: TTL,
            renewals_per_ttl: 3,
        },
    )
    .await
    .unwrap()
}

async fn a_job_is_retried_when_its_producer_disappears(b: Backend) {
    let id = JobId::random();
    let mut producers = vec![
        register(&b, producer("p1")).await,
        register(&b, producer("p2")).await,
    ];
    let _consumer = register(&b, consumer("c1")).await;
    let _scheduler = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(id, 3)).await.unwrap();

    let first = within("the job is assigned", async {
        loop {
            let job = jobs.get(id).await.unwrap().unwrap();
            if job.state == JobState::Assigned {
                break job.producer.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let job = jobs.get(id).await.unwrap().unwrap();
    assert_eq!((job.attempts, job.consumer.as_deref()), (1, Some("c1")));
    // The producer starts working on it, then crashes.
    jobs.transition(id, JobState::Prefilling).await.unwrap();
    let index = producers.iter().position(|r| r.node_id() == first).unwrap();
    drop(producers.remove(index));

    let survivor = producers[0].node_id();
    eventually(
        "the job is reassigned to the surviving producer",
        || async {
            let job = jobs.get(id).await.unwrap().unwrap();
            job.state == JobState::Assigned && job.producer.as_deref() == Some(survivor.as_str())
        },
    )
    .await;
    let job = jobs.get(id).await.unwrap().unwrap();
    assert_eq!(job.attempts, 2);
    assert_eq!(job.failed_producers, vec![first.clone()]);
    assert!(job.error.as_deref().unwrap_or("").contains(first.as_str()));
    let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
    assert_eq!(
        states,
        [
            JobState::Queued,
            JobState::Assigned,
            JobState::Prefilling,
            JobState::Queued,
            JobState::Assigned
        ]
    );
    // The pool no longer lists the dead producer.
    eventually("the pool drops the dead producer", || async {
        read_pools(b.store.as_ref(), &b.keys)
            .await
            .unwrap()
            .get("sotu")
            == Some(&vec![survivor.clone()])
    })
    .await;
}

async fn a_job_fails_when_attempts_run_out(b: Backend) {
    let once = JobId::random();
    let p = register(&b, producer("p1")).await;
    let _consumer = register(&b, consumer("c1")).await;
    let _scheduler = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(once, 1)).await.unwrap();
    reaches(&jobs, once, JobState::Assigned).await;
    p.deregister().await.unwrap();
    reaches(&jobs, once, JobState::Failed).await;
    let job = jobs.get(once).await.unwrap().unwrap();
    assert!(job.error.unwrap().contains("gave up after 1 attempts"));
}

async fn prefix_affinity_picks_the_producer_holding_the_prompt(b: Backend) {
    let affine = JobId::random();
    let plain = JobId::random();
    let hashes = scd_scheduler::prefix::block_hashes("base", &(0..96).collect::<Vec<u32>>(), 32);
    let mut warm = producer("warm");
    warm.prefix_hashes = hashes[..2].to_vec();
    warm.load = 3;
    let _p = [
        register(&b, producer("cold")).await,
        register(&b, warm).await,
    ];
    let _c = register(&b, consumer("c1")).await;
    let _scheduler = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let mut job = sotu_job(affine, 3);
    job.prefix_hashes = hashes.clone();
    jobs.create(&job).await.unwrap();
    jobs.create(&sotu_job(plain, 3)).await.unwrap();
    eventually("both assigned", || async {
        let a = jobs.get(affine).await.unwrap().unwrap();
        let p = jobs.get(plain).await.unwrap().unwrap();
        a.state == JobState::Assigned && p.state == JobState::Assigned
    })
    .await;
    assert_eq!(
        jobs.get(affine).await.unwrap().unwrap().producer.as_deref(),
        Some("warm")
    );
    // Without a prefix, the less loaded producer wins.
    assert_eq!(
        jobs.get(plain).await.unwrap().unwrap().producer.as_deref(),
        Some("cold")
    );
}

async fn finished_jobs_are_swept_after_a_short_retention(b: Backend) {
    let quick = JobId::random();
    let waiting = JobId::random();
    let _p = register(&b, producer("p1")).await;
    let _scheduler = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(quick, 3)).await.unwrap();
    // No consumer hosts the expert: the job waits, and waiting jobs are never swept.
    jobs.create(&sotu_job(waiting, 3)).await.unwrap();
    jobs.cancel(quick, "cancelled by user").await.unwrap();
    eventually("the finished job is swept", || async {
        jobs.get(quick).await.unwrap().is_none()
    })
    .await;
    assert_eq!(
        jobs.get(waiting).await.unwrap().unwrap().state,
        JobState::Queued
    );
}

/// A producer and a consumer, two scheduler replicas, and a job (whose id is returned) already
/// assigned.
async fn two_schedulers_and_an_assigned_job(
    b: &Backend,
) -> ([Registration; 2], [Scheduler; 2], JobStore, JobId) {
    let before = JobId::random();
    let nodes = [
        register(b, producer("p1")).await,
        register(b, consumer("c1")).await,
    ];
    let config = scheduler_config(Duration::from_secs(3600));
    let s1 = Scheduler::start(b.client().await, b.keys.clone(), "s1", config.clone())
        .await
        .unwrap();
    let s2 = Scheduler::start(b.client().await, b.keys.clone(), "s2", config)
        .await
        .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(before, 3)).await.unwrap();
    reaches(&jobs, before, JobState::Assigned).await;
    (nodes, [s1, s2], jobs, before)
}

async fn scheduler_failover_keeps_assigning(b: Backend) {
    let after = JobId::random();
    let (_nodes, [s1, s2], jobs, _) = two_schedulers_and_an_assigned_job(&b).await;
    let (leader, follower) = if s1.is_leader() { (s1, s2) } else { (s2, s1) };
    drop(leader);
    within("the follower takes over", async {
        let mut rx = follower.leadership();
        rx.wait_for(|l| l.is_leader()).await.unwrap();
    })
    .await;
    jobs.create(&sotu_job(after, 3)).await.unwrap();
    reaches(&jobs, after, JobState::Assigned).await;
}

async fn experts_come_from_model_records_too(b: Backend) {
    let mut p = producer("p1");
    p.producer_models = vec!["smol".into()];
    let _p = register(&b, p).await;
    let models = ModelRegistry::new(b.store.clone(), b.keys.clone());
    models
        .put(&ModelRecord {
            id: "law".into(),
            architecture: "llama".into(),
            weights_hash: "w".into(),
            base: Some("smol".into()),
        })
        .await
        .unwrap();
    models
        .put(&ModelRecord {
            id: "smol".into(),
            architecture: "llama".into(),
            weights_hash: "b".into(),
            base: None,
        })
        .await
        .unwrap();
    let mut config = scheduler_config(Duration::from_secs(3600));
    config.experts.clear();
    let _s = Scheduler::start(b.client().await, b.keys.clone(), "s1", config)
        .await
        .unwrap();
    eventually("a pool for the expert found in /models", || async {
        read_pools(b.store.as_ref(), &b.keys)
            .await
            .unwrap()
            .get("law")
            == Some(&vec![NodeId::from_static("p1")])
    })
    .await;
    assert!(!read_pools(b.store.as_ref(), &b.keys)
        .await
        .unwrap()
        .contains_key("smol"));
    assert_eq!(models.list().await.unwrap().len(), 2);
    // Removing the expert's record removes its pool.
    assert!(models.remove("law").await.unwrap());
    assert!(!models.remove("law").await.unwrap());
    eventually("the pool of the removed expert is deleted", || async {
        read_pools(b.store.as_ref(), &b.keys)
            .await
            .unwrap()
            .is_empty()
    })
    .await;
}

async fn a_no_op_update_writes_nothing(b: Backend) {
    let idle = JobId::random();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(idle, 3)).await.unwrap();
    let key = b.keys.job(idle);
    let before = b.store.get(&key).await.unwrap().unwrap().mod_revision;
    jobs.update(idle, |_| Ok(())).await.unwrap();
    assert_eq!(
        b.store.get(&key).await.unwrap().unwrap().mod_revision,
        before
    );
}

async fn a_burst_of_jobs_spreads_over_the_pool(b: Backend) {
    let _p = [
        register(&b, producer("p1")).await,
        register(&b, producer("p2")).await,
    ];
    let _c = register(&b, consumer("c1")).await;
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    // Queued before any scheduler runs: the first pass assigns them all at once.
    for _ in 0..4 {
        jobs.create(&sotu_job(JobId::random(), 3)).await.unwrap();
    }
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    eventually("all assigned", || async {
        jobs.list()
            .await
            .unwrap()
            .iter()
            .all(|(j, _)| j.state == JobState::Assigned)
    })
    .await;
    let on_p1 = jobs
        .list()
        .await
        .unwrap()
        .iter()
        .filter(|(j, _)| j.producer.as_deref() == Some("p1"))
        .count();
    assert_eq!(on_p1, 2);
}

/// Racing submitters cannot push the cluster past its bound of unfinished jobs; refusals write
/// nothing and say when to retry; the leader's recount frees the slots of finished jobs.
async fn admission_bounds_unfinished_jobs_exactly(b: Backend) {
    let _p = register(&b, producer("p1")).await;
    let scheduler = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        SchedulerConfig {
            max_unfinished_jobs: 5,
            ..scheduler_config(Duration::from_secs(3600))
        },
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    within("leading", async {
        scheduler
            .leadership()
            .wait_for(|l| l.is_leader())
            .await
            .unwrap();
    })
    .await;
    let record = || async { admission::current(b.store.as_ref(), &b.keys).await.unwrap() };
    // The leader writes its limit into the admission record on its first pass.
    eventually("the limit is published", || async {
        record().await.limit == 5
    })
    .await;

    // 16 submitters at once, each with its own store connection, for 5 slots.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let jobs = JobStore::new(b.client().await, b.keys.clone());
        tasks.push(tokio::spawn(async move {
            let id = JobId::random();
            (id, jobs.create_admitted(&sotu_job(id, 3)).await)
        }));
    }
    let mut admitted = Vec::new();
    let mut busy = 0;
    for t in tasks {
        let (id, result) = within("submit", t).await.unwrap();
        match result {
            Ok(()) => admitted.push(id),
            Err(JobError::Busy(refusal)) => {
                assert_eq!(refusal.limit, 5);
                assert!(refusal.unfinished >= 5, "{refusal}");
                assert!(refusal.retry_after >= Duration::from_secs(1), "{refusal}");
                assert!(refusal.to_string().contains("retry after"), "{refusal}");
                assert!(
                    jobs.get(id).await.unwrap().is_none(),
                    "a refusal wrote {id}"
                );
                busy += 1;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(admitted.len(), 5, "exactly the limit is admitted");
    assert_eq!(busy, 11);
    assert_eq!(jobs.list().await.unwrap().len(), 5);

    // Two finish (no consumer: they wait until cancelled); the leader's recount frees their
    // slots, and exactly two more get in.
    for id in &admitted[..2] {
        jobs.cancel(*id, "done with it").await.unwrap();
    }
    eventually("the recount frees two slots", || async {
        record().await.unfinished == 3
    })
    .await;
    for _ in 0..2 {
        jobs.create_admitted(&sotu_job(JobId::random(), 3))
            .await
            .unwrap();
    }
    assert!(matches!(
        jobs.create_admitted(&sotu_job(JobId::random(), 3)).await,
        Err(JobError::Busy(_))
    ));
    // A retried submission of an admitted id is told it landed, not counted twice.
    assert!(matches!(
        jobs.create_admitted(&sotu_job(admitted[4], 3)).await,
        Err(JobError::AlreadyExists(_)) | Err(JobError::Busy(_))
    ));
}

/// The drift guard's fallback: while the pair's live translator is marked degraded, a scd job
/// is assigned as raw and says why; `reuse`/`scd` are back once another version is live, and a
/// mark on a version that is no longer live changes nothing.
async fn a_degraded_translator_sends_its_jobs_to_a_safer_mode(b: Backend) {
    use scd_scheduler::{Degraded, TranslatorHash, TranslatorManifest, TranslatorRegistry};
    let _p = register(&b, producer("p1")).await;
    let _c = register(&b, consumer("c1")).await;
    let registry = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    let version = |name: &str, byte| TranslatorManifest {
        producer_model: "base".into(),
        consumer_model: "sotu".into(),
        version: name.into(),
        content_hash: TranslatorHash::from_bytes([byte; 32]),
        ranks: Default::default(),
        reuse_layers: Vec::new(),
        patch_layers: Vec::new(),
        blob: format!("/t/{name}"),
        metrics: Default::default(),
    };
    for (name, byte) in [("v1", 1), ("v2", 2)] {
        registry.publish(&version(name, byte)).await.unwrap();
    }
    registry.activate("base", "sotu", "v1").await.unwrap();
    let mark = || Degraded {
        shadow_kl: 0.9,
        bound: 0.5,
        jobs: 12,
        by: NodeId::from_static("c1"),
        at_ms: now_ms(),
    };
    let hash = |byte| TranslatorHash::from_bytes([byte; 32]);
    // Not the live version: nothing is marked.
    assert!(!registry
        .mark_degraded("base", "sotu", hash(2), mark())
        .await
        .unwrap());
    assert!(registry
        .mark_degraded("base", "sotu", hash(1), mark())
        .await
        .unwrap());
    assert!(
        !registry
            .mark_degraded("base", "sotu", hash(1), mark())
            .await
            .unwrap(),
        "marked once"
    );
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let (during, raw, after) = (JobId::random(), JobId::random(), JobId::random());
    jobs.create(&sotu_job(during, 3)).await.unwrap();
    jobs.create(&JobRecord::new(raw, "sotu", Mode::Q4, 3))
        .await
        .unwrap();
    reaches(&jobs, during, JobState::Assigned).await;
    reaches(&jobs, raw, JobState::Assigned).await;
    let job = jobs.get(during).await.unwrap().unwrap();
    assert_eq!(job.mode, Mode::Raw);
    let fallback = job.fallback.expect("the record says why");
    assert_eq!(fallback.from, Mode::Scd);
    assert!(
        fallback.reason.contains("v1") && fallback.reason.contains("0.900"),
        "{}",
        fallback.reason
    );
    let q4 = jobs.get(raw).await.unwrap().unwrap();
    assert_eq!(
        (q4.mode, q4.fallback),
        (Mode::Q4, None),
        "other modes are left alone"
    );
    // A recalibrated version made live clears the mark.
    let live = registry.activate("base", "sotu", "v2").await.unwrap();
    assert_eq!(live.degraded, None);
    jobs.create(&sotu_job(after, 3)).await.unwrap();
    reaches(&jobs, after, JobState::Assigned).await;
    let job = jobs.get(after).await.unwrap().unwrap();
    assert_eq!((job.mode, job.fallback), (Mode::Scd, None));
}

on_both_stores!(
    a_drained_consumer_does_not_get_its_job_back_from_a_stale_view,
    a_full_node_is_given_nothing_more_until_its_work_ends,
    a_degraded_translator_sends_its_jobs_to_a_safer_mode,
    admission_bounds_unfinished_jobs_exactly,
    a_job_nobody_can_decode_fails_after_the_grace,
    cancel_is_a_compare_and_swap,
    cancel_and_fail_racing_have_one_winner,
    a_cancelled_job_is_never_assigned_or_retried,
    a_lost_consumer_retries_without_blaming_the_producer,
    a_no_op_update_writes_nothing,
    a_burst_of_jobs_spreads_over_the_pool,
    concurrent_updates_lose_nothing,
    the_state_machine_guards_the_record,
    finished_records_are_kept_for_the_retention_only,
    a_job_is_retried_when_its_producer_disappears,
    a_job_fails_when_attempts_run_out,
    prefix_affinity_picks_the_producer_holding_the_prompt,
    finished_jobs_are_swept_after_a_short_retention,
    scheduler_failover_keeps_assigning,
    experts_come_from_model_records_too,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_keeps_jobs_and_scheduling_resumes() {
    let mut b = Backend::etcd().await;
    let (_nodes, [s1, s2], jobs, before) = two_schedulers_and_an_assigned_job(&b).await;
    let after = JobId::random();
    let assigned = jobs.get(before).await.unwrap().unwrap();

    b.etcd.as_mut().unwrap().restart().await.unwrap();
    eventually("the store answers again", || async {
        jobs.get(before).await.is_ok()
    })
    .await;
    // Nothing was lost or changed by the restart.
    assert_eq!(jobs.get(before).await.unwrap().unwrap(), assigned);
    // One replica leads again and keeps assigning.
    eventually("exactly one leader", || async {
        u8::from(s1.is_leader()) + u8::from(s2.is_leader()) == 1
    })
    .await;
    jobs.create(&sotu_job(after, 3)).await.unwrap();
    reaches(&jobs, after, JobState::Assigned).await;
    assert_eq!(jobs.get(before).await.unwrap().unwrap().attempts, 1);
}

async fn a_lost_consumer_retries_without_blaming_the_producer(b: Backend) {
    let dec = JobId::random();
    let _p = register(&b, producer("p1")).await;
    let c1 = register(&b, consumer("c1")).await;
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        scheduler_config(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(dec, 3)).await.unwrap();
    reaches(&jobs, dec, JobState::Assigned).await;
    for s in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
    ] {
        jobs.transition(dec, s).await.unwrap();
    }
    // The decoding consumer dies; another one comes up.
    c1.deregister().await.unwrap();
    let _c2 = register(&b, consumer("c2")).await;
    eventually("reassigned to the new consumer", || async {
        let job = jobs.get(dec).await.unwrap().unwrap();
        job.state == JobState::Assigned && job.consumer.as_deref() == Some("c2")
    })
    .await;
    let job = jobs.get(dec).await.unwrap().unwrap();
    assert_eq!((job.attempts, job.producer.as_deref()), (2, Some("p1")));
    assert!(job.failed_producers.is_empty());
    assert_eq!(job.failed_consumers, vec!["c1".to_string()]);
    assert!(job.error.unwrap().contains("consumer c1"));
}

/// A node at its capacity is given nothing more, whatever load it advertises:
/// the scheduler counts the jobs the records show it holding. The producer is free again once
/// its codes are sent, the consumer once the job ends; the waiting job is assigned then.
async fn a_full_node_is_given_nothing_more_until_its_work_ends(b: Backend) {
    let candidate = Candidate::start(
        b.client().await,
        &b.keys,
        "scheduler",
        "s1",
        ElectionConfig { ttl: TTL },
    )
    .unwrap();
    let guard = candidate.wait_until_leader().await;
    let config = scheduler_config(Duration::from_secs(3600));
    // Advertising no load at all, as a node whose count has not reached the store yet.
    let mut view = NodeMap::new();
    for mut n in [producer("p1"), consumer("c1")] {
        n.capacity = 2;
        view.insert(n.id.clone(), n);
    }
    let pass = || {
        let (store, keys, guard, config, view) = (
            b.store.clone(),
            b.keys.clone(),
            guard.clone(),
            config.clone(),
            view.clone(),
        );
        async move {
            reconcile(&store, &keys, &guard, &view, &config.experts, &config)
                .await
                .unwrap()
        }
    };
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let ids: Vec<JobId> = (0..3).map(|_| JobId::random()).collect();
    for id in &ids {
        jobs.create(&sotu_job(*id, 3)).await.unwrap();
    }
    assert_eq!(pass().await.jobs_assigned, 2);
    let states = || async {
        let mut s = Vec::new();
        for id in &ids {
            s.push(jobs.get(*id).await.unwrap().unwrap().state);
        }
        s
    };
    let assigned: Vec<JobId> = ids
        .iter()
        .zip(states().await)
        .filter(|(_, s)| *s == JobState::Assigned)
        .map(|(id, _)| *id)
        .collect();
    let waiting = *ids.iter().find(|id| !assigned.contains(id)).unwrap();
    // Again, from the records alone: both nodes hold two jobs.
    assert_eq!(pass().await.jobs_assigned, 0);
    assert_eq!(
        jobs.get(waiting).await.unwrap().unwrap().state,
        JobState::Queued
    );
    // One job's codes are sent: the producer has room, the consumer (decoding both) not.
    for s in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
    ] {
        jobs.transition(assigned[0], s).await.unwrap();
    }
    assert_eq!(pass().await.jobs_assigned, 0);
    // It ends: the waiting job goes.
    jobs.update(assigned[0], |j| {
        j.state = JobState::Done;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(pass().await.jobs_assigned, 1);
    let s = states().await;
    assert_eq!(
        s.iter().filter(|s| **s == JobState::Assigned).count(),
        2,
        "{s:?}"
    );
    assert_eq!(
        jobs.get(waiting).await.unwrap().unwrap().state,
        JobState::Assigned
    );
}

/// A consumer drains (it advertises nothing to serve) and hands its job back; a scheduler
/// whose watch of the nodes has not seen the drain yet must not place the job there again.
async fn a_drained_consumer_does_not_get_its_job_back_from_a_stale_view(b: Backend) {
    let id = JobId::random();
    let _p = register(&b, producer("p1")).await;
    let c1 = register(&b, consumer("c1")).await;
    let candidate = Candidate::start(
        b.client().await,
        &b.keys,
        "scheduler",
        "s1",
        ElectionConfig { ttl: TTL },
    )
    .unwrap();
    let guard = candidate.wait_until_leader().await;
    let config = scheduler_config(Duration::from_secs(3600));
    let mut before_drain = NodeMap::new();
    for n in [producer("p1"), consumer("c1")] {
        before_drain.insert(n.id.clone(), n);
    }
    let pass = |view: NodeMap| {
        let (store, keys, guard, config) = (
            b.store.clone(),
            b.keys.clone(),
            guard.clone(),
            config.clone(),
        );
        async move {
            reconcile(&store, &keys, &guard, &view, &config.experts, &config)
                .await
                .unwrap()
        }
    };
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(id, 3)).await.unwrap();
    assert_eq!(pass(before_drain.clone()).await.jobs_assigned, 1);
    for s in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
    ] {
        jobs.transition(id, s).await.unwrap();
    }
    // The drain as `Node::shutdown` does it: advertise nothing, then hand the job back.
    c1.update(|n| {
        n.consumer_models.clear();
        n.capacity = 0;
    })
    .await
    .unwrap();
    jobs.update(id, |j| {
        j.retry("node c1 shut down", Blame::Consumer, now_ms())
    })
    .await
    .unwrap();
    let report = pass(before_drain.clone()).await;
    let job = jobs.get(id).await.unwrap().unwrap();
    assert_eq!((report.jobs_assigned, job.state), (0, JobState::Queued));
    assert_eq!((job.attempts, job.consumer), (1, None));

    // Back in service (say, restarted under the same id), the one consumer it has gets the job
    // again, placed from the same view (now right about c1).
    c1.update(|n| {
        n.consumer_models = vec!["sotu".into()];
        n.capacity = 4;
    })
    .await
    .unwrap();
    assert_eq!(pass(before_drain).await.jobs_assigned, 1);
    let job = jobs.get(id).await.unwrap().unwrap();
    assert_eq!(
        (job.state, job.attempts, job.consumer.as_deref()),
        (JobState::Assigned, 2, Some("c1"))
    );
}

/// A job whose only consumer dies is queued again; when no node hosts its expert for the
/// grace period, it fails saying so instead of waiting for ever.
async fn a_job_nobody_can_decode_fails_after_the_grace(b: Backend) {
    let id = JobId::random();
    let _p = register(&b, producer("p1")).await;
    let c1 = register(&b, consumer("c1")).await;
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        SchedulerConfig {
            orphan_grace: Duration::from_millis(600),
            ..scheduler_config(Duration::from_secs(3600))
        },
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    jobs.create(&sotu_job(id, 3)).await.unwrap();
    reaches(&jobs, id, JobState::Assigned).await;
    c1.deregister().await.unwrap();
    reaches(&jobs, id, JobState::Failed).await;
    let job = jobs.get(id).await.unwrap().unwrap();
    let reason = job.error.unwrap();
    assert!(
        reason.contains("no live node hosts expert sotu"),
        "{reason}"
    );
    // It was queued again first (the attempt abandoned), then failed.
    let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
    assert_eq!(
        states,
        [
            JobState::Queued,
            JobState::Assigned,
            JobState::Queued,
            JobState::Failed
        ]
    );
}
