//! A node's share of the jobs, driven by the job records in the store: the async driver of
//! the [`crate::lifecycle`] state machines. Everything it decides (whose record or stream
//! this is, what an ending means, when progress is due) comes from there; here are the I/O
//! and the actors.
//!
//! - Producer side: a record assigned to this node as producer is claimed (`assigned` to
//!   `prefilling`, by compare-and-swap, so a record seen twice runs once); the node connects to
//!   the job's consumer node and starts its producer half (prefill, encode, send). Timings and
//!   bytes go into the record.
//! - Consumer side: the job stream itself starts the work. A stream nobody expects comes here
//!   from the transfer actor; the record says whether it is ours (this node the consumer, the
//!   stream's peer the recorded producer, the job still running), which expert and mode, and the
//!   request. The decoder rebuilds and decodes; the record ends `done` with the tokens and
//!   timings, or `failed` with the reason.
//!
//! Starting the consumer from the stream, not from the record, means a decoder never waits for
//! a stream that is stuck behind another job on the producer: it only takes jobs whose codes
//! are arriving.
//!
//! A record that turns `cancelled`, `failed` or back to `queued` (the scheduler gave the
//! attempt to someone else) cancels the local work on it.
//!
//! A job that names documents (SemPIC) takes the same path: its producer serves the
//! documents' compiled caches from its store instead of prefilling (compiling the ones it does
//! not hold, and announcing them in its registration), and its consumer reads the prompt itself
//! after them ([`scd_models::codec::Documents`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;

use ractor::ActorRef;
use scd_models::codec::{CodecOptions, TcRate};
use scd_models::{GenerateParams, KvCache, Sampling, StopReason};
use scd_scheduler::jobs::now_ms;
use scd_scheduler::{
    JobRecord, JobRequest, JobResult, JobState, JobStore, Keys, LiveNodes, MetaStore, Mode,
    ModeChoice, StageSpan,
};
use scd_transport::{Connection, Endpoint, JobId, JobReceiver};
use scd_types::{JobReport, LayerPoint, NodeId, Side, Stage};
use tokio::sync::{mpsc, watch, Mutex};
use tokio_util::sync::CancellationToken;

use crate::decoder::DecoderMsg;
use crate::halves::{self, cause, ConsumerJob};
use crate::job::JobCodec;
use crate::job::{JobError, PipelineOptions};
pub(crate) use crate::lifecycle::Refusal;
use crate::lifecycle::{
    self, Action, Attempt, ConsumerEvent, ConsumerHalf, ProducerEvent, ProducerHalf, RecordAction,
};
use crate::metrics::{JobKindLabels, NodeMetrics, SideLabels};
use crate::mode_planner;
use crate::node::served::Served;
use crate::node::supervisor::{read, ActorTable};
use crate::node::translators::NodeTranslators;
use crate::reply::{Step, TokenSource};
use crate::telemetry::Telemetry;
use crate::transfer::TransferInMsg;
use opentelemetry::KeyValue;

/// Everything a node's job handling uses.
pub(crate) struct Work {
    pub id: NodeId,
    pub store: Arc<dyn MetaStore>,
    pub jobs: JobStore,
    pub served: Arc<Served>,
    /// The producer's prefix cache (producer role, unless turned off).
    pub prefix_cache: Option<Arc<crate::prefix_cache::PrefixCache>>,
    /// The consumer's decode loop (consumer role): its counts go into the metrics.
    pub decode_loop: Option<crate::decode_loop::DecodeLoop>,
    /// The translator versions of its experts, following the cluster's live ones.
    pub translators: NodeTranslators,
    pub codec_options: CodecOptions,
    /// How this producer picks the ranks of a job's codes, and the link and prefill speeds
    /// it has measured for it.
    pub ranks: crate::rank_planner::RankPlanner,
    /// The consumer's shadow checks of translated jobs.
    pub drift: Arc<crate::drift_guard::DriftGuard>,
    pub queues: PipelineOptions,
    /// Whether this node prefills.
    pub producer_role: bool,
    /// The node's actors as its supervisor keeps them.
    pub actors: ActorTable,
    /// Connections from producer nodes (a restarted transfer-in actor is given them again).
    pub inbound: Arc<StdMutex<Vec<Connection>>>,
    pub endpoint: Endpoint,
    pub nodes: LiveNodes,
    pub keys: Keys,
    /// The cluster's jobs as a client sees them (the admin endpoint's view).
    pub client: crate::client::ClusterClient,
    /// Whether this node serves admin clients.
    pub admin: bool,
    /// The node's metrics.
    pub metrics: Arc<NodeMetrics>,
    /// The node's tracer, when spans are exported.
    pub telemetry: Option<Telemetry>,
    /// This node's load as it changes; the node's reporter writes it to its registration.
    pub load: watch::Sender<usize>,
    /// The node's registration: where it announces the documents it holds compiled.
    pub registration: Arc<scd_scheduler::Registration>,
    /// Connections to consumer nodes, by node id, each with the registration epoch of the
    /// incarnation it reaches.
    pub links: Mutex<HashMap<NodeId, Link>>,
    /// What the caches of the jobs this consumer decodes may hold at once.
    pub kv: crate::kv_budget::KvBudget,
    /// What this consumer measures of its jobs' last step, for `auto` on the producers.
    pub finish_costs: crate::mode_planner::CostsPerToken,
    /// What this producer measures of its encoding, for `auto`.
    pub encode_costs: crate::mode_planner::CostsPerToken,
    /// What this producer measures of the jobs it serves from its prefix cache, for `auto`
    /// ([`mode_planner::Situation::producer_serve_ms`]).
    pub serve_costs: crate::mode_planner::CostsPerToken,
    /// Jobs this node works on (a one-process node may hold both halves of one), with their
    /// cancellation.
    /// Keyed by attempt too: a job handed back and given to this node again starts afresh
    /// while the old attempt winds down.
    pub active: StdMutex<HashMap<(JobId, u32, Side), CancellationToken>>,
    /// Set when the node drains: no new work is taken.
    pub draining: AtomicBool,
    /// The node's cancellation.
    pub cancel: CancellationToken,
}

fn side_labels(side: Side) -> SideLabels {
    SideLabels {
        side: side.name().into(),
    }
}

/// Test hooks that stop a node's work at a chosen point, for the restart and fault tests.
/// Nothing outside tests sets them; unset, each costs one lock per job.
#[doc(hidden)]
pub mod failpoints {
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    type Nodes = Mutex<BTreeSet<String>>;

    fn set(points: &Nodes, node: &str, on: bool) {
        let mut nodes = points.lock().unwrap_or_else(|p| p.into_inner());
        match on {
            true => nodes.insert(node.to_owned()),
            false => nodes.remove(node),
        };
    }

    fn has(points: &Nodes, node: &str) -> bool {
        let nodes = points.lock().unwrap_or_else(|p| p.into_inner());
        !nodes.is_empty() && nodes.contains(node)
    }

    static HOLD_AFTER_CLAIM: Nodes = Mutex::new(BTreeSet::new());
    static HOLD_BEFORE_REPORT: Nodes = Mutex::new(BTreeSet::new());
    static SILENCED: Nodes = Mutex::new(BTreeSet::new());

    /// With `on`, producer node `node` claims the jobs assigned to it and then holds them
    /// (until the attempt is stopped) instead of opening their streams: a crash between the
    /// claim and the stream, once the node is killed.
    pub fn hold_after_claim(node: &str, on: bool) {
        set(&HOLD_AFTER_CLAIM, node, on)
    }

    pub(crate) fn holds_after_claim(node: &str) -> bool {
        has(&HOLD_AFTER_CLAIM, node)
    }

    /// With `on`, consumer node `node` decodes the jobs it is given and then holds them (until
    /// the attempt is stopped) instead of reporting them: once the node is killed, a consumer
    /// that died with jobs in flight by construction, however fast it decodes.
    pub fn hold_before_report(node: &str, on: bool) {
        set(&HOLD_BEFORE_REPORT, node, on)
    }

    pub(crate) fn holds_before_report(node: &str) -> bool {
        has(&HOLD_BEFORE_REPORT, node)
    }

