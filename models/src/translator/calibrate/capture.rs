//! Step 2 of a calibration: every model's prefill over the fitting prompts, into per-layer
//! moments and a sample of `H_in` rows.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::{CalibrateEvent, Setup};
use crate::llama::{Capture, Input, LayerCapture, Llama, LogitsWanted};
use crate::translator::moments::Moments;
use crate::translator::TranslatorError;

/// Per-layer state of the fitting pass.
pub(super) struct LayerStats {
    pub(super) k: Moments,
    pub(super) v: Moments,
    pub(super) h: Moments,
    /// Sampled `H_in` rows: producer, then each consumer.
    pub(super) h_rows: Vec<Vec<f32>>,
}

/// Runs every model's prefill over each of `fit_prompts` and adds K (before RoPE), V and
/// `H_in` of every layer to that layer's moments (the producer's columns first, then each
/// consumer's), keeping `cfg.aligner_rows` rows of `H_in` in all, drawn evenly over the
/// prompts with `rng` (the generator the prompts were drawn with).
///
/// Returns the per-layer statistics and the number of tokens seen; reports progress per
/// prompt.
pub(super) fn capture_moments(
    setup: &Setup<'_>,
    fit_prompts: &[Vec<u32>],
    rng: &mut StdRng,
    on_event: &mut impl FnMut(&CalibrateEvent),
) -> Result<(Vec<LayerStats>, u64), TranslatorError> {
    let (cfg, kv, hidden, m) = (setup.cfg, setup.kv, setup.hidden, setup.m);
    let per_prompt = cfg
        .aligner_rows
        .div_ceil(fit_prompts.len())
        .min(cfg.prefix_tokens);
    let mut stats: Vec<LayerStats> = (0..setup.layers)
        .map(|_| LayerStats {
            k: Moments::new(kv * (m + 1)),
            v: Moments::new(kv * (m + 1)),
            h: Moments::new(hidden * (m + 1)),
            h_rows: vec![Vec::new(); m + 1],
        })
        .collect();
    let mut tokens_seen = 0u64;
    for (i, prompt) in fit_prompts.iter().enumerate() {
        let mut caps = vec![capture_all(setup.producer, prompt)?];
        for (_, c) in setup.consumers {
            caps.push(capture_all(c, prompt)?);
        }
        let mut rows: Vec<u32> = (0..prompt.len() as u32).collect();
        rows.shuffle(rng);
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
    Ok((stats, tokens_seen))
}

/// `model`'s prefill over `tokens`, capturing K before RoPE, V, `H_in` and the hidden state
/// entering every layer.
pub(super) fn capture_all(
    model: &Llama,
    tokens: &[u32],
) -> Result<Vec<LayerCapture>, TranslatorError> {
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

/// The captured tensor, or an error naming `what` the capture lacks.
pub(super) fn need<'a>(t: &'a Option<Tensor>, what: &str) -> Result<&'a Tensor, TranslatorError> {
    t.as_ref()
        .ok_or_else(|| TranslatorError::Fit(format!("capture without {what}")))
}
