//! The second part of `scd demo`: where the codes win. A long prompt the producer already holds
//! in its prefix cache (the paper's setting: a base model serving many experts has computed
//! the shared context before), sent over a link paced to `--paced-mbit`: the oracle, raw and
//! scd with the codes as configured, then from a second producer scd's codes transform-coded at
//! the rate the link pays for, kvtc (raw KV coded as hard) and auto; each mode's time to first
//! token against the oracle's, and what auto chose and why. On a fresh in-process cluster of
//! its own (scheduler, consumer, one producer after the other), so the pacing and the warm
//! cache touch nothing of the first part.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use scd_actors::Served;
use scd_scheduler::JobRecord;
use scd_types::Mode;

use crate::cmd::local_cluster::{config, models_section, Cluster};

/// What the paced part runs.
pub struct Paced<'a> {
    pub model: &'a Path,
    pub expert: &'a str,
    pub expert_dir: &'a Path,
    pub mbit: u64,
    pub prompt: Vec<u32>,
    pub code_dtype: &'a str,
}

/// Runs the paced part and prints its table.
pub async fn run(p: Paced<'_>, served: Arc<Served>) -> anyhow::Result<()> {
    let models = models_section(p.model, &[(p.expert, p.expert_dir)]);
    let consumer_id = format!("{}-far", p.expert);
    let cluster = Cluster::new(served)?;
    let scheduler = cluster
        .start(&config(
            "scheduler-far",
            "\"scheduler\"",
            &models_section(p.model, &[]),
        )?)
        .await?;
    let consumer = cluster
        .start(&config(&consumer_id, "\"consumer\"", &models)?)
        .await?;
    println!(
        "\n== where the codes win: {} tokens the producer already holds (warm prefix cache), \
         sent to {consumer_id} over a link paced to {} Mbit/s ==",
        p.prompt.len(),
        p.mbit
    );
    // The codes as configured (fixed width, the translator's default ranks), then on a second
    // producer transform-coded at the rate its link pays for, beside kvtc (raw KV coded as
    // hard) and auto weighing them all.
    let producers = [
        (
            "prefill-far",
            p.code_dtype,
            "default",
            &[Mode::Oracle, Mode::Raw, Mode::Scd][..],
        ),
        (
            "prefill-far-tc",
            "tc",
            "adaptive",
            &[Mode::Kvtc, Mode::Scd, Mode::Auto][..],
        ),
    ];
    let mut done: Vec<(String, Mode, JobRecord)> = Vec::new();
    for (id, dtype, ranks, modes) in producers {
        let producer = cluster
            .start(&config(
                id,
                "\"producer\"",
                &format!(
                    "{models}\n[codec]\ncode_dtype = \"{dtype}\"\nranks = \"{ranks}\"\n\n\
                     [limits]\nprefix_cache_mib = 1024\n\n\
                     [links]\npace_mbit = {{ {consumer_id} = {} }}\n",
                    p.mbit
                ),
            )?)
            .await?;
        // Connections up, then the prompt's prefix into the producer's cache (which also
        // measures the link).
        cluster
            .run(p.expert, Mode::Q4, &p.prompt[..p.prompt.len().min(32)])
            .await?;
        eprintln!("warming {id}'s prefix cache with the prompt ...");
        cluster.run(p.expert, Mode::Q4, &p.prompt).await?;
        // Auto last: it weighs the speeds the jobs before it measured.
        for &mode in modes {
            eprintln!("{mode} over the paced link from {id} ...");
            let job = cluster.run(p.expert, mode, &p.prompt).await?;
            let label = match (mode, job.ranks.and_then(|c| c.step)) {
                (Mode::Oracle | Mode::Raw, _) => mode.to_string(),
                (Mode::Auto, _) => match &job.mode_choice {
                    Some(c) => format!("auto ({})", c.chosen),
                    None => "auto".into(),
                },
                (_, Some(step)) => format!("{mode} tc@{step}"),
                (_, None) => format!("{mode} {dtype}"),
            };
            done.push((label, mode, job));
        }
        producer.shutdown(Duration::ZERO).await;
    }
    consumer.shutdown(Duration::ZERO).await;
    scheduler.shutdown(Duration::ZERO).await;
    print_paced(&done);
    Ok(())
}

fn print_paced(done: &[(String, Mode, JobRecord)]) {
    let ttft = |job: &JobRecord| job.timings_ms.get("ttft").copied().unwrap_or(f64::NAN);
    let oracle = done
        .iter()
        .find(|(_, m, _)| *m == Mode::Oracle)
        .map_or(f64::NAN, |(_, _, j)| ttft(j));
    // The held-out KL each mode has for this expert, as the auto job's producer weighed it (for
    // its codes: at the size it weighed them, so only for that producer's jobs).
    let auto = done.iter().find(|(_, m, _)| *m == Mode::Auto);
    let kl: BTreeMap<Mode, f64> = auto
        .and_then(|(_, _, j)| j.mode_choice.as_ref())
        .into_iter()
        .flat_map(|c| c.weighed.iter().filter_map(|e| Some((e.mode, e.kl?))))
        .collect();
    let auto_producer = auto.and_then(|(_, _, j)| j.producer.clone());
    println!(
        "{:<18} {:>8} {:>9} {:>9}  held-out KL to the expert's own prefill",
        "mode", "wire MB", "TTFT ms", "vs oracle"
    );
    for (label, mode, job) in done {
        let ran = job.mode_choice.as_ref().map_or(*mode, |c| c.chosen);
        // A code's own measured KL where its record has one (the rate table's or the curve's).
        let weighed = matches!(ran, Mode::Oracle | Mode::Raw) || job.producer == auto_producer;
        let own = job
            .ranks
            .and_then(|c| c.curve_kl)
            .or_else(|| kl.get(&ran).copied().filter(|_| weighed));
        println!(
            "{:<18} {:>8.2} {:>9.0} {:>8.2}x  {}",
            label,
            job.payload_bytes as f64 / 1e6,
            ttft(job),
            oracle / ttft(job),
            own.map_or("-".into(), |k| format!("{k:.3}")),
        );
    }
    if let Some(c) = done
        .iter()
        .find(|(_, m, _)| *m == Mode::Auto)
        .and_then(|(_, _, j)| j.mode_choice.as_ref())
    {
        println!("auto chose {}: {}", c.chosen, c.reason);
    }
    println!(
        "(the oracle prefills the whole prompt on the consumer; raw sends the base's KV, which a \
         fine-tune reads wrongly where its KL is high; scd sends low-rank codes the expert rebuilds \
         its own cache from, tc@ transform-coded at the rate the link pays for; kvtc codes raw KV \
         as hard; auto picks the fastest mode under the quality ceiling for each job)"
    );
}
