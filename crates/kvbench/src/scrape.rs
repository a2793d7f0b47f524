//! Ground truth from the replicas while a run goes: their vLLM `/metrics` (running and waiting
//! requests, KV usage, preemptions, prefix-cache queries and hits) sampled every
//! `scrape_interval_ms`, and the router's decision-time histogram at the end.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::client::SimClock;

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
        let fetches = list.iter().map(|(name, addr)| {
            let client = client.clone();
            async move {
                let text = client
                    .get(format!("http://{addr}/metrics"))
                    .send()
                    .await
                    .ok()?
                    .error_for_status()
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                Some((name.clone(), text))
            }
        });
        let t_ms = clock.now_ms();
        for (name, text) in futures::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
        {
            let m = parse_prometheus(&text);
            let get = |k: &str| {
                m.iter()
                    .filter(|(n, _)| n == k)
                    .map(|(_, v)| v)
                    .sum::<f64>()
            };
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

/// `(metric name, value)` of every sample line of a Prometheus text exposition (labels
/// dropped).
pub fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let name = series.split('{').next()?.trim();
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// A Prometheus histogram read from `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    /// `(upper bound, cumulative count)`, ascending; `+Inf` last (written as `null` in JSON,
    /// which has no infinity).
    #[serde(deserialize_with = "buckets_from_json")]
    pub buckets: Vec<(f64, f64)>,
    /// Sum of observations.
    pub sum: f64,
    /// Observations.
    pub count: f64,
}

fn buckets_from_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<(f64, f64)>, D::Error> {
    let raw: Vec<(Option<f64>, f64)> = Deserialize::deserialize(d)?;
    Ok(raw
        .into_iter()
        .map(|(le, c)| (le.unwrap_or(f64::INFINITY), c))
        .collect())
}

impl Histogram {
    /// Reads histogram `name` (summing label sets) from exposition text.
    pub fn from_text(text: &str, name: &str) -> Histogram {
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        let mut h = Histogram::default();
        for line in text.lines().filter(|l| l.starts_with(name)) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.trim().parse::<f64>() else {
                continue;
            };
            if series.starts_with(&format!("{name}_bucket")) {
                let le = series
                    .split("le=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .map(|s| {
                        if s == "+Inf" {
                            f64::INFINITY
                        } else {
                            s.parse().unwrap_or(f64::NAN)
                        }
                    });
                if let Some(le) = le.filter(|l| !l.is_nan()) {
                    match buckets.iter_mut().find(|(b, _)| *b == le) {
                        Some(b) => b.1 += v,
                        None => buckets.push((le, v)),
                    }
                }
            } else if series.starts_with(&format!("{name}_sum")) {
                h.sum += v;
            } else if series.starts_with(&format!("{name}_count")) {
                h.count += v;
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h.buckets = buckets;
        h
    }

    /// The `q` quantile (0..1), linearly interpolated within its bucket (Prometheus'
    /// `histogram_quantile`); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut prev = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(prev.0);
                }
                let within = if c > prev.1 {
                    (rank - prev.1) / (c - prev.1)
                } else {
                    1.0
                };
                return Some(prev.0 + (le - prev.0) * within);
            }
            prev = (le, c);
        }
        Some(prev.0)
    }
}

/// Fetches `url` and reads histogram `name` from it (empty on failure).
pub async fn fetch_histogram(url: &str, name: &str) -> Histogram {
    let text = async { reqwest::get(url).await.ok()?.text().await.ok() }
        .await
        .unwrap_or_default();
    Histogram::from_text(&text, name)
}

/// Saves kvrouter's view at the end of a run into `dir`: `router-endpoints.json`
/// (`/debug/endpoints`: load, learned speeds, cache index, KV-event status) and, when the run's
/// config records decisions (`debug.record_decisions`), `router-decisions.jsonl` (one
/// explanation per line; hashes and counts, never prompt text). Best effort: a failure only
/// leaves the files out.
pub async fn save_router_debug(admin: std::net::SocketAddr, dir: &std::path::Path) {
    let get = |path: String| async move {
        reqwest::get(format!("http://{admin}{path}"))
            .await
            .ok()?
            .text()
            .await
            .ok()
    };
    if let Some(text) = get("/debug/endpoints".into()).await {
        let _ = std::fs::write(dir.join("router-endpoints.json"), text);
    }
    let ids: Vec<String> = get("/debug/decisions".into())
        .await
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| serde_json::from_value(v["request_ids"].clone()).ok())
        .unwrap_or_default();
    if ids.is_empty() {
        return;
    }
    let mut lines = String::new();
    for id in ids {
        if let Some(text) = get(format!("/debug/decisions/{id}")).await {
            lines.push_str(text.trim());
            lines.push('\n');
        }
    }
    let _ = std::fs::write(dir.join("router-decisions.jsonl"), lines);
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3\n\
        vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
        d_bucket{le=\"0.001\"} 2\nd_bucket{le=\"0.01\"} 8\nd_bucket{le=\"+Inf\"} 10\n\
        d_sum 0.05\nd_count 10\n";

    #[test]
    fn parses_samples_and_histograms() {
        let m = parse_prometheus(TEXT);
        assert!(m.contains(&("vllm:num_requests_waiting".into(), 3.0)));
        let h = Histogram::from_text(TEXT, "d");
        assert_eq!(h.count, 10.0);
        assert_eq!(h.buckets.len(), 3);
        // Median: rank 5 is 3/6 into (0.001, 0.01].
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 0.0055).abs() < 1e-9, "{p50}");
        assert_eq!(
            h.quantile(0.99),
            Some(0.01),
            "the +Inf bucket answers its lower bound"
        );
        assert_eq!(Histogram::default().quantile(0.5), None);
        let json = serde_json::to_string(&h).unwrap();
        let back: Histogram = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h, "+Inf survives JSON as null");
    }
}
