//! Blocks shared by many endpoints: the holder lists and their bitset summaries, through the
//! index's public calls, against the model of the parent module.

use super::*;

/// Endpoints at and around the bitset word boundaries, and past 64 and 256.
const WIDE: &[EndpointId] = &[
    0, 1, 2, 5, 31, 62, 63, 64, 65, 66, 100, 127, 128, 129, 191, 192, 255, 256, 257, 299,
];

/// Every id in 0..n in a scrambled order (n prime to 7919).
fn scrambled(n: u32) -> Vec<EndpointId> {
    (0..n).map(|i| (i * 7919) % n).collect()
}

/// 300 endpoints hold a 40-block prefix, inserted in scrambled order, each also its own tail;
/// confirmations and removals in other scrambled orders: every candidate subset gets exactly
/// what the model says, whichever way the block's holders are kept.
#[test]
fn three_hundred_endpoints_share_a_prefix_in_scrambled_orders() {
    let (idx, clock) = index(1_000, 10_000);
    let prefix: Vec<u64> = (1..=40).collect();
    let mut model: Vec<ModelEndpoint> = (0..300)
        .map(|_| ModelEndpoint {
            capacity: 1_000,
            ..ModelEndpoint::default()
        })
        .collect();
    let predict = |idx: &OwnershipIndex, model: &mut [ModelEndpoint], e: EndpointId, h: &[u64]| {
        idx.insert_predicted(e, h).unwrap();
        let until = clock.now_ms() + 10_000;
        model[e as usize].insert(h, false, |x| x.2 = x.2.max(until));
    };
    for &e in &scrambled(300) {
        let mut h = prefix.clone();
        h.extend([1000 + u64::from(e), 2000 + u64::from(e)]);
        predict(&idx, &mut model, e, &h);
    }
    let check = |idx: &OwnershipIndex, model: &[ModelEndpoint], what: &str| {
        let now = clock.now_ms();
        let all: Vec<EndpointId> = (0..300).collect();
        let subsets: [Vec<EndpointId>; 5] = [
            all.clone(),
            WIDE.to_vec(),
            scrambled(300).into_iter().step_by(7).collect(),
            vec![64],
            vec![299, 0, 299, 63, 400],
        ];
        for c in &subsets {
            for e in [0u64, 63, 64, 65, 299] {
                let mut h = prefix.clone();
                h.extend([1000 + e, 2000 + e]);
                let got = idx.lookup(&h, c);
                for (i, &id) in c.iter().enumerate() {
                    let expected = model
                        .get(id as usize)
                        .map_or(PrefixMatch::default(), |m| m.expect(&h, now));
                    assert_eq!(
                        got[i], expected,
                        "{what}: candidate {id} of {c:?}, tail {e}"
                    );
                }
            }
        }
    };
    check(&idx, &model, "predicted");
    // Confirm parts of the prefix on various media, in another order.
    for (k, &e) in scrambled(300).iter().rev().enumerate() {
        let m = [Medium::Gpu, Medium::Cpu, Medium::Other][k % 3];
        let upto = 10 + k % 31;
        idx.insert_confirmed(e, &prefix[..upto], m).unwrap();
        model[e as usize].insert(&prefix[..upto], false, |x| x.1 |= m.bit());
    }
    check(&idx, &model, "confirmed");
    // Time passes: unconfirmed predictions expire, confirmed blocks stay.
    clock.advance_ms(10_000);
    check(&idx, &model, "expired");
    // A few endpoints refresh the prefix; some lose blocks of it.
    for &e in WIDE {
        predict(&idx, &mut model, e, &prefix[..20]);
    }
    for &e in scrambled(300).iter().step_by(5) {
        let gone = [prefix[3 + e as usize % 30]];
        idx.remove(e, &gone, Some(Medium::Cpu));
        let list = &mut model[e as usize].list;
        if let Some(i) = list.iter().position(|x| x.0 == gone[0]) {
            list[i].1 &= !Medium::Cpu.bit();
            if list[i].1 == 0 && list[i].2 <= clock.now_ms() {
                list.remove(i);
            }
        }
    }
    check(&idx, &model, "refreshed and removed");
    let stats = idx.stats();
    let held: usize = model.iter().map(|m| m.list.len()).sum();
    assert_eq!(stats.entries, held);
}

/// An id retired while it shared blocks with 299 others, then reused: the new endpoint starts
/// with nothing, the others keep everything, and what the new one adds is its own; at the
/// word boundary ids 63, 64 and 65.
#[test]
fn ids_reused_after_retirement_start_empty_in_shared_blocks() {
    let (idx, _) = index(1_000, 60_000);
    let prefix: Vec<u64> = (1..=30).collect();
    for &e in &scrambled(300) {
        idx.insert_confirmed(e, &prefix, Medium::Gpu).unwrap();
    }
    let all: Vec<EndpointId> = (0..300).collect();
    let mut retired = Vec::new();
    for gone in [64, 63, 65] {
        idx.retire_endpoint(gone);
        retired.push(gone);
        let m = idx.lookup(&prefix, &all);
        for (e, m) in all.iter().zip(&m) {
            let expected = if retired.contains(e) { 0 } else { 30 };
            assert_eq!(m.blocks, expected, "{e} after {gone}");
        }
    }
    // The next owner of 64 predicts half the prefix; 63 and 65 stay empty.
    idx.insert_predicted(64, &prefix[..15]).unwrap();
    let m = idx.lookup(&prefix, &[62, 63, 64, 65, 66]);
    let got: Vec<(u32, u32)> = m.iter().map(|m| (m.blocks, m.confirmed_blocks)).collect();
    assert_eq!(got, [(30, 30), (0, 0), (15, 0), (0, 0), (30, 30)]);
    assert_eq!(idx.stats().entries, 297 * 30 + 15);
}

