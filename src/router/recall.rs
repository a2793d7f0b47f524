//! [`Recall`]: where each prompt prefix was last routed, kept after the engine has evicted it.
//!
//! The ownership index forgets a prefix as soon as an engine's KV events say it was evicted.
//! On a working set larger than the fleet's KV, every group's prefix is evicted now and then;
//! with nothing held anywhere its next request goes wherever the cost is lowest, and a group
//! that wanders leaves partial copies behind on every replica it passed (issue 13's eviction
//! cell: 109-135 moves per run with events against 0 for SGLang's tree, which never forgets).
//! This table remembers the last endpoint each prefix went to, so `predicted-ttft` can charge
//! sending a group away from the home it lost its blocks on (`recall_weight`).
//!
//! Only sampled depths are kept: the prompt's blocks 1, 2, 4, 8, ... and its last block (about
//! `log2(blocks) + 1` keys per request), each key the chained block hash (unique per model,
//! adapter and salt). A lookup returns the deepest sampled block found, so a group's shared
//! system prompt is found from any of its users' prompts. Bounded: two generations of at most
//! [`GENERATION_KEYS`] keys; when the current one fills it becomes the previous one and the
//! oldest generation is dropped (an approximate LRU; not the token cache's `lru::LruCache`, which
//! allocates a node per key: ten per decision here). A key names an endpoint id; an id freed
//! and reused by another address after [`super::tables::ID_REUSE_GRACE_MS`] may inherit a
//! departed endpoint's homes, which costs a little stickiness and nothing else.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::index::EndpointId;

/// Keys per generation (all shards together); two generations are kept.
pub(crate) const GENERATION_KEYS: usize = 1 << 18;

/// Shards of the table (a power of two): decisions of different prefixes rarely meet.
const SHARDS: usize = 16;

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<u64, EndpointId, ahash::RandomState>,
    previous: HashMap<u64, EndpointId, ahash::RandomState>,
}

impl Generations {
    fn get(&self, key: u64) -> Option<EndpointId> {
        self.current
            .get(&key)
            .or_else(|| self.previous.get(&key))
            .copied()
    }
}

/// Where each (sampled) prefix was last routed.
#[derive(Debug)]
pub(crate) struct Recall {
    shards: Box<[Mutex<Generations>]>,
    per_shard: usize,
}

impl Default for Recall {
    fn default() -> Self {
        Recall::with_capacity(GENERATION_KEYS)
    }
}

/// The sampled block positions of a prompt of `blocks` blocks, deepest first: its last block,
/// then blocks 2^k - 1 (0-based) below it.
fn sampled(blocks: usize) -> impl Iterator<Item = usize> {
    let last = blocks.checked_sub(1);
    let below = last.map_or(0, |l| usize::BITS - l.leading_zeros());
    let powers = (0..below)
        .rev()
        .map(|k| (1usize << k) - 1)
        .filter(move |&i| Some(i) != last);
    last.into_iter().chain(powers)
}

impl Recall {
    /// A table of at most `generation_keys` keys per generation.
    pub(crate) fn with_capacity(generation_keys: usize) -> Recall {
        Recall {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: (generation_keys / SHARDS).max(1),
        }
    }

    fn shard(&self, key: u64) -> &Mutex<Generations> {
        // The keys are hashes already; the top bits pick the shard, the map hashes again.
        &self.shards[(key >> 60) as usize % SHARDS]
    }

    /// Records that the prompt with these chained block `hashes` was routed to `endpoint`.
    pub(crate) fn record(&self, hashes: &[u64], endpoint: EndpointId) {
        for i in sampled(hashes.len()) {
            let key = hashes[i];
            let mut shard = self.shard(key).lock();
            if shard.current.len() >= self.per_shard && !shard.current.contains_key(&key) {
                shard.previous = std::mem::take(&mut shard.current);
            }
            shard.current.insert(key, endpoint);
        }
    }

    /// The endpoint the deepest recorded prefix of `hashes` was last routed to, with that
    /// prefix's length in blocks.
    pub(crate) fn recall(&self, hashes: &[u64]) -> Option<(EndpointId, usize)> {
        sampled(hashes.len()).find_map(|i| {
            let key = hashes[i];
            self.shard(key).lock().get(key).map(|ep| (ep, i + 1))
        })
    }

    /// Keys held, both generations.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock();
                s.current.len() + s.previous.len()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_the_last_block_and_the_powers_of_two_below_it() {
        let s = |n| sampled(n).collect::<Vec<_>>();
        assert_eq!(s(0), Vec::<usize>::new());
        assert_eq!(s(1), vec![0]);
        assert_eq!(s(2), vec![1, 0]);
        assert_eq!(s(4), vec![3, 1, 0]);
        assert_eq!(s(5), vec![4, 3, 1, 0]);
        assert_eq!(s(8), vec![7, 3, 1, 0]);
        assert_eq!(s(9), vec![8, 7, 3, 1, 0]);
        assert_eq!(s(375), vec![374, 255, 127, 63, 31, 15, 7, 3, 1, 0]);
    }

    #[test]
    fn a_group_is_recalled_from_any_prompt_that_shares_its_prefix() {
        let recall = Recall::default();
        // A 40-block system prompt shared by the group, then each user's question.
        let system: Vec<u64> = (1..=40).collect();
        let user = |q: u64| {
            let mut h = system.clone();
            h.extend((0..8).map(|i| 1000 * q + i));
            h
        };
        recall.record(&user(1), 3);
        // Another user's prompt: its own blocks are new, block 31 (the 32nd) is the group's.
        assert_eq!(recall.recall(&user(2)), Some((3, 32)));
        // The same user again: the whole prompt.
        assert_eq!(recall.recall(&user(1)), Some((3, 48)));
        // The group moves: the last routing wins.
        recall.record(&user(2), 5);
        assert_eq!(recall.recall(&user(7)), Some((5, 32)));
        // Unrelated prompts recall nothing.
        assert_eq!(recall.recall(&[70_000, 70_001, 70_002]), None);
        assert_eq!(recall.recall(&[]), None);
    }

    #[test]
    fn the_table_keeps_two_generations_at_most() {
        let recall = Recall::with_capacity(SHARDS * 4);
        for p in 0..1000u64 {
            // One-block prompts spread over the shards by their top bits.
            recall.record(&[p.rotate_right(4) | 1], 1);
        }
        assert!(recall.len() <= 2 * SHARDS * 4, "{}", recall.len());
        // The newest are still there.
        assert_eq!(recall.recall(&[999u64.rotate_right(4) | 1]), Some((1, 1)));
    }
}
