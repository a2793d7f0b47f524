//! The top-level body object: the fields routing reads, parsed in one pass with the limits of
//! [`super::limits`]; every other field is skipped without being built. Only the prompt field of
//! the request's API is parsed (`messages` for chat, `prompt` for completions, `input` for
//! embeddings): a field the engine will not read cannot fail or slow the routing.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::body::{ChatMessage, MessagesSeed, PromptInput, PromptSeed};
use super::errors::classify;
use super::leaf::{reject, Count, Flag, Text};
use super::limits::{Budget, RequestLimits};
use super::{ApiKind, ChatOptions, RequestError};

/// The request fields we read.
#[derive(Debug, Default)]
pub(super) struct RawRequest<'a> {
    pub model: Option<Cow<'a, str>>,
    pub stream: Option<bool>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub cache_salt: Option<Cow<'a, str>>,
    pub messages: Option<Vec<ChatMessage<'a>>>,
    pub prompt: Option<PromptInput<'a>>,
    pub input: Option<PromptInput<'a>>,
    pub chat: ChatOptions,
}

impl<'a> RawRequest<'a> {
    /// Parses `body` as a request to `api` within `limits`.
    pub(super) fn from_slice(
        body: &'a [u8],
        api: ApiKind,
        limits: RequestLimits,
    ) -> Result<Self, RequestError> {
        // serde would accept a JSON array as a struct in sequence form; requests are objects.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => Err(RequestError::NotObject),
                Err(e) => Err(classify(None, e)),
            };
        }
        let budget = Budget::new(limits);
        let mut de = serde_json::Deserializer::from_slice(body);
        let seed = RequestSeed {
            api,
            budget: &budget,
        };
        // Without tracking the path first: tracking cost as much as the rest of the parse
        // (4 kB chat, ~25k instructions each), and only an error needs it. A body over a limit
        // needs no path (the budget names the field): refused at once, so a hostile body is
        // never parsed twice. Any other failure is parsed again, tracking, up to the same
        // error (deterministic: the same error comes).
        let raw = match seed.deserialize(&mut de) {
            Ok(raw) => raw,
            Err(first) => {
                return Err(match budget.hit() {
                    Some(hit) => RequestError::TooLarge {
                        field: hit.field,
                        limit: hit.limit,
                    },
                    None => Self::failure(body, api, limits, first),
                })
            }
        };
        // Trailing garbage after the object is malformed JSON too.
        de.end().map_err(|e| classify(None, e))?;
        Ok(raw)
    }

    /// Why `body` (an object) does not parse (`first`, the error of the untracked parse), with
    /// the path of the field at fault.
    #[cold]
    fn failure(
        body: &'a [u8],
        api: ApiKind,
        limits: RequestLimits,
        first: serde_json::Error,
    ) -> RequestError {
        let budget = Budget::new(limits);
        let mut de = serde_json::Deserializer::from_slice(body);
        let seed = RequestSeed {
            api,
            budget: &budget,
        };
        let mut track = serde_path_to_error::Track::new();
        match seed.deserialize(serde_path_to_error::Deserializer::new(&mut de, &mut track)) {
            // Parsing is deterministic, so this does not happen; the first error stands.
            Ok(_) => classify(None, first),
            Err(err) => match budget.hit() {
                Some(hit) => RequestError::TooLarge {
                    field: hit.field,
                    limit: hit.limit,
                },
                None => classify(Some(track.path()), err),
            },
        }
    }
}

struct RequestSeed<'b> {
    api: ApiKind,
    budget: &'b Budget,
}

