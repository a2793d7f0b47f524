//! The flow-control comparison: the same `flow_mix` traffic with kvrouter's `flow_control` on and
//! off (two policy labels of one routing policy), under overload and unloaded, over every seed.
//! It answers issue 17's "must show" from the per-request records (objective, tenant, status,
//! `retry-after`):
//!
//! - the critical objective's TTFT p90 under overload over its unloaded value (same arm);
//! - the flooding tenant's share of admitted prompt tokens over its fair share;
//! - sheddable requests answered 429 with `retry-after`;
//! - requests that waited past the queue's bound, and requests lost silently;
//! - goodput (answers within `slo_ttft_ms` per simulated second of the window).
//!
//! **Fair share.** Fairness in kvrouter is kept within a priority band, so the fair share is
//! computed per objective: the tokens admitted in a band, shared max-min between the tenants by
//! what each asked for in that band (a tenant asking less than an equal split gets all it asked,
//! the rest is split among the others), summed over bands. Without flow control every request
//! is eventually answered, so admitted = asked and the share is the fair one by construction:
//! there the figure says nothing; the TTFT and goodput rows say what waiting cost.
//!
//! That is max-min over the whole run, which an online queue can miss without being unfair at
//! any moment: it counts what a tenant asked across the run, so when a critical burst holds a
//! band's slots for seconds and the light tenant's backlog expires with the flood's, the flood
//! gets the slots later, when the light tenant has nothing left to ask. So a second fair share is
//! reported, the one fair queueing promises (GPS; VTC's and DRR's guarantee): **per dispatch**,
//! the tokens of each request dispatched in a band are owed in equal parts to the tenants that
//! had a request of that band waiting at that moment (all to one tenant if it alone waited).
//! A request waits from when it was sent until its dispatch (answered) or its refusal. Dispatch
//! times are when answered requests' response headers reached the client (kvsim answers with
//! headers at once, so this is the dispatch plus one Envoy hop).
//!
//! **Tokens.** Admitted requests carry the replica's `usage.prompt_tokens`; refused ones do not,
//! and are counted at the mean of the run's answered requests (every `flow_mix` prompt has the
//! same token count by construction).
//!
//! **Waited past the bound.** On the queue's own clock: admitted requests whose wait exceeded the
//! bound (`flow_control.max_wait_ms`), from `kvrouter_flow_wait_seconds` (exact when the bound
//! is a bucket bound, as the flow plan chooses; else the next bucket up, which can only
//! under-count). A refused request is turned away by the queue's timer at the bound; the client
//! also sees Envoy, HTTP and the machine, so the client-clock row (a 429/503 later than the bound
//! plus [`BOUND_SLACK`]) is information, not the goal.
//!
//! Intervals: the paired two-level bootstrap of [`crate::verdict`]: per resample, seeds with
//! replacement and, within a seed, request ids with replacement, the same draws for both arms
//! (and independent draws for the unloaded cell of the same seed); figures are medians over the
//! drawn seeds, ratios are taken within a resample.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::client::RequestRecord;
use super::plan::{FlowAnalysisSpec, Plan};
use super::results::RunResult;
use super::verdict::{interval, median, ratio, Estimate};

/// Client-side slack on the queue's bound, simulated ms: the bound is kept in the router's real
/// time, the client also sees Envoy and HTTP (real ms times the time scale) on a loaded machine.
pub const BOUND_SLACK: f64 = 250.0;

/// One figure, both arms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowRow {
    /// What it is.
    pub figure: String,
    /// The goal, if the issue sets one.
    pub goal: String,
    /// Flow control on: median over seeds [95% interval].
    pub on: Estimate,
    /// Flow control off.
    pub off: Estimate,
    /// on / off, paired by resample (for figures where a ratio means something).
    pub on_over_off: Option<Estimate>,
    /// `met`, `NOT met`, `tie` (interval straddles the goal) or empty (no goal), for the on arm.
    /// A count whose goal is 0 is met only when it is 0 in every run.
    pub verdict: String,
    /// For counts: the sum over every seed's run, (on, off).
    #[serde(default)]
    pub totals: Option<(f64, f64)>,
}

/// One flow-control configuration against flow control off.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowReport {
    /// The policy label with flow control on.
    pub on: String,
    /// Seeds where all four runs (two arms, two cells) exist.
    pub seeds: Vec<u64>,
    /// The queue's bound, simulated ms.
    pub bound_ms: f64,
    /// The figures.
    pub rows: Vec<FlowRow>,
    /// Admitted requests whose router-side queue wait exceeded the bound, per seed (on arm).
    pub router_over_bound: Vec<f64>,
    /// Why it could not be computed, if it could not.
    pub missing: Option<String>,
}

