//! Translator versions per (producer model, consumer model) pair: published manifests under
//! `/translators/<producer>/<consumer>/<version>`, the live one under `.../active` (with the
//! history of earlier live versions, for rollback). Nodes follow the active version with a
//! [`TranslatorWatcher`] and switch without a restart; a consumer checks every incoming code
//! stream with [`check_translator`] so it never decodes with a translator other than the one
//! the producer encoded with.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use scd_types::{NodeId, TranslatorHash};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::envelope::{self, EnvelopeError};
use crate::keys::{InvalidId, Keys};
use crate::store::{Compare, EventKind, MetaStore, StoreError, Txn, TxnOp};

/// How many earlier active versions are remembered for rollback.
pub const HISTORY_LIMIT: usize = 32;

/// A published translator version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranslatorManifest {
    /// The base (producer) model id.
    pub producer_model: String,
    /// The expert (consumer) model id.
    pub consumer_model: String,
    /// Version name (one key segment, not `active`).
    pub version: String,
    /// Content hash of the translator's weights: what names this version on the wire.
    pub content_hash: TranslatorHash,
    /// Ranks of the codes, by name (e.g. `k`, `v`, `h`).
    #[serde(default)]
    pub ranks: BTreeMap<String, u32>,
    /// Layers rebuilt by reuse (`Z W_dec`).
    #[serde(default)]
    pub reuse_layers: Vec<u32>,
    /// Layers rebuilt by the patch aligner.
    #[serde(default)]
    pub patch_layers: Vec<u32>,
    /// Where the weights blob is (a path or URL).
    pub blob: String,
    /// Quality and size metrics from calibration.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
}

/// The live version of a pair, with the versions that were live before it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActiveTranslator {
    /// The live version.
    pub version: String,
    /// Its content hash.
    pub content_hash: TranslatorHash,
    /// Where its blob is.
    pub blob: String,
    /// Earlier live versions, oldest first (rollback pops the last).
    #[serde(default)]
    pub history: Vec<String>,
    /// Set when consumers' shadow checks found this version's codes worse than their bound
    /// (the drift guard); the scheduler then runs the pair's `reuse` / `scd` jobs in a safer
    /// mode until another version is made live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<Degraded>,
}

/// Why a live translator version was marked degraded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Degraded {
    /// The mean KL(own prefill || rebuilt cache) the shadow checks measured.
    pub shadow_kl: f64,
    /// The bound it went over.
    pub bound: f64,
    /// Shadowed jobs the mean is over.
    pub jobs: u32,
    /// The node that measured it.
    pub by: NodeId,
    /// When (milliseconds since the Unix epoch).
    pub at_ms: u64,
}

/// Errors of translator operations.
#[derive(Debug, thiserror::Error)]
pub enum TranslatorError {
    /// An id or version is not a valid key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// The store failed.
    #[error("translator store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
    /// The version exists with different content; versions are immutable.
    #[error(
        "translator {producer}->{consumer} version {version} already exists with hash {existing}"
    )]
    VersionExists {
        /// Producer model.
        producer: String,
        /// Consumer model.
        consumer: String,
        /// The version.
        version: String,
        /// The hash already published.
        existing: TranslatorHash,
    },
    /// The version was never published.
    #[error("translator {producer}->{consumer} has no version {version}")]
    UnknownVersion {
        /// Producer model.
        producer: String,
        /// Consumer model.
        consumer: String,
        /// The version.
        version: String,
    },
    /// Rollback with nothing to roll back to.
    #[error("translator {producer}->{consumer} has no earlier active version to roll back to")]
    NoHistory {
        /// Producer model.
        producer: String,
        /// Consumer model.
        consumer: String,
    },
    /// Too many concurrent writers; the compare-and-swap kept losing.
    #[error("gave up updating the active translator after {attempts} conflicting attempts")]
    Contention {
        /// Attempts made.
        attempts: u32,
    },
}

