//! A cluster node: what `scd node --config` runs, and what the in-process cluster of
//! `scd demo` and the tests start several of.
//!
//! A node binds its QUIC endpoint, registers in the store under a lease (as producer of its
//! base model and consumer of its experts, with its capacity and load), publishes the model
//! records, runs a scheduler replica if its roles say so, starts the actors of its roles, and
//! then follows the job records ([`jobs`]): it prefills the jobs assigned to it as producer and
//! decodes the job streams that reach it as consumer.
//!
//! [`Node::shutdown`] drains: the node stops taking work and advertises nothing to serve, lets
//! the jobs in flight finish for a while, hands the rest back to the queue, revokes its lease
//! (the node leaves at once, not when the lease expires), then stops its actors and endpoint.
//!
//! - [`served`]: loading the models and translators a config names.
//! - `translators`: the translator version of each expert, following the cluster's live one.
//! - `supervisor`: the actor that starts the node's actors and starts a new one in place of
//!   any that fails; the node reaches them through its table.
//! - `jobs`: the node's share of the jobs, from the records and the streams.
//! - `admin`: the admin endpoint (submit, watch, cancel) for clients with an admin
//!   certificate.

mod admin;
mod bearer;
mod gateway;
mod jobs;
#[doc(hidden)]
pub use jobs::failpoints;
pub mod served;
mod supervisor;
mod translators;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, RwLock};
use std::time::Duration;

use ractor::{ActorRef, SpawnErr};
use scd_models::codec::CodecOptions;
use scd_scheduler::jobs::{now_ms, Blame};
use scd_scheduler::membership::MembershipError;
use scd_scheduler::models::ModelError;
use scd_scheduler::{
    JobStore, Keys, LiveNodes, MetaStore, ModelRegistry, NodeInfo, Registration,
    RegistrationConfig, Scheduler, SchedulerConfig, SchedulerError,
};
use scd_transport::{BindError, Endpoint, Identity, JobId, Role, TransportOptions};
use tokio::sync::{mpsc, watch, Mutex};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{NodeConfig, NodeRole};
use crate::decode_loop::DecodeLoop;
use crate::job::PipelineOptions;
use crate::metrics::{NodeMetrics, QueueLabels};
use crate::prefix_cache::PrefixCache;
use crate::telemetry::Telemetry;
use crate::transfer::TransferInMsg;
use jobs::Work;
pub use served::{ServeError, Served, ServedExpert};
use supervisor::{ActorTable, Actors, SupervisorArgs, SupervisorMsg};
use translators::NodeTranslators;
pub use translators::VersionError;

