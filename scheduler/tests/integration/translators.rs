//! Translator versions: publish, activate, roll back, every watcher switching, concurrent
//! activations, and the stale-hash guard.

use std::collections::BTreeMap;

use crate::common::{within, Backend};
use scd_scheduler::translators::TranslatorError;
use scd_scheduler::{
    check_translator, StaleTranslator, TranslatorHash, TranslatorManifest, TranslatorRegistry,
    TranslatorWatcher,
};

/// A distinct content hash per label (what a real SHA-256 of distinct weights gives).
fn h(label: &str) -> TranslatorHash {
    let mut bytes = [0u8; 32];
    bytes[..label.len()].copy_from_slice(label.as_bytes());
    TranslatorHash::from_bytes(bytes)
}

fn manifest(version: &str, hash: &str) -> TranslatorManifest {
    TranslatorManifest {
        producer_model: "base".into(),
        consumer_model: "sotu".into(),
        version: version.into(),
        content_hash: h(hash),
        ranks: BTreeMap::from([("k".to_string(), 64), ("v".to_string(), 64)]),
        reuse_layers: vec![0, 1, 2],
        patch_layers: vec![3],
        blob: format!("file:///translators/{version}.safetensors"),
        metrics: BTreeMap::from([("kl".to_string(), 0.05)]),
    }
}

async fn publish_activate_and_roll_back(b: Backend) {
    let reg = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    assert!(reg.active("base", "sotu").await.unwrap().is_none());
    reg.publish(&manifest("v1", "h1")).await.unwrap();
    reg.publish(&manifest("v2", "h2")).await.unwrap();
    // Publishing again is idempotent; changing a published version is refused.
    reg.publish(&manifest("v1", "h1")).await.unwrap();
    assert!(matches!(
        reg.publish(&manifest("v1", "other")).await,
        Err(TranslatorError::VersionExists { existing, .. }) if existing == h("h1")
    ));
    assert!(matches!(
        reg.publish(&manifest("active", "x")).await,
        Err(TranslatorError::InvalidId(_))
    ));
    assert_eq!(
        reg.manifest("base", "sotu", "v2").await.unwrap(),
        manifest("v2", "h2")
    );
    let versions: Vec<String> = reg
        .versions("base", "sotu")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.version)
        .collect();
    assert_eq!(versions, ["v1", "v2"]);

    assert!(matches!(
        reg.activate("base", "sotu", "v9").await,
        Err(TranslatorError::UnknownVersion { .. })
    ));
    assert!(matches!(
        reg.rollback("base", "sotu").await,
        Err(TranslatorError::NoHistory { .. })
    ));
    let a = reg.activate("base", "sotu", "v1").await.unwrap();
    assert_eq!(
        (a.version.as_str(), a.content_hash, a.history.len()),
        ("v1", h("h1"), 0)
    );
    let a = reg.activate("base", "sotu", "v2").await.unwrap();
    assert_eq!(
        (a.version.as_str(), a.history.clone()),
        ("v2", vec!["v1".to_string()])
    );
    assert_eq!(a.blob, "file:///translators/v2.safetensors");
    // Activating the live version again changes nothing.
    assert_eq!(reg.activate("base", "sotu", "v2").await.unwrap(), a);
    let back = reg.rollback("base", "sotu").await.unwrap();
    assert_eq!(
        (back.version.as_str(), back.content_hash, back.history.len()),
        ("v1", h("h1"), 0)
    );
    assert_eq!(reg.active("base", "sotu").await.unwrap().unwrap(), back);
    assert!(matches!(
        reg.rollback("base", "sotu").await,
        Err(TranslatorError::NoHistory { .. })
    ));
}

async fn every_watcher_sees_an_activation(b: Backend) {
    let reg = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    reg.publish(&manifest("v1", "h1")).await.unwrap();
    reg.publish(&manifest("v2", "h2")).await.unwrap();
    reg.activate("base", "sotu", "v1").await.unwrap();
    let mut watchers = Vec::new();
    for _ in 0..5 {
        watchers.push(
            TranslatorWatcher::start(b.client().await, &b.keys, "base", "sotu")
                .await
                .unwrap(),
        );
    }
    for w in &watchers {
        assert_eq!(w.current().unwrap().version, "v1");
        assert!(w.check(h("h1")).is_ok());
    }
    reg.activate("base", "sotu", "v2").await.unwrap();
    for w in &watchers {
        let a = within(
            "the switch to v2",
            w.wait_for(|a| a.is_some_and(|a| a.version == "v2")),
        )
        .await
        .unwrap();
        assert_eq!(a.content_hash, h("h2"));
        // Codes made with the old translator are refused from now on.
        assert_eq!(
            w.check(h("h1")).unwrap_err(),
            StaleTranslator {
                encoded_with: h("h1"),
                active: Some(h("h2"))
            }
        );
        assert_eq!(w.check(h("h2")).unwrap().version, "v2");
    }
    reg.rollback("base", "sotu").await.unwrap();
    for w in &watchers {
        within(
            "the rollback",
            w.wait_for(|a| a.is_some_and(|a| a.content_hash == h("h1"))),
        )
        .await;
    }
    // A watcher of another pair sees nothing.
    let other = TranslatorWatcher::start(b.client().await, &b.keys, "base", "law")
        .await
        .unwrap();
    assert!(other.current().is_none());
    assert_eq!(
        other.check(h("h1")).unwrap_err(),
        StaleTranslator {
            encoded_with: h("h1"),
            active: None
        }
    );
}

