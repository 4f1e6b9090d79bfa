//! Membership: each node registers `/nodes/<id>` under its own lease and keeps it alive; the
//! [`LiveNodes`] view follows those keys with a read plus a watch from the next revision.
//!
//! A lease can be lost (a pause longer than its TTL, an etcd whose state was wiped, an operator
//! revoking it). [`Registration`] treats that as an event with a recovery path: it grants a new
//! lease and writes the node key again on its own, and says so on its event channel.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::envelope::{self, EnvelopeError};
use crate::keys::{InvalidId, Keys};
use crate::store::{EventKind, LeaseId, MetaStore, StoreError, WatchEvent};
use scd_types::{Mode, NodeId};

/// What a node advertises about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique node id.
    pub id: NodeId,
    /// Where its QUIC endpoint listens (`host:port`).
    pub addr: String,
    /// Base models whose prefill this node runs (it is a producer for them).
    #[serde(default)]
    pub producer_models: Vec<String>,
    /// Expert models this node decodes (it is a consumer for them).
    #[serde(default)]
    pub consumer_models: Vec<String>,
    /// How many jobs it runs at once.
    pub capacity: u32,
    /// How many jobs it runs now.
    #[serde(default)]
    pub load: u32,
    /// Content hashes of the prompt-prefix blocks it holds (see [`crate::prefix`]).
    #[serde(default)]
    pub prefix_hashes: Vec<String>,
    /// The writer version its producer compiles documents with (SemPIC); `None` when it serves
    /// no documents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document_writer: Option<String>,
    /// Ids of the documents it holds compiled by that writer version.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub documents: Vec<String>,
    /// This incarnation of the node: stamped by [`Registration::register`] (the id of the
    /// first lease it was granted) and kept across its re-registrations, so a node restarted
    /// under the same id within the old lease's TTL shows a new epoch, and the jobs recorded
    /// under the old one are known to be lost. `0`: unknown (a record from before epochs).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
    /// A consumer's measured held-out KL of raw transfer from the base, per expert it serves
    /// (from the expert's drift report): what `auto` weighs raw and q4 by.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub transfer_kl: BTreeMap<String, BTreeMap<Mode, f64>>,
    /// A consumer's measured cost of finishing a job, per mode: ms per prompt token from the
    /// last code's arrival (the job's start, in mode oracle: its own prefill) to the first
    /// token, over its recent jobs. What `auto` expects after the transfer.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub finish_ms_per_token: BTreeMap<Mode, f64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl NodeInfo {
    /// A node with an id, an address and a capacity, serving nothing yet.
    pub fn new(id: NodeId, addr: impl Into<String>, capacity: u32) -> Self {
        Self {
            id,
            addr: addr.into(),
            producer_models: Vec::new(),
            consumer_models: Vec::new(),
            capacity,
            load: 0,
            prefix_hashes: Vec::new(),
            document_writer: None,
            documents: Vec::new(),
            epoch: 0,
            transfer_kl: BTreeMap::new(),
            finish_ms_per_token: BTreeMap::new(),
        }
    }
}

/// Errors of membership operations.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// The node id is not a valid key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// The store failed.
    #[error("membership store operation failed: {0}")]
    Store(#[from] StoreError),
    /// The node record could not be encoded.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
}

/// Lease timing of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistrationConfig {
    /// Lease TTL: how long a silent node stays listed.
    pub ttl: Duration,
    /// Renewals per TTL; 3 renews at a third of the TTL, leaving two more tries before expiry.
    pub renewals_per_ttl: u32,
}

impl Default for RegistrationConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            renewals_per_ttl: 3,
        }
    }
}

/// What happened to a registration's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationEvent {
    /// A renewal failed for a reason other than the lease being gone (etcd down, slow, ...).
    RenewalFailed {
        /// Why.
        error: String,
    },
    /// The lease is gone: the node key went with it.
    LeaseLost {
        /// The lost lease.
        lease: LeaseId,
    },
    /// The node registered again under a new lease.
    Reregistered {
        /// The new lease.
        lease: LeaseId,
    },
    /// The node key had vanished while the lease lived (wiped or deleted by hand) and was
    /// written again.
    Restored {
        /// The lease it was written under.
        lease: LeaseId,
    },
}

