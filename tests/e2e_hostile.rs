//! Hostile clients through real Envoy (issue 12): while worst-case bodies are in flight, a
//! one-line chat is served; the hostile bodies get a clear 413, malformed ones a 4xx, and no
//! response body, router log line (at trace level) or metric carries their text.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvrouter::envoyconf::{self, BodyMode, ClusterStyle};
use testkit::*;

/// Planted in every hostile body; must never come back.
const MARKER: &str = "Zq7xSECRETxMARKERx41";

/// A generous bound for the one-line chat (before the fix it got no answer within 30 s).
const ANSWER_DEADLINE: Duration = Duration::from_secs(60);

fn fixture() -> String {
    shared_fixture().display().to_string()
}

/// A chat body of `n` messages made by `message(i)`.
fn chat(n: usize, message: impl Fn(usize) -> String) -> String {
    let messages: Vec<String> = (0..n).map(message).collect();
    format!(
        r#"{{"model":"{MODEL}","max_tokens":1,"messages":[{}]}}"#,
        messages.join(",")
    )
}

/// 60,000 messages with a text and an image part each (~7 MiB): over `routing.max_messages`.
fn image_messages() -> String {
    chat(60_000, |i| {
        format!(
            r#"{{"role":"user","content":[{{"type":"text","text":"{MARKER} look"}},{{"type":"image_url","image_url":{{"url":"https://x/{i}.png"}}}}]}}"#
        )
    })
}

