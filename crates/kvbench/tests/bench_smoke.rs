//! The benchmark tool end to end on tiny plans: real kvsim replicas, kvrouter and Envoy on
//! loopback, two policies on one trace, a policy kvrouter does not know (its run fails, the
//! bench goes on), conversation turns with answers of varying length, requests that bypass the
//! router, a replica killed and restarted, the multi-tenant check with and without
//! `cache_salt`, and the report files (goals, verdicts, SVG and PNG plots); then two routers
//! behind one Envoy replaying a Mooncake-format trace on two seeds.
//! Seconds, not a benchmark: nothing here asserts a latency.

use std::path::PathBuf;

use kvbench::plan::{PolicySpec, Shape, TraceSpec, WorkloadSpec};
use kvbench::{run_plan, Plan, SuiteOptions};

fn options(out: PathBuf) -> SuiteOptions {
    SuiteOptions {
        binaries: testkit::binaries(),
        tokenizers_dir: PathBuf::from("/nonexistent"),
        out_dir: out,
        progress: false,
        workloads: Vec::new(),
        policies: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_plan_runs_every_policy_and_reports() {
    let mut plan = Plan::load("smoke").unwrap();
    plan.tokenizer = testkit::shared_fixture().display().to_string();
    plan.policies.push(PolicySpec {
        policy: "no-such-policy".into(),
        ..PolicySpec::default()
    });
    // The default policy on the engines' KV events, as the quick plan runs it: the replicas
    // publish, the generated config connects kvrouter to them.
    plan.policies.push(PolicySpec {
        label: "predicted-ttft+events".into(),
        policy: "predicted-ttft".into(),
        kv_events: true,
        endpoint_yaml: Some(
            serde_norway::from_str(r#"{kv_events: {connect: "{kv_events}"}}"#).unwrap(),
        ),
        ..PolicySpec::default()
    });
    // The negative control: the same multi-tenant workload without cache_salt.
    let mut leaky = plan
        .workloads
        .iter()
        .find(|w| w.name == "multi-tenant")
        .unwrap()
        .clone();
    leaky.name = "multi-tenant-unsalted".into();
    if let Shape::MultiTenant(s) = &mut leaky.shape {
        s.cache_salt = false;
    }
    plan.workloads.push(leaky);
    let out = tempfile::tempdir().unwrap();
    let mut report = run_plan(&plan, &options(out.path().to_path_buf()))
        .await
        .unwrap();
    report.finish(out.path()).unwrap();

    // One run per workload and policy label, each at the workload's one rate: 5 workloads
    // (the preset's 4 and the unsalted control) x 4 policies (the preset's 2, the unknown one,
    // predicted-ttft on events).
    assert_eq!(report.runs.len(), 5 * 4, "{} runs", report.runs.len());
    let run_of = |w: &str, label: &str| {
        let runs: Vec<_> = report
            .runs
            .iter()
            .filter(|r| r.workload == w && r.label == label)
            .collect();
        assert_eq!(runs.len(), 1, "{w}/{label}: {} runs", runs.len());
        runs[0]
    };
    for w in [
        "shared-prefix",
        "multi-tenant",
        "multi-tenant-unsalted",
        "multi-turn",
    ] {
        for label in ["round-robin", "least-loaded", "predicted-ttft+events"] {
            let run = run_of(w, label);
            assert!(run.failed.is_none(), "{w}/{label}: {:?}", run.failed);
            let s = run.stats.as_ref().unwrap();
            assert_eq!(s.requests, run.records.len());
            assert_eq!(s.errors, 0, "{w}/{label}: {:?}", s.error_kinds);
            assert!(!run.records.is_empty(), "{w}/{label}: no requests");
            assert!(run
                .records
                .iter()
                .all(|r| r.replica.is_some() && r.prompt_tokens.is_some()));
            assert_eq!(
                run.token_mismatches, 0,
                "engine token counts agree with the replicas'"
            );
            assert!(!run.samples.is_empty(), "replica metrics were scraped");
            // Every request the router saw was decided (bypassing ones never reach it).
            assert!(
                run.decision.count >= (s.requests - s.bypassed) as f64,
                "router decisions counted"
            );
        }
        let unknown = run_of(w, "no-such-policy");
        let why = unknown.failed.as_deref().unwrap_or("");
        assert!(why.contains("kvrouter rejected the config"), "{why}");
    }
    // The events run really ran the shared prefixes: their blocks were found cached.
    let events_hits = run_of("shared-prefix", "predicted-ttft+events")
        .stats
        .as_ref()
        .and_then(|s| s.kv_hit_rate)
        .unwrap();
    assert!(events_hits > 0.3, "hit rate {events_hits}");

    // Later turns resend the conversation: they find its earlier blocks cached.
    let turns = run_of("multi-turn", "least-loaded");
    assert_eq!(turns.records.len(), 9);
    assert!(turns.stats.as_ref().unwrap().kv_hit_rate.unwrap() > 0.3);

    // Kill and restart: both done, every request accounted for, the disturbance computed.
    let killed = run_of("kill-restart", "least-loaded");
    assert!(killed.failed.is_none(), "{:?}", killed.failed);
    let outcomes: Vec<&str> = killed.events.iter().map(|e| e.outcome.as_str()).collect();
    assert_eq!(outcomes, ["ok", "ok"], "{:?}", killed.events);
    assert_eq!(killed.records.len(), 16);
    let analysis = report.analysis.as_ref().unwrap();
    assert!(
        analysis
            .kill_restart
            .iter()
            .any(|d| d.label == "least-loaded"),
        "{:?}",
        analysis.kill_restart
    );

    // Identical traces: the same prompts reached the replicas under both policies.
    let tokens = |label: &str| -> Vec<Option<u64>> {
        let run = run_of("shared-prefix", label);
        run.records.iter().map(|r| r.prompt_tokens).collect()
    };
    assert_eq!(tokens("round-robin"), tokens("least-loaded"));

    let hits = |w: &str| -> usize {
        let ran: Vec<_> = report
            .runs
            .iter()
            .filter(|r| r.workload == w && r.failed.is_none())
            .collect();
        assert_eq!(ran.len(), 3, "{w}: every known policy ran");
        ran.iter()
            .map(|r| r.cross_tenant.as_ref().expect("tenant check ran").requests)
            .sum()
    };
    assert_eq!(hits("multi-tenant"), 0, "cache_salt isolates tenants");
    assert!(
        hits("multi-tenant-unsalted") > 0,
        "without cache_salt the check finds sharing"
    );

    // Every run on the plan's one seed; the router's clock scaled to the replicas' (the
    // scrape interval held at kvrouter's floor at this scale, and said so).
    let seed = plan.seed_list()[0];
    assert!(report.runs.iter().all(|r| r.seed == seed));
    let scaled = &run_of("shared-prefix", "least-loaded").router_time;
    assert!(
        scaled
            .iter()
            .any(|f| f.path == "load.scrape.interval_ms" && f.floored),
        "{scaled:?}"
    );
    assert!(scaled.iter().any(|f| f.path == "load.scrape.staleness_ms"));

    // A quarter of the shared-prefix requests went straight to a replica, and were answered.
    let direct: Vec<_> = run_of("shared-prefix", "round-robin")
        .records
        .iter()
        .filter(|r| r.bypassed)
        .collect();
    assert!(!direct.is_empty(), "some requests bypassed the router");
    assert!(direct.iter().all(|r| r.ok() && r.replica.is_some()));

    for f in ["results.json", "summary.json", "report.md", "runs.md"] {
        assert!(out.path().join(f).is_file(), "{f}");
    }
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    assert!(md.contains("## Goals"), "{md}");
    assert!(md.contains("| shared-prefix | 4 | 1 | TTFT p90 | "), "{md}");
    assert!(
        md.contains("| no-such-policy | FAILED on every seed |"),
        "{md}"
    );
    let runs_md = std::fs::read_to_string(out.path().join("runs.md")).unwrap();
    assert!(
        runs_md.contains("FAILED: kvrouter rejected the config"),
        "{runs_md}"
    );
    let plots: Vec<String> = std::fs::read_dir(out.path().join("plots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let svg = plots.iter().filter(|p| p.ends_with(".svg")).count();
    let png = plots.iter().filter(|p| p.ends_with(".png")).count();
    assert!(svg >= 4 && png == svg, "{plots:?}");
}

/// Four prefix roots of three 64-token blocks, each request adding a block of its own.
fn write_trace(path: &std::path::Path) {
    let mut lines = String::new();
    for i in 0..16u64 {
        let root = i % 4;
        let ids = [root * 10, root * 10 + 1, root * 10 + 2, 1000 + i];
        lines.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 4, \"hash_ids\": {:?}}}\n",
            i * 150,
            3 * 64 + 20 + i,
            ids
        ));
    }
    std::fs::write(path, lines).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_replay_a_trace_on_two_seeds() {
    let out = tempfile::tempdir().unwrap();
    let trace = out.path().join("trace.jsonl");
    write_trace(&trace);
    let mut plan = Plan::load("smoke").unwrap();
    plan.tokenizer = testkit::shared_fixture().display().to_string();
    plan.seeds = 2;
    plan.routers = 2;
    plan.workloads = vec![WorkloadSpec {
        name: "trace".into(),
        shape: Shape::Trace(TraceSpec {
            path: trace.display().to_string(),
            duration_s: 60.0,
            block_tokens: 64,
            ..TraceSpec::default()
        }),
        ..WorkloadSpec::default()
    }];
    plan.analysis.subject = "least-loaded".into();
    plan.analysis.replay = "trace".into();
    plan.analysis.shared_prefix.clear();
    plan.analysis.multi_tenant.clear();
    plan.analysis.kill_restart.clear();
    let mut report = run_plan(&plan, &options(out.path().to_path_buf()))
        .await
        .unwrap();
    report.finish(out.path()).unwrap();

    // Two seeds x two policies, on the same trace shape.
    assert_eq!(report.runs.len(), 4);
    let seeds: std::collections::BTreeSet<u64> = report.runs.iter().map(|r| r.seed).collect();
    assert_eq!(seeds.len(), 2);
    // The text blocks reproduce the trace's sharing in the engine's own block hashes.
    assert_eq!(report.workloads.len(), 2, "one per seed");
    for w in &report.workloads {
        let c = w.sharing.as_ref().expect("sharing checked");
        assert_eq!((c.requests, c.agree), (16, 16), "{c:?}");
        assert!(c.engine_shared_tokens > 0);
    }
    for run in &report.runs {
        assert!(run.failed.is_none(), "{:?}", run.failed);
        let s = run.stats.as_ref().unwrap();
        assert_eq!((s.requests, s.errors), (16, 0), "{:?}", s.error_kinds);
        assert!(s.kv_hit_rate.unwrap() > 0.2, "{:?}", s.kv_hit_rate);
        // Both routers decided, and every decision was matched to its trace request.
        let d = run
            .divergence
            .as_ref()
            .expect("two routers: divergence measured");
        assert_eq!(d.routers, 2);
        assert_eq!(d.unmatched, 0, "{d:?}");
        assert_eq!(d.per_router.iter().sum::<usize>(), 16, "{d:?}");
        assert!(d.per_router.iter().all(|&n| n > 0), "{d:?}");
    }
    let cell = &report.cells[0];
    assert_eq!(cell.seeds.len(), 2);
    assert_eq!(cell.policies.len(), 2);
    assert!(!cell.verdicts.is_empty());
    assert!(
        report
            .goals
            .iter()
            .any(|g| g.goal.starts_with("trace replay")
                && g.detail.contains("least-loaded/round-robin")),
        "{:?}",
        report.goals
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_plan_records_objectives_and_sheds_only_sheddable_work_with_retry_after() {
    // The flow preset's shape, made tiny: one slow replica far past its capacity (about four
    // 500-token prefills a simulated second against 40 arrivals), a short queue bound.
    let mut plan = Plan::load("flow").unwrap();
    plan.tokenizer = testkit::shared_fixture().display().to_string();
    plan.seeds = 1;
    plan.seed_set = kvbench::plan::SeedSet::Tuning;
    plan.bootstrap_resamples = 100;
    plan.time_scale = 5.0;
    plan.drain_timeout_s = 60;
    plan.fleet = serde_norway::from_str("[{count: 1, profile: l4-llama3-8b}]").unwrap();
    // Off against the predicted room with a short bound, as the plan has it: nothing in its
    // room is sized for this fleet.
    plan.policies
        .retain(|p| p.label == "flow-off" || p.label == "flow-on-500");
    plan.analysis.subject = "flow-on-500".into();
    plan.analysis.flow.as_mut().unwrap().on = vec!["flow-on-500".into()];
    for w in &mut plan.workloads {
        if let Shape::FlowMix(s) = &mut w.shape {
            s.prompt_tokens = 500;
        }
        w.output_tokens = kvbench::plan::OutputLen::Fixed(4);
        let (rate, requests) = if w.name == "overload" {
            (40.0, 60)
        } else {
            (1.0, 8)
        };
        w.rate = rate;
        w.requests = Some(requests);
    }
    let out = tempfile::tempdir().unwrap();
    let mut report = run_plan(&plan, &options(out.path().to_path_buf()))
        .await
        .unwrap();
    report.finish(out.path()).unwrap();

    assert_eq!(report.runs.len(), 2 * 2, "two arms x two workloads");
    for run in &report.runs {
        assert!(run.failed.is_none(), "{}: {:?}", run.label, run.failed);
        // One record per request sent, so the checks below cannot pass on none.
        let sent = if run.workload == "overload" { 60 } else { 8 };
        assert_eq!(run.records.len(), sent, "{} {}", run.label, run.workload);
        for r in &run.records {
            // Every request carries its objective and tenant, and ends in an answer or an
            // explicit refusal: nothing is lost silently.
            assert!(r.objective.is_some() && r.tenant.is_some(), "{r:?}");
            let refused = matches!(r.status, 429 | 503) && r.retry_after.is_some();
            assert!(r.ok() || refused, "{}: {r:?}", run.label);
        }
    }
    let overload = |label: &str| {
        report
            .runs
            .iter()
            .find(|r| r.label == label && r.workload == "overload")
            .unwrap()
    };
    // Off: nothing is refused, every request waits in the engine.
    assert!(overload("flow-off").records.iter().all(|r| r.ok()));
    // On: sheddable requests are turned away with 429 and retry-after; critical ones never get a
    // 429.
    let on = overload("flow-on-500");
    let shed: Vec<_> = on.records.iter().filter(|r| r.status == 429).collect();
    assert!(!shed.is_empty(), "no 429 under overload");
    assert!(shed
        .iter()
        .all(|r| r.objective.as_deref() == Some("sheddable")
            && r.retry_after.as_deref() == Some("1")));
    let critical: Vec<_> = on
        .records
        .iter()
        .filter(|r| r.objective.as_deref() == Some("critical"))
        .collect();
    assert!(!critical.is_empty(), "no critical request in the overload");
    assert!(critical.iter().all(|r| r.status != 429), "{critical:?}");
    // The comparison is computed and reported.
    assert_eq!(report.flow.len(), 1);
    let f = &report.flow[0];
    assert!(f.missing.is_none(), "{:?}", f.missing);
    let row = |name: &str| f.rows.iter().find(|r| r.figure.starts_with(name)).unwrap();
    assert!(row("sheddable answered 429").on.median.unwrap() > 0.0);
    assert_eq!(row("sheddable answered 429").off.median, Some(0.0));
    assert_eq!(row("lost silently").on.median, Some(0.0));
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    assert!(md.contains("## Flow control: `flow-on-500` against `flow-off`"));
}
