use super::*;
use kvsim::block_hash::ExtraKey as SimKey;
use kvsim::kv_events::{encode_batch, KvEvent};
use proptest::prelude::*;
use rmpv::Value as V;

thread_local! {
    /// The most bytes one `reserve` reserved on this thread since the last reset.
    static LARGEST_RESERVED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

pub(super) fn note_reserved(bytes: usize) {
    LARGEST_RESERVED.with(|m| m.set(m.get().max(bytes)));
}

/// The most bytes reserved up front while decoding `payload` (decoded or not).
fn largest_reservation(payload: &[u8]) -> usize {
    LARGEST_RESERVED.with(|m| m.set(0));
    let _ = decode_batch(payload);
    LARGEST_RESERVED.with(|m| m.get())
}

#[test]
fn a_claimed_length_reserves_no_more_than_the_payload_could_hold() {
    // [ts, events, dp_rank] whose events array claims one event per byte left, each a 1-byte
    // fixint (not an event at all): before, 4096 x size_of::<Event>() bytes were reserved.
    let n = 4096usize;
    let mut p = vec![0x93, 0x00, 0xdd];
    p.extend((n as u32).to_be_bytes());
    p.extend(std::iter::repeat_n(0x01u8, n - 1));
    p.push(0x00);
    let reserved = largest_reservation(&p);
    assert!(reserved > 0, "an event vector was reserved");
    assert!(
        reserved <= p.len(),
        "reserved {reserved} bytes for a {}-byte payload (an event is {} bytes)",
        p.len(),
        std::mem::size_of::<Event>()
    );
    // The same for a BlockStored's hashes and token ids (8 and 4 bytes each decoded).
    for field in ["block_hashes", "token_ids"] {
        let mut p = vec![0x93, 0x00, 0x91, 0x82, 0xa4];
        p.extend(b"type");
        p.push(0xab);
        p.extend(b"BlockStored");
        p.push(0xa0 | field.len() as u8);
        p.extend(field.as_bytes());
        p.push(0xdd);
        p.extend((n as u32).to_be_bytes());
        p.extend(std::iter::repeat_n(0x01u8, n / 2));
        let reserved = largest_reservation(&p);
        assert!(
            reserved > 0 && reserved <= p.len(),
            "{field}: {reserved} of {}",
            p.len()
        );
    }
    // An honest payload still gets its vectors sized at once.
    let honest = encode_batch(
        1.0,
        &[KvEvent::BlockRemoved {
            block_hashes: (0..64).map(|i| u64::MAX - i).collect(),
        }],
        0,
    );
    assert_eq!(largest_reservation(&honest), 64 * 8);
}

fn enc(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn arr(items: Vec<V>) -> V {
    V::Array(items)
}

fn uints(xs: &[u64]) -> V {
    arr(xs.iter().map(|&x| V::from(x)).collect())
}

#[test]
fn the_simulators_map_encoding_decodes_field_for_field() {
    let payload = encode_batch(
        1.5,
        &[
            KvEvent::BlockStored {
                block_hashes: vec![11, u64::MAX],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: Some(3),
                lora_name: Some("sql".into()),
                extra_keys: vec![
                    Some(vec![SimKey::Lora("sql".into()), SimKey::Salt("s".into())]),
                    Some(vec![SimKey::Lora("sql".into()), SimKey::Mm(99)]),
                ],
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![11],
            },
            KvEvent::AllBlocksCleared,
        ],
        0,
    );
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.ts_s, 1.5);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: vec![11, u64::MAX],
                parent_block_hash: Some(7),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: Some(3),
                medium: Medium::Gpu,
                lora_name: Some("sql".into()),
                extra_keys: Some(vec![
                    Some(vec![ExtraKey::Str("sql".into()), ExtraKey::Str("s".into())]),
                    Some(vec![ExtraKey::Str("sql".into()), ExtraKey::Int(99)]),
                ]),
                group_idx: Some(0),
            }),
            Event::Removed(BlockRemoved {
                block_hashes: vec![11],
                medium: Medium::Gpu,
                group_idx: Some(0),
            }),
            Event::Cleared { medium: None },
        ]
    );
}

