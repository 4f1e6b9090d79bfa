//! [`Tokenizer::from_file`] and [`Tokenizer::from_hf_dir`]: the tokenizer of a Hugging Face
//! model, from `tokenizer.json` (vocabulary, merges, pre-tokenizer, added tokens) and
//! `tokenizer_config.json` (bos/eos and the chat template's source).

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tokenizers::decoders::DecoderWrapper;

use super::error::library;
use super::{Tokenizer, TokenizerError};

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. Its decoder must be byte-level. bos/eos and the
    /// chat template are unknown from this file alone (see [`Tokenizer::from_hf_dir`]); the stop
    /// ids are then the ChatML and end-of-text tokens that exist in the vocabulary.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        Self::assemble(tokenizer_json(path.as_ref())?, None, None, None)
    }

    /// Loads the tokenizer of a Hugging Face model directory: `tokenizer.json`, plus bos/eos and
    /// the chat template from `tokenizer_config.json` when that file exists (the template is
    /// compiled here, as in [`Tokenizer::from_gguf`]).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let inner = tokenizer_json(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&config_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Self::assemble(inner, None, None, None)
            }
            Err(source) => {
                return Err(TokenizerError::Io {
                    path: config_path,
                    source,
                })
            }
        };
        let config = TokenizerConfig::parse(&text).map_err(|reason| TokenizerError::Config {
            path: config_path.clone(),
            reason,
        })?;
        let id = |key: &str, text: Option<&str>| -> Result<Option<u32>, TokenizerError> {
            text.map(|t| {
                inner.token_to_id(t).ok_or_else(|| TokenizerError::Config {
                    path: config_path.clone(),
                    reason: format!("`{key}` {t:?} is not in the vocabulary"),
                })
            })
            .transpose()
        };
        let bos_id = id("bos_token", config.bos_token.as_deref())?;
        let eos_id = id("eos_token", config.eos_token.as_deref())?;
        Self::assemble(inner, bos_id, eos_id, config.chat_template.as_deref())
    }
}

/// A `tokenizer.json` with a byte-level decoder.
fn tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })?;
    let inner = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(library(format!("loading {}", path.display())))?;
    if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
        let found = match inner.get_decoder() {
            Some(d) => serde_json::to_string(d).unwrap_or_else(|e| e.to_string()),
            None => "none".to_owned(),
        };
        return Err(TokenizerError::UnsupportedDecoder {
            path: PathBuf::from(path),
            found,
        });
    }
    Ok(inner)
}

/// What the tokenizer takes from `tokenizer_config.json`.
struct TokenizerConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<String>,
}

impl TokenizerConfig {
    fn parse(text: &str) -> Result<Self, String> {
        let config: Json = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let token = |key: &str| -> Result<Option<String>, String> {
            // Either "<s>" or {"content": "<s>", ...}; null means none.
            match config.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::String(s)) => Ok(Some(s.clone())),
                Some(v) => v
                    .get("content")
                    .and_then(Json::as_str)
                    .map(|c| Some(c.to_owned()))
                    .ok_or_else(|| format!("`{key}` is neither a string nor has content")),
            }
        };
        let chat_template = match config.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            // Newer files hold a list of named templates; the one named "default" is the chat one.
            Some(Json::Array(list)) => Some(
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str)
                    .ok_or("no chat template named `default`")?
                    .to_owned(),
            ),
            Some(_) => return Err("`chat_template` is not a string".into()),
        };
        Ok(Self {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            chat_template,
        })
    }
}
