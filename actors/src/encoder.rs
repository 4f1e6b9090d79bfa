//! The encoder actor: takes a job's layer captures as the producer finishes them, runs the
//! codec's `encode_layer` on each (on a blocking thread: a translator's encode is a matmul) and
//! hands the codes on to the transfer as [`CodeFrame`]s, stamped with the translator version
//! when the mode has one. Encodes run one job at a time.

use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use scd_models::{CodecError, LayerCapture};
use scd_transport::{CodeFrame, JobId};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::blocking::{self, run_and_reply, Interrupted, Outlet};
use crate::job::JobCodec;
use crate::timeline::{LayerBytes, Span};

/// Errors of a job's encoding.
#[derive(Debug, thiserror::Error)]
pub enum EncoderError {
    /// The codec could not encode a layer.
    #[error("encoding layer {layer}: {source}")]
    Codec {
        /// The layer.
        layer: usize,
        /// Why.
        source: CodecError,
    },
    /// The transfer stopped taking frames (it failed, or the job ended there).
    #[error("the transfer stopped taking frames")]
    TransferGone,
    /// The job was cancelled.
    #[error("encoding cancelled")]
    Cancelled,
    /// The encoder's thread failed (a panic in codec code).
    #[error("encoder thread failed: {0}")]
    Internal(String),
}

/// What the encoder did for a job.
#[derive(Debug, Clone, Default)]
pub struct EncodeReport {
    /// First capture taken to last frame handed on; `None` when no capture came (oracle).
    pub span: Option<Span>,
    /// Code bytes per layer.
    pub layer_bytes: Vec<LayerBytes>,
    /// Time spent encoding, all layers together (the span also holds the waits for captures).
    pub busy: std::time::Duration,
    /// Time spent waiting for the transfer to take frames: the link, not the producer, set the
    /// pace then (the producer's own cost of a job is its span less this).
    pub waited_for_link: std::time::Duration,
}

/// The encoder actor (stateless: the codec comes with each job).
pub struct Encoder;

/// One job's encoding.
pub struct EncodeJob {
    /// The job.
    pub job: JobId,
    /// The job's codec.
    pub codec: JobCodec,
    /// Captures from the producer, in layer order.
    pub captures: mpsc::Receiver<LayerCapture>,
    /// Frames to the transfer; dropped when the encoding ends.
    pub frames: mpsc::Sender<CodeFrame>,
    /// The job's cancellation.
    pub cancel: CancellationToken,
}

/// Messages of the encoder.
pub enum EncoderMsg {
    /// Encode a job's captures as they come.
    Encode(EncodeJob, RpcReplyPort<Result<EncodeReport, EncoderError>>),
}

impl Actor for Encoder {
    type Msg = EncoderMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (): (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        (): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EncoderMsg::Encode(job, reply) => {
                run_and_reply("encoding", reply, EncoderError::Internal, move |rt| {
                    encode(rt, job)
                })
                .await;
            }
        }
        Ok(())
    }
}

fn encode(rt: &Handle, job: EncodeJob) -> Result<EncodeReport, EncoderError> {
    let EncodeJob {
        job,
        codec,
        mut captures,
        frames,
        cancel,
    } = job;
    let frames = Outlet::new(frames, cancel.clone());
    let interrupted = |e| match e {
        Interrupted::Cancelled => EncoderError::Cancelled,
        Interrupted::Closed => EncoderError::TransferGone,
    };
    let mut report = EncodeReport::default();
    let mut start = None;
    let mut codes = Vec::new();
    while let Some(capture) = blocking::recv(rt, &mut captures, &cancel).map_err(interrupted)? {
        let began = Instant::now();
        start.get_or_insert(began);
        codec
            .codec
            .encode_layer(&capture, &mut codes)
            .map_err(|source| EncoderError::Codec {
                layer: capture.layer,
                source,
            })?;
        let encoded = Instant::now();
        report.busy += encoded - began;
        report.layer_bytes.push(LayerBytes {
            layer: capture.layer as u16,
            bytes: codes.iter().map(|c| c.bytes.len()).sum(),
            encoded,
        });
        for code in codes.drain(..) {
            let mut frame = CodeFrame::new(job, code);
            if let Some(hash) = codec.translator {
                frame = frame.with_translator(hash);
            }
            let handing = Instant::now();
            frames.send(rt, frame).map_err(interrupted)?;
            report.waited_for_link += handing.elapsed();
        }
    }
    frames.finish();
    report.span = start.map(|start| Span {
        start,
        end: Instant::now(),
    });
    Ok(report)
}
