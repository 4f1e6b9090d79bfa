//! The hyperparameters of a llama-family model, resolved from a GGUF file's `llama.*` metadata or
//! from a Hugging Face `config.json` (a serde struct that mirrors it). Nothing is hard-coded for a
//! particular model.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::{Deserialize, Serialize};

use crate::error::LoadError;

/// How the checkpoint on disk pairs the dimensions that RoPE rotates together.
///
/// Inside this crate every model runs the interleaved variant; a half-split checkpoint has the
/// rows of its query and key projections permuted at load (see [`crate::hf`]), so there is a
/// single code path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeVariant {
    /// Adjacent pairs `(2i, 2i+1)` (GPT-J style); what llama.cpp's GGUF llama models use.
    Interleaved,
    /// Pairs `(i, i + d/2)` (GPT-NeoX style); what Hugging Face llama checkpoints use.
    HalfSplit,
}

/// The resolved hyperparameters of a llama-family model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Number of transformer blocks.
    pub num_layers: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's inner layer.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Context window in tokens.
    pub context_length: usize,
    /// Whether the output projection reuses the token embedding.
    pub tie_embeddings: bool,
    /// The RoPE pairing of the checkpoint on disk (the model always runs interleaved).
    pub rope_variant: RopeVariant,
}

impl LlamaConfig {
    /// Query width, `num_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Key/value width, `num_kv_heads * head_dim`: the width of one layer's K or V per token.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters that take part in matrix multiplications for one token (all projections of
    /// all layers and the output head); `2 *` this is the FLOP count of a token's linear layers.
    pub fn matmul_params(&self) -> usize {
        let h = self.hidden_size;
        let attn = h * self.q_dim() * 2 + h * self.kv_dim() * 2;
        let mlp = 3 * h * self.intermediate_size;
        self.num_layers * (attn + mlp)
    }

