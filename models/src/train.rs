//! LoRA fine-tuning of a frozen base: the experts that SCD serves are the base plus an adapter
//! trained here.
//!
//! Read top-down: the configuration ([`TrainConfig`]), the trainer (one optimisation step:
//! random windows of the tokenised train split, next-token cross-entropy through the model's
//! differentiable forward with the adapter applied on the fly, AdamW), checkpoints (written
//! atomically, resumable bit for bit), the training loop with its stop flag, and validation.
//!
//! Determinism: the windows of step `s` come from a generator seeded by `(seed, s)`, so the
//! only state a checkpoint needs beyond the adapter and the optimiser's moments is the step;
//! resuming from a checkpoint gives the same adapter as never stopping.
//!
//! Only the adapter's `A`/`B` matrices are [`Var`]s; the base weights are plain tensors, so the
//! optimiser never touches them, and the training forward (`train/forward.rs`) multiplies by
//! them through a custom op whose backward computes no gradient for them at all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::corpus::{random_window, CorpusError};
use crate::error::{AdapterError, ForwardError};
use crate::llama::{Input, Llama, LogitsWanted, Proj};
use crate::lora::{AdapterMode, LoraAdapter};

mod forward;

/// Errors of fine-tuning.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// Building or saving the adapter failed.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// The corpus is unusable.
    #[error(transparent)]
    Corpus(#[from] CorpusError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A checkpoint that cannot be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Hyperparameters that make no sense.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The loss became NaN or infinite.
    #[error("loss is not finite at step {step} (try a lower learning rate)")]
    Diverged {
        /// The step.
        step: usize,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

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
        }
    }
}

