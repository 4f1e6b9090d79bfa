//! Typed builders for the key layout of the cluster state (see `docs/architecture.md` §4). Every
//! key is built here, so a typo cannot invent a new key, and every id is checked to be one path
//! segment (a [`JobId`] is one by construction, so job keys cannot fail).

use scd_types::JobId;

/// The default root of every scd key.
pub const DEFAULT_ROOT: &str = "/scd/v1";

/// The word reserved for the live translator version; it cannot be a version name.
pub const ACTIVE: &str = "active";

/// An id that cannot be one key segment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: ids must be non-empty, at most 128 bytes, without '/', whitespace or control characters")]
pub struct InvalidId {
    /// What the id names (node, model, job, ...).
    pub what: &'static str,
    /// The offending value.
    pub value: String,
}

/// Checks that `value` can be one key segment.
pub fn check_id(what: &'static str, value: &str) -> Result<(), InvalidId> {
    if scd_types::is_key_segment(value) {
        Ok(())
    } else {
        Err(InvalidId {
            what,
            value: value.to_string(),
        })
    }
}

/// Key builders under one root (several clusters can share one etcd under different roots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Default for Keys {
    fn default() -> Self {
        Self {
            root: DEFAULT_ROOT.to_string(),
        }
    }
}

impl Keys {
    /// Keys under a custom root such as `/scd/v1` (a trailing slash is removed).
    pub fn new(root: impl Into<String>) -> Self {
        let mut root = root.into();
        while root.ends_with('/') {
            root.pop();
        }
        Self { root }
    }

    /// The root.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `<root>/admission`, the count of unfinished jobs and its bound.
    pub fn admission(&self) -> String {
        format!("{}/admission", self.root)
    }

    /// `<root>/nodes/`
    pub fn nodes_prefix(&self) -> String {
        format!("{}/nodes/", self.root)
    }

    /// `<root>/nodes/<node-id>`
    pub fn node(&self, node_id: &str) -> Result<String, InvalidId> {
        check_id("node id", node_id)?;
        Ok(format!("{}{node_id}", self.nodes_prefix()))
    }

    /// `<root>/models/`
    pub fn models_prefix(&self) -> String {
        format!("{}/models/", self.root)
    }

    /// `<root>/models/<model-id>`
    pub fn model(&self, model_id: &str) -> Result<String, InvalidId> {
        check_id("model id", model_id)?;
        Ok(format!("{}{model_id}", self.models_prefix()))
    }

    /// `<root>/translators/`: every pair's versions.
    pub fn all_translators_prefix(&self) -> String {
        format!("{}/translators/", self.root)
    }

    /// `<root>/translators/<producer>/<consumer>/`
    pub fn translators_prefix(&self, producer: &str, consumer: &str) -> Result<String, InvalidId> {
        check_id("producer model id", producer)?;
        check_id("consumer model id", consumer)?;
        Ok(format!("{}/translators/{producer}/{consumer}/", self.root))
    }

    /// `<root>/translators/<producer>/<consumer>/<version>`
    pub fn translator_version(
        &self,
        producer: &str,
        consumer: &str,
        version: &str,
    ) -> Result<String, InvalidId> {
        check_id("translator version", version)?;
        if version == ACTIVE {
            return Err(InvalidId {
                what: "translator version",
                value: version.to_string(),
            });
        }
        Ok(format!(
            "{}{version}",
            self.translators_prefix(producer, consumer)?
        ))
    }

    /// `<root>/translators/<producer>/<consumer>/active`
    pub fn translator_active(&self, producer: &str, consumer: &str) -> Result<String, InvalidId> {
        Ok(format!(
            "{}{ACTIVE}",
            self.translators_prefix(producer, consumer)?
        ))
    }

    /// `<root>/pools/`
    pub fn pools_prefix(&self) -> String {
        format!("{}/pools/", self.root)
    }

    /// `<root>/pools/<expert-model>`
    pub fn pool(&self, expert: &str) -> Result<String, InvalidId> {
        check_id("expert model id", expert)?;
        Ok(format!("{}{expert}", self.pools_prefix()))
    }

    /// `<root>/jobs/`
    pub fn jobs_prefix(&self) -> String {
        format!("{}/jobs/", self.root)
    }

    /// `<root>/jobs/<job-id>`, the id in its 32-hex-digit text form.
    pub fn job(&self, job_id: JobId) -> String {
        format!("{}{job_id}", self.jobs_prefix())
    }

