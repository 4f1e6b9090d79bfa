//! What transform-coded codes ([`crate::codec::transform`]) need from a translator: the scales
//! of K's and `H_in`'s steps against V's, chosen on the calibration's held-out prompts and kept
//! in the manifest, and the quality and size those give at a ladder of rates (what a producer
//! sizes codes for a link with).
//!
//! Within one code, steps already equalise the error every component leaves in the consumer's
//! rows (`translated`). Across kinds an equal error does not cost equal quality: keys tolerate
//! far coarser codes than values. [`measure`] tries each candidate K scale (then each `H_in`
//! scale, with K's fixed) at a few rates and keeps the one whose KL-against-bytes curve lies
//! lowest over the bytes every candidate reaches: the allocation is read off the model's own
//! frontier, not assumed. A finer allocation, a step scale per layer and kind from the KL rise
//! of each group probed alone (the Lagrangian of KVTC's dynamic programme, per group), was
//! built and measured first and lost to the per-kind scales on held-out text (errors of the
//! groups do not add up the way probes alone see them; `docs/design-notes.md`), so it is not
//! kept.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Translator, TranslatorError};
use crate::codec::{self, Codec, TcRate, Translated};
use crate::llama::Llama;
use crate::prefill_matmul::PrefillMatmul;
use scd_types::{CodeDType, Mode};

/// Scales of K, V and `H_in` steps where a translator has no table, from the search on the
/// shipped translators (keys at four times values' step).
pub const DEFAULT_SCALES: [f32; 3] = [4.0, 1.0, 1.0];

/// K scales [`measure`] tries.
pub const K_SCALES: [f32; 5] = [1.0, 2.0, 4.0, 8.0, 16.0];
/// `H_in` scales [`measure`] tries (scd only).
pub const H_SCALES: [f32; 4] = [0.25, 0.5, 1.0, 2.0];
/// The rates each candidate is tried at.
pub const SEARCH_STEPS: [f32; 4] = [0.15, 0.25, 0.4, 0.6];

/// One measured rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RatePoint {
    /// `reuse` or `scd` (with the translator's default Patch layers), or `kvtc` (the base's
    /// raw KV in its own basis: [`measure_kvtc`]).
    pub mode: Mode,
    /// The rate's step.
    pub step: f32,
    /// Mean held-out KL(oracle || consumer), one value per consumer.
    pub kl: Vec<f64>,
    /// Payload over the producer's K and V in bf16 for the same prompts, per consumer.
    pub bytes_share: Vec<f64>,
}

/// A translator's table for transform-coded codes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RateTable {
    /// Held-out prompts per consumer.
    pub prompts: usize,
    /// Tokens each prompt transfers.
    pub prefix_tokens: usize,
    /// Continuation tokens scored after each.
    pub continuation: usize,
    /// Per consumer: the scales of K's, V's and `H_in`'s steps.
    pub scales: Vec<[f32; 3]>,
    /// Every measured rate, per mode in step order.
    pub points: Vec<RatePoint>,
}

/// The default ladder of rates a table measures.
pub const DEFAULT_STEPS: [f32; 8] = [0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8];

impl RateTable {
    /// The step at which `mode`'s codes for consumer `expert` took `share` of
    /// raw's bytes on the held-out prompts, interpolated between measured rates (bytes fall
    /// about linearly in the log of the step); `None` without points of that mode or where
    /// `share` is outside what they span.
    pub fn step_for_share(&self, mode: Mode, expert: usize, share: f64) -> Option<f32> {
        let mut pts: Vec<(f64, f64)> = self
            .points
            .iter()
            .filter(|p| p.mode == mode)
            .filter_map(|p| Some((*p.bytes_share.get(expert)?, f64::from(p.step).ln())))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts.windows(2)
            .find(|w| w[0].0 <= share && share <= w[1].0)
            .map(|w| {
                let f = if w[1].0 > w[0].0 {
                    (share - w[0].0) / (w[1].0 - w[0].0)
                } else {
                    0.0
                };
                (w[0].1 + f * (w[1].1 - w[0].1)).exp() as f32
            })
    }
}

/// The rate chosen for one job, with what the choice expected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateChoice {
    /// The rate's step.
    pub step: f32,
    /// The table's held-out KL at it.
    pub kl: f64,
    /// Expected payload bytes of the job's codes: the table's share of raw's bytes.
    pub payload_bytes: u64,
    /// Expected seconds from the prefill's start to the last code's arrival.
    pub expected_secs: f64,
}

