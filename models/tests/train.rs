//! Fine-tuning on the real SmolLM2 base with tiny windows: the loss falls, runs are
//! deterministic, a resumed run equals an uninterrupted one, the stop flag checkpoints and
//! returns, and the manifest describes the run.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::DType;
use common::{max_abs_diff, real as base};
use scd_models::corpus::{self, Corpus};
use scd_models::expert::{save_adapter, Manifest};
use scd_models::perplexity::score_windows;
use scd_models::train::{
    self, finetune, FinetuneOptions, FinetuneOutcome, LoopEnd, Schedule, TrainConfig, TrainData,
    TrainEvent, Trainer,
};
use scd_models::{AdapterMode, Llama, LoraAdapter, Proj};

fn mean_loss(model: &Llama, windows: &[Vec<u32>]) -> f64 {
    score_windows(model, windows).unwrap().unwrap().mean_nll
}

const TEXT: &str = "Call me Ishmael. Some years ago, never mind how long precisely, having little \
or no money in my purse, and nothing particular to interest me on shore, I thought I would sail \
about a little and see the watery part of the world. It is a way I have of driving off the spleen \
and regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it \
is a damp, drizzly November in my soul; then, I account it high time to get to sea as soon as I can.";

fn tiny_cfg() -> TrainConfig {
    TrainConfig {
        rank: 4,
        alpha: 8.0,
        lr: 5e-3,
        warmup: 1,
        schedule: Schedule::Constant,
        steps: 4,
        seq_len: 16,
        batch: 2,
        seed: 7,
        weight_decay: 0.01,
        clip_norm: Some(1.0),
        valid_windows: 2,
        targets: Proj::ALL.to_vec(),
        layers: None,
        rope_theta: None,
        boundary: None,
    }
}

fn tiny_data() -> TrainData {
    let (_, tok) = base();
    let train = tok.encode(TEXT, false).unwrap();
    let valid = corpus::even_windows(&train, 17, 4, "valid").unwrap();
    TrainData { train, valid }
}

