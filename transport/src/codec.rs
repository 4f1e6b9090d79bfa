//! Framing and validation: pure functions over byte buffers, no I/O.
//!
//! A frame is a 16-byte header followed by an rkyv archive of a [`Message`]:
//!
//! ```text
//! 0..4   magic "SCDF"
//! 4..6   protocol version, u16 little-endian
//! 6..8   flags, must be zero
//! 8..12  body length, u32 little-endian
//! 12..16 reserved, must be zero
//! 16..   body: the rkyv archive of a Message
//! ```
//!
//! The header is 16 bytes so that an archive written straight after it in an aligned buffer stays
//! aligned for its widest field. Readers check the header first and refuse oversized frames before
//! allocating; the body is validated with bytecheck from an aligned buffer, then its content is
//! checked ([`ArchivedMessage::check`]: trace contexts within their limits, a code's length
//! agreeing with its dtype and shape), before anything in it is used. No input makes these
//! functions panic.
//!
//! In a code frame's archive, rkyv writes the out-of-line data first, in field order (the trace
//! context's strings and entries, the layer code's shape, then the layer code's bytes), and the
//! fixed-size root last. [`encode_frame`] relies on the code's bytes being one contiguous write: they go to
//! QUIC as a segment of their own, the caller's buffer itself, between the archive's head (header
//! included) and its tail (the root):
//!
//! ```text
//! segment 0: header | trace context, shape, padding   (copied: tens to hundreds of bytes)
//! segment 1: the LayerCode's bytes                    (not copied: the Vec itself)
//! segment 2: padding | Message and CodeFrame root     (copied: about 130 bytes)
//! ```

use bytes::Bytes;
use rkyv::rancor;
use rkyv::ser::{Positional, Writer};
use rkyv::util::AlignedVec;

use crate::wire::{ArchivedMessage, ContentError, Message, PROTOCOL_VERSION};

/// Length of the frame header in bytes.
pub const HEADER_LEN: usize = 16;
/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SCDF";
/// Default cap on one frame's body (64 MiB): a layer's codes fit with room to spare.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 64 << 20;

/// A buffer aligned for rkyv archives.
pub type FrameBuf = AlignedVec<16>;

/// A checked frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The sender's protocol version (equal to [`PROTOCOL_VERSION`] once checked).
    pub version: u16,
    /// Length of the body that follows the header.
    pub body_len: u32,
}

impl FrameHeader {
    /// Header plus body.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }
}

