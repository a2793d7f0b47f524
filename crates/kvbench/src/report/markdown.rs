//! `report.md`: the goals (met or NOT met), the subject's verdicts with their intervals, every
//! cell's figures over seeds, the single-run analyses, the workloads, router overhead during
//! runs and on its own, cost and utilisation, the plots. `runs.md`: every run's numbers.

use std::fmt::Write as _;

use super::Report;
use crate::analysis::RUNAWAY_MIN_QUEUE;
use crate::results::RunResult;
use crate::verdict::{Estimate, Metric, Outcome};

fn est(e: Option<Estimate>, pct: bool) -> String {
    let Some(e) = e else { return "-".into() };
    let f = |v: Option<f64>| match v {
        Some(v) if pct => format!("{:.0}%", v * 100.0),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.2}"),
        None => "-".into(),
    };
    format!("{} [{}, {}]", f(e.median), f(e.lo), f(e.hi))
}

fn ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
        None => "-".into(),
    }
}

fn x(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}x"))
}

/// Renders the report; `plots` are paths relative to the report's directory.
pub fn render(r: &Report, plots: &[String]) -> String {
    let p = &r.plan;
    let mut o = String::new();
    let seeds = p.seed_list();
    let _ = writeln!(o, "# kvrouter benchmark: {}\n", p.name);
    let _ = writeln!(
        o,
        "Plan `{}`, {} seed(s) of the `{:?}` set ({}..={}), policies in {:?} order per seed, \
         tokenizer `{}`, time scale {}x on {} CPUs. Times are **simulated** ms (real time x the \
         scale). Router time constants {} (see *Router time*). Goodput counts answers with TTFT \
         <= {} ms; failures count as misses. Figures are medians over seeds with 95% paired \
         bootstrap intervals ({} resamples). Every run's numbers are in [runs.md](runs.md). \
         Reproduce: `kvbench run --plan <plan> --out DIR` (`make bench`).\n",
        p.name,
        seeds.len(),
        p.seed_set,
        seeds.first().copied().unwrap_or(0),
        seeds.last().copied().unwrap_or(0),
        p.policy_order,
        p.tokenizer,
        p.time_scale,
        r.cpus,
        if p.scale_router_time {
            "are divided by the time scale"
        } else {
            "are NOT scaled (real time)"
        },
        p.slo_ttft_ms,
        p.bootstrap_resamples,
    );
    goals(&mut o, r);
    flow(&mut o, r);
    verdicts(&mut o, r);
    cells(&mut o, r);
    must_show(&mut o, r);
    let _ = writeln!(o, "## Workloads\n");
    let mut shown: Vec<(String, f64)> = Vec::new();
    for w in &r.workloads {
        if shown.iter().any(|k| k.0 == w.name && k.1 == w.rate) {
            continue;
        }
        shown.push((w.name.clone(), w.rate));
        let same: Vec<_> = r
            .workloads
            .iter()
            .filter(|x| x.name == w.name && x.rate == w.rate)
            .collect();
        let fluid: Vec<String> = same
            .iter()
            .map(|x| format!("{:.0}", x.fluid_mean_ms))
            .collect();
        let _ = writeln!(
            o,
            "- **{}** ({}, {} req/s, {} requests, time scale {}{}{}): {}; lower bound TTFT mean {} ms, \
             p90 {} ms on {}; fluid bound (fleet capacity) mean {} ms per seed; a perfect router's \
             prefill utilisation {:.0}%.",
            w.name,
            w.kind,
            w.rate,
            w.requests,
            w.time_scale,
            if w.events > 0 { format!(", {} scenario events", w.events) } else { String::new() },
            if w.warmup_s > 0.0 { format!(", steady state from {} s", w.warmup_s) } else { String::new() },
            w.notes.join("; "),
            ms(Some(w.bound_mean_ms)),
            ms(Some(w.bound_p90_ms)),
            w.bound_profile,
            fluid.join(", "),
            w.prefill_utilisation * 100.0
        );
        for x in &same {
            if let Some(c) = &x.sharing {
                let _ = writeln!(
                    o,
                    "  - seed {}: engine-block sharing {:.1}% of prompt tokens vs the trace's {:.1}% \
                     of input tokens; {} of {} requests agree within two engine blocks.",
                    x.seed,
                    100.0 * c.engine_shared_tokens as f64 / c.prompt_tokens.max(1) as f64,
                    100.0 * c.trace_shared_tokens as f64 / c.prompt_tokens.max(1) as f64,
                    c.agree,
                    c.requests
                );
            }
        }
    }
    beyond_ttft(&mut o, r);
    router_time(&mut o, r);
    decision_overhead(&mut o, r);
    overhead(&mut o, r);
    if !plots.is_empty() {
        let _ = writeln!(o, "\n## Plots\n");
        for p in plots.iter().filter(|p| p.ends_with(".svg")) {
            let png = p.trim_end_matches(".svg").to_string() + ".png";
            let alt = if plots.contains(&png) {
                format!(" ([PNG]({png}))")
            } else {
                String::new()
            };
            let _ = writeln!(o, "![{p}]({p}){alt}\n");
        }
    }
    o
}

