//! How a producer node sizes a job's codes for the link they cross.
//!
//! Translators store nested codes, so any ranks up to `r_max` can be sent without
//! recalibrating, and each translator carries its held-out quality at a grid of ranks
//! ([`scd_models::translator::rank_curve`]). What the producer adds is what it measures: the
//! throughput of its recent transfers to each consumer node (every job's stream reports the
//! time the link set the pace, [`scd_transport::SendReport::link_busy`]) and its own prefill
//! speed. At claim time it picks the ranks that minimise the job's expected time to first
//! token under the configured KL ceiling, and the record carries the choice and its grounds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use scd_models::codec::TcRate;
use scd_models::translator::rank_curve::{self, LinkEstimate};
use scd_models::translator::{RankPolicy, Translator};
use scd_scheduler::{Mode, ModeChoice, RanksChoice, RanksRule};
use scd_transport::{CodeDType, LinkRate};
use scd_types::NodeId;

use crate::config::RankSetting;

/// Transfers smaller than this say little about a link: they fit in the pacer's burst or
/// QUIC's first window, and their time is mostly round trips.
pub const MIN_SAMPLE_BYTES: u64 = 512 << 10;

/// Prefills shorter than this are not measured ([`RankPlanner::observe_prefill`]).
pub const MIN_PREFILL_SAMPLE_TOKENS: usize = 32;

/// Weight of a new measurement in a link's running estimate: links change (other traffic,
/// another route), and the last few jobs are the best guide to the next one.
const NEW_SAMPLE_WEIGHT: f64 = 0.5;

/// The producer's rank rule and what it has measured.
#[derive(Debug)]
pub struct RankPlanner {
    setting: RankSetting,
    policy: RankPolicy,
    dtype: CodeDType,
    /// Bytes per second to each consumer node, by node id.
    links: Mutex<HashMap<NodeId, Estimate>>,
    /// Seconds of prefill per prompt token.
    prefill_per_token: Mutex<Option<f64>>,
}

/// A link's running estimate, and whether any job measured it.
#[derive(Debug, Clone, Copy)]
enum Estimate {
    Measured(f64),
    KeptUp(f64),
}

fn blend(old: Option<f64>, sample: f64) -> f64 {
    match old {
        Some(o) => o + NEW_SAMPLE_WEIGHT * (sample - o),
        None => sample,
    }
}

impl RankPlanner {
    /// A planner with nothing measured yet.
    pub fn new(setting: RankSetting, policy: RankPolicy, dtype: CodeDType) -> Self {
        Self {
            setting,
            policy,
            dtype,
            links: Mutex::new(HashMap::new()),
            prefill_per_token: Mutex::new(None),
        }
    }

    /// A finished transfer of `bytes` to `peer` at `rate`
    /// ([`scd_transport::SendReport::link_rate`]) that took `elapsed` from its stream's open
    /// to its end. A measured rate moves the estimate. A "kept up" one (a job the link never
    /// held back) is an upper bound only, and a loose one: a frame under the pacer's burst or
    /// QUIC's window is written at once, so a 300 Mbit/s link fed slowly reads as tens of
    /// Gbit/s. What such a job proves is its floor: a link carried its bytes within `elapsed`
    /// whatever held the stream back, so `bytes / elapsed` is a lower bound on its rate. While
    /// nothing was measured, a kept-up job stands in as its floor, or as
    /// [`ModeChoice::UNMEASURED_MBIT`] where that is higher (and the upper bound allows): as
    /// cautious as knowing nothing, and never faster than a job showed; the highest such
    /// stand-in holds until a measurement replaces it. Once measured, a
    /// measured estimate under a stream's floor is stale (the link got faster since it last
    /// held a job back; a fast link never does again, and would be taken for the old slow one
    /// for good), so it is raised to the floor.
    pub fn observe_transfer(
        &self,
        peer: &NodeId,
        bytes: u64,
        rate: Option<LinkRate>,
        elapsed: Duration,
    ) {
        let Some(rate) = rate.filter(|r| {
            let r = r.bytes_per_sec();
            r.is_finite() && r > 0.0
        }) else {
            return;
        };
        if bytes < MIN_SAMPLE_BYTES {
            return;
        }
        let secs = elapsed.as_secs_f64();
        let floor = if secs > 0.0 { bytes as f64 / secs } else { 0.0 };
        let stand_in = |upper: f64| {
            let unmeasured = ModeChoice::UNMEASURED_MBIT * 1e6 / 8.0;
            floor.max(unmeasured.min(upper))
        };
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let old = links.get(peer).copied();
        let new = match (rate, old) {
            (LinkRate::Measured(r), Some(Estimate::Measured(o))) => blend(Some(o), r),
            (LinkRate::Measured(r), _) => r,
            (LinkRate::KeptUp(_), Some(Estimate::Measured(o))) => {
                if floor > o {
                    links.insert(peer.clone(), Estimate::Measured(floor));
                }
                return;
            }
            // Floors are lower bounds: the largest any job showed stands (a link that slows
            // down holds the next job back, and is measured then).
            (LinkRate::KeptUp(r), Some(Estimate::KeptUp(o))) => o.max(stand_in(r)),
            (LinkRate::KeptUp(r), None) => stand_in(r),
        };
        let estimate = match rate {
            LinkRate::Measured(_) => Estimate::Measured(new),
            LinkRate::KeptUp(_) => Estimate::KeptUp(new),
        };
        links.insert(peer.clone(), estimate);
    }

