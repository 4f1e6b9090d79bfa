//! What one half of a job reports when it ends: the stages it ran, on the wall clock, and the
//! times and bytes derived from them. The job record, the Prometheus metrics and the trace are
//! all written from one [`JobReport`], so a stage has one name ([`Stage::name`]) everywhere.

use serde::{Deserialize, Serialize};

/// A job's half: the producer (prefill, encode, send) or the consumer (rebuild, decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// The node that prefills the prompt and sends its codes.
    Producer,
    /// The node that rebuilds a cache from the codes and decodes.
    Consumer,
}

impl Side {
    /// The side's name in metrics labels, span names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Side::Producer => "producer",
            Side::Consumer => "consumer",
        }
    }
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A stage on a job's path, in the order a job passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// The base model's prefill of the prompt (producer).
    Prefill,
    /// Serving the compiled caches of the job's documents (producer, SemPIC jobs).
    Documents,
    /// Encoding each layer's capture into codes (producer).
    Encode,
    /// Sending the codes (producer).
    Transfer,
    /// The codes arriving, first layer to last (consumer).
    Arrivals,
    /// Rebuilding a cache from the codes (consumer).
    Rebuild,
    /// From the consumer's start to its first token (consumer).
    FirstToken,
    /// Decoding, from the first token to the last (consumer).
    Decode,
}

impl Stage {
    /// Every stage, in path order.
    pub const ALL: [Stage; 8] = [
        Stage::Prefill,
        Stage::Documents,
        Stage::Encode,
        Stage::Transfer,
        Stage::Arrivals,
        Stage::Rebuild,
        Stage::FirstToken,
        Stage::Decode,
    ];

    /// The stage's one name: the record's `stages` and `timings_ms` key, the metrics' `stage`
    /// label and the trace's span name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Prefill => "prefill",
            Stage::Documents => "documents",
            Stage::Encode => "encode",
            Stage::Transfer => "transfer",
            Stage::Arrivals => "arrivals",
            Stage::Rebuild => "rebuild",
            Stage::FirstToken => "first_token",
            Stage::Decode => "decode",
        }
    }

    /// Whether the stage's duration goes into the record's timings and the stage-time
    /// histogram. Arrivals and decode only place the layers and tokens on the trace: their
    /// length is set by the link and by `max_tokens`, not by this node's speed.
    pub fn is_timed(self) -> bool {
        !matches!(self, Stage::Arrivals | Stage::Decode)
    }

    /// Whether the stage is a span of its own in the record and the trace. The first token is a
    /// point (its time is measured from the consumer's start, and shown as the decode span's
    /// start).
    pub fn is_span(self) -> bool {
        self != Stage::FirstToken
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// When something ran (milliseconds since the Unix epoch).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageSpan {
    /// Start.
    pub start_ms: f64,
    /// End.
    pub end_ms: f64,
}

impl StageSpan {
    /// Its length in milliseconds.
    pub fn ms(&self) -> f64 {
        self.end_ms - self.start_ms
    }
}

/// One layer's codes at a point of a stage (encoded on the producer, arrived on the consumer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerPoint {
    /// The layer.
    pub layer: u16,
    /// Its codes' bytes.
    pub bytes: usize,
    /// When (milliseconds since the Unix epoch).
    pub at_ms: f64,
}

/// One half's report of a job it finished.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// Whose report.
    pub side: Side,
    /// The half from its start to its end.
    pub whole: StageSpan,
    /// The stages it ran, in path order, each at most once.
    pub stages: Vec<(Stage, StageSpan)>,
    /// Per-layer points inside a stage (encode, arrivals), for the trace.
    pub layers: Vec<(Stage, Vec<LayerPoint>)>,
    /// Bytes on the wire: sent by a producer, received by a consumer.
    pub wire_bytes: u64,
    /// Extra timings that are not stages (e.g. a fan-out expert's first token, the job's
    /// submission-to-first-token on the store's clock), by their record key.
    pub extra_ms: Vec<(String, f64)>,
}

