//! The codec interface on a tiny random llama: raw K/V survive the trip producer -> codes ->
//! consumer cache within bf16 rounding, the payload is exactly the bytes that would go on the
//! wire, and every malformed payload is a typed error, never a panic.

mod common;

use common::{max_abs, max_abs_diff, tiny_model};
use rand::{Rng, SeedableRng};
use scd_models::codec::{self, Codec, CodecError, Oracle, Prefix, Raw};
use scd_models::{AdapterMode, Input, LogitsWanted, LoraAdapter, Proj};
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

const TOKENS: [u32; 9] = [3, 17, 42, 5, 9, 63, 0, 21, 8];

fn raw_codes(model: &scd_models::Llama) -> Vec<LayerCode> {
    let out = model
        .forward(
            Input::new(&TOKENS)
                .capture(Raw.capture().unwrap())
                .logits(LogitsWanted::None),
        )
        .unwrap();
    codec::encode(&Raw, &out.captured).unwrap()
}

#[test]
fn raw_codes_rebuild_the_producers_cache_and_count_wire_bytes() {
    let (_dir, model) = tiny_model(1);
    let cfg = model.config().clone();
    let codes = raw_codes(&model);
    assert_eq!(codes.len(), 2 * cfg.num_layers);
    assert!(codes
        .iter()
        .all(|c| c.dtype == CodeDType::BF16 && c.is_consistent()));
    assert_eq!(
        codec::payload_bytes(&codes),
        TOKENS.len() * cfg.kv_dim() * 2 * 2 * cfg.num_layers
    );
    let rebuilt = codec::decode(&Raw, &model, &codes, Prefix::new(&TOKENS)).unwrap();
    let own = codec::decode(&Oracle, &model, &[], Prefix::new(&TOKENS)).unwrap();
    assert_eq!(rebuilt.len(), TOKENS.len());
    assert_eq!(rebuilt.next_position(), TOKENS.len());
    for l in 0..cfg.num_layers {
        let (kr, vr) = rebuilt.layer(l).unwrap().unwrap();
        let (ko, vo) = own.layer(l).unwrap().unwrap();
        // bf16 keeps 8 bits of mantissa: relative error below 2^-8.
        assert!(
            max_abs_diff(&kr, &ko) <= max_abs(&ko) / 128.0,
            "layer {l} K"
        );
        assert!(
            max_abs_diff(&vr, &vo) <= max_abs(&vo) / 128.0,
            "layer {l} V"
        );
    }
}

/// Raw transfer hands an expert the cache the producer serves, keys rotated with the
/// producer's RoPE: an expert with its own RoPE base gets the base's rotation, not its own
/// (what breaks raw KV for long-context fine-tunes such as the paper's MistralLite).
#[test]
fn raw_keys_keep_the_producers_rotation_for_an_expert_with_its_own_rope_base() {
    let (_dir, model) = tiny_model(1);
    let cfg = model.config().clone();
    // An identity edit (B = 0) with another base: the expert's keys before RoPE are the
    // producer's, so any difference is the rotation.
    let adapter = LoraAdapter::init(&cfg, 2, 4.0, &[Proj::K], 1)
        .unwrap()
        .with_rope_theta(Some(1e6))
        .unwrap();
    let expert = model.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    let codes = raw_codes(&model);
    let rebuilt = codec::decode(&Raw, &expert, &codes, Prefix::new(&TOKENS)).unwrap();
    let served = codec::decode(&Oracle, &model, &[], Prefix::new(&TOKENS)).unwrap();
    let own = codec::decode(&Oracle, &expert, &[], Prefix::new(&TOKENS)).unwrap();
    for l in 0..cfg.num_layers {
        let (k, _) = rebuilt.layer(l).unwrap().unwrap();
        let (k_served, _) = served.layer(l).unwrap().unwrap();
        let (k_own, _) = own.layer(l).unwrap().unwrap();
        assert!(
            max_abs_diff(&k, &k_served) <= max_abs(&k_served) / 128.0,
            "layer {l}"
        );
        assert!(
            max_abs_diff(&k, &k_own) > max_abs(&k_own) / 16.0,
            "layer {l}: the expert's own rotation"
        );
    }
}

#[test]
fn oracle_sends_nothing_and_refuses_codes() {
    let (_dir, model) = tiny_model(1);
    assert!(Oracle.capture().is_none());
    let codes = raw_codes(&model);
    let err = codec::decode(&Oracle, &model, &codes[..1], Prefix::new(&TOKENS)).unwrap_err();
    assert!(
        matches!(
            err,
            CodecError::UnexpectedCode {
                mode: Mode::Oracle,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn malformed_payloads_are_typed_errors() {
    let (_dir, model) = tiny_model(1);
    let codes = raw_codes(&model);
    let decode = |codes: &[LayerCode]| codec::decode(&Raw, &model, codes, Prefix::new(&TOKENS));
    let with = |i: usize, f: &dyn Fn(&mut LayerCode)| {
        let mut c = codes.clone();
        f(&mut c[i]);
        decode(&c).unwrap_err()
    };
    let err = decode(&codes[..codes.len() - 1]).unwrap_err();
    assert!(
        matches!(err, CodecError::Missing { kind: "raw_v", .. }),
        "{err}"
    );
    let mut twice = codes.clone();
    twice.push(codes[0].clone());
    assert!(matches!(
        decode(&twice).unwrap_err(),
        CodecError::Duplicate { .. }
    ));
    let err = with(0, &|c| c.dtype = CodeDType::F16);
    assert!(matches!(err, CodecError::DType { .. }), "{err}");
    let err = with(0, &|c| c.shape[0] += 1);
    assert!(matches!(err, CodecError::Shape { .. }), "{err}");
    let err = with(0, &|c| {
        c.bytes.pop();
    });
    assert!(matches!(err, CodecError::Shape { .. }), "{err}");
    let err = with(1, &|c| c.layer = 99);
    assert!(
        matches!(err, CodecError::LayerOutOfRange { layer: 99, .. }),
        "{err}"
    );
    let err = with(1, &|c| c.kind = CodeKind::PATCH_H);
    assert!(matches!(err, CodecError::UnexpectedCode { .. }), "{err}");
    let err = with(1, &|c| c.kind = CodeKind(200));
    assert!(err.to_string().contains("#200"), "{err}");
}

/// Random codes (random layer, kind, dtype, shape and byte count) against the raw decoder: an
/// error or, by chance, acceptance, never a panic.
#[test]
fn random_codes_never_panic_the_decoder() {
    let (_dir, model) = tiny_model(1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for _ in 0..2000 {
        let dims = rng.gen_range(0..4);
        let code = LayerCode {
            layer: rng.gen_range(0..4),
            kind: CodeKind(rng.gen_range(0..10)),
            dtype: CodeDType(rng.gen_range(0..8)),
            shape: (0..dims).map(|_| rng.gen_range(0..20)).collect(),
            bytes: vec![0x7f; rng.gen_range(0..200)],
        };
        let _ = codec::decode(&Raw, &model, &[code], Prefix::new(&TOKENS));
    }
    assert!(codec::codec_for(Mode::Scd).is_err());
}
