//! Scoring a model on fixed token windows: the mean next-token negative log-likelihood and its
//! perplexity. One routine behind fine-tuning validation, the drift report and the evaluation
//! harness; per position it is [`crate::metrics::nll`].

use candle_core::Tensor;

use crate::cache::KvCache;
use crate::error::ForwardError;
use crate::llama::{Input, Llama, LogitsWanted};
use crate::metrics;

/// Mean NLL over the positions scored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NllScore {
    /// Mean negative log-likelihood, nats per token.
    pub mean_nll: f64,
    /// Positions scored.
    pub tokens: usize,
}

impl NllScore {
    /// `exp(mean NLL)`.
    pub fn perplexity(&self) -> f64 {
        self.mean_nll.exp()
    }
}

/// Rows of a `(T, vocab)` logits tensor as host vectors.
pub fn logit_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>, ForwardError> {
    Ok(logits.to_vec2::<f32>()?)
}

/// Logits `(T - 1, vocab)` of `model` over `window[..T - 1]` (row `i` predicts `window[i + 1]`).
pub fn window_logits(model: &Llama, window: &[u32]) -> Result<Vec<Vec<f32>>, ForwardError> {
    let input = &window[..window.len().saturating_sub(1)];
    let out = model.forward(Input::new(input).logits(LogitsWanted::All))?;
    let logits = out
        .logits
        .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()))?;
    logit_rows(&logits)
}

/// Teacher-forced logits of `model` over `continuation` after `cache`, which holds a prompt
/// without its last token `last`: row `i` predicts `continuation[i]`. The evaluation harness and
/// the calibration's held-out measurements both score transferred caches through it.
pub fn continuation_logits(
    model: &Llama,
    mut cache: KvCache,
    last: u32,
    continuation: &[u32],
) -> Result<Vec<Vec<f32>>, ForwardError> {
    let mut input = vec![last];
    input.extend_from_slice(&continuation[..continuation.len().saturating_sub(1)]);
    let out = model.forward(
        Input::new(&input)
            .with_cache(&mut cache)
            .logits(LogitsWanted::All),
    )?;
    let logits = out
        .logits
        .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()))?;
    logit_rows(&logits)
}

/// Scores every position after the first of each window; windows shorter than two tokens are
/// skipped. `None` when nothing was scored.
pub fn score_windows(
    model: &Llama,
    windows: &[Vec<u32>],
) -> Result<Option<NllScore>, ForwardError> {
    let (mut total, mut n) = (0.0, 0usize);
    for w in windows.iter().filter(|w| w.len() >= 2) {
        for (i, row) in window_logits(model, w)?.iter().enumerate() {
            total += metrics::nll(row, w[i + 1]);
            n += 1;
        }
    }
    Ok((n > 0).then(|| NllScore {
        mean_nll: total / n as f64,
        tokens: n,
    }))
}
