//! SCD translators on a tiny random llama and a drifted copy of it: calibration end to end,
//! the artifact's round trip and the checks a loader makes, and the reuse / scd / droidspeak /
//! q4 codecs over it, including a joint translator whose one code stream serves two experts.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use candle_core::{Device, Tensor};
use common::tiny_model;
use rand::{Rng, SeedableRng};
use scd_models::codec::{self, codec_with, CodecError, CodecOptions, Prefix};
use scd_models::translator::calibrate::{CalibrationText, ChatWrap};
use scd_models::translator::select::HeldOutPrompt;
use scd_models::translator::{
    calibrate, rank_curve, AlignerConfig, CalibrationConfig, LinkEstimate, PatchChoice, RankPolicy,
    Ranks, Translator, TranslatorError, WeightsDtype,
};
use scd_models::{AdapterMode, Input, LayerCapture, Llama, LogitsWanted, LoraAdapter, Proj};
use scd_types::{CodeDType, CodeKind, Mode};

struct Fixture {
    _dir: tempfile::TempDir,
    base: Llama,
    experts: Vec<Llama>,
    tokens: Vec<u32>,
}

/// The tiny base and two experts: the base with random adapters on every projection.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let (dir, base) = tiny_model(3);
        let cfg = base.config().clone();
        let experts = (0..2)
            .map(|seed| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(100 + seed);
                let mut parts = BTreeMap::new();
                for layer in 0..cfg.num_layers {
                    for proj in Proj::ALL {
                        let (out, inp) = proj.shape(&cfg);
                        let mut mk = |n: usize| -> Vec<f32> {
                            (0..n).map(|_| rng.gen_range(-0.3..0.3)).collect()
                        };
                        let a = Tensor::from_vec(mk(4 * inp), (4, inp), &Device::Cpu).unwrap();
                        let b = Tensor::from_vec(mk(out * 4), (out, 4), &Device::Cpu).unwrap();
                        parts.insert((layer, proj), (a, b));
                    }
                }
                let adapter = LoraAdapter::from_parts(&cfg, 4, 4.0, parts).unwrap();
                base.with_adapter(&adapter, AdapterMode::Merge).unwrap()
            })
            .collect();
        // A token stream with structure (a repeated random phrase with noise), so models
        // produce something better than noise to calibrate on.
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let phrase: Vec<u32> = (0..11).map(|_| rng.gen_range(0..64)).collect();
        let tokens = (0..4000)
            .map(|i| {
                if rng.gen_bool(0.3) {
                    rng.gen_range(0..64)
                } else {
                    phrase[i % 11]
                }
            })
            .collect();
        Fixture {
            _dir: dir,
            base,
            experts,
            tokens,
        }
    })
}

fn config() -> CalibrationConfig {
    let kv = fixture().base.config().kv_dim();
    CalibrationConfig {
        prefixes: 40,
        heldout: 4,
        prefix_tokens: 24,
        heldout_prefix_tokens: 20,
        heldout_continuation: 6,
        r_max: Ranks {
            k: kv,
            v: kv,
            h: 24,
        },
        default_ranks: Ranks {
            k: kv,
            v: kv,
            h: 16,
        },
        aligner: AlignerConfig {
            hidden: 32,
            epochs: 8,
            batch: 64,
            ..AlignerConfig::default()
        },
        aligner_rows: 600,
        patch: PatchChoice::Fixed(1),
        droidspeak_block: 1,
        droidspeak_blocks: 1,
        ..CalibrationConfig::for_model(kv)
    }
}

fn calibrated(consumers: &[usize]) -> Translator {
    let f = fixture();
    let names = ["alpha", "beta"];
    let consumers: Vec<(&str, &Llama)> = consumers
        .iter()
        .map(|&i| (names[i], &f.experts[i]))
        .collect();
    let text = CalibrationText {
        corpus: "synthetic",
        split: "all",
        sha256: "00",
        tokens: &f.tokens,
    };
    calibrate(&f.base, &consumers, &text, &config(), |_| {}).unwrap()
}

fn pair_translator() -> &'static Translator {
    static T: OnceLock<Translator> = OnceLock::new();
    T.get_or_init(|| calibrated(&[0]))
}

/// The base's captures of `prefix`: what `codec`'s producer encodes.
fn captured(codec: &dyn codec::Codec, prefix: &[u32]) -> Vec<LayerCapture> {
    let capture = codec.capture().expect("a codec that sends codes");
    let input = Input::new(prefix).capture(capture);
    let out = fixture().base.forward(input.logits(LogitsWanted::None));
    out.unwrap().captured
}

