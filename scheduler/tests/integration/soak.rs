//! The control plane's soak, `make soak`: a real etcd compacting its history
//! every minute, more than 10 MiB of finished job records left in the live prefix (as a day of
//! jobs left them before the archive existed), then 2,000 small jobs through one scheduler
//! replica and a simulated producer and consumer that drive each assigned job through its
//! states with progress writes, as the nodes do. Every job must reach `done`; the listings
//! that `scd jobs list` reads must answer throughout; etcd's database must stay bounded.
//! Every few seconds it prints jobs done, jobs/s, the live and archived records, the time the
//! two listings take and etcd's database size; after the last job it idles until the finished
//! records are archived, the archive is back within its bound (1,000 here) and etcd has
//! compacted (the part of its database in use drops), then defragments it once.
//! BENCHMARKS.md records a run.
//!
//! Ignored by a plain `cargo test` (it takes minutes): `make soak` runs it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use scd_scheduler::jobs::now_ms;
use scd_scheduler::store::EventKind;
use scd_scheduler::{
    envelope, Appended, ArchiveConfig, EtcdServer, ExpertSpec, JobError, JobId, JobRecord,
    JobRequest, JobResult, JobState, JobStore, Keys, MetaStore, Mode, NodeId, NodeInfo,
    Registration, RegistrationConfig, Scheduler, SchedulerConfig,
};
use tokio::sync::Semaphore;

/// Jobs run in the soak.
const JOBS: usize = 2_000;
/// Finished records seeded before it, and the prompt tokens of each (about 12 KB a record).
const SEEDED: usize = 900;
const SEEDED_PROMPT_TOKENS: usize = 2_000;
/// The whole soak's bound: only a real bug takes this long.
const SOAK_BOUND: Duration = Duration::from_secs(20 * 60);
/// Between two samples.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How long after the last job the soak waits to see etcd compact (every minute, down to the
/// last minute's history: the jobs' writes are compacted away about two minutes after them).
const COMPACTION_WAIT: Duration = Duration::from_secs(240);
/// Jobs the simulated nodes work on at once.
const WORKERS: usize = 64;

fn request(prompt_tokens: usize, seed: u64) -> JobRequest {
    JobRequest {
        prompt: (0..prompt_tokens)
            .map(|i| ((seed as usize * 7919 + i * 104_729) % 49_152) as u32)
            .collect(),
        max_tokens: 16,
        temperature: 0.0,
        top_p: 1.0,
        seed,
        stop_tokens: Vec::new(),
        documents: Vec::new(),
    }
}

/// Writes `SEEDED` finished records, last updated two hours ago, into the live prefix; returns
/// their bytes.
async fn seed(store: &dyn MetaStore, keys: &Keys) -> usize {
    let ago = now_ms() - 2 * 3600 * 1000;
    let mut bytes = 0;
    for i in 0..SEEDED {
        let mut job = JobRecord::new(JobId::random(), "sotu", Mode::Scd, 3)
            .with_request(request(SEEDED_PROMPT_TOKENS, i as u64));
        for s in [
            JobState::Assigned,
            JobState::Prefilling,
            JobState::Transferring,
            JobState::Decoding,
            JobState::Done,
        ] {
            job.transition(s, ago).unwrap();
        }
        job.output = Some(JobResult {
            tokens: (0..16).collect(),
            stop: "max_tokens".into(),
        });
        job.created_at_ms = ago;
        job.updated_at_ms = ago;
        let value = envelope::encode(&job).unwrap();
        bytes += value.len();
        store.put(&keys.job(job.id), value, None).await.unwrap();
    }
    bytes
}

/// One assigned attempt driven as the producer and consumer nodes would: prefilling,
/// transferring, decoding, three batches of the tokens so far, done. Returns whether it
/// ended done (false: the scheduler moved the job on meanwhile).
async fn drive(jobs: &JobStore, id: JobId, attempt: u32) -> Result<bool, JobError> {
    let mine = |j: &JobRecord| j.attempts == attempt && j.state.is_running();
    let step = |next: JobState| {
        move |j: &mut JobRecord| {
            if mine(j) && j.state != next {
                j.transition(next, now_ms())?;
            }
            Ok(())
        }
    };
    for next in [
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
    ] {
        let j = jobs.update(id, step(next)).await?;
        if !mine(&j) {
            return Ok(false);
        }
    }
    // The tokens so far, appended beside the record as the consumer nodes do.
    for tokens in [4u32, 8, 12] {
        let shown: Vec<u32> = (0..tokens).collect();
        if jobs.append_output(id, &shown, mine).await? == Appended::WriteTheRecord {
            jobs.update(id, |j| {
                if mine(j) {
                    j.output = Some(JobResult {
                        tokens: shown.clone(),
                        stop: String::new(),
                    });
                }
                Ok(())
            })
            .await?;
        }
    }
    let j = jobs
        .update(id, |j| {
            if mine(j) && j.state == JobState::Decoding {
                j.output = Some(JobResult {
                    tokens: (0..16).collect(),
                    stop: "max_tokens".into(),
                });
                j.transition(JobState::Done, now_ms())?;
            }
            Ok(())
        })
        .await?;
    Ok(j.state == JobState::Done && j.attempts == attempt)
}

