//! Whole frames on streams: [`FrameReader`] reads and validates frames from any
//! [`AsyncRead`] (a quinn [`RecvStream`](quinn::RecvStream) on the network, an in-memory
//! reader in the fuzz harness), and the write helpers put encoded frames on a quinn
//! [`SendStream`], paced or not. Built on the pure functions of [`crate::codec`]; knows nothing of
//! jobs (that is [`crate::session`]) or connections.
//!
//! Receive-side memory: the header is checked (magic, version, the frame cap) before anything is
//! allocated; then the body buffer grows with the bytes actually received: [`BODY_STEP`] (or
//! the whole body when it is smaller), then four times as much each time it fills, up to the
//! declared length. So a peer that announces a large frame and sends slowly makes the node
//! allocate at most about four times what it sent (or one step), never what it announced. Every
//! growth is charged to the endpoint's [`ReceiveBudget`] first, and fails when the budget is
//! spent (see [`crate::budget`] for why it does not wait).
//!
//! Why these numbers: each growth moves the bytes received so far (`realloc`), so frames up to a
//! step take one allocation as before the budget, and larger ones copy about a third of their
//! length once more; a growth that would leave less than a sixteenth of the frame for later
//! takes all of it (a round payload plus the archive's hundred bytes of overhead would
//! otherwise cost a last copy of the whole frame).

use std::future::poll_fn;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use quinn::{ConnectionError, ReadError, SendStream, WriteError};
use tokio::io::{AsyncRead, ReadBuf};

use crate::budget::{BudgetError, BudgetShare, ReceiveBudget};
use crate::codec::{
    self, check_header, DecodeError, EncodeError, EncodedFrame, FrameBuf, ValidatedFrame,
    HEADER_LEN,
};
use crate::pacing::Pacer;
use crate::session::{ConnectionLoss, ReadFailure};
use crate::wire::{ArchivedMessage, Message};

/// The first allocation for a frame body (or the whole body, when it is smaller): one layer's
/// codes usually fit, and an announced-but-unsent frame costs no more than this.
pub const BODY_STEP: usize = 1 << 20;

/// How much a body buffer grows each time it is full.
const BODY_GROWTH: usize = 4;

/// Chunk size of paced writes: small enough that the pacer's waits stay short.
const PACED_CHUNK: usize = 16 << 10;

/// Reading one frame failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameReadError {
    /// The bytes are not a valid frame.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// The frame does not fit in the receive budget.
    #[error(transparent)]
    OverBudget(#[from] BudgetError),
    /// The peer reset the stream with an application code.
    #[error("stream reset by peer with code {0}")]
    Reset(u64),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Connection(ConnectionError),
    /// The stream was already closed locally.
    #[error("stream already closed")]
    Closed,
    /// A reader other than a QUIC stream failed.
    #[error("reading a frame: {0}")]
    Io(io::Error),
}

impl From<ReadError> for FrameReadError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Reset(code) => FrameReadError::Reset(code.into_inner()),
            ReadError::ConnectionLost(c) => FrameReadError::Connection(c),
            ReadError::ClosedStream
            | ReadError::IllegalOrderedRead
            | ReadError::ZeroRttRejected => FrameReadError::Closed,
        }
    }
}

impl From<io::Error> for FrameReadError {
    /// quinn's `AsyncRead` wraps its [`ReadError`] in an `io::Error`; it is unwrapped again here
    /// so that resets and lost connections keep their codes and causes.
    fn from(e: io::Error) -> Self {
        if e.get_ref().is_some_and(|inner| inner.is::<ReadError>()) {
            if let Some(Ok(read)) = e.into_inner().map(|inner| inner.downcast::<ReadError>()) {
                return (*read).into();
            }
            return FrameReadError::Closed;
        }
        FrameReadError::Io(e)
    }
}

/// How a lost connection looks to the job rules.
pub(crate) fn connection_loss(c: ConnectionError) -> ConnectionLoss {
    match c {
        ConnectionError::LocallyClosed => ConnectionLoss::ClosedLocally,
        other => ConnectionLoss::Peer(other.to_string()),
    }
}

