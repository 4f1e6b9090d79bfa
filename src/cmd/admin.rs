//! Cluster commands of an operator: `scd submit`, `scd jobs`, `scd nodes`, `scd pools` (and the
//! calls `scd translators` makes), as admin calls on
//! a node's QUIC endpoint with an admin certificate of the cluster CA (`scd cert issue --role
//! admin`). The node is named by its certificate name and address, from `--node` or
//! `SCD_NODE`; the certificate from `--pki-dir`/`--name` or `SCD_PKI_DIR`/`SCD_ADMIN_NAME`.
//!
//! Exit codes: 2 for usage errors (clap), 3 when the cluster cannot be reached, 4 when the job
//! failed or was cancelled, 5 when the node refused the request, 6 when the cluster is busy (it
//! holds its limit of unfinished jobs; the message says when to retry).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use scd_transport::{
    error_code, AdminCall, Connection, Control, Endpoint, Identity, JobId, JobState, Prompt,
    SubmitRequest, TraceContext, TransportOptions,
};
use scd_types::Mode;

/// Exit code: the cluster could not be reached.
const UNREACHABLE: u8 = 3;
/// Exit code: the job failed or was cancelled.
const JOB_FAILED: u8 = 4;
/// Exit code: the node refused the request.
const REFUSED: u8 = 5;
/// Exit code: the cluster holds its limit of unfinished jobs; the message says when to retry.
const BUSY: u8 = 6;

/// Where the cluster is and who is asking: flags, then environment variables, then the client
/// config file (`--client-config`, `$SCD_CLIENT_CONFIG`, else `~/.config/scd/client.toml`
/// when it exists), then the defaults.
#[derive(clap::Args)]
pub struct Target {
    /// The node to talk to, as NAME@HOST:PORT (its certificate name and QUIC address; a node
    /// prints both when it starts). It must have the admin role.
    #[arg(long, env = "SCD_NODE")]
    pub node: Option<String>,
    /// The folder with ca.pem and the admin certificate (`scd cert init` / `scd cert issue`);
    /// default `.cache/pki`.
    #[arg(long, env = "SCD_PKI_DIR")]
    pub pki_dir: Option<PathBuf>,
    /// The admin certificate's name (`<name>.pem`, `<name>.key`); default `ops`.
    #[arg(long = "name", env = "SCD_ADMIN_NAME")]
    pub admin_name: Option<String>,
    /// A TOML file with `node`, `pki_dir` and `name` for what the flags and environment leave
    /// out.
    #[arg(long, env = "SCD_CLIENT_CONFIG")]
    pub client_config: Option<PathBuf>,
}

/// The client config file's keys.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClientFile {
    node: Option<String>,
    pki_dir: Option<PathBuf>,
    name: Option<String>,
}

/// A [`Target`] with every gap filled.
struct Resolved {
    node: String,
    pki_dir: PathBuf,
    admin_name: String,
}

impl Target {
    fn resolve(&self) -> Result<Resolved, Failure> {
        let default_file = std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".config/scd/client.toml"))
            .filter(|p| p.is_file());
        let path = self.client_config.clone().or(default_file);
        let file: ClientFile = match &path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading the client config {}", p.display()))
                    .map_err(|e| fail(2, e))?;
                toml::from_str(&text)
                    .with_context(|| format!("the client config {}", p.display()))
                    .map_err(|e| fail(2, e))?
            }
            None => ClientFile::default(),
        };
        let node = self.node.clone().or(file.node).ok_or_else(|| {
            fail(
                2,
                anyhow::anyhow!(
                    "which node? give --node NAME@HOST:PORT, set SCD_NODE, or put node = \"...\" in the client config"
                ),
            )
        })?;
        Ok(Resolved {
            node,
            pki_dir: self
                .pki_dir
                .clone()
                .or(file.pki_dir)
                .unwrap_or_else(|| PathBuf::from(".cache/pki")),
            admin_name: self
                .admin_name
                .clone()
                .or(file.name)
                .unwrap_or_else(|| "ops".into()),
        })
    }
}

/// Arguments of `scd submit`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd submit --node producer@127.0.0.1:7101 --expert sotu --prompt 'What did the president promise?'\n  \
    scd submit --node producer@127.0.0.1:7101 --expert mail --raw --prompt-file mail.txt --mode raw --json\n  \
    echo 'Describe the sea.' | scd submit --node producer@127.0.0.1:7101 --expert melville\n  \
    scd submit --node producer@127.0.0.1:7101 --expert mail --expert sotu --mode raw --prompt 'Hello'\n  \
    scd submit --node producer@127.0.0.1:7101 --expert mail --document 3f2a... --prompt 'Summarise the document.'")]
