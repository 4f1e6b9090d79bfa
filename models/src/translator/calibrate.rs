//! `scd calibrate`: fit a translator for a producer and one or more consumers.
//!
//! 1. Cut calibration prompts from a corpus split the evaluation never reads (Brown's train
//!    split by default): `prefixes` for fitting and `heldout` more for choices, each from its
//!    own stretch of the text; a share of both as chat turns ([`ChatWrap`]).
//! 2. Run every model's prefill over each fitting prompt, capturing K before RoPE, V and
//!    `H_in` at every layer; add them to the per-layer moments, and keep a bounded sample of
//!    `H_in` rows for the aligners.
//! 3. Fit the Reuse codes of K and V and the code of `H_in` per layer (also for the other
//!    centring choice and a few ridge strengths, to record how they compare), and train an
//!    aligner per layer and consumer.
//! 4. On the held-out prompts, measure raw, Reuse and Patch per layer, choose the Patch layers
//!    greedily (and DroidSpeak's recompute blocks the same way), and record the curves.
//! 5. Assemble the translator with its manifest, and measure its quality at a grid of ranks on
//!    the same held-out prompts (the curve a producer sizes codes for a link with). The
//!    caller saves it.

use std::time::Instant;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::aligner::{self, AlignerConfig, AlignerReport};
use super::artifact::{
    CalibrationInfo, ConsumerRef, LayerTranslator, ModelRef, PatchLayer, Ranks, Translator,
    TranslatorManifest, WeightsDtype, FORMAT,
};
use super::low_rank::{fit, FitOptions, LowRankCode};
use super::moments::Moments;
use super::select::{greedy, knee, HeldOutPrompt};
use super::TranslatorError;
use crate::cache::KvCache;
use crate::llama::{Capture, Input, LayerCapture, Llama, LogitsWanted, Proj};
// Calibration measures its candidates' codes in f32 whatever the machine, so that a
// translator's choices (centring, ridge, Patch layers) reproduce on machines with and without
// AMX; serving runs the codes on the machine's prefill path (`codec::translated`).
use crate::prefill_matmul::PrefillMatmul::F32;
use crate::tokenizer::{ChatMessage, Tokenizer};
use scd_types::{CodeDType, Mode};

/// How many Patch layers to use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PatchChoice {
    /// Greedy up to `max` layers, keeping those before the curve's knee: the last layer kept
    /// brings at least `min_share` of the whole improvement.
    Auto {
        /// Layers tried at most.
        max: usize,
        /// Share of the whole improvement a kept layer must bring.
        min_share: f64,
    },
    /// The first `k` layers of the greedy curve.
    Fixed(usize),
}

/// What a calibration does.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrationConfig {
    /// Fitting prompts.
    pub prefixes: usize,
    /// Held-out prompts (aligner early stopping uses the last fitting prompts' rows; layer
    /// choices use these).
    pub heldout: usize,
    /// Tokens per fitting prompt.
    pub prefix_tokens: usize,
    /// Held-out prompts: transferred prefix length.
    pub heldout_prefix_tokens: usize,
    /// Held-out prompts: scored continuation length.
    pub heldout_continuation: usize,
    /// Seed of prompt placement, row sampling and aligner training.
    pub seed: u64,
    /// Centre the codes on the calibration means.
    pub centre: bool,
    /// Relative ridge strength.
    pub ridge: f64,
    /// Highest ranks stored.
    pub r_max: Ranks,
    /// Ranks used when a request does not say.
    pub default_ranks: Ranks,
    /// Aligner training.
    pub aligner: AlignerConfig,
    /// `H_in` rows per layer kept for aligner training.
    pub aligner_rows: usize,
    /// How the Patch layers are chosen.
    pub patch: PatchChoice,
    /// Greedy choices (Patch layers, DroidSpeak blocks): after scoring every candidate alone,
    /// try only this many of the best ones (`None`: all of them at every step).
    pub shortlist: Option<usize>,
    /// DroidSpeak: layers per recomputed block, and blocks at most.
    pub droidspeak_block: usize,
    /// DroidSpeak blocks chosen.
    pub droidspeak_blocks: usize,
    /// A label for the version (the content hash identifies it).
    pub version: String,
    /// Measure the quality-vs-ranks curve ([`super::rank_curve`]) at the end, on the held-out
    /// prompts, at this grid of (K, V) ranks (`None`: not measured).
    pub rank_grid: Option<Vec<(usize, usize)>>,
    /// Wrap a share of the prompts (fitting and held-out) in the model's chat template
    /// (`None`: plain text only).
    pub chat: Option<ChatWrap>,
}

/// A share of the calibration prompts as chat turns: the corpus text as the user's message,
/// between the template's tokens before it (the system turn, if the template adds one) and
/// after it (the generation prompt).
///
/// Served prompts are chat turns, and every one of them starts with the same template tokens,
/// whose K and V (the first positions, attention sinks) look like nothing in running text: a
/// translator fitted on running text alone has never seen those rows. Wrapping keeps each
/// prompt's length, so the fitting cost does not change.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatWrap {
    /// Share of the prompts wrapped, spread evenly over them (0 to 1).
    pub share: f64,
    /// The template's tokens before the user's text.
    pub head: Vec<u32>,
    /// The template's tokens after it, up to the generation prompt.
    pub tail: Vec<u32>,
}

