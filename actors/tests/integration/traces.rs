//! One job is one trace across nodes: a client's root span, the producer node's half with its
//! stages, the consumer node's half with its stages, joined through the trace context the job
//! record and the code frames carry. Each node exports to its own in-memory exporter (the
//! OpenTelemetry SDK's), as separate processes would to a collector.

use std::time::Duration;

use crate::common::{config, models, prompt, python, repo, request, Cluster, WAIT};
use opentelemetry::trace::{SpanId, TraceContextExt};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use scd_actors::telemetry::{context_of, OtlpProtocol, Telemetry};
use scd_scheduler::{JobId, JobState, Mode, TraceContext};

fn spans(e: &InMemorySpanExporter) -> Vec<SpanData> {
    e.get_finished_spans().unwrap()
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    spans.iter().find(|s| s.name == name).unwrap_or_else(|| {
        panic!(
            "no span {name} in {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        )
    })
}

fn attr<'a>(s: &'a SpanData, key: &str) -> Option<&'a Value> {
    s.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_jobs_spans_on_two_nodes_join_one_trace() {
    let m = models();
    let prompt = prompt(m);
    let (client_spans, producer_spans, consumer_spans) = (
        InMemorySpanExporter::default(),
        InMemorySpanExporter::default(),
        InMemorySpanExporter::default(),
    );
    let client = Telemetry::with_exporter(client_spans.clone(), "client");
    let cluster = Cluster::new();
    let producer = cluster
        .start_traced(
            &config("prefill-0", "\"producer\", \"scheduler\"", true),
            Some(Telemetry::with_exporter(
                producer_spans.clone(),
                "prefill-0",
            )),
        )
        .await;
    let consumer = cluster
        .start_traced(
            &config("mail-0", "\"consumer\"", true),
            Some(Telemetry::with_exporter(consumer_spans.clone(), "mail-0")),
        )
        .await;

    let id = JobId::random();
    let trace = client.start_job(&TraceContext::new(), id, "mail", Mode::Scd);
    assert!(trace.get("traceparent").is_some(), "{trace:?}");
    cluster
        .client
        .submit_as(id, "mail", Mode::Scd, request(&prompt, 4), trace.clone())
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.trace, trace, "the record keeps the job's trace context");
    // Both halves are recorded when they end; the producer's may end just after the record.
    let mut waited = 0;
    while spans(&producer_spans).is_empty() || spans(&consumer_spans).is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(waited < 3000, "the nodes recorded no spans");
    }

    let root = named(&spans(&client_spans), "job").clone();
    let trace_id = root.span_context.trace_id();
    assert_eq!(
        context_of(&trace).span().span_context().trace_id(),
        trace_id
    );
    for (node, exporter, half, stages) in [
        (
            "prefill-0",
            &producer_spans,
            "producer",
            ["prefill", "encode", "transfer"],
        ),
        (
            "mail-0",
            &consumer_spans,
            "consumer",
            ["arrivals", "rebuild", "decode"],
        ),
    ] {
        let all = spans(exporter);
        let h = named(&all, half);
        assert_eq!(h.span_context.trace_id(), trace_id, "{half}");
        assert_eq!(h.parent_span_id, root.span_context.span_id(), "{half}");
        assert_eq!(attr(h, "scd.node").map(|v| v.as_str()), Some(node.into()));
        assert_eq!(attr(h, "scd.mode").map(|v| v.as_str()), Some("scd".into()));
        assert_eq!(
            attr(h, "scd.translator").map(|v| v.as_str()),
            Some(m.translator.0.hash().to_string().into())
        );
        let r = m.translator.0.manifest.default_ranks;
        assert_eq!(
            attr(h, "scd.ranks").map(|v| v.as_str()),
            Some(format!("k={},v={},h={}", r.k, r.v, r.h).into())
        );
        for stage in stages {
            let s = named(&all, stage);
            assert_eq!(s.span_context.trace_id(), trace_id, "{stage}");
            assert_eq!(s.parent_span_id, h.span_context.span_id(), "{stage}");
            assert_ne!(s.parent_span_id, SpanId::INVALID);
            assert!(s.start_time <= s.end_time, "{stage}");
            assert!(
                h.start_time <= s.start_time && s.end_time <= h.end_time,
                "{stage} within {half}"
            );
        }
    }
    // A span per layer under its stage: up to when the producer encoded it, up to when its
    // codes reached the consumer.
    let layers = m.base.config().num_layers;
    for (exporter, stage, layer_span) in [
        (&producer_spans, "encode", "layer encoded"),
        (&consumer_spans, "arrivals", "layer arrived"),
    ] {
        let all = spans(exporter);
        let parent = named(&all, stage).span_context.span_id();
        let per_layer: Vec<&SpanData> = all.iter().filter(|s| s.name == layer_span).collect();
        assert!(
            per_layer.len() >= layers,
            "{layer_span}: {}",
            per_layer.len()
        );
        let mut seen: Vec<i64> = per_layer
            .iter()
            .map(|s| {
                assert_eq!(s.parent_span_id, parent, "{layer_span}");
                assert!(s.start_time <= s.end_time);
                match attr(s, "scd.layer") {
                    Some(Value::I64(l)) => *l,
                    other => panic!("{layer_span}: layer attribute {other:?}"),
                }
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, (0..layers as i64).collect::<Vec<_>>(), "{layer_span}");
    }
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spans_reach_a_real_otlp_receiver() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("spans.jsonl");
    let mut receiver = Command::new(python())
        .arg(repo().join("ops/otlp-receiver.py"))
        .arg(&out)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ports = String::new();
    BufReader::new(receiver.stdout.take().unwrap())
        .read_line(&mut ports)
        .unwrap();
    let mut ports = ports.split_whitespace();
    let http = format!("http://127.0.0.1:{}", ports.next().unwrap());
    let grpc = format!("http://127.0.0.1:{}", ports.next().unwrap());

    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    // The exporters are made off the async runtime, as `scd node` does. The producer exports
    // over gRPC, the others over HTTP.
    let otlp = |service: &'static str, endpoint: &str, protocol| {
        let endpoint = endpoint.to_owned();
        tokio::task::spawn_blocking(move || Telemetry::otlp(&endpoint, protocol, service).unwrap())
    };
    let producer = cluster
        .start_traced(
            &config("prefill-0", "\"producer\", \"scheduler\"", true),
            Some(otlp("prefill-0", &grpc, OtlpProtocol::Grpc).await.unwrap()),
        )
        .await;
    let consumer = cluster
        .start_traced(
            &config("mail-0", "\"consumer\"", true),
            Some(
                otlp("mail-0", &http, OtlpProtocol::HttpProtobuf)
                    .await
                    .unwrap(),
            ),
        )
        .await;
    let client = otlp("client", &http, OtlpProtocol::HttpProtobuf)
        .await
        .unwrap();
    let id = JobId::random();
    let trace = client.start_job(&TraceContext::new(), id, "mail", Mode::Raw);
    cluster
        .client
        .submit_as(id, "mail", Mode::Raw, request(&prompt, 4), trace.clone())
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    let trace_id = context_of(&trace)
        .span()
        .span_context()
        .trace_id()
        .to_string();
    // Shutting down flushes each node's batch exporter.
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
    tokio::task::spawn_blocking(move || client.shutdown())
        .await
        .unwrap();

    let lines = std::fs::read_to_string(&out).unwrap();
    let _ = receiver.kill();
    let _ = receiver.wait();
    let spans: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut names: Vec<(String, String)> = spans
        .iter()
        .filter(|s| s["trace_id"] == trace_id.as_str())
        .map(|s| {
            let service = s["service"].as_str().unwrap().to_owned();
            let want = if service == "prefill-0" {
                "grpc"
            } else {
                "http"
            };
            assert_eq!(s["protocol"], want, "{s}");
            (service, s["name"].as_str().unwrap().to_owned())
        })
        .collect();
    // The per-layer spans arrived too; the rest is checked by name.
    let layers = m.base.config().num_layers;
    let encoded = names.iter().filter(|(_, n)| n == "layer encoded").count();
    assert_eq!(encoded, layers);
    names.retain(|(_, n)| !n.starts_with("layer "));
    names.sort();
    let want: Vec<(String, String)> = [
        ("client", "job"),
        ("mail-0", "arrivals"),
        ("mail-0", "consumer"),
        ("mail-0", "decode"),
        ("mail-0", "rebuild"),
        ("prefill-0", "encode"),
        ("prefill-0", "prefill"),
        ("prefill-0", "producer"),
        ("prefill-0", "transfer"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(names, want, "{lines}");
}
