//! What `tokenizer_config.json` contributes, read as transformers (v5) reads it: the chat
//! template, the named special tokens a template sees, and the `add_bos_token` /
//! `add_eos_token` flags that rebuild the tokenizer's post-processor.

use serde_json::Value;

/// Special-token attributes transformers exposes to chat templates (`bos_token`...).
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The parts of a `tokenizer_config.json` the simulator uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// The chat template (`chat_template`: a string, or the `default` of a named list).
    pub chat_template: Option<String>,
    /// The named special tokens that are set, as (attribute, token text).
    pub special_tokens: Vec<(&'static str, String)>,
    /// `additional_special_tokens`, when listed.
    pub additional_special_tokens: Option<Vec<String>>,
    /// `add_bos_token`, when the file says.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when the file says.
    pub add_eos_token: Option<bool>,
}

impl TokenizerConfig {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<TokenizerConfig, String> {
        let json: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let Value::Object(fields) = json else {
            return Err("not a JSON object".into());
        };
        let special_tokens = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|&name| token_text(fields.get(name)?).map(|t| (name, t)))
            .collect();
        let additional_special_tokens = match fields.get("additional_special_tokens") {
            Some(Value::Array(items)) => Some(items.iter().filter_map(token_text).collect()),
            _ => None,
        };
        let chat_template = match fields.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => Some(t.clone()),
            Some(Value::Array(named)) => Some(default_template(named)?),
            Some(_) => return Err("`chat_template` must be a string or a list".into()),
        };
        let flag = |key: &str| fields.get(key).and_then(Value::as_bool);
        Ok(TokenizerConfig {
            chat_template,
            special_tokens,
            additional_special_tokens,
            add_bos_token: flag("add_bos_token"),
            add_eos_token: flag("add_eos_token"),
        })
    }

    /// The text of special token `name` (`bos_token`...), when set.
    pub fn special(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t.as_str())
    }
}

/// A token given as a string or as a serialized `AddedToken` (`{"content": "<s>", ...}`).
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// From a list of `{"name", "template"}`, the one named `default` (transformers' choice when no
/// tools are given).
fn default_template(named: &[Value]) -> Result<String, String> {
    named
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
        .and_then(|t| t.get("template")?.as_str())
        .map(str::to_owned)
        .ok_or_else(|| "the model has several chat templates and none named \"default\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tokens_templates_and_flags() {
        let c = TokenizerConfig::parse(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "unk_token": null, "pad_token": "</s>",
                "additional_special_tokens": ["<a>", {"content": "<b>"}],
                "add_bos_token": true, "model_max_length": 1e30,
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(c.special("bos_token"), Some("<s>"));
        assert_eq!(c.special("eos_token"), Some("</s>"));
        assert_eq!(c.special("unk_token"), None, "null is unset");
        assert_eq!(c.special_tokens.len(), 3);
        assert_eq!(
            c.additional_special_tokens,
            Some(vec!["<a>".to_string(), "<b>".to_string()])
        );
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        assert_eq!((c.add_bos_token, c.add_eos_token), (Some(true), None));
    }

    #[test]
    fn bad_files_are_errors() {
        for text in [
            "{",
            "[]",
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "x", "template": "T"}]}"#,
        ] {
            assert!(TokenizerConfig::parse(text).is_err(), "{text}");
        }
        assert_eq!(TokenizerConfig::parse("{}"), Ok(TokenizerConfig::default()));
    }
}
