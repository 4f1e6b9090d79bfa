//! A node's metrics, in Prometheus' OpenMetrics text format on `node.metrics_listen`
//! (`/metrics`): the jobs this node finished per side and outcome, the jobs it works on, time
//! to first token per mode and expert, stage latencies, code bytes sent and received, actor
//! restarts, the translator versions it serves (and those it could not load), the producer's
//! prefix cache (lookups by result, tokens reused, size), the work waiting on it, and the
//! cluster's live jobs by state. A scrape lists nothing from the store: the cluster's jobs come
//! from [`ClusterJobs`], the index the node's job follower keeps from its listing and watch.
//!
//! The types and the encoding are those of `prometheus-client`, the official Rust client; this
//! file only names the metrics and records into them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use scd_scheduler::{JobId, JobRecord, JobState};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The label of a job's half.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SideLabels {
    /// `producer` or `consumer`.
    pub side: String,
}

/// Labels of a finished job half.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `producer` or `consumer`.
    pub side: String,
    /// `done`, `failed` or `handed_back`.
    pub outcome: String,
}

/// Labels of a job's kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobKindLabels {
    /// The transfer mode.
    pub mode: String,
    /// The expert.
    pub expert: String,
}

/// Labels of a stage.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `prefill`, `encode`, `transfer`, `rebuild` or `first_token`.
    pub stage: String,
}

/// Labels of a translator version.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TranslatorLabels {
    /// The expert.
    pub expert: String,
    /// The translator's content hash.
    pub version: String,
}

/// Labels of an expert.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExpertLabels {
    /// The expert.
    pub expert: String,
}

/// Labels of a lookup's result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `hit` or `miss`.
    pub result: String,
}

/// Labels of a queue.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// `producer` or `consumer`.
    pub queue: String,
}

/// Labels of a job state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// The state.
    pub state: String,
}

