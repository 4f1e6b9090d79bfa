//! Loading a llama model from a GGUF file (llama.cpp's format), dequantised to f32 at load.
//!
//! The file is memory-mapped once: the same pages are hashed (the model's identity) and parsed,
//! so it is read from disk once. GGUF llama models already use the interleaved RoPE layout this
//! crate runs, so their weights are taken as they are.

use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use crate::config::LlamaConfig;
use crate::decode_weights::DecodeWeights;
use crate::error::LoadError;
use crate::kernel_choice::KernelChoice;
use crate::kernels::{Format, PackedWeight};
use crate::llama::{check_shape, BlockWeights, Llama, ModelIdentity, Proj};

/// An opened, validated GGUF file: its parsed header and its bytes.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    content: gguf_file::Content,
    sha256: String,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("tensors", &self.content.tensor_infos.len())
            .field("sha256", &self.sha256)
            .finish()
    }
}

impl GgufFile {
    /// Opens `path`, checks the magic bytes, parses the header and checks that every tensor's
    /// data lies inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => LoadError::NotFound { path: path.clone() },
            _ => LoadError::Io {
                path: path.clone(),
                source: e,
            },
        })?;
        let io = |e| LoadError::Io {
            path: path.clone(),
            source: e,
        };
        if file.metadata().map_err(io)?.is_dir() {
            return Err(LoadError::Io {
                path: path.clone(),
                source: std::io::Error::other("is a directory, expected a .gguf file"),
            });
        }
        // SAFETY: the map is read-only and private to this struct; a file changed underneath by
        // another process could show torn data, which the parser and the hash then see as
        // corruption rather than as undefined behaviour in safe code we rely on.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        if map.len() < 4 || &map[..4] != b"GGUF" {
            return Err(LoadError::NotGguf {
                path,
                magic: map[..map.len().min(4)].to_vec(),
            });
        }
        let content = gguf_file::Content::read(&mut Cursor::new(&map[..])).map_err(|e| {
            LoadError::BadHeader {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        let len = map.len() as u64;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            let bytes = (elems / block * info.ggml_dtype.type_size()) as u64;
            let end = content.tensor_data_offset + info.offset + bytes;
            if end > len {
                return Err(LoadError::Truncated {
                    path,
                    tensor: name.clone(),
                    needed: end,
                    len,
                });
            }
        }
        let sha256 = hex::encode(Sha256::digest(&map[..]));
        Ok(Self {
            path,
            map,
            content,
            sha256,
        })
    }

    /// The parsed header: metadata (hyperparameters, tokenizer) and tensor directory.
    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    /// Hex SHA-256 of the whole file.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's hyperparameters from the metadata.
    pub fn config(&self) -> Result<LlamaConfig, LoadError> {
        LlamaConfig::from_gguf(
            &self.content,
            &self.path,
            self.content.tensor_infos.contains_key("output.weight"),
        )
    }

    /// Reads and dequantises one tensor to f32.
    pub fn tensor(&self, name: &str) -> Result<Tensor, LoadError> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(LoadError::MissingTensor {
                path: self.path.clone(),
                name: name.into(),
            });
        }
        let wrap = |source| LoadError::Tensor {
            path: self.path.clone(),
            source,
        };
        let q = self
            .content
            .tensor(&mut Cursor::new(&self.map[..]), name, &Device::Cpu)
            .map_err(wrap)?;
        q.dequantize(&Device::Cpu).map_err(wrap)
    }

    /// One tensor's blocks packed for the decode kernels, when its type is one they take as it
    /// is (Q4_1, Q8_0) and its rows are whole blocks; `None` otherwise (the model then
    /// quantises the f32 values, see [`crate::decode_weights`]).
    fn packed(&self, name: &str, rows: usize, cols: usize) -> Option<PackedWeight> {
        let info = self.content.tensor_infos.get(name)?;
        let format = match info.ggml_dtype {
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q8_0 => Format::Q8_0,
            _ => return None,
        };
        let elems = info.shape.elem_count();
        let len = elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        // `open` checked that every tensor's data lies inside the file.
        let start = self.content.tensor_data_offset as usize + info.offset as usize;
        let bytes = self.map.get(start..start + len)?;
        PackedWeight::from_gguf(format, bytes, rows, cols)
    }

    /// Builds the model on the best kernels this machine has ([`KernelChoice::best`]).
    pub fn load_model(&self) -> Result<Llama, LoadError> {
        self.load_model_with(KernelChoice::best())
    }

    /// Builds the model: f32 weights, and the decode weights, decode products and prefill
    /// products of `kernels` (see [`crate::decode_weights`], [`crate::decode_products`],
    /// [`crate::prefill_matmul`]).
    pub fn load_model_with(&self, kernels: KernelChoice) -> Result<Llama, LoadError> {
        let decode = kernels.decode_weights;
        let cfg = self.config()?;
        let narrow = decode == DecodeWeights::Narrow;
        let packed = |name: &str, (rows, cols): (usize, usize)| {
            narrow.then(|| self.packed(name, rows, cols)).flatten()
        };
        let get = |name: &str, shape: &[usize]| -> Result<Tensor, LoadError> {
            let t = self.tensor(name)?;
            check_shape(name, &t, shape)?;
            Ok(t)
        };
        let (h, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let embed = get("token_embd.weight", &[cfg.vocab_size, h])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let lin = |s: &str, out: usize, inp: usize| get(&p(s), &[out, inp]);
            let names = [
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ];
            blocks.push(BlockWeights {
                packed: std::array::from_fn(|j| packed(&p(names[j]), Proj::ALL[j].shape(&cfg))),
                attn_norm: get(&p("attn_norm"), &[h])?,
                ffn_norm: get(&p("ffn_norm"), &[h])?,
                projections: [
                    lin("attn_q", cfg.q_dim(), h)?,
                    lin("attn_k", cfg.kv_dim(), h)?,
                    lin("attn_v", cfg.kv_dim(), h)?,
                    lin("attn_output", h, cfg.q_dim())?,
                    lin("ffn_gate", ffn, h)?,
                    lin("ffn_up", ffn, h)?,
                    lin("ffn_down", h, ffn)?,
                ],
            });
        }
        let norm = get("output_norm.weight", &[h])?;
        let (output, head) = if cfg.tie_embeddings {
            (None, "token_embd.weight")
        } else {
            (
                Some(get("output.weight", &[cfg.vocab_size, h])?),
                "output.weight",
            )
        };
        let head_packed = packed(head, (cfg.vocab_size, h));
        let identity = ModelIdentity {
            adapter_sha256: None,
            sha256: self.sha256.clone(),
            source: self.path.clone(),
        };
        Llama::assemble(
            cfg,
            embed,
            blocks,
            norm,
            (output, head_packed),
            identity,
            (decode, kernels.decode_products, kernels.prefill_matmul),
        )
        .map_err(|source| LoadError::Tensor {
            path: self.path.clone(),
            source,
        })
    }
}

impl Llama {
    /// Loads a llama GGUF file, dequantised to f32, on the best kernels this machine has.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::from_gguf_with(path, KernelChoice::best())
    }

    /// Loads a llama GGUF file, dequantised to f32, on `kernels`.
    pub fn from_gguf_with(
        path: impl AsRef<Path>,
        kernels: KernelChoice,
    ) -> Result<Self, LoadError> {
        GgufFile::open(path)?.load_model_with(kernels)
    }
}
