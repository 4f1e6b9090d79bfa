//! The quality harness every SCD method reports through: build the consumer's cache for a
//! prompt with a [`CacheMethod`], let the consumer continue from it, and compare with the
//! oracle (the consumer's own prefill) on the same prompts and the same continuation tokens.
//!
//! Read top-down: cache methods, the configuration, the three tasks (WikiText-2 windows scored
//! teacher-forced for KL / TV / perplexity and greedily for agreement; SQuAD extractive QA),
//! the record (JSON + Markdown), and the drift report of an expert against its base.
//!
//! Every method sees the prompt's first `T - 1` tokens through its cache; the consumer then runs
//! its own forward pass from the prompt's last token on. So the methods differ only in the
//! cache, and the continuation tokens, positions and decoding are identical.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::cache::KvCache;
use crate::corpus::{self, CorpusError};
use crate::error::{ForwardError, GenerateError};
use crate::generate::{generate_with_cache, GenerateParams};
use crate::llama::{Input, Llama, LogitsWanted};
use crate::metrics;
use crate::sampling::Sampling;
use crate::tokenizer::{ChatMessage, Tokenizer, TokenizerError};

/// Errors of an evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// Tokenising failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A data file is missing or malformed.
    #[error(transparent)]
    Data(#[from] CorpusError),
    /// A method name nobody implements.
    #[error("unknown cache method {0:?} (known: oracle, raw)")]
    UnknownMethod(String),
    /// A configuration that cannot run.
    #[error("invalid evaluation configuration: {0}")]
    Config(String),
}

/// The two models of a transfer: the producer prefilled the prompt, the consumer continues.
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    /// The model whose KV is shipped (the base).
    pub producer: &'a Llama,
    /// The model that decodes (an expert).
    pub consumer: &'a Llama,
}

/// A way of building the consumer's cache for a prompt prefix. Adding an SCD mode is one new
/// implementation of this trait.
pub trait CacheMethod: Send + Sync {
    /// Short name used in records and on the command line.
    fn name(&self) -> &str;

    /// The consumer's cache holding `prefix` (the prompt without its last token) at positions
    /// `0..prefix.len()`.
    fn build(&self, pair: Pair<'_>, prefix: &[u32]) -> Result<KvCache, EvalError>;
}

/// The consumer's own prefill: the reference every method is compared with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

/// The producer's cache handed to the consumer unchanged (the naive transfer).
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

fn prefill(model: &Llama, prefix: &[u32]) -> Result<KvCache, EvalError> {
    let mut cache = model.new_cache();
    if !prefix.is_empty() {
        model.forward(
            Input::new(prefix)
                .with_cache(&mut cache)
                .logits(LogitsWanted::None),
        )?;
    }
    Ok(cache)
}

impl CacheMethod for Oracle {
    fn name(&self) -> &str {
        "oracle"
    }

    fn build(&self, pair: Pair<'_>, prefix: &[u32]) -> Result<KvCache, EvalError> {
        prefill(pair.consumer, prefix)
    }
}

impl CacheMethod for Raw {
    fn name(&self) -> &str {
        "raw"
    }

    fn build(&self, pair: Pair<'_>, prefix: &[u32]) -> Result<KvCache, EvalError> {
        prefill(pair.producer, prefix)
    }
}

/// The method called `name`.
pub fn method_by_name(name: &str) -> Result<Box<dyn CacheMethod>, EvalError> {
    match name {
        "oracle" => Ok(Box::new(Oracle)),
        "raw" => Ok(Box::new(Raw)),
        other => Err(EvalError::UnknownMethod(other.into())),
    }
}

/// The prompt template of the QA task; `{context}` and `{question}` are replaced, and the result
/// is the user turn of the model's chat template (with the generation prompt).
pub const QA_TEMPLATE: &str = "Answer the question with a short phrase copied from the context.\n\nContext: {context}\n\nQuestion: {question}";

/// What to evaluate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalConfig {
    /// Method names, in output order.
    pub methods: Vec<String>,
    /// Seed of window starts and of the QA sample.
    pub seed: u64,
    /// WikiText-2 windows.
    pub wikitext_windows: usize,
    /// Prompt tokens per window (the method builds the cache for all but the last).
    pub prefix_tokens: usize,
    /// Continuation tokens per window, scored teacher-forced.
    pub continuation_tokens: usize,
    /// Greedy tokens compared with the oracle's greedy continuation, per window.
    pub greedy_tokens: usize,
    /// SQuAD answerable questions.
    pub squad_questions: usize,
    /// Greedy answer budget.
    pub answer_tokens: usize,
    /// The QA prompt template.
    pub qa_template: String,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            methods: vec!["oracle".into(), "raw".into()],
            seed: 0,
            wikitext_windows: 8,
            prefix_tokens: 256,
            continuation_tokens: 64,
            greedy_tokens: 32,
            squad_questions: 50,
            answer_tokens: 32,
            qa_template: QA_TEMPLATE.into(),
        }
    }
}

