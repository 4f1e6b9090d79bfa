//! Shared test support: a backend (embedded store, or a real etcd started for the test), a
//! polling wait with a generous bound, and a macro that runs one scenario on both backends.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use scd_scheduler::{EmbeddedStore, EtcdServer, Keys, MetaStore};

/// Upper bound for waits: only a real bug takes this long.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// Short leases keep the suite quick (etcd's minimum lease TTL is about 2 s by default).
pub const TTL: Duration = Duration::from_secs(2);

pub struct Backend {
    pub store: Arc<dyn MetaStore>,
    pub etcd: Option<EtcdServer>,
    pub keys: Keys,
}

impl Backend {
    pub async fn embedded() -> Self {
        Self {
            store: Arc::new(EmbeddedStore::new()),
            etcd: None,
            keys: Keys::new("/scd-test/v1"),
        }
    }

    pub async fn etcd() -> Self {
        let server = match EtcdServer::start().await {
            Ok(s) => s,
            Err(e) => panic!("these tests need a real etcd: {e}"),
        };
        let store = server.store().await.unwrap();
        Self {
            store: Arc::new(store),
            etcd: Some(server),
            keys: Keys::new("/scd-test/v1"),
        }
    }

    /// A second client of the same store (a separate connection for etcd).
    pub async fn client(&self) -> Arc<dyn MetaStore> {
        match &self.etcd {
            Some(server) => Arc::new(server.store().await.unwrap()),
            None => self.store.clone(),
        }
    }
}

/// Polls `check` until it holds; panics with `what` after [`PATIENCE`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out after {PATIENCE:?} waiting for: {what}");
}

/// Awaits a future with the [`PATIENCE`] bound.
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {PATIENCE:?} waiting for: {what}"),
    }
}

/// Runs each named `async fn(Backend)` scenario on the embedded store and on a real etcd.
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::embedded().await).await
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::etcd().await).await
                }
            )*
        }
    };
}
