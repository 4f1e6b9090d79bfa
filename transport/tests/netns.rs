//! A transfer across a kernel-level shaped link: ops/netns-link.sh builds two network
//! namespaces joined by veth with tc, and this test runs a receiving node in one and a sending
//! node in the other, each as a child process (this test binary re-run with a role). Skipped,
//! with a message, where namespaces cannot be created (not root, no CAP_SYS_ADMIN).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use scd_transport::pki::{init_ca_dir, issue_in_dir};
use scd_transport::{
    CodeFrame, CodeKind, DType, Endpoint, Identity, JobId, LinkProfile, Message, Role,
    TransportOptions,
};

const SERVER_ADDR: &str = "10.77.0.1:47001";
const CLIENT_ADDR: &str = "10.77.0.2:0";
const FRAMES: u16 = 16;
const FRAME_BYTES: usize = 256 << 10;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/netns-link.sh")
}

struct LinkGuard;

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("down").status();
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

fn frame(layer: u16) -> CodeFrame {
    CodeFrame {
        job_id: JobId(77),
        layer,
        kind: CodeKind::REUSE_K,
        dtype: DType::F16,
        shape: vec![(FRAME_BYTES / 2) as u32],
        translator: [1; 32],
        trace: vec![],
        payload: (0..FRAME_BYTES)
            .map(|i| (i as u8) ^ (layer as u8))
            .collect(),
    }
}

fn spawn_role(role: &str, dir: &Path, ns: &str) -> Child {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "netns_role",
            "--ignored",
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
fn transfer_across_network_namespaces() {
    if let Err(why) = Command::new(script())
        .arg("check")
        .output()
        .map_err(|e| e.to_string())
        .and_then(|o| {
            if o.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&o.stderr).trim().to_owned())
            }
        })
    {
        println!("SKIPPED transfer_across_network_namespaces: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    init_ca_dir(dir.path(), "netns").unwrap();
    issue_in_dir(dir.path(), "node-a", Role::Node).unwrap();
    issue_in_dir(dir.path(), "node-b", Role::Node).unwrap();

    let up = Command::new(script())
        .args(["up", "200mbit", "2ms"])
        .status()
        .unwrap();
    let _link = LinkGuard;
    assert!(up.success(), "netns-link.sh up failed");

    let deadline = Instant::now() + Duration::from_secs(120);
    let mut server = Reaped(spawn_role("server", dir.path(), "scd-a"));
    let server_out = lines_of(&mut server.0);
    wait_line(&server_out, "LISTENING");
    let mut client = Reaped(spawn_role("client", dir.path(), "scd-b"));
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

/// The child side of the test above; does nothing unless started by it.
#[test]
#[ignore = "run by transfer_across_network_namespaces inside a namespace"]
fn netns_role() {
    let Ok(role) = std::env::var("SCD_NETNS_ROLE") else {
        return;
    };
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
                got += f.payload.len() as u64;
            }
            println!("SCD-NETNS RECEIVED {got}");
            conn.closed().await;
        } else {
            let id = Identity::load(&dir, "node-b").unwrap();
            let ep = Endpoint::bind(CLIENT_ADDR.parse().unwrap(), &id, opts()).unwrap();
            let server: SocketAddr = SERVER_ADDR.parse().unwrap();
            let conn = ep.connect(server, "node-a").await.unwrap();
            let start = Instant::now();
            let mut tx = conn.open_job(JobId(77), vec![]).await.unwrap();
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
