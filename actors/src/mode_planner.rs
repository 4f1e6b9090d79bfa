//! How a producer resolves a job submitted in mode `auto`: the way of sending with the lowest
//! expected time to first token among those whose measured quality is under the ceiling.
//!
//! The producer weighs what it knows as it claims the job: its measured throughput to the
//! job's consumer and its own prefill speed ([`crate::rank_planner::RankPlanner`]), the
//! payload each mode would send (ranks for the codes as the rank planner would pick them),
//! and what the consumer advertises ([`scd_scheduler::NodeInfo`]): the held-out KL of raw
//! transfer for the expert (its drift report) and its own cost of finishing a job per mode
//! (ms per prompt token after the last code arrives; in mode oracle, its own prefill). The
//! translator's curve gives the codes' KL at their ranks.
//!
//! Per mode, as `rank_curve`'s estimate: codes stream layer by layer while the producer
//! prefills and encodes, so a transfer costs `max(prefill + encode, transfer) + transfer /
//! layers`, then the consumer's finish; for a prompt mostly in the producer's prefix cache,
//! `prefill + encode` is at least what such jobs measured in that mode (`producer_serve_ms`). The oracle costs the consumer's prefill alone, and its KL is 0 by
//! definition: it is always a candidate, so a choice under the ceiling always exists. A mode
//! whose quality nobody measured is never chosen. Among modes within `slack` of the fastest,
//! the lowest KL wins (the better answer when the difference is noise).
//!
//! Unmeasured speeds fall back, in order: each side's prefill to the other's (the expert is
//! its base with an adapter: the same work per token), Patch's finish to its share of the
//! layers times that prefill, the others' finish and every encode to nothing (each is measured
//! from the first job run in that mode); an unmeasured link to
//! [`ModeChoice::UNMEASURED_MBIT`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use scd_scheduler::{ModeChoice, ModeEstimate, RanksChoice};
use scd_types::Mode;

/// A job is served from the prefix cache when at most one row in this many is computed.
const MOSTLY_CACHED_DENOMINATOR: usize = 4;

/// One way the job could be sent, as the producer would send it.
#[derive(Debug, Clone, PartialEq)]
pub struct Offer {
    /// The mode.
    pub mode: Mode,
    /// Bytes it would send.
    pub payload_bytes: u64,
    /// Its measured held-out KL for this pair; `None` when nobody measured it.
    pub kl: Option<f64>,
    /// The ranks of its codes (`reuse`, `scd`), as the rank planner chose them.
    pub ranks: Option<RanksChoice>,
}

/// What the producer knows of the job, the link and the two nodes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Situation {
    /// Prompt tokens whose state the consumer needs (the prompt less its last token).
    pub rows: usize,
    /// Of those, the ones the producer must compute (the rest are in its prefix cache).
    pub producer_rows: usize,
    /// The producer's measured prefill, seconds per token.
    pub producer_secs_per_token: Option<f64>,
    /// The measured throughput to the consumer, bytes per second.
    pub link_bytes_per_sec: Option<f64>,
    /// The consumer's advertised finish per mode, ms per prompt token.
    pub consumer_finish_ms: BTreeMap<Mode, f64>,
    /// The producer's measured encode per mode, ms per prompt token (it adds to the prefill
    /// before the codes can go: on a CPU the two share the cores).
    pub producer_encode_ms: BTreeMap<Mode, f64>,
    /// The producer's measured cost per mode of a job served from its prefix cache, ms per
    /// prompt token: its start to the last code encoded, less the time the link held the codes
    /// back. It holds what `prefill + encode` leaves out there: turning cached blocks into
    /// layer captures and the encode's share of the cores, which for q4 over the whole KV is
    /// most of the job.
    pub producer_serve_ms: BTreeMap<Mode, f64>,
    /// Layers the codes stream in.
    pub layers: usize,
    /// Share of layers `scd` recomputes on the consumer (Patch).
    pub patch_share: f64,
    /// Highest held-out KL a mode may have.
    pub kl_ceiling: f64,
    /// Modes within this share of the fastest count as equally fast.
    pub slack: f64,
}

impl Situation {
    fn consumer_prefill_secs_per_token(&self) -> Option<f64> {
        let measured = self
            .consumer_finish_ms
            .get(&Mode::Oracle)
            .map(|ms| ms / 1e3);
        measured.or(self.producer_secs_per_token)
    }

    /// Whether the producer holds most of the prompt (the jobs `producer_serve_ms` is
    /// measured on).
    pub fn mostly_cached(&self) -> bool {
        self.producer_rows * MOSTLY_CACHED_DENOMINATOR <= self.rows
    }

