use super::super::holders::SUMMARY_MIN;
use super::super::{Holder, Medium};
use super::*;

fn endpoints(s: &Shard, hash: u64) -> Vec<EndpointId> {
    match s.block(hash) {
        None => Vec::new(),
        Some(Block::One(h)) => vec![h.endpoint()],
        Some(Block::Many(list)) => {
            let v: Vec<_> = list.holders().iter().map(Holder::endpoint).collect();
            assert!(v.windows(2).all(|w| w[0] < w[1]), "sorted: {v:?}");
            v
        }
    }
}

/// What a lookup with every endpoint alive says of one block: (held, confirmed, offloaded,
/// offloaded in CPU memory).
fn extend(s: &Shard, hash: u64, now: u64, max_id: usize) -> [Vec<usize>; 4] {
    let words = max_id / 64 + 1;
    let alive = vec![u64::MAX; words];
    let (mut next, mut confirmed) = (vec![0; words], vec![0; words]);
    let (mut offloaded, mut cpu) = (vec![0; words], vec![0; words]);
    if let Some(b) = s.block(hash) {
        b.extend(
            now,
            &mut Extend {
                alive: &alive,
                lo: 0,
                hi: words - 1,
                next: &mut next,
                confirmed: &mut confirmed,
                offloaded: &mut offloaded,
                cpu: &mut cpu,
            },
        );
    }
    let ids = |bits: &[u64]| -> Vec<usize> {
        (0..words * 64)
            .filter(|&e| bits[e / 64] >> (e % 64) & 1 == 1)
            .collect()
    };
    [ids(&next), ids(&confirmed), ids(&offloaded), ids(&cpu)]
}

#[test]
fn holders_and_records_pack_into_twelve_and_twenty_bytes() {
    assert_eq!(std::mem::size_of::<Holder>(), 12);
    assert_eq!(std::mem::size_of::<Record>(), 20);
    let mut x = Holder::new(super::super::MAX_ENDPOINT_ID, 7);
    assert!(!x.confirmed() && !x.live(0));
    x.set_predicted_until_ms(100);
    assert!(x.live(99) && !x.live(100));
    x.set_media(Medium::Cpu.bit());
    assert_eq!(x.endpoint(), super::super::MAX_ENDPOINT_ID);
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
    assert_eq!(
        x.predicted_until_ms(),
        super::super::MAX_UNTIL_MS,
        "saturates"
    );
    assert_eq!((x.endpoint(), x.slot), (super::super::MAX_ENDPOINT_ID, 7));
    assert_eq!(x.media(), Medium::Cpu.bit() | Medium::Gpu.bit());
    assert_eq!(Holder::from_words(x.to_words()), x);
}

fn predicted(ep: EndpointId, slot: u32, until: u64) -> Holder {
    let mut h = Holder::new(ep, slot);
    h.set_predicted_until_ms(until);
    h
}

