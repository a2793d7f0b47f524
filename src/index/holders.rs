//! The endpoints holding one block: a [`Holder`] each, and for widely shared blocks a bitset
//! [`Summary`] over endpoint ids that a lookup ANDs with its candidates instead of decoding
//! every holder.
//!
//! A holder is 12 bytes: the endpoint id, the confirmed media and when its prediction expires
//! packed in one `u64`, and the slot of the block in that endpoint's recency list. A block held
//! by one endpoint keeps its holder inline in its record ([`super::shard`]); a shared block
//! keeps a [`HolderList`], sorted by endpoint.
//!
//! A system prompt cached on hundreds of endpoints made the lookup visit every holder of every
//! matched block: 66 blocks x 256 holders at ~1.8 ns each, 38% of a 256-endpoint decision. With
//! at least [`SUMMARY_MIN`] holders (and ids dense enough: endpoint ids are small integers,
//! reused lowest first), a list also keeps five bitsets (held, confirmed, on GPU, in CPU memory,
//! predicted)
//! and a lower bound of the predictions' expiry, so "which candidates still extend the match"
//! is a few word operations per block: 4 words a plane for 256 endpoints.

use super::{EndpointId, Medium};

/// Endpoint ids use the low 24 bits of a holder's word.
pub(crate) const MAX_ENDPOINT_ID: EndpointId = (1 << 24) - 1;

const MEDIA_SHIFT: u32 = 24;
const UNTIL_SHIFT: u32 = 27;
/// Prediction expiry is kept in 37 bits of ms since the index was created (4.3 years); later
/// times saturate (see [`super::OwnershipIndex`]).
pub(crate) const MAX_UNTIL_MS: u64 = (1 << (64 - UNTIL_SHIFT)) - 1;

/// Holders from which a list keeps a [`Summary`] (below, decoding the holders is as cheap).
pub(crate) const SUMMARY_MIN: usize = 32;
/// A list keeps its summary down to this many holders (hysteresis: a block at the threshold
/// does not rebuild it on every change).
const SUMMARY_KEEP: usize = SUMMARY_MIN / 2;
/// A summary is built only if its planes cost at most this many bits a holder (16 a plane:
/// 10 bytes, next to the holder's 12): the ids must be dense enough. 256 endpoints with ids
/// 0..256 cost 5.
const SUMMARY_BITS_PER_HOLDER: usize = 16 * PLANES;
/// And kept up to twice that, as holders leave.
const SUMMARY_KEEP_BITS_PER_HOLDER: usize = 2 * SUMMARY_BITS_PER_HOLDER;

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

    /// The holder packed in a record's three words (and back).
    pub(crate) fn to_words(self) -> [u32; 3] {
        [self.word[0], self.word[1], self.slot]
    }

    pub(crate) fn from_words(w: [u32; 3]) -> Holder {
        Holder {
            word: [w[0], w[1]],
            slot: w[2],
        }
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

    fn on_gpu(&self) -> bool {
        self.media() & Medium::Gpu.bit() != 0
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

/// Which of a lookup's candidates extend their match at one block, as bitsets over endpoint
/// ids: bit `i` of word `w` is endpoint `64 w + i`. Only words `lo..=hi` (where candidates are
/// still alive) count: the lookup zeroes them in the outputs, a block sets bits there.
pub(crate) struct Extend<'a> {
    /// Candidates still matching before this block.
    pub(crate) alive: &'a [u64],
    pub(crate) lo: usize,
    pub(crate) hi: usize,
    /// Out: alive candidates that hold the block (live at `now`).
    pub(crate) next: &'a mut [u64],
    /// Out: of those, confirmed ones.
    pub(crate) confirmed: &'a mut [u64],
    /// Out: of those, confirmed only on media slower than GPU.
    pub(crate) offloaded: &'a mut [u64],
    /// Out: of the offloaded, those held in CPU memory.
    pub(crate) cpu: &'a mut [u64],
}

impl Extend<'_> {
    /// Records one holder (any endpoint: those not alive are skipped).
    #[inline]
    pub(crate) fn holder(&mut self, h: &Holder, now: u64) {
        let e = h.endpoint() as usize;
        let (w, bit) = (e / 64, 1u64 << (e % 64));
        if w < self.lo || w > self.hi || self.alive[w] & bit == 0 {
            return;
        }
        if let Some(media) = h.state(now) {
            self.next[w] |= bit;
            if media != 0 {
                self.confirmed[w] |= bit;
                if media & Medium::Gpu.bit() == 0 {
                    self.offloaded[w] |= bit;
                    if media & Medium::Cpu.bit() != 0 {
                        self.cpu[w] |= bit;
                    }
                }
            }
        }
    }
}