    fn producer_prefill_secs_per_token(&self) -> Option<f64> {
        let measured = self
            .consumer_finish_ms
            .get(&Mode::Oracle)
            .map(|ms| ms / 1e3);
        self.producer_secs_per_token.or(measured)
    }

    fn finish_secs(&self, mode: Mode) -> f64 {
        let per_token = match (self.consumer_finish_ms.get(&mode), mode) {
            (Some(ms), _) => ms / 1e3,
            (None, Mode::Scd) => {
                self.patch_share * self.consumer_prefill_secs_per_token().unwrap_or(0.0)
            }
            (None, _) => 0.0,
        };
        per_token * self.rows as f64
    }

    /// Expected seconds to the first token in `mode` with `payload` bytes; `None` when a
    /// speed it needs is not known at all.
    fn expected_secs(&self, mode: Mode, payload: u64) -> Option<f64> {
        if mode == Mode::Oracle {
            return Some(self.consumer_prefill_secs_per_token()? * self.rows as f64);
        }
        let rate = self
            .link_bytes_per_sec
            .unwrap_or(ModeChoice::UNMEASURED_MBIT * 1e6 / 8.0)
            .max(1.0);
        let transfer = payload as f64 / rate;
        let prefill = match self.producer_rows {
            0 => 0.0,
            rows => self.producer_prefill_secs_per_token()? * rows as f64,
        };
        let encode = self
            .producer_encode_ms
            .get(&mode)
            .map_or(0.0, |ms| ms / 1e3)
            * self.rows as f64;
        let mut ready = prefill + encode;
        if self.mostly_cached() {
            if let Some(ms) = self.producer_serve_ms.get(&mode) {
                ready = ready.max(ms / 1e3 * self.rows as f64);
            }
        }
        let streamed = ready.max(transfer) + transfer / self.layers.max(1) as f64;
        Some(streamed + self.finish_secs(mode))
    }
}

/// The choice among `offers` (the oracle is added if missing) for `situation`, and the offer
/// chosen.
pub fn choose(situation: &Situation, offers: &[Offer]) -> (ModeChoice, Offer) {
    let mut offers = offers.to_vec();
    if !offers.iter().any(|o| o.mode == Mode::Oracle) {
        offers.push(Offer {
            mode: Mode::Oracle,
            payload_bytes: 0,
            kl: Some(0.0),
            ranks: None,
        });
    }
    let weighed: Vec<(ModeEstimate, &Offer)> = offers
        .iter()
        .map(|o| {
            let expected = situation.expected_secs(o.mode, o.payload_bytes);
            let estimate = ModeEstimate {
                mode: o.mode,
                expected_ms: expected.map(|s| s * 1e3).filter(|ms| ms.is_finite()),
                payload_bytes: o.payload_bytes,
                kl: if o.mode == Mode::Oracle {
                    Some(0.0)
                } else {
                    o.kl
                },
            };
            (estimate, o)
        })
        .collect();
    let eligible = |e: &ModeEstimate| {
        e.expected_ms.is_some() && e.kl.is_some_and(|kl| kl <= situation.kl_ceiling)
    };
    let ms = |e: &ModeEstimate| e.expected_ms.unwrap_or(f64::INFINITY);
    let fastest = weighed
        .iter()
        .filter(|(e, _)| eligible(e))
        .map(|(e, _)| ms(e))
        .min_by(f64::total_cmp);
    let chosen = match fastest {
        Some(fastest) => weighed
            .iter()
            .filter(|(e, _)| eligible(e))
            .filter(|(e, _)| ms(e) <= fastest * (1.0 + situation.slack.max(0.0)))
            .min_by(|a, b| {
                let kl = |e: &ModeEstimate| e.kl.unwrap_or(f64::INFINITY);
                kl(&a.0)
                    .total_cmp(&kl(&b.0))
                    .then(ms(&a.0).total_cmp(&ms(&b.0)))
            }),
        // Nothing has a time: no speed is measured yet, not even a prefill. The oracle is
        // right by definition.
        None => weighed.iter().find(|(e, _)| e.mode == Mode::Oracle),
    };
    let Some((chosen_estimate, chosen_offer)) = chosen else {
        unreachable!("the oracle is always among the offers");
    };
    let reason = reason(
        situation,
        (chosen_estimate, chosen_offer),
        &weighed,
        fastest.is_none(),
    );
    let choice = ModeChoice {
        chosen: chosen_offer.mode,
        reason,
        link_mbit: situation.link_bytes_per_sec.map(|b| b * 8.0 / 1e6),
        weighed: weighed.iter().map(|(e, _)| e.clone()).collect(),
    };
    let offer = (*chosen_offer).clone();
    (choice, offer)
}

