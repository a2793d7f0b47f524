//! Client-side helpers of the end-to-end tests: OpenAI request bodies, a response as a test
//! reads it (status, the headers that say who served it, body), and SSE checks.

use std::net::SocketAddr;

/// A chat request body with a short system message and `text` as the user's.
pub fn chat_body(model: &str, text: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
    })
    .to_string()
}

/// `body` as a client uploading in two halves sends it: the second half once `gate` resolves
/// (a pause, or a step of the test).
pub fn split_upload(
    body: Vec<u8>,
    gate: impl std::future::Future<Output = ()> + Send + 'static,
) -> reqwest::Body {
    use futures::StreamExt;
    let mut first = body;
    let second = first.split_off(first.len() / 2);
    let first = futures::stream::once(async move { Ok::<_, std::io::Error>(first) });
    let second = futures::stream::once(async move {
        gate.await;
        Ok::<_, std::io::Error>(second)
    });
    reqwest::Body::wrap_stream(first.chain(second))
}

/// A completion request body.
pub fn completion_body(model: &str, prompt: &str, stream: bool, max_tokens: u32) -> String {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": max_tokens, "prompt": prompt})
        .to_string()
}

/// A response as the test sees it.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// `x-kvsim-replica`: the replica that generated it.
    pub replica: Option<String>,
    /// `x-kvrouter-upstream`: the upstream Envoy reports it went to.
    pub upstream: Option<String>,
    /// `retry-after`.
    pub retry_after: Option<String>,
    /// `content-type`.
    pub content_type: Option<String>,
    /// The whole body.
    pub body: String,
}

/// POSTs the JSON `body` to `path` on `addr` and reads the whole response; panics if no
/// response arrives.
pub async fn post(client: &reqwest::Client, addr: SocketAddr, path: &str, body: String) -> Reply {
    let resp = client
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {addr}{path}: {e}"));
    reply(resp).await
}

/// Reads a whole response.
pub async fn reply(resp: reqwest::Response) -> Reply {
    let header = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (status, replica, upstream, retry_after, content_type) = (
        resp.status().as_u16(),
        header("x-kvsim-replica"),
        header("x-kvrouter-upstream"),
        header("retry-after"),
        header("content-type"),
    );
    let body = resp.text().await.expect("response body");
    Reply {
        status,
        replica,
        upstream,
        retry_after,
        content_type,
        body,
    }
}

/// Checks an SSE body is a complete generation of `tokens` tokens: one event per token (plus
/// vLLM's leading role event for chat), a usage event, then `[DONE]`.
pub fn assert_complete_stream(body: &str, tokens: u64) {
    let events = sse_events(body);
    assert!(events.len() >= 2, "no usage and [DONE] events: {body}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let usage: serde_json::Value =
        serde_json::from_str(&events[events.len() - 2]).expect("usage event");
    assert_eq!(usage["usage"]["completion_tokens"], tokens, "{usage}");
    let with_text = events[..events.len() - 2]
        .iter()
        .filter(|e| {
            let v: serde_json::Value = serde_json::from_str(e).expect("event JSON");
            let c = &v["choices"][0];
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .is_some_and(|t| !t.is_empty())
        })
        .count() as u64;
    assert_eq!(with_text, tokens, "one event per generated token");
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_the_data_payloads() {
        let body = "data: {\"a\":1}\n\ndata: [DONE]\n\n";
        assert_eq!(sse_events(body), ["{\"a\":1}", "[DONE]"]);
    }
}
