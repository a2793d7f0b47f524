//! vLLM's KV-event wire format, decoded.
//!
//! A ZMQ multipart message `[topic, sequence, payload]`: the sequence is an 8-byte big-endian
//! counter from 0 per publisher; the payload is msgpack `[ts, [events...], data_parallel_rank]`
//! (or the same as a map with those keys). Each event is either a map with a `type` key (vLLM
//! 0.32, checked against a real capture) or a positional array whose first element is the type
//! name (msgspec `array_like`, older vLLM and llm-d):
//!
//! - `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window}`
//! - `BlockRemoved {block_hashes, medium, group_idx}`
//! - `AllBlocksCleared {medium?}`
//!
//! Fields after the ones vLLM has always sent may be missing (msgspec `omit_defaults`), unknown
//! fields and trailing array elements are skipped, and unknown event types decode as
//! [`Event::Unknown`]. Block hashes are integers (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
//! the default) or bytes (a SHA-256 digest), which are reduced to their low 64 bits big-endian,
//! the same value vLLM's own int conversion gives. Nothing here panics on bad input.

use super::msgpack::{MsgpackError, Reader};
use crate::index::Medium;

/// One decoded multipart message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message<'a> {
    /// The topic frame (vLLM's `topic`, default empty).
    pub topic: &'a [u8],
    /// The publisher's sequence number of this batch (from 0 at its start).
    pub seq: u64,
    /// The batch.
    pub batch: Batch,
}

/// One engine step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// When the engine published it, in Unix seconds.
    pub ts_s: f64,
    /// The events, in order.
    pub events: Vec<Event>,
    /// The data-parallel rank of the engine that published it (`None`: not given, rank 0).
    pub dp_rank: Option<u32>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Full blocks became findable in the engine's prefix cache.
    Stored(BlockStored),
    /// Blocks left the cache (evicted), on one medium.
    Removed(BlockRemoved),
    /// The whole prefix cache was dropped (vLLM's `reset_prefix_cache`), on one medium or all.
    Cleared {
        /// The medium cleared; `None` = every medium.
        medium: Option<Medium>,
    },
    /// An event type this decoder does not know (skipped).
    Unknown,
}

/// `BlockStored`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the new blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the block before the first new one; `None` when the first is a
    /// sequence's block 0.
    pub parent_block_hash: Option<u64>,
    /// Token ids of all the new blocks (`block_size` per block). May be empty when the event
    /// only reports a new medium for blocks already known (vLLM's offloading connector
    /// without `self_describing_kv_events`: no tokens, no parent, block size 0 or the
    /// offloaded block size).
    pub token_ids: Vec<u32>,
    /// Tokens per engine block (0 only in a placeholder without tokens).
    pub block_size: u32,
    /// vLLM's integer LoRA id (deprecated in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Where the blocks live (`None` in the event: GPU).
    pub medium: Medium,
    /// The LoRA adapter's name, when the blocks belong to one.
    pub lora_name: Option<Box<str>>,
    /// The extra keys of each block (`None` for a block without any), when the engine sent them.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// The KV-cache group (hybrid models have several); `None` = 0.
    pub group_idx: Option<u32>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// The engine's hashes of the removed blocks (one physical copy each).
    pub block_hashes: Vec<u64>,
    /// The medium they left (`None` in the event: GPU).
    pub medium: Medium,
    /// The KV-cache group; `None` = 0.
    pub group_idx: Option<u32>,
}

/// One extra key of a block, as the engine hashed it: the LoRA name (every block), a
/// multimodal item (`[identifier, offset]` or its hash), `cache_salt` (block 0 only), a prompt
/// embedding digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string key (LoRA name, cache salt, or an older vLLM's multimodal hash).
    Str(Box<str>),
    /// An integer key (an older vLLM's LoRA id, or a multimodal hash).
    Int(i128),
    /// Anything else (arrays, bytes...): content we cannot reproduce.
    Other,
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not `[topic, sequence, payload]`.
    #[error("expected 3 frames [topic, sequence, payload], got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame is {0} bytes, expected 8")]
    Sequence(usize),
    /// The payload is not valid msgpack of the expected shape.
    #[error(transparent)]
    Msgpack(#[from] MsgpackError),
    /// A required field is missing.
    #[error("{event}: missing field {field}")]
    Missing {
        /// The event (or `batch`).
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field has an impossible value.
    #[error("{field}: {message}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong.
        message: &'static str,
    },
}

