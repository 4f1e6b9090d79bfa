//! The etcd `MetaStore`, over etcd-client. Every unary call has a deadline; watches run in a
//! driver task that re-creates the etcd watch from the last seen revision whenever the stream
//! breaks (etcd restarting, a dropped connection), so consumers see each event exactly once.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, CompactionOptions, Compare as EtcdCompare, CompareOp, ConnectOptions,
    Error as EtcdError, EventType, GetOptions, LeaseGrantOptions, PutOptions, SortOrder,
    SortTarget, Txn as EtcdTxn, TxnOp as EtcdTxnOp, WatchOptions,
};
use tokio::sync::mpsc;

use super::{
    ttl_secs, Compare, CompareTarget, EventKind, KeyValue, Lease, LeaseId, Listing, MetaStore,
    StoreError, Txn, TxnOp, TxnOutcome, WatchEvent, WatchStream, WATCH_CHANNEL_CAPACITY,
};

/// Deadline of one unary request.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys asked for in one page of a listing (halved while a page outgrows a response).
const FIRST_PAGE_KEYS: i64 = 256;
/// Times a listing starts again after the revision it was pinned to was compacted.
const LISTING_RESTARTS: u32 = 3;
/// Backoff between attempts to re-create a broken watch.
const WATCH_RETRY_MIN: Duration = Duration::from_millis(50);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(2);

/// A `MetaStore` backed by an etcd cluster.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    endpoints: Vec<String>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

/// The client's side of etcd's TLS, PEM: the CA that signed etcd's serving certificates
/// (`--trusted-ca-file` on etcd's side names the one for clients) and, for an etcd started with
/// `--client-cert-auth`, this client's certificate and key.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA certificate(s) etcd's serving certificate must chain to.
    pub ca_pem: Vec<u8>,
    /// This client's certificate and private key.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.client.is_some())
            .finish_non_exhaustive()
    }
}

impl EtcdTls {
    /// etcd-client's (tonic's) form of it.
    pub(crate) fn client_config(&self) -> etcd_client::TlsOptions {
        let config = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&self.ca_pem));
        match &self.client {
            Some((cert, key)) => config.identity(etcd_client::Identity::from_pem(cert, key)),
            None => config,
        }
    }
}

impl EtcdStore {
    /// Connects to etcd over plain HTTP. The connection is lazy underneath: a store created
    /// while etcd is down starts working when it comes up.
    pub async fn connect(endpoints: &[String]) -> Result<Self, StoreError> {
        Self::connect_with(endpoints, None).await
    }

    /// Connects to etcd, over TLS where `tls` is given (endpoints then `https://` or without a
    /// scheme). A certificate etcd refuses, or one of etcd's this client does not trust, shows
    /// at the first request, as [`StoreError::Etcd`] with the TLS error as its source.
    pub async fn connect_with(
        endpoints: &[String],
        tls: Option<&EtcdTls>,
    ) -> Result<Self, StoreError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            // HTTP/2 pings notice a dead server on an idle watch or keep-alive stream.
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some(tls) = tls {
            options = options.with_tls(tls.client_config());
        }
        let client = deadline("connect", Client::connect(endpoints, Some(options))).await?;
        Ok(Self {
            client,
            endpoints: endpoints.to_vec(),
        })
    }

    /// The endpoints this store talks to.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Every key under `prefix`, read page by page at the revision of the first page. A page
    /// that does not fit one response is asked for again at half the size.
    async fn list_pages(&self, prefix: &str) -> Result<Listing, StoreError> {
        let end = prefix_end(prefix.as_bytes());
        let mut start = prefix.as_bytes().to_vec();
        let mut revision = 0;
        let mut limit = FIRST_PAGE_KEYS;
        let mut kvs = Vec::new();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let mut client = self.client.clone();
            let resp = match deadline("get_prefix", client.get(start.clone(), Some(options))).await
            {
                Ok(resp) => resp,
                Err(e) if is_too_large(&e) && limit > 1 => {
                    limit = (limit / 2).max(1);
                    continue;
                }
                Err(e) if is_compacted(&e) => {
                    return Err(StoreError::Compacted {
                        requested: revision,
                        compact_revision: revision,
                    })
                }
                Err(e) => return Err(e),
            };
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                kvs.push(convert_kv(kv)?);
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    // The next page starts just after the last key read.
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok(Listing { kvs, revision }),
            }
        }
    }
}