fn held_out_kl(codec: &dyn codec::Codec, consumer: &Llama) -> f64 {
    let f = fixture();
    let mut total = 0.0;
    for start in [3000usize, 3200, 3400, 3600] {
        let prompt = HeldOutPrompt::new(consumer, &f.tokens[start..start + 27], 6).unwrap();
        let codes = match codec.capture() {
            Some(_) => codec::encode(codec, &captured(codec, &prompt.prefix)).unwrap(),
            None => Vec::new(),
        };
        let cache = codec::decode(codec, consumer, &codes, Prefix::new(&prompt.prefix)).unwrap();
        total += prompt.kl(consumer, cache).unwrap();
    }
    total / 4.0
}

#[test]
fn calibration_records_its_choices_and_reuse_beats_raw_transfer() {
    let t = pair_translator();
    let m = &t.manifest;
    assert_eq!(m.consumers.len(), 1);
    assert_eq!(m.patch_layers.len(), 1);
    assert_eq!(m.droidspeak_blocks.len(), 1);
    assert_eq!(m.calibration.prefixes, 40);
    assert!(m.metrics["patch_curve"].as_array().unwrap().len() == 2);
    assert_eq!(
        m.metrics["centring_ridge_sweep"].as_array().unwrap().len(),
        8
    );
    let (kl_raw, kl_reuse) = (
        m.metrics["kl_raw"].as_f64().unwrap(),
        m.metrics["kl_reuse"].as_f64().unwrap(),
    );
    assert!(
        kl_raw > 0.0 && kl_reuse < kl_raw,
        "held-out KL raw {kl_raw}, reuse {kl_reuse}"
    );

    // The same holds through the codecs, on prompts calibration never saw.
    let f = fixture();
    let arc = Arc::new(t.clone());
    let opts = CodecOptions::default();
    let raw = codec_with(Mode::Raw, None, &opts).unwrap();
    let reuse = codec_with(Mode::Reuse, Some((&arc, 0)), &opts).unwrap();
    let scd = codec_with(Mode::Scd, Some((&arc, 0)), &opts).unwrap();
    let (r, u, s) = (
        held_out_kl(raw.as_ref(), &f.experts[0]),
        held_out_kl(reuse.as_ref(), &f.experts[0]),
        held_out_kl(scd.as_ref(), &f.experts[0]),
    );
    assert!(u < r, "reuse {u} vs raw {r}");
    assert!(s.is_finite() && s < r, "scd {s} vs raw {r}");
}

#[test]
fn codes_have_the_requested_ranks_and_dtype_and_rebuild_every_layer() {
    let f = fixture();
    let t = Arc::new(pair_translator().clone());
    let cfg = f.base.config();
    let patch_layer = t.manifest.patch_layers[0];
    let prefix = &f.tokens[100..120];
    for (dtype, bytes_per_value, row_extra) in [(CodeDType::F16, 2, 0), (CodeDType::I8_ROWS, 1, 4)]
    {
        let opts = CodecOptions {
            ranks: Some(Ranks { k: 5, v: 9, h: 7 }),
            code_dtype: dtype,
            ..CodecOptions::default()
        };
        let scd = codec_with(Mode::Scd, Some((&t, 0)), &opts).unwrap();
        let caps = captured(scd.as_ref(), prefix);
        let codes = codec::encode(scd.as_ref(), &caps).unwrap();
        let mut expected = 0;
        for l in 0..cfg.num_layers {
            let kinds: Vec<(CodeKind, u32)> = codes
                .iter()
                .filter(|c| c.layer as usize == l)
                .map(|c| (c.kind, c.shape[1]))
                .collect();
            if l == patch_layer {
                assert_eq!(kinds, vec![(CodeKind::PATCH_H, 7)]);
                expected += 20 * (7 * bytes_per_value + row_extra);
            } else {
                assert_eq!(kinds, vec![(CodeKind::REUSE_K, 5), (CodeKind::REUSE_V, 9)]);
                expected += 20 * (14 * bytes_per_value + 2 * row_extra);
            }
        }
        assert!(codes.iter().all(|c| c.dtype == dtype && c.is_consistent()));
        assert_eq!(codec::payload_bytes(&codes), expected);
        let priced =
            codec::Translated::new(t.clone(), Mode::Scd, 0, opts.ranks.unwrap(), dtype, None)
                .unwrap()
                .payload_bytes(20);
        assert_eq!(priced, expected as u64, "bytes known before encoding");
        let cache =
            codec::decode(scd.as_ref(), &f.experts[0], &codes, Prefix::new(prefix)).unwrap();
        assert_eq!(cache.len(), 20);
        assert_eq!(cache.next_position(), 20);
        // A whole payload (its layers rebuilt in parallel) gives the cache that codes taken
        // one at a time, as they arrive, give.
        let mut one_by_one = scd.decoder(&f.experts[0], Prefix::new(prefix)).unwrap();
        for c in &codes {
            one_by_one.push(c).unwrap();
        }
        let one_by_one = one_by_one.finish().unwrap();
        for l in 0..cfg.num_layers {
            let (Some((k1, v1)), Some((k2, v2))) =
                (cache.layer(l).unwrap(), one_by_one.layer(l).unwrap())
            else {
                panic!("layer {l} missing");
            };
            for (a, b) in [(k1, k2), (v1, v2)] {
                let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(values(a), values(b), "layer {l}");
            }
        }
        // A code twice in one batch is refused as it is one push after another.
        let mut twice = scd.decoder(&f.experts[0], Prefix::new(prefix)).unwrap();
        let err = twice
            .push_many(&[codes[0].clone(), codes[0].clone()])
            .unwrap_err();
        assert!(matches!(err, CodecError::Duplicate { .. }), "{err}");
        // A code for a layer the consumer does not have.
        let mut far = codes.clone();
        far[1].layer = 99;
        let err =
            codec::decode(scd.as_ref(), &f.experts[0], &far, Prefix::new(prefix)).unwrap_err();
        assert!(
            matches!(err, CodecError::LayerOutOfRange { layer: 99, .. }),
            "{err}"
        );
        // A Patch budget of 0 sends Reuse codes everywhere; the consumer takes them.
        let none = codec_with(
            Mode::Scd,
            Some((&t, 0)),
            &CodecOptions {
                patch_k: Some(0),
                ..opts
            },
        )
        .unwrap();
        let reuse_codes = codec::encode(none.as_ref(), &caps).unwrap();
        assert!(reuse_codes.iter().all(|c| c.kind != CodeKind::PATCH_H));
        codec::decode(
            scd.as_ref(),
            &f.experts[0],
            &reuse_codes,
            Prefix::new(prefix),
        )
        .unwrap();
        assert!(codec_with(
            Mode::Scd,
            Some((&t, 0)),
            &CodecOptions {
                patch_k: Some(9),
                ..opts
            }
        )
        .is_err());
        // Fewer codes than layers is an incomplete payload, not a cache.
        let err = codec::decode(
            scd.as_ref(),
            &f.experts[0],
            &codes[..codes.len() - 1],
            Prefix::new(prefix),
        )
        .unwrap_err();
        assert!(matches!(err, CodecError::Missing { .. }), "{err}");
    }
}