fn flat(trainer: &Trainer) -> Vec<f32> {
    let (model, _) = base();
    let a = trainer.adapter(model, DType::F32).unwrap();
    let mut out = Vec::new();
    for (layer, proj) in [(0, Proj::Q), (13, Proj::Up), (29, Proj::Down)] {
        let (a, b) = a.get(layer, proj).unwrap();
        out.extend(a.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        out.extend(b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    out
}

#[test]
fn training_lowers_the_loss_on_what_it_sees() {
    let (model, _) = base();
    let data = tiny_data();
    let before = mean_loss(model, &data.valid);
    let mut t = Trainer::new(
        model,
        TrainConfig {
            steps: 6,
            ..tiny_cfg()
        },
    )
    .unwrap();
    for _ in 0..6 {
        let r = t.train_step(&data).unwrap();
        assert!(r.loss.is_finite() && r.grad_norm > 0.0);
    }
    let after = mean_loss(t.model(), &data.valid);
    // The training forward (differentiable ops, frozen-weight matmuls) computes what the
    // inference kernels compute for the same adapter without gradients.
    let w = &data.valid[0];
    let ours = t.train_logits(w).unwrap();
    assert!(ours.track_op());
    // On the f32 kernels: training multiplies in f32, the AMX tiles in bf16.
    let plain = model
        .with_adapter(
            &t.adapter(model, DType::F32).unwrap(),
            AdapterMode::OnTheFly,
        )
        .unwrap()
        .with_prefill_matmul(scd_models::PrefillMatmul::F32)
        .unwrap();
    let theirs = common::all_logits(&plain, w);
    assert!(!theirs.track_op());
    let diff = max_abs_diff(&ours, &theirs);
    assert!(diff < 1e-3, "training forward differs by {diff}");
    assert!(
        after < before - 0.1,
        "loss {before:.3} -> {after:.3} after 6 steps"
    );
    // The base itself is untouched: only the adapter's Vars were optimised.
    assert_eq!(mean_loss(model, &data.valid), before);
}

#[test]
fn resumed_run_equals_uninterrupted_run_and_seeds_matter() {
    let (model, _) = base();
    let data = tiny_data();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg();

    let mut straight = Trainer::new(model, cfg.clone()).unwrap();
    for _ in 0..4 {
        straight.train_step(&data).unwrap();
    }

    let mut first = Trainer::new(model, cfg.clone()).unwrap();
    first.train_step(&data).unwrap();
    first.train_step(&data).unwrap();
    first.save_checkpoint(dir.path()).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(model, &cfg, dir.path()).unwrap().unwrap();
    assert_eq!(resumed.step(), 2);
    resumed.train_step(&data).unwrap();
    resumed.train_step(&data).unwrap();

    assert_eq!(straight.losses(), resumed.losses());
    let (a, b) = (flat(&straight), flat(&resumed));
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(max_diff <= 1e-7, "resumed adapter differs by {max_diff}");

    let mut other = Trainer::new(
        model,
        TrainConfig {
            seed: 8,
            ..cfg.clone()
        },
    )
    .unwrap();
    other.train_step(&data).unwrap();
    assert_ne!(other.losses()[0], straight.losses()[0]);

    // Different hyperparameters cannot resume this run.
    let err = Trainer::resume(model, &TrainConfig { rank: 8, ..cfg }, dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("different hyperparameters"),
        "{err}"
    );
}

/// A run with its own RoPE base trains the expert at that base (the first step's loss is the
/// base model's under the new rotation), ships it in the adapter, and resumes only as such.
#[test]
fn a_run_with_its_own_rope_base_trains_and_ships_the_expert_at_it() {
    let (model, _) = base();
    let data = tiny_data();
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        rope_theta: Some(1e6),
        ..tiny_cfg()
    };
    let mut t = Trainer::new(model, cfg.clone()).unwrap();
    let mut plain = Trainer::new(model, tiny_cfg()).unwrap();
    assert_ne!(t.model().rope(), model.rope());
    assert_eq!(plain.model().rope(), model.rope());
    t.train_step(&data).unwrap();
    plain.train_step(&data).unwrap();
    assert_ne!(t.losses()[0], plain.losses()[0]);
    t.save_checkpoint(dir.path()).unwrap();
    assert_eq!(
        t.adapter(model, DType::F32).unwrap().rope_theta(),
        Some(1e6)
    );
    let resumed = Trainer::resume(model, &cfg, dir.path()).unwrap().unwrap();
    assert_eq!(resumed.model().rope(), t.model().rope());
    let err = Trainer::resume(model, &tiny_cfg(), dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("different hyperparameters"),
        "{err}"
    );
    let bad = TrainConfig {
        rope_theta: Some(-1.0),
        ..tiny_cfg()
    };
    assert!(Trainer::new(model, bad).is_err());
}

#[test]
fn an_attention_only_run_adapts_those_projections_and_resumes_as_one() {
    let (model, _) = base();
    let data = tiny_data();
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        targets: Proj::parse_list("attention").unwrap(),
        ..tiny_cfg()
    };
    let mut t = Trainer::new(model, cfg.clone()).unwrap();
    t.train_step(&data).unwrap();
    t.save_checkpoint(dir.path()).unwrap();
    let adapter = t.adapter(model, DType::F32).unwrap();
    let layers = model.config().num_layers;
    let mut got: Vec<_> = adapter.targets().collect();
    got.sort();
    let want: Vec<_> = (0..layers)
        .flat_map(|l| Proj::ATTENTION.map(|p| (l, p)))
        .collect();
    assert_eq!(got, want);

    let resumed = Trainer::resume(model, &cfg, dir.path()).unwrap().unwrap();
    assert_eq!(resumed.step(), 1);
    let again = resumed.adapter(model, DType::F32).unwrap();
    let (a0, b0) = adapter.get(5, Proj::V).unwrap();
    let (a1, b1) = again.get(5, Proj::V).unwrap();
    assert_eq!(max_abs_diff(a0, a1), 0.0);
    assert_eq!(max_abs_diff(b0, b1), 0.0);
    assert!(again.get(5, Proj::Up).is_none());
    // An all-projection run cannot resume it.
    let all = TrainConfig {
        targets: Proj::ALL.to_vec(),
        ..cfg
    };
    let err = Trainer::resume(model, &all, dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("different hyperparameters"),
        "{err}"
    );
    assert_eq!(Proj::parse_list("v,k,k"), Some(vec![Proj::K, Proj::V]));
    // A run on the first layer only adapts that layer, and resumes as such.
    let first = TrainConfig {
        layers: Some(vec![0]),
        ..tiny_cfg()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(model, first.clone()).unwrap();
    t.train_step(&data).unwrap();
    t.save_checkpoint(dir.path()).unwrap();
    let only: Vec<_> = t.adapter(model, DType::F32).unwrap().targets().collect();
    assert!(
        !only.is_empty() && only.iter().all(|&(l, _)| l == 0),
        "{only:?}"
    );
    let back = Trainer::resume(model, &first, dir.path()).unwrap().unwrap();
    assert_eq!(
        back.adapter(model, DType::F32).unwrap().targets().count(),
        only.len()
    );
    assert_eq!(Proj::parse_list("k,mlp"), None);

    // PEFT's config beside a saved adapter names what it adapts: the attention run's four
    // projections on every layer, the first-layer run's seven on layer 0 only.
    let peft = |adapter: &LoraAdapter| {
        let dir = tempfile::tempdir().unwrap();
        save_adapter(adapter, model, dir.path(), DType::F32).unwrap();
        let text = std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let cfg = peft(&adapter);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj"])
    );
    assert!(cfg.get("layers_to_transform").is_none(), "{cfg}");
    let cfg = peft(&t.adapter(model, DType::F32).unwrap());
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 7, "{cfg}");
    assert_eq!(cfg["layers_to_transform"], serde_json::json!([0]));
}

#[test]
fn stop_flag_checkpoints_the_last_step_and_returns() {
    let (model, _) = base();
    let data = tiny_data();
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        steps: 10,
        ..tiny_cfg()
    };
    let mut t = Trainer::new(model, cfg.clone()).unwrap();
    let stop = AtomicBool::new(false);
    let mut steps_seen = 0;
    // The flag is raised while step 2 runs (as the Ctrl-C handler would).
    let end = train::run(&mut t, &data, dir.path(), 0, &stop, |e| {
        if let TrainEvent::Step(r) = e {
            steps_seen = r.step;
            if r.step == 2 {
                stop.store(true, Ordering::SeqCst);
            }
        }
    })
    .unwrap();
    assert_eq!(steps_seen, 2);
    match end {
        LoopEnd::Stopped { step, checkpoint } => {
            assert_eq!(step, 2);
            assert!(checkpoint.join("state.safetensors").exists());
        }
        other => panic!("expected a stop, got {other:?}"),
    }
    let latest = std::fs::read_to_string(dir.path().join("latest.json")).unwrap();
    assert!(latest.contains("step-000002"), "{latest}");
    let resumed = Trainer::resume(model, &cfg, dir.path()).unwrap().unwrap();
    assert_eq!(resumed.step(), 2);
    assert_eq!(resumed.losses(), t.losses());
}