/// Texts the harness reads, with their hashes.
#[derive(Debug, Clone)]
pub struct EvalData {
    /// WikiText-2 validation text.
    pub wikitext: String,
    /// Where it came from and its SHA-256.
    pub wikitext_file: FileInfo,
    /// SQuAD answerable questions, in file order.
    pub squad: Vec<QaItem>,
    /// Where SQuAD came from and its SHA-256.
    pub squad_file: FileInfo,
}

/// A file and its content hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Path as read.
    pub path: String,
    /// Hex SHA-256.
    pub sha256: String,
}

/// One extractive-QA item.
#[derive(Debug, Clone, PartialEq)]
pub struct QaItem {
    /// SQuAD id.
    pub id: String,
    /// The paragraph.
    pub context: String,
    /// The question.
    pub question: String,
    /// Gold answers (answerable questions have at least one).
    pub answers: Vec<String>,
}

#[derive(Deserialize)]
struct SquadFile {
    data: Vec<SquadArticle>,
}
#[derive(Deserialize)]
struct SquadArticle {
    paragraphs: Vec<SquadParagraph>,
}
#[derive(Deserialize)]
struct SquadParagraph {
    context: String,
    qas: Vec<SquadQa>,
}
#[derive(Deserialize)]
struct SquadQa {
    id: String,
    question: String,
    answers: Vec<SquadAnswer>,
    #[serde(default)]
    is_impossible: bool,
}
#[derive(Deserialize)]
struct SquadAnswer {
    text: String,
}

/// Answerable questions of a SQuAD 2.0 JSON file.
pub fn parse_squad(bytes: &[u8], path: &Path) -> Result<Vec<QaItem>, EvalError> {
    let f: SquadFile = serde_json::from_slice(bytes).map_err(|e| CorpusError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    for a in f.data {
        for p in a.paragraphs {
            for q in p.qas {
                if q.is_impossible || q.answers.is_empty() {
                    continue;
                }
                out.push(QaItem {
                    id: q.id,
                    context: p.context.clone(),
                    question: q.question,
                    answers: q.answers.into_iter().map(|a| a.text).collect(),
                });
            }
        }
    }
    Ok(out)
}

impl EvalData {
    /// Reads WikiText-2 valid and the SQuAD part from [`corpus::shared_data_dir`].
    pub fn load_shared() -> Result<Self, EvalError> {
        let wpath = corpus::wikitext2_valid_path();
        let spath = corpus::squad_path();
        let wikitext = corpus::read_text(&wpath)?;
        let sbytes = std::fs::read(&spath).map_err(|source| CorpusError::Io {
            path: spath.clone(),
            source,
        })?;
        Ok(Self {
            wikitext_file: FileInfo {
                path: wpath.display().to_string(),
                sha256: corpus::sha256_hex(wikitext.as_bytes()),
            },
            wikitext,
            squad: parse_squad(&sbytes, &spath)?,
            squad_file: FileInfo {
                path: spath.display().to_string(),
                sha256: corpus::sha256_hex(&sbytes),
            },
        })
    }
}

/// Windows of `len` tokens at seeded random starts.
pub fn seeded_windows(tokens: &[u32], len: usize, n: usize, seed: u64) -> Vec<Vec<u32>> {
    if tokens.len() < len {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let s = rng.gen_range(0..=tokens.len() - len);
            tokens[s..s + len].to_vec()
        })
        .collect()
}

