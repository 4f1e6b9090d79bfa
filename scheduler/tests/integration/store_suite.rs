//! One suite for the `MetaStore` contract, run against the embedded store and a real etcd.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, within, Backend, TTL};
use scd_scheduler::store::{Compare, EventKind, MetaStore, StoreError, Txn, TxnOp};

async fn put_get_delete_and_revisions(b: Backend) {
    let s = &b.store;
    let k = "/t/kv/a";
    let r1 = s.put(k, b"1".to_vec(), None).await.unwrap();
    let r2 = s.put(k, b"2".to_vec(), None).await.unwrap();
    assert!(r2 > r1);
    let kv = s.get(k).await.unwrap().unwrap();
    assert_eq!(kv.value, b"2");
    assert_eq!(kv.version, 2);
    assert_eq!(kv.create_revision, r1);
    assert_eq!(kv.mod_revision, r2);
    assert_eq!(kv.lease, 0);
    assert!(s.delete(k).await.unwrap());
    assert!(!s.delete(k).await.unwrap());
    assert!(s.get(k).await.unwrap().is_none());
    // Re-created keys start a new incarnation.
    let r3 = s.put(k, b"3".to_vec(), None).await.unwrap();
    let kv = s.get(k).await.unwrap().unwrap();
    assert_eq!((kv.version, kv.create_revision), (1, r3));
    assert!(matches!(
        s.put("", vec![], None).await,
        Err(StoreError::Invalid(_))
    ));
}

async fn prefix_reads_are_scoped_and_sorted(b: Backend) {
    let s = &b.store;
    for k in ["/t/p/b", "/t/p/a", "/t/p/c/d", "/t/q/a", "/t/pp"] {
        s.put(k, k.as_bytes().to_vec(), None).await.unwrap();
    }
    let last = s.put("/t/p/e", b"e".to_vec(), None).await.unwrap();
    let listing = s.get_prefix("/t/p/").await.unwrap();
    let keys: Vec<&str> = listing.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["/t/p/a", "/t/p/b", "/t/p/c/d", "/t/p/e"]);
    assert!(listing.revision >= last);
    assert!(s.get_prefix("/nothing/").await.unwrap().kvs.is_empty());
}

/// A listing larger than one page of the etcd store (256 keys) and than the client's 4 MiB
/// receive limit comes back whole, sorted and scoped, at one revision.
async fn large_listings_come_back_whole(b: Backend) {
    let s = &b.store;
    const KEYS: usize = 600;
    // 600 values of 10 KiB: about 6 MiB, so both the page count and the byte limit are passed.
    let value = vec![b'x'; 10 << 10];
    let mut last = 0;
    for i in 0..KEYS {
        last = s
            .put(&format!("/t/big/{i:04}"), value.clone(), None)
            .await
            .unwrap();
    }
    // Keys just outside the prefix, on both sides.
    s.put("/t/bif", b"before".to_vec(), None).await.unwrap();
    let after = s.put("/t/big0", b"after".to_vec(), None).await.unwrap();
    let listing = within("a 6 MiB listing", s.get_prefix("/t/big/"))
        .await
        .unwrap();
    assert_eq!(listing.kvs.len(), KEYS);
    let expected: Vec<String> = (0..KEYS).map(|i| format!("/t/big/{i:04}")).collect();
    let keys: Vec<&str> = listing.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, expected);
    assert!(listing.kvs.iter().all(|kv| kv.value == value));
    assert!(listing.revision >= after && after > last);
}

/// The newest keys of a prefix, by creation, without reading the rest; a rewrite does not make a
/// key newer.
async fn newest_keys_by_creation(b: Backend) {
    let s = &b.store;
    for k in ["/t/n/c", "/t/n/a", "/t/n/d", "/t/n/b"] {
        s.put(k, k.as_bytes().to_vec(), None).await.unwrap();
    }
    s.put("/t/n/c", b"again".to_vec(), None).await.unwrap();
    let last = s.put("/t/o", b"outside".to_vec(), None).await.unwrap();
    let listing = s.get_prefix_newest("/t/n/", 3).await.unwrap();
    let keys: Vec<&str> = listing.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["/t/n/b", "/t/n/d", "/t/n/a"]);
    assert!(listing.revision >= last);
    assert_eq!(s.get_prefix_newest("/t/n/", 10).await.unwrap().kvs.len(), 4);
    assert!(s
        .get_prefix_newest("/t/n/", 0)
        .await
        .unwrap()
        .kvs
        .is_empty());
}

