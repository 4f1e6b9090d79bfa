//! Measuring transfer quality on held-out calibration prompts, and the greedy choices made with
//! it: which layers Patch rebuilds, which layer blocks DroidSpeak recomputes.
//!
//! Quality is the mean KL(oracle || consumer) over teacher-forced continuation tokens, the
//! consumer continuing from a cache rebuilt one way or another; the oracle is the consumer's
//! own prefill. A choice adds, one step at a time, the candidate that lowers that KL most, and
//! records the whole curve so the trade-off stays visible.

use serde::{Deserialize, Serialize};

use super::TranslatorError;
use crate::cache::KvCache;
use crate::codec::{Oracle, Prefix};
use crate::llama::Llama;
use crate::metrics;
use crate::perplexity::continuation_logits;

/// One held-out prompt: a prefix whose cache is transferred, its last token and the
/// continuation that is scored, with the oracle's logits over it.
#[derive(Debug, Clone)]
pub struct HeldOutPrompt {
    /// The transferred prefix.
    pub prefix: Vec<u32>,
    /// The prompt's last token (the consumer's first own forward step).
    pub last: u32,
    /// Scored continuation.
    pub continuation: Vec<u32>,
    /// The oracle's logits, one row per continuation token.
    pub oracle: Vec<Vec<f32>>,
}

impl HeldOutPrompt {
    /// A held-out prompt for `consumer`: `tokens` split into prefix, last token and
    /// `continuation` tokens.
    pub fn new(
        consumer: &Llama,
        tokens: &[u32],
        continuation: usize,
    ) -> Result<Self, TranslatorError> {
        if tokens.len() < continuation + 2 {
            return Err(TranslatorError::Fit("held-out prompt too short".into()));
        }
        let split = tokens.len() - continuation;
        let prefix = tokens[..split - 1].to_vec();
        let (last, cont) = (tokens[split - 1], tokens[split..].to_vec());
        let cache = crate::codec::decode(&Oracle, consumer, &[], Prefix::new(&prefix))?;
        let oracle = continuation_logits(consumer, cache, last, &cont)?;
        Ok(Self {
            prefix,
            last,
            continuation: cont,
            oracle,
        })
    }

    /// Mean KL(oracle || consumer from `cache`) over the continuation.
    pub fn kl(&self, consumer: &Llama, cache: KvCache) -> Result<f64, TranslatorError> {
        let rows = continuation_logits(consumer, cache, self.last, &self.continuation)?;
        let total: f64 = self
            .oracle
            .iter()
            .zip(&rows)
            .map(|(p, q)| metrics::kl_divergence(p, q))
            .sum();
        Ok(total / rows.len().max(1) as f64)
    }
}

/// One point of a greedy curve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Candidates chosen so far, in the order chosen.
    pub chosen: Vec<usize>,
    /// Held-out KL with them.
    pub kl: f64,
}

