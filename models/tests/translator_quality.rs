//! The shipped SCD translators' quality on the real model: each expert's
//! `experts/<name>/translator` carries the base's prefill to that expert, and this file checks
//! what BENCHMARKS.md ("SCD translators") reports for them still holds, so that a translator
//! rebuilt into garbage fails `make test`.
//!
//! What is measured, and how: `scd eval`'s own harness ([`eval::evaluate`]) and codecs
//! ([`codec_with`]), as command E1 runs them (int8 code rows at the translator's default ranks
//! 96/192/128 and its own Patch layers; 512-token prompts, 64 teacher-forced continuation
//! tokens; seed 0), with the base as producer and the expert, its adapter merged, as consumer.
//! For `raw` and `scd`: the mean KL(oracle ‖ method) per continuation position over the
//! windows, each with the harness's bootstrap 95% interval, and the payload bytes per prompt.
//! Greedy and QA runs are left out (`greedy_tokens: 0`, `squad_questions: 0`): they do not
//! enter the KL, and they would double the time.
//!
//! The windows are WikiText-2 validation text (the vendored `data/`, `SCD_EVAL_DATA`), held
//! out from every translator: calibration cut its prompts from the Brown corpus's train split
//! (each `translator.json`'s `calibration`; [`the_windows_are_held_out_from_calibration`]).
//! With seed 0 they are the first windows of E1's, so the figures compare with
//! `docs/m3/<expert>-main.json` window for window.
//!
//! Beside E1's int8 codes, the same windows carry scd as transform-coded codes (`tc`) at the
//! rate each translator's own rate table (measured on its held-out Brown prompts) says gives
//! 11.5% of raw's bytes: the eighth-of-raw operating point (BENCHMARKS.md, "Codes at an eighth
//! of raw"), bounded at 12.5% of raw's bytes on these windows, mail-rope's KL at 0.25 and half
//! of raw's, the mild experts' at 3x raw's (E6, 4 windows: mail-rope 0.153; the mild experts
//! 1.10x / 2.12x / 1.95x). The negative controls must fail both.
//!
//! Like against like: the same windows carry kvtc (raw KV transform-coded by the same coder
//! in the base's own basis, no translation) at the rate its own rate table gives for the same
//! share, and scd's transform-coded KL must be at most kvtc's at no more than 1.05x its bytes,
//! on every expert (measured 2026-12-07: mail-rope 0.153 against 1.251, mail 0.167 against
//! 0.194, sotu 0.082 against 0.094, melville 0.090 against 0.101; the mild experts' margins
//! are 10-14%, and like the other bounds this is a check of these fixed windows, not a
//! statistical claim: the intervals overlap). Random decoders must fail it.
//!
//! The int8 bounds (BENCHMARKS.md's "make-test bound (S2)" row):
//! - mail-rope, the expert whose RoPE base breaks raw transfer: scd KL <= 0.5x raw's
//!   (E1: 0.092x), and under 40% of raw's bytes (36%). 4 windows: the ratio is an order of
//!   magnitude under the bound on every window count we tried.
//! - mail, sotu, melville, the mild experts (raw transfer costs them 0.15 / 0.035 / 0.045
//!   nats): scd KL <= 1.1x raw's (E1: 0.94x / 1.04x / 1.07x) at under 40% of raw's bytes
//!   (37% / 38% / 37%). 16 windows each,
//!   E1's: this file reproduces E1's ratios (0.939 / 1.036 / 1.074). The bound holds on these
//!   windows but with little margin for melville (2.4%), and it is not a statistical claim:
//!   each ratio moves with the windows (on seed 1's 16 windows 0.916 / 0.941 / 1.074; on four
//!   single windows of sotu, seeds 1000-1003, per-window ratios 0.96-1.86, 1.29 over the
//!   four), and the harness's per-method intervals allow about 0.76-1.30. Fewer windows than
//!   16 are not stable enough to assert 1.1x on.
//!
//! Negative controls ([`garbage_decoders_fail_the_mild_bound`],
//! [`garbage_decoders_fail_the_mail_rope_bound`]): the same measurement and the same
//! [`check`] with the translator's Reuse decoders replaced in memory by random values of the
//! same scale must report a violation, so that the bounds cannot pass vacuously.
//!
//! Time: every figure above comes from one run ([`runs`], through
//! [`eval::evaluate_shared`]) that the tests share: each window's base prefill is done once
//! for every expert, and each expert's oracle once for all its methods; the two negative
//! controls are consumers of their own in the same run, on their first two windows. Before, each test ran the harness on its own (a base prefill per window per
//! expert, and again for the controls: 744 s for this file on the 2-core development VM,
//! 2026-12-07, the largest binary of `make test`; 373 s after, with the dependencies' debug
//! assertions off too: `docs/bench-log/suite.md`).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use scd_models::codec::{codec_with, Codec, CodecOptions, TcRate};
use scd_models::eval::{self, EvalConfig, EvalData, MethodMetrics};
use scd_models::translator::Translator;
use scd_models::{AdapterMode, Llama, LoraAdapter};
use scd_types::{CodeDType, Mode};