/// Errors starting or stopping a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The endpoint could not be bound.
    #[error("binding the QUIC endpoint: {0}")]
    Bind(#[from] BindError),
    /// The endpoint's address could not be read.
    #[error("reading the endpoint's address: {0}")]
    Address(std::io::Error),
    /// Registration or the node view failed.
    #[error("joining the cluster: {0}")]
    Membership(#[from] MembershipError),
    /// The model records could not be written.
    #[error("publishing the model records: {0}")]
    Models(#[from] ModelError),
    /// A model record in the store disagrees with what this node loaded.
    #[error("model {id}: the cluster has weights {theirs}, this node loaded {ours}; every node must load the same file")]
    ModelMismatch {
        /// The model.
        id: String,
        /// The hash in the store.
        theirs: String,
        /// This node's hash.
        ours: String,
    },
    /// A translator version of the node's experts could not be published or loaded.
    #[error("the translators of this node's experts: {0}")]
    Translators(#[from] VersionError),
    /// The scheduler replica could not start.
    #[error("starting the scheduler replica: {0}")]
    Scheduler(#[from] SchedulerError),
    /// An actor could not start.
    #[error("starting an actor: {0}")]
    Spawn(#[from] SpawnErr),
    /// The decode loop's thread could not start.
    #[error("starting the decode loop: {0}")]
    DecodeLoop(std::io::Error),
    /// The HTTP API's address could not be bound.
    #[error("binding the HTTP API on {addr}: {source}")]
    HttpBind {
        /// `node.http_listen`.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// What a drain did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Jobs in flight when the drain began.
    pub in_flight: usize,
    /// Jobs handed back to the queue (or failed, out of attempts) because they did not finish
    /// in time.
    pub handed_back: Vec<JobId>,
}

/// A running node.
pub struct Node {
    id: scd_types::NodeId,
    addr: SocketAddr,
    http_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    work: Arc<Work>,
    registration: Arc<Registration>,
    scheduler: Option<Scheduler>,
    supervisor: Option<(ActorRef<SupervisorMsg>, JoinHandle<()>)>,
    restarts: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Starts a node: `config` says what it is, `identity` is its certificate (issued to
    /// `config.node.id` by the cluster CA), `served` the models it loaded
    /// ([`Served::load`]), `store` the cluster state, `telemetry` where its job spans go. Cancelling `cancel` stops its work at
    /// once (use [`Node::shutdown`] to drain first).
    pub async fn start(
        config: &NodeConfig,
        identity: &Identity,
        served: Arc<Served>,
        store: Arc<dyn MetaStore>,
        telemetry: Option<Telemetry>,
        cancel: CancellationToken,
    ) -> Result<Self, NodeError> {
        let cancel = cancel.child_token();
        let id = config.node.id.clone();
        let keys = Keys::new(config.store.prefix());
        let producer_role = config.has_role(NodeRole::Producer);
        let consumer_role = config.has_role(NodeRole::Consumer);
        check_models(&store, &keys, &served).await?;
        let metrics = Arc::new(NodeMetrics::new());
        let translators =
            NodeTranslators::start(&served, store.clone(), &keys, metrics.clone()).await?;

        let transport = TransportOptions {
            send_queue_frames: config.limits.frames_in_flight.get(),
            pacing_to: config.pacing_to(),
            ..TransportOptions::default()
        };
        let endpoint = Endpoint::bind(config.node.listen, identity, transport.clone())?;
        let addr = endpoint.local_addr().map_err(NodeError::Address)?;

        // Job streams that arrived before a decoder took them; past `[limits] queued_jobs`, a
        // new stream is refused as busy.
        let (new_streams_tx, new_streams) = mpsc::channel(config.limits.queued_jobs.get());
        let table: ActorTable = Arc::new(RwLock::new(Actors::default()));
        let inbound = Arc::new(StdMutex::new(Vec::new()));
        let restarts = Arc::new(AtomicU64::new(0));
        let prefix_cache = (producer_role && config.limits.prefix_cache_mib > 0).then(|| {
            Arc::new(PrefixCache::new(
                &served.base_id,
                scd_scheduler::prefix::DEFAULT_BLOCK_TOKENS,
                config.limits.prefix_cache_mib << 20,
            ))
        });
        let decode_loop = if consumer_role {
            Some(DecodeLoop::start().map_err(NodeError::DecodeLoop)?)
        } else {
            None
        };
        let (supervisor, supervisor_task) = supervisor::start(SupervisorArgs {
            prefix_cache: prefix_cache.clone(),
            decode_loop: decode_loop.clone(),
            served: served.clone(),
            producer_role,
            consumer_role,
            cancel: cancel.clone(),
            new_streams: new_streams_tx,
            table: table.clone(),
            inbound: inbound.clone(),
            restarts: restarts.clone(),
        })
        .await?;

        let mut info = NodeInfo::new(
            id.clone(),
            config
                .node
                .advertise
                .clone()
                .unwrap_or_else(|| advertised(config.node.listen, addr)),
            u32::try_from(config.limits.concurrent_jobs.get()).unwrap_or(u32::MAX),
        );
        if producer_role {
            info.producer_models = vec![served.base_id.clone()];
        }
        if consumer_role {
            info.consumer_models = served.experts.keys().cloned().collect();
            info.transfer_kl = served
                .experts
                .values()
                .filter(|e| !e.transfer_kl.is_empty())
                .map(|e| (e.name.clone(), e.transfer_kl.clone()))
                .collect();
        }
        if let Some(docs) = served.documents.as_ref().filter(|_| producer_role) {
            // What the store holds from earlier runs is announced again: the entries outlive
            // the node, the registration does not.
            info.document_writer = Some(docs.version().id());
            let mut held = docs.held().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "listing the compiled documents failed; announcing none");
                Vec::new()
            });
            held.truncate(jobs::MAX_ANNOUNCED_DOCUMENTS);
            info.documents = held;
        }
        let registration = Arc::new(
            Registration::register(store.clone(), &keys, info, RegistrationConfig::default())
                .await?,
        );
        let nodes = LiveNodes::start(store.clone(), &keys).await?;
        let scheduler = if config.has_role(NodeRole::Scheduler) {
            Some(
                Scheduler::start(
                    store.clone(),
                    keys.clone(),
                    &id,
                    SchedulerConfig {
                        max_unfinished_jobs: config.limits.unfinished_jobs.get() as u64,
                        retention: Duration::from_secs(
                            config
                                .limits
                                .finished_jobs_max_age_h
                                .get()
                                .saturating_mul(3600),
                        ),
                        archive: scd_scheduler::ArchiveConfig {
                            after: Duration::from_secs(config.limits.archive_finished_after_s),
                            max_records: config.limits.archived_jobs_max,
                            ..scd_scheduler::ArchiveConfig::default()
                        },
                        orphan_grace: Duration::from_secs(config.limits.orphan_grace_s),
                        attempt_deadline: scd_scheduler::AttemptDeadline {
                            base: Duration::from_secs(config.limits.attempt_base_s),
                            per_token: Duration::from_millis(config.limits.attempt_ms_per_token),
                        },
                        ..SchedulerConfig::default()
                    },
                )
                .await?,
            )
        } else {
            None
        };

        let (load, load_rx) = watch::channel(0);
        let kernels = served.kernels;
        let work = Arc::new(Work {
            id: id.clone(),
            store: store.clone(),
            jobs: JobStore::new(store.clone(), keys.clone()),
            client: crate::client::ClusterClient::new(store.clone(), keys.clone()),
            metrics: metrics.clone(),
            telemetry,
            admin: config.has_role(NodeRole::Admin),
            keys,
            served,
            prefix_cache,
            decode_loop,
            translators,
            codec_options: CodecOptions {
                code_dtype: config.codec.code_dtype.dtype(),
                matmul: kernels.prefill_matmul,
                ..CodecOptions::default()
            },
            drift: Arc::new(crate::drift_guard::DriftGuard::new(config.drift())),
            ranks: crate::rank_planner::RankPlanner::new(
                config.codec.ranks,
                config.rank_policy(),
                config.codec.code_dtype.dtype(),
            ),
            queues: PipelineOptions {
                transport,
                ..PipelineOptions::default()
            },
            producer_role,
            actors: table,
            inbound,
            endpoint,
            nodes,
            load,
            registration: registration.clone(),
            links: Mutex::new(HashMap::new()),
            kv: crate::kv_budget::KvBudget::new(config.limits.kv_mib),
            finish_costs: crate::mode_planner::CostsPerToken::default(),
            encode_costs: crate::mode_planner::CostsPerToken::default(),
            serve_costs: crate::mode_planner::CostsPerToken::default(),
            active: StdMutex::new(HashMap::new()),
            draining: AtomicBool::new(false),
            cancel: cancel.clone(),
        });
        let mut http_addr = None;
        let mut tasks = Vec::new();
        if let (true, Some(listen)) = (config.has_role(NodeRole::Gateway), config.node.http_listen)
        {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|source| NodeError::HttpBind {
                    addr: listen,
                    source,
                })?;
            http_addr = Some(listener.local_addr().map_err(NodeError::Address)?);
            if config.gateway.api_keys.is_empty() {
                tracing::warn!(node = %id, %listen, "the HTTP API takes requests without an API key: set [gateway] api_keys or api_keys_file to require one");
            }
            tasks.push(tokio::spawn(gateway::serve(
                work.clone(),
                listener,
                config.gateway.clone(),
            )));
        }
        let mut metrics_addr = None;
        if let Some(listen) = config.node.metrics_listen {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|source| NodeError::HttpBind {
                    addr: listen,
                    source,
                })?;
            metrics_addr = Some(listener.local_addr().map_err(NodeError::Address)?);
            tasks.push(tokio::spawn(serve_metrics(
                work.clone(),
                listener,
                restarts.clone(),
                config.node.metrics_token.clone(),
            )));
        }
        tasks.extend([
            tokio::spawn(accept_connections(work.clone())),
            tokio::spawn(take_streams(work.clone(), new_streams)),
            tokio::spawn(jobs::follow_jobs(work.clone())),
            tokio::spawn(report_load(registration.clone(), load_rx, cancel.clone())),
        ]);
        if let Some(cache) = &work.prefix_cache {
            tasks.push(tokio::spawn(advertise_prefixes(
                registration.clone(),
                cache.clone(),
                cancel.clone(),
            )));
        }
        tracing::info!(node = %id, %addr, producer = producer_role, consumer = consumer_role, "node started");
        Ok(Self {
            id,
            addr,
            http_addr,
            metrics_addr,
            work,
            registration,
            scheduler,
            supervisor: Some((supervisor, supervisor_task)),
            restarts,
            tasks,
        })
    }

    /// The node's id.
    pub fn id(&self) -> &scd_types::NodeId {
        &self.id
    }

    /// Where its QUIC endpoint listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where its HTTP API listens (gateway role).
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// Where its metrics endpoint listens (`node.metrics_listen`).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Its metrics as a scrape of `GET /metrics` would show them.
    pub fn metrics_text(&self) -> String {
        self.work.metrics.render()
    }

    /// Jobs it works on now.
    pub fn load(&self) -> usize {
        self.work.load()
    }

    /// The compiled documents it serves (a producer with `[documents]`): its store's counts of
    /// compilations and hits say what was computed.
    pub fn documents(&self) -> Option<&crate::documents::DocumentServer> {
        self.work.served.documents.as_deref()
    }

    /// Actors its supervisor has started again since the node started.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::SeqCst)
    }

    /// The translator version (name and hash) new jobs of `expert` use on this node now.
    pub fn translator(&self, expert: &str) -> Option<(String, scd_scheduler::TranslatorHash)> {
        let v = self.work.translators.current(expert).ok()?;
        Some((v.name.clone(), v.hash()))
    }

    /// Kills one of the node's actors (`producer`, `encoder`, `transfer-out`, `transfer-in`,
    /// `decoder:<expert>`) as a failure would: for tests of the supervision. Whether it exists.
    #[doc(hidden)]
    pub async fn kill_actor(&self, name: &str) -> bool {
        let Some((supervisor, _)) = &self.supervisor else {
            return false;
        };
        ractor::call!(supervisor, SupervisorMsg::Kill, name.to_owned()).unwrap_or(false)
    }

    /// Drains and stops the node (see the module docs): jobs in flight get `grace` to finish.
    pub async fn shutdown(mut self, grace: Duration) -> DrainReport {
        let work = &self.work;
        work.draining.store(true, Ordering::SeqCst);
        let in_flight = work.load();
        let stop_serving = self.registration.update(|info| {
            info.producer_models.clear();
            info.consumer_models.clear();
            info.capacity = 0;
        });
        if let Err(e) = stop_serving.await {
            tracing::warn!(node = %self.id, error = %e, "advertising the drain failed");
        }
        // The scheduler places work from its watch of the nodes: a job handed back before that
        // view shows this node serving nothing could come straight back here. This node's own
        // view follows the same watch; wait (briefly) until it shows the change.
        let mut view = work.nodes.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                let drained = view
                    .borrow_and_update()
                    .get(&self.id)
                    .is_none_or(|n| n.capacity == 0 && n.consumer_models.is_empty());
                if drained || view.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        let deadline = tokio::time::Instant::now() + grace;
        while work.load() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = work.active_jobs();
        let mut handed_back = Vec::new();
        for job in left {
            work.cancel_local(
                job,
                crate::lifecycle::RecordAction::CancelLocal { through: u32::MAX },
            );
            let reason = format!("node {} shut down", self.id);
            let back = work
                .jobs
                .update(job, |j| {
                    if j.state.is_running() {
                        // A draining node blames itself, so that the retry goes elsewhere.
                        let blame = if j.producer.as_deref() == Some(self.id.as_str()) {
                            Blame::Producer
                        } else {
                            Blame::Consumer
                        };
                        j.retry(&reason, blame, now_ms())?;
                    }
                    Ok(())
                })
                .await;
            match back {
                Ok(_) => handed_back.push(job),
                Err(e) => tracing::warn!(%job, error = %e, "handing a job back failed"),
            }
        }
        if let Err(e) = self.registration.leave().await {
            tracing::warn!(node = %self.id, error = %e, "revoking the lease failed; the node key goes when it expires");
        }
        if let Some(s) = self.scheduler.take() {
            if let Err(e) = s.shutdown().await {
                tracing::warn!(node = %self.id, error = %e, "resigning the scheduler leadership failed");
            }
        }
        self.stop().await;
        tracing::info!(
            node = %self.id,
            in_flight,
            handed_back = handed_back.len(),
            "node stopped"
        );
        DrainReport {
            in_flight,
            handed_back,
        }
    }

    /// Stops at once, as a crash would, but tidily in this process: no drain, the lease is
    /// left to expire.
    pub async fn kill(mut self) {
        self.scheduler.take();
        self.stop().await;
    }

    async fn stop(&mut self) {
        self.work.cancel.cancel();
        for task in &self.tasks {
            task.abort();
        }
        if let Some((supervisor, task)) = self.supervisor.take() {
            // Its children stop with it (its post_stop).
            supervisor.stop(None);
            let _ = task.await;
        }
        self.work.endpoint.close();
        self.work.endpoint.wait_idle().await;
        if let Some(t) = self.work.telemetry.clone() {
            // The batch exporter's last send may wait on the network: off the runtime.
            let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
        }
    }
}

/// The address other nodes reach this one at: the configured one, with the port the endpoint
/// got when the config asked for any (port 0).
fn advertised(listen: SocketAddr, bound: SocketAddr) -> String {
    if listen.port() == 0 {
        bound.to_string()
    } else {
        listen.to_string()
    }
}

/// Checks this node's models against the cluster's records, then writes them: a node with
/// other weights under the same name would decode garbage, so it is refused at start.
async fn check_models(
    store: &Arc<dyn MetaStore>,
    keys: &Keys,
    served: &Served,
) -> Result<(), NodeError> {
    let registry = ModelRegistry::new(store.clone(), keys.clone());
    for record in served.records() {
        if let Some(theirs) = registry.get(&record.id).await? {
            if theirs.weights_hash != record.weights_hash {
                return Err(NodeError::ModelMismatch {
                    id: record.id,
                    theirs: theirs.weights_hash,
                    ours: record.weights_hash,
                });
            }
            continue;
        }
        registry.put(&record).await?;
    }
    Ok(())
}

/// Accepts connections: other nodes' go to the transfer actor (their job streams), admin
/// clients' to the admin endpoint when the node has the admin role.
async fn accept_connections(work: Arc<Work>) {
    loop {
        let incoming = tokio::select! {
            () = work.cancel.cancelled() => return,
            i = work.endpoint.accept() => i,
        };
        let Some(incoming) = incoming else { return };
        let work = work.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let connection = match incoming.complete().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%remote, error = %e, "refused a connection");
                    return;
                }
            };
            match connection.peer().role {
                Role::Node => {
                    work.inbound
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(connection.clone());
                    let transfer_in = supervisor::read(&work.actors).transfer_in.clone();
                    if let Some(t) = transfer_in {
                        let _ = t.send_message(TransferInMsg::Connection(connection));
                    }
                }
                Role::Admin if work.admin => admin::serve(work, connection).await,
                Role::Admin => {
                    tracing::info!(%remote, "closing an admin connection: no admin role here");
                    connection.close("this node has no admin role: use a node whose config lists \"admin\" in node.roles");
                }
            }
        });
    }
}

