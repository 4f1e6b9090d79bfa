//! A cluster of nodes in one process on the embedded store, over real QUIC on loopback, with the
//! real base model and the shipped `mail` expert: jobs submitted as records are scheduled,
//! prefilled by the producer node, streamed to the consumer node and decoded there, and each
//! result equals the same mode in-process; bad jobs fail with their reason; a draining node
//! leaves at once and loses no job.

use crate::common;

use std::time::Duration;

use crate::common::{
    config, config_with, models, prompt, reference, reference_for, repo, request, Cluster,
    MAX_TOKENS, WAIT,
};
use scd_actors::config::{CodeDtypeName, RankSetting};
use scd_actors::{ClientError, JobCodec};
use scd_models::codec::CodecOptions;
use scd_models::translator::Translator;
use scd_scheduler::{
    JobState, Keys, Mode, NodeId, RanksRule, TranslatorManifest, TranslatorRegistry,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_in_every_mode_run_across_the_nodes_and_match_the_in_process_reference() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;

    // q2 and kvtc as the baselines of M13 (kvtc's codes made with the translator's base basis,
    // checked by its hash like scd's).
    for mode in [
        Mode::Raw,
        Mode::Scd,
        Mode::Q4,
        Mode::Q2,
        Mode::Kvtc,
        Mode::Oracle,
    ] {
        let want = reference_for(m, mode, &prompt);
        let job = cluster.run_mail(mode, &prompt, MAX_TOKENS).await;
        assert_eq!(job.state, JobState::Done, "{mode}: {:?}", job.error);
        assert_eq!(job.producer.as_deref(), Some("prefill-0"));
        assert_eq!(job.consumer.as_deref(), Some("mail-0"));
        let output = job.output.expect("a done job has its output");
        assert_eq!(output.tokens, want, "{mode}");
        assert_eq!(output.stop, "max_tokens");
        // Ranks as configured, for the modes that have them.
        match mode {
            Mode::Scd => {
                let c = job.ranks.expect("a scd job's ranks are recorded");
                assert_eq!(c.rule, RanksRule::Default);
                assert_eq!(c.ranks, m.translator.0.manifest.default_ranks);
                assert_eq!(c.step, None);
            }
            // kvtc's codes are transform-coded: a rate, the default one as configured.
            Mode::Kvtc => {
                let c = job.ranks.expect("a kvtc job's rate is recorded");
                assert_eq!(c.rule, RanksRule::Default);
                assert_eq!(c.step, Some(scd_models::codec::TcRate::default().step));
            }
            _ => assert_eq!(job.ranks, None, "{mode}"),
        }
        // The record went through every state, and carries both nodes' timings.
        let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
        assert_eq!(
            states,
            [
                JobState::Queued,
                JobState::Assigned,
                JobState::Prefilling,
                JobState::Transferring,
                JobState::Decoding,
                JobState::Done
            ],
            "{mode}"
        );
        for key in ["rebuild", "first_token", "total"] {
            assert!(job.timings_ms.contains_key(key), "{mode}: no {key} timing");
        }
        if mode != Mode::Oracle {
            assert!(job.timings_ms.contains_key("prefill"), "{mode}");
            // Every layer's codes, fewer bytes than went on the wire (frame headers).
            let layers = m.base.config().num_layers;
            assert_eq!(job.layer_bytes.len(), layers, "{mode}");
            let codes: u64 = job.layer_bytes.iter().sum();
            assert!(codes > 0 && codes < job.payload_bytes, "{mode}");
            // Pipelined across the nodes: the first layer's codes reached the consumer before
            // the producer's prefill ended.
            let prefill = job.stages["prefill"];
            let arrivals = job.stages["arrivals"];
            assert!(
                arrivals.start_ms < prefill.end_ms,
                "{mode}: first frame at {}, prefill ended at {}",
                arrivals.start_ms,
                prefill.end_ms
            );
        }
        for stage in ["rebuild", "decode"] {
            assert!(job.stages.contains_key(stage), "{mode}: no {stage} span");
        }
        eprintln!(
            "{mode}: {} payload bytes, timings {:?}",
            job.payload_bytes, job.timings_ms
        );
    }
    // Both nodes let go of every job (the producer's last record write may come after the
    // consumer's).
    let mut waited = 0;
    while producer.load() + consumer.load() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(waited < 3000, "jobs left on the nodes");
    }
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_jobs_fail_with_their_reason_and_the_next_job_runs() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;

    // No node serves this expert: refused at submission, saying what to start.
    let err = cluster
        .client
        .submit("sotu", Mode::Raw, request(&prompt, 4))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::NoConsumer { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("sotu") && message.contains("served now: mail"),
        "{message}"
    );

    // An expert whose base no node prefills: refused too, saying what to start.
    let alone = Cluster::new();
    let expert_only = alone.start(&config("mail-1", "\"consumer\"", true)).await;
    let err = alone
        .client
        .submit("mail", Mode::Raw, request(&prompt, 4))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, ClientError::NoProducer { .. }), "{err:?}");
    assert!(
        message.contains("producer role") && message.contains(common::MODEL_FILE),
        "{message}"
    );
    expert_only.shutdown(Duration::ZERO).await;

    // A token outside the vocabulary: the producer refuses the job, the record says why.
    let mut bad = prompt.clone();
    bad[3] = u32::MAX;
    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&bad, 4))
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Failed);
    let reason = job.error.unwrap_or_default();
    assert!(
        reason.contains("prefill-0") && reason.contains(&u32::MAX.to_string()),
        "{reason}"
    );

    // More tokens than the context holds.
    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 1 << 20))
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Failed);
    assert!(
        job.error.as_deref().unwrap_or_default().contains("context"),
        "{:?}",
        job.error
    );

    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 4))
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_node_leaves_at_once_and_its_job_finishes_elsewhere() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;

    // A long job; drain the consumer while it decodes.
    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 160))
        .await
        .unwrap();
    let mut waited = 0;
    while consumer.load() == 0 {
        let job = cluster.client.get(id).await.unwrap();
        assert!(!job.state.is_finished(), "{:?}", job.error);
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += 1;
        assert!(waited < 15_000, "the consumer never took the job");
    }
    let report = consumer.shutdown(Duration::ZERO).await;
    assert_eq!(report.in_flight, 1);
    assert_eq!(report.handed_back, vec![id]);
    // Its lease was revoked: it is gone from the cluster now, not when the lease expires.
    let nodes = cluster.client.nodes().await.unwrap();
    assert!(!nodes.contains_key("mail-0"), "{:?}", nodes.keys());
    let job = cluster.client.get(id).await.unwrap();
    assert_eq!(job.state, JobState::Queued);
    // Handed back by the node, blaming itself; never placed on it again, even where the
    // scheduler's watch of the nodes has not seen the drain yet.
    let error = job.error.clone().unwrap_or_default();
    assert!(error.contains("mail-0 shut down"), "{error:?}");

    // Another consumer of mail joins; the job runs there to the end.
    let other = cluster.start(&config("mail-1", "\"consumer\"", true)).await;
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.consumer.as_deref(), Some("mail-1"));
    assert_eq!(job.attempts, 2);
    assert_eq!(job.output.map(|o| o.tokens.len()), Some(160));
    other.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// Waits until `node` uses translator `hash` for mail.
