//! The admin endpoint: calls from clients holding an admin certificate of the cluster CA
//! (`scd submit`, `scd jobs watch|cancel`), on the node's QUIC endpoint.
//!
//! - `Submit`: the prompt is tokenised here (chat template applied on request), checked against
//!   the model's context and the sampling ranges, and queued as a job record under the client's
//!   job id; then followed as for `Watch`.
//! - `Watch`: the job's state changes and its tokens as the consumer writes them into the record,
//!   then a final status whose detail is the record's summary as JSON.
//! - `Cancel`: the record is cancelled; the nodes working on it stop.
//!
//! - `Inspect`: the cluster's state as JSON (nodes, pools, translators, jobs, one job,
//!   documents).
//! - `Change`: publish, activate or roll back a translator version; add a document.
//!
//! A client that goes away stops the following, not the job: it can `Watch` it again.

use std::sync::Arc;

use crate::client::ClientError;
use crate::follow::Following;
use crate::node::jobs::{check_prompt, Work};
use crate::reply::{ReplyText, Step, TokenSource};
use scd_models::Sampling;
use scd_scheduler::jobs::JobError as RecordError;
use scd_scheduler::{
    DocumentError, DocumentRegistry, JobId, JobRecord, JobRequest, JobState, TranslatorError,
};
use scd_transport::{
    error_code, AdminError, AdminReplies, AdminRequest, Connection, Control, Prompt, SubmitRequest,
};

/// An admin call's failure: the error code and message the client gets.
struct Refused {
    code: u32,
    message: String,
}

