//! Text <-> token ids for llama-family models with a byte-level BPE vocabulary, and chat
//! conversations -> prompt text by the model's own chat template.
//!
//! A [`Tokenizer`] is built once and then only read. Its constructors are loaders, one per
//! source: [`Tokenizer::from_gguf`] reads the `tokenizer.*` metadata of a GGUF file (`gguf`),
//! [`Tokenizer::from_file`] and [`Tokenizer::from_hf_dir`] read a Hugging Face `tokenizer.json`
//! and `tokenizer_config.json` (`hf`). A GGUF names its pre-tokenizer (`pre_tokenizer`) and
//! lists its vocabulary and merges, from which `byte_level` builds the BPE model over GPT-2's
//! byte alphabet; its token types say which tokens are special (`special`, which also holds the
//! bos/eos that encoding adds and the ids that stop a generation). Both loaders end in
//! `Tokenizer::assemble` here, which computes the per-id byte table that `decode` uses and
//! compiles the chat template (`chat_template`). Errors are [`TokenizerError`] (`error`), and
//! [`ChatTemplateError`] for a template that does not compile or render.
//!
//! Encoding reuses the `tokenizers` BPE model and its word cache. Decoding maps ids to bytes
//! through the table; a [`StreamDecoder`] does it for ids that arrive one at a time, holding
//! back characters that a later token completes.
//!
//! [`Tokenizer::apply_chat_template`] renders with the model's own template through a Jinja
//! engine. A model without a template gets [`TokenizerError::NoChatTemplate`];
//! [`ChatTemplate::chatml`] is there for a caller that wants to fall back to ChatML then.

mod byte_level;
mod chat_template;
mod decode;
mod error;
mod gguf;
mod hf;
mod pre_tokenizer;
mod special;

use std::path::Path;
use std::sync::{Arc, OnceLock};

pub use chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};
pub use decode::StreamDecoder;
pub use error::TokenizerError;

use decode::ByteTable;
use error::library;

/// A byte-level BPE tokenizer with its special tokens and, when the model has one, its chat
/// template.
///
/// Cheap to share behind an `Arc`; cloning copies the vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Same model with special-token text treated as ordinary text, built on first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    table: Arc<ByteTable>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    stop_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("stop_ids", &self.stop_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// The tokenizer around a loaded `tokenizers` model: the byte table, the stop ids, and the
    /// chat template compiled with the bos/eos texts.
    fn assemble(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        chat_template: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let table = Arc::new(ByteTable::new(&inner));
        let stop_ids = special::stop_ids(&inner, eos_id);
        // The text of the token, as Hugging Face passes it (an added token's content).
        let text = |id: Option<u32>| id.map(|id| table.decode(&[id], false)).transpose();
        let chat_template = match chat_template {
            Some(source) => Some(
                ChatTemplate::from_source(source)?
                    .with_special_tokens(text(bos_id)?, text(eos_id)?),
            ),
            None => None,
        };
        Ok(Self {
            inner,
            plain: OnceLock::new(),
            table,
            bos_id,
            eos_id,
            stop_ids,
            chat_template,
        })
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json` (vocabulary, merges, pre-tokenizer,
    /// decoder, added tokens); bos/eos and the chat template are not part of that file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), TokenizerError> {
        let path = path.as_ref();
        self.inner
            .save(path, false)
            .map_err(library(format!("saving {}", path.display())))
    }

    /// Token ids of `text`. Special-token text such as `<|im_start|>` becomes its single id.
    /// `add_special_tokens` adds bos/eos where the model asks for them (SmolLM2 does not).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        encode_with(&self.inner, text, add_special_tokens)
    }

    /// Like [`Tokenizer::encode`], but special-token text is tokenized as ordinary text, so that
    /// untrusted input cannot produce control tokens.
    pub fn encode_plain(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        encode_with(plain, text, add_special_tokens)
    }

    /// The text of `ids`; invalid UTF-8 (a character cut off at either end) becomes U+FFFD.
    /// With `skip_special`, special tokens produce no text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.table.decode(ids, skip_special)
    }

    /// A decoder for ids that arrive one at a time (generation).
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(Arc::clone(&self.table), skip_special)
    }

    /// The id of a token given by its vocabulary text (byte-level form, e.g. `Ġthe`), or of a
    /// special token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary text of an id (byte-level form, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.table.is_special(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.table.len()
    }

    /// Beginning-of-sequence id, when known.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence id, when known.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Ids that end a generation: eos plus `<|im_end|>` and `<|endoftext|>` where they exist,
    /// sorted.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Whether `id` ends a generation.
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.binary_search(&id).is_ok()
    }

    /// The model's chat template, when it carries one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders a conversation with the model's own chat template, given the model's bos/eos
    /// texts. [`TokenizerError::NoChatTemplate`] when the model has none (there is no silent
    /// fallback; [`ChatTemplate::chatml`] is the explicit one), and
    /// [`TokenizerError::ChatTemplate`] with the template's own message when it fails or
    /// refuses the conversation.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        Ok(template.render(messages, add_generation_prompt)?)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn encode_with(
    tok: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizerError> {
    // `encode_fast` skips offset bookkeeping, which nothing here needs.
    let encoding = tok
        .encode_fast(text, add_special_tokens)
        .map_err(library("encoding"))?;
    Ok(encoding.get_ids().to_vec())
}
