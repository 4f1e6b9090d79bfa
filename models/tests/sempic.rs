//! The SemPIC writer's training (`docs/method.md` §5.2): gradients reach the writer through the
//! stitched caches only, KV gradient checkpointing per writer layer gives the gradients of one
//! graph, training lowers the KL to full recompute, and `train_writer` runs end to end on the real
//! model, writing an adapter the evaluation loads, and resumes. The same for KV-Packet's boundary
//! tokens (`docs/method.md` §5.3), trained for the base and for a writer (the joint mode).

mod common;

use std::sync::atomic::AtomicBool;

use candle_core::{DType, Tensor};
use common::{real, tiny_model};
use scd_models::eval::data::FileInfo;
use scd_models::eval::EvalData;
use scd_models::train::sempic::{example_kl, training_reader, WriterExample, WriterObjective};
use scd_models::train::writer::{train_writer, WriterManifest, WriterOptions, WriterOutcome};
use scd_models::train::{Schedule, TrainConfig, TrainError, Trainer};
use scd_models::{AdapterMode, LoraAdapter, Proj};

fn cfg(steps: usize) -> TrainConfig {
    TrainConfig {
        rank: 4,
        alpha: 8.0,
        lr: 2e-2,
        warmup: 1,
        schedule: Schedule::Constant,
        steps,
        seq_len: 2,
        batch: 1,
        seed: 3,
        weight_decay: 0.0,
        clip_norm: None,
        valid_windows: 0,
        targets: Proj::ALL.to_vec(),
        layers: None,
        rope_theta: None,
        boundary: None,
    }
}

/// Head, two documents and a tail that fit the tiny model's 32 positions.
fn tiny_example(shift: u32) -> WriterExample {
    let t = |a: u32, n: u32| (a..a + n).map(|i| (i * 7 + shift) % 64).collect::<Vec<_>>();
    WriterExample {
        head: t(1, 3),
        documents: vec![t(10, 7), t(30, 6)],
        tail: t(50, 6),
    }
}

fn grads_of(
    trainer: &Trainer,
    objective: &WriterObjective,
    ex: &WriterExample,
) -> Vec<Option<Tensor>> {
    let mut grads = vec![None; trainer.params().len()];
    objective
        .example_gradients(trainer, ex, 1.0, &mut grads)
        .unwrap();
    grads
}

#[test]
fn checkpointing_per_writer_layer_gives_the_gradients_of_one_graph() {
    let (_dir, base) = tiny_model(11);
    let ex = tiny_example(0);
    let plain = WriterObjective::new(&base, vec![ex.clone()], false).unwrap();
    let ckpt = WriterObjective::new(&base, vec![ex.clone()], true).unwrap();
    let mut trainer = Trainer::new(plain.reader(), cfg(1)).unwrap();
    // After one step B is no longer zero, so every A has a gradient too.
    trainer.train_step(&plain).unwrap();
    let a = grads_of(&trainer, &plain, &ex);
    let b = grads_of(&trainer, &ckpt, &ex);
    assert_eq!(a.len(), trainer.params().len());
    let (mut largest, mut reached) = (0f32, 0);
    for (i, pair) in a.iter().zip(&b).enumerate() {
        match pair {
            (Some(x), Some(y)) => {
                let scale = common::max_abs(x).max(1e-12);
                largest = largest.max(scale);
                reached += 1;
                let diff = common::max_abs_diff(x, y);
                assert!(
                    diff <= 1e-4 * scale + 1e-7,
                    "parameter {i}: {diff} of {scale}"
                );
            }
            // The last layer's projections other than K and V reach no stored key or value.
            (None, None) => {}
            _ => panic!("parameter {i} has a gradient on one path only"),
        }
    }
    // Every layer's K and V matrices at least (A and B each), and every projection of the
    // layers below the last.
    let per_layer = 2 * Proj::ALL.len();
    assert!(reached >= per_layer + 4, "{reached} parameters reached");
    assert!(largest > 1e-7, "the writer receives gradients ({largest})");
}

