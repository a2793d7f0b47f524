//! What a bench run produced, as data: one [`RunResult`] per policy, workload and rate, with its
//! CPU use and its comparison with the lower bound. The suite fills these in, the analysis reads
//! them, and the report writes them; none of those modules needs another to name them.

use serde::{Deserialize, Serialize};

use super::client::RequestRecord;
use super::divergence::Divergence;
use super::oracle::CrossTenant;
use super::routercfg::ScaledField;
use super::scenario::EventRecord;
use super::scrape::{Histogram, ReplicaSample};
use super::stats::RunStats;

/// CPU seconds used during a run's load phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    /// Real seconds of the load phase.
    pub wall_s: f64,
    /// The load generator (this process).
    pub bench_s: f64,
    /// All replicas.
    pub replicas_s: f64,
    /// kvrouter.
    pub router_s: f64,
    /// Envoy.
    pub envoy_s: f64,
}

/// A run's comparison with the workload's lower bound.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BoundRatio {
    /// The bound's mean TTFT, simulated ms.
    pub bound_mean_ms: f64,
    /// The bound's p90 TTFT.
    pub bound_p90_ms: f64,
    /// Mean TTFT / bound mean TTFT.
    pub mean_ratio: Option<f64>,
    /// p90 TTFT / bound p90 TTFT.
    pub p90_ratio: Option<f64>,
    /// The fluid bound on the mean TTFT (fleet capacity included), simulated ms.
    #[serde(default)]
    pub fluid_mean_ms: f64,
    /// Mean TTFT / fluid bound.
    #[serde(default)]
    pub fluid_ratio: Option<f64>,
    /// The prefill utilisation a perfect router would see.
    #[serde(default)]
    pub prefill_utilisation: f64,
}

/// One policy on one workload at one rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Workload name.
    pub workload: String,
    /// Its shape kind.
    pub kind: String,
    /// Arrival rate, requests per simulated second.
    pub rate: f64,
    /// Policy label.
    pub label: String,
    /// kvrouter's `policy.name`.
    pub policy: String,
    /// The seed of the trace.
    #[serde(default)]
    pub seed: u64,
    /// Position of the run among the policies of its seed and cell (0 = first).
    #[serde(default)]
    pub order: usize,
    /// Why the run did not happen or broke off; `None` when it ran.
    pub failed: Option<String>,
    /// The numbers.
    pub stats: Option<RunStats>,
    /// Against the lower bound.
    pub bound: Option<BoundRatio>,
    /// Cross-tenant cache hits (workloads with tenants).
    pub cross_tenant: Option<CrossTenant>,
    /// kvrouter's decision time (`kvrouter_decision_duration_seconds`, real time).
    pub decision: Histogram,
    /// How long admitted requests waited in kvrouter's flow-control queue
    /// (`kvrouter_flow_wait_seconds`, every priority, real time); empty with flow control off.
    #[serde(default)]
    pub flow_wait: Histogram,
    /// CPU used.
    pub cpu: CpuUse,
    /// Scenario events done.
    pub events: Vec<EventRecord>,
    /// Requests whose prompt token count from the replica differs from the bench's engine
    /// tokenization (the bound and tenant checks assume they agree).
    pub token_mismatches: usize,
    /// Router settings changed to simulated time (first router's config).
    #[serde(default)]
    pub router_time: Vec<ScaledField>,
    /// With several routers: how often a peer instance's decisions would have changed one.
    #[serde(default)]
    pub divergence: Option<Divergence>,
    /// Every request.
    pub records: Vec<RequestRecord>,
    /// Replica metric samples.
    pub samples: Vec<ReplicaSample>,
}

impl RunResult {
    /// A run of `workload` (`kind`) at `rate` under `label` (`policy`) with nothing measured
    /// yet: seed and order 0, no stats, empty histograms and samples. Callers set what they have
    /// with struct update syntax.
    pub(crate) fn unmeasured(
        workload: &str,
        kind: &str,
        rate: f64,
        label: &str,
        policy: &str,
    ) -> RunResult {
        RunResult {
            workload: workload.into(),
            kind: kind.into(),
            rate,
            label: label.into(),
            policy: policy.into(),
            seed: 0,
            order: 0,
            failed: None,
            stats: None,
            bound: None,
            cross_tenant: None,
            decision: Histogram::default(),
            flow_wait: Histogram::default(),
            cpu: CpuUse::default(),
            events: Vec::new(),
            token_mismatches: 0,
            router_time: Vec::new(),
            divergence: None,
            records: Vec::new(),
            samples: Vec::new(),
        }
    }

    /// A finished run for tests: `label` as the policy, rate 1, nothing but `stats` and
    /// `records` measured.
    #[cfg(test)]
    pub(crate) fn for_test(
        workload: &str,
        kind: &str,
        label: &str,
        seed: u64,
        stats: RunStats,
        records: Vec<RequestRecord>,
    ) -> RunResult {
        RunResult {
            seed,
            stats: Some(stats),
            records,
            ..RunResult::unmeasured(workload, kind, 1.0, label, label)
        }
    }
}