    /// A prefill of `tokens` tokens took `secs` seconds. A short one (a prompt mostly in the
    /// prefix cache) is left out: its fixed costs over a few tokens would read as a prefill
    /// tens of times slower than it is.
    pub fn observe_prefill(&self, tokens: usize, secs: f64) {
        if tokens < MIN_PREFILL_SAMPLE_TOKENS || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let mut p = self
            .prefill_per_token
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *p = Some(blend(*p, secs / tokens as f64));
    }

    /// The measured prefill speed, seconds per token.
    pub fn prefill_secs_per_token(&self) -> Option<f64> {
        *self
            .prefill_per_token
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The rule the ranks are chosen by.
    pub fn policy(&self) -> RankPolicy {
        self.policy
    }

    /// The link estimate to `peer`, bytes per second.
    pub fn link(&self, peer: &str) -> Option<f64> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.get(peer).map(|e| match *e {
            Estimate::Measured(r) | Estimate::KeptUp(r) => r,
        })
    }

    /// The ranks of a job of `mode` on consumer `expert` of `translator`, whose prefix of
    /// `rows` tokens goes to `peer`; for transform-coded codes (`kvtc`, and `reuse` and `scd`
    /// when this producer sends dtype `tc`) their rate instead, from the translator's rate
    /// table as ranks are from its curve (the ranks are then `r_max`: such codes carry every
    /// component the rate pays for). Of the `rows`, the producer computes `computed_rows` (the
    /// rest are in its prefix cache): codes stream behind that prefill only, so for a warm
    /// prompt the link, not the prefill, bounds the time.
    pub fn plan(
        &self,
        translator: &Arc<Translator>,
        expert: usize,
        mode: Mode,
        (rows, computed_rows): (usize, usize),
        peer: &str,
    ) -> RanksChoice {
        let m = &translator.manifest;
        let tc = mode == Mode::Kvtc || self.dtype == CodeDType::TC && mode.uses_translator_codes();
        let defaults = |rule| RanksChoice {
            ranks: if tc { m.r_max } else { m.default_ranks },
            step: tc.then(|| TcRate::default().step),
            rule,
            link_mbit: None,
            curve_kl: None,
        };
        match self.setting {
            RankSetting::Default => return defaults(RanksRule::Default),
            // Fixed ranks are refused with dtype tc ([`crate::config`]); kvtc has none.
            RankSetting::Fixed(_) if tc => return defaults(RanksRule::Default),
            RankSetting::Fixed(ranks) => {
                return RanksChoice {
                    ranks,
                    ..defaults(RanksRule::Fixed)
                }
            }
            RankSetting::Adaptive => {}
        }
        let measured = match tc {
            true => m.rate_table.is_some(),
            false => m.rank_curve.is_some(),
        };
        if !measured {
            return defaults(RanksRule::NoCurve);
        }
        let Some(bytes_per_sec) = self.link(peer) else {
            return defaults(RanksRule::Unmeasured);
        };
        let per_token = *self
            .prefill_per_token
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let link = LinkEstimate {
            bytes_per_sec,
            prefill_secs: per_token.unwrap_or(0.0) * computed_rows.min(rows) as f64,
        };
        let chosen = |ranks, step, kl, rule| RanksChoice {
            ranks,
            step,
            rule,
            link_mbit: Some(bytes_per_sec * 8.0 / 1e6),
            curve_kl: Some(kl),
        };
        if let Some(table) = m.rate_table.as_ref().filter(|_| tc) {
            let layers = translator.layers.len();
            // The base's K and V in bf16: what the table's shares are of.
            let raw = (rows * layers * 2 * m.kv_dim * 2) as u64;
            return match table.choose(mode, expert, raw, layers, &link, &self.policy) {
                Some(c) => chosen(m.r_max, Some(c.step), c.kl, RanksRule::Adaptive),
                // Nothing meets the ceiling: the best rate measured, whatever it costs.
                None => match table.best(mode, expert) {
                    Some((step, kl)) => chosen(m.r_max, Some(step), kl, RanksRule::OverCeiling),
                    None => defaults(RanksRule::NoCurve),
                },
            };
        }
        match rank_curve::choose(
            translator,
            expert,
            mode,
            rows,
            self.dtype,
            &link,
            &self.policy,
        ) {
            Some(c) => chosen(c.ranks, None, c.kl, RanksRule::Adaptive),
            // Nothing meets the ceiling: the best the translator can do, whatever it costs.
            None => match m
                .rank_curve
                .iter()
                .flat_map(|c| &c.points)
                .filter(|p| p.mode == mode)
                .filter_map(|p| Some((p.ranks, *p.kl.get(expert)?)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
            {
                Some((ranks, kl)) => chosen(ranks, None, kl, RanksRule::OverCeiling),
                None => defaults(RanksRule::NoCurve),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_transfers_do_not_move_the_estimate_and_large_ones_blend() {
        let p = RankPlanner::new(RankSetting::Adaptive, RankPolicy::default(), CodeDType::F16);
        let n = MIN_SAMPLE_BYTES;
        let measured = |r| Some(LinkRate::Measured(r));
        // Streams that took a long time: their floors (bytes / elapsed) are under every rate.
        let long = Duration::from_secs(1 << 20);
        p.observe_transfer(&NodeId::from_static("c"), n - 1, measured(1e9), long);
        assert_eq!(p.link("c"), None);
        p.observe_transfer(&NodeId::from_static("c"), n, measured(100.0), long);
        assert_eq!(p.link("c"), Some(100.0));
        p.observe_transfer(&NodeId::from_static("c"), n, measured(300.0), long);
        assert_eq!(p.link("c"), Some(200.0));
        p.observe_transfer(&NodeId::from_static("c"), n, None, long);
        p.observe_transfer(&NodeId::from_static("c"), n, measured(f64::INFINITY), long);
        assert_eq!(p.link("c"), Some(200.0));
        // A job the link never held back says little once the link was measured...
        p.observe_transfer(
            &NodeId::from_static("c"),
            n,
            Some(LinkRate::KeptUp(1e12)),
            long,
        );
        assert_eq!(p.link("c"), Some(200.0));
        // ...and stands in while nothing was, until a measurement replaces it: as the
        // unmeasured default while its floor is lower (the write times of a link fed slowly
        // are bursts, not its rate)...
        let unmeasured = ModeChoice::UNMEASURED_MBIT * 1e6 / 8.0;
        p.observe_transfer(
            &NodeId::from_static("fast"),
            n,
            Some(LinkRate::KeptUp(1e12)),
            long,
        );
        assert_eq!(p.link("fast"), Some(unmeasured));
        // ...as its floor where that is higher, and never over its own upper bound.
        let quick = Duration::from_secs_f64(n as f64 / (4.0 * unmeasured));
        p.observe_transfer(
            &NodeId::from_static("fast"),
            n,
            Some(LinkRate::KeptUp(1e12)),
            quick,
        );
        let floor = n as f64 / quick.as_secs_f64();
        assert!(
            (p.link("fast").unwrap() - floor).abs() < 1.0,
            "{:?}",
            p.link("fast")
        );
        // A later job that proves less does not lower what an earlier one proved.
        p.observe_transfer(
            &NodeId::from_static("fast"),
            n,
            Some(LinkRate::KeptUp(1e12)),
            long,
        );
        assert!(
            (p.link("fast").unwrap() - floor).abs() < 1.0,
            "{:?}",
            p.link("fast")
        );
        p.observe_transfer(
            &NodeId::from_static("slow"),
            n,
            Some(LinkRate::KeptUp(1e6)),
            long,
        );
        assert_eq!(p.link("slow"), Some(1e6));
        p.observe_transfer(&NodeId::from_static("fast"), n, measured(5e8), long);
        assert_eq!(p.link("fast"), Some(5e8));
        assert_eq!(p.link("other"), None);
    }

    /// The bench's sequence of links, and a link freed of other traffic: measured slow, then
    /// fast enough that no job is held back again. Without the floor the old measure stood
    /// for good (auto then expected raw at 5 Gbit/s to take 600 ms; it took 210).
    #[test]
    fn a_link_that_got_faster_is_seen_from_the_jobs_it_kept_up_with() {
        let p = RankPlanner::new(RankSetting::Adaptive, RankPolicy::default(), CodeDType::F16);
        let mb = 24u64 << 20;
        p.observe_transfer(
            &NodeId::from_static("c"),
            mb,
            Some(LinkRate::Measured(50e6)),
            Duration::from_millis(480),
        );
        assert_eq!(p.link("c"), Some(50e6));
        // A job that kept up, but over a slow prefill: its floor (24 MiB in 1 s) is under the
        // measure, which stands.
        let burst = Some(LinkRate::KeptUp(1e10));
        p.observe_transfer(&NodeId::from_static("c"), mb, burst, Duration::from_secs(1));
        assert_eq!(p.link("c"), Some(50e6));
        // One that carried 24 MiB in 160 ms: the link is at least that fast, not its burst.
        p.observe_transfer(
            &NodeId::from_static("c"),
            mb,
            burst,
            Duration::from_millis(160),
        );
        let floor = mb as f64 / 0.16;
        assert!(
            (p.link("c").unwrap() - floor).abs() < 1.0,
            "{:?}",
            p.link("c")
        );
        // Measurements go on from there.
        p.observe_transfer(
            &NodeId::from_static("c"),
            mb,
            Some(LinkRate::Measured(2e8)),
            Duration::from_millis(130),
        );
        assert!((p.link("c").unwrap() - (floor + 2e8) / 2.0).abs() < 1.0);
    }
}
