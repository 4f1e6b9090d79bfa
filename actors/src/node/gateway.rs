//! The gateway role: an OpenAI-compatible HTTP API on `node.http_listen`, each expert a model.
//!
//! - `GET /v1/models`: the experts live consumers serve now.
//! - `POST /v1/chat/completions`: the messages through the model's chat template;
//!   `POST /v1/completions`: the prompt as it is. Both stream with server-sent events when
//!   `stream` is true. The transfer mode is the extension field `scd_mode` (default from
//!   `[gateway] default_mode`); the extension field `scd_documents` names documents (ids of
//!   `scd docs add`) the expert reads the prompt after (mode `oracle` then, unless named).
//!
//! Every request becomes a job through the store, as `scd submit` does, and is answered from
//! the job's record as it changes ([`crate::follow`]). A request with an `Idempotency-Key`
//! header is one job however often it is sent (its id derives from the key, and a client that
//! lost its connection comes back for the answer); a client without one that goes away before
//! its answer (the connection closed, or an event stream no longer read) cancels its job. Errors have OpenAI's shape
//! (`{"error": {"message", "type", "param", "code"}}`) and status codes, so that OpenAI clients
//! report them as they would OpenAI's own.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use scd_models::tokenizer::ChatMessage;
use scd_models::Sampling;
use scd_scheduler::{JobId, JobRecord, JobRequest, JobState, Mode, TraceContext};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::client::{ClientError, ClusterClient};
use crate::config::GatewayConfig;
use crate::follow::Following;
use crate::node::bearer;
use crate::node::jobs::{check_prompt, Work};
use crate::reply::{ReplyText, Step, TokenSource};

/// Longest a request body may be.
const MAX_BODY: usize = 4 << 20;

struct Gateway {
    work: Arc<Work>,
    api_keys: Vec<String>,
    default_mode: Mode,
    /// `[gateway] max_requests_per_key` (0: none).
    per_key: usize,
    /// Unanswered requests per API key.
    in_flight: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// Serves the API on `listener` until the node stops.
pub(crate) async fn serve(work: Arc<Work>, listener: TcpListener, config: GatewayConfig) {
    let cancel = work.cancel.clone();
    let gateway = Arc::new(Gateway {
        work,
        per_key: match config.api_keys.is_empty() {
            true => 0,
            false => config.max_requests_per_key,
        },
        api_keys: config.api_keys,
        default_mode: config.default_mode,
        in_flight: Default::default(),
    });
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        // Before any body is read: a caller without a key is refused at its headers.
        .route_layer(axum::middleware::from_fn_with_state(
            gateway.clone(),
            require_key,
        ))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(gateway);
    let stopped = async move { cancel.cancelled().await };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await
    {
        tracing::warn!(error = %e, "the HTTP API stopped");
    }
}

/// An OpenAI-shaped error.
struct ApiError {
    status: StatusCode,
    /// `Retry-After`, in seconds, on a 429.
    retry_after: Option<u64>,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            retry_after: None,
            kind: "invalid_request_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            retry_after: None,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::NoConsumer { .. } | ClientError::NoProducer { .. } => {
                ApiError::bad_request(e.to_string())
                    .status(StatusCode::NOT_FOUND)
                    .code("model_not_found")
                    .param("model")
            }
            ClientError::Request(_) | ClientError::Documents(_) => {
                ApiError::bad_request(e.to_string())
            }
            // OpenAI's own answer to overload: 429 with a hint that its clients honour.
            ClientError::Busy(ref busy) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                retry_after: Some(busy.retry_after_secs()),
                kind: "rate_limit_error",
                code: Some("cluster_busy"),
                param: None,
                message: e.to_string(),
            },
            e => ApiError::server(e.to_string()),
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::bad_request("no such endpoint: this server has GET /v1/models, POST /v1/chat/completions and POST /v1/completions")
        .status(StatusCode::NOT_FOUND)
}

/// Refuses a request without one of the API keys before its handler (and so its body) runs.
async fn require_key(
    State(g): State<Arc<Gateway>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match g.authorise(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// One unanswered request of an API key; its slot is free again when this is dropped (a
/// stream's task holds it to the stream's end).
struct Slot {
    gateway: Arc<Gateway>,
    key: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut in_flight = self.gateway.lock_in_flight();
        if let Some(n) = in_flight.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                in_flight.remove(&self.key);
            }
        }
    }
}

