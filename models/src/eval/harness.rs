//! The runs behind a record: for every WikiText-2 window and SQuAD question, each method's
//! codec carries the prompt prefix from producer to consumer, and the consumer's continuation
//! is compared with the oracle's.

use std::ops::ControlFlow;
use std::time::Instant;

use scd_types::Mode;

use super::data::{first_line, qa_prompt, sample_questions, seeded_windows};
use super::record::{DataInfo, EvalRecord, MethodMetrics, MethodTiming, ModelInfo, ModelsInfo};
use super::{EvalConfig, EvalData, EvalError, FileInfo};
use crate::cache::KvCache;
use crate::codec::{self, Codec, Oracle, Prefix};
use crate::corpus;
use crate::generate::{generate_with_cache, GenerateParams};
use crate::llama::{Capture, Input, LayerCapture, Llama, LogitsWanted};
use crate::metrics;
use crate::perplexity::continuation_logits;
use crate::sampling::Sampling;
use crate::stats::{bootstrap_mean, bootstrap_ratio, Estimate};
use crate::tokenizer::Tokenizer;

/// The two models of a transfer: the producer prefills the prompt, the consumer continues.
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    /// The model whose state is shipped (the base).
    pub producer: &'a Llama,
    /// The model that decodes (an expert).
    pub consumer: &'a Llama,
}

/// One transfer of a prompt prefix and what it cost.
pub struct Transfer {
    /// The consumer's rebuilt cache.
    pub cache: KvCache,
    /// Payload bytes.
    pub payload: usize,
    /// Stage times, milliseconds.
    pub timing: MethodTiming,
}

/// Carries `prefix` from `pair.producer` to `pair.consumer` with `codec`, as the cluster does:
/// the producer's prefill with the codec's capture, encode, then the consumer's rebuild.
pub fn transfer(codec: &dyn Codec, pair: Pair<'_>, prefix: &[u32]) -> Result<Transfer, EvalError> {
    let mut out = None;
    transfer_each(&[codec], pair, prefix, |_, t| {
        out = Some(t);
        Ok(())
    })?;
    out.ok_or_else(|| EvalError::Config("no transfer".into()))
}

/// [`transfer`] for several codecs, with one producer prefill capturing what any of them
/// needs (each codec's stage times count that prefill as its own); `each` takes codec `i`'s
/// transfer before the next codec rebuilds. One cache at a time, as a node serves a request:
/// with every method's cache held until the last was built, each later method's rebuild
/// wrote fresh pages and paid their faults (SCD's rebuild, sixth of six, took three times as
/// long).
pub fn transfer_each(
    codecs: &[&dyn Codec],
    pair: Pair<'_>,
    prefix: &[u32],
    each: impl FnMut(usize, Transfer) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    let captured = capture(codecs.iter().copied(), pair.producer, prefix)?;
    rebuild_each(codecs, pair.consumer, &captured, prefix, each)
}

/// What the producer's prefill of a prefix captured, for the codecs that asked, and how long
/// the prefill took.
struct Captured {
    layers: Vec<LayerCapture>,
    prefill_ms: f64,
}

/// The producer's prefill of `prefix`, capturing what any of `codecs` needs (nothing, and no
/// prefill, where none captures).
fn capture<'c>(
    codecs: impl Iterator<Item = &'c dyn Codec>,
    producer: &Llama,
    prefix: &[u32],
) -> Result<Captured, EvalError> {
    let wanted: Vec<Capture> = codecs.filter_map(|c| c.capture()).collect();
    if wanted.is_empty() || prefix.is_empty() {
        return Ok(Captured {
            layers: Vec::new(),
            prefill_ms: 0.0,
        });
    }
    let union = Capture {
        k_pre_rope: wanted.iter().any(|c| c.k_pre_rope),
        v: wanted.iter().any(|c| c.v),
        h_in: wanted.iter().any(|c| c.h_in),
        hidden: wanted.iter().any(|c| c.hidden),
        layers: None,
    };
    let t = Instant::now();
    let layers = producer
        .forward(Input::new(prefix).capture(union).logits(LogitsWanted::None))?
        .captured;
    Ok(Captured {
        layers,
        prefill_ms: ms(t),
    })
}

