//! Cache ownership: which endpoints hold which prefix blocks.
//!
//! Keyed by our own block hashes ([`crate::prefix::BlockHasher`]), each block maps to the
//! endpoints holding it, with where the claim comes from: a **prediction** from our own routing
//! decision (expires after a TTL unless confirmed), or **confirmed** by the engine's KV events,
//! on one or more media (GPU, CPU offload...). Each endpoint has a capacity in blocks and a
//! recency order; past capacity its least recently used block is dropped (a re-insert refreshes
//! a block; the router re-inserts a request's whole prefix for the endpoint it picked, so a hit
//! refreshes). Insertion goes from the last block to the first, so an endpoint's prefix blocks
//! are more recent than their tails and tails are dropped first, as vLLM evicts.
//!
//! [`OwnershipIndex::lookup`] gives, per candidate, its longest run of held blocks from block 0,
//! walking the request's hashes only while some candidate still matches: time proportional to the
//! matched length (times the holders per block), not to the prompt or the index.
//!
//! Concurrency: the block map is split into shards, each behind a `parking_lot` read-write lock;
//! each endpoint's recency list is behind its own mutex. A lookup takes shard read locks one at a
//! time, briefly, and never an endpoint lock, so it never waits on an insert for more than one
//! shard update. Writers take the endpoint's lock, then one shard lock at a time. No lock is
//! held across an `.await` (nothing here is async). A lookup racing an insert may see part of it.
//! An insert racing [`OwnershipIndex::retire_endpoint`] adds nothing once the endpoint's state is
//! marked retired, so a freed id never keeps entries (ids are reused: [`EndpointInterner`]).
//!
//! Memory: a (block, endpoint) entry costs a 12-byte holder (inline in the block's record when
//! the block has one holder), a 16-byte recency node, and a share of the block's 24-byte record
//! and of its 5-byte table bucket (record number and control byte; a bucket per 0.44 to 0.88
//! blocks, as hashbrown doubles). So a block held by one endpoint costs 46 to 57 bytes (with the
//! record vector's spare room), each further holder about 28. [`OwnershipIndex::stats`] reports
//! the total from the allocated capacities, and `benches/index.rs` and `benches/events.rs`
//! measure it with a counting allocator (`docs/kv-events.md`, Measurements).
//!
//! Time: predictions expire on the injected [`Clock`], kept in holders as 37 bits of
//! milliseconds since the index was created. Past 4.3 years of uptime, expiry times saturate:
//! predictions made then last until evicted or removed.

mod clock;
mod holders;
mod interner;
mod lookup;
mod lru;
mod pages;
mod shard;
mod table;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

pub use clock::{Clock, ManualClock, TokioClock};
pub use interner::{EndpointInterner, IdCounts, IdLease};
pub(crate) use pages::Pages;
pub(crate) use table::{RecordTable, MAX_RECORDS};

use holders::{Holder, MAX_ENDPOINT_ID, MAX_UNTIL_MS};
use lru::EndpointLru;
use shard::{Full, Shard, Upsert};

use crate::config::CacheIndexConfig;

/// A small dense endpoint id, from [`EndpointInterner`]. At most 2^24 - 1. Reused for another
/// address once the endpoint is gone for good (see [`IdLease`]).
pub type EndpointId = u32;

/// Where a block's KV lives on an endpoint, as the engine reports it (`medium` in vLLM's KV
/// events). Faster media should weigh more in a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Accelerator memory (vLLM's `"GPU"`, and the default when the event gives none).
    Gpu,
    /// Host memory offload (`"CPU"`).
    Cpu,
    /// Anything slower (disk, remote), by any other name.
    Other,
}

impl Medium {
    /// Parses an engine's medium name (case-insensitive); `None` is GPU.
    pub fn from_engine(name: Option<&str>) -> Medium {
        match name {
            None => Medium::Gpu,
            Some(n) if n.eq_ignore_ascii_case("gpu") || n.eq_ignore_ascii_case("cuda") => {
                Medium::Gpu
            }
            Some(n) if n.eq_ignore_ascii_case("cpu") => Medium::Cpu,
            Some(_) => Medium::Other,
        }
    }

