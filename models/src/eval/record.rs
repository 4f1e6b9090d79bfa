//! The record of an evaluation: what ran on what, every metric with its bootstrap 95% interval,
//! payload sizes and stage times; JSON for machines, Markdown for BENCHMARKS.md.

use scd_types::Mode;
use serde::{Deserialize, Serialize};

use super::{EvalConfig, FileInfo};
use crate::llama::Llama;
use crate::stats::Estimate;

/// Mean wall-clock milliseconds per request of each stage of a transfer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MethodTiming {
    /// The producer's prefill with the codec's capture (zero when the codec needs none).
    pub producer_prefill_ms: f64,
    /// Encoding the captures into codes.
    pub encode_ms: f64,
    /// Rebuilding the consumer's cache from the codes (for the oracle: its own prefill).
    pub rebuild_ms: f64,
}

/// Metrics of one method. Each estimate is a mean over independent units (WikiText windows or
/// QA questions) with its bootstrap 95% interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MethodMetrics {
    /// The transfer mode.
    pub method: Mode,
    /// The codec's settings where they distinguish it from others of its mode (a
    /// transform-coded rate); empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub variant: String,
    /// KL(oracle || method) per continuation position, nats.
    pub kl: Estimate,
    /// Total-variation distance per continuation position.
    pub tv: Estimate,
    /// Perplexity of the WikiText-2 continuations.
    pub perplexity: Estimate,
    /// Share of greedy tokens identical to the oracle's.
    pub greedy_agreement: Estimate,
    /// SQuAD F1 (percent).
    pub qa_f1: Estimate,
    /// SQuAD exact match (percent).
    pub qa_exact_match: Estimate,
    /// Share of answer tokens identical to the oracle's answers.
    pub qa_agreement: Estimate,
    /// Continuation positions scored.
    pub positions: usize,
    /// Mean payload bytes per request (the codes' bytes).
    pub payload_bytes: f64,
    /// Payload as a share of the producer's K and V in bf16 for the same prompts.
    pub payload_share_of_raw: f64,
    /// Stage times (wall clock; they differ between identical runs).
    pub timing: MethodTiming,
}

/// A model's identity in a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// File name.
    pub file: String,
    /// Hex SHA-256.
    pub sha256: String,
}

impl ModelInfo {
    /// From a loaded model.
    pub fn of(model: &Llama) -> Self {
        let id = model.identity();
        Self {
            file: id.file_name(),
            sha256: id.sha256.clone(),
        }
    }
}

/// The models of a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelsInfo {
    /// Producer (base).
    pub producer: ModelInfo,
    /// Consumer weights.
    pub consumer: ModelInfo,
    /// The consumer's adapter, if any (file and SHA-256).
    pub consumer_adapter: Option<FileInfo>,
}

/// Data files of a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataInfo {
    /// What the continuation windows come from (records from before the field: WikiText-2).
    #[serde(default = "wikitext_name")]
    pub text_name: String,
    /// WikiText-2 valid (or the text `text_name` names).
    pub wikitext: FileInfo,
    /// SQuAD part.
    pub squad: FileInfo,
    /// Ids of the sampled questions, in evaluation order.
    pub squad_ids: Vec<String>,
}

fn wikitext_name() -> String {
    super::data::WIKITEXT.into()
}

/// One evaluation: what ran on what, and every metric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// scd version.
    pub scd_version: String,
    /// The configuration (template and sample sizes included).
    pub config: EvalConfig,
    /// Models.
    pub models: ModelsInfo,
    /// Data files.
    pub data: DataInfo,
    /// Oracle perplexity on the WikiText-2 continuations (the reference for the methods').
    pub oracle_perplexity: Estimate,
    /// Per method, in the order given.
    pub results: Vec<MethodMetrics>,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl EvalRecord {
    /// The record with every wall-clock figure zeroed: what two runs with the same inputs must
    /// agree on.
    pub fn without_timings(&self) -> Self {
        let mut r = self.clone();
        r.seconds = 0.0;
        for m in &mut r.results {
            m.timing = MethodTiming::default();
        }
        r
    }

    /// The record as a Markdown section: configuration lines, then one row per method.
    pub fn markdown(&self) -> String {
        let c = &self.config;
        let short = |h: &str| h[..h.len().min(12)].to_string();
        let mut s = format!(
            "Producer `{}` ({}), consumer `{}` ({}){}.\n\n",
            self.models.producer.file,
            short(&self.models.producer.sha256),
            self.models.consumer.file,
            short(&self.models.consumer.sha256),
            self.models
                .consumer_adapter
                .as_ref()
                .map(|a| format!(" with adapter `{}` ({})", a.path, short(&a.sha256)))
                .unwrap_or_default()
        );
        let text = &self.data.text_name;
        s.push_str(&format!(
            "{text}: {} windows of {} prompt + {} continuation tokens (greedy agreement over {} tokens); SQuAD: {} answerable questions, greedy answers of up to {} tokens, first line; seed {}. Brackets: bootstrap 95% intervals over windows / questions. Stage times: means per request after one unmeasured warm-up request per method.\n\n",
            c.wikitext_windows, c.prefix_tokens, c.continuation_tokens, c.greedy_tokens,
            self.data.squad_ids.len(), c.answer_tokens, c.seed
        ));
        s.push_str(&format!(
            "QA prompt (user turn of the chat template): `{}`\n\n",
            c.qa_template.replace('\n', "\\n")
        ));
        s.push_str(&format!(
            "Oracle {text} continuation perplexity: {}.\n\n",
            self.oracle_perplexity.display(3)
        ));
        s.push_str(&format!("| method | payload (share of raw bf16) | KL(oracle‖method) | TV | {text} PPL | greedy agreement | SQuAD F1 | SQuAD EM | QA answer agreement | producer prefill / encode / rebuild ms |\n"));
        s.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for r in &self.results {
            s.push_str(&format!(
                "| {}{}{} | {:.1} KB ({:.1}%) | {} | {} | {} | {} | {} | {} | {} | {:.0} / {:.1} / {:.0} |\n",
                r.method,
                if r.variant.is_empty() { "" } else { " " },
                r.variant,
                r.payload_bytes / 1e3,
                100.0 * r.payload_share_of_raw,
                r.kl.display(4),
                r.tv.display(4),
                r.perplexity.display(2),
                r.greedy_agreement.display(3),
                r.qa_f1.display(1),
                r.qa_exact_match.display(1),
                r.qa_agreement.display(3),
                r.timing.producer_prefill_ms,
                r.timing.encode_ms,
                r.timing.rebuild_ms,
            ));
        }
        s
    }
}