async fn create_if_absent_has_one_winner(b: Backend) {
    let s = &b.store;
    let k = "/t/once";
    let mut winners = 0;
    for i in 0..3 {
        let txn = Txn::new()
            .when([Compare::absent(k)])
            .and_then([TxnOp::put(k, format!("w{i}"))])
            .or_else([TxnOp::put("/t/losers", format!("l{i}"))]);
        if s.txn(txn).await.unwrap().succeeded {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
    assert_eq!(s.get(k).await.unwrap().unwrap().value, b"w0");
    // The failure branch ran for the losers.
    assert_eq!(s.get("/t/losers").await.unwrap().unwrap().value, b"l2");
}

async fn compare_and_swap_on_revision_value_and_creation(b: Backend) {
    let s = &b.store;
    let k = "/t/cas";
    let r = s.put(k, b"a".to_vec(), None).await.unwrap();
    let stale = Txn::new()
        .when([Compare::mod_revision(k, r - 1)])
        .and_then([TxnOp::put(k, "x")]);
    assert!(!s.txn(stale).await.unwrap().succeeded);
    let fresh = Txn::new()
        .when([Compare::mod_revision(k, r)])
        .and_then([TxnOp::put(k, "b")]);
    let out = s.txn(fresh).await.unwrap();
    assert!(out.succeeded);
    assert_eq!(s.get(k).await.unwrap().unwrap().mod_revision, out.revision);
    assert!(
        s.txn(
            Txn::new()
                .when([Compare::value(k, "b")])
                .and_then([TxnOp::put(k, "c")])
        )
        .await
        .unwrap()
        .succeeded
    );
    assert!(
        !s.txn(
            Txn::new()
                .when([Compare::value(k, "b")])
                .and_then([TxnOp::put(k, "d")])
        )
        .await
        .unwrap()
        .succeeded
    );
    assert!(
        !s.txn(Txn::new().when([Compare::value("/t/none", "")]))
            .await
            .unwrap()
            .succeeded
    );
    assert!(
        s.txn(
            Txn::new()
                .when([Compare::create_revision(k, r)])
                .and_then([TxnOp::delete(k)])
        )
        .await
        .unwrap()
        .succeeded
    );
    assert!(s.get(k).await.unwrap().is_none());
    // Several writes in one transaction share one revision.
    let out = s
        .txn(Txn::new().and_then([TxnOp::put("/t/m1", "1"), TxnOp::put("/t/m2", "2")]))
        .await
        .unwrap();
    assert_eq!(
        s.get("/t/m1").await.unwrap().unwrap().mod_revision,
        out.revision
    );
    assert_eq!(
        s.get("/t/m2").await.unwrap().unwrap().mod_revision,
        out.revision
    );
}

async fn concurrent_cas_increments_lose_nothing(b: Backend) {
    let k = "/t/counter";
    b.store.put(k, b"0".to_vec(), None).await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = b.client().await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                loop {
                    let kv = s.get(k).await.unwrap().unwrap();
                    let n: u64 = String::from_utf8(kv.value).unwrap().parse().unwrap();
                    let txn = Txn::new()
                        .when([Compare::mod_revision(k, kv.mod_revision)])
                        .and_then([TxnOp::put(k, (n + 1).to_string())]);
                    if s.txn(txn).await.unwrap().succeeded {
                        break;
                    }
                }
            }
        }));
    }
    for t in tasks {
        within("increments", t).await.unwrap();
    }
    assert_eq!(b.store.get(k).await.unwrap().unwrap().value, b"80");
}