    /// With `on`, node `node` writes nothing more to job records (no progress, report,
    /// hand-back or failure): with [`crate::node::Node::kill`], a process killed with
    /// SIGKILL, which cannot say anything as it goes.
    pub fn silence(node: &str, on: bool) {
        set(&SILENCED, node, on)
    }

    pub(crate) fn silenced(node: &str) -> bool {
        has(&SILENCED, node)
    }

    pub(crate) fn silenced_error() -> scd_scheduler::JobError {
        scd_scheduler::JobError::Store(scd_scheduler::StoreError::Invalid(
            "failpoint: this node is silenced".into(),
        ))
    }

    /// The variable a node process reads its failpoints from, as fail-rs reads `FAILPOINTS`:
    /// the tests that run `scd node` as a process (`tests/cluster.rs`) cannot reach its
    /// statics. A comma-separated list of `hold-after-claim` and `hold-before-report`.
    pub const ENV: &str = "SCD_FAILPOINTS";

    /// Sets the failpoints [`ENV`] names for node `node`; returns the names set (none where
    /// it is unset), or the first name it does not know (then it sets none).
    pub fn from_env(node: &str) -> Result<Vec<String>, String> {
        match std::env::var(ENV) {
            Ok(list) => set_listed(node, &list),
            Err(_) => Ok(Vec::new()),
        }
    }

    fn set_listed(node: &str, list: &str) -> Result<Vec<String>, String> {
        let names: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        let mut set: Vec<fn(&str, bool)> = Vec::new();
        for name in &names {
            set.push(match name.as_str() {
                "hold-after-claim" => hold_after_claim,
                "hold-before-report" => hold_before_report,
                other => {
                    return Err(format!(
                        "{ENV} names `{other}`; the failpoints are hold-after-claim and \
                         hold-before-report"
                    ))
                }
            });
        }
        for point in set {
            point(node, true);
        }
        Ok(names)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_listed_failpoint_is_set_for_its_node_and_an_unknown_one_sets_none() {
            let err = set_listed("fp-a", "hold-before-report, hold-on").unwrap_err();
            assert!(err.contains("`hold-on`"), "{err}");
            assert!(!holds_before_report("fp-a"));
            let set = set_listed("fp-a", " hold-before-report ,,").unwrap();
            assert_eq!(set, ["hold-before-report"]);
            assert!(holds_before_report("fp-a"));
            assert!(!holds_before_report("fp-b") && !holds_after_claim("fp-a"));
            hold_before_report("fp-a", false);
            assert!(!holds_before_report("fp-a"));
        }
    }
}

/// Applies a half's final change (its report, a hand-back, a failure) to `job`'s record, and
/// keeps trying while the store is away or contended ([`lifecycle::retry_final_write`]) until
/// it lands, the change finds the attempt fenced (it then writes nothing), or `stop` fires (the
/// node shutting down: the scheduler's attempt deadline then ends the attempt). Before, a write
/// that outlasted the job store's own patience was logged and dropped, and the job stayed
/// running.
pub(crate) async fn write_final(
    jobs: &JobStore,
    node: &str,
    job: JobId,
    stop: &CancellationToken,
    mut change: impl FnMut(&mut JobRecord) -> Result<(), scd_scheduler::JobError>,
) -> Result<JobRecord, scd_scheduler::JobError> {
    let mut failures = 0u32;
    loop {
        if failpoints::silenced(node) {
            return Err(failpoints::silenced_error());
        }
        let error = match jobs.update(job, &mut change).await {
            Ok(record) => return Ok(record),
            Err(e) => e,
        };
        let Some(wait) = lifecycle::retry_final_write(&error, failures) else {
            return Err(error);
        };
        failures = failures.saturating_add(1);
        tracing::warn!(%job, error = %error, retry_in = ?wait, failures, "a job's final write did not land; trying again");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return Err(error),
        }
    }
}

/// The most document ids a node announces holding (the newest kept): the registration is
/// rewritten at every change, so it stays small.
pub(crate) const MAX_ANNOUNCED_DOCUMENTS: usize = 4096;

impl Work {
    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Registers local work on `job`; `None` if it is already running here.
    fn begin(&self, job: JobId, attempt: u32, side: Side) -> Option<CancellationToken> {
        let mut active = self.active.lock().unwrap_or_else(|p| p.into_inner());
        if active.contains_key(&(job, attempt, side)) {
            return None;
        }
        let token = self.cancel.child_token();
        active.insert((job, attempt, side), token.clone());
        self.metrics.active.get_or_create(&side_labels(side)).inc();
        let load = active.len();
        drop(active);
        self.report_load(load);
        Some(token)
    }

    fn end(&self, job: JobId, attempt: u32, side: Side) {
        let mut active = self.active.lock().unwrap_or_else(|p| p.into_inner());
        if active.remove(&(job, attempt, side)).is_some() {
            self.metrics.active.get_or_create(&side_labels(side)).dec();
        }
        let load = active.len();
        drop(active);
        self.report_load(load);
    }

