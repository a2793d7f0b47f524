//! OpenAI request bodies as vLLM's server reads them (`/v1/completions`,
//! `/v1/chat/completions`), for the simulator only: its own parser, so a parsing bug in the
//! router cannot hide behind an identical bug here.
//!
//! The body is read as a JSON object and each field the simulator uses is taken out of it with
//! a type check of its own; unknown fields are ignored (vLLM accepts extra fields with a
//! warning). Errors name the field (`messages[1].content[0].type`) and never quote prompt text:
//! they become vLLM's 400 `BadRequestError` body.
//!
//! What follows vLLM's protocol classes: `model` is optional (the first served model then), chat
//! takes `max_completion_tokens` before `max_tokens` (as Python's `or`, so a 0 falls through),
//! `stream_options` needs `stream: true`, `cache_salt` must be non-empty, `add_special_tokens`
//! defaults to true for completions and false for chat, `add_generation_prompt` to true.

mod chat;
mod fields;

use serde_json::{Map, Value};

pub use chat::{ChatMessage, ContentPart, Media, Modality};
use fields::Fields;

/// Which generation API a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

/// A completions `prompt` or chat `messages`, in the shape the body gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// A batch of text prompts (one choice each).
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts.
    TokenLists(Vec<Vec<u32>>),
    /// Chat messages.
    Chat(Vec<ChatMessage>),
}

/// One prompt of a (possibly batched) request, borrowed from it: what a tokenizer turns into ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PromptRef<'a> {
    /// Text.
    Text(&'a str),
    /// Token ids, used as given.
    Tokens(&'a [u32]),
    /// A conversation to render with the chat template.
    Chat(&'a [ChatMessage]),
}

/// How a prompt becomes tokens (vLLM's request fields of the same names).
#[derive(Debug, Clone, PartialEq)]
pub struct RenderOptions {
    /// Append the assistant turn's header after the conversation. Default true.
    pub add_generation_prompt: bool,
    /// Let the tokenizer add its special tokens (BOS...) on top of the text. Default true for
    /// completions, false for chat (the template writes them itself).
    pub add_special_tokens: bool,
    /// Extra variables for the chat template (`{"enable_thinking": false}`). Default none.
    pub chat_template_kwargs: Map<String, Value>,
    /// `tools` (chat), as sent.
    pub tools: Option<Value>,
    /// `documents` (chat), as sent.
    pub documents: Option<Value>,
    /// `reasoning_effort` (chat): also `enable_thinking` unless the kwargs set it.
    pub reasoning_effort: Option<String>,
}

impl Default for RenderOptions {
    /// A chat request's defaults.
    fn default() -> Self {
        RenderOptions {
            add_generation_prompt: true,
            add_special_tokens: false,
            chat_template_kwargs: Map::new(),
            tools: None,
            documents: None,
            reasoning_effort: None,
        }
    }
}

/// The fields of a generation request the simulator acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// The API.
    pub api: ApiKind,
    /// A served model or LoRA adapter name; `None` means the replica's first model.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage`, when given.
    pub include_usage: Option<bool>,
    /// Tokens to generate, when the request says (at least 1).
    pub max_tokens: Option<u32>,
    /// vLLM's `cache_salt`: keys the first block's hash, isolating this request's cache.
    pub cache_salt: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Rendering and tokenizing options.
    pub render: RenderOptions,
}

impl SimRequest {
    /// Each prompt of the request, in choice order (a batched completions prompt has several).
    pub fn prompts(&self) -> Vec<PromptRef<'_>> {
        match &self.prompt {
            Prompt::Text(t) => vec![PromptRef::Text(t)],
            Prompt::Texts(ts) => ts.iter().map(|t| PromptRef::Text(t)).collect(),
            Prompt::Tokens(ids) => vec![PromptRef::Tokens(ids)],
            Prompt::TokenLists(lists) => lists.iter().map(|l| PromptRef::Tokens(l)).collect(),
            Prompt::Chat(messages) => vec![PromptRef::Chat(messages)],
        }
    }
}