struct RegShared {
    store: Arc<dyn MetaStore>,
    key: String,
    info: Mutex<NodeInfo>,
    lease: watch::Sender<LeaseId>,
    events: broadcast::Sender<RegistrationEvent>,
}

impl RegShared {
    fn info(&self) -> NodeInfo {
        self.info.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn write(&self, lease: LeaseId) -> Result<(), MembershipError> {
        let value = envelope::encode(&self.info())?;
        self.store.put(&self.key, value, Some(lease)).await?;
        Ok(())
    }

    fn emit(&self, event: RegistrationEvent) {
        tracing::info!(key = self.key, ?event, "registration");
        // Nobody listening is fine.
        let _ = self.events.send(event);
    }
}

/// A node's registration: one lease, kept alive by a background task. Dropping it stops the
/// renewals without revoking (as a crash would: the key goes when the lease expires);
/// [`Registration::deregister`] leaves cleanly.
pub struct Registration {
    shared: Arc<RegShared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.shared.key)
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// Grants a lease, writes the node key under it and starts renewing. An `info` without an
    /// [`NodeInfo::epoch`] gets the lease's id as its epoch: each call is a new incarnation
    /// (re-registrations after a lost lease keep the epoch).
    pub async fn register(
        store: Arc<dyn MetaStore>,
        keys: &Keys,
        mut info: NodeInfo,
        config: RegistrationConfig,
    ) -> Result<Self, MembershipError> {
        let key = keys.node(&info.id)?;
        let lease = store.grant_lease(config.ttl).await?;
        if info.epoch == 0 {
            // Lease ids are unique while the store lives and never 0 (0 is "no lease").
            info.epoch = lease.id.unsigned_abs().max(1);
        }
        let (lease_tx, _) = watch::channel(lease.id);
        let (events, _) = broadcast::channel(64);
        let shared = Arc::new(RegShared {
            store,
            key,
            info: Mutex::new(info),
            lease: lease_tx,
            events,
        });
        shared.write(lease.id).await?;
        let task = tokio::spawn(keep_registered(
            shared.clone(),
            lease.ttl,
            config.renewals_per_ttl.max(2),
        ));
        Ok(Self { shared, task })
    }

    /// The node id.
    pub fn node_id(&self) -> NodeId {
        self.shared.info().id
    }

