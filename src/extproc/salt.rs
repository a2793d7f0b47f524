//! Writing the tenant's `cache_salt` into the request body Envoy forwards.
//!
//! The engine keys a request's first KV block by its `cache_salt` (vLLM), so a salt per tenant
//! keeps tenants apart inside the engine's own cache. The router rewrites the body it was given
//! rather than re-serializing it: only the top-level `cache_salt` member changes (replaced where
//! the client put one, else inserted right after the opening brace), every other byte is kept,
//! and the chunk boundaries of the original are kept so full-duplex echoing stays in step.
//!
//! The body has already been parsed as a JSON object by the time this runs (routing needs it),
//! so the scan below only has to find member boundaries; it still refuses anything it does not
//! understand rather than guessing, and the caller then rejects the request (see
//! [`salt_body`]): forwarding it unsalted would put the tenant in the shared cache.

use std::ops::Range;

use super::reject::Rejection;
use crate::prefix::TenantSalts;

/// The hook the stream calls once a request is routed: writes `tenant`'s salt into `body`
/// (moving `chunk_ends` along). `Ok(true)` if the body changed, `Ok(false)` if the request
/// carries no salt (no tenant, no body, injection off).
pub fn salt_request(
    salts: &TenantSalts,
    tenant: Option<&str>,
    body: &mut Vec<u8>,
    chunk_ends: &mut [usize],
) -> Result<bool, Rejection> {
    if body.is_empty() || salts.cache_salt(tenant, None).is_none() {
        return Ok(false);
    }
    // Same function, same inputs as the router's namespace (`plan`): the engine's KV events
    // for this request then land in the namespace the router predicted.
    let salted = salt_body(body, chunk_ends, |client| {
        salts.cache_salt(tenant, client).unwrap_or_default()
    });
    if salted {
        Ok(true)
    } else {
        Err(Rejection::unsaltable())
    }
}

/// Where the top-level `cache_salt` member's value sits, and what the client sent in it.
#[derive(Debug, PartialEq, Eq)]
struct Found {
    /// Byte range of the value (a JSON string or `null`).
    value: Range<usize>,
    /// The client's salt (`None` for `null`).
    client: Option<String>,
}

/// Where to write the salt: replace a value, or insert a member after the opening brace.
#[derive(Debug, PartialEq, Eq)]
enum Site {
    Replace(Found),
    /// Insert at this offset (just past `{`); `empty` if the object has no members.
    Insert {
        at: usize,
        empty: bool,
    },
}

/// Sets the top-level `cache_salt` of `body` to `salt_of(client's salt)` and moves the chunk
/// ends in `chunk_ends` to match. Returns false (body untouched) if the body is not a JSON
/// object with a string, `null` or absent `cache_salt`: the caller must then reject the
/// request, since forwarding it unsalted would break the tenant's isolation.
pub fn salt_body(
    body: &mut Vec<u8>,
    chunk_ends: &mut [usize],
    salt_of: impl FnOnce(Option<&str>) -> String,
) -> bool {
    let Some(site) = locate(body) else {
        return false;
    };
    let (range, client, member) = match site {
        Site::Replace(found) => (found.value, found.client, None),
        Site::Insert { at, empty } => (at..at, None, Some(empty)),
    };
    let salt = salt_of(client.as_deref());
    let quoted = serde_json::to_string(&salt).unwrap_or_else(|_| "\"\"".into());
    let replacement = match member {
        None => quoted,
        Some(false) => format!("\"cache_salt\":{quoted},"),
        Some(true) => format!("\"cache_salt\":{quoted}"),
    };
    let new_len = replacement.len();
    body.splice(range.clone(), replacement.into_bytes());
    for end in chunk_ends.iter_mut() {
        if *end >= range.end && *end > range.start {
            *end = *end + new_len - range.len();
        } else if *end > range.start {
            // A chunk ended inside the replaced value: it now ends where the new value does.
            *end = range.start + new_len;
        }
    }
    true
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// End (exclusive) of the JSON string starting at `b[i] == '"'`.
fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
    None
}

