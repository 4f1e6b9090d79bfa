//! `scd bench ttft`: time to first token of every transfer mode over a grid of
//! links and prompt lengths, through real nodes (an in-process cluster on the embedded store,
//! QUIC between the nodes, links emulated by the producer's pacing, `[links] pace_mbit`), cold
//! (the producer prefills the prompt) and warm (the producer holds the prompt's prefix in its
//! prefix cache, the paper's setting: only encode, transfer and rebuild are left). Per cell:
//! payload, TTFT median and p95 with bootstrap intervals over the repeats, speed-up against the
//! oracle of the same link and cache state in the same run, each stage's median, and the mode's
//! quality on held-out WikiText-2 from the eval harness (`scd_models::eval::evaluate`: KL to
//! the oracle, greedy agreement). Writes JSON that `scd bench ttft --project` reads to fit the
//! cost model (`crate::cost_model`), project it and draw the plots.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use scd_actors::Served;
use scd_models::codec::{codec_with, Codec, CodecOptions, TcRate};
use scd_models::corpus;
use scd_models::eval::{self, EvalConfig, EvalData, Pair};
use scd_models::KernelChoice;
use scd_types::{CodeDType, Mode};
use serde::{Deserialize, Serialize};

use crate::cmd::local_cluster::{config, median, models_section, Cluster};
use crate::paths::DataDirs;

/// Arguments of `scd bench ttft`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF). Required unless --project.
    #[arg(long, env = "SCD_MODEL")]
    pub model: Option<PathBuf>,
    /// The expert: a folder under --experts with adapter.safetensors and translator/.
    #[arg(long, default_value = "sotu")]
    pub expert: String,
    /// Where the shipped experts are.
    #[arg(long, default_value = "experts")]
    pub experts: PathBuf,
    #[command(flatten)]
    pub dirs: DataDirs,
    /// Transfer modes, comma-separated (oracle is always run: the speed-ups are against it).
    /// `auto` runs last in each repeat, after the fixed modes taught the nodes their speeds,
    /// and is checked against the best fixed mode of its cell.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "oracle,raw,q4,droidspeak,reuse,scd,auto"
    )]
    pub modes: Vec<Mode>,
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub lengths: Vec<usize>,
    /// Links from the producer to the consumer: Mbit/s, or `loopback` (unpaced).
    #[arg(long, value_delimiter = ',', default_value = "50,500,loopback")]
    pub links: Vec<String>,
    /// Cache states: `cold` (the producer prefills) and/or `warm` (the producer holds the
    /// prefix in its prefix cache).
    #[arg(long, value_delimiter = ',', default_value = "cold,warm")]
    pub cache: Vec<String>,
    /// Jobs per cell (each on its own WikiText-2 window).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Element type of the codes the producer sends (`[codec] code_dtype`): i8-rows, f16, or
    /// tc (transform-coded: each job's rate chosen for the link from the translator's rate
    /// table, `[codec] ranks = "adaptive"`; kvtc jobs are sized the same way with any dtype).
    #[arg(long, default_value = "i8-rows")]
    pub code_dtype: String,
    /// Held-out WikiText-2 windows of the quality measurement (0: skip it).
    #[arg(long, default_value_t = 4)]
    pub quality_windows: usize,
    /// Prompt tokens of each quality window.
    #[arg(long, default_value_t = 256)]
    pub quality_tokens: usize,
    /// Continuation tokens the KL is measured over (the greedy agreement takes half).
    #[arg(long, default_value_t = 32)]
    pub quality_continuation: usize,
    /// Write the jobs and the cells here as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Instead of measuring: read these `bench ttft` JSON records (comma-separated), fit the cost model, print predicted
    /// against measured, project to the 7B / 32B pairs, and write the plots and the
    /// projection under --plots.
    #[arg(long, value_delimiter = ',')]
    pub project: Vec<PathBuf>,
    /// Where --project writes its SVG / PNG plots and `cost-model.json`.
    #[arg(long, default_value = "docs/m8")]
    pub plots: PathBuf,
    /// The TrueType font of the plots' text (default: DejaVu Sans or Liberation Sans from the
    /// usual system folders).
    #[arg(long)]
    pub font: Option<PathBuf>,
}