#[test]
fn finetune_writes_adapter_and_manifest() {
    let (model, tok) = base();
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{TEXT}\n\n{TEXT}");
    let c = Corpus::from_texts(
        "tiny",
        "train.txt".into(),
        "valid.txt".into(),
        "test: the same text twice",
        text.clone(),
        text,
    );
    let cfg = TrainConfig {
        steps: 2,
        ..tiny_cfg()
    };
    let opts = FinetuneOptions {
        out_dir: dir.path().to_path_buf(),
        checkpoint_every: 1,
        resume: false,
        dtype: DType::BF16,
    };
    let stop = AtomicBool::new(false);
    let mut notes = 0;
    let out = finetune(model, tok, &c, &cfg, &opts, &stop, |e| {
        if matches!(e, TrainEvent::Note(_)) {
            notes += 1;
        }
    })
    .unwrap();
    assert!(notes >= 2);
    let FinetuneOutcome::Finished(m) = out else {
        panic!("not finished")
    };
    let on_disk = Manifest::load(&dir.path().join("manifest.json")).unwrap();
    // serde_json reads floats back to within an ulp or so: compare exact fields exactly.
    assert_eq!(on_disk.corpus, m.corpus);
    assert_eq!(on_disk.adapter, m.adapter);
    assert_eq!(on_disk.hyperparameters, m.hyperparameters);
    assert_eq!(on_disk.steps, m.steps);
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    assert!(
        rel(
            on_disk.validation.expert_perplexity,
            m.validation.expert_perplexity
        ) < 1e-12
    );
    assert_eq!(m.steps, 2);
    assert_eq!(m.hyperparameters, cfg);
    assert_eq!(m.base_model.sha256, model.identity().sha256);
    assert_eq!(m.base_model.sha256.len(), 64);
    assert_eq!(m.corpus.train_sha256, c.train_sha256);
    assert_eq!(m.corpus.split_rule, "test: the same text twice");
    assert_eq!(m.targets.len(), 7);
    assert_eq!(m.adapter.dtype, "bf16");
    assert!(m.final_train_loss.is_finite());
    assert!(m.validation.base_perplexity > 1.0 && m.validation.expert_perplexity > 1.0);
    let bytes = std::fs::read(dir.path().join("adapter.safetensors")).unwrap();
    assert_eq!(m.adapter.bytes, bytes.len() as u64);
    assert_eq!(m.adapter.sha256, corpus::sha256_hex(&bytes));
    // rank 4 on 7 projections of 30 layers, 2 bytes per value, plus the header.
    let values = 4 * (576 + 576 + 2 * (576 + 192) + 576 + 576 + 3 * (576 + 1536)) * 30;
    assert!(bytes.len() > 2 * values && bytes.len() < 2 * values + 100_000);
    assert!(dir.path().join("adapter_config.json").exists());

    // A second run into the same folder without --resume refuses to clobber it.
    let again = finetune(model, tok, &c, &cfg, &opts, &stop, |_| {});
    assert!(again.is_err());
}

