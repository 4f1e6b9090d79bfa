//! Membership: registration under a lease, the live view, lease loss and recovery, slow
//! renewals, and an etcd restart.

use std::sync::Arc;

use crate::common::{eventually, within, Backend, TTL};
use scd_scheduler::store::{EventKind, HookedStore, LeaseId, MetaStore};
use scd_scheduler::{
    LiveNodes, NodeId, NodeInfo, Registration, RegistrationConfig, RegistrationEvent,
};

fn config() -> RegistrationConfig {
    RegistrationConfig {
        ttl: TTL,
        renewals_per_ttl: 3,
    }
}

fn node(id: &str) -> NodeInfo {
    let mut n = NodeInfo::new(
        NodeId::new(id).unwrap(),
        format!("127.0.0.1:{}", 7000 + id.len()),
        4,
    );
    n.producer_models = vec!["base".into()];
    n
}

async fn register(b: &Backend, id: &str) -> Registration {
    Registration::register(b.client().await, &b.keys, node(id), config())
        .await
        .unwrap()
}

async fn nodes_and_updates_are_seen(b: Backend) {
    let live = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    let r1 = register(&b, "n1").await;
    let r2 = register(&b, "n2").await;
    live.wait_for(|m| m.len() == 2).await;
    assert_eq!(live.snapshot()["n1"], r1.info());
    assert_ne!(r1.epoch(), 0);
    assert_ne!(r1.epoch(), r2.epoch());
    r2.update(|n| {
        n.load = 3;
        n.prefix_hashes = vec!["h0".into()];
    })
    .await
    .unwrap();
    within(
        "load update",
        live.wait_for(|m| m.get("n2").is_some_and(|n| n.load == 3)),
    )
    .await;
    // A view started now reads the same.
    let fresh = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    assert_eq!(fresh.snapshot(), live.snapshot());
    r1.deregister().await.unwrap();
    within(
        "n1 gone",
        live.wait_for(|m| !m.contains_key("n1") && m.contains_key("n2")),
    )
    .await;
}

async fn lease_expiry_removes_a_node(b: Backend) {
    let live = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    let crashed = register(&b, "crashed").await;
    let _alive = register(&b, "alive").await;
    within("both listed", live.wait_for(|m| m.len() == 2)).await;
    // A crash: renewals stop, nothing is revoked; the lease runs out.
    drop(crashed);
    within(
        "crashed node expires",
        live.wait_for(|m| !m.contains_key("crashed")),
    )
    .await;
    // The one that keeps renewing stays, well past several TTLs.
    tokio::time::sleep(TTL * 2).await;
    assert!(live.snapshot().contains_key("alive"));
    assert!(b
        .store
        .get(&b.keys.node("alive").unwrap())
        .await
        .unwrap()
        .is_some());
}

async fn a_lost_lease_reregisters_on_its_own(b: Backend) {
    let live = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    let reg = register(&b, "n1").await;
    let mut events = reg.subscribe();
    let old = reg.lease();
    within("listed", live.wait_for(|m| m.contains_key("n1"))).await;
    // Someone revokes the lease (or it expired during a long pause): the key goes with it.
    b.store.revoke_lease(old).await.unwrap();
    let mut lost = false;
    let new_lease = within("re-registration", async {
        loop {
            match events.recv().await.unwrap() {
                RegistrationEvent::LeaseLost { lease } => {
                    assert_eq!(lease, old);
                    lost = true;
                }
                RegistrationEvent::Reregistered { lease } => break lease,
                _ => {}
            }
        }
    })
    .await;
    assert!(lost, "the loss is reported before the recovery");
    assert_ne!(new_lease, old);
    assert_eq!(reg.lease(), new_lease);
    let key = b.keys.node("n1").unwrap();
    eventually("node key under the new lease", || async {
        b.store
            .get(&key)
            .await
            .unwrap()
            .is_some_and(|kv| kv.lease == new_lease)
    })
    .await;
    within("listed again", live.wait_for(|m| m.contains_key("n1"))).await;
}