    /// The number of jobs this node works on now.
    pub fn load(&self) -> usize {
        self.active.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Cancels local work on `job`'s attempts that `action` ends.
    pub fn cancel_local(&self, job: JobId, action: RecordAction) {
        let active = self.active.lock().unwrap_or_else(|p| p.into_inner());
        for ((j, attempt, _), token) in active.iter() {
            if *j == job && action.ends(*attempt) {
                token.cancel();
            }
        }
    }

    /// The jobs this node works on.
    pub fn active_jobs(&self) -> Vec<JobId> {
        let active = self.active.lock().unwrap_or_else(|p| p.into_inner());
        let mut jobs: Vec<JobId> = active.keys().map(|(j, _, _)| *j).collect();
        jobs.sort_unstable();
        jobs.dedup();
        jobs
    }

    fn report_load(&self, load: usize) {
        self.load.send_replace(load);
    }

    /// Reacts to a job record as it is now.
    pub fn on_record(self: &Arc<Self>, job: JobRecord) {
        match lifecycle::on_record(&job, &self.id, self.producer_role, self.is_draining()) {
            action @ RecordAction::CancelLocal { .. } => self.cancel_local(job.id, action),
            RecordAction::StartProducer => {
                if let Some(cancel) = self.begin(job.id, job.attempts, Side::Producer) {
                    let work = Arc::clone(self);
                    tokio::spawn(async move {
                        let (id, attempt) = (job.id, job.attempts);
                        work.run_producer(job, cancel).await;
                        work.end(id, attempt, Side::Producer);
                    });
                }
            }
            RecordAction::Ignore => {}
        }
    }

    /// The producer half of an assigned job: its [`ProducerHalf`]'s actions carried out.
    async fn run_producer(&self, job: JobRecord, cancel: CancellationToken) {
        let (mut half, _claim) = ProducerHalf::new(job.id, job.attempts, &self.id);
        // A job in mode auto is sent the way this node expects to be fastest under the
        // quality ceiling, and the record says so from the claim on.
        let (choice, chosen_ranks) = match job.mode {
            Mode::Auto => {
                let (choice, ranks) = self.choose_mode(&job);
                (Some(choice), ranks)
            }
            _ => (None, None),
        };
        let mode = choice.as_ref().map_or(job.mode, |c| c.chosen);
        // The version this attempt's codes are made with: the live one now, stamped on the
        // record as the attempt is claimed so that the consumer rebuilds with the same one;
        // likewise the ranks, chosen for the link to the job's consumer as it is now.
        let version = match mode.needs_translator() {
            true => self.translators.current(&job.expert).ok(),
            false => None,
        };
        let stamp = version.as_ref().map(|v| v.hash());
        // Auto weighed the codes at their ranks already: the ones it chose are those. Only
        // codes tied to the translator have a size to choose (the translator's own codes their
        // ranks or rate, kvtc's its rate; droidspeak sends raw KV).
        let ranks = chosen_ranks.or_else(|| {
            let v = version
                .as_ref()
                .filter(|_| mode.codes_tied_to_translator())?;
            let prompt = &job.request.as_ref()?.prompt;
            let rows = prompt.len().saturating_sub(1);
            let computed = rows - self.cached_rows(prompt);
            let consumer = job.consumer.as_deref()?;
            Some(
                self.ranks
                    .plan(&v.translator, v.index, mode, (rows, computed), consumer),
            )
        });
        // The job store waits out a brief etcd outage, so a claim whose answer was lost is
        // found applied on its retry rather than left assigned to this node for ever.
        let claimed = self
            .jobs
            .update(job.id, |j| {
                half.claim(j, stamp, ranks, choice.clone(), now_ms())
            })
            .await;
        if let Err(e) = &claimed {
            tracing::warn!(job = %job.id, error = %e, "claiming a job failed");
        }
        let action = half.handle(ProducerEvent::Claimed(claimed.as_ref().ok()));
        let (Action::Start, Ok(job)) = (action, claimed) else {
            return;
        };
        if failpoints::holds_after_claim(&self.id) {
            // A test's stand-in for a crash between the claim and the stream.
            tracing::warn!(job = %job.id, "failpoint: holding the claimed job");
            return cancel.cancelled().await;
        }
        let started = Instant::now();
        // The stages' own token: the first stage to fail cancels the others through it, so that
        // `cancel` still tells whether the job was stopped from outside (cancelled by its user,
        // ended on the record by the consumer, or the node shutting down).
        let stages = cancel.child_token();
        let replies = match self.start_producer(&job, &stages).await {
            Ok(replies) => replies,
            Err(refusal) => {
                let action = half.handle(ProducerEvent::Refused(&refusal));
                return self.carry_out(half.attempt(), action).await;
            }
        };
        half.handle(ProducerEvent::Started);
        let action = match replies.settle(&stages).await.map_err(cause) {
            Ok(done) => match half.handle(ProducerEvent::Finished) {
                Action::Report => return self.producer_report(&half, &job, done, started).await,
                other => other,
            },
            Err(error) => half.handle(ProducerEvent::Failed {
                error: &error,
                stopped: cancel.is_cancelled(),
            }),
        };
        let action = match action {
            Action::AwaitRecord(grace) => {
                let ended = tokio::time::timeout(grace, cancel.cancelled()).await;
                half.handle(match ended {
                    Ok(()) => ProducerEvent::AttemptEnded,
                    Err(_) => ProducerEvent::GraceElapsed,
                })
            }
            other => other,
        };
        self.carry_out(half.attempt(), action).await;
    }

    /// The mode of a job submitted in mode `auto` ([`crate::mode_planner`]): every way of
    /// sending this node can make for the job's expert, weighed with what it measured and
    /// what the job's consumer advertises; with the ranks of the chosen codes.
    fn choose_mode(&self, job: &JobRecord) -> (ModeChoice, Option<scd_scheduler::RanksChoice>) {
        let fixed = |mode, why| (ModeChoice::fixed(mode, why), None);
        let Some(request) = job.request.as_ref() else {
            return fixed(Mode::Oracle, "the record has no request to plan for");
        };
        // The client resolves these (ClusterClient::submit_fan_out); a record written
        // otherwise still runs.
        if !request.documents.is_empty() {
            return fixed(Mode::Oracle, "a job with documents runs in mode oracle");
        }
        if !job.fan_out.is_empty() {
            return fixed(Mode::Raw, "a fan-out is not planned");
        }
        let version = self.translators.current(&job.expert).ok();
        let consumer = job.consumer.as_deref().unwrap_or_default();
        let advertised = self.nodes.snapshot().remove(consumer);
        let rows = request.prompt.len().saturating_sub(1);
        let cached = self.cached_rows(&request.prompt);
        let config = &self.served.config;
        let policy = self.ranks.policy();
        let layers = config.num_layers;
        let mut situation = mode_planner::Situation {
            rows,
            producer_rows: rows.saturating_sub(cached),
            producer_secs_per_token: self.ranks.prefill_secs_per_token(),
            producer_encode_ms: self.encode_costs.now(),
            producer_serve_ms: self.serve_costs.now(),
            link_bytes_per_sec: self.ranks.link(consumer),
            layers,
            kl_ceiling: policy.kl_ceiling,
            slack: policy.slack,
            ..Default::default()
        };
        let transfer_kl = advertised
            .as_ref()
            .and_then(|n| n.transfer_kl.get(&job.expert).cloned())
            .unwrap_or_default();
        if let Some(n) = advertised {
            situation.consumer_finish_ms = n.finish_ms_per_token;
        }
        // The base's own KV: K and V, kv_dim values per token and layer, bf16 (2 bytes);
        // KIVI packs a value in 4 (2) bits plus an f16 scale and minimum per group of 32: 5 (3)
        // bits a value.
        let raw = (layers * rows * 2 * config.num_kv_heads * config.head_dim * 2) as u64;
        let kivi = |mode: Mode, bits: u64| mode_planner::Offer {
            mode,
            payload_bytes: raw * bits / 16,
            kl: transfer_kl.get(&mode).copied(),
            ranks: None,
        };
        let mut offers = vec![
            mode_planner::Offer {
                mode: Mode::Raw,
                payload_bytes: raw,
                kl: transfer_kl.get(&Mode::Raw).copied(),
                ranks: None,
            },
            kivi(Mode::Q4, 5),
            kivi(Mode::Q2, 3),
        ];
        if let Some(v) = &version {
            let manifest = &v.translator.manifest;
            situation.patch_share = manifest.patch_layers.len() as f64 / layers.max(1) as f64;
            let kvtc = manifest.kvtc.is_some().then_some(Mode::Kvtc);
            for mode in [Mode::Reuse, Mode::Scd].into_iter().chain(kvtc) {
                let choice = self.ranks.plan(
                    &v.translator,
                    v.index,
                    mode,
                    (rows, situation.producer_rows),
                    consumer,
                );
                let Some(payload_bytes) = self.expected_payload(v, mode, &choice, rows, raw) else {
                    continue;
                };
                // The KL the choice was made on, or the one measured at its ranks or rate.
                let kl = choice.curve_kl.or_else(|| match choice.step {
                    Some(step) => manifest.rate_table.as_ref()?.kl_at(mode, v.index, step),
                    None => {
                        let points = manifest.rank_curve.as_ref()?.points.iter();
                        points
                            .filter(|p| p.mode == mode && p.ranks == choice.ranks)
                            .find_map(|p| p.kl.get(v.index).copied())
                    }
                });
                offers.push(mode_planner::Offer {
                    mode,
                    payload_bytes,
                    kl,
                    ranks: Some(choice),
                });
            }
        }
        tracing::debug!(job = %job.id, ?situation, ?offers, "auto weighs");
        let (choice, offer) = mode_planner::choose(&situation, &offers);
        tracing::info!(job = %job.id, mode = %choice.chosen, reason = choice.reason, "auto chose a mode");
        (choice, offer.ranks)
    }

    /// Rows of `prompt` (less its last token) the producer holds in its prefix cache.
    fn cached_rows(&self, prompt: &[u32]) -> usize {
        let rows = prompt.len().saturating_sub(1);
        match &self.prefix_cache {
            Some(cache) => {
                let hashes = cache.hashes(&prompt[..rows]);
                (cache.lookup(&hashes).len() * cache.block_tokens()).min(rows)
            }
            None => 0,
        }
    }

    /// The bytes a job of `mode` sends with codes of `choice`'s size over `rows` tokens whose
    /// raw KV is `raw` bytes: a fixed-width code's exact payload, or the share of raw the rate
    /// table measured for a transform-coded one (its bytes depend on its values; the bound
    /// the wire checks is several times more); `None` for a codec this node cannot make.
    fn expected_payload(
        &self,
        v: &crate::node::translators::Version,
        mode: Mode,
        choice: &scd_scheduler::RanksChoice,
        rows: usize,
        raw: u64,
    ) -> Option<u64> {
        if let Some(step) = choice.step {
            let table = v.translator.manifest.rate_table.as_ref()?;
            let share = table.share_at(mode, v.index, step)?;
            return Some((raw as f64 * share).ceil() as u64);
        }
        let codec = scd_models::codec::Translated::new(
            v.translator.clone(),
            mode,
            v.index,
            choice.ranks,
            self.codec_options.code_dtype,
            None,
        )
        .ok()?;
        Some(codec.payload_bytes(rows))
    }

    /// A finished producer half's report, into the rank planner, the metrics, the trace and
    /// the record.
    async fn producer_report(
        &self,
        half: &ProducerHalf,
        job: &JobRecord,
        done: halves::ProducerDone,
        started: Instant,
    ) {
        let id = job.id;
        let clock = WallClock::now();
        let span = |s: crate::timeline::Span| clock.span(s.start, s.end);
        let mut report = JobReport::new(Side::Producer, clock.span(started, clock.now));
        report
            .stage(Stage::Prefill, done.prefill.map(span))
            .stage(
                Stage::Documents,
                done.documents.as_ref().map(|d| span(d.span)),
            )
            .stage(Stage::Encode, done.encoded.span.map(span))
            .stage(Stage::Transfer, Some(span(done.sent.span)));
        let layers = done.encoded.layer_bytes.iter();
        let points = layers.map(|l| clock.layer(l.layer, l.bytes, l.encoded));
        report.layers.push((Stage::Encode, points.collect()));
        report.wire_bytes = done.sent.wire_bytes;
        if let Some(consumer) = &job.consumer {
            let elapsed = done.sent.span.end - done.sent.span.start;
            let (bytes, rate) = (report.wire_bytes, done.sent.link_rate);
            self.ranks.observe_transfer(consumer, bytes, rate, elapsed);
        }
        if let Some(r) = job.request.as_ref() {
            let rows = r.prompt.len().saturating_sub(1);
            let busy = done.encoded.busy.as_secs_f64();
            self.encode_costs.observe(job.mode, rows, busy);
            let computed = rows.saturating_sub(done.cached_tokens);
            let shape = mode_planner::Situation {
                rows,
                producer_rows: computed,
                ..Default::default()
            };
            if let (true, Some(encoded)) = (shape.mostly_cached(), done.encoded.span) {
                let own = (encoded.end - started).saturating_sub(done.encoded.waited_for_link);
                self.serve_costs.observe(job.mode, rows, own.as_secs_f64());
            }
        }
        if let (Some(prefill), Some(r)) = (report.span(Stage::Prefill), job.request.as_ref()) {
            let computed = r.prompt.len().saturating_sub(1 + done.cached_tokens);
            self.ranks.observe_prefill(computed, prefill.ms() / 1e3);
        }
        let m = &self.metrics;
        m.report(&report);
        let cached_tokens = done.cached_tokens as u64;
        if self.prefix_cache.is_some() && done.prefill.is_some() {
            m.prefix_lookup(cached_tokens);
        }
        if let Some(d) = &done.documents {
            m.documents_served(d.hits as u64, d.compiled.len() as u64);
        }
        m.finished(Side::Producer.name(), "done");
        if let Some(t) = &self.telemetry {
            let mut attrs = self.trace_attributes(job);
            attrs.push(KeyValue::new("scd.wire_bytes", report.wire_bytes as i64));
            if let Some(c) = job.ranks {
                attrs.push(KeyValue::new("scd.ranks_rule", c.rule.name()));
                if let Some(m) = c.link_mbit {
                    attrs.push(KeyValue::new("scd.link_mbit", m));
                }
                if let Some(kl) = c.curve_kl {
                    attrs.push(KeyValue::new("scd.ranks_curve_kl", kl));
                }
                if let Some(step) = c.step {
                    attrs.push(KeyValue::new("scd.tc_step", f64::from(step)));
                }
            }
            t.record_report(&job.trace, &report, attrs);
        }
        let layer_bytes: Vec<u64> = report
            .layers_of(Stage::Encode)
            .iter()
            .map(|l| l.bytes as u64)
            .collect();
        let documents = done
            .documents
            .as_ref()
            .map(|d| scd_scheduler::DocumentsRecord {
                writer: d.writer.clone(),
                rows: d.rows as u64,
                compiled: d.compiled.clone(),
                hits: d.hits as u32,
            });
        let written = write_final(&self.jobs, &self.id, id, &self.cancel, |j| {
            half.report(j, &report, now_ms(), |j| {
                j.layer_bytes = layer_bytes.clone();
                j.payload_bytes = report.wire_bytes;
                j.cached_prefix_tokens = cached_tokens;
                j.documents = documents.clone();
            })
        })
        .await;
        if let Err(e) = written {
            tracing::warn!(job = %id, error = %e, "recording the producer's timings failed");
        }
        if let Some(d) = done.documents.as_ref().filter(|d| !d.compiled.is_empty()) {
            self.announce_documents(&d.compiled).await;
        }
    }

    /// The attributes of a half's trace span that come from the job.
    fn trace_attributes(&self, job: &JobRecord) -> Vec<KeyValue> {
        let mut attrs = vec![
            KeyValue::new("scd.job", job.id.to_string()),
            KeyValue::new("scd.node", self.id.to_string()),
            KeyValue::new("scd.expert", job.expert.clone()),
            KeyValue::new("scd.mode", job.mode.to_string()),
            KeyValue::new("scd.translator", translator_name(job)),
            KeyValue::new("scd.ranks", self.ranks_name(job)),
        ];
        if let Some(choice) = &job.mode_choice {
            attrs.push(KeyValue::new("scd.mode_requested", "auto"));
            attrs.push(KeyValue::new("scd.mode_reason", choice.reason.clone()));
        }
        attrs
    }

    async fn start_producer(
        &self,
        job: &JobRecord,
        cancel: &CancellationToken,
    ) -> Result<halves::ProducerReplies, Refusal> {
        let request = self.check_request(job)?;
        let codec = self.codec(job, &job.expert).await?;
        let consumer = job
            .consumer
            .clone()
            .ok_or_else(|| Refusal::ConsumerGone("(none recorded)".into()))?;
        let connection = self.link(&consumer, job.consumer_epoch).await?;
        let producer = read(&self.actors)
            .producer()
            .ok_or(Refusal::Codec("this node has no producer role".into()))?;
        if !request.documents.is_empty() {
            let documents = self.documents_of(request).await?;
            let after = request.prompt.len() + request.max_tokens as usize;
            return producer
                .start_documents(
                    job.id,
                    job.trace.clone(),
                    documents,
                    after,
                    connection,
                    &self.queues,
                    cancel,
                )
                .map_err(|e| Refusal::Codec(e.to_string()));
        }
        let prefix = request.prompt[..request.prompt.len() - 1].to_vec();
        producer
            .start(
                job.id,
                job.trace.clone(),
                prefix,
                codec,
                connection,
                &self.queues,
                cancel,
            )
            .map_err(|e| Refusal::Codec(e.to_string()))
    }

    /// A connection to consumer node `node` as of registration `epoch` (`None`: any), opened
    /// on first use and again after it closed or the node restarted.
    ///
    /// A node killed without closing its connections leaves them open here until QUIC's idle
    /// timeout; a stream opened on one would wait that long. The job record names the
    /// incarnation it was assigned to, so a link to another one is dropped, not reused.
    async fn link(&self, node: &NodeId, epoch: Option<u64>) -> Result<Connection, Refusal> {
        let mut links = self.links.lock().await;
        if let Some(link) = links.get(node) {
            if !link.connection.is_closed() && same_incarnation(link.epoch, epoch) {
                return Ok(link.connection.clone());
            }
            // Closed already, or reaching an incarnation that is gone.
            link.connection
                .close("replaced by a connection to the node's new incarnation");
            links.remove(node);
        }
        // The node view follows a watch; a node that joined (or restarted) a moment ago may be
        // known to the scheduler that assigned the job before it reaches this view: ask the
        // store then.
        let known = self
            .nodes
            .snapshot()
            .get(node)
            .filter(|info| same_incarnation(info.epoch, epoch))
            .cloned();
        let info = match known {
            Some(info) => info,
            None => self
                .read_node(node)
                .await
                .ok_or_else(|| Refusal::ConsumerGone(node.as_str().to_owned()))?,
        };
        let connect_err = |error: String| Refusal::Connect {
            node: node.as_str().to_owned(),
            error,
        };
        let addr = tokio::net::lookup_host(&info.addr)
            .await
            .map_err(|e| connect_err(format!("resolving {}: {e}", info.addr)))?
            .next()
            .ok_or_else(|| connect_err(format!("{} resolves to nothing", info.addr)))?;
        let connection = self
            .endpoint
            .connect(addr, node)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        links.insert(
            node.clone(),
            Link {
                epoch: info.epoch,
                connection: connection.clone(),
            },
        );
        Ok(connection)
    }

    /// A node's registration as the store has it now.
    async fn read_node(&self, node: &str) -> Option<scd_scheduler::NodeInfo> {
        let key = self.keys.node(node).ok()?;
        let kv = self.store.get(&key).await.ok()??;
        scd_scheduler::envelope::decode(&kv.key, &kv.value).ok()
    }

    /// A job stream nobody expected: the consumer half of a job, if the record says so.
    pub async fn on_stream(self: &Arc<Self>, receiver: JobReceiver) {
        let id = receiver.job_id();
        let peer = receiver.peer().name.clone();
        // The job store waits out a brief etcd outage before this refuses (a refusal costs the
        // job an attempt).
        let job = match self.jobs.get(id).await {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "reading a job record failed");
                receiver
                    .cancel("the consumer node cannot read the job")
                    .await;
                return;
            }
        };
        let attempt = match lifecycle::admit_stream(job.as_ref(), &self.id, &peer) {
            Ok(attempt) => attempt,
            Err(refusal) => {
                tracing::warn!(job = %id, %peer, refusal, "refused a job stream");
                receiver.cancel(refusal).await;
                return;
            }
        };
        let Some(job) = job else { return };
        let Some(cancel) = self.begin(id, attempt, Side::Consumer) else {
            receiver.cancel("the job is already being decoded").await;
            return;
        };
        let work = Arc::clone(self);
        tokio::spawn(async move {
            work.run_consumer(job, receiver, cancel).await;
            work.end(id, attempt, Side::Consumer);
        });
    }

    /// The documents `request` names (SemPIC), read from their records: id and tokens, in order.
    async fn documents_of(&self, request: &JobRequest) -> Result<Vec<(String, Vec<u32>)>, Refusal> {
        let registry = scd_scheduler::DocumentRegistry::new(self.store.clone(), self.keys.clone());
        let mut documents = Vec::with_capacity(request.documents.len());
        for id in &request.documents {
            let record = registry
                .get(id)
                .await
                .map_err(|e| Refusal::Documents(format!("document {id}: {e}")))?
                .ok_or_else(|| Refusal::UnknownDocument(id.clone()))?;
            documents.push((record.id, record.tokens));
        }
        Ok(documents)
    }

    /// The consumer half of a job whose stream arrived: its [`ConsumerHalf`]'s actions
    /// carried out.
    async fn run_consumer(&self, job: JobRecord, receiver: JobReceiver, cancel: CancellationToken) {
        let id = job.id;
        let (mut half, _start) = ConsumerHalf::new(id, job.attempts, &self.id);
        let started = Instant::now();
        // A fan-out's other experts decode on this node too, from the same codes.
        let mut set_up =
            self.consumer_job(&job, &job.expert)
                .await
                .and_then(|(decoder, params, codec)| {
                    let request = self.check_request(&job)?;
                    Ok((decoder, params, codec, request.prompt.clone()))
                });
        let mut others = Vec::with_capacity(job.fan_out.len());
        for expert in &job.fan_out {
            if set_up.is_err() {
                break;
            }
            match self.consumer_job(&job, expert).await {
                Ok(part) => others.push((expert.clone(), part)),
                Err(refusal) => set_up = Err(refusal),
            }
        }
        // Room for every expert's cache of the whole answer (after the documents' compiled
        // rows, where it names any), held until the job ends here.
        let document_rows = match (&set_up, job.request.as_ref()) {
            (Ok(_), Some(r)) if !r.documents.is_empty() => self
                .documents_of(r)
                .await
                .map(|d| d.iter().map(|(_, tokens)| tokens.len()).sum()),
            _ => Ok(0),
        };
        let set_up = set_up.and_then(|(decoder, params, codec, prompt)| {
            let positions = document_rows? + prompt.len() + params.max_tokens;
            let bytes = KvCache::peak_bytes(&self.served.config, positions)
                .saturating_mul(1 + others.len() as u64);
            let held = self.kv.reserve(bytes)?;
            Ok(((decoder, params, codec, prompt), held))
        });
        let ((decoder, mut params, codec, prompt), _kv) = match set_up {
            Ok(s) => s,
            Err(refusal) => {
                receiver.cancel(&refusal.to_string()).await;
                let action = half.handle(ConsumerEvent::Refused(&refusal));
                return self.carry_out(half.attempt(), action).await;
            }
        };
        let (inbound_tx, mut inbound_rx) =
            mpsc::channel::<crate::transfer::Inbound>(self.queues.arrival_queue.max(1));
        // A fan-out's frames go to every expert's decoder: each rebuilds its own cache.
        let mut other_inbound = Vec::with_capacity(others.len());
        if !others.is_empty() {
            let queue = self.queues.arrival_queue.max(1);
            let (first_tx, first_rx) = mpsc::channel(queue);
            let mut outs = vec![first_tx];
            for _ in &others {
                let (tx, rx) = mpsc::channel(queue);
                outs.push(tx);
                other_inbound.push(rx);
            }
            let mut from = std::mem::replace(&mut inbound_rx, first_rx);
            tokio::spawn(async move {
                while let Some(item) = from.recv().await {
                    for out in &outs {
                        let copy = match &item {
                            Ok(a) => Ok(crate::job::Arrival {
                                frame: a.frame.clone(),
                                at: a.at,
                            }),
                            Err(e) => Err(e.clone()),
                        };
                        // A decoder that stopped taking frames has failed its part already.
                        let _ = out.send(copy).await;
                    }
                }
            });
        }
        let attach = TransferInMsg::Attach {
            receiver: Box::new(receiver),
            inbound: inbound_tx,
        };
        let transfer_in = read(&self.actors).transfer_in.clone();
        if transfer_in.is_none_or(|t| t.send_message(attach).is_err()) {
            let action = half.handle(ConsumerEvent::NotStarted("its transfer actor is gone"));
            return self.carry_out(half.attempt(), action).await;
        }
        // A job the drift guard checks keeps a copy of its rebuilt cache for after it answers.
        let checked =
            job.mode.uses_translator_codes() && job.translator.is_some() && self.drift.sampled(id);
        let (shadow_tx, shadow_rx) = match checked {
            true => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        // A retried attempt goes on from what an earlier one showed (the fan-out's other
        // experts show nothing before they finish: they start over).
        let shown = lifecycle::shown_tokens(&job);
        params.max_tokens = params.max_tokens.saturating_sub(shown.len());
        half.resume(&shown);
        let resumed = !shown.is_empty();
        // Kept for the fan-out's other decoders and the shadow check (a few KB of token ids).
        let decode = ConsumerJob {
            job: id,
            prompt: prompt.clone(),
            codec,
            params,
            resume: shown,
            inbound: inbound_rx,
            shadow: shadow_tx,
        };
        let mut decoding = match halves::start_decode(&decoder, decode, &self.queues, &cancel) {
            Ok(d) => d,
            Err(e) => {
                let action = half.handle(ConsumerEvent::NotStarted(&e.to_string()));
                return self.carry_out(half.attempt(), action).await;
            }
        };
        let mut fan_out = Vec::with_capacity(others.len());
        for ((expert, (decoder, params, codec)), inbound) in others.into_iter().zip(other_inbound) {
            let part = ConsumerJob {
                job: id,
                prompt: prompt.clone(),
                codec,
                params,
                resume: Vec::new(),
                inbound,
                shadow: None,
            };
            let decoding = match halves::start_decode(&decoder, part, &self.queues, &cancel) {
                Ok(d) => d,
                Err(e) => {
                    let cause = format!("fan-out to {expert}: {e}");
                    let action = half.handle(ConsumerEvent::NotStarted(&cause));
                    return self.carry_out(half.attempt(), action).await;
                }
            };
            fan_out.push(tokio::spawn(async move {
                let (tokens, report) = decoding.collect().await;
                (expert, report.map(|r| (r, tokens)))
            }));
        }
        half.handle(ConsumerEvent::Started);
        while let Some(step) = decoding.next().await {
            let Step::Tokens(tokens) = step else { continue };
            let now = Instant::now();
            let mut write = false;
            for token in tokens {
                write |= half.handle(ConsumerEvent::Token { token, now }) == Action::WriteProgress;
            }
            if write {
                self.progress(&half).await;
            }
        }
        let mut result = decoding.finish().await;
        let mut outputs = std::collections::BTreeMap::new();
        let mut fan_out_first = Vec::new();
        for part in fan_out {
            match part.await {
                Ok((expert, Ok((report, tokens)))) => {
                    let stop = stop_name(&report.stop);
                    if let Some(t) = report.first_token {
                        let ms = t.duration_since(started).as_secs_f64() * 1e3;
                        fan_out_first.push((format!("first_token:{expert}"), ms));
                    }
                    outputs.insert(expert, JobResult { tokens, stop });
                }
                Ok((expert, Err(e))) if result.is_ok() => {
                    tracing::warn!(job = %id, %expert, error = %e, "a fan-out expert failed");
                    result = Err(e);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(job = %id, error = %e, "a fan-out decode task failed");
                    if result.is_ok() {
                        result = Err(JobError::ActorGone("decoder"));
                    }
                }
            }
        }
        let decoded = match result {
            Ok(decoded) => decoded,
            Err(error) => {
                let stopped = cancel.is_cancelled();
                let action = half.handle(ConsumerEvent::Failed {
                    error: &error,
                    stopped,
                });
                return self.carry_out(half.attempt(), action).await;
            }
        };
        if half.handle(ConsumerEvent::Finished) != Action::Report {
            return;
        }
        if failpoints::holds_before_report(&self.id) {
            // A test's stand-in for a consumer that dies with the job decoded but not reported.
            tracing::warn!(job = %id, "failpoint: holding the decoded job");
            return cancel.cancelled().await;
        }
        let clock = WallClock::now();
        let end = clock.now;
        let mut report = JobReport::new(Side::Consumer, clock.span(started, end));
        let arrivals = (decoded.arrivals.first(), decoded.arrivals.last());
        report
            .stage(
                Stage::Rebuild,
                Some(clock.span(decoded.rebuild.start, decoded.rebuild.end)),
            )
            .stage(
                Stage::Arrivals,
                match arrivals {
                    (Some(first), Some(last)) => Some(clock.span(first.at, last.at)),
                    _ => None,
                },
            )
            .stage(
                Stage::FirstToken,
                decoded.first_token.map(|t| clock.span(started, t)),
            )
            .stage(
                Stage::Decode,
                decoded.first_token.map(|t| clock.span(t, end)),
            );
        let points = decoded
            .arrivals
            .iter()
            .map(|a| clock.layer(a.layer, a.bytes, a.at));
        report.layers.push((Stage::Arrivals, points.collect()));
        report.wire_bytes = decoded.arrivals.iter().map(|a| a.bytes as u64).sum();
        report.extra_ms = fan_out_first;
        let since_first_token = decoded.first_token.map(|t| t.elapsed());
        // A resumed attempt's first token also waited on the shown tokens: not a finish cost.
        if job.fan_out.is_empty() && !resumed {
            let from = decoded.arrivals.last().map_or(started, |a| a.at);
            self.observe_finish(&job, from, decoded.first_token);
        }
        let m = &self.metrics;
        // Counted before the record says done, so whoever saw it done sees the count.
        m.report(&report);
        m.decoded(&job.expert);
        for expert in outputs.keys() {
            m.decoded(expert);
        }
        let output = JobResult {
            tokens: half.tokens().to_vec(),
            stop: stop_name(&decoded.stop),
        };
        let mut ttft_ms = None;
        let done = write_final(&self.jobs, &self.id, id, &self.cancel, |j| {
            ttft_ms = half.finish(j, &report, &output, &outputs, since_first_token, now_ms())?;
            Ok(())
        })
        .await;
        if let Err(e) = done {
            tracing::warn!(job = %id, error = %e, "recording a finished job failed");
        }
        if let Some(t) = ttft_ms {
            let kind = JobKindLabels {
                mode: job.mode.to_string(),
                expert: job.expert.clone(),
            };
            m.ttft.get_or_create(&kind).observe(t / 1e3);
        }
        m.finished(Side::Consumer.name(), "done");
        if let Some(t) = &self.telemetry {
            let mut attrs = self.trace_attributes(&job);
            attrs.push(KeyValue::new("scd.tokens", output.tokens.len() as i64));
            t.record_report(&job.trace, &report, attrs);
        }
        if let Some(rx) = shadow_rx {
            self.shadow_check(&job, prompt, output.tokens, rx);
        }
    }

    /// A finished job's last step (`from` the last code's arrival, or the job's start, to its
    /// `first_token`) into this consumer's finish costs, advertised to the producers when they
    /// moved (in the background: the job's end does not wait on the node key's write).
    fn observe_finish(&self, job: &JobRecord, from: Instant, first_token: Option<Instant>) {
        let (Some(first), Some(request)) = (first_token, job.request.as_ref()) else {
            return;
        };
        let rows = request.prompt.len().saturating_sub(1);
        let secs = first.saturating_duration_since(from).as_secs_f64();
        let Some(costs) = self.finish_costs.observe(job.mode, rows, secs) else {
            return;
        };
        let registration = self.registration.clone();
        tokio::spawn(async move {
            let update = registration.update(|info| info.finish_ms_per_token = costs);
            if let Err(e) = update.await {
                tracing::debug!(error = %e, "advertising the finish costs failed");
            }
        });
    }

    /// The drift guard's check of a finished job, in the background: the expert's own prefill
    /// against the rebuilt cache over the tokens the job generated; the mean over recent
    /// checks goes to the metrics, and past the bound the live translator version is marked
    /// degraded in the store.
    fn shadow_check(
        &self,
        job: &JobRecord,
        prompt: Vec<u32>,
        output: Vec<u32>,
        rebuilt: tokio::sync::oneshot::Receiver<scd_models::KvCache>,
    ) {
        let (Some(hash), Some(model)) = (
            job.translator,
            self.served
                .experts
                .get(&job.expert)
                .and_then(|e| e.model.clone()),
        ) else {
            return;
        };
        let (id, expert) = (job.id, job.expert.clone());
        let registry =
            scd_scheduler::TranslatorRegistry::new(self.store.clone(), self.keys.clone());
        let (base, me) = (self.served.base_id.clone(), self.id.clone());
        let metrics = self.metrics.clone();
        let guard = self.drift.clone();
        tokio::spawn(async move {
            let Ok(cache) = rebuilt.await else { return };
            let Some((&last, prefix)) = prompt.split_last() else {
                return;
            };
            let prefix = prefix.to_vec();
            let kl = tokio::task::spawn_blocking(move || {
                crate::drift_guard::shadow_kl(&model, &prefix, last, &output, cache)
            })
            .await;
            let kl = match kl {
                Ok(Ok(kl)) => kl,
                Ok(Err(e)) => return tracing::warn!(job = %id, error = %e, "shadow check failed"),
                Err(e) => return tracing::warn!(job = %id, error = %e, "shadow check failed"),
            };
            let verdict = guard.record(&expert, hash, kl);
            metrics.shadow_check(&expert, hash, verdict.mean_kl);
            tracing::debug!(job = %id, kl, mean = verdict.mean_kl, "shadow check");
            if !verdict.degraded_now {
                return;
            }
            let mark = scd_scheduler::Degraded {
                shadow_kl: verdict.mean_kl,
                bound: guard.bound(),
                jobs: verdict.jobs as u32,
                by: me,
                at_ms: now_ms(),
            };
            match registry.mark_degraded(&base, &expert, hash, mark).await {
                Ok(true) => tracing::warn!(
                    %expert,
                    translator = %hash.short(),
                    mean_kl = verdict.mean_kl,
                    "translator marked degraded: its jobs run in a safer mode until another version is live"
                ),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(%expert, error = %e, "marking a translator degraded failed")
                }
            }
        });
    }

    /// Writes the tokens so far into the record of a job still decoding here.
    async fn progress(&self, half: &ConsumerHalf) {
        let job = half.attempt().job;
        if failpoints::silenced(&self.id) {
            return;
        }
        // The new tokens go into a small key of their own; the record (prompt and all) is
        // written only to move it to `decoding` and every few seconds to fold the batches in.
        let appended = self
            .jobs
            .append_output(job, half.tokens(), |j| half.attempt().holds(j))
            .await;
        let written = match appended {
            Ok(scd_scheduler::Appended::WriteTheRecord) => self
                .jobs
                .update(job, |j| half.progress(j, now_ms()))
                .await
                .map(drop),
            other => other.map(drop),
        };
        if let Err(e) = written {
            tracing::debug!(%job, error = %e, "recording progress failed");
        }
    }

    #[allow(clippy::type_complexity)]
    async fn consumer_job(
        &self,
        job: &JobRecord,
        expert: &str,
    ) -> Result<(ActorRef<DecoderMsg>, GenerateParams, JobCodec), Refusal> {
        let decoder = read(&self.actors)
            .decoders
            .get(expert)
            .cloned()
            .ok_or_else(|| Refusal::UnknownExpert(expert.to_string()))?;
        let request = self.check_request(job)?;
        let sampling = Sampling::from_params(request.temperature, request.top_p)
            .map_err(|e| Refusal::Sampling(e.to_string()))?;
        let params = GenerateParams {
            max_tokens: request.max_tokens as usize,
            sampling,
            seed: request.seed,
            stop_tokens: request.stop_tokens.clone(),
        };
        Ok((decoder, params, self.codec(job, expert).await?))
    }

    /// The job's codec for `expert` (the job's own, or one of its fan-out), with the translator
    /// version its record names (the current one for a record that names none: modes without
    /// a translator, or a record from before versions).
    async fn codec(&self, job: &JobRecord, expert: &str) -> Result<JobCodec, Refusal> {
        if !self.served.experts.contains_key(expert) {
            return Err(Refusal::UnknownExpert(expert.to_string()));
        }
        if job
            .request
            .as_ref()
            .is_some_and(|r| !r.documents.is_empty())
        {
            if job.mode != scd_scheduler::Mode::Oracle {
                return Err(Refusal::Codec(format!(
                    "a job with documents runs in mode oracle (the expert reads the prompt \
                     itself, after the documents' compiled caches), not {}",
                    job.mode
                )));
            }
            return Ok(JobCodec {
                codec: Arc::new(scd_models::codec::Documents),
                translator: None,
            });
        }
        let version = match job.translator {
            Some(hash) => self.translators.get(expert, hash).await,
            None => self.translators.current(expert),
        }
        .map_err(|e| Refusal::Translator(e.to_string()))?;
        let step = job.ranks.and_then(|c| c.step);
        let options = CodecOptions {
            ranks: job.ranks.map(|c| c.ranks).or(self.codec_options.ranks),
            tc_rate: step.map_or(self.codec_options.tc_rate, |step| TcRate { step }),
            ..self.codec_options
        };
        JobCodec::for_mode(
            job.mode,
            Some((&version.translator, version.index)),
            &options,
        )
        .map_err(|e| Refusal::Codec(e.to_string()))
    }

    fn check_request<'a>(&self, job: &'a JobRecord) -> Result<&'a JobRequest, Refusal> {
        let request = job.request.as_ref().ok_or(Refusal::NoRequest)?;
        check_prompt(&self.served, request)?;
        Ok(request)
    }

    /// Adds `ids` to the documents this node announces holding compiled (the newest kept past
    /// [`MAX_ANNOUNCED_DOCUMENTS`]).
    async fn announce_documents(&self, ids: &[String]) {
        let announced = self
            .registration
            .update(|info| {
                for id in ids {
                    if !info.documents.contains(id) {
                        info.documents.push(id.clone());
                    }
                }
                let over = info.documents.len().saturating_sub(MAX_ANNOUNCED_DOCUMENTS);
                info.documents.drain(..over);
            })
            .await;
        if let Err(e) = announced {
            tracing::warn!(error = %e, "announcing compiled documents failed");
        }
    }

    /// Carries out a half's ending: a hand-back or a failure written to the record (if it
    /// still runs the attempt this node worked on: one handed back meanwhile is someone
    /// else's now), or nothing.
    async fn carry_out(&self, attempt: &Attempt, action: Action) {
        let job = attempt.job;
        let side = attempt.side.name();
        let written = match action {
            Action::HandBack { reason, blame } => {
                tracing::warn!(%job, reason, "job handed back to the queue");
                self.metrics.finished(side, "handed_back");
                let now = now_ms();
                write_final(&self.jobs, &self.id, job, &self.cancel, |j| {
                    attempt.hand_back(j, &reason, blame, now)
                })
                .await
            }
            Action::Fail { reason } => {
                tracing::warn!(%job, reason, "job failed");
                self.metrics.finished(side, "failed");
                let now = now_ms();
                write_final(&self.jobs, &self.id, job, &self.cancel, |j| {
                    attempt.fail(j, &reason, now)
                })
                .await
            }
            other => {
                tracing::debug!(%job, side, action = ?other, "half ended");
                return;
            }
        };
        if let Err(e) = written {
            tracing::warn!(%job, error = %e, "recording the end of an attempt failed");
        }
    }
}

