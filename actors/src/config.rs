//! The node configuration: the TOML file `scd node --config <file>` starts a node from.
//!
//! Sections: `[node]` (id, listen address, roles), `[models]` (the base model), `[[experts]]`
//! (each expert's adapter and translator), `[store]` (embedded, or etcd endpoints), `[tls]` (the
//! cluster CA and this node's certificate and key), `[tracing]` (OTLP export) and `[limits]`
//! (queue lengths). `cluster-config/` at the repository root holds ready files.
//!
//! Every section refuses keys it does not know, naming them, so that a misspelt setting is an
//! error instead of a silent default. Relative paths are relative to the folder of the config
//! file, not to the working directory, so a config works wherever the node is started.
//!
//! Checking is two steps, so that what can be checked without the files is checked everywhere
//! (the shipped configs in CI, where models and certificates are absent):
//! [`NodeConfig::parse`] checks the text (syntax, unknown keys, values, and that roles and
//! sections agree) and resolves paths; [`NodeConfig::validate_files`] checks what the config
//! names on disk (every file exists, the node certificate is signed by the configured CA and
//! issued to this node). [`NodeConfig::load`] does both, so a bad config stops a node at start,
//! not at its first job.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::fs;
use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};

use scd_models::expert::ADAPTER_FILE;
use scd_models::translator::artifact::{MANIFEST_FILE, WEIGHTS_FILE};
use scd_scheduler::keys::{check_id, DEFAULT_ROOT};
use scd_transport::pki::{self, Identity, PkiError, Role};
use scd_transport::TransportOptions;
use serde::Deserialize;

/// A node's configuration, checked, with its paths resolved against the config file's folder.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// `[node]`: who this node is and what it does.
    pub node: NodeSettings,
    /// `[models]`: the base model, for producers and consumers.
    #[serde(default)]
    pub models: ModelsConfig,
    /// `[[experts]]`: the experts this node serves, each with its translator.
    #[serde(default)]
    pub experts: Vec<ExpertConfig>,
    /// `[store]`: where the cluster state lives. Required: a node whose etcd settings were
    /// forgotten would otherwise run on a store of its own, alone, without noticing.
    pub store: StoreConfig,
    /// `[tls]`: the certificates of the mutual TLS every connection uses.
    pub tls: TlsConfig,
    /// `[tracing]`: span export; off by default.
    #[serde(default)]
    pub tracing: TracingConfig,
    /// `[limits]`: queue lengths and concurrency.
    #[serde(default)]
    pub limits: Limits,
    /// `[codec]`: how this node's producer writes codes.
    #[serde(default)]
    pub codec: CodecConfig,
    /// `[gateway]`: the OpenAI-compatible HTTP API's settings.
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// `[links]`: link emulation.
    #[serde(default)]
    pub links: LinksConfig,
    /// `[drift]`: the consumer's shadow checks of translated jobs (defaults when absent; see
    /// [`NodeConfig::drift`]).
    #[serde(default)]
    pub drift: Option<DriftConfig>,
    /// `[documents]`: the producer's compiled-document store (SemPIC); absent: the producer
    /// serves no documents.
    #[serde(default)]
    pub documents: Option<DocumentsConfig>,
}

/// `[documents]`: how a producer serves the documents jobs name (SemPIC, `docs/method.md` §5.5):
/// compiled once by a writer into the store under `dir`, then served from there to every job that
/// names them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentsConfig {
    /// `dir`: the compiled-document store (created if missing; entries survive restarts and
    /// are announced again when the node starts).
    pub dir: PathBuf,
    /// `writer`: the SemPIC writer's adapter (a folder holding `adapter.safetensors`, or the
    /// file); absent: documents are compiled by the base model itself (plain stitching).
    #[serde(default)]
    pub writer: Option<PathBuf>,
    /// `boundary`: a folder of KV-Packet boundary tokens trained for that writer
    /// (`scd sempic boundary`); absent: none.
    #[serde(default)]
    pub boundary: Option<PathBuf>,
    /// `wire`: the element type compiled caches travel in, `"bf16"` (the default: half the
    /// bytes) or `"f32"` (exactly the stored cache).
    #[serde(default)]
    pub wire: DocumentWire,
}

impl DocumentsConfig {
    /// The writer adapter's weights file, as for an expert's adapter.
    pub fn writer_file(&self) -> Option<PathBuf> {
        self.writer.as_ref().map(|path| {
            if path.extension().is_some_and(|e| e == "safetensors") {
                path.clone()
            } else {
                path.join(ADAPTER_FILE)
            }
        })
    }
}

/// The element types compiled documents can travel in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DocumentWire {
    /// bfloat16.
    #[default]
    Bf16,
    /// f32.
    F32,
}

impl DocumentWire {
    /// The wire's element type.
    pub fn dtype(self) -> scd_transport::CodeDType {
        match self {
            Self::Bf16 => scd_transport::CodeDType::BF16,
            Self::F32 => scd_transport::CodeDType::F32,
        }
    }
}

/// `[gateway]`: who may call the HTTP API and how its jobs reach the expert.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// `api_keys`: bearer tokens the API accepts (`Authorization: Bearer <key>`); empty: the
    /// API is open to anyone who can reach `node.http_listen` (a warning says so at start).
    pub api_keys: Vec<String>,
    /// `api_keys_file`: a file of more keys, one per line (blank lines and lines starting
    /// with `#` skipped), so that the keys need not sit in the config (a Compose or Kubernetes
    /// secret mounted as a file). Read when the config is loaded, into `api_keys`.
    pub api_keys_file: Option<PathBuf>,
    /// `default_mode`: the transfer mode of a request that names none (the `scd_mode` field of
    /// a request picks another); default `auto`, the producer's choice per job.
    pub default_mode: scd_transport::Mode,
    /// `max_requests_per_key`: requests one API key may have unanswered at this gateway at
    /// once (streams count until they end); more get 429 with `Retry-After`, so that one
    /// caller cannot take every slot of the cluster's admission. 0: no limit. Default 16.
    /// Without `api_keys` there is no caller to tell apart, and no limit.
    pub max_requests_per_key: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            api_keys_file: None,
            default_mode: scd_transport::Mode::Auto,
            max_requests_per_key: 16,
        }
    }
}

/// `[codec]`: how a producer writes the codes of `reuse` and `scd` jobs. A consumer reads
/// whatever element type and ranks each job's record and frames name, so producers may differ.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CodecConfig {
    /// `code_dtype`: `"f16"` (the default), `"i8-rows"` (int8 with a scale per token and
    /// code: half the bytes, at the KL cost BENCHMARKS.md measures) or `"tc"` (transform-coded:
    /// a step per component and entropy coding, at a rate chosen per job from the translator's
    /// rate table as ranks are from its curve; about a third of i8-rows' bytes at the same KL).
    pub code_dtype: CodeDtypeName,
    /// `ranks`: `"adaptive"` (the default: per job, from the measured link to the job's
    /// consumer and the translator's quality-vs-ranks curve, under `kl_ceiling`), `"default"`
    /// (the translator's default ranks), or fixed ranks such as `"k=96,v=192,h=128"`.
    pub ranks: RankSetting,
    /// `kl_ceiling`: with adaptive ranks, the highest held-out KL (as the translator's curve
    /// measured it) a job's ranks may have. Default 0.1.
    pub kl_ceiling: f64,
    /// `rank_slack`: with adaptive ranks, choices whose expected time to first token is within
    /// this share of the fastest one count as equally fast, and the better code among them is
    /// sent. Default 0.05.
    pub rank_slack: f64,
}

impl Default for CodecConfig {
    fn default() -> Self {
        let policy = scd_models::translator::RankPolicy::default();
        Self {
            code_dtype: CodeDtypeName::default(),
            ranks: RankSetting::Adaptive,
            kl_ceiling: policy.kl_ceiling,
            rank_slack: policy.slack,
        }
    }
}

/// How a producer picks the ranks of a job's codes (`[codec] ranks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankSetting {
    /// Per job, for the link ([`scd_models::translator::rank_curve::choose`]).
    Adaptive,
    /// The translator's default ranks.
    Default,
    /// These ranks for every job.
    Fixed(scd_scheduler::Ranks),
}

impl<'de> Deserialize<'de> for RankSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "adaptive" => Ok(Self::Adaptive),
            "default" => Ok(Self::Default),
            other => other.parse().map(Self::Fixed).map_err(|e| {
                serde::de::Error::custom(format!("{e}, or \"adaptive\" or \"default\""))
            }),
        }
    }
}

/// `[drift]`: the drift guard of a consumer ([`crate::drift_guard`]).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DriftConfig {
    /// `shadow_share`: the share of `reuse` / `scd` jobs also checked against the expert's own
    /// prefill, in the background after they answer (0 turns the guard off). Default 0.02.
    pub shadow_share: f64,
    /// `kl_bound`: the mean shadow KL over the window above which the live translator version
    /// is marked degraded. Default 0.5 (raw transfer of the shipped experts measures
    /// 0.03-0.11: docs/drift.md, BENCHMARKS.md "Codes sized for the link").
    pub kl_bound: f64,
    /// `window`: checks the mean is over (the most recent). Default 50.
    pub window: usize,
    /// `min_jobs`: checks needed before a version can be marked. Default 10.
    pub min_jobs: usize,
}

