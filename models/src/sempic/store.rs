//! Compiled documents on disk (`docs/method.md` §5.1), content-addressed by the version of the
//! model that compiled them and by the document's tokens:
//! `DIR/<writer version>/<document id>.safetensors`.
//!
//! A writer version ([`WriterVersion`]) is the compiler's base hash, its adapter's hash (a SemPIC
//! writer) and its boundary tokens' hash (KV-Packet), so that a document compiled by another
//! writer is simply another entry: a lookup for the current writer never finds it, and
//! [`DocStore::get_or_compile`] compiles afresh instead of mixing versions. Each file also
//! records its version and tokens; a file whose records do not match its address is refused.
//! Files are written to a temporary name and renamed, so a crash leaves either the whole entry
//! or none. The store counts its compilations and hits: on a hit nothing of the document is
//! computed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::CompiledDoc;
use crate::boundary::Boundary;
use crate::error::ForwardError;
use crate::llama::{Llama, ModelIdentity};

/// Errors of the document store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading or writing a file failed.
    #[error("document store {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// An entry that cannot be read as a compiled document of this model.
    #[error("document store entry {path}: {reason}")]
    Format {
        /// The entry.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Compiling a missing document failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// What compiled a document: every input to compilation besides its tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriterVersion {
    /// The compiler's base model file (hex SHA-256).
    pub base_sha256: String,
    /// Its adapter (a SemPIC writer), if any.
    pub adapter_sha256: Option<String>,
    /// The boundary tokens the documents were compiled between, if any.
    pub boundary_sha256: Option<String>,
}

impl WriterVersion {
    /// The version of `writer` compiling between `boundary`'s tokens.
    pub fn of(writer: &Llama, boundary: Option<&Boundary>) -> Result<Self, ForwardError> {
        Ok(Self {
            base_sha256: writer.identity().sha256.clone(),
            adapter_sha256: writer.identity().adapter_sha256.clone(),
            boundary_sha256: boundary
                .map(Boundary::content_sha256)
                .transpose()
                .map_err(Box::new)?,
        })
    }

    /// The version a compiled document records.
    pub fn of_doc(doc: &CompiledDoc) -> Self {
        Self {
            base_sha256: doc.writer().sha256.clone(),
            adapter_sha256: doc.writer().adapter_sha256.clone(),
            boundary_sha256: doc.boundary_sha256().map(str::to_string),
        }
    }

    /// A short stable id: the first 16 bytes of the SHA-256 of its parts, in hex.
    pub fn id(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [
            Some(&self.base_sha256),
            self.adapter_sha256.as_ref(),
            self.boundary_sha256.as_ref(),
        ] {
            // A length prefix keeps ("ab", None) apart from ("a", "b").
            let s = part.map_or("", String::as_str);
            h.update((s.len() as u64 + u64::from(part.is_some())).to_le_bytes());
            h.update(s.as_bytes());
        }
        hex::encode(&h.finalize()[..16])
    }
}

/// A document's id ([`scd_types::document_id`]: one function for the store, the scheduler
/// and the wire).
pub use scd_types::document_id;

/// Compiled documents under one folder; see the module doc.
#[derive(Debug)]
pub struct DocStore {
    dir: PathBuf,
    compiled: AtomicU64,
    hits: AtomicU64,
}

impl DocStore {
    /// The store under `dir` (created if missing).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(Self {
            dir,
            compiled: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        })
    }

    /// Where the entry of `doc_id` compiled by `version` lives.
    pub fn path_of(&self, version: &WriterVersion, doc_id: &str) -> PathBuf {
        self.dir
            .join(version.id())
            .join(format!("{doc_id}.safetensors"))
    }

    /// Documents this store compiled since it was opened.
    pub fn compilations(&self) -> u64 {
        self.compiled.load(Ordering::Relaxed)
    }

    /// Lookups answered from disk since it was opened.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// The document `doc_id` as `version` compiled it, if stored, for `reader` to stitch.
    pub fn get(
        &self,
        reader: &Llama,
        version: &WriterVersion,
        doc_id: &str,
    ) -> Result<Option<CompiledDoc>, StoreError> {
        let path = self.path_of(version, doc_id);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(StoreError::Io { path, source }),
        };
        let doc = decode(reader, &bytes).map_err(|reason| StoreError::Format {
            path: path.clone(),
            reason,
        })?;
        let found = WriterVersion::of_doc(&doc);
        if &found != version || document_id(doc.tokens()) != doc_id {
            return Err(StoreError::Format {
                path,
                reason: format!(
                    "holds document {} of writer version {}, not its address's",
                    document_id(doc.tokens()),
                    found.id()
                ),
            });
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Ok(Some(doc))
    }

    /// Stores `doc` under its writer version and tokens; returns its document id.
    pub fn put(&self, doc: &CompiledDoc) -> Result<String, StoreError> {
        let version = WriterVersion::of_doc(doc);
        let doc_id = document_id(doc.tokens());
        let path = self.path_of(&version, &doc_id);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let tmp = path.with_extension("safetensors.tmp");
        let (tensors, meta) = encode(doc).map_err(|e| StoreError::Format {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n, t)), Some(meta), &tmp)
            .map_err(|e| StoreError::Format {
                path: tmp.clone(),
                reason: e.to_string(),
            })?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        Ok(doc_id)
    }

    /// The document of `tokens` as `writer` compiles it between `boundary`'s tokens: from disk
    /// when stored, compiled (and stored) otherwise. `reader` is the model that will stitch it.
    pub fn get_or_compile(
        &self,
        reader: &Llama,
        writer: &Llama,
        boundary: Option<&Boundary>,
        tokens: &[u32],
    ) -> Result<CompiledDoc, StoreError> {
        Ok(self.fetch(reader, writer, boundary, tokens)?.0)
    }

    /// [`DocStore::get_or_compile`], and whether this call compiled it (`false`: a hit).
    pub fn fetch(
        &self,
        reader: &Llama,
        writer: &Llama,
        boundary: Option<&Boundary>,
        tokens: &[u32],
    ) -> Result<(CompiledDoc, bool), StoreError> {
        let version = WriterVersion::of(writer, boundary)?;
        if let Some(doc) = self.get(reader, &version, &document_id(tokens))? {
            return Ok((doc, false));
        }
        let doc = CompiledDoc::compile_with(writer, tokens, boundary)?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        self.put(&doc)?;
        Ok((doc, true))
    }

    /// The ids of the documents stored for `version` (entries are not opened or checked here;
    /// [`DocStore::get`] checks each as it reads it).
    pub fn ids(&self, version: &WriterVersion) -> Result<Vec<String>, StoreError> {
        let dir = self.dir.join(version.id());
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(StoreError::Io { path: dir, source }),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| StoreError::Io {
                path: dir.clone(),
                source,
            })?;
            let name = entry.file_name();
            let id = name.to_str().and_then(|n| n.strip_suffix(".safetensors"));
            // Half-written entries end in `.tmp`; anything else is not the store's.
            if let Some(id) = id.filter(|id| scd_types::is_document_id(id)) {
                ids.push(id.to_owned());
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }
}

