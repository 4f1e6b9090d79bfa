//! A job's timeline: when each stage started and ended, when each frame arrived and how many
//! bytes each layer took. Plain data, filled from the stages' reports; the scheduler's job
//! record will carry it. Instants are of this process: the in-process pipeline's two nodes
//! share a clock (across machines the stages will report durations and offsets instead).

use std::time::Instant;

use scd_transport::CodeKind;

/// A stage's start and end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// When it started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

/// One code frame as the consumer node received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameArrival {
    /// The layer.
    pub layer: u16,
    /// The code's kind.
    pub kind: CodeKind,
    /// The code's bytes (payload, not frame headers).
    pub bytes: usize,
    /// When it was read off the stream.
    pub at: Instant,
}

/// Code bytes of one layer, as the encoder made them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerBytes {
    /// The layer.
    pub layer: u16,
    /// Bytes of all its codes (payload, not frame headers).
    pub bytes: usize,
    /// When its codes were made.
    pub encoded: Instant,
}

/// Every stage of one job. A stage a mode does not run (the oracle has no producer pass) is
/// `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    /// When the job was submitted.
    pub submitted: Instant,
    /// The producer's prefill, embedding to last layer.
    pub prefill: Option<Span>,
    /// The encoder: first capture taken to last code handed on.
    pub encode: Option<Span>,
    /// The producer node's job stream: opened to finished (the consumer has read it all).
    pub transfer: Option<Span>,
    /// Bytes the job stream carried, frame headers and the Open frame included.
    pub wire_bytes: u64,
    /// Code bytes per layer, in layer order.
    pub layer_bytes: Vec<LayerBytes>,
    /// Every code frame as it reached the consumer node, in order.
    pub arrivals: Vec<FrameArrival>,
    /// The consumer's rebuild: first code pushed (or, without codes, the decoder started) to
    /// the cache finished.
    pub rebuild: Option<Span>,
    /// When the expert produced its first token.
    pub first_token: Option<Instant>,
    /// When the last stage ended.
    pub finished: Instant,
}

impl Timeline {
    /// A timeline with nothing recorded yet.
    pub fn new(submitted: Instant) -> Self {
        Self {
            submitted,
            prefill: None,
            encode: None,
            transfer: None,
            wire_bytes: 0,
            layer_bytes: Vec::new(),
            arrivals: Vec::new(),
            rebuild: None,
            first_token: None,
            finished: submitted,
        }
    }

    /// When the first code frame reached the consumer node.
    pub fn first_arrival(&self) -> Option<Instant> {
        self.arrivals.first().map(|a| a.at)
    }

    /// The payload: all code bytes.
    pub fn payload_bytes(&self) -> usize {
        self.layer_bytes.iter().map(|l| l.bytes).sum()
    }
}
