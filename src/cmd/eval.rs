//! `scd eval`: the quality harness (methods of building the consumer's cache against the
//! oracle, on WikiText-2 and SQuAD), and `scd eval drift`, the drift report of shipped experts.

use scd_models::KernelChoice;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use std::sync::Arc;

use scd_models::codec::{codec_with, Codec, CodecOptions};
use scd_models::corpus::{self, Corpus};
use scd_models::eval::{self, DriftOptions, EvalConfig, EvalData, FileInfo, Pair};
use scd_models::expert::{expert_files, Manifest};
use scd_models::translator::{Ranks, Translator};
use scd_models::{AdapterMode, Llama, LoraAdapter};
use scd_types::CodeDType;
use scd_types::Mode;

use crate::paths::DataDirs;

/// Arguments of `scd eval`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd eval --producer .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --consumer-adapter experts/sotu/adapter.safetensors \\\n      --translator experts/sotu/translator --methods oracle,raw,reuse,scd\n  \
    scd eval drift --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --expert experts/melville")]
pub struct Args {
    #[command(subcommand)]
    pub drift: Option<Sub>,
    /// The producer (base) model, GGUF or Hugging Face directory.
    #[arg(long, env = "SCD_MODEL")]
    pub producer: Option<PathBuf>,
    /// The consumer's weights (the same base for an expert).
    #[arg(long)]
    pub consumer: Option<PathBuf>,
    /// The consumer's LoRA adapter (an expert).
    #[arg(long)]
    pub consumer_adapter: Option<PathBuf>,
    /// Transfer modes, comma-separated: oracle, raw, q4, q2, kvtc, droidspeak, reuse, scd
    /// (the last four need --translator; kvtc is measured at each of --tc-steps).
    #[arg(long, default_value = "oracle,raw", value_delimiter = ',')]
    pub methods: Vec<Mode>,
    /// The pair's translator folder (scd calibrate), for kvtc, droidspeak, reuse and scd.
    #[arg(long)]
    pub translator: Option<PathBuf>,
    /// Ranks of the reuse / scd codes as K,V,H (default: the translator's).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Option<Vec<usize>>,
    /// Element type of the reuse / scd codes: f16, bf16, f32, i8-rows, or tc
    /// (transform-coded: a step per component, entropy-coded; see --tc-steps).
    #[arg(long, default_value = "f16")]
    pub code_dtype: String,
    /// Rates of tc codes, comma-separated: each a step, the error a code component may leave
    /// in the expert's rows before the translator's per-layer scales (larger, fewer bytes);
    /// kvtc, and reuse and scd with --code-dtype tc, are measured at each.
    #[arg(long, value_delimiter = ',', default_value = "0.3")]
    pub tc_steps: Vec<f32>,
    /// Rates of kvtc, comma-separated steps (default: --tc-steps): its bytes at a step differ
    /// from scd's, so a frontier gives each the steps that land on the same shares of raw.
    #[arg(long, value_delimiter = ',')]
    pub kvtc_steps: Option<Vec<f32>>,
    /// Group size of q4 and q2.
    #[arg(long, default_value_t = 32)]
    pub q4_group: usize,
    /// Patch budget of scd: the first K layers of the translator's greedy order (default:
    /// the translator's chosen set).
    #[arg(long)]
    pub patch_k: Option<usize>,
    /// Text the continuation windows are cut from: `wikitext2` (its validation text), or a
    /// corpus (`mail`, `sotu`, `moby-dick`, a folder, ...) whose validation split is used:
    /// an expert's own held-out text.
    #[arg(long, default_value = "wikitext2")]
    pub text: String,
    #[command(flatten)]
    pub common: Common,
    /// Where to write the JSON record.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where to write the Markdown table.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// Harness settings shared by `eval` and `eval drift`.
#[derive(clap::Args, Clone)]
pub struct Common {
    /// Continuation windows (of WikiText-2, or of the text `scd eval --text` names).
    #[arg(long, default_value_t = 16)]
    pub wikitext_windows: usize,
    /// Prompt tokens per window.
    #[arg(long, default_value_t = 256)]
    pub prefix_tokens: usize,
    /// Continuation tokens per window (teacher-forced).
    #[arg(long, default_value_t = 64)]
    pub continuation_tokens: usize,
    /// Greedy tokens per window compared with the oracle.
    #[arg(long, default_value_t = 32)]
    pub greedy_tokens: usize,
    /// SQuAD answerable questions.
    #[arg(long, default_value_t = 200)]
    pub squad_questions: usize,
    /// Greedy answer budget (tokens).
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: usize,
    /// Seed of the samples and of the bootstrap intervals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub dirs: DataDirs,
}

/// `scd eval drift`.
#[derive(clap::Subcommand)]
pub enum Sub {
    /// Base vs expert perplexity and KL on the expert's domain and WikiText-2, and the raw
    /// transfer against the oracle, for each expert folder (adapter + manifest).
    #[command(after_help = "Example:\n  \
        scd eval drift --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --expert experts/melville --expert experts/sotu")]
    Drift(DriftArgs),
    /// Multi-document QA: each SQuAD question's gold paragraph among 3-7 distractor
    /// paragraphs, answered with the documents prefilled together (full recompute) and compiled
    /// alone and stitched (no recompute), and with --writer, --packet and --joint the SemPIC,
    /// packet and joint modes; F1 and exact match with bootstrap intervals.
    #[command(after_help = "Examples:\n  \
        scd eval multidoc --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --questions 300\n  \
        scd eval multidoc --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --task needle \
        --writer experts/sempic-writer/adapter.safetensors --packet experts/packet-boundary")]
    Multidoc(MultidocArgs),
    /// Draw the quality-bytes frontier of `scd eval` records: KL to the oracle against the
    /// payload's share of raw's bytes, log-log, one series per method (a line through a
    /// method's rates, a marker where it has one point), into OUT.svg and OUT.png.
    #[command(after_help = "Example:\n  \
        scd eval plot --json docs/m13/sotu-frontier.json --out docs/m13/sotu-frontier --title sotu")]
    Plot(PlotArgs),
}

/// Arguments of `scd eval plot`.
#[derive(clap::Args)]
pub struct PlotArgs {
    /// `scd eval --json` records (their methods are drawn together).
    #[arg(long, required = true)]
    pub json: Vec<PathBuf>,
    /// The plot's path without extension.
    #[arg(long)]
    pub out: PathBuf,
    /// The plot's title (default: the consumer's adapter).
    #[arg(long)]
    pub title: Option<String>,
    /// A TrueType font for the text (default: the first of a few usual system paths).
    #[arg(long)]
    pub font: Option<PathBuf>,
}

/// Arguments of `scd eval multidoc`.
#[derive(clap::Args)]
pub struct MultidocArgs {
    /// The model (reader, and writer of the compiled documents).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// A SemPIC writer's adapter (`scd sempic train`): adds the SemPIC mode, documents
    /// compiled by the model with this adapter merged.
    #[arg(long)]
    pub writer: Option<PathBuf>,
    /// KV-Packet boundary tokens for the model (`scd sempic boundary`, a folder): adds the
    /// packet mode.
    #[arg(long)]
    pub packet: Option<PathBuf>,
    /// Boundary tokens trained for the writer (`scd sempic boundary --writer`, a folder): adds
    /// the joint mode (needs --writer).
    #[arg(long)]
    pub joint: Option<PathBuf>,
    /// The questions: `squad` (each gold SQuAD paragraph among distractor paragraphs) or
    /// `needle` (an invented fact hidden in one paragraph of WikiText-2's validation text among
    /// others, asked for).
    #[arg(long, default_value = "squad")]
    pub task: String,
    /// Only these modes (comma list of full, none, sempic, packet, joint; full recompute is
    /// always computed as the reference); default: every mode the given files allow.
    #[arg(long)]
    pub modes: Option<String>,
    /// Questions (SQuAD answerable ones of the articles the writer never trains on, a seeded
    /// sample).
    #[arg(long, default_value_t = 300)]
    pub questions: usize,
    /// Fewest distractor paragraphs per question.
    #[arg(long, default_value_t = 3)]
    pub min_distractors: usize,
    /// Most distractor paragraphs per question.
    #[arg(long, default_value_t = 7)]
    pub max_distractors: usize,
    /// Greedy answer budget (tokens).
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: usize,
    /// Seed of the sample, the distractors, their order and the bootstrap intervals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub dirs: DataDirs,
    /// Where to write the JSON record.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Arguments of `scd eval drift`.
#[derive(clap::Args)]
pub struct DriftArgs {
    /// The base model.
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// Expert folders (adapter.safetensors + manifest.json); repeatable.
    #[arg(long = "expert", required = true)]
    pub experts: Vec<PathBuf>,
    /// Windows per text for perplexity and KL.
    #[arg(long, default_value_t = 16)]
    pub windows: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 257)]
    pub window_tokens: usize,
    #[command(flatten)]
    pub common: Common,
    /// Where to write the JSON reports (one array).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where to write the Markdown sections.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

impl Common {
    fn config(&self) -> EvalConfig {
        EvalConfig {
            seed: self.seed,
            wikitext_windows: self.wikitext_windows,
            prefix_tokens: self.prefix_tokens,
            continuation_tokens: self.continuation_tokens,
            greedy_tokens: self.greedy_tokens,
            squad_questions: self.squad_questions,
            answer_tokens: self.answer_tokens,
            qa_template: eval::QA_TEMPLATE.into(),
        }
    }
}

fn adapter_info(path: &Path) -> anyhow::Result<FileInfo> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading the adapter {}", path.display()))?;
    Ok(FileInfo {
        path: path.display().to_string(),
        sha256: corpus::sha256_hex(&bytes),
    })
}

