//! One endpoint's recency order over its blocks: a doubly linked list in a slab, so touching,
//! adding and evicting are O(1) and a node is 12 bytes: the block's record (its shard and record
//! number, packed by [`super::OwnershipIndex`]; records never move) and the two links. Slots
//! are handed to the shard entries so a block found by hash can be touched or unlinked without
//! a second map.
//!
//! A block in use by requests the router sent there and that have not ended is *pinned* (a
//! count per slot, one byte): the engine cannot evict a running request's blocks, and frees
//! them, most recent, when the request ends (vLLM's free queue). A pinned slot leaves the list,
//! so eviction never reaches it; when its last pin goes it is linked back as most recently used.

use super::pages::Pages;
use super::shard::MAX_SLOT;

const NIL: u32 = u32::MAX;

/// A request's pin on a slot, as [`EndpointLru::pin`] took it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pin {
    slot: u32,
    /// The block's record then.
    record: u32,
    /// The slot's removals then.
    removals: u8,
}

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The block's record, as the index packs it.
    record: u32,
    prev: u32,
    next: u32,
}

/// The recency list and capacity of one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointLru {
    nodes: Pages<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
    /// First free slot (free slots are chained through `next`).
    free: u32,
    len: usize,
    /// Most blocks kept, besides `pending`.
    pub(crate) capacity: usize,
    /// Blocks added for routed requests whose prefill has not started on the engine yet
    /// ([`super::PendingBlocks`]): they hold no engine memory, so they push nothing out of
    /// it yet. At most `capacity`.
    pub(crate) pending: usize,
    /// Counts [`Self::clear`]s: a pending claim taken before one settles nothing after it.
    pub(crate) generation: u64,
    /// Blocks confirmed by engine events (the rest are predictions).
    pub(crate) confirmed: usize,
    /// Per slot, how many open requests pin it (0: in the list). Saturates: past 255 a pin is
    /// refused (its caller does not unpin it either).
    pins: Pages<u8>,
    /// Per slot, how many times it was removed (wrapping): a pin taken before a removal must
    /// not take back a pin of the block that reuses the slot, even with the same record.
    removals: Pages<u8>,
    /// Slots with a pin (not in the list). At most `capacity` ([`Self::can_pin`]), so a list
    /// over its capacity always has an unpinned block to evict.
    pub(crate) pinned: usize,
    /// The endpoint's id was retired ([`super::OwnershipIndex::retire_endpoint`]): a writer
    /// that took this list before the retirement must add nothing.
    pub(crate) retired: bool,
}

impl EndpointLru {
    pub(crate) fn new(capacity: usize) -> EndpointLru {
        EndpointLru {
            nodes: Pages::default(),
            head: NIL,
            tail: NIL,
            free: NIL,
            len: 0,
            capacity,
            pending: 0,
            generation: 0,
            confirmed: 0,
            pins: Pages::default(),
            removals: Pages::default(),
            pinned: 0,
            retired: false,
        }
    }

