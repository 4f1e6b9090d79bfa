//! The receiver's real path as one function of bytes, for fuzzing: the bytes a peer could put
//! on a job stream go through the [`FrameReader`] that job streams use (fed from an in-memory
//! reader, in pieces, with waits and dropped reads), each validated frame through the
//! [`JobTracker`], until the tracker ends the job. [`receive_path`] panics when a property
//! breaks; anything else is a pass.
//!
//! Two harnesses run it: the cargo-fuzz target in `transport/fuzz` (open-ended, `make fuzz`) and
//! `tests/fuzz_receive.rs` (bounded, part of `cargo test`, a fresh seed per run plus the seed
//! corpus in `transport/fuzz/seeds`).
//!
//! An input is two setting bytes and the stream: `data[0]` chooses how the stream is handed to
//! the reader (piece sizes, waits, whether a waiting read is dropped and started again),
//! `data[1]` the caps (frame cap, per-job cap, budget, the body buffer's first step); the rest is
//! the stream.
//!
//! Properties checked on every input:
//! - nothing panics, and the reader never waits on an in-memory stream it could read;
//! - the outcome (frames delivered, how the job ended, what the receiver does about it) is the
//!   same however the stream is cut into pieces and however often a read is dropped;
//! - a frame body's buffer never holds more than about four times what arrived (or its first
//!   step), and never more than the budget; every share returns to the budget;
//! - a delivered frame deserialises, re-encodes and decodes to the same message, and the job
//!   rules read the same facts from it owned or archived;
//! - the receiver's reply to the sender (an Error frame) always fits on the reply half.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};

use crate::budget::ReceiveBudget;
use crate::codec::{self, DecodeError, HEADER_LEN};
use crate::framing::{FrameReader, BODY_STEP};
use crate::session::{
    error_code, EndAction, FrameFacts, JobTracker, RecvError, RecvStep, SendHalf,
};
use crate::stream::CONTROL_MAX_FRAME_BYTES;
use crate::wire::{Control, Message};

/// How a job stream ended on the receiving side.
// One value per input, compared and dropped: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The sender finished and everything was delivered.
    Finished,
    /// The job failed with this error; the receiver carries out the action.
    Failed(RecvError, EndAction),
}

/// What the receiving side made of one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The frames delivered to the application, in order.
    pub delivered: Vec<Message>,
    /// How the job ended.
    pub ending: Ending,
}

/// The caps an input's second byte selects: (frame cap, per-job cap, receive budget, first
/// step of a body buffer).
pub fn caps(setting: u8) -> (u32, u64, u64, usize) {
    let max_frame: u32 = [256, 4 << 10, 64 << 10, 1 << 20][usize::from(setting & 3)];
    let max_job: u64 = [u64::MAX, 2 << 10, 64 << 10, 1 << 20][usize::from((setting >> 2) & 3)];
    let budget = u64::from(max_frame) * [1, 4][usize::from((setting >> 4) & 1)];
    // Small steps, so the growth of the body buffer is exercised on small frames too.
    let first_step = [BODY_STEP, 1, 64, 1000][usize::from((setting >> 5) & 3)];
    (max_frame, max_job, budget, first_step)
}

/// Piece sizes an input's first byte selects from.
const PIECES: [usize; 12] = [1, 2, 3, 7, 15, 16, 17, 100, 1500, 4096, 65_536, usize::MAX];

/// An input: the two setting bytes, then the stream.
pub fn input(delivery: u8, setting: u8, stream: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(stream.len() + 2);
    v.extend_from_slice(&[delivery, setting]);
    v.extend_from_slice(stream);
    v
}

/// How the stream is handed to the reader.
#[derive(Debug, Clone, Copy)]
struct Delivery {
    piece: usize,
    /// Every other read is a single byte.
    alternate: bool,
    /// Every other poll returns Pending first.
    wait: bool,
    /// A read that waits is dropped and started again.
    drop_waiting: bool,
}

impl Delivery {
    const WHOLE: Delivery = Delivery {
        piece: usize::MAX,
        alternate: false,
        wait: false,
        drop_waiting: false,
    };

    fn from_byte(b: u8) -> Self {
        Self {
            piece: PIECES[usize::from(b & 0x0f) % PIECES.len()],
            alternate: b & 0x10 != 0,
            wait: b & 0x20 != 0,
            drop_waiting: b & 0x40 != 0,
        }
    }
}

