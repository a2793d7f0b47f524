//! Long gRPC messages taken off the wire without copying them on the async workers.
//!
//! tonic's decoder gathers every message into one contiguous buffer: it reserves the message's
//! whole length up front and copies each HTTP/2 DATA frame into it, on the async worker that
//! polls the stream. For a 30 MiB BUFFERED body that is ~7,700 fresh pages faulted in and a
//! 30 MiB copy, a few hundred microseconds per poll at a time, while the worker's other streams
//! (normal requests) wait. Profiled under the flood bench (`cargo bench --bench flood`,
//! `perf record` of the router): after the decode itself had moved to the heavy lane, this
//! copy and its page faults were most of what the flood still cost the async workers.
//!
//! [`Divert`] wraps the request body in front of tonic. It reads the gRPC framing itself
//! (a flag byte and a 4-byte big-endian length before each message). A message of at most
//! `raw_above` bytes passes through untouched. A longer one is kept as the DATA frames h2
//! received (`Bytes` handles into h2's read buffers: no copy), and once complete it goes into
//! the stream's [`Diverted`] queue under its message number, while tonic is given an empty
//! message in its place; the codec ([`super::codec`]) sees the number come up and hands the
//! frames on raw, to be decoded in the heavy lane.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use http_body::{Body, Frame, SizeHint};
use tonic::Status;

/// The gRPC message header: compression flag, then the length.
const HEADER: usize = 5;

/// A long message's frames, in order, and how many bytes they hold.
#[derive(Debug, Default)]
pub struct Chunks {
    parts: VecDeque<Bytes>,
    remaining: usize,
}

impl Chunks {
    fn push(&mut self, part: Bytes) {
        if part.is_empty() {
            return;
        }
        self.remaining += part.len();
        self.parts.push_back(part);
    }
}

impl From<Bytes> for Chunks {
    fn from(part: Bytes) -> Chunks {
        let mut chunks = Chunks::default();
        chunks.push(part);
        chunks
    }
}

impl Buf for Chunks {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |p| p.as_ref())
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the end of the chunks");
        self.remaining -= cnt;
        while cnt > 0 {
            let front = self.parts.front_mut().expect("remaining counted the parts");
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.parts.pop_front();
        }
        // Drop emptied parts at the front, so `chunk` is never empty while bytes remain.
        while self.parts.front().is_some_and(|p| p.is_empty()) {
            self.parts.pop_front();
        }
    }

    /// Zero-copy when the bytes lie in one part (prost asks for a field at a time).
    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        match self.parts.front_mut() {
            Some(front) if front.len() > len => {
                self.remaining -= len;
                front.split_to(len)
            }
            Some(front) if front.len() == len => {
                self.remaining -= len;
                self.parts.pop_front().expect("front exists")
            }
            _ => {
                assert!(len <= self.remaining, "copy_to_bytes past the end");
                let mut out = bytes::BytesMut::with_capacity(len);
                out.put((&mut *self).take(len));
                out.freeze()
            }
        }
    }
}

/// Long messages of one stream, by message number (0 = the stream's first message), waiting
/// for the codec. Shared by the stream's [`Divert`] body and its decoder only.
pub type Diverted = Arc<parking_lot::Mutex<VecDeque<(u64, Chunks)>>>;

/// Where the reader is in the framing.
enum State {
    /// Reading a header (`have` of its 5 bytes so far).
    Header { bytes: [u8; HEADER], have: usize },
    /// Passing a short message's payload through.
    Pass { left: usize },
    /// Collecting a long message's payload.
    Collect { left: usize, chunks: Chunks },
}

/// The request body with long messages diverted (see the module doc).
pub struct Divert<B> {
    inner: B,
    /// Messages longer than this are diverted.
    raw_above: usize,
    /// The largest message accepted at all (tonic's own limit for the rest).
    max_message_bytes: usize,
    state: State,
    /// Messages whose header has been read (the number of the one being read is `seen - 1`).
    seen: u64,
    /// Data to hand tonic before reading more (pass-through pieces, placeholders).
    out: VecDeque<Bytes>,
    /// A trailers frame read while data was still queued.
    trailers: Option<http::HeaderMap>,
    diverted: Diverted,
}

impl<B> Divert<B> {
    pub fn new(inner: B, raw_above: usize, max_message_bytes: usize, diverted: Diverted) -> Self {
        Divert {
            inner,
            raw_above,
            max_message_bytes,
            state: State::Header {
                bytes: [0; HEADER],
                have: 0,
            },
            seen: 0,
            out: VecDeque::new(),
            trailers: None,
            diverted,
        }
    }