async fn switched(node: &scd_actors::node::Node, hash: scd_scheduler::TranslatorHash) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while node.translator("mail").map(|(_, h)| h) != Some(hash) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} never switched to {}",
            node.id(),
            hash.short()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_follow_the_live_translator_version_and_refuse_one_they_cannot_use() {
    let m = models();
    let prompt = prompt(m);
    let shipped = m.translator.0.hash();
    // Another version of the mail translator: the same weights stored in f32 instead of bf16,
    // so its content hash differs while it computes the same codes for the same pair.
    let dir = tempfile::tempdir().unwrap();
    let mut other = Translator::load(&repo().join("experts/mail/translator")).unwrap();
    other.manifest.weights_dtype = scd_models::translator::WeightsDtype::F32;
    let other_hash = other.save(dir.path()).unwrap();
    assert_ne!(other_hash, shipped);

    // The first node makes its configured version live; the second, configured with another,
    // publishes that one too but works with the live one.
    let cluster = Cluster::new();
    let producer = cluster
        .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
        .await;
    let consumer = cluster
        .start(&config_with("mail-0", "\"consumer\"", true, dir.path(), ""))
        .await;
    assert_eq!(consumer.translator("mail").map(|(_, h)| h), Some(shipped));
    let registry = TranslatorRegistry::new(cluster.store.clone(), Keys::default());
    let base = common::MODEL_FILE;
    let pair = registry.pairs().await.unwrap();
    assert_eq!(pair.len(), 1);
    assert_eq!(pair[0].versions.len(), 2, "{pair:?}");
    assert_eq!(
        pair[0].active.as_ref().map(|a| a.content_hash),
        Some(shipped)
    );
    let run = |mode| cluster.run_mail(mode, &prompt, 4);
    let job = run(Mode::Scd).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.translator, Some(shipped));

    // Activating the other version switches both nodes without a restart; rolling back
    // returns them.
    let other_name = pair[0]
        .versions
        .iter()
        .find(|v| v.content_hash == other_hash)
        .unwrap()
        .version
        .clone();
    registry.activate(base, "mail", &other_name).await.unwrap();
    switched(&producer, other_hash).await;
    switched(&consumer, other_hash).await;
    let job = run(Mode::Scd).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.translator, Some(other_hash));
    registry.rollback(base, "mail").await.unwrap();
    switched(&producer, shipped).await;
    switched(&consumer, shipped).await;

    // A version the consumer cannot use: the sotu translator relabelled for mail. The producer
    // knows mail by name only and takes it; the consumer checks it against its mail model and
    // refuses, keeping the version it has. Codes made with it fail with both reasons named.
    let bad = tempfile::tempdir().unwrap();
    let mut relabelled = Translator::load(&repo().join("experts/sotu/translator")).unwrap();
    relabelled.manifest.consumers[0].name = "mail".into();
    // Saved again: the manifest is part of the content hash.
    let bad_hash = relabelled.save(bad.path()).unwrap();
    registry
        .publish(&TranslatorManifest {
            producer_model: base.into(),
            consumer_model: "mail".into(),
            version: "relabelled".into(),
            content_hash: bad_hash,
            ranks: Default::default(),
            reuse_layers: Vec::new(),
            patch_layers: Vec::new(),
            blob: bad.path().display().to_string(),
            metrics: Default::default(),
        })
        .await
        .unwrap();
    registry.activate(base, "mail", "relabelled").await.unwrap();
    switched(&producer, bad_hash).await;
    let job = run(Mode::Scd).await;
    assert_eq!(job.state, JobState::Failed);
    let reason = job.error.unwrap_or_default();
    assert!(
        reason.contains("mail-0") && reason.contains(&bad_hash.short()),
        "{reason}"
    );
    assert_eq!(consumer.translator("mail").map(|(_, h)| h), Some(shipped));
    // Raw codes carry no translator: the same nodes still serve them.
    let job = run(Mode::Raw).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.translator, None);
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_actor_is_started_again_and_its_job_runs_to_the_end() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;

    // Kill the consumer's decoder while it decodes: the job goes back to the queue and runs
    // again on the decoder the supervisor started in its place.
    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 64))
        .await
        .unwrap();
    let mut waited = 0;
    while consumer.load() == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += 1;
        assert!(waited < 15_000, "the consumer never took the job");
    }
    assert!(consumer.kill_actor("decoder:mail").await);
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.attempts, 2, "the killed attempt was handed back");
    assert!(
        job.error
            .as_deref()
            .unwrap_or_default()
            .contains("actor is gone"),
        "{:?}",
        job.error
    );
    assert_eq!(consumer.restarts(), 1);
    let tokens = job.output.unwrap().tokens;
    assert_eq!(tokens.len(), 64);

    // The producer's encoder, killed between jobs, is back for the next one; the same request
    // gives the same tokens.
    assert!(producer.kill_actor("encoder").await);
    let mut waited = 0;
    while producer.restarts() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(waited < 3000, "the encoder was not started again");
    }
    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 64))
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.output.unwrap().tokens, tokens);
    assert!(!producer.kill_actor("no-such-actor").await);
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// A repeated prompt prefix is not prefilled again: the producer takes its whole blocks from
/// the prefix cache (one cached prefix serves every mode: the cache holds base-model state),
/// the record says how many tokens, the result equals the uncached in-process one, and the
/// producer advertises the blocks for the scheduler's prefix affinity.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_prefix_comes_from_the_producers_cache() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;
    let block = scd_scheduler::prefix::DEFAULT_BLOCK_TOKENS;
    let whole = (prompt.len() - 1) / block * block;
    assert!(whole > 0);
    let mut first_hashes = Vec::new();
    for (mode, cached) in [(Mode::Raw, 0), (Mode::Scd, whole), (Mode::Raw, whole)] {
        let want = reference_for(m, mode, &prompt);
        let job = cluster.run_mail(mode, &prompt, MAX_TOKENS).await;
        assert_eq!(job.state, JobState::Done, "{mode}: {:?}", job.error);
        assert_eq!(job.cached_prefix_tokens, cached as u64, "{mode}");
        assert_eq!(job.output.unwrap().tokens, want, "{mode}, {cached} cached");
        assert_eq!(job.prefix_hashes.len(), whole / block);
        first_hashes = job.prefix_hashes;
    }
    let nodes = cluster.client.nodes().await.unwrap();
    let held = &nodes["prefill-0"].prefix_hashes;
    assert!(
        first_hashes.iter().all(|h| held.contains(h)),
        "{held:?} lacks {first_hashes:?}"
    );
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// The scheduler's prefix affinity: a prompt whose blocks one producer holds goes to that
/// producer, ahead of the one the load and id order would pick; another prompt does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prompt_goes_to_the_producer_holding_its_prefix() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let holder = cluster
        .start(&config("prefill-1", "\"producer\", \"scheduler\"", true))
        .await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let first = cluster.run_mail(Mode::Raw, &prompt, 4).await;
    assert_eq!(first.producer.as_deref(), Some("prefill-1"));
    // A second producer joins; with equal loads, the id order would pick it first.
    let other = cluster
        .start(&config("prefill-0", "\"producer\"", true))
        .await;
    let keys = Keys::default();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let pools = scd_scheduler::service::read_pools(cluster.store.as_ref(), &keys)
            .await
            .unwrap();
        let nodes = cluster.client.nodes().await.unwrap();
        let both = pools.get("mail").is_some_and(|p| p.len() == 2);
        let advertised = nodes.get("prefill-1").is_some_and(|n| {
            first
                .prefix_hashes
                .iter()
                .all(|h| n.prefix_hashes.contains(h))
        });
        if both && advertised {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "pools {pools:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = cluster.run_mail(Mode::Raw, &prompt, 4).await;
    assert_eq!(again.state, JobState::Done, "{:?}", again.error);
    assert_eq!(again.producer.as_deref(), Some("prefill-1"));
    assert!(again.cached_prefix_tokens > 0);
    // A prompt none of whose blocks are held goes by load, then id.
    let fresh: Vec<u32> = prompt.iter().rev().copied().collect();
    let elsewhere = cluster.run_mail(Mode::Raw, &fresh, 4).await;
    assert_eq!(elsewhere.state, JobState::Done, "{:?}", elsewhere.error);
    assert_eq!(elsewhere.producer.as_deref(), Some("prefill-0"));
    assert_eq!(elsewhere.cached_prefix_tokens, 0);
    for node in [other, consumer, holder] {
        node.shutdown(Duration::ZERO).await;
    }
}

