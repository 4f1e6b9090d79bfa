//! The etcd test harness itself: an etcd started by a test process that is killed outright
//! (no destructor runs) goes with it instead of lingering on its ports, and the harness never
//! mistakes another etcd (or another program) on its ports for the one it started.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use scd_scheduler::etcd_server::{EtcdServer, EtcdServerError};
use scd_scheduler::MetaStore;

const CHILD_ENV: &str = "SCD_HARNESS_CHILD";

/// In the child role (set by the parent below) this starts etcd, reports its pid and waits
/// to be killed; in the normal role it runs that child, SIGKILLs it and checks etcd is gone.
#[test]
fn etcd_dies_with_a_killed_test_process() {
    if std::env::var_os(CHILD_ENV).is_some() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let server = rt.block_on(EtcdServer::start()).unwrap();
        println!("etcd pid {}", server.pid().unwrap());
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "etcd_dies_with_a_killed_test_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let pid = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        // libtest prints "test <name> ... " without a newline first, so search within lines.
        .find_map(|l| l.split_once("etcd pid ").map(|(_, p)| p.trim().to_owned()))
        .expect("the child never reported etcd's pid")
        .parse::<u32>()
        .unwrap();
    let proc_dir = format!("/proc/{pid}");
    assert!(Path::new(&proc_dir).exists(), "etcd {pid} is not running");
    child.kill().unwrap(); // SIGKILL: the child's EtcdServer is never dropped.
    child.wait().unwrap();
    // The kernel delivers the parent-death signal at once; the bound is for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(pid),
        "etcd {pid} outlived the test process that started it"
    );
}

/// Running and not a zombie: etcd's parent is gone, so it is reaped by init, but a zombie
/// may show in /proc for a moment.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// A second harness forced onto the ports of a running one finds the first etcd answering
/// there, and refuses it instead of handing out someone else's etcd as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_etcd_on_the_port_is_refused() {
    let ours = EtcdServer::start()
        .await
        .unwrap_or_else(|e| panic!("this test needs a real etcd: {e}"));
    let store = ours.store().await.unwrap();
    store.put("/mine", b"1".to_vec(), None).await.unwrap();

    let err = EtcdServer::start_on(ours.client_port(), ours.peer_port())
        .await
        .expect_err("a second harness on the same ports must not start");
    match &err {
        EtcdServerError::Foreign {
            endpoint,
            expected,
            found,
        } => {
            assert_eq!(endpoint, &ours.endpoint());
            assert_ne!(expected, ours.name());
            assert!(found.contains(ours.name()), "{found}");
        }
        other => panic!("expected a foreign-etcd error, got: {other}"),
    }
    assert!(
        err.to_string().contains("not the one this harness started"),
        "{err}"
    );
    // The first etcd is untouched: same process, same data.
    assert!(ours.pid().is_some_and(alive));
    assert_eq!(store.get("/mine").await.unwrap().unwrap().value, b"1");
}

/// A port held by a program that is not etcd at all: the harness's etcd cannot bind it and
/// exits, and the harness says so instead of waiting out its patience.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_cannot_bind_its_port_is_reported() {
    let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let peer_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    match EtcdServer::start_on(port, peer_port).await {
        Err(EtcdServerError::Exited {
            endpoint, log_tail, ..
        }) => {
            assert_eq!(endpoint, format!("http://127.0.0.1:{port}"));
            assert!(
                log_tail.contains("address already in use"),
                "etcd's log: {log_tail}"
            );
        }
        Err(other) => panic!("expected an exit error, got: {other}"),
        Ok(_) => panic!("etcd started on a port another program holds"),
    }
}
