//! Shared by the model test binaries: the real model (loaded once per binary), real text, and a
//! tiny random llama written as a Hugging Face directory.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use scd_models::tokenizer::Tokenizer;
use scd_models::{
    AdapterMode, GgufFile, HfLlamaConfig, Llama, LlamaConfig, LoraAdapter, Proj, RopeVariant,
};

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A folder from the environment, or a default inside the repository (tests, unlike the
/// library, may know where the repository is).
fn dir_from_env(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(default)
    })
}

/// `$SCD_MODEL_DIR` or `<repo>/.cache/models`.
pub fn model_dir() -> PathBuf {
    dir_from_env("SCD_MODEL_DIR", ".cache/models")
}

/// `$SCD_DATA_DIR` or `<repo>/.cache/data`.
pub fn data_dir() -> PathBuf {
    dir_from_env("SCD_DATA_DIR", ".cache/data")
}

/// `$SCD_EVAL_DATA` or `<repo>/data` (the evaluation sets the repository ships).
pub fn eval_data_dir() -> PathBuf {
    dir_from_env("SCD_EVAL_DATA", "data")
}

/// Path of the real GGUF; panics with the fix when it is missing.
pub fn model_path() -> PathBuf {
    let path = model_dir().join(MODEL_FILE);
    assert!(
        path.exists(),
        "{} is missing: run `make model` (or set SCD_MODEL_DIR to the folder holding {MODEL_FILE})",
        path.display()
    );
    path
}

/// The real model and its tokenizer, loaded once per test binary.
pub fn real() -> &'static (Llama, Tokenizer) {
    static REAL: OnceLock<(Llama, Tokenizer)> = OnceLock::new();
    REAL.get_or_init(|| {
        let file = GgufFile::open(model_path()).unwrap();
        let tok = Tokenizer::from_gguf(file.content()).unwrap();
        (file.load_model().unwrap(), tok)
    })
}

/// The first `n` tokens of WikiText-2 validation text (real prose, not the heading lines).
pub fn wikitext_tokens(tok: &Tokenizer, n: usize) -> Vec<u32> {
    let path = eval_data_dir().join(scd_models::corpus::WIKITEXT2_VALID);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let prose: String = text
        .lines()
        .filter(|l| l.len() > 200)
        .take(20)
        .collect::<Vec<_>>()
        .join("\n");
    let ids = tok.encode(&prose, false).unwrap();
    assert!(ids.len() >= n, "not enough text for {n} tokens");
    ids[..n].to_vec()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

pub fn max_abs(a: &Tensor) -> f32 {
    a.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A tiny llama config: 2 layers, GQA 4/2 heads of 8, vocab 64, context 32.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        num_layers: 2,
        hidden_size: 32,
        intermediate_size: 48,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        vocab_size: 64,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        context_length: 32,
        tie_embeddings: true,
        rope_variant: RopeVariant::HalfSplit,
    }
}

fn random(rng: &mut rand::rngs::StdRng, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Writes a random llama with `cfg` as a Hugging Face directory in `dir`.
pub fn write_tiny_hf(dir: &Path, cfg: &LlamaConfig, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        random(&mut rng, &[cfg.vocab_size, h], 1.0),
    );
    t.insert(
        "model.norm.weight".into(),
        random(&mut rng, &[h], 1.0).abs().unwrap(),
    );
    let lin = 1.0 / (h as f32).sqrt();
    for i in 0..cfg.num_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        t.insert(
            p("input_layernorm"),
            random(&mut rng, &[h], 1.0).abs().unwrap(),
        );
        t.insert(
            p("post_attention_layernorm"),
            random(&mut rng, &[h], 1.0).abs().unwrap(),
        );
        t.insert(
            p("self_attn.q_proj"),
            random(&mut rng, &[cfg.q_dim(), h], lin),
        );
        t.insert(
            p("self_attn.k_proj"),
            random(&mut rng, &[cfg.kv_dim(), h], lin),
        );
        t.insert(
            p("self_attn.v_proj"),
            random(&mut rng, &[cfg.kv_dim(), h], lin),
        );
        t.insert(
            p("self_attn.o_proj"),
            random(&mut rng, &[h, cfg.q_dim()], lin),
        );
        t.insert(p("mlp.gate_proj"), random(&mut rng, &[f, h], lin));
        t.insert(p("mlp.up_proj"), random(&mut rng, &[f, h], lin));
        t.insert(
            p("mlp.down_proj"),
            random(&mut rng, &[h, f], 1.0 / (f as f32).sqrt()),
        );
    }
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    let json = serde_json::to_vec_pretty(&HfLlamaConfig::from_config(cfg)).unwrap();
    std::fs::write(dir.join("config.json"), json).unwrap();
}

/// A tiny random model loaded through the Hugging Face loader.
pub fn tiny_model(seed: u64) -> (tempfile::TempDir, Llama) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_hf(dir.path(), &tiny_config(), seed);
    // The tiny model's tests compare logits of a few tokens across paths (merged and on the fly,
    // gradients and kernels) to float precision: decode and prefill on the f32 weights. The
    // narrow decode weights and the AMX prefill have their own tests (the kernels', and the real
    // model's against f32).
    let model = Llama::from_hf_dir(dir.path())
        .unwrap()
        .with_decode_weights(scd_models::DecodeWeights::F32)
        .unwrap()
        .with_prefill_matmul(scd_models::PrefillMatmul::F32)
        .unwrap();
    (dir, model)
}

/// Logits of `tokens` at every position, as host rows.
pub fn all_logits(model: &Llama, tokens: &[u32]) -> Tensor {
    model
        .forward(scd_models::Input::new(tokens).logits(scd_models::LogitsWanted::All))
        .unwrap()
        .logits
        .unwrap()
}

/// `model` with an on-the-fly adapter of `Var`s whose `B` is zero on every projection: it
/// computes the same function as `model`, but its activations carry gradients, so its forward
/// pass takes the differentiable ops instead of the inference kernels.
pub fn with_zero_var_adapter(model: &Llama) -> Llama {
    let cfg = model.config();
    let mut parts = std::collections::BTreeMap::new();
    for layer in 0..cfg.num_layers {
        for proj in Proj::ALL {
            let (out, inp) = proj.shape(cfg);
            let a = candle_core::Var::randn(0f32, 0.1, (1, inp), &Device::Cpu).unwrap();
            let b =
                candle_core::Var::zeros((out, 1), candle_core::DType::F32, &Device::Cpu).unwrap();
            parts.insert(
                (layer, proj),
                (a.as_tensor().clone(), b.as_tensor().clone()),
            );
        }
    }
    let adapter = LoraAdapter::from_parts(cfg, 1, 1.0, parts).unwrap();
    model.with_adapter(&adapter, AdapterMode::OnTheFly).unwrap()
}
