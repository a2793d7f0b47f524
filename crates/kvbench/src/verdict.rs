//! Verdicts that survive noise: every (workload, rate, policy) cell is run on several seeds, and
//! each figure is given as the median over seeds with a 95% bootstrap confidence interval.
//!
//! The bootstrap is paired and two-level. Every policy of a cell runs on the same trace per
//! seed, so one resample draws seeds with replacement and, within each drawn seed, request ids
//! with replacement, and evaluates **every** policy on those same draws; a figure of a
//! resample is the median over its drawn seeds. The interval is the 2.5th..97.5th percentile
//! over resamples. A comparison of two policies is the ratio of their figures within each
//! resample, so the traffic both saw cancels out and what remains is the policies' difference
//! plus the run-to-run noise of the machine (different seeds are different runs).
//!
//! A verdict compares the subject with the best peer of the cell for that figure: **better**
//! when the whole interval of the ratio is on the subject's side of 1x, **worse** when it is
//! wholly on the other side, **tie** when it contains 1x.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::results::RunResult;
use super::stats::percentile;

/// A figure of a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// TTFT median, simulated ms.
    TtftP50,
    /// TTFT 90th percentile.
    TtftP90,
    /// TTFT 99th percentile.
    TtftP99,
    /// TTFT mean.
    TtftMean,
    /// Answers within the TTFT objective per simulated second of the window (failures miss).
    Goodput,
    /// Cached over prompt tokens (replica-reported).
    HitRate,
}

impl Metric {
    /// Every figure, in report order.
    pub const ALL: [Metric; 6] = [
        Metric::TtftP50,
        Metric::TtftP90,
        Metric::TtftP99,
        Metric::TtftMean,
        Metric::Goodput,
        Metric::HitRate,
    ];

    /// Higher is better (goodput, hit rate); else lower is.
    pub fn higher_is_better(self) -> bool {
        matches!(self, Metric::Goodput | Metric::HitRate)
    }

    /// The column name.
    pub fn name(self) -> &'static str {
        match self {
            Metric::TtftP50 => "TTFT p50",
            Metric::TtftP90 => "TTFT p90",
            Metric::TtftP99 => "TTFT p99",
            Metric::TtftMean => "TTFT mean",
            Metric::Goodput => "goodput/s",
            Metric::HitRate => "KV hit",
        }
    }

    fn index(self) -> usize {
        Metric::ALL.iter().position(|m| *m == self).unwrap_or(0)
    }
}

/// A median over seeds with its 95% bootstrap interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Median over seeds.
    pub median: Option<f64>,
    /// 2.5th percentile over resamples.
    pub lo: Option<f64>,
    /// 97.5th percentile over resamples.
    pub hi: Option<f64>,
}

/// How the subject compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The interval of the ratio is wholly on the subject's side of 1x.
    Better,
    /// The interval contains 1x.
    Tie,
    /// Wholly on the other side.
    Worse,
    /// Not computable (missing runs).
    Unknown,
}

/// One policy's figures in one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyCell {
    /// Policy label.
    pub label: String,
    /// One estimate per [`Metric::ALL`].
    pub figures: Vec<Estimate>,
}

/// A comparison of two policies in one cell on one figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The figure.
    pub metric: Metric,
    /// The first policy (the subject).
    pub subject: String,
    /// The other.
    pub other: String,
    /// subject / other, per resample.
    pub ratio: Estimate,
    /// What the ratio says.
    pub outcome: Outcome,
}

/// A cell: one workload at one rate, every policy, every seed that all of them ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// Workload.
    pub workload: String,
    /// Rate, requests per simulated second.
    pub rate: f64,
    /// Seeds used (those where every policy of the cell has a run).
    pub seeds: Vec<u64>,
    /// Policies that failed on every seed (left out).
    pub failed: Vec<String>,
    /// Per policy.
    pub policies: Vec<PolicyCell>,
    /// The subject against its best peer, per figure.
    pub verdicts: Vec<Comparison>,
}

