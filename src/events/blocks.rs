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

use std::collections::HashMap;
use std::sync::Arc;

use super::wire::{BlockRemoved, BlockStored, ExtraKey};
use crate::index::{EndpointId, Medium, OwnershipIndex};
use crate::prefix::{BlockHasher, ChainState, Namespace};

const MEDIA: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Other];

fn slot(m: Medium) -> usize {
    match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::Other => 2,
    }
}

/// The chain cannot be reproduced (multimodal or embedding keys, an unknown parent, an adapter
/// known only by id): such a block maps to none of ours, and neither do its children.
const OPAQUE: u8 = 1;
/// `ours` is exactly `[end]` (engine block size == ours), so nothing spills.
const ONE: u8 = 2;

/// One engine block: 32 bytes, plus a spill when it makes more or fewer than one block of ours.
#[derive(Debug)]
struct EngineBlock {
    /// Our chain's parent after this block: its last full block of ours, or the one before.
    end: u64,
    spill: Option<Box<Spill>>,
    ns: u16,
    flags: u8,
    /// Physical copies per medium (GPU, CPU, other).
    copies: [u16; 3],
}

#[derive(Debug)]
struct Spill {
    ours: Box<[u64]>,
    pending: Box<[u32]>,
}

impl EngineBlock {
    fn ours(&self) -> &[u64] {
        if self.flags & OPAQUE != 0 {
            &[]
        } else if let Some(s) = &self.spill {
            &s.ours
        } else if self.flags & ONE != 0 {
            std::slice::from_ref(&self.end)
        } else {
            &[]
        }
    }

    fn pending(&self) -> &[u32] {
        self.spill.as_ref().map_or(&[], |s| &s.pending)
    }

    fn held(&self) -> bool {
        self.copies.iter().any(|&c| c > 0)
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
    map: HashMap<u64, EngineBlock, ahash::RandomState>,
    ns_ids: HashMap<NamespaceKey, u16>,
    hashers: Vec<BlockHasher>,
    rehash: Rehash,
}

impl EngineBlocks {
    pub(crate) fn new(rehash: Rehash) -> EngineBlocks {
        EngineBlocks {
            map: HashMap::default(),
            ns_ids: HashMap::new(),
            hashers: Vec::new(),
            rehash,
        }
    }

    /// Engine blocks tracked.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Heap bytes held (table capacity, spills, namespaces), approximately.
    pub(crate) fn heap_bytes(&self) -> usize {
        let table = self.map.capacity() * (std::mem::size_of::<(u64, EngineBlock)>() + 1);
        let spills: usize = self
            .map
            .values()
            .filter_map(|b| b.spill.as_ref())
            .map(|s| std::mem::size_of::<Spill>() + s.ours.len() * 8 + s.pending.len() * 4)
            .sum();
        table + spills + self.hashers.capacity() * std::mem::size_of::<BlockHasher>()
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
        let has_tokens = ev.token_ids.len() == n.saturating_mul(e);
        let mut cursor = match ev.parent_block_hash {
            None => Cursor::Root,
            Some(p) => self.cursor_after(p),
        };
        let mut confirm: Vec<u64> = Vec::new();
        for (i, &hash) in ev.block_hashes.iter().enumerate() {
            if let Some(block) = self.map.get_mut(&hash) {
                // Another copy, or the same block on another medium (offloading).
                block.copies[m] = block.copies[m].saturating_add(1);
                confirm.extend_from_slice(block.ours());
                cursor = self.cursor_after(hash);
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
                    EngineBlock {
                        end: state.parent,
                        spill: (!one).then(|| {
                            Box::new(Spill {
                                ours: ours.into(),
                                pending: state.pending.into_boxed_slice(),
                            })
                        }),
                        ns,
                        flags: if one { ONE } else { 0 },
                        copies: [0; 3],
                    }
                }
                None => {
                    applied.unmapped += 1;
                    cursor = Cursor::Opaque;
                    EngineBlock {
                        end: 0,
                        spill: None,
                        ns: 0,
                        flags: OPAQUE,
                        copies: [0; 3],
                    }
                }
            };
            self.map.entry(hash).or_insert(block).copies[m] = 1;
        }
        if !confirm.is_empty() {
            // Endpoint ids come from the interner, far below the index's limit.
            let _ = index.insert_confirmed(ep, &confirm, ev.medium);
        }
        applied
    }

    fn cursor_after(&self, hash: u64) -> Cursor {
        match self.map.get(&hash) {
            Some(b) if b.flags & OPAQUE == 0 => Cursor::After {
                ns: b.ns,
                state: ChainState {
                    parent: b.end,
                    pending: b.pending().to_vec(),
                    blocks: 0,
                },
            },
            // An unknown parent (events missed) or one we cannot reproduce.
            _ => Cursor::Opaque,
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
        for hash in &ev.block_hashes {
            let Some(block) = self.map.get_mut(hash) else {
                applied.unknown_removed += 1;
                continue;
            };
            if block.copies[m] == 0 {
                applied.unknown_removed += 1;
                continue;
            }
            applied.removed += 1;
            block.copies[m] -= 1;
            if block.copies[m] > 0 {
                continue;
            }
            if block.held() {
                index.remove(ep, block.ours(), Some(ev.medium));
            } else if let Some(block) = self.map.remove(hash) {
                index.remove(ep, block.ours(), None);
            }
        }
        applied
    }

    /// `AllBlocksCleared` on one medium: every copy there goes.
    pub(crate) fn clear_medium(&mut self, medium: Medium, ep: EndpointId, index: &OwnershipIndex) {
        let m = slot(medium);
        let mut gone = Vec::new();
        let mut still = Vec::new();
        self.map.retain(|_, b| {
            if b.copies[m] == 0 {
                return true;
            }
            b.copies[m] = 0;
            if b.held() {
                still.extend_from_slice(b.ours());
                true
            } else {
                gone.extend_from_slice(b.ours());
                false
            }
        });
        index.remove(ep, &still, Some(medium));
        index.remove(ep, &gone, None);
    }

    /// Forgets every engine block (the caller clears or withdraws the index entries).
    pub(crate) fn clear(&mut self) {
        self.map = HashMap::default();
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
                let ours = self
                    .map
                    .values()
                    .filter(|b| b.copies[m] > 0)
                    .flat_map(|b| b.ours().iter().copied())
                    .collect();
                (medium, ours)
            })
            .filter(|(_, ours): &(Medium, Vec<u64>)| !ours.is_empty())
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