pub struct SubmitArgs {
    #[command(flatten)]
    pub target: Target,
    /// The expert that answers; repeat it for a fan-out: one prefill and one code stream
    /// serve every expert named (of one base, hosted together on a consumer node), each
    /// answering in turn on stdout.
    #[arg(long, required = true)]
    pub expert: Vec<String>,
    /// How the base model's prefill reaches the expert: oracle, raw, q4, droidspeak, reuse, scd,
    /// or auto (the producer picks the fastest expected under the quality ceiling; the record
    /// says which and why). Default auto; oracle with --document (the expert reads the prompt
    /// itself after the documents, whose compiled caches the producer serves).
    #[arg(long)]
    pub mode: Option<Mode>,
    /// A document to place before the prompt, by id (`scd docs add`); repeat it for several,
    /// in order.
    #[arg(long = "document")]
    pub documents: Vec<String>,
    /// The prompt; without it and --prompt-file, stdin.
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// A file holding the prompt.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Send the prompt as it is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object at the end (the job's summary and its text) instead of streaming
    /// the text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `scd jobs`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd jobs list --node producer@127.0.0.1:7101\n  \
    scd jobs watch --node producer@127.0.0.1:7101 3f2a...")]
pub struct JobsArgs {
    #[command(subcommand)]
    pub command: JobsCommand,
}

/// Arguments of `scd nodes` and `scd pools`.
#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub target: Target,
    /// Print the JSON the node answered with.
    #[arg(long)]
    pub json: bool,
}

/// `scd jobs` subcommands.
#[derive(clap::Subcommand)]
pub enum JobsCommand {
    /// The cluster's jobs, newest first.
    #[command(after_help = "Example:\n  scd jobs list --node producer@127.0.0.1:7101")]
    List {
        #[command(flatten)]
        target: Target,
        /// Print the JSON the node answered with.
        #[arg(long)]
        json: bool,
    },
    /// One job's whole record: request, states with times, stage timeline, output.
    #[command(after_help = "Example:\n  scd jobs show --node producer@127.0.0.1:7101 3f2a...")]
    Show {
        #[command(flatten)]
        target: Target,
        /// The job id.
        job: JobId,
    },
    /// Follow a job to its end, printing its text as it comes.
    #[command(after_help = "Example:\n  scd jobs watch --node producer@127.0.0.1:7101 3f2a...")]
    Watch {
        #[command(flatten)]
        target: Target,
        /// The job id (32 hex digits, as `scd submit` prints it).
        job: JobId,
        /// Print one JSON object at the end instead of streaming the text.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job; the nodes working on it stop.
    #[command(after_help = "Example:\n  scd jobs cancel --node producer@127.0.0.1:7101 3f2a...")]
    Cancel {
        #[command(flatten)]
        target: Target,
        /// The job id.
        job: JobId,
        /// Why (kept in the job record).
        #[arg(long, default_value = "cancelled by an operator")]
        reason: String,
    },
}

/// A failure with its exit code.
pub(crate) struct Failure {
    code: u8,
    error: anyhow::Error,
}

pub(crate) fn fail(code: u8, error: anyhow::Error) -> Failure {
    Failure { code, error }
}

pub(crate) fn exit(result: Result<(), Failure>) -> anyhow::Result<ExitCode> {
    match result {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(Failure { code, error }) => {
            eprintln!("error: {}", crate::report::one_line(&error));
            Ok(ExitCode::from(code))
        }
    }
}

async fn connect(target: &Target) -> Result<(Endpoint, Connection), Failure> {
    let target = target.resolve()?;
    let (name, addr) = target.node.split_once('@').ok_or_else(|| {
        fail(
            2,
            anyhow::anyhow!(
                "--node {:?} is not NAME@HOST:PORT (the node's certificate name and its QUIC address, e.g. producer@127.0.0.1:7101)",
                target.node
            ),
        )
    })?;
    let identity = Identity::load(&target.pki_dir, &target.admin_name)
        .with_context(|| {
            format!(
                "loading the admin certificate {name}.pem from {dir} (make one with `scd cert issue --dir {dir} --name {name} --role admin`)",
                name = target.admin_name,
                dir = target.pki_dir.display()
            )
        })
        .map_err(|e| fail(2, e))?;
    let addr: SocketAddr = tokio::net::lookup_host(addr)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| fail(2, anyhow::anyhow!("cannot resolve the node address {addr}")))?;
    let local: SocketAddr = if addr.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = Endpoint::client(local, &identity, TransportOptions::default())
        .context("opening a QUIC endpoint")
        .map_err(|e| fail(UNREACHABLE, e))?;
    let conn = endpoint
        .connect(addr, name)
        .await
        .with_context(|| {
            format!("connecting to node {name} at {addr}: is it running, with this cluster's CA?")
        })
        .map_err(|e| fail(UNREACHABLE, e))?;
    Ok((endpoint, conn))
}

