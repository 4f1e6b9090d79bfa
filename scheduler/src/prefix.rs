//! Content-addressed prompt-prefix blocks. A prompt's tokens are cut into fixed-size blocks and
//! each block's hash chains the previous one, so one hash names a whole prefix: a producer that
//! advertises hash `i` holds the state of the first `i + 1` blocks. Producers and the scheduler
//! compute the same hashes with this function.

use sha2::{Digest, Sha256};

/// Tokens per block unless configured otherwise.
pub const DEFAULT_BLOCK_TOKENS: usize = 32;

/// The chained hashes of every complete block of `tokens` (a trailing partial block is not
/// hashed: a prefix cache only holds whole blocks). `model` keeps hashes of different base
/// models apart.
pub fn block_hashes(model: &str, tokens: &[u32], block_tokens: usize) -> Vec<String> {
    let block_tokens = block_tokens.max(1);
    let mut previous = Sha256::digest(model.as_bytes());
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(previous);
            for t in block {
                h.update(t.to_le_bytes());
            }
            previous = h.finalize();
            // 128 bits are plenty to tell prefixes apart and keep node records small.
            hex::encode(&previous[..16])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_name_prefixes() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[70] = 9999;
        let ha = block_hashes("m", &a, 32);
        let hb = block_hashes("m", &b, 32);
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // The same block after a different prefix hashes differently.
        let mut c = a.clone();
        c[0] = 1234;
        assert_ne!(block_hashes("m", &c, 32)[1], ha[1]);
        assert_ne!(block_hashes("other", &a, 32)[0], ha[0]);
        assert!(block_hashes("m", &a[..31], 32).is_empty());
    }
}