impl Default for DriftConfig {
    fn default() -> Self {
        Self {
            shadow_share: 0.02,
            kl_bound: 0.5,
            window: 50,
            min_jobs: 10,
        }
    }
}

/// `[links]`: link emulation, for tests and demos of slow links.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinksConfig {
    /// `pace_mbit`: what this node sends to a peer goes at most this many Mbit/s, by peer
    /// node id, e.g. `pace_mbit = { consumer-a = 50 }` (a token bucket on the send path).
    pub pace_mbit: std::collections::BTreeMap<String, u64>,
}

/// The code element types a producer can be configured to send.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CodeDtypeName {
    /// IEEE half precision.
    #[default]
    F16,
    /// int8 rows, each with its f32 scale.
    I8Rows,
    /// Transform-coded ([`scd_transport::CodeDType::TC`]).
    Tc,
}

impl CodeDtypeName {
    /// The wire's element type.
    pub fn dtype(self) -> scd_transport::CodeDType {
        match self {
            Self::F16 => scd_transport::CodeDType::F16,
            Self::I8Rows => scd_transport::CodeDType::I8_ROWS,
            Self::Tc => scd_transport::CodeDType::TC,
        }
    }
}

/// `[node]`: the node's identity, address and roles.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSettings {
    /// The node's name: its key in the store and the name its certificate is issued to
    /// (1-63 characters of a-z, 0-9 and '-').
    pub id: scd_types::NodeId,
    /// The QUIC endpoint's address (UDP): code streams between nodes and admin clients.
    pub listen: SocketAddr,
    /// What the node does; at least one role.
    pub roles: BTreeSet<NodeRole>,
    /// The OpenAI-compatible HTTP API's address (TCP); required with the `gateway` role, and
    /// refused without it.
    #[serde(default)]
    pub http_listen: Option<SocketAddr>,
    /// Where the Prometheus (OpenMetrics text) endpoint `/metrics` listens (TCP); none: no
    /// endpoint.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// A bearer token `/metrics` requires (`Authorization: Bearer <token>`, Prometheus's
    /// `authorization.credentials_file`); none: `/metrics` is open to anyone who can reach
    /// `metrics_listen`. The probes `/livez` and `/readyz` stay open either way.
    #[serde(default)]
    pub metrics_token: Option<String>,
    /// The `host:port` other nodes reach this one at, when it differs from `listen` (a node
    /// listening on `0.0.0.0` in a container is reached by its service name); default: `listen`.
    #[serde(default)]
    pub advertise: Option<String>,
}

/// What a node does. One process may hold every role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// Prefills prompts with the base model and streams each layer's codes to consumers.
    Producer,
    /// Hosts experts: rebuilds a prompt's cache from codes and decodes.
    Consumer,
    /// A scheduler replica: stands in the leader election; the leader assigns jobs and pools.
    Scheduler,
    /// Accepts admin clients (`scd submit` and the operator commands) on the QUIC endpoint.
    Admin,
    /// Serves the OpenAI-compatible HTTP API on `node.http_listen`.
    Gateway,
}

impl NodeRole {
    /// The name used in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Producer => "producer",
            NodeRole::Consumer => "consumer",
            NodeRole::Scheduler => "scheduler",
            NodeRole::Admin => "admin",
            NodeRole::Gateway => "gateway",
        }
    }
}

impl fmt::Display for NodeRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[models]`: the model files a node loads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// The base model's GGUF file: producers prefill with it, consumers run each expert as it
    /// plus the expert's adapter. Required on both, refused on nodes that are neither.
    #[serde(default)]
    pub base: Option<PathBuf>,
    /// How a consumer applies its experts' adapters: `merge` (a weight copy per expert, no
    /// cost per token), `on-the-fly` (the base weights shared by every expert, each adapter's
    /// low-rank term added per token), or `auto` (default): merge for one expert, on the fly
    /// for several, so that a node's memory grows by the adapters, not by whole models.
    #[serde(default)]
    pub adapter_mode: AdapterModeConfig,
    /// Folders the node loads translators from: its configured ones and every version the
    /// store names (`scd translators publish` / `activate`) must lie under one, after links
    /// are followed. Default: the folders holding the translator folders of `[[experts]]`.
    #[serde(default)]
    pub translator_roots: Vec<PathBuf>,
}

/// `[models] adapter_mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterModeConfig {
    /// Merge for one expert, on the fly for several.
    #[default]
    Auto,
    /// Each expert's own merged weights.
    Merge,
    /// The base's weights shared, adapters applied per token.
    OnTheFly,
}

/// One `[[experts]]` entry: an expert of the base model this node serves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertConfig {
    /// The expert's model name: what jobs and the HTTP API name, and its pool's key in the
    /// store.
    pub name: String,
    /// The LoRA adapter: an expert folder holding `adapter.safetensors`, or the `.safetensors`
    /// file itself. Required on consumers, which run the expert; a producer does not need it.
    #[serde(default)]
    pub adapter: Option<PathBuf>,
    /// The translator folder (`translator.json` and `translator.safetensors`) between the base
    /// model and this expert: producers encode with it, consumers rebuild with it.
    pub translator: PathBuf,
}

impl ExpertConfig {
    /// The adapter's weights file: `adapter` itself when it names a `.safetensors` file, else
    /// `adapter.safetensors` inside it.
    pub fn adapter_file(&self) -> Option<PathBuf> {
        self.adapter.as_ref().map(|path| {
            if path.extension().is_some_and(|e| e == "safetensors") {
                path.clone()
            } else {
                path.join(ADAPTER_FILE)
            }
        })
    }
}

fn default_prefix() -> String {
    DEFAULT_ROOT.to_owned()
}

/// `[store]`: where the cluster state lives, chosen by `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum StoreConfig {
    /// `kind = "embedded"`: in this process's memory, for a cluster of one process.
    Embedded {
        /// Root of every key (default `/scd/v1`).
        #[serde(default = "default_prefix")]
        prefix: String,
    },
    /// `kind = "etcd"`: an etcd cluster shared by every node.
    Etcd {
        /// etcd client endpoints, `host:port` or `http(s)://host:port`; at least one.
        #[serde(default)]
        endpoints: Vec<String>,
        /// Root of every key (default `/scd/v1`); clusters sharing one etcd use different
        /// roots.
        #[serde(default = "default_prefix")]
        prefix: String,
        /// `ca`: the CA certificate (PEM) etcd's serving certificate chains to; with it etcd
        /// is reached over TLS (endpoints `https://` or without a scheme).
        #[serde(default)]
        ca: Option<PathBuf>,
        /// `cert`: this node's client certificate for an etcd started with
        /// `--client-cert-auth` (issued from etcd's CA, e.g. by `scd cert issue`).
        #[serde(default)]
        cert: Option<PathBuf>,
        /// `key`: `cert`'s private key.
        #[serde(default)]
        key: Option<PathBuf>,
    },
}

impl StoreConfig {
    /// What the etcd client presents and trusts, read from `ca`, `cert` and `key`; `None`
    /// for an embedded store or a plain-HTTP etcd.
    pub fn etcd_tls(&self) -> Result<Option<scd_scheduler::EtcdTls>, ConfigError> {
        let StoreConfig::Etcd { ca, cert, key, .. } = self else {
            return Ok(None);
        };
        let read = |key: &str, path: &Path| {
            std::fs::read(path).map_err(|source| ConfigError::Unreadable {
                key: key.to_owned(),
                path: path.to_owned(),
                source,
            })
        };
        let Some(ca) = ca else {
            return Ok(None);
        };
        let client = match (cert, key) {
            (Some(cert), Some(key)) => Some((read("store.cert", cert)?, read("store.key", key)?)),
            _ => None,
        };
        Ok(Some(scd_scheduler::EtcdTls {
            ca_pem: read("store.ca", ca)?,
            client,
        }))
    }

    /// The root of every key, as `scd_scheduler::Keys::new` takes it.
    pub fn prefix(&self) -> &str {
        match self {
            StoreConfig::Embedded { prefix } | StoreConfig::Etcd { prefix, .. } => prefix,
        }
    }
}

/// `[tls]`: the files `scd cert init` and `scd cert issue` write.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The cluster CA's certificate (`ca.pem`): the only root trusted for peers.
    pub ca: PathBuf,
    /// This node's certificate (`<id>.pem`), issued by that CA to `node.id` as a node.
    pub cert: PathBuf,
    /// This node's private key (`<id>.key`).
    pub key: PathBuf,
    /// The name `cert` is issued to, where it is not `node.id`: the replicas of a gateway
    /// Deployment share one certificate while each registers under its own pod name. Only on
    /// a node that nothing dials (no role but gateway and scheduler): producers, consumers and
    /// admin endpoints are reached, and checked, by their id. Default: `node.id`.
    #[serde(default)]
    pub name: Option<String>,
}

/// `[tracing]`: where spans go.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// OTLP endpoint to export spans to, e.g. `http://127.0.0.1:4317` (Jaeger's OTLP gRPC
    /// port) or `http://127.0.0.1:4318` (its OTLP/HTTP port); none: spans are not exported.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http/protobuf`; default: `$OTEL_EXPORTER_OTLP_PROTOCOL`, else gRPC for an
    /// endpoint on port 4317 and HTTP for any other.
    #[serde(default)]
    pub otlp_protocol: Option<String>,
    /// The service name spans carry; default: the node id (see [`NodeConfig::service_name`]).
    #[serde(default)]
    pub service_name: Option<String>,
}

