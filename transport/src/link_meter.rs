//! What a job stream's writes say about its link: the rate over spells in which the link, not
//! the producer, set the pace.
//!
//! A spell starts with a frame that was already queued when the writer got to it and lasts
//! while every next frame is too; it ends when the writer has to wait for a frame (then the
//! frame it waited for is not counted: after an idle moment a link, a pacer's token bucket or
//! QUIC's window, sends a burst faster than it can keep up) or when the stream ends, with the
//! wait until the peer has read everything. Only spells of at least [`MIN_SPELL`] count:
//! frames that merely arrive together (a layer's K and V codes) make short spells that fit in a
//! burst and would overstate the link. Pure arithmetic over instants handed in.

use std::time::{Duration, Instant};

/// The shortest spell that counts: several times a pacer's 20 ms burst, so that the burst's
/// share of a counted spell stays small.
pub const MIN_SPELL: Duration = Duration::from_millis(60);

/// Spells seen so far on one stream.
#[derive(Debug, Default)]
pub struct LinkMeter {
    open: Option<(Instant, u64, Instant)>,
    bytes: u64,
    busy: Duration,
}

impl LinkMeter {
    /// A frame of `len` bytes was written from `start` to `end`; `queued`: it was waiting when
    /// the writer got to it.
    pub fn wrote(&mut self, queued: bool, len: u64, start: Instant, end: Instant) {
        match (&mut self.open, queued) {
            (Some((_, bytes, last)), true) => {
                *bytes += len;
                *last = end;
            }
            (_, true) => self.open = Some((start, len, end)),
            (_, false) => self.close(None),
        }
    }

    /// The writer found no frame queued and waits for the producer: a spell ends at its last
    /// write.
    pub fn waiting(&mut self) {
        self.close(None);
    }

    /// The stream ended; the peer had read everything at `read`.
    pub fn finish(&mut self, read: Instant) {
        self.close(Some(read));
    }

    fn close(&mut self, read: Option<Instant>) {
        if let Some((start, bytes, last)) = self.open.take() {
            let end = read.map_or(last, |r| r.max(last));
            let spell = end.saturating_duration_since(start);
            if spell >= MIN_SPELL {
                self.bytes += bytes;
                self.busy += spell;
            }
        }
    }

    /// Bytes and time of the counted spells.
    pub fn spells(&self) -> (u64, Duration) {
        (self.bytes, self.busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(t0: Instant, m: u64) -> Instant {
        t0 + Duration::from_millis(m)
    }

    /// `n` frames of 100 bytes written back to back from 1 ms, 10 ms each, each queued behind
    /// the one before.
    fn queued(m: &mut LinkMeter, t0: Instant, n: u64) {
        for i in 0..n {
            m.wrote(true, 100, ms(t0, 1 + 10 * i), ms(t0, 11 + 10 * i));
        }
    }

    #[test]
    fn a_long_spell_counts_its_queued_frames_and_the_drain() {
        let t0 = Instant::now();
        let mut m = LinkMeter::default();
        // Waited for: not counted, and it closes nothing.
        m.wrote(false, 1000, ms(t0, 0), ms(t0, 1));
        queued(&mut m, t0, 10);
        m.finish(ms(t0, 121));
        assert_eq!(m.spells(), (1000, Duration::from_millis(120)));
    }

    #[test]
    fn a_wait_for_the_producer_ends_a_spell_before_the_stream_ends() {
        let t0 = Instant::now();
        let mut m = LinkMeter::default();
        m.wrote(false, 100, ms(t0, 0), ms(t0, 1));
        queued(&mut m, t0, 7);
        m.waiting();
        // The producer closes the stream long after: the wait is not the link's.
        m.finish(ms(t0, 500));
        assert_eq!(m.spells(), (700, Duration::from_millis(70)));
    }

    #[test]
    fn frames_that_merely_arrive_together_do_not_count() {
        let t0 = Instant::now();
        let mut m = LinkMeter::default();
        for layer in 0..5 {
            let at = 20 * layer;
            m.wrote(false, 100, ms(t0, at), ms(t0, at));
            m.wrote(true, 200, ms(t0, at), ms(t0, at + 1));
        }
        m.finish(ms(t0, 100));
        assert_eq!(m.spells(), (0, Duration::ZERO));
    }
}
