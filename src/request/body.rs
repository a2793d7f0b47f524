//! Typed, borrowing deserialization of the request body, with hand-written visitors for the
//! OpenAI union types so a wrong shape gets a precise message instead of "no variant matched".

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use super::RequestError;

/// The request fields we read; everything else is skipped.
#[derive(Debug, Deserialize)]
pub(super) struct RawRequest<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    pub cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub messages: Option<Vec<ChatMessage<'a>>>,
    #[serde(borrow, default)]
    pub prompt: Option<PromptInput<'a>>,
    #[serde(borrow, default)]
    pub input: Option<PromptInput<'a>>,
}

impl<'a> RawRequest<'a> {
    pub(super) fn from_slice(body: &'a [u8]) -> Result<Self, RequestError> {
        // serde would accept a JSON array as a struct in sequence form; requests are objects.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => Err(RequestError::NotObject),
                Err(e) => Err(RequestError::Json(e.to_string())),
            };
        }
        let mut de = serde_json::Deserializer::from_slice(body);
        let raw: RawRequest<'a> = match serde_path_to_error::deserialize(&mut de) {
            Ok(raw) => raw,
            Err(err) => return Err(classify(err)),
        };
        // Trailing garbage after the object is malformed JSON too.
        de.end().map_err(|e| RequestError::Json(e.to_string()))?;
        Ok(raw)
    }
}

fn classify(err: serde_path_to_error::Error<serde_json::Error>) -> RequestError {
    let path = err.path().to_string();
    let inner = err.into_inner();
    match inner.classify() {
        serde_json::error::Category::Data if path == "." => RequestError::NotObject,
        serde_json::error::Category::Data => RequestError::Invalid {
            field: path,
            message: strip_location(&inner.to_string()),
        },
        _ => RequestError::Json(inner.to_string()),
    }
}

/// serde_json appends " at line L column C" to data errors; the field path says more.
fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

/// A completions `prompt` / embeddings `input`: text, a batch of texts, token ids, or a batch of
/// token-id lists.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput<'a> {
    /// One prompt.
    Text(Cow<'a, str>),
    /// A batch of prompts.
    Texts(Vec<Cow<'a, str>>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

impl PromptInput<'_> {
    /// Bytes of text, plus 4 per token id.
    pub fn text_bytes(&self) -> usize {
        match self {
            PromptInput::Text(t) => t.len(),
            PromptInput::Texts(ts) => ts.iter().map(|t| t.len()).sum(),
            PromptInput::Tokens(ids) => ids.len() * 4,
            PromptInput::TokenLists(lists) => lists.iter().map(|l| l.len() * 4).sum(),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptInput<'a> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptInput<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, an array of strings, an array of token ids, or an array of arrays of token ids")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out: Option<PromptInput<'de>> = None;
        while let Some(elem) = seq.next_element::<PromptElement<'de>>()? {
            match (&mut out, elem) {
                (None, PromptElement::Text(t)) => out = Some(PromptInput::Texts(vec![t])),
                (None, PromptElement::Token(id)) => out = Some(PromptInput::Tokens(vec![id])),
                (None, PromptElement::Tokens(ids)) => {
                    out = Some(PromptInput::TokenLists(vec![ids]))
                }
                (Some(PromptInput::Texts(v)), PromptElement::Text(t)) => v.push(t),
                (Some(PromptInput::Tokens(v)), PromptElement::Token(id)) => v.push(id),
                (Some(PromptInput::TokenLists(v)), PromptElement::Tokens(ids)) => v.push(ids),
                _ => return Err(de::Error::custom(
                    "array elements must all be strings, all token ids, or all arrays of token ids",
                )),
            }
        }
        out.ok_or_else(|| de::Error::custom("must not be an empty array"))
    }
}

enum PromptElement<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptElement<'a> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptElement<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id, or an array of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptElement::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptElement::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptElement::Token)
                    .map_err(|_| E::custom(format!("token id {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Err(E::custom(format!("token id {v} is out of range")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptElement::Tokens(ids))
            }
        }
        de.deserialize_any(V)
    }
}

