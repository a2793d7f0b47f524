//! The real vLLM capture (`shared/fixtures/vllm-0.32-cpu-smollm2`), read for tests: the
//! requests in order with the usage vLLM returned, and the KV events it published, decoded with
//! a generic msgpack reader (not the simulator's encoder). Tests of the simulator and of the
//! router compare their token ids, prompt lengths and events with these.
//!
//! Every function panics with a clear message when the capture is missing or malformed: a test
//! that compares with vLLM must fail without it, never pass.

use std::path::{Path, PathBuf};

use rmpv::Value as Mp;
use serde_json::Value;

const FIXTURE: &str = "shared/fixtures/vllm-0.32-cpu-smollm2";

/// The capture's directory, beside the repository or any ancestor of it.
pub fn dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .map(|a| a.join(FIXTURE))
        .find(|p| p.join("requests.jsonl").is_file())
        .unwrap_or_else(|| {
            panic!(
                "the real vLLM capture `{FIXTURE}` is missing: looked beside every ancestor of {}",
                manifest.display()
            )
        })
}

/// One request sent to vLLM, with what vLLM answered.
#[derive(Debug, Clone)]
pub struct CapturedRequest {
    /// The OpenAI body as sent.
    pub body: Value,
    /// A chat request (else a completion).
    pub chat: bool,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

impl CapturedRequest {
    /// The request path.
    pub fn path(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }
}

/// One step of the capture, in order.
#[derive(Debug, Clone)]
pub enum Step {
    /// A generation request.
    Request(CapturedRequest),
    /// `POST /reset_prefix_cache`.
    ResetPrefixCache,
}

/// Every step of `requests.jsonl`.
pub fn steps() -> Vec<Step> {
    let path = dir().join("requests.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let record: Value = serde_json::from_str(line).expect("requests.jsonl lines are JSON");
            if let Some(action) = record.get("action") {
                assert_eq!(action, "POST /reset_prefix_cache", "unknown capture action");
                return Step::ResetPrefixCache;
            }
            let usage = &record["usage"];
            Step::Request(CapturedRequest {
                chat: record["request"].get("messages").is_some(),
                body: record["request"].clone(),
                prompt_tokens: usage["prompt_tokens"]
                    .as_u64()
                    .expect("usage.prompt_tokens"),
                cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .expect("usage.prompt_tokens_details.cached_tokens"),
            })
        })
        .collect()
}

/// The requests of the capture, in order.
pub fn requests() -> Vec<CapturedRequest> {
    steps()
        .into_iter()
        .filter_map(|s| match s {
            Step::Request(r) => Some(r),
            Step::ResetPrefixCache => None,
        })
        .collect()
}

/// One KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// BlockStored.
    Stored {
        /// One hash per stored block.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first, if any.
        parent: Option<u64>,
        /// The blocks' token ids, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
    },
    /// BlockRemoved.
    Removed {
        /// The evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// AllBlocksCleared.
    Cleared,
}

/// Every event of `kv-events.jsonl`, in order.
pub fn events() -> Vec<Event> {
    let path = dir().join("kv-events.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .flat_map(|line| {
            let msg: Value = serde_json::from_str(line).expect("kv-events.jsonl lines are JSON");
            let payload = hex(msg["frames_hex"][2].as_str().expect("three hex frames"));
            decode_payload(&payload)
        })
        .collect()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The events of one KV-event message payload (`[ts, [events...], dp_rank]`, events as maps
/// with a `type` key), as vLLM 0.32 encodes it.
pub fn decode_payload(payload: &[u8]) -> Vec<Event> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack payload");
    let events = batch
        .as_array()
        .and_then(|b| b.get(1))
        .and_then(Mp::as_array)
        .expect("[ts, [events], dp_rank]");
    events.iter().map(event).collect()
}

fn field<'a>(event: &'a Mp, key: &str) -> Option<&'a Mp> {
    event
        .as_map()
        .expect("events are maps")
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn u64s(v: Option<&Mp>) -> Vec<u64> {
    v.and_then(Mp::as_array)
        .expect("an array")
        .iter()
        .map(|x| x.as_u64().expect("an unsigned integer"))
        .collect()
}

fn event(ev: &Mp) -> Event {
    match field(ev, "type").and_then(Mp::as_str) {
        Some("BlockStored") => Event::Stored {
            block_hashes: u64s(field(ev, "block_hashes")),
            parent: field(ev, "parent_block_hash").and_then(Mp::as_u64),
            token_ids: u64s(field(ev, "token_ids"))
                .into_iter()
                .map(|t| u32::try_from(t).expect("token id"))
                .collect(),
            block_size: field(ev, "block_size")
                .and_then(Mp::as_u64)
                .expect("block_size") as usize,
        },
        Some("BlockRemoved") => Event::Removed {
            block_hashes: u64s(field(ev, "block_hashes")),
        },
        Some("AllBlocksCleared") => Event::Cleared,
        other => panic!("unknown KV event type {other:?}"),
    }
}

/// Every full-block token prefix the engine stored: for each stored block, the token ids from
/// its chain's root to its end.
pub fn stored_prefixes(events: &[Event]) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for ev in events {
        if let Event::Stored { block_hashes, .. } = ev {
            for &h in block_hashes {
                out.push(chain(events, h));
            }
        }
    }
    out
}

/// The token ids of the block chain ending in block `last`, root first.
fn chain(events: &[Event], last: u64) -> Vec<u32> {
    let mut blocks: Vec<&[u32]> = Vec::new();
    let mut at = Some(last);
    while let Some(h) = at {
        let (hashes, parent, tokens, bs) = events
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                } if block_hashes.contains(&h) => {
                    Some((block_hashes, parent, token_ids, *block_size))
                }
                _ => None,
            })
            .expect("every parent block is in the capture");
        let i = hashes.iter().position(|&x| x == h).expect("present");
        blocks.push(&tokens[i * bs..(i + 1) * bs]);
        at = if i == 0 { *parent } else { Some(hashes[i - 1]) };
    }
    blocks.into_iter().rev().flatten().copied().collect()
}
