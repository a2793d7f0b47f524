//! Chat-template rendering as vLLM calls transformers' `apply_chat_template(conversation,
//! add_generation_prompt=..., tokenize=False, **chat_template_kwargs)`.
//!
//! The environment is transformers' Jinja environment rebuilt on minijinja: `trim_blocks`,
//! `lstrip_blocks`, loop controls, Python string and dict methods (minijinja-contrib's
//! pycompat), `raise_exception`, `strftime_now` and a `json.dumps`-like `tojson`; the
//! `{% generation %}` markers transformers uses for assistant masks render their body.
//!
//! The context is transformers': `messages`, `tools` and `documents` (none), the
//! `add_generation_prompt` flag, every special token set in `tokenizer_config.json`
//! (`bos_token`...), then the request's `chat_template_kwargs` (which may override them).
//!
//! Messages are shaped as vLLM's `parse_chat_messages` shapes them: content as one string (text
//! parts joined with `"\n"`, media placeholders first) or, for templates that loop over
//! content, as `{"type": "text", "text": ...}` parts. A media item is rendered as a placeholder
//! string chosen by the caller, so the caller can find where the template put it.

use std::collections::BTreeMap;

use minijinja::value::{Serde, Value};
use minijinja::Environment;
use serde_json::json;

use super::config::TokenizerConfig;
use super::content_format::{self, ContentFormat};
use super::python;
use crate::request::{ChatMessage, ContentPart, Media, RenderOptions};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    format: ContentFormat,
    /// Context entries every render starts from (special tokens).
    base_context: BTreeMap<String, Value>,
    /// The template names the `developer` role (else vLLM renders developer messages as
    /// system ones).
    developer_role: bool,
}

/// A rendered conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The prompt text.
    pub text: String,
    /// The media items, in placeholder order: item `k` was rendered as `placeholder(k)`.
    pub media: Vec<Media>,
}

impl ChatTemplate {
    /// Compiles `source` for a tokenizer described by `config`.
    pub fn new(source: &str, config: &TokenizerConfig) -> Result<ChatTemplate, minijinja::Error> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", python::raise_exception);
        env.add_function("strftime_now", python::strftime_now);
        env.add_filter("tojson", python::tojson);
        env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source))?;
        let mut base_context: BTreeMap<String, Value> = config
            .special_tokens
            .iter()
            .map(|(name, token)| ((*name).to_string(), Value::from(token.as_str())))
            .collect();
        if let Some(extra) = &config.additional_special_tokens {
            base_context.insert(
                "additional_special_tokens".into(),
                extra.iter().map(String::as_str).collect(),
            );
        }
        Ok(ChatTemplate {
            env,
            format: content_format::detect(source),
            base_context,
            developer_role: source.contains("\"developer\"") || source.contains("'developer'"),
        })
    }

    /// How this template takes message content.
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Renders `messages`; media item `k` becomes the text `placeholder(k)`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
        placeholder: impl Fn(usize) -> String,
    ) -> Result<Rendered, minijinja::Error> {
        let mut media = Vec::new();
        let mut conversation: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| self.message(m, &mut media, &placeholder))
            .collect();
        if !self.developer_role && messages.iter().any(|m| m.role == "developer") {
            conversation = developer_as_system(conversation);
        }
        // vLLM 0.32's layers (`merge_kwargs`), later over earlier, None and "auto" not
        // counting in an overriding layer: its defaults (the request's tools, as its pydantic
        // models dump them), the request's kwargs, its own values from the request.
        let mut context = self.base_context.clone();
        context.insert("documents".into(), Value::from(()));
        context.insert(
            "tools".into(),
            options
                .tools
                .as_ref()
                .map_or(Value::from(()), |t| Value::from(Serde(&dumped_tools(t)))),
        );
        let kwargs = &options.chat_template_kwargs;
        let counts = |v: &serde_json::Value| !v.is_null() && v.as_str() != Some("auto");
        for (key, value) in kwargs {
            if key != "chat_template" && key != "tokenize" && counts(value) {
                context.insert(key.clone(), Value::from(Serde(value)));
            }
        }
        context.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        if let Some(documents) = options.documents.as_ref().filter(|d| counts(d)) {
            context.insert("documents".into(), Value::from(Serde(documents)));
        }
        if let Some(effort) = &options.reasoning_effort {
            if effort != "auto" {
                context.insert("reasoning_effort".into(), Value::from(effort.as_str()));
            }
            if !kwargs.contains_key("enable_thinking") {
                context.insert("enable_thinking".into(), Value::from(effort != "none"));
            }
        }
        context.insert("messages".into(), Value::from(Serde(&conversation)));
        let text = self
            .env
            .get_template(TEMPLATE_NAME)?
            .render(Value::from(context))?;
        Ok(Rendered { text, media })
    }

    /// One message as vLLM hands it to the template.
    fn message(
        &self,
        m: &ChatMessage,
        media: &mut Vec<Media>,
        placeholder: &impl Fn(usize) -> String,
    ) -> serde_json::Value {
        let mut texts: Vec<String> = Vec::new();
        let mut placeholders: Vec<String> = Vec::new();
        let mut parts: Vec<serde_json::Value> = Vec::new();
        for part in &m.content {
            match part {
                ContentPart::Text(t) => {
                    texts.push(t.clone());
                    parts.push(json!({"type": "text", "text": t}));
                }
                ContentPart::Media(item) => {
                    let p = placeholder(media.len());
                    media.push(*item);
                    parts.push(json!({"type": "text", "text": p}));
                    placeholders.push(p);
                }
            }
        }
        let content = match self.format {
            // Tool results are strings for templates, unless they carry media (vLLM).
            ContentFormat::OpenAi if m.role != "tool" || !placeholders.is_empty() => {
                serde_json::Value::Array(parts)
            }
            ContentFormat::OpenAi => serde_json::Value::String(texts.join("\n")),
            // vLLM puts the media placeholders first, then the text, one per line; an empty
            // text part is left out (`if parse_res:`).
            ContentFormat::String => {
                texts.retain(|t| !t.is_empty());
                let text = texts.join("\n");
                if !text.is_empty() {
                    placeholders.push(text);
                }
                serde_json::Value::String(placeholders.join("\n"))
            }
        };
        let mut out = serde_json::Map::new();
        out.insert("role".into(), json!(m.role));
        out.insert("content".into(), content);
        if let Some(name) = &m.name {
            out.insert("name".into(), json!(name));
        }
        match m.role.as_str() {
            "assistant" => {
                if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    out.insert("tool_calls".into(), json!(calls));
                }
                if let Some(r) = &m.reasoning {
                    out.insert("reasoning".into(), json!(r));
                    out.insert("reasoning_content".into(), json!(r));
                }
            }
            "tool" => {
                if let Some(id) = &m.tool_call_id {
                    out.insert("tool_call_id".into(), json!(id));
                }
            }
            _ => {}
        }
        serde_json::Value::Object(out)
    }
}

