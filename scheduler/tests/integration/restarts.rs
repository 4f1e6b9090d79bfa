//! Restarts and lost attempts: a node restarted under the same id within its
//! lease TTL is the old incarnation leaving (its epoch changed), and an attempt past its
//! deadline is abandoned, so no job stays running for ever holding its admission slot.

use crate::common;

use std::time::Duration;

use crate::common::{eventually, Backend, TTL};
use scd_scheduler::admission;
use scd_scheduler::{
    AttemptDeadline, ElectionConfig, ExpertSpec, JobId, JobRecord, JobState, JobStore, Mode,
    NodeId, NodeInfo, Registration, RegistrationConfig, RegistrationEvent, Scheduler,
    SchedulerConfig,
};

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

fn config() -> SchedulerConfig {
    SchedulerConfig {
        experts: vec![ExpertSpec::new("sotu", "base", 2)],
        reconcile_every: Duration::from_millis(200),
        election: ElectionConfig { ttl: TTL },
        ..SchedulerConfig::default()
    }
}

/// Registers `info` as a new incarnation, with a lease TTL far longer than any wait below: a
/// node that stops renewing stays listed throughout, as a node restarted within its TTL does.
async fn start_node(b: &Backend, info: NodeInfo) -> Registration {
    Registration::register(
        b.client().await,
        &b.keys,
        info,
        RegistrationConfig {
            ttl: Duration::from_secs(600),
            renewals_per_ttl: 3,
        },
    )
    .await
    .unwrap()
}

async fn record(jobs: &JobStore, id: JobId) -> JobRecord {
    jobs.get(id).await.unwrap().unwrap()
}

/// Creates a job through admission, waits for its assignment and walks it to `state` as its
/// nodes would.
async fn job_in(b: &Backend, jobs: &JobStore, state: JobState, max_attempts: u32) -> JobId {
    let id = JobId::random();
    jobs.create_admitted(&JobRecord::new(id, "sotu", Mode::Raw, max_attempts))
        .await
        .unwrap();
    eventually("the job is assigned", || async {
        record(jobs, id).await.state == JobState::Assigned
    })
    .await;
    for s in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
    ] {
        if record(jobs, id).await.state == state {
            break;
        }
        jobs.transition(id, s).await.unwrap();
    }
    assert_eq!(record(jobs, id).await.state, state);
    let _ = b;
    id
}

/// The admission count equals the number of unfinished jobs (bounded wait: the leader
/// recounts on its next pass).
async fn admission_matches_live_jobs(b: &Backend, jobs: &JobStore) {
    eventually("the admission count equals the live jobs", || async {
        let live = jobs
            .list()
            .await
            .unwrap()
            .iter()
            .filter(|(j, _)| !j.state.is_finished())
            .count() as u64;
        admission::current(b.store.as_ref(), &b.keys)
            .await
            .unwrap()
            .unfinished
            == live
    })
    .await;
}

async fn a_consumer_restarted_within_its_ttl_loses_its_decoding_job(b: Backend) {
    let _p = start_node(&b, producer("p1")).await;
    let c1 = start_node(&b, consumer("c1")).await;
    let _s = Scheduler::start(b.client().await, b.keys.clone(), "s1", config())
        .await
        .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    let id = job_in(&b, &jobs, JobState::Decoding, 3).await;
    let first = record(&jobs, id).await;
    assert_eq!(first.consumer_epoch, Some(c1.epoch()));
    assert!(first.attempt_deadline_ms.is_some());

    // kill -9: the renewals stop, the key stays under its lease; the node comes back under
    // the same id at once, overwriting its own key.
    let old_epoch = c1.epoch();
    drop(c1);
    let c1 = start_node(&b, consumer("c1")).await;
    assert_ne!(c1.epoch(), old_epoch);

    eventually("the lost attempt is handed back and run again", || async {
        record(&jobs, id).await.attempts == 2
    })
    .await;
    let job = record(&jobs, id).await;
    let reason = job.error.clone().unwrap_or_default();
    assert!(reason.contains("consumer c1 restarted"), "{reason}");
    assert_eq!(job.failed_consumers, vec!["c1".to_string()]);
    assert!(job.failed_producers.is_empty());
    // The only consumer is the restarted one: the new attempt goes to its new incarnation.
    assert_eq!(job.consumer_epoch, Some(c1.epoch()));
    admission_matches_live_jobs(&b, &jobs).await;
}

