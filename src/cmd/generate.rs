//! `scd generate`: load a model (GGUF file or Hugging Face directory), optionally with a LoRA
//! adapter, apply the chat template, and stream a reply to stdout; a summary goes to stderr.

use scd_models::KernelChoice;
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use scd_models::codec::{codec_with, CodecOptions};
use scd_models::eval::harness::{transfer, Pair, Transfer};
use scd_models::tokenizer::{ChatMessage, Tokenizer};
use scd_models::translator::Translator;
use scd_models::{
    generate_with_cache, AdapterMode, GenerateParams, GgufFile, Llama, LoraAdapter, Sampling,
};
use scd_types::Mode;

/// Arguments of `scd generate`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd generate --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt 'What is a cache?'\n  \
    scd generate --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --adapter experts/melville/adapter.safetensors \\\n      --prompt 'Describe the sea.' --max-tokens 64")]
pub struct Args {
    /// A llama GGUF file, or a Hugging Face directory (config.json, *.safetensors,
    /// tokenizer.json).
    #[arg(long, env = "SCD_MODEL")]
    pub model: PathBuf,
    /// A LoRA adapter (PEFT safetensors) to apply.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// How to apply the adapter: fold it into the weights (fastest; the expert gets its own
    /// copy of the adapted weights) or add its low-rank term in every pass (base weights
    /// shared, slower per token).
    #[arg(long, value_enum, default_value_t = ModeArg::Merge, requires = "adapter")]
    pub adapter_mode: ModeArg,
    /// The prompt (a user message; the model's chat template is applied).
    #[arg(long)]
    pub prompt: String,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Send the prompt as it is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Disaggregated: the base model (--model without the adapter) prefills the prompt and
    /// hands its state to the expert in this transfer mode (oracle, raw, q4, droidspeak, reuse,
    /// scd); the expert decodes from the rebuilt cache. Prints the payload it took.
    #[arg(long, requires = "adapter")]
    pub transfer: Option<Mode>,
    /// The base/expert translator folder (scd calibrate), for droidspeak, reuse and scd.
    #[arg(long)]
    pub translator: Option<PathBuf>,
    /// Element type of the reuse / scd codes: f16, bf16, f32 or i8-rows.
    #[arg(long, default_value = "f16")]
    pub code_dtype: String,
}

/// `--adapter-mode` values.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ModeArg {
    /// Fold `scale * B A` into the weights at load.
    Merge,
    /// Keep `A` and `B` apart and apply them in every forward pass.
    OnTheFly,
}

impl From<ModeArg> for AdapterMode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Merge => AdapterMode::Merge,
            ModeArg::OnTheFly => AdapterMode::OnTheFly,
        }
    }
}

