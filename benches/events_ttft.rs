//! TTFT with precise cache ownership (KV events) vs predictions only, on a shared-prefix
//! workload whose replicas' caches are under eviction pressure.
//!
//! Four simulated A100-class replicas (in process, `time_scale` 10, small KV caches) publish KV
//! events over loopback ZMQ. Requests are one of 48 shared 1024-token prefixes (Zipf
//! popularity) plus a unique 128-token suffix, spread over two router instances (as when the
//! router runs beside each gateway replica: neither sees the other's decisions); background
//! traffic that bypasses both sends unique 2048-token prompts straight to random replicas,
//! evicting what it displaces. The prefixes alone need about 77% of the fleet's KV blocks.
//! Both modes route with the same rule, minimum (in-flight prompt tokens + uncached prompt
//! tokens, each router counting its own in-flight requests), and differ only in where the match
//! comes from:
//!
//! - `predictions`: each router's index is fed only with its own routing decisions (TTL 120 s,
//!   capacity per endpoint = the engine's KV blocks, as `vllm:cache_config_info` would give);
//! - `precise`: each router's index is fed by the engines' KV events ([`KvEvents`]),
//!   predictions bridging the event lag ([`KvEvents::record_routed`]).
//!
//! Not a microbenchmark (no criterion): it prints one table. TTFTs are simulated time (observed
//! x `time_scale`). `cargo bench --bench events_ttft`; under `cargo test` (no `--bench`
//! argument) it runs 3 simulated seconds at the lowest rate, as a smoke test whose numbers mean
//! nothing (debug build).

use kvsim::inproc as sim_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvrouter::config::Config;
use kvrouter::events::{KvEvents, SourceState};
use kvrouter::index::{
    Clock, EndpointId, EndpointInterner, IndexOptions, OwnershipIndex, TokioClock,
};
use kvrouter::prefix::{BlockHasher, Namespace};
use kvsim::driver::AdminCommand;
use kvsim::{KvEventsConfig, Replica};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

const REPLICAS: usize = 4;
const TIME_SCALE: f64 = 10.0;
/// KV blocks per replica (16 tokens each), null block included.
const GPU_BLOCKS: u32 = 1_000;
const PREFIXES: usize = 48;
/// Router instances sharing the traffic.
const ROUTERS: usize = 2;
const PREFIX_TOKENS: usize = 1_024;
const SUFFIX_TOKENS: usize = 128;
const BYPASS_TOKENS: usize = 2_048;
/// Simulated seconds of arrivals (3 under `cargo test`).
const DURATION_S: f64 = 60.0;
/// Routed requests per simulated second (all routers), one run each; `EVENTS_TTFT_RATE=r`
/// runs only `r`.
const ROUTED_RATES: [f64; 4] = [16.0, 24.0, 32.0, 40.0];
/// Bypass requests per simulated second (all replicas).
const BYPASS_RATE: f64 = 1.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Predictions,
    Precise,
}

struct Sim {
    replica: Arc<Replica>,
    app: axum::Router,
}

/// What routes: the index to read and how to record a decision.
struct Router {
    index: Arc<OwnershipIndex>,
    events: Option<KvEvents>,
    ids: Vec<EndpointId>,
    /// Prompt tokens this router sent each replica that it believes uncached and whose first
    /// token has not come back yet: its estimate of the replica's prefill queue.
    pending_prefill: Vec<AtomicU64>,
}

impl Router {
    /// Minimum (pending prefill tokens + this prompt's uncached tokens), the predicted TTFT in
    /// token units; ties to the lower index. Returns the pick, its confirmed blocks and its
    /// uncached tokens.
    fn pick(&self, hashes: &[u64], prompt_tokens: u64) -> (usize, u32, u64) {
        let matches = self.index.lookup(hashes, &self.ids);
        let uncached = |i: usize| prompt_tokens.saturating_sub(u64::from(matches[i].blocks) * 16);
        let cost = |i: usize| self.pending_prefill[i].load(Ordering::Relaxed) + uncached(i);
        let best = (0..self.ids.len()).min_by_key(|&i| cost(i)).unwrap();
        (best, matches[best].confirmed_blocks, uncached(best))
    }

    fn record(&self, i: usize, hashes: &[u64], confirmed: u32) {
        match &self.events {
            Some(events) => events
                .record_routed(
                    self.ids[i],
                    hashes,
                    confirmed,
                    None,
                    std::time::Duration::ZERO,
                )
                .unwrap(),
            None => self.index.insert_predicted(self.ids[i], hashes).unwrap(),
        }
    }
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(1_000..30_000)).collect()
}

