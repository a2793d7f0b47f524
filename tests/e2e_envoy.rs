//! End to end through the real Envoy 1.40: simulated replicas, kvrouter, Envoy, real HTTP.

use std::collections::HashMap;
use std::time::Duration;

use kvrouter::envoyconf::{BodyMode, ClusterStyle};
use testkit::*;

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The concatenated generated text of a chat or completion response (SSE or JSON).
fn generated_text(reply: &Reply) -> String {
    if reply
        .content_type
        .as_deref()
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        sse_events(&reply.body)
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| {
                let v = json(e);
                let c = &v["choices"][0];
                c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or("")
                    .to_string()
            })
            .collect()
    } else {
        let v = json(&reply.body);
        let c = &v["choices"][0];
        c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .expect("generated text")
            .to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_pass_through_envoy_intact() {
    let stack = Stack::start(StackOptions::default()).await;
    for (path, body) in [
        ("/v1/chat/completions", chat_body(MODEL, "hello", false, 5)),
        (
            "/v1/completions",
            completion_body(MODEL, "once upon a time", false, 5),
        ),
        ("/v1/chat/completions", chat_body(MODEL, "hello", true, 7)),
        (
            "/v1/completions",
            completion_body(MODEL, "once upon a time", true, 7),
        ),
    ] {
        let r = stack.post(path, body.clone()).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        // Envoy reports where it went, and that replica says it served it.
        let upstream = r.upstream.as_deref().expect("x-kvrouter-upstream");
        assert_eq!(stack.name_of(upstream), r.replica.as_deref(), "{r:?}");
        // The same request sent straight to that replica generates the same text: Envoy and the
        // router passed the stream through unchanged.
        let replica = stack
            .replicas
            .iter()
            .find(|x| x.addr.to_string() == upstream)
            .unwrap();
        let direct = post(&stack.client, replica.addr, path, body).await;
        assert_eq!(generated_text(&r), generated_text(&direct), "{path}");
        assert_eq!(r.content_type, direct.content_type);
        if r.content_type
            .as_deref()
            .unwrap()
            .starts_with("text/event-stream")
        {
            assert_complete_stream(&r.body, 7);
        } else {
            assert_eq!(json(&r.body)["usage"]["completion_tokens"], 5);
        }
    }
    // A request without a body goes to some replica.
    let models = stack
        .client
        .get(format!("http://{}/v1/models", stack.envoy.addr))
        .send()
        .await
        .expect("models");
    let models = reply(models).await;
    assert_eq!(models.status, 200);
    assert_eq!(json(&models.body)["data"][0]["id"], MODEL);
    assert!(models.replica.is_some());
    assert_in_flight_drains(stack.router.admin).await;
    let metrics = router_metrics(stack.router.admin).await;
    let decisions: Vec<&Series> = metrics.named("kvrouter_decisions_total").collect();
    let total: f64 = decisions.iter().map(|s| s.value).sum();
    assert_eq!(total, 5.0, "{decisions:?}");
    // Each request had a picker stream and an observer stream (Envoy's observability-mode
    // filter) that watched the response to its first byte.
    let admin = stack.router.admin;
    eventually(
        "observer streams to end",
        Duration::from_secs(10),
        || async move {
            let m = router_metrics(admin).await;
            let count = |o: &str| m.sum_where("kvrouter_streams_ended_total", "outcome", o);
            (count("routed") == 5.0 && count("complete") == 5.0).then_some(())
        },
    )
    .await;
}

/// kvrouter beside Envoy on one host or in one pod: Envoy's config names only kvrouter's Unix
/// socket (`server.grpc_unix_socket`, `envoy-config --extproc unix:PATH`), and kvrouter routes
/// every request through it, observer streams included.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reaches_kvrouter_over_its_unix_socket() {
    use std::os::unix::fs::FileTypeExt;
    let stack = Stack::start(StackOptions {
        unix_socket: true,
        ..Default::default()
    })
    .await;
    let path = stack
        .router
        .grpc_unix
        .clone()
        .expect("the socket kvrouter announced");
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket(), "{}", path.display());
    for i in 0..4 {
        let body = chat_body(MODEL, &format!("hello over a socket {i}"), i % 2 == 0, 5);
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let upstream = r.upstream.as_deref().expect("x-kvrouter-upstream");
        assert_eq!(stack.name_of(upstream), r.replica.as_deref(), "{r:?}");
    }
    let admin = stack.router.admin;
    eventually(
        "four routed picker streams and observer streams over the socket",
        Duration::from_secs(10),
        || async move {
            let m = router_metrics(admin).await;
            let count = |o: &str| m.sum_where("kvrouter_streams_ended_total", "outcome", o);
            (count("routed") == 4.0 && count("complete") >= 1.0).then_some(())
        },
    )
    .await;
    let decisions = router_metrics(admin).await.sum("kvrouter_decisions_total");
    assert_eq!(decisions, 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_rotates_and_least_loaded_spreads_concurrent_requests() {
    let stack = Stack::start(StackOptions {
        replicas: 4,
        router_extra: "policy: {name: round-robin}",
        ..StackOptions::default()
    })
    .await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut order = Vec::new();
    for i in 0..8 {
        let r = stack
            .post(
                "/v1/completions",
                completion_body(MODEL, &format!("p{i}"), false, 1),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let name = r.replica.expect("replica header");
        order.push(name.clone());
        *counts.entry(name).or_default() += 1;
    }
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert!(counts.values().all(|&c| c == 2), "{counts:?}");
    assert_eq!(order[..4], order[4..], "strict rotation: {order:?}");

    // least-loaded: 8 slow requests in flight at once land 2 per replica.
    stack
        .reconfigure(
            &stack.replicas.iter().map(|r| r.addr).collect::<Vec<_>>(),
            "policy: {name: least-loaded}",
        )
        .await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let client = stack.client.clone();
        let addr = stack.envoy.addr;
        tasks.push(tokio::spawn(async move {
            post(
                &client,
                addr,
                "/v1/chat/completions",
                chat_body(MODEL, &format!("q{i}"), true, 150),
            )
            .await
        }));
        // Each request must be counted before the next is routed; the router counts at
        // decision time, so wait for the count, not for a fixed time.
        wait_for_in_flight(stack.router.admin, i + 1).await;
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        *counts.entry(r.replica.unwrap()).or_default() += 1;
    }
    assert!(
        counts.len() == 4 && counts.values().all(|&c| c == 2),
        "{counts:?}"
    );
    assert_in_flight_drains(stack.router.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_errors_reach_the_client_through_envoy() {
    let stack = Stack::start(StackOptions {
        router_extra: "routing: {max_body_bytes: 1048576, retry_after_s: 3}",
        ..StackOptions::default()
    })
    .await;
    let cases = [
        (
            "/v1/chat/completions",
            "{\"model\": ".to_string(),
            400,
            "not valid JSON",
            None,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"demo-model"}"#.to_string(),
            400,
            "missing required field `messages`",
            Some("messages"),
        ),
        (
            "/v1/completions",
            r#"{"model":"demo-model","prompt":[1,"a"]}"#.to_string(),
            400,
            "invalid field `prompt`",
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            chat_body("no-such-model", "hi", false, 1),
            404,
            "The model `no-such-model` does not exist.",
            Some("model"),
        ),
        (
            "/v1/completions",
            completion_body(MODEL, &"x".repeat(2 << 20), false, 1),
            413,
            "exceeds the router's limit of 1048576 bytes",
            None,
        ),
    ];
    for (path, body, status, message, param) in cases {
        let r = stack.post(path, body).await;
        assert_eq!(r.status, status, "{}", r.body);
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        assert!(r.replica.is_none(), "answered by the router, not a replica");
        let v = json(&r.body);
        assert!(
            v["error"]["message"].as_str().unwrap().contains(message),
            "{v}"
        );
        assert_eq!(v["error"]["code"], status);
        assert_eq!(v["error"]["param"].as_str(), param);
    }
    // 503 with retry-after: every endpoint draining.
    let addrs: Vec<_> = stack.replicas.iter().map(|r| r.addr).collect();
    let yaml_pools = router_config(
        stack.dir.path(),
        &addrs,
        "routing: {max_body_bytes: 1048576, retry_after_s: 3}",
    )
    .replace("      - address:", "      - drain: true\n        address:");
    stack.reload(&yaml_pools).await;
    let r = stack
        .post("/v1/chat/completions", chat_body(MODEL, "hi", false, 1))
        .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.retry_after.as_deref(), Some("3"));
    assert!(json(&r.body)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("draining"));
    let metrics = router_metrics(stack.router.admin).await;
    for code in ["400", "404", "413", "503"] {
        let n = metrics.sum_where("kvrouter_immediate_responses_total", "code", code);
        assert!(n >= 1.0, "{code}: {n}");
    }
    // The EDS file kvrouter writes marks them DRAINING, so Envoy's own fallback (kvrouter down)
    // would not send new requests there either.
    let clusters = format!("http://{}/clusters", stack.envoy.admin);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = reqwest::get(&clusters).await.unwrap().text().await.unwrap();
        let draining = text
            .lines()
            .filter(|l| l.contains("::health_flags::") && l.contains("eds_status_draining"))
            .count();
        if draining == addrs.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Envoy never saw {} draining hosts:\n{text}",
            addrs.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_in_flight_drains(stack.router.admin).await;
}

/// kvsim flags for replicas that accept (and quickly "prefill") a prompt of millions of tokens.
const HUGE_PROMPTS: &[&str] = &[
    "--max-model-len",
    "4000000",
    "--num-gpu-blocks",
    "300000",
    "--time-scale",
    "100000",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_mib_body_in_full_duplex_streamed_mode() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        body_mode: BodyMode::FullDuplex,
        replica_flags: HUGE_PROMPTS,
        ..StackOptions::default()
    })
    .await;
    let prompt = "abcd ".repeat((10 << 20) / 5);
    let r = stack
        .post("/v1/completions", completion_body(MODEL, &prompt, false, 2))
        .await;
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(500)]);
    // The replica saw the whole body: one token per word.
    let usage = &json(&r.body)["usage"];
    assert_eq!(usage["prompt_tokens"], (10u64 << 20) / 5, "{usage}");
    // A small streaming request works in the same mode.
    let r = stack
        .post("/v1/chat/completions", chat_body(MODEL, "hi", true, 3))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        sse_events(&r.body).last().map(String::as_str),
        Some("[DONE]")
    );
    assert_in_flight_drains(stack.router.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_still_served_when_the_router_dies() {
    let statuses = statuses_once_the_router_is_dead(BodyMode::Buffered).await;
    assert!(
        statuses.iter().all(|(status, _)| *status == 200),
        "the fallback must serve: {statuses:?}"
    );
    let served_by: std::collections::HashSet<_> = statuses.iter().map(|(_, u)| u).collect();
    assert!(
        served_by.len() > 1,
        "least-request fallback spreads: {served_by:?}"
    );
}

/// What an InferencePool gateway sees (FULL_DUPLEX_STREAMED with `failure_mode_allow`, which
/// FailOpen maps to) when its only picker is dead: Envoy 1.40 answers 500 to every request with a
/// body instead of failing open (upstream: kubernetes-sigs/gateway-api-inference-extension#1266),
/// and forwards none. This pins the behaviour docs/deploy.md describes, and why the deploy base
/// runs two picker replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_router_in_full_duplex_mode_gets_500s_from_envoy() {
    let statuses = statuses_once_the_router_is_dead(BodyMode::FullDuplex).await;
    assert!(
        statuses
            .iter()
            .all(|(status, upstream)| *status == 500 && upstream.is_none()),
        "Envoy's FULL_DUPLEX_STREAMED fail-open changed: {statuses:?}"
    );
}