/// Bitsets over the holders' endpoint ids, in [`PLANES`] planes of `words` words from word `base`.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    /// Bit `i` of word `w` of a plane stands for endpoint `64 (base + w) + i`.
    base: usize,
    words: usize,
    /// Every predicted holder (in the `predicted` plane and not confirmed) expires at or after
    /// this (ms, the holders' origin): before it, the planes alone say who is live. At or past
    /// it a lookup checks those holders' expiry, and the next write re-derives the plane.
    min_until: u64,
    /// Planes: held, confirmed, on GPU, in CPU memory, predicted (live when last written).
    bits: Box<[u64]>,
}

const HELD: usize = 0;
const CONFIRMED: usize = 1;
const GPU: usize = 2;
const CPU: usize = 3;
const PREDICTED: usize = 4;
/// Planes a summary keeps.
const PLANES: usize = 5;

impl Summary {
    /// A summary of `holders` (sorted, at least one) if their ids are dense enough that the
    /// planes cost at most `per_holder_bits` bits a holder.
    fn build(holders: &[Holder], now: u64, per_holder_bits: usize) -> Option<Summary> {
        let base = holders.first()?.endpoint() as usize / 64;
        let words = holders.last()?.endpoint() as usize / 64 + 1 - base;
        if words * 64 * PLANES > holders.len() * per_holder_bits {
            return None;
        }
        let mut s = Summary {
            base,
            words,
            min_until: u64::MAX,
            bits: vec![0; PLANES * words].into_boxed_slice(),
        };
        for h in holders {
            s.set(h, now);
        }
        Some(s)
    }

    fn at(&self, e: EndpointId) -> Option<(usize, u64)> {
        let w = (e as usize / 64).checked_sub(self.base)?;
        (w < self.words).then_some((w, 1u64 << (e % 64)))
    }

    fn plane(&self, p: usize) -> &[u64] {
        &self.bits[p * self.words..(p + 1) * self.words]
    }

    fn put(&mut self, p: usize, w: usize, bit: u64, on: bool) {
        let word = &mut self.bits[p * self.words + w];
        *word = if on { *word | bit } else { *word & !bit };
    }

    /// Writes `h`'s bits (its endpoint must be in range).
    fn set(&mut self, h: &Holder, now: u64) {
        let (w, bit) = self.at(h.endpoint()).expect("endpoint within the planes");
        let predicted = h.predicted_until_ms() > now;
        self.put(HELD, w, bit, true);
        self.put(CONFIRMED, w, bit, h.confirmed());
        self.put(GPU, w, bit, h.on_gpu());
        self.put(CPU, w, bit, h.media() & Medium::Cpu.bit() != 0);
        self.put(PREDICTED, w, bit, predicted);
        if predicted && !h.confirmed() {
            self.min_until = self.min_until.min(h.predicted_until_ms());
        }
    }

    fn clear(&mut self, e: EndpointId) {
        if let Some((w, bit)) = self.at(e) {
            for p in [HELD, CONFIRMED, GPU, CPU, PREDICTED] {
                self.put(p, w, bit, false);
            }
        }
    }