/// Calibration measures every grid point of both modes; the choice for a link takes the
/// cheapest code under the ceiling on a slow link and the best one on a fast link, never one
/// over the ceiling, and none when nothing meets it.
#[test]
fn the_rank_curve_prices_every_choice_and_the_link_decides_which() {
    let t = Arc::new(pair_translator().clone());
    let m = &t.manifest;
    let curve = m
        .rank_curve
        .as_ref()
        .expect("calibration measures the curve");
    let grid = rank_curve::default_grid(m.r_max);
    assert_eq!(curve.points.len(), 2 * grid.len());
    assert_eq!((curve.prompts, curve.code_dtype.as_str()), (4, "f16"));
    for mode in [Mode::Reuse, Mode::Scd] {
        let pts: Vec<_> = curve.points.iter().filter(|p| p.mode == mode).collect();
        assert_eq!(pts.len(), grid.len());
        assert!(pts
            .iter()
            .all(|p| p.kl.len() == 1 && p.kl[0].is_finite() && p.kl[0] >= 0.0));
        // Nested codes: all of r_max rebuilds better than an eighth of it.
        let (low, full) = (pts[0], pts[pts.len() - 1]);
        assert_eq!((full.ranks.k, full.ranks.v), (m.r_max.k, m.r_max.v));
        assert!(full.kl[0] < low.kl[0], "{mode}: {full:?} vs {low:?}");
    }
    let rows = 20;
    let priced = |p: &rank_curve::RankPoint| {
        codec::Translated::new(t.clone(), p.mode, 0, p.ranks, CodeDType::F16, None)
            .unwrap()
            .payload_bytes(rows)
    };
    let mut kls: Vec<f64> = curve
        .points
        .iter()
        .filter(|p| p.mode == Mode::Reuse)
        .map(|p| p.kl[0])
        .collect();
    kls.sort_by(f64::total_cmp);
    let policy = RankPolicy {
        kl_ceiling: kls[kls.len() / 2],
        slack: 0.05,
    };
    let feasible: Vec<_> = curve
        .points
        .iter()
        .filter(|p| p.mode == Mode::Reuse && p.kl[0] <= policy.kl_ceiling)
        .collect();
    let pick = |bytes_per_sec, prefill_secs, policy: &RankPolicy| {
        let link = LinkEstimate {
            bytes_per_sec,
            prefill_secs,
        };
        rank_curve::choose(&t, 0, Mode::Reuse, rows, CodeDType::F16, &link, policy)
    };
    let slow = pick(1e3, 0.0, &policy).unwrap();
    let cheapest = feasible.iter().map(|p| priced(p)).min().unwrap();
    assert_eq!(slow.payload_bytes, cheapest);
    assert!(slow.kl <= policy.kl_ceiling);
    let fast = pick(1e15, 1.0, &policy).unwrap();
    let best = feasible
        .iter()
        .map(|p| p.kl[0])
        .min_by(f64::total_cmp)
        .unwrap();
    assert_eq!(fast.kl, best);
    assert!(
        fast.payload_bytes > slow.payload_bytes,
        "{fast:?} vs {slow:?}"
    );
    let strict = RankPolicy {
        kl_ceiling: kls[0] / 2.0,
        ..policy
    };
    assert_eq!(pick(1e3, 0.0, &strict), None);
}

