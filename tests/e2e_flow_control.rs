//! Flow control end to end: real Envoy, kvrouter and simulated replicas. The replicas are stalled
//! so the fleet has no room; a burst far beyond it queues in kvrouter, where sheddable requests
//! are turned away with 429 and `retry-after` while critical and unmarked ones wait and are all
//! served once the replicas resume. A queued request whose client goes away leaves the queue.

use std::net::SocketAddr;

use kvrouter::envoyconf::{message_timeout_for_wait, BodyMode};
use testkit::*;

/// Prompts carry this so the test can check no error body echoes prompt text.
const MARKER: &str = "flow-control-private-prompt-text";

/// One queue per test: up to 24 requests, 30 s of wait; the default (predicted) room: a stalled
/// replica with a prompt in prefill has no room for another of the same size (the wait behind
/// it is a whole prompt's prefill against a budget of half of one), an idle one takes one.
const FLOW: &str = "\
load: {scrape: {enabled: false}}
flow_control:
  enabled: true
  max_queue_requests: 24
  max_wait_ms: 30000
  retry_after_s: 2
  objectives:
    - {name: critical, priority: 1}
    - {name: sheddable, priority: -1}
";

async fn start(body_mode: BodyMode) -> Stack {
    Stack::start(StackOptions {
        replicas: 2,
        router_extra: FLOW,
        body_mode,
        message_timeout_ms: message_timeout_for_wait(30_000),
        ..StackOptions::default()
    })
    .await
}

/// One request served, so kvrouter has seen Envoy's observer stream: from then on a routed
/// request counts as in flight until its response (before, a picker stream's end releases it).
async fn warm_up(stack: &Stack) {
    let reply = request(&stack.client, stack.envoy.addr, None, 0).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}

/// Stalls (`/admin/stall`) or resumes (`/admin/resume`) every replica.
async fn set_stalled(stack: &Stack, stalled: bool) {
    let path = if stalled { "stall" } else { "resume" };
    for r in &stack.replicas {
        let resp = stack
            .client
            .post(format!("http://{}/admin/{path}", r.addr))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("replica admin");
        assert!(resp.status().is_success(), "{path}: {}", resp.status());
    }
}

/// A chat request through Envoy with objective `objective` (none: unmarked).
fn request(
    client: &reqwest::Client,
    envoy: SocketAddr,
    objective: Option<&str>,
    i: usize,
) -> impl std::future::Future<Output = Reply> {
    let mut req = client
        .post(format!("http://{envoy}/v1/chat/completions"))
        .header("content-type", "application/json")
        // Streamed, as clients that care about TTFT send: its first byte is its first token,
        // which is what frees room (a non-streamed one's prefill is taken as done when
        // predicted, so a stalled engine would not hold it).
        .body(chat_body(MODEL, &format!("{MARKER} {i}"), true, 4));
    if let Some(o) = objective {
        req = req.header("x-llm-d-inference-objective", o);
    }
    async move { reply(req.send().await.expect("response")).await }
}

/// (requests queued, requests admitted) from kvrouter's `/debug/flow` and `/metrics`.
async fn queue_state(stack: &Stack) -> (u64, u64) {
    let flow: serde_json::Value = stack
        .client
        .get(format!("http://{}/debug/flow", stack.router.admin))
        .send()
        .await
        .expect("debug flow")
        .json()
        .await
        .expect("json");
    let models = flow["models"].as_array().expect("models");
    let queued = models.iter().map(|m| m["requests"].as_u64().unwrap()).sum();
    (queued, outcome_count(stack, "admitted").await)
}

