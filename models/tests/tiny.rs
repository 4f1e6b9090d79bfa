//! A tiny random llama (written as a Hugging Face directory): LoRA adapters, the half-split to
//! interleaved RoPE permutation, sampling.

mod common;

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use common::{all_logits, max_abs, max_abs_diff, tiny_config, tiny_model};
use scd_models::hf::to_interleaved_rows;
use scd_models::lora::peft_name;
use scd_models::sampling::{argmax, nucleus};
use scd_models::{
    AdapterError, AdapterMode, Capture, Input, Llama, LoraAdapter, Proj, Sampler, Sampling,
};

const TOKENS: [u32; 12] = [3, 17, 42, 5, 9, 63, 0, 21, 21, 8, 30, 11];

fn random_adapter(seed: u64, rank: usize) -> LoraAdapter {
    random_adapter_on(seed, rank, &Proj::ALL)
}

fn random_adapter_on(seed: u64, rank: usize, projs: &[Proj]) -> LoraAdapter {
    let cfg = tiny_config();
    let init = LoraAdapter::init(&cfg, rank, 2.0 * rank as f64, projs, seed).unwrap();
    // Give B random values so that the adapter actually edits the model.
    let mut weights = BTreeMap::new();
    for (layer, proj) in init.targets().collect::<Vec<_>>() {
        let (a, b) = init.get(layer, proj).unwrap();
        let b = Tensor::randn(0f32, 0.2, b.dims(), &Device::Cpu).unwrap();
        weights.insert((layer, proj), (a.clone(), b));
    }
    LoraAdapter::from_parts(&cfg, rank, 2.0 * rank as f64, weights).unwrap()
}

/// All logits of `TOKENS` with `adapter` merged, and applied on the fly.
fn merged_and_on_the_fly(model: &Llama, adapter: &LoraAdapter) -> (Tensor, Tensor) {
    let run = |mode| all_logits(&model.with_adapter(adapter, mode).unwrap(), &TOKENS);
    (run(AdapterMode::Merge), run(AdapterMode::OnTheFly))
}

#[test]
fn zero_b_adapter_leaves_logits_unchanged() {
    let (_dir, model) = tiny_model(1);
    let base = all_logits(&model, &TOKENS);
    let adapter = LoraAdapter::init(model.config(), 4, 8.0, &Proj::ALL, 7).unwrap();
    for mode in [AdapterMode::Merge, AdapterMode::OnTheFly] {
        let expert = model.with_adapter(&adapter, mode).unwrap();
        assert!(
            max_abs_diff(&all_logits(&expert, &TOKENS), &base) < 1e-5,
            "{mode:?}"
        );
    }
}

#[test]
fn random_adapter_changes_logits_and_merged_equals_on_the_fly() {
    let (_dir, model) = tiny_model(1);
    let base = all_logits(&model, &TOKENS);
    let adapter = random_adapter(3, 4);
    let (merged, fly) = merged_and_on_the_fly(&model, &adapter);
    assert!(
        max_abs_diff(&merged, &base) > 1e-2,
        "the adapter changed nothing"
    );
    assert!(max_abs_diff(&merged, &fly) < 1e-4 * max_abs(&merged).max(1.0));
    // The base model is untouched by building experts from it.
    assert!(max_abs_diff(&all_logits(&model, &TOKENS), &base) < 1e-6);
}

/// An adapter on some projections of a block only: on the fly, the fused inference path
/// must fall back to the separate projections for exactly those (q here, and down) while gate/up
/// stay fused, and still agree with the merged model.
#[test]
fn partial_on_the_fly_adapter_equals_merged() {
    let (_dir, model) = tiny_model(1);
    let adapter = random_adapter_on(5, 4, &[Proj::Q, Proj::Down]);
    let (merged, fly) = merged_and_on_the_fly(&model, &adapter);
    assert!(max_abs_diff(&merged, &all_logits(&model, &TOKENS)) > 1e-2);
    assert!(max_abs_diff(&merged, &fly) < 1e-4 * max_abs(&merged).max(1.0));
}

