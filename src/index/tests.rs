use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn index(capacity: usize, ttl_ms: u64) -> (OwnershipIndex, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(1_000));
    let options = IndexOptions {
        default_capacity_blocks: capacity,
        prediction_ttl: Duration::from_millis(ttl_ms),
        shards: 4,
    };
    (OwnershipIndex::new(options, clock.clone()), clock)
}

fn blocks(m: &[PrefixMatch]) -> Vec<u32> {
    m.iter().map(|m| m.blocks).collect()
}

#[test]
fn lookup_counts_consecutive_blocks_per_candidate() {
    let (idx, _) = index(100, 10_000);
    idx.insert_predicted(0, &[1, 2, 3, 4]).unwrap();
    idx.insert_predicted(1, &[1, 2]).unwrap();
    idx.insert_predicted(2, &[2, 3, 4]).unwrap(); // no block 0: no prefix
    let cases: &[(&[u64], &[EndpointId], &[u32])] = &[
        (&[1, 2, 3, 4, 5], &[0, 1, 2, 3], &[4, 2, 0, 0]),
        (&[1, 2, 9, 4], &[0, 1], &[2, 2]),
        (&[9, 1, 2], &[0, 1, 2], &[0, 0, 0]),
        (&[1, 2, 3], &[1, 0, 1], &[2, 3, 2]),
        (&[1, 2, 3], &[], &[]),
        (&[], &[0], &[0]),
        (&[1, 2, 3], &[7], &[0]),
    ];
    for (hashes, candidates, expected) in cases {
        assert_eq!(
            blocks(&idx.lookup(hashes, candidates)),
            *expected,
            "{hashes:?} {candidates:?}"
        );
    }
}

#[test]
fn predictions_expire_and_confirmations_do_not() {
    let (idx, clock) = index(100, 2_000);
    idx.insert_predicted(0, &[1, 2, 3]).unwrap();
    idx.insert_confirmed(1, &[1, 2, 3], Medium::Gpu).unwrap();
    clock.advance_ms(1_999);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[0, 1])), [3, 3]);
    let m = idx.lookup(&[1, 2, 3], &[0, 1]);
    assert_eq!((m[0].confirmed_blocks, m[0].predicted_blocks()), (0, 3));
    assert_eq!((m[1].confirmed_blocks, m[1].predicted_blocks()), (3, 0));
    clock.advance_ms(1);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[0, 1])), [0, 3]);
    // A fresh prediction revives it; a confirmation makes it permanent.
    idx.insert_predicted(0, &[1, 2]).unwrap();
    idx.insert_confirmed(0, &[1], Medium::Cpu).unwrap();
    clock.advance_ms(10_000);
    let m = idx.lookup(&[1, 2, 3], &[0]);
    assert_eq!(
        (m[0].blocks, m[0].confirmed_blocks, m[0].offloaded_blocks),
        (1, 1, 1)
    );
    // An explicit short TTL (while events flow and will confirm) expires on its own clock.
    idx.insert_predicted_for(2, &[5], Duration::from_millis(100))
        .unwrap();
    clock.advance_ms(100);
    assert_eq!(blocks(&idx.lookup(&[5], &[2])), [0]);
}

