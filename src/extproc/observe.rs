//! Watching a replica's response go by: status, time of the first body byte, and the `usage`
//! object at its end (OpenAI JSON or the last SSE event), without buffering the body.
//!
//! Only the last [`TAIL_BYTES`] of the body are kept: `usage` comes last in both a JSON response
//! and an SSE stream (with `stream_options.include_usage`), so the tail is enough and memory per
//! stream stays bounded whatever the response size.

use std::time::Instant;

use serde::Deserialize;

/// How much of the body's end is kept to find `usage` in.
pub const TAIL_BYTES: usize = 16 * 1024;

/// Token counts a replica reported for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens as the engine counted them.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache (vLLM with
    /// `--enable-prompt-tokens-details`), if reported.
    #[serde(default, deserialize_with = "cached_tokens")]
    #[serde(rename = "prompt_tokens_details")]
    pub cached_tokens: Option<u64>,
}

fn cached_tokens<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(de)?.and_then(|d| d.cached_tokens))
}

/// What has been seen of one response so far.
#[derive(Debug, Default)]
pub struct ResponseObserver {
    /// HTTP status from the response headers.
    pub status: Option<u16>,
    /// Whether the body is an SSE stream.
    pub sse: bool,
    /// When the first body byte went by.
    pub first_byte_at: Option<Instant>,
    /// Body bytes seen.
    pub body_bytes: u64,
    tail: Vec<u8>,
}

impl ResponseObserver {
    /// Records the response headers.
    pub fn on_headers(&mut self, status: Option<u16>, content_type: Option<&str>) {
        self.status = status;
        self.sse = content_type.is_some_and(|ct| ct.starts_with("text/event-stream"));
    }

    /// Records a body chunk; returns true if it carried the first body byte.
    pub fn on_body(&mut self, chunk: &[u8], now: Instant) -> bool {
        self.body_bytes += chunk.len() as u64;
        let first = self.first_byte_at.is_none() && !chunk.is_empty();
        if first {
            self.first_byte_at = Some(now);
        }
        if chunk.len() >= TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&chunk[chunk.len() - TAIL_BYTES..]);
        } else {
            let overflow = (self.tail.len() + chunk.len()).saturating_sub(TAIL_BYTES);
            self.tail.drain(..overflow);
            self.tail.extend_from_slice(chunk);
        }
        first
    }

    /// The `usage` reported at the end of the body, if any: the last `"usage": {...}` object in
    /// the tail that parses.
    pub fn usage(&self) -> Option<Usage> {
        let tail = &self.tail;
        let needle = b"\"usage\"";
        let mut end = tail.len();
        while let Some(at) = find_last(&tail[..end], needle) {
            end = at;
            let rest = &tail[at + needle.len()..];
            let rest = skip_ws(rest);
            let Some(rest) = rest.strip_prefix(b":") else {
                continue;
            };
            let rest = skip_ws(rest);
            if !rest.starts_with(b"{") {
                continue; // "usage": null in an intermediate SSE chunk
            }
            let mut de = serde_json::Deserializer::from_slice(rest);
            if let Ok(usage) = Usage::deserialize(&mut de) {
                return Some(usage);
            }
        }
        None
    }
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| &hay[i..i + needle.len()] == needle)
}

fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_json_body_split_across_chunks() {
        let body = br#"{"id":"x","choices":[{"text":"hello"}],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        let mut o = ResponseObserver::default();
        o.on_headers(Some(200), Some("application/json"));
        let now = Instant::now();
        let (a, b) = body.split_at(60);
        assert!(o.on_body(a, now));
        assert!(!o.on_body(b, now));
        assert!(!o.sse);
        assert_eq!(
            o.usage(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 3,
                cached_tokens: Some(8)
            })
        );
    }

    #[test]
    fn usage_from_last_sse_event_ignoring_null_usage() {
        let mut o = ResponseObserver::default();
        o.on_headers(Some(200), Some("text/event-stream; charset=utf-8"));
        let now = Instant::now();
        o.on_body(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n",
            now,
        );
        o.on_body(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":null}}\n\ndata: [DONE]\n\n", now);
        assert!(o.sse);
        assert_eq!(
            o.usage(),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: None
            })
        );
    }

    #[test]
    fn no_usage_and_bounded_tail() {
        let mut o = ResponseObserver::default();
        let now = Instant::now();
        o.on_body(&vec![b'x'; TAIL_BYTES * 3], now);
        o.on_body(b"\"usage\": 5", now);
        assert_eq!(o.usage(), None);
        assert!(o.tail.len() <= TAIL_BYTES);
        assert_eq!(o.body_bytes, (TAIL_BYTES * 3 + 10) as u64);
        assert!(ResponseObserver::default().usage().is_none());
    }
}
