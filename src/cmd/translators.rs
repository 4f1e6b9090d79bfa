//! `scd translators list|publish|activate|rollback`: the translator versions of each (base,
//! expert) pair in the cluster's store, through a node's admin endpoint. Nodes follow the live
//! version of their pairs on their own, without a restart. `scd translators convert` and
//! `curve` and `rates` work on a folder, offline: the first rewrites a translator's weights in
//! another storage type, the second measures its quality at a grid of ranks into its manifest,
//! the third the step scales of its transform-coded codes and their quality at a ladder of
//! rates.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use scd_models::translator::artifact::WEIGHTS_FILE;
use scd_models::translator::{Translator, WeightsDtype};
use scd_transport::Control;

use crate::cmd::admin::{ask, exit, show, Failure, Target};

/// Arguments of `scd translators`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd translators list --node producer@127.0.0.1:7101\n  \
    scd translators rollback --node producer@127.0.0.1:7101 --expert mail")]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

/// The pair a command is about.
#[derive(clap::Args)]
pub struct Pair {
    /// The expert (consumer model).
    #[arg(long)]
    pub expert: String,
    /// The base (producer) model id; default: the base model of the node asked.
    #[arg(long)]
    pub base: Option<String>,
}

/// `scd translators` subcommands.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Every pair's versions, the live one marked.
    #[command(after_help = "Example:\n  scd translators list --node producer@127.0.0.1:7101")]
    List {
        #[command(flatten)]
        target: Target,
        /// Print the JSON the node answered with.
        #[arg(long)]
        json: bool,
    },
    /// Publish a translator folder (`scd calibrate --out`) as a version of a pair. The folder
    /// must be readable at the same path on every node of the pair (shared storage, or copied
    /// there first); the node asked checks that it loads and fits its base model.
    #[command(after_help = "Example:\n  \
        scd translators publish --node producer@127.0.0.1:7101 --expert mail \\\n      \
        --translator /srv/scd/translators/mail-v2 --version v2 --activate")]
    Publish {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        pair: Pair,
        /// The translator folder (translator.json, translator.safetensors).
        #[arg(long)]
        translator: PathBuf,
        /// The version's name; default: the label in its translator.json.
        #[arg(long)]
        version: Option<String>,
        /// Make it live at once.
        #[arg(long)]
        activate: bool,
    },
    /// Make a published version live; the nodes of the pair switch to it.
    #[command(after_help = "Example:\n  \
        scd translators activate --node producer@127.0.0.1:7101 --expert mail --version v2")]
    Activate {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        pair: Pair,
        /// The version.
        #[arg(long)]
        version: String,
    },
    /// Rewrite a translator folder's weights in another storage type (a new version: its
    /// content hash changes). Offline; publish the result to use it in a cluster.
    #[command(after_help = "Example:\n  \
        scd translators convert --translator experts/mail/translator --out /tmp/mail-bf16 --weights-dtype bf16")]
    Convert {
        /// The translator folder to read.
        #[arg(long)]
        translator: PathBuf,
        /// Where to write the converted folder (may be the same folder).
        #[arg(long)]
        out: PathBuf,
        /// bf16 or f32.
        #[arg(long, default_value = "bf16")]
        weights_dtype: WeightsDtype,
    },
    /// Measure a translator's held-out quality at a grid of ranks and keep it in its
    /// manifest (the curve producers size codes for a link with; `scd calibrate` measures it
    /// already). Offline; the weights and so the version are unchanged.
    #[command(after_help = "Example:\n  \
        scd translators curve --translator experts/mail/translator \\\n      \
        --producer .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --consumer-adapter experts/mail")]
    Curve(CurveArgs),
    /// Choose the step scales of a translator's transform-coded (tc) codes (K's and H's against
    /// V's) on its held-out calibration prompts, and measure their quality and size at a
    /// ladder of rates, into its manifest (a new version: the manifest is part of the content
    /// hash). Offline.
    #[command(after_help = "Example:\n  \
        scd translators rates --translator experts/mail/translator \\\n      \
        --producer .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --consumer-adapter experts/mail")]
    Rates(RatesArgs),
    /// Fit the base's own PCA basis of K and V (for the kvtc mode: raw KV transform-coded
    /// without translation, SCD's like-for-like baseline) on the translator's fitting prompts,
    /// choose its K step scale and measure it at a ladder of rates on the held-out prompts,
    /// as `rates` does for reuse and scd; into the translator (a new version). Offline.
    #[command(after_help = "Example:\n  \
        scd translators kvtc --translator experts/mail/translator \\\n      \
        --producer .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --consumer-adapter experts/mail")]
    Kvtc(KvtcArgs),
    /// Make the version that was live before the current one live again.
    #[command(after_help = "Example:\n  \
        scd translators rollback --node producer@127.0.0.1:7101 --expert mail")]
    Rollback {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        pair: Pair,
    },
}