#[test]
fn positional_encoding_with_old_short_and_new_long_forms() {
    // vLLM <= 0.10 array_like events: BlockStored stops after lora_id; BlockRemoved has
    // only hashes. A newer one has every field plus one this decoder has never heard of.
    let old_stored = arr(vec![
        "BlockStored".into(),
        uints(&[5, 6]),
        V::Nil,
        uints(&[1, 2, 3, 4, 5, 6, 7, 8]),
        4.into(),
        V::Nil,
    ]);
    let new_stored = arr(vec![
        "BlockStored".into(),
        uints(&[9]),
        6.into(),
        uints(&[9, 9, 9, 9]),
        4.into(),
        V::Nil,
        "CPU".into(),
        V::Nil,
        arr(vec![arr(vec![arr(vec!["mm-id".into(), 0.into()])])]),
        1.into(),
        "full_attention".into(),
        V::Nil,
        "a future field".into(),
    ]);
    let old_removed = arr(vec!["BlockRemoved".into(), uints(&[5])]);
    let cleared = arr(vec!["AllBlocksCleared".into()]);
    let future = arr(vec!["BlockTransferred".into(), uints(&[1]), "GPU".into()]);
    // The batch as an array with an extra trailing element.
    let payload = enc(&arr(vec![
        2.0.into(),
        arr(vec![old_stored, new_stored, old_removed, cleared, future]),
        V::Nil,
        "trailing".into(),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.dp_rank, None);
    let [Event::Stored(a), Event::Stored(b), Event::Removed(c), Event::Cleared { medium: None }, Event::Unknown] =
        &batch.events[..]
    else {
        panic!("unexpected {:?}", batch.events)
    };
    assert_eq!(
        (a.block_size, a.token_ids.len(), a.medium),
        (4, 8, Medium::Gpu)
    );
    assert_eq!((a.parent_block_hash, a.extra_keys.as_ref()), (None, None));
    assert_eq!(b.parent_block_hash, Some(6));
    assert_eq!(b.medium, Medium::Cpu);
    assert_eq!(b.group_idx, Some(1));
    assert_eq!(b.extra_keys, Some(vec![Some(vec![ExtraKey::Other])]));
    assert_eq!(
        (c.block_hashes.as_slice(), c.medium),
        (&[5u64][..], Medium::Gpu)
    );
}

/// The simulator's CPU tier speaks as vLLM's offloading connector: a placeholder
/// `BlockStored` (hashes only, block size 0) and a `BlockRemoved`, both with medium `CPU`.
#[test]
fn offload_placeholders_decode_with_their_medium() {
    let payload = encode_batch(
        1.0,
        &[
            KvEvent::offload_placeholder(vec![5, 6]),
            KvEvent::OffloadRemoved {
                block_hashes: vec![5],
            },
        ],
        0,
    );
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(
        batch.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: vec![5, 6],
                parent_block_hash: None,
                token_ids: vec![],
                block_size: 0,
                lora_id: None,
                medium: Medium::Cpu,
                lora_name: None,
                extra_keys: None,
                group_idx: Some(0),
            }),
            Event::Removed(BlockRemoved {
                block_hashes: vec![5],
                medium: Medium::Cpu,
                group_idx: Some(0),
            }),
        ]
    );
}

