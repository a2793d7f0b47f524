//! Where each media-carrying message's content starts in the rendered prompt, found in one
//! extra render, so a conversation with N images costs two renders, not N.
//!
//! A media hash joins the block in which its message's content starts (see [`super`]); that
//! needs the message's byte position in the rendered prompt. Rendering `messages[..i]` for every
//! such message (what this replaced) is quadratic: 2,000 image messages took 2.7 s and 60,000
//! never finished. Instead the conversation is rendered a second time with a marker
//! (`U+F8FF <index> U+F8FE`, private-use characters) at the start of each media message's
//! content, after its leading whitespace. Removing the markers must give back exactly the
//! unmarked rendering: then each marker's position (in the text without markers) is where that
//! message's content starts. If it does not (the template inspects content, e.g.
//! `content.startswith(...)`, or a message already contains `U+F8FF`), there is no layout and
//! the caller falls back to the byte identity, whose chunking keeps media in place.

use super::template::ChatTemplate;
use crate::request::{ChatMessage, ChatOptions, ContentPart};

const OPEN: char = '\u{F8FF}';
const CLOSE: char = '\u{F8FE}';

/// A media hash and the byte offset, in the rendered prompt, of the start of its message's
/// content.
pub(crate) type MediaAt = (usize, u64);

/// The media of `messages` with their byte offsets in `rendered` (the unmarked rendering with
/// the same generation-prompt setting), in message order; `None` when the layout cannot be
/// trusted. `Err` is the marked render's own failure (fuel, size).
pub(crate) fn locate(
    template: &ChatTemplate,
    messages: &[ChatMessage<'_>],
    options: &ChatOptions,
    rendered: &str,
) -> Result<Option<Vec<MediaAt>>, minijinja::Error> {
    if rendered.contains(OPEN) {
        return Ok(None);
    }
    let marked = template.render_marked(messages, options, &|i| {
        messages[i].has_media().then(|| format!("{OPEN}{i}{CLOSE}"))
    })?;
    let Some((unmarked, found)) = strip_markers(&marked, messages.len()) else {
        return Ok(None);
    };
    if unmarked != rendered {
        return Ok(None);
    }
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if !m.has_media() {
            continue;
        }
        let Some(at) = found[i] else {
            return Ok(None);
        };
        for part in &m.content {
            if let ContentPart::Image(h) | ContentPart::Media(h) = part {
                out.push((at, *h));
            }
        }
    }
    Ok(Some(out))
}

/// `marked` without its markers, and per message index the byte offset of its marker in the
/// result. `None` for a malformed or repeated marker.
fn strip_markers(marked: &str, messages: usize) -> Option<(String, Vec<Option<usize>>)> {
    let mut found: Vec<Option<usize>> = vec![None; messages];
    let mut out = String::with_capacity(marked.len());
    let mut rest = marked;
    while let Some(open) = rest.find(OPEN) {
        out.push_str(&rest[..open]);
        let after = &rest[open + OPEN.len_utf8()..];
        let close = after.find(CLOSE)?;
        let index: usize = after[..close].parse().ok()?;
        let slot = found.get_mut(index)?;
        if slot.replace(out.len()).is_some() {
            return None;
        }
        rest = &after[close + CLOSE.len_utf8()..];
    }
    out.push_str(rest);
    Some((out, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::template::{RenderLimits, TokenizerConfigFile};
    use std::borrow::Cow;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(
            source.into(),
            &TokenizerConfigFile::default(),
            RenderLimits::default(),
        )
        .unwrap()
    }

    fn message<'a>(role: &'a str, parts: Vec<ContentPart<'a>>) -> ChatMessage<'a> {
        ChatMessage {
            role: Cow::Borrowed(role),
            content: parts,
            extra: None,
        }
    }

    fn text(s: &str) -> ContentPart<'_> {
        ContentPart::Text(Cow::Borrowed(s))
    }

    #[test]
    fn finds_each_media_message_content_start() {
        let messages = [
            message("system", vec![text("be brief")]),
            message("user", vec![text("  look"), ContentPart::Image(7)]),
            message("assistant", vec![text("ok")]),
            message("user", vec![ContentPart::Image(8), ContentPart::Media(9)]),
        ];
        // String content (trimmed, as Llama 3 does) and parts content (as Gemma 3 does).
        for source in [
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</>{% endfor %}",
            "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{% if p.type == 'text' %}{{ p.text | trim }}{% else %}[img]{% endif %}{% endfor %}</>{% endfor %}",
        ] {
            let t = template(source);
            let rendered = t.render(&messages).unwrap();
            let at = locate(&t, &messages, &ChatOptions::default(), &rendered).unwrap().unwrap();
            assert_eq!(at.len(), 3, "{source}");
            let user = rendered.find("<user>").unwrap() + "<user>".len();
            assert_eq!(at[0], (user, 7));
            assert_eq!(&rendered[at[0].0..at[0].0 + 4], "look");
            let last = rendered.rfind("<user>").unwrap() + "<user>".len();
            assert_eq!((at[1], at[2]), ((last, 8), (last, 9)));
        }
    }

    #[test]
    fn no_layout_when_the_template_reacts_to_content_or_markers_exist() {
        let messages = [message("user", vec![text("hi"), ContentPart::Image(1)])];
        // The template branches on the content: the marked render differs.
        let t = template(
            "{% for m in messages %}{% if m.content.startswith('hi') %}H{% endif %}{{ m.content }}{% endfor %}",
        );
        let rendered = t.render(&messages).unwrap();
        assert_eq!(
            locate(&t, &messages, &ChatOptions::default(), &rendered).unwrap(),
            None
        );
        // The client's text already holds the marker character.
        let forged = [message(
            "user",
            vec![text("\u{F8FF}0\u{F8FE}"), ContentPart::Image(1)],
        )];
        let t = template("{% for m in messages %}{{ m.content }}{% endfor %}");
        let rendered = t.render(&forged).unwrap();
        assert_eq!(
            locate(&t, &forged, &ChatOptions::default(), &rendered).unwrap(),
            None
        );
        // A template that shows the content twice.
        let t = template("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}");
        let rendered = t.render(&messages).unwrap();
        assert_eq!(
            locate(&t, &messages, &ChatOptions::default(), &rendered).unwrap(),
            None
        );
    }

    #[test]
    fn malformed_markers_are_rejected() {
        assert_eq!(strip_markers("a\u{F8FF}x\u{F8FE}b", 1), None);
        assert_eq!(strip_markers("a\u{F8FF}0", 1), None);
        assert_eq!(strip_markers("a\u{F8FF}5\u{F8FE}", 1), None);
        assert_eq!(
            strip_markers("ab\u{F8FF}0\u{F8FE}cd", 1),
            Some(("abcd".to_string(), vec![Some(2)]))
        );
    }
}
