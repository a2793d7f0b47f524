//! One shard of the block map: block hash -> the endpoints holding it.
//!
//! Blocks are records in a dense vector, found through a hash table of 4-byte record numbers.
//! A table bucket is then 5 bytes (the number and hashbrown's control byte) where a map of
//! `(hash, holders)` entries spent 41 per bucket: at hashbrown's worst load (1/2, right after
//! it doubled) a block costs 10 bytes of table plus its 24-byte record, not 82 bytes.
//!
//! Most blocks are held by one endpoint, so a record holds its first holder inline and points
//! to a list of the others when there are more. A holder is 12 bytes: the endpoint id, the
//! confirmed media and when its prediction expires packed in one `u64`, and the slot of the
//! block in that endpoint's recency list.

use hashbrown::HashTable;

use super::EndpointId;

/// Endpoint ids use the low 24 bits of a holder's word.
pub(crate) const MAX_ENDPOINT_ID: EndpointId = (1 << 24) - 1;

const MEDIA_SHIFT: u32 = 24;
const UNTIL_SHIFT: u32 = 27;
/// Prediction expiry is kept in 37 bits of ms since the index was created (4.3 years); later
/// times saturate (see [`super::OwnershipIndex`]).
pub(crate) const MAX_UNTIL_MS: u64 = (1 << (64 - UNTIL_SHIFT)) - 1;

/// One endpoint's claim on one block. 12 bytes, 4-byte aligned so a record packs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holder {
    /// Endpoint (24 bits), confirmed media (3 bits), predicted-until ms (37 bits), as two
    /// halves so the holder needs no 8-byte alignment.
    word: [u32; 2],
    /// Slot in the endpoint's recency list.
    pub(crate) slot: u32,
}

impl Holder {
    pub(crate) fn new(endpoint: EndpointId, slot: u32) -> Holder {
        let mut h = Holder { word: [0; 2], slot };
        h.set_word(u64::from(endpoint & MAX_ENDPOINT_ID));
        h
    }

    fn word(&self) -> u64 {
        u64::from(self.word[0]) | u64::from(self.word[1]) << 32
    }

    fn set_word(&mut self, w: u64) {
        self.word = [w as u32, (w >> 32) as u32];
    }

    pub(crate) fn endpoint(&self) -> EndpointId {
        self.word[0] & MAX_ENDPOINT_ID
    }

    /// Media on which the engine confirmed the block (bit set of [`Medium`]); 0 if none.
    pub(crate) fn media(&self) -> u8 {
        ((self.word() >> MEDIA_SHIFT) & 0b111) as u8
    }

    pub(crate) fn set_media(&mut self, media: u8) {
        let w = self.word() & !(0b111 << MEDIA_SHIFT) | u64::from(media & 0b111) << MEDIA_SHIFT;
        self.set_word(w);
    }

    /// Until when our own prediction counts (ms since the index's origin); 0 = never predicted.
    pub(crate) fn predicted_until_ms(&self) -> u64 {
        self.word() >> UNTIL_SHIFT
    }

    /// Sets the prediction's expiry, saturating at [`MAX_UNTIL_MS`].
    pub(crate) fn set_predicted_until_ms(&mut self, until: u64) {
        let w = self.word() & ((1 << UNTIL_SHIFT) - 1) | until.min(MAX_UNTIL_MS) << UNTIL_SHIFT;
        self.set_word(w);
    }

    pub(crate) fn confirmed(&self) -> bool {
        self.media() != 0
    }

    /// Counts as held at `now_ms` (same origin as the expiry): confirmed, or predicted and
    /// not yet expired.
    pub(crate) fn live(&self, now_ms: u64) -> bool {
        self.confirmed() || self.predicted_until_ms() > now_ms
    }

    /// At `now_ms`, when live: the media the engine confirmed it on (0: only predicted); from
    /// one read of the word.
    #[inline]
    pub(crate) fn state(&self, now_ms: u64) -> Option<u8> {
        let w = self.word();
        let media = ((w >> MEDIA_SHIFT) & 0b111) as u8;
        (media != 0 || w >> UNTIL_SHIFT > now_ms).then_some(media)
    }
}

const NO_LIST: u32 = u32::MAX;

/// A block: its hash and its holders. 24 bytes.
#[derive(Debug, Clone)]
struct Record {
    hash: u64,
    first: Holder,
    /// The other holders, sorted by endpoint: an index into [`Shard::lists`], or [`NO_LIST`].
    more: u32,
}

/// A shard: its own table behind its own lock (in [`super::OwnershipIndex`]). The table's
/// hasher is randomly keyed per process: block hashes derive from client text, and a keyed
/// hasher keeps a crafted prompt from piling entries into one probe sequence.
#[derive(Debug, Default)]
pub(crate) struct Shard {
    table: HashTable<u32>,
    /// A plain vector (one load fewer on the lookup path than pages), grown by a quarter at a
    /// time so its spare room stays under a quarter.
    records: Vec<Record>,
    /// Holders past the first of shared blocks; emptied lists are reused.
    lists: Vec<Vec<Holder>>,
    free_lists: Vec<u32>,
    hasher: ahash::RandomState,
}

