//! One shard of the block map: block hash -> the endpoints holding it.
//!
//! Blocks are 20-byte records in pages ([`Pages`]), found through a [`RecordTable`] of 4-byte
//! record numbers. A record holds the block's hash and either its one holder inline (most
//! blocks have one) or the number of its [`HolderList`]. Records never move: the endpoints'
//! recency lists point at them by number ([`super::OwnershipIndex`] packs the shard with it),
//! so that a recency node needs no copy of the hash. A freed record is reused by the shard's
//! next new block; a shard whose blocks all left frees its pages.

use super::holders::{Extend, Holder, HolderList};
use super::pages::Pages;
use super::table::RecordTable;
use super::EndpointId;

/// `first.slot` of a shared block's record: `first.word[0]` is its list.
const SHARED: u32 = u32::MAX;
/// `first.slot` of a free record: `first.word[0]` is the next free one.
const FREE: u32 = u32::MAX - 1;
/// No record (end of the free chain).
const NONE: u32 = u32::MAX;

/// The largest recency slot a holder may have (the two above are markers).
pub(crate) const MAX_SLOT: u32 = FREE - 1;

/// A block: its hash and its holder (or list). 20 bytes.
#[derive(Debug, Clone, Copy)]
struct Record {
    /// As two halves, so the record needs no 8-byte alignment.
    hash: [u32; 2],
    first: Holder,
}

impl Record {
    fn hash(&self) -> u64 {
        u64::from(self.hash[0]) | u64::from(self.hash[1]) << 32
    }

    fn marked(hash: u64, marker: u32, value: u32) -> Record {
        Record {
            hash: [hash as u32, (hash >> 32) as u32],
            first: Holder::from_words([value, 0, marker]),
        }
    }

    /// The list of a shared block.
    fn list(&self) -> Option<usize> {
        (self.first.slot == SHARED).then_some(self.first.to_words()[0] as usize)
    }
}

/// A block as a lookup reads it.
pub(crate) enum Block<'a> {
    One(&'a Holder),
    Many(&'a HolderList),
}

impl Block<'_> {
    /// Fills `x` with the alive candidates that hold this block.
    #[inline]
    pub(crate) fn extend(&self, now: u64, x: &mut Extend<'_>) {
        match self {
            Block::One(h) => x.holder(h, now),
            Block::Many(list) => list.extend(now, x),
        }
    }
}

/// What [`Shard::upsert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Upsert {
    /// The endpoint held the block: its holder before and after.
    Updated { was: Holder, is: Holder },
    /// The endpoint holds it now: the block's record and the new holder.
    Added { record: u32, holder: Holder },
}

/// The shard has as many records as its record numbers can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

/// A shard: its own table behind its own lock (in [`super::OwnershipIndex`]). The table's
/// hasher is randomly keyed per process: block hashes derive from client text, and a keyed
/// hasher keeps a crafted prompt from piling entries into one run.
#[derive(Debug)]
pub(crate) struct Shard {
    table: RecordTable,
    records: Pages<Record>,
    /// First free record (free records are chained through their body), or [`NONE`].
    free: u32,
    /// Records in use (blocks).
    blocks: usize,
    /// (block, endpoint) entries.
    entries: usize,
    /// Holders of shared blocks; emptied lists are reused.
    lists: Vec<HolderList>,
    free_lists: Vec<u32>,
    /// Most records (what the recency lists' record numbers can name).
    max_records: usize,
}

impl Shard {
    /// An empty shard of at most `max_records` blocks.
    pub(crate) fn new(max_records: usize) -> Shard {
        Shard {
            table: RecordTable::new(),
            records: Pages::default(),
            free: NONE,
            blocks: 0,
            entries: 0,
            lists: Vec::new(),
            free_lists: Vec::new(),
            max_records: max_records.min(super::table::MAX_RECORDS),
        }
    }

    fn find(&self, hash: u64) -> Option<usize> {
        let records = &self.records;
        self.table
            .find(hash, |i| records[i as usize].hash())
            .map(|i| i as usize)
    }

    /// Distinct blocks.
    pub(crate) fn len(&self) -> usize {
        self.blocks
    }

    /// (block, endpoint) entries.
    pub(crate) fn entries(&self) -> usize {
        self.entries
    }

