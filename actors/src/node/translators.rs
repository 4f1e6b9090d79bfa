//! The translator versions a node works with, following the cluster's live version of each
//! (base, expert) pair without a restart.
//!
//! At start, a node whose config names a translator for an expert publishes it under its
//! version label (or its hash, when the label is taken by other weights) and makes it live if
//! nothing is live yet; if another version is live, the node loads that one from its blob (a
//! node that cannot is refused at start: it would encode or rebuild with the wrong one). Then
//! it follows the pair's `active` key: an activation or rollback loads the version's blob and
//! makes it the one new jobs use.
//!
//! A producer stamps the version it encodes with on the job's record when it claims the
//! attempt, and the consumer rebuilds with that version: the current one, one it used a moment
//! ago (kept for jobs already under way when the switch came), or one it loads from the store's
//! manifest on demand (its own watch may lag the producer's). Codes of a version the consumer
//! cannot load are refused with both hashes, never decoded with another translator.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use scd_models::translator::Translator;
use scd_models::Llama;
use scd_scheduler::{
    ActiveTranslator, Keys, MetaStore, TranslatorError as RegistryError, TranslatorHash,
    TranslatorManifest, TranslatorRegistry, TranslatorWatcher,
};
use tokio::task::JoinHandle;

use crate::metrics::{NodeMetrics, TranslatorLabels};
use crate::node::served::{load_translator, ServeError, Served, TranslatorSource};

/// Versions kept besides the current one, for jobs encoded just before a switch.
const KEPT: usize = 3;

/// One loaded translator version.
#[derive(Clone)]
pub(crate) struct Version {
    /// Its name in the store.
    pub name: String,
    /// The translator.
    pub translator: Arc<Translator>,
    /// The expert's index in it.
    pub index: usize,
}

impl Version {
    pub fn hash(&self) -> TranslatorHash {
        self.translator.hash()
    }
}

/// Why a translator version could not be used.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// The store failed or refused.
    #[error("translator versions of {base}->{expert}: {source}")]
    Registry {
        /// The base model.
        base: String,
        /// The expert.
        expert: String,
        /// Why.
        source: Box<RegistryError>,
    },
    /// The version's blob could not be loaded here, or is not for this pair.
    #[error("translator {version} ({hash}) of {expert}, from {blob}: {source}")]
    Load {
        /// The expert.
        expert: String,
        /// The version.
        version: String,
        /// Its hash.
        hash: String,
        /// Where it was read from.
        blob: String,
        /// Why.
        source: Box<ServeError>,
    },
    /// The blob holds other weights than the version's manifest names.
    #[error("translator {version} of {expert}: its blob {blob} holds {found}, the cluster's manifest says {expected}")]
    WrongBlob {
        /// The expert.
        expert: String,
        /// The version.
        version: String,
        /// Where it was read from.
        blob: String,
        /// What it holds.
        found: String,
        /// What the store says.
        expected: String,
    },
    /// Codes of a version this node does not know and the store does not list.
    #[error("codes were made with translator {wanted}, which is not a published version of {expert} (this node has {current})")]
    Unknown {
        /// The expert.
        expert: String,
        /// The wanted hash.
        wanted: String,
        /// The node's current hash.
        current: String,
    },
    /// The blocking task that loads a version failed.
    #[error("loading a translator version: {0}")]
    Task(String),
    /// The node serves no such expert.
    #[error("this node has no translator for expert {0}")]
    NoExpert(String),
    /// The node serves experts without the base model's weights (it loaded only its header).
    #[error("expert {expert}: {source}")]
    NoModel {
        /// The expert.
        expert: String,
        /// Why.
        source: Box<ServeError>,
    },
}

struct ExpertVersions {
    base: String,
    expert: String,
    /// The expert's model (consumer role), for checking a version against it.
    model: Option<Arc<Llama>>,
    /// Where its versions may be loaded from.
    source: Arc<TranslatorSource>,
    current: RwLock<Version>,
    /// Earlier versions, newest last.
    kept: Mutex<VecDeque<Version>>,
}

