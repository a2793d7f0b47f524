//! The prompt-carrying parts of a body: completion prompts, chat messages and their content
//! parts, with hand-written visitors for the OpenAI union types (a wrong shape gets a precise
//! message instead of "no variant matched") and the message / content-part limits counted as
//! they are read.
//!
//! Every error names the expected shape and the JSON type it got, never a value: see
//! [`super::leaf`].

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use super::leaf::{reject, Text, TokenId, TokenIds};
use super::limits::Budget;

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
        de.deserialize_any(PromptVisitor(None))
    }
}

/// A `prompt` / `input` whose batch elements (texts, token-id lists) count as content parts
/// against the budget: each is ~24 bytes held for as few as 3 of the body (`"",` or `[],`), so
/// a 32 MiB batch of empty ones would take ~10x the body in memory.
pub(super) struct PromptSeed<'b>(pub(super) &'b Budget);

impl<'de, 'b> DeserializeSeed<'de> for PromptSeed<'b> {
    type Value = PromptInput<'de>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(PromptVisitor(Some(self.0)))
    }
}

/// Reads a prompt, counting batch elements against the budget when there is one.
struct PromptVisitor<'b>(Option<&'b Budget>);

impl<'de> Visitor<'de> for PromptVisitor<'_> {
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
            if let (Some(budget), PromptElement::Text(_) | PromptElement::Tokens(_)) =
                (self.0, &elem)
            {
                budget.take_part()?;
            }
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

    reject!(bool, num, null, map, bytes);
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
                TokenId::deserialize(de::value::U64Deserializer::<E>::new(v))
                    .map(|t| PromptElement::Token(t.0))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                TokenId::deserialize(de::value::I64Deserializer::<E>::new(v))
                    .map(|t| PromptElement::Token(t.0))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                TokenId::deserialize(de::value::F64Deserializer::<E>::new(v))
                    .map(|t| PromptElement::Token(t.0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                TokenIds::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(|t| PromptElement::Tokens(t.0))
            }
            reject!(bool, null, map, bytes);
        }
        de.deserialize_any(V)
    }
}

/// One chat message, reduced to what the prompt is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage<'a> {
    /// `system`, `user`, `assistant`, `tool`, `developer`...
    pub role: Cow<'a, str>,
    /// The content, as parts (a plain string is one text part; null is no parts).
    pub content: Vec<ContentPart<'a>>,
    /// Its other fields a chat template reads, if it has any.
    pub extra: Option<Box<MessageExtra<'a>>>,
}

/// The fields of a message beside role and content that vLLM hands the chat template.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MessageExtra<'a> {
    /// An assistant's `tool_calls`, as sent (not null).
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's `tool_call_id`.
    pub tool_call_id: Option<Cow<'a, str>>,
    /// `name`.
    pub name: Option<Cow<'a, str>>,
    /// An assistant's `reasoning` (interleaved thinking), else its deprecated
    /// `reasoning_content` (vLLM renames it before validating).
    pub reasoning: Option<Cow<'a, str>>,
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

    /// True when the message carries an image or other media part.
    pub fn has_media(&self) -> bool {
        self.content
            .iter()
            .any(|p| matches!(p, ContentPart::Image(_) | ContentPart::Media(_)))
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

/// Chat `messages`: at most `max_messages` of them (one element past the limit is skipped, not
/// parsed, before the parse is aborted).
pub(super) struct MessagesSeed<'b>(pub &'b Budget);

impl<'de, 'b> DeserializeSeed<'de> for MessagesSeed<'b> {
    type Value = Vec<ChatMessage<'de>>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de, 'b> Visitor<'de> for MessagesSeed<'b> {
    type Value = Vec<ChatMessage<'de>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let max = self.0.max_messages();
        let mut out = Vec::new();
        loop {
            if out.len() == max {
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(self.0.exceeded("messages", max));
                }
                return Ok(out);
            }
            match seq.next_element_seed(MessageSeed(self.0))? {
                Some(m) => out.push(m),
                None => return Ok(out),
            }
        }
    }
    reject!(bool, num, str, null, map, bytes);
}

struct MessageSeed<'b>(&'b Budget);

impl<'de, 'b> DeserializeSeed<'de> for MessageSeed<'b> {
    type Value = ChatMessage<'de>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de, 'b> Visitor<'de> for MessageSeed<'b> {
    type Value = ChatMessage<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut role: Option<Cow<'de, str>> = None;
        let mut content: Option<Vec<ContentPart<'de>>> = None;
        let mut extra = MessageExtra::default();
        let mut reasoning_content = None;
        while let Some(key) = map.next_key::<Text<'de>>()? {
            match key.0.as_ref() {
                "role" if role.is_some() => return Err(de::Error::duplicate_field("role")),
                "role" => role = Some(map.next_value::<Text<'de>>()?.0),
                "content" if content.is_some() => {
                    return Err(de::Error::duplicate_field("content"))
                }
                "content" => content = Some(map.next_value_seed(ContentSeed(self.0))?),
                "tool_calls" => {
                    extra.tool_calls =
                        Some(map.next_value::<serde_json::Value>()?).filter(|v| !v.is_null())
                }
                "tool_call_id" => {
                    extra.tool_call_id = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0)
                }
                "name" => extra.name = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0),
                "reasoning" => {
                    extra.reasoning = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0)
                }
                "reasoning_content" => {
                    reasoning_content = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0)
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        extra.reasoning = extra.reasoning.or(reasoning_content);
        Ok(ChatMessage {
            role: role.ok_or_else(|| de::Error::missing_field("role"))?,
            content: content.unwrap_or_default(),
            extra: (extra != MessageExtra::default()).then(|| Box::new(extra)),
        })
    }
    reject!(bool, num, str, null, seq, bytes);
}

