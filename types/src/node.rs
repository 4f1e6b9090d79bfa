//! A node's identity.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The longest id a node may have: a store key segment's limit.
pub const MAX_NODE_ID_LEN: usize = MAX_KEY_SEGMENT_LEN;

/// The longest text a store key segment may be.
pub const MAX_KEY_SEGMENT_LEN: usize = 128;

/// Whether `s` can be one segment of a store key: not empty, at most [`MAX_KEY_SEGMENT_LEN`]
/// bytes, no `/`, no whitespace or control characters. Every id the store keys by (nodes,
/// models, jobs, documents) is held to it.
pub fn is_key_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_KEY_SEGMENT_LEN
        && !s
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control())
}

/// A node's id, as its configuration names it: its key in the store, the name its QUIC
/// certificate is issued to, and how job records name the producer and the consumer of an
/// attempt. One segment of a store key: not empty, at most [`MAX_NODE_ID_LEN`] bytes, no `/`,
/// no whitespace or control characters. A node's configuration narrows it further (a DNS label,
/// for its certificate); ids read from records are held to this rule only, so that a record
/// written by any node stays readable.
///
/// It reads as a `str` (`Deref`, `Borrow`), so maps keyed by it are looked up with a plain
/// `&str`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

/// A string that is not a node id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid node id {0:?}: expected 1-{MAX_NODE_ID_LEN} bytes without '/', whitespace or control characters")]
pub struct InvalidNodeId(pub String);

impl NodeId {
    /// `id`, checked.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidNodeId> {
        let id = id.into();
        if is_key_segment(&id) {
            Ok(Self(id))
        } else {
            Err(InvalidNodeId(id))
        }
    }

    /// An id written in the program (tests, examples).
    ///
    /// # Panics
    /// When `id` is not a node id: a literal that is not one is a bug of the program, as
    /// `http::HeaderName::from_static` treats one.
    pub fn from_static(id: &'static str) -> Self {
        match Self::new(id) {
            Ok(id) => id,
            Err(e) => panic!("{e}"),
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for NodeId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for NodeId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for NodeId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for NodeId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for NodeId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for NodeId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl FromStr for NodeId {
    type Err = InvalidNodeId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for NodeId {
    type Error = InvalidNodeId;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> Self {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_id_is_one_key_segment() {
        for ok in [
            "p1",
            "consumer-a",
            "node_7.eu",
            &"x".repeat(MAX_NODE_ID_LEN),
        ] {
            assert_eq!(NodeId::new(ok).unwrap().as_str(), ok);
        }
        for bad in [
            "",
            "a/b",
            "a b",
            "tab\t",
            "nl\n",
            &"x".repeat(MAX_NODE_ID_LEN + 1),
        ] {
            assert_eq!(
                NodeId::new(bad),
                Err(InvalidNodeId(bad.to_owned())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn records_refuse_an_id_that_is_not_one() {
        let id: NodeId = serde_json::from_str("\"c1\"").unwrap();
        assert_eq!(id, "c1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"c1\"");
        let err = serde_json::from_str::<NodeId>("\"c/1\"").unwrap_err();
        assert!(err.to_string().contains("invalid node id"), "{err}");
    }

    #[test]
    fn maps_keyed_by_node_id_are_read_with_a_str() {
        let mut m = std::collections::BTreeMap::new();
        m.insert(NodeId::from_static("c1"), 1);
        assert_eq!(m.get("c1"), Some(&1));
    }
}
