//! Does the context a token sits in predict the expert's K and V better than the token's own
//! producer state? An offline measurement for the translators' design (docs/design-notes.md,
//! "Patch adds little on these pairs"): at a few layers, fit ridge regressions from sets of
//! producer features to the expert's `[K before RoPE | V]` on calibration prompts (Brown's train
//! split), and report their error on held-out prompts against raw transfer's (the producer's own
//! K and V, unchanged).
//!
//! Feature sets, all at full rank (the floors a code of any rank approaches from above):
//! - `R`: the producer's `[K | V]` at the token (Reuse's input);
//! - `R+prev`: and the previous token's;
//! - `R+ctx`: and two summaries of the context up to the token: the running mean of `[K | V]`
//!   and an exponential moving average (0.9 per token);
//! - `H`: the producer's `H_in` at the token (a linear Patch fitted in K/V space);
//! - `H+R`: both;
//! - `all`: every feature above, with `H_in`'s running mean and moving average.
//!
//! Usage: `context_features GGUF ADAPTER [layers 5,15,25,29] [fit prompts 64] [held-out 16]
//! [tokens 256]`, e.g. `cargo run --release -p scd-models --example context_features --
//! .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf experts/melville/adapter.safetensors`.
//! Reads Brown from `.cache/data` (`make data`); the relative ridge is 1e-4 unless `CTX_RIDGE`
//! says otherwise. Figures and their reading: BENCHMARKS.md, "What any per-token or
//! context-summary map can recover".

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use faer::linalg::solvers::Solve;
use faer::{Mat, Side};
use scd_models::corpus::{self, Corpus};
use scd_models::tokenizer::Tokenizer;
use scd_models::translator::moments::Moments;
use scd_models::{AdapterMode, Capture, GgufFile, Input, Llama, LogitsWanted, LoraAdapter};

/// Feature blocks, in column order: name and whether it is `kv`- or `hidden`-wide.
const BLOCKS: [(&str, bool); 7] = [
    ("KV", true),
    ("H", false),
    ("mean KV", true),
    ("ema KV", true),
    ("prev KV", true),
    ("mean H", false),
    ("ema H", false),
];

const SETS: [(&str, &[usize]); 7] = [
    ("R", &[0]),
    ("R+prev", &[0, 4]),
    ("R+ctx", &[0, 2, 3]),
    ("R+ctx+prev", &[0, 2, 3, 4]),
    ("H", &[1]),
    ("H+R", &[0, 1]),
    ("all", &[0, 1, 2, 3, 4, 5, 6]),
];

const EMA: f32 = 0.9;
/// Relative ridge strength; `CTX_RIDGE` overrides it.
const RIDGE: f64 = 1e-4;

type BoxError = Box<dyn std::error::Error>;

/// Running mean (inclusive) and moving average of the rows of `x` `(T, d)`, and each row's
/// predecessor (zeros before the first).
fn context(x: &Tensor) -> Result<[Tensor; 3], BoxError> {
    let (t, d) = x.dims2()?;
    let rows = x.to_vec2::<f32>()?;
    let (mut mean, mut ema, mut prev) = (vec![0f32; t * d], vec![0f32; t * d], vec![0f32; t * d]);
    let mut sum = vec![0f32; d];
    for (i, row) in rows.iter().enumerate() {
        for j in 0..d {
            sum[j] += row[j];
            mean[i * d + j] = sum[j] / (i + 1) as f32;
            ema[i * d + j] = if i == 0 {
                row[j]
            } else {
                EMA * ema[(i - 1) * d + j] + (1.0 - EMA) * row[j]
            };
            if i > 0 {
                prev[i * d + j] = rows[i - 1][j];
            }
        }
    }
    let mk = |v: Vec<f32>| Tensor::from_vec(v, (t, d), &Device::Cpu);
    Ok([mk(mean)?, mk(ema)?, mk(prev)?])
}