/// Holders past the first 256 (ids up to 599) with candidates that start beyond the first
/// word and a match that ends at different blocks for candidates in different words.
#[test]
fn matches_end_at_different_blocks_across_words() {
    let (idx, _) = index(1_000, 60_000);
    let prefix: Vec<u64> = (1..=64).collect();
    // Endpoint e holds the first e % 64 + 1 blocks.
    for &e in &scrambled(600) {
        let n = e as usize % 64 + 1;
        idx.insert_predicted(e, &prefix[..n]).unwrap();
    }
    let c: Vec<EndpointId> = (130..600).rev().collect();
    let m = idx.lookup(&prefix, &c);
    for (i, &e) in c.iter().enumerate() {
        assert_eq!(m[i].blocks as usize, e as usize % 64 + 1, "{e}");
    }
}

#[derive(Debug, Clone)]
enum WideOp {
    Predict(Vec<EndpointId>, Vec<u64>),
    Confirm(Vec<EndpointId>, Vec<u64>, Medium),
    Remove(EndpointId, Vec<u64>, Option<Medium>),
    Clear(EndpointId),
    Retire(EndpointId),
    Advance(u64),
    Lookup(Vec<u64>, Vec<EndpointId>),
}

fn arb_endpoint() -> impl Strategy<Value = EndpointId> {
    prop_oneof![0u32..8, 56u32..72, 120u32..136, 250u32..262, 0u32..300]
}

fn arb_many() -> impl Strategy<Value = Vec<EndpointId>> {
    prop_oneof![
        prop::collection::vec(arb_endpoint(), 1..6),
        // A contiguous run of ids: enough holders for the bitset summaries.
        (0u32..260, 30u32..120).prop_map(|(a, n)| (a..(a + n).min(300)).collect()),
    ]
}

fn arb_wide_op() -> impl Strategy<Value = WideOp> {
    let hashes = || prop::collection::vec(0u64..6, 0..6);
    prop_oneof![
        3 => (arb_many(), hashes()).prop_map(|(e, h)| WideOp::Predict(e, h)),
        2 => (arb_many(), hashes(), arb_medium()).prop_map(|(e, h, m)| WideOp::Confirm(e, h, m)),
        2 => (arb_endpoint(), hashes(), proptest::option::of(arb_medium()))
            .prop_map(|(e, h, m)| WideOp::Remove(e, h, m)),
        1 => arb_endpoint().prop_map(WideOp::Clear),
        1 => arb_endpoint().prop_map(WideOp::Retire),
        1 => (0u64..1500).prop_map(WideOp::Advance),
        3 => (hashes(), prop_oneof![arb_many(), prop::collection::vec(0u32..310, 0..40)])
            .prop_map(|(h, c)| WideOp::Lookup(h, c)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Hundreds of endpoints on a handful of blocks, so blocks gain and lose their bitset
    /// summaries, ids are retired and reused, predictions expire: lookups say exactly what the
    /// model says (matched, confirmed, offloaded and CPU blocks).
    #[test]
    fn widely_shared_blocks_match_the_model(ops in prop::collection::vec(arb_wide_op(), 1..40)) {
        let (idx, clock) = index(CAPACITY, TTL_MS);
        let fresh = || ModelEndpoint { capacity: CAPACITY, ..ModelEndpoint::default() };
        let mut model: Vec<ModelEndpoint> = (0..300).map(|_| fresh()).collect();
        for op in ops {
            let now = clock.now_ms();
            match op {
                WideOp::Predict(es, h) => {
                    for e in es {
                        idx.insert_predicted(e, &h).unwrap();
                        model[e as usize].insert(&h, false, |x| x.2 = x.2.max(now + TTL_MS));
                    }
                }
                WideOp::Confirm(es, h, m) => {
                    for e in es {
                        idx.insert_confirmed(e, &h, m).unwrap();
                        model[e as usize].insert(&h, false, |x| x.1 |= m.bit());
                    }
                }
                WideOp::Remove(e, h, m) => {
                    idx.remove(e, &h, m);
                    model[e as usize].remove(&h, m, now);
                }
                WideOp::Clear(e) => {
                    idx.clear_endpoint(e);
                    model[e as usize].list.clear();
                }
                WideOp::Retire(e) => {
                    idx.retire_endpoint(e);
                    model[e as usize] = fresh();
                }
                WideOp::Advance(ms) => clock.advance_ms(ms),
                WideOp::Lookup(h, c) => {
                    let got = idx.lookup(&h, &c);
                    for (i, &e) in c.iter().enumerate() {
                        let expected = model
                            .get(e as usize)
                            .map_or(PrefixMatch::default(), |m| m.expect(&h, now));
                        prop_assert_eq!(got[i], expected, "candidate {}", e);
                    }
                }
            }
            let stats = idx.stats();
            for s in &stats.endpoints {
                let m = &model[s.endpoint as usize];
                prop_assert_eq!(s.blocks, m.list.len());
                prop_assert_eq!(s.confirmed_blocks, m.list.iter().filter(|x| x.1 != 0).count());
            }
            let total: usize = model.iter().map(|m| m.list.len()).sum();
            prop_assert_eq!(total, stats.entries);
        }
    }
}
