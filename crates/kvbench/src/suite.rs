//! Runs a plan: for every workload (and every rate of a sweep) one trace, and on it every
//! policy, each on a fresh fleet (cold caches), a fresh kvrouter and a fresh Envoy. A run whose
//! router config kvrouter rejects (e.g. an unknown policy name) is recorded as failed and the
//! bench goes on. Results are written after every run, so an interrupted bench keeps what it had.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokio::sync::watch;

use super::client::SimClock;
use super::divergence::{self, Decision};
use super::oracle::{self, EngineView, LowerBound};
use super::plan::{Action, Plan, PolicyOrder, PolicySpec, ReplicaGroup, RouterLb, WorkloadSpec};
use super::report::{Report, SharingCheck};
use super::results::{BoundRatio, CpuUse, RunResult};
use super::routercfg::{self, EndpointInfo, RouterInputs};
use super::runner::{self, RunOptions};
use super::scenario::{self, Fleet};
use super::scrape::{self, Histogram};
use super::stats;
use super::vocab::{self, Vocab};
use super::workload::{self, Trace};
use super::BenchError;
use kvsim::profile::StepProfile;
use kvsim::{PromptTokenizer, TokenizerPaths, WordPieceTokenizer};
use testkit::{Binaries, Envoy, Replica, ReplicaSpec, Router};

/// How to run a plan.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// The binaries.
    pub binaries: Binaries,
    /// Where tokenizer directories are (`qwen3/`, ...).
    pub tokenizers_dir: PathBuf,
    /// Output directory (results, logs, report).
    pub out_dir: PathBuf,
    /// Progress bars on stderr.
    pub progress: bool,
    /// Only these workloads (empty: all).
    pub workloads: Vec<String>,
    /// Only these policy labels (empty: all).
    pub policies: Vec<String>,
}

/// The engine tokenizer the bench assumes the replicas use, for the lower bound and the
/// cross-tenant check: the same tokenizer files as the replicas when `replica_tokenizer` is
/// set (so the bench's block hashes are the engines'), else kvsim's word-piece fallback. Each
/// run's `token_mismatches` shows any disagreement with what the replicas report.
pub fn engine_tokenizer(
    replica_tokenizer: Option<&Path>,
) -> Result<Arc<dyn PromptTokenizer>, BenchError> {
    match replica_tokenizer {
        Some(dir) => {
            let t = kvsim::hf_tokenizer::HfTokenizer::load(&replica_tokenizer_paths(dir))
                .map_err(|e| BenchError::Config(e.to_string()))?;
            Ok(Arc::new(t))
        }
        None => Ok(Arc::new(WordPieceTokenizer::default())),
    }
}

/// The tokenizer files of a replica given the tokenizer directory `dir`.
fn replica_tokenizer_paths(dir: &Path) -> TokenizerPaths {
    TokenizerPaths {
        tokenizer_json: dir.join("tokenizer.json"),
        tokenizer_config: Some(dir.join("tokenizer_config.json")).filter(|p| p.is_file()),
        chat_template: Some(dir.join("chat_template.jinja")).filter(|p| p.is_file()),
    }
}

