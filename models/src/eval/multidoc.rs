//! Multi-document QA (SemPIC's evaluation, `docs/method.md` §5.4): each SQuAD question's gold
//! paragraph among distractor paragraphs of other articles, in shuffled order, answered with the
//! documents' caches built one of five ways:
//! - full recompute: a plain prefill of the whole prompt (the upper bound);
//! - no recompute: every document compiled alone and stitched at request time
//!   ([`crate::sempic`]), only the instruction and the question run with the documents' cache;
//! - SemPIC: the same, the documents compiled by a writer (the base with its LoRA, trained by
//!   [`crate::train::writer`]);
//! - packet: no recompute with each document compiled between KV-Packet's trained boundary
//!   tokens ([`crate::boundary`]);
//! - joint: SemPIC's writer compiling between boundary tokens trained for it.
//!
//! Besides the answers, each stitched mode's KL to full recompute over the teacher-forced
//! question and gold answer, and how far its documents' keys and values lie from full
//! recompute's at document boundaries and inside ([`kv_deviation`]).
//!
//! Both read the same token ids: the chat-formatted prompt is split at the documents, and each
//! piece is tokenised alone. Answers are greedy, their first line scored with SQuAD's F1 and
//! exact match; figures carry bootstrap intervals over questions.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::data::{first_line, sample_questions, QaItem};
use super::EvalError;
use crate::boundary::Boundary;
use crate::generate::{generate_with_cache, GenerateParams};
use crate::llama::Llama;
use crate::metrics::{squad_contains, squad_exact_match, squad_f1};
use crate::rope::Rope;
use crate::sempic::{stitch_after_head, CompiledDoc};
use crate::stats::{bootstrap_mean, bootstrap_ratio, Estimate};
use crate::tokenizer::{ChatMessage, Tokenizer};
use crate::train::sempic::{kl_to_teacher, tail_logits};
use crate::{Input, KvCache, LogitsWanted};
use candle_core::{Tensor, D};

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

/// Articles at the end of the SQuAD file that train the SemPIC writer (`scd sempic train`);
/// the evaluation never draws a question or a distractor from them.
pub const WRITER_ARTICLES: usize = 4;

/// The questions of the last [`WRITER_ARTICLES`] articles (the writer's training data) and
/// those of the others (the evaluation's), in file order.
pub fn writer_split(squad: &[QaItem]) -> (Vec<QaItem>, Vec<QaItem>) {
    let articles = squad.iter().map(|q| q.article + 1).max().unwrap_or(0);
    let first = articles.saturating_sub(WRITER_ARTICLES);
    squad.iter().cloned().partition(|q| q.article >= first)
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
    /// Each document compiled alone by a SemPIC writer (the base with its LoRA), stitched and
    /// read by the base.
    SemPic,
    /// Each document compiled alone by the base between KV-Packet boundary tokens.
    Packet,
    /// Each document compiled alone by the SemPIC writer between boundary tokens trained for
    /// it.
    Joint,
}

impl std::fmt::Display for DocMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::FullRecompute => "full recompute",
            Self::NoRecompute => "no recompute",
            Self::SemPic => "SemPIC",
            Self::Packet => "packet",
            Self::Joint => "joint (SemPIC + packet)",
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

/// The tokens of `item`'s first gold answer and the end of the turn: what a writer's training
/// and the evaluation's KL teacher-force after the question.
pub fn gold_answer(tok: &Tokenizer, item: &MultiDocItem) -> Result<Vec<u32>, EvalError> {
    let first = item.qa.answers.first().map_or("", String::as_str);
    let mut tokens = tok.encode(first, false)?;
    tokens.extend(tok.stop_ids().first());
    Ok(tokens)
}

/// What compiles the documents of the modes beyond the model's own plain stitching.
#[derive(Debug, Clone, Copy, Default)]
pub struct DocCompilers<'a> {
    /// SemPIC's writer: the model with the writer adapter merged.
    pub writer: Option<&'a Llama>,
    /// Boundary tokens trained for the model (the packet mode).
    pub packet: Option<&'a Boundary>,
    /// Boundary tokens trained for the writer (the joint mode).
    pub joint: Option<&'a Boundary>,
}