impl TrainConfig {
    fn validate(&self) -> Result<(), TrainError> {
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
        Ok(())
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

/// AdamW moments of one parameter.
#[derive(Debug)]
struct Moments {
    m: Tensor,
    v: Tensor,
}

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;

/// A fine-tuning run in memory: the trainable adapter, the model that applies it on the fly,
/// the optimiser's moments and the step counter.
#[derive(Debug)]
pub struct Trainer {
    cfg: TrainConfig,
    model: Llama,
    /// `(layer, projection) -> (A, B)`; parameter order is this map's order, A before B.
    vars: BTreeMap<(usize, Proj), (Var, Var)>,
    moments: Vec<Moments>,
    step: usize,
    losses: Vec<f64>,
    train_seconds: f64,
}

/// The seed of step `step`'s window generator: splitmix64 of the run seed and the step, so
/// nearby steps get unrelated streams.
fn step_seed(seed: u64, step: usize) -> u64 {
    let mut z = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Trainer {
    /// A fresh run: an adapter on every projection of every layer (`A` random from the seed,
    /// `B` zero) and zero moments.
    pub fn new(base: &Llama, cfg: TrainConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        let init = LoraAdapter::init(base.config(), cfg.rank, cfg.alpha, &Proj::ALL, cfg.seed)?;
        let mut parts = BTreeMap::new();
        for key in init.targets() {
            if let Some((a, b)) = init.get(key.0, key.1) {
                parts.insert(key, (a.clone(), b.clone()));
            }
        }
        Self::from_parts(base, cfg, parts, None, 0, Vec::new(), 0.0)
    }

    fn from_parts(
        base: &Llama,
        cfg: TrainConfig,
        parts: BTreeMap<(usize, Proj), (Tensor, Tensor)>,
        moments: Option<Vec<Moments>>,
        step: usize,
        losses: Vec<f64>,
        train_seconds: f64,
    ) -> Result<Self, TrainError> {
        let mut vars = BTreeMap::new();
        let mut zero = Vec::new();
        for (key, (a, b)) in parts {
            let (a, b) = (Var::from_tensor(&a.copy()?)?, Var::from_tensor(&b.copy()?)?);
            for t in [a.as_tensor(), b.as_tensor()] {
                zero.push(Moments {
                    m: t.zeros_like()?,
                    v: t.zeros_like()?,
                });
            }
            vars.insert(key, (a, b));
        }
        let moments = match moments {
            Some(m) if m.len() == zero.len() => m,
            Some(m) => {
                return Err(TrainError::Config(format!(
                    "{} optimiser moments for {} parameters",
                    m.len(),
                    zero.len()
                )))
            }
            None => zero,
        };
        let live = LoraAdapter::from_parts(
            base.config(),
            cfg.rank,
            cfg.alpha,
            vars.iter()
                .map(|(&k, (a, b))| (k, (a.as_tensor().clone(), b.as_tensor().clone())))
                .collect(),
        )?;
        // On the fly, the model holds the Vars' own tensors: updating a Var updates the model.
        let model = base.with_adapter(&live, AdapterMode::OnTheFly)?;
        Ok(Self {
            cfg,
            model,
            vars,
            moments,
            step,
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
        self.step
    }

    /// Training loss of every step done.
    pub fn losses(&self) -> &[f64] {
        &self.losses
    }

    /// Seconds spent in optimisation steps (across resumes).
    pub fn train_seconds(&self) -> f64 {
        self.train_seconds
    }

    /// The model with the current adapter applied on the fly.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// A copy of the current adapter (f32, or rounded to `dtype` for shipping).
    pub fn adapter(&self, base: &Llama, dtype: DType) -> Result<LoraAdapter, TrainError> {
        let mut parts = BTreeMap::new();
        for (&k, (a, b)) in &self.vars {
            parts.insert(
                k,
                (
                    a.as_tensor().detach().to_dtype(dtype)?,
                    b.as_tensor().detach().to_dtype(dtype)?,
                ),
            );
        }
        Ok(LoraAdapter::from_parts(
            base.config(),
            self.cfg.rank,
            self.cfg.alpha,
            parts,
        )?)
    }

    /// Logits `(T, vocab)` of `tokens` through the training forward (gradients for the adapter
    /// only); equal to the model's differentiable forward.
    pub fn train_logits(&self, tokens: &[u32]) -> Result<Tensor, TrainError> {
        if let Some(&id) = tokens
            .iter()
            .find(|&&id| id as usize >= self.model.config().vocab_size)
        {
            return Err(ForwardError::TokenOutOfRange {
                id,
                vocab: self.model.config().vocab_size,
            }
            .into());
        }
        let lora = forward::Lora {
            vars: &self.vars,
            scale: self.cfg.alpha / self.cfg.rank as f64,
        };
        Ok(forward::logits(&self.model, &lora, tokens)?)
    }

    fn params(&self) -> impl Iterator<Item = &Var> {
        self.vars.values().flat_map(|(a, b)| [a, b])
    }

    /// One optimisation step on `batch` random windows of `data.train`.
    pub fn train_step(&mut self, data: &TrainData) -> Result<StepReport, TrainError> {
        let t0 = Instant::now();
        let (seq, batch) = (self.cfg.seq_len, self.cfg.batch);
        if data.train.len() < seq + 1 {
            return Err(CorpusError::TooShort {
                split: "train",
                tokens: data.train.len(),
                needed: seq + 1,
            }
            .into());
        }
        let mut rng = StdRng::seed_from_u64(step_seed(self.cfg.seed, self.step));
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|_| random_window(&data.train, seq + 1, &mut rng))
            .collect();
        let mut grads: Vec<Option<Tensor>> = vec![None; self.moments.len()];
        let mut loss_sum = 0.0;
        // One backward per window keeps one window's graph alive at a time; gradients add up.
        for w in &windows {
            let logits = self.train_logits(&w[..seq])?;
            let targets = Tensor::new(&w[1..], &Device::Cpu)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &targets)?;
            loss_sum += f64::from(loss.to_scalar::<f32>()?);
            let store = (loss / batch as f64)?.backward()?;
            for (slot, var) in grads.iter_mut().zip(self.params()) {
                if let Some(g) = store.get(var.as_tensor()) {
                    *slot = Some(match slot.take() {
                        None => g.clone(),
                        Some(acc) => (acc + g)?,
                    });
                }
            }
        }
        let loss = loss_sum / batch as f64;
        if !loss.is_finite() {
            return Err(TrainError::Diverged {
                step: self.step + 1,
            });
        }
        let mut sq = 0.0f64;
        for g in grads.iter().flatten() {
            sq += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
        }
        let grad_norm = sq.sqrt();
        let clip = match self.cfg.clip_norm {
            Some(c) if grad_norm > c => c / grad_norm,
            _ => 1.0,
        };
        let lr = self.cfg.lr_at(self.step);
        self.adamw(&grads, lr, clip)?;
        self.step += 1;
        self.losses.push(loss);
        let seconds = t0.elapsed().as_secs_f64();
        self.train_seconds += seconds;
        Ok(StepReport {
            step: self.step,
            loss,
            lr,
            grad_norm,
            seconds,
            tokens_per_s: (seq * batch) as f64 / seconds.max(1e-9),
        })
    }

    fn adamw(&mut self, grads: &[Option<Tensor>], lr: f64, clip: f64) -> Result<(), TrainError> {
        let t = (self.step + 1) as i32;
        let (c1, c2) = (1.0 - BETA1.powi(t), 1.0 - BETA2.powi(t));
        let vars: Vec<Var> = self.params().cloned().collect();
        for ((var, mom), g) in vars.iter().zip(self.moments.iter_mut()).zip(grads) {
            // A parameter without a gradient (B's partner while B is zero) still decays and
            // keeps its moments moving, as if its gradient were zero.
            let g = match g {
                Some(g) => (g * clip)?,
                None => var.as_tensor().zeros_like()?,
            };
            mom.m = ((&mom.m * BETA1)? + (&g * (1.0 - BETA1))?)?;
            mom.v = ((&mom.v * BETA2)? + (g.sqr()? * (1.0 - BETA2))?)?;
            let update = ((&mom.m / c1)? / ((&mom.v / c2)?.sqrt()? + EPS)?)?;
            let theta = var.as_tensor().detach();
            let theta = ((theta * (1.0 - lr * self.cfg.weight_decay))? - (update * lr)?)?;
            var.set(&theta)?;
        }
        Ok(())
    }

    /// Writes a checkpoint under `dir` (`step-NNNNNN/`, built in a temporary folder and renamed
    /// into place, then `latest.json` replaced atomically) and removes older checkpoints.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let name = format!("step-{:06}", self.step);
        let tmp = dir.join(format!("{name}.tmp"));
        let fin = dir.join(&name);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut i = 0;
        for (&(layer, proj), (a, b)) in &self.vars {
            for (which, var) in [("A", a), ("B", b)] {
                let key = format!("{layer}.{}.{which}", proj.hf_name());
                tensors.push((format!("{key}.w"), var.as_tensor().detach()));
                tensors.push((format!("{key}.m"), self.moments[i].m.clone()));
                tensors.push((format!("{key}.v"), self.moments[i].v.clone()));
                i += 1;
            }
        }
        let st = tmp.join("state.safetensors");
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n, t)), None, &st).map_err(
            |e| TrainError::Checkpoint {
                path: st.clone(),
                reason: e.to_string(),
            },
        )?;
        let meta = CheckpointMeta {
            step: self.step,
            config: self.cfg.clone(),
            losses: self.losses.clone(),
            train_seconds: self.train_seconds,
        };
        write_json(&tmp.join("state.json"), &meta)?;
        if fin.exists() {
            std::fs::remove_dir_all(&fin).map_err(io_err(&fin))?;
        }
        std::fs::rename(&tmp, &fin).map_err(io_err(&fin))?;
        write_json_atomic(&dir.join("latest.json"), &Latest { checkpoint: name })?;
        // Older checkpoints are only removed once the pointer names the new one.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("step-") && n != format!("step-{:06}", self.step) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(fin)
    }

    /// Resumes the run whose checkpoints are under `dir`; `None` if there is none. The
    /// checkpoint's configuration must equal `cfg` except for `steps`, which may grow.
    pub fn resume(base: &Llama, cfg: &TrainConfig, dir: &Path) -> Result<Option<Self>, TrainError> {
        let latest = dir.join("latest.json");
        if !latest.exists() {
            return Ok(None);
        }
        let l: Latest = read_json(&latest)?;
        let ck = dir.join(&l.checkpoint);
        let meta: CheckpointMeta = read_json(&ck.join("state.json"))?;
        let mut want = cfg.clone();
        want.steps = meta.config.steps;
        if want != meta.config {
            return Err(TrainError::Checkpoint {
                path: ck,
                reason: format!(
                    "was written with different hyperparameters ({:?}); use a new output folder",
                    meta.config
                ),
            });
        }
        let st = ck.join("state.safetensors");
        let mut tensors = candle_core::safetensors::load(&st, &Device::Cpu).map_err(|e| {
            TrainError::Checkpoint {
                path: st.clone(),
                reason: e.to_string(),
            }
        })?;
        let mut take = |k: &str| {
            tensors.remove(k).ok_or_else(|| TrainError::Checkpoint {
                path: st.clone(),
                reason: format!("missing tensor {k}"),
            })
        };
        let mut parts = BTreeMap::new();
        let mut moments = Vec::new();
        for layer in 0..base.config().num_layers {
            for proj in Proj::ALL {
                let mut pair = Vec::new();
                for which in ["A", "B"] {
                    let key = format!("{layer}.{}.{which}", proj.hf_name());
                    pair.push(take(&format!("{key}.w"))?);
                    moments.push(Moments {
                        m: take(&format!("{key}.m"))?,
                        v: take(&format!("{key}.v"))?,
                    });
                }
                let b = pair.pop();
                let a = pair.pop();
                if let (Some(a), Some(b)) = (a, b) {
                    parts.insert((layer, proj), (a, b));
                }
            }
        }
        Self::from_parts(
            base,
            cfg.clone(),
            parts,
            Some(moments),
            meta.step,
            meta.losses,
            meta.train_seconds,
        )
        .map(Some)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct CheckpointMeta {
    step: usize,
    config: TrainConfig,
    losses: Vec<f64>,
    train_seconds: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Latest {
    checkpoint: String,
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), TrainError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(io_err(path))
}

/// Writes `path` through a temporary file and a rename, so readers see the old or the new file.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), TrainError> {
    let tmp = path.with_extension("json.tmp");
    write_json(&tmp, value)?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TrainError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    serde_json::from_slice(&bytes).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// What the training loop tells its caller.
#[derive(Debug, Clone)]
pub enum TrainEvent {
    /// The loop starts at `from` of `total` steps.
    Started {
        /// Steps already done (after a resume).
        from: usize,
        /// Steps in the run.
        total: usize,
    },
    /// A step finished.
    Step(StepReport),
    /// A phase outside the steps (tokenising, validating, saving).
    Note(String),
    /// A checkpoint was written.
    Checkpoint {
        /// Steps it holds.
        step: usize,
        /// Its folder.
        path: PathBuf,
    },
}

/// How the training loop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoopEnd {
    /// Every step is done (the final checkpoint is written).
    Finished,
    /// The stop flag was raised; a checkpoint of the last finished step is at `checkpoint`.
    Stopped {
        /// Steps done.
        step: usize,
        /// The checkpoint folder.
        checkpoint: PathBuf,
    },
}

