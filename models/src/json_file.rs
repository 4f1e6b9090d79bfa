//! JSON files written atomically: the bytes go to a temporary file beside the target, are
//! flushed to disk, and the temporary file is renamed over the target, so a reader or a crash
//! sees the old file or the new one, never half of one. Checkpoints, manifests and records go
//! through here.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Reading or writing a JSON file failed.
#[derive(Debug, thiserror::Error)]
pub enum JsonFileError {
    /// The file system refused.
    #[error("cannot read or write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The content is not the JSON expected (or the value cannot be written as JSON).
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser or serialiser said.
        reason: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JsonFileError + '_ {
    move |source| JsonFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `value` as pretty JSON to `path`, atomically.
pub fn write_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), JsonFileError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| JsonFileError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(text.as_bytes()).map_err(io(&tmp))?;
    f.write_all(b"\n").map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Reads a JSON file.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<T, JsonFileError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    serde_json::from_slice(&bytes).map_err(|e| JsonFileError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_replaces_and_names_the_file_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        write_atomic(&p, &vec![1, 2]).unwrap();
        write_atomic(&p, &vec![3]).unwrap();
        assert_eq!(read::<Vec<u32>>(&p).unwrap(), vec![3]);
        assert!(!dir.path().join("x.json.tmp").exists());
        std::fs::write(&p, "{").unwrap();
        let err = read::<Vec<u32>>(&p).unwrap_err();
        assert!(matches!(err, JsonFileError::Format { .. }) && err.to_string().contains("x.json"));
        let missing = read::<Vec<u32>>(&dir.path().join("none.json")).unwrap_err();
        assert!(matches!(missing, JsonFileError::Io { .. }));
    }
}
