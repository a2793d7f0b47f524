//! The "must show" comparisons, computed from a bench's runs as the plan's `analysis` section
//! names them (the report stores the result; this module knows nothing of the report). A comparison whose runs are missing or failed says so instead of a number.
//!
//! - Shared prefix, high load (the workload's highest rate): the subject's TTFT p90 against the
//!   baseline's and against the best other cache-aware policy's (goals 0.05x and 0.5x).
//! - Unique prompts: the subject's TTFT p50/p90/mean against the baseline (goal within 5 %).
//! - Hot prefix: per policy, each replica's waiting queue in the first and last quarter of the
//!   arrival window; a queue **runs away** when its last-quarter mean is at least
//!   `RUNAWAY_MIN_QUEUE` and at least twice its first-quarter mean (still growing when arrivals
//!   stop).
//! - Multi-tenant: cross-tenant cache hits per policy (see `oracle`).
//! - Kill/restart: errors and TTFT p90 before the kill, while the replica is down, and after the
//!   restart, plus the recovery time: from the restart until ten consecutive requests (in send
//!   order) have a TTFT within 1.5x the before-kill p90.

use serde::{Deserialize, Serialize};

use super::client::RequestRecord;
use super::oracle::CrossTenant;
use super::plan::{Action, AnalysisSpec};
use super::results::RunResult;
use super::stats::percentile;

/// Smallest last-quarter mean queue that can count as running away.
pub const RUNAWAY_MIN_QUEUE: f64 = 8.0;

/// Everything the analysis found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    /// Shared prefix at high load.
    pub shared_prefix: Option<P90Comparison>,
    /// Unique prompts.
    pub unique: Option<UniqueComparison>,
    /// Hot prefix: queue growth per policy.
    pub hot_prefix: Vec<QueueGrowth>,
    /// Hot prefix: (the subject's queues stayed bounded, the affinity policy's ran away), for
    /// the policies that ran.
    pub hot_prefix_verdict: (Option<bool>, Option<bool>),
    /// Multi-tenant: cross-tenant hits per policy.
    pub multi_tenant: Vec<(String, CrossTenant)>,
    /// Kill/restart: disturbance per policy.
    pub kill_restart: Vec<Disturbance>,
    /// What could not be computed, and why.
    pub missing: Vec<String>,
}

/// The subject's TTFT p90 against the baseline and the best other cache-aware policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct P90Comparison {
    /// Workload and rate.
    pub workload: String,
    /// Rate, requests per simulated second.
    pub rate: f64,
    /// Subject's p90, simulated ms.
    pub subject_p90_ms: Option<f64>,
    /// Baseline's p90.
    pub baseline_p90_ms: Option<f64>,
    /// subject / baseline (goal <= 0.05).
    pub vs_baseline: Option<f64>,
    /// The best other cache-aware policy by p90, and its p90.
    pub best_cache_aware: Option<(String, f64)>,
    /// subject / best cache-aware (goal <= 0.5).
    pub vs_best_cache_aware: Option<f64>,
}

/// Subject against baseline on unique prompts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UniqueComparison {
    /// Workload.
    pub workload: String,
    /// subject / baseline TTFT mean.
    pub mean_ratio: Option<f64>,
    /// subject / baseline TTFT p50.
    pub p50_ratio: Option<f64>,
    /// subject / baseline TTFT p90.
    pub p90_ratio: Option<f64>,
    /// All three within 1.05.
    pub within_5_percent: bool,
}

/// A policy's queues on the hot-prefix workload.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueGrowth {
    /// Policy label.
    pub label: String,
    /// Largest waiting queue and its replica.
    pub max_queue: f64,
    /// The replica with the largest queue.
    pub max_replica: String,
    /// Per replica: (name, first-quarter mean, last-quarter mean).
    pub quarters: Vec<(String, f64, f64)>,
    /// Replicas whose queue ran away.
    pub runaway: Vec<String>,
    /// Share of requests on the busiest replica.
    pub busiest_share: f64,
}

/// A policy's disturbance in the kill/restart scenario.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Disturbance {
    /// Policy label.
    pub label: String,
    /// When the replica was killed and restarted, simulated ms.
    pub kill_ms: f64,
    /// See `kill_ms`.
    pub restart_ms: Option<f64>,
    /// Client-visible errors in the whole run, and by kind.
    pub errors: usize,
    /// Errors by kind.
    pub error_kinds: Vec<(String, usize)>,
    /// TTFT p90 of requests sent before the kill, simulated ms.
    pub before_p90_ms: Option<f64>,
    /// While the replica was down.
    pub down_p90_ms: Option<f64>,
    /// After the restart.
    pub after_p90_ms: Option<f64>,
    /// From the restart until TTFT recovered, simulated ms; `None` if it never did.
    pub recovery_ms: Option<f64>,
}