impl Gateway {
    fn lock_in_flight(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, usize>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot of the caller's key (from `headers`, already authorised), or 429 when the key
    /// has `per_key` requests unanswered.
    fn slot(self: &Arc<Self>, headers: &HeaderMap) -> Result<Option<Slot>, ApiError> {
        if self.per_key == 0 {
            return Ok(None);
        }
        let key = bearer::given(headers).unwrap_or_default().to_owned();
        let mut in_flight = self.lock_in_flight();
        let n = in_flight.entry(key.clone()).or_insert(0);
        if *n >= self.per_key {
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                retry_after: Some(1),
                kind: "rate_limit_error",
                code: Some("rate_limit_exceeded"),
                param: None,
                message: format!(
                    "this API key has {} requests unanswered, the most this gateway takes at once ([gateway] max_requests_per_key): retry when one has ended",
                    self.per_key
                ),
            });
        }
        *n += 1;
        Ok(Some(Slot {
            gateway: self.clone(),
            key,
        }))
    }
}

impl Gateway {
    fn authorise(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.api_keys.is_empty() {
            return Ok(());
        }
        match bearer::carries_one_of(headers, &self.api_keys) {
            true => Ok(()),
            false => Err(ApiError {
                status: StatusCode::UNAUTHORIZED,
                retry_after: None,
                kind: "invalid_request_error",
                code: Some("invalid_api_key"),
                param: None,
                message: "missing or wrong API key: send Authorization: Bearer <key> with a key from the node's [gateway] api_keys".into(),
            }),
        }
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(g): State<Arc<Gateway>>) -> Result<Json<Value>, ApiError> {
    let nodes = g.work.client.nodes().await?;
    let mut experts: Vec<&str> = nodes
        .values()
        .flat_map(|n| n.consumer_models.iter().map(String::as_str))
        .collect();
    experts.sort_unstable();
    experts.dedup();
    let data: Vec<Value> = experts
        .iter()
        .map(|e| json!({"id": e, "object": "model", "created": 0, "owned_by": "scd"}))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// A message's content: a string, or the parts of a multi-part message (text parts only).
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// What both endpoints take besides the prompt (other OpenAI fields are accepted and ignored).
#[derive(Deserialize)]
struct Settings {
    model: String,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    /// Extension: the transfer mode.
    #[serde(default)]
    scd_mode: Option<Mode>,
    /// Extension: documents placed before the prompt, by id.
    #[serde(default)]
    scd_documents: Vec<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    settings: Settings,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptField,
    #[serde(flatten)]
    settings: Settings,
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the request body is not a valid request: {e}"))
            .code("invalid_request_body")
    })
}

/// Default new tokens when a request names none.
const DEFAULT_MAX_TOKENS: u32 = 256;

impl Gateway {
    fn request(&self, text: &str, s: &Settings) -> Result<JobRequest, ApiError> {
        let tok = &self.work.served.tokenizer;
        let prompt = tok
            .encode(text, false)
            .map_err(|e| ApiError::bad_request(format!("tokenising the prompt: {e}")))?;
        let temperature = s.temperature.unwrap_or(1.0);
        let top_p = s.top_p.unwrap_or(1.0);
        Sampling::from_params(temperature, top_p)
            .map_err(|e| ApiError::bad_request(e.to_string()).param("temperature"))?;
        let request = JobRequest {
            prompt,
            max_tokens: s
                .max_completion_tokens
                .or(s.max_tokens)
                .unwrap_or(DEFAULT_MAX_TOKENS),
            temperature,
            top_p,
            seed: s.seed.unwrap_or(0),
            stop_tokens: tok.stop_ids().to_vec(),
            documents: s.scd_documents.clone(),
        };
        check_prompt(&self.work.served, &request).map_err(|e| {
            ApiError::bad_request(e.to_string())
                .code("context_length_exceeded")
                .param("messages")
        })?;
        Ok(request)
    }

