//! A fine-tuning run in memory and its optimisation step.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{TrainConfig, TrainError};
use crate::boundary::Boundary;
use crate::corpus::{random_window, CorpusError};
use crate::llama::{Input, Llama, LogitsWanted, Proj};
use crate::lora::{AdapterMode, LoraAdapter};
use crate::optim::{self, AdamW, AdamWConfig, Moments};

/// Tokenised training data: the train split as one stream and fixed validation windows.
#[derive(Debug, Clone)]
pub struct TrainData {
    /// The train split's tokens.
    pub train: Vec<u32>,
    /// Validation windows, each scored on every position after the first.
    pub valid: Vec<Vec<u32>>,
}

/// What one optimisation step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Steps done, this one included.
    pub step: usize,
    /// Mean next-token cross-entropy over the batch (nats).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step, seconds.
    pub seconds: f64,
    /// Training tokens per second of this step.
    pub tokens_per_s: f64,
}

/// A fine-tuning run in memory: the trainable adapter (or boundary tokens), the model that
/// applies it on the fly, the optimiser and the losses so far.
#[derive(Debug)]
pub struct Trainer {
    pub(super) cfg: TrainConfig,
    pub(super) model: Llama,
    pub(super) params: Params,
    pub(super) opt: AdamW,
    pub(super) losses: Vec<f64>,
    pub(super) train_seconds: f64,
}

/// What a run trains.
#[derive(Debug)]
pub(super) enum Params {
    /// `(layer, projection) -> (A, B)`; the optimiser's parameter order is this map's order,
    /// A before B.
    Lora(BTreeMap<(usize, Proj), (Var, Var)>),
    /// KV-Packet boundary tokens, header then trailer; `live` holds the variables' own
    /// tensors, so that documents compiled with it record gradients for them.
    Boundary {
        header: Var,
        trailer: Var,
        live: Boundary,
    },
}

impl Params {
    /// Each parameter with its name in checkpoints, in the optimiser's order.
    pub(super) fn named(&self) -> Vec<(String, &Var)> {
        match self {
            Self::Lora(vars) => vars
                .iter()
                .flat_map(|(&(layer, proj), (a, b))| {
                    [
                        (lora_key(layer, proj, "A"), a),
                        (lora_key(layer, proj, "B"), b),
                    ]
                })
                .collect(),
            Self::Boundary {
                header, trailer, ..
            } => vec![("header".into(), header), ("trailer".into(), trailer)],
        }
    }
}

/// A LoRA matrix's name in checkpoints.
pub(super) fn lora_key(layer: usize, proj: Proj, which: &str) -> String {
    format!("{layer}.{}.{which}", proj.hf_name())
}

