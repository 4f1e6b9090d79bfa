//! The control plane under store faults (issue R1 §2; minutes each, so ignored: `make faults`
//! runs them): a real etcd, a scheduler node, a producer and a consumer with the real model,
//! jobs in flight when the fault starts and more after it heals.
//!
//! - etcd stopped (SIGSTOP) for 60 s, then continued;
//! - etcd out of space: started with a small `--quota-backend-bytes`, filled until it raises
//!   its NOSPACE alarm and refuses writes, held there 20 s (longer than a job store waits out
//!   an outage on its own), then healed as an operator would (the filler deleted, the history
//!   compacted, the database defragmented, the alarm disarmed).
//!
//! After healing, every job must end within a bound, none done twice, none lost, and the
//! admission count must equal the unfinished jobs. Each prints one table row (submitted, done,
//! failed with reasons, lost, duplicated, seconds to recover) for BENCHMARKS.md.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{config, models, prompt, request};
use scd_actors::{ClusterClient, Node, Served};
use scd_scheduler::{admission, EtcdServer, JobId, JobState, JobStore, Keys, MetaStore, Mode};
use scd_transport::{ClusterCa, Role};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Jobs in flight when the fault starts, and submitted after it heals.
const BEFORE: usize = 6;
const AFTER: usize = 3;
/// Tokens per job.
const TOKENS: usize = 48;
/// Every job must end within this after healing.
const BOUND: Duration = Duration::from_secs(600);

struct Rig {
    etcd: EtcdServer,
    store: Arc<dyn MetaStore>,
    client: ClusterClient,
    nodes: Vec<Node>,
}

async fn rig(etcd: EtcdServer) -> Rig {
    let store: Arc<dyn MetaStore> = Arc::new(etcd.store().await.unwrap());
    let ca = ClusterCa::generate("faults").unwrap();
    let mut nodes = Vec::new();
    for (id, roles, expert) in [
        ("sched-0", "\"scheduler\"", false),
        ("prefill-0", "\"producer\"", true),
        ("mail-0", "\"consumer\"", true),
    ] {
        let config = config(id, roles, expert);
        let served = Arc::new(Served::load(&config, scd_models::KernelChoice::best()).unwrap());
        let identity = ca.issue(id, Role::Node).unwrap();
        let node = Node::start(
            &config,
            &identity,
            served,
            store.clone(),
            None,
            CancellationToken::new(),
        )
        .await
        .unwrap();
        nodes.push(node);
    }
    let client = ClusterClient::new(store.clone(), Keys::default());
    Rig {
        etcd,
        store,
        client,
        nodes,
    }
}

