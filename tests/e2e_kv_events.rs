//! Precise cache ownership end to end: replicas publish vLLM KV events over ZMQ, kvrouter
//! subscribes, and requests routed through Envoy follow what the engines actually hold,
//! including blocks filled by traffic that never went through the router.

use std::time::Duration;

use testkit::*;

fn system_prompt() -> String {
    "You are the support assistant of a freight company; always quote the tracking number. "
        .repeat(30)
}

fn body(question: &str) -> String {
    serde_json::json!({
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": system_prompt()}, {"role": "user", "content": question}],
    })
    .to_string()
}

/// Two replicas publishing KV events on ephemeral bound sockets, tokenizing with the router's
/// tokenizer, and a router subscribed to each.
async fn start() -> Stack {
    let tokenizer = shared_fixture().display().to_string();
    let extra = format!(
        "policy: {{name: predicted-ttft}}\nmodels: [{{name: {MODEL}, tokenizer: \"{tokenizer}\"}}]"
    );
    Stack::start(StackOptions {
        replicas: 2,
        router_extra: &extra,
        replica_flags: &["--tokenizer", &tokenizer],
        kv_events: true,
        ..StackOptions::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_that_bypassed_the_router_is_found_and_a_restart_leaves_no_stale_hit() {
    let stack = start().await;
    let (r1, r1_addr) = (&stack.replicas[1].name, stack.replicas[1].addr);
    // Fill r1 directly, bypassing Envoy and the router.
    let direct = post(
        &stack.client,
        r1_addr,
        "/v1/chat/completions",
        body("direct"),
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);

    // The router learns it from r1's events: its confirmed match covers the system prompt.
    let probe = body("routed");
    let e = eventually(
        "r1's events to confirm the prefix",
        Duration::from_secs(10),
        || async {
            let e = stack.explain(&probe).await;
            (candidate_row(&e, r1_addr)["confirmed_tokens"].as_u64() >= Some(300)).then_some(e)
        },
    )
    .await;
    assert_eq!(candidate_row(&e, r1_addr)["cache_source"], "events", "{e}");
    assert_eq!(e["pick"], r1_addr.to_string(), "{e}");

    // Routed through Envoy, the request goes to r1 and r1 reports the hit.
    let routed = stack.post("/v1/chat/completions", probe.clone()).await;
    assert_eq!(routed.status, 200, "{}", routed.body);
    assert_eq!(routed.replica.as_deref(), Some(r1.as_str()));
    let usage: serde_json::Value = serde_json::from_str(&routed.body).unwrap();
    let cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 300, "r1 served the prefix from cache: {cached}");

    // r1 restarts: its cache is gone, and no stale hit may remain (predictions included).
    let restart = stack
        .client
        .post(format!("http://{r1_addr}/admin/restart"))
        .body(r#"{"down_ms": 0}"#)
        .send()
        .await
        .unwrap();
    assert!(restart.status().is_success());
    eventually(
        "r1's stale entries to be dropped",
        Duration::from_secs(10),
        || async {
            let e = stack.explain(&body("after restart")).await;
            (candidate_row(&e, r1_addr)["matched_tokens"] == 0).then_some(())
        },
    )
    .await;
    let metrics = router_metrics(stack.router.admin).await;
    let messages = metrics.sum_where(
        "kvrouter_kv_events_messages_total",
        "endpoint",
        &r1_addr.to_string(),
    );
    assert!(messages >= 1.0, "r1's batches were counted: {messages}");
    assert_in_flight_drains(stack.router.admin).await;
}
