//! The quality harness on the real SmolLM2 base, WikiText-2 and SQuAD: the oracle matches
//! itself, raw transfer between identical models is lossless, raw transfer into a different
//! consumer is not, the QA plumbing scores answers, and records are deterministic for a seed.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use common::{max_abs_diff, real as base};
use rand::{Rng, SeedableRng};
use scd_models::codec::{codec_for, Oracle, Raw};
use scd_models::eval::{self, harness::transfer, EvalConfig, EvalData, EvalRecord, Pair, QaItem};
use scd_models::{AdapterMode, DecodeWeights, Input, Llama, LogitsWanted, LoraAdapter, Proj};
use scd_types::Mode;

fn data() -> &'static EvalData {
    static D: OnceLock<EvalData> = OnceLock::new();
    D.get_or_init(|| EvalData::load(&common::eval_data_dir()).unwrap())
}

/// The base with a random adapter whose B is not zero: a consumer that differs from the base.
fn perturbed() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let (model, _) = base();
        let cfg = model.config();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut parts = BTreeMap::new();
        for layer in 0..cfg.num_layers {
            for proj in [Proj::Q, Proj::V, Proj::Up] {
                let (out, inp) = proj.shape(cfg);
                let mut mk = |n: usize, s: f32| -> Vec<f32> {
                    (0..n).map(|_| rng.gen_range(-s..s)).collect()
                };
                let a = Tensor::from_vec(mk(4 * inp, 0.05), (4, inp), &Device::Cpu).unwrap();
                let b = Tensor::from_vec(mk(out * 4, 0.05), (out, 4), &Device::Cpu).unwrap();
                parts.insert((layer, proj), (a, b));
            }
        }
        let adapter = LoraAdapter::from_parts(cfg, 4, 8.0, parts).unwrap();
        model.with_adapter(&adapter, AdapterMode::Merge).unwrap()
    })
}

fn small_cfg() -> EvalConfig {
    EvalConfig {
        seed: 11,
        wikitext_windows: 2,
        prefix_tokens: 24,
        continuation_tokens: 8,
        greedy_tokens: 6,
        squad_questions: 2,
        answer_tokens: 8,
        ..EvalConfig::default()
    }
}

fn run(consumer: &Llama) -> EvalRecord {
    let (model, tok) = base();
    eval::evaluate(
        Pair {
            producer: model,
            consumer,
        },
        &[&Oracle, &Raw],
        tok,
        data(),
        &small_cfg(),
        None,
        |_| {},
    )
    .unwrap()
}

#[test]
fn identical_models_transfer_almost_losslessly_and_records_are_deterministic() {
    let (model, _) = base();
    let first = run(model);
    let second = run(model);
    let json = |r: &EvalRecord| serde_json::to_string(&r.without_timings()).unwrap();
    assert_eq!(json(&first), json(&second));

    let [oracle, raw] = &first.results[..] else {
        panic!("two methods expected")
    };
    assert_eq!(oracle.method, Mode::Oracle);
    assert_eq!(raw.method, Mode::Raw);
    assert_eq!(oracle.positions, 16);
    // The oracle is measured like any method: its own prefill again, the same computation.
    assert_eq!(oracle.kl.value, 0.0);
    assert_eq!(oracle.tv.value, 0.0);
    assert_eq!(oracle.greedy_agreement.value, 1.0);
    assert_eq!(oracle.qa_agreement.value, 1.0);
    assert_eq!(oracle.payload_bytes, 0.0);
    assert!((oracle.perplexity.value - first.oracle_perplexity.value).abs() < 1e-9);
    // Raw between identical models loses only bf16 rounding of K and V.
    assert!(
        raw.kl.value > 0.0 && raw.kl.value < 5e-3,
        "raw KL {:?}",
        raw.kl
    );
    assert!(raw.kl.low <= raw.kl.value && raw.kl.value <= raw.kl.high);
    assert!((raw.payload_share_of_raw - 1.0).abs() < 1e-12);
    // At least the 23-token WikiText prefixes: 30 layers x (K and V) x 192 values x 2 bytes.
    assert!(raw.payload_bytes >= 23.0 * 30.0 * 2.0 * 192.0 * 2.0);
    for m in [oracle, raw] {
        assert!((0.0..=100.0).contains(&m.qa_f1.value));
        assert!(m.qa_exact_match.value <= m.qa_f1.value + 1e-9);
        assert_eq!(m.qa_f1.n, 2);
        assert_eq!(m.kl.n, 2);
    }
    assert!(first.oracle_perplexity.value > 1.0 && first.oracle_perplexity.value < 1e4);
    assert_eq!(first.data.squad_ids.len(), 2);
    assert_eq!(first.models.producer.sha256, model.identity().sha256);
    assert_eq!(first.data.wikitext.sha256.len(), 64);

    let md = first.markdown();
    assert!(md.contains("| oracle |") && md.contains("| raw |"), "{md}");
    assert!(md.contains("2 answerable questions"), "{md}");
    assert!(
        md.contains("Answer the question with a short phrase"),
        "{md}"
    );
}