    pub(crate) fn bit(self) -> u8 {
        match self {
            Medium::Gpu => 1,
            Medium::Cpu => 2,
            Medium::Other => 4,
        }
    }
}

/// What one candidate holds of a request's prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Consecutive blocks held from block 0 (multiply by the block size for tokens).
    pub blocks: u32,
    /// Of those, blocks the engine's events confirmed (the rest are live predictions).
    pub confirmed_blocks: u32,
    /// Of the confirmed, blocks held only on a medium slower than GPU.
    pub offloaded_blocks: u32,
    /// Of the offloaded, blocks held in CPU memory (the rest are only on slower media: disk,
    /// a remote store).
    pub cpu_blocks: u32,
}

impl PrefixMatch {
    /// Blocks matched only by our own (unexpired) predictions.
    pub fn predicted_blocks(&self) -> u32 {
        self.blocks - self.confirmed_blocks
    }
}

/// Index settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexOptions {
    /// Capacity of an endpoint whose own is not set, in blocks. Default 31250.
    pub default_capacity_blocks: usize,
    /// How long a prediction counts unless confirmed. Default 120 s.
    pub prediction_ttl: Duration,
    /// Shards of the block map (rounded up to a power of two, at most [`MAX_SHARDS`]). Each
    /// holds at most 2^24 blocks (fewer past 256 shards: 2^32 / shards). Default 64.
    pub shards: usize,
}

impl Default for IndexOptions {
    fn default() -> Self {
        IndexOptions::from(&CacheIndexConfig::default())
    }
}

impl From<&CacheIndexConfig> for IndexOptions {
    fn from(c: &CacheIndexConfig) -> Self {
        IndexOptions {
            default_capacity_blocks: usize::try_from(c.default_capacity_blocks)
                .unwrap_or(usize::MAX),
            prediction_ttl: Duration::from_millis(c.prediction_ttl_ms),
            shards: 64,
        }
    }
}

/// Entries and capacity of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointStats {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Blocks held (including predictions that expired but were not yet evicted).
    pub blocks: usize,
    /// Of those, blocks confirmed by engine events.
    pub confirmed_blocks: usize,
    /// Its capacity in blocks.
    pub capacity_blocks: usize,
    /// Blocks of routed requests not yet prefilled there, held beyond the capacity
    /// ([`PendingBlocks`]).
    pub pending_blocks: usize,
    /// Blocks pinned by routed requests that have not ended ([`PendingBlocks`]): not evicted
    /// until they do. At most the capacity.
    pub pinned_blocks: usize,
}

/// A snapshot of the index's size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block hashes.
    pub blocks: usize,
    /// (block, endpoint) entries.
    pub entries: usize,
    /// Per endpoint that ever held a block.
    pub endpoints: Vec<EndpointStats>,
    /// Heap bytes of the block map and recency lists, from allocated capacities.
    pub heap_bytes: usize,
}

/// The blocks a routed request added to its pick before the engine there began its prefill
/// ([`OwnershipIndex::insert_routed`]): held beyond the endpoint's capacity until
/// [`Self::prefilled`] (or the drop).
///
/// The index learns of a prefix when the request is routed, but the engine stores it only when
/// it prefills the request: under load seconds later, behind the queue. Until then the blocks
/// new to the endpoint take no engine memory and push nothing out of it, so its capacity
/// stretches by them (up to twice the capacity). Counted against the capacity from the
/// decision on, the index ran ahead of the engine by the queue: with 57k-100k prompt tokens
/// queued on replicas with room for 400k it dropped prefixes their engines still held, and the
/// policy sent their next requests to another replica to recompute them (issue 13's eviction
/// workload, docs/bench/tuning-2026-12-03/). Once prefilled the blocks count, and the least recently
/// used blocks past the capacity go, as the engine's do when it allocates the prompt. Nothing
/// happens once the endpoint was cleared or retired since the decision.
///
/// The claim also pins the prompt's blocks there until it is dropped (the request's end): an
/// engine cannot evict a running request's blocks, and frees them, most recent, when it ends.
/// Aged from the decision instead, a prefix whose request decoded for a minute under load left
/// the index while its engine still held it (the same workload: at 60-75 s since a group's
/// previous request, the index had moved on where the engine still held it). All of a prompt's
/// blocks are pinned, or none (when that would pin more than the capacity).
pub struct PendingBlocks {
    index: Arc<OwnershipIndex>,
    state: Arc<Mutex<EndpointLru>>,
    endpoint: EndpointId,
    /// The list's generation at the decision: a clear since ends the claim.
    generation: u64,
    /// Blocks held beyond the capacity (0 once prefilled).
    blocks: usize,
    /// Each block pinned, last block first; empty once released.
    pins: Vec<lru::Pin>,
}

