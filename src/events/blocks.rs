//! One endpoint's engine blocks: the engine's block hash -> the blocks of ours its tokens make,
//! and where its chain stands so a child block continues it.
//!
//! The engine's hashes are its own (vLLM: SHA-256 with a per-process seed), so we re-hash every
//! stored block's token ids with our [`BlockHasher`] in the block's namespace, continuing the
//! chain from the parent engine block's end state. When the engine's block size is not a
//! multiple of ours, an engine block ends mid-block of ours; the leftover tokens are kept with
//! it, and a block of ours that straddles engine blocks belongs to the one that completes it.
//!
//! Each engine block counts its physical copies per medium: vLLM does not de-duplicate, so the
//! same hash can be stored twice and each copy is removed on its own; our blocks leave the index
//! only when the last copy on a medium goes.

//!
//! # Memory
//!
//! An engine block is a 20-byte record in a dense paged vector ([`Pages`]), found by its engine
//! hash through a [`RecordTable`] of 4-byte record numbers kept 70% to 87.5% full (4.6 to 5.7
//! bytes a block; hashbrown's, doubling, took 5.7 to 11.4). The record holds the engine hash, the one block of
//! ours it makes when the engine's block size equals ours (vLLM on GPU: 16 and 16), and its
//! namespace, kind and copy counts packed in 32 bits. Anything else (several blocks of ours,
//! leftover tokens) spills into a side vector, once per engine block: amortised over the
//! blocks of ours it makes. Copy counts past what 32 bits pack (31 on GPU, 15 elsewhere) move
//! to a side map. The previous table (a map of 40-byte entries) cost 72 bytes an engine block.

use std::collections::HashMap;
use std::sync::Arc;

use super::wire::{BlockRemoved, BlockStored, ExtraKey};
use crate::index::{EndpointId, Medium, OwnershipIndex, Pages, RecordTable, MAX_RECORDS};
use crate::prefix::{BlockHasher, ChainState, Namespace};

const MEDIA: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Other];

fn slot(m: Medium) -> usize {
    match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::Other => 2,
    }
}

/// `value` is our one block (engine block size == ours): its hash, also the chain's end.
const ONE: u32 = 0;
/// `value` is an index into [`EngineBlocks::spills`].
const SPILL: u32 = 1;
/// The chain cannot be reproduced (multimodal or embedding keys, an unknown parent, an adapter
/// known only by id): such a block maps to none of ours, and neither do its children.
const OPAQUE: u32 = 2;

/// `meta`: namespace id (16 bits), kind (2), copies moved to the side map (1), then copies on
/// GPU (5 bits), CPU (4) and other media (4).
const KIND_SHIFT: u32 = 16;
const MANY_COPIES: u32 = 1 << 18;
const COPY_SHIFT: [u32; 3] = [19, 24, 28];
const COPY_MAX: [u32; 3] = [31, 15, 15];

/// One engine block: 20 bytes (4-byte aligned, so a vector packs them).
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct EngineBlock {
    /// The engine's hash.
    hash: u64,
    /// By kind: our block's hash, a spill index, or nothing.
    value: u64,
    meta: u32,
}

impl EngineBlock {
    // Packed fields are read by value only (a reference to one could be unaligned).
    fn hash(self) -> u64 {
        self.hash
    }

    fn value(self) -> u64 {
        self.value
    }

    fn kind(self) -> u32 {
        (self.meta >> KIND_SHIFT) & 0b11
    }

    fn ns(self) -> u16 {
        self.meta as u16
    }

    fn packed_copies(self) -> [u32; 3] {
        [0, 1, 2].map(|m| (self.meta >> COPY_SHIFT[m]) & COPY_MAX[m])
    }
}

/// What an engine block makes besides one block of ours: several (or none, with leftover
/// tokens), and where our chain stands after it.
#[derive(Debug, Default)]
struct Spill {
    /// Our chain's parent after this block: its last full block of ours, or the one before.
    end: u64,
    ours: Box<[u64]>,
    pending: Box<[u32]>,
}