#[test]
fn the_artifact_round_trips_and_refuses_damage_and_other_pairs() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let mut t = pair_translator().clone();
    let hash = t.save(dir.path()).unwrap();
    let back = Translator::load(dir.path()).unwrap();
    assert_eq!(back.hash(), hash);
    // JSON keeps every field; floats in the metrics and the rank curve may move by an ulp.
    let without_metrics = |m: &scd_models::translator::TranslatorManifest| {
        let mut m = m.clone();
        m.metrics = serde_json::Value::Null;
        for p in m.rank_curve.iter_mut().flat_map(|c| c.points.iter_mut()) {
            p.kl = p.kl.iter().map(|&k| (k as f32) as f64).collect();
        }
        m
    };
    assert_eq!(
        without_metrics(&back.manifest),
        without_metrics(&t.manifest)
    );
    assert_eq!(back.check_pair(&f.base, &f.experts[0]).unwrap(), 0);
    // Another consumer, or producer and consumer swapped: refused, naming the models.
    let err = back.check_pair(&f.base, &f.experts[1]).unwrap_err();
    assert!(
        matches!(err, TranslatorError::WrongPair(_)) && err.to_string().contains("alpha"),
        "{err}"
    );
    assert!(matches!(
        back.check_pair(&f.experts[0], &f.experts[0]),
        Err(TranslatorError::WrongPair(_))
    ));
    // The codes of the loaded translator equal the in-memory one's.
    let prefix = &f.tokens[10..30];
    let opts = CodecOptions::default();
    let (a, b) = (Arc::new(t), Arc::new(back));
    let scd_a = codec_with(Mode::Scd, Some((&a, 0)), &opts).unwrap();
    let caps = captured(scd_a.as_ref(), prefix);
    let ca = codec::encode(scd_a.as_ref(), &caps).unwrap();
    let cb = codec::encode(
        codec_with(Mode::Scd, Some((&b, 0)), &opts)
            .unwrap()
            .as_ref(),
        &caps,
    )
    .unwrap();
    assert_eq!(ca, cb);

    // Ranks above r_max.
    let too_high = CodecOptions {
        ranks: Some(Ranks { k: 999, v: 4, h: 4 }),
        ..opts
    };
    assert!(codec_with(Mode::Scd, Some((&b, 0)), &too_high).is_err());
    // The manifest is part of the content hash: a label changed by hand fails it, and the
    // file as saved loads again.
    let manifest = dir.path().join("translator.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let label = format!("\"version\": {}", serde_json::json!(b.manifest.version));
    assert!(text.contains(&label), "{text}");
    std::fs::write(
        &manifest,
        text.replacen(&label, "\"version\": \"other\"", 1),
    )
    .unwrap();
    let err = Translator::load(dir.path()).unwrap_err();
    assert!(
        matches!(err, TranslatorError::Corrupt(_)) && err.to_string().contains("hash"),
        "{err}"
    );
    std::fs::write(&manifest, &text).unwrap();
    assert_eq!(Translator::load(dir.path()).unwrap().hash(), hash);
    // A flipped byte in the weights, a truncated file, a missing manifest.
    let weights = dir.path().join("translator.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0xff;
    std::fs::write(&weights, &bytes).unwrap();
    assert!(matches!(
        Translator::load(dir.path()),
        Err(TranslatorError::Corrupt(_))
    ));
    std::fs::write(&weights, &bytes[..n / 3]).unwrap();
    assert!(matches!(
        Translator::load(dir.path()),
        Err(TranslatorError::Corrupt(_))
    ));
    std::fs::remove_file(dir.path().join("translator.json")).unwrap();
    assert!(matches!(
        Translator::load(dir.path()),
        Err(TranslatorError::Io { .. })
    ));
}