/// Runs `plan`, writing `results.json` after every run; returns the report.
///
/// Seed-major: for every workload and rate, each seed is its own trace, and on it every policy
/// runs once, in an order shuffled per seed (unless the plan fixes it), so a slow drift of the
/// machine falls on every policy alike.
pub async fn run_plan(plan: &Plan, o: &SuiteOptions) -> Result<Report, BenchError> {
    std::fs::create_dir_all(&o.out_dir).map_err(|e| BenchError::Io(e.to_string()))?;
    let tok_dir = vocab::resolve(&plan.tokenizer, &o.tokenizers_dir)?;
    let vocab = Vocab::load(&tok_dir)?;
    let engine = engine_tokenizer(plan.replica_tokenizer.then_some(tok_dir.as_path()))?;
    let mut report = Report::new(plan.clone());
    let policies: Vec<&PolicySpec> = plan
        .policies
        .iter()
        .filter(|p| o.policies.is_empty() || o.policies.iter().any(|l| l == p.label()))
        .collect();
    for w in plan
        .workloads
        .iter()
        .filter(|w| o.workloads.is_empty() || o.workloads.contains(&w.name))
    {
        for rate in w.run_rates() {
            for seed in plan.seed_list() {
                let generating = Instant::now();
                let trace = workload::generate(plan, w, rate, seed, &vocab, engine.as_ref())?;
                let trace = Arc::new(trace);
                let texts_s = generating.elapsed().as_secs_f64();
                let fleet = plan.fleet_of(w);
                let block_size = fleet.first().map_or(16, |g| g.block_size);
                let views = oracle::engine_views(&trace, engine.as_ref(), &plan.model, block_size)?;
                eprintln!(
                    "kvbench: trace {} @ {} req/s seed {seed}: {} requests in {:.1} s ({texts_s:.1} s \
                     text, the rest the engine's tokens)",
                    w.name,
                    trace.rate,
                    trace.requests.len(),
                    generating.elapsed().as_secs_f64()
                );
                let (profile, chunk) = fastest(fleet);
                let bound = oracle::lower_bound(
                    &trace,
                    &views,
                    block_size,
                    &profile,
                    chunk,
                    fleet_speed(fleet, &profile, chunk),
                );
                let sharing = trace
                    .expected_shared_tokens
                    .as_ref()
                    .map(|expected| sharing_check(expected, &views, block_size));
                report.add_workload(w, seed, &trace, &bound, sharing);
                let mut order = policies.clone();
                if plan.policy_order == PolicyOrder::Shuffled {
                    let key = seed ^ workload::name_seed(&w.name) ^ rate.to_bits();
                    order.shuffle(&mut StdRng::seed_from_u64(key));
                }
                for (position, policy) in order.iter().enumerate() {
                    let label = format!(
                        "{} @ {} req/s / {} / seed {seed}",
                        w.name,
                        trace.rate,
                        policy.label()
                    );
                    eprintln!("kvbench: {label}");
                    let started = Instant::now();
                    let mut result = run_one(
                        plan, w, policy, &trace, &views, &bound, &tok_dir, o, block_size,
                    )
                    .await;
                    result.order = position;
                    eprintln!(
                        "kvbench:   {} in {:.1} s",
                        match (&result.failed, &result.stats) {
                            (Some(f), _) => format!("FAILED: {}", f.lines().next().unwrap_or("")),
                            (None, Some(s)) => format!(
                                "{} ok, {} errors, TTFT p50 {:.0} ms p90 {:.0} ms, hit rate {:.2}",
                                s.ok,
                                s.errors,
                                s.ttft_ms.p50.unwrap_or(f64::NAN),
                                s.ttft_ms.p90.unwrap_or(f64::NAN),
                                s.kv_hit_rate.unwrap_or(0.0)
                            ),
                            _ => String::new(),
                        },
                        started.elapsed().as_secs_f64()
                    );
                    report.runs.push(result);
                    report.write_results(&o.out_dir)?;
                }
            }
        }
    }
    Ok(report)
}

/// How the engine's block sharing compares with what a replayed trace says: the trace's own
/// shared tokens per request against the engine's (prompt blocks seen before, in order).
fn sharing_check(expected: &[usize], views: &[EngineView], block_size: u32) -> SharingCheck {
    let engine = oracle::engine_shared_tokens(views, block_size);
    let prompt: usize = views.iter().map(|v| v.prompt_tokens).sum();
    // The chat template shifts block boundaries: agreement within two engine blocks.
    let slack = 2 * block_size as usize;
    let agree = expected
        .iter()
        .zip(&engine)
        .filter(|(t, e)| t.abs_diff(**e) <= slack)
        .count();
    SharingCheck {
        requests: expected.len(),
        agree,
        trace_shared_tokens: expected.iter().sum(),
        engine_shared_tokens: engine.iter().sum(),
        prompt_tokens: prompt,
    }
}

/// Replicas of `fleet` in units of `fastest`'s prefill speed (1000 cold tokens).
fn fleet_speed(fleet: &[ReplicaGroup], fastest: &StepProfile, chunk: u32) -> f64 {
    let t_fast = fastest.prefill_ms(0, 1000, chunk);
    fleet
        .iter()
        .filter_map(|g| {
            let p = StepProfile::builtin(&g.profile)?;
            let c = g.max_num_batched_tokens.unwrap_or(p.max_num_batched_tokens);
            Some(g.count as f64 * t_fast / p.prefill_ms(0, 1000, c))
        })
        .sum()
}