fn with_adapter(base: &Llama, path: &Path) -> anyhow::Result<Llama> {
    let adapter = LoraAdapter::load(path, base.config())
        .with_context(|| format!("loading the adapter {}", path.display()))?;
    base.with_adapter(&adapter, AdapterMode::Merge)
        .context("applying the adapter")
}

/// The `--code-dtype` values of `eval` and `generate`.
pub fn code_dtype(name: &str) -> anyhow::Result<CodeDType> {
    Ok(match name {
        "f16" => CodeDType::F16,
        "bf16" => CodeDType::BF16,
        "f32" => CodeDType::F32,
        "i8-rows" | "int8" => CodeDType::I8_ROWS,
        "tc" => CodeDType::TC,
        other => bail!("unknown code dtype {other:?}: expected f16, bf16, f32, i8-rows or tc"),
    })
}

fn load_data(dirs: &DataDirs) -> anyhow::Result<EvalData> {
    EvalData::load(&dirs.eval_data).with_context(|| {
        format!(
            "reading WikiText-2 and SQuAD under {} (set --eval-data or SCD_EVAL_DATA)",
            dirs.eval_data.display()
        )
    })
}

fn write(path: &Option<PathBuf>, text: &str) -> anyhow::Result<()> {
    match path {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display())),
        None => Ok(()),
    }
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    match args.drift {
        Some(Sub::Drift(d)) => return run_drift(d, kernels),
        Some(Sub::Multidoc(m)) => return run_multidoc(m, kernels),
        Some(Sub::Plot(p)) => return run_plot(&p),
        None => {}
    }
    let Some(producer_path) = &args.producer else {
        bail!("--producer is required (or use `scd eval drift`)");
    };
    let consumer_path = args.consumer.as_ref().unwrap_or(producer_path);
    let (producer, tok) = super::generate::load(producer_path, kernels)?;
    let consumer_base = if consumer_path == producer_path {
        producer.clone()
    } else {
        super::generate::load(consumer_path, kernels)?.0
    };
    let (consumer, adapter) = match &args.consumer_adapter {
        Some(p) => (with_adapter(&consumer_base, p)?, Some(adapter_info(p)?)),
        None => (consumer_base, None),
    };
    let data = load_data(&args.common.dirs)?;
    let data = match args.text.as_str() {
        "wikitext2" => data,
        spec => {
            let c = Corpus::open(spec, &args.common.dirs.data_dir)
                .with_context(|| format!("--text {spec}"))?;
            let path = c.valid_path.display().to_string();
            data.with_text(&format!("{} valid", c.name), &c.valid, &path)
        }
    };
    let cfg = args.common.config();
    let translator = match &args.translator {
        Some(dir) => {
            let t = Translator::load(dir)
                .with_context(|| format!("loading the translator {}", dir.display()))?;
            let expert = t.check_pair(&producer, &consumer)?;
            Some((Arc::new(t), expert))
        }
        None => None,
    };
    let opts = CodecOptions {
        ranks: match &args.ranks {
            Some(r) => match r.as_slice() {
                &[k, v, h] => Some(Ranks { k, v, h }),
                _ => bail!("--ranks takes three numbers: K,V,H"),
            },
            None => None,
        },
        code_dtype: code_dtype(&args.code_dtype)?,
        q4_group: args.q4_group,
        patch_k: args.patch_k,
        tc_rate: Default::default(),
        matmul: kernels.prefill_matmul,
    };
    // kvtc and each translated mode with tc codes once per rate; every other mode once.
    let mut codecs = Vec::new();
    for &m in &args.methods {
        let steps = match (m, &args.kvtc_steps) {
            (Mode::Kvtc, Some(s)) => s,
            _ => &args.tc_steps,
        };
        let coded =
            m == Mode::Kvtc || m.uses_translator_codes() && opts.code_dtype == CodeDType::TC;
        let rates: Vec<_> = match coded {
            true => steps
                .iter()
                .map(|&step| scd_models::codec::TcRate { step })
                .collect(),
            false => vec![opts.tc_rate],
        };
        for tc_rate in rates {
            let o = CodecOptions { tc_rate, ..opts };
            codecs.push(codec_with(
                m,
                translator.as_ref().map(|(t, e)| (t, *e)),
                &o,
            )?);
        }
    }
    let codecs: Vec<&dyn Codec> = codecs.iter().map(|c| c.as_ref()).collect();
    let record = eval::evaluate(
        Pair {
            producer: &producer,
            consumer: &consumer,
        },
        &codecs,
        &tok,
        &data,
        &cfg,
        adapter,
        |p| eprintln!("{p}"),
    )
    .context("evaluating")?;
    let md = record.markdown();
    print!("{md}");
    write(&args.json, &(serde_json::to_string_pretty(&record)? + "\n"))?;
    write(&args.markdown, &md)?;
    Ok(())
}

