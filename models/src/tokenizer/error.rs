//! [`TokenizerError`]: what can go wrong building a [`Tokenizer`](super::Tokenizer) from GGUF
//! metadata or Hugging Face files, and using it. Chat-template failures have their own type,
//! [`ChatTemplateError`], carried here when they happen through the tokenizer.

use std::path::PathBuf;

use super::chat_template::ChatTemplateError;

/// Errors from building or using a [`Tokenizer`](super::Tokenizer).
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A GGUF metadata key the tokenizer needs is absent.
    #[error("GGUF metadata has no `{0}`")]
    MissingMetadata(&'static str),
    /// A GGUF metadata value has the wrong type or an impossible value.
    #[error("GGUF metadata `{key}` is malformed: {reason}")]
    BadMetadata {
        /// The metadata key.
        key: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer kind this module does not build.
    #[error("unsupported tokenizer model `{0}` (supported: gpt2, i.e. byte-level BPE)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this module does not reproduce.
    #[error("unsupported pre-tokenizer `{0}` (supported: smollm, gpt-2)")]
    UnsupportedPreTokenizer(String),
    /// A `tokenizer.json` whose decoder is not byte-level; the byte table and the streaming
    /// decoder rely on it.
    #[error(
        "unsupported decoder in {path}: {found} (only a plain ByteLevel decoder is supported)"
    )]
    UnsupportedDecoder {
        /// The file.
        path: PathBuf,
        /// The decoder found, as JSON.
        found: String,
    },
    /// Reading a file failed.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON of the expected shape.
    #[error("cannot parse {path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The `tokenizers` library refused to build, load, save, encode or decode.
    #[error("tokenizers: {context}")]
    Library {
        /// What was being done.
        context: String,
        /// The library's error.
        #[source]
        source: tokenizers::Error,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The model carries no chat template (neither `tokenizer.chat_template` in the GGUF nor
    /// `chat_template` in `tokenizer_config.json`).
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The model's chat template does not compile or failed to render.
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
}

/// Maps a `tokenizers` error to [`TokenizerError::Library`] with what was being done.
pub(super) fn library(
    context: impl Into<String>,
) -> impl FnOnce(tokenizers::Error) -> TokenizerError {
    let context = context.into();
    move |source| TokenizerError::Library { context, source }
}
