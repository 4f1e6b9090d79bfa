//! What an evaluation runs: sample sizes, lengths, the seed and the QA prompt.

use serde::{Deserialize, Serialize};

/// The prompt template of the QA task; `{context}` and `{question}` are replaced, and the result
/// is the user turn of the model's chat template (with the generation prompt).
pub const QA_TEMPLATE: &str = "Answer the question with a short phrase copied from the context.\n\nContext: {context}\n\nQuestion: {question}";

/// What to evaluate (the methods are the codecs given to [`super::evaluate`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalConfig {
    /// Seed of window starts, of the QA sample and of the bootstrap.
    pub seed: u64,
    /// WikiText-2 windows.
    pub wikitext_windows: usize,
    /// Prompt tokens per window (the method builds the cache for all but the last).
    pub prefix_tokens: usize,
    /// Continuation tokens per window, scored teacher-forced.
    pub continuation_tokens: usize,
    /// Greedy tokens compared with the oracle's greedy continuation, per window.
    pub greedy_tokens: usize,
    /// SQuAD answerable questions.
    pub squad_questions: usize,
    /// Greedy answer budget.
    pub answer_tokens: usize,
    /// The QA prompt template.
    pub qa_template: String,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            wikitext_windows: 16,
            prefix_tokens: 256,
            continuation_tokens: 64,
            greedy_tokens: 32,
            squad_questions: 200,
            answer_tokens: 32,
            qa_template: QA_TEMPLATE.into(),
        }
    }
}