/// Why a body was refused (a 400 whose message is this error's text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON (the parser's message: a position, never content).
    #[error("the request body is not valid JSON: {0}")]
    Json(String),
    /// JSON, but not an object.
    #[error("the request body must be a JSON object")]
    NotObject,
    /// A required field is absent or null.
    #[error("missing required field `{0}`")]
    Missing(&'static str),
    /// A field has the wrong type or value.
    #[error("invalid `{field}`: {message}")]
    Invalid {
        /// Where, e.g. `messages[0].content[1].image_url`.
        field: String,
        /// What is wrong (types and limits, never the value of a text field).
        message: String,
    },
}

impl RequestError {
    /// The offending field, for the error body's `param`.
    pub fn param(&self) -> Option<&str> {
        match self {
            RequestError::Missing(field) => Some(field),
            RequestError::Invalid { field, .. } => Some(field),
            RequestError::Json(_) | RequestError::NotObject => None,
        }
    }

    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> RequestError {
        RequestError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Parses the body of a request to `api`.
pub fn parse(api: ApiKind, body: &[u8]) -> Result<SimRequest, RequestError> {
    // Parsed as a value first: a typed parse of a non-object would quote it in its error.
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
    let Value::Object(map) = value else {
        return Err(RequestError::NotObject);
    };
    let mut f = Fields::new(map);

    let model = f.string("model")?.filter(|m| !m.is_empty());
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        None => None,
        Some(_) if !stream => {
            return Err(RequestError::invalid(
                "stream_options",
                "stream options can only be defined when `stream=True`",
            ))
        }
        Some(options) => Fields::new(options)
            .nested("stream_options")
            .bool("include_usage")?,
    };
    let max_tokens = match api {
        ApiKind::ChatCompletions => match f.int("max_completion_tokens")? {
            Some(n) if n != 0 => Some(("max_completion_tokens", n)),
            _ => f.int("max_tokens")?.map(|n| ("max_tokens", n)),
        },
        ApiKind::Completions => f.int("max_tokens")?.map(|n| ("max_tokens", n)),
    };
    let max_tokens = match max_tokens {
        Some((field, n)) if n < 1 => {
            return Err(RequestError::invalid(
                field,
                format!("must be at least 1, got {n}"),
            ))
        }
        Some((_, n)) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
        None => None,
    };
    let cache_salt = match f.string("cache_salt")? {
        Some(salt) if salt.is_empty() => {
            return Err(RequestError::invalid(
                "cache_salt",
                "must be a non-empty string if provided",
            ))
        }
        salt => salt,
    };
    let chat = api == ApiKind::ChatCompletions;
    let render = RenderOptions {
        add_generation_prompt: f.bool("add_generation_prompt")?.unwrap_or(true),
        add_special_tokens: f.bool("add_special_tokens")?.unwrap_or(!chat),
        chat_template_kwargs: f.object("chat_template_kwargs")?.unwrap_or_default(),
        tools: if chat { f.array("tools")? } else { None },
        documents: if chat { f.array("documents")? } else { None },
        reasoning_effort: if chat {
            f.string("reasoning_effort")?
        } else {
            None
        },
    };
    let prompt = if chat {
        Prompt::Chat(chat::messages(f.take("messages"))?)
    } else {
        completion_prompt(f.take("prompt"))?
    };
    Ok(SimRequest {
        api,
        model,
        stream,
        include_usage,
        max_tokens,
        cache_salt,
        prompt,
        render,
    })
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of such arrays.
fn completion_prompt(value: Option<Value>) -> Result<Prompt, RequestError> {
    const FIELD: &str = "prompt";
    let items = match value {
        None | Some(Value::Null) => return Err(RequestError::Missing(FIELD)),
        Some(Value::String(text)) => return Ok(Prompt::Text(text)),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(RequestError::invalid(
                FIELD,
                format!(
                    "expected a string or an array, got {}",
                    fields::kind(&other)
                ),
            ))
        }
    };
    let mixed = || {
        RequestError::invalid(
            FIELD,
            "array elements must be all strings, all token ids, or all arrays of token ids",
        )
    };
    match items.first() {
        None => Err(RequestError::invalid(FIELD, "must not be an empty array")),
        Some(Value::String(_)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(mixed()),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::Texts),
        Some(Value::Number(_)) => fields::token_ids(&items, FIELD).map(Prompt::Tokens),
        Some(Value::Array(_)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::Array(ids) => fields::token_ids(ids, &format!("{FIELD}[{i}]")),
                _ => Err(mixed()),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::TokenLists),
        Some(_) => Err(mixed()),
    }
}

#[cfg(test)]
mod tests;
