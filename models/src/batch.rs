//! Decoding several generations together: one batched forward pass
//! ([`Llama::forward_batch`]) per step for all of them, each with its own model (the base or an
//! expert of it), cache, position and sampling. Decode is bound by streaming the weights, so a
//! consumer serving several jobs gains most of a job's cost back for every job it adds.
//!
//! The batch owns what it decodes: the caller adds generations as their caches are ready,
//! steps, and takes each token and each finished generation from what a step returns. A
//! sequence whose tokens nobody is taking (a slow client) sits out steps without holding up the
//! others. Each sequence's tokens are those [`crate::generate_with_cache`] gives it alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cache::KvCache;
use crate::error::GenerateError;
use crate::generate::{check_room, GenerateParams, Generation, Next, Stepper, StopReason};
use crate::llama::{Llama, Sequence};

/// Generations decoded together.
pub struct Batch<K> {
    active: Vec<Active<K>>,
}

struct Active<K> {
    key: K,
    model: Arc<Llama>,
    cache: KvCache,
    /// What the next step runs through the model: the prompt's pending tokens, then the last
    /// emitted one.
    pending: Vec<u32>,
    stepper: Stepper,
    prompt_tokens: usize,
    /// Its first step's time (the pending prompt tokens) and when that step ended.
    first_step: Option<(Duration, Instant)>,
}

/// What a step produced for one sequence.
#[derive(Debug)]
pub enum Event<K> {
    /// A new token.
    Token(K, u32),
    /// The generation ended (stop token or budget); it has left the batch.
    Done(K, Generation),
}

impl<K> Default for Batch<K> {
    fn default() -> Self {
        Self { active: Vec::new() }
    }
}

impl<K: Clone + PartialEq> Batch<K> {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Generations in the batch.
    pub fn len(&self) -> usize {
        self.active.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    /// The keys of the generations in the batch.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.active.iter().map(|a| &a.key)
    }

    /// Adds a generation of `model` after `pending` tokens (at least the prompt's last) on top
    /// of `cache`, checked as [`crate::generate_with_cache`] checks it. Its first step runs
    /// `pending` through the model.
    pub fn join(
        &mut self,
        key: K,
        model: Arc<Llama>,
        cache: KvCache,
        pending: Vec<u32>,
        params: &GenerateParams,
    ) -> Result<(), GenerateError> {
        let prompt_tokens = check_room(&model, &cache, &pending, params)?;
        self.active.push(Active {
            key,
            model,
            cache,
            pending,
            stepper: Stepper::new(params),
            prompt_tokens,
            first_step: None,
        });
        Ok(())
    }

    /// Ends `key`'s generation early (its caller went away or cancelled it); what it generated
    /// so far, with [`StopReason::Cancelled`].
    pub fn leave(&mut self, key: &K) -> Option<Generation> {
        let i = self.active.iter().position(|a| &a.key == key)?;
        Some(self.active.remove(i).finish(StopReason::Cancelled))
    }

    /// One step of every generation `ready` accepts: one forward pass over all of them, one
    /// token (or the end) each. Tokens come first in the result, then the generations that
    /// ended. On an error the batch's caches may be partly extended: fail its generations.
    pub fn step(&mut self, ready: impl Fn(&K) -> bool) -> Result<Vec<Event<K>>, GenerateError> {
        let chosen: Vec<bool> = self.active.iter().map(|a| ready(&a.key)).collect();
        if !chosen.contains(&true) {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let logits = {
            let mut seqs: Vec<Sequence<'_>> = self
                .active
                .iter_mut()
                .zip(&chosen)
                .filter(|(_, &c)| c)
                .map(|(a, _)| Sequence {
                    model: &a.model,
                    tokens: &a.pending,
                    cache: &mut a.cache,
                })
                .collect();
            Llama::forward_batch(&mut seqs)?
        };
        let rows = logits.to_vec2::<f32>()?;
        let now = Instant::now();
        let mut events = Vec::new();
        let mut ended = vec![None; self.active.len()];
        let picked = self
            .active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| chosen[*i]);
        for ((i, a), row) in picked.zip(&rows) {
            a.first_step.get_or_insert((now - t0, now));
            match a.stepper.next(row) {
                Next::Stop(reason) => ended[i] = Some(reason),
                Next::Emit(token) => {
                    a.pending = vec![token];
                    ended[i] = a.stepper.exhausted();
                    events.push(Event::Token(a.key.clone(), token));
                }
            }
        }
        for (a, end) in std::mem::take(&mut self.active).into_iter().zip(ended) {
            match end {
                Some(reason) => {
                    let key = a.key.clone();
                    events.push(Event::Done(key, a.finish(reason)));
                }
                None => self.active.push(a),
            }
        }
        Ok(events)
    }
}

impl<K> Active<K> {
    fn finish(self, stop: StopReason) -> Generation {
        let (prefill, decode) = match self.first_step {
            Some((took, ended)) => (took, ended.elapsed()),
            None => (Duration::ZERO, Duration::ZERO),
        };
        Generation {
            tokens: self.stepper.tokens,
            stop,
            prompt_tokens: self.prompt_tokens,
            prefill,
            decode,
        }
    }
}