async fn fleet(mode: Mode) -> (Vec<Sim>, Vec<Router>) {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let mut sims = Vec::new();
    let mut endpoints = String::new();
    let addresses: Vec<SocketAddr> = (0..REPLICAS)
        .map(|i| format!("127.0.0.1:{}", 19_000 + i).parse().unwrap())
        .collect();
    for (i, address) in addresses.iter().enumerate() {
        let mut cfg = sim_support::config(&format!("r{i}"));
        cfg.profile = "a100-llama3-8b".into();
        cfg.time_scale = TIME_SCALE;
        cfg.num_gpu_blocks = Some(GPU_BLOCKS);
        cfg.kv_events = Some(KvEventsConfig {
            endpoint: testkit::KV_EVENTS_BIND.into(),
            topic: String::new(),
            bind: true,
            ..KvEventsConfig::default()
        });
        let (replica, app) = sim_support::start(cfg).await;
        endpoints.push_str(&format!(
            "      - address: {address}\n        kv_events: {{connect: \"{}\"}}\n",
            replica.kv_events_endpoint().unwrap()
        ));
        sims.push(Sim { replica, app });
    }
    let yaml = format!(
        "cache_index: {{default_capacity_blocks: {}, prediction_ttl_ms: 120000}}\npools:\n  - name: p\n    models: [m]\n    endpoints:\n{endpoints}",
        GPU_BLOCKS - 1
    );
    let mut config = Config::parse_and_validate(&yaml, "bench").unwrap();
    if mode == Mode::Predictions {
        for ep in &mut config.pools[0].endpoints {
            ep.kv_events = None;
        }
    }
    let mut routers = Vec::new();
    for _ in 0..ROUTERS {
        let index = Arc::new(OwnershipIndex::new(
            IndexOptions::from(&config.cache_index),
            Arc::clone(&clock),
        ));
        let interner = Arc::new(EndpointInterner::new());
        // Nothing reclaims ids here: each stays its address's after the lease is dropped.
        let ids: Vec<EndpointId> = addresses.iter().map(|a| interner.lease(*a).id()).collect();
        let events = match mode {
            Mode::Predictions => None,
            Mode::Precise => Some(
                KvEvents::start(
                    &config,
                    &kvrouter::prefix::TokenizerRegistry::empty(),
                    Arc::clone(&index),
                    interner,
                    Arc::clone(&clock),
                )
                .await
                .unwrap(),
            ),
        };
        routers.push(Router {
            index,
            events,
            pending_prefill: (0..REPLICAS).map(|_| AtomicU64::new(0)).collect(),
            ids,
        });
    }
    // Drop the (empty) caches until a clear gets through every subscription.
    for r in &routers {
        let Some(events) = &r.events else { continue };
        for (i, sim) in sims.iter().enumerate() {
            let start = Instant::now();
            while events.source_state(r.ids[i]) != SourceState::Trusted {
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "no events from r{i}"
                );
                sim.replica.admin(AdminCommand::DropCache).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    (sims, routers)
}

#[derive(Default)]
struct Outcome {
    ttft_ms: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

async fn run(mode: Mode, rate: f64, duration_s: f64) -> Outcome {
    let (sims, routers) = fleet(mode).await;
    let sims = Arc::new(sims);
    let routers: Vec<Arc<Router>> = routers.into_iter().map(Arc::new).collect();
    let hasher = BlockHasher::new(&Namespace::new("m", None, None), 16);
    let prefixes: Arc<Vec<Vec<u32>>> = Arc::new(
        (0..PREFIXES)
            .map(|p| tokens(p as u64, PREFIX_TOKENS))
            .collect(),
    );
    let zipf: Vec<f64> = (1..=PREFIXES).map(|k| 1.0 / k as f64).collect();
    let zipf_total: f64 = zipf.iter().sum();
    let mut rng = StdRng::seed_from_u64(7);
    let start = Instant::now();
    let mut tasks = Vec::new();
    let (mut t_routed, mut t_bypass) = (0.0f64, 0.0f64);
    let mut n = 0u64;
    loop {
        // Exponential inter-arrival times, in simulated seconds.
        let next_routed = t_routed - (1.0 - rng.random::<f64>()).ln() / rate;
        let next_bypass = t_bypass - (1.0 - rng.random::<f64>()).ln() / BYPASS_RATE;
        let routed = next_routed <= next_bypass;
        let at = if routed { next_routed } else { next_bypass };
        if at > duration_s {
            break;
        }
        if routed {
            t_routed = next_routed;
        } else {
            t_bypass = next_bypass;
        }
        n += 1;
        let when = start + Duration::from_secs_f64(at / TIME_SCALE);
        let router = Arc::clone(&routers[n as usize % ROUTERS]);
        let (sims, prefixes) = (Arc::clone(&sims), Arc::clone(&prefixes));
        if routed {
            let mut pick = rng.random::<f64>() * zipf_total;
            let mut p = 0;
            while pick > zipf[p] && p + 1 < PREFIXES {
                pick -= zipf[p];
                p += 1;
            }
            let prompt: Vec<u32> = prefixes[p]
                .iter()
                .copied()
                .chain(tokens(1_000_000 + n, SUFFIX_TOKENS))
                .collect();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(when).await;
                let hashes = hasher.hash_tokens(&prompt, usize::MAX);
                let len = prompt.len() as u64;
                let (i, confirmed, uncached) = router.pick(&hashes, len);
                router.record(i, &hashes, confirmed);
                router.pending_prefill[i].fetch_add(uncached, Ordering::Relaxed);
                let (ttft, cached) = stream(&sims[i].app, &prompt, || {
                    router.pending_prefill[i].fetch_sub(uncached, Ordering::Relaxed);
                })
                .await;
                Some((ttft.as_secs_f64() * 1e3 * TIME_SCALE, len, cached))
            }));
        } else {
            let target = rng.random_range(0..REPLICAS);
            let prompt = tokens(2_000_000 + n, BYPASS_TOKENS);
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(when).await;
                let body = sim_support::tokens_body(&prompt, 1);
                sim_support::call(&sims[target].app, "POST", "/v1/completions", Some(&body)).await;
                None
            }));
        }
    }
    let mut out = Outcome::default();
    for t in tasks {
        if let Some((ttft, prompt, cached)) = t.await.unwrap() {
            out.ttft_ms.push(ttft);
            out.prompt_tokens += prompt;
            out.cached_tokens += cached;
        }
    }
    if let Some(events) = &routers[0].events {
        for s in events.status() {
            let c = s.counters;
            eprintln!(
                "  {} {:?}: {} messages, {} blocks stored, {} removed, {} gaps",
                s.address, s.state, c.messages, c.blocks_mapped, c.blocks_removed, c.gaps
            );
        }
    }
    out
}

