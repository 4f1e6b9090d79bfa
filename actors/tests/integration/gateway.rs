//! The OpenAI-compatible HTTP API with a real client: the official `openai` Python package
//! (installed by `ops/setup.sh` into `.cache/openai-venv`) lists the experts, streams a chat
//! completion and asks for plain ones from a producer node with the gateway role and a consumer
//! of the mail expert on the embedded store; bad requests get OpenAI-shaped errors.

use crate::common;

use std::process::Command;
use std::time::Duration;

use crate::common::{config, config_with, python, repo, Cluster};
use serde_json::Value;

const KEY: &str = "test-key-1";
const OTHER: &str = "test-key-2";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_client_streams_and_gets_openai_shaped_errors() {
    let python = python();
    let cluster = Cluster::new();
    let store_dir = tempfile::tempdir().unwrap();
    let gateway = config_with(
        "front-0",
        "\"producer\", \"scheduler\", \"gateway\"",
        true,
        &repo().join("experts/mail/translator"),
        &format!(
            "http_listen = \"127.0.0.1:0\"\n\n[gateway]\napi_keys = [\"{KEY}\"]\n\n\
             [documents]\ndir = \"{}\"\n",
            store_dir.path().display()
        ),
    );
    let producer = cluster.start(&gateway).await;
    // A document the chat names through the `scd_documents` extension.
    let m = common::models();
    let doc = m
        .tok
        .encode(
            "The mail server is down on Friday from six to eight.",
            false,
        )
        .unwrap();
    let doc =
        scd_scheduler::DocumentRegistry::new(cluster.store.clone(), scd_scheduler::Keys::default())
            .add(common::MODEL_FILE, doc, None)
            .await
            .unwrap()
            .id;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let base = format!(
        "http://{}/v1",
        producer.http_addr().expect("the gateway's address")
    );

    let script = repo().join("ops/openai-check.py");
    let arg = doc.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([&base, KEY, "mail", &arg])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("{r:#}");

    assert_eq!(r["models"], serde_json::json!(["mail"]));
    // Streamed: the role first, then the text in pieces; the same greedy request unstreamed
    // gives the same text.
    let pieces: Vec<&str> = r["stream"]["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(!pieces.is_empty());
    assert_eq!(r["stream"]["roles"], serde_json::json!(["assistant"]));
    let chat = &r["chat"];
    assert_eq!(pieces.concat(), chat["text"].as_str().unwrap());
    let n = chat["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&n), "{n}");
    let finish = if n == 12 { "length" } else { "stop" };
    assert_eq!(chat["finish"], finish);
    assert_eq!(r["stream"]["finish"], finish);
    assert!(chat["prompt_tokens"].as_u64().unwrap() > 5);
    assert!(!r["completion"]["text"].as_str().unwrap().is_empty());
    // The chat that named the document: answered by a job that read it, compiled by the
    // producer.
    assert!(!r["documents"]["text"].as_str().unwrap().is_empty(), "{r}");
    let jobs = scd_scheduler::JobStore::new(cluster.store.clone(), scd_scheduler::Keys::default())
        .list()
        .await
        .unwrap();
    let with_doc = jobs
        .iter()
        .map(|(j, _)| j)
        .find(|j| {
            j.request
                .as_ref()
                .is_some_and(|r| r.documents == [doc.clone()])
        })
        .expect("a job that names the document");
    assert_eq!(with_doc.mode, scd_scheduler::Mode::Oracle);
    assert_eq!(with_doc.documents.as_ref().unwrap().compiled, [doc]);

    // The replies are the model's: each chat job's tokens (the streamed and the plain one,
    // both greedy) are the in-process greedy reference of their mode on the prompt the gateway
    // built, and the plain reply's text is those tokens decoded.
    let chats: Vec<_> = jobs
        .iter()
        .map(|(j, _)| j)
        // The chats ask for 12 tokens; the text completion for 8. (Not the one that names the
        // document, checked above.)
        .filter(|j| {
            j.request
                .as_ref()
                .is_some_and(|r| r.max_tokens == 12 && r.documents.is_empty())
        })
        .collect();
    assert_eq!(chats.len(), 2, "the streamed and the plain chat");
    let mut texts = Vec::new();
    for job in &chats {
        assert_eq!(job.state, scd_scheduler::JobState::Done, "{:?}", job.error);
        // ops/openai-check.py asks for scd; a request naming no mode runs in auto.
        assert_eq!(job.mode, scd_scheduler::Mode::Scd);
        let request = job.request.as_ref().unwrap();
        assert_eq!(request.prompt, chats[0].request.as_ref().unwrap().prompt);
        let reference = common::reference_for(m, job.mode, &request.prompt);
        let tokens = &job.output.as_ref().unwrap().tokens;
        assert!(!tokens.is_empty() && tokens.len() <= reference.len());
        assert_eq!(
            tokens[..],
            reference[..tokens.len()],
            "{} in {}",
            job.id,
            job.mode
        );
        texts.push(m.tok.decode(tokens, true).unwrap());
    }
    assert!(
        texts.iter().any(|t| t == chat["text"].as_str().unwrap()),
        "{texts:?} against {}",
        chat["text"]
    );

    let error = |name: &str, status: u64, code: &str| {
        let e = &r[name];
        assert_eq!(e["status"], status, "{name}: {e}");
        // The client hands over the `error` object's fields.
        let body = if e["body"]["error"].is_object() {
            &e["body"]["error"]
        } else {
            &e["body"]
        };
        assert_eq!(body["code"], code, "{name}: {e}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(body["type"].is_string(), "{name}: {e}");
    };
    error("unknown_model", 404, "model_not_found");
    error("too_long", 400, "context_length_exceeded");
    error("bad_json", 400, "invalid_request_body");
    error("no_key", 401, "invalid_api_key");

    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// A node's metrics as the official Prometheus client parses them: (name, labels, value).
fn scrape(python: &std::path::Path, addr: std::net::SocketAddr) -> Vec<(String, Value, f64)> {
    let out = Command::new(python)
        .arg(repo().join("ops/metrics-scrape.py"))
        .arg(format!("http://{addr}/metrics"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: Vec<(String, Value, f64)> = serde_json::from_slice(&out.stdout).unwrap();
    samples
}

fn value(samples: &[(String, Value, f64)], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l[*k] == *v))
        .map(|(_, _, v)| *v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_node_serves_metrics_a_prometheus_parser_reads() {
    let python = python();
    let cluster = Cluster::new();
    let with_metrics = "metrics_listen = \"127.0.0.1:0\"\n";
    let mail = repo().join("experts/mail/translator");
    let producer = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &mail,
            with_metrics,
        ))
        .await;
    let consumer = cluster
        .start(&config_with(
            "mail-0",
            "\"consumer\"",
            true,
            &mail,
            with_metrics,
        ))
        .await;
    let m = common::models();
    let prompt = common::prompt(m);
    let id = cluster
        .client
        .submit(
            "mail",
            scd_scheduler::Mode::Raw,
            common::request(&prompt, 4),
        )
        .await
        .unwrap();
    let job = cluster.client.wait(id, common::WAIT).await.unwrap();
    assert_eq!(job.state, scd_scheduler::JobState::Done, "{:?}", job.error);
    // The producer's last counts may land just after the consumer finished the record: scrape
    // until the producer counts its half done (bounded), rather than sleep and hope.
    let done = [("side", "producer"), ("outcome", "done")];
    let deadline = std::time::Instant::now() + common::WAIT;
    let (p, c) = loop {
        let python = python.clone();
        let (pa, ca) = (
            producer.metrics_addr().unwrap(),
            consumer.metrics_addr().unwrap(),
        );
        let (p, c) =
            tokio::task::spawn_blocking(move || (scrape(&python, pa), scrape(&python, ca)))
                .await
                .unwrap();
        if value(&p, "scd_jobs_total", &done).is_some() || std::time::Instant::now() > deadline {
            break (p, c);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&p, "scd_jobs_total", &done), Some(1.0));
    let done = [("side", "consumer"), ("outcome", "done")];
    assert_eq!(value(&c, "scd_jobs_total", &done), Some(1.0));
    let sent = value(&p, "scd_code_bytes_sent_total", &[]).unwrap();
    let received = value(&c, "scd_code_bytes_received_total", &[]).unwrap();
    assert!(sent >= received && received > 0.0, "{sent} {received}");
    assert_eq!(sent, job.payload_bytes as f64);
    let raw_mail = [("mode", "raw"), ("expert", "mail")];
    assert_eq!(value(&c, "scd_ttft_seconds_count", &raw_mail), Some(1.0));
    assert_eq!(
        value(&p, "scd_stage_seconds_count", &[("stage", "prefill")]),
        Some(1.0)
    );
    assert_eq!(
        value(&c, "scd_stage_seconds_count", &[("stage", "rebuild")]),
        Some(1.0)
    );
    assert_eq!(
        value(&c, "scd_cluster_jobs", &[("state", "done")]),
        Some(1.0)
    );
    assert_eq!(value(&c, "scd_actor_restarts", &[]), Some(0.0));
    // One job decoded alone: one row per step, a step per token (and one for a stop token).
    let tokens = job.output.as_ref().map_or(0, |o| o.tokens.len()) as f64;
    let (steps, rows) = (
        value(&c, "scd_decode_steps", &[]).unwrap(),
        value(&c, "scd_decode_rows", &[]).unwrap(),
    );
    assert!(
        steps == rows && (tokens..=tokens + 1.0).contains(&rows),
        "{steps} {rows} {tokens}"
    );
    // The producer's prefix cache looked once, found nothing, and now holds the prompt's
    // whole blocks.
    assert_eq!(
        value(&p, "scd_prefix_cache_lookups_total", &[("result", "miss")]),
        Some(1.0)
    );
    assert_eq!(
        value(&p, "scd_prefix_cache_tokens_reused_total", &[]),
        Some(0.0)
    );
    assert!(value(&p, "scd_prefix_cache_blocks", &[]).is_some_and(|b| b >= 1.0));
    // Nothing waits once the job is done, and the live translator loaded everywhere.
    for (m, queue) in [(&p, "producer"), (&c, "consumer")] {
        assert_eq!(
            value(m, "scd_queue_depth", &[("queue", queue)]),
            Some(0.0),
            "{queue}"
        );
        assert_eq!(
            value(m, "scd_translator_load_failures_total", &[]),
            Some(0.0)
        );
    }
    let version = m.translator.0.hash().to_string();
    assert_eq!(
        value(
            &c,
            "scd_translator",
            &[("expert", "mail"), ("version", &version)]
        ),
        Some(1.0)
    );
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// Sends a POST of `body` (JSON) to `path` on `addr` over plain HTTP/1.1 with `headers`; the
/// connection, for the reply.
async fn send(
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> tokio::net::TcpStream {
    send_as(KEY, addr, path, body, headers).await
}

/// [`send`] with API key `key`.
async fn send_as(
    key: &str,
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    s
}

/// POSTs `body` (JSON) to `path` on `addr` over plain HTTP/1.1: the status and the body.
async fn post(addr: std::net::SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    post_with(addr, path, body, &[]).await
}

/// [`post`] with more headers.
async fn post_with(
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    post_as(KEY, addr, path, body, headers).await
}

/// [`post_with`] with API key `key`.
async fn post_as(
    key: &str,
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    use tokio::io::AsyncReadExt;
    let mut s = send_as(key, addr, path, body, headers).await;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.unwrap();
    let reply = String::from_utf8(reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// The gateway on a node of its own: it reads the base model's tokenizer and limits,
/// not its weights, and answers a chat as a producer+consumer cluster behind it computes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_only_node_answers_for_the_cluster_behind_it() {
    let cluster = Cluster::new();
    let front = config_with(
        "front-0",
        "\"gateway\", \"admin\"",
        false,
        &repo().join("experts/mail/translator"),
        &format!("http_listen = \"127.0.0.1:0\"\n\n[gateway]\napi_keys = [\"{KEY}\"]\n"),
    );
    // What it loads: the header, none of the weights.
    let served = scd_actors::node::Served::load(&front, scd_models::KernelChoice::best()).unwrap();
    let m = common::models();
    assert!(served.base.is_none() && served.experts.is_empty());
    assert!(matches!(
        served.model(),
        Err(scd_actors::node::ServeError::NoWeights)
    ));
    assert_eq!(served.config, *m.base.config());
    assert_eq!(served.base_id, common::MODEL_FILE);
    assert_eq!(served.base_sha256, m.base.identity().sha256);

    let producer = cluster
        .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
        .await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let gateway = cluster.start(&front).await;
    let addr = gateway.http_addr().expect("the gateway's address");
    let chat = serde_json::json!({
        "model": "mail",
        "messages": [{"role": "user", "content": "Is the mail server down on Friday?"}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let (status, reply) = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{reply}");

    let jobs = scd_scheduler::JobStore::new(cluster.store.clone(), scd_scheduler::Keys::default())
        .list()
        .await
        .unwrap();
    let [(job, _)] = &jobs[..] else {
        panic!("one job, not {}", jobs.len())
    };
    assert_eq!(job.state, scd_scheduler::JobState::Done, "{:?}", job.error);
    assert_eq!(
        (job.producer.as_deref(), job.consumer.as_deref()),
        (Some("prefill-0"), Some("mail-0"))
    );
    let request = job.request.as_ref().unwrap();
    let reference = common::reference_for(m, job.mode, &request.prompt);
    let tokens = &job.output.as_ref().unwrap().tokens;
    assert!(!tokens.is_empty() && tokens.len() <= reference.len());
    assert_eq!(tokens[..], reference[..tokens.len()], "{}", job.id);
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        m.tok.decode(tokens, true).unwrap(),
        "{reply}"
    );
    assert_eq!(reply["usage"]["prompt_tokens"], request.prompt.len());
    // A prompt past the base model's context is refused by the gateway from the header's limits.
    let long = "mail ".repeat(m.base.config().context_length);
    let too_long = serde_json::json!({"model": "mail", "prompt": long, "max_tokens": 4});
    let (status, reply) = post(addr, "/v1/completions", &too_long).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["code"], "context_length_exceeded", "{reply}");

    gateway.shutdown(Duration::ZERO).await;
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// A caller without a key is refused before its body is read, and one key has at most
/// `max_requests_per_key` requests unanswered while others are served. What a client
/// sees is one answer: a request sent again with the same
/// `Idempotency-Key` is the same job and gets the same reply (the key with another request is
/// refused), and a client that goes away before its answer, streaming or not, cancels its job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retried_request_is_one_job_and_a_client_that_leaves_cancels_its_job() {
    use scd_scheduler::{JobState, JobStore, Keys};
    let cluster = Cluster::new();
    let producer = cluster
        .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
        .await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let front = config_with(
        "front-0",
        "\"gateway\"",
        false,
        &repo().join("experts/mail/translator"),
        &format!(
            "http_listen = \"127.0.0.1:0\"\n\n[gateway]\napi_keys = [\"{KEY}\", \"{OTHER}\"]\n\
             max_requests_per_key = 1\n"
        ),
    );
    let gateway = cluster.start(&front).await;
    let addr = gateway.http_addr().expect("the gateway's address");
    let jobs = JobStore::new(cluster.store.clone(), Keys::default());

    // A caller without a key is refused at its headers, before its body (never sent here)
    // would be read.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: 3000000\r\nConnection: close\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut reply = vec![0; 12];
        tokio::time::timeout(common::WAIT, s.read_exact(&mut reply))
            .await
            .expect("refused without its body")
            .unwrap();
        assert_eq!(
            &reply,
            b"HTTP/1.1 401",
            "{}",
            String::from_utf8_lossy(&reply)
        );
    }

    let once = serde_json::json!({"model": "mail", "prompt": "Dear all,", "max_tokens": 8, "temperature": 0});
    let key = [("Idempotency-Key", "retry-1")];
    let (status, first) = post_with(addr, "/v1/completions", &once, &key).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = post_with(addr, "/v1/completions", &once, &key).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(first["scd"]["job"], again["scd"]["job"]);
    assert_eq!(first["choices"], again["choices"]);
    // Live or archived once finished.
    let count =
        || async { jobs.list().await.unwrap().len() + jobs.list_archived().await.unwrap().len() };
    assert_eq!(count().await, 1, "one job for both");
    let other = serde_json::json!({"model": "mail", "prompt": "Hello there, all", "max_tokens": 8});
    let (status, refused) = post_with(addr, "/v1/completions", &other, &key).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(
        refused["error"]["code"], "idempotency_key_reused",
        "{refused}"
    );
    assert_eq!(count().await, 1);

    // Counting goes on for long: the job is decoding when its client leaves.
    let count: String = (1..=40).map(|i| format!("{i}, ")).collect();
    for stream in [false, true] {
        let long = serde_json::json!({
            "model": "mail", "prompt": count, "max_tokens": 2000, "temperature": 0, "stream": stream,
        });
        let connection = send(addr, "/v1/completions", &long, &[]).await;
        let deadline = tokio::time::Instant::now() + common::WAIT;
        let id = decoding_with(&jobs, 2000).await;
        // One unanswered request per key here: the same key waits its turn, another is served.
        let short = serde_json::json!({"model": "mail", "prompt": "Dear all,", "max_tokens": 2});
        let (status, busy) = post_with(addr, "/v1/completions", &short, &[]).await;
        assert_eq!(status, 429, "{busy}");
        assert_eq!(busy["error"]["code"], "rate_limit_exceeded", "{busy}");
        let (status, served) = post_as(OTHER, addr, "/v1/completions", &short, &[]).await;
        assert_eq!(status, 200, "{served}");
        drop(connection);
        let job = loop {
            let job = cluster.client.get(id).await.unwrap();
            if job.state.is_finished() {
                break job;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {id} still {}",
                job.state
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            job.state,
            JobState::Cancelled,
            "stream {stream}: {:?}",
            job.error
        );
        assert!(job.output.map_or(0, |o| o.tokens.len()) < 2000);
    }
    // With an idempotency key the client means to come back: its job runs on when the
    // connection is lost, and the retry gets that job's answer.
    let keyed =
        serde_json::json!({"model": "mail", "prompt": count, "max_tokens": 300, "temperature": 0});
    let key = [("Idempotency-Key", "long-1")];
    let connection = send(addr, "/v1/completions", &keyed, &key).await;
    let id = decoding_with(&jobs, 300).await;
    drop(connection);
    // The gateway frees the abandoned request's slot of the key once it sees the connection
    // closed, which a busy machine may not have done when the retry comes: until then the retry
    // is answered 429 with Retry-After, and a client retries as it says.
    let deadline = tokio::time::Instant::now() + common::WAIT;
    let (status, reply) = loop {
        let (status, reply) = post_with(addr, "/v1/completions", &keyed, &key).await;
        if status != 429 {
            break (status, reply);
        }
        assert_eq!(reply["error"]["code"], "rate_limit_exceeded", "{reply}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the retry was still refused: {reply}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["scd"]["job"], id.to_string());
    assert_eq!(cluster.client.get(id).await.unwrap().state, JobState::Done);
    gateway.shutdown(Duration::ZERO).await;
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// The id of the job decoding a request for `max_tokens` tokens, once there is one (bounded by
/// the tests' wait).
async fn decoding_with(jobs: &scd_scheduler::JobStore, max_tokens: u32) -> scd_scheduler::JobId {
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        let decoding = jobs.list().await.unwrap().into_iter().find(|(j, _)| {
            j.state == scd_scheduler::JobState::Decoding
                && j.request
                    .as_ref()
                    .is_some_and(|r| r.max_tokens == max_tokens)
        });
        if let Some((j, _)) = decoding {
            return j.id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no job of {max_tokens} tokens decoding"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
