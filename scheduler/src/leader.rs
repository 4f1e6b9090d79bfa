//! Leader election among scheduler replicas with a lease-backed lock: the election key is
//! created only if absent, under the candidate's lease. Whoever created it leads until the key
//! goes (resignation, or the lease expiring when the leader dies); the others watch the key and
//! campaign again when it is deleted.
//!
//! A leader can be deposed without noticing at once (a long pause). Every write the leader makes
//! therefore carries [`LeaderGuard::compare`]: the transaction only applies while the election
//! key is still the incarnation this leader created, so at most one leader's writes land.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::keys::{InvalidId, Keys};
use crate::store::{Compare, EventKind, Lease, MetaStore, StoreError, Txn, TxnOp};

/// The fencing token of one term of leadership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderGuard {
    /// The election key.
    pub key: String,
    /// The revision at which this leader created it.
    pub create_revision: i64,
}

impl LeaderGuard {
    /// The condition to add to every write made as leader.
    pub fn compare(&self) -> Compare {
        Compare::create_revision(self.key.clone(), self.create_revision)
    }
}

/// A candidate's view of the election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// Someone else leads (or nobody, for a moment).
    Follower {
        /// The leader's id when known.
        leader: Option<String>,
    },
    /// This candidate leads.
    Leader(LeaderGuard),
}

impl Leadership {
    /// Whether this is leadership.
    pub fn is_leader(&self) -> bool {
        matches!(self, Leadership::Leader(_))
    }
}

/// Errors starting an election.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    /// The election name or candidate id cannot be a key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
}

/// Election timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElectionConfig {
    /// TTL of the candidate's lease: how long a dead leader blocks a new one.
    pub ttl: Duration,
}

impl Default for ElectionConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
        }
    }
}

