//! Chat `messages` as vLLM's `parse_chat_messages` reads them: a role, content as a string, a
//! list of parts or null, and the assistant/tool extras a chat template may print.
//!
//! Content parts follow vLLM's part parser: text-like parts (`text`, `input_text`,
//! `output_text`, `refusal`, `thinking`; a bare string) give text, a text part whose text is null
//! is skipped; media parts (`image_url`, `input_image`, `image_embeds`, `audio_url`,
//! `input_audio`, `audio_embeds`, `video_url`, and `file`, which vLLM does not take but clients
//! send) give a [`Media`] item identified by its `uuid` when the part has one, else by a hash of
//! its URL or inline data; a part without `type` is recognised by its media key; any other type
//! is refused.

use serde_json::{Map, Value};
use xxhash_rust::xxh3::Xxh3;

use super::fields::{kind, Fields};
use super::RequestError;

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer` or any custom role.
    pub role: String,
    /// The content's parts, in order (a string is one text part; null is none).
    pub content: Vec<ContentPart>,
    /// `name`, when given.
    pub name: Option<String>,
    /// `tool_call_id` of a `tool` message.
    pub tool_call_id: Option<String>,
    /// `tool_calls` of an `assistant` message, each `function.arguments` decoded from its JSON
    /// string into a value (vLLM does this for templates; invalid JSON becomes `{}`).
    pub tool_calls: Option<Vec<Value>>,
    /// `reasoning` (or the older `reasoning_content`) of an `assistant` message.
    pub reasoning: Option<String>,
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    /// Text.
    Text(String),
    /// An image, audio clip, video or file.
    Media(Media),
}

/// A multimodal item: its kind and a 64-bit identity (it keys the KV blocks it overlaps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Media {
    /// What kind of item.
    pub modality: Modality,
    /// xxh3 of the modality and the part's `uuid`, or of its URL / inline data.
    pub hash: u64,
}

/// The kind of a media item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Modality {
    /// `image_url`, `input_image`, `image_embeds`.
    Image,
    /// `audio_url`, `input_audio`, `audio_embeds`.
    Audio,
    /// `video_url`.
    Video,
    /// `file` (not a vLLM part type; accepted so clients that send files still get a prompt).
    File,
}

impl Modality {
    /// The part type a chat template sees for this item (`{"type": "image"}`).
    pub fn as_str(self) -> &'static str {
        match self {
            Modality::Image => "image",
            Modality::Audio => "audio",
            Modality::Video => "video",
            Modality::File => "file",
        }
    }
}

/// Parses `messages`.
pub(super) fn messages(value: Option<Value>) -> Result<Vec<ChatMessage>, RequestError> {
    let items = match value {
        None | Some(Value::Null) => return Err(RequestError::Missing("messages")),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(RequestError::invalid(
                "messages",
                format!("expected an array of messages, got {}", kind(&other)),
            ))
        }
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| message(item, &format!("messages[{i}]")))
        .collect()
}

fn message(value: Value, path: &str) -> Result<ChatMessage, RequestError> {
    let Value::Object(map) = value else {
        return Err(RequestError::invalid(
            path,
            format!("expected a message object, got {}", kind(&value)),
        ));
    };
    let mut f = Fields::new(map).nested(path);
    let role = f
        .string("role")?
        .ok_or_else(|| RequestError::invalid(f.path_of("role"), "a message needs a role"))?;
    let content_path = f.path_of("content");
    let content = match f.take("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => vec![ContentPart::Text(text)],
        Some(Value::Array(parts)) => parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| content_part(part, &format!("{content_path}[{i}]")))
            .filter_map(Result::transpose)
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(RequestError::invalid(
                content_path,
                format!(
                    "expected a string, an array of content parts or null, got {}",
                    kind(&other)
                ),
            ))
        }
    };
    let name = f.string("name")?;
    let tool_call_id = f.string("tool_call_id")?;
    let tool_calls = match f.take("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) => Some(calls.into_iter().map(decode_arguments).collect()),
        Some(other) => {
            return Err(RequestError::invalid(
                f.path_of("tool_calls"),
                format!("expected an array, got {}", kind(&other)),
            ))
        }
    };
    let reasoning = match f.string("reasoning")? {
        Some(r) => Some(r),
        None => f.string("reasoning_content")?,
    };
    Ok(ChatMessage {
        role,
        content,
        name,
        tool_call_id,
        tool_calls,
        reasoning,
    })
}

/// vLLM hands templates `function.arguments` as a value, not the JSON string the API carries.
fn decode_arguments(mut call: Value) -> Value {
    if let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) {
        let decoded = match function.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_default(),
            Some(v @ (Value::Object(_) | Value::Array(_))) => v.clone(),
            _ => Value::Object(Map::new()),
        };
        let decoded = if decoded.is_null() {
            Value::Object(Map::new())
        } else {
            decoded
        };
        function.insert("arguments".into(), decoded);
    }
    call
}

/// Media keys a part without `type` (or with a `uuid`) is recognised by, in vLLM's order.
const UNTYPED_MEDIA_KEYS: [&str; 6] = [
    "image_url",
    "image_embeds",
    "audio_embeds",
    "audio_url",
    "input_audio",
    "video_url",
];

/// One content part; `Ok(None)` for a text part without text (vLLM skips it).
fn content_part(value: Value, path: &str) -> Result<Option<ContentPart>, RequestError> {
    let map = match value {
        Value::String(text) => return Ok(Some(ContentPart::Text(text))),
        Value::Object(map) => map,
        other => {
            return Err(RequestError::invalid(
                path,
                format!("expected a content part object, got {}", kind(&other)),
            ))
        }
    };
    let mut f = Fields::new(map).nested(path);
    let uuid = match f.take("uuid") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(v @ Value::Number(_)) => Some(v.to_string()),
        Some(other) => {
            return Err(RequestError::invalid(
                f.path_of("uuid"),
                format!("expected a string, got {}", kind(&other)),
            ))
        }
    };
    let part_type = match f.take("type") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t),
        Some(other) => {
            return Err(RequestError::invalid(
                f.path_of("type"),
                format!("expected a string, got {}", kind(&other)),
            ))
        }
    };
    let part_type = match part_type {
        Some(t) if uuid.is_none() => t,
        // vLLM: with a uuid, or without a type, the part is whatever media key it carries.
        typed => match UNTYPED_MEDIA_KEYS.iter().find(|k| f.has(k)) {
            Some(key) => (*key).to_string(),
            None => match typed {
                Some(t) => t,
                None => {
                    return Err(RequestError::invalid(
                        f.path_of("type"),
                        "a content part needs a `type`",
                    ))
                }
            },
        },
    };
    let text = |f: &mut Fields, key: &str| -> Result<Option<ContentPart>, RequestError> {
        Ok(f.string(key)?.map(ContentPart::Text))
    };
    let modality = match part_type.as_str() {
        "text" | "input_text" | "output_text" => return text(&mut f, "text"),
        "refusal" => return text(&mut f, "refusal"),
        "thinking" => return text(&mut f, "thinking"),
        "tool_reference" => return text(&mut f, "name"),
        "image_url" | "input_image" | "image_embeds" => Modality::Image,
        "audio_url" | "input_audio" | "audio_embeds" => Modality::Audio,
        "video_url" => Modality::Video,
        "file" => Modality::File,
        other => {
            return Err(RequestError::invalid(
                f.path_of("type"),
                format!(
                    "unsupported chat content part type {:?}",
                    other.chars().take(64).collect::<String>()
                ),
            ))
        }
    };
    let key = match part_type.as_str() {
        "input_image" => "image_url",
        key => key,
    };
    let identity = match &uuid {
        Some(uuid) => Identity::Uuid(uuid),
        None => Identity::Content(media_source(f.take(key), &f.path_of(key))?),
    };
    Ok(Some(ContentPart::Media(Media {
        modality,
        hash: media_hash(modality, identity),
    })))
}

enum Identity<'a> {
    Uuid(&'a str),
    Content(String),
}

/// The string that identifies a media item: a URL (data URLs included) or inline data. An
/// object gives its `url`, else `data` (with `format` for audio), else `file_data` / `file_id`;
/// an embeddings object (several named tensors) gives its values in key order.
fn media_source(value: Option<Value>, path: &str) -> Result<String, RequestError> {
    let missing = || RequestError::invalid(path, "a media part needs a URL or inline data");
    match value {
        None | Some(Value::Null) => Err(missing()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Object(mut map)) => {
            for key in ["url", "data", "file_data", "file_id"] {
                if let Some(Value::String(s)) = map.remove(key) {
                    return Ok(match map.get("format").and_then(Value::as_str) {
                        Some(format) if key == "data" => format!("{format};{s}"),
                        _ => s,
                    });
                }
            }
            let mut joined = String::new();
            for (k, v) in &map {
                if let Value::String(s) = v {
                    joined.push_str(k);
                    joined.push('=');
                    joined.push_str(s);
                    joined.push(';');
                }
            }
            if joined.is_empty() {
                Err(missing())
            } else {
                Ok(joined)
            }
        }
        Some(other) => Err(RequestError::invalid(
            path,
            format!("expected a URL string or an object, got {}", kind(&other)),
        )),
    }
}

fn media_hash(modality: Modality, identity: Identity<'_>) -> u64 {
    let mut h = Xxh3::new();
    h.update(modality.as_str().as_bytes());
    match identity {
        Identity::Uuid(uuid) => {
            h.update(b"\0uuid\0");
            h.update(uuid.as_bytes());
        }
        Identity::Content(source) => {
            h.update(b"\0content\0");
            h.update(source.as_bytes());
        }
    }
    h.digest()
}

impl Fields {
    fn has(&self, key: &str) -> bool {
        self.peek(key).is_some_and(|v| !v.is_null())
    }
}
