//! The OpenAI-compatible HTTP API with a real client: the official `openai` Python package
//! (installed by `ops/setup.sh` into `.cache/openai-venv`) lists the experts, streams a chat
//! completion and asks for plain ones from a producer node with the gateway role and a consumer
//! of the mail expert on the embedded store; bad requests get OpenAI-shaped errors.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{config, config_with, repo, Cluster};
use serde_json::Value;

const KEY: &str = "test-key-1";

/// The Python with `openai` installed: `$SCD_OPENAI_PYTHON`, else the venv `ops/setup.sh` makes.
fn python() -> PathBuf {
    let path = std::env::var_os("SCD_OPENAI_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/openai-venv/bin/python"));
    assert!(
        path.exists(),
        "{} is missing: run `make setup` (ops/setup.sh installs the openai client there) or set SCD_OPENAI_PYTHON",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_client_streams_and_gets_openai_shaped_errors() {
    let python = python();
    let cluster = Cluster::new();
    let gateway = config_with(
        "front-0",
        "\"producer\", \"scheduler\", \"gateway\"",
        true,
        &repo().join("experts/mail/translator"),
        &format!("http_listen = \"127.0.0.1:0\"\n\n[gateway]\napi_keys = [\"{KEY}\"]\n"),
    );
    let producer = cluster.start(&gateway).await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let base = format!(
        "http://{}/v1",
        producer.http_addr().expect("the gateway's address")
    );

    let script = repo().join("ops/openai-check.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .args([&base, KEY, "mail"])
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
