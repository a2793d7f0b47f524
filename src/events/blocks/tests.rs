use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::index::{IndexOptions, ManualClock, PrefixMatch};

const EP: EndpointId = 3;

fn index() -> (OwnershipIndex, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(1));
    let options = IndexOptions {
        default_capacity_blocks: 1 << 20,
        prediction_ttl: Duration::from_secs(60),
        shards: 8,
    };
    (OwnershipIndex::new(options, clock.clone()), clock)
}

fn table(bs: u32) -> EngineBlocks {
    EngineBlocks::new(Rehash {
        model: "m".into(),
        block_size_tokens: bs,
        max_namespaces: 4,
    })
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], e: u32) -> BlockStored {
    BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: e,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
    }
}

fn removed(hashes: &[u64], medium: Medium) -> BlockRemoved {
    BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: Some(0),
    }
}

fn ours(ns: &Namespace, bs: u32, tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(ns, bs).hash_tokens(tokens, usize::MAX)
}

fn plain() -> Namespace {
    Namespace::new("m", None, None)
}

fn held(index: &OwnershipIndex, hashes: &[u64]) -> PrefixMatch {
    index.lookup(hashes, &[EP])[0]
}

#[test]
fn engine_blocks_of_128_tokens_become_the_same_chain_the_router_hashes_in_16s() {
    let (index, _) = index();
    let mut t = table(16);
    let tokens: Vec<u32> = (1000..1512).collect();
    // Three engine blocks in one event, then a fourth as a child in another.
    let a = t.store(
        &stored(&[11, 12, 13], None, &tokens[..384], 128),
        EP,
        &index,
    );
    let b = t.store(&stored(&[14], Some(13), &tokens[384..], 128), EP, &index);
    assert_eq!((a.mapped, b.mapped), (3, 1));
    let expected = ours(&plain(), 16, &tokens);
    assert_eq!(expected.len(), 32);
    let m = held(&index, &expected);
    assert_eq!(
        (m.blocks, m.confirmed_blocks, m.offloaded_blocks),
        (32, 32, 0)
    );
    assert_eq!(t.len(), 4);
    // Removing the tail engine block drops exactly its 8 blocks of ours.
    t.remove(&removed(&[14], Medium::Gpu), EP, &index);
    assert_eq!(held(&index, &expected).blocks, 24);
    assert_eq!(index.stats().entries, 24);
}

proptest! {
    #[test]
    fn any_engine_block_size_and_event_split_gives_the_routers_hashes(
        engine_bs in 1u32..80,
        bs in 1u32..40,
        blocks in 1usize..12,
        cuts in prop::collection::vec(any::<bool>(), 12),
        seed in any::<u32>(),
    ) {
        let (index, _) = index();
        let mut t = table(bs);
        let tokens: Vec<u32> = (0..blocks as u32 * engine_bs).map(|i| i.wrapping_mul(seed | 1)).collect();
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| 0xe000 + i).collect();
        let mut start = 0;
        for i in 1..=blocks {
            if i == blocks || cuts[i] {
                let e = engine_bs as usize;
                let ev = stored(
                    &hashes[start..i],
                    start.checked_sub(1).map(|p| hashes[p]),
                    &tokens[start * e..i * e],
                    engine_bs,
                );
                t.store(&ev, EP, &index);
                start = i;
            }
        }
        let expected = ours(&plain(), bs, &tokens);
        let m = held(&index, &expected);
        prop_assert_eq!(m.blocks as usize, expected.len());
        prop_assert_eq!(index.stats().entries, expected.len());
    }
}

