//! The CPU offload tier, as vLLM's `OffloadingConnector` with its CPU backend keeps it
//! (`vllm/v1/kv_offload`: an LRU `OffloadingManager` on the scheduler side, asynchronous DMA
//! on the workers):
//!
//! - **Write-through**: every full block a request computes (prompt and output) is stored to
//!   CPU memory once the step that computed it ends, unless the tier already holds its hash (then
//!   it only becomes the most recent). So the tier holds copies of GPU blocks too, and a block
//!   evicted from the GPU stays loadable while the tier keeps it.
//! - **LRU** over the tier's `num_blocks`; blocks being loaded are pinned and never evicted.
//!   Lookups touch what they find.
//! - **Loads**: a waiting request looks up the GPU prefix cache, then the tier for the
//!   consecutive blocks after the GPU hit (within vLLM's `num_tokens - 1` cap). A tier hit gets
//!   its GPU blocks allocated and waits (vLLM's `WAITING_FOR_REMOTE_KVS`) without holding up
//!   the queue behind it, for `latency + blocks x block load time`; loads go one at a time over
//!   the host link (a second waits for the first), and cost the GPU nothing. When the load
//!   ends, the blocks are cached on the GPU (`BlockStored` with medium `GPU`) and the request
//!   is scheduled with them computed.
//! - **Events** (medium `CPU`): `BlockStored` when a block reaches the tier, `BlockRemoved` when
//!   the tier evicts it. By default as vLLM sends them without `self_describing_kv_events`: a
//!   placeholder with the hashes only (no tokens, no parent, block size 0); with it, the full
//!   payload of the GPU event.
//!
//! Not modelled: the store's own transfer time (stores are asynchronous and the blocks stay
//! on the GPU meanwhile), vLLM's offloaded block size larger than the GPU's (one GPU block
//! per tier block here), reuse-frequency gating of stores, storage tiers below CPU memory.

use std::collections::BTreeMap;
use std::time::Duration;

use ahash::AHashMap;
use tokio::time::Instant;

/// How a replica's CPU tier is sized and how fast it loads, in real time (the time scale
/// applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadConfig {
    /// Blocks the tier holds.
    pub num_blocks: u32,
    /// Time to load one block into GPU memory, real time.
    pub block_load: Duration,
    /// Fixed time a load adds, real time.
    pub latency: Duration,
    /// Bytes of KV one block holds (for the transfer metrics).
    pub block_bytes: u64,
    /// Events carry the full payload (vLLM's `self_describing_kv_events`), else placeholders.
    pub self_describing: bool,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Recency stamp (a key of [`CpuTier::order`]).
    stamp: u64,
    /// Loads in progress that read it.
    pins: u32,
}

/// The blocks held in CPU memory, by hash, with their recency.
#[derive(Debug)]
pub struct CpuTier {
    config: OffloadConfig,
    blocks: AHashMap<u64, Entry>,
    /// Stamp -> hash, oldest first.
    order: BTreeMap<u64, u64>,
    next_stamp: u64,
    /// When the host link is free for the next load.
    link_free_at: Option<Instant>,
}

/// What a store did: hashes newly held, hashes evicted for them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// Newly in the tier, in the order given.
    pub stored: Vec<u64>,
    /// Evicted to make room, oldest first.
    pub evicted: Vec<u64>,
}

impl CpuTier {
    /// An empty tier.
    pub fn new(config: OffloadConfig) -> CpuTier {
        CpuTier {
            config,
            blocks: AHashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
            link_free_at: None,
        }
    }

    /// Its sizes and speeds.
    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether it holds `hash`.
    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    fn touch(&mut self, hash: u64) {
        let stamp = self.next_stamp;
        if let Some(e) = self.blocks.get_mut(&hash) {
            self.order.remove(&e.stamp);
            e.stamp = stamp;
            self.order.insert(stamp, hash);
            self.next_stamp += 1;
        }
    }

