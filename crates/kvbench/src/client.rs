//! One streaming chat request, timed as a client sees it: time to the first generated token
//! (first SSE event with non-empty content), end of stream, the usage the replica reports
//! (`prompt_tokens`, `prompt_tokens_details.cached_tokens`, `completion_tokens`) and which
//! replica served it (`x-kvsim-replica`).

use std::time::Instant;

use futures::StreamExt;
use serde::{Deserialize, Serialize};

/// What happened to one request. Times are simulated ms since the run's start (real time
/// multiplied by the time scale).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Trace id.
    pub id: usize,
    /// Prefix group, conversation or tenant number.
    pub group: usize,
    /// Tenant, if any.
    pub tenant: Option<String>,
    /// When the trace wanted it sent.
    pub scheduled_ms: f64,
    /// When it was sent (later than scheduled if the concurrency cap held it back).
    pub sent_ms: f64,
    /// When the response's headers arrived (any status). Behind kvrouter's queue, for an
    /// admitted request this is about when it was dispatched: a replica answers with headers at
    /// once and streams the tokens after (older records have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers_ms: Option<f64>,
    /// When the first generated token arrived.
    pub first_token_ms: Option<f64>,
    /// When the response ended (or failed).
    pub end_ms: f64,
    /// HTTP status; 0 when no response arrived.
    pub status: u16,
    /// Why it failed, if it did (status, stream error, connection error, cancellation).
    pub error: Option<String>,
    /// The replica that answered (`x-kvsim-replica`).
    pub replica: Option<String>,
    /// Prompt tokens as the replica counted them.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the replica found in its prefix cache.
    pub cached_tokens: Option<u64>,
    /// Generated tokens.
    pub completion_tokens: Option<u64>,
    /// Sent straight to a replica, bypassing the router.
    #[serde(default)]
    pub bypassed: bool,
    /// The objective it was sent with (the objective header), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// The `retry-after` header of a response that was not a 200, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
}

impl RequestRecord {
    /// A complete answer: HTTP 200 and a stream that ended normally.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }

    /// Time to first token, simulated ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_ms.map(|t| t - self.sent_ms)
    }

    /// Send to end of stream, simulated ms.
    pub fn e2e_ms(&self) -> f64 {
        self.end_ms - self.sent_ms
    }
}

/// A clock converting real instants into simulated ms since a start.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    /// The run's start.
    pub t0: Instant,
    /// Simulated time runs this many times faster.
    pub scale: f64,
}

impl SimClock {
    /// Simulated ms from the start to `t` (0 before it).
    pub fn ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.t0).as_secs_f64() * 1000.0 * self.scale
    }

    /// Simulated ms until now.
    pub fn now_ms(&self) -> f64 {
        self.ms(Instant::now())
    }

    /// The real instant of simulated time `ms`.
    pub fn instant(&self, ms: f64) -> Instant {
        self.t0 + std::time::Duration::from_secs_f64((ms / self.scale / 1000.0).max(0.0))
    }
}

/// What a response told us.
#[derive(Debug, Default)]
pub struct Outcome {
    /// HTTP status (0: none).
    pub status: u16,
    /// Failure, if any.
    pub error: Option<String>,
    /// Serving replica.
    pub replica: Option<String>,
    /// When the response's headers arrived (any status).
    pub headers: Option<Instant>,
    /// First content token.
    pub first_token: Option<Instant>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// The `retry-after` header of a response that is not a 200.
    pub retry_after: Option<String>,
}

/// Sends one request and reads its SSE stream to the end.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Outcome {
    let mut out = Outcome::default();
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("connection: {}", short(&e.to_string())));
            return out;
        }
    };
    out.headers = Some(Instant::now());
    out.status = resp.status().as_u16();
    out.replica = resp
        .headers()
        .get(kvsim::REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if out.status != 200 {
        out.retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let text = resp.text().await.unwrap_or_default();
        out.error = Some(format!("HTTP {}: {}", out.status, short(&text)));
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                out.error = Some(format!("stream: {}", short(&e.to_string())));
                return out;
            }
        };
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            match parse_event(&event[..end], &mut out) {
                EventKind::Token if out.first_token.is_none() => out.first_token = Some(now),
                EventKind::Done => done = true,
                EventKind::Error(message) => out.error = Some(format!("stream error: {message}")),
                _ => {}
            }
        }
    }
    if !done && out.error.is_none() {
        out.error = Some("stream ended without [DONE]".into());
    }
    out
}

enum EventKind {
    Token,
    Other,
    Done,
    Error(String),
}

fn parse_event(event: &[u8], out: &mut Outcome) -> EventKind {
    let text = String::from_utf8_lossy(event);
    let Some(data) = text.trim().strip_prefix("data:") else {
        return EventKind::Other;
    };
    let data = data.trim();
    if data == "[DONE]" {
        return EventKind::Done;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
        return EventKind::Error("unparseable event".into());
    };
    if let Some(e) = v.get("error") {
        return EventKind::Error(short(e["message"].as_str().unwrap_or("error")));
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        out.prompt_tokens = u["prompt_tokens"].as_u64();
        out.completion_tokens = u["completion_tokens"].as_u64();
        out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .or(Some(0));
    }
    let c = &v["choices"][0];
    let content = c["delta"]["content"].as_str().or(c["text"].as_str());
    if content.is_some_and(|t| !t.is_empty()) {
        EventKind::Token
    } else {
        EventKind::Other
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn short(s: &str) -> String {
    let s = s.trim();
    if s.len() > 160 {
        let mut cut = 160;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}...", &s[..cut])
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_classified() {
        let mut out = Outcome::default();
        let role = br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert!(matches!(parse_event(role, &mut out), EventKind::Other));
        let token = br#"data: {"choices":[{"index":0,"delta":{"content":"lorem "}}]}"#;
        assert!(matches!(parse_event(token, &mut out), EventKind::Token));
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        assert!(matches!(parse_event(usage, &mut out), EventKind::Other));
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens, out.completion_tokens),
            (Some(10), Some(8), Some(2))
        );
        assert!(matches!(
            parse_event(b"data: [DONE]", &mut out),
            EventKind::Done
        ));
        let err = br#"data: {"error":{"message":"aborted"}}"#;
        assert!(matches!(parse_event(err, &mut out), EventKind::Error(m) if m == "aborted"));
    }

    #[test]
    fn clock_round_trips() {
        let c = SimClock {
            t0: Instant::now(),
            scale: 10.0,
        };
        let t = c.instant(1000.0);
        assert!((c.ms(t) - 1000.0).abs() < 1e-3);
        assert_eq!(c.ms(c.t0 - std::time::Duration::from_secs(1)), 0.0);
    }
}