/// The second half of [`transfer_each`]: each codec encodes what `captured` holds and
/// `consumer` rebuilds from its codes.
fn rebuild_each(
    codecs: &[&dyn Codec],
    consumer: &Llama,
    captured: &Captured,
    prefix: &[u32],
    mut each: impl FnMut(usize, Transfer) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    for (i, codec) in codecs.iter().enumerate() {
        let mut timing = MethodTiming::default();
        let mut codes = Vec::new();
        if codec.capture().is_some() && !prefix.is_empty() {
            timing.producer_prefill_ms = captured.prefill_ms;
            let t = Instant::now();
            codes = codec::encode(*codec, &captured.layers)?;
            timing.encode_ms = ms(t);
        }
        let t = Instant::now();
        let cache = codec::decode(*codec, consumer, &codes, Prefix::new(prefix))?;
        timing.rebuild_ms = ms(t);
        let payload = codec::payload_bytes(&codes);
        drop(codes);
        each(
            i,
            Transfer {
                cache,
                payload,
                timing,
            },
        )?;
    }
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
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
        ControlFlow::Continue(())
    })?;
    Ok(g.tokens)
}

/// Per-unit values of one method, resampled into intervals at the end.
#[derive(Default)]
struct Units {
    /// Per window: mean KL, mean TV, (NLL sum, positions), greedy agreement.
    kl: Vec<f64>,
    tv: Vec<f64>,
    nll: Vec<(f64, f64)>,
    greedy: Vec<f64>,
    /// Per question: F1, EM, answer agreement (0..1).
    f1: Vec<f64>,
    em: Vec<f64>,
    qa_agree: Vec<f64>,
    positions: usize,
    payload: f64,
    raw_bf16: f64,
    requests: usize,
    timing: MethodTiming,
}

impl Units {
    fn add_transfer(&mut self, t: &Transfer, raw_bf16: usize) {
        self.payload += t.payload as f64;
        self.raw_bf16 += raw_bf16 as f64;
        self.requests += 1;
        self.timing.producer_prefill_ms += t.timing.producer_prefill_ms;
        self.timing.encode_ms += t.timing.encode_ms;
        self.timing.rebuild_ms += t.timing.rebuild_ms;
    }

    fn metrics(&self, method: Mode, variant: String, seed: u64) -> MethodMetrics {
        let per_request = |x: f64| x / self.requests.max(1) as f64;
        let pct = |e: Estimate| e.map(|x| 100.0 * x);
        MethodMetrics {
            method,
            variant,
            kl: bootstrap_mean(&self.kl, seed),
            tv: bootstrap_mean(&self.tv, seed ^ 1),
            perplexity: bootstrap_ratio(&self.nll, seed ^ 2).map(f64::exp),
            greedy_agreement: bootstrap_mean(&self.greedy, seed ^ 3),
            qa_f1: pct(bootstrap_mean(&self.f1, seed ^ 4)),
            qa_exact_match: pct(bootstrap_mean(&self.em, seed ^ 5)),
            qa_agreement: bootstrap_mean(&self.qa_agree, seed ^ 6),
            positions: self.positions,
            payload_bytes: per_request(self.payload),
            payload_share_of_raw: if self.raw_bf16 > 0.0 {
                self.payload / self.raw_bf16
            } else {
                f64::NAN
            },
            timing: MethodTiming {
                producer_prefill_ms: per_request(self.timing.producer_prefill_ms),
                encode_ms: per_request(self.timing.encode_ms),
                rebuild_ms: per_request(self.timing.rebuild_ms),
            },
        }
    }
}

/// Runs the harness: every codec against the oracle on the same WikiText-2 windows and SQuAD
/// questions. The oracle reference is computed on its own, so an `oracle` method is measured
/// like any other (its distances come out zero because it is the same computation, not because
/// they are assumed). `consumer_adapter` only labels the record; `progress` receives short
/// lines as items finish.
pub fn evaluate(
    pair: Pair<'_>,
    codecs: &[&dyn Codec],
    tok: &Tokenizer,
    data: &EvalData,
    cfg: &EvalConfig,
    consumer_adapter: Option<FileInfo>,
    progress: impl FnMut(&str),
) -> Result<EvalRecord, EvalError> {
    let consumer = Consumer {
        model: pair.consumer,
        codecs,
        adapter: consumer_adapter,
        windows: cfg.wikitext_windows,
    };
    let mut records = evaluate_shared(pair.producer, &[consumer], tok, data, cfg, progress)?;
    records
        .pop()
        .ok_or_else(|| EvalError::Config("no record".into()))
}

