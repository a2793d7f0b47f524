//! The goals of the plan's `analysis` (issue 13's "must show"), each printed as met or NOT met
//! with its numbers. A goal on a ratio is met when the whole 95% interval is within it (the
//! median alone is not enough), so a met goal survives the machine's noise.
//!
//! - Every cell: the subject's TTFT p90 and mean are better than or tied with the best peer's.
//! - Every cell with a peer that melts (its TTFT p90 at least `melt_factor` times the best
//!   policy's): the subject's p90 is at most 0.1x that peer's.
//! - Saturated shared prefix (the `shared_prefix` workload's highest rate): the subject's p90
//!   is at most 0.05x the baseline's.
//! - The `half_load` cell: the subject's mean TTFT is at most 1.3x the fluid lower bound.
//! - The `replay` workload: the subject's mean and p99 TTFT against `replay_baseline`, beside
//!   Dynamo's published KV-router A/B on the Mooncake tool-and-agent trace (a reference, not a
//!   goal).

use serde::{Deserialize, Serialize};

use super::plan::Plan;
use super::results::RunResult;
use super::verdict::{Cell, Comparison, Estimate, Metric, Outcome, Resampled};

/// Dynamo's KV router against round-robin on the Mooncake tool-and-agent trace (8 workers,
/// Qwen3-32B, 0.8x replay speed): TTFT mean 63,652 -> 2,586 ms, p99 332,974 -> 17,871 ms
/// (`docs/benchmarks/kv-router-ab-testing.md` of ai-dynamo/dynamo, "Example Comparison").
pub const DYNAMO_MEAN_RATIO: f64 = 2586.0 / 63652.0;
/// See [`DYNAMO_MEAN_RATIO`].
pub const DYNAMO_P99_RATIO: f64 = 17871.0 / 332974.0;

/// One goal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goal {
    /// What is asked, in words.
    pub goal: String,
    /// The cell (`workload @ rate`).
    pub cell: String,
    /// Met, NOT met, or `None` when it could not be measured (or is a reference only).
    pub met: Option<bool>,
    /// The numbers.
    pub detail: String,
}

fn ci(e: &Estimate) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    format!("{}x [{}, {}]", f(e.median), f(e.lo), f(e.hi))
}

fn ms(e: &Estimate) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    format!("{} ms [{}, {}]", f(e.median), f(e.lo), f(e.hi))
}

fn within(c: &Comparison, goal: f64) -> Option<bool> {
    c.ratio.hi.map(|hi| hi <= goal)
}

