//! KV-Packet boundary tokens (`docs/method.md` §2.6 and §5.3, the "packet" baseline): a few
//! trained soft tokens placed before (header) and after (trailer) every document when it is
//! compiled alone ([`crate::sempic::CompiledDoc::compile_with`]). They are input embeddings, not
//! vocabulary tokens: the header gives a document compiled alone something to attend to
//! besides its own first token, and the trailer's keys and values, stored with the document,
//! are what later tokens can read a summary from. The model's weights stay as they are.
//!
//! The tokens are trained for one compiler (the base, or the base with a SemPIC writer: the
//! "joint" mode) by [`crate::train::sempic`]'s distillation; a set records that compiler's
//! identity and refuses to compile with another. On disk: `boundary.safetensors` (`header`,
//! `trailer`, f32) and `boundary.json` (counts, the compiler's hashes, the content hash, checked
//! on load).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::ForwardError;
use crate::json_file::{self, JsonFileError};
use crate::llama::{Llama, ModelIdentity};

/// The tensor file of a set of boundary tokens.
pub const BOUNDARY_FILE: &str = "boundary.safetensors";
/// Its description beside it.
pub const BOUNDARY_META_FILE: &str = "boundary.json";

/// Loading, checking or saving boundary tokens failed.
#[derive(Debug, thiserror::Error)]
pub enum BoundaryError {
    /// Reading or writing a file failed.
    #[error("cannot access boundary file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The description is missing or malformed.
    #[error(transparent)]
    Meta(#[from] JsonFileError),
    /// The tensor file is malformed or lacks a tensor.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The tensors do not hash to the recorded content hash: a corrupt or edited file.
    #[error("{path}: content hash {got} does not match the recorded {expected} (corrupt file?)")]
    Corrupt {
        /// The tensor file.
        path: PathBuf,
        /// The hash of what was read.
        got: String,
        /// The hash in the description.
        expected: String,
    },
    /// The tokens were trained for another compiler.
    #[error("boundary tokens trained for {trained_for}, used with {model}")]
    ForeignModel {
        /// The compiler they were trained for (base hash, adapter hash).
        trained_for: String,
        /// The model given.
        model: String,
    },
    /// Shapes that do not fit the model, or no tokens at all.
    #[error("invalid boundary tokens: {0}")]
    Shape(String),
    /// The tensor library failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// Header and trailer soft tokens for one compiler.
#[derive(Debug, Clone)]
pub struct Boundary {
    /// `(header, hidden)`.
    header: Tensor,
    /// `(trailer, hidden)`.
    trailer: Tensor,
    /// The compiler they were trained for: base hash and adapter hash.
    base_sha256: String,
    adapter_sha256: Option<String>,
}

/// `boundary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BoundaryMeta {
    /// Header tokens.
    pub header: usize,
    /// Trailer tokens.
    pub trailer: usize,
    /// Width of each token (the model's hidden size).
    pub hidden: usize,
    /// The compiler's base model file (hex SHA-256).
    pub base_sha256: String,
    /// The compiler's adapter (a SemPIC writer), if any.
    pub adapter_sha256: Option<String>,
    /// [`Boundary::content_sha256`].
    pub sha256: String,
}

fn describe(base: &str, adapter: Option<&str>) -> String {
    let short = |s: &str| s[..12.min(s.len())].to_string();
    match adapter {
        Some(a) => format!("base {} with adapter {}", short(base), short(a)),
        None => format!("base {} without adapter", short(base)),
    }
}

impl Boundary {
    /// Tokens `(header, hidden)` and `(trailer, hidden)` for `compiler`.
    pub fn new(header: Tensor, trailer: Tensor, compiler: &Llama) -> Result<Self, BoundaryError> {
        let hidden = compiler.config().hidden_size;
        for (what, t) in [("header", &header), ("trailer", &trailer)] {
            match t.dims() {
                &[_, w] if w == hidden => {}
                dims => {
                    return Err(BoundaryError::Shape(format!(
                        "{what} has shape {dims:?}, the model's tokens are {hidden} wide"
                    )))
                }
            }
        }
        if header.dim(0)? + trailer.dim(0)? == 0 {
            return Err(BoundaryError::Shape("no header or trailer tokens".into()));
        }
        let id = compiler.identity();
        Ok(Self {
            header: header.to_dtype(DType::F32)?,
            trailer: trailer.to_dtype(DType::F32)?,
            base_sha256: id.sha256.clone(),
            adapter_sha256: id.adapter_sha256.clone(),
        })
    }

    /// Fresh tokens for `compiler`: each the mean of its vocabulary's embeddings plus seeded
    /// uniform noise of about half their spread, so that no token starts as a particular word
    /// and the tokens start apart.
    pub fn init(
        compiler: &Llama,
        header: usize,
        trailer: usize,
        seed: u64,
    ) -> Result<Self, BoundaryError> {
        let embed = compiler.embedding();
        let mean = embed.mean_keepdim(0)?;
        let spread =
            f64::from((embed.broadcast_sub(&mean)?.sqr()?.mean_all()?.sqrt())?.to_scalar::<f32>()?);
        let hidden = compiler.config().hidden_size;
        // Uniform on [-b, b] has standard deviation b / sqrt(3).
        let bound = (0.5 * spread * 3f64.sqrt()) as f32;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6b76_7061_636b);
        let mut rows = |n: usize| -> Result<Tensor, BoundaryError> {
            let noise: Vec<f32> = (0..n * hidden)
                .map(|_| rng.gen_range(-bound..=bound))
                .collect();
            let noise = Tensor::from_vec(noise, (n, hidden), &Device::Cpu)?;
            Ok(noise.broadcast_add(&mean)?)
        };
        let (h, t) = (rows(header)?, rows(trailer)?);
        Self::new(h, t, compiler)
    }

