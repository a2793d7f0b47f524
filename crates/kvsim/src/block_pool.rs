//! The paged KV cache's block pool, as vLLM v1's `BlockPool` + `FreeKVCacheBlockQueue`.
//!
//! - Block 0 is vLLM's null block: always allocated, never cached, never freed.
//! - Free blocks sit in a doubly-linked queue. Allocation pops the front; a freed block that
//!   holds a cached (hashed) block goes to the back, an unhashed one to the front (reused
//!   first). Callers free a request's blocks in reverse, so a chain's tail is evicted before its
//!   prefix, and older requests' blocks before newer ones (LRU).
//! - A freed cached block keeps its hash and stays findable until it is popped for reuse; then
//!   its hash is dropped and a `BlockRemoved` event queued.
//! - A cache hit on a free block `touch`es it: out of the queue, reference count up.

use ahash::AHashMap;

use super::kv_events::KvEvent;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;
const NULL_BLOCK: BlockId = 0;

#[derive(Debug, Clone, Copy)]
struct Meta {
    ref_cnt: u32,
    hash: Option<u64>,
    prev: u32,
    next: u32,
    free: bool,
}

/// Block ids holding one hash (two requests can compute the same block concurrently).
#[derive(Debug, Clone)]
enum Holders {
    One(BlockId),
    Many(Vec<BlockId>),
}

/// The GPU's KV blocks: reference counts, the free queue and the hash → block map.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Meta>,
    head: u32,
    tail: u32,
    num_free: u32,
    cached: AHashMap<u64, Holders>,
    events: Option<Vec<KvEvent>>,
}

impl BlockPool {
    /// A pool of `num_blocks` (≥ 2; block 0 is the null block), all free. Events are recorded
    /// only when `record_events`.
    pub fn new(num_blocks: u32, record_events: bool) -> BlockPool {
        let n = num_blocks.max(2);
        let mut pool = BlockPool {
            blocks: vec![
                Meta {
                    ref_cnt: 0,
                    hash: None,
                    prev: NIL,
                    next: NIL,
                    free: false,
                };
                n as usize
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: AHashMap::new(),
            events: record_events.then(Vec::new),
        };
        pool.blocks[NULL_BLOCK as usize].ref_cnt = 1;
        for id in 1..n {
            pool.push_back(id);
        }
        pool
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks in the free queue (cached-but-unused ones included).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Distinct hashes currently findable.
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// vLLM's `kv_cache_usage_perc`: `1 - free / (blocks - 1)`, in [0, 1].
    pub fn usage(&self) -> f64 {
        let usable = self.num_blocks() - 1;
        1.0 - f64::from(self.num_free) / f64::from(usable)
    }

    /// A block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        match self.cached.get(&hash)? {
            Holders::One(id) => Some(*id),
            Holders::Many(ids) => ids.first().copied(),
        }
    }