async fn deadline<T>(
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, EtcdError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(OP_TIMEOUT, fut).await {
        Ok(result) => result.map_err(|source| StoreError::Etcd { op, source }),
        Err(_) => Err(StoreError::Timeout {
            op,
            after: OP_TIMEOUT,
        }),
    }
}

/// etcd reports a missing lease as a gRPC status with this text.
fn is_lease_not_found(e: &StoreError) -> bool {
    match e {
        StoreError::Etcd {
            source: EtcdError::GRpcStatus(s),
            ..
        } => s.message().contains("lease not found"),
        StoreError::Etcd {
            source: EtcdError::LeaseKeepAliveError(m),
            ..
        } => m.contains("lease not found"),
        _ => false,
    }
}

/// The end of the range of keys starting with `prefix` (etcd's convention: the prefix with
/// its last byte below 0xff incremented; `\0` for every key).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// tonic refusing a response over the client's receive limit.
fn is_too_large(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Etcd { source: EtcdError::GRpcStatus(s), .. }
            if s.message().contains("message length too large")
    )
}

/// etcd refusing a read at a compacted revision.
fn is_compacted(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Etcd { source: EtcdError::GRpcStatus(s), .. }
            if s.message().contains("compacted")
    )
}

fn convert_kv(kv: &etcd_client::KeyValue) -> Result<KeyValue, StoreError> {
    let key =
        std::str::from_utf8(kv.key()).map_err(|_| StoreError::NonUtf8Key(kv.key().to_vec()))?;
    Ok(KeyValue {
        key: key.to_string(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
    })
}

fn convert_compare(c: &Compare) -> EtcdCompare {
    let key = c.key.as_bytes().to_vec();
    match &c.target {
        CompareTarget::Version(v) => EtcdCompare::version(key, CompareOp::Equal, *v),
        CompareTarget::ModRevision(r) => EtcdCompare::mod_revision(key, CompareOp::Equal, *r),
        CompareTarget::CreateRevision(r) => EtcdCompare::create_revision(key, CompareOp::Equal, *r),
        CompareTarget::Value(v) => EtcdCompare::value(key, CompareOp::Equal, v.clone()),
    }
}

fn convert_op(op: &TxnOp) -> EtcdTxnOp {
    match op {
        TxnOp::Put { key, value, lease } => EtcdTxnOp::put(
            key.as_bytes(),
            value.clone(),
            lease.map(|l| PutOptions::new().with_lease(l)),
        ),
        TxnOp::Delete { key } => EtcdTxnOp::delete(key.as_bytes(), None),
    }
}

fn lease_of(ops: &[TxnOp]) -> Option<LeaseId> {
    ops.iter().find_map(|op| match op {
        TxnOp::Put { lease, .. } => *lease,
        TxnOp::Delete { .. } => None,
    })
}

fn map_compaction(e: StoreError, requested: i64) -> StoreError {
    match &e {
        StoreError::Etcd {
            source: EtcdError::GRpcStatus(s),
            ..
        } if s.message().contains("compacted") => StoreError::Compacted {
            requested,
            compact_revision: requested,
        },
        StoreError::Etcd {
            source: EtcdError::GRpcStatus(s),
            ..
        } if s.message().contains("future revision") => {
            StoreError::Invalid(format!("cannot compact at future revision {requested}"))
        }
        _ => e,
    }
}

#[async_trait]
impl MetaStore for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let mut client = self.client.clone();
        let resp = deadline("get", client.get(key, None)).await?;
        resp.kvs().first().map(convert_kv).transpose()
    }

    async fn get_prefix(&self, prefix: &str) -> Result<Listing, StoreError> {
        // A listing is read in pages, all at the first page's revision: one unpaginated range
        // of a large prefix outgrows the client's 4 MiB message limit. Compaction of that
        // revision between pages (rare: it would have to land within the listing) starts the
        // listing again at the newest revision.
        let mut restarts = 0;
        loop {
            match self.list_pages(prefix).await {
                Err(StoreError::Compacted { .. }) if restarts < LISTING_RESTARTS => restarts += 1,
                other => return other,
            }
        }
    }

    async fn get_prefix_newest(&self, prefix: &str, limit: usize) -> Result<Listing, StoreError> {
        // etcd sorts the range by creation revision and returns the first `limit`: one
        // response, halved while it outgrows the client's receive limit.
        let mut limit = i64::try_from(limit).unwrap_or(i64::MAX);
        loop {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend);
            // etcd reads a limit of 0 as "no limit": ask for the count alone then.
            let options = if limit == 0 {
                options.with_count_only()
            } else {
                options.with_limit(limit)
            };
            let mut client = self.client.clone();
            match deadline("get_prefix_newest", client.get(prefix, Some(options))).await {
                Ok(resp) => {
                    let kvs = resp
                        .kvs()
                        .iter()
                        .map(convert_kv)
                        .collect::<Result<Vec<_>, _>>()?;
                    let revision = resp.header().map_or(0, |h| h.revision());
                    return Ok(Listing { kvs, revision });
                }
                Err(e) if is_too_large(&e) && limit > 1 => limit /= 2,
                Err(e) => return Err(e),
            }
        }
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<i64, StoreError> {
        if key.is_empty() {
            return Err(StoreError::Invalid("empty key".into()));
        }
        let mut client = self.client.clone();
        let options = lease.map(|l| PutOptions::new().with_lease(l));
        let resp = deadline("put", client.put(key, value, options))
            .await
            .map_err(|e| match lease {
                Some(l) if is_lease_not_found(&e) => StoreError::LeaseNotFound(l),
                _ => e,
            })?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut client = self.client.clone();
        let resp = deadline("delete", client.delete(key, None)).await?;
        Ok(resp.deleted() > 0)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        for op in txn.success.iter().chain(&txn.failure) {
            let (TxnOp::Put { key, .. } | TxnOp::Delete { key }) = op;
            if key.is_empty() {
                return Err(StoreError::Invalid("empty key".into()));
            }
        }
        let etcd_txn = EtcdTxn::new()
            .when(txn.compares.iter().map(convert_compare).collect::<Vec<_>>())
            .and_then(txn.success.iter().map(convert_op).collect::<Vec<_>>())
            .or_else(txn.failure.iter().map(convert_op).collect::<Vec<_>>());
        let mut client = self.client.clone();
        let resp = deadline("txn", client.txn(etcd_txn)).await.map_err(|e| {
            match lease_of(&txn.success).or_else(|| lease_of(&txn.failure)) {
                Some(l) if is_lease_not_found(&e) => StoreError::LeaseNotFound(l),
                _ => e,
            }
        })?;
        Ok(TxnOutcome {
            succeeded: resp.succeeded(),
            revision: resp.header().map_or(0, |h| h.revision()),
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease, StoreError> {
        let mut client = self.client.clone();
        let resp = deadline(
            "lease_grant",
            client.lease_grant(ttl_secs(ttl), None::<LeaseGrantOptions>),
        )
        .await?;
        if !resp.error().is_empty() {
            return Err(StoreError::Invalid(format!(
                "lease grant refused: {}",
                resp.error()
            )));
        }
        Ok(Lease {
            id: resp.id(),
            ttl: Duration::from_secs(resp.ttl().max(1).unsigned_abs()),
        })
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, StoreError> {
        let mut client = self.client.clone();
        // One short-lived keep-alive stream per renewal: renewals are seconds apart, and a fresh
        // stream never carries a half-broken state over from a previous connection. Opening it
        // renews once (and reports a missing lease); the second exchange reads the TTL.
        let ttl = deadline("keep_alive", async move {
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            match stream.message().await? {
                Some(resp) => Ok(resp.ttl()),
                None => Err(EtcdError::LeaseKeepAliveError(
                    "keep-alive stream closed".into(),
                )),
            }
        })
        .await
        .map_err(|e| {
            if is_lease_not_found(&e) {
                StoreError::LeaseNotFound(lease)
            } else {
                e
            }
        })?;
        if ttl <= 0 {
            return Err(StoreError::LeaseNotFound(lease));
        }
        Ok(Duration::from_secs(ttl.unsigned_abs()))
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut client = self.client.clone();
        deadline("lease_revoke", client.lease_revoke(lease))
            .await
            .map_err(|e| {
                if is_lease_not_found(&e) {
                    StoreError::LeaseNotFound(lease)
                } else {
                    e
                }
            })?;
        Ok(())
    }

    async fn watch_prefix(
        &self,
        prefix: &str,
        from_revision: i64,
    ) -> Result<WatchStream, StoreError> {
        // "From now" is pinned to the revision at the time of the call, so that a write made
        // after this returns is seen even though the etcd watch is created asynchronously.
        let start = if from_revision > 0 {
            from_revision
        } else {
            let mut client = self.client.clone();
            let resp = deadline(
                "watch",
                client.get(
                    prefix,
                    Some(GetOptions::new().with_prefix().with_count_only()),
                ),
            )
            .await?;
            resp.header().map_or(0, |h| h.revision()) + 1
        };
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL_CAPACITY);
        let client = self.client.clone();
        let prefix = prefix.to_string();
        let driver = tokio::spawn(drive_watch(client, prefix, start, tx));
        Ok(WatchStream::new(rx, driver))
    }

    async fn compact(&self, revision: i64) -> Result<(), StoreError> {
        let mut client = self.client.clone();
        deadline(
            "compact",
            client.compact(revision, Some(CompactionOptions::new().with_physical())),
        )
        .await
        .map_err(|e| map_compaction(e, revision))?;
        Ok(())
    }
}

type EventSender = mpsc::Sender<Result<WatchEvent, StoreError>>;

/// Keeps one logical watch alive across broken streams. `next` is the first revision not yet
/// delivered (0 until the first watch is created, meaning "from now").
async fn drive_watch(client: Client, prefix: String, mut next: i64, tx: EventSender) {
    let mut backoff = WATCH_RETRY_MIN;
    loop {
        let mut options = WatchOptions::new().with_prefix();
        if next > 0 {
            options = options.with_start_revision(next);
        }
        let mut watch_client = client.clone();
        let created = tokio::select! {
            created = watch_client.watch(prefix.as_bytes(), Some(options)) => created,
            _ = tx.closed() => return,
        };
        match created {
            Ok(mut stream) => loop {
                let message = tokio::select! {
                    message = stream.message() => message,
                    _ = tx.closed() => return,
                };
                match message {
                    Ok(Some(resp)) => {
                        if resp.compact_revision() > 0 {
                            let _ = tx
                                .send(Err(StoreError::Compacted {
                                    requested: next,
                                    compact_revision: resp.compact_revision(),
                                }))
                                .await;
                            return;
                        }
                        let current = resp.header().map_or(0, |h| h.revision());
                        if resp.created() && next == 0 {
                            next = current + 1;
                        }
                        if resp.created() && current > 0 && current + 1 < next {
                            // The store is behind what we already delivered: etcd came back
                            // without its data. Revisions will be reused, so resuming would
                            // silently skip changes; the consumer must read everything again.
                            let _ = tx
                                .send(Err(StoreError::HistoryReset {
                                    expected: next - 1,
                                    found: current,
                                }))
                                .await;
                            return;
                        }
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            let kv = match convert_kv(kv) {
                                Ok(kv) => kv,
                                Err(e) => {
                                    tracing::warn!(error = %e, "skipping watch event");
                                    continue;
                                }
                            };
                            let kind = match event.event_type() {
                                EventType::Put => EventKind::Put,
                                EventType::Delete => EventKind::Delete,
                            };
                            next = next.max(kv.mod_revision + 1);
                            if tx.send(Ok(WatchEvent { kind, kv })).await.is_err() {
                                return;
                            }
                        }
                        backoff = WATCH_RETRY_MIN;
                        if resp.canceled() {
                            tracing::warn!(
                                prefix,
                                reason = resp.cancel_reason(),
                                "etcd cancelled a watch; re-creating"
                            );
                            break;
                        }
                    }
                    Ok(None) => {
                        tracing::warn!(prefix, next, "etcd watch stream ended; resuming");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(prefix, next, error = %e, "etcd watch stream failed; resuming");
                        break;
                    }
                }
            },
            Err(e) => {
                tracing::warn!(prefix, next, error = %e, "creating etcd watch failed; retrying")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {},
            _ = tx.closed() => return,
        }
        backoff = (backoff * 2).min(WATCH_RETRY_MAX);
    }
}
