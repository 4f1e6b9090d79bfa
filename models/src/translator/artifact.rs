//! A translator on disk: `translator.safetensors` (every tensor) and `translator.json` (the
//! manifest: which models it was calibrated for, ranks, Patch layers, the calibration data and
//! its measured quality, and the weights' content hash). The content hash is the translator
//! version's name on the wire and in the store ([`scd_types::TranslatorHash`]).
//!
//! Loading checks everything a wrong or damaged file could break: the hash of the weights and
//! the manifest against the one the manifest names ([`content_hash`]), every tensor's presence and shape, and, before use, that the producer
//! and consumer models are the ones it was made for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
pub use scd_types::Ranks;
use scd_types::TranslatorHash;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::aligner::Aligner;
use super::low_rank::LowRankCode;
use super::TranslatorError;
use crate::json_file;
use crate::llama::Llama;

/// The weights file inside a translator folder.
pub const WEIGHTS_FILE: &str = "translator.safetensors";
/// The manifest inside a translator folder.
pub const MANIFEST_FILE: &str = "translator.json";
/// The manifest format this build reads and writes. 2: the content hash covers the manifest
/// as well as the weights (1: the weights only, so that a changed manifest, say another
/// consumer's name or rank curve, passed for the same version).
pub const FORMAT: u32 = 2;

/// A translator's identity: SHA-256 over a tag, the SHA-256 of its weights file and its
/// manifest file as written, with the hash's own digits zeroed (`manifest_text`; trailing
/// white space aside). Both files count: the manifest says which layers are patched, whom the
/// aligners are for and what quality each rank has. The text, not the parsed manifest, is
/// hashed: JSON's floats need not parse back to the very bits they were written from.
pub fn content_hash(weights: &[u8], manifest_text: &str) -> TranslatorHash {
    let mut h = Sha256::new();
    h.update(b"scd translator 2\0");
    h.update(Sha256::digest(weights));
    h.update(manifest_text.trim_end().as_bytes());
    TranslatorHash::from_bytes(h.finalize().into())
}

/// The hash digits in a manifest's text.
const BLANK_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// A model as a translator names it: its weight file's hash and, for an expert, its adapter's
/// content hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRef {
    /// The weight file's name (for people; not checked).
    pub file: String,
    /// Hex SHA-256 of the weight file.
    pub sha256: String,
    /// The adapter's content hash, for an expert.
    #[serde(default)]
    pub adapter_sha256: Option<String>,
}

impl ModelRef {
    /// The reference of a loaded model (base plus adapter, if any).
    pub fn of(model: &Llama) -> Self {
        let id = model.identity();
        Self {
            file: id.file_name(),
            sha256: id.sha256.clone(),
            adapter_sha256: id.adapter_sha256.clone(),
        }
    }

    /// Whether `model` is this model.
    pub fn matches(&self, model: &Llama) -> bool {
        let id = model.identity();
        id.sha256 == self.sha256 && id.adapter_sha256 == self.adapter_sha256
    }

    fn describe(&self) -> String {
        let short = |h: &str| h[..h.len().min(12)].to_string();
        match &self.adapter_sha256 {
            Some(a) => format!(
                "{} ({}) + adapter {}",
                self.file,
                short(&self.sha256),
                short(a)
            ),
            None => format!("{} ({})", self.file, short(&self.sha256)),
        }
    }
}

/// One consumer of a translator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerRef {
    /// The expert's name (its folder's name).
    pub name: String,
    /// Its model.
    pub model: ModelRef,
}

/// Where the calibration data came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationInfo {
    /// Corpus name.
    pub corpus: String,
    /// Which split was used and how prefixes were cut from it.
    pub split: String,
    /// Hex SHA-256 of that split's text.
    pub text_sha256: String,
    /// Prefixes the factorisations and aligners were fitted on.
    pub prefixes: usize,
    /// Held-out prefixes (aligner early stopping, layer selection).
    pub heldout: usize,
    /// Tokens per prefix.
    pub prefix_tokens: usize,
    /// Calibration tokens in all.
    pub tokens: u64,
    /// Seconds the calibration took.
    pub seconds: f64,
    /// Share of the prompts (fitting and held-out) wrapped as chat turns (0 for translators
    /// from before the option).
    #[serde(default)]
    pub chat_share: f64,
}