/// Why bytes are not (yet) a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// More bytes are needed; not an error for a reader that can wait for them.
    #[error("incomplete frame: {needed} more bytes needed")]
    Incomplete {
        /// How many more bytes, at least.
        needed: usize,
    },
    /// The bytes do not start with the frame magic: not an scd peer, or the stream lost sync.
    #[error("bad frame magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// The frame was written by another protocol version.
    #[error("protocol version mismatch: frame has version {got}, this node speaks {supported}")]
    UnsupportedVersion {
        /// The frame's version.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// Flag or reserved bits that this version does not define are set.
    #[error("reserved header bits set")]
    ReservedBits,
    /// The frame is larger than the configured cap.
    #[error("frame of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// Announced body length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// The body is not a valid archive of a [`Message`].
    #[error("invalid frame body: {0}")]
    Invalid(String),
    /// The body is a valid archive, but its content breaks a rule of the protocol.
    #[error("invalid frame content: {0}")]
    Content(#[from] ContentError),
}

impl DecodeError {
    /// Whether waiting for more bytes could help.
    pub fn is_incomplete(&self) -> bool {
        matches!(self, DecodeError::Incomplete { .. })
    }
}

/// Why a message could not be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The archive would exceed the frame cap.
    #[error("encoded frame of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// The archive's length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// rkyv failed to serialise (it does not, for these types, short of allocation failure).
    #[error("serialising a frame: {0}")]
    Serialize(String),
    /// The message breaks a rule of the protocol (see [`Message::check`]); nothing was encoded.
    #[error("refusing to encode: {0}")]
    Content(#[from] ContentError),
}

/// Upper bound of a message's archive, used to allocate once when encoding.
fn size_hint(msg: &Message) -> usize {
    let trace = |t: &scd_types::TraceContext| {
        t.entries()
            .iter()
            .map(|e| e.key.len() + e.value.len() + 32)
            .sum::<usize>()
    };
    256 + match msg {
        Message::Code(f) => f.code.bytes.len() + f.code.shape.len() * 4 + trace(&f.trace),
        Message::Control(crate::wire::Control::PrefillRequest(r)) => {
            let prompt = match &r.prompt {
                crate::wire::Prompt::Tokens(t) => t.len() * 4,
                crate::wire::Prompt::Text(s) => s.len(),
            };
            prompt + r.base_model.len() + r.expert.len() + trace(&r.trace)
        }
        Message::Control(_) => 256,
    }
}

/// Encode a message as one frame (header and archive) into a fresh aligned buffer.
pub fn encode(msg: &Message, max_frame_bytes: u32) -> Result<FrameBuf, EncodeError> {
    let mut buf = FrameBuf::with_capacity(HEADER_LEN + size_hint(msg));
    encode_into(msg, max_frame_bytes, &mut buf)?;
    Ok(buf)
}

/// Encode a message as one frame into `buf`, which is cleared first (reuse it to save
/// allocations).
pub fn encode_into(
    msg: &Message,
    max_frame_bytes: u32,
    buf: &mut FrameBuf,
) -> Result<(), EncodeError> {
    msg.check()?;
    buf.clear();
    buf.extend_from_slice(&[0u8; HEADER_LEN]);
    let taken = std::mem::take(buf);
    let mut out = rkyv::api::high::to_bytes_in::<_, rancor::Error>(msg, taken)
        .map_err(|e| EncodeError::Serialize(e.to_string()))?;
    let body_len = out.len() - HEADER_LEN;
    if body_len as u64 > u64::from(max_frame_bytes) {
        return Err(EncodeError::TooLarge {
            len: body_len as u64,
            max: u64::from(max_frame_bytes),
        });
    }
    let header = header_bytes(body_len as u32);
    out.as_mut_slice()[..HEADER_LEN].copy_from_slice(&header);
    *buf = out;
    Ok(())
}

/// Code payloads at least this long go out from the message's own buffer (see
/// [`encode_frame`]); below it, one copy into the frame costs less than an extra segment.
pub const ZERO_COPY_MIN_PAYLOAD: usize = 16 << 10;

/// A frame ready to send: its bytes as one or more segments, in order. For a code frame with a
/// large payload the payload is a segment of its own, the message's buffer itself.
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    segments: Vec<Bytes>,
    len: usize,
}

impl EncodedFrame {
    /// Length on the wire, header included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a frame has at least its header.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segments, in wire order.
    pub fn segments(&self) -> &[Bytes] {
        &self.segments
    }

    /// The segments, in wire order, to hand to the stream.
    pub fn into_segments(self) -> Vec<Bytes> {
        self.segments
    }
}

impl From<FrameBuf> for EncodedFrame {
    fn from(buf: FrameBuf) -> Self {
        Self {
            len: buf.len(),
            segments: vec![Bytes::from_owner(buf)],
        }
    }
}

/// An rkyv writer that keeps one given slice out of its output: bytes before it go to `head`,
/// bytes after it to `tail`, and the slice itself only advances the position. rkyv writes a
/// `Vec<u8>` field with a single `write` of the whole vector, so passing the payload's slice
/// leaves exactly that field's bytes out.
struct SplitWriter<'a> {
    skip: &'a [u8],
    skipped: bool,
    head: Vec<u8>,
    tail: Vec<u8>,
    pos: usize,
}

impl Positional for SplitWriter<'_> {
    fn pos(&self) -> usize {
        self.pos
    }
}

impl<E> Writer<E> for SplitWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), E> {
        // Identity, not equality: the payload's own memory, whatever other bytes look like it.
        if !self.skipped && std::ptr::eq(bytes, self.skip) {
            self.skipped = true;
        } else if self.skipped {
            self.tail.extend_from_slice(bytes);
        } else {
            self.head.extend_from_slice(bytes);
        }
        self.pos += bytes.len();
        Ok(())
    }
}