    /// Empties the list, frees its memory and marks it retired (the mark alone keeps writers
    /// out: the capacity is left as it was).
    pub(crate) fn retire(&mut self) {
        *self = EndpointLru {
            retired: true,
            ..EndpointLru::new(self.capacity)
        };
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn over_capacity(&self) -> bool {
        self.len > self.capacity.saturating_add(self.pending)
    }

    /// Counts one more pending block (within `capacity`); whether it was counted.
    pub(crate) fn add_pending(&mut self) -> bool {
        let room = self.pending < self.capacity;
        self.pending += usize::from(room);
        room
    }

    /// A slot for a block about to be added, not yet in the list: [`Self::link_front`] puts it
    /// there, [`Self::release`] gives it back.
    pub(crate) fn reserve(&mut self) -> u32 {
        let node = Node {
            record: 0,
            prev: NIL,
            next: NIL,
        };
        if self.free != NIL {
            let slot = self.free;
            self.free = self.nodes[slot as usize].next;
            self.nodes[slot as usize] = node;
            slot
        } else {
            assert!(
                self.nodes.len() <= MAX_SLOT as usize,
                "recency slots exhausted"
            );
            self.pins.push(0);
            self.removals.push(0);
            self.nodes.push(node) as u32
        }
    }

    /// Gives back a reserved slot that was not linked.
    pub(crate) fn release(&mut self, slot: u32) {
        self.nodes[slot as usize].next = self.free;
        self.free = slot;
    }

    /// Links reserved `slot`, for block `record`, as most recently used.
    pub(crate) fn link_front(&mut self, slot: u32, record: u32) {
        self.nodes[slot as usize] = Node {
            record,
            prev: NIL,
            next: self.head,
        };
        if self.head != NIL {
            self.nodes[self.head as usize].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
        self.len += 1;
    }

    /// Marks `slot` most recently used (a pinned slot becomes so when its last pin goes).
    pub(crate) fn touch(&mut self, slot: u32) {
        if self.head == slot || self.pins[slot as usize] > 0 {
            return;
        }
        self.unlink(slot);
        self.relink_front(slot);
    }

    /// Whether `n` more slots may be pinned (the pinned stay within the capacity).
    pub(crate) fn can_pin(&self, n: usize) -> bool {
        self.pinned.saturating_add(n) <= self.capacity
    }

    /// Pins linked or pinned `slot` for one more request (out of the list: never evicted);
    /// returns the pin to give back, or `None` when its count is full (then it is not pinned
    /// again). The caller checks [`Self::can_pin`] first.
    pub(crate) fn pin(&mut self, slot: u32) -> Option<Pin> {
        let pins = self.pins[slot as usize];
        if pins == u8::MAX {
            return None;
        }
        if pins == 0 {
            self.unlink(slot);
            self.pinned += 1;
        }
        self.pins[slot as usize] = pins + 1;
        Some(Pin {
            slot,
            record: self.nodes[slot as usize].record,
            removals: self.removals[slot as usize],
        })
    }

    /// Takes back `pin`; the slot's last pin links it as most recently used. Nothing if the
    /// slot holds no pin or was removed since the pin (another block, or the same block added
    /// again: its pins are another request's).
    pub(crate) fn unpin(&mut self, pin: Pin) {
        let Pin {
            slot,
            record,
            removals,
        } = pin;
        if slot as usize >= self.pins.len() {
            return;
        }
        let pins = self.pins[slot as usize];
        if pins == 0
            || self.nodes[slot as usize].record != record
            || self.removals[slot as usize] != removals
        {
            return;
        }
        self.pins[slot as usize] = pins - 1;
        if pins == 1 {
            self.pinned -= 1;
            self.relink_front(slot);
        }
    }

    /// Puts unlinked `slot` at the front.
    fn relink_front(&mut self, slot: u32) {
        let node = &mut self.nodes[slot as usize];
        node.prev = NIL;
        node.next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
    }

    /// Removes `slot` (pinned or not: the engine's word, or a clear); returns its record.
    pub(crate) fn remove(&mut self, slot: u32) -> u32 {
        self.removals[slot as usize] = self.removals[slot as usize].wrapping_add(1);
        if self.pins[slot as usize] > 0 {
            self.pins[slot as usize] = 0;
            self.pinned -= 1;
        } else {
            self.unlink(slot);
        }
        let record = self.nodes[slot as usize].record;
        self.release(slot);
        self.len -= 1;
        record
    }

    /// The least recently used slot and its record.
    pub(crate) fn lru(&self) -> Option<(u32, u32)> {
        (self.tail != NIL).then(|| (self.tail, self.nodes[self.tail as usize].record))
    }

    /// Every (slot, record) in the list, most recent first; then the pinned ones.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut at = self.head;
        let listed = std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let slot = at;
            let node = self.nodes[slot as usize];
            at = node.next;
            Some((slot, node.record))
        });
        let slots = if self.pinned > 0 { self.pins.len() } else { 0 };
        let pinned = (0..slots)
            .filter(move |&i| self.pins[i] > 0)
            .map(|i| (i as u32, self.nodes[i].record));
        listed.chain(pinned)
    }

    /// Forgets every block and pending claim (capacity kept), releasing memory.
    pub(crate) fn clear(&mut self) {
        *self = EndpointLru {
            retired: self.retired,
            generation: self.generation + 1,
            ..EndpointLru::new(self.capacity)
        };
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.nodes.heap_bytes() + self.pins.heap_bytes()
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(lru: &EndpointLru) -> Vec<u32> {
        lru.iter().map(|(_, r)| r).collect()
    }

    fn push(lru: &mut EndpointLru, record: u32) -> u32 {
        let slot = lru.reserve();
        lru.link_front(slot, record);
        slot
    }

    #[test]
    fn recency_order_touch_remove_and_slot_reuse() {
        let mut lru = EndpointLru::new(10);
        let a = push(&mut lru, 1);
        let b = push(&mut lru, 2);
        let c = push(&mut lru, 3);
        assert_eq!(order(&lru), [3, 2, 1]);
        assert_eq!(lru.lru(), Some((a, 1)));
        lru.touch(a);
        assert_eq!(order(&lru), [1, 3, 2]);
        lru.touch(a); // already head
        assert_eq!(lru.remove(b), 2);
        assert_eq!(order(&lru), [1, 3]);
        assert_eq!(lru.lru(), Some((c, 3)));
        let d = push(&mut lru, 4);
        assert_eq!(d, b, "freed slot reused");
        assert_eq!(order(&lru), [4, 1, 3]);
        // A reserved slot given back is not in the list and is reused next.
        let e = lru.reserve();
        lru.release(e);
        assert_eq!((lru.len(), order(&lru)), (3, vec![4, 1, 3]));
        assert_eq!(push(&mut lru, 5), e);
        lru.remove(e);
        lru.remove(c);
        lru.remove(a);
        lru.remove(d);
        assert_eq!(lru.len(), 0);
        assert_eq!(lru.lru(), None);
        push(&mut lru, 5);
        assert_eq!(order(&lru), [5]);
        assert_eq!(std::mem::size_of::<Node>(), 12);
    }

    #[test]
    fn a_pinned_slot_is_never_the_lru_and_comes_back_most_recent() {
        let mut lru = EndpointLru::new(3);
        let a = push(&mut lru, 1);
        let b = push(&mut lru, 2);
        let c = push(&mut lru, 3);
        assert!(lru.can_pin(3) && !lru.can_pin(4));
        let pin_a = lru.pin(a).unwrap();
        assert_eq!(lru.pin(a), Some(pin_a), "a second request");
        assert_eq!((lru.pinned, lru.len()), (1, 3));
        assert_eq!(order(&lru), [3, 2, 1], "listed first, then the pinned");
        assert_eq!(lru.lru(), Some((b, 2)), "the pinned one is skipped");
        lru.touch(a); // no-op while pinned
        assert_eq!(lru.lru(), Some((b, 2)));
        lru.unpin(pin_a);
        assert_eq!(lru.lru(), Some((b, 2)), "one pin left");
        lru.unpin(Pin {
            record: 99,
            ..pin_a
        }); // taken for another block: ignored
        lru.unpin(pin_a);
        assert_eq!(lru.pinned, 0);
        assert_eq!(order(&lru), [1, 3, 2], "most recent once its last pin went");
        lru.unpin(pin_a); // no pin left: ignored
        assert_eq!(order(&lru), [1, 3, 2]);
        // A pinned slot removed (the engine's word) frees its pin; a stale unpin is ignored.
        let pin_c = lru.pin(c).unwrap();
        assert_eq!(lru.remove(c), 3);
        assert_eq!((lru.pinned, lru.len()), (0, 2));
        let d = push(&mut lru, 4);
        assert_eq!(d, c, "slot reused");
        lru.unpin(pin_c);
        assert_eq!(order(&lru), [4, 1, 2]);
        // Saturation: a slot pinned 255 times takes no more pins.
        let pin_d = lru.pin(d).unwrap();
        for _ in 1..255 {
            assert!(lru.pin(d).is_some());
        }
        assert_eq!(lru.pin(d), None);
        for _ in 0..255 {
            lru.unpin(pin_d);
        }
        assert_eq!((lru.pinned, order(&lru)), (0, vec![4, 1, 2]));
    }

    #[test]
    fn a_pin_from_before_a_removal_does_not_take_back_the_readded_blocks() {
        // Request A pins block 1; the engine removes it; request B adds the same block again,
        // in the same slot with the same record, and pins it. A's end must leave B's pin.
        let mut lru = EndpointLru::new(3);
        let slot = push(&mut lru, 1);
        let a = lru.pin(slot).unwrap();
        lru.remove(slot);
        assert_eq!(push(&mut lru, 1), slot, "the same slot, the same record");
        let b = lru.pin(slot).unwrap();
        lru.unpin(a);
        assert_eq!(lru.pinned, 1, "B's pin stays");
        assert_eq!(lru.lru(), None, "and the block is not evictable");
        lru.unpin(b);
        assert_eq!((lru.pinned, lru.lru()), (0, Some((slot, 1))));
    }
}
