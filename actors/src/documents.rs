//! A producer's compiled documents (SemPIC, `docs/method.md` §5.5): the writer that compiles them
//! (the base model with the SemPIC writer's adapter, between KV-Packet boundary tokens if
//! configured), and the on-disk store ([`scd_models::sempic::DocStore`]) they are compiled into once
//! and served from after. The producer actor fetches a job's documents here; on a hit nothing of
//! the document is computed.

use std::path::PathBuf;
use std::sync::Arc;

use scd_models::boundary::{Boundary, BoundaryError};
use scd_models::sempic::{CompiledDoc, DocStore, StoreError, WriterVersion};
use scd_models::{AdapterError, AdapterMode, ForwardError, Llama, LoraAdapter};
use scd_transport::CodeDType;

use crate::config::DocumentsConfig;

/// Why a producer's documents could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum DocumentSetupError {
    /// The writer's adapter could not be loaded or applied.
    #[error("documents.writer {path}: {source}")]
    Writer {
        /// The adapter file.
        path: PathBuf,
        /// Why.
        source: Box<AdapterError>,
    },
    /// The boundary tokens could not be loaded, or are for another writer.
    #[error("documents.boundary {path}: {source}")]
    Boundary {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: Box<BoundaryError>,
    },
    /// The store's folder could not be made.
    #[error("documents.dir: {0}")]
    Store(#[from] StoreError),
    /// The writer version could not be computed.
    #[error("documents: {0}")]
    Version(#[from] ForwardError),
}

/// What a producer compiles documents with, and where it keeps them.
pub struct DocumentServer {
    store: DocStore,
    writer: Arc<Llama>,
    boundary: Option<Boundary>,
    version: WriterVersion,
    wire: CodeDType,
}

impl DocumentServer {
    /// The server `config` describes, on `base` (the producer's model, which also reads the
    /// documents' shapes back from disk).
    pub fn load(config: &DocumentsConfig, base: &Arc<Llama>) -> Result<Self, DocumentSetupError> {
        let writer = match config.writer_file() {
            None => Arc::clone(base),
            Some(path) => {
                let err = |source| DocumentSetupError::Writer {
                    path: path.clone(),
                    source: Box::new(source),
                };
                let adapter = LoraAdapter::load(&path, base.config()).map_err(err)?;
                Arc::new(
                    base.with_adapter(&adapter, AdapterMode::Merge)
                        .map_err(err)?,
                )
            }
        };
        let boundary = match &config.boundary {
            None => None,
            Some(dir) => Some(Boundary::load(dir, &writer).map_err(|source| {
                DocumentSetupError::Boundary {
                    path: dir.clone(),
                    source: Box::new(source),
                }
            })?),
        };
        let version = WriterVersion::of(&writer, boundary.as_ref())?;
        Ok(Self {
            store: DocStore::open(&config.dir)?,
            writer,
            boundary,
            version,
            wire: config.wire.dtype(),
        })
    }

    /// The writer version every document here is compiled by.
    pub fn version(&self) -> &WriterVersion {
        &self.version
    }

    /// The element type compiled caches travel in.
    pub fn wire(&self) -> CodeDType {
        self.wire
    }

    /// The positions a document of `tokens` tokens occupies once compiled here (its boundary
    /// tokens included).
    pub fn positions(&self, tokens: usize) -> usize {
        let (header, trailer) = self.boundary.as_ref().map_or((0, 0), Boundary::counts);
        header + tokens + trailer
    }

    /// The ids of the documents stored for this writer version.
    pub fn held(&self) -> Result<Vec<String>, StoreError> {
        self.store.ids(&self.version)
    }

    /// The document of `tokens`, from the store or compiled into it now (`true`), for `reader`
    /// to serve.
    pub fn fetch(&self, reader: &Llama, tokens: &[u32]) -> Result<(CompiledDoc, bool), StoreError> {
        self.store
            .fetch(reader, &self.writer, self.boundary.as_ref(), tokens)
    }

    /// Documents compiled since the node started.
    pub fn compilations(&self) -> u64 {
        self.store.compilations()
    }

    /// Documents served from the store since the node started.
    pub fn hits(&self) -> u64 {
        self.store.hits()
    }
}
