//! Policy scoring cost: one `rank` call over 1, 8, 64 and 256 candidates with varied load and
//! cached-prefix matches, per named policy. A new policy is one line in `POLICIES`.
//!
//! `cargo bench --bench policy`

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvrouter::config::{PolicyConfig, PolicyName};
use kvrouter::policy::{self, CandidateView, EngineLoad, RequestView, RouterLoad};

/// The policies measured, by config name.
const POLICIES: &[PolicyName] = &PolicyName::ALL;

/// Candidate counts.
const SIZES: &[usize] = &[1, 8, 64, 256];

/// Deterministic, varied candidates: loads 0-31 requests, 0-64k prefill tokens, matches of a
/// 4k-token prompt in whole 16-token blocks.
fn candidates(n: usize) -> Vec<CandidateView> {
    (0..n)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 7;
            CandidateView {
                address: SocketAddr::from(([10, 0, (i / 250) as u8, (i % 250) as u8 + 1], 8000)),
                weight: 1.0 + (h % 3) as f64,
                load: RouterLoad {
                    in_flight_requests: h % 32,
                    in_flight_prefill_tokens: (h >> 5) % 65_536,
                    in_flight_prefilling: h % 16,
                    prefill_head_elapsed_us: 0,
                },
                max_in_flight: (h % 5 == 0).then_some(24),
                matched_tokens: ((h >> 11) % 257) * 16,
                confirmed_tokens: ((h >> 11) % 257) * 8,
                held_tokens: ((h >> 11) % 257) * 16,
                offloaded: Default::default(),
                prefill_tokens_per_s: 8_000.0 + ((h >> 20) % 8) as f64 * 4_000.0,
                engine: (h % 3 != 0).then_some(EngineLoad {
                    waiting_requests: (h >> 23) % 8,
                    running_requests: (h >> 26) % 64,
                    kv_cache_usage: ((h >> 29) % 100) as f64 / 100.0,
                }),
                ttft_residual_ms: ((h >> 33) % 20) as f64,
                recalled_tokens: 0,
            }
        })
        .collect()
}

fn bench_policies(c: &mut Criterion) {
    let request = RequestView {
        prompt_tokens: 4096,
        max_tokens: Some(256),
        arrivals_per_endpoint_s: 2.0,
        // The pick and the two fallbacks a decision hands the gateway by default.
        ranked: 3,
        ..RequestView::default()
    };
    let mut group = c.benchmark_group("policy_rank");
    group.measurement_time(Duration::from_secs(3));
    for &name in POLICIES {
        let policy = policy::build(&PolicyConfig {
            name,
            ..PolicyConfig::default()
        });
        for &n in SIZES {
            let cands = candidates(n);
            group.bench_with_input(BenchmarkId::new(name.as_str(), n), &cands, |b, cands| {
                b.iter(|| black_box(policy.rank(black_box(&request), black_box(cands))).pick())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_policies);
criterion_main!(benches);