/// Runs steps until `cfg.steps` are done or `stop` is raised, checkpointing under `ckpt_dir`
/// every `checkpoint_every` steps, at the end, and when stopped. A step in progress when `stop`
/// is raised finishes first, so no work is lost.
pub fn run(
    trainer: &mut Trainer,
    data: &TrainData,
    ckpt_dir: &Path,
    checkpoint_every: usize,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<LoopEnd, TrainError> {
    on_event(&TrainEvent::Started {
        from: trainer.step(),
        total: trainer.cfg.steps,
    });
    while trainer.step() < trainer.cfg.steps {
        if stop.load(Ordering::SeqCst) {
            let path = trainer.save_checkpoint(ckpt_dir)?;
            on_event(&TrainEvent::Checkpoint {
                step: trainer.step(),
                path: path.clone(),
            });
            return Ok(LoopEnd::Stopped {
                step: trainer.step(),
                checkpoint: path,
            });
        }
        let report = trainer.train_step(data)?;
        on_event(&TrainEvent::Step(report));
        let last = trainer.step() == trainer.cfg.steps;
        if last || (checkpoint_every > 0 && trainer.step().is_multiple_of(checkpoint_every)) {
            let path = trainer.save_checkpoint(ckpt_dir)?;
            on_event(&TrainEvent::Checkpoint {
                step: trainer.step(),
                path,
            });
        }
    }
    Ok(LoopEnd::Finished)
}

/// Mean next-token cross-entropy (nats) of `model` over `windows` (every position after the
/// first of each window), with the fast non-differentiable forward.
pub fn mean_loss(model: &Llama, windows: &[Vec<u32>]) -> Result<f64, TrainError> {
    let mut total = 0.0;
    let mut n = 0usize;
    for w in windows {
        if w.len() < 2 {
            continue;
        }
        let out = model.forward(Input::new(&w[..w.len() - 1]).logits(LogitsWanted::All))?;
        let logits = out
            .logits
            .ok_or_else(|| candle_core::Error::Msg("forward returned no logits".into()))?;
        let targets = Tensor::new(&w[1..], &Device::Cpu)?;
        let lsm = candle_nn::ops::log_softmax(&logits, 1)?;
        let picked = lsm.gather(&targets.unsqueeze(1)?, 1)?;
        total -= picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        n += w.len() - 1;
    }
    if n == 0 {
        return Err(TrainError::Config("no validation tokens".into()));
    }
    Ok(total / n as f64)
}

/// The manifest written beside a trained adapter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// scd version that trained it.
    pub scd_version: String,
    /// The base model.
    pub base_model: BaseModelInfo,
    /// The corpus.
    pub corpus: CorpusInfo,
    /// Hyperparameters.
    pub hyperparameters: TrainConfig,
    /// Adapted projections (Hugging Face module names) of every layer.
    pub targets: Vec<String>,
    /// Steps done.
    pub steps: usize,
    /// Mean training loss of the last (up to) 10 steps.
    pub final_train_loss: f64,
    /// Validation of base and expert on the same windows.
    pub validation: ValidationInfo,
    /// Seconds of optimisation steps (excluding tokenisation and validation).
    pub train_seconds: f64,
    /// Wall time of the whole command, seconds (this invocation only when resumed).
    pub wall_seconds: f64,
    /// Mean seconds per step.
    pub seconds_per_step: f64,
    /// The adapter file: name, dtype, bytes, sha256.
    pub adapter: AdapterFileInfo,
}

