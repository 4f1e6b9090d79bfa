//! Nodes killed and started again under the same id at once, in one process on
//! the embedded store: `Node::kill` stops a node as a crash would (no drain, its lease left to
//! expire) and a new `Node` with the same id registers over its key while the old lease still
//! lives. The scheduler must take the new incarnation as the old one leaving: the job the old
//! one held is handed back and runs to the end once, and the admission count comes back to the
//! number of unfinished jobs. An in-process restart stands in for `kill -9` and a new process.
//!
//! The failpoints are process-wide and keyed by node id, and the tests run at once: each test
//! names the nodes it kills (or holds) differently from every other test here.

use crate::common;

use std::time::Duration;

use crate::common::{config, models, prompt, request, Cluster, WAIT};
use scd_actors::node::failpoints;
use scd_scheduler::{admission, JobId, JobRecord, JobState, JobStore, Keys, Mode};

/// Polls `id`'s record until `ready` holds of it (bounded by [`WAIT`]).
async fn until(cluster: &Cluster, id: JobId, what: &str, ready: impl Fn(&JobRecord) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = cluster.client.get(id).await.unwrap();
        if ready(&job) {
            return;
        }
        assert!(!job.state.is_finished(), "{what}: ended first: {job:?}");
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The job ended done once, and nothing is left counted against admission.
async fn done_once_and_nothing_held(cluster: &Cluster, job: &JobRecord, tokens: usize) {
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.output.as_ref().map(|o| o.tokens.len()), Some(tokens));
    let dones = job
        .history
        .iter()
        .filter(|h| h.state == JobState::Done)
        .count();
    assert_eq!(dones, 1, "{:?}", job.history);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let held = admission::current(cluster.store.as_ref(), &Keys::default())
            .await
            .unwrap()
            .unfinished;
        if held == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "admission still counts {held} jobs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_while_decoding_and_restarted_under_its_id_loses_no_job() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let scheduler = cluster
        .start(&config("sched-0", "\"scheduler\"", false))
        .await;
    let producer = cluster
        .start(&config("prefill-0", "\"producer\"", true))
        .await;
    let consumer = cluster.start(&config("mail-0", "\"consumer\"", true)).await;

    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 160))
        .await
        .unwrap();
    until(&cluster, id, "decoding on mail-0 with output", |j| {
        j.state == JobState::Decoding
            && j.consumer.as_deref() == Some("mail-0")
            && j.output.as_ref().is_some_and(|o| o.tokens.len() >= 4)
    })
    .await;
    // SIGKILL: the node says nothing more.
    failpoints::silence("mail-0", true);
    consumer.kill().await;
    failpoints::silence("mail-0", false);
    // What a client following the job was shown, made unlike anything the expert would
    // generate: the answer must go on from it, not start over.
    let shown = JobStore::new(cluster.store.clone(), Keys::default())
        .update(id, |j| {
            if let Some(o) = j.output.as_mut() {
                o.tokens.extend([1000, 1000, 1000]);
            }
            Ok(())
        })
        .await
        .unwrap()
        .output
        .unwrap()
        .tokens;
    let again = cluster.start(&config("mail-0", "\"consumer\"", true)).await;

    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.attempts, 2, "{:?}", job.history);
    assert_eq!(job.failed_consumers, vec!["mail-0".to_string()]);
    assert!(job.failed_producers.is_empty());
    assert_eq!(job.consumer.as_deref(), Some("mail-0"));
    done_once_and_nothing_held(&cluster, &job, 160).await;
    let answer = &job.output.as_ref().unwrap().tokens;
    assert_eq!(
        answer[..shown.len()],
        shown[..],
        "the answer goes on from what was shown"
    );
    for node in [again, producer, scheduler] {
        node.shutdown(Duration::ZERO).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_killed_between_claim_and_stream_and_restarted_under_its_id_loses_no_job() {
    let m = models();
    let prompt = prompt(m);
    let cluster = Cluster::new();
    let scheduler = cluster
        .start(&config("sched-0", "\"scheduler\"", false))
        .await;
    failpoints::hold_after_claim("prefill-r", true);
    let producer = cluster
        .start(&config("prefill-r", "\"producer\"", true))
        .await;
    let consumer = cluster.start(&config("mail-p", "\"consumer\"", true)).await;

    let id = cluster
        .client
        .submit("mail", Mode::Raw, request(&prompt, 24))
        .await
        .unwrap();
    until(&cluster, id, "claimed by prefill-r", |j| {
        j.state == JobState::Prefilling && j.producer.as_deref() == Some("prefill-r")
    })
    .await;
    failpoints::silence("prefill-r", true);
    producer.kill().await;
    failpoints::silence("prefill-r", false);
    failpoints::hold_after_claim("prefill-r", false);
    let again = cluster
        .start(&config("prefill-r", "\"producer\"", true))
        .await;

    let job = cluster.client.wait(id, WAIT).await.unwrap();
    assert_eq!(job.attempts, 2, "{:?}", job.history);
    assert_eq!(job.failed_producers, vec!["prefill-r".to_string()]);
    assert!(job.failed_consumers.is_empty());
    done_once_and_nothing_held(&cluster, &job, 24).await;
    for node in [again, consumer, scheduler] {
        node.shutdown(Duration::ZERO).await;
    }
}

/// The history a streaming client reads is the answer: a chat streamed through
/// the gateway in mode scd with adaptive ranks while its consumer is killed mid-decode and
/// restarted. What the client was shown is made unlike anything the expert would generate
/// (attempts with other ranks can answer differently; here they would not, by chance), and
/// the deltas it reads, concatenated, must be the job's final text, with one finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_through_a_consumer_killed_mid_decode_reads_exactly_the_final_answer() {
    use scd_actors::config::RankSetting;
    use scd_scheduler::JobStore;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let m = models();
    let cluster = Cluster::new();
    let mut front = common::config_with(
        "sched-0",
        "\"scheduler\", \"gateway\"",
        false,
        &common::repo().join("experts/mail/translator"),
        "http_listen = \"127.0.0.1:0\"\n",
    );
    front.codec.ranks = RankSetting::Adaptive;
    let front = cluster.start(&front).await;
    let mut producer = config("prefill-0", "\"producer\"", true);
    producer.codec.ranks = RankSetting::Adaptive;
    let producer = cluster.start(&producer).await;
    let consumer = cluster.start(&config("mail-s", "\"consumer\"", true)).await;

    // Counting goes on for long: the job is decoding when the consumer dies.
    let count: String = (1..=40).map(|i| format!("{i}, ")).collect();
    let body = serde_json::json!({
        "model": "mail", "prompt": count, "max_tokens": 200, "temperature": 0,
        "stream": true, "scd_mode": "scd",
    })
    .to_string();
    let addr = front.http_addr().expect("the gateway's address");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let reading = tokio::spawn(async move {
        let mut raw = Vec::new();
        conn.read_to_end(&mut raw).await.unwrap();
        String::from_utf8(raw).unwrap()
    });

    let jobs = JobStore::new(cluster.store.clone(), Keys::default());
    let deadline = tokio::time::Instant::now() + WAIT;
    let id = loop {
        // A listing shows a decoding record as last written; `get` adds the tokens appended
        // since.
        let listed = jobs.list().await.unwrap();
        if let Some((j, _)) = listed.iter().find(|(j, _)| j.state == JobState::Decoding) {
            let now = jobs.get(j.id).await.unwrap().unwrap();
            if now.output.as_ref().is_some_and(|o| o.tokens.len() >= 4) {
                break j.id;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no job decoding");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    failpoints::silence("mail-s", true);
    consumer.kill().await;
    failpoints::silence("mail-s", false);
    jobs.update(id, |j| {
        if let Some(o) = j.output.as_mut() {
            o.tokens.extend([1000, 1000, 1000]);
        }
        Ok(())
    })
    .await
    .unwrap();
    let again = cluster.start(&config("mail-s", "\"consumer\"", true)).await;

    let reply = reading.await.unwrap();
    let job = cluster.client.wait(id, WAIT).await.unwrap();
    // How many attempts it took is the other restart tests' business; each went on from what
    // the one before it showed.
    assert!(job.attempts >= 2, "{:?}", job.history);
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    // The events' payloads (`data: ...` lines; the chunked framing around them is skipped).
    let events: Vec<serde_json::Value> = reply
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let read: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    let answer = m
        .tok
        .decode(&job.output.as_ref().unwrap().tokens, true)
        .unwrap();
    assert_eq!(read, answer, "the deltas are the answer, once");
    let finishes = events
        .iter()
        .filter(|e| !e["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "{reply}");
    assert_eq!(reply.matches("data: [DONE]").count(), 1, "{reply}");
    for node in [again, producer, front] {
        node.shutdown(Duration::ZERO).await;
    }
}
