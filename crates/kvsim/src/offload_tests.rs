//! The engine with a CPU offload tier: write-through stores, loads instead of prefill, events
//! with medium `CPU`, a loading request that does not hold up the queue.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::engine::{Engine, EngineConfig, NewRequest, Output, OutputSink, ReqId, StepPlan, Usage};
use crate::kv_events::KvEvent;
use crate::metrics::SimMetrics;
use crate::offload::OffloadConfig;
use crate::tokenize::{PromptTokens, WordPieceTokenizer};

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<Output>>>);

impl OutputSink for Sink {
    fn deliver(&mut self, output: Output) -> bool {
        self.0.lock().push(output);
        true
    }
}

impl Sink {
    fn usage(&self) -> Option<Usage> {
        self.0.lock().iter().find_map(|o| match o {
            Output::Finished(u) => Some(*u),
            _ => None,
        })
    }
}

const BLOCK_LOAD: Duration = Duration::from_millis(2);
const LATENCY: Duration = Duration::from_millis(1);

/// Blocks of 4 tokens, `gpu` GPU blocks (null block included), `cpu` tier blocks.
fn engine(gpu: u32, cpu: u32, self_describing: bool) -> Engine<Sink> {
    let cfg = EngineConfig {
        block_size: 4,
        num_gpu_blocks: gpu,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        max_model_len: (gpu - 1) * 4,
        hash_seed: 0,
        record_events: true,
        track_loras: false,
        offload: Some(OffloadConfig {
            num_blocks: cpu,
            block_load: BLOCK_LOAD,
            latency: LATENCY,
            block_bytes: 4 * 131_072,
            self_describing,
        }),
    };
    Engine::new(
        cfg,
        Arc::new(WordPieceTokenizer::default()),
        Arc::new(SimMetrics::default()),
    )
}

fn submit(e: &mut Engine<Sink>, ids: Vec<u32>, max_tokens: u32) -> (ReqId, Sink) {
    let sink = Sink::default();
    let id = e
        .add(NewRequest {
            prompt: PromptTokens {
                ids,
                mm: Vec::new(),
            },
            max_tokens,
            lora: None,
            cache_salt: None,
            sink: sink.clone(),
            arrival: Instant::now(),
        })
        .map_err(|(err, _)| err)
        .unwrap();
    (id, sink)
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (seed.wrapping_mul(7919) + i * 31) % 30_000)
        .collect()
}

/// Runs steps (each 1 ms of paused time) until idle, waiting out loads with nothing to step;
/// returns the events and the time it took.
async fn run(e: &mut Engine<Sink>) -> (Vec<KvEvent>, Duration) {
    let start = Instant::now();
    let mut events = Vec::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        let mut plan = StepPlan::default();
        e.schedule(&mut plan, Instant::now());
        events.extend(e.take_events());
        if plan.items.is_empty() {
            let ready = e.next_load_ready().expect("idle only while loading");
            tokio::time::sleep_until(ready).await;
            continue;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        e.finish_step(&plan, Instant::now());
        events.extend(e.take_events());
    }
    assert!(!e.has_work(), "engine did not drain");
    (events, start.elapsed())
}

fn cpu_stored(events: &[KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::Offloaded(inner) => match &**inner {
                KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.clone()),
                _ => None,
            },
            _ => None,
        })
        .flatten()
        .collect()
}

fn gpu_removed(events: &[KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// A's prefix is stored to the tier as it is computed, pushed off the GPU by B, and loaded
/// back for A's repeat (12 tokens at 2 ms a block + 1 ms) instead of being recomputed.
#[tokio::test(start_paused = true)]
async fn a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_cpu_tier() {
    // 5 usable GPU blocks: A takes 4 (13 tokens), B all 5 (17 tokens), evicting A's.
    let mut e = engine(6, 32, false);
    let a = ids(1, 13);
    let (ia, first) = submit(&mut e, a.clone(), 1);
    let a_hashes = e.request_hashes(ia).unwrap()[..3].to_vec();
    let (events, _) = run(&mut e).await;
    assert_eq!(first.usage().unwrap().cached_tokens, 0);
    assert_eq!(
        cpu_stored(&events),
        a_hashes,
        "write-through of A's 3 full blocks"
    );
    // The placeholder shape: hashes only.
    let placeholder = events.iter().find(|ev| matches!(ev, KvEvent::Offloaded(_)));
    assert_eq!(
        placeholder,
        Some(&KvEvent::offload_placeholder(a_hashes.clone()))
    );

    submit(&mut e, ids(2, 17), 1);
    let (events, _) = run(&mut e).await;
    let removed = gpu_removed(&events);
    assert!(
        a_hashes.iter().all(|h| removed.contains(h)),
        "A left the GPU"
    );
    assert_eq!(
        e.offload().unwrap().len(),
        3 + 4,
        "both prefixes in the tier"
    );

    let (_, again) = submit(&mut e, a, 1);
    let (events, took) = run(&mut e).await;
    assert_eq!(
        again.usage().unwrap().cached_tokens,
        12,
        "loaded, not computed"
    );
    // The loaded blocks become GPU blocks again, with their tokens; nothing new in the tier.
    let restored: Vec<u64> = events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(&restored[..3], &a_hashes[..]);
    assert!(cpu_stored(&events).is_empty());
    assert!(took >= LATENCY + BLOCK_LOAD * 3, "{took:?}");
    let m = &e.metrics;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&m.external_prefix_cache_hits), 12);
    assert_eq!(load(&m.offload_load_bytes), 3 * 4 * 131_072);
    assert_eq!(
        load(&m.offload_load_ns),
        (LATENCY + BLOCK_LOAD * 3).as_nanos() as u64
    );
}

/// While a request waits for its load, the request behind it is scheduled.
#[tokio::test(start_paused = true)]
async fn a_loading_request_does_not_hold_up_the_queue() {
    let mut e = engine(40, 64, false);
    let long = ids(3, 41); // 10 full blocks: a 21 ms load
    submit(&mut e, long.clone(), 1);
    run(&mut e).await;
    e.clear_gpu_for_test();
    let (loading, _) = submit(&mut e, long, 1);
    let (cold, _) = submit(&mut e, ids(4, 9), 1);
    let mut plan = StepPlan::default();
    e.schedule(&mut plan, Instant::now());
    let scheduled: Vec<ReqId> = plan.items.iter().map(|i| i.id).collect();
    assert_eq!(
        scheduled,
        vec![cold],
        "the cold one runs while the other loads"
    );
    assert!(e.next_load_ready().is_some());
    let _ = loading;
}

/// With `self_describing_kv_events` the tier's events carry the GPU event's payload.
#[tokio::test(start_paused = true)]
async fn self_describing_events_carry_tokens_and_parents() {
    let mut e = engine(40, 64, true);
    let prompt = ids(5, 9);
    let (id, _) = submit(&mut e, prompt.clone(), 1);
    let hashes = e.request_hashes(id).unwrap()[..2].to_vec();
    let (events, _) = run(&mut e).await;
    let full: Vec<KvEvent> = events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::Offloaded(inner) => Some((**inner).clone()),
            _ => None,
        })
        .collect();
    assert_eq!(full.len(), 2, "one self-contained event per block");
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        ..
    } = &full[1]
    else {
        panic!("{full:?}")
    };
    assert_eq!(
        (
            block_hashes,
            *parent_block_hash,
            &token_ids[..],
            *block_size
        ),
        (&vec![hashes[1]], Some(hashes[0]), &prompt[4..8], 4)
    );
}