/// The fleet's fastest profile (by cold prefill of 1000 tokens) and its prefill chunk.
fn fastest(fleet: &[ReplicaGroup]) -> (StepProfile, u32) {
    fleet
        .iter()
        .filter_map(|g| {
            let p = StepProfile::builtin(&g.profile)?;
            Some((
                p,
                g.max_num_batched_tokens.unwrap_or(p.max_num_batched_tokens),
            ))
        })
        .min_by(|a, b| {
            a.0.prefill_ms(0, 1000, a.1)
                .total_cmp(&b.0.prefill_ms(0, 1000, b.1))
        })
        .unwrap_or_else(|| {
            let p = StepProfile::builtin(kvsim::profile::DEFAULT_PROFILE).expect("default profile");
            (p, p.max_num_batched_tokens)
        })
}

/// The kvsim flags of one replica of `group` (its tokenizer: a directory as in
/// [`replica_tokenizer_paths`]).
fn replica_spec(
    plan: &Plan,
    tokenizer: Option<&Path>,
    time_scale: f64,
    group: &ReplicaGroup,
    name: String,
    kv_events: bool,
) -> ReplicaSpec {
    let mut spec = ReplicaSpec {
        models: vec![plan.model.clone()],
        kv_events,
        log_filter: Some("warn".into()),
        ..ReplicaSpec::new(name)
    }
    .flag("profile", &group.profile)
    .flag("block-size", group.block_size)
    .flag("time-scale", time_scale);
    for (flag, value) in [
        ("num-gpu-blocks", group.num_gpu_blocks),
        ("max-num-seqs", group.max_num_seqs),
        ("max-num-batched-tokens", group.max_num_batched_tokens),
    ] {
        if let Some(v) = value {
            spec = spec.flag(flag, v);
        }
    }
    if let Some(blocks) = group.cpu_offload_blocks {
        spec = spec.flag("cpu-offload-blocks", blocks);
        if let Some(bw) = group.cpu_offload_gb_per_s {
            spec = spec.flag("cpu-offload-gb-per-s", bw);
        }
    }
    if let Some(dir) = tokenizer {
        spec = spec.flag("tokenizer", dir.display());
    }
    spec
}

fn failed(w: &WorkloadSpec, rate: f64, p: &PolicySpec, why: String) -> RunResult {
    RunResult {
        failed: Some(why),
        ..RunResult::unmeasured(&w.name, w.shape.kind(), rate, p.label(), &p.policy)
    }
}

