//! OpenAI-style request bodies: parse what routing needs, borrow the rest, reject bad input with
//! a message that names the field.
//!
//! Parsing borrows strings from the body buffer where JSON escapes allow, so a multi-megabyte
//! prompt is not copied. Unknown fields are skipped (clients send many we do not route on).
//! Nothing here logs: the prompt never leaves the returned value, and no error carries input
//! text (field names, JSON type names and limits only; see `errors`).
//!
//! - `raw`: the top-level object, one pass, only the fields routing reads.
//! - `body`: prompts, chat messages and content parts.
//! - `leaf`: strings, flags, counts and token ids, whose type errors name no value.
//! - `limits`: [`RequestLimits`] (messages, content parts), enforced while parsing.
//! - `errors`: serde errors to [`RequestError`], and [`model_for_display`].

mod body;
mod errors;
mod leaf;
mod limits;
mod raw;

use std::borrow::Cow;

pub use body::{ChatMessage, ContentPart, MessageExtra, PromptInput};
pub use errors::{model_for_display, MAX_SHOWN_MODEL_BYTES};
pub use limits::{RequestLimits, DEFAULT_MAX_CONTENT_PARTS, DEFAULT_MAX_MESSAGES};

/// Which OpenAI API a request path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// Any other path (routed by `model` when the body has one, else to any endpoint).
    Other,
}

impl ApiKind {
    /// Classifies a request `:path` (query string ignored).
    pub fn from_path(path: &str) -> ApiKind {
        let path = path.split(['?', '#']).next().unwrap_or("");
        let path = path.trim_end_matches('/');
        match path {
            "/v1/completions" => ApiKind::Completions,
            "/v1/chat/completions" => ApiKind::ChatCompletions,
            "/v1/embeddings" => ApiKind::Embeddings,
            _ => ApiKind::Other,
        }
    }

    /// A short label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::Completions => "completions",
            ApiKind::ChatCompletions => "chat",
            ApiKind::Embeddings => "embeddings",
            ApiKind::Other => "other",
        }
    }
}

/// What the prompt is, in the shape the API gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt<'a> {
    /// A completions `prompt` or embeddings `input`.
    Input(PromptInput<'a>),
    /// Chat `messages`.
    Chat(Vec<ChatMessage<'a>>),
    /// No prompt (a request to another path).
    None,
}

impl Prompt<'_> {
    /// Bytes of prompt text plus 4 bytes per given token id: the size the byte-estimate token
    /// count is based on.
    pub fn text_bytes(&self) -> usize {
        match self {
            Prompt::Input(input) => input.text_bytes(),
            Prompt::Chat(messages) => messages.iter().map(ChatMessage::text_bytes).sum(),
            Prompt::None => 0,
        }
    }
}