/// 9,000 messages of 3 image parts each: under the message limit, over the parts limit.
fn tiny_parts() -> String {
    chat(9_000, |i| {
        let part = format!(r#"{{"type":"image_url","image_url":"{MARKER}{}"}}"#, i % 10);
        format!(r#"{{"role":"user","content":[{part},{part},{part}]}}"#)
    })
}

/// Envoy in front of `router` (buffered bodies), once it routes to every one of `replicas`.
async fn envoy_in_front(router: &Router, dir: &std::path::Path, replicas: &[SocketAddr]) -> Envoy {
    let options = envoy_options(
        router,
        dir,
        ClusterStyle::OverrideHost,
        BodyMode::Buffered,
        None,
    );
    let envoy = start_envoy(dir, &envoyconf::render(&options)).await;
    envoy.wait_for_hosts(replicas).await.unwrap();
    envoy
}

struct Hostile {
    _dir: tempfile::TempDir,
    _replicas: Vec<Replica>,
    router: Router,
    envoy: Envoy,
    client: reqwest::Client,
}

/// Two tokenizing replicas, kvrouter logging at trace level, Envoy in front (buffered bodies).
async fn start() -> Hostile {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = fixture();
    let replicas: Vec<Replica> = (0..2)
        .map(|i| {
            let mut spec = ReplicaSpec::new(format!("r{i}"));
            spec.flags = vec!["--tokenizer".into(), tokenizer.clone()];
            start_replica(dir.path(), spec)
        })
        .collect();
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let extra = format!("models: [{{name: {MODEL}, tokenizer: \"{tokenizer}\"}}]");
    let yaml = router_config(dir.path(), &replicas, &extra);
    let config = dir.path().join("kvrouter.yaml");
    std::fs::write(&config, yaml).unwrap();
    let router = Router::start(&kvrouter_bin(), dir.path(), &config, "info,kvrouter=trace")
        .unwrap_or_else(|e| panic!("{e}"));
    let envoy = envoy_in_front(&router, dir.path(), &addrs).await;
    Hostile {
        _dir: dir,
        _replicas: replicas,
        router,
        envoy,
        client: reqwest::Client::new(),
    }
}

impl Hostile {
    async fn post(&self, path: &str, body: String) -> Reply {
        post(&self.client, self.envoy.addr, path, body).await
    }

    async fn one_line_chat(&self) -> (Reply, Duration) {
        let started = Instant::now();
        let reply = tokio::time::timeout(
            ANSWER_DEADLINE,
            self.post(
                "/v1/chat/completions",
                chat_body(MODEL, "What is 2+2?", false, 2),
            ),
        )
        .await
        .expect("the one-line chat got no answer within the deadline");
        (reply, started.elapsed())
    }
}

/// A 4xx with an OpenAI-style error that does not quote the body.
fn assert_clean_rejection(what: &str, reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "{what}: {}", reply.body);
    let v: serde_json::Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", reply.body));
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{what}: no message: {}", reply.body);
    assert!(
        !reply.body.contains(MARKER),
        "{what} leaked: {}",
        reply.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_line_chat_is_served_while_hostile_bodies_are_refused_without_their_text() {
    let h = start().await;
    let (warm, _) = h.one_line_chat().await;
    assert_eq!(warm.status, 200, "{}", warm.body);
    let (quiet, quiet_took) = h.one_line_chat().await;
    assert_eq!(quiet.status, 200, "{}", quiet.body);
    println!("one-line chat, quiet: {} ms", quiet_took.as_millis());

    // Four ~7 MiB bodies of 60k image messages and two of 27k image parts, all at once.
    let mut hostile = Vec::new();
    for i in 0..6 {
        let body = if i < 4 {
            image_messages()
        } else {
            tiny_parts()
        };
        let (client, addr) = (h.client.clone(), h.envoy.addr);
        hostile.push(tokio::spawn(async move {
            post(&client, addr, "/v1/chat/completions", body).await
        }));
    }
    let (reply, took) = h.one_line_chat().await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    println!("one-line chat during the flood: {} ms", took.as_millis());
    assert_eq!(hostile.len(), 6);
    // Each is refused by the router, never handed to a replica: 413 once read, or 503 with
    // `retry-after` when it waited past `routing.heavy_body_max_wait_ms` for its turn at the
    // long bodies' read rate (six ~7 MiB bodies at once are ~40 MiB: some wait), which is
    // what keeps Envoy's 2 s message timeout from failing it open to the engine.
    let mut busy = 0;
    for (i, task) in hostile.into_iter().enumerate() {
        let r = tokio::time::timeout(ANSWER_DEADLINE, task)
            .await
            .expect("a hostile body got no answer")
            .unwrap();
        let what = format!("hostile body {i}");
        assert_eq!(r.replica, None, "{what} reached a replica: {}", r.body);
        if r.status == 503 {
            assert!(r.retry_after.is_some(), "{what}: 503 without retry-after");
            busy += 1;
        }
        assert_clean_rejection(&what, &r, if r.status == 503 { 503 } else { 413 });
    }
    println!("hostile bodies refused while waiting for their turn: {busy} of 6");

    // Malformed bodies of other shapes, each carrying the marker.
    let malformed: [(&str, &str, String, u16); 7] = [
        (
            "messages as a string",
            "/v1/chat/completions",
            format!(r#"{{"model":"{MODEL}","messages":"{MARKER}"}}"#),
            400,
        ),
        (
            "content as a number in a list of strings",
            "/v1/chat/completions",
            format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":["{MARKER}",7]}}]}}"#
            ),
            400,
        ),
        (
            "a prompt as an object",
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":{{"{MARKER}":1}}}}"#),
            400,
        ),
        (
            "truncated JSON",
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"{MARKER} and more"#),
            400,
        ),
        (
            "a bad escape",
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"{MARKER}\q"}}"#),
            400,
        ),
        (
            "a prompt pasted into the model name",
            "/v1/completions",
            format!(r#"{{"model":"please summarise {MARKER} for me","prompt":"hi"}}"#),
            404,
        ),
        (
            "an unknown model name with the marker alone",
            "/v1/chat/completions",
            format!(
                r#"{{"model":"{MARKER}/{}","messages":[{{"role":"user","content":"hi"}}]}}"#,
                "x".repeat(200)
            ),
            404,
        ),
    ];
    for (what, path, body, status) in malformed {
        let r = h.post(path, body).await;
        assert_clean_rejection(what, &r, status);
    }

    // Still up and serving.
    let (after, _) = h.one_line_chat().await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_in_flight_drains(h.router.admin).await;

    let metrics = h
        .client
        .get(format!("http://{}/metrics", h.router.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("kvrouter_"), "a real exposition");
    assert!(!metrics.contains(MARKER), "a metric carries the marker");
    let log = std::fs::read_to_string(h.router.proc.log_path()).unwrap();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the router logged at debug/trace level: {}",
        h.router.proc.log_tail()
    );
    let leaks: Vec<&str> = log.lines().filter(|l| l.contains(MARKER)).collect();
    assert!(leaks.is_empty(), "log lines with the marker: {leaks:?}");
}

/// A body the router accepts by size is served when nothing else is being read, however slow
/// the long bodies' read rate: the rate's burst makes room for one `max_body_bytes` body within
/// `heavy_body_max_wait_ms`. (With a fixed 4 MiB burst this body, 7.5 MiB at 2 MiB/s, would
/// have waited ~1.75 s for its turn and been answered 503 on every try.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_near_the_size_limit_is_served_when_nothing_else_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let replicas = vec![start_replica(dir.path(), ReplicaSpec::new("r0"))];
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let extra = "routing: {max_body_bytes: 8388608, heavy_body_bytes_per_s: 2097152, \
                 heavy_body_max_wait_ms: 1000}";
    let yaml = router_config(dir.path(), &replicas, extra);
    let router = start_router(dir.path(), &yaml);
    let envoy = envoy_in_front(&router, dir.path(), &addrs).await;
    let client = reqwest::Client::new();

    let text = "lorem ipsum dolor sit amet ".repeat((15 << 20) / 2 / 27);
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":1,"messages":[{{"role":"user","content":"{text}"}}]}}"#
    );
    assert!((7 << 20..8 << 20).contains(&body.len()), "{}", body.len());
    let reply = tokio::time::timeout(
        ANSWER_DEADLINE,
        post(&client, envoy.addr, "/v1/chat/completions", body),
    )
    .await
    .expect("the long body got no answer");
    // It reaches the replica (which refuses it for its context length: ~1.5M tokens), not a
    // 503 from the router.
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(
        reply.body.contains("maximum context length"),
        "{}",
        reply.body
    );

    // Read by the router at its rate (held a while past the burst), not failed open.
    let metrics = router_metrics(router.admin).await;
    assert!(metrics.sum("kvrouter_heavy_body_held_seconds_total") > 0.0);
    assert_eq!(
        metrics.named("kvrouter_heavy_body_refused_total").count(),
        1
    );
    assert_eq!(metrics.sum("kvrouter_heavy_body_refused_total"), 0.0);
}