impl PendingBlocks {
    /// Blocks held beyond the endpoint's capacity until the prefill is done.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The request's prefill is done (its first byte came, or was due): its blocks count
    /// against the capacity from now on. Idempotent.
    pub fn prefilled(&mut self) {
        if self.blocks > 0 {
            self.index.settle(self);
            self.blocks = 0;
        }
    }

    /// Blocks pinned (0 once released).
    pub fn pinned(&self) -> usize {
        self.pins.len()
    }

    /// The request is over there (it ended, or another endpoint served it): prefilled if it
    /// was not, and its blocks unpinned, most recent, the prompt's first block ahead (as an
    /// engine frees them). Idempotent.
    pub fn release(&mut self) {
        self.prefilled();
        if !self.pins.is_empty() {
            self.index.unpin(self);
            self.pins = Vec::new();
        }
    }
}

impl std::fmt::Debug for PendingBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingBlocks")
            .field("endpoint", &self.endpoint)
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl Drop for PendingBlocks {
    fn drop(&mut self) {
        self.release();
    }
}

/// A holder update that predicts the block held until `until_ms` (or longer, if it already was).
fn predicted_until(until_ms: u64) -> impl Fn(&mut Holder) {
    move |h| h.set_predicted_until_ms(h.predicted_until_ms().max(until_ms))
}

/// Why an index call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The endpoint id does not fit an entry (more than 2^24 - 1 endpoints were interned).
    #[error("endpoint id {0} is out of range (max {MAX_ENDPOINT_ID})")]
    EndpointOutOfRange(EndpointId),
}

/// Most shards of the block map: a recency node names a block by its shard and record number
/// in 32 bits.
pub const MAX_SHARDS: usize = 1 << 10;

/// Block hash -> endpoints, with per-endpoint capacity, LRU eviction and prediction expiry.
#[derive(Debug)]
pub struct OwnershipIndex {
    shards: Box<[RwLock<Shard>]>,
    shard_mask: usize,
    /// Low bits of a recency node's record that number the record in its shard (the high
    /// ones name the shard).
    record_bits: u32,
    /// The clock's reading at creation: expiry times are kept relative to it.
    epoch_ms: u64,
    endpoints: RwLock<Vec<Option<Arc<Mutex<EndpointLru>>>>>,
    options: IndexOptions,
    clock: Arc<dyn Clock>,
}

impl OwnershipIndex {
    /// An empty index.
    pub fn new(options: IndexOptions, clock: Arc<dyn Clock>) -> OwnershipIndex {
        let n = options.shards.clamp(1, MAX_SHARDS).next_power_of_two();
        let record_bits = (32 - n.trailing_zeros()).min(24);
        OwnershipIndex {
            shards: (0..n)
                .map(|_| RwLock::new(Shard::new(1 << record_bits)))
                .collect(),
            shard_mask: n - 1,
            record_bits,
            epoch_ms: clock.now_ms(),
            endpoints: RwLock::new(Vec::new()),
            options,
            clock,
        }
    }

    /// The settings in force.
    pub fn options(&self) -> &IndexOptions {
        &self.options
    }

