//! The cluster state of scd, kept in etcd (or, for one process, in an embedded store with the
//! same semantics).
//!
//! * [`store`]: the `MetaStore` trait (get, prefix reads, puts under leases, transactions,
//!   leases, resumable watches) with [`EtcdStore`] and [`EmbeddedStore`].
//! * [`keys`] and [`envelope`]: the typed key layout and the versioned JSON values.
//! * [`membership`]: node registration under a self-healing lease, and the live node view.
//! * [`leader`]: leader election among scheduler replicas with a lease-backed lock and a fence
//!   for the leader's writes.
//! * [`assign`] and [`prefix`]: pure assignment logic (pools per expert, producer choice with
//!   prefix affinity) and the prompt-prefix block hashes it matches on.
//! * [`translators`]: translator versions per model pair (publish, activate, roll back, watch,
//!   and the stale-hash guard), named by their [`TranslatorHash`].
//! * [`admission`]: the cluster-wide bound on unfinished jobs (submissions past it are answered
//!   busy, with a retry hint), kept exact by transactions.
//! * [`jobs`]: durable job records keyed by [`JobId`], moved through the [`JobState`] machine
//!   (cancelling included) by compare-and-swap; each record carries its [`Mode`] and the
//!   [`TraceContext`] that joins its spans across nodes.
//! * [`models`]: model records.
//! * [`documents`]: documents that jobs name by id (SemPIC), with their tokens.
//! * [`service`]: the scheduler replica that ties them together while it leads.
//! * `etcd_server` (feature `test-util`, off by default): a throwaway etcd process for tests,
//!   examples and local runs, which checks that the etcd answering on its port is the one it
//!   started; and `store::HookedStore`, a store wrapper through which tests inject faults.
//!
//! Job ids, job states, modes, translator hashes and trace contexts are the shared types of
//! `scd-types`, re-exported here, so the records hold the same values the wire and the command
//! line carry; their JSON forms are those types' own. The crate knows nothing of transport or
//! models.
#![warn(missing_docs)]

pub mod admission;
pub mod assign;
pub mod documents;
pub mod envelope;
#[cfg(feature = "test-util")]
pub mod etcd_server;
pub mod jobs;
pub mod keys;
pub mod leader;
pub mod membership;
pub mod models;
pub mod prefix;
pub mod service;
pub mod store;
pub mod translators;

pub use admission::{AdmissionRecord, Busy};
pub use assign::{
    choose_consumer, choose_producer, compute_pools, ExpertSpec, Pools, ProducerChoice,
};
pub use documents::{DocumentError, DocumentRecord, DocumentRegistry, MAX_DOCUMENT_TOKENS};
#[cfg(feature = "test-util")]
pub use etcd_server::{EtcdServer, EtcdServerError, ServingTls};
pub use jobs::{
    Appended, ArchiveConfig, Blame, DocumentsRecord, JobError, JobRecord, JobStore, ModeChoice,
    ModeEstimate, ModeFallback, RanksChoice, RanksRule, Retired,
};
pub use keys::Keys;
pub use leader::{Candidate, ElectionConfig, LeaderGuard, Leadership};
pub use membership::{
    LiveNodes, NodeInfo, NodeMap, Registration, RegistrationConfig, RegistrationEvent,
};
pub use models::{ModelRecord, ModelRegistry};
pub use scd_types::{
    JobId, JobRequest, JobResult, JobState, Mode, NodeId, Ranks, StageSpan, TraceContext,
    TranslatorHash,
};
pub use service::{AttemptDeadline, Scheduler, SchedulerConfig, SchedulerError};
pub use store::{EmbeddedStore, EtcdStore, EtcdTls, MetaStore, StoreError};
pub use translators::{
    check_translator, ActiveTranslator, Degraded, PairTranslators, StaleTranslator,
    TranslatorError, TranslatorManifest, TranslatorRegistry, TranslatorWatcher,
};