/// Prompt and continuation lengths and the seed of E1 (BENCHMARKS.md), so that the windows are
/// E1's first ones.
const PREFIX_TOKENS: usize = 512;
const CONTINUATION_TOKENS: usize = 64;
const SEED: u64 = 0;

/// Windows per expert: see the module comment for why these counts.
const MAIL_ROPE_WINDOWS: usize = 4;
const MILD_WINDOWS: usize = 16;

/// The experts this file loads, in one order (the index of each one's consumer below).
const EXPERTS: [&str; 4] = ["mail-rope", "mail", "sotu", "melville"];

/// The share of raw's bytes the codes are sized for: the rate each translator's table says
/// gives it on the held-out calibration prompts, a little under the bound ([`EIGHTH`]) since
/// these windows are other text and longer prompts.
const AIMED_SHARE: f64 = 0.115;
/// An eighth of raw's bytes: the bound on every expert's payload.
const EIGHTH: f64 = 0.125;

/// A bound on scd against raw transfer.
#[derive(Debug, Clone, Copy)]
struct Bound {
    /// What the bound is for, in messages.
    name: &'static str,
    /// scd's mean KL at most this multiple of raw's.
    max_kl_ratio: f64,
    /// scd's mean KL at most this.
    max_kl: f64,
    /// scd's payload at most this share of raw's.
    max_bytes_share: f64,
}

/// mail-rope, where raw transfer breaks, int8 codes at the default ranks: scd at most half of
/// raw's KL.
const BREAKS_RAW: Bound = Bound {
    name: "an expert raw transfer breaks (int8 codes: scd KL <= 0.5x raw's, < 40% of its bytes)",
    max_kl_ratio: 0.5,
    max_kl: f64::INFINITY,
    max_bytes_share: 0.40,
};

/// The mild experts, int8 codes at the default ranks: scd at most 1.1x raw's KL at under 40%
/// of its bytes.
const MILD: Bound = Bound {
    name: "a mild expert (int8 codes: scd KL <= 1.1x raw's, < 40% of its bytes)",
    max_kl_ratio: 1.1,
    max_kl: f64::INFINITY,
    max_bytes_share: 0.40,
};

/// mail-rope, transform-coded: scd KL at most 0.25 and half of raw's, at an eighth
/// of raw's bytes (E6 on 4 windows: 0.153, 0.14x raw's; the aim, 0.10, is reached
/// only at 20% of raw's bytes).
const BREAKS_RAW_EIGHTH: Bound = Bound {
    name: "an expert raw transfer breaks (tc codes: scd KL <= 0.25 and <= 0.5x raw's, at <= 12.5% of its \
           bytes)",
    max_kl_ratio: 0.5,
    max_kl: 0.25,
    max_bytes_share: EIGHTH,
};

/// The mild experts, transform-coded: scd within 3x raw's KL at an eighth of its bytes (E6 on 4 windows: mail
/// 1.10x, sotu 2.12x, melville 1.95x; the aim, 1.1x, is not reached at this size).
const MILD_EIGHTH: Bound = Bound {
    name: "a mild expert (tc codes: scd KL <= 3x raw's, at <= 12.5% of its bytes)",
    max_kl_ratio: 3.0,
    max_kl: f64::INFINITY,
    max_bytes_share: EIGHTH,
};

/// What the harness measured for one expert and translator.
struct Quality {
    expert: String,
    windows: usize,
    raw: MethodMetrics,
    scd: MethodMetrics,
    seconds: f64,
}

