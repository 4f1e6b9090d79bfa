//! `scd bench codes`: what coding a prompt's state costs next to the prefills it stands
//! between. For one WikiText-2 prompt and an expert's shipped translator, each coded mode
//! (scd and reuse as transform-coded codes, kvtc; raw and q4 for reference) at the rate its
//! rate table gives for a share of raw's bytes: the producer's prefill with the capture, the
//! encode (projections and entropy coding), the consumer's rebuild (entropy decoding and
//! products), the oracle's own prefill, and the entropy coder alone in both directions on one
//! thread (MB/s of raw bf16 KV the codes stand for, and of code bytes). Same warm-up and
//! repetitions for every figure, medians.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use scd_models::codec::{self, codec_with, transform, Codec, CodecOptions, Prefix, TcRate};
use scd_models::eval::EvalData;
use scd_models::translator::Translator;
use scd_models::{Input, KernelChoice, LogitsWanted};
use scd_types::{CodeDType, LayerCode, Mode};

/// Arguments of `scd bench codes`.
#[derive(clap::Args)]
pub struct Args {
    /// The base model (GGUF).
    #[arg(long, env = "SCD_MODEL")]
    model: PathBuf,
    /// The expert's folder (its adapter, and its translator in `translator/`).
    #[arg(long)]
    expert: PathBuf,
    /// Prompt tokens (a stretch of WikiText-2's validation text).
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// The share of raw's bytes each coded mode is sized for, by its rate table.
    #[arg(long, default_value_t = 0.115)]
    share: f64,
    /// Untimed runs before the timed ones, per figure.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[command(flatten)]
    dirs: crate::paths::DataDirs,
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    if args.tokens == 0 || !(args.share > 0.0 && args.share < 1.0) {
        bail!("--tokens must be positive and --share between 0 and 1");
    }
    let (base, tok) = super::generate::load(&args.model, kernels)?;
    let (name, expert) = super::calibrate::load_expert(&base, &args.expert)?;
    let dir = args.expert.join("translator");
    let translator = Translator::load(&dir)
        .with_context(|| format!("loading the translator {}", dir.display()))?;
    let index = translator.check_pair(&base, &expert)?;
    let translator = Arc::new(translator);
    let data = EvalData::load(&args.dirs.eval_data).with_context(|| {
        format!(
            "reading WikiText-2 under {} (set --eval-data)",
            args.dirs.eval_data.display()
        )
    })?;
    let text = scd_models::corpus::tokenize_long(&tok, &data.text).context("tokenising")?;
    let context = base.config().context_length;
    if args.tokens >= context || args.tokens > text.len() {
        bail!(
            "a prompt of {} tokens does not fit the {context}-token window or the text",
            args.tokens
        );
    }
    let prompt = &text[..args.tokens];
    let table = translator
        .manifest
        .rate_table
        .as_ref()
        .context("the translator has no rate table (scd translators rates)")?;
    let step = |mode: Mode| {
        table
            .step_for_share(mode, index, args.share)
            .with_context(|| format!("the rate table has no {mode} rates around {}", args.share))
    };
    let mut codecs: Vec<(String, Box<dyn Codec>)> = Vec::new();
    for mode in [Mode::Raw, Mode::Q4, Mode::Kvtc, Mode::Reuse, Mode::Scd] {
        let opts = match mode {
            Mode::Raw | Mode::Q4 => CodecOptions::default(),
            _ => CodecOptions {
                code_dtype: CodeDType::TC,
                tc_rate: TcRate { step: step(mode)? },
                ..CodecOptions::default()
            },
        };
        let c = codec_with(mode, Some((&translator, index)), &opts)?;
        let label = match c.variant() {
            v if v.is_empty() => mode.to_string(),
            v => format!("{mode} {v}"),
        };
        codecs.push((label, c));
    }
    let oracle = median(&args, || {
        let mut cache = expert.new_cache();
        expert.forward(
            Input::new(prompt)
                .with_cache(&mut cache)
                .logits(LogitsWanted::Last),
        )?;
        Ok(())
    })?;
    let cfg = base.config();
    let raw_bytes = (args.tokens * cfg.kv_dim() * 2 * 2 * cfg.num_layers) as f64;
    println!(
        "{name}: a {}-token WikiText-2 prompt; prefill on {}; {} untimed + {} timed runs per figure, median; oracle prefill {:.1} ms",
        args.tokens,
        base.prefill_matmul(),
        args.warmup,
        args.reps,
        ms(oracle)
    );
    println!();
    println!("| mode | payload, % of raw | producer prefill ms | encode ms (% of prefill) | rebuild ms (% of oracle prefill) | entropy coding ms, MB/s raw / code | entropy decoding ms, MB/s raw / code |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (label, c) in &codecs {
        let capture = c.capture().context("a mode that sends nothing")?;
        let prefill = median(&args, || {
            base.forward(
                Input::new(prompt)
                    .capture(capture.clone())
                    .logits(LogitsWanted::None),
            )?;
            Ok(())
        })?;
        let captured = base
            .forward(
                Input::new(prompt)
                    .capture(capture.clone())
                    .logits(LogitsWanted::None),
            )?
            .captured;
        let codes = codec::encode(c.as_ref(), &captured)?;
        let bytes = codec::payload_bytes(&codes) as f64;
        let encode = median(&args, || {
            codec::encode(c.as_ref(), &captured)?;
            Ok(())
        })?;
        let rebuild = median(&args, || {
            codec::decode(c.as_ref(), &expert, &codes, Prefix::new(prompt))?;
            Ok(())
        })?;
        let coded: Vec<&LayerCode> = codes.iter().filter(|c| c.dtype == CodeDType::TC).collect();
        // Raw and q4 have no entropy coder.
        let (coding, decoding) = match coded.is_empty() {
            true => ("n/a".to_string(), "n/a".to_string()),
            false => {
                let (enc, dec) = coder_times(&args, &coded)?;
                let cell = |d: Duration| {
                    let rate = |b: f64| b / d.as_secs_f64() / 1e6;
                    format!(
                        "{:.1} ms, {:.0} / {:.0}",
                        ms(d),
                        rate(raw_bytes),
                        rate(bytes)
                    )
                };
                (cell(enc), cell(dec))
            }
        };
        println!(
            "| {label} | {:.1} | {:.1} | {:.1} ({:.1}%) | {:.1} ({:.1}%) | {coding} | {decoding} |",
            100.0 * bytes / raw_bytes,
            ms(prefill),
            ms(encode),
            100.0 * encode.as_secs_f64() / prefill.as_secs_f64(),
            ms(rebuild),
            100.0 * rebuild.as_secs_f64() / oracle.as_secs_f64(),
        );
    }
    Ok(())
}

/// The entropy coder alone on `codes`, one thread: (coding, decoding) medians. Each code is
/// decoded to its quantised values, which are coded again with the steps its header carries:
/// the same symbols, so the producer's work (a column's model may be its neighbour class,
/// the quantised values' spread being a little off the originals').
fn coder_times(args: &Args, codes: &[&LayerCode]) -> anyhow::Result<(Duration, Duration)> {
    let mut inputs = Vec::with_capacity(codes.len());
    for c in codes {
        let (rows, cols) = (c.shape[0] as usize, c.shape[1] as usize);
        let values = transform::decode(&c.bytes, rows, cols)?;
        let steps = transform::steps(&c.bytes, cols).context("a code shorter than its headers")?;
        inputs.push((values, rows, cols, steps));
    }
    let enc = median(args, || {
        for (values, rows, cols, steps) in &inputs {
            transform::encode(values, *rows, *cols, steps)?;
        }
        Ok(())
    })?;
    let dec = median(args, || {
        for c in codes {
            transform::decode(&c.bytes, c.shape[0] as usize, c.shape[1] as usize)?;
        }
        Ok(())
    })?;
    Ok((enc, dec))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(args: &Args, f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    super::bench::median_time(args.warmup, args.reps, f)
}
