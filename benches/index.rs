//! Ownership-index costs: lookup of a 4k-token prompt (256 blocks of 16) at 1, 64 and 256
//! candidate endpoints, insertion, and memory per (block, endpoint) entry measured with a
//! counting allocator.
//!
//! `cargo bench --bench index`

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvrouter::index::{EndpointId, IndexOptions, ManualClock, OwnershipIndex};

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

const BLOCKS: u64 = 256; // 4096 tokens in 16-token blocks

fn hashes(seed: u64, n: u64) -> Vec<u64> {
    (0..n)
        .map(|i| (seed << 32 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed)
        .collect()
}

fn new_index() -> OwnershipIndex {
    OwnershipIndex::new(
        IndexOptions {
            default_capacity_blocks: 1 << 20,
            prediction_ttl: Duration::from_secs(3600),
            shards: 64,
        },
        Arc::new(ManualClock::new(1)),
    )
}

/// `endpoints` endpoints; each holds a 128-block prefix shared by all (`shared`) or its own,
/// then its own 128-block tail. The request is endpoint 0's full prompt.
fn setup(endpoints: u32, shared: bool) -> (OwnershipIndex, Vec<u64>, Vec<EndpointId>) {
    let idx = new_index();
    let common = hashes(1 << 20, BLOCKS / 2);
    let mut request = Vec::new();
    for e in 0..endpoints {
        let mut prompt = if shared {
            common.clone()
        } else {
            hashes(u64::from(e) * 2 + 1, BLOCKS / 2)
        };
        prompt.extend(hashes(u64::from(e) * 2 + 2, BLOCKS / 2));
        idx.insert_predicted(e, &prompt).unwrap();
        if e == 0 {
            request = prompt;
        }
    }
    (idx, request, (0..endpoints).collect())
}

fn bench_index(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup_4k_tokens");
    g.sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for shared in [false, true] {
        for n in [1u32, 64, 256] {
            let (idx, request, candidates) = setup(n, shared);
            let m = idx.lookup(&request, &candidates);
            assert_eq!(m[0].blocks as u64, BLOCKS);
            let label = if shared {
                "hot_shared_prefix"
            } else {
                "distinct_prefixes"
            };
            g.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter(|| black_box(idx.lookup(black_box(&request), &candidates)))
            });
        }
    }
    // A miss: nothing matches block 0, so the lookup stops at once.
    let (idx, _, candidates) = setup(256, false);
    let miss = hashes(999_999, BLOCKS);
    g.bench_function("miss_256_endpoints", |b| {
        b.iter(|| black_box(idx.lookup(black_box(&miss), &candidates)))
    });
    g.finish();

    let mut g = c.benchmark_group("insert_predicted_4k_tokens");
    g.sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let (idx, request, _) = setup(64, true);
    g.bench_function("refresh_existing", |b| {
        b.iter(|| idx.insert_predicted(0, black_box(&request)).unwrap())
    });
    let idx = new_index();
    let mut seed = 0u64;
    g.bench_function("new_blocks_with_eviction", |b| {
        idx.set_capacity(0, 31_250).unwrap();
        b.iter(|| {
            seed += 1;
            idx.insert_predicted(0, &hashes(seed, BLOCKS)).unwrap()
        })
    });
    g.finish();

    memory_per_entry();
}

/// Live heap bytes per (block, endpoint) entry, measured, and as `stats()` estimates it.
fn memory_per_entry() {
    for (label, endpoints, shared) in [
        ("1 endpoint, distinct blocks", 1u32, false),
        ("64 endpoints, distinct blocks", 64, false),
        ("64 endpoints, 50% of each prompt shared by all", 64, true),
    ] {
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        let idx = new_index();
        let prompts = 200_000 / (u64::from(endpoints) * BLOCKS) + 1;
        let common = hashes(1 << 30, BLOCKS / 2);
        for e in 0..endpoints {
            for p in 0..prompts {
                let seed = (u64::from(e) << 16) | p;
                let mut prompt = if shared {
                    common.clone()
                } else {
                    hashes(seed * 2 + 1, BLOCKS / 2)
                };
                prompt.extend(hashes(seed * 2 + 2, BLOCKS / 2));
                idx.insert_predicted(e, &prompt).unwrap();
            }
        }
        let measured = LIVE_BYTES.load(Ordering::Relaxed) - before;
        let stats = idx.stats();
        println!(
            "memory {label}: {} entries, {} blocks: {:.1} B/entry measured, {:.1} B/entry from stats()",
            stats.entries,
            stats.blocks,
            measured as f64 / stats.entries as f64,
            stats.heap_bytes as f64 / stats.entries as f64,
        );
        drop(idx);
    }
}

criterion_group!(benches, bench_index);
criterion_main!(benches);