#[test]
fn adapter_save_load_round_trip_in_peft_layout() {
    let (dir, model) = tiny_model(1);
    let cfg = model.config().clone();
    let adapter = random_adapter(5, 2);
    let path = dir.path().join("adapter.safetensors");
    adapter.save(&path, &cfg).unwrap();
    let loaded = LoraAdapter::load(&path, &cfg).unwrap();
    assert_eq!((loaded.rank(), loaded.alpha()), (2, 4.0));
    for (layer, proj) in adapter.targets() {
        let (a0, b0) = adapter.get(layer, proj).unwrap();
        let (a1, b1) = loaded.get(layer, proj).unwrap();
        assert!(max_abs_diff(a0, a1) == 0.0 && max_abs_diff(b0, b1) == 0.0);
    }
    // On disk, q/k B rows are in PEFT's half-split layout: permuting them gives ours back.
    let raw = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let b_q = &raw[&peft_name(0, Proj::Q, 'B')];
    let (_, ours) = adapter.get(0, Proj::Q).unwrap();
    assert!(max_abs_diff(&to_interleaved_rows(b_q, cfg.num_heads).unwrap(), ours) == 0.0);
    assert!(max_abs_diff(b_q, ours) > 0.0);
    // adapter_config.json beside the file wins over the metadata.
    std::fs::write(
        dir.path().join("adapter_config.json"),
        r#"{"r": 2, "lora_alpha": 16, "target_modules": ["q_proj"]}"#,
    )
    .unwrap();
    assert_eq!(LoraAdapter::load(&path, &cfg).unwrap().alpha(), 16.0);
}

/// An expert with its own RoPE base: the base travels with the adapter (file metadata and
/// identity), the expert rotates with it, and the base model keeps its own.
#[test]
fn an_adapter_with_its_own_rope_base_keeps_it_through_save_load_and_identity() {
    let (dir, model) = tiny_model(1);
    let cfg = model.config().clone();
    let plain = LoraAdapter::init(&cfg, 2, 4.0, &Proj::ALL, 7).unwrap();
    let own = plain.clone().with_rope_theta(Some(1e6)).unwrap();
    assert_eq!((plain.rope_theta(), own.rope_theta()), (None, Some(1e6)));
    // Same matrices, another expert: the identity tells them apart.
    assert_ne!(
        plain.content_sha256().unwrap(),
        own.content_sha256().unwrap()
    );
    let path = dir.path().join("adapter.safetensors");
    own.save(&path, &cfg).unwrap();
    let loaded = LoraAdapter::load(&path, &cfg).unwrap();
    assert_eq!(loaded.rope_theta(), Some(1e6));
    assert_eq!(
        loaded.content_sha256().unwrap(),
        own.content_sha256().unwrap()
    );
    // An identity edit (B = 0) with another base changes every position but the first.
    let expert = model.with_adapter(&loaded, AdapterMode::Merge).unwrap();
    assert_eq!(expert.config().rope_theta, 1e6);
    assert_eq!(expert.base_rope(), model.rope());
    assert_ne!(expert.rope(), model.rope());
    let (a, b) = (all_logits(&expert, &TOKENS), all_logits(&model, &TOKENS));
    let first = |t: &Tensor| t.narrow(0, 0, 1).unwrap();
    assert!(max_abs_diff(&first(&a), &first(&b)) < 1e-5);
    assert!(max_abs_diff(&a, &b) > 1e-3, "the RoPE base changed nothing");
    // Bad values are refused, in memory and in a file's metadata.
    for bad in [0.5, f64::NAN, f64::INFINITY] {
        assert!(plain.clone().with_rope_theta(Some(bad)).is_err(), "{bad}");
    }
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let meta = HashMap::from([
        ("r".to_string(), "2".to_string()),
        ("lora_alpha".to_string(), "4".to_string()),
        ("rope_theta".to_string(), "a million".to_string()),
    ]);
    safetensors::serialize_to_file(tensors.iter(), Some(meta), &path).unwrap();
    let err = LoraAdapter::load(&path, &cfg).unwrap_err();
    assert!(err.to_string().contains("rope_theta"), "{err}");
}