/// An offer as the reason names it: its mode, and the rate of transform-coded codes
/// (`scd@0.4`).
fn label(offer: &Offer) -> String {
    match offer.ranks.and_then(|r| r.step) {
        Some(step) => format!("{}@{step}", offer.mode),
        None => offer.mode.to_string(),
    }
}

fn reason(
    situation: &Situation,
    (chosen, chosen_offer): (&ModeEstimate, &Offer),
    weighed: &[(ModeEstimate, &Offer)],
    nothing_measured: bool,
) -> String {
    let mut s = if nothing_measured {
        format!(
            "{}: no speed measured yet, the reference",
            label(chosen_offer)
        )
    } else {
        format!(
            "{}: expected {:.0} ms, the fastest under KL {}",
            label(chosen_offer),
            chosen.expected_ms.unwrap_or(f64::NAN),
            situation.kl_ceiling
        )
    };
    if situation.link_bytes_per_sec.is_none() {
        let _ = write!(
            s,
            " (link unmeasured, assumed {} Mbit/s)",
            ModeChoice::UNMEASURED_MBIT
        );
    }
    let others: Vec<String> = weighed
        .iter()
        .filter(|(e, _)| e.mode != chosen.mode)
        .map(|(e, o)| match e.kl {
            None => format!("{} quality not measured", label(o)),
            Some(kl) if kl > situation.kl_ceiling => format!("{} KL {kl:.3} over", label(o)),
            Some(_) => match e.expected_ms {
                Some(ms) => format!("{} {ms:.0} ms", label(o)),
                None => format!("{} speed unknown", label(o)),
            },
        })
        .collect();
    if !others.is_empty() {
        let _ = write!(s, "; {}", others.join(", "));
    }
    s
}

/// Weight of a new job in a consumer's running finish cost per mode.
const NEW_SAMPLE_WEIGHT: f64 = 0.3;

/// A change of a finish cost by more than this share of the advertised one is advertised
/// (each advertisement is a write of the node's key).
const ADVERTISE_CHANGE: f64 = 0.2;

/// Prompts shorter than this say little of the cost per token: fixed costs dominate.
const MIN_SAMPLE_ROWS: usize = 32;

/// A running measure of a cost per prompt token, per mode: a consumer's finish
/// ([`scd_scheduler::NodeInfo::finish_ms_per_token`], with what it last advertised), a
/// producer's encode.
#[derive(Debug, Default)]
pub struct CostsPerToken {
    state: Mutex<(BTreeMap<Mode, f64>, BTreeMap<Mode, f64>)>,
}

