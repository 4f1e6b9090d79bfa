//! A transfer across a kernel-level shaped link: ops/netns-link.sh builds two network
//! namespaces joined by veth with tc, and this test runs a receiving node in one and a sending
//! node in the other, each as a child process (this test binary re-run with a role in
//! `SCD_NETNS_ROLE`). It needs iproute2 (`ip`, `tc`; ops/setup.sh installs them) and the right
//! to create network namespaces (root, or CAP_SYS_ADMIN and CAP_NET_ADMIN), so a plain `cargo
//! test` leaves it out (ignored); `make test` runs it (`make test-netns`) where
//! `ops/netns-link.sh check` passes and says plainly that it did not run, and why, elsewhere.
//! Run by hand where either is missing, it fails and says which. The namespaces are named after
//! this process, so runs on one machine at the same time do not tear down each other's link.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use scd_transport::pki::{init_ca_dir, issue_in_dir};
use scd_transport::{
    CodeDType, CodeFrame, CodeKind, Endpoint, Identity, JobId, LayerCode, LinkProfile, Message,
    Role, TraceContext, TranslatorHash, TransportOptions,
};

const SERVER_ADDR: &str = "10.77.0.1:47001";
const CLIENT_ADDR: &str = "10.77.0.2:0";
const FRAMES: u16 = 16;
const FRAME_BYTES: usize = 256 << 10;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/netns-link.sh")
}

/// The namespaces' name prefix for this run: `scd<pid>` gives `scd<pid>-a` and `scd<pid>-b`.
fn prefix() -> String {
    format!("scd{}", std::process::id())
}

fn link_script() -> Command {
    let mut c = Command::new(script());
    c.env("SCD_NETNS_PREFIX", prefix());
    c
}

struct LinkGuard;

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = link_script().arg("down").status();
    }
}

fn opts() -> TransportOptions {
    TransportOptions {
        link: LinkProfile {
            bandwidth_bps: 200_000_000,
            rtt: Duration::from_millis(4),
        },
        ..TransportOptions::default()
    }
}

const JOB: JobId = JobId::from_u128(77);

fn frame(layer: u16) -> CodeFrame {
    CodeFrame::new(
        JOB,
        LayerCode {
            layer,
            kind: CodeKind::REUSE_K,
            dtype: CodeDType::F16,
            shape: vec![(FRAME_BYTES / 2) as u32],
            bytes: (0..FRAME_BYTES)
                .map(|i| (i as u8) ^ (layer as u8))
                .collect(),
        },
    )
    .with_translator(TranslatorHash::from_bytes([1; 32]))
}

fn spawn_role(role: &str, dir: &Path, ns: &str) -> Child {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "transfer_across_network_namespaces",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SCD_NETNS_ROLE", role)
        .env("SCD_NETNS_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Forward a child's stdout lines to a channel, so the test can wait with a timeout.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Wait for `SCD-NETNS <word> ...` (libtest may print its own text before it on the line).
fn wait_line(lines: &mpsc::Receiver<String>, word: &str) -> String {
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no {word} from the child: {e}"));
        if let Some(at) = line.find("SCD-NETNS ") {
            let rest = &line[at + "SCD-NETNS ".len()..];
            if rest.starts_with(word) {
                return rest.to_owned();
            }
        }
    }
}

/// Kills the child if the test fails before it exits.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_exit(child: &mut Reaped, deadline: Instant) -> bool {
    while Instant::now() < deadline {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
#[ignore = "needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2 (ip, tc); `make test` runs it where it can (`make test-netns`)"]
fn transfer_across_network_namespaces() {
    if let Ok(role) = std::env::var("SCD_NETNS_ROLE") {
        return netns_role(&role);
    }
    let check = link_script()
        .arg("check")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script().display()));
    assert!(
        check.status.success(),
        "this test needs network namespaces: {} (ops/setup.sh installs iproute2; creating \
         namespaces needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN)",
        String::from_utf8_lossy(&check.stderr).trim()
    );
    let dir = tempfile::tempdir().unwrap();
    init_ca_dir(dir.path(), "netns").unwrap();
    issue_in_dir(dir.path(), "node-a", Role::Node).unwrap();
    issue_in_dir(dir.path(), "node-b", Role::Node).unwrap();

    let up = link_script()
        .args(["up", "200mbit", "2ms"])
        .status()
        .unwrap();
    let _link = LinkGuard;
    assert!(up.success(), "netns-link.sh up failed");

    let deadline = Instant::now() + Duration::from_secs(120);
    let mut server = Reaped(spawn_role("server", dir.path(), &format!("{}-a", prefix())));
    let server_out = lines_of(&mut server.0);
    wait_line(&server_out, "LISTENING");
    let mut client = Reaped(spawn_role("client", dir.path(), &format!("{}-b", prefix())));
    let client_out = lines_of(&mut client.0);
    let sent = wait_line(&client_out, "SENT");
    let received = wait_line(&server_out, "RECEIVED");
    assert!(wait_exit(&mut client, deadline), "client failed");
    assert!(wait_exit(&mut server, deadline), "server failed");
    let bytes = |s: &str| s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
    assert_eq!(bytes(&received), u64::from(FRAMES) * FRAME_BYTES as u64);
    assert_eq!(bytes(&sent), bytes(&received));
    println!("netns transfer: {sent}");
}

/// The child side of the test above, run inside a namespace as `role` (server or client).
fn netns_role(role: &str) {
    let dir = PathBuf::from(std::env::var("SCD_NETNS_DIR").unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        if role == "server" {
            let id = Identity::load(&dir, "node-a").unwrap();
            let ep = Endpoint::bind(SERVER_ADDR.parse().unwrap(), &id, opts()).unwrap();
            println!("SCD-NETNS LISTENING");
            let conn = ep.accept().await.unwrap().complete().await.unwrap();
            let mut rx = conn.accept_job().await.unwrap();
            let mut got = 0u64;
            let mut layer = 0;
            while let Some(m) = rx.next().await.unwrap() {
                let Message::Code(f) = m else {
                    panic!("unexpected {m:?}")
                };
                assert_eq!(f, frame(layer));
                layer += 1;
                got += f.code.bytes.len() as u64;
            }
            println!("SCD-NETNS RECEIVED {got}");
            conn.closed().await;
        } else {
            let id = Identity::load(&dir, "node-b").unwrap();
            let ep = Endpoint::bind(CLIENT_ADDR.parse().unwrap(), &id, opts()).unwrap();
            let server: SocketAddr = SERVER_ADDR.parse().unwrap();
            let conn = ep.connect(server, "node-a").await.unwrap();
            let start = Instant::now();
            let mut tx = conn.open_job(JOB, TraceContext::new()).await.unwrap();
            for l in 0..FRAMES {
                tx.send(frame(l)).await.unwrap();
            }
            tx.finish().await.unwrap();
            let secs = start.elapsed().as_secs_f64();
            let bytes = u64::from(FRAMES) * FRAME_BYTES as u64;
            println!(
                "SCD-NETNS SENT {bytes} in {secs:.3} s ({:.1} Mbit/s goodput)",
                bytes as f64 * 8.0 / secs / 1e6
            );
            conn.close("done");
            ep.wait_idle().await;
        }
    });
}