/// A message's `content`: a string (one text part), an array of content parts, or null.
struct ContentSeed<'b>(&'b Budget);

impl<'de, 'b> DeserializeSeed<'de> for ContentSeed<'b> {
    type Value = Vec<ContentPart<'de>>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de, 'b> Visitor<'de> for ContentSeed<'b> {
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
        self.0.take_part()?;
        Ok(vec![ContentPart::Text(Cow::Borrowed(v))])
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.0.take_part()?;
        Ok(vec![ContentPart::Text(Cow::Owned(v.to_owned()))])
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::new();
        while let Some(Part(part)) = seq.next_element::<Part<'de>>()? {
            self.0.take_part::<A::Error>()?;
            parts.extend(part);
        }
        Ok(parts)
    }
    reject!(bool, num, map, bytes);
}

/// A content part object: `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
/// {"url": ...}}`, `{"type": "input_audio", "input_audio": {"data": ...}}` and the like.
#[derive(Default)]
struct RawPart<'a> {
    kind: Option<Cow<'a, str>>,
    text: Option<Cow<'a, str>>,
    refusal: Option<Cow<'a, str>>,
    thinking: Option<Cow<'a, str>>,
    image_url: Option<MediaRef>,
    input_audio: Option<MediaRef>,
    video_url: Option<MediaRef>,
    file: Option<MediaRef>,
}

/// One element of a `content` array, checked inside the element (so errors name its index);
/// `None` for a text part without its text, which vLLM skips.
struct Part<'a>(Option<ContentPart<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Part<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut part = RawPart::default();
                while let Some(key) = map.next_key::<Text<'de>>()? {
                    // A repeated key keeps its last value, as JSON parsers commonly do.
                    match key.0.as_ref() {
                        "type" => part.kind = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0),
                        "text" => part.text = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0),
                        "refusal" => {
                            part.refusal = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0)
                        }
                        "thinking" => {
                            part.thinking = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0)
                        }
                        "image_url" => part.image_url = map.next_value()?,
                        "input_audio" => part.input_audio = map.next_value()?,
                        "video_url" => part.video_url = map.next_value()?,
                        "file" => part.file = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                part.into_part().map(Part).map_err(de::Error::custom)
            }
            reject!(bool, num, str, null, seq, bytes);
        }
        de.deserialize_any(V)
    }
}

impl<'a> RawPart<'a> {
    /// The part, or what is wrong with it (naming field names and types only). Text parts are
    /// read as vLLM reads them (`TEXT_PART_TYPES`): `text`, `input_text` and `output_text` from
    /// `text`, `refusal` and `thinking` from the field of their name; one without its text is
    /// skipped (`None`), as vLLM skips it.
    fn into_part(self) -> Result<Option<ContentPart<'a>>, &'static str> {
        let kind = self.kind.ok_or("content part is missing `type`")?;
        Ok(Some(match kind.as_ref() {
            "text" | "input_text" | "output_text" => return Ok(self.text.map(ContentPart::Text)),
            "refusal" => return Ok(self.refusal.map(ContentPart::Text)),
            "thinking" => return Ok(self.thinking.map(ContentPart::Text)),
            "image_url" => ContentPart::Image(
                self.image_url
                    .ok_or("content part of type image_url is missing `image_url`")?
                    .0,
            ),
            "input_audio" => ContentPart::Media(
                self.input_audio
                    .ok_or("content part of type input_audio is missing `input_audio`")?
                    .0,
            ),
            "video_url" => ContentPart::Media(
                self.video_url
                    .ok_or("content part of type video_url is missing `video_url`")?
                    .0,
            ),
            "file" => ContentPart::Media(
                self.file
                    .ok_or("content part of type file is missing `file`")?
                    .0,
            ),
            // The unknown type is not echoed: it is client text.
            _ => return Err(
                "unsupported content part type (expected text, input_text, output_text, refusal, thinking, image_url, input_audio, video_url or file)",
            ),
        }))
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
                while let Some(key) = map.next_key::<Text<'de>>()? {
                    match key.0.as_ref() {
                        "url" | "data" | "file_data" | "file_id" => {
                            let v = map.next_value::<Text<'de>>()?;
                            hash.get_or_insert(xxh3_64(v.0.as_bytes()));
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                hash.map(MediaRef)
                    .ok_or_else(|| de::Error::custom("media reference has no `url` or `data`"))
            }
            reject!(bool, num, null, seq, bytes);
        }
        de.deserialize_any(V)
    }
}
