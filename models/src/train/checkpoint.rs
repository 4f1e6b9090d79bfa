//! Checkpoints of a run: `step-NNNNNN/` folders holding the adapter (or boundary tokens), both
//! optimiser moments (`state.safetensors`) and the step, configuration and losses
//! (`state.json`), with `latest.json` naming the newest. A checkpoint is built in a temporary
//! folder and renamed into place before `latest.json` is replaced, so a crash at any moment
//! leaves a usable one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::trainer::lora_key;
use super::{io_err, TrainConfig, TrainError, Trainer};
use crate::json_file;
use crate::llama::Llama;
use crate::optim::Moments;

#[derive(Debug, Serialize, Deserialize)]
struct CheckpointMeta {
    step: usize,
    config: TrainConfig,
    losses: Vec<f64>,
    train_seconds: f64,
    /// A boundary-token run's compiler (base hash, adapter hash): the tokens are trained for
    /// it, so a run resumed on another compiler would go on training tokens meant for the
    /// first. Checkpoints written before the field existed read as `None` (not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    compiler: Option<(String, Option<String>)>,
}

/// The identity a boundary-token run records for its compiler.
fn compiler_of(model: &Llama) -> (String, Option<String>) {
    let id = model.identity();
    (id.sha256.clone(), id.adapter_sha256.clone())
}

#[derive(Debug, Serialize, Deserialize)]
struct Latest {
    checkpoint: String,
}

impl Trainer {
    /// Writes a checkpoint under `dir` and removes older ones.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let name = format!("step-{:06}", self.step());
        let tmp = dir.join(format!("{name}.tmp"));
        let fin = dir.join(&name);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut moments = self.opt.moments().iter();
        for (key, var) in self.params.named() {
            let mom = moments.next().ok_or_else(|| TrainError::Checkpoint {
                path: tmp.clone(),
                reason: "fewer optimiser moments than parameters".into(),
            })?;
            tensors.push((format!("{key}.w"), var.as_tensor().detach()));
            tensors.push((format!("{key}.m"), mom.m.clone()));
            tensors.push((format!("{key}.v"), mom.v.clone()));
        }
        let st = tmp.join("state.safetensors");
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n, t)), None, &st).map_err(
            |e| TrainError::Checkpoint {
                path: st.clone(),
                reason: e.to_string(),
            },
        )?;
        let meta = CheckpointMeta {
            step: self.step(),
            config: self.cfg.clone(),
            losses: self.losses.clone(),
            train_seconds: self.train_seconds,
            compiler: self
                .cfg
                .boundary
                .is_some()
                .then(|| compiler_of(&self.model)),
        };
        json_file::write_atomic(&tmp.join("state.json"), &meta)?;
        if fin.exists() {
            std::fs::remove_dir_all(&fin).map_err(io_err(&fin))?;
        }
        std::fs::rename(&tmp, &fin).map_err(io_err(&fin))?;
        json_file::write_atomic(
            &dir.join("latest.json"),
            &Latest {
                checkpoint: name.clone(),
            },
        )?;
        // Older checkpoints are only removed once the pointer names the new one.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("step-") && n != name {
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
        let l: Latest = json_file::read(&latest)?;
        let ck = dir.join(&l.checkpoint);
        let meta: CheckpointMeta = json_file::read(&ck.join("state.json"))?;
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
        if let Some(saved) = meta.compiler.as_ref().filter(|_| cfg.boundary.is_some()) {
            let now = compiler_of(base);
            if *saved != now {
                let name = |(base, adapter): &(String, Option<String>)| {
                    let short = |s: &str| s[..12.min(s.len())].to_owned();
                    match adapter {
                        Some(a) => format!("base {} with adapter {}", short(base), short(a)),
                        None => format!("base {} without adapter", short(base)),
                    }
                };
                return Err(TrainError::Checkpoint {
                    path: ck,
                    reason: format!(
                        "trains boundary tokens for {}, not {} (the --writer differs); use a \
                         new output folder",
                        name(saved),
                        name(&now)
                    ),
                });
            }
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
        let mut moments = Vec::new();
        let saved = |moments, losses| (Some((moments, meta.step)), losses, meta.train_seconds);
        if cfg.boundary.is_some() {
            let mut tokens = Vec::with_capacity(2);
            for key in ["header", "trailer"] {
                tokens.push(take(&format!("{key}.w"))?);
                moments.push(Moments {
                    m: take(&format!("{key}.m"))?,
                    v: take(&format!("{key}.v"))?,
                });
            }
            let (s, losses, secs) = saved(moments, meta.losses);
            return Self::from_boundary(
                base,
                cfg.clone(),
                (&tokens[0], &tokens[1]),
                s,
                losses,
                secs,
            )
            .map(Some);
        }
        let mut parts = BTreeMap::new();
        // The moments were saved in the trainer's (layer, projection) order.
        let mut targets = cfg.targets.clone();
        targets.sort();
        targets.dedup();
        for layer in (0..base.config().num_layers).filter(|&l| cfg.adapts_layer(l)) {
            for &proj in &targets {
                let mut pair = Vec::with_capacity(2);
                for which in ["A", "B"] {
                    let key = lora_key(layer, proj, which);
                    pair.push(take(&format!("{key}.w"))?);
                    moments.push(Moments {
                        m: take(&format!("{key}.m"))?,
                        v: take(&format!("{key}.v"))?,
                    });
                }
                let [a, b]: [Tensor; 2] = pair.try_into().map_err(|_| TrainError::Checkpoint {
                    path: st.clone(),
                    reason: "unpaired adapter matrices".into(),
                })?;
                parts.insert((layer, proj), (a, b));
            }
        }
        let (s, losses, secs) = saved(moments, meta.losses);
        Self::from_parts(base, cfg.clone(), parts, s, losses, secs).map(Some)
    }
}