/// Per layer: the feature blocks (in [`BLOCKS`] order) and the target `[K | V]` of the expert.
fn rows(
    producer: &Llama,
    consumer: &Llama,
    tokens: &[u32],
    layers: &[usize],
) -> Result<Vec<(Vec<Tensor>, Tensor)>, BoxError> {
    let capture = Capture {
        k_pre_rope: true,
        v: true,
        h_in: true,
        hidden: false,
        layers: Some(layers.to_vec()),
    };
    let run = |m: &Llama| {
        m.forward(
            Input::new(tokens)
                .capture(capture.clone())
                .logits(LogitsWanted::None),
        )
    };
    let (p, c) = (run(producer)?, run(consumer)?);
    let mut out = Vec::new();
    for &l in layers {
        let (pl, cl) = (
            p.layer(l).ok_or("no capture")?,
            c.layer(l).ok_or("no capture")?,
        );
        let need = |t: &Option<Tensor>| t.clone().ok_or("capture without a tensor");
        let kv = Tensor::cat(&[need(&pl.k_pre_rope)?, need(&pl.v)?], 1)?;
        let h = need(&pl.h_in)?;
        let y = Tensor::cat(&[need(&cl.k_pre_rope)?, need(&cl.v)?], 1)?;
        let [mkv, ekv, pkv] = context(&kv)?;
        let [mh, eh, _] = context(&h)?;
        out.push((vec![kv, h, mkv, ekv, pkv, mh, eh], y));
    }
    Ok(out)
}

/// Column offsets of each block and the target in a moment matrix.
fn offsets(kv: usize, hidden: usize) -> (Vec<(usize, usize)>, usize, usize) {
    let mut at = 0;
    let blocks = BLOCKS
        .iter()
        .map(|&(_, is_kv)| {
            let w = if is_kv { kv } else { hidden };
            at += w;
            (at - w, w)
        })
        .collect();
    (blocks, at, at + kv)
}

/// A ridge fit: weights `(features, target)`, the features' means, the target's mean.
type Ridge = (Mat<f64>, Vec<f64>, Vec<f64>);

