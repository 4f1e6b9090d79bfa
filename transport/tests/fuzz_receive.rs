//! The receiver's path under fuzzing, on stable Rust and inside `cargo test`: bytes -> the frame
//! reader job streams use -> validated frame -> job tracker, through
//! [`scd_transport::fuzz::receive_path`] (the same function the cargo-fuzz target runs; the
//! properties it checks are listed there).
//!
//! Two sources of input:
//! - the seed corpus checked in under `transport/fuzz/seeds/receive_path` (interesting streams
//!   built from the current encoder, plus any input a fuzzer found and someone added);
//! - [`CASES`] streams generated from a fresh random seed on every run: valid jobs (Open, code
//!   frames, status, cancel) with some rules broken on purpose, then mutated (bit flips,
//!   overwrites, truncation, lies in a header's length, spliced garbage).
//!
//! A failure prints the seed and writes the failing input to a file; replay the run with
//! `SCD_FUZZ_SEED=<seed> cargo test -p scd-transport --test fuzz_receive`, and add the file to
//! the seed corpus once fixed. After a change to the wire format, rewrite the corpus with
//! `cargo test -p scd-transport --test fuzz_receive -- --ignored write_seed_corpus`.

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use scd_transport::codec::{self, header_bytes, HEADER_LEN};
use scd_transport::fuzz::{input, receive_path, Ending, Outcome};
use scd_transport::wire::{CodeFrame, Control, Message, PrefillRequest, Prompt};
use scd_transport::{
    CodeDType, CodeKind, JobId, JobState, LayerCode, Mode, RecvError, TraceContext, TranslatorHash,
};

/// Generated inputs per run.
const CASES: usize = 100_000;

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/receive_path")
}

/// Runs `receive_path` on one input; on a panic, says how to reproduce it and saves the input.
fn check(what: &str, data: &[u8]) -> Outcome {
    match std::panic::catch_unwind(|| receive_path(data)) {
        Ok(outcome) => outcome,
        Err(panic) => {
            let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("receive_path-failure.bin");
            let saved = std::fs::write(&file, data).map_or_else(
                |e| format!("could not save the input: {e}"),
                |()| format!("input saved to {}", file.display()),
            );
            eprintln!("receive_path failed on {what}; {saved}");
            std::panic::resume_unwind(panic)
        }
    }
}

// ----- generated inputs -----

fn trace(rng: &mut StdRng) -> TraceContext {
    let mut t = TraceContext::new();
    if rng.gen_bool(0.3) {
        t.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .unwrap();
    }
    t
}

fn code(rng: &mut StdRng, layer: u16) -> LayerCode {
    let mut dtype = CodeDType(rng.gen_range(0..12));
    let shape: Vec<u32> = (0..rng.gen_range(0..3))
        .map(|_| rng.gen_range(0..12))
        .collect();
    if dtype.is_known() && LayerCode::max_len(dtype, &shape).is_none() {
        // A known dtype this shape does not suit (the encoder would refuse it).
        dtype = CodeDType::U8;
    }
    // A dtype this version does not know may hold anything.
    let len = match LayerCode::expected_len(dtype, &shape) {
        Some(n) => n,
        // A variable-length dtype, within its bound; or one this version does not know.
        None => rng.gen_range(0..LayerCode::max_len(dtype, &shape).unwrap_or(64).min(64) + 1),
    };
    LayerCode {
        layer,
        // Mostly the named kinds, so (layer, kind) repeats now and then.
        kind: CodeKind(if rng.gen_bool(0.9) {
            rng.gen_range(0..9)
        } else {
            rng.gen()
        }),
        dtype,
        shape,
        bytes: (0..len).map(|_| rng.gen()).collect(),
    }
}

