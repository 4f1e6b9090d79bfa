//! Latency of the scheduler's store operations on the embedded store and on a real etcd
//! (started here on loopback): a put, a compare-and-swap job update, the same update from eight
//! contending writers, and how long a leader failover takes when the leader dies.
//!
//! `cargo run -p scd-scheduler --example store_bench` (the dev profile builds dependencies at
//! opt-level 3)

use std::sync::Arc;
use std::time::{Duration, Instant};

use scd_scheduler::jobs::JobRecord;
use scd_scheduler::{
    Candidate, ElectionConfig, EmbeddedStore, EtcdServer, JobId, JobStore, Keys, MetaStore, Mode,
};

const OPS: usize = 500;

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

async fn bench(name: &str, store: Arc<dyn MetaStore>, clients: Vec<Arc<dyn MetaStore>>) {
    let keys = Keys::new("/bench");
    let mut puts = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let t = Instant::now();
        store
            .put("/bench/k", i.to_string().into_bytes(), None)
            .await
            .expect("put");
        puts.push(t.elapsed());
    }
    let jobs = JobStore::new(store.clone(), keys.clone());
    let (single, contended_id) = (JobId::random(), JobId::random());
    jobs.create(&JobRecord::new(single, "e", Mode::Scd, 3))
        .await
        .expect("create");
    let mut updates = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let t = Instant::now();
        jobs.update(single, |j| {
            j.payload_bytes = i as u64;
            Ok(())
        })
        .await
        .expect("update");
        updates.push(t.elapsed());
    }
    jobs.create(&JobRecord::new(contended_id, "e", Mode::Scd, 3))
        .await
        .expect("create");
    let per_writer = OPS / clients.len();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for (w, client) in clients.iter().enumerate() {
        let jobs = JobStore::new(client.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..per_writer {
                jobs.update(contended_id, |j| {
                    j.timings_ms.insert(format!("{w}-{i}"), 0.0);
                    Ok(())
                })
                .await
                .expect("contended update");
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer");
    }
    let contended = t.elapsed();
    let total = per_writer * clients.len();
    let kept = jobs
        .get(contended_id)
        .await
        .expect("get")
        .expect("job")
        .timings_ms
        .len();
    assert_eq!(kept, total, "lost updates");

    let ttl = Duration::from_secs(2);
    let a = Candidate::start(
        clients[0].clone(),
        &keys,
        "bench",
        "a",
        ElectionConfig { ttl },
    )
    .expect("candidate");
    a.wait_until_leader().await;
    let b = Candidate::start(
        clients[1].clone(),
        &keys,
        "bench",
        "b",
        ElectionConfig { ttl },
    )
    .expect("candidate");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    drop(a);
    b.wait_until_leader().await;
    let failover = t.elapsed();

    println!(
        "| {name} | {:.1} | {:.1} | {:.0} | {:.2} |",
        median_us(puts),
        median_us(updates),
        total as f64 / contended.as_secs_f64(),
        failover.as_secs_f64()
    );
}

#[tokio::main]
async fn main() {
    println!("| store | put median (us) | CAS job update median (us) | contended updates/s (8 writers) | failover after leader death, TTL 2 s (s) |");
    println!("|---|---|---|---|---|");
    let embedded = Arc::new(EmbeddedStore::new());
    let clients: Vec<Arc<dyn MetaStore>> = (0..8)
        .map(|_| embedded.clone() as Arc<dyn MetaStore>)
        .collect();
    bench("embedded", embedded.clone(), clients).await;
    let server = EtcdServer::start().await.expect("etcd (run `make setup`)");
    let store: Arc<dyn MetaStore> = Arc::new(server.store().await.expect("connect"));
    let mut clients: Vec<Arc<dyn MetaStore>> = Vec::new();
    for _ in 0..8 {
        clients.push(Arc::new(server.store().await.expect("connect")));
    }
    bench("etcd 3.4 (loopback, one member)", store, clients).await;
}