/// The translator versions of a node's experts.
pub(crate) struct NodeTranslators {
    experts: BTreeMap<String, Arc<ExpertVersions>>,
    registry: TranslatorRegistry,
    /// The base model where the node loaded it (producer or consumer role).
    base: Option<Arc<Llama>>,
    /// Where versions may be loaded from.
    source: Arc<TranslatorSource>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for NodeTranslators {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl NodeTranslators {
    /// Publishes and adopts the configured versions, loads the live ones and starts following
    /// them.
    pub async fn start(
        served: &Served,
        store: Arc<dyn MetaStore>,
        keys: &Keys,
        metrics: Arc<NodeMetrics>,
    ) -> Result<Self, VersionError> {
        let registry = TranslatorRegistry::new(store.clone(), keys.clone());
        let source = Arc::new(served.translator_source.clone());
        let base_id = &served.base_id;
        let mut experts = BTreeMap::new();
        let mut tasks = Vec::new();
        for (name, e) in &served.experts {
            // Served::load loads the weights wherever it loads experts.
            let base = served.model().map_err(|source| VersionError::NoModel {
                expert: name.clone(),
                source: Box::new(source),
            })?;
            let reg_err = |source| VersionError::Registry {
                base: base_id.clone(),
                expert: name.clone(),
                source: Box::new(source),
            };
            let (translator, index) = e.translator.clone();
            let configured = publish_configured(&registry, base_id, name, &translator, &e.dir)
                .await
                .map_err(reg_err)?;
            let live = registry
                .adopt(base_id, name, &configured)
                .await
                .map_err(reg_err)?;
            let entry = Arc::new(ExpertVersions {
                base: base_id.clone(),
                expert: name.clone(),
                model: e.model.clone(),
                source: source.clone(),
                current: RwLock::new(Version {
                    name: configured,
                    translator,
                    index,
                }),
                kept: Mutex::new(VecDeque::new()),
            });
            if live.content_hash != entry.current().hash() {
                let version = entry.load(base, &live).await?;
                entry.switch(version, &metrics);
            } else {
                entry.show(&metrics, None);
            }
            let watcher = TranslatorWatcher::start(store.clone(), keys, base_id, name)
                .await
                .map_err(reg_err)?;
            tasks.push(tokio::spawn(follow(
                entry.clone(),
                base.clone(),
                watcher,
                metrics.clone(),
            )));
            experts.insert(name.clone(), entry);
        }
        Ok(Self {
            experts,
            registry,
            base: served.base.clone(),
            source,
            tasks,
        })
    }

    /// The version new jobs of `expert` are encoded with.
    pub fn current(&self, expert: &str) -> Result<Version, VersionError> {
        Ok(self.entry(expert)?.current())
    }

    /// The version with hash `wanted` if this node has it loaded.
    pub fn find(&self, expert: &str, wanted: TranslatorHash) -> Option<Version> {
        self.experts.get(expert)?.find(wanted)
    }

    /// The version with hash `wanted`: the current one, a kept one, or one the store lists
    /// (loaded now and kept).
    pub async fn get(&self, expert: &str, wanted: TranslatorHash) -> Result<Version, VersionError> {
        let entry = self.entry(expert)?;
        if let Some(v) = entry.find(wanted) {
            return Ok(v);
        }
        let manifests = self
            .registry
            .versions(&entry.base, expert)
            .await
            .map_err(|source| VersionError::Registry {
                base: entry.base.clone(),
                expert: expert.to_owned(),
                source: Box::new(source),
            })?;
        let Some(m) = manifests.iter().find(|m| m.content_hash == wanted) else {
            return Err(VersionError::Unknown {
                expert: expert.to_owned(),
                wanted: wanted.short(),
                current: entry.current().hash().short(),
            });
        };
        let live = ActiveTranslator {
            version: m.version.clone(),
            content_hash: m.content_hash,
            blob: m.blob.clone(),
            history: Vec::new(),
            degraded: None,
        };
        let base = self.base.as_ref().ok_or_else(|| VersionError::NoModel {
            expert: expert.to_owned(),
            source: Box::new(ServeError::NoWeights),
        })?;
        let version = entry.load(base, &live).await?;
        entry.keep(version.clone());
        Ok(version)
    }

    /// The registry of the cluster's versions.
    pub fn registry(&self) -> &TranslatorRegistry {
        &self.registry
    }

    /// The manifest of the translator folder `blob` as version `version` (default: its own
    /// label) of (`producer`, `consumer`), after checking here that it loads and, when this
    /// node runs `producer`, that it was calibrated with it for `consumer`.
    pub async fn manifest_for(
        &self,
        producer: &str,
        consumer: &str,
        version: Option<&str>,
        blob: &str,
    ) -> Result<TranslatorManifest, VersionError> {
        let dir = PathBuf::from(blob.strip_prefix("file://").unwrap_or(blob));
        let (name, path) = (consumer.to_owned(), dir.clone());
        // Checked against the producer's model where this node runs it.
        let ours = self
            .base
            .clone()
            .filter(|base| crate::node::served::model_id(base) == producer);
        let load_err = |source| VersionError::Load {
            expert: consumer.to_owned(),
            version: version.unwrap_or("(its label)").to_owned(),
            hash: "?".into(),
            blob: blob.to_owned(),
            source: Box::new(source),
        };
        let source = self.source.clone();
        let translator = tokio::task::spawn_blocking(move || match ours {
            Some(base) => load_translator(&source, &name, &path, &base, None).map(|(t, _)| t),
            None => {
                let path = source.folder(&name, &path)?;
                Translator::load(&path)
                    .map(Arc::new)
                    .map_err(|source| ServeError::Translator {
                        expert: name,
                        path,
                        source: Box::new(source),
                    })
            }
        })
        .await
        .map_err(|e| VersionError::Task(e.to_string()))?
        .map_err(load_err)?;
        let version = version.unwrap_or(&translator.manifest.version);
        Ok(manifest_of(producer, consumer, version, &translator, &dir))
    }

    fn entry(&self, expert: &str) -> Result<&Arc<ExpertVersions>, VersionError> {
        self.experts
            .get(expert)
            .ok_or_else(|| VersionError::NoExpert(expert.to_owned()))
    }
}

impl ExpertVersions {
    fn current(&self) -> Version {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn find(&self, wanted: TranslatorHash) -> Option<Version> {
        let current = self.current();
        if current.hash() == wanted {
            return Some(current);
        }
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().rev().find(|v| v.hash() == wanted).cloned()
    }

    fn keep(&self, version: Version) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|v| v.hash() != version.hash());
        kept.push_back(version);
        while kept.len() > KEPT {
            kept.pop_front();
        }
    }

    /// Makes `version` current; the previous one is kept for jobs already under way.
    fn switch(&self, version: Version, metrics: &NodeMetrics) {
        let previous = {
            let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *current, version)
        };
        self.show(metrics, Some(&previous));
        tracing::info!(
            expert = self.expert,
            version = self.current().name,
            hash = %self.current().hash(),
            previous = previous.name,
            "translator switched"
        );
        self.keep(previous);
    }