/// The simulated nodes: follow the live job records (listing, then watch; again after a
/// compacted watch) and drive every newly assigned attempt.
async fn simulated_nodes(
    store: Arc<dyn MetaStore>,
    keys: Keys,
    done: Arc<AtomicUsize>,
    started: Arc<Mutex<HashSet<(JobId, u32)>>>,
) {
    let jobs = JobStore::new(store.clone(), keys.clone());
    let permits = Arc::new(Semaphore::new(WORKERS));
    let prefix = keys.jobs_prefix();
    loop {
        let Ok(listing) = store.get_prefix(&prefix).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let mut seen: Vec<JobRecord> = listing
            .kvs
            .iter()
            .filter_map(|kv| envelope::decode(&kv.key, &kv.value).ok())
            .collect();
        let Ok(mut watch) = store.watch_prefix(&prefix, listing.revision + 1).await else {
            continue;
        };
        loop {
            for job in seen.drain(..) {
                if job.state != JobState::Assigned
                    || !started.lock().unwrap().insert((job.id, job.attempts))
                {
                    continue;
                }
                let (jobs, done, permits) = (jobs.clone(), done.clone(), permits.clone());
                tokio::spawn(async move {
                    let Ok(_permit) = permits.acquire_owned().await else {
                        return;
                    };
                    match drive(&jobs, job.id, job.attempts).await {
                        Ok(true) => {
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(false) => {}
                        Err(e) => eprintln!("soak: driving {} failed: {e}", job.id),
                    }
                });
            }
            match watch.next().await {
                Some(Ok(event)) if event.kind == EventKind::Put => {
                    if let Ok(job) = envelope::decode(&event.kv.key, &event.kv.value) {
                        seen.push(job);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => break,
            }
        }
    }
}

/// etcd's database size and the part of it in use, in bytes.
async fn db_size(endpoint: &str) -> (i64, i64) {
    let Ok(mut client) = etcd_client::Client::connect([endpoint], None).await else {
        return (-1, -1);
    };
    match client.status().await {
        Ok(s) => (s.db_size(), s.raft_used_db_size()),
        Err(_) => (-1, -1),
    }
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a soak of minutes: make soak"]
async fn soak_two_thousand_jobs_over_ten_mib_of_finished_records() {
    let server = EtcdServer::start_compacting("1m")
        .await
        .unwrap_or_else(|e| panic!("the soak needs a real etcd: {e}"));
    let endpoint = server.endpoint();
    let store: Arc<dyn MetaStore> = Arc::new(server.store().await.unwrap());
    let keys = Keys::new("/scd-soak/v1");
    let jobs = JobStore::new(store.clone(), keys.clone());

    let seeded_bytes = seed(store.as_ref(), &keys).await;
    assert!(seeded_bytes >= 10 << 20, "seeded only {seeded_bytes} bytes");
    let (db_before, _) = db_size(&endpoint).await;
    println!(
        "soak: seeded {SEEDED} finished records, {:.1} MiB, in the live prefix; etcd db {:.1} MiB",
        mib(seeded_bytes as i64),
        mib(db_before)
    );

    let mut producer = NodeInfo::new(NodeId::from_static("p1"), "127.0.0.1:1", 64);
    producer.producer_models = vec!["base".into()];
    let mut consumer = NodeInfo::new(NodeId::from_static("c1"), "127.0.0.1:2", 64);
    consumer.consumer_models = vec!["sotu".into()];
    let mut registrations = Vec::new();
    for info in [producer, consumer] {
        registrations.push(
            Registration::register(store.clone(), &keys, info, RegistrationConfig::default())
                .await
                .unwrap(),
        );
    }
    let archive = ArchiveConfig {
        max_records: 1_000,
        sweep_every: Duration::from_secs(10),
        ..ArchiveConfig::default()
    };
    let config = SchedulerConfig {
        experts: vec![ExpertSpec::new("sotu", "base", 2)],
        archive,
        ..SchedulerConfig::default()
    };
    println!(
        "soak: scheduler defaults but archive.max_records {} and sweep_every {:?} (archive after {:?}, retention {:?}); etcd --auto-compaction-mode=periodic --auto-compaction-retention=1m",
        archive.max_records, archive.sweep_every, archive.after, config.retention
    );
    let scheduler = Scheduler::start(store.clone(), keys.clone(), "s1", config)
        .await
        .unwrap();

    let done = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Mutex::new(HashSet::new()));
    let nodes = tokio::spawn(simulated_nodes(
        store.clone(),
        keys.clone(),
        done.clone(),
        started,
    ));

    let begin = Instant::now();
    let submitted = Arc::new(AtomicUsize::new(0));
    let submitter = {
        let (jobs, submitted) = (jobs.clone(), submitted.clone());
        tokio::spawn(async move {
            let mut ids = Vec::with_capacity(JOBS);
            for i in 0..JOBS {
                let job = JobRecord::new(JobId::random(), "sotu", Mode::Scd, 3)
                    .with_request(request(16, i as u64));
                loop {
                    match jobs.create_admitted(&job).await {
                        Ok(()) => break,
                        // The cluster holds its bound of unfinished jobs: wait as a client would.
                        Err(JobError::Busy(_)) => {
                            tokio::time::sleep(Duration::from_millis(50)).await
                        }
                        Err(e) => panic!("submitting job {i}: {e}"),
                    }
                }
                ids.push(job.id);
                submitted.fetch_add(1, Ordering::SeqCst);
            }
            ids
        })
    };

    println!(
        "soak: t_s  submitted  done  jobs_per_s  live  archived  list_ms  db_mib  db_in_use_mib"
    );
    let mut samples = Vec::new();
    let mut peak_db = 0;
    let mut peak_in_use = 0;
    loop {
        let finished = done.load(Ordering::SeqCst);
        let listed = Instant::now();
        // What `scd jobs list` reads: the live records and the archive.
        let live = jobs.list().await.expect("listing the live jobs").len();
        let archived = jobs
            .list_archived()
            .await
            .expect("listing the archive")
            .len();
        let list_ms = listed.elapsed().as_secs_f64() * 1e3;
        let (db, in_use) = db_size(&endpoint).await;
        peak_db = peak_db.max(db);
        peak_in_use = peak_in_use.max(in_use);
        let t = begin.elapsed().as_secs_f64();
        let line = format!(
            "{t:7.1}  {:9}  {finished:4}  {:10.1}  {live:4}  {archived:8}  {list_ms:7.1}  {:6.1}  {:13.1}",
            submitted.load(Ordering::SeqCst),
            finished as f64 / t.max(1e-3),
            mib(db),
            mib(in_use)
        );
        println!("soak: {line}");
        samples.push(line);
        if finished >= JOBS {
            break;
        }
        assert!(
            begin.elapsed() < SOAK_BOUND,
            "the soak passed {SOAK_BOUND:?} with {finished} of {JOBS} jobs done"
        );
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    let elapsed = begin.elapsed().as_secs_f64();
    let ids = submitter.await.unwrap();
    for id in &ids {
        let job = jobs.get(*id).await.unwrap().expect("a job's record");
        assert_eq!(job.state, JobState::Done, "job {id}");
    }
    // Then idle, sampling, until the finished records have left the live prefix, the archive
    // is back within its bound and etcd has compacted at least once since the last write.
    let ended = Instant::now();
    let (live, archived, db_after, in_use_after) = loop {
        tokio::time::sleep(SAMPLE_EVERY).await;
        let live = jobs.list().await.expect("listing the live jobs").len();
        let archived = jobs
            .list_archived()
            .await
            .expect("listing the archive")
            .len();
        let (db, in_use) = db_size(&endpoint).await;
        peak_db = peak_db.max(db);
        println!(
            "soak: {:7.1}  {JOBS:9}  {JOBS:4}  {:>10}  {live:4}  {archived:8}  {:>7}  {:6.1}  {:13.1}",
            begin.elapsed().as_secs_f64(),
            "-",
            "-",
            mib(db),
            mib(in_use)
        );
        peak_in_use = peak_in_use.max(in_use);
        // Compaction shows as pages freed inside the file: the part in use drops.
        let compacted = in_use < peak_in_use - peak_in_use / 10;
        if live == 0 && archived <= 1_000 && (compacted || ended.elapsed() >= COMPACTION_WAIT) {
            if !compacted {
                println!("soak: no compaction seen within {COMPACTION_WAIT:?} of the last job");
            }
            break (live, archived, db, in_use);
        }
        assert!(
            begin.elapsed() < SOAK_BOUND,
            "the soak passed {SOAK_BOUND:?}: {live} live records, {archived} archived"
        );
    };
    // Defragmentation gives the freed pages back to the file system.
    let mut client = etcd_client::Client::connect([endpoint.as_str()], None)
        .await
        .unwrap();
    client.defragment().await.unwrap();
    let (db_defragmented, _) = db_size(&endpoint).await;
    println!(
        "soak: after etcdctl defrag's equivalent: etcd db {:.1} MiB",
        mib(db_defragmented)
    );
    println!(
        "soak: {JOBS} jobs done in {elapsed:.1} s, {:.1} jobs/s; records held before: {SEEDED} live ({:.1} MiB), after: {live} live, {archived} archived; etcd db {:.1} MiB before, peak {:.1} MiB, after {:.1} MiB ({:.1} MiB in use)",
        JOBS as f64 / elapsed,
        mib(seeded_bytes as i64),
        mib(db_before),
        mib(peak_db),
        mib(db_after),
        mib(in_use_after)
    );
    assert_eq!(live, 0);
    assert!(archived <= 1_000, "the archive holds {archived} records");
    // Bounded: far below etcd's default 2 GiB quota, and not growing with every write made.
    assert!(
        peak_db < 512 << 20,
        "etcd's database reached {peak_db} bytes"
    );
    nodes.abort();
    scheduler.shutdown().await.unwrap();
    drop(registrations);
}
