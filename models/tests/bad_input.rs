//! Bad inputs give typed errors with clear messages: missing, truncated and non-GGUF files,
//! another architecture, missing metadata; and a tiny llama GGUF written here loads with the
//! hyperparameters of its own metadata.

mod common;

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{all_logits, max_abs_diff, tiny_config, tiny_model};
use scd_models::hf::to_interleaved_rows;
use scd_models::{Llama, LlamaConfig, LoadError};

fn write_gguf(path: &Path, metadata: &[(&str, gguf_file::Value)], tensors: &[(String, Tensor)]) {
    let q: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap()))
        .collect();
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tq: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &tq).unwrap();
}

fn llama_metadata(cfg: &LlamaConfig) -> Vec<(&'static str, gguf_file::Value)> {
    use gguf_file::Value as V;
    vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", V::U32(cfg.num_layers as u32)),
        ("llama.embedding_length", V::U32(cfg.hidden_size as u32)),
        (
            "llama.feed_forward_length",
            V::U32(cfg.intermediate_size as u32),
        ),
        ("llama.attention.head_count", V::U32(cfg.num_heads as u32)),
        (
            "llama.attention.head_count_kv",
            V::U32(cfg.num_kv_heads as u32),
        ),
        ("llama.rope.freq_base", V::F32(cfg.rope_theta as f32)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::F32(cfg.rms_norm_eps as f32),
        ),
        ("llama.context_length", V::U32(cfg.context_length as u32)),
    ]
}

/// The tiny random model's weights under GGUF names, q/k rows in the interleaved layout.
fn tiny_gguf_tensors(dir: &Path, cfg: &LlamaConfig) -> Vec<(String, Tensor)> {
    let hf = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut out = vec![
        (
            "token_embd.weight".to_string(),
            hf["model.embed_tokens.weight"].clone(),
        ),
        (
            "output_norm.weight".to_string(),
            hf["model.norm.weight"].clone(),
        ),
    ];
    for i in 0..cfg.num_layers {
        let g = |n: &str| hf[&format!("model.layers.{i}.{n}.weight")].clone();
        let names = [
            ("attn_norm", g("input_layernorm")),
            ("ffn_norm", g("post_attention_layernorm")),
            (
                "attn_q",
                to_interleaved_rows(&g("self_attn.q_proj"), cfg.num_heads).unwrap(),
            ),
            (
                "attn_k",
                to_interleaved_rows(&g("self_attn.k_proj"), cfg.num_kv_heads).unwrap(),
            ),
            ("attn_v", g("self_attn.v_proj")),
            ("attn_output", g("self_attn.o_proj")),
            ("ffn_gate", g("mlp.gate_proj")),
            ("ffn_up", g("mlp.up_proj")),
            ("ffn_down", g("mlp.down_proj")),
        ];
        for (n, t) in names {
            out.push((format!("blk.{i}.{n}.weight"), t));
        }
    }
    out
}

#[test]
fn tiny_llama_gguf_loads_with_its_own_hyperparameters() {
    let (dir, hf_model) = tiny_model(6);
    let cfg = tiny_config();
    let path = dir.path().join("tiny.gguf");
    write_gguf(
        &path,
        &llama_metadata(&cfg),
        &tiny_gguf_tensors(dir.path(), &cfg),
    );
    // Compared with the tiny Hugging Face model, which decodes on f32 (common::tiny_model).
    let model = Llama::from_gguf(&path)
        .unwrap()
        .with_decode_weights(scd_models::DecodeWeights::F32)
        .unwrap();
    let got = model.config();
    assert_eq!(
        (got.num_layers, got.hidden_size, got.intermediate_size),
        (2, 32, 48)
    );
    assert_eq!(
        (
            got.num_heads,
            got.num_kv_heads,
            got.head_dim,
            got.vocab_size
        ),
        (4, 2, 8, 64)
    );
    assert_eq!((got.context_length, got.rope_theta), (32, 10_000.0));
    assert!(got.tie_embeddings);
    let tokens = [1u32, 5, 9, 33, 2, 7];
    assert!(
        max_abs_diff(
            &all_logits(&model, &tokens),
            &all_logits(&hf_model, &tokens)
        ) < 1e-5
    );
}

