//! `scd bench fanout`: one prompt for several experts of one base, as one fan-out job (one
//! prefill, one code stream, a decode per expert on a node hosting them all) against one job
//! per expert submitted at the same time. An in-process cluster on the embedded store: a
//! producer (also the scheduler) and a consumer node with every expert, over QUIC on loopback,
//! optionally through an emulated link. Per way: bytes on the wire and time to first token of
//! the first and of the last expert to answer, from the job records.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use scd_actors::Served;
use scd_models::corpus;
use scd_scheduler::{JobId, JobRecord, JobRequest, JobState};
use scd_types::{Mode, TraceContext};

use crate::cmd::local_cluster::{config, median, models_section, Cluster};
use crate::paths::DataDirs;

/// Arguments of `scd bench fanout`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// The experts (folders under --experts).
    #[arg(long, value_delimiter = ',', default_value = "mail,sotu,melville")]
    pub experts: Vec<String>,
    /// Where the shipped experts are.
    #[arg(long, default_value = "experts")]
    pub experts_dir: PathBuf,
    #[command(flatten)]
    pub dirs: DataDirs,
    /// Prompts: windows of a corpus's validation split.
    #[arg(long, default_value = "brown")]
    pub text: String,
    /// Prompts.
    #[arg(long, default_value_t = 6)]
    pub prompts: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Emulated link from the producer to the consumer node, Mbit/s (0: loopback as is).
    #[arg(long, default_value_t = 500)]
    pub link_mbit: u64,
    /// Transfer mode (raw, q4 and droidspeak fan out to any experts; reuse and scd need one
    /// joint translator for all of them).
    #[arg(long, default_value = "raw")]
    pub mode: Mode,
    /// New tokens per expert.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
}

/// Milliseconds from submission to each expert's first token: the record's `ttft` is the
/// first expert's; a fan-out's others answer `first_token:<expert>` minus `first_token` later.
fn ttfts(job: &JobRecord) -> Vec<f64> {
    let t = &job.timings_ms;
    let (Some(&ttft), Some(&first)) = (t.get("ttft"), t.get("first_token")) else {
        return Vec::new();
    };
    let mut out = vec![ttft];
    for e in &job.fan_out {
        if let Some(&f) = t.get(&format!("first_token:{e}")) {
            out.push(ttft + (f - first));
        }
    }
    out
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if args.experts.len() < 2 {
        bail!("--experts: name at least two experts of the base");
    }
    let model = std::path::absolute(&args.model)?;
    let dirs: Vec<PathBuf> = args
        .experts
        .iter()
        .map(|e| std::path::absolute(args.experts_dir.join(e)))
        .collect::<Result<_, _>>()?;
    let pairs: Vec<(&str, &std::path::Path)> = args
        .experts
        .iter()
        .map(String::as_str)
        .zip(dirs.iter().map(PathBuf::as_path))
        .collect();
    let models = models_section(&model, &pairs);
    let consumer_cfg = config("experts-0", "\"consumer\"", &models)?;
    let served = Arc::new(Served::load(&consumer_cfg, kernels).context("loading the models")?);
    let file = scd_models::GgufFile::open(&model).context("opening the model")?;
    let tok = scd_models::tokenizer::Tokenizer::from_gguf(file.content())?;
    let text = corpus::Corpus::open(&args.text, &args.dirs.data_dir)
        .with_context(|| format!("opening the corpus {}", args.text))?
        .valid;
    let tokens = corpus::tokenize_long(&tok, &text)?;
    let prompts = corpus::even_windows(&tokens, args.prompt_tokens, args.prompts, "validation")?;
    let pace = match args.link_mbit {
        0 => String::new(),
        m => format!("[links]\npace_mbit = {{ experts-0 = {m} }}\n"),
    };
    let producer_cfg = config(
        "prefill-0",
        "\"producer\", \"scheduler\"",
        &format!("{models}\n[limits]\nprefix_cache_mib = 0\n\n{pace}"),
    )?;
    let request = |prompt: &[u32]| JobRequest {
        prompt: prompt.to_vec(),
        max_tokens: args.max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        stop_tokens: Vec::new(),
        documents: Vec::new(),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let rows = runtime.block_on(async {
        let cluster = Cluster::new(served.clone())?;
        let producer = cluster.start(&producer_cfg).await?;
        let consumer = cluster.start(&consumer_cfg).await?;
        let wait = |id| cluster.client.wait(id, std::time::Duration::from_secs(600));
        let done = |job: JobRecord| match job.state {
            JobState::Done => Ok(job),
            s => Err(anyhow::anyhow!(
                "job {} ended {s}: {}",
                job.id,
                job.error.as_deref().unwrap_or("no reason recorded")
            )),
        };
        // Warm-up: every expert once.
        cluster
            .run(&args.experts[0], args.mode, &prompts[0])
            .await?;
        let mut rows = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            // Alternate which way goes first, so neither always meets a warmer machine.
            let order: [&str; 2] = match i % 2 {
                0 => ["fan-out", "separate"],
                _ => ["separate", "fan-out"],
            };
            for way in order {
                let (bytes, times) = if way == "fan-out" {
                    let id = JobId::random();
                    cluster
                        .client
                        .submit_fan_out(
                            id,
                            &args.experts,
                            args.mode,
                            request(prompt),
                            TraceContext::new(),
                        )
                        .await?;
                    let job = done(wait(id).await?)?;
                    (job.payload_bytes, ttfts(&job))
                } else {
                    let mut ids = Vec::new();
                    for e in &args.experts {
                        ids.push(cluster.client.submit(e, args.mode, request(prompt)).await?);
                    }
                    let (mut bytes, mut times) = (0, Vec::new());
                    for id in ids {
                        let job = done(wait(id).await?)?;
                        bytes += job.payload_bytes;
                        times.extend(ttfts(&job));
                    }
                    (bytes, times)
                };
                if times.len() != args.experts.len() {
                    bail!("{way}: first-token times missing from the records");
                }
                let first = times.iter().copied().fold(f64::INFINITY, f64::min);
                let last = times.iter().copied().fold(0.0, f64::max);
                eprintln!("prompt {i}, {way}: {bytes} B, first {first:.0} ms, last {last:.0} ms");
                rows.push((way, bytes, first, last));
            }
        }
        consumer.shutdown(std::time::Duration::ZERO).await;
        producer.shutdown(std::time::Duration::ZERO).await;
        anyhow::Ok(rows)
    })?;
    println!(
        "\n{} prompts of {} tokens ({} validation split), {} experts ({}), {} mode, {} new tokens each, link {}",
        args.prompts,
        args.prompt_tokens,
        args.text,
        args.experts.len(),
        args.experts.join(", "),
        args.mode,
        args.max_tokens,
        match args.link_mbit {
            0 => "loopback".to_string(),
            m => format!("{m} Mbit/s"),
        }
    );
    println!("| way | jobs | prefills | bytes per prompt, MB | TTFT first expert, ms | TTFT last expert, ms |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let m = args.experts.len();
    for (way, jobs, prefills) in [("fan-out", 1, 1), ("separate", m, m)] {
        let these: Vec<_> = rows.iter().filter(|r| r.0 == way).collect();
        println!(
            "| {way} | {jobs} | {prefills} | {:.2} | {:.0} | {:.0} |",
            median(these.iter().map(|r| r.1 as f64 / 1e6).collect()),
            median(these.iter().map(|r| r.2).collect()),
            median(these.iter().map(|r| r.3).collect()),
        );
    }
    println!("(medians over the prompts)");
    Ok(())
}
