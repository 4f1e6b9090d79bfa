//! Admin calls: one request from an admin client and the node's replies, on one bidirectional
//! stream of a connection made with an admin certificate. The client writes its request frame
//! (a [`Control`]: `Submit`, `Watch`, `Cancel`) and finishes its half; the node answers with
//! reply frames (`JobStatus`, `Tokens`, `Error`) and finishes its own. Frames are those of job
//! streams (header, rkyv archive, validation), capped at [`CONTROL_MAX_FRAME_BYTES`]: an admin
//! call carries no codes.

use quinn::{RecvStream, SendStream};

use crate::framing::{write_one, FrameReadError, FrameReader, FrameWriteError};
use crate::stream::CONTROL_MAX_FRAME_BYTES;
use crate::wire::{Control, Message};

/// Errors of an admin call, on either side.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The stream could not be opened or accepted: the connection is gone.
    #[error("connection lost: {0}")]
    ConnectionLost(#[from] quinn::ConnectionError),
    /// A frame could not be read (malformed, truncated, reset, connection lost).
    #[error("reading an admin frame: {0}")]
    Read(#[from] FrameReadError),
    /// A frame could not be written.
    #[error("writing an admin frame: {0}")]
    Write(#[from] FrameWriteError),
    /// The peer sent a code frame, or nothing, where a control message belongs.
    #[error("the peer sent {0} where an admin message belongs")]
    Unexpected(&'static str),
    /// The request did not come in time.
    #[error("no admin request within {0:?}")]
    Timeout(std::time::Duration),
}

fn control(msg: Message) -> Result<Control, AdminError> {
    match msg {
        Message::Control(c) => Ok(c),
        Message::Code(_) => Err(AdminError::Unexpected("a code frame")),
    }
}

/// The client's side of a call: the node's replies, in order.
#[derive(Debug)]
pub struct AdminCall {
    recv: RecvStream,
    reader: FrameReader,
    // Kept open until the call ends: finishing it early is fine, dropping it would reset it.
    _send: SendStream,
}

impl AdminCall {
    /// Sends `request` on a new stream of `conn`.
    pub(crate) async fn start(
        conn: &quinn::Connection,
        request: Control,
    ) -> Result<Self, AdminError> {
        let (mut send, recv) = conn.open_bi().await?;
        write_one(
            &mut send,
            &Message::Control(request),
            CONTROL_MAX_FRAME_BYTES,
        )
        .await?;
        send.finish()
            .map_err(|_| AdminError::Write(FrameWriteError::Closed))?;
        Ok(Self {
            recv,
            reader: FrameReader::new(CONTROL_MAX_FRAME_BYTES, None),
            _send: send,
        })
    }

    /// The next reply; `None` once the node has finished the call.
    pub async fn next(&mut self) -> Result<Option<Control>, AdminError> {
        match self.reader.next(&mut self.recv).await? {
            Some(frame) => Ok(Some(control(
                frame.to_message().map_err(FrameReadError::from)?,
            )?)),
            None => Ok(None),
        }
    }
}

/// The node's side of a call: the request, and where replies go.
#[derive(Debug)]
pub struct AdminRequest {
    /// What the client asks.
    pub request: Control,
    /// Where the replies go.
    pub replies: AdminReplies,
}

/// Replies to one admin call.
#[derive(Debug)]
pub struct AdminReplies {
    send: SendStream,
}

impl AdminReplies {
    /// Sends one reply.
    pub async fn send(&mut self, reply: Control) -> Result<(), AdminError> {
        write_one(
            &mut self.send,
            &Message::Control(reply),
            CONTROL_MAX_FRAME_BYTES,
        )
        .await?;
        Ok(())
    }

    /// Ends the call: the client reads the end of the replies.
    pub fn finish(mut self) {
        // A client that went away has nothing left to read.
        let _ = self.send.finish();
    }

    /// Resolves when the client has gone (stopped reading, reset or lost the connection).
    pub async fn client_gone(&mut self) {
        let _ = self.send.stopped().await;
    }
}

/// Waits for the client to open a call on `conn` and reads its request (within `timeout`).
pub(crate) async fn accept(
    conn: &quinn::Connection,
    timeout: std::time::Duration,
) -> Result<AdminRequest, AdminError> {
    let (send, mut recv) = conn.accept_bi().await?;
    let mut reader = FrameReader::new(CONTROL_MAX_FRAME_BYTES, None);
    let first = tokio::time::timeout(timeout, reader.next(&mut recv))
        .await
        .map_err(|_| AdminError::Timeout(timeout))??;
    let Some(frame) = first else {
        return Err(AdminError::Unexpected("nothing"));
    };
    let request = control(frame.to_message().map_err(FrameReadError::from)?)?;
    Ok(AdminRequest {
        request,
        replies: AdminReplies { send },
    })
}