/// Overload: a burst of four times the cluster's bound of unfinished jobs. The excess is
/// answered busy with a retry hint and creates no record, every admitted job finishes, and
/// once they have, the leader's recount lets new jobs in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_past_the_admission_bound_is_answered_busy_and_loses_nothing() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let producer = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &repo().join("experts/mail/translator"),
            "\n[limits]\nunfinished_jobs = 3\n",
        ))
        .await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let keys = Keys::default();
    let started = std::time::Instant::now();
    while scd_scheduler::admission::current(cluster.store.as_ref(), &keys)
        .await
        .unwrap()
        .limit
        != 3
    {
        assert!(
            started.elapsed() < WAIT,
            "the leader never published its limit"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut admitted = Vec::new();
    let mut busy = 0;
    for _ in 0..12 {
        match cluster
            .client
            .submit("mail", Mode::Raw, request(&prompt, 2))
            .await
        {
            Ok(id) => admitted.push(id),
            Err(ClientError::Busy(refusal)) => {
                assert_eq!(refusal.limit, 3);
                assert!(refusal.retry_after >= Duration::from_secs(1));
                assert!(refusal.to_string().contains("retry after"), "{refusal}");
                busy += 1;
            }
            Err(e) => panic!("unexpected refusal: {e}"),
        }
    }
    // Jobs finishing during the burst may free a slot or two; most of the burst is refused.
    assert!(
        admitted.len() >= 3 && busy >= 6,
        "{} admitted",
        admitted.len()
    );
    let records = scd_scheduler::JobStore::new(cluster.store.clone(), keys.clone())
        .list()
        .await
        .unwrap();
    assert_eq!(records.len(), admitted.len(), "a refusal wrote a record");
    for id in &admitted {
        let job = cluster.client.wait(*id, WAIT).await.unwrap();
        assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    }
    // All finished: the next pass recounts, and a new job gets in and runs.
    let started = std::time::Instant::now();
    let id = loop {
        match cluster
            .client
            .submit("mail", Mode::Raw, request(&prompt, 2))
            .await
        {
            Ok(id) => break id,
            Err(ClientError::Busy(_)) if started.elapsed() < WAIT => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("still refused after the jobs finished: {e}"),
        }
    };
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// Codes sized for the link (`docs/method.md` §4.6): one producer with adaptive ranks, its link to
/// one consumer paced at 4 Mbit/s and to the other left at loopback speed. (4 Mbit/s is far below
/// what even a loaded test machine's prefill produces, so frames queue behind that link and it is
/// measured, whatever the machine's speed.) The first job to a consumer has no measurement and goes
/// at the translator's defaults; after it the producer knows the link (the fast one at least as
/// the unmeasured default: it never holds a job back), and the same prompt, prefilled again, gets
/// the smallest codes under the KL ceiling over the slow link and no smaller ones over the fast
/// one (larger where the machine's prefill hides them), both under the ceiling per the
/// translator's curve. Each consumer rebuilds with the ranks the record names: its tokens equal the
/// in-process run at those ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_sizes_each_jobs_codes_for_the_link_to_its_consumer() {
    const SLOW_MBIT: u64 = 4;
    let m = models();
    let (t, index) = &m.translator;
    assert!(
        t.manifest.rank_curve.is_some(),
        "the shipped mail translator lacks its rank curve: run `scd translators curve`"
    );
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let mut producer_config = config("prefill-0", "\"producer\", \"scheduler\"", true);
    producer_config.codec.ranks = RankSetting::Adaptive;
    // Mail's curve meets 0.1 only at its largest ranks; at 0.2 it offers a range.
    producer_config.codec.kl_ceiling = 0.2;
    // Every job prefilled: codes stream behind the prefill, which hides them on the fast link.
    producer_config.limits.prefix_cache_mib = 0;
    producer_config
        .links
        .pace_mbit
        .insert("mail-slow".into(), SLOW_MBIT);
    let ceiling = producer_config.codec.kl_ceiling;
    let producer = cluster.start(&producer_config).await;
    let mut chosen = Vec::new();
    for consumer_id in ["mail-slow", "mail-fast"] {
        let consumer = cluster
            .start(&config(consumer_id, "\"consumer\"", true))
            .await;
        let mut rules = Vec::new();
        for (mode, max_tokens) in [(Mode::Scd, 2), (Mode::Scd, MAX_TOKENS)] {
            let job = cluster.run_mail(mode, &prompt, max_tokens).await;
            assert_eq!(job.state, JobState::Done, "{consumer_id}: {:?}", job.error);
            assert_eq!(job.consumer.as_deref(), Some(consumer_id));
            let c = job.ranks.expect("scd jobs record their ranks");
            rules.push(c.rule);
            if c.rule == RanksRule::Unmeasured {
                assert_eq!(c.ranks, t.manifest.default_ranks);
                continue;
            }
            assert!(c.curve_kl.is_some_and(|kl| kl <= ceiling), "{c:?}");
            let codec = JobCodec::for_mode(
                Mode::Scd,
                Some((t, *index)),
                &CodecOptions {
                    ranks: Some(c.ranks),
                    ..CodecOptions::default()
                },
            )
            .unwrap();
            let want = reference(m, codec.codec.as_ref(), &prompt);
            assert_eq!(job.output.unwrap().tokens, want, "{consumer_id}: {c:?}");
            eprintln!(
                "{consumer_id}: {c:?}, {} bytes, timings {:?}",
                job.payload_bytes, job.timings_ms
            );
            chosen.push((c, job.payload_bytes));
        }
        assert_eq!(
            rules,
            [RanksRule::Unmeasured, RanksRule::Adaptive],
            "{consumer_id}"
        );
        consumer.shutdown(Duration::ZERO).await;
    }
    let [(slow, slow_bytes), (fast, fast_bytes)] = chosen.as_slice() else {
        panic!("{chosen:?}")
    };
    let slow_mbit = slow.link_mbit.unwrap();
    assert!(
        (0.5 * SLOW_MBIT as f64..1.25 * SLOW_MBIT as f64).contains(&slow_mbit),
        "the paced link measured at {slow_mbit} Mbit/s"
    );
    assert!(fast.link_mbit.unwrap() > 5.0 * slow_mbit, "{fast:?}");
    // Over the slow link every choice's transfer outlasts any CPU's prefill: the smallest codes
    // under the ceiling go. How much larger the fast link's are depends on how long this
    // machine's prefill hides them (on the 2-core EPYC: k=192 against 48).
    let smallest = t
        .manifest
        .rank_curve
        .as_ref()
        .unwrap()
        .points
        .iter()
        .filter(|p| p.mode == Mode::Scd && p.kl[*index] <= ceiling)
        .min_by_key(|p| p.ranks.k + p.ranks.v)
        .unwrap();
    assert_eq!(
        (slow.ranks.k, slow.ranks.v),
        (smallest.ranks.k, smallest.ranks.v),
        "{slow:?}"
    );
    assert!(
        slow_bytes <= fast_bytes,
        "slow link: {slow:?} {slow_bytes} B, fast: {fast:?} {fast_bytes} B"
    );
    producer.shutdown(Duration::ZERO).await;
}

/// Transform-coded codes sized for the link (M13): a producer that sends `reuse` and `scd` codes
/// in dtype `tc` picks each job's rate from the translator's rate table as it picks ranks from
/// the curve. Every job is prefilled (no prefix cache), so codes stream behind the prefill. The
/// link to one consumer is paced at 1 Mbit/s: slower than even a loaded 2-core runner's prefill
/// makes codes (so they queue and the link is measured), and at any rate the table measured a
/// job's codes take longer on it than the prefill on any machine's CPU, so the coarsest rate
/// under the ceiling is fastest. The other is loopback (the codes hide behind the prefill, so a
/// finer rate goes).
/// The first job to a consumer goes at the default rate; once the link is known the slow one
/// gets the coarsest rate under the ceiling and the fast one no coarser (finer where the
/// machine's prefill hides the codes), each under the ceiling per the table, each answering as
/// the in-process codec at its rate. kvtc's codes (raw KV in the base's
/// basis, the same coder) are sized the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_sends_transform_coded_codes_at_the_rate_its_link_pays_for() {
    const SLOW_MBIT: u64 = 1;
    const CEILING: f64 = 0.2;
    let m = models();
    let (t, index) = &m.translator;
    let table =
        t.manifest.rate_table.as_ref().expect(
            "the shipped mail translator lacks its rate table: run `scd translators rates`",
        );
    // About 200 tokens: enough that even the coarsest codes exceed the bytes a transfer
    // must carry to measure a link (`rank_planner::MIN_SAMPLE_BYTES`).
    let prompt = prompt(m).repeat(2);
    let rows = prompt.len() - 1;
    let raw = (rows * t.layers.len() * 2 * t.manifest.kv_dim * 2) as u64;
    let cluster = Cluster::new();
    let mut producer_config = config("prefill-0", "\"producer\", \"scheduler\"", true);
    producer_config.codec.ranks = RankSetting::Adaptive;
    producer_config.codec.code_dtype = CodeDtypeName::Tc;
    // Mail's codes meet 0.1 only at the finest rate; at 0.2 the table offers a range.
    producer_config.codec.kl_ceiling = CEILING;
    producer_config.limits.prefix_cache_mib = 0;
    producer_config
        .links
        .pace_mbit
        .insert("mail-slow".into(), SLOW_MBIT);
    let producer = cluster.start(&producer_config).await;
    let mut last = Vec::new();
    for consumer_id in ["mail-slow", "mail-fast"] {
        let consumer = cluster
            .start(&config(consumer_id, "\"consumer\"", true))
            .await;
        let mut rules = Vec::new();
        for max_tokens in [1, 1, MAX_TOKENS] {
            let job = cluster.run_mail(Mode::Scd, &prompt, max_tokens).await;
            assert_eq!(job.state, JobState::Done, "{consumer_id}: {:?}", job.error);
            assert_eq!(job.consumer.as_deref(), Some(consumer_id));
            let c = job.ranks.expect("scd jobs record the size of their codes");
            assert_eq!(c.ranks, t.manifest.r_max, "tc codes carry all of r_max");
            let step = c.step.expect("transform-coded codes record their rate");
            rules.push(c.rule);
            // The codes took about the share of raw's bytes the table measured at that rate
            // (on other prompts of 256 tokens).
            let codes: u64 = job.layer_bytes.iter().sum();
            let share = table.share_at(Mode::Scd, *index, step).unwrap();
            assert!(
                (codes as f64) < 1.5 * share * raw as f64,
                "{consumer_id}: {codes} bytes of codes at step {step}, the table's share {share} of {raw}"
            );
            if max_tokens == MAX_TOKENS {
                assert!(c.curve_kl.is_some_and(|kl| kl <= CEILING), "{c:?}");
                let codec = JobCodec::for_mode(
                    Mode::Scd,
                    Some((t, *index)),
                    &CodecOptions {
                        ranks: Some(c.ranks),
                        code_dtype: scd_transport::CodeDType::TC,
                        tc_rate: scd_models::codec::TcRate { step },
                        ..CodecOptions::default()
                    },
                )
                .unwrap();
                let want = reference(m, codec.codec.as_ref(), &prompt);
                assert_eq!(job.output.unwrap().tokens, want, "{consumer_id}: {c:?}");
                eprintln!("{consumer_id}: {c:?}, {codes} bytes of codes of raw's {raw}");
                last.push((c, codes));
            }
        }
        assert_eq!(
            rules,
            [
                RanksRule::Unmeasured,
                RanksRule::Adaptive,
                RanksRule::Adaptive
            ],
            "{consumer_id}"
        );
        if consumer_id == "mail-slow" {
            consumer.shutdown(Duration::ZERO).await;
            continue;
        }
        // kvtc: the same coder over the base's raw KV, its rate from its own rows of the table
        // (on the fast link only: the path is the same, and the slow one takes seconds a job).
        let job = cluster.run_mail(Mode::Kvtc, &prompt, 1).await;
        assert_eq!(job.state, JobState::Done, "{consumer_id}: {:?}", job.error);
        let c = job.ranks.expect("kvtc jobs record their rate");
        assert_eq!(c.rule, RanksRule::Adaptive, "{consumer_id}: {c:?}");
        let step = c.step.expect("kvtc's rate");
        assert_eq!(c.curve_kl, table.kl_at(Mode::Kvtc, *index, step), "{c:?}");
        assert!(c.curve_kl.is_some_and(|kl| kl <= CEILING), "{c:?}");
        consumer.shutdown(Duration::ZERO).await;
    }
    let [(slow, slow_bytes), (fast, fast_bytes)] = last.as_slice() else {
        panic!("{last:?}")
    };
    let slow_mbit = slow.link_mbit.unwrap();
    assert!(
        slow_mbit <= SLOW_MBIT as f64 * 4.0 / 3.0,
        "the paced link measured at {slow_mbit} Mbit/s"
    );
    // The loopback is known as at least the unmeasured default, 100 Mbit/s.
    assert!(fast.link_mbit.unwrap() >= 50.0 * slow_mbit, "{fast:?}");
    // Over the slow link every rate's codes outlast any CPU's prefill: the coarsest rate under
    // the ceiling goes. How much finer the fast link's is depends on how long this machine's
    // prefill hides the codes (on the 2-core EPYC: step 0.05 against 0.4).
    let coarsest = table
        .points
        .iter()
        .filter(|p| p.mode == Mode::Scd && p.kl[*index] <= CEILING)
        .map(|p| p.step)
        .fold(f32::MIN, f32::max);
    assert_eq!(slow.step, Some(coarsest), "{slow:?}");
    assert!(slow.step >= fast.step, "slow: {slow:?}, fast: {fast:?}");
    assert!(
        slow_bytes <= fast_bytes,
        "slow link: {slow:?} {slow_bytes} B, fast: {fast:?} {fast_bytes} B"
    );
    producer.shutdown(Duration::ZERO).await;
}

