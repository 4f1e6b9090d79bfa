//! The cluster's certificates: a certificate authority, and certificates it issues to nodes
//! (server and client authentication) and to admin clients (client authentication only).
//!
//! On disk a cluster directory holds `ca.pem` and `ca.key`, and `<name>.pem` / `<name>.key` for
//! each issued identity. Private keys are written with mode 0600 and never overwritten.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// What a certificate lets its holder do; recorded in the subject's OU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A cluster node: serves connections and opens them.
    Node,
    /// An admin client: opens connections only.
    Admin,
}

impl Role {
    /// The OU string written into certificates.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = PkiError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "node" => Ok(Role::Node),
            "admin" => Ok(Role::Admin),
            other => Err(PkiError::UnknownRole(other.to_owned())),
        }
    }
}

/// Errors creating, writing or loading certificates.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A name that cannot be a DNS name and file stem.
    #[error("invalid name {0:?}: use 1-63 characters of a-z, 0-9 and '-', not starting or ending with '-'")]
    InvalidName(String),
    /// An extra certificate name that is neither an IP address nor a DNS name.
    #[error("invalid extra name {0:?}: give an IP address or a DNS name (labels of a-z, 0-9 and '-', the first may be '*')")]
    InvalidAltName(String),
    /// A role string other than `node` or `admin`.
    #[error("unknown role {0:?}: expected node or admin")]
    UnknownRole(String),
    /// Refusing to overwrite an existing file (a CA or a key).
    #[error("{0} already exists; refusing to overwrite it")]
    Exists(PathBuf),
    /// File system error on a path.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A PEM file that does not hold what it should.
    #[error("{path}: {what}")]
    BadPem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rcgen failed to build or sign a certificate.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    /// A certificate that a peer holding the cluster CA would refuse.
    #[error("not accepted under the cluster CA: {0}")]
    NotSignedByCa(rustls::Error),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Check a node or admin name: it becomes a DNS SAN, the CN and a file stem.
pub fn validate_name(name: &str) -> Result<(), PkiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(PkiError::InvalidName(name.to_owned()))
    }
}

/// Check an extra name for a certificate: an IP address, or a DNS name of labels as
/// [`validate_name`] takes them, the first of which may be `*` (a wildcard).
pub fn validate_alt_name(alt: &str) -> Result<(), PkiError> {
    if alt.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let mut labels = alt.split('.').peekable();
    if labels.peek() == Some(&"*") {
        labels.next();
    }
    let mut any = false;
    for label in labels {
        validate_name(label).map_err(|_| PkiError::InvalidAltName(alt.to_owned()))?;
        any = true;
    }
    if any && alt.len() <= 253 {
        Ok(())
    } else {
        Err(PkiError::InvalidAltName(alt.to_owned()))
    }
}

/// A cluster certificate authority held in memory.
pub struct ClusterCa {
    cert_pem: String,
    key: KeyPair,
}

