//! A job's reply as whoever waits for it reads it: one trait, [`TokenSource`], for every place
//! a job's tokens come back from, and [`ReplyText`], the text those tokens add as they come.
//!
//! Tokens come back three ways, one per distance from the decoder:
//! - on the consumer node, from the decoder itself (`halves::Decoding`: the decoder's token
//!   channel, ended early by its failure); the node's consumer half and each fan-out expert
//!   read it;
//! - in the in-process pipeline, the same channel with the producer half joined at the end
//!   ([`RunningJob`](crate::pipeline::RunningJob));
//! - anywhere else, from the job's record in the store, which the consumer appends to
//!   ([`Following`](crate::follow::Following)); the admin endpoint and the HTTP gateway read it.
//!
//! Each is read the same way: [`TokenSource::next`] until it gives `None`, then
//! [`TokenSource::finish`] for how the job ended.

use std::future::Future;

use scd_models::tokenizer::Tokenizer;
use scd_scheduler::JobRecord;

/// One step of a job's reply.
#[derive(Debug, Clone)]
pub enum Step {
    /// The tokens generated since the last step, in order; never empty.
    Tokens(Vec<u32>),
    /// The job's record after its state changed (queued, running on a producer and a
    /// consumer, finished). Only a source that reads the record sees these.
    Moved(Box<JobRecord>),
}

/// Where a job's tokens are read from as the expert generates them, then how the job ended.
pub trait TokenSource: Send {
    /// How the job ended.
    type Outcome: Send;

    /// The next step: `None` once the job's tokens have ended (it finished, failed or was
    /// cancelled). Cancel-safe: a step not returned is not lost.
    fn next(&mut self) -> impl Future<Output = Option<Step>> + Send;

    /// How the job ended; reads (and drops) whatever [`TokenSource::next`] had not given yet,
    /// so it waits for the job's end.
    fn finish(self) -> impl Future<Output = Self::Outcome> + Send;

    /// Every token, then how the job ended.
    fn collect(mut self) -> impl Future<Output = (Vec<u32>, Self::Outcome)> + Send
    where
        Self: Sized,
    {
        async move {
            let mut tokens = Vec::new();
            while let Some(step) = self.next().await {
                if let Step::Tokens(t) = step {
                    tokens.extend(t);
                }
            }
            (tokens, self.finish().await)
        }
    }
}

/// The text of a reply so far, as its tokens come.
#[derive(Debug, Default)]
pub struct ReplyText {
    tokens: Vec<u32>,
    text: String,
}

impl ReplyText {
    /// Adds `tokens`; the text they add.
    pub fn push(&mut self, tok: &Tokenizer, tokens: &[u32]) -> String {
        self.tokens.extend_from_slice(tokens);
        let text = tok.decode(&self.tokens, true).unwrap_or_default();
        // Decoding a longer sequence can rewrite its tail (a multi-byte character completed);
        // what is added is what extends the text already given.
        let delta = text
            .strip_prefix(self.text.as_str())
            .unwrap_or(&text)
            .to_owned();
        self.text = text;
        delta
    }

    /// The whole text so far.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}