/// Per-run figures, in this order.
const FIGURES: [&str; N_FIG] = [
    "critical TTFT p90, simulated ms",
    "flooding tenant's share of admitted prompt tokens",
    "flooding tenant's fair share of all demand (max-min per band)",
    "admitted share / fair share of all demand",
    "sheddable answered 429 with retry-after",
    "other refusals (429/503 with retry-after)",
    "refusals answered later than the bound + slack (client clock)",
    "lost silently (no answer, no 429/503 with retry-after)",
    "goodput, answers within the TTFT objective per s",
    "answered (200, complete)",
    "sheddable TTFT p90, simulated ms",
    "flooding tenant's fair share among the tenants waiting at each dispatch",
    "admitted share / fair share among the tenants waiting at each dispatch",
];
const N_FIG: usize = 13;
const CRIT_P90: usize = 0;
const SHARE: usize = 1;
const FAIR: usize = 2;
const SHARE_OVER_FAIR: usize = 3;
const SHED: usize = 4;
const OVER_BOUND: usize = 6;
const LOST: usize = 7;
const GOODPUT: usize = 8;
const FAIR_WAITING: usize = 11;
const SHARE_OVER_WAITING: usize = 12;

#[derive(Debug, Clone, Copy, Default)]
struct Req {
    in_window: bool,
    critical: bool,
    sheddable: bool,
    /// Band index: 0 critical, 1 sheddable, 2 anything else.
    band: usize,
    flood: bool,
    tokens: f64,
    answered: bool,
    ttft: Option<f64>,
    good: bool,
    shed_429: bool,
    refused_other: bool,
    late_refusal: bool,
    /// The flooding tenant's part of this request's tokens if it was dispatched: shared equally
    /// among the tenants with a request of its band waiting then ([`owed_at_dispatch`]).
    flood_owed: f64,
}

#[derive(Debug, Clone)]
struct Run {
    reqs: Vec<Req>,
    window_s: f64,
    /// Whether every answered request has its response headers' time, so who waited at each
    /// dispatch is known (records from before that field have none).
    dispatches_known: bool,
}

/// One request's wait in its band: (band, flooding tenant?, from, until), simulated ms.
type Wait = (usize, bool, f64, f64);

/// The flooding tenant's part of `tokens` dispatched at `at` in `band` for a request of the
/// flood (`flood`): the tenants with a request of `band` waiting then (`waits`; the dispatched
/// request's own tenant always counts) share it equally.
fn owed_at_dispatch(waits: &[Wait], band: usize, at: f64, flood: bool, tokens: f64) -> f64 {
    let waiting = |f: bool| {
        f == flood
            || waits
                .iter()
                .any(|&(b, wf, from, until)| b == band && wf == f && from <= at && at < until)
    };
    match (waiting(true), waiting(false)) {
        (true, true) => tokens / 2.0,
        (true, false) => tokens,
        _ => 0.0,
    }
}

impl Run {
    fn of(run: &RunResult, a: &FlowAnalysisSpec, slo_ms: f64, bound_ms: f64) -> Option<Run> {
        let s = run.stats.as_ref()?;
        let answered: Vec<f64> = run
            .records
            .iter()
            .filter(|r| r.ok())
            .filter_map(|r| r.prompt_tokens.map(|t| t as f64))
            .collect();
        let mean_tokens = super::stats::mean(&answered).unwrap_or(1.0);
        let n = run.records.iter().map(|r| r.id + 1).max().unwrap_or(0);
        let band_of = |objective: Option<&str>| {
            if objective == Some(a.critical.as_str()) {
                0
            } else if objective == Some(a.sheddable.as_str()) {
                1
            } else {
                2
            }
        };
        let is_flood = |r: &RequestRecord| r.tenant.as_deref() == Some(a.flooding_tenant.as_str());
        // Each request waits from when it was sent until its dispatch (answered: its response
        // headers) or its answer (refused, failed).
        let waits: Vec<Wait> = run
            .records
            .iter()
            .map(|r| {
                let until = if r.ok() { r.headers_ms } else { None };
                (
                    band_of(r.objective.as_deref()),
                    is_flood(r),
                    r.sent_ms,
                    until.unwrap_or(r.end_ms),
                )
            })
            .collect();
        let dispatches_known = run
            .records
            .iter()
            .all(|r| !r.ok() || r.headers_ms.is_some());
        let mut reqs = vec![Req::default(); n];
        let mut last = s.window_from_ms;
        for r in &run.records {
            let in_window = r.scheduled_ms >= s.window_from_ms;
            if in_window {
                last = last.max(r.scheduled_ms);
            }
            let objective = r.objective.as_deref();
            let critical = objective == Some(a.critical.as_str());
            let sheddable = objective == Some(a.sheddable.as_str());
            let refused = matches!(r.status, 429 | 503) && r.retry_after.is_some();
            let ttft = r.ttft_ms().filter(|_| r.ok());
            let band = band_of(objective);
            let tokens = r
                .prompt_tokens
                .filter(|_| r.ok())
                .map_or(mean_tokens, |t| t as f64);
            let flood_owed = match r.headers_ms.filter(|_| r.ok() && dispatches_known) {
                Some(at) => owed_at_dispatch(&waits, band, at, is_flood(r), tokens),
                None => 0.0,
            };
            reqs[r.id] = Req {
                in_window,
                critical,
                sheddable,
                band,
                flood: is_flood(r),
                tokens,
                answered: r.ok(),
                ttft,
                good: ttft.is_some_and(|t| t <= slo_ms),
                shed_429: refused && r.status == 429 && sheddable,
                refused_other: refused && !(r.status == 429 && sheddable),
                late_refusal: refused && r.e2e_ms() > bound_ms + BOUND_SLACK,
                flood_owed,
            };
        }
        Some(Run {
            reqs,
            window_s: ((last - s.window_from_ms) / 1000.0).max(1.0),
            dispatches_known,
        })
    }

