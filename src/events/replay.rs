//! Fetching a publisher's buffered batches from its replay socket (vLLM's `replay_endpoint`).
//!
//! vLLM's `ZmqEventPublisher` keeps its last `buffer_steps` batches (10,000 by default) and
//! serves them on a ROUTER socket: a DEALER sends `["", start sequence (8-byte big-endian)]`
//! and gets `["", topic, sequence, payload]` for every buffered batch from `start` on, then
//! `["", "", -1 (8-byte big-endian, signed), ""]` (vLLM 0.32, as the real-engine check sees it;
//! earlier vLLM sent the same without the topic frame, which is also taken). The subscriber asks for everything (start 0)
//! each time its SUB socket connects, applies the answer before the live messages, and drops
//! the live messages the answer already held. A buffer that still starts at sequence 0 gives a
//! complete view (a fresh start, see `apply`); a wrapped one a partial view that knows far more
//! than nothing.
//!
//! The replay socket is the engine's (trusted, named in the config); the answer is still
//! bounded in batches, bytes and time so a wedged or confused engine cannot hold the
//! subscriber or its memory.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::endpoint::Shared;

/// At most this many batches are taken from one replay (vLLM buffers 10,000 by default).
pub(crate) const MAX_BATCHES: usize = 100_000;

/// At most this many payload bytes are taken from one replay.
pub(crate) const MAX_BYTES: usize = 256 << 20;

/// The whole replay (connect, request, answer) must finish within this.
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);

/// The end-of-replay sequence: -1 as a signed 8-byte big-endian integer.
const END: [u8; 8] = [0xff; 8];

