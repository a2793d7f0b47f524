//! KV-cache events in vLLM's wire format, and the ZMQ publisher that sends them.
//!
//! Wire format (vLLM 0.32, checked against a real capture in
//! `fixtures/vllm-0.32-cpu-smollm2/kv-events.jsonl`): a ZMQ multipart message
//! `[topic, sequence (8-byte big-endian, from 0 per publisher), payload]` where the payload is the
//! msgpack array `[ts (float seconds), [events...], data_parallel_rank (int)]` and each event is a
//! msgpack map with a `type` key:
//!
//! - `{type: "BlockStored", block_hashes: [u64...], parent_block_hash: u64|nil, token_ids:
//!   [u32...], block_size, lora_id: int|nil, medium: "GPU", lora_name: str|nil, extra_keys:
//!   [nil|[key...]] (one per block), group_idx: 0, kv_cache_spec_kind: "full_attention"}`
//! - `{type: "BlockRemoved", block_hashes: [u64...], medium: "GPU", group_idx: 0}`
//! - `{type: "AllBlocksCleared"}`
//!
//! An extra key is a string (LoRA name or cache salt) or an unsigned int (a multimodal item's
//! hash). One batch per engine step that produced events.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

use super::block_hash::ExtraKey;

/// One KV-cache event, as the engine queues it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks became findable (hashed at allocation time, as vLLM).
    BlockStored {
        /// Hashes of the new blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one, `None` when the first is a prompt's first.
        parent_block_hash: Option<u64>,
        /// Token ids of all the new blocks (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter id (vLLM's `lora_int_id`), if any.
        lora_id: Option<u32>,
        /// LoRA adapter name, if any.
        lora_name: Option<Arc<str>>,
        /// Extra keys per block (`None` for a block without any).
        extra_keys: Vec<Option<Vec<ExtraKey>>>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// The msgpack payload of one batch: `[ts, [events], data_parallel_rank]`.
pub fn encode_batch(ts_s: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + events.len() * 64));
    w.array(3);
    w.f64(ts_s);
    w.array(events.len());
    for event in events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                extra_keys,
            } => {
                w.map(11);
                w.pair_str("type", "BlockStored");
                w.str("block_hashes");
                w.uints(block_hashes.iter().copied());
                w.str("parent_block_hash");
                w.opt_uint(*parent_block_hash);
                w.str("token_ids");
                w.uints(token_ids.iter().map(|&t| u64::from(t)));
                w.str("block_size");
                w.uint(u64::from(*block_size));
                w.str("lora_id");
                w.opt_uint(lora_id.map(u64::from));
                w.pair_str("medium", "GPU");
                w.str("lora_name");
                match lora_name {
                    Some(name) => w.str(name),
                    None => w.nil(),
                }
                w.str("extra_keys");
                w.array(extra_keys.len());
                for keys in extra_keys {
                    let Some(keys) = keys else {
                        w.nil();
                        continue;
                    };
                    w.array(keys.len());
                    for key in keys {
                        match key {
                            ExtraKey::Lora(s) | ExtraKey::Salt(s) => w.str(s),
                            ExtraKey::Mm(h) => w.uint(*h),
                        }
                    }
                }
                w.str("group_idx");
                w.uint(0);
                w.pair_str("kv_cache_spec_kind", "full_attention");
            }
            KvEvent::BlockRemoved { block_hashes } => {
                w.map(4);
                w.pair_str("type", "BlockRemoved");
                w.str("block_hashes");
                w.uints(block_hashes.iter().copied());
                w.pair_str("medium", "GPU");
                w.str("group_idx");
                w.uint(0);
            }
            KvEvent::AllBlocksCleared => {
                w.map(1);
                w.pair_str("type", "AllBlocksCleared");
            }
        }
    }
    w.uint(u64::from(dp_rank));
    w.0
}

/// msgpack into a `Vec`, which cannot fail, so errors are dropped here once.
struct Writer(Vec<u8>);