#[test]
fn capacity_evicts_least_recently_used_tails_first() {
    let (idx, _) = index(4, 60_000);
    idx.insert_predicted(0, &[1, 2, 3]).unwrap();
    idx.insert_predicted(0, &[10, 11, 12]).unwrap();
    // 6 blocks into 4: the first prompt's tail (3, 2) went first; its block 1 survives.
    assert_eq!(blocks(&idx.lookup(&[10, 11, 12], &[0])), [3]);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[0])), [1]);
    // A re-insert refreshes: prompt 1 is now the most recent.
    idx.insert_predicted(0, &[1]).unwrap();
    idx.insert_predicted(0, &[20]).unwrap();
    assert_eq!(blocks(&idx.lookup(&[1], &[0])), [1]);
    assert_eq!(blocks(&idx.lookup(&[10, 11, 12], &[0])), [2]);
    // Shrinking the capacity evicts at once.
    idx.set_capacity(0, 1).unwrap();
    let stats = idx.stats();
    assert_eq!(stats.endpoints[0].blocks, 1);
    assert_eq!(stats.endpoints[0].capacity_blocks, 1);
    assert_eq!(blocks(&idx.lookup(&[20], &[0])), [1], "most recent kept");
    // A prompt longer than the capacity keeps its prefix.
    idx.set_capacity(0, 3).unwrap();
    idx.insert_predicted(0, &[30, 31, 32, 33, 34]).unwrap();
    assert_eq!(blocks(&idx.lookup(&[30, 31, 32, 33, 34], &[0])), [3]);
}

#[test]
fn remove_by_medium_and_clear_endpoint() {
    let (idx, clock) = index(100, 1_000);
    idx.insert_confirmed(0, &[1, 2, 3], Medium::Gpu).unwrap();
    idx.insert_confirmed(0, &[1], Medium::Cpu).unwrap();
    idx.insert_predicted(1, &[1, 2, 3]).unwrap();
    // GPU copy of block 1 removed: the CPU copy keeps it, now offloaded.
    idx.remove(0, &[1], Some(Medium::Gpu));
    let m = idx.lookup(&[1, 2, 3], &[0]);
    assert_eq!(
        (m[0].blocks, m[0].offloaded_blocks, m[0].cpu_blocks),
        (3, 1, 1)
    );
    // Block 3 also on disk, then only there: offloaded, but not in CPU memory.
    idx.insert_confirmed(0, &[3], Medium::Other).unwrap();
    assert_eq!(idx.lookup(&[1, 2, 3], &[0])[0].offloaded_blocks, 1);
    idx.remove(0, &[3], Some(Medium::Gpu));
    let m = idx.lookup(&[1, 2, 3], &[0]);
    assert_eq!(
        (m[0].blocks, m[0].offloaded_blocks, m[0].cpu_blocks),
        (3, 2, 1)
    );
    idx.insert_confirmed(0, &[3], Medium::Gpu).unwrap();
    // Removing block 2 entirely cuts the run; endpoint 1 is untouched.
    idx.remove(0, &[2], None);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[0, 1])), [1, 3]);
    idx.remove(9, &[1], None); // unknown endpoint: nothing happens
    assert_eq!(idx.stats().endpoints[0].confirmed_blocks, 2);
    idx.clear_endpoint(0);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[0, 1])), [0, 3]);
    let stats = idx.stats();
    assert_eq!(stats.endpoints[0].blocks, 0);
    assert_eq!(stats.endpoints[0].confirmed_blocks, 0);
    assert_eq!((stats.blocks, stats.entries), (3, 3));
    clock.advance_ms(1_000);
    idx.clear_endpoint(1);
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.entries), (0, 0));
}

#[test]
fn a_retired_endpoint_leaves_nothing_and_its_id_starts_fresh() {
    let (idx, _) = index(100, 60_000);
    let hashes: Vec<u64> = (1..=50).collect();
    idx.insert_confirmed(0, &hashes, Medium::Gpu).unwrap();
    idx.insert_predicted(1, &hashes).unwrap();
    idx.insert_predicted(2, &hashes[..10]).unwrap();
    idx.set_capacity(2, 7).unwrap();
    let before = idx.stats();
    idx.retire_endpoint(2);
    let stats = idx.stats();
    let ids: Vec<EndpointId> = stats.endpoints.iter().map(|e| e.endpoint).collect();
    assert_eq!(ids, [0, 1], "its state is gone, not just emptied");
    assert_eq!(stats.entries, 100);
    assert!(stats.heap_bytes < before.heap_bytes);
    assert_eq!(blocks(&idx.lookup(&hashes, &[0, 1, 2])), [50, 50, 0]);
    // Whoever gets id 2 next starts with the default capacity and nothing held.
    idx.insert_predicted(2, &hashes[..3]).unwrap();
    let fresh = idx.stats().endpoints[2];
    assert_eq!((fresh.blocks, fresh.capacity_blocks), (3, 100));
    // Retiring the highest ids shortens the per-endpoint table.
    idx.retire_endpoint(2);
    idx.retire_endpoint(1);
    idx.retire_endpoint(9); // never seen: nothing happens
    assert_eq!(idx.endpoints.read().len(), 1);
    assert_eq!(idx.stats().entries, 50);
}