impl Refused {
    fn new(code: u32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<ClientError> for Refused {
    fn from(e: ClientError) -> Self {
        let code = match &e {
            ClientError::NoConsumer { .. }
            | ClientError::NoProducer { .. }
            | ClientError::FanOut { .. }
            | ClientError::Documents(_)
            | ClientError::Request(_) => error_code::REFUSED,
            ClientError::Busy(_) => error_code::BUSY,
            ClientError::Gone(_) | ClientError::Record(RecordError::NotFound(_)) => {
                error_code::NOT_FOUND
            }
            _ => error_code::INTERNAL,
        };
        Self::new(code, e.to_string())
    }
}

/// Serves the admin calls of one client connection until it closes or the node stops.
pub(crate) async fn serve(work: Arc<Work>, conn: Connection) {
    let client = conn.peer().name.clone();
    loop {
        let call = tokio::select! {
            () = work.cancel.cancelled() => return,
            c = conn.accept_admin() => c,
        };
        match call {
            Ok(call) => {
                let work = work.clone();
                let client = client.clone();
                tokio::spawn(async move { handle(&work, &client, call).await });
            }
            Err(AdminError::ConnectionLost(_)) => return,
            Err(e) => tracing::warn!(client, error = %e, "a bad admin call"),
        }
    }
}

async fn handle(work: &Work, client: &str, call: AdminRequest) {
    let AdminRequest {
        request,
        mut replies,
    } = call;
    let job = request.job_id();
    tracing::info!(client, ?job, "admin call");
    let result = match request {
        Control::Submit(r) => submit(work, r, &mut replies).await,
        Control::Watch { job_id } => follow(work, job_id, &mut replies, None, IfGone::Leave).await,
        Control::Cancel { job_id, reason } => cancel(work, job_id, &reason, &mut replies).await,
        Control::Inspect { topic } => inspect(work, &topic, &mut replies).await,
        Control::Change { topic, body } => change(work, &topic, &body, &mut replies).await,
        _ => Err(Refused::new(
            error_code::PROTOCOL,
            "not an admin request: send Submit, Watch, Cancel, Inspect or Change",
        )),
    };
    if let Err(refused) = result {
        let error = Control::Error {
            job_id: job,
            code: refused.code,
            message: refused.message,
        };
        if let Err(e) = replies.send(error).await {
            tracing::debug!(client, error = %e, "the admin client went away");
        }
    }
    replies.finish();
}

/// The job request of a submission, tokenised and checked here so that a bad one is refused at
/// once, with the reason, instead of failing later on a producer.
fn request_of(work: &Work, r: &SubmitRequest) -> Result<JobRequest, Refused> {
    let tok = &work.served.tokenizer;
    let refuse = |m: String| Refused::new(error_code::REFUSED, m);
    let prompt = match &r.prompt {
        Prompt::Tokens(t) => t.clone(),
        Prompt::Text(text) => {
            let text = if r.chat {
                let chat = [scd_models::tokenizer::ChatMessage::user(text.clone())];
                tok.apply_chat_template(&chat, true)
                    .map_err(|e| refuse(format!("applying the chat template: {e}")))?
            } else {
                text.clone()
            };
            tok.encode(&text, false)
                .map_err(|e| refuse(format!("tokenising the prompt: {e}")))?
        }
    };
    let temperature = r.temperature_milli as f32 / 1000.0;
    let top_p = r.top_p_milli as f32 / 1000.0;
    Sampling::from_params(temperature, top_p).map_err(|e| refuse(e.to_string()))?;
    let request = JobRequest {
        prompt,
        max_tokens: r.max_tokens,
        temperature,
        top_p,
        seed: r.seed,
        stop_tokens: tok.stop_ids().to_vec(),
        documents: r.documents.clone(),
    };
    check_prompt(&work.served, &request).map_err(|e| refuse(e.to_string()))?;
    Ok(request)
}

async fn submit(work: &Work, r: SubmitRequest, replies: &mut AdminReplies) -> Result<(), Refused> {
    let request = request_of(work, &r)?;
    let tokens = request.prompt.len();
    let trace = match &work.telemetry {
        Some(t) => t.start_job(&r.trace, r.job_id, &r.expert, r.mode),
        None => r.trace.clone(),
    };
    let experts: Vec<String> = std::iter::once(r.expert.clone())
        .chain(r.fan_out.iter().cloned())
        .collect();
    let submitted = work
        .client
        .submit_fan_out(r.job_id, &experts, r.mode, request, trace)
        .await;
    match submitted {
        Ok(()) => {}
        // A retried submit: the first one landed; follow it.
        Err(ClientError::Record(RecordError::AlreadyExists(_))) => {}
        Err(e) => return Err(e.into()),
    }
    let detail = format!(
        "queued on {}: {} prompt tokens, expert {}, mode {}",
        work.id,
        tokens,
        experts.join(" + "),
        r.mode
    );
    send(replies, status(r.job_id, JobState::Queued, detail)).await?;
    follow(
        work,
        r.job_id,
        replies,
        Some(JobState::Queued),
        IfGone::Cancel,
    )
    .await
}

/// What a client that goes away before its job ends means for the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IfGone {
    /// It submitted the job and would have read the answer: nobody else will.
    Cancel,
    /// It only watched.
    Leave,
}

async fn cancel(
    work: &Work,
    job: JobId,
    reason: &str,
    replies: &mut AdminReplies,
) -> Result<(), Refused> {
    let record = work.client.cancel(job, reason).await.map_err(|e| match e {
        ClientError::Record(RecordError::InvalidTransition { from, .. }) => Refused::new(
            error_code::REFUSED,
            format!("job {job} is {from}: only an unfinished job can be cancelled"),
        ),
        e => e.into(),
    })?;
    send(
        replies,
        status(job, record.state, summary(&record, &work.served.tokenizer)),
    )
    .await
}

/// Most jobs an `Inspect` of `jobs` lists (the newest first, live and archived).
const MAX_LISTED_JOBS: usize = 200;

/// Reads the cluster's state for an operator: `nodes`, `pools`, `jobs` (newest first, with
/// their summaries) or `job/<id>` (the whole record), as JSON.
async fn inspect(work: &Work, topic: &str, replies: &mut AdminReplies) -> Result<(), Refused> {
    let internal = |e: String| Refused::new(error_code::INTERNAL, e);
    let body = match topic {
        "nodes" => {
            let nodes = work.client.nodes().await?;
            serde_json::to_value(nodes.values().collect::<Vec<_>>())
                .map_err(|e| internal(e.to_string()))?
        }
        "translators" => {
            let pairs = work
                .translators
                .registry()
                .pairs()
                .await
                .map_err(Refused::from)?;
            serde_json::to_value(pairs).map_err(|e| internal(e.to_string()))?
        }
        "pools" => {
            let pools = scd_scheduler::service::read_pools(work.store.as_ref(), &work.keys)
                .await
                .map_err(|e| internal(e.to_string()))?;
            serde_json::to_value(pools).map_err(|e| internal(e.to_string()))?
        }
        "jobs" => {
            // The live records and the newest archived ones; the rest of the archive is not
            // read.
            let jobs = work
                .jobs
                .list_newest(MAX_LISTED_JOBS)
                .await
                .map_err(|e| internal(e.to_string()))?;
            let list: Vec<serde_json::Value> = jobs
                .iter()
                .map(|j| {
                    serde_json::from_str(&summary(j, &work.served.tokenizer)).unwrap_or_default()
                })
                .collect();
            serde_json::Value::Array(list)
        }
        "documents" => documents(work).await?,
        t => match t.strip_prefix("job/").map(str::parse::<JobId>) {
            Some(Ok(id)) => {
                let job = work.client.get(id).await?;
                serde_json::to_value(job).map_err(|e| internal(e.to_string()))?
            }
            _ => {
                let known = "nodes, pools, translators, jobs, job/<id> or documents";
                let message = format!("unknown topic {t:?}: {known}");
                return Err(Refused::new(error_code::PROTOCOL, message));
            }
        },
    };
    report(replies, body).await
}

/// Sends `body` as the call's `Report`, if it fits one admin frame.
async fn report(replies: &mut AdminReplies, body: serde_json::Value) -> Result<(), Refused> {
    let body = body.to_string();
    if body.len() > (60 << 10) {
        return Err(Refused::new(
            error_code::REFUSED,
            format!("the answer is {} bytes, over one admin frame", body.len()),
        ));
    }
    send(replies, Control::Report { body }).await
}

impl From<TranslatorError> for Refused {
    fn from(e: TranslatorError) -> Self {
        let code = match &e {
            TranslatorError::UnknownVersion { .. } => error_code::NOT_FOUND,
            TranslatorError::VersionExists { .. }
            | TranslatorError::NoHistory { .. }
            | TranslatorError::InvalidId(_) => error_code::REFUSED,
            _ => error_code::INTERNAL,
        };
        Self::new(code, e.to_string())
    }
}

/// The arguments of a `translators/*` change. `producer` defaults to this node's base model.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TranslatorArgs {
    #[serde(default)]
    producer: Option<String>,
    consumer: String,
    #[serde(default)]
    version: Option<String>,
    /// `publish`: the translator folder, as every node of the pair reads it.
    #[serde(default)]
    blob: Option<String>,
    /// `publish`: make it live at once.
    #[serde(default)]
    activate: bool,
}

