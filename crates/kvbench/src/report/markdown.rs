//! `report.md`: the summary table per workload x policy, the "must show" section, the
//! workloads and the router overhead, with links to the plots.

use std::fmt::Write as _;

use super::Report;
use crate::analysis::RUNAWAY_MIN_QUEUE;
use crate::results::RunResult;

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
    let _ = writeln!(o, "# kvrouter benchmark: {}\n", p.name);
    let _ = writeln!(
        o,
        "Plan `{}`, seed {}, tokenizer `{}`, time scale {}x on {} CPUs. Times are **simulated** ms \
         (real time x {}); router and Envoy overhead is real time and therefore inflated {}x in \
         them (see *Router overhead*). Goodput counts answers with TTFT <= {} ms. Reproduce: \
         `kvbench run --plan <plan> --out DIR` (`make bench`).\n",
        p.name, p.seed, p.tokenizer, p.time_scale, r.cpus, p.time_scale, p.time_scale, p.slo_ttft_ms
    );
    must_show(&mut o, r);
    let _ = writeln!(o, "## Results\n");
    let _ = writeln!(
        o,
        "| workload | rate | policy | ok | err | TTFT p50 | p95 | p99 | e2e p50 | p99 | out tok/s | \
         KV hit | queue max | queue mean | preempt | goodput/s | vs bound (mean) |"
    );
    let _ = writeln!(o, "|{}", "---|".repeat(17));
    for run in &r.runs {
        row(&mut o, run);
    }
    let _ = writeln!(
        o,
        "\n*queue* is the replicas' `vllm:num_requests_waiting` (max over replicas and samples; mean \
         of per-replica means). *vs bound*: mean TTFT over the workload's lower bound (every \
         request pays only the prefill of tokens no earlier request could have cached, on an idle \
         replica of the fleet's fastest profile).\n"
    );
    let _ = writeln!(o, "## Workloads\n");
    for w in &r.workloads {
        let _ = writeln!(
            o,
            "- **{}** ({}, {} req/s, {} requests, time scale {}{}): {}; lower bound TTFT mean {} ms, p90 {} ms on {}.",
            w.name,
            w.kind,
            w.rate,
            w.requests,
            w.time_scale,
            if w.events > 0 { format!(", {} scenario events", w.events) } else { String::new() },
            w.notes.join("; "),
            ms(Some(w.bound_mean_ms)),
            ms(Some(w.bound_p90_ms)),
            w.bound_profile
        );
    }
    let _ = writeln!(o, "\n## Per replica\n");
    let _ = writeln!(o, "| workload | rate | policy | replica | requests | TTFT p50 | queue max | queue mean | in-flight max | preempt |");
    let _ = writeln!(o, "|{}", "---|".repeat(10));
    for run in &r.runs {
        if let Some(s) = &run.stats {
            for rep in &s.replicas {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {} | {:.0} |",
                    run.workload,
                    run.rate,
                    run.label,
                    rep.replica,
                    rep.requests,
                    ms(rep.ttft_p50_ms),
                    rep.max_waiting,
                    rep.mean_waiting,
                    rep.max_in_flight,
                    rep.preemptions
                );
            }
        }
    }
    let _ = writeln!(o, "\n## Cold start\n");
    let _ = writeln!(
        o,
        "Every run starts on empty caches. The first fifth of each run's requests (by send time) \
         against the rest:\n"
    );
    let _ = writeln!(o, "| workload | rate | policy | KV hit first | KV hit rest | TTFT p50 first | TTFT p50 rest |");
    let _ = writeln!(o, "|{}", "---|".repeat(7));
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0}%", v * 100.0));
    for run in &r.runs {
        if let Some(s) = &run.stats {
            let w = &s.warmup;
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} |",
                run.workload,
                run.rate,
                run.label,
                pct(w.first_hit_rate),
                pct(w.rest_hit_rate),
                ms(w.first_ttft_p50_ms),
                ms(w.rest_ttft_p50_ms)
            );
        }
    }
    let _ = writeln!(o, "\n## Load generator and machine\n");
    let _ = writeln!(o, "| workload | rate | policy | real s | bench CPU | replicas CPU | kvrouter CPU | Envoy CPU | late | lag p99 real ms | decision p50 us | p99 us |");
    let _ = writeln!(o, "|{}", "---|".repeat(12));
    for run in r.runs.iter().filter(|r| r.stats.is_some()) {
        let c = &run.cpu;
        let pct = |s: f64| format!("{:.0}%", 100.0 * s / c.wall_s.max(1e-9));
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {:.2} | {} | {} |",
            run.workload,
            run.rate,
            run.label,
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
    overhead(&mut o, r);
    if !plots.is_empty() {
        let _ = writeln!(o, "\n## Plots\n");
        for p in plots {
            let _ = writeln!(o, "![{p}]({p})\n");
        }
    }
    o
}

fn row(o: &mut String, run: &RunResult) {
    let Some(s) = &run.stats else {
        let why = run.failed.as_deref().unwrap_or("no result");
        let _ = writeln!(
            o,
            "| {} | {} | {} | FAILED: {} |{}",
            run.workload,
            run.rate,
            run.label,
            why.lines().next().unwrap_or("").replace('|', "/"),
            " |".repeat(13)
        );
        return;
    };
    let _ = writeln!(
        o,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {:.0} | {:.1} | {:.0} | {:.2} | {} |",
        run.workload,
        run.rate,
        run.label,
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
    );
}

fn must_show(o: &mut String, r: &Report) {
    let Some(a) = &r.analysis else { return };
    let spec = &r.plan.analysis;
    let _ = writeln!(o, "## Summary (must show)\n");
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
