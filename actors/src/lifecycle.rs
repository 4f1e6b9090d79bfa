//! A job's life on a node as decisions without I/O: whether a record or a stream is this node's
//! work, and, for each half of an attempt ([`ProducerHalf`], [`ConsumerHalf`]), what to do next
//! given what just happened: claim, start, write progress, write the report, hand the attempt
//! back with its blame, fail it, wait for the record, or stop. The record changes themselves
//! ([`Attempt::hand_back`], [`ProducerHalf::claim`], ...) are pure functions over a
//! [`JobRecord`], applied by the caller as one compare-and-swap.
//!
//! The node's async driver (`node::jobs`) feeds every event it sees here and carries out the
//! action it gets back; it decides nothing itself. That keeps the rules testable without a
//! runtime, a store or a socket (the tests below), as `scd_transport::session` does for the job
//! stream.

use std::time::{Duration, Instant};

use scd_scheduler::jobs::Blame;
use scd_scheduler::{JobError as RecordError, JobRecord, JobResult, JobState};
use scd_types::{JobId, JobReport, Side};

use crate::job::JobError;

/// How often a decoding job's tokens so far are written to its record (the first at once).
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// How long a producer whose stream the consumer stopped waits for the consumer to record why
/// before it hands the attempt back (a consumer records within milliseconds; this only delays
/// the retry of a job whose consumer never took it).
pub const CONSUMER_GRACE: Duration = Duration::from_secs(10);

/// The first wait before a final write that did not land is tried again ([`retry_final_write`]).
pub const FINAL_WRITE_FIRST_WAIT: Duration = Duration::from_millis(250);

/// The longest wait between two tries of a final write.
pub const FINAL_WRITE_MAX_WAIT: Duration = Duration::from_secs(5);

/// Whether a half's final write (its report, a hand-back, a failure) that failed with `error`
/// after `failures` failed tries is tried again, and after how long: while the store is away
/// or contended the write is kept (doubling waits from [`FINAL_WRITE_FIRST_WAIT`], at most
/// [`FINAL_WRITE_MAX_WAIT`]) until it lands; an error that waiting does not cure (no such
/// record, an unreadable one, a change the state machine refuses) ends it. A write that finds
/// the attempt fenced (handed to a newer attempt, or ended) changes nothing and lands at once,
/// so retrying never writes over someone else's attempt.
pub fn retry_final_write(error: &RecordError, failures: u32) -> Option<Duration> {
    let curable = match error {
        RecordError::Store(e) => e.is_transient(),
        RecordError::Contention { .. } => true,
        _ => false,
    };
    curable.then(|| {
        FINAL_WRITE_FIRST_WAIT
            .saturating_mul(1 << failures.min(8))
            .min(FINAL_WRITE_MAX_WAIT)
    })
}

/// Why a job's half could not start on this node.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The record carries no request.
    #[error("the job record has no request (prompt and generation settings)")]
    NoRequest,
    /// The request fails the one request check ([`scd_types::JobRequest::check`]).
    #[error(transparent)]
    Request(#[from] scd_types::RequestError),
    /// The job names an expert this node does not serve.
    #[error("this node does not serve expert {0}")]
    UnknownExpert(String),
    /// Temperature or top-p out of range.
    #[error("bad sampling settings: {0}")]
    Sampling(String),
    /// No codec for the job's mode.
    #[error("no codec: {0}")]
    Codec(String),
    /// The translator version the job names cannot be had.
    #[error("{0}")]
    Translator(String),
    /// The job's consumer is not registered.
    #[error("consumer node {0} is not in the cluster")]
    ConsumerGone(String),
    /// The job's consumer could not be reached.
    #[error("connecting to consumer node {node}: {error}")]
    Connect {
        /// The consumer node.
        node: String,
        /// Why.
        error: String,
    },
    /// The job names a document nobody added.
    #[error("no document {0} in the cluster (add it with `scd docs add`)")]
    UnknownDocument(String),
    /// The job's documents could not be read.
    #[error("reading the job's documents: {0}")]
    Documents(String),
    /// The consumer's cache memory (`[limits] kv_mib`) has no room for the job.
    #[error(transparent)]
    Kv(#[from] crate::kv_budget::KvRefusal),
}

impl Refusal {
    /// Whether the refusal is the consumer's, not the job's: another attempt goes to another
    /// consumer.
    fn consumer_lost(&self) -> bool {
        matches!(self, Refusal::ConsumerGone(_) | Refusal::Connect { .. })
    }
}

/// What a node does about a job record as it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordAction {
    /// Stop local work on the job's attempts up to `through` (it was cancelled, failed, or
    /// sent back to the queue). Later attempts are left alone: a node's view of the records
    /// lags the streams producers open to it, so a consumer can be decoding attempt 2 when
    /// attempt 1's requeue reaches it.
    CancelLocal {
        /// The newest attempt the record ends.
        through: u32,
    },
    /// Start the producer half of the record's attempt.
    StartProducer,
    /// Nothing.
    Ignore,
}

impl RecordAction {
    /// Whether this action stops local work on `attempt` of the record's job.
    pub fn ends(&self, attempt: u32) -> bool {
        matches!(*self, RecordAction::CancelLocal { through } if attempt <= through)
    }
}