/// One consumer of [`evaluate_shared`]: an expert, the methods that carry the producer's
/// prefill to it, and how many of the run's windows it is scored on (the first ones).
#[derive(Clone)]
pub struct Consumer<'a> {
    /// The model that decodes.
    pub model: &'a Llama,
    /// The methods, each against this consumer's own oracle.
    pub codecs: &'a [&'a dyn Codec],
    /// Labels the record only.
    pub adapter: Option<FileInfo>,
    /// The first this many of the run's `cfg.wikitext_windows` windows.
    pub windows: usize,
}

/// [`evaluate`] for several consumers of one producer, with its model work done once: each
/// window's (and question's) producer prefill is shared by every consumer's methods, as a
/// producer's prefill of one prompt is shared by the experts of a fan-out. Each consumer gets
/// the record [`evaluate`] would give it alone (the same windows, the same figures; its
/// methods' prefill times are the shared prefill's); `cfg` is the run's, with
/// `wikitext_windows` the most any consumer asks for.
pub fn evaluate_shared(
    producer: &Llama,
    consumers: &[Consumer<'_>],
    tok: &Tokenizer,
    data: &EvalData,
    cfg: &EvalConfig,
    mut progress: impl FnMut(&str),
) -> Result<Vec<EvalRecord>, EvalError> {
    let t0 = Instant::now();
    if consumers.is_empty()
        || consumers.iter().any(|c| c.codecs.is_empty())
        || cfg.prefix_tokens < 2
        || cfg.continuation_tokens == 0
    {
        return Err(EvalError::Config(
            "need at least one method, a prefix of 2+ tokens and a continuation".into(),
        ));
    }
    if let Some(c) = consumers.iter().find(|c| c.windows > cfg.wikitext_windows) {
        return Err(EvalError::Config(format!(
            "a consumer asks for {} windows of a run of {}",
            c.windows, cfg.wikitext_windows
        )));
    }
    let pcfg = producer.config();
    for c in consumers {
        let ccfg = c.model.config();
        if pcfg.num_layers != ccfg.num_layers || pcfg.kv_dim() != ccfg.kv_dim() {
            return Err(EvalError::Config(
                "producer and consumer must share the architecture (layers, KV width)".into(),
            ));
        }
    }
    let raw_bf16 = |prefix: usize| prefix * pcfg.kv_dim() * 2 * 2 * pcfg.num_layers;
    let all_codecs = || consumers.iter().flat_map(|c| c.codecs.iter().copied());
    let mut units: Vec<Vec<Units>> = consumers
        .iter()
        .map(|c| c.codecs.iter().map(|_| Units::default()).collect())
        .collect();
    let mut oracle_nll = vec![Vec::new(); consumers.len()];
    // One request per method before any is timed: a method's first request pays what a node
    // pays once (a translator's fused Patch weights, the threads' scratch buffers), and the
    // stage times are per request.
    let mut warmed = vec![false; consumers.len()];
    let mut producer_warmed = false;
    let mut warm_producer = |prefix: &[u32]| -> Result<(), EvalError> {
        if !std::mem::replace(&mut producer_warmed, true) {
            capture(all_codecs(), producer, prefix)?;
        }
        Ok(())
    };
    let mut warm_up = |ci: usize, captured: &Captured, prefix: &[u32]| -> Result<(), EvalError> {
        if !std::mem::replace(&mut warmed[ci], true) {
            let c = &consumers[ci];
            let pair = Pair {
                producer,
                consumer: c.model,
            };
            transfer(&Oracle, pair, prefix)?;
            rebuild_each(c.codecs, c.model, captured, prefix, |_, _| Ok(()))?;
        }
        Ok(())
    };

    if cfg.wikitext_windows > 0 {
        let tokens = corpus::tokenize_long(tok, &data.text)?;
        let len = cfg.prefix_tokens + cfg.continuation_tokens;
        let windows = seeded_windows(&tokens, len, cfg.wikitext_windows, cfg.seed);
        for (wi, w) in windows.iter().enumerate() {
            let (prompt, cont) = w.split_at(cfg.prefix_tokens);
            let (prefix, last) = (&prompt[..prompt.len() - 1], prompt[prompt.len() - 1]);
            let active: Vec<usize> = (0..consumers.len())
                .filter(|&ci| wi < consumers[ci].windows)
                .collect();
            if active.is_empty() {
                break;
            }
            warm_producer(prefix)?;
            let captured = capture(
                active
                    .iter()
                    .flat_map(|&ci| consumers[ci].codecs.iter().copied()),
                producer,
                prefix,
            )?;
            for &ci in &active {
                warm_up(ci, &captured, prefix)?;
                let consumer = consumers[ci].model;
                let pair = Pair { producer, consumer };
                let reference = transfer(&Oracle, pair, prefix)?.cache;
                let ref_logits = continuation_logits(consumer, reference.try_clone()?, last, cont)?;
                let ref_greedy = greedy(consumer, reference, last, cfg.greedy_tokens, &[])?;
                let nll: f64 = (0..cont.len())
                    .map(|i| metrics::nll(&ref_logits[i], cont[i]))
                    .sum();
                oracle_nll[ci].push((nll, cont.len() as f64));
                let units = &mut units[ci];
                rebuild_each(consumers[ci].codecs, consumer, &captured, prefix, |i, t| {
                    let u = &mut units[i];
                    u.add_transfer(&t, raw_bf16(prefix.len()));
                    let logits = continuation_logits(consumer, t.cache.try_clone()?, last, cont)?;
                    let g = greedy(consumer, t.cache, last, cfg.greedy_tokens, &[])?;
                    let (mut kl, mut tv, mut nll) = (0.0, 0.0, 0.0);
                    for (i, (p, q)) in ref_logits.iter().zip(&logits).enumerate() {
                        let (k, v) = metrics::distances(p, q);
                        kl += k;
                        tv += v;
                        nll += metrics::nll(q, cont[i]);
                    }
                    let n = cont.len() as f64;
                    u.kl.push(kl / n);
                    u.tv.push(tv / n);
                    u.nll.push((nll, n));
                    u.positions += cont.len();
                    u.greedy.push(metrics::agreement(&ref_greedy, &g));
                    Ok(())
                })?;
            }
            progress(&format!(
                "{} window {}/{}",
                data.text_name,
                wi + 1,
                windows.len()
            ));
        }
    }

    let questions = sample_questions(&data.squad, cfg.squad_questions, cfg.seed);
    for (qi, item) in questions.iter().enumerate() {
        let prompt = qa_prompt(tok, &cfg.qa_template, item)?;
        let (prefix, last) = (&prompt[..prompt.len() - 1], prompt[prompt.len() - 1]);
        let golds: Vec<&str> = item.answers.iter().map(String::as_str).collect();
        warm_producer(prefix)?;
        let captured = capture(all_codecs(), producer, prefix)?;
        for (ci, c) in consumers.iter().enumerate() {
            warm_up(ci, &captured, prefix)?;
            let pair = Pair {
                producer,
                consumer: c.model,
            };
            let reference = transfer(&Oracle, pair, prefix)?.cache;
            let ref_answer = greedy(c.model, reference, last, cfg.answer_tokens, tok.stop_ids())?;
            let units = &mut units[ci];
            rebuild_each(c.codecs, c.model, &captured, prefix, |i, t| {
                let u = &mut units[i];
                u.add_transfer(&t, raw_bf16(prefix.len()));
                let answer = greedy(c.model, t.cache, last, cfg.answer_tokens, tok.stop_ids())?;
                let text = tok.decode(&answer, true)?;
                let pred = first_line(&text);
                u.f1.push(metrics::squad_f1(pred, &golds));
                u.em.push(metrics::squad_exact_match(pred, &golds));
                u.qa_agree.push(metrics::agreement(&ref_answer, &answer));
                Ok(())
            })?;
        }
        progress(&format!("squad question {}/{}", qi + 1, questions.len()));
    }

    let seconds = t0.elapsed().as_secs_f64();
    let records = consumers
        .iter()
        .zip(&units)
        .zip(&oracle_nll)
        .map(|((c, units), oracle_nll)| EvalRecord {
            scd_version: env!("CARGO_PKG_VERSION").into(),
            config: EvalConfig {
                wikitext_windows: c.windows,
                ..cfg.clone()
            },
            models: ModelsInfo {
                producer: ModelInfo::of(producer),
                consumer: ModelInfo::of(c.model),
                consumer_adapter: c.adapter.clone(),
            },
            data: DataInfo {
                text_name: data.text_name.clone(),
                wikitext: data.text_file.clone(),
                squad: data.squad_file.clone(),
                squad_ids: questions.iter().map(|q| q.id.clone()).collect(),
            },
            oracle_perplexity: bootstrap_ratio(oracle_nll, cfg.seed ^ 2).map(f64::exp),
            results: c
                .codecs
                .iter()
                .zip(units)
                .map(|(codec, u)| u.metrics(codec.mode(), codec.variant(), cfg.seed))
                .collect(),
            seconds,
        })
        .collect();
    Ok(records)
}
