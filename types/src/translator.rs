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

/// The ranks of a translator's three codes: `Z_K` and `Z_V` (Reuse, every layer) and `Z_H`
/// (Patch layers). Translators store nested codes up to some `r_max`, so any ranks up to it
/// can be asked for per job; text form `k=96,v=192,h=128`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Ranks {
    /// Rank of `Z_K`.
    pub k: usize,
    /// Rank of `Z_V`.
    pub v: usize,
    /// Rank of `Z_H` (Patch layers).
    pub h: usize,
}

impl fmt::Display for Ranks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "k={},v={},h={}", self.k, self.v, self.h)
    }
}

/// A text that is not `k=..,v=..,h=..`.
#[derive(Debug, thiserror::Error)]
#[error("bad ranks {0:?}: expected k=<n>,v=<n>,h=<n>, e.g. k=96,v=192,h=128")]
pub struct ParseRanksError(String);

impl FromStr for Ranks {
    type Err = ParseRanksError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseRanksError(s.to_string());
        let mut r = [None; 3];
        for part in s.split(',') {
            let (name, value) = part.trim().split_once('=').ok_or_else(bad)?;
            let slot = match name.trim() {
                "k" => 0,
                "v" => 1,
                "h" => 2,
                _ => return Err(bad()),
            };
            let n: usize = value.trim().parse().map_err(|_| bad())?;
            if r[slot].replace(n).is_some() {
                return Err(bad());
            }
        }
        match r {
            [Some(k), Some(v), Some(h)] => Ok(Ranks { k, v, h }),
            _ => Err(bad()),
        }
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

    #[test]
    fn ranks_read_back_their_text_and_refuse_anything_else() {
        let r = Ranks {
            k: 96,
            v: 192,
            h: 128,
        };
        assert_eq!(r.to_string(), "k=96,v=192,h=128");
        assert_eq!("k=96,v=192,h=128".parse::<Ranks>().unwrap(), r);
        assert_eq!(" h=128, v=192 ,k=96".parse::<Ranks>().unwrap(), r);
        for bad in [
            "",
            "k=96,v=192",
            "k=96,v=192,h=128,k=1",
            "k=a,v=1,h=1",
            "q=1,v=1,h=1",
        ] {
            assert!(bad.parse::<Ranks>().is_err(), "{bad}");
        }
    }
}