    /// Every figure of [`FIGURES`] over the requests `ids` (with repetition) in the window.
    fn figures(&self, ids: &mut dyn Iterator<Item = usize>) -> [Option<f64>; N_FIG] {
        let mut crit = Vec::new();
        let mut shed_ttft = Vec::new();
        // [band][flood?] asked and admitted tokens.
        let mut asked = [[0.0f64; 2]; 3];
        let mut flood_owed = 0.0f64;
        let mut admitted = [[0.0f64; 2]; 3];
        let mut counts = [0usize; 5]; // shed, other, late, lost, good
        let mut answered = 0usize;
        for id in ids {
            let Some(r) = self.reqs.get(id).filter(|r| r.in_window) else {
                continue;
            };
            let t = usize::from(r.flood);
            asked[r.band][t] += r.tokens;
            flood_owed += r.flood_owed;
            if r.answered {
                admitted[r.band][t] += r.tokens;
                answered += 1;
            }
            if let Some(v) = r.ttft {
                if r.critical {
                    crit.push(v);
                } else if r.sheddable {
                    shed_ttft.push(v);
                }
            }
            counts[0] += usize::from(r.shed_429);
            counts[1] += usize::from(r.refused_other);
            counts[2] += usize::from(r.late_refusal);
            counts[3] += usize::from(!r.answered && !r.shed_429 && !r.refused_other);
            counts[4] += usize::from(r.good);
        }
        let total: f64 = admitted.iter().flatten().sum();
        let share = (total > 0.0).then(|| admitted.iter().map(|b| b[1]).sum::<f64>() / total);
        let fair = (total > 0.0).then(|| {
            (0..3)
                .map(|b| max_min(admitted[b][0] + admitted[b][1], asked[b])[1])
                .sum::<f64>()
                / total
        });
        let over = |fair: Option<f64>| {
            share
                .zip(fair)
                .filter(|(_, f)| *f > 0.0)
                .map(|(s, f)| s / f)
        };
        let fair_waiting = (total > 0.0 && self.dispatches_known).then(|| flood_owed / total);
        [
            super::stats::percentile(&crit, 0.9),
            share,
            fair,
            over(fair),
            Some(counts[0] as f64),
            Some(counts[1] as f64),
            Some(counts[2] as f64),
            Some(counts[3] as f64),
            Some(counts[4] as f64 / self.window_s),
            Some(answered as f64),
            super::stats::percentile(&shed_ttft, 0.9),
            fair_waiting,
            over(fair_waiting),
        ]
    }
}

/// `capacity` shared max-min between two claimants asking `asked`.
fn max_min(capacity: f64, asked: [f64; 2]) -> [f64; 2] {
    let half = capacity / 2.0;
    match (asked[0] <= half, asked[1] <= half) {
        (true, true) => asked,
        (true, false) => [asked[0], (capacity - asked[0]).min(asked[1])],
        (false, true) => [(capacity - asked[1]).min(asked[0]), asked[1]],
        (false, false) => [half, half],
    }
}

/// The queue's bound of `run`, simulated ms: its router config's `flow_control.max_wait_ms`
/// before time scaling, else kvrouter's default.
fn bound_of(run: &RunResult) -> f64 {
    run.router_time
        .iter()
        .find(|f| f.path == "flow_control.max_wait_ms")
        .map_or(
            kvrouter::config::FlowControlConfig::default().max_wait_ms as f64,
            |f| f.simulated,
        )
}

