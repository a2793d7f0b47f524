//! Numbers of one run: latency percentiles, throughput, cache hits, queues, preemptions,
//! goodput at the TTFT objective, errors, and per-replica breakdowns. All times simulated.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::client::RequestRecord;
use super::scrape::ReplicaSample;

/// Nearest-rank percentile (`q` in 0..=1) of unsorted values; `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Arithmetic mean; `None` when empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Percentiles of a latency, simulated ms.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Mean.
    pub mean: Option<f64>,
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Largest.
    pub max: Option<f64>,
}

impl Latency {
    /// Percentiles of `values`.
    pub fn of(values: &[f64]) -> Latency {
        Latency {
            mean: mean(values),
            p50: percentile(values, 0.5),
            p90: percentile(values, 0.9),
            p95: percentile(values, 0.95),
            p99: percentile(values, 0.99),
            max: percentile(values, 1.0),
        }
    }
}

/// One replica's share of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplicaStats {
    /// Replica name.
    pub replica: String,
    /// Requests it answered.
    pub requests: usize,
    /// Its median TTFT, simulated ms.
    pub ttft_p50_ms: Option<f64>,
    /// Largest waiting queue seen (`vllm:num_requests_waiting`).
    pub max_waiting: f64,
    /// Mean waiting queue over the samples.
    pub mean_waiting: f64,
    /// Largest number of this run's requests open on it at once (client view, exact).
    pub max_in_flight: usize,
    /// Mean waiting queue in the first and last quarter of the arrival window.
    pub waiting_first_quarter: f64,
    /// See `waiting_first_quarter`.
    pub waiting_last_quarter: f64,
    /// Preemptions.
    pub preemptions: f64,
    /// Simulated seconds with at least one request of this run open on it (the engine steps
    /// whenever it holds a request: the simulated GPU's busy time).
    #[serde(default)]
    pub busy_s: f64,
}

/// Every number of one run except the raw records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunStats {
    /// Requests in the trace.
    pub requests: usize,
    /// Complete answers.
    pub ok: usize,
    /// Failed requests (any status but 200, broken streams, connection errors, cancellations).
    pub errors: usize,
    /// Failures by kind (message up to the first colon).
    pub error_kinds: BTreeMap<String, usize>,
    /// TTFT of complete answers.
    pub ttft_ms: Latency,
    /// End-to-end latency of complete answers.
    pub e2e_ms: Latency,
    /// Generated tokens per simulated second over the run.
    pub output_tokens_per_s: f64,
    /// Cached prompt tokens / prompt tokens, as the replicas reported them.
    pub kv_hit_rate: Option<f64>,
    /// Prompt tokens the replicas counted (complete answers).
    pub prompt_tokens: u64,
    /// Largest waiting queue on any replica.
    pub max_queue: f64,
    /// Mean over replicas of their mean waiting queue.
    pub mean_queue: f64,
    /// Largest client-view in-flight count on any replica.
    pub max_in_flight: usize,
    /// Preemptions over the fleet.
    pub preemptions: f64,
    /// Complete answers with TTFT within the objective, per simulated second of arrivals.
    pub goodput_rps: f64,
    /// Their share of all requests.
    pub goodput_fraction: f64,
    /// First send to last end, simulated seconds.
    pub duration_s: f64,
    /// Requests sent more than 5 real ms after their scheduled time (concurrency cap or a busy
    /// load generator).
    pub late: usize,
    /// 99th percentile of send lag (sent - scheduled), real ms: the load generator's own
    /// schedule error.
    pub lag_p99_real_ms: f64,
    /// Cold start: the first fifth of the requests (by send time) against the rest.
    pub warmup: Warmup,
    /// Per replica.
    pub replicas: Vec<ReplicaStats>,
    /// The steady-state window starts at this simulated ms of arrivals (earlier arrivals are
    /// left out of the latency, hit-rate and goodput figures).
    #[serde(default)]
    pub window_from_ms: f64,
    /// Requests in the window.
    #[serde(default)]
    pub measured: usize,
    /// Requests sent straight to a replica (bypassing the router).
    #[serde(default)]
    pub bypassed: usize,
    /// The fleet's mean busy fraction (busy replica-seconds over replica-seconds of the run).
    #[serde(default)]
    pub busy_fraction: f64,
    /// Cost: replica-seconds of the run (every replica, first send to last end) per 1,000
    /// complete answers.
    #[serde(default)]
    pub replica_s_per_1k: f64,
    /// Busy replica-seconds per 1,000 complete answers.
    #[serde(default)]
    pub busy_replica_s_per_1k: f64,
    /// Prefix groups (the workload's `group`: a shared prefix, a conversation, a tenant, a hot
    /// prefix's rank) with a complete answer through the router, over the whole run.
    #[serde(default)]
    pub groups: usize,
    /// Of those, groups the router sent to two replicas or more: a router that moves a group recomputes
    /// its prefix and keeps copies of it on several replicas. What a policy should do with a
    /// group depends on the workload (a hot prefix must spread; a shared prefix under eviction
    /// pressure should stay put).
    #[serde(default)]
    pub split_groups: usize,
}