impl ChatWrap {
    /// The wrap of `tok`'s chat template, one user message and the generation prompt.
    pub fn for_tokenizer(tok: &Tokenizer, share: f64) -> Result<Self, TranslatorError> {
        // A marker no template writes, split out of the rendered turn: the template decides
        // what comes before and after the message (a default system turn, say).
        const MARK: &str = "\u{1}SCD-MESSAGE\u{1}";
        let rendered = tok
            .apply_chat_template(&[ChatMessage::user(MARK)], true)
            .map_err(|e| TranslatorError::Fit(format!("chat template: {e}")))?;
        let (head, tail) = rendered.split_once(MARK).ok_or_else(|| {
            TranslatorError::Fit("the chat template does not write the user's message".into())
        })?;
        let encode = |t: &str| {
            tok.encode(t, false)
                .map_err(|e| TranslatorError::Fit(format!("tokenising the chat template: {e}")))
        };
        if !(0.0..=1.0).contains(&share) {
            return Err(TranslatorError::Fit(format!(
                "chat share {share} is not between 0 and 1"
            )));
        }
        Ok(Self {
            share,
            head: encode(head)?,
            tail: encode(tail)?,
        })
    }

    /// Whether prompt `i` is wrapped: every prompt where the running count of
    /// `share * (i + 1)` steps up, so the wrapped ones spread evenly.
    fn wraps(&self, i: usize) -> bool {
        ((i + 1) as f64 * self.share).floor() > (i as f64 * self.share).floor()
    }

    /// `window` as a chat turn of the same length: the head, the window's first tokens as
    /// the message, the tail, then (for held-out prompts) `after` more of the window's tokens
    /// as the reply the continuation scores. `None` when the window is too short for it.
    fn wrap(&self, window: &[u32], after: usize) -> Option<Vec<u32>> {
        let fixed = self.head.len() + self.tail.len();
        let message = window.len().checked_sub(fixed + after)?;
        if message == 0 {
            return None;
        }
        let mut out = Vec::with_capacity(window.len());
        out.extend_from_slice(&self.head);
        out.extend_from_slice(&window[..message]);
        out.extend_from_slice(&self.tail);
        out.extend_from_slice(&window[message..message + after]);
        Some(out)
    }

    /// Wraps this share of `windows`, each keeping `after` tokens for after the turn.
    fn apply(&self, windows: &mut [Vec<u32>], after: usize) -> Result<(), TranslatorError> {
        for (i, w) in windows.iter_mut().enumerate() {
            if self.wraps(i) {
                *w = self.wrap(w, after).ok_or_else(|| {
                    TranslatorError::Fit(format!(
                        "prompts of {} tokens are too short for the chat template's {} + {}",
                        w.len(),
                        self.head.len(),
                        self.tail.len()
                    ))
                })?;
            }
        }
        Ok(())
    }
}

impl CalibrationConfig {
    /// Defaults for a model with KV rows of `kv_dim`.
    pub fn for_model(kv_dim: usize) -> Self {
        Self {
            prefixes: 200,
            heldout: 12,
            prefix_tokens: 320,
            heldout_prefix_tokens: 256,
            heldout_continuation: 32,
            seed: 0,
            centre: true,
            ridge: 1e-4,
            r_max: Ranks {
                k: kv_dim,
                v: kv_dim,
                h: 256,
            },
            default_ranks: Ranks {
                k: kv_dim,
                v: kv_dim,
                h: 128,
            },
            aligner: AlignerConfig::default(),
            aligner_rows: 12_288,
            patch: PatchChoice::Auto {
                max: 8,
                min_share: 0.05,
            },
            shortlist: Some(6),
            droidspeak_block: 2,
            droidspeak_blocks: 3,
            version: "cal".into(),
            rank_grid: Some(super::rank_curve::default_grid(Ranks {
                k: kv_dim,
                v: kv_dim,
                h: 256,
            })),
            chat: None,
        }
    }
}

/// What calibration tells its caller as it goes.
#[derive(Debug, Clone)]
pub enum CalibrateEvent {
    /// A phase begins.
    Phase(String),
    /// `done` of `total` items of the current phase.
    Progress {
        /// Items done.
        done: usize,
        /// Items in the phase.
        total: usize,
    },
    /// A line worth printing (a measurement).
    Note(String),
}

/// A calibration corpus split.
#[derive(Debug, Clone)]
pub struct CalibrationText<'a> {
    /// Corpus name.
    pub corpus: &'a str,
    /// Which split, and anything else a reader needs to know.
    pub split: &'a str,
    /// Hex SHA-256 of the text.
    pub sha256: &'a str,
    /// The split's tokens.
    pub tokens: &'a [u32],
}