/// Encode a message as one frame for sending, taking ownership of it. The bytes on the wire are
/// those of [`encode`]; the difference is that a code frame's payload of at least
/// [`ZERO_COPY_MIN_PAYLOAD`] bytes is not copied: the frame is the archive's bytes before the
/// payload (header included), the payload's buffer itself, and the bytes after it. This saves
/// one pass over every payload, and the write of a fresh buffer as large as it, on the send
/// path.
pub fn encode_frame(msg: Message, max_frame_bytes: u32) -> Result<EncodedFrame, EncodeError> {
    let payload: &[u8] = match &msg {
        Message::Code(f) if f.code.bytes.len() >= ZERO_COPY_MIN_PAYLOAD => &f.code.bytes,
        _ => return encode(&msg, max_frame_bytes).map(EncodedFrame::from),
    };
    msg.check()?;
    let mut head = Vec::with_capacity(HEADER_LEN + 512);
    head.extend_from_slice(&[0u8; HEADER_LEN]);
    let writer = SplitWriter {
        skip: payload,
        skipped: false,
        head,
        tail: Vec::with_capacity(512),
        pos: 0,
    };
    // Positions count from the start of the body, as in `encode` modulo the header's 16 bytes,
    // which keeps every alignment the same.
    let SplitWriter {
        skipped,
        mut head,
        tail,
        pos: body_len,
        ..
    } = rkyv::api::high::to_bytes_in::<_, rancor::Error>(&msg, writer)
        .map_err(|e| EncodeError::Serialize(e.to_string()))?;
    if body_len as u64 > u64::from(max_frame_bytes) {
        return Err(EncodeError::TooLarge {
            len: body_len as u64,
            max: u64::from(max_frame_bytes),
        });
    }
    head[..HEADER_LEN].copy_from_slice(&header_bytes(body_len as u32));
    let len = HEADER_LEN + body_len;
    match msg {
        Message::Code(f) if skipped => Ok(EncodedFrame {
            len,
            segments: vec![
                Bytes::from(head),
                Bytes::from(f.code.bytes),
                Bytes::from(tail),
            ],
        }),
        // rkyv wrote the payload in pieces (not the layout this relies on): nothing was left
        // out, the head holds the whole frame.
        _ => Ok(EncodedFrame {
            len,
            segments: vec![Bytes::from(head)],
        }),
    }
}

/// The header for a body of `body_len` bytes.
pub fn header_bytes(body_len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&body_len.to_le_bytes());
    h
}

/// Check a frame header at the start of `buf`: magic, version, reserved bits and the size cap.
/// Needs only the first [`HEADER_LEN`] bytes, so a reader can refuse a frame before allocating.
pub fn check_header(buf: &[u8], max_frame_bytes: u32) -> Result<FrameHeader, DecodeError> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Err(DecodeError::Incomplete {
            needed: HEADER_LEN - buf.len(),
        });
    };
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            got: version,
            supported: PROTOCOL_VERSION,
        });
    }
    if h[6..8] != [0, 0] || h[12..16] != [0, 0, 0, 0] {
        return Err(DecodeError::ReservedBits);
    }
    let body_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if body_len > max_frame_bytes {
        return Err(DecodeError::TooLarge {
            len: u64::from(body_len),
            max: u64::from(max_frame_bytes),
        });
    }
    Ok(FrameHeader { version, body_len })
}

/// Check that `buf` starts with a whole frame; returns its header (and so its length).
pub fn check(buf: &[u8], max_frame_bytes: u32) -> Result<FrameHeader, DecodeError> {
    let header = check_header(buf, max_frame_bytes)?;
    if buf.len() < header.frame_len() {
        return Err(DecodeError::Incomplete {
            needed: header.frame_len() - buf.len(),
        });
    }
    Ok(header)
}

/// Validate an archive body that is already in an aligned buffer, without copying it: bytecheck,
/// then the content rules of [`ArchivedMessage::check`].
pub fn access_body(body: &[u8]) -> Result<&ArchivedMessage, DecodeError> {
    let msg = rkyv::access::<ArchivedMessage, rancor::Error>(body)
        .map_err(|e| DecodeError::Invalid(e.to_string()))?;
    msg.check()?;
    Ok(msg)
}

/// Validate an archive body and turn it into an owned message. A body that is not aligned is
/// copied into an aligned buffer first.
pub fn decode_body(body: &[u8]) -> Result<Message, DecodeError> {
    if (body.as_ptr() as usize).is_multiple_of(16) {
        to_owned(access_body(body)?)
    } else {
        let mut aligned = FrameBuf::with_capacity(body.len());
        aligned.extend_from_slice(body);
        to_owned(access_body(&aligned)?)
    }
}

fn to_owned(archived: &ArchivedMessage) -> Result<Message, DecodeError> {
    rkyv::deserialize::<Message, rancor::Error>(archived)
        .map_err(|e| DecodeError::Invalid(e.to_string()))
}

/// A frame body that passed validation, kept in its aligned buffer: the receiver can read the
/// archive (payload bytes included) in place, without deserialising a copy.
#[derive(Debug)]
pub struct ValidatedFrame {
    body: FrameBuf,
}

