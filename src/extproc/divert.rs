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
//!
//! **Paced.** Receiving a long message still costs the async worker that polls the connection:
//! the kernel copies every byte out of the socket in its `recv` (profiled under the flood bench:
//! the flood's bytes, ~190 MB/s, were what normal requests still waited behind). So long
//! messages share one byte rate ([`Pace`], `routing.heavy_body_bytes_per_s`): once a long
//! message's frames have taken their share, the stream is not read again until the rate allows.
//! Unread, its HTTP/2 window stays closed and Envoy holds the rest of the body; the other
//! streams' windows are their own, so short messages are read as they come.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use http_body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use tonic::Status;

use crate::config::MIN_HEAVY_BURST_BYTES;

/// The gRPC message header: compression flag, then the length.
const HEADER: usize = 5;

/// A long message's frames, in order, and how many bytes they hold.
#[derive(Debug, Default)]
pub struct Chunks {
    parts: VecDeque<Bytes>,
    remaining: usize,
    /// Not read to its end: refused after waiting too long for its turn (see [`Pace`]).
    refused: bool,
}

impl Chunks {
    /// The place of a long message refused before it was read to its end.
    pub(super) fn refused() -> Chunks {
        Chunks {
            refused: true,
            ..Chunks::default()
        }
    }

    /// Whether this is the place of a refused message ([`Self::refused`]).
    pub fn is_refused(&self) -> bool {
        self.refused
    }

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

/// How long a tenant counts as receiving long bodies after its last bytes, for the shares.
const FLOW_ACTIVE: Duration = Duration::from_millis(250);

/// Most tenants with a share of their own at once; more share the rate without one.
const MAX_FLOWS: usize = 1024;

/// What a stream tells the [`Divert`] reading its frames: its trusted tenant, set once its
/// headers are read (`None` until then, and without tenancy: whose share of the [`Pace`] its
/// long bodies take), and whether its request has been read.
#[derive(Debug, Clone, Default)]
pub struct PaceFlow(Arc<FlowState>);

#[derive(Debug, Default)]
struct FlowState {
    tenant: std::sync::OnceLock<Arc<str>>,
    request_read: std::sync::atomic::AtomicBool,
    /// A long message of the stream is being held back by the pace right now.
    holding: std::sync::atomic::AtomicBool,
}

impl PaceFlow {
    /// The stream's tenant is `tenant` from now on (the first call wins).
    pub fn set(&self, tenant: &str) {
        let _ = self.0.tenant.set(Arc::from(tenant));
    }

    /// The stream's request has been read (decided, or its response has begun): what comes
    /// next is the engine's response (an observer's body chunks), which is neither paced,
    /// refused nor diverted. A long response chunk (an embeddings answer) charged to the
    /// clients' pace would wait behind a flood of long request bodies, and, refused, end the
    /// stream that reports the request's first byte.
    pub fn request_read(&self) {
        self.0.request_read.store(true, Ordering::Relaxed);
    }

    fn tenant(&self) -> Option<&Arc<str>> {
        self.0.tenant.get()
    }

    /// Whether the pace is holding back a long message of the stream right now (the stream's
    /// reader waits for it then, not for Envoy).
    pub fn is_holding(&self) -> bool {
        self.0.holding.load(Ordering::Relaxed)
    }

    pub(super) fn set_holding(&self, holding: bool) {
        self.0.holding.store(holding, Ordering::Relaxed);
    }

