//! LoRA adapters on every linear projection of every block: an expert is the base model plus an
//! adapter.
//!
//! On disk an adapter uses PEFT's names and layout
//! (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, `..lora_B.weight`, MLP
//! `gate_proj`/`up_proj`/`down_proj`), with rank and alpha from an `adapter_config.json` beside
//! the file or from the file's metadata (`r`, `lora_alpha`). PEFT adapters are trained on
//! half-split Hugging Face checkpoints, so the rows of the q and k `B` matrices are permuted to
//! this crate's interleaved layout at load and back at save.
//!
//! An adapter applies in one of two ways: merged into the f32 weights (`W + scale * B A`, no
//! cost per token), or on the fly (`x W^T + scale * (x A^T) B^T`), which keeps the base weights
//! shared between experts and keeps the adapter's tensors in the autograd graph, so an adapter
//! built from `candle_core::Var`s can be trained through the model.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::config::LlamaConfig;
use crate::decode_weights::DecodeWeights;
use crate::error::AdapterError;
use crate::hf::{to_half_split_rows, to_interleaved_rows};
use crate::llama::{Llama, LoraDelta, Proj};

const PREFIX: &str = "base_model.model.model.layers.";

/// How an adapter is combined with the base weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterMode {
    /// Fold `scale * B A` into the weights: fastest, but the expert owns a full weight copy.
    Merge,
    /// Keep `A`, `B` apart and add their term in every forward pass: base weights shared,
    /// differentiable with respect to the adapter.
    OnTheFly,
}

/// A LoRA adapter: per (layer, projection) a pair `A (rank, in)`, `B (out, rank)`, with `B`'s
/// rows in the model's internal (interleaved RoPE) layout, and optionally a RoPE base of its
/// own.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    rank: usize,
    alpha: f64,
    weights: BTreeMap<(usize, Proj), (Tensor, Tensor)>,
    /// The expert rotates with this base instead of the base model's, as long-context fine-tunes
    /// do (MistralLite: 10^6 over Mistral's 10^4). Stored in the file's metadata (`rope_theta`):
    /// PEFT has no field for it, a Hugging Face user sets it in the model's config.
    rope_theta: Option<f64>,
}

/// The PEFT name of one LoRA matrix (`which` is `'A'` or `'B'`).
pub fn peft_name(layer: usize, proj: Proj, which: char) -> String {
    format!("{PREFIX}{layer}.{}.lora_{which}.weight", proj.hf_name())
}

impl LoraAdapter {
    /// Builds an adapter from `(A, B)` pairs in the internal layout, checking every shape
    /// against `cfg` (errors name the tensor in PEFT naming). Tensors may come from
    /// `candle_core::Var`s for training.
    pub fn from_parts(
        cfg: &LlamaConfig,
        rank: usize,
        alpha: f64,
        weights: BTreeMap<(usize, Proj), (Tensor, Tensor)>,
    ) -> Result<Self, AdapterError> {
        if rank == 0 || !alpha.is_finite() {
            return Err(AdapterError::Hyper(format!("rank {rank}, alpha {alpha}")));
        }
        let adapter = Self {
            rank,
            alpha,
            weights,
            rope_theta: None,
        };
        adapter.check(cfg)?;
        Ok(adapter)
    }