/// The manifest of a translator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TranslatorManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// scd version that calibrated it.
    pub scd_version: String,
    /// A label for people (the hash is what identifies it).
    pub version: String,
    /// The version's identity: [`content_hash`] of the weights file and this manifest.
    pub content_hash: TranslatorHash,
    /// The producer (base) model.
    pub producer: ModelRef,
    /// The consumers, in the order of their decoders.
    pub consumers: Vec<ConsumerRef>,
    /// Layers of the architecture.
    pub layers: usize,
    /// Width of K and V rows.
    pub kv_dim: usize,
    /// Width of `H_in` rows.
    pub hidden: usize,
    /// Highest ranks stored.
    pub r_max: Ranks,
    /// Ranks a request uses unless it asks for others.
    pub default_ranks: Ranks,
    /// Layers rebuilt by Patch in mode `scd` unless a request asks for another budget.
    pub patch_layers: Vec<usize>,
    /// Every layer with a Patch translator, in the order the greedy choice added them: a
    /// request's Patch budget `k` takes the first `k`.
    pub patch_order: Vec<usize>,
    /// Layer blocks `[start, end)` recomputed by the consumer in mode `droidspeak`.
    pub droidspeak_blocks: Vec<(usize, usize)>,
    /// Whether codes are centred on the calibration means.
    pub centre: bool,
    /// Relative ridge strength of the encoders.
    pub ridge: f64,
    /// The calibration data.
    pub calibration: CalibrationInfo,
    /// What calibration measured (curves, aligner losses), free-form for people and docs.
    #[serde(default)]
    pub metrics: serde_json::Value,
    /// How the weights file stores its tensors (they are f32 in memory either way).
    #[serde(default)]
    pub weights_dtype: WeightsDtype,
    /// Held-out quality at a grid of ranks ([`super::rank_curve`]), what a producer needs to
    /// size codes for a link; absent in translators measured before it existed (`scd
    /// translators curve` adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_curve: Option<super::rank_curve::RankCurve>,
    /// Step scales of transform-coded codes and their held-out quality and size at a ladder
    /// of rates ([`super::rate_table`]); absent in translators measured before it existed
    /// (`scd translators rates` adds it; producers then use default scales).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_table: Option<super::rate_table::RateTable>,
    /// The base's own basis for the `kvtc` mode ([`super::kvtc`]); absent in translators
    /// without one (`scd translators kvtc` adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvtc: Option<super::kvtc::KvtcInfo>,
}

/// The storage type of a translator's weights file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsDtype {
    /// Full precision (translators written before this field existed).
    #[default]
    F32,
    /// Half the bytes; the rounding (relative 2^-9) is far below the codes' own error, which
    /// `weights_in_bf16_round_trip_within_their_precision` and BENCHMARKS.md measure.
    Bf16,
}

impl std::str::FromStr for WeightsDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(WeightsDtype::Bf16),
            "f32" => Ok(WeightsDtype::F32),
            other => Err(format!("{other}: expected bf16 or f32")),
        }
    }
}

impl WeightsDtype {
    fn dtype(self) -> DType {
        match self {
            WeightsDtype::F32 => DType::F32,
            WeightsDtype::Bf16 => DType::BF16,
        }
    }
}

/// One Patch layer: the code of `H_in` and an aligner per consumer.
#[derive(Debug, Clone)]
pub struct PatchLayer {
    /// The low-rank code of `H_in`.
    pub h: LowRankCode,
    /// Per consumer.
    pub aligners: Vec<Aligner>,
}

/// One layer of a translator.
#[derive(Debug, Clone)]
pub struct LayerTranslator {
    /// Reuse code of K before RoPE.
    pub k: LowRankCode,
    /// Reuse code of V.
    pub v: LowRankCode,
    /// Patch, for the layers in the manifest's `patch_layers`.
    pub patch: Option<PatchLayer>,
}

/// A translator in memory.
#[derive(Debug, Clone)]
pub struct Translator {
    /// Its manifest.
    pub manifest: TranslatorManifest,
    /// Per layer.
    pub layers: Vec<LayerTranslator>,
    /// Per layer, the base's own bases for `kvtc`, when the manifest has `kvtc`.
    pub kvtc: Option<Vec<super::kvtc::KvtcLayer>>,
}

fn low_rank_tensors(
    name: &str,
    c: &LowRankCode,
    out: &mut Vec<(String, Tensor)>,
) -> candle_core::Result<()> {
    out.push((format!("{name}.mean_a"), c.mean_a.clone()));
    out.push((format!("{name}.enc"), c.enc.clone()));
    let eig: Vec<f32> = c.eigenvalues.iter().map(|&e| e as f32).collect();
    out.push((
        format!("{name}.eig"),
        Tensor::from_vec(eig, c.eigenvalues.len(), &Device::Cpu)?,
    ));
    for (e, (m, d)) in c.means_b.iter().zip(&c.decs).enumerate() {
        out.push((format!("{name}.mean_b.{e}"), m.clone()));
        out.push((format!("{name}.dec.{e}"), d.clone()));
    }
    Ok(())
}

