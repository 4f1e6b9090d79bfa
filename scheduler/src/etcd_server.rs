//! A throwaway etcd for tests and local runs (feature `test-util`): the system's `etcd` binary
//! on free loopback ports with its own data directory, stopped (killed) when dropped.
//! Restarting keeps the data directory and ports, as a real etcd restart would.
//!
//! Each instance names its member (and its cluster token) uniquely and, before handing the
//! server out, checks through the client that the member answering on its port is that one: a
//! stray etcd left on the same port by another process would otherwise pass for ours, and a test
//! would run against someone else's data.

use std::net::{IpAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions};

use crate::store::{EtcdStore, EtcdTls, StoreError};

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
    #[error("etcd on {endpoint} did not answer within {waited:?}; its log ends with:\n{log_tail}")]
    NotReady {
        /// Client endpoint.
        endpoint: String,
        /// How long we waited.
        waited: Duration,
        /// The end of its log (the log itself goes with the harness's temporary directory).
        log_tail: String,
    },
    /// The etcd it started exited before answering (a port taken by another program, a bad
    /// data directory, ...).
    #[error(
        "etcd exited ({status}) before answering on {endpoint}; its log ends with:\n{log_tail}"
    )]
    Exited {
        /// Client endpoint.
        endpoint: String,
        /// How it exited.
        status: String,
        /// The end of its log.
        log_tail: String,
    },
    /// Another etcd answers on the port: the harness would run against someone else's data.
    #[error("the etcd answering on {endpoint} is not the one this harness started (expected member {expected:?}, found {found}); another etcd holds the port: stop it or let the harness pick free ports")]
    Foreign {
        /// Client endpoint.
        endpoint: String,
        /// The member name the harness gave its etcd.
        expected: String,
        /// The member that answered.
        found: String,
    },
}