/// Base model identity.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BaseModelInfo {
    /// File name.
    pub file: String,
    /// Hex SHA-256 of the file.
    pub sha256: String,
}

/// Corpus identity and split.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CorpusInfo {
    /// Name or path as given.
    pub name: String,
    /// Hex SHA-256 of the train text.
    pub train_sha256: String,
    /// Hex SHA-256 of the validation text.
    pub valid_sha256: String,
    /// How the splits were made.
    pub split_rule: String,
    /// Tokens in the train split.
    pub train_tokens: usize,
    /// Tokens in the validation split.
    pub valid_tokens: usize,
}

/// Validation of base and expert.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ValidationInfo {
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window.
    pub window_tokens: usize,
    /// Base mean cross-entropy (nats).
    pub base_loss: f64,
    /// Base perplexity.
    pub base_perplexity: f64,
    /// Expert (shipped adapter, as stored) mean cross-entropy.
    pub expert_loss: f64,
    /// Expert perplexity.
    pub expert_perplexity: f64,
    /// `1 - expert / base` perplexity.
    pub perplexity_reduction: f64,
}

/// The stored adapter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AdapterFileInfo {
    /// File name beside the manifest.
    pub file: String,
    /// `f32` or `bf16`.
    pub dtype: String,
    /// Size.
    pub bytes: u64,
    /// Hex SHA-256.
    pub sha256: String,
}