/// Flow control on against off (`analysis.flow`), if the plan asks for it.
fn flow(o: &mut String, r: &Report) {
    let Some(a) = &r.plan.analysis.flow else {
        return;
    };
    for f in &r.flow {
        flow_one(o, a, f);
    }
}

fn flow_one(o: &mut String, a: &crate::plan::FlowAnalysisSpec, f: &crate::flow::FlowReport) {
    let _ = writeln!(o, "## Flow control: `{}` against `{}`\n", f.on, a.off);
    if let Some(why) = &f.missing {
        let _ = writeln!(o, "Not computed: {why}.\n");
        return;
    }
    let _ = writeln!(
        o,
        "`{}` against `{}` on `{}` (the same traffic unloaded: `{}`), {} seeds ({}). Median over \
         seeds [95% paired bootstrap interval]; a goal is met when its whole interval is within \
         it, NOT met when wholly outside, else a tie. Counts are per run over the window; the \
         queue's bound is {:.0} ms (simulated), refusals count as late past it plus {:.0} ms. \
         The flooding tenant is `{}`; its fair share is max-min per priority band of the tokens \
         admitted in that band, split by what each asked over the run; a second fair share owes \
         each dispatched request's tokens in equal parts to the tenants with a request of its \
         band waiting at that moment (fair queueing's promise; see \
         `crates/kvbench/src/flow.rs`).\n",
        f.on,
        a.off,
        a.overload,
        a.unloaded,
        f.seeds.len(),
        f.seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        f.bound_ms,
        crate::flow::BOUND_SLACK,
        a.flooding_tenant,
    );
    let _ = writeln!(
        o,
        "| figure | goal | {} (on) | {} (off) | on / off | verdict (on) |",
        f.on, a.off
    );
    let _ = writeln!(o, "| --- | --- | --- | --- | --- | --- |");
    for row in &f.rows {
        let pct = row.figure.contains("share") && !row.figure.contains('/');
        let total = |t: Option<f64>| t.map_or(String::new(), |t| format!(" (all runs: {t:.0})"));
        let _ = writeln!(
            o,
            "| {} | {} | {}{} | {}{} | {} | {} |",
            row.figure,
            row.goal,
            est(Some(row.on), pct),
            total(row.totals.map(|t| t.0)),
            est(Some(row.off), pct),
            total(row.totals.map(|t| t.1)),
            est(row.on_over_off, false),
            row.verdict
        );
    }
    let _ = writeln!(
        o,
        "\nRouter side, admitted requests that waited in the queue past the bound (from \
         `kvrouter_flow_wait_seconds`), per seed: {:?}.\n",
        f.router_over_bound
    );
}

fn goals(o: &mut String, r: &Report) {
    if r.goals.is_empty() {
        return;
    }
    let met = r.goals.iter().filter(|g| g.met == Some(true)).count();
    let not = r.goals.iter().filter(|g| g.met == Some(false)).count();
    let _ = writeln!(
        o,
        "## Goals\n\nSubject `{}`. {met} met, {not} NOT met, {} not measured or reference only. \
         A ratio goal is met when its whole 95% interval is within it.\n",
        r.plan.analysis.subject,
        r.goals.len() - met - not
    );
    let _ = writeln!(o, "| goal | cell | result | numbers |\n|---|---|---|---|");
    for g in &r.goals {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} |",
            g.goal,
            g.cell,
            match g.met {
                Some(true) => "met",
                Some(false) => "**NOT met**",
                None => "-",
            },
            g.detail.replace('|', "/")
        );
    }
    let _ = writeln!(o);
}

