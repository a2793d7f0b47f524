//! OpenAI/vLLM response bodies: JSON errors, non-streaming responses and SSE chunks. Chunk
//! prefixes are built once per request so a token costs one small `format!`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::engine::Usage;
use super::tokenize::filler_piece;

/// An OpenAI/vLLM-style error response:
/// `{"error": {"message", "type", "param", "code"}}` (vLLM's `ErrorResponse`).
pub fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::FORBIDDEN => "PermissionDeniedError",
        StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": status.as_u16()}})),
    )
        .into_response()
}

/// The `usage` object, with `prompt_tokens_details.cached_tokens` as vLLM reports it.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Sums usages of a batched request's choices.
pub fn add_usage(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_tokens += u.cached_tokens;
    total.preemptions += u.preemptions;
}

/// The filler text of `count` generated tokens.
pub fn filler_text(count: u32) -> String {
    (0..count).map(filler_piece).collect()
}

/// What every chunk and response of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `cmpl-…` / `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model name the request used.
    pub model: String,
    /// Chat or completions.
    pub chat: bool,
}

impl ResponseMeta {
    /// The non-streaming response body.
    pub fn full_response(&self, choices: &[(u32, &'static str)], usage: &Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, &(count, finish))| {
                let text = filler_text(count);
                if self.chat {
                    json!({"index": i, "message": {"role": "assistant", "content": text, "tool_calls": []}, "logprobs": null, "finish_reason": finish, "stop_reason": null})
                } else {
                    json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null})
                }
            })
            .collect();
        let object = if self.chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": usage_json(usage)})
    }

    /// `data: {...}\n\n` up to the choice's `"index":`, for a streaming chunk.
    pub fn chunk_prefix(&self) -> String {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        format!(
            "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":",
            json_str(&self.id),
            self.created,
            json_str(&self.model)
        )
    }

    /// The chunk for generated token `index` of choice `choice`.
    pub fn token_chunk(
        &self,
        prefix: &str,
        choice: u32,
        index: u32,
        finish: Option<&str>,
    ) -> String {
        let finish = match finish {
            Some(f) => format!("\"{f}\""),
            None => "null".into(),
        };
        let piece = filler_piece(index);
        if self.chat {
            format!("{prefix}{choice},\"delta\":{{\"content\":\"{piece}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n")
        } else {
            format!("{prefix}{choice},\"text\":\"{piece}\",\"logprobs\":null,\"finish_reason\":{finish},\"stop_reason\":null}}]}}\n\n")
        }
    }

    /// The chat role chunk vLLM sends before a choice's first token.
    pub fn role_chunk(&self, prefix: &str, choice: u32) -> String {
        format!("{prefix}{choice},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n")
    }

    /// The final usage chunk (empty choices) followed by `data: [DONE]`.
    pub fn usage_and_done(&self, usage: &Usage) -> String {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage_json(usage)});
        format!("data: {chunk}\n\ndata: [DONE]\n\n")
    }

    /// The end of a stream without a usage chunk (`stream_options.include_usage: false`).
    pub fn done() -> &'static str {
        "data: [DONE]\n\n"
    }

    /// An error event ending a broken stream (no `[DONE]` follows, as vLLM).
    pub fn stream_error(message: &str) -> String {
        let body = json!({"error": {"message": message, "type": "InternalServerError", "param": null, "code": 500}});
        format!("data: {body}\n\n")
    }
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(chat: bool) -> ResponseMeta {
        ResponseMeta {
            id: "cmpl-1".into(),
            created: 7,
            model: "m\"x".into(),
            chat,
        }
    }

    fn parse_data(line: &str) -> Value {
        serde_json::from_str(line.trim().strip_prefix("data: ").unwrap()).unwrap()
    }

    #[test]
    fn chunks_are_valid_json_with_escaped_names() {
        for chat in [false, true] {
            let m = meta(chat);
            let p = m.chunk_prefix();
            let v = parse_data(&m.token_chunk(&p, 0, 1, Some("length")));
            assert_eq!(v["model"], "m\"x");
            assert_eq!(v["choices"][0]["finish_reason"], "length");
            let text = if chat {
                &v["choices"][0]["delta"]["content"]
            } else {
                &v["choices"][0]["text"]
            };
            assert_eq!(text, "ipsum ");
            if chat {
                let role = parse_data(&m.role_chunk(&p, 2));
                assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
                assert_eq!(role["choices"][0]["index"], 2);
            }
        }
        let done = meta(false).usage_and_done(&Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 0,
            preemptions: 0,
        });
        let mut parts = done.split("\n\n");
        let usage = parse_data(parts.next().unwrap());
        assert_eq!(usage["usage"]["total_tokens"], 5);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(parts.next(), Some("data: [DONE]"));
    }
}