/// Hands the job streams nobody expected to the node's consumer side.
async fn take_streams(work: Arc<Work>, mut streams: mpsc::Receiver<scd_transport::JobReceiver>) {
    loop {
        let next = tokio::select! {
            () = work.cancel.cancelled() => return,
            s = streams.recv() => s,
        };
        let Some(receiver) = next else { return };
        if work.draining.load(Ordering::SeqCst) {
            receiver.cancel("the node is draining").await;
            continue;
        }
        let work = work.clone();
        tokio::spawn(async move { work.on_stream(receiver).await });
    }
}

/// Whether the node is ready for work: not draining, and its registration is in the store
/// (the node's own view of the cluster, which follows the store as the scheduler's does) with
/// the models it loaded and a capacity. `Ok` says what it serves, `Err` why it is not ready.
fn readiness(work: &Work) -> Result<String, String> {
    if work.draining.load(Ordering::SeqCst) {
        return Err(format!("node {}: draining", work.id));
    }
    let wanted = work.registration.info();
    let view = work.nodes.snapshot();
    let Some(listed) = view.get(&work.id) else {
        return Err(format!(
            "node {}: not registered in the store (lease lost or not yet written)",
            work.id
        ));
    };
    if listed.capacity == 0
        || listed.producer_models != wanted.producer_models
        || listed.consumer_models != wanted.consumer_models
    {
        return Err(format!(
            "node {}: the store lists it serving base {:?}, experts {:?}, capacity {}; it loaded base {:?}, experts {:?}",
            work.id,
            listed.producer_models,
            listed.consumer_models,
            listed.capacity,
            wanted.producer_models,
            wanted.consumer_models
        ));
    }
    Ok(format!(
        "node {}: ready; base {:?}, experts {:?}",
        work.id, wanted.producer_models, wanted.consumer_models
    ))
}

