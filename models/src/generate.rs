//! Autoregressive generation on token ids: prefill the prompt (or continue from a cache that
//! already holds it), then decode one token at a time with a [`Sampler`] until a stop token or
//! the token budget, handing each new token to a streaming callback.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::cache::KvCache;
use crate::error::GenerateError;
use crate::llama::{Input, Llama};
use crate::sampling::{Sampler, Sampling};

/// What to generate and when to stop.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// At most this many new tokens (stop token excluded).
    pub max_tokens: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Seed of the sampler's generator.
    pub seed: u64,
    /// Tokens that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was produced.
    StopToken(u32),
    /// `max_tokens` were produced.
    MaxTokens,
    /// The callback asked to stop.
    Cancelled,
}

/// The result of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The new tokens, without the stop token.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop: StopReason,
    /// Tokens in the context before the first new one.
    pub prompt_tokens: usize,
    /// Time of the forward pass over the pending prompt tokens.
    pub prefill: Duration,
    /// Time of the decode steps.
    pub decode: Duration,
}

/// Generates a continuation of `prompt` with a fresh cache.
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, GenerateError> {
    let mut cache = model.new_cache();
    generate_with_cache(model, &mut cache, prompt, params, on_token)
}

/// Generates after `pending` tokens placed on top of `cache` (which may hold an injected prefix:
/// the consumer path). `pending` must hold at least the prompt's last token.
pub fn generate_with_cache(
    model: &Llama,
    cache: &mut KvCache,
    pending: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, GenerateError> {
    if pending.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let context = model.config().context_length;
    let prompt = cache.next_position() + pending.len();
    if prompt > context {
        return Err(GenerateError::PromptTooLong { prompt, context });
    }
    if prompt + params.max_tokens > context {
        return Err(GenerateError::ExceedsContext {
            prompt,
            max_tokens: params.max_tokens,
            context,
        });
    }
    let mut sampler = Sampler::new(params.sampling, params.seed);
    let t0 = Instant::now();
    let out = model.forward(Input::new(pending).with_cache(cache))?;
    let mut logits = last_row(out.logits)?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let stop = loop {
        if tokens.len() == params.max_tokens {
            break StopReason::MaxTokens;
        }
        let next = sampler.sample(&logits);
        if params.stop_tokens.contains(&next) {
            break StopReason::StopToken(next);
        }
        tokens.push(next);
        if on_token(next).is_break() {
            break StopReason::Cancelled;
        }
        if tokens.len() == params.max_tokens {
            break StopReason::MaxTokens;
        }
        let out = model.forward(Input::new(&[next]).with_cache(cache))?;
        logits = last_row(out.logits)?;
    };
    Ok(Generation {
        tokens,
        stop,
        prompt_tokens: prompt,
        prefill,
        decode: t1.elapsed(),
    })
}

fn last_row(logits: Option<candle_core::Tensor>) -> Result<Vec<f32>, GenerateError> {
    let logits = logits.ok_or_else(|| candle_core::Error::Msg("no logits".into()))?;
    Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
}