/// The arguments of `documents/add`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DocumentArgs {
    /// The document's text (tokenised here, with the base model's tokenizer, as it is).
    text: String,
    /// A name for people.
    #[serde(default)]
    name: Option<String>,
}

/// Every document (without its tokens), with the producers that announce it compiled.
async fn documents(work: &Work) -> Result<serde_json::Value, Refused> {
    let internal = |e: String| Refused::new(error_code::INTERNAL, e);
    let records = DocumentRegistry::new(work.store.clone(), work.keys.clone())
        .list()
        .await
        .map_err(|e| internal(e.to_string()))?;
    let nodes = work.client.nodes().await?;
    let list = records
        .iter()
        .map(|d| {
            let held_by: Vec<&str> = nodes
                .values()
                .filter(|n| n.documents.contains(&d.id))
                .map(|n| n.id.as_str())
                .collect();
            serde_json::json!({
                "id": d.id, "name": d.name, "base": d.base, "tokens": d.tokens.len(),
                "added_at_ms": d.added_at_ms, "held_by": held_by,
            })
        })
        .collect();
    Ok(serde_json::Value::Array(list))
}

/// Changes the cluster's state: `translators/publish` (checks the folder here, publishes its
/// manifest, and activates it if asked), `translators/activate`, `translators/rollback`. The
/// nodes of the pair follow the live version on their own. `documents/add` records a
/// document (tokenised here) that jobs may then name.
async fn change(
    work: &Work,
    topic: &str,
    body: &str,
    replies: &mut AdminReplies,
) -> Result<(), Refused> {
    let refuse = |m: String| Refused::new(error_code::REFUSED, m);
    if topic == "documents/add" {
        let args: DocumentArgs = serde_json::from_str(body)
            .map_err(|e| refuse(format!("the arguments of {topic}: {e}")))?;
        let tokens = work
            .served
            .tokenizer
            .encode(&args.text, false)
            .map_err(|e| refuse(format!("tokenising the document: {e}")))?;
        let record = DocumentRegistry::new(work.store.clone(), work.keys.clone())
            .add(&work.served.base_id, tokens, args.name)
            .await
            .map_err(|e| match e {
                DocumentError::Store(_) | DocumentError::Codec(_) => {
                    Refused::new(error_code::INTERNAL, e.to_string())
                }
                _ => refuse(e.to_string()),
            })?;
        tracing::info!(
            topic,
            document = record.id,
            tokens = record.tokens.len(),
            "admin change"
        );
        let body = serde_json::json!({
            "id": record.id, "tokens": record.tokens.len(), "name": record.name,
            "base": record.base,
        });
        return report(replies, body).await;
    }
    let args: TranslatorArgs =
        serde_json::from_str(body).map_err(|e| refuse(format!("the arguments of {topic}: {e}")))?;
    let producer = args
        .producer
        .clone()
        .unwrap_or_else(|| work.served.base_id.clone());
    let registry = work.translators.registry();
    let version = || {
        args.version
            .clone()
            .ok_or_else(|| refuse(format!("{topic} needs a version")))
    };
    let body = match topic {
        "translators/publish" => {
            let blob = args
                .blob
                .clone()
                .ok_or_else(|| refuse("translators/publish needs the translator's folder".into()))?;
            let manifest = work
                .translators
                .manifest_for(&producer, &args.consumer, args.version.as_deref(), &blob)
                .await
                .map_err(|e| refuse(e.to_string()))?;
            registry.publish(&manifest).await?;
            let active = match args.activate {
                true => Some(
                    registry
                        .activate(&producer, &args.consumer, &manifest.version)
                        .await?,
                ),
                false => None,
            };
            serde_json::json!({ "published": manifest, "active": active })
        }
        "translators/activate" => {
            let active = registry
                .activate(&producer, &args.consumer, &version()?)
                .await?;
            serde_json::json!({ "active": active })
        }
        "translators/rollback" => {
            let active = registry.rollback(&producer, &args.consumer).await?;
            serde_json::json!({ "active": active })
        }
        t => {
            return Err(Refused::new(
                error_code::PROTOCOL,
                format!("unknown change {t:?}: translators/publish, translators/activate, translators/rollback or documents/add"),
            ))
        }
    };
    tracing::info!(topic, producer, consumer = args.consumer, "admin change");
    report(replies, body).await
}