#[test]
fn holders_grow_shrink_and_freed_records_are_reused() {
    let mut s = Shard::new(1 << 20);
    let mut records = Vec::new();
    for hash in 0..100u64 {
        records.push(s.add(hash, predicted(1, hash as u32, 50), 0).unwrap());
    }
    assert_eq!(
        s.add(5, predicted(2, 50, 50), 0),
        Ok(records[5]),
        "same block"
    );
    s.add(5, predicted(3, 51, 50), 0).unwrap();
    assert_eq!(endpoints(&s, 5), [1, 2, 3]);
    assert_eq!((s.len(), s.entries()), (100, 102));
    assert_eq!(s.get(5, 3).unwrap().slot, 51);
    assert!(s.get(5, 4).is_none());
    assert_eq!(s.remove(5, 1, 0).unwrap().slot, 5, "the first holder");
    assert_eq!(s.remove(5, 1, 0), None);
    assert_eq!(endpoints(&s, 5), [2, 3]);
    assert_eq!(s.remove_at(records[5], 3, 0).unwrap().slot, 51, "by record");
    assert_eq!(endpoints(&s, 5), [2]);
    assert!(matches!(s.block(5), Some(Block::One(_))), "back inline");
    assert_eq!(s.free_lists, [0], "the emptied list is free again");
    // Removing whole blocks frees their records; the others keep theirs.
    for hash in (0..100u64).step_by(3) {
        let ep = if hash == 5 { 2 } else { 1 };
        assert!(s.remove(hash, ep, 0).is_some(), "{hash}");
    }
    for hash in 0..100u64 {
        let expected: &[EndpointId] = match (hash % 3, hash) {
            (0, _) => &[],
            (_, 5) => &[2],
            _ => &[1],
        };
        assert_eq!(endpoints(&s, hash), expected, "{hash}");
        if hash % 3 != 0 {
            assert_eq!(s.find(hash), Some(records[hash as usize] as usize));
        }
    }
    assert_eq!(s.len(), 66);
    // New blocks take the freed records (most recently freed first), not new ones.
    let reused = s.add(1000, predicted(1, 7, 50), 0).unwrap();
    assert_eq!(reused, records[99]);
    assert_eq!(s.records.len(), 100);
    assert!(s.heap_bytes() >= 100 * 20);
    // Once every block left, the pages go.
    for hash in (0..100u64).filter(|h| h % 3 != 0).chain([1000]) {
        let ep = if hash == 5 { 2 } else { 1 };
        assert!(s.remove(hash, ep, 0).is_some());
    }
    assert_eq!((s.len(), s.entries(), s.heap_bytes()), (0, 0, 0));
    assert_eq!(s.add(7, predicted(1, 0, 50), 0), Ok(0));
}

#[test]
fn a_full_shard_refuses_new_blocks_but_not_new_holders() {
    let mut s = Shard::new(2);
    s.add(1, predicted(0, 0, 50), 0).unwrap();
    s.add(2, predicted(0, 1, 50), 0).unwrap();
    assert_eq!(s.add(3, predicted(0, 2, 50), 0), Err(Full));
    assert_eq!((s.len(), s.entries()), (2, 2));
    assert!(s.add(2, predicted(1, 0, 50), 0).is_ok(), "another holder");
    s.remove(1, 0, 0).unwrap();
    assert!(s.add(3, predicted(0, 2, 50), 0).is_ok(), "a freed record");
    assert_eq!(endpoints(&s, 3), [0]);
}

/// A block held by many endpoints, added and removed in scrambled orders: every holder is
/// found (by bisection, or by rank in the summary's bitset once there are enough), removed
/// ones are not, the list stays sorted, and the summary says what the holders say.
#[test]
fn shared_blocks_find_each_of_many_holders_in_scrambled_orders() {
    for n in [40u32, 64, 65, 300] {
        let mut s = Shard::new(1 << 20);
        let order: Vec<EndpointId> = (0..n).map(|i| (i * 7919) % n).collect();
        for (k, &ep) in order.iter().enumerate() {
            s.add(9, predicted(ep, ep + 1000, 500), 0).unwrap();
            assert_eq!(s.summarized(9), k + 1 >= SUMMARY_MIN, "{n}: {k}");
        }
        for &ep in order.iter().filter(|&&ep| ep % 3 == 0) {
            assert_eq!(s.remove(9, ep, 0).unwrap().slot, ep + 1000);
        }
        for ep in 0..n + 70 {
            let found = s.get(9, ep).map(|h| h.slot);
            let held = ep < n && ep % 3 != 0;
            assert_eq!(found, held.then_some(ep + 1000), "{n}: endpoint {ep}");
        }
        let kept: Vec<EndpointId> = (0..n).filter(|e| e % 3 != 0).collect();
        assert_eq!(endpoints(&s, 9), kept);
        let ids: Vec<usize> = kept.iter().map(|&e| e as usize).collect();
        assert_eq!(
            extend(&s, 9, 0, n as usize + 70),
            [ids, vec![], vec![], vec![]]
        );
    }
}

