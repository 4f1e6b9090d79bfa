//! `scd demo`: an in-process cluster on the embedded store (a producer node that is also the
//! scheduler, and a consumer node serving one expert, over real QUIC on loopback with a throwaway
//! CA), and the same prompt through it in every transfer mode, each a job record the scheduler
//! assigns; then the results side by side: text, time to first token and its parts, payload bytes,
//! and agreement with the expert's own prefill (the oracle). With `--document-files`, then a job
//! that names documents, twice: the producer compiles them with the SemPIC writer the first time
//! and serves them from its store the second (SemPIC, `docs/method.md` §5.5). Then, with
//! `--paced-mbit`, the paced part (`demo_paced`): where the codes beat the expert's own prefill.

use scd_models::KernelChoice;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use scd_actors::{ClusterClient, Node, NodeConfig, Served};
use scd_models::tokenizer::Tokenizer;
use scd_models::GgufFile;
use scd_scheduler::{EmbeddedStore, JobRecord, JobRequest, JobState, Keys, MetaStore};
use scd_transport::{ClusterCa, Role};
use scd_types::Mode;
use tokio_util::sync::CancellationToken;

/// Arguments of `scd demo`.
#[derive(clap::Args)]
#[command(after_help = "Example (what `make demo` runs):\n  \
    scd demo --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --expert mail \\\n    \
    --prompt-file ops/demo-mail.txt")]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// The expert: a folder under --experts with adapter.safetensors and translator/.
    #[arg(long, default_value = "mail")]
    pub expert: String,
    /// Where the shipped experts are.
    #[arg(long, default_value = "experts")]
    pub experts: PathBuf,
    /// The prompt, as it is (no chat template: the mail expert continues mail).
    #[arg(long)]
    pub prompt_file: PathBuf,
    /// New tokens per job.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: u32,
    /// Modes to run, in order (the oracle always runs first: the others are compared to it).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "raw,q4,droidspeak,reuse,scd,auto"
    )]
    pub modes: Vec<Mode>,
    /// Element type of reuse and scd codes: f16 or i8-rows.
    #[arg(long, default_value = "i8-rows")]
    pub code_dtype: String,
    /// Text files to record as documents for a job that names them (none: no such job).
    #[arg(long, value_delimiter = ',')]
    pub document_files: Vec<PathBuf>,
    /// The prompt the expert reads after the documents.
    #[arg(long, requires = "document_files")]
    pub question_file: Option<PathBuf>,
    /// The SemPIC writer that compiles the documents (adapter folder or file).
    #[arg(long, default_value = "experts/sempic-writer")]
    pub writer: PathBuf,
    /// Then a long prompt the producer holds in its prefix cache, over a link paced to this
    /// many Mbit/s, in the oracle, raw, scd and auto (0: skip it).
    #[arg(long, default_value_t = 100)]
    pub paced_mbit: u64,
    /// Tokens of that prompt (the start of WikiText-2's validation text).
    #[arg(long, default_value_t = 1024)]
    pub paced_tokens: usize,
    #[command(flatten)]
    pub dirs: crate::paths::DataDirs,
}

