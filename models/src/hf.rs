//! Loading (and exporting) a Hugging Face style llama directory: `config.json`, weights in one
//! or more `*.safetensors` files, and `tokenizer.json` (read by [`crate::tokenizer`]).
//!
//! Hugging Face llama checkpoints rotate half-split pairs `(i, i + d/2)`, while this crate runs
//! the interleaved variant of GGUF files. The two are the same model up to a per-head permutation
//! of the rows of `W_q` and `W_k` (the one llama.cpp's converter applies), so the loader permutes
//! those rows and everything downstream has one code path. [`to_half_split_rows`] undoes it
//! (exports, PEFT adapters).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};

use crate::config::{HfLlamaConfig, LlamaConfig};
use crate::error::LoadError;
use crate::kernel_choice::KernelChoice;
use crate::llama::{check_shape, BlockWeights, Llama, ModelIdentity, Proj};

/// Reorders the rows of a `(n_heads * head_dim, ..)` matrix from half-split to interleaved
/// pairing: within each head, new row `2i` is old row `i` and new row `2i+1` is old row
/// `i + head_dim/2`.
pub fn to_interleaved_rows(w: &Tensor, n_heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let d = rows / n_heads;
    w.reshape((n_heads, 2, d / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// The inverse of [`to_interleaved_rows`].
pub fn to_half_split_rows(w: &Tensor, n_heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let d = rows / n_heads;
    w.reshape((n_heads, d / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

impl Llama {
    /// Loads a Hugging Face llama directory (`config.json` + `*.safetensors`) on the best
    /// kernels this machine has.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::from_hf_dir_with(dir, KernelChoice::best())
    }

    /// Loads a Hugging Face llama directory on `kernels`.
    pub fn from_hf_dir_with(
        dir: impl AsRef<Path>,
        kernels: KernelChoice,
    ) -> Result<Self, LoadError> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.exists() {
            return Err(LoadError::NotFound { path: dir });
        }
        let config_path = dir.join("config.json");
        let config_bytes = read(&config_path)?;
        let hf: HfLlamaConfig =
            serde_json::from_slice(&config_bytes).map_err(|source| LoadError::ConfigJson {
                path: config_path.clone(),
                source,
            })?;
        let mut cfg = hf.resolve(&dir)?;
        let mut files: Vec<PathBuf> = fs::read_dir(&dir)
            .map_err(|source| LoadError::Io {
                path: dir.clone(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(LoadError::NoWeights { path: dir });
        }
        let mut hasher = Sha256::new();
        hasher.update(&config_bytes);
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for f in &files {
            let bytes = read(f)?;
            hasher.update(&bytes);
            let loaded =
                candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|source| {
                    LoadError::Tensor {
                        path: f.clone(),
                        source,
                    }
                })?;
            tensors.extend(loaded);
        }
        // The tensors decide: a checkpoint without `lm_head.weight` ties whatever config.json says.
        cfg.tie_embeddings = !tensors.contains_key("lm_head.weight");
        let cfg = cfg;
        let wrap = |source| LoadError::Tensor {
            path: dir.clone(),
            source,
        };
        let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, LoadError> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| LoadError::MissingTensor {
                    path: dir.clone(),
                    name: name.into(),
                })?;
            let t = t.to_dtype(DType::F32).map_err(wrap)?;
            check_shape(name, &t, shape)?;
            Ok(t)
        };
        let h = cfg.hidden_size;
        let embed = take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}.weight");
            let mut lin = |proj: Proj| -> Result<Tensor, LoadError> {
                let (out, inp) = proj.shape(&cfg);
                let w = take(&p(proj.hf_name()), &[out, inp])?;
                match proj {
                    Proj::Q => to_interleaved_rows(&w, cfg.num_heads).map_err(wrap),
                    Proj::K => to_interleaved_rows(&w, cfg.num_kv_heads).map_err(wrap),
                    _ => Ok(w),
                }
            };
            let projections = [
                lin(Proj::Q)?,
                lin(Proj::K)?,
                lin(Proj::V)?,
                lin(Proj::O)?,
                lin(Proj::Gate)?,
                lin(Proj::Up)?,
                lin(Proj::Down)?,
            ];
            blocks.push(BlockWeights {
                attn_norm: take(&p("input_layernorm"), &[h])?,
                ffn_norm: take(&p("post_attention_layernorm"), &[h])?,
                projections,
                packed: Default::default(),
            });
        }
        let norm = take("model.norm.weight", &[h])?;
        let output = if cfg.tie_embeddings {
            None
        } else {
            Some(take("lm_head.weight", &[cfg.vocab_size, h])?)
        };
        let identity = ModelIdentity {
            adapter_sha256: None,
            sha256: hex::encode(hasher.finalize()),
            source: dir.clone(),
        };
        let kernels = (
            kernels.decode_weights,
            kernels.decode_products,
            kernels.prefill_matmul,
        );
        Llama::assemble(cfg, embed, blocks, norm, (output, None), identity, kernels).map_err(wrap)
    }

    /// Writes the model as a Hugging Face llama directory (`config.json`, `model.safetensors`
    /// with half-split q/k rows); adapters applied on the fly are not included.
    pub fn save_hf_dir(&self, dir: impl AsRef<Path>) -> Result<(), LoadError> {
        let dir = dir.as_ref().to_path_buf();
        let io = |source| LoadError::Io {
            path: dir.clone(),
            source,
        };
        fs::create_dir_all(&dir).map_err(io)?;
        let cfg: &LlamaConfig = &self.cfg;
        let json =
            serde_json::to_vec_pretty(&HfLlamaConfig::from_config(cfg)).map_err(|source| {
                LoadError::ConfigJson {
                    path: dir.join("config.json"),
                    source,
                }
            })?;
        fs::write(dir.join("config.json"), json).map_err(io)?;
        let wrap = |source| LoadError::Tensor {
            path: dir.clone(),
            source,
        };
        let mut out: HashMap<String, Tensor> = HashMap::new();
        out.insert("model.embed_tokens.weight".into(), self.embed.clone());
        out.insert("model.norm.weight".into(), self.norm.clone());
        if !cfg.tie_embeddings {
            out.insert("lm_head.weight".into(), self.lm_head.clone());
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.{s}.weight");
            out.insert(p("input_layernorm"), b.attn_norm.clone());
            out.insert(p("post_attention_layernorm"), b.ffn_norm.clone());
            for proj in Proj::ALL {
                let w = b.linear(proj).weight_of(proj).map_err(wrap)?;
                let w = match proj {
                    Proj::Q => to_half_split_rows(&w, cfg.num_heads).map_err(wrap)?,
                    Proj::K => to_half_split_rows(&w, cfg.num_kv_heads).map_err(wrap)?,
                    _ => w.contiguous().map_err(wrap)?,
                };
                out.insert(p(proj.hf_name()), w);
            }
        }
        candle_core::safetensors::save(&out, dir.join("model.safetensors")).map_err(wrap)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => LoadError::NotFound {
            path: path.to_path_buf(),
        },
        _ => LoadError::Io {
            path: path.to_path_buf(),
            source: e,
        },
    })
}