#[test]
fn missing_file_is_not_found() {
    let err = Llama::from_gguf("/nonexistent/model.gguf").unwrap_err();
    assert!(matches!(err, LoadError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
    let err = Llama::from_hf_dir("/nonexistent/dir").unwrap_err();
    assert!(matches!(err, LoadError::NotFound { .. }), "{err}");
}

#[test]
fn non_gguf_file_is_rejected_by_its_magic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, b"{\"this is\": \"json\"}").unwrap();
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(matches!(err, LoadError::NotGguf { .. }), "{err}");
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
    std::fs::write(&path, b"GG").unwrap();
    assert!(matches!(
        Llama::from_gguf(&path).unwrap_err(),
        LoadError::NotGguf { .. }
    ));
}

#[test]
fn truncated_files_are_reported_as_truncated() {
    let real = std::fs::read(common::model_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    // Cut inside the tensor data: the header parses, the data does not fit.
    std::fs::write(&path, &real[..real.len() / 2]).unwrap();
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(matches!(err, LoadError::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("truncated"), "{err}");
    // Cut inside the header.
    std::fs::write(&path, &real[..4096]).unwrap();
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(matches!(err, LoadError::BadHeader { .. }), "{err}");
    assert!(err.to_string().contains("truncated or corrupt"), "{err}");
}

#[test]
fn other_architecture_is_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.gguf");
    let w = Tensor::zeros((4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    write_gguf(
        &path,
        &[(
            "general.architecture",
            gguf_file::Value::String("gpt2".into()),
        )],
        &[("token_embd.weight".into(), w)],
    );
    let err = Llama::from_gguf(&path).unwrap_err();
    match &err {
        LoadError::UnsupportedArchitecture { found, .. } => assert_eq!(found, "gpt2"),
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("only \"llama\""), "{err}");

    // The same for a Hugging Face directory of another family.
    let hf = tempfile::tempdir().unwrap();
    common::write_tiny_hf(hf.path(), &tiny_config(), 1);
    let cfg_path = hf.path().join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        text.replace("\"llama\"", "\"gpt_neox\"")
            .replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
    )
    .unwrap();
    let err = Llama::from_hf_dir(hf.path()).unwrap_err();
    assert!(
        matches!(err, LoadError::UnsupportedArchitecture { .. }),
        "{err}"
    );
}

#[test]
fn missing_metadata_and_tensors_are_named() {
    let (dir, _) = tiny_model(6);
    let cfg = tiny_config();
    let path = dir.path().join("nometa.gguf");
    let md: Vec<_> = llama_metadata(&cfg)
        .into_iter()
        .filter(|(k, _)| *k != "llama.feed_forward_length")
        .collect();
    write_gguf(&path, &md, &tiny_gguf_tensors(dir.path(), &cfg));
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::Metadata { key, .. } if key == "llama.feed_forward_length"),
        "{err}"
    );
    let path = dir.path().join("notensor.gguf");
    let tensors: Vec<_> = tiny_gguf_tensors(dir.path(), &cfg)
        .into_iter()
        .filter(|(n, _)| n != "blk.1.ffn_up.weight")
        .collect();
    write_gguf(&path, &llama_metadata(&cfg), &tensors);
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::MissingTensor { name, .. } if name == "blk.1.ffn_up.weight"),
        "{err}"
    );
    // A weight whose shape contradicts the metadata.
    let mut wrong = cfg.clone();
    wrong.intermediate_size = 40;
    let path = dir.path().join("shape.gguf");
    write_gguf(
        &path,
        &llama_metadata(&wrong),
        &tiny_gguf_tensors(dir.path(), &cfg),
    );
    let err = Llama::from_gguf(&path).unwrap_err();
    assert!(matches!(err, LoadError::TensorShape { .. }), "{err}");
}