#[test]
fn an_insert_that_looked_up_the_endpoint_before_its_retirement_adds_nothing() {
    let (idx, _) = index(100, 60_000);
    idx.insert_predicted(3, &[1, 2]).unwrap();
    // A writer (a decision's commit, a KV-event batch) found the state, then lost the race.
    let stale = idx.endpoint(3).unwrap();
    idx.retire_endpoint(3);
    idx.insert_into(&stale, 3, &[1, 2, 3], None, |h| {
        h.set_media(Medium::Gpu.bit())
    });
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.entries), (0, 0));
    assert!(stats.endpoints.is_empty());
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3], &[3])), [0]);
    assert!(stale.lock().retired, "marked for whoever still holds it");
}

#[test]
fn endpoint_ids_past_the_packing_limit_are_refused() {
    let (idx, _) = index(10, 10);
    assert_eq!(
        idx.insert_predicted(1 << 24, &[1]),
        Err(IndexError::EndpointOutOfRange(1 << 24))
    );
    assert!(idx.set_capacity(1 << 24, 1).is_err());
}

#[test]
fn stats_report_memory_per_entry() {
    let (idx, _) = index(100_000, 60_000);
    let hashes: Vec<u64> = (0..10_000u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    idx.insert_predicted(0, &hashes).unwrap();
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.entries), (10_000, 10_000));
    let per_entry = stats.heap_bytes / stats.entries;
    // 20-byte record, a 4-byte table slot per 0.7 to 0.875 blocks, 12-byte recency node, and
    // the last pages' spare room (10k entries in 4 shards: 3 pages of records each).
    assert!(
        (36..=48).contains(&per_entry),
        "{per_entry} bytes per entry"
    );
}