    /// A fresh adapter on `targets` of every layer, initialised as PEFT does: `A` uniform in
    /// `±1/sqrt(in)` from a seeded generator, `B` zero, so it starts as the identity edit.
    pub fn init(
        cfg: &LlamaConfig,
        rank: usize,
        alpha: f64,
        targets: &[Proj],
        seed: u64,
    ) -> Result<Self, AdapterError> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut weights = BTreeMap::new();
        for layer in 0..cfg.num_layers {
            for &proj in targets {
                let (out, inp) = proj.shape(cfg);
                let bound = 1.0 / (inp as f32).sqrt();
                let a: Vec<f32> = (0..rank * inp)
                    .map(|_| rng.gen_range(-bound..bound))
                    .collect();
                let a = Tensor::from_vec(a, (rank, inp), &Device::Cpu)?;
                let b = Tensor::zeros((out, rank), DType::F32, &Device::Cpu)?;
                weights.insert((layer, proj), (a, b));
            }
        }
        Self::from_parts(cfg, rank, alpha, weights)
    }

    /// Loads a PEFT safetensors file for `cfg`'s model.
    pub fn load(path: impl AsRef<Path>, cfg: &LlamaConfig) -> Result<Self, AdapterError> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|source| AdapterError::Io {
            path: path.clone(),
            source,
        })?;
        let format = |reason: String| AdapterError::Format {
            path: path.clone(),
            reason,
        };
        let (_, header) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| format(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| format(e.to_string()))?;
        let side = read_adapter_config(&path)?;
        let rank = side
            .as_ref()
            .and_then(|c| c.get("r").and_then(|v| v.as_u64()))
            .or_else(|| meta.get("r").and_then(|s| s.parse().ok()))
            .ok_or(AdapterError::MissingConfig {
                path: path.clone(),
                what: "rank",
            })? as usize;
        let alpha = side
            .as_ref()
            .and_then(|c| c.get("lora_alpha").and_then(|v| v.as_f64()))
            .or_else(|| meta.get("lora_alpha").and_then(|s| s.parse().ok()))
            .ok_or(AdapterError::MissingConfig {
                path: path.clone(),
                what: "alpha",
            })?;
        let adapter = Self::from_peft_tensors(cfg, rank, alpha, tensors)?;
        match meta.get("rope_theta") {
            None => Ok(adapter),
            Some(s) => match s.parse::<f64>() {
                Ok(theta) => adapter.with_rope_theta(Some(theta)),
                Err(_) => Err(format(format!("rope_theta {s:?} is not a number"))),
            },
        }
    }

    /// This adapter with its own RoPE base (`None`: the base model's).
    pub fn with_rope_theta(mut self, theta: Option<f64>) -> Result<Self, AdapterError> {
        if let Some(t) = theta {
            if !(t.is_finite() && t > 1.0) {
                return Err(AdapterError::Hyper(format!("rope_theta {t}")));
            }
        }
        self.rope_theta = theta;
        Ok(self)
    }

    /// The expert's own RoPE base, when it has one.
    pub fn rope_theta(&self) -> Option<f64> {
        self.rope_theta
    }

    /// Builds an adapter from tensors in PEFT naming and layout (half-split q/k rows).
    pub fn from_peft_tensors(
        cfg: &LlamaConfig,
        rank: usize,
        alpha: f64,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Self, AdapterError> {
        let mut weights = BTreeMap::new();
        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        for name in names {
            let Some((layer, proj, which)) = parse_peft_name(&name, cfg)? else {
                continue;
            };
            if which != 'A' {
                continue;
            }
            let b_name = name.replacen("lora_A", "lora_B", 1);
            let a = tensors
                .remove(&name)
                .ok_or_else(|| AdapterError::Unpaired {
                    name: name.clone(),
                    missing: name.clone(),
                })?;
            let b = tensors
                .remove(&b_name)
                .ok_or_else(|| AdapterError::Unpaired {
                    name: name.clone(),
                    missing: b_name.clone(),
                })?;
            let a = a.to_dtype(DType::F32)?;
            let b = b.to_dtype(DType::F32)?;
            let (out, _) = proj.shape(cfg);
            if b.dims().len() != 2 || b.dim(0)? != out {
                return Err(AdapterError::Shape {
                    tensor: b_name,
                    got: b.dims().to_vec(),
                    expected: vec![out, rank],
                });
            }
            let b = match proj {
                Proj::Q => to_interleaved_rows(&b, cfg.num_heads)?,
                Proj::K => to_interleaved_rows(&b, cfg.num_kv_heads)?,
                _ => b,
            };
            weights.insert((layer, proj), (a, b));
        }
        // Every A has been paired and removed: a lora tensor left over is a B without its A.
        if let Some(name) = tensors.keys().find(|n| n.contains("lora_B")).cloned() {
            return Err(AdapterError::Unpaired {
                missing: name.replacen("lora_B", "lora_A", 1),
                name,
            });
        }
        Self::from_parts(cfg, rank, alpha, weights)
    }

    /// Writes the adapter in PEFT naming and layout, with `r` and `lora_alpha` in the file's
    /// metadata.
    pub fn save(&self, path: impl AsRef<Path>, cfg: &LlamaConfig) -> Result<(), AdapterError> {
        let path = path.as_ref();
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for (&(layer, proj), (a, b)) in &self.weights {
            let b = match proj {
                Proj::Q => to_half_split_rows(b, cfg.num_heads)?,
                Proj::K => to_half_split_rows(b, cfg.num_kv_heads)?,
                _ => b.clone(),
            };
            out.push((peft_name(layer, proj, 'A'), a.contiguous()?));
            out.push((peft_name(layer, proj, 'B'), b.contiguous()?));
        }
        let mut meta = HashMap::from([
            ("r".to_string(), self.rank.to_string()),
            ("lora_alpha".to_string(), self.alpha.to_string()),
        ]);
        if let Some(theta) = self.rope_theta {
            meta.insert("rope_theta".to_string(), theta.to_string());
        }
        safetensors::serialize_to_file(out.iter().map(|(n, t)| (n, t)), Some(meta), path).map_err(
            |e| AdapterError::Format {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
        )
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Alpha.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// `alpha / rank`, the factor of the adapter's term.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// `(A, B)` of one projection, internal layout.
    pub fn get(&self, layer: usize, proj: Proj) -> Option<(&Tensor, &Tensor)> {
        self.weights.get(&(layer, proj)).map(|(a, b)| (a, b))
    }

    /// SHA-256 (hex) of the adapter's content: rank, alpha, every matrix as f32 in
    /// (layer, projection) order, and the RoPE base when it has its own (adapters without one
    /// keep the hashes they had before the field existed). The same for the same adapter however
    /// it was stored (bf16 or f32 file, in memory), so an expert's identity does not depend on
    /// the file format.
    pub fn content_sha256(&self) -> Result<String, AdapterError> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update((self.rank as u64).to_le_bytes());
        h.update(self.alpha.to_le_bytes());
        for (&(layer, proj), (a, b)) in &self.weights {
            h.update((layer as u64).to_le_bytes());
            h.update(proj.hf_name().as_bytes());
            for t in [a, b] {
                for x in t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                    h.update(x.to_le_bytes());
                }
            }
        }
        if let Some(theta) = self.rope_theta {
            h.update(b"rope_theta");
            h.update(theta.to_le_bytes());
        }
        Ok(hex::encode(h.finalize()))
    }

    /// Every adapted projection.
    pub fn targets(&self) -> impl Iterator<Item = (usize, Proj)> + '_ {
        self.weights.keys().copied()
    }

    fn check(&self, cfg: &LlamaConfig) -> Result<(), AdapterError> {
        for (&(layer, proj), (a, b)) in &self.weights {
            if layer >= cfg.num_layers {
                return Err(AdapterError::UnknownTensor {
                    name: peft_name(layer, proj, 'A'),
                    reason: format!("the model has {} layers", cfg.num_layers),
                });
            }
            let (out, inp) = proj.shape(cfg);
            if a.dims() != [self.rank, inp] {
                return Err(AdapterError::Shape {
                    tensor: peft_name(layer, proj, 'A'),
                    got: a.dims().to_vec(),
                    expected: vec![self.rank, inp],
                });
            }
            if b.dims() != [out, self.rank] {
                return Err(AdapterError::Shape {
                    tensor: peft_name(layer, proj, 'B'),
                    got: b.dims().to_vec(),
                    expected: vec![out, self.rank],
                });
            }
        }
        Ok(())
    }
}