/// STREAMED with `send_body_without_waiting_for_header_response` (`--body-mode streamed`): Envoy
/// sends the headers and the body at once and picks the host only when kvrouter answers the
/// headers, after the body. Every pick is honoured (a strict round-robin rotation, which Envoy's
/// least-request fallback would not produce), a 4 MiB body arriving in several chunks is routed
/// (Envoy queues them up to the virtual host's `request_body_buffer_limit`), and with kvrouter dead before the requests come Envoy still fails them open (what
/// full duplex cannot; a body still arriving when it dies is another matter, below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_streamed_mode_honours_every_pick_and_fails_open() {
    let mut stack = Stack::start(StackOptions {
        replicas: 3,
        body_mode: BodyMode::Streamed,
        router_extra: "policy: {name: round-robin}",
        replica_flags: HUGE_PROMPTS,
        ..StackOptions::default()
    })
    .await;
    let mut order = Vec::new();
    for i in 0..6 {
        let r = if i % 2 == 0 {
            stack
                .post(
                    "/v1/chat/completions",
                    chat_body(MODEL, &format!("s{i}"), i % 4 == 0, 3),
                )
                .await
        } else {
            stack
                .post(
                    "/v1/completions",
                    completion_body(MODEL, &format!("s{i}"), false, 3),
                )
                .await
        };
        assert_eq!(r.status, 200, "{}", r.body);
        let upstream = r.upstream.as_deref().expect("x-kvrouter-upstream");
        assert_eq!(stack.name_of(upstream), r.replica.as_deref(), "{r:?}");
        order.push(r.replica.expect("replica header"));
    }
    let distinct: std::collections::HashSet<_> = order.iter().collect();
    assert_eq!(distinct.len(), 3, "{order:?}");
    assert_eq!(order[..3], order[3..], "strict rotation: {order:?}");

    // 4 MiB: Envoy holds the chunks while kvrouter waits for the last one.
    let prompt = "abcd ".repeat((4 << 20) / 5);
    let r = stack
        .post("/v1/completions", completion_body(MODEL, &prompt, false, 2))
        .await;
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(500)]);
    assert_eq!(json(&r.body)["usage"]["prompt_tokens"], (4u64 << 20) / 5);
    assert_eq!(
        r.replica.as_deref(),
        Some(order[0].as_str()),
        "the rotation's next pick, not a fallback"
    );
    let admin = stack.router.admin;
    eventually(
        "seven routed picker streams",
        Duration::from_secs(10),
        || async move {
            let m = router_metrics(admin).await;
            (m.sum_where("kvrouter_streams_ended_total", "outcome", "routed") == 7.0).then_some(())
        },
    )
    .await;
    assert_in_flight_drains(admin).await;

    let statuses = statuses_after_killing_the_router(&mut stack).await;
    assert!(
        statuses
            .iter()
            .all(|(status, upstream)| *status == 200 && upstream.is_some()),
        "fails open: {statuses:?}"
    );
}