impl From<FrameReadError> for ReadFailure {
    fn from(e: FrameReadError) -> Self {
        match e {
            FrameReadError::Decode(d) => ReadFailure::Malformed(d),
            FrameReadError::Truncated => ReadFailure::Truncated,
            FrameReadError::OverBudget(b) => ReadFailure::OverBudget(b),
            FrameReadError::Reset(code) => ReadFailure::Reset(code),
            FrameReadError::Connection(c) => ReadFailure::Lost(connection_loss(c)),
            FrameReadError::Closed => ReadFailure::Closed,
            FrameReadError::Io(e) => ReadFailure::Lost(ConnectionLoss::Peer(e.to_string())),
        }
    }
}

/// Writing one frame failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameWriteError {
    /// The message could not be encoded; nothing was written.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The peer stopped the stream with an application code.
    #[error("stream stopped by peer with code {0}")]
    Stopped(u64),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Connection(ConnectionError),
    /// The stream was already closed locally.
    #[error("stream already closed")]
    Closed,
}

impl From<WriteError> for FrameWriteError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Stopped(code) => FrameWriteError::Stopped(code.into_inner()),
            WriteError::ConnectionLost(c) => FrameWriteError::Connection(c),
            WriteError::ClosedStream | WriteError::ZeroRttRejected => FrameWriteError::Closed,
        }
    }
}

/// A frame that passed validation, kept in its receive buffer, with the share of the receive
/// budget it holds; the share returns to the budget when the frame is dropped.
#[derive(Debug)]
pub struct ReceivedFrame {
    frame: ValidatedFrame,
    share: Option<BudgetShare>,
}

impl ReceivedFrame {
    /// The archived message, read in place (no copy of the payload).
    pub fn archived(&self) -> &ArchivedMessage {
        self.frame.archived()
    }

    /// Deserialise into an owned message (copies the payload).
    pub fn to_message(&self) -> Result<Message, DecodeError> {
        self.frame.to_message()
    }

    /// Length of the frame on the wire, header included.
    pub fn frame_len(&self) -> usize {
        self.frame.frame_len()
    }

    /// Receive-budget bytes this frame holds (0 where the reader has no budget).
    pub fn budget_held(&self) -> u64 {
        self.share.as_ref().map_or(0, BudgetShare::len)
    }

    /// The validated frame.
    pub fn validated(&self) -> &ValidatedFrame {
        &self.frame
    }
}

#[derive(Debug)]
enum ReadState {
    /// Reading the header; this many bytes of it are in `FrameReader::header`.
    Header(usize),
    /// Reading the body; `share` is what its buffer holds of the budget.
    Body {
        body: FrameBuf,
        len: usize,
        share: Option<BudgetShare>,
    },
}

/// Reads frames from a stream, one at a time. Cancel-safe: what a dropped [`next`](Self::next)
/// had read stays in the reader.
#[derive(Debug)]
pub struct FrameReader {
    max_frame_bytes: u32,
    budget: Option<ReceiveBudget>,
    first_step: usize,
    header: [u8; HEADER_LEN],
    state: ReadState,
}

impl FrameReader {
    /// A reader refusing bodies over `max_frame_bytes`, charging every frame to `budget` if
    /// given.
    pub fn new(max_frame_bytes: u32, budget: Option<ReceiveBudget>) -> Self {
        Self {
            max_frame_bytes,
            budget,
            first_step: BODY_STEP,
            header: [0; HEADER_LEN],
            state: ReadState::Header(0),
        }
    }

    /// The same reader with a first body allocation of `bytes` instead of [`BODY_STEP`] (at
    /// least 1; tests and the fuzz harness use small steps to exercise the growth).
    pub fn with_first_step(mut self, bytes: usize) -> Self {
        self.first_step = bytes.max(1);
        self
    }

    /// Bytes allocated for the body of the frame being read (0 between frames).
    pub fn body_capacity(&self) -> usize {
        match &self.state {
            ReadState::Body { body, .. } => body.capacity(),
            _ => 0,
        }
    }