/// bf16 storage: half the bytes, every weight within bf16's rounding of the f32 one, the saved
/// translator computes what its loaded copy computes, and the held-out KL of its rebuilt caches
/// stays where the f32 translator's is.
#[test]
fn weights_in_bf16_round_trip_within_their_precision() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let mut full = pair_translator().clone();
    full.save(&dir.path().join("f32")).unwrap();
    let mut half = pair_translator().clone();
    half.manifest.weights_dtype = WeightsDtype::Bf16;
    let hash = half.save(&dir.path().join("bf16")).unwrap();
    let size = |d: &str| {
        std::fs::metadata(dir.path().join(d).join("translator.safetensors"))
            .unwrap()
            .len() as f64
    };
    let ratio = size("bf16") / size("f32");
    assert!((0.45..0.55).contains(&ratio), "bf16 file is {ratio} of f32");
    let back = Translator::load(&dir.path().join("bf16")).unwrap();
    assert_eq!(back.hash(), hash);
    assert_eq!(back.manifest.weights_dtype, WeightsDtype::Bf16);
    let (a, b) = (&full.layers[1].v.decs[0], &back.layers[1].v.decs[0]);
    let (scale, diff) = (common::max_abs(a), common::max_abs_diff(a, b));
    assert!(diff > 0.0 && diff <= scale / 256.0, "{diff} of {scale}");
    // The in-memory translator took the stored weights back: same codes as the loaded one.
    let opts = CodecOptions::default();
    let (h, l) = (Arc::new(half), Arc::new(back));
    let ch = codec_with(Mode::Scd, Some((&h, 0)), &opts).unwrap();
    let cl = codec_with(Mode::Scd, Some((&l, 0)), &opts).unwrap();
    let kl_half = held_out_kl(ch.as_ref(), &f.experts[0]);
    assert_eq!(kl_half, held_out_kl(cl.as_ref(), &f.experts[0]));
    let full = Arc::new(full);
    let cf = codec_with(Mode::Scd, Some((&full, 0)), &opts).unwrap();
    let kl_full = held_out_kl(cf.as_ref(), &f.experts[0]);
    assert!(
        (kl_half - kl_full).abs() <= 0.05 * kl_full + 1e-6,
        "KL bf16 {kl_half} vs f32 {kl_full}"
    );
}

#[test]
fn a_joint_translator_serves_two_experts_from_one_code_stream() {
    let f = fixture();
    let joint = Arc::new(calibrated(&[0, 1]));
    assert_eq!(joint.manifest.consumers.len(), 2);
    let opts = CodecOptions::default();
    let prefix = &f.tokens[300..320];
    let for_expert = |e: usize| codec_with(Mode::Scd, Some((&joint, e)), &opts).unwrap();
    let caps = captured(for_expert(0).as_ref(), prefix);
    let codes = codec::encode(for_expert(0).as_ref(), &caps).unwrap();
    // The producer's codes do not depend on the expert: one payload for both.
    assert_eq!(codes, codec::encode(for_expert(1).as_ref(), &caps).unwrap());
    for e in 0..2 {
        let cache = codec::decode(
            for_expert(e).as_ref(),
            &f.experts[e],
            &codes,
            Prefix::new(prefix),
        )
        .unwrap();
        assert_eq!(cache.len(), 20);
        let kl = held_out_kl(for_expert(e).as_ref(), &f.experts[e]);
        let raw = held_out_kl(
            codec_with(Mode::Raw, None, &opts).unwrap().as_ref(),
            &f.experts[e],
        );
        assert!(kl < raw, "expert {e}: joint scd {kl} vs raw {raw}");
    }
    // Decoding for the wrong expert is refused.
    assert!(codec::decode(
        for_expert(0).as_ref(),
        &f.experts[1],
        &codes,
        Prefix::new(prefix)
    )
    .is_err());
}

#[test]
fn a_calibration_with_chat_turns_records_the_share_and_each_kinds_quality() {
    let f = fixture();
    let text = CalibrationText {
        corpus: "synthetic",
        split: "all",
        sha256: "00",
        tokens: &f.tokens,
    };
    let cfg = CalibrationConfig {
        chat: Some(ChatWrap {
            share: 0.5,
            head: vec![1, 2, 3],
            tail: vec![4, 5],
        }),
        ..config()
    };
    let t = calibrate(&f.base, &[("alpha", &f.experts[0])], &text, &cfg, |_| {}).unwrap();
    let m = &t.manifest;
    assert_eq!(m.calibration.chat_share, 0.5);
    for kind in ["chat", "text"] {
        let k = &m.metrics["heldout_by_kind"][kind];
        let (raw, reuse) = (
            k["kl_raw"].as_f64().unwrap(),
            k["kl_reuse"].as_f64().unwrap(),
        );
        assert!(raw > 0.0 && reuse > 0.0, "{kind}: {k}");
    }
    // The overall held-out figures are the two kinds' mean (two prompts of each).
    let mean = |what: &str| {
        ["chat", "text"]
            .iter()
            .map(|k| m.metrics["heldout_by_kind"][*k][what].as_f64().unwrap())
            .sum::<f64>()
            / 2.0
    };
    for what in ["kl_raw", "kl_reuse"] {
        assert!(
            (mean(what) - m.metrics[what].as_f64().unwrap()).abs() < 1e-9,
            "{what}"
        );
    }
    // Without the wrap, nothing is recorded per kind and the share is 0.
    let plain = pair_translator();
    assert_eq!(plain.manifest.calibration.chat_share, 0.0);
    assert!(plain.manifest.metrics["heldout_by_kind"].is_null());
}