/// The fields of a request that routing uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest<'a> {
    /// Which API.
    pub api: ApiKind,
    /// The `model` field: a served model name or a LoRA adapter name.
    pub model: Cow<'a, str>,
    /// `stream: true`.
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`, if given.
    pub max_tokens: Option<u64>,
    /// vLLM's `cache_salt`: isolates this request's prefix cache from others'.
    pub cache_salt: Option<Cow<'a, str>>,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// What a chat template sees beside the messages (chat requests).
    pub chat: ChatOptions,
}

/// The fields of a chat request that vLLM hands its chat template beside the messages
/// (`tools`, `documents`, `chat_template_kwargs`, `add_generation_prompt`, `reasoning_effort`),
/// so the prompt kvrouter hashes is the one the engine renders. JSON values are kept as sent
/// (key order too); none of them is echoed in an error.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatOptions {
    /// `tools` (not null).
    pub tools: Option<serde_json::Value>,
    /// `documents` (not null).
    pub documents: Option<serde_json::Value>,
    /// `chat_template_kwargs`: extra template variables.
    pub template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// `add_generation_prompt` (vLLM's default: true).
    pub add_generation_prompt: Option<bool>,
    /// `reasoning_effort`: also `enable_thinking` (unless the kwargs set it), as vLLM does.
    pub reasoning_effort: Option<String>,
}

impl ChatOptions {
    /// Takes the request field `key`'s value: a value of a shape vLLM would not accept is
    /// left out (the engine answers that request itself); booleans as pydantic reads them
    /// leniently ("yes", "off", 0...).
    pub(crate) fn take(&mut self, key: &str, value: serde_json::Value) {
        use serde_json::Value as J;
        match key {
            "tools" => self.tools = Some(value).filter(J::is_array),
            "documents" => self.documents = Some(value).filter(J::is_array),
            "chat_template_kwargs" => {
                self.template_kwargs = match value {
                    J::Object(map) => Some(map),
                    _ => None,
                }
            }
            "add_generation_prompt" => self.add_generation_prompt = lenient_bool(&value),
            "reasoning_effort" => self.reasoning_effort = value.as_str().map(str::to_owned),
            _ => {}
        }
    }
}

/// A boolean as pydantic's lax mode reads one.
fn lenient_bool(value: &serde_json::Value) -> Option<bool> {
    match value {
        serde_json::Value::Bool(b) => Some(*b),
        serde_json::Value::Number(n) => {
            let x = n.as_f64()?;
            (x == 1.0 || x == 0.0).then_some(x == 1.0)
        }
        serde_json::Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

/// Why a body was rejected. Shown to the client in a 400 (or, for [`RequestError::TooLarge`],
/// 413) error, so no variant carries input text: field paths, JSON type names, line/column
/// numbers and limits only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Not parseable as JSON (serde_json's syntax message: a fixed text with a line and column).
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    /// JSON, but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// A required field is absent (or null).
    #[error("missing required field `{0}`")]
    Missing(&'static str),
    /// A field has the wrong type or value.
    #[error("invalid field `{field}`: {message}")]
    Invalid {
        /// Path of the field, e.g. `messages[1].content`.
        field: String,
        /// What is wrong with it: the expected shape and the JSON type given, never the value.
        message: String,
    },
    /// Over one of the [`RequestLimits`] (e.g. more messages than `routing.max_messages`).
    #[error("request has more than {limit} {field}, the router's limit")]
    TooLarge {
        /// What was counted: `messages` or `content parts`.
        field: &'static str,
        /// The limit.
        limit: usize,
    },
}

impl RequestError {
    /// The offending field, for the OpenAI error body's `param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            RequestError::Missing(field) => Some(field),
            RequestError::Invalid { field, .. } => Some(field),
            RequestError::TooLarge { field, .. } => Some(match *field {
                "content parts" => "messages",
                other => other,
            }),
            _ => None,
        }
    }

    /// The HTTP status to answer with: 413 for [`RequestError::TooLarge`], else 400.
    pub fn http_status(&self) -> u16 {
        match self {
            RequestError::TooLarge { .. } => 413,
            _ => 400,
        }
    }
}

/// Parses the body of a request to `api` within the default [`RequestLimits`].
///
/// Errors name the offending field. `Other` APIs only need `model` if the body is a JSON object
/// that has one; anything else returns `Ok` with an empty model (route to any endpoint).
pub fn parse(api: ApiKind, body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    parse_with(api, body, RequestLimits::default())
}

/// Parses the body of a request to `api`; more messages or content parts than `limits` allow
/// is [`RequestError::TooLarge`], found after reading at most one element past the limit.
pub fn parse_with(
    api: ApiKind,
    body: &[u8],
    limits: RequestLimits,
) -> Result<ParsedRequest<'_>, RequestError> {
    let raw = match raw::RawRequest::from_slice(body, api, limits) {
        Ok(raw) => raw,
        Err(_) if api == ApiKind::Other => return Ok(unrouted(api)),
        Err(e) => return Err(e),
    };
    let stream = raw.stream.unwrap_or(false);
    let max_tokens = raw.max_completion_tokens.or(raw.max_tokens);
    let prompt = match api {
        ApiKind::ChatCompletions => {
            let messages = raw.messages.ok_or(RequestError::Missing("messages"))?;
            if messages.is_empty() {
                return Err(RequestError::Invalid {
                    field: "messages".into(),
                    message: "must contain at least one message".into(),
                });
            }
            Prompt::Chat(messages)
        }
        ApiKind::Completions => Prompt::Input(raw.prompt.ok_or(RequestError::Missing("prompt"))?),
        ApiKind::Embeddings => Prompt::Input(raw.input.ok_or(RequestError::Missing("input"))?),
        ApiKind::Other => Prompt::None,
    };
    let model = match raw.model {
        Some(model) if model.trim().is_empty() => {
            return Err(RequestError::Invalid {
                field: "model".into(),
                message: "must not be empty".into(),
            })
        }
        Some(model) => model,
        None if api == ApiKind::Other => Cow::Borrowed(""),
        None => return Err(RequestError::Missing("model")),
    };
    Ok(ParsedRequest {
        api,
        model,
        stream,
        max_tokens,
        cache_salt: raw.cache_salt,
        prompt,
        chat: raw.chat,
    })
}

fn unrouted(api: ApiKind) -> ParsedRequest<'static> {
    ParsedRequest {
        api,
        model: Cow::Borrowed(""),
        stream: false,
        max_tokens: None,
        cache_salt: None,
        prompt: Prompt::None,
        chat: ChatOptions::default(),
    }
}

#[cfg(test)]
mod tests;