fn run_drift(args: DriftArgs, kernels: KernelChoice) -> anyhow::Result<()> {
    let (base, tok) = super::generate::load(&args.model, kernels)?;
    let data = load_data(&args.common.dirs)?;
    let mut reports = Vec::new();
    let mut md = String::new();
    for dir in &args.experts {
        let (adapter_path, manifest_path) = expert_files(dir);
        let manifest = Manifest::load(&manifest_path)
            .with_context(|| format!("reading {}", manifest_path.display()))?;
        if manifest.base_model.sha256 != base.identity().sha256 {
            bail!(
                "{} was trained on base {} but --model is {}",
                dir.display(),
                manifest.base_model.sha256,
                base.identity().sha256
            );
        }
        let corpus = Corpus::open(&manifest.corpus.name, &args.common.dirs.data_dir)
            .with_context(|| format!("opening the corpus {}", manifest.corpus.name))?;
        if corpus.valid_sha256 != manifest.corpus.valid_sha256 {
            eprintln!(
                "warning: the {} validation split differs from the one the expert was trained with",
                manifest.corpus.name
            );
        }
        let expert = with_adapter(&base, &adapter_path)?;
        let name = dir
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        let opts = DriftOptions {
            expert: name.clone(),
            corpus,
            windows: args.windows,
            window_tokens: args.window_tokens,
            eval: args.common.config(),
            adapter: Some(adapter_info(&adapter_path)?),
        };
        let report = eval::drift(&base, &expert, &tok, &data, &opts, |p| {
            eprintln!("{name}: {p}")
        })
        .with_context(|| format!("drift of {name}"))?;
        let section = report.markdown();
        println!("{section}");
        md.push_str(&section);
        md.push('\n');
        reports.push(report);
        // Written after every expert: a report of several experts runs for an hour or more on
        // a small machine, and a stop should lose at most the expert in progress.
        if let Some(path) = &args.json {
            scd_models::json_file::write_atomic(path, &reports)?;
        }
        write(&args.markdown, &md)?;
    }
    Ok(())
}