/// Decodes one multipart message (frames as received).
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message<'_>, WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    let seq: [u8; 8] = seq
        .as_ref()
        .try_into()
        .map_err(|_| WireError::Sequence(seq.as_ref().len()))?;
    Ok(Message {
        topic: topic.as_ref(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Decodes a payload: `[ts, [events], dp_rank]` or `{ts, events, data_parallel_rank}`.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    let mut r = Reader::new(payload);
    let mut ts_s = None;
    let mut events = None;
    let mut dp_rank = None;
    if r.at_map() {
        for _ in 0..r.map_len()? {
            match r.str()? {
                "ts" => ts_s = Some(r.f64()?),
                "events" => events = Some(events_of(&mut r)?),
                "data_parallel_rank" => dp_rank = opt_u32(&mut r, "data_parallel_rank")?,
                _ => r.skip()?,
            }
        }
    } else {
        let n = r.array_len()?;
        for i in 0..n {
            match i {
                0 => ts_s = Some(r.f64()?),
                1 => events = Some(events_of(&mut r)?),
                2 => dp_rank = opt_u32(&mut r, "data_parallel_rank")?,
                _ => r.skip()?,
            }
        }
    }
    let missing = |field| WireError::Missing {
        event: "batch",
        field,
    };
    Ok(Batch {
        ts_s: ts_s.ok_or_else(|| missing("ts"))?,
        events: events.ok_or_else(|| missing("events"))?,
        dp_rank,
    })
}

/// Fewest payload bytes an element of each array can take, bounding what a claimed length
/// may reserve (the header's count is the sender's word, the bytes left are not).
mod min_bytes {
    /// An event: `[""]`, a positional event of an unknown type.
    pub(super) const EVENT: usize = 2;
    /// A hash, a token id, an extra key, or `nil`: one positive fixint.
    pub(super) const SCALAR: usize = 1;
}

/// A vector for a claimed `n` elements of at least `min_bytes` encoded bytes each, with room
/// for no more elements than the bytes left could hold and no more bytes than are left: a
/// lying header cannot make the decoder reserve `n × size_of::<T>()` bytes on its word (an
/// event is ~100 bytes decoded); the vector grows as real elements arrive.
fn reserve<T>(r: &Reader<'_>, n: usize, min_bytes: usize) -> Vec<T> {
    let v = Vec::with_capacity(r.capacity_for(n, min_bytes, std::mem::size_of::<T>()));
    #[cfg(test)]
    tests::note_reserved(v.capacity() * std::mem::size_of::<T>());
    v
}

fn events_of(r: &mut Reader<'_>) -> Result<Vec<Event>, WireError> {
    let n = r.array_len()?;
    let mut out = reserve(r, n, min_bytes::EVENT);
    for _ in 0..n {
        out.push(event(r)?);
    }
    Ok(out)
}

/// Every field any event type has; an event reads the ones its type uses.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<Box<str>>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Kind {
    fn of(name: &str) -> Kind {
        match name {
            "BlockStored" => Kind::Stored,
            "BlockRemoved" => Kind::Removed,
            "AllBlocksCleared" => Kind::Cleared,
            _ => Kind::Unknown,
        }
    }

    /// Field order of the positional (array) form, after the type tag.
    fn positions(self) -> &'static [&'static str] {
        match self {
            Kind::Stored => &[
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
            ],
            Kind::Removed => &["block_hashes", "medium", "group_idx"],
            Kind::Cleared => &["medium"],
            Kind::Unknown => &[],
        }
    }
}

fn event(r: &mut Reader<'_>) -> Result<Event, WireError> {
    let mut fields = Fields::default();
    let kind = if r.at_map() {
        let mut kind = None;
        for _ in 0..r.map_len()? {
            match r.str()? {
                "type" => kind = Some(Kind::of(r.str()?)),
                name => field(r, name, &mut fields)?,
            }
        }
        kind.ok_or(WireError::Missing {
            event: "event",
            field: "type",
        })?
    } else {
        let n = r.array_len()?;
        if n == 0 {
            return Err(WireError::Missing {
                event: "event",
                field: "type",
            });
        }
        let kind = Kind::of(r.str()?);
        let positions = kind.positions();
        for i in 1..n {
            match positions.get(i - 1) {
                Some(name) => field(r, name, &mut fields)?,
                None => r.skip()?,
            }
        }
        kind
    };
    let missing = |event, field| WireError::Missing { event, field };
    Ok(match kind {
        Kind::Stored => {
            let block_hashes = fields
                .block_hashes
                .ok_or_else(|| missing("BlockStored", "block_hashes"))?;
            let block_size = fields
                .block_size
                .ok_or_else(|| missing("BlockStored", "block_size"))?;
            let token_ids = fields.token_ids.unwrap_or_default();
            // vLLM's offloading connector announces a new medium for blocks it already
            // reported with a placeholder: no tokens and block size 0.
            if block_size == 0 && !token_ids.is_empty() {
                return Err(WireError::Invalid {
                    field: "block_size",
                    message: "must be > 0 when token_ids are given",
                });
            }
            Event::Stored(BlockStored {
                block_hashes,
                parent_block_hash: fields.parent_block_hash,
                token_ids,
                block_size,
                lora_id: fields.lora_id,
                medium: fields.medium.unwrap_or(Medium::Gpu),
                lora_name: fields.lora_name,
                extra_keys: fields.extra_keys,
                group_idx: fields.group_idx,
            })
        }
        Kind::Removed => Event::Removed(BlockRemoved {
            block_hashes: fields
                .block_hashes
                .ok_or_else(|| missing("BlockRemoved", "block_hashes"))?,
            medium: fields.medium.unwrap_or(Medium::Gpu),
            group_idx: fields.group_idx,
        }),
        Kind::Cleared => Event::Cleared {
            medium: fields.medium,
        },
        Kind::Unknown => Event::Unknown,
    })
}