    /// How many of `hashes`, from the first, it holds (touching them, as vLLM's lookup does).
    pub fn lookup(&mut self, hashes: &[u64]) -> usize {
        let n = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        for &h in &hashes[..n] {
            self.touch(h);
        }
        n
    }

    /// Stores `hashes` (the blocks a step just completed): held ones become most recent,
    /// others are added, evicting the least recently used unpinned blocks; a block that finds
    /// no room (everything pinned) is not stored.
    pub fn store(&mut self, hashes: &[u64]) -> Stored {
        let mut out = Stored::default();
        for &h in hashes {
            if self.blocks.contains_key(&h) {
                self.touch(h);
                continue;
            }
            if self.blocks.len() >= self.config.num_blocks as usize {
                let victim = self
                    .order
                    .iter()
                    .find(|(_, v)| self.blocks[*v].pins == 0)
                    .map(|(&s, &v)| (s, v));
                let Some((stamp, victim)) = victim else {
                    continue;
                };
                self.order.remove(&stamp);
                self.blocks.remove(&victim);
                out.evicted.push(victim);
            }
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            self.blocks.insert(h, Entry { stamp, pins: 0 });
            self.order.insert(stamp, h);
            out.stored.push(h);
        }
        out
    }

    /// Starts loading `hashes` (held) at `now`: pins them and returns when the load ends, after
    /// any load already on the link.
    pub fn begin_load(&mut self, hashes: &[u64], now: Instant) -> Instant {
        for h in hashes {
            if let Some(e) = self.blocks.get_mut(h) {
                e.pins += 1;
            }
        }
        let start = self.link_free_at.filter(|&t| t > now).unwrap_or(now);
        let end = start + self.config.latency + self.config.block_load * hashes.len() as u32;
        self.link_free_at = Some(end);
        end
    }

    /// A load of `hashes` ended (or its request left): unpins them.
    pub fn end_load(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(e) = self.blocks.get_mut(h) {
                e.pins = e.pins.saturating_sub(1);
            }
        }
    }

    /// Forgets everything (a cache reset).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
        self.link_free_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(num_blocks: u32) -> CpuTier {
        CpuTier::new(OffloadConfig {
            num_blocks,
            block_load: Duration::from_millis(2),
            latency: Duration::from_millis(1),
            block_bytes: 1 << 21,
            self_describing: false,
        })
    }

    #[test]
    fn lru_evicts_the_oldest_and_a_lookup_or_a_repeat_store_refreshes() {
        let mut t = tier(3);
        assert_eq!(t.store(&[1, 2, 3]).stored, vec![1, 2, 3]);
        // A repeat store stores nothing new and refreshes 1.
        assert_eq!(t.store(&[1]), Stored::default());
        let s = t.store(&[4]);
        assert_eq!((s.stored, s.evicted), (vec![4], vec![2]));
        // Lookups count from the first block and refresh what they find.
        assert_eq!(t.lookup(&[3, 4, 2, 1]), 2);
        assert_eq!(t.store(&[5]).evicted, vec![1]);
        assert_eq!(t.lookup(&[3, 4, 5]), 3);
        assert_eq!(t.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn loads_pin_their_blocks_and_queue_on_the_link() {
        let mut t = tier(2);
        t.store(&[1, 2]);
        let now = Instant::now();
        let first = t.begin_load(&[1], now);
        assert_eq!(first - now, Duration::from_millis(3));
        // A second load starts when the first ends.
        let second = t.begin_load(&[2], now);
        assert_eq!(second - now, Duration::from_millis(6));
        // Both pinned: a store finds no room and is dropped.
        assert_eq!(t.store(&[3]), Stored::default());
        t.end_load(&[1]);
        assert_eq!(t.store(&[3]).evicted, vec![1]);
        assert!(t.contains(2) && t.contains(3));
        // The link is free again later.
        assert_eq!(
            t.begin_load(&[3], second) - second,
            Duration::from_millis(3)
        );
        t.clear();
        assert!(t.is_empty());
    }
}
