//! The second part of `scd demo`: where the codes win. A long prompt the producer already holds
//! in its prefix cache (the paper's setting: a base model serving many experts has computed
//! the shared context before), sent over a link paced to `--paced-mbit`, in the oracle, raw,
//! scd and auto; then each mode's time to first token against the oracle's, and what auto chose
//! and why. On a fresh in-process cluster of its own (scheduler, producer, consumer), so the
//! pacing and the warm cache touch nothing of the first part.

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
    let mut nodes = vec![
        cluster
            .start(&config(
                "scheduler-far",
                "\"scheduler\"",
                &models_section(p.model, &[]),
            )?)
            .await?,
        cluster
            .start(&config(&consumer_id, "\"consumer\"", &models)?)
            .await?,
    ];
    nodes.push(
        cluster
            .start(&config(
                "prefill-far",
                "\"producer\"",
                &format!(
                    "{models}\n[codec]\ncode_dtype = \"{}\"\nranks = \"default\"\n\n\
                     [limits]\nprefix_cache_mib = 1024\n\n\
                     [links]\npace_mbit = {{ {consumer_id} = {} }}\n",
                    p.code_dtype, p.mbit
                ),
            )?)
            .await?,
    );
    println!(
        "\n== where the codes win: {} tokens the producer already holds (warm prefix cache), \
         sent to {consumer_id} over a link paced to {} Mbit/s ==",
        p.prompt.len(),
        p.mbit
    );
    // Connections up, then the prompt's prefix into the producer's cache.
    cluster
        .run(p.expert, Mode::Q4, &p.prompt[..p.prompt.len().min(32)])
        .await?;
    eprintln!("warming the producer's prefix cache with the prompt ...");
    cluster.run(p.expert, Mode::Q4, &p.prompt).await?;
    let mut done: Vec<(Mode, JobRecord)> = Vec::new();
    // Auto last: it weighs the speeds the jobs before it measured.
    for mode in [Mode::Oracle, Mode::Raw, Mode::Scd, Mode::Auto] {
        eprintln!("{mode} over the paced link ...");
        done.push((mode, cluster.run(p.expert, mode, &p.prompt).await?));
    }
    for node in nodes.into_iter().rev() {
        node.shutdown(Duration::ZERO).await;
    }
    print_paced(&done);
    Ok(())
}

fn print_paced(done: &[(Mode, JobRecord)]) {
    let ttft = |job: &JobRecord| job.timings_ms.get("ttft").copied().unwrap_or(f64::NAN);
    let oracle = done
        .iter()
        .find(|(m, _)| *m == Mode::Oracle)
        .map_or(f64::NAN, |(_, j)| ttft(j));
    // The held-out KL each mode has for this expert, as the auto job's producer weighed it.
    let kl: BTreeMap<Mode, f64> = done
        .iter()
        .filter_map(|(_, j)| j.mode_choice.as_ref())
        .flat_map(|c| c.weighed.iter().filter_map(|e| Some((e.mode, e.kl?))))
        .collect();
    println!(
        "{:<12} {:>10} {:>9} {:>9}  held-out KL to the expert's own prefill",
        "mode", "wire MB", "TTFT ms", "vs oracle"
    );
    for (mode, job) in done {
        let name = match &job.mode_choice {
            Some(c) if *mode == Mode::Auto => format!("auto ({})", c.chosen),
            _ => mode.to_string(),
        };
        let ran = job.mode_choice.as_ref().map_or(*mode, |c| c.chosen);
        println!(
            "{:<12} {:>10.2} {:>9.0} {:>8.2}x  {}",
            name,
            job.payload_bytes as f64 / 1e6,
            ttft(job),
            oracle / ttft(job),
            kl.get(&ran).map_or("-".into(), |k| format!("{k:.3}")),
        );
    }
    if let Some(c) = done
        .iter()
        .find(|(m, _)| *m == Mode::Auto)
        .and_then(|(_, j)| j.mode_choice.as_ref())
    {
        println!("auto chose {}: {}", c.chosen, c.reason);
    }
    println!(
        "(the oracle prefills the whole prompt on the consumer; raw sends the base's KV, which a \
         fine-tune reads wrongly where its KL is high; scd sends low-rank codes the expert rebuilds \
         its own cache from; auto picks the fastest mode under the quality ceiling for each job)"
    );
}
