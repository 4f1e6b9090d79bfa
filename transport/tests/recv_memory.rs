//! Receive-side memory over real QUIC on loopback: a peer that announces a huge frame and sends
//! slowly makes the receiver allocate about what it sent (measured with a counting allocator),
//! and jobs over several connections share the node's receive budget: what fits completes, what
//! does not is refused as busy (the sender sees why), and the budget comes back whole.
//!
//! The tests of this file run one at a time (the allocator's counters are process-wide).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use scd_transport::codec::header_bytes;
use scd_transport::{
    error_code, BindError, ClusterCa, CodeDType, CodeFrame, CodeKind, Endpoint, JobId, LayerCode,
    Message, RecvError, Role, SendError, TraceContext, TransportOptions,
};
use tokio::sync::{mpsc, watch};

use common::{local, open_raw_job, raw_client, serve_as_node_a};

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(by: isize) {
    let now = LIVE.fetch_add(by, Ordering::SeqCst) + by;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            grew(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `test` on a runtime of its own while no other test of this file runs.
fn serial<F: std::future::Future>(test: F) -> F::Output {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test)
}

const MIB: usize = 1 << 20;

#[test]
fn a_peer_announcing_a_gigabyte_frame_and_sending_slowly_gets_no_gigabyte() {
    serial(announced_gigabyte());
}

async fn announced_gigabyte() {
    let ca = ClusterCa::generate("mem").unwrap();
    // The node accepts frames up to 1 GiB and may hold 1 GiB of frames in all.
    const DECLARED: u32 = 1 << 30;
    let opts = TransportOptions {
        max_frame_bytes: DECLARED,
        receive_budget_bytes: u64::from(DECLARED),
        ..TransportOptions::default()
    };
    let server = serve_as_node_a(&ca, opts);
    let s = server.clone();
    let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
    let raw = raw_client(&ca, &server).await;
    let conn = accept.await.unwrap().unwrap();

    let job = JobId::from_u128(0x6b);
    let (mut send, _back) = open_raw_job(&raw, job).await;
    let mut rx = conn.accept_job().await.unwrap();
    let receiver = tokio::spawn(async move { rx.next().await });

    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    send.write_all(&header_bytes(DECLARED)).await.unwrap();
    // 8 MiB of body, in 64 KiB writes with pauses, then the sender gives up mid-frame: the
    // receiver reads all of it before it sees the end.
    const SENT: usize = 8 * MIB;
    let piece = vec![0x5au8; 64 << 10];
    for i in 0..SENT / piece.len() {
        send.write_all(&piece).await.unwrap();
        if i % 16 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    send.finish().unwrap();
    let err = receiver.await.unwrap().unwrap_err();
    assert_eq!(err, RecvError::Truncated);
    let peak = (PEAK.load(Ordering::SeqCst) - before) as usize;
    println!(
        "peak heap growth {:.1} MiB for {} MiB received of {} MiB announced",
        peak as f64 / MIB as f64,
        SENT / MIB,
        DECLARED as usize / MIB
    );
    // What may be held: the body buffer (16 MiB: it grows fourfold, 1, 4, 16 MiB), QUIC's
    // buffers on both sides (windows of a few MiB) and the sender's piece. Announced: 1 GiB.
    assert!(
        peak < 48 * MIB,
        "the receiver allocated {} MiB for {} MiB received of {} MiB announced",
        peak / MIB,
        SENT / MIB,
        DECLARED as usize / MIB
    );
    // The budget was charged for the buffer (at most four times what arrived), not for the
    // announced gigabyte.
    let stats = server.receive_budget();
    assert!(stats.high_water <= 4 * SENT as u64, "{stats:?}");
    assert_eq!(stats.in_use, 0, "{stats:?}");
    server.close();
}

fn frame(job: JobId, layer: u16, len: usize) -> CodeFrame {
    CodeFrame::new(
        job,
        LayerCode {
            layer,
            kind: CodeKind::RAW_K,
            dtype: CodeDType::U8,
            shape: vec![len as u32],
            bytes: vec![layer as u8; len],
        },
    )
}

/// What became of one receiving job.
#[derive(Debug)]
enum Fate {
    /// Its first frame is in hand.
    Holding,
    /// Refused: the budget was spent.
    Busy,
}

#[test]
fn jobs_over_two_connections_share_the_budget_and_the_excess_is_refused_as_busy() {
    serial(budget_shared_by_jobs());
}

async fn budget_shared_by_jobs() {
    const BUDGET: u64 = 4 << 20;
    const PAYLOAD: usize = 900 << 10;
    const JOBS_PER_CONN: u64 = 6;
    const JOBS: usize = 2 * JOBS_PER_CONN as usize;
    // One frame per competing job: a receiver that holds a frame and stops reading would
    // otherwise leave the job's later frames in quinn's buffers, where they count against the
    // connection's flow-control window and stall every other stream on it (QUIC's rule, not the
    // budget's).
    const FRAMES: u16 = 1;
    let ca = ClusterCa::generate("budget").unwrap();
    let opts = TransportOptions {
        max_frame_bytes: 1 << 20,
        receive_budget_bytes: BUDGET,
        ..TransportOptions::default()
    };
    let server = serve_as_node_a(&ca, opts.clone());
    let addr = server.local_addr().unwrap();

    // Senders: two client nodes, each opens its jobs on its own connection.
    let mut senders = vec![];
    let mut clients = vec![];
    let mut server_conns = vec![];
    let mut to_servers = vec![];
    for c in 0..2u64 {
        let s = server.clone();
        let accept = tokio::spawn(async move { s.accept().await.unwrap().complete().await });
        let name = format!("node-c{c}");
        let client =
            Endpoint::bind(local(), &ca.issue(&name, Role::Node).unwrap(), opts.clone()).unwrap();
        let to_server = client.connect(addr, "node-a").await.unwrap();
        server_conns.push(accept.await.unwrap().unwrap());
        for j in 0..JOBS_PER_CONN {
            let conn = to_server.clone();
            let job = JobId::from_u128(u128::from(c * 100 + j));
            senders.push(tokio::spawn(async move {
                let mut tx = conn.open_job(job, TraceContext::new()).await.unwrap();
                for l in 0..FRAMES {
                    tx.send(frame(job, l, PAYLOAD)).await?;
                }
                tx.finish().await
            }));
        }
        to_servers.push(to_server);
        clients.push(client);
    }

    // Receivers: each reads its first frame in place and holds it until released, so the
    // frames compete for the budget.
    let mut accepted = vec![];
    for conn in &server_conns {
        for _ in 0..JOBS_PER_CONN {
            accepted.push(conn.accept_job().await.unwrap());
        }
    }
    let (fate_tx, mut fates) = mpsc::unbounded_channel::<Fate>();
    let (release_tx, release) = watch::channel(false);
    let mut receivers = vec![];
    for mut rx in accepted {
        let fate_tx = fate_tx.clone();
        let mut release = release.clone();
        receivers.push(tokio::spawn(async move {
            let first = match rx.next_frame().await {
                Ok(Some(f)) => f,
                Err(RecvError::OverBudget(_)) => {
                    fate_tx.send(Fate::Busy).unwrap();
                    return None;
                }
                other => panic!("{other:?}"),
            };
            fate_tx.send(Fate::Holding).unwrap();
            release.wait_for(|r| *r).await.unwrap();
            let Some(Message::Code(f)) = first.to_message().ok() else {
                panic!("not a code frame")
            };
            assert_eq!(f, frame(rx.job_id(), 0, PAYLOAD));
            drop(first);
            assert!(rx.next().await.unwrap().is_none());
            Some(1)
        }));
    }
    let (mut holding, mut busy) = (0, 0);
    for _ in 0..JOBS {
        match fates.recv().await.unwrap() {
            Fate::Holding => holding += 1,
            Fate::Busy => busy += 1,
        }
    }
    let stats = server.receive_budget();
    // At most four frames of 900 KiB fit in 4 MiB; a refused frame gives its share back at
    // once, so the last one standing always fits.
    assert!((1..=4).contains(&holding), "{holding} holding, {busy} busy");
    assert!(
        stats.in_use <= BUDGET && stats.high_water <= BUDGET,
        "{stats:?}"
    );
    assert_eq!(stats.refused, busy as u64, "{stats:?}");

    release_tx.send(true).unwrap();
    let completed = futures_count(receivers).await;
    assert_eq!(completed, holding);
    let (mut sent, mut refused) = (0, 0);
    for s in senders {
        match s.await.unwrap() {
            Ok(report) => {
                assert_eq!(report.frames, 1 + u64::from(FRAMES));
                sent += 1;
            }
            Err(SendError::Rejected { code, .. }) if code == error_code::BUSY => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((sent, refused), (holding, busy));

    // The budget came back whole: four jobs of four such frames, read as they come, all go
    // through at once.
    let stats = server.receive_budget();
    assert_eq!(stats.in_use, 0, "{stats:?}");
    let (mut sending, mut receiving) = (vec![], vec![]);
    for j in 0..4u64 {
        let c = (j % 2) as usize;
        let job = JobId::from_u128(u128::from(1000 + j));
        let mut tx = to_servers[c]
            .open_job(job, TraceContext::new())
            .await
            .unwrap();
        let mut rx = server_conns[c].accept_job().await.unwrap();
        sending.push(tokio::spawn(async move {
            for l in 0..4 {
                tx.send(frame(job, l, PAYLOAD)).await.unwrap();
            }
            tx.finish().await.unwrap()
        }));
        receiving.push(tokio::spawn(async move {
            let mut got = 0;
            while rx.next().await.unwrap().is_some() {
                got += 1;
            }
            got
        }));
    }
    for r in receiving {
        assert_eq!(r.await.unwrap(), 4);
    }
    for s in sending {
        s.await.unwrap();
    }
    assert!(server.receive_budget().high_water <= BUDGET);
    server.close();
    for c in clients {
        c.close();
    }
}

/// Waits for every receiver; counts those that completed their job.
async fn futures_count(receivers: Vec<tokio::task::JoinHandle<Option<u16>>>) -> usize {
    let mut n = 0;
    for r in receivers {
        if r.await.unwrap().is_some() {
            n += 1;
        }
    }
    n
}

#[test]
fn a_budget_below_the_frame_cap_is_refused_at_bind() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let ca = ClusterCa::generate("cfg").unwrap();
    let opts = TransportOptions {
        max_frame_bytes: 2 << 20,
        receive_budget_bytes: 1 << 20,
        ..TransportOptions::default()
    };
    let err = Endpoint::bind(local(), &ca.issue("node-a", Role::Node).unwrap(), opts).unwrap_err();
    assert!(
        matches!(
            err,
            BindError::BudgetBelowFrameCap {
                budget: 1_048_576,
                max_frame: 2_097_152
            }
        ),
        "{err}"
    );
}