fn node_config(
    id: &str,
    roles: &str,
    args: &Args,
    model: &Path,
    expert: &Path,
) -> anyhow::Result<NodeConfig> {
    let text = format!(
        r#"[node]
id = "{id}"
listen = "127.0.0.1:0"
roles = [{roles}]

[models]
base = "{model}"

[[experts]]
name = "{name}"
adapter = "{expert}"
translator = "{translator}"

[store]
kind = "embedded"

[tls]
ca = "unused.pem"
cert = "unused.pem"
key = "unused.key"

[codec]
code_dtype = "{dtype}"
# Every mode at the translator's own ranks, so the table compares modes, not links.
ranks = "default"

# Off: every mode runs the same prompt, and each should pay for its own prefill.
[limits]
prefix_cache_mib = 0
"#,
        model = model.display(),
        name = args.expert,
        expert = expert.display(),
        translator = expert.join("translator").display(),
        dtype = args.code_dtype,
    );
    NodeConfig::parse(&text, Path::new(".")).context("building the demo's node configs")
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let model = std::path::absolute(&args.model)?;
    let expert_dir = std::path::absolute(args.experts.join(&args.expert))?;
    if !expert_dir.join("translator").is_dir() {
        bail!(
            "{} has no translator/: pick an expert that ships one (mail, mail-rope, sotu, melville)",
            expert_dir.display()
        );
    }
    let text = std::fs::read_to_string(&args.prompt_file)
        .with_context(|| format!("reading {}", args.prompt_file.display()))?;
    let file = GgufFile::open(&model).context("opening the model")?;
    let tok = Tokenizer::from_gguf(file.content()).context("reading the tokenizer")?;
    let prompt = tok.encode(&text, false).context("tokenising the prompt")?;
    let producer_cfg = node_config(
        "prefill-0",
        r#""producer", "scheduler""#,
        &args,
        &model,
        &expert_dir,
    )?;
    let consumer_cfg = node_config(
        &format!("{}-0", args.expert),
        r#""consumer""#,
        &args,
        &model,
        &expert_dir,
    )?;
    let t0 = Instant::now();
    // One load serves both nodes: the producer node uses the base and the translator, the
    // consumer node the expert.
    let mut served = Served::load(&consumer_cfg, kernels).context("loading the models")?;
    // Only the producer node serves documents (the consumer node's role does not use them);
    // their store is a folder that lives as long as the demo.
    let _store_dir = match args.document_files.is_empty() {
        true => None,
        false => {
            let dir = tempfile::tempdir().context("making the demo's document store")?;
            let config = scd_actors::config::DocumentsConfig {
                dir: dir.path().to_path_buf(),
                writer: Some(std::path::absolute(&args.writer)?),
                boundary: None,
                wire: scd_actors::config::DocumentWire::Bf16,
            };
            let server = scd_actors::documents::DocumentServer::load(&config, served.model()?)
                .context("loading the SemPIC writer")?;
            served.documents = Some(Arc::new(server));
            Some(dir)
        }
    };
    let served = Arc::new(served);
    eprintln!(
        "loaded {} and expert {} in {:.1} s",
        served.base_id,
        args.expert,
        t0.elapsed().as_secs_f64()
    );
    let (translator, _) = &served
        .experts
        .get(&args.expert)
        .context("the expert is not loaded")?
        .translator;
    let m = &translator.manifest;
    let translator_line = format!(
        "translator {}: ranks K/V/H {}/{}/{}, Patch layers {:?}, DroidSpeak blocks {:?}",
        translator.hash().short(),
        m.default_ranks.k,
        m.default_ranks.v,
        m.default_ranks.h,
        m.patch_layers,
        m.droidspeak_blocks
    );

    let paced_prompt = match args.paced_mbit {
        0 => None,
        _ => {
            let path = args
                .dirs
                .eval_data
                .join(scd_models::corpus::WIKITEXT2_VALID);
            let text = scd_models::corpus::read_text(&path)?;
            let tokens = scd_models::corpus::tokenize_long(&tok, &text)?;
            let window =
                scd_models::corpus::even_windows(&tokens, args.paced_tokens, 1, "validation")?;
            window.into_iter().next()
        }
    };

    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let ca = ClusterCa::generate("demo")?;
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let mut nodes = Vec::new();
        for cfg in [&producer_cfg, &consumer_cfg] {
            let identity = ca.issue(&cfg.node.id, Role::Node)?;
            let node = Node::start(
                cfg,
                &identity,
                served.clone(),
                store.clone(),
                None,
                CancellationToken::new(),
            )
            .await
            .with_context(|| format!("starting node {}", cfg.node.id))?;
            nodes.push(node);
        }
        println!("== an in-process cluster on the embedded store, over QUIC on loopback ==");
        println!(
            "node {} (producer of {}, scheduler) at {}",
            nodes[0].id(),
            served.base_id,
            nodes[0].local_addr()
        );
        println!(
            "node {} (consumer of {}) at {}",
            nodes[1].id(),
            args.expert,
            nodes[1].local_addr()
        );
        println!("{translator_line}; codes in {}", args.code_dtype);
        println!(
            "prompt: {} tokens from {}; {} new tokens per job, greedy",
            prompt.len(),
            args.prompt_file.display(),
            args.max_tokens
        );
        let client = ClusterClient::new(store.clone(), Keys::default());
        let mut modes = vec![Mode::Oracle];
        modes.extend(args.modes.iter().copied().filter(|m| *m != Mode::Oracle));
        let mut done: Vec<(Mode, JobRecord)> = Vec::new();
        for mode in modes {
            let request = greedy(&args, &tok, prompt.clone(), Vec::new());
            let id = client.submit(&args.expert, mode, request).await?;
            eprintln!("job {id}: {mode} ...");
            let job = client.wait(id, Duration::from_secs(600)).await?;
            if job.state != JobState::Done {
                bail!(
                    "job {id} ({mode}) ended {}: {}",
                    job.state,
                    job.error.as_deref().unwrap_or("no reason recorded")
                );
            }
            done.push((mode, job));
        }
        let documents = match &args.question_file {
            Some(q) => {
                let registry = scd_scheduler::DocumentRegistry::new(store.clone(), Keys::default());
                Some(documents_jobs(&args, &client, &registry, &tok, &served.base_id, q).await?)
            }
            None => None,
        };
        for node in nodes.into_iter().rev() {
            node.shutdown(Duration::ZERO).await;
        }
        print_results(&done, &tok);
        if let Some(jobs) = documents {
            print_documents(&args, &jobs, &tok);
        }
        if let Some(prompt) = paced_prompt {
            let paced = super::demo_paced::Paced {
                model: &model,
                expert: &args.expert,
                expert_dir: &expert_dir,
                mbit: args.paced_mbit,
                prompt,
                code_dtype: &args.code_dtype,
            };
            super::demo_paced::run(paced, served.clone()).await?;
        }
        Ok(())
    })
}