async fn concurrent_activations_lose_none(b: Backend) {
    let reg = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    let n = 6;
    for i in 0..n {
        reg.publish(&manifest(&format!("v{i}"), &format!("h{i}")))
            .await
            .unwrap();
    }
    let mut tasks = Vec::new();
    for i in 0..n {
        let reg = TranslatorRegistry::new(b.client().await, b.keys.clone());
        tasks.push(tokio::spawn(async move {
            reg.activate("base", "sotu", &format!("v{i}"))
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        within("activation", t).await.unwrap();
    }
    // Each activation pushed its predecessor: all versions are in the live one plus its history.
    let active = reg.active("base", "sotu").await.unwrap().unwrap();
    let mut seen = active.history.clone();
    seen.push(active.version.clone());
    seen.sort();
    let expected: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
    assert_eq!(seen, expected);
}

/// A node adopts its configured version only when nothing is live; the listing shows every
/// pair with its versions and the live one.
async fn adopt_keeps_a_live_version_and_pairs_list_everything(b: Backend) {
    let reg = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    reg.publish(&manifest("v1", "h1")).await.unwrap();
    reg.publish(&manifest("v2", "h2")).await.unwrap();
    let mut other = manifest("w1", "g1");
    other.consumer_model = "melville".into();
    reg.publish(&other).await.unwrap();
    let a = reg.adopt("base", "sotu", "v1").await.unwrap();
    assert_eq!(a.version, "v1");
    // A second node with another configured version keeps the live one.
    let a = reg.adopt("base", "sotu", "v2").await.unwrap();
    assert_eq!((a.version.as_str(), a.content_hash), ("v1", h("h1")));
    assert!(matches!(
        reg.adopt("base", "sotu", "v9").await,
        Ok(a) if a.version == "v1"
    ));
    let pairs = reg.pairs().await.unwrap();
    let shown: Vec<(&str, Option<&str>, Vec<&str>)> = pairs
        .iter()
        .map(|p| {
            (
                p.consumer.as_str(),
                p.active.as_ref().map(|a| a.version.as_str()),
                p.versions.iter().map(|m| m.version.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("melville", None, vec!["w1"]),
            ("sotu", Some("v1"), vec!["v1", "v2"])
        ]
    );
    assert!(pairs.iter().all(|p| p.producer == "base"));
}

on_both_stores!(
    adopt_keeps_a_live_version_and_pairs_list_everything,
    publish_activate_and_roll_back,
    every_watcher_sees_an_activation,
    concurrent_activations_lose_none
);

#[test]
fn the_guard_refuses_any_other_hash() {
    assert!(check_translator(h("h2"), Some(h("h2"))).is_ok());
    assert!(check_translator(h("h1"), Some(h("h2"))).is_err());
    assert!(check_translator(h("h1"), None).is_err());
}

/// etcd restored without its data: the watcher's revision is now ahead of the store's, so a
/// new activation lands at a revision its watch has already passed. The watcher must still
/// switch (it notices the reset or re-reads), or nodes would keep accepting codes of a
/// translator that is no longer live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_follows_an_etcd_restored_empty() {
    let mut b = Backend::etcd().await;
    let reg = TranslatorRegistry::new(b.store.clone(), b.keys.clone());
    reg.publish(&manifest("v1", "h1")).await.unwrap();
    reg.activate("base", "sotu", "v1").await.unwrap();
    let watcher = TranslatorWatcher::start(b.client().await, &b.keys, "base", "sotu")
        .await
        .unwrap();
    // Push the watcher's revision well past what the emptied etcd reaches below.
    for i in 0..30u8 {
        b.store.put("/filler", vec![i], None).await.unwrap();
    }
    b.etcd.as_mut().unwrap().restart_empty().await.unwrap();
    let reg = TranslatorRegistry::new(b.client().await, b.keys.clone());
    reg.publish(&manifest("v2", "h2")).await.unwrap();
    reg.activate("base", "sotu", "v2").await.unwrap();
    let seen = within(
        "watcher switches after the reset",
        watcher.wait_for(|a| a.is_some_and(|a| a.version == "v2")),
    )
    .await;
    assert_eq!(seen.unwrap().content_hash, h("h2"));
}
