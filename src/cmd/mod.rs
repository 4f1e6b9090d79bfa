//! One module per subcommand.

pub mod generate;
pub mod bench;
pub mod bench_model;
pub mod bench_transport;
pub mod cert;