impl<'a> DocCompilers<'a> {
    /// The model that compiles the documents in `mode` and the boundary tokens it compiles
    /// between: none for full recompute, `model` itself without recompute.
    fn of(
        &self,
        model: &'a Llama,
        mode: DocMode,
    ) -> Result<Option<(&'a Llama, Option<&'a Boundary>)>, EvalError> {
        let need = |what: &str| EvalError::Config(format!("the {mode} mode needs {what}"));
        Ok(match mode {
            DocMode::FullRecompute => None,
            DocMode::NoRecompute => Some((model, None)),
            DocMode::SemPic => Some((self.writer.ok_or_else(|| need("a writer adapter"))?, None)),
            DocMode::Packet => Some((
                model,
                Some(self.packet.ok_or_else(|| need("boundary tokens"))?),
            )),
            DocMode::Joint => Some((
                self.writer.ok_or_else(|| need("a writer adapter"))?,
                Some(
                    self.joint
                        .ok_or_else(|| need("boundary tokens for the writer"))?,
                ),
            )),
        })
    }
}

/// The cache of everything before the question with the documents made as `mode` says; the
/// question and the answer then run on top of it.
pub fn documents_cache(
    model: &Llama,
    compilers: &DocCompilers<'_>,
    pieces: &Pieces,
    mode: DocMode,
) -> Result<KvCache, EvalError> {
    match compilers.of(model, mode)? {
        None => {
            let mut cache = model.new_cache();
            let mut prefix = pieces.head.clone();
            pieces.documents.iter().for_each(|d| prefix.extend(d));
            model.forward(
                Input::new(&prefix)
                    .with_cache(&mut cache)
                    .logits(LogitsWanted::None),
            )?;
            Ok(cache)
        }
        Some((writer, boundary)) => {
            let docs = pieces
                .documents
                .iter()
                .map(|t| CompiledDoc::compile_with(writer, t, boundary))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(stitch_after_head(model, &pieces.head, &docs)?)
        }
    }
}

/// `model`'s greedy answer to the question in `tail` over `cache` (consumed), first line.
fn reply(
    model: &Llama,
    tok: &Tokenizer,
    mut cache: KvCache,
    tail: &[u32],
    max_tokens: usize,
) -> Result<String, EvalError> {
    let params = GenerateParams {
        max_tokens,
        stop_tokens: tok.stop_ids().to_vec(),
        ..GenerateParams::default()
    };
    let generation = generate_with_cache(model, &mut cache, tail, &params, |_| {
        std::ops::ControlFlow::Continue(())
    })?;
    let text = tok.decode(&generation.tokens, true)?;
    Ok(first_line(&text).to_string())
}

/// `model`'s greedy answer to `pieces` with the documents' cache made as `mode` says.
pub fn answer(
    model: &Llama,
    compilers: &DocCompilers<'_>,
    tok: &Tokenizer,
    pieces: &Pieces,
    mode: DocMode,
    max_tokens: usize,
) -> Result<String, EvalError> {
    let cache = documents_cache(model, compilers, pieces, mode)?;
    reply(model, tok, cache, &pieces.tail, max_tokens)
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
    /// Replies that hold a gold answer whole ([`squad_contains`], 0-100).
    pub contains: Estimate,
    /// KL to full recompute (nats per position) at the question's and the gold answer's
    /// positions, teacher-forced; `None` for full recompute itself.
    pub kl: Option<Estimate>,
    /// How far the documents' keys and values lie from full recompute's, at each document's
    /// first [`BOUNDARY_TOKENS`] tokens and at the rest ([`kv_deviation`]); `None` for full
    /// recompute itself.
    pub kv_deviation: Option<[Estimate; 2]>,
    /// The share of the F1 gap between no recompute and full recompute that this mode closes,
    /// `sum(mode - none) / sum(full - none)` over questions, with a paired bootstrap interval
    /// (questions resampled together in all three modes): `None` for those two modes and when
    /// the run lacks either.
    pub gap_recovered: Option<Estimate>,
    /// Each question's F1, in the items' order: what pairs this run with another on the same
    /// questions (a new writer against stored full and no recompute rows).
    pub f1_per_question: Vec<f64>,
}

/// Tokens at the start of a document counted as its boundary in [`kv_deviation`].
pub const BOUNDARY_TOKENS: usize = 8;

