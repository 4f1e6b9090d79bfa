//! The name of a translator version: the SHA-256 of its content.

use std::fmt;
use std::str::FromStr;

use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};
use serde::{Deserialize, Serialize};

/// A translator version's content hash. The producer stamps it on every code frame and the
/// consumer refuses codes made with a translator other than the one it loaded, so the hash is
/// what "translator version" means on the wire and in the store (a version's human label is
/// only a label). Written as 64 lower-case hex digits in text, 32 bytes on the wire.
#[derive(
    Archive, RkyvSerialize, RkyvDeserialize, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct TranslatorHash([u8; 32]);

impl TranslatorHash {
    /// The hash with these bytes (e.g. a SHA-256 digest).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The hash's bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The first 12 hex digits, for logs and tables.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

impl ArchivedTranslatorHash {
    /// The hash this archive holds.
    pub fn get(&self) -> TranslatorHash {
        TranslatorHash(self.0)
    }
}

impl fmt::Display for TranslatorHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for TranslatorHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TranslatorHash({self})")
    }
}

/// A translator hash string that is not 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("translator hash {0:?} is not 64 hex digits")]
pub struct ParseTranslatorHashError(String);

impl FromStr for TranslatorHash {
    type Err = ParseTranslatorHashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| ParseTranslatorHashError(s.to_owned()))?;
        Ok(Self(out))
    }
}

impl Serialize for TranslatorHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TranslatorHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_json_forms_round_trip() {
        let h = TranslatorHash::from_bytes([0xab; 32]);
        let text = h.to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(text.parse::<TranslatorHash>().unwrap(), h);
        assert_eq!(h.short(), "abababababab");
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<TranslatorHash>(&json).unwrap(), h);
        for bad in ["", "ab", &"g".repeat(64), &"a".repeat(66)] {
            assert!(bad.parse::<TranslatorHash>().is_err(), "{bad:?}");
        }
    }
}