#[test]
fn droidspeak_q4_and_q2_rebuild_caches_of_the_right_size() {
    let f = fixture();
    let t = Arc::new(pair_translator().clone());
    let opts = CodecOptions {
        q4_group: 8,
        ..CodecOptions::default()
    };
    let prefix = &f.tokens[500..520];
    let cfg = f.base.config();
    for mode in [Mode::DroidSpeak, Mode::Q4, Mode::Q2] {
        let c = codec_with(mode, Some((&t, 0)), &opts).unwrap();
        assert_eq!(c.mode(), mode);
        let codes = codec::encode(c.as_ref(), &captured(c.as_ref(), prefix)).unwrap();
        let raw_bytes = 20 * cfg.kv_dim() * 2 * 2 * cfg.num_layers;
        let bytes = codec::payload_bytes(&codes);
        match mode {
            // Per layer: 4-bit levels of K and V (160 bytes each), K's f16 scale and minimum per
            // channel for 3 groups of up to 8 tokens (192 bytes), V's per token for 2 groups
            // of 8 channels (160 bytes).
            Mode::Q4 => assert_eq!(bytes, cfg.num_layers * (2 * 160 + 192 + 160)),
            // 2-bit levels: half the bytes of the 4-bit ones, the same scales.
            Mode::Q2 => assert_eq!(bytes, cfg.num_layers * (2 * 80 + 192 + 160)),
            // One block of one layer recomputed from the hidden state.
            _ => assert_eq!(
                bytes,
                raw_bytes - raw_bytes / cfg.num_layers + 20 * cfg.hidden_size * 2
            ),
        }
        let cache = codec::decode(c.as_ref(), &f.experts[0], &codes, Prefix::new(prefix)).unwrap();
        assert_eq!(cache.len(), 20, "{mode}");
        let mut far = codes.clone();
        far[1].layer = 99;
        let err = codec::decode(c.as_ref(), &f.experts[0], &far, Prefix::new(prefix)).unwrap_err();
        assert!(
            matches!(err, CodecError::LayerOutOfRange { layer: 99, .. }),
            "{mode}: {err}"
        );
        assert!(held_out_kl(c.as_ref(), &f.experts[0]).is_finite());
    }
    assert!(codec_with(Mode::DroidSpeak, None, &opts).is_err());
}

/// The codes' products on AMX tiles (bf16 inputs, f32 sums: what a node with AMX runs) against
/// the same codecs in f32: the codes differ (the tiles ran), and the rebuilt caches agree
/// within what rounding the products' inputs to bf16 allows.
#[test]
#[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
fn translator_codes_track_the_f32_codes_on_amx_tiles() {
    use scd_models::PrefillMatmul;
    assert_eq!(
        PrefillMatmul::best(),
        PrefillMatmul::Tiles,
        "this CPU or kernel cannot run AMX tiles"
    );
    let f = fixture();
    let t = Arc::new(pair_translator().clone());
    let ranks = t.manifest.default_ranks;
    // More rows than the few-rows kernels take (so that the products go to the tiles), inside
    // the tiny model's context of 32.
    let prefix = &f.tokens[100..130];
    for mode in [Mode::Reuse, Mode::Scd] {
        let on = |m| {
            codec::Translated::new(t.clone(), mode, 0, ranks, CodeDType::F32, None)
                .unwrap()
                .with_matmul(m)
                .unwrap()
        };
        let (plain, tiles) = (on(PrefillMatmul::F32), on(PrefillMatmul::Tiles));
        // Patch layers rebuild through the aligner fused with the expert's projections.
        assert_eq!(mode == Mode::Scd, !tiles.patch_layers().is_empty());
        let caps = captured(&plain, prefix);
        let codes = codec::encode(&plain, &caps).unwrap();
        let codes_tiles = codec::encode(&tiles, &caps).unwrap();
        assert_eq!(codes.len(), codes_tiles.len());
        assert!(
            codes
                .iter()
                .zip(&codes_tiles)
                .any(|(a, b)| a.bytes != b.bytes),
            "{mode}: the tile products gave the f32 codes bit for bit"
        );
        let expert = &f.experts[0];
        let rebuilt = codec::decode(&plain, expert, &codes, Prefix::new(prefix)).unwrap();
        let rebuilt_tiles =
            codec::decode(&tiles, expert, &codes_tiles, Prefix::new(prefix)).unwrap();
        for l in 0..f.base.config().num_layers {
            let (k, v) = rebuilt.layer(l).unwrap().unwrap();
            let (k_t, v_t) = rebuilt_tiles.layer(l).unwrap().unwrap();
            // Two products with bf16 inputs (8 bits of mantissa) on the way: errors of a few
            // parts in a thousand of the largest value, far below the codes' own.
            for (what, a, b) in [("K", &k, &k_t), ("V", &v, &v_t)] {
                let (diff, scale) = (common::max_abs_diff(a, b), common::max_abs(a));
                assert!(
                    diff <= scale / 64.0,
                    "{mode} layer {l} {what}: max difference {diff} against max {scale}"
                );
            }
        }
    }
}

