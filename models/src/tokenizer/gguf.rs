//! [`Tokenizer::from_gguf`]: the tokenizer described by a GGUF file's `tokenizer.*` metadata
//! (vocabulary, merges, token types, bos/eos, and the chat template's source), read and checked
//! here and assembled by the sibling modules.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::Vocab;

use super::special::Surround;
use super::{byte_level, pre_tokenizer, special, Tokenizer, TokenizerError};

type Metadata = std::collections::HashMap<String, Value>;

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's metadata: `tokenizer.ggml.model` (must be
    /// `gpt2`), `.pre`, `.tokens`, `.merges`, `.token_type`, the bos/eos ids, `add_bos_token` /
    /// `add_eos_token`, and `tokenizer.chat_template` when present (compiled here, so that a
    /// template the engine cannot parse is an error now rather than at the first chat).
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let md = &content.metadata;
        let model = meta_str(md, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        let pre_tokenizer = pre_tokenizer::for_gguf_name(meta_str(md, "tokenizer.ggml.pre")?)?;

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
        let merges = merges(meta_array(md, "tokenizer.ggml.merges")?)?;
        let token_types = token_types(md, tokens.len())?;

        let mut inner = byte_level::bpe_tokenizer(vocab, merges, pre_tokenizer)?;
        special::add_typed_tokens(&mut inner, &tokens, &token_types)?;

        let bos_id = meta_opt_u32(md, "tokenizer.ggml.bos_token_id", vocab_len)?;
        let eos_id = meta_opt_u32(md, "tokenizer.ggml.eos_token_id", vocab_len)?;
        let wanted = |flag: &'static str, id_key: &'static str, id: Option<u32>| {
            if !meta_opt_bool(md, flag)?.unwrap_or(false) {
                return Ok(None);
            }
            let id = id.ok_or(TokenizerError::MissingMetadata(id_key))?;
            Ok::<_, TokenizerError>(Some((tokens[id as usize].to_owned(), id)))
        };
        let surround = Surround {
            bos: wanted(
                "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.bos_token_id",
                bos_id,
            )?,
            eos: wanted(
                "tokenizer.ggml.add_eos_token",
                "tokenizer.ggml.eos_token_id",
                eos_id,
            )?,
        };
        special::add_surround(&mut inner, surround)
            .map_err(|reason| bad("tokenizer.ggml.add_bos_token", reason))?;

        let chat_template = match md.get("tokenizer.chat_template") {
            Some(Value::String(s)) => Some(s.as_str()),
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
}

/// `tokenizer.ggml.merges`: one `a b` string per merge.
fn merges(entries: &[Value]) -> Result<Vec<(String, String)>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.merges";
    entries
        .iter()
        .map(|v| {
            let Value::String(s) = v else {
                return Err(bad(KEY, format!("non-string entry {v:?}")));
            };
            // Byte-level tokens never contain a space (it is mapped to 'Ġ'), so the single
            // space separates the pair unambiguously.
            match s.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    Ok((a.to_owned(), b.to_owned()))
                }
                _ => Err(bad(KEY, format!("entry {s:?} is not `a b`"))),
            }
        })
        .collect()
}

/// `tokenizer.ggml.token_type`: one type per token, or empty when the file has none.
fn token_types(md: &Metadata, n_tokens: usize) -> Result<Vec<i32>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let types = match md.get(KEY) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.to_i32().map_err(|e| bad(KEY, e.to_string())))
            .collect::<Result<Vec<i32>, _>>()?,
        Some(other) => return Err(bad(KEY, format!("not an array: {other:?}"))),
        None => Vec::new(),
    };
    if !types.is_empty() && types.len() != n_tokens {
        return Err(bad(
            KEY,
            format!("{} entries for {n_tokens} tokens", types.len()),
        ));
    }
    Ok(types)
}

fn bad(key: &'static str, reason: String) -> TokenizerError {
    TokenizerError::BadMetadata { key, reason }
}

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
