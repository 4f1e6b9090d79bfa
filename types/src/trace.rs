//! The trace context that travels with a job (W3C `traceparent`, `tracestate`, baggage), so
//! that one job is one trace across the nodes it touches.

use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};
use serde::{Deserialize, Serialize};

/// Entries a context may hold.
pub const MAX_ENTRIES: usize = 8;
/// Bytes of one key.
pub const MAX_KEY_LEN: usize = 64;
/// Bytes of one value (W3C allows `tracestate` up to 512).
pub const MAX_VALUE_LEN: usize = 512;

/// One propagation key and its value.
#[derive(
    Archive, RkyvSerialize, RkyvDeserialize, Clone, Debug, PartialEq, Eq, Serialize, Deserialize,
)]
#[rkyv(derive(Debug))]
pub struct TraceEntry {
    /// The propagation key (`traceparent`, `tracestate`, ...).
    pub key: String,
    /// Its value.
    pub value: String,
}

/// A context that breaks the limits above.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceContextError {
    /// More than [`MAX_ENTRIES`] entries.
    #[error("trace context has {0} entries (at most {MAX_ENTRIES})")]
    TooManyEntries(usize),
    /// A key that is empty, too long or not printable ASCII.
    #[error(
        "trace context key {0:?} is empty, longer than {MAX_KEY_LEN} bytes or not printable ASCII"
    )]
    BadKey(String),
    /// A value that is too long or not printable ASCII.
    #[error("trace context value of {key:?} is longer than {MAX_VALUE_LEN} bytes or not printable ASCII")]
    BadValue {
        /// Its key.
        key: String,
    },
}

/// A trace context: a few validated key/value pairs, as propagators read and write them. The
/// same value goes into frames (rkyv) and job records (JSON).
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
)]
#[rkyv(derive(Debug))]
#[serde(try_from = "Vec<TraceEntry>", into = "Vec<TraceEntry>")]
pub struct TraceContext {
    entries: Vec<TraceEntry>,
}

fn printable(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

fn check_entry(key: &str, value: &str) -> Result<(), TraceContextError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN || !printable(key) {
        return Err(TraceContextError::BadKey(key.chars().take(80).collect()));
    }
    if value.len() > MAX_VALUE_LEN || !printable(value) {
        return Err(TraceContextError::BadValue {
            key: key.to_owned(),
        });
    }
    Ok(())
}

impl TraceContext {
    /// An empty context (no trace).
    pub fn new() -> Self {
        Self::default()
    }

    /// A context that starts a new trace: a W3C `traceparent` with a random trace id and
    /// parent span id, sampled. A client that makes one knows the trace id before the cluster
    /// has seen the job, and every span of the job joins that trace.
    pub fn fresh() -> Self {
        let (trace, span): (u128, u64) = (rand::random(), rand::random());
        // All-zero ids are invalid in W3C trace context.
        let (trace, span) = (trace.max(1), span.max(1));
        let mut cx = Self::new();
        cx.entries.push(TraceEntry {
            key: "traceparent".into(),
            value: format!("00-{trace:032x}-{span:016x}-01"),
        });
        cx
    }

    /// The trace id of its `traceparent`, if it has a well-formed one.
    pub fn trace_id(&self) -> Option<&str> {
        let parent = self.get("traceparent")?;
        let mut parts = parent.split('-');
        let (_, trace) = (parts.next()?, parts.next()?);
        (trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit())).then_some(trace)
    }

    /// Sets `key` to `value`, replacing an earlier value.
    pub fn insert(
        &mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<(), TraceContextError> {
        let (key, value) = (key.into(), value.into());
        check_entry(&key, &value)?;
        let len = self.entries.len();
        match self.entries.iter_mut().find(|e| e.key == key) {
            Some(e) => e.value = value,
            None if len >= MAX_ENTRIES => return Err(TraceContextError::TooManyEntries(len + 1)),
            None => self.entries.push(TraceEntry { key, value }),
        }
        Ok(())
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.as_str())
    }

    /// Every key in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.key.as_str())
    }

    /// The entries in insertion order.
    pub fn entries(&self) -> &[TraceEntry] {
        &self.entries
    }

    /// Whether it carries nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The context an archive holds, checked against the limits (a peer's frame is input).
    pub fn from_archived(a: &ArchivedTraceContext) -> Result<Self, TraceContextError> {
        if a.entries.len() > MAX_ENTRIES {
            return Err(TraceContextError::TooManyEntries(a.entries.len()));
        }
        let mut out = Self::new();
        for e in a.entries.iter() {
            out.insert(e.key.as_str(), e.value.as_str())?;
        }
        Ok(out)
    }
}

impl TryFrom<Vec<TraceEntry>> for TraceContext {
    type Error = TraceContextError;

    fn try_from(entries: Vec<TraceEntry>) -> Result<Self, Self::Error> {
        if entries.len() > MAX_ENTRIES {
            return Err(TraceContextError::TooManyEntries(entries.len()));
        }
        let mut out = Self::new();
        for e in entries {
            out.insert(e.key, e.value)?;
        }
        Ok(out)
    }
}

impl From<TraceContext> for Vec<TraceEntry> {
    fn from(c: TraceContext) -> Self {
        c.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_fresh_context_starts_a_new_trace() {
        let (a, b) = (TraceContext::fresh(), TraceContext::fresh());
        let id = a.trace_id().unwrap();
        assert_eq!(id.len(), 32);
        assert_ne!(Some(id), b.trace_id());
        let parent = a.get("traceparent").unwrap();
        assert!(
            parent.starts_with("00-") && parent.ends_with("-01"),
            "{parent}"
        );
        assert_eq!(TraceContext::new().trace_id(), None);
    }

    #[test]
    fn insert_get_replace_and_limits() {
        let mut c = TraceContext::new();
        c.insert("traceparent", PARENT).unwrap();
        c.insert("traceparent", PARENT).unwrap();
        assert_eq!(c.get("traceparent"), Some(PARENT));
        assert_eq!(c.entries().len(), 1);
        assert!(c.insert("", "x").is_err());
        assert!(c.insert("k", "x".repeat(MAX_VALUE_LEN + 1)).is_err());
        assert!(c.insert("k", "line\nbreak").is_err());
        for i in 1..MAX_ENTRIES {
            c.insert(format!("k{i}"), "v").unwrap();
        }
        assert_eq!(
            c.insert("one-more", "v"),
            Err(TraceContextError::TooManyEntries(MAX_ENTRIES + 1))
        );
    }

    #[test]
    fn json_and_wire_forms_validate() {
        let mut c = TraceContext::new();
        c.insert("traceparent", PARENT).unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<TraceContext>(&json).unwrap(), c);
        let bad = format!(r#"[{{"key":"","value":"{PARENT}"}}]"#);
        assert!(serde_json::from_str::<TraceContext>(&bad).is_err());

        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&c).unwrap();
        let a = rkyv::access::<ArchivedTraceContext, rkyv::rancor::Error>(&bytes).unwrap();
        assert_eq!(TraceContext::from_archived(a).unwrap(), c);
        // A context built around the validation (as a hostile peer would) is refused on read.
        let hostile = TraceContext {
            entries: vec![
                TraceEntry {
                    key: "k".into(),
                    value: "v".into()
                };
                MAX_ENTRIES + 1
            ],
        };
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&hostile).unwrap();
        let a = rkyv::access::<ArchivedTraceContext, rkyv::rancor::Error>(&bytes).unwrap();
        assert!(TraceContext::from_archived(a).is_err());
    }
}