/// One scheduler replica taking part in an election. Dropping it stops campaigning without
/// revoking its lease (as a crash would); [`Candidate::resign`] hands over at once.
pub struct Candidate {
    id: String,
    state: watch::Receiver<Leadership>,
    lease: watch::Receiver<Option<i64>>,
    store: Arc<dyn MetaStore>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Candidate")
            .field("id", &self.id)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl Candidate {
    /// Starts campaigning for `name` (the scheduler's election is `"scheduler"`).
    pub fn start(
        store: Arc<dyn MetaStore>,
        keys: &Keys,
        name: &str,
        candidate_id: &str,
        config: ElectionConfig,
    ) -> Result<Self, ElectionError> {
        let key = keys.election(name)?;
        crate::keys::check_id("candidate id", candidate_id)?;
        let (state_tx, state) = watch::channel(Leadership::Follower { leader: None });
        let (lease_tx, lease) = watch::channel(None);
        let campaign = Campaign {
            store: store.clone(),
            key,
            id: candidate_id.to_string(),
            ttl: config.ttl,
            state: state_tx,
            lease: lease_tx,
        };
        let task = tokio::spawn(campaign.run());
        Ok(Self {
            id: candidate_id.to_string(),
            state,
            lease,
            store,
            task,
        })
    }

    /// This candidate's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether this candidate leads now.
    pub fn is_leader(&self) -> bool {
        self.state.borrow().is_leader()
    }

    /// The current view.
    pub fn leadership(&self) -> Leadership {
        self.state.borrow().clone()
    }

    /// The fencing guard while leading.
    pub fn guard(&self) -> Option<LeaderGuard> {
        match &*self.state.borrow() {
            Leadership::Leader(g) => Some(g.clone()),
            Leadership::Follower { .. } => None,
        }
    }

    /// Follows leadership changes.
    pub fn subscribe(&self) -> watch::Receiver<Leadership> {
        self.state.clone()
    }

    /// The candidate's current lease (tests use it to simulate a lost lease).
    pub fn lease(&self) -> Option<i64> {
        *self.lease.borrow()
    }

    /// Waits until this candidate leads and returns its guard.
    pub async fn wait_until_leader(&self) -> LeaderGuard {
        let mut rx = self.state.clone();
        loop {
            if let Leadership::Leader(g) = &*rx.borrow_and_update() {
                return g.clone();
            }
            if rx.changed().await.is_err() {
                // The campaign task ended (only when aborted); wait forever like a follower.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops campaigning and revokes the lease, so another candidate can lead at once.
    pub async fn resign(&self) -> Result<(), StoreError> {
        self.task.abort();
        let lease = *self.lease.borrow();
        if let Some(lease) = lease {
            match self.store.revoke_lease(lease).await {
                Ok(()) | Err(StoreError::LeaseNotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Campaign {
    store: Arc<dyn MetaStore>,
    key: String,
    id: String,
    ttl: Duration,
    state: watch::Sender<Leadership>,
    lease: watch::Sender<Option<i64>>,
}

/// Why a term (or a wait) ended.
enum Next {
    /// Try to take the key again with the same lease.
    Campaign,
    /// The lease is gone: get a new one first.
    NewLease,
}

impl Campaign {
    async fn run(self) {
        let retry = Duration::from_millis(200);
        loop {
            let lease = match self.store.grant_lease(self.ttl).await {
                Ok(lease) => lease,
                Err(e) => {
                    tracing::warn!(key = self.key, error = %e, "election: granting a lease failed");
                    tokio::time::sleep(retry).await;
                    continue;
                }
            };
            self.lease.send_replace(Some(lease.id));
            loop {
                let next = match self.try_acquire(lease).await {
                    Ok(Some(guard)) => {
                        tracing::info!(key = self.key, id = self.id, "became leader");
                        self.state.send_replace(Leadership::Leader(guard.clone()));
                        let next = self.lead(lease, &guard).await;
                        self.state
                            .send_replace(Leadership::Follower { leader: None });
                        tracing::info!(key = self.key, id = self.id, "stepped down");
                        next
                    }
                    Ok(None) => self.follow(lease).await,
                    Err(StoreError::LeaseNotFound(_)) => Next::NewLease,
                    Err(e) => {
                        tracing::warn!(key = self.key, error = %e, "election: campaign failed");
                        tokio::time::sleep(retry).await;
                        Next::Campaign
                    }
                };
                if let Next::NewLease = next {
                    break;
                }
            }
        }
    }

    /// Creates the key if absent; also recognises a key this candidate already holds (after an
    /// outage it may have stepped down while its key survived).
    async fn try_acquire(&self, lease: Lease) -> Result<Option<LeaderGuard>, StoreError> {
        let txn = Txn::new()
            .when([Compare::absent(self.key.clone())])
            .and_then([TxnOp::put_with_lease(
                self.key.clone(),
                self.id.as_bytes().to_vec(),
                lease.id,
            )]);
        let outcome = self.store.txn(txn).await?;
        if outcome.succeeded {
            return Ok(Some(LeaderGuard {
                key: self.key.clone(),
                create_revision: outcome.revision,
            }));
        }
        match self.store.get(&self.key).await? {
            Some(kv) if kv.lease == lease.id => Ok(Some(LeaderGuard {
                key: self.key.clone(),
                create_revision: kv.create_revision,
            })),
            _ => Ok(None),
        }
    }

    /// Leads until the key is gone or the lease cannot be shown to be alive.
    async fn lead(&self, lease: Lease, guard: &LeaderGuard) -> Next {
        let period = lease.ttl / 3;
        // Without a successful renewal for this long, the lease may have expired unseen:
        // stop acting before the other candidates can have taken over.
        let trust = lease.ttl * 2 / 3;
        let mut last_ok = Instant::now();
        let mut watch = match self
            .store
            .watch_prefix(&self.key, guard.create_revision + 1)
            .await
        {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "election: watching the key failed");
                None
            }
        };
        let mut next_renewal = Instant::now() + period;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_renewal) => {
                    match tokio::time::timeout(period, self.store.keep_alive(lease.id)).await {
                        Ok(Ok(_)) => {
                            last_ok = Instant::now();
                            next_renewal = last_ok + period;
                            // A key lost while its lease lives (wiped by hand) also ends a term.
                            match self.store.get(&self.key).await {
                                Ok(Some(kv)) if kv.create_revision == guard.create_revision => {}
                                Ok(_) => return Next::Campaign,
                                Err(_) => {}
                            }
                        }
                        Ok(Err(StoreError::LeaseNotFound(_))) => return Next::NewLease,
                        Ok(Err(_)) | Err(_) => {
                            next_renewal = Instant::now() + period / 3;
                        }
                    }
                    if last_ok.elapsed() >= trust {
                        tracing::warn!(key = self.key, "leader could not renew its lease in time; stepping down");
                        return Next::Campaign;
                    }
                }
                event = next_event(&mut watch) => match event {
                    Some(Ok(e)) if e.kv.key == self.key => {
                        let ours = e.kind == EventKind::Put && e.kv.create_revision == guard.create_revision;
                        if !ours {
                            return Next::Campaign;
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => {
                        // Lost the watch: the renewal branch's read still checks the key.
                        watch = None;
                    }
                },
            }
        }
    }

    /// Waits, keeping the lease alive, until the key is deleted.
    async fn follow(&self, lease: Lease) -> Next {
        let period = lease.ttl / 3;
        let (leader, revision) = match self.store.get_prefix(&self.key).await {
            Ok(listing) => {
                let kv = listing.kvs.into_iter().find(|kv| kv.key == self.key);
                match kv {
                    Some(kv) => (
                        Some(String::from_utf8_lossy(&kv.value).into_owned()),
                        listing.revision,
                    ),
                    None => return Next::Campaign,
                }
            }
            Err(_) => {
                tokio::time::sleep(period / 3).await;
                return Next::Campaign;
            }
        };
        self.state.send_replace(Leadership::Follower { leader });
        let mut watch = self.store.watch_prefix(&self.key, revision + 1).await.ok();
        let mut next_renewal = Instant::now() + period;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_renewal) => {
                    match tokio::time::timeout(period, self.store.keep_alive(lease.id)).await {
                        Ok(Err(StoreError::LeaseNotFound(_))) => return Next::NewLease,
                        _ => next_renewal = Instant::now() + period,
                    }
                    if watch.is_none() {
                        // No watch to tell us: poll by campaigning again.
                        return Next::Campaign;
                    }
                }
                event = next_event(&mut watch) => match event {
                    Some(Ok(e)) if e.kv.key == self.key => match e.kind {
                        EventKind::Delete => return Next::Campaign,
                        EventKind::Put => {
                            let leader = String::from_utf8_lossy(&e.kv.value).into_owned();
                            self.state.send_replace(Leadership::Follower { leader: Some(leader) });
                        }
                    },
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => return Next::Campaign,
                },
            }
        }
    }
}

async fn next_event(
    watch: &mut Option<crate::store::WatchStream>,
) -> Option<Result<crate::store::WatchEvent, StoreError>> {
    match watch {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}