/// A job as a sender might write it, with a rule broken now and then.
fn job_stream(rng: &mut StdRng) -> Vec<u8> {
    let job = JobId::from_u128(rng.gen_range(0..3));
    let other = || JobId::from_u128(7);
    let mut msgs = vec![];
    if rng.gen_bool(0.92) {
        msgs.push(Message::Control(Control::Open {
            job_id: job,
            trace: trace(rng),
        }));
    }
    let mut layer = 0u16;
    for _ in 0..rng.gen_range(0..6) {
        let pick = rng.gen_range(0..100);
        let msg = match pick {
            0..=69 => {
                match rng.gen_range(0..20) {
                    0 => layer = layer.saturating_sub(1),
                    1..=9 => {}
                    _ => layer += 1,
                }
                let id = if rng.gen_bool(0.03) { other() } else { job };
                let mut f = CodeFrame::new(id, code(rng, layer)).with_trace(trace(rng));
                if rng.gen() {
                    f = f.with_translator(TranslatorHash::from_bytes(rng.gen()));
                }
                Message::Code(f)
            }
            70..=79 => Message::Control(Control::JobStatus {
                job_id: job,
                state: JobState::ALL[rng.gen_range(0..JobState::ALL.len())],
                detail: "rebuilding".into(),
            }),
            80..=83 => Message::Control(Control::Error {
                job_id: rng.gen::<bool>().then_some(job),
                code: rng.gen_range(0..6),
                message: "x".into(),
            }),
            84..=88 => Message::Control(Control::Cancel {
                job_id: job,
                reason: "gone".into(),
            }),
            89..=93 => Message::Control(Control::PrefillRequest(PrefillRequest {
                job_id: job,
                base_model: "base".into(),
                expert: "sotu".into(),
                prompt: if rng.gen() {
                    Prompt::Tokens((0..rng.gen_range(0..20)).map(|_| rng.gen()).collect())
                } else {
                    Prompt::Text("hello".into())
                },
                mode: Mode::ALL[rng.gen_range(0..Mode::ALL.len())],
                translator: None,
                trace: trace(rng),
            })),
            94..=96 => Message::Control(Control::Hello {
                protocol: 1,
                node_id: "node-x".into(),
            }),
            _ => Message::Control(Control::Open {
                job_id: job,
                trace: TraceContext::new(),
            }),
        };
        msgs.push(msg);
    }
    let mut out = vec![];
    for m in &msgs {
        out.extend_from_slice(&codec::encode(m, u32::MAX).unwrap());
    }
    out
}

/// Offsets of frame starts in a well-formed stream.
fn frame_starts(stream: &[u8]) -> Vec<usize> {
    let mut at = 0;
    let mut starts = vec![];
    while let Ok(h) = codec::check_header(&stream[at..], u32::MAX) {
        starts.push(at);
        at += h.frame_len();
        if at >= stream.len() {
            break;
        }
    }
    starts
}