    /// The holders of `hash`, if any.
    #[inline]
    pub(crate) fn block(&self, hash: u64) -> Option<Block<'_>> {
        let r = &self.records[self.find(hash)?];
        Some(match r.list() {
            Some(l) => Block::Many(&self.lists[l]),
            None => Block::One(&r.first),
        })
    }

    /// `endpoint`'s holder of `hash`, if it has one.
    #[cfg(test)]
    pub(crate) fn get(&self, hash: u64, endpoint: EndpointId) -> Option<Holder> {
        match self.block(hash)? {
            Block::One(h) => (h.endpoint() == endpoint).then_some(*h),
            Block::Many(list) => list.get(endpoint).copied(),
        }
    }

    /// Applies `f` to `endpoint`'s holder of `hash` (`now`: the holders' clock); returns the
    /// holder before and after, if there is one.
    pub(crate) fn update(
        &mut self,
        hash: u64,
        endpoint: EndpointId,
        now: u64,
        f: impl FnOnce(&mut Holder),
    ) -> Option<(Holder, Holder)> {
        let i = self.find(hash)?;
        let r = &mut self.records[i];
        match r.list() {
            Some(l) => self.lists[l].update(endpoint, now, f),
            None if r.first.endpoint() == endpoint => {
                let was = r.first;
                f(&mut r.first);
                Some((was, r.first))
            }
            None => None,
        }
    }

    /// Applies `f` to `endpoint`'s holder of `hash`, or to a new one from `new` (the endpoint
    /// must be `endpoint`'s) that it adds: one search either way, where an update and then an
    /// add searched twice for every new block.
    pub(crate) fn upsert(
        &mut self,
        hash: u64,
        endpoint: EndpointId,
        now: u64,
        f: impl FnOnce(&mut Holder),
        new: impl FnOnce() -> Holder,
    ) -> Result<Upsert, Full> {
        let Some(i) = self.find(hash) else {
            let mut h = new();
            f(&mut h);
            let record = self.add_block(hash, h)?;
            return Ok(Upsert::Added { record, holder: h });
        };
        let r = &mut self.records[i];
        match r.list() {
            Some(l) => {
                if let Some(at) = self.lists[l].position(endpoint) {
                    let (was, is) = self.lists[l].update_at(at, now, f);
                    return Ok(Upsert::Updated { was, is });
                }
            }
            None if r.first.endpoint() == endpoint => {
                let was = r.first;
                f(&mut r.first);
                return Ok(Upsert::Updated { was, is: r.first });
            }
            None => {}
        }
        let mut h = new();
        f(&mut h);
        self.add_holder(i, hash, h, now);
        Ok(Upsert::Added {
            record: i as u32,
            holder: h,
        })
    }

    /// Adds a holder of `hash` for an endpoint that has none; returns the block's record.
    #[cfg(test)]
    pub(crate) fn add(&mut self, hash: u64, holder: Holder, now: u64) -> Result<u32, Full> {
        match self.find(hash) {
            None => self.add_block(hash, holder),
            Some(i) => {
                self.add_holder(i, hash, holder, now);
                Ok(i as u32)
            }
        }
    }

    /// A new block, held by `holder`; returns its record.
    fn add_block(&mut self, hash: u64, holder: Holder) -> Result<u32, Full> {
        debug_assert!(holder.slot <= MAX_SLOT);
        let i = self.new_record(Record {
            hash: [hash as u32, (hash >> 32) as u32],
            first: holder,
        })?;
        let records = &self.records;
        self.table
            .insert_unique(hash, i, |j| records[j as usize].hash());
        self.entries += 1;
        Ok(i)
    }

    /// Adds `holder` to block `i` (of `hash`), which its endpoint does not hold yet.
    fn add_holder(&mut self, i: usize, hash: u64, holder: Holder, now: u64) {
        debug_assert!(holder.slot <= MAX_SLOT);
        match self.records[i].list() {
            Some(l) => self.lists[l].insert(holder, now),
            None => {
                let list = HolderList::pair(self.records[i].first, holder);
                let l = match self.free_lists.pop() {
                    Some(l) => {
                        self.lists[l as usize] = list;
                        l
                    }
                    None => {
                        self.lists.push(list);
                        (self.lists.len() - 1) as u32
                    }
                };
                self.records[i] = Record::marked(hash, SHARED, l);
            }
        }
        self.entries += 1;
    }

    fn new_record(&mut self, record: Record) -> Result<u32, Full> {
        self.blocks += 1;
        if self.free != NONE {
            let i = self.free;
            self.free = self.records[i as usize].first.to_words()[0];
            self.records[i as usize] = record;
            return Ok(i);
        }
        if self.records.len() >= self.max_records {
            self.blocks -= 1;
            return Err(Full);
        }
        Ok(self.records.push(record) as u32)
    }

    /// Removes `endpoint`'s holder of `hash` (and the block with its last holder); returns it.
    pub(crate) fn remove(&mut self, hash: u64, endpoint: EndpointId, now: u64) -> Option<Holder> {
        let i = self.find(hash)?;
        self.remove_at(i as u32, endpoint, now)
    }

    /// Removes `endpoint`'s holder of block `record` (a number [`Self::add`] returned, still in
    /// use); returns it.
    pub(crate) fn remove_at(
        &mut self,
        record: u32,
        endpoint: EndpointId,
        now: u64,
    ) -> Option<Holder> {
        let i = record as usize;
        let r = self.records[i];
        debug_assert_ne!(r.first.slot, FREE, "a recency node outlived its block");
        let removed = match r.list() {
            None if r.first.endpoint() == endpoint => {
                self.free_record(i);
                r.first
            }
            None => return None,
            Some(l) => {
                let list = &mut self.lists[l];
                let removed = list.remove(endpoint, now)?;
                if list.len() == 1 {
                    // One holder left: back inline; the list's memory goes.
                    let last = list.holders()[0];
                    self.lists[l] = HolderList::default();
                    self.free_lists.push(l as u32);
                    self.records[i].first = last;
                }
                removed
            }
        };
        self.entries -= 1;
        Some(removed)
    }

    /// Frees record `i` (its last holder left).
    fn free_record(&mut self, i: usize) {
        self.table.remove(self.records[i].hash(), i as u32);
        self.blocks -= 1;
        if self.blocks == 0 {
            // Empty: give the pages back (no recency node points here any more).
            self.records = Pages::default();
            self.free = NONE;
            self.table.clear();
            self.lists = Vec::new();
            self.free_lists = Vec::new();
            return;
        }
        self.records[i] = Record::marked(0, FREE, self.free);
        self.free = i as u32;
    }

    /// Heap bytes: the table, the records and the lists of shared blocks.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.heap_bytes()
            + self.records.heap_bytes()
            + self.lists.capacity() * std::mem::size_of::<HolderList>()
            + self.lists.iter().map(HolderList::heap_bytes).sum::<usize>()
            + self.free_lists.capacity() * 4
    }

    /// Whether `hash`'s holders keep a bitset summary (for tests).
    #[cfg(test)]
    pub(crate) fn summarized(&self, hash: u64) -> bool {
        matches!(self.block(hash), Some(Block::Many(l)) if l.summarized())
    }
}

#[cfg(test)]
mod tests;