fn verdicts(o: &mut String, r: &Report) {
    if r.cells.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "## Verdicts\n\n`{}` against the best peer of each cell and figure (peers: {}). Ratio = \
         subject / peer, paired by seed and request; **better** / **worse** when the whole interval \
         is on one side of 1x, else tie.\n",
        r.plan.analysis.subject,
        r.plan.peers().join(", ")
    );
    let _ = writeln!(
        o,
        "| workload | rate | seeds | figure | subject | best peer | peer | ratio | verdict |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(9));
    for c in &r.cells {
        for v in &c.verdicts {
            let pct = v.metric == Metric::HitRate;
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                c.workload,
                c.rate,
                c.seeds.len(),
                v.metric.name(),
                est(c.figure(&v.subject, v.metric), pct),
                v.other,
                est(c.figure(&v.other, v.metric), pct),
                est(Some(v.ratio), false),
                match v.outcome {
                    Outcome::Better => "**better**",
                    Outcome::Tie => "tie",
                    Outcome::Worse => "**worse**",
                    Outcome::Unknown => "-",
                }
            );
        }
    }
    let _ = writeln!(o);
}

fn cells(o: &mut String, r: &Report) {
    if r.cells.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "## Cells\n\nEvery policy per workload and rate: median over seeds [95% interval].\n"
    );
    let _ = writeln!(
        o,
        "| workload | rate | policy | TTFT p50 | p90 | p99 | mean | goodput/s | KV hit |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(9));
    for c in &r.cells {
        for p in &c.policies {
            let f = |m: Metric| {
                est(
                    p.figures
                        .get(Metric::ALL.iter().position(|x| *x == m).unwrap_or(0))
                        .copied(),
                    m == Metric::HitRate,
                )
            };
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                c.workload,
                c.rate,
                p.label,
                f(Metric::TtftP50),
                f(Metric::TtftP90),
                f(Metric::TtftP99),
                f(Metric::TtftMean),
                f(Metric::Goodput),
                f(Metric::HitRate)
            );
        }
        for l in &c.failed {
            let _ = writeln!(
                o,
                "| {} | {} | {l} | FAILED on every seed |{}",
                c.workload,
                c.rate,
                " |".repeat(5)
            );
        }
    }
    let _ = writeln!(o);
}