#[test]
fn transform_coded_codes_trade_bytes_for_distortion_and_refuse_damage() {
    let f = fixture();
    let t = Arc::new(pair_translator().clone());
    let cfg = f.base.config();
    let prefix = &f.tokens[400..424];
    let ranks = t.manifest.r_max;
    let codec_at = |dtype, step| {
        let opts = CodecOptions {
            ranks: Some(ranks),
            code_dtype: dtype,
            tc_rate: codec::TcRate { step },
            ..CodecOptions::default()
        };
        codec_with(Mode::Scd, Some((&t, 0)), &opts).unwrap()
    };
    // The reference: the same codes in f32.
    let exact = codec_at(CodeDType::F32, 1.0);
    let caps = captured(exact.as_ref(), prefix);
    let exact_codes = codec::encode(exact.as_ref(), &caps).unwrap();
    let reference = codec::decode(
        exact.as_ref(),
        &f.experts[0],
        &exact_codes,
        Prefix::new(prefix),
    )
    .unwrap();
    let error_of = |cache: &scd_models::KvCache| cache_distance(&reference, cache, cfg.num_layers);
    let mut last: Option<(usize, f64)> = None;
    for step in [0.2f32, 0.05, 0.01] {
        let tc = codec_at(CodeDType::TC, step);
        assert!(tc.variant().contains("tc step"), "{}", tc.variant());
        let codes = codec::encode(tc.as_ref(), &caps).unwrap();
        assert!(codes
            .iter()
            .all(|c| c.dtype == CodeDType::TC && c.is_consistent()));
        let bytes = codec::payload_bytes(&codes);
        let cache = codec::decode(tc.as_ref(), &f.experts[0], &codes, Prefix::new(prefix)).unwrap();
        let err = error_of(&cache);
        // A finer step: more bytes, less error; always fewer bytes than f16 codes.
        assert!(
            bytes < codec::payload_bytes(&exact_codes) / 2,
            "{bytes} bytes"
        );
        if let Some((b, e)) = last {
            assert!(
                bytes > b && err < e,
                "step {step}: {bytes} B, error {err} after {b} B, {e}"
            );
        }
        last = Some((bytes, err));
    }
    let (_, finest) = last.unwrap();
    assert!(finest < 0.05, "relative error at the finest step {finest}");
    // Damaged coded bytes are an error naming the layer, never another cache.
    let tc = codec_at(CodeDType::TC, 0.05);
    let mut codes = codec::encode(tc.as_ref(), &caps).unwrap();
    let i = codes
        .iter()
        .position(|c| c.kind == CodeKind::REUSE_V)
        .unwrap();
    let head = 3 * codes[i].shape[1] as usize;
    codes[i].bytes.truncate(head + 4);
    let err = codec::decode(tc.as_ref(), &f.experts[0], &codes, Prefix::new(prefix)).unwrap_err();
    assert!(
        matches!(err, CodecError::Coded { .. }) && err.layer() == Some(codes[i].layer as usize),
        "{err}"
    );
    // A rate that is not a positive number is refused.
    let bad = CodecOptions {
        code_dtype: CodeDType::TC,
        tc_rate: codec::TcRate { step: 0.0 },
        ..CodecOptions::default()
    };
    assert!(codec_with(Mode::Scd, Some((&t, 0)), &bad).is_err());
}

/// The relative RMS distance between two caches' K and V over every layer.
fn cache_distance(a: &scd_models::KvCache, b: &scd_models::KvCache, layers: usize) -> f64 {
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for l in 0..layers {
        let (Some((k1, v1)), Some((k2, v2))) = (a.layer(l).unwrap(), b.layer(l).unwrap()) else {
            panic!("layer {l} missing");
        };
        for (x, y) in [(k1, k2), (v1, v2)] {
            for (p, q) in values(&x).iter().zip(values(&y)) {
                err += f64::from(p - q).powi(2);
                norm += f64::from(*p).powi(2);
            }
        }
    }
    (err / norm).sqrt()
}