/// Greedy forward selection: starting from nothing, adds at each step the candidate (among
/// `0..candidates` that `compatible` allows next to the chosen ones) whose addition gives the
/// lowest `kl`, up to `max_steps` steps. Returns the curve, the empty set first.
///
/// The first step scores every candidate alone; later steps try only the `shortlist` best of
/// those (all of them when `None`). Each score is a full held-out evaluation, and candidates
/// that do nothing alone rarely start to help next to others, so this keeps calibration to
/// minutes (30 layers x 8 steps would be ~220 evaluations, a shortlist of 6 makes it ~70).
pub fn greedy(
    candidates: usize,
    max_steps: usize,
    shortlist: Option<usize>,
    compatible: impl Fn(&[usize], usize) -> bool,
    mut kl: impl FnMut(&[usize]) -> Result<f64, TranslatorError>,
    mut progress: impl FnMut(&CurvePoint),
) -> Result<Vec<CurvePoint>, TranslatorError> {
    let mut chosen: Vec<usize> = Vec::new();
    let first = CurvePoint {
        chosen: Vec::new(),
        kl: kl(&[])?,
    };
    progress(&first);
    let mut curve = vec![first];
    let mut pool: Vec<usize> = (0..candidates).collect();
    for step in 0..max_steps {
        let mut scored: Vec<(usize, f64)> = Vec::new();
        for &c in &pool {
            if chosen.contains(&c) || !compatible(&chosen, c) {
                continue;
            }
            let mut trial = chosen.clone();
            trial.push(c);
            scored.push((c, kl(&trial)?));
        }
        let Some(&(c, v)) = scored.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
            break;
        };
        if step == 0 {
            if let Some(n) = shortlist {
                scored.sort_by(|a, b| a.1.total_cmp(&b.1));
                pool = scored.iter().take(n.max(1)).map(|&(c, _)| c).collect();
            }
        }
        chosen.push(c);
        let point = CurvePoint {
            chosen: chosen.clone(),
            kl: v,
        };
        progress(&point);
        curve.push(point);
    }
    Ok(curve)
}

/// The number of steps to keep from a greedy curve: the smallest `k` after which no further
/// step would add at least `min_share` of the whole improvement the curve achieves (its best
/// KL against the empty set's). A curve that never improves keeps nothing.
pub fn knee(curve: &[CurvePoint], min_share: f64) -> usize {
    let Some(start) = curve.first().map(|p| p.kl) else {
        return 0;
    };
    let best = curve.iter().map(|p| p.kl).fold(start, f64::min);
    let total = start - best;
    if total <= 0.0 {
        return 0;
    }
    let mut k = 0;
    for (i, w) in curve.windows(2).enumerate() {
        if w[0].kl - w[1].kl >= min_share * total {
            k = i + 1;
        }
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_best_candidate_each_step_and_respects_compatibility() {
        // KL falls by the candidate's gain; candidates 1 and 2 exclude each other.
        let gains = [0.1, 0.5, 0.4, 0.05];
        let kl = |set: &[usize]| Ok(1.0 - set.iter().map(|&c| gains[c]).sum::<f64>());
        let compatible = |chosen: &[usize], c: usize| {
            !(chosen.contains(&1) && c == 2 || chosen.contains(&2) && c == 1)
        };
        let curve = greedy(4, 3, None, compatible, kl, |_| {}).unwrap();
        let chosen: Vec<Vec<usize>> = curve.iter().map(|p| p.chosen.clone()).collect();
        assert_eq!(chosen, vec![vec![], vec![1], vec![1, 0], vec![1, 0, 3]]);
        assert!((curve[3].kl - 0.35).abs() < 1e-12);
        // Steps 1 and 2 bring 0.5 and 0.1 of a 0.65 improvement; step 3 only 0.05.
        assert_eq!(knee(&curve, 0.1), 2);
        assert_eq!(knee(&curve, 0.5), 1);
        assert_eq!(knee(&curve[..1], 0.1), 0);
    }

    #[test]
    fn greedy_with_a_shortlist_tries_only_the_best_single_candidates_after_the_first_step() {
        let gains = [0.1, 0.5, 0.4, 0.05];
        let mut tried = Vec::new();
        let kl = |set: &[usize]| {
            tried.push(set.to_vec());
            Ok(1.0 - set.iter().map(|&c| gains[c]).sum::<f64>())
        };
        let curve = greedy(4, 3, Some(2), |_, _| true, kl, |_| {}).unwrap();
        let chosen: Vec<Vec<usize>> = curve.iter().map(|p| p.chosen.clone()).collect();
        // The shortlist is {1, 2}: after both are in, nothing is left to try.
        assert_eq!(chosen, vec![vec![], vec![1], vec![1, 2]]);
        // Empty set, four singles, then only [1, 2].
        assert_eq!(tried.len(), 1 + 4 + 1);
    }
}
