//! The simulator's own cost, so a fleet of replicas is never the bottleneck of a benchmark:
//! one engine step (scheduling + KV bookkeeping) at realistic batch sizes, admission with
//! prefix hashing, and KV-event encoding.
//!
//! `cargo bench --bench sim_engine`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvsim::engine::{Engine, EngineConfig, NewRequest, Output, OutputSink, StepPlan};
use kvsim::kv_events::{encode_batch, KvEvent};
use kvsim::metrics::SimMetrics;
use kvsim::{PromptTokens, WordPieceTokenizer};
use tokio::time::Instant;

struct Discard;

impl OutputSink for Discard {
    fn deliver(&mut self, _: Output) -> bool {
        true
    }
}

fn engine(record_events: bool) -> Engine<Discard> {
    let cfg = EngineConfig {
        block_size: 16,
        num_gpu_blocks: 25_000,
        max_num_seqs: 1024,
        max_num_batched_tokens: 8192,
        max_model_len: 32_768,
        hash_seed: 0,
        record_events,
        track_loras: false,
        offload: None,
    };
    Engine::new(
        cfg,
        Arc::new(WordPieceTokenizer::default()),
        Arc::new(SimMetrics::default()),
    )
}

fn prompt(seed: u32, shared: usize, len: usize) -> PromptTokens {
    let ids = (0..len as u32)
        .map(|i| {
            if (i as usize) < shared {
                500 + i
            } else {
                1000 + (seed * 7919 + i * 31) % 30_000
            }
        })
        .collect();
    PromptTokens {
        ids,
        mm: Vec::new(),
    }
}

fn submit(e: &mut Engine<Discard>, p: PromptTokens, max_tokens: u32) {
    let req = NewRequest {
        prompt: p,
        max_tokens,
        lora: None,
        cache_salt: None,
        sink: Discard,
        arrival: Instant::now(),
    };
    if e.add(req).is_err() {
        panic!("request rejected");
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("sim_engine");
    for batch in [64u32, 256] {
        // `batch` requests decoding 1k-token contexts; a finished request is replaced at once
        // (1k prompt, 512 of it cached), so every step is a full batch, as under load.
        let mut e = engine(true);
        let mut next = 0;
        let mut plan = StepPlan::default();
        let step = |e: &mut Engine<Discard>, plan: &mut StepPlan, next: &mut u32| {
            while (e.queue_lengths().0 + e.queue_lengths().1) < batch as usize {
                submit(e, prompt(*next, 512, 1024), 256);
                *next += 1;
            }
            e.schedule(plan, Instant::now());
            e.finish_step(plan, Instant::now());
            e.take_events()
        };
        for _ in 0..600 {
            step(&mut e, &mut plan, &mut next);
        }
        group.throughput(Throughput::Elements(u64::from(batch)));
        group.bench_function(format!("decode_step_{batch}_seqs"), |b| {
            b.iter(|| step(&mut e, &mut plan, &mut next))
        });
    }

    // A 2k-token request whose first 1k tokens are cached: admission (hashing), lookup,
    // allocation with events, and its prefill step.
    group.throughput(Throughput::Elements(1));
    let mut e = engine(true);
    submit(&mut e, prompt(0, 1024, 1024), 1);
    let mut plan = StepPlan::default();
    while e.has_work() {
        e.schedule(&mut plan, Instant::now());
        e.finish_step(&plan, Instant::now());
    }
    let mut seed = 1;
    group.bench_function("admit_and_prefill_2k_with_1k_hit", |b| {
        b.iter_batched(
            || {
                seed += 1;
                prompt(seed, 1024, 2048)
            },
            |p| {
                submit(&mut e, p, 1);
                while e.has_work() {
                    e.schedule(&mut plan, Instant::now());
                    e.finish_step(&plan, Instant::now());
                }
                e.take_events()
            },
            BatchSize::SmallInput,
        )
    });

    let stored = KvEvent::BlockStored {
        block_hashes: (0..128u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect(),
        parent_block_hash: Some(7),
        token_ids: (0..128 * 16).collect(),
        block_size: 16,
        lora_id: None,
        lora_name: None,
        extra_keys: vec![None; 128],
    };
    group.throughput(Throughput::Elements(128));
    group.bench_function("encode_block_stored_128_blocks", |b| {
        b.iter(|| encode_batch(1.0, std::slice::from_ref(&stored), 0))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
