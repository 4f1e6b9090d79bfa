//! What a node serves, loaded from its config: the base model (a producer prefills with it; a
//! consumer builds its experts on it), each expert's model (consumer role) and each expert's
//! translator, checked against the models it names before the node joins the cluster; and a
//! producer's compiled documents ([`crate::documents`]).
//!
//! A node that runs no model (only the gateway, admin or scheduler roles) reads the base
//! model's file for its tokenizer (with the chat template), its hyperparameters (the prompt
//! limits) and its hash (checked against the cluster's record), and loads none of its weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use scd_models::tokenizer::{Tokenizer, TokenizerError};
use scd_models::translator::{artifact, Translator, TranslatorError};
use scd_models::{
    AdapterError, AdapterMode, GgufFile, KernelChoice, Llama, LlamaConfig, LoadError, LoraAdapter,
};
use scd_scheduler::{Mode, ModelRecord};

use crate::config::{AdapterModeConfig, NodeConfig, NodeRole};

/// Why a node's models could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The config names no base model.
    #[error("models.base is not set: every node needs the base model (a producer prefills with it, a consumer's experts are built on it, the gateway and admin roles tokenize with its tokenizer)")]
    NoBase,
    /// The base model's weights were asked for on a node that loaded only its header (no
    /// producer or consumer role).
    #[error("the base model's weights are not loaded on this node: only the producer and consumer roles load them")]
    NoWeights,
    /// The base model could not be loaded.
    #[error("loading the base model {path}: {source}")]
    Base {
        /// Its file.
        path: PathBuf,
        /// Why.
        source: Box<LoadError>,
    },
    /// The base model's tokenizer could not be read.
    #[error("reading the tokenizer of {path}: {source}")]
    Tokenizer {
        /// The model file.
        path: PathBuf,
        /// Why.
        source: Box<TokenizerError>,
    },
    /// An expert's adapter could not be loaded or applied.
    #[error("expert {expert}: loading its adapter {path}: {source}")]
    Adapter {
        /// The expert.
        expert: String,
        /// The adapter file.
        path: PathBuf,
        /// Why.
        source: Box<AdapterError>,
    },
    /// A consumer's expert has no adapter.
    #[error("expert {0}: a consumer needs its adapter (experts[].adapter)")]
    NoAdapter(String),
    /// An expert's translator could not be loaded or is for other models.
    #[error("expert {expert}: translator {path}: {source}")]
    Translator {
        /// The expert.
        expert: String,
        /// The translator folder.
        path: PathBuf,
        /// Why.
        source: Box<TranslatorError>,
    },
    /// A translator folder outside every folder the node may load translators from.
    #[error("expert {expert}: translator {path} is outside [models] translator_roots ({roots}): copy it under one of them, or add its folder there")]
    OutsideRoots {
        /// The expert.
        expert: String,
        /// The translator folder.
        path: PathBuf,
        /// The roots in force.
        roots: String,
    },
    /// A translator file over `[limits] translator_mib`.
    #[error("expert {expert}: {} is {bytes} bytes, over [limits] translator_mib ({cap} bytes)", path.display())]
    TooLarge {
        /// The expert.
        expert: String,
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The cap.
        cap: u64,
    },
    /// The producer's compiled documents could not be set up.
    #[error(transparent)]
    Documents(#[from] Box<crate::documents::DocumentSetupError>),
    /// The translator was calibrated for other consumers.
    #[error(
        "expert {expert}: translator {path} was calibrated for consumers [{names}], not {expert}"
    )]
    NotInTranslator {
        /// The expert.
        expert: String,
        /// The translator folder.
        path: PathBuf,
        /// The consumers it has.
        names: String,
    },
}

