//! One job end to end through the actors, over real QUIC on loopback, with the real base model
//! and the shipped `mail` expert: the pipeline generates what the same codec gives in-process,
//! layers stream while the producer is still prefilling, and a corrupt code fails its job
//! without harming the next.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use scd_actors::{
    DecoderError, JobCodec, JobError, JobOutput, JobSpec, Pipeline, PipelineOptions, ProducerError,
};
use scd_models::codec::{self, CodecOptions, Raw};
use scd_models::tokenizer::{ChatMessage, Tokenizer};
use scd_models::translator::Translator;
use scd_models::{
    generate_with_cache, AdapterMode, Capture, Codec, CodecError, GenerateParams, GgufFile, Input,
    LayerCapture, LayerDecoder, Llama, LogitsWanted, LoraAdapter, Prefix, Sampling, StopReason,
};
use scd_transport::{ClusterCa, CodeDType, JobId, LayerCode, Mode};
use tokio_util::sync::CancellationToken;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const MAX_TOKENS: usize = 16;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `$SCD_MODEL_DIR/<model>` or `<repo>/.cache/models/<model>`; fails with the fix when absent.
fn model_path() -> PathBuf {
    let dir = std::env::var_os("SCD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/models"));
    let path = dir.join(MODEL_FILE);
    assert!(
        path.exists(),
        "{} is missing: run `make model` (or set SCD_MODEL_DIR to the folder holding {MODEL_FILE})",
        path.display()
    );
    path
}

/// The base model, the mail expert, their translator (with the expert's index in it) and the
/// tokenizer, loaded once per test binary.
struct Models {
    base: Arc<Llama>,
    expert: Arc<Llama>,
    translator: (Arc<Translator>, usize),
    tok: Tokenizer,
}

fn models() -> &'static Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS.get_or_init(|| {
        let file = GgufFile::open(model_path()).unwrap();
        let tok = Tokenizer::from_gguf(file.content()).unwrap();
        let base = file.load_model().unwrap();
        let mail = repo().join("experts/mail");
        let adapter = LoraAdapter::load(mail.join("adapter.safetensors"), base.config()).unwrap();
        let expert = base.with_adapter(&adapter, AdapterMode::Merge).unwrap();
        let translator = Translator::load(&mail.join("translator")).unwrap();
        let index = translator.check_pair(&base, &expert).unwrap();
        Models {
            base: Arc::new(base),
            expert: Arc::new(expert),
            translator: (Arc::new(translator), index),
            tok,
        }
    })
}

/// A chat prompt of about a hundred tokens, long enough that the prefill takes a while.
fn prompt(m: &Models) -> Vec<u32> {
    let text = "Please read this message and write a short, polite reply. \
        From: Jane Smith <jane@example.org>. Subject: Re: the server upgrade on Friday. \
        Hi all, a reminder that the mail server will be down for maintenance from six to \
        eight in the evening on Friday. Messages sent during that window will be queued and \
        delivered afterwards. If you have urgent deliveries, send them before five. Thanks \
        for your patience, Jane.";
    let chat = m
        .tok
        .apply_chat_template(&[ChatMessage::user(text.to_owned())], true)
        .unwrap();
    let ids = m.tok.encode(&chat, false).unwrap();
    assert!(ids.len() > 64, "prompt of {} tokens", ids.len());
    ids
}

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: MAX_TOKENS,
        sampling: Sampling::Greedy,
        seed: 0,
        // No stop token: every run generates exactly MAX_TOKENS, so the comparison is long.
        stop_tokens: Vec::new(),
    }
}

fn raw_codec() -> JobCodec {
    JobCodec::for_mode(Mode::Raw, None, &CodecOptions::default()).unwrap()
}

fn scd_codec(m: &Models) -> JobCodec {
    let (t, index) = &m.translator;
    let codec = JobCodec::for_mode(
        Mode::Scd,
        Some((t, *index)),
        &CodecOptions {
            code_dtype: CodeDType::I8_ROWS,
            ..CodecOptions::default()
        },
    )
    .unwrap();
    assert_eq!(codec.translator, Some(t.hash()));
    codec
}

