//! Leaf values of a request body (strings, flags, counts, token ids) with visitors that name
//! the JSON type they got, never its value.
//!
//! serde's default "invalid type" error quotes the offending value (`invalid type: string
//! "<the prompt>", expected a boolean`), and that message would reach the client's 400 body and
//! the logs. Every visitor of this module's callers therefore implements every `visit_*` method
//! through [`reject!`], whose message is `expected <what>, got <JSON type>`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// `expected <what>, got <kind>`: the only shape of type error this module's visitors produce.
pub(super) fn wrong_type<E: de::Error>(expected: &dyn de::Expected, got: &str) -> E {
    E::custom(format_args!("expected {expected}, got {got}"))
}

/// Implements the listed `visit_*` methods as type errors that name the JSON type only. Lists:
/// `bool`, `num` (integers and floats), `str`, `null`, `seq`, `map`, `bytes`.
macro_rules! reject {
    ($($kind:ident),* $(,)?) => { $( $crate::request::leaf::reject!(@ $kind); )* };
    (@ bool) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "a boolean"))
        }
    };
    (@ num) => {
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "a number"))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "a number"))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "a number"))
        }
    };
    (@ str) => {
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "a string"))
        }
    };
    (@ null) => {
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "null"))
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "null"))
        }
    };
    (@ seq) => {
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err($crate::request::leaf::wrong_type(&self, "an array"))
        }
    };
    (@ map) => {
        fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err($crate::request::leaf::wrong_type(&self, "an object"))
        }
    };
    (@ bytes) => {
        fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Err($crate::request::leaf::wrong_type(&self, "bytes"))
        }
    };
}
pub(super) use reject;

/// A JSON string, borrowed from the body when it has no escapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
            reject!(bool, num, null, seq, map, bytes);
        }
        de.deserialize_any(V)
    }
}

/// A JSON boolean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Flag(pub bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Flag;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a boolean")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Flag(v))
            }
            reject!(num, str, null, seq, map, bytes);
        }
        de.deserialize_any(V)
    }
}

/// A non-negative integer that fits in `u64` (e.g. `max_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Count(pub u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Count(v))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Err(wrong_type(&self, "a negative number"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Err(wrong_type(&self, "a fraction or an out-of-range number"))
            }
            reject!(bool, str, null, seq, map, bytes);
        }
        de.deserialize_any(V)
    }
}

/// A token id: an integer in `0..=u32::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TokenId(pub u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (an integer in 0..=4294967295)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(TokenId)
                    .map_err(|_| wrong_type(&self, "an out-of-range number"))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Err(wrong_type(&self, "a negative number"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Err(wrong_type(&self, "a fraction or an out-of-range number"))
            }
            reject!(bool, str, null, seq, map, bytes);
        }
        de.deserialize_any(V)
    }
}

/// An array of token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TokenIds(pub Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(TokenId(id)) = seq.next_element()? {
                    ids.push(id);
                }
                Ok(TokenIds(ids))
            }
            reject!(bool, num, str, null, map, bytes);
        }
        de.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_errors_name_the_json_type_not_the_value() {
        let secret = "SECRET-1f2e";
        type Parse = fn(&str) -> Result<(), serde_json::Error>;
        let cases: &[(&str, Parse, &str)] = &[
            (
                "\"SECRET-1f2e\"",
                |s| serde_json::from_str::<Flag>(s).map(drop),
                "expected a boolean, got a string",
            ),
            (
                "\"SECRET-1f2e\"",
                |s| serde_json::from_str::<Count>(s).map(drop),
                "expected a non-negative integer, got a string",
            ),
            (
                "[\"SECRET-1f2e\"]",
                |s| serde_json::from_str::<TokenIds>(s).map(drop),
                "expected a token id",
            ),
            (
                "{\"SECRET-1f2e\": 1}",
                |s| serde_json::from_str::<Text>(s).map(drop),
                "expected a string, got an object",
            ),
            (
                "-7",
                |s| serde_json::from_str::<TokenId>(s).map(drop),
                "got a negative number",
            ),
            (
                "4294967296",
                |s| serde_json::from_str::<TokenId>(s).map(drop),
                "got an out-of-range number",
            ),
            (
                "1e300",
                |s| serde_json::from_str::<Count>(s).map(drop),
                "got a fraction or an out-of-range number",
            ),
        ];
        for (json, parse, expected) in cases {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(expected), "{json}: {err}");
            assert!(!err.contains(secret), "{json}: {err}");
        }
        assert_eq!(serde_json::from_str::<Text>("\"a\\nb\"").unwrap().0, "a\nb");
    }
}