/// The seed of step `step`'s window generator: splitmix64 of the run seed and the step, so
/// nearby steps get unrelated streams.
pub(crate) fn step_seed(seed: u64, step: usize) -> u64 {
    let mut z = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Trainer {
    /// A fresh run: an adapter on the configured projections of every layer (`A` random from
    /// the seed, `B` zero), or boundary tokens ([`Boundary::init`]) for `base` to compile
    /// with, and a fresh optimiser.
    pub fn new(base: &Llama, cfg: TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        if let Some((header, trailer)) = cfg.boundary {
            let init = Boundary::init(base, header, trailer, cfg.seed)?;
            return Self::from_boundary(
                base,
                cfg,
                (init.header(), init.trailer()),
                None,
                Vec::new(),
                0.0,
            );
        }
        let init = LoraAdapter::init(base.config(), cfg.rank, cfg.alpha, &cfg.targets, cfg.seed)?;
        let mut parts = BTreeMap::new();
        for key in init.targets().filter(|&(layer, _)| cfg.adapts_layer(layer)) {
            if let Some((a, b)) = init.get(key.0, key.1) {
                parts.insert(key, (a.clone(), b.clone()));
            }
        }
        Self::from_parts(base, cfg, parts, None, Vec::new(), 0.0)
    }

    /// A run that goes on training `adapter` (trained before, perhaps on other data) with a
    /// fresh optimiser and schedule. It must adapt exactly the projections and layers `cfg`
    /// names, at `cfg`'s rank and alpha: anything else would train another adapter than the
    /// one the manifest describes.
    pub fn from_adapter(
        base: &Llama,
        cfg: TrainConfig,
        adapter: &LoraAdapter,
    ) -> Result<Self, TrainError> {
        cfg.validate()?;
        if cfg.boundary.is_some() {
            return Err(TrainError::Config(
                "boundary tokens do not start from an adapter".into(),
            ));
        }
        if adapter.rank() != cfg.rank || adapter.alpha() != cfg.alpha {
            return Err(TrainError::Config(format!(
                "the adapter to continue has rank {} and alpha {}, the run rank {} and alpha {}",
                adapter.rank(),
                adapter.alpha(),
                cfg.rank,
                cfg.alpha
            )));
        }
        let wanted: BTreeSet<(usize, Proj)> = (0..base.config().num_layers)
            .filter(|&layer| cfg.adapts_layer(layer))
            .flat_map(|layer| cfg.targets.iter().map(move |&p| (layer, p)))
            .collect();
        let have: BTreeSet<(usize, Proj)> = adapter.targets().collect();
        if have != wanted {
            return Err(TrainError::Config(format!(
                "the adapter to continue adapts {} projections, the run's --targets {} (same layers and projections needed)",
                have.len(),
                wanted.len()
            )));
        }
        let mut parts = BTreeMap::new();
        for key in wanted {
            if let Some((a, b)) = adapter.get(key.0, key.1) {
                parts.insert(key, (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?));
            }
        }
        Self::from_parts(base, cfg, parts, None, Vec::new(), 0.0)
    }

    /// A run from adapter matrices and, when resuming, the optimiser's moments and step.
    pub(super) fn from_parts(
        base: &Llama,
        cfg: TrainConfig,
        parts: BTreeMap<(usize, Proj), (Tensor, Tensor)>,
        saved: Option<(Vec<Moments>, usize)>,
        losses: Vec<f64>,
        train_seconds: f64,
    ) -> Result<Self, TrainError> {
        let mut vars = BTreeMap::new();
        for (key, (a, b)) in parts {
            vars.insert(
                key,
                (Var::from_tensor(&a.copy()?)?, Var::from_tensor(&b.copy()?)?),
            );
        }
        let live = LoraAdapter::from_parts(
            base.config(),
            cfg.rank,
            cfg.alpha,
            vars.iter()
                .map(|(&k, (a, b))| (k, (a.as_tensor().clone(), b.as_tensor().clone())))
                .collect(),
        )?
        .with_rope_theta(cfg.rope_theta)?;
        // On the fly, the model holds the Vars' own tensors: updating a Var updates the model,
        // and its forward pass records gradients for them.
        let mut model = base.with_adapter(&live, AdapterMode::OnTheFly)?;
        // Training multiplies in f32 throughout: rows without gradients yet (the first
        // layer's base products) would otherwise go to the AMX tiles in bf16.
        model.set_prefill_matmul(crate::PrefillMatmul::F32);
        Self::assemble(cfg, model, Params::Lora(vars), saved, losses, train_seconds)
    }

    /// A boundary-token run from the tokens `(header, trailer)` for `base` to compile with.
    pub(super) fn from_boundary(
        base: &Llama,
        cfg: TrainConfig,
        (header, trailer): (&Tensor, &Tensor),
        saved: Option<(Vec<Moments>, usize)>,
        losses: Vec<f64>,
        train_seconds: f64,
    ) -> Result<Self, TrainError> {
        let header = Var::from_tensor(&header.copy()?)?;
        let trailer = Var::from_tensor(&trailer.copy()?)?;
        let live = Boundary::new(
            header.as_tensor().clone(),
            trailer.as_tensor().clone(),
            base,
        )?;
        let mut model = base.clone();
        model.set_prefill_matmul(crate::PrefillMatmul::F32);
        let params = Params::Boundary {
            header,
            trailer,
            live,
        };
        Self::assemble(cfg, model, params, saved, losses, train_seconds)
    }

    fn assemble(
        cfg: TrainConfig,
        model: Llama,
        params: Params,
        saved: Option<(Vec<Moments>, usize)>,
        losses: Vec<f64>,
        train_seconds: f64,
    ) -> Result<Self, TrainError> {
        let vars: Vec<Var> = params.named().into_iter().map(|(_, v)| v.clone()).collect();
        let opt_cfg = AdamWConfig {
            weight_decay: cfg.weight_decay,
            ..AdamWConfig::default()
        };
        let opt = match saved {
            Some((moments, step)) => AdamW::restore(vars, opt_cfg, moments, step)?,
            None => AdamW::new(vars, opt_cfg)?,
        };
        Ok(Self {
            cfg,
            model,
            params,
            opt,
            losses,
            train_seconds,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// Steps done.
    pub fn step(&self) -> usize {
        self.opt.steps()
    }

    /// Training loss of every step done.
    pub fn losses(&self) -> &[f64] {
        &self.losses
    }

    /// Seconds spent in optimisation steps (across resumes).
    pub fn train_seconds(&self) -> f64 {
        self.train_seconds
    }

    /// The model with the current adapter applied on the fly (for boundary tokens, the model
    /// that compiles with them, unchanged).
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The boundary tokens being trained, as live variables; `None` for an adapter's run.
    pub fn boundary(&self) -> Option<&Boundary> {
        match &self.params {
            Params::Boundary { live, .. } => Some(live),
            Params::Lora(_) => None,
        }
    }

    /// A copy of the current adapter (f32, or rounded to `dtype` for shipping).
    pub fn adapter(&self, base: &Llama, dtype: DType) -> Result<LoraAdapter, TrainError> {
        let Params::Lora(vars) = &self.params else {
            return Err(TrainError::Config(
                "a boundary-token run has no adapter".into(),
            ));
        };
        let mut parts = BTreeMap::new();
        for (&k, (a, b)) in vars {
            parts.insert(
                k,
                (
                    a.as_tensor().detach().to_dtype(dtype)?,
                    b.as_tensor().detach().to_dtype(dtype)?,
                ),
            );
        }
        Ok(
            LoraAdapter::from_parts(base.config(), self.cfg.rank, self.cfg.alpha, parts)?
                .with_rope_theta(self.cfg.rope_theta)?,
        )
    }

    /// Logits `(T, vocab)` of `tokens` at positions `0..T`, with gradients for the adapter.
    pub fn train_logits(&self, tokens: &[u32]) -> Result<Tensor, TrainError> {
        let out = self
            .model
            .forward(Input::new(tokens).logits(LogitsWanted::All))?;
        out.logits
            .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()).into())
    }

    /// The trainable parameters in the optimiser's order: per adapted `(layer, projection)`,
    /// `A` then `B` (boundary tokens: header, then trailer).
    pub fn params(&self) -> &[Var] {
        self.opt.params()
    }

    /// Adds the gradients that `store` holds for the parameters to `grads` (in
    /// [`Trainer::params`] order): objectives that run several backward passes per step sum
    /// them this way.
    pub fn accumulate(
        &self,
        grads: &mut [Option<Tensor>],
        store: &candle_core::backprop::GradStore,
    ) -> Result<(), TrainError> {
        for (slot, var) in grads.iter_mut().zip(self.opt.params()) {
            if let Some(g) = store.get(var.as_tensor()) {
                *slot = Some(match slot.take() {
                    None => g.clone(),
                    Some(acc) => (acc + g)?,
                });
            }
        }
        Ok(())
    }

    /// One optimisation step on `objective`: its gradients for this step, clipped, then AdamW
    /// at the step's learning rate.
    pub fn train_step(&mut self, objective: &impl Objective) -> Result<StepReport, TrainError> {
        let t0 = Instant::now();
        let step = self.step();
        let StepGrads {
            mut grads,
            loss,
            tokens,
        } = objective.gradients(self, step)?;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step: step + 1 });
        }
        let grad_norm = optim::global_norm(&grads)?;
        if let Some(c) = self.cfg.clip_norm.filter(|&c| grad_norm > c) {
            for g in grads.iter_mut().flatten() {
                *g = (&*g * (c / grad_norm))?;
            }
        }
        let lr = self.cfg.lr_at(step);
        self.opt.step(&grads, lr)?;
        self.losses.push(loss);
        let seconds = t0.elapsed().as_secs_f64();
        self.train_seconds += seconds;
        Ok(StepReport {
            step: self.step(),
            loss,
            lr,
            grad_norm,
            seconds,
            tokens_per_s: tokens as f64 / seconds.max(1e-9),
        })
    }
}

