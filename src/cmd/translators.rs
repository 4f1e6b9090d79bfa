//! `scd translators list|publish|activate|rollback`: the translator versions of each (base,
//! expert) pair in the cluster's store, through a node's admin endpoint. Nodes follow the live
//! version of their pairs on their own, without a restart. `scd translators convert` works on a
//! folder, offline: it rewrites a translator's weights in another storage type.

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

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match &args.command {
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
            Command::List { .. } | Command::Convert { .. } => Ok(()),
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