    /// Now, as holders keep time: ms since creation, below the saturated expiry.
    fn now_ms(&self) -> u64 {
        self.clock
            .now_ms()
            .saturating_sub(self.epoch_ms)
            .min(MAX_UNTIL_MS - 1)
    }

    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[self.shard_of(hash)]
    }

    fn shard_of(&self, hash: u64) -> usize {
        // Block hashes are uniform, so their low bits spread shards evenly.
        (hash as usize) & self.shard_mask
    }

    /// A block's name in recency nodes: its shard and its record there.
    fn record_name(&self, shard: usize, record: u32) -> u32 {
        (shard as u32) << self.record_bits | record
    }

    /// The shard and record of a block named by [`Self::record_name`].
    fn named(&self, name: u32) -> (&RwLock<Shard>, u32) {
        let shard = (name >> self.record_bits) as usize;
        (&self.shards[shard], name & ((1 << self.record_bits) - 1))
    }

    fn endpoint(&self, endpoint: EndpointId) -> Option<Arc<Mutex<EndpointLru>>> {
        self.endpoints
            .read()
            .get(endpoint as usize)
            .and_then(|e| e.clone())
    }

    fn endpoint_or_create(
        &self,
        endpoint: EndpointId,
    ) -> Result<Arc<Mutex<EndpointLru>>, IndexError> {
        if endpoint > MAX_ENDPOINT_ID {
            return Err(IndexError::EndpointOutOfRange(endpoint));
        }
        if let Some(e) = self.endpoint(endpoint) {
            return Ok(e);
        }
        let mut all = self.endpoints.write();
        let i = endpoint as usize;
        if all.len() <= i {
            all.resize(i + 1, None);
        }
        Ok(Arc::clone(all[i].get_or_insert_with(|| {
            Arc::new(Mutex::new(EndpointLru::new(
                self.options.default_capacity_blocks,
            )))
        })))
    }

    /// Records that `endpoint` will hold `hashes` (a request's prefix, in order) because we just
    /// routed there; the claim lasts the configured prediction TTL unless events confirm it.
    pub fn insert_predicted(&self, endpoint: EndpointId, hashes: &[u64]) -> Result<(), IndexError> {
        self.insert_predicted_for(endpoint, hashes, self.options.prediction_ttl)
    }

    /// As [`Self::insert_predicted`] with an explicit TTL (e.g. a short one while the endpoint's
    /// KV events flow and will confirm the blocks).
    pub fn insert_predicted_for(
        &self,
        endpoint: EndpointId,
        hashes: &[u64],
        ttl: Duration,
    ) -> Result<(), IndexError> {
        self.insert(endpoint, hashes, predicted_until(self.until_ms(ttl)))
    }

    /// Records that the engine confirmed `endpoint` holds `hashes` (ours, re-hashed from its
    /// `BlockStored` event, in order) on `medium`. Confirmed blocks do not expire.
    pub fn insert_confirmed(
        &self,
        endpoint: EndpointId,
        hashes: &[u64],
        medium: Medium,
    ) -> Result<(), IndexError> {
        self.insert(endpoint, hashes, |h| h.set_media(h.media() | medium.bit()))
    }

    /// As [`Self::insert_predicted`] for a request routed to `endpoint` whose prefill has not
    /// begun there: the blocks new to the endpoint are [`PendingBlocks`] until the returned
    /// claim is prefilled or dropped.
    pub fn insert_routed(
        self: &Arc<Self>,
        endpoint: EndpointId,
        hashes: &[u64],
    ) -> Result<PendingBlocks, IndexError> {
        let state = self.endpoint_or_create(endpoint)?;
        let until = predicted_until(self.until_ms(self.options.prediction_ttl));
        let mut pins = Vec::new();
        let (blocks, generation) =
            self.insert_into(&state, endpoint, hashes, Some(&mut pins), until);
        Ok(PendingBlocks {
            index: Arc::clone(self),
            state,
            endpoint,
            generation,
            blocks,
            pins,
        })
    }

    fn until_ms(&self, ttl: Duration) -> u64 {
        self.now_ms()
            .saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
    }

    fn insert(
        &self,
        endpoint: EndpointId,
        hashes: &[u64],
        update: impl Fn(&mut Holder),
    ) -> Result<(), IndexError> {
        let state = self.endpoint_or_create(endpoint)?;
        self.insert_into(&state, endpoint, hashes, None, update);
        Ok(())
    }

    /// [`Self::insert`] into `state`, looked up earlier (maybe before a retirement). With
    /// `routed` (a routed request's claim), the blocks added count as pending and every block is
    /// pinned, its pin pushed there, if all fit ([`EndpointLru::can_pin`]). Returns
    /// how many counted as pending, and the list's generation.
    fn insert_into(
        &self,
        state: &Mutex<EndpointLru>,
        endpoint: EndpointId,
        hashes: &[u64],
        routed: Option<&mut Vec<lru::Pin>>,
        update: impl Fn(&mut Holder),
    ) -> (usize, u64) {
        let mut lru = state.lock();
        if lru.retired {
            // Retired since we looked it up: nothing may be added under an id that is free.
            return (0, lru.generation);
        }
        let pending = routed.is_some();
        let mut pins = routed.filter(|_| lru.can_pin(hashes.len()));
        if let Some(pins) = pins.as_deref_mut() {
            pins.reserve_exact(hashes.len());
        }
        let mut counted = 0;
        let now = self.now_ms();
        // Last block first: the prefix ends up most recent, so tails are evicted first.
        for &hash in hashes.iter().rev() {
            let slot = {
                let s = self.shard_of(hash);
                let mut shard = self.shards[s].write();
                let mut reserved = None;
                let new = || Holder::new(endpoint, *reserved.insert(lru.reserve()));
                match shard.upsert(hash, endpoint, now, &update, new) {
                    Ok(Upsert::Updated { was, is }) => {
                        lru.confirmed += usize::from(!was.confirmed() && is.confirmed());
                        lru.touch(is.slot);
                        Some(is.slot)
                    }
                    Ok(Upsert::Added { record, holder }) => {
                        lru.link_front(holder.slot, self.record_name(s, record));
                        lru.confirmed += usize::from(holder.confirmed());
                        counted += usize::from(pending && lru.add_pending());
                        Some(holder.slot)
                    }
                    // The shard holds all the blocks it can name: this one is not kept.
                    Err(Full) => {
                        if let Some(slot) = reserved {
                            lru.release(slot);
                        }
                        None
                    }
                }
            };
            if let (Some(slot), Some(pins)) = (slot, pins.as_deref_mut()) {
                if let Some(pin) = lru.pin(slot) {
                    pins.push(pin);
                }
            }
            while lru.over_capacity() && self.evict_lru(endpoint, &mut lru, now) {}
        }
        (counted, lru.generation)
    }

    /// Ends a pending claim: its blocks count against the capacity, and the least recently
    /// used blocks past it go. Nothing if the endpoint was cleared or retired since.
    fn settle(&self, claim: &PendingBlocks) {
        let mut lru = claim.state.lock();
        if lru.retired || lru.generation != claim.generation {
            return;
        }
        lru.pending = lru.pending.saturating_sub(claim.blocks);
        let now = self.now_ms();
        while lru.over_capacity() && self.evict_lru(claim.endpoint, &mut lru, now) {}
    }

    /// Takes back a claim's pins, in the order taken (last block first, so the prompt's first
    /// block ends up most recent). Nothing if the endpoint was cleared or retired since.
    fn unpin(&self, claim: &PendingBlocks) {
        let mut lru = claim.state.lock();
        if lru.retired || lru.generation != claim.generation {
            return;
        }
        for &pin in &claim.pins {
            lru.unpin(pin);
        }
        // Over the capacity only if the pins kept it there (a capacity lowered meanwhile).
        let now = self.now_ms();
        while lru.over_capacity() && self.evict_lru(claim.endpoint, &mut lru, now) {}
    }

    /// Drops the endpoint's least recently used unpinned block (the caller holds its lock);
    /// whether there was one.
    fn evict_lru(&self, endpoint: EndpointId, lru: &mut EndpointLru, now: u64) -> bool {
        let Some((slot, name)) = lru.lru() else {
            return false;
        };
        lru.remove(slot);
        let (shard, record) = self.named(name);
        if let Some(h) = shard.write().remove_at(record, endpoint, now) {
            lru.confirmed -= usize::from(h.confirmed());
        }
        true
    }

    /// Removes `hashes` from `endpoint` (the engine's `BlockRemoved`, re-mapped to our hashes).
    /// With a `medium`, only that medium's copy goes; the block stays while another medium (or
    /// an unexpired prediction made since) holds it. Without, the block goes entirely.
    pub fn remove(&self, endpoint: EndpointId, hashes: &[u64], medium: Option<Medium>) {
        let Some(state) = self.endpoint(endpoint) else {
            return;
        };
        let mut lru = state.lock();
        let now = self.now_ms();
        for &hash in hashes {
            let mut shard = self.shard(hash).write();
            let keep = match medium {
                Some(m) => {
                    let strip = |h: &mut Holder| h.set_media(h.media() & !m.bit());
                    let Some((was, is)) = shard.update(hash, endpoint, now, strip) else {
                        continue;
                    };
                    lru.confirmed -= usize::from(was.confirmed() && !is.confirmed());
                    is.live(now)
                }
                None => false,
            };
            if !keep {
                if let Some(h) = shard.remove(hash, endpoint, now) {
                    lru.confirmed -= usize::from(h.confirmed());
                    lru.remove(h.slot);
                }
            }
        }
    }

    /// Drops everything `endpoint` holds (removed, restarted, its events lost or cleared). Its
    /// capacity setting is kept.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        let Some(state) = self.endpoint(endpoint) else {
            return;
        };
        let mut lru = state.lock();
        let now = self.now_ms();
        for (_, name) in lru.iter() {
            let (shard, record) = self.named(name);
            shard.write().remove_at(record, endpoint, now);
        }
        lru.clear();
    }

    /// Forgets `endpoint` entirely so its id can be given to another address: drops its
    /// entries, frees its recency list and forgets its capacity setting. A writer racing the
    /// retirement with the endpoint's state looked up before it adds nothing; a later writer
    /// starts a fresh state, as for a new endpoint (the caller, [`EndpointInterner::reclaim`],
    /// retires only ids nothing can write for any more).
    pub fn retire_endpoint(&self, endpoint: EndpointId) {
        let state = {
            let mut all = self.endpoints.write();
            let state = all.get_mut(endpoint as usize).and_then(Option::take);
            // Keep the table as short as the highest id in use.
            while matches!(all.last(), Some(None)) {
                all.pop();
            }
            state
        };
        let Some(state) = state else {
            return;
        };
        let mut lru = state.lock();
        let now = self.now_ms();
        for (_, name) in lru.iter() {
            let (shard, record) = self.named(name);
            shard.write().remove_at(record, endpoint, now);
        }
        lru.retire();
    }

    /// Sets `endpoint`'s capacity in blocks (e.g. from its `vllm:cache_config_info`, converted to
    /// our block size), evicting its least recently used blocks past it.
    pub fn set_capacity(&self, endpoint: EndpointId, blocks: usize) -> Result<(), IndexError> {
        let state = self.endpoint_or_create(endpoint)?;
        let mut lru = state.lock();
        if lru.retired {
            return Ok(());
        }
        lru.capacity = blocks;
        let now = self.now_ms();
        while lru.over_capacity() && self.evict_lru(endpoint, &mut lru, now) {}
        Ok(())
    }

    /// Sizes and memory.
    pub fn stats(&self) -> IndexStats {
        let mut stats = IndexStats::default();
        for shard in self.shards.iter() {
            let shard = shard.read();
            stats.blocks += shard.len();
            stats.entries += shard.entries();
            stats.heap_bytes += shard.heap_bytes();
        }
        let endpoints = self.endpoints.read().clone();
        stats.heap_bytes += endpoints.capacity() * std::mem::size_of::<usize>();
        for (id, state) in endpoints.iter().enumerate() {
            let Some(state) = state else { continue };
            let lru = state.lock();
            stats.heap_bytes += lru.heap_bytes();
            stats.endpoints.push(EndpointStats {
                endpoint: id as EndpointId,
                blocks: lru.len(),
                confirmed_blocks: lru.confirmed,
                capacity_blocks: lru.capacity,
                pending_blocks: lru.pending,
                pinned_blocks: lru.pinned,
            });
        }
        stats
    }
}

#[cfg(test)]
mod tests;