impl Manifest {
    /// Reads `manifest.json`.
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        read_json(path)
    }

    /// Writes it atomically.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        write_json_atomic(path, self)
    }
}

/// Mean of the last up-to-`n` values.
pub fn tail_mean(values: &[f64], n: usize) -> f64 {
    let tail = &values[values.len().saturating_sub(n)..];
    if tail.is_empty() {
        return f64::NAN;
    }
    tail.iter().sum::<f64>() / tail.len() as f64
}

/// Saves `adapter` (already in its storage dtype) as `dir/adapter.safetensors` with an
/// `adapter_config.json` beside it, and describes the file.
pub fn save_adapter(
    adapter: &LoraAdapter,
    base: &Llama,
    dir: &Path,
    dtype: DType,
) -> Result<AdapterFileInfo, TrainError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join("adapter.safetensors");
    let tmp = dir.join("adapter.safetensors.tmp");
    adapter.save(&tmp, base.config())?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "r": adapter.rank(),
        "lora_alpha": adapter.alpha(),
        "target_modules": Proj::ALL.iter().map(|p| p.hf_name().rsplit('.').next().unwrap_or("")).collect::<Vec<_>>(),
        "bias": "none",
    });
    write_json_atomic(&dir.join("adapter_config.json"), &cfg)?;
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    Ok(AdapterFileInfo {
        file: "adapter.safetensors".into(),
        dtype: format!("{dtype:?}").to_lowercase(),
        bytes: bytes.len() as u64,
        sha256: crate::corpus::sha256_hex(&bytes),
    })
}