/// `(layer, projection, 'A' | 'B')` of a PEFT LoRA tensor name; `None` for tensors that are not
/// LoRA matrices (PEFT also stores e.g. modules saved in full, which this crate ignores).
fn parse_peft_name(
    name: &str,
    cfg: &LlamaConfig,
) -> Result<Option<(usize, Proj, char)>, AdapterError> {
    if !name.contains("lora_A") && !name.contains("lora_B") {
        return Ok(None);
    }
    let unknown = |reason: &str| AdapterError::UnknownTensor {
        name: name.into(),
        reason: reason.into(),
    };
    let rest = name
        .strip_prefix(PREFIX)
        .ok_or_else(|| unknown("expected the prefix base_model.model.model.layers."))?;
    let (layer, rest) = rest
        .split_once('.')
        .ok_or_else(|| unknown("no layer index"))?;
    let layer: usize = layer.parse().map_err(|_| unknown("bad layer index"))?;
    if layer >= cfg.num_layers {
        return Err(unknown(&format!("the model has {} layers", cfg.num_layers)));
    }
    let proj = Proj::ALL
        .into_iter()
        .find(|p| rest.starts_with(&format!("{}.lora_", p.hf_name())))
        .ok_or_else(|| unknown("not one of q/k/v/o/gate/up/down_proj"))?;
    let which = if rest.contains(".lora_A.") { 'A' } else { 'B' };
    Ok(Some((layer, proj, which)))
}