/// Our blocks of one engine block.
enum Ours<'a> {
    One([u64; 1]),
    Many(&'a [u64]),
}

impl std::ops::Deref for Ours<'_> {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Ours::One(h) => h,
            Ours::Many(s) => s,
        }
    }
}

/// Where the next block of an event continues from.
#[derive(Debug)]
enum Cursor {
    /// Block 0 of a sequence.
    Root,
    /// After a known, reproducible block.
    After { ns: u16, state: ChainState },
    /// After a block we cannot reproduce.
    Opaque,
}

/// What one event changed, for the caller's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Engine blocks newly mapped to blocks of ours.
    pub(crate) mapped: u64,
    /// Engine blocks stored that map to none of ours (opaque, unknown parent, malformed).
    pub(crate) unmapped: u64,
    /// Copies removed.
    pub(crate) removed: u64,
    /// Removals of blocks (or media) we did not know.
    pub(crate) unknown_removed: u64,
}

/// Per-endpoint settings of the re-hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rehash {
    /// The model whose namespace engine blocks are hashed in (the endpoint's first model).
    pub(crate) model: Arc<str>,
    /// Our block size for that model.
    pub(crate) block_size_tokens: u32,
    /// Most (LoRA, cache salt) namespaces remembered.
    pub(crate) max_namespaces: usize,
}

/// (LoRA name, cache salt): what tells an endpoint's namespaces apart.
type NamespaceKey = (Option<Box<str>>, Option<Box<str>>);

/// The engine-block table of one endpoint.
#[derive(Debug)]
pub(crate) struct EngineBlocks {
    /// Engine hash -> index in `blocks`; keyed per process (hashes come from the engine).
    table: RecordTable,
    blocks: Pages<EngineBlock>,
    /// Most engine blocks the table holds ([`MAX_RECORDS`]; smaller in tests), far above
    /// `kv_events.max_engine_blocks`' default: past it, a new block is not tracked (its
    /// removal will count as unknown, its children as unmapped).
    limit: usize,
    spills: Vec<Spill>,
    free_spills: Vec<u32>,
    /// Exact copy counts of blocks whose counts outgrew `meta` (by engine hash).
    many_copies: HashMap<u64, [u32; 3], ahash::RandomState>,
    ns_ids: HashMap<NamespaceKey, u16>,
    hashers: Vec<BlockHasher>,
    rehash: Rehash,
}

impl EngineBlocks {
    pub(crate) fn new(rehash: Rehash) -> EngineBlocks {
        EngineBlocks {
            table: RecordTable::new(),
            blocks: Pages::default(),
            limit: MAX_RECORDS,
            spills: Vec::new(),
            free_spills: Vec::new(),
            many_copies: HashMap::default(),
            ns_ids: HashMap::new(),
            hashers: Vec::new(),
            rehash,
        }
    }

    /// Engine blocks tracked.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Heap bytes held (table, records, spills, side map, namespaces), approximately.
    pub(crate) fn heap_bytes(&self) -> usize {
        let spills: usize = self
            .spills
            .iter()
            .map(|s| s.ours.len() * 8 + s.pending.len() * 4)
            .sum();
        self.table.heap_bytes()
            + self.blocks.heap_bytes()
            + self.spills.capacity() * std::mem::size_of::<Spill>()
            + spills
            + self.free_spills.capacity() * 4
            + self.many_copies.capacity() * (8 + 12 + 1)
            + self.hashers.capacity() * std::mem::size_of::<BlockHasher>()
    }

    fn find(&self, hash: u64) -> Option<usize> {
        let blocks = &self.blocks;
        self.table
            .find(hash, |i| blocks[i as usize].hash())
            .map(|i| i as usize)
    }

    fn push(&mut self, block: EngineBlock) -> usize {
        let i = self.blocks.push(block);
        let blocks = &self.blocks;
        self.table
            .insert_unique(block.hash(), i as u32, |j| blocks[j as usize].hash());
        i
    }