#[test]
fn training_the_writer_lowers_the_kl_to_full_recompute() {
    let (_dir, base) = tiny_model(12);
    let examples: Vec<WriterExample> = (0..2).map(tiny_example).collect();
    let objective = WriterObjective::new(&base, examples.clone(), true).unwrap();
    let reader = objective.reader();
    let before: f64 = examples
        .iter()
        .map(|e| example_kl(reader, reader, None, e).unwrap())
        .sum();
    assert!(
        before > 1e-5,
        "plain stitching differs from full recompute: {before}"
    );
    let mut c = cfg(30);
    c.batch = 2;
    let mut trainer = Trainer::new(reader, c).unwrap();
    for _ in 0..30 {
        trainer.train_step(&objective).unwrap();
    }
    let adapter = trainer.adapter(reader, DType::F32).unwrap();
    let writer = reader.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    let after: f64 = examples
        .iter()
        .map(|e| example_kl(reader, &writer, None, e).unwrap())
        .sum();
    assert!(after < 0.5 * before, "KL {before} -> {after}");
    // The reader is the base: the writer's adapter never reaches its tail.
    let fresh = training_reader(&base).unwrap();
    assert_eq!(
        example_kl(&fresh, &fresh, None, &examples[0]).unwrap(),
        example_kl(reader, reader, None, &examples[0]).unwrap()
    );
}

#[test]
fn a_writer_run_continues_from_a_stored_adapter_and_refuses_another_shape() {
    let (_dir, base) = tiny_model(12);
    let examples: Vec<WriterExample> = (0..2).map(tiny_example).collect();
    let objective = WriterObjective::new(&base, examples.clone(), true).unwrap();
    let reader = objective.reader();
    let mut first = Trainer::new(reader, cfg(10)).unwrap();
    for _ in 0..10 {
        first.train_step(&objective).unwrap();
    }
    let trained = first.adapter(reader, DType::F32).unwrap();
    let kl_of = |a: &LoraAdapter| -> f64 {
        let writer = reader.with_adapter(a, AdapterMode::Merge).unwrap();
        examples
            .iter()
            .map(|e| example_kl(reader, &writer, None, e).unwrap())
            .sum()
    };
    // Before any step the continued run holds the stored matrices, not a fresh adapter (whose
    // B is zero: plain stitching).
    let mut next = Trainer::from_adapter(reader, cfg(5), &trained).unwrap();
    let start = next.adapter(reader, DType::F32).unwrap();
    for (layer, proj) in trained.targets() {
        let (a, b) = trained.get(layer, proj).unwrap();
        let (a2, b2) = start.get(layer, proj).unwrap();
        for (x, y) in [(a, a2), (b, b2)] {
            let diff = (x - y).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{layer} {proj:?}");
        }
    }
    // So it reads the documents as the stored writer does, not as plain stitching.
    let fresh = Trainer::new(reader, cfg(5)).unwrap();
    let plain = kl_of(&fresh.adapter(reader, DType::F32).unwrap());
    let continued = kl_of(&start);
    assert_eq!(continued, kl_of(&trained));
    assert_ne!(continued, plain);
    // And it trains on from there.
    for _ in 0..5 {
        next.train_step(&objective).unwrap();
    }
    assert!(kl_of(&next.adapter(reader, DType::F32).unwrap()).is_finite());
    // Another rank, alpha or set of projections would train another adapter: refused.
    for other in [
        TrainConfig { rank: 2, ..cfg(5) },
        TrainConfig {
            alpha: 4.0,
            ..cfg(5)
        },
        TrainConfig {
            targets: vec![Proj::K, Proj::V],
            ..cfg(5)
        },
        TrainConfig {
            boundary: Some((2, 2)),
            ..cfg(5)
        },
    ] {
        assert!(matches!(
            Trainer::from_adapter(reader, other, &trained),
            Err(TrainError::Config(_))
        ));
    }
}