    /// The header tokens `(header, hidden)` (the trainer's live variable while training).
    pub fn header(&self) -> &Tensor {
        &self.header
    }

    /// The trailer tokens `(trailer, hidden)`.
    pub fn trailer(&self) -> &Tensor {
        &self.trailer
    }

    /// Header and trailer token counts.
    pub fn counts(&self) -> (usize, usize) {
        (self.header.dims()[0], self.trailer.dims()[0])
    }

    /// The same tokens for the same compiler, detached from any graph.
    pub fn detach(&self) -> Self {
        Self {
            header: self.header.detach(),
            trailer: self.trailer.detach(),
            ..self.clone()
        }
    }

    /// Whether `compiler` is the model these tokens were trained for.
    pub fn check(&self, compiler: &Llama) -> Result<(), BoundaryError> {
        let id: &ModelIdentity = compiler.identity();
        if id.sha256 != self.base_sha256 || id.adapter_sha256 != self.adapter_sha256 {
            return Err(BoundaryError::ForeignModel {
                trained_for: describe(&self.base_sha256, self.adapter_sha256.as_deref()),
                model: describe(&id.sha256, id.adapter_sha256.as_deref()),
            });
        }
        Ok(())
    }

    /// The rows a document compiles from: the header, `tokens`' embeddings under `compiler`,
    /// the trailer; `(header + T + trailer, hidden)`.
    pub fn embed(&self, compiler: &Llama, tokens: &[u32]) -> Result<Tensor, ForwardError> {
        let vocab = compiler.config().vocab_size;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ForwardError::TokenOutOfRange { id, vocab });
        }
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let x = compiler.embedding().index_select(&ids, 0)?;
        Ok(Tensor::cat(&[&self.header, &x, &self.trailer], 0)?)
    }

    /// A hash of the counts and values: what a compiled document records as its boundary.
    pub fn content_sha256(&self) -> Result<String, BoundaryError> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for t in [&self.header, &self.trailer] {
            h.update((t.dims()[0] as u64).to_le_bytes());
            for x in t.flatten_all()?.to_vec1::<f32>()? {
                h.update(x.to_le_bytes());
            }
        }
        Ok(hex::encode(h.finalize()))
    }

    /// Writes `boundary.safetensors` and `boundary.json` into `dir` (each renamed into place).
    pub fn save(&self, dir: &Path) -> Result<BoundaryMeta, BoundaryError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| BoundaryError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(BOUNDARY_FILE);
        let tmp = dir.join(format!("{BOUNDARY_FILE}.tmp"));
        let tensors = [
            ("header", self.header.detach()),
            ("trailer", self.trailer.detach()),
        ];
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (*n, t)), None, &tmp).map_err(
            |e| BoundaryError::Format {
                path: tmp.clone(),
                reason: e.to_string(),
            },
        )?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        let (header, trailer) = self.counts();
        let meta = BoundaryMeta {
            header,
            trailer,
            hidden: self.header.dims()[1],
            base_sha256: self.base_sha256.clone(),
            adapter_sha256: self.adapter_sha256.clone(),
            sha256: self.content_sha256()?,
        };
        json_file::write_atomic(&dir.join(BOUNDARY_META_FILE), &meta)?;
        Ok(meta)
    }

    /// Loads the tokens in `dir` for `compiler`: refuses a corrupt file and tokens trained for
    /// another compiler.
    pub fn load(dir: &Path, compiler: &Llama) -> Result<Self, BoundaryError> {
        let meta: BoundaryMeta = json_file::read(&dir.join(BOUNDARY_META_FILE))?;
        let path = dir.join(BOUNDARY_FILE);
        let format = |reason: String| BoundaryError::Format {
            path: path.clone(),
            reason,
        };
        let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| format(format!("not a valid safetensors file: {e}")))?;
        let mut take = |name: &str| {
            tensors
                .remove(name)
                .ok_or_else(|| format(format!("no `{name}` tensor")))
        };
        let (header, trailer) = (take("header")?, take("trailer")?);
        let loaded = Self {
            header: header.to_dtype(DType::F32)?,
            trailer: trailer.to_dtype(DType::F32)?,
            base_sha256: meta.base_sha256.clone(),
            adapter_sha256: meta.adapter_sha256.clone(),
        };
        let got = loaded.content_sha256()?;
        if got != meta.sha256 || loaded.counts() != (meta.header, meta.trailer) {
            return Err(BoundaryError::Corrupt {
                path,
                got,
                expected: meta.sha256,
            });
        }
        loaded.check(compiler)?;
        // Shapes last: the hash matched, so a wrong width means a model of another shape.
        Self::new(loaded.header, loaded.trailer, compiler)
    }
}