/// Seconds from 5 ms to about 80 s.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// A node's metrics.
pub struct NodeMetrics {
    registry: Registry,
    /// Job halves finished here, by side and outcome.
    pub jobs: Family<OutcomeLabels, Counter>,
    /// Job halves running here.
    pub active: Family<SideLabels, Gauge>,
    /// Submission to first token, per mode and expert (consumer side).
    pub ttft: Family<JobKindLabels, Histogram, fn() -> Histogram>,
    /// Stage latencies.
    pub stages: Family<StageLabels, Histogram, fn() -> Histogram>,
    /// Code bytes sent (producer side, frame headers included).
    pub bytes_sent: Counter,
    /// Code bytes received (consumer side, payload).
    pub bytes_received: Counter,
    /// Translator versions served.
    pub translators: Family<TranslatorLabels, Gauge>,
    /// Live translator versions this node could not load (it kept the one it had).
    pub translator_load_failures: Counter,
    /// Prefills that looked in the prefix cache, by result (`hit`, `miss`).
    pub prefix_lookups: Family<ResultLabels, Counter>,
    /// Documents served for jobs, by result (`hit`: from the store; `miss`: compiled).
    pub documents: Family<ResultLabels, Counter>,
    /// Prompt tokens the prefix cache gave instead of a prefill.
    pub prefix_tokens_reused: Counter,
    /// Bytes the prefix cache holds, when last scraped.
    pub prefix_cache_bytes: Gauge,
    /// Blocks the prefix cache holds, when last scraped.
    pub prefix_cache_blocks: Gauge,
    /// Work waiting on this node, when last scraped.
    pub queues: Family<QueueLabels, Gauge>,
    /// Jobs in the cluster by state, when last scraped.
    pub cluster_jobs: Family<StateLabels, Gauge>,
    /// Decodes this consumer finished, by expert (a fan-out job counts one per expert).
    pub decodes: Family<ExpertLabels, Counter>,
    /// Drift guard checks made here, by expert.
    pub shadow_checks: Family<ExpertLabels, Counter>,
    /// The drift guard's mean KL over its window, per expert and translator version.
    pub shadow_kl: Family<TranslatorLabels, Gauge<f64, AtomicU64>>,
    /// The cluster's live jobs as the job follower sees them (what `cluster_jobs` and `queues`
    /// are set from at a scrape).
    pub cluster: ClusterJobs,
    restarts: Gauge<u64, AtomicU64>,
    decode_steps: Gauge<u64, AtomicU64>,
    decode_rows: Gauge<u64, AtomicU64>,
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeMetrics").finish_non_exhaustive()
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// The metrics, registered under the `scd` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("scd");
        let jobs = Family::<OutcomeLabels, Counter>::default();
        registry.register("jobs", "Job halves this node finished", jobs.clone());
        let active = Family::<SideLabels, Gauge>::default();
        registry.register(
            "jobs_active",
            "Job halves this node works on",
            active.clone(),
        );
        let ttft = Family::<JobKindLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency as fn() -> Histogram,
        );
        registry.register(
            "ttft_seconds",
            "Submission to first token of the jobs this node decoded",
            ttft.clone(),
        );
        let stages = Family::<StageLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency as fn() -> Histogram,
        );
        registry.register(
            "stage_seconds",
            "How long each stage of a job took on this node",
            stages.clone(),
        );
        let bytes_sent = Counter::default();
        registry.register(
            "code_bytes_sent",
            "Bytes of code frames sent to consumer nodes",
            bytes_sent.clone(),
        );
        let bytes_received = Counter::default();
        registry.register(
            "code_bytes_received",
            "Bytes of codes received from producer nodes",
            bytes_received.clone(),
        );
        let translators = Family::<TranslatorLabels, Gauge>::default();
        registry.register(
            "translator",
            "Translator versions this node serves (value 1)",
            translators.clone(),
        );
        let cluster_jobs = Family::<StateLabels, Gauge>::default();
        registry.register(
            "cluster_jobs",
            "Live job records in the cluster's store by state (archived ones not counted), as this node's job follower last saw them",
            cluster_jobs.clone(),
        );
        let translator_load_failures = Counter::default();
        registry.register(
            "translator_load_failures",
            "Live translator versions this node could not load (it kept the one it had)",
            translator_load_failures.clone(),
        );
        let prefix_lookups = Family::<ResultLabels, Counter>::default();
        registry.register(
            "prefix_cache_lookups",
            "Prefills that looked in the producer's prefix cache, by result (hit rate: hit / all)",
            prefix_lookups.clone(),
        );
        let documents = Family::<ResultLabels, Counter>::default();
        registry.register(
            "documents_served",
            "Documents a producer served for jobs, by result (hit: from its store, nothing computed; miss: compiled)",
            documents.clone(),
        );
        let prefix_tokens_reused = Counter::default();
        registry.register(
            "prefix_cache_tokens_reused",
            "Prompt tokens taken from the prefix cache instead of computed",
            prefix_tokens_reused.clone(),
        );
        let prefix_cache_bytes = Gauge::default();
        registry.register(
            "prefix_cache_bytes",
            "Bytes the producer's prefix cache holds",
            prefix_cache_bytes.clone(),
        );
        let prefix_cache_blocks = Gauge::default();
        registry.register(
            "prefix_cache_blocks",
            "Prompt blocks the producer's prefix cache holds",
            prefix_cache_blocks.clone(),
        );
        let queues = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "queue_depth",
            "Work waiting on this node when scraped: jobs assigned to it as producer and not \
             yet started (producer), job streams that arrived and wait for a decoder (consumer)",
            queues.clone(),
        );
        let decodes = Family::<ExpertLabels, Counter>::default();
        registry.register(
            "decodes",
            "Decodes this consumer finished, by expert (a fan-out job counts one per expert)",
            decodes.clone(),
        );
        let shadow_checks = Family::<ExpertLabels, Counter>::default();
        registry.register(
            "shadow_checks",
            "Translated jobs this consumer checked against the expert's own prefill (drift guard)",
            shadow_checks.clone(),
        );
        let shadow_kl = Family::<TranslatorLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "shadow_kl",
            "Mean KL(expert's own prefill || rebuilt cache) over the drift guard's recent checks, \
             per translator version",
            shadow_kl.clone(),
        );
        let restarts = Gauge::<u64, AtomicU64>::default();
        registry.register(
            "actor_restarts",
            "Actors the node's supervisor started again",
            restarts.clone(),
        );
        let decode_steps = Gauge::<u64, AtomicU64>::default();
        registry.register(
            "decode_steps",
            "Decode steps of the consumer's batch (forward passes), when scraped",
            decode_steps.clone(),
        );
        let decode_rows = Gauge::<u64, AtomicU64>::default();
        registry.register(
            "decode_rows",
            "Tokens the consumer's batch decoded, when scraped (rows / steps: jobs per step)",
            decode_rows.clone(),
        );
        Self {
            decode_steps,
            decode_rows,
            registry,
            jobs,
            active,
            ttft,
            stages,
            bytes_sent,
            bytes_received,
            translators,
            translator_load_failures,
            prefix_lookups,
            documents,
            prefix_tokens_reused,
            prefix_cache_bytes,
            prefix_cache_blocks,
            queues,
            cluster_jobs,
            decodes,
            shadow_checks,
            shadow_kl,
            cluster: ClusterJobs::default(),
            restarts,
        }
    }

    /// Sets `cluster_jobs` from the job follower's index.
    pub fn set_cluster_jobs(&self) {
        let counts = self.cluster.by_state();
        self.cluster_jobs.clear();
        for state in JobState::ALL {
            let labels = StateLabels {
                state: state.to_string(),
            };
            let n = counts.get(&state).copied().unwrap_or(0);
            self.cluster_jobs
                .get_or_create(&labels)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The decode loop's counts, at a scrape.
    pub fn set_decode(&self, stats: crate::decode_loop::DecodeStats) {
        self.decode_steps.set(stats.steps);
        self.decode_rows.set(stats.rows);
    }

    /// Counts a finished job half.
    pub fn finished(&self, side: &str, outcome: &str) {
        self.jobs
            .get_or_create(&OutcomeLabels {
                side: side.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Counts a drift guard check of `expert`'s translator version `hash` and sets the mean
    /// over its window.
    pub fn shadow_check(&self, expert: &str, hash: scd_scheduler::TranslatorHash, mean_kl: f64) {
        self.shadow_checks
            .get_or_create(&ExpertLabels {
                expert: expert.to_string(),
            })
            .inc();
        self.shadow_kl
            .get_or_create(&TranslatorLabels {
                expert: expert.to_string(),
                version: hash.to_string(),
            })
            .set(mean_kl);
    }

    /// Counts a finished decode of `expert`.
    pub fn decoded(&self, expert: &str) {
        self.decodes
            .get_or_create(&ExpertLabels {
                expert: expert.to_string(),
            })
            .inc();
    }

    /// Counts a prefill's prefix-cache lookup that gave `reused` tokens (0: a miss).
    pub fn prefix_lookup(&self, reused: u64) {
        let result = if reused > 0 { "hit" } else { "miss" };
        self.prefix_lookups
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
        self.prefix_tokens_reused.inc_by(reused);
    }

    /// Counts a job's documents: `hits` served from the store, `compiled` compiled for it.
    pub fn documents_served(&self, hits: u64, compiled: u64) {
        for (result, n) in [("hit", hits), ("miss", compiled)] {
            self.documents
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc_by(n);
        }
    }

    /// Records what a job's half reports: each timed stage's duration, and its bytes on the
    /// wire (sent by a producer, received by a consumer).
    pub fn report(&self, report: &scd_types::JobReport) {
        for (stage, span) in &report.stages {
            if stage.is_timed() {
                self.stage_ms(stage.name(), span.ms());
            }
        }
        match report.side {
            scd_types::Side::Producer => self.bytes_sent.inc_by(report.wire_bytes),
            scd_types::Side::Consumer => self.bytes_received.inc_by(report.wire_bytes),
        };
    }

    /// Records a stage's duration in milliseconds.
    fn stage_ms(&self, stage: &str, ms: f64) {
        self.stages
            .get_or_create(&StageLabels {
                stage: stage.into(),
            })
            .observe(ms / 1e3);
    }

    /// Sets the restart count.
    pub fn set_restarts(&self, n: u64) {
        self.restarts.set(n);
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The cluster's live job records as a node's job follower sees them: its listing, then every
/// change its watch reports. Only what the metrics need is kept (the prompt, outputs and
/// timings are dropped), so a scrape neither reads the store nor holds whole records.
#[derive(Debug, Default)]
pub struct ClusterJobs {
    jobs: Mutex<HashMap<JobId, JobRecord>>,
}

impl ClusterJobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, JobRecord>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets everything (before a fresh listing is put in).
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// A record written (created or changed).
    pub fn put(&self, job: &JobRecord) {
        self.lock().insert(job.id, slim(job));
    }

    /// A record deleted from the live prefix (archived or removed), by its key.
    pub fn remove_key(&self, key: &str) {
        let id = key
            .rsplit('/')
            .next()
            .and_then(|id| id.parse::<JobId>().ok());
        if let Some(id) = id {
            self.lock().remove(&id);
        }
    }

    /// How many live records are in each state.
    pub fn by_state(&self) -> BTreeMap<JobState, usize> {
        let mut counts = BTreeMap::new();
        for job in self.lock().values() {
            *counts.entry(job.state).or_insert(0) += 1;
        }
        counts
    }

    /// The kept records (slimmed), for counts such as the work waiting on this node.
    pub fn records(&self) -> Vec<JobRecord> {
        self.lock().values().cloned().collect()
    }

    /// How many records it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A record with only the fields the counts read.
fn slim(job: &JobRecord) -> JobRecord {
    let mut slim = JobRecord::new(job.id, job.expert.clone(), job.mode, job.max_attempts);
    slim.state = job.state;
    slim.producer = job.producer.clone();
    slim.consumer = job.consumer.clone();
    slim.attempts = job.attempts;
    slim.history.clear();
    slim.created_at_ms = job.created_at_ms;
    slim.updated_at_ms = job.updated_at_ms;
    slim
}