fn runs<'a>(all: &'a [RunResult], workload: &str) -> Vec<&'a RunResult> {
    let top = all
        .iter()
        .filter(|r| r.workload == workload)
        .map(|r| r.rate)
        .fold(f64::NEG_INFINITY, f64::max);
    all.iter()
        .filter(|r| {
            r.workload == workload && r.rate == top && r.failed.is_none() && r.stats.is_some()
        })
        .collect()
}

fn find<'a>(runs: &[&'a RunResult], label: &str) -> Option<&'a RunResult> {
    runs.iter().copied().find(|r| r.label == label)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Computes every comparison `spec` (the plan's `analysis`) asks for over `all` runs.
pub fn analyse(spec: &AnalysisSpec, all: &[RunResult]) -> Analysis {
    let mut a = Analysis::default();
    let mut need = |what: &str, workload: &str, label: &str, runs: &[&RunResult]| {
        if find(runs, label).is_none() {
            a.missing.push(format!(
                "{what}: no successful run of {label:?} on {workload:?}"
            ));
        }
    };
    if !spec.shared_prefix.is_empty() {
        let rs = runs(all, &spec.shared_prefix);
        need("shared prefix", &spec.shared_prefix, &spec.subject, &rs);
        need("shared prefix", &spec.shared_prefix, &spec.baseline, &rs);
        let p90 = |l: &str| find(&rs, l).and_then(|r| r.stats.as_ref()?.ttft_ms.p90);
        let best = spec
            .cache_aware
            .iter()
            .filter(|l| **l != spec.subject)
            .filter_map(|l| Some((l.clone(), p90(l)?)))
            .min_by(|x, y| x.1.total_cmp(&y.1));
        a.shared_prefix = Some(P90Comparison {
            workload: spec.shared_prefix.clone(),
            rate: rs.first().map_or(0.0, |r| r.rate),
            subject_p90_ms: p90(&spec.subject),
            baseline_p90_ms: p90(&spec.baseline),
            vs_baseline: ratio(p90(&spec.subject), p90(&spec.baseline)),
            vs_best_cache_aware: ratio(p90(&spec.subject), best.as_ref().map(|b| b.1)),
            best_cache_aware: best,
        });
    }
    if !spec.unique.is_empty() {
        let rs = runs(all, &spec.unique);
        need("unique", &spec.unique, &spec.subject, &rs);
        need("unique", &spec.unique, &spec.baseline, &rs);
        let get = |l: &str, f: fn(&super::stats::Latency) -> Option<f64>| {
            find(&rs, l).and_then(|r| f(&r.stats.as_ref()?.ttft_ms))
        };
        let mean_ratio = ratio(
            get(&spec.subject, |l| l.mean),
            get(&spec.baseline, |l| l.mean),
        );
        let p50_ratio = ratio(
            get(&spec.subject, |l| l.p50),
            get(&spec.baseline, |l| l.p50),
        );
        let p90_ratio = ratio(
            get(&spec.subject, |l| l.p90),
            get(&spec.baseline, |l| l.p90),
        );
        a.unique = Some(UniqueComparison {
            workload: spec.unique.clone(),
            within_5_percent: [mean_ratio, p50_ratio, p90_ratio]
                .iter()
                .all(|r| r.is_some_and(|r| r <= 1.05)),
            mean_ratio,
            p50_ratio,
            p90_ratio,
        });
    }
    if !spec.hot_prefix.is_empty() {
        a.hot_prefix = runs(all, &spec.hot_prefix)
            .into_iter()
            .map(queue_growth)
            .collect();
        let ran_away = |label: &str| {
            a.hot_prefix
                .iter()
                .find(|q| q.label == label)
                .map(|q| !q.runaway.is_empty())
        };
        a.hot_prefix_verdict = (
            ran_away(&spec.subject).map(|r| !r),
            ran_away(&spec.affinity),
        );
    }
    if !spec.multi_tenant.is_empty() {
        a.multi_tenant = runs(all, &spec.multi_tenant)
            .into_iter()
            .filter_map(|r| Some((r.label.clone(), r.cross_tenant.clone()?)))
            .collect();
    }
    if !spec.kill_restart.is_empty() {
        a.kill_restart = runs(all, &spec.kill_restart)
            .into_iter()
            .filter_map(disturbance)
            .collect();
    }
    a
}

fn queue_growth(r: &RunResult) -> QueueGrowth {
    let Some(s) = &r.stats else {
        return QueueGrowth::default();
    };
    let max = s
        .replicas
        .iter()
        .max_by(|a, b| a.max_waiting.total_cmp(&b.max_waiting));
    let served: usize = s.replicas.iter().map(|x| x.requests).sum();
    QueueGrowth {
        label: r.label.clone(),
        max_queue: s.max_queue,
        max_replica: max.map(|m| m.replica.clone()).unwrap_or_default(),
        quarters: s
            .replicas
            .iter()
            .map(|x| {
                (
                    x.replica.clone(),
                    x.waiting_first_quarter,
                    x.waiting_last_quarter,
                )
            })
            .collect(),
        runaway: s
            .replicas
            .iter()
            .filter(|x| {
                x.waiting_last_quarter >= RUNAWAY_MIN_QUEUE
                    && x.waiting_last_quarter >= 2.0 * x.waiting_first_quarter
            })
            .map(|x| x.replica.clone())
            .collect(),
        busiest_share: s.replicas.iter().map(|x| x.requests).max().unwrap_or(0) as f64
            / served.max(1) as f64,
    }
}

fn disturbance(r: &RunResult) -> Option<Disturbance> {
    let s = r.stats.as_ref()?;
    let kill_ms = r.events.iter().find(|e| e.action == Action::Kill)?.at_ms;
    let restart_ms = r
        .events
        .iter()
        .find(|e| e.action == Action::Restart && e.at_ms >= kill_ms)
        .map(|e| e.at_ms);
    let p90_in = |from: f64, to: f64| {
        let v: Vec<f64> = r
            .records
            .iter()
            .filter(|x| x.ok() && x.sent_ms >= from && x.sent_ms < to)
            .filter_map(RequestRecord::ttft_ms)
            .collect();
        percentile(&v, 0.9)
    };
    let before = p90_in(f64::NEG_INFINITY, kill_ms);
    let after_from = restart_ms.unwrap_or(f64::INFINITY);
    let recovery_ms = match (before, restart_ms) {
        (Some(b), Some(rs)) => {
            let mut sent: Vec<&RequestRecord> =
                r.records.iter().filter(|x| x.sent_ms >= rs).collect();
            sent.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
            let good = |x: &RequestRecord| x.ok() && x.ttft_ms().is_some_and(|t| t <= 1.5 * b);
            sent.windows(10)
                .find(|w| w.iter().all(|x| good(x)))
                .map(|w| (w[0].sent_ms - rs).max(0.0))
        }
        _ => None,
    };
    Some(Disturbance {
        label: r.label.clone(),
        kill_ms,
        restart_ms,
        errors: s.errors,
        error_kinds: s.error_kinds.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        before_p90_ms: before,
        down_p90_ms: p90_in(kill_ms, after_from),
        after_p90_ms: restart_ms.and_then(|rs| p90_in(rs, f64::INFINITY)),
        recovery_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::EventRecord;
    use crate::stats::{ReplicaStats, RunStats};

    fn record(id: usize, sent: f64, ttft: f64, ok: bool) -> RequestRecord {
        RequestRecord {
            id,
            group: 0,
            tenant: None,
            scheduled_ms: sent,
            sent_ms: sent,
            headers_ms: None,
            first_token_ms: Some(sent + ttft),
            end_ms: sent + ttft + 10.0,
            status: if ok { 200 } else { 0 },
            error: (!ok).then(|| "stream: reset".into()),
            replica: Some("r0".into()),
            prompt_tokens: Some(10),
            cached_tokens: Some(0),
            completion_tokens: Some(1),
            bypassed: false,
            objective: None,
            retry_after: None,
        }
    }

    fn run(workload: &str, label: &str, stats: RunStats, records: Vec<RequestRecord>) -> RunResult {
        RunResult::for_test(workload, "k", label, 0, stats, records)
    }

    fn with_p90(p90: f64) -> RunStats {
        let mut s = RunStats::default();
        s.ttft_ms.p90 = Some(p90);
        s.ttft_ms.p50 = Some(p90 / 2.0);
        s.ttft_ms.mean = Some(p90 / 2.0);
        s
    }

    fn replica(name: &str, first: f64, last: f64, requests: usize) -> ReplicaStats {
        ReplicaStats {
            replica: name.into(),
            requests,
            waiting_first_quarter: first,
            waiting_last_quarter: last,
            max_waiting: last.max(first),
            ..ReplicaStats::default()
        }
    }

    #[test]
    fn ratios_runaway_queues_and_disturbance() {
        let spec = AnalysisSpec {
            subject: "s".into(),
            baseline: "b".into(),
            cache_aware: vec!["c1".into(), "c2".into(), "s".into()],
            affinity: "c1".into(),
            shared_prefix: "sp".into(),
            unique: "u".into(),
            hot_prefix: "hot".into(),
            kill_restart: "kill".into(),
            ..AnalysisSpec::default()
        };
        let mut runs = Vec::new();
        for (label, p90) in [("s", 50.0), ("b", 2000.0), ("c1", 400.0), ("c2", 100.0)] {
            runs.push(run("sp", label, with_p90(p90), Vec::new()));
        }
        runs.push(run("u", "s", with_p90(104.0), Vec::new()));
        runs.push(run("u", "b", with_p90(100.0), Vec::new()));
        let hot = |reps: Vec<ReplicaStats>| RunStats {
            replicas: reps,
            ..RunStats::default()
        };
        runs.push(run(
            "hot",
            "c1",
            hot(vec![
                replica("r0", 3.0, 40.0, 70),
                replica("r1", 1.0, 0.5, 30),
            ]),
            Vec::new(),
        ));
        runs.push(run(
            "hot",
            "s",
            hot(vec![
                replica("r0", 3.0, 7.0, 50),
                replica("r1", 0.0, 6.0, 50),
            ]),
            Vec::new(),
        ));
        // Kill at 100 ms, restart at 200 ms; TTFT 10 before, 100 while down, then back to 10
        // from 250 ms on.
        let mut records: Vec<RequestRecord> = (0..40)
            .map(|i| {
                let t = i as f64 * 10.0;
                let ttft = if (100.0..250.0).contains(&t) {
                    100.0
                } else {
                    10.0
                };
                record(i, t, ttft, true)
            })
            .collect();
        records.push(record(40, 95.0, 5.0, false));
        let mut killed = run("kill", "s", RunStats::default(), records);
        killed.stats.as_mut().unwrap().errors = 1;
        killed.events = vec![
            EventRecord {
                at_ms: 100.0,
                action: Action::Kill,
                replica: "r0".into(),
                outcome: "ok".into(),
            },
            EventRecord {
                at_ms: 200.0,
                action: Action::Restart,
                replica: "r0".into(),
                outcome: "ok".into(),
            },
        ];
        runs.push(killed);

        let a = analyse(&spec, &runs);
        let sp = a.shared_prefix.unwrap();
        assert_eq!(sp.vs_baseline, Some(0.025));
        assert_eq!(
            sp.best_cache_aware,
            Some(("c2".to_string(), 100.0)),
            "the subject is not its own rival"
        );
        assert_eq!(sp.vs_best_cache_aware, Some(0.5));
        let u = a.unique.unwrap();
        assert!((u.p90_ratio.unwrap() - 1.04).abs() < 1e-9);
        assert!(u.within_5_percent);
        let c1 = a.hot_prefix.iter().find(|q| q.label == "c1").unwrap();
        assert_eq!(c1.runaway, vec!["r0".to_string()]);
        assert!((c1.busiest_share - 0.7).abs() < 1e-9);
        let s = a.hot_prefix.iter().find(|q| q.label == "s").unwrap();
        assert!(
            s.runaway.is_empty(),
            "below the minimum queue, growth is not a runaway"
        );
        assert_eq!(a.hot_prefix_verdict, (Some(true), Some(true)));
        let d = &a.kill_restart[0];
        assert_eq!(d.before_p90_ms, Some(10.0));
        assert_eq!(d.down_p90_ms, Some(100.0));
        assert_eq!(
            d.recovery_ms,
            Some(50.0),
            "ten good requests in a row from 250 ms"
        );
        assert_eq!(d.errors, 1);
        assert!(a.missing.is_empty(), "{:?}", a.missing);
    }

    #[test]
    fn missing_runs_are_named() {
        let spec = AnalysisSpec {
            shared_prefix: "sp".into(),
            ..AnalysisSpec::default()
        };
        let a = analyse(&spec, &[]);
        assert_eq!(a.missing.len(), 2, "{:?}", a.missing);
        assert!(a.missing[0].contains("predicted-ttft"));
        assert_eq!(a.shared_prefix.unwrap().vs_baseline, None);
    }
}