async fn revoking_a_lease_removes_its_keys(b: Backend) {
    let s = &b.store;
    let lease = s.grant_lease(TTL).await.unwrap();
    assert!(lease.ttl >= TTL);
    s.put("/t/l/a", b"a".to_vec(), Some(lease.id))
        .await
        .unwrap();
    s.txn(Txn::new().and_then([TxnOp::put_with_lease("/t/l/b", "b", lease.id)]))
        .await
        .unwrap();
    s.put("/t/l/keep", b"k".to_vec(), None).await.unwrap();
    assert_eq!(s.get("/t/l/a").await.unwrap().unwrap().lease, lease.id);
    assert!(s.keep_alive(lease.id).await.unwrap() >= Duration::from_secs(1));
    s.revoke_lease(lease.id).await.unwrap();
    let left: Vec<String> = s
        .get_prefix("/t/l/")
        .await
        .unwrap()
        .kvs
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(left, ["/t/l/keep"]);
    assert!(
        matches!(s.revoke_lease(lease.id).await, Err(StoreError::LeaseNotFound(id)) if id == lease.id)
    );
    assert!(matches!(
        s.keep_alive(lease.id).await,
        Err(StoreError::LeaseNotFound(_))
    ));
    assert!(matches!(
        s.put("/t/l/c", vec![], Some(lease.id)).await,
        Err(StoreError::LeaseNotFound(_))
    ));
    let txn = Txn::new().and_then([TxnOp::put_with_lease("/t/l/c", "c", lease.id)]);
    assert!(matches!(
        s.txn(txn).await,
        Err(StoreError::LeaseNotFound(_))
    ));
}

async fn an_unrenewed_lease_expires(b: Backend) {
    let s = &b.store;
    let lease = s.grant_lease(TTL).await.unwrap();
    s.put("/t/exp", b"x".to_vec(), Some(lease.id))
        .await
        .unwrap();
    eventually("the key of an expired lease to go", || async {
        s.get("/t/exp").await.unwrap().is_none()
    })
    .await;
    assert!(matches!(
        s.keep_alive(lease.id).await,
        Err(StoreError::LeaseNotFound(_))
    ));
}

async fn renewing_keeps_a_lease_past_its_ttl(b: Backend) {
    let s = &b.store;
    let lease = s.grant_lease(TTL).await.unwrap();
    s.put("/t/kept", b"x".to_vec(), Some(lease.id))
        .await
        .unwrap();
    // Renew at a quarter of the TTL for three TTLs.
    for _ in 0..12 {
        tokio::time::sleep(lease.ttl / 4).await;
        s.keep_alive(lease.id).await.unwrap();
    }
    assert!(s.get("/t/kept").await.unwrap().is_some());
}

