//! Step 5 of a calibration: the translator with its manifest, and its quality at a grid of
//! ranks.

use std::sync::Arc;

use serde_json::json;

use super::capture::LayerStats;
use super::fit_layers::Fitted;
use super::heldout::{Baseline, DroidSpeakBlocks, PatchLayers};
use super::{CalibrateEvent, CalibrationText, PhaseClock, Setup};
use crate::llama::Llama;
use crate::translator::artifact::{
    CalibrationInfo, ConsumerRef, LayerTranslator, ModelRef, PatchLayer, Translator,
    TranslatorManifest, WeightsDtype, FORMAT,
};
use crate::translator::low_rank::LowRankCode;
use crate::translator::moments::Moments;
use crate::translator::rank_curve::{self, RankCurve};
use crate::translator::TranslatorError;
use scd_types::{CodeDType, Mode};

/// What step 4 measured and chose.
pub(super) struct Choices {
    pub(super) baseline: Baseline,
    pub(super) patch: PatchLayers,
    pub(super) droidspeak: DroidSpeakBlocks,
    /// The centring / ridge comparison.
    pub(super) sweep: Vec<serde_json::Value>,
}

/// How much calibration data was read.
pub(super) struct Counts {
    /// Fitting prompts.
    pub(super) prefixes: usize,
    /// Held-out prompts.
    pub(super) heldout: usize,
    /// Tokens of the fitting prompts.
    pub(super) tokens: u64,
}

/// The translator: per layer the codes of K and V, and for the layers of the Patch curve the
/// code of `H_in` with its aligners; a manifest naming the models, the calibration data, the
/// choices, and the measurements (the held-out KLs and curves, the centring / ridge
/// comparison, the aligners' errors, the variance each K and V code keeps, the phases' times
/// on `clock` so far). No rank curve yet.
pub(super) fn assemble(
    setup: &Setup<'_>,
    text: &CalibrationText<'_>,
    counts: Counts,
    stats: &[LayerStats],
    fitted: Fitted,
    choices: Choices,
    clock: &PhaseClock,
) -> Translator {
    let (cfg, layers, kv, hidden) = (setup.cfg, setup.layers, setup.kv, setup.hidden);
    let dr = cfg.default_ranks;
    let Fitted {
        k_codes,
        v_codes,
        h_codes,
        aligners,
        reports: aligner_reports,
    } = fitted;
    let Choices {
        baseline:
            Baseline {
                kl_raw,
                kl_reuse,
                by_kind,
            },
        patch:
            PatchLayers {
                curve: patch_curve,
                knee: k,
                layers: patch_layers,
                order: patch_order,
            },
        droidspeak:
            DroidSpeakBlocks {
                curve: ds_curve,
                blocks: droidspeak_blocks,
            },
        sweep,
    } = choices;
    let payload_share = |patch: usize| {
        let reuse_values = (layers - patch) * (dr.k + dr.v);
        let patch_values = patch * dr.h;
        (reuse_values + patch_values) as f64 / (layers * 2 * kv) as f64
    };
    let metrics = json!({
        "heldout_prompts": counts.heldout,
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
        "phase_seconds": clock.phase_seconds(),
        "aligners": aligner_reports.iter().enumerate().map(|(l, reps)| json!({
            "layer": l,
            "linear_mse": reps.iter().map(|r| r.linear_mse).collect::<Vec<_>>(),
            "mse": reps.iter().map(|r| r.mse).collect::<Vec<_>>(),
            "epochs": reps.iter().map(|r| r.epochs).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "k_explained": explained(&k_codes, dr.k, &stats.iter().map(|st| &st.k).collect::<Vec<_>>()),
        "v_explained": explained(&v_codes, dr.v, &stats.iter().map(|st| &st.v).collect::<Vec<_>>()),
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
        producer: ModelRef::of(setup.producer),
        consumers: setup
            .consumers
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
            prefixes: counts.prefixes,
            heldout: counts.heldout,
            prefix_tokens: cfg.prefix_tokens,
            tokens: counts.tokens,
            seconds: clock.total_seconds(),
            chat_share: cfg.chat.as_ref().map_or(0.0, |c| c.share),
        },
        metrics,
        weights_dtype: WeightsDtype::F32,
        rank_curve: None,
        rate_table: None,
        kvtc: None,
    };
    Translator {
        manifest,
        layers: layers_out,
        kvtc: None,
    }
}

/// The held-out quality of `translator` at each `(K, V)` ranks of `grid`, in Reuse and SCD
/// with f16 codes, on the same held-out prompts the choices used ([`rank_curve::measure`]).
/// Reports progress.
pub(super) fn measure_rank_curve(
    setup: &Setup<'_>,
    translator: &Arc<Translator>,
    held_prompts: &[Vec<u32>],
    grid: &[(usize, usize)],
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<RankCurve, TranslatorError> {
    let models: Vec<&Llama> = setup.consumers.iter().map(|(_, c)| *c).collect();
    rank_curve::measure(
        translator,
        setup.producer,
        &models,
        held_prompts,
        setup.cfg.heldout_continuation,
        grid,
        &[Mode::Reuse, Mode::Scd],
        CodeDType::F16,
        |done, total| on_event(&CalibrateEvent::Progress { done, total }),
    )
}

/// `translator` with its rank `curve`, and its manifest's phase times and calibration time
/// brought up to date from `clock` (they now include the curve's measurement).
pub(super) fn with_rank_curve(
    translator: Arc<Translator>,
    curve: RankCurve,
    clock: &PhaseClock,
) -> Translator {
    let mut translator = Arc::try_unwrap(translator).unwrap_or_else(|shared| (*shared).clone());
    translator.manifest.rank_curve = Some(curve);
    if let Some(phases) = translator.manifest.metrics.get_mut("phase_seconds") {
        *phases = json!(clock.phase_seconds());
    }
    translator.manifest.calibration.seconds = clock.total_seconds();
    translator
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