impl Quality {
    fn kl_ratio(&self) -> f64 {
        self.scd.kl.value / self.raw.kl.value
    }

    fn bytes_share(&self) -> f64 {
        self.scd.payload_bytes / self.raw.payload_bytes
    }

    /// The figures, with each KL's bootstrap 95% interval over the windows and the range of
    /// the ratio those intervals allow (the harness resamples each method on its own, so this
    /// range is wider than a paired interval would be).
    fn describe(&self) -> String {
        let (r, s) = (&self.raw.kl, &self.scd.kl);
        format!(
            "{}: {} WikiText-2 windows of {PREFIX_TOKENS} + {CONTINUATION_TOKENS} tokens: \
             KL raw {:.4} [{:.4}, {:.4}], scd {:.4} [{:.4}, {:.4}]; scd/raw {:.3} (intervals \
             allow {:.3}-{:.3}); scd bytes {:.1}% of raw's ({:.0} / {:.0} per prompt); {:.1} s",
            self.expert,
            self.windows,
            r.value,
            r.low,
            r.high,
            s.value,
            s.low,
            s.high,
            self.kl_ratio(),
            s.low / r.high,
            s.high / r.low,
            100.0 * self.bytes_share(),
            self.scd.payload_bytes,
            self.raw.payload_bytes,
            self.seconds,
        )
    }
}

/// The quality check: `Err` names each violated part of `bound`, with the figures. Written so
/// that a NaN anywhere is a violation.
fn check(q: &Quality, bound: &Bound) -> Result<(), String> {
    let mut violations = Vec::new();
    let raw = q.raw.kl.value;
    if !(raw.is_finite() && raw > 0.0) {
        violations.push(format!("raw KL {raw} is not a positive number"));
    }
    if q.kl_ratio().is_nan() || q.kl_ratio() > bound.max_kl_ratio {
        violations.push(format!(
            "scd KL is {:.3}x raw's, the bound is {}x",
            q.kl_ratio(),
            bound.max_kl_ratio
        ));
    }
    if q.scd.kl.value.is_nan() || q.scd.kl.value > bound.max_kl {
        violations.push(format!(
            "scd KL is {:.4}, the bound is {}",
            q.scd.kl.value, bound.max_kl
        ));
    }
    if q.bytes_share().is_nan() || q.bytes_share() > bound.max_bytes_share {
        violations.push(format!(
            "scd sends {:.1}% of raw's bytes, the bound is {:.1}%",
            100.0 * q.bytes_share(),
            100.0 * bound.max_bytes_share
        ));
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} violates the bound for {}: {}",
            q.expert,
            bound.name,
            violations.join("; ")
        ))
    }
}

fn expert_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../experts")
        .join(name)
}

fn data() -> &'static EvalData {
    static D: OnceLock<EvalData> = OnceLock::new();
    D.get_or_init(|| {
        let dir = common::eval_data_dir();
        EvalData::load(&dir).unwrap_or_else(|e| {
            panic!(
                "cannot read the evaluation data under {}: {e} (run `make data`, or set \
                 SCD_EVAL_DATA to the folder holding wikitext-2/ and squad/)",
                dir.display()
            )
        })
    })
}

/// The expert `name` as `scd eval` builds it: the base with the shipped adapter merged.
fn consumer(name: &str) -> &'static Llama {
    static CONSUMERS: [OnceLock<Llama>; EXPERTS.len()] = [const { OnceLock::new() }; 4];
    let i = EXPERTS
        .iter()
        .position(|&e| e == name)
        .unwrap_or_else(|| panic!("{name} is not one of {EXPERTS:?}"));
    CONSUMERS[i].get_or_init(|| {
        let (base, _) = common::real();
        let path = expert_dir(name).join("adapter.safetensors");
        let adapter = LoraAdapter::load(&path, base.config())
            .unwrap_or_else(|e| panic!("cannot load the shipped adapter {}: {e}", path.display()));
        base.with_adapter(&adapter, AdapterMode::Merge)
            .unwrap_or_else(|e| panic!("cannot apply {}: {e}", path.display()))
    })
}

/// The shipped translator of `name`.
fn translator(name: &str) -> Translator {
    let dir = expert_dir(name).join("translator");
    Translator::load(&dir)
        .unwrap_or_else(|e| panic!("cannot load the shipped translator {}: {e}", dir.display()))
}

