//! `scd bench links`: codes sized for the link (`docs/method.md` §4.6). An in-process cluster on
//! the embedded store whose producer reaches one consumer node per emulated link
//! (`[links] pace_mbit`), the same prompts over each (a validation split calibration never
//! reads): raw KV, the translator's default ranks, and ranks the producer picks for the link it
//! measured (`[codec] ranks = "adaptive"`). Per link: the ranks chosen, payload, time to first
//! token from the job records, and the KL to the expert's own prefill over a continuation,
//! measured in-process at the ranks each job used.

use scd_models::KernelChoice;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use scd_actors::Served;
use scd_models::codec::{self, Codec, CodecOptions, Prefix};
use scd_models::corpus;
use scd_models::stats::{bootstrap_mean, Estimate};
use scd_models::translator::select::HeldOutPrompt;
use scd_models::{Input, Llama, LogitsWanted};
use scd_scheduler::Ranks;
use scd_types::Mode;

use crate::cmd::local_cluster::{config, median, models_section, Cluster};
use crate::paths::DataDirs;

/// Arguments of `scd bench links`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// The expert: a folder under --experts with adapter.safetensors and translator/ (whose
    /// manifest carries a rank curve).
    #[arg(long, default_value = "mail")]
    pub expert: String,
    /// Where the shipped experts are.
    #[arg(long, default_value = "experts")]
    pub experts: PathBuf,
    #[command(flatten)]
    pub dirs: DataDirs,
    /// Emulated links from the producer to each consumer node, Mbit/s.
    #[arg(long, value_delimiter = ',', default_value = "50,500,5000")]
    pub links: Vec<u64>,
    /// Where the prompts come from: a named corpus's validation split (`brown`: the
    /// calibration's corpus, a split calibration never reads) or `wikitext2` (the evaluation's
    /// WikiText-2 validation split, another domain).
    #[arg(long, default_value = "brown")]
    pub text: String,
    /// Prompts (windows spread over the split).
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Tokens each prompt transfers.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Continuation tokens the KL is measured over.
    #[arg(long, default_value_t = 32)]
    pub continuation: usize,
    /// The KL ceiling of adaptive ranks (`[codec] kl_ceiling`).
    #[arg(long, default_value_t = 0.1)]
    pub kl_ceiling: f64,
    /// Transfer mode of the translated jobs: scd or reuse.
    #[arg(long, default_value = "scd")]
    pub mode: Mode,
    /// Write every job's figures here as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The three ways a prompt crosses a link.
const KINDS: [&str; 3] = ["raw", "default ranks", "adaptive ranks"];

/// One job's figures.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    link_mbit: u64,
    kind: &'static str,
    prompt: usize,
    ranks: Option<Ranks>,
    rule: Option<String>,
    measured_mbit: Option<f64>,
    payload_bytes: u64,
    ttft_ms: f64,
    kl: f64,
}