/// The mean relative distance `|x - x_full| / |x_full|` of `cache`'s keys and values (one
/// row per token, both concatenated, averaged over layers) from `full`'s, over the documents'
/// tokens of `pieces`: at each document's first [`BOUNDARY_TOKENS`] tokens and at the rest.
/// Our stand-in for the paper's attention deviation near block boundaries and inside blocks: it
/// measures what a compiled cache stores, where the missing cross-document attention shows.
///
/// `boundary` gives the header and trailer tokens around each document in `cache` (0, 0 for
/// none): a document's tokens then sit later than in `full`, and `full`'s keys are rotated on
/// to the same positions (`rope`) before the comparison, so that only what the keys hold
/// differs, not where they sit.
pub fn kv_deviation(
    rope: &Rope,
    full: &KvCache,
    cache: &KvCache,
    pieces: &Pieces,
    (header, trailer): (usize, usize),
) -> Result<(f64, f64), EvalError> {
    let docs = pieces.documents.len();
    let expected = full.len() + docs * (header + trailer);
    if cache.len() != expected {
        return Err(EvalError::Config(format!(
            "a cache of {} tokens compared with {expected}",
            cache.len()
        )));
    }
    // Per document: its rows in `full`, its rows in `cache`, its length.
    let mut spans = Vec::with_capacity(docs);
    let (mut at_full, mut at_cache) = (pieces.head.len(), pieces.head.len());
    for d in &pieces.documents {
        spans.push((at_full, at_cache + header, d.len()));
        at_full += d.len();
        at_cache += header + d.len() + trailer;
    }
    let rows: usize = spans.iter().map(|s| s.2).sum();
    let layers = full.num_layers();
    let mut per_token = vec![0f64; rows];
    for l in 0..layers {
        let (Some((kf, vf)), Some((kc, vc))) = (full.layer(l)?, cache.layer(l)?) else {
            return Err(EvalError::Config(format!("layer {l} missing from a cache")));
        };
        let (mut f, mut c) = (Vec::with_capacity(docs), Vec::with_capacity(docs));
        for &(from_full, from_cache, len) in &spans {
            let mut k = kf.narrow(0, from_full, len)?;
            let shift = (from_cache - from_full) as u32;
            if shift > 0 {
                k = rope.apply(&k, &vec![shift; len])?;
            }
            f.push(Tensor::cat(&[k, vf.narrow(0, from_full, len)?], 1)?);
            c.push(Tensor::cat(
                &[
                    kc.narrow(0, from_cache, len)?,
                    vc.narrow(0, from_cache, len)?,
                ],
                1,
            )?);
        }
        let (f, c) = (Tensor::cat(&f, 0)?, Tensor::cat(&c, 0)?);
        let dist = (c - &f)?.sqr()?.sum(1)?.sqrt()?;
        let norm = f.sqr()?.sum(1)?.sqrt()?.clamp(1e-12, f32::MAX)?;
        for (acc, r) in per_token.iter_mut().zip((dist / norm)?.to_vec1::<f32>()?) {
            *acc += f64::from(r) / layers as f64;
        }
    }
    let (mut edge, mut inside) = (Vec::new(), Vec::new());
    let mut at = 0;
    for &(_, _, len) in &spans {
        for (i, &r) in per_token[at..at + len].iter().enumerate() {
            if i < BOUNDARY_TOKENS {
                edge.push(r);
            } else {
                inside.push(r);
            }
        }
        at += len;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok((mean(&edge), mean(&inside)))
}

/// The share of the gap from `none` to `full` that `mode` closes, per-question scores in the
/// same order: `sum(mode - none) / sum(full - none)`, with a bootstrap interval that resamples
/// questions in all three together (paired: the per-question noise common to the modes, what
/// makes each mode's own interval wide, cancels).
pub fn gap_share(mode: &[f64], none: &[f64], full: &[f64], seed: u64) -> Estimate {
    let units: Vec<(f64, f64)> = mode
        .iter()
        .zip(none)
        .zip(full)
        .map(|((m, n), f)| (m - n, f - n))
        .collect();
    bootstrap_ratio(&units, seed)
}

/// Answers every item in every mode; `progress(done, total)` after each item.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &Llama,
    compilers: &DocCompilers<'_>,
    tok: &Tokenizer,
    items: &[MultiDocItem],
    modes: &[DocMode],
    max_tokens: usize,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<ModeScore>, EvalError> {
    let mut f1 = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut em = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut contains = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut kl = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut edge = vec![Vec::with_capacity(items.len()); modes.len()];
    let mut inside = vec![Vec::with_capacity(items.len()); modes.len()];
    for (i, item) in items.iter().enumerate() {
        let p = pieces(tok, item)?;
        let golds: Vec<&str> = item.qa.answers.iter().map(String::as_str).collect();
        // The teacher-forced question and gold answer, read over each mode's cache.
        let mut forced = p.tail.clone();
        forced.extend(gold_answer(tok, item)?);
        let full = documents_cache(model, compilers, &p, DocMode::FullRecompute)?;
        let teacher = candle_nn::ops::log_softmax(
            &tail_logits(model, &mut full.try_clone()?, &forced)?,
            D::Minus1,
        )?;
        for (m, &mode) in modes.iter().enumerate() {
            let cache = match mode {
                DocMode::FullRecompute => full.try_clone()?,
                _ => documents_cache(model, compilers, &p, mode)?,
            };
            if let Some((_, boundary)) = compilers.of(model, mode)? {
                let counts = boundary.map_or((0, 0), Boundary::counts);
                let (e, i) = kv_deviation(model.rope(), &full, &cache, &p, counts)?;
                edge[m].push(e);
                inside[m].push(i);
                let logits = tail_logits(model, &mut cache.try_clone()?, &forced)?;
                kl[m].push(f64::from(
                    kl_to_teacher(&teacher, &logits)?.to_scalar::<f32>()?,
                ));
            }
            let a = reply(model, tok, cache, &p.tail, max_tokens)?;
            f1[m].push(100.0 * squad_f1(&a, &golds));
            em[m].push(100.0 * squad_exact_match(&a, &golds));
            contains[m].push(100.0 * squad_contains(&a, &golds));
        }
        progress(i + 1, items.len());
    }
    let at = |wanted: DocMode| modes.iter().position(|&m| m == wanted);
    let ends = at(DocMode::FullRecompute).zip(at(DocMode::NoRecompute));
    let gap_recovered = |m: usize, mode: DocMode| {
        let (full, none) = ends?;
        if matches!(mode, DocMode::FullRecompute | DocMode::NoRecompute) {
            return None;
        }
        Some(gap_share(&f1[m], &f1[none], &f1[full], seed))
    };
    Ok(modes
        .iter()
        .enumerate()
        .map(|(m, &mode)| ModeScore {
            gap_recovered: gap_recovered(m, mode),
            f1_per_question: f1[m].clone(),
            mode,
            f1: bootstrap_mean(&f1[m], seed),
            em: bootstrap_mean(&em[m], seed),
            contains: bootstrap_mean(&contains[m], seed),
            kl: (!kl[m].is_empty()).then(|| bootstrap_mean(&kl[m], seed)),
            kv_deviation: (!edge[m].is_empty()).then(|| {
                [
                    bootstrap_mean(&edge[m], seed),
                    bootstrap_mean(&inside[m], seed),
                ]
            }),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::gap_share;

    #[test]
    fn the_gap_share_is_paired_over_questions() {
        // Per-question scores that vary a lot between questions, alike in every mode.
        let none: Vec<f64> = (0..200).map(|i| f64::from((i * 37) % 100)).collect();
        let full: Vec<f64> = none.iter().map(|x| x + 4.0).collect();
        let half: Vec<f64> = none.iter().map(|x| x + 2.0).collect();
        assert_eq!(gap_share(&full, &none, &full, 0).value, 1.0);
        assert_eq!(gap_share(&none, &none, &full, 0).value, 0.0);
        let h = gap_share(&half, &none, &full, 0);
        assert_eq!(h.value, 0.5);
        // Paired, the questions' spread cancels: the interval is the point.
        assert!(h.high - h.low < 1e-12, "{h:?}");
        // Where the mode's gain varies by question, the interval widens around the share.
        let noisy: Vec<f64> = none
            .iter()
            .enumerate()
            .map(|(i, x)| x + if i % 2 == 0 { 0.0 } else { 4.0 })
            .collect();
        let n = gap_share(&noisy, &none, &full, 0);
        assert_eq!(n.value, 0.5);
        assert!(n.low < 0.5 && n.high > 0.5 && n.high - n.low < 0.4, "{n:?}");
    }
}