/// Loads a model and its tokenizer from a GGUF file or a Hugging Face directory.
/// Loads a model (GGUF file or Hugging Face folder) and its tokenizer, on `kernels`.
pub fn load(path: &Path, kernels: KernelChoice) -> anyhow::Result<(Llama, Tokenizer)> {
    if path.is_dir() {
        let model = Llama::from_hf_dir_with(path, kernels)
            .with_context(|| format!("loading the model directory {}", path.display()))?;
        let tok = Tokenizer::from_hf_dir(path)
            .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
        Ok((model, tok))
    } else {
        let file = GgufFile::open(path).context("opening the model")?;
        let tok = Tokenizer::from_gguf(file.content())
            .with_context(|| format!("reading the tokenizer from {}", path.display()))?;
        let model = file.load_model_with(kernels).context("loading the model")?;
        Ok((model, tok))
    }
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let sampling = Sampling::from_params(args.temperature, args.top_p)?;
    let t0 = Instant::now();
    let (base, tok) = load(&args.model, kernels)?;
    let model = match &args.adapter {
        Some(path) => {
            let adapter = LoraAdapter::load(path, base.config())
                .with_context(|| format!("loading the adapter {}", path.display()))?;
            base.with_adapter(&adapter, args.adapter_mode.into())
                .context("applying the adapter")?
        }
        None => base.clone(),
    };
    let load_time = t0.elapsed();
    let text = if args.raw {
        args.prompt.clone()
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::system(s.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        tok.apply_chat_template(&messages, true)
            .context("applying the chat template")?
    };
    let prompt = tok.encode(&text, false).context("tokenising the prompt")?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling,
        seed: args.seed,
        stop_tokens: tok.stop_ids().to_vec(),
    };
    // Disaggregated: the base prefills all but the last token and the expert continues from
    // the cache the transfer mode rebuilds.
    let mut handed_over = match args.transfer {
        Some(_) if prompt.len() < 2 => {
            bail!("--transfer needs a prompt of at least two tokens (the base prefills all but the last)")
        }
        Some(mode) => {
            let translator = match &args.translator {
                Some(dir) => {
                    let t = Translator::load(dir)
                        .with_context(|| format!("loading the translator {}", dir.display()))?;
                    let expert = t.check_pair(&base, &model)?;
                    Some((Arc::new(t), expert))
                }
                None => None,
            };
            let codec = codec_with(
                mode,
                translator.as_ref().map(|(t, e)| (t, *e)),
                &CodecOptions {
                    code_dtype: super::eval::code_dtype(&args.code_dtype)?,
                    ..CodecOptions::default()
                },
            )?;
            let pair = Pair {
                producer: &base,
                consumer: &model,
            };
            let prefix = &prompt[..prompt.len() - 1];
            Some((
                mode,
                transfer(codec.as_ref(), pair, prefix).context("transferring the prompt")?,
            ))
        }
        None => None,
    };
    let mut decoder = tok.stream_decoder(true);
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let on_token = |id| {
        let piece = match decoder.step(id) {
            Ok(p) => p,
            Err(e) => {
                write_err = Some(anyhow::Error::new(e).context("decoding a token"));
                return ControlFlow::Break(());
            }
        };
        if let Err(e) = stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
        {
            write_err = Some(anyhow::Error::new(e).context("writing to stdout"));
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    };
    let generation = match handed_over.as_mut() {
        Some((_, t)) => generate_with_cache(
            &model,
            &mut t.cache,
            &prompt[prompt.len() - 1..],
            &params,
            on_token,
        ),
        None => scd_models::generate(&model, &prompt, &params, on_token),
    }
    .context("generating")?;
    if let Some(e) = write_err {
        return Err(e);
    }
    writeln!(stdout, "{}", decoder.finish())
        .and_then(|_| stdout.flush())
        .context("writing to stdout")?;
    let n = generation.tokens.len();
    let decode_s = generation.decode.as_secs_f64();
    eprintln!(
        "[scd] model {} (sha256 {}…) loaded in {:.2}s | prompt {} tokens, prefill {:.2}s | \
         generated {} tokens in {:.2}s ({:.1} tok/s) | stop: {:?}",
        args.model.display(),
        &model.identity().sha256[..12],
        load_time.as_secs_f64(),
        generation.prompt_tokens,
        generation.prefill.as_secs_f64(),
        n,
        decode_s,
        if decode_s > 0.0 {
            n as f64 / decode_s
        } else {
            0.0
        },
        generation.stop,
    );
    if let Some((
        mode,
        Transfer {
            payload, timing, ..
        },
    )) = &handed_over
    {
        let cfg = base.config();
        let raw = (prompt.len() - 1) * cfg.kv_dim() * 2 * 2 * cfg.num_layers;
        eprintln!(
            "[scd] transfer {mode}: base prefill {:.0} ms, encode {:.1} ms, payload {} bytes ({:.0}% of raw bf16 KV), expert rebuild {:.1} ms",
            timing.producer_prefill_ms,
            timing.encode_ms,
            payload,
            100.0 * *payload as f64 / raw.max(1) as f64,
            timing.rebuild_ms
        );
    }
    Ok(())
}