/// Per cell and policy: medians over seeds of queues, preemptions, busy share, cost.
fn beyond_ttft(o: &mut String, r: &Report) {
    let _ = writeln!(o, "\n## Queues, preemptions, utilisation and cost\n");
    let _ = writeln!(
        o,
        "Medians over seeds. *busy*: the simulated GPUs' busy share (time with a request on the \
         replica, over the run). *cost*: replica-seconds of the run per 1,000 answers; *busy cost*: \
         busy replica-seconds per 1,000 answers. *queue*: `vllm:num_requests_waiting` (max; mean of \
         per-replica means). *split*: prefix groups (shared prefix, conversation, tenant or hot \
         prefix, as the workload defines them) the router sent to two replicas or more, of those answered, \
         over the whole run: each split recomputed the group's prefix somewhere new (a hot prefix \
         should split; a shared prefix under eviction pressure should not).\n"
    );
    let _ = writeln!(o, "| workload | rate | policy | errors | queue max | queue mean | preempt | busy | cost | busy cost | e2e p50 | out tok/s | split |");
    let _ = writeln!(o, "|{}", "---|".repeat(13));
    let mut keys: Vec<(String, f64, String)> = Vec::new();
    for x in r.runs.iter().filter(|x| x.stats.is_some()) {
        let k = (x.workload.clone(), x.rate, x.label.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (w, rate, label) in keys {
        let runs: Vec<&RunResult> = r
            .runs
            .iter()
            .filter(|x| x.workload == w && x.rate == rate && x.label == label)
            .collect();
        let med = |f: &dyn Fn(&crate::stats::RunStats) -> f64| {
            let mut v: Vec<f64> = runs
                .iter()
                .filter_map(|x| x.stats.as_ref())
                .map(f)
                .collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let _ = writeln!(
            o,
            "| {w} | {rate} | {label} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0}% | {:.0} | {:.0} | {} | {:.0} | {:.0} of {:.0} |",
            med(&|s| s.errors as f64),
            med(&|s| s.max_queue),
            med(&|s| s.mean_queue),
            med(&|s| s.preemptions),
            med(&|s| s.busy_fraction) * 100.0,
            med(&|s| s.replica_s_per_1k),
            med(&|s| s.busy_replica_s_per_1k),
            ms(Some(med(&|s| s.e2e_ms.p50.unwrap_or(0.0)))),
            med(&|s| s.output_tokens_per_s),
            med(&|s| s.split_groups as f64),
            med(&|s| s.groups as f64),
        );
    }
    let multi: Vec<&RunResult> = r.runs.iter().filter(|x| x.divergence.is_some()).collect();
    if !multi.is_empty() {
        let _ = writeln!(o, "\n### Several routers\n");
        let _ = writeln!(o, "Share of decisions a peer instance's recent decisions would have changed (see `divergence` in docs/bench.md).\n");
        let _ = writeln!(o, "| workload | rate | policy | seed | routers | decisions per router | unmatched | changed | share |");
        let _ = writeln!(o, "|{}", "---|".repeat(9));
        for x in multi {
            if let Some(d) = &x.divergence {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {:?} | {} | {} | {:.1}% |",
                    x.workload,
                    x.rate,
                    x.label,
                    x.seed,
                    d.routers,
                    d.per_router,
                    d.unmatched,
                    d.changed,
                    d.share * 100.0
                );
            }
        }
    }
}

fn router_time(o: &mut String, r: &Report) {
    let Some(run) = r.runs.iter().find(|x| !x.router_time.is_empty()) else {
        return;
    };
    let _ = writeln!(o, "\n## Router time\n");
    let _ = writeln!(
        o,
        "The replicas run {}x faster than real time; the router's durations were divided by that \
         and its speeds multiplied, so it lives in simulated time (first run's config; values in \
         the router's own units):\n",
        r.plan.time_scale_of(
            r.plan
                .workloads
                .iter()
                .find(|w| w.name == run.workload)
                .unwrap_or(&r.plan.workloads[0])
        )
    );
    let cells: Vec<String> = run
        .router_time
        .iter()
        .map(|f| {
            format!(
                "`{}` {} -> {}{}",
                f.path,
                f.simulated,
                f.written,
                if f.floored {
                    " (kvrouter's floor: slower than simulated)"
                } else {
                    ""
                }
            )
        })
        .collect();
    let _ = writeln!(o, "{}\n", cells.join("; "));
    let _ = writeln!(
        o,
        "Not configurable, so still in real time: the arrival meter's 5 s time constant \
         (`src/router/arrivals.rs`), the KV-event subscriber's 200 ms reconnect and the observer's \
         120 s bookkeeping window."
    );
}

fn decision_overhead(o: &mut String, r: &Report) {
    let _ = writeln!(o, "\n## Router overhead during the runs\n");
    let _ = writeln!(
        o,
        "kvrouter's own decision time (`kvrouter_decision_duration_seconds`, **real** ms) over every \
         run of a policy, and what it is in simulated time at the run's scale (each real ms of \
         router or Envoy time appears as `time scale` ms in simulated TTFTs).\n"
    );
    let _ = writeln!(
        o,
        "| policy | decisions | p50 real ms | p90 | p99 | p99 as simulated ms |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|");
    for label in r.plan.policies.iter().map(|p| p.label().to_string()) {
        let mut h = crate::scrape::Histogram::default();
        for x in r.runs.iter().filter(|x| x.label == label) {
            if h.buckets.is_empty() {
                h = x.decision.clone();
            } else if h.buckets.len() == x.decision.buckets.len() {
                for (a, b) in h.buckets.iter_mut().zip(&x.decision.buckets) {
                    a.1 += b.1;
                }
                h.count += x.decision.count;
                h.sum += x.decision.sum;
            }
        }
        if h.count <= 0.0 {
            continue;
        }
        let q = |v: f64| {
            h.quantile(v)
                .map_or("-".into(), |s| format!("{:.2}", s * 1e3))
        };
        let _ = writeln!(
            o,
            "| {label} | {:.0} | {} | {} | {} | {} |",
            h.count,
            q(0.5),
            q(0.9),
            q(0.99),
            h.quantile(0.99).map_or("-".into(), |s| format!(
                "{:.1}",
                s * 1e3 * r.plan.time_scale
            )),
        );
    }
}

/// `runs.md`: every run's numbers, per replica, cold start, the load generator.
pub fn render_runs(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# kvrouter benchmark: {} (every run)\n", r.plan.name);
    let _ = writeln!(o, "## Results\n");
    let _ = writeln!(
        o,
        "| workload | rate | policy | seed | order | ok | err | TTFT p50 | p95 | p99 | e2e p50 | p99 | out tok/s | \
         KV hit | queue max | queue mean | preempt | goodput/s | vs bound (mean) | vs fluid bound | split |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(21));
    for run in &r.runs {
        row(&mut o, run);
    }
    let _ = writeln!(
        o,
        "\n*queue* is the replicas' `vllm:num_requests_waiting` (max over replicas and samples; mean \
         of per-replica means). *vs bound*: mean TTFT over the workload's per-request lower bound; \
         *vs fluid bound*: over the bound that also counts the fleet's capacity.\n"
    );
    let _ = writeln!(o, "## Per replica\n");
    let _ = writeln!(o, "| workload | rate | policy | seed | replica | requests | TTFT p50 | queue max | queue mean | in-flight max | preempt | busy s |");
    let _ = writeln!(o, "|{}", "---|".repeat(12));
    for run in &r.runs {
        if let Some(s) = &run.stats {
            for rep in &s.replicas {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {} | {:.0} | {:.1} |",
                    run.workload,
                    run.rate,
                    run.label,
                    run.seed,
                    rep.replica,
                    rep.requests,
                    ms(rep.ttft_p50_ms),
                    rep.max_waiting,
                    rep.mean_waiting,
                    rep.max_in_flight,
                    rep.preemptions,
                    rep.busy_s
                );
            }
        }
    }
    let _ = writeln!(o, "\n## Cold start\n");
    let _ = writeln!(
        o,
        "Every run starts on empty caches. The first fifth of each run's requests (by send time) \
         against the rest (the whole run, warm-up included):\n"
    );
    let _ = writeln!(o, "| workload | rate | policy | seed | KV hit first | KV hit rest | TTFT p50 first | TTFT p50 rest |");
    let _ = writeln!(o, "|{}", "---|".repeat(8));
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0}%", v * 100.0));
    for run in &r.runs {
        if let Some(s) = &run.stats {
            let w = &s.warmup;
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                run.workload,
                run.rate,
                run.label,
                run.seed,
                pct(w.first_hit_rate),
                pct(w.rest_hit_rate),
                ms(w.first_ttft_p50_ms),
                ms(w.rest_ttft_p50_ms)
            );
        }
    }
    let _ = writeln!(o, "\n## Load generator and machine\n");
    let _ = writeln!(o, "| workload | rate | policy | seed | order | real s | bench CPU | replicas CPU | kvrouter CPU | Envoy CPU | late | lag p99 real ms | decision p50 us | p99 us |");
    let _ = writeln!(o, "|{}", "---|".repeat(14));
    for run in r.runs.iter().filter(|r| r.stats.is_some()) {
        let c = &run.cpu;
        let pct = |s: f64| format!("{:.0}%", 100.0 * s / c.wall_s.max(1e-9));
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {:.2} | {} | {} |",
            run.workload,
            run.rate,
            run.label,
            run.seed,
            run.order,
            c.wall_s,
            pct(c.bench_s),
            pct(c.replicas_s),
            pct(c.router_s),
            pct(c.envoy_s),
            run.stats.as_ref().map_or(0, |s| s.late),
            run.stats.as_ref().map_or(0.0, |s| s.lag_p99_real_ms),
            ms(run.decision.quantile(0.5).map(|s| s * 1e6)),
            ms(run.decision.quantile(0.99).map(|s| s * 1e6)),
        );
    }
    let _ = writeln!(
        o,
        "\nCPU as a share of one core over the run's real duration. *late*: requests sent \
         more than 5 real ms after their scheduled time; *lag*: send time minus scheduled time \
         (small values mean the load generator kept its schedule and is not the bottleneck)."
    );
    o
}

