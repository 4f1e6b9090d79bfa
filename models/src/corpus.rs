//! Text corpora for fine-tuning and evaluation: where they live, their fixed train/validation
//! splits, content hashes for manifests, and cutting tokenised text into training windows.
//!
//! A named corpus (`moby-dick`, `sotu`, `brown`, `mail`) is a directory `<data dir>/<name>/` holding
//! `train.txt` and `valid.txt`, written by `ops/fetch-corpora.sh` with document-level splits
//! (docs/data.md). A corpus may also be any directory with those two files, or a single text
//! file, which is split by [`SINGLE_FILE_SPLIT`].
//!
//! WikiText-2 and SQuAD are read from the evaluation data folder ([`WIKITEXT2_VALID`],
//! [`SQUAD_PART`] inside it; the repository ships them in `data/`). The library never guesses where folders are: the binary resolves
//! them (flags, environment, defaults) and passes them in.

use std::path::{Path, PathBuf};

use rand::Rng;
use sha2::{Digest, Sha256};

/// The rule a single-file corpus is split by.
pub const SINGLE_FILE_SPLIT: &str =
    "single file: validation = the last 10% of the lines, train = the rest";

/// The corpora `ops/fetch-corpora.sh` provides, with the split rule it applies.
pub const NAMED: [(&str, &str); 4] = [
    (
        "moby-dick",
        "by chapter: validation = chapters whose number is a multiple of 10, train = the rest",
    ),
    (
        "sotu",
        "addresses sorted by (year, president): validation = every 10th from the first",
    ),
    (
        "brown",
        "files sorted by name: validation = every 10th from the first",
    ),
    (
        "mail",
        "raw messages (base64 bodies dropped) sorted by (group, id): validation = every 10th from the first",
    ),
];

/// Errors of reading a corpus or a data file.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    /// A file could not be read.
    #[error("cannot read {path}: {source} (named corpora come from ops/fetch-corpora.sh, WikiText-2 and SQuAD from the evaluation data folder (data/ in the repository, or --eval-data))")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A corpus that is neither a known name nor an existing path.
    #[error("unknown corpus {0:?}: expected moby-dick, sotu, brown, mail, a directory with train.txt and valid.txt, or a text file")]
    Unknown(String),
    /// A split that is too short for what was asked of it.
    #[error("the {split} split has {tokens} tokens, fewer than the {needed} needed")]
    TooShort {
        /// `train` or `valid`.
        split: &'static str,
        /// Tokens available.
        tokens: usize,
        /// Tokens needed.
        needed: usize,
    },
    /// A data file whose content is not what was expected.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Where WikiText-2's validation split sits inside the evaluation data folder (data/).
pub const WIKITEXT2_VALID: &str = "wikitext-2/valid.txt";

/// Where the SQuAD 2.0 dev part sits inside the evaluation data folder (data/).
pub const SQUAD_PART: &str = "squad/dev-v2.0-part.json";

/// Hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Reads a file, naming it in the error.
pub fn read_text(path: &Path) -> Result<String, CorpusError> {
    std::fs::read_to_string(path).map_err(|source| CorpusError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// A corpus with its two splits in memory.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// The name given (a known name, or the path as given).
    pub name: String,
    /// Where the train split came from.
    pub train_path: PathBuf,
    /// Where the validation split came from (the same file for a single-file corpus).
    pub valid_path: PathBuf,
    /// How train and validation were separated.
    pub split_rule: String,
    /// Train text.
    pub train: String,
    /// Validation text.
    pub valid: String,
    /// Hex SHA-256 of the train text.
    pub train_sha256: String,
    /// Hex SHA-256 of the validation text.
    pub valid_sha256: String,
}

impl Corpus {
    /// Opens `spec`: a known name under `data_dir`, a directory with `train.txt` and
    /// `valid.txt`, or a single text file.
    pub fn open(spec: &str, data_dir: &Path) -> Result<Self, CorpusError> {
        if let Some((name, rule)) = NAMED.iter().find(|(n, _)| *n == spec) {
            let dir = data_dir.join(name);
            return Self::from_dir(name, &dir, rule);
        }
        let path = Path::new(spec);
        if path.is_dir() {
            return Self::from_dir(spec, path, "train.txt / valid.txt as given");
        }
        if path.is_file() {
            let text = read_text(path)?;
            let lines: Vec<&str> = text.lines().collect();
            let cut = lines.len() - lines.len() / 10;
            let train = lines[..cut].join("\n");
            let valid = lines[cut..].join("\n");
            return Ok(Self::from_texts(
                spec,
                path.to_path_buf(),
                path.to_path_buf(),
                SINGLE_FILE_SPLIT,
                train,
                valid,
            ));
        }
        Err(CorpusError::Unknown(spec.into()))
    }

    fn from_dir(name: &str, dir: &Path, rule: &str) -> Result<Self, CorpusError> {
        let train_path = dir.join("train.txt");
        let valid_path = dir.join("valid.txt");
        let train = read_text(&train_path)?;
        let valid = read_text(&valid_path)?;
        Ok(Self::from_texts(
            name, train_path, valid_path, rule, train, valid,
        ))
    }

    /// A corpus from two texts already in memory.
    pub fn from_texts(
        name: &str,
        train_path: PathBuf,
        valid_path: PathBuf,
        split_rule: &str,
        train: String,
        valid: String,
    ) -> Self {
        Self {
            name: name.into(),
            train_path,
            valid_path,
            split_rule: split_rule.into(),
            train_sha256: sha256_hex(train.as_bytes()),
            valid_sha256: sha256_hex(valid.as_bytes()),
            train,
            valid,
        }
    }
}

/// Tokenises a long text in pieces of about [`PIECE_BYTES`] cut at line ends (the tokenizer is
/// much slower on one huge input); the pieces' ids are concatenated. The pre-tokenizer splits
/// at line ends anyway, so the result differs from one call over the whole text at most where a
/// piece boundary falls inside a run of blank lines. Special-token text stays ordinary text.
pub fn tokenize_long(
    tok: &crate::tokenizer::Tokenizer,
    text: &str,
) -> Result<Vec<u32>, crate::tokenizer::TokenizerError> {
    let mut out = Vec::with_capacity(text.len() / 4);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + PIECE_BYTES).min(text.len());
        while end < text.len() && !text.is_char_boundary(end) {
            end += 1;
        }
        if end < text.len() {
            if let Some(nl) = text[start..end].rfind('\n') {
                end = start + nl + 1;
            }
        }
        out.extend(tok.encode_plain(&text[start..end], false)?);
        start = end;
    }
    Ok(out)
}

/// Bytes per tokenizer call in [`tokenize_long`].
pub const PIECE_BYTES: usize = 16 * 1024;

/// `n` windows of `len` tokens spread evenly over `tokens` (start to end), for a fixed
/// validation set.
pub fn even_windows(
    tokens: &[u32],
    len: usize,
    n: usize,
    split: &'static str,
) -> Result<Vec<Vec<u32>>, CorpusError> {
    if tokens.len() < len || n == 0 {
        return Err(CorpusError::TooShort {
            split,
            tokens: tokens.len(),
            needed: len.max(1),
        });
    }
    let room = tokens.len() - len;
    Ok((0..n)
        .map(|i| {
            let start = if n == 1 { 0 } else { room * i / (n - 1) };
            tokens[start..start + len].to_vec()
        })
        .collect())
}

/// A window of `len` tokens at a uniformly random start.
pub fn random_window<R: Rng>(tokens: &[u32], len: usize, rng: &mut R) -> Vec<u32> {
    let start = rng.gen_range(0..=tokens.len() - len);
    tokens[start..start + len].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_windows_cover_both_ends() {
        let t: Vec<u32> = (0..100).collect();
        let w = even_windows(&t, 10, 3, "valid").unwrap();
        assert_eq!(w[0][0], 0);
        assert_eq!(w[2][9], 99);
        assert_eq!(w[1][0], 45);
        assert!(even_windows(&t, 101, 1, "valid").is_err());
    }

    #[test]
    fn single_file_corpus_splits_last_tenth() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        let text: Vec<String> = (0..20).map(|i| format!("line {i}")).collect();
        std::fs::write(&p, text.join("\n")).unwrap();
        let c = Corpus::open(p.to_str().unwrap(), dir.path()).unwrap();
        assert_eq!(c.valid, "line 18\nline 19");
        assert!(c.train.ends_with("line 17"));
        assert_eq!(c.train_sha256, sha256_hex(c.train.as_bytes()));
        assert!(matches!(
            Corpus::open("no-such-corpus", dir.path()),
            Err(CorpusError::Unknown(_))
        ));
    }
}
