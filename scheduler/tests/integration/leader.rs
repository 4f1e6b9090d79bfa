//! Leader election: one leader among concurrent candidates, failover when it dies, hand-over on
//! resignation, and the fence that stops a deposed leader's writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, within, Backend, TTL};
use scd_scheduler::store::{Compare, Txn, TxnOp};
use scd_scheduler::{Candidate, ElectionConfig, LeaderGuard, Leadership};

async fn candidates(b: &Backend, n: usize) -> Vec<Arc<Candidate>> {
    let mut out = Vec::new();
    for i in 0..n {
        let store = b.client().await;
        out.push(Arc::new(
            Candidate::start(
                store,
                &b.keys,
                "scheduler",
                &format!("c{i}"),
                ElectionConfig { ttl: TTL },
            )
            .unwrap(),
        ));
    }
    out
}

/// Waits until exactly one of `cs` leads and the election key names it; returns its index.
async fn sole_leader(b: &Backend, cs: &[Arc<Candidate>]) -> usize {
    let key = b.keys.election("scheduler").unwrap();
    within("exactly one leader, named by the election key", async {
        loop {
            let leaders: Vec<usize> = cs
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_leader())
                .map(|(i, _)| i)
                .collect();
            if leaders.len() == 1 {
                if let Ok(Some(kv)) = b.store.get(&key).await {
                    if kv.value == cs[leaders[0]].id().as_bytes() {
                        return leaders[0];
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

async fn one_leader_among_concurrent_candidates(b: Backend) {
    let cs = candidates(&b, 4).await;
    let leader = sole_leader(&b, &cs).await;
    // Leadership is stable while nothing happens: over two TTLs, still just that one.
    for _ in 0..20 {
        tokio::time::sleep(TTL / 10).await;
        let leaders: Vec<&str> = cs
            .iter()
            .filter(|c| c.is_leader())
            .map(|c| c.id())
            .collect();
        assert_eq!(leaders, [cs[leader].id()]);
    }
    // Followers know who leads.
    for (i, c) in cs.iter().enumerate() {
        if i != leader {
            eventually("followers name the leader", || async {
                matches!(c.leadership(), scd_scheduler::Leadership::Follower { leader: Some(ref l) } if l == cs[leader].id())
            })
            .await;
        }
    }
}

async fn another_takes_over_when_the_leader_dies(b: Backend) {
    let mut cs = candidates(&b, 3).await;
    let first = sole_leader(&b, &cs).await;
    let old_guard = cs[first].guard().unwrap();
    // Crash: its lease is not revoked; takeover waits for it to expire.
    drop(cs.remove(first));
    let second = sole_leader(&b, &cs).await;
    let new_guard = cs[second].guard().unwrap();
    assert_ne!(old_guard, new_guard);
    assert_fenced(&b, &old_guard, &new_guard).await;
    // And again.
    drop(cs.remove(second));
    let third = sole_leader(&b, &cs).await;
    assert_eq!(cs.len(), 1);
    assert_eq!(third, 0);
}

async fn resigning_hands_over_at_once(b: Backend) {
    let mut cs = candidates(&b, 2).await;
    let first = sole_leader(&b, &cs).await;
    cs.remove(first).resign().await.unwrap();
    sole_leader(&b, &cs).await;
}

async fn a_leader_that_loses_its_lease_steps_down(b: Backend) {
    let cs = candidates(&b, 2).await;
    let first = sole_leader(&b, &cs).await;
    let old_guard = cs[first].guard().unwrap();
    let mut rx = cs[first].subscribe();
    b.store
        .revoke_lease(cs[first].lease().unwrap())
        .await
        .unwrap();
    // A watch channel keeps only the latest view: the old leader may step down and win the next
    // term with a fresh lease before this task looks. Either way its old term must be over.
    within(
        "the old leader steps down",
        rx.wait_for(|l| match l {
            Leadership::Leader(g) => *g != old_guard,
            Leadership::Follower { .. } => true,
        }),
    )
    .await
    .unwrap();
    let next = sole_leader(&b, &cs).await;
    let new_guard = cs[next].guard().unwrap();
    assert_ne!(new_guard, old_guard);
    assert_fenced(&b, &old_guard, &new_guard).await;
}

/// A write guarded by the old term fails; one guarded by the new term lands.
async fn assert_fenced(b: &Backend, old: &LeaderGuard, new: &LeaderGuard) {
    let key = "/t/leader-write";
    let stale = Txn::new()
        .when([old.compare()])
        .and_then([TxnOp::put(key, "old")]);
    assert!(!b.store.txn(stale).await.unwrap().succeeded);
    let fresh = Txn::new()
        .when([new.compare()])
        .and_then([TxnOp::put(key, "new")]);
    assert!(b.store.txn(fresh).await.unwrap().succeeded);
    assert_eq!(b.store.get(key).await.unwrap().unwrap().value, b"new");
}

async fn only_one_leader_writes_at_a_time(b: Backend) {
    // Every candidate keeps appending "(term, id)" to a log while it believes it leads, fenced
    // by its guard. Each term (the election key's creation revision) must have one writer, and
    // terms must not interleave: once a newer term wrote, an older one never writes again.
    let cs = candidates(&b, 3).await;
    let log_key = "/t/fenced-log";
    b.store.put(log_key, b"[]".to_vec(), None).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for c in &cs {
        let c = c.clone();
        let store = b.client().await;
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Some(guard) = c.guard() {
                    if let Ok(Some(kv)) = store.get(log_key).await {
                        let mut log: Vec<(i64, String)> =
                            serde_json::from_slice(&kv.value).unwrap();
                        log.push((guard.create_revision, c.id().to_string()));
                        let txn = Txn::new()
                            .when([
                                guard.compare(),
                                Compare::mod_revision(log_key, kv.mod_revision),
                            ])
                            .and_then([TxnOp::put(log_key, serde_json::to_vec(&log).unwrap())]);
                        let _ = store.txn(txn).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    let read_log = || async {
        let kv = b.store.get(log_key).await.unwrap().unwrap();
        serde_json::from_slice::<Vec<(i64, String)>>(&kv.value).unwrap()
    };
    for round in 0..2 {
        let leader = sole_leader(&b, &cs).await;
        let term = cs[leader].guard().unwrap().create_revision;
        eventually("the leader writes", || async {
            read_log().await.iter().any(|(t, _)| *t == term)
        })
        .await;
        if round == 0 {
            // The leader loses its lease while it keeps trying to write.
            b.store
                .revoke_lease(cs[leader].lease().unwrap())
                .await
                .unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let log = read_log().await;
    let mut terms: Vec<(i64, String)> = Vec::new();
    for (term, id) in &log {
        match terms.last() {
            Some((t, who)) if t == term => assert_eq!(who, id, "two writers in term {term}"),
            Some((t, _)) => {
                assert!(term > t, "term {term} wrote after newer term {t}");
                terms.push((*term, id.clone()));
            }
            None => terms.push((*term, id.clone())),
        }
    }
    assert!(
        terms.len() >= 2,
        "expected a failover in the log: {terms:?}"
    );
}

on_both_stores!(
    one_leader_among_concurrent_candidates,
    another_takes_over_when_the_leader_dies,
    resigning_hands_over_at_once,
    a_leader_that_loses_its_lease_steps_down,
    only_one_leader_writes_at_a_time,
);
