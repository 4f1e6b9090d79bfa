//! The cluster state of scd: a `MetaStore` trait with an etcd implementation and an embedded
//! one, membership by leases, leader election among scheduler replicas, producer pools per
//! expert, translator versions per model pair, and durable job records.
#![warn(missing_docs)]
