//! The `MetaStore` trait: the small part of etcd's API that scd relies on, with the types that
//! travel through it. Two implementations share these semantics exactly: [`EtcdStore`] and
//! [`EmbeddedStore`]; one test suite (`tests/integration/store_suite.rs`) runs against both. With feature
//! `test-util`, [`HookedStore`] wraps either to inject the faults tests need.

mod embedded;
mod etcd;
#[cfg(feature = "test-util")]
mod hooked;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use embedded::EmbeddedStore;
pub use etcd::{EtcdStore, EtcdTls};
#[cfg(feature = "test-util")]
pub use hooked::{Hook, HookedStore};

/// A lease id as etcd hands it out.
pub type LeaseId = i64;

/// Capacity of the channel between a watch's driver task and its consumer: a slow consumer
/// holds the driver back rather than growing memory without bound.
pub const WATCH_CHANNEL_CAPACITY: usize = 256;

/// One key with its value and etcd's bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value (empty in a delete event).
    pub value: Vec<u8>,
    /// Revision at which the key was created (0 in a delete event).
    pub create_revision: i64,
    /// Revision of the last change (of the deletion, in a delete event).
    pub mod_revision: i64,
    /// Number of writes since creation (0 in a delete event).
    pub version: i64,
    /// Lease the key is attached to, 0 for none.
    pub lease: LeaseId,
}

/// The keys under a prefix, read at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    /// The keys, sorted.
    pub kvs: Vec<KeyValue>,
    /// The store's revision when the read happened: watch from `revision + 1` to miss nothing.
    pub revision: i64,
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL actually granted (etcd may raise a short one to its minimum).
    pub ttl: Duration,
}

/// What a transaction compares, always for equality.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareTarget {
    /// The key's version; 0 means "the key does not exist".
    Version(i64),
    /// The key's last modification revision; 0 means "the key does not exist".
    ModRevision(i64),
    /// The key's creation revision.
    CreateRevision(i64),
    /// The key's exact value.
    Value(Vec<u8>),
}

/// One condition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    /// The key compared.
    pub key: String,
    /// What it must equal.
    pub target: CompareTarget,
}

impl Compare {
    /// The key must not exist (create-if-absent).
    pub fn absent(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            target: CompareTarget::Version(0),
        }
    }

    /// The key must still be at this modification revision (compare-and-swap).
    pub fn mod_revision(key: impl Into<String>, revision: i64) -> Self {
        Self {
            key: key.into(),
            target: CompareTarget::ModRevision(revision),
        }
    }

    /// The key must have been created at this revision (it is the same incarnation).
    pub fn create_revision(key: impl Into<String>, revision: i64) -> Self {
        Self {
            key: key.into(),
            target: CompareTarget::CreateRevision(revision),
        }
    }

    /// The key must hold exactly this value.
    pub fn value(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            target: CompareTarget::Value(value.into()),
        }
    }
}

/// One write inside a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    /// Put a value, optionally under a lease.
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// The lease to attach, if any.
        lease: Option<LeaseId>,
    },
    /// Delete a key (a no-op when absent).
    Delete {
        /// The key.
        key: String,
    },
}

impl TxnOp {
    /// A put without a lease.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    /// A put attached to a lease.
    pub fn put_with_lease(
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> Self {
        Self::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    /// A delete.
    pub fn delete(key: impl Into<String>) -> Self {
        Self::Delete { key: key.into() }
    }
}

/// A transaction: if every compare holds, apply `success`, otherwise `failure`, atomically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// Conditions, all of which must hold.
    pub compares: Vec<Compare>,
    /// Writes applied when they hold.
    pub success: Vec<TxnOp>,
    /// Writes applied when they do not.
    pub failure: Vec<TxnOp>,
}

impl Txn {
    /// An empty transaction.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds conditions.
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(compares);
        self
    }

    /// Adds writes for the success branch.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.success.extend(ops);
        self
    }

    /// Adds writes for the failure branch.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.failure.extend(ops);
        self
    }
}

/// The result of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Whether the compares held (and `success` was applied).
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: i64,
}

/// Kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A key was created or changed.
    Put,
    /// A key was deleted (or its lease expired).
    Delete,
}

/// One change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after the change; for a delete, the key with the deletion's revision.
    pub kv: KeyValue,
}

