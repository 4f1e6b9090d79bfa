//! The etcd test harness itself: an etcd started by a test process that is killed outright
//! (no destructor runs) goes with it instead of lingering on its ports.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use scd_scheduler::etcd_server::EtcdServer;

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
