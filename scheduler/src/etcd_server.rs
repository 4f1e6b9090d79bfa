//! A throwaway etcd for tests and local runs: the system's `etcd` binary on free loopback ports
//! with its own data directory, stopped (killed) when dropped. Restarting keeps the data
//! directory and ports, as a real etcd restart would.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::store::{EtcdStore, MetaStore};

/// Errors starting the test etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdServerError {
    /// No etcd binary.
    #[error("etcd binary not found (looked for $SCD_ETCD_BIN, `etcd` on PATH, /usr/bin/etcd, /usr/local/bin/etcd); run `make setup` (ops/setup.sh installs Debian's etcd-server)")]
    BinaryMissing,
    /// Filesystem or process error.
    #[error("starting etcd failed: {0}")]
    Io(#[from] std::io::Error),
    /// It started but never answered.
    #[error("etcd on {endpoint} did not answer within {waited:?}; its log is at {log}")]
    NotReady {
        /// Client endpoint.
        endpoint: String,
        /// How long we waited.
        waited: Duration,
        /// The log file.
        log: String,
    },
}

/// A running etcd owned by this process.
#[derive(Debug)]
pub struct EtcdServer {
    binary: PathBuf,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// How long to wait for etcd to answer after starting it.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<Self, EtcdServerError> {
        let binary = find_etcd().ok_or(EtcdServerError::BinaryMissing)?;
        let dir = tempfile::Builder::new().prefix("scd-etcd-").tempdir()?;
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let mut server = Self {
            binary,
            dir,
            client_port,
            peer_port,
            child: None,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The etcd process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data directory (kept across restarts).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Connects a store to it.
    pub async fn store(&self) -> Result<EtcdStore, crate::store::StoreError> {
        EtcdStore::connect(&[self.endpoint()]).await
    }

    /// Kills the process (SIGKILL: no graceful shutdown) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same data directory and ports, and waits until it answers.
    pub async fn restart(&mut self) -> Result<(), EtcdServerError> {
        self.kill();
        self.spawn().await
    }

    /// Starts it again on the same ports with an empty data directory: everything it held,
    /// leases included, is gone (a cluster restored without its state).
    pub async fn restart_empty(&mut self) -> Result<(), EtcdServerError> {
        self.kill();
        let data = self.data_dir();
        if data.exists() {
            std::fs::remove_dir_all(&data)?;
        }
        self.spawn().await
    }

    async fn spawn(&mut self) -> Result<(), EtcdServerError> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log_path = self.dir.path().join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut cmd = Command::new(&self.binary);
        die_with_parent(&mut cmd);
        let child = cmd
            .arg("--name")
            .arg("scd-test")
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("scd-test={peer}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--logger")
            .arg("zap")
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        wait_ready(&client, READY_TIMEOUT, &log_path).await
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn wait_ready(endpoint: &str, limit: Duration, log: &Path) -> Result<(), EtcdServerError> {
    let started = tokio::time::Instant::now();
    while started.elapsed() < limit {
        if let Ok(store) = EtcdStore::connect(&[endpoint.to_string()]).await {
            if store.get("/scd/ready-probe").await.is_ok() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(EtcdServerError::NotReady {
        endpoint: endpoint.to_string(),
        waited: limit,
        log: log.display().to_string(),
    })
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn find_etcd() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SCD_ETCD_BIN").map(PathBuf::from) {
        return p.is_file().then_some(p);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"));
    on_path
        .chain([
            PathBuf::from("/usr/bin/etcd"),
            PathBuf::from("/usr/local/bin/etcd"),
        ])
        .find(|p| p.is_file())
}

/// Makes the kernel SIGKILL the child when the thread that spawned it dies, so a test process
/// that is itself killed (Ctrl-C twice, a CI timeout) leaves no etcd behind holding its ports.
/// `Drop` covers every orderly exit; this covers the rest. Linux only; elsewhere a no-op.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the forked child before exec and only calls prctl, which is
    // async-signal-safe and touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}