/// PEM files for an etcd that serves its clients over TLS and asks each for a certificate
/// (`--client-cert-auth`), as every shipped etcd config does.
#[derive(Debug, Clone)]
pub struct ServingTls {
    /// The CA that signed `cert` and that clients' certificates must chain to.
    pub ca: PathBuf,
    /// etcd's certificate, valid for 127.0.0.1 and usable as a client's too (the harness
    /// probes with it).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

impl ServingTls {
    /// The harness's own client credentials: the CA, and etcd's certificate as a client's.
    fn client(&self) -> std::io::Result<EtcdTls> {
        Ok(EtcdTls {
            ca_pem: std::fs::read(&self.ca)?,
            client: Some((std::fs::read(&self.cert)?, std::fs::read(&self.key)?)),
        })
    }
}

/// A running etcd owned by this process.
#[derive(Debug)]
pub struct EtcdServer {
    binary: PathBuf,
    dir: tempfile::TempDir,
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    compaction_retention: String,
    /// `--quota-backend-bytes`, where set (etcd's default, 2 GiB, otherwise).
    quota_backend_bytes: Option<u64>,
    /// Clients served over TLS with certificates, where set.
    tls: Option<ServingTls>,
    /// What this harness presents as a client of it then.
    client_tls: Option<EtcdTls>,
    /// Addresses it also serves clients on, besides loopback (the network fault tests, whose
    /// nodes sit in other network namespaces).
    also_on: Vec<IpAddr>,
}

/// The history the test etcd keeps: auto-compaction as in every shipped etcd config
/// (`--auto-compaction-mode=periodic`), so a long run's database stays bounded.
pub const COMPACTION_RETENTION: &str = "5m";

/// How long to wait for etcd to answer after starting it.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on one probe, so a port held by something that accepts but never answers cannot
/// stall the wait.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<Self, EtcdServerError> {
        Self::start_on(free_port()?, free_port()?).await
    }

    /// Starts etcd on the given loopback ports and waits until it answers. Fails with
    /// [`EtcdServerError::Foreign`] if another etcd answers on `client_port`.
    pub async fn start_on(client_port: u16, peer_port: u16) -> Result<Self, EtcdServerError> {
        Self::start_with(client_port, peer_port, COMPACTION_RETENTION, None, None).await
    }

    /// Starts etcd on free loopback ports serving clients over TLS only, each client required
    /// to present a certificate signed by `tls.ca`.
    pub async fn start_tls(tls: ServingTls) -> Result<Self, EtcdServerError> {
        Self::start_with(
            free_port()?,
            free_port()?,
            COMPACTION_RETENTION,
            None,
            Some(tls),
        )
        .await
    }

    /// Starts etcd on free loopback ports, compacting its history periodically down to the
    /// last `retention` (etcd's duration syntax, such as `1m`; below an hour etcd compacts
    /// every `retention`).
    pub async fn start_compacting(retention: &str) -> Result<Self, EtcdServerError> {
        Self::start_with(free_port()?, free_port()?, retention, None, None).await
    }

    /// Starts etcd on free loopback ports with a backend quota of `bytes`: past it etcd raises
    /// its NOSPACE alarm and refuses writes until the alarm is disarmed (the fault tests).
    pub async fn start_with_quota(bytes: u64) -> Result<Self, EtcdServerError> {
        Self::start_with(
            free_port()?,
            free_port()?,
            COMPACTION_RETENTION,
            Some(bytes),
            None,
        )
        .await
    }

    /// Starts etcd on free ports serving plain clients on loopback and on each of `hosts` too
    /// (same port): for clients in other network namespaces, see [`Self::endpoint_at`].
    pub async fn start_also_on(hosts: &[IpAddr]) -> Result<Self, EtcdServerError> {
        let mut server = Self::unstarted(free_port()?, free_port()?, COMPACTION_RETENTION)?;
        server.also_on = hosts.to_vec();
        server.spawn().await?;
        Ok(server)
    }

    async fn start_with(
        client_port: u16,
        peer_port: u16,
        retention: &str,
        quota_backend_bytes: Option<u64>,
        tls: Option<ServingTls>,
    ) -> Result<Self, EtcdServerError> {
        let mut server = Self::unstarted(client_port, peer_port, retention)?;
        server.quota_backend_bytes = quota_backend_bytes;
        server.client_tls = tls.as_ref().map(ServingTls::client).transpose()?;
        server.tls = tls;
        server.spawn().await?;
        Ok(server)
    }

    /// A plain etcd on those ports, not started yet.
    fn unstarted(
        client_port: u16,
        peer_port: u16,
        retention: &str,
    ) -> Result<Self, EtcdServerError> {
        Ok(Self {
            binary: find_etcd().ok_or(EtcdServerError::BinaryMissing)?,
            dir: tempfile::Builder::new().prefix("scd-etcd-").tempdir()?,
            name: unique_name(),
            client_port,
            peer_port,
            child: None,
            compaction_retention: retention.to_string(),
            quota_backend_bytes: None,
            tls: None,
            client_tls: None,
            also_on: Vec::new(),
        })
    }

    /// The client URL (`https://` where it serves TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The client URL on one of the addresses given to [`Self::start_also_on`].
    pub fn endpoint_at(&self, host: IpAddr) -> String {
        format!("http://{host}:{}", self.client_port)
    }

    /// What a client needs to reach a TLS etcd: its CA, and etcd's own certificate as the
    /// client's. `None` for a plain one.
    pub fn client_tls(&self) -> Option<&EtcdTls> {
        self.client_tls.as_ref()
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The peer port.
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// The member name, unique to this instance (kept across restarts).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The etcd process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data directory (kept across restarts).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Connects a store to it (with [`Self::client_tls`] where it serves TLS).
    pub async fn store(&self) -> Result<EtcdStore, StoreError> {
        EtcdStore::connect_with(&[self.endpoint()], self.client_tls()).await
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
        let client = std::iter::once(self.endpoint())
            .chain(self.also_on.iter().map(|h| self.endpoint_at(*h)))
            .collect::<Vec<_>>()
            .join(",");
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
            .arg(&self.name)
            .arg("--initial-cluster-token")
            .arg(&self.name)
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
            .arg(format!("{}={peer}", self.name))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--auto-compaction-mode")
            .arg("periodic")
            .arg("--auto-compaction-retention")
            .arg(&self.compaction_retention)
            .args(
                self.quota_backend_bytes
                    .map(|b| format!("--quota-backend-bytes={b}")),
            )
            .args(self.tls.iter().flat_map(|t| {
                [
                    format!("--cert-file={}", t.cert.display()),
                    format!("--key-file={}", t.key.display()),
                    format!("--trusted-ca-file={}", t.ca.display()),
                    "--client-cert-auth".to_owned(),
                ]
            }))
            .arg("--logger")
            .arg("zap")
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        self.wait_ready(&log_path).await
    }

    /// Waits until our member answers and serves reads. Whatever answers first decides: a
    /// member with another name is refused at once, so a stray etcd already on the port is
    /// caught even while our child is still failing to bind it.
    async fn wait_ready(&mut self, log: &Path) -> Result<(), EtcdServerError> {
        let endpoint = self.endpoint();
        let tls = self.client_tls.clone();
        let started = tokio::time::Instant::now();
        while started.elapsed() < READY_TIMEOUT {
            let probe = tokio::time::timeout(PROBE_TIMEOUT, probe(&endpoint, tls.as_ref())).await;
            // An empty name is a member that has not published its attributes yet: ask again.
            if let Ok(Some(answer)) = probe.map(|a| a.filter(|a| !a.name.is_empty())) {
                if answer.name != self.name {
                    return Err(EtcdServerError::Foreign {
                        endpoint,
                        expected: self.name.clone(),
                        found: answer.describe(),
                    });
                }
                if answer.serves {
                    return Ok(());
                }
            }
            let exited = match self.child.as_mut() {
                Some(child) => child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                self.child = None;
                return Err(EtcdServerError::Exited {
                    endpoint,
                    status: status.to_string(),
                    log_tail: log_tail(log),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(EtcdServerError::NotReady {
            endpoint,
            waited: READY_TIMEOUT,
            log_tail: log_tail(log),
        })
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What answered a probe.
struct Answer {
    /// The answering member's name ("" if it is not in its own member list).
    name: String,
    /// Its member id.
    id: u64,
    /// Whether it has a leader and serves a read.
    serves: bool,
}

impl Answer {
    fn describe(&self) -> String {
        format!("member {:?} (id {:x})", self.name, self.id)
    }
}

/// Asks whoever answers at `endpoint` which member it is (`status` names the member that
/// answered, by id; the member list maps the id to its name), and whether it serves reads.
/// `None` while nothing answers.
async fn probe(endpoint: &str, tls: Option<&EtcdTls>) -> Option<Answer> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(PROBE_TIMEOUT)
        .with_timeout(PROBE_TIMEOUT);
    if let Some(tls) = tls {
        options = options.with_tls(tls.client_config());
    }
    let mut client = Client::connect([endpoint], Some(options)).await.ok()?;
    let status = client.status().await.ok()?;
    let id = status.header()?.member_id();
    let members = client.member_list().await.ok()?;
    let name = members
        .members()
        .iter()
        .find(|m| m.id() == id)
        .map_or_else(String::new, |m| m.name().to_owned());
    let serves = status.leader() != 0 && client.get("/scd/ready-probe", None).await.is_ok();
    Some(Answer { name, id, serves })
}

/// A member name no other harness instance (in this process or another) uses at the same
/// time: the process id tells processes apart, the counter instances within one, and the
/// start time a reused process id.
fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let instance = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "scd-test-{}-{instance}-{:x}",
        std::process::id(),
        nanos % (1 << 48)
    )
}

/// The last few kilobytes of etcd's log, for an error that outlives the log's directory.
fn log_tail(path: &Path) -> String {
    const TAIL: usize = 4096;
    match std::fs::read(path) {
        Ok(bytes) => {
            let tail = &bytes[bytes.len().saturating_sub(TAIL)..];
            String::from_utf8_lossy(tail).trim_end().to_string()
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_within_a_process() {
        let names: std::collections::BTreeSet<String> = (0..100).map(|_| unique_name()).collect();
        assert_eq!(names.len(), 100);
        assert!(names
            .iter()
            .all(|n| n.starts_with(&format!("scd-test-{}-", std::process::id()))));
    }
}
