//! Mode `auto` in a cluster: the producer picks the mode per job from what it
//! measured of the link and the two nodes, records the choice and its grounds, and the job
//! answers exactly as a job submitted in the mode it chose. One consumer on a paced link, one
//! on loopback; the experts `sotu` (raw transfer under the quality ceiling) and `mail-rope`
//! (raw breaks it: its drift report measures a KL near 1).
//!
//! On loopback the modes are within a few percent of each other on a CPU, and which is fastest
//! depends on what else the machine runs (a test shares it with other tests, which slow the
//! consumer's own prefill most), so the test checks that the choice is the fastest the record
//! shows rather than naming a mode. `scd bench ttft` measures auto against every fixed mode on
//! a quiet machine (BENCHMARKS.md).

use std::time::Duration;

use crate::common::{config, models, prompt, repo, request, Cluster};
use scd_actors::config::{CodeDtypeName, ExpertConfig, NodeConfig};
use scd_scheduler::{JobRecord, JobState, Mode, ModeEstimate};

/// The paced consumer's link: slow enough that raw's payload takes longer on it than the
/// other modes' work per job, so that the producer's estimates show the link.
const SLOW_MBIT: u64 = 300;

fn node(id: &str, roles: &str) -> NodeConfig {
    let mut c = config(id, roles, true);
    c.experts = ["sotu", "mail-rope"]
        .into_iter()
        .map(|name| ExpertConfig {
            name: name.into(),
            adapter: Some(repo().join("experts").join(name)),
            translator: repo().join("experts").join(name).join("translator"),
        })
        .collect();
    c.codec.code_dtype = CodeDtypeName::I8Rows;
    c
}

fn done(job: &JobRecord) -> Vec<u32> {
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    job.output
        .as_ref()
        .map(|o| o.tokens.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_picks_a_mode_per_link_and_expert_and_answers_as_that_mode() {
    let m = models();
    // A few hundred tokens, so that costs per token dominate the fixed ones.
    let prompt: Vec<u32> = prompt(m).repeat(3);
    let cluster = Cluster::new();
    let mut producer_config = node("prefill-0", "\"producer\", \"scheduler\"");
    producer_config
        .links
        .pace_mbit
        .insert("slow-0".into(), SLOW_MBIT);
    let producer = cluster.start(&producer_config).await;
    let mut weighed_slow = Vec::new();
    for consumer_id in ["fast-0", "slow-0"] {
        let consumer = cluster.start(&node(consumer_id, "\"consumer\"")).await;
        // One job in each mode auto weighs: the producer measures the link, its prefill and
        // its encoding, the consumer its finish per mode; the prompt lands in the producer's
        // prefix cache (the warm setting).
        for mode in [Mode::Raw, Mode::Q4, Mode::Reuse, Mode::Scd, Mode::Oracle] {
            let job = cluster.run("sotu", mode, request(&prompt, 1)).await;
            done(&job);
            assert_eq!(job.consumer.as_deref(), Some(consumer_id));
        }
        for expert in ["sotu", "mail-rope"] {
            let job = cluster.run(expert, Mode::Auto, request(&prompt, 6)).await;
            let tokens = done(&job);
            let choice = job.mode_choice.clone().expect("auto records its choice");
            assert_eq!(job.mode, choice.chosen);
            assert_ne!(job.mode, Mode::Auto);
            // raw, q4, q2, kvtc (both translators hold the base basis), reuse, scd, oracle.
            assert_eq!(choice.weighed.len(), 7, "{choice:?}");
            eprintln!("{consumer_id} {expert}: {}", choice.reason);
            // The choice is the fastest expected among the modes under the ceiling (or
            // within the slack of it, with a lower KL).
            let eligible = |e: &&ModeEstimate| e.kl.is_some_and(|kl| kl <= 0.1);
            let best = choice
                .weighed
                .iter()
                .filter(eligible)
                .filter_map(|e| e.expected_ms)
                .fold(f64::INFINITY, f64::min);
            let mine = choice.weighed.iter().find(|e| e.mode == job.mode).unwrap();
            assert!(eligible(&mine), "{}", choice.reason);
            let mine_ms = mine.expected_ms.expect("the chosen mode's time is known");
            assert!(mine_ms <= best * 1.05 + 1e-9, "{}", choice.reason);
            if expert == "mail-rope" {
                // Its raw transfer is measured far over the ceiling; q4 is not measured.
                assert!(
                    !matches!(job.mode, Mode::Raw | Mode::Q4),
                    "{}",
                    choice.reason
                );
                assert!(choice.reason.contains("raw KL"), "{}", choice.reason);
            }
            let fixed = cluster.run(expert, job.mode, request(&prompt, 6)).await;
            assert_eq!(tokens, done(&fixed), "{expert} in {}", job.mode);
            if consumer_id == "slow-0" {
                weighed_slow.push((expert, choice.link_mbit, choice.weighed.clone()));
            }
        }
        consumer.shutdown(Duration::ZERO).await;
    }
    // Over the paced link the producer weighs the link it measured, and raw's expected time
    // holds its payload at that rate. The estimate is at most the pace, but for the pacer's
    // burst (20 ms of bytes) within a measured spell of at least 60 ms: a third over at most.
    // (A link the producer never backlogged is taken at its floor or the unmeasured default,
    // never at its write times: before, those read as 15 Gbit/s here.)
    // Which mode that makes fastest depends on the machine's own speeds (on a loaded 2-core
    // runner q4's encoding can cost more than the bytes it saves), so no mode is named here:
    // the choice is the fastest the record shows, checked above.
    for (expert, link_mbit, weighed) in &weighed_slow {
        let mbit = link_mbit.unwrap_or_else(|| panic!("slow-0 {expert}: link not measured"));
        assert!(
            mbit <= SLOW_MBIT as f64 * 4.0 / 3.0 + 1e-6,
            "slow-0 {expert}: {mbit} Mbit/s"
        );
        let raw = weighed.iter().find(|e| e.mode == Mode::Raw).unwrap();
        let q4 = weighed.iter().find(|e| e.mode == Mode::Q4).unwrap();
        assert!(q4.payload_bytes < raw.payload_bytes, "{weighed:?}");
        let transfer_ms = raw.payload_bytes as f64 * 8.0 / (mbit * 1e6) * 1e3;
        let raw_ms = raw.expected_ms.expect("raw's time is known");
        assert!(
            raw_ms >= transfer_ms,
            "slow-0 {expert}: raw expected {raw_ms:.0} ms, under its {} bytes at {mbit:.0} Mbit/s",
            raw.payload_bytes
        );
    }
    assert_eq!(weighed_slow.len(), 2);
    producer.shutdown(Duration::ZERO).await;
}