    /// This incarnation's epoch ([`NodeInfo::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.shared.info().epoch
    }

    /// The lease the node key is under now.
    pub fn lease(&self) -> LeaseId {
        *self.shared.lease.borrow()
    }

    /// Follows lease changes.
    pub fn lease_changes(&self) -> watch::Receiver<LeaseId> {
        self.shared.lease.subscribe()
    }

    /// Lease events (loss, re-registration, failed renewals).
    pub fn subscribe(&self) -> broadcast::Receiver<RegistrationEvent> {
        self.shared.events.subscribe()
    }

    /// The info currently advertised.
    pub fn info(&self) -> NodeInfo {
        self.shared.info()
    }

    /// Changes the advertised info (load, prefixes, ...) and writes it under the current lease.
    /// The change is kept even if the write fails, and goes out with the next re-registration.
    pub async fn update(&self, change: impl FnOnce(&mut NodeInfo)) -> Result<(), MembershipError> {
        {
            let mut info = self.shared.info.lock().unwrap_or_else(|p| p.into_inner());
            let (id, epoch) = (info.id.clone(), info.epoch);
            change(&mut info);
            // The key is derived from the id; it cannot move. The epoch is the incarnation's.
            info.id = id;
            info.epoch = epoch;
        }
        match self.shared.write(self.lease()).await {
            // The renewal task notices the loss and re-registers with the new info.
            Err(MembershipError::Store(StoreError::LeaseNotFound(_))) => Ok(()),
            other => other,
        }
    }

    /// Stops renewing and revokes the lease, removing the node key now.
    pub async fn deregister(self) -> Result<(), MembershipError> {
        self.leave().await
    }

    /// [`Registration::deregister`] for a registration that is shared: the renewals stop and
    /// the lease is revoked; later updates fail with the lease gone.
    pub async fn leave(&self) -> Result<(), MembershipError> {
        self.task.abort();
        match self.shared.store.revoke_lease(self.lease()).await {
            Ok(()) | Err(StoreError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep_registered(shared: Arc<RegShared>, ttl: Duration, renewals_per_ttl: u32) {
    let period = ttl / renewals_per_ttl;
    // A renewal slower than this is abandoned and retried; the lease still has a margin left.
    let attempt_limit = ttl / 2;
    let retry = (period / 3).max(Duration::from_millis(50));
    let mut troubled = false;
    let mut next = Instant::now() + period;
    loop {
        tokio::time::sleep_until(next).await;
        let lease = *shared.lease.borrow();
        let started = Instant::now();
        let outcome = tokio::time::timeout(attempt_limit, shared.store.keep_alive(lease)).await;
        match outcome {
            Ok(Ok(_)) => {
                if troubled {
                    // After an outage, make sure the key itself survived (a wiped or restored
                    // etcd can keep a lease but not the key, or the other way round).
                    troubled = !restore_key(&shared, lease).await;
                }
                next = started + period;
            }
            Ok(Err(StoreError::LeaseNotFound(_))) => {
                shared.emit(RegistrationEvent::LeaseLost { lease });
                reregister(&shared, ttl, retry).await;
                troubled = false;
                next = Instant::now() + period;
            }
            Ok(Err(e)) => {
                shared.emit(RegistrationEvent::RenewalFailed {
                    error: e.to_string(),
                });
                troubled = true;
                next = Instant::now() + retry;
            }
            Err(_) => {
                shared.emit(RegistrationEvent::RenewalFailed {
                    error: format!("renewal took over {attempt_limit:?}"),
                });
                troubled = true;
                next = Instant::now() + retry;
            }
        }
    }
}

/// Writes the node key again if it vanished; returns whether the key is known to be in place.
async fn restore_key(shared: &RegShared, lease: LeaseId) -> bool {
    match shared.store.get(&shared.key).await {
        Ok(Some(kv)) if kv.lease == lease => true,
        Ok(_) => match shared.write(lease).await {
            Ok(()) => {
                shared.emit(RegistrationEvent::Restored { lease });
                true
            }
            Err(e) => {
                tracing::warn!(key = shared.key, error = %e, "restoring node key failed");
                false
            }
        },
        Err(e) => {
            tracing::warn!(key = shared.key, error = %e, "checking node key failed");
            false
        }
    }
}

/// Grants a new lease and writes the node key under it, retrying with capped backoff until it
/// works: a node without a registration is invisible, so there is nothing better to do.
async fn reregister(shared: &RegShared, ttl: Duration, first_backoff: Duration) {
    let mut backoff = first_backoff;
    loop {
        match shared.store.grant_lease(ttl).await {
            Ok(lease) => match shared.write(lease.id).await {
                Ok(()) => {
                    shared.lease.send_replace(lease.id);
                    shared.emit(RegistrationEvent::Reregistered { lease: lease.id });
                    return;
                }
                Err(e) => {
                    tracing::warn!(key = shared.key, error = %e, "re-registering failed");
                    let _ = shared.store.revoke_lease(lease.id).await;
                }
            },
            Err(e) => tracing::warn!(key = shared.key, error = %e, "granting a new lease failed"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(ttl / 2).max(first_backoff);
    }
}

/// The set of live nodes, by id, kept current by a watch.
pub type NodeMap = BTreeMap<NodeId, NodeInfo>;

/// A live view of `/nodes/`: a read, then a watch from the next revision; after compaction, a
/// history reset, or every minute, it reads again. Dropping it stops the watch.
pub struct LiveNodes {
    rx: watch::Receiver<NodeMap>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for LiveNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveNodes")
            .field("nodes", &*self.rx.borrow())
            .finish_non_exhaustive()
    }
}

impl LiveNodes {
    /// Reads the current members and starts following changes.
    pub async fn start(store: Arc<dyn MetaStore>, keys: &Keys) -> Result<Self, MembershipError> {
        let prefix = keys.nodes_prefix();
        let (nodes, revision) = list_nodes(store.as_ref(), &prefix).await?;
        let (tx, rx) = watch::channel(nodes);
        let task = tokio::spawn(follow_nodes(store, prefix, revision, tx));
        Ok(Self { rx, task })
    }

    /// The members now.
    pub fn snapshot(&self) -> NodeMap {
        self.rx.borrow().clone()
    }

    /// A receiver that is told about every change.
    pub fn subscribe(&self) -> watch::Receiver<NodeMap> {
        self.rx.clone()
    }

    /// Waits until the members satisfy `condition`, and returns them.
    pub async fn wait_for(&self, mut condition: impl FnMut(&NodeMap) -> bool) -> NodeMap {
        let mut rx = self.rx.clone();
        // The follower task never drops its sender while `self` lives.
        let found = rx.wait_for(|m| condition(m)).await.map(|m| m.clone());
        found.unwrap_or_else(|_| self.snapshot())
    }
}

impl Drop for LiveNodes {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn list_nodes(
    store: &dyn MetaStore,
    prefix: &str,
) -> Result<(NodeMap, i64), MembershipError> {
    let listing = store.get_prefix(prefix).await?;
    let mut nodes = NodeMap::new();
    for kv in listing.kvs {
        let Some(id) = node_id_under(prefix, &kv.key) else {
            continue;
        };
        match envelope::decode::<NodeInfo>(&kv.key, &kv.value) {
            Ok(info) => {
                nodes.insert(id, info);
            }
            Err(e) => tracing::warn!(error = %e, "ignoring unreadable node record"),
        }
    }
    Ok((nodes, listing.revision))
}

/// Even a watch that never fails is re-read now and then: a full read is cheap for the node set,
/// and it bounds how long any missed change (an etcd restored from a backup behind our revision,
/// say) can linger in the view.
const RESYNC_EVERY: Duration = Duration::from_secs(60);

async fn follow_nodes(
    store: Arc<dyn MetaStore>,
    prefix: String,
    mut revision: i64,
    tx: watch::Sender<NodeMap>,
) {
    loop {
        match store.watch_prefix(&prefix, revision + 1).await {
            Ok(mut stream) => {
                let resync = tokio::time::sleep(RESYNC_EVERY);
                tokio::pin!(resync);
                loop {
                    let event = tokio::select! {
                        event = stream.next() => event,
                        _ = &mut resync => break,
                    };
                    match event {
                        Some(Ok(event)) => apply_node_event(&prefix, event, &tx),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "node watch lost its history; reading again");
                            break;
                        }
                        None => break,
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "watching nodes failed; retrying"),
        }
        // Re-read until it works, then watch again from there.
        loop {
            match list_nodes(store.as_ref(), &prefix).await {
                Ok((nodes, rev)) => {
                    revision = rev;
                    tx.send_if_modified(|m| {
                        let changed = *m != nodes;
                        *m = nodes;
                        changed
                    });
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "listing nodes failed; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }
}

/// The node a key under `prefix` names; `None` (and a warning) for a key that names none.
fn node_id_under(prefix: &str, key: &str) -> Option<NodeId> {
    let id = Keys::id_under(prefix, key)?;
    NodeId::new(id)
        .inspect_err(|e| tracing::warn!(key, error = %e, "ignoring a node key"))
        .ok()
}

fn apply_node_event(prefix: &str, event: WatchEvent, tx: &watch::Sender<NodeMap>) {
    let Some(id) = node_id_under(prefix, &event.kv.key) else {
        return;
    };
    match event.kind {
        EventKind::Put => match envelope::decode::<NodeInfo>(&event.kv.key, &event.kv.value) {
            Ok(info) => {
                tx.send_modify(|m| {
                    m.insert(id, info);
                });
            }
            Err(e) => tracing::warn!(error = %e, "ignoring unreadable node record"),
        },
        EventKind::Delete => {
            tx.send_if_modified(|m| m.remove(&id).is_some());
        }
    }
}