#[test]
fn concurrent_readers_and_writers_keep_invariants() {
    let (idx, _) = index(50, 60_000);
    let idx = Arc::new(idx);
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let idx = Arc::clone(&idx);
            std::thread::spawn(move || {
                for round in 0..300u64 {
                    let hashes: Vec<u64> = (0..20).map(|i| (round % 7) * 100 + i).collect();
                    idx.insert_predicted(t, &hashes).unwrap();
                    let m = idx.lookup(&hashes, &[0, 1, 2, 3]);
                    assert!(m.iter().all(|m| m.blocks <= 20));
                    if round % 50 == 0 {
                        idx.clear_endpoint((t + 1) % 4);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = idx.stats();
    assert!(stats.endpoints.iter().all(|e| e.blocks <= 50));
    let per_endpoint: usize = stats.endpoints.iter().map(|e| e.blocks).sum();
    assert_eq!(per_endpoint, stats.entries, "map and recency lists agree");
}

/// A straightforward model of one endpoint: recency list (front = most recent) of
/// (hash, confirmed media bits, predicted-until), the blocks held beyond the capacity for
/// routed requests not yet prefilled, the pins of routed requests not ended (by hash: never
/// evicted; unpinned last, a block goes to the front), with the clears since the start (a
/// claim from before a clear settles and unpins nothing).
#[derive(Default, Clone)]
struct ModelEndpoint {
    list: VecDeque<(u64, u8, u64)>,
    capacity: usize,
    pending: usize,
    pins: HashMap<u64, usize>,
    clears: u64,
}

/// The model's side of an open claim: its endpoint, pending blocks, the endpoint's clears when
/// it was taken and the blocks it pinned.
struct ModelClaim {
    endpoint: usize,
    pending: usize,
    clears: u64,
    pinned: Vec<u64>,
}

#[derive(Debug, Clone)]
enum Op {
    Predict(u32, Vec<u64>),
    Confirm(u32, Vec<u64>, Medium),
    Remove(u32, Vec<u64>, Option<Medium>),
    Clear(u32),
    Capacity(u32, usize),
    /// A request routed to the endpoint with these blocks (its claim kept open).
    Route(u32, Vec<u64>),
    /// The prefill of the open claim at this index (modulo their count) is done.
    Prefilled(usize),
    /// The request of the open claim at this index (modulo their count) ended.
    Ended(usize),
    Advance(u64),
    Lookup(Vec<u64>, Vec<u32>),
}

fn arb_hashes() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..12, 0..8)
}

fn arb_medium() -> impl Strategy<Value = Medium> {
    prop_oneof![Just(Medium::Gpu), Just(Medium::Cpu), Just(Medium::Other)]
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..4, arb_hashes()).prop_map(|(e, h)| Op::Predict(e, h)),
        2 => (0u32..4, arb_hashes(), arb_medium()).prop_map(|(e, h, m)| Op::Confirm(e, h, m)),
        1 => (0u32..4, arb_hashes(), proptest::option::of(arb_medium())).prop_map(|(e, h, m)| Op::Remove(e, h, m)),
        1 => (0u32..4).prop_map(Op::Clear),
        1 => (0u32..4, 0usize..8).prop_map(|(e, c)| Op::Capacity(e, c)),
        2 => (0u32..4, arb_hashes()).prop_map(|(e, h)| Op::Route(e, h)),
        2 => (0usize..8).prop_map(Op::Prefilled),
        2 => (0usize..8).prop_map(Op::Ended),
        1 => (0u64..1500).prop_map(Op::Advance),
        3 => (arb_hashes(), prop::collection::vec(0u32..5, 0..5)).prop_map(|(h, c)| Op::Lookup(h, c)),
    ]
}

const TTL_MS: u64 = 1_000;
const CAPACITY: usize = 6;

impl ModelEndpoint {
    /// Evicts the least recent unpinned blocks while over the capacity and pending blocks.
    fn evict(&mut self) {
        while self.list.len() > self.capacity + self.pending {
            let Some(i) = self
                .list
                .iter()
                .rposition(|e| !self.pins.contains_key(&e.0))
            else {
                break;
            };
            self.list.remove(i);
        }
    }

    /// Inserts `hashes`, last first; with `pending` (a routed request), each block new here is
    /// held beyond the capacity (while fewer than the capacity are), and every block is pinned
    /// when all fit within the capacity; returns how many were pending and the blocks pinned.
    fn insert(
        &mut self,
        hashes: &[u64],
        pending: bool,
        update: impl Fn(&mut (u64, u8, u64)),
    ) -> (usize, Vec<u64>) {
        let mut counted = 0;
        let mut pinned = Vec::new();
        let pin = pending && self.pins.len() + hashes.len() <= self.capacity;
        for &h in hashes.iter().rev() {
            let mut entry = match self.list.iter().position(|e| e.0 == h) {
                Some(i) => self.list.remove(i).unwrap(),
                None => {
                    if pending && self.pending < self.capacity {
                        self.pending += 1;
                        counted += 1;
                    }
                    (h, 0, 0)
                }
            };
            update(&mut entry);
            self.list.push_front(entry);
            if pin {
                *self.pins.entry(h).or_default() += 1;
                pinned.push(h);
            }
            self.evict();
        }
        (counted, pinned)
    }