/// A greedy request for `prompt` after `documents`, as every demo job is.
fn greedy(args: &Args, tok: &Tokenizer, prompt: Vec<u32>, documents: Vec<String>) -> JobRequest {
    JobRequest {
        prompt,
        max_tokens: args.max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        stop_tokens: tok.stop_ids().to_vec(),
        documents,
    }
}

/// Records the document files and runs a job that names them twice: the first compiles them on
/// the producer, the second is served from its store.
async fn documents_jobs(
    args: &Args,
    client: &ClusterClient,
    registry: &scd_scheduler::DocumentRegistry,
    tok: &Tokenizer,
    base: &str,
    question: &Path,
) -> anyhow::Result<Vec<JobRecord>> {
    let mut ids = Vec::new();
    for file in &args.document_files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let tokens = tok.encode(text.trim(), false)?;
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        ids.push(registry.add(base, tokens, name).await?.id);
    }
    let text = std::fs::read_to_string(question)
        .with_context(|| format!("reading {}", question.display()))?;
    let prompt = tok.encode(&text, false)?;
    let mut jobs = Vec::new();
    for _ in 0..2 {
        let request = greedy(args, tok, prompt.clone(), ids.clone());
        let id = client.submit(&args.expert, Mode::Oracle, request).await?;
        eprintln!("job {id}: {} documents ...", ids.len());
        let job = client.wait(id, Duration::from_secs(600)).await?;
        if job.state != JobState::Done {
            bail!(
                "job {id} (documents) ended {}: {}",
                job.state,
                job.error.as_deref().unwrap_or("no reason recorded")
            );
        }
        jobs.push(job);
    }
    Ok(jobs)
}

