//! `scd calibrate`: fit the SCD translator of a base model (the producer) and one or more of
//! its experts (the consumers) on calibration text the evaluation never reads, and write it
//! as a translator folder (`translator.safetensors` + `translator.json`).

use scd_models::KernelChoice;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use scd_models::corpus::{self, Corpus};
use scd_models::expert::expert_files;
use scd_models::tokenizer::Tokenizer;
use scd_models::translator::{
    calibrate,
    calibrate::{CalibrationText, ChatWrap},
    AlignerConfig, CalibrateEvent, CalibrationConfig, PatchChoice, Ranks, WeightsDtype,
};
use scd_models::{AdapterMode, Llama, LoraAdapter};

use crate::paths::DataDirs;
use crate::progress::Progress;

/// Arguments of `scd calibrate`.
#[derive(clap::Args)]
#[command(
    after_help = "Example:\n  scd calibrate --producer .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \\\n    --consumer-adapter experts/sotu --out experts/sotu/translator"
)]
pub struct Args {
    #[command(flatten)]
    pub models: PairArgs,
    /// Where to write the translator folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Calibration corpus: its train split is used (the evaluation reads only WikiText-2 and
    /// SQuAD).
    #[arg(long, default_value = "brown")]
    pub corpus: String,
    #[command(flatten)]
    pub dirs: DataDirs,
    /// Fitting prompts.
    #[arg(long, default_value_t = 200)]
    pub prefixes: usize,
    /// Tokens per fitting prompt.
    #[arg(long, default_value_t = 320)]
    pub prefix_tokens: usize,
    /// Share of the prompts (fitting and held-out) given as chat turns: the text as the
    /// user's message in the model's chat template, as served prompts are (0: plain text).
    #[arg(long, default_value_t = 0.25)]
    pub chat_share: f64,
    /// Held-out prompts for the Patch-layer and DroidSpeak choices.
    #[arg(long, default_value_t = 12)]
    pub heldout: usize,
    /// Highest ranks stored for K, V and H (0: the full width for K and V).
    #[arg(long, value_delimiter = ',', default_value = "0,0,256")]
    pub r_max: Vec<usize>,
    /// Default ranks of requests for K, V and H (0: r_max for K and V).
    #[arg(long, value_delimiter = ',', default_value = "0,0,128")]
    pub ranks: Vec<usize>,
    /// Do not centre the codes on the calibration means.
    #[arg(long)]
    pub no_centre: bool,
    /// Ridge strength of the encoders, relative to the producer's mean variance.
    #[arg(long, default_value_t = 1e-4)]
    pub ridge: f64,
    /// Patch layers: `auto` (greedy, to the curve's knee) or a number.
    #[arg(long, default_value = "auto")]
    pub patch_layers: String,
    /// Layers the automatic choice tries at most.
    #[arg(long, default_value_t = 8)]
    pub patch_max: usize,
    /// Greedy choices try every candidate alone, then only this many of the best at each
    /// later step (0: all of them at every step, several times slower).
    #[arg(long, default_value_t = 6)]
    pub shortlist: usize,
    /// Aligner MLP width.
    #[arg(long, default_value_t = 512)]
    pub aligner_hidden: usize,
    /// Aligner epochs at most.
    #[arg(long, default_value_t = 30)]
    pub aligner_epochs: usize,
    /// `H_in` rows per layer for aligner training.
    #[arg(long, default_value_t = 12_288)]
    pub aligner_rows: usize,
    /// DroidSpeak: layers per recomputed block, and blocks.
    #[arg(long, value_delimiter = ',', default_value = "2,3")]
    pub droidspeak: Vec<usize>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage type of the weights file: bf16 (half the bytes; BENCHMARKS.md measures what the
    /// rounding costs) or f32.
    #[arg(long, default_value = "bf16")]
    pub weights_dtype: WeightsDtype,
    /// A label for the version (the content hash identifies it).
    #[arg(long, default_value = "cal")]
    pub version: String,
}

/// The models of a translator: the producer, and each consumer as base plus adapter.
#[derive(clap::Args)]
pub struct PairArgs {
    /// The producer (base) model, GGUF file or Hugging Face directory.
    #[arg(long, env = "SCD_MODEL")]
    pub producer: PathBuf,
    /// The consumers' base weights (default: the producer's).
    #[arg(long)]
    pub consumer: Option<PathBuf>,
    /// An expert: its folder (adapter.safetensors inside) or an adapter file. Repeat it for a
    /// joint translator whose one code stream serves every expert given (in its order).
    #[arg(long = "consumer-adapter", required = true)]
    pub consumer_adapters: Vec<PathBuf>,
}

/// A translator's models loaded: the producer, the tokenizer, and every consumer by name.
pub type PairModels = (Llama, Tokenizer, Vec<(String, Llama)>);

impl PairArgs {
    /// Loads the models ([`PairModels`]).
    pub fn load(&self, kernels: KernelChoice) -> anyhow::Result<PairModels> {
        let (producer, tok) = super::generate::load(&self.producer, kernels)?;
        let consumer_base = match &self.consumer {
            Some(p) if p != &self.producer => super::generate::load(p, kernels)?.0,
            _ => producer.clone(),
        };
        let experts = self
            .consumer_adapters
            .iter()
            .map(|p| load_expert(&consumer_base, p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((producer, tok, experts))
    }
}

/// Loads `base` with the adapter at `path` (a folder holding adapter.safetensors, or the file),
/// named after the folder.
pub(crate) fn load_expert(base: &Llama, path: &Path) -> anyhow::Result<(String, Llama)> {
    let file = if path.is_dir() {
        expert_files(path).0
    } else {
        path.to_path_buf()
    };
    let name_of = if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(path)
    };
    let name = name_of
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let adapter = LoraAdapter::load(&file, base.config())
        .with_context(|| format!("loading the adapter {}", file.display()))?;
    let expert = base
        .with_adapter(&adapter, AdapterMode::Merge)
        .context("applying the adapter")?;
    Ok((name, expert))
}

fn triple(v: &[usize], what: &str) -> anyhow::Result<[usize; 3]> {
    <[usize; 3]>::try_from(v).map_err(|_| anyhow::anyhow!("--{what} takes three numbers: K,V,H"))
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let (producer, tok, experts) = args.models.load(kernels)?;
    let kv = producer.config().kv_dim();
    let [rk, rv, rh] = triple(&args.r_max, "r-max")?;
    let r_max = Ranks {
        k: if rk == 0 { kv } else { rk },
        v: if rv == 0 { kv } else { rv },
        h: rh,
    };
    let [dk, dv, dh] = triple(&args.ranks, "ranks")?;
    let default_ranks = Ranks {
        k: if dk == 0 { r_max.k } else { dk },
        v: if dv == 0 { r_max.v } else { dv },
        h: dh,
    };
    let patch = match args.patch_layers.as_str() {
        "auto" => PatchChoice::Auto {
            max: args.patch_max,
            min_share: 0.05,
        },
        n => PatchChoice::Fixed(
            n.parse()
                .with_context(|| format!("--patch-layers {n:?}: expected auto or a number"))?,
        ),
    };
    let [ds_block, ds_blocks] = <[usize; 2]>::try_from(args.droidspeak.as_slice())
        .map_err(|_| anyhow::anyhow!("--droidspeak takes two numbers: block length, blocks"))?;
    let defaults = CalibrationConfig::for_model(kv);
    let cfg = CalibrationConfig {
        prefixes: args.prefixes,
        heldout: args.heldout,
        prefix_tokens: args.prefix_tokens,
        seed: args.seed,
        centre: !args.no_centre,
        ridge: args.ridge,
        r_max,
        default_ranks,
        aligner: AlignerConfig {
            hidden: args.aligner_hidden,
            epochs: args.aligner_epochs,
            seed: args.seed,
            ..AlignerConfig::default()
        },
        aligner_rows: args.aligner_rows,
        patch,
        shortlist: (args.shortlist > 0).then_some(args.shortlist),
        droidspeak_block: ds_block,
        droidspeak_blocks: ds_blocks,
        version: args.version.clone(),
        chat: (args.chat_share > 0.0)
            .then(|| ChatWrap::for_tokenizer(&tok, args.chat_share))
            .transpose()
            .context("--chat-share")?,
        ..defaults
    };
    if args.out.join("translator.json").exists() {
        bail!(
            "{} already holds a translator: choose another --out or remove it",
            args.out.display()
        );
    }
    let corpus = Corpus::open(&args.corpus, &args.dirs.data_dir)
        .with_context(|| format!("opening the calibration corpus {}", args.corpus))?;
    eprintln!("tokenising the {} train split", corpus.name);
    let tokens = corpus::tokenize_long(&tok, &corpus.train).context("tokenising")?;
    let split = format!(
        "train split ({}); {} fitting prompts spread over the split, held-out prompts from its last tenth; {:.0}% of each as chat turns",
        corpus.split_rule, cfg.prefixes, 100.0 * args.chat_share
    );
    let text = CalibrationText {
        corpus: &corpus.name,
        split: &split,
        sha256: &corpus.train_sha256,
        tokens: &tokens,
    };
    let consumers: Vec<(&str, &Llama)> = experts.iter().map(|(n, m)| (n.as_str(), m)).collect();
    let bar = Progress::new(0, "items")?;
    let mut translator = calibrate(&producer, &consumers, &text, &cfg, |e| match e {
        CalibrateEvent::Phase(p) => {
            bar.restart(0);
            bar.line(p);
        }
        CalibrateEvent::Progress { done, total } => bar.set(*done as u64, *total as u64),
        CalibrateEvent::Note(n) => bar.line(n),
    })
    .context("calibrating")?;
    bar.finish();
    translator.manifest.weights_dtype = args.weights_dtype;
    let hash = translator
        .save(&args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let m = &translator.manifest;
    eprintln!(
        "translator {} ({}) for {} -> [{}] in {:.0} s: patch layers {:?}, droidspeak blocks {:?}; written to {}",
        m.version,
        hash.short(),
        m.producer.file,
        m.consumers.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
        t0.elapsed().as_secs_f64(),
        m.patch_layers,
        m.droidspeak_blocks,
        args.out.display()
    );
    Ok(())
}