/// kvtc: the base's own basis fitted on its prefill, kept by the artifact, and raw KV coded in
/// it: finer steps cost more bytes and come closer to raw's cache (the same rows, the same
/// rotation), far under raw's bytes; a translator without a basis, damaged bytes and foreign
/// codes are errors.
#[test]
fn kvtc_codes_the_bases_own_kv_in_its_own_basis() {
    use scd_models::translator::kvtc;
    let f = fixture();
    let cfg = f.base.config();
    let prompts: Vec<Vec<u32>> = (0..30)
        .map(|i| f.tokens[i * 24..i * 24 + 24].to_vec())
        .collect();
    let mut seen = 0;
    let (layers, tokens) = kvtc::fit(&f.base, &prompts, |done, _| seen = done).unwrap();
    assert_eq!((layers.len(), tokens, seen), (cfg.num_layers, 30 * 24, 30));
    let without = Arc::new(pair_translator().clone());
    let opts = |step| CodecOptions {
        tc_rate: codec::TcRate { step },
        ..CodecOptions::default()
    };
    let Err(err) = codec_with(Mode::Kvtc, Some((&without, 0)), &opts(0.1)) else {
        panic!("kvtc without a basis");
    };
    assert!(err.to_string().contains("scd translators kvtc"), "{err}");
    let mut t = pair_translator().clone();
    t.kvtc = Some(layers);
    t.manifest.kvtc = Some(kvtc::KvtcInfo {
        prompts: 30,
        tokens,
        scales: kvtc::KvtcInfo::DEFAULT_SCALES,
    });
    let dir = tempfile::tempdir().unwrap();
    t.save(dir.path()).unwrap();
    let loaded = Translator::load(dir.path()).unwrap();
    assert_eq!(loaded.manifest.kvtc, t.manifest.kvtc);
    assert_eq!(loaded.kvtc.as_ref().map(Vec::len), Some(cfg.num_layers));
    let t = Arc::new(loaded);

    let prefix = &f.tokens[400..424];
    let raw = codec::codec_for(Mode::Raw).unwrap();
    let caps = captured(raw.as_ref(), prefix);
    let raw_codes = codec::encode(raw.as_ref(), &caps).unwrap();
    let raw_cache =
        codec::decode(raw.as_ref(), &f.experts[0], &raw_codes, Prefix::new(prefix)).unwrap();
    let mut last: Option<(usize, f64)> = None;
    for step in [0.2f32, 0.05, 0.01] {
        let c = codec_with(Mode::Kvtc, Some((&t, 0)), &opts(step)).unwrap();
        assert_eq!(c.mode(), Mode::Kvtc);
        let codes = codec::encode(c.as_ref(), &caps).unwrap();
        assert!(codes
            .iter()
            .all(|c| c.dtype == CodeDType::TC
                && [CodeKind::KVTC_K, CodeKind::KVTC_V].contains(&c.kind)));
        let bytes = codec::payload_bytes(&codes);
        assert!(
            bytes < codec::payload_bytes(&raw_codes),
            "{bytes} bytes at {step}"
        );
        let cache = codec::decode(c.as_ref(), &f.experts[0], &codes, Prefix::new(prefix)).unwrap();
        assert_eq!(cache.len(), prefix.len());
        let err = cache_distance(&raw_cache, &cache, cfg.num_layers);
        if let Some((b, e)) = last {
            assert!(
                bytes > b && err < e,
                "step {step}: {bytes} B, error {err} after {b} B, {e}"
            );
        }
        last = Some((bytes, err));
    }
    let (_, finest) = last.unwrap();
    assert!(finest < 0.05, "relative error at the finest step {finest}");

    let c = codec_with(Mode::Kvtc, Some((&t, 0)), &opts(0.05)).unwrap();
    let codes = codec::encode(c.as_ref(), &caps).unwrap();
    let mut cut = codes.clone();
    let head = 3 * cut[1].shape[1] as usize;
    cut[1].bytes.truncate(head + 4);
    let err = codec::decode(c.as_ref(), &f.experts[0], &cut, Prefix::new(prefix)).unwrap_err();
    assert!(
        matches!(err, CodecError::Coded { .. }) && err.layer() == Some(0),
        "{err}"
    );
    let err =
        codec::decode(c.as_ref(), &f.experts[0], &raw_codes, Prefix::new(prefix)).unwrap_err();
    assert!(matches!(err, CodecError::UnexpectedCode { .. }), "{err}");
    let err =
        codec::decode(c.as_ref(), &f.experts[0], &codes[..3], Prefix::new(prefix)).unwrap_err();
    assert!(matches!(err, CodecError::Missing { layer: 1, .. }), "{err}");
}