/// Where and how [`finetune`] writes.
#[derive(Debug, Clone)]
pub struct FinetuneOptions {
    /// Output folder: `adapter.safetensors`, `adapter_config.json`, `manifest.json`, and
    /// `checkpoints/`.
    pub out_dir: PathBuf,
    /// Steps between checkpoints (0: only at the end and when stopped).
    pub checkpoint_every: usize,
    /// Continue from the latest checkpoint in `out_dir/checkpoints` if there is one.
    pub resume: bool,
    /// Storage dtype of the shipped adapter (`F32` or `BF16`).
    pub dtype: DType,
}

/// How [`finetune`] ended.
#[derive(Debug, Clone)]
pub enum FinetuneOutcome {
    /// Trained, saved and validated.
    Finished(Box<Manifest>),
    /// Stopped by the flag after `step` steps; resume from `checkpoint`.
    Stopped {
        /// Steps done.
        step: usize,
        /// The checkpoint folder.
        checkpoint: PathBuf,
    },
}

/// The whole fine-tuning command: tokenise the corpus, validate the base, train (resuming if
/// asked), save the adapter in `opts.dtype`, validate the stored adapter, and write the
/// manifest.
pub fn finetune(
    base: &Llama,
    tok: &crate::tokenizer::Tokenizer,
    corpus: &crate::corpus::Corpus,
    cfg: &TrainConfig,
    opts: &FinetuneOptions,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<FinetuneOutcome, TrainError> {
    let wall = Instant::now();
    cfg.validate()?;
    let tok_err = |e: crate::tokenizer::TokenizerError| TrainError::Config(e.to_string());
    on_event(&TrainEvent::Note(format!("tokenising {}", corpus.name)));
    let train = crate::corpus::tokenize_long(tok, &corpus.train).map_err(tok_err)?;
    let valid_tokens = crate::corpus::tokenize_long(tok, &corpus.valid).map_err(tok_err)?;
    let valid =
        crate::corpus::even_windows(&valid_tokens, cfg.seq_len + 1, cfg.valid_windows, "valid")?;
    if train.len() < cfg.seq_len + 1 {
        return Err(CorpusError::TooShort {
            split: "train",
            tokens: train.len(),
            needed: cfg.seq_len + 1,
        }
        .into());
    }
    let data = TrainData { train, valid };
    let ckpt_dir = opts.out_dir.join("checkpoints");
    let resumed = if opts.resume {
        Trainer::resume(base, cfg, &ckpt_dir)?
    } else {
        None
    };
    let mut trainer = match resumed {
        Some(t) => {
            on_event(&TrainEvent::Note(format!("resuming at step {}", t.step())));
            t
        }
        None => {
            if ckpt_dir.join("latest.json").exists() {
                return Err(TrainError::Checkpoint {
                    path: ckpt_dir,
                    reason:
                        "a run already has checkpoints here: pass --resume or use another folder"
                            .into(),
                });
            }
            Trainer::new(base, cfg.clone())?
        }
    };
    on_event(&TrainEvent::Note(format!(
        "validating the base on {} windows",
        data.valid.len()
    )));
    let base_loss = mean_loss(base, &data.valid)?;
    match run(
        &mut trainer,
        &data,
        &ckpt_dir,
        opts.checkpoint_every,
        stop,
        &mut on_event,
    )? {
        LoopEnd::Stopped { step, checkpoint } => {
            return Ok(FinetuneOutcome::Stopped { step, checkpoint })
        }
        LoopEnd::Finished => {}
    }
    on_event(&TrainEvent::Note(
        "saving and validating the adapter".into(),
    ));
    let adapter = trainer.adapter(base, opts.dtype)?;
    let file = save_adapter(&adapter, base, &opts.out_dir, opts.dtype)?;
    // Validate what was stored (after any rounding), loaded back as a user would.
    let stored = LoraAdapter::load(opts.out_dir.join(&file.file), base.config())?;
    let expert = base.with_adapter(&stored, AdapterMode::Merge)?;
    let expert_loss = mean_loss(&expert, &data.valid)?;
    let id = base.identity();
    let manifest = Manifest {
        scd_version: env!("CARGO_PKG_VERSION").into(),
        base_model: BaseModelInfo {
            file: id
                .source
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            sha256: id.sha256.clone(),
        },
        corpus: CorpusInfo {
            name: corpus.name.clone(),
            train_sha256: corpus.train_sha256.clone(),
            valid_sha256: corpus.valid_sha256.clone(),
            split_rule: corpus.split_rule.clone(),
            train_tokens: data.train.len(),
            valid_tokens: valid_tokens.len(),
        },
        hyperparameters: cfg.clone(),
        targets: Proj::ALL.iter().map(|p| p.hf_name().to_string()).collect(),
        steps: trainer.step(),
        final_train_loss: tail_mean(trainer.losses(), 10),
        validation: ValidationInfo {
            windows: data.valid.len(),
            window_tokens: cfg.seq_len + 1,
            base_loss,
            base_perplexity: base_loss.exp(),
            expert_loss,
            expert_perplexity: expert_loss.exp(),
            perplexity_reduction: 1.0 - (expert_loss - base_loss).exp(),
        },
        train_seconds: trainer.train_seconds(),
        wall_seconds: wall.elapsed().as_secs_f64(),
        seconds_per_step: trainer.train_seconds() / trainer.step().max(1) as f64,
        adapter: file,
    };
    manifest.save(&opts.out_dir.join("manifest.json"))?;
    Ok(FinetuneOutcome::Finished(Box::new(manifest)))
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
    fn step_seeds_differ() {
        assert_ne!(step_seed(0, 0), step_seed(0, 1));
        assert_ne!(step_seed(0, 1), step_seed(1, 1));
        assert_eq!(step_seed(7, 3), step_seed(7, 3));
    }

    #[test]
    fn tail_mean_of_short_series() {
        assert_eq!(tail_mean(&[1.0, 3.0], 10), 2.0);
        assert_eq!(tail_mean(&[1.0, 3.0, 5.0], 2), 4.0);
    }
}