/// A client that pauses mid-body for longer than Envoy's message timeout. BUFFERED sends
/// kvrouter the body only once it is whole, and routes it. Early STREAMED: Envoy re-arms its
/// timeout with each chunk, and past it gives up on kvrouter and forwards the part it holds as
/// the whole body (the engine answers 400 to the cut JSON): what happens with
/// `routing.streamed_body_pause_ms: 0`. With the pause under the timeout, kvrouter lets the
/// request go unrouted first, and the whole body is served. docs/envoy.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_paused_past_the_message_timeout_is_let_go_unrouted_before_envoy_cuts_it() {
    // (mode, router config, status, kvrouter decided it, Envoy's message timeout fired)
    let cases = [
        (BodyMode::Buffered, "", 200, true, false),
        (
            BodyMode::Streamed,
            "routing: {streamed_body_pause_ms: 0}",
            400,
            false,
            true,
        ),
        (
            BodyMode::Streamed,
            "routing: {streamed_body_pause_ms: 50}",
            200,
            false,
            false,
        ),
    ];
    for (mode, router_extra, status, routed, timed_out) in cases {
        let stack = Stack::start(StackOptions {
            body_mode: mode,
            message_timeout_ms: 200,
            router_extra,
            ..StackOptions::default()
        })
        .await;
        let body = chat_body(MODEL, "an upload that pauses", false, 2).into_bytes();
        // The pause is the stimulus: four message timeouts between the two halves.
        let pause = async { tokio::time::sleep(Duration::from_millis(800)).await };
        let r = stack
            .client
            .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
            .header("content-type", "application/json")
            .body(split_upload(body, pause))
            .send()
            .await
            .expect("POST through Envoy");
        let r = reply(r).await;
        let case = format!("{mode:?} {router_extra:?}");
        assert!(r.replica.is_some(), "{case}: a replica answered: {r:?}");
        assert_eq!(r.status, status, "{case}: {}", r.body);
        if status == 400 {
            assert!(
                r.body.contains("not valid JSON"),
                "{case}: a cut body: {}",
                r.body
            );
        }
        let decisions = metric_sum(stack.router.admin, "kvrouter_decisions_total").await;
        assert_eq!(decisions, if routed { 1.0 } else { 0.0 }, "{case}");
        let timeouts = envoy_counter(&stack, "ext_proc.kvrouter.message_timeouts").await;
        assert_eq!(timeouts, u64::from(timed_out), "{case}");
    }
}