/// The drift guard (`docs/method.md` §4.6): a consumer that checks every translated job against the
/// mail expert's own prefill, with a bound no real translator meets, marks the live version
/// degraded after two checks; the scheduler then runs scd jobs as raw (the record says why, and the
/// result is raw's); another version made live brings scd back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_translator_whose_shadow_checks_drift_is_marked_and_its_jobs_fall_back() {
    let m = models();
    let prompt = prompt(m);
    let shipped = m.translator.0.hash();
    let cluster = Cluster::new();
    let producer = cluster
        .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
        .await;
    let mut consumer_config = config("mail-0", "\"consumer\"", true);
    consumer_config.drift = Some(scd_actors::config::DriftConfig {
        shadow_share: 1.0,
        kl_bound: 1e-9,
        window: 4,
        min_jobs: 2,
    });
    let consumer = cluster.start(&consumer_config).await;
    let registry = TranslatorRegistry::new(cluster.store.clone(), Keys::default());
    let base = common::MODEL_FILE;
    for _ in 0..2 {
        let job = cluster.run_mail(Mode::Scd, &prompt, 4).await;
        assert_eq!(job.state, JobState::Done, "{:?}", job.error);
        assert_eq!((job.mode, job.translator), (Mode::Scd, Some(shipped)));
    }
    let mut waited = 0;
    let degraded = loop {
        let active = registry.active(base, "mail").await.unwrap().unwrap();
        if let Some(d) = active.degraded {
            break d;
        }
        waited += 1;
        assert!(waited < 3000, "the checks never marked the translator");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((degraded.by.as_str(), degraded.jobs), ("mail-0", 2));
    assert!(
        degraded.shadow_kl > 1e-9 && degraded.shadow_kl < 10.0,
        "{degraded:?}"
    );

    let job = cluster.run_mail(Mode::Scd, &prompt, MAX_TOKENS).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.mode, Mode::Raw);
    let fallback = job.fallback.expect("the record says why it ran raw");
    assert_eq!(fallback.from, Mode::Scd);
    assert!(fallback.reason.contains("degraded"), "{}", fallback.reason);
    assert_eq!(
        job.output.unwrap().tokens,
        reference_for(m, Mode::Raw, &prompt)
    );

    // A recalibrated version (here the same weights stored in f32: another hash) made live.
    let dir = tempfile::tempdir().unwrap();
    let mut other = Translator::load(&repo().join("experts/mail/translator")).unwrap();
    other.manifest.weights_dtype = scd_models::translator::WeightsDtype::F32;
    let other_hash = other.save(dir.path()).unwrap();
    let manifest = TranslatorManifest {
        producer_model: base.into(),
        consumer_model: "mail".into(),
        version: "recalibrated".into(),
        content_hash: other_hash,
        ranks: Default::default(),
        reuse_layers: Vec::new(),
        patch_layers: Vec::new(),
        blob: dir.path().display().to_string(),
        metrics: Default::default(),
    };
    registry.publish(&manifest).await.unwrap();
    registry
        .activate(base, "mail", "recalibrated")
        .await
        .unwrap();
    switched(&producer, other_hash).await;
    switched(&consumer, other_hash).await;
    let job = cluster.run_mail(Mode::Scd, &prompt, 4).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(
        (job.mode, job.fallback, job.translator),
        (Mode::Scd, None, Some(other_hash))
    );
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// The drift guard with the bound it ships with (`DriftConfig::default().kl_bound`) and every job
/// checked: the shipped mail translator passes its checks and stays live, scd jobs keep running
/// as scd, and the mean shadow KL it reports sits under the bound. The counterpart of the test
/// above, so that the guard is shown to tell a good translator from a bad bound, not only to trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_translator_within_the_shipped_drift_bound_stays_live() {
    let m = models();
    let prompt = prompt(m);
    let shipped = m.translator.0.hash();
    let cluster = Cluster::new();
    let producer = cluster
        .start(&config("prefill-0", "\"producer\", \"scheduler\"", true))
        .await;
    let bound = scd_actors::config::DriftConfig::default().kl_bound;
    let mut consumer_config = config("mail-0", "\"consumer\"", true);
    consumer_config.drift = Some(scd_actors::config::DriftConfig {
        shadow_share: 1.0,
        kl_bound: bound,
        window: 4,
        min_jobs: 2,
    });
    let consumer = cluster.start(&consumer_config).await;
    let checks = "scd_shadow_checks_total{expert=\"mail\"}";
    const JOBS: usize = 3;
    for _ in 0..JOBS {
        let job = cluster.run_mail(Mode::Scd, &prompt, 4).await;
        assert_eq!(job.state, JobState::Done, "{:?}", job.error);
        assert_eq!(
            (job.mode, job.fallback, job.translator),
            (Mode::Scd, None, Some(shipped))
        );
    }
    // The checks run after the jobs answer: wait (bounded) until all of them are counted.
    let mut waited = 0;
    while metric(&consumer.metrics_text(), checks) < JOBS as f64 {
        waited += 1;
        assert!(waited < 3000, "the consumer never checked its {JOBS} jobs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = consumer.metrics_text();
    let mean_kl = text
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix("scd_shadow_kl{")?;
            rest.contains("expert=\"mail\"")
                .then(|| rest.rsplit(' ').next()?.parse::<f64>().ok())?
        })
        .expect("a shadow KL gauge for mail");
    assert!(
        mean_kl > 0.0 && mean_kl < bound,
        "mean shadow KL {mean_kl} against the shipped bound {bound}"
    );
    let registry = TranslatorRegistry::new(cluster.store.clone(), Keys::default());
    let active = registry
        .active(common::MODEL_FILE, "mail")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(active.degraded, None, "marked degraded under {bound}");
    let job = cluster.run_mail(Mode::Scd, &prompt, 4).await;
    assert_eq!((job.mode, job.fallback), (Mode::Scd, None));
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// Each of `experts` alone on `prompt` in `mode`: their tokens by expert, and one job's payload.
async fn each_alone(
    cluster: &Cluster,
    experts: &[String],
    mode: Mode,
    prompt: &[u32],
) -> (std::collections::BTreeMap<String, Vec<u32>>, u64) {
    let mut alone = std::collections::BTreeMap::new();
    let mut one_payload = 0;
    for e in experts {
        let id = cluster
            .client
            .submit(e, mode, request(prompt, MAX_TOKENS))
            .await
            .unwrap();
        let job = cluster.client.wait(id, WAIT).await.unwrap();
        assert_eq!(job.state, JobState::Done, "{e}: {:?}", job.error);
        alone.insert(e.clone(), job.output.unwrap().tokens);
        one_payload = job.payload_bytes;
    }
    (alone, one_payload)
}