/// End (exclusive) of the JSON value starting at `b[i]` (whitespace already skipped).
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            // Brackets balance outside strings; strings are skipped whole.
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            // Number, true, false, null: up to the next delimiter.
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Finds where the salt goes. Keys are compared after JSON unescaping, so `"cache\u005fsalt"`
/// is found too (serde reads it as `cache_salt`, and so does the engine). The whole object is
/// read: a second `cache_salt` member (the engine reads the last) is `None`, unsaltable, never
/// a salt written over the first while the client's own goes out after it.
fn locate(b: &[u8]) -> Option<Site> {
    let open = skip_ws(b, 0);
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let mut i = skip_ws(b, open + 1);
    if b.get(i) == Some(&b'}') {
        return Some(Site::Insert {
            at: open + 1,
            empty: true,
        });
    }
    let mut found = None;
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = skip_string(b, i)?;
        let key = &b[i..key_end];
        let is_salt = key == b"\"cache_salt\""
            || (key.contains(&b'\\')
                && serde_json::from_slice::<String>(key).ok().as_deref() == Some("cache_salt"));
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let value_end = skip_value(b, i)?;
        if is_salt {
            if found.is_some() {
                return None;
            }
            let raw = &b[i..value_end];
            let client = if raw == b"null" {
                None
            } else if raw.first() == Some(&b'"') {
                Some(serde_json::from_slice::<String>(raw).ok()?)
            } else {
                return None;
            };
            found = Some(Found {
                value: i..value_end,
                client,
            });
        }
        i = skip_ws(b, value_end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => {
                return Some(match found {
                    Some(found) => Site::Replace(found),
                    None => Site::Insert {
                        at: open + 1,
                        empty: false,
                    },
                })
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn salted(body: &str, chunks: &[usize]) -> (Value, Vec<usize>, Option<String>) {
        let mut bytes = body.as_bytes().to_vec();
        let mut ends = chunks.to_vec();
        let mut seen = None;
        assert!(salt_body(&mut bytes, &mut ends, |c| {
            seen = c.map(str::to_string);
            "S".into()
        }));
        let v: Value = serde_json::from_slice(&bytes).expect("still JSON");
        assert_eq!(
            ends.last().copied(),
            Some(bytes.len()),
            "last chunk ends at the end"
        );
        (v, ends, seen)
    }

    #[test]
    fn inserts_replaces_and_keeps_everything_else() {
        let cases: &[(&str, Option<&str>)] = &[
            (r#"{"model":"m","prompt":"x"}"#, None),
            (
                r#" { "model" : "m" , "cache_salt" : "mine" , "n": [1, {"cache_salt": 2}] }"#,
                Some("mine"),
            ),
            (r#"{"cache_salt":null,"model":"m"}"#, None),
            (
                r#"{"model":"m","cache\u005fsalt":"esc\"aped"}"#,
                Some("esc\"aped"),
            ),
            (
                r#"{"nested":{"cache_salt":"deep"},"s":"}{\"","model":"m"}"#,
                None,
            ),
            ("{}", None),
        ];
        for (body, client) in cases {
            let original: Value = serde_json::from_str(body).unwrap();
            let (v, _, seen) = salted(body, &[body.len()]);
            assert_eq!(seen.as_deref(), *client, "{body}");
            assert_eq!(v["cache_salt"], "S", "{body}");
            let mut expected = original.clone();
            expected["cache_salt"] = json!("S");
            assert_eq!(v, expected, "{body}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_walk() {
        for body in [
            r#"[1]"#,
            r#"{"cache_salt":5}"#,
            r#"{"a":"#,
            r#"{"a" 1}"#,
            "",
            r#"{"a":1"#,
            // Twice (the engine reads the last): salting the first would send the client's own.
            r#"{"cache_salt":null,"model":"m","cache_salt":"chosen"}"#,
            r#"{"cache_salt":"a","cache\u005fsalt":"b"}"#,
        ] {
            let mut bytes = body.as_bytes().to_vec();
            assert!(!salt_body(&mut bytes, &mut [], |_| "S".into()), "{body}");
            assert_eq!(bytes, body.as_bytes(), "untouched");
        }
    }

    #[test]
    fn chunk_ends_follow_the_splice() {
        let body = r#"{"model":"m","cache_salt":"abcdef","prompt":"p"}"#;
        let value_at = body.find("\"abcdef\"").unwrap();
        // A chunk ending inside the old value, one before it and the end.
        let (_, ends, _) = salted(body, &[5, value_at + 3, body.len()]);
        assert_eq!(ends[0], 5);
        assert_eq!(
            ends[1],
            value_at + 3,
            "\"S\" is 3 bytes: ends where the new value does"
        );
        assert_eq!(ends[2], body.len() - 8 + 3);
    }

    proptest! {
        #[test]
        fn any_object_gets_exactly_one_salt_and_keeps_its_members(
            members in prop::collection::btree_map("[a-z_]{1,12}", any::<i32>(), 0..8),
            salt in proptest::option::of("[ -~]{0,10}"),
            split in 0usize..200,
        ) {
            let mut obj = serde_json::Map::new();
            for (k, v) in &members {
                obj.insert(k.clone(), json!(v));
            }
            if let Some(s) = &salt {
                obj.insert("cache_salt".into(), json!(s));
            }
            let body = serde_json::to_vec_pretty(&Value::Object(obj.clone())).unwrap();
            let mut bytes = body.clone();
            let cut = split.min(body.len());
            let mut ends = vec![cut, body.len()];
            let mut seen = None;
            let changed = salt_body(&mut bytes, &mut ends, |c| {
                seen = c.map(str::to_string);
                "T".into()
            });
            prop_assert!(changed);
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            obj.insert("cache_salt".into(), json!("T"));
            prop_assert_eq!(v, Value::Object(obj));
            prop_assert_eq!(seen, salt);
            prop_assert_eq!(ends[1], bytes.len());
            prop_assert!(ends[0] <= ends[1]);
        }
    }
}