impl Cell {
    /// The estimate of `label` on `metric`.
    pub fn figure(&self, label: &str, metric: Metric) -> Option<Estimate> {
        self.policies
            .iter()
            .find(|p| p.label == label)
            .and_then(|p| p.figures.get(metric.index()).copied())
    }

    /// The verdict on `metric`.
    pub fn verdict(&self, metric: Metric) -> Option<&Comparison> {
        self.verdicts.iter().find(|v| v.metric == metric)
    }
}

/// Per request id of one run: what the figures need.
#[derive(Debug, Clone, Copy, Default)]
struct Req {
    in_window: bool,
    ttft: Option<f64>,
    good: bool,
    prompt: u64,
    cached: u64,
}

/// One run, reduced.
#[derive(Debug, Clone)]
struct RunData {
    reqs: Vec<Req>,
    window_s: f64,
}

impl RunData {
    fn of(run: &RunResult, slo_ttft_ms: f64) -> Option<RunData> {
        let s = run.stats.as_ref()?;
        let n = run.records.iter().map(|r| r.id + 1).max().unwrap_or(0);
        let mut reqs = vec![Req::default(); n];
        let mut last = s.window_from_ms;
        for r in &run.records {
            let in_window = r.scheduled_ms >= s.window_from_ms;
            if in_window {
                last = last.max(r.scheduled_ms);
            }
            let ttft = r.ttft_ms().filter(|_| r.ok());
            reqs[r.id] = Req {
                in_window,
                ttft,
                good: ttft.is_some_and(|t| t <= slo_ttft_ms),
                prompt: r.prompt_tokens.filter(|_| r.ok()).unwrap_or(0),
                cached: r.cached_tokens.filter(|_| r.ok()).unwrap_or(0),
            };
        }
        Some(RunData {
            reqs,
            window_s: ((last - s.window_from_ms) / 1000.0).max(1.0),
        })
    }

    /// Every figure over the requests `ids` (with repetition).
    fn figures(
        &self,
        ids: &mut dyn Iterator<Item = usize>,
        ttft: &mut Vec<f64>,
    ) -> [Option<f64>; 6] {
        ttft.clear();
        let (mut good, mut prompt, mut cached) = (0usize, 0u64, 0u64);
        for id in ids {
            let Some(r) = self.reqs.get(id).filter(|r| r.in_window) else {
                continue;
            };
            if let Some(t) = r.ttft {
                ttft.push(t);
            }
            good += usize::from(r.good);
            prompt += r.prompt;
            cached += r.cached;
        }
        ttft.sort_by(f64::total_cmp);
        let q = |p: f64| {
            (!ttft.is_empty()).then(|| {
                let rank = ((p * ttft.len() as f64).ceil() as usize).clamp(1, ttft.len());
                ttft[rank - 1]
            })
        };
        [
            q(0.5),
            q(0.9),
            q(0.99),
            (!ttft.is_empty()).then(|| ttft.iter().sum::<f64>() / ttft.len() as f64),
            Some(good as f64 / self.window_s),
            (prompt > 0).then(|| cached as f64 / prompt as f64),
        ]
    }
}

pub(crate) fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// `p / q` for a paired ratio: `0 / 0` is 1 (both nothing: equal), `x / 0` +inf (kept: a
/// resample where the other has nothing is one the subject wins by any ratio).
pub(crate) fn ratio(p: f64, q: f64) -> f64 {
    if p == 0.0 && q == 0.0 {
        1.0
    } else {
        p / q
    }
}

/// The point estimate and the 95% percentile interval of the resamples `v`. Only NaN is left
/// out: an infinite ratio is a real resample (dropping it conditioned the interval on the
/// resamples where the other arm did well, and once called a 0.31 / 0.00 / 0.15 goodput
/// against 1.28 / 0.00 / 0.00 "worse").
pub(crate) fn interval(mut v: Vec<f64>, point: Option<f64>) -> Estimate {
    v.retain(|x| !x.is_nan());
    Estimate {
        median: point,
        lo: percentile(&v, 0.025),
        hi: percentile(&v, 0.975),
    }
}

/// The resampled figures of one cell: `reps[label][metric][resample]`, paired across labels.
pub struct Resampled {
    labels: Vec<String>,
    points: Vec<[Option<f64>; 6]>,
    reps: Vec<Vec<Vec<f64>>>,
}

