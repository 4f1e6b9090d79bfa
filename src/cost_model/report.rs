//! `scd bench ttft --project`: reads `scd bench ttft` records, fits the cost model to their
//! cells, prints predicted against measured (and a leave-one-link-out check), the crossovers on
//! this machine, the projection to a 7B and a 32B Llama-family pair on one H100 beside the
//! paper's table, and draws the plots (SVG and PNG) into the plots folder.
//!
//! The projection's hardware figures, and where they come from:
//! * H100 SXM: 989 TFLOP/s dense BF16 (NVIDIA H100 Tensor Core GPU datasheet);
//! * a forward pass costs 2 FLOPs per parameter per token (Kaplan et al. 2020, "Scaling Laws
//!   for Neural Language Models", §2.1) plus causal attention, 2 · layers · d_model FLOPs per
//!   token per earlier token;
//! * prefill at 50% of the peak (an assumption: large-batch prefill in vLLM / TensorRT-LLM runs
//!   at 40-60% model FLOPs utilisation); and, as a second rate, the paper's own oracle:
//!   Mistral-7B in 331.9 ms for a prompt whose bf16 K and V are 115.02 MB, i.e. 877 tokens at
//!   128 KiB a token (docs/method.md §1.9), 2,640 tokens/s;
//! * K and V per token in bf16 from the published configs: Mistral-7B / Llama-3-8B shape, 32
//!   layers of 8 KV heads of 128 (128 KiB); a Llama-architecture 32B (Qwen2.5-32B's shape), 64
//!   layers of 8 KV heads of 128 (256 KiB).
//!
//! What is carried over from this machine: each mode's payload as a share of raw's, its encode
//! and rebuild as a share of the prefill, and the layer-wise overlap. The fixed cost `t0` of
//! this cluster's job path is left out of the projection (it is the scheduler's, not the
//! modes').

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use scd_types::Mode;

use super::{crossover, fit, median, relative_error, Cache, Measured, Model, Point};
use crate::cmd::bench_ttft::{Cell, Quality, Record};

/// The paper's Mistral-7B pair at 200 Gbit/s (docs/method.md §1.9): mode, payload MB, TTFT ms,
/// speed-up, KL.
pub const PAPER: [(Mode, f64, f64, f64, f64); 6] = [
    (Mode::Oracle, 0.0, 331.9, 1.00, 0.0),
    (Mode::Raw, 115.02, 145.5, 2.28, 3.1209),
    (Mode::Q4, 28.76, 59.2, 5.60, 6.1887),
    (Mode::DroidSpeak, 127.34, 198.7, 1.67, 0.1459),
    (Mode::Reuse, 69.02, 118.2, 2.81, 0.1661),
    (Mode::Scd, 87.31, 125.2, 2.65, 0.1105),
];

/// A projected model pair on one GPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pair {
    pub name: &'static str,
    pub params: f64,
    pub layers: f64,
    pub d_model: f64,
    /// bf16 K and V bytes per token.
    pub kv_bytes_per_token: f64,
}

pub const PAIRS: [Pair; 2] = [
    Pair {
        name: "7B (Mistral-7B shape)",
        params: 7.24e9,
        layers: 32.0,
        d_model: 4096.0,
        kv_bytes_per_token: 131_072.0,
    },
    Pair {
        name: "32B (Qwen2.5-32B shape)",
        params: 32.8e9,
        layers: 64.0,
        d_model: 5120.0,
        kv_bytes_per_token: 262_144.0,
    },
];

/// H100 SXM dense BF16, FLOP/s.
pub const H100_BF16_FLOPS: f64 = 989e12;
/// The assumed prefill utilisation.
pub const PREFILL_MFU: f64 = 0.5;
/// The paper's oracle rate, tokens/s (877 tokens in 331.9 ms).
pub const PAPER_TOKENS: f64 = 877.0;

