//! The report: `results.json` (every number, every request, every sample), `summary.json` (the
//! same without per-request records and samples), `report.md` (tables and the "must show"
//! summary) and SVG plots.

pub mod markdown;
pub mod plots;

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::analysis::{self, Analysis};
use super::oracle::LowerBound;
use super::overhead::OverheadResult;
use super::plan::{Plan, WorkloadSpec};
use super::results::RunResult;
use super::stats;
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
    /// The comparisons the plan's `analysis` asks for.
    pub analysis: Option<Analysis>,
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
        }
    }

    /// Records a generated workload.
    pub fn add_workload(&mut self, w: &WorkloadSpec, rate: f64, trace: &Trace, bound: &LowerBound) {
        self.workloads.push(WorkloadInfo {
            name: w.name.clone(),
            kind: w.shape.kind().into(),
            rate,
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
        self.analysis = Some(analysis::analyse(&self.plan.analysis, &self.runs));
        self.write_results(dir)?;
        let mut summary = self.clone();
        for r in &mut summary.runs {
            r.records.clear();
            r.samples.clear();
        }
        write_json(&dir.join("summary.json"), &summary)?;
        let plots = plots::write_all(self, &dir.join("plots"))?;
        let md = markdown::render(self, &plots);
        std::fs::write(dir.join("report.md"), md).map_err(|e| BenchError::Io(e.to_string()))
    }
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| BenchError::Io(e.to_string()))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| BenchError::Io(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| BenchError::Io(e.to_string()))
}