/// Reads the value of field `name` into `f` (unknown names are skipped).
fn field(r: &mut Reader<'_>, name: &str, f: &mut Fields) -> Result<(), WireError> {
    match name {
        "block_hashes" => {
            let n = r.array_len()?;
            let mut v = reserve(r, n, min_bytes::SCALAR);
            for _ in 0..n {
                v.push(hash(r)?);
            }
            f.block_hashes = Some(v);
        }
        "parent_block_hash" => f.parent_block_hash = if r.nil() { None } else { Some(hash(r)?) },
        "token_ids" => {
            if !r.nil() {
                let n = r.array_len()?;
                let mut v = reserve(r, n, min_bytes::SCALAR);
                for _ in 0..n {
                    let t = r.uint("a token id")?;
                    v.push(u32::try_from(t).map_err(|_| WireError::Invalid {
                        field: "token_ids",
                        message: "token id does not fit 32 bits",
                    })?);
                }
                f.token_ids = Some(v);
            }
        }
        "block_size" => f.block_size = opt_u32(r, "block_size")?,
        "lora_id" => {
            f.lora_id = match r.nil() {
                true => None,
                false => Some(i64::try_from(r.int()?).unwrap_or(i64::MAX)),
            }
        }
        "medium" => {
            f.medium = if r.nil() {
                None
            } else {
                Some(medium(r.str()?))
            }
        }
        "lora_name" => f.lora_name = if r.nil() { None } else { Some(r.str()?.into()) },
        "extra_keys" => f.extra_keys = if r.nil() { None } else { Some(extra_keys(r)?) },
        "group_idx" => f.group_idx = opt_u32(r, "group_idx")?,
        _ => r.skip()?,
    }
    Ok(())
}

fn medium(name: &str) -> Medium {
    Medium::from_engine(Some(name))
}

fn opt_u32(r: &mut Reader<'_>, field: &'static str) -> Result<Option<u32>, WireError> {
    if r.nil() {
        return Ok(None);
    }
    let v = r.uint("a non-negative integer")?;
    u32::try_from(v).map(Some).map_err(|_| WireError::Invalid {
        field,
        message: "does not fit 32 bits",
    })
}

/// A block hash: an integer (negative ones keep their bits), or bytes reduced to their low 64
/// bits read big-endian (vLLM's `int.from_bytes(h, "big") & (2**64 - 1)`).
fn hash(r: &mut Reader<'_>) -> Result<u64, WireError> {
    if r.at_int() {
        // Negative hashes keep their 64 bits (two's complement), as vLLM's signed ints do.
        return Ok(r.int()? as u64);
    }
    let bytes = r.bytes()?;
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    Ok(tail.iter().fold(0u64, |h, &b| (h << 8) | u64::from(b)))
}

fn extra_keys(r: &mut Reader<'_>) -> Result<Vec<Option<Vec<ExtraKey>>>, WireError> {
    let n = r.array_len()?;
    let mut out = reserve(r, n, min_bytes::SCALAR);
    for _ in 0..n {
        if r.nil() {
            out.push(None);
            continue;
        }
        let k = r.array_len()?;
        let mut keys = reserve(r, k, min_bytes::SCALAR);
        for _ in 0..k {
            keys.push(if r.at_str() {
                ExtraKey::Str(r.str()?.into())
            } else if r.at_int() {
                ExtraKey::Int(r.int()?)
            } else {
                r.skip()?;
                ExtraKey::Other
            });
        }
        out.push(Some(keys));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
