//! `scd cert`: the cluster certificate authority and the certificates it issues.

use std::path::PathBuf;

use anyhow::Context;
use scd_transport::pki::{init_ca_dir, issue_in_dir_also_for};
use scd_transport::Role;

/// Arguments of `scd cert`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    scd cert init --dir .cache/pki\n  \
    scd cert issue --dir .cache/pki --name producer --role node\n  \
    scd cert issue --dir .cache/pki --name ops --role admin\n  \
    scd cert init --dir .cache/pki/etcd --cluster scd-etcd\n  \
    scd cert issue --dir .cache/pki/etcd --name etcd --role node --also etcd --also 127.0.0.1")]
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
        scd cert issue --dir .cache/pki --name ops --role admin\n  \
        scd cert issue --dir .cache/pki/etcd --name etcd --role node --also 127.0.0.1")]
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
        /// Another name the certificate is valid for, a host name (the first label may be
        /// `*`) or an IP address: for a server reached by other names than NAME, such as
        /// etcd. Repeat for more.
        #[arg(long, value_name = "NAME_OR_IP")]
        also: Vec<String>,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let written = match args.command {
        Command::Init { dir, cluster } => init_ca_dir(&dir, &cluster)
            .with_context(|| format!("creating a cluster CA in {}", dir.display()))?,
        Command::Issue {
            dir,
            name,
            role,
            also,
        } => {
            let role: Role = role.parse()?;
            issue_in_dir_also_for(&dir, &name, role, &also).with_context(|| {
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