impl Resampled {
    /// Resamples the runs of one cell: `runs[seed][label]`, every label present in every seed.
    fn new(labels: Vec<String>, runs: &[Vec<RunData>], resamples: usize, seed: u64) -> Resampled {
        let n_seeds = runs.len();
        let mut buf = Vec::new();
        let points = (0..labels.len())
            .map(|l| {
                let mut out = [None; 6];
                for (m, slot) in out.iter_mut().enumerate() {
                    let mut per_seed: Vec<f64> = runs
                        .iter()
                        .filter_map(|s| {
                            let n = s[l].reqs.len();
                            s[l].figures(&mut (0..n), &mut buf)[m]
                        })
                        .collect();
                    *slot = median(&mut per_seed);
                }
                out
            })
            .collect();
        let mut reps: Vec<Vec<Vec<f64>>> = (0..labels.len())
            .map(|_| (0..6).map(|_| Vec::with_capacity(resamples)).collect())
            .collect();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut per_pick: Vec<Vec<Vec<f64>>> = (0..labels.len())
            .map(|_| (0..6).map(|_| Vec::with_capacity(n_seeds)).collect())
            .collect();
        let mut ids: Vec<usize> = Vec::new();
        for _ in 0..resamples {
            per_pick.iter_mut().flatten().for_each(Vec::clear);
            for _ in 0..n_seeds {
                let s = &runs[rng.random_range(0..n_seeds)];
                let n = s.iter().map(|r| r.reqs.len()).max().unwrap_or(0);
                ids.clear();
                ids.extend((0..n).map(|_| rng.random_range(0..n.max(1))));
                for (l, run) in s.iter().enumerate() {
                    let f = run.figures(&mut ids.iter().copied(), &mut buf);
                    for (m, v) in f.iter().enumerate() {
                        if let Some(v) = v {
                            per_pick[l][m].push(*v);
                        }
                    }
                }
            }
            for l in 0..labels.len() {
                for m in 0..6 {
                    let v = median(&mut per_pick[l][m]).unwrap_or(f64::NAN);
                    reps[l][m].push(v);
                }
            }
        }
        Resampled {
            labels,
            points,
            reps,
        }
    }

    fn at(&self, label: &str) -> Option<usize> {
        self.labels.iter().position(|l| l == label)
    }

    /// The estimate of `label` on `metric`.
    pub fn estimate(&self, label: &str, metric: Metric) -> Estimate {
        let Some(l) = self.at(label) else {
            return Estimate::default();
        };
        let m = metric.index();
        interval(self.reps[l][m].clone(), self.points[l][m])
    }

    /// `a / b` on `metric`, paired by resample, and what it says for `a`.
    pub fn compare(&self, a: &str, b: &str, metric: Metric) -> Comparison {
        let (Some(x), Some(y)) = (self.at(a), self.at(b)) else {
            return Comparison {
                metric,
                subject: a.into(),
                other: b.into(),
                ratio: Estimate::default(),
                outcome: Outcome::Unknown,
            };
        };
        let m = metric.index();
        let ratios: Vec<f64> = self.reps[x][m]
            .iter()
            .zip(&self.reps[y][m])
            .map(|(&p, &q)| ratio(p, q))
            .collect();
        let point = match (self.points[x][m], self.points[y][m]) {
            (Some(p), Some(q)) if q > 0.0 => Some(p / q),
            _ => None,
        };
        let ratio = interval(ratios, point);
        let outcome = match (ratio.lo, ratio.hi) {
            (Some(lo), Some(hi)) => {
                let (good, bad) = if metric.higher_is_better() {
                    (lo > 1.0, hi < 1.0)
                } else {
                    (hi < 1.0, lo > 1.0)
                };
                if good {
                    Outcome::Better
                } else if bad {
                    Outcome::Worse
                } else {
                    Outcome::Tie
                }
            }
            _ => Outcome::Unknown,
        };
        Comparison {
            metric,
            subject: a.into(),
            other: b.into(),
            ratio,
            outcome,
        }
    }
}