    /// Drops block `i` with its spill and side counts; the last block moves into its place.
    fn remove_at(&mut self, i: usize) {
        let b = self.blocks[i];
        let hash = b.hash();
        if b.kind() == SPILL {
            self.spills[b.value() as usize] = Spill::default();
            self.free_spills.push(b.value() as u32);
        }
        if b.meta & MANY_COPIES != 0 {
            self.many_copies.remove(&hash);
        }
        self.table.remove(hash, i as u32);
        let last = self.blocks.len() - 1;
        if i != last {
            let moved = self.blocks[last].hash();
            self.table.replace(moved, last as u32, i as u32);
        }
        self.blocks.swap_remove(i);
    }

    fn ours(&self, i: usize) -> Ours<'_> {
        let b = self.blocks[i];
        match b.kind() {
            ONE => Ours::One([b.value()]),
            SPILL => Ours::Many(&self.spills[b.value() as usize].ours),
            _ => Ours::Many(&[]),
        }
    }

    fn copies(&self, i: usize) -> [u32; 3] {
        let b = self.blocks[i];
        if b.meta & MANY_COPIES != 0 {
            self.many_copies[&b.hash()]
        } else {
            b.packed_copies()
        }
    }

    fn set_copies(&mut self, i: usize, copies: [u32; 3]) {
        let b = self.blocks[i];
        let hash = b.hash();
        let mut meta = b.meta & ((1 << COPY_SHIFT[0]) - 1) & !MANY_COPIES;
        if (0..3).all(|m| copies[m] <= COPY_MAX[m]) {
            for m in 0..3 {
                meta |= copies[m] << COPY_SHIFT[m];
            }
            if b.meta & MANY_COPIES != 0 {
                self.many_copies.remove(&hash);
            }
        } else {
            meta |= MANY_COPIES;
            self.many_copies.insert(hash, copies);
        }
        self.blocks[i].meta = meta;
    }

    fn held(&self, i: usize) -> bool {
        self.copies(i).iter().any(|&c| c > 0)
    }

    /// The namespace id of (LoRA name, cache salt), creating it within the limit.
    fn namespace(&mut self, lora: Option<&str>, salt: Option<&str>) -> Option<u16> {
        let key = (lora.map(Into::into), salt.map(Into::into));
        if let Some(&id) = self.ns_ids.get(&key) {
            return Some(id);
        }
        if self.hashers.len() >= self.rehash.max_namespaces.min(usize::from(u16::MAX)) {
            return None;
        }
        let ns = Namespace::new(&self.rehash.model, lora, None).with_cache_salt(salt);
        let id = self.hashers.len() as u16;
        self.hashers
            .push(BlockHasher::new(&ns, self.rehash.block_size_tokens));
        self.ns_ids.insert(key, id);
        Some(id)
    }

    /// Applies a `BlockStored`: maps new engine blocks, counts copies, and confirms our blocks
    /// on `ev.medium` in the index.
    pub(crate) fn store(
        &mut self,
        ev: &BlockStored,
        ep: EndpointId,
        index: &OwnershipIndex,
    ) -> Applied {
        let mut applied = Applied::default();
        let m = slot(ev.medium);
        let e = ev.block_size as usize;
        let n = ev.block_hashes.len();
        // A placeholder (no tokens, block size 0) can only add a medium to known blocks.
        let has_tokens = e > 0 && ev.token_ids.len() == n.saturating_mul(e);
        let mut cursor = match ev.parent_block_hash {
            None => Cursor::Root,
            Some(p) => self.cursor_after(p),
        };
        let mut confirm: Vec<u64> = Vec::new();
        for (i, &hash) in ev.block_hashes.iter().enumerate() {
            if let Some(b) = self.find(hash) {
                // Another copy, or the same block on another medium (offloading).
                let mut copies = self.copies(b);
                copies[m] = copies[m].saturating_add(1);
                self.set_copies(b, copies);
                confirm.extend_from_slice(&self.ours(b));
                cursor = self.cursor_at(b);
                continue;
            }
            let tokens = if has_tokens {
                &ev.token_ids[i * e..(i + 1) * e]
            } else {
                &[][..]
            };
            let keys = ev
                .extra_keys
                .as_ref()
                .and_then(|k| k.get(i))
                .and_then(|k| k.as_deref())
                .unwrap_or(&[]);
            if self.blocks.len() >= self.limit {
                // No room to track it (or its children): as if its chain were unknown.
                applied.unmapped += 1;
                cursor = Cursor::Opaque;
                continue;
            }
            let root = matches!(cursor, Cursor::Root);
            let start = match (cursor, has_tokens, classify(ev, keys, root)) {
                (_, false, _) | (Cursor::Opaque, ..) | (_, _, Keys::Opaque) => None,
                (Cursor::Root, _, Keys::Plain { salt }) => self
                    .namespace(ev.lora_name.as_deref(), salt)
                    .map(|ns| (ns, self.hashers[usize::from(ns)].start())),
                (Cursor::After { ns, state }, _, Keys::Plain { salt: None }) => Some((ns, state)),
                (Cursor::After { .. }, _, Keys::Plain { salt: Some(_) }) => None,
            };
            let block = match start {
                Some((ns, mut state)) => {
                    let hasher = self.hashers[usize::from(ns)];
                    let before = confirm.len();
                    hasher.extend(&mut state, tokens, &mut confirm);
                    applied.mapped += 1;
                    let ours = &confirm[before..];
                    let one = ours.len() == 1 && state.pending.is_empty();
                    cursor = Cursor::After {
                        ns,
                        state: state.clone(),
                    };
                    let (kind, value) = if one {
                        (ONE, state.parent)
                    } else {
                        let spill = Spill {
                            end: state.parent,
                            ours: ours.into(),
                            pending: state.pending.into_boxed_slice(),
                        };
                        let at = match self.free_spills.pop() {
                            Some(at) => {
                                self.spills[at as usize] = spill;
                                at
                            }
                            None => {
                                self.spills.push(spill);
                                (self.spills.len() - 1) as u32
                            }
                        };
                        (SPILL, u64::from(at))
                    };
                    EngineBlock {
                        hash,
                        value,
                        meta: u32::from(ns) | kind << KIND_SHIFT,
                    }
                }
                None => {
                    applied.unmapped += 1;
                    cursor = Cursor::Opaque;
                    EngineBlock {
                        hash,
                        value: 0,
                        meta: OPAQUE << KIND_SHIFT,
                    }
                }
            };
            let b = self.push(block);
            let mut copies = [0; 3];
            copies[m] = 1;
            self.set_copies(b, copies);
        }
        if !confirm.is_empty() {
            // Endpoint ids come from the interner, far below the index's limit.
            let _ = index.insert_confirmed(ep, &confirm, ev.medium);
        }
        applied
    }

    fn cursor_after(&self, hash: u64) -> Cursor {
        // An unknown parent (events missed) cannot be continued.
        self.find(hash)
            .map_or(Cursor::Opaque, |b| self.cursor_at(b))
    }

    fn cursor_at(&self, i: usize) -> Cursor {
        let b = self.blocks[i];
        let (parent, pending) = match b.kind() {
            ONE => (b.value(), Vec::new()),
            SPILL => {
                let s = &self.spills[b.value() as usize];
                (s.end, s.pending.to_vec())
            }
            _ => return Cursor::Opaque,
        };
        Cursor::After {
            ns: b.ns(),
            state: ChainState {
                parent,
                pending,
                blocks: 0,
            },
        }
    }

    /// Applies a `BlockRemoved`: one copy per hash leaves `ev.medium`; our blocks leave the
    /// index when no copy is left on that medium, entirely (predictions included: the engine
    /// said so) when none is left on any.
    pub(crate) fn remove(
        &mut self,
        ev: &BlockRemoved,
        ep: EndpointId,
        index: &OwnershipIndex,
    ) -> Applied {
        let mut applied = Applied::default();
        let m = slot(ev.medium);
        for &hash in &ev.block_hashes {
            let Some(b) = self.find(hash) else {
                applied.unknown_removed += 1;
                continue;
            };
            let mut copies = self.copies(b);
            if copies[m] == 0 {
                applied.unknown_removed += 1;
                continue;
            }
            applied.removed += 1;
            copies[m] -= 1;
            self.set_copies(b, copies);
            if copies[m] > 0 {
                continue;
            }
            if self.held(b) {
                index.remove(ep, &self.ours(b), Some(ev.medium));
            } else {
                index.remove(ep, &self.ours(b), None);
                self.remove_at(b);
            }
        }
        applied
    }

    /// `AllBlocksCleared` on one medium: every copy there goes.
    pub(crate) fn clear_medium(&mut self, medium: Medium, ep: EndpointId, index: &OwnershipIndex) {
        let m = slot(medium);
        let mut gone = Vec::new();
        let mut still = Vec::new();
        let mut drop = Vec::new();
        for b in 0..self.blocks.len() {
            let mut copies = self.copies(b);
            if copies[m] == 0 {
                continue;
            }
            copies[m] = 0;
            self.set_copies(b, copies);
            if self.held(b) {
                still.extend_from_slice(&self.ours(b));
            } else {
                gone.extend_from_slice(&self.ours(b));
                drop.push(b);
            }
        }
        // Highest first: what moves into a freed place is never itself to be dropped.
        for b in drop.into_iter().rev() {
            self.remove_at(b);
        }
        index.remove(ep, &still, Some(medium));
        index.remove(ep, &gone, None);
    }

    /// Forgets every engine block (the caller clears or withdraws the index entries).
    pub(crate) fn clear(&mut self) {
        self.table.clear();
        self.blocks = Pages::default();
        self.spills = Vec::new();
        self.free_spills = Vec::new();
        self.many_copies = HashMap::default();
    }

    /// Takes our confirmed blocks out of the index, keeping the table (and live predictions):
    /// the events stopped, so what they said may go stale.
    pub(crate) fn withdraw(&self, ep: EndpointId, index: &OwnershipIndex) {
        for (medium, ours) in self.by_medium() {
            index.remove(ep, &ours, Some(medium));
        }
    }

    /// Puts every tracked block back into the index as confirmed (after a withdrawal, when the
    /// stream turned out to be intact).
    pub(crate) fn restore(&self, ep: EndpointId, index: &OwnershipIndex) {
        for (medium, ours) in self.by_medium() {
            let _ = index.insert_confirmed(ep, &ours, medium);
        }
    }

    fn by_medium(&self) -> Vec<(Medium, Vec<u64>)> {
        MEDIA
            .iter()
            .enumerate()
            .map(|(m, &medium)| {
                let mut ours = Vec::new();
                for b in 0..self.blocks.len() {
                    if self.copies(b)[m] > 0 {
                        ours.extend_from_slice(&self.ours(b));
                    }
                }
                (medium, ours)
            })
            .filter(|(_, ours)| !ours.is_empty())
            .collect()
    }
}