fn print_documents(args: &Args, jobs: &[JobRecord], tok: &Tokenizer) {
    let names: Vec<String> = args
        .document_files
        .iter()
        .map(|f| f.display().to_string())
        .collect();
    println!(
        "\n== a job naming {} documents ({}), twice: compiled by the SemPIC writer {} on the producer, then served from its store ==",
        names.len(),
        names.join(", "),
        args.writer.display()
    );
    println!(
        "{:<5} {:>9} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "job", "compiled", "from store", "positions", "documents", "TTFT", "wire B"
    );
    for (i, job) in jobs.iter().enumerate() {
        let d = job.documents.as_ref();
        let ms = |key: &str| {
            job.timings_ms
                .get(key)
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
        };
        println!(
            "{:<5} {:>9} {:>10} {:>10} {:>10} {:>8} {:>8}",
            i + 1,
            d.map_or(0, |d| d.compiled.len()),
            d.map_or(0, |d| d.hits),
            d.map_or(0, |d| d.rows),
            ms("documents"),
            ms("ttft"),
            job.payload_bytes
        );
    }
    println!("(\"documents\" is the producer's time to fetch or compile the documents and send them, ms; the second job computes nothing of them)");
    let text = |job: &JobRecord| {
        let tokens = job
            .output
            .as_ref()
            .map(|o| o.tokens.clone())
            .unwrap_or_default();
        tok.decode(&tokens, true)
            .unwrap_or_else(|e| format!("(undecodable: {e})"))
    };
    if let Some(first) = jobs.first() {
        println!(
            "\n-- the expert, after the documents --\n{}",
            text(first).trim()
        );
    }
    if let [a, b] = jobs {
        let same = a.output.as_ref().map(|o| &o.tokens) == b.output.as_ref().map(|o| &o.tokens);
        println!(
            "(the second job's answer is {}the first's)",
            if same { "" } else { "NOT " }
        );
    }
}

fn print_results(done: &[(Mode, JobRecord)], tok: &Tokenizer) {
    let tokens = |job: &JobRecord| {
        job.output
            .as_ref()
            .map(|o| o.tokens.clone())
            .unwrap_or_default()
    };
    let oracle = done.first().map(|(_, j)| tokens(j)).unwrap_or_default();
    let raw_bytes = done
        .iter()
        .find(|(m, _)| *m == Mode::Raw)
        .map(|(_, j)| j.payload_bytes);
    let ms = |job: &JobRecord, key: &str| {
        job.timings_ms
            .get(key)
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
    };
    println!();
    println!(
        "{:<11} {:>10} {:>7} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8}  same tokens as the oracle",
        "mode",
        "wire B",
        "vs raw",
        "prefill",
        "1st code",
        "encode",
        "transfer",
        "rebuild",
        "TTFT",
        "total"
    );
    for (mode, job) in done {
        // The oracle sends no codes (its job stream carries only the opening frame).
        let ran = job.mode_choice.as_ref().map_or(*mode, |c| c.chosen);
        let sends = ran != Mode::Oracle;
        let share = match raw_bytes {
            Some(r) if r > 0 && sends => {
                format!("{:.1}%", 100.0 * job.payload_bytes as f64 / r as f64)
            }
            _ => "-".to_owned(),
        };
        let bytes = if sends {
            job.payload_bytes.to_string()
        } else {
            "-".to_owned()
        };
        let got = tokens(job);
        let same = got.iter().zip(&oracle).take_while(|(a, b)| a == b).count();
        let agreement = if got == oracle {
            format!("all {}", got.len())
        } else {
            format!("first {same} of {}", oracle.len())
        };
        // When the first layer's codes reached the expert, counted from the prefill's start:
        // well before the prefill ends, because layers stream as they are done.
        let first_code = match (job.stages.get("prefill"), job.stages.get("arrivals")) {
            (Some(p), Some(a)) => format!("{:.0}", a.start_ms - p.start_ms),
            _ => "-".to_owned(),
        };
        let name = match &job.mode_choice {
            Some(c) if *mode == Mode::Auto => format!("auto:{}", c.chosen),
            _ => mode.to_string(),
        };
        println!(
            "{:<11} {:>10} {:>7} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8}  {agreement}",
            name,
            bytes,
            share,
            ms(job, "prefill"),
            first_code,
            ms(job, "encode"),
            ms(job, "transfer"),
            ms(job, "rebuild"),
            ms(job, "ttft"),
            ms(job, "total"),
        );
    }
    println!("(times in ms; prefill, encode and transfer overlap layer by layer: \"1st code\" is when the first layer's codes reached the expert, after the prefill began; TTFT is submission to first token, scheduling included)");
    for (_, job) in done.iter().filter(|(m, _)| *m == Mode::Auto) {
        if let Some(c) = &job.mode_choice {
            println!("auto chose {}: {}", c.chosen, c.reason);
        }
    }
    for (mode, job) in done {
        let text = tok
            .decode(&tokens(job), true)
            .unwrap_or_else(|e| format!("(undecodable: {e})"));
        println!("\n-- {mode} --\n{}", text.trim());
    }
}
