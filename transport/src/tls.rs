//! TLS for the cluster: rustls server and client configurations built from a node's
//! [`Identity`] (its certificate chain, its key and the cluster CA), both requiring a peer
//! certificate signed by the CA (mutual TLS, TLS 1.3 only, ring as the crypto provider), and
//! the reading of TLS alerts out of QUIC connection errors, so that a refused handshake can be
//! reported as what it was.

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ConnectionError, TransportConfig, TransportErrorCode};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::pki::Identity;

/// A node's identity cannot be turned into a TLS configuration.
#[derive(Debug, thiserror::Error)]
#[error("TLS configuration: {0}")]
pub struct TlsConfigError(String);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Check that `identity`'s certificate chain is accepted under its own CA by the verifier the
/// handshake uses (signature, validity period, client use, which node and admin certificates
/// both carry), so that a certificate from another cluster's CA is refused when a node starts
/// rather than at its first connection.
pub fn verify_signed_by_ca(identity: &Identity) -> Result<(), crate::pki::PkiError> {
    let refused = crate::pki::PkiError::NotSignedByCa;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(identity.ca.clone()).map_err(refused)?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider())
            .build()
            .map_err(|e| refused(rustls::Error::General(e.to_string())))?;
    let (leaf, intermediates) = identity
        .cert_chain
        .split_first()
        .ok_or_else(|| refused(rustls::Error::NoCertificatesPresented))?;
    verifier
        .verify_client_cert(leaf, intermediates, rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(refused)
}

/// Trust anchors: the cluster CA and nothing else.
fn roots(identity: &Identity) -> Result<Arc<RootCertStore>, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(identity.ca.clone())
        .map_err(|e| TlsConfigError(format!("cluster CA: {e}")))?;
    Ok(Arc::new(roots))
}

fn tls_err(e: impl std::fmt::Display) -> TlsConfigError {
    TlsConfigError(e.to_string())
}

/// The rustls server side: present the identity's chain, require a client certificate signed by
/// the cluster CA, offer `alpn`.
pub(crate) fn server_crypto(
    identity: &Identity,
    alpn: Vec<u8>,
) -> Result<rustls::ServerConfig, TlsConfigError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(tls_err)?;
    let mut crypto = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls_err)?;
    crypto.alpn_protocols = vec![alpn];
    Ok(crypto)
}

/// The rustls client side: trust only the cluster CA, present the identity's chain, offer
/// `alpn`.
pub(crate) fn client_crypto(
    identity: &Identity,
    alpn: Vec<u8>,
) -> Result<rustls::ClientConfig, TlsConfigError> {
    let mut crypto = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_root_certificates(roots(identity)?)
        .with_client_auth_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(tls_err)?;
    crypto.alpn_protocols = vec![alpn];
    Ok(crypto)
}

/// A quinn server config: [`server_crypto`] with `transport`.
pub(crate) fn server_config(
    identity: &Identity,
    alpn: Vec<u8>,
    transport: Arc<TransportConfig>,
) -> Result<quinn::ServerConfig, TlsConfigError> {
    let quic = QuicServerConfig::try_from(server_crypto(identity, alpn)?).map_err(tls_err)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    config.transport_config(transport);
    Ok(config)
}

/// A quinn client config: [`client_crypto`] with `transport`.
pub(crate) fn client_config(
    identity: &Identity,
    alpn: Vec<u8>,
    transport: Arc<TransportConfig>,
) -> Result<quinn::ClientConfig, TlsConfigError> {
    let quic = QuicClientConfig::try_from(client_crypto(identity, alpn)?).map_err(tls_err)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(transport);
    Ok(config)
}

// TLS alert numbers (RFC 8446 section 6); QUIC reports them as CRYPTO_ERROR 0x100 + alert.
const ALERT_BAD_CERTIFICATE: u8 = 42;
const ALERT_UNSUPPORTED_CERTIFICATE: u8 = 43;
const ALERT_CERTIFICATE_UNKNOWN: u8 = 46;
const ALERT_UNKNOWN_CA: u8 = 48;
const ALERT_ACCESS_DENIED: u8 = 49;
const ALERT_DECRYPT_ERROR: u8 = 51;
const ALERT_CERTIFICATE_REQUIRED: u8 = 116;
const ALERT_NO_APPLICATION_PROTOCOL: u8 = 120;