/// How a run started cold: its first fifth of requests (by send time) against the rest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Warmup {
    /// KV hit rate of the first fifth.
    pub first_hit_rate: Option<f64>,
    /// KV hit rate of the rest.
    pub rest_hit_rate: Option<f64>,
    /// Median TTFT of the first fifth, simulated ms.
    pub first_ttft_p50_ms: Option<f64>,
    /// Median TTFT of the rest.
    pub rest_ttft_p50_ms: Option<f64>,
}

fn warmup(records: &[RequestRecord]) -> Warmup {
    let mut sorted: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    sorted.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    let cut = sorted.len() / 5;
    let (first, rest) = sorted.split_at(cut);
    let hit = |rs: &[&RequestRecord]| {
        let prompt: u64 = rs.iter().filter_map(|r| r.prompt_tokens).sum();
        let cached: u64 = rs.iter().filter_map(|r| r.cached_tokens).sum();
        (prompt > 0).then(|| cached as f64 / prompt as f64)
    };
    let p50 = |rs: &[&RequestRecord]| {
        percentile(
            &rs.iter().filter_map(|r| r.ttft_ms()).collect::<Vec<_>>(),
            0.5,
        )
    };
    Warmup {
        first_hit_rate: hit(first),
        rest_hit_rate: hit(rest),
        first_ttft_p50_ms: p50(first),
        rest_ttft_p50_ms: p50(rest),
    }
}

/// Computes a run's numbers: latencies, hits and goodput over the requests scheduled from
/// `window_from_ms` on (failures count as misses of the objective), the rest over the run;
/// `fleet` replicas for the cost.
pub fn run_stats(
    all: &[RequestRecord],
    samples: &[ReplicaSample],
    slo_ttft_ms: f64,
    time_scale: f64,
    window_from_ms: f64,
    fleet: usize,
) -> RunStats {
    let in_window: Vec<RequestRecord> = all
        .iter()
        .filter(|r| r.scheduled_ms >= window_from_ms)
        .cloned()
        .collect();
    let records = &in_window[..];
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms()).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms()).collect();
    let start = records
        .iter()
        .map(|r| r.sent_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    let duration_s = if end > start {
        (end - start) / 1000.0
    } else {
        0.0
    };
    let arrivals_s = {
        let last = records.iter().map(|r| r.scheduled_ms).fold(0.0, f64::max);
        (last - start.min(last)).max(1.0) / 1000.0
    };
    let output: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let good = ok
        .iter()
        .filter(|r| r.ttft_ms().is_some_and(|t| t <= slo_ttft_ms))
        .count();
    let mut error_kinds = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok()) {
        let msg = r.error.as_deref().unwrap_or("unknown");
        let kind = msg.split(':').next().unwrap_or(msg).trim().to_string();
        *error_kinds.entry(kind).or_insert(0) += 1;
    }
    let replicas = replica_stats(all, samples);
    let (run_start, run_end) = all.iter().fold((f64::INFINITY, 0.0f64), |(a, b), r| {
        (a.min(r.sent_ms), b.max(r.end_ms))
    });
    let run_s = if run_end > run_start {
        (run_end - run_start) / 1000.0
    } else {
        0.0
    };
    let answered = all.iter().filter(|r| r.ok()).count().max(1) as f64;
    let (groups, split_groups) = placement(all);
    let busy: f64 = replicas.iter().map(|r| r.busy_s).sum();
    let fleet = fleet.max(replicas.len()).max(1) as f64;
    RunStats {
        window_from_ms,
        measured: records.len(),
        bypassed: all.iter().filter(|r| r.bypassed).count(),
        busy_fraction: if run_s > 0.0 {
            busy / (fleet * run_s)
        } else {
            0.0
        },
        replica_s_per_1k: fleet * run_s / answered * 1000.0,
        busy_replica_s_per_1k: busy / answered * 1000.0,
        groups,
        split_groups,
        requests: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        error_kinds,
        ttft_ms: Latency::of(&ttft),
        e2e_ms: Latency::of(&e2e),
        output_tokens_per_s: if duration_s > 0.0 {
            output as f64 / duration_s
        } else {
            0.0
        },
        kv_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
        prompt_tokens: prompt,
        max_queue: replicas.iter().map(|r| r.max_waiting).fold(0.0, f64::max),
        mean_queue: mean(&replicas.iter().map(|r| r.mean_waiting).collect::<Vec<_>>())
            .unwrap_or(0.0),
        max_in_flight: replicas.iter().map(|r| r.max_in_flight).max().unwrap_or(0),
        preemptions: replicas.iter().map(|r| r.preemptions).sum(),
        goodput_rps: good as f64 / arrivals_s,
        goodput_fraction: good as f64 / records.len().max(1) as f64,
        duration_s,
        late: all
            .iter()
            .filter(|r| r.sent_ms - r.scheduled_ms > 5.0 * time_scale)
            .count(),
        lag_p99_real_ms: percentile(
            &all.iter()
                .map(|r| (r.sent_ms - r.scheduled_ms) / time_scale)
                .collect::<Vec<_>>(),
            0.99,
        )
        .unwrap_or(0.0),
        warmup: warmup(all),
        replicas,
    }
}