    pub(super) fn is_request_read(&self) -> bool {
        self.0.request_read.load(Ordering::Relaxed)
    }
}

/// When the bytes charged so far are paid off at the rate (the "theoretical arrival time").
#[derive(Debug, Default)]
struct Buckets {
    /// All long bodies, at the whole rate.
    total: Option<tokio::time::Instant>,
    /// Per tenant receiving long bodies: its own bucket, at the rate split evenly among the
    /// tenants active within [`FLOW_ACTIVE`], and when it last read.
    flows: std::collections::HashMap<Arc<str>, (tokio::time::Instant, tokio::time::Instant)>,
}

/// The byte rate all streams' long messages share (a GCRA token bucket of
/// [`MIN_HEAVY_BURST_BYTES`]), split evenly between the tenants whose long bodies are arriving (each
/// also has a bucket of its own at its share, so a tenant flooding with many streams takes its
/// share, not one stream's worth per stream). The rate is set per new stream from the config in
/// force; 0 reads at full speed.
#[derive(Debug)]
pub struct Pace {
    rate: AtomicU64,
    /// Bytes read at full speed when nothing was read for a while ([`MIN_HEAVY_BURST_BYTES`] or
    /// more: `RoutingConfig::heavy_burst`).
    burst: AtomicU64,
    buckets: parking_lot::Mutex<Buckets>,
    /// Time streams were held back, seconds, summed over streams (counted when a hold ends).
    held_seconds: prometheus_client::metrics::counter::Counter<f64, AtomicU64>,
    /// Long messages refused for their wait.
    refused: Counter,
}

impl Pace {
    /// A pace of `bytes_per_s` (0: none).
    pub fn new(bytes_per_s: u64) -> Pace {
        Pace {
            rate: AtomicU64::new(bytes_per_s),
            burst: AtomicU64::new(MIN_HEAVY_BURST_BYTES),
            buckets: parking_lot::Mutex::new(Buckets::default()),
            held_seconds: Default::default(),
            refused: Default::default(),
        }
    }

    /// Also counts the time held in `held_seconds`, in seconds, and the messages refused in
    /// `refused`.
    pub fn counted(
        mut self,
        held_seconds: prometheus_client::metrics::counter::Counter<f64, AtomicU64>,
        refused: Counter,
    ) -> Pace {
        self.held_seconds = held_seconds;
        self.refused = refused;
        self
    }

    /// The rate from now on (the config in force when a stream starts).
    #[cfg(test)]
    pub fn set_rate(&self, bytes_per_s: u64) {
        self.set(bytes_per_s, MIN_HEAVY_BURST_BYTES);
    }

    /// The rate and the burst from now on (the config in force when a stream starts).
    pub fn set(&self, bytes_per_s: u64, burst_bytes: u64) {
        self.rate.store(bytes_per_s, Ordering::Relaxed);
        self.burst.store(burst_bytes, Ordering::Relaxed);
    }

