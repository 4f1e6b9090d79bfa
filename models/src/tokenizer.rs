//! Text <-> token ids for llama-family models with a byte-level BPE vocabulary.
//!
//! A [`Tokenizer`] is built once, either from the tokenizer metadata inside a GGUF file
//! ([`Tokenizer::from_gguf`]) or from a Hugging Face `tokenizer.json` ([`Tokenizer::from_file`],
//! [`Tokenizer::from_hf_dir`]), and then only read: encoding reuses the `tokenizers` BPE model and
//! its word cache, decoding uses a per-id byte table computed at construction.
//!
//! Byte-level BPE splits multi-byte UTF-8 characters across tokens, so text produced token by
//! token goes through a [`StreamDecoder`], which holds back incomplete characters instead of
//! emitting replacement characters that the next token would have completed.
//!
//! [`ChatTemplate`] renders conversations in ChatML, the format of the GGUF's
//! `tokenizer.chat_template` for SmolLM2, including the default system prompt that the template
//! inserts when a conversation does not start with one.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

/// Errors from building or using a [`Tokenizer`] or a [`ChatTemplate`].
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
    /// The tokenizer carries no chat template.
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template is not ChatML, the only format rendered here.
    #[error("unsupported chat template (not ChatML): {0}")]
    UnsupportedChatTemplate(String),
}

