use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::events::wire::{Batch, BlockStored};
use crate::index::{IndexOptions, ManualClock, Medium};
use crate::prefix::{BlockHasher, Namespace};

const EP: EndpointId = 0;
const BS: u32 = 4;

fn index() -> OwnershipIndex {
    OwnershipIndex::new(
        IndexOptions {
            default_capacity_blocks: 1 << 16,
            prediction_ttl: Duration::from_secs(60),
            shards: 4,
        },
        Arc::new(ManualClock::new(1)),
    )
}

fn applier(max_engine_blocks: usize) -> Applier {
    Applier::new(
        EP,
        Rehash {
            model: "m".into(),
            block_size_tokens: BS,
            max_namespaces: 8,
        },
        max_engine_blocks,
        0,
    )
}

/// Tokens of the root block a batch with sequence `tag` stores.
fn tokens(tag: u64) -> Vec<u32> {
    (0..BS).map(|i| tag as u32 * 100 + i).collect()
}

fn ours(tag: u64) -> u64 {
    BlockHasher::new(&Namespace::new("m", None, None), BS).hash_tokens(&tokens(tag), 1)[0]
}

fn stored(tag: u64) -> Event {
    Event::Stored(BlockStored {
        block_hashes: vec![1000 + tag],
        parent_block_hash: None,
        token_ids: tokens(tag),
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
    })
}

/// What happens to the endpoint, in order.
#[derive(Debug, Clone)]
enum Step {
    /// A batch with this sequence number storing one new root block (tagged by `tag`), after
    /// the extra events given.
    Batch {
        seq: u64,
        tag: u64,
        before: Vec<Event>,
    },
    Malformed {
        seq: u64,
    },
    LinkLost(Reason),
    Connected,
    Restarted,
}

fn batch(seq: u64) -> Step {
    Step::Batch {
        seq,
        tag: seq + 1_000 * u64::from(seq == 0),
        before: vec![],
    }
}

/// A batch with sequence `seq` whose block is tagged `tag` (distinct blocks across restarts).
fn batch_tagged(seq: u64, tag: u64) -> Step {
    Step::Batch {
        seq,
        tag,
        before: vec![],
    }
}

fn run(steps: &[Step], max_engine_blocks: usize) -> (Applier, OwnershipIndex, Vec<u64>) {
    let index = index();
    let mut a = applier(max_engine_blocks);
    let mut tags = Vec::new();
    for step in steps {
        match step.clone() {
            Step::Batch { seq, tag, before } => {
                let mut events = before;
                events.push(stored(tag));
                tags.push(tag);
                a.on_message(
                    Ok(Message {
                        topic: b"",
                        seq,
                        batch: Batch {
                            ts_s: 0.0,
                            events,
                            dp_rank: None,
                        },
                    }),
                    &index,
                );
            }
            Step::Malformed { seq } => {
                a.on_message(Err((WireError::Frames(0), Some((seq, 0)))), &index)
            }
            Step::LinkLost(r) => a.link_lost(r, &index),
            Step::Connected => a.connected(),
            Step::Restarted => a.restarted(&index),
        }
    }
    (a, index, tags)
}

/// Tags whose block is confirmed in the index.
fn confirmed(index: &OwnershipIndex, tags: &[u64]) -> Vec<u64> {
    let mut out: Vec<u64> = tags
        .iter()
        .copied()
        .filter(|&t| index.lookup(&[ours(t)], &[EP])[0].confirmed_blocks == 1)
        .collect();
    out.sort();
    out.dedup();
    out
}