/// One fan-out job of `experts` on `prompt` in `mode`, run to its end.
async fn fan_out(
    cluster: &Cluster,
    experts: &[String],
    mode: Mode,
    prompt: &[u32],
) -> scd_scheduler::JobRecord {
    let id = scd_scheduler::JobId::random();
    cluster
        .client
        .submit_fan_out(
            id,
            experts,
            mode,
            request(prompt, MAX_TOKENS),
            scd_scheduler::TraceContext::new(),
        )
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    job
}

/// A metric's value in a node's scrape (`name{labels}` as rendered), 0 when absent.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Fan-out (README, "Fan-out"): one job names three experts of the base; one consumer node hosts
/// them all (adapters on the fly over one copy of the base). The producer prefills once and sends
/// one code stream (the counters: one more prefill, the payload of one job); the consumer decodes
/// each expert, and each result equals that expert's own job. Fan-outs that cannot run are refused
/// at submission with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_prefill_and_one_code_stream_serve_three_experts() {
    use scd_actors::config::ExpertConfig;
    use scd_scheduler::{JobId, TraceContext};
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let mut producer_config = config("prefill-0", "\"producer\", \"scheduler\"", true);
    producer_config.limits.prefix_cache_mib = 0;
    let mut consumer_config = config("experts-0", "\"consumer\"", true);
    for name in ["sotu", "melville", "mail-rope"] {
        let dir = repo().join("experts").join(name);
        let expert = ExpertConfig {
            name: name.into(),
            adapter: Some(dir.clone()),
            translator: dir.join("translator"),
        };
        producer_config.experts.push(expert.clone());
        consumer_config.experts.push(expert);
    }
    let producer = cluster.start(&producer_config).await;
    let consumer = cluster.start(&consumer_config).await;
    let experts: Vec<String> = ["mail", "sotu", "melville"].map(String::from).to_vec();

    let (alone, one_payload) = each_alone(&cluster, &experts, Mode::Raw, &prompt).await;
    let prefills = "scd_stage_seconds_count{stage=\"prefill\"}";
    let decodes = |e: &str| format!("scd_decodes_total{{expert=\"{e}\"}}");
    let before = (producer.metrics_text(), consumer.metrics_text());
    let job = fan_out(&cluster, &experts, Mode::Raw, &prompt).await;
    assert_eq!(job.experts(), ["mail", "sotu", "melville"]);
    assert_eq!(job.output.unwrap().tokens, alone["mail"]);
    for e in ["sotu", "melville"] {
        assert_eq!(job.outputs[e].tokens, alone[e], "{e}");
    }
    assert_ne!(
        alone["mail"], alone["sotu"],
        "the experts answer differently"
    );
    assert_eq!(job.payload_bytes, one_payload, "one code stream");
    // The producer records its half when its stream has been read, which may be after the
    // consumer's record update; wait (bounded) for it, then make sure no second one came.
    let mut waited = 0;
    while metric(&producer.metrics_text(), prefills) == metric(&before.0, prefills) {
        waited += 1;
        assert!(waited < 500, "the producer never counted its prefill");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = (producer.metrics_text(), consumer.metrics_text());
    assert_eq!(
        metric(&after.0, prefills) - metric(&before.0, prefills),
        1.0
    );
    for e in &experts {
        let d = metric(&after.1, &decodes(e)) - metric(&before.1, &decodes(e));
        assert_eq!(d, 1.0, "{e} decoded once");
    }

    // Auto fans out by quality. No joint translator here; the drift reports of sotu and
    // melville put raw under the ceiling (0.034, 0.047): raw, answering as the raw jobs did.
    let mild: Vec<String> = ["sotu", "melville"].map(String::from).to_vec();
    let job = fan_out(&cluster, &mild, Mode::Auto, &prompt).await;
    let why = job
        .mode_choice
        .clone()
        .expect("auto records its choice")
        .reason;
    assert_eq!(job.mode, Mode::Raw, "{why}");
    assert!(why.contains("raw's KL under"), "{why}");
    assert_eq!(job.output.unwrap().tokens, alone["sotu"]);
    assert_eq!(job.outputs["melville"].tokens, alone["melville"]);
    // Mail's report puts raw over it (0.17 on its own text), mail-rope's far over (1.39):
    // every expert prefills itself, answering as an oracle fan-out does.
    let with_rope: Vec<String> = ["mail", "mail-rope"].map(String::from).to_vec();
    let job = fan_out(&cluster, &with_rope, Mode::Auto, &prompt).await;
    let why = job
        .mode_choice
        .clone()
        .expect("auto records its choice")
        .reason;
    assert_eq!(job.mode, Mode::Oracle, "{why}");
    assert!(why.ends_with("for mail, mail-rope"), "{why}");
    let oracle = fan_out(&cluster, &with_rope, Mode::Oracle, &prompt).await;
    assert_eq!(job.output, oracle.output);
    assert_eq!(
        job.outputs["mail-rope"].tokens,
        oracle.outputs["mail-rope"].tokens
    );

    // What cannot fan out is refused before anything is created.
    for (names, mode, why) in [
        (vec!["mail", "sotu"], Mode::Scd, "joint translator"),
        // kvtc's codes are made in the basis one translator version holds, as scd's are.
        (vec!["mail", "sotu"], Mode::Kvtc, "joint translator"),
        (vec!["mail", "mail"], Mode::Raw, "named twice"),
    ] {
        let names: Vec<String> = names.into_iter().map(String::from).collect();
        let err = cluster
            .client
            .submit_fan_out(
                JobId::random(),
                &names,
                mode,
                request(&prompt, 4),
                TraceContext::new(),
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    }
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// Fan-out with codes (one joint translator fitted over several experts, `docs/method.md` §4.7):
/// the shipped joint translator of mail, sotu and melville is every expert's translator on both
/// nodes; one scd fan-out job sends the payload of one job, and each expert's result equals its own
/// scd job's (the same codes, rebuilt with its own decoder of the joint translator).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_joint_code_stream_serves_three_experts() {
    use scd_actors::config::ExpertConfig;
    let m = models();
    let prompt = prompt(m);
    let joint = repo().join("experts/joint/translator");
    let joint_hash = Translator::load(&joint).unwrap().hash();
    let experts: Vec<String> = ["mail", "sotu", "melville"].map(String::from).to_vec();
    let with_joint = |id: &str, roles: &str| {
        let mut c = config_with(id, roles, true, &joint, "");
        c.experts.clear();
        for name in &experts {
            c.experts.push(ExpertConfig {
                name: name.clone(),
                adapter: Some(repo().join("experts").join(name)),
                translator: joint.clone(),
            });
        }
        c
    };
    let cluster = Cluster::new();
    let mut producer_config = with_joint("prefill-0", "\"producer\", \"scheduler\"");
    producer_config.limits.prefix_cache_mib = 0;
    let producer = cluster.start(&producer_config).await;
    let consumer = cluster
        .start(&with_joint("experts-0", "\"consumer\""))
        .await;
    let (alone, one_payload) = each_alone(&cluster, &experts, Mode::Scd, &prompt).await;
    let job = fan_out(&cluster, &experts, Mode::Scd, &prompt).await;
    assert_eq!((job.mode, job.translator), (Mode::Scd, Some(joint_hash)));
    assert_eq!(job.payload_bytes, one_payload, "one code stream");
    assert_eq!(job.output.unwrap().tokens, alone["mail"]);
    for e in ["sotu", "melville"] {
        assert_eq!(job.outputs[e].tokens, alone[e], "{e}");
    }
    // Auto fans out with codes where the experts share a joint translator.
    let job = fan_out(&cluster, &experts, Mode::Auto, &prompt).await;
    let why = job
        .mode_choice
        .clone()
        .expect("auto records its choice")
        .reason;
    assert_eq!(
        (job.mode, job.translator),
        (Mode::Scd, Some(joint_hash)),
        "{why}"
    );
    assert_eq!(job.output.unwrap().tokens, alone["mail"]);
    for e in ["sotu", "melville"] {
        assert_eq!(job.outputs[e].tokens, alone[e], "{e}");
    }
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// The reference of a job with documents: each compiled alone by `writer`, stitched in order,
/// the prompt read after them by the expert, then greedy decoding, all in one process.
fn documents_reference(
    m: &common::Models,
    writer: &scd_models::Llama,
    docs: &[&[u32]],
    prompt: &[u32],
) -> Vec<u32> {
    use scd_models::sempic::{stitch, CompiledDoc};
    let compiled: Vec<CompiledDoc> = docs
        .iter()
        .map(|d| CompiledDoc::compile(writer, d).unwrap())
        .collect();
    let refs: Vec<&CompiledDoc> = compiled.iter().collect();
    let mut cache = stitch(&m.expert, &refs).unwrap();
    let (&last, prefix) = prompt.split_last().unwrap();
    m.expert
        .forward(
            scd_models::Input::new(prefix)
                .with_cache(&mut cache)
                .logits(scd_models::LogitsWanted::None),
        )
        .unwrap();
    scd_models::generate_with_cache(&m.expert, &mut cache, &[last], &common::params(), |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap()
    .tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_naming_documents_are_served_compiled_from_the_producers_store() {
    use scd_actors::config::ExpertConfig;
    use scd_scheduler::{DocumentRegistry, JobId, TraceContext};
    let m = models();
    let cluster = Cluster::new();
    let store_dir = tempfile::tempdir().unwrap();
    let writer_dir = repo().join("experts/sempic-writer");
    let section = format!(
        "[documents]\ndir = \"{}\"\nwriter = \"{}\"\nwire = \"f32\"\n",
        store_dir.path().display(),
        writer_dir.display()
    );
    let mut producer_config = config_with(
        "prefill-0",
        "\"producer\", \"scheduler\"",
        true,
        &repo().join("experts/mail/translator"),
        &section,
    );
    let sotu = ExpertConfig {
        name: "sotu".into(),
        adapter: Some(repo().join("experts/sotu")),
        translator: repo().join("experts/sotu/translator"),
    };
    producer_config.experts.push(sotu.clone());
    let producer = cluster.start(&producer_config).await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;
    let writer = {
        let adapter =
            scd_models::LoraAdapter::load(writer_dir.join("adapter.safetensors"), m.base.config())
                .unwrap();
        m.base
            .with_adapter(&adapter, scd_models::AdapterMode::Merge)
            .unwrap()
    };
    let version = scd_models::sempic::WriterVersion::of(&writer, None)
        .unwrap()
        .id();

    // Two documents, recorded once in the cluster; a question that names them.
    let texts = [
        "The lighthouse on Gull Rock was built in 1871 from granite quarried on the island. \
         Its lamp was lit by oil until 1934, when the keepers' cottage received electricity.",
        "Maria Okafor kept the lighthouse from 1952 to 1979. She logged every ship that passed \
         and rescued the crew of the trawler Bonny Lass during the storm of 1961.",
    ];
    let registry = DocumentRegistry::new(cluster.store.clone(), Keys::default());
    let mut records = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let tokens = m.tok.encode(t, false).unwrap();
        let r = registry
            .add(common::MODEL_FILE, tokens, Some(format!("doc{i}")))
            .await
            .unwrap();
        records.push(r);
    }
    let again = registry
        .add(common::MODEL_FILE, records[0].tokens.clone(), None)
        .await
        .unwrap();
    assert_eq!(
        again, records[0],
        "adding a document twice finds the first record"
    );
    let chat = m
        .tok
        .apply_chat_template(
            &[scd_models::tokenizer::ChatMessage::user(
                "Who kept the lighthouse, and whom did she rescue?".to_owned(),
            )],
            true,
        )
        .unwrap();
    let question = m.tok.encode(&chat, false).unwrap();
    let ask = |order: [usize; 2]| {
        let mut r = request(&question, MAX_TOKENS);
        r.documents = order.iter().map(|&i| records[i].id.clone()).collect();
        r
    };

    // First job: the producer compiles both into its store, serves them, and announces them.
    let job = cluster.run("mail", Mode::Oracle, ask([0, 1])).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    let first_payload = job.payload_bytes;
    let docs: Vec<&[u32]> = records.iter().map(|r| r.tokens.as_slice()).collect();
    let want = documents_reference(m, &writer, &docs, &question);
    assert_eq!(job.output.as_ref().unwrap().tokens, want);
    let served = job
        .documents
        .clone()
        .expect("the producer records the documents");
    assert_eq!(served.writer, version);
    assert_eq!(
        served.compiled,
        [records[0].id.clone(), records[1].id.clone()]
    );
    assert_eq!(served.hits, 0);
    assert_eq!(served.rows as usize, docs[0].len() + docs[1].len());
    assert!(job.stages.contains_key("documents") && !job.stages.contains_key("prefill"));
    assert_eq!(job.layer_bytes.len(), m.base.config().num_layers);
    let store = producer.documents().expect("the producer serves documents");
    assert_eq!((store.compilations(), store.hits()), (2, 0));
    let announced = |nodes: &scd_scheduler::NodeMap| {
        nodes.get("prefill-0").is_some_and(|n| {
            n.document_writer.as_deref() == Some(version.as_str())
                && records.iter().all(|r| n.documents.contains(&r.id))
        })
    };
    let mut waited = 0;
    while !announced(&cluster.client.nodes().await.unwrap()) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += 1;
        assert!(waited < 500, "the compiled documents were never announced");
    }

    // Second job, the documents the other way round: both from the store, nothing computed,
    // and the answer of that order.
    let job = cluster.run("mail", Mode::Oracle, ask([1, 0])).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    let want = documents_reference(m, &writer, &[docs[1], docs[0]], &question);
    assert_eq!(job.output.as_ref().unwrap().tokens, want);
    let served = job.documents.clone().unwrap();
    assert!(served.compiled.is_empty(), "{served:?}");
    assert_eq!(served.hits, 2);
    assert_eq!(
        (store.compilations(), store.hits()),
        (2, 2),
        "a hit computes nothing"
    );

    // Documents and a prompt that each fit the context but not together: the producer fails
    // the job with the three numbers before it fetches, compiles or sends anything.
    let context = m.base.config().context_length;
    let mut long = ask([0, 1]);
    long.max_tokens = (context - question.len()) as u32;
    let job = cluster.run("mail", Mode::Oracle, long).await;
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    let err = job.error.clone().unwrap_or_default();
    let rows = docs[0].len() + docs[1].len();
    for says in [
        format!("the documents take {rows} positions"),
        format!("the prompt {context} more"),
        format!("context holds {context}"),
    ] {
        assert!(err.contains(&says), "{err}");
    }
    assert_eq!((store.compilations(), store.hits()), (2, 2));

    // Refused at submission, with the reason: a document the cluster does not know, a
    // malformed id, and a mode other than oracle.
    let mut unknown = ask([0, 1]);
    unknown.documents[1] = scd_models::sempic::document_id(&[1, 2, 3]);
    for (req, mode, says) in [
        (unknown, Mode::Oracle, "scd docs add"),
        (
            {
                let mut r = ask([0, 1]);
                r.documents[0] = "not-an-id".into();
                r
            },
            Mode::Oracle,
            "not a document id",
        ),
        (ask([0, 1]), Mode::Raw, "mode oracle"),
    ] {
        let err = cluster.client.submit("mail", mode, req).await.unwrap_err();
        assert!(matches!(err, ClientError::Documents(_)), "{err:?}");
        assert!(err.to_string().contains(says), "{err}");
    }

    // A fan-out naming documents: the node that hosts mail and sotu (the only consumer now)
    // takes one stream of the documents' codes, and each expert reads the prompt after them.
    // Each answer is that expert's own job's on the same node.
    consumer.shutdown(Duration::ZERO).await;
    let mut both = config("experts-0", "\"consumer\"", true);
    both.experts.push(sotu);
    let consumer = cluster.start(&both).await;
    // Long enough for the experts to part after the answer both read from the documents.
    let longer = || {
        let mut r = ask([0, 1]);
        r.max_tokens = 64;
        r
    };
    let mut alone = std::collections::BTreeMap::new();
    for e in ["mail", "sotu"] {
        let job = cluster.run(e, Mode::Oracle, longer()).await;
        assert_eq!(job.state, JobState::Done, "{e}: {:?}", job.error);
        alone.insert(e, job.output.unwrap().tokens);
    }
    assert_ne!(
        alone["mail"], alone["sotu"],
        "the experts answer differently: {alone:?}"
    );
    let id = JobId::random();
    let experts = ["mail".to_owned(), "sotu".to_owned()];
    cluster
        .client
        .submit_fan_out(id, &experts, Mode::Oracle, longer(), TraceContext::new())
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.output.as_ref().unwrap().tokens, alone["mail"]);
    assert_eq!(job.outputs["sotu"].tokens, alone["sotu"]);
    assert_eq!(job.payload_bytes, first_payload, "one stream of codes");
    assert_eq!(job.documents.unwrap().hits, 2, "nothing compiled");

    // A restarted producer finds its store again: it announces what it holds before any job,
    // and serves the next job without compiling.
    producer.shutdown(Duration::ZERO).await;
    let producer = cluster.start(&producer_config).await;
    assert!(announced(&cluster.client.nodes().await.unwrap()));
    let job = cluster.run("mail", Mode::Oracle, ask([0, 1])).await;
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.documents.unwrap().hits, 2);
    assert_eq!(producer.documents().unwrap().compilations(), 0);
    consumer.shutdown(Duration::ZERO).await;
    producer.shutdown(Duration::ZERO).await;
}

