//! Model records under `/models/<id>`: what each model is and which base it was tuned from. An
//! expert is a model with a base; the scheduler builds a producer pool for each.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::envelope::{self, EnvelopeError};
use crate::keys::{InvalidId, Keys};
use crate::store::{MetaStore, StoreError};

/// A model known to the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Model id.
    pub id: String,
    /// Architecture name (e.g. `llama`).
    pub architecture: String,
    /// Content hash of the weights.
    pub weights_hash: String,
    /// The base model it was fine-tuned from; `None` for a base model.
    #[serde(default)]
    pub base: Option<String>,
}

/// Errors of model registry operations.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model id is not a valid key segment.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// The store failed.
    #[error("model store operation failed: {0}")]
    Store(#[from] StoreError),
    /// A record could not be read or written.
    #[error(transparent)]
    Codec(#[from] EnvelopeError),
}

/// Reads and writes model records.
#[derive(Debug, Clone)]
pub struct ModelRegistry {
    store: Arc<dyn MetaStore>,
    keys: Keys,
}

impl ModelRegistry {
    /// A registry over a store.
    pub fn new(store: Arc<dyn MetaStore>, keys: Keys) -> Self {
        Self { store, keys }
    }

    /// Writes (or replaces) a model record.
    pub async fn put(&self, model: &ModelRecord) -> Result<(), ModelError> {
        let key = self.keys.model(&model.id)?;
        self.store.put(&key, envelope::encode(model)?, None).await?;
        Ok(())
    }

    /// Reads one model.
    pub async fn get(&self, id: &str) -> Result<Option<ModelRecord>, ModelError> {
        let key = self.keys.model(id)?;
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(envelope::decode(&kv.key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Removes a model record; returns whether it existed. An expert removed here loses its
    /// pool at the scheduler's next pass.
    pub async fn remove(&self, id: &str) -> Result<bool, ModelError> {
        let key = self.keys.model(id)?;
        Ok(self.store.delete(&key).await?)
    }

    /// Every model.
    pub async fn list(&self) -> Result<Vec<ModelRecord>, ModelError> {
        let listing = self.store.get_prefix(&self.keys.models_prefix()).await?;
        listing
            .kvs
            .iter()
            .map(|kv| envelope::decode(&kv.key, &kv.value).map_err(ModelError::from))
            .collect()
    }
}