/// The prompt from the flag, the file or stdin.
fn prompt_text(args: &SubmitArgs) -> anyhow::Result<String> {
    if let Some(p) = &args.prompt {
        return Ok(p.clone());
    }
    if let Some(path) = &args.prompt_file {
        return std::fs::read_to_string(path)
            .with_context(|| format!("reading the prompt file {}", path.display()));
    }
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading the prompt from stdin")?;
    if text.trim().is_empty() {
        bail!("no prompt: give --prompt, --prompt-file or text on stdin");
    }
    Ok(text)
}

fn milli(x: f32) -> u32 {
    (x.max(0.0) * 1000.0).round() as u32
}

pub fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let text = match prompt_text(&args) {
        Ok(t) => t,
        Err(e) => return exit(Err(fail(2, e))),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    exit(runtime.block_on(async {
        let (endpoint, conn) = connect(&args.target).await?;
        let job_id = JobId::random();
        // The job's trace starts here, so its id is known before the cluster answers.
        let trace = TraceContext::fresh();
        let (expert, fan_out) = match args.expert.split_first() {
            Some((e, more)) => (e.clone(), more.to_vec()),
            None => return Err(fail(2, anyhow::anyhow!("name an --expert"))),
        };
        let request = Control::Submit(SubmitRequest {
            job_id,
            expert,
            fan_out,
            mode: args.mode.unwrap_or(match args.documents.is_empty() {
                true => Mode::Auto,
                false => Mode::Oracle,
            }),
            documents: args.documents.clone(),
            prompt: Prompt::Text(text),
            chat: !args.raw,
            max_tokens: args.max_tokens,
            temperature_milli: milli(args.temperature),
            top_p_milli: milli(args.top_p),
            seed: args.seed,
            trace: trace.clone(),
        });
        eprintln!("job {job_id}");
        if let Some(id) = trace.trace_id() {
            eprintln!("trace {id}");
        }
        let call = conn
            .call_admin(request)
            .await
            .context("sending the job")
            .map_err(|e| fail(UNREACHABLE, e))?;
        // Ctrl-C closes the connection at once (a killed process would leave the node to
        // notice only when the connection times out), and the node cancels the job.
        let result = tokio::select! {
            r = follow(call, args.json, false) => r,
            _ = tokio::signal::ctrl_c() => Err(fail(
                130,
                anyhow::anyhow!("interrupted: job {job_id} is cancelled"),
            )),
        };
        conn.close("done");
        endpoint.wait_idle().await;
        result
    }))
}

/// Asks a node for `topic` (`nodes`, `pools`, `translators`, `jobs`, `job/<id>`); the JSON it
/// answers.
async fn inspect(target: &Target, topic: String) -> Result<serde_json::Value, Failure> {
    ask(target, Control::Inspect { topic }).await
}

/// Sends `request` (an `Inspect` or a `Change`) to a node; the JSON of its `Report`.
pub(crate) async fn ask(target: &Target, request: Control) -> Result<serde_json::Value, Failure> {
    let (endpoint, conn) = connect(target).await?;
    let answer = async {
        let mut call = conn
            .call_admin(request)
            .await
            .context("sending the request")
            .map_err(|e| fail(UNREACHABLE, e))?;
        match call.next().await {
            Ok(Some(Control::Report { body })) => serde_json::from_str(&body)
                .context("reading the node's answer")
                .map_err(|e| fail(UNREACHABLE, e)),
            Ok(Some(Control::Error { code, message, .. })) => {
                let exit = if code == error_code::INTERNAL {
                    UNREACHABLE
                } else {
                    REFUSED
                };
                Err(fail(exit, anyhow::anyhow!("{message}")))
            }
            Ok(other) => Err(fail(
                UNREACHABLE,
                anyhow::anyhow!("unexpected answer from the node: {other:?}"),
            )),
            Err(e) => Err(fail(UNREACHABLE, anyhow::Error::new(e))),
        }
    }
    .await;
    conn.close("done");
    endpoint.wait_idle().await;
    answer
}