#[test]
fn copies_are_counted_and_media_removed_one_at_a_time() {
    let (index, _) = index();
    let mut t = table(4);
    let tokens = [1, 2, 3, 4];
    let h = ours(&plain(), 4, &tokens);
    // Two physical copies on GPU (vLLM does not de-duplicate), then one on CPU (offload,
    // reported without tokens).
    t.store(&stored(&[7], None, &tokens, 4), EP, &index);
    t.store(&stored(&[7], None, &tokens, 4), EP, &index);
    let mut cpu = stored(&[7], None, &[], 4);
    cpu.medium = Medium::Cpu;
    t.store(&cpu, EP, &index);
    let steps: &[(Medium, (u32, u32))] = &[
        (Medium::Gpu, (1, 0)), // one GPU copy left
        (Medium::Gpu, (1, 1)), // only the CPU copy: offloaded
        (Medium::Gpu, (1, 1)), // unknown: nothing changes
        (Medium::Cpu, (0, 0)), // gone
    ];
    for (i, (medium, (blocks, offloaded))) in steps.iter().enumerate() {
        let a = t.remove(&removed(&[7], *medium), EP, &index);
        let m = held(&index, &h);
        assert_eq!(
            (m.blocks, m.offloaded_blocks),
            (*blocks, *offloaded),
            "step {i}"
        );
        assert_eq!(a.unknown_removed, u64::from(i == 2), "step {i}");
    }
    assert_eq!(t.len(), 0);
}

/// vLLM's offloading connector without `self_describing_kv_events` announces a block's CPU
/// copy as a placeholder: its hash only, no tokens, no parent, block size 0. A known hash gains
/// the medium; an unknown one (its GPU event was missed) maps to nothing of ours.
#[test]
fn a_placeholder_adds_a_medium_to_a_known_block_and_maps_nothing_else() {
    let (index, _) = index();
    let mut t = table(4);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let h = ours(&plain(), 4, &tokens);
    t.store(&stored(&[7, 8], None, &tokens, 4), EP, &index);
    let mut cpu = stored(&[8, 99], None, &[], 0);
    cpu.medium = Medium::Cpu;
    let a = t.store(&cpu, EP, &index);
    assert_eq!((a.mapped, a.unmapped), (0, 1), "99 is not ours to map");
    t.remove(&removed(&[8], Medium::Gpu), EP, &index);
    let m = held(&index, &h);
    assert_eq!((m.blocks, m.offloaded_blocks, m.cpu_blocks), (2, 1, 1));
    t.remove(&removed(&[99], Medium::Cpu), EP, &index);
    assert_eq!(
        held(&index, &h).blocks,
        2,
        "an unmapped block's removal takes nothing"
    );
}

#[test]
fn an_engine_removal_erases_our_prediction_of_the_block_too() {
    let (index, _) = index();
    let mut t = table(4);
    let tokens = [9, 8, 7, 6, 5, 4, 3, 2];
    let h = ours(&plain(), 4, &tokens);
    index.insert_predicted(EP, &h).unwrap();
    t.store(&stored(&[1, 2], None, &tokens, 4), EP, &index);
    assert_eq!(held(&index, &h).confirmed_blocks, 2);
    t.remove(&removed(&[2], Medium::Gpu), EP, &index);
    assert_eq!(
        held(&index, &h).blocks,
        1,
        "the engine said block 2 is gone"
    );
}