impl Writer {
    fn array(&mut self, len: usize) {
        let _ = rmp::encode::write_array_len(&mut self.0, len as u32);
    }
    fn map(&mut self, len: u32) {
        let _ = rmp::encode::write_map_len(&mut self.0, len);
    }
    fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(&mut self.0, v);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(&mut self.0, v);
    }
    fn uints(&mut self, vs: impl ExactSizeIterator<Item = u64>) {
        self.array(vs.len());
        for v in vs {
            self.uint(v);
        }
    }
    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(&mut self.0);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(&mut self.0, s);
    }
    fn pair_str(&mut self, key: &str, value: &str) {
        self.str(key);
        self.str(value);
    }
}

/// How the PUB socket attaches to an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attach {
    /// Bind this address (wildcard host rewritten to `0.0.0.0`).
    Bind(String),
    /// Connect to this endpoint (the subscriber binds).
    Connect(String),
}

/// vLLM's rule: bind when the endpoint has a wildcard host (`*`, `::`), connect otherwise.
/// Only `tcp://host:port` endpoints are supported.
pub fn parse_endpoint(endpoint: &str) -> Result<Attach, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint:?}: missing :port"))?;
    port.parse::<u16>()
        .map_err(|_| format!("{endpoint:?}: {port:?} is not a port"))?;
    match host {
        "*" | "0.0.0.0" => Ok(Attach::Bind(format!("tcp://0.0.0.0:{port}"))),
        "[::]" | "::" | "[*]" => Ok(Attach::Bind(format!("tcp://[::]:{port}"))),
        "" => Err(format!("{endpoint:?}: missing host")),
        _ if port == "0" => Err(format!("{endpoint:?}: cannot connect to port 0")),
        _ => Ok(Attach::Connect(endpoint.to_string())),
    }
}

/// What the publisher task is told.
#[derive(Debug)]
pub enum PublisherMsg {
    /// Publish one batch (one engine step's events).
    Batch(Vec<KvEvent>),
    /// Simulated process restart: reopen the socket and restart the sequence at 0.
    Restart,
}

/// Why the publisher did not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// The endpoint is not one we support.
    #[error("kv_events.endpoint {0}")]
    Endpoint(String),
    /// The socket could not bind.
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// What zeromq said.
        source: zeromq::ZmqError,
    },
}