    /// Bytes of the frame being read that have arrived, header included.
    pub fn bytes_pending(&self) -> usize {
        match &self.state {
            ReadState::Header(n) => *n,
            ReadState::Body { body, .. } => HEADER_LEN + body.len(),
        }
    }

    /// The next frame, validated; `None` at a clean end of stream (between frames).
    pub async fn next<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
    ) -> Result<Option<ReceivedFrame>, FrameReadError> {
        loop {
            match &mut self.state {
                ReadState::Header(have) if *have == HEADER_LEN => {
                    let header = check_header(&self.header, self.max_frame_bytes)?;
                    let share = match &self.budget {
                        Some(b) => Some(b.share_for(header.body_len)?),
                        None => None,
                    };
                    self.state = ReadState::Body {
                        body: FrameBuf::new(),
                        len: header.body_len as usize,
                        share,
                    };
                }
                ReadState::Header(have) => {
                    let have = *have;
                    let n = poll_fn(|cx| {
                        poll_read_slice(Pin::new(&mut *r), cx, &mut self.header[have..])
                    })
                    .await?;
                    if n == 0 {
                        return if have == 0 {
                            Ok(None)
                        } else {
                            Err(FrameReadError::Truncated)
                        };
                    }
                    self.state = ReadState::Header(have + n);
                }
                ReadState::Body { body, len, .. } if body.len() == *len => {
                    let ReadState::Body { body, share, .. } =
                        std::mem::replace(&mut self.state, ReadState::Header(0))
                    else {
                        unreachable!("matched Body above")
                    };
                    let frame = ValidatedFrame::new(body)?;
                    return Ok(Some(ReceivedFrame { frame, share }));
                }
                ReadState::Body { body, len, share } => {
                    let len = *len;
                    if body.capacity() == body.len() {
                        grow(body, len, self.first_step, share.as_mut())?;
                    }
                    let n = poll_fn(|cx| poll_read_spare(Pin::new(&mut *r), cx, body, len)).await?;
                    if n == 0 {
                        return Err(FrameReadError::Truncated);
                    }
                }
            }
        }
    }
}

/// Grows the body's capacity as the module doc says, charging the growth to the budget first.
fn grow(
    body: &mut FrameBuf,
    len: usize,
    first_step: usize,
    share: Option<&mut BudgetShare>,
) -> Result<(), BudgetError> {
    let mut target = len.min(body.capacity().saturating_mul(BODY_GROWTH).max(first_step));
    if len - target <= len / 16 {
        target = len;
    }
    if let Some(share) = share {
        share.grow((target - body.capacity()) as u64)?;
    }
    // Exact: the capacity is what the budget was charged.
    body.reserve_exact(target - body.len());
    Ok(())
}

fn poll_read_slice<R: AsyncRead>(
    r: Pin<&mut R>,
    cx: &mut Context<'_>,
    buf: &mut [u8],
) -> Poll<io::Result<usize>> {
    let mut rb = ReadBuf::new(buf);
    ready!(r.poll_read(cx, &mut rb))?;
    Poll::Ready(Ok(rb.filled().len()))
}

/// Reads into the body's spare capacity, at most up to `len`: quinn copies its chunks straight
/// into the body, with no zero-filling first and no intermediate buffer.
fn poll_read_spare<R: AsyncRead>(
    r: Pin<&mut R>,
    cx: &mut Context<'_>,
    body: &mut FrameBuf,
    len: usize,
) -> Poll<io::Result<usize>> {
    let have = body.len();
    let room = (body.capacity() - have).min(len - have);
    // SAFETY: `have..have + room` lies within the allocation (room <= capacity - len), nothing
    // else refers to it while `spare` lives, and `MaybeUninit<u8>` needs no initialisation.
    let spare = unsafe {
        std::slice::from_raw_parts_mut(body.as_mut_ptr().add(have).cast::<MaybeUninit<u8>>(), room)
    };
    let start = spare.as_ptr().cast::<u8>();
    let mut rb = ReadBuf::uninit(spare);
    ready!(r.poll_read(cx, &mut rb))?;
    let filled = rb.filled();
    // `poll_read` may legally replace the ReadBuf with one of its own; bytes written there are
    // not in the body, so they must not be counted.
    if filled.as_ptr() != start || filled.len() > room {
        return Poll::Ready(Err(io::Error::other(
            "reader wrote outside the buffer it was given",
        )));
    }
    let n = filled.len();
    // SAFETY: the ReadBuf is ours (checked above) and its filled part, `have..have + n`, is
    // initialised; `have + n <= capacity`.
    unsafe { body.set_len(have + n) };
    Poll::Ready(Ok(n))
}

