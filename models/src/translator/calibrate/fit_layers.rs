//! Step 3 of a calibration: the codes of K, V and `H_in` per layer, and the Patch aligners.

use candle_core::{Device, Tensor};

use super::capture::LayerStats;
use super::{CalibrateEvent, Setup};
use crate::translator::aligner::{self, Aligner, AlignerConfig, AlignerReport};
use crate::translator::low_rank::{fit, FitOptions, LowRankCode};
use crate::translator::TranslatorError;

/// What step 3 fits, per layer.
pub(super) struct Fitted {
    /// The Reuse code of K.
    pub(super) k_codes: Vec<LowRankCode>,
    /// The Reuse code of V.
    pub(super) v_codes: Vec<LowRankCode>,
    /// The code of `H_in` (Patch).
    pub(super) h_codes: Vec<LowRankCode>,
    /// The Patch aligner of each consumer.
    pub(super) aligners: Vec<Vec<Aligner>>,
    /// How each aligner's training went.
    pub(super) reports: Vec<Vec<AlignerReport>>,
}

/// Fits, for each layer of `stats`, the codes of K and V (at `r_max`'s K and V ranks) and of
/// `H_in` (at its H rank) with the configured centring and ridge, and trains the aligner of
/// each consumer on the sampled `H_in` rows (its last tenth held out for early stopping).
///
/// Returns the codes and aligners, and drops the sampled rows from `stats` (only the moments
/// are read after this). Notes each aligner's held-out error; reports progress per layer.
pub(super) fn fit_layers(
    setup: &Setup<'_>,
    stats: &mut [LayerStats],
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<Fitted, TranslatorError> {
    let (cfg, layers, kv, hidden, m) = (setup.cfg, setup.layers, setup.kv, setup.hidden, setup.m);
    let r = cfg.r_max;
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
    let mut aligners: Vec<Vec<Aligner>> = Vec::with_capacity(layers);
    let mut aligner_reports: Vec<Vec<AlignerReport>> = Vec::with_capacity(layers);
    for (l, st) in stats.iter().enumerate() {
        k_codes.push(fit(&st.k, &widths_kv, opts(r.k))?);
        v_codes.push(fit(&st.v, &widths_kv, opts(r.v))?);
        let h = fit(&st.h, &widths_h, opts(r.h))?;
        let n = st.h_rows[0].len() / hidden;
        let ha = Tensor::from_slice(&st.h_rows[0], (n, hidden), &Device::Cpu)?;
        let mut layer_aligners = Vec::with_capacity(m);
        let mut reports = Vec::with_capacity(m);
        for (e, (name, _)) in setup.consumers.iter().enumerate() {
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
    // The sampled rows are not needed after this; the moments are (step 4's sweep of centring
    // and ridge refits them).
    for st in stats.iter_mut() {
        st.h_rows = Vec::new();
    }
    Ok(Fitted {
        k_codes,
        v_codes,
        h_codes,
        aligners,
        reports: aligner_reports,
    })
}