/// The measured cells as the model's points (TTFT medians in seconds).
pub fn measured(cells: &[Cell]) -> Vec<Measured> {
    cells
        .iter()
        .filter(|c| c.ttft_median_ms.value.is_finite())
        .map(|c| Measured {
            point: Point {
                mode: c.mode,
                cache: if c.cache == "warm" {
                    Cache::Warm
                } else {
                    Cache::Cold
                },
                tokens: c.tokens as f64,
                bits_per_s: c.link_mbit.map(|m| m as f64 * 1e6),
                payload_bytes: c.payload_mb * 1e6,
            },
            ttft_s: c.ttft_median_ms.value / 1e3,
        })
        .collect()
}

/// Each mode's payload per token on this machine (median over its cells), bytes.
fn bytes_per_token(cells: &[Cell]) -> BTreeMap<Mode, f64> {
    let mut by: BTreeMap<Mode, Vec<f64>> = BTreeMap::new();
    for c in cells {
        by.entry(c.mode)
            .or_default()
            .push(c.payload_mb * 1e6 / c.tokens as f64);
    }
    by.into_iter().map(|(m, v)| (m, median(v))).collect()
}

/// The projected model of `pair` at `prefill_tokens_per_s` (None: the FLOP bound at the
/// assumed utilisation), carrying over the codec shares and the overlap of `here`.
/// `shares`: each mode's encode + rebuild as a share of the prefill, where measured in-process
/// (they replace the fitted ones, whose job-path overlap hides most of them).
pub fn projected(
    here: &Model,
    pair: &Pair,
    paper_rate: bool,
    at_tokens: f64,
    shares: &BTreeMap<String, f64>,
) -> Model {
    let (p1, p2) = if paper_rate {
        (1.0 / (PAPER_TOKENS / 0.3319), 0.0)
    } else {
        let rate = H100_BF16_FLOPS * PREFILL_MFU;
        (
            2.0 * pair.params / rate,
            2.0 * pair.layers * pair.d_model / rate,
        )
    };
    let here_per_token = here.prefill(at_tokens) / at_tokens;
    let there_per_token = p1 + p2 * at_tokens;
    Model {
        t0: 0.0,
        t0_transfer: 0.0,
        p1,
        p2,
        codec_s_per_token: here
            .codec_s_per_token
            .iter()
            .map(|(m, c)| {
                let share = shares.get(m).copied().unwrap_or(c / here_per_token);
                (m.clone(), share * there_per_token)
            })
            .collect(),
        overlap: here.overlap,
        loopback_bits_per_s: here.loopback_bits_per_s,
    }
}

/// Each mode's encode + rebuild as a share of the producer's prefill, from an `scd eval`
/// record's stage times (run in-process, one stage after the other); empty when unreadable.
pub fn eval_shares(path: &Path) -> BTreeMap<String, f64> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return BTreeMap::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for r in v["results"].as_array().into_iter().flatten() {
        let t = &r["timing"];
        let (Some(m), Some(p), Some(e), Some(b)) = (
            r["method"].as_str(),
            t["producer_prefill_ms"].as_f64(),
            t["encode_ms"].as_f64(),
            t["rebuild_ms"].as_f64(),
        ) else {
            continue;
        };
        if m != "oracle" && p > 0.0 {
            out.insert(m.to_string(), (e + b) / p);
        }
    }
    out
}