fn row(o: &mut String, run: &RunResult) {
    let Some(s) = &run.stats else {
        let why = run.failed.as_deref().unwrap_or("no result");
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | FAILED: {} |{}",
            run.workload,
            run.rate,
            run.label,
            run.seed,
            run.order,
            why.lines().next().unwrap_or("").replace('|', "/"),
            " |".repeat(14)
        );
        return;
    };
    let _ = writeln!(
        o,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {:.0} | {:.1} | {:.0} | {:.2} | {} | {} | {} of {} |",
        run.workload,
        run.rate,
        run.label,
        run.seed,
        run.order,
        s.ok,
        s.errors,
        ms(s.ttft_ms.p50),
        ms(s.ttft_ms.p95),
        ms(s.ttft_ms.p99),
        ms(s.e2e_ms.p50),
        ms(s.e2e_ms.p99),
        s.output_tokens_per_s,
        s.kv_hit_rate.map_or("-".into(), |h| format!("{:.0}%", h * 100.0)),
        s.max_queue,
        s.mean_queue,
        s.preemptions,
        s.goodput_rps,
        x(run.bound.as_ref().and_then(|b| b.mean_ratio)),
        x(run.bound.as_ref().and_then(|b| b.fluid_ratio)),
        s.split_groups,
        s.groups,
    );
}

