//! One job end to end through the actors, over real QUIC on loopback, with the real base model
//! and the shipped `mail` expert: the pipeline generates what the same codec gives in-process,
//! layers stream while the producer is still prefilling, and a corrupt code fails its job
//! without harming the next.

use std::sync::Arc;

use crate::common::{models, params, prompt, raw_codec, reference, scd_codec, Models, MAX_TOKENS};
use scd_actors::{
    DecoderError, JobCodec, JobError, JobOutput, JobSpec, Pipeline, PipelineOptions, ProducerError,
    Step, TokenSource,
};
use scd_models::codec::{CodecOptions, Raw};
use scd_models::{
    Capture, Codec, CodecError, LayerCapture, LayerDecoder, Llama, Prefix, StopReason,
};
use scd_transport::{ClusterCa, JobId, LayerCode, Mode};
use tokio_util::sync::CancellationToken;

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
    assert!(matches!(job.next().await, Some(Step::Tokens(_))));
    cancel.cancel();
    let err = job.wait().await.unwrap_err();
    assert!(err.is_knock_on(), "{err:?}");
    let after = pipeline.run_job(spec(&prompt, raw_codec())).await;
    assert!(after.is_err(), "a job after cancellation ran");
    pipeline.shutdown().await;
}

/// A consumer that stops reading holds up only its own job: the producer node's transfer sends
/// each job on its own, so another consumer's job goes through while the first is stuck behind
/// QUIC's flow control, and the stuck one still ends when it is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_consumer_holds_up_only_its_own_job() {
    use ractor::Actor;
    use scd_actors::transfer::SendJob;
    use scd_actors::{TransferError, TransferOut, TransferOutMsg};
    use scd_transport::{
        CodeDType, CodeFrame, CodeKind, Endpoint, Role, TraceContext, TransportOptions,
    };

    let ca = ClusterCa::generate("test").unwrap();
    let local = || "127.0.0.1:0".parse().unwrap();
    let opts = TransportOptions::default();
    let producer = Endpoint::bind(
        local(),
        &ca.issue("producer", Role::Node).unwrap(),
        opts.clone(),
    )
    .unwrap();
    let mut consumers = Vec::new();
    for name in ["stalled", "reader"] {
        let ep =
            Endpoint::bind(local(), &ca.issue(name, Role::Node).unwrap(), opts.clone()).unwrap();
        let addr = ep.local_addr().unwrap();
        let server = ep.clone();
        let accept =
            tokio::spawn(async move { server.accept().await.unwrap().complete().await.unwrap() });
        let to_consumer = producer.connect(addr, name).await.unwrap();
        let theirs = accept.await.unwrap();
        consumers.push((ep, to_consumer, theirs));
    }
    let (transfer, _handle) = Actor::spawn(None, TransferOut, ()).await.unwrap();
    // 48 frames of 1 MiB: far more than QUIC's windows and the send queue hold, so a stream
    // nobody reads blocks its sender.
    let send = |job: JobId, to: &scd_transport::Connection, cancel: &CancellationToken| {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        for layer in 0..48u16 {
            let code = LayerCode {
                layer,
                kind: CodeKind::RAW_K,
                dtype: CodeDType::U8,
                shape: vec![1 << 20],
                bytes: vec![layer as u8; 1 << 20],
            };
            tx.try_send(CodeFrame::new(job, code)).unwrap();
        }
        drop(tx);
        let (reply, answer) = tokio::sync::oneshot::channel();
        transfer
            .send_message(TransferOutMsg::Send(
                SendJob {
                    job,
                    connection: to.clone(),
                    trace: TraceContext::new(),
                    frames: rx,
                    cancel: cancel.clone(),
                },
                reply.into(),
            ))
            .unwrap();
        answer
    };
    let stalled_cancel = CancellationToken::new();
    let stalled_job = JobId::random();
    // Sent first: `send` puts the job in the actor's mailbox before it returns, so the
    // reader's job comes after it there (no pause needed to order them).
    let stalled = tokio::spawn(send(stalled_job, &consumers[0].1, &stalled_cancel));
    // The reader's consumer reads its job to the end.
    let reader_conn = consumers[1].2.clone();
    let reading = tokio::spawn(async move {
        let mut receiver = reader_conn.accept_job().await.unwrap();
        let mut frames = 0;
        while receiver.next_frame().await.unwrap().is_some() {
            frames += 1;
        }
        frames
    });
    let report = send(JobId::random(), &consumers[1].1, &CancellationToken::new())
        .await
        .unwrap()
        .unwrap();
    assert!(report.wire_bytes > 48 << 20);
    assert_eq!(reading.await.unwrap(), 48);
    // The stalled job is still under way, and cancelling it ends it.
    assert!(!stalled.is_finished());
    stalled_cancel.cancel();
    let ended = stalled.await.unwrap().unwrap();
    assert!(matches!(ended, Err(TransferError::Cancelled)), "{ended:?}");
}

/// Batched decode: the consumer decodes concurrent jobs in one batch (one forward pass per step for
/// all of them), and each job's tokens are those it gets alone. Each caller takes its first token
/// and then nothing until all three have one, so all three are in the decode loop together (a job
/// whose caller is not reading waits in the batch); then all three are read at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_jobs_decode_in_one_batch_with_the_tokens_each_gets_alone() {
    let m = models();
    let ca = ClusterCa::generate("test").unwrap();
    let opts = PipelineOptions {
        token_queue: 1,
        ..PipelineOptions::default()
    };
    let pipeline = Pipeline::start(
        &ca,
        Arc::clone(&m.base),
        Arc::clone(&m.expert),
        opts,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let base = prompt(m);
    // Three prompts of different lengths: the jobs sit at different positions.
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| base[..base.len() - 7 * i].to_vec())
        .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| reference(m, raw_codec().codec.as_ref(), p))
        .collect();
    let before = pipeline.decode_stats();
    let mut running = Vec::new();
    for p in &prompts {
        let mut job = pipeline.start_job(spec(p, raw_codec())).await.unwrap();
        let Some(Step::Tokens(first)) = job.next().await else {
            panic!("no first token");
        };
        running.push((job, first));
    }
    let outputs = futures::future::join_all(running.into_iter().map(|(job, first)| async move {
        let out = job.wait().await.unwrap();
        first.into_iter().chain(out.tokens).collect::<Vec<_>>()
    }))
    .await;
    for (i, (got, want)) in outputs.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "job {i} ({} prompt tokens)", prompts[i].len());
    }
    let stats = pipeline.decode_stats();
    assert_eq!(stats.rows - before.rows, 3 * MAX_TOKENS as u64);
    assert!(
        stats.widest >= 2 && stats.steps - before.steps < 3 * MAX_TOKENS as u64,
        "the jobs were never decoded together: {stats:?}"
    );
    pipeline.shutdown().await;
}
