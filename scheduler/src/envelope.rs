//! Values in the store are JSON in a small envelope that carries a schema version, so a node
//! never misreads a record written by an incompatible release.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The schema version this release writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A stored value that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// Not the JSON this release expects.
    #[error("malformed record at {key}: {source}")]
    Malformed {
        /// The key read.
        key: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// Written with another schema version.
    #[error("record at {key} has schema {found}, this release reads schema {SCHEMA_VERSION}; upgrade the node")]
    Schema {
        /// The key read.
        key: String,
        /// The version found.
        found: u32,
    },
    /// The value could not be serialised.
    #[error("cannot serialise a record: {0}")]
    Serialise(#[source] serde_json::Error),
}

#[derive(Serialize)]
struct EnvelopeOut<'a, T> {
    schema: u32,
    data: &'a T,
}

#[derive(Deserialize)]
struct EnvelopeIn<T> {
    data: Option<T>,
}

#[derive(Deserialize)]
struct SchemaOnly {
    schema: u32,
}

/// Serialises a value with the current schema version.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, EnvelopeError> {
    serde_json::to_vec(&EnvelopeOut {
        schema: SCHEMA_VERSION,
        data: value,
    })
    .map_err(EnvelopeError::Serialise)
}

/// Reads a value written by [`encode`], refusing other schema versions.
pub fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, EnvelopeError> {
    // Check the version first so a newer layout reports "schema", not a confusing field error.
    let head: SchemaOnly =
        serde_json::from_slice(bytes).map_err(|source| EnvelopeError::Malformed {
            key: key.to_string(),
            source,
        })?;
    if head.schema != SCHEMA_VERSION {
        return Err(EnvelopeError::Schema {
            key: key.to_string(),
            found: head.schema,
        });
    }
    let envelope: EnvelopeIn<T> =
        serde_json::from_slice(bytes).map_err(|source| EnvelopeError::Malformed {
            key: key.to_string(),
            source,
        })?;
    envelope.data.ok_or_else(|| EnvelopeError::Malformed {
        key: key.to_string(),
        source: serde::de::Error::missing_field("data"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_schema_check() {
        let bytes = encode(&vec![1u32, 2]).unwrap();
        assert_eq!(decode::<Vec<u32>>("k", &bytes).unwrap(), vec![1, 2]);
        let other = br#"{"schema":2,"data":{"new":"layout"}}"#;
        assert!(matches!(
            decode::<Vec<u32>>("k", other),
            Err(EnvelopeError::Schema { found: 2, .. })
        ));
        assert!(matches!(
            decode::<Vec<u32>>("k", b"nope"),
            Err(EnvelopeError::Malformed { .. })
        ));
    }
}