/// One run for several consumers shares the producer's prefill of each window and question,
/// and gives each consumer the record it gets alone, figure for figure, including a consumer
/// scored on fewer windows than the run's.
#[test]
fn a_shared_run_gives_each_consumer_the_record_it_gets_alone() {
    let (model, tok) = base();
    // One question: its prompt is the long part, and one shows it is shared too.
    let cfg = EvalConfig {
        squad_questions: 1,
        ..small_cfg()
    };
    let both: [&dyn scd_models::codec::Codec; 2] = [&Oracle, &Raw];
    let raw_only: [&dyn scd_models::codec::Codec; 1] = [&Raw];
    let consumers = [
        eval::Consumer {
            model,
            codecs: &both,
            adapter: None,
            windows: 2,
        },
        eval::Consumer {
            model: perturbed(),
            codecs: &raw_only,
            adapter: None,
            windows: 1,
        },
    ];
    let shared = eval::evaluate_shared(model, &consumers, tok, data(), &cfg, |_| {}).unwrap();
    let one_window = EvalConfig {
        wikitext_windows: 1,
        ..cfg.clone()
    };
    let pair = Pair {
        producer: model,
        consumer: perturbed(),
    };
    let by_itself = Pair {
        producer: model,
        consumer: model,
    };
    let alone = [
        eval::evaluate(by_itself, &both, tok, data(), &cfg, None, |_| {}).unwrap(),
        eval::evaluate(pair, &raw_only, tok, data(), &one_window, None, |_| {}).unwrap(),
    ];
    let json = |r: &EvalRecord| serde_json::to_string(&r.without_timings()).unwrap();
    assert_eq!(shared.len(), 2);
    for (s, a) in shared.iter().zip(&alone) {
        assert_eq!(json(s), json(a));
    }
    assert_eq!(shared[1].results[0].kl.n, 1);
    assert!(shared[1].results[0].kl.value > 1e-3);

    // A consumer cannot ask for more windows than the run has.
    let too_many = [eval::Consumer {
        windows: 3,
        ..consumers[1].clone()
    }];
    let err = eval::evaluate_shared(model, &too_many, tok, data(), &cfg, |_| {}).unwrap_err();
    assert!(err.to_string().contains("3 windows of a run of 2"), "{err}");
}

#[test]
fn raw_transfer_into_a_different_consumer_loses_quality() {
    let r = run(perturbed());
    let [oracle, raw] = &r.results[..] else {
        panic!("two methods expected")
    };
    assert_eq!(oracle.kl.value, 0.0, "oracle KL {:?}", oracle.kl);
    assert!(
        raw.kl.value > 1e-3,
        "raw KL {:?} should be clearly positive",
        raw.kl
    );
    assert!(
        raw.tv.value > 1e-3 && raw.tv.value <= 1.0,
        "raw TV {:?}",
        raw.tv
    );
}

#[test]
fn the_drift_report_measures_raw_transfer_on_the_experts_own_text_too() {
    let (model, tok) = base();
    // An "expert corpus" of real text unlike WikiText: the SQuAD paragraphs.
    let own: String = data()
        .squad
        .iter()
        .take(40)
        .map(|q| q.context.as_str())
        .collect::<Vec<_>>()
        .join("\n\n");
    let corpus = scd_models::corpus::Corpus::from_texts(
        "paragraphs",
        "train.txt".into(),
        "valid.txt".into(),
        "test: SQuAD paragraphs",
        own.clone(),
        own.clone(),
    );
    let opts = eval::DriftOptions {
        expert: "perturbed".into(),
        corpus,
        windows: 2,
        window_tokens: 33,
        eval: small_cfg(),
        adapter: None,
    };
    let report = eval::drift(model, perturbed(), tok, data(), &opts, |_| {}).unwrap();
    let own_run = report.domain_transfer.as_ref().unwrap();
    assert_eq!(own_run.data.text_name, "paragraphs valid");
    assert_eq!(report.transfer.data.text_name, "WikiText-2");
    assert_eq!(
        own_run.data.wikitext.sha256,
        scd_models::corpus::sha256_hex(own.as_bytes())
    );
    // Windows of the expert's text, no QA; raw transfer loses quality there too, and the
    // oracle measures zero as everywhere.
    assert!(own_run.data.squad_ids.is_empty());
    let [oracle, raw, q4, q2] = &own_run.results[..] else {
        panic!("oracle, raw, q4 and q2 expected")
    };
    assert_eq!((oracle.kl.value, oracle.kl.n), (0.0, 2));
    assert!(raw.kl.value > 1e-3, "raw KL {:?}", raw.kl);
    // q4 is raw's KV in 4 bits: a payload a quarter of raw's or less, at some KL cost of its
    // own (what `auto` weighs before sending it).
    assert_eq!(q4.method.as_str(), "q4");
    assert!(
        q4.kl.value > 0.0 && q4.kl.value.is_finite(),
        "q4 KL {:?}",
        q4.kl
    );
    assert!(
        q4.payload_share_of_raw < 0.35,
        "{}",
        q4.payload_share_of_raw
    );
    // q2 is KIVI's 2 bits: fewer bytes than q4 (a fifth of raw's), and its own KL.
    assert_eq!(q2.method.as_str(), "q2");
    assert!(
        q2.kl.value > 0.0 && q2.kl.value.is_finite(),
        "q2 KL {:?}",
        q2.kl
    );
    assert!(
        q2.payload_share_of_raw < q4.payload_share_of_raw,
        "{} against {}",
        q2.payload_share_of_raw,
        q4.payload_share_of_raw
    );
    assert_eq!(report.transfer.results.len(), 4);
    assert_ne!(raw.kl.value, report.transfer.results[1].kl.value);
    let md = report.markdown();
    assert!(md.contains("expert's own held-out text"), "{md}");
    assert!(md.contains("paragraphs valid: 2 windows"), "{md}");
    assert!(md.contains("| paragraphs valid PPL |"), "{md}");
    // A report from before the field reads back without it.
    let mut old = serde_json::to_value(&report).unwrap();
    old.as_object_mut().unwrap().remove("domain_transfer");
    let back: eval::DriftReport = serde_json::from_value(old).unwrap();
    assert!(back.domain_transfer.is_none());
}

