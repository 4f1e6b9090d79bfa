//! The in-process pipeline: a producer node (producer, encoder, outgoing transfer) and a
//! consumer node (incoming transfer, decoder) in one process, each with its own QUIC endpoint on
//! loopback under one cluster CA and connected to each other, and [`Pipeline::run_job`], which
//! takes one job through them.
//!
//! Control goes through the actors' mailboxes (one message per stage per job, with a reply
//! port); a job's data goes through bounded channels made for the job: captures (producer to
//! encoder), frames (encoder to transfer), the QUIC job stream (bounded by the transport),
//! arrivals (transfer to decoder) and tokens (decoder to caller). Each job has a cancellation
//! token, a child of the pipeline's: the first stage that fails cancels the job, the others
//! wind down, and the job's error is the one that caused it, not its knock-on effects.
//!
//! Each stage takes one job at a time, in the order jobs were submitted (submission is
//! serialised so that every stage sees the same order); jobs overlap across stages, so job 2
//! can be prefilled while job 1 decodes.
//!
//! Supervision is minimal in this slice: actors are spawned unlinked and never fail on a job
//! (a job's error goes to its reply port), so the next job finds them ready; an actor that
//! panics is gone and the jobs that need it fail with [`JobError::ActorGone`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorCell, ActorRef, SpawnErr};
use scd_models::{Llama, StopReason};
use scd_transport::pki::PkiError;
use scd_transport::{
    AcceptError, BindError, ClusterCa, ConnectError, Connection, Endpoint, JobId, Role,
};
use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::decode_loop::{DecodeLoop, DecodeStats};
use crate::decoder::{Decoder, DecoderArgs, DecoderMsg};
use crate::encoder::Encoder;
use crate::halves::{self, ask, cause, ConsumerJob, Decoding, ProducerActors, ProducerDone};
use crate::job::{JobError, JobSpec, PipelineOptions};
use crate::producer::{Producer, ProducerArgs};
use crate::reply::{Step, TokenSource};
use crate::timeline::Timeline;
use crate::transfer::{TransferIn, TransferInArgs, TransferInMsg, TransferOut};

/// The certificate names of the two nodes.
const PRODUCER_NODE: &str = "producer-0";
const CONSUMER_NODE: &str = "consumer-0";

