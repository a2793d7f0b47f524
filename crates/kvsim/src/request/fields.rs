//! Typed access to the fields of a JSON object, with errors that name the field's path and the
//! type found (never the value: it may be prompt text).

use serde_json::{Map, Value};

use super::RequestError;

/// A JSON object whose fields are taken out one by one.
pub(super) struct Fields {
    map: Map<String, Value>,
    /// Path of the object itself (`""` for the body, `stream_options`, `messages[2]`).
    path: String,
}

impl Fields {
    pub(super) fn new(map: Map<String, Value>) -> Fields {
        Fields {
            map,
            path: String::new(),
        }
    }

    /// The same object, reporting its fields under `path`.
    pub(super) fn nested(mut self, path: impl Into<String>) -> Fields {
        self.path = path.into();
        self
    }

    /// The path of field `key` of this object.
    pub(super) fn path_of(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// A field, left in place.
    pub(super) fn peek(&self, key: &str) -> Option<&Value> {
        self.map.get(key)
    }

    /// Removes and returns a field, `None` when absent.
    pub(super) fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key)
    }

    fn wrong(&self, key: &str, expected: &str, got: &Value) -> RequestError {
        RequestError::invalid(
            self.path_of(key),
            format!("expected {expected}, got {}", kind(got)),
        )
    }

    /// A boolean; absent or null is `None`.
    pub(super) fn bool(&mut self, key: &str) -> Result<Option<bool>, RequestError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(other) => Err(self.wrong(key, "a boolean", &other)),
        }
    }

    /// A string; absent or null is `None`.
    pub(super) fn string(&mut self, key: &str) -> Result<Option<String>, RequestError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(key, "a string", &other)),
        }
    }

    /// An integer (an integral float such as `5.0` too, as pydantic accepts); absent or null
    /// is `None`.
    pub(super) fn int(&mut self, key: &str) -> Result<Option<i64>, RequestError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => integer(&n)
                .map(Some)
                .ok_or_else(|| RequestError::invalid(self.path_of(key), "expected an integer")),
            Some(other) => Err(self.wrong(key, "an integer", &other)),
        }
    }

    /// An array, kept as sent; absent or null is `None`.
    pub(super) fn array(&mut self, key: &str) -> Result<Option<Value>, RequestError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Array(_)) => Ok(Some(v)),
            Some(other) => Err(self.wrong(key, "an array", &other)),
        }
    }

    /// An object; absent or null is `None`.
    pub(super) fn object(&mut self, key: &str) -> Result<Option<Map<String, Value>>, RequestError> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(map)) => Ok(Some(map)),
            Some(other) => Err(self.wrong(key, "an object", &other)),
        }
    }
}

/// An integral JSON number as i64 (saturating beyond its range).
fn integer(n: &serde_json::Number) -> Option<i64> {
    if let Some(i) = n.as_i64() {
        return Some(i);
    }
    if n.as_u64().is_some() {
        return Some(i64::MAX);
    }
    n.as_f64()
        .filter(|f| f.fract() == 0.0 && f.is_finite())
        .map(|f| f as i64)
}

/// Token ids: non-negative integers that fit in u32.
pub(super) fn token_ids(items: &[Value], field: &str) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    RequestError::invalid(
                        format!("{field}[{i}]"),
                        format!("expected a token id (0..2^32), got {}", kind(v)),
                    )
                })
        })
        .collect()
}

/// The JSON type of a value, for error messages.
pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(n) if n.as_i64().is_some_and(|i| i < 0) => "a negative integer",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
