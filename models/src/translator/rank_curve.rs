//! What a translator's nested ranks buy: held-out quality at a grid of (K, V) ranks, measured
//! once and kept in the manifest, and the choice of ranks for one job on one link.
//!
//! Codes are nested ([`super::low_rank`]), so a producer may send any ranks up to `r_max`
//! without recalibrating; what it lacks is what each choice costs in quality. [`measure`]
//! runs the codec as served (encode, exact payload, rebuild, the consumer continuing) on the
//! calibration's held-out prompts at each grid point and records the KL to the oracle.
//! [`choose`] then takes the link's measured throughput and a KL ceiling and picks the point
//! with the lowest expected time to first token among those under the ceiling, preferring
//! the better code when the link makes the difference negligible.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::select::HeldOutPrompt;
use super::{Ranks, Translator, TranslatorError};
use crate::codec::{self, Codec, Prefix, Translated};
use crate::llama::{Input, LayerCapture, Llama, LogitsWanted};
use scd_types::{CodeDType, Mode};

/// One measured choice of ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPoint {
    /// `reuse` or `scd` (with the translator's default Patch layers).
    pub mode: Mode,
    /// The ranks (H at the translator's default for every point).
    pub ranks: Ranks,
    /// Mean held-out KL(oracle || consumer), one value per consumer of the translator.
    pub kl: Vec<f64>,
}

/// A translator's quality-vs-ranks curve.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RankCurve {
    /// Held-out prompts per consumer.
    pub prompts: usize,
    /// Tokens each prompt transfers.
    pub prefix_tokens: usize,
    /// Continuation tokens scored after each.
    pub continuation: usize,
    /// Code dtype the points were measured with.
    pub code_dtype: String,
    /// Every point, in grid order.
    pub points: Vec<RankPoint>,
}

/// The default grid: K and V each at 1/8, 1/4, 3/8, 1/2, 3/4 and all of `r_max`.
pub fn default_grid(r_max: Ranks) -> Vec<(usize, usize)> {
    let ladder = |max: usize| {
        let mut r: Vec<usize> = [1, 2, 3, 4, 6, 8]
            .iter()
            .map(|&e| (max * e / 8).max(1))
            .collect();
        r.dedup();
        r
    };
    let (ks, vs) = (ladder(r_max.k), ladder(r_max.v));
    ks.iter()
        .flat_map(|&k| vs.iter().map(move |&v| (k, v)))
        .collect()
}

/// Measures the curve of `translator` for its consumers (`consumers[e]` is its consumer `e`)
/// on held-out `prompts` (each `prefix + 1 + continuation` tokens, from text the fit never
/// saw), at every `(k, v)` of `grid` for each of `modes`, with codes in `dtype`.
/// `progress(done, total)` after each point.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    translator: &Arc<Translator>,
    producer: &Llama,
    consumers: &[&Llama],
    prompts: &[Vec<u32>],
    continuation: usize,
    grid: &[(usize, usize)],
    modes: &[Mode],
    dtype: CodeDType,
    mut progress: impl FnMut(usize, usize),
) -> Result<RankCurve, TranslatorError> {
    let m = &translator.manifest;
    let held = held_out(translator, producer, consumers, prompts, continuation)?;
    let total = grid.len() * modes.len();
    let mut points = Vec::with_capacity(total);
    for &mode in modes {
        for &(k, v) in grid {
            let ranks = Ranks {
                k,
                v,
                h: m.default_ranks.h,
            };
            let mut kl = Vec::with_capacity(consumers.len());
            for (e, (consumer, per)) in consumers.iter().zip(&held).enumerate() {
                let codec = Translated::new(translator.clone(), mode, e, ranks, dtype, None)?;
                let mut sum = 0.0;
                for (prompt, captured) in per {
                    let codes = codec::encode(&codec, captured)?;
                    let cache =
                        codec::decode(&codec, consumer, &codes, Prefix::new(&prompt.prefix))?;
                    sum += prompt.kl(consumer, cache)?;
                }
                kl.push(sum / per.len().max(1) as f64);
            }
            points.push(RankPoint { mode, ranks, kl });
            progress(points.len(), total);
        }
    }
    Ok(RankCurve {
        prompts: prompts.len(),
        prefix_tokens: held
            .first()
            .and_then(|p| p.first())
            .map_or(0, |(p, _)| p.prefix.len()),
        continuation,
        code_dtype: dtype.name().unwrap_or("?").into(),
        points,
    })
}

/// A held-out prompt with the producer's captures of its prefix.
pub(crate) type HeldOut = (HeldOutPrompt, Vec<LayerCapture>);

/// Each consumer's held-out prompts with the producer's captures of them (what codecs
/// encode), after checking that `consumers[e]` is the translator's consumer `e`: every prompt's
/// oracle and capture once, so that each measured point only encodes and rebuilds.
pub(crate) fn held_out(
    translator: &Arc<Translator>,
    producer: &Llama,
    consumers: &[&Llama],
    prompts: &[Vec<u32>],
    continuation: usize,
) -> Result<Vec<Vec<HeldOut>>, TranslatorError> {
    let m = &translator.manifest;
    if consumers.len() != m.consumers.len() {
        return Err(TranslatorError::WrongPair(format!(
            "{} consumers given, the translator has {}",
            consumers.len(),
            m.consumers.len()
        )));
    }
    for (e, c) in consumers.iter().enumerate() {
        translator
            .check_pair(producer, c)
            .and_then(|i| match i == e {
                true => Ok(()),
                false => Err(TranslatorError::WrongPair(format!(
                    "consumer {e} given is the translator's consumer {i}"
                ))),
            })?;
    }
    let capture = Translated::new(
        translator.clone(),
        Mode::Scd,
        0,
        m.default_ranks,
        CodeDType::F32,
        None,
    )?
    .capture();
    let mut held = Vec::with_capacity(consumers.len());
    for consumer in consumers {
        let mut per = Vec::with_capacity(prompts.len());
        for tokens in prompts {
            let prompt = HeldOutPrompt::new(consumer, tokens, continuation)?;
            let mut input = Input::new(&prompt.prefix).logits(LogitsWanted::None);
            if let Some(c) = &capture {
                input = input.capture(c.clone());
            }
            let captured = producer.forward(input)?.captured;
            per.push((prompt, captured));
        }
        held.push(per);
    }
    Ok(held)
}

