//! Job traces (OpenTelemetry): one trace per job across the nodes that work on it.
//!
//! The node that takes a submission starts the job's root span and stores its W3C context
//! (`traceparent`) in the job record's [`TraceContext`]; it also rides every code frame. Each
//! node that works on the job records its half as a span under that root when the half ends,
//! with a child span per stage (prefill, encode, transfer; arrivals, rebuild, decode) at the
//! times the stages ran and an event per layer (its code bytes; on the consumer, when its
//! codes arrived). Recording spans after the fact, from the stage timeline the node measures
//! anyway, keeps tracing out of the model threads' way.
//!
//! Export is OTLP, over gRPC or HTTP/protobuf, from the SDK's batch processor on its own thread:
//! a job never waits on the collector, and a collector that is down costs dropped spans (the
//! queue is bounded), not memory.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Span, SpanKind, TraceContextExt, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use scd_scheduler::{JobId, Mode, TraceContext};
use scd_types::{JobReport, Stage};

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The exporter could not be built.
    #[error("setting up the OTLP exporter for {endpoint}: {reason}")]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// The exporter's runtime (gRPC) could not start.
    #[error("starting the OTLP/gRPC exporter's runtime: {0}")]
    Runtime(std::io::Error),
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (collectors listen on 4317).
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (collectors listen on 4318).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// The protocol of `endpoint`: `explicit` (the config's, else
    /// `$OTEL_EXPORTER_OTLP_PROTOCOL` as the caller read it), else gRPC on port 4317 and
    /// HTTP on any other.
    pub fn resolve(explicit: Option<&str>, endpoint: &str) -> Result<Self, TelemetryError> {
        match explicit.map(str::trim) {
            Some("grpc") => Ok(Self::Grpc),
            Some("http/protobuf") => Ok(Self::HttpProtobuf),
            Some(other) => Err(TelemetryError::Exporter {
                endpoint: endpoint.to_owned(),
                reason: format!(
                    "protocol {other:?}: use \"grpc\" or \"http/protobuf\" (http/json is not supported)"
                ),
            }),
            None if endpoint.trim_end_matches('/').ends_with(":4317") => Ok(Self::Grpc),
            None => Ok(Self::HttpProtobuf),
        }
    }
}

impl std::fmt::Display for OtlpProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Grpc => "OTLP/gRPC",
            Self::HttpProtobuf => "OTLP/HTTP",
        })
    }
}

/// A span exporter run on a runtime of its own. tonic's channel and timers need a Tokio
/// runtime, while the SDK's batch processor exports from a plain thread (without one, the
/// first export panics that thread and every later span is dropped).
#[derive(Debug)]
struct OnRuntime<E> {
    inner: std::sync::Arc<E>,
    /// Taken on drop, to shut down without blocking (dropping a runtime may happen inside
    /// another one's task, where a blocking shutdown panics).
    runtime: Option<tokio::runtime::Runtime>,
}

impl<E> Drop for OnRuntime<E> {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl std::future::Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        use opentelemetry_sdk::error::OTelSdkError;
        let inner = self.inner.clone();
        let task = self
            .runtime
            .as_ref()
            .map(|r| r.spawn(async move { inner.export(batch).await }));
        async move {
            match task {
                Some(task) => task
                    .await
                    .unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(e.to_string()))),
                None => Err(OTelSdkError::AlreadyShutdown),
            }
        }
    }

    fn shutdown_with_timeout(
        &mut self,
        timeout: Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        match std::sync::Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.shutdown_with_timeout(timeout),
            None => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once, before any export: the exporter is not shared yet.
        if let Some(inner) = std::sync::Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

/// A node's tracer.
#[derive(Clone, Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

fn at(ms: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(ms.max(0.0) / 1e3)
}

struct Entries<'a>(&'a mut HashMap<String, String>);

impl Injector for Entries<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct Reader<'a>(&'a TraceContext);

impl Extractor for Reader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().collect()
    }
}

/// The OpenTelemetry context a job's trace context names (empty when it names none).
pub fn context_of(trace: &TraceContext) -> Context {
    TraceContextPropagator::new().extract(&Reader(trace))
}

/// The trace context of `cx`, for the job record and the frames.
pub fn trace_of(cx: &Context) -> TraceContext {
    let mut entries = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut Entries(&mut entries));
    let mut trace = TraceContext::new();
    for (k, v) in entries {
        // The propagator writes W3C headers, which are within the context's limits.
        let _ = trace.insert(k, v);
    }
    trace
}