    /// The metrics' view: the current version at 1, the one it replaced gone.
    fn show(&self, metrics: &NodeMetrics, previous: Option<&Version>) {
        let labels = |v: &Version| TranslatorLabels {
            expert: self.expert.clone(),
            version: v.hash().to_string(),
        };
        if let Some(p) = previous {
            metrics.translators.remove(&labels(p));
        }
        metrics
            .translators
            .get_or_create(&labels(&self.current()))
            .set(1);
    }

    /// Loads the version `live` names from its blob and checks it against this pair.
    async fn load(
        &self,
        base: &Arc<Llama>,
        live: &ActiveTranslator,
    ) -> Result<Version, VersionError> {
        let (base, model, expert) = (base.clone(), self.model.clone(), self.expert.clone());
        let source = self.source.clone();
        let blob = PathBuf::from(live.blob.strip_prefix("file://").unwrap_or(&live.blob));
        let load_err = |source| VersionError::Load {
            expert: self.expert.clone(),
            version: live.version.clone(),
            hash: live.content_hash.short(),
            blob: live.blob.clone(),
            source: Box::new(source),
        };
        let loaded = tokio::task::spawn_blocking(move || {
            load_translator(&source, &expert, &blob, &base, model.as_deref())
        })
        .await
        .map_err(|e| VersionError::Task(e.to_string()))?
        .map_err(load_err)?;
        let (translator, index) = loaded;
        if translator.hash() != live.content_hash {
            return Err(VersionError::WrongBlob {
                expert: self.expert.clone(),
                version: live.version.clone(),
                blob: live.blob.clone(),
                found: translator.hash().short(),
                expected: live.content_hash.short(),
            });
        }
        Ok(Version {
            name: live.version.clone(),
            translator,
            index,
        })
    }
}

