//! Live-signal costs on the scrape path: parsing an engine's `/metrics` exposition (the real
//! vLLM 0.32 capture, ~53 KB, and the simulator's, ~8.5 KB) into an engine sample, and the
//! health bookkeeping of one scrape result. Also what every new ext_proc stream reads of the
//! config (the long-body rate), next to the standard library's core count it once re-read per
//! call.
//!
//! `cargo bench --bench signals -- --noplot` (criterion's plots need a font this host lacks)

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter::config::{EngineKind, HealthConfig};
use kvrouter::health::EndpointHealth;
use kvrouter::load::exposition::{parse, MetricNames};
use kvsim::metrics::{MetricsInfo, SimMetrics};

fn exposition(c: &mut Criterion) {
    let names = MetricNames::of(EngineKind::Vllm).unwrap();
    let vllm = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/fixtures/vllm-0.32-cpu-smollm2/metrics.txt"
    ))
    .expect("the shared vLLM capture");
    let sim = SimMetrics::default().render(&MetricsInfo {
        model_name: "demo-model".into(),
        block_size: 16,
        num_gpu_blocks: 31_250,
        max_loras: 0,
        offload_bytes: None,
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = rt.enter();
    c.bench_function("parse vllm 0.32 capture (53 KB)", |b| {
        b.iter(|| parse(&names, black_box(&vllm), tokio::time::Instant::now()).unwrap())
    });
    c.bench_function("parse kvsim exposition (8.5 KB)", |b| {
        b.iter(|| parse(&names, black_box(&sim), tokio::time::Instant::now()).unwrap())
    });
    let health = EndpointHealth::default();
    let cfg = HealthConfig::default();
    c.bench_function("record one scrape result", |b| {
        b.iter(|| health.record_scrape(black_box(true), &cfg))
    });
}

fn per_stream(c: &mut Criterion) {
    let routing = kvrouter::config::RoutingConfig::default();
    c.bench_function("long-body rate of a new stream (default config)", |b| {
        b.iter(|| black_box(&routing).heavy_rate())
    });
    c.bench_function("std available_parallelism (uncached)", |b| {
        b.iter(std::thread::available_parallelism)
    });
}

criterion_group!(benches, exposition, per_stream);
criterion_main!(benches);