#[test]
fn map_batches_unknown_fields_and_byte_hashes() {
    let digest: Vec<u8> = (0u8..32).collect();
    let stored = V::Map(vec![
        ("novel".into(), arr(vec![V::Nil, 1.into()])),
        (
            "block_hashes".into(),
            arr(vec![V::Binary(digest.clone()), (-1i64).into()]),
        ),
        ("token_ids".into(), uints(&[1, 2])),
        ("block_size".into(), 1.into()),
        ("type".into(), "BlockStored".into()),
    ]);
    let payload = enc(&V::Map(vec![
        ("events".into(), arr(vec![stored])),
        ("ts".into(), 3.into()),
        ("data_parallel_rank".into(), 2.into()),
        ("source".into(), "x".into()),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!((batch.ts_s, batch.dp_rank), (3.0, Some(2)));
    let Event::Stored(s) = &batch.events[0] else {
        panic!()
    };
    // Low 64 bits, big-endian: bytes 24..32.
    assert_eq!(s.block_hashes[0], 0x18191a1b1c1d1e1f);
    assert_eq!(s.block_hashes[1], u64::MAX, "negative ints keep their bits");
    assert_eq!(s.parent_block_hash, None);
}

#[test]
fn malformed_messages_are_errors_naming_what_is_wrong() {
    let ok = enc(&arr(vec![1.0.into(), arr(vec![]), 0.into()]));
    let cases: Vec<(Vec<Vec<u8>>, &str)> = vec![
        (
            vec![vec![], 0u64.to_be_bytes().to_vec()],
            "expected 3 frames",
        ),
        (
            vec![vec![], vec![0; 4], ok.clone()],
            "sequence frame is 4 bytes",
        ),
        (vec![vec![], vec![0; 8], vec![0xc1]], "msgpack: expected"),
        (
            vec![vec![], vec![0; 8], enc(&arr(vec![1.0.into()]))],
            "batch: missing field events",
        ),
        (
            vec![
                vec![],
                vec![0; 8],
                enc(&arr(vec![
                    1.0.into(),
                    arr(vec![V::Map(vec![("type".into(), "BlockRemoved".into())])]),
                ])),
            ],
            "BlockRemoved: missing field block_hashes",
        ),
        (
            vec![
                vec![],
                vec![0; 8],
                enc(&arr(vec![
                    1.0.into(),
                    arr(vec![arr(vec![
                        "BlockStored".into(),
                        uints(&[1]),
                        V::Nil,
                        uints(&[1 << 40]),
                        1.into(),
                    ])]),
                ])),
            ],
            "token_ids: token id does not fit 32 bits",
        ),
        (
            vec![
                vec![],
                vec![0; 8],
                enc(&arr(vec![
                    1.0.into(),
                    arr(vec![arr(vec![
                        "BlockStored".into(),
                        uints(&[1]),
                        V::Nil,
                        uints(&[7, 8]),
                        0.into(),
                    ])]),
                ])),
            ],
            "block_size: must be > 0 when token_ids are given",
        ),
        (
            vec![
                vec![],
                vec![0; 8],
                enc(&arr(vec![1.0.into(), arr(vec![arr(vec![])])])),
            ],
            "event: missing field type",
        ),
    ];
    for (frames, expected) in cases {
        let err = decode_message(&frames).unwrap_err().to_string();
        assert!(
            err.starts_with(expected),
            "{err:?} should start with {expected:?}"
        );
    }
    let frames = [b"kv@x".to_vec(), 7u64.to_be_bytes().to_vec(), ok];
    let m = decode_message(&frames).unwrap();
    assert_eq!((m.topic, m.seq), (&b"kv@x"[..], 7));
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        (
            prop::collection::vec(any::<u64>(), 0..4),
            proptest::option::of(any::<u64>()),
            1u32..5,
            proptest::option::of("[a-z]{1,4}"),
        )
            .prop_map(|(hashes, parent, bs, lora)| KvEvent::BlockStored {
                token_ids: (0..hashes.len() as u32 * bs).collect(),
                extra_keys: hashes
                    .iter()
                    .map(|_| lora.as_ref().map(|l| vec![SimKey::Lora(l.as_str().into())]))
                    .collect(),
                block_hashes: hashes,
                parent_block_hash: parent,
                block_size: bs,
                lora_id: lora.as_ref().map(|_| 1),
                lora_name: lora.map(|l| l.into()),
            }),
        prop::collection::vec(any::<u64>(), 0..4)
            .prop_map(|block_hashes| KvEvent::BlockRemoved { block_hashes }),
        Just(KvEvent::AllBlocksCleared),
    ]
}

proptest! {
    #[test]
    fn every_encoded_batch_decodes_to_its_events(events in prop::collection::vec(arb_event(), 0..6)) {
        let batch = decode_batch(&encode_batch(9.0, &events, 0)).unwrap();
        prop_assert_eq!(batch.events.len(), events.len());
        for (got, sent) in batch.events.iter().zip(&events) {
            match (got, sent) {
                (Event::Stored(g), KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, lora_name, .. }) => {
                    prop_assert_eq!(&g.block_hashes, block_hashes);
                    prop_assert_eq!(g.parent_block_hash, *parent_block_hash);
                    prop_assert_eq!(&g.token_ids, token_ids);
                    prop_assert_eq!(g.lora_name.as_deref(), lora_name.as_deref());
                }
                (Event::Removed(g), KvEvent::BlockRemoved { block_hashes }) => {
                    prop_assert_eq!(&g.block_hashes, block_hashes);
                }
                (Event::Cleared { medium: None }, KvEvent::AllBlocksCleared) => {}
                other => prop_assert!(false, "mismatch {:?}", other),
            }
        }
    }

    #[test]
    fn arbitrary_payloads_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn truncated_real_payloads_are_errors_not_panics(cut in 0usize..200) {
        let payload = encode_batch(1.0, &[KvEvent::BlockStored {
            block_hashes: vec![1, 2], parent_block_hash: None, token_ids: (0..32).collect(),
            block_size: 16, lora_id: None, lora_name: None, extra_keys: vec![None, None],
        }], 0);
        let cut = cut.min(payload.len() - 1);
        prop_assert!(decode_batch(&payload[..cut]).is_err());
    }
}
