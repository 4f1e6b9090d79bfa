//! Autoregressive generation on token ids: prefill the prompt (or continue from a cache that
//! already holds it), then decode one token at a time with a [`Sampler`] until a stop token or
//! the token budget, handing each new token to a streaming callback.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::cache::KvCache;
use crate::error::GenerateError;
use crate::llama::{Input, Llama, LogitsWanted};
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
    // The prompt's last token goes through the model as the first step, as it does on a
    // consumer that receives the rest as a cache: a decode step runs on the narrow weights and
    // a prefill on f32, so splitting it the same way everywhere gives the same reply locally and
    // after any handover.
    let Some((last, head)) = prompt.split_last() else {
        return Err(GenerateError::EmptyPrompt);
    };
    check_room(model, &cache, prompt, params)?;
    let t = Instant::now();
    if !head.is_empty() {
        model.forward(
            Input::new(head)
                .with_cache(&mut cache)
                .logits(LogitsWanted::None),
        )?;
    }
    let before = t.elapsed();
    let mut g = generate_with_cache(model, &mut cache, &[*last], params, on_token)?;
    g.prefill += before;
    Ok(g)
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
    let prompt = check_room(model, cache, pending, params)?;
    let mut stepper = Stepper::new(params);
    let t0 = Instant::now();
    let out = model.forward(Input::new(pending).with_cache(cache))?;
    let mut logits = last_row(out.logits)?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let stop = loop {
        match stepper.next(&logits) {
            Next::Stop(reason) => break reason,
            Next::Emit(token) => {
                if on_token(token).is_break() {
                    break StopReason::Cancelled;
                }
                if let Some(reason) = stepper.exhausted() {
                    break reason;
                }
                let out = model.forward(Input::new(&[token]).with_cache(cache))?;
                logits = last_row(out.logits)?;
            }
        }
    };
    Ok(Generation {
        tokens: stepper.tokens,
        stop,
        prompt_tokens: prompt,
        prefill,
        decode: t1.elapsed(),
    })
}

/// The context a generation will reach (prompt plus budget) checked against the model's:
/// returns the prompt's length.
pub(crate) fn check_room(
    model: &Llama,
    cache: &KvCache,
    pending: &[u32],
    params: &GenerateParams,
) -> Result<usize, GenerateError> {
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
    Ok(prompt)
}

/// What a generation does with the logits of its last position.
pub(crate) enum Next {
    /// Emit this token, then (unless [`Stepper::exhausted`]) run it through the model.
    Emit(u32),
    /// Stop.
    Stop(StopReason),
}

/// One generation's choices: sampling, stop tokens and the budget, the same whether it decodes
/// alone ([`generate_with_cache`]) or in a [`crate::batch::Batch`].
pub(crate) struct Stepper {
    sampler: Sampler,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
}

impl Stepper {
    pub(crate) fn new(params: &GenerateParams) -> Self {
        Self {
            sampler: Sampler::new(params.sampling, params.seed),
            max_tokens: params.max_tokens,
            stop_tokens: params.stop_tokens.clone(),
            tokens: Vec::new(),
        }
    }

    pub(crate) fn next(&mut self, logits: &[f32]) -> Next {
        if let Some(reason) = self.exhausted() {
            return Next::Stop(reason);
        }
        let next = self.sampler.sample(logits);
        if self.stop_tokens.contains(&next) {
            return Next::Stop(StopReason::StopToken(next));
        }
        self.tokens.push(next);
        Next::Emit(next)
    }

    /// `Some(MaxTokens)` once the budget is spent (no forward pass is needed for the last one).
    pub(crate) fn exhausted(&self) -> Option<StopReason> {
        (self.tokens.len() == self.max_tokens).then_some(StopReason::MaxTokens)
    }
}

fn last_row(logits: Option<candle_core::Tensor>) -> Result<Vec<f32>, GenerateError> {
    let logits = logits.ok_or_else(|| candle_core::Error::Msg("no logits".into()))?;
    Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
}
