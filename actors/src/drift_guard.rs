//! The drift guard on a consumer node: a share of `reuse` / `scd` jobs is checked against the
//! expert's own prefill, in the background, after the job has answered.
//!
//! A translator's quality was measured once, at calibration, on text chosen then; what it
//! meets in service may differ (another domain, longer prompts, a producer model updated under
//! it). For a sampled job the decoder keeps a copy of the rebuilt cache; once the job is done,
//! the node runs the expert's own prefill of the same prefix (the oracle) and measures the KL
//! between the two caches' next-token distributions over the tokens the job generated
//! (teacher-forced, so one early difference does not decide the rest). The mean over a window
//! of recent checks is exported per translator version; when it rises above the bound the
//! node marks the live version degraded in the store, and the scheduler runs the pair's jobs
//! in a safer mode until another version is made live.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use scd_models::codec::{self, Oracle, Prefix};
use scd_models::perplexity::continuation_logits;
use scd_models::{metrics, CodecError, KvCache, Llama};
use scd_scheduler::TranslatorHash;
use scd_transport::JobId;

use crate::config::DriftConfig;

/// What one recorded check says about its translator version.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// Mean KL over the window.
    pub mean_kl: f64,
    /// Checks in the window.
    pub jobs: usize,
    /// True the first time the mean goes over the bound with enough checks: the caller marks
    /// the version degraded.
    pub degraded_now: bool,
}

#[derive(Debug, Default)]
struct Window {
    kls: VecDeque<f64>,
    flagged: bool,
}

/// The guard's settings and its windows, per (expert, translator version).
#[derive(Debug)]
pub struct DriftGuard {
    cfg: DriftConfig,
    windows: Mutex<HashMap<(String, TranslatorHash), Window>>,
}

impl DriftGuard {
    /// A guard with empty windows.
    pub fn new(cfg: DriftConfig) -> Self {
        Self {
            cfg,
            windows: Mutex::new(HashMap::new()),
        }
    }

    /// The bound the mean KL is held to.
    pub fn bound(&self) -> f64 {
        self.cfg.kl_bound
    }

    /// Whether `job` is checked. Decided by the job id, so every node (and a test) agrees on
    /// which jobs are, and a share of 1 checks every job.
    pub fn sampled(&self, job: JobId) -> bool {
        if self.cfg.shadow_share <= 0.0 {
            return false;
        }
        let mut h = DefaultHasher::new();
        job.as_u128().hash(&mut h);
        (h.finish() % 1_000_000) as f64 / 1e6 < self.cfg.shadow_share
    }

    /// Adds one check's KL for `expert`'s translator version `hash`.
    pub fn record(&self, expert: &str, hash: TranslatorHash, kl: f64) -> Verdict {
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let w = windows.entry((expert.to_string(), hash)).or_default();
        w.kls.push_back(kl);
        while w.kls.len() > self.cfg.window.max(1) {
            w.kls.pop_front();
        }
        let jobs = w.kls.len();
        let mean_kl = w.kls.iter().sum::<f64>() / jobs as f64;
        let over = jobs >= self.cfg.min_jobs && mean_kl > self.cfg.kl_bound;
        let degraded_now = over && !w.flagged;
        w.flagged |= over;
        Verdict {
            mean_kl,
            jobs,
            degraded_now,
        }
    }
}

/// Mean KL(expert's own prefill || `rebuilt`) over the next-token distributions that produced
/// `output` (after the prompt's `last` token, then after each generated token but the final
/// one), for a prompt whose cached part is `prefix`. Zero for an empty output.
pub fn shadow_kl(
    expert: &Llama,
    prefix: &[u32],
    last: u32,
    output: &[u32],
    rebuilt: KvCache,
) -> Result<f64, CodecError> {
    if output.is_empty() {
        return Ok(0.0);
    }
    let oracle = codec::decode(&Oracle, expert, &[], Prefix::new(prefix))?;
    let want = continuation_logits(expert, oracle, last, output)?;
    let got = continuation_logits(expert, rebuilt, last, output)?;
    let total: f64 = want
        .iter()
        .zip(&got)
        .map(|(p, q)| metrics::kl_divergence(p, q))
        .sum();
    Ok(total / want.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(share: f64) -> DriftGuard {
        DriftGuard::new(DriftConfig {
            shadow_share: share,
            kl_bound: 0.5,
            window: 3,
            min_jobs: 2,
        })
    }

    #[test]
    fn the_share_decides_by_job_id() {
        let ids: Vec<JobId> = (0..2000u128).map(|i| JobId::from_u128(i * 7919)).collect();
        assert!(ids.iter().all(|&j| guard(1.0).sampled(j)));
        assert!(!ids.iter().any(|&j| guard(0.0).sampled(j)));
        let some = ids.iter().filter(|&&j| guard(0.1).sampled(j)).count();
        assert!((100..300).contains(&some), "{some} of 2000 at 10%");
        assert_eq!(guard(0.1).sampled(ids[5]), guard(0.1).sampled(ids[5]));
    }

    #[test]
    fn a_window_over_the_bound_degrades_once_per_version() {
        let g = guard(1.0);
        let (a, b) = (
            TranslatorHash::from_bytes([1; 32]),
            TranslatorHash::from_bytes([2; 32]),
        );
        // One check is not enough, however bad.
        assert!(!g.record("mail", a, 9.0).degraded_now);
        let v = g.record("mail", a, 0.1);
        assert!(v.degraded_now && v.jobs == 2 && (v.mean_kl - 4.55).abs() < 1e-12);
        assert!(!g.record("mail", a, 9.0).degraded_now, "marked once");
        // The window slides: three good checks bring the mean under the bound.
        for _ in 0..3 {
            g.record("mail", a, 0.1);
        }
        assert!((g.record("mail", a, 0.1).mean_kl - 0.1).abs() < 1e-12);
        // Another version starts afresh.
        assert_eq!(g.record("mail", b, 0.1).jobs, 1);
    }
}
