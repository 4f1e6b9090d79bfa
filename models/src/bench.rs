//! Measurements for `scd bench model`: the machine's f32 matmul throughput, one timing protocol
//! (warm-up, repetitions, decode steps) applied alike to every implementation compared, FLOP
//! counts, and the process's peak resident memory.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::baseline::QuantizedLlama;
use crate::cache::KvCache;
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

/// The machine's AMX bf16 peak in GFLOP/s: `tdpbf16ps` on tiles already loaded (no memory
/// traffic), on every thread of the pool at once for `per_thread` instructions each; `None`
/// where AMX is missing. What the tile kernels' figures are a share of.
pub fn amx_peak_gflops(per_thread: u64) -> Option<f64> {
    use rayon::prelude::*;
    if !crate::kernels::amx::available() {
        return None;
    }
    let threads = rayon::current_num_threads();
    let t = Instant::now();
    (0..threads)
        .into_par_iter()
        .for_each(|_| crate::kernels::amx::register_loop(per_thread));
    let flops = crate::kernels::amx::FLOPS_PER_PRODUCT * per_thread as f64 * threads as f64;
    Some(flops / t.elapsed().as_secs_f64() / 1e9)
}

/// The machine's f32 FMA peak in GFLOP/s: fused multiply-adds on registers only (16
/// independent AVX-512 accumulators, or AVX2 ones where AVX-512 is missing), on every thread of
/// the pool at once for `per_thread` iterations each. What the f32 paths' figures are a share
/// of.
pub fn fma_peak_gflops(per_thread: u64) -> f64 {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads();
    let t = Instant::now();
    let lanes: usize = (0..threads)
        .into_par_iter()
        .map(|_| fma_loop(per_thread))
        .sum();
    // Two FLOPs per lane per FMA, 16 accumulators per iteration, `lanes` summed over threads.
    let flops = 2.0 * 16.0 * per_thread as f64 * lanes as f64;
    flops / t.elapsed().as_secs_f64() / 1e9
}

/// Runs `iters` iterations of 16 independent vector FMAs; returns the vector width in f32
/// lanes (so the caller can count FLOPs).
fn fma_loop(iters: u64) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was just detected.
            unsafe { fma_avx512(iters) };
            return 16;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: both features were just detected.
            unsafe { fma_avx2(iters) };
            return 8;
        }
    }
    let mut acc = [1f32; 16];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    1
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_avx512(iters: u64) {
    use std::arch::x86_64::*;
    let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); 16];
    for _ in 0..iters {
        for a in &mut acc {
            *a = _mm512_fmadd_ps(*a, m, c);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_avx2(iters: u64) {
    use std::arch::x86_64::*;
    let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); 16];
    for _ in 0..iters {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, m, c);
        }
    }
    std::hint::black_box(acc);
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

/// How every implementation in one bench run is timed, so that their figures compare: the same
/// untimed warm-up and the same number of timed runs for each prefill length, and the same
/// untimed and timed greedy decode steps. `ops/llama-bench.py` follows the same protocol for
/// llama.cpp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol {
    /// Untimed prefills of each length before the timed ones.
    pub warmup: usize,
    /// Timed prefills of each length.
    pub reps: usize,
    /// Untimed decode steps after the prompt, before the timed ones.
    pub decode_warmup: usize,
    /// Timed decode steps.
    pub decode_steps: usize,
}

/// The timed runs of one measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Runs(pub Vec<Duration>);

impl Runs {
    /// The fastest run (the least disturbed by other work on a shared machine).
    pub fn best(&self) -> Duration {
        self.0.iter().copied().min().unwrap_or_default()
    }

    /// The median run (the upper of the two middle ones for an even count).
    pub fn median(&self) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    }
}

/// A model as the bench drives it: a prefill from an empty cache that computes the last
/// position's logits, then greedy decode steps. Each call returns the argmax of the logits it
/// computed, so every implementation does the same work per call.
pub trait Timed {
    /// Errors of a forward pass.
    type Error;
    /// Forgets every token fed so far.
    fn reset(&mut self);
    /// Feeds `tokens` after those fed since the last reset.
    fn feed(&mut self, tokens: &[u32]) -> Result<u32, Self::Error>;
}

/// `protocol.warmup` untimed then `protocol.reps` timed prefills of `tokens`, each from an
/// empty cache.
pub fn time_prefill<M: Timed>(
    model: &mut M,
    tokens: &[u32],
    protocol: &Protocol,
) -> Result<Runs, M::Error> {
    let mut runs = Vec::with_capacity(protocol.reps);
    for i in 0..protocol.warmup + protocol.reps.max(1) {
        model.reset();
        let t = Instant::now();
        model.feed(tokens)?;
        if i >= protocol.warmup {
            runs.push(t.elapsed());
        }
    }
    Ok(Runs(runs))
}

/// Mean time per greedy decode step: a prefill of `prompt`, `protocol.decode_warmup` untimed
/// steps, then `protocol.decode_steps` timed ones.
pub fn time_decode<M: Timed>(
    model: &mut M,
    prompt: &[u32],
    protocol: &Protocol,
) -> Result<Duration, M::Error> {
    model.reset();
    let mut next = model.feed(prompt)?;
    for _ in 0..protocol.decode_warmup {
        next = model.feed(&[next])?;
    }
    let steps = protocol.decode_steps.max(1);
    let t = Instant::now();
    for _ in 0..steps {
        next = model.feed(&[next])?;
    }
    Ok(t.elapsed() / steps as u32)
}

/// This crate's f32 model with its own KV cache.
#[derive(Debug)]
pub struct TimedLlama<'a> {
    model: &'a Llama,
    cache: KvCache,
}

impl<'a> TimedLlama<'a> {
    /// `model` with an empty cache.
    pub fn new(model: &'a Llama) -> Self {
        Self {
            cache: model.new_cache(),
            model,
        }
    }
}

impl Timed for TimedLlama<'_> {
    type Error = ForwardError;

    fn reset(&mut self) {
        self.cache = self.model.new_cache();
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<u32, ForwardError> {
        let out = self.model.forward(
            Input::new(tokens)
                .with_cache(&mut self.cache)
                .logits(LogitsWanted::Last),
        )?;
        let logits = out
            .logits
            .ok_or_else(|| candle_core::Error::Msg("no logits".into()))?;
        Ok(argmax_row(&logits.squeeze(0)?)?)
    }
}

impl Timed for QuantizedLlama {
    type Error = candle_core::Error;

    fn reset(&mut self) {
        QuantizedLlama::reset(self);
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<u32, candle_core::Error> {
        argmax_row(&self.forward(tokens)?)
    }
}

fn argmax_row(logits: &Tensor) -> candle_core::Result<u32> {
    logits.argmax(0)?.to_dtype(DType::U32)?.to_scalar::<u32>()
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