    /// `<root>/archive/jobs/`: finished job records moved out of the live prefix, kept for the
    /// retention (age and count).
    pub fn archived_jobs_prefix(&self) -> String {
        format!("{}/archive/jobs/", self.root)
    }

    /// `<root>/archive/jobs/<job-id>`
    pub fn archived_job(&self, job_id: JobId) -> String {
        format!("{}{job_id}", self.archived_jobs_prefix())
    }

    /// `<root>/progress/`: the output a decoding job's consumer appends between record
    /// writes ([`crate::jobs::JobStore::append_output`]); outside the jobs prefix, so that a
    /// listing of jobs reads records only.
    pub fn progress_prefix(&self) -> String {
        format!("{}/progress/", self.root)
    }

    /// `<root>/progress/<job-id>/`: every key of one job's appended output.
    pub fn job_progress(&self, job_id: JobId) -> String {
        format!("{}{job_id}/", self.progress_prefix())
    }

    /// `<root>/documents/`
    pub fn documents_prefix(&self) -> String {
        format!("{}/documents/", self.root)
    }

    /// `<root>/documents/<document-id>`; the id must have [`scd_types::document_id`]'s form.
    pub fn document(&self, id: &str) -> Result<String, InvalidId> {
        if !scd_types::is_document_id(id) {
            return Err(InvalidId {
                what: "document id (32 lower-case hex digits)",
                value: id.to_string(),
            });
        }
        Ok(format!("{}{id}", self.documents_prefix()))
    }

    /// `<root>/election/<name>` (the scheduler's is `scheduler`).
    pub fn election(&self, name: &str) -> Result<String, InvalidId> {
        check_id("election name", name)?;
        Ok(format!("{}/election/{name}", self.root))
    }

    /// The id at the end of a key under `prefix`, if the key is directly under it.
    pub fn id_under<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(prefix)
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_architecture() {
        let k = Keys::default();
        assert_eq!(k.node("n1").unwrap(), "/scd/v1/nodes/n1");
        assert_eq!(k.model("smollm").unwrap(), "/scd/v1/models/smollm");
        assert_eq!(
            k.translator_version("base", "sotu", "v3").unwrap(),
            "/scd/v1/translators/base/sotu/v3"
        );
        assert_eq!(
            k.translator_active("base", "sotu").unwrap(),
            "/scd/v1/translators/base/sotu/active"
        );
        assert_eq!(k.pool("sotu").unwrap(), "/scd/v1/pools/sotu");
        assert_eq!(
            k.job(JobId::from_u128(0xa1)),
            "/scd/v1/jobs/000000000000000000000000000000a1"
        );
        assert_eq!(
            k.archived_job(JobId::from_u128(0xa1)),
            "/scd/v1/archive/jobs/000000000000000000000000000000a1"
        );
        assert_eq!(
            k.job_progress(JobId::from_u128(0xa1)),
            "/scd/v1/progress/000000000000000000000000000000a1/"
        );
        assert!(!k.progress_prefix().starts_with(&k.jobs_prefix()));
        // The live prefix does not hold the archive.
        assert!(!k.archived_jobs_prefix().starts_with(&k.jobs_prefix()));
        assert_eq!(
            k.election("scheduler").unwrap(),
            "/scd/v1/election/scheduler"
        );
        assert_eq!(Keys::new("/x/").node("a").unwrap(), "/x/nodes/a");
        let doc = scd_types::document_id(&[1, 2, 3]);
        assert_eq!(
            k.document(&doc).unwrap(),
            format!("/scd/v1/documents/{doc}")
        );
    }

    #[test]
    fn ids_must_be_one_segment() {
        let k = Keys::default();
        assert!(k.node("").is_err());
        assert!(k.node("a/b").is_err());
        assert!(k.pool("a b").is_err());
        assert!(k.translator_version("p", "c", ACTIVE).is_err());
        assert!(k.model(&"x".repeat(129)).is_err());
        assert!(k.document("abc").is_err());
        assert!(k.document(&"A".repeat(32)).is_err());
    }

    #[test]
    fn id_under_takes_direct_children_only() {
        assert_eq!(Keys::id_under("/p/", "/p/a"), Some("a"));
        assert_eq!(Keys::id_under("/p/", "/p/a/b"), None);
        assert_eq!(Keys::id_under("/p/", "/q/a"), None);
    }
}