    /// Checks the relations between the numbers that the forward pass relies on.
    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |m: String| Err(LoadError::Config(m));
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(format!("degenerate sizes in {self:?}"));
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} query heads cannot be grouped over {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.context_length == 0 {
            return bad("context length 0".into());
        }
        Ok(())
    }

    /// Resolves the configuration from a GGUF file's metadata (`llama.*` keys).
    ///
    /// `path` only labels errors. The vocabulary size comes from `llama.vocab_size` when present,
    /// otherwise from the token embedding's shape; the caller passes whether `output.weight`
    /// exists, since ties are a property of the tensors rather than of the metadata.
    pub fn from_gguf(
        content: &gguf_file::Content,
        path: &Path,
        has_output_weight: bool,
    ) -> Result<Self, LoadError> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            return Err(LoadError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: arch,
            });
        }
        if let Some(kind) = md
            .get("llama.rope.scaling.type")
            .and_then(|v| v.to_string().ok())
        {
            if kind != "none" {
                return Err(LoadError::Config(format!(
                    "RoPE scaling {kind:?} is not supported"
                )));
            }
        }
        let get = |key: &str| -> Result<u64, LoadError> {
            md.get(key)
                .and_then(value_as_u64)
                .ok_or(LoadError::Metadata {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                })
        };
        let get_f = |key: &str| -> Option<f64> { md.get(key).and_then(value_as_f64) };
        let hidden_size = get("llama.embedding_length")? as usize;
        let num_heads = get("llama.attention.head_count")? as usize;
        let num_kv_heads = match md.get("llama.attention.head_count_kv") {
            Some(v) => value_as_u64(v).ok_or(LoadError::Metadata {
                path: path.to_path_buf(),
                key: "llama.attention.head_count_kv".into(),
            })? as usize,
            None => num_heads,
        };
        let head_dim = match md
            .get("llama.attention.key_length")
            .or_else(|| md.get("llama.rope.dimension_count"))
        {
            Some(v) => value_as_u64(v).ok_or(LoadError::Metadata {
                path: path.to_path_buf(),
                key: "llama.attention.key_length".into(),
            })? as usize,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let vocab_size = match md.get("llama.vocab_size").and_then(value_as_u64) {
            Some(v) => v as usize,
            None => content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or(LoadError::MissingTensor {
                    path: path.to_path_buf(),
                    name: "token_embd.weight".into(),
                })?,
        };
        let rms_norm_eps =
            get_f("llama.attention.layer_norm_rms_epsilon").ok_or(LoadError::Metadata {
                path: path.to_path_buf(),
                key: "llama.attention.layer_norm_rms_epsilon".into(),
            })?;
        let cfg = Self {
            num_layers: get("llama.block_count")? as usize,
            hidden_size,
            intermediate_size: get("llama.feed_forward_length")? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            // llama.cpp's own default when the key is absent.
            rope_theta: get_f("llama.rope.freq_base").unwrap_or(10_000.0),
            rms_norm_eps,
            context_length: get("llama.context_length")? as usize,
            tie_embeddings: !has_output_weight,
            rope_variant: RopeVariant::Interleaved,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn value_as_u64(v: &gguf_file::Value) -> Option<u64> {
    use gguf_file::Value as V;
    match v {
        V::U8(x) => Some(u64::from(*x)),
        V::U16(x) => Some(u64::from(*x)),
        V::U32(x) => Some(u64::from(*x)),
        V::U64(x) => Some(*x),
        V::I8(x) => u64::try_from(*x).ok(),
        V::I16(x) => u64::try_from(*x).ok(),
        V::I32(x) => u64::try_from(*x).ok(),
        V::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

fn value_as_f64(v: &gguf_file::Value) -> Option<f64> {
    use gguf_file::Value as V;
    match v {
        V::F32(x) => Some(f64::from(*x)),
        V::F64(x) => Some(*x),
        other => value_as_u64(other).map(|x| x as f64),
    }
}

/// `config.json` of a Hugging Face llama checkpoint, as far as this crate reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfLlamaConfig {
    /// `"llama"` for this family.
    #[serde(default)]
    pub model_type: Option<String>,
    /// E.g. `["LlamaForCausalLM"]`.
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base; defaults to 10,000.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Context window.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` reuses the embedding.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Must be absent or null: scaled RoPE variants are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Fields this crate does not interpret, kept so that a round trip loses nothing.
    #[serde(flatten)]
    pub other: HashMap<String, serde_json::Value>,
}

impl HfLlamaConfig {
    /// Resolves the plain configuration; `path` only labels errors.
    pub fn resolve(&self, path: &Path) -> Result<LlamaConfig, LoadError> {
        let model_type = self.model_type.clone().unwrap_or_default();
        let arch_ok = model_type == "llama"
            || self
                .architectures
                .as_ref()
                .is_some_and(|a| a.iter().any(|s| s == "LlamaForCausalLM"));
        if !arch_ok {
            return Err(LoadError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: model_type,
            });
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(LoadError::Config("rope_scaling is not supported".into()));
        }
        let cfg = LlamaConfig {
            num_layers: self.num_hidden_layers,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            vocab_size: self.vocab_size,
            rope_theta: self.rope_theta.unwrap_or(10_000.0),
            rms_norm_eps: self.rms_norm_eps,
            context_length: self.max_position_embeddings,
            tie_embeddings: self.tie_word_embeddings.unwrap_or(false),
            rope_variant: RopeVariant::HalfSplit,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` that describes `cfg` (used when exporting a model as a directory).
    pub fn from_config(cfg: &LlamaConfig) -> Self {
        Self {
            model_type: Some("llama".into()),
            architectures: Some(vec!["LlamaForCausalLM".into()]),
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_hidden_layers: cfg.num_layers,
            num_attention_heads: cfg.num_heads,
            num_key_value_heads: Some(cfg.num_kv_heads),
            head_dim: Some(cfg.head_dim),
            vocab_size: cfg.vocab_size,
            rms_norm_eps: cfg.rms_norm_eps,
            rope_theta: Some(cfg.rope_theta),
            max_position_embeddings: cfg.context_length,
            tie_word_embeddings: Some(cfg.tie_embeddings),
            rope_scaling: None,
            other: HashMap::new(),
        }
    }
}
