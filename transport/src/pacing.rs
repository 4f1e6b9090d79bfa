//! Link emulation on the send path: a token bucket that limits a connection to a bandwidth.
//!
//! [`TokenBucket`] is the pure arithmetic (time is passed in); [`Pacer`] is the async wrapper the
//! stream writers share per connection. The bucket may go into debt: a chunk larger than the
//! tokens on hand is sent after a wait that pays the debt off, so chunk size and timer
//! granularity do not change the long-run rate, only the burstiness.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Pacing settings for one connection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PacingOptions {
    /// The emulated bandwidth in bits per second (payload bytes handed to QUIC, before framing
    /// overhead of QUIC itself).
    pub rate_bps: u64,
    /// Largest burst in bytes sent at line rate after an idle period.
    pub burst_bytes: u64,
}

impl PacingOptions {
    /// A rate with a burst of 20 ms worth of bytes (at least 16 KiB): enough that a writer
    /// delayed by a busy scheduler catches up instead of losing rate for good.
    pub fn rate(rate_bps: u64) -> Self {
        Self {
            rate_bps,
            burst_bytes: (rate_bps / 8 / 50).max(16 << 10),
        }
    }
}

/// Token bucket over an explicit clock.
#[derive(Debug)]
pub struct TokenBucket {
    bytes_per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(opts: PacingOptions, now: Instant) -> Self {
        let burst = opts.burst_bytes.max(1) as f64;
        Self {
            bytes_per_sec: (opts.rate_bps.max(1) as f64) / 8.0,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Take `n` bytes at `now`; returns how long to wait before sending them (zero when the
    /// bucket covers them).
    pub fn take(&mut self, now: Instant, n: u64) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.bytes_per_sec).min(self.burst);
        self.tokens -= n as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.bytes_per_sec)
        }
    }
}

/// A token bucket shared by every writer on a connection.
#[derive(Debug)]
pub struct Pacer {
    bucket: Mutex<TokenBucket>,
}

impl Pacer {
    /// A pacer with a full bucket.
    pub fn new(opts: PacingOptions) -> Self {
        Self {
            bucket: Mutex::new(TokenBucket::new(opts, Instant::now())),
        }
    }

    /// Wait until `n` more bytes may be sent.
    pub async fn pace(&self, n: u64) {
        let wait = {
            // A poisoned lock only means another writer panicked mid-update; the bucket is
            // still usable numbers.
            let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
            b.take(Instant::now(), n)
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(
            PacingOptions {
                rate_bps: 8_000_000,
                burst_bytes: 1000,
            },
            t0,
        );
        assert_eq!(b.take(t0, 1000), Duration::ZERO);
        // 1 MB/s: 500 bytes of debt is 0.5 ms.
        assert_eq!(b.take(t0, 500), Duration::from_micros(500));
        // After the debt is paid and 1 ms more, 1000 bytes are available again.
        let t1 = t0 + Duration::from_micros(1500);
        assert_eq!(b.take(t1, 1000), Duration::ZERO);
    }

    #[test]
    fn long_run_rate_is_exact_whatever_the_chunks() {
        let t0 = Instant::now();
        let opts = PacingOptions::rate(100_000_000);
        let mut b = TokenBucket::new(opts, t0);
        let mut now = t0;
        let mut sent = 0u64;
        for i in 0..10_000u64 {
            let n = 1000 + (i * 7919) % 60_000;
            now += b.take(now, n);
            sent += n;
        }
        let secs = (now - t0).as_secs_f64();
        let rate = (sent - opts.burst_bytes) as f64 * 8.0 / secs;
        assert!((rate / 100e6 - 1.0).abs() < 1e-6, "{rate}");
    }

    #[test]
    fn idle_time_is_capped_at_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(
            PacingOptions {
                rate_bps: 8000,
                burst_bytes: 100,
            },
            t0,
        );
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(b.take(later, 100), Duration::ZERO);
        assert!(b.take(later, 1) > Duration::ZERO);
    }
}