/// Groups with a complete answer through the router, and how many of them more than one
/// replica answered (requests sent straight to a replica are not the router's placement).
pub fn placement(records: &[RequestRecord]) -> (usize, usize) {
    let mut by_group: BTreeMap<usize, (&str, bool)> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ok() && !r.bypassed) {
        let Some(replica) = r.replica.as_deref() else {
            continue;
        };
        let entry = by_group.entry(r.group).or_insert((replica, false));
        entry.1 |= entry.0 != replica;
    }
    let split = by_group.values().filter(|(_, split)| *split).count();
    (by_group.len(), split)
}

fn replica_stats(records: &[RequestRecord], samples: &[ReplicaSample]) -> Vec<ReplicaStats> {
    let mut names: Vec<String> = samples
        .iter()
        .map(|s| s.replica.clone())
        .chain(records.iter().filter_map(|r| r.replica.clone()))
        .collect();
    names.sort_by_key(|n| (n.len(), n.clone()));
    names.dedup();
    let start = records
        .iter()
        .map(|r| r.scheduled_ms)
        .fold(f64::INFINITY, f64::min);
    let last = records.iter().map(|r| r.scheduled_ms).fold(0.0, f64::max);
    let quarter = (last - start).max(0.0) / 4.0;
    names
        .into_iter()
        .map(|name| {
            let mine: Vec<&RequestRecord> = records
                .iter()
                .filter(|r| r.replica.as_deref() == Some(name.as_str()))
                .collect();
            let ttft: Vec<f64> = mine
                .iter()
                .filter(|r| r.ok())
                .filter_map(|r| r.ttft_ms())
                .collect();
            let s: Vec<&ReplicaSample> = samples.iter().filter(|s| s.replica == name).collect();
            let waiting: Vec<f64> = s.iter().map(|s| s.waiting).collect();
            let window = |from: f64, to: f64| {
                mean(
                    &s.iter()
                        .filter(|s| s.t_ms >= from && s.t_ms < to)
                        .map(|s| s.waiting)
                        .collect::<Vec<_>>(),
                )
                .unwrap_or(0.0)
            };
            ReplicaStats {
                requests: mine.len(),
                ttft_p50_ms: percentile(&ttft, 0.5),
                max_waiting: waiting.iter().copied().fold(0.0, f64::max),
                mean_waiting: mean(&waiting).unwrap_or(0.0),
                max_in_flight: max_in_flight(&mine),
                waiting_first_quarter: window(start, start + quarter),
                waiting_last_quarter: window(last - quarter, last + 1e-9),
                preemptions: s.last().map_or(0.0, |s| s.preemptions),
                busy_s: busy_ms(&mine) / 1000.0,
                replica: name,
            }
        })
        .collect()
}

