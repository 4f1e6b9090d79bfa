//! `scd node --config FILE`: runs one cluster node until SIGTERM or Ctrl-C, then drains it
//! (jobs in flight get `--drain-timeout` to finish, the rest go back to the queue, the node's
//! lease is revoked). A second signal stops at once.

use scd_models::KernelChoice;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use scd_actors::config::StoreConfig;
use scd_actors::telemetry::{OtlpProtocol, Telemetry};
use scd_actors::{Node, NodeConfig, Served};
use scd_scheduler::{EmbeddedStore, EtcdStore, MetaStore};
use tokio_util::sync::CancellationToken;

/// Arguments of `scd node`.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  scd node --config cluster-config/three-node/producer.toml")]
pub struct Args {
    /// The node's config (cluster-config/ has ready ones; each says how to start it).
    #[arg(long, env = "SCD_NODE_CONFIG")]
    pub config: PathBuf,
    /// On SIGTERM or Ctrl-C, how long jobs in flight may run on before they are handed back
    /// to the queue (seconds).
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
}

/// Opens the store a config names.
pub async fn open_store(config: &StoreConfig) -> anyhow::Result<Arc<dyn MetaStore>> {
    Ok(match config {
        StoreConfig::Embedded { .. } => Arc::new(EmbeddedStore::new()),
        StoreConfig::Etcd { endpoints, .. } => {
            let tls = config.etcd_tls()?;
            let store = EtcdStore::connect_with(endpoints, tls.as_ref())
                .await
                .with_context(|| {
                    format!(
                        "connecting to etcd at {}: is it running? (make test starts one; \
                         ops/ has how to run one for a cluster)",
                        endpoints.join(", ")
                    )
                })?;
            // The connection is lazy, and a node may start before etcd: nothing is refused
            // here, but a certificate etcd will not take (or one of etcd's this node does not
            // trust) is said now, with its cause, rather than as retries later.
            if let Err(e) = store.get("/scd-connect-probe").await {
                tracing::warn!(
                    "etcd at {} did not answer yet; the node keeps trying: {:#}",
                    endpoints.join(", "),
                    anyhow::Error::new(e)
                );
            }
            Arc::new(store)
        }
    })
}

pub fn run(args: Args, kernels: KernelChoice) -> anyhow::Result<()> {
    let config = NodeConfig::load(&args.config)
        .with_context(|| format!("reading the node config {}", args.config.display()))?;
    let identity = config.identity()?;
    // Spans go to the config's OTLP endpoint, else to $OTEL_EXPORTER_OTLP_ENDPOINT, by gRPC or
    // HTTP (config, $OTEL_EXPORTER_OTLP_PROTOCOL, else by the port). Made before the runtime:
    // the HTTP exporter's blocking client brings its own, the gRPC one runs on its own.
    let endpoint = config
        .tracing
        .otlp_endpoint
        .clone()
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok());
    let telemetry = match endpoint {
        Some(e) => {
            let protocol = config
                .tracing
                .otlp_protocol
                .clone()
                .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").ok());
            let protocol = OtlpProtocol::resolve(protocol.as_deref(), &e)?;
            let t = Telemetry::otlp(&e, protocol, config.service_name())?;
            eprintln!(
                "node {}: exporting job traces to {e} ({protocol})",
                config.node.id
            );
            Some(t)
        }
        None => None,
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let store = open_store(&config.store).await?;
        let started = Instant::now();
        eprintln!("node {}: loading models ...", config.node.id);
        let load = config.clone();
        let served = tokio::task::spawn_blocking(move || Served::load(&load, kernels))
            .await
            .context("loading models")??;
        eprintln!(
            "node {}: base {} and {} expert(s) loaded in {:.1} s",
            config.node.id,
            served.base_id,
            served.experts.len(),
            started.elapsed().as_secs_f64()
        );
        let id = config.node.id.to_string();
        let failpoints = scd_actors::node::failpoints::from_env(&id).map_err(anyhow::Error::msg)?;
        if !failpoints.is_empty() {
            eprintln!(
                "node {id}: test failpoints from {}: {}",
                scd_actors::node::failpoints::ENV,
                failpoints.join(", ")
            );
        }
        let cancel = CancellationToken::new();
        let node = Node::start(
            &config,
            &identity,
            Arc::new(served),
            store,
            telemetry,
            cancel.clone(),
        )
            .await
            .with_context(|| format!("starting node {}", config.node.id))?;
        let roles: Vec<&str> = config.node.roles.iter().map(|r| r.as_str()).collect();
        let experts: Vec<&str> = config.experts.iter().map(|e| e.name.as_str()).collect();
        println!(
            "node {id} up: QUIC on {addr} (admin clients: --node {id}@{addr}), roles [{}], experts [{}]; Ctrl-C or SIGTERM drains it",
            roles.join(", "),
            experts.join(", "),
            id = node.id(),
            addr = node.local_addr(),
        );
        if let Some(http) = node.http_addr() {
            println!("node {} HTTP API: http://{http}/v1 (OpenAI-compatible)", node.id());
        }
        shutdown_signal().await?;
        let grace = Duration::from_secs_f64(args.drain_timeout.max(0.0));
        eprintln!(
            "node {}: draining ({} job(s) in flight, up to {:.0} s; signal again to stop now)",
            node.id(),
            node.load(),
            grace.as_secs_f64()
        );
        let id = node.id().to_owned();
        tokio::select! {
            report = node.shutdown(grace) => {
                eprintln!(
                    "node {id}: stopped; {} job(s) were in flight, {} handed back to the queue",
                    report.in_flight,
                    report.handed_back.len()
                );
            }
            _ = shutdown_signal() => {
                cancel.cancel();
                eprintln!("node {id}: stopped without draining");
            }
        }
        Ok(())
    })
}

/// Waits for SIGTERM or Ctrl-C.
async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        tokio::select! {
            _ = term.recv() => {}
            r = tokio::signal::ctrl_c() => r.context("listening for Ctrl-C")?,
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("listening for Ctrl-C")?;
    Ok(())
}