/// The versions of one pair, as `scd translators list` shows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairTranslators {
    /// The producer (base) model.
    pub producer: String,
    /// The consumer (expert) model.
    pub consumer: String,
    /// The live version.
    pub active: Option<ActiveTranslator>,
    /// Every published version, by name.
    pub versions: Vec<TranslatorManifest>,
}

/// A consumer asked to decode codes made with another translator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stale translator: codes were encoded with {encoded_with}, this consumer has {}", active.map_or_else(|| "none".to_string(), |a| a.to_string()))]
pub struct StaleTranslator {
    /// Hash the producer encoded with.
    pub encoded_with: TranslatorHash,
    /// Hash the consumer has loaded, if any.
    pub active: Option<TranslatorHash>,
}

/// Refuses to decode unless the consumer has a translator loaded and it is exactly the one the
/// producer encoded with.
pub fn check_translator(
    encoded_with: TranslatorHash,
    active: Option<TranslatorHash>,
) -> Result<(), StaleTranslator> {
    if active == Some(encoded_with) {
        Ok(())
    } else {
        Err(StaleTranslator {
            encoded_with,
            active,
        })
    }
}

/// Reads and writes translator versions.
#[derive(Debug, Clone)]
pub struct TranslatorRegistry {
    store: Arc<dyn MetaStore>,
    keys: Keys,
}

const CAS_ATTEMPTS: u32 = 32;

impl TranslatorRegistry {
    /// A registry over a store.
    pub fn new(store: Arc<dyn MetaStore>, keys: Keys) -> Self {
        Self { store, keys }
    }

    /// Publishes a version (create-if-absent). Publishing the same content again is a no-op;
    /// different content under an existing version is refused.
    pub async fn publish(&self, manifest: &TranslatorManifest) -> Result<(), TranslatorError> {
        let (p, c, v) = (
            &manifest.producer_model,
            &manifest.consumer_model,
            &manifest.version,
        );
        let key = self.keys.translator_version(p, c, v)?;
        let txn = Txn::new()
            .when([Compare::absent(key.clone())])
            .and_then([TxnOp::put(key.clone(), envelope::encode(manifest)?)]);
        if self.store.txn(txn).await?.succeeded {
            return Ok(());
        }
        let existing = self.manifest(p, c, v).await?;
        if existing.content_hash == manifest.content_hash {
            Ok(())
        } else {
            Err(TranslatorError::VersionExists {
                producer: p.clone(),
                consumer: c.clone(),
                version: v.clone(),
                existing: existing.content_hash,
            })
        }
    }

    /// Reads a published version.
    pub async fn manifest(
        &self,
        producer: &str,
        consumer: &str,
        version: &str,
    ) -> Result<TranslatorManifest, TranslatorError> {
        let key = self.keys.translator_version(producer, consumer, version)?;
        match self.store.get(&key).await? {
            Some(kv) => Ok(envelope::decode(&kv.key, &kv.value)?),
            None => Err(TranslatorError::UnknownVersion {
                producer: producer.into(),
                consumer: consumer.into(),
                version: version.into(),
            }),
        }
    }

    /// Every published version of a pair, by version name.
    pub async fn versions(
        &self,
        producer: &str,
        consumer: &str,
    ) -> Result<Vec<TranslatorManifest>, TranslatorError> {
        let prefix = self.keys.translators_prefix(producer, consumer)?;
        let active = self.keys.translator_active(producer, consumer)?;
        let listing = self.store.get_prefix(&prefix).await?;
        listing
            .kvs
            .iter()
            .filter(|kv| kv.key != active && Keys::id_under(&prefix, &kv.key).is_some())
            .map(|kv| envelope::decode(&kv.key, &kv.value).map_err(TranslatorError::from))
            .collect()
    }