fn mutate(rng: &mut StdRng, s: &mut Vec<u8>) {
    if s.is_empty() {
        s.extend((0..rng.gen_range(0..64)).map(|_| rng.gen::<u8>()));
        return;
    }
    let starts = frame_starts(s);
    match rng.gen_range(0..8) {
        0 => {
            for _ in 0..rng.gen_range(1..6) {
                let i = rng.gen_range(0..s.len());
                s[i] ^= 1 << rng.gen_range(0..8);
            }
        }
        1 => {
            let i = rng.gen_range(0..s.len());
            let n = rng.gen_range(1..24).min(s.len() - i);
            rng.fill_bytes(&mut s[i..i + n]);
        }
        2 => {
            let n = rng.gen_range(0..s.len());
            s.truncate(n);
        }
        // A header that lies about its length: shorter, longer, or far beyond any cap.
        3 if !starts.is_empty() => {
            let at = starts[rng.gen_range(0..starts.len())];
            let len = match rng.gen_range(0..3) {
                0 => rng.gen_range(0..64),
                1 => rng.gen_range(0..(1 << 21)),
                _ => u32::MAX - rng.gen_range(0..16),
            };
            s[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        }
        // Garbage spliced in at a frame boundary, with or without a header of its own.
        4 => {
            let at = starts
                .get(rng.gen_range(0..starts.len().max(1)))
                .copied()
                .unwrap_or(0);
            let n = rng.gen_range(0..300);
            let mut junk: Vec<u8> = if rng.gen() {
                header_bytes(n as u32).to_vec()
            } else {
                vec![]
            };
            junk.extend((0..n).map(|_| rng.gen::<u8>()));
            s.splice(at..at, junk);
        }
        // The archive's tail, where the root and its relative pointers live.
        5 if starts.len() > 1 => {
            let end = starts[1];
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(end.saturating_sub(24).max(HEADER_LEN)..end);
                s[i] = rng.gen();
            }
        }
        // A frame repeated (a second Open, a duplicate code).
        6 if !starts.is_empty() => {
            let i = rng.gen_range(0..starts.len());
            let end = starts.get(i + 1).copied().unwrap_or(s.len());
            let copy = s[starts[i]..end].to_vec();
            s.splice(end..end, copy);
        }
        _ => s.extend((0..rng.gen_range(1..32)).map(|_| rng.gen::<u8>())),
    }
}

/// What the generated cases reached, so the run cannot pass by exercising nothing.
#[derive(Default, Debug)]
struct Coverage {
    finished: usize,
    cancelled: usize,
    protocol: usize,
    decode: usize,
    truncated: usize,
    frames: usize,
}

impl Coverage {
    fn add(&mut self, o: &Outcome) {
        self.frames += o.delivered.len();
        match &o.ending {
            Ending::Finished => self.finished += 1,
            Ending::Failed(RecvError::CancelledByPeer { .. }, _) => self.cancelled += 1,
            Ending::Failed(RecvError::Protocol(_), _) => self.protocol += 1,
            Ending::Failed(RecvError::Decode(_), _) => self.decode += 1,
            Ending::Failed(RecvError::Truncated, _) => self.truncated += 1,
            Ending::Failed(other, _) => panic!("unexpected ending {other}"),
        }
    }
}

#[test]
fn generated_streams_from_a_fresh_seed() {
    let seed = match std::env::var("SCD_FUZZ_SEED") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("SCD_FUZZ_SEED={s:?} is not a u64")),
        Err(_) => rand::random::<u64>(),
    };
    // Printed now; libtest shows it with the failure (and `--nocapture` shows it always).
    println!("fuzz_receive seed {seed} (replay: SCD_FUZZ_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut coverage = Coverage::default();
    for case in 0..CASES {
        let mut stream = job_stream(&mut rng);
        if rng.gen_bool(0.6) {
            mutate(&mut rng, &mut stream);
        }
        let data = input(rng.gen(), rng.gen(), &stream);
        let what = format!("case {case} of seed {seed} (replay: SCD_FUZZ_SEED={seed})");
        coverage.add(&check(&what, &data));
    }
    println!("{coverage:?}");
    // Each way a job can end must have been reached many times, or the run proved little.
    for (what, n) in [
        ("finished", coverage.finished),
        ("cancelled", coverage.cancelled),
        ("protocol", coverage.protocol),
        ("decode", coverage.decode),
        ("truncated", coverage.truncated),
    ] {
        assert!(n > CASES / 100, "only {n} cases ended {what}: {coverage:?}");
    }
    assert!(coverage.frames > CASES, "{coverage:?}");
}

// ----- the seed corpus -----