fn safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    plan: &Plan,
    w: &WorkloadSpec,
    p: &PolicySpec,
    trace: &Arc<Trace>,
    views: &[EngineView],
    bound: &LowerBound,
    tok_dir: &Path,
    o: &SuiteOptions,
    block_size: u32,
) -> RunResult {
    let rate = trace.rate;
    let dir = o.out_dir.join("runs").join(safe(&format!(
        "{}-{rate}-{}-s{}",
        w.name,
        p.label(),
        trace.seed
    )));
    let _ = std::fs::remove_dir_all(&dir);
    let mut result = match std::fs::create_dir_all(&dir) {
        Err(e) => failed(w, rate, p, e.to_string()),
        Ok(()) => match run_stack(
            plan, w, p, trace, views, bound, tok_dir, o, block_size, &dir,
        )
        .await
        {
            Ok(r) => r,
            Err(e) => failed(w, rate, p, e.to_string()),
        },
    };
    result.seed = trace.seed;
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_stack(
    plan: &Plan,
    w: &WorkloadSpec,
    p: &PolicySpec,
    trace: &Arc<Trace>,
    views: &[EngineView],
    bound: &LowerBound,
    tok_dir: &Path,
    o: &SuiteOptions,
    block_size: u32,
    dir: &Path,
) -> Result<RunResult, BenchError> {
    let n_routers = p.routers(plan).max(1);
    // Several routers: each keeps its decisions so the bench can tell how often a peer's
    // would have changed one.
    let record_decisions = (n_routers > 1).then(|| trace.requests.len() + 64);
    // Decision sharing: a fresh Redis per run (empty, like the fleet's caches), named in the
    // policy's router config; it lives as long as the run's stack.
    let redis = if p.sharing {
        Some(testkit::Redis::start(dir)?)
    } else {
        None
    };
    let mut p_shared = p.clone();
    if let Some(redis) = &redis {
        let mut yaml = p_shared
            .router_yaml
            .take()
            .unwrap_or_else(|| serde_norway::Value::Mapping(Default::default()));
        let over: serde_norway::Value =
            serde_norway::from_str(&format!("{{sharing: {{redis: \"{}\"}}}}", redis.url()))
                .map_err(|e| BenchError::Io(e.to_string()))?;
        routercfg::merge(&mut yaml, over);
        p_shared.router_yaml = Some(yaml);
    }
    let p = &p_shared;
    let bins = &o.binaries;
    let kvrouter_bin = p.router_bin.as_deref().unwrap_or(&bins.kvrouter);
    let eds = dir.join("eds.json");
    let tenant_header = trace.tenant_header.clone();
    // The unsalted multi-tenant control sends no cache_salt and must see engines share: the
    // router then leaves bodies as sent.
    let inject_cache_salt = trace.requests.iter().any(|r| r.cache_salt.is_some());
    let model = plan.model.clone();
    let tokenizer = plan.router_tokenizer.then(|| tok_dir.to_path_buf());
    let policy = p.clone();
    let scale = plan.time_scale_of(w);
    let router_scale = if plan.scale_router_time { scale } else { 1.0 };
    // Every router gets the same config (they all write the same EDS file, atomically).
    let render_scaled = move |eps: &[EndpointInfo]| {
        routercfg::render_scaled(
            &policy,
            &RouterInputs {
                model: &model,
                tokenizer: tokenizer.as_deref(),
                tenant_header: tenant_header.as_deref(),
                inject_cache_salt,
                eds_path: &eds,
                endpoints: eps,
                time_scale: router_scale,
                record_decisions,
            },
        )
    };
    let render_scaled = Arc::new(render_scaled);
    let render_router = {
        let r = Arc::clone(&render_scaled);
        move |eps: &[EndpointInfo]| r(eps).0
    };
    // The policy first: a config kvrouter rejects fails this run before anything starts.
    let probe: Vec<EndpointInfo> = (0..plan.fleet_of(w).iter().map(|g| g.count).sum::<usize>())
        .map(|i| EndpointInfo {
            name: format!("r{i}"),
            address: SocketAddr::from(([127, 0, 0, 1], 1 + i as u16)),
            kv_events: p.kv_events.then(|| format!("tcp://127.0.0.1:{}", 2 + i)),
        })
        .collect();
    let config_path = |i: usize| {
        if i == 0 {
            dir.join("kvrouter.yaml")
        } else {
            dir.join(format!("kvrouter-{i}.yaml"))
        }
    };
    std::fs::write(config_path(0), render_router(&probe))
        .map_err(|e| BenchError::Io(e.to_string()))?;
    testkit::check_config(kvrouter_bin, &config_path(0))?;

    let kv_events = p.kv_events;
    let plan_c = plan.clone();
    let replica_tok = plan.replica_tokenizer.then(|| tok_dir.to_path_buf());
    let make_spec = move |g: &ReplicaGroup, name: String| {
        replica_spec(&plan_c, replica_tok.as_deref(), scale, g, name, kv_events)
    };
    let mut replicas = Vec::new();
    let mut i = 0;
    for g in plan.fleet_of(w) {
        for _ in 0..g.count {
            replicas.push(Replica::start(
                &bins.kvsim,
                dir,
                make_spec(g, format!("r{i}")),
            )?);
            i += 1;
        }
    }
    let fleet = Fleet {
        kvsim: bins.kvsim.clone(),
        dir: dir.to_path_buf(),
        make_spec: Box::new(make_spec),
        render_router: Box::new(render_router),
        default_group: plan.fleet_of(w).first().cloned().unwrap_or_default(),
        replicas,
    };
    let (first_yaml, router_time) = render_scaled(&fleet.endpoints());
    let mut routers = Vec::with_capacity(n_routers);
    for i in 0..n_routers {
        let path = config_path(i);
        std::fs::write(&path, &first_yaml).map_err(|e| BenchError::Io(e.to_string()))?;
        let name_dir = if i == 0 {
            dir.to_path_buf()
        } else {
            let d = dir.join(format!("router-{i}"));
            std::fs::create_dir_all(&d).map_err(|e| BenchError::Io(e.to_string()))?;
            d
        };
        routers.push(Router::start(kvrouter_bin, &name_dir, &path, "warn")?);
    }
    for r in &routers {
        r.wait_ready().await?;
    }
    let routers = Arc::new(routers);
    let defaults = kvrouter::envoyconf::EnvoyOptions::default();
    let mut envoy_yaml = kvrouter::envoyconf::render(&kvrouter::envoyconf::EnvoyOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        extproc: routers[0].grpc.into(),
        replicas: kvrouter::envoyconf::Replicas::EdsFile(dir.join("eds.json")),
        // A request may wait in the router's queue: Envoy must not give up on it first (it
        // would then route it around the queue, uncounted).
        message_timeout_ms: queue_wait_ms(&first_yaml).map_or(
            defaults.message_timeout_ms,
            kvrouter::envoyconf::message_timeout_for_wait,
        ),
        ..defaults
    });
    if routers.len() > 1 {
        let addrs: Vec<SocketAddr> = routers.iter().map(|r| r.grpc).collect();
        let lb = match plan.router_lb {
            RouterLb::RoundRobin => "ROUND_ROBIN",
            RouterLb::LeastRequest => "LEAST_REQUEST",
        };
        envoy_yaml = testkit::with_routers(&envoy_yaml, &addrs, lb)?;
    }
    let envoy = Envoy::start(&bins.envoy, dir, &envoy_yaml).await?;
    let addrs: Vec<SocketAddr> = fleet.replicas.iter().map(|r| r.addr).collect();
    envoy.wait_for_hosts(&addrs).await?;
    let targets: scrape::Targets = Arc::new(RwLock::new(
        fleet
            .replicas
            .iter()
            .map(|r| (r.name.clone(), r.addr))
            .collect(),
    ));
    let fleet = Arc::new(Mutex::new(fleet));

    // The load phase.
    let cpu_at = |fleet: &Fleet| {
        (
            testkit::own_cpu_s(),
            fleet.replicas.iter().map(Replica::cpu_s).sum::<f64>(),
            routers.iter().map(|r| r.proc.cpu_s()).sum::<f64>(),
            envoy.proc.cpu_s(),
        )
    };
    let before = cpu_at(&fleet.lock());
    let clock = SimClock {
        t0: Instant::now() + Duration::from_millis(100),
        scale,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let scraper = tokio::spawn(scrape::scrape_replicas(
        Arc::clone(&targets),
        clock,
        Duration::from_millis(plan.scrape_interval_ms),
        stop_rx,
    ));
    let events = tokio::spawn(scenario::run_events(
        w.events.clone(),
        Arc::clone(&fleet),
        Arc::clone(&routers),
        Arc::clone(&targets),
        clock,
    ));
    let request_id_prefix = format!("kvb-{}-", trace.seed);
    let options = RunOptions {
        base_url: format!("http://{}", envoy.addr),
        model: plan.model.clone(),
        max_concurrency: plan.max_concurrency,
        drain_timeout: Duration::from_secs(plan.drain_timeout_s),
        progress: o.progress,
        label: format!("{}/{}", w.name, p.label()),
        direct_urls: addrs.iter().map(|a| format!("http://{a}")).collect(),
        request_id_prefix: Some(request_id_prefix.clone()),
    };
    let records = runner::run(Arc::clone(trace), clock, &options).await;
    // The load phase ends when the trace is done AND every scenario event has been executed.
    // On a busy machine the trace can be done before a late event finishes (a restart waits
    // for the new process to come up); aborting the event task then lost its records, those
    // of the events already done included. Each event is bounded (process start-up and admin
    // calls have deadlines), so this wait is too.
    let events = events
        .await
        .map_err(|e| BenchError::Process(format!("scenario events: {e}")))?;
    let wall_s = clock.t0.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let samples = scraper.await.unwrap_or_default();
    let after = cpu_at(&fleet.lock());
    let mut decision = Histogram::default();
    let mut flow_wait = Histogram::default();
    let mut decisions: Vec<Decision> = Vec::new();
    let mut unmatched = 0;
    for (i, r) in routers.iter().enumerate() {
        let h = scrape::fetch_histogram(
            &format!("http://{}/metrics", r.admin),
            "kvrouter_decision_duration_seconds",
        )
        .await;
        decision = merge_histograms(decision, h);
        let h = scrape::fetch_histogram(
            &format!("http://{}/metrics", r.admin),
            "kvrouter_flow_wait_seconds",
        )
        .await;
        flow_wait = merge_histograms(flow_wait, h);
        let name = if i == 0 {
            "router".to_string()
        } else {
            format!("router-{i}")
        };
        for (rid, e) in scrape::save_router_debug(r.admin, dir, &name).await {
            match divergence::parse(i, &rid, &request_id_prefix, &e) {
                Some(d) => decisions.push(d),
                None => unmatched += 1,
            }
        }
    }
    drop(envoy);
    drop(fleet);

    let fleet_size = plan.fleet_of(w).iter().map(|g| g.count).sum::<usize>()
        + w.events.iter().filter(|e| e.action == Action::Add).count();
    let stats = stats::run_stats(
        &records,
        &samples,
        plan.slo_ttft_ms,
        scale,
        w.warmup_s * 1000.0,
        fleet_size,
    );
    let ttft_ok: Vec<f64> = records
        .iter()
        .filter(|r| r.ok() && r.scheduled_ms >= w.warmup_s * 1000.0)
        .filter_map(|r| r.ttft_ms())
        .collect();
    let bound_ratio = {
        let m = stats::mean(&bound.ttft_ms).unwrap_or(0.0);
        let p90 = stats::percentile(&bound.ttft_ms, 0.9).unwrap_or(0.0);
        let mean = stats::mean(&ttft_ok);
        BoundRatio {
            bound_mean_ms: m,
            bound_p90_ms: p90,
            mean_ratio: mean.filter(|_| m > 0.0).map(|v| v / m),
            p90_ratio: stats::percentile(&ttft_ok, 0.9)
                .filter(|_| p90 > 0.0)
                .map(|v| v / p90),
            fluid_mean_ms: bound.fluid_mean_ms,
            fluid_ratio: mean
                .filter(|_| bound.fluid_mean_ms > 0.0)
                .map(|v| v / bound.fluid_mean_ms),
            prefill_utilisation: bound.prefill_utilisation,
        }
    };
    let cross_tenant = trace
        .tenant_header
        .is_some()
        .then(|| oracle::cross_tenant_hits(&records, views, block_size));
    let token_mismatches = records
        .iter()
        .filter(|r| {
            r.prompt_tokens
                .is_some_and(|n| views.get(r.id).is_some_and(|v| v.prompt_tokens as u64 != n))
        })
        .count();
    let divergence = (routers.len() > 1).then(|| {
        let window_ms = kvrouter::config::Config::default()
            .cache_index
            .prediction_ttl_ms as f64;
        divergence::measure(
            routers.len(),
            &decisions,
            unmatched,
            &records,
            views,
            block_size,
            window_ms,
        )
    });
    Ok(RunResult {
        workload: w.name.clone(),
        kind: w.shape.kind().into(),
        rate: trace.rate,
        label: p.label().into(),
        policy: p.policy.clone(),
        seed: trace.seed,
        order: 0,
        failed: None,
        stats: Some(stats),
        bound: Some(bound_ratio),
        cross_tenant,
        decision,
        flow_wait,
        cpu: CpuUse {
            wall_s,
            bench_s: after.0 - before.0,
            replicas_s: after.1 - before.1,
            router_s: after.2 - before.2,
            envoy_s: after.3 - before.3,
        },
        events,
        token_mismatches,
        router_time,
        divergence,
        records,
        samples,
    })
}

/// The longest a request may wait in the queue of the router config `yaml` (real ms, as
/// written), when its flow control is on.
fn queue_wait_ms(yaml: &str) -> Option<u64> {
    let v: serde_norway::Value = serde_norway::from_str(yaml).ok()?;
    let flow = v.get("flow_control")?;
    if flow.get("enabled").and_then(serde_norway::Value::as_bool) != Some(true) {
        return None;
    }
    Some(
        flow.get("max_wait_ms")
            .and_then(serde_norway::Value::as_u64)
            .unwrap_or(kvrouter::config::FlowControlConfig::default().max_wait_ms),
    )
}

/// The sum of two histograms with the same buckets (one of them may be empty).
fn merge_histograms(a: Histogram, b: Histogram) -> Histogram {
    if a.buckets.is_empty() {
        return b;
    }
    if b.buckets.is_empty() || a.buckets.len() != b.buckets.len() {
        return a;
    }
    Histogram {
        buckets: a
            .buckets
            .iter()
            .zip(&b.buckets)
            .map(|(x, y)| (x.0, x.1 + y.1))
            .collect(),
        sum: a.sum + b.sum,
        count: a.count + b.count,
    }
}