/// The same mode in one process, without actors or QUIC: the whole prefix's captures encoded,
/// decoded with the codec's layer decoder, generated with the same function.
fn reference(m: &Models, codec: &dyn Codec, prompt: &[u32]) -> Vec<u32> {
    let (&last, prefix) = prompt.split_last().unwrap();
    let codes = match codec.capture() {
        Some(capture) => {
            let captured = m
                .base
                .forward(
                    Input::new(prefix)
                        .capture(capture)
                        .logits(LogitsWanted::None),
                )
                .unwrap()
                .captured;
            codec::encode(codec, &captured).unwrap()
        }
        None => Vec::new(),
    };
    let mut cache = codec::decode(codec, &m.expert, &codes, Prefix::new(prefix)).unwrap();
    generate_with_cache(&m.expert, &mut cache, &[last], &params(), |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}

async fn start(m: &Models) -> Pipeline {
    let ca = ClusterCa::generate("test").unwrap();
    Pipeline::start(
        &ca,
        Arc::clone(&m.base),
        Arc::clone(&m.expert),
        PipelineOptions::default(),
        CancellationToken::new(),
    )
    .await
    .unwrap()
}

fn spec(prompt: &[u32], codec: JobCodec) -> JobSpec {
    JobSpec {
        id: JobId::random(),
        prompt: prompt.to_vec(),
        codec,
        params: params(),
    }
}

/// The facts every streamed job's timeline shows, whatever the machine's speed.
fn check_timeline(out: &JobOutput, layers: usize, codes_per_layer: impl Fn(u16) -> usize) {
    let t = &out.timeline;
    let prefill = t.prefill.expect("a prefill");
    let encode = t.encode.expect("an encoding");
    let transfer = t.transfer.expect("a transfer");
    let rebuild = t.rebuild.expect("a rebuild");
    let first_arrival = t.first_arrival().expect("frames arrived");
    eprintln!(
        "prefill {:?}..{:?}, first frame {:?}, last frame {:?}, rebuild end {:?}, first token {:?}, payload {} bytes in {} frames",
        prefill.start - t.submitted,
        prefill.end - t.submitted,
        first_arrival - t.submitted,
        t.arrivals.last().map(|a| a.at - t.submitted),
        rebuild.end - t.submitted,
        t.first_token.map(|f| f - t.submitted),
        t.payload_bytes(),
        t.arrivals.len(),
    );
    // Pipelined: the first layer's codes reached the consumer node before the producer had
    // finished its prefill.
    assert!(
        first_arrival < prefill.end,
        "first frame at {:?}, prefill ended at {:?} (after submission)",
        first_arrival - t.submitted,
        prefill.end - t.submitted
    );
    assert!(prefill.start <= encode.start && encode.start <= first_arrival);
    assert!(transfer.start <= first_arrival);
    assert!(rebuild.start <= rebuild.end);
    assert!(rebuild.end <= t.first_token.expect("a first token"));
    // Every layer's codes, in layer order, each frame as the encoder counted it.
    assert_eq!(t.layer_bytes.len(), layers);
    let expected: usize = (0..layers as u16).map(&codes_per_layer).sum();
    assert_eq!(t.arrivals.len(), expected);
    assert!(t
        .arrivals
        .windows(2)
        .all(|w| w[0].layer <= w[1].layer && w[0].at <= w[1].at));
    let arrived: usize = t.arrivals.iter().map(|a| a.bytes).sum();
    assert_eq!(arrived, t.payload_bytes());
    assert!(t.wire_bytes > t.payload_bytes() as u64);
    assert_eq!(out.stop, StopReason::MaxTokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raw_and_scd_through_the_actors_match_the_in_process_reference() {
    let m = models();
    let prompt = prompt(m);
    let layers = m.base.config().num_layers;
    let pipeline = start(m).await;

    let raw = raw_codec();
    let want = reference(m, raw.codec.as_ref(), &prompt);
    let got = pipeline.run_job(spec(&prompt, raw)).await.unwrap();
    assert_eq!(got.tokens, want, "raw");
    assert_eq!(want.len(), MAX_TOKENS);
    check_timeline(&got, layers, |_| 2);

    // Two jobs at once: each stage takes them in the same order, both come out whole.
    let (a, b) = tokio::join!(
        pipeline.run_job(spec(&prompt, raw_codec())),
        pipeline.run_job(spec(&prompt, raw_codec())),
    );
    assert_eq!(a.unwrap().tokens, want, "first of two concurrent jobs");
    assert_eq!(b.unwrap().tokens, want, "second of two concurrent jobs");

    let scd = scd_codec(m);
    let want = reference(m, scd.codec.as_ref(), &prompt);
    let got = pipeline.run_job(spec(&prompt, scd)).await.unwrap();
    assert_eq!(got.tokens, want, "scd i8-rows");
    // A Patch layer sends one code (Z_H), a Reuse layer two (Z_K, Z_V).
    let by_layer = |l: u16| {
        got.timeline
            .arrivals
            .iter()
            .filter(|a| a.layer == l)
            .count()
    };
    assert!((0..layers as u16).all(|l| (1..=2).contains(&by_layer(l))));
    check_timeline(&got, layers, by_layer);

    // The oracle needs no producer pass: an empty job stream, the expert's own prefill.
    let oracle = JobCodec::for_mode(Mode::Oracle, None, &CodecOptions::default()).unwrap();
    let want = reference(m, oracle.codec.as_ref(), &prompt);
    let got = pipeline.run_job(spec(&prompt, oracle)).await.unwrap();
    assert_eq!(got.tokens, want, "oracle");
    let t = &got.timeline;
    assert!(t.prefill.is_none() && t.encode.is_none() && t.arrivals.is_empty());
    assert!(t.rebuild.is_some() && t.first_token.is_some());

    pipeline.shutdown().await;
}

/// Raw, except that one layer's K code has its shape turned around: the bytes still agree with
/// the shape (the transport passes it), the consumer's codec refuses it.
struct CorruptLayer {
    layer: usize,
}

impl Codec for CorruptLayer {
    fn mode(&self) -> Mode {
        Raw.mode()
    }

    fn capture(&self) -> Option<Capture> {
        Raw.capture()
    }

    fn encode_layer(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        let first = out.len();
        Raw.encode_layer(capture, out)?;
        if capture.layer == self.layer {
            out[first].shape.reverse();
        }
        Ok(())
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        Raw.decoder(consumer, prefix)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_code_fails_its_job_and_the_next_job_succeeds() {
    let m = models();
    let prompt = prompt(m);
    let pipeline = start(m).await;

    let corrupt = JobCodec {
        codec: Arc::new(CorruptLayer { layer: 3 }),
        translator: None,
    };
    let err = pipeline.run_job(spec(&prompt, corrupt)).await.unwrap_err();
    match &err {
        JobError::Decoder(DecoderError::Code {
            layer: 3,
            source: CodecError::Shape { .. },
        }) => {}
        other => panic!("expected the decoder's shape error at layer 3, got {other:?}"),
    }
    let message = err.to_string();
    eprintln!("corrupt job: {message}");
    assert!(
        message.contains("layer 3") && message.contains("shape"),
        "{message}"
    );

    // A producer failure is reported as the producer's, not as what it did to the stages
    // after it.
    let mut bad = prompt.clone();
    bad[5] = u32::MAX;
    let err = pipeline.run_job(spec(&bad, raw_codec())).await.unwrap_err();
    assert!(
        matches!(
            err,
            JobError::Producer(ProducerError::TokenOutOfRange { id: u32::MAX, .. })
        ),
        "{err:?}"
    );

    let raw = raw_codec();
    let want = reference(m, raw.codec.as_ref(), &prompt);
    let got = pipeline.run_job(spec(&prompt, raw)).await.unwrap();
    assert_eq!(got.tokens, want);

    pipeline.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_root_token_stops_a_running_job_and_shutdown_returns() {
    let m = models();
    let prompt = prompt(m);
    let cancel = CancellationToken::new();
    let pipeline = Pipeline::start(
        &ClusterCa::generate("test").unwrap(),
        Arc::clone(&m.base),
        Arc::clone(&m.expert),
        PipelineOptions::default(),
        cancel.clone(),
    )
    .await
    .unwrap();
    let mut job = pipeline
        .start_job(spec(&prompt, raw_codec()))
        .await
        .unwrap();
    // Tokens stream before the job ends; cancel after the first.
    assert!(job.tokens.recv().await.is_some());
    cancel.cancel();
    let err = job.wait().await.unwrap_err();
    assert!(err.is_knock_on(), "{err:?}");
    let after = pipeline.run_job(spec(&prompt, raw_codec())).await;
    assert!(after.is_err(), "a job after cancellation ran");
    pipeline.shutdown().await;
}