/// Interesting streams, each under the settings it is meant for.
fn seed_corpus() -> Vec<(&'static str, Vec<u8>)> {
    let job = JobId::from_u128(0x5eed);
    let enc = |m: &Message| codec::encode(m, u32::MAX).unwrap().as_slice().to_vec();
    // Bypasses the encoder's content check, as a hostile peer would.
    let raw = |m: &Message| {
        let body = rkyv::to_bytes::<rkyv::rancor::Error>(m).unwrap();
        let mut v = header_bytes(body.len() as u32).to_vec();
        v.extend_from_slice(&body);
        v
    };
    let open = enc(&Message::Control(Control::Open {
        job_id: job,
        trace: TraceContext::new(),
    }));
    let code_frame = |layer: u16, kind: CodeKind, len: usize| {
        Message::Code(CodeFrame::new(
            job,
            LayerCode {
                layer,
                kind,
                dtype: CodeDType::U8,
                shape: vec![len as u32],
                bytes: vec![layer as u8; len],
            },
        ))
    };
    let code = |layer, kind, len| enc(&code_frame(layer, kind, len));
    let cat = |parts: &[&[u8]]| parts.concat();
    let good = cat(&[
        &open,
        &code(0, CodeKind::REUSE_K, 100),
        &code(0, CodeKind::REUSE_V, 100),
        &code(1, CodeKind::REUSE_K, 3000),
        &enc(&Message::Control(Control::JobStatus {
            job_id: job,
            state: JobState::Transferring,
            detail: "half way".into(),
        })),
    ]);
    let mut bad_magic = code(1, CodeKind::RAW_K, 10);
    bad_magic[..4].copy_from_slice(b"XXXX");
    let mut bad_version = code(1, CodeKind::RAW_K, 10);
    bad_version[4] = 2;
    let mut reserved = code(1, CodeKind::RAW_K, 10);
    reserved[14] = 1;
    let mut garbage = header_bytes(64).to_vec();
    garbage.extend_from_slice(&[0xff; 64]);
    // A trace value with a byte the context refuses (a newline), put in after encoding.
    let mut hostile_trace = {
        let mut t = TraceContext::new();
        t.insert("tracestate", "vendor=AAAAAAAAAAAAAAAA").unwrap();
        enc(&Message::Control(Control::Open {
            job_id: job,
            trace: t,
        }))
    };
    let at = hostile_trace
        .windows(4)
        .position(|w| w == b"AAAA")
        .expect("the marker is in the archive");
    hostile_trace[at] = b'\n';
    let inconsistent = {
        let Message::Code(mut f) = code_frame(0, CodeKind::RAW_V, 10) else {
            unreachable!()
        };
        f.code.shape = vec![11];
        raw(&Message::Code(f))
    };
    let body = code(0, CodeKind::RAW_K, 5000);
    // A code frame whose body is exactly 64 KiB, the frame cap and the whole budget of
    // setting 2.
    let exact = (60_000..65_536)
        .rev()
        .map(|len| code(0, CodeKind::RAW_K, len))
        .find(|f| f.len() == HEADER_LEN + (64 << 10))
        .expect("some payload length makes a 64 KiB body");
    vec![
        ("good_job", input(0x0b, 3, &good)),
        ("good_job_bytewise", input(0, 3, &good)),
        ("good_job_pieces_waits_drops", input(0x74, 3, &good)),
        (
            "cancel",
            input(
                0x23,
                3,
                &cat(&[
                    &good,
                    &enc(&Message::Control(Control::Cancel {
                        job_id: job,
                        reason: "user left".into(),
                    })),
                ]),
            ),
        ),
        ("empty_stream", input(0, 0, &[])),
        ("no_open", input(0, 3, &code(0, CodeKind::RAW_K, 10))),
        (
            "another_job",
            input(
                5,
                3,
                &cat(&[
                    &open,
                    &enc(&Message::Code(CodeFrame::new(
                        JobId::from_u128(1),
                        LayerCode {
                            layer: 0,
                            kind: CodeKind::RAW_K,
                            dtype: CodeDType::U8,
                            shape: vec![1],
                            bytes: vec![1],
                        },
                    ))),
                ]),
            ),
        ),
        (
            "layer_backwards",
            input(
                6,
                3,
                &cat(&[
                    &open,
                    &code(2, CodeKind::RAW_K, 10),
                    &code(1, CodeKind::RAW_K, 10),
                ]),
            ),
        ),
        (
            "duplicate_code",
            input(
                7,
                3,
                &cat(&[
                    &open,
                    &code(2, CodeKind::RAW_K, 10),
                    &code(2, CodeKind::RAW_K, 10),
                ]),
            ),
        ),
        ("second_open", input(8, 3, &cat(&[&open, &open]))),
        (
            "job_over_its_cap",
            input(
                9,
                0b0111,
                &cat(&[
                    &open,
                    &code(0, CodeKind::RAW_K, 1500),
                    &code(1, CodeKind::RAW_K, 1500),
                ]),
            ),
        ),
        ("bad_magic", input(1, 3, &cat(&[&open, &bad_magic]))),
        ("bad_version", input(2, 3, &cat(&[&open, &bad_version]))),
        ("reserved_bits", input(3, 3, &cat(&[&open, &reserved]))),
        ("garbage_body", input(4, 3, &cat(&[&open, &garbage]))),
        ("over_the_frame_cap", input(0, 0, &cat(&[&open, &body]))),
        (
            "announces_4_gib",
            input(0x10, 3, &cat(&[&open, &header_bytes(u32::MAX)])),
        ),
        (
            "announces_1_mib_sends_100",
            input(0x31, 3, &cat(&[&open, &header_bytes(1 << 20), &[7; 100]])),
        ),
        ("truncated_header", input(0, 3, &cat(&[&open, &body[..9]]))),
        (
            "truncated_body",
            input(0x45, 3, &cat(&[&open, &body[..body.len() - 1]])),
        ),
        ("empty_body", input(0, 3, &cat(&[&open, &header_bytes(0)]))),
        ("hostile_trace", input(0, 3, &hostile_trace)),
        (
            "inconsistent_code",
            input(0, 3, &cat(&[&open, &inconsistent])),
        ),
        (
            "frame_exactly_the_budget",
            input(0x0b, 2, &cat(&[&open, &exact])),
        ),
    ]
}