impl Rig {
    async fn submit(&self, n: usize) -> Vec<JobId> {
        let prompt = prompt(models());
        let mut ids = Vec::new();
        for _ in 0..n {
            // Right after healing a submission may be refused (the consumer re-registering
            // after its lease lapsed): a client tries again, within the bound.
            let deadline = Instant::now() + BOUND;
            let id = loop {
                match self
                    .client
                    .submit("mail", Mode::Raw, request(&prompt, TOKENS))
                    .await
                {
                    Ok(id) => break id,
                    Err(e) if Instant::now() < deadline => {
                        println!("  submit refused, retrying: {e}");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => panic!("no submission accepted within {BOUND:?}: {e}"),
                }
            };
            ids.push(id);
        }
        ids
    }

    /// Waits (bounded) until some job is decoding: the fault hits jobs in every state.
    async fn until_decoding(&self, ids: &[JobId]) {
        let deadline = Instant::now() + BOUND;
        loop {
            for id in ids {
                if self.client.get(*id).await.unwrap().state == JobState::Decoding {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "no job started decoding");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits after healing until every job has ended (or the bound passed), then tallies.
    async fn tally(&self, fault: &str, ids: &[JobId], healed: Instant) -> Tally {
        let deadline = healed + BOUND;
        let mut ended = BTreeMap::new();
        while ended.len() < ids.len() && Instant::now() < deadline {
            let open: Vec<JobId> = ids
                .iter()
                .filter(|id| !ended.contains_key(*id))
                .copied()
                .collect();
            for id in open.iter() {
                if let Ok(job) = self.client.get(*id).await {
                    if job.state.is_finished() {
                        ended.insert(*id, job);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let recovered = healed.elapsed();
        let mut tally = Tally {
            fault: fault.to_string(),
            submitted: ids.len(),
            lost: ids.len() - ended.len(),
            recover_s: recovered.as_secs_f64(),
            ..Tally::default()
        };
        for job in ended.values() {
            let dones = job
                .history
                .iter()
                .filter(|h| h.state == JobState::Done)
                .count();
            tally.duplicated += usize::from(dones > 1);
            match job.state {
                JobState::Done => tally.done += 1,
                _ => tally
                    .failed
                    .push(job.error.clone().unwrap_or_else(|| "(no reason)".into())),
            }
            tally.retries += job.attempts.saturating_sub(1) as usize;
        }
        // The admission count comes back to the truth (the leader recounts each pass).
        let deadline = Instant::now() + BOUND;
        loop {
            let live = JobStore::new(self.store.clone(), Keys::default())
                .list()
                .await
                .map(|l| l.iter().filter(|(j, _)| !j.state.is_finished()).count() as u64);
            let counted = admission::current(self.store.as_ref(), &Keys::default())
                .await
                .map(|a| a.unfinished);
            if let (Ok(live), Ok(counted)) = (live, counted) {
                if live == counted {
                    tally.admission_ok = true;
                    break;
                }
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tally
    }

    async fn stop(self) {
        for node in self.nodes {
            node.shutdown(Duration::ZERO).await;
        }
        drop(self.etcd);
    }
}

#[derive(Debug, Default)]
struct Tally {
    fault: String,
    submitted: usize,
    done: usize,
    failed: Vec<String>,
    lost: usize,
    duplicated: usize,
    retries: usize,
    admission_ok: bool,
    recover_s: f64,
}

impl Tally {
    fn check(&self) {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} |",
            self.fault,
            self.submitted,
            self.done,
            self.failed.len(),
            self.lost,
            self.duplicated,
            self.retries,
            self.recover_s,
            if self.admission_ok { "yes" } else { "NO" }
        );
        for reason in &self.failed {
            println!("  failed: {reason}");
        }
        assert_eq!(self.lost, 0, "{self:?}");
        assert_eq!(self.duplicated, 0, "{self:?}");
        assert!(self.admission_ok, "{self:?}");
    }
}

fn signal(etcd: &EtcdServer, sig: &str) {
    let pid = etcd.pid().expect("etcd runs");
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes, and a real etcd: make faults"]
async fn etcd_stopped_for_60_s_under_load_loses_and_doubles_nothing() {
    let rig = rig(EtcdServer::start().await.unwrap()).await;
    let mut ids = rig.submit(BEFORE).await;
    rig.until_decoding(&ids).await;
    signal(&rig.etcd, "STOP");
    tokio::time::sleep(Duration::from_secs(60)).await;
    signal(&rig.etcd, "CONT");
    let healed = Instant::now();
    ids.extend(rig.submit(AFTER).await);
    let tally = rig.tally("etcd stopped 60 s (SIGSTOP)", &ids, healed).await;
    rig.stop().await;
    tally.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes, and a real etcd: make faults"]
async fn etcd_out_of_space_loses_and_doubles_nothing() {
    const QUOTA: u64 = 16 << 20;
    let rig = rig(EtcdServer::start_with_quota(QUOTA).await.unwrap()).await;
    let mut etcd = etcd_client::Client::connect([rig.etcd.endpoint()], None)
        .await
        .unwrap();
    let mut ids = rig.submit(BEFORE).await;
    rig.until_decoding(&ids).await;
    // Fill until etcd refuses writes.
    let filler = vec![b'x'; 512 << 10];
    let mut puts = 0;
    loop {
        match etcd
            .put(format!("/filler/{puts}"), filler.clone(), None)
            .await
        {
            Ok(_) => puts += 1,
            Err(e) if e.to_string().contains("space") => break,
            Err(e) => panic!("filling etcd: {e}"),
        }
        assert!(puts < 4 * (QUOTA >> 19), "etcd never ran out of space");
    }
    let full = etcd.alarm(
        etcd_client::AlarmAction::Get,
        etcd_client::AlarmType::None,
        None,
    );
    let alarms = full.await.unwrap();
    assert!(!alarms.alarms().is_empty(), "no NOSPACE alarm");
    tokio::time::sleep(Duration::from_secs(20)).await;
    // Heal: delete the filler, compact, defragment, disarm.
    let options = etcd_client::DeleteOptions::new().with_prefix();
    etcd.delete("/filler/", Some(options)).await.unwrap();
    let revision = etcd
        .get("/", None)
        .await
        .unwrap()
        .header()
        .map_or(0, |h| h.revision());
    let physical = etcd_client::CompactionOptions::new().with_physical();
    etcd.compact(revision, Some(physical)).await.unwrap();
    etcd.defragment().await.unwrap();
    // Each member's alarm by its id (member 0 matches none).
    for alarm in alarms.alarms() {
        let mut member = etcd_client::AlarmOptions::new();
        member.with_member(alarm.member_id());
        etcd.alarm(
            etcd_client::AlarmAction::Deactivate,
            etcd_client::AlarmType::Nospace,
            Some(member),
        )
        .await
        .unwrap();
    }
    let left = etcd
        .alarm(
            etcd_client::AlarmAction::Get,
            etcd_client::AlarmType::None,
            None,
        )
        .await
        .unwrap();
    assert!(
        left.alarms().is_empty(),
        "NOSPACE still raised after disarming"
    );
    let healed = Instant::now();
    ids.extend(rig.submit(AFTER).await);
    let tally = rig
        .tally(
            &format!("NOSPACE ({} MiB quota, 20 s)", QUOTA >> 20),
            &ids,
            healed,
        )
        .await;
    rig.stop().await;
    tally.check();
}
