//! What one routing decision costs when every candidate holds the prompt's prefix (the worst
//! case for the index lookup and the policy: every candidate matches every block), at 8, 64 and
//! 256 endpoints: body parsed, identity hashed (no tokenizer: tokenization is measured by
//! `benches/prefix.rs`), candidates looked up and scored by `predicted-ttft`, the decision
//! committed and its ticket dropped. Every endpoint's engine is scraped (a sample stored, as the
//! scraper does, untimed) before the first decision and every 100 after, so each candidate's
//! engine signal is fresh and read, as in a fleet where scraping is on. Timed one by one, so the tail is real: prints p50 / p99 /
//! p99.9 per round and the median of the rounds.
//!
//! Not criterion: the question is a tail percentile, which needs every sample.
//!
//! The host's own tail: after each round a pure CPU loop (no memory, no locks, no allocation)
//! calibrated to the round's median is timed the same way, as many times; its p99 is what this
//! machine gives any work of that length (on the 2-core VM here the 4 ms timer tick costs each
//! unit it lands in tens of microseconds). A decision p99 near that floor is the host's, not
//! the decision's.
//!
//! `cargo bench --bench decision` (`-- --decisions N --rounds R` to change the size,
//! `-- --endpoints N` for one fleet size only, e.g. under a profiler, `-- --events 1` for a pool
//! whose engines push KV events, `-- --recall-weight W` to price prefixes' homes
//! at W, default 16 as the router's (`policy.predicted_ttft.recall_weight`: each decision also
//! looks its prompt up in, and records its pick into, the home table; 0 turns that off))

use std::hint::black_box;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrouter::config::Config;
use kvrouter::load::EngineSample;
use kvrouter::request::{self, ApiKind};
use kvrouter::router::{RouteContext, Router};
use kvrouter::telemetry::Metrics;

mod support;
use support::{arg, median};

fn router(endpoints: usize, events: bool, recall_weight: usize) -> (Router, Vec<SocketAddr>) {
    let addrs: Vec<SocketAddr> = (0..endpoints)
        .map(|i| {
            format!("127.0.{}.{}:8000", 1 + i / 250, 1 + i % 250)
                .parse()
                .unwrap()
        })
        .collect();
    let list: String = addrs
        .iter()
        .map(|a| format!("{{address: '{a}'}}, "))
        .collect();
    // With `--events`, the pool's engines push KV events (none arrive here): every candidate's
    // event source is read per decision, as in a fleet with events on.
    let events = if events {
        "kv_events: {push: true}, "
    } else {
        ""
    };
    let yaml = format!(
        "policy: {{name: predicted-ttft, predicted_ttft: {{recall_weight: {recall_weight}}}}}\npools: [{{name: a, models: [m], {events}endpoints: [{list}]}}]"
    );
    let router = Router::new(
        Config::parse_and_validate(&yaml, "bench").expect("config"),
        Arc::new(Metrics::new()),
        Path::new("."),
    )
    .expect("router");
    (router, addrs)
}

/// A chat body: a shared 4 kB system prompt and a question that varies per request.
fn body(i: usize) -> Vec<u8> {
    serde_json::json!({"model": "m", "max_tokens": 64, "messages": [
        {"role": "system", "content": "You are a careful assistant for a logistics company. ".repeat(80)},
        {"role": "user", "content": format!("Where is parcel {}?", i % 512)}]})
    .to_string()
    .into_bytes()
}

/// Stores a fresh engine sample for every endpoint, as a scrape round would.
fn scrape_all(router: &Router, round: u64) {
    let now = tokio::time::Instant::now();
    for (i, ep) in router.handles().admin.endpoints().all().iter().enumerate() {
        let i = i as u64 + round;
        ep.load.engine.store(EngineSample {
            waiting_requests: i % 4,
            running_requests: 2 + i % 8,
            kv_cache_usage: 0.25 + (i % 50) as f64 / 100.0,
            capacity_tokens: None,
            block_size_tokens: None,
            lora: None,
            cpu_offload_bytes: None,
            cpu_loaded: None,
            scraped_at: now,
        });
    }
}

/// One decision: its time, the fewest blocks any candidate matched and how many candidates'
/// engine signals were fresh.
fn decide(router: &Router, body: &[u8], subset: Option<&[SocketAddr]>) -> (Duration, u32, usize) {
    let started = Instant::now();
    let parsed = request::parse(ApiKind::ChatCompletions, body).expect("valid body");
    let ctx = RouteContext {
        subset,
        ..RouteContext::default()
    };
    let decision = router
        .decide(&router.snapshot(), &parsed, ctx)
        .expect("a pick");
    let took = started.elapsed();
    let least_matched = decision
        .plan
        .matches
        .iter()
        .map(|m| m.blocks)
        .min()
        .unwrap_or(0);
    let fresh = decision
        .plan
        .signals
        .iter()
        .filter(|s| s.engine == "fresh")
        .count();
    black_box(decision);
    (took, least_matched, fresh)
}

