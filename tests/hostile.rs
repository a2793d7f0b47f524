//! Hostile clients through real Envoy: what one client does must not hurt others or mix with
//! them. (Tenancy forgeries are in `tests/tenancy.rs`.)
//!
//! - A flood of buffered bodies is bounded by one process-wide byte budget: past it, 503 with
//!   `retry-after`, and the budget comes back when the holder ends.
//! - Two requests carrying the same `x-request-id` keep two decision records.

use std::time::Duration;

use kvrouter::envoyconf::BodyMode;
use testkit::*;

/// A completion body of about `bytes` bytes whose prompt is the short `tag`: the bulk is JSON
/// whitespace, so the engine sees a short prompt while the router must hold every byte.
fn big_body(bytes: usize, tag: &str) -> String {
    let body = completion_body(MODEL, tag, false, 2);
    format!("{{{}{}", " ".repeat(bytes), &body[1..])
}

/// One client holds most of the budget with a body it has not finished sending; another's body
/// no longer fits and is refused with 503 + `retry-after`, without waiting; when the first ends,
/// the second fits again and both were served or refused cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bodies_share_one_budget() {
    let stack = Stack::start(StackOptions {
        replicas: 1,
        body_mode: BodyMode::FullDuplex,
        router_extra: "routing: {max_body_bytes: 700000, max_buffered_body_bytes: 1000000}",
        ..StackOptions::default()
    })
    .await;

    // The holder: 600 kB of its body sent, the rest held back.
    let full = big_body(600_000, "secret-held");
    let (head, tail) = full.split_at(full.len() - 10);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
    tx.send(Ok(head.as_bytes().to_vec())).await.unwrap();
    let body = reqwest::Body::wrap_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let holder = {
        let client = stack.client.clone();
        let url = format!("http://{}/v1/completions", stack.envoy.addr);
        tokio::spawn(async move {
            let resp = client
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("holder's request");
            reply(resp).await
        })
    };

    // Wait until the holder's bytes are all held by the router (a probe sent earlier could
    // take the budget first and get the HOLDER refused), then a second body must not fit.
    let head_len = head.len() as f64;
    eventually(
        "the holder's sent bytes to be held by the router",
        Duration::from_secs(20),
        || async {
            let held = router_metrics(stack.router.admin)
                .await
                .sum("kvrouter_buffered_body_bytes");
            (held >= head_len).then_some(())
        },
    )
    .await;
    let refused = stack
        .post("/v1/completions", big_body(500_000, "secret-other"))
        .await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.retry_after.as_deref(), Some("1"), "{refused:?}");
    let error: serde_json::Value = serde_json::from_str(&refused.body).expect("JSON error body");
    assert_eq!(error["error"]["code"], 503, "{}", refused.body);
    assert!(
        !refused.body.contains("secret-other"),
        "no prompt text echoed"
    );
    // Small bodies still fit beside the holder.
    let small = stack
        .post("/v1/completions", completion_body(MODEL, "hi", false, 2))
        .await;
    assert_eq!(small.status, 200, "{}", small.body);

    // The holder finishes and is served; its share comes back.
    tx.send(Ok(tail.as_bytes().to_vec())).await.unwrap();
    drop(tx);
    let held = holder.await.unwrap();
    assert_eq!(held.status, 200, "{}", held.body);
    let again = stack
        .post("/v1/completions", big_body(500_000, "secret-other"))
        .await;
    assert_eq!(
        again.status, 200,
        "the budget was given back: {}",
        again.body
    );
    assert_in_flight_drains(stack.router.admin).await;
    let held = router_metrics(stack.router.admin)
        .await
        .sum("kvrouter_buffered_body_bytes");
    assert_eq!(held, 0.0, "every body's share given back");
}

/// A client-chosen `x-request-id` shared by two requests: each decision is kept whole under its
/// own key, the first is not overwritten by the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_request_ids_keep_separate_decisions() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        router_extra: "debug: {record_decisions: 64}",
        ..StackOptions::default()
    })
    .await;
    let id = "collide-0001";
    let prompts = ["short", &"a much longer prompt ".repeat(40)];
    for prompt in prompts {
        let r = stack
            .client
            .post(format!("http://{}/v1/completions", stack.envoy.addr))
            .header("content-type", "application/json")
            .header("x-request-id", id)
            .body(completion_body(MODEL, prompt, false, 2))
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status().as_u16(), 200);
    }
    let admin = stack.router.admin;
    let get = |path: String| {
        let client = stack.client.clone();
        async move {
            let r = client.get(path).send().await.expect("admin");
            assert_eq!(r.status().as_u16(), 200);
            r.json::<serde_json::Value>().await.expect("json")
        }
    };
    let listed = get(format!("http://{admin}/debug/decisions")).await;
    let ids: Vec<&str> = listed["request_ids"]
        .as_array()
        .expect("request_ids")
        .iter()
        .filter_map(|v| v.as_str())
        .filter(|s| s.starts_with(id))
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "Envoy passed the client's id through and both decisions are kept: {listed}"
    );
    let mut tokens = Vec::new();
    for key in &ids {
        let e = get(format!(
            "http://{admin}/debug/decisions/{}",
            key.replace('#', "%23")
        ))
        .await;
        tokens.push(e["prompt_tokens"].as_u64().expect("prompt_tokens"));
    }
    assert!(
        tokens[0] < tokens[1],
        "the first record is the short prompt's, the second the long one's: {tokens:?}"
    );
}

/// An endpoint that leaves the config takes its metric series with it: under DNS or Kubernetes
/// churn `/metrics` must not keep every address a pool ever had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_series_of_a_removed_endpoint_go_with_it() {
    let extra = "policy: {name: round-robin}";
    let stack = Stack::start(StackOptions {
        replicas: 2,
        router_extra: extra,
        ..StackOptions::default()
    })
    .await;
    for i in 0..6 {
        let r = stack
            .post(
                "/v1/completions",
                completion_body(MODEL, &format!("p{i}"), false, 2),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let gone = stack.replicas[1].addr;
    let label = format!("endpoint=\"{gone}\"");
    let metrics_text = || {
        let client = stack.client.clone();
        let url = format!("http://{}/metrics", stack.router.admin);
        async move {
            client
                .get(url)
                .send()
                .await
                .expect("metrics")
                .text()
                .await
                .expect("metrics text")
        }
    };
    let before = metrics_text().await;
    let series = |text: &str, name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(&label))
            .count()
    };
    for name in [
        "kvrouter_decisions_total",
        "kvrouter_upstream_responses_total",
    ] {
        assert!(
            series(&before, name) > 0,
            "{name} has a series for {gone} before:\n{before}"
        );
    }

    stack.reconfigure(&[stack.replicas[0].addr], extra).await;
    let after = eventually(
        "the removed endpoint's series to leave /metrics",
        Duration::from_secs(10),
        || async {
            let text = metrics_text().await;
            (!text.contains(&label)).then_some(text)
        },
    )
    .await;
    let kept = format!("endpoint=\"{}\"", stack.replicas[0].addr);
    assert!(
        after
            .lines()
            .any(|l| l.starts_with("kvrouter_decisions_total") && l.contains(&kept)),
        "the remaining endpoint's series stay:\n{after}"
    );
}