/// A link of the grid.
#[derive(Debug, Clone, PartialEq)]
struct Link {
    name: String,
    /// None: loopback, unpaced.
    mbit: Option<u64>,
}

fn parse_link(s: &str) -> anyhow::Result<Link> {
    if s == "loopback" {
        return Ok(Link {
            name: "loopback".into(),
            mbit: None,
        });
    }
    let mbit: u64 = s
        .parse()
        .with_context(|| format!("--links {s:?}: Mbit/s or `loopback`"))?;
    if mbit == 0 {
        bail!("--links: a link is at least 1 Mbit/s");
    }
    Ok(Link {
        name: format!("{mbit}m"),
        mbit: Some(mbit),
    })
}

/// One job's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRow {
    pub link: String,
    pub link_mbit: Option<u64>,
    pub cache: String,
    pub tokens: usize,
    pub mode: Mode,
    pub repeat: usize,
    pub payload_bytes: u64,
    pub ttft_ms: f64,
    pub timings_ms: BTreeMap<String, f64>,
    /// In mode auto: the mode the producer chose, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chosen: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The rate of transform-coded codes (their step), where the job sent them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<f32>,
}

impl JobRow {
    /// The key of this job's codes in the record's quality: the mode it ran in, and the rate
    /// of transform-coded codes (`scd@0.4`).
    pub fn quality_key(&self) -> String {
        let mode = self.chosen.unwrap_or(self.mode);
        match self.step {
            Some(step) => format!("{mode}@{step}"),
            None => mode.as_str().to_string(),
        }
    }
}

/// A quantile with its bootstrap interval.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Quantile {
    pub value: f64,
    pub low: f64,
    pub high: f64,
}

/// The quality of a mode on held-out text (the eval harness's figures).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Quality {
    pub kl: scd_models::stats::Estimate,
    pub greedy_agreement: scd_models::stats::Estimate,
    pub payload_share_of_raw: f64,
}

/// One cell of the grid.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub link: String,
    pub link_mbit: Option<u64>,
    pub cache: String,
    pub tokens: usize,
    pub mode: Mode,
    pub jobs: usize,
    pub payload_mb: f64,
    pub ttft_median_ms: Quantile,
    pub ttft_p95_ms: Quantile,
    /// The oracle's median TTFT over this cell's median (same link, cache state and length).
    pub speedup_vs_oracle: f64,
    /// Each stage's median over the jobs (prefill, encode, transfer, rebuild, first_token).
    pub stages_ms: BTreeMap<String, f64>,
    pub kl: Option<f64>,
    /// The largest KL among the codes the cell's jobs sent (its rates, or auto's choices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_max: Option<f64>,
    pub greedy_agreement: Option<f64>,
    /// In mode auto: how many of the cell's jobs ran in each mode.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub chosen: BTreeMap<String, usize>,
}

/// Auto against the fixed modes in one cell (auto's target: never more than 10% slower than
/// the best fixed mode, never over the quality ceiling where a mode under it exists).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AutoCheck {
    pub link: String,
    pub cache: String,
    pub tokens: usize,
    pub auto_median_ms: f64,
    /// The fastest fixed mode of the cell whose measured KL is under the ceiling (every fixed
    /// mode when the run measured no quality).
    pub best_fixed: Mode,
    pub best_fixed_median_ms: f64,
    /// Auto's median over the best fixed mode's.
    pub ratio: f64,
    /// The largest measured KL of a mode auto chose in this cell.
    pub auto_kl: Option<f64>,
    pub chosen: BTreeMap<String, usize>,
}

/// The whole record `--out` writes and `--project` reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub command: String,
    pub machine: String,
    pub expert: String,
    pub code_dtype: String,
    pub repeats: usize,
    pub quality_config: Option<EvalConfig>,
    pub quality: BTreeMap<String, Quality>,
    pub cells: Vec<Cell>,
    /// The quality ceiling auto and the checks used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_ceiling: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub auto: Vec<AutoCheck>,
    pub jobs: Vec<JobRow>,
}