impl ClusterCa {
    /// Generate a fresh CA (ECDSA P-256) for a cluster called `cluster`.
    pub fn generate(cluster: &str) -> Result<Self, PkiError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("scd cluster CA {cluster}"));
        dn.push(DnType::OrganizationName, "scd");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key,
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issue a certificate for `name` with `role`; returns (certificate PEM, key PEM).
    pub fn issue_pem(&self, name: &str, role: Role) -> Result<(String, String), PkiError> {
        self.issue_pem_also_for(name, role, &[])
    }

    /// Issue a certificate for `name` with `role` that also names `also` (host names or IP
    /// addresses, [`validate_alt_name`]): a server reached by other names than its own, such
    /// as an etcd member behind a Service or on 127.0.0.1.
    pub fn issue_pem_also_for(
        &self,
        name: &str,
        role: Role,
        also: &[String],
    ) -> Result<(String, String), PkiError> {
        validate_name(name)?;
        for alt in also {
            validate_alt_name(alt)?;
        }
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, &self.key)?;
        let names = std::iter::once(name.to_owned()).chain(also.iter().cloned());
        let mut params = CertificateParams::new(names.collect::<Vec<_>>())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        dn.push(DnType::OrganizationalUnitName, role.as_str());
        dn.push(DnType::OrganizationName, "scd");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = match role {
            Role::Node => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            Role::Admin => vec![ExtendedKeyUsagePurpose::ClientAuth],
        };
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Issue an in-memory identity for `name` with `role` (tests, benchmarks, demos).
    pub fn issue(&self, name: &str, role: Role) -> Result<Identity, PkiError> {
        let (cert, key) = self.issue_pem(name, role)?;
        Identity::from_pem(
            self.cert_pem.as_bytes(),
            cert.as_bytes(),
            key.as_bytes(),
            Path::new("<memory>"),
        )
    }

    /// Write `ca.pem` and `ca.key` (0600) into `dir`, creating it; refuses to overwrite.
    pub fn save(&self, dir: &Path) -> Result<(), PkiError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        write_new(
            &dir.join("ca.key"),
            self.key.serialize_pem().as_bytes(),
            0o600,
        )?;
        write_new(&dir.join("ca.pem"), self.cert_pem.as_bytes(), 0o644)
    }

    /// Load `ca.pem` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, PkiError> {
        let cert_path = dir.join("ca.pem");
        let key_path = dir.join("ca.key");
        let cert_pem = fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
        let key_pem = fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| PkiError::BadPem {
            path: key_path.clone(),
            what: format!("not a private key: {e}"),
        })?;
        // Fail here rather than at the first issue if the certificate is unusable.
        Issuer::from_ca_cert_pem(&cert_pem, &key).map_err(|e| PkiError::BadPem {
            path: cert_path.clone(),
            what: format!("not a CA certificate: {e}"),
        })?;
        Ok(Self { cert_pem, key })
    }
}

/// Write a new file with `mode`; never overwrites.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                PkiError::Exists(path.to_owned())
            } else {
                PkiError::Io {
                    path: path.to_owned(),
                    source: e,
                }
            }
        })?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// `scd cert init`: create a cluster CA in `dir`. Returns the paths written.
pub fn init_ca_dir(dir: &Path, cluster: &str) -> Result<Vec<PathBuf>, PkiError> {
    if dir.join("ca.pem").exists() || dir.join("ca.key").exists() {
        return Err(PkiError::Exists(dir.join("ca.pem")));
    }
    ClusterCa::generate(cluster)?.save(dir)?;
    Ok(vec![dir.join("ca.pem"), dir.join("ca.key")])
}

/// `scd cert issue`: issue `<name>.pem` and `<name>.key` (0600) in `dir` with the CA found
/// there. Returns the paths written.
pub fn issue_in_dir(dir: &Path, name: &str, role: Role) -> Result<Vec<PathBuf>, PkiError> {
    issue_in_dir_also_for(dir, name, role, &[])
}

/// [`issue_in_dir`], the certificate also naming `also` ([`ClusterCa::issue_pem_also_for`]).
pub fn issue_in_dir_also_for(
    dir: &Path,
    name: &str,
    role: Role,
    also: &[String],
) -> Result<Vec<PathBuf>, PkiError> {
    validate_name(name)?;
    let ca = ClusterCa::load(dir)?;
    let cert_path = dir.join(format!("{name}.pem"));
    let key_path = dir.join(format!("{name}.key"));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            return Err(PkiError::Exists(p.clone()));
        }
    }
    let (cert, key) = ca.issue_pem_also_for(name, role, also)?;
    write_new(&key_path, key.as_bytes(), 0o600)?;
    write_new(&cert_path, cert.as_bytes(), 0o644)?;
    Ok(vec![cert_path, key_path])
}