/// `[limits]`: bounds on the work a node holds, so that overload is refused, not queued without
/// end.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Job streams waiting for a decoder on this node (consumer role); past it a new one is
    /// refused as busy. Default 64.
    pub queued_jobs: NonZeroUsize,
    /// Jobs worked on at once. Default 2: the models run on the CPU, so more would share the
    /// same cores without finishing sooner.
    pub concurrent_jobs: NonZeroUsize,
    /// Frames of one job queued ahead of its QUIC stream; memory per job is this times the
    /// frame cap. Default: the transport's own default.
    pub frames_in_flight: NonZeroUsize,
    /// Memory for the producer's prefix cache, in MiB (0 turns it off). A cached token holds
    /// every layer's K, V, `H_in` and residual rows, about 180 KiB for SmolLM2-135M, so the
    /// default 256 MiB holds some 1,400 prompt tokens. Default 256.
    pub prefix_cache_mib: usize,
    /// Unfinished jobs the whole cluster may hold; a submission past it is answered busy with
    /// a retry hint. Read by the scheduler role (the leader's value is the one in force).
    /// Default 256.
    pub unfinished_jobs: NonZeroUsize,
    /// Seconds a finished job's record stays among the live ones (where clients following it
    /// and the nodes see it end) before the scheduler moves it to the archive, which no job
    /// listing of the scheduler or the nodes reads. Read by the scheduler role. Default 60.
    pub archive_finished_after_s: u64,
    /// Hours a finished job's record is kept at all, live or archived. Read by the scheduler
    /// role. Default 24.
    pub finished_jobs_max_age_h: NonZeroU64,
    /// Archived job records kept at most; the oldest go first. Read by the scheduler role.
    /// Default 10000.
    pub archived_jobs_max: usize,
    /// The deadline of a job's attempt, before its tokens, in seconds: past
    /// `attempt_base_s + attempt_ms_per_token × max_tokens` from its assignment the scheduler
    /// abandons the attempt (back to the queue, or failed once out of attempts). Read by the
    /// scheduler role. Default 300.
    pub attempt_base_s: u64,
    /// Milliseconds an attempt's deadline grows per token the job may generate. Default 1000.
    pub attempt_ms_per_token: u64,
    /// Seconds a queued job may wait while no live node hosts its expert before it fails saying
    /// so (its consumers died, left or lost the store, and none came back). Read by the
    /// scheduler role. Default 30.
    pub orphan_grace_s: u64,
    /// Largest translator file (weights or manifest) the node loads, in MiB: a version the
    /// store names is read whole into memory. Default 1024.
    pub translator_mib: u64,
    /// Memory the caches of the jobs this node decodes may hold at once, in MiB (consumer
    /// role): see [`crate::kv_budget`]. Default 2048.
    pub kv_mib: u64,
}

impl Default for Limits {
    fn default() -> Self {
        let nonzero = |n| NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN);
        Self {
            queued_jobs: nonzero(64),
            concurrent_jobs: nonzero(2),
            frames_in_flight: nonzero(TransportOptions::default().send_queue_frames),
            prefix_cache_mib: 256,
            unfinished_jobs: nonzero(256),
            archive_finished_after_s: 60,
            finished_jobs_max_age_h: NonZeroU64::new(24).unwrap_or(NonZeroU64::MIN),
            archived_jobs_max: 10_000,
            attempt_base_s: 300,
            attempt_ms_per_token: 1000,
            orphan_grace_s: 30,
            translator_mib: 1024,
            kv_mib: 2048,
        }
    }
}

/// Why a node config cannot be used; each message names the key and says what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("cannot read node config {path}: {source}")]
    Read {
        /// The config file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Not TOML, an unknown or missing key, or a value of the wrong type; toml's message names
    /// the key and its line.
    #[error("invalid node config: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value that parses but cannot be used.
    #[error("{key}: {reason}")]
    Invalid {
        /// The key, as written in the file.
        key: String,
        /// What is wrong and what would do.
        reason: String,
    },
    /// A setting that this node's roles need is missing.
    #[error("{key} is required {because}")]
    Required {
        /// The key, as written in the file.
        key: String,
        /// Which role needs it, and what for.
        because: String,
    },
    /// A setting that none of this node's roles uses.
    #[error("{key} is set but {because}: remove it, or add the role that uses it to node.roles")]
    Unused {
        /// The key, as written in the file.
        key: String,
        /// Why no role uses it.
        because: String,
    },
    /// A file the config names is not there.
    #[error("{key}: {} does not exist; {hint}", path.display())]
    MissingFile {
        /// The key that names the file.
        key: String,
        /// The path, resolved against the config file's folder.
        path: PathBuf,
        /// How to make the file.
        hint: String,
    },
    /// A file the config names is there but cannot be read.
    #[error("{key}: cannot read {}: {source}", path.display())]
    Unreadable {
        /// The key that names the file.
        key: String,
        /// The path, resolved against the config file's folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The CA certificate, node certificate or key is not what it should be.
    #[error("cannot load this node's TLS identity from tls.ca {}, tls.cert {}, tls.key {} ({source}): create them with `scd cert init` and `scd cert issue`", ca.display(), cert.display(), key.display())]
    BadCertificate {
        /// `tls.ca`.
        ca: PathBuf,
        /// `tls.cert`.
        cert: PathBuf,
        /// `tls.key`.
        key: PathBuf,
        /// What is wrong (boxed: the PKI errors are large, the others small).
        source: Box<PkiError>,
    },
    /// The node certificate is not signed by the configured CA.
    #[error("tls.cert {} is not signed by tls.ca {} ({source}): issue this node's certificate from that CA with `scd cert issue --dir <folder of tls.ca> --name {id} --role node`, or set tls.ca to the CA that signed it", cert.display(), ca.display())]
    ForeignCertificate {
        /// `tls.cert`.
        cert: PathBuf,
        /// `tls.ca`.
        ca: PathBuf,
        /// `node.id`.
        id: String,
        /// The verifier's verdict.
        source: Box<PkiError>,
    },
    /// The node certificate is another node's, or an admin's.
    #[error("tls.cert {}: {problem}, but the node's name is {id:?} (tls.name, else node.id): issue one with `scd cert issue --dir <folder of tls.ca> --name {id} --role node`", cert.display())]
    WrongIdentity {
        /// `tls.cert`.
        cert: PathBuf,
        /// The name it should be issued to: `tls.name`, else `node.id`.
        id: String,
        /// Whom the certificate names instead.
        problem: String,
    },
}

/// Shortest `node.metrics_token` taken.
const MIN_TOKEN_LEN: usize = 16;

fn invalid(key: impl Into<String>, reason: impl fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.to_string(),
    }
}

fn required(key: impl Into<String>, because: &str) -> ConfigError {
    ConfigError::Required {
        key: key.into(),
        because: because.to_owned(),
    }
}

fn unused(key: &str, because: &str) -> ConfigError {
    ConfigError::Unused {
        key: key.to_owned(),
        because: because.to_owned(),
    }
}