/// Publishes the translator a node's config names, under its version label, or under the label
/// and its hash when the label is already taken by other weights. Returns the name.
async fn publish_configured(
    registry: &TranslatorRegistry,
    base: &str,
    expert: &str,
    translator: &Translator,
    dir: &Path,
) -> Result<String, RegistryError> {
    let label = translator.manifest.version.as_str();
    let mut manifest = manifest_of(base, expert, label, translator, dir);
    match registry.publish(&manifest).await {
        Ok(()) => Ok(manifest.version),
        // The label is taken by other weights, or is no key segment: the hash names it.
        Err(RegistryError::VersionExists { .. } | RegistryError::InvalidId(_)) => {
            manifest.version = format!("translator-{}", translator.hash().short());
            registry.publish(&manifest).await?;
            Ok(manifest.version)
        }
        Err(e) => Err(e),
    }
}

/// The store's manifest of a translator folder, published as version `version` of the pair.
pub(crate) fn manifest_of(
    base: &str,
    expert: &str,
    version: &str,
    t: &Translator,
    dir: &Path,
) -> TranslatorManifest {
    let m = &t.manifest;
    let ranks = [
        ("k", m.default_ranks.k),
        ("v", m.default_ranks.v),
        ("h", m.default_ranks.h),
    ]
    .into_iter()
    .map(|(k, r)| (k.to_string(), r as u32))
    .collect();
    let mut metrics = BTreeMap::new();
    if let Some(obj) = m.metrics.as_object() {
        for (k, v) in obj {
            if let Some(x) = v.as_f64() {
                metrics.insert(k.clone(), x);
            }
        }
    }
    metrics.insert("calibration_prefixes".into(), m.calibration.prefixes as f64);
    let patch: Vec<u32> = m.patch_layers.iter().map(|&l| l as u32).collect();
    TranslatorManifest {
        producer_model: base.to_owned(),
        consumer_model: expert.to_owned(),
        version: version.to_owned(),
        content_hash: t.hash(),
        ranks,
        reuse_layers: (0..m.layers as u32)
            .filter(|l| !patch.contains(l))
            .collect(),
        patch_layers: patch,
        blob: std::path::absolute(dir)
            .unwrap_or_else(|_| dir.to_owned())
            .display()
            .to_string(),
        metrics,
    }
}

/// Follows the pair's live version: loads each newly activated one and makes it current. A
/// version that cannot be loaded here leaves the current one in place (jobs encoded with the
/// new one elsewhere are refused with the reason).
async fn follow(
    entry: Arc<ExpertVersions>,
    base: Arc<Llama>,
    watcher: TranslatorWatcher,
    metrics: Arc<NodeMetrics>,
) {
    let mut rx = watcher.subscribe();
    loop {
        let live = rx.borrow_and_update().clone();
        if let Some(live) = live {
            if entry.current().hash() != live.content_hash {
                let found = entry.find(live.content_hash);
                let version = match found {
                    Some(v) => Ok(v),
                    None => entry.load(&base, &live).await,
                };
                match version {
                    Ok(v) => entry.switch(v, &metrics),
                    Err(e) => {
                        metrics.translator_load_failures.inc();
                        tracing::error!(error = %e, "the cluster's live translator cannot be used here; keeping the current one");
                    }
                }
            }
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