    /// A routed request ended: its pins go, in the order taken; a block whose last pin went
    /// becomes the most recent.
    fn unpin(&mut self, pinned: &[u64]) {
        for h in pinned {
            let Some(n) = self.pins.get_mut(h) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.pins.remove(h);
                let i = self.list.iter().position(|e| e.0 == *h).unwrap();
                let entry = self.list.remove(i).unwrap();
                self.list.push_front(entry);
            }
        }
    }

    /// What `OwnershipIndex::remove` does to the endpoint: each of `hashes` loses medium `m`
    /// (and goes once it has no medium left and no unexpired prediction), or goes outright
    /// when `m` is `None`.
    fn remove(&mut self, hashes: &[u64], m: Option<Medium>, now: u64) {
        for &hash in hashes {
            if let Some(i) = self.list.iter().position(|x| x.0 == hash) {
                let keep = match m {
                    Some(m) => {
                        self.list[i].1 &= !m.bit();
                        self.list[i].1 != 0 || self.list[i].2 > now
                    }
                    None => false,
                };
                if !keep {
                    self.list.remove(i);
                    self.pins.remove(&hash);
                }
            }
        }
    }

    /// The media bits of `h` if held at `now` (`Some(0)`: by an unexpired prediction only).
    fn holds(&self, h: u64, now: u64) -> Option<u8> {
        self.list
            .iter()
            .find(|e| e.0 == h && (e.1 != 0 || e.2 > now))
            .map(|e| e.1)
    }

    /// What a lookup of `hashes` should say of this endpoint at `now`.
    fn expect(&self, hashes: &[u64], now: u64) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for media in hashes.iter().map_while(|&h| self.holds(h, now)) {
            m.blocks += 1;
            m.confirmed_blocks += u32::from(media != 0);
            let offloaded = media != 0 && media & Medium::Gpu.bit() == 0;
            m.offloaded_blocks += u32::from(offloaded);
            m.cpu_blocks += u32::from(offloaded && media & Medium::Cpu.bit() != 0);
        }
        m
    }
}