/// Rows of a `(T, vocab)` logits tensor as host vectors.
fn rows(t: &Tensor) -> Result<Vec<Vec<f32>>, EvalError> {
    Ok(t.to_vec2::<f32>()?)
}

/// Teacher-forced logits of the consumer over `continuation` after a method's cache for
/// `prompt[..T-1]`: row `i` predicts `continuation[i]`.
fn continuation_logits(
    consumer: &Llama,
    mut cache: KvCache,
    last_prompt_token: u32,
    continuation: &[u32],
) -> Result<Vec<Vec<f32>>, EvalError> {
    let mut input = vec![last_prompt_token];
    input.extend_from_slice(&continuation[..continuation.len().saturating_sub(1)]);
    let out = consumer.forward(
        Input::new(&input)
            .with_cache(&mut cache)
            .logits(LogitsWanted::All),
    )?;
    let logits = out
        .logits
        .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()))?;
    rows(&logits)
}

fn greedy(
    consumer: &Llama,
    mut cache: KvCache,
    last_prompt_token: u32,
    max_tokens: usize,
    stop_tokens: &[u32],
) -> Result<Vec<u32>, EvalError> {
    let params = GenerateParams {
        max_tokens,
        sampling: Sampling::Greedy,
        seed: 0,
        stop_tokens: stop_tokens.to_vec(),
    };
    let g = generate_with_cache(consumer, &mut cache, &[last_prompt_token], &params, |_| {
        std::ops::ControlFlow::Continue(())
    })?;
    Ok(g.tokens)
}

/// Metrics of one method.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MethodMetrics {
    /// Method name.
    pub method: String,
    /// Mean KL(oracle || method) over continuation positions, nats.
    pub kl: f64,
    /// Mean total-variation distance over continuation positions.
    pub tv: f64,
    /// Perplexity of the WikiText-2 continuations.
    pub perplexity: f64,
    /// Share of greedy tokens identical to the oracle's, over windows and positions.
    pub greedy_agreement: f64,
    /// SQuAD F1 (percent).
    pub qa_f1: f64,
    /// SQuAD exact match (percent).
    pub qa_exact_match: f64,
    /// Share of answer tokens identical to the oracle's answers.
    pub qa_agreement: f64,
    /// Continuation positions scored.
    pub positions: usize,
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
            file: id
                .source
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
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
    pub oracle_perplexity: f64,
    /// Per method, in the configured order.
    pub results: Vec<MethodMetrics>,
    /// Wall time, seconds (the only field that differs between identical runs).
    pub seconds: f64,
}

/// Data files of a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataInfo {
    /// WikiText-2 valid.
    pub wikitext: FileInfo,
    /// SQuAD part.
    pub squad: FileInfo,
    /// Ids of the sampled questions, in evaluation order.
    pub squad_ids: Vec<String>,
}

#[derive(Default)]
struct Acc {
    kl: f64,
    tv: f64,
    nll: f64,
    positions: usize,
    greedy_same: f64,
    greedy_windows: usize,
    f1: f64,
    em: f64,
    qa_agree: f64,
    questions: usize,
}

/// The QA sample: answerable questions shuffled by `seed`, first `n`.
pub fn sample_questions(items: &[QaItem], n: usize, seed: u64) -> Vec<QaItem> {
    let mut idx: Vec<usize> = (0..items.len()).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5155_4144);
    idx.shuffle(&mut rng);
    idx.into_iter().take(n).map(|i| items[i].clone()).collect()
}

/// The chat-formatted prompt of a QA item.
pub fn qa_prompt(tok: &Tokenizer, template: &str, item: &QaItem) -> Result<Vec<u32>, EvalError> {
    let user = template
        .replace("{context}", &item.context)
        .replace("{question}", &item.question);
    let text = tok.apply_chat_template(&[ChatMessage::user(user)], true)?;
    Ok(tok.encode(&text, false)?)
}