impl CostsPerToken {
    /// The costs now, ms per token.
    pub fn now(&self) -> BTreeMap<Mode, f64> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// A job of `mode` whose prompt had `rows` rows took `secs` (a consumer: from its last
    /// code's arrival, or its start for the oracle, to its first token). Returns the costs to
    /// advertise when one is new or moved by more than a fifth since last advertised.
    pub fn observe(&self, mode: Mode, rows: usize, secs: f64) -> Option<BTreeMap<Mode, f64>> {
        if rows < MIN_SAMPLE_ROWS || !(secs.is_finite() && secs >= 0.0) || mode == Mode::Auto {
            return None;
        }
        let sample = secs * 1e3 / rows as f64;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (measured, advertised) = &mut *state;
        let now = match measured.get(&mode) {
            Some(old) => old + NEW_SAMPLE_WEIGHT * (sample - old),
            None => sample,
        };
        measured.insert(mode, now);
        let moved = advertised
            .get(&mode)
            .is_none_or(|a| (now - a).abs() > ADVERTISE_CHANGE * a.abs().max(1e-6));
        if !moved {
            return None;
        }
        *advertised = measured.clone();
        Some(advertised.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    /// A 1,024-token prompt on a producer and consumer of the same speed (1 ms per token),
    /// 30 layers, a ceiling of 0.1; raw 24 MB, q4 7.5 MB, scd 3 MB.
    fn situation(link_mbit: Option<f64>) -> Situation {
        Situation {
            rows: 1024,
            producer_rows: 1024,
            producer_secs_per_token: Some(1e-3),
            link_bytes_per_sec: link_mbit.map(|m| m * 1e6 / 8.0),
            consumer_finish_ms: BTreeMap::new(),
            producer_encode_ms: BTreeMap::new(),
            producer_serve_ms: BTreeMap::new(),
            layers: 30,
            patch_share: 0.1,
            kl_ceiling: 0.1,
            slack: 0.05,
        }
    }

    fn offers(raw_kl: f64) -> Vec<Offer> {
        let offer = |mode, payload_bytes, kl| Offer {
            mode,
            payload_bytes,
            kl,
            ranks: None,
        };
        vec![
            offer(Mode::Raw, 24 * MB, Some(raw_kl)),
            offer(Mode::Q4, 15 * MB / 2, None),
            offer(Mode::Reuse, 2 * MB, Some(0.4)),
            offer(Mode::Scd, 3 * MB, Some(0.05)),
        ]
    }

    /// Transform-coded codes are named with their rate, chosen or not.
    #[test]
    fn the_reason_names_a_transform_coded_offer_with_its_rate() {
        let mut offers = offers(0.04);
        let tc = |step| {
            Some(scd_scheduler::RanksChoice {
                ranks: scd_scheduler::Ranks { k: 8, v: 8, h: 8 },
                step: Some(step),
                rule: scd_scheduler::RanksRule::Adaptive,
                link_mbit: None,
                curve_kl: None,
            })
        };
        offers[3].ranks = tc(0.4);
        offers[2].ranks = tc(0.3);
        let warm = Situation {
            producer_rows: 16,
            ..situation(Some(50.0))
        };
        let (slow, _) = choose(&warm, &offers);
        assert_eq!(slow.chosen, Mode::Scd);
        assert!(
            slow.reason.starts_with("scd@0.4: expected"),
            "{}",
            slow.reason
        );
        assert!(
            slow.reason.contains("reuse@0.3 KL 0.400 over"),
            "{}",
            slow.reason
        );
    }

    #[test]
    fn a_warm_job_weighs_what_serving_each_mode_from_the_cache_measured() {
        // The numbers of a 1,024-token job at 1 Gbit/s on the 2-core EPYC (docs/m8): q4's
        // payload is the smallest but quantising the whole KV holds the producer ~260 ms,
        // reuse ~190 ms. Without the serve costs q4 looks fastest.
        let mut s = Situation {
            producer_rows: 16,
            ..situation(Some(1000.0))
        };
        let offers = [
            Offer {
                mode: Mode::Q4,
                payload_bytes: 7 * MB,
                kl: Some(0.02),
                ranks: None,
            },
            Offer {
                mode: Mode::Reuse,
                payload_bytes: 9 * MB,
                kl: Some(0.03),
                ranks: None,
            },
        ];
        let (blind, _) = choose(&s, &offers);
        assert_eq!(blind.chosen, Mode::Q4, "{}", blind.reason);
        s.producer_serve_ms.insert(Mode::Q4, 260.0 / 1024.0);
        s.producer_serve_ms.insert(Mode::Reuse, 190.0 / 1024.0);
        let (seen, _) = choose(&s, &offers);
        assert_eq!(seen.chosen, Mode::Reuse, "{}", seen.reason);
        // A cold job computes its rows: the prefill dominates and the serve costs, measured on
        // cached prompts, do not apply.
        let cold = Situation {
            producer_rows: 1024,
            ..s.clone()
        };
        assert!(!cold.mostly_cached());
        assert!(s.mostly_cached());
    }

    #[test]
    fn a_slow_link_gets_the_code_and_a_fast_one_the_cheapest_path() {
        // Warm (the producer holds the prompt in its prefix cache, the paper's setting).
        let warm = |link| Situation {
            producer_rows: 0,
            ..situation(link)
        };
        let (slow, _) = choose(&warm(Some(50.0)), &offers(0.03));
        assert_eq!(slow.chosen, Mode::Scd, "{}", slow.reason);
        assert_eq!(slow.link_mbit, Some(50.0));
        // Cold, two nodes of one speed: the consumer's own prefill beats waiting for the
        // producer's and then the codes.
        let (cold, _) = choose(&situation(Some(50.0)), &offers(0.03));
        assert_eq!(cold.chosen, Mode::Oracle, "{}", cold.reason);
        // On a fast link with the producer's prefill to do, the consumer's own prefill costs
        // the same and sends nothing: the oracle (raw is a hair slower).
        let (fast, _) = choose(&situation(Some(100_000.0)), &offers(0.03));
        assert_eq!(fast.chosen, Mode::Oracle, "{}", fast.reason);
        // Warm, raw's transfer is all there is to wait for.
        let (warm, offer) = choose(&warm(Some(100_000.0)), &offers(0.03));
        assert_eq!(warm.chosen, Mode::Raw, "{}", warm.reason);
        assert_eq!(offer.payload_bytes, 24 * MB);
        assert_eq!(warm.weighed.len(), 5);
        // The record carries it: every field survives JSON (an unknown speed is absent, not
        // a NaN that JSON cannot hold).
        let back: ModeChoice =
            serde_json::from_str(&serde_json::to_string(&warm).unwrap()).unwrap();
        assert_eq!((back.chosen, back.weighed.len()), (Mode::Raw, 5));
    }

    #[test]
    fn a_mode_over_the_ceiling_or_unmeasured_is_never_chosen() {
        // An expert raw transfer breaks (mail-rope: KL near 1), on the fastest link, warm.
        let s = Situation {
            producer_rows: 0,
            ..situation(Some(1e6))
        };
        let (c, _) = choose(&s, &offers(0.9));
        assert_ne!(c.chosen, Mode::Raw, "{}", c.reason);
        assert!(c.reason.contains("raw KL 0.900 over"), "{}", c.reason);
        assert!(c.reason.contains("q4 quality not measured"), "{}", c.reason);
        // Every code over the ceiling: the oracle, whatever the link.
        let bad: Vec<Offer> = offers(0.9)
            .into_iter()
            .map(|o| Offer { kl: Some(0.5), ..o })
            .collect();
        assert_eq!(choose(&situation(Some(1.0)), &bad).0.chosen, Mode::Oracle);
    }

    #[test]
    fn unknown_speeds_fall_back_to_stated_assumptions() {
        // Nothing measured at all: the reference.
        let s = Situation {
            producer_secs_per_token: None,
            link_bytes_per_sec: None,
            ..situation(None)
        };
        let (c, _) = choose(&s, &offers(0.03));
        assert_eq!(c.chosen, Mode::Oracle);
        assert!(c.reason.contains("no speed measured"), "{}", c.reason);
        assert!(c.weighed.iter().all(|e| e.expected_ms.is_none()));
        let back: ModeChoice = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        // Only the consumer's prefill known (it ran an oracle job): it stands in for the
        // producer's, and the producer's cache still counts.
        let mut s = Situation {
            producer_secs_per_token: None,
            producer_rows: 0,
            ..situation(Some(50.0))
        };
        s.consumer_finish_ms.insert(Mode::Oracle, 1.0);
        assert_eq!(choose(&s, &offers(0.03)).0.chosen, Mode::Scd);
        // The link not measured: assumed 100 Mbit/s, where 24 MB of raw take 2 s and 3 MB of
        // codes a quarter of that (warm).
        let s = Situation {
            producer_rows: 0,
            ..situation(None)
        };
        let (c, _) = choose(&s, &offers(0.03));
        assert_eq!(c.chosen, Mode::Scd, "{}", c.reason);
        assert_eq!(c.link_mbit, None);
        assert!(c.reason.contains("link unmeasured"), "{}", c.reason);
    }

    #[test]
    fn finish_costs_are_advertised_when_new_or_moved() {
        let f = CostsPerToken::default();
        assert_eq!(f.observe(Mode::Oracle, 8, 1.0), None, "too short to say");
        let first = f.observe(Mode::Oracle, 100, 0.1).unwrap();
        assert_eq!(first.get(&Mode::Oracle), Some(&1.0));
        // 1.0 -> 1.03: not worth a write.
        assert_eq!(f.observe(Mode::Oracle, 100, 0.11), None);
        // Another mode is news.
        let both = f.observe(Mode::Scd, 100, 0.02).unwrap();
        assert_eq!(both.len(), 2);
        // A consumer that got three times slower says so within a few jobs.
        let moved = (0..5)
            .find_map(|_| f.observe(Mode::Oracle, 100, 0.3))
            .unwrap();
        assert!(moved[&Mode::Oracle] > 1.2, "{moved:?}");
    }

    #[test]
    fn the_consumers_advertised_costs_count() {
        // A consumer ten times slower at prefill than the producer: on a fast link the
        // transfer of raw beats its own prefill even cold.
        let mut s = situation(Some(10_000.0));
        s.consumer_finish_ms.insert(Mode::Oracle, 10.0);
        let (c, _) = choose(&s, &offers(0.03));
        assert_eq!(c.chosen, Mode::Raw, "{}", c.reason);
        // ...unless rebuilding raw is what it is slow at.
        s.consumer_finish_ms.insert(Mode::Raw, 20.0);
        assert_ne!(choose(&s, &offers(0.03)).0.chosen, Mode::Raw);
        // Near-ties go to the better answer: scd and oracle equally fast, oracle's KL is 0.
        let mut tie = situation(Some(1e6));
        tie.consumer_finish_ms.insert(Mode::Scd, 0.0);
        tie.producer_rows = 1024;
        let (c, _) = choose(&tie, &offers(0.03));
        assert_eq!(c.chosen, Mode::Oracle, "{}", c.reason);
    }
}