/// Errors of store operations.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// etcd could not be reached or refused the request.
    #[error(
        "etcd {op} failed: {source} (is etcd running and reachable at the configured endpoints? over TLS, do it and this node take each other's certificates: [store] ca, cert, key?)"
    )]
    Etcd {
        /// The operation that failed.
        op: &'static str,
        /// What etcd-client reported.
        #[source]
        source: etcd_client::Error,
    },
    /// The lease expired or was revoked; keys written under it are gone.
    #[error("lease {0:#x} not found: it expired or was revoked")]
    LeaseNotFound(LeaseId),
    /// A watch asked for history that compaction has already removed.
    #[error("revision {requested} has been compacted (oldest available is {compact_revision}); re-read and watch again")]
    Compacted {
        /// The revision asked for.
        requested: i64,
        /// The oldest revision still available.
        compact_revision: i64,
    },
    /// The store's revision went backwards (etcd restored or recreated without its data): a
    /// watch cannot resume and its consumer must read everything again.
    #[error("the store's history was reset: it is at revision {found}, behind the {expected} already seen; re-read and watch again")]
    HistoryReset {
        /// The last revision delivered.
        expected: i64,
        /// The store's revision now.
        found: i64,
    },
    /// The store returned a key that is not UTF-8 (scd only writes UTF-8 keys).
    #[error("key is not valid UTF-8: {0:?}")]
    NonUtf8Key(Vec<u8>),
    /// The request itself was wrong (a future revision, an empty key, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The operation did not finish in time.
    #[error("etcd {op} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The limit.
        after: Duration,
    },
}

impl StoreError {
    /// Whether the error says the store was unreachable or slow, rather than that the request
    /// was wrong: the same request may succeed once etcd is back.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Etcd { .. } | StoreError::Timeout { .. })
    }
}

/// A stream of watch events, fed by a driver task through a bounded channel. The driver resumes
/// from the last seen revision after a transport error; the only errors it yields are
/// [`StoreError::Compacted`] and [`StoreError::HistoryReset`], after which the stream ends and
/// the consumer reads again. Dropping it stops the driver.
pub struct WatchStream {
    rx: mpsc::Receiver<Result<WatchEvent, StoreError>>,
    driver: JoinHandle<()>,
}

impl WatchStream {
    pub(crate) fn new(
        rx: mpsc::Receiver<Result<WatchEvent, StoreError>>,
        driver: JoinHandle<()>,
    ) -> Self {
        Self { rx, driver }
    }

    /// The next event; `None` once the stream has ended.
    pub async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        self.rx.recv().await
    }
}

impl fmt::Debug for WatchStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchStream").finish_non_exhaustive()
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The cluster-state store: etcd, or an in-process store with the same semantics.
#[async_trait]
pub trait MetaStore: Send + Sync + fmt::Debug {
    /// Reads one key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;

    /// Reads every key under a prefix, with the revision of the read. The listing is
    /// consistent (every key as of that one revision) however large it is: etcd's is read in
    /// pages pinned to the first page's revision, so no response outgrows the client's 4 MiB
    /// receive limit.
    async fn get_prefix(&self, prefix: &str) -> Result<Listing, StoreError>;

    /// The at most `limit` keys under a prefix created last (highest creation revision), newest
    /// first, with the revision of the read: what a "latest N" view needs without reading the
    /// whole prefix. etcd's may return fewer when `limit` keys would not fit one response.
    async fn get_prefix_newest(&self, prefix: &str, limit: usize) -> Result<Listing, StoreError> {
        let mut listing = self.get_prefix(prefix).await?;
        listing
            .kvs
            .sort_by_key(|kv| std::cmp::Reverse(kv.create_revision));
        listing.kvs.truncate(limit);
        Ok(listing)
    }

    /// Writes a key, optionally under a lease; returns the new revision.
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<i64, StoreError>;

    /// Deletes a key; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Runs a transaction atomically.
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError>;

    /// Grants a lease (TTLs are whole seconds, rounded up).
    async fn grant_lease(&self, ttl: Duration) -> Result<Lease, StoreError>;

    /// Renews a lease once; returns the TTL it now has. `LeaseNotFound` when it is gone.
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError>;

    /// Revokes a lease, deleting its keys. `LeaseNotFound` when it is already gone.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Watches every key under a prefix from a revision (0: from now on).
    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: i64,
    ) -> Result<WatchStream, StoreError>;

    /// Discards history before a revision.
    async fn compact(&self, revision: i64) -> Result<(), StoreError>;
}

/// Whole seconds for a lease TTL, at least one.
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}