/// The ridge fit of the target columns `y0..y0 + ny` on the feature columns `cols`.
fn solve(m: &Moments, cols: &[usize], y0: usize, ny: usize) -> Result<Ridge, BoxError> {
    let c = m.second_moment(true);
    let w = m.width();
    let n = cols.len();
    let trace: f64 = cols.iter().map(|&i| c[i * w + i]).sum();
    let ridge = std::env::var("CTX_RIDGE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(RIDGE);
    let lambda = ridge * trace / n as f64;
    let cff = Mat::<f64>::from_fn(n, n, |i, j| {
        c[cols[i] * w + cols[j]] + if i == j { lambda } else { 0.0 }
    });
    let cfy = Mat::<f64>::from_fn(n, ny, |i, j| c[cols[i] * w + y0 + j]);
    let llt = cff.llt(Side::Lower).map_err(|e| {
        format!(
            "the ridge system of {n} features on {} rows is not positive definite ({e:?}): \
                 fit more prompts or raise CTX_RIDGE",
            m.count()
        )
    })?;
    let mean = m.mean();
    Ok((
        llt.solve(&cfy),
        cols.iter().map(|&i| mean[i]).collect(),
        mean[y0..y0 + ny].to_vec(),
    ))
}

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: context_features GGUF ADAPTER [layers] [fit] [held] [tokens]";
    let gguf = args.next().ok_or(usage)?;
    let adapter = args.next().ok_or(usage)?;
    let layers: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "5,15,25,29".into())
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let n_fit: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let n_held: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16);
    let len: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(256);

    let file = GgufFile::open(&gguf)?;
    let tok = Tokenizer::from_gguf(file.content())?;
    let producer = file.load_model()?;
    let lora = LoraAdapter::load(&adapter, producer.config())?;
    let consumer = producer.with_adapter(&lora, AdapterMode::Merge)?;
    let corpus = Corpus::open("brown", std::path::Path::new(".cache/data"))?;
    let tokens = corpus::tokenize_long(&tok, &corpus.train)?;
    // Fitting prompts spread over the first nine tenths, held-out ones over the last tenth.
    let cut = tokens.len() * 9 / 10;
    let windows = |from: usize, to: usize, n: usize| -> Result<Vec<Vec<u32>>, BoxError> {
        let stretch = (to - from) / n.max(1);
        if n == 0 || stretch < len {
            return Err(format!("{} tokens cannot give {n} prompts of {len}", to - from).into());
        }
        Ok((0..n)
            .map(|i| tokens[from + i * stretch..from + i * stretch + len].to_vec())
            .collect())
    };
    let (fit, held) = (windows(0, cut, n_fit)?, windows(cut, tokens.len(), n_held)?);

    let cfg = producer.config();
    // A target row is `[K | V]`, twice the KV width.
    let (kv, hidden) = (2 * cfg.kv_dim(), cfg.hidden_size);
    let (blocks, y0, width) = offsets(kv, hidden);
    let mut moments: Vec<Moments> = layers.iter().map(|_| Moments::new(width)).collect();
    let t0 = Instant::now();
    for (i, p) in fit.iter().enumerate() {
        for (m, (feats, y)) in moments
            .iter_mut()
            .zip(rows(&producer, &consumer, p, &layers)?)
        {
            let mut all: Vec<&Tensor> = feats.iter().collect();
            all.push(&y);
            m.add(&all)?;
        }
        eprintln!(
            "fit prompt {}/{} ({:.0} s)",
            i + 1,
            fit.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    let cols_of = |set: &[usize]| -> Vec<usize> {
        set.iter()
            .flat_map(|&b| blocks[b].0..blocks[b].0 + blocks[b].1)
            .collect()
    };
    let solved: Vec<Vec<_>> = moments
        .iter()
        .map(|m| {
            SETS.iter()
                .map(|(_, set)| solve(m, &cols_of(set), y0, kv))
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()?;
    // Held-out squared errors per layer: raw, then each set; K and V apart.
    let mut err = vec![vec![[0f64; 2]; SETS.len() + 1]; layers.len()];
    let half = kv / 2;
    let weights: Vec<Vec<(Tensor, Tensor, Tensor, Tensor)>> = solved
        .iter()
        .map(|per_set| {
            per_set
                .iter()
                .zip(SETS)
                .map(|((w, mf, my), (_, set))| {
                    let cols: Vec<u32> = cols_of(set).iter().map(|&c| c as u32).collect();
                    let n = cols.len();
                    let wt = Tensor::from_vec(
                        (0..n * kv)
                            .map(|i| w[(i / kv, i % kv)])
                            .collect::<Vec<f64>>(),
                        (n, kv),
                        &Device::Cpu,
                    )?;
                    Ok((
                        Tensor::new(cols.as_slice(), &Device::Cpu)?,
                        Tensor::new(mf.as_slice(), &Device::Cpu)?,
                        wt,
                        Tensor::new(my.as_slice(), &Device::Cpu)?,
                    ))
                })
                .collect::<Result<Vec<_>, BoxError>>()
        })
        .collect::<Result<_, _>>()?;
    let sq = |d: &Tensor| -> Result<[f64; 2], BoxError> {
        let d2 = d.sqr()?;
        Ok([
            d2.narrow(1, 0, half)?.sum_all()?.to_scalar::<f64>()?,
            d2.narrow(1, half, half)?.sum_all()?.to_scalar::<f64>()?,
        ])
    };
    for p in &held {
        for (li, (feats, y)) in rows(&producer, &consumer, p, &layers)?
            .into_iter()
            .enumerate()
        {
            let y = y.to_dtype(DType::F64)?;
            let x = Tensor::cat(&feats.iter().collect::<Vec<_>>(), 1)?.to_dtype(DType::F64)?;
            let raw = sq(&(&y - x.narrow(1, 0, kv)?)?)?;
            let mut slots = vec![raw];
            for (cols, mf, w, my) in &weights[li] {
                let xs = x.index_select(cols, 1)?.broadcast_sub(mf)?;
                let pred = xs.matmul(w)?.broadcast_add(my)?;
                slots.push(sq(&(&y - pred)?)?);
            }
            for (acc, v) in err[li].iter_mut().zip(slots) {
                acc[0] += v[0];
                acc[1] += v[1];
            }
        }
    }
    println!(
        "{} fitting and {} held-out Brown prompts of {len} tokens; held-out squared error of the expert's K | V as a share of raw transfer's",
        fit.len(),
        held.len()
    );
    print!("| layer | raw MSE K / V |");
    for (name, _) in SETS {
        print!(" {name} K / V |");
    }
    println!();
    let rows_held = (held.len() * len) as f64;
    for (li, &l) in layers.iter().enumerate() {
        let raw = err[li][0];
        print!(
            "| {l} | {:.4} / {:.4} |",
            raw[0] / rows_held / half as f64,
            raw[1] / rows_held / half as f64
        );
        for e in &err[li][1..] {
            print!(" {:.3} / {:.3} |", e[0] / raw[0], e[1] / raw[1]);
        }
        println!();
    }
    Ok(())
}