    /// Drops expired predictions from the plane and raises the bound to the earliest live one.
    fn refresh(&mut self, holders: &[Holder], now: u64) {
        self.min_until = u64::MAX;
        for h in holders {
            let (w, bit) = self.at(h.endpoint()).expect("endpoint within the planes");
            let predicted = h.predicted_until_ms() > now;
            self.put(PREDICTED, w, bit, predicted);
            if predicted && !h.confirmed() {
                self.min_until = self.min_until.min(h.predicted_until_ms());
            }
        }
    }

    /// Index in `holders` (sorted) of endpoint `e`'s holder, if it has one: a popcount.
    fn rank(&self, e: EndpointId) -> Option<usize> {
        let (w, bit) = self.at(e)?;
        let held = self.plane(HELD);
        if held[w] & bit == 0 {
            return None;
        }
        let before: u32 = held[..w].iter().map(|x| x.count_ones()).sum();
        Some((before + (held[w] & (bit - 1)).count_ones()) as usize)
    }

    /// Fills `x` for this block, word by word.
    fn extend(&self, holders: &[Holder], now: u64, x: &mut Extend<'_>) {
        let lo = x.lo.max(self.base);
        let hi = x.hi.min(self.base + self.words - 1);
        if lo > hi {
            return;
        }
        let check = now >= self.min_until;
        let (held, confirmed) = (self.plane(HELD), self.plane(CONFIRMED));
        let (gpu, predicted) = (self.plane(GPU), self.plane(PREDICTED));
        let cpu = self.plane(CPU);
        // Holders before word `lo`, for ranks when predictions must be checked one by one.
        let mut rank: u32 = if check {
            held[..lo - self.base].iter().map(|x| x.count_ones()).sum()
        } else {
            0
        };
        for w in lo..=hi {
            let i = w - self.base;
            let alive = x.alive[w] & held[i];
            let mut live = confirmed[i] | predicted[i];
            if check {
                // Past the bound, some predictions may have expired: look at those of alive
                // candidates.
                let mut unsure = alive & predicted[i] & !confirmed[i];
                while unsure != 0 {
                    let bit = unsure & unsure.wrapping_neg();
                    let h = &holders[(rank + (held[i] & (bit - 1)).count_ones()) as usize];
                    if h.predicted_until_ms() <= now {
                        live &= !bit;
                    }
                    unsure &= unsure - 1;
                }
                rank += held[i].count_ones();
            }
            let next = alive & live;
            x.next[w] = next;
            x.confirmed[w] = next & confirmed[i];
            x.offloaded[w] = next & confirmed[i] & !gpu[i];
            x.cpu[w] = x.offloaded[w] & cpu[i];
        }
    }

    fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Summary>() + self.bits.len() * 8
    }
}

/// The holders of a shared block, sorted by endpoint; with many, their [`Summary`].
#[derive(Debug, Clone, Default)]
pub(crate) struct HolderList {
    holders: Vec<Holder>,
    summary: Option<Box<Summary>>,
}

