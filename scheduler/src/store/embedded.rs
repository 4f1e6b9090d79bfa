//! An in-process `MetaStore` for the one-process default: a sorted map with etcd's revision
//! bookkeeping, leases whose expiry is driven by tokio's clock, and watches that read a bounded
//! event history (so a watch can start from a past revision, and compaction behaves like etcd's).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::{
    ttl_secs, Compare, CompareTarget, EventKind, KeyValue, Lease, LeaseId, Listing, MetaStore,
    StoreError, Txn, TxnOp, TxnOutcome, WatchEvent, WatchStream, WATCH_CHANNEL_CAPACITY,
};

/// Events kept for watches that start in the past; older ones are compacted automatically.
const DEFAULT_HISTORY: usize = 10_000;
/// How often expired leases are looked for.
const REAP_EVERY: Duration = Duration::from_millis(50);

/// The embedded store. Cheap to clone; clones share one state.
#[derive(Clone)]
pub struct EmbeddedStore {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    revision_tx: watch::Sender<i64>,
}

struct LeaseEntry {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct State {
    kvs: BTreeMap<String, KeyValue>,
    revision: i64,
    compact_revision: i64,
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    leases: HashMap<LeaseId, LeaseEntry>,
    next_lease: LeaseId,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore").finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// A new, empty store that keeps the last 10 000 events for watches.
    ///
    /// # Panics
    /// Outside a tokio runtime: it spawns the task that expires leases (the task ends when the
    /// last clone is dropped).
    pub fn new() -> Self {
        Self::with_history(DEFAULT_HISTORY)
    }

    /// A store that keeps at most `events` past events for watches (at least one).
    pub fn with_history(events: usize) -> Self {
        let (revision_tx, _) = watch::channel(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                kvs: BTreeMap::new(),
                // etcd starts at revision 1 with an empty keyspace.
                revision: 1,
                compact_revision: 0,
                history: VecDeque::new(),
                history_limit: events.max(1),
                leases: HashMap::new(),
                next_lease: 0x5cd0_0000_0000,
            }),
            revision_tx,
        });
        tokio::spawn(reap_leases(Arc::downgrade(&shared)));
        Self { shared }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }
}

impl Default for EmbeddedStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way later
        // readers would trip on (every write is applied after all checks), so keep going.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish(&self, revision: i64) {
        self.revision_tx.send_replace(revision);
    }
}

async fn reap_leases(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(REAP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        let revision = {
            let mut state = shared.lock();
            let expired: Vec<LeaseId> = state
                .leases
                .iter()
                .filter(|(_, l)| l.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            let before = state.revision;
            for id in expired {
                state.drop_lease(id);
            }
            (state.revision != before).then_some(state.revision)
        };
        if let Some(revision) = revision {
            shared.publish(revision);
        }
    }
}

impl State {
    fn compare_holds(&self, compare: &Compare) -> bool {
        let kv = self.kvs.get(&compare.key);
        match &compare.target {
            CompareTarget::Version(v) => kv.map_or(0, |kv| kv.version) == *v,
            CompareTarget::ModRevision(r) => kv.map_or(0, |kv| kv.mod_revision) == *r,
            CompareTarget::CreateRevision(r) => kv.map_or(0, |kv| kv.create_revision) == *r,
            // etcd compares a missing key's value as failing.
            CompareTarget::Value(v) => kv.is_some_and(|kv| &kv.value == v),
        }
    }

    fn lease_alive(&self, lease: LeaseId) -> bool {
        self.leases
            .get(&lease)
            .is_some_and(|l| l.deadline > Instant::now())
    }

    /// Applies writes at one new revision (only when something changes, as etcd does).
    fn apply(&mut self, ops: &[TxnOp]) -> Result<(), StoreError> {
        for op in ops {
            let (TxnOp::Put { key, .. } | TxnOp::Delete { key }) = op;
            if key.is_empty() {
                return Err(StoreError::Invalid("empty key".into()));
            }
            if let TxnOp::Put {
                lease: Some(lease), ..
            } = op
            {
                if !self.lease_alive(*lease) {
                    return Err(StoreError::LeaseNotFound(*lease));
                }
            }
        }
        let writes = ops.iter().any(|op| match op {
            TxnOp::Put { .. } => true,
            TxnOp::Delete { key } => self.kvs.contains_key(key),
        });
        if !writes {
            return Ok(());
        }
        self.revision += 1;
        let revision = self.revision;
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => {
                    let lease = lease.unwrap_or(0);
                    let previous = self.kvs.get(key);
                    let (create_revision, version, old_lease) = match previous {
                        Some(p) => (p.create_revision, p.version + 1, p.lease),
                        None => (revision, 1, 0),
                    };
                    if old_lease != 0 && old_lease != lease {
                        if let Some(l) = self.leases.get_mut(&old_lease) {
                            l.keys.remove(key);
                        }
                    }
                    if let Some(l) = self.leases.get_mut(&lease) {
                        l.keys.insert(key.clone());
                    }
                    let kv = KeyValue {
                        key: key.clone(),
                        value: value.clone(),
                        create_revision,
                        mod_revision: revision,
                        version,
                        lease,
                    };
                    self.kvs.insert(key.clone(), kv.clone());
                    self.record(WatchEvent {
                        kind: EventKind::Put,
                        kv,
                    });
                }
                TxnOp::Delete { key } => self.remove_key(key, revision),
            }
        }
        Ok(())
    }

    fn remove_key(&mut self, key: &str, revision: i64) {
        if let Some(old) = self.kvs.remove(key) {
            if let Some(l) = self.leases.get_mut(&old.lease) {
                l.keys.remove(key);
            }
            self.record(WatchEvent {
                kind: EventKind::Delete,
                kv: KeyValue {
                    key: old.key,
                    value: Vec::new(),
                    create_revision: 0,
                    mod_revision: revision,
                    version: 0,
                    lease: 0,
                },
            });
        }
    }

    /// Removes a lease and, at one revision, every key attached to it.
    fn drop_lease(&mut self, id: LeaseId) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        let live: Vec<&String> = lease
            .keys
            .iter()
            .filter(|k| self.kvs.contains_key(*k))
            .collect();
        if !live.is_empty() {
            self.revision += 1;
            let revision = self.revision;
            for key in lease.keys.iter() {
                self.remove_key(key, revision);
            }
        }
        true
    }

    fn record(&mut self, event: WatchEvent) {
        self.history.push_back(event);
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compact_revision = self.compact_revision.max(dropped.kv.mod_revision + 1);
            }
        }
        // Events of one revision go together: never keep half of a revision.
        while self
            .history
            .front()
            .is_some_and(|e| e.kv.mod_revision < self.compact_revision)
        {
            self.history.pop_front();
        }
    }

    /// Events under `prefix` from `from` on, or `Compacted` when that history is gone.
    fn events_since(&self, prefix: &str, from: i64) -> Result<Vec<WatchEvent>, StoreError> {
        if from < self.compact_revision {
            return Err(StoreError::Compacted {
                requested: from,
                compact_revision: self.compact_revision,
            });
        }
        let start = self.history.partition_point(|e| e.kv.mod_revision < from);
        Ok(self
            .history
            .iter()
            .skip(start)
            .filter(|e| e.kv.key.starts_with(prefix))
            .cloned()
            .collect())
    }
}

