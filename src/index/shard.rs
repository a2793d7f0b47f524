//! One shard of the block map: block hash -> the endpoints holding it.
//!
//! Most blocks are held by one endpoint, so the holder list is inline for one and a vector past
//! that. A holder is 16 bytes: endpoint id and confirmed media packed in one `u32`, the slot of
//! the block in that endpoint's recency list, and when its prediction expires.

use std::collections::HashMap;

use super::{EndpointId, Medium};

/// Endpoint ids use the low 24 bits of a holder's first word; media flags the high 8.
pub(crate) const MAX_ENDPOINT_ID: EndpointId = (1 << 24) - 1;

/// One endpoint's claim on one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    endpoint_media: u32,
    /// Slot in the endpoint's recency list.
    pub(crate) slot: u32,
    /// Until when our own prediction counts (ms on the index clock); 0 = never predicted.
    pub(crate) predicted_until_ms: u64,
}

impl Holder {
    pub(crate) fn new(endpoint: EndpointId, slot: u32) -> Holder {
        Holder {
            endpoint_media: endpoint & MAX_ENDPOINT_ID,
            slot,
            predicted_until_ms: 0,
        }
    }

    pub(crate) fn endpoint(&self) -> EndpointId {
        self.endpoint_media & MAX_ENDPOINT_ID
    }

    /// Media on which the engine confirmed the block (bit set of [`Medium`]); 0 if none.
    pub(crate) fn media(&self) -> u8 {
        (self.endpoint_media >> 24) as u8
    }

    pub(crate) fn set_media(&mut self, media: u8) {
        self.endpoint_media = self.endpoint() | (u32::from(media) << 24);
    }

    pub(crate) fn confirmed(&self) -> bool {
        self.media() != 0
    }

    /// Counts as held at `now_ms`: confirmed, or predicted and not yet expired.
    pub(crate) fn live(&self, now_ms: u64) -> bool {
        self.confirmed() || self.predicted_until_ms > now_ms
    }

    /// Confirmed only on slower media than GPU.
    pub(crate) fn offloaded(&self) -> bool {
        self.confirmed() && self.media() & Medium::Gpu.bit() == 0
    }
}

/// The holders of one block.
#[derive(Debug, Clone)]
pub(crate) enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    pub(crate) fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    pub(crate) fn find_mut(&mut self, endpoint: EndpointId) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => (h.endpoint() == endpoint).then_some(h),
            Holders::Many(v) => v.iter_mut().find(|h| h.endpoint() == endpoint),
        }
    }

    pub(crate) fn push(&mut self, holder: Holder) {
        match self {
            Holders::One(first) => *self = Holders::Many(vec![*first, holder]),
            Holders::Many(v) => v.push(holder),
        }
    }

    /// Removes `endpoint`'s holder; returns it. The caller drops the entry when `is_empty`.
    pub(crate) fn remove(&mut self, endpoint: EndpointId) -> Option<Holder> {
        match self {
            Holders::One(h) if h.endpoint() == endpoint => {
                let h = *h;
                *self = Holders::Many(Vec::new());
                Some(h)
            }
            Holders::One(_) => None,
            Holders::Many(v) => {
                let i = v.iter().position(|h| h.endpoint() == endpoint)?;
                let h = v.swap_remove(i);
                if v.len() == 1 {
                    *self = Holders::One(v[0]);
                }
                Some(h)
            }
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Holders::Many(v) if v.is_empty())
    }

    /// Heap bytes beyond the map entry.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(_) => 0,
            Holders::Many(v) => v.capacity() * std::mem::size_of::<Holder>(),
        }
    }
}

/// A shard: its own map behind its own lock (in [`super::OwnershipIndex`]). The map's hasher is
/// randomly keyed per process: block hashes derive from client text, and a keyed hasher keeps a
/// crafted prompt from piling entries into one bucket chain.
pub(crate) type ShardMap = HashMap<u64, Holders, ahash::RandomState>;

/// Heap bytes of a shard map: its table (entries and control bytes) plus holder vectors.
pub(crate) fn shard_heap_bytes(map: &ShardMap) -> usize {
    let table = map.capacity() * (std::mem::size_of::<(u64, Holders)>() + 1);
    table + map.values().map(Holders::heap_bytes).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_grow_shrink_and_pack() {
        assert_eq!(std::mem::size_of::<Holder>(), 16);
        let mut h = Holders::One(Holder::new(1, 10));
        assert!(h.find_mut(2).is_none());
        h.push(Holder::new(2, 20));
        h.push(Holder::new(3, 30));
        assert_eq!(h.as_slice().len(), 3);
        assert_eq!(h.find_mut(3).unwrap().slot, 30);
        assert_eq!(h.remove(1).unwrap().slot, 10);
        assert_eq!(h.remove(1), None);
        assert_eq!(h.remove(3).unwrap().slot, 30);
        assert!(matches!(h, Holders::One(x) if x.endpoint() == 2));
        assert_eq!(h.remove(2).unwrap().slot, 20);
        assert!(h.is_empty());

        let mut x = Holder::new(MAX_ENDPOINT_ID, 0);
        assert!(!x.confirmed() && !x.live(0));
        x.predicted_until_ms = 100;
        assert!(x.live(99) && !x.live(100));
        x.set_media(Medium::Cpu.bit());
        assert_eq!(x.endpoint(), MAX_ENDPOINT_ID);
        assert!(x.confirmed() && x.live(1000) && x.offloaded());
        x.set_media(Medium::Cpu.bit() | Medium::Gpu.bit());
        assert!(!x.offloaded());
    }
}
