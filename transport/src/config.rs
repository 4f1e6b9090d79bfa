//! Transport settings: link profile, timeouts, caps, pacing; and the quinn transport config
//! derived from them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use quinn::{TransportConfig, VarInt};

use crate::codec::DEFAULT_MAX_FRAME_BYTES;
use crate::pacing::PacingOptions;
use crate::wire::PROTOCOL_VERSION;

/// The link a connection runs over, used to size flow-control windows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkProfile {
    /// Bottleneck bandwidth in bits per second.
    pub bandwidth_bps: u64,
    /// Round-trip time.
    pub rtt: Duration,
}

impl Default for LinkProfile {
    /// A datacenter link: 10 Gbit/s, 1 ms.
    fn default() -> Self {
        Self {
            bandwidth_bps: 10_000_000_000,
            rtt: Duration::from_millis(1),
        }
    }
}

impl LinkProfile {
    /// Bandwidth-delay product in bytes.
    pub fn bdp_bytes(&self) -> u64 {
        ((self.bandwidth_bps as f64 / 8.0) * self.rtt.as_secs_f64()) as u64
    }

    /// Per-stream receive window: twice the BDP so one job can fill the link while the
    /// receiver's reads lag a round trip, between 2 MiB and 512 MiB.
    pub fn stream_window(&self) -> u64 {
        (2 * self.bdp_bytes()).clamp(2 << 20, 512 << 20)
    }

    /// Connection-wide receive and send window: room for a few jobs at full speed.
    pub fn connection_window(&self) -> u64 {
        (4 * self.stream_window()).min(1 << 30)
    }
}

/// Everything an endpoint needs besides its identity.
#[derive(Clone, Debug)]
pub struct TransportOptions {
    /// The link, for window sizes.
    pub link: LinkProfile,
    /// Keep-alive interval, so idle connections through NATs and firewalls stay up.
    pub keep_alive: Duration,
    /// A connection silent this long is dead; every job on it fails.
    pub idle_timeout: Duration,
    /// Concurrent job streams a peer may open.
    pub max_concurrent_jobs: u32,
    /// Cap on one frame's body.
    pub max_frame_bytes: u32,
    /// Cap on all frames of one job in one direction.
    pub max_job_bytes: u64,
    /// Frame-body bytes that all job streams of the endpoint, over all its connections, may
    /// hold at once on the receiving side (see [`crate::budget`]): a frame whose buffer would
    /// grow past it fails, and its job is refused as busy. At least `max_frame_bytes`. QUIC's
    /// own receive windows (below the frame reader) come on top: per connection, at most
    /// [`LinkProfile::connection_window`].
    pub receive_budget_bytes: u64,
    /// Frames a job sender may queue ahead of the stream writer (memory bound:
    /// this times `max_frame_bytes`, plus QUIC's send window).
    pub send_queue_frames: usize,
    /// How long an accepted job stream may take to name its job.
    pub open_timeout: Duration,
    /// Emulate a link of this bandwidth on every connection of the endpoint.
    pub pacing: Option<PacingOptions>,
    /// Emulate a link of its own to some peers, by the peer's certificate name (overrides
    /// `pacing` for them): what a test or a demo of links of different speeds needs.
    pub pacing_to: BTreeMap<String, PacingOptions>,
    /// The protocol version offered in ALPN. Leave it at [`PROTOCOL_VERSION`]; other values exist
    /// to test version negotiation.
    pub protocol_version: u16,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            link: LinkProfile::default(),
            keep_alive: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            max_concurrent_jobs: 256,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_job_bytes: 4 << 30,
            receive_budget_bytes: 1 << 30,
            send_queue_frames: 4,
            open_timeout: Duration::from_secs(10),
            pacing: None,
            pacing_to: BTreeMap::new(),
            protocol_version: PROTOCOL_VERSION,
        }
    }
}

impl TransportOptions {
    /// The pacing of what this endpoint sends to `peer`, if any.
    pub fn pacing_for(&self, peer: &str) -> Option<PacingOptions> {
        self.pacing_to.get(peer).copied().or(self.pacing)
    }

    /// The ALPN identifier for the configured protocol version.
    pub fn alpn(&self) -> Vec<u8> {
        alpn_for(self.protocol_version)
    }

    /// The quinn transport config for these options.
    pub fn quinn_transport(&self) -> Arc<TransportConfig> {
        let mut t = TransportConfig::default();
        let stream = varint(self.link.stream_window());
        let conn = self.link.connection_window();
        t.stream_receive_window(stream)
            .receive_window(varint(conn))
            .send_window(conn)
            .max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_jobs))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .keep_alive_interval(Some(self.keep_alive))
            .max_idle_timeout(quinn::IdleTimeout::try_from(self.idle_timeout).ok());
        Arc::new(t)
    }
}

/// The ALPN identifier of a protocol version: `scd/<version>`.
pub fn alpn_for(version: u16) -> Vec<u8> {
    format!("scd/{version}").into_bytes()
}

fn varint(v: u64) -> VarInt {
    VarInt::from_u64(v).unwrap_or(VarInt::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_the_bdp() {
        let wan = LinkProfile {
            bandwidth_bps: 1_000_000_000,
            rtt: Duration::from_millis(50),
        };
        assert_eq!(wan.bdp_bytes(), 6_250_000);
        assert_eq!(wan.stream_window(), 12_500_000);
        assert_eq!(wan.connection_window(), 50_000_000);
        let slow = LinkProfile {
            bandwidth_bps: 10_000_000,
            rtt: Duration::from_millis(1),
        };
        assert_eq!(slow.stream_window(), 2 << 20);
    }

    #[test]
    fn alpn_carries_the_version() {
        assert_eq!(
            TransportOptions::default().alpn(),
            format!("scd/{PROTOCOL_VERSION}").as_bytes()
        );
    }
}