    /// Requests holding `id`.
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// Takes a reference on a (possibly free) block.
    pub fn touch(&mut self, id: BlockId) {
        if self.blocks[id as usize].free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Pops `n` blocks off the free queue into `out`, evicting their cached hashes. Returns
    /// false (and takes nothing) when fewer than `n` are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free {
            return false;
        }
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if let Some(hash) = self.blocks[id as usize].hash.take() {
                self.forget(hash, id);
                if let Some(events) = &mut self.events {
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: vec![hash],
                    });
                }
            }
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        true
    }

    /// Marks a held block as holding `hash` (findable by later lookups).
    pub fn cache(&mut self, id: BlockId, hash: u64) {
        debug_assert!(self.blocks[id as usize].hash.is_none());
        self.blocks[id as usize].hash = Some(hash);
        self.cached
            .entry(hash)
            .and_modify(|h| match h {
                Holders::One(other) => *h = Holders::Many(vec![*other, id]),
                Holders::Many(ids) => ids.push(id),
            })
            .or_insert(Holders::One(id));
    }

    /// Drops one reference on each block, in the order given; blocks reaching zero join the
    /// free queue (cached ones at the back, others at the front).
    pub fn free(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            let meta = &mut self.blocks[id as usize];
            debug_assert!(meta.ref_cnt > 0, "double free of block {id}");
            meta.ref_cnt = meta.ref_cnt.saturating_sub(1);
            if meta.ref_cnt == 0 {
                if meta.hash.is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
    }

    /// Forgets every cached hash (blocks in use keep their data but are no longer findable)
    /// and queues `AllBlocksCleared`.
    pub fn clear_cache(&mut self) {
        for meta in &mut self.blocks {
            meta.hash = None;
        }
        self.cached.clear();
        self.push_event(KvEvent::AllBlocksCleared);
    }

    /// Queues an event (dropped when events are off).
    pub fn push_event(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// True when events are recorded.
    pub fn records_events(&self) -> bool {
        self.events.is_some()
    }

    /// Takes the queued events, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn forget(&mut self, hash: u64, id: BlockId) {
        if let Some(holders) = self.cached.get_mut(&hash) {
            match holders {
                Holders::One(_) => {
                    self.cached.remove(&hash);
                }
                Holders::Many(ids) => {
                    ids.retain(|&b| b != id);
                    if ids.len() == 1 {
                        *holders = Holders::One(ids[0]);
                    }
                }
            }
        }
    }

    fn push_back(&mut self, id: BlockId) {
        let tail = self.tail;
        let meta = &mut self.blocks[id as usize];
        meta.prev = tail;
        meta.next = NIL;
        meta.free = true;
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let head = self.head;
        let meta = &mut self.blocks[id as usize];
        meta.prev = NIL;
        meta.next = head;
        meta.free = true;
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let Meta { prev, next, .. } = self.blocks[id as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let meta = &mut self.blocks[id as usize];
        meta.prev = NIL;
        meta.next = NIL;
        meta.free = false;
        self.num_free -= 1;
    }

    /// The free queue front to back (for tests and debugging).
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.blocks[id as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn alloc(pool: &mut BlockPool, n: u32) -> Vec<BlockId> {
        let mut out = Vec::new();
        assert!(pool.allocate(n, &mut out));
        out
    }

    #[test]
    fn null_block_is_reserved_and_usage_excludes_it() {
        let pool = BlockPool::new(5, false);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.free_queue(), vec![1, 2, 3, 4]);
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn reverse_free_evicts_tails_first_and_unhashed_blocks_are_reused_first() {
        let mut pool = BlockPool::new(8, true);
        let a = alloc(&mut pool, 3); // 1 2 3: two cached, one partial
        pool.cache(a[0], 100);
        pool.cache(a[1], 101);
        pool.free(a.iter().rev().copied());
        assert_eq!(pool.free_queue(), vec![3, 4, 5, 6, 7, 2, 1]);
        // Six more blocks: the partial, the never-used ones, then the chain's tail (101).
        let b = alloc(&mut pool, 6);
        assert_eq!(b, vec![3, 4, 5, 6, 7, 2]);
        assert_eq!(pool.lookup(101), None);
        assert_eq!(pool.lookup(100), Some(1));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![101]
            }]
        );
    }

    #[test]
    fn touch_takes_a_free_cached_block_out_of_the_queue() {
        let mut pool = BlockPool::new(4, false);
        let a = alloc(&mut pool, 1);
        pool.cache(a[0], 7);
        pool.free(a.clone());
        assert_eq!(pool.num_free(), 3);
        pool.touch(a[0]);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.ref_cnt(a[0]), 1);
        assert!(!pool.free_queue().contains(&a[0]));
        assert!(!pool.allocate(3, &mut Vec::new()), "only two are free");
    }

    #[test]
    fn duplicate_hashes_survive_one_eviction() {
        let mut pool = BlockPool::new(4, true);
        let a = alloc(&mut pool, 2);
        pool.cache(a[0], 9);
        pool.cache(a[1], 9);
        pool.free([a[0]]);
        alloc(&mut pool, 2); // block 3, then evicts a[0]
        assert_eq!(pool.lookup(9), Some(a[1]));
    }

    #[test]
    fn clear_cache_forgets_everything() {
        let mut pool = BlockPool::new(4, true);
        let a = alloc(&mut pool, 2);
        pool.cache(a[0], 1);
        pool.clear_cache();
        assert_eq!(pool.lookup(1), None);
        assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
        pool.free(a);
        assert_eq!(pool.num_free(), 3);
    }

    proptest! {
        /// Random allocate / cache / free / touch sequences keep the free count equal to the
        /// queue length and to the blocks with no reference.
        #[test]
        fn free_accounting_is_consistent(ops in proptest::collection::vec((0u8..4, 0u32..5), 1..200)) {
            let mut pool = BlockPool::new(12, true);
            let mut held: Vec<BlockId> = Vec::new();
            let mut next_hash = 0u64;
            for (op, arg) in ops {
                match op {
                    0 => { let _ = pool.allocate(arg, &mut held); }
                    1 => if let Some(&b) = held.last() {
                        if pool.blocks[b as usize].hash.is_none() { next_hash += 1; pool.cache(b, next_hash % 6); }
                    },
                    2 => { let n = (arg as usize).min(held.len()); let freed: Vec<_> = held.drain(..n).collect(); pool.free(freed.into_iter().rev()); }
                    _ => if let Some(b) = pool.lookup(u64::from(arg)) { pool.touch(b); held.push(b); },
                }
                let queue = pool.free_queue();
                prop_assert_eq!(queue.len() as u32, pool.num_free());
                let unreferenced = (1..pool.num_blocks()).filter(|&b| pool.ref_cnt(b) == 0).count();
                prop_assert_eq!(unreferenced, queue.len());
                for (hash, holders) in &pool.cached {
                    let ids = match holders { Holders::One(i) => vec![*i], Holders::Many(v) => v.clone() };
                    for id in ids { prop_assert_eq!(pool.blocks[id as usize].hash, Some(*hash)); }
                }
            }
        }
    }
}