impl HolderList {
    /// A list of two holders (of different endpoints).
    pub(crate) fn pair(a: Holder, b: Holder) -> HolderList {
        debug_assert_ne!(a.endpoint(), b.endpoint());
        let holders = if a.endpoint() < b.endpoint() {
            vec![a, b]
        } else {
            vec![b, a]
        };
        HolderList {
            holders,
            summary: None,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.holders.len()
    }

    pub(crate) fn holders(&self) -> &[Holder] {
        &self.holders
    }

    /// Index of `e`'s holder in [`Self::holders`], if it has one.
    pub(crate) fn position(&self, e: EndpointId) -> Option<usize> {
        match &self.summary {
            Some(s) => s.rank(e),
            None => self.holders.binary_search_by_key(&e, Holder::endpoint).ok(),
        }
    }

    /// Endpoint `e`'s holder, if it has one.
    #[cfg(test)]
    pub(crate) fn get(&self, e: EndpointId) -> Option<&Holder> {
        self.position(e).map(|i| &self.holders[i])
    }

    /// Applies `f` to `e`'s holder (which must keep its endpoint); returns it before and after.
    pub(crate) fn update(
        &mut self,
        e: EndpointId,
        now: u64,
        f: impl FnOnce(&mut Holder),
    ) -> Option<(Holder, Holder)> {
        let i = self.position(e)?;
        Some(self.update_at(i, now, f))
    }

    /// Applies `f` to the holder at `i` (a [`Self::position`]; it must keep its endpoint);
    /// returns it before and after.
    pub(crate) fn update_at(
        &mut self,
        i: usize,
        now: u64,
        f: impl FnOnce(&mut Holder),
    ) -> (Holder, Holder) {
        let was = self.holders[i];
        f(&mut self.holders[i]);
        let is = self.holders[i];
        debug_assert_eq!(is.endpoint(), was.endpoint());
        if let Some(s) = &mut self.summary {
            s.set(&is, now);
            if now >= s.min_until {
                s.refresh(&self.holders, now);
            }
        }
        (was, is)
    }

    /// Adds a holder for an endpoint that has none.
    pub(crate) fn insert(&mut self, h: Holder, now: u64) {
        let i = self
            .holders
            .partition_point(|x| x.endpoint() < h.endpoint());
        debug_assert!(self
            .holders
            .get(i)
            .is_none_or(|x| x.endpoint() != h.endpoint()));
        self.holders.insert(i, h);
        match &mut self.summary {
            Some(s) if s.at(h.endpoint()).is_some() => s.set(&h, now),
            // Outside the planes, or none yet: build them anew if the list is dense enough.
            _ => self.summarize(now, SUMMARY_MIN, SUMMARY_BITS_PER_HOLDER),
        }
    }

    /// Removes `e`'s holder; returns it.
    pub(crate) fn remove(&mut self, e: EndpointId, now: u64) -> Option<Holder> {
        let i = self.position(e)?;
        let h = self.holders.remove(i);
        if let Some(s) = &mut self.summary {
            s.clear(e);
        }
        if self.summary.is_some() {
            // Keep the planes while the list stays large and dense enough (half the bar).
            self.summarize(now, SUMMARY_KEEP, SUMMARY_KEEP_BITS_PER_HOLDER);
        }
        Some(h)
    }

    /// Builds (or drops) the summary: kept with at least `min` holders whose planes cost at
    /// most `per_holder_bits` bits a holder.
    fn summarize(&mut self, now: u64, min: usize, per_holder_bits: usize) {
        let fits = |s: &Summary| s.words * 64 * PLANES <= self.holders.len() * per_holder_bits;
        let first = self.holders.first().map(|h| h.endpoint());
        let last = self.holders.last().map(|h| h.endpoint());
        self.summary = match self.summary.take() {
            _ if self.holders.len() < min => None,
            // Still covering every holder and dense enough: keep it.
            Some(s)
                if first.is_some_and(|e| s.at(e).is_some())
                    && last.is_some_and(|e| s.at(e).is_some())
                    && fits(&s) =>
            {
                Some(s)
            }
            _ => Summary::build(&self.holders, now, per_holder_bits).map(Box::new),
        };
    }

    /// Fills `x` for this block: from the planes if there are some, else holder by holder.
    #[inline]
    pub(crate) fn extend(&self, now: u64, x: &mut Extend<'_>) {
        match &self.summary {
            Some(s) => s.extend(&self.holders, now, x),
            None => self.holders.iter().for_each(|h| x.holder(h, now)),
        }
    }

    /// Whether the list keeps a summary (for tests).
    #[cfg(test)]
    pub(crate) fn summarized(&self) -> bool {
        self.summary.is_some()
    }

    /// Heap bytes: the holders and the summary.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.holders.capacity() * std::mem::size_of::<Holder>()
            + self.summary.as_ref().map_or(0, |s| s.heap_bytes())
    }
}