/// What a node or admin presents and trusts: its certificate chain and key, and the cluster CA.
#[derive(Debug)]
pub struct Identity {
    /// This holder's certificate chain, leaf first.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// This holder's private key.
    pub key: PrivateKeyDer<'static>,
    /// The cluster CA: the only root trusted for peers.
    pub ca: CertificateDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

impl Identity {
    /// Load `ca.pem`, `<name>.pem` and `<name>.key` from a cluster directory.
    pub fn load(dir: &Path, name: &str) -> Result<Self, PkiError> {
        validate_name(name)?;
        let read = |p: PathBuf| fs::read(&p).map_err(io_err(&p));
        Self::from_pem(
            &read(dir.join("ca.pem"))?,
            &read(dir.join(format!("{name}.pem")))?,
            &read(dir.join(format!("{name}.key")))?,
            dir,
        )
    }

    /// Build an identity from PEM bytes; `origin` names the source in errors.
    pub fn from_pem(
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
        origin: &Path,
    ) -> Result<Self, PkiError> {
        let bad = |what: String| PkiError::BadPem {
            path: origin.to_owned(),
            what,
        };
        let ca = CertificateDer::from_pem_slice(ca_pem)
            .map_err(|e| bad(format!("CA certificate: {e}")))?;
        let cert_chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(format!("certificate: {e}")))?;
        if cert_chain.is_empty() {
            return Err(bad("no certificate found".into()));
        }
        let key =
            PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| bad(format!("private key: {e}")))?;
        Ok(Self {
            cert_chain,
            key,
            ca,
        })
    }
}

/// Who is at the other end of a connection, read from its (CA-verified) certificate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    /// The certificate's common name: the node or admin name.
    pub name: String,
    /// The role from the certificate's OU.
    pub role: Role,
}

/// Read name and role from a DER certificate issued by [`ClusterCa`].
pub fn peer_identity(der: &[u8]) -> Result<PeerIdentity, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("unparsable certificate: {e}"))?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|a| a.as_str().ok())
        .ok_or("certificate has no common name")?
        .to_owned();
    let role = subject
        .iter_organizational_unit()
        .next()
        .and_then(|a| a.as_str().ok())
        .ok_or("certificate has no role (OU)")?
        .parse::<Role>()
        .map_err(|e| e.to_string())?;
    Ok(PeerIdentity { name, role })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn names() {
        for ok in ["node-a", "a", "n1", "admin"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", "-a", "a-", "A", "a/b", "../x", "a.b", &"x".repeat(64)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn extra_names() {
        for ok in [
            "127.0.0.1",
            "::1",
            "etcd",
            "etcd-0.etcd.scd.svc",
            "*.etcd.scd.svc",
        ] {
            validate_alt_name(ok).unwrap();
        }
        for bad in [
            "", ".", "a..b", "*", "a.*.b", "Etcd", "a b", "etcd.", "-a.b",
        ] {
            assert!(
                matches!(validate_alt_name(bad), Err(PkiError::InvalidAltName(_))),
                "{bad}"
            );
        }
        let ca = ClusterCa::generate("test").unwrap();
        assert!(ca
            .issue_pem_also_for("etcd", Role::Node, &["a..b".into()])
            .is_err());
    }

    #[test]
    fn init_issue_load_with_private_key_modes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("pki");
        init_ca_dir(&d, "test").unwrap();
        assert!(matches!(init_ca_dir(&d, "test"), Err(PkiError::Exists(_))));
        issue_in_dir(&d, "node-a", Role::Node).unwrap();
        issue_in_dir(&d, "ops", Role::Admin).unwrap();
        assert!(matches!(
            issue_in_dir(&d, "node-a", Role::Node),
            Err(PkiError::Exists(_))
        ));
        for key in ["ca.key", "node-a.key", "ops.key"] {
            let mode = fs::metadata(d.join(key)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
        let id = Identity::load(&d, "node-a").unwrap();
        assert_eq!(
            peer_identity(&id.cert_chain[0]).unwrap(),
            PeerIdentity {
                name: "node-a".into(),
                role: Role::Node
            }
        );
        let id = Identity::load(&d, "ops").unwrap();
        assert_eq!(peer_identity(&id.cert_chain[0]).unwrap().role, Role::Admin);
        assert!(matches!(
            Identity::load(&d, "nobody"),
            Err(PkiError::Io { .. })
        ));
    }
}