/// A consumer that stops a job's stream without recording why must not leave the job running for
/// ever. Here the record names as consumer a node that takes no job streams (producer role only:
/// its transport refuses them, "no decoder expects this job", and writes nothing), as a
/// scheduler's stale view might. The producer hands the attempt back after its grace, and the
/// next attempt runs on the node that serves mail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_refused_without_a_record_is_handed_back_and_runs_again() {
    use scd_scheduler::{JobId, JobRecord, JobStore};
    let m = models();
    let cluster = Cluster::new();
    let (producer, consumer) = cluster.two_nodes().await;
    let bystander = cluster
        .start(&config("prefill-1", "\"producer\"", true))
        .await;
    let prompt = prompt(m);
    let mut job = JobRecord::new(JobId::random(), "mail", Mode::Raw, 3)
        .with_request(request(&prompt, MAX_TOKENS));
    job.assign(
        &NodeId::from_static("prefill-0"),
        &NodeId::from_static("prefill-1"),
        scd_scheduler::jobs::now_ms(),
    )
    .unwrap();
    JobStore::new(cluster.store.clone(), Keys::default())
        .create(&job)
        .await
        .unwrap();
    let done = cluster.client.wait(job.id, WAIT).await.unwrap();
    assert_eq!(done.state, JobState::Done, "{:?}", done.error);
    assert_eq!(done.attempts, 2, "{:?}", done.history);
    assert_eq!(done.consumer.as_deref(), Some("mail-0"));
    assert!(
        done.history.iter().any(|h| h.state == JobState::Queued),
        "handed back to the queue: {:?}",
        done.history
    );
    for node in [bystander, consumer, producer] {
        node.shutdown(Duration::ZERO).await;
    }
}

