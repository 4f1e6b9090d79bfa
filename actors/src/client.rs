//! Submitting jobs to a cluster and following them through the store: what an admin endpoint,
//! the HTTP gateway and the in-process demo do on a user's behalf. A submission is a job record
//! (`queued`, carrying the request); the scheduler assigns it, the nodes work on it, and the
//! record ends `done` with the tokens or `failed` with the reason.

use std::sync::Arc;
use std::time::Duration;

use scd_scheduler::jobs::JobError as RecordError;
use scd_scheduler::{
    JobId, JobRecord, JobRequest, JobStore, Keys, MetaStore, Mode, NodeMap, StoreError,
    TraceContext,
};

/// Attempts a job gets (a producer or consumer lost mid-job costs one) unless the caller says.
pub const DEFAULT_ATTEMPTS: u32 = 3;

/// Why a submission or a wait failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No live node decodes the expert.
    #[error("no consumer serves expert {expert}: start a node with the consumer role and that expert (experts[] in its config){known}")]
    NoConsumer {
        /// The expert asked for.
        expert: String,
        /// The experts that are served, for the message.
        known: String,
    },
    /// No live node prefills the expert's base model.
    #[error(
        "no producer serves expert {expert}: start a node with the producer role and base {base}"
    )]
    NoProducer {
        /// The expert asked for.
        expert: String,
        /// Its base model.
        base: String,
    },
    /// The cluster holds its limit of unfinished jobs: nothing was created; try again after
    /// the hint.
    #[error(transparent)]
    Busy(scd_scheduler::Busy),
    /// A fan-out that cannot run as asked.
    #[error("fan-out to {experts}: {reason}")]
    FanOut {
        /// The experts asked for.
        experts: String,
        /// Why not, and what would do.
        reason: String,
    },
    /// Documents a job cannot be given as asked.
    #[error("documents: {0}")]
    Documents(String),
    /// The prompt cannot be a job.
    #[error(transparent)]
    Request(#[from] scd_types::RequestError),
    /// Reading or writing the job record failed.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The store failed.
    #[error("cluster store: {0}")]
    Store(#[from] StoreError),
    /// The job vanished (swept, or the store was wiped).
    #[error("job {0} is gone from the store")]
    Gone(JobId),
    /// The client's own task failed.
    #[error("following the job failed: {0}")]
    Internal(String),
    /// The job did not finish in time.
    #[error("job {id} did not finish within {after:?}; it is {state} (attempt {attempt}, producer {producer}, consumer {consumer})")]
    Timeout {
        /// The job.
        id: JobId,
        /// How long the caller waited.
        after: Duration,
        /// Where it was.
        state: scd_scheduler::JobState,
        /// Its attempt then.
        attempt: u32,
        /// The attempt's producer node (`none` before one is assigned).
        producer: String,
        /// The attempt's consumer node (`none` before one is assigned).
        consumer: String,
    },
}

/// A client of one cluster's store.
#[derive(Clone)]
pub struct ClusterClient {
    store: Arc<dyn MetaStore>,
    keys: Keys,
    jobs: JobStore,
}

impl ClusterClient {
    /// A client of the cluster under `keys` in `store`.
    pub fn new(store: Arc<dyn MetaStore>, keys: Keys) -> Self {
        let jobs = JobStore::new(store.clone(), keys.clone());
        Self { store, keys, jobs }
    }

    /// The live nodes now.
    pub async fn nodes(&self) -> Result<NodeMap, ClientError> {
        let listing = self.store.get_prefix(&self.keys.nodes_prefix()).await?;
        let mut nodes = NodeMap::new();
        for kv in listing.kvs {
            if let Ok(info) =
                scd_scheduler::envelope::decode::<scd_scheduler::NodeInfo>(&kv.key, &kv.value)
            {
                nodes.insert(info.id.clone(), info);
            }
        }
        Ok(nodes)
    }

    /// Queues a job for `expert` in `mode`; its id. Refused at once when no live node decodes
    /// the expert (the job would only wait).
    pub async fn submit(
        &self,
        expert: &str,
        mode: Mode,
        request: JobRequest,
    ) -> Result<JobId, ClientError> {
        let id = JobId::random();
        self.submit_as(id, expert, mode, request, TraceContext::new())
            .await?;
        Ok(id)
    }

    /// [`ClusterClient::submit`] under the caller's job id (a client that retries a submit
    /// learns from [`RecordError::AlreadyExists`] that the first one landed), carrying the
    /// caller's trace context.
    pub async fn submit_as(
        &self,
        id: JobId,
        expert: &str,
        mode: Mode,
        request: JobRequest,
        trace: TraceContext,
    ) -> Result<(), ClientError> {
        self.submit_fan_out(id, &[expert.to_string()], mode, request, trace)
            .await
    }

    /// [`ClusterClient::submit_as`] for several experts of one base at once (a fan-out): one
    /// prefill and one code stream to a consumer node hosting them all, which decodes each.
    /// Modes whose codes do not depend on the expert (raw, q4, droidspeak, oracle) fan out to
    /// any experts of the base; `reuse` and `scd` need the experts' live translators to be one
    /// joint translator (`scd calibrate` with a `--consumer-adapter` for each).
    pub async fn submit_fan_out(
        &self,
        id: JobId,
        experts: &[String],
        mode: Mode,
        request: JobRequest,
        trace: TraceContext,
    ) -> Result<(), ClientError> {
        let Some((expert, more)) = experts.split_first() else {
            return Err(ClientError::FanOut {
                experts: String::new(),
                reason: "no expert named".into(),
            });
        };
        let expert = expert.as_str();
        request.check_shape()?;
        let nodes = self.nodes().await?;
        // Auto is resolved by the producer for a single expert's job; the two kinds of job
        // whose mode follows from what they are are resolved here.
        let (mode, choice) = match mode {
            Mode::Auto if !request.documents.is_empty() => (
                Mode::Oracle,
                Some("a job with documents runs in mode oracle".to_string()),
            ),
            Mode::Auto if !more.is_empty() => {
                let (mode, why) = self.auto_fan_out(experts, &nodes).await;
                (mode, Some(why))
            }
            m => (m, None),
        };
        let checked = choice.is_some() && mode == Mode::Scd; // an auto fan-out, just now
        if !more.is_empty() && !checked {
            self.check_fan_out(experts, mode, &nodes).await?;
        }
        if !nodes
            .values()
            .any(|n| n.consumer_models.iter().any(|m| m == expert))
        {
            let mut served: Vec<&str> = nodes
                .values()
                .flat_map(|n| n.consumer_models.iter().map(String::as_str))
                .collect();
            served.sort_unstable();
            served.dedup();
            let known = if served.is_empty() {
                String::from("; no node serves any expert now")
            } else {
                format!("; served now: {}", served.join(", "))
            };
            return Err(ClientError::NoConsumer {
                expert: expert.to_owned(),
                known,
            });
        }
        // The prompt's prefix blocks, hashed as producers hash what they cache (under the
        // expert's base model), so that the scheduler can send it where its prefix is.
        let base = scd_scheduler::ModelRegistry::new(self.store.clone(), self.keys.clone())
            .get(expert)
            .await
            .ok()
            .flatten()
            .and_then(|r| r.base);
        if let Some(base) = &base {
            if !nodes
                .values()
                .any(|n| n.producer_models.iter().any(|m| m == base))
            {
                return Err(ClientError::NoProducer {
                    expert: expert.to_owned(),
                    base: base.clone(),
                });
            }
        }
        if !request.documents.is_empty() {
            self.check_documents(base.as_deref(), mode, &request.documents, &nodes)
                .await?;
        }
        let prefix_hashes = match base {
            Some(base) => scd_scheduler::prefix::block_hashes(
                &base,
                &request.prompt[..request.prompt.len() - 1],
                scd_scheduler::prefix::DEFAULT_BLOCK_TOKENS,
            ),
            None => Vec::new(),
        };
        let mut record = JobRecord::new(id, expert, mode, DEFAULT_ATTEMPTS)
            .with_fan_out(more.to_vec())
            .with_request(request)
            .with_trace(trace);
        record.prefix_hashes = prefix_hashes;
        record.mode_choice = choice.map(|why| scd_scheduler::ModeChoice::fixed(mode, &why));
        match self.jobs.create_admitted(&record).await {
            Err(RecordError::Busy(busy)) => Err(ClientError::Busy(busy)),
            other => Ok(other?),
        }
    }

    /// Auto for a fan-out. Its producer does not plan it (one prefill serves experts whose
    /// speeds and links differ), so the choice is by quality alone: codes where the experts
    /// share a joint translator; else raw where every expert's measured raw KL (the drift
    /// reports its consumers advertise) is under the default ceiling; else each expert
    /// prefills itself, the only mode left that is right for all of them.
    async fn auto_fan_out(&self, experts: &[String], nodes: &NodeMap) -> (Mode, String) {
        const NOT_PLANNED: &str = "a fan-out is chosen by quality, not planned";
        if self.check_fan_out(experts, Mode::Scd, nodes).await.is_ok() {
            return (
                Mode::Scd,
                format!("{NOT_PLANNED}; the experts share a joint translator"),
            );
        }
        let ceiling = scd_models::translator::RankPolicy::default().kl_ceiling;
        let raw_kl = |expert: &str| {
            nodes
                .values()
                .filter_map(|n| n.transfer_kl.get(expert)?.get(&Mode::Raw).copied())
                .reduce(f64::max)
        };
        let over: Vec<&str> = experts
            .iter()
            .map(String::as_str)
            .filter(|e| raw_kl(e).is_none_or(|kl| kl > ceiling))
            .collect();
        if over.is_empty() {
            (
                Mode::Raw,
                format!(
                    "{NOT_PLANNED}; no joint translator, raw's KL under {ceiling} for every expert"
                ),
            )
        } else {
            (
                Mode::Oracle,
                format!(
                    "{NOT_PLANNED}; no joint translator, raw's KL over {ceiling} or not measured for {}",
                    over.join(", ")
                ),
            )
        }
    }

    /// Refuses documents a job cannot have: a mode other than oracle (the expert reads the
    /// prompt itself after the documents' compiled caches), an id the cluster does not know or
    /// knows for another base, or no producer of the base that serves documents.
    async fn check_documents(
        &self,
        base: Option<&str>,
        mode: Mode,
        ids: &[String],
        nodes: &NodeMap,
    ) -> Result<(), ClientError> {
        let refuse = |m: String| Err(ClientError::Documents(m));
        if mode != Mode::Oracle {
            return refuse(format!(
                "a job with documents runs in mode oracle: the expert reads the prompt itself, \
                 after the documents' compiled caches (asked: {mode})"
            ));
        }
        let registry = scd_scheduler::DocumentRegistry::new(self.store.clone(), self.keys.clone());
        for id in ids {
            let record = match registry.get(id).await {
                Ok(r) => r,
                Err(scd_scheduler::DocumentError::InvalidId(_)) => {
                    return refuse(format!("{id:?} is not a document id (32 hex digits)"))
                }
                Err(e) => return refuse(format!("reading document {id}: {e}")),
            };
            match (record, base) {
                (None, _) => {
                    return refuse(format!("no document {id}: add it with `scd docs add`"))
                }
                (Some(r), Some(b)) if r.base != b => {
                    return refuse(format!(
                        "document {id} was tokenised for base {}, the expert's base is {b}",
                        r.base
                    ))
                }
                _ => {}
            }
        }
        let serves = |n: &scd_scheduler::NodeInfo| {
            n.document_writer.is_some()
                && base.is_none_or(|b| n.producer_models.iter().any(|m| m == b))
        };
        if !nodes.values().any(serves) {
            return refuse(format!(
                "no producer{} serves documents: add a [documents] section to a producer's config",
                base.map(|b| format!(" of base {b}")).unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// Refuses a fan-out that cannot run: an expert named twice, experts of different bases, no
    /// node hosting them all, or (`reuse`, `scd`) live translators that are not one joint one.
    async fn check_fan_out(
        &self,
        experts: &[String],
        mode: Mode,
        nodes: &scd_scheduler::NodeMap,
    ) -> Result<(), ClientError> {
        let refuse = |reason: String| ClientError::FanOut {
            experts: experts.join(", "),
            reason,
        };
        let mut seen = std::collections::BTreeSet::new();
        if let Some(twice) = experts.iter().find(|e| !seen.insert(e.as_str())) {
            return Err(refuse(format!("{twice} is named twice")));
        }
        let models = scd_scheduler::ModelRegistry::new(self.store.clone(), self.keys.clone());
        let mut bases = Vec::new();
        for e in experts {
            let base = models.get(e).await.ok().flatten().and_then(|r| r.base);
            bases.push(base.ok_or_else(|| refuse(format!("{e} has no base model on record")))?);
        }
        if bases.iter().any(|b| b != &bases[0]) {
            return Err(refuse(format!(
                "the experts have different bases ({}): one prefill serves experts of one base",
                bases.join(", ")
            )));
        }
        if scd_scheduler::choose_consumer(experts, nodes, &[]).is_none() {
            return Err(refuse(
                "no consumer node hosts all of them: list them all in one node's [[experts]]"
                    .into(),
            ));
        }
        if mode.codes_tied_to_translator() {
            let registry =
                scd_scheduler::TranslatorRegistry::new(self.store.clone(), self.keys.clone());
            let mut live = Vec::new();
            for e in experts {
                let active = registry.active(&bases[0], e).await.ok().flatten();
                live.push(active.map(|a| a.content_hash));
            }
            if live[0].is_none() || live.iter().any(|h| h != &live[0]) {
                return Err(refuse(format!(
                    "mode {mode} sends one code stream, so the experts' live translators must be \
                     one joint translator (scd calibrate with a --consumer-adapter for each, set \
                     as every one's translator); raw, q4, q2, droidspeak and oracle fan out without"
                )));
            }
        }
        Ok(())
    }

    /// The job's record now.
    pub async fn get(&self, id: JobId) -> Result<JobRecord, ClientError> {
        self.jobs.get(id).await?.ok_or(ClientError::Gone(id))
    }

    /// Cancels a job.
    pub async fn cancel(&self, id: JobId, reason: &str) -> Result<JobRecord, ClientError> {
        Ok(self.jobs.cancel(id, reason).await?)
    }

    /// Waits until the job is done, failed or cancelled (or `timeout` passes); its record.
    pub async fn wait(&self, id: JobId, timeout: Duration) -> Result<JobRecord, ClientError> {
        let key = self.keys.job(id);
        let wait = async {
            loop {
                let Some(kv) = self.store.get(&key).await? else {
                    // A finished job's record moves to the archive after a while.
                    return match self.jobs.get(id).await? {
                        Some(job) if job.state.is_finished() => Ok(job),
                        _ => Err(ClientError::Gone(id)),
                    };
                };
                let job: JobRecord = scd_scheduler::envelope::decode(&kv.key, &kv.value)
                    .map_err(RecordError::from)?;
                if job.state.is_finished() {
                    return Ok(job);
                }
                let mut watch = self.store.watch_prefix(&key, kv.mod_revision + 1).await?;
                // Any change (or the watch ending) means: read the record again.
                let _ = watch.next().await;
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(r) => r,
            Err(_) => {
                let job = self.get(id).await?;
                let node =
                    |n: Option<scd_types::NodeId>| n.map_or_else(|| "none".into(), String::from);
                Err(ClientError::Timeout {
                    id,
                    after: timeout,
                    state: job.state,
                    attempt: job.attempts,
                    producer: node(job.producer),
                    consumer: node(job.consumer),
                })
            }
        }
    }

    /// Calls `on_change` with the job's record as it is now and again after each change
    /// (the output its consumer appends included), until it is done, failed or cancelled; the
    /// final record.
    pub async fn follow(
        &self,
        id: JobId,
        mut on_change: impl FnMut(&JobRecord),
    ) -> Result<JobRecord, ClientError> {
        let mut last: Option<JobRecord> = None;
        loop {
            // Watch first, then read: whatever changes after the read wakes a watch. The
            // record and the output appended beside it are two prefixes.
            let mut records = self.store.watch_prefix(&self.keys.job(id), 0).await?;
            let mut appended = self
                .store
                .watch_prefix(&self.keys.job_progress(id), 0)
                .await?;
            loop {
                // A finished job's record moves to the archive after a while; `get` reads it
                // there.
                let job = self.jobs.get(id).await?.ok_or(ClientError::Gone(id))?;
                if last.as_ref() != Some(&job) {
                    on_change(&job);
                }
                if job.state.is_finished() {
                    return Ok(job);
                }
                last = Some(job);
                let event = tokio::select! {
                    e = records.next() => e,
                    e = appended.next() => e,
                };
                match event {
                    // Any change means: read the job again.
                    Some(Ok(_)) => {}
                    // A broken watch: watch anew.
                    Some(Err(_)) | None => break,
                }
            }
        }
    }
}
