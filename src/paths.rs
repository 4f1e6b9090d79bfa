//! Where the data lives. The libraries never guess: the folders they read are resolved here,
//! from a flag, else an environment variable, else a default relative to the working directory
//! (the repository root when run through `make`), and passed in.

use std::path::PathBuf;

/// The data folders of the offline commands.
#[derive(clap::Args, Clone, Debug)]
pub struct DataDirs {
    /// Folder of the named corpora (moby-dick, sotu, brown), written by ops/fetch-corpora.sh.
    #[arg(long, env = "SCD_DATA_DIR", default_value = ".cache/data")]
    pub data_dir: PathBuf,
    /// Folder of the evaluation sets (wikitext-2/valid.txt, squad/dev-v2.0-part.json); the
    /// repository ships them in `data/` (see data/README.md for sources and licences).
    #[arg(long, env = "SCD_EVAL_DATA", default_value = "data")]
    pub eval_data: PathBuf,
}
