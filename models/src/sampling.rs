//! Choosing the next token from logits: greedy, or temperature + nucleus (top-p) sampling from a
//! seeded generator, so that a seed fixes the output.

use rand::{Rng, SeedableRng};

use crate::error::GenerateError;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token.
    Greedy,
    /// Sample from the smallest set of most likely tokens whose probability reaches `top_p`,
    /// after dividing the logits by `temperature`.
    TopP {
        /// Softmax temperature, > 0.
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
    },
}

impl Sampling {
    /// Greedy when `temperature` is 0, nucleus sampling otherwise; checks the ranges.
    pub fn from_params(temperature: f32, top_p: f32) -> Result<Self, GenerateError> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(GenerateError::Sampling(format!(
                "temperature must be >= 0, got {temperature}"
            )));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(GenerateError::Sampling(format!(
                "top_p must be in (0, 1], got {top_p}"
            )));
        }
        Ok(if temperature == 0.0 {
            Self::Greedy
        } else {
            Self::TopP { temperature, top_p }
        })
    }
}

/// A sampler with its own generator state.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    /// A sampler seeded with `seed`.
    pub fn new(sampling: Sampling, seed: u64) -> Self {
        Self {
            sampling,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// The next token for `logits` (one vocabulary row).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::TopP { temperature, top_p } => {
                let candidates = nucleus(logits, temperature, top_p);
                let total: f32 = candidates.iter().map(|c| c.1).sum();
                let mut r = self.rng.gen::<f32>() * total;
                for &(id, p) in &candidates {
                    if r < p {
                        return id;
                    }
                    r -= p;
                }
                candidates.last().map_or(0, |c| c.0)
            }
        }
    }
}

/// Index of the largest logit (the first on ties; NaNs never win).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// The tokens nucleus sampling may pick, most likely first, with their (unnormalised within the
/// nucleus) probabilities: the smallest prefix of the sorted distribution at `temperature` whose
/// mass reaches `top_p`.
pub fn nucleus(logits: &[f32], temperature: f32, top_p: f32) -> Vec<(u32, f32)> {
    let t = temperature.max(f32::MIN_POSITIVE);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
        .collect();
    let z: f32 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut kept = Vec::new();
    let mut mass = 0.0;
    for (id, p) in probs {
        let p = p / z;
        kept.push((id, p));
        mass += p;
        if mass >= top_p {
            break;
        }
    }
    kept
}