    /// Submits `request` as job `id` (a random one without an idempotency key); a retried
    /// request whose job exists already follows that job.
    async fn submit(
        &self,
        s: &Settings,
        request: JobRequest,
        id: Option<JobId>,
    ) -> Result<JobId, ApiError> {
        let idempotent = id.is_some();
        let id = id.unwrap_or_else(JobId::random);
        let mode = match (s.scd_mode, s.scd_documents.is_empty()) {
            (Some(m), _) => m,
            (None, true) => self.default_mode,
            (None, false) => Mode::Oracle,
        };
        let trace = match &self.work.telemetry {
            Some(t) => t.start_job(&TraceContext::new(), id, &s.model, mode),
            None => TraceContext::new(),
        };
        let submitted = self
            .work
            .client
            .submit_as(id, &s.model, mode, request.clone(), trace)
            .await;
        match submitted {
            Ok(()) => Ok(id),
            Err(ClientError::Record(scd_scheduler::JobError::AlreadyExists(_))) if idempotent => {
                // The same key for another request is the client's mistake, not a retry.
                let first = self.work.client.get(id).await?;
                if first.expert != s.model || first.request.as_ref() != Some(&request) {
                    return Err(ApiError::bad_request(
                        "this Idempotency-Key was sent before with another request: use a new key for a new request",
                    )
                    .status(StatusCode::UNPROCESSABLE_ENTITY)
                    .code("idempotency_key_reused"));
                }
                Ok(id)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The job id an `Idempotency-Key` header names (with the caller's API key, so that two
    /// callers' keys never meet), if the request has one.
    fn idempotent_id(&self, headers: &HeaderMap) -> Result<Option<JobId>, ApiError> {
        let Some(value) = headers.get("idempotency-key") else {
            return Ok(None);
        };
        let key = value
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= 255)
            .ok_or_else(|| {
                ApiError::bad_request("Idempotency-Key: 1 to 255 visible ASCII characters")
            })?;
        let caller = headers
            .get(axum::http::header::AUTHORIZATION)
            .map_or(&b""[..], |v| v.as_bytes());
        Ok(Some(JobId::derived(&[caller, key.as_bytes()])))
    }
}

/// Cancels its job when dropped armed. The gateway's handler future is dropped when its
/// client closes the connection (hyper drops a request's future then), and a stream's task
/// drops it when its client stops reading: nobody will read the answer, and the job would
/// hold a producer, a consumer and an admission slot to the end.
struct CancelOnDrop {
    client: ClusterClient,
    id: JobId,
    armed: bool,
}

impl CancelOnDrop {
    /// Armed unless the request has an idempotency key: its client means to come back for
    /// the answer after a lost connection.
    fn new(client: &ClusterClient, id: JobId, idempotent: bool) -> Self {
        Self {
            client: client.clone(),
            id,
            armed: !idempotent,
        }
    }

    /// The client has its answer.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (client, id) = (self.client.clone(), self.id);
        // A drop cannot wait: the cancel goes on in a task of the runtime the gateway runs on.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                match client.cancel(id, "the client went away").await {
                    Ok(_) => tracing::info!(job = %id, "cancelled: the client went away"),
                    Err(e) => tracing::debug!(job = %id, error = %e, "cancelling an abandoned job"),
                }
            });
        }
    }
}

async fn chat(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ChatBody = parse(&body)?;
    if body.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for m in body.messages {
        let text = match m.content {
            Content::Text(t) => t,
            Content::Parts(parts) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad_request(format!(
                            "message parts of type {:?} are not supported: text only",
                            p.kind
                        ))
                        .param("messages"));
                    }
                    text.push_str(p.text.as_deref().unwrap_or_default());
                }
                text
            }
        };
        messages.push(ChatMessage::new(m.role, text));
    }
    let prompt = g
        .work
        .served
        .tokenizer
        .apply_chat_template(&messages, true)
        .map_err(|e| ApiError::bad_request(format!("applying the chat template: {e}")))?;
    let request = g.request(&prompt, &body.settings)?;
    let id = g.idempotent_id(&headers)?;
    let slot = g.slot(&headers)?;
    respond(g, body.settings, request, id, slot, Kind::Chat).await
}

async fn completions(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: CompletionBody = parse(&body)?;
    let prompt = match body.prompt {
        PromptField::One(p) => p,
        PromptField::Many(mut v) if v.len() == 1 => v.remove(0),
        PromptField::Many(_) => {
            return Err(
                ApiError::bad_request("one prompt per request: send a string").param("prompt"),
            )
        }
    };
    let request = g.request(&prompt, &body.settings)?;
    let id = g.idempotent_id(&headers)?;
    let slot = g.slot(&headers)?;
    respond(g, body.settings, request, id, slot, Kind::Completion).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

fn finish_reason(job: &JobRecord) -> &'static str {
    match job.output.as_ref().map(|o| o.stop.as_str()) {
        Some("max_tokens") => "length",
        _ => "stop",
    }
}

fn failure(job: &JobRecord) -> ApiError {
    ApiError::server(format!(
        "job {} {}: {}",
        job.id,
        job.state,
        job.error.as_deref().unwrap_or("no reason recorded")
    ))
}

