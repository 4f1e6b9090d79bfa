//! The control plane under store faults (minutes each, so ignored: `make faults`
//! runs them): a real etcd, a scheduler node, a producer and a consumer with the real model,
//! jobs in flight when the fault starts and more after it heals.
//!
//! - etcd stopped (SIGSTOP) for 60 s, then continued;
//! - etcd out of space: started with a small `--quota-backend-bytes`, filled until it raises
//!   its NOSPACE alarm and refuses writes, held there 20 s (longer than a job store waits out
//!   an outage on its own), then healed as an operator would (the filler deleted, the history
//!   compacted, the database defragmented, the alarm disarmed).
//!
//! - the producer and the consumer partitioned from each other for 60 s (both still reach
//!   etcd), and the consumer alone cut from etcd for 60 s (its link to the producer intact):
//!   real partitions, made with `ops/netns-link.sh` (root needed). The producer and the consumer
//!   run in two network namespaces joined by a link, each reaching the etcd on the host by a
//!   link of its own; a cut link drops every packet silently, as a failed switch does.
//!
//! After healing, every job must end within a bound, none done twice, none lost, and the
//! admission count must equal the unfinished jobs. Each prints one table row (submitted, done,
//! failed with reasons, lost, duplicated, seconds to recover) for BENCHMARKS.md.

use crate::common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{config, config_with, models, prompt, request};
use scd_actors::node::failpoints;
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
    ca: ClusterCa,
    client: ClusterClient,
    nodes: Vec<Node>,
    /// Nodes in other network namespaces, each with the runtime whose threads live there.
    away: Vec<(AwayRuntime, Node)>,
    /// The namespaces' link, torn down when the rig stops.
    link: Option<Link>,
}

/// The rig's nodes: a scheduler, a producer, a consumer of the mail expert.
const SCHEDULER: &str = "sched-0";
const PRODUCER: &str = "prefill-0";
const CONSUMER: &str = "mail-0";

/// A node's config in the rig.
fn node_config(id: &str) -> scd_actors::NodeConfig {
    match id {
        SCHEDULER => config(id, "\"scheduler\"", false),
        PRODUCER => config(id, "\"producer\"", true),
        _ => config(id, "\"consumer\"", true),
    }
}

/// A rig with its three nodes in this process's namespace.
async fn rig(etcd: EtcdServer) -> Rig {
    let mut rig = rig_of(etcd, node_config(SCHEDULER)).await;
    for id in [PRODUCER, CONSUMER] {
        let node = rig.start(node_config(id), rig.store.clone()).await;
        rig.nodes.push(node);
    }
    rig
}

/// A rig with its scheduler only, started from `scheduler`.
async fn rig_of(etcd: EtcdServer, scheduler: scd_actors::NodeConfig) -> Rig {
    let store: Arc<dyn MetaStore> = Arc::new(etcd.store().await.unwrap());
    let client = ClusterClient::new(store.clone(), Keys::default());
    let mut rig = Rig {
        etcd,
        store,
        ca: ClusterCa::generate("faults").unwrap(),
        client,
        nodes: Vec::new(),
        away: Vec::new(),
        link: None,
    };
    let scheduler = rig.start(scheduler, rig.store.clone()).await;
    rig.nodes.push(scheduler);
    rig
}

/// Two network namespaces from `ops/netns-link.sh`: `-a` holds the producer, `-b` the
/// consumer; the data link joins them, and each reaches the host (etcd, the scheduler, this
/// test's client) by its control link.
struct Link {
    prefix: String,
}

/// The addresses `ops/netns-link.sh` gives: the data link's ends, the host's control ends.
const PRODUCER_AT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const CONSUMER_AT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const HOST_FOR_A: Ipv4Addr = Ipv4Addr::new(10, 78, 1, 1);
const HOST_FOR_B: Ipv4Addr = Ipv4Addr::new(10, 78, 2, 1);

impl Link {
    fn up() -> Self {
        let link = Self {
            prefix: format!("scdf{}", std::process::id()),
        };
        let check = link.script(&["check"]);
        assert!(
            check.status.success(),
            "the network fault tests need network namespaces (root, iproute2): {}",
            String::from_utf8_lossy(&check.stderr)
        );
        for args in [&["up", "1gbit", "0ms"][..], &["control"]] {
            let out = link.script(args);
            assert!(
                out.status.success(),
                "netns-link.sh {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        link
    }

    fn script(&self, args: &[&str]) -> std::process::Output {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/netns-link.sh");
        Command::new("bash")
            .arg(script)
            .args(args)
            .env("SCD_NETNS_PREFIX", &self.prefix)
            .output()
            .unwrap()
    }

    /// `cut` or `heal` one link: data, ctl-a or ctl-b.
    fn set(&self, verb: &str, link: &str) {
        let out = self.script(&[verb, link]);
        assert!(
            out.status.success(),
            "netns-link.sh {verb} {link}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A runtime whose threads live in namespace `side` (a or b). A thread starts in the
    /// namespace of the thread that spawns it and a socket belongs to that of the thread that
    /// opens it, so a node started on this runtime listens and connects from there.
    fn runtime(&self, side: &str) -> AwayRuntime {
        let path = format!("/var/run/netns/{}-{side}", self.prefix);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: setns with a namespace file's open descriptor moves only this thread.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
        })
        .join()
        .map(|runtime| AwayRuntime(Some(runtime)))
        .unwrap()
    }
}

/// A runtime of its own for a namespace's node. Dropping a runtime blocks, which panics inside
/// the test's runtime: this one is shut down without waiting, so that a failing test reports
/// its failure and takes its namespaces down instead of aborting.
struct AwayRuntime(Option<tokio::runtime::Runtime>);

impl AwayRuntime {
    fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.as_ref().expect("running until dropped").spawn(task)
    }
}

impl Drop for AwayRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = self.script(&["down"]);
    }
}