    /// The live version, if any.
    pub async fn active(
        &self,
        producer: &str,
        consumer: &str,
    ) -> Result<Option<ActiveTranslator>, TranslatorError> {
        let key = self.keys.translator_active(producer, consumer)?;
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(envelope::decode(&kv.key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Makes a published version live; the previous live version goes onto the history.
    pub async fn activate(
        &self,
        producer: &str,
        consumer: &str,
        version: &str,
    ) -> Result<ActiveTranslator, TranslatorError> {
        self.swap_active(producer, consumer, |current| {
            let Some(current) = current else {
                return Ok(Goal::Set {
                    version: version.to_string(),
                    history: Vec::new(),
                });
            };
            if current.version == version {
                return Ok(Goal::AlreadyThere(current));
            }
            let mut history = current.history;
            history.push(current.version);
            if history.len() > HISTORY_LIMIT {
                history.drain(..history.len() - HISTORY_LIMIT);
            }
            Ok(Goal::Set {
                version: version.to_string(),
                history,
            })
        })
        .await
    }

    /// Makes `version` live unless some version is live already (then that one stays): what a
    /// node does with the translator its config names when it is the first to serve the pair.
    pub async fn adopt(
        &self,
        producer: &str,
        consumer: &str,
        version: &str,
    ) -> Result<ActiveTranslator, TranslatorError> {
        self.swap_active(producer, consumer, |current| match current {
            Some(current) => Ok(Goal::AlreadyThere(current)),
            None => Ok(Goal::Set {
                version: version.to_string(),
                history: Vec::new(),
            }),
        })
        .await
    }

    /// Every pair with published versions: its versions (by name) and the live one.
    pub async fn pairs(&self) -> Result<Vec<PairTranslators>, TranslatorError> {
        let prefix = self.keys.all_translators_prefix();
        let listing = self.store.get_prefix(&prefix).await?;
        let mut pairs: BTreeMap<(String, String), PairTranslators> = BTreeMap::new();
        for kv in &listing.kvs {
            let Some(rest) = kv.key.strip_prefix(&prefix) else {
                continue;
            };
            let mut parts = rest.splitn(3, '/');
            let (Some(p), Some(c), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            let pair = pairs
                .entry((p.to_string(), c.to_string()))
                .or_insert_with(|| PairTranslators {
                    producer: p.to_string(),
                    consumer: c.to_string(),
                    active: None,
                    versions: Vec::new(),
                });
            if name == crate::keys::ACTIVE {
                pair.active = Some(envelope::decode(&kv.key, &kv.value)?);
            } else {
                pair.versions.push(envelope::decode(&kv.key, &kv.value)?);
            }
        }
        Ok(pairs.into_values().collect())
    }

    /// Makes the previously live version live again.
    pub async fn rollback(
        &self,
        producer: &str,
        consumer: &str,
    ) -> Result<ActiveTranslator, TranslatorError> {
        self.swap_active(producer, consumer, |current| {
            let no_history = || TranslatorError::NoHistory {
                producer: producer.into(),
                consumer: consumer.into(),
            };
            let mut history = current.ok_or_else(no_history)?.history;
            let version = history.pop().ok_or_else(no_history)?;
            Ok(Goal::Set { version, history })
        })
        .await
    }

    /// Marks the live version degraded, if it is still the version with `content_hash` and not
    /// marked already. Returns whether this call marked it.
    pub async fn mark_degraded(
        &self,
        producer: &str,
        consumer: &str,
        content_hash: TranslatorHash,
        degraded: Degraded,
    ) -> Result<bool, TranslatorError> {
        let key = self.keys.translator_active(producer, consumer)?;
        for attempt in 0..CAS_ATTEMPTS {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(false);
            };
            let mut active: ActiveTranslator = envelope::decode(&kv.key, &kv.value)?;
            if active.content_hash != content_hash || active.degraded.is_some() {
                return Ok(false);
            }
            active.degraded = Some(degraded.clone());
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), kv.mod_revision)])
                .and_then([TxnOp::put(key.clone(), envelope::encode(&active)?)]);
            if self.store.txn(txn).await?.succeeded {
                tracing::warn!(
                    producer,
                    consumer,
                    version = active.version,
                    shadow_kl = degraded.shadow_kl,
                    bound = degraded.bound,
                    "translator marked degraded"
                );
                return Ok(true);
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(TranslatorError::Contention {
            attempts: CAS_ATTEMPTS,
        })
    }

    /// Compare-and-swap on the active key. `decide` looks at the live version and says what
    /// should be live. The transaction also checks that the target manifest is unchanged
    /// since it was read.
    async fn swap_active(
        &self,
        producer: &str,
        consumer: &str,
        decide: impl Fn(Option<ActiveTranslator>) -> Result<Goal, TranslatorError>,
    ) -> Result<ActiveTranslator, TranslatorError> {
        let active_key = self.keys.translator_active(producer, consumer)?;
        for attempt in 0..CAS_ATTEMPTS {
            let current_kv = self.store.get(&active_key).await?;
            let current: Option<ActiveTranslator> = match &current_kv {
                Some(kv) => Some(envelope::decode(&kv.key, &kv.value)?),
                None => None,
            };
            let (version, history) = match decide(current)? {
                Goal::AlreadyThere(current) => return Ok(current),
                Goal::Set { version, history } => (version, history),
            };
            let version_key = self.keys.translator_version(producer, consumer, &version)?;
            let Some(manifest_kv) = self.store.get(&version_key).await? else {
                return Err(TranslatorError::UnknownVersion {
                    producer: producer.into(),
                    consumer: consumer.into(),
                    version,
                });
            };
            let manifest: TranslatorManifest =
                envelope::decode(&manifest_kv.key, &manifest_kv.value)?;
            let next = ActiveTranslator {
                version,
                content_hash: manifest.content_hash,
                blob: manifest.blob,
                history,
                degraded: None,
            };
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(
                        active_key.clone(),
                        current_kv.map_or(0, |kv| kv.mod_revision),
                    ),
                    Compare::mod_revision(version_key, manifest_kv.mod_revision),
                ])
                .and_then([TxnOp::put(active_key.clone(), envelope::encode(&next)?)]);
            if self.store.txn(txn).await?.succeeded {
                tracing::info!(
                    producer,
                    consumer,
                    version = next.version,
                    hash = %next.content_hash,
                    "translator activated"
                );
                return Ok(next);
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(TranslatorError::Contention {
            attempts: CAS_ATTEMPTS,
        })
    }
}

/// What an activation or rollback wants live.
enum Goal {
    /// The live version already is the goal.
    AlreadyThere(ActiveTranslator),
    /// Make `version` live with this history.
    Set {
        version: String,
        history: Vec<String>,
    },
}

/// Capped exponential backoff with a little per-attempt spread.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let base = 2u64.saturating_pow(attempt.min(8)).min(200);
    let spread = u64::from(std::process::id() ^ attempt.wrapping_mul(2_654_435_761)) % 5;
    Duration::from_millis(base + spread)
}

