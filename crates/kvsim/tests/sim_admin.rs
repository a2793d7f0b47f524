//! Fault injection and maintenance endpoints: loopback only, failures, stalls, cache drops,
//! resets and restarts. Simulated time on a paused clock.

use kvsim::inproc as sim_support;

use std::time::Duration;

use kvsim::REPLICA_HEADER;
use serde_json::json;
use sim_support::*;

const LABELS: &str = "{engine=\"0\",model_name=\"m\"}";

#[tokio::test(start_paused = true)]
async fn admin_refuses_non_loopback_peers() {
    let (_replica, app) = start(config("r1")).await;
    let (status, headers, body) =
        call_from(&app, "POST", "/admin/reset", None, [10, 0, 0, 7]).await;
    assert_eq!(status, 403);
    assert_eq!(body["error"]["code"], 403);
    assert_eq!(headers[REPLICA_HEADER], "r1");
    let (status, _, body) = call(&app, "GET", "/admin/state", None).await;
    assert_eq!(status, 200);
    assert_eq!(body["replica"], "r1");
    assert_eq!(body["engine"]["running"], 0);
}

#[tokio::test(start_paused = true)]
async fn injected_failures_answer_with_the_status_then_stop() {
    let (_replica, app) = start(config("r1")).await;
    let (status, _, _) = call(
        &app,
        "POST",
        "/admin/fail",
        Some(&json!({"status": 503, "count": 2})),
    )
    .await;
    assert_eq!(status, 200);
    let body = tokens_body(&ids(1, 10), 1);
    for _ in 0..2 {
        let (status, headers, json) = call(&app, "POST", "/v1/completions", Some(&body)).await;
        assert_eq!(status, 503);
        assert_eq!(json["error"]["message"], "injected failure");
        assert_eq!(headers[REPLICA_HEADER], "r1");
    }
    assert_eq!(
        call(&app, "POST", "/v1/completions", Some(&body)).await.0,
        200
    );
    // Until cleared, by duration.
    call(
        &app,
        "POST",
        "/admin/fail",
        Some(&json!({"duration_ms": 1000})),
    )
    .await;
    assert_eq!(
        call(&app, "POST", "/v1/completions", Some(&body)).await.0,
        500
    );
    tokio::time::sleep(Duration::from_millis(1001)).await;
    assert_eq!(
        call(&app, "POST", "/v1/completions", Some(&body)).await.0,
        200
    );
    // An open-ended injection fails requests until it is cleared.
    assert_eq!(call(&app, "POST", "/admin/fail", None).await.0, 200);
    assert_eq!(
        call(&app, "POST", "/v1/completions", Some(&body)).await.0,
        500,
        "failing with no duration set"
    );
    assert_eq!(call(&app, "DELETE", "/admin/fail", None).await.0, 200);
    assert_eq!(
        call(&app, "POST", "/v1/completions", Some(&body)).await.0,
        200
    );
    let (status, _, _) = call(&app, "POST", "/admin/fail", Some(&json!({"status": 200}))).await;
    assert_eq!(status, 400, "only error statuses can be injected");
}

#[tokio::test(start_paused = true)]
async fn a_stall_holds_requests_until_it_ends() {
    let (_replica, app) = start(config("r1")).await;
    let normal = stream(&app, "/v1/completions", tokens_body(&ids(2, 64), 1)).await;
    call(
        &app,
        "POST",
        "/admin/stall",
        Some(&json!({"duration_ms": 2000})),
    )
    .await;
    let stalled = stream(&app, "/v1/completions", tokens_body(&ids(3, 64), 1)).await;
    assert!(stalled.ttft >= Duration::from_millis(2000) + normal.ttft - Duration::from_millis(1));
    // Until resumed.
    call(&app, "POST", "/admin/stall", None).await;
    let app2 = app.clone();
    let pending =
        tokio::spawn(
            async move { stream(&app2, "/v1/completions", tokens_body(&ids(4, 64), 1)).await },
        );
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (_, _, state) = call(&app, "GET", "/admin/state", None).await;
    assert_eq!(state["engine"]["stalled"], true);
    assert_eq!(state["engine"]["waiting"], 1);
    assert!(!pending.is_finished());
    call(&app, "POST", "/admin/resume", None).await;
    let done = pending.await.unwrap();
    assert!(done.ttft >= Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn drop_cache_and_reset_give_a_cold_replica() {
    let (_replica, app) = start(config("r1")).await;
    let prompt = ids(5, 500);
    stream(&app, "/v1/completions", tokens_body(&prompt, 1)).await;
    assert_eq!(
        stream(&app, "/v1/completions", tokens_body(&prompt, 1))
            .await
            .cached_tokens(),
        496
    );
    let (_, _, state) = call(&app, "POST", "/admin/drop-cache", None).await;
    assert_eq!(state["engine"]["cached_blocks"], 0);
    assert_eq!(
        stream(&app, "/v1/completions", tokens_body(&prompt, 1))
            .await
            .cached_tokens(),
        0
    );
    let before = metrics(&app).await;
    assert_eq!(
        metric(&before, &format!("vllm:prefix_cache_hits_total{LABELS}")),
        496.0
    );
    let (status, _, state) = call(&app, "POST", "/admin/reset", None).await;
    assert_eq!(status, 200);
    assert_eq!(state["engine"]["cached_blocks"], 0);
    let after = metrics(&app).await;
    assert_eq!(
        metric(&after, &format!("vllm:prefix_cache_hits_total{LABELS}")),
        0.0
    );
    assert_eq!(
        metric(
            &after,
            &format!("vllm:time_to_first_token_seconds_count{LABELS}")
        ),
        0.0
    );
    assert_eq!(
        stream(&app, "/v1/completions", tokens_body(&prompt, 1))
            .await
            .cached_tokens(),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn a_restart_aborts_in_flight_requests_and_is_down_for_a_while() {
    let (_replica, app) = start(config("r1")).await;
    let app2 = app.clone();
    let long = tokio::spawn(async move {
        call(
            &app2,
            "POST",
            "/v1/completions",
            Some(&tokens_body(&ids(6, 100), 5000)),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, _) = call(
        &app,
        "POST",
        "/admin/restart",
        Some(&json!({"down_ms": 500})),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, body) = long.await.unwrap();
    assert_eq!(status, 500, "{body}");
    assert_eq!(call(&app, "GET", "/health", None).await.0, 503);
    assert_eq!(
        call(
            &app,
            "POST",
            "/v1/completions",
            Some(&tokens_body(&ids(7, 10), 1))
        )
        .await
        .0,
        503
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(call(&app, "GET", "/health", None).await.0, 200);
    let text = metrics(&app).await;
    assert_eq!(
        metric(&text, &format!("vllm:generation_tokens_total{LABELS}")),
        0.0,
        "counters restart at 0"
    );
}

#[tokio::test(start_paused = true)]
async fn an_aborted_stream_ends_with_an_error_event() {
    let (_replica, app) = start(config("r1")).await;
    let app2 = app.clone();
    let mut body = tokens_body(&ids(8, 100), 5000);
    body["stream"] = json!(true);
    let pending =
        tokio::spawn(async move { call(&app2, "POST", "/v1/completions", Some(&body)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    call(&app, "POST", "/admin/reset", None).await;
    let (status, _, text) = pending.await.unwrap();
    assert_eq!(status, 200, "the stream had started");
    let text = text.as_str().unwrap();
    assert!(text.contains("\"error\""), "{text}");
    assert!(!text.contains("[DONE]"));
}
