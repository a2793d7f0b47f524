//! What decision spans cost: the decision as the ext_proc stream makes it (trace context read
//! from the headers, body parsed, router decides and commits, span filled and ended), timed one
//! by one, with tracing off and with tracing on at 100% sampling, in alternating rounds.
//!
//! "On" is the production pipeline minus the network: the OpenTelemetry layer kvrouter installs
//! (`otel::layer`), a parent-based 100% sampler, and a batch span processor exporting to memory
//! (emptied between rounds). "Off" is the default: no OpenTelemetry layer, and
//! `otel::enabled()` false, so `DecisionSpan` is empty.
//!
//! Prints p50 / p99 / p99.9 per round and the median of each mode's rounds. Not criterion: the
//! question is a tail percentile, which needs every sample.
//!
//! `cargo bench --bench tracing_overhead` (`-- --decisions N --rounds R` to change the size)

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrouter::config::Config;
use kvrouter::otel::{self, DecisionSpan, RemoteParent};
use kvrouter::request::{self, ApiKind};
use kvrouter::router::{RouteContext, Router};
use kvrouter::telemetry::Metrics;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, InMemorySpanExporter, Sampler, SdkTracerProvider,
};
use tracing_subscriber::layer::SubscriberExt;

mod support;
use support::{arg, median};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn router() -> Router {
    let endpoints: String = (0..8)
        .map(|i| format!("{{address: '127.0.0.1:{}'}}, ", 8001 + i))
        .collect();
    let yaml = format!(
        "policy: {{name: predicted-ttft}}\npools: [{{name: a, models: [m], endpoints: [{endpoints}]}}]"
    );
    Router::new(
        Config::parse_and_validate(&yaml, "bench").expect("config"),
        Arc::new(Metrics::new()),
        Path::new("."),
    )
    .expect("router")
}

/// A chat body: a shared 2 kB system prompt and a question that varies per request.
fn body(i: usize) -> Vec<u8> {
    serde_json::json!({"model": "m", "max_tokens": 64, "messages": [
        {"role": "system", "content": "You are a careful assistant for a logistics company. ".repeat(40)},
        {"role": "user", "content": format!("Where is parcel {}?", i % 512)}]})
    .to_string()
    .into_bytes()
}

/// One decision as the stream makes it, timed.
fn decide(router: &Router, body: &[u8]) -> Duration {
    let started = Instant::now();
    let parent = RemoteParent::capture(|name| (name == "traceparent").then_some(TRACEPARENT));
    let span = DecisionSpan::start(parent.as_ref(), "bench-request");
    let parsed = request::parse(ApiKind::ChatCompletions, body).expect("valid body");
    let decision = router
        .decide(&router.snapshot(), &parsed, RouteContext::default())
        .expect("a pick");
    span.routed(&decision);
    drop(span);
    let took = started.elapsed();
    black_box(decision);
    took
}

struct Round {
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
}

fn round(router: &Router, bodies: &[Vec<u8>], n: usize) -> Round {
    for b in bodies.iter().take(2_000) {
        decide(router, b);
    }
    let mut ns: Vec<u64> = (0..n)
        .map(|i| decide(router, &bodies[i % bodies.len()]).as_nanos() as u64)
        .collect();
    ns.sort_unstable();
    let q = |p: f64| ns[((ns.len() - 1) as f64 * p) as usize] as f64 / 1e3;
    Round {
        p50_us: q(0.5),
        p99_us: q(0.99),
        p999_us: q(0.999),
    }
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: a smoke run, not a measurement.
    let measuring = support::measuring();
    let decisions = arg("--decisions", if measuring { 50_000 } else { 200 });
    let rounds = arg("--rounds", if measuring { 6 } else { 1 });
    let router = router();
    let bodies: Vec<Vec<u8>> = (0..512).map(body).collect();

    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            1.0,
        ))))
        .with_span_processor(
            BatchSpanProcessor::builder(exporter.clone())
                .with_batch_config(
                    BatchConfigBuilder::default()
                        .with_max_queue_size(8192)
                        .build(),
                )
                .build(),
        )
        .build();
    let on = tracing_subscriber::registry().with(otel::layer(&provider));
    let on = tracing::Dispatch::new(on);
    let off = tracing::Dispatch::new(tracing_subscriber::registry());

    println!("decision with tracing off vs on (100% sampling), {decisions} decisions per round, 8 endpoints, 2 kB chat prompt");
    println!(
        "{:>5} {:>4} {:>9} {:>9} {:>9}",
        "round", "mode", "p50 us", "p99 us", "p99.9 us"
    );
    let (mut off_p99, mut on_p99, mut off_p50, mut on_p50) = (vec![], vec![], vec![], vec![]);
    for r in 0..rounds {
        // Alternate which mode goes first, so drift (other load, caches) hits both alike.
        let order = if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for traced in order {
            otel::set_enabled(traced);
            let dispatch = if traced { &on } else { &off };
            let result =
                tracing::dispatcher::with_default(dispatch, || round(&router, &bodies, decisions));
            // Spans that reached the exporter (the batch queue drops spans when full, as in
            // production): shows the "on" rounds did build and export spans.
            let exported = if traced {
                let _ = provider.force_flush();
                let n = exporter.get_finished_spans().map_or(0, |s| s.len());
                exporter.reset();
                n
            } else {
                0
            };
            let mode = if traced { "on" } else { "off" };
            println!(
                "{r:>5} {mode:>4} {:>9.1} {:>9.1} {:>9.1} {exported:>9}",
                result.p50_us, result.p99_us, result.p999_us
            );
            if traced {
                on_p99.push(result.p99_us);
                on_p50.push(result.p50_us);
            } else {
                off_p99.push(result.p99_us);
                off_p50.push(result.p50_us);
            }
        }
    }
    otel::set_enabled(false);
    let (off99, on99) = (median(off_p99), median(on_p99));
    println!(
        "median of rounds: off p50 {:.1} us p99 {off99:.1} us | on p50 {:.1} us p99 {on99:.1} us | p99 on/off {:.2}x",
        median(off_p50),
        median(on_p50),
        on99 / off99
    );
    let _ = provider.shutdown();
}
