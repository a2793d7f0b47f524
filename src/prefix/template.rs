//! Chat-template rendering, as Hugging Face `apply_chat_template` and vLLM do it.
//!
//! The template comes from `tokenizer_config.json` (`chat_template`, a string or a list of named
//! templates, `default` preferred) or a separate `chat_template.jinja`. It is rendered with
//! minijinja configured like HF's Jinja environment: `trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string/dict methods (`.strip()`, `.startswith()`, `.items()`...), HF's
//! `raise_exception`, `strftime_now` and a `tojson` that formats like Python's `json.dumps`.
//! Context: `messages`, `add_generation_prompt` (true, vLLM's default for chat), and the
//! special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) from the config.
//!
//! Message content is passed as vLLM does: a string (text parts joined with `"\n"`) unless the
//! template iterates over `message['content']`, in which case as OpenAI-style parts
//! (`{"type": "text", "text": ...}`, `{"type": "image"}`).
//!
//! **Bounded work.** The template comes from config, but the messages from clients, and one
//! template loop over a hostile conversation must not pin a core: every render runs with
//! minijinja's fuel ([`RenderLimits::fuel`], one unit per instruction and per ~64 bytes of data)
//! and its output is capped ([`RenderLimits::max_output_bytes`]); either limit fails the render
//! with [`ErrorKind::OutOfFuel`] / [`ErrorKind::WriteFailure`], which the caller turns into the
//! cheaper byte identity.

use std::borrow::Cow;
use std::path::Path;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use super::PrefixError;
use crate::request::{ChatMessage, ChatOptions, ContentPart};

/// How much work one render may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    /// minijinja fuel per render (`models[].template_fuel`); `None` is unlimited.
    pub fuel: Option<u64>,
    /// Most bytes of rendered text (`models[].max_rendered_prompt_bytes`).
    pub max_output_bytes: usize,
}

impl Default for RenderLimits {
    fn default() -> Self {
        RenderLimits {
            fuel: Some(DEFAULT_TEMPLATE_FUEL),
            max_output_bytes: DEFAULT_MAX_RENDERED_PROMPT_BYTES,
        }
    }
}

/// Default of `models[].template_fuel`.
pub const DEFAULT_TEMPLATE_FUEL: u64 = 10_000_000;
/// Default of `models[].max_rendered_prompt_bytes`: 64 MiB.
pub const DEFAULT_MAX_RENDERED_PROMPT_BYTES: usize = 64 << 20;

/// A model's chat template, compiled.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    max_output_bytes: usize,
    content_as_parts: bool,
    /// The template names the `developer` role; if not, developer messages are rendered as
    /// system ones (vLLM's `safe_apply_chat_template`).
    developer_role: bool,
    bos_token: String,
    eos_token: String,
    unk_token: String,
    pad_token: String,
}

const TEMPLATE_NAME: &str = "chat";

/// The fields of `tokenizer_config.json` that rendering uses.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfigFile {
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

impl TokenizerConfigFile {
    /// Reads the file; `field` names the config field in errors.
    pub(crate) fn read(path: &Path, field: &str) -> Result<TokenizerConfigFile, PrefixError> {
        let text = std::fs::read_to_string(path).map_err(|e| PrefixError::Load {
            field: field.to_string(),
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::parse(&text).map_err(|message| PrefixError::Load {
            field: field.to_string(),
            path: path.display().to_string(),
            message,
        })
    }

    pub(crate) fn parse(text: &str) -> Result<TokenizerConfigFile, String> {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let token = |key: &str| match json.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // `{"content": "<s>", "lstrip": false, ...}` (AddedToken serialization).
            Some(serde_json::Value::Object(o)) => {
                o.get("content").and_then(|c| c.as_str()).map(str::to_owned)
            }
            _ => None,
        };
        let chat_template = match json.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => {
                let find = |name: &str| {
                    named.iter().find_map(|t| {
                        (t.get("name")?.as_str()? == name)
                            .then(|| t.get("template")?.as_str().map(str::to_owned))
                            .flatten()
                    })
                };
                Some(find("default").ok_or("chat_template list has no \"default\" template")?)
            }
            Some(_) => return Err("chat_template must be a string or a list".into()),
        };
        Ok(TokenizerConfigFile {
            chat_template,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            unk_token: token("unk_token"),
            pad_token: token("pad_token"),
        })
    }
}

