//! TTFT with precise cache ownership (KV events) vs predictions only, on a shared-prefix
//! workload whose replicas' caches are under eviction pressure.
//!
//! Four simulated A100-class replicas (in process, `time_scale` 10, small KV caches) publish KV
//! events over loopback ZMQ. Routed requests are one of 32 shared 1024-token prefixes (Zipf
//! popularity) plus a unique 128-token suffix; background traffic that bypasses the router
//! sends unique 2048-token prompts straight to random replicas, evicting what it displaces.
//! Both modes route with the same rule, minimum (in-flight prompt tokens + uncached prompt
//! tokens), and differ only in where the match comes from:
//!
//! - `predictions`: an index fed only with our own routing decisions (TTL 120 s, capacity per
//!   endpoint = the engine's KV blocks, as `vllm:cache_config_info` would give);
//! - `precise`: the index fed by the engines' KV events ([`KvEvents`]), predictions bridging
//!   the event lag ([`KvEvents::record_routed`]).
//!
//! Not a microbenchmark (no criterion): it prints one table. TTFTs are simulated time (observed
//! x `time_scale`). `cargo bench --bench events_ttft`

#[path = "../tests/sim_support/mod.rs"]
mod sim_support;

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
use kvrouter::sim::driver::AdminCommand;
use kvrouter::sim::{KvEventsConfig, Replica};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

const REPLICAS: usize = 4;
const TIME_SCALE: f64 = 10.0;
/// KV blocks per replica (16 tokens each), null block included.
const GPU_BLOCKS: u32 = 1_000;
const PREFIXES: usize = 32;
const PREFIX_TOKENS: usize = 1_024;
const SUFFIX_TOKENS: usize = 128;
const BYPASS_TOKENS: usize = 2_048;
/// Simulated seconds of arrivals.
const DURATION_S: f64 = 60.0;
/// Routed requests per simulated second (all replicas).
const ROUTED_RATE: f64 = 24.0;
/// Bypass requests per simulated second (all replicas).
const BYPASS_RATE: f64 = 2.0;

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
    inflight_tokens: Vec<AtomicU64>,
}

impl Router {
    /// Minimum (in-flight prompt tokens + uncached prompt tokens); ties to the lower index.
    fn pick(&self, hashes: &[u64], prompt_tokens: u64) -> (usize, u32) {
        let matches = self.index.lookup(hashes, &self.ids);
        let cost = |i: usize| {
            let uncached = prompt_tokens.saturating_sub(u64::from(matches[i].blocks) * 16);
            self.inflight_tokens[i].load(Ordering::Relaxed) + uncached
        };
        let best = (0..self.ids.len()).min_by_key(|&i| cost(i)).unwrap();
        (best, matches[best].confirmed_blocks)
    }

    fn record(&self, i: usize, hashes: &[u64], confirmed: u32) {
        match &self.events {
            Some(events) => events
                .record_routed(self.ids[i], hashes, confirmed)
                .unwrap(),
            None => self.index.insert_predicted(self.ids[i], hashes).unwrap(),
        }
    }
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(1_000..30_000)).collect()
}

async fn fleet(mode: Mode) -> (Vec<Sim>, Router) {
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
            endpoint: "tcp://*:0".into(),
            topic: String::new(),
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
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::from(&config.cache_index),
        Arc::clone(&clock),
    ));
    let interner = Arc::new(EndpointInterner::new());
    let ids: Vec<EndpointId> = addresses.iter().map(|a| interner.intern(*a)).collect();
    if mode == Mode::Predictions {
        for ep in &mut config.pools[0].endpoints {
            ep.kv_events = None;
        }
    }
    let events = match mode {
        Mode::Predictions => None,
        Mode::Precise => Some(
            KvEvents::start(
                &config,
                &kvrouter::prefix::TokenizerRegistry::empty(),
                Arc::clone(&index),
                interner,
                clock,
            )
            .await
            .unwrap(),
        ),
    };
    if let Some(events) = &events {
        // Drop the (empty) caches until a clear gets through each subscription.
        for (i, sim) in sims.iter().enumerate() {
            let start = Instant::now();
            while events.source_state(ids[i]) != SourceState::Trusted {
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "no events from r{i}"
                );
                sim.replica.admin(AdminCommand::DropCache).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let router = Router {
        index,
        events,
        inflight_tokens: (0..REPLICAS).map(|_| AtomicU64::new(0)).collect(),
        ids,
    };
    (sims, router)
}

#[derive(Default)]
struct Outcome {
    ttft_ms: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

async fn run(mode: Mode) -> Outcome {
    let (sims, router) = fleet(mode).await;
    let sims = Arc::new(sims);
    let router = Arc::new(router);
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
        let next_routed = t_routed - (1.0 - rng.random::<f64>()).ln() / ROUTED_RATE;
        let next_bypass = t_bypass - (1.0 - rng.random::<f64>()).ln() / BYPASS_RATE;
        let routed = next_routed <= next_bypass;
        let at = if routed { next_routed } else { next_bypass };
        if at > DURATION_S {
            break;
        }
        if routed {
            t_routed = next_routed;
        } else {
            t_bypass = next_bypass;
        }
        n += 1;
        let when = start + Duration::from_secs_f64(at / TIME_SCALE);
        let (sims, router, prefixes) = (
            Arc::clone(&sims),
            Arc::clone(&router),
            Arc::clone(&prefixes),
        );
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
                let (i, confirmed) = router.pick(&hashes, len);
                router.record(i, &hashes, confirmed);
                router.inflight_tokens[i].fetch_add(len, Ordering::Relaxed);
                let body = sim_support::tokens_body(&prompt, 16);
                let s = sim_support::stream(&sims[i].app, "/v1/completions", body).await;
                router.inflight_tokens[i].fetch_sub(len, Ordering::Relaxed);
                Some((
                    s.ttft.as_secs_f64() * 1e3 * TIME_SCALE,
                    len,
                    s.cached_tokens(),
                ))
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
    if let Some(events) = &router.events {
        for s in events.status() {
            eprintln!("  {:?}: {:?} {:?}", s.address, s.state, s.counters);
        }
    }
    out
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
    println!(
        "{:<12} {:>8} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "mode", "requests", "ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "hit_rate"
    );
    for mode in [Mode::Predictions, Mode::Precise] {
        let mut o = rt.block_on(run(mode));
        o.ttft_ms.sort_by(f64::total_cmp);
        let mean = o.ttft_ms.iter().sum::<f64>() / o.ttft_ms.len() as f64;
        println!(
            "{:<12} {:>8} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.1}%",
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