impl RateTable {
    /// Picks the rate of a job of `mode` (`reuse`, `scd` or `kvtc`) on consumer `expert`
    /// whose raw K and V in bf16 would be `raw_bytes`, sent in `layers` layers over `link`,
    /// as [`super::rank_curve::choose`] picks ranks: among the measured rates under the KL
    /// ceiling the lowest expected time to first token, and within `slack` of it the lowest
    /// KL. A code's bytes depend on its values, so the payload expected is the share of raw
    /// the table measured at that rate. `None` when no rate meets the ceiling.
    pub fn choose(
        &self,
        mode: Mode,
        expert: usize,
        raw_bytes: u64,
        layers: usize,
        link: &super::rank_curve::LinkEstimate,
        policy: &super::RankPolicy,
    ) -> Option<RateChoice> {
        let candidates = self
            .points
            .iter()
            .filter(|p| p.mode == mode)
            .filter_map(|p| {
                let kl = *p.kl.get(expert)?;
                let share = *p.bytes_share.get(expert)?;
                if kl.is_nan() || kl > policy.kl_ceiling || !(share.is_finite() && share > 0.0) {
                    return None;
                }
                let payload_bytes = (raw_bytes as f64 * share).ceil() as u64;
                Some(RateChoice {
                    step: p.step,
                    kl,
                    payload_bytes,
                    expected_secs: super::rank_curve::expected_secs(payload_bytes, layers, link),
                })
            })
            .collect();
        super::rank_curve::pick(candidates, policy, |c| {
            (c.expected_secs, c.kl, c.payload_bytes)
        })
    }

