//! vLLM's KV-event replay socket: the publisher keeps its last `buffer_steps` batches and a
//! ROUTER socket serves them. A DEALER asks with `["", start sequence (8-byte big-endian)]`
//! and gets `["", topic, sequence, payload]` for each buffered batch from `start` on, then
//! `["", "", -1 (8-byte big-endian, signed), ""]` (vLLM's `END_SEQ`), as vLLM 0.32's
//! `ZmqEventPublisher._service_replay` sends them. A request of another shape is ignored, as
//! vLLM does.

use std::collections::VecDeque;

use bytes::Bytes;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The end-of-replay marker.
const END_SEQ: [u8; 8] = [0xff; 8];

/// The last batches published, oldest first.
#[derive(Debug)]
pub struct ReplayBuffer {
    steps: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl ReplayBuffer {
    /// Keeps at most `steps` batches.
    pub fn new(steps: usize) -> ReplayBuffer {
        ReplayBuffer {
            steps: steps.max(1),
            batches: VecDeque::new(),
        }
    }

    /// Records a published batch, forgetting the oldest beyond the bound.
    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() == self.steps {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// Forgets everything (a restarted publisher starts empty).
    pub fn clear(&mut self) {
        self.batches.clear();
    }

    /// The batches from `start` on.
    pub fn since(&self, start: u64) -> impl Iterator<Item = &(u64, Bytes)> {
        self.batches.iter().filter(move |(seq, _)| *seq >= start)
    }
}

/// Binds the replay socket; returns it and the endpoint it listens on (port resolved).
pub async fn bind(endpoint: &str) -> Result<(RouterSocket, String), zeromq::ZmqError> {
    let mut socket = RouterSocket::new();
    let bound = socket.bind(endpoint).await?.to_string();
    Ok((socket, bound))
}

/// Receives the next replay request: the asker's identity and its start sequence.
/// Requests of another shape are skipped.
pub async fn next_request(socket: &mut RouterSocket) -> Result<(Bytes, u64), zeromq::ZmqError> {
    loop {
        let frames = socket.recv().await?.into_vec();
        if let [identity, empty, start] = &frames[..] {
            if let (true, Ok(start)) = (empty.is_empty(), <[u8; 8]>::try_from(&start[..])) {
                return Ok((identity.clone(), u64::from_be_bytes(start)));
            }
        }
        tracing::warn!(
            frames = frames.len(),
            "kv events: invalid replay request ignored"
        );
    }
}

/// Answers one request: every buffered batch from `start` on (under `topic`), then the end
/// marker (under an empty topic, as vLLM sends it).
pub async fn answer(
    socket: &mut RouterSocket,
    buffer: &ReplayBuffer,
    topic: &Bytes,
    identity: Bytes,
    start: u64,
) -> Result<usize, zeromq::ZmqError> {
    let mut sent = 0;
    let frames = |topic: Bytes, seq: [u8; 8], payload: Bytes| {
        let mut m = ZmqMessage::from(identity.clone());
        m.push_back(Bytes::new());
        m.push_back(topic);
        m.push_back(Bytes::copy_from_slice(&seq));
        m.push_back(payload);
        m
    };
    for (seq, payload) in buffer.since(start) {
        socket
            .send(frames(topic.clone(), seq.to_be_bytes(), payload.clone()))
            .await?;
        sent += 1;
    }
    socket
        .send(frames(Bytes::new(), END_SEQ, Bytes::new()))
        .await?;
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_steps_batches_in_order() {
        let mut b = ReplayBuffer::new(3);
        for seq in 0..5 {
            b.push(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs: Vec<u64> = b.since(0).map(|(s, _)| *s).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(b.since(4).count(), 1);
        b.clear();
        assert_eq!(b.since(0).count(), 0);
    }
}