impl JobReport {
    /// An empty report of `side`'s half that ran over `whole`.
    pub fn new(side: Side, whole: StageSpan) -> Self {
        Self {
            side,
            whole,
            stages: Vec::new(),
            layers: Vec::new(),
            wire_bytes: 0,
            extra_ms: Vec::new(),
        }
    }

    /// Adds `stage`, if it ran.
    pub fn stage(&mut self, stage: Stage, span: Option<StageSpan>) -> &mut Self {
        if let Some(span) = span {
            self.stages.push((stage, span));
        }
        self
    }

    /// The span of `stage`, if it ran.
    pub fn span(&self, stage: Stage) -> Option<StageSpan> {
        self.stages
            .iter()
            .find(|(s, _)| *s == stage)
            .map(|(_, span)| *span)
    }

    /// The record's timings of this half: each timed stage's length, and the half's total
    /// (`producer_total` / `consumer_total`), in milliseconds.
    pub fn timings_ms(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = self
            .stages
            .iter()
            .filter(|(s, _)| s.is_timed())
            .map(|(s, span)| (s.name().to_string(), span.ms()))
            .collect();
        out.push((format!("{}_total", self.side.name()), self.whole.ms()));
        out.extend(self.extra_ms.iter().cloned());
        out
    }

    /// The stages that are spans of their own in the record and the trace.
    pub fn spans(&self) -> impl Iterator<Item = (Stage, StageSpan)> + '_ {
        self.stages.iter().filter(|(s, _)| s.is_span()).copied()
    }

    /// The layer points inside `stage`.
    pub fn layers_of(&self, stage: Stage) -> &[LayerPoint] {
        self.layers
            .iter()
            .find(|(s, _)| *s == stage)
            .map_or(&[], |(_, l)| l.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start_ms: f64, end_ms: f64) -> StageSpan {
        StageSpan { start_ms, end_ms }
    }

    #[test]
    fn stage_names_are_distinct_and_round_trip_through_all() {
        let names: std::collections::BTreeSet<_> = Stage::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), Stage::ALL.len());
    }

    #[test]
    fn a_producer_report_times_its_timed_stages_and_its_total() {
        let mut r = JobReport::new(Side::Producer, span(0.0, 100.0));
        r.stage(Stage::Prefill, Some(span(0.0, 40.0)))
            .stage(Stage::Documents, None)
            .stage(Stage::Encode, Some(span(10.0, 45.0)))
            .stage(Stage::Transfer, Some(span(12.0, 90.0)));
        let t = r.timings_ms();
        assert_eq!(
            t,
            vec![
                ("prefill".to_string(), 40.0),
                ("encode".to_string(), 35.0),
                ("transfer".to_string(), 78.0),
                ("producer_total".to_string(), 100.0),
            ]
        );
        assert_eq!(r.spans().count(), 3);
        assert_eq!(r.span(Stage::Documents), None);
    }

    #[test]
    fn a_consumer_report_keeps_first_token_as_a_timing_not_a_span() {
        let mut r = JobReport::new(Side::Consumer, span(0.0, 500.0));
        r.stage(Stage::Rebuild, Some(span(5.0, 30.0)))
            .stage(Stage::Arrivals, Some(span(2.0, 28.0)))
            .stage(Stage::FirstToken, Some(span(0.0, 35.0)))
            .stage(Stage::Decode, Some(span(35.0, 500.0)));
        r.extra_ms.push(("ttft".into(), 80.0));
        let t = r.timings_ms();
        assert!(t.contains(&("first_token".into(), 35.0)));
        assert!(t.contains(&("rebuild".into(), 25.0)));
        assert!(t.contains(&("consumer_total".into(), 500.0)));
        assert!(t.contains(&("ttft".into(), 80.0)));
        assert!(!t.iter().any(|(k, _)| k == "decode" || k == "arrivals"));
        let spans: Vec<Stage> = r.spans().map(|(s, _)| s).collect();
        assert_eq!(spans, vec![Stage::Rebuild, Stage::Arrivals, Stage::Decode]);
    }
}
