//! `scd generate`: load a model, apply the chat template, and stream a reply.

/// Arguments of `scd generate`.
#[derive(clap::Args)]
pub struct Args {
    /// The prompt (a user message; the model's chat template is applied).
    #[arg(long)]
    pub prompt: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::bail!("model loading is not built yet (prompt: {:?})", args.prompt)
}