/// Serves `/metrics` until the node stops; each scrape sets the cluster's jobs by state from
/// the job follower's index, never listing the store. With `token` (`[node] metrics_token`) a
/// scrape must carry it as a bearer token, else 401. Beside it, the probes, open to the
/// kubelet: `/livez` (200 while the node runs) and `/readyz` (200 when [`readiness`] says so,
/// else 503 with the reason).
async fn serve_metrics(
    work: Arc<Work>,
    listener: tokio::net::TcpListener,
    restarts: Arc<AtomicU64>,
    token: Option<String>,
) {
    use axum::http::header::CONTENT_TYPE;
    let cancel = work.cancel.clone();
    let work_for_probe = work.clone();
    let scrape = move || {
        let work = work.clone();
        let restarts = restarts.clone();
        async move {
            let m = &work.metrics;
            m.set_restarts(restarts.load(Ordering::SeqCst));
            // No listing here: the counts come from the job follower's index.
            m.set_cluster_jobs();
            if let Some(cache) = &work.prefix_cache {
                let s = cache.stats();
                m.prefix_cache_bytes.set(s.bytes as i64);
                m.prefix_cache_blocks.set(s.blocks as i64);
            }
            if let Some(decode) = &work.decode_loop {
                m.set_decode(decode.stats());
            }
            let jobs = m.cluster.records();
            let (producer, consumer) = work.waiting(jobs.iter());
            for (queue, n) in [("producer", producer), ("consumer", consumer)] {
                let labels = QueueLabels {
                    queue: queue.into(),
                };
                m.queues.get_or_create(&labels).set(n as i64);
            }
            (
                [(
                    CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                m.render(),
            )
        }
    };
    let ready = {
        let work = work_for_probe;
        move || {
            let work = work.clone();
            async move {
                use axum::http::StatusCode;
                match readiness(&work) {
                    Ok(why) => (StatusCode::OK, why + "\n"),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why + "\n"),
                }
            }
        }
    };
    let tokens: Arc<[String]> = token.into_iter().collect();
    let scrapes = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .route_layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let tokens = tokens.clone();
                async move {
                    use axum::response::IntoResponse;
                    if tokens.is_empty() || bearer::carries_one_of(request.headers(), &tokens) {
                        return next.run(request).await;
                    }
                    (
                        axum::http::StatusCode::UNAUTHORIZED,
                        [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
                        "missing or wrong token: send Authorization: Bearer <token> with the node's [node] metrics_token\n",
                    )
                        .into_response()
                }
            },
        ));
    let app = scrapes
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route("/readyz", axum::routing::get(ready));
    let stopped = async move { cancel.cancelled().await };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await
    {
        tracing::warn!(error = %e, "the metrics endpoint stopped");
    }
}

/// Most prefix hashes a node advertises (the most recently used).
const ADVERTISED_PREFIXES: usize = 1024;

/// Writes the prefix blocks the producer's cache holds into the node's registration as they
/// change, for the scheduler's prefix affinity.
async fn advertise_prefixes(
    registration: Arc<Registration>,
    cache: Arc<PrefixCache>,
    cancel: CancellationToken,
) {
    let mut changed = cache.subscribe();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            c = changed.changed() => if c.is_err() { return },
        }
        changed.borrow_and_update();
        let held = cache.held(ADVERTISED_PREFIXES);
        if let Err(e) = registration
            .update(|info| info.prefix_hashes = held.clone())
            .await
        {
            tracing::debug!(error = %e, "advertising the cached prefixes failed");
        }
    }
}

/// Writes the node's load into its registration as it changes (the latest value wins).
async fn report_load(
    registration: Arc<Registration>,
    mut load: watch::Receiver<usize>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = load.changed() => if changed.is_err() { return },
        }
        let now = u32::try_from(*load.borrow_and_update()).unwrap_or(u32::MAX);
        if let Err(e) = registration.update(|info| info.load = now).await {
            tracing::debug!(error = %e, "reporting the load failed");
        }
    }
}
