//! Bounded property test of the pure frame codec: random valid frames round-trip exactly, and
//! random mutations of them are either refused with a typed error or decode to a frame that
//! itself round-trips. Nothing panics. (The receiver's whole path, stream reader and job rules
//! included, is fuzzed by tests/fuzz_receive.rs and the cargo-fuzz target in transport/fuzz.)

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use scd_transport::codec::{decode, encode, DecodeError, HEADER_LEN};
use scd_transport::wire::{CodeFrame, Control, Message, PrefillRequest, Prompt};
use scd_transport::{
    CodeDType, CodeKind, JobId, JobState, LayerCode, Mode, TraceContext, TranslatorHash,
};

const CASES: usize = 2_000;
const MAX: u32 = 1 << 20;

fn string(rng: &mut StdRng) -> String {
    let n = rng.gen_range(0..24);
    (0..n).map(|_| rng.gen_range(' '..='~')).collect::<String>()
        + if rng.gen_bool(0.1) { "é✓" } else { "" }
}

/// Printable ASCII keys and values (what a trace context admits), some empty values.
fn trace(rng: &mut StdRng) -> TraceContext {
    let mut t = TraceContext::new();
    for _ in 0..rng.gen_range(0..4) {
        let key: String = (0..rng.gen_range(1..16))
            .map(|_| rng.gen_range('!'..='~'))
            .collect();
        let value: String = (0..rng.gen_range(0..40))
            .map(|_| rng.gen_range(' '..='~'))
            .collect();
        t.insert(key, value).unwrap();
    }
    t
}

fn translator(rng: &mut StdRng) -> Option<TranslatorHash> {
    rng.gen::<bool>()
        .then(|| TranslatorHash::from_bytes(rng.gen()))
}

/// A layer code whose length agrees with its dtype and shape (or of a dtype this version does
/// not know, which may hold anything).
fn layer_code(rng: &mut StdRng) -> LayerCode {
    let mut dtype = CodeDType(rng.gen_range(0..12));
    let shape: Vec<u32> = (0..rng.gen_range(0..4))
        .map(|_| rng.gen_range(0..24))
        .collect();
    if dtype.is_known() && LayerCode::max_len(dtype, &shape).is_none() {
        // A known dtype this shape does not suit (the encoder would refuse it).
        dtype = CodeDType::U8;
    }
    let len = match LayerCode::expected_len(dtype, &shape) {
        Some(n) => n,
        // A variable-length dtype, within its bound; or one this version does not know.
        None => rng.gen_range(0..LayerCode::max_len(dtype, &shape).unwrap_or(2048).min(2048) + 1),
    };
    LayerCode {
        layer: rng.gen(),
        kind: CodeKind(rng.gen()),
        dtype,
        shape,
        bytes: (0..len).map(|_| rng.gen()).collect(),
    }
}

fn message(rng: &mut StdRng) -> Message {
    let job = JobId::from_u128(rng.gen());
    match rng.gen_range(0..7) {
        0..=2 => Message::Code(CodeFrame {
            job_id: job,
            translator: translator(rng),
            trace: trace(rng),
            code: layer_code(rng),
        }),
        3 => Message::Control(Control::PrefillRequest(PrefillRequest {
            job_id: job,
            base_model: string(rng),
            expert: string(rng),
            prompt: if rng.gen() {
                Prompt::Tokens((0..rng.gen_range(0..100)).map(|_| rng.gen()).collect())
            } else {
                Prompt::Text(string(rng))
            },
            mode: Mode::ALL[rng.gen_range(0..Mode::ALL.len())],
            translator: translator(rng),
            trace: trace(rng),
        })),
        4 => Message::Control(Control::JobStatus {
            job_id: job,
            state: JobState::ALL[rng.gen_range(0..JobState::ALL.len())],
            detail: string(rng),
        }),
        5 => Message::Control(Control::Error {
            job_id: rng.gen::<bool>().then_some(job),
            code: rng.gen(),
            message: string(rng),
        }),
        _ => Message::Control(Control::Cancel {
            job_id: job,
            reason: string(rng),
        }),
    }
}

fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>) {
    match rng.gen_range(0..6) {
        // Flip a few bits anywhere, body included.
        0 => {
            for _ in 0..rng.gen_range(1..8) {
                let i = rng.gen_range(0..bytes.len());
                bytes[i] ^= 1 << rng.gen_range(0..8);
            }
        }
        // Overwrite a run with random bytes.
        1 => {
            let i = rng.gen_range(0..bytes.len());
            let n = rng.gen_range(1..32).min(bytes.len() - i);
            rng.fill(&mut bytes[i..i + n]);
        }
        // Truncate, keeping the header's length (the decoder must notice the missing bytes).
        2 => {
            let n = rng.gen_range(0..bytes.len());
            bytes.truncate(n);
        }
        // Lie about the length in the header, then make the buffer match the lie.
        3 if bytes.len() >= HEADER_LEN => {
            let body = bytes.len() - HEADER_LEN;
            let new_len = rng.gen_range(0..body + 64) as u32;
            bytes[8..12].copy_from_slice(&new_len.to_le_bytes());
            bytes.resize(HEADER_LEN + new_len as usize, rng.gen());
        }
        // Corrupt the archive's root (the last bytes), where relative pointers live.
        4 if bytes.len() > HEADER_LEN + 8 => {
            let n = bytes.len();
            let i = rng.gen_range(n - 8..n);
            bytes[i] = rng.gen();
        }
        // Pure noise behind a valid header.
        _ => {
            let n = rng.gen_range(0..512);
            bytes.truncate(HEADER_LEN.min(bytes.len()));
            let len = n as u32;
            if bytes.len() == HEADER_LEN {
                bytes[8..12].copy_from_slice(&len.to_le_bytes());
            }
            bytes.extend((0..n).map(|_| rng.gen::<u8>()));
        }
    }
}

#[test]
fn random_frames_round_trip_exactly() {
    let mut rng = StdRng::seed_from_u64(0x5cd_0001);
    for _ in 0..CASES {
        let msg = message(&mut rng);
        let buf = encode(&msg, MAX).unwrap();
        let (back, used) = decode(&buf, MAX).unwrap();
        assert_eq!(back, msg);
        assert_eq!(used, buf.len());
    }
}

#[test]
fn mutated_frames_are_refused_or_decode_consistently() {
    let mut rng = StdRng::seed_from_u64(0x5cd_0002);
    let (mut refused, mut decoded) = (0, 0);
    for _ in 0..CASES {
        let msg = message(&mut rng);
        let mut bytes = encode(&msg, MAX).unwrap().as_slice().to_vec();
        mutate(&mut rng, &mut bytes);
        match decode(&bytes, MAX) {
            Ok((m, used)) => {
                decoded += 1;
                assert!(used <= bytes.len());
                let again = encode(&m, MAX).unwrap();
                assert_eq!(decode(&again, MAX).unwrap().0, m);
            }
            Err(
                DecodeError::Incomplete { .. }
                | DecodeError::BadMagic(_)
                | DecodeError::UnsupportedVersion { .. }
                | DecodeError::ReservedBits
                | DecodeError::TooLarge { .. }
                | DecodeError::Invalid(_)
                | DecodeError::Content(_),
            ) => refused += 1,
        }
    }
    // Both outcomes must actually be exercised for the test to mean anything.
    assert!(refused > CASES / 4, "refused {refused}");
    assert!(decoded > 0, "decoded {decoded}");
}