/// What node `me` does about `record` (`producer_role`: it prefills; `draining`: it takes no
/// new work).
pub fn on_record(
    record: &JobRecord,
    me: &str,
    producer_role: bool,
    draining: bool,
) -> RecordAction {
    match record.state {
        JobState::Queued | JobState::Failed | JobState::Cancelled => RecordAction::CancelLocal {
            through: record.attempts,
        },
        JobState::Assigned
            if record.producer.as_deref() == Some(me) && producer_role && !draining =>
        {
            RecordAction::StartProducer
        }
        _ => RecordAction::Ignore,
    }
}

/// Whether a job stream from producer node `peer` is node `me`'s to decode: the attempt to
/// decode, or why the stream is refused (sent to the producer as the stream's cancel reason).
pub fn admit_stream(record: Option<&JobRecord>, me: &str, peer: &str) -> Result<u32, &'static str> {
    let Some(job) = record else {
        return Err("no such job");
    };
    let ours = job.consumer.as_deref() == Some(me)
        && job.producer.as_deref() == Some(peer)
        && job.state.is_running();
    match ours {
        true => Ok(job.attempts),
        false => Err("this node is not the job's consumer, or the sender not its producer"),
    }
}

/// One attempt of a job, as one node's half works on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The job.
    pub job: JobId,
    /// Which attempt (the record's `attempts` when this half started).
    pub attempt: u32,
    /// Which half.
    pub side: Side,
    /// This node.
    pub node: String,
}

impl Attempt {
    /// Whether `j` still runs this attempt (not finished, not handed to another attempt).
    pub fn holds(&self, j: &JobRecord) -> bool {
        j.state.is_running() && j.attempts == self.attempt
    }

    /// A reason as the record shows it: `producer <node>: <cause>`.
    pub fn reason(&self, cause: impl std::fmt::Display) -> String {
        format!("{} {}: {cause}", self.side.name(), self.node)
    }

    /// Sends the job back to the queue with `reason` and `blame`, if `j` still runs this
    /// attempt (otherwise it is someone else's now, and nothing changes).
    pub fn hand_back(
        &self,
        j: &mut JobRecord,
        reason: &str,
        blame: Blame,
        now_ms: u64,
    ) -> Result<(), RecordError> {
        match self.holds(j) {
            true => j.retry(reason, blame, now_ms),
            false => Ok(()),
        }
    }

    /// Fails the job with `reason`, if `j` still runs this attempt.
    pub fn fail(&self, j: &mut JobRecord, reason: &str, now_ms: u64) -> Result<(), RecordError> {
        match self.holds(j) {
            true => j.fail(reason, now_ms),
            false => Ok(()),
        }
    }
}

/// What a half does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Claim the attempt on the record (producer: `assigned` to `prefilling`, by
    /// compare-and-swap with [`ProducerHalf::claim`]).
    Claim,
    /// Start the half's stages (producer: open the link to the consumer, prefill, encode,
    /// send; consumer: attach the stream, rebuild, decode).
    Start,
    /// Write the tokens so far into the record ([`ConsumerHalf::progress`]).
    WriteProgress,
    /// Nothing now: wait for the next event.
    Continue,
    /// Write the half's report (timings, bytes, and for the consumer its answer) into the
    /// record, the metrics and the trace.
    Report,
    /// Give the attempt back to the queue ([`Attempt::hand_back`]).
    HandBack {
        /// Why, as the record shows it.
        reason: String,
        /// Whose fault.
        blame: Blame,
    },
    /// Fail the job ([`Attempt::fail`]); a consumer that holds the stream refuses it too.
    Fail {
        /// Why, as the record shows it.
        reason: String,
    },
    /// Wait up to this long for the record to end the attempt ([`ProducerEvent::AttemptEnded`]),
    /// else [`ProducerEvent::GraceElapsed`].
    AwaitRecord(Duration),
    /// Nothing more to do on this node: the half is over.
    Stop,
}

/// Where a half is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Producer: claiming the attempt on the record.
    Claiming,
    /// Starting its stages.
    Starting,
    /// Its stages run.
    Running,
    /// Producer: its stream was stopped by the consumer; waiting for the record to say why.
    AwaitingRecord,
    /// Over.
    Ended,
}

