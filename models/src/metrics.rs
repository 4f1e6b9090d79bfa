//! Quality metrics shared by every evaluation: distribution distances between a method's
//! next-token distribution and the oracle's, perplexity, and extractive-QA scores with the
//! standard SQuAD normalisation.
//!
//! Everything here works on plain slices so that it can score logits from any source (a
//! candle tensor copied to the host, a reference file) and is computed in f64: KL over a
//! 49,152-word vocabulary sums many tiny terms, and f32 accumulation loses them.

use std::collections::HashMap;

/// Log-softmax of `logits`, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&x| f64::from(x) - log_z).collect()
}

/// KL(p || q) in nats and the total-variation distance between the distributions given by two
/// logit vectors, from one log-softmax of each (the harness wants both at every position).
///
/// `p` is the reference (the oracle), `q` the method under test: KL is large where the method
/// gives little mass to tokens the oracle finds likely; TV is half the L1 distance, in [0, 1].
pub fn distances(p_logits: &[f32], q_logits: &[f32]) -> (f64, f64) {
    assert_eq!(
        p_logits.len(),
        q_logits.len(),
        "logit vectors of different vocabularies"
    );
    let lp = log_softmax(p_logits);
    let lq = log_softmax(q_logits);
    let (mut kl, mut l1) = (0f64, 0f64);
    for (&a, &b) in lp.iter().zip(&lq) {
        let (p, q) = (a.exp(), b.exp());
        if p > 0.0 {
            kl += p * (a - b);
        }
        l1 += (p - q).abs();
    }
    (kl.max(0.0), 0.5 * l1)
}

/// KL(p || q) in nats; see [`distances`].
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    distances(p_logits, q_logits).0
}

/// Total-variation distance; see [`distances`].
pub fn total_variation(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    distances(p_logits, q_logits).1
}

/// Negative log-likelihood (nats) of `target` under the distribution given by `logits`
/// (infinite for a target outside the vocabulary: it has probability zero). The one per-position
/// routine behind every perplexity in the project.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let Some(&x) = logits.get(target as usize) else {
        return f64::INFINITY;
    };
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let sum: f64 = logits.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    max + sum.ln() - f64::from(x)
}

/// Perplexity from per-token negative log-likelihoods: `exp(mean(nll))`.
/// Returns `None` for an empty slice, where perplexity is undefined.
pub fn perplexity(nlls: &[f64]) -> Option<f64> {
    if nlls.is_empty() {
        return None;
    }
    Some((nlls.iter().sum::<f64>() / nlls.len() as f64).exp())
}

/// Share of positions where two token sequences agree, over the length of the reference.
/// Positions past the end of the shorter sequence count as disagreements.
pub fn agreement(reference: &[u32], candidate: &[u32]) -> f64 {
    if reference.is_empty() {
        return if candidate.is_empty() { 1.0 } else { 0.0 };
    }
    let same = reference
        .iter()
        .zip(candidate)
        .filter(|(a, b)| a == b)
        .count();
    same as f64 / reference.len().max(candidate.len()) as f64
}