#[async_trait]
impl MetaStore for EmbeddedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        Ok(self.lock().kvs.get(key).cloned())
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Listing, StoreError> {
        let state = self.lock();
        let kvs = state
            .kvs
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, kv)| kv.clone())
            .collect();
        Ok(Listing {
            kvs,
            revision: state.revision,
        })
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<i64, StoreError> {
        let revision = {
            let mut state = self.lock();
            state.apply(&[TxnOp::Put {
                key: key.to_string(),
                value,
                lease,
            }])?;
            state.revision
        };
        self.shared.publish(revision);
        Ok(revision)
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let (existed, revision) = {
            let mut state = self.lock();
            let existed = state.kvs.contains_key(key);
            state.apply(&[TxnOp::delete(key)])?;
            (existed, state.revision)
        };
        self.shared.publish(revision);
        Ok(existed)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        let outcome = {
            let mut state = self.lock();
            let succeeded = txn.compares.iter().all(|c| state.compare_holds(c));
            state.apply(if succeeded {
                &txn.success
            } else {
                &txn.failure
            })?;
            TxnOutcome {
                succeeded,
                revision: state.revision,
            }
        };
        self.shared.publish(outcome.revision);
        Ok(outcome)
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease, StoreError> {
        let ttl = Duration::from_secs(ttl_secs(ttl).unsigned_abs());
        let mut state = self.lock();
        state.next_lease += 1;
        let id = state.next_lease;
        state.leases.insert(
            id,
            LeaseEntry {
                ttl,
                deadline: Instant::now() + ttl,
                keys: BTreeSet::new(),
            },
        );
        Ok(Lease { id, ttl })
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        let now = Instant::now();
        let mut state = self.lock();
        match state.leases.get_mut(&lease) {
            Some(l) if l.deadline > now => {
                l.deadline = now + l.ttl;
                Ok(l.ttl)
            }
            Some(_) => {
                // Expired but not reaped yet: reap now so the keys go with the answer.
                state.drop_lease(lease);
                let revision = state.revision;
                drop(state);
                self.shared.publish(revision);
                Err(StoreError::LeaseNotFound(lease))
            }
            None => Err(StoreError::LeaseNotFound(lease)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let revision = {
            let mut state = self.lock();
            if !state.drop_lease(lease) {
                return Err(StoreError::LeaseNotFound(lease));
            }
            state.revision
        };
        self.shared.publish(revision);
        Ok(())
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: i64,
    ) -> Result<WatchStream, StoreError> {
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL_CAPACITY);
        let mut next = if from_revision <= 0 {
            self.lock().revision + 1
        } else {
            from_revision
        };
        let shared = Arc::downgrade(&self.shared);
        let mut revisions = self.shared.revision_tx.subscribe();
        let prefix = prefix.to_string();
        let driver = tokio::spawn(async move {
            loop {
                revisions.borrow_and_update();
                let batch = {
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    let state = shared.lock();
                    let batch = state.events_since(&prefix, next);
                    if batch.is_ok() {
                        next = state.revision + 1;
                    }
                    batch
                };
                match batch {
                    Ok(events) => {
                        for event in events {
                            if tx.send(Ok(event)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
                tokio::select! {
                    changed = revisions.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(WatchStream::new(rx, driver))
    }

    async fn compact(&self, revision: i64) -> Result<(), StoreError> {
        let mut state = self.lock();
        if revision > state.revision {
            return Err(StoreError::Invalid(format!(
                "cannot compact at future revision {revision} (current {})",
                state.revision
            )));
        }
        if revision <= state.compact_revision {
            return Err(StoreError::Compacted {
                requested: revision,
                compact_revision: state.compact_revision,
            });
        }
        state.compact_revision = revision;
        while state
            .history
            .front()
            .is_some_and(|e| e.kv.mod_revision < revision)
        {
            state.history.pop_front();
        }
        Ok(())
    }
}
