//! Decoding: token ids back to text through a per-id byte table computed once at construction,
//! and [`StreamDecoder`] for ids that arrive one at a time.
//!
//! Byte-level BPE splits multi-byte UTF-8 characters across tokens, so text produced token by
//! token goes through a [`StreamDecoder`], which holds back incomplete characters instead of
//! emitting replacement characters that the next token would have completed.

use std::sync::Arc;

use super::byte_level::token_bytes;
use super::TokenizerError;

/// The raw bytes behind every id, and which ids are special.
#[derive(Debug)]
pub(super) struct ByteTable {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

impl ByteTable {
    pub(super) fn new(tok: &tokenizers::Tokenizer) -> Self {
        let n = tok.get_vocab_size(true);
        let added = tok.get_added_tokens_decoder();
        let mut bytes = Vec::with_capacity(n);
        let mut special = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let text = tok.id_to_token(id).unwrap_or_default();
            bytes.push(token_bytes(&text).into_boxed_slice());
            special.push(added.get(&id).is_some_and(|t| t.special));
        }
        Self { bytes, special }
    }

    /// Number of ids.
    pub(super) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether `id` is a special token; false for an unknown id.
    pub(super) fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The bytes of `id`; empty for a special token when skipping them.
    pub(super) fn bytes(&self, id: u32, skip_special: bool) -> Result<&[u8], TokenizerError> {
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

    /// The text of `ids`; invalid UTF-8 becomes U+FFFD.
    pub(super) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.bytes(id, skip_special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Turns ids arriving one at a time into text, emitting only whole UTF-8 characters.
///
/// The concatenation of everything [`StreamDecoder::step`] and [`StreamDecoder::finish`] return
/// equals [`Tokenizer::decode`](super::Tokenizer::decode) of all the ids.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    table: Arc<ByteTable>,
    skip_special: bool,
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub(super) fn new(table: Arc<ByteTable>, skip_special: bool) -> Self {
        Self {
            table,
            skip_special,
            pending: Vec::new(),
        }
    }

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
