//! Router overhead: the same light closed-loop workload (short chat prompts, one output token,
//! streamed) against one fast replica (a) directly, (b) through Envoy without the ext_proc
//! filter, (c) through Envoy + kvrouter. All times here are **real** milliseconds (the replica
//! runs at a large time scale so it adds almost nothing), and kvrouter's own decision-time
//! histogram is read from its `/metrics`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::client;
use super::plan::{OverheadSpec, PolicySpec};
use super::routercfg::{self, EndpointInfo, RouterInputs};
use super::scrape::{self, Histogram};
use super::stats::Latency;
use super::BenchError;
use testkit::{Binaries, Envoy, Replica, ReplicaSpec, Router};

/// One path's latencies, real ms.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PathResult {
    /// `direct`, `envoy`, `envoy+kvrouter`.
    pub path: String,
    /// End-to-end latency (one output token).
    pub latency_ms: Latency,
    /// Failed requests.
    pub errors: usize,
    /// Requests per real second.
    pub throughput_rps: f64,
}

/// The overhead measurement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverheadResult {
    /// What was run.
    pub spec: OverheadSpec,
    /// Per path.
    pub paths: Vec<PathResult>,
    /// p50 added by Envoy over direct, real ms.
    pub envoy_added_p50_ms: Option<f64>,
    /// p99 added by Envoy over direct.
    pub envoy_added_p99_ms: Option<f64>,
    /// p50 added by kvrouter over Envoy alone.
    pub router_added_p50_ms: Option<f64>,
    /// p99 added by kvrouter over Envoy alone.
    pub router_added_p99_ms: Option<f64>,
    /// kvrouter's decision time during (c), seconds.
    pub decision: Histogram,
    /// kvrouter's CPU seconds per 1000 requests during (c).
    pub router_cpu_s_per_1k: f64,
}

const WARMUP: usize = 100;

/// Runs the measurement with its processes in `dir`.
pub async fn measure(
    spec: &OverheadSpec,
    bins: &Binaries,
    dir: &Path,
    model: &str,
) -> Result<OverheadResult, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Io(e.to_string()))?;
    let replica = Replica::start(
        &bins.kvsim,
        dir,
        ReplicaSpec {
            models: vec![model.into()],
            log_filter: Some("warn".into()),
            ..ReplicaSpec::new("r0")
        }
        .flag("time-scale", spec.time_scale),
    )?;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": model, "max_tokens": 1, "stream": true,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant that answers briefly."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}
        ]
    }))
    .map_err(|e| BenchError::Io(e.to_string()))?;
    let body = Arc::new(body);
    let mut paths = Vec::new();
    paths.push(drive("direct", replica.addr, spec, &body).await);

    let alone = kvrouter::envoyconf::render(&kvrouter::envoyconf::EnvoyOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        replicas: kvrouter::envoyconf::Replicas::Static(vec![replica.addr]),
        attach: false,
        ..kvrouter::envoyconf::EnvoyOptions::default()
    });
    {
        let envoy = Envoy::start(&bins.envoy, dir, &alone).await?;
        envoy.wait_for_hosts(&[replica.addr]).await?;
        paths.push(drive("envoy", envoy.addr, spec, &body).await);
    }

    let config = dir.join("kvrouter.yaml");
    let eds = dir.join("eds.json");
    let yaml = routercfg::render(
        &PolicySpec {
            policy: spec.policy.clone(),
            ..PolicySpec::default()
        },
        &RouterInputs {
            model,
            tokenizer: None,
            tenant_header: None,
            inject_cache_salt: true,
            eds_path: &eds,
            endpoints: &[EndpointInfo {
                name: "r0".into(),
                address: replica.addr,
                kv_events: None,
            }],
            // Real time on both sides: this measures the mechanics, not a simulated fleet.
            time_scale: 1.0,
            record_decisions: None,
        },
    );
    std::fs::write(&config, yaml).map_err(|e| BenchError::Io(e.to_string()))?;
    testkit::check_config(&bins.kvrouter, &config)?;
    let router = Router::start(&bins.kvrouter, dir, &config, "warn")?;
    router.wait_ready().await?;
    let with = kvrouter::envoyconf::render(&kvrouter::envoyconf::EnvoyOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        extproc: router.grpc.into(),
        replicas: kvrouter::envoyconf::Replicas::EdsFile(eds),
        ..kvrouter::envoyconf::EnvoyOptions::default()
    });
    let envoy = Envoy::start(&bins.envoy, dir, &with).await?;
    envoy.wait_for_hosts(&[replica.addr]).await?;
    let metrics = format!("http://{}/metrics", router.admin);
    let name = "kvrouter_decision_duration_seconds";
    let cpu0 = router.proc.cpu_s();
    let before = scrape::fetch_histogram(&metrics, name).await;
    let result = drive("envoy+kvrouter", envoy.addr, spec, &body).await;
    let after = scrape::fetch_histogram(&metrics, name).await;
    let cpu = router.proc.cpu_s() - cpu0;
    paths.push(result);

    // The measured phase's decisions (its warm-up included).
    let decision = after.since(&before);
    let p = |i: usize, f: fn(&Latency) -> Option<f64>| f(&paths[i].latency_ms);
    let diff = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
    Ok(OverheadResult {
        spec: spec.clone(),
        envoy_added_p50_ms: diff(p(1, |l| l.p50), p(0, |l| l.p50)),
        envoy_added_p99_ms: diff(p(1, |l| l.p99), p(0, |l| l.p99)),
        router_added_p50_ms: diff(p(2, |l| l.p50), p(1, |l| l.p50)),
        router_added_p99_ms: diff(p(2, |l| l.p99), p(1, |l| l.p99)),
        router_cpu_s_per_1k: cpu / (spec.requests + WARMUP).max(1) as f64 * 1000.0,
        decision,
        paths,
    })
}

/// `spec.concurrency` closed-loop clients send `spec.requests` requests (after a warm-up).
async fn drive(
    path: &str,
    addr: SocketAddr,
    spec: &OverheadSpec,
    body: &Arc<Vec<u8>>,
) -> PathResult {
    let url = format!("http://{addr}/v1/chat/completions");
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap_or_default();
    for _ in 0..WARMUP {
        let _ = client::send(&client, &url, &[], body.to_vec()).await;
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..spec.concurrency.max(1)).map(|_| {
        let (client, url, body, next) = (
            client.clone(),
            url.clone(),
            Arc::clone(body),
            Arc::clone(&next),
        );
        let total = spec.requests;
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                let t = Instant::now();
                let o = client::send(&client, &url, &[], body.to_vec()).await;
                if o.status == 200 && o.error.is_none() {
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        })
    });
    let mut all = Vec::new();
    let mut errors = 0;
    for r in futures::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
    {
        all.extend(r.0);
        errors += r.1;
    }
    let secs = started.elapsed().as_secs_f64();
    PathResult {
        path: path.into(),
        latency_ms: Latency::of(&all),
        errors,
        throughput_rps: spec.requests as f64 / secs.max(1e-9),
    }
}
