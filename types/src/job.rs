//! A job's identity and the state machine of its life.

use std::fmt;
use std::str::FromStr;

use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};
use serde::{Deserialize, Serialize};

/// A job's id: 128 random bits, written as 32 lower-case hex digits everywhere (records, keys,
/// logs, the command line) and as a `u128` on the wire.
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct JobId(u128);

impl JobId {
    /// A fresh random id.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// The id that `parts` name: the first 128 bits of SHA-256 over them, each prefixed by
    /// its length. A request retried with the same parts (an HTTP client's idempotency key)
    /// gets the same id, and the store refuses its second creation.
    pub fn derived(parts: &[&[u8]]) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        let digest = h.finalize();
        let mut bits = [0u8; 16];
        bits.copy_from_slice(&digest[..16]);
        Self(u128::from_le_bytes(bits))
    }

    /// The id with these 128 bits.
    pub const fn from_u128(bits: u128) -> Self {
        Self(bits)
    }

    /// The id's 128 bits.
    pub const fn as_u128(self) -> u128 {
        self.0
    }
}

impl ArchivedJobId {
    /// The id this archive holds (every bit pattern is a valid id).
    pub fn get(&self) -> JobId {
        JobId(self.0.to_native())
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A job id string that is not 1 to 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job id {0:?} is not 1 to 32 hex digits")]
pub struct ParseJobIdError(String);

impl FromStr for JobId {
    type Err = ParseJobIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // from_str_radix alone would accept a leading '+'.
        if s.is_empty() || s.len() > 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ParseJobIdError(s.to_owned()));
        }
        u128::from_str_radix(s, 16)
            .map(JobId)
            .map_err(|_| ParseJobIdError(s.to_owned()))
    }
}

impl Serialize for JobId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for JobId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a job is. The same states in the store's records, in status messages on the wire and
/// on the command line.
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for a producer and a consumer.
    Queued,
    /// Producer and consumer chosen.
    Assigned,
    /// The producer runs the base model's prefill.
    Prefilling,
    /// Codes stream to the consumer.
    Transferring,
    /// The consumer decodes.
    Decoding,
    /// Finished with an answer.
    Done,
    /// Finished without one.
    Failed,
    /// Stopped on request before it finished.
    Cancelled,
}

impl JobState {
    /// Every state, in pipeline order, then the two other ends.
    pub const ALL: [JobState; 8] = [
        JobState::Queued,
        JobState::Assigned,
        JobState::Prefilling,
        JobState::Transferring,
        JobState::Decoding,
        JobState::Done,
        JobState::Failed,
        JobState::Cancelled,
    ];