#[test]
fn adapter_with_a_wrong_shape_is_a_typed_error_naming_the_tensor() {
    let cfg = tiny_config();
    let name_a = peft_name(1, Proj::Up, 'A');
    let name_b = peft_name(1, Proj::Up, 'B');
    let tensors = HashMap::from([
        (
            name_a.clone(),
            Tensor::zeros(
                (4, cfg.hidden_size + 1),
                candle_core::DType::F32,
                &Device::Cpu,
            )
            .unwrap(),
        ),
        (
            name_b,
            Tensor::zeros(
                (cfg.intermediate_size, 4),
                candle_core::DType::F32,
                &Device::Cpu,
            )
            .unwrap(),
        ),
    ]);
    let err = LoraAdapter::from_peft_tensors(&cfg, 4, 8.0, tensors).unwrap_err();
    match &err {
        AdapterError::Shape {
            tensor,
            got,
            expected,
        } => {
            assert_eq!(tensor, &name_a);
            assert_eq!(got, &[4, cfg.hidden_size + 1]);
            assert_eq!(expected, &[4, cfg.hidden_size]);
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains(&name_a), "{err}");

    // B without A, a layer the model does not have, and an adapter built for another model.
    let lonely = HashMap::from([(
        peft_name(0, Proj::V, 'B'),
        Tensor::zeros((cfg.kv_dim(), 4), candle_core::DType::F32, &Device::Cpu).unwrap(),
    )]);
    let err = LoraAdapter::from_peft_tensors(&cfg, 4, 8.0, lonely).unwrap_err();
    assert!(matches!(err, AdapterError::Unpaired { .. }), "{err}");
    let far = HashMap::from([(
        peft_name(9, Proj::V, 'A'),
        Tensor::zeros((4, cfg.hidden_size), candle_core::DType::F32, &Device::Cpu).unwrap(),
    )]);
    let err = LoraAdapter::from_peft_tensors(&cfg, 4, 8.0, far).unwrap_err();
    assert!(matches!(err, AdapterError::UnknownTensor { .. }), "{err}");
    let mut bigger = cfg.clone();
    bigger.intermediate_size += 8;
    let other = LoraAdapter::init(&bigger, 2, 2.0, &[Proj::Down], 0).unwrap();
    let (_dir, model) = tiny_model(1);
    let err = model
        .with_adapter(&other, AdapterMode::OnTheFly)
        .unwrap_err();
    assert!(
        matches!(&err, AdapterError::Shape { tensor, .. } if tensor.contains("mlp.down_proj.lora_A")),
        "{err}"
    );
}

#[test]
fn adapter_without_rank_or_alpha_is_an_error() {
    let cfg = tiny_config();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.safetensors");
    let t = HashMap::from([(
        peft_name(0, Proj::Q, 'A'),
        Tensor::zeros((2, cfg.hidden_size), candle_core::DType::F32, &Device::Cpu).unwrap(),
    )]);
    candle_core::safetensors::save(&t, &path).unwrap();
    let err = LoraAdapter::load(&path, &cfg).unwrap_err();
    assert!(
        matches!(err, AdapterError::MissingConfig { what: "rank", .. }),
        "{err}"
    );
    let err = LoraAdapter::load(dir.path().join("none.safetensors"), &cfg).unwrap_err();
    assert!(matches!(err, AdapterError::Io { .. }), "{err}");
}

#[test]
fn on_the_fly_adapter_is_differentiable() {
    let (_dir, model) = tiny_model(1);
    let cfg = model.config().clone();
    let a = candle_core::Var::randn(0f32, 0.1, (2, cfg.hidden_size), &Device::Cpu).unwrap();
    let b = candle_core::Var::randn(0f32, 0.1, (cfg.q_dim(), 2), &Device::Cpu).unwrap();
    let weights = BTreeMap::from([((0, Proj::Q), (a.as_tensor().clone(), b.as_tensor().clone()))]);
    let adapter = LoraAdapter::from_parts(&cfg, 2, 2.0, weights).unwrap();
    let expert = model.with_adapter(&adapter, AdapterMode::OnTheFly).unwrap();
    let logits = all_logits(&expert, &TOKENS);
    assert!(logits.track_op());
    // The differentiable path computes the same function as the inference kernels, which run
    // for the same adapter without gradients.
    let detached = BTreeMap::from([(
        (0, Proj::Q),
        (a.as_tensor().detach(), b.as_tensor().detach()),
    )]);
    let plain = LoraAdapter::from_parts(&cfg, 2, 2.0, detached).unwrap();
    let fast = all_logits(
        &model.with_adapter(&plain, AdapterMode::OnTheFly).unwrap(),
        &TOKENS,
    );
    assert!(!fast.track_op());
    assert!(max_abs_diff(&logits, &fast) < 1e-4);
    let loss = logits.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let ga = grads.get(a.as_tensor()).expect("gradient for A");
    let gb = grads.get(b.as_tensor()).expect("gradient for B");
    assert!(max_abs(ga) > 0.0 && max_abs(gb) > 0.0);
}

#[test]
fn half_split_checkpoint_rotates_like_neox_after_the_permutation() {
    // Independent check of the load-time permutation: K from the Hugging Face weights, rotated
    // with candle's half-split (NeoX) kernel, must equal our cache's K up to the same column
    // permutation.
    let (dir, model) = tiny_model(2);
    let cfg = model.config().clone();
    let raw =
        candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu).unwrap();
    let w_k_hf = &raw["model.layers.1.self_attn.k_proj.weight"];
    let mut cache = model.new_cache();
    let out = model
        .forward(Input::new(&TOKENS).with_cache(&mut cache).capture(Capture {
            h_in: true,
            ..Capture::none()
        }))
        .unwrap();
    let h_in = out.layer(1).unwrap().h_in.clone().unwrap();
    let t = TOKENS.len();
    let (kv, d) = (cfg.num_kv_heads, cfg.head_dim);
    let k_hf = h_in.matmul(&w_k_hf.t().unwrap()).unwrap();
    let k_heads = k_hf
        .reshape((1, t, kv, d))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap();
    let rope = scd_models::Rope::new(&cfg);
    let positions: Vec<u32> = (0..t as u32).collect();
    let (cos, sin) = rope.cos_sin(&positions, &Device::Cpu).unwrap();
    let k_neox = candle_nn::rotary_emb::rope(&k_heads, &cos, &sin).unwrap();
    let k_neox = k_neox
        .transpose(1, 2)
        .unwrap()
        .reshape((t, kv * d))
        .unwrap();
    let expected = to_interleaved_rows(&k_neox.t().unwrap().contiguous().unwrap(), kv)
        .unwrap()
        .t()
        .unwrap();
    let (k_ours, _) = cache.layer(1).unwrap().unwrap();
    assert!(max_abs_diff(&k_ours, &expected) < 1e-4);
}