/// kvrouter dying while a body is still arriving, per body mode: the first half is sent, kvrouter
/// is killed once it has the picker stream open, then the second half follows. Returns the
/// status the client got.
async fn status_when_the_router_dies_mid_body(mode: BodyMode) -> u16 {
    let mut stack = warm_stack(mode).await;
    let body = chat_body(MODEL, "an upload the router does not live to see", false, 2).into_bytes();
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let gate = async move {
        let _ = wait.await;
    };
    let request = stack
        .client
        .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
        .header("content-type", "application/json")
        .body(split_upload(body, gate))
        .send();
    let request = tokio::spawn(request);
    // BUFFERED: Envoy holds the first half and has opened no stream yet; the others: kvrouter
    // has the request's headers (its picker stream is open).
    let admin = stack.router.admin;
    if mode != BodyMode::Buffered {
        eventually(
            "the picker stream open",
            Duration::from_secs(10),
            || async move {
                let open = metric_sum(admin, "kvrouter_streams_active").await;
                (open >= 1.0).then_some(())
            },
        )
        .await;
    } else {
        let envoy = stack.envoy.admin;
        let client = stack.client.clone();
        eventually("Envoy holding the request", Duration::from_secs(10), || {
            let client = client.clone();
            async move {
                let url = format!("http://{envoy}/stats?filter=downstream_rq_active");
                let text = client.get(url).send().await.ok()?.text().await.ok()?;
                text.lines()
                    .filter(|l| !l.starts_with("http.admin."))
                    .filter_map(|l| l.split_once(": "))
                    .any(|(k, v)| k.ends_with("downstream_rq_active") && v.trim() != "0")
                    .then_some(())
            }
        })
        .await;
    }
    stack.router.proc.kill();
    go.send(()).expect("the upload waits for the second half");
    let r = reply(request.await.unwrap().expect("POST through Envoy")).await;
    r.status
}