impl NodeConfig {
    /// Read, check and resolve the config at `path`, and check every file it names: what
    /// `scd node --config` does before anything starts.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let read_err = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let text = fs::read_to_string(path).map_err(read_err)?;
        // Absolute, so that errors name the files wherever the reader stands.
        let dir = std::path::absolute(path)
            .map_err(read_err)?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let mut config = Self::parse(&text, &dir)?;
        config.validate_files()?;
        if let Some(file) = &config.gateway.api_keys_file {
            let keys = read_api_keys(file)?;
            config.gateway.api_keys.extend(keys);
        }
        Ok(config)
    }

    /// Parse and check a config's text, resolving relative paths against `base_dir` (the config
    /// file's folder). Touches no file: see [`NodeConfig::validate_files`].
    pub fn parse(text: &str, base_dir: &Path) -> Result<Self, ConfigError> {
        let mut config: NodeConfig = toml::from_str(text)?;
        config.check()?;
        config.resolve(base_dir);
        Ok(config)
    }

    /// Whether this node has `role`.
    pub fn has_role(&self, role: NodeRole) -> bool {
        self.node.roles.contains(&role)
    }

    /// The service name its spans carry: `tracing.service_name`, else the node id.
    pub fn service_name(&self) -> &str {
        self.tracing
            .service_name
            .as_deref()
            .unwrap_or(&self.node.id)
    }

    /// Check every file the config names: that it exists, and that the node certificate and
    /// key load, are signed by `tls.ca` and are issued to `node.id` as a node.
    pub fn validate_files(&self) -> Result<(), ConfigError> {
        for (key, path, hint) in self.files() {
            match fs::metadata(&path) {
                Ok(meta) if meta.is_file() => {}
                Ok(_) => {
                    return Err(invalid(
                        key,
                        format!("{} is a folder; name a file", path.display()),
                    ))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(ConfigError::MissingFile { key, path, hint })
                }
                Err(source) => return Err(ConfigError::Unreadable { key, path, source }),
            }
        }
        self.identity().map(drop)
    }

    /// Load this node's TLS identity and check it: signed by `tls.ca`, issued to `node.id` as a
    /// node.
    pub fn identity(&self) -> Result<Identity, ConfigError> {
        let tls = &self.tls;
        let read = |key: &str, path: &Path| {
            fs::read(path).map_err(|source| ConfigError::Unreadable {
                key: key.to_owned(),
                path: path.to_owned(),
                source,
            })
        };
        let identity = Identity::from_pem(
            &read("tls.ca", &tls.ca)?,
            &read("tls.cert", &tls.cert)?,
            &read("tls.key", &tls.key)?,
            Path::new("tls"),
        )
        .map_err(|source| ConfigError::BadCertificate {
            ca: tls.ca.clone(),
            cert: tls.cert.clone(),
            key: tls.key.clone(),
            source: Box::new(source),
        })?;
        scd_transport::verify_signed_by_ca(&identity).map_err(|source| {
            ConfigError::ForeignCertificate {
                cert: tls.cert.clone(),
                ca: tls.ca.clone(),
                id: self.node.id.to_string(),
                source: Box::new(source),
            }
        })?;
        let name = tls.name.as_deref().unwrap_or(&self.node.id);
        let wrong = |problem: String| ConfigError::WrongIdentity {
            cert: tls.cert.clone(),
            id: name.to_owned(),
            problem,
        };
        let peer = identity
            .cert_chain
            .first()
            .ok_or_else(|| "no certificate".to_owned())
            .and_then(|leaf| pki::peer_identity(leaf))
            .map_err(wrong)?;
        if peer.name != name || peer.role != Role::Node {
            return Err(wrong(format!("issued to {:?} as {}", peer.name, peer.role)));
        }
        Ok(identity)
    }

    /// What can be checked without touching a file.
    fn check(&self) -> Result<(), ConfigError> {
        pki::validate_name(&self.node.id).map_err(|e| invalid("node.id", e))?;
        if self.node.roles.is_empty() {
            return Err(invalid(
                "node.roles",
                "list at least one of producer, consumer, scheduler, admin, gateway",
            ));
        }
        if let Some(a) = &self.node.advertise {
            let ok = a
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(invalid(
                    "node.advertise",
                    format!("{a:?} is not host:port, e.g. \"producer:7101\""),
                ));
            }
        }
        if let Some(name) = &self.tls.name {
            pki::validate_name(name).map_err(|e| invalid("tls.name", e))?;
            let dialed = self
                .node
                .roles
                .iter()
                .any(|r| !matches!(r, NodeRole::Gateway | NodeRole::Scheduler));
            if dialed && name != self.node.id.as_str() {
                return Err(invalid(
                    "tls.name",
                    format!(
                        "{name:?} is not node.id {:?}: only a node with no role but gateway and \
                         scheduler may use a certificate issued to another name (nothing dials \
                         it); producers, consumers and admin endpoints are checked by their id",
                        self.node.id
                    ),
                ));
            }
        }
        match (self.has_role(NodeRole::Gateway), self.node.http_listen) {
            (true, None) => {
                return Err(required(
                    "node.http_listen",
                    "by the gateway role: the TCP address of the HTTP API, e.g. \"127.0.0.1:8080\"",
                ))
            }
            (false, Some(_)) => {
                return Err(unused(
                    "node.http_listen",
                    "only the gateway role serves HTTP",
                ))
            }
            _ => {}
        }
        match (&self.node.metrics_token, self.node.metrics_listen) {
            (Some(_), None) => {
                return Err(invalid(
                    "node.metrics_token",
                    "it guards /metrics, and node.metrics_listen is not set: set both or neither",
                ))
            }
            (Some(t), Some(_)) if t.len() < MIN_TOKEN_LEN => {
                return Err(invalid(
                    "node.metrics_token",
                    format_args!(
                        "{} characters, easily guessed; use at least {MIN_TOKEN_LEN} (e.g. `openssl rand -hex 16`)",
                        t.len()
                    ),
                ))
            }
            _ => {}
        }
        self.check_models()?;
        self.check_store()?;
        self.check_codec()?;
        self.check_tracing()
    }

    fn check_codec(&self) -> Result<(), ConfigError> {
        let c = &self.codec;
        if !(c.kl_ceiling > 0.0 && c.kl_ceiling.is_finite()) {
            return Err(invalid(
                "codec.kl_ceiling",
                format!("{} must be a positive number, e.g. 0.1", c.kl_ceiling),
            ));
        }
        if let (CodeDtypeName::Tc, RankSetting::Fixed(_)) = (c.code_dtype, c.ranks) {
            return Err(invalid(
                "codec.ranks",
                "transform-coded codes (code_dtype = \"tc\") send every component their rate \
                 pays for: their size is a rate, \"adaptive\" or \"default\", not fixed ranks"
                    .to_string(),
            ));
        }
        if !(0.0..=10.0).contains(&c.rank_slack) {
            return Err(invalid(
                "codec.rank_slack",
                format!("{} must be between 0 and 10, e.g. 0.05", c.rank_slack),
            ));
        }
        if let Some(d) = &self.drift {
            if !self.has_role(NodeRole::Consumer) {
                return Err(unused("drift", "only consumers check their jobs"));
            }
            if !(0.0..=1.0).contains(&d.shadow_share) {
                return Err(invalid(
                    "drift.shadow_share",
                    format!("{} must be between 0 and 1, e.g. 0.02", d.shadow_share),
                ));
            }
            if !(d.kl_bound > 0.0 && d.kl_bound.is_finite()) {
                return Err(invalid(
                    "drift.kl_bound",
                    format!("{} must be a positive number, e.g. 0.5", d.kl_bound),
                ));
            }
            if d.window == 0 || d.min_jobs == 0 || d.min_jobs > d.window {
                return Err(invalid(
                    "drift.min_jobs",
                    format!(
                        "{} must be at least 1 and at most drift.window ({})",
                        d.min_jobs, d.window
                    ),
                ));
            }
        }
        if self.documents.is_some() && !self.has_role(NodeRole::Producer) {
            return Err(unused(
                "documents",
                "only producers compile and serve documents",
            ));
        }
        for (peer, &mbit) in &self.links.pace_mbit {
            pki::validate_name(peer).map_err(|e| invalid(format!("links.pace_mbit.{peer}"), e))?;
            if mbit == 0 {
                return Err(invalid(
                    format!("links.pace_mbit.{peer}"),
                    "must be at least 1 (Mbit/s)",
                ));
            }
        }
        Ok(())
    }

    /// The drift guard's settings: `[drift]`, or its defaults.
    pub fn drift(&self) -> DriftConfig {
        self.drift.unwrap_or_default()
    }

    /// The producer's rule for adaptive ranks, from `[codec]`.
    pub fn rank_policy(&self) -> scd_models::translator::RankPolicy {
        scd_models::translator::RankPolicy {
            kl_ceiling: self.codec.kl_ceiling,
            slack: self.codec.rank_slack,
        }
    }

    /// The transport's link emulation from `[links]`.
    pub fn pacing_to(
        &self,
    ) -> std::collections::BTreeMap<String, scd_transport::pacing::PacingOptions> {
        self.links
            .pace_mbit
            .iter()
            .map(|(peer, &mbit)| {
                let rate =
                    scd_transport::pacing::PacingOptions::rate(mbit.saturating_mul(1_000_000));
                (peer.clone(), rate)
            })
            .collect()
    }

    fn check_models(&self) -> Result<(), ConfigError> {
        let consumer = self.has_role(NodeRole::Consumer);
        let runs_models = consumer || self.has_role(NodeRole::Producer);
        if self.models.base.is_none() {
            return Err(required(
                "models.base",
                "by every node: producers prefill with the base model and consumers run each \
                 expert on it; a node without those roles (gateway, admin, scheduler) reads only \
                 its tokenizer and hyperparameters, none of its weights",
            ));
        }
        if !runs_models && !self.experts.is_empty() {
            return Err(unused(
                "experts",
                "only producers and consumers serve experts (a gateway, admin or scheduler \
                 node reads only the base model's tokenizer)",
            ));
        }
        if consumer && self.experts.is_empty() {
            return Err(required(
                "experts",
                "by the consumer role: add an [[experts]] table (name, adapter, translator) for \
                 each expert this node serves",
            ));
        }
        let mut names = HashSet::new();
        for (i, expert) in self.experts.iter().enumerate() {
            check_id("expert", &expert.name)
                .map_err(|e| invalid(format!("experts[{i}].name"), e))?;
            if !names.insert(expert.name.as_str()) {
                return Err(invalid(
                    format!("experts[{i}].name"),
                    format!("{:?} is listed twice", expert.name),
                ));
            }
            if consumer && expert.adapter.is_none() {
                return Err(required(
                    format!("experts[{}].adapter", expert.name),
                    "by the consumer role: the expert is the base model plus this LoRA adapter",
                ));
            }
        }
        Ok(())
    }

    fn check_store(&self) -> Result<(), ConfigError> {
        let prefix = self.store.prefix();
        if !prefix.starts_with('/') || prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(invalid(
                "store.prefix",
                format!(
                    "{prefix:?} must start with '/' and hold no spaces, e.g. \"{DEFAULT_ROOT}\""
                ),
            ));
        }
        if let StoreConfig::Etcd { endpoints, .. } = &self.store {
            if endpoints.is_empty() {
                return Err(required(
                    "store.endpoints",
                    "with kind = \"etcd\": list etcd's client addresses, e.g. \
                     endpoints = [\"127.0.0.1:2379\"]",
                ));
            }
            if let Some(bad) = endpoints.iter().find(|e| !is_endpoint(e)) {
                return Err(invalid(
                    "store.endpoints",
                    format!("{bad:?} is not host:port or http(s)://host:port"),
                ));
            }
        }
        if let StoreConfig::Etcd {
            endpoints,
            ca,
            cert,
            key,
            ..
        } = &self.store
        {
            if cert.is_some() != key.is_some() {
                return Err(invalid(
                    "store.cert",
                    "store.cert and store.key go together: give both, or neither".to_owned(),
                ));
            }
            match ca {
                Some(_) => {
                    if let Some(plain) = endpoints.iter().find(|e| e.starts_with("http://")) {
                        return Err(invalid(
                            "store.endpoints",
                            format!(
                                "{plain:?} is plain HTTP but store.ca asks for TLS: write \
                                 https:// (or no scheme)"
                            ),
                        ));
                    }
                }
                None if cert.is_some() => {
                    return Err(required(
                        "store.ca",
                        "with store.cert: the CA that signed etcd's certificate, so that \
                         the node knows it talks to etcd",
                    ));
                }
                None => {
                    if let Some(tls) = endpoints.iter().find(|e| e.starts_with("https://")) {
                        return Err(required(
                            "store.ca",
                            &format!(
                                "for {tls:?}: the CA that signed etcd's certificate (no \
                                 system roots are trusted)"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_tracing(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.tracing.otlp_endpoint {
            let host = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            if host.is_none_or(|h| h.is_empty() || h.contains(char::is_whitespace)) {
                return Err(invalid(
                    "tracing.otlp_endpoint",
                    format!("{url:?} is not an http(s) URL, e.g. \"http://127.0.0.1:4317\""),
                ));
            }
        }
        if let Some(p) = &self.tracing.otlp_protocol {
            if p != "grpc" && p != "http/protobuf" {
                return Err(invalid(
                    "tracing.otlp_protocol",
                    format!("{p:?}: use \"grpc\" or \"http/protobuf\""),
                ));
            }
        }
        if self
            .tracing
            .service_name
            .as_deref()
            .is_some_and(str::is_empty)
        {
            return Err(invalid(
                "tracing.service_name",
                "empty; leave it out to use the node id",
            ));
        }
        Ok(())
    }

    fn resolve(&mut self, base_dir: &Path) {
        // `join` keeps absolute paths as they are.
        let at = |p: &mut PathBuf| *p = base_dir.join(&*p);
        if let Some(base) = &mut self.models.base {
            at(base);
        }
        for root in &mut self.models.translator_roots {
            at(root);
        }
        for expert in &mut self.experts {
            if let Some(adapter) = &mut expert.adapter {
                at(adapter);
            }
            at(&mut expert.translator);
        }
        at(&mut self.tls.ca);
        at(&mut self.tls.cert);
        at(&mut self.tls.key);
        if let StoreConfig::Etcd { ca, cert, key, .. } = &mut self.store {
            for path in [ca, cert, key].into_iter().flatten() {
                at(path);
            }
        }
        if let Some(file) = &mut self.gateway.api_keys_file {
            at(file);
        }
        if let Some(d) = &mut self.documents {
            at(&mut d.dir);
            if let Some(w) = &mut d.writer {
                at(w);
            }
            if let Some(b) = &mut d.boundary {
                at(b);
            }
        }
    }

    /// Every file the node will read: (key, path, how to make it).
    fn files(&self) -> Vec<(String, PathBuf, String)> {
        let mut files = Vec::new();
        if let Some(base) = &self.models.base {
            files.push((
                "models.base".to_owned(),
                base.clone(),
                "fetch the base model with ops/fetch-model.sh".to_owned(),
            ));
        }
        for expert in &self.experts {
            let name = &expert.name;
            if let Some(adapter) = expert.adapter_file() {
                files.push((
                    format!("experts[{name}].adapter"),
                    adapter,
                    "train the expert with `scd finetune --out <folder>` (experts/README.md)"
                        .to_owned(),
                ));
            }
            for file in [MANIFEST_FILE, WEIGHTS_FILE] {
                files.push((
                    format!("experts[{name}].translator"),
                    expert.translator.join(file),
                    format!("fit the translator between the base and {name} with `scd calibrate`"),
                ));
            }
        }
        if let Some(d) = &self.documents {
            if let Some(writer) = d.writer_file() {
                files.push((
                    "documents.writer".to_owned(),
                    writer,
                    "train a SemPIC writer with `scd sempic train` (experts/README.md), or \
                     leave documents.writer out to compile with the base model"
                        .to_owned(),
                ));
            }
            if let Some(b) = &d.boundary {
                for file in [
                    scd_models::boundary::BOUNDARY_META_FILE,
                    scd_models::boundary::BOUNDARY_FILE,
                ] {
                    files.push((
                        "documents.boundary".to_owned(),
                        b.join(file),
                        "train boundary tokens with `scd sempic boundary`".to_owned(),
                    ));
                }
            }
        }
        let id = &self.node.id;
        let pki = format!(
            "create the cluster CA with `scd cert init --dir <folder>` and this node's \
             certificate with `scd cert issue --dir <folder> --name {id} --role node`"
        );
        for (key, path) in [
            ("tls.ca", &self.tls.ca),
            ("tls.cert", &self.tls.cert),
            ("tls.key", &self.tls.key),
        ] {
            files.push((key.to_owned(), path.clone(), pki.clone()));
        }
        if let StoreConfig::Etcd { ca, cert, key, .. } = &self.store {
            let pki = format!(
                "etcd's own CA comes from `scd cert init --dir <etcd folder>`, this node's \
                 client certificate from `scd cert issue --dir <etcd folder> --name {id} \
                 --role node` (docs/deploy.md, \"etcd over TLS\")"
            );
            for (key, path) in [("store.ca", ca), ("store.cert", cert), ("store.key", key)] {
                if let Some(path) = path {
                    files.push((key.to_owned(), path.clone(), pki.clone()));
                }
            }
        }
        files
    }
}

/// The keys of `gateway.api_keys_file`: one per line, blank lines and `#` comments skipped;
/// each must fit an HTTP header as a bearer token (visible ASCII, no spaces), and the file
/// must hold at least one, since a file named but empty would open the API to anyone.
fn read_api_keys(file: &Path) -> Result<Vec<String>, ConfigError> {
    const KEY: &str = "gateway.api_keys_file";
    let text = fs::read_to_string(file).map_err(|source| ConfigError::Unreadable {
        key: KEY.to_owned(),
        path: file.to_owned(),
        source,
    })?;
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                KEY,
                format!(
                    "{} line {}: a key is visible ASCII without spaces (it travels as \
                     `Authorization: Bearer <key>`)",
                    file.display(),
                    n + 1
                ),
            ));
        }
        keys.push(line.to_owned());
    }
    if keys.is_empty() {
        return Err(invalid(
            KEY,
            format!(
                "{} holds no key: write one per line (e.g. `openssl rand -hex 24`), or leave \
                 api_keys_file out",
                file.display()
            ),
        ));
    }
    Ok(keys)
}

/// `host:port`, optionally behind `http://` or `https://`, as etcd's client takes them.
fn is_endpoint(endpoint: &str) -> bool {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .unwrap_or(endpoint);
    rest.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && !host.contains(|c: char| c.is_whitespace() || c == '/')
            && port.parse::<u16>().is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use scd_transport::pki::{init_ca_dir, issue_in_dir};

    /// A consumer and producer on etcd, every path relative, with placeholders for the model
    /// files and real certificates under `pki/`.
    const VALID: &str = r#"
[node]
id = "node-a"
listen = "127.0.0.1:7000"
roles = ["producer", "consumer"]

[models]
base = "models/base.gguf"

[[experts]]
name = "mail"
adapter = "experts/mail"
translator = "experts/mail/translator"

[store]
kind = "etcd"
endpoints = ["127.0.0.1:2379", "http://10.0.0.2:2379"]

[tls]
ca = "pki/ca.pem"
cert = "pki/node-a.pem"
key = "pki/node-a.key"
"#;

    fn touch(path: &Path) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
    }

    /// A folder holding what `VALID` names, and the config written there as `node.toml`.
    fn fixture() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        touch(&d.join("models/base.gguf"));
        touch(&d.join("experts/mail/adapter.safetensors"));
        touch(&d.join("experts/mail/translator/translator.json"));
        touch(&d.join("experts/mail/translator/translator.safetensors"));
        init_ca_dir(&d.join("pki"), "test").unwrap();
        issue_in_dir(&d.join("pki"), "node-a", Role::Node).unwrap();
        let file = d.join("node.toml");
        fs::write(&file, VALID).unwrap();
        (dir, file)
    }

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse(text, Path::new("/cfg"))
    }

    #[test]
    fn api_keys_come_from_the_config_and_its_key_file() {
        let (dir, file) = fixture();
        let d = dir.path();
        let with_file = |keys_file: &str| {
            let text = format!(
                "{VALID}\n[gateway]\napi_keys = [\"inline-key\"]\napi_keys_file = \"{keys_file}\"\n"
            );
            fs::write(&file, text).unwrap();
            NodeConfig::load(&file)
        };
        fs::write(d.join("keys"), "# the ops team\n\n  key-one  \nkey-two\n").unwrap();
        let config = with_file("keys").unwrap();
        assert_eq!(config.gateway.api_keys_file, Some(d.join("keys")));
        assert_eq!(
            config.gateway.api_keys,
            ["inline-key", "key-one", "key-two"].map(String::from)
        );
        let err = with_file("missing").unwrap_err().to_string();
        assert!(err.starts_with("gateway.api_keys_file"), "{err}");
        fs::write(d.join("empty"), "# nothing yet\n").unwrap();
        let err = with_file("empty").unwrap_err().to_string();
        assert!(err.contains("holds no key"), "{err}");
        fs::write(d.join("spaced"), "two words\n").unwrap();
        let err = with_file("spaced").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn a_valid_config_loads_with_its_values_and_defaults() {
        let (dir, file) = fixture();
        let config = NodeConfig::load(&file).unwrap();
        let d = dir.path();
        assert_eq!(config.node.id, "node-a");
        assert_eq!(
            config.node.listen,
            "127.0.0.1:7000".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            config.node.roles,
            BTreeSet::from([NodeRole::Producer, NodeRole::Consumer])
        );
        assert!(config.has_role(NodeRole::Consumer) && !config.has_role(NodeRole::Gateway));
        assert_eq!(config.node.http_listen, None);
        // Paths follow the config file's folder, not the working directory.
        assert_eq!(config.models.base, Some(d.join("models/base.gguf")));
        let expert = &config.experts[0];
        assert_eq!(expert.translator, d.join("experts/mail/translator"));
        assert_eq!(
            expert.adapter_file(),
            Some(d.join("experts/mail/adapter.safetensors"))
        );
        assert_eq!(config.tls.cert, d.join("pki/node-a.pem"));
        assert_eq!(
            config.store,
            StoreConfig::Etcd {
                endpoints: vec!["127.0.0.1:2379".into(), "http://10.0.0.2:2379".into()],
                prefix: "/scd/v1".into(),
                ca: None,
                cert: None,
                key: None,
            }
        );
        assert_eq!(config.tracing, TracingConfig::default());
        assert_eq!(config.service_name(), "node-a");
        let limits = &config.limits;
        assert_eq!(
            (
                limits.queued_jobs.get(),
                limits.concurrent_jobs.get(),
                limits.frames_in_flight.get()
            ),
            (64, 2, TransportOptions::default().send_queue_frames)
        );
        let identity = config.identity().unwrap();
        assert_eq!(
            pki::peer_identity(&identity.cert_chain[0]).unwrap().name,
            "node-a"
        );
    }

    #[test]
    fn set_values_replace_the_defaults() {
        let text = VALID.replace(
            "[store]\nkind = \"etcd\"\nendpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]",
            "[store]\nkind = \"embedded\"\nprefix = \"/lab/v2\"",
        ) + r#"
[tracing]
otlp_endpoint = "http://127.0.0.1:4317"
service_name = "scd-lab"

[limits]
queued_jobs = 8
frames_in_flight = 16
"#;
        let config = parse(&text.replace("models/base.gguf", "/abs/base.gguf")).unwrap();
        assert_eq!(
            config.store,
            StoreConfig::Embedded {
                prefix: "/lab/v2".into()
            }
        );
        assert_eq!(config.store.prefix(), "/lab/v2");
        assert_eq!(config.service_name(), "scd-lab");
        assert_eq!(
            config.tracing.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4317")
        );
        assert_eq!(config.limits.queued_jobs.get(), 8);
        assert_eq!(config.limits.concurrent_jobs.get(), 2);
        assert_eq!(config.limits.frames_in_flight.get(), 16);
        assert_eq!(config.models.base, Some(PathBuf::from("/abs/base.gguf")));
    }

    #[test]
    fn ranks_are_adaptive_unless_set_and_links_can_be_paced_per_peer() {
        let config = parse(VALID).unwrap();
        assert_eq!(config.codec.ranks, RankSetting::Adaptive);
        assert_eq!(
            config.rank_policy(),
            scd_models::translator::RankPolicy::default()
        );
        assert!(config.pacing_to().is_empty());
        let text = VALID.to_owned()
            + "\n[codec]\nranks = \"k=32,v=64,h=16\"\nkl_ceiling = 0.2\nrank_slack = 0\n\
               \n[links]\npace_mbit = { consumer-a = 50, consumer-b = 5000 }\n";
        let config = parse(&text).unwrap();
        assert_eq!(
            config.codec.ranks,
            RankSetting::Fixed(scd_scheduler::Ranks {
                k: 32,
                v: 64,
                h: 16
            })
        );
        assert_eq!(config.rank_policy().kl_ceiling, 0.2);
        assert_eq!(config.rank_policy().slack, 0.0);
        let paced = config.pacing_to();
        assert_eq!(paced["consumer-a"].rate_bps, 50_000_000);
        assert_eq!(paced["consumer-b"].rate_bps, 5_000_000_000);
        let config = parse(&(VALID.to_owned() + "\n[codec]\nranks = \"default\"\n")).unwrap();
        assert_eq!(config.codec.ranks, RankSetting::Default);
        let config = parse(&(VALID.to_owned() + "\n[codec]\ncode_dtype = \"tc\"\n")).unwrap();
        assert_eq!(
            config.codec.code_dtype.dtype(),
            scd_transport::CodeDType::TC
        );
        for (extra, key) in [
            ("[codec]\nkl_ceiling = 0\n", "codec.kl_ceiling"),
            (
                "[codec]\ncode_dtype = \"tc\"\nranks = \"k=32,v=64,h=16\"\n",
                "codec.ranks",
            ),
            ("[codec]\nrank_slack = -1\n", "codec.rank_slack"),
            (
                "[links]\npace_mbit = { consumer-a = 0 }\n",
                "links.pace_mbit.consumer-a",
            ),
            (
                "[links]\npace_mbit = { Consumer_A = 10 }\n",
                "links.pace_mbit.Consumer_A",
            ),
        ] {
            match parse(&(VALID.to_owned() + "\n" + extra)) {
                Err(ConfigError::Invalid { key: k, .. }) if k == key => {}
                other => panic!("{key}: {:?}", other.map(drop)),
            }
        }
        let err = parse(&(VALID.to_owned() + "\n[codec]\nranks = \"k=1\"\n")).unwrap_err();
        assert!(err.to_string().contains("adaptive"), "{err}");
    }

    #[test]
    fn documents_are_a_producers_with_paths_resolved_and_files_checked() {
        let set = VALID.to_owned()
            + "\n[documents]\ndir = \"docs\"\nwriter = \"writer\"\nboundary = \"b\"\nwire = \"f32\"\n";
        let c = NodeConfig::parse(&set, Path::new("/srv")).unwrap();
        let d = c.documents.clone().unwrap();
        assert_eq!(d.dir, Path::new("/srv/docs"));
        assert_eq!(
            d.writer_file().unwrap(),
            Path::new("/srv/writer/adapter.safetensors")
        );
        assert_eq!(d.wire.dtype(), scd_transport::CodeDType::F32);
        let files: Vec<String> = c.files().into_iter().map(|(k, _, _)| k).collect();
        assert!(files.contains(&"documents.writer".to_owned()), "{files:?}");
        assert_eq!(
            files.iter().filter(|k| *k == "documents.boundary").count(),
            2
        );
        // The defaults: compiled by the base, bf16 on the wire.
        let plain = VALID.to_owned() + "\n[documents]\ndir = \"docs\"\n";
        let d = parse(&plain).unwrap().documents.unwrap();
        assert_eq!((d.writer, d.wire), (None, DocumentWire::Bf16));
        let consumer_only = VALID.replace("[\"producer\", \"consumer\"]", "[\"consumer\"]");
        match parse(&(consumer_only + "\n[documents]\ndir = \"d\"\n")) {
            Err(ConfigError::Unused { key, .. }) if key == "documents" => {}
            other => panic!("{other:?}"),
        }
        assert!(
            parse(&(VALID.to_owned() + "\n[documents]\ndir = \"d\"\nwire = \"q4\"\n")).is_err()
        );
    }

    #[test]
    fn the_drift_guard_is_a_consumers_and_its_values_are_checked() {
        assert_eq!(parse(VALID).unwrap().drift(), DriftConfig::default());
        let set = VALID.to_owned()
            + "\n[drift]\nshadow_share = 1\nkl_bound = 0.2\nwindow = 5\nmin_jobs = 5\n";
        let d = parse(&set).unwrap().drift();
        assert_eq!(
            (d.shadow_share, d.kl_bound, d.window, d.min_jobs),
            (1.0, 0.2, 5, 5)
        );
        for (extra, key) in [
            ("shadow_share = 1.5", "drift.shadow_share"),
            ("kl_bound = -1", "drift.kl_bound"),
            ("window = 3\nmin_jobs = 4", "drift.min_jobs"),
        ] {
            match parse(&(VALID.to_owned() + "\n[drift]\n" + extra + "\n")) {
                Err(ConfigError::Invalid { key: k, .. }) if k == key => {}
                other => panic!("{key}: {:?}", other.map(drop)),
            }
        }
        let producer_only = VALID.replace(
            "roles = [\"producer\", \"consumer\"]",
            "roles = [\"producer\"]",
        );
        assert_ne!(producer_only, VALID);
        match parse(&(producer_only + "\n[drift]\nshadow_share = 0.5\n")) {
            Err(ConfigError::Unused { key, .. }) if key == "drift" => {}
            other => panic!("{:?}", other.map(drop)),
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let cases = [
            ("[node]\n", "[node]\ncolour = \"red\"\n", "colour"),
            (
                "[models]\n",
                "[models]\ntokenizer = \"t.json\"\n",
                "tokenizer",
            ),
            (
                "name = \"mail\"\n",
                "name = \"mail\"\nadaptor = \"x\"\n",
                "adaptor",
            ),
            (
                "kind = \"etcd\"\n",
                "kind = \"etcd\"\nendpoint = \"x:1\"\n",
                "endpoint",
            ),
            ("[tls]\n", "[tls]\nca_file = \"x\"\n", "ca_file"),
            (
                "[store]\n",
                "[tracing]\nendpoint = \"http://x:4317\"\n\n[store]\n",
                "endpoint",
            ),
            (
                "[store]\n",
                "[limits]\nmax_jobs = 3\n\n[store]\n",
                "max_jobs",
            ),
            ("[node]\n", "clusterr = \"x\"\n\n[node]\n", "clusterr"),
        ];
        for (at, with, key) in cases {
            let text = VALID.replacen(at, with, 1);
            assert_ne!(text, VALID, "{at:?} not found");
            let err = parse(&text).unwrap_err();
            assert!(matches!(err, ConfigError::Parse(_)), "{key}: {err}");
            assert!(
                err.to_string().contains(&format!("`{key}`")),
                "{key}: {err}"
            );
        }
        // An embedded store has no endpoints: naming some is an unknown key, not ignored.
        let text = VALID.replace("kind = \"etcd\"", "kind = \"embedded\"");
        assert!(parse(&text)
            .unwrap_err()
            .to_string()
            .contains("`endpoints`"));
    }

    #[test]
    fn a_missing_file_is_refused_naming_its_key_and_path() {
        let cases = [
            ("models/base.gguf", "models.base"),
            ("experts/mail/adapter.safetensors", "experts[mail].adapter"),
            (
                "experts/mail/translator/translator.json",
                "experts[mail].translator",
            ),
            ("pki/node-a.key", "tls.key"),
        ];
        for (file, key) in cases {
            let (dir, config) = fixture();
            let path = dir.path().join(file);
            fs::remove_file(&path).unwrap();
            let err = NodeConfig::load(&config).unwrap_err();
            match &err {
                ConfigError::MissingFile {
                    key: k, path: p, ..
                } => {
                    assert_eq!((k.as_str(), p), (key, &path))
                }
                other => panic!("{file}: {other}"),
            }
            let message = err.to_string();
            assert!(message.contains(key) && message.contains(&path.display().to_string()));
        }
        let (dir, _) = fixture();
        let missing = dir.path().join("nowhere.toml");
        assert!(matches!(
            NodeConfig::load(&missing),
            Err(ConfigError::Read { path, .. }) if path == missing
        ));
    }

    #[test]
    fn a_certificate_from_another_ca_is_refused_naming_both_files() {
        let (dir, config) = fixture();
        let other = dir.path().join("other");
        init_ca_dir(&other, "test").unwrap();
        issue_in_dir(&other, "node-a", Role::Node).unwrap();
        let text = VALID.replace("pki/node-a.", "other/node-a.");
        fs::write(&config, text).unwrap();
        let err = NodeConfig::load(&config).unwrap_err();
        assert!(
            matches!(err, ConfigError::ForeignCertificate { .. }),
            "{err}"
        );
        let message = err.to_string();
        for file in ["other/node-a.pem", "pki/ca.pem"] {
            let path = dir.path().join(file).display().to_string();
            assert!(message.contains(&path), "{message}");
        }
    }

    #[test]
    fn gateway_replicas_share_a_certificate_by_tls_name() {
        let (dir, file) = fixture();
        issue_in_dir(&dir.path().join("pki"), "gateway", Role::Node).unwrap();
        let no_experts = VALID.split("[[experts]]").next().unwrap().to_owned()
            + &VALID[VALID.find("[store]").unwrap()..];
        let gateway = no_experts
            .replace("id = \"node-a\"", "id = \"gateway-7c9d8f6b5-x2x9z\"")
            .replace(
                "roles = [\"producer\", \"consumer\"]",
                "roles = [\"gateway\"]\nhttp_listen = \"127.0.0.1:8080\"",
            )
            .replace("pki/node-a.", "pki/gateway.")
            .replace("[tls]\n", "[tls]\nname = \"gateway\"\n");
        fs::write(&file, &gateway).unwrap();
        let config = NodeConfig::load(&file).unwrap();
        assert_eq!(config.node.id, "gateway-7c9d8f6b5-x2x9z");
        assert_eq!(config.tls.name.as_deref(), Some("gateway"));
        // Without tls.name the certificate is another node's.
        fs::write(&file, gateway.replace("name = \"gateway\"\n", "")).unwrap();
        let err = NodeConfig::load(&file).unwrap_err();
        assert!(matches!(err, ConfigError::WrongIdentity { .. }), "{err}");
        // A node that is dialed by its id may not use another name.
        for roles in ["\"gateway\", \"admin\"", "\"gateway\", \"producer\""] {
            let text = gateway.replace("roles = [\"gateway\"]", &format!("roles = [{roles}]"));
            match parse(&text) {
                Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "tls.name", "{roles}"),
                other => panic!("{roles}: {:?}", other.map(drop)),
            }
        }
        // The same name as node.id is fine anywhere.
        parse(&VALID.replace("[tls]\n", "[tls]\nname = \"node-a\"\n")).unwrap();
        let bad = gateway.replace("name = \"gateway\"", "name = \"Gateway\"");
        assert!(matches!(parse(&bad), Err(ConfigError::Invalid { key, .. }) if key == "tls.name"));
    }

    #[test]
    fn a_certificate_of_another_node_or_an_admin_is_refused() {
        for (name, role) in [("node-b", Role::Node), ("ops", Role::Admin)] {
            let (dir, config) = fixture();
            issue_in_dir(&dir.path().join("pki"), name, role).unwrap();
            let text = VALID.replace("pki/node-a.", &format!("pki/{name}."));
            fs::write(&config, text).unwrap();
            let err = NodeConfig::load(&config).unwrap_err();
            assert!(
                matches!(&err, ConfigError::WrongIdentity { problem, .. } if problem.contains(name)),
                "{err}"
            );
        }
        let (dir, config) = fixture();
        fs::write(dir.path().join("pki/node-a.key"), b"not a key").unwrap();
        assert!(matches!(
            NodeConfig::load(&config),
            Err(ConfigError::BadCertificate { .. })
        ));
    }

    #[test]
    fn etcd_over_tls_needs_its_ca_and_a_whole_client_identity() {
        let plain = "endpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]";
        let tls = "endpoints = [\"etcd:2379\", \"https://10.0.0.2:2379\"]\n\
                   ca = \"etcd/ca.pem\"\ncert = \"etcd/node-a.pem\"\nkey = \"etcd/node-a.key\"";
        let config = parse(&VALID.replace(plain, tls)).unwrap();
        let StoreConfig::Etcd { ca, cert, key, .. } = &config.store else {
            panic!("{:?}", config.store);
        };
        assert_eq!(ca.as_deref(), Some(Path::new("/cfg/etcd/ca.pem")));
        assert_eq!(cert.as_deref(), Some(Path::new("/cfg/etcd/node-a.pem")));
        assert_eq!(key.as_deref(), Some(Path::new("/cfg/etcd/node-a.key")));
        // Server authentication only: the CA without a client certificate.
        let ca_only = tls
            .replace("cert = \"etcd/node-a.pem\"\n", "")
            .replace("key = \"etcd/node-a.key\"", "");
        parse(&VALID.replace(plain, &ca_only)).unwrap();
        let cases = [
            (tls.replace("key = \"etcd/node-a.key\"", ""), "store.cert"),
            (
                tls.replace("https://10.0.0.2", "http://10.0.0.2"),
                "store.endpoints",
            ),
            (tls.replace("ca = \"etcd/ca.pem\"\n", ""), "store.ca"),
            (ca_only.replace("ca = \"etcd/ca.pem\"\n", ""), "store.ca"),
        ];
        for (store, key) in cases {
            let err = parse(&VALID.replace(plain, &store))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(key), "{store}: {err}");
        }
        // An embedded store has nothing to reach over TLS: the keys are unknown there.
        let embedded = VALID
            .replace("kind = \"etcd\"", "kind = \"embedded\"")
            .replace(&format!("{plain}\n"), "");
        parse(&embedded).unwrap();
        let err = parse(&embedded.replace("[store]\n", "[store]\nca = \"etcd/ca.pem\"\n"));
        assert!(err.unwrap_err().to_string().contains("`ca`"));
        assert!(parse(VALID).unwrap().store.etcd_tls().unwrap().is_none());
    }

    #[test]
    fn roles_and_sections_must_agree() {
        const MAIL: &str = "[[experts]]\nname = \"mail\"\nadapter = \"a\"\ntranslator = \"t\"\n";
        let no_experts = VALID.split("[[experts]]").next().unwrap().to_owned()
            + &VALID[VALID.find("[store]").unwrap()..];
        let producer_only = no_experts.replace(
            "roles = [\"producer\", \"consumer\"]",
            "roles = [\"producer\"]",
        );
        parse(&producer_only).unwrap();
        // The HTTP API alone, in front of a cluster: the base model for its tokenizer.
        let gateway = no_experts.replace(
            "roles = [\"producer\", \"consumer\"]",
            "roles = [\"gateway\", \"admin\"]\nhttp_listen = \"127.0.0.1:8080\"",
        );
        let front = parse(&gateway).unwrap();
        assert_eq!(
            front.models.base.as_deref(),
            Some(Path::new("/cfg/models/base.gguf"))
        );
        assert!(front.experts.is_empty() && !front.has_role(NodeRole::Producer));
        let cases = [
            (no_experts.clone(), "experts", "required"),
            (
                VALID.replace("base = \"models/base.gguf\"", ""),
                "models.base",
                "required",
            ),
            (
                VALID.replace("adapter = \"experts/mail\"\n", ""),
                "experts[mail].adapter",
                "required",
            ),
            (
                VALID.replace(
                    "endpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]",
                    "",
                ),
                "store.endpoints",
                "required",
            ),
            (
                VALID.replace(
                    "endpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]",
                    "endpoints = []",
                ),
                "store.endpoints",
                "required",
            ),
            (
                VALID.replace("\"consumer\"]", "\"consumer\", \"gateway\"]"),
                "node.http_listen",
                "required",
            ),
            (
                VALID.replace("roles = [", "http_listen = \"127.0.0.1:8080\"\nroles = ["),
                "node.http_listen",
                "unused",
            ),
            // Every node names the base model: the front roles read its tokenizer.
            (
                no_experts.replace("[\"producer\", \"consumer\"]", "[\"scheduler\"]"),
                "",
                "ok",
            ),
            (
                no_experts.replace("[\"producer\", \"consumer\"]", "[\"admin\"]"),
                "",
                "ok",
            ),
            (gateway.clone(), "", "ok"),
            (
                gateway.replace("base = \"models/base.gguf\"", ""),
                "models.base",
                "required",
            ),
            (
                no_experts
                    .replace("[\"producer\", \"consumer\"]", "[\"admin\"]")
                    .replace("base = \"models/base.gguf\"", ""),
                "models.base",
                "required",
            ),
            // ... and serves no expert.
            (
                VALID.replace("[\"producer\", \"consumer\"]", "[\"admin\"]"),
                "experts",
                "unused",
            ),
            (
                gateway.replace("[store]", &format!("{MAIL}\n[store]")),
                "experts",
                "unused",
            ),
            (
                VALID.replace("[\"producer\", \"consumer\"]", "[\"scheduler\"]"),
                "experts",
                "unused",
            ),
            (
                VALID.replace("[\"producer\", \"consumer\"]", "[]"),
                "node.roles",
                "invalid",
            ),
            (
                VALID.replace("[store]", &format!("{MAIL}\n[store]")),
                "experts[1].name",
                "invalid",
            ),
            // /metrics's token: only with the listener it guards, and not guessable.
            (
                VALID.replace(
                    "roles = [",
                    "metrics_listen = \"127.0.0.1:9100\"\nmetrics_token = \"0123456789abcdef\"\nroles = [",
                ),
                "",
                "ok",
            ),
            (
                VALID.replace("roles = [", "metrics_token = \"0123456789abcdef\"\nroles = ["),
                "node.metrics_token",
                "invalid",
            ),
            (
                VALID.replace(
                    "roles = [",
                    "metrics_listen = \"127.0.0.1:9100\"\nmetrics_token = \"secret\"\nroles = [",
                ),
                "node.metrics_token",
                "invalid",
            ),
        ];
        for (text, key, verdict) in cases {
            let result = parse(&text);
            let ok = match (&result, verdict) {
                (Ok(_), "ok") => true,
                (Err(ConfigError::Required { key: k, .. }), "required")
                | (Err(ConfigError::Unused { key: k, .. }), "unused")
                | (Err(ConfigError::Invalid { key: k, .. }), "invalid") => k == key,
                _ => false,
            };
            assert!(ok, "{key} {verdict}: {:?}\n{text}", result.map(drop));
        }
    }

    #[test]
    fn bad_values_are_refused_naming_their_key() {
        let cases = [
            (VALID.replace("\"node-a\"", "\"Node_A\""), "node.id"),
            (
                VALID.replace("name = \"mail\"", "name = \"mail/x\""),
                "experts[0].name",
            ),
            (
                VALID.replace("\"127.0.0.1:2379\",", "\"127.0.0.1\","),
                "store.endpoints",
            ),
            (
                VALID.replace("kind = \"etcd\"", "kind = \"etcd\"\nprefix = \"scd\""),
                "store.prefix",
            ),
            (
                VALID.to_owned() + "\n[tracing]\notlp_endpoint = \"127.0.0.1:4317\"\n",
                "tracing.otlp_endpoint",
            ),
            (
                VALID.to_owned() + "\n[tracing]\nservice_name = \"\"\n",
                "tracing.service_name",
            ),
        ];
        for (text, key) in cases {
            match parse(&text) {
                Err(ConfigError::Invalid { key: k, .. }) if k == key => {}
                other => panic!("{key}: {:?}", other.map(drop)),
            }
        }
        // Types are checked by the parser, which names the key.
        for (text, key) in [
            (
                VALID.to_owned() + "\n[limits]\nqueued_jobs = 0\n",
                "queued_jobs",
            ),
            (
                VALID.replace("\"127.0.0.1:7000\"", "\"localhost\""),
                "listen",
            ),
            (VALID.replace("\"consumer\"]", "\"decoder\"]"), "roles"),
            (
                VALID.replace("kind = \"etcd\"", "kind = \"zookeeper\""),
                "zookeeper",
            ),
        ] {
            let err = parse(&text).unwrap_err();
            assert!(
                matches!(err, ConfigError::Parse(_)) && err.to_string().contains(key),
                "{key}: {err}"
            );
        }
    }

    #[test]
    fn shipped_cluster_configs_parse_and_name_the_shipped_experts() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let configs = root.join("cluster-config");
        let mut seen = Vec::new();
        for name in [
            "one-process.toml",
            "three-node/producer.toml",
            "three-node/consumer-a.toml",
            "three-node/consumer-b.toml",
        ] {
            let path = configs.join(name);
            let text = fs::read_to_string(&path).unwrap();
            let config = NodeConfig::parse(&text, path.parent().unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            // Models and certificates are made per machine; the experts ship in the repository.
            for (key, file, _) in config.files() {
                if key.starts_with("experts") {
                    assert!(file.is_file(), "{name}: {key} {}", file.display());
                }
            }
            let base = config.models.base.as_ref().unwrap();
            assert_eq!(
                fs::canonicalize(base.parent().unwrap().parent().unwrap()).ok(),
                fs::canonicalize(root.join(".cache")).ok(),
                "{name}"
            );
            assert!(base.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{name}");
            seen.push(config);
        }
        let one = &seen[0];
        assert_eq!(
            one.store,
            StoreConfig::Embedded {
                prefix: DEFAULT_ROOT.into()
            }
        );
        assert_eq!(one.node.roles.len(), 5);
        let three = &seen[1..];
        assert!(three
            .iter()
            .all(|c| matches!(c.store, StoreConfig::Etcd { .. })));
        let producers = three
            .iter()
            .filter(|c| c.has_role(NodeRole::Producer))
            .count();
        let consumers: Vec<_> = three
            .iter()
            .filter(|c| c.has_role(NodeRole::Consumer))
            .map(|c| c.experts[0].name.as_str())
            .collect();
        assert_eq!((producers, consumers), (1, vec!["mail", "sotu"]));
        let ids: HashSet<_> = seen.iter().map(|c| c.node.id.as_str()).collect();
        let ports: HashSet<_> = seen.iter().map(|c| c.node.listen).collect();
        assert_eq!((ids.len(), ports.len()), (4, 4));
    }

    #[test]
    fn the_compose_configs_parse_and_advertise_their_service_names() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster-config/compose");
        for id in ["producer", "consumer-a", "consumer-b", "gateway"] {
            let path = dir.join(format!("{id}.toml"));
            let text = fs::read_to_string(&path).unwrap();
            let config = NodeConfig::parse(&text, &dir).unwrap_or_else(|e| panic!("{id}: {e}"));
            assert_eq!(config.node.id, id);
            assert_eq!(
                config.node.advertise.as_deref(),
                Some(format!("{id}:7101").as_str())
            );
            assert!(matches!(config.store, StoreConfig::Etcd { .. }));
            assert_eq!(
                config.tracing.otlp_endpoint.as_deref(),
                Some("http://jaeger:4318")
            );
        }
        // The HTTP API on a node of its own, the producer without it.
        let gateway =
            NodeConfig::parse(&fs::read_to_string(dir.join("gateway.toml")).unwrap(), &dir)
                .unwrap();
        assert!(gateway.has_role(NodeRole::Gateway) && gateway.experts.is_empty());
        assert_eq!(gateway.node.roles.len(), 1);
        let producer = NodeConfig::parse(
            &fs::read_to_string(dir.join("producer.toml")).unwrap(),
            &dir,
        )
        .unwrap();
        assert!(!producer.has_role(NodeRole::Gateway));
        let bad = VALID.replace("roles = [", "advertise = \"no-port\"\nroles = [");
        let err = NodeConfig::parse(&bad, Path::new(".")).unwrap_err();
        assert!(err.to_string().contains("node.advertise"), "{err}");
    }
}
