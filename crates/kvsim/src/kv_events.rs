//! KV-cache events and their encoding in vLLM's wire format.
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
//! The CPU offload tier ([`super::offload`]) reports as vLLM's `OffloadingConnector` does, with
//! medium `CPU`: `BlockStored` when a block reaches the tier (by default a placeholder: the
//! hashes, empty `token_ids`, nil parent, LoRA and extra keys, block size 0; with
//! `self_describing_kv_events` the GPU event's payload) and `BlockRemoved` when it leaves.
//!
//! An extra key is a string (LoRA name or cache salt) or an unsigned int (a multimodal item's
//! hash). One batch per engine step that produced events; [`super::publisher`] sends them.

use std::sync::Arc;

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
    /// Blocks reached the CPU offload tier: `BlockStored` with medium `CPU`. The payload is a
    /// `BlockStored` (a placeholder has no tokens, no parent, no extra keys and block size 0).
    Offloaded(Box<KvEvent>),
    /// The CPU offload tier evicted blocks: `BlockRemoved` with medium `CPU`.
    OffloadRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

impl KvEvent {
    /// vLLM's placeholder for blocks stored in the CPU tier: their hashes only.
    pub fn offload_placeholder(block_hashes: Vec<u64>) -> KvEvent {
        KvEvent::Offloaded(Box::new(KvEvent::BlockStored {
            block_hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            lora_name: None,
            extra_keys: Vec::new(),
        }))
    }
}

/// The msgpack payload of one batch: `[ts, [events], data_parallel_rank]`.
pub fn encode_batch(ts_s: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + events.len() * 64));
    w.array(3);
    w.f64(ts_s);
    w.array(events.len());
    for event in events {
        encode_event(&mut w, event, "GPU");
    }
    w.uint(u64::from(dp_rank));
    w.0
}

/// One event as a msgpack map, with `medium` as given.
fn encode_event(w: &mut Writer, event: &KvEvent, medium: &str) {
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
            w.pair_str("medium", medium);
            w.str("lora_name");
            match lora_name {
                Some(name) => w.str(name),
                None => w.nil(),
            }
            w.str("extra_keys");
            if extra_keys.is_empty() {
                // A placeholder's (every real GPU event has one entry per block).
                w.nil();
            } else {
                w.array(extra_keys.len());
            }
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
            w.pair_str("medium", medium);
            w.str("group_idx");
            w.uint(0);
        }
        KvEvent::AllBlocksCleared => {
            w.map(1);
            w.pair_str("type", "AllBlocksCleared");
        }
        KvEvent::Offloaded(stored) => encode_event(w, stored, "CPU"),
        KvEvent::OffloadRemoved { block_hashes } => {
            w.map(4);
            w.pair_str("type", "BlockRemoved");
            w.str("block_hashes");
            w.uints(block_hashes.iter().copied());
            w.pair_str("medium", "CPU");
            w.str("group_idx");
            w.uint(0);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
