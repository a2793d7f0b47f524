//! KV-event ingestion costs on one core: decoding vLLM batches, and decoding + re-hashing +
//! index updates for an engine in steady state (every step stores new blocks and evicts as many);
//! then memory of the index plus the engine-block tables at 1M blocks x 16 endpoints, measured
//! with a counting allocator.
//!
//! `cargo bench --bench events` (memory only: `cargo bench --bench events -- memory`). Under
//! `cargo test` (no `--bench` argument) every case runs once at a small size, as a smoke test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvrouter::config::Config;
use kvrouter::events::wire::decode_message;
use kvrouter::events::KvEvents;
use kvrouter::index::{Clock, EndpointInterner, IndexOptions, ManualClock, OwnershipIndex};
use kvrouter::prefix::TokenizerRegistry;
use kvsim::kv_events::{encode_batch, KvEvent};

/// Counts live heap bytes.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A hub with `endpoints` endpoints on one bound loopback socket (never used: messages are fed
/// with `ingest`), each endpoint's index capacity `capacity` blocks of 16.
fn hub(
    rt: &tokio::runtime::Runtime,
    endpoints: usize,
    capacity: u64,
) -> (KvEvents, Arc<OwnershipIndex>, Vec<u32>) {
    let mut yaml = format!(
        "cache_index: {{default_capacity_blocks: {capacity}}}\nkv_events: {{max_engine_blocks: 4194304}}\npools:\n  - name: p\n    models: [m]\n    kv_events: {{bind: \"tcp://127.0.0.1:0\", topic: \"kv@{{address}}\"}}\n    endpoints:\n"
    );
    for e in 0..endpoints {
        yaml.push_str(&format!("      - address: 10.0.0.{}:8000\n", e + 1));
    }
    let config = Config::parse_and_validate(&yaml, "bench").unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1));
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::from(&config.cache_index),
        Arc::clone(&clock),
    ));
    let interner = Arc::new(EndpointInterner::new());
    let events = rt
        .block_on(KvEvents::start(
            &config,
            &TokenizerRegistry::empty(),
            Arc::clone(&index),
            Arc::clone(&interner),
            clock,
        ))
        .unwrap();
    let ids = (0..endpoints)
        .map(|e| {
            interner
                .lease(format!("10.0.0.{}:8000", e + 1).parse().unwrap())
                .id()
        })
        .collect();
    (events, index, ids)
}

fn frames(seq: u64, events: &[KvEvent]) -> Vec<Vec<u8>> {
    vec![
        b"kv".to_vec(),
        seq.to_be_bytes().to_vec(),
        encode_batch(1.7e9, events, 0),
    ]
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((seed.wrapping_mul(0x9E37_79B9) ^ i.wrapping_mul(2_654_435_761)) % 50_000) as u32)
        .collect()
}

/// An engine in steady state with `engine_bs`-token blocks: each step stores one new chain of
/// `blocks` blocks and removes the `blocks` blocks stored `lag` steps earlier, one
/// `BlockRemoved` per block as vLLM sends them. Returns the messages and events per message.
fn steady_stream(
    engine_bs: u32,
    blocks: usize,
    steps: usize,
    lag: usize,
) -> (Vec<Vec<Vec<u8>>>, usize) {
    let hash = |step: usize, i: usize| {
        ((step as u64) << 16 | i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
    };
    let mut out = Vec::with_capacity(steps + 1);
    out.push(frames(0, &[KvEvent::AllBlocksCleared]));
    for step in 0..steps {
        let mut events = Vec::new();
        if step >= lag {
            for i in 0..blocks {
                events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![hash(step - lag, i)],
                });
            }
        }
        events.push(KvEvent::BlockStored {
            block_hashes: (0..blocks).map(|i| hash(step, i)).collect(),
            parent_block_hash: None,
            token_ids: tokens(step as u64, blocks * engine_bs as usize),
            block_size: engine_bs,
            lora_id: None,
            lora_name: None,
            extra_keys: vec![None; blocks],
        });
        out.push(frames(step as u64 + 1, &events));
    }
    (out, 2 * blocks.max(1))
}