async fn respond(
    g: Arc<Gateway>,
    s: Settings,
    request: JobRequest,
    id: Option<JobId>,
    slot: Option<Slot>,
    kind: Kind,
) -> Result<Response, ApiError> {
    let prompt_tokens = request.prompt.len();
    let idempotent = id.is_some();
    let id = g.submit(&s, request, id).await?;
    let created = now_s();
    let object_id = match kind {
        Kind::Chat => format!("chatcmpl-{id}"),
        Kind::Completion => format!("cmpl-{id}"),
    };
    if s.stream {
        let events = stream(g, (id, idempotent, slot), object_id, s.model, created, kind);
        return Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let tok = &g.work.served.tokenizer;
    let abandoned = CancelOnDrop::new(&g.work.client, id, idempotent);
    let job = Following::start(&g.work.client, id).finish().await?;
    abandoned.disarm();
    if job.state != JobState::Done {
        return Err(failure(&job));
    }
    let mut text = ReplyText::default();
    if let Some(output) = &job.output {
        text.push(tok, &output.tokens);
    }
    let completion_tokens = job.output.as_ref().map_or(0, |o| o.tokens.len());
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text.as_str()},
            "finish_reason": finish_reason(&job),
            "logprobs": null,
        }),
        Kind::Completion => json!({
            "index": 0,
            "text": text.as_str(),
            "finish_reason": finish_reason(&job),
            "logprobs": null,
        }),
    };
    let object = match kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    Ok(Json(json!({
        "id": object_id,
        "object": object,
        "created": created,
        "model": s.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "scd": {"job": id, "mode": job.mode, "timings_ms": job.timings_ms, "payload_bytes": job.payload_bytes},
    }))
    .into_response())
}

/// The server-sent events of a streamed response: a chunk per new piece of text, a last chunk
/// with the finish reason, then `[DONE]`; a failed job ends the stream with an error object.
fn stream(
    g: Arc<Gateway>,
    (id, idempotent, slot): (JobId, bool, Option<Slot>),
    object_id: String,
    model: String,
    created: u64,
    kind: Kind,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let (tx, rx) = mpsc::channel::<Event>(16);
    tokio::spawn(async move {
        // Held to the stream's end: a stream is unanswered until then.
        let _slot = slot;
        let abandoned = CancelOnDrop::new(&g.work.client, id, idempotent);
        let object = match kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let chunk = |delta: Value, finish: Option<&str>| {
            let choice = match kind {
                Kind::Chat => {
                    json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
                }
                Kind::Completion => json!({
                    "index": 0,
                    "text": delta.get("content").cloned().unwrap_or(Value::String(String::new())),
                    "finish_reason": finish,
                    "logprobs": null,
                }),
            };
            Event::default().data(
                json!({"id": object_id, "object": object, "created": created, "model": model, "choices": [choice]})
                    .to_string(),
            )
        };
        if kind == Kind::Chat
            && tx
                .send(chunk(json!({"role": "assistant", "content": ""}), None))
                .await
                .is_err()
        {
            return;
        }
        let tok = &g.work.served.tokenizer;
        let mut text = ReplyText::default();
        let mut following = Following::start(&g.work.client, id);
        loop {
            let step = tokio::select! {
                step = following.next() => step,
                // Gone while nothing new came: noticed now, not at the next token.
                () = tx.closed() => return,
            };
            match step {
                Some(Step::Tokens(tokens)) => {
                    let delta = text.push(tok, &tokens);
                    if tx
                        .send(chunk(json!({"content": delta}), None))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Some(Step::Moved(_)) => {}
                None => break,
            }
        }
        let job = match following.finish().await {
            Ok(job) => job,
            Err(e) => {
                let err = ApiError::from(e);
                let _ = tx.send(Event::default().data(err.body().to_string())).await;
                return;
            }
        };
        // The job has ended: nothing is left to cancel.
        abandoned.disarm();
        if job.state == JobState::Done {
            let _ = tx.send(chunk(json!({}), Some(finish_reason(&job)))).await;
        } else {
            let _ = tx
                .send(Event::default().data(failure(&job).body().to_string()))
                .await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    });
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_cluster_is_a_429_with_retry_after() {
        let busy = scd_scheduler::Busy {
            unfinished: 9,
            limit: 9,
            retry_after: std::time::Duration::from_millis(2500),
        };
        let response = ApiError::from(ClientError::Busy(busy)).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "2");
    }
}