/// Arguments of `scd translators curve`.
#[derive(clap::Args)]
pub struct CurveArgs {
    /// The translator folder; its manifest is rewritten with the curve.
    #[arg(long)]
    pub translator: PathBuf,
    /// The models it was calibrated for (experts in the translator's order).
    #[command(flatten)]
    pub models: super::calibrate::PairArgs,
    /// The calibration's seed (the held-out prompts are drawn with it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub dirs: crate::paths::DataDirs,
}

/// Arguments of `scd translators rates`.
#[derive(clap::Args)]
pub struct RatesArgs {
    #[command(flatten)]
    pub curve: CurveArgs,
    /// Held-out prompts to measure on (the calibration's first ones; all of them by default).
    #[arg(long)]
    pub prompts: Option<usize>,
    /// The rates measured after, comma-separated steps.
    #[arg(long, value_delimiter = ',', default_values_t = scd_models::translator::rate_table::DEFAULT_STEPS)]
    pub steps: Vec<f32>,
}

/// Arguments of `scd translators kvtc`.
#[derive(clap::Args)]
pub struct KvtcArgs {
    #[command(flatten)]
    pub rates: RatesArgs,
    /// Fitting prompts the basis is fitted on (the calibration's first ones).
    #[arg(long, default_value_t = 64)]
    pub fit_prompts: usize,
}