/// What happens to a producer half.
#[derive(Debug)]
pub enum ProducerEvent<'a> {
    /// The claim was written; the record as it is after it (`None`: the store refused the
    /// write).
    Claimed(Option<&'a JobRecord>),
    /// The stages could not start.
    Refused(&'a Refusal),
    /// The stages started.
    Started,
    /// The stages finished: every code was sent.
    Finished,
    /// A stage failed; `stopped`: the attempt was stopped from outside first (cancelled by its
    /// user, ended on the record, the node shutting down).
    Failed {
        /// The cause.
        error: &'a JobError,
        /// Whether the attempt was stopped from outside.
        stopped: bool,
    },
    /// While waiting: the record ended the attempt.
    AttemptEnded,
    /// While waiting: the grace passed and the record still runs the attempt.
    GraceElapsed,
}

/// The producer half of one attempt: claim, start, and what an ending means.
#[derive(Debug)]
pub struct ProducerHalf {
    attempt: Attempt,
    phase: Phase,
    /// While waiting for the record: the stream's end, the reason of a hand-back after the grace.
    stream_end: Option<String>,
}

impl ProducerHalf {
    /// The producer half of `job`'s attempt `attempt` on node `node`, and its first action
    /// ([`Action::Claim`]).
    pub fn new(job: JobId, attempt: u32, node: &str) -> (Self, Action) {
        let half = Self {
            attempt: Attempt {
                job,
                attempt,
                side: Side::Producer,
                node: node.to_owned(),
            },
            phase: Phase::Claiming,
            stream_end: None,
        };
        (half, Action::Claim)
    }

    /// The attempt.
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// Where it is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The claim as a record change: `assigned` to `prefilling` if the record is still this
    /// node's attempt, with the translator version and ranks the codes will be made with.
    /// A record that is no longer `assigned` to it is left alone (including one this node
    /// claimed already, whose answer was lost: [`ProducerEvent::Claimed`] takes that as
    /// claimed).
    pub fn claim(
        &self,
        j: &mut JobRecord,
        translator: Option<scd_types::TranslatorHash>,
        ranks: Option<scd_scheduler::RanksChoice>,
        mode: Option<scd_scheduler::ModeChoice>,
        now_ms: u64,
    ) -> Result<(), RecordError> {
        let ours = j.state == JobState::Assigned
            && j.attempts == self.attempt.attempt
            && j.producer.as_deref() == Some(self.attempt.node.as_str());
        if ours {
            j.transition(JobState::Prefilling, now_ms)?;
            j.translator = translator;
            j.ranks = ranks;
            if let Some(choice) = mode {
                j.mode = choice.chosen;
                j.mode_choice = Some(choice);
            }
        }
        Ok(())
    }

    /// The producer's report as a record change: its timings and bytes (written by the
    /// caller's `extra`), then `prefilling` to `transferring` if the record still runs this
    /// attempt there.
    pub fn report(
        &self,
        j: &mut JobRecord,
        report: &JobReport,
        now_ms: u64,
        extra: impl FnOnce(&mut JobRecord),
    ) -> Result<(), RecordError> {
        write_report(j, report);
        extra(j);
        if j.state == JobState::Prefilling && j.attempts == self.attempt.attempt {
            j.transition(JobState::Transferring, now_ms)?;
        }
        Ok(())
    }

    /// The next action after `event`.
    pub fn handle(&mut self, event: ProducerEvent<'_>) -> Action {
        let action = match (self.phase, event) {
            (Phase::Claiming, ProducerEvent::Claimed(Some(j)))
                if j.state == JobState::Prefilling && j.attempts == self.attempt.attempt =>
            {
                self.phase = Phase::Starting;
                return Action::Start;
            }
            // Someone else's now, or the store would not take the claim: the scheduler
            // reassigns an attempt nobody claims.
            (Phase::Claiming, ProducerEvent::Claimed(_)) => Action::Stop,
            (Phase::Starting, ProducerEvent::Refused(refusal)) => {
                let reason = self.attempt.reason(refusal);
                match refusal.consumer_lost() {
                    true => Action::HandBack {
                        reason,
                        blame: Blame::Consumer,
                    },
                    false => Action::Fail { reason },
                }
            }
            (Phase::Starting, ProducerEvent::Started) => {
                self.phase = Phase::Running;
                return Action::Continue;
            }
            (Phase::Running, ProducerEvent::Finished) => Action::Report,
            (Phase::Running, ProducerEvent::Failed { error, stopped }) => {
                let reason = self.attempt.reason(error);
                if error.is_knock_on() && stopped {
                    Action::Stop
                } else if error.is_knock_on() {
                    // The consumer stopped the stream and nobody stopped the job. A consumer
                    // that took the job records why, which ends the attempt; one that never
                    // took it (busy, shutting down, unable to read the record) records
                    // nothing, and after the grace the attempt runs again.
                    self.phase = Phase::AwaitingRecord;
                    self.stream_end = Some(reason);
                    return Action::AwaitRecord(CONSUMER_GRACE);
                } else if matches!(error, JobError::ActorGone(_)) {
                    Action::HandBack {
                        reason,
                        blame: Blame::Nobody,
                    }
                } else if error.consumer_lost() {
                    Action::HandBack {
                        reason,
                        blame: Blame::Consumer,
                    }
                } else {
                    Action::Fail { reason }
                }
            }
            (Phase::AwaitingRecord, ProducerEvent::AttemptEnded) => Action::Stop,
            (Phase::AwaitingRecord, ProducerEvent::GraceElapsed) => Action::HandBack {
                reason: self.stream_end.take().unwrap_or_default(),
                blame: Blame::Nobody,
            },
            // Anything else is out of order (a driver bug): end the half rather than act twice.
            (phase, event) => {
                tracing::warn!(job = %self.attempt.job, ?phase, ?event, "producer half: event out of order");
                Action::Stop
            }
        };
        self.phase = Phase::Ended;
        action
    }
}

/// What happens to a consumer half.
#[derive(Debug)]
pub enum ConsumerEvent<'a> {
    /// Setting the job up failed (its expert, codec, translator or request).
    Refused(&'a Refusal),
    /// A stage could not start (`cause` as the record shows it).
    NotStarted(&'a str),
    /// The stages started: codes are arriving.
    Started,
    /// The expert generated a token.
    Token {
        /// The token.
        token: u32,
        /// When.
        now: Instant,
    },
    /// The decode finished.
    Finished,
    /// A stage failed; `stopped`: the attempt was stopped from outside first.
    Failed {
        /// The cause.
        error: &'a JobError,
        /// Whether the attempt was stopped from outside.
        stopped: bool,
    },
}

/// The tokens earlier attempts of `job` already showed: its record's unfinished output (at
/// most the request's `max_tokens`). A new attempt goes on from them rather than starting
/// over (its ranks, mode or node may differ, and so would its tokens), so that a client
/// following the job, which may have read them, is never told something else.
pub fn shown_tokens(job: &JobRecord) -> Vec<u32> {
    let Some(output) = job.output.as_ref().filter(|o| o.stop.is_empty()) else {
        return Vec::new();
    };
    let max = job.request.as_ref().map_or(0, |r| r.max_tokens as usize);
    output.tokens[..output.tokens.len().min(max)].to_vec()
}

/// The consumer half of one attempt: the tokens so far, when they go to the record, and what an
/// ending means.
#[derive(Debug)]
pub struct ConsumerHalf {
    attempt: Attempt,
    phase: Phase,
    tokens: Vec<u32>,
    last_flush: Option<Instant>,
}

impl ConsumerHalf {
    /// The consumer half of `job`'s attempt `attempt` on node `node`, admitted from its stream
    /// ([`admit_stream`]); its first action is [`Action::Start`].
    pub fn new(job: JobId, attempt: u32, node: &str) -> (Self, Action) {
        let half = Self {
            attempt: Attempt {
                job,
                attempt,
                side: Side::Consumer,
                node: node.to_owned(),
            },
            phase: Phase::Starting,
            tokens: Vec::new(),
            last_flush: None,
        };
        (half, Action::Start)
    }

    /// Starts from `shown` (see [`shown_tokens`]): they are the start of this attempt's
    /// answer, and its decoder generates only what follows them.
    pub fn resume(&mut self, shown: &[u32]) {
        if self.phase == Phase::Starting {
            self.tokens = shown.to_vec();
        }
    }

    /// The attempt.
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// Where it is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The tokens so far as a record change, if the record still runs this attempt: it moves
    /// on to `decoding` and shows the tokens as an unfinished output.
    pub fn progress(&self, j: &mut JobRecord, now_ms: u64) -> Result<(), RecordError> {
        if !self.attempt.holds(j) {
            return Ok(());
        }
        for next in [JobState::Transferring, JobState::Decoding] {
            if j.state.can_transition_to(next) {
                j.transition(next, now_ms)?;
            }
        }
        j.output = Some(JobResult {
            tokens: self.tokens.clone(),
            stop: String::new(),
        });
        Ok(())
    }

    /// The consumer's report as a record change, if the record still runs this attempt: on to
    /// `done` with its timings, the answer (`output`, and a fan-out's other experts' in
    /// `outputs`), and, when the first token came `since_first_token` ago, the job's
    /// submission-to-first-token on the store's clock. Returns that time, in milliseconds.
    pub fn finish(
        &self,
        j: &mut JobRecord,
        report: &JobReport,
        output: &JobResult,
        outputs: &std::collections::BTreeMap<String, JobResult>,
        since_first_token: Option<Duration>,
        now_ms: u64,
    ) -> Result<Option<f64>, RecordError> {
        if j.state.is_finished() || j.attempts != self.attempt.attempt {
            return Ok(None);
        }
        for next in [JobState::Transferring, JobState::Decoding, JobState::Done] {
            if j.state.can_transition_to(next) {
                j.transition(next, now_ms)?;
            }
        }
        write_report(j, report);
        let total = now_ms.saturating_sub(j.created_at_ms) as f64;
        j.timings_ms.insert("total".into(), total);
        // The consumer's own first-token time placed on the store's clock.
        let ttft = since_first_token.map(|since| (total - since.as_secs_f64() * 1e3).max(0.0));
        if let Some(ttft) = ttft {
            j.timings_ms.insert("ttft".into(), ttft);
        }
        j.output = Some(output.clone());
        j.outputs = outputs.clone();
        Ok(ttft)
    }

    /// The next action after `event`.
    pub fn handle(&mut self, event: ConsumerEvent<'_>) -> Action {
        let action = match (self.phase, event) {
            // No room for its caches here: busy, not broken; the blame steers the next attempt
            // to another consumer while one is free.
            (Phase::Starting, ConsumerEvent::Refused(refusal @ Refusal::Kv(_))) => {
                Action::HandBack {
                    reason: self.attempt.reason(refusal),
                    blame: Blame::Consumer,
                }
            }
            (Phase::Starting, ConsumerEvent::Refused(refusal)) => Action::Fail {
                reason: self.attempt.reason(refusal),
            },
            (Phase::Starting | Phase::Running, ConsumerEvent::NotStarted(cause)) => Action::Fail {
                reason: self.attempt.reason(cause),
            },
            (Phase::Starting, ConsumerEvent::Started) => {
                self.phase = Phase::Running;
                return Action::Continue;
            }
            (Phase::Running, ConsumerEvent::Token { token, now }) => {
                self.tokens.push(token);
                let due = self
                    .last_flush
                    .is_none_or(|at| now.saturating_duration_since(at) >= PROGRESS_EVERY);
                if due {
                    self.last_flush = Some(now);
                    return Action::WriteProgress;
                }
                return Action::Continue;
            }
            (Phase::Running, ConsumerEvent::Finished) => Action::Report,
            (Phase::Running, ConsumerEvent::Failed { error, stopped }) => {
                let reason = self.attempt.reason(error);
                if matches!(error, JobError::ActorGone(_)) {
                    Action::HandBack {
                        reason,
                        blame: Blame::Nobody,
                    }
                } else if error.producer_lost() {
                    Action::HandBack {
                        reason,
                        blame: Blame::Producer,
                    }
                } else if error.receiver_full() {
                    // Busy, not broken: the next attempt goes to another consumer while one
                    // is free (the blame steers it away), else back here once there is room.
                    Action::HandBack {
                        reason,
                        blame: Blame::Consumer,
                    }
                } else if stopped && error.is_knock_on() {
                    Action::Stop
                } else {
                    Action::Fail { reason }
                }
            }
            (phase, event) => {
                tracing::warn!(job = %self.attempt.job, ?phase, ?event, "consumer half: event out of order");
                Action::Stop
            }
        };
        self.phase = Phase::Ended;
        action
    }
}

/// A half's stages and timings into the record, under the stages' one names.
fn write_report(j: &mut JobRecord, report: &JobReport) {
    for (stage, span) in report.spans() {
        j.stages.insert(stage.name().into(), span);
    }
    j.timings_ms.extend(report.timings_ms());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::DecoderError;
    use crate::producer::ProducerError;
    use crate::transfer::TransferError;
    use scd_scheduler::{JobRequest, Mode, NodeId, StageSpan};
    use scd_transport::{RecvError, SendError};
    use scd_types::Stage;

    const ME: &str = "node-a";
    const PEER: &str = "node-b";

    fn record(state: JobState, producer: &str, consumer: &str) -> JobRecord {
        let mut j = JobRecord::new(JobId::random(), "sotu", Mode::Scd, 3);
        j.request = Some(JobRequest {
            prompt: vec![1, 2, 3],
            max_tokens: 4,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop_tokens: Vec::new(),
            documents: Vec::new(),
        });
        j.created_at_ms = 1_000;
        j.attempts = 1;
        j.producer = Some(NodeId::new(producer).unwrap());
        j.consumer = Some(NodeId::new(consumer).unwrap());
        j.state = state;
        j
    }

    fn span(a: f64, b: f64) -> StageSpan {
        StageSpan {
            start_ms: a,
            end_ms: b,
        }
    }

    #[test]
    fn records_start_the_producer_only_when_assigned_to_it_and_not_draining() {
        let assigned = record(JobState::Assigned, ME, PEER);
        assert_eq!(
            on_record(&assigned, ME, true, false),
            RecordAction::StartProducer
        );
        assert_eq!(on_record(&assigned, ME, true, true), RecordAction::Ignore);
        assert_eq!(on_record(&assigned, ME, false, false), RecordAction::Ignore);
        assert_eq!(
            on_record(&assigned, PEER, true, false),
            RecordAction::Ignore
        );
        for state in [JobState::Queued, JobState::Failed, JobState::Cancelled] {
            let j = record(state, ME, PEER);
            assert_eq!(
                on_record(&j, ME, true, false),
                RecordAction::CancelLocal {
                    through: j.attempts
                }
            );
        }
        let done = record(JobState::Done, ME, PEER);
        assert_eq!(on_record(&done, ME, true, false), RecordAction::Ignore);
    }

    #[test]
    fn a_requeue_seen_late_ends_only_the_attempts_it_names() {
        // Attempt 1 sent back: a node whose watch lags can already decode attempt 2, whose
        // producer opened the stream before the requeue reached the node.
        let requeued = record(JobState::Queued, ME, PEER);
        let action = on_record(&requeued, PEER, false, false);
        assert!(action.ends(1));
        assert!(!action.ends(2));
        assert!(!RecordAction::Ignore.ends(1));
        assert!(!RecordAction::StartProducer.ends(1));
    }

    #[test]
    fn a_stream_is_taken_only_from_the_recorded_producer_of_a_running_job() {
        let j = record(JobState::Prefilling, PEER, ME);
        assert_eq!(admit_stream(Some(&j), ME, PEER), Ok(1));
        assert!(admit_stream(Some(&j), ME, "intruder").is_err());
        assert!(admit_stream(Some(&j), PEER, PEER).is_err());
        assert_eq!(admit_stream(None, ME, PEER), Err("no such job"));
        let done = record(JobState::Done, PEER, ME);
        assert!(admit_stream(Some(&done), ME, PEER).is_err());
    }

    #[test]
    fn a_producer_claims_then_starts_then_reports() {
        let mut j = record(JobState::Assigned, ME, PEER);
        let (mut half, first) = ProducerHalf::new(j.id, 1, ME);
        assert_eq!(first, Action::Claim);
        half.claim(&mut j, None, None, None, 2_000).unwrap();
        assert_eq!(j.state, JobState::Prefilling);
        assert_eq!(half.handle(ProducerEvent::Claimed(Some(&j))), Action::Start);
        assert_eq!(half.handle(ProducerEvent::Started), Action::Continue);
        assert_eq!(half.handle(ProducerEvent::Finished), Action::Report);
        assert_eq!(half.phase(), Phase::Ended);

        let mut report = JobReport::new(Side::Producer, span(0.0, 50.0));
        report.stage(Stage::Prefill, Some(span(0.0, 20.0)));
        half.report(&mut j, &report, 3_000, |j| j.payload_bytes = 7)
            .unwrap();
        assert_eq!(j.state, JobState::Transferring);
        assert_eq!(j.payload_bytes, 7);
        assert_eq!(j.timings_ms["prefill"], 20.0);
        assert_eq!(j.timings_ms["producer_total"], 50.0);
        assert_eq!(j.stages["prefill"], span(0.0, 20.0));
    }

    #[test]
    fn a_claim_found_applied_on_retry_still_starts_and_a_lost_one_stops() {
        // The claim's answer was lost and the store retried it: the record is already ours.
        let mut j = record(JobState::Prefilling, ME, PEER);
        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        half.claim(&mut j, None, None, None, 2_000).unwrap();
        assert_eq!(half.handle(ProducerEvent::Claimed(Some(&j))), Action::Start);

        // Another attempt took the job meanwhile.
        let mut j = record(JobState::Assigned, ME, PEER);
        j.attempts = 2;
        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        half.claim(&mut j, None, None, None, 2_000).unwrap();
        assert_eq!(
            j.state,
            JobState::Assigned,
            "someone else's attempt is not touched"
        );
        assert_eq!(half.handle(ProducerEvent::Claimed(Some(&j))), Action::Stop);

        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        assert_eq!(half.handle(ProducerEvent::Claimed(None)), Action::Stop);
    }

    fn running_producer() -> ProducerHalf {
        let j = record(JobState::Prefilling, ME, PEER);
        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        half.handle(ProducerEvent::Claimed(Some(&j)));
        half.handle(ProducerEvent::Started);
        half
    }

    #[test]
    fn a_producer_that_cannot_reach_its_consumer_hands_back_blaming_it() {
        let j = record(JobState::Prefilling, ME, PEER);
        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        half.handle(ProducerEvent::Claimed(Some(&j)));
        let refusal = Refusal::Connect {
            node: PEER.into(),
            error: "timed out".into(),
        };
        match half.handle(ProducerEvent::Refused(&refusal)) {
            Action::HandBack { reason, blame } => {
                assert_eq!(blame, Blame::Consumer);
                assert!(reason.starts_with("producer node-a: connecting to consumer node node-b"));
            }
            other => panic!("expected a hand-back, got {other:?}"),
        }
        let (mut half, _) = ProducerHalf::new(j.id, 1, ME);
        half.handle(ProducerEvent::Claimed(Some(&j)));
        let bad = Refusal::Request(scd_types::RequestError::BadToken(99_999));
        assert!(matches!(
            half.handle(ProducerEvent::Refused(&bad)),
            Action::Fail { .. }
        ));
    }

    #[test]
    fn a_producer_failure_is_classified_once() {
        let cases: Vec<(JobError, bool, Action)> = vec![
            (
                JobError::Producer(ProducerError::Cancelled),
                true,
                Action::Stop,
            ),
            (
                JobError::Producer(ProducerError::Cancelled),
                false,
                Action::AwaitRecord(CONSUMER_GRACE),
            ),
            (
                JobError::ActorGone("encoder"),
                false,
                Action::HandBack {
                    reason: "producer node-a: the encoder actor is gone".into(),
                    blame: Blame::Nobody,
                },
            ),
            (
                JobError::Transfer(TransferError::Send(SendError::PeerGone(
                    "connection lost".into(),
                ))),
                false,
                Action::HandBack {
                    reason: String::new(),
                    blame: Blame::Consumer,
                },
            ),
            (
                JobError::Internal("boom".into()),
                false,
                Action::Fail {
                    reason: "producer node-a: job task failed: boom".into(),
                },
            ),
        ];
        for (error, stopped, want) in cases {
            let mut half = running_producer();
            let got = half.handle(ProducerEvent::Failed {
                error: &error,
                stopped,
            });
            match (&got, &want) {
                // The transport's wording is its own; the blame is what matters here.
                (
                    Action::HandBack { blame: a, .. },
                    Action::HandBack {
                        reason, blame: b, ..
                    },
                ) if reason.is_empty() => assert_eq!(a, b, "{error}"),
                _ => assert_eq!(got, want, "{error}"),
            }
        }
    }

    #[test]
    fn a_stopped_stream_waits_for_the_record_then_hands_back() {
        let knock_on = JobError::Producer(ProducerError::Cancelled);
        let mut half = running_producer();
        let wait = half.handle(ProducerEvent::Failed {
            error: &knock_on,
            stopped: false,
        });
        assert_eq!(wait, Action::AwaitRecord(CONSUMER_GRACE));
        assert_eq!(half.phase(), Phase::AwaitingRecord);
        assert!(matches!(
            half.handle(ProducerEvent::GraceElapsed),
            Action::HandBack {
                blame: Blame::Nobody,
                ..
            }
        ));

        let mut half = running_producer();
        half.handle(ProducerEvent::Failed {
            error: &knock_on,
            stopped: false,
        });
        assert_eq!(half.handle(ProducerEvent::AttemptEnded), Action::Stop);
    }

    #[test]
    fn events_out_of_order_end_the_half_without_acting() {
        let mut half = running_producer();
        assert_eq!(half.handle(ProducerEvent::Finished), Action::Report);
        // A second ending must not write a second report or a hand-back.
        assert_eq!(half.handle(ProducerEvent::Finished), Action::Stop);
        assert_eq!(half.handle(ProducerEvent::GraceElapsed), Action::Stop);

        let (mut half, _) = ConsumerHalf::new(JobId::random(), 1, ME);
        let t0 = Instant::now();
        assert_eq!(
            half.handle(ConsumerEvent::Token { token: 1, now: t0 }),
            Action::Stop
        );
        assert!(
            half.tokens().is_empty(),
            "a token before the start is not taken"
        );
    }

    #[test]
    fn a_new_attempt_goes_on_from_the_tokens_an_earlier_one_showed() {
        let mut j = record(JobState::Queued, PEER, ME);
        assert!(shown_tokens(&j).is_empty(), "nothing shown yet");
        j.output = Some(JobResult {
            tokens: vec![7, 8],
            stop: String::new(),
        });
        assert_eq!(shown_tokens(&j), [7, 8]);
        let (mut half, _) = ConsumerHalf::new(j.id, 2, ME);
        half.resume(&shown_tokens(&j));
        assert_eq!(half.handle(ConsumerEvent::Started), Action::Continue);
        half.handle(ConsumerEvent::Token {
            token: 9,
            now: Instant::now(),
        });
        assert_eq!(
            half.tokens(),
            [7, 8, 9],
            "the answer extends what was shown"
        );
        // At most the request's budget; a finished output is an answer, not a start.
        j.output.as_mut().unwrap().tokens = vec![1, 2, 3, 4, 5, 6];
        assert_eq!(shown_tokens(&j), [1, 2, 3, 4]);
        j.output.as_mut().unwrap().stop = "max_tokens".into();
        assert!(shown_tokens(&j).is_empty());
    }

    #[test]
    fn consumer_progress_goes_out_first_at_once_then_at_most_every_interval() {
        let (mut half, first) = ConsumerHalf::new(JobId::random(), 1, ME);
        assert_eq!(first, Action::Start);
        assert_eq!(half.handle(ConsumerEvent::Started), Action::Continue);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let steps = [
            (0, Action::WriteProgress),
            (10, Action::Continue),
            (249, Action::Continue),
            (250, Action::WriteProgress),
            (300, Action::Continue),
            (600, Action::WriteProgress),
        ];
        for (i, (ms, want)) in steps.into_iter().enumerate() {
            let got = half.handle(ConsumerEvent::Token {
                token: i as u32,
                now: at(ms),
            });
            assert_eq!(got, want, "token at {ms} ms");
        }
        assert_eq!(half.tokens(), &[0, 1, 2, 3, 4, 5]);
        assert_eq!(half.handle(ConsumerEvent::Finished), Action::Report);
    }

    #[test]
    fn consumer_progress_and_finish_touch_only_their_own_attempt() {
        let (mut half, _) = ConsumerHalf::new(JobId::random(), 1, ME);
        half.handle(ConsumerEvent::Started);
        half.handle(ConsumerEvent::Token {
            token: 42,
            now: Instant::now(),
        });
        let mut j = record(JobState::Prefilling, PEER, ME);
        half.progress(&mut j, 2_000).unwrap();
        assert_eq!(j.state, JobState::Decoding);
        assert_eq!(j.output.as_ref().map(|o| o.tokens.clone()), Some(vec![42]));

        let mut report = JobReport::new(Side::Consumer, span(0.0, 90.0));
        report
            .stage(Stage::Rebuild, Some(span(1.0, 11.0)))
            .stage(Stage::FirstToken, Some(span(0.0, 15.0)));
        let output = JobResult {
            tokens: vec![42, 43],
            stop: "max_tokens".into(),
        };
        let none = Default::default();
        let ttft = half
            .finish(
                &mut j,
                &report,
                &output,
                &none,
                Some(Duration::from_millis(400)),
                3_000,
            )
            .unwrap();
        assert_eq!(j.state, JobState::Done);
        assert_eq!(
            ttft,
            Some(1_600.0),
            "created at 1 s, done at 3 s, first token 0.4 s before"
        );
        assert_eq!(j.timings_ms["total"], 2_000.0);
        assert_eq!(j.timings_ms["rebuild"], 10.0);
        assert_eq!(j.timings_ms["first_token"], 15.0);
        assert!(j.stages.contains_key("rebuild") && !j.stages.contains_key("first_token"));
        assert_eq!(j.output.as_ref(), Some(&output));

        // A record handed to attempt 2 meanwhile is not this half's to finish or fail.
        let mut other = record(JobState::Decoding, PEER, ME);
        other.attempts = 2;
        half.progress(&mut other, 4_000).unwrap();
        assert!(other.output.is_none());
        let ttft = half
            .finish(&mut other, &report, &output, &none, None, 4_000)
            .unwrap();
        assert_eq!((ttft, other.state), (None, JobState::Decoding));
        half.attempt().fail(&mut other, "late", 4_000).unwrap();
        half.attempt()
            .hand_back(&mut other, "late", Blame::Nobody, 4_000)
            .unwrap();
        assert_eq!(other.state, JobState::Decoding);
        assert_eq!(other.attempts, 2);
    }

    #[test]
    fn a_consumer_failure_is_classified_once() {
        let start = || {
            let (mut half, _) = ConsumerHalf::new(JobId::random(), 1, ME);
            half.handle(ConsumerEvent::Started);
            half
        };
        let producer_gone = JobError::Decoder(DecoderError::Transfer(RecvError::Truncated));
        assert!(matches!(
            start().handle(ConsumerEvent::Failed {
                error: &producer_gone,
                stopped: false
            }),
            Action::HandBack {
                blame: Blame::Producer,
                ..
            }
        ));
        let full = JobError::Decoder(DecoderError::Transfer(RecvError::OverBudget(
            scd_transport::BudgetError::Exhausted {
                requested: 1 << 20,
                in_use: 63 << 20,
                total: 64 << 20,
            },
        )));
        assert!(matches!(
            start().handle(ConsumerEvent::Failed {
                error: &full,
                stopped: false
            }),
            Action::HandBack {
                blame: Blame::Consumer,
                ..
            }
        ));
        // A frame over the whole budget never fits: that fails.
        let never = JobError::Decoder(DecoderError::Transfer(RecvError::OverBudget(
            scd_transport::BudgetError::FrameOverTotal {
                len: 65 << 20,
                total: 64 << 20,
            },
        )));
        assert!(matches!(
            start().handle(ConsumerEvent::Failed {
                error: &never,
                stopped: false
            }),
            Action::Fail { .. }
        ));
        let gone = JobError::ActorGone("decoder");
        assert!(matches!(
            start().handle(ConsumerEvent::Failed {
                error: &gone,
                stopped: true
            }),
            Action::HandBack {
                blame: Blame::Nobody,
                ..
            }
        ));
        let cancelled = JobError::Decoder(DecoderError::Cancelled);
        assert_eq!(
            start().handle(ConsumerEvent::Failed {
                error: &cancelled,
                stopped: true
            }),
            Action::Stop
        );
        assert!(matches!(
            start().handle(ConsumerEvent::Failed {
                error: &cancelled,
                stopped: false
            }),
            Action::Fail { .. }
        ));
        let (mut half, _) = ConsumerHalf::new(JobId::random(), 1, ME);
        let refusal = Refusal::UnknownExpert("nope".into());
        assert_eq!(
            half.handle(ConsumerEvent::Refused(&refusal)),
            Action::Fail {
                reason: "consumer node-a: this node does not serve expert nope".into()
            }
        );
        // No room for the job's caches: handed back, blaming this consumer, busy or too large.
        for kv in [
            crate::kv_budget::KvRefusal::Busy {
                need_mib: 3,
                free_mib: 1,
                limit_mib: 4,
            },
            crate::kv_budget::KvRefusal::TooLarge {
                need_mib: 5,
                limit_mib: 4,
            },
        ] {
            let (mut half, _) = ConsumerHalf::new(JobId::random(), 1, ME);
            let refusal = Refusal::Kv(kv.clone());
            assert_eq!(
                half.handle(ConsumerEvent::Refused(&refusal)),
                Action::HandBack {
                    reason: format!("consumer node-a: {kv}"),
                    blame: Blame::Consumer
                }
            );
        }
    }

    #[test]
    fn final_writes_are_retried_while_the_store_is_away_and_only_then() {
        use scd_scheduler::StoreError;
        let away = RecordError::Store(StoreError::Timeout {
            op: "txn",
            after: Duration::from_secs(5),
        });
        let waits: Vec<_> = (0..8).map(|n| retry_final_write(&away, n)).collect();
        assert_eq!(waits[0], Some(FINAL_WRITE_FIRST_WAIT));
        assert_eq!(waits[1], Some(FINAL_WRITE_FIRST_WAIT * 2));
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(waits[7], Some(FINAL_WRITE_MAX_WAIT));
        assert_eq!(
            retry_final_write(&away, u32::MAX),
            Some(FINAL_WRITE_MAX_WAIT)
        );
        let contended = RecordError::Contention {
            id: JobId::from_u128(1),
            attempts: 64,
        };
        assert!(retry_final_write(&contended, 0).is_some());
        for hopeless in [
            RecordError::NotFound(JobId::from_u128(1)),
            RecordError::InvalidTransition {
                id: JobId::from_u128(1),
                from: JobState::Done,
                to: JobState::Failed,
            },
            RecordError::Store(StoreError::Invalid("bad key".into())),
        ] {
            assert_eq!(retry_final_write(&hopeless, 0), None, "{hopeless}");
        }
    }
}