pub(crate) fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// Asks a node for `topic` and prints its answer: as JSON with `json`, else with `table`.
pub(crate) fn show(
    target: &Target,
    topic: &str,
    json: bool,
    table: impl FnOnce(&serde_json::Value),
) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    exit(runtime.block_on(async {
        let v = inspect(target, topic.into()).await?;
        match json {
            true => print_json(&v),
            false => table(&v),
        }
        Ok(())
    }))
}

/// `scd nodes`: the live nodes, what they serve and their load.
pub fn nodes(args: ListArgs) -> anyhow::Result<ExitCode> {
    show(&args.target, "nodes", args.json, |v| {
        println!(
            "{:<16} {:<22} {:>9} {:<34} experts",
            "node", "address", "load", "produces"
        );
        for n in v.as_array().into_iter().flatten() {
            let list = |k: &str| {
                n[k].as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str())
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default()
            };
            println!(
                "{:<16} {:<22} {:>4}/{:<4} {:<34} {}",
                n["id"].as_str().unwrap_or("?"),
                n["addr"].as_str().unwrap_or("?"),
                n["load"],
                n["capacity"],
                list("producer_models"),
                list("consumer_models")
            );
        }
    })
}

/// `scd pools`: the producers the scheduler assigned to each expert.
pub fn pools(args: ListArgs) -> anyhow::Result<ExitCode> {
    show(&args.target, "pools", args.json, |v| {
        println!("{:<16} producers", "expert");
        for (expert, producers) in v.as_object().into_iter().flatten() {
            let p: Vec<&str> = producers
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_str())
                .collect();
            println!("{expert:<16} {}", p.join(", "));
        }
    })
}

pub fn jobs(args: JobsArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    exit(runtime.block_on(async {
        let (target, request, json) = match args.command {
            JobsCommand::List { target, json } => {
                let v = inspect(&target, "jobs".into()).await?;
                if json {
                    print_json(&v);
                    return Ok(());
                }
                println!(
                    "{:<32} {:<12} {:<10} {:<11} {:>9}  error",
                    "job", "state", "expert", "mode", "total ms"
                );
                for j in v.as_array().into_iter().flatten() {
                    println!(
                        "{:<32} {:<12} {:<10} {:<11} {:>9}  {}",
                        j["job"].as_str().unwrap_or("?"),
                        j["state"].as_str().unwrap_or("?"),
                        j["expert"].as_str().unwrap_or("?"),
                        j["mode"].as_str().unwrap_or("?"),
                        j["timings_ms"]["total"]
                            .as_f64()
                            .map_or("-".into(), |t| format!("{t:.0}")),
                        j["error"].as_str().unwrap_or("")
                    );
                }
                return Ok(());
            }
            JobsCommand::Show { target, job } => {
                print_json(&inspect(&target, format!("job/{job}")).await?);
                return Ok(());
            }
            JobsCommand::Watch { target, job, json } => {
                (target, Control::Watch { job_id: job }, json)
            }
            JobsCommand::Cancel {
                target,
                job,
                reason,
            } => (
                target,
                Control::Cancel {
                    job_id: job,
                    reason,
                },
                false,
            ),
        };
        let cancelling = matches!(request, Control::Cancel { .. });
        let (endpoint, conn) = connect(&target).await?;
        let call = conn
            .call_admin(request)
            .await
            .context("sending the request")
            .map_err(|e| fail(UNREACHABLE, e))?;
        let result = follow(call, json, cancelling).await;
        conn.close("done");
        endpoint.wait_idle().await;
        result
    }))
}