#[test]
fn the_seed_corpus_is_current_and_passes() {
    let dir = seed_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("seed corpus {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for (name, bytes) in seed_corpus() {
        let file = dir.join(format!("{name}.bin"));
        let on_disk = std::fs::read(&file).unwrap_or_default();
        assert!(
            on_disk == bytes,
            "{} is missing or stale; rewrite the corpus with `cargo test -p scd-transport \
             --test fuzz_receive -- --ignored write_seed_corpus`",
            file.display()
        );
    }
    // Every file, including inputs a fuzzer found that are not generated above.
    let mut endings = vec![];
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let outcome = check(&file.display().to_string(), &data);
        endings.push((file.file_name().unwrap().to_owned(), outcome.ending));
    }
    let ending = |name: &str| {
        endings
            .iter()
            .find(|(f, _)| f.to_str() == Some(&format!("{name}.bin")))
            .map(|(_, e)| e.clone())
            .unwrap()
    };
    assert_eq!(ending("good_job"), Ending::Finished);
    assert_eq!(ending("frame_exactly_the_budget"), Ending::Finished);
    assert!(matches!(
        ending("hostile_trace"),
        Ending::Failed(RecvError::Decode(codec::DecodeError::Content(_)), _)
    ));
    assert!(matches!(
        ending("announces_4_gib"),
        Ending::Failed(RecvError::Decode(codec::DecodeError::TooLarge { .. }), _)
    ));
    assert!(matches!(
        ending("announces_1_mib_sends_100"),
        Ending::Failed(RecvError::Truncated, _)
    ));
}

#[test]
#[ignore = "writes the seed corpus; run after a change to the wire format"]
fn write_seed_corpus() {
    let dir = seed_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in seed_corpus() {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).unwrap();
    }
}