#[test]
fn trust_state_machine() {
    use Reason::*;
    use SourceState::*;
    let cleared = |seq: u64| Step::Batch {
        seq,
        tag: seq,
        before: vec![Event::Cleared { medium: None }],
    };
    let cases: Vec<(&str, Vec<Step>, SourceState, Vec<u64>)> =
        vec![
        ("nothing yet", vec![], Distrusted(Connecting), vec![]),
        (
            "connected, no batch",
            vec![Step::Connected],
            Partial(Joined),
            vec![],
        ),
        (
            "fresh start",
            vec![batch(0), batch(1), batch(2)],
            Trusted,
            vec![1, 2, 1000],
        ),
        (
            "joined mid-stream",
            vec![batch(5), batch(6)],
            Partial(Joined),
            vec![5, 6],
        ),
        (
            "a full clear makes a joined view complete",
            vec![batch(5), cleared(6), batch(7)],
            Trusted,
            vec![6, 7],
        ),
        (
            "gap: what came before goes",
            vec![batch(0), batch(1), batch(3), batch(4)],
            Partial(Gap),
            vec![3, 4],
        ),
        (
            "publisher restarted at 0: clean",
            vec![batch(0), batch(1), batch_tagged(0, 50)],
            Trusted,
            vec![50],
        ),
        (
            "publisher restarted, first batches missed",
            vec![batch(0), batch(1), batch(2), batch_tagged(1, 51)],
            Partial(Restart),
            vec![51],
        ),
        (
            "disconnected: withdrawn",
            vec![batch(0), batch(1), Step::LinkLost(Disconnected)],
            Distrusted(Disconnected),
            vec![],
        ),
        (
            "disconnected, then a batch continuing our sequence: not trusted to be the same run",
            vec![
                batch(0),
                batch(1),
                Step::LinkLost(Disconnected),
                Step::Connected,
                batch(2),
            ],
            Partial(Disconnected),
            vec![2],
        ),
        (
            "disconnected, then the restarted publisher's first batch",
            vec![batch(0), batch(1), Step::LinkLost(Disconnected), batch_tagged(0, 54)],
            Trusted,
            vec![54],
        ),
        (
            "silent, then in sequence: restored",
            vec![batch(0), batch(1), Step::LinkLost(Silent), batch(2)],
            Trusted,
            vec![1, 2, 1000],
        ),
        (
            "silent, then a gap",
            vec![batch(0), Step::LinkLost(Silent), batch(2)],
            Partial(Gap),
            vec![2],
        ),
        (
            "silent, then a restart",
            vec![
                batch(0),
                batch(1),
                Step::LinkLost(Silent),
                batch_tagged(0, 52),
            ],
            Trusted,
            vec![52],
        ),
        (
            "a joined view stays partial across a restored link",
            vec![batch(3), Step::LinkLost(Silent), batch(4)],
            Partial(Joined),
            vec![3, 4],
        ),
        (
            "malformed batch: as a gap",
            vec![batch(0), Step::Malformed { seq: 1 }, batch(2)],
            Partial(Malformed),
            vec![2],
        ),
        (
            "restart reported from outside",
            vec![batch(0), batch(1), Step::Restarted],
            Distrusted(Restart),
            vec![],
        ),
        (
            "restart reported, then the publisher's first batch",
            vec![batch(0), batch(1), Step::Restarted, batch_tagged(0, 53)],
            Trusted,
            vec![53],
        ),
    ];
    for (name, steps, state, blocks) in cases {
        let (a, index, tags) = run(&steps, 1 << 20);
        assert_eq!(a.state(), state, "{name}");
        assert_eq!(confirmed(&index, &tags), blocks, "{name}");
        // Nothing in the index that the table does not account for, once settled.
        if matches!(state, Trusted | Partial(_)) {
            assert_eq!(index.stats().entries, blocks.len(), "{name}");
        }
    }
}

#[test]
fn overflow_resets_the_table() {
    let (a, index, tags) = run(&[batch(0), batch(1), batch(2)], 2);
    assert_eq!(a.state(), SourceState::Partial(Reason::Overflow));
    assert_eq!(confirmed(&index, &tags), Vec::<u64>::new());
    assert_eq!(a.table_size().0, 0);
    let (a, _, _) = run(&[batch(0), batch(1), batch(2), batch(3)], 2);
    assert_eq!(a.table_size().0, 1, "counts again from the reset");
}

#[test]
fn a_gap_or_silence_keeps_predictions_and_a_restart_or_disconnect_drops_them() {
    for (steps, kept) in [
        (vec![batch(0), batch(2)], true),
        (vec![batch(0), batch(1), batch_tagged(0, 9)], false),
        (vec![batch(0), Step::LinkLost(Reason::Silent)], true),
        (vec![batch(0), Step::LinkLost(Reason::Disconnected)], false),
    ] {
        let index = index();
        let mut a = applier(1 << 20);
        let predicted = ours(77);
        for (i, step) in steps.into_iter().enumerate() {
            if i == 1 {
                // Made after the fresh start, before what follows.
                index.insert_predicted(EP, &[predicted]).unwrap();
            }
            let (seq, tag) = match step {
                Step::Batch { seq, tag, .. } => (seq, tag),
                Step::LinkLost(r) => {
                    a.link_lost(r, &index);
                    continue;
                }
                _ => unreachable!(),
            };
            a.on_message(
                Ok(Message {
                    topic: b"",
                    seq,
                    batch: Batch {
                        ts_s: 0.0,
                        events: vec![stored(tag)],
                        dp_rank: None,
                    },
                }),
                &index,
            );
        }
        assert_eq!(index.lookup(&[predicted], &[EP])[0].blocks == 1, kept);
    }
}

