//! `scd docs add|list`: the documents a cluster's jobs may name by id (SemPIC, `docs/method.md`
//! §5.5), through a node's admin endpoint. A document is recorded once with its tokens (the node
//! tokenises the text with its base model's tokenizer); a job names it with
//! `scd submit --document ID`, and the producer that takes the job serves its compiled cache from
//! its store, compiling it there the first time.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use scd_transport::Control;

use crate::cmd::admin::{ask, exit, fail, show, Target};

/// Arguments of `scd docs`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd docs add --node producer@127.0.0.1:7101 manual.txt faq.txt\n  \
    scd docs list --node producer@127.0.0.1:7101\n  \
    scd submit --node producer@127.0.0.1:7101 --expert mail --document 3f2a... --prompt 'What does the manual say about backups?'")]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

/// `scd docs` subcommands.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Record text files as documents; prints each one's id and tokens.
    #[command(
        after_help = "Example:\n  scd docs add --node producer@127.0.0.1:7101 manual.txt faq.txt"
    )]
    Add {
        #[command(flatten)]
        target: Target,
        /// The text files (UTF-8), one document each.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print the JSON the node answered with.
        #[arg(long)]
        json: bool,
    },
    /// Every document: id, tokens, name, and the producers holding it compiled.
    #[command(after_help = "Example:\n  scd docs list --node producer@127.0.0.1:7101")]
    List {
        #[command(flatten)]
        target: Target,
        /// Print the JSON the node answered with.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::List { target, json } => show(&target, "documents", json, print_list),
        Command::Add {
            target,
            files,
            json,
        } => {
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            exit(runtime.block_on(async {
                // Every file is read and checked before the first is sent: a bad one late in
                // the list leaves the cluster's documents as they were.
                let bodies = files
                    .iter()
                    .map(|file| add_body(file).map_err(|e| fail(2, e)))
                    .collect::<Result<Vec<_>, _>>()?;
                for (file, body) in files.iter().zip(bodies) {
                    let v = ask(
                        &target,
                        Control::Change {
                            topic: "documents/add".into(),
                            body,
                        },
                    )
                    .await?;
                    match json {
                        true => crate::cmd::admin::print_json(&v),
                        false => println!(
                            "{}  {:>6} tokens  {}",
                            v["id"].as_str().unwrap_or("?"),
                            v["tokens"],
                            file.display()
                        ),
                    }
                }
                Ok(())
            }))
        }
    }
}

/// Room in a control frame for what surrounds the request's body (the archive's own fields).
const FRAME_HEADROOM: usize = 1024;

/// The `documents/add` request for `file`, refused when it would not fit one control frame
/// (one admin request is one frame): said here, before connecting, rather than while sending.
fn add_body(file: &Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
    let body = serde_json::json!({ "text": text, "name": name }).to_string();
    let cap = scd_transport::CONTROL_MAX_FRAME_BYTES as usize - FRAME_HEADROOM;
    if body.len() > cap {
        anyhow::bail!(
            "{}: {} bytes of text; one `scd docs add` request carries at most {cap} bytes: split it into several documents",
            file.display(),
            text.len()
        );
    }
    Ok(body)
}

fn print_list(v: &serde_json::Value) {
    println!("{:<32} {:>7}  {:<24} held by", "id", "tokens", "name");
    for d in v.as_array().into_iter().flatten() {
        let held: Vec<&str> = d["held_by"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str())
            .collect();
        println!(
            "{:<32} {:>7}  {:<24} {}",
            d["id"].as_str().unwrap_or("?"),
            d["tokens"],
            d["name"].as_str().unwrap_or("-"),
            held.join(", ")
        );
    }
}