/// What the run gives for one translator: a [`Quality`] for each of scd's codes, and kvtc at
/// the same share of raw.
struct Measured {
    int8: Quality,
    tc: Quality,
    kvtc: MethodMetrics,
}

/// What the run gives for one expert: its shipped translator measured, and, for the experts
/// of the negative controls, the same translator with garbage decoders.
struct ExpertRun {
    shipped: Measured,
    garbage: Option<Measured>,
}

/// The experts the negative controls garble, one mild and the one raw transfer breaks.
const CONTROLLED: [&str; 2] = ["melville", "mail-rope"];
/// The negative controls are far off; two windows show it.
const CONTROL_WINDOWS: usize = 2;

/// An expert's codecs for one translator: raw and scd as E1 (int8 codes), and scd
/// transform-coded and kvtc (raw KV coded by the same coder in the base's own basis) each at
/// the rate the translator's table gives for [`AIMED_SHARE`].
fn codecs_for(expert: &str, translator: &Arc<Translator>, index: usize) -> Vec<Box<dyn Codec>> {
    // The rate the translator's own table (measured on its held-out calibration prompts, not
    // on these windows) says gives the share of raw's bytes aimed at.
    let step_of = |mode: Mode| {
        translator
            .manifest
            .rate_table
            .as_ref()
            .and_then(|t| t.step_for_share(mode, index, AIMED_SHARE))
            .unwrap_or_else(|| {
                panic!(
                    "{expert}'s translator has no {mode} rates reaching {:.1}% of raw's bytes \
                     (scd translators rates, scd translators kvtc)",
                    100.0 * AIMED_SHARE
                )
            })
    };
    let int8 = CodecOptions {
        code_dtype: CodeDType::I8_ROWS,
        ..CodecOptions::default()
    };
    let tc = |step| CodecOptions {
        code_dtype: CodeDType::TC,
        tc_rate: TcRate { step },
        ..CodecOptions::default()
    };
    let with = |mode, options: &CodecOptions| {
        codec_with(mode, Some((translator, index)), options)
            .unwrap_or_else(|e| panic!("{expert}: {mode} codec: {e}"))
    };
    vec![
        codec_with(Mode::Raw, None, &int8).unwrap(),
        with(Mode::Scd, &int8),
        with(Mode::Scd, &tc(step_of(Mode::Scd))),
        with(Mode::Kvtc, &tc(step_of(Mode::Kvtc))),
    ]
}

/// Every expert's figures, measured once for all the tests of this file with the model work
/// shared ([`eval::evaluate_shared`]): one base prefill per window for every expert and
/// control, each expert's oracle once for all its methods. A panic while measuring becomes
/// every test's failure, not a second run.
fn runs() -> &'static Result<Vec<(String, ExpertRun)>, String> {
    static RUNS: OnceLock<Result<Vec<(String, ExpertRun)>, String>> = OnceLock::new();
    RUNS.get_or_init(|| {
        std::panic::catch_unwind(measure_all).map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "measuring panicked".into())
        })
    })
}

/// The run of `expert`; panics with the measurement's failure.
fn run(expert: &str) -> &'static ExpertRun {
    match runs() {
        Ok(runs) => &runs.iter().find(|(e, _)| e == expert).expect("measured").1,
        Err(e) => panic!("measuring the translators failed: {e}"),
    }
}