/// What each body mode does with a request whose body is still arriving when kvrouter dies:
/// BUFFERED opens the stream only once the body is whole, so it fails open whole (200);
/// FULL_DUPLEX_STREAMED fails closed (500); early STREAMED fails open with the part Envoy held
/// as the whole body (the engine's 400), as with a pause past the message timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_router_dying_mid_body_does_per_body_mode() {
    assert_eq!(
        status_when_the_router_dies_mid_body(BodyMode::Buffered).await,
        200
    );
    assert_eq!(
        status_when_the_router_dies_mid_body(BodyMode::FullDuplex).await,
        500
    );
    assert_eq!(
        status_when_the_router_dies_mid_body(BodyMode::Streamed).await,
        400
    );
}

/// Twelve chats through Envoy once kvrouter is SIGKILLed: status and upstream of each.
async fn statuses_once_the_router_is_dead(body_mode: BodyMode) -> Vec<(u16, Option<String>)> {
    statuses_after_killing_the_router(&mut warm_stack(body_mode).await).await
}

/// Twelve chats through `stack`'s Envoy once its kvrouter is SIGKILLed.
async fn statuses_after_killing_the_router(stack: &mut Stack) -> Vec<(u16, Option<String>)> {
    stack.router.proc.kill();
    let mut out = Vec::new();
    // Twelve, not six: with every replica idle, least-request picks at random among them, and
    // six in a row landed on one replica once in a full-suite run (p ~ 0.4%).
    for i in 0..12 {
        let r = stack
            .post(
                "/v1/chat/completions",
                chat_body(MODEL, &format!("after {i}"), i % 2 == 0, 2),
            )
            .await;
        out.push((r.status, r.upstream));
    }
    assert_eq!(out.len(), 12);
    out
}