impl Work {
    /// The code ranks of a job's `reuse` / `scd` codes as `k=..,v=..,h=..`, for traces (`none`
    /// for other modes): the record's, else the translator version's defaults.
    fn ranks_name(&self, job: &JobRecord) -> String {
        if !job.mode.uses_translator_codes() {
            return "none".into();
        }
        let ranks = job.ranks.map(|c| c.ranks).or_else(|| {
            let version = match job.translator {
                Some(hash) => self.translators.find(&job.expert, hash),
                None => self.translators.current(&job.expert).ok(),
            };
            version.map(|v| v.translator.manifest.default_ranks)
        });
        match ranks {
            Some(r) => r.to_string(),
            None => "none".into(),
        }
    }

    /// Work waiting on this node among `jobs`: attempts assigned to it as producer that it
    /// has not started, and attempts it is the consumer of whose stream it has not taken yet.
    pub fn waiting<'a>(&self, jobs: impl Iterator<Item = &'a JobRecord>) -> (usize, usize) {
        let active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        let started = |j: &JobRecord, side| active.contains_key(&(j.id, j.attempts, side));
        let me = Some(self.id.as_str());
        let (mut producer, mut consumer) = (0, 0);
        for j in jobs {
            if j.state == JobState::Assigned
                && j.producer.as_deref() == me
                && !started(j, Side::Producer)
            {
                producer += 1;
            }
            if j.state.is_running() && j.consumer.as_deref() == me && !started(j, Side::Consumer) {
                consumer += 1;
            }
        }
        (producer, consumer)
    }
}