const META_VERSION: &str = "writer_version";
const META_BOUNDARY: &str = "boundary_counts";

/// A stored entry: named tensors and the file's metadata.
type Entry = (Vec<(String, Tensor)>, HashMap<String, String>);

fn encode(doc: &CompiledDoc) -> candle_core::Result<Entry> {
    let mut tensors = vec![(
        "tokens".to_string(),
        Tensor::new(doc.tokens(), &Device::Cpu)?,
    )];
    for (l, (k, v)) in doc.layers.iter().enumerate() {
        tensors.push((format!("{l}.k"), k.detach().contiguous()?));
        tensors.push((format!("{l}.v"), v.detach().contiguous()?));
    }
    let version = serde_json::to_string(&WriterVersion::of_doc(doc))
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let (h, t) = doc.boundary_counts();
    let meta = HashMap::from([
        (META_VERSION.to_string(), version),
        (META_BOUNDARY.to_string(), format!("{h},{t}")),
    ]);
    Ok((tensors, meta))
}

/// A compiled document from a stored entry, checked against `reader`'s shapes so that a bad
/// file is an error, never a panic or an unbounded allocation later.
fn decode(reader: &Llama, bytes: &[u8]) -> Result<CompiledDoc, String> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let meta = header.metadata().clone().unwrap_or_default();
    let version: WriterVersion =
        serde_json::from_str(meta.get(META_VERSION).ok_or("no writer version recorded")?)
            .map_err(|e| format!("writer version: {e}"))?;
    let (h, t) = meta
        .get(META_BOUNDARY)
        .and_then(|s| s.split_once(','))
        .and_then(|(h, t)| Some((h.parse::<usize>().ok()?, t.parse::<usize>().ok()?)))
        .ok_or("no boundary counts recorded")?;
    let mut tensors =
        candle_core::safetensors::load_buffer(bytes, &Device::Cpu).map_err(|e| e.to_string())?;
    let mut take = |name: &str| tensors.remove(name).ok_or(format!("no tensor {name}"));
    let tokens: Vec<u32> = take("tokens")?
        .to_dtype(DType::U32)
        .and_then(|t| t.to_vec1())
        .map_err(|e| format!("tokens: {e}"))?;
    let cfg = reader.config();
    let rows = h + tokens.len() + t;
    let width = cfg.num_kv_heads * cfg.head_dim;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for l in 0..cfg.num_layers {
        let mut kv = [take(&format!("{l}.k"))?, take(&format!("{l}.v"))?];
        for x in &mut kv {
            if x.dims() != [rows, width] || x.dtype() != DType::F32 {
                return Err(format!(
                    "layer {l}: a {:?} {:?} tensor, the reader needs f32 {:?}",
                    x.dtype(),
                    x.dims(),
                    [rows, width]
                ));
            }
        }
        let [k, v] = kv;
        layers.push((k, v));
    }
    if !tensors.is_empty() {
        return Err(format!(
            "{} tensors beyond the reader's layers",
            tensors.len()
        ));
    }
    let writer = ModelIdentity {
        sha256: version.base_sha256.clone(),
        source: PathBuf::new(),
        adapter_sha256: version.adapter_sha256.clone(),
    };
    let doc = CompiledDoc::from_layers(tokens, layers, writer);
    Ok(match version.boundary_sha256 {
        Some(sha) => doc.with_boundary_parts(h, t, sha),
        None if h + t == 0 => doc,
        None => return Err("boundary counts without boundary tokens".into()),
    })
}