/// The SQuAD answer normalisation: lower case, drop ASCII punctuation, drop the articles
/// "a", "an", "the" as whole words, and collapse white space.
pub fn squad_normalize(text: &str) -> String {
    let lowered = text.to_lowercase();
    let no_punct: String = lowered
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// SQuAD exact match of a prediction against the best of several gold answers (0.0 or 1.0).
pub fn squad_exact_match(prediction: &str, golds: &[&str]) -> f64 {
    let p = squad_normalize(prediction);
    if golds.iter().any(|g| squad_normalize(g) == p) {
        1.0
    } else {
        0.0
    }
}

/// Whether a prediction holds one of the gold answers whole (normalised as for
/// [`squad_exact_match`], on word boundaries): 0.0 or 1.0. What a needle-in-a-haystack test
/// asks (was the fact retrieved?), where a model that answers in a sentence scores 0 on exact
/// match and a capped F1 however right it is.
pub fn squad_contains(prediction: &str, golds: &[&str]) -> f64 {
    let p = format!(" {} ", squad_normalize(prediction));
    let hit = golds.iter().any(|g| {
        let g = squad_normalize(g);
        !g.is_empty() && p.contains(&format!(" {g} "))
    });
    if hit {
        1.0
    } else {
        0.0
    }
}

/// SQuAD token F1 of a prediction against the best of several gold answers.
pub fn squad_f1(prediction: &str, golds: &[&str]) -> f64 {
    golds
        .iter()
        .map(|g| token_f1(&squad_normalize(prediction), &squad_normalize(g)))
        .fold(0.0, f64::max)
}

fn token_f1(prediction: &str, gold: &str) -> f64 {
    let p: Vec<&str> = prediction.split_whitespace().collect();
    let g: Vec<&str> = gold.split_whitespace().collect();
    if p.is_empty() || g.is_empty() {
        // SQuAD's rule: two empty answers agree fully, one empty answer not at all.
        return if p.is_empty() && g.is_empty() {
            1.0
        } else {
            0.0
        };
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for w in &g {
        *counts.entry(w).or_default() += 1;
    }
    let mut common = 0usize;
    for w in &p {
        if let Some(c) = counts.get_mut(w) {
            if *c > 0 {
                *c -= 1;
                common += 1;
            }
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / p.len() as f64;
    let recall = common as f64 / g.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_and_tv_are_zero_for_equal_distributions_and_shift_invariant() {
        let p = [1.0f32, 2.0, -3.0, 0.5];
        let shifted: Vec<f32> = p.iter().map(|x| x + 7.0).collect();
        assert!(kl_divergence(&p, &shifted).abs() < 1e-12);
        assert!(total_variation(&p, &shifted).abs() < 1e-12);
    }

    #[test]
    fn kl_matches_hand_computation() {
        // p = (0.5, 0.5), q = (0.25, 0.75) given as log-probabilities.
        let p = [0.5f32.ln(), 0.5f32.ln()];
        let q = [0.25f32.ln(), 0.75f32.ln()];
        let expected = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((kl_divergence(&p, &q) - expected).abs() < 1e-6);
        assert!((total_variation(&p, &q) - 0.25).abs() < 1e-6);
        // KL is not symmetric; TV is.
        assert!((kl_divergence(&q, &p) - expected).abs() > 1e-3);
        assert!((total_variation(&q, &p) - 0.25).abs() < 1e-6);
    }

    #[test]
    fn tv_of_disjoint_peaks_is_nearly_one() {
        let p = [100.0f32, 0.0, 0.0];
        let q = [0.0f32, 100.0, 0.0];
        assert!(total_variation(&p, &q) > 0.999);
        assert!(kl_divergence(&p, &q) > 90.0);
    }

    #[test]
    fn perplexity_of_uniform_guess_is_vocabulary_size() {
        let logits = [0.0f32; 8];
        let nlls: Vec<f64> = (0..8).map(|t| nll(&logits, t)).collect();
        assert!((perplexity(&nlls).unwrap() - 8.0).abs() < 1e-9);
        assert_eq!(perplexity(&[]), None);
    }

    #[test]
    fn agreement_counts_matching_positions() {
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 2, 9, 4]), 0.75);
        assert_eq!(agreement(&[1, 2, 3, 4], &[1, 2]), 0.5);
        assert_eq!(agreement(&[1, 2], &[1, 2, 3, 4]), 0.5);
        assert_eq!(agreement(&[], &[]), 1.0);
    }

    #[test]
    fn squad_normalisation_follows_the_official_script() {
        assert_eq!(squad_normalize("The  Eiffel Tower!"), "eiffel tower");
        assert_eq!(squad_normalize("an apple, a pear"), "apple pear");
        // Articles inside words stay.
        assert_eq!(squad_normalize("Theatre Anatomy"), "theatre anatomy");
        assert_eq!(squad_normalize("1,000"), "1000");
    }

    #[test]
    fn squad_scores_take_the_best_gold_answer() {
        let golds = ["Denver Broncos", "the Broncos"];
        assert_eq!(squad_exact_match("broncos", &golds), 1.0);
        assert_eq!(squad_exact_match("Denver", &golds), 0.0);
        // "Denver" against "denver broncos": precision 1, recall 1/2.
        assert!((squad_f1("Denver", &golds) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(squad_f1("Carolina Panthers", &golds), 0.0);
        assert_eq!(squad_f1("", &[""]), 1.0);
        assert_eq!(squad_f1("x", &[""]), 0.0);
        // Held whole, on word boundaries.
        let number = ["482913"];
        assert_eq!(squad_contains("The secret number is 482913.", &number), 1.0);
        assert_eq!(squad_contains("It is 4829130.", &number), 0.0);
        assert_eq!(squad_contains("They were the Broncos!", &golds), 1.0);
        assert_eq!(squad_contains("Denver", &golds), 0.0);
        assert_eq!(squad_contains("anything", &[""]), 0.0);
    }
}