/// The answer in a generated text: its first non-empty line, trimmed.
pub fn first_line(text: &str) -> &str {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}

/// Runs the harness: every configured method against the oracle on the same WikiText-2 windows
/// and SQuAD questions. `consumer_adapter` only labels the record. `progress` receives short
/// lines as items finish.
pub fn evaluate(
    pair: Pair<'_>,
    tok: &Tokenizer,
    data: &EvalData,
    cfg: &EvalConfig,
    consumer_adapter: Option<FileInfo>,
    mut progress: impl FnMut(&str),
) -> Result<EvalRecord, EvalError> {
    let t0 = Instant::now();
    let methods = cfg
        .methods
        .iter()
        .map(|m| method_by_name(m))
        .collect::<Result<Vec<_>, _>>()?;
    if methods.is_empty() || cfg.prefix_tokens < 2 || cfg.continuation_tokens == 0 {
        return Err(EvalError::Config(
            "need at least one method, a prefix of 2+ tokens and a continuation".into(),
        ));
    }
    let mut accs: Vec<Acc> = methods.iter().map(|_| Acc::default()).collect();
    let mut oracle_nll = 0.0;
    let mut oracle_positions = 0usize;

    if cfg.wikitext_windows > 0 {
        let tokens = corpus::tokenize_long(tok, &data.wikitext)?;
        let len = cfg.prefix_tokens + cfg.continuation_tokens;
        let windows = seeded_windows(&tokens, len, cfg.wikitext_windows, cfg.seed);
        for (wi, w) in windows.iter().enumerate() {
            let (prompt, cont) = w.split_at(cfg.prefix_tokens);
            let prefix = &prompt[..prompt.len() - 1];
            let last = prompt[prompt.len() - 1];
            let oracle_cache = Oracle.build(pair, prefix)?;
            let oracle_logits =
                continuation_logits(pair.consumer, oracle_cache.try_clone()?, last, cont)?;
            let oracle_greedy = greedy(pair.consumer, oracle_cache, last, cfg.greedy_tokens, &[])?;
            for (i, row) in oracle_logits.iter().enumerate() {
                oracle_nll += metrics::nll(row, cont[i]);
            }
            oracle_positions += cont.len();
            for (m, acc) in methods.iter().zip(accs.iter_mut()) {
                // The oracle method recomputes exactly what the reference is: reuse it.
                let (logits, g) = if m.name() == Oracle.name() {
                    (oracle_logits.clone(), oracle_greedy.clone())
                } else {
                    let cache = m.build(pair, prefix)?;
                    let logits =
                        continuation_logits(pair.consumer, cache.try_clone()?, last, cont)?;
                    let g = greedy(pair.consumer, cache, last, cfg.greedy_tokens, &[])?;
                    (logits, g)
                };
                for (i, (p, q)) in oracle_logits.iter().zip(&logits).enumerate() {
                    let (kl, tv) = metrics::distances(p, q);
                    acc.kl += kl;
                    acc.tv += tv;
                    acc.nll += metrics::nll(q, cont[i]);
                }
                acc.positions += cont.len();
                acc.greedy_same += metrics::agreement(&oracle_greedy, &g);
                acc.greedy_windows += 1;
            }
            progress(&format!("wikitext window {}/{}", wi + 1, windows.len()));
        }
    }

    let questions = sample_questions(&data.squad, cfg.squad_questions, cfg.seed);
    for (qi, item) in questions.iter().enumerate() {
        let prompt = qa_prompt(tok, &cfg.qa_template, item)?;
        let (prefix, last) = (&prompt[..prompt.len() - 1], prompt[prompt.len() - 1]);
        let golds: Vec<&str> = item.answers.iter().map(String::as_str).collect();
        let oracle_answer = greedy(
            pair.consumer,
            Oracle.build(pair, prefix)?,
            last,
            cfg.answer_tokens,
            tok.stop_ids(),
        )?;
        for (m, acc) in methods.iter().zip(accs.iter_mut()) {
            let answer = if m.name() == Oracle.name() {
                oracle_answer.clone()
            } else {
                greedy(
                    pair.consumer,
                    m.build(pair, prefix)?,
                    last,
                    cfg.answer_tokens,
                    tok.stop_ids(),
                )?
            };
            let text = tok.decode(&answer, true)?;
            let pred = first_line(&text);
            acc.f1 += metrics::squad_f1(pred, &golds);
            acc.em += metrics::squad_exact_match(pred, &golds);
            acc.qa_agree += metrics::agreement(&oracle_answer, &answer);
            acc.questions += 1;
        }
        progress(&format!("squad question {}/{}", qi + 1, questions.len()));
    }

    let mean = |x: f64, n: usize| if n == 0 { f64::NAN } else { x / n as f64 };
    let results = methods
        .iter()
        .zip(&accs)
        .map(|(m, a)| MethodMetrics {
            method: m.name().to_string(),
            kl: mean(a.kl, a.positions),
            tv: mean(a.tv, a.positions),
            perplexity: mean(a.nll, a.positions).exp(),
            greedy_agreement: mean(a.greedy_same, a.greedy_windows),
            qa_f1: 100.0 * mean(a.f1, a.questions),
            qa_exact_match: 100.0 * mean(a.em, a.questions),
            qa_agreement: mean(a.qa_agree, a.questions),
            positions: a.positions,
        })
        .collect();
    Ok(EvalRecord {
        scd_version: env!("CARGO_PKG_VERSION").into(),
        config: cfg.clone(),
        models: ModelsInfo {
            producer: ModelInfo::of(pair.producer),
            consumer: ModelInfo::of(pair.consumer),
            consumer_adapter,
        },
        data: DataInfo {
            wikitext: data.wikitext_file.clone(),
            squad: data.squad_file.clone(),
            squad_ids: questions.iter().map(|q| q.id.clone()).collect(),
        },
        oracle_perplexity: mean(oracle_nll, oracle_positions).exp(),
        results,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn num(x: f64, digits: usize) -> String {
    if x.is_nan() {
        "n/a".into()
    } else {
        format!("{x:.digits$}")
    }
}

impl EvalRecord {
    /// The record as a Markdown section: configuration lines, then one row per method.
    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        s.push_str(&format!(
            "Producer `{}` ({}), consumer `{}` ({}){}.\n\n",
            self.models.producer.file,
            &self.models.producer.sha256[..self.models.producer.sha256.len().min(12)],
            self.models.consumer.file,
            &self.models.consumer.sha256[..self.models.consumer.sha256.len().min(12)],
            self.models
                .consumer_adapter
                .as_ref()
                .map(|a| format!(
                    " with adapter `{}` ({})",
                    a.path,
                    &a.sha256[..a.sha256.len().min(12)]
                ))
                .unwrap_or_default()
        ));
        s.push_str(&format!(
            "WikiText-2: {} windows of {} prompt + {} continuation tokens (greedy agreement over {} tokens); SQuAD: {} answerable questions, greedy answers of up to {} tokens, first line; seed {}.\n\n",
            c.wikitext_windows, c.prefix_tokens, c.continuation_tokens, c.greedy_tokens,
            self.data.squad_ids.len(), c.answer_tokens, c.seed
        ));
        s.push_str(&format!(
            "QA prompt (user turn of the chat template): `{}`\n\n",
            c.qa_template.replace('\n', "\\n")
        ));
        s.push_str(&format!(
            "Oracle WikiText-2 continuation perplexity: {}.\n\n",
            num(self.oracle_perplexity, 3)
        ));
        s.push_str("| method | KL(oracle‖method) | TV | WikiText-2 PPL | greedy agreement | SQuAD F1 | SQuAD EM | QA answer agreement |\n");
        s.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for r in &self.results {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.method,
                num(r.kl, 4),
                num(r.tv, 4),
                num(r.perplexity, 3),
                num(r.greedy_agreement, 3),
                num(r.qa_f1, 1),
                num(r.qa_exact_match, 1),
                num(r.qa_agreement, 3)
            ));
        }
        s
    }
}