impl ChatTemplate {
    /// Compiles `source` with the special tokens of `config`; every render is bounded by
    /// `limits`.
    pub(crate) fn new(
        source: String,
        config: &TokenizerConfigFile,
        limits: RenderLimits,
    ) -> Result<ChatTemplate, minijinja::Error> {
        let content_as_parts = iterates_over_content(&source);
        let developer_role = source.contains("\"developer\"") || source.contains("'developer'");
        let mut env = Environment::new();
        env.set_fuel(limits.fuel);
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)?;
        let or_empty = |t: &Option<String>| t.clone().unwrap_or_default();
        Ok(ChatTemplate {
            env,
            max_output_bytes: limits.max_output_bytes,
            content_as_parts,
            developer_role,
            bos_token: or_empty(&config.bos_token),
            eos_token: or_empty(&config.eos_token),
            unk_token: or_empty(&config.unk_token),
            pad_token: or_empty(&config.pad_token),
        })
    }

    /// Renders `messages` with the generation prompt appended. Errors carry the template's
    /// message (which may quote template text, never message content).
    pub fn render(&self, messages: &[ChatMessage<'_>]) -> Result<String, minijinja::Error> {
        self.render_with(messages, true)
    }

    /// Renders `messages`; `add_generation_prompt` as in HF.
    pub fn render_with(
        &self,
        messages: &[ChatMessage<'_>],
        add_generation_prompt: bool,
    ) -> Result<String, minijinja::Error> {
        let options = ChatOptions {
            add_generation_prompt: Some(add_generation_prompt),
            ..ChatOptions::default()
        };
        self.render_marked(messages, &options, &|_| None)
    }

    /// Renders a chat request's `messages` with its `options` (tools, documents, template
    /// kwargs, generation prompt), as vLLM does.
    pub fn render_request(
        &self,
        messages: &[ChatMessage<'_>],
        options: &ChatOptions,
    ) -> Result<String, minijinja::Error> {
        self.render_marked(messages, options, &|_| None)
    }

    /// Renders `messages` with `marker(i)`, when given, inserted at the start of message `i`'s
    /// content (after its leading whitespace, which templates often trim): in the joined string,
    /// or in its first text part (a part of its own when there is none). See `super::media`.
    pub(crate) fn render_marked(
        &self,
        messages: &[ChatMessage<'_>],
        options: &ChatOptions,
        marker: &dyn Fn(usize) -> Option<String>,
    ) -> Result<String, minijinja::Error> {
        let mut messages: Vec<RenderMessage<'_>> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| self.message(m, marker(i)))
            .collect();
        if !self.developer_role {
            let mut renamed = false;
            for m in messages.iter_mut().filter(|m| m.role == "developer") {
                m.role = "system";
                renamed = true;
            }
            if renamed {
                messages = consolidate_system_messages(messages);
            }
        }
        let template = self.env.get_template(TEMPLATE_NAME)?;
        let mut out = CappedWriter {
            buf: Vec::new(),
            max_bytes: self.max_output_bytes,
        };
        template.render_captured_to(self.context(messages, options), &mut out)?;
        String::from_utf8(out.buf).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "the template produced invalid UTF-8",
            )
        })
    }

    /// The render context as vLLM 0.32 and Hugging Face's `apply_chat_template` build it.
    /// vLLM merges, later over earlier, skipping values that are None or "auto" in each
    /// overriding layer (`renderers/params.py` `merge_kwargs`): its defaults (the request's
    /// `tools`, normalised as its pydantic model dumps them), then the request's
    /// `chat_template_kwargs` (less `chat_template` and `tokenize`, which it refuses) with its
    /// own values over them (`add_generation_prompt`, default true; `documents`;
    /// `reasoning_effort`; `enable_thinking` when reasoning is asked for and the kwargs do not
    /// set it). transformers then renders with the special tokens, `messages`, and `tools`,
    /// `documents` (none when unset) and `add_generation_prompt` as its own parameters.
    /// Variables a template does not read are harmless, so vLLM's filter of the kwargs by the
    /// template's variables changes nothing here.
    fn context(&self, messages: Vec<RenderMessage<'_>>, options: &ChatOptions) -> Value {
        use std::collections::BTreeMap;
        let json = |v: &serde_json::Value| Value::from(minijinja::value::Serde(v));
        let unset = |v: &serde_json::Value| v.is_null() || v.as_str() == Some("auto");
        let mut vars: BTreeMap<&str, Value> = BTreeMap::new();
        vars.insert("bos_token", Value::from(self.bos_token.as_str()));
        vars.insert("eos_token", Value::from(self.eos_token.as_str()));
        vars.insert("unk_token", Value::from(self.unk_token.as_str()));
        vars.insert("pad_token", Value::from(self.pad_token.as_str()));
        vars.insert("documents", Value::from(()));
        let tools = options.tools.as_ref().map(vllm_tools);
        vars.insert("tools", tools.as_ref().map_or(Value::from(()), json));
        let kwargs = options.template_kwargs.as_ref();
        for (k, v) in kwargs.into_iter().flatten() {
            if k != "chat_template" && k != "tokenize" && !unset(v) {
                vars.insert(k.as_str(), json(v));
            }
        }
        if let Some(documents) = options.documents.as_ref().filter(|d| !unset(d)) {
            vars.insert("documents", json(documents));
        }
        if let Some(effort) = &options.reasoning_effort {
            if effort != "auto" {
                vars.insert("reasoning_effort", Value::from(effort.as_str()));
            }
            if !kwargs.is_some_and(|k| k.contains_key("enable_thinking")) {
                vars.insert("enable_thinking", Value::from(effort != "none"));
            }
        }
        vars.insert(
            "add_generation_prompt",
            Value::from(options.add_generation_prompt.unwrap_or(true)),
        );
        vars.insert("messages", Value::from(minijinja::value::Serde(&messages)));
        Value::from(vars)
    }

    /// A message as vLLM hands it to the template: role and content, an assistant's
    /// `tool_calls` (arguments as objects) and `reasoning` (also as `reasoning_content`), a
    /// tool message's `tool_call_id` (its all-text content as one string), and `name`.
    fn message<'a>(&self, m: &'a ChatMessage<'a>, marker: Option<String>) -> RenderMessage<'a> {
        let role = m.role.as_ref();
        // As parts, a tool result of text parts is one string (empty parts kept).
        let tool_text = role == "tool"
            && self.content_as_parts
            && marker.is_none()
            && m.content.iter().all(|p| matches!(p, ContentPart::Text(_)));
        let content = if tool_text {
            RenderContent::Text(join_text(&m.content, true))
        } else {
            self.content(&m.content, marker)
        };
        let mut out = RenderMessage::new(role, content);
        if let Some(extra) = &m.extra {
            match role {
                "assistant" => {
                    out.tool_calls = extra.tool_calls.as_ref().and_then(template_tool_calls);
                    out.reasoning = extra.reasoning.as_deref();
                    out.reasoning_content = extra.reasoning.as_deref();
                }
                "tool" => out.tool_call_id = extra.tool_call_id.as_deref(),
                _ => {}
            }
            out.name = extra.name.as_deref();
        }
        out
    }

    fn content<'a>(
        &self,
        parts: &'a [ContentPart<'a>],
        marker: Option<String>,
    ) -> RenderContent<'a> {
        if !self.content_as_parts {
            // vLLM leaves empty text parts out of the joined string.
            let mut text = join_text(parts, false);
            if let Some(m) = marker {
                text.insert_str(leading_whitespace(&text), &m);
            }
            return RenderContent::Text(text);
        }
        let mut out: Vec<RenderPart<'a>> = parts.iter().map(RenderPart::from).collect();
        if let Some(m) = marker {
            match out.iter_mut().find_map(|p| match p {
                RenderPart::Text { text } => Some(text),
                _ => None,
            }) {
                Some(text) => {
                    let mut marked = text.to_string();
                    marked.insert_str(leading_whitespace(&marked), &m);
                    *text = Cow::Owned(marked);
                }
                None => out.insert(
                    0,
                    RenderPart::Text {
                        text: Cow::Owned(m),
                    },
                ),
            }
        }
        RenderContent::Parts(out)
    }
}