async fn watch_replays_history_then_follows(b: Backend) {
    let s = &b.store;
    let r1 = s.put("/t/w/a", b"1".to_vec(), None).await.unwrap();
    s.put("/t/other", b"x".to_vec(), None).await.unwrap();
    s.put("/t/w/b", b"2".to_vec(), None).await.unwrap();
    let mut w = s.watch_prefix("/t/w/", r1).await.unwrap();
    let e = within("history a", w.next()).await.unwrap().unwrap();
    assert_eq!(
        (e.kind, e.kv.key.as_str(), e.kv.value.as_slice()),
        (EventKind::Put, "/t/w/a", &b"1"[..])
    );
    let e = within("history b", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/w/b");
    let writer = b.client().await;
    writer.put("/t/w/c", b"3".to_vec(), None).await.unwrap();
    let rd = writer.put("/t/w/a", b"4".to_vec(), None).await.unwrap();
    writer.delete("/t/w/b").await.unwrap();
    let e = within("live c", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/w/c");
    let e = within("live a", w.next()).await.unwrap().unwrap();
    assert_eq!(
        (e.kv.key.as_str(), e.kv.version, e.kv.mod_revision),
        ("/t/w/a", 2, rd)
    );
    let e = within("delete b", w.next()).await.unwrap().unwrap();
    assert_eq!((e.kind, e.kv.key.as_str()), (EventKind::Delete, "/t/w/b"));
    assert!(e.kv.mod_revision > rd);
}

async fn a_watch_from_now_misses_the_past(b: Backend) {
    let s = &b.store;
    s.put("/t/n/old", b"1".to_vec(), None).await.unwrap();
    let mut w = s.watch_prefix("/t/n/", 0).await.unwrap();
    s.put("/t/n/new", b"2".to_vec(), None).await.unwrap();
    let e = within("new", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/n/new");
}

async fn lease_expiry_is_a_delete_event(b: Backend) {
    let s = &b.store;
    let lease = s.grant_lease(TTL).await.unwrap();
    let r = s
        .put("/t/le/a", b"x".to_vec(), Some(lease.id))
        .await
        .unwrap();
    let mut w = s.watch_prefix("/t/le/", r + 1).await.unwrap();
    s.revoke_lease(lease.id).await.unwrap();
    let e = within("delete", w.next()).await.unwrap().unwrap();
    assert_eq!((e.kind, e.kv.key.as_str()), (EventKind::Delete, "/t/le/a"));
}

async fn compacted_history_is_a_clear_error(b: Backend) {
    let s = &b.store;
    let r1 = s.put("/t/c/a", b"1".to_vec(), None).await.unwrap();
    s.put("/t/c/a", b"2".to_vec(), None).await.unwrap();
    let r3 = s.put("/t/c/a", b"3".to_vec(), None).await.unwrap();
    s.compact(r3).await.unwrap();
    let mut w = s.watch_prefix("/t/c/", r1).await.unwrap();
    match within("compacted", w.next()).await {
        Some(Err(StoreError::Compacted {
            compact_revision, ..
        })) => assert!(compact_revision >= r3),
        other => panic!("expected a compaction error, got {other:?}"),
    }
    assert!(within("end", w.next()).await.is_none());
    // From the compaction point on, history is there.
    let mut w = s.watch_prefix("/t/c/", r3).await.unwrap();
    let e = within("r3", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.value, b"3");
    assert!(s.compact(r3 + 1000).await.is_err());
}

async fn dropping_a_watch_stops_it(b: Backend) {
    let s: Arc<dyn MetaStore> = b.store.clone();
    let w = s.watch_prefix("/t/d/", 0).await.unwrap();
    drop(w);
    // Writes after the drop must not block on the dropped consumer's bounded channel.
    for i in 0..(scd_scheduler::store::WATCH_CHANNEL_CAPACITY + 10) {
        s.put("/t/d/k", i.to_string().into_bytes(), None)
            .await
            .unwrap();
    }
}

on_both_stores!(
    put_get_delete_and_revisions,
    prefix_reads_are_scoped_and_sorted,
    large_listings_come_back_whole,
    newest_keys_by_creation,
    create_if_absent_has_one_winner,
    compare_and_swap_on_revision_value_and_creation,
    concurrent_cas_increments_lose_nothing,
    revoking_a_lease_removes_its_keys,
    an_unrenewed_lease_expires,
    renewing_keeps_a_lease_past_its_ttl,
    watch_replays_history_then_follows,
    a_watch_from_now_misses_the_past,
    lease_expiry_is_a_delete_event,
    compacted_history_is_a_clear_error,
    dropping_a_watch_stops_it,
);

#[tokio::test]
async fn embedded_history_limit_compacts_like_etcd() {
    let s = scd_scheduler::EmbeddedStore::with_history(4);
    let first = s.put("/h/a", b"0".to_vec(), None).await.unwrap();
    for i in 1..10 {
        s.put("/h/a", i.to_string().into_bytes(), None)
            .await
            .unwrap();
    }
    let mut w = s.watch_prefix("/h/", first).await.unwrap();
    assert!(matches!(
        w.next().await,
        Some(Err(StoreError::Compacted { .. }))
    ));
    let current = s.get("/h/a").await.unwrap().unwrap().mod_revision;
    let mut w = s.watch_prefix("/h/", current - 2).await.unwrap();
    assert_eq!(w.next().await.unwrap().unwrap().kv.value, b"7");
}

#[tokio::test(start_paused = true)]
async fn embedded_leases_follow_tokio_time() {
    let s = scd_scheduler::EmbeddedStore::new();
    let lease = s.grant_lease(Duration::from_secs(10)).await.unwrap();
    s.put("/p/a", b"x".to_vec(), Some(lease.id)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    s.keep_alive(lease.id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(s.get("/p/a").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(s.get("/p/a").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_resumes_across_a_restart_without_loss_or_repeats() {
    let mut b = Backend::etcd().await;
    let mut w = b.store.watch_prefix("/t/r/", 0).await.unwrap();
    b.store.put("/t/r/a", b"1".to_vec(), None).await.unwrap();
    let e = within("before restart", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/r/a");
    b.etcd.as_mut().unwrap().restart().await.unwrap();
    let writer = b.client().await;
    common::eventually("a write after the restart", || async {
        writer.put("/t/r/b", b"2".to_vec(), None).await.is_ok()
    })
    .await;
    writer.put("/t/r/c", b"3".to_vec(), None).await.unwrap();
    let e = within("b after restart", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/r/b");
    let e = within("c after restart", w.next()).await.unwrap().unwrap();
    assert_eq!(e.kv.key, "/t/r/c");
    // The data survived the restart too.
    assert_eq!(b.store.get("/t/r/a").await.unwrap().unwrap().value, b"1");
}