/// The scheduler on the host, the producer in namespace a and the consumer in b, each node in
/// its namespace reaching etcd by its own control link; `orphan_grace_s` for the scheduler.
async fn rig_across_namespaces(orphan_grace_s: u64) -> Rig {
    let link = Link::up();
    let etcd = EtcdServer::start_also_on(&[HOST_FOR_A.into(), HOST_FOR_B.into()])
        .await
        .unwrap();
    let limits = format!("\n[limits]\norphan_grace_s = {orphan_grace_s}\n");
    let translator = common::repo().join("experts/mail/translator");
    let scheduler = config_with(SCHEDULER, "\"scheduler\"", false, &translator, &limits);
    let mut rig = rig_of(etcd, scheduler).await;
    for (id, side, at, host) in [
        (PRODUCER, "a", PRODUCER_AT, HOST_FOR_A),
        (CONSUMER, "b", CONSUMER_AT, HOST_FOR_B),
    ] {
        let mut config = node_config(id);
        config.node.listen = (IpAddr::from(at), 0).into();
        let endpoint = rig.etcd.endpoint_at(host.into());
        let runtime = link.runtime(side);
        let served = Arc::new(Served::load(&config, scd_models::KernelChoice::best()).unwrap());
        let identity = rig.ca.issue(id, Role::Node).unwrap();
        // Everything the node opens, its store's connection included, is opened there.
        let node = runtime
            .spawn(async move {
                let store: Arc<dyn MetaStore> = Arc::new(
                    scd_scheduler::EtcdStore::connect(&[endpoint])
                        .await
                        .unwrap(),
                );
                let cancel = CancellationToken::new();
                Node::start(&config, &identity, served, store, None, cancel)
                    .await
                    .unwrap()
            })
            .await
            .unwrap();
        rig.away.push((runtime, node));
    }
    rig.link = Some(link);
    rig
}

impl Rig {
    /// Starts a node on `store` with a certificate from the rig's CA.
    async fn start(&self, config: scd_actors::NodeConfig, store: Arc<dyn MetaStore>) -> Node {
        let served = Arc::new(Served::load(&config, scd_models::KernelChoice::best()).unwrap());
        let identity = self.ca.issue(&config.node.id, Role::Node).unwrap();
        let cancel = CancellationToken::new();
        Node::start(&config, &identity, served, store, None, cancel)
            .await
            .unwrap()
    }

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
        for (runtime, node) in self.away {
            let _ = runtime.spawn(node.shutdown(Duration::ZERO)).await;
        }
        for node in self.nodes {
            node.shutdown(Duration::ZERO).await;
        }
        drop(self.etcd);
        drop(self.link);
    }

    fn link(&self) -> &Link {
        self.link.as_ref().expect("a rig across namespaces")
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
async fn consumer_killed_and_restarted_under_its_id_loses_and_doubles_nothing() {
    let mut rig = rig(EtcdServer::start().await.unwrap()).await;
    let mut ids = rig.submit(BEFORE).await;
    rig.until_decoding(&ids).await;
    // As kill -9 and a new process at once: no drain, no word to the store, its lease left
    // to expire while the new incarnation registers over its key.
    let consumer = rig.nodes.pop().expect("the consumer starts last");
    failpoints::silence(CONSUMER, true);
    consumer.kill().await;
    failpoints::silence(CONSUMER, false);
    let again = rig.start(node_config(CONSUMER), rig.store.clone()).await;
    rig.nodes.push(again);
    let healed = Instant::now();
    ids.extend(rig.submit(AFTER).await);
    let fault = "consumer killed while decoding, restarted under its id at once";
    let tally = rig.tally(fault, &ids, healed).await;
    rig.stop().await;
    tally.check();
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

/// Starts jobs, cuts `link` for 60 s, heals it, submits more, and tallies; the scheduler
/// fails a job whose expert no live node hosts after `orphan_grace_s`.
async fn cut_for_60_s(link: &str, fault: &str, orphan_grace_s: u64) {
    let rig = rig_across_namespaces(orphan_grace_s).await;
    let mut ids = rig.submit(BEFORE).await;
    rig.until_decoding(&ids).await;
    rig.link().set("cut", link);
    tokio::time::sleep(Duration::from_secs(60)).await;
    rig.link().set("heal", link);
    let healed = Instant::now();
    ids.extend(rig.submit(AFTER).await);
    let tally = rig.tally(fault, &ids, healed).await;
    rig.stop().await;
    tally.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes, root and a real etcd: make faults"]
async fn producer_and_consumer_partitioned_for_60_s_lose_and_double_nothing() {
    let fault = "producer | consumer partitioned 60 s";
    cut_for_60_s("data", fault, 30).await;
}

/// With the default `orphan_grace_s` (30 s) the jobs the cut consumer held fail once their
/// expert has had no live node for that long, saying so; with 90 s they wait it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes, root and a real etcd: make faults"]
async fn consumer_cut_from_etcd_for_60_s_loses_and_doubles_nothing() {
    for grace in [30, 90] {
        let fault = format!("consumer cut from etcd 60 s (orphan_grace_s {grace})");
        cut_for_60_s("ctl-b", &fault, grace).await;
    }
}
