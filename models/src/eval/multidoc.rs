//! Multi-document QA (M9's evaluation): each SQuAD question's gold paragraph among distractor
//! paragraphs of other articles, in shuffled order, answered with the documents' caches built
//! one of two ways:
//! - full recompute: one plain prefill of the whole prompt (the upper bound);
//! - no recompute: every document compiled alone and stitched at request time
//!   ([`crate::pic`]), only the instruction and the question run with the documents' cache.
//!
//! Both read the same token ids: the chat-formatted prompt is split at the documents, and each
//! piece is tokenised alone. Answers are greedy, their first line scored with SQuAD's F1 and
//! exact match; figures carry bootstrap intervals over questions.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::data::{first_line, sample_questions, QaItem};
use super::EvalError;
use crate::generate::{generate_with_cache, GenerateParams};
use crate::llama::Llama;
use crate::metrics::{squad_exact_match, squad_f1};
use crate::pic::{stitch, CompiledDoc};
use crate::stats::{bootstrap_mean, Estimate};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// The instruction around the documents; `{documents}` marks where they go.
pub const MULTIDOC_TEMPLATE: &str = "Answer the question with a short phrase copied from one of the documents.\n\nDocuments:\n{documents}\nQuestion: {question}";

/// One question with its documents.
#[derive(Debug, Clone)]
pub struct MultiDocItem {
    /// The question and its gold answers (its `context` is the gold paragraph).
    pub qa: QaItem,
    /// The paragraphs in prompt order, the gold one among them.
    pub documents: Vec<String>,
    /// Where the gold paragraph is.
    pub gold: usize,
}

/// `n` seeded questions, each with `distractors` (a range, inclusive) paragraphs of other
/// contexts, shuffled.
pub fn build_items(
    squad: &[QaItem],
    n: usize,
    (fewest, most): (usize, usize),
    seed: u64,
) -> Vec<MultiDocItem> {
    let mut contexts: Vec<&str> = squad.iter().map(|q| q.context.as_str()).collect();
    contexts.sort_unstable();
    contexts.dedup();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x4d44_4f43);
    sample_questions(squad, n, seed)
        .into_iter()
        .map(|qa| {
            let k = rng.gen_range(fewest..=most.max(fewest));
            let mut documents: Vec<String> = contexts
                .iter()
                .filter(|c| **c != qa.context)
                .copied()
                .collect::<Vec<_>>()
                .choose_multiple(&mut rng, k)
                .map(|c| c.to_string())
                .collect();
            documents.push(qa.context.clone());
            documents.shuffle(&mut rng);
            let gold = documents
                .iter()
                .position(|d| *d == qa.context)
                .unwrap_or_default();
            MultiDocItem {
                qa,
                documents,
                gold,
            }
        })
        .collect()
}

/// How the documents' cache is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocMode {
    /// One prefill of the whole prompt.
    FullRecompute,
    /// Each document compiled alone, stitched.
    NoRecompute,
}

impl std::fmt::Display for DocMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::FullRecompute => "full recompute",
            Self::NoRecompute => "no recompute",
        })
    }
}

/// A prompt in pieces: the instruction before the documents, each document, the rest.
#[derive(Debug, Clone)]
pub struct Pieces {
    /// The chat header and instruction.
    pub head: Vec<u32>,
    /// One token run per document.
    pub documents: Vec<Vec<u32>>,
    /// The question and the assistant header.
    pub tail: Vec<u32>,
}

impl Pieces {
    /// All token ids in order.
    pub fn all(&self) -> Vec<u32> {
        let mut t = self.head.clone();
        for d in &self.documents {
            t.extend(d);
        }
        t.extend(&self.tail);
        t
    }
}

/// The chat-formatted prompt of `item`, tokenised piece by piece.
pub fn pieces(tok: &Tokenizer, item: &MultiDocItem) -> Result<Pieces, EvalError> {
    // A private-use character marks the documents' place in the rendered template.
    const MARK: &str = "\u{e000}";
    let user = MULTIDOC_TEMPLATE
        .replace("{documents}", MARK)
        .replace("{question}", &item.qa.question);
    let text = tok.apply_chat_template(&[ChatMessage::user(user)], true)?;
    let Some((head, tail)) = text.split_once(MARK) else {
        return Err(EvalError::Config(
            "the chat template dropped the documents' place".into(),
        ));
    };
    let documents = item
        .documents
        .iter()
        .map(|d| tok.encode(&format!("{d}\n\n"), false))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Pieces {
        head: tok.encode(head, false)?,
        documents,
        tail: tok.encode(tail, false)?,
    })
}

/// `model`'s greedy answer to `pieces` with the documents' cache made as `mode` says.
pub fn answer(
    model: &Llama,
    tok: &Tokenizer,
    pieces: &Pieces,
    mode: DocMode,
    max_tokens: usize,
) -> Result<String, EvalError> {
    let params = GenerateParams {
        max_tokens,
        stop_tokens: tok.stop_ids().to_vec(),
        ..GenerateParams::default()
    };
    let (mut cache, pending) = match mode {
        DocMode::FullRecompute => (model.new_cache(), pieces.all()),
        DocMode::NoRecompute => {
            // The head is first in the prompt, so compiling it alone is exact.
            let compiled = std::iter::once(&pieces.head)
                .chain(&pieces.documents)
                .map(|t| CompiledDoc::compile(model, t))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&CompiledDoc> = compiled.iter().collect();
            (stitch(model, &refs)?, pieces.tail.clone())
        }
    };
    let generation = generate_with_cache(model, &mut cache, &pending, &params, |_| {
        std::ops::ControlFlow::Continue(())
    })?;
    let text = tok.decode(&generation.tokens, true)?;
    Ok(first_line(&text).to_string())
}

/// One mode's figures.
#[derive(Debug, Clone)]
pub struct ModeScore {
    /// The mode.
    pub mode: DocMode,
    /// SQuAD F1 (0-100) with its bootstrap interval.
    pub f1: Estimate,
    /// Exact match (0-100).
    pub em: Estimate,
}

/// Answers every item in every mode; `progress(done, total)` after each item.
pub fn evaluate(
    model: &Llama,
    tok: &Tokenizer,
    items: &[MultiDocItem],
    modes: &[DocMode],
    max_tokens: usize,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<ModeScore>, EvalError> {
    let mut f1 = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut em = vec![Vec::with_capacity(items.len()); modes.len()];
    for (i, item) in items.iter().enumerate() {
        let p = pieces(tok, item)?;
        let golds: Vec<&str> = item.qa.answers.iter().map(String::as_str).collect();
        for (m, &mode) in modes.iter().enumerate() {
            let a = answer(model, tok, &p, mode, max_tokens)?;
            f1[m].push(100.0 * squad_f1(&a, &golds));
            em[m].push(100.0 * squad_exact_match(&a, &golds));
        }
        progress(i + 1, items.len());
    }
    Ok(modes
        .iter()
        .enumerate()
        .map(|(m, &mode)| ModeScore {
            mode,
            f1: bootstrap_mean(&f1[m], seed),
            em: bootstrap_mean(&em[m], seed),
        })
        .collect())
}