/// Deterministic resampling (xorshift): the bench needs no statistical-grade generator.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The `q` quantile of `v` (linear interpolation between order statistics).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

/// The `q` quantile of `v` with its percentile bootstrap 95% interval (1,000 resamples).
pub fn bootstrap_quantile(v: &[f64], q: f64, seed: u64) -> Quantile {
    let value = quantile(v, q);
    if v.len() < 2 {
        return Quantile {
            value,
            low: value,
            high: value,
        };
    }
    let mut rng = Xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut stats: Vec<f64> = (0..1000)
        .map(|_| {
            let r: Vec<f64> = (0..v.len()).map(|_| v[rng.below(v.len())]).collect();
            quantile(&r, q)
        })
        .collect();
    stats.sort_by(f64::total_cmp);
    Quantile {
        value,
        low: quantile(&stats, 0.025),
        high: quantile(&stats, 0.975),
    }
}

/// The cells of `jobs`, in grid order, with the quality of each mode when measured.
pub fn cells(jobs: &[JobRow], quality: &BTreeMap<String, Quality>) -> Vec<Cell> {
    let mut keys: Vec<(String, Option<u64>, String, usize, Mode)> = Vec::new();
    for j in jobs {
        let k = (
            j.link.clone(),
            j.link_mbit,
            j.cache.clone(),
            j.tokens,
            j.mode,
        );
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let of = |k: &(String, Option<u64>, String, usize, Mode)| -> Vec<&JobRow> {
        jobs.iter()
            .filter(|j| j.link == k.0 && j.cache == k.2 && j.tokens == k.3 && j.mode == k.4)
            .collect()
    };
    keys.iter()
        .map(|k| {
            let these = of(k);
            let ttft: Vec<f64> = these.iter().map(|j| j.ttft_ms).collect();
            let oracle = of(&(k.0.clone(), k.1, k.2.clone(), k.3, Mode::Oracle));
            let oracle_median = median(oracle.iter().map(|j| j.ttft_ms).collect());
            let mut stages = BTreeMap::new();
            for stage in ["prefill", "encode", "transfer", "rebuild", "first_token"] {
                let v: Vec<f64> = these
                    .iter()
                    .filter_map(|j| j.timings_ms.get(stage).copied())
                    .collect();
                if !v.is_empty() {
                    stages.insert(stage.to_string(), median(v));
                }
            }
            let mut chosen = BTreeMap::new();
            for j in &these {
                if let Some(m) = j.chosen {
                    *chosen.entry(m.as_str().to_string()).or_insert(0) += 1;
                }
            }
            // A cell's quality is that of the codes its jobs sent (auto's: of the modes it
            // ran in; tc codes': of their rates), averaged over its jobs.
            let per_job = |f: fn(&Quality) -> f64| -> Option<Vec<f64>> {
                let v: Option<Vec<f64>> = these
                    .iter()
                    .map(|j| quality.get(&j.quality_key()).map(f))
                    .collect();
                v.filter(|v| !v.is_empty())
            };
            let of_jobs = |f: fn(&Quality) -> f64| -> Option<f64> {
                per_job(f).map(|v| v.iter().sum::<f64>() / v.len() as f64)
            };
            let med = bootstrap_quantile(&ttft, 0.5, 1);
            Cell {
                link: k.0.clone(),
                link_mbit: k.1,
                cache: k.2.clone(),
                tokens: k.3,
                mode: k.4,
                jobs: these.len(),
                payload_mb: median(these.iter().map(|j| j.payload_bytes as f64 / 1e6).collect()),
                ttft_median_ms: med,
                ttft_p95_ms: bootstrap_quantile(&ttft, 0.95, 2),
                speedup_vs_oracle: oracle_median / med.value,
                stages_ms: stages,
                kl: of_jobs(|q| q.kl.value),
                kl_max: per_job(|q| q.kl.value).and_then(|v| v.into_iter().max_by(f64::total_cmp)),
                greedy_agreement: of_jobs(|q| q.greedy_agreement.value),
                chosen,
            }
        })
        .collect()
}

/// Auto against the best fixed mode under `kl_ceiling`, in every cell that ran auto.
pub fn auto_checks(cells: &[Cell], kl_ceiling: f64) -> Vec<AutoCheck> {
    let under = |c: &Cell| c.kl_max.is_none_or(|kl| kl <= kl_ceiling);
    cells
        .iter()
        .filter(|c| c.mode == Mode::Auto)
        .filter_map(|auto| {
            let same =
                |c: &&Cell| c.link == auto.link && c.cache == auto.cache && c.tokens == auto.tokens;
            let best = cells
                .iter()
                .filter(same)
                .filter(|c| c.mode != Mode::Auto && under(c))
                .min_by(|a, b| a.ttft_median_ms.value.total_cmp(&b.ttft_median_ms.value))?;
            let auto_kl = auto.kl_max;
            Some(AutoCheck {
                link: auto.link.clone(),
                cache: auto.cache.clone(),
                tokens: auto.tokens,
                auto_median_ms: auto.ttft_median_ms.value,
                best_fixed: best.mode,
                best_fixed_median_ms: best.ttft_median_ms.value,
                ratio: auto.ttft_median_ms.value / best.ttft_median_ms.value,
                auto_kl,
                chosen: auto.chosen.clone(),
            })
        })
        .collect()
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if !args.project.is_empty() {
        return crate::cost_model::report::run(&args.project, &args.plots, args.font.as_deref());
    }
    let Some(model) = &args.model else {
        bail!("--model is required (or --project with a bench ttft JSON)");
    };
    let model = std::path::absolute(model)?;
    let links: Vec<Link> = args
        .links
        .iter()
        .map(|s| parse_link(s))
        .collect::<anyhow::Result<_>>()?;
    for c in &args.cache {
        if c != "cold" && c != "warm" {
            bail!("--cache {c:?}: cold or warm");
        }
    }
    if args.repeats == 0 || args.lengths.is_empty() || links.is_empty() {
        bail!("nothing to run: give at least one length, one link and one repeat");
    }
    let code_dtype = super::eval::code_dtype(&args.code_dtype)?;
    // The oracle first (the speed-ups are against it), auto last (it weighs what the fixed
    // modes before it measured).
    let mut modes = vec![Mode::Oracle];
    modes.extend(
        args.modes
            .iter()
            .copied()
            .filter(|m| !matches!(m, Mode::Oracle | Mode::Auto)),
    );
    if args.modes.contains(&Mode::Auto) {
        modes.push(Mode::Auto);
    }
    let expert_dir = std::path::absolute(args.experts.join(&args.expert))?;
    let name = args.expert.clone();
    let models = models_section(&model, &[(&name, &expert_dir)]);
    let consumer_cfg = config("consumer-0", "\"consumer\"", &models)?;
    let served = Arc::new(Served::load(&consumer_cfg, kernels).context("loading the models")?);
    let loaded = served
        .experts
        .get(&name)
        .context("the expert is not loaded")?;
    let (translator, index) = loaded.translator.clone();
    let expert = loaded
        .model
        .clone()
        .context("the expert model is not loaded")?;
    let base = served.model()?.clone();

    // Prompts: `repeats` windows of WikiText-2's validation text per length.
    let text = corpus::read_text(&args.dirs.eval_data.join(corpus::WIKITEXT2_VALID))?;
    let tokens = corpus::tokenize_long(&served.tokenizer, &text)?;
    let mut prompts: BTreeMap<usize, Vec<Vec<u32>>> = BTreeMap::new();
    for &len in &args.lengths {
        if len < 2 {
            bail!("--lengths: a prompt has at least 2 tokens");
        }
        prompts.insert(
            len,
            corpus::even_windows(&tokens, len, args.repeats, "validation")?,
        );
    }

    let code_dtype_name = match args.code_dtype.as_str() {
        "i8-rows" => "i8-rows",
        "tc" => "tc",
        _ => "f16",
    };
    // Fixed-width codes at the translator's default ranks, so that every cell sends the same
    // code; a tc code's size is its rate, which is the link's to choose.
    let ranks = match code_dtype {
        CodeDType::TC => "adaptive",
        _ => "default",
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let jobs = runtime.block_on(async {
        let cluster = Cluster::new(served.clone())?;
        let scheduler = cluster
            .start(&config(
                "scheduler",
                "\"scheduler\"",
                &models_section(&model, &[]),
            )?)
            .await?;
        let mut jobs = Vec::new();
        for (li, link) in links.iter().enumerate() {
            let consumer_id = format!("consumer-{li}");
            let consumer = cluster
                .start(&config(&consumer_id, "\"consumer\"", &models)?)
                .await?;
            for cache in &args.cache {
                let warm = cache == "warm";
                let pace = match link.mbit {
                    Some(m) => format!("[links]\npace_mbit = {{ {consumer_id} = {m} }}\n"),
                    None => String::new(),
                };
                let producer = cluster
                    .start(&config(
                        &format!("producer-{li}-{cache}"),
                        "\"producer\"",
                        &format!(
                            "{models}\n[codec]\nranks = \"{ranks}\"\ncode_dtype = \"{code_dtype_name}\"\n\n\
                             [limits]\nprefix_cache_mib = {}\n\n{pace}",
                            if warm { 1024 } else { 0 }
                        ),
                    )?)
                    .await?;
                // One job first: connections up, everything touched once.
                cluster
                    .run(&name, Mode::Q4, &prompts[&args.lengths[0]][0][..64.min(args.lengths[0])])
                    .await?;
                for (&len, windows) in &prompts {
                    for (rep, prompt) in windows.iter().enumerate() {
                        if warm {
                            // The producer prefills the prompt once and keeps its blocks.
                            cluster.run(&name, Mode::Q4, prompt).await?;
                        }
                        for &mode in &modes {
                            let job = cluster.run(&name, mode, prompt).await?;
                            let ttft = job.timings_ms.get("ttft").copied().unwrap_or(f64::NAN);
                            let choice = job.mode_choice.as_ref().filter(|_| mode == Mode::Auto);
                            let step = job.ranks.and_then(|c| c.step);
                            eprintln!(
                                "{} {cache} {len} tokens {mode} #{rep}: {:.2} MB{}, ttft {ttft:.0} ms{}",
                                link.name,
                                job.payload_bytes as f64 / 1e6,
                                match (step, job.ranks.and_then(|c| c.link_mbit)) {
                                    (Some(s), Some(l)) => format!(" at step {s} (link {l:.0} Mbit/s)"),
                                    (Some(s), None) => format!(" at step {s}"),
                                    _ => String::new(),
                                },
                                choice.map_or(String::new(), |c| format!(" ({})", c.reason))
                            );
                            jobs.push(JobRow {
                                link: link.name.clone(),
                                link_mbit: link.mbit,
                                cache: cache.clone(),
                                tokens: len,
                                mode,
                                repeat: rep,
                                payload_bytes: job.payload_bytes,
                                ttft_ms: ttft,
                                timings_ms: job.timings_ms.clone().into_iter().collect(),
                                chosen: choice.map(|c| c.chosen),
                                reason: choice.map(|c| c.reason.clone()),
                                step,
                            });
                        }
                    }
                }
                producer.shutdown(Duration::ZERO).await;
            }
            consumer.shutdown(Duration::ZERO).await;
        }
        scheduler.shutdown(Duration::ZERO).await;
        anyhow::Ok(jobs)
    })?;

    // Quality of each mode on held-out WikiText-2, by the eval harness.
    let mut quality = BTreeMap::new();
    let mut quality_config = None;
    if args.quality_windows > 0 {
        eprintln!(
            "quality: the eval harness on {} windows",
            args.quality_windows
        );
        let data = EvalData::load(&args.dirs.eval_data).context("reading WikiText-2")?;
        let cfg = EvalConfig {
            wikitext_windows: args.quality_windows,
            prefix_tokens: args.quality_tokens,
            continuation_tokens: args.quality_continuation,
            greedy_tokens: (args.quality_continuation / 2).max(1),
            squad_questions: 0,
            ..EvalConfig::default()
        };
        // Every code the jobs sent: each mode (auto's choices included), and each rate of
        // transform-coded codes, in the order the jobs first sent them.
        let mut keys: Vec<(String, Mode, Option<f32>)> = Vec::new();
        for j in &jobs {
            let key = j.quality_key();
            if !keys.iter().any(|k| k.0 == key) {
                keys.push((key, j.chosen.unwrap_or(j.mode), j.step));
            }
        }
        let codecs = keys
            .iter()
            .map(|&(_, mode, step)| {
                let opts = CodecOptions {
                    code_dtype,
                    matmul: kernels.prefill_matmul,
                    tc_rate: step.map_or_else(TcRate::default, |step| TcRate { step }),
                    ..CodecOptions::default()
                };
                codec_with(mode, Some((&translator, index)), &opts)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let codecs: Vec<&dyn Codec> = codecs.iter().map(|c| c.as_ref()).collect();
        let record = eval::evaluate(
            Pair {
                producer: &base,
                consumer: &expert,
            },
            &codecs,
            &served.tokenizer,
            &data,
            &cfg,
            None,
            |p| eprintln!("{p}"),
        )
        .context("the quality of the modes")?;
        for ((key, _, _), m) in keys.iter().zip(&record.results) {
            quality.insert(
                key.clone(),
                Quality {
                    kl: m.kl,
                    greedy_agreement: m.greedy_agreement,
                    payload_share_of_raw: m.payload_share_of_raw,
                },
            );
        }
        quality_config = Some(cfg);
    }

    let kl_ceiling = scd_actors::config::CodecConfig::default().kl_ceiling;
    let cells = cells(&jobs, &quality);
    let record = Record {
        // The program as `scd`, not its path here: the record is shipped.
        command: std::iter::once("scd".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
        machine: machine(),
        expert: name,
        code_dtype: args.code_dtype.clone(),
        repeats: args.repeats,
        quality_config,
        auto: auto_checks(&cells, kl_ceiling),
        kl_ceiling: Some(kl_ceiling),
        cells,
        quality,
        jobs,
    };
    print!("{}", table(&record));
    if let Some(out) = &args.out {
        scd_models::json_file::write_atomic(out, &record)
            .with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// The CPU's model name and core count, for the record.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores")
}

/// The cells as a Markdown table.
pub fn table(r: &Record) -> String {
    let mut s = format!(
        "\n{} expert, {} codes, {} jobs per cell; TTFT in ms with 95% bootstrap intervals; speed-up = oracle median / cell median\n\n\
         | link | cache | tokens | mode | payload MB | TTFT median | TTFT p95 | speed-up | KL | greedy agr. |\n\
         | --- | --- | ---: | --- | ---: | --- | --- | ---: | ---: | ---: |\n",
        r.expert, r.code_dtype, r.repeats
    );
    for c in &r.cells {
        let opt = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |v| format!("{v:.d$}"));
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {:.0} [{:.0}, {:.0}] | {:.0} [{:.0}, {:.0}] | {:.2}x | {} | {} |\n",
            c.link,
            c.cache,
            c.tokens,
            c.mode,
            c.payload_mb,
            c.ttft_median_ms.value,
            c.ttft_median_ms.low,
            c.ttft_median_ms.high,
            c.ttft_p95_ms.value,
            c.ttft_p95_ms.low,
            c.ttft_p95_ms.high,
            c.speedup_vs_oracle,
            opt(c.kl, 4),
            opt(c.greedy_agreement, 3),
        ));
    }
    if !r.auto.is_empty() {
        s.push_str(&format!(
            "\nAuto against the fastest fixed mode under the KL ceiling {}\n\n\
             | link | cache | tokens | auto ran | auto ms | best fixed | its ms | auto / best | auto KL |\n\
             | --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |\n",
            r.kl_ceiling.map_or("-".into(), |k| k.to_string())
        ));
        for a in &r.auto {
            let ran: Vec<String> = a.chosen.iter().map(|(m, n)| format!("{m} x{n}")).collect();
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.0} | {} | {:.0} | {:.2} | {} |\n",
                a.link,
                a.cache,
                a.tokens,
                ran.join(", "),
                a.auto_median_ms,
                a.best_fixed,
                a.best_fixed_median_ms,
                a.ratio,
                a.auto_kl.map_or("-".into(), |k| format!("{k:.4}")),
            ));
        }
        let within = r.auto.iter().filter(|a| a.ratio <= 1.1).count();
        s.push_str(&format!(
            "\nauto within 10% of the best fixed mode in {within} of {} cells\n",
            r.auto.len()
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_their_intervals() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert!((quantile(&v, 0.95) - 4.8).abs() < 1e-12);
        let q = bootstrap_quantile(&v, 0.5, 7);
        assert!(q.low <= q.value && q.value <= q.high);
        assert!(q.low >= 1.0 && q.high <= 5.0);
        let one = bootstrap_quantile(&[2.0], 0.5, 7);
        assert_eq!((one.low, one.value, one.high), (2.0, 2.0, 2.0));
    }

    /// A cell's quality is that of the codes its jobs sent: each tc job's rate, and auto's
    /// choices; auto is checked against the fastest fixed cell whose codes all met the ceiling.
    #[test]
    fn cells_read_the_quality_of_each_jobs_rate_and_auto_skips_cells_over_the_ceiling() {
        let job = |mode: Mode, ttft_ms: f64, step: Option<f32>, chosen: Option<Mode>| JobRow {
            link: "50m".into(),
            link_mbit: Some(50),
            cache: "warm".into(),
            tokens: 1024,
            mode,
            repeat: 0,
            payload_bytes: 1,
            ttft_ms,
            timings_ms: BTreeMap::new(),
            chosen,
            reason: None,
            step,
        };
        let estimate = |value: f64| scd_models::stats::Estimate {
            value,
            low: value,
            high: value,
            n: 1,
        };
        let q = |kl: f64| Quality {
            kl: estimate(kl),
            greedy_agreement: estimate(1.0),
            payload_share_of_raw: 0.1,
        };
        let quality: BTreeMap<String, Quality> = [
            ("oracle", q(0.0)),
            ("raw", q(0.5)),
            ("scd@0.2", q(0.04)),
            ("scd@0.4", q(0.08)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let jobs = vec![
            job(Mode::Oracle, 1000.0, None, None),
            job(Mode::Raw, 100.0, None, None),
            job(Mode::Scd, 200.0, Some(0.2), None),
            job(Mode::Scd, 200.0, Some(0.4), None),
            job(Mode::Auto, 210.0, Some(0.4), Some(Mode::Scd)),
        ];
        assert_eq!(jobs[3].quality_key(), "scd@0.4");
        assert_eq!(jobs[4].quality_key(), "scd@0.4");
        let cells = cells(&jobs, &quality);
        let scd = cells.iter().find(|c| c.mode == Mode::Scd).unwrap();
        assert!((scd.kl.unwrap() - 0.06).abs() < 1e-12, "{:?}", scd.kl);
        assert_eq!(scd.kl_max, Some(0.08));
        let checks = auto_checks(&cells, 0.1);
        assert_eq!(checks.len(), 1);
        // Raw is faster but over the ceiling: scd is the best fixed mode.
        assert_eq!(checks[0].best_fixed, Mode::Scd);
        assert_eq!(checks[0].auto_kl, Some(0.08));
        assert!((checks[0].ratio - 1.05).abs() < 1e-12);
    }

    #[test]
    fn links_parse() {
        assert_eq!(parse_link("loopback").unwrap().mbit, None);
        assert_eq!(parse_link("50").unwrap().mbit, Some(50));
        assert!(parse_link("0").is_err());
        assert!(parse_link("fast").is_err());
    }
}