/// `scd eval plot`.
fn run_plot(args: &PlotArgs) -> anyhow::Result<()> {
    let mut points: Vec<(Mode, f64, f64)> = Vec::new();
    let mut title = args.title.clone();
    for path in &args.json {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let record: eval::EvalRecord = serde_json::from_str(&text)
            .with_context(|| format!("{} is not an scd eval record", path.display()))?;
        if title.is_none() {
            // An expert's adapter sits in its folder: the folder's name is the expert's.
            title = record.models.consumer_adapter.as_ref().map(|a| {
                let a = Path::new(&a.path);
                let name = a.parent().and_then(|p| p.file_name()).unwrap_or_default();
                name.to_string_lossy().into_owned()
            });
        }
        points.extend(
            record
                .results
                .iter()
                .map(|m| (m.method, m.payload_share_of_raw, m.kl.value)),
        );
    }
    let title = format!(
        "{}: KL to the oracle against payload",
        title.unwrap_or_else(|| "frontier".into())
    );
    let drawn =
        crate::cost_model::plots::frontier(&args.out, &title, &points, args.font.as_deref())?;
    if drawn {
        println!("{}.svg, {}.png", args.out.display(), args.out.display());
    }
    Ok(())
}

fn run_multidoc(args: MultidocArgs, kernels: KernelChoice) -> anyhow::Result<()> {
    use eval::multidoc::{build_items, evaluate, writer_split, DocCompilers, DocMode};
    use scd_models::boundary::Boundary;
    if args.min_distractors > args.max_distractors {
        bail!("--min-distractors is above --max-distractors");
    }
    let (model, tok) = super::generate::load(&args.model, kernels)?;
    let writer = args
        .writer
        .as_deref()
        .map(|p| with_adapter(&model, p))
        .transpose()?;
    let data = load_data(&args.dirs)?;
    let distractors = (args.min_distractors, args.max_distractors);
    let items = match args.task.as_str() {
        "squad" => {
            // Never a question or a distractor of the writer's training articles.
            let (_, held_out) = writer_split(&data.squad);
            build_items(&held_out, args.questions, distractors, args.seed)
        }
        "needle" => eval::needle::needle_items(&data.text, args.questions, distractors, args.seed),
        other => bail!("--task {other:?}: expected squad or needle"),
    };
    if items.is_empty() {
        bail!("no questions: the data is too small for {distractors:?} distractors");
    }
    let load_boundary = |dir: &Path, compiler: &Llama| {
        Boundary::load(dir, compiler)
            .with_context(|| format!("loading the boundary tokens in {}", dir.display()))
    };
    let packet = args
        .packet
        .as_deref()
        .map(|d| load_boundary(d, &model))
        .transpose()?;
    let joint = match (&args.joint, &writer) {
        (Some(d), Some(w)) => Some(load_boundary(d, w)?),
        (Some(_), None) => bail!("--joint needs --writer (the writer its tokens were trained for)"),
        (None, _) => None,
    };
    let compilers = DocCompilers {
        writer: writer.as_ref(),
        packet: packet.as_ref(),
        joint: joint.as_ref(),
    };
    let mut modes = vec![DocMode::FullRecompute, DocMode::NoRecompute];
    modes.extend(writer.is_some().then_some(DocMode::SemPic));
    modes.extend(packet.is_some().then_some(DocMode::Packet));
    modes.extend(joint.is_some().then_some(DocMode::Joint));
    if let Some(list) = &args.modes {
        let mut wanted = Vec::new();
        for name in list.split(',').map(str::trim) {
            let mode = match name {
                "full" => DocMode::FullRecompute,
                "none" => DocMode::NoRecompute,
                "sempic" => DocMode::SemPic,
                "packet" => DocMode::Packet,
                "joint" => DocMode::Joint,
                other => bail!(
                    "--modes: unknown mode {other:?} (expected full, none, sempic, packet, joint)"
                ),
            };
            if !modes.contains(&mode) {
                bail!("--modes: the {mode} mode needs its files (--writer, --packet, --joint)");
            }
            wanted.push(mode);
        }
        modes = wanted;
    }
    let started = std::time::Instant::now();
    let scores = evaluate(
        &model,
        &compilers,
        &tok,
        &items,
        &modes,
        args.answer_tokens,
        args.seed,
        |done, total| {
            if done % 10 == 0 || done == total {
                eprintln!(
                    "multidoc: {done}/{total} questions ({:.0} s)",
                    started.elapsed().as_secs_f64()
                );
            }
        },
    )
    .context("multi-document QA")?;
    let docs: usize = items.iter().map(|i| i.documents.len()).sum();
    let source = match args.task.as_str() {
        "needle" => format!("needles in {}", data.text_name),
        _ => "SQuAD".to_string(),
    };
    let file = match args.task.as_str() {
        "needle" => &data.text_file,
        _ => &data.squad_file,
    };
    println!(
        "Multi-document QA: {} questions, {:.1} documents each on average ({}-{} distractors), \
         {source} {} (sha256 {}), seed {}, model {} ({}), prefill on {}",
        items.len(),
        docs as f64 / items.len().max(1) as f64,
        args.min_distractors,
        args.max_distractors,
        file.path,
        &file.sha256[..12.min(file.sha256.len())],
        args.seed,
        args.model.display(),
        &model.identity().sha256[..12.min(model.identity().sha256.len())],
        model.prefill_matmul()
    );
    println!();
    for (what, path) in [
        ("SemPIC writer", &args.writer),
        ("packet boundary tokens", &args.packet),
        ("joint boundary tokens", &args.joint),
    ] {
        if let Some(p) = path {
            println!("{what}: {}", p.display());
        }
    }
    println!();
    println!(
        "| mode | F1 | F1 gap recovered | EM | answer in reply | KL to full recompute (question and answer) | KV deviation, first {} tokens of a document | KV deviation, rest |",
        eval::multidoc::BOUNDARY_TOKENS
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let show = |e: Option<&scd_models::stats::Estimate>, d| e.map_or("-".into(), |e| e.display(d));
    for s in &scores {
        let dev = s.kv_deviation.as_ref();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            s.mode,
            s.f1.display(1),
            show(s.gap_recovered.map(|g| g.map(|x| 100.0 * x)).as_ref(), 0),
            s.em.display(1),
            s.contains.display(1),
            show(s.kl.as_ref(), 4),
            show(dev.map(|d| &d[0]), 3),
            show(dev.map(|d| &d[1]), 3),
        );
    }
    if let Some(path) = &args.json {
        let record = serde_json::json!({
            "task": args.task,
            "questions": items.len(),
            "distractors": [args.min_distractors, args.max_distractors],
            "seed": args.seed,
            "answer_tokens": args.answer_tokens,
            "data": file,
            "model": args.model.display().to_string(),
            "model_sha256": model.identity().sha256,
            "prefill": model.prefill_matmul().to_string(),
            "template": eval::multidoc::MULTIDOC_TEMPLATE,
            "modes": scores.iter().map(|s| serde_json::json!({
                "mode": s.mode.to_string(),
                "f1": s.f1,
                "f1_gap_recovered": s.gap_recovered,
                "f1_per_question": s.f1_per_question,
                "em": s.em,
                "contains": s.contains,
                "kl": s.kl,
                "kv_deviation": s.kv_deviation.as_ref().map(|[edge, rest]| serde_json::json!({
                    "boundary_tokens": eval::multidoc::BOUNDARY_TOKENS,
                    "boundary": edge,
                    "interior": rest,
                })),
            })).collect::<Vec<_>>(),
            "writer": args.writer.as_ref().map(|w| w.display().to_string()),
            "packet": args.packet.as_ref().map(|w| w.display().to_string()),
            "joint": args.joint.as_ref().map(|w| w.display().to_string()),
        });
        scd_models::json_file::write_atomic(path, &record)?;
    }
    Ok(())
}