/// `n` windows of `len` tokens, one from each of `n` equal stretches of `tokens` at a seeded
/// offset: spread over the whole text and never overlapping.
fn spread_windows(
    tokens: &[u32],
    n: usize,
    len: usize,
    rng: &mut StdRng,
) -> Result<Vec<Vec<u32>>, TranslatorError> {
    let stretch = tokens.len() / n.max(1);
    if n == 0 || stretch < len {
        return Err(TranslatorError::Fit(format!(
            "{} calibration tokens cannot give {n} prompts of {len}",
            tokens.len()
        )));
    }
    Ok((0..n)
        .map(|i| {
            let start = i * stretch + rng.gen_range(0..=stretch - len);
            tokens[start..start + len].to_vec()
        })
        .collect())
}

fn capture_all(model: &Llama, tokens: &[u32]) -> Result<Vec<LayerCapture>, TranslatorError> {
    Ok(model
        .forward(
            Input::new(tokens)
                .capture(Capture {
                    k_pre_rope: true,
                    v: true,
                    h_in: true,
                    hidden: true,
                    layers: None,
                })
                .logits(LogitsWanted::None),
        )?
        .captured)
}

fn need<'a>(t: &'a Option<Tensor>, what: &str) -> Result<&'a Tensor, TranslatorError> {
    t.as_ref()
        .ok_or_else(|| TranslatorError::Fit(format!("capture without {what}")))
}

/// Per-layer state of the fitting pass.
struct LayerStats {
    k: Moments,
    v: Moments,
    h: Moments,
    /// Sampled `H_in` rows: producer, then each consumer.
    h_rows: Vec<Vec<f32>>,
}

/// The K and V a held-out prompt's consumer cache gets at one layer, one way or another.
type Kv = (Tensor, Tensor);

/// One layer of a held-out cache: the producer's as it serves it (keys rotated with its RoPE,
/// which an expert with its own base reads wrongly), or one the consumer's side derived (rotated
/// with the consumer's own).
enum HeldKv {
    Served(Kv),
    Own(Kv),
}

/// Everything measured on one held-out prompt for one consumer, per layer.
struct HeldOutLayers {
    prompt: HeldOutPrompt,
    raw: Vec<Kv>,
    reuse: Vec<Kv>,
    patch: Vec<Kv>,
    /// DroidSpeak: per block start, the block's layers as the consumer computes them.
    blocks: Vec<Vec<Kv>>,
}

impl HeldOutLayers {
    /// The consumer's cache with each layer from `pick` (Reuse where it gives `None`).
    fn cache(
        &self,
        consumer: &Llama,
        pick: impl Fn(usize) -> Result<Option<HeldKv>, TranslatorError>,
    ) -> Result<KvCache, TranslatorError> {
        let positions: Vec<u32> = (0..self.prompt.prefix.len() as u32).collect();
        let served = consumer.base_rope().tables(&positions)?;
        let own = consumer.rope().tables(&positions)?;
        let mut cache = consumer.new_cache();
        for l in 0..consumer.config().num_layers {
            let (tables, (k, v)) = match pick(l)? {
                Some(HeldKv::Served(kv)) => (&served, kv),
                Some(HeldKv::Own(kv)) => (&own, kv),
                None => (&own, self.reuse[l].clone()),
            };
            cache.fill_layer_rotating(tables, l, &k, &v)?;
        }
        Ok(cache)
    }
}

/// Wall time per phase, reported as each ends and kept in the manifest: calibration is long
/// work, and where its time goes decides what to make faster.
#[derive(Default)]
struct PhaseClock {
    current: Option<(String, Instant)>,
    done: Vec<(String, f64)>,
}

impl PhaseClock {
    fn begin(&mut self, name: String, on_event: &mut impl FnMut(&CalibrateEvent)) {
        self.end(on_event);
        on_event(&CalibrateEvent::Phase(name.clone()));
        self.current = Some((name, Instant::now()));
    }

    fn end(&mut self, on_event: &mut impl FnMut(&CalibrateEvent)) {
        if let Some((name, t)) = self.current.take() {
            let secs = t.elapsed().as_secs_f64();
            on_event(&CalibrateEvent::Note(format!("({name}: {secs:.0} s)")));
            self.done.push((name, secs));
        }
    }
}

/// The fitting prompts, the held-out prompts, and the generator after drawing them (row
/// sampling and aligner training go on with it).
type Prompts = (Vec<Vec<u32>>, Vec<Vec<u32>>, StdRng);

