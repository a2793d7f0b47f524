//! Whether a chat template wants message content as a string or as OpenAI-style parts:
//! vLLM's `auto` content format, decided from the template's statements.
//!
//! vLLM walks the Jinja AST: names assigned from `messages` (or a slice, filter or test of it)
//! join `messages`; loop variables of `for` loops over any of those are message variables; a
//! `for` loop over a message variable's `content` (`m['content']`, `m.content`, sliced or
//! filtered) means the template iterates parts, so content is passed as a list. This module
//! reads the `{% for %}` and `{% set %}` statements of the source and applies the same rule.

/// How message content reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: the text parts joined with newlines.
    String,
    /// A list of `{"type": ...}` parts.
    OpenAi,
}

/// The content format `source` expects.
pub fn detect(source: &str) -> ContentFormat {
    let statements: Vec<Statement<'_>> = statement_bodies(source).filter_map(statement).collect();
    let mut related = vec!["messages"];
    // Breadth-first over assignments, as vLLM follows `set a = messages`, `set b = a[1:]`...
    let mut i = 0;
    while i < related.len() {
        let name = related[i];
        for s in &statements {
            if let Statement::Set { target, value } = *s {
                if accesses(value, name, None) && !related.contains(&target) {
                    related.push(target);
                }
            }
        }
        i += 1;
    }
    let message_vars: Vec<&str> = statements
        .iter()
        .filter_map(|s| match *s {
            Statement::For { target, iter } if related.iter().any(|r| accesses(iter, r, None)) => {
                Some(target)
            }
            _ => None,
        })
        .collect();
    let iterates_content = statements.iter().any(|s| match *s {
        Statement::For { iter, .. } => message_vars
            .iter()
            .any(|m| accesses(iter, m, Some("content"))),
        Statement::Set { .. } => false,
    });
    if iterates_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

#[derive(Debug, Clone, Copy)]
enum Statement<'a> {
    /// `for target in iter`.
    For { target: &'a str, iter: &'a str },
    /// `set target = value`.
    Set { target: &'a str, value: &'a str },
}

/// The bodies of `{% ... %}` tags (whitespace-control marks removed), comments skipped.
fn statement_bodies(source: &str) -> impl Iterator<Item = &str> {
    let mut rest = source;
    std::iter::from_fn(move || loop {
        let tag = rest.find("{%");
        let comment = rest.find("{#");
        match (tag, comment) {
            (Some(t), Some(c)) if c < t => {
                rest = rest[c..].find("#}").map_or("", |e| &rest[c + e + 2..]);
            }
            (Some(t), _) => {
                let after = &rest[t + 2..];
                let end = after.find("%}")?;
                rest = &after[end + 2..];
                let body = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c == '~');
                return Some(body.trim());
            }
            (None, _) => return None,
        }
    })
}

fn statement(body: &str) -> Option<Statement<'_>> {
    if let Some(rest) = keyword(body, "for") {
        let (target, iter) = rest.split_once(" in ")?;
        let target = target.trim();
        // A loop filter or `recursive` ends the iterated expression.
        let iter = [" if ", " recursive"]
            .iter()
            .filter_map(|k| iter.find(k))
            .min()
            .map_or(iter, |end| &iter[..end]);
        return is_name(target).then_some(Statement::For {
            target,
            iter: iter.trim(),
        });
    }
    if let Some(rest) = keyword(body, "set") {
        let (target, value) = rest.split_once('=')?;
        let target = target.trim();
        return is_name(target).then_some(Statement::Set {
            target,
            value: value.trim(),
        });
    }
    None
}

/// The text after `word` when `body` starts with it as a whole word.
fn keyword<'a>(body: &'a str, word: &str) -> Option<&'a str> {
    let rest = body.strip_prefix(word)?;
    rest.starts_with(char::is_whitespace).then_some(rest)
}

fn is_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// Is `expr` the variable `var` (or its `key` item), possibly sliced, filtered or tested?
/// (`messages`, `messages[1:]`, `messages|reverse`, `m['content']`, `m.content|list`...)
fn accesses(expr: &str, var: &str, key: Option<&str>) -> bool {
    let Some(mut rest) = expr.strip_prefix(var) else {
        return false;
    };
    if rest.starts_with(|c: char| c.is_alphanumeric() || c == '_') {
        return false; // a longer name
    }
    if let Some(key) = key {
        rest = rest.trim_start();
        let after = if let Some(r) = rest.strip_prefix('.') {
            r.trim_start()
                .strip_prefix(key)
                .filter(|r| !r.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
        } else if let Some(r) = rest.strip_prefix('[') {
            let r = r.trim_start();
            [format!("'{key}'"), format!("\"{key}\"")]
                .iter()
                .find_map(|quoted| r.strip_prefix(quoted.as_str()))
                .and_then(|r| r.trim_start().strip_prefix(']'))
        } else {
            None
        };
        match after {
            Some(r) => rest = r,
            None => return false,
        }
    }
    // Slices keep the elements; an index (`[0]`) picks one and is not an access of them.
    loop {
        rest = rest.trim_start();
        let Some(inner) = rest.strip_prefix('[') else {
            break;
        };
        let Some(close) = inner.find(']') else {
            return false;
        };
        if !inner[..close].contains(':') {
            return false;
        }
        rest = &inner[close + 1..];
    }
    rest.is_empty() || rest.starts_with('|') || keyword(rest, "is").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_of_both_formats() {
        let cases = [
            // SmolLM2 / ChatML: content concatenated as a string.
            ("{% for message in messages %}{{ message['content'] }}{% endfor %}", ContentFormat::String),
            // Gemma 3: a slice of messages, then a loop over each message's content.
            (
                "{%- set loop_messages = messages[1:] -%}{%- for message in loop_messages -%}{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}{%- for item in message['content'] -%}{{ item['text'] }}{%- endfor -%}{%- endif -%}{%- endfor -%}",
                ContentFormat::OpenAi,
            ),
            ("{% for m in messages|reverse %}{% for p in m.content|list %}{% endfor %}{% endfor %}", ContentFormat::OpenAi),
            ("{% for m in messages if m.role != 'system' %}{% for p in m [ \"content\" ] %}{% endfor %}{% endfor %}", ContentFormat::OpenAi),
            // A loop over something else's content does not count.
            ("{% for m in messages %}{% endfor %}{% for t in tools %}{% for p in t.content %}{% endfor %}{% endfor %}", ContentFormat::String),
            // Neither does a loop over one element (`[0]` is an index, not a slice).
            ("{% set first = messages[0] %}{% for p in first.content %}{% endfor %}", ContentFormat::String),
            // Nor a name that merely starts like one, nor a commented-out loop.
            ("{% for m in messages_x %}{% for p in m.content %}{% endfor %}{% endfor %}", ContentFormat::String),
            ("{# {% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %} #}", ContentFormat::String),
            // Chained assignments are followed.
            ("{% set a = messages %}{% set b = a[::-1] %}{% for m in b %}{% for p in m['content'] %}{% endfor %}{% endfor %}", ContentFormat::OpenAi),
        ];
        for (source, expected) in cases {
            assert_eq!(detect(source), expected, "{source}");
        }
    }
}
