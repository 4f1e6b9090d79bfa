//! Following a job for a user: its record, watched in the store, turned into what a client
//! shows: state changes, the new tokens with the text they add, and the final record. The admin
//! endpoint and the HTTP gateway both read a job this way.

use scd_models::tokenizer::Tokenizer;
use scd_scheduler::{JobId, JobRecord, JobState};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::client::{ClientError, ClusterClient};

/// One step of a followed job.
#[derive(Debug, Clone)]
pub enum Progress {
    /// The job entered `state` (`record` as it was then).
    State(JobState, Box<JobRecord>),
    /// New tokens, and the text they add to the reply.
    Text {
        /// The tokens since the last `Text`.
        tokens: Vec<u32>,
        /// What they add to the decoded reply.
        text: String,
    },
}

/// What has been shown of a job so far, and the steps that bring a client up to a record.
#[derive(Debug, Default)]
pub struct Shown {
    state: Option<JobState>,
    tokens: usize,
    text: String,
}

impl Shown {
    /// Nothing shown yet, except that the client already knows the job is in `state`.
    pub fn after(state: JobState) -> Self {
        Self {
            state: Some(state),
            ..Self::default()
        }
    }

    /// The whole text shown so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The steps from what was shown to `job`: new text first, then a new state.
    pub fn steps(&mut self, tok: &Tokenizer, job: &JobRecord) -> Vec<Progress> {
        let mut out = Vec::new();
        if let Some(output) = &job.output {
            if output.tokens.len() > self.tokens {
                let text = tok.decode(&output.tokens, true).unwrap_or_default();
                // Decoding a longer sequence can rewrite its tail (a multi-byte character
                // completed); the client is sent what extends what it has.
                let delta = text.strip_prefix(self.text.as_str()).unwrap_or(&text);
                out.push(Progress::Text {
                    tokens: output.tokens[self.tokens..].to_vec(),
                    text: delta.to_owned(),
                });
                self.tokens = output.tokens.len();
                self.text = text;
            }
        }
        if self.state != Some(job.state) {
            self.state = Some(job.state);
            out.push(Progress::State(job.state, Box::new(job.clone())));
        }
        out
    }
}

/// A job being followed: its records as they change, the last one finished.
pub struct Following {
    records: mpsc::Receiver<JobRecord>,
    task: Option<JoinHandle<Result<JobRecord, ClientError>>>,
}

impl Following {
    /// Starts following `job`.
    pub fn start(client: &ClusterClient, job: JobId) -> Self {
        // The watch's callback cannot wait; it hands the latest record over, and a skipped one
        // only means that the next carries more.
        let (tx, records) = mpsc::channel::<JobRecord>(8);
        let client = client.clone();
        let task = tokio::spawn(async move {
            client
                .follow(job, |record| {
                    let _ = tx.try_send(record.clone());
                })
                .await
        });
        Self {
            records,
            task: Some(task),
        }
    }

    /// The next record: `Ok(Some(_))` while the job runs (possibly finished already), and once
    /// the watch has ended `Ok(None)`; then [`Following::finish`] has the final record.
    pub async fn next(&mut self) -> Option<JobRecord> {
        self.records.recv().await
    }

    /// The job's final record.
    pub async fn finish(mut self) -> Result<JobRecord, ClientError> {
        let Some(task) = self.task.take() else {
            return Err(ClientError::Internal("the job was already finished".into()));
        };
        task.await
            .map_err(|e| ClientError::Internal(e.to_string()))?
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