fn library(context: impl Into<String>) -> impl FnOnce(tokenizers::Error) -> TokenizerError {
    let context = context.into();
    move |source| TokenizerError::Library { context, source }
}

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Token texts that end a generation whatever the configured eos is: the end of a ChatML turn and
/// the end of a document. llama.cpp treats both as end-of-generation tokens too.
const STOP_TOKEN_TEXTS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// A byte-level BPE tokenizer with its special tokens and, when known, its chat template.
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
    /// Builds the tokenizer described by a GGUF file's metadata: `tokenizer.ggml.model` (must be
    /// `gpt2`), `.pre`, `.tokens`, `.merges`, `.token_type`, the bos/eos ids, `add_bos_token` /
    /// `add_eos_token`, and `tokenizer.chat_template` when present.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let md = &content.metadata;
        let model = meta_str(md, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        let pre = meta_str(md, "tokenizer.ggml.pre")?;
        let pre_tokenizer = pre_tokenizer_for(pre)?;

        let tokens = meta_array(md, "tokenizer.ggml.tokens")?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(bad(
                    "tokenizer.ggml.tokens",
                    format!("non-string entry {other:?}"),
                )),
            })
            .collect::<Result<Vec<&str>, _>>()?;
        let vocab_len = u32::try_from(tokens.len())
            .map_err(|_| bad("tokenizer.ggml.tokens", "more than u32::MAX tokens".into()))?;
        let vocab: Vocab = tokens
            .iter()
            .zip(0..vocab_len)
            .map(|(t, i)| ((*t).to_owned(), i))
            .collect();
        if vocab.len() != tokens.len() {
            return Err(bad("tokenizer.ggml.tokens", "duplicate token texts".into()));
        }

        let merges = meta_array(md, "tokenizer.ggml.merges")?
            .iter()
            .map(|v| {
                let Value::String(s) = v else {
                    return Err(bad(
                        "tokenizer.ggml.merges",
                        format!("non-string entry {v:?}"),
                    ));
                };
                // Byte-level tokens never contain a space (it is mapped to 'Ġ'), so the single
                // space separates the pair unambiguously.
                match s.split_once(' ') {
                    Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                        Ok((a.to_owned(), b.to_owned()))
                    }
                    _ => Err(bad(
                        "tokenizer.ggml.merges",
                        format!("entry {s:?} is not `a b`"),
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;

        let token_types = match md.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.to_i32()
                        .map_err(|e| bad("tokenizer.ggml.token_type", e.to_string()))
                })
                .collect::<Result<Vec<i32>, _>>()?,
            Some(other) => {
                return Err(bad(
                    "tokenizer.ggml.token_type",
                    format!("not an array: {other:?}"),
                ))
            }
            None => Vec::new(),
        };
        if !token_types.is_empty() && token_types.len() != tokens.len() {
            return Err(bad(
                "tokenizer.ggml.token_type",
                format!("{} entries for {} tokens", token_types.len(), tokens.len()),
            ));
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(library(
                "building the BPE model from GGUF tokens and merges",
            ))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevel::new(false, true, true)));

        // Control tokens (<|im_start|> ...) are special: matched whole in text and dropped by
        // `skip_special`; user-defined ones are matched whole but kept.
        let typed = |wanted: i32| -> Vec<AddedToken> {
            token_types
                .iter()
                .zip(&tokens)
                .filter(|(ty, _)| **ty == wanted)
                .map(|(_, text)| {
                    AddedToken::from(*text, wanted == TOKEN_TYPE_CONTROL).normalized(false)
                })
                .collect()
        };
        inner
            .add_special_tokens(typed(TOKEN_TYPE_CONTROL))
            .map_err(library("adding control tokens"))?;
        inner
            .add_tokens(typed(TOKEN_TYPE_USER_DEFINED))
            .map_err(library("adding user-defined tokens"))?;

        let bos_id = meta_opt_u32(md, "tokenizer.ggml.bos_token_id", vocab_len)?;
        let eos_id = meta_opt_u32(md, "tokenizer.ggml.eos_token_id", vocab_len)?;
        let add_bos = meta_opt_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let add_eos = meta_opt_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos || add_eos {
            let mut pieces = Vec::new();
            let mut specials = Vec::new();
            let mut special = |key: &'static str, id: Option<u32>| {
                let id = id.ok_or(TokenizerError::MissingMetadata(key))?;
                let text = tokens[id as usize].to_owned();
                specials.push((text.clone(), id));
                Ok::<String, TokenizerError>(text)
            };
            if add_bos {
                pieces.push(special("tokenizer.ggml.bos_token_id", bos_id)?);
            }
            pieces.push("$0".to_owned());
            if add_eos {
                pieces.push(special("tokenizer.ggml.eos_token_id", eos_id)?);
            }
            let processor = TemplateProcessing::builder()
                .try_single(pieces)
                .map_err(|e| bad("tokenizer.ggml.add_bos_token", e))?
                .special_tokens(specials)
                .build()
                .map_err(|e| bad("tokenizer.ggml.add_bos_token", e.to_string()))?;
            inner.with_post_processor(Some(processor));
        }

        let chat_template = match md.get("tokenizer.chat_template") {
            Some(Value::String(s)) => Some(ChatTemplate::from_source(s)?),
            Some(other) => {
                return Err(bad(
                    "tokenizer.chat_template",
                    format!("not a string: {other:?}"),
                ))
            }
            None => None,
        };
        Self::assemble(inner, bos_id, eos_id, chat_template)
    }

    /// Loads a Hugging Face `tokenizer.json`. Its decoder must be byte-level. bos/eos are unknown
    /// from this file alone (see [`Tokenizer::from_hf_dir`]); the stop ids are then the ChatML and
    /// end-of-text tokens that exist in the vocabulary.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
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
                path: path.to_owned(),
                found,
            });
        }
        Self::assemble(inner, None, None, None)
    }

    /// Loads the tokenizer of a Hugging Face model directory: `tokenizer.json`, plus bos/eos and
    /// the chat template from `tokenizer_config.json` when that file exists.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let mut tok = Self::from_file(dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&config_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(tok),
            Err(source) => {
                return Err(TokenizerError::Io {
                    path: config_path,
                    source,
                })
            }
        };
        let config_err = |reason: String| TokenizerError::Config {
            path: config_path.clone(),
            reason,
        };
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| config_err(e.to_string()))?;
        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            // Either "<s>" or {"content": "<s>", ...}; null means none.
            let text = match config.get(key) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(v) => v.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                    config_err(format!("`{key}` is neither a string nor has content"))
                })?,
            };
            tok.token_to_id(text)
                .map(Some)
                .ok_or_else(|| config_err(format!("`{key}` {text:?} is not in the vocabulary")))
        };
        let bos_id = token_id("bos_token")?;
        let eos_id = token_id("eos_token")?;
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(ChatTemplate::from_source(s)?),
            // Newer files hold a list of named templates; the one named "default" is the chat one.
            Some(serde_json::Value::Array(list)) => {
                let default = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| config_err("no chat template named `default`".into()))?;
                Some(ChatTemplate::from_source(default)?)
            }
            Some(_) => return Err(config_err("`chat_template` is not a string".into())),
        };
        tok.bos_id = bos_id;
        tok.eos_id = eos_id;
        tok.stop_ids = stop_ids(&tok.inner, eos_id);
        tok.chat_template = chat_template;
        Ok(tok)
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        chat_template: Option<ChatTemplate>,
    ) -> Result<Self, TokenizerError> {
        let table = Arc::new(ByteTable::new(&inner));
        let stop_ids = stop_ids(&inner, eos_id);
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
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.table.bytes(id, skip_special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A decoder for ids that arrive one at a time (generation).
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder {
            table: Arc::clone(&self.table),
            skip_special,
            pending: Vec::new(),
        }
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
        self.table
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.table.bytes.len()
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

    /// The chat template, when the model carries one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders a conversation with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        Ok(template.render(messages, add_generation_prompt))
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

fn stop_ids(inner: &tokenizers::Tokenizer, eos_id: Option<u32>) -> Vec<u32> {
    let set: BTreeSet<u32> = eos_id
        .into_iter()
        .chain(STOP_TOKEN_TEXTS.iter().filter_map(|t| inner.token_to_id(t)))
        .collect();
    set.into_iter().collect()
}

fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    // The GPT-2 split regex of `ByteLevel` (use_regex) is the one llama.cpp applies for these
    // names; "smollm" first isolates every digit (llama.cpp's `\p{N}` pass).
    let byte_level = ByteLevel::new(false, true, true);
    match pre {
        "smollm" => Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(byte_level),
        ]))),
        "gpt-2" => Ok(PreTokenizerWrapper::ByteLevel(byte_level)),
        other => Err(TokenizerError::UnsupportedPreTokenizer(other.to_owned())),
    }
}