proptest! {
    #[test]
    fn index_matches_a_simple_model(ops in prop::collection::vec(arb_op(), 1..60)) {
        let (idx, clock) = index(CAPACITY, TTL_MS);
        let idx = Arc::new(idx);
        let mut model: Vec<ModelEndpoint> = (0..4)
            .map(|_| ModelEndpoint { capacity: CAPACITY, ..ModelEndpoint::default() })
            .collect();
        // Open claims: the index's, and the model's.
        let mut claims: Vec<(PendingBlocks, ModelClaim)> = Vec::new();
        for op in ops {
            let now = clock.now_ms();
            match op {
                Op::Predict(e, h) => {
                    idx.insert_predicted(e, &h).unwrap();
                    model[e as usize].insert(&h, false, |x| x.2 = x.2.max(now + TTL_MS));
                }
                Op::Confirm(e, h, m) => {
                    idx.insert_confirmed(e, &h, m).unwrap();
                    model[e as usize].insert(&h, false, |x| x.1 |= m.bit());
                }
                // Removing a pinned block (the engine's word while our request runs there) is
                // left out: with KV events configured no routed request pins (the router takes
                // the event-fed path), and a claim identifies its pins by slot, not hash.
                Op::Remove(e, h, _) if h.iter().any(|x| model[e as usize].pins.contains_key(x)) => {}
                Op::Remove(e, h, m) => {
                    idx.remove(e, &h, m);
                    model[e as usize].remove(&h, m, now);
                }
                Op::Clear(e) => {
                    idx.clear_endpoint(e);
                    let m = &mut model[e as usize];
                    m.list.clear();
                    m.pending = 0;
                    m.pins.clear();
                    m.clears += 1;
                }
                Op::Capacity(e, c) => {
                    idx.set_capacity(e, c).unwrap();
                    let m = &mut model[e as usize];
                    m.capacity = c;
                    m.evict();
                }
                Op::Route(e, h) => {
                    let claim = idx.insert_routed(e, &h).unwrap();
                    let m = &mut model[e as usize];
                    let (counted, pinned) = m.insert(&h, true, |x| x.2 = x.2.max(now + TTL_MS));
                    prop_assert_eq!(claim.blocks(), counted);
                    prop_assert_eq!(claim.pinned(), pinned.len());
                    let clears = m.clears;
                    claims.push((claim, ModelClaim { endpoint: e as usize, pending: counted, clears, pinned }));
                }
                Op::Prefilled(i) if !claims.is_empty() => {
                    let i = i % claims.len();
                    let (claim, c) = &mut claims[i];
                    claim.prefilled();
                    let m = &mut model[c.endpoint];
                    if m.clears == c.clears {
                        m.pending -= c.pending;
                        m.evict();
                    }
                    c.pending = 0;
                }
                Op::Ended(i) if !claims.is_empty() => {
                    let (claim, c) = claims.swap_remove(i % claims.len());
                    drop(claim);
                    let m = &mut model[c.endpoint];
                    if m.clears == c.clears {
                        m.pending -= c.pending;
                        m.evict();
                        m.unpin(&c.pinned);
                        m.evict();
                    }
                }
                Op::Prefilled(_) | Op::Ended(_) => {}
                Op::Advance(ms) => clock.advance_ms(ms),
                Op::Lookup(h, c) => {
                    let got = idx.lookup(&h, &c);
                    let now = clock.now_ms();
                    for (i, &e) in c.iter().enumerate() {
                        let expected = match model.get(e as usize) {
                            Some(m) => m.expect(&h, now),
                            None => PrefixMatch::default(),
                        };
                        prop_assert_eq!(got[i], expected, "candidate {}", e);
                    }
                }
            }
            // Invariants after every step: capacity (and pending blocks beyond it) respected,
            // map and lists agree.
            let stats = idx.stats();
            for s in &stats.endpoints {
                let m = &model[s.endpoint as usize];
                // (Pinned blocks stay when the capacity is lowered below them.)
                prop_assert!(
                    s.blocks <= s.capacity_blocks.max(s.pinned_blocks) + s.pending_blocks
                );
                prop_assert_eq!(s.pending_blocks, m.pending);
                prop_assert_eq!(s.pinned_blocks, m.pins.len());
                prop_assert_eq!(s.blocks, m.list.len());
                prop_assert_eq!(s.confirmed_blocks, m.list.iter().filter(|x| x.1 != 0).count());
            }
            let total: usize = stats.endpoints.iter().map(|e| e.blocks).sum();
            prop_assert_eq!(total, stats.entries);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn predictions_expire_on_paused_tokio_time() {
    let options = IndexOptions {
        prediction_ttl: Duration::from_secs(2),
        ..IndexOptions::default()
    };
    let idx = OwnershipIndex::new(options, Arc::new(TokioClock::new()));
    idx.insert_predicted(0, &[1, 2]).unwrap();
    tokio::time::advance(Duration::from_millis(1_999)).await;
    assert_eq!(blocks(&idx.lookup(&[1, 2], &[0])), [2]);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(blocks(&idx.lookup(&[1, 2], &[0])), [0]);
}

mod shared;

fn pending_of(idx: &OwnershipIndex, endpoint: EndpointId) -> usize {
    idx.stats()
        .endpoints
        .iter()
        .find(|e| e.endpoint == endpoint)
        .map_or(0, |e| e.pending_blocks)
}

/// A routed request's new blocks push nothing out of a full endpoint until its prefill is done
/// (the claim is dropped); then the least recently used blocks past the capacity go.
#[test]
fn pending_blocks_evict_only_once_their_prefill_is_done() {
    let (idx, _) = index(4, 60_000);
    let idx = Arc::new(idx);
    idx.insert_predicted(0, &[1, 2, 3, 4]).unwrap();
    let claim = idx.insert_routed(0, &[10, 11, 12]).unwrap();
    assert_eq!((claim.blocks(), pending_of(&idx, 0)), (3, 3));
    assert_eq!(
        blocks(&idx.lookup(&[1, 2, 3, 4], &[0])),
        [4],
        "nothing evicted"
    );
    assert_eq!(blocks(&idx.lookup(&[10, 11, 12], &[0])), [3]);
    // A second request of the same prefix adds nothing new: it claims nothing.
    let again = idx.insert_routed(0, &[10, 11]).unwrap();
    assert_eq!(again.blocks(), 0);
    drop(again);
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3, 4], &[0])), [4]);
    // Other traffic past capacity plus pending evicts the least recent (the old tails).
    idx.insert_predicted(0, &[20]).unwrap();
    assert_eq!(blocks(&idx.lookup(&[1, 2, 3, 4], &[0])), [3]);
    let mut claim = claim;
    claim.prefilled();
    claim.prefilled(); // idempotent
    assert_eq!((claim.blocks(), pending_of(&idx, 0)), (0, 0));
    assert_eq!(idx.stats().endpoints[0].blocks, 4);
    assert_eq!(blocks(&idx.lookup(&[10, 11, 12], &[0])), [3]);
    assert_eq!(blocks(&idx.lookup(&[20], &[0])), [1]);
    assert_eq!(
        blocks(&idx.lookup(&[1, 2, 3, 4], &[0])),
        [0],
        "the old prefix went"
    );
    drop(claim);
    assert_eq!(idx.stats().endpoints[0].blocks, 4, "nothing more to settle");
}