/// `tools` as vLLM 0.32 dumps its `ChatCompletionToolsParam` models for the template: per tool
/// `type` (default "function"), `function` {`name`, `description`, `parameters` (null when
/// missing), `strict` and `defer_loading` only when set, the tool's `defer_loading` inherited},
/// the tool's `defer_loading` when set; other keys dropped. A tool vLLM would refuse is kept
/// as sent.
fn dumped_tools(tools: &serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Array(list) = tools else {
        return tools.clone();
    };
    let given = |v: Option<&serde_json::Value>| v.filter(|v| !v.is_null()).cloned();
    let dumped = list.iter().map(|tool| {
        let function = match tool.get("function") {
            Some(f) if f.get("name").is_some() => f,
            _ => return tool.clone(),
        };
        let tool_defer = given(tool.get("defer_loading"));
        let mut f = serde_json::Map::new();
        f.insert("name".into(), function["name"].clone());
        f.insert(
            "description".into(),
            function.get("description").cloned().unwrap_or_default(),
        );
        f.insert(
            "parameters".into(),
            function.get("parameters").cloned().unwrap_or_default(),
        );
        if let Some(v) = given(function.get("strict")) {
            f.insert("strict".into(), v);
        }
        if let Some(v) = given(function.get("defer_loading")).or_else(|| tool_defer.clone()) {
            f.insert("defer_loading".into(), v);
        }
        let mut out = serde_json::Map::new();
        out.insert(
            "type".into(),
            given(tool.get("type")).unwrap_or_else(|| json!("function")),
        );
        out.insert("function".into(), serde_json::Value::Object(f));
        if let Some(v) = tool_defer {
            out.insert("defer_loading".into(), v);
        }
        serde_json::Value::Object(out)
    });
    serde_json::Value::Array(dumped.collect())
}

/// vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`: developer messages
/// become system ones; if a system message is then not first, or there are several, their
/// texts (parts' texts joined with "\n"; empty ones left out) become one system message, first,
/// joined with "\n\n".
fn developer_as_system(conversation: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    let mut conversation = conversation;
    for m in &mut conversation {
        if m["role"] == "developer" {
            m["role"] = json!("system");
            if let Some(o) = m.as_object_mut() {
                o.remove("tools");
            }
        }
    }
    let systems: Vec<usize> = (0..conversation.len())
        .filter(|&i| conversation[i]["role"] == "system")
        .collect();
    if systems.is_empty() || systems == [0] {
        return conversation;
    }
    let mut texts = Vec::new();
    let mut rest = Vec::new();
    for m in conversation {
        if m["role"] != "system" {
            rest.push(m);
            continue;
        }
        let text = match &m["content"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            texts.push(text);
        }
    }
    let mut out = vec![json!({"role": "system", "content": texts.join("\n\n")})];
    out.extend(rest);
    out
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension) turned
/// into an always-true `if`, whitespace control kept.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let body = &tag[2..tag.len() - 2];
        let lead = if body.starts_with(['-', '+']) {
            &body[..1]
        } else {
            ""
        };
        let trail = if body.ends_with(['-', '+']) {
            &body[body.len() - 1..]
        } else {
            ""
        };
        let word = body.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        match word {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(tag),
        }
        rest = &rest[start + tag.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Modality;

    fn config() -> TokenizerConfig {
        TokenizerConfig::parse(r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}}"#).unwrap()
    }

    fn text_message(role: &str, text: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: vec![ContentPart::Text(text.into())],
            name: None,
            tool_call_id: None,
            tool_calls: None,
            reasoning: None,
        }
    }

    fn options() -> RenderOptions {
        RenderOptions::default()
    }

    fn render(source: &str, messages: &[ChatMessage], options: &RenderOptions) -> Rendered {
        ChatTemplate::new(source, &config())
            .unwrap()
            .render(messages, options, |k| format!("<MEDIA{k}>"))
            .unwrap()
    }

    #[test]
    fn the_context_transformers_gives() {
        let source = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m['content'] | trim }}]{{ eos_token }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}{% if tools is none %}N{% endif %}{% if unk_token is defined %}U{% endif %}";
        let messages = [text_message("user", " hi ")];
        let out = render(source, &messages, &options());
        assert_eq!(out.text, "<s>[hi]</s>\n>N");
        let mut opts = options();
        opts.add_generation_prompt = false;
        assert_eq!(render(source, &messages, &opts).text, "<s>[hi]</s>\nN");
        // chat_template_kwargs reach the template, but vLLM 0.32 puts the request's own
        // add_generation_prompt over theirs (`merge_kwargs`).
        let mut opts = options();
        opts.chat_template_kwargs =
            serde_json::from_str(r#"{"enable_thinking": false, "add_generation_prompt": false}"#)
                .unwrap();
        let out = render(
            "{% if not enable_thinking %}off{% endif %}{% if add_generation_prompt %}>{% endif %}",
            &messages,
            &opts,
        );
        assert_eq!(out.text, "off>");
        // tools in vLLM's shape, documents as sent; reasoning_effort sets enable_thinking.
        let mut opts = options();
        opts.tools = Some(serde_json::json!([{"type": "function", "function": {"name": "f"}}]));
        opts.documents = Some(serde_json::json!([{"text": "d"}]));
        opts.reasoning_effort = Some("none".into());
        let out = render(
            "{{ tools[0].function.name }}{{ documents[0].text }}{{ reasoning_effort }}{% if not enable_thinking %}-{% endif %}",
            &messages,
            &opts,
        );
        assert_eq!(out.text, "fdnone-");
    }

    #[test]
    fn developer_messages_become_system_ones_unless_the_template_names_the_role() {
        let plain = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}";
        let out = render(
            plain,
            &[
                text_message("system", "A"),
                text_message("user", "hi"),
                text_message("developer", "B"),
            ],
            &options(),
        );
        assert_eq!(out.text, "[system]A\n\nB[user]hi");
        let knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}{% endfor %}";
        let out = render(knows, &[text_message("developer", "x")], &options());
        assert_eq!(out.text, "D:x");
    }

    #[test]
    fn media_placeholders_where_vllm_puts_them() {
        let cat = Media {
            modality: Modality::Image,
            hash: 7,
        };
        let m = ChatMessage {
            content: vec![
                ContentPart::Text("a".into()),
                ContentPart::Media(cat),
                ContentPart::Text("b".into()),
            ],
            ..text_message("user", "")
        };
        // String format: placeholders first, then the text parts, newline-joined.
        let out = render(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            std::slice::from_ref(&m),
            &options(),
        );
        assert_eq!(out.text, "<MEDIA0>\na\nb");
        assert_eq!(out.media, vec![cat]);
        // Parts format: the item stays where it was.
        let out = render(
            "{% for m in messages %}{% for p in m.content %}({{ p.text }}){% endfor %}{% endfor %}",
            std::slice::from_ref(&m),
            &options(),
        );
        assert_eq!(out.text, "(a)(<MEDIA0>)(b)");
    }

    #[test]
    fn python_methods_loop_controls_and_generation_tags() {
        let out = render(
            "{% for m in messages %}{% if m.content.startswith('x') %}{% continue %}{% endif %}{% generation -%}\n{{ m.content.upper() }}{%- endgeneration %}{% break %}{% endfor %}",
            &[text_message("user", "xa"), text_message("user", "yb"), text_message("user", "zc")],
            &options(),
        );
        assert_eq!(out.text, "YB");
    }

    #[test]
    fn template_errors_are_errors() {
        let t =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", &config()).unwrap();
        let err = t
            .render(&[text_message("user", "x")], &options(), |k| k.to_string())
            .unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        assert!(ChatTemplate::new("{% for %}", &config()).is_err());
    }
}
