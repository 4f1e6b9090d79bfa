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

/// The paced consumer's link: slow enough that the smaller payload of the codes pays, fast
/// enough that sending them beats the consumer's own prefill on a CPU (about 1 ms a token).
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
    let mut chosen = Vec::new();
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
            assert_eq!(choice.weighed.len(), 5, "{choice:?}");
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
            chosen.push((consumer_id, expert, job.mode, choice.reason));
        }
        consumer.shutdown(Duration::ZERO).await;
    }
    let mode_of = |c: &str, e: &str| {
        let (_, _, mode, reason) = chosen.iter().find(|x| x.0 == c && x.1 == e).unwrap();
        (*mode, reason.clone())
    };
    // Over the paced link a smaller payload pays: a code (4-bit KV, which sotu's drift report
    // measures under the ceiling, or a translator's), whatever the machine; not raw, not the
    // oracle.
    let (slow, why) = mode_of("slow-0", "sotu");
    assert!(
        matches!(slow, Mode::Q4 | Mode::Reuse | Mode::Scd),
        "{SLOW_MBIT} Mbit/s: {why}"
    );
    producer.shutdown(Duration::ZERO).await;
}
