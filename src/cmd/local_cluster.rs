//! An in-process cluster for the benchmarks that run jobs through real nodes: node configs on
//! the embedded store with a throwaway CA, nodes that share one set of loaded models, a job run
//! to its end, and the median the tables report.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use scd_actors::{ClusterClient, Node, NodeConfig, Served};
use scd_scheduler::{JobRecord, JobRequest, JobState, MetaStore};
use scd_transport::{ClusterCa, Role};
use scd_types::Mode;
use tokio_util::sync::CancellationToken;

/// A node config on the embedded store: `roles` as TOML list items, `body` the sections
/// between `[node]` and `[store]`.
pub fn config(id: &str, roles: &str, body: &str) -> anyhow::Result<NodeConfig> {
    let text = format!(
        "[node]\nid = \"{id}\"\nlisten = \"127.0.0.1:0\"\nroles = [{roles}]\n\n{body}\n\
         [store]\nkind = \"embedded\"\n\n\
         [tls]\nca = \"unused.pem\"\ncert = \"unused.pem\"\nkey = \"unused.key\"\n"
    );
    NodeConfig::parse(&text, Path::new(".")).context("building the bench's node configs")
}

/// `[models]` with the base, and one `[[experts]]` table per `(name, folder)` (the folder
/// holds adapter.safetensors and translator/).
pub fn models_section(model: &Path, experts: &[(&str, &Path)]) -> String {
    let mut text = format!("[models]\nbase = \"{}\"\n\n", model.display());
    for (name, dir) in experts {
        text.push_str(&format!(
            "[[experts]]\nname = \"{name}\"\nadapter = \"{}\"\ntranslator = \"{}\"\n\n",
            dir.display(),
            dir.join("translator").display()
        ));
    }
    text
}

/// Nodes on one embedded store sharing `served`, and a client.
pub struct Cluster {
    pub store: Arc<dyn MetaStore>,
    pub ca: ClusterCa,
    pub served: Arc<Served>,
    pub client: ClusterClient,
}

impl Cluster {
    /// A fresh embedded store, a throwaway CA, and nodes that will share `served`.
    pub fn new(served: Arc<Served>) -> anyhow::Result<Self> {
        let store: Arc<dyn MetaStore> = Arc::new(scd_scheduler::EmbeddedStore::new());
        Ok(Self {
            client: ClusterClient::new(store.clone(), scd_scheduler::Keys::default()),
            store,
            ca: ClusterCa::generate("bench")?,
            served,
        })
    }

    /// Starts a node from `cfg`.
    pub async fn start(&self, cfg: &NodeConfig) -> anyhow::Result<Node> {
        let identity = self.ca.issue(&cfg.node.id, Role::Node)?;
        Node::start(
            cfg,
            &identity,
            self.served.clone(),
            self.store.clone(),
            None,
            CancellationToken::new(),
        )
        .await
        .with_context(|| format!("starting node {}", cfg.node.id))
    }

    /// Runs a one-token greedy job of `expert` in `mode` to its end; its record.
    pub async fn run(&self, expert: &str, mode: Mode, prompt: &[u32]) -> anyhow::Result<JobRecord> {
        let request = JobRequest {
            prompt: prompt.to_vec(),
            max_tokens: 1,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop_tokens: Vec::new(),
            documents: Vec::new(),
        };
        let id = self.client.submit(expert, mode, request).await?;
        let job = self.client.wait(id, Duration::from_secs(600)).await?;
        if job.state != JobState::Done {
            bail!(
                "job {id} ({mode}) ended {}: {}",
                job.state,
                job.error.as_deref().unwrap_or("no reason recorded")
            );
        }
        Ok(job)
    }
}

/// The median of `v` (NaN when empty): the benchmarks' summary of per-job figures.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