/// Seconds per optimisation step at the shipped experts' shape (seq 256 x batch 4); a benchmark,
/// not a test: `cargo test -p scd-models --test train -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_step_seq256_batch4() {
    let (model, tok) = base();
    let c = Corpus::open("moby-dick", &common::data_dir()).unwrap();
    let train = corpus::tokenize_long(tok, &c.train[..200_000]).unwrap();
    let data = TrainData {
        train,
        valid: Vec::new(),
    };
    let mut t = Trainer::new(
        model,
        TrainConfig {
            steps: 3,
            ..TrainConfig::default()
        },
    )
    .unwrap();
    for _ in 0..3 {
        let r = t.train_step(&data).unwrap();
        eprintln!(
            "step {}: {:.2} s, {:.0} tok/s, loss {:.3}",
            r.step, r.seconds, r.tokens_per_s, r.loss
        );
    }
}

#[test]
#[ignore]
fn bench_phases() {
    use scd_models::{Input, LogitsWanted};
    use std::time::Instant;
    let (model, _) = base();
    let t = Trainer::new(model, TrainConfig::default()).unwrap();
    let toks: Vec<u32> = (0..257).map(|i| 1000 + i as u32 * 7).collect();
    let t0 = Instant::now();
    let out = t
        .model()
        .forward(Input::new(&toks[..256]).logits(LogitsWanted::All))
        .unwrap();
    eprintln!("forward (tracked): {:?}", t0.elapsed());
    drop(out);
    let t0 = Instant::now();
    let logits = t.train_logits(&toks[..256]).unwrap();
    let fwd = t0.elapsed();
    let targets = candle_core::Tensor::new(&toks[1..], &candle_core::Device::Cpu).unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits, &targets).unwrap();
    let t2 = Instant::now();
    let _g = loss.backward().unwrap();
    eprintln!("frozen: forward {fwd:?}, backward {:?}", t2.elapsed());
}
