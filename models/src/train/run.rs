//! The training loop: steps until done or stopped, checkpointing on the way and when stopped.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Objective, StepReport, TrainConfig, TrainError, Trainer};
use crate::llama::Llama;
use crate::lora::LoraAdapter;

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

/// Runs steps of `objective` until `cfg.steps` are done or `stop` is raised, checkpointing under `ckpt_dir`
/// every `checkpoint_every` steps, at the end, and when stopped. A step in progress when `stop`
/// is raised finishes first, so no work is lost.
pub fn run(
    trainer: &mut Trainer,
    objective: &impl Objective,
    ckpt_dir: &Path,
    checkpoint_every: usize,
    stop: &AtomicBool,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<LoopEnd, TrainError> {
    let total = trainer.config().steps;
    on_event(&TrainEvent::Started {
        from: trainer.step(),
        total,
    });
    while trainer.step() < total {
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
        let report = trainer.train_step(objective)?;
        on_event(&TrainEvent::Step(report));
        let last = trainer.step() == total;
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

/// The run's trainer: resumed from the latest checkpoint under `ckpt_dir` when `resume` and
/// there is one, fresh otherwise: from `init` when given (an adapter trained before, whose
/// training this run continues), else from [`Trainer::new`]. A fresh run refuses a folder that
/// already holds checkpoints, so that another run's are never overwritten.
pub fn start_or_resume(
    base: &Llama,
    cfg: &TrainConfig,
    ckpt_dir: &Path,
    resume: bool,
    init: Option<&LoraAdapter>,
    mut on_event: impl FnMut(&TrainEvent),
) -> Result<Trainer, TrainError> {
    if resume {
        if let Some(t) = Trainer::resume(base, cfg, ckpt_dir)? {
            on_event(&TrainEvent::Note(format!("resuming at step {}", t.step())));
            return Ok(t);
        }
    }
    if ckpt_dir.join("latest.json").exists() {
        return Err(TrainError::Checkpoint {
            path: ckpt_dir.to_path_buf(),
            reason: "a run already has checkpoints here: pass --resume or use another folder"
                .into(),
        });
    }
    match init {
        Some(adapter) => Trainer::from_adapter(base, cfg.clone(), adapter),
        None => Trainer::new(base, cfg.clone()),
    }
}
