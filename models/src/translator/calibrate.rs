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
//!
//! This file holds the settings, the prompts (step 1) and [`calibrate`], which runs the
//! steps in order; each step is a function in a file of its own under `calibrate/`:
//! `capture.rs` (step 2), `fit_layers.rs` (step 3), `heldout.rs` (step 4: the held-out
//! measurements, the Patch and DroidSpeak choices and the centring / ridge comparison) and
//! `assemble.rs` (step 5).

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::aligner::AlignerConfig;
use super::artifact::{Ranks, Translator};
use super::TranslatorError;
use crate::llama::Llama;
use crate::tokenizer::{ChatMessage, Tokenizer};

mod assemble;
mod capture;
mod fit_layers;
mod heldout;

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

/// What every step reads: the models, the settings, and the shape the models share.
struct Setup<'a> {
    producer: &'a Llama,
    /// `(name, model)`.
    consumers: &'a [(&'a str, &'a Llama)],
    cfg: &'a CalibrationConfig,
    layers: usize,
    /// Width of a K or V row.
    kv: usize,
    hidden: usize,
    /// Consumers.
    m: usize,
}

impl<'a> Setup<'a> {
    /// Checks that there is a consumer, that every consumer has the producer's shape, and
    /// that `cfg.r_max` fits within the widths.
    fn new(
        producer: &'a Llama,
        consumers: &'a [(&'a str, &'a Llama)],
        cfg: &'a CalibrationConfig,
    ) -> Result<Self, TranslatorError> {
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
        Ok(Self {
            producer,
            consumers,
            cfg,
            layers,
            kv,
            hidden,
            m,
        })
    }

    /// DroidSpeak's block length, within 1 to the layer count.
    fn droidspeak_block(&self) -> usize {
        self.cfg.droidspeak_block.clamp(1, self.layers)
    }
}

/// Wall time of the whole calibration and per phase, reported as each phase ends and kept in
/// the manifest: calibration is long work, and where its time goes decides what to make
/// faster.
struct PhaseClock {
    started: Instant,
    current: Option<(String, Instant)>,
    done: Vec<(String, f64)>,
}

impl PhaseClock {
    /// A clock whose whole-calibration time starts now.
    fn start() -> Self {
        Self {
            started: Instant::now(),
            current: None,
            done: Vec::new(),
        }
    }

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

    /// Seconds since [`PhaseClock::start`].
    fn total_seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The finished phases as the manifest's `phase_seconds` records them.
    fn phase_seconds(&self) -> Vec<serde_json::Value> {
        self.done
            .iter()
            .map(|(p, s)| serde_json::json!({"phase": p, "seconds": s}))
            .collect()
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

/// The fitting prompts of a calibration with `cfg` on `text`: what a later fit for an existing
/// translator (its `kvtc` basis) reads, the same text its codes were fitted on.
pub fn fitting_prompts(
    text: &CalibrationText<'_>,
    cfg: &CalibrationConfig,
) -> Result<Vec<Vec<u32>>, TranslatorError> {
    Ok(prompts(text, cfg)?.0)
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
    let mut clock = PhaseClock::start();
    let setup = Setup::new(producer, consumers, cfg)?;

    // 1. Prompts.
    let (fit_prompts, held_prompts, mut rng) = prompts(text, cfg)?;

    // 2. Moments and aligner rows.
    clock.begin(
        format!(
            "capturing {} prompts of {} tokens with {} models",
            fit_prompts.len(),
            cfg.prefix_tokens,
            setup.m + 1
        ),
        &mut on_event,
    );
    let (mut stats, tokens_seen) =
        capture::capture_moments(&setup, &fit_prompts, &mut rng, &mut on_event)?;

    // 3. Fits and aligners.
    clock.begin(
        "fitting the codes and training the aligners".into(),
        &mut on_event,
    );
    let fitted = fit_layers::fit_layers(&setup, &mut stats, &mut on_event)?;

    // 4. Held-out measurements and choices.
    clock.begin(
        format!("measuring on {} held-out prompts", held_prompts.len()),
        &mut on_event,
    );
    let held = heldout::measure(&setup, &fitted, &held_prompts)?;
    let baseline = heldout::baseline(&setup, &held, &mut on_event)?;
    clock.begin("choosing the Patch layers".into(), &mut on_event);
    let patch = heldout::choose_patch_layers(&setup, &held, &mut on_event)?;
    clock.begin("choosing the DroidSpeak blocks".into(), &mut on_event);
    let droidspeak = heldout::choose_droidspeak_blocks(&setup, &held, &mut on_event)?;
    // Centring and ridge, compared on the same held-out prompts (Reuse only, default ranks).
    clock.begin(
        "comparing centring and ridge strengths".into(),
        &mut on_event,
    );
    let sweep = heldout::compare_centring_ridge(&setup, &held, &stats, &mut on_event)?;

    // 5. The translator, then its quality at the grid of ranks.
    clock.end(&mut on_event);
    let choices = assemble::Choices {
        baseline,
        patch,
        droidspeak,
        sweep,
    };
    let counts = assemble::Counts {
        prefixes: fit_prompts.len(),
        heldout: held_prompts.len(),
        tokens: tokens_seen,
    };
    let translator = assemble::assemble(&setup, text, counts, &stats, fitted, choices, &clock);
    let Some(grid) = &cfg.rank_grid else {
        return Ok(translator);
    };
    clock.begin(
        format!("measuring {} rank choices per mode", grid.len()),
        &mut on_event,
    );
    let translator = Arc::new(translator);
    let curve =
        assemble::measure_rank_curve(&setup, &translator, &held_prompts, grid, &mut on_event)?;
    clock.end(&mut on_event);
    Ok(assemble::with_rank_curve(translator, curve, &clock))
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