/// Errors starting a pipeline.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A node certificate could not be issued.
    #[error("issuing a node certificate: {0}")]
    Pki(#[from] PkiError),
    /// An endpoint could not be bound.
    #[error("binding an endpoint: {0}")]
    Bind(#[from] BindError),
    /// The consumer node's address could not be read.
    #[error("reading the consumer node's address: {0}")]
    Address(std::io::Error),
    /// The producer node could not connect to the consumer node.
    #[error("connecting the producer node to the consumer node: {0}")]
    Connect(#[from] ConnectError),
    /// The consumer node could not accept the producer node.
    #[error("accepting the producer node: {0}")]
    Accept(#[from] AcceptError),
    /// The consumer node's endpoint closed before the producer node connected.
    #[error("the consumer node's endpoint closed while starting")]
    EndpointClosed,
    /// An actor could not be started.
    #[error("starting an actor: {0}")]
    Spawn(#[from] SpawnErr),
    /// An actor stopped while starting.
    #[error("the {0} actor stopped while starting")]
    ActorStopped(&'static str),
    /// The decode loop's thread could not start.
    #[error("starting the decode loop: {0}")]
    DecodeLoop(std::io::Error),
}

/// A finished job.
#[derive(Debug, Clone)]
pub struct JobOutput {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub stop: StopReason,
    /// When each stage ran.
    pub timeline: Timeline,
}

/// A job on its way: a [`TokenSource`] of its tokens as they come, or [`RunningJob::wait`] for
/// all of them.
pub struct RunningJob {
    /// The job.
    pub id: JobId,
    submitted: Instant,
    decoding: Decoding,
    /// The producer half, settled as it goes, so that its failure cancels the job at once.
    produced: JoinHandle<Result<ProducerDone, Vec<JobError>>>,
}

impl TokenSource for RunningJob {
    /// The timeline and why generation stopped, or the cause of the failure.
    type Outcome = Result<(Timeline, StopReason), JobError>;

    async fn next(&mut self) -> Option<Step> {
        self.decoding.next().await
    }

    async fn finish(self) -> Self::Outcome {
        let decoded = self.decoding.finish().await;
        let produced = self
            .produced
            .await
            .map_err(|e| JobError::Internal(e.to_string()))?;
        let (produced, decoded) = match (produced, decoded) {
            (Ok(p), Ok(d)) => (p, d),
            (p, d) => {
                let mut errors = p.err().unwrap_or_default();
                errors.extend(d.err());
                return Err(cause(errors));
            }
        };
        let mut timeline = Timeline::new(self.submitted);
        timeline.prefill = produced.prefill;
        timeline.encode = produced.encoded.span;
        timeline.layer_bytes = produced.encoded.layer_bytes;
        timeline.transfer = Some(produced.sent.span);
        timeline.wire_bytes = produced.sent.wire_bytes;
        timeline.arrivals = decoded.arrivals;
        timeline.rebuild = Some(decoded.rebuild);
        timeline.first_token = decoded.first_token;
        timeline.finished = Instant::now();
        Ok((timeline, decoded.stop))
    }
}

impl RunningJob {
    /// Reads every token and waits for the job's end.
    pub async fn wait(self) -> Result<JobOutput, JobError> {
        let (tokens, outcome) = self.collect().await;
        let (timeline, stop) = outcome?;
        Ok(JobOutput {
            tokens,
            stop,
            timeline,
        })
    }
}

/// The producer node's actors and endpoint, and its connection to the consumer node.
struct ProducerNode {
    endpoint: Endpoint,
    actors: ProducerActors,
    to_consumer: Connection,
}

/// The consumer node's actors and endpoint.
struct ConsumerNode {
    endpoint: Endpoint,
    transfer: ActorRef<TransferInMsg>,
    decoder: ActorRef<DecoderMsg>,
    decode_loop: DecodeLoop,
}

/// A producer node and a consumer node in one process, connected over QUIC on loopback.
pub struct Pipeline {
    producer: ProducerNode,
    consumer: ConsumerNode,
    opts: PipelineOptions,
    cancel: CancellationToken,
    actors: Vec<(ActorCell, JoinHandle<()>)>,
    /// Held while a job's requests go out, so that every stage sees jobs in the same order.
    /// Each stage takes its jobs one at a time, first come first served; two jobs reaching two
    /// stages in opposite orders would wait on each other across the bounded queues.
    submit: Mutex<()>,
}

/// The actors of both nodes.
type Actors = (
    ProducerActors,
    ActorRef<TransferInMsg>,
    ActorRef<DecoderMsg>,
);

/// Spawns the actors of both nodes, each kept in `actors` as soon as it runs (so a failure
/// half-way can stop those already started).
async fn spawn_actors(
    actors: &mut Vec<(ActorCell, JoinHandle<()>)>,
    base: Arc<Llama>,
    expert: Arc<Llama>,
    from_producer: Connection,
    decode_loop: DecodeLoop,
    cancel: &CancellationToken,
) -> Result<Actors, StartError> {
    let (producer, h) = Actor::spawn(
        None,
        Producer,
        ProducerArgs {
            model: base,
            prefix_cache: None,
            documents: None,
        },
    )
    .await?;
    actors.push((producer.get_cell(), h));
    let (encoder, h) = Actor::spawn(None, Encoder, ()).await?;
    actors.push((encoder.get_cell(), h));
    let (transfer, h) = Actor::spawn(None, TransferOut, ()).await?;
    actors.push((transfer.get_cell(), h));
    let args = TransferInArgs {
        cancel: cancel.clone(),
        unexpected: None,
    };
    let (transfer_in, h) = Actor::spawn(None, TransferIn, args).await?;
    actors.push((transfer_in.get_cell(), h));
    transfer_in
        .send_message(TransferInMsg::Connection(from_producer))
        .map_err(|_| StartError::ActorStopped("consumer transfer"))?;
    let args = DecoderArgs {
        model: expert,
        decode_loop,
    };
    let (decoder, h) = Actor::spawn(None, Decoder, args).await?;
    actors.push((decoder.get_cell(), h));
    let producer = ProducerActors {
        producer,
        encoder,
        transfer,
    };
    Ok((producer, transfer_in, decoder))
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

impl Pipeline {
    /// Starts both nodes: endpoints on `127.0.0.1:0` with certificates from `ca`, the producer
    /// node connected to the consumer node, and their actors. `base` is the producer's model,
    /// `expert` the consumer's. Cancelling `cancel` stops every job.
    pub async fn start(
        ca: &ClusterCa,
        base: Arc<Llama>,
        expert: Arc<Llama>,
        opts: PipelineOptions,
        cancel: CancellationToken,
    ) -> Result<Self, StartError> {
        let producer_ep = Endpoint::bind(
            loopback(),
            &ca.issue(PRODUCER_NODE, Role::Node)?,
            opts.transport.clone(),
        )?;
        let consumer_ep = Endpoint::bind(
            loopback(),
            &ca.issue(CONSUMER_NODE, Role::Node)?,
            opts.transport.clone(),
        )?;
        let addr = consumer_ep.local_addr().map_err(StartError::Address)?;
        let accept = async {
            let accepting = consumer_ep
                .accept()
                .await
                .ok_or(StartError::EndpointClosed)?;
            Ok::<_, StartError>(accepting.complete().await?)
        };
        let connect =
            async { Ok::<_, StartError>(producer_ep.connect(addr, CONSUMER_NODE).await?) };
        let (to_consumer, from_producer) = tokio::try_join!(connect, accept)?;

        let mut actors = Vec::new();
        let decode_loop = DecodeLoop::start().map_err(StartError::DecodeLoop)?;
        let spawned = spawn_actors(
            &mut actors,
            base,
            expert,
            from_producer,
            decode_loop.clone(),
            &cancel,
        )
        .await;
        let (producer, transfer_in, decoder) = match spawned {
            Ok(refs) => refs,
            Err(e) => {
                for (cell, _) in &actors {
                    cell.stop(None);
                }
                return Err(e);
            }
        };
        Ok(Self {
            producer: ProducerNode {
                endpoint: producer_ep,
                actors: producer,
                to_consumer,
            },
            consumer: ConsumerNode {
                endpoint: consumer_ep,
                transfer: transfer_in,
                decoder,
                decode_loop,
            },
            opts,
            cancel,
            actors,
            submit: Mutex::new(()),
        })
    }

    /// What the consumer's decode loop has done so far: how many jobs it decoded together.
    pub fn decode_stats(&self) -> DecodeStats {
        self.consumer.decode_loop.stats()
    }

    /// Runs one job to its end: the generated tokens and the timeline, or the error of the
    /// stage that failed.
    pub async fn run_job(&self, spec: JobSpec) -> Result<JobOutput, JobError> {
        self.start_job(spec).await?.wait().await
    }

    /// Starts one job: the consumer node first (so the job stream has somewhere to go), then
    /// the producer node's stages.
    pub async fn start_job(&self, spec: JobSpec) -> Result<RunningJob, JobError> {
        let submitted = Instant::now();
        spec.split()?;
        let cancel = self.cancel.child_token();
        let order = self.submit.lock().await;
        let started = self.dispatch(spec, submitted, &cancel).await;
        drop(order);
        if started.is_err() {
            // Stages already told of the job stop waiting for the others.
            cancel.cancel();
        }
        started
    }

    async fn dispatch(
        &self,
        spec: JobSpec,
        submitted: Instant,
        cancel: &CancellationToken,
    ) -> Result<RunningJob, JobError> {
        let q = &self.opts;
        let (inbound_tx, inbound_rx) = mpsc::channel(q.arrival_queue.max(1));
        let job = spec.id;
        let prefix = spec.split().map(|(p, _)| p.to_vec()).unwrap_or_default();

        let consumer = &self.consumer;
        ask(&consumer.transfer, "consumer transfer", |reply| {
            TransferInMsg::Expect {
                job,
                inbound: inbound_tx,
                reply,
            }
        })?
        .await
        .map_err(|_| JobError::ActorGone("consumer transfer"))?;
        let decode = ConsumerJob {
            job,
            prompt: spec.prompt,
            codec: spec.codec.clone(),
            params: spec.params,
            resume: Vec::new(),
            inbound: inbound_rx,
            shadow: None,
        };
        let decoding = halves::start_decode(&consumer.decoder, decode, q, cancel)?;
        let producer = &self.producer;
        let produced = producer.actors.start(
            job,
            scd_transport::TraceContext::new(),
            prefix,
            spec.codec,
            producer.to_consumer.clone(),
            q,
            cancel,
        )?;
        let cancel = cancel.clone();
        let produced = tokio::spawn(async move { produced.settle(&cancel).await });
        Ok(RunningJob {
            id: job,
            submitted,
            decoding,
            produced,
        })
    }

    /// Stops every job and actor and closes both endpoints.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        for (cell, _) in &self.actors {
            cell.stop(None);
        }
        for (_, handle) in self.actors {
            let _ = handle.await;
        }
        self.producer.endpoint.close();
        self.consumer.endpoint.close();
        self.producer.endpoint.wait_idle().await;
        self.consumer.endpoint.wait_idle().await;
    }
}