/// Perplexities and divergence of an expert against its base on one text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextDrift {
    /// Which text (`<corpus> valid` or `WikiText-2 valid`).
    pub text: String,
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Base perplexity.
    pub base_perplexity: f64,
    /// Expert perplexity.
    pub expert_perplexity: f64,
    /// Mean KL(expert || base) of next-token distributions, nats.
    pub kl_expert_base: f64,
}

/// Scores `windows` (every position after the first) with base and expert.
pub fn text_drift(
    base: &Llama,
    expert: &Llama,
    text: &str,
    windows: &[Vec<u32>],
) -> Result<TextDrift, EvalError> {
    let (mut nb, mut ne, mut kl, mut n) = (0.0, 0.0, 0.0, 0usize);
    for w in windows {
        if w.len() < 2 {
            continue;
        }
        let input = &w[..w.len() - 1];
        let lb = base.forward(Input::new(input).logits(LogitsWanted::All))?;
        let le = expert.forward(Input::new(input).logits(LogitsWanted::All))?;
        let none = || candle_core::Error::Msg("forward returned no logits".into());
        let rb = rows(&lb.logits.ok_or_else(none)?)?;
        let re = rows(&le.logits.ok_or_else(none)?)?;
        for (i, (b, e)) in rb.iter().zip(&re).enumerate() {
            nb += metrics::nll(b, w[i + 1]);
            ne += metrics::nll(e, w[i + 1]);
            kl += metrics::kl_divergence(e, b);
            n += 1;
        }
    }
    if n == 0 {
        return Err(EvalError::Config("no tokens to score".into()));
    }
    Ok(TextDrift {
        text: text.into(),
        windows: windows.len(),
        window_tokens: windows.first().map_or(0, Vec::len),
        base_perplexity: (nb / n as f64).exp(),
        expert_perplexity: (ne / n as f64).exp(),
        kl_expert_base: kl / n as f64,
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
}

/// Where a drift report's data comes from and how much of it to use.
#[derive(Debug, Clone)]
pub struct DriftOptions {
    /// The expert's name for the report.
    pub expert: String,
    /// Its corpus (validation split is scored).
    pub corpus: corpus::Corpus,
    /// Windows per text.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Harness configuration for the transfer part (methods are forced to oracle and raw).
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
    let dom_tokens = corpus::tokenize_long(tok, &opts.corpus.valid)?;
    let dom_windows = corpus::even_windows(&dom_tokens, opts.window_tokens, opts.windows, "valid")?;
    progress("domain perplexity and KL");
    let domain = text_drift(
        base,
        expert,
        &format!("{} valid", opts.corpus.name),
        &dom_windows,
    )?;
    let wiki_tokens = corpus::tokenize_long(tok, &data.wikitext)?;
    let wiki_windows = seeded_windows(
        &wiki_tokens,
        opts.window_tokens,
        opts.windows,
        opts.eval.seed ^ 0x5749_4b49,
    );
    progress("WikiText-2 perplexity and KL");
    let wikitext = text_drift(base, expert, "WikiText-2 valid", &wiki_windows)?;
    let mut cfg = opts.eval.clone();
    cfg.methods = vec!["oracle".into(), "raw".into()];
    let transfer = evaluate(
        Pair {
            producer: base,
            consumer: expert,
        },
        tok,
        data,
        &cfg,
        opts.adapter.clone(),
        progress,
    )?;
    Ok(DriftReport {
        expert: opts.expert.clone(),
        domain,
        wikitext,
        transfer,
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
                num(d.base_perplexity, 3),
                num(d.expert_perplexity, 3),
                100.0 * (d.expert_perplexity / d.base_perplexity - 1.0),
                num(d.kl_expert_base, 4)
            ));
        }
        s.push_str(
            "\nNaive transfer (the expert decoding on the base's KV) against the oracle:\n\n",
        );
        s.push_str(&self.transfer.markdown());
        s
    }
}

/// Paths of an expert folder.
pub fn expert_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("adapter.safetensors"), dir.join("manifest.json"))
}