/// The prompts of a calibration ([`Prompts`]).
fn prompts(
    text: &CalibrationText<'_>,
    cfg: &CalibrationConfig,
) -> Result<Prompts, TranslatorError> {
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let heldout_len = cfg.heldout_prefix_tokens + 1 + cfg.heldout_continuation;
    let mut fit_prompts = spread_windows(text.tokens, cfg.prefixes, cfg.prefix_tokens, &mut rng)?;
    // Held-out prompts come from the stretch after the fitting ones' sample: a separate draw
    // over the whole text would overlap them; instead take them from the text's last tenth,
    // which the fitting prompts cover only in proportion.
    let tail = &text.tokens[text.tokens.len() * 9 / 10..];
    let mut held_prompts = spread_windows(tail, cfg.heldout, heldout_len, &mut rng)?;
    if let Some(chat) = &cfg.chat {
        chat.apply(&mut fit_prompts, 0)?;
        // The last transferred token and the continuation follow the turn, as a reply would.
        chat.apply(&mut held_prompts, 1 + cfg.heldout_continuation)?;
    }
    Ok((fit_prompts, held_prompts, rng))
}

/// The held-out prompts a calibration with `cfg` on `text` measures its choices on: what a
/// later measurement of an existing translator (its rank curve) must use to stay on text the
/// fit never saw.
pub fn heldout_prompts(
    text: &CalibrationText<'_>,
    cfg: &CalibrationConfig,
) -> Result<Vec<Vec<u32>>, TranslatorError> {
    Ok(prompts(text, cfg)?.1)
}