/// The one request check ([`JobRequest::check`]) against the base model this node serves.
pub(crate) fn check_prompt(served: &Served, request: &JobRequest) -> Result<(), Refusal> {
    let cfg = &served.config;
    let limits = scd_types::ModelLimits {
        context_length: cfg.context_length,
        vocab_size: cfg.vocab_size,
    };
    Ok(request.check(limits)?)
}

/// The translator version a job's codes are made with, for traces (`none` for modes without).
fn translator_name(job: &JobRecord) -> String {
    match (job.mode.needs_translator(), job.translator) {
        (true, Some(hash)) => hash.to_string(),
        _ => "none".into(),
    }
}

/// This process's monotonic clock placed on the wall clock for the record and the trace, read
/// once per report so that all its spans are placed alike and keep their order.
struct WallClock {
    now_ms: f64,
    now: Instant,
}

impl WallClock {
    fn now() -> Self {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        Self {
            now_ms,
            now: Instant::now(),
        }
    }

    fn ms(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.now) {
            Some(after) => self.now_ms + after.as_secs_f64() * 1e3,
            None => self.now_ms - self.now.duration_since(t).as_secs_f64() * 1e3,
        }
    }

    fn span(&self, start: Instant, end: Instant) -> StageSpan {
        StageSpan {
            start_ms: self.ms(start),
            end_ms: self.ms(end),
        }
    }

    /// One layer's codes at `at`.
    fn layer(&self, layer: u16, bytes: usize, at: Instant) -> LayerPoint {
        LayerPoint {
            layer,
            bytes,
            at_ms: self.ms(at),
        }
    }
}