impl Shard {
    fn key(&self, hash: u64) -> u64 {
        self.hasher.hash_one(hash)
    }

    fn find(&self, hash: u64) -> Option<usize> {
        let records = &self.records;
        self.table
            .find(self.key(hash), |&i| records[i as usize].hash == hash)
            .map(|&i| i as usize)
    }

    /// Distinct blocks.
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }

    /// (block, endpoint) entries.
    pub(crate) fn entries(&self) -> usize {
        self.records.len() + self.lists.iter().map(Vec::len).sum::<usize>()
    }

    /// The holders of `hash`, if any.
    pub(crate) fn holders(&self, hash: u64) -> Option<(&Holder, &[Holder])> {
        let r = &self.records[self.find(hash)?];
        let more = match r.more {
            NO_LIST => &[][..],
            l => &self.lists[l as usize],
        };
        Some((&r.first, more))
    }

    /// `endpoint`'s holder of `hash`, if it has one.
    pub(crate) fn holder_mut(&mut self, hash: u64, endpoint: EndpointId) -> Option<&mut Holder> {
        let i = self.find(hash)?;
        let r = &mut self.records[i];
        if r.first.endpoint() == endpoint {
            return Some(&mut r.first);
        }
        match r.more {
            NO_LIST => None,
            l => {
                let list = &mut self.lists[l as usize];
                let j = list
                    .binary_search_by_key(&endpoint, Holder::endpoint)
                    .ok()?;
                Some(&mut list[j])
            }
        }
    }

    /// Adds a holder of `hash` for an endpoint that has none.
    pub(crate) fn add(&mut self, hash: u64, holder: Holder) {
        let Some(i) = self.find(hash) else {
            if self.records.len() == self.records.capacity() {
                let more = (self.records.capacity() / 4).max(64);
                self.records.reserve_exact(more);
            }
            let i = self.records.len() as u32;
            self.records.push(Record {
                hash,
                first: holder,
                more: NO_LIST,
            });
            let (records, hasher) = (&self.records, &self.hasher);
            self.table.insert_unique(self.key(hash), i, |&j| {
                hasher.hash_one(records[j as usize].hash)
            });
            return;
        };
        let l = match self.records[i].more {
            NO_LIST => {
                let l = match self.free_lists.pop() {
                    Some(l) => l,
                    None => {
                        self.lists.push(Vec::new());
                        (self.lists.len() - 1) as u32
                    }
                };
                self.records[i].more = l;
                l
            }
            l => l,
        };
        // Sorted by endpoint: the commit of a decision finds its endpoint's holder in blocks
        // that hundreds of endpoints share by bisection, not by a scan.
        let list = &mut self.lists[l as usize];
        let j = list.partition_point(|h| h.endpoint() < holder.endpoint());
        list.insert(j, holder);
    }

    /// Removes `endpoint`'s holder of `hash` (and the block with its last holder); returns it.
    pub(crate) fn remove(&mut self, hash: u64, endpoint: EndpointId) -> Option<Holder> {
        let i = self.find(hash)?;
        let more = self.records[i].more;
        let list = (more != NO_LIST).then(|| &mut self.lists[more as usize]);
        let removed = if self.records[i].first.endpoint() == endpoint {
            let first = self.records[i].first;
            match list {
                Some(list) => self.records[i].first = list.pop().expect("lists are never empty"),
                None => {
                    self.remove_record(i);
                    return Some(first);
                }
            }
            first
        } else {
            let list = list?;
            let j = list
                .binary_search_by_key(&endpoint, Holder::endpoint)
                .ok()?;
            list.remove(j)
        };
        if more != NO_LIST && self.lists[more as usize].is_empty() {
            // Release the vector: a block shared once may never be again.
            self.lists[more as usize] = Vec::new();
            self.free_lists.push(more);
            self.records[i].more = NO_LIST;
        }
        Some(removed)
    }

    /// Drops record `i` (its last holder left); the last record moves into its place.
    fn remove_record(&mut self, i: usize) {
        let hash = self.records[i].hash;
        let key = self.key(hash);
        let records = &self.records;
        if let Ok(e) = self
            .table
            .find_entry(key, |&j| records[j as usize].hash == hash)
        {
            e.remove();
        }
        let last = self.records.len() - 1;
        if i != last {
            let moved = self.records[last].hash;
            let key = self.key(moved);
            if let Some(slot) = self.table.find_mut(key, |&j| j as usize == last) {
                *slot = i as u32;
            }
        }
        self.records.swap_remove(i);
    }

    /// Heap bytes: the table, the records and the lists of shared blocks.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
            + self.records.capacity() * std::mem::size_of::<Record>()
            + self.lists.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self
                .lists
                .iter()
                .map(|l| l.capacity() * std::mem::size_of::<Holder>())
                .sum::<usize>()
            + self.free_lists.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Medium;

    #[test]
    fn holders_pack_into_twelve_bytes_and_records_into_twenty_four() {
        assert_eq!(std::mem::size_of::<Holder>(), 12);
        assert_eq!(std::mem::size_of::<Record>(), 24);
        let mut x = Holder::new(MAX_ENDPOINT_ID, 7);
        assert!(!x.confirmed() && !x.live(0));
        x.set_predicted_until_ms(100);
        assert!(x.live(99) && !x.live(100));
        x.set_media(Medium::Cpu.bit());
        assert_eq!(x.endpoint(), MAX_ENDPOINT_ID);
        assert_eq!(x.predicted_until_ms(), 100);
        assert!(x.confirmed() && x.live(1000));
        assert_eq!(x.state(1000), Some(Medium::Cpu.bit()), "offloaded");
        x.set_media(Medium::Cpu.bit() | Medium::Gpu.bit());
        assert_eq!(
            x.state(1 << 30),
            Some(Medium::Cpu.bit() | Medium::Gpu.bit())
        );
        let mut y = Holder::new(3, 0);
        assert_eq!(y.state(0), None);
        y.set_predicted_until_ms(10);
        assert_eq!((y.state(9), y.state(10)), (Some(0), None), "predicted only");
        y.set_media(Medium::Other.bit());
        assert_eq!(y.state(10), Some(Medium::Other.bit()));
        x.set_predicted_until_ms(u64::MAX);
        assert_eq!(x.predicted_until_ms(), MAX_UNTIL_MS, "saturates");
        assert_eq!((x.endpoint(), x.slot), (MAX_ENDPOINT_ID, 7));
        assert_eq!(x.media(), Medium::Cpu.bit() | Medium::Gpu.bit());
    }

    fn endpoints(s: &Shard, hash: u64) -> Vec<EndpointId> {
        let Some((first, more)) = s.holders(hash) else {
            return Vec::new();
        };
        let mut v: Vec<_> = std::iter::once(first)
            .chain(more)
            .map(Holder::endpoint)
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn holders_grow_shrink_and_records_move_when_blocks_go() {
        let mut s = Shard::default();
        for hash in 0..100u64 {
            s.add(hash, Holder::new(1, hash as u32));
        }
        s.add(5, Holder::new(2, 50));
        s.add(5, Holder::new(3, 51));
        assert_eq!(endpoints(&s, 5), [1, 2, 3]);
        assert_eq!((s.len(), s.entries()), (100, 102));
        assert_eq!(s.holder_mut(5, 3).unwrap().slot, 51);
        assert!(s.holder_mut(5, 4).is_none());
        assert_eq!(s.remove(5, 1).unwrap().slot, 5, "the first holder");
        assert_eq!(s.remove(5, 1), None);
        assert_eq!(endpoints(&s, 5), [2, 3]);
        assert_eq!(s.remove(5, 3).unwrap().slot, 51);
        assert_eq!(endpoints(&s, 5), [2]);
        assert_eq!(s.free_lists, [0], "the emptied list is free again");
        // Removing whole blocks moves the last record into their place.
        for hash in (0..100u64).step_by(3) {
            let ep = if hash == 5 { 2 } else { 1 };
            assert!(s.remove(hash, ep).is_some(), "{hash}");
        }
        for hash in 0..100u64 {
            let expected: &[EndpointId] = match (hash % 3, hash) {
                (0, _) => &[],
                (_, 5) => &[2],
                _ => &[1],
            };
            assert_eq!(endpoints(&s, hash), expected, "{hash}");
        }
        assert_eq!(s.len(), 66);
        assert!(s.heap_bytes() >= 66 * 24);
    }

    /// A block held by many endpoints, added and removed in scrambled order: every holder is
    /// found (by bisection of the sorted list), removed ones are not, the list stays sorted.
    #[test]
    fn shared_blocks_find_each_of_many_holders() {
        let mut s = Shard::default();
        let order: Vec<EndpointId> = (0..300u32).map(|i| (i * 7919) % 300).collect();
        for &ep in &order {
            s.add(9, Holder::new(ep, ep + 1000));
        }
        for &ep in order.iter().filter(|&&ep| ep % 3 == 0) {
            assert_eq!(s.remove(9, ep).unwrap().slot, ep + 1000);
        }
        for ep in 0..300u32 {
            let found = s.holder_mut(9, ep).map(|h| h.slot);
            assert_eq!(found, (ep % 3 != 0).then_some(ep + 1000), "endpoint {ep}");
        }
        let (_, more) = s.holders(9).unwrap();
        assert!(more.windows(2).all(|w| w[0].endpoint() < w[1].endpoint()));
        assert_eq!(endpoints(&s, 9).len(), 200);
    }
}