/// Bytes of leading whitespace (as Python's `str.strip` sees it) of `s`.
fn leading_whitespace(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

/// The render's output, failing the render past `max_bytes`.
struct CappedWriter {
    buf: Vec<u8>,
    max_bytes: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.max_bytes {
            return Err(std::io::Error::other("rendered prompt too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// vLLM's "string" content format: the text parts joined with newlines (media dropped; the
/// engine's processor inserts its placeholders, which we cannot reproduce).
fn join_text(parts: &[ContentPart<'_>], keep_empty: bool) -> String {
    let mut out = String::new();
    let mut first = true;
    for part in parts {
        if let ContentPart::Text(t) = part {
            if t.is_empty() && !keep_empty {
                continue;
            }
            if !first {
                out.push('\n');
            }
            out.push_str(t);
            first = false;
        }
    }
    out
}

/// Does the template loop over a message's content (vLLM then passes OpenAI-style parts)?
/// vLLM inspects the template's AST; this finds the same `for` loops in the source text: loops
/// over `messages` (or `loop_messages`, a slice of it) name the message variables, and a loop
/// over `<message variable>['content']` / `.content` means parts.
fn iterates_over_content(source: &str) -> bool {
    // (loop variable, iterated expression) of every `{% for x in expr %}`, whitespace removed.
    let loops: Vec<(String, String)> = source
        .split("{%")
        .skip(1)
        .filter_map(|tag| {
            let tag = tag.split("%}").next()?;
            let tag = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
            let rest = tag.strip_prefix("for")?;
            let (var, expr) = rest.split_once(" in ")?;
            let compact = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
            Some((compact(var), compact(expr)))
        })
        .collect();
    let mut message_vars = vec!["message".to_string()];
    message_vars.extend(
        loops
            .iter()
            .filter(|(_, expr)| expr.starts_with("messages") || expr.starts_with("loop_messages"))
            .map(|(var, _)| var.clone()),
    );
    loops.iter().any(|(_, expr)| {
        message_vars.iter().any(|m| {
            [
                format!("{m}['content']"),
                format!("{m}[\"content\"]"),
                format!("{m}.content"),
            ]
            .iter()
            .any(|p| expr == p || expr.starts_with(&format!("{p}|")))
        })
    })
}

#[derive(Serialize)]
struct RenderMessage<'a> {
    role: &'a str,
    content: RenderContent<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

/// The request's `tools` as vLLM hands them to the template: each tool as its pydantic model
/// dumps it (`ChatCompletionToolsParam`, `FunctionDefinition`), keys in the models' order,
/// unknown ones dropped: `type` (default "function"), `function` with `name`, `description`
/// and `parameters` (null when absent) and `strict` / `defer_loading` when set (a tool-level
/// `defer_loading` copied into its function), then the tool's own `defer_loading` when set.
/// Anything vLLM would refuse (a tool that is not an object, a function without a name) is
/// passed as sent: the engine answers such a request with a 400 anyway.
fn vllm_tools(tools: &serde_json::Value) -> serde_json::Value {
    use serde_json::{Map, Value as J};
    let Some(list) = tools.as_array() else {
        return tools.clone();
    };
    let set = |v: Option<&J>| v.filter(|v| !v.is_null()).cloned();
    J::Array(
        list.iter()
            .map(|tool| {
                let Some(function) = tool.get("function").filter(|f| f.get("name").is_some())
                else {
                    return tool.clone();
                };
                let tool_defer = set(tool.get("defer_loading"));
                let mut f = Map::new();
                f.insert("name".into(), function["name"].clone());
                for key in ["description", "parameters"] {
                    f.insert(key.into(), function.get(key).cloned().unwrap_or(J::Null));
                }
                if let Some(strict) = set(function.get("strict")) {
                    f.insert("strict".into(), strict);
                }
                if let Some(defer) =
                    set(function.get("defer_loading")).or_else(|| tool_defer.clone())
                {
                    f.insert("defer_loading".into(), defer);
                }
                let mut out = Map::new();
                out.insert(
                    "type".into(),
                    set(tool.get("type")).unwrap_or_else(|| J::from("function")),
                );
                out.insert("function".into(), J::Object(f));
                if let Some(defer) = tool_defer {
                    out.insert("defer_loading".into(), defer);
                }
                J::Object(out)
            })
            .collect(),
    )
}

impl<'a> RenderMessage<'a> {
    /// A message with no fields beside role and content.
    fn new(role: &'a str, content: RenderContent<'a>) -> Self {
        RenderMessage {
            role,
            content,
            tool_calls: None,
            reasoning: None,
            reasoning_content: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// An assistant's `tool_calls` as vLLM's `_postprocess_messages` leaves them: an empty list is
/// dropped (the template takes its plain assistant path); each call's `function.arguments`
/// becomes an object (a JSON string parsed; anything that is not, or does not parse to, an
/// object becomes `{}`). Anything else is passed as sent.
fn template_tool_calls(calls: &serde_json::Value) -> Option<serde_json::Value> {
    use serde_json::Value as J;
    let J::Array(items) = calls else {
        return Some(calls.clone());
    };
    if items.is_empty() {
        return None;
    }
    let mut items = items.clone();
    for item in &mut items {
        let Some(function) = item.get_mut("function").and_then(J::as_object_mut) else {
            continue;
        };
        let arguments = match function.get("arguments") {
            Some(J::Object(_)) => continue,
            Some(J::String(s)) => match serde_json::from_str::<J>(s) {
                Ok(J::Object(o)) => J::Object(o),
                _ => J::Object(serde_json::Map::new()),
            },
            _ => J::Object(serde_json::Map::new()),
        };
        function.insert("arguments".into(), arguments);
    }
    Some(J::Array(items))
}

/// vLLM's `_consolidate_system_messages`, after developer messages became system ones: when a
/// system message is not first, or there are several, their texts (a message's text parts joined
/// with "\n", empty ones left out) become one system message, first, joined with "\n\n".
fn consolidate_system_messages(messages: Vec<RenderMessage<'_>>) -> Vec<RenderMessage<'_>> {
    let mut systems = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == "system")
        .map(|(i, _)| i);
    if matches!(
        (systems.next(), systems.next()),
        (None, _) | (Some(0), None)
    ) {
        return messages;
    }
    let mut system = Vec::new();
    let mut rest = Vec::with_capacity(messages.len());
    for m in messages {
        if m.role != "system" {
            rest.push(m);
            continue;
        }
        let text = match m.content {
            RenderContent::Text(t) => t,
            RenderContent::Parts(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    RenderPart::Text { text } => Some(text.as_ref()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
        };
        if !text.is_empty() {
            system.push(text);
        }
    }
    let mut out = Vec::with_capacity(rest.len() + 1);
    out.push(RenderMessage::new(
        "system",
        RenderContent::Text(system.join("\n\n")),
    ));
    out.extend(rest);
    out
}

#[derive(Serialize)]
#[serde(untagged)]
enum RenderContent<'a> {
    Text(String),
    Parts(Vec<RenderPart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum RenderPart<'a> {
    Text { text: Cow<'a, str> },
    Image {},
    Audio {},
}

impl<'a> From<&'a ContentPart<'a>> for RenderPart<'a> {
    fn from(part: &'a ContentPart<'a>) -> Self {
        match part {
            ContentPart::Text(t) => RenderPart::Text {
                text: Cow::Borrowed(t),
            },
            ContentPart::Image(_) => RenderPart::Image {},
            ContentPart::Media(_) => RenderPart::Audio {},
        }
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time; supports `%d %m %Y %y %b %B %H %M %S %j %%`.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs)
}

fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix_secs / 86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    let secs_of_day = unix_secs % 86_400;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('H') => out.push_str(&format!("{:02}", secs_of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs_of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs_of_day % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1-12, day 1-31) (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// HF's `tojson`: Python `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=...)`,
/// i.e. `", "` and `": "` separators when compact, newlines and `indent` spaces otherwise; no
/// HTML escaping; keys in insertion order unless `sort_keys`.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // Other keyword arguments (separators, ensure_ascii) are accepted and ignored.
    for key in ["ensure_ascii", "separators"] {
        let _: Option<Value> = kwargs.get(key)?;
    }
    kwargs.assert_all_used()?;
    let value = if sort_keys == Some(true) {
        let json = serde_json::to_value(&value)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        Value::from(minijinja::value::Serde(&sorted_keys(json)))
    } else {
        value
    };
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            value.serialize(&mut ser)
        }
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// `value` with every object's keys sorted (Python's `sort_keys=True`).
fn sorted_keys(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sorted_keys).collect())
        }
        other => other,
    }
}

/// `json.dumps` default separators: `", "` between items, `": "` after keys.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Reads a template file (`chat_template.jinja`).
pub(crate) fn read_template(path: &Path, field: &str) -> Result<String, PrefixError> {
    std::fs::read_to_string(path).map_err(|e| PrefixError::Load {
        field: field.to_string(),
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    fn msg<'a>(role: &'a str, text: &'a str) -> ChatMessage<'a> {
        with_parts(role, vec![ContentPart::Text(Cow::Borrowed(text))])
    }

    fn with_parts<'a>(role: &'a str, content: Vec<ContentPart<'a>>) -> ChatMessage<'a> {
        ChatMessage {
            role: Cow::Borrowed(role),
            content,
            extra: None,
        }
    }

    fn template(source: &str) -> ChatTemplate {
        let config = TokenizerConfigFile::parse(
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#,
        )
        .unwrap();
        ChatTemplate::new(source.to_string(), &config, RenderLimits::default()).unwrap()
    }

    #[test]
    fn renders_like_hf_jinja() {
        let cases: &[(&str, &str)] = &[
            // bos from an AddedToken object; generation prompt on.
            (
                "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
                "<s>[user] hi there >",
            ),
            // trim_blocks + lstrip_blocks: block tags on their own lines leave no whitespace.
            (
                "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}\n",
                "U: hi there \n",
            ),
            // Python string methods (pycompat) and loop controls.
            (
                "{% for m in messages %}{% if m.content.startswith(' hi') %}{{ m.content.strip() | upper }}{% break %}{% endif %}{% endfor %}",
                "HI THERE",
            ),
            // tojson formats like Python's json.dumps.
            (
                "{{ {'a': [1, 'é'], 'b': none} | tojson }}",
                r#"{"a": [1, "é"], "b": null}"#,
            ),
            ("{{ [1] | tojson(indent=2) }}", "[\n  1\n]"),
            // Insertion order, as Python's dicts keep it, unless sort_keys.
            (
                "{{ {'b': 1, 'a': {'d': 2, 'c': 3}} | tojson }}",
                r#"{"b": 1, "a": {"d": 2, "c": 3}}"#,
            ),
            (
                "{{ {'b': 1, 'a': {'d': 2, 'c': [{'z': 0, 'y': 1}]}} | tojson(sort_keys=true) }}",
                r#"{"a": {"c": [{"y": 1, "z": 0}], "d": 2}, "b": 1}"#,
            ),
            // Slicing with a step, as Qwen templates do.
            ("{% for m in messages[::-1] %}{{ m.role }}{% endfor %}", "user"),
        ];
        let messages = [msg("user", " hi there ")];
        for (source, expected) in cases {
            let out = template(source).render(&messages).unwrap();
            assert_eq!(&out, expected, "template {source:?}");
        }
    }

    #[test]
    fn developer_messages_become_system_ones_unless_the_template_names_the_role() {
        // As vLLM's `safe_apply_chat_template`: converted, then system messages merged first.
        let plain = template("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}");
        let render = |t: &ChatTemplate, m: &[ChatMessage<'_>]| t.render_with(m, false).unwrap();
        assert_eq!(
            render(&plain, &[msg("developer", "Be terse."), msg("user", "hi")]),
            "[system]Be terse.[user]hi"
        );
        assert_eq!(
            render(
                &plain,
                &[
                    msg("system", "A"),
                    msg("user", "hi"),
                    msg("developer", "B"),
                    msg("developer", ""),
                ]
            ),
            "[system]A\n\nB[user]hi"
        );
        // Without a developer message nothing moves, even with two system messages.
        assert_eq!(
            render(&plain, &[msg("user", "hi"), msg("system", "late")]),
            "[user]hi[system]late"
        );
        let knows = template(
            "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}{% endfor %}",
        );
        assert_eq!(
            render(&knows, &[msg("developer", "Be terse."), msg("user", "hi")]),
            "D:Be terse.hi"
        );
        // A template that iterates over parts: the merged system message is a string.
        let parts = template(
            "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
        );
        let two = with_parts(
            "developer",
            vec![
                ContentPart::Text(Cow::Borrowed("x")),
                ContentPart::Text(Cow::Borrowed("y")),
            ],
        );
        assert_eq!(
            render(&parts, &[msg("user", "hi"), two]),
            "[system]x\ny[user]hi"
        );
    }

    #[test]
    fn raise_exception_is_an_error_and_bad_templates_fail_to_compile() {
        let t = template("{{ raise_exception('roles must alternate') }}");
        let err = t.render(&[msg("user", "x")]).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        let config = TokenizerConfigFile::default();
        assert!(ChatTemplate::new("{% for %}".into(), &config, RenderLimits::default()).is_err());
    }

    #[test]
    fn content_format_follows_the_template() {
        assert!(iterates_over_content(
            "{% for item in message['content'] %}{% endfor %}"
        ));
        assert!(iterates_over_content(
            "{%- for c in message.content -%}{% endfor %}"
        ));
        assert!(!iterates_over_content(
            "{{ message['content'] }}{% for m in messages %}{% endfor %}"
        ));
        assert!(!iterates_over_content(
            "{% for x in tools %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
        ));
        let parts = template(
            "{% for m in messages %}{% for p in m['content'] %}<{{ p.type }}>{% endfor %}{% endfor %}",
        );
        let m = with_parts(
            "user",
            vec![
                ContentPart::Text(Cow::Borrowed("a")),
                ContentPart::Image(7),
                ContentPart::Text(Cow::Borrowed("b")),
            ],
        );
        assert_eq!(
            parts.render(std::slice::from_ref(&m)).unwrap(),
            "<text><image><text>"
        );
        let string = template("{% for m in messages %}{{ m['content'] }}{% endfor %}");
        assert_eq!(string.render(&[m]).unwrap(), "a\nb");
    }

    #[test]
    fn chat_template_lists_pick_default() {
        let cfg = TokenizerConfigFile::parse(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.chat_template.as_deref(), Some("D"));
        assert!(TokenizerConfigFile::parse(
            r#"{"chat_template": [{"name": "x", "template": "T"}]}"#
        )
        .is_err());
        assert!(TokenizerConfigFile::parse("{").is_err());
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-02-29 13:05:09 UTC
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %j %B %y %%", t),
            "2024-02-29 13:05:09 060 February 24 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }
}