pub fn run(args: Args, kernels: &crate::kernels::KernelArgs) -> anyhow::Result<ExitCode> {
    match &args.command {
        Command::Curve(a) => {
            curve(a, kernels)?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Rates(a) => {
            rates(a, kernels)?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Kvtc(a) => {
            kvtc(a, kernels)?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::List { target, json } => return show(target, "translators", *json, print_list),
        Command::Convert {
            translator,
            out,
            weights_dtype,
        } => {
            convert(translator, out, *weights_dtype)?;
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    exit(runtime.block_on(async {
        match args.command {
            // Answered above, without the change machinery.
            Command::List { .. }
            | Command::Convert { .. }
            | Command::Curve(_)
            | Command::Rates(_)
            | Command::Kvtc(_) => Ok(()),
            Command::Publish {
                target,
                pair,
                translator,
                version,
                activate,
            } => {
                let blob = std::path::absolute(&translator)
                    .unwrap_or(translator)
                    .display()
                    .to_string();
                let body = serde_json::json!({
                    "producer": pair.base, "consumer": pair.expert, "version": version,
                    "blob": blob, "activate": activate,
                });
                let v = change(&target, "publish", body).await?;
                let m = &v["published"];
                println!(
                    "published {} of {} -> {}: {} ({})",
                    m["version"].as_str().unwrap_or("?"),
                    m["producer_model"].as_str().unwrap_or("?"),
                    m["consumer_model"].as_str().unwrap_or("?"),
                    short(&m["content_hash"]),
                    m["blob"].as_str().unwrap_or("?"),
                );
                if !v["active"].is_null() {
                    print_active(&v["active"]);
                }
                Ok(())
            }
            Command::Activate {
                target,
                pair,
                version,
            } => {
                let body = serde_json::json!({
                    "producer": pair.base, "consumer": pair.expert, "version": version,
                });
                print_active(&change(&target, "activate", body).await?["active"]);
                Ok(())
            }
            Command::Rollback { target, pair } => {
                let body = serde_json::json!({ "producer": pair.base, "consumer": pair.expert });
                print_active(&change(&target, "rollback", body).await?["active"]);
                Ok(())
            }
        }
    }))
}

/// What `curve` and `rates` measure on: the translator, its models, and the held-out prompts
/// the calibration chose with (same corpus split, checked by its hash, same seed).
struct HeldOutSetup {
    translator: Translator,
    producer: scd_models::Llama,
    experts: Vec<scd_models::Llama>,
    prompts: Vec<Vec<u32>>,
    /// The calibration's fitting prompts.
    fitting: Vec<Vec<u32>>,
    continuation: usize,
}

fn held_out_setup(
    a: &CurveArgs,
    kernels: &crate::kernels::KernelArgs,
) -> anyhow::Result<HeldOutSetup> {
    use scd_models::corpus::{self, Corpus};
    use scd_models::translator::calibrate::{
        fitting_prompts, heldout_prompts, CalibrationText, ChatWrap,
    };
    use scd_models::translator::CalibrationConfig;

    let dir = &a.translator;
    let t = Translator::load(dir).with_context(|| format!("loading {}", dir.display()))?;
    let (producer, tok, experts) = a.models.load(kernels.choice()?)?;
    let m = &t.manifest;
    let cal = &m.calibration;
    let corpus = Corpus::open(&cal.corpus, &a.dirs.data_dir)
        .with_context(|| format!("opening the calibration corpus {}", cal.corpus))?;
    anyhow::ensure!(
        corpus.train_sha256 == cal.text_sha256,
        "the {} train split here ({}) is not the text the translator was calibrated on ({})",
        cal.corpus,
        &corpus.train_sha256[..12.min(corpus.train_sha256.len())],
        &cal.text_sha256[..12.min(cal.text_sha256.len())]
    );
    let tokens = corpus::tokenize_long(&tok, &corpus.train).context("tokenising")?;
    let metric = |k: &str, d: usize| {
        m.metrics
            .get(k)
            .and_then(|v| v.as_u64())
            .map_or(d, |v| v as usize)
    };
    let cfg = CalibrationConfig {
        prefixes: cal.prefixes,
        heldout: cal.heldout,
        prefix_tokens: cal.prefix_tokens,
        heldout_prefix_tokens: metric("heldout_prefix_tokens", 256),
        heldout_continuation: metric("heldout_continuation", 32),
        seed: a.seed,
        chat: (cal.chat_share > 0.0)
            .then(|| ChatWrap::for_tokenizer(&tok, cal.chat_share))
            .transpose()?,
        ..CalibrationConfig::for_model(m.kv_dim)
    };
    let text = CalibrationText {
        corpus: &cal.corpus,
        split: &cal.split,
        sha256: &cal.text_sha256,
        tokens: &tokens,
    };
    let prompts = heldout_prompts(&text, &cfg)?;
    let fitting = fitting_prompts(&text, &cfg)?;
    Ok(HeldOutSetup {
        fitting,
        continuation: cfg.heldout_continuation,
        translator: t,
        producer,
        experts: experts.into_iter().map(|(_, e)| e).collect(),
        prompts,
    })
}

/// `scd translators curve`: the default grid of ranks on the held-out prompts.
fn curve(a: &CurveArgs, kernels: &crate::kernels::KernelArgs) -> anyhow::Result<()> {
    use scd_models::translator::rank_curve;
    use scd_types::{CodeDType, Mode};

    let dir = &a.translator;
    let mut h = held_out_setup(a, kernels)?;
    let before = h.translator.hash();
    let grid = rank_curve::default_grid(h.translator.manifest.r_max);
    let models: Vec<&scd_models::Llama> = h.experts.iter().collect();
    let bar = crate::progress::Progress::new((grid.len() * 2) as u64, "points")?;
    let shared = std::sync::Arc::new(h.translator.clone());
    let measured = rank_curve::measure(
        &shared,
        &h.producer,
        &models,
        &h.prompts,
        h.continuation,
        &grid,
        &[Mode::Reuse, Mode::Scd],
        CodeDType::F16,
        |done, total| bar.set(done as u64, total as u64),
    )
    .context("measuring the curve")?;
    bar.finish();
    for p in &measured.points {
        let kl: Vec<String> = p.kl.iter().map(|k| format!("{k:.4}")).collect();
        println!(
            "{:<6} {}: KL {}",
            p.mode.to_string(),
            p.ranks,
            kl.join(" / ")
        );
    }
    h.translator.manifest.rank_curve = Some(measured);
    let after = h
        .translator
        .save(dir)
        .with_context(|| format!("writing {}", dir.display()))?;
    anyhow::ensure!(
        after == before,
        "rewriting {} changed its weights ({} -> {}): this build stores them differently",
        dir.display(),
        before.short(),
        after.short()
    );
    println!(
        "{}: curve of {} points written ({})",
        dir.display(),
        grid.len() * 2,
        after.short()
    );
    Ok(())
}

/// `scd translators rates`: the rate table on the held-out prompts.
fn rates(a: &RatesArgs, kernels: &crate::kernels::KernelArgs) -> anyhow::Result<()> {
    use scd_models::translator::rate_table;

    anyhow::ensure!(
        !a.steps.is_empty() && a.steps.iter().all(|s| s.is_finite() && *s > 0.0),
        "--steps must be positive numbers"
    );
    let dir = &a.curve.translator;
    let mut h = held_out_setup(&a.curve, kernels)?;
    let before = h.translator.hash();
    let models: Vec<&scd_models::Llama> = h.experts.iter().collect();
    let search =
        (rate_table::K_SCALES.len() + rate_table::H_SCALES.len()) * rate_table::SEARCH_STEPS.len();
    let total = models.len() * search + 2 * a.steps.len();
    let bar = crate::progress::Progress::new(total as u64, "points")?;
    let shared = std::sync::Arc::new(h.translator.clone());
    let prompts = &h.prompts[..a.prompts.unwrap_or(usize::MAX).min(h.prompts.len())];
    anyhow::ensure!(!prompts.is_empty(), "no held-out prompts to measure on");
    let table = rate_table::measure(
        &shared,
        &h.producer,
        &models,
        prompts,
        h.continuation,
        &a.steps,
        |done, total| bar.set(done as u64, total as u64),
    )
    .context("measuring the rate table")?;
    bar.finish();
    print_points(&table.points);
    for (name, s) in h.translator.manifest.consumers.iter().zip(&table.scales) {
        println!(
            "{}: steps of K x{}, V x{}, H x{}",
            name.name, s[0], s[1], s[2]
        );
    }
    h.translator.manifest.rate_table = Some(table);
    let after = h
        .translator
        .save(dir)
        .with_context(|| format!("writing {}", dir.display()))?;
    println!(
        "{}: rate table written; version {} -> {}",
        dir.display(),
        before.short(),
        after.short()
    );
    Ok(())
}

/// One line per measured rate: each consumer's KL and share of raw's bytes.
fn print_points(points: &[scd_models::translator::RatePoint]) {
    for p in points {
        let cells: Vec<String> =
            p.kl.iter()
                .zip(&p.bytes_share)
                .map(|(k, b)| format!("KL {k:.4} at {:.1}% of raw", 100.0 * b))
                .collect();
        println!(
            "{:<6} step {:<5}: {}",
            p.mode.to_string(),
            p.step,
            cells.join(" / ")
        );
    }
}

/// `scd translators kvtc`.
fn kvtc(a: &KvtcArgs, kernels: &crate::kernels::KernelArgs) -> anyhow::Result<()> {
    use scd_models::translator::{kvtc, rate_table, RateTable};

    let r = &a.rates;
    anyhow::ensure!(
        !r.steps.is_empty() && r.steps.iter().all(|s| s.is_finite() && *s > 0.0),
        "--steps must be positive numbers"
    );
    anyhow::ensure!(a.fit_prompts > 0, "--fit-prompts must be at least 1");
    let dir = &r.curve.translator;
    let mut h = held_out_setup(&r.curve, kernels)?;
    let before = h.translator.hash();
    let fit = &h.fitting[..a.fit_prompts.min(h.fitting.len())];
    let bar = crate::progress::Progress::new(fit.len() as u64, "prompts fitted")?;
    let (layers, tokens) = kvtc::fit(&h.producer, fit, |done, total| {
        bar.set(done as u64, total as u64)
    })
    .context("fitting the base's basis")?;
    bar.finish();
    h.translator.kvtc = Some(layers);
    h.translator.manifest.kvtc = Some(kvtc::KvtcInfo {
        prompts: fit.len(),
        tokens,
        scales: kvtc::KvtcInfo::DEFAULT_SCALES,
    });
    let models: Vec<&scd_models::Llama> = h.experts.iter().collect();
    let prompts = &h.prompts[..r.prompts.unwrap_or(usize::MAX).min(h.prompts.len())];
    anyhow::ensure!(!prompts.is_empty(), "no held-out prompts to measure on");
    let bar = crate::progress::Progress::new(1, "points")?;
    let (scales, points) = rate_table::measure_kvtc(
        &std::sync::Arc::new(h.translator.clone()),
        &h.producer,
        &models,
        prompts,
        h.continuation,
        &r.steps,
        |done, total| bar.set(done as u64, total as u64),
    )
    .context("measuring kvtc's rates")?;
    bar.finish();
    print_points(&points);
    println!("kvtc: steps of K x{}, V x{}", scales[0], scales[1]);
    if let Some(info) = h.translator.manifest.kvtc.as_mut() {
        info.scales = scales;
    }
    let m = &mut h.translator.manifest;
    let experts = m.consumers.len();
    let table = m.rate_table.get_or_insert_with(|| RateTable {
        prompts: prompts.len(),
        prefix_tokens: prompts
            .first()
            .map_or(0, |p| p.len().saturating_sub(1 + h.continuation)),
        continuation: h.continuation,
        scales: vec![rate_table::DEFAULT_SCALES; experts],
        points: Vec::new(),
    });
    table.points.retain(|p| p.mode != scd_types::Mode::Kvtc);
    table.points.extend(points);
    let after = h
        .translator
        .save(dir)
        .with_context(|| format!("writing {}", dir.display()))?;
    println!(
        "{}: kvtc basis ({} prompts, {tokens} tokens) written; version {} -> {}",
        dir.display(),
        fit.len(),
        before.short(),
        after.short()
    );
    Ok(())
}

fn convert(from: &Path, to: &Path, dtype: WeightsDtype) -> anyhow::Result<()> {
    let mut t = Translator::load(from).with_context(|| format!("loading {}", from.display()))?;
    let before = t.hash();
    t.manifest.weights_dtype = dtype;
    let after = t
        .save(to)
        .with_context(|| format!("writing {}", to.display()))?;
    let size = |d: &Path| std::fs::metadata(d.join(WEIGHTS_FILE)).map_or(0, |m| m.len());
    println!(
        "{} ({}) -> {} ({}, {dtype:?}): {:.1} MB",
        from.display(),
        before.short(),
        to.display(),
        after.short(),
        size(to) as f64 / 1e6
    );
    Ok(())
}

async fn change(
    target: &Target,
    what: &str,
    body: serde_json::Value,
) -> Result<serde_json::Value, Failure> {
    let request = Control::Change {
        topic: format!("translators/{what}"),
        body: body.to_string(),
    };
    ask(target, request).await
}

/// A content hash as people read it: its first 12 hex digits.
fn short(hash: &serde_json::Value) -> String {
    hash.as_str()
        .map_or("?".into(), |h| h.chars().take(12).collect())
}

fn print_active(a: &serde_json::Value) {
    println!(
        "live: {} ({})",
        a["version"].as_str().unwrap_or("?"),
        short(&a["content_hash"])
    );
}

fn print_list(v: &serde_json::Value) {
    println!(
        "{:<12} {:<34} {:<24} {:<14} {:<6} blob",
        "expert", "base", "version", "hash", "live"
    );
    for pair in v.as_array().into_iter().flatten() {
        let live = pair["active"]["version"].as_str();
        for m in pair["versions"].as_array().into_iter().flatten() {
            let version = m["version"].as_str().unwrap_or("?");
            println!(
                "{:<12} {:<34} {:<24} {:<14} {:<6} {}",
                pair["consumer"].as_str().unwrap_or("?"),
                pair["producer"].as_str().unwrap_or("?"),
                version,
                short(&m["content_hash"]),
                if live == Some(version) { "*" } else { "" },
                m["blob"].as_str().unwrap_or("?"),
            );
        }
    }
}