fn low_rank_from(
    name: &str,
    experts: usize,
    (d_a, d_b, r): (usize, usize, usize),
    take: &mut impl FnMut(&str, &[usize]) -> Result<Tensor, TranslatorError>,
) -> Result<LowRankCode, TranslatorError> {
    let mut means_b = Vec::with_capacity(experts);
    let mut decs = Vec::with_capacity(experts);
    for e in 0..experts {
        means_b.push(take(&format!("{name}.mean_b.{e}"), &[d_b])?);
        decs.push(take(&format!("{name}.dec.{e}"), &[r, d_b])?);
    }
    let eigenvalues = take(&format!("{name}.eig"), &[r])?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect();
    Ok(LowRankCode {
        mean_a: take(&format!("{name}.mean_a"), &[d_a])?,
        enc: take(&format!("{name}.enc"), &[d_a, r])?,
        means_b,
        decs,
        eigenvalues,
    })
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TranslatorError + '_ {
    move |source| TranslatorError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Translator {
    /// The consumer index of `consumer`, after checking that `producer` and `consumer` are the
    /// models this translator was calibrated for.
    pub fn check_pair(&self, producer: &Llama, consumer: &Llama) -> Result<usize, TranslatorError> {
        let m = &self.manifest;
        if !m.producer.matches(producer) {
            return Err(TranslatorError::WrongPair(format!(
                "calibrated with producer {}, given {}",
                m.producer.describe(),
                ModelRef::of(producer).describe()
            )));
        }
        m.consumers
            .iter()
            .position(|c| c.model.matches(consumer))
            .ok_or_else(|| {
                TranslatorError::WrongPair(format!(
                    "calibrated for consumers [{}], given {}",
                    m.consumers
                        .iter()
                        .map(|c| format!("{}: {}", c.name, c.model.describe()))
                        .collect::<Vec<_>>()
                        .join(", "),
                    ModelRef::of(consumer).describe()
                ))
            })
    }

    /// The Patch layers of a budget of `k` layers (the first `k` of the greedy order); the
    /// translator's default set without one.
    pub fn patch_set(&self, k: Option<usize>) -> Result<Vec<usize>, TranslatorError> {
        let m = &self.manifest;
        let mut set = match k {
            None => m.patch_layers.clone(),
            Some(k) if k <= m.patch_order.len() => m.patch_order[..k].to_vec(),
            Some(k) => {
                return Err(TranslatorError::Ranks(format!(
                    "a Patch budget of {k} layers, the translator has {}",
                    m.patch_order.len()
                )))
            }
        };
        set.sort_unstable();
        Ok(set)
    }

    /// Checks requested ranks against what is stored.
    pub fn check_ranks(&self, r: Ranks) -> Result<(), TranslatorError> {
        let max = self.manifest.r_max;
        if r.k == 0 || r.v == 0 || r.k > max.k || r.v > max.v || r.h > max.h || r.h == 0 {
            return Err(TranslatorError::Ranks(format!(
                "asked for K {} / V {} / H {}, the translator stores 1..={} / 1..={} / 1..={}",
                r.k, r.v, r.h, max.k, max.v, max.h
            )));
        }
        Ok(())
    }

    /// Writes `dir/translator.safetensors` (in the manifest's `weights_dtype`) and
    /// `dir/translator.json`, filling in the manifest's content hash, and takes the weights
    /// back as stored, so that this translator computes what a loaded copy computes. Returns
    /// the hash.
    pub fn save(&mut self, dir: &Path) -> Result<TranslatorHash, TranslatorError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut tensors = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            low_rank_tensors(&format!("layer.{l}.k"), &layer.k, &mut tensors)?;
            low_rank_tensors(&format!("layer.{l}.v"), &layer.v, &mut tensors)?;
            if let Some(p) = &layer.patch {
                low_rank_tensors(&format!("layer.{l}.h"), &p.h, &mut tensors)?;
                for (e, a) in p.aligners.iter().enumerate() {
                    tensors.extend(a.tensors(&format!("layer.{l}.h.aligner.{e}")));
                }
            }
        }
        if self.kvtc.is_some() != self.manifest.kvtc.is_some() {
            return Err(TranslatorError::Corrupt(
                "a kvtc basis without its manifest entry, or the other way round".into(),
            ));
        }
        for (l, layer) in self.kvtc.iter().flatten().enumerate() {
            super::kvtc::tensors(l, layer, &mut tensors)?;
        }
        let tensors = tensors
            .into_iter()
            .map(|(n, t)| {
                Ok((
                    n,
                    t.to_dtype(self.manifest.weights_dtype.dtype())?
                        .contiguous()?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n, t)), None)
            .map_err(|e| TranslatorError::Corrupt(e.to_string()))?;
        self.manifest.format = FORMAT;
        self.manifest.content_hash = TranslatorHash::from_bytes([0; 32]);
        let blank = serde_json::to_string_pretty(&self.manifest)
            .map_err(|e| TranslatorError::Corrupt(e.to_string()))?;
        let hash = content_hash(&bytes, &blank);
        let path = dir.join(WEIGHTS_FILE);
        let tmp = dir.join(format!("{WEIGHTS_FILE}.tmp"));
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        self.manifest.content_hash = hash;
        json_file::write_atomic(&dir.join(MANIFEST_FILE), &self.manifest)
            .map_err(|e| TranslatorError::Corrupt(e.to_string()))?;
        if self.manifest.weights_dtype != WeightsDtype::F32 {
            *self = Self::load(dir)?;
        }
        Ok(hash)
    }

    /// Reads a translator folder, checking the weights against the manifest's hash and every
    /// tensor's shape.
    pub fn load(dir: &Path) -> Result<Self, TranslatorError> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&manifest_path).map_err(io(&manifest_path))?;
        let manifest: TranslatorManifest = serde_json::from_str(&text)
            .map_err(|e| TranslatorError::Corrupt(format!("{}: {e}", manifest_path.display())))?;
        if manifest.format != FORMAT {
            return Err(TranslatorError::Corrupt(format!(
                "{}: format {}, this build reads {FORMAT}",
                manifest_path.display(),
                manifest.format
            )));
        }
        let path: PathBuf = dir.join(WEIGHTS_FILE);
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        let digits = manifest.content_hash.to_string();
        let hash = content_hash(&bytes, &text.replacen(&digits, BLANK_HASH, 1));
        if hash != manifest.content_hash {
            return Err(TranslatorError::Corrupt(format!(
                "{} with {MANIFEST_FILE} hash to {}, the manifest says {}: a file is damaged, changed, or belongs to another version",
                path.display(),
                hash.short(),
                manifest.content_hash.short()
            )));
        }
        let mut tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
                .map_err(|e| TranslatorError::Corrupt(format!("{}: {e}", path.display())))?;
        let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, TranslatorError> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| TranslatorError::Corrupt(format!("missing tensor {name}")))?;
            if !shape.is_empty() && t.dims() != shape {
                return Err(TranslatorError::Corrupt(format!(
                    "tensor {name} is {:?}, expected {shape:?}",
                    t.dims()
                )));
            }
            Ok(t.to_dtype(DType::F32)?)
        };
        let m = &manifest;
        let experts = m.consumers.len();
        if experts == 0 || m.layers == 0 {
            return Err(TranslatorError::Corrupt("no consumers or no layers".into()));
        }
        let mut layers = Vec::with_capacity(m.layers);
        for l in 0..m.layers {
            let kv = (m.kv_dim, m.kv_dim, m.r_max.k);
            let k = low_rank_from(&format!("layer.{l}.k"), experts, kv, &mut take)?;
            let kv = (m.kv_dim, m.kv_dim, m.r_max.v);
            let v = low_rank_from(&format!("layer.{l}.v"), experts, kv, &mut take)?;
            let patch = if m.patch_order.contains(&l) {
                let hs = (m.hidden, m.hidden, m.r_max.h);
                let h = low_rank_from(&format!("layer.{l}.h"), experts, hs, &mut take)?;
                let aligners = (0..experts)
                    .map(|e| {
                        Aligner::from_tensors(&format!("layer.{l}.h.aligner.{e}"), |n| take(n, &[]))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some(PatchLayer { h, aligners })
            } else {
                None
            };
            layers.push(LayerTranslator { k, v, patch });
        }
        let kvtc = match m.kvtc {
            Some(_) => Some(
                (0..m.layers)
                    .map(|l| super::kvtc::from_tensors(l, m.kv_dim, &mut take))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        if m.patch_order.iter().any(|&l| l >= m.layers)
            || m.patch_layers.iter().any(|l| !m.patch_order.contains(l))
            || m.droidspeak_blocks
                .iter()
                .any(|&(s, e)| s >= e || e > m.layers)
        {
            return Err(TranslatorError::Corrupt(
                "layer indices out of range".into(),
            ));
        }
        Ok(Self {
            manifest,
            layers,
            kvtc,
        })
    }

    /// The content hash (the version's identity).
    pub fn hash(&self) -> TranslatorHash {
        self.manifest.content_hash
    }
}