/// Reads a call's replies: streams text to stdout (or gathers it for `json`), status lines to
/// stderr, and ends with the job's fate.
async fn follow(mut call: AdminCall, json: bool, cancelling: bool) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    let mut text = String::new();
    let mut last: Option<(JobState, String)> = None;
    loop {
        let reply = call
            .next()
            .await
            .context("reading the node's replies")
            .map_err(|e| fail(UNREACHABLE, e))?;
        match reply {
            None => break,
            Some(Control::Tokens { text: piece, .. }) => {
                if !json {
                    let _ = stdout.write_all(piece.as_bytes());
                    let _ = stdout.flush();
                }
                text.push_str(&piece);
            }
            Some(Control::JobStatus { state, detail, .. }) => {
                if !state.is_finished() && !json {
                    let sep = if detail.is_empty() { "" } else { ": " };
                    eprintln!("[{state}{sep}{detail}]");
                }
                last = Some((state, detail));
            }
            Some(Control::Error { code, message, .. }) => {
                let exit = match code {
                    error_code::REFUSED | error_code::NOT_FOUND | error_code::PROTOCOL => REFUSED,
                    error_code::BUSY => BUSY,
                    _ => JOB_FAILED,
                };
                return Err(fail(exit, anyhow::anyhow!("{message}")));
            }
            Some(other) => {
                return Err(fail(
                    UNREACHABLE,
                    anyhow::anyhow!("unexpected reply from the node: {other:?}"),
                ))
            }
        }
    }
    let Some((state, detail)) = last else {
        return Err(fail(
            UNREACHABLE,
            anyhow::anyhow!("the node ended the call without a status"),
        ));
    };
    let summary: serde_json::Value =
        serde_json::from_str(&detail).unwrap_or(serde_json::Value::String(detail));
    if json {
        let mut out = summary.clone();
        if let Some(o) = out.as_object_mut() {
            o.insert("text".into(), serde_json::Value::String(text));
        }
        let _ = writeln!(stdout, "{out}");
    } else {
        let _ = writeln!(stdout);
        // A fan-out's other experts answer after the first, each under its name.
        if let Some(outputs) = summary["outputs_text"].as_object() {
            for (expert, text) in outputs {
                let _ = writeln!(stdout, "[{expert}]\n{}", text.as_str().unwrap_or_default());
            }
        }
        eprintln!("[{state}: {}]", describe(&summary));
    }
    match state {
        JobState::Done => Ok(()),
        JobState::Cancelled if cancelling => Ok(()),
        _ => Err(fail(
            JOB_FAILED,
            anyhow::anyhow!(
                "job {state}: {}",
                summary["error"].as_str().unwrap_or("no reason recorded")
            ),
        )),
    }
}

/// One line of a summary for people.
fn describe(s: &serde_json::Value) -> String {
    let ms = |k: &str| {
        s["timings_ms"][k]
            .as_f64()
            .map(|v| format!("{k} {v:.0} ms"))
    };
    let mut parts: Vec<String> = ["ttft", "prefill", "transfer", "rebuild", "total"]
        .iter()
        .filter_map(|k| ms(k))
        .collect();
    if let Some(n) = s["tokens"].as_u64() {
        parts.insert(0, format!("{n} tokens"));
    }
    if let Some(b) = s["payload_bytes"].as_u64().filter(|b| *b > 0) {
        parts.push(format!("{b} bytes on the wire"));
    }
    if let Some(why) = s["mode_choice"].as_str() {
        parts.push(format!("auto chose {why}"));
    }
    if let Some(f) = s["fallback"].as_object() {
        parts.push(format!(
            "ran as {} instead of {}: {}",
            s["mode"].as_str().unwrap_or("?"),
            f.get("from").and_then(|v| v.as_str()).unwrap_or("?"),
            f.get("reason").and_then(|v| v.as_str()).unwrap_or("?")
        ));
    }
    if let Some(r) = s["ranks"].as_object() {
        let n = |k: &str| r["ranks"][k].as_u64().unwrap_or(0);
        let mut how = r["rule"].as_str().unwrap_or("?").to_string();
        if let Some(m) = r.get("link_mbit").and_then(|v| v.as_f64()) {
            how.push_str(&format!(" for {m:.0} Mbit/s"));
        }
        if let Some(kl) = r.get("curve_kl").and_then(|v| v.as_f64()) {
            how.push_str(&format!(", held-out KL {kl:.3}"));
        }
        parts.push(format!(
            "ranks k={},v={},h={} ({how})",
            n("k"),
            n("v"),
            n("h")
        ));
    }
    if let Some(n) = s["cached_prefix_tokens"].as_u64().filter(|n| *n > 0) {
        parts.push(format!("{n} prompt tokens from the prefix cache"));
    }
    if let (Some(p), Some(c)) = (s["producer"].as_str(), s["consumer"].as_str()) {
        parts.push(format!("{p} -> {c}"));
    }
    parts.join(", ")
}