/// Admitted requests that waited in the router's queue longer than `bound_real_s` (counted from
/// the first bucket at or above it), and whether that bucket is the bound itself (exact).
fn router_over_bound(run: &RunResult, bound_real_s: f64) -> (f64, bool) {
    let h = &run.flow_wait;
    let bucket = h.buckets.iter().find(|(le, _)| *le >= bound_real_s - 1e-9);
    let within = bucket.map_or(h.count, |(_, n)| *n);
    let exact = bucket.is_some_and(|(le, _)| (le - bound_real_s).abs() < 1e-6);
    ((h.count - within).max(0.0), exact)
}

/// The comparisons the plan's `analysis.flow` asks for (one per label with flow control on);
/// empty when it asks for none.
pub fn analyse(plan: &Plan, runs: &[RunResult]) -> Vec<FlowReport> {
    let Some(a) = plan.analysis.flow.as_ref() else {
        return Vec::new();
    };
    a.on.iter()
        .map(|on| FlowReport {
            on: on.clone(),
            ..compare(plan, a, on, runs)
        })
        .collect()
}

/// `on` against `a.off`.
fn compare(plan: &Plan, a: &FlowAnalysisSpec, on: &str, runs: &[RunResult]) -> FlowReport {
    let find = |label: &str, workload: &str, seed: u64| {
        runs.iter().find(|r| {
            r.label == label && r.workload == workload && r.seed == seed && r.failed.is_none()
        })
    };
    let mut seeds: Vec<u64> = runs.iter().map(|r| r.seed).collect();
    seeds.sort_unstable();
    seeds.dedup();
    seeds.retain(|&s| {
        [on, a.off.as_str()]
            .iter()
            .all(|&l| find(l, &a.overload, s).is_some() && find(l, &a.unloaded, s).is_some())
    });
    let Some(bound_ms) = seeds
        .first()
        .and_then(|&s| find(on, &a.overload, s))
        .map(bound_of)
    else {
        return FlowReport {
            missing: Some(format!(
                "no seed has all four runs ({on} and {} on {} and {})",
                a.off, a.overload, a.unloaded
            )),
            ..FlowReport::default()
        };
    };
    let slo = plan.slo_ttft_ms;
    // data[seed][arm][cell]: arm 0 on, 1 off; cell 0 overload, 1 unloaded.
    let mut data: Vec<[[Run; 2]; 2]> = Vec::new();
    let mut router_over = Vec::new();
    let mut exact_bucket = true;
    for &s in &seeds {
        let get = |label: &str, workload: &str| {
            find(label, workload, s).and_then(|r| Run::of(r, a, slo, bound_ms))
        };
        let (Some(a0), Some(a1), Some(b0), Some(b1)) = (
            get(on, &a.overload),
            get(on, &a.unloaded),
            get(&a.off, &a.overload),
            get(&a.off, &a.unloaded),
        ) else {
            continue;
        };
        if let Some(r) = find(on, &a.overload, s) {
            let scale = plan
                .workloads
                .iter()
                .find(|w| w.name == a.overload)
                .map_or(plan.time_scale, |w| plan.time_scale_of(w));
            let (n, exact) = router_over_bound(r, bound_ms / scale / 1000.0);
            router_over.push(n);
            exact_bucket &= exact;
        }
        data.push([[a0, a1], [b0, b1]]);
    }
    let n_fig = FIGURES.len();
    // Points: the median over seeds of each run's figures on all its requests.
    let all = |run: &Run| run.figures(&mut (0..run.reqs.len()));
    let mut points = [[[None; N_FIG]; 2]; 2];
    for (arm, arm_points) in points.iter_mut().enumerate() {
        for (cell, cell_points) in arm_points.iter_mut().enumerate() {
            for (f, slot) in cell_points.iter_mut().enumerate() {
                let mut v: Vec<f64> = data.iter().filter_map(|d| all(&d[arm][cell])[f]).collect();
                *slot = median(&mut v);
            }
        }
    }
    // Resamples: reps[arm][cell][figure][resample].
    let resamples = plan.bootstrap_resamples;
    let mut reps = vec![vec![vec![Vec::with_capacity(resamples); n_fig]; 2]; 2];
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x666c_6f77);
    let n_seeds = data.len();
    let mut picked = vec![vec![vec![Vec::with_capacity(n_seeds); n_fig]; 2]; 2];
    let mut ids = Vec::new();
    for _ in 0..resamples {
        picked.iter_mut().flatten().flatten().for_each(Vec::clear);
        for _ in 0..n_seeds {
            let d = &data[rng.random_range(0..n_seeds)];
            for cell in 0..2 {
                let n = d[0][cell].reqs.len().max(d[1][cell].reqs.len());
                ids.clear();
                ids.extend((0..n).map(|_| rng.random_range(0..n.max(1))));
                for arm in 0..2 {
                    let f = d[arm][cell].figures(&mut ids.iter().copied());
                    for (i, v) in f.iter().enumerate() {
                        if let Some(v) = v {
                            picked[arm][cell][i].push(*v);
                        }
                    }
                }
            }
        }
        for arm in 0..2 {
            for cell in 0..2 {
                for f in 0..n_fig {
                    let m = median(&mut picked[arm][cell][f]).unwrap_or(f64::NAN);
                    reps[arm][cell][f].push(m);
                }
            }
        }
    }
    let est = |arm: usize, cell: usize, f: usize| {
        interval(reps[arm][cell][f].clone(), points[arm][cell][f])
    };
    let ratio_est = |x: &[f64], y: &[f64], px: Option<f64>, py: Option<f64>| {
        let r: Vec<f64> = x.iter().zip(y).map(|(&p, &q)| ratio(p, q)).collect();
        interval(r, px.zip(py).filter(|(_, q)| *q > 0.0).map(|(p, q)| p / q))
    };
    let on_off = |f: usize| {
        ratio_est(
            &reps[0][0][f],
            &reps[1][0][f],
            points[0][0][f],
            points[1][0][f],
        )
    };
    let at_most = |e: &Estimate, limit: f64| match (e.lo, e.hi) {
        (_, Some(hi)) if hi <= limit => "met",
        (Some(lo), _) if lo > limit => "NOT met",
        (Some(_), Some(_)) => "tie",
        _ => "not measured",
    };
    let mut rows = Vec::new();
    // The critical objective against its own unloaded value.
    let crit_ratio = |arm: usize| {
        ratio_est(
            &reps[arm][0][CRIT_P90],
            &reps[arm][1][CRIT_P90],
            points[arm][0][CRIT_P90],
            points[arm][1][CRIT_P90],
        )
    };
    rows.push(FlowRow {
        figure: "critical TTFT p90 unloaded, simulated ms".into(),
        goal: String::new(),
        on: est(0, 1, CRIT_P90),
        off: est(1, 1, CRIT_P90),
        on_over_off: Some(ratio_est(
            &reps[0][1][CRIT_P90],
            &reps[1][1][CRIT_P90],
            points[0][1][CRIT_P90],
            points[1][1][CRIT_P90],
        )),
        verdict: String::new(),
        totals: None,
    });
    let (on_ratio, off_ratio) = (crit_ratio(0), crit_ratio(1));
    let factor = a.critical_ttft_factor;
    rows.push(FlowRow {
        figure: format!("overload {}", FIGURES[CRIT_P90]),
        goal: String::new(),
        on: est(0, 0, CRIT_P90),
        off: est(1, 0, CRIT_P90),
        on_over_off: Some(on_off(CRIT_P90)),
        verdict: String::new(),
        totals: None,
    });
    rows.push(FlowRow {
        figure: "critical TTFT p90, overload / unloaded".into(),
        goal: format!("<= {factor}x"),
        verdict: at_most(&on_ratio, factor).into(),
        on: on_ratio,
        off: off_ratio,
        on_over_off: None,
        totals: None,
    });
    for f in [SHARE, FAIR] {
        rows.push(FlowRow {
            figure: FIGURES[f].into(),
            goal: String::new(),
            on: est(0, 0, f),
            off: est(1, 0, f),
            on_over_off: None,
            verdict: String::new(),
            totals: None,
        });
    }
    for (fair, over) in [(FAIR, SHARE_OVER_FAIR), (FAIR_WAITING, SHARE_OVER_WAITING)] {
        if fair != FAIR {
            rows.push(FlowRow {
                figure: FIGURES[fair].into(),
                goal: String::new(),
                on: est(0, 0, fair),
                off: est(1, 0, fair),
                on_over_off: None,
                verdict: String::new(),
                totals: None,
            });
        }
        let share = est(0, 0, over);
        rows.push(FlowRow {
            figure: FIGURES[over].into(),
            goal: "<= 1".into(),
            verdict: at_most(&share, 1.0).into(),
            on: share,
            off: est(1, 0, over),
            on_over_off: None,
            totals: None,
        });
    }
    let total = |arm: usize, f: usize| data.iter().filter_map(|d| all(&d[arm][0])[f]).sum::<f64>();
    for (f, goal) in [
        (SHED, "> 0 under overload"),
        (SHED + 1, ""),
        (OVER_BOUND, ""),
        (LOST, "0"),
    ] {
        let on = est(0, 0, f);
        let totals = Some((total(0, f), total(1, f)));
        let verdict = match goal {
            // Nothing lost means none in any run, not a median of zero.
            "0" if total(0, f) == 0.0 => "met".to_string(),
            "0" => "NOT met".to_string(),
            "" => String::new(),
            _ => match (on.lo, on.hi) {
                (Some(lo), _) if lo > 0.0 => "met".into(),
                // Wholly outside "> 0": none in any resample.
                (Some(_), Some(hi)) if hi <= 0.0 => "NOT met".into(),
                (Some(_), _) => "tie".into(),
                (None, _) => "not measured".into(),
            },
        };
        rows.push(FlowRow {
            figure: FIGURES[f].into(),
            goal: goal.into(),
            on,
            off: est(1, 0, f),
            on_over_off: None,
            verdict,
            totals,
        });
    }
    // The queue's own clock: admitted requests that waited past the bound (no request id, so
    // no interval: the per-seed counts and their sum).
    let over: f64 = router_over.iter().sum();
    let mut per_seed = router_over.clone();
    rows.push(FlowRow {
        figure: format!(
            "admitted requests that waited in the router past the bound (kvrouter_flow_wait_seconds{})",
            if exact_bucket { "" } else { ", next bucket up" }
        ),
        goal: "0".into(),
        on: Estimate {
            median: median(&mut per_seed),
            lo: None,
            hi: None,
        },
        off: Estimate::default(),
        on_over_off: None,
        verdict: if over == 0.0 { "met" } else { "NOT met" }.into(),
        totals: Some((over, 0.0)),
    });
    let goodput = on_off(GOODPUT);
    // Judged on the difference: off's goodput may be 0, where a ratio says nothing.
    let gain = {
        let d: Vec<f64> = reps[0][0][GOODPUT]
            .iter()
            .zip(&reps[1][0][GOODPUT])
            .map(|(p, q)| p - q)
            .collect();
        let point = points[0][0][GOODPUT].zip(points[1][0][GOODPUT]);
        interval(d, point.map(|(p, q)| p - q))
    };
    rows.push(FlowRow {
        figure: FIGURES[GOODPUT].into(),
        goal: "on >= off".into(),
        verdict: match (gain.lo, gain.hi) {
            (Some(lo), _) if lo > 0.0 => "met (better)".into(),
            (_, Some(hi)) if hi < 0.0 => "NOT met (worse)".into(),
            (Some(_), Some(_)) => "tie".into(),
            _ => "not measured".into(),
        },
        on: est(0, 0, GOODPUT),
        off: est(1, 0, GOODPUT),
        on_over_off: Some(goodput),
        totals: None,
    });
    for f in [GOODPUT + 1, GOODPUT + 2] {
        rows.push(FlowRow {
            figure: FIGURES[f].into(),
            goal: String::new(),
            on: est(0, 0, f),
            off: est(1, 0, f),
            on_over_off: Some(on_off(f)),
            verdict: String::new(),
            totals: None,
        });
    }
    FlowReport {
        on: on.to_string(),
        seeds,
        bound_ms,
        rows,
        router_over_bound: router_over,
        missing: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::RequestRecord;
    use crate::stats::run_stats;

    /// One synthetic run: per request (objective, tenant, status, ttft); requests 100 ms apart,
    /// 100 prompt tokens each; refusals after `refused_after_ms`.
    fn run(label: &str, workload: &str, seed: u64, reqs: &[(&str, &str, u16, f64)]) -> RunResult {
        let refused_after_ms = 200.0;
        let records: Vec<RequestRecord> = reqs
            .iter()
            .enumerate()
            .map(|(id, &(objective, tenant, status, ttft))| {
                let t0 = id as f64 * 100.0;
                let ok = status == 200;
                RequestRecord {
                    id,
                    group: 0,
                    tenant: Some(tenant.into()),
                    scheduled_ms: t0,
                    sent_ms: t0,
                    headers_ms: ok.then_some(t0 + 1.0),
                    first_token_ms: ok.then_some(t0 + ttft),
                    end_ms: t0 + if ok { ttft + 10.0 } else { refused_after_ms },
                    status,
                    error: (!ok).then(|| format!("HTTP {status}")),
                    replica: ok.then(|| "r0".into()),
                    prompt_tokens: ok.then_some(100),
                    cached_tokens: ok.then_some(0),
                    completion_tokens: ok.then_some(1),
                    bypassed: false,
                    objective: Some(objective.into()),
                    retry_after: (status == 429 || status == 503).then(|| "1".into()),
                }
            })
            .collect();
        RunResult::for_test(
            workload,
            "flow_mix",
            label,
            seed,
            run_stats(&records, &[], 1000.0, 1.0, 0.0, 1),
            records,
        )
    }

    /// A plan analysing the flow comparison with the default labels, 200 resamples.
    fn flow_plan() -> Plan {
        Plan {
            bootstrap_resamples: 200,
            analysis: crate::plan::AnalysisSpec {
                flow: Some(FlowAnalysisSpec::default()),
                ..crate::plan::AnalysisSpec::default()
            },
            ..Plan::default()
        }
    }

    #[test]
    fn no_sheddable_refused_in_any_run_is_not_met_not_a_tie() {
        let plan = flow_plan();
        let unloaded = [("critical", "flood", 200, 100.0); 10];
        // Flow control on answers everything: nothing shed, in every seed.
        let answered: Vec<_> = (0..20)
            .map(|i| {
                let objective = if i % 4 == 0 { "critical" } else { "sheddable" };
                (objective, "flood", 200, 150.0)
            })
            .collect();
        let mut runs = Vec::new();
        for seed in 0..3 {
            runs.push(run("flow-on", "overload", seed, &answered));
            runs.push(run("flow-off", "overload", seed, &answered));
            runs.push(run("flow-on", "unloaded", seed, &unloaded));
            runs.push(run("flow-off", "unloaded", seed, &unloaded));
        }
        let reports = analyse(&plan, &runs);
        let shed = reports[0]
            .rows
            .iter()
            .find(|r| r.figure.starts_with("sheddable answered 429"))
            .unwrap();
        assert_eq!(shed.on.hi, Some(0.0));
        assert_eq!(shed.verdict, "NOT met");
    }

    #[test]
    fn on_against_off_counts_sheds_losses_and_the_flooding_share() {
        let plan = flow_plan();
        let unloaded = [("critical", "flood", 200, 100.0); 10];
        let mut runs = Vec::new();
        for seed in 0..5 {
            // Overload: critical requests from both tenants, sheddable ones mostly from the
            // flood. On: critical answered fast, flood's sheddable half refused with 429, one
            // request lost (status 0). Off: everything answered, late.
            let mut on = Vec::new();
            let mut off = Vec::new();
            for i in 0..40 {
                let tenant = if i % 5 == 0 { "steady" } else { "flood" };
                let objective = if i % 4 == 0 { "critical" } else { "sheddable" };
                let shed = objective == "sheddable" && tenant == "flood" && i % 2 == 1;
                let status = if i == 7 {
                    0
                } else if shed {
                    429
                } else {
                    200
                };
                let fast = if objective == "critical" {
                    150.0
                } else {
                    400.0
                };
                on.push((objective, tenant, status, fast));
                off.push((objective, tenant, 200, 3000.0 + 10.0 * i as f64));
            }
            runs.push(run("flow-on", "overload", seed, &on));
            runs.push(run("flow-off", "overload", seed, &off));
            runs.push(run("flow-on", "unloaded", seed, &unloaded));
            runs.push(run("flow-off", "unloaded", seed, &unloaded));
        }
        let reports = analyse(&plan, &runs);
        assert_eq!(reports.len(), 1);
        let f = &reports[0];
        assert!(f.missing.is_none(), "{:?}", f.missing);
        assert_eq!(f.seeds.len(), 5);
        let row = |name: &str| {
            f.rows
                .iter()
                .find(|r| r.figure.starts_with(name))
                .unwrap_or_else(|| panic!("{name}"))
        };
        let ratio = row("critical TTFT p90, overload / unloaded");
        assert_eq!(ratio.on.median, Some(1.5));
        assert_eq!(ratio.verdict, "met");
        assert!(ratio.off.median.unwrap() > 25.0);
        // 40 requests: 30 sheddable, of which flood's odd-numbered ones are refused.
        let shed = row("sheddable answered 429");
        let expected = (0..40)
            .filter(|i| i % 4 != 0 && i % 5 != 0 && i % 2 == 1 && *i != 7)
            .count() as f64;
        assert_eq!(shed.on.median, Some(expected));
        assert_eq!(shed.off.median, Some(0.0));
        let lost = row("lost silently");
        assert_eq!((lost.on.median, lost.off.median), (Some(1.0), Some(0.0)));
        assert_eq!(lost.verdict, "NOT met");
        assert_eq!(row("refusals answered later").on.median, Some(0.0));
        // No wait histogram in these runs: nothing counted past the bound on the router side.
        let router = row("admitted requests that waited in the router");
        assert_eq!(
            (router.totals, router.verdict.as_str()),
            (Some((0.0, 0.0)), "met")
        );
        // Off admits everything: the share is the fair one by construction.
        assert_eq!(row("admitted share / fair share").off.median, Some(1.0));
        let share = row("admitted share / fair share").on.median.unwrap();
        assert!(share <= 1.0 + 1e-9, "{share}");
        // Goodput: on answers within the objective, off never does.
        let goodput = row("goodput");
        assert!(goodput.on.median.unwrap() > 0.0);
        assert_eq!(goodput.off.median, Some(0.0));
        assert_eq!(goodput.verdict, "met (better)");
    }

    #[test]
    fn a_missing_arm_is_reported_not_guessed() {
        let plan = flow_plan();
        let one = [("critical", "flood", 200, 100.0)];
        let runs = vec![run("flow-on", "overload", 1, &one)];
        let f = &analyse(&plan, &runs)[0];
        assert!(f.missing.is_some());
        assert!(f.rows.is_empty());
    }

    #[test]
    fn a_dispatch_is_owed_equally_to_the_tenants_waiting_then() {
        // (band, flood?, from, until)
        let waits = [
            (1, false, 0.0, 200.0),
            (1, true, 150.0, 300.0),
            (0, false, 0.0, 900.0),
        ];
        // Light waits at 100: a flood request dispatched then owes the flood half.
        assert_eq!(owed_at_dispatch(&waits, 1, 100.0, true, 80.0), 40.0);
        // A light request dispatched at 170, the flood waiting: half to the flood.
        assert_eq!(owed_at_dispatch(&waits, 1, 170.0, false, 80.0), 40.0);
        // At 250 light no longer waits (until is exclusive at 200): all to the flood.
        assert_eq!(owed_at_dispatch(&waits, 1, 250.0, true, 80.0), 80.0);
        // Light dispatched alone, or a wait in another band: nothing to the flood.
        assert_eq!(owed_at_dispatch(&waits, 1, 50.0, false, 80.0), 0.0);
        assert_eq!(owed_at_dispatch(&waits, 0, 250.0, false, 80.0), 0.0);
    }

    /// A light sheddable request expires while critical requests take every slot (nothing
    /// sheddable is dispatched while it waits); afterwards the flood's sheddable requests are
    /// served alone. Over the whole run's demand the flood is over its max-min share; per
    /// dispatch, among the tenants waiting, it got exactly its share.
    #[test]
    fn whole_run_max_min_and_the_per_dispatch_share_differ_when_priority_took_the_slots() {
        // 100 ms apart: answered ones are dispatched 1 ms after they are sent, refusals end
        // 200 ms after (the fixture's).
        let reqs = [
            ("sheddable", "steady", 429, 0.0),
            ("critical", "flood", 200, 50.0),
            ("critical", "steady", 200, 50.0),
            ("sheddable", "flood", 200, 50.0),
            ("sheddable", "flood", 200, 50.0),
        ];
        let result = run("flow-on", "overload", 1, &reqs);
        let r = Run::of(&result, &FlowAnalysisSpec::default(), 1000.0, 5000.0).unwrap();
        assert!(r.dispatches_known);
        let f = r.figures(&mut (0..r.reqs.len()));
        // Admitted 400 tokens, 300 the flood's. Whole run: critical [100, 100]; sheddable 200
        // admitted against light 100 and flood 200 asked: [100, 100]. The flood's fair share is
        // 200 of 400.
        assert_eq!(f[SHARE], Some(0.75));
        assert_eq!(f[FAIR], Some(0.5));
        assert_eq!(f[SHARE_OVER_FAIR], Some(1.5));
        // Per dispatch: nobody else waited at any of the flood's dispatches (the light
        // sheddable request waited 0-200, before them), so it is owed all of its 300.
        assert_eq!(f[FAIR_WAITING], Some(0.75));
        assert_eq!(f[SHARE_OVER_WAITING], Some(1.0));
        // Records without the headers' time cannot say who waited at a dispatch: no figure.
        let mut old = result.clone();
        old.records.iter_mut().for_each(|r| r.headers_ms = None);
        let r = Run::of(&old, &FlowAnalysisSpec::default(), 1000.0, 5000.0).unwrap();
        let f = r.figures(&mut (0..r.reqs.len()));
        assert_eq!((f[FAIR_WAITING], f[SHARE_OVER_WAITING]), (None, None));
        assert!(f[FAIR].is_some());
    }

    #[test]
    fn fair_share_is_max_min_within_a_band() {
        // Both ask more than half: an equal split.
        assert_eq!(max_min(100.0, [300.0, 80.0]), [50.0, 50.0]);
        // One asks less than half: it gets what it asked, the other the rest.
        assert_eq!(max_min(100.0, [20.0, 300.0]), [20.0, 80.0]);
        // Room for both.
        assert_eq!(max_min(100.0, [20.0, 30.0]), [20.0, 30.0]);
    }
}