#[test]
fn namespaces_from_adapter_and_cache_salt_and_what_cannot_be_reproduced() {
    let tokens: Vec<u32> = (50..58).collect();
    let key = |s: &str| ExtraKey::Str(s.into());
    let lora = Namespace::new("m", Some("sql"), None);
    let salted = plain().with_cache_salt(Some("s1"));
    let both = Namespace::new("m", Some("sql"), None).with_cache_salt(Some("s1"));
    // (lora_name, lora_id, extra keys per block) -> the namespace and how many blocks map.
    type Case = (
        Option<&'static str>,
        Option<i64>,
        Option<Vec<Option<Vec<ExtraKey>>>>,
        Namespace,
        u32,
    );
    let cases: Vec<Case> = vec![
        (None, None, None, plain(), 2),
        (None, None, Some(vec![None, None]), plain(), 2),
        (
            Some("sql"),
            Some(1),
            Some(vec![Some(vec![key("sql")]), Some(vec![key("sql")])]),
            lora,
            2,
        ),
        (
            None,
            None,
            Some(vec![Some(vec![key("s1")]), None]),
            salted,
            2,
        ),
        (
            Some("sql"),
            Some(1),
            Some(vec![
                Some(vec![key("sql"), key("s1")]),
                Some(vec![key("sql")]),
            ]),
            both,
            2,
        ),
        // A multimodal item ([identifier, offset]) in block 0: nothing maps.
        (
            None,
            None,
            Some(vec![Some(vec![ExtraKey::Other]), None]),
            plain(),
            0,
        ),
        // An adapter known only by id (old vLLM).
        (
            None,
            Some(3),
            Some(vec![Some(vec![ExtraKey::Int(3)]), None]),
            plain(),
            0,
        ),
        // A salt-like key on a later block is not a salt: block 1 on is opaque.
        (
            None,
            None,
            Some(vec![None, Some(vec![key("s1")])]),
            plain(),
            1,
        ),
    ];
    for (i, (lora_name, lora_id, extra_keys, ns, mapped)) in cases.into_iter().enumerate() {
        let (index, _) = index();
        let mut t = table(4);
        let mut ev = stored(&[1, 2], None, &tokens, 4);
        ev.lora_name = lora_name.map(Into::into);
        ev.lora_id = lora_id;
        ev.extra_keys = extra_keys;
        let a = t.store(&ev, EP, &index);
        assert_eq!(
            (a.mapped, a.unmapped),
            (u64::from(mapped), u64::from(2 - mapped)),
            "case {i}"
        );
        // Children continue the namespace, or stay opaque after an opaque block.
        let all: Vec<u32> = tokens.iter().copied().chain(60..64).collect();
        t.store(&stored(&[3], Some(2), &all[8..], 4), EP, &index);
        let m = held(&index, &ours(&ns, 4, &all));
        let expected = if mapped == 2 { 3 } else { mapped };
        assert_eq!(m.blocks, expected, "case {i}");
        assert_eq!(index.stats().entries, expected as usize, "case {i}");
    }
}

#[test]
fn unknown_parents_and_namespace_overflow_map_nothing_but_are_tracked() {
    let (index, _) = index();
    let mut t = EngineBlocks::new(Rehash {
        model: "m".into(),
        block_size_tokens: 4,
        max_namespaces: 1,
    });
    let a = t.store(&stored(&[5], Some(999), &[1, 2, 3, 4], 4), EP, &index);
    assert_eq!((a.mapped, a.unmapped), (0, 1));
    // Its removal balances without touching the index.
    let r = t.remove(&removed(&[5], Medium::Gpu), EP, &index);
    assert_eq!((r.removed, r.unknown_removed), (1, 0));
    t.store(&stored(&[6], None, &[1, 2, 3, 4], 4), EP, &index);
    let mut salted = stored(&[7], None, &[1, 2, 3, 4], 4);
    salted.extra_keys = Some(vec![Some(vec![ExtraKey::Str("x".into())])]);
    let a = t.store(&salted, EP, &index);
    assert_eq!(a.unmapped, 1, "a second namespace is over the limit of 1");
    assert_eq!(index.stats().entries, 1);
    // Malformed: token count does not match the hashes.
    let a = t.store(&stored(&[8, 9], None, &[1, 2, 3], 4), EP, &index);
    assert_eq!(a.unmapped, 2);
}

#[test]
fn withdraw_keeps_predictions_and_restore_puts_confirmed_blocks_back() {
    let (index, _) = index();
    let mut t = table(4);
    let tokens: Vec<u32> = (1..=8).collect();
    let h = ours(&plain(), 4, &tokens);
    t.store(&stored(&[1, 2], None, &tokens, 4), EP, &index);
    index.insert_predicted(EP, &h[..1]).unwrap();
    t.withdraw(EP, &index);
    let m = held(&index, &h);
    assert_eq!(
        (m.blocks, m.confirmed_blocks),
        (1, 0),
        "the prediction stays"
    );
    t.restore(EP, &index);
    assert_eq!(held(&index, &h).confirmed_blocks, 2);
    // A medium-only clear.
    let mut cpu = stored(&[2], Some(1), &[], 4);
    cpu.medium = Medium::Cpu;
    t.store(&cpu, EP, &index);
    t.clear_medium(Medium::Gpu, EP, &index);
    // Block 1 left with the GPU (its prediction with it); block 2 stays, on CPU.
    assert_eq!(held(&index, &h).blocks, 0);
    assert_eq!(index.stats().entries, 1);
    assert_eq!(t.len(), 1);
    assert!(t.heap_bytes() > 0);
}