#[test]
fn exported_hf_dir_loads_back_to_the_same_model() {
    let (_dir, model) = tiny_model(4);
    let out = tempfile::tempdir().unwrap();
    model.save_hf_dir(out.path()).unwrap();
    let again = scd_models::Llama::from_hf_dir(out.path())
        .unwrap()
        .with_decode_weights(scd_models::DecodeWeights::F32)
        .unwrap();
    assert_eq!(again.config(), model.config());
    assert!(max_abs_diff(&all_logits(&again, &TOKENS), &all_logits(&model, &TOKENS)) < 1e-6);
}

#[test]
fn sampling_is_seeded_greedy_is_argmax_and_top_p_restricts_support() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let mut greedy = Sampler::new(Sampling::Greedy, 0);
    assert_eq!(greedy.sample(&logits), argmax(&logits));
    assert_eq!(argmax(&[0.0, 3.0, -1.0, 3.0]), 1);

    let sampling = Sampling::TopP {
        temperature: 1.0,
        top_p: 0.9,
    };
    let draw = |seed| {
        let mut s = Sampler::new(sampling, seed);
        (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
    };
    assert_eq!(draw(11), draw(11));
    assert_ne!(draw(11), draw(12));

    // top_p = 0.5 keeps only the few most likely tokens; every draw comes from them.
    let kept = nucleus(&logits, 1.0, 0.5);
    assert!(kept.len() < logits.len() / 2, "kept {}", kept.len());
    let support: Vec<u32> = kept.iter().map(|k| k.0).collect();
    let mut s = Sampler::new(
        Sampling::TopP {
            temperature: 1.0,
            top_p: 0.5,
        },
        3,
    );
    for _ in 0..500 {
        assert!(support.contains(&s.sample(&logits)));
    }
    // A tiny top_p is greedy; a low temperature concentrates the mass.
    assert_eq!(nucleus(&logits, 1.0, 1e-6).len(), 1);
    assert!(nucleus(&logits, 0.05, 0.99).len() <= nucleus(&logits, 1.0, 0.99).len());
    assert!(Sampling::from_params(-1.0, 0.9).is_err());
    assert!(Sampling::from_params(0.7, 0.0).is_err());
    assert_eq!(Sampling::from_params(0.0, 0.9).unwrap(), Sampling::Greedy);
}

