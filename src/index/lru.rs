//! One endpoint's recency order over its blocks: a doubly linked list in a slab, so touching,
//! adding and evicting are O(1) and a node is 12 bytes: the block's record (its shard and record
//! number, packed by [`super::OwnershipIndex`]; records never move) and the two links. Slots
//! are handed to the shard entries so a block found by hash can be touched or unlinked without
//! a second map.

use super::pages::Pages;
use super::shard::MAX_SLOT;

const NIL: u32 = u32::MAX;

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

    /// Marks `slot` most recently used.
    pub(crate) fn touch(&mut self, slot: u32) {
        if self.head == slot {
            return;
        }
        self.unlink(slot);
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

    /// Removes `slot`; returns its record.
    pub(crate) fn remove(&mut self, slot: u32) -> u32 {
        self.unlink(slot);
        let record = self.nodes[slot as usize].record;
        self.release(slot);
        self.len -= 1;
        record
    }

    /// The least recently used slot and its record.
    pub(crate) fn lru(&self) -> Option<(u32, u32)> {
        (self.tail != NIL).then(|| (self.tail, self.nodes[self.tail as usize].record))
    }

    /// Every (slot, record), most recent first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let slot = at;
            let node = self.nodes[slot as usize];
            at = node.next;
            Some((slot, node.record))
        })
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
        self.nodes.heap_bytes()
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
}
