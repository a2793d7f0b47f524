//! Ground truth from the replicas while a run goes: their vLLM `/metrics` (running and waiting
//! requests, KV usage, preemptions, prefix-cache queries and hits) sampled every
//! `scrape_interval_ms`, and the router's decision-time histogram at the end. Expositions are
//! parsed by the workspace's one reader of them, `testkit::Metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::client::SimClock;
pub use testkit::Histogram;
use testkit::Metrics;

/// One replica's metrics at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaSample {
    /// Simulated ms since the run's start.
    pub t_ms: f64,
    /// Replica name.
    pub replica: String,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting` (the queue).
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc`, 0..1.
    pub kv_usage: f64,
    /// `vllm:num_preemptions_total`, summed over restarts of the replica.
    pub preemptions: f64,
    /// `vllm:prefix_cache_queries_total`, summed over restarts.
    pub prefix_queries: f64,
    /// `vllm:prefix_cache_hits_total`, summed over restarts.
    pub prefix_hits: f64,
}

/// The replicas to scrape (changes when one is added mid-run).
pub type Targets = Arc<RwLock<Vec<(String, SocketAddr)>>>;

/// Samples `targets` every `interval` until `stop` turns true; returns every sample.
pub async fn scrape_replicas(
    targets: Targets,
    clock: SimClock,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> Vec<ReplicaSample> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    let mut samples = Vec::new();
    // Per replica: last raw value and offset of each counter, to sum across restarts.
    let mut counters: std::collections::HashMap<(String, usize), (f64, f64)> = Default::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let list = targets.read().clone();
        // A replica that is down (killed by a scenario) or answers garbage gives no sample.
        let fetches = list.iter().map(|(name, addr)| {
            let client = client.clone();
            async move {
                let url = format!("http://{addr}/metrics");
                let m = Metrics::fetch(&client, &url).await.ok()?;
                Some((name.clone(), m))
            }
        });
        let t_ms = clock.now_ms();
        for (name, m) in futures::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
        {
            let get = |k: &str| m.sum(k);
            let mut monotonic = |i: usize, raw: f64| {
                let entry = counters.entry((name.clone(), i)).or_insert((0.0, 0.0));
                if raw < entry.0 {
                    entry.1 += entry.0;
                }
                entry.0 = raw;
                raw + entry.1
            };
            samples.push(ReplicaSample {
                t_ms,
                running: get("vllm:num_requests_running"),
                waiting: get("vllm:num_requests_waiting"),
                kv_usage: get("vllm:kv_cache_usage_perc"),
                preemptions: monotonic(0, get("vllm:num_preemptions_total")),
                prefix_queries: monotonic(1, get("vllm:prefix_cache_queries_total")),
                prefix_hits: monotonic(2, get("vllm:prefix_cache_hits_total")),
                replica: name,
            });
        }
    }
    samples
}

/// Fetches `url` and reads histogram `name` from it (empty on failure: the report then shows
/// no decision times rather than losing the run).
pub async fn fetch_histogram(url: &str, name: &str) -> Histogram {
    Metrics::fetch(&reqwest::Client::new(), url)
        .await
        .map(|m| m.histogram(name))
        .unwrap_or_default()
}

/// The decisions kvrouter recorded (`debug.record_decisions`), as `(request id, explanation)`;
/// empty when it records none or does not answer.
pub async fn fetch_decisions(admin: std::net::SocketAddr) -> Vec<(String, serde_json::Value)> {
    let client = reqwest::Client::new();
    let get = |path: String| {
        let client = client.clone();
        async move {
            client
                .get(format!("http://{admin}{path}"))
                .send()
                .await
                .ok()?
                .json::<serde_json::Value>()
                .await
                .ok()
        }
    };
    let ids: Vec<String> = get("/debug/decisions".into())
        .await
        .and_then(|v| serde_json::from_value(v["request_ids"].clone()).ok())
        .unwrap_or_default();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(e) = get(format!("/debug/decisions/{id}")).await {
            out.push((id, e));
        }
    }
    out
}

/// Saves kvrouter's view at the end of a run into `dir`: `router-endpoints.json`
/// (`/debug/endpoints`: load, learned speeds, cache index, KV-event status) and, when the run's
/// config records decisions (`debug.record_decisions`), `router-decisions.jsonl` (one
/// explanation per line; hashes and counts, never prompt text). Best effort: a failure only
/// leaves the files out.
/// `name` is the file prefix (`router`, `router-1`, ...). Returns the decisions.
pub async fn save_router_debug(
    admin: std::net::SocketAddr,
    dir: &std::path::Path,
    name: &str,
) -> Vec<(String, serde_json::Value)> {
    let endpoints = async {
        reqwest::get(format!("http://{admin}/debug/endpoints"))
            .await
            .ok()?
            .text()
            .await
            .ok()
    };
    if let Some(text) = endpoints.await {
        let _ = std::fs::write(dir.join(format!("{name}-endpoints.json")), text);
    }
    // Its metrics at the end of the run (decision sharing's published / received / dropped
    // counts among them).
    let metrics = async {
        reqwest::get(format!("http://{admin}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()
    };
    if let Some(text) = metrics.await {
        let _ = std::fs::write(dir.join(format!("{name}-metrics.txt")), text);
    }
    let decisions = fetch_decisions(admin).await;
    if !decisions.is_empty() {
        let lines: String = decisions
            .iter()
            .map(|(id, e)| format!("{}\n", serde_json::json!({"request_id": id, "decision": e})))
            .collect();
        let _ = std::fs::write(dir.join(format!("{name}-decisions.jsonl")), lines);
    }
    decisions
}