/// Read one whole frame, without a budget (the hello exchange, whose cap is tiny).
pub async fn read_one<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame_bytes: u32,
) -> Result<Option<Message>, FrameReadError> {
    match FrameReader::new(max_frame_bytes, None).next(r).await? {
        Some(f) => Ok(Some(f.to_message()?)),
        None => Ok(None),
    }
}

/// Encode and write one frame.
pub async fn write_one(
    send: &mut SendStream,
    msg: &Message,
    max_frame_bytes: u32,
) -> Result<(), FrameWriteError> {
    let buf = codec::encode(msg, max_frame_bytes)?;
    send.write_all(&buf).await?;
    Ok(())
}

/// Write an encoded frame's segments as they are (a large payload goes to quinn from its own
/// buffer), through `pacer` when the link is emulated.
pub async fn write_encoded(
    send: &mut SendStream,
    frame: EncodedFrame,
    pacer: Option<&Pacer>,
) -> Result<(), WriteError> {
    let mut segments = frame.into_segments();
    match pacer {
        None => send.write_all_chunks(&mut segments).await,
        Some(p) => {
            for seg in segments {
                write_paced(send, seg, p).await?;
            }
            Ok(())
        }
    }
}

async fn write_paced(send: &mut SendStream, seg: Bytes, p: &Pacer) -> Result<(), WriteError> {
    for start in (0..seg.len()).step_by(PACED_CHUNK) {
        let end = (start + PACED_CHUNK).min(seg.len());
        p.pace((end - start) as u64).await;
        send.write_chunk(seg.slice(start..end)).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodeFrame, Control};
    use scd_types::{CodeDType, CodeKind, JobId, LayerCode};
    use std::future::Future;
    use std::task::Waker;

    /// An in-memory stream that hands out at most `piece` bytes per read.
    struct Pieces<'a> {
        data: &'a [u8],
        piece: usize,
    }

    impl AsyncRead for Pieces<'_> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self.piece.min(buf.remaining()).min(self.data.len());
            buf.put_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Poll::Ready(Ok(()))
        }
    }

    fn ready<F: Future>(f: F) -> F::Output {
        match std::pin::pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("an in-memory read does not wait"),
        }
    }

    fn code_msg(len: usize) -> Message {
        Message::Code(CodeFrame::new(
            JobId::from_u128(1),
            LayerCode {
                layer: 0,
                kind: CodeKind::RAW_K,
                dtype: CodeDType::U8,
                shape: vec![len as u32],
                bytes: (0..len).map(|i| i as u8).collect(),
            },
        ))
    }

    #[test]
    fn frames_arrive_whole_whatever_the_pieces() {
        let msgs = [
            code_msg(0),
            code_msg(300_000),
            Message::Control(Control::Cancel {
                job_id: JobId::from_u128(1),
                reason: "r".into(),
            }),
        ];
        let mut stream = vec![];
        for m in &msgs {
            stream.extend_from_slice(&codec::encode(m, u32::MAX).unwrap());
        }
        for piece in [1, 7, 4096, usize::MAX] {
            let mut r = Pieces {
                data: &stream,
                piece,
            };
            let mut reader = FrameReader::new(1 << 20, None);
            for m in &msgs {
                let f = ready(reader.next(&mut r)).unwrap().unwrap();
                assert_eq!(&f.to_message().unwrap(), m, "piece {piece}");
            }
            assert!(ready(reader.next(&mut r)).unwrap().is_none());
        }
    }

    /// What a reader holds after `arrived` bytes of a body announced as `announced`, then the
    /// end of the stream: (buffer capacity, budget in use).
    fn held_after(announced: u32, arrived: usize, first_step: Option<usize>) -> (usize, u64) {
        let mut stream = codec::header_bytes(announced).to_vec();
        stream.extend(std::iter::repeat_n(0u8, arrived));
        let mut r = Pieces {
            data: &stream,
            piece: 1000,
        };
        let budget = ReceiveBudget::new(1 << 30);
        let mut reader = FrameReader::new(u32::MAX, Some(budget.clone()));
        if let Some(step) = first_step {
            reader = reader.with_first_step(step);
        }
        assert!(matches!(
            ready(reader.next(&mut r)),
            Err(FrameReadError::Truncated)
        ));
        let held = (reader.body_capacity(), budget.stats().in_use);
        drop(reader);
        assert_eq!(budget.stats().in_use, 0);
        held
    }

    #[test]
    fn the_body_buffer_grows_with_what_arrived() {
        // 1 GiB announced, 100 KiB sent: one step is allocated and charged, not a gigabyte.
        assert_eq!(
            held_after(1 << 30, 100 << 10, None),
            (BODY_STEP, BODY_STEP as u64)
        );
        // 1.5 MiB arrived: the step filled, the buffer grew four times.
        assert_eq!(
            held_after(1 << 30, 3 << 19, None),
            (4 * BODY_STEP, 4 * BODY_STEP as u64)
        );
        // Small steps: 1 KiB, 4 KiB, 16 KiB for 5000 bytes.
        assert_eq!(held_after(1 << 20, 5000, Some(1024)), (16 << 10, 16 << 10));
        // A growth that would leave less than a sixteenth for later takes the whole body.
        let len = (16 << 10) + 100;
        assert_eq!(
            held_after(len, 5000, Some(1024)),
            (len as usize, len.into())
        );
    }

    #[test]
    fn a_spent_budget_fails_the_frame_when_its_buffer_would_grow() {
        let mut stream = codec::header_bytes(200 << 10).to_vec();
        stream.extend_from_slice(&[0u8; 200 << 10]);
        let budget = ReceiveBudget::new(256 << 10);
        let mut held = budget.share_for(0).unwrap();
        held.grow(100 << 10).unwrap();
        let mut r = Pieces {
            data: &stream,
            piece: 4096,
        };
        let mut reader = FrameReader::new(1 << 20, Some(budget.clone())).with_first_step(64 << 10);
        // 64 KiB fit beside the 100 KiB held; the whole 200 KiB would not.
        assert!(matches!(
            ready(reader.next(&mut r)),
            Err(FrameReadError::OverBudget(BudgetError::Exhausted {
                requested: 139_264,
                ..
            }))
        ));
        assert_eq!(reader.body_capacity(), 64 << 10);
        drop(reader);
        drop(held);
        assert_eq!(budget.stats().in_use, 0);
    }

    #[test]
    fn the_cap_is_checked_before_the_budget_and_the_budget_before_the_body() {
        let stream = codec::header_bytes(2 << 20).to_vec();
        let mut r = Pieces {
            data: &stream,
            piece: usize::MAX,
        };
        let mut reader = FrameReader::new(1 << 20, None);
        assert!(matches!(
            ready(reader.next(&mut r)),
            Err(FrameReadError::Decode(DecodeError::TooLarge { .. }))
        ));
        let mut r = Pieces {
            data: &stream,
            piece: usize::MAX,
        };
        let mut reader = FrameReader::new(4 << 20, Some(ReceiveBudget::new(1 << 20)));
        assert!(matches!(
            ready(reader.next(&mut r)),
            Err(FrameReadError::OverBudget(BudgetError::FrameOverTotal { len, total: 1_048_576 }))
                if len == 2 << 20
        ));
        assert_eq!(reader.body_capacity(), 0);
    }

    #[test]
    fn quinn_errors_survive_the_io_wrapping() {
        let e: io::Error = ReadError::Reset(quinn::VarInt::from_u32(7)).into();
        assert!(matches!(FrameReadError::from(e), FrameReadError::Reset(7)));
        let e = io::Error::other("disk on fire");
        assert!(matches!(FrameReadError::from(e), FrameReadError::Io(_)));
    }
}