/// A real-model run's options: a few short examples (no distractors), a checkpoint every step.
fn real_opts(dir: &std::path::Path, compiler_adapter: Option<LoraAdapter>) -> WriterOptions {
    WriterOptions {
        out_dir: dir.to_path_buf(),
        checkpoint_every: 1,
        resume: false,
        dtype: DType::F32,
        checkpointing: true,
        examples: 2,
        valid_examples: 1,
        distractors: (0, 0),
        compiler_adapter,
        init: None,
    }
}

fn train_real(c: &TrainConfig, o: &WriterOptions) -> Result<WriterOutcome, TrainError> {
    let (base, tok) = real();
    let data = EvalData::load(&common::eval_data_dir()).unwrap();
    let stop = AtomicBool::new(false);
    train_writer(
        base,
        tok,
        &data.squad,
        &data.squad_file,
        c,
        o,
        &stop,
        |_| {},
    )
}

/// One step of `c`; a second run in the same folder without --resume is refused; with it, the
/// run goes on to two steps. Returns the final manifest.
fn train_then_resume(c: &TrainConfig, opts: &WriterOptions) -> WriterManifest {
    let one = TrainConfig {
        steps: 1,
        ..c.clone()
    };
    let WriterOutcome::Finished(first) = train_real(&one, opts).unwrap() else {
        panic!("stopped")
    };
    assert_eq!(first.steps, 1);
    assert!(train_real(&one, opts).is_err());
    let resumed = WriterOptions {
        resume: true,
        ..opts.clone()
    };
    let two = TrainConfig { steps: 2, ..one };
    let WriterOutcome::Finished(m) = train_real(&two, &resumed).unwrap() else {
        panic!("stopped")
    };
    assert_eq!(m.steps, 2);
    *m
}

#[test]
fn train_writer_runs_end_to_end_resumes_and_ships_an_adapter() {
    let (base, _) = real();
    let dir = tempfile::tempdir().unwrap();
    let c = TrainConfig {
        rank: 2,
        alpha: 4.0,
        lr: 1e-3,
        targets: vec![Proj::K, Proj::V],
        ..cfg(1)
    };
    let m = train_then_resume(&c, &real_opts(dir.path(), None));
    assert_eq!(m.data.articles.len(), 4);
    assert!(m.validation.kl_no_recompute > 0.0 && m.validation.kl_writer.is_finite());
    assert!(m.final_train_loss.is_finite());
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["steps"], 2);
    let adapter = LoraAdapter::load(dir.path().join("adapter.safetensors"), base.config()).unwrap();
    assert!(m.boundary.is_none());
    assert_eq!(adapter.rank(), 2);
    assert_eq!(
        adapter.targets().count(),
        2 * base.config().num_layers,
        "k and v of every layer"
    );
    // A second stage continues the shipped adapter and names it in its manifest.
    let next = tempfile::tempdir().unwrap();
    let file = FileInfo {
        path: "adapter.safetensors".into(),
        sha256: "0".repeat(64),
    };
    let opts = WriterOptions {
        init: Some((adapter, file.clone())),
        ..real_opts(next.path(), None)
    };
    let WriterOutcome::Finished(m) = train_real(&TrainConfig { steps: 1, ..c }, &opts).unwrap()
    else {
        panic!("stopped")
    };
    assert_eq!(m.continued_from, Some(file));
    assert!(m.validation.kl_writer.is_finite());
}

fn boundary_cfg(steps: usize) -> TrainConfig {
    TrainConfig {
        boundary: Some((2, 2)),
        lr: 5e-2,
        ..cfg(steps)
    }
}