/// Evaluates every goal; `resampled[i]` belongs to `cells[i]`.
pub fn evaluate(
    plan: &Plan,
    runs: &[RunResult],
    cells: &[Cell],
    resampled: &[Resampled],
) -> Vec<Goal> {
    let a = &plan.analysis;
    let subject = a.subject.as_str();
    let mut out = Vec::new();
    for (cell, res) in cells.iter().zip(resampled) {
        let at = format!("{} @ {}", cell.workload, cell.rate);
        if cell.figure(subject, Metric::TtftMean).is_none() {
            out.push(Goal {
                goal: "TTFT p90 and mean better than or tied with the best peer".into(),
                cell: at.clone(),
                met: None,
                detail: format!("no successful run of {subject}"),
            });
            continue;
        }
        for m in [Metric::TtftP90, Metric::TtftMean] {
            let (met, detail) = match cell.verdict(m) {
                Some(v) => (
                    match v.outcome {
                        Outcome::Better | Outcome::Tie => Some(true),
                        Outcome::Worse => Some(false),
                        Outcome::Unknown => None,
                    },
                    format!(
                        "{:?} vs best peer {} ({}): {subject}/{} = {} over {} seeds",
                        v.outcome,
                        v.other,
                        cell.figure(&v.other, m).map_or("-".into(), |e| ms(&e)),
                        v.other,
                        ci(&v.ratio),
                        cell.seeds.len()
                    ),
                ),
                None => (None, "no peer ran".into()),
            };
            out.push(Goal {
                goal: format!("{} better than or tied with the best peer", m.name()),
                cell: at.clone(),
                met,
                detail,
            });
        }
        // Peers that melt.
        let best = cell
            .policies
            .iter()
            .filter_map(|p| p.figures.get(1).and_then(|e| e.median))
            .fold(f64::INFINITY, f64::min);
        for peer in plan.peers() {
            let Some(p90) = cell.figure(&peer, Metric::TtftP90).and_then(|e| e.median) else {
                continue;
            };
            if best.is_finite() && best > 0.0 && p90 >= a.melt_factor * best {
                let c = res.compare(subject, &peer, Metric::TtftP90);
                out.push(Goal {
                    goal: format!("TTFT p90 <= 0.1x a peer that melts ({peer})"),
                    cell: at.clone(),
                    met: within(&c, 0.1),
                    detail: format!(
                        "{peer} p90 {p90:.0} ms is {:.1}x the best policy's; {subject}/{peer} = {}",
                        p90 / best,
                        ci(&c.ratio)
                    ),
                });
            }
        }
    }
    if !a.shared_prefix.is_empty() {
        let top = cells
            .iter()
            .enumerate()
            .filter(|(_, c)| c.workload == a.shared_prefix)
            .max_by(|x, y| x.1.rate.total_cmp(&y.1.rate));
        let goal = format!(
            "TTFT p90 <= 0.05x {} on saturated shared-prefix traffic",
            a.baseline
        );
        match top {
            Some((i, c)) => {
                let cmp = resampled[i].compare(subject, &a.baseline, Metric::TtftP90);
                out.push(Goal {
                    goal,
                    cell: format!("{} @ {}", c.workload, c.rate),
                    met: within(&cmp, 0.05),
                    detail: format!("{subject}/{} = {}", a.baseline, ci(&cmp.ratio)),
                });
            }
            None => out.push(Goal {
                goal,
                cell: a.shared_prefix.clone(),
                met: None,
                detail: "not run".into(),
            }),
        }
    }
    if let Some(h) = &a.half_load {
        let goal = "mean TTFT <= 1.3x the fluid lower bound at 50% load".to_string();
        let at = format!("{} @ {}", h.workload, h.rate);
        let found = cells
            .iter()
            .position(|c| c.workload == h.workload && c.rate == h.rate);
        let mut bounds: Vec<f64> = runs
            .iter()
            .filter(|r| r.workload == h.workload && r.rate == h.rate && r.label == subject)
            .filter_map(|r| r.bound.as_ref().map(|b| b.fluid_mean_ms))
            .filter(|b| *b > 0.0)
            .collect();
        bounds.sort_by(f64::total_cmp);
        let bound = bounds.get(bounds.len() / 2).copied();
        match (found, bound) {
            (Some(i), Some(b)) => {
                let e = resampled[i].estimate(subject, Metric::TtftMean);
                let r = Estimate {
                    median: e.median.map(|v| v / b),
                    lo: e.lo.map(|v| v / b),
                    hi: e.hi.map(|v| v / b),
                };
                let util = runs
                    .iter()
                    .find(|x| x.workload == h.workload && x.rate == h.rate)
                    .and_then(|x| x.bound.as_ref())
                    .map_or(0.0, |b| b.prefill_utilisation);
                out.push(Goal {
                    goal,
                    cell: at,
                    met: r.hi.map(|hi| hi <= 1.3),
                    detail: format!(
                        "{subject} mean {} over the fluid bound {b:.0} ms = {} (a perfect router's \
                         prefill utilisation {:.0}%)",
                        ms(&e),
                        ci(&r),
                        util * 100.0
                    ),
                });
            }
            _ => out.push(Goal {
                goal,
                cell: at,
                met: None,
                detail: "not run".into(),
            }),
        }
    }
    if !a.replay.is_empty() {
        let at = a.replay.clone();
        match cells.iter().position(|c| c.workload == a.replay) {
            Some(i) => {
                let mean = resampled[i].compare(subject, &a.replay_baseline, Metric::TtftMean);
                let p99 = resampled[i].compare(subject, &a.replay_baseline, Metric::TtftP99);
                out.push(Goal {
                    goal: format!(
                        "trace replay: TTFT mean and p99 vs {} (beside Dynamo's KV router vs \
                         round-robin on the Mooncake tool-and-agent trace: mean {:.3}x, p99 {:.3}x)",
                        a.replay_baseline, DYNAMO_MEAN_RATIO, DYNAMO_P99_RATIO
                    ),
                    cell: format!("{} @ {}", cells[i].workload, cells[i].rate),
                    met: None,
                    detail: format!(
                        "{subject}/{}: mean {}, p99 {} (a reference: different trace, fleet and \
                         model)",
                        a.replay_baseline,
                        ci(&mean.ratio),
                        ci(&p99.ratio)
                    ),
                });
            }
            None => out.push(Goal {
                goal: "trace replay against the baseline".into(),
                cell: at,
                met: None,
                detail: "not run".into(),
            }),
        }
    }
    out
}
