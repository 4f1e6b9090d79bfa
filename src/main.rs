//! `scd`: the one binary of the Semantic Cache Distillation cluster.
//!
//! Each subcommand lives in its own file under `src/cmd/` and turns library errors into
//! operator-facing messages with `anyhow` context; `report` prints the one that ends a command.

mod cmd;
mod cost_model;
mod kernels;
mod paths;
mod progress;
mod report;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "scd",
    version,
    about = "Serve fine-tuned expert LLMs from shared base-model prefill work"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    kernels: kernels::KernelArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Load a model and generate a reply to a prompt (single process, no cluster).
    Generate(cmd::generate::Args),
    /// Train a LoRA expert of a base model on a text corpus.
    Finetune(cmd::finetune::Args),
    /// Compare ways of building an expert's cache against its own prefill (and `eval drift`).
    Eval(Box<cmd::eval::Args>),
    /// SemPIC: train a writer that compiles documents into position-independent caches.
    Sempic(cmd::sempic::Args),
    /// Fit the SCD translator of a base model and its experts.
    Calibrate(cmd::calibrate::Args),
    /// Create the cluster CA and issue node and admin certificates.
    Cert(cmd::cert::Args),
    /// Run benchmarks (build with --release).
    Bench(cmd::bench::Args),
    /// Run a cluster node from its config file until SIGTERM or Ctrl-C (then drain).
    Node(cmd::node::Args),
    /// Start an in-process cluster and run one prompt through it in every transfer mode.
    Demo(cmd::demo::Args),
    /// Submit a job to a cluster and stream the expert's reply.
    Submit(cmd::admin::SubmitArgs),
    /// List, show, follow or cancel a cluster's jobs.
    Jobs(cmd::admin::JobsArgs),
    /// The cluster's live nodes: address, load, what each produces and decodes.
    #[command(after_help = "Example:\n  scd nodes --node producer@127.0.0.1:7101")]
    Nodes(cmd::admin::ListArgs),
    /// The producers the scheduler assigned to each expert.
    #[command(after_help = "Example:\n  scd pools --node producer@127.0.0.1:7101")]
    Pools(cmd::admin::ListArgs),
    /// The translator versions of each (base, expert) pair: list, publish, activate, roll back.
    Translators(cmd::translators::Args),
    /// Documents jobs may name by id (SemPIC): add, list.
    Docs(cmd::docs::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(
        after_help = "Example:\n  scd completions bash > ~/.local/share/bash-completion/completions/scd"
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{}", report::report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SCD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Resolved only by the commands that load a model: a kernel flag an admin command
    // never uses cannot fail it.
    let kernels = || cli.kernels.choice();
    let done = match cli.command {
        Command::Generate(args) => cmd::generate::run(args, kernels()?),
        Command::Finetune(args) => cmd::finetune::run(args, kernels()?),
        Command::Eval(args) => cmd::eval::run(*args, kernels()?),
        Command::Calibrate(args) => cmd::calibrate::run(args, kernels()?),
        Command::Sempic(args) => cmd::sempic::run(args, kernels()?),
        Command::Cert(args) => cmd::cert::run(args),
        Command::Bench(args) => cmd::bench::run(args, kernels()?),
        Command::Node(args) => cmd::node::run(args, kernels()?),
        Command::Demo(args) => cmd::demo::run(args, kernels()?),
        // These choose their own exit codes (cluster unreachable, job failed, refused).
        Command::Submit(args) => return cmd::admin::submit(args),
        Command::Jobs(args) => return cmd::admin::jobs(args),
        Command::Nodes(args) => return cmd::admin::nodes(args),
        Command::Pools(args) => return cmd::admin::pools(args),
        Command::Translators(args) => return cmd::translators::run(args, &cli.kernels),
        Command::Docs(args) => return cmd::docs::run(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            use std::io::Write;
            // Into a buffer first: the generator panics on a write error (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "scd", &mut script);
            match std::io::stdout().write_all(&script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                _ => Ok(()),
            }
        }
    };
    done.map(|()| std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every command and subcommand's `--help` ends with an example.
    #[test]
    fn every_command_has_an_example() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                let name = format!("{path} {}", sub.get_name());
                let help = sub.get_after_help().map(|h| h.to_string());
                if !help.is_some_and(|h| h.contains("Example")) {
                    missing.push(name.clone());
                }
                walk(sub, &name, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "scd", &mut missing);
        assert!(missing.is_empty(), "no example in --help of: {missing:?}");
    }
}