fn read_adapter_config(path: &Path) -> Result<Option<serde_json::Value>, AdapterError> {
    let side: PathBuf = path
        .parent()
        .map(|p| p.join("adapter_config.json"))
        .unwrap_or_else(|| PathBuf::from("adapter_config.json"));
    match std::fs::read(&side) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| AdapterError::Format {
                path: side,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AdapterError::Io { path: side, source }),
    }
}

impl Llama {
    /// This model with `adapter` applied. The result shares every weight the adapter does not
    /// touch (and, on the fly, all of them) with `self`.
    pub fn with_adapter(
        &self,
        adapter: &LoraAdapter,
        mode: AdapterMode,
    ) -> Result<Llama, AdapterError> {
        adapter.check(&self.cfg)?;
        let mut model = self.clone();
        model.identity.adapter_sha256 = Some(adapter.content_sha256()?);
        if let Some(theta) = adapter.rope_theta {
            model.cfg.rope_theta = theta;
            model.rope = crate::rope::Rope::with_params(model.cfg.head_dim, theta);
        }
        let scale = adapter.scale();
        for (&(layer, proj), (a, b)) in &adapter.weights {
            let lin = model.blocks[layer].linear_mut(proj);
            match mode {
                // A new weight tensor for the fused projection that holds `proj`; the base's
                // stays shared with every other model.
                AdapterMode::Merge => lin.add_to_weight(proj, &(b.matmul(a)? * scale)?)?,
                AdapterMode::OnTheFly => lin.set_lora(
                    proj,
                    Some(LoraDelta {
                        a: a.clone(),
                        b: b.clone(),
                        scale,
                    }),
                ),
            }
        }
        if mode == AdapterMode::OnTheFly {
            for block in &mut model.blocks {
                for lin in block.linears_mut() {
                    lin.stack_adapter()?;
                }
            }
        }
        // A merge replaced weights: their packed decode copies are stale, and are quantised
        // again (to Q8_0, from the merged f32 values) unless the model decodes on f32.
        if mode == AdapterMode::Merge && self.decode_weights() == DecodeWeights::Narrow {
            model.set_decode_weights(DecodeWeights::Narrow)?;
        }
        Ok(model)
    }
}