    /// The measured rate of `mode` with the lowest KL for consumer `expert`: what a job is
    /// sent at when no rate meets the ceiling.
    pub fn best(&self, mode: Mode, expert: usize) -> Option<(f32, f64)> {
        self.points
            .iter()
            .filter(|p| p.mode == mode)
            .filter_map(|p| Some((p.step, *p.kl.get(expert)?)))
            .filter(|(_, kl)| !kl.is_nan())
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The table's share of raw's bytes for `mode` at `step` for consumer `expert`, where it
    /// measured that rate.
    pub fn share_at(&self, mode: Mode, expert: usize, step: f32) -> Option<f64> {
        self.points
            .iter()
            .find(|p| p.mode == mode && p.step == step)
            .and_then(|p| p.bytes_share.get(expert).copied())
    }

    /// The table's KL for `mode` at `step` for consumer `expert`, where it measured that rate.
    pub fn kl_at(&self, mode: Mode, expert: usize, step: f32) -> Option<f64> {
        self.points
            .iter()
            .find(|p| p.mode == mode && p.step == step)
            .and_then(|p| p.kl.get(expert).copied())
    }
}

impl Translator {
    /// The scales of K's, V's and `H_in`'s steps for consumer `expert`: the rate table's, or
    /// [`DEFAULT_SCALES`] without one.
    pub fn tc_scales(&self, expert: usize) -> [f32; 3] {
        self.manifest
            .rate_table
            .as_ref()
            .and_then(|t| t.scales.get(expert))
            .copied()
            .unwrap_or(DEFAULT_SCALES)
    }
}

/// Measures the table of `translator` for its consumers (`consumers[e]` is its consumer `e`)
/// on held-out `prompts` (each `prefix + 1 + continuation` tokens, from text the fit never
/// saw): the scales, then quality and size at each of `steps` for `reuse` and `scd`.
/// `progress(done, total)` after each measured point.
pub fn measure(
    translator: &Arc<Translator>,
    producer: &Llama,
    consumers: &[&Llama],
    prompts: &[Vec<u32>],
    continuation: usize,
    steps: &[f32],
    mut progress: impl FnMut(usize, usize),
) -> Result<RateTable, TranslatorError> {
    let held = super::rank_curve::held_out(translator, producer, consumers, prompts, continuation)?;
    let search = (K_SCALES.len() + H_SCALES.len()) * SEARCH_STEPS.len();
    let total = consumers.len() * search + 2 * steps.len();
    let mut done = 0;
    let mut scales = Vec::with_capacity(consumers.len());
    for (e, (consumer, per)) in consumers.iter().zip(&held).enumerate() {
        let mut curve_of = |s: [f32; 3]| -> Result<Vec<(f64, f64)>, TranslatorError> {
            let t = with_scales(translator, e, s);
            let mut curve = Vec::with_capacity(SEARCH_STEPS.len());
            for &step in &SEARCH_STEPS {
                curve.push(point(&t, Mode::Scd, e, step, consumer, per)?);
                done += 1;
                progress(done, total);
            }
            Ok(curve)
        };
        let mut k_curves = Vec::with_capacity(K_SCALES.len());
        for &k in &K_SCALES {
            k_curves.push(curve_of([k, 1.0, 1.0])?);
        }
        let k = K_SCALES[lowest(&k_curves)];
        let mut h_curves = Vec::with_capacity(H_SCALES.len());
        for &h in &H_SCALES {
            h_curves.push(curve_of([k, 1.0, h])?);
        }
        scales.push([k, 1.0, H_SCALES[lowest(&h_curves)]]);
    }
    let mut table = RateTable {
        prompts: prompts.len(),
        prefix_tokens: held
            .first()
            .and_then(|p| p.first())
            .map_or(0, |(p, _)| p.prefix.len()),
        continuation,
        scales,
        points: Vec::new(),
    };
    let mut tabled = (**translator).clone();
    tabled.manifest.rate_table = Some(table.clone());
    let tabled = Arc::new(tabled);
    for mode in [Mode::Reuse, Mode::Scd] {
        for &step in steps {
            let (mut kl, mut share) = (Vec::new(), Vec::new());
            for (e, (consumer, per)) in consumers.iter().zip(&held).enumerate() {
                let (b, k) = point(&tabled, mode, e, step, consumer, per)?;
                share.push(b);
                kl.push(k);
            }
            table.points.push(RatePoint {
                mode,
                step,
                kl,
                bytes_share: share,
            });
            done += 1;
            progress(done, total);
        }
    }
    Ok(table)
}

/// `translator` with consumer `expert`'s scales set to `s` (a copy: tensors are shared).
fn with_scales(translator: &Arc<Translator>, expert: usize, s: [f32; 3]) -> Arc<Translator> {
    let mut t = (**translator).clone();
    let consumers = t.manifest.consumers.len();
    let table = t.manifest.rate_table.get_or_insert_with(RateTable::default);
    table.scales.resize(consumers, DEFAULT_SCALES);
    table.scales[expert] = s;
    Arc::new(t)
}

/// (bytes share of raw, mean KL) of `mode` at `step` over the held-out prompts.
fn point(
    translator: &Arc<Translator>,
    mode: Mode,
    expert: usize,
    step: f32,
    consumer: &Llama,
    per: &[super::rank_curve::HeldOut],
) -> Result<(f64, f64), TranslatorError> {
    let codec = Translated::new(
        translator.clone(),
        mode,
        expert,
        translator.manifest.r_max,
        CodeDType::TC,
        None,
    )?
    .with_tc_rate(TcRate { step })?;
    point_of(&codec, translator, consumer, per)
}

/// (bytes share of raw, mean KL) of `codec` over the held-out prompts.
fn point_of(
    codec: &dyn Codec,
    translator: &Translator,
    consumer: &Llama,
    per: &[super::rank_curve::HeldOut],
) -> Result<(f64, f64), TranslatorError> {
    let m = &translator.manifest;
    let (mut kl, mut bytes, mut raw) = (0.0, 0usize, 0usize);
    for (prompt, captured) in per {
        let codes = codec::encode(codec, captured)?;
        bytes += codec::payload_bytes(&codes);
        raw += prompt.prefix.len() * m.kv_dim * 2 * 2 * m.layers;
        let cache = codec::decode(codec, consumer, &codes, codec::Prefix::new(&prompt.prefix))?;
        kl += prompt.kl(consumer, cache)?;
    }
    Ok((
        bytes as f64 / raw.max(1) as f64,
        kl / per.len().max(1) as f64,
    ))
}

/// The `kvtc` mode's K scale and its quality and size at each of `steps`, for a translator
/// with a base basis ([`super::kvtc`]), on the same held-out prompts as [`measure`] and by the
/// same search SCD's codes get (each of [`K_SCALES`] at [`SEARCH_STEPS`], the lowest curve of
/// KL against bytes, KL averaged over the consumers: the basis is one for all of them), so
/// that the baseline is tuned as hard as the method. Returns the scales and the points.
pub fn measure_kvtc(
    translator: &Arc<Translator>,
    producer: &Llama,
    consumers: &[&Llama],
    prompts: &[Vec<u32>],
    continuation: usize,
    steps: &[f32],
    mut progress: impl FnMut(usize, usize),
) -> Result<([f32; 2], Vec<RatePoint>), TranslatorError> {
    if translator.manifest.kvtc.is_none() {
        return Err(TranslatorError::Fit(
            "the translator has no kvtc basis to measure".into(),
        ));
    }
    let held = super::rank_curve::held_out(translator, producer, consumers, prompts, continuation)?;
    let total = (K_SCALES.len() * SEARCH_STEPS.len() + steps.len()) * consumers.len();
    let mut done = 0;
    let mut at = |t: &Arc<Translator>, step: f32| -> Result<RatePoint, TranslatorError> {
        let codec = codec::Kvtc::new(t.clone(), TcRate { step }, PrefillMatmul::best())?;
        let (mut kl, mut share) = (Vec::new(), Vec::new());
        for (consumer, per) in consumers.iter().zip(&held) {
            let (b, k) = point_of(&codec, t, consumer, per)?;
            share.push(b);
            kl.push(k);
            done += 1;
            progress(done, total);
        }
        Ok(RatePoint {
            mode: Mode::Kvtc,
            step,
            kl,
            bytes_share: share,
        })
    };
    let with = |scales: [f32; 2]| {
        let mut t = (**translator).clone();
        if let Some(info) = t.manifest.kvtc.as_mut() {
            info.scales = scales;
        }
        Arc::new(t)
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut curves = Vec::with_capacity(K_SCALES.len());
    for &k in &K_SCALES {
        let t = with([k, 1.0]);
        let mut curve = Vec::with_capacity(SEARCH_STEPS.len());
        for &step in &SEARCH_STEPS {
            let p = at(&t, step)?;
            curve.push((mean(&p.bytes_share), mean(&p.kl)));
        }
        curves.push(curve);
    }
    let scales = [K_SCALES[lowest(&curves)], 1.0];
    let t = with(scales);
    let points = steps
        .iter()
        .map(|&step| at(&t, step))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((scales, points))
}

/// The index of the curve (points of bytes share and KL) that lies lowest: its log KL,
/// interpolated in log bytes, averaged over the bytes every curve reaches (a curve that
/// reaches none of them, or a single curve, decides nothing: the first wins).
fn lowest(curves: &[Vec<(f64, f64)>]) -> usize {
    let span = |c: &Vec<(f64, f64)>| {
        let (lo, hi) = c.iter().fold((f64::INFINITY, 0f64), |(lo, hi), p| {
            (lo.min(p.0), hi.max(p.0))
        });
        (lo, hi)
    };
    let lo = curves.iter().map(|c| span(c).0).fold(0f64, f64::max);
    let hi = curves
        .iter()
        .map(|c| span(c).1)
        .fold(f64::INFINITY, f64::min);
    if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
        return 0;
    }
    let at = |c: &Vec<(f64, f64)>, b: f64| -> f64 {
        let mut pts: Vec<(f64, f64)> = c.iter().map(|p| (p.0.ln(), p.1.max(1e-9).ln())).collect();
        pts.sort_by(|x, y| x.0.total_cmp(&y.0));
        let x = b.ln();
        pts.windows(2)
            .find(|w| w[0].0 <= x && x <= w[1].0)
            .map_or(f64::INFINITY, |w| {
                let f = if w[1].0 > w[0].0 {
                    (x - w[0].0) / (w[1].0 - w[0].0)
                } else {
                    0.0
                };
                w[0].1 + f * (w[1].1 - w[0].1)
            })
    };
    const SAMPLES: usize = 8;
    let score = |c: &Vec<(f64, f64)>| -> f64 {
        (0..SAMPLES)
            .map(|i| {
                let b = (lo.ln() + (hi.ln() - lo.ln()) * i as f64 / (SAMPLES - 1) as f64).exp();
                at(c, b)
            })
            .sum()
    };
    (0..curves.len())
        .min_by(|&a, &b| score(&curves[a]).total_cmp(&score(&curves[b])))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translator::rank_curve::LinkEstimate;
    use crate::translator::RankPolicy;

    #[test]
    fn the_lowest_curve_wins_over_the_bytes_all_reach() {
        // Curve 1 is below curve 0 everywhere they overlap; curve 2 reaches further left but
        // is higher where all three overlap.
        let c0 = vec![(0.10, 0.20), (0.15, 0.08), (0.20, 0.05)];
        let c1 = vec![(0.11, 0.10), (0.16, 0.05), (0.22, 0.03)];
        let c2 = vec![(0.05, 0.50), (0.12, 0.20), (0.21, 0.07)];
        assert_eq!(lowest(&[c0.clone(), c1.clone(), c2.clone()]), 1);
        assert_eq!(lowest(&[c2, c0.clone()]), 1);
        // No common span: the first.
        assert_eq!(lowest(&[c0, vec![(0.5, 0.01), (0.6, 0.005)]]), 0);
        assert_eq!(lowest(&[]), 0);
    }

    #[test]
    fn a_share_of_raw_maps_to_a_step_between_measured_rates() {
        let point = |step: f32, share: f64| RatePoint {
            mode: Mode::Scd,
            step,
            kl: vec![0.0],
            bytes_share: vec![share],
        };
        let table = RateTable {
            points: vec![point(0.2, 0.20), point(0.4, 0.10), point(0.8, 0.05)],
            ..RateTable::default()
        };
        assert_eq!(table.step_for_share(Mode::Scd, 0, 0.10), Some(0.4));
        let s = table.step_for_share(Mode::Scd, 0, 0.15).unwrap();
        assert!((s - 0.2f32 * 2f32.sqrt()).abs() < 1e-4, "{s}");
        assert_eq!(table.step_for_share(Mode::Scd, 0, 0.30), None);
        assert_eq!(table.step_for_share(Mode::Reuse, 0, 0.10), None);
        assert_eq!(table.step_for_share(Mode::Scd, 1, 0.10), None);
    }

    /// A table of one consumer: finer steps cost more bytes and give lower KL.
    fn table() -> RateTable {
        let point = |step: f32, kl: f64, share: f64| RatePoint {
            mode: Mode::Scd,
            step,
            kl: vec![kl],
            bytes_share: vec![share],
        };
        RateTable {
            points: vec![
                point(0.1, 0.02, 0.24),
                point(0.2, 0.04, 0.16),
                point(0.4, 0.09, 0.10),
                point(0.8, 0.40, 0.06),
            ],
            ..RateTable::default()
        }
    }

    #[test]
    fn a_slow_link_gets_the_coarsest_rate_under_the_ceiling_and_a_fast_one_the_best() {
        let t = table();
        let policy = RankPolicy::default();
        let raw = 20_000_000;
        let link = |mbit: f64| LinkEstimate {
            bytes_per_sec: mbit * 1e6 / 8.0,
            prefill_secs: 0.05,
        };
        let slow = t
            .choose(Mode::Scd, 0, raw, 30, &link(50.0), &policy)
            .unwrap();
        assert_eq!(slow.step, 0.4, "{slow:?}");
        assert_eq!(slow.payload_bytes, 2_000_000);
        // On a link that carries even the finest rate within the prefill, the best code.
        let fast = t
            .choose(Mode::Scd, 0, raw, 30, &link(1e6), &policy)
            .unwrap();
        assert_eq!(fast.step, 0.1, "{fast:?}");
        // Over the ceiling nothing is chosen; the best measured rate is the fallback.
        let strict = RankPolicy {
            kl_ceiling: 0.01,
            ..policy
        };
        assert_eq!(t.choose(Mode::Scd, 0, raw, 30, &link(50.0), &strict), None);
        assert_eq!(t.best(Mode::Scd, 0), Some((0.1, 0.02)));
        // Another mode or consumer has no points.
        assert_eq!(
            t.choose(Mode::Reuse, 0, raw, 30, &link(50.0), &policy),
            None
        );
        assert_eq!(t.choose(Mode::Scd, 1, raw, 30, &link(50.0), &policy), None);
        assert_eq!(t.kl_at(Mode::Scd, 0, 0.2), Some(0.04));
        assert_eq!(t.kl_at(Mode::Scd, 0, 0.3), None);
        assert_eq!(t.share_at(Mode::Scd, 0, 0.4), Some(0.10));
        assert_eq!(t.share_at(Mode::Reuse, 0, 0.4), None);
    }
}