/// The summary's planes at ids 63, 64, 65 and across several words, as holders are
/// confirmed, offloaded and expire; and a shared block read holder by holder gives the same.
#[test]
fn a_summary_says_what_its_holders_say_at_word_boundaries() {
    let ids: Vec<EndpointId> = (0..40).chain([63, 64, 65, 127, 128, 129, 200]).collect();
    let mut s = Shard::new(1 << 20);
    for (i, &ep) in ids.iter().enumerate() {
        s.add(9, predicted(ep, i as u32, 100 + u64::from(ep)), 0)
            .unwrap();
    }
    assert!(s.summarized(9));
    let confirm = |s: &mut Shard, ep, m: Medium| {
        s.update(9, ep, 0, |h| h.set_media(h.media() | m.bit()))
            .unwrap();
    };
    confirm(&mut s, 63, Medium::Gpu);
    confirm(&mut s, 64, Medium::Cpu);
    confirm(&mut s, 65, Medium::Cpu);
    confirm(&mut s, 65, Medium::Gpu);
    confirm(&mut s, 200, Medium::Other);
    let all: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
    let at = |s: &Shard, now| extend(s, 9, now, 255);
    assert_eq!(
        at(&s, 0),
        [all.clone(), vec![63, 64, 65, 200], vec![64, 200], vec![64]]
    );
    // Predictions expire at 100 + id: past 164, of the predicted-only only 165+ are live.
    let live_at = |now: u64| -> Vec<usize> {
        ids.iter()
            .map(|&e| e as usize)
            .filter(|&e| [63, 64, 65, 200].contains(&e) || 100 + e as u64 > now)
            .collect()
    };
    for now in [99, 100, 120, 139, 164, 165, 228, 229, 1000] {
        assert_eq!(at(&s, now)[0], live_at(now), "at {now}");
    }
    // A write past the bound re-derives the predicted plane; the answers stay the same.
    s.update(9, 1, 150, |h| h.set_predicted_until_ms(10_000))
        .unwrap();
    let mut expected = live_at(150);
    expected.insert(0, 1);
    assert_eq!(at(&s, 150)[0], expected);
    // Confirmation withdrawn from a holder whose prediction is still live: stays, unconfirmed.
    s.update(9, 200, 150, |h| h.set_media(0)).unwrap();
    assert_eq!(at(&s, 150)[1], vec![63, 64, 65]);
    assert!(at(&s, 150)[0].contains(&200), "predicted until 300");
    assert!(!at(&s, 300)[0].contains(&200));
    // Holders leave until the list is small again: the planes go, the answers stay.
    for &ep in ids.iter().filter(|&&e| e < 32) {
        s.remove(9, ep, 150).unwrap();
    }
    assert!(!s.summarized(9));
    let rest: Vec<usize> = live_at(150).into_iter().filter(|&e| e >= 32).collect();
    assert_eq!(at(&s, 150)[0], rest);
    assert_eq!(at(&s, 150)[1], vec![63, 64, 65]);
    assert_eq!(at(&s, 150)[3], vec![64], "in CPU memory only");
}

/// Ids too sparse for bitsets to pay (a few holders spread over millions of ids) keep a plain
/// list; one holder far from the rest makes the summary rebuild, or go.
#[test]
fn sparse_ids_keep_a_plain_list() {
    let mut s = Shard::new(1 << 20);
    for i in 0..SUMMARY_MIN as u32 {
        s.add(9, predicted(i * 100_000, i, 50), 0).unwrap();
    }
    assert!(!s.summarized(9));
    assert_eq!(extend(&s, 9, 0, 4_000_000)[0].len(), SUMMARY_MIN);
    let mut d = Shard::new(1 << 20);
    for i in 0..SUMMARY_MIN as u32 {
        d.add(9, predicted(i, i, 50), 0).unwrap();
    }
    assert!(d.summarized(9));
    d.add(9, predicted(1_000_000, 99, 50), 0).unwrap();
    assert!(
        !d.summarized(9),
        "one id far away: the planes would be too wide"
    );
    d.remove(9, 1_000_000, 0).unwrap();
    d.add(9, predicted(500, 99, 50), 0).unwrap();
    assert!(d.summarized(9), "rebuilt wider");
    assert_eq!(d.get(9, 500).unwrap().slot, 99);
    assert_eq!(extend(&d, 9, 0, 600)[0].len(), SUMMARY_MIN + 1);
}