/// A stack in `body_mode` that has routed one chat.
async fn warm_stack(body_mode: BodyMode) -> Stack {
    let stack = Stack::start(StackOptions {
        body_mode,
        ..StackOptions::default()
    })
    .await;
    let r = stack
        .post("/v1/chat/completions", chat_body(MODEL, "before", false, 2))
        .await;
    assert_eq!(r.status, 200);
    stack
}

/// A picker that stalls (here: SIGSTOP) in FULL_DUPLEX_STREAMED mode: Envoy arms no message
/// timeout in this mode, so the request is held (not failed open, not failed) until the picker
/// answers; resumed, kvrouter routes it. What bounds the wait in production is the gateway's
/// route timeout (docs/deploy.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_router_in_full_duplex_mode_holds_requests_until_it_answers() {
    let stack = warm_stack(BodyMode::FullDuplex).await;
    let decisions = metric_sum(stack.router.admin, "kvrouter_decisions_total").await;
    let pid = stack.router.proc.pid().expect("router running").to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let (client, addr) = (stack.client.clone(), stack.envoy.addr);
    let held = tokio::spawn(async move {
        post(
            &client,
            addr,
            "/v1/chat/completions",
            chat_body(MODEL, "while stalled", false, 2),
        )
        .await
    });
    // Envoy has the request (its listener counts it active) and has not answered it.
    let stats = format!(
        "http://{}/stats?filter=downstream_rq_active",
        stack.envoy.admin
    );
    let client = stack.client.clone();
    let active = eventually("Envoy holding the request", Duration::from_secs(10), || {
        let (client, stats) = (client.clone(), stats.clone());
        async move {
            let text = client.get(&stats).send().await.ok()?.text().await.ok()?;
            let n: u64 = text
                .lines()
                .filter(|l| !l.starts_with("http.admin."))
                .filter_map(|l| l.split_once(": "))
                .filter(|(k, _)| k.ends_with("downstream_rq_active"))
                .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
                .sum();
            (n >= 1).then_some(n)
        }
    })
    .await;
    assert!(!held.is_finished(), "answered while the picker was stopped");
    signal("-CONT");
    let r = tokio::time::timeout(Duration::from_secs(60), held)
        .await
        .expect("answered once the picker resumed")
        .expect("request task");
    assert_eq!(r.status, 200, "{}", r.body);
    let after = metric_sum(stack.router.admin, "kvrouter_decisions_total").await;
    assert_eq!(
        after,
        decisions + 1.0,
        "the held request was routed by kvrouter ({active} active at Envoy while stopped), not failed open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_adds_a_replica_without_dropping_an_in_flight_stream() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        router_extra: "policy: {name: round-robin}",
        ..StackOptions::default()
    })
    .await;
    let all: Vec<_> = stack.replicas.iter().map(|r| r.addr).collect();
    // Start with two replicas configured.
    stack
        .reconfigure(&all[..2], "policy: {name: round-robin}")
        .await;
    stack.envoy.wait_for_hosts(&all[..2]).await.unwrap();
    // A long stream in flight across the reload.
    let client = stack.client.clone();
    let addr = stack.envoy.addr;
    let long = tokio::spawn(async move {
        post(
            &client,
            addr,
            "/v1/chat/completions",
            chat_body(MODEL, "long", true, 300),
        )
        .await
    });
    wait_for_in_flight(stack.router.admin, 1).await;
    stack.reconfigure(&all, "policy: {name: round-robin}").await;
    stack.envoy.wait_for_hosts(&all).await.unwrap();
    let third = stack.replicas[2].name.clone();
    let mut reached_third = false;
    for i in 0..6 {
        let r = stack
            .post(
                "/v1/completions",
                completion_body(MODEL, &format!("n{i}"), false, 1),
            )
            .await;
        assert_eq!(r.status, 200);
        reached_third |= r.replica.as_deref() == Some(third.as_str());
    }
    assert!(
        reached_third,
        "the added replica receives traffic without a restart"
    );
    let long = long.await.unwrap();
    assert_eq!(long.status, 200);
    assert_complete_stream(&long.body, 300);
    assert_in_flight_drains(stack.router.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_cluster_routes_on_the_header() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        router_extra: "policy: {name: round-robin}\nrouting: {fallback_endpoints: 0}",
        cluster: ClusterStyle::OriginalDst,
        ..StackOptions::default()
    })
    .await;
    let mut seen = Vec::new();
    for i in 0..6 {
        let r = stack
            .post(
                "/v1/chat/completions",
                chat_body(MODEL, &format!("o{i}"), i % 2 == 1, 2),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        seen.push(r.replica.unwrap());
    }
    assert_eq!(
        seen[..3],
        seen[3..],
        "the router's rotation, not Envoy's: {seen:?}"
    );
    let mut distinct = seen.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3);
    assert_in_flight_drains(stack.router.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_counts_until_its_response_ends_with_or_without_the_observer() {
    for observe in [false, true] {
        request_counts_until_its_response_ends(observe).await;
    }
}

/// The picker stream lives as long as the request, so the request counts while its response
/// streams, whether or not the observer filter (which kvrouter closes at the first byte) is in.
async fn request_counts_until_its_response_ends(observe: bool) {
    use futures::StreamExt as _;
    let stack = Stack::start(StackOptions {
        replicas: 2,
        observe,
        ..StackOptions::default()
    })
    .await;
    let admin = stack.router.admin;
    let in_flight = || metric_sum(admin, "kvrouter_endpoint_in_flight_requests");
    if observe {
        // An answered request first: observers are then known to be in use.
        let r = stack
            .post("/v1/chat/completions", chat_body(MODEL, "warm", false, 2))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_in_flight_drains(admin).await;
    }
    let resp = stack
        .client
        .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
        .header("content-type", "application/json")
        .body(chat_body(MODEL, "long", true, 200))
        .send()
        .await
        .expect("sent");
    // While fewer than 150 of 200 tokens have arrived the replica is certainly still
    // generating, so the request must still count.
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    let (mut samples, mut last_bucket) = (0, 0);
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.expect("chunk"));
        let tokens = String::from_utf8_lossy(&body)
            .matches("\"content\":\"")
            .count();
        if tokens < 150 && tokens / 20 > last_bucket {
            last_bucket = tokens / 20;
            assert_eq!(
                in_flight().await,
                1.0,
                "released with {tokens} of 200 tokens sent (observer: {observe})"
            );
            samples += 1;
        }
    }
    assert!(samples >= 3, "sampled while streaming ({samples})");
    assert_complete_stream(&String::from_utf8(body).unwrap(), 200);
    assert_in_flight_drains(admin).await;
}