/// What a TLS alert in a failed handshake means for the peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AlertKind {
    /// No common ALPN: the peers speak different protocol versions.
    NoCommonProtocol,
    /// A certificate was refused. `raised_here`: this side raised the alert (it refused the
    /// peer's certificate); otherwise the peer refused ours. `text` names the alert.
    Certificate { raised_here: bool, text: String },
}

/// The TLS alert a connection error carries, if any, read as what it means.
pub(crate) fn alert(e: &ConnectionError) -> Option<AlertKind> {
    let (code, reason, raised_here) = match e {
        ConnectionError::TransportError(t) => (t.code, t.reason.clone(), true),
        ConnectionError::ConnectionClosed(c) => (
            c.error_code,
            String::from_utf8_lossy(&c.reason).into_owned(),
            false,
        ),
        _ => return None,
    };
    let raw = u64::from(code);
    if !(0x100..0x200).contains(&raw) {
        return None;
    }
    let alert = (raw - 0x100) as u8;
    if code != TransportErrorCode::crypto(alert) {
        return None;
    }
    if alert == ALERT_NO_APPLICATION_PROTOCOL {
        return Some(AlertKind::NoCommonProtocol);
    }
    is_cert_alert(alert).then(|| AlertKind::Certificate {
        raised_here,
        text: alert_text(alert, &reason),
    })
}

fn alert_text(alert: u8, reason: &str) -> String {
    let name = match alert {
        ALERT_BAD_CERTIFICATE => "bad certificate",
        ALERT_UNSUPPORTED_CERTIFICATE => "unsupported certificate",
        ALERT_CERTIFICATE_UNKNOWN => "certificate unknown",
        ALERT_UNKNOWN_CA => "unknown CA",
        ALERT_ACCESS_DENIED => "access denied",
        ALERT_DECRYPT_ERROR => "decrypt error",
        ALERT_CERTIFICATE_REQUIRED => "certificate required",
        _ => "TLS alert",
    };
    if reason.is_empty() {
        format!("{name} (alert {alert})")
    } else {
        format!("{name} (alert {alert}): {reason}")
    }
}

fn is_cert_alert(alert: u8) -> bool {
    matches!(
        alert,
        ALERT_BAD_CERTIFICATE
            | ALERT_UNSUPPORTED_CERTIFICATE
            | ALERT_CERTIFICATE_UNKNOWN
            | ALERT_UNKNOWN_CA
            | ALERT_ACCESS_DENIED
            | ALERT_DECRYPT_ERROR
            | ALERT_CERTIFICATE_REQUIRED
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    fn raised(alert: u8) -> ConnectionError {
        ConnectionError::TransportError(TransportErrorCode::crypto(alert).into())
    }

    #[test]
    fn alerts_are_read_as_what_they_mean() {
        assert_eq!(
            alert(&raised(ALERT_NO_APPLICATION_PROTOCOL)),
            Some(AlertKind::NoCommonProtocol)
        );
        assert_eq!(
            alert(&raised(ALERT_UNKNOWN_CA)),
            Some(AlertKind::Certificate {
                raised_here: true,
                text: "unknown CA (alert 48)".into()
            })
        );
        // An alert that is not about certificates or ALPN is left to the caller.
        assert_eq!(alert(&raised(80)), None);
        assert_eq!(alert(&ConnectionError::TimedOut), None);
    }

    #[test]
    fn a_certificate_is_checked_against_the_ca_that_should_have_signed_it() {
        // Same cluster name, so both CAs have the same subject: only the signature tells them apart.
        let ours = crate::pki::ClusterCa::generate("scd").unwrap();
        let theirs = crate::pki::ClusterCa::generate("scd").unwrap();
        for role in [crate::pki::Role::Node, crate::pki::Role::Admin] {
            verify_signed_by_ca(&ours.issue("node-a", role).unwrap()).unwrap();
        }
        let (cert, key) = theirs.issue_pem("node-a", crate::pki::Role::Node).unwrap();
        let foreign = Identity::from_pem(
            ours.cert_pem().as_bytes(),
            cert.as_bytes(),
            key.as_bytes(),
            std::path::Path::new("<memory>"),
        )
        .unwrap();
        let err = verify_signed_by_ca(&foreign).unwrap_err();
        assert!(
            matches!(
                err,
                crate::pki::PkiError::NotSignedByCa(rustls::Error::InvalidCertificate(_))
            ),
            "{err}"
        );
    }
}
