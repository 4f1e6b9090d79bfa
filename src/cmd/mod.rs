//! One module per subcommand.

pub mod generate;
