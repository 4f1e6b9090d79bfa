//! Helpers shared by the QUIC tests: loopback endpoints, and a raw client that speaks the
//! protocol by hand over plain quinn.
#![allow(dead_code)] // each test binary uses its own subset

use std::net::SocketAddr;
use std::sync::Arc;

use scd_transport::{
    ClusterCa, Control, Endpoint, JobId, Message, Role, TraceContext, TransportOptions,
};

/// Any free port on loopback.
pub fn local() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A server endpoint on loopback with a node certificate "node-a" from `ca`.
pub fn serve_as_node_a(ca: &ClusterCa, opts: TransportOptions) -> Endpoint {
    Endpoint::bind(local(), &ca.issue("node-a", Role::Node).unwrap(), opts).unwrap()
}

/// Opens a job stream by hand on a raw connection: its `Open` frame written, nothing else.
pub async fn open_raw_job(
    raw: &quinn::Connection,
    job: JobId,
) -> (quinn::SendStream, quinn::RecvStream) {
    let (mut send, back) = raw.open_bi().await.unwrap();
    let open = Message::Control(Control::Open {
        job_id: job,
        trace: TraceContext::new(),
    });
    send.write_all(&scd_transport::codec::encode(&open, u32::MAX).unwrap())
        .await
        .unwrap();
    (send, back)
}

/// A cluster node that speaks the protocol by hand over plain quinn, connected to `server`:
/// mutual TLS and the hello exchange done here, so a test can put on a job stream bytes our
/// `JobSender` never would.
pub async fn raw_client(ca: &ClusterCa, server: &Endpoint) -> quinn::Connection {
    use quinn::crypto::rustls::QuicClientConfig;
    use scd_transport::codec;
    let id = ca.issue("node-raw", Role::Node).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(id.ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(id.cert_chain.clone(), id.key.clone_key())
    .unwrap();
    tls.alpn_protocols = vec![format!("scd/{}", scd_transport::PROTOCOL_VERSION).into_bytes()];
    let mut client = quinn::Endpoint::client(local()).unwrap();
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(tls).unwrap(),
    )));
    let conn = client
        .connect(server.local_addr().unwrap(), "node-a")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Message::Control(Control::Hello {
        protocol: scd_transport::PROTOCOL_VERSION,
        node_id: "node-raw".into(),
    });
    send.write_all(&codec::encode(&hello, u32::MAX).unwrap())
        .await
        .unwrap();
    send.finish().unwrap();
    let back = recv.read_to_end(1 << 16).await.unwrap();
    assert!(matches!(
        codec::decode(&back, u32::MAX).unwrap().0,
        Message::Control(Control::Hello { .. })
    ));
    conn
}