/// Streams a completion of `prompt` from `app`; calls `first_token` when the first token
/// arrives. Returns the time to it and the request's `cached_tokens`.
async fn stream(app: &axum::Router, prompt: &[u32], first_token: impl FnOnce()) -> (Duration, u64) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut body = sim_support::tokens_body(prompt, 16);
    body["stream"] = true.into();
    let mut req = axum::http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(SocketAddr::from((
            [127, 0, 0, 1],
            40000,
        ))));
    let start = Instant::now();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let mut body = resp.into_body();
    let (mut ttft, mut first_token, mut text) = (None, Some(first_token), String::new());
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.unwrap().data_ref() {
            let s = std::str::from_utf8(data).unwrap();
            if ttft.is_none() && s.contains("\"text\":") {
                ttft = Some(start.elapsed());
                if let Some(f) = first_token.take() {
                    f();
                }
            }
            text.push_str(s);
        }
    }
    if let Some(f) = first_token.take() {
        f();
    }
    let usage = text
        .split("data: ")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .filter_map(|v| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64())
        .last()
        .unwrap_or(0);
    (ttft.unwrap_or_else(|| start.elapsed()), usage)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let benching = std::env::args().any(|a| a == "--bench");
    let duration_s = if benching { DURATION_S } else { 3.0 };
    let rates: Vec<f64> = match std::env::var("EVENTS_TTFT_RATE") {
        Ok(r) => vec![r.parse().expect("EVENTS_TTFT_RATE is a number")],
        Err(_) if benching => ROUTED_RATES.to_vec(),
        Err(_) => ROUTED_RATES[..1].to_vec(),
    };
    eprintln!(
        "{REPLICAS} replicas x {} KV blocks, {ROUTERS} routers, {PREFIXES} prefixes of {PREFIX_TOKENS} tokens + {SUFFIX_TOKENS}, bypass {BYPASS_RATE}/s x {BYPASS_TOKENS} tokens, {duration_s} s",
        GPU_BLOCKS - 1
    );
    println!(
        "{:>6} {:<12} {:>8} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "rate", "mode", "requests", "ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "hit_rate"
    );
    for rate in rates {
        for mode in [Mode::Predictions, Mode::Precise] {
            let mut o = rt.block_on(run(mode, rate, duration_s));
            o.ttft_ms.sort_by(f64::total_cmp);
            let mean = o.ttft_ms.iter().sum::<f64>() / o.ttft_ms.len() as f64;
            println!(
                "{:>4}/s {:<12} {:>8} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.1}%",
                rate,
                format!("{mode:?}").to_lowercase(),
                o.ttft_ms.len(),
                percentile(&o.ttft_ms, 0.5),
                percentile(&o.ttft_ms, 0.9),
                percentile(&o.ttft_ms, 0.99),
                mean,
                100.0 * o.cached_tokens as f64 / o.prompt_tokens as f64,
            );
        }
    }
}
