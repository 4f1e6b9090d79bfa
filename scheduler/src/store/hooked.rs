//! A store that passes every call to another, with hooks run before its transactions and its
//! lease renewals: the faults that tests inject (a store away for a while, an overloaded one
//! answering renewals late, another writer landing between a read and a write). Feature
//! `test-util`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::{
    KeyValue, Lease, LeaseId, Listing, MetaStore, StoreError, Txn, TxnOutcome, WatchStream,
};

/// What a hook does before the call it guards: `Err` fails the call with that error, unrun.
pub type Hook =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>> + Send + Sync>;

/// [`MetaStore`] over `inner`, with the hooks set.
#[derive(Clone)]
pub struct HookedStore {
    inner: Arc<dyn MetaStore>,
    before_txn: Option<Hook>,
    before_keep_alive: Option<Hook>,
}

impl std::fmt::Debug for HookedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookedStore")
            .field("inner", &self.inner)
            .field("before_txn", &self.before_txn.is_some())
            .field("before_keep_alive", &self.before_keep_alive.is_some())
            .finish()
    }
}

fn hook<F, Fut>(f: F) -> Hook
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), StoreError>> + Send + 'static,
{
    Arc::new(move || Box::pin(f()))
}

impl HookedStore {
    /// A store passing everything to `inner`.
    pub fn new(inner: Arc<dyn MetaStore>) -> Self {
        Self {
            inner,
            before_txn: None,
            before_keep_alive: None,
        }
    }

    /// Runs `f` before each transaction.
    pub fn before_txn<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        self.before_txn = Some(hook(f));
        self
    }

    /// Runs `f` before each lease renewal.
    pub fn before_keep_alive<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        self.before_keep_alive = Some(hook(f));
        self
    }
}

async fn run(hook: &Option<Hook>) -> Result<(), StoreError> {
    match hook {
        Some(h) => h().await,
        None => Ok(()),
    }
}

#[async_trait]
impl MetaStore for HookedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.inner.get(key).await
    }
    async fn get_prefix(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.inner.get_prefix(prefix).await
    }
    async fn get_prefix_newest(&self, prefix: &str, limit: usize) -> Result<Listing, StoreError> {
        self.inner.get_prefix_newest(prefix, limit).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<i64, StoreError> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        run(&self.before_txn).await?;
        self.inner.txn(txn).await
    }
    async fn grant_lease(&self, ttl: Duration) -> Result<Lease, StoreError> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        run(&self.before_keep_alive).await?;
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }
    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: i64,
    ) -> Result<WatchStream, StoreError> {
        self.inner.watch_prefix(prefix, from_revision).await
    }
    async fn compact(&self, revision: i64) -> Result<(), StoreError> {
        self.inner.compact(revision).await
    }
}
