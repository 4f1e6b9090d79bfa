//! An expert on disk: a folder with the LoRA adapter (`adapter.safetensors` in PEFT layout and
//! its `adapter_config.json`) and `manifest.json`, which says what base it adapts, what corpus
//! and hyperparameters trained it, how it validated, and the adapter file's hash.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::error::AdapterError;
use crate::json_file::{self, JsonFileError};
use crate::llama::{Llama, Proj};
use crate::lora::LoraAdapter;
use crate::train::TrainConfig;

/// The adapter file's name inside an expert folder.
pub const ADAPTER_FILE: &str = "adapter.safetensors";
/// The manifest's name inside an expert folder.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The manifest written beside a trained adapter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// scd version that trained it.
    pub scd_version: String,
    /// The base model.
    pub base_model: BaseModelInfo,
    /// The corpus.
    pub corpus: CorpusInfo,
    /// Hyperparameters.
    pub hyperparameters: TrainConfig,
    /// Adapted projections (Hugging Face module names) of every layer.
    pub targets: Vec<String>,
    /// Steps done.
    pub steps: usize,
    /// Mean training loss of the last (up to) 10 steps.
    pub final_train_loss: f64,
    /// Validation of base and expert on the same windows.
    pub validation: ValidationInfo,
    /// Seconds of optimisation steps (excluding tokenisation and validation).
    pub train_seconds: f64,
    /// Wall time of the whole command, seconds (this invocation only when resumed).
    pub wall_seconds: f64,
    /// Mean seconds per step.
    pub seconds_per_step: f64,
    /// The adapter file: name, dtype, bytes, sha256.
    pub adapter: AdapterFileInfo,
}

/// Base model identity.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BaseModelInfo {
    /// File name.
    pub file: String,
    /// Hex SHA-256 of the file.
    pub sha256: String,
}

impl BaseModelInfo {
    /// The identity of a loaded model.
    pub fn of(model: &Llama) -> Self {
        let id = model.identity();
        Self {
            file: id.file_name(),
            sha256: id.sha256.clone(),
        }
    }
}

/// Corpus identity and split.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CorpusInfo {
    /// Name or path as given.
    pub name: String,
    /// Hex SHA-256 of the train text.
    pub train_sha256: String,
    /// Hex SHA-256 of the validation text.
    pub valid_sha256: String,
    /// How the splits were made.
    pub split_rule: String,
    /// Tokens in the train split.
    pub train_tokens: usize,
    /// Tokens in the validation split.
    pub valid_tokens: usize,
}

/// Validation of base and expert.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ValidationInfo {
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Base mean cross-entropy (nats).
    pub base_loss: f64,
    /// Base perplexity.
    pub base_perplexity: f64,
    /// Expert (shipped adapter, as stored) mean cross-entropy.
    pub expert_loss: f64,
    /// Expert perplexity.
    pub expert_perplexity: f64,
    /// `1 - expert / base` perplexity.
    pub perplexity_reduction: f64,
}

/// The stored adapter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AdapterFileInfo {
    /// File name beside the manifest.
    pub file: String,
    /// `f32` or `bf16`.
    pub dtype: String,
    /// Size.
    pub bytes: u64,
    /// Hex SHA-256.
    pub sha256: String,
}

impl Manifest {
    /// Reads `manifest.json`.
    pub fn load(path: &Path) -> Result<Self, JsonFileError> {
        json_file::read(path)
    }

    /// Writes it atomically.
    pub fn save(&self, path: &Path) -> Result<(), JsonFileError> {
        json_file::write_atomic(path, self)
    }
}

/// Saves `adapter` (already in its storage dtype) as `dir/adapter.safetensors` (through a
/// temporary file) with an `adapter_config.json` beside it, and describes the file.
pub fn save_adapter(
    adapter: &LoraAdapter,
    base: &Llama,
    dir: &Path,
    dtype: DType,
) -> Result<AdapterFileInfo, AdapterError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| AdapterError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(ADAPTER_FILE);
    let tmp = dir.join(format!("{ADAPTER_FILE}.tmp"));
    adapter.save(&tmp, base.config())?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    // PEFT's config names the projections the adapter has, and the layers when not all.
    let targets: BTreeSet<(usize, Proj)> = adapter.targets().collect();
    let modules: Vec<&str> = Proj::ALL
        .iter()
        .filter(|p| targets.iter().any(|(_, q)| q == *p))
        .map(|p| p.hf_name().rsplit('.').next().unwrap_or(""))
        .collect();
    let layers: BTreeSet<usize> = targets.iter().map(|(l, _)| *l).collect();
    let mut cfg = serde_json::json!({
        "peft_type": "LORA",
        "r": adapter.rank(),
        "lora_alpha": adapter.alpha(),
        "target_modules": modules,
        "bias": "none",
    });
    if layers.len() < base.config().num_layers {
        cfg["layers_to_transform"] = serde_json::json!(layers);
    }
    let side = dir.join("adapter_config.json");
    json_file::write_atomic(&side, &cfg).map_err(|e| AdapterError::Format {
        path: side.clone(),
        reason: e.to_string(),
    })?;
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    Ok(AdapterFileInfo {
        file: ADAPTER_FILE.into(),
        dtype: format!("{dtype:?}").to_lowercase(),
        bytes: bytes.len() as u64,
        sha256: crate::corpus::sha256_hex(&bytes),
    })
}

/// The adapter and manifest paths of an expert folder.
pub fn expert_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join(ADAPTER_FILE), dir.join(MANIFEST_FILE))
}