fn measure_all() -> Vec<(String, ExpertRun)> {
    let t0 = Instant::now();
    let (base, tok) = common::real();
    // The run's consumers: each expert with its shipped translator, then each control's expert
    // with its garbled one: (expert, garbled, windows).
    let plan: Vec<(&str, bool, usize)> = EXPERTS
        .iter()
        .map(|&e| match e {
            "mail-rope" => (e, false, MAIL_ROPE_WINDOWS),
            _ => (e, false, MILD_WINDOWS),
        })
        .chain(CONTROLLED.iter().map(|&e| (e, true, CONTROL_WINDOWS)))
        .collect();
    let codecs: Vec<Vec<Box<dyn Codec>>> = plan
        .iter()
        .map(|&(expert, garbled, _)| {
            let t = match garbled {
                false => translator(expert),
                true => garbage_translator(expert),
            };
            let index = t
                .check_pair(base, consumer(expert))
                .unwrap_or_else(|e| panic!("{expert}'s translator does not fit the pair: {e}"));
            codecs_for(expert, &Arc::new(t), index)
        })
        .collect();
    let refs: Vec<Vec<&dyn Codec>> = codecs
        .iter()
        .map(|c| c.iter().map(|c| c.as_ref()).collect())
        .collect();
    let consumers: Vec<eval::Consumer> = plan
        .iter()
        .zip(&refs)
        .map(|(&(expert, _, windows), codecs)| eval::Consumer {
            model: consumer(expert),
            codecs,
            adapter: None,
            windows,
        })
        .collect();
    let cfg = EvalConfig {
        seed: SEED,
        wikitext_windows: MILD_WINDOWS.max(MAIL_ROPE_WINDOWS),
        prefix_tokens: PREFIX_TOKENS,
        continuation_tokens: CONTINUATION_TOKENS,
        greedy_tokens: 0,
        squad_questions: 0,
        ..EvalConfig::default()
    };
    let records = eval::evaluate_shared(base, &consumers, tok, data(), &cfg, |_| {})
        .unwrap_or_else(|e| panic!("evaluating: {e}"));
    let seconds = t0.elapsed().as_secs_f64();
    let mut measured: Vec<Measured> = plan
        .iter()
        .zip(records)
        .map(|(&(expert, garbled, n), record)| {
            let what = match garbled {
                false => "shipped translator",
                true => "garbage decoders",
            };
            let [raw, scd, scd_tc, kvtc] = <[MethodMetrics; 4]>::try_from(record.results)
                .unwrap_or_else(|_| panic!("{expert}: four methods"));
            assert_eq!(
                (raw.method, scd.method, scd_tc.method, kvtc.method),
                (Mode::Raw, Mode::Scd, Mode::Scd, Mode::Kvtc)
            );
            assert_eq!(raw.kl.n, n, "{expert}: windows scored");
            let (tc_variant, kvtc_variant) = (scd_tc.variant.clone(), kvtc.variant.clone());
            let q = |scd: MethodMetrics, codes: &str| Quality {
                expert: format!("{expert} ({what}, {codes})"),
                windows: n,
                raw: raw.clone(),
                scd,
                seconds,
            };
            let m = Measured {
                int8: q(scd, "int8 codes"),
                tc: q(scd_tc, &format!("tc codes, {tc_variant}")),
                kvtc,
            };
            for q in [&m.int8, &m.tc] {
                eprintln!("{}", q.describe());
            }
            eprintln!(
                "{expert} ({what}): kvtc {kvtc_variant}: KL {:.4} [{:.4}, {:.4}], {:.1}% of raw's \
                 bytes",
                m.kvtc.kl.value,
                m.kvtc.kl.low,
                m.kvtc.kl.high,
                100.0 * m.kvtc.payload_bytes / m.tc.raw.payload_bytes
            );
            m
        })
        .collect();
    let mut controls: Vec<Option<Measured>> = measured
        .split_off(EXPERTS.len())
        .into_iter()
        .map(Some)
        .collect();
    EXPERTS
        .iter()
        .zip(measured)
        .map(|(&expert, shipped)| {
            let garbage = CONTROLLED
                .iter()
                .position(|&c| c == expert)
                .and_then(|i| controls[i].take());
            (expert.to_owned(), ExpertRun { shipped, garbage })
        })
        .collect()
}

/// Transform-coded scd against kvtc at about the same bytes: scd's KL at most kvtc's, with
/// at most 5% more bytes (each sized by its own rate table for the same share). Written so
/// that a NaN is a violation.
fn check_against_kvtc(q: &Quality, kvtc: &MethodMetrics) -> Result<(), String> {
    let mut violations = Vec::new();
    let (scd, base) = (q.scd.kl.value, kvtc.kl.value);
    if scd.is_nan() || base.is_nan() || scd > base {
        violations.push(format!("scd KL {scd:.4} is above kvtc's {base:.4}"));
    }
    let ratio = q.scd.payload_bytes / kvtc.payload_bytes;
    if ratio.is_nan() || ratio > 1.05 {
        violations.push(format!(
            "scd sends {ratio:.3}x kvtc's bytes, the bound is 1.05x"
        ));
    }
    match violations.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "{} does not beat kvtc at like bytes: {}",
            q.expert,
            violations.join("; ")
        )),
    }
}