/// Pending blocks stretch an endpoint to at most twice its capacity, and a claim taken before
/// the endpoint was cleared settles nothing of the claims made since.
#[test]
fn pending_blocks_are_bounded_and_a_clear_ends_their_claims() {
    let (idx, _) = index(4, 60_000);
    let idx = Arc::new(idx);
    let hashes: Vec<u64> = (1..=10).collect();
    let big = idx.insert_routed(0, &hashes).unwrap();
    assert_eq!(big.blocks(), 4);
    assert_eq!(idx.stats().endpoints[0].blocks, 8);
    assert_eq!(
        blocks(&idx.lookup(&hashes, &[0])),
        [8],
        "tails dropped first"
    );
    idx.clear_endpoint(0);
    assert_eq!(pending_of(&idx, 0), 0);
    let fresh = idx.insert_routed(0, &[30, 31]).unwrap();
    assert_eq!(pending_of(&idx, 0), 2);
    drop(big);
    assert_eq!(pending_of(&idx, 0), 2, "the cleared claim settles nothing");
    drop(fresh);
    assert_eq!(pending_of(&idx, 0), 0);
    // A retired endpoint's claim is a no-op too.
    let late = idx.insert_routed(1, &[40]).unwrap();
    idx.retire_endpoint(1);
    drop(late);
    assert!(idx.stats().endpoints.iter().all(|e| e.endpoint != 1));
}

/// Request A pins block 7; the engine removes it; request B (the same prefix, same home) adds
/// it again, into the same slot with the same record. A's end must not take B's pin: block 7
/// is not evictable while B runs.
#[test]
fn a_pin_taken_before_a_removal_leaves_the_readded_blocks_pin() {
    let (idx, _) = index(4, 60_000);
    let idx = Arc::new(idx);
    let mut a = idx.insert_routed(0, &[7]).unwrap();
    idx.remove(0, &[7], None);
    let b = idx.insert_routed(0, &[7]).unwrap();
    a.release();
    assert_eq!(idx.stats().endpoints[0].pinned_blocks, 1, "B's pin stays");
    idx.insert_predicted(0, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(
        blocks(&idx.lookup(&[7], &[0])),
        [1],
        "not evicted while B runs"
    );
    drop(b);
    assert_eq!(idx.stats().endpoints[0].pinned_blocks, 0);
}