async fn a_producer_restarted_between_claim_and_stream_loses_its_attempt(b: Backend) {
    let p1 = start_node(&b, producer("p1")).await;
    let _c = start_node(&b, consumer("c1")).await;
    let _s = Scheduler::start(b.client().await, b.keys.clone(), "s1", config())
        .await
        .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    // Claimed (prefilling), the stream never opened.
    let id = job_in(&b, &jobs, JobState::Prefilling, 3).await;
    assert_eq!(record(&jobs, id).await.producer_epoch, Some(p1.epoch()));
    drop(p1);
    let _p1 = start_node(&b, producer("p1")).await;

    eventually("the lost attempt is handed back and run again", || async {
        record(&jobs, id).await.attempts == 2
    })
    .await;
    let job = record(&jobs, id).await;
    let reason = job.error.clone().unwrap_or_default();
    assert!(reason.contains("producer p1 restarted"), "{reason}");
    assert_eq!(job.failed_producers, vec!["p1".to_string()]);
    assert!(job.failed_consumers.is_empty());
    admission_matches_live_jobs(&b, &jobs).await;
}

async fn an_attempt_past_its_deadline_is_abandoned(b: Backend) {
    let _p = start_node(&b, producer("p1")).await;
    let _c = start_node(&b, consumer("c1")).await;
    let _s = Scheduler::start(
        b.client().await,
        b.keys.clone(),
        "s1",
        SchedulerConfig {
            attempt_deadline: AttemptDeadline {
                base: Duration::from_secs(3),
                per_token: Duration::ZERO,
            },
            ..config()
        },
    )
    .await
    .unwrap();
    let jobs = JobStore::new(b.store.clone(), b.keys.clone());
    // Both nodes stay alive and silent: only the deadline can end these attempts.
    let once = job_in(&b, &jobs, JobState::Decoding, 1).await;
    let twice = job_in(&b, &jobs, JobState::Prefilling, 2).await;
    eventually("both jobs end", || async {
        record(&jobs, once).await.state.is_finished()
            && record(&jobs, twice).await.state.is_finished()
    })
    .await;
    for id in [once, twice] {
        let job = record(&jobs, id).await;
        assert_eq!(job.state, JobState::Failed);
        let reason = job.error.unwrap_or_default();
        assert!(reason.contains("passed its deadline"), "{reason}");
        assert!(reason.contains(&format!("gave up after {} attempts", job.max_attempts)));
    }
    admission_matches_live_jobs(&b, &jobs).await;
}

/// Re-registering after a lost lease is the same incarnation: the epoch stays.
async fn a_lost_lease_keeps_the_epoch(b: Backend) {
    let reg = Registration::register(
        b.client().await,
        &b.keys,
        consumer("c1"),
        RegistrationConfig {
            ttl: TTL,
            renewals_per_ttl: 3,
        },
    )
    .await
    .unwrap();
    let epoch = reg.epoch();
    let mut events = reg.subscribe();
    b.store.revoke_lease(reg.lease()).await.unwrap();
    common::within("re-registered", async {
        while !matches!(
            events.recv().await,
            Ok(RegistrationEvent::Reregistered { .. })
        ) {}
    })
    .await;
    assert_eq!(reg.epoch(), epoch);
    let stored = b.store.get(&b.keys.node("c1").unwrap()).await.unwrap();
    let stored: NodeInfo = scd_scheduler::envelope::decode("node", &stored.unwrap().value).unwrap();
    assert_eq!(stored.epoch, epoch);
}

on_both_stores!(
    a_consumer_restarted_within_its_ttl_loses_its_decoding_job,
    a_producer_restarted_between_claim_and_stream_loses_its_attempt,
    an_attempt_past_its_deadline_is_abandoned,
    a_lost_lease_keeps_the_epoch,
);