/// A consumer whose `[limits] kv_mib` cannot hold a job's caches hands the job back rather
/// than rebuilding them (the consumer bounds its own cache memory); with no other
/// consumer the job ends failed, saying which limit and by how much, and holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_without_room_for_a_jobs_caches_hands_it_back() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let scheduler = cluster
        .start(&config("sched-0", "\"scheduler\"", false))
        .await;
    let producer = cluster
        .start(&config("prefill-0", "\"producer\"", true))
        .await;
    let small = config_with(
        "mail-k",
        "\"consumer\"",
        true,
        &repo().join("experts/mail/translator"),
        "[limits]\nkv_mib = 1\n",
    );
    assert_eq!(small.limits.kv_mib, 1);
    let consumer = cluster.start(&small).await;

    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 16))
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Failed);
    let error = job.error.clone().unwrap_or_default();
    assert!(
        error.contains("mail-k") && error.contains("[limits] kv_mib (1)"),
        "{error}"
    );
    // Handed back each time (blaming the consumer), not failed at the first refusal.
    assert_eq!(job.attempts, job.max_attempts, "{:?}", job.history);
    assert!(job
        .failed_consumers
        .contains(&NodeId::from_static("mail-k")));
    assert!(job.failed_producers.is_empty());
    assert!(
        job.output.is_none(),
        "no cache was rebuilt, nothing decoded"
    );
    for node in [consumer, producer, scheduler] {
        node.shutdown(Duration::ZERO).await;
    }
}

