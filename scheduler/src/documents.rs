//! Documents under `/documents/<id>` (SemPIC, `docs/method.md` §5.5): a document a job may name by
//! id instead of carrying its text. The record holds the document's tokens (of its base model's
//! tokenizer), so that whichever producer a job lands on can compile it; producers announce the
//! documents they hold compiled in their node registration ([`crate::NodeInfo::documents`]), under
//! the node's lease, and the scheduler prefers them ([`crate::choose_producer`]).
//!
//! The id is [`scd_types::document_id`] of the tokens: adding the same document twice finds
//! the first record.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::envelope::{self, EnvelopeError};
use crate::jobs::now_ms;
use crate::keys::{InvalidId, Keys};
use crate::store::{Compare, MetaStore, StoreError, Txn, TxnOp};

/// The most tokens a document may have: the records live in the cluster store (etcd keeps
/// values under 1.5 MB by default; this is about 100 KB of JSON), and no model we serve reads
/// more positions than this.
pub const MAX_DOCUMENT_TOKENS: usize = 16_384;

/// A document known to the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentRecord {
    /// Its id ([`scd_types::document_id`] of `tokens`).
    pub id: String,
    /// The base model whose tokenizer made `tokens`.
    pub base: String,
    /// A name for people (a file name, a title); not unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// When it was added (ms since the Unix epoch).
    pub added_at_ms: u64,
}

/// Errors of document operations.
#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    /// The id is not one a document can have.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// An empty document.
    #[error("the document has no tokens")]
    Empty,
    /// A document over [`MAX_DOCUMENT_TOKENS`].
    #[error(
        "the document has {0} tokens; at most {MAX_DOCUMENT_TOKENS} are kept in the cluster store"
    )]
    TooLong(usize),
    /// The same id already names a document of another base model.
    #[error("document {id} is already recorded for base {existing}, not {base}")]
    OtherBase {
        /// The id.
        id: String,
        /// The base on record.
        existing: String,
        /// The base asked for.
        base: String,
    },
    /// The store failed.
    #[error("document store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
}

/// Reads and writes document records.
#[derive(Debug, Clone)]
pub struct DocumentRegistry {
    store: Arc<dyn MetaStore>,
    keys: Keys,
}

impl DocumentRegistry {
    /// A registry over a store.
    pub fn new(store: Arc<dyn MetaStore>, keys: Keys) -> Self {
        Self { store, keys }
    }

    /// Records the document of `tokens` for `base`, unless it is recorded already; the record
    /// as it is in the store (an earlier one keeps its name and time).
    pub async fn add(
        &self,
        base: &str,
        tokens: Vec<u32>,
        name: Option<String>,
    ) -> Result<DocumentRecord, DocumentError> {
        if tokens.is_empty() {
            return Err(DocumentError::Empty);
        }
        if tokens.len() > MAX_DOCUMENT_TOKENS {
            return Err(DocumentError::TooLong(tokens.len()));
        }
        let record = DocumentRecord {
            id: scd_types::document_id(&tokens),
            base: base.to_owned(),
            name,
            tokens,
            added_at_ms: now_ms(),
        };
        let key = self.keys.document(&record.id)?;
        let created = self
            .store
            .txn(
                Txn::new()
                    .when([Compare::absent(key.clone())])
                    .and_then([TxnOp::put(key, envelope::encode(&record)?)]),
            )
            .await?;
        if created.succeeded {
            return Ok(record);
        }
        match self.get(&record.id).await? {
            Some(existing) if existing.base == record.base => Ok(existing),
            Some(existing) => Err(DocumentError::OtherBase {
                id: record.id,
                existing: existing.base,
                base: record.base,
            }),
            // Removed between the two calls: try again.
            None => Box::pin(self.add(base, record.tokens, record.name)).await,
        }
    }

    /// One document.
    pub async fn get(&self, id: &str) -> Result<Option<DocumentRecord>, DocumentError> {
        let key = self.keys.document(id)?;
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(envelope::decode(&kv.key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Removes a document's record; whether it existed. Compiled copies stay on the producers'
    /// disks (content-addressed, they are found again if the document is added again).
    pub async fn remove(&self, id: &str) -> Result<bool, DocumentError> {
        let key = self.keys.document(id)?;
        Ok(self.store.delete(&key).await?)
    }

    /// Every document.
    pub async fn list(&self) -> Result<Vec<DocumentRecord>, DocumentError> {
        let listing = self.store.get_prefix(&self.keys.documents_prefix()).await?;
        listing
            .kvs
            .iter()
            .map(|kv| envelope::decode(&kv.key, &kv.value).map_err(DocumentError::from))
            .collect()
    }
}
