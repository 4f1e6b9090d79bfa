//! Uncertainty of the quality figures: a point estimate with a bootstrap 95% interval.
//!
//! The unit of resampling is what was drawn independently: a QA question, a WikiText window
//! (positions inside one window are correlated, so they are not resampled one by one). The
//! interval is the percentile interval of the mean over 2,000 resamples from a fixed seed, so
//! records stay deterministic.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Resamples per interval.
pub const RESAMPLES: usize = 2000;

/// A mean over units with its bootstrap 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The mean over all units.
    #[serde(deserialize_with = "nan_if_null")]
    pub value: f64,
    /// 2.5th percentile of the resampled means.
    #[serde(deserialize_with = "nan_if_null")]
    pub low: f64,
    /// 97.5th percentile of the resampled means.
    #[serde(deserialize_with = "nan_if_null")]
    pub high: f64,
    /// Units the mean is over.
    pub n: usize,
}

/// JSON has no NaN: an estimate over no units is written as `null`, and read back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Estimate {
    /// No units: every field NaN (or zero).
    pub fn empty() -> Self {
        Self {
            value: f64::NAN,
            low: f64::NAN,
            high: f64::NAN,
            n: 0,
        }
    }

    /// `f` applied to the value and both ends (a monotone map such as `exp` or a scale).
    pub fn map(self, f: impl Fn(f64) -> f64) -> Self {
        Self {
            value: f(self.value),
            low: f(self.low),
            high: f(self.high),
            n: self.n,
        }
    }

    /// `value [low, high]` with `digits` decimals.
    pub fn display(&self, digits: usize) -> String {
        if self.value.is_nan() {
            return "n/a".into();
        }
        format!(
            "{:.d$} [{:.d$}, {:.d$}]",
            self.value,
            self.low,
            self.high,
            d = digits
        )
    }
}

/// The mean of `units` with its percentile bootstrap interval, resampled from `seed`.
pub fn bootstrap_mean(units: &[f64], seed: u64) -> Estimate {
    if units.is_empty() {
        return Estimate::empty();
    }
    let n = units.len();
    let value = units.iter().sum::<f64>() / n as f64;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut means: Vec<f64> = (0..RESAMPLES)
        .map(|_| (0..n).map(|_| units[rng.gen_range(0..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Estimate {
        value,
        low: at(0.025),
        high: at(0.975),
        n,
    }
}

/// A ratio of sums (e.g. NLL summed over positions / positions) over units, resampling units:
/// `units[i] = (numerator_i, denominator_i)`.
pub fn bootstrap_ratio(units: &[(f64, f64)], seed: u64) -> Estimate {
    let total: f64 = units.iter().map(|u| u.1).sum();
    if units.is_empty() || total <= 0.0 {
        return Estimate::empty();
    }
    let n = units.len();
    let value = units.iter().map(|u| u.0).sum::<f64>() / total;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ratios: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let (mut a, mut b) = (0.0, 0.0);
            for _ in 0..n {
                let u = units[rng.gen_range(0..n)];
                a += u.0;
                b += u.1;
            }
            a / b
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Estimate {
        value,
        low: at(0.025),
        high: at(0.975),
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_estimate_reads_back_from_its_json() {
        let text = serde_json::to_string(&Estimate::empty()).unwrap();
        assert!(text.contains("null"), "{text}");
        let back: Estimate = serde_json::from_str(&text).unwrap();
        assert!(back.value.is_nan() && back.low.is_nan() && back.high.is_nan());
        let full = bootstrap_mean(&[1.0, 2.0, 4.0], 3);
        let back: Estimate = serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn interval_brackets_the_mean_and_shrinks_with_more_units() {
        let small: Vec<f64> = (0..20).map(|i| (i % 5) as f64).collect();
        let large: Vec<f64> = (0..2000).map(|i| (i % 5) as f64).collect();
        let (s, l) = (bootstrap_mean(&small, 1), bootstrap_mean(&large, 1));
        assert_eq!((s.value, l.value), (2.0, 2.0));
        assert!(s.low < 2.0 && s.high > 2.0);
        assert!(l.high - l.low < (s.high - s.low) / 5.0);
        // The standard error of the mean of 2,000 draws from {0..4} is ~0.032: the 95%
        // interval is ~ +-0.062.
        assert!((l.high - l.low - 0.124).abs() < 0.03, "{l:?}");
        assert_eq!(bootstrap_mean(&small, 1), s, "seeded: deterministic");
        assert_eq!(bootstrap_mean(&[3.0; 7], 9).low, 3.0);
        assert!(bootstrap_mean(&[], 0).value.is_nan());
    }

    #[test]
    fn ratio_weights_units_by_their_denominator() {
        let units = [(1.0, 1.0), (9.0, 3.0)];
        let e = bootstrap_ratio(&units, 0);
        assert_eq!(e.value, 2.5);
        assert!(e.low >= 1.0 && e.high <= 3.0);
        assert_eq!(e.map(|x| x * 2.0).value, 5.0);
    }
}
