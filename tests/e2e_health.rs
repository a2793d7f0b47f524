//! Live load signals and health end to end: real Envoy, kvrouter and simulated replicas with
//! fault injection. A failing replica is ejected with no client-visible failure and rejoins; a
//! replica killed under load loses no request another replica could serve; a replica with a long
//! engine queue (seen only through its scraped metrics) gets less traffic; DNS discovery finds
//! replicas.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use testkit::*;

/// The router's view of the endpoint at `addr` (`/debug/endpoints`).
async fn endpoint(stack: &Stack, addr: SocketAddr) -> serde_json::Value {
    let table = stack.endpoint_table().await;
    table["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .find(|e| e["address"] == addr.to_string())
        .cloned()
        .unwrap_or(serde_json::Value::Null)
}

async fn admin(
    client: &reqwest::Client,
    replica: SocketAddr,
    method: reqwest::Method,
    path: &str,
    body: &str,
) {
    let resp = client
        .request(method, format!("http://{replica}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("admin call");
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
}

/// `text` without terminal colour codes.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// kvrouter's counter `name` for the endpoint at `addr` (summed over its other labels).
async fn counter(admin: SocketAddr, name: &str, addr: SocketAddr) -> f64 {
    router_metrics(admin)
        .await
        .sum_where(name, "endpoint", &addr.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_replica_is_ejected_without_client_errors_and_rejoins_after_recovering() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        router_extra:
            "policy: {name: round-robin}\nhealth: {breaker: {open_ms: 300, max_open_ms: 600}}",
        ..StackOptions::default()
    })
    .await;
    let sick = stack.replicas[0].addr;
    let sick_name = stack.replicas[0].name.clone();
    // Every generation request to r0 gets a 503 (its /health and /metrics stay fine: only
    // request outcomes can catch this).
    admin(
        &stack.client,
        sick,
        reqwest::Method::POST,
        "/admin/fail",
        r#"{"status":503}"#,
    )
    .await;
    for i in 0..30 {
        let r = stack
            .post(
                "/v1/completions",
                completion_body(MODEL, &format!("f{i}"), false, 2),
            )
            .await;
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert_ne!(r.replica.as_deref(), Some(sick_name.as_str()));
    }
    // Envoy reports how many attempts each request took, so the router knows r0 was tried.
    let log = strip_ansi(&std::fs::read_to_string(stack.dir.path().join("kvrouter.log")).unwrap());
    assert!(
        log.lines()
            .any(|l| l.contains("served by another endpoint than the pick")
                && l.contains("attempts=2")
                && l.contains("failed=1")),
        "no attempt count from Envoy in the router's log"
    );
    let ejections = counter(stack.router.admin, "kvrouter_ejections_total", sick).await;
    assert!(ejections >= 1.0, "r0 was ejected by its breaker");
    let decisions_for_sick = counter(stack.router.admin, "kvrouter_decisions_total", sick).await;
    assert!(
        decisions_for_sick < 15.0,
        "an ejected replica stops being picked (round-robin would give it 10 of 30, plus trials): {decisions_for_sick}"
    );

    // Recovery: half-open trials succeed and it takes traffic again.
    admin(
        &stack.client,
        sick,
        reqwest::Method::DELETE,
        "/admin/fail",
        "",
    )
    .await;
    let s = &stack;
    let sick_name = sick_name.as_str();
    let mut i = 0;
    eventually("r0 to serve again", Duration::from_secs(15), move || {
        i += 1;
        let body = completion_body(MODEL, &format!("g{i}"), false, 2);
        async move {
            let r = s.post("/v1/completions", body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            (r.replica.as_deref() == Some(sick_name)).then_some(())
        }
    })
    .await;
    let mut i = 0;
    eventually(
        "r0's breaker to close",
        Duration::from_secs(15),
        move || {
            i += 1;
            let body = completion_body(MODEL, &format!("h{i}"), false, 2);
            async move {
                assert_eq!(s.post("/v1/completions", body).await.status, 200);
                let ep = endpoint(s, sick).await;
                (ep["health"]["breaker"] == "closed" && ep["health"]["routable"] == true)
                    .then_some(())
            }
        },
    )
    .await;
    assert_in_flight_drains(stack.router.admin).await;
}

/// What happened to the clients of a kill test.
#[derive(Debug, Default)]
struct KillReport {
    ok: usize,
    /// Non-streamed requests that failed (status != 200): a retriable request lost.
    failed: Vec<u16>,
    streams_ok: usize,
    /// Streams cut mid-response by the kill (no proxy can retry a started response).
    streams_cut: usize,
    /// Streams that failed before their response started.
    streams_failed: Vec<u16>,
    ejected_after: Option<Duration>,
    /// Envoy's non-zero retry counters for the replica cluster.
    envoy_retry_stats: Vec<String>,
}

/// Runs non-streamed and streamed clients against a 3-replica stack, SIGKILLs one replica under
/// load, and reports what the clients saw and how long the router took to eject it.
async fn kill_under_load(router_extra: &'static str) -> KillReport {
    let mut stack = Stack::start(StackOptions {
        replicas: 3,
        router_extra,
        ..StackOptions::default()
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (client, addr, stop) = (stack.client.clone(), stack.envoy.addr, Arc::clone(&stop));
        let stream = w >= 6; // 6 non-streamed clients, 2 streamed
        workers.push(tokio::spawn(async move {
            let mut seen: Vec<(bool, u16, bool)> = Vec::new(); // (stream, status, complete)
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let body = chat_body(MODEL, &format!("worker {w} request {i}"), stream, 20);
                let sent = client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                let Ok(resp) = sent else {
                    seen.push((stream, 0, false));
                    continue;
                };
                let status = resp.status().as_u16();
                let text = resp.text().await.unwrap_or_default();
                let complete = if stream {
                    text.trim_end().ends_with("data: [DONE]")
                } else {
                    text.contains("\"usage\"")
                };
                seen.push((stream, status, complete));
            }
            seen
        }));
    }
    let victim = stack.replicas[1].addr;
    let admin = stack.router.admin;
    // Let traffic reach every replica, then kill one.
    eventually(
        "traffic on the victim",
        Duration::from_secs(15),
        || async move {
            (counter(admin, "kvrouter_decisions_total", victim).await >= 3.0).then_some(())
        },
    )
    .await;
    stack.replicas[1].kill();
    let killed_at = Instant::now();
    let mut report = KillReport::default();
    let deadline = killed_at + Duration::from_secs(20);
    while Instant::now() < deadline {
        let ep = endpoint(&stack, victim).await;
        if ep["health"]["routable"] == false {
            report.ejected_after = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Keep the load on after the ejection until the survivors have taken 50 more decisions;
    // the ejected replica must get none of them.
    let picked_at_ejection = counter(admin, "kvrouter_decisions_total", victim).await;
    let total_at_ejection = metric_sum(admin, "kvrouter_decisions_total").await;
    eventually(
        "50 more decisions after the ejection",
        Duration::from_secs(20),
        || async move {
            let total = metric_sum(admin, "kvrouter_decisions_total").await;
            (total >= total_at_ejection + 50.0).then_some(())
        },
    )
    .await;
    let picked_after = counter(admin, "kvrouter_decisions_total", victim).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        for (stream, status, complete) in w.await.unwrap() {
            match (stream, status, complete) {
                (false, 200, true) => report.ok += 1,
                (false, s, _) => report.failed.push(s),
                (true, 200, true) => report.streams_ok += 1,
                (true, 200, false) => report.streams_cut += 1,
                (true, s, _) => report.streams_failed.push(s),
            }
        }
    }
    let stats = stack
        .client
        .get(format!(
            "http://{}/stats?filter=upstream_rq_retry",
            stack.envoy.admin
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    report.envoy_retry_stats = stats
        .lines()
        .filter(|l| l.starts_with("cluster.llm_replicas.") && !l.ends_with(": 0"))
        .map(str::to_string)
        .collect();
    assert!(
        report.ejected_after.is_some(),
        "the dead replica was never ejected: {report:?}"
    );
    assert_eq!(
        picked_after, picked_at_ejection,
        "no request is routed to an ejected replica"
    );
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_load_loses_no_retriable_request() {
    let report = kill_under_load("").await;
    eprintln!("kill test (defaults): {report:?}");
    assert!(report.ok > 20, "{report:?}");
    assert_eq!(
        report.failed,
        Vec::<u16>::new(),
        "every non-streamed request was served (Envoy retried those the dead replica had): {report:?}"
    );
    assert!(report.streams_failed.is_empty(), "{report:?}");
    assert!(report.streams_ok > 0, "{report:?}");
    // Streams the dead replica was sending when it died are cut; no proxy can retry a response
    // that has started. There are at most as many as streaming clients.
    assert!(report.streams_cut <= 2, "{report:?}");
}

/// The kill test under each detector alone, for the report (slow: run with `--ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check: cargo test --test e2e_health -- --ignored --nocapture"]
async fn time_to_ejection_per_detector() {
    for (name, extra) in [
        ("all detectors (default)", ""),
        (
            "scrape only (50 ms interval, 3 failures)",
            "health: {probe: {enabled: false}, breaker: {enabled: false}}",
        ),
        (
            "probe only (1 s interval, 3 failures)",
            "load: {scrape: {enabled: false}}\nhealth: {breaker: {enabled: false}}",
        ),
        (
            "passive only (breaker, 3 failures)",
            "load: {scrape: {enabled: false}}\nhealth: {probe: {enabled: false}}",
        ),
    ] {
        let r = kill_under_load(extra).await;
        eprintln!(
            "{name}: ejected after {:?}; non-streamed ok {} failed {}; streams ok {} cut {} failed {}; envoy {:?}",
            r.ejected_after,
            r.ok,
            r.failed.len(),
            r.streams_ok,
            r.streams_cut,
            r.streams_failed.len(),
            r.envoy_retry_stats
        );
    }
}

fn hot_prefix_body(question: &str, max_tokens: u32, stream: bool) -> String {
    let system = "You are the support desk of a parcel company; be precise and cite tracking ids. "
        .repeat(40);
    serde_json::json!({
        "model": MODEL, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_long_scraped_queue_receives_less_traffic() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        // Two batch slots per replica, so a few long requests make a queue.
        replica_flags: &["--max-num-seqs", "2"],
        ..StackOptions::default()
    })
    .await;
    // The hot prefix lands somewhere: that replica now holds it.
    let first = stack
        .post("/v1/chat/completions", hot_prefix_body("first", 2, false))
        .await;
    assert_eq!(first.status, 200);
    let holder_name = first.replica.expect("replica header");
    let holder = stack
        .replicas
        .iter()
        .find(|r| r.name == holder_name)
        .unwrap()
        .addr;
    // Traffic the router never sees (another gateway, a batch job) fills the holder's engine:
    // 2 running, 6 waiting, for tens of seconds.
    let mut bypass = Vec::new();
    for i in 0..8 {
        let client = stack.client.clone();
        bypass.push(tokio::spawn(async move {
            post(
                &client,
                holder,
                "/v1/chat/completions",
                chat_body(MODEL, &format!("bypass {i}"), true, 3000),
            )
            .await
        }));
    }
    let s = &stack;
    eventually(
        "the holder's queue to be scraped",
        Duration::from_secs(15),
        || {
            let stack = s;
            async move {
                let ep = endpoint(stack, holder).await;
                (ep["engine"]["waiting_requests"].as_u64()? >= 5 && ep["engine_signal"] == "fresh")
                    .then_some(())
            }
        },
    )
    .await;
    // The router's own count for the holder is 0: without the scraped queue, predicted-ttft
    // would send the hot prefix straight back to it. /debug/explain shows why it does not.
    let explain = stack.explain(&hot_prefix_body("explain", 2, false)).await;
    let row = candidate_row(&explain, holder);
    assert!(row["matched_tokens"].as_u64().unwrap() > 0, "{row}");
    // Its predicted TTFT carries the hidden queue (100 ms per request the router did not
    // route there), so it ranks below the idle replicas.
    let waiting = row["engine_waiting_requests"].as_u64().unwrap();
    assert!(waiting >= 5, "{row}");
    assert!(
        row["predicted_ttft_ms"].as_f64().unwrap() >= 100.0 * waiting as f64,
        "hidden queue priced: {row}"
    );
    assert_ne!(row["rank"], 0, "{row}");
    assert_ne!(explain["pick"], holder.to_string(), "{explain}");

    let mut counts: HashMap<String, usize> = HashMap::new();
    for i in 0..20 {
        let r = stack
            .post(
                "/v1/chat/completions",
                hot_prefix_body(&format!("q{i}"), 2, false),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        *counts.entry(r.replica.unwrap()).or_default() += 1;
    }
    let on_holder = counts.get(&holder_name).copied().unwrap_or(0);
    assert!(
        on_holder <= 2,
        "the queued holder gets (almost) nothing while its queue lasts: {counts:?}"
    );

    // Scraping off (hot reload): the router is blind to the queue again.
    let addrs: Vec<SocketAddr> = stack.replicas.iter().map(|r| r.addr).collect();
    stack
        .reconfigure(&addrs, "load: {scrape: {enabled: false}}")
        .await;
    let explain = stack.explain(&hot_prefix_body("explain", 2, false)).await;
    // The other replicas that took the hot prefix hold it too now: the holder is predicted
    // as fast as the best of them (its queue unseen), where it was far behind before.
    let best = explain["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["predicted_ttft_ms"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    let row = candidate_row(&explain, holder);
    assert_eq!(
        row["predicted_ttft_ms"].as_f64().unwrap(),
        best,
        "{explain}"
    );
    for t in bypass {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_finds_replicas_and_dead_addresses_are_ejected() {
    let dir = tempfile::tempdir().unwrap();
    let replica = start_replica(dir.path(), ReplicaSpec::new("r0"));
    // `localhost` may also resolve to ::1, where nothing listens: that address must be ejected
    // by the health checks, not break routing.
    let yaml = format!(
        "server:\n  reload_interval_ms: 50\nenvoy:\n  eds_path: {eds}\n\
         pools:\n  - name: dns\n    models: [{MODEL}]\n    dns: {{name: localhost, port: {port}, refresh_ms: 500}}\n",
        eds = dir.path().join("eds.json").display(),
        port = replica.addr.port()
    );
    let router = start_router(dir.path(), &yaml);
    let client = reqwest::Client::new();
    let table = || {
        let client = client.clone();
        async move {
            client
                .get(format!("http://{}/debug/endpoints", router.admin))
                .send()
                .await
                .ok()?
                .json::<serde_json::Value>()
                .await
                .ok()
        }
    };
    let discovered: Vec<SocketAddr> =
        eventually("DNS discovery", Duration::from_secs(15), || async {
            let t = table().await?;
            let addrs: Vec<SocketAddr> = t["endpoints"]
                .as_array()?
                .iter()
                .filter_map(|e| e["address"].as_str()?.parse().ok())
                .collect();
            addrs.contains(&replica.addr).then_some(addrs)
        })
        .await;
    let t = table().await.unwrap();
    assert!(t["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["source"] == "dns:dns"));
    let others: Vec<SocketAddr> = discovered
        .iter()
        .copied()
        .filter(|a| *a != replica.addr)
        .collect();
    eventually(
        "dead addresses ejected, the live one fresh",
        Duration::from_secs(15),
        || async {
            let t = table().await?;
            let eps = t["endpoints"].as_array()?;
            let listed = eps.iter().any(|e| e["address"] == replica.addr.to_string());
            let ok = listed
                && eps.iter().all(|e| {
                    let live = e["address"] == replica.addr.to_string();
                    if live {
                        e["engine_signal"] == "fresh" && e["health"]["routable"] == true
                    } else {
                        e["health"]["routable"] == false
                    }
                });
            ok.then_some(())
        },
    )
    .await;
    let envoy_yaml = envoy_yaml(
        &router,
        dir.path(),
        kvrouter::envoyconf::ClusterStyle::OverrideHost,
        kvrouter::envoyconf::BodyMode::Buffered,
        None,
    );
    let envoy = start_envoy(dir.path(), &envoy_yaml).await;
    envoy.wait_for_hosts(&discovered).await.unwrap();
    for i in 0..5 {
        let r = post(
            &client,
            envoy.addr,
            "/v1/completions",
            completion_body(MODEL, &format!("d{i}"), false, 1),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.replica.as_deref(), Some("r0"));
    }
    eprintln!("discovered {discovered:?}; dead ones ejected: {others:?}");
}