fn bad(key: &'static str, reason: String) -> TokenizerError {
    TokenizerError::BadMetadata { key, reason }
}

type Metadata = std::collections::HashMap<String, Value>;

fn meta_str<'a>(md: &'a Metadata, key: &'static str) -> Result<&'a str, TokenizerError> {
    match md.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(bad(key, format!("not a string: {other:?}"))),
        None => Err(TokenizerError::MissingMetadata(key)),
    }
}

fn meta_array<'a>(md: &'a Metadata, key: &'static str) -> Result<&'a [Value], TokenizerError> {
    match md.get(key) {
        Some(Value::Array(a)) => Ok(a),
        Some(other) => Err(bad(key, format!("not an array: {other:?}"))),
        None => Err(TokenizerError::MissingMetadata(key)),
    }
}

fn meta_opt_u32(
    md: &Metadata,
    key: &'static str,
    vocab: u32,
) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = v.to_u32().map_err(|e| bad(key, e.to_string()))?;
    if id >= vocab {
        return Err(bad(
            key,
            format!("id {id} outside the vocabulary of {vocab}"),
        ));
    }
    Ok(Some(id))
}

fn meta_opt_bool(md: &Metadata, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    md.get(key)
        .map(|v| v.to_bool().map_err(|e| bad(key, e.to_string())))
        .transpose()
}

/// The raw bytes behind every id, and which ids are special.
#[derive(Debug)]
struct ByteTable {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

impl ByteTable {
    fn new(tok: &tokenizers::Tokenizer) -> Self {
        let n = tok.get_vocab_size(true);
        let added = tok.get_added_tokens_decoder();
        let mut bytes = Vec::with_capacity(n);
        let mut special = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let text = tok.id_to_token(id).unwrap_or_default();
            bytes.push(byte_level_bytes(&text).into_boxed_slice());
            special.push(added.get(&id).is_some_and(|t| t.special));
        }
        Self { bytes, special }
    }