/// Envoy's count of ext_proc streams started by the filter with `stat_prefix`.
async fn extproc_streams(stack: &Stack, stat_prefix: &str) -> u64 {
    envoy_counter(stack, &format!("ext_proc.{stat_prefix}.streams_started")).await
}

/// An Envoy counter, summed over the scopes that end in `stat`.
async fn envoy_counter(stack: &Stack, stat: &str) -> u64 {
    let text = stack
        .client
        .get(format!("http://{}/stats?filter={stat}", stack.envoy.admin))
        .send()
        .await
        .expect("Envoy admin")
        .text()
        .await
        .expect("stats");
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| k.ends_with(&stat))
        .map(|(_, v)| v.trim().parse::<u64>().expect("a counter"))
        .sum()
}

/// Only the requests kvrouter marks reach the observer filter: with one mark per endpoint per
/// hour, the first request opens an observer stream and the next ones open none. An unmarked
/// request is still counted until its response ends, and its prefill until the first byte the
/// decision predicted (here long before the 300-token stream ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_marked_requests_open_an_observer_stream() {
    use futures::StreamExt as _;
    let stack = Stack::start(StackOptions {
        replicas: 1,
        router_extra: "routing: {observe_interval_ms: 3600000}",
        ..StackOptions::default()
    })
    .await;
    let admin = stack.router.admin;
    for i in 0..6 {
        let r = stack
            .post(
                "/v1/chat/completions",
                chat_body(MODEL, &format!("q{i}"), false, 2),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_in_flight_drains(admin).await;
    assert_eq!(
        extproc_streams(&stack, "kvrouter").await,
        6,
        "a picker stream each"
    );
    assert_eq!(
        extproc_streams(&stack, "kvrouter_observe").await,
        1,
        "only the interval's first request is watched"
    );

    // An unmarked streaming request: its prefill is released at the predicted first byte
    // while it still streams; the request itself only when it ends.
    let resp = stack
        .client
        .post(format!("http://{}/v1/chat/completions", stack.envoy.addr))
        .header("content-type", "application/json")
        .body(chat_body(
            MODEL,
            &"please give a long answer ".repeat(40),
            true,
            300,
        ))
        .send()
        .await
        .expect("sent");
    let mut stream = resp.bytes_stream();
    let mut body = Vec::new();
    body.extend_from_slice(&stream.next().await.expect("a first chunk").expect("chunk"));
    // A 300-token answer takes the replica seconds to generate: the request is still in flight
    // when its prefill is released.
    eventually(
        "the unmarked request's prefill released at its predicted first byte, mid-stream",
        Duration::from_secs(10),
        || async {
            let m = router_metrics(admin).await;
            let prefill = m.sum("kvrouter_endpoint_in_flight_prefill_tokens");
            let requests = m.sum("kvrouter_endpoint_in_flight_requests");
            assert_eq!(
                requests, 1.0,
                "the stream ended before its prefill was released"
            );
            (prefill == 0.0).then_some(())
        },
    )
    .await;
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_complete_stream(&String::from_utf8(body).unwrap(), 300);
    assert_in_flight_drains(admin).await;
    assert_eq!(extproc_streams(&stack, "kvrouter_observe").await, 1);
}

#[test]
fn check_config_reports_ok_and_names_bad_fields() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:8001'}]}]",
    )
    .unwrap();
    let out = std::process::Command::new(kvrouter_bin())
        .arg("check-config")
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("ok (1 endpoints in 1 pools; models: m; policy: predicted-ttft)"),
        "{stdout}"
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "pools: [{name: a, models: [m], endpoints: [{address: 'localhost', weight: -2}]}]",
    )
    .unwrap();
    let out = std::process::Command::new(kvrouter_bin())
        .arg("check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("pools[0].endpoints[0].address"), "{stderr}");
    assert!(stderr.contains("pools[0].endpoints[0].weight"), "{stderr}");

    // A tokenizer that cannot be loaded is named by its field.
    let bad_tokenizer = dir.path().join("tok.yaml");
    std::fs::write(
        &bad_tokenizer,
        "models: [{name: m, tokenizer: /nonexistent/tokenizer.json}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:8001'}]}]",
    )
    .unwrap();
    let out = std::process::Command::new(kvrouter_bin())
        .arg("check-config")
        .arg(&bad_tokenizer)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("models[0].tokenizer"), "{stderr}");

    // The local stack's config is valid.
    let out = std::process::Command::new(kvrouter_bin())
        .arg("check-config")
        .arg(repo().join("examples/kvrouter.yaml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let missing = std::process::Command::new(kvrouter_bin())
        .args(["check-config", "/nonexistent.yaml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read /nonexistent.yaml"));
}