/// What a block's extra keys allow.
#[derive(Debug, PartialEq, Eq)]
enum Keys<'a> {
    /// Only the adapter name (which the namespace carries) and, on a sequence's first block,
    /// the cache salt.
    Plain { salt: Option<&'a str> },
    /// Anything we cannot reproduce: multimodal items, prompt embeddings, an adapter known
    /// only by its integer id.
    Opaque,
}

/// Reads a block's extra keys in vLLM's order: the LoRA name (every block of an adapter's
/// request), multimodal keys, `cache_salt` (block 0 only), prompt-embedding digests.
fn classify<'a>(ev: &BlockStored, keys: &'a [ExtraKey], root: bool) -> Keys<'a> {
    if ev.lora_name.is_none() && ev.lora_id.is_some() {
        return Keys::Opaque;
    }
    let mut rest = keys;
    if let (Some(ExtraKey::Str(first)), Some(lora)) = (rest.first(), ev.lora_name.as_deref()) {
        if **first == *lora {
            rest = &rest[1..];
        }
    }
    match rest {
        [] => Keys::Plain { salt: None },
        [ExtraKey::Str(salt)] if root => Keys::Plain { salt: Some(salt) },
        _ => Keys::Opaque,
    }
}

#[cfg(test)]
mod tests;