/// The record's name of a stop reason.
pub fn stop_name(stop: &StopReason) -> String {
    match stop {
        StopReason::StopToken(t) => format!("stop_token:{t}"),
        StopReason::MaxTokens => "max_tokens".into(),
        StopReason::Cancelled => "cancelled".into(),
    }
}

/// Drives `work` from the job records: lists them, then follows every change.
pub(crate) async fn follow_jobs(work: Arc<Work>) {
    let prefix = work.keys.jobs_prefix();
    loop {
        let listing = tokio::select! {
            () = work.cancel.cancelled() => return,
            l = work.store.get_prefix(&prefix) => l,
        };
        let listing = match listing {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "reading the job records failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
        };
        work.metrics.cluster.clear();
        for kv in &listing.kvs {
            if let Ok(job) = scd_scheduler::envelope::decode::<JobRecord>(&kv.key, &kv.value) {
                work.metrics.cluster.put(&job);
                work.on_record(job);
            }
        }
        let mut watch = match work.store.watch_prefix(&prefix, listing.revision + 1).await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "watching the job records failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            let event = tokio::select! {
                () = work.cancel.cancelled() => return,
                e = watch.next() => e,
            };
            match event {
                Some(Ok(event)) if event.kind == scd_scheduler::store::EventKind::Put => {
                    match scd_scheduler::envelope::decode::<JobRecord>(
                        &event.kv.key,
                        &event.kv.value,
                    ) {
                        Ok(job) => {
                            work.metrics.cluster.put(&job);
                            work.on_record(job)
                        }
                        Err(e) => tracing::warn!(error = %e, "unreadable job record"),
                    }
                }
                // Archived or removed: gone from the live jobs the metrics count.
                Some(Ok(event)) => work.metrics.cluster.remove_key(&event.kv.key),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "the job watch failed; listing again");
                    break;
                }
                None => break,
            }
        }
    }
}

