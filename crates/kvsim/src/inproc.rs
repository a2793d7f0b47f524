//! Drives a replica in process, for the simulator's tests and the router's benchmarks: its HTTP
//! routes are called without sockets, so a paused tokio clock measures simulated time exactly.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::{http, Replica, ReplicaConfig};
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::time::Instant;
use tower::ServiceExt;

/// A replica config with a small KV cache and fast defaults for tests.
pub fn config(name: &str) -> ReplicaConfig {
    ReplicaConfig {
        name: name.into(),
        models: vec!["m".into()],
        ..ReplicaConfig::default()
    }
}

/// Starts a replica (engine task included) and returns its routes.
pub async fn start(cfg: ReplicaConfig) -> (Arc<Replica>, Router) {
    let replica = Replica::start(cfg).await.expect("replica starts");
    let router = http::routes(&replica);
    (replica, router)
}

fn request(
    method: &str,
    path: &str,
    body: Option<&Value>,
    peer: [u8; 4],
) -> Request<axum::body::Body> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(match body {
            Some(v) => axum::body::Body::from(v.to_string()),
            None => axum::body::Body::empty(),
        })
        .expect("request builds");
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((peer, 40000))));
    req
}

/// Sends a request from `peer`; returns status, headers and the body as JSON (or a string).
pub async fn call_from(
    app: &Router,
    method: &str,
    path: &str,
    body: Option<&Value>,
    peer: [u8; 4],
) -> (StatusCode, HeaderMap, Value) {
    let resp = app
        .clone()
        .oneshot(request(method, path, body, peer))
        .await
        .expect("router answers");
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, headers, value)
}

/// Sends a request from loopback.
pub async fn call(
    app: &Router,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (StatusCode, HeaderMap, Value) {
    call_from(app, method, path, body, [127, 0, 0, 1]).await
}

/// What a streamed completion looked like to its client.
#[derive(Debug)]
pub struct Streamed {
    /// From sending the request to the first token's chunk.
    pub ttft: Duration,
    /// From sending to the end of the stream.
    pub e2e: Duration,
    /// Every `data:` payload parsed as JSON (`[DONE]` excluded).
    pub chunks: Vec<Value>,
    /// True when the stream ended with `data: [DONE]`.
    pub done: bool,
}

impl Streamed {
    /// The final chunk's `usage`.
    pub fn usage(&self) -> &Value {
        &self.chunks.last().expect("chunks")["usage"]
    }

    /// `usage.prompt_tokens_details.cached_tokens`.
    pub fn cached_tokens(&self) -> u64 {
        self.usage()["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens")
    }
}

/// Streams `body` (with `stream: true` added) to `path` and times it on the tokio clock.
pub async fn stream(app: &Router, path: &str, mut body: Value) -> Streamed {
    body["stream"] = Value::Bool(true);
    let start = Instant::now();
    let resp = app
        .clone()
        .oneshot(request("POST", path, Some(&body), [127, 0, 0, 1]))
        .await
        .expect("router answers");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("frame");
        if let Some(data) = frame.data_ref() {
            let s = std::str::from_utf8(data).expect("utf-8");
            if ttft.is_none() && (s.contains("\"text\":") || s.contains("\"content\":\"l")) {
                ttft = Some(start.elapsed());
            }
            text.push_str(s);
        }
    }
    let e2e = start.elapsed();
    let mut chunks = Vec::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("SSE data line");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("chunk is JSON"));
        }
    }
    Streamed {
        ttft: ttft.expect("a token arrived"),
        e2e,
        chunks,
        done,
    }
}

/// A completions body with a token-id prompt.
pub fn tokens_body(ids: &[u32], max_tokens: u32) -> Value {
    serde_json::json!({"model": "m", "prompt": ids, "max_tokens": max_tokens})
}

/// Deterministic token ids, distinct per `seed`.
pub fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (seed.wrapping_mul(7919).wrapping_add(i.wrapping_mul(31))) % 30_000)
        .collect()
}

/// The value of the first series in a Prometheus text that starts with `series`.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{series} not found"))
}

/// `GET /metrics` as text.
pub async fn metrics(app: &Router) -> String {
    match call(app, "GET", "/metrics", None).await {
        (StatusCode::OK, _, Value::String(text)) => text,
        other => panic!("unexpected /metrics answer {other:?}"),
    }
}

/// tokio timers fire on millisecond ticks: an observed duration is the simulated one rounded
/// up to the next millisecond (never accumulated over steps).
pub fn assert_close_ms(observed: Duration, expected_ms: f64) {
    let got = observed.as_secs_f64() * 1e3;
    assert!(
        got >= expected_ms - 1e-6 && got < expected_ms + 1.0,
        "observed {got} ms, profile says {expected_ms} ms"
    );
}