/// A cache holding `prefix` for `model`.
fn cache_of(model: &Llama, prefix: &[u32]) -> scd_models::KvCache {
    let mut cache = model.new_cache();
    if !prefix.is_empty() {
        model
            .forward(Input::new(prefix).with_cache(&mut cache))
            .unwrap();
    }
    cache
}

#[test]
fn a_batch_of_sequences_at_different_positions_and_experts_equals_each_alone() {
    let (_dir, base) = tiny_model(3);
    let a = random_adapter(11, 4);
    let b = random_adapter_on(12, 2, &[Proj::Q, Proj::V, Proj::Down]);
    let a_fly = base.with_adapter(&a, AdapterMode::OnTheFly).unwrap();
    let b_fly = base.with_adapter(&b, AdapterMode::OnTheFly).unwrap();
    let a_merged = base.with_adapter(&a, AdapterMode::Merge).unwrap();
    // An expert that rotates with its own RoPE base: its rows take its own angles.
    let c = random_adapter(13, 2).with_rope_theta(Some(1e6)).unwrap();
    let c_fly = base.with_adapter(&c, AdapterMode::OnTheFly).unwrap();
    // (model, cached prefix, new tokens): interleaved so that rows of one weight are not
    // adjacent in the caller's order; one sequence with no cached prefix, one with 3 new tokens.
    let cases: Vec<(&Llama, &[u32], &[u32])> = vec![
        (&a_fly, &TOKENS[..5], &[7]),
        (&base, &TOKENS[..9], &[2]),
        (&b_fly, &TOKENS[..2], &[40, 41, 42]),
        (&a_merged, &TOKENS[..7], &[1]),
        (&a_fly, &[], &[9]),
        (&b_fly, &TOKENS[..11], &[13]),
        (&c_fly, &TOKENS[..6], &[4, 5]),
    ];
    let mut alone = Vec::new();
    for &(model, prefix, tokens) in &cases {
        let mut cache = cache_of(model, prefix);
        let out = model
            .forward(Input::new(tokens).with_cache(&mut cache))
            .unwrap();
        alone.push((out.logits.unwrap(), cache));
    }
    let mut caches: Vec<_> = cases
        .iter()
        .map(|&(model, prefix, _)| cache_of(model, prefix))
        .collect();
    let mut seqs: Vec<scd_models::Sequence<'_>> = cases
        .iter()
        .zip(caches.iter_mut())
        .map(|(&(model, _, tokens), cache)| scd_models::Sequence {
            model,
            tokens,
            cache,
        })
        .collect();
    let batched = Llama::forward_batch(&mut seqs).unwrap();
    assert_eq!(batched.dims(), &[cases.len(), 64]);
    for (i, ((logits, cache_alone), cache)) in alone.iter().zip(&caches).enumerate() {
        let row = batched.narrow(0, i, 1).unwrap();
        let d = max_abs_diff(&row, logits);
        assert!(d < 1e-4, "sequence {i}: logits differ by {d}");
        assert_eq!(cache.next_position(), cache_alone.next_position(), "{i}");
        for layer in 0..2 {
            let (k, v) = cache.layer(layer).unwrap().unwrap();
            let (k1, v1) = cache_alone.layer(layer).unwrap().unwrap();
            assert!(max_abs_diff(&k, &k1) < 1e-4 && max_abs_diff(&v, &v1) < 1e-4);
        }
    }
    // The experts' rows really differ from the base's (the batch did not apply one model).
    let (base_row, a_row) = (batched.narrow(0, 1, 1).unwrap(), alone[0].0.clone());
    assert!(max_abs_diff(&base_row, &a_row) > 1e-2);
}

#[test]
fn a_batch_refuses_models_of_different_bases_and_empty_input() {
    let (_d1, one) = tiny_model(3);
    let (_d2, other) = tiny_model(4);
    let (mut c1, mut c2) = (one.new_cache(), other.new_cache());
    let mut seqs = vec![
        scd_models::Sequence {
            model: &one,
            tokens: &[1],
            cache: &mut c1,
        },
        scd_models::Sequence {
            model: &other,
            tokens: &[1],
            cache: &mut c2,
        },
    ];
    let err = Llama::forward_batch(&mut seqs).unwrap_err();
    assert!(
        matches!(err, scd_models::ForwardError::MixedBases { .. }),
        "{err}"
    );
    assert!(matches!(
        Llama::forward_batch(&mut []).unwrap_err(),
        scd_models::ForwardError::EmptyInput
    ));
    // Nothing was written to the caches of a refused batch.
    assert_eq!((c1.next_position(), c2.next_position()), (0, 0));
}