    /// The bytes of `id`; empty for a special token when skipping them.
    fn bytes(&self, id: u32, skip_special: bool) -> Result<&[u8], TokenizerError> {
        let b = self
            .bytes
            .get(id as usize)
            .ok_or(TokenizerError::UnknownId {
                id,
                vocab_size: self.bytes.len(),
            })?;
        if skip_special && self.special[id as usize] {
            Ok(&[])
        } else {
            Ok(b)
        }
    }
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the 68 others are
/// shifted to U+0100.. in byte order. Index: code point; value: the byte it stands for.
fn char_to_byte_table() -> [Option<u8>; 324] {
    let mut table = [None; 324];
    let mut next = 256usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
}

/// The bytes a byte-level token stands for. Like the `tokenizers` ByteLevel decoder, a token with
/// any character outside the alphabet (an added token such as `<think>\n`) stands for its own
/// UTF-8 text.
fn byte_level_bytes(token: &str) -> Vec<u8> {
    static TABLE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    let table = TABLE.get_or_init(char_to_byte_table);
    token
        .chars()
        .map(|c| table.get(c as usize).copied().flatten())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// Turns ids arriving one at a time into text, emitting only whole UTF-8 characters.
///
/// The concatenation of everything [`StreamDecoder::step`] and [`StreamDecoder::finish`] return
/// equals [`Tokenizer::decode`] of all the ids.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    table: Arc<ByteTable>,
    skip_special: bool,
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Feeds one id; returns the text it completed (possibly empty).
    pub fn step(&mut self, id: u32) -> Result<String, TokenizerError> {
        let bytes = self.table.bytes(id, self.skip_special)?;
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid_up_to` guarantees `valid` is UTF-8.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // Invalid whatever follows: replace it the way a lossy decode of the
                        // whole text would.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[len..];
                        }
                        // A character cut off by the end of the input: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        Ok(out)
    }

    /// Ends the stream: an incomplete trailing character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A ChatML chat template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, an optional
/// default system message when the conversation does not start with one, and
/// `<|im_start|>assistant\n` as the generation prompt.
///
/// The Jinja source is kept (for display and for checking) but not interpreted: it is recognised
/// as ChatML and its default system prompt, if any, is read out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    source: String,
    default_system: Option<String>,
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

impl ChatTemplate {
    /// Recognises a ChatML template source (as found in `tokenizer.chat_template`).
    pub fn from_source(source: &str) -> Result<Self, TokenizerError> {
        if !source.contains(IM_START) || !source.contains(IM_END) {
            let head: String = source.chars().take(120).collect();
            return Err(TokenizerError::UnsupportedChatTemplate(head));
        }
        Ok(Self {
            source: source.to_owned(),
            default_system: default_system_prompt(source),
        })
    }

    /// Plain ChatML without a default system prompt.
    pub fn chatml() -> Self {
        Self {
            source: String::new(),
            default_system: None,
        }
    }

    /// The template source it was recognised from (empty for [`ChatTemplate::chatml`]).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The system prompt inserted when a conversation does not start with a system message.
    pub fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    /// Renders a conversation; with `add_generation_prompt`, ends with the opening of an
    /// assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        if let (Some(first), Some(system)) = (messages.first(), &self.default_system) {
            if first.role != "system" {
                push_turn(&mut out, "system", system);
            }
        }
        for m in messages {
            push_turn(&mut out, &m.role, &m.content);
        }
        if add_generation_prompt {
            out.push_str(IM_START);
            out.push_str("assistant\n");
        }
        out
    }
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END);
    out.push('\n');
}

/// The literal system turn written into a template, e.g. SmolLM2's
/// `'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n'`.
/// Only a literal counts: text containing quotes or Jinja delimiters is an expression that
/// inserts the caller's own system message, not a default.
fn default_system_prompt(source: &str) -> Option<String> {
    let marker = format!("{IM_START}system");
    let mut search = source;
    while let Some(pos) = search.find(&marker) {
        let after = &search[pos + marker.len()..];
        let body = after
            .strip_prefix('\n')
            .or_else(|| after.strip_prefix("\\n"));
        if let Some(body) = body {
            if let Some(end) = body.find(IM_END) {
                let text = &body[..end];
                if !text.is_empty() && !text.contains(['\'', '"', '{', '}']) {
                    return Some(text.replace("\\n", "\n"));
                }
            }
        }
        search = after;
    }
    None
}
