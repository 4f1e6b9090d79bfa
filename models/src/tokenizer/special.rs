//! Special tokens: which vocabulary entries are matched whole in text (GGUF token types), the
//! bos/eos that encoding adds when the model asks for them, and the ids that end a generation.

use std::collections::BTreeSet;

use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use super::error::library;
use super::TokenizerError;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Token texts that end a generation whatever the configured eos is: the end of a ChatML turn and
/// the end of a document. llama.cpp treats both as end-of-generation tokens too.
const STOP_TOKEN_TEXTS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// Registers the GGUF's control and user-defined tokens with `inner`. `token_types` is empty
/// (no types in the file) or has one entry per token.
pub(super) fn add_typed_tokens(
    inner: &mut tokenizers::Tokenizer,
    tokens: &[&str],
    token_types: &[i32],
) -> Result<(), TokenizerError> {
    // Control tokens (<|im_start|> ...) are special: matched whole in text and dropped by
    // `skip_special`; user-defined ones are matched whole but kept.
    let typed = |wanted: i32| -> Vec<AddedToken> {
        token_types
            .iter()
            .zip(tokens)
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
    Ok(())
}

/// The bos and eos that `encode(.., add_special_tokens: true)` puts around the text, each as
/// `(token text, id)`; `None` for one the model does not ask for.
pub(super) struct Surround {
    pub(super) bos: Option<(String, u32)>,
    pub(super) eos: Option<(String, u32)>,
}

/// Makes encoding with special tokens add `surround`'s bos and eos; nothing when it has neither.
pub(super) fn add_surround(
    inner: &mut tokenizers::Tokenizer,
    surround: Surround,
) -> Result<(), String> {
    if surround.bos.is_none() && surround.eos.is_none() {
        return Ok(());
    }
    let mut pieces = Vec::new();
    let mut specials = Vec::new();
    if let Some((text, id)) = surround.bos {
        pieces.push(text.clone());
        specials.push((text, id));
    }
    pieces.push("$0".to_owned());
    if let Some((text, id)) = surround.eos {
        pieces.push(text.clone());
        specials.push((text, id));
    }
    let processor = TemplateProcessing::builder()
        .try_single(pieces)?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())?;
    inner.with_post_processor(Some(processor));
    Ok(())
}

/// Ids that end a generation: eos plus the [`STOP_TOKEN_TEXTS`] that exist, sorted.
pub(super) fn stop_ids(inner: &tokenizers::Tokenizer, eos_id: Option<u32>) -> Vec<u32> {
    let set: BTreeSet<u32> = eos_id
        .into_iter()
        .chain(STOP_TOKEN_TEXTS.iter().filter_map(|t| inner.token_to_id(t)))
        .collect();
    set.into_iter().collect()
}
