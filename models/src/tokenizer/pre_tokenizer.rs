//! Pre-tokenisation: how text is cut into words before BPE merges run inside each word, chosen
//! by the GGUF's `tokenizer.ggml.pre` name the way llama.cpp chooses its split regexes.
//! A Hugging Face `tokenizer.json` carries its own pre-tokenizer and does not come here.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;

use super::TokenizerError;

/// The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` name.
pub(super) fn for_gguf_name(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
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