/// Pure CPU work, `iters` rounds of a multiply-add chain.
fn spin(iters: u64) {
    let mut x = 0u64;
    for i in 0..iters {
        x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
    }
}

/// Iterations of [`spin`] that take about `target_us`.
fn calibrate(target_us: f64) -> u64 {
    let mut iters = 1_000u64;
    for _ in 0..50 {
        let started = Instant::now();
        for _ in 0..20 {
            spin(iters);
        }
        let us = started.elapsed().as_secs_f64() * 1e6 / 20.0;
        if (us - target_us).abs() < target_us * 0.02 {
            break;
        }
        iters = ((iters as f64 * target_us / us.max(0.01)) as u64).max(1);
    }
    iters
}

/// `n` timings of pure CPU work as long as a median decision, sorted.
fn host_floor(target_us: f64, n: usize) -> Vec<u64> {
    let iters = calibrate(target_us);
    let mut ns: Vec<u64> = (0..n)
        .map(|_| {
            let started = Instant::now();
            spin(iters);
            started.elapsed().as_nanos() as u64
        })
        .collect();
    ns.sort_unstable();
    ns
}

fn q(sorted_ns: &[u64], p: f64) -> f64 {
    sorted_ns[((sorted_ns.len() - 1) as f64 * p) as usize] as f64 / 1e3
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: a smoke run, not a measurement.
    let measuring = support::measuring();
    let decisions = arg("--decisions", if measuring { 20_000 } else { 100 });
    let rounds = arg("--rounds", if measuring { 5 } else { 1 });
    let bodies: Vec<Vec<u8>> = (0..512).map(body).collect();
    println!(
        "decision (parse, byte identity, lookup, predicted-ttft, commit), every endpoint holding \
         the 4 kB system prompt; {decisions} decisions per round, {rounds} rounds"
    );
    println!(
        "{:>9} {:>5} {:>10} {:>10} {:>10} | {:>14} {:>14}",
        "endpoints", "round", "p50 us", "p99 us", "p99.9 us", "host p50 us", "host p99 us"
    );
    let only = arg("--endpoints", 0);
    let events = arg("--events", 0) == 1;
    let recall_weight = arg("--recall-weight", 16);
    println!("homes priced: recall_weight {recall_weight}");
    // The event hub starts its silence checker on the runtime it is built in.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _entered = runtime.enter();
    let sizes: Vec<usize> = if only > 0 {
        vec![only]
    } else {
        vec![8, 64, 256]
    };
    for endpoints in sizes {
        let (router, addrs) = router(endpoints, events, recall_weight);
        // Each endpoint routes the prompt once (a subset hint of just that endpoint), so each
        // holds its prefix by prediction.
        for (i, addr) in addrs.iter().enumerate() {
            decide(
                &router,
                &bodies[i % bodies.len()],
                Some(std::slice::from_ref(addr)),
            );
        }
        scrape_all(&router, 0);
        let (_, least, fresh) = decide(&router, &bodies[0], None);
        assert!(
            least > 0,
            "every candidate should hold the system prompt's blocks"
        );
        assert_eq!(
            fresh, endpoints,
            "every candidate's engine signal should be fresh"
        );
        let (mut p50s, mut p99s, mut floor_p99s) = (vec![], vec![], vec![]);
        for r in 0..rounds {
            let mut stale = 0;
            let mut ns: Vec<u64> = (0..decisions)
                .map(|i| {
                    if i % 100 == 0 {
                        scrape_all(&router, (r * decisions + i) as u64);
                    }
                    let (took, _, fresh) = decide(&router, &bodies[i % bodies.len()], None);
                    stale += endpoints - fresh;
                    took.as_nanos() as u64
                })
                .collect();
            assert_eq!(stale, 0, "some engine signals went stale within a round");
            ns.sort_unstable();
            let floor = host_floor(q(&ns, 0.5), decisions);
            println!(
                "{endpoints:>9} {:>5} {:>10.1} {:>10.1} {:>10.1} | {:>14.1} {:>14.1}",
                r + 1,
                q(&ns, 0.5),
                q(&ns, 0.99),
                q(&ns, 0.999),
                q(&floor, 0.5),
                q(&floor, 0.99)
            );
            p50s.push(q(&ns, 0.5));
            p99s.push(q(&ns, 0.99));
            floor_p99s.push(q(&floor, 0.99));
        }
        println!(
            "{endpoints:>9} median p50 {:.1} us, p99 {:.1} us (range {:.1}-{:.1}); host floor p99 {:.1} us",
            median(p50s),
            median(p99s.clone()),
            p99s.iter().cloned().fold(f64::INFINITY, f64::min),
            p99s.iter().cloned().fold(0.0, f64::max),
            median(floor_p99s)
        );
    }
}