/// Length of the union of the records' sent..end intervals, ms.
pub fn busy_ms(records: &[&RequestRecord]) -> f64 {
    let mut spans: Vec<(f64, f64)> = records.iter().map(|r| (r.sent_ms, r.end_ms)).collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut current: Option<(f64, f64)> = None;
    for (a, b) in spans {
        current = match current {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + current.map_or(0.0, |(s, e)| e - s)
}

/// Most requests open at once among `records` (sent..end intervals).
pub fn max_in_flight(records: &[&RequestRecord]) -> usize {
    let mut edges: Vec<(f64, i32)> = records
        .iter()
        .flat_map(|r| [(r.sent_ms, 1), (r.end_ms, -1)])
        .collect();
    // Ends before starts at the same instant.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut open = 0i32;
    let mut best = 0i32;
    for (_, d) in edges {
        open += d;
        best = best.max(open);
    }
    best as usize
}

/// Client-view in-flight count of each replica at evenly spaced times: `(t_ms, counts)`.
pub fn in_flight_series(
    records: &[RequestRecord],
    replicas: &[String],
    points: usize,
) -> Vec<(f64, Vec<usize>)> {
    let start = records
        .iter()
        .map(|r| r.sent_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    if end <= start || !end.is_finite() || !start.is_finite() || points == 0 {
        return Vec::new();
    }
    let step = (end - start) / points as f64;
    (0..=points)
        .map(|i| {
            let t = start + step * i as f64;
            let counts = replicas
                .iter()
                .map(|name| {
                    records
                        .iter()
                        .filter(|r| {
                            r.replica.as_deref() == Some(name) && r.sent_ms <= t && t < r.end_ms
                        })
                        .count()
                })
                .collect();
            (t, counts)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, replica: &str, sent: f64, ttft: f64, end: f64, ok: bool) -> RequestRecord {
        RequestRecord {
            id,
            group: 0,
            tenant: None,
            scheduled_ms: sent,
            sent_ms: sent,
            headers_ms: None,
            first_token_ms: Some(sent + ttft),
            end_ms: end,
            status: if ok { 200 } else { 503 },
            error: (!ok).then(|| "HTTP 503: down".into()),
            replica: Some(replica.into()),
            prompt_tokens: Some(100),
            cached_tokens: Some(50),
            completion_tokens: Some(10),
            bypassed: false,
            objective: None,
            retry_after: None,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 0.01), Some(3.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn run_numbers() {
        let records = vec![
            rec(0, "r0", 0.0, 100.0, 1000.0, true),
            rec(1, "r0", 500.0, 2000.0, 3000.0, true),
            rec(2, "r1", 1000.0, 50.0, 2000.0, false),
        ];
        let s = run_stats(&records, &[], 1000.0, 1.0, 0.0, 2);
        assert_eq!((s.ok, s.errors), (2, 1));
        assert_eq!(s.error_kinds.get("HTTP 503"), Some(&1));
        assert_eq!(s.kv_hit_rate, Some(0.5));
        assert_eq!(s.duration_s, 3.0);
        assert!((s.output_tokens_per_s - 20.0 / 3.0).abs() < 1e-9);
        // One of three within the 1 s objective, over 1 s of arrivals.
        assert!((s.goodput_fraction - 1.0 / 3.0).abs() < 1e-9);
        assert!((s.goodput_rps - 1.0).abs() < 1e-9);
        assert_eq!(s.max_in_flight, 2);
        let r0 = s.replicas.iter().find(|r| r.replica == "r0").unwrap();
        assert_eq!(r0.requests, 2);
        let series = in_flight_series(&records, &["r0".into(), "r1".into()], 3);
        assert_eq!(series[1], (1000.0, vec![1, 1]));
        // r0 is busy 0..3000 (two overlapping requests), r1 1000..2000: 4 of 2 x 3 s.
        assert_eq!(r0.busy_s, 3.0);
        assert!((s.busy_fraction - 4.0 / 6.0).abs() < 1e-9);
        // 2 replicas x 3 s per 2 answers.
        assert!((s.replica_s_per_1k - 3000.0).abs() < 1e-9);
        // The window leaves out early arrivals, not the run's cost.
        let w = run_stats(&records, &[], 1000.0, 1.0, 400.0, 2);
        assert_eq!((w.measured, w.ok), (2, 1));
        assert_eq!(w.replica_s_per_1k, s.replica_s_per_1k);
    }

    #[test]
    fn a_group_answered_by_two_replicas_is_split_and_failures_do_not_count() {
        let in_group = |g: usize, r: RequestRecord| RequestRecord { group: g, ..r };
        let records = vec![
            in_group(0, rec(0, "r0", 0.0, 10.0, 100.0, true)),
            // Group 1 answered by r0 and r1: split.
            in_group(1, rec(1, "r0", 10.0, 10.0, 100.0, true)),
            in_group(1, rec(2, "r1", 20.0, 10.0, 100.0, true)),
            // Group 2 answered by r1; its failure on r0 does not split it.
            in_group(2, rec(3, "r1", 30.0, 10.0, 100.0, true)),
            in_group(2, rec(4, "r0", 40.0, 10.0, 100.0, false)),
            // Group 3 never answered: not counted.
            in_group(3, rec(5, "r2", 50.0, 10.0, 100.0, false)),
            // Group 0 answered by r2 too, but sent there straight, not by the router.
            RequestRecord {
                bypassed: true,
                ..in_group(0, rec(6, "r2", 60.0, 10.0, 100.0, true))
            },
        ];
        let s = run_stats(&records, &[], 1000.0, 1.0, 0.0, 3);
        assert_eq!((s.groups, s.split_groups), (3, 1));
        // The whole run counts, not the window.
        let w = run_stats(&records, &[], 1000.0, 1.0, 25.0, 3);
        assert_eq!((w.groups, w.split_groups), (3, 1));
    }
}