/// An open connection to a consumer node and the registration epoch of the incarnation it
/// reaches (`0`: unknown).
pub(crate) struct Link {
    epoch: u64,
    connection: Connection,
}

/// Whether a node known under epoch `have` is the incarnation `want` names; an unknown epoch
/// on either side (`0`, `None`: records from before epochs) matches.
fn same_incarnation(have: u64, want: Option<u64>) -> bool {
    match want {
        Some(want) => have == 0 || want == 0 || have == want,
        None => true,
    }
}

#[cfg(test)]
mod tests {
    //! Final writes against a store that refuses writes for a while (a wrapper over the
    //! embedded store; the real-etcd outage is `tests/failpoints/faults.rs`). Time is paused: the waits
    //! pass at once and the test reads the same on any machine.

    use std::time::Duration;

    use scd_scheduler::jobs::Blame;
    use scd_scheduler::store::HookedStore;
    use scd_scheduler::{EmbeddedStore, JobError as RecordError, Mode, NodeId, StoreError};
    use tokio::time::Instant;

    use super::*;

    /// A job in `decoding` on attempt 1 (p1 to c1), the consumer's [`Attempt`] of it, the
    /// store as everyone else sees it and the job store of a node behind an outage of
    /// `outage`.
    async fn decoding_job(outage: Duration) -> (JobId, Attempt, JobStore, JobStore) {
        let keys = Keys::new("/t");
        let inner: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let others = JobStore::new(inner.clone(), keys.clone());
        let id = JobId::from_u128(7);
        let mut job = JobRecord::new(id, "sotu", Mode::Raw, 3);
        job.assign(&NodeId::from_static("p1"), &NodeId::from_static("c1"), 1)
            .unwrap();
        for s in [
            JobState::Prefilling,
            JobState::Transferring,
            JobState::Decoding,
        ] {
            job.transition(s, 2).unwrap();
        }
        others.create(&job).await.unwrap();
        // Transactions fail as if etcd were away until then.
        let until = Instant::now() + outage;
        let away = Arc::new(HookedStore::new(inner).before_txn(move || async move {
            match Instant::now() < until {
                true => Err(StoreError::Timeout {
                    op: "txn",
                    after: Duration::from_secs(1),
                }),
                false => Ok(()),
            }
        }));
        let attempt = Attempt {
            job: id,
            attempt: 1,
            side: Side::Consumer,
            node: "c1".into(),
        };
        (id, attempt, others, JobStore::new(away, keys))
    }