fn must_show(o: &mut String, r: &Report) {
    let Some(a) = &r.analysis else { return };
    let spec = &r.plan.analysis;
    let _ = writeln!(o, "## Single-run analyses (first seed)\n");
    if let Some(c) = &a.shared_prefix {
        let _ = writeln!(
            o,
            "- **Shared prefix at high load** (`{}` at {} req/s): {} TTFT p90 {} ms vs {} {} ms = \
             **{}** (goal <= 0.05x); vs best other cache-aware {} = **{}** (goal <= 0.5x).",
            c.workload,
            c.rate,
            spec.subject,
            ms(c.subject_p90_ms),
            spec.baseline,
            ms(c.baseline_p90_ms),
            x(c.vs_baseline),
            c.best_cache_aware
                .as_ref()
                .map_or("-".into(), |(l, v)| format!("{l} ({} ms)", ms(Some(*v)))),
            x(c.vs_best_cache_aware)
        );
    }
    if let Some(u) = &a.unique {
        let _ = writeln!(
            o,
            "- **Unique prompts** (`{}`): {} / {} TTFT mean {}, p50 {}, p90 {}: {}.",
            u.workload,
            spec.subject,
            spec.baseline,
            x(u.mean_ratio),
            x(u.p50_ratio),
            x(u.p90_ratio),
            if u.within_5_percent {
                "within 5%"
            } else {
                "NOT within 5% (the honest number)"
            }
        );
    }
    if !a.hot_prefix.is_empty() {
        let yes = |v: Option<bool>| v.map_or("not run", |v| if v { "yes" } else { "no" });
        let _ = writeln!(
            o,
            "- **Hot prefix** (`{}`): {} kept every queue bounded: **{}**; {} ran a queue away: **{}**. A queue runs away when its last-quarter mean is >= {RUNAWAY_MIN_QUEUE} and >= 2x its first-quarter mean.",
            spec.hot_prefix, spec.subject, yes(a.hot_prefix_verdict.0), spec.affinity, yes(a.hot_prefix_verdict.1)
        );
        for q in &a.hot_prefix {
            let _ = writeln!(
                o,
                "  - {}: max queue {:.0} on {}, busiest replica served {:.0}% of requests; runaway: {}; quarters (first->last) {}",
                q.label, q.max_queue, q.max_replica, q.busiest_share * 100.0,
                if q.runaway.is_empty() { "none".to_string() } else { q.runaway.join(", ") },
                q.quarters.iter().map(|(n, f, l)| format!("{n} {f:.1}->{l:.1}")).collect::<Vec<_>>().join(", ")
            );
        }
    }
    if !a.multi_tenant.is_empty() {
        let _ = writeln!(o, "- **Multi-tenant** (`{}`): cross-tenant cache hits (a hit beyond what the tenant's own earlier requests on that replica could provide):", spec.multi_tenant);
        for (label, c) in &a.multi_tenant {
            let _ = writeln!(
                o,
                "  - {label}: **{}** requests ({} tokens) of {} checked hits",
                c.requests, c.tokens, c.checked
            );
        }
    }
    if !a.kill_restart.is_empty() {
        let _ = writeln!(o, "- **Kill/restart** (`{}`):", spec.kill_restart);
        for d in &a.kill_restart {
            let _ = writeln!(
                o,
                "  - {}: {} client-visible errors ({}); TTFT p90 before kill {} ms, while down {} ms, after restart {} ms; recovered {} after the restart.",
                d.label, d.errors,
                if d.error_kinds.is_empty() { "none".into() } else { d.error_kinds.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ") },
                ms(d.before_p90_ms), ms(d.down_p90_ms), ms(d.after_p90_ms),
                d.recovery_ms.map_or("never (within the run)".into(), |v| format!("{} ms", ms(Some(v))))
            );
        }
    }
    for m in &a.missing {
        let _ = writeln!(o, "- not measured: {m}");
    }
    let _ = writeln!(o);
}

fn overhead(o: &mut String, r: &Report) {
    let Some(ov) = &r.overhead else { return };
    let _ = writeln!(o, "\n## Router overhead (real time)\n");
    let _ = writeln!(
        o,
        "{} requests per path, {} closed-loop clients, one replica at time scale {} (near-zero \
         latency), policy `{}`, streamed chat with one output token.\n",
        ov.spec.requests, ov.spec.concurrency, ov.spec.time_scale, ov.spec.policy
    );
    let _ = writeln!(o, "| path | p50 ms | p90 ms | p99 ms | req/s | errors |");
    let _ = writeln!(o, "|---|---|---|---|---|---|");
    for p in &ov.paths {
        let _ = writeln!(
            o,
            "| {} | {:.3} | {:.3} | {:.3} | {:.0} | {} |",
            p.path,
            p.latency_ms.p50.unwrap_or(f64::NAN),
            p.latency_ms.p90.unwrap_or(f64::NAN),
            p.latency_ms.p99.unwrap_or(f64::NAN),
            p.throughput_rps,
            p.errors
        );
    }
    let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
    let _ = writeln!(
        o,
        "\nEnvoy adds p50 {} ms / p99 {} ms over direct; kvrouter adds p50 {} ms / p99 {} ms over \
         Envoy alone (its ext_proc round trip and decision). kvrouter CPU: {:.3} s per 1000 requests.\n",
        f(ov.envoy_added_p50_ms), f(ov.envoy_added_p99_ms), f(ov.router_added_p50_ms), f(ov.router_added_p99_ms),
        ov.router_cpu_s_per_1k
    );
    let _ = writeln!(o, "kvrouter decision time (`kvrouter_decision_duration_seconds`, {} decisions): p50 {} us, p90 {} us, p99 {} us; buckets (upper bound us: count):", ov.decision.count,
        ms(ov.decision.quantile(0.5).map(|s| s * 1e6)), ms(ov.decision.quantile(0.9).map(|s| s * 1e6)), ms(ov.decision.quantile(0.99).map(|s| s * 1e6)));
    let mut prev = 0.0;
    let cells: Vec<String> = ov
        .decision
        .buckets
        .iter()
        .map(|&(le, c)| {
            let n = c - prev;
            prev = c;
            if le.is_infinite() {
                format!("+Inf: {n:.0}")
            } else {
                format!("{}: {n:.0}", le * 1e6)
            }
        })
        .collect();
    let _ = writeln!(o, "`{}`", cells.join(", "));
    let _ = writeln!(
        o,
        "\nIn simulated figures above, the kvrouter + Envoy p50 overhead of about {} real ms appears \
         as about {} ms.",
        f(ov.router_added_p50_ms.zip(ov.envoy_added_p50_ms).map(|(a, b)| a + b)),
        f(ov.router_added_p50_ms.zip(ov.envoy_added_p50_ms).map(|(a, b)| (a + b) * r.plan.time_scale))
    );
}