#[test]
fn boundary_token_gradients_with_checkpointing_match_one_graph() {
    let (_dir, base) = tiny_model(13);
    let ex = tiny_example(1);
    let plain = WriterObjective::new(&base, vec![ex.clone()], false).unwrap();
    let ckpt = WriterObjective::new(&base, vec![ex.clone()], true).unwrap();
    let mut trainer = Trainer::new(plain.reader(), boundary_cfg(1)).unwrap();
    trainer.train_step(&plain).unwrap();
    assert!(trainer.adapter(plain.reader(), DType::F32).is_err());
    let a = grads_of(&trainer, &plain, &ex);
    let b = grads_of(&trainer, &ckpt, &ex);
    assert_eq!(a.len(), 2, "header and trailer");
    for (i, pair) in a.iter().zip(&b).enumerate() {
        let (Some(x), Some(y)) = pair else {
            panic!("token set {i} has no gradient on a path")
        };
        let scale = common::max_abs(x);
        assert!(scale > 1e-7, "token set {i} receives gradients ({scale})");
        let diff = common::max_abs_diff(x, y);
        assert!(
            diff <= 1e-4 * scale + 1e-7,
            "token set {i}: {diff} of {scale}"
        );
    }
}

#[test]
fn training_boundary_tokens_lowers_the_kl_to_full_recompute() {
    let (_dir, base) = tiny_model(14);
    let examples: Vec<WriterExample> = (0..2).map(tiny_example).collect();
    let objective = WriterObjective::new(&base, examples.clone(), true).unwrap();
    let reader = objective.reader();
    let mut c = boundary_cfg(30);
    c.batch = 2;
    let mut trainer = Trainer::new(reader, c).unwrap();
    let kl = |b: &scd_models::boundary::Boundary| -> f64 {
        examples
            .iter()
            .map(|e| example_kl(reader, reader, Some(b), e).unwrap())
            .sum()
    };
    let before = kl(&trainer.boundary().unwrap().detach());
    for _ in 0..30 {
        trainer.train_step(&objective).unwrap();
    }
    let after = kl(&trainer.boundary().unwrap().detach());
    assert!(after < 0.7 * before, "KL {before} -> {after}");
}

#[test]
fn boundary_tokens_for_a_writer_train_end_to_end_resume_and_ship() {
    use scd_models::boundary::{Boundary, BoundaryError};
    let (base, _) = real();
    let dir = tempfile::tempdir().unwrap();
    let writer_adapter = LoraAdapter::init(base.config(), 2, 4.0, &[Proj::V], 9).unwrap();
    let opts = real_opts(dir.path(), Some(writer_adapter.clone()));
    let c = TrainConfig {
        lr: 1e-3,
        ..boundary_cfg(1)
    };
    let m = train_then_resume(&c, &opts);
    assert!(m.adapter.is_none());
    // Resumed with another writer, the run is refused: its tokens were trained for the first.
    let other_writer = LoraAdapter::init(base.config(), 2, 4.0, &[Proj::V], 10).unwrap();
    let resumed_elsewhere = WriterOptions {
        resume: true,
        ..real_opts(dir.path(), Some(other_writer))
    };
    let three = TrainConfig {
        steps: 3,
        ..c.clone()
    };
    let err = train_real(&three, &resumed_elsewhere).unwrap_err();
    assert!(err.to_string().contains("--writer differs"), "{err}");
    let meta = m.boundary.clone().unwrap();
    assert_eq!((meta.header, meta.trailer), (2, 2));
    assert!(m.validation.kl_compiler_alone.unwrap().is_finite());
    assert!(m.validation.kl_writer.is_finite());
    // The tokens load for the writer they were trained with, not for the base.
    let reader = training_reader(base).unwrap();
    let writer = reader
        .with_adapter(&writer_adapter, AdapterMode::Merge)
        .unwrap();
    let loaded = Boundary::load(dir.path(), &writer).unwrap();
    assert_eq!(loaded.content_sha256().unwrap(), meta.sha256);
    assert!(matches!(
        Boundary::load(dir.path(), base),
        Err(BoundaryError::ForeignModel { .. })
    ));
    // A writer's compiling adapter without boundary tokens makes no sense.
    let other = tempfile::tempdir().unwrap();
    assert!(train_real(&cfg(1), &real_opts(other.path(), Some(writer_adapter))).is_err());
}