    /// Whether a job may go from `self` to `next`: forward one step along the pipeline, back to
    /// `Queued` from any running state (a retry), or to `Failed` or `Cancelled` from any
    /// unfinished state.
    pub fn can_transition_to(self, next: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, next),
            (Queued, Assigned)
                | (Assigned, Prefilling)
                | (Prefilling, Transferring)
                | (Transferring, Decoding)
                | (Decoding, Done)
                | (Assigned | Prefilling | Transferring | Decoding, Queued)
                | (
                    Queued | Assigned | Prefilling | Transferring | Decoding,
                    Failed | Cancelled
                )
        )
    }

    /// Done, failed or cancelled: nothing will change it again.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }

    /// A producer or consumer is working on it.
    pub fn is_running(self) -> bool {
        matches!(
            self,
            JobState::Assigned | JobState::Prefilling | JobState::Transferring | JobState::Decoding
        )
    }

    /// The name used in records, logs and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Prefilling => "prefilling",
            JobState::Transferring => "transferring",
            JobState::Decoding => "decoding",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A job state name that is not one of [`JobState::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown job state {0:?} (known: queued, assigned, prefilling, transferring, decoding, done, failed, cancelled)")]
pub struct ParseJobStateError(String);

impl FromStr for JobState {
    type Err = ParseJobStateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| ParseJobStateError(s.to_owned()))
    }
}

impl ArchivedJobState {
    /// The state this archive holds.
    pub fn get(&self) -> JobState {
        match self {
            ArchivedJobState::Queued => JobState::Queued,
            ArchivedJobState::Assigned => JobState::Assigned,
            ArchivedJobState::Prefilling => JobState::Prefilling,
            ArchivedJobState::Transferring => JobState::Transferring,
            ArchivedJobState::Decoding => JobState::Decoding,
            ArchivedJobState::Done => JobState::Done,
            ArchivedJobState::Failed => JobState::Failed,
            ArchivedJobState::Cancelled => JobState::Cancelled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_the_same_for_the_same_parts_only() {
        let a = JobId::derived(&[b"key", b"retry-1"]);
        assert_eq!(a, JobId::derived(&[b"key", b"retry-1"]));
        assert_ne!(a, JobId::derived(&[b"key", b"retry-2"]));
        // Where one part ends is part of the name.
        assert_ne!(a, JobId::derived(&[b"keyr", b"etry-1"]));
    }

    #[test]
    fn one_request_check_refuses_short_long_and_unknown_tokens() {
        let limits = ModelLimits {
            context_length: 8,
            vocab_size: 100,
        };
        let request = |prompt: Vec<u32>, max_tokens| JobRequest {
            prompt,
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop_tokens: Vec::new(),
            documents: Vec::new(),
        };
        assert_eq!(request(vec![1, 2], 6).check(limits), Ok(()));
        assert_eq!(
            request(vec![1], 1).check(limits),
            Err(RequestError::PromptTooShort(1))
        );
        assert_eq!(
            request(vec![], 1).check_shape(),
            Err(RequestError::PromptTooShort(0))
        );
        assert_eq!(
            request(vec![1, 2], 7).check(limits),
            Err(RequestError::PromptTooLong {
                tokens: 9,
                context: 8
            })
        );
        assert_eq!(
            request(vec![1, 100], 1).check(limits),
            Err(RequestError::BadToken(100))
        );
        assert_eq!(split_prompt(&[5, 6, 7]), Ok((&[5u32, 6][..], 7)));
    }

    #[test]
    fn job_id_text_form_round_trips_and_is_validated() {
        let id = JobId::from_u128(0xabc);
        assert_eq!(id.to_string(), "00000000000000000000000000000abc");
        assert_eq!(id.to_string().parse::<JobId>().unwrap(), id);
        assert_eq!("ABC".parse::<JobId>().unwrap(), id);
        for bad in ["", "+abc", "xyz", "0123456789abcdef0123456789abcdef0", " 1"] {
            assert!(bad.parse::<JobId>().is_err(), "{bad:?} parsed");
        }
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"00000000000000000000000000000abc\"");
        assert_eq!(serde_json::from_str::<JobId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<JobId>("\"not hex\"").is_err());
        assert_ne!(JobId::random(), JobId::random());
    }

    #[test]
    fn job_id_survives_the_wire_form() {
        let id = JobId::random();
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&id).unwrap();
        let archived = rkyv::access::<ArchivedJobId, rkyv::rancor::Error>(&bytes).unwrap();
        assert_eq!(archived.get(), id);
    }

    #[test]
    fn state_machine_moves_forward_retries_and_ends() {
        use JobState::*;
        assert!(Queued.can_transition_to(Assigned));
        assert!(Decoding.can_transition_to(Done));
        assert!(Transferring.can_transition_to(Queued));
        assert!(Queued.can_transition_to(Cancelled));
        assert!(!Queued.can_transition_to(Done));
        for end in [Done, Failed, Cancelled] {
            assert!(end.is_finished());
            for next in JobState::ALL {
                assert!(!end.can_transition_to(next), "{end} -> {next}");
            }
        }
        for st in JobState::ALL {
            assert_eq!(st.as_str().parse::<JobState>().unwrap(), st);
            let json = serde_json::to_string(&st).unwrap();
            assert_eq!(json, format!("\"{st}\""));
        }
        assert!("running".parse::<JobState>().is_err());
    }
}

/// What a job asks the expert to do: the prompt, already tokenised with the base model's
/// tokenizer (the producer prefills all but its last token), and how to generate. Kept in the
/// job record, so that whichever producer and consumer the job lands on (or lands on again
/// after a retry) work from the same request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// At most this many new tokens.
    pub max_tokens: u32,
    /// Softmax temperature; 0 is greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Nucleus mass in (0, 1], used when `temperature` > 0.
    #[serde(default = "one")]
    pub top_p: f32,
    /// Seed of the sampler.
    #[serde(default)]
    pub seed: u64,
    /// Tokens that end generation (not emitted).
    #[serde(default)]
    pub stop_tokens: Vec<u32>,
    /// Documents placed before the prompt, in this order, by id ([`crate::document_id`]): the
    /// producer serves their compiled caches (SemPIC) and the expert reads the prompt after
    /// them. Empty for a plain job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub documents: Vec<String>,
}

fn one() -> f32 {
    1.0
}

/// Why a request cannot run: one check, used by every way in (the admin endpoint, the
/// gateway, the client, the node that takes the job, the decoder), so each refuses the same
/// request with the same words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The prompt cannot be split into a prefix to prefill and a last token to continue from.
    #[error("the prompt has {0} tokens; a job needs at least two (the producer prefills all but the last)")]
    PromptTooShort(usize),
    /// The prompt and the tokens asked for do not fit the model's context.
    #[error("the prompt and its answer need {tokens} tokens; the model's context holds {context}")]
    PromptTooLong {
        /// Prompt tokens plus `max_tokens`.
        tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// A token id the base model does not have.
    #[error("token {0} is outside the base model's vocabulary")]
    BadToken(u32),
}

/// What a request is checked against: the base model's context and vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    /// Tokens the model's context holds.
    pub context_length: usize,
    /// Token ids below this exist.
    pub vocab_size: usize,
}

/// A prompt split into the prefix the producer prefills and the token the expert continues
/// from.
pub fn split_prompt(prompt: &[u32]) -> Result<(&[u32], u32), RequestError> {
    match prompt.split_last() {
        Some((&last, prefix)) if !prefix.is_empty() => Ok((prefix, last)),
        _ => Err(RequestError::PromptTooShort(prompt.len())),
    }
}

impl JobRequest {
    /// The checks that need no model (a client's, before it writes a record).
    pub fn check_shape(&self) -> Result<(), RequestError> {
        split_prompt(&self.prompt).map(|_| ())
    }

    /// Every check, against the model the request will run on.
    pub fn check(&self, limits: ModelLimits) -> Result<(), RequestError> {
        self.check_shape()?;
        let tokens = self.prompt.len() + self.max_tokens as usize;
        if tokens > limits.context_length {
            return Err(RequestError::PromptTooLong {
                tokens,
                context: limits.context_length,
            });
        }
        match self
            .prompt
            .iter()
            .find(|&&t| t as usize >= limits.vocab_size)
        {
            Some(&bad) => Err(RequestError::BadToken(bad)),
            None => Ok(()),
        }
    }
}

/// What a finished job produced, written by the consumer that decoded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResult {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Why generation ended (`max_tokens`, `stop_token`, ...).
    pub stop: String,
}