#[test]
fn other_groups_and_unknown_events_are_skipped_and_ranks_are_sequenced_apart() {
    let index = index();
    let mut a = applier(1 << 20);
    let mut other_group = stored(1);
    if let Event::Stored(s) = &mut other_group {
        s.group_idx = Some(1);
    }
    let message = |seq, rank, events| {
        Ok(Message {
            topic: b"",
            seq,
            batch: Batch {
                ts_s: 0.0,
                events,
                dp_rank: Some(rank),
            },
        })
    };
    a.on_message(
        message(0, 0, vec![other_group, Event::Unknown, stored(2)]),
        &index,
    );
    assert_eq!(a.counters.skipped, 2);
    assert_eq!(confirmed(&index, &[1, 2]), vec![2]);
    // A second data-parallel rank starting at 0 does not clear the first's blocks, and each
    // rank's sequence is its own.
    a.on_message(message(0, 1, vec![stored(3)]), &index);
    a.on_message(message(1, 0, vec![stored(4)]), &index);
    a.on_message(message(1, 1, vec![stored(5)]), &index);
    assert_eq!(a.state(), SourceState::Trusted);
    assert_eq!(confirmed(&index, &[2, 3, 4, 5]), vec![2, 3, 4, 5]);
    assert_eq!(a.counters.gaps, 0);
}

#[test]
fn the_sequence_table_holds_at_most_max_dp_ranks_and_further_ranks_are_malformed() {
    let index = index();
    let mut a = applier(1 << 20);
    let message = |seq, rank: u32, events| {
        Ok(Message {
            topic: b"",
            seq,
            batch: Batch {
                ts_s: 0.0,
                events,
                dp_rank: Some(rank),
            },
        })
    };
    for rank in 0..MAX_DP_RANKS as u32 {
        a.on_message(message(0, rank, vec![]), &index);
    }
    assert_eq!(a.expected.len(), MAX_DP_RANKS);
    assert_eq!(a.counters.malformed, 0);
    // A publisher inventing ranks: no new entry, the batch is not applied, the stream is lost.
    a.on_message(message(0, u32::MAX, vec![stored(7)]), &index);
    a.on_message(Err((WireError::Frames(0), Some((5, u32::MAX - 1)))), &index);
    assert_eq!(a.expected.len(), MAX_DP_RANKS, "bounded");
    assert_eq!(a.counters.malformed, 2);
    assert_eq!(confirmed(&index, &[7]), Vec::<u64>::new());
    assert_eq!(a.state(), SourceState::Partial(Reason::Malformed));
    // Known ranks still sequence.
    a.on_message(message(1, 0, vec![stored(8)]), &index);
    assert_eq!(a.expected.len(), MAX_DP_RANKS);
}

#[test]
fn a_retired_stream_touches_the_index_no_more() {
    let (mut a, index, tags) = run(&[batch(0), batch(1)], 1 << 20);
    assert_eq!(confirmed(&index, &tags), [1, 1000]);
    a.retire(&index);
    assert!(
        confirmed(&index, &tags).is_empty(),
        "what it confirmed goes"
    );
    // The endpoint's entries from now on are someone else's business (its next stream, the
    // decisions routed to it); what reaches the old stream late must leave them alone.
    let predicted = ours(77);
    index.insert_predicted(EP, &[predicted]).unwrap();
    a.on_message(
        Ok(Message {
            topic: b"",
            seq: 2,
            batch: Batch {
                ts_s: 0.0,
                events: vec![stored(5)],
                dp_rank: None,
            },
        }),
        &index,
    );
    a.link_lost(Reason::Disconnected, &index);
    a.restarted(&index);
    assert!(confirmed(&index, &[5]).is_empty());
    assert_eq!(
        index.lookup(&[predicted], &[EP])[0].blocks,
        1,
        "not cleared"
    );
    assert_eq!(a.counters.messages, 2, "the late message was not applied");
}

#[test]
fn an_unreadable_payload_places_its_sequence_only_on_a_single_rank_stream() {
    let index = index();
    // The last sequence a publisher can send: no overflow.
    let mut a = applier(1 << 20);
    a.on_message(Err((WireError::Frames(0), Some((u64::MAX, 0)))), &index);
    assert_eq!(a.expected, vec![(0, u64::MAX)]);
    // A data-parallel stream: the unreadable payload's rank is unknown, so no phantom rank 0.
    let mut b = applier(1 << 20);
    b.on_message(
        Ok(Message {
            topic: b"",
            seq: 0,
            batch: Batch {
                ts_s: 0.0,
                events: vec![],
                dp_rank: Some(1),
            },
        }),
        &index,
    );
    b.on_message(Err((WireError::Frames(0), Some((7, 0)))), &index);
    assert_eq!(b.expected, vec![(1, 1)]);
    assert_eq!(b.counters.malformed, 1);
}