/// Where a node may load translators from, and how large one may be: `[models]
/// translator_roots` (default: the folders holding the config's translator folders) and
/// `[limits] translator_mib`. A version the store names is a path that anyone who may write
/// the store chooses; without these a node would read any file it can reach, and any amount.
#[derive(Debug, Clone)]
pub struct TranslatorSource {
    roots: Vec<PathBuf>,
    max_bytes: u64,
}

impl TranslatorSource {
    /// The source `config` sets.
    pub fn of(config: &NodeConfig) -> Self {
        let roots = match config.models.translator_roots.is_empty() {
            false => config.models.translator_roots.clone(),
            true => {
                let mut roots: Vec<PathBuf> = config
                    .experts
                    .iter()
                    .filter_map(|e| e.translator.parent().map(Path::to_path_buf))
                    .collect();
                roots.sort();
                roots.dedup();
                roots
            }
        };
        Self {
            roots,
            max_bytes: config.limits.translator_mib.saturating_mul(1 << 20),
        }
    }

    /// The translator folder `dir`, resolved (links followed, so that none leads out of a
    /// root), once it lies under a root and its files are within the cap.
    pub fn folder(&self, expert: &str, dir: &Path) -> Result<PathBuf, ServeError> {
        let io = |path: &Path, source| ServeError::Translator {
            expert: expert.to_owned(),
            path: path.to_owned(),
            source: Box::new(TranslatorError::Io {
                path: path.to_owned(),
                source,
            }),
        };
        let real = dir.canonicalize().map_err(|e| io(dir, e))?;
        let inside = self
            .roots
            .iter()
            .filter_map(|r| r.canonicalize().ok())
            .any(|root| real.starts_with(root));
        if !inside {
            return Err(ServeError::OutsideRoots {
                expert: expert.to_owned(),
                path: dir.to_owned(),
                roots: self
                    .roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        for file in [artifact::WEIGHTS_FILE, artifact::MANIFEST_FILE] {
            let path = real.join(file);
            let bytes = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
            if bytes > self.max_bytes {
                return Err(ServeError::TooLarge {
                    expert: expert.to_owned(),
                    path,
                    bytes,
                    cap: self.max_bytes,
                });
            }
        }
        Ok(real)
    }
}

/// One expert as a node serves it.
pub struct ServedExpert {
    /// Its name (the model id in the cluster).
    pub name: String,
    /// The expert model: base plus adapter (consumer role only).
    pub model: Option<Arc<Llama>>,
    /// Its translator as the config names it, and the expert's index in it (the node then
    /// follows the cluster's live version of the pair).
    pub translator: (Arc<Translator>, usize),
    /// The translator's folder.
    pub dir: PathBuf,
    /// Held-out KL of the modes that send the base's own KV (raw, q4) to this expert, from
    /// the drift report beside its adapter (`drift.json`, written by `scd eval drift`); empty
    /// where there is none.
    pub transfer_kl: BTreeMap<Mode, f64>,
}

/// What a node serves.
pub struct Served {
    /// The base model's id in the cluster: its file name.
    pub base_id: String,
    /// The base model: loaded on a node that runs models (producer or consumer role); `None`
    /// on a node of the other roles only, which reads the file's header and no weights.
    pub base: Option<Arc<Llama>>,
    /// Hex SHA-256 of the base model's file (its record in the cluster).
    pub base_sha256: String,
    /// The base model's hyperparameters (a request's limits: context length, vocabulary).
    pub config: LlamaConfig,
    /// The base model's tokenizer (experts share it).
    pub tokenizer: Tokenizer,
    /// The experts, by name.
    pub experts: BTreeMap<String, ServedExpert>,
    /// The producer's compiled documents (`[documents]`), if it serves any.
    pub documents: Option<Arc<crate::documents::DocumentServer>>,
    /// The kernels its models run on (the binary's choice); translator codes' products follow
    /// the prefill's.
    pub kernels: KernelChoice,
    /// Where it may load translators from.
    pub translator_source: TranslatorSource,
}

impl Served {
    /// Loads what `config`'s roles need, on `kernels`: the base model's weights, experts and
    /// documents on a producer or consumer; on a node of the other roles only the base model's
    /// tokenizer and hyperparameters (its file is read once for its hash, none of it kept).
    pub fn load(config: &NodeConfig, kernels: KernelChoice) -> Result<Self, ServeError> {
        let path = config.models.base.as_ref().ok_or(ServeError::NoBase)?;
        let base_err = |source| ServeError::Base {
            path: path.clone(),
            source: Box::new(source),
        };
        let file = GgufFile::open(path).map_err(base_err)?;
        let tokenizer =
            Tokenizer::from_gguf(file.content()).map_err(|source| ServeError::Tokenizer {
                path: path.clone(),
                source: Box::new(source),
            })?;
        let consumer = config.has_role(NodeRole::Consumer);
        if !consumer && !config.has_role(NodeRole::Producer) {
            // The front roles (gateway, admin, scheduler): the header only.
            return Ok(Self {
                base_id: file_model_id(file.path()),
                base: None,
                base_sha256: file.sha256().to_owned(),
                config: file.config().map_err(base_err)?,
                tokenizer,
                experts: BTreeMap::new(),
                documents: None,
                kernels,
                translator_source: TranslatorSource::of(config),
            });
        }
        let base = file.load_model_with(kernels).map_err(base_err)?;
        let base = Arc::new(base);
        let mode = match config.models.adapter_mode {
            AdapterModeConfig::Merge => AdapterMode::Merge,
            AdapterModeConfig::OnTheFly => AdapterMode::OnTheFly,
            AdapterModeConfig::Auto if config.experts.len() > 1 => AdapterMode::OnTheFly,
            AdapterModeConfig::Auto => AdapterMode::Merge,
        };
        let source = TranslatorSource::of(config);
        let mut experts = BTreeMap::new();
        for e in &config.experts {
            let model = match (consumer, e.adapter_file()) {
                (false, _) => None,
                (true, None) => return Err(ServeError::NoAdapter(e.name.clone())),
                (true, Some(file)) => Some(Arc::new(expert_model(&base, &e.name, &file, mode)?)),
            };
            let translator =
                load_translator(&source, &e.name, &e.translator, &base, model.as_deref())?;
            let transfer_kl = match (consumer, e.adapter_file()) {
                (true, Some(file)) => transfer_kl(&e.name, &file),
                _ => BTreeMap::new(),
            };
            experts.insert(
                e.name.clone(),
                ServedExpert {
                    name: e.name.clone(),
                    model,
                    translator,
                    dir: e.translator.clone(),
                    transfer_kl,
                },
            );
        }
        let documents = match (&config.documents, config.has_role(NodeRole::Producer)) {
            (Some(d), true) => Some(Arc::new(
                crate::documents::DocumentServer::load(d, &base).map_err(Box::new)?,
            )),
            _ => None,
        };
        Ok(Self {
            base_id: model_id(&base),
            base_sha256: base.identity().sha256.clone(),
            config: base.config().clone(),
            base: Some(base),
            tokenizer,
            experts,
            documents,
            kernels,
            translator_source: source,
        })
    }

    /// The base model's weights: there on a producer or consumer, [`ServeError::NoWeights`]
    /// on a node of the other roles only.
    pub fn model(&self) -> Result<&Arc<Llama>, ServeError> {
        self.base.as_ref().ok_or(ServeError::NoWeights)
    }

    /// The cluster's records of these models: the base, and each expert this node has the
    /// model of (a producer knows its experts by name only), with its base.
    pub fn records(&self) -> Vec<ModelRecord> {
        let mut records = vec![ModelRecord {
            id: self.base_id.clone(),
            architecture: "llama".into(),
            weights_hash: self.base_sha256.clone(),
            base: None,
        }];
        for e in self.experts.values() {
            let Some(model) = e.model.as_deref() else {
                continue;
            };
            let weights = model.identity();
            records.push(ModelRecord {
                id: e.name.clone(),
                architecture: "llama".into(),
                weights_hash: weights
                    .adapter_sha256
                    .clone()
                    .unwrap_or_else(|| weights.sha256.clone()),
                base: Some(self.base_id.clone()),
            });
        }
        records
    }
}

/// The held-out KL per mode of the drift report beside `adapter` (`drift.json`: one report,
/// or a list with one per expert), the larger of its WikiText-2 and own-domain measures. A
/// missing or unreadable report only costs `auto` its knowledge of raw transfer to this expert
/// (it then never picks raw, q4 or q2 for it): warned about, not fatal.
fn transfer_kl(expert: &str, adapter: &Path) -> BTreeMap<Mode, f64> {
    let mut kl = BTreeMap::new();
    let Some(path) = adapter.parent().map(|d| d.join("drift.json")) else {
        return kl;
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return kl,
        Err(e) => {
            tracing::warn!(expert, path = %path.display(), error = %e, "reading the drift report failed");
            return kl;
        }
    };
    // Read loosely (the reports' other fields changed over time; these did not).
    let value: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(expert, path = %path.display(), error = %e, "unreadable drift report");
            return kl;
        }
    };
    let reports = match value {
        serde_json::Value::Array(reports) => reports,
        one => vec![one],
    };
    let named = |r: &&serde_json::Value| r["expert"].as_str() == Some(expert);
    let report = match reports.iter().find(named) {
        Some(r) => r,
        // A report of one expert written before reports named theirs.
        None if reports.len() == 1 && reports[0]["expert"].is_null() => &reports[0],
        None => return kl,
    };
    for record in ["transfer", "domain_transfer"] {
        let results = report[record]["results"].as_array().into_iter().flatten();
        for result in results {
            let mode = result["method"]
                .as_str()
                .and_then(|m| m.parse::<Mode>().ok());
            let value = result["kl"]["value"].as_f64().filter(|v| v.is_finite());
            if let (Some(mode @ (Mode::Raw | Mode::Q4 | Mode::Q2)), Some(value)) = (mode, value) {
                let e = kl.entry(mode).or_insert(value);
                *e = e.max(value);
            }
        }
    }
    kl
}

/// A model's id in the cluster: the name of its weight file, which every node of the cluster
/// loads (the records carry the content hash that says it is the same file).
pub fn model_id(model: &Llama) -> String {
    file_model_id(&model.identity().source)
}

/// [`model_id`] of the model in the file `path`.
fn file_model_id(path: &Path) -> String {
    path.file_name()
        .map(|f| f.to_string_lossy().replace(char::is_whitespace, "_"))
        .unwrap_or_else(|| "base".into())
}

fn expert_model(
    base: &Llama,
    name: &str,
    file: &Path,
    mode: AdapterMode,
) -> Result<Llama, ServeError> {
    let err = |source| ServeError::Adapter {
        expert: name.to_owned(),
        path: file.to_owned(),
        source: Box::new(source),
    };
    let adapter = LoraAdapter::load(file, base.config()).map_err(err)?;
    base.with_adapter(&adapter, mode).map_err(err)
}

/// The translator of `name`, checked: against the base and the expert model where the node has
/// it; by the expert's name where it has only the base (a producer).
pub(crate) fn load_translator(
    source: &TranslatorSource,
    name: &str,
    dir: &Path,
    base: &Llama,
    expert: Option<&Llama>,
) -> Result<(Arc<Translator>, usize), ServeError> {
    let err = |source| ServeError::Translator {
        expert: name.to_owned(),
        path: dir.to_owned(),
        source: Box::new(source),
    };
    let t = Translator::load(&source.folder(name, dir)?).map_err(err)?;
    let index = match expert {
        Some(expert) => t.check_pair(base, expert).map_err(err)?,
        None => {
            // check_pair with the base as its own consumer checks the producer side only
            // when it fails on the consumer; the producer is checked on its own here.
            if !t.manifest.producer.matches(base) {
                let e = t.check_pair(base, base).err();
                return Err(err(e.unwrap_or_else(|| {
                    TranslatorError::WrongPair("calibrated with another producer".into())
                })));
            }
            let names = &t.manifest.consumers;
            names.iter().position(|c| c.name == name).ok_or_else(|| {
                ServeError::NotInTranslator {
                    expert: name.to_owned(),
                    path: dir.to_owned(),
                    names: names
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            })?
        }
    };
    Ok((Arc::new(t), index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drift_report_gives_each_raw_kv_modes_worse_kl_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let adapter = dir.path().join("adapter.safetensors");
        let result =
            |method: &str, kl: f64| serde_json::json!({"method": method, "kl": {"value": kl}});
        let report = serde_json::json!([{
            "expert": "mail",
            "transfer": {"results": [result("oracle", 0.0), result("raw", 0.1), result("q4", 0.2),
                                     result("q2", 0.5), result("scd", 0.01)]},
            "domain_transfer": {"results": [result("raw", 0.15), result("q2", 0.4)]},
        }]);
        std::fs::write(dir.path().join("drift.json"), report.to_string()).unwrap();
        let kl = transfer_kl("mail", &adapter);
        let want: BTreeMap<Mode, f64> = [(Mode::Raw, 0.15), (Mode::Q4, 0.2), (Mode::Q2, 0.5)]
            .into_iter()
            .collect();
        assert_eq!(kl, want);
        // Another expert's report, or none, says nothing.
        assert!(transfer_kl("sotu", &adapter).is_empty());
        assert!(transfer_kl("mail", &dir.path().join("none/adapter.safetensors")).is_empty());
    }

    fn translator_folder(at: &Path, weights: usize) -> PathBuf {
        std::fs::create_dir_all(at).unwrap();
        std::fs::write(at.join(artifact::WEIGHTS_FILE), vec![0u8; weights]).unwrap();
        std::fs::write(at.join(artifact::MANIFEST_FILE), b"{}").unwrap();
        at.to_owned()
    }

    #[test]
    fn a_translator_is_taken_only_from_under_a_root_and_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("translators");
        let source = TranslatorSource {
            roots: vec![root.clone()],
            max_bytes: 1000,
        };
        let inside = translator_folder(&root.join("mail/v2"), 1000);
        assert_eq!(
            source.folder("mail", &inside).unwrap(),
            inside.canonicalize().unwrap()
        );
        let outside = translator_folder(&dir.path().join("elsewhere"), 10);
        let e = source.folder("mail", &outside).unwrap_err();
        assert!(matches!(e, ServeError::OutsideRoots { .. }), "{e}");
        assert!(e.to_string().contains("translator_roots"), "{e}");
        // Neither `..` nor a link leads out of a root.
        let dotted = root.join("mail/../../elsewhere");
        let e = source.folder("mail", &dotted).unwrap_err();
        assert!(matches!(e, ServeError::OutsideRoots { .. }), "{e}");
        #[cfg(unix)]
        {
            let link = root.join("link");
            std::os::unix::fs::symlink(&outside, &link).unwrap();
            let e = source.folder("mail", &link).unwrap_err();
            assert!(matches!(e, ServeError::OutsideRoots { .. }), "{e}");
        }
        let large = translator_folder(&root.join("large"), 1001);
        let e = source.folder("mail", &large).unwrap_err();
        assert!(
            matches!(
                e,
                ServeError::TooLarge {
                    bytes: 1001,
                    cap: 1000,
                    ..
                }
            ),
            "{e}"
        );
        let missing = source.folder("mail", &root.join("nothing")).unwrap_err();
        assert!(
            matches!(missing, ServeError::Translator { .. }),
            "{missing}"
        );
    }
}