/// Builds the cell of `workload` at `rate` from `runs` (every run of the bench): its figures,
/// and the subject's verdicts against the best of `peers`. Also returns the resamples, for
/// further comparisons.
pub fn cell(
    runs: &[RunResult],
    workload: &str,
    rate: f64,
    subject: &str,
    peers: &[String],
    slo_ttft_ms: f64,
    resamples: usize,
) -> (Cell, Resampled) {
    let mine: Vec<&RunResult> = runs
        .iter()
        .filter(|r| r.workload == workload && r.rate == rate)
        .collect();
    let mut labels: Vec<String> = Vec::new();
    for r in &mine {
        if !labels.contains(&r.label) {
            labels.push(r.label.clone());
        }
    }
    let ok = |r: &&RunResult| r.failed.is_none() && r.stats.is_some();
    let failed: Vec<String> = labels
        .iter()
        .filter(|l| !mine.iter().any(|r| &r.label == *l && ok(r)))
        .cloned()
        .collect();
    labels.retain(|l| !failed.contains(l));
    let mut seeds: Vec<u64> = mine.iter().map(|r| r.seed).collect();
    seeds.sort_unstable();
    seeds.dedup();
    seeds.retain(|s| {
        labels
            .iter()
            .all(|l| mine.iter().any(|r| r.seed == *s && &r.label == l && ok(r)))
    });
    let data: Vec<Vec<RunData>> = seeds
        .iter()
        .map(|s| {
            labels
                .iter()
                .filter_map(|l| {
                    let r = mine.iter().find(|r| r.seed == *s && &r.label == l)?;
                    RunData::of(r, slo_ttft_ms)
                })
                .collect()
        })
        .collect();
    let key = xxhash_rust::xxh3::xxh3_64(format!("{workload}@{rate}").as_bytes());
    let res = Resampled::new(labels.clone(), &data, resamples, key);
    let policies = labels
        .iter()
        .map(|l| PolicyCell {
            label: l.clone(),
            figures: Metric::ALL.iter().map(|m| res.estimate(l, *m)).collect(),
        })
        .collect::<Vec<_>>();
    let verdicts = Metric::ALL
        .iter()
        .filter_map(|&m| {
            let best = peers
                .iter()
                .filter(|p| labels.contains(p))
                .filter_map(|p| Some((p, res.estimate(p, m).median?)))
                .min_by(|a, b| {
                    if m.higher_is_better() {
                        b.1.total_cmp(&a.1)
                    } else {
                        a.1.total_cmp(&b.1)
                    }
                })?;
            labels
                .iter()
                .any(|l| l == subject)
                .then(|| res.compare(subject, best.0, m))
        })
        .collect();
    (
        Cell {
            workload: workload.into(),
            rate,
            seeds,
            failed,
            policies,
            verdicts,
        },
        res,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::RequestRecord;
    use crate::stats::run_stats;

    fn run(label: &str, seed: u64, ttfts: &[f64]) -> RunResult {
        let records: Vec<RequestRecord> = ttfts
            .iter()
            .enumerate()
            .map(|(id, &t)| RequestRecord {
                id,
                group: 0,
                tenant: None,
                scheduled_ms: id as f64 * 100.0,
                sent_ms: id as f64 * 100.0,
                headers_ms: None,
                first_token_ms: Some(id as f64 * 100.0 + t),
                end_ms: id as f64 * 100.0 + t + 10.0,
                status: 200,
                error: None,
                replica: Some("r0".into()),
                prompt_tokens: Some(100),
                cached_tokens: Some(50),
                completion_tokens: Some(1),
                bypassed: false,
                objective: None,
                retry_after: None,
            })
            .collect();
        RunResult::for_test(
            "w",
            "k",
            label,
            seed,
            run_stats(&records, &[], 1000.0, 1.0, 0.0, 1),
            records,
        )
    }

    fn noisy(base: f64, seed: u64, n: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| base * rng.random_range(0.5..1.5)).collect()
    }

    #[test]
    fn a_clear_difference_is_better_a_small_one_a_tie() {
        let mut runs = Vec::new();
        for seed in 0..5 {
            // Per seed the same traffic: the subject is 0.5x "far", 0.98x "near".
            let t = noisy(200.0, seed, 200);
            runs.push(run(
                "s",
                seed,
                &t.iter().map(|x| x * 0.5).collect::<Vec<_>>(),
            ));
            runs.push(run(
                "near",
                seed,
                &t.iter()
                    .enumerate()
                    .map(|(i, x)| x * if i % 2 == 0 { 0.9 } else { 1.1 } * 0.5)
                    .collect::<Vec<_>>(),
            ));
            runs.push(run("far", seed, &t));
        }
        let peers = vec!["far".to_string(), "near".to_string()];
        let (c, res) = cell(&runs, "w", 1.0, "s", &peers, 1000.0, 400);
        assert_eq!(c.seeds.len(), 5);
        assert_eq!(c.policies.len(), 3);
        let v = c.verdict(Metric::TtftMean).unwrap();
        assert_eq!(v.other, "near", "the best peer");
        assert_eq!(v.outcome, Outcome::Tie, "{v:?}");
        let far = res.compare("s", "far", Metric::TtftMean);
        assert_eq!(far.outcome, Outcome::Better, "{far:?}");
        let r = far.ratio;
        assert!((r.median.unwrap() - 0.5).abs() < 1e-9);
        assert!(r.lo.unwrap() <= 0.5 && r.hi.unwrap() >= 0.5 - 1e-9);
        let back = res.compare("far", "s", Metric::TtftP90);
        assert_eq!(back.outcome, Outcome::Worse);
        // Hit rates are equal: a tie, with higher-is-better read the right way.
        assert_eq!(
            res.compare("s", "far", Metric::HitRate).outcome,
            Outcome::Tie
        );
        let e = c.figure("s", Metric::TtftP50).unwrap();
        assert!(e.lo.unwrap() <= e.median.unwrap() && e.median.unwrap() <= e.hi.unwrap());
    }

    #[test]
    fn failed_policies_and_missing_seeds_are_left_out() {
        let mut runs = vec![run("a", 1, &[10.0, 20.0]), run("b", 1, &[10.0, 20.0])];
        runs.push(run("a", 2, &[10.0, 20.0]));
        let mut broken = run("c", 1, &[]);
        broken.failed = Some("no".into());
        broken.stats = None;
        runs.push(broken);
        let (c, _) = cell(&runs, "w", 1.0, "a", &["b".into()], 1000.0, 100);
        assert_eq!(c.seeds, vec![1], "seed 2 lacks b");
        assert_eq!(c.failed, vec!["c".to_string()]);
        assert_eq!(c.verdicts.len(), Metric::ALL.len());
    }

    #[test]
    fn a_peer_with_no_goodput_in_a_resample_does_not_make_the_subject_worse() {
        // Goodput per seed (answers within the 1000 ms objective): subject 5, 0, 5 of 20;
        // peer 20, 0, 0. The subject does at least as well in two seeds of three: not worse.
        // Dropping the resamples where the peer's median is 0 (x / 0) left only those where
        // it drew seed 0 twice, and called it worse.
        let k = |good: usize| {
            (0..20)
                .map(|i| if i < good { 100.0 } else { 5000.0 })
                .collect::<Vec<_>>()
        };
        let runs = vec![
            run("s", 0, &k(5)),
            run("p", 0, &k(20)),
            run("s", 1, &k(0)),
            run("p", 1, &k(0)),
            run("s", 2, &k(5)),
            run("p", 2, &k(0)),
        ];
        let (c, res) = cell(&runs, "w", 1.0, "s", &["p".into()], 1000.0, 1000);
        let v = c.verdict(Metric::Goodput).unwrap();
        assert_eq!(v.outcome, Outcome::Tie, "{v:?}");
        assert_eq!(v.ratio.hi, Some(f64::INFINITY), "{v:?}");
        // Both nothing is equal, not undefined.
        assert_eq!(ratio(0.0, 0.0), 1.0);
        let back = res.compare("p", "s", Metric::Goodput);
        assert_eq!(back.outcome, Outcome::Tie, "{back:?}");
    }
}