    /// Reads the framing of one DATA frame, queueing what tonic gets.
    fn take(&mut self, mut data: Bytes) -> Result<(), Status> {
        while !data.is_empty() {
            match &mut self.state {
                State::Header { bytes, have } => {
                    let n = (HEADER - *have).min(data.len());
                    bytes[*have..*have + n].copy_from_slice(&data[..n]);
                    *have += n;
                    data.advance(n);
                    if *have < HEADER {
                        continue;
                    }
                    let header = *bytes;
                    let len =
                        u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
                    self.seen += 1;
                    // A compressed long message is left to tonic, which refuses it (kvrouter
                    // accepts no compression), as it would without this wrapper.
                    if header[0] == 0 && len > self.raw_above {
                        if len > self.max_message_bytes {
                            return Err(Status::out_of_range(format!(
                                "Error, decoded message length too large: found {len} bytes, \
                                 the limit is: {} bytes",
                                self.max_message_bytes
                            )));
                        }
                        self.state = State::Collect {
                            left: len,
                            chunks: Chunks::default(),
                        };
                    } else {
                        self.out.push_back(Bytes::copy_from_slice(&header));
                        self.state = if len == 0 {
                            State::Header {
                                bytes: [0; HEADER],
                                have: 0,
                            }
                        } else {
                            State::Pass { left: len }
                        };
                    }
                }
                State::Pass { left } => {
                    let n = (*left).min(data.len());
                    self.out.push_back(data.split_to(n));
                    *left -= n;
                    if *left == 0 {
                        self.state = State::Header {
                            bytes: [0; HEADER],
                            have: 0,
                        };
                    }
                }
                State::Collect { left, chunks } => {
                    let n = (*left).min(data.len());
                    chunks.push(data.split_to(n));
                    *left -= n;
                    if *left == 0 {
                        let State::Collect { chunks, .. } = std::mem::replace(
                            &mut self.state,
                            State::Header {
                                bytes: [0; HEADER],
                                have: 0,
                            },
                        ) else {
                            unreachable!("matched above")
                        };
                        self.diverted.lock().push_back((self.seen - 1, chunks));
                        // tonic gets an empty message in its place.
                        self.out.push_back(Bytes::from_static(&[0; HEADER]));
                    }
                }
            }
        }
        Ok(())
    }

    /// True between messages (the body may end here).
    fn at_boundary(&self) -> bool {
        matches!(self.state, State::Header { have: 0, .. })
    }
}

impl<B> Body for Divert<B>
where
    B: Body + Unpin,
    B::Data: Buf,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(data) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if let Some(trailers) = this.trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => {
                    return Poll::Ready(if this.at_boundary() {
                        None
                    } else {
                        Some(Err(Status::internal("Unexpected EOF decoding stream.")))
                    });
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(Status::from_error(e.into())))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        let len = data.remaining();
                        let bytes = data.copy_to_bytes(len);
                        if let Err(status) = this.take(bytes) {
                            return Poll::Ready(Some(Err(status)));
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.trailers = Some(trailers);
                        }
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.out.is_empty() && self.trailers.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A gRPC-framed message of `len` payload bytes, each byte `fill`.
    fn framed(len: usize, fill: u8) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.extend(std::iter::repeat_n(fill, len));
        out
    }

    /// Feeds `wire` through a Divert in pieces of `piece` bytes; what tonic would get, and
    /// what was diverted.
    async fn run(wire: &[u8], piece: usize, raw_above: usize) -> (Vec<u8>, Vec<(u64, Vec<u8>)>) {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = wire
            .chunks(piece)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let inner = http_body_util::StreamBody::new(futures::stream::iter(frames));
        let diverted = Diverted::default();
        let body = Divert::new(inner, raw_above, 1 << 20, Arc::clone(&diverted));
        let passed = body.collect().await.unwrap().to_bytes().to_vec();
        let taken = diverted
            .lock()
            .drain(..)
            .map(|(n, mut c)| (n, c.copy_to_bytes(c.remaining()).to_vec()))
            .collect();
        (passed, taken)
    }

    #[tokio::test]
    async fn short_messages_pass_and_long_ones_are_diverted_in_any_piece_size() {
        let mut wire = framed(10, b'a');
        wire.extend(framed(3000, b'b'));
        wire.extend(framed(0, 0));
        wire.extend(framed(20, b'c'));
        wire.extend(framed(5000, b'd'));
        for piece in [1, 4, 5, 7, 100, 4096, wire.len()] {
            let (passed, taken) = run(&wire, piece, 1024).await;
            let mut expect = framed(10, b'a');
            expect.extend(framed(0, 0)); // placeholder for message 1
            expect.extend(framed(0, 0));
            expect.extend(framed(20, b'c'));
            expect.extend(framed(0, 0)); // placeholder for message 4
            assert_eq!(passed, expect, "piece {piece}");
            assert_eq!(taken.len(), 2, "piece {piece}");
            assert_eq!(taken[0], (1, vec![b'b'; 3000]), "piece {piece}");
            assert_eq!(taken[1], (4, vec![b'd'; 5000]), "piece {piece}");
        }
    }

    #[tokio::test]
    async fn a_long_message_over_the_limit_is_refused_before_it_is_read() {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> =
            vec![Ok(Frame::data(Bytes::from(vec![
                0, 0x7f, 0xff, 0xff, 0xff,
            ])))];
        let inner = http_body_util::StreamBody::new(futures::stream::iter(frames));
        let body = Divert::new(inner, 1024, 1 << 20, Diverted::default());
        let status = body.collect().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
    }

    #[tokio::test]
    async fn a_body_cut_inside_a_long_message_is_an_error_not_a_clean_end() {
        let wire = framed(3000, b'x');
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> =
            vec![Ok(Frame::data(Bytes::copy_from_slice(&wire[..2000])))];
        let inner = http_body_util::StreamBody::new(futures::stream::iter(frames));
        let body = Divert::new(inner, 1024, 1 << 20, Diverted::default());
        let status = body.collect().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
    }

    #[test]
    fn chunks_read_across_part_boundaries_and_split_without_copy_inside_one() {
        let mut c = Chunks::default();
        c.push(Bytes::from_static(b"hello "));
        c.push(Bytes::from_static(b""));
        c.push(Bytes::from_static(b"world"));
        assert_eq!(c.remaining(), 11);
        let first = c.copy_to_bytes(3);
        assert_eq!(&first[..], b"hel");
        let across = c.copy_to_bytes(5);
        assert_eq!(&across[..], b"lo wo");
        assert_eq!(c.chunk(), b"rld");
        c.advance(3);
        assert_eq!(c.remaining(), 0);
        assert!(c.chunk().is_empty());
    }
}
