//! `scd cert`: the cluster certificate authority and the certificates it issues.

use std::path::PathBuf;

use anyhow::Context;
use scd_transport::pki::{init_ca_dir, issue_in_dir};
use scd_transport::Role;

/// Arguments of `scd cert`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd cert init --dir .cache/pki\n  \
    scd cert issue --dir .cache/pki --name producer --role node\n  \
    scd cert issue --dir .cache/pki --name ops --role admin")]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Create a cluster CA (ca.pem, ca.key with mode 0600) in a directory.
    #[command(after_help = "Example:\n  scd cert init --dir .cache/pki --cluster prod")]
    Init {
        /// Directory for the cluster's certificates (created if missing).
        #[arg(long)]
        dir: PathBuf,
        /// Cluster name written into the CA's subject.
        #[arg(long, default_value = "scd")]
        cluster: String,
    },
    /// Issue a node or admin certificate (<name>.pem, <name>.key with mode 0600) signed by the CA in DIR.
    #[command(after_help = "Examples:\n  \
        scd cert issue --dir .cache/pki --name consumer-a --role node\n  \
        scd cert issue --dir .cache/pki --name ops --role admin")]
    Issue {
        /// Directory holding ca.pem and ca.key.
        #[arg(long)]
        dir: PathBuf,
        /// Node or admin name (a-z, 0-9, '-'): the certificate's CN and DNS name.
        #[arg(long)]
        name: String,
        /// node (serves and connects) or admin (connects only).
        #[arg(long, value_parser = ["node", "admin"])]
        role: String,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let written = match args.command {
        Command::Init { dir, cluster } => init_ca_dir(&dir, &cluster)
            .with_context(|| format!("creating a cluster CA in {}", dir.display()))?,
        Command::Issue { dir, name, role } => {
            let role: Role = role.parse()?;
            issue_in_dir(&dir, &name, role).with_context(|| {
                format!(
                    "issuing a {role} certificate for {name:?} from the CA in {}",
                    dir.display()
                )
            })?
        }
    };
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}