/// One chat message, reduced to what the prompt is made of.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessage<'a> {
    /// `system`, `user`, `assistant`, `tool`, `developer`...
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    /// The content, as parts (a plain string is one text part; null is no parts).
    #[serde(borrow, default, deserialize_with = "content")]
    pub content: Vec<ContentPart<'a>>,
}

impl ChatMessage<'_> {
    /// Bytes of text in this message (role included).
    pub fn text_bytes(&self) -> usize {
        self.role.len()
            + self
                .content
                .iter()
                .map(|p| match p {
                    ContentPart::Text(t) => t.len(),
                    _ => 0,
                })
                .sum::<usize>()
    }
}

/// One part of a message's content. Media are kept only as content hashes: they matter for
/// prefix identity (the same text with another image is another prefix), not their bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart<'a> {
    /// Text.
    Text(Cow<'a, str>),
    /// An image (`image_url`), as the xxh3 hash of its URL or data URL.
    Image(u64),
    /// Audio or video or a file, as the xxh3 hash of its data or URL.
    Media(u64),
}

fn content<'de, D: Deserializer<'de>>(de: D) -> Result<Vec<ContentPart<'de>>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<ContentPart<'de>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string, an array of content parts, or null")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(vec![ContentPart::Text(Cow::Borrowed(v))])
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(vec![ContentPart::Text(Cow::Owned(v.to_owned()))])
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut parts = Vec::new();
            while let Some(part) = seq.next_element::<RawPart<'de>>()? {
                parts.push(part.into_part().map_err(de::Error::custom)?);
            }
            Ok(parts)
        }
    }
    de.deserialize_any(V)
}

/// A content part object: `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
/// {"url": ...}}`, `{"type": "input_audio", "input_audio": {"data": ...}}` and the like.
#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    image_url: Option<MediaRef>,
    #[serde(default)]
    input_audio: Option<MediaRef>,
    #[serde(default)]
    video_url: Option<MediaRef>,
    #[serde(default)]
    file: Option<MediaRef>,
}

impl<'a> RawPart<'a> {
    fn into_part(self) -> Result<ContentPart<'a>, String> {
        let kind = self.kind.ok_or("content part is missing `type`")?;
        let media = |m: Option<MediaRef>, name: &str| {
            m.map(|m| m.0)
                .ok_or_else(|| format!("content part of type {name:?} is missing `{name}`"))
        };
        Ok(match kind.as_ref() {
            "text" | "input_text" => ContentPart::Text(
                self.text
                    .ok_or("content part of type \"text\" is missing `text`")?,
            ),
            "image_url" => ContentPart::Image(media(self.image_url, "image_url")?),
            "input_audio" => ContentPart::Media(media(self.input_audio, "input_audio")?),
            "video_url" => ContentPart::Media(media(self.video_url, "video_url")?),
            "file" => ContentPart::Media(media(self.file, "file")?),
            other => return Err(format!("unsupported content part type {other:?}")),
        })
    }
}

/// The content hash of a media reference: a URL string, or an object whose `url`, `data` or
/// `file_data` / `file_id` string identifies the media. Hashed while parsing so a large inline
/// image is never copied.
struct MediaRef(u64);

impl<'de> Deserialize<'de> for MediaRef {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MediaRef;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a URL string or an object with `url` or `data`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MediaRef(xxh3_64(v.as_bytes())))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut hash = None;
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match key.as_ref() {
                        "url" | "data" | "file_data" | "file_id" => {
                            let v = map.next_value::<Cow<'de, str>>()?;
                            hash.get_or_insert(xxh3_64(v.as_bytes()));
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                hash.map(MediaRef)
                    .ok_or_else(|| de::Error::custom("media reference has no `url` or `data`"))
            }
        }
        de.deserialize_any(V)
    }
}
