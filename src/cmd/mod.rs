//! One module per subcommand.

pub mod admin;
pub mod bench;
pub mod bench_codes;
pub mod bench_decode;
pub mod bench_docs;
pub mod bench_fanout;
pub mod bench_links;
pub mod bench_memory;
pub mod bench_model;
pub mod bench_transport;
pub mod bench_ttft;
pub mod calibrate;
pub mod cert;
pub mod demo;
pub mod demo_paced;
pub mod docs;
pub mod eval;
pub mod finetune;
pub mod generate;
pub mod local_cluster;
pub mod node;
pub mod sempic;
pub mod translators;