/// Follows the live translator of one pair. The current value is always at hand
/// ([`TranslatorWatcher::current`]); a node swaps translators when it changes.
pub struct TranslatorWatcher {
    rx: watch::Receiver<Option<ActiveTranslator>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for TranslatorWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TranslatorWatcher")
            .field("current", &*self.rx.borrow())
            .finish_non_exhaustive()
    }
}

impl TranslatorWatcher {
    /// Reads the live version and starts following it.
    pub async fn start(
        store: Arc<dyn MetaStore>,
        keys: &Keys,
        producer: &str,
        consumer: &str,
    ) -> Result<Self, TranslatorError> {
        let key = keys.translator_active(producer, consumer)?;
        let (current, revision) = read_active(store.as_ref(), &key).await?;
        let (tx, rx) = watch::channel(current);
        let task = tokio::spawn(follow_active(store, key, revision, tx));
        Ok(Self { rx, task })
    }

    /// The live version now.
    pub fn current(&self) -> Option<ActiveTranslator> {
        self.rx.borrow().clone()
    }

    /// A receiver told about every switch.
    pub fn subscribe(&self) -> watch::Receiver<Option<ActiveTranslator>> {
        self.rx.clone()
    }

    /// Checks codes encoded with `encoded_with` against the live version, and returns it.
    pub fn check(&self, encoded_with: TranslatorHash) -> Result<ActiveTranslator, StaleTranslator> {
        match self.current() {
            Some(active) if active.content_hash == encoded_with => Ok(active),
            current => Err(StaleTranslator {
                encoded_with,
                active: current.map(|a| a.content_hash),
            }),
        }
    }