/// kvrouter's count of flow-control outcomes `outcome` (`kvrouter_flow_requests_total`).
async fn outcome_count(stack: &Stack, outcome: &str) -> u64 {
    router_metrics(stack.router.admin).await.sum_where(
        "kvrouter_flow_requests_total",
        "outcome",
        outcome,
    ) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_beyond_the_fleet_sheds_sheddable_requests_and_serves_the_rest() {
    let stack = start(BodyMode::Buffered).await;
    warm_up(&stack).await;
    set_stalled(&stack, true).await;
    let envoy = stack.envoy.addr;

    // 20 requests that must all be served: 10 critical, 10 unmarked.
    let mut must_serve = Vec::new();
    for i in 0..20 {
        let objective = (i % 2 == 0).then_some("critical");
        must_serve.push(tokio::spawn(request(&stack.client, envoy, objective, i)));
    }
    eventually("the 20 to be admitted or queued", STARTUP, || async {
        let (queued, admitted) = queue_state(&stack).await;
        (queued + admitted == 21 && queued > 0).then_some(())
    })
    .await;

    // 40 sheddable ones: the queue (24) has room for only a few of them.
    let mut sheddable = Vec::new();
    for i in 0..40 {
        sheddable.push(tokio::spawn(request(
            &stack.client,
            envoy,
            Some("sheddable"),
            100 + i,
        )));
    }
    eventually("the queue to fill up", STARTUP, || async {
        (queue_state(&stack).await.0 == 24).then_some(())
    })
    .await;
    // Two more critical ones displace queued sheddable ones.
    for i in 0..2 {
        must_serve.push(tokio::spawn(request(
            &stack.client,
            envoy,
            Some("critical"),
            200 + i,
        )));
    }
    eventually("the critical ones to be queued", STARTUP, || async {
        (outcome_count(&stack, "displaced").await >= 2).then_some(())
    })
    .await;

    set_stalled(&stack, false).await;
    assert_eq!(must_serve.len(), 22);
    for task in must_serve {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200, "critical or unmarked: {}", reply.body);
    }
    assert_eq!(sheddable.len(), 40);
    let (mut served, mut shed) = (0u64, 0u64);
    for task in sheddable {
        let reply = task.await.unwrap();
        match reply.status {
            200 => served += 1,
            429 => {
                shed += 1;
                assert_eq!(reply.retry_after.as_deref(), Some("2"));
                assert!(
                    !reply.body.contains(MARKER),
                    "prompt text in {}",
                    reply.body
                );
                let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
                assert_eq!(body["error"]["code"], 429);
            }
            other => panic!("sheddable request answered {other}: {}", reply.body),
        }
    }
    assert_eq!(served + shed, 40);
    // At most 24 - 20 + (admitted before the queue formed) fit; 2 more were displaced.
    assert!(shed >= 16, "only {shed} of 40 sheddable requests shed");

    let full = outcome_count(&stack, "full").await;
    let displaced = outcome_count(&stack, "displaced").await;
    assert_eq!(full + displaced, shed);
    assert_eq!(outcome_count(&stack, "admitted").await, 1 + 22 + served);
    assert_eq!(queue_state(&stack).await.0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_queued_request_leaves_the_queue() {
    let stack = start(BodyMode::FullDuplex).await;
    warm_up(&stack).await;
    set_stalled(&stack, true).await;
    let envoy = stack.envoy.addr;
    // Fill the fleet's room one request at a time until one queues.
    let mut held = Vec::new();
    let queued = loop {
        assert!(
            held.len() < 6,
            "no request queued behind {} stalled ones",
            held.len()
        );
        let admitted_before = outcome_count(&stack, "admitted").await;
        let task = tokio::spawn(request(&stack.client, envoy, None, held.len() + 1));
        let queued = eventually("the request to be admitted or queued", STARTUP, || async {
            let (queued, admitted) = queue_state(&stack).await;
            (queued + admitted == admitted_before + 1).then_some(queued)
        })
        .await;
        if queued == 1 {
            break task;
        }
        held.push(task);
    };
    // Its client goes away: Envoy resets the ext_proc stream and the request leaves the queue.
    queued.abort();
    assert!(queued.await.is_err_and(|e| e.is_cancelled()));
    eventually("the queue to empty", STARTUP, || async {
        (queue_state(&stack).await.0 == 0).then_some(())
    })
    .await;
    assert_eq!(outcome_count(&stack, "cancelled").await, 1);
    set_stalled(&stack, false).await;
    assert!(!held.is_empty());
    for task in held {
        let reply = task.await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    // The fleet serves again, through the queue.
    let reply = request(&stack.client, envoy, Some("critical"), 9).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}