#[test]
fn batched_generations_equal_each_alone_even_when_one_sits_out_steps() {
    use scd_models::batch::{Batch, Event};
    use scd_models::{generate_with_cache, GenerateParams};
    use std::sync::Arc;
    let (_dir, base) = tiny_model(5);
    let base = Arc::new(base);
    let expert = Arc::new(
        base.with_adapter(&random_adapter(21, 4), AdapterMode::OnTheFly)
            .unwrap(),
    );
    let params = |max_tokens, sampling, seed| GenerateParams {
        max_tokens,
        sampling,
        seed,
        stop_tokens: vec![63],
    };
    let jobs = [
        (
            Arc::clone(&base),
            &TOKENS[..6],
            params(12, Sampling::Greedy, 0),
        ),
        (
            Arc::clone(&expert),
            &TOKENS[..9],
            params(8, Sampling::Greedy, 0),
        ),
        (
            Arc::clone(&expert),
            &TOKENS[..3],
            params(
                16,
                Sampling::TopP {
                    temperature: 0.9,
                    top_p: 0.9,
                },
                7,
            ),
        ),
    ];
    let mut expected = Vec::new();
    for (model, prompt, p) in &jobs {
        let (last, prefix) = prompt.split_last().unwrap();
        let mut cache = cache_of(model, prefix);
        expected.push(
            generate_with_cache(model, &mut cache, &[*last], p, |_| {
                std::ops::ControlFlow::Continue(())
            })
            .unwrap(),
        );
    }
    let mut batch = Batch::new();
    for (key, (model, prompt, p)) in jobs.iter().enumerate() {
        let (last, prefix) = prompt.split_last().unwrap();
        let cache = cache_of(model, prefix);
        batch
            .join(key, Arc::clone(model), cache, vec![*last], p)
            .unwrap();
    }
    let mut got = vec![Vec::new(); jobs.len()];
    let mut done = vec![None; jobs.len()];
    let mut step = 0;
    while !batch.is_empty() {
        // Job 1 sits out every other step (its client is slow).
        for event in batch.step(|&k| k != 1 || step % 2 == 0).unwrap() {
            match event {
                Event::Token(k, t) => got[k].push(t),
                Event::Done(k, g) => done[k] = Some(g),
            }
        }
        step += 1;
        assert!(step < 100, "the batch does not finish");
    }
    for (k, want) in expected.iter().enumerate() {
        let g = done[k].as_ref().unwrap();
        assert_eq!(got[k], want.tokens, "job {k}");
        assert_eq!(g.tokens, want.tokens, "job {k}");
        assert_eq!(g.stop, want.stop, "job {k}");
        assert_eq!(g.prompt_tokens, want.prompt_tokens, "job {k}");
    }
}

#[test]
fn a_generation_leaves_the_batch_with_what_it_made() {
    use scd_models::batch::Batch;
    use scd_models::GenerateParams;
    use std::sync::Arc;
    let (_dir, base) = tiny_model(6);
    let base = Arc::new(base);
    let params = GenerateParams {
        max_tokens: 10,
        ..GenerateParams::default()
    };
    let mut batch = Batch::new();
    batch
        .join(
            "a",
            Arc::clone(&base),
            cache_of(&base, &TOKENS[..4]),
            vec![5],
            &params,
        )
        .unwrap();
    batch
        .join(
            "b",
            Arc::clone(&base),
            cache_of(&base, &TOKENS[..2]),
            vec![5],
            &params,
        )
        .unwrap();
    // One too many new tokens for the context (32) is refused at the door.
    let too_long = GenerateParams {
        max_tokens: 28,
        ..GenerateParams::default()
    };
    assert!(batch
        .join(
            "c",
            Arc::clone(&base),
            cache_of(&base, &TOKENS[..4]),
            vec![5],
            &too_long
        )
        .is_err());
    batch.step(|_| true).unwrap();
    batch.step(|_| true).unwrap();
    let left = batch.leave(&"a").unwrap();
    assert_eq!(left.tokens.len(), 2);
    assert_eq!(left.stop, scd_models::StopReason::Cancelled);
    assert_eq!(batch.keys().collect::<Vec<_>>(), vec![&"b"]);
    assert!(batch.leave(&"a").is_none());
}