    /// Charges `bytes` just read by a stream of `tenant` (if known); when the stream must wait
    /// before reading more, until when.
    fn charge(&self, bytes: usize, tenant: Option<&Arc<str>>) -> Option<tokio::time::Instant> {
        let rate = self.rate.load(Ordering::Relaxed);
        if rate == 0 || bytes == 0 {
            return None;
        }
        let now = tokio::time::Instant::now();
        // Paid off at `rate` after `paid_at`: the new paid-off time, and when that is at most
        // the burst's time at the whole rate ahead of now (a tenant's share of the burst is its
        // share of the rate).
        let burst_bytes = self.burst.load(Ordering::Relaxed);
        let burst = Duration::from_secs_f64(burst_bytes as f64 / rate as f64);
        let pay = |paid_at: Option<tokio::time::Instant>, rate: f64| {
            let paid = paid_at.map_or(now, |at| at.max(now))
                + Duration::from_secs_f64(bytes as f64 / rate);
            (paid, paid.checked_sub(burst))
        };
        let mut buckets = self.buckets.lock();
        let (paid, mut ready) = pay(buckets.total, rate as f64);
        buckets.total = Some(paid);
        if let Some(tenant) = tenant {
            let flows = &mut buckets.flows;
            flows.retain(|_, (_, last)| now.saturating_duration_since(*last) < FLOW_ACTIVE);
            let known = flows.contains_key(tenant);
            if known || flows.len() < MAX_FLOWS {
                let share = rate as f64 / (flows.len() + usize::from(!known)) as f64;
                // A new tenant's bucket starts paid off now.
                let flow = flows.entry(Arc::clone(tenant)).or_insert((now, now));
                let (paid, flow_ready) = pay(Some(flow.0), share);
                *flow = (paid, now);
                ready = ready.max(flow_ready);
            }
        }
        ready.filter(|&ready| ready > now)
    }
}

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
    pace: Option<Arc<Pace>>,
    /// Whose share of the pace this stream takes.
    flow: PaceFlow,
    /// Held back by the pace until this fires, since then.
    held: Option<(Pin<Box<tokio::time::Sleep>>, tokio::time::Instant)>,
    /// The longest a long message may wait for the pace in all; past it, it is refused.
    /// Zero: never refused.
    max_wait: Duration,
    /// How long the long message being read has waited so far.
    waited: Duration,
    /// A long message was refused: nothing more is read from this stream.
    refused: bool,
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
            pace: None,
            flow: PaceFlow::default(),
            held: None,
            max_wait: Duration::ZERO,
            waited: Duration::ZERO,
            refused: false,
        }
    }

    /// Long messages' bytes are charged to `pace` (see the module doc), to `flow`'s share
    /// once it is known; one that would wait more than `max_wait` in all (if not zero) is
    /// refused instead ([`Chunks::is_refused`]) and the stream read no further.
    pub fn paced(mut self, pace: Arc<Pace>, flow: PaceFlow, max_wait: Duration) -> Self {
        self.pace = Some(pace);
        self.flow = flow;
        self.max_wait = max_wait;
        self
    }

    /// Gives up the long message being read: its place is refused, tonic gets a placeholder.
    fn refuse(&mut self) {
        // What Envoy may already have sent of the rest (up to the stream's window) is
        // received whether or not it is read: it counts against the rate too.
        if let (State::Collect { left, .. }, Some(pace)) = (&self.state, &self.pace) {
            let unread = (*left).min(super::STREAM_WINDOW_BYTES as usize);
            pace.charge(unread, self.flow.tenant());
            pace.refused.inc();
        }
        self.state = State::Header {
            bytes: [0; HEADER],
            have: 0,
        };
        self.diverted
            .lock()
            .push_back((self.seen - 1, Chunks::refused()));
        self.out.push_back(Bytes::from_static(&[0; HEADER]));
        self.refused = true;
        self.held = None;
    }

    /// Reads the framing of one DATA frame, queueing what tonic gets; returns how many of its
    /// bytes belong to long messages.
    fn take(&mut self, mut data: Bytes) -> Result<usize, Status> {
        let mut long = 0;
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
                    if header[0] == 0 && len > self.raw_above && !self.flow.is_request_read() {
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
                        self.waited = Duration::ZERO;
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
                    long += n;
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
        Ok(long)
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
            if this.refused {
                // The placeholder went out above: the body ends there for tonic.
                return Poll::Ready(None);
            }
            if let Some((held, since)) = this.held.as_mut() {
                std::task::ready!(held.as_mut().poll(cx));
                let waited = since.elapsed();
                this.waited += waited;
                if let Some(pace) = &this.pace {
                    pace.held_seconds.inc_by(waited.as_secs_f64());
                }
                this.held = None;
                this.flow.set_holding(false);
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
                        let long = match this.take(bytes) {
                            Ok(long) => long,
                            Err(status) => return Poll::Ready(Some(Err(status))),
                        };
                        if let Some(until) = this
                            .pace
                            .as_ref()
                            .and_then(|p| p.charge(long, this.flow.tenant()))
                        {
                            let now = tokio::time::Instant::now();
                            let collecting = matches!(this.state, State::Collect { .. });
                            if collecting
                                && !this.max_wait.is_zero()
                                && this.waited + (until - now) > this.max_wait
                            {
                                this.refuse();
                                continue;
                            }
                            this.held = Some((Box::pin(tokio::time::sleep_until(until)), now));
                            this.flow.set_holding(true);
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

    /// `wire` as a request body of DATA frames of `piece` bytes.
    fn body_of(
        wire: &[u8],
        piece: usize,
    ) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = wire
            .chunks(piece)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        http_body_util::StreamBody::new(futures::stream::iter(frames))
    }

    /// Feeds `wire` through a Divert in pieces of `piece` bytes; what tonic would get, and
    /// what was diverted.
    async fn run(wire: &[u8], piece: usize, raw_above: usize) -> (Vec<u8>, Vec<(u64, Vec<u8>)>) {
        let inner = body_of(wire, piece);
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

    /// Feeds `wire` in 16 KiB frames through a Divert paced at `rate`; how long it took on
    /// tokio's (paused) clock, and the bytes diverted.
    async fn paced_run(wire: &[u8], rate: u64, pace: &Arc<Pace>) -> (Duration, usize) {
        paced_run_of(wire, rate, pace, None).await
    }

    /// [`paced_run`] for a stream of `tenant`.
    async fn paced_run_of(
        wire: &[u8],
        rate: u64,
        pace: &Arc<Pace>,
        tenant: Option<&str>,
    ) -> (Duration, usize) {
        pace.set_rate(rate);
        let flow = PaceFlow::default();
        if let Some(tenant) = tenant {
            flow.set(tenant);
        }
        let inner = body_of(wire, 16 << 10);
        let diverted = Diverted::default();
        let body = Divert::new(inner, 1024, 64 << 20, Arc::clone(&diverted)).paced(
            Arc::clone(pace),
            flow,
            Duration::ZERO,
        );
        let started = tokio::time::Instant::now();
        body.collect().await.unwrap();
        let taken = diverted.lock().iter().map(|(_, c)| c.remaining()).sum();
        (started.elapsed(), taken)
    }

    #[tokio::test(start_paused = true)]
    async fn long_messages_are_read_at_the_shared_rate_after_the_burst_and_short_ones_at_once() {
        let mib = 1usize << 20;
        let pace = Arc::new(Pace::new(0));
        // 12 MiB long message at 4 MiB/s: the first 4 MiB are the burst, the other 8 take 2 s.
        let long = framed(12 * mib, b'x');
        let (took, taken) = paced_run(&long, 4 << 20, &pace).await;
        assert_eq!(taken, 12 * mib);
        let secs = took.as_secs_f64();
        assert!((1.95..2.05).contains(&secs), "took {secs} s");
        // The bucket is shared and still in debt right after: a second stream waits its turn
        // (its 12 MiB take 3 s, nothing left of the burst).
        let (took, _) = paced_run(&long, 4 << 20, &pace).await;
        let secs = took.as_secs_f64();
        assert!((2.95..3.05).contains(&secs), "took {secs} s");
        // Short messages are never held, however much of them, even with the bucket in debt.
        let mut short = Vec::new();
        for _ in 0..2000 {
            short.extend(framed(1000, b's'));
        }
        let (took, taken) = paced_run(&short, 4 << 20, &pace).await;
        assert_eq!((took, taken), (Duration::ZERO, 0));
        // Rate 0 reads at full speed.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (took, _) = paced_run(&framed(40 * mib, b'y'), 0, &pace).await;
        assert_eq!(took, Duration::ZERO);
        let held = pace.held_seconds.get();
        assert!((4.9..5.1).contains(&held), "held {held} s");
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_message_that_would_wait_past_the_bound_is_refused_and_nothing_more_is_read() {
        let mib = 1usize << 20;
        // 12 MiB at 4 MiB/s would wait 2 s after the burst; the bound is 500 ms. A short
        // message follows it on the wire.
        let mut wire = framed(12 * mib, b'x');
        wire.extend(framed(10, b's'));
        let inner = body_of(&wire, 16 << 10);
        let diverted = Diverted::default();
        let pace = Arc::new(Pace::new(4 << 20));
        let body = Divert::new(inner, 1024, 64 << 20, Arc::clone(&diverted)).paced(
            Arc::clone(&pace),
            PaceFlow::default(),
            Duration::from_millis(500),
        );
        let started = tokio::time::Instant::now();
        let passed = body.collect().await.unwrap().to_bytes().to_vec();
        let took = started.elapsed();
        // tonic gets the long message's placeholder and then the end: the short message
        // behind it is never read.
        assert_eq!(passed, framed(0, 0));
        let queue: Vec<_> = diverted.lock().drain(..).collect();
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0].0, 0);
        assert!(queue[0].1.is_refused());
        assert!(took <= Duration::from_millis(500), "took {took:?}");
        assert_eq!(pace.refused.get(), 1);
        // Without a bound the same message is read whole, after ~2 s.
        let (took, taken) =
            paced_run(&framed(12 * mib, b'x'), 4 << 20, &Arc::new(Pace::new(0))).await;
        assert_eq!(taken, 12 * mib);
        assert!(took >= Duration::from_millis(1900), "took {took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn of_two_long_messages_that_fit_alone_the_later_is_refused_when_read_together() {
        let mib = 1usize << 20;
        // Two 6 MiB messages at 4 MiB/s, 4 MiB burst, 1 s bound: each alone would wait 0.5 s;
        // both headers read before either's payload, then read together, the later one's
        // turn comes at ~2 s.
        let wire = framed(6 * mib, b'x');
        let pace = Arc::new(Pace::new(4 << 20));
        let mut feeds = Vec::new();
        let mut runs = Vec::new();
        for _ in 0..2 {
            let (tx, rx) = futures::channel::mpsc::unbounded::<
                Result<Frame<Bytes>, std::convert::Infallible>,
            >();
            tx.unbounded_send(Ok(Frame::data(Bytes::copy_from_slice(&wire[..HEADER]))))
                .unwrap();
            feeds.push(tx);
            let diverted = Diverted::default();
            let body = Divert::new(
                http_body_util::StreamBody::new(rx),
                1024,
                64 << 20,
                Arc::clone(&diverted),
            )
            .paced(
                Arc::clone(&pace),
                PaceFlow::default(),
                Duration::from_secs(1),
            );
            runs.push(async move {
                body.collect().await.unwrap();
                let refused = diverted.lock().iter().any(|(_, c)| c.is_refused());
                refused
            });
        }
        let feed = async {
            // Both streams have read their headers (and wait for more) before any payload.
            tokio::task::yield_now().await;
            for tx in feeds {
                for piece in wire[HEADER..].chunks(16 << 10) {
                    tx.unbounded_send(Ok(Frame::data(Bytes::copy_from_slice(piece))))
                        .unwrap();
                }
            }
        };
        let b = runs.pop().unwrap();
        let a = runs.pop().unwrap();
        let ((), a, b) = tokio::join!(feed, a, b);
        assert_eq!(u8::from(a) + u8::from(b), 1, "one served, one refused");
        assert_eq!(pace.refused.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_of_the_largest_size_is_read_in_time_when_nothing_else_is() {
        // The config's burst makes room for one body of `max_body_bytes` within the bound;
        // with the 4 MiB burst alone, 32 MiB at 16 MiB/s would wait ~1.75 s: refused every try.
        let routing = crate::config::RoutingConfig {
            heavy_body_bytes_per_s: Some(16 << 20),
            ..Default::default()
        };
        let largest = routing.max_body_bytes;
        let max_wait = Duration::from_millis(routing.heavy_body_max_wait_ms);
        for (burst, served) in [
            (MIN_HEAVY_BURST_BYTES, false),
            (routing.heavy_burst(), true),
        ] {
            let pace = Arc::new(Pace::new(0));
            pace.set(routing.heavy_rate(), burst);
            let diverted = Diverted::default();
            let body = Divert::new(
                body_of(&framed(largest, b'x'), 16 << 10),
                1024,
                64 << 20,
                Arc::clone(&diverted),
            )
            .paced(pace, PaceFlow::default(), max_wait);
            let started = tokio::time::Instant::now();
            body.collect().await.unwrap();
            let took = started.elapsed();
            let queue: Vec<_> = diverted.lock().drain(..).collect();
            assert_eq!(queue.len(), 1);
            assert_eq!(!queue[0].1.is_refused(), served, "burst {burst}");
            if served {
                assert_eq!(queue[0].1.remaining(), largest);
                assert!(took <= max_wait, "took {took:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn once_the_request_is_read_long_messages_pass_unpaced_and_unrefused() {
        // An observer's long response chunk after a flood emptied the pace: refused before its
        // stream says the request is read, passed to tonic whole and at once after.
        let mib = 1usize << 20;
        let wire = framed(8 * mib, b'r');
        for read in [false, true] {
            let pace = Arc::new(Pace::new(0));
            pace.set(1 << 20, MIN_HEAVY_BURST_BYTES);
            // Someone else's long bodies took the burst and more.
            pace.charge(16 * mib, None);
            let flow = PaceFlow::default();
            if read {
                flow.request_read();
            }
            let diverted = Diverted::default();
            let body = Divert::new(
                body_of(&wire, 16 << 10),
                1024,
                64 << 20,
                Arc::clone(&diverted),
            )
            .paced(Arc::clone(&pace), flow, Duration::from_secs(1));
            let started = tokio::time::Instant::now();
            let passed = body.collect().await.unwrap().to_bytes();
            let queue: Vec<_> = diverted.lock().drain(..).collect();
            if read {
                assert_eq!(passed.len(), wire.len(), "tonic reads it itself");
                assert!(queue.is_empty(), "not diverted");
                assert_eq!(started.elapsed(), Duration::ZERO, "not held");
            } else {
                assert_eq!(queue.len(), 1);
                assert!(
                    queue[0].1.is_refused(),
                    "a request body waits its turn or is refused"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn tenants_share_the_rate_evenly_however_many_streams_each_has() {
        let mib = 1usize << 20;
        let pace = Arc::new(Pace::new(0));
        let body = framed(8 * mib, b'x');
        // Tenant `flood` reads three 8 MiB bodies at once, tenant `victim` one, at 4 MiB/s:
        // 32 MiB, 4 of them the burst, so the last ends ~7 s in, whoever it is.
        let flood = || paced_run_of(&body, 4 << 20, &pace, Some("flood"));
        let (a, b, c, victim) = tokio::join!(
            flood(),
            flood(),
            flood(),
            paced_run_of(&body, 4 << 20, &pace, Some("victim"))
        );
        let flood_took = [a.0, b.0, c.0].map(|d| d.as_secs_f64());
        let victim_took = victim.0.as_secs_f64();
        assert_eq!(
            (a.1, b.1, c.1, victim.1),
            (8 * mib, 8 * mib, 8 * mib, 8 * mib)
        );
        let last = flood_took.iter().copied().fold(victim_took, f64::max);
        assert!((6.9..7.3).contains(&last), "the rate is kept: {last} s");
        // Per stream the victim would get a quarter of the rate and end with the others
        // (~7 s); with half of it, its 8 MiB are in by about 4 s.
        assert!(
            victim_took < 4.5,
            "victim {victim_took} s, flood {flood_took:?}"
        );
        // Without tenants the same four streams share per stream: the one in the victim's
        // place gets a quarter of the rate and ends with the last (the first stream polled
        // took the whole burst in both runs).
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (_, _, _, fourth) = tokio::join!(
            paced_run(&body, 4 << 20, &pace),
            paced_run(&body, 4 << 20, &pace),
            paced_run(&body, 4 << 20, &pace),
            paced_run(&body, 4 << 20, &pace)
        );
        let fourth = fourth.0.as_secs_f64();
        assert!(fourth > 6.5, "per stream, the fourth ends at {fourth} s");
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