pub fn run(inputs: &[PathBuf], plots: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    let mut cells: Vec<Cell> = Vec::new();
    let mut quality: BTreeMap<String, Quality> = BTreeMap::new();
    let mut machine = String::new();
    let mut expert = String::new();
    for input in inputs {
        let text = std::fs::read_to_string(input)
            .with_context(|| format!("reading {}", input.display()))?;
        let r: Record = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a `scd bench ttft` record", input.display()))?;
        // Auto's cells are other modes' jobs: the model is of the fixed modes.
        cells.extend(r.cells.into_iter().filter(|c| c.mode != Mode::Auto));
        if quality.is_empty() {
            quality = r.quality;
        }
        machine = r.machine;
        expert = r.expert;
    }
    if cells.is_empty() {
        bail!("no cells in the records");
    }
    let points = measured(&cells);
    let model = fit(&points)?;
    let errors: Vec<f64> = points.iter().map(|m| relative_error(&model, m)).collect();
    let median_error = median(errors.clone());

    // Leave one link out: fit without its cells, predict them.
    let mut links: Vec<Option<u64>> = cells.iter().map(|c| c.link_mbit).collect();
    links.sort();
    links.dedup();
    let mut held_out = Vec::new();
    for link in &links {
        let rate = link.map(|m| m as f64 * 1e6);
        let (test, train): (Vec<Measured>, Vec<Measured>) = points
            .iter()
            .cloned()
            .partition(|m| m.point.bits_per_s == rate && m.point.mode != Mode::Oracle);
        if test.is_empty() || link.is_none() {
            continue;
        }
        let m = fit(&train)?;
        held_out.extend(test.iter().map(|t| relative_error(&m, t)));
    }
    let held_out_error = median(held_out);

    let mut out = String::new();
    out.push_str(&format!(
        "Cost model fitted to {} cells ({}, expert {expert})\n\n\
         t0 = {:.1} ms (oracle), tx = {:.1} ms (transfers), prefill P(L) = {:.4} ms x L + {:.3e} ms x L^2 ({:.0} tokens/s at L = 1,024), \
         overlap w = {:.2}, loopback {:.1} Gbit/s\n",
        points.len(),
        machine,
        model.t0 * 1e3,
        model.t0_transfer * 1e3,
        model.p1 * 1e3,
        model.p2 * 1e3,
        1024.0 / model.prefill(1024.0),
        model.overlap,
        model.loopback_bits_per_s / 1e9
    ));
    out.push_str("encode + rebuild per token (share of the prefill at L = 1,024):");
    for (m, c) in &model.codec_s_per_token {
        out.push_str(&format!(
            " {m} {:.4} ms ({:.1}%);",
            c * 1e3,
            100.0 * c * 1024.0 / model.prefill(1024.0)
        ));
    }
    out.push_str(&format!(
        "\n\nmedian |predicted - measured| / measured: {:.1}% over every cell (90th percentile {:.1}%); \
         {:.1}% leaving each paced link out of the fit and predicting its cells\n\n",
        100.0 * median_error,
        100.0 * crate::cmd::bench_ttft::quantile(&errors, 0.9),
        100.0 * held_out_error
    ));
    out.push_str("| link | cache | tokens | mode | measured ms | predicted ms | error |\n| --- | --- | ---: | --- | ---: | ---: | ---: |\n");
    let mut rows = Vec::new();
    for (c, m) in cells.iter().zip(&points) {
        let p = model.predict(&m.point);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:+.1}% |\n",
            c.link,
            c.cache,
            c.tokens,
            c.mode,
            m.ttft_s * 1e3,
            p * 1e3,
            100.0 * (p - m.ttft_s) / m.ttft_s
        ));
        rows.push(serde_json::json!({
            "link": c.link, "cache": c.cache, "tokens": c.tokens, "mode": c.mode,
            "measured_ms": m.ttft_s * 1e3, "predicted_ms": p * 1e3,
        }));
    }

    // Crossovers on this machine.
    let bpt = bytes_per_token(&cells);
    let mut tokens: Vec<usize> = cells.iter().map(|c| c.tokens).collect();
    tokens.sort();
    tokens.dedup();
    let mut crossovers = Vec::new();
    out.push_str("\nCrossovers on this machine (model): the link above which each mode is faster than the oracle, and below which scd is faster than raw\n\n");
    out.push_str("| tokens | cache | mode | beats the oracle above | scd beats it below |\n| ---: | --- | --- | ---: | ---: |\n");
    for &l in &tokens {
        let l = l as f64;
        for cache in [Cache::Cold, Cache::Warm] {
            for (&mode, &b) in &bpt {
                if mode == Mode::Oracle {
                    continue;
                }
                let vs_oracle = crossover(
                    &model,
                    (mode, b * l),
                    (Mode::Oracle, 0.0),
                    l,
                    cache,
                    1e5,
                    1e12,
                );
                let scd_vs = bpt.get(&Mode::Scd).and_then(|&s| {
                    (mode != Mode::Scd)
                        .then(|| {
                            crossover(
                                &model,
                                (Mode::Scd, s * l),
                                (mode, b * l),
                                l,
                                cache,
                                1e5,
                                1e12,
                            )
                        })
                        .flatten()
                });
                out.push_str(&format!(
                    "| {l} | {cache:?} | {mode} | {} | {} |\n",
                    rate_text(vs_oracle, &model, mode, b * l, l, cache),
                    scd_vs.map_or("-".into(), mbit_text)
                ));
                crossovers.push(serde_json::json!({
                    "tokens": l, "cache": cache, "mode": mode,
                    "beats_oracle_above_mbit": vs_oracle.map(|r| r / 1e6),
                    "scd_beats_it_below_mbit": scd_vs.map(|r| r / 1e6),
                }));
            }
        }
    }

    // Projection.
    let shares_from = PathBuf::from(format!("docs/m3/{expert}-main.json"));
    let shares = eval_shares(&shares_from);
    out.push_str(&format!(
        "\nEncode + rebuild as a share of the prefill carried to the projection: {} ({})\n",
        shares
            .iter()
            .map(|(m, s)| format!("{m} {:.1}%", 100.0 * s))
            .collect::<Vec<_>>()
            .join(", "),
        if shares.is_empty() {
            "the fitted ones: no eval record found".to_string()
        } else {
            format!("in-process stage times of {}", shares_from.display())
        }
    ));
    let raw_bpt = bpt.get(&Mode::Raw).copied().unwrap_or(f64::NAN);
    let share = |m: Mode| bpt.get(&m).map_or(f64::NAN, |b| b / raw_bpt);
    let gbits = [10.0, 25.0, 50.0, 100.0, 200.0, 400.0];
    let project_modes: Vec<Mode> = bpt.keys().copied().filter(|m| *m != Mode::Oracle).collect();
    let mut projection = Vec::new();
    out.push_str(&format!(
        "\nProjection, warm producer (the paper's setting), {PAPER_TOKENS} tokens (the paper's prompt), speed-up against the oracle; payload shares of raw from this machine: {}\n",
        project_modes
            .iter()
            .map(|m| format!("{m} {:.2}", share(*m)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for pair in &PAIRS {
        for paper_rate in [false, true] {
            if paper_rate && pair.name.starts_with("32B") {
                continue;
            }
            let pm = projected(&model, pair, paper_rate, PAPER_TOKENS, &shares);
            let oracle = pm.prefill(PAPER_TOKENS);
            out.push_str(&format!(
                "\n{} on one H100, prefill {} ({:.0} tokens/s): oracle {:.1} ms\n\n| mode | payload MB | {} |\n| --- | ---: |{}\n",
                pair.name,
                if paper_rate { "at the paper's measured rate" } else { "at 50% of 989 TFLOP/s" },
                PAPER_TOKENS / oracle,
                oracle * 1e3,
                gbits.iter().map(|g| format!("{g} Gbit/s")).collect::<Vec<_>>().join(" | "),
                " ---: |".repeat(gbits.len())
            ));
            for &mode in &project_modes {
                let bytes = share(mode) * pair.kv_bytes_per_token * PAPER_TOKENS;
                let mut cols = Vec::new();
                for &g in &gbits {
                    let t = pm.predict(&Point {
                        mode,
                        cache: Cache::Warm,
                        tokens: PAPER_TOKENS,
                        bits_per_s: Some(g * 1e9),
                        payload_bytes: bytes,
                    });
                    cols.push(format!("{:.2}x", oracle / t));
                    projection.push(serde_json::json!({
                        "pair": pair.name, "paper_rate": paper_rate, "mode": mode, "gbit": g,
                        "payload_mb": bytes / 1e6, "ttft_ms": t * 1e3, "oracle_ms": oracle * 1e3,
                        "speedup": oracle / t,
                    }));
                }
                let above = crossover(
                    &pm,
                    (mode, bytes),
                    (Mode::Oracle, 0.0),
                    PAPER_TOKENS,
                    Cache::Warm,
                    1e6,
                    1e13,
                );
                out.push_str(&format!(
                    "| {mode} | {:.1} | {} |  beats the oracle above {}\n",
                    bytes / 1e6,
                    cols.join(" | "),
                    rate_text(above, &pm, mode, bytes, PAPER_TOKENS, Cache::Warm)
                ));
            }
            let bytes_of = |m: Mode| share(m) * pair.kv_bytes_per_token * PAPER_TOKENS;
            let scd_raw = crossover(
                &pm,
                (Mode::Scd, bytes_of(Mode::Scd)),
                (Mode::Raw, bytes_of(Mode::Raw)),
                PAPER_TOKENS,
                Cache::Warm,
                1e6,
                1e13,
            );
            out.push_str(&format!(
                "\nscd is faster than raw below {}\n",
                scd_raw.map_or("- (on one side everywhere)".into(), mbit_text)
            ));
        }
    }
    out.push_str("\nThe paper (docs/method.md §1.9), MistralLite to Mistral-7B, 200 Gbit/s:\n\n| mode | payload MB | TTFT ms | speed-up | KL |\n| --- | ---: | ---: | ---: | ---: |\n");
    for (m, mb, ms, s, kl) in PAPER {
        out.push_str(&format!(
            "| {m} | {mb:.2} | {ms:.1} | {s:.2}x | {kl:.4} |\n"
        ));
    }
    print!("{out}");

    std::fs::create_dir_all(plots).with_context(|| format!("creating {}", plots.display()))?;
    let json = serde_json::json!({
        "inputs": inputs,
        "machine": machine,
        "model": model,
        "median_relative_error": median_error,
        "leave_one_link_out_median_error": held_out_error,
        "cells": rows,
        "crossovers": crossovers,
        "projection_codec_shares": shares,
        "projection": projection,
        "hardware": {
            "h100_bf16_flops": H100_BF16_FLOPS, "prefill_mfu": PREFILL_MFU,
            "paper_tokens": PAPER_TOKENS, "pairs": PAIRS,
        },
    });
    scd_models::json_file::write_atomic(&plots.join("cost-model.json"), &json)?;
    std::fs::write(plots.join("cost-model.md"), &out)?;
    super::plots::draw_all(plots, &cells, &quality, &model, &bpt, &shares, font)?;
    eprintln!(
        "wrote {}/cost-model.{{json,md}} and the plots",
        plots.display()
    );
    Ok(())
}

fn mbit_text(r: f64) -> String {
    if r >= 1e9 {
        format!("{:.1} Gbit/s", r / 1e9)
    } else {
        format!("{:.0} Mbit/s", r / 1e6)
    }
}

/// A crossover for the table: the rate, or which side wins everywhere.
fn rate_text(
    r: Option<f64>,
    model: &Model,
    mode: Mode,
    bytes: f64,
    tokens: f64,
    cache: Cache,
) -> String {
    match r {
        Some(r) => mbit_text(r),
        None => {
            let fast = model.predict(&Point {
                mode,
                cache,
                tokens,
                bits_per_s: Some(1e13),
                payload_bytes: bytes,
            });
            if fast < model.t0 + model.prefill(tokens) {
                "any link".into()
            } else {
                "never".into()
            }
        }
    }
}