/// What a producer knows about one job's link when it picks ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkEstimate {
    /// Measured throughput to the consumer node, bytes per second.
    pub bytes_per_sec: f64,
    /// Expected prefill time of the job's prefix, seconds (codes stream while it runs).
    pub prefill_secs: f64,
}

/// How [`choose`] decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankPolicy {
    /// Highest held-out KL a choice may have.
    pub kl_ceiling: f64,
    /// Points whose expected time to first token is within this share of the fastest one's
    /// count as equally fast; among them the lowest KL wins.
    pub slack: f64,
}

impl Default for RankPolicy {
    fn default() -> Self {
        Self {
            kl_ceiling: 0.1,
            slack: 0.05,
        }
    }
}

/// The ranks chosen for one job, with what the choice expected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankChoice {
    /// The ranks.
    pub ranks: Ranks,
    /// The curve's held-out KL at them.
    pub kl: f64,
    /// Payload bytes of the job's codes.
    pub payload_bytes: u64,
    /// Expected seconds from the prefill's start to the last code's arrival.
    pub expected_secs: f64,
}

/// Expected seconds from the prefill's start until the last code has arrived: codes stream
/// layer by layer while the prefill runs, so a transfer shorter than the prefill costs only
/// its last layer's share after it; a longer one is the bottleneck.
pub(crate) fn expected_secs(payload: u64, layers: usize, link: &LinkEstimate) -> f64 {
    let transfer = payload as f64 / link.bytes_per_sec.max(1.0);
    link.prefill_secs.max(transfer) + transfer / layers.max(1) as f64
}

/// Picks ranks for a job of `mode` on consumer `expert` of `translator`, for a prefix of
/// `rows` tokens sent in `dtype` over `link`: among the curve's points of that mode under the
/// ceiling, the lowest expected time to first token, and among points within `slack` of it the
/// lowest KL. `None` when no point meets the ceiling (the caller falls back to its default).
pub fn choose(
    translator: &Arc<Translator>,
    expert: usize,
    mode: Mode,
    rows: usize,
    dtype: CodeDType,
    link: &LinkEstimate,
    policy: &RankPolicy,
) -> Option<RankChoice> {
    let curve = translator.manifest.rank_curve.as_ref()?;
    let layers = translator.layers.len();
    let candidates: Vec<RankChoice> = curve
        .points
        .iter()
        .filter(|p| p.mode == mode)
        .filter_map(|p| {
            let kl = *p.kl.get(expert)?;
            if kl.is_nan() || kl > policy.kl_ceiling {
                return None;
            }
            let codec =
                Translated::new(translator.clone(), mode, expert, p.ranks, dtype, None).ok()?;
            let payload_bytes = codec.payload_bytes(rows);
            Some(RankChoice {
                ranks: p.ranks,
                kl,
                payload_bytes,
                expected_secs: expected_secs(payload_bytes, layers, link),
            })
        })
        .collect();
    pick(candidates, policy, |c| {
        (c.expected_secs, c.kl, c.payload_bytes)
    })
}

/// Among `candidates`, whose `key` is (expected seconds, KL, payload bytes): those within
/// `policy.slack` of the fastest, and of them the lowest KL (then the fewest bytes).
pub(crate) fn pick<T>(
    candidates: Vec<T>,
    policy: &RankPolicy,
    key: impl Fn(&T) -> (f64, f64, u64),
) -> Option<T> {
    let fastest = candidates.iter().map(|c| key(c).0).min_by(f64::total_cmp)?;
    candidates
        .into_iter()
        .filter(|c| key(c).0 <= fastest * (1.0 + policy.slack.max(0.0)))
        .min_by(|a, b| {
            let (a, b) = (key(a), key(b));
            a.1.total_cmp(&b.1).then(a.2.cmp(&b.2))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grid_spans_one_eighth_to_r_max() {
        let g = default_grid(Ranks {
            k: 192,
            v: 192,
            h: 256,
        });
        assert_eq!(g.len(), 36);
        assert_eq!(g[0], (24, 24));
        assert_eq!(g[35], (192, 192));
        let tiny = default_grid(Ranks { k: 4, v: 4, h: 4 });
        assert!(tiny
            .iter()
            .all(|&(k, v)| (1..=4).contains(&k) && (1..=4).contains(&v)));
        assert_eq!(tiny.len(), 16, "{tiny:?}");
    }

    #[test]
    fn transfer_under_the_prefill_costs_only_its_last_layer() {
        let link = LinkEstimate {
            bytes_per_sec: 1e6,
            prefill_secs: 2.0,
        };
        assert!((expected_secs(1_000_000, 10, &link) - 2.1).abs() < 1e-12);
        assert!((expected_secs(5_000_000, 10, &link) - 5.5).abs() < 1e-12);
    }
}
