//! Byte-level BPE: the BPE model over GPT-2's byte alphabet, in which every byte of UTF-8 text
//! is one printable character, and the way back from a token's text to the bytes it stands for.
//!
//! Encoding runs in the `tokenizers` crate (its BPE model and word cache); the alphabet here is
//! what decoding ([`super::decode`]) needs to turn ids into bytes without going through it.

use std::sync::OnceLock;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;

use super::error::library;
use super::TokenizerError;

/// A byte-level BPE tokenizer from a vocabulary and its merges, with the given pre-tokenizer
/// and the byte-level decoder. Special tokens are added by the caller.
pub(super) fn bpe_tokenizer(
    vocab: Vocab,
    merges: Vec<(String, String)>,
    pre_tokenizer: PreTokenizerWrapper,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(library("building the BPE model from tokens and merges"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::new(false, true, true)));
    Ok(inner)
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
pub(super) fn token_bytes(token: &str) -> Vec<u8> {
    static TABLE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    let table = TABLE.get_or_init(char_to_byte_table);
    token
        .chars()
        .map(|c| table.get(c as usize).copied().flatten())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_covers_every_byte_once() {
        let table = char_to_byte_table();
        let mut seen = [false; 256];
        for b in table.iter().flatten() {
            assert!(!seen[*b as usize], "byte {b} twice");
            seen[*b as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn tokens_map_to_their_bytes() {
        // 'Ġ' is the space, 'Ċ' the newline; plain ASCII stands for itself.
        assert_eq!(token_bytes("Ġthe"), b" the");
        assert_eq!(token_bytes("ĊĊ"), b"\n\n");
        // "ðŁ¦Ģ" is the 4-byte crab emoji in byte-level form.
        assert_eq!(token_bytes("ðŁ¦Ģ"), "🦀".as_bytes());
        // A character outside the alphabet: the token is literal text.
        assert_eq!(token_bytes("<think>\n"), b"<think>\n");
    }
}
