//! Measurements for `scd bench model`: the machine's f32 matmul throughput, timed prefill and
//! decode of a model, FLOP counts, and the process's peak resident memory.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::config::LlamaConfig;
use crate::error::ForwardError;
use crate::llama::{Input, Llama, LogitsWanted};

/// Best-of-`reps` throughput of an `n x n x n` f32 candle matmul, in GFLOP/s.
pub fn matmul_gflops(n: usize, reps: usize) -> candle_core::Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    // One untimed run to fault in the output pages and warm up the thread pool.
    a.matmul(&b)?;
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let c = a.matmul(&b)?;
        best = best.min(t.elapsed());
        drop(c);
    }
    Ok(2.0 * (n * n * n) as f64 / best.as_secs_f64() / 1e9)
}

/// FLOPs of a prefill of `t` tokens from an empty cache: every projection of every layer, causal
/// attention (`q k^T` and `p v` over the visible keys only), and the output head for the last
/// position. Norms, RoPE and softmax are left out (a few percent).
pub fn prefill_flops(cfg: &LlamaConfig, t: usize) -> f64 {
    let linear = 2.0 * cfg.matmul_params() as f64 * t as f64;
    let visible = (t * (t + 1) / 2) as f64;
    let attention = cfg.num_layers as f64 * 2.0 * 2.0 * cfg.q_dim() as f64 * visible;
    let head = 2.0 * (cfg.hidden_size * cfg.vocab_size) as f64;
    linear + attention + head
}

/// Deterministic token ids for timing (the content does not change the work).
pub fn synthetic_tokens(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// Best-of-`reps` time of a prefill of `tokens` that fills a fresh cache and computes the last
/// position's logits.
pub fn time_prefill(model: &Llama, tokens: &[u32], reps: usize) -> Result<Duration, ForwardError> {
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        let mut cache = model.new_cache();
        let t = Instant::now();
        model.forward(
            Input::new(tokens)
                .with_cache(&mut cache)
                .logits(LogitsWanted::Last),
        )?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

/// Mean time per decode step of `steps` greedy steps after a prefill of `prompt`.
pub fn time_decode(model: &Llama, prompt: &[u32], steps: usize) -> Result<Duration, ForwardError> {
    let mut cache = model.new_cache();
    let out = model.forward(Input::new(prompt).with_cache(&mut cache))?;
    let mut next = argmax_row(out.logits)?;
    let t = Instant::now();
    for _ in 0..steps {
        let out = model.forward(Input::new(&[next]).with_cache(&mut cache))?;
        next = argmax_row(out.logits)?;
    }
    Ok(t.elapsed() / steps.max(1) as u32)
}

fn argmax_row(logits: Option<Tensor>) -> Result<u32, ForwardError> {
    let logits = logits.ok_or_else(|| candle_core::Error::Msg("no logits".into()))?;
    Ok(logits
        .squeeze(0)?
        .argmax(0)?
        .to_dtype(DType::U32)?
        .to_scalar::<u32>()?)
}

/// Peak resident set size of this process so far (`VmHWM`), in bytes; `None` off Linux.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kb("VmHWM:").map(|kb| kb * 1024)
}

/// Current resident set size (`VmRSS`), in bytes; `None` off Linux.
pub fn rss_bytes() -> Option<u64> {
    proc_status_kb("VmRSS:").map(|kb| kb * 1024)
}

fn proc_status_kb(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
