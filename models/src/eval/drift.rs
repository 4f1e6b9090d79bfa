//! The drift report of an expert: how far it moved from its base on its own domain and on
//! WikiText-2 (perplexities and KL of next-token distributions), and what naive KV transfer
//! from the base costs it (the harness with the oracle, raw, q4 and q2 modes: a node's `auto`
//! sends the base's KV, whole, 4-bit or 2-bit, only to an expert whose report puts it under the
//! quality ceiling).

use serde::{Deserialize, Serialize};

use super::data::seeded_windows;
use super::harness::{evaluate, Pair};
use super::record::EvalRecord;
use super::{EvalConfig, EvalData, EvalError, FileInfo};
use crate::codec::{Kivi, Oracle, Raw};
use crate::corpus::{self, Corpus};
use crate::llama::Llama;
use crate::metrics;
use crate::perplexity::window_logits;
use crate::stats::{bootstrap_mean, bootstrap_ratio, Estimate};
use crate::tokenizer::Tokenizer;

/// Perplexities and divergence of an expert against its base on one text, with bootstrap
/// intervals over windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextDrift {
    /// Which text (`<corpus> valid` or `WikiText-2 valid`).
    pub text: String,
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Base perplexity.
    pub base_perplexity: Estimate,
    /// Expert perplexity.
    pub expert_perplexity: Estimate,
    /// KL(expert || base) of next-token distributions, nats per position.
    pub kl_expert_base: Estimate,
}

/// Scores `windows` (every position after the first) with base and expert.
pub fn text_drift(
    base: &Llama,
    expert: &Llama,
    text: &str,
    windows: &[Vec<u32>],
    seed: u64,
) -> Result<TextDrift, EvalError> {
    let (mut nb, mut ne, mut kl) = (Vec::new(), Vec::new(), Vec::new());
    for w in windows.iter().filter(|w| w.len() >= 2) {
        let rb = window_logits(base, w)?;
        let re = window_logits(expert, w)?;
        let (mut sb, mut se, mut sk) = (0.0, 0.0, 0.0);
        for (i, (b, e)) in rb.iter().zip(&re).enumerate() {
            sb += metrics::nll(b, w[i + 1]);
            se += metrics::nll(e, w[i + 1]);
            sk += metrics::kl_divergence(e, b);
        }
        let n = rb.len() as f64;
        nb.push((sb, n));
        ne.push((se, n));
        kl.push(sk / n);
    }
    if kl.is_empty() {
        return Err(EvalError::Config("no tokens to score".into()));
    }
    Ok(TextDrift {
        text: text.into(),
        windows: windows.len(),
        window_tokens: windows.first().map_or(0, Vec::len),
        base_perplexity: bootstrap_ratio(&nb, seed).map(f64::exp),
        expert_perplexity: bootstrap_ratio(&ne, seed ^ 1).map(f64::exp),
        kl_expert_base: bootstrap_mean(&kl, seed ^ 2),
    })
}

/// The drift of one expert: how far it is from its base, and what the naive transfer costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriftReport {
    /// Expert name (its folder's name).
    pub expert: String,
    /// The expert's own domain (validation split).
    pub domain: TextDrift,
    /// WikiText-2 valid.
    pub wikitext: TextDrift,
    /// The harness with producer = base, consumer = expert, methods oracle and raw.
    pub transfer: EvalRecord,
    /// The same transfer on windows of the expert's own validation split (no QA): the text
    /// such an expert is asked to continue when it serves its domain (absent in reports from
    /// before it was measured).
    #[serde(default)]
    pub domain_transfer: Option<EvalRecord>,
}

/// Where a drift report's data comes from and how much of it to use.
#[derive(Debug, Clone)]
pub struct DriftOptions {
    /// The expert's name for the report.
    pub expert: String,
    /// Its corpus (validation split is scored).
    pub corpus: Corpus,
    /// Windows per text.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Harness configuration for the transfer part (methods oracle, raw, q4 and q2).
    pub eval: EvalConfig,
    /// The adapter file, for the record.
    pub adapter: Option<FileInfo>,
}

/// Builds the drift report of `expert` (the base with the adapter merged) against `base`.
pub fn drift(
    base: &Llama,
    expert: &Llama,
    tok: &Tokenizer,
    data: &EvalData,
    opts: &DriftOptions,
    mut progress: impl FnMut(&str),
) -> Result<DriftReport, EvalError> {
    let seed = opts.eval.seed;
    let dom_tokens = corpus::tokenize_long(tok, &opts.corpus.valid)?;
    let dom_windows = corpus::even_windows(&dom_tokens, opts.window_tokens, opts.windows, "valid")?;
    progress("domain perplexity and KL");
    let domain = text_drift(
        base,
        expert,
        &format!("{} valid", opts.corpus.name),
        &dom_windows,
        seed,
    )?;
    let wiki_tokens = corpus::tokenize_long(tok, &data.text)?;
    let wiki_windows = seeded_windows(
        &wiki_tokens,
        opts.window_tokens,
        opts.windows,
        seed ^ 0x5749_4b49,
    );
    progress("WikiText-2 perplexity and KL");
    let wikitext = text_drift(base, expert, "WikiText-2 valid", &wiki_windows, seed)?;
    let pair = Pair {
        producer: base,
        consumer: expert,
    };
    // Every way of sending the base's own KV that needs no translator, so that `auto` knows
    // each one's quality for this expert: raw, and KIVI's 4 and 2 bits.
    let q2 = Kivi::new(2, crate::codec::kivi::DEFAULT_GROUP)?;
    let raw_kv: [&dyn crate::codec::Codec; 4] = [&Oracle, &Raw, &Kivi::default(), &q2];
    let transfer = evaluate(
        pair,
        &raw_kv,
        tok,
        data,
        &opts.eval,
        opts.adapter.clone(),
        &mut progress,
    )?;
    let own = data.with_text(
        &format!("{} valid", opts.corpus.name),
        &opts.corpus.valid,
        &format!("{} corpus, validation split", opts.corpus.name),
    );
    let domain_transfer = evaluate(
        pair,
        &raw_kv,
        tok,
        &own,
        &EvalConfig {
            squad_questions: 0,
            ..opts.eval.clone()
        },
        opts.adapter.clone(),
        &mut progress,
    )?;
    Ok(DriftReport {
        expert: opts.expert.clone(),
        domain,
        wikitext,
        transfer,
        domain_transfer: Some(domain_transfer),
    })
}

impl DriftReport {
    /// A Markdown section for docs/drift.md.
    pub fn markdown(&self) -> String {
        let mut s = format!("### Expert `{}`\n\n", self.expert);
        s.push_str(
            "| text | windows x tokens | base PPL | expert PPL | change | KL(expert‖base) |\n",
        );
        s.push_str("| --- | ---: | ---: | ---: | ---: | ---: |\n");
        for d in [&self.domain, &self.wikitext] {
            s.push_str(&format!(
                "| {} | {} x {} | {} | {} | {:+.1}% | {} |\n",
                d.text,
                d.windows,
                d.window_tokens,
                d.base_perplexity.display(2),
                d.expert_perplexity.display(2),
                100.0 * (d.expert_perplexity.value / d.base_perplexity.value - 1.0),
                d.kl_expert_base.display(4)
            ));
        }
        s.push_str(
            "\nNaive transfer (the expert decoding on the base's KV, whole and 4-bit) against the oracle:\n\n",
        );
        s.push_str(&self.transfer.markdown());
        if let Some(own) = &self.domain_transfer {
            s.push_str("\nThe same on the expert's own held-out text (no QA):\n\n");
            s.push_str(&own.markdown());
        }
        s
    }
}
