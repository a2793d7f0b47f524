//! Turning parse failures into [`RequestError`]s that carry no input text, and showing a
//! client-sent model name only when it looks like one.
//!
//! What an error may contain: field names of the OpenAI schema, array indices, JSON type names,
//! the expected shape, line/column numbers and our own limits. What it never contains: a string
//! value, a number value, an unknown key or an unknown model name from the body. The visitors of
//! [`super::leaf`] make serde's data errors follow that rule; this module checks it again (a
//! message with a quote in it is replaced) and rebuilds the field path from known names only.

use std::borrow::Cow;

use serde_path_to_error::{Path, Segment};

use super::RequestError;

/// The longest path segment shown as-is; longer keys are shown as `?`.
const MAX_KEY_CHARS: usize = 32;

/// Classifies a serde_json error at `path` (none for errors outside any field).
pub(super) fn classify(path: Option<Path>, err: serde_json::Error) -> RequestError {
    use serde_json::error::Category;
    let field = path.as_ref().map(field_path).unwrap_or_default();
    match err.classify() {
        Category::Data if field.is_empty() => RequestError::NotObject,
        Category::Data => RequestError::Invalid {
            field,
            message: data_message(&err.to_string()),
        },
        // serde_json's syntax and end-of-input messages are fixed texts plus a line and column
        // ("expected `,` or `]` at line 1 column 9"); they never quote the input.
        Category::Syntax | Category::Eof => RequestError::Json(err.to_string()),
        Category::Io => RequestError::Json("the body could not be read".into()),
    }
}

/// The path of a field, e.g. `messages[1].content[0].image_url`, from schema-like names only:
/// a key that is not a short lowercase identifier (a client's own key) is shown as `?`.
fn field_path(path: &Path) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(if is_schema_name(key) { key } else { "?" });
            }
            Segment::Unknown => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    out
}

fn is_schema_name(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_CHARS
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// A data error's message without serde_json's " at line L column C" (the field path says
/// more). Our visitors never put a value in a message; should one ever carry a quoted value
/// (serde's default wording, `invalid type: string "..."`), a generic text replaces it.
fn data_message(message: &str) -> String {
    let message = match message.rfind(" at line ") {
        Some(i) => &message[..i],
        None => message,
    };
    if message.contains(['"', '\'']) {
        "has the wrong type or value".to_string()
    } else {
        message.to_string()
    }
}

/// The longest model name echoed in an error, in bytes.
pub const MAX_SHOWN_MODEL_BYTES: usize = 128;

/// A client-sent model name as it may appear in an error message or a log line: itself when it
/// looks like a model name (at most [`MAX_SHOWN_MODEL_BYTES`] bytes of ASCII letters, digits and
/// `. _ - : / @ +`, as Hugging Face ids and LoRA names are), else a description that quotes none
/// of it (`a model name of 734 bytes (not shown)`). A prompt pasted into `model` has spaces or
/// is long, so it is never echoed; a short token-like secret could be, which is why nothing the
/// router echoes is more than the client itself sent.
pub fn model_for_display(model: &str) -> Cow<'_, str> {
    let safe = !model.is_empty()
        && model.len() <= MAX_SHOWN_MODEL_BYTES
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/@+".contains(&b));
    if safe {
        Cow::Borrowed(model)
    } else {
        Cow::Owned(format!("a model name of {} bytes (not shown)", model.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_shown_only_when_they_look_like_one() {
        for shown in [
            "meta-llama/Llama-3.1-8B-Instruct",
            "qwen3:8b",
            "lora@v2+x",
            "a_b.c",
        ] {
            assert_eq!(model_for_display(shown), shown);
        }
        let prompt = "Summarise the following confidential memo";
        assert_eq!(
            model_for_display(prompt),
            format!("a model name of {} bytes (not shown)", prompt.len())
        );
        for hidden in ["", "x\"y", "naïve", &"a".repeat(129), "a\nb"] {
            assert!(
                model_for_display(hidden).ends_with("(not shown)"),
                "{hidden:?}"
            );
        }
    }

    #[test]
    fn quoted_values_never_survive() {
        assert_eq!(
            data_message("invalid type: string \"SECRET\", expected a boolean at line 1 column 9"),
            "has the wrong type or value"
        );
        assert_eq!(
            data_message("expected a boolean, got a string at line 1 column 9"),
            "expected a boolean, got a string"
        );
    }
}
