//! AdamW with decoupled weight decay, over candle [`Var`]s, with its state in the open.
//!
//! Ours rather than candle-nn's `AdamW`: training here must stop and resume bit for bit
//! (checkpoints hold the adapter, both moments and the step), and candle-nn keeps its moments
//! private with no way to read or restore them. It also takes gradients the caller has already
//! accumulated over several windows and clipped by the global norm, which candle-nn's
//! `backward_step` (one loss, no clipping) does not allow. Fine-tuning, the Patch aligner and the
//! SemPIC writer all train through this one optimiser.

use candle_core::{Tensor, Var};

/// Hyperparameters of [`AdamW`]; the learning rate is given per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay (multiplies the learning rate).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The two moments of one parameter.
#[derive(Debug, Clone)]
pub struct Moments {
    /// First moment (mean of gradients).
    pub m: Tensor,
    /// Second moment (mean of squared gradients).
    pub v: Tensor,
}

/// An AdamW optimiser over a fixed list of parameters.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    params: Vec<Var>,
    moments: Vec<Moments>,
    steps: usize,
}

/// The state given to [`AdamW::restore`] does not fit the parameters.
#[derive(Debug, thiserror::Error)]
#[error("optimiser state does not fit: {0}")]
pub struct StateMismatch(String);

impl AdamW {
    /// A fresh optimiser: zero moments, no step taken.
    pub fn new(params: Vec<Var>, cfg: AdamWConfig) -> candle_core::Result<Self> {
        let moments = params
            .iter()
            .map(|p| {
                Ok(Moments {
                    m: p.as_tensor().zeros_like()?,
                    v: p.as_tensor().zeros_like()?,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            cfg,
            params,
            moments,
            steps: 0,
        })
    }

    /// An optimiser that continues from saved moments after `steps` steps.
    pub fn restore(
        params: Vec<Var>,
        cfg: AdamWConfig,
        moments: Vec<Moments>,
        steps: usize,
    ) -> Result<Self, StateMismatch> {
        if moments.len() != params.len() {
            return Err(StateMismatch(format!(
                "{} moments for {} parameters",
                moments.len(),
                params.len()
            )));
        }
        for (i, (p, m)) in params.iter().zip(&moments).enumerate() {
            if m.m.dims() != p.as_tensor().dims() || m.v.dims() != p.as_tensor().dims() {
                return Err(StateMismatch(format!(
                    "parameter {i} is {:?}, its moments {:?} / {:?}",
                    p.as_tensor().dims(),
                    m.m.dims(),
                    m.v.dims()
                )));
            }
        }
        Ok(Self {
            cfg,
            params,
            moments,
            steps,
        })
    }

    /// The parameters, in order.
    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// The moments, in parameter order.
    pub fn moments(&self) -> &[Moments] {
        &self.moments
    }

    /// Steps taken.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// One update with learning rate `lr`. `grads[i]` is parameter `i`'s gradient (already
    /// accumulated and clipped); a parameter without one (`None`, e.g. LoRA's `A` while `B` is
    /// still zero) still decays and keeps its moments moving, as if its gradient were zero.
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> candle_core::Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!(
                "{} gradients for {} parameters",
                grads.len(),
                self.params.len()
            );
        }
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let t = (self.steps + 1) as i32;
        let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
        for ((var, mom), g) in self.params.iter().zip(&mut self.moments).zip(grads) {
            let g = match g {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like()?,
            };
            mom.m = ((&mom.m * beta1)? + (&g * (1.0 - beta1))?)?;
            mom.v = ((&mom.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let update = ((&mom.m / c1)? / ((&mom.v / c2)?.sqrt()? + eps)?)?;
            let theta = var.as_tensor().detach();
            var.set(&((theta * (1.0 - lr * weight_decay))? - (update * lr)?)?)?;
        }
        self.steps += 1;
        Ok(())
    }
}

/// The L2 norm of all gradients together.
pub fn global_norm(grads: &[Option<Tensor>]) -> candle_core::Result<f64> {
    let mut sq = 0.0f64;
    for g in grads.iter().flatten() {
        sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
    }
    Ok(sq.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two steps on a two-element parameter, against the update rule worked out by hand:
    /// m_t = b1 m + (1-b1) g, v_t = b2 v + (1-b2) g^2, m^ = m_t / (1-b1^t), v^ = v_t / (1-b2^t),
    /// theta <- theta (1 - lr wd) - lr m^ / (sqrt(v^) + eps).
    #[test]
    fn two_steps_match_a_hand_calculation() {
        let var = Var::from_vec(vec![1.0f32, -2.0], 2, &Device::Cpu).unwrap();
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(vec![var.clone()], cfg).unwrap();
        let (lr, g1, g2) = (0.01f64, [0.5f64, -3.0], [0.25f64, 1.0]);
        let grad =
            |g: [f64; 2]| Some(Tensor::new(&[g[0] as f32, g[1] as f32], &Device::Cpu).unwrap());
        opt.step(&[grad(g1)], lr).unwrap();
        // By hand: at step 1 the bias-corrected moments are g and g^2, so each element moves by
        // lr * sign(g) after decaying by lr * wd: 1 * 0.999 - 0.01 and -2 * 0.999 + 0.01.
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        assert!(
            (got[0] - 0.989).abs() < 1e-6 && (got[1] + 1.988).abs() < 1e-6,
            "{got:?}"
        );
        opt.step(&[grad(g2)], lr).unwrap();

        let mut want = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for (t, g) in [(1, g1), (2, g2)] {
            for i in 0..2 {
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                want[i] = want[i] * (1.0 - lr * 0.1) - lr * mh / (vh.sqrt() + 1e-8);
            }
        }
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        for i in 0..2 {
            assert!(
                (f64::from(got[i]) - want[i]).abs() < 1e-6,
                "{got:?} vs {want:?}"
            );
        }
        assert_eq!(opt.steps(), 2);
    }

    #[test]
    fn restore_checks_the_state_and_a_missing_gradient_still_decays() {
        let var = Var::from_vec(vec![2.0f32], 1, &Device::Cpu).unwrap();
        let bad = vec![Moments {
            m: Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
            v: Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
        }];
        assert!(AdamW::restore(vec![var.clone()], AdamWConfig::default(), bad, 1).is_err());
        let cfg = AdamWConfig {
            weight_decay: 0.5,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(vec![var.clone()], cfg).unwrap();
        opt.step(&[None], 0.1).unwrap();
        let got = var.as_tensor().to_vec1::<f32>().unwrap()[0];
        assert!((got - 2.0 * 0.95).abs() < 1e-6, "{got}");
    }
}