/// True under `cargo bench`; false under `cargo test`, which runs benches once as tests.
fn benching() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn bench_ingest(c: &mut Criterion) {
    // Engine blocks stored per steady-state run (half of them held at a time).
    let stored_blocks = if benching() { 40_000 } else { 2_000 };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // Decoding alone: a step that stores 4 blocks of 16 and evicts 4.
    let (stream, per_msg) = steady_stream(16, 4, 64, 8);
    let mut g = c.benchmark_group("decode");
    g.sample_size(30).measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(per_msg as u64));
    let msg = &stream[40];
    g.bench_function("step_4_stored_4_removed", |b| {
        b.iter(|| black_box(decode_message(black_box(msg)).unwrap()))
    });
    g.finish();

    // Decode + re-hash + index, steady state: (engine block size, blocks per step).
    let mut g = c.benchmark_group("ingest_steady_state");
    g.sample_size(10).measurement_time(Duration::from_secs(6));
    for (engine_bs, blocks) in [(16u32, 4usize), (16, 32), (128, 1), (128, 4)] {
        let steps = stored_blocks / blocks;
        let (stream, per_msg) = steady_stream(engine_bs, blocks, steps, steps / 2);
        g.throughput(Throughput::Elements((steps * per_msg) as u64));
        g.bench_function(format!("engine_bs_{engine_bs}_x{blocks}_per_step"), |b| {
            b.iter_batched(
                || hub(&rt, 1, 1 << 20),
                |(events, _index, ids)| {
                    for m in &stream {
                        events.ingest(ids[0], m);
                    }
                    events
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    memory(&rt);
}

/// Live bytes of the index and engine-block tables at 1M engine blocks (16 tokens) on each of
/// 16 endpoints: all endpoints holding the same 1M blocks (a fleet serving one corpus), and
/// each holding its own 1M.
fn memory(rt: &tokio::runtime::Runtime) {
    let blocks_per_endpoint: usize = if benching() { 1 << 20 } else { 1 << 10 };
    const CHAIN: usize = 64; // blocks per BlockStored (a 1k-token prompt)
    for shared in [true, false] {
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        let (events, index, ids) = hub(rt, 16, 2 * blocks_per_endpoint as u64);
        let started = Instant::now();
        for (e, &ep) in ids.iter().enumerate() {
            events.ingest(ep, &frames(0, &[KvEvent::AllBlocksCleared]));
            for chain in 0..blocks_per_endpoint / CHAIN {
                let seed = if shared { chain } else { e << 32 | chain } as u64;
                let stored = KvEvent::BlockStored {
                    block_hashes: (0..CHAIN as u64).map(|i| seed << 8 | i).collect(),
                    parent_block_hash: None,
                    token_ids: tokens(seed, CHAIN * 16),
                    block_size: 16,
                    lora_id: None,
                    lora_name: None,
                    extra_keys: vec![None; CHAIN],
                };
                events.ingest(ep, &frames(chain as u64 + 1, &[stored]));
            }
        }
        let elapsed = started.elapsed();
        let measured = LIVE_BYTES.load(Ordering::Relaxed) - before;
        let stats = index.stats();
        let status = events.status();
        let tables: usize = status.iter().map(|s| s.table_bytes).sum();
        let engine_blocks: usize = status.iter().map(|s| s.engine_blocks).sum();
        assert_eq!(stats.entries, 16 * blocks_per_endpoint);
        assert_eq!(engine_blocks, 16 * blocks_per_endpoint);
        println!(
            "memory, 16 endpoints x {} blocks ({}): {} entries, {} distinct blocks: {:.2} GiB measured \
             ({:.1} B/entry); index stats() {:.2} GiB, engine tables {:.2} GiB (estimates); \
             ingested in {:.1} s ({:.2} M blocks/s)",
            blocks_per_endpoint,
            if shared { "same blocks on all" } else { "distinct per endpoint" },
            stats.entries,
            stats.blocks,
            measured as f64 / (1u64 << 30) as f64,
            measured as f64 / stats.entries as f64,
            stats.heap_bytes as f64 / (1u64 << 30) as f64,
            tables as f64 / (1u64 << 30) as f64,
            elapsed.as_secs_f64(),
            (16 * blocks_per_endpoint) as f64 / elapsed.as_secs_f64() / 1e6,
        );
        drop(events);
        drop(index);
    }
}

criterion_group!(benches, bench_ingest);
criterion_main!(benches);