fn status(job_id: JobId, state: JobState, detail: String) -> Control {
    Control::JobStatus {
        job_id,
        state,
        detail,
    }
}

async fn send(replies: &mut AdminReplies, msg: Control) -> Result<(), Refused> {
    replies
        .send(msg)
        .await
        .map_err(|e| Refused::new(error_code::INTERNAL, e.to_string()))
}

/// The record's summary a finished call ends with, as JSON; a fan-out's other experts' texts
/// come decoded with `tok`.
fn summary(job: &JobRecord, tok: &scd_models::tokenizer::Tokenizer) -> String {
    let outputs: serde_json::Map<String, serde_json::Value> = job
        .outputs
        .iter()
        .map(|(e, o)| {
            let text = tok.decode(&o.tokens, true).unwrap_or_default();
            (e.clone(), serde_json::Value::String(text))
        })
        .collect();
    serde_json::json!({
        "fan_out": job.fan_out,
        "outputs_text": outputs,
        "job": job.id,
        "state": job.state,
        "created_ms": job.created_at_ms,
        "expert": job.expert,
        "mode": job.mode,
        "producer": job.producer,
        "consumer": job.consumer,
        "attempts": job.attempts,
        "error": job.error,
        "stop": job.output.as_ref().map(|o| o.stop.clone()),
        "tokens": job.output.as_ref().map_or(0, |o| o.tokens.len()),
        "payload_bytes": job.payload_bytes,
        "cached_prefix_tokens": job.cached_prefix_tokens,
        "translator": job.translator.map(|h| h.to_string()),
        "ranks": job.ranks,
        "mode_choice": job.mode_choice.as_ref().map(|c| &c.reason),
        "fallback": job.fallback,
        "timings_ms": job.timings_ms,
        "traceparent": job.trace.get("traceparent"),
    })
    .to_string()
}

/// The status line of a job that moved to a new state.
fn moved(job: &JobRecord, tok: &scd_models::tokenizer::Tokenizer) -> Control {
    let detail = if job.state.is_finished() {
        summary(job, tok)
    } else {
        match (&job.producer, &job.consumer) {
            (Some(p), Some(c)) => format!("producer {p}, consumer {c}"),
            _ => String::new(),
        }
    };
    status(job.id, job.state, detail)
}

/// Sends the client the job's reply as it comes: its text, each new state (after `shown`,
/// which the client has already), and the final record's summary.
async fn follow(
    work: &Work,
    job: JobId,
    replies: &mut AdminReplies,
    mut shown: Option<JobState>,
    if_gone: IfGone,
) -> Result<(), Refused> {
    let tok = &work.served.tokenizer;
    let mut following = Following::start(&work.client, job);
    let mut text = ReplyText::default();
    let gone = || async {
        if if_gone == IfGone::Cancel {
            match work
                .client
                .cancel(job, "the submitting client went away")
                .await
            {
                Ok(_) => tracing::info!(%job, "cancelled: the submitting client went away"),
                Err(e) => tracing::debug!(%job, error = %e, "cancelling an abandoned job"),
            }
        }
    };
    loop {
        let msg = tokio::select! {
            step = following.next() => match step {
                Some(Step::Tokens(tokens)) => Control::Tokens {
                    job_id: job,
                    text: text.push(tok, &tokens),
                    tokens,
                },
                Some(Step::Moved(record)) if shown != Some(record.state) => {
                    shown = Some(record.state);
                    moved(&record, tok)
                }
                Some(Step::Moved(_)) => continue,
                None => break,
            },
            () = replies.client_gone() => {
                gone().await;
                return Ok(());
            }
        };
        if let Err(e) = send(replies, msg).await {
            gone().await;
            return Err(e);
        }
    }
    following.finish().await?;
    Ok(())
}