/// A started publisher: where subscribers find it and how to feed it.
#[derive(Debug)]
pub struct Publisher {
    /// The endpoint a subscriber uses: `tcp://127.0.0.1:PORT` when bound (port resolved), the
    /// configured endpoint when connecting.
    pub endpoint: String,
    /// Feeds the publisher task.
    pub tx: mpsc::UnboundedSender<PublisherMsg>,
    /// The publisher task.
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts a publisher on `endpoint` with `topic`. Binding happens before this returns (so the
/// port is known); connecting happens in the background (the subscriber may start later).
pub async fn start(endpoint: &str, topic: &str) -> Result<Publisher, PublisherError> {
    let attach = parse_endpoint(endpoint).map_err(PublisherError::Endpoint)?;
    let (socket, shown) = open(&attach).await?;
    let attach = match (&attach, &shown) {
        // A restart rebinds the same port, not a new random one.
        (Attach::Bind(_), Some(resolved)) => Attach::Bind(resolved.clone()),
        _ => attach,
    };
    let endpoint = match &shown {
        Some(resolved) => resolved
            .replace("0.0.0.0", "127.0.0.1")
            .replace("[::]", "[::1]"),
        None => endpoint.to_string(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let topic = Bytes::copy_from_slice(topic.as_bytes());
    let task = tokio::spawn(run(socket, attach, topic, rx));
    Ok(Publisher { endpoint, tx, task })
}

/// Opens a PUB socket; returns the resolved endpoint when it bound.
async fn open(attach: &Attach) -> Result<(zeromq::PubSocket, Option<String>), PublisherError> {
    let mut socket = zeromq::PubSocket::new();
    match attach {
        Attach::Bind(addr) => {
            let bound = socket
                .bind(addr)
                .await
                .map_err(|source| PublisherError::Bind {
                    endpoint: addr.clone(),
                    source,
                })?;
            Ok((socket, Some(bound.to_string())))
        }
        // zeromq's connect waits for the peer; the publisher task connects in the background so
        // a subscriber that starts later still gets events (libzmq connects asynchronously too).
        Attach::Connect(_) => Ok((socket, None)),
    }
}

async fn run(
    mut socket: zeromq::PubSocket,
    attach: Attach,
    topic: Bytes,
    mut rx: mpsc::UnboundedReceiver<PublisherMsg>,
) {
    let mut seq: u64 = 0;
    if let Attach::Connect(addr) = &attach {
        connect(&mut socket, addr).await;
    }
    while let Some(msg) = rx.recv().await {
        match msg {
            PublisherMsg::Batch(events) => {
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                let payload = encode_batch(ts, &events, 0);
                let mut message = ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                message.push_back(Bytes::from(payload));
                if let Err(e) = socket.send(message).await {
                    tracing::warn!("kv events: send failed: {e}");
                }
                seq += 1;
            }
            PublisherMsg::Restart => {
                drop(socket);
                seq = 0;
                socket = match reopen(&attach).await {
                    Some(s) => s,
                    None => return,
                };
            }
        }
    }
}

async fn connect(socket: &mut zeromq::PubSocket, addr: &str) {
    if let Err(e) = socket.connect(addr).await {
        tracing::warn!("kv events: cannot connect to {addr}: {e}");
    }
}

async fn reopen(attach: &Attach) -> Option<zeromq::PubSocket> {
    // The old listener may take a moment to release its port.
    for _ in 0..50 {
        match open(attach).await {
            Ok((mut socket, _)) => {
                if let Attach::Connect(addr) = attach {
                    connect(&mut socket, addr).await;
                }
                return Some(socket);
            }
            Err(e) => {
                tracing::debug!("kv events: reopen: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
    tracing::error!("kv events: could not reopen the publisher after a restart");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_rule_table() {
        let cases = [
            (
                "tcp://*:5557",
                Ok(Attach::Bind("tcp://0.0.0.0:5557".into())),
            ),
            ("tcp://*:0", Ok(Attach::Bind("tcp://0.0.0.0:0".into()))),
            (
                "tcp://[::]:5557",
                Ok(Attach::Bind("tcp://[::]:5557".into())),
            ),
            (
                "tcp://127.0.0.1:5557",
                Ok(Attach::Connect("tcp://127.0.0.1:5557".into())),
            ),
        ];
        for (endpoint, expected) in cases {
            assert_eq!(parse_endpoint(endpoint), expected, "{endpoint}");
        }
        for bad in [
            "ipc:///tmp/x",
            "tcp://h",
            "tcp://h:x",
            "tcp://:1",
            "tcp://127.0.0.1:0",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn encoding_matches_the_vllm_capture_byte_for_byte() {
        // The first BlockRemoved event of the real vLLM 0.32 capture: batch 4 starts
        // `93 cb <ts> 92 84 a4 "type" ac "BlockRemoved" ac "block_hashes" 91 cf <u64> a6 "medium"
        // a3 "GPU" a9 "group_idx" 00`.
        let payload = encode_batch(
            1.5,
            &[KvEvent::BlockRemoved {
                block_hashes: vec![8263073329575226639],
            }],
            0,
        );
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.extend_from_slice(&[0x91, 0x84, 0xa4]);
        expected.extend_from_slice(b"type");
        expected.push(0xac);
        expected.extend_from_slice(b"BlockRemoved");
        expected.push(0xac);
        expected.extend_from_slice(b"block_hashes");
        expected.extend_from_slice(&[0x91, 0xcf]);
        expected.extend_from_slice(&8263073329575226639u64.to_be_bytes());
        expected.push(0xa6);
        expected.extend_from_slice(b"medium");
        expected.push(0xa3);
        expected.extend_from_slice(b"GPU");
        expected.push(0xa9);
        expected.extend_from_slice(b"group_idx");
        expected.push(0x00);
        expected.push(0x00); // data_parallel_rank
        assert_eq!(payload, expected);
    }
}