/// Why a replay gave nothing (the subscriber then goes on with live messages only).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    /// The socket failed.
    #[error("replay socket: {0}")]
    Socket(#[from] zeromq::ZmqError),
    /// No complete answer within the deadline.
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    /// The answer was not in vLLM's replay format.
    #[error("malformed answer: {0}")]
    Malformed(&'static str),
    /// The answer held more than the bounds allow.
    #[error("answer larger than {MAX_BATCHES} batches or {MAX_BYTES} bytes")]
    TooLarge,
}

/// One buffered batch: its sequence and its msgpack payload.
pub(crate) type Batch = (u64, Bytes);

/// Fetches every batch the publisher behind `endpoint` buffered from sequence `start` on, in
/// order, within [`DEADLINE`].
pub(crate) async fn fetch(
    endpoint: &str,
    start: u64,
    shared: &Arc<Shared>,
) -> Result<Vec<Batch>, ReplayError> {
    fetch_within(endpoint, start, DEADLINE, shared).await
}

pub(crate) async fn fetch_within(
    endpoint: &str,
    start: u64,
    deadline: Duration,
    shared: &Arc<Shared>,
) -> Result<Vec<Batch>, ReplayError> {
    tokio::time::timeout(deadline, exchange(endpoint, start, shared))
        .await
        .map_err(|_| ReplayError::Timeout(deadline))?
}

async fn exchange(
    endpoint: &str,
    start: u64,
    shared: &Arc<Shared>,
) -> Result<Vec<Batch>, ReplayError> {
    // Through the gate's frame check, as the live socket (the publisher may be a discovered
    // address: not trusted with a frame header `zeromq` would abort on).
    let (target, _relay) = super::gate::connect_checked(endpoint, shared)
        .await
        .map_err(|e| ReplayError::Socket(zeromq::ZmqError::Network(e)))?;
    let mut socket = DealerSocket::new();
    socket.connect(&target).await?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    socket.send(request).await?;
    let mut batches = Vec::new();
    let mut bytes = 0usize;
    loop {
        let frames = socket.recv().await?.into_vec();
        let (empty, seq, payload) = match &frames[..] {
            [empty, _, seq, payload] | [empty, seq, payload] => (empty, seq, payload),
            _ => return Err(ReplayError::Malformed("neither three nor four frames")),
        };
        if !empty.is_empty() {
            return Err(ReplayError::Malformed("no empty delimiter frame"));
        }
        let seq: [u8; 8] = seq[..]
            .try_into()
            .map_err(|_| ReplayError::Malformed("sequence frame is not 8 bytes"))?;
        if seq == END {
            return Ok(batches);
        }
        let seq = u64::from_be_bytes(seq);
        if batches.last().is_some_and(|(last, _)| *last >= seq) {
            return Err(ReplayError::Malformed("sequences not increasing"));
        }
        bytes += payload.len();
        if batches.len() >= MAX_BATCHES || bytes > MAX_BYTES {
            return Err(ReplayError::TooLarge);
        }
        batches.push((seq, payload.clone()));
    }
}

/// Drops live messages the replay already delivered: those with a sequence at or below the
/// replay's last, until the first newer one (after which every message passes: a restarted
/// publisher's sequence 0 must reach the state machine).
#[derive(Debug, Default)]
pub(crate) struct Overlap {
    upto: Option<u64>,
}

impl Overlap {
    /// After a replay whose last batch was `last`.
    pub(crate) fn after(last: Option<u64>) -> Overlap {
        Overlap { upto: last }
    }

    /// Whether a live message with sequence frame `seq` (8-byte big-endian) is new.
    pub(crate) fn is_new(&mut self, seq: Option<&[u8]>) -> bool {
        let Some(upto) = self.upto else {
            return true;
        };
        let seq = seq
            .and_then(|s| <[u8; 8]>::try_from(s).ok())
            .map(u64::from_be_bytes);
        match seq {
            Some(s) if s <= upto => false,
            _ => {
                self.upto = None;
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::RouterSocket;

    #[test]
    fn live_messages_the_replay_held_are_dropped_until_a_newer_one() {
        let be = |s: u64| s.to_be_bytes();
        let mut o = Overlap::after(Some(5));
        assert!(!o.is_new(Some(&be(4))));
        assert!(!o.is_new(Some(&be(5))));
        assert!(o.is_new(Some(&be(6))));
        assert!(
            o.is_new(Some(&be(0))),
            "after a newer one, a restart's 0 passes"
        );
        let mut none = Overlap::after(None);
        assert!(none.is_new(Some(&be(0))));
        let mut bad = Overlap::after(Some(5));
        assert!(
            bad.is_new(Some(b"short")),
            "undecodable goes on to be counted"
        );
    }

    /// A ROUTER on loopback answering one request with `answer` (frames after the identity).
    /// Returns its endpoint, the start it was asked for, and its task.
    async fn server(
        answer: Vec<Vec<Bytes>>,
    ) -> (
        String,
        tokio::sync::oneshot::Receiver<u64>,
        tokio::task::JoinHandle<()>,
    ) {
        let mut socket = RouterSocket::new();
        let bound = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let request = socket.recv().await.unwrap().into_vec();
            assert_eq!(request.len(), 3, "identity, empty, start");
            assert!(request[1].is_empty());
            let _ = tx.send(u64::from_be_bytes(request[2][..].try_into().unwrap()));
            for frames in answer {
                let mut m = ZmqMessage::from(request[0].clone());
                for f in frames {
                    m.push_back(f);
                }
                socket.send(m).await.unwrap();
            }
            // Keep the socket until the client is done.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        (bound, rx, task)
    }

    fn frame(seq: i64, payload: &'static [u8]) -> Vec<Bytes> {
        vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from_static(payload),
        ]
    }

    #[tokio::test]
    async fn fetches_batches_in_order_until_the_end_marker() {
        let (endpoint, start, task) =
            server(vec![frame(3, b"a"), frame(4, b"b"), frame(-1, b"")]).await;
        let got = fetch_within(&endpoint, 3, Duration::from_secs(10), &Shared::for_tests())
            .await
            .unwrap();
        assert_eq!(start.await.unwrap(), 3);
        assert_eq!(
            got,
            vec![(3, Bytes::from_static(b"a")), (4, Bytes::from_static(b"b"))]
        );
        task.abort();
    }

    /// vLLM 0.32's layout: a topic frame before the sequence; the end marker's topic is empty.
    fn frame_with_topic(topic: &'static [u8], seq: i64, payload: &'static [u8]) -> Vec<Bytes> {
        let mut f = frame(seq, payload);
        f.insert(1, Bytes::from_static(topic));
        f
    }

    #[tokio::test]
    async fn takes_vllm_0_32_answers_that_carry_the_topic() {
        let (endpoint, start, task) = server(vec![
            frame_with_topic(b"kv@x", 0, b"a"),
            frame_with_topic(b"kv@x", 1, b"b"),
            frame_with_topic(b"", -1, b""),
        ])
        .await;
        let got = fetch_within(&endpoint, 0, Duration::from_secs(10), &Shared::for_tests())
            .await
            .unwrap();
        assert_eq!(start.await.unwrap(), 0);
        assert_eq!(
            got,
            vec![(0, Bytes::from_static(b"a")), (1, Bytes::from_static(b"b"))]
        );
        task.abort();
    }

    #[tokio::test]
    async fn a_malformed_or_unfinished_answer_is_an_error() {
        let (endpoint, _, task) = server(vec![frame(4, b"a"), frame(4, b"b")]).await;
        let err = fetch_within(&endpoint, 0, Duration::from_secs(10), &Shared::for_tests())
            .await
            .unwrap_err();
        assert!(matches!(err, ReplayError::Malformed(_)), "{err}");
        task.abort();
        let (endpoint, _, task) = server(vec![frame(1, b"a")]).await;
        let err = fetch_within(
            &endpoint,
            0,
            Duration::from_millis(300),
            &Shared::for_tests(),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ReplayError::Timeout(_)), "{err}");
        task.abort();
    }
}
