//! The evaluation data: WikiText-2 validation text (windows at seeded starts) and SQuAD 2.0's
//! answerable questions (a seeded sample, turned into chat prompts), with content hashes for
//! records.

use std::path::Path;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::EvalError;
use crate::corpus::{self, CorpusError};
use crate::tokenizer::{ChatMessage, Tokenizer};

/// Texts the harness reads, with their hashes.
#[derive(Debug, Clone)]
pub struct EvalData {
    /// What the continuation windows are cut from: "WikiText-2" (its validation text) unless
    /// [`EvalData::with_text`] put another text there.
    pub text_name: String,
    /// The continuation text: WikiText-2's validation text, or the text named by `text_name`.
    pub text: String,
    /// Where it came from and its SHA-256.
    pub text_file: FileInfo,
    /// SQuAD answerable questions, in file order.
    pub squad: Vec<QaItem>,
    /// Where SQuAD came from and its SHA-256.
    pub squad_file: FileInfo,
}

/// A file and its content hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Path as read.
    pub path: String,
    /// Hex SHA-256.
    pub sha256: String,
}

/// One extractive-QA item.
#[derive(Debug, Clone, PartialEq)]
pub struct QaItem {
    /// SQuAD id.
    pub id: String,
    /// The paragraph.
    pub context: String,
    /// The question.
    pub question: String,
    /// Gold answers (answerable questions have at least one).
    pub answers: Vec<String>,
    /// Index of its article in the file (splits by article keep a topic on one side).
    pub article: usize,
}

#[derive(Deserialize)]
struct SquadFile {
    data: Vec<SquadArticle>,
}
#[derive(Deserialize)]
struct SquadArticle {
    paragraphs: Vec<SquadParagraph>,
}
#[derive(Deserialize)]
struct SquadParagraph {
    context: String,
    qas: Vec<SquadQa>,
}
#[derive(Deserialize)]
struct SquadQa {
    id: String,
    question: String,
    answers: Vec<SquadAnswer>,
    #[serde(default)]
    is_impossible: bool,
}
#[derive(Deserialize)]
struct SquadAnswer {
    text: String,
}

/// Answerable questions of a SQuAD 2.0 JSON file.
pub fn parse_squad(bytes: &[u8], path: &Path) -> Result<Vec<QaItem>, EvalError> {
    let f: SquadFile = serde_json::from_slice(bytes).map_err(|e| CorpusError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (article, a) in f.data.into_iter().enumerate() {
        for p in a.paragraphs {
            for q in p.qas {
                if q.is_impossible || q.answers.is_empty() {
                    continue;
                }
                out.push(QaItem {
                    id: q.id,
                    context: p.context.clone(),
                    question: q.question,
                    answers: q.answers.into_iter().map(|a| a.text).collect(),
                    article,
                });
            }
        }
    }
    Ok(out)
}

impl EvalData {
    /// Reads WikiText-2 valid and the SQuAD part from the evaluation data folder `dir`
    /// ([`corpus::WIKITEXT2_VALID`] and [`corpus::SQUAD_PART`] inside it).
    pub fn load(dir: &Path) -> Result<Self, EvalError> {
        let wpath = dir.join(corpus::WIKITEXT2_VALID);
        let spath = dir.join(corpus::SQUAD_PART);
        let wikitext = corpus::read_text(&wpath)?;
        let sbytes = std::fs::read(&spath).map_err(|source| CorpusError::Io {
            path: spath.clone(),
            source,
        })?;
        Ok(Self {
            text_name: WIKITEXT.into(),
            text_file: FileInfo {
                path: wpath.display().to_string(),
                sha256: corpus::sha256_hex(wikitext.as_bytes()),
            },
            text: wikitext,
            squad: parse_squad(&sbytes, &spath)?,
            squad_file: FileInfo {
                path: spath.display().to_string(),
                sha256: corpus::sha256_hex(&sbytes),
            },
        })
    }

    /// The same data with the continuation windows cut from `text` (named `name`, read from
    /// `path`) instead of WikiText-2: the transfer measured on another kind of text, such as
    /// an expert's own held-out split.
    pub fn with_text(&self, name: &str, text: &str, path: &str) -> Self {
        Self {
            text_name: name.into(),
            text: text.into(),
            text_file: FileInfo {
                path: path.into(),
                sha256: corpus::sha256_hex(text.as_bytes()),
            },
            ..self.clone()
        }
    }
}

/// The name of the default continuation text.
pub const WIKITEXT: &str = "WikiText-2";

/// Windows of `len` tokens at seeded random starts.
pub fn seeded_windows(tokens: &[u32], len: usize, n: usize, seed: u64) -> Vec<Vec<u32>> {
    if tokens.len() < len {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let s = rng.gen_range(0..=tokens.len() - len);
            tokens[s..s + len].to_vec()
        })
        .collect()
}

/// The QA sample: answerable questions shuffled by `seed`, first `n`.
pub fn sample_questions(items: &[QaItem], n: usize, seed: u64) -> Vec<QaItem> {
    let mut idx: Vec<usize> = (0..items.len()).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5155_4144);
    idx.shuffle(&mut rng);
    idx.into_iter().take(n).map(|i| items[i].clone()).collect()
}

/// The chat-formatted prompt of a QA item.
pub fn qa_prompt(tok: &Tokenizer, template: &str, item: &QaItem) -> Result<Vec<u32>, EvalError> {
    let user = template
        .replace("{context}", &item.context)
        .replace("{question}", &item.question);
    let text = tok.apply_chat_template(&[ChatMessage::user(user)], true)?;
    Ok(tok.encode(&text, false)?)
}

/// The answer in a generated text: its first non-empty line, trimmed.
pub fn first_line(text: &str) -> &str {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}
