//! The report: `results.json` (every number, every request, every sample), `summary.json` (the
//! same without per-request records and samples), `report.md` (the goals, the verdicts with
//! their confidence intervals, the cells), `runs.md` (every run), and plots as SVG and PNG.

pub mod markdown;
pub mod plots;

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::analysis::{self, Analysis};
use super::flow::{self, FlowReport};
use super::goals::{self, Goal};
use super::oracle::LowerBound;
use super::overhead::OverheadResult;
use super::plan::{Plan, WorkloadSpec};
use super::results::RunResult;
use super::stats;
use super::verdict::{self, Cell};
use super::workload::Trace;
use super::BenchError;

/// One workload at one rate, as generated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadInfo {
    /// Name.
    pub name: String,
    /// Shape kind.
    pub kind: String,
    /// Rate, requests per simulated second.
    pub rate: f64,
    /// Requests in the trace.
    pub requests: usize,
    /// Generation notes.
    pub notes: Vec<String>,
    /// The lower bound's mean TTFT, simulated ms.
    pub bound_mean_ms: f64,
    /// The lower bound's p90 TTFT, simulated ms.
    pub bound_p90_ms: f64,
    /// Profile the bound assumes.
    pub bound_profile: String,
    /// Scenario events of the workload (as planned).
    pub events: usize,
    /// The workload's time scale.
    pub time_scale: f64,
    /// The seed of the trace.
    #[serde(default)]
    pub seed: u64,
    /// The fluid bound on the mean TTFT, simulated ms.
    #[serde(default)]
    pub fluid_mean_ms: f64,
    /// The prefill utilisation a perfect router would see.
    #[serde(default)]
    pub prefill_utilisation: f64,
    /// The steady-state window's start, simulated s of arrivals.
    #[serde(default)]
    pub warmup_s: f64,
    /// Trace replay: the engine's block sharing against the trace's.
    #[serde(default)]
    pub sharing: Option<SharingCheck>,
}

/// A replayed trace's sharing as the engine's chained block hashes see it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SharingCheck {
    /// Requests compared.
    pub requests: usize,
    /// Requests whose engine-side shared prefix is within two engine blocks of the trace's.
    pub agree: usize,
    /// Input tokens the trace says repeat an earlier request's prefix.
    pub trace_shared_tokens: usize,
    /// Prompt tokens in engine blocks that repeat an earlier request's prefix.
    pub engine_shared_tokens: usize,
    /// Prompt tokens (chat template included).
    pub prompt_tokens: usize,
}

/// Everything a bench produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The plan that was run.
    pub plan: Plan,
    /// Unix seconds at the start.
    pub started_unix_s: u64,
    /// CPUs of the machine.
    pub cpus: usize,
    /// The workloads.
    pub workloads: Vec<WorkloadInfo>,
    /// Every run.
    pub runs: Vec<RunResult>,
    /// Router overhead, if measured.
    pub overhead: Option<OverheadResult>,
    /// The comparisons the plan's `analysis` asks for (on the first seed's runs).
    pub analysis: Option<Analysis>,
    /// Per workload and rate: every policy's figures over seeds and the subject's verdicts.
    #[serde(default)]
    pub cells: Vec<Cell>,
    /// The goals of the plan's `analysis`, met or not, with their numbers.
    #[serde(default)]
    pub goals: Vec<Goal>,
    /// Flow control on against off (the plan's `analysis.flow`), one per configuration on.
    #[serde(default)]
    pub flow: Vec<FlowReport>,
}

impl Report {
    /// An empty report for `plan`.
    pub fn new(plan: Plan) -> Report {
        Report {
            plan,
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            workloads: Vec::new(),
            runs: Vec::new(),
            overhead: None,
            analysis: None,
            cells: Vec::new(),
            goals: Vec::new(),
            flow: Vec::new(),
        }
    }

