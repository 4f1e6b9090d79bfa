//! An independent implementation of the same model for comparison: candle-transformers'
//! `quantized_llama`, which keeps the GGUF weights quantized and quantizes activations too (so
//! it agrees with the f32 model only within a tolerance). Used by the parity test and by
//! `scd bench model`.

use std::path::Path;

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;

use crate::error::LoadError;

/// candle-transformers' quantized llama with its internal KV cache.
pub struct QuantizedLlama {
    inner: ModelWeights,
    position: usize,
}

impl std::fmt::Debug for QuantizedLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizedLlama")
            .field("position", &self.position)
            .finish()
    }
}

impl QuantizedLlama {
    /// Loads the GGUF file without dequantising it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let file = crate::gguf::GgufFile::open(path)?;
        let mut reader = std::fs::File::open(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content =
            candle_core::quantized::gguf_file::Content::read(&mut reader).map_err(|e| {
                LoadError::BadHeader {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                }
            })?;
        drop(file);
        let inner =
            ModelWeights::from_gguf(content, &mut reader, &Device::Cpu).map_err(|source| {
                LoadError::Tensor {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
        Ok(Self { inner, position: 0 })
    }

    /// Forgets the cached prefix.
    pub fn reset(&mut self) {
        self.inner.clear_kv_cache();
        self.position = 0;
    }

    /// Feeds `tokens` after what was fed before; returns the last position's logits `(vocab,)`.
    pub fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let input = Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?;
        let logits = self.inner.forward(&input, self.position)?;
        self.position += tokens.len();
        logits.squeeze(0)
    }
}