impl ValidatedFrame {
    /// Validate `body` (an archive without its header).
    pub fn new(body: FrameBuf) -> Result<Self, DecodeError> {
        access_body(&body)?;
        Ok(Self { body })
    }

    /// The archived message, read in place.
    pub fn archived(&self) -> &ArchivedMessage {
        // SAFETY: `new` validated exactly these bytes with bytecheck, and `body` is private and
        // never mutated afterwards, so the unchecked access sees a valid archive.
        unsafe { rkyv::access_unchecked::<ArchivedMessage>(&self.body) }
    }

    /// Deserialise into an owned message (copies the payload).
    pub fn to_message(&self) -> Result<Message, DecodeError> {
        to_owned(self.archived())
    }

    /// Length of the frame on the wire, header included.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body.len()
    }
}

/// Decode the frame at the start of `buf`; returns the message and the bytes it used.
pub fn decode(buf: &[u8], max_frame_bytes: u32) -> Result<(Message, usize), DecodeError> {
    let header = check(buf, max_frame_bytes)?;
    let msg = decode_body(&buf[HEADER_LEN..header.frame_len()])?;
    Ok((msg, header.frame_len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodeFrame, Control};
    use scd_types::{CodeDType, CodeKind, JobId, LayerCode, TraceContext, TranslatorHash};

    fn code(len: usize) -> LayerCode {
        LayerCode {
            layer: 7,
            kind: CodeKind::REUSE_K,
            dtype: CodeDType::U8,
            shape: vec![len as u32],
            bytes: (0..len).map(|i| (i * 7) as u8).collect(),
        }
    }

    fn frame() -> Message {
        let mut trace = TraceContext::new();
        trace.insert("traceparent", "00-abc-def-01").unwrap();
        Message::Code(
            CodeFrame::new(JobId::from_u128(0xdead_beef), code(24))
                .with_translator(TranslatorHash::from_bytes([9; 32]))
                .with_trace(trace),
        )
    }

    #[test]
    fn round_trip() {
        let msg = frame();
        let buf = encode(&msg, DEFAULT_MAX_FRAME_BYTES).unwrap();
        let (back, used) = decode(&buf, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(back, msg);
        assert_eq!(used, buf.len());
    }

    #[test]
    fn every_prefix_is_incomplete() {
        let buf = encode(&frame(), DEFAULT_MAX_FRAME_BYTES).unwrap();
        for n in 0..buf.len() {
            let err = decode(&buf[..n], DEFAULT_MAX_FRAME_BYTES).unwrap_err();
            assert_eq!(
                err,
                DecodeError::Incomplete {
                    needed: if n < HEADER_LEN {
                        HEADER_LEN - n
                    } else {
                        buf.len() - n
                    }
                }
            );
        }
    }

    #[test]
    fn unaligned_input_is_copied_not_refused() {
        let buf = encode(&frame(), DEFAULT_MAX_FRAME_BYTES).unwrap();
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&buf);
        let (back, _) = decode(&shifted[1..], DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(back, frame());
    }

    #[test]
    fn header_errors() {
        let buf = encode(&frame(), DEFAULT_MAX_FRAME_BYTES).unwrap();
        let mut bad = buf.as_slice().to_vec();
        bad[0] = b'X';
        assert!(matches!(
            decode(&bad, u32::MAX),
            Err(DecodeError::BadMagic(_))
        ));
        let mut bad = buf.as_slice().to_vec();
        let other = PROTOCOL_VERSION + 1;
        bad[4..6].copy_from_slice(&other.to_le_bytes());
        assert_eq!(
            decode(&bad, u32::MAX).unwrap_err(),
            DecodeError::UnsupportedVersion {
                got: other,
                supported: PROTOCOL_VERSION
            }
        );
        let mut bad = buf.as_slice().to_vec();
        bad[13] = 1;
        assert_eq!(
            decode(&bad, u32::MAX).unwrap_err(),
            DecodeError::ReservedBits
        );
        let body = (buf.len() - HEADER_LEN) as u32;
        assert_eq!(
            check_header(&buf, body - 1).unwrap_err(),
            DecodeError::TooLarge {
                len: body.into(),
                max: (body - 1).into()
            }
        );
    }

    #[test]
    fn encode_refuses_oversized() {
        assert!(matches!(
            encode(&frame(), 16),
            Err(EncodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn garbage_body_is_invalid() {
        let mut buf = header_bytes(64).to_vec();
        buf.extend_from_slice(&[0xff; 64]);
        assert!(matches!(
            decode(&buf, u32::MAX),
            Err(DecodeError::Invalid(_))
        ));
    }

    fn concat(frame: &EncodedFrame) -> Vec<u8> {
        frame
            .segments()
            .iter()
            .flat_map(|s| s.iter().copied())
            .collect()
    }

    #[test]
    fn encode_frame_matches_encode() {
        for len in [
            0,
            24,
            ZERO_COPY_MIN_PAYLOAD - 1,
            ZERO_COPY_MIN_PAYLOAD,
            100_003,
        ] {
            let Message::Code(mut f) = frame() else {
                unreachable!()
            };
            f.code = code(len);
            let msg = Message::Code(f);
            let whole = encode(&msg, DEFAULT_MAX_FRAME_BYTES).unwrap();
            let payload_ptr = match &msg {
                Message::Code(f) => f.code.bytes.as_ptr(),
                Message::Control(_) => unreachable!(),
            };
            let split = encode_frame(msg, DEFAULT_MAX_FRAME_BYTES).unwrap();
            assert_eq!(split.len(), whole.len(), "payload {len}");
            assert_eq!(concat(&split), whole.as_slice(), "payload {len}");
            if len >= ZERO_COPY_MIN_PAYLOAD {
                // Head, the payload's own buffer, tail: the layout in the module doc.
                assert_eq!(split.segments().len(), 3);
                assert_eq!(split.segments()[1].as_ptr(), payload_ptr);
                // What is copied stays small: under 256 bytes before (with this trace context)
                // and 160 after.
                assert!(split.segments()[0].len() < 256, "{:?}", split.segments()[0]);
                assert!(split.segments()[2].len() < 160, "{:?}", split.segments()[2]);
            } else {
                assert_eq!(split.segments().len(), 1);
            }
        }
        let ctl = Message::Control(Control::Error {
            job_id: None,
            code: 3,
            message: "x".into(),
        });
        let split = encode_frame(ctl.clone(), DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(
            concat(&split),
            encode(&ctl, DEFAULT_MAX_FRAME_BYTES).unwrap().as_slice()
        );
    }

    #[test]
    fn encode_frame_refuses_oversized() {
        let Message::Code(mut f) = frame() else {
            unreachable!()
        };
        f.code = code(ZERO_COPY_MIN_PAYLOAD * 2);
        assert!(matches!(
            encode_frame(Message::Code(f), ZERO_COPY_MIN_PAYLOAD as u32),
            Err(EncodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn content_rules_hold_on_both_sides() {
        // A code whose bytes disagree with its shape is refused by the encoder, whichever path.
        let Message::Code(mut f) = frame() else {
            unreachable!()
        };
        f.code.shape = vec![25];
        let bad = Message::Code(f.clone());
        assert!(matches!(
            encode(&bad, DEFAULT_MAX_FRAME_BYTES),
            Err(EncodeError::Content(ContentError::CodeLength {
                len: 24,
                expected: Some(25),
                ..
            }))
        ));
        f.code = code(ZERO_COPY_MIN_PAYLOAD);
        f.code.shape = vec![1, 2];
        assert!(matches!(
            encode_frame(Message::Code(f.clone()), DEFAULT_MAX_FRAME_BYTES),
            Err(EncodeError::Content(_))
        ));
        // ... and by the decoder, for one written around the check.
        let mut buf = FrameBuf::new();
        buf.extend_from_slice(&[0; HEADER_LEN]);
        let mut buf = rkyv::api::high::to_bytes_in::<_, rancor::Error>(&bad, buf).unwrap();
        let body_len = (buf.len() - HEADER_LEN) as u32;
        buf[..HEADER_LEN].copy_from_slice(&header_bytes(body_len));
        assert!(matches!(
            decode(&buf, DEFAULT_MAX_FRAME_BYTES),
            Err(DecodeError::Content(ContentError::CodeLength { .. }))
        ));
        // A dtype this version does not know passes: a newer peer's codes still travel.
        f.code.dtype = scd_types::CodeDType(200);
        let newer = Message::Code(f);
        let buf = encode(&newer, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(decode(&buf, DEFAULT_MAX_FRAME_BYTES).unwrap().0, newer);
    }

    #[test]
    fn control_round_trip() {
        let msg = Message::Control(Control::Error {
            job_id: None,
            code: 3,
            message: "x".into(),
        });
        let buf = encode(&msg, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert_eq!(decode(&buf, DEFAULT_MAX_FRAME_BYTES).unwrap().0, msg);
    }
}