/// Runs the calibration; see the module doc. `consumers` are `(name, model)`.
pub fn calibrate(
    producer: &Llama,
    consumers: &[(&str, &Llama)],
    text: &CalibrationText<'_>,
    cfg: &CalibrationConfig,
    mut on_event: impl FnMut(&CalibrateEvent),
) -> Result<Translator, TranslatorError> {
    let started = Instant::now();
    let mut clock = PhaseClock::default();
    let pc = producer.config();
    let (layers, kv, hidden, m) = (pc.num_layers, pc.kv_dim(), pc.hidden_size, consumers.len());
    if m == 0 {
        return Err(TranslatorError::Fit("no consumer to calibrate for".into()));
    }
    for (name, c) in consumers {
        let cc = c.config();
        if cc.num_layers != layers || cc.kv_dim() != kv || cc.hidden_size != hidden {
            return Err(TranslatorError::WrongPair(format!(
                "consumer {name} does not share the producer's architecture"
            )));
        }
    }
    let r = cfg.r_max;
    if r.k > kv || r.v > kv || r.h > hidden || r.h == 0 {
        return Err(TranslatorError::Ranks(format!(
            "r_max K {} / V {} / H {} above the widths {kv} / {kv} / {hidden}",
            r.k, r.v, r.h
        )));
    }
    let (fit_prompts, held_prompts, mut rng) = prompts(text, cfg)?;

    // 2. Moments and aligner rows.
    clock.begin(
        format!(
            "capturing {} prompts of {} tokens with {} models",
            fit_prompts.len(),
            cfg.prefix_tokens,
            m + 1
        ),
        &mut on_event,
    );
    let per_prompt = cfg
        .aligner_rows
        .div_ceil(fit_prompts.len())
        .min(cfg.prefix_tokens);
    let mut stats: Vec<LayerStats> = (0..layers)
        .map(|_| LayerStats {
            k: Moments::new(kv * (m + 1)),
            v: Moments::new(kv * (m + 1)),
            h: Moments::new(hidden * (m + 1)),
            h_rows: vec![Vec::new(); m + 1],
        })
        .collect();
    let mut tokens_seen = 0u64;
    for (i, prompt) in fit_prompts.iter().enumerate() {
        let mut caps = vec![capture_all(producer, prompt)?];
        for (_, c) in consumers {
            caps.push(capture_all(c, prompt)?);
        }
        let mut rows: Vec<u32> = (0..prompt.len() as u32).collect();
        rows.shuffle(&mut rng);
        rows.truncate(per_prompt);
        let rows = Tensor::new(rows.as_slice(), &Device::Cpu)?;
        for (l, st) in stats.iter_mut().enumerate() {
            let ks = caps
                .iter()
                .map(|c| need(&c[l].k_pre_rope, "K"))
                .collect::<Result<Vec<_>, _>>()?;
            let vs = caps
                .iter()
                .map(|c| need(&c[l].v, "V"))
                .collect::<Result<Vec<_>, _>>()?;
            let hs = caps
                .iter()
                .map(|c| need(&c[l].h_in, "H_in"))
                .collect::<Result<Vec<_>, _>>()?;
            st.k.add(&ks)?;
            st.v.add(&vs)?;
            st.h.add(&hs)?;
            for (buf, h) in st.h_rows.iter_mut().zip(&hs) {
                buf.extend(h.index_select(&rows, 0)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        tokens_seen += prompt.len() as u64;
        on_event(&CalibrateEvent::Progress {
            done: i + 1,
            total: fit_prompts.len(),
        });
    }

    // 3. Fits and aligners.
    clock.begin(
        "fitting the codes and training the aligners".into(),
        &mut on_event,
    );
    let widths_kv: Vec<usize> = vec![kv; m + 1];
    let widths_h: Vec<usize> = vec![hidden; m + 1];
    let opts = |rank| FitOptions {
        centre: cfg.centre,
        ridge: cfg.ridge,
        rank,
    };
    let mut k_codes = Vec::with_capacity(layers);
    let mut v_codes = Vec::with_capacity(layers);
    let mut h_codes = Vec::with_capacity(layers);
    let mut aligners: Vec<Vec<aligner::Aligner>> = Vec::with_capacity(layers);
    let mut aligner_reports: Vec<Vec<AlignerReport>> = Vec::with_capacity(layers);
    for (l, st) in stats.iter().enumerate() {
        k_codes.push(fit(&st.k, &widths_kv, opts(r.k))?);
        v_codes.push(fit(&st.v, &widths_kv, opts(r.v))?);
        let h = fit(&st.h, &widths_h, opts(r.h))?;
        let n = st.h_rows[0].len() / hidden;
        let ha = Tensor::from_slice(&st.h_rows[0], (n, hidden), &Device::Cpu)?;
        let mut layer_aligners = Vec::with_capacity(m);
        let mut reports = Vec::with_capacity(m);
        for (e, (name, _)) in consumers.iter().enumerate() {
            let hb = Tensor::from_slice(&st.h_rows[e + 1], (n, hidden), &Device::Cpu)?;
            let (a, rep) = aligner::train(
                &h,
                e,
                &ha,
                &hb,
                (n / 10).max(1),
                &AlignerConfig {
                    seed: cfg.aligner.seed ^ ((l as u64) << 8) ^ (e as u64),
                    ..cfg.aligner
                },
            )?;
            on_event(&CalibrateEvent::Note(format!(
                "layer {l}, {name}: aligner held-out MSE {:.3e} (linear decoder {:.3e}), {} epochs",
                rep.mse, rep.linear_mse, rep.epochs
            )));
            layer_aligners.push(a);
            reports.push(rep);
        }
        h_codes.push(h);
        aligners.push(layer_aligners);
        aligner_reports.push(reports);
        on_event(&CalibrateEvent::Progress {
            done: l + 1,
            total: layers,
        });
    }
    // The moments are no longer needed beyond the sweep below; the sampled rows are.
    for st in &mut stats {
        st.h_rows = Vec::new();
    }

    // 4. Held-out measurements and choices.
    clock.begin(
        format!("measuring on {} held-out prompts", held_prompts.len()),
        &mut on_event,
    );
    let dr = cfg.default_ranks;
    let block = cfg.droidspeak_block.clamp(1, layers);
    let block_starts = layers + 1 - block;
    let mut held: Vec<Vec<HeldOutLayers>> = Vec::with_capacity(m);
    for (e, (_, consumer)) in consumers.iter().enumerate() {
        let mut per_prompt_layers = Vec::with_capacity(held_prompts.len());
        for tokens in &held_prompts {
            let prompt = HeldOutPrompt::new(consumer, tokens, cfg.heldout_continuation)?;
            let caps = capture_all(producer, &prompt.prefix)?;
            let (mut raw, mut reuse, mut patch) = (Vec::new(), Vec::new(), Vec::new());
            for (l, c) in caps.iter().enumerate() {
                let (k, v, h) = (
                    need(&c.k_pre_rope, "K")?,
                    need(&c.v, "V")?,
                    need(&c.h_in, "H_in")?,
                );
                raw.push((k.clone(), v.clone()));
                reuse.push((
                    k_codes[l].decode(&k_codes[l].encode(k, dr.k, F32)?, e, F32)?,
                    v_codes[l].decode(&v_codes[l].encode(v, dr.v, F32)?, e, F32)?,
                ));
                let hb = aligners[l][e].forward(&h_codes[l].encode(h, dr.h, F32)?, F32)?;
                patch.push((
                    consumer.project(l, Proj::K, &hb)?,
                    consumer.project(l, Proj::V, &hb)?,
                ));
            }
            let mut blocks = Vec::with_capacity(block_starts);
            for (s, cap) in caps.iter().enumerate().take(block_starts) {
                let hidden_in = need(&cap.hidden, "hidden")?;
                let mut cache = consumer.new_cache();
                let mut own = Vec::new();
                consumer.forward_layers_capture(
                    hidden_in,
                    s..s + block,
                    0,
                    Some(&mut cache),
                    &Capture {
                        k_pre_rope: true,
                        v: true,
                        ..Capture::none()
                    },
                    &mut own,
                )?;
                blocks.push(
                    own.iter()
                        .map(|c| Ok((need(&c.k_pre_rope, "K")?.clone(), need(&c.v, "V")?.clone())))
                        .collect::<Result<Vec<_>, TranslatorError>>()?,
                );
            }
            per_prompt_layers.push(HeldOutLayers {
                prompt,
                raw,
                reuse,
                patch,
                blocks,
            });
        }
        held.push(per_prompt_layers);
    }
    // Mean held-out KL over consumers and the prompts `which` takes, with each layer taken
    // from `pick`.
    type Pick<'p> = &'p dyn Fn(&HeldOutLayers, usize) -> Option<HeldKv>;
    let kl_of = |which: &dyn Fn(usize) -> bool, pick: Pick| -> Result<f64, TranslatorError> {
        let mut total = 0.0;
        let mut n = 0usize;
        for ((_, consumer), prompts) in consumers.iter().zip(&held) {
            for (_, h) in prompts.iter().enumerate().filter(|(i, _)| which(*i)) {
                total += h
                    .prompt
                    .kl(consumer, h.cache(consumer, |l| Ok(pick(h, l)))?)?;
                n += 1;
            }
        }
        Ok(total / n.max(1) as f64)
    };
    let kl = |pick: Pick| kl_of(&|_| true, pick);
    let kl_raw = kl(&|h, l| Some(HeldKv::Served(h.raw[l].clone())))?;
    let kl_reuse = kl(&|_, _| None)?;
    on_event(&CalibrateEvent::Note(format!(
        "held-out KL: raw {kl_raw:.4}, reuse at ranks {}/{} {kl_reuse:.4}",
        dr.k, dr.v
    )));
    // The same on the chat turns and on the running text apart: what the mix costs or buys
    // on each kind of prompt.
    let by_kind = match &cfg.chat {
        Some(chat) if chat.share > 0.0 && chat.share < 1.0 => {
            let mut kinds = serde_json::Map::new();
            for (name, is_chat) in [("chat", true), ("text", false)] {
                let which = |i: usize| chat.wraps(i) == is_chat;
                let raw = kl_of(&which, &|h, l| Some(HeldKv::Served(h.raw[l].clone())))?;
                let reuse = kl_of(&which, &|_, _| None)?;
                on_event(&CalibrateEvent::Note(format!(
                    "held-out KL on {name} prompts: raw {raw:.4}, reuse {reuse:.4}"
                )));
                kinds.insert(name.into(), json!({"kl_raw": raw, "kl_reuse": reuse}));
            }
            serde_json::Value::Object(kinds)
        }
        _ => serde_json::Value::Null,
    };

    clock.begin("choosing the Patch layers".into(), &mut on_event);
    let max_patch = match &cfg.patch {
        PatchChoice::Auto { max, .. } => *max,
        PatchChoice::Fixed(k) => *k,
    }
    .min(layers);
    let patch_curve = greedy(
        layers,
        max_patch,
        cfg.shortlist,
        |_, _| true,
        |set| kl(&|h, l| set.contains(&l).then(|| HeldKv::Own(h.patch[l].clone()))),
        |p| {
            on_event(&CalibrateEvent::Note(format!(
                "patch {:?}: KL {:.4}",
                p.chosen, p.kl
            )))
        },
    )?;
    let k = match &cfg.patch {
        PatchChoice::Auto { min_share, .. } => knee(&patch_curve, *min_share),
        PatchChoice::Fixed(k) => (*k).min(patch_curve.len() - 1),
    };
    let mut patch_layers = patch_curve[k].chosen.clone();
    patch_layers.sort_unstable();
    let patch_order = patch_curve
        .last()
        .map(|p| p.chosen.clone())
        .unwrap_or_default();

    clock.begin("choosing the DroidSpeak blocks".into(), &mut on_event);
    let ds_curve = greedy(
        block_starts,
        cfg.droidspeak_blocks,
        cfg.shortlist,
        |chosen, s| chosen.iter().all(|&c| s + block <= c || c + block <= s),
        |starts| {
            kl(&|h, l| {
                starts
                    .iter()
                    .find(|&&s| (s..s + block).contains(&l))
                    .map(|&s| HeldKv::Own(h.blocks[s][l - s].clone()))
                    .or_else(|| Some(HeldKv::Served(h.raw[l].clone())))
            })
        },
        |p| {
            on_event(&CalibrateEvent::Note(format!(
                "droidspeak {:?}: KL {:.4}",
                p.chosen, p.kl
            )))
        },
    )?;
    let mut droidspeak_blocks: Vec<(usize, usize)> = ds_curve
        .last()
        .map(|p| p.chosen.iter().map(|&s| (s, s + block)).collect())
        .unwrap_or_default();
    droidspeak_blocks.sort_unstable();

    // Centring and ridge, compared on the same held-out prompts (Reuse only, default ranks).
    clock.begin(
        "comparing centring and ridge strengths".into(),
        &mut on_event,
    );
    let mut sweep = Vec::new();
    for centre in [true, false] {
        for ridge in [1e-6, 1e-4, 1e-2, 1e-1] {
            let o = FitOptions {
                centre,
                ridge,
                rank: dr.k.max(dr.v),
            };
            let codes = stats
                .iter()
                .map(|st| Ok((fit(&st.k, &widths_kv, o)?, fit(&st.v, &widths_kv, o)?)))
                .collect::<Result<Vec<_>, TranslatorError>>()?;
            let mut total = 0.0;
            let mut n = 0usize;
            for (e, ((_, consumer), prompts)) in consumers.iter().zip(&held).enumerate() {
                for h in prompts {
                    let cache = h.cache(consumer, |l| {
                        let (kc, vc) = &codes[l];
                        let (k, v) = &h.raw[l];
                        Ok(Some(HeldKv::Own((
                            kc.decode(&kc.encode(k, dr.k, F32)?, e, F32)?,
                            vc.decode(&vc.encode(v, dr.v, F32)?, e, F32)?,
                        ))))
                    })?;
                    total += h.prompt.kl(consumer, cache)?;
                    n += 1;
                }
            }
            let v = total / n.max(1) as f64;
            on_event(&CalibrateEvent::Note(format!(
                "reuse, centre {centre}, ridge {ridge:e}: KL {v:.4}"
            )));
            sweep.push(json!({"centre": centre, "ridge": ridge, "kl": v}));
        }
    }

    // 5. The translator.
    clock.end(&mut on_event);
    let payload_share = |patch: usize| {
        let reuse_values = (layers - patch) * (dr.k + dr.v);
        let patch_values = patch * dr.h;
        (reuse_values + patch_values) as f64 / (layers * 2 * kv) as f64
    };
    let metrics = json!({
        "heldout_prompts": held_prompts.len(),
        "heldout_prefix_tokens": cfg.heldout_prefix_tokens,
        "heldout_continuation": cfg.heldout_continuation,
        "kl_raw": kl_raw,
        "kl_reuse": kl_reuse,
        "heldout_by_kind": by_kind,
        "kl_scd": patch_curve[k].kl,
        "value_share_of_raw_scd": payload_share(patch_layers.len()),
        "patch_curve": patch_curve,
        "patch_rule": format!("{:?}", cfg.patch),
        "greedy_shortlist": cfg.shortlist,
        "droidspeak_curve": ds_curve,
        "centring_ridge_sweep": sweep,
        "phase_seconds": clock.done.iter().map(|(p, s)| json!({"phase": p, "seconds": s})).collect::<Vec<_>>(),
        "aligners": aligner_reports.iter().enumerate().map(|(l, reps)| json!({
            "layer": l,
            "linear_mse": reps.iter().map(|r| r.linear_mse).collect::<Vec<_>>(),
            "mse": reps.iter().map(|r| r.mse).collect::<Vec<_>>(),
            "epochs": reps.iter().map(|r| r.epochs).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "k_explained": explained(&k_codes, dr.k, &stats.iter().map(|s| &s.k).collect::<Vec<_>>()),
        "v_explained": explained(&v_codes, dr.v, &stats.iter().map(|s| &s.v).collect::<Vec<_>>()),
    });
    let mut layers_out = Vec::with_capacity(layers);
    for (l, ((k, v), (h, a))) in k_codes
        .into_iter()
        .zip(v_codes)
        .zip(h_codes.into_iter().zip(aligners))
        .enumerate()
    {
        let patch = patch_order
            .contains(&l)
            .then_some(PatchLayer { h, aligners: a });
        layers_out.push(LayerTranslator { k, v, patch });
    }
    let manifest = TranslatorManifest {
        format: FORMAT,
        scd_version: env!("CARGO_PKG_VERSION").into(),
        version: cfg.version.clone(),
        content_hash: scd_types::TranslatorHash::from_bytes([0; 32]),
        producer: ModelRef::of(producer),
        consumers: consumers
            .iter()
            .map(|(name, c)| ConsumerRef {
                name: (*name).to_string(),
                model: ModelRef::of(c),
            })
            .collect(),
        layers,
        kv_dim: kv,
        hidden,
        r_max: cfg.r_max,
        default_ranks: cfg.default_ranks,
        patch_layers,
        patch_order,
        droidspeak_blocks,
        centre: cfg.centre,
        ridge: cfg.ridge,
        calibration: CalibrationInfo {
            corpus: text.corpus.into(),
            split: text.split.into(),
            text_sha256: text.sha256.into(),
            prefixes: fit_prompts.len(),
            heldout: held_prompts.len(),
            prefix_tokens: cfg.prefix_tokens,
            tokens: tokens_seen,
            seconds: started.elapsed().as_secs_f64(),
            chat_share: cfg.chat.as_ref().map_or(0.0, |c| c.share),
        },
        metrics,
        weights_dtype: WeightsDtype::F32,
        rank_curve: None,
    };
    let translator = Translator {
        manifest,
        layers: layers_out,
    };
    let Some(grid) = &cfg.rank_grid else {
        return Ok(translator);
    };
    clock.begin(
        format!("measuring {} rank choices per mode", grid.len()),
        &mut on_event,
    );
    let translator = std::sync::Arc::new(translator);
    let models: Vec<&Llama> = consumers.iter().map(|(_, c)| *c).collect();
    let curve = super::rank_curve::measure(
        &translator,
        producer,
        &models,
        &held_prompts,
        cfg.heldout_continuation,
        grid,
        &[Mode::Reuse, Mode::Scd],
        CodeDType::F16,
        |done, total| on_event(&CalibrateEvent::Progress { done, total }),
    )?;
    clock.end(&mut on_event);
    let mut translator =
        std::sync::Arc::try_unwrap(translator).unwrap_or_else(|shared| (*shared).clone());
    translator.manifest.rank_curve = Some(curve);
    if let Some(phases) = translator.manifest.metrics.get_mut("phase_seconds") {
        *phases = json!(clock
            .done
            .iter()
            .map(|(p, s)| json!({"phase": p, "seconds": s}))
            .collect::<Vec<_>>());
    }
    translator.manifest.calibration.seconds = started.elapsed().as_secs_f64();
    Ok(translator)
}

/// Per layer, the share of the joint rows' variance the first `rank` components carry (a
/// diagnostic of how compressible each layer is).
fn explained(codes: &[LowRankCode], rank: usize, moments: &[&Moments]) -> Vec<f64> {
    codes
        .iter()
        .zip(moments)
        .map(|(c, m)| {
            let w = m.width();
            let cov = m.second_moment(true);
            let total: f64 = (0..w).map(|i| cov[i * w + i]).sum();
            let kept: f64 = c.eigenvalues.iter().take(rank).sum();
            if total > 0.0 {
                kept / total
            } else {
                f64::NAN
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_windows_do_not_overlap_and_refuse_short_text() {
        let tokens: Vec<u32> = (0..1000).collect();
        let mut rng = StdRng::seed_from_u64(1);
        let w = spread_windows(&tokens, 5, 100, &mut rng).unwrap();
        assert_eq!(w.len(), 5);
        for pair in w.windows(2) {
            assert!(pair[0][99] < pair[1][0]);
        }
        assert!(spread_windows(&tokens, 20, 100, &mut rng).is_err());
    }

    fn wrap(share: f64) -> ChatWrap {
        ChatWrap {
            share,
            head: vec![900, 901, 902],
            tail: vec![990, 991],
        }
    }

    #[test]
    fn a_chat_share_wraps_that_share_of_the_prompts_spread_evenly() {
        for (share, n, wrapped) in [(0.25, 200, 50), (0.5, 12, 6), (0.0, 10, 0), (1.0, 7, 7)] {
            let w = wrap(share);
            let picked: Vec<usize> = (0..n).filter(|&i| w.wraps(i)).collect();
            assert_eq!(picked.len(), wrapped, "share {share} of {n}");
            if share == 0.25 {
                assert!(picked.windows(2).all(|p| p[1] - p[0] == 4), "{picked:?}");
            }
        }
    }

    #[test]
    fn a_wrapped_prompt_keeps_its_length_and_puts_the_reply_after_the_turn() {
        let w = wrap(1.0);
        let window: Vec<u32> = (0..20).collect();
        // A fitting prompt: head, the first 15 tokens as the message, tail.
        let fit = w.wrap(&window, 0).unwrap();
        assert_eq!(fit.len(), 20);
        assert_eq!(&fit[..3], &[900, 901, 902]);
        assert_eq!(&fit[3..18], &window[..15]);
        assert_eq!(&fit[18..], &[990, 991]);
        // A held-out prompt: 5 tokens kept after the turn (the last transferred token and
        // the scored continuation), following on from the message.
        let held = w.wrap(&window, 5).unwrap();
        assert_eq!(held.len(), 20);
        assert_eq!(&held[3..13], &window[..10]);
        assert_eq!(&held[13..15], &[990, 991]);
        assert_eq!(&held[15..], &window[10..15]);
        // No room for a message: refused, not truncated.
        assert!(w.wrap(&window[..5], 0).is_none());
        let mut too_short = vec![window[..6].to_vec()];
        assert!(w.apply(&mut too_short, 1).is_err());
    }

    #[test]
    fn chat_prompts_replace_their_share_of_the_plain_ones_and_nothing_else() {
        let tokens: Vec<u32> = (0..50_000).collect();
        let text = CalibrationText {
            corpus: "t",
            split: "s",
            sha256: "0",
            tokens: &tokens,
        };
        let mut cfg = CalibrationConfig::for_model(8);
        cfg.prefixes = 8;
        cfg.heldout = 4;
        let (fit, held, _) = prompts(&text, &cfg).unwrap();
        cfg.chat = Some(wrap(0.5));
        let (fit_chat, held_chat, _) = prompts(&text, &cfg).unwrap();
        for (i, (a, b)) in fit.iter().zip(&fit_chat).enumerate() {
            assert_eq!(a.len(), b.len());
            assert_eq!(a == b, i % 2 == 0, "fitting prompt {i}");
        }
        for (i, (a, b)) in held.iter().zip(&held_chat).enumerate() {
            assert_eq!(a.len(), b.len());
            assert_eq!(a == b, i % 2 == 0, "held-out prompt {i}");
            if i % 2 == 1 {
                // The continuation the KL scores is the window's text after the message.
                let after = 1 + cfg.heldout_continuation;
                let message = a.len() - 5 - after;
                assert_eq!(&b[b.len() - after..], &a[message..message + after]);
            }
        }
    }
}