/// An in-memory stream delivered as [`Delivery`] says.
struct Pieces<'a> {
    data: &'a [u8],
    how: Delivery,
    /// Reads that returned data or the end, seen from outside while a read borrows the stream.
    reads: &'a Cell<usize>,
    waited: bool,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.how.wait && !self.waited {
            self.waited = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.waited = false;
        self.reads.set(self.reads.get() + 1);
        let piece = if self.how.alternate && self.reads.get().is_multiple_of(2) {
            1
        } else {
            self.how.piece
        };
        let n = piece.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Run the receiver's path on `data`; panics when a property breaks. Returns the outcome, for
/// harnesses that count what they covered.
pub fn receive_path(data: &[u8]) -> Outcome {
    let (Some(&delivery), Some(&setting)) = (data.first(), data.get(1)) else {
        return Outcome {
            delivered: vec![],
            ending: Ending::Finished,
        };
    };
    let stream = &data[2..];
    let whole = comparable(run(stream, setting, Delivery::WHOLE));
    let cut = comparable(run(stream, setting, Delivery::from_byte(delivery)));
    assert_eq!(
        whole,
        cut,
        "the outcome depends on how the stream was cut ({:?})",
        Delivery::from_byte(delivery)
    );
    whole
}

/// The outcome without bytecheck's text, which names heap addresses of this run.
fn comparable(mut o: Outcome) -> Outcome {
    if let Ending::Failed(RecvError::Decode(DecodeError::Invalid(text)), _) = &mut o.ending {
        text.clear();
    }
    o
}

fn run(stream: &[u8], setting: u8, how: Delivery) -> Outcome {
    let (max_frame, max_job, budget_total, first_step) = caps(setting);
    let budget = ReceiveBudget::new(budget_total);
    let mut reader = FrameReader::new(max_frame, Some(budget.clone())).with_first_step(first_step);
    let mut tracker = JobTracker::new(max_job);
    let reads = Cell::new(0);
    let mut src = Pieces {
        data: stream,
        how,
        reads: &reads,
        waited: false,
    };
    let mut delivered = vec![];
    let ending = loop {
        let read = next_frame(
            &mut reader,
            &mut src,
            how.drop_waiting,
            budget_total,
            first_step,
        );
        let step = match read {
            Ok(Some(frame)) => {
                assert_eq!(
                    frame.budget_held() as usize + HEADER_LEN,
                    frame.frame_len(),
                    "a frame holds its body's length of budget"
                );
                let msg = frame.to_message().expect("a validated frame deserialises");
                let again = codec::encode(&msg, u32::MAX).expect("a validated message re-encodes");
                let (back, _) = codec::decode(&again, u32::MAX).expect("and decodes");
                assert_eq!(back, msg, "re-encoding changed the message");
                let facts = FrameFacts::of_archived(frame.archived());
                assert_eq!(
                    facts,
                    FrameFacts::of(&msg),
                    "owned and archived facts differ"
                );
                match tracker.on_frame(facts, frame.frame_len()) {
                    RecvStep::Deliver => {
                        delivered.push(msg);
                        continue;
                    }
                    step => step,
                }
            }
            Ok(None) => tracker.on_end_of_stream(),
            Err(e) => tracker.on_read_failure(e.into()),
        };
        break match step {
            RecvStep::Deliver => unreachable!("delivery continues the loop"),
            RecvStep::Finished(action) => {
                assert!(
                    action.reply.is_none() && action.stop.is_none(),
                    "{action:?}"
                );
                Ending::Finished
            }
            RecvStep::Failed(action, error) => {
                check_action(&tracker, &action, &error);
                Ending::Failed(error, action)
            }
        };
    };
    assert!(tracker.is_ended(), "the tracker must know the job ended");
    if let Some(m) = delivered.first() {
        assert!(
            matches!(m, Message::Control(Control::Open { .. })),
            "the first delivered frame is not Open: {m:?}"
        );
    }
    assert!(
        delivered.iter().all(|m| m.job_id() == tracker.job_id()),
        "a frame of another job was delivered"
    );
    drop(reader);
    assert_eq!(budget.stats().in_use, 0, "a budget share was not returned");
    Outcome { delivered, ending }
}

/// The reader's next frame, polled by hand (an in-memory stream needs no runtime), checking the
/// body buffer's size wherever a read stops.
fn next_frame(
    reader: &mut FrameReader,
    src: &mut Pieces<'_>,
    drop_waiting: bool,
    budget: u64,
    first_step: usize,
) -> Result<Option<crate::framing::ReceivedFrame>, crate::framing::FrameReadError> {
    let mut cx = Context::from_waker(Waker::noop());
    let reads = src.reads;
    // Polls in a row without a read: the in-memory stream waits only every other poll, so a
    // few are normal; many mean the reader waits for something that will never come.
    let mut idle = 0;
    let mut seen = reads.get();
    let mut progress = move || {
        if reads.get() == seen {
            idle += 1;
            assert!(idle < 8, "the reader is stuck waiting");
        } else {
            seen = reads.get();
            idle = 0;
        }
    };
    loop {
        let polled = {
            let mut next = pin!(reader.next(&mut *src));
            let mut polled = next.as_mut().poll(&mut cx);
            while polled.is_pending() && !drop_waiting {
                progress();
                polled = next.as_mut().poll(&mut cx);
            }
            polled
        };
        check_body(reader, budget, first_step);
        match polled {
            Poll::Ready(r) => return r,
            Poll::Pending => progress(),
        }
    }
}

fn check_body(reader: &FrameReader, budget: u64, first_step: usize) {
    let cap = reader.body_capacity();
    let received = reader.bytes_pending().saturating_sub(HEADER_LEN);
    // Four times what arrived, or the first step; a sixteenth more where a growth took the rest
    // of the body.
    assert!(
        15 * cap <= (16 * first_step).max(64 * received),
        "body buffer of {cap} bytes for {received} received"
    );
    assert!(cap as u64 <= budget, "body buffer over the whole budget");
}

fn check_action(tracker: &JobTracker, action: &EndAction, error: &RecvError) {
    if let Some(reply) = &action.reply {
        codec::encode(&Message::Control(reply.clone()), CONTROL_MAX_FRAME_BYTES)
            .expect("the receiver's reply fits on the reply half");
    }
    match error {
        RecvError::Protocol(_) | RecvError::Decode(_) => {
            assert_eq!(action.stop, Some(error_code::PROTOCOL), "{error}");
            assert!(
                matches!(
                    &action.reply,
                    Some(Control::Error { job_id, code: error_code::PROTOCOL, .. })
                        if *job_id == tracker.job_id()
                ),
                "a rejection tells the sender why: {action:?}"
            );
        }
        RecvError::CancelledByPeer { reason: Some(_) } => assert_eq!(
            action,
            &EndAction {
                send: SendHalf::Finish,
                ..EndAction::NOTHING
            }
        ),
        RecvError::OverBudget(_) => panic!("the budget is never below the frame cap here"),
        RecvError::Truncated => assert!(action.reply.is_none() && action.stop.is_none()),
        other => panic!("an in-memory stream cannot end with {other}"),
    }
}