impl Telemetry {
    /// Spans exported over OTLP to `endpoint` (a collector's base URL such as
    /// `http://127.0.0.1:4317` for gRPC or `http://127.0.0.1:4318` for HTTP, where an HTTP URL
    /// may also be the full `/v1/traces` one), as `service`.
    pub fn otlp(
        endpoint: &str,
        protocol: OtlpProtocol,
        service: &str,
    ) -> Result<Self, TelemetryError> {
        use opentelemetry_otlp::WithExportConfig;
        let failed = |e: opentelemetry_otlp::ExporterBuildError| TelemetryError::Exporter {
            endpoint: endpoint.to_owned(),
            reason: e.to_string(),
        };
        let builder = SdkTracerProvider::builder();
        let builder = match protocol {
            OtlpProtocol::HttpProtobuf => {
                let url = if endpoint.ends_with("/v1/traces") {
                    endpoint.to_owned()
                } else {
                    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
                };
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_endpoint(url)
                    .build()
                    .map_err(failed)?;
                builder.with_batch_exporter(exporter)
            }
            OtlpProtocol::Grpc => {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("scd-otlp")
                    .enable_all()
                    .build()
                    .map_err(TelemetryError::Runtime)?;
                // The channel is made (lazily, it connects on first use) on that runtime.
                let exporter = {
                    let _on = runtime.enter();
                    opentelemetry_otlp::SpanExporter::builder()
                        .with_tonic()
                        .with_endpoint(endpoint)
                        .build()
                        .map_err(failed)?
                };
                builder.with_batch_exporter(OnRuntime {
                    inner: std::sync::Arc::new(exporter),
                    runtime: Some(runtime),
                })
            }
        };
        let provider = builder
            .with_resource(
                Resource::builder()
                    .with_service_name(service.to_owned())
                    .build(),
            )
            .build();
        Ok(Self::of(provider))
    }

    /// Spans handed to `exporter` as each ends (the tests' in-memory exporter).
    pub fn with_exporter(exporter: impl SpanExporter + 'static, service: &str) -> Self {
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name(service.to_owned())
                    .build(),
            )
            .build();
        Self::of(provider)
    }

    fn of(provider: SdkTracerProvider) -> Self {
        let tracer = provider.tracer("scd");
        Self { provider, tracer }
    }

    /// Sends what is queued.
    pub fn flush(&self) {
        let _ = self.provider.force_flush();
    }

    /// Sends what is queued and stops exporting.
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }

    /// Starts and ends a job's root span (`job`, a child of `parent` when it names a trace);
    /// the trace context to store with the job.
    pub fn start_job(
        &self,
        parent: &TraceContext,
        job: JobId,
        expert: &str,
        mode: Mode,
    ) -> TraceContext {
        let parent = context_of(parent);
        let mut span = self
            .tracer
            .span_builder("job")
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("scd.job", job.to_string()),
                KeyValue::new("scd.expert", expert.to_owned()),
                KeyValue::new("scd.mode", mode.to_string()),
            ])
            .start_with_context(&self.tracer, &parent);
        let cx = Context::current().with_remote_span_context(span.span_context().clone());
        span.end();
        trace_of(&cx)
    }

    /// Records a node's half of a job, as its [`JobReport`] tells it, under the job's trace: a
    /// span named for the side, with `attributes`, a child span per stage, and inside a stage
    /// with layer points (encode, arrivals) a child span per layer.
    pub fn record_report(
        &self,
        trace: &TraceContext,
        report: &JobReport,
        attributes: Vec<KeyValue>,
    ) {
        let parent = context_of(trace);
        let mut half = self
            .tracer
            .span_builder(report.side.name())
            .with_kind(SpanKind::Internal)
            .with_start_time(at(report.whole.start_ms))
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        let cx = parent.with_remote_span_context(half.span_context().clone());
        for (stage, stage_span) in report.spans() {
            let mut span = self
                .tracer
                .span_builder(stage.name())
                .with_start_time(at(stage_span.start_ms))
                .start_with_context(&self.tracer, &cx);
            // One child span per layer: from the previous layer's point (or the stage's start)
            // to this layer's, so that the trace shows where each layer's time went.
            let stage_cx = cx.with_remote_span_context(span.span_context().clone());
            let event = match stage {
                Stage::Arrivals => "layer arrived",
                _ => "layer encoded",
            };
            let mut from = stage_span.start_ms;
            for point in report.layers_of(stage) {
                let attrs = vec![
                    KeyValue::new("scd.layer", i64::from(point.layer)),
                    KeyValue::new("scd.bytes", point.bytes as i64),
                ];
                self.tracer
                    .span_builder(event)
                    .with_start_time(at(from.min(point.at_ms)))
                    .with_attributes(attrs)
                    .start_with_context(&self.tracer, &stage_cx)
                    .end_with_timestamp(at(point.at_ms));
                from = point.at_ms;
            }
            span.end_with_timestamp(at(stage_span.end_ms));
        }
        half.end_with_timestamp(at(report.whole.end_ms));
    }
}
