//! The base model's own basis for the `kvtc` mode: per layer, the principal components of the
//! base's K (before RoPE) and V over calibration prompts, in which [`crate::codec::kvtc`]
//! transform-codes raw KV within the one model (KVTC's recipe: PCA, a step per component,
//! entropy coding) with no translation. It answers the question a reviewer asks of SCD's codes
//! first: does a translated code still win when raw KV is compressed just as hard?
//!
//! The basis depends on the base alone, but lives in the pair's translator, beside the other
//! calibrated things a pair's modes need (DroidSpeak's blocks): a node loads, hash-checks and
//! versions one artifact per pair. `scd translators kvtc` adds it to a translator from the
//! base's prefill of the translator's own fitting prompts.

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::low_rank::{pca, LowRankCode};
use super::moments::Moments;
use super::TranslatorError;
use crate::llama::{Capture, Input, Llama, LogitsWanted};

/// Per-layer bases of K and V.
#[derive(Debug, Clone)]
pub struct KvtcLayer {
    /// K before RoPE: `kv_dim` components by variance, the decoder the encoder's transpose.
    pub k: LowRankCode,
    /// V, as `k`.
    pub v: LowRankCode,
}

/// What the manifest says of the basis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvtcInfo {
    /// Fitting prompts the base's rows came from (the translator's first ones).
    pub prompts: usize,
    /// Rows (tokens) seen.
    pub tokens: u64,
    /// Step scales of K and V: a rate step `s` codes K's components with step `s * scales[0]`
    /// and V's with `s * scales[1]` (the same treatment SCD's codes get from the rate
    /// table's search: see [`Self::DEFAULT_SCALES`]).
    pub scales: [f32; 2],
}

impl KvtcInfo {
    /// K's steps four times V's, as the rate tables' search found for SCD's codes on every
    /// shipped pair: errors in keys move attention less than errors in values move outputs.
    pub const DEFAULT_SCALES: [f32; 2] = [4.0, 1.0];
}

/// Fits the bases from the base's prefill of each of `prompts` (centred, as the translator's
/// codes are), reporting progress per prompt.
pub fn fit(
    base: &Llama,
    prompts: &[Vec<u32>],
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<KvtcLayer>, u64), TranslatorError> {
    let cfg = base.config();
    let (layers, kv) = (cfg.num_layers, cfg.kv_dim());
    if prompts.is_empty() {
        return Err(TranslatorError::Fit(
            "no prompts to fit the kvtc basis on".into(),
        ));
    }
    let mut stats: Vec<(Moments, Moments)> = (0..layers)
        .map(|_| (Moments::new(kv), Moments::new(kv)))
        .collect();
    let mut tokens = 0u64;
    let capture = Capture {
        k_pre_rope: true,
        v: true,
        ..Capture::none()
    };
    for (i, p) in prompts.iter().enumerate() {
        let caps = base
            .forward(
                Input::new(p)
                    .capture(capture.clone())
                    .logits(LogitsWanted::None),
            )?
            .captured;
        for (c, (mk, mv)) in caps.iter().zip(&mut stats) {
            let need = |t: &Option<Tensor>, what: &str| {
                t.clone()
                    .ok_or_else(|| TranslatorError::Fit(format!("capture without {what}")))
            };
            mk.add(&[&need(&c.k_pre_rope, "K")?])?;
            mv.add(&[&need(&c.v, "V")?])?;
        }
        tokens += p.len() as u64;
        progress(i + 1, prompts.len());
    }
    let layers = stats
        .iter()
        .map(|(mk, mv)| {
            Ok(KvtcLayer {
                k: pca(mk, kv, true)?,
                v: pca(mv, kv, true)?,
            })
        })
        .collect::<Result<Vec<_>, TranslatorError>>()?;
    Ok((layers, tokens))
}

/// The tensors of layer `l`'s bases for the artifact (the decoder is the encoder's transpose
/// and is not stored).
pub(crate) fn tensors(
    l: usize,
    layer: &KvtcLayer,
    out: &mut Vec<(String, Tensor)>,
) -> candle_core::Result<()> {
    for (kind, c) in [("k", &layer.k), ("v", &layer.v)] {
        let eig: Vec<f32> = c.eigenvalues.iter().map(|&e| e as f32).collect();
        let n = eig.len();
        out.push((format!("kvtc.{l}.{kind}.mean"), c.mean_a.clone()));
        out.push((format!("kvtc.{l}.{kind}.basis"), c.enc.clone()));
        out.push((
            format!("kvtc.{l}.{kind}.eig"),
            Tensor::from_vec(eig, n, &candle_core::Device::Cpu)?,
        ));
    }
    Ok(())
}

/// Layer `l`'s bases from the artifact's tensors (`take` checks shapes).
pub(crate) fn from_tensors(
    l: usize,
    kv: usize,
    take: &mut impl FnMut(&str, &[usize]) -> Result<Tensor, TranslatorError>,
) -> Result<KvtcLayer, TranslatorError> {
    let mut one = |kind: &str| -> Result<LowRankCode, TranslatorError> {
        let mean = take(&format!("kvtc.{l}.{kind}.mean"), &[kv])?;
        let basis = take(&format!("kvtc.{l}.{kind}.basis"), &[kv, kv])?;
        let eigenvalues = take(&format!("kvtc.{l}.{kind}.eig"), &[kv])?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f64::from)
            .collect();
        Ok(LowRankCode {
            mean_a: mean.clone(),
            decs: vec![basis.t()?.contiguous()?],
            enc: basis,
            means_b: vec![mean],
            eigenvalues,
        })
    };
    Ok(KvtcLayer {
        k: one("k")?,
        v: one("v")?,
    })
}