    /// A minute-long outage outlasts the job store's own patience (about 13 s); the hand-back
    /// is kept and lands once the store is back.
    #[tokio::test(start_paused = true)]
    async fn a_final_write_outlasts_a_long_outage() {
        let (id, attempt, others, node) = decoding_job(Duration::from_secs(60)).await;
        let stop = CancellationToken::new();
        // What the node's job store alone does: it gives up.
        let dropped = node
            .update(id, |j| {
                attempt.hand_back(j, "consumer c1: gone", Blame::Consumer, 3)
            })
            .await;
        assert!(matches!(dropped, Err(RecordError::Store(_))), "{dropped:?}");
        let started = Instant::now();
        let landed = write_final(&node, "c1", id, &stop, |j| {
            attempt.hand_back(j, "consumer c1: gone", Blame::Consumer, 3)
        })
        .await
        .unwrap();
        assert!(started.elapsed() > Duration::ZERO);
        assert_eq!(landed.state, JobState::Queued);
        let stored = others.get(id).await.unwrap().unwrap();
        assert_eq!(
            (stored.state, stored.failed_consumers),
            (JobState::Queued, vec![NodeId::from_static("c1")])
        );
    }

    /// While the node cannot write, the scheduler hands the attempt to another one; the node's
    /// late write then finds the attempt fenced and changes nothing.
    #[tokio::test(start_paused = true)]
    async fn a_late_final_write_leaves_a_newer_attempt_alone() {
        let (id, attempt, others, node) = decoding_job(Duration::from_secs(60)).await;
        others
            .update(id, |j| {
                j.retry("attempt 1 passed its deadline", Blame::Consumer, 4)?;
                j.assign(&NodeId::from_static("p1"), &NodeId::from_static("c2"), 5)
            })
            .await
            .unwrap();
        let newer = others.get(id).await.unwrap().unwrap();
        let stop = CancellationToken::new();
        let tokens = JobResult {
            tokens: vec![1, 2, 3],
            stop: "length".into(),
        };
        let landed = write_final(&node, "c1", id, &stop, |j| {
            if attempt.holds(j) {
                j.output = Some(tokens.clone());
                j.transition(JobState::Done, 6)?;
            }
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(landed, newer);
        assert_eq!(others.get(id).await.unwrap().unwrap(), newer);
    }

    /// A node shutting down stops trying; the scheduler's attempt deadline ends the attempt.
    #[tokio::test(start_paused = true)]
    async fn a_stopped_node_stops_trying() {
        let (id, attempt, others, node) = decoding_job(Duration::from_secs(24 * 3600)).await;
        let stop = CancellationToken::new();
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(120)).await;
            stopper.cancel();
        });
        let given_up = write_final(&node, "c1", id, &stop, |j| attempt.fail(j, "why", 3)).await;
        assert!(
            matches!(given_up, Err(RecordError::Store(_))),
            "{given_up:?}"
        );
        assert_eq!(
            others.get(id).await.unwrap().unwrap().state,
            JobState::Decoding
        );
    }

    /// An error that waiting does not cure is not retried.
    #[tokio::test(start_paused = true)]
    async fn a_hopeless_final_write_is_not_retried() {
        let (_, attempt, _, node) = decoding_job(Duration::ZERO).await;
        let stop = CancellationToken::new();
        let missing = JobId::from_u128(8);
        let result = write_final(&node, "c1", missing, &stop, |j| attempt.fail(j, "why", 3)).await;
        assert!(
            matches!(result, Err(RecordError::NotFound(_))),
            "{result:?}"
        );
    }

    #[test]
    fn a_link_serves_only_the_incarnation_the_job_names() {
        assert!(same_incarnation(7, Some(7)));
        assert!(
            !same_incarnation(7, Some(8)),
            "a restarted node is another link"
        );
        assert!(same_incarnation(7, None));
        assert!(same_incarnation(0, Some(8)));
        assert!(same_incarnation(7, Some(0)));
    }
}