#[test]
fn methods_build_the_prefix_cache_the_consumer_continues_from() {
    let (model, tok) = base();
    let prompt = tok
        .encode("The whale is a large animal that", false)
        .unwrap();
    let (prefix, last) = (&prompt[..prompt.len() - 1], prompt[prompt.len() - 1]);
    // On the f32 path: steps of a few rows on narrow weights round, and keep the cache in f16.
    let consumer = perturbed()
        .clone()
        .with_decode_weights(DecodeWeights::F32)
        .unwrap();
    let pair = Pair {
        producer: model,
        consumer: &consumer,
    };
    // The oracle's cache is the consumer's own prefill: continuing from it equals a full pass.
    let mut cache = transfer(&Oracle, pair, prefix).unwrap().cache;
    assert_eq!(cache.len(), prefix.len());
    let step = consumer
        .forward(Input::new(&[last]).with_cache(&mut cache))
        .unwrap()
        .logits
        .unwrap();
    let full = consumer
        .forward(Input::new(&prompt).logits(LogitsWanted::Last))
        .unwrap()
        .logits
        .unwrap();
    let diff = max_abs_diff(&step, &full);
    assert!(diff < 1e-3, "cached continuation differs by {diff}");
    // Raw hands over the producer's keys: not the consumer's.
    let raw = transfer(&Raw, pair, prefix).unwrap().cache;
    let oracle = transfer(&Oracle, pair, prefix).unwrap().cache;
    let (kr, _) = raw.layer(5).unwrap().unwrap();
    let (ko, _) = oracle.layer(5).unwrap().unwrap();
    assert_eq!(kr.dims(), ko.dims());
    let d = (kr - ko).unwrap().abs().unwrap().max_all().unwrap();
    assert!(d.to_scalar::<f32>().unwrap() > 1e-4);
    assert!(codec_for(Mode::Raw).is_ok());
}

#[test]
fn squad_plumbing_scores_and_samples_deterministically() {
    let json = br#"{"data":[{"title":"t","paragraphs":[{"context":"Normandy is a region in France.",
        "qas":[{"id":"a","question":"Where is Normandy?","answers":[{"text":"France","answer_start":24}],"is_impossible":false},
               {"id":"b","question":"Who ate it?","answers":[],"is_impossible":true}]}]}]}"#;
    let items = eval::parse_squad(json, Path::new("inline.json")).unwrap();
    assert_eq!(
        items,
        vec![QaItem {
            id: "a".into(),
            context: "Normandy is a region in France.".into(),
            question: "Where is Normandy?".into(),
            answers: vec!["France".into()],
            article: 0,
        }]
    );
    assert_eq!(eval::first_line("\n  In France.\nMore"), "In France.");

    let all = &data().squad;
    assert!(all.len() > 2000, "{} answerable questions", all.len());
    let s1 = eval::sample_questions(all, 5, 1);
    assert_eq!(s1, eval::sample_questions(all, 5, 1));
    assert_ne!(s1, eval::sample_questions(all, 5, 2));

    let (_, tok) = base();
    let prompt = eval::qa_prompt(tok, eval::QA_TEMPLATE, &items[0]).unwrap();
    let text = tok.decode(&prompt, false).unwrap();
    assert!(
        text.contains("Context: Normandy is a region in France."),
        "{text}"
    );
    assert!(text.trim_end().ends_with("<|im_start|>assistant"), "{text}");
    // The scoring the harness applies to the first line of an answer.
    let golds = ["France"];
    assert_eq!(
        scd_models::metrics::squad_exact_match("the France.", &golds),
        1.0
    );
    assert!((scd_models::metrics::squad_f1("in France", &golds) - 2.0 / 3.0).abs() < 1e-12);
}