    /// Records a generated workload (one per seed).
    pub fn add_workload(
        &mut self,
        w: &WorkloadSpec,
        seed: u64,
        trace: &Trace,
        bound: &LowerBound,
        sharing: Option<SharingCheck>,
    ) {
        self.workloads.push(WorkloadInfo {
            name: w.name.clone(),
            kind: w.shape.kind().into(),
            rate: trace.rate,
            seed,
            fluid_mean_ms: bound.fluid_mean_ms,
            prefill_utilisation: bound.prefill_utilisation,
            warmup_s: w.warmup_s,
            sharing,
            requests: trace.requests.len(),
            notes: trace.notes.clone(),
            bound_mean_ms: stats::mean(&bound.ttft_ms).unwrap_or(0.0),
            bound_p90_ms: stats::percentile(&bound.ttft_ms, 0.9).unwrap_or(0.0),
            bound_profile: bound.profile.clone(),
            events: w.events.len(),
            time_scale: self.plan.time_scale_of(w),
        });
    }

    /// Writes `results.json` (complete).
    pub fn write_results(&self, dir: &Path) -> Result<(), BenchError> {
        write_json(&dir.join("results.json"), self)
    }

    /// Reads a `results.json`.
    pub fn read(path: &Path) -> Result<Report, BenchError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| BenchError::Io(format!("{}: {e}", path.display())))?;
        serde_json::from_str(&text).map_err(|e| BenchError::Io(format!("{}: {e}", path.display())))
    }

    /// Computes the analysis and writes everything: `results.json`, `summary.json`,
    /// `report.md`, and the plots under `plots/`.
    pub fn finish(&mut self, dir: &Path) -> Result<(), BenchError> {
        // Results written before runs counted their split groups: count them from the records
        // (`run_stats` does for every new run).
        for r in &mut self.runs {
            if let Some(s) = r.stats.as_mut().filter(|s| s.groups == 0) {
                (s.groups, s.split_groups) = crate::stats::placement(&r.records);
            }
        }
        // The single-run analyses look at the first seed only; the verdicts at every seed.
        let first_seed = self.plan.seed_list().first().copied();
        let first: Vec<RunResult> = self
            .runs
            .iter()
            .filter(|r| Some(r.seed) == first_seed || r.failed.is_some())
            .cloned()
            .collect();
        self.analysis = Some(analysis::analyse(&self.plan.analysis, &first));
        let peers = self.plan.peers();
        let mut keys: Vec<(String, f64)> = Vec::new();
        for r in &self.runs {
            if !keys.iter().any(|k| k.0 == r.workload && k.1 == r.rate) {
                keys.push((r.workload.clone(), r.rate));
            }
        }
        let mut resampled = Vec::new();
        self.cells.clear();
        for (w, rate) in &keys {
            let (cell, res) = verdict::cell(
                &self.runs,
                w,
                *rate,
                &self.plan.analysis.subject,
                &peers,
                self.plan.slo_ttft_ms,
                self.plan.bootstrap_resamples,
            );
            self.cells.push(cell);
            resampled.push(res);
        }
        self.goals = goals::evaluate(&self.plan, &self.runs, &self.cells, &resampled);
        self.flow = flow::analyse(&self.plan, &self.runs);
        self.write_results(dir)?;
        let mut summary = self.clone();
        for r in &mut summary.runs {
            r.records.clear();
            r.samples.clear();
        }
        write_json(&dir.join("summary.json"), &summary)?;
        let plots = match plots::write_all(self, &dir.join("plots")) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("kvbench: plots not drawn: {e}");
                Vec::new()
            }
        };
        let md = markdown::render(self, &plots);
        std::fs::write(dir.join("report.md"), md).map_err(|e| BenchError::Io(e.to_string()))?;
        std::fs::write(dir.join("runs.md"), markdown::render_runs(self))
            .map_err(|e| BenchError::Io(e.to_string()))
    }
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| BenchError::Io(e.to_string()))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| BenchError::Io(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| BenchError::Io(e.to_string()))
}