/// Both of `expert`'s operating points meet their bounds: int8 codes `int8`, transform-coded
/// ones `eighth`; and the transform-coded ones beat kvtc at like bytes.
fn assert_meets(expert: &str, int8: &Bound, eighth: &Bound) {
    let m = &run(expert).shipped;
    let mut failures: Vec<String> = [(&m.int8, int8), (&m.tc, eighth)]
        .iter()
        .filter_map(|(q, b)| {
            check(q, b)
                .err()
                .map(|v| format!("{v}\n  measured: {}", q.describe()))
        })
        .collect();
    failures.extend(check_against_kvtc(&m.tc, &m.kvtc).err());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn mail_rope_scd_keeps_under_half_of_raw_transfers_kl() {
    assert_meets("mail-rope", &BREAKS_RAW, &BREAKS_RAW_EIGHTH);
}

#[test]
fn mail_scd_stays_within_the_mild_bound() {
    assert_meets("mail", &MILD, &MILD_EIGHTH);
}

#[test]
fn sotu_scd_stays_within_the_mild_bound() {
    assert_meets("sotu", &MILD, &MILD_EIGHTH);
}

#[test]
fn melville_scd_stays_within_the_mild_bound() {
    assert_meets("melville", &MILD, &MILD_EIGHTH);
}

/// `name`'s shipped translator with the Reuse decoders of K and V on every layer replaced by
/// uniform noise of the same RMS (a seeded draw): a translator rebuilt into garbage that still
/// loads, fits the pair and sends the same bytes.
fn garbage_translator(name: &str) -> Translator {
    let mut t = translator(name);
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let mut noise = |d: &Tensor| -> Tensor {
        let rms = d
            .sqr()
            .and_then(|s| s.mean_all())
            .and_then(|m| m.to_scalar::<f32>())
            .unwrap()
            .sqrt();
        // Uniform on [-a, a] has RMS a / sqrt(3).
        let a = rms * 3f32.sqrt();
        let v: Vec<f32> = (0..d.elem_count()).map(|_| rng.gen_range(-a..=a)).collect();
        Tensor::from_vec(v, d.dims(), d.device()).unwrap()
    };
    for layer in &mut t.layers {
        for code in [&mut layer.k, &mut layer.v] {
            for d in &mut code.decs {
                *d = noise(d);
            }
        }
    }
    t
}

fn assert_rejected(expert: &str, int8: &Bound, eighth: &Bound) {
    let m = run(expert)
        .garbage
        .as_ref()
        .unwrap_or_else(|| panic!("{expert} has no control in {CONTROLLED:?}"));
    let kvtc = check_against_kvtc(&m.tc, &m.kvtc);
    assert!(
        kvtc.is_err(),
        "random decoders beat kvtc: {}",
        m.tc.describe()
    );
    for (q, bound) in [(&m.int8, int8), (&m.tc, eighth)] {
        match check(q, bound) {
            Err(violation) => {
                assert!(violation.contains("x raw's"), "{violation}");
                eprintln!("rejected, as it should be: {violation}");
            }
            Ok(()) => panic!(
                "the quality check passed a translator with random decoders, so it cannot \
                 tell a good translator from garbage: {}",
                q.describe()
            ),
        }
    }
}

#[test]
fn garbage_decoders_fail_the_mild_bound() {
    assert_rejected("melville", &MILD, &MILD_EIGHTH);
}

#[test]
fn garbage_decoders_fail_the_mail_rope_bound() {
    assert_rejected("mail-rope", &BREAKS_RAW, &BREAKS_RAW_EIGHTH);
}

#[test]
fn the_windows_are_held_out_from_calibration() {
    // Calibration read the Brown corpus; the windows are WikiText-2.
    assert_eq!(data().text_name, eval::data::WIKITEXT);
    for name in EXPERTS {
        let cal = translator(name).manifest.calibration;
        assert_eq!(cal.corpus, "brown", "{name}: calibrated on {}", cal.corpus);
        assert_ne!(
            cal.text_sha256,
            data().text_file.sha256,
            "{name}: calibrated on the evaluation text"
        );
    }
}