/// KL(oracle || expert) over the continuation, the expert's cache rebuilt by `codec` from the
/// base's prefill.
fn kl_of(
    base: &Llama,
    expert: &Llama,
    codec: &dyn Codec,
    p: &HeldOutPrompt,
) -> anyhow::Result<f64> {
    let codes = match codec.capture() {
        Some(c) => {
            let out = base.forward(Input::new(&p.prefix).capture(c).logits(LogitsWanted::None))?;
            codec::encode(codec, &out.captured)?
        }
        None => Vec::new(),
    };
    let cache = codec::decode(codec, expert, &codes, Prefix::new(&p.prefix))?;
    Ok(p.kl(expert, cache)?)
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if !args.mode.uses_translator_codes() {
        bail!("--mode {}: ranks exist for scd and reuse", args.mode);
    }
    let model = std::path::absolute(&args.model)?;
    let expert_dir = std::path::absolute(args.experts.join(&args.expert))?;
    let name = args.expert.clone();
    let links: Vec<(String, u64)> = args
        .links
        .iter()
        .map(|&m| (format!("link-{m}m"), m))
        .collect();
    let models = models_section(&model, &[(&name, &expert_dir)]);
    let consumer_cfg = config(&links[0].0, "\"consumer\"", &models)?;
    let served = Arc::new(Served::load(&consumer_cfg, kernels).context("loading the models")?);
    let loaded = served
        .experts
        .get(&name)
        .context("the expert is not loaded")?;
    let (translator, index) = loaded.translator.clone();
    if translator.manifest.rank_curve.is_none() {
        bail!(
            "the {name} translator has no rank curve: add it with `scd translators curve --translator {}`",
            expert_dir.join("translator").display()
        );
    }
    let base = served.model()?.clone();
    let expert = loaded
        .model
        .clone()
        .context("the expert model is not loaded")?;

    let text = match args.text.as_str() {
        "wikitext2" => corpus::read_text(&args.dirs.eval_data.join(corpus::WIKITEXT2_VALID))?,
        name => {
            corpus::Corpus::open(name, &args.dirs.data_dir)
                .with_context(|| format!("opening the corpus {name}"))?
                .valid
        }
    };
    let file = scd_models::GgufFile::open(&model).context("opening the model")?;
    let tok = scd_models::tokenizer::Tokenizer::from_gguf(file.content())?;
    let tokens = corpus::tokenize_long(&tok, &text)?;
    let windows = corpus::even_windows(
        &tokens,
        args.prompt_tokens + 1 + args.continuation,
        args.prompts,
        "validation",
    )?;
    eprintln!("{} prompts: oracle continuations", windows.len());
    let held: Vec<HeldOutPrompt> = windows
        .iter()
        .map(|w| HeldOutPrompt::new(&expert, w, args.continuation))
        .collect::<Result<_, _>>()?;
    let job_prompts: Vec<Vec<u32>> = held
        .iter()
        .map(|p| [p.prefix.as_slice(), &[p.last]].concat())
        .collect();

    let pace = links
        .iter()
        .map(|(id, m)| format!("{id} = {m}"))
        .collect::<Vec<_>>()
        .join(", ");
    let producer = |rule: &str| {
        config(
            &format!("prefill-{rule}"),
            "\"producer\"",
            &format!(
                "{models}\n[codec]\nranks = \"{rule}\"\nkl_ceiling = {}\n\n\
                 [limits]\nprefix_cache_mib = 0\n\n[links]\npace_mbit = {{ {pace} }}\n",
                args.kl_ceiling
            ),
        )
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let rows = runtime.block_on(async {
        let cluster = Cluster::new(served.clone())?;
        let scheduler = cluster
            .start(&config(
                "scheduler",
                "\"scheduler\"",
                &models_section(&model, &[]),
            )?)
            .await?;
        let mut rows = Vec::new();
        for (consumer_id, mbit) in &links {
            let consumer = cluster
                .start(&config(consumer_id, "\"consumer\"", &models)?)
                .await?;
            for (rule, kinds) in [("default", &KINDS[..2]), ("adaptive", &KINDS[2..])] {
                let p = cluster.start(&producer(rule)?).await?;
                // One raw job first: the producer measures the link (and everything is warm).
                cluster.run(&name, Mode::Raw, &job_prompts[0]).await?;
                for (i, prompt) in job_prompts.iter().enumerate() {
                    for &kind in kinds {
                        let mode = if kind == "raw" { Mode::Raw } else { args.mode };
                        let job = cluster.run(&name, mode, prompt).await?;
                        eprintln!(
                            "{mbit} Mbit/s, prompt {i}, {kind}: {} B, ttft {:.0} ms, {:?}",
                            job.payload_bytes,
                            job.timings_ms.get("ttft").copied().unwrap_or(f64::NAN),
                            job.ranks
                        );
                        rows.push(Row {
                            link_mbit: *mbit,
                            kind,
                            prompt: i,
                            ranks: job.ranks.map(|c| c.ranks),
                            rule: job.ranks.map(|c| c.rule.name().to_string()),
                            measured_mbit: job.ranks.and_then(|c| c.link_mbit),
                            payload_bytes: job.payload_bytes,
                            ttft_ms: job.timings_ms.get("ttft").copied().unwrap_or(f64::NAN),
                            kl: f64::NAN,
                        });
                    }
                }
                p.shutdown(Duration::ZERO).await;
            }
            consumer.shutdown(Duration::ZERO).await;
        }
        scheduler.shutdown(Duration::ZERO).await;
        anyhow::Ok(rows)
    })?;

    // KL at the ranks each job used, in-process (the same codec the nodes ran).
    eprintln!("measuring KL at the ranks used");
    let mut rows = rows;
    let mut memo: std::collections::HashMap<(usize, Option<Ranks>), f64> = Default::default();
    for row in &mut rows {
        let key = (row.prompt, row.ranks);
        if let Some(&kl) = memo.get(&key) {
            row.kl = kl;
            continue;
        }
        let codec = match row.ranks {
            None => codec::codec_for(Mode::Raw)?,
            Some(ranks) => codec::codec_with(
                args.mode,
                Some((&translator, index)),
                &CodecOptions {
                    ranks: Some(ranks),
                    ..CodecOptions::default()
                },
            )?,
        };
        row.kl = kl_of(&base, &expert, codec.as_ref(), &held[row.prompt])?;
        memo.insert(key, row.kl);
    }
    print_table(&rows, &args);
    if let Some(out) = &args.out {
        let json = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "expert": name,
            "translator": translator.hash().to_string(),
            "mode": args.mode,
            "kl_ceiling": args.kl_ceiling,
            "text": format!("{} validation split", args.text),
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "continuation": args.continuation,
            "rows": rows,
        });
        scd_models::json_file::write_atomic(out, &json)
            .with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

fn print_table(rows: &[Row], args: &Args) {
    println!(
        "\n{} prompts of {} tokens ({} validation split), {} mode, KL ceiling {} (KL over {} continuation tokens, mean [95% bootstrap interval] over prompts)",
        args.prompts, args.prompt_tokens, args.text, args.mode, args.kl_ceiling, args.continuation
    );
    println!("| link | codes | ranks (jobs) | measured link | payload MB | TTFT ms, median | KL |");
    println!("| ---: | --- | --- | ---: | ---: | ---: | --- |");
    for &mbit in &args.links {
        for kind in KINDS {
            let these: Vec<&Row> = rows
                .iter()
                .filter(|r| r.link_mbit == mbit && r.kind == kind)
                .collect();
            if these.is_empty() {
                continue;
            }
            let mut ranks: BTreeMap<String, usize> = BTreeMap::new();
            for r in &these {
                let name = r
                    .ranks
                    .map_or("-".into(), |r| format!("{}/{}/{}", r.k, r.v, r.h));
                *ranks.entry(name).or_default() += 1;
            }
            let ranks: Vec<String> = ranks.iter().map(|(k, n)| format!("{k} ({n})")).collect();
            let measured = these
                .iter()
                .filter_map(|r| r.measured_mbit)
                .collect::<Vec<_>>();
            let kl: Estimate = bootstrap_mean(&these.iter().map(|r| r.kl).collect::<Vec<_>>(), 0);
            println!(
                "| {mbit} Mbit/s | {kind} | {} | {} | {:.2} | {:.0} | {} |",
                ranks.join(", "),
                if measured.is_empty() {
                    "-".into()
                } else {
                    format!("{:.0} Mbit/s", median(measured))
                },
                median(these.iter().map(|r| r.payload_bytes as f64 / 1e6).collect()),
                median(these.iter().map(|r| r.ttft_ms).collect()),
                kl.display(4)
            );
        }
    }
}