#[test]
fn copies_past_what_the_record_packs_are_still_counted_exactly() {
    assert_eq!(std::mem::size_of::<EngineBlock>(), 20);
    let (index, _) = index();
    let mut t = table(4);
    let tokens = [1, 2, 3, 4];
    let h = ours(&plain(), 4, &tokens);
    // 40 GPU copies (past the 31 the record packs) and 20 CPU ones (past 15).
    for _ in 0..40 {
        t.store(&stored(&[7], None, &tokens, 4), EP, &index);
    }
    let mut cpu = stored(&[7], None, &[], 4);
    cpu.medium = Medium::Cpu;
    for _ in 0..20 {
        t.store(&cpu, EP, &index);
    }
    assert_eq!(t.copies(0), [40, 20, 0]);
    for i in 0..40 {
        assert_eq!(held(&index, &h).offloaded_blocks, 0, "GPU copy {i} left");
        t.remove(&removed(&[7], Medium::Gpu), EP, &index);
    }
    assert_eq!(t.copies(0), [0, 20, 0]);
    for _ in 0..19 {
        t.remove(&removed(&[7], Medium::Cpu), EP, &index);
    }
    assert!(t.many_copies.is_empty(), "back in the record");
    assert_eq!(t.copies(0), [0, 1, 0]);
    assert_eq!(held(&index, &h).offloaded_blocks, 1);
    t.remove(&removed(&[7], Medium::Cpu), EP, &index);
    assert_eq!((held(&index, &h).blocks, t.len()), (0, 0));
}

#[test]
fn removing_blocks_keeps_the_others_findable() {
    let (index, _) = index();
    let mut t = table(4);
    let tokens: Vec<u32> = (0..400).collect();
    let hashes: Vec<u64> = (1..=100).collect();
    t.store(&stored(&hashes, None, &tokens, 4), EP, &index);
    // Every third block goes (the last record moves into each freed place).
    let gone: Vec<u64> = hashes.iter().copied().filter(|h| h % 3 == 0).collect();
    t.remove(&removed(&gone, Medium::Gpu), EP, &index);
    assert_eq!(t.len(), 100 - gone.len());
    for &h in &hashes {
        assert_eq!(t.find(h).is_some(), h % 3 != 0, "{h}");
    }
    // A child of a surviving block continues its chain.
    let a = t.store(&stored(&[1000], Some(100), &[7, 7, 7, 7], 4), EP, &index);
    assert_eq!(a.mapped, 1);
    let all: Vec<u32> = tokens.iter().copied().chain([7, 7, 7, 7]).collect();
    let expected = ours(&plain(), 4, &all);
    let run = |from: usize| index.lookup(&expected[from..], &[EP])[0].blocks;
    assert_eq!(run(99), 2, "engine block 100 and its new child");
    assert_eq!(run(98), 0, "engine block 99 went");
    assert_eq!(run(0), 2, "engine block 3 went");
}

/// Past what the table numbers, a new engine block is not tracked: it and its children map to
/// nothing, its removal is unknown, and what was tracked before stays exact.
#[test]
fn a_full_table_tracks_no_more_blocks_and_keeps_the_others() {
    let (index, _) = index();
    let mut t = table(4);
    t.limit = 3;
    let tokens: Vec<u32> = (0..20).collect();
    let a = t.store(&stored(&[1, 2, 3, 4], None, &tokens[..16], 4), EP, &index);
    assert_eq!((a.mapped, a.unmapped, t.len()), (3, 1, 3));
    let b = t.store(&stored(&[5], Some(4), &tokens[16..], 4), EP, &index);
    assert_eq!((b.mapped, b.unmapped), (0, 1));
    let expected = ours(&plain(), 4, &tokens);
    assert_eq!(held(&index, &expected).confirmed_blocks, 3);
    let r = t.remove(&removed(&[4, 5], Medium::Gpu), EP, &index);
    assert_eq!((r.removed, r.unknown_removed), (0, 2));
    // Room again: a removal frees a place for the next block.
    t.remove(&removed(&[3], Medium::Gpu), EP, &index);
    let c = t.store(&stored(&[3], Some(2), &tokens[8..12], 4), EP, &index);
    assert_eq!((c.mapped, t.len()), (1, 3));
    assert_eq!(held(&index, &expected).blocks, 3);
}