async fn slow_renewals_do_not_drop_a_node(b: Backend) {
    // Each renewal takes 40% of the TTL, longer than the renewal period itself.
    // Renewals answered slowly, as an overloaded etcd would.
    let delay = TTL * 2 / 5;
    let slow: Arc<dyn MetaStore> = Arc::new(HookedStore::new(b.client().await).before_keep_alive(
        move || async move {
            tokio::time::sleep(delay).await;
            Ok(())
        },
    ));
    let reg = Registration::register(slow, &b.keys, node("slow"), config())
        .await
        .unwrap();
    let mut events = reg.subscribe();
    let key = b.keys.node("slow").unwrap();
    let r = b.store.get(&key).await.unwrap().unwrap().mod_revision;
    let mut watch = b.store.watch_prefix(&key, r + 1).await.unwrap();
    // Over four TTLs the key must never be deleted.
    let observed = tokio::time::timeout(TTL * 4, async {
        while let Some(e) = watch.next().await {
            let e = e.unwrap();
            if e.kv.key == key && e.kind == EventKind::Delete {
                return Some(e);
            }
        }
        None
    })
    .await;
    assert!(observed.is_err(), "the node key was deleted: {observed:?}");
    while let Ok(e) = events.try_recv() {
        assert!(
            !matches!(e, RegistrationEvent::LeaseLost { .. }),
            "lease lost despite renewals: {e:?}"
        );
    }
    assert!(b.store.get(&key).await.unwrap().is_some());
}

on_both_stores!(
    nodes_and_updates_are_seen,
    lease_expiry_removes_a_node,
    a_lost_lease_reregisters_on_its_own,
    slow_renewals_do_not_drop_a_node,
);

async fn wait_for_outage(regs: &mut [tokio::sync::broadcast::Receiver<RegistrationEvent>]) {
    for events in regs.iter_mut() {
        within("a failed renewal during the outage", async {
            loop {
                if let Ok(RegistrationEvent::RenewalFailed { .. }) = events.recv().await {
                    break;
                }
            }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_every_node_is_registered_again() {
    let mut b = Backend::etcd().await;
    let ids = ["n1", "n2", "n3"];
    let mut regs = Vec::new();
    for id in ids {
        regs.push(register(&b, id).await);
    }
    let live = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    within("all listed", live.wait_for(|m| m.len() == 3)).await;
    let mut events: Vec<_> = regs.iter().map(|r| r.subscribe()).collect();

    let server = b.etcd.as_mut().unwrap();
    server.kill();
    wait_for_outage(&mut events).await;
    // Stay down for longer than a TTL.
    tokio::time::sleep(TTL + TTL / 2).await;
    server.restart().await.unwrap();

    let prefix = b.keys.nodes_prefix();
    eventually(
        "every node registered under its current, live lease",
        || async {
            let Ok(listing) = b.store.get_prefix(&prefix).await else {
                return false;
            };
            let mut ok = listing.kvs.len() == 3;
            for reg in &regs {
                let key = b.keys.node(&reg.node_id()).unwrap();
                ok &= listing
                    .kvs
                    .iter()
                    .any(|kv| kv.key == key && kv.lease == reg.lease());
            }
            ok
        },
    )
    .await;
    // And they stay, renewing against the restarted etcd.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(b.store.get_prefix(&prefix).await.unwrap().kvs.len(), 3);
    // The live view resumed its watch: it sees a change made after the restart.
    regs[0].update(|n| n.load = 2).await.unwrap();
    within(
        "view follows after restart",
        live.wait_for(|m| m.len() == 3 && m["n1"].load == 2),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restarted_empty_every_node_reregisters() {
    let mut b = Backend::etcd().await;
    let mut regs = Vec::new();
    for id in ["n1", "n2", "n3"] {
        regs.push(register(&b, id).await);
    }
    let live = LiveNodes::start(b.client().await, &b.keys).await.unwrap();
    within("all listed", live.wait_for(|m| m.len() == 3)).await;
    // Move the view's revision well past what a fresh etcd reaches by re-registering three
    // nodes (keys nested under the prefix are delivered to the watch but are not nodes).
    let filler = format!("{}filler/x", b.keys.nodes_prefix());
    for i in 0..20 {
        b.store.put(&filler, vec![i], None).await.unwrap();
    }
    let old: Vec<LeaseId> = regs.iter().map(|r| r.lease()).collect();
    let mut events: Vec<_> = regs.iter().map(|r| r.subscribe()).collect();
    b.etcd.as_mut().unwrap().restart_empty().await.unwrap();
    // Every lease is gone with the data: each node must notice and register again.
    for events in events.iter_mut() {
        within("re-registration", async {
            loop {
                if let Ok(RegistrationEvent::Reregistered { .. }) = events.recv().await {
                    break;
                }
            }
        })
        .await;
    }
    let listing = b.store.get_prefix(&b.keys.nodes_prefix()).await.unwrap();
    assert_eq!(listing.kvs.len(), 3);
    for (reg, old) in regs.iter().zip(old) {
        assert_ne!(reg.lease(), old);
        assert!(listing.kvs.iter().any(|kv| kv.lease == reg.lease()));
    }
    // The live view noticed the reset (revisions went backwards), read again, and follows on.
    regs[1].update(|n| n.load = 1).await.unwrap();
    within(
        "view follows after the reset",
        live.wait_for(|m| m.len() == 3 && m["n2"].load == 1),
    )
    .await;
}
