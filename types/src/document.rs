//! A document's id: what a job names when it asks for compiled documents (SemPIC served from the
//! cluster, `docs/method.md` §5.5), what a producer's compiled-document store files an entry
//! under and what a node announces it holds.
//! One function makes it everywhere, so that the store, the scheduler and the wire agree.

use sha2::{Digest, Sha256};

/// A document's id: the first 16 bytes of the SHA-256 of its tokens (each as 4 little-endian
/// bytes), in lower-case hex. The tokens are the base model's, so the id names the same
/// document for every writer of that base; a writer version is kept apart by where a compiled
/// entry is filed, not by the id.
pub fn document_id(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// Whether `id` has the form [`document_id`] gives (32 lower-case hex digits).
pub fn is_document_id(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_token_sequences_and_have_one_form() {
        let a = document_id(&[1, 2, 3]);
        assert!(is_document_id(&a), "{a}");
        assert_eq!(a, document_id(&[1, 2, 3]));
        assert_ne!(a, document_id(&[1, 2, 4]));
        // Token boundaries count: [1, 2] is not [258] or [1, 2, 0].
        assert_ne!(document_id(&[1, 2]), document_id(&[0x0201]));
        assert_ne!(document_id(&[1, 2]), document_id(&[1, 2, 0]));
        for bad in [
            "",
            "ABCDEF00000000000000000000000000",
            &a[..31],
            "g".repeat(32).as_str(),
        ] {
            assert!(!is_document_id(bad), "{bad:?}");
        }
    }
}
