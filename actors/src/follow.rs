//! Following a job from anywhere: its record, watched in the store, as a [`TokenSource`]: the
//! tokens its consumer appends, each change of state, then the final record. The admin endpoint
//! and the HTTP gateway read a job this way.

use std::collections::VecDeque;

use scd_scheduler::{JobId, JobRecord, JobState};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::client::{ClientError, ClusterClient};
use crate::reply::{Step, TokenSource};

/// A job being followed through its record.
pub struct Following {
    records: mpsc::Receiver<JobRecord>,
    task: Option<JoinHandle<Result<JobRecord, ClientError>>>,
    /// Tokens of the record's output already given.
    tokens: usize,
    state: Option<JobState>,
    pending: VecDeque<Step>,
    outcome: Option<Result<JobRecord, ClientError>>,
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
        Self::over(records, task)
    }

    /// Following the records `records` hands over; `task` ends with the final one.
    fn over(
        records: mpsc::Receiver<JobRecord>,
        task: JoinHandle<Result<JobRecord, ClientError>>,
    ) -> Self {
        Self {
            records,
            task: Some(task),
            tokens: 0,
            state: None,
            pending: VecDeque::new(),
            outcome: None,
        }
    }

    /// The steps from what was given to `job`: new tokens first, then a new state.
    fn steps_to(&mut self, job: &JobRecord) {
        if let Some(output) = &job.output {
            // An attempt that takes over goes on from the tokens shown, so the output only
            // grows.
            if output.tokens.len() > self.tokens {
                self.pending
                    .push_back(Step::Tokens(output.tokens[self.tokens..].to_vec()));
                self.tokens = output.tokens.len();
            }
        }
        if self.state != Some(job.state) {
            self.state = Some(job.state);
            self.pending.push_back(Step::Moved(Box::new(job.clone())));
        }
    }
}

impl TokenSource for Following {
    type Outcome = Result<JobRecord, ClientError>;

    async fn next(&mut self) -> Option<Step> {
        loop {
            if let Some(step) = self.pending.pop_front() {
                return Some(step);
            }
            if self.outcome.is_some() {
                return None;
            }
            if let Some(record) = self.records.recv().await {
                self.steps_to(&record);
                continue;
            }
            // The watch has ended: the final record is the task's.
            let outcome = match self.task.as_mut() {
                Some(task) => task
                    .await
                    .map_err(|e| ClientError::Internal(e.to_string()))
                    .and_then(|r| r),
                None => Err(ClientError::Internal("the follow task is gone".into())),
            };
            self.task = None;
            if let Ok(last) = &outcome {
                self.steps_to(last);
            }
            self.outcome = Some(outcome);
        }
    }

    async fn finish(mut self) -> Self::Outcome {
        while self.next().await.is_some() {}
        self.outcome.take().unwrap_or_else(|| {
            Err(ClientError::Internal(
                "the follow ended without its final record".into(),
            ))
        })
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use scd_scheduler::Mode;
    use scd_types::JobResult;

    use super::*;

    fn record(state: JobState, tokens: &[u32]) -> JobRecord {
        let mut job = JobRecord::new(JobId::from_u128(7), "sotu", Mode::Scd, 3);
        job.state = state;
        job.output = (!tokens.is_empty()).then(|| JobResult {
            tokens: tokens.to_vec(),
            stop: String::new(),
        });
        job
    }

    /// A step as a short string: `t:1,2` for tokens, `s:running` for a state.
    fn show(step: Step) -> String {
        match step {
            Step::Tokens(t) => format!("t:{t:?}"),
            Step::Moved(job) => format!("s:{}", job.state),
        }
    }

    #[tokio::test]
    async fn a_followed_record_gives_new_tokens_before_each_new_state_then_the_final_record() {
        let (tx, rx) = mpsc::channel(8);
        for r in [
            record(JobState::Queued, &[]),
            record(JobState::Decoding, &[5, 6]),
            // Nothing new: no step.
            record(JobState::Decoding, &[5, 6]),
            record(JobState::Decoding, &[5, 6, 7]),
        ] {
            tx.send(r).await.unwrap();
        }
        drop(tx);
        let task = tokio::spawn(async { Ok(record(JobState::Done, &[5, 6, 7, 8, 9])) });
        let mut following = Following::over(rx, task);
        let mut steps = Vec::new();
        while let Some(step) = following.next().await {
            steps.push(show(step));
        }
        assert_eq!(
            steps,
            [
                "s:queued",
                "t:[5, 6]",
                "s:decoding",
                "t:[7]",
                "t:[8, 9]",
                "s:done"
            ]
        );
        let last = following.finish().await.unwrap();
        assert_eq!(last.state, JobState::Done);
    }

    #[tokio::test]
    async fn a_follow_that_failed_ends_the_tokens_and_finishes_with_its_error() {
        let (tx, rx) = mpsc::channel(8);
        tx.send(record(JobState::Decoding, &[1])).await.unwrap();
        drop(tx);
        let task = tokio::spawn(async { Err(ClientError::Internal("store gone".into())) });
        let (tokens, outcome) = Following::over(rx, task).collect().await;
        assert_eq!(tokens, [1]);
        assert!(
            matches!(outcome, Err(ClientError::Internal(ref m)) if m == "store gone"),
            "{outcome:?}"
        );
    }
}