impl<'de, 'b> DeserializeSeed<'de> for RequestSeed<'b> {
    type Value = RawRequest<'de>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

/// A field seen twice: consuming its second value fails inside it, so the error's path names
/// the field (serde's derive reports duplicates at the object, with no path).
struct Duplicate(&'static str);

impl<'de> DeserializeSeed<'de> for Duplicate {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<(), D::Error> {
        Err(de::Error::duplicate_field(self.0))
    }
}

/// The fields read so far. A field read as `null` is left unset, so `is_some` would let a
/// second occurrence through: `{"cache_salt":null,"cache_salt":"x"}` would parse with the salt
/// `x`, and a salt written over the first key would leave the engine (which reads the last)
/// the client's own. Any second occurrence is a duplicate.
#[derive(Default)]
struct Seen(u16);

impl Seen {
    const MODEL: u32 = 0;
    const STREAM: u32 = 1;
    const MAX_TOKENS: u32 = 2;
    const MAX_COMPLETION_TOKENS: u32 = 3;
    const CACHE_SALT: u32 = 4;
    const MESSAGES: u32 = 5;
    const PROMPT: u32 = 6;
    const INPUT: u32 = 7;

    /// Marks field `n` read; true when it was read before.
    fn again(&mut self, n: u32) -> bool {
        let bit = 1u16 << n;
        let before = self.0 & bit != 0;
        self.0 |= bit;
        before
    }
}

impl<'de, 'b> Visitor<'de> for RequestSeed<'b> {
    type Value = RawRequest<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut raw = RawRequest::default();
        let mut seen = Seen::default();
        let api = self.api;
        while let Some(key) = map.next_key::<Text<'de>>()? {
            match key.0.as_ref() {
                "model" => {
                    if seen.again(Seen::MODEL) {
                        return map.next_value_seed(Duplicate("model")).map(|()| raw);
                    }
                    raw.model = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0);
                }
                "stream" => {
                    if seen.again(Seen::STREAM) {
                        return map.next_value_seed(Duplicate("stream")).map(|()| raw);
                    }
                    raw.stream = map.next_value::<Option<Flag>>()?.map(|f| f.0);
                }
                "max_tokens" => {
                    if seen.again(Seen::MAX_TOKENS) {
                        return map.next_value_seed(Duplicate("max_tokens")).map(|()| raw);
                    }
                    raw.max_tokens = map.next_value::<Option<Count>>()?.map(|c| c.0);
                }
                "max_completion_tokens" => {
                    if seen.again(Seen::MAX_COMPLETION_TOKENS) {
                        return map
                            .next_value_seed(Duplicate("max_completion_tokens"))
                            .map(|()| raw);
                    }
                    raw.max_completion_tokens = map.next_value::<Option<Count>>()?.map(|c| c.0);
                }
                "cache_salt" => {
                    if seen.again(Seen::CACHE_SALT) {
                        return map.next_value_seed(Duplicate("cache_salt")).map(|()| raw);
                    }
                    raw.cache_salt = map.next_value::<Option<Text<'de>>>()?.map(|t| t.0);
                }
                "messages" if api == ApiKind::ChatCompletions => {
                    if seen.again(Seen::MESSAGES) {
                        return map.next_value_seed(Duplicate("messages")).map(|()| raw);
                    }
                    raw.messages = map.next_value_seed(Nullable(MessagesSeed(self.budget)))?;
                }
                // What only the chat template reads: taken leniently (a value of another
                // shape is left out, a repeated key keeps its last value), so hashing inputs
                // never refuse a request the engine would serve.
                "tools"
                | "documents"
                | "chat_template_kwargs"
                | "add_generation_prompt"
                | "reasoning_effort"
                    if api == ApiKind::ChatCompletions =>
                {
                    let value = map.next_value::<serde_json::Value>()?;
                    raw.chat.take(key.0.as_ref(), value);
                }
                "prompt" if api == ApiKind::Completions => {
                    if seen.again(Seen::PROMPT) {
                        return map.next_value_seed(Duplicate("prompt")).map(|()| raw);
                    }
                    raw.prompt = map.next_value_seed(Nullable(PromptSeed(self.budget)))?;
                }
                "input" if api == ApiKind::Embeddings => {
                    if seen.again(Seen::INPUT) {
                        return map.next_value_seed(Duplicate("input")).map(|()| raw);
                    }
                    raw.input = map.next_value_seed(Nullable(PromptSeed(self.budget)))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(raw)
    }
    reject!(bool, num, str, null, seq, bytes);
}

/// `null` or the seed's value.
struct Nullable<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value or null")
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(de).map(Some)
    }
}