    /// Waits until the live version satisfies `condition`.
    pub async fn wait_for(
        &self,
        mut condition: impl FnMut(Option<&ActiveTranslator>) -> bool,
    ) -> Option<ActiveTranslator> {
        let mut rx = self.rx.clone();
        let found = rx
            .wait_for(|a| condition(a.as_ref()))
            .await
            .map(|a| a.clone());
        found.unwrap_or_else(|_| self.current())
    }
}

impl Drop for TranslatorWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_active(
    store: &dyn MetaStore,
    key: &str,
) -> Result<(Option<ActiveTranslator>, i64), TranslatorError> {
    let listing = store.get_prefix(key).await?;
    let active = match listing.kvs.iter().find(|kv| kv.key == key) {
        Some(kv) => Some(envelope::decode(&kv.key, &kv.value)?),
        None => None,
    };
    Ok((active, listing.revision))
}

async fn follow_active(
    store: Arc<dyn MetaStore>,
    key: String,
    mut revision: i64,
    tx: watch::Sender<Option<ActiveTranslator>>,
) {
    loop {
        if let Ok(mut stream) = store.watch_prefix(&key, revision + 1).await {
            while let Some(event) = stream.next().await {
                let Ok(event) = event else { break };
                if event.kv.key != key {
                    continue;
                }
                match event.kind {
                    EventKind::Put => {
                        match envelope::decode::<ActiveTranslator>(&event.kv.key, &event.kv.value) {
                            Ok(active) => {
                                tx.send_replace(Some(active));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "ignoring unreadable active translator")
                            }
                        }
                    }
                    EventKind::Delete => {
                        tx.send_replace(None);
                    }
                }
            }
        }
        loop {
            match read_active(store.as_ref(), &key).await {
                Ok((active, rev)) => {
                    revision = rev;
                    tx.send_if_modified(|a| {
                        let changed = *a != active;
                        *a = active;
                        changed
                    });
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading the active translator failed; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_hash_decodes() {
        let (h1, h2) = (
            TranslatorHash::from_bytes([1; 32]),
            TranslatorHash::from_bytes([2; 32]),
        );
        assert!(check_translator(h1, Some(h1)).is_ok());
        let err = check_translator(h1, Some(h2)).unwrap_err();
        assert_eq!(
            err,
            StaleTranslator {
                encoded_with: h1,
                active: Some(h2)
            }
        );
        assert!(err.to_string().contains(&h2.to_string()), "{err}");
        let none = check_translator(h1, None).unwrap_err();
        assert!(
            none.to_string().ends_with("this consumer has none"),
            "{none}"
        );
    }

    #[test]
    fn records_keep_their_json_field_names() {
        let hash = TranslatorHash::from_bytes([0xab; 32]);
        let active = ActiveTranslator {
            version: "v1".into(),
            content_hash: hash,
            blob: "file:///t.safetensors".into(),
            history: vec!["v0".into()],
            degraded: None,
        };
        let value = serde_json::to_value(&active).unwrap();
        assert_eq!(value["content_hash"], "ab".repeat(32));
        assert_eq!(
            serde_json::from_value::<ActiveTranslator>(value).unwrap(),
            active
        );
        // A hash that is not 64 hex digits is refused on read.
        let bad = r#"{"version":"v1","content_hash":"h1","blob":"b"}"#;
        assert!(serde_json::from_str::<ActiveTranslator>(bad).is_err());
    }
}