/// What one step's objective hands the optimiser.
#[derive(Debug)]
pub struct StepGrads {
    /// The gradient of the step's loss per parameter, in [`Trainer::params`] order (`None`: no
    /// gradient reached it).
    pub grads: Vec<Option<Tensor>>,
    /// The step's loss (the mean over its examples).
    pub loss: f64,
    /// Tokens the step trained on (for the rate it reports).
    pub tokens: usize,
}

/// What a run minimises. Step `step`'s examples must follow from the step alone (seeded), so
/// that a resumed run equals one never stopped.
pub trait Objective {
    /// The loss of step `step` and its gradients for `trainer`'s parameters.
    fn gradients(&self, trainer: &Trainer, step: usize) -> Result<StepGrads, TrainError>;
}

/// Next-token cross-entropy on `batch` random windows of the train split: the fine-tuning of
/// an expert.
impl Objective for TrainData {
    fn gradients(&self, trainer: &Trainer, step: usize) -> Result<StepGrads, TrainError> {
        let (seq, batch) = (trainer.cfg.seq_len, trainer.cfg.batch);
        if self.train.len() < seq + 1 {
            return Err(CorpusError::TooShort {
                split: "train",
                tokens: self.train.len(),
                needed: seq + 1,
            }
            .into());
        }
        let mut rng = StdRng::seed_from_u64(step_seed(trainer.cfg.seed, step));
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|_| random_window(&self.train, seq + 1, &mut rng))
            .collect();
        let mut grads: Vec<Option<Tensor>> = vec![None; trainer.params().len()];
        let mut loss_sum = 0.0;
        // One backward per window keeps one window's graph alive at a time; gradients add up.
        for w in &windows {
            let logits = trainer.train_logits(&w[..seq])?;
            let targets = Tensor::new(&w[1..], &Device::Cpu)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &targets)?;
            loss_sum += f64::from(loss.to_scalar::<f32>()?);
            let store = (loss / batch as f64)?.backward()?;
            trainer.accumulate(&mut grads, &store)?;
        }
        Ok(StepGrads {
            grads,
            loss: loss_sum / batch as f64,
            tokens: seq * batch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_differ() {
        assert_ne!(step_seed(0, 0), step_seed(0, 1));
        assert_ne!(step_seed(0, 1), step_seed(1, 1));
        assert_eq!(step_seed(7, 3), step_seed(7, 3));
    }
}
