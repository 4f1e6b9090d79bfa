//! The hyperparameters of a fine-tuning run and its learning-rate schedule.

use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::llama::Proj;

/// Learning-rate decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Half a cosine from the peak to zero at the last step.
    Cosine,
    /// A straight line from the peak to zero at the last step.
    Linear,
    /// The peak until the end.
    Constant,
}

/// Hyperparameters of a fine-tuning run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// LoRA rank.
    pub rank: usize,
    /// LoRA alpha (the adapter's term is scaled by `alpha / rank`).
    pub alpha: f64,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps from zero to the peak.
    pub warmup: usize,
    /// Decay after warm-up.
    pub schedule: Schedule,
    /// Optimisation steps.
    pub steps: usize,
    /// Tokens per training window (the model predicts each from the ones before).
    pub seq_len: usize,
    /// Windows per step.
    pub batch: usize,
    /// Seed of the adapter's initialisation and of the window choice.
    pub seed: u64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; `None` disables clipping.
    pub clip_norm: Option<f64>,
    /// Validation windows (of `seq_len` tokens, spread over the validation split).
    pub valid_windows: usize,
    /// The projections the adapter edits, in every layer (runs written before this field
    /// existed adapted all seven).
    #[serde(default = "all_projections")]
    pub targets: Vec<Proj>,
    /// The layers the adapter edits, ascending; `None` for every layer. An edit of the first
    /// layers reaches every later layer's K and V through the residual stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<usize>>,
    /// The expert's own RoPE base, trained into it (`None`: the base model's). A long-context
    /// fine-tune raises it; the expert then reads a cache rotated with the base's frequencies
    /// wrongly, which is how the paper's MistralLite breaks raw KV transfer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Train KV-Packet boundary tokens (header, trailer) instead of an adapter
    /// ([`crate::boundary`]); the LoRA fields are then unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<(usize, usize)>,
}

fn all_projections() -> Vec<Proj> {
    Proj::ALL.to_vec()
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            lr: 2e-4,
            warmup: 20,
            schedule: Schedule::Cosine,
            steps: 300,
            seq_len: 256,
            batch: 4,
            seed: 0,
            weight_decay: 0.0,
            clip_norm: Some(1.0),
            valid_windows: 16,
            targets: all_projections(),
            layers: None,
            rope_theta: None,
            boundary: None,
        }
    }
}

impl TrainConfig {
    /// Refuses hyperparameters that cannot train.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: &str| Err(TrainError::Config(m.into()));
        if self.rank == 0 || self.seq_len < 2 || self.batch == 0 || self.steps == 0 {
            return bad("rank, seq-len (>= 2), batch and steps must be positive");
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && self.alpha.is_finite()) {
            return bad("lr must be positive and alpha finite");
        }
        if self.clip_norm.is_some_and(|c| c.is_nan() || c <= 0.0) {
            return bad("clip norm must be positive");
        }
        if self.targets.is_empty() {
            return bad("the adapter needs at least one target projection");
        }
        if self.layers.as_ref().is_some_and(Vec::is_empty) {
            return bad("the adapter needs at least one layer");
        }
        if self.rope_theta.is_some_and(|t| !(t.is_finite() && t > 1.0)) {
            return bad("rope theta must be a finite number above 1");
        }
        if self.boundary == Some((0, 0)) {
            return bad("boundary tokens need at least one header or trailer token");
        }
        Ok(())
    }

    /// Whether the adapter edits `layer`.
    pub fn adapts_layer(&self, layer: usize) -> bool {
        self.layers.as_ref().is_none_or(|l| l.contains(&layer))
    }

    /// The learning rate of step `step` (0-based).
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Linear => self.lr * (1.0 - progress),
            Schedule::Cosine => self.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        let cfg = TrainConfig {
            lr: 1.0,
            warmup: 4,
            steps: 14,
            ..TrainConfig::default()
        };
        assert!((cfg.lr_at(0) - 0.25).abs() < 1e-12);
        assert!((cfg.lr_at(3) - 1.0).abs() < 1e-12);
        assert!((cfg.lr_at(4) - 1.0).abs() < 1e-12);
        assert!((cfg.lr_at(9) - 0.5).abs() < 1e-12);
        assert!(cfg.lr_at(14) < 1e-12);
        let lin = TrainConfig {
            schedule: Schedule::Linear,
            ..cfg.clone()
        };
        assert!((lin.lr_at(9) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn nonsense_is_refused() {
        for cfg in [
            TrainConfig {
                rank: 0,
                ..TrainConfig::default()
            },
            TrainConfig {
                lr: f64::NAN,
                ..TrainConfig::default()
            },
            TrainConfig {
                clip_norm: Some(0.0),
                ..TrainConfig::default()
            },
        ] {
            assert!(matches!(cfg.validate(), Err(TrainError::Config(_))));
        }
    }
}