/// A job naming documents decodes after their compiled rows, so its consumer reserves room for
/// those too: here the prompt and the answer alone fit the consumer's `kv_mib`, and with the
/// document they do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_reserves_room_for_a_jobs_documents_too() {
    use scd_models::KvCache;
    use scd_scheduler::DocumentRegistry;
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let translator = repo().join("experts/mail/translator");
    let store_dir = tempfile::tempdir().unwrap();
    let documents = format!("[documents]\ndir = \"{}\"\n", store_dir.path().display());
    let producer = cluster
        .start(&config_with(
            "prefill-0",
            "\"producer\", \"scheduler\"",
            true,
            &translator,
            &documents,
        ))
        .await;
    let max_tokens = 4;
    let cfg = m.base.config();
    let kv_mib = KvCache::peak_bytes(cfg, prompt.len() + max_tokens).div_ceil(1 << 20);
    let limits = format!("[limits]\nkv_mib = {kv_mib}\n");
    let small = config_with("mail-d", "\"consumer\"", true, &translator, &limits);
    let consumer = cluster.start(&small).await;

    let sentence = "The keeper logged every ship that passed the rock. ";
    let document = m.tok.encode(&sentence.repeat(20), false).unwrap();
    let with_document = document.len() + prompt.len() + max_tokens;
    assert!(KvCache::peak_bytes(cfg, with_document) > kv_mib << 20);
    let registry = DocumentRegistry::new(cluster.store.clone(), Keys::default());
    let record = registry
        .add(common::MODEL_FILE, document, None)
        .await
        .unwrap();
    let mut ask = request(&prompt, max_tokens);
    ask.documents = vec![record.id];
    let id = cluster
        .client
        .submit("mail", Mode::Oracle, ask)
        .await
        .unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.state, JobState::Failed, "{job:?}");
    let error = job.error.clone().unwrap_or_default();
    assert!(
        error.contains("mail-d") && error.contains(&format!("[limits] kv_mib ({kv_mib})")),
        "{error}"
    );
    assert_eq!(job.attempts, job.max_attempts, "{:?}", job.history);
    assert!(job.output.is_none(), "nothing decoded");
    for node in [consumer, producer] {
        node.shutdown(Duration::ZERO).await;
    }
}
