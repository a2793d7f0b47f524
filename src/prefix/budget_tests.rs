//! The work bounds of issue 12: media layout in one extra render, template fuel and output
//! size, deadlines. Each ends in an identity, never an error, and says which.

use std::borrow::Cow;
use std::path::Path;
use std::time::{Duration, Instant};

use super::tests::fixture_dir;
use super::*;
use crate::config::ModelConfig;
use crate::request::{self, ApiKind, ChatMessage, ContentPart, ParsedRequest, Prompt};

fn registry_with(
    template: Option<&str>,
    tweak: impl FnOnce(&mut ModelConfig),
) -> TokenizerRegistry {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.keep();
    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        path.join("tokenizer.json"),
    )
    .unwrap();
    let source = match template {
        Some(t) => t.to_string(),
        None => std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap(),
    };
    std::fs::write(path.join("chat_template.jinja"), source).unwrap();
    let mut config = ModelConfig {
        name: "m".into(),
        tokenizer: Some(path.display().to_string()),
        ..ModelConfig::default()
    };
    tweak(&mut config);
    let reg = TokenizerRegistry::from_config(&[config], Path::new("/")).unwrap();
    let _ = std::fs::remove_dir_all(&path);
    reg
}

fn ns() -> Namespace {
    Namespace::new("m", None, None)
}

fn chat_request(messages: Vec<ChatMessage<'_>>) -> ParsedRequest<'_> {
    ParsedRequest {
        api: ApiKind::ChatCompletions,
        model: Cow::Borrowed("m"),
        stream: false,
        max_tokens: None,
        cache_salt: None,
        prompt: Prompt::Chat(messages),
        chat: Default::default(),
    }
}

fn text(role: &str, s: impl Into<Cow<'static, str>>) -> ChatMessage<'static> {
    ChatMessage {
        role: Cow::Owned(role.to_string()),
        content: vec![ContentPart::Text(s.into())],
        extra: None,
    }
}

fn with_image(role: &str, s: &'static str, image: u64) -> ChatMessage<'static> {
    ChatMessage {
        role: Cow::Owned(role.to_string()),
        content: vec![
            ContentPart::Text(Cow::Borrowed(s)),
            ContentPart::Image(image),
        ],
        extra: None,
    }
}

/// The token offset of each media message is the token count of the rendered prompt before
/// its content: checked against tokenizing that prefix of the rendered text whole.
#[test]
fn media_offsets_are_the_tokens_before_each_media_message_content() {
    let reg = registry_with(None, |_| {});
    let t = reg.tokenizer("m").unwrap();
    let messages = vec![
        text("system", "You describe pictures. ".repeat(20)),
        with_image("user", "  what is in this one?", 11),
        text("assistant", "A cat on a mat."),
        with_image("user", "and this?", 22),
    ];
    let tokens = t.tokenize_chat(&messages).unwrap();
    assert_eq!(tokens.media.len(), 2);
    let template = std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap();
    let full = minijinja::Environment::new()
        .template_from_str(&template)
        .unwrap()
        .render(minijinja::context! {
            messages => vec![
                minijinja::context!{role => "system", content => "You describe pictures. ".repeat(20)},
                minijinja::context!{role => "user", content => "  what is in this one?"},
                minijinja::context!{role => "assistant", content => "A cat on a mat."},
                minijinja::context!{role => "user", content => "and this?"},
            ],
            add_generation_prompt => true,
        })
        .unwrap();
    for ((offset, hash), (needle, want_hash)) in tokens
        .media
        .iter()
        .zip([("what is in this one?", 11u64), ("and this?", 22)])
    {
        let at = full.find(needle).unwrap();
        let before = t.tokenize(&full[..at], false, false).unwrap().total_tokens;
        assert_eq!((*offset, *hash), (before, want_hash), "{needle}");
        // The whole-text path (tokenizers whose segments are not verified) maps it the same.
        let whole = t
            .tokenize_inner_for_test(&full, false, None, &[(at, want_hash)])
            .unwrap();
        assert_eq!(whole.media, vec![(before, want_hash)], "{needle}");
    }
}

/// A template with no special token between messages puts them all in one segment: their
/// media are mapped in one pass with offsets (encoding each one's head alone was quadratic in
/// the media and left a cache entry per media message), to the same offsets.
#[test]
fn media_sharing_a_segment_are_mapped_in_one_pass() {
    const PLAIN: &str = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    let reg = registry_with(Some(PLAIN), |c| c.max_prefix_tokens = 1 << 20);
    let t = reg.tokenizer("m").unwrap();
    let contents = ["what is in this one?", "and this?", "and the last"];
    let messages: Vec<_> = contents
        .iter()
        .enumerate()
        .map(|(i, c)| with_image("user", c, i as u64))
        .collect();
    let tokens = t.tokenize_chat(&messages).unwrap();
    assert_eq!(tokens.media.len(), 3);
    let full: String = contents.iter().map(|c| format!("<user>{c}")).collect();
    for ((offset, hash), (i, needle)) in tokens.media.iter().zip(contents.iter().enumerate()) {
        let at = full.find(needle).unwrap();
        let before = t.tokenize(&full[..at], false, false).unwrap().total_tokens;
        assert_eq!((*offset, *hash), (before, i as u64), "{needle}");
    }
    // Thousands of them: a few cache entries, not one per media message.
    let many: Vec<_> = (0..3000u64)
        .map(|i| with_image("user", "abcdefghijklmnop", i))
        .collect();
    let entries = t.cache_stats().0;
    let id = reg.identify(&chat_request(many), &ns());
    assert_eq!(id.source(), "tokens");
    let added = t.cache_stats().0 - entries;
    assert!(added < 20, "{added} new cache entries");
}

/// Thousands of image messages: one identity with every image in place, in two renders (the
/// old per-message re-render took seconds for 2,000; see benches/prefix.rs for timings).
#[test]
fn many_media_messages_are_identified_exactly() {
    let reg = registry_with(None, |c| c.max_prefix_tokens = 1 << 20);
    let messages: Vec<_> = (0..3000).map(|i| with_image("user", "look", i)).collect();
    let id = reg.identify(&chat_request(messages.clone()), &ns());
    assert_eq!((id.source(), id.fallback), ("tokens", None));
    // Changing one image changes the blocks from its message on, not before.
    let mut other = messages;
    other[2000] = with_image("user", "look", 99_999);
    let id2 = reg.identify(&chat_request(other), &ns());
    let shared = id
        .block_hashes
        .iter()
        .zip(&id2.block_hashes)
        .take_while(|(a, b)| a == b)
        .count();
    let at = shared as f64 / id.block_hashes.len() as f64;
    assert!(
        (0.6..0.72).contains(&at),
        "{shared} of {} blocks shared",
        id.block_hashes.len()
    );
}

/// A template that does not render content as given: no layout, so the byte identity, which
/// keeps media in place.
#[test]
fn templates_that_inspect_content_fall_back_to_bytes_for_media() {
    let reg = registry_with(
        Some("{% for m in messages %}{% if m.content.startswith('h') %}!{% endif %}{{ m.content }}{% endfor %}"),
        |_| {},
    );
    let id = reg.identify(&chat_request(vec![with_image("user", "hello", 1)]), &ns());
    assert_eq!(id.fallback, Some(Fallback::MediaLayout));
    assert_eq!(id.source(), "bytes");
    let plain = reg.identify(&chat_request(vec![text("user", "hello")]), &ns());
    assert_eq!(
        plain.source(),
        "tokens",
        "without media the template is used"
    );
}

/// A quadratic template runs out of fuel; a huge rendering runs out of room. Both end in the
/// byte identity, labelled `work-budget`.
#[test]
fn render_limits_end_in_the_byte_identity() {
    let quadratic =
        "{% for a in messages %}{% for b in messages %}{{ b.role }}{% endfor %}{% endfor %}";
    let reg = registry_with(Some(quadratic), |c| c.template_fuel = 100_000);
    let messages: Vec<_> = (0..2000).map(|_| text("user", "x")).collect();
    let id = reg.identify(&chat_request(messages), &ns());
    assert_eq!(id.fallback, Some(Fallback::WorkBudget));
    assert!(!id.block_hashes.is_empty() || id.tokens > 0);
    let few: Vec<_> = (0..5).map(|_| text("user", "x")).collect();
    assert_eq!(reg.identify(&chat_request(few), &ns()).source(), "tokens");

    let reg = registry_with(None, |c| c.max_rendered_prompt_bytes = 1000);
    let big = vec![text("user", "y".repeat(2000))];
    let id = reg.identify(&chat_request(big), &ns());
    assert_eq!(
        (id.fallback, id.source()),
        (Some(Fallback::WorkBudget), "bytes")
    );
    let t = reg.tokenizer("m").unwrap();
    let err = t
        .tokenize_chat(&[text("user", "y".repeat(2000))])
        .unwrap_err();
    assert_eq!(err, PrefixError::Budget("rendered prompt size"));
}

/// Past the deadline before rendering: the byte identity. Past it while tokenizing: the exact
/// prefix tokenized so far, whose hashes lead the full identity's.
#[test]
fn deadlines_give_a_cheaper_identity_not_an_error() {
    let reg = registry_with(None, |_| {});
    let messages = vec![
        text("system", "Shared instructions. ".repeat(200)),
        text("user", "A question. ".repeat(200)),
    ];
    let full = reg.identify(&chat_request(messages.clone()), &ns());
    assert_eq!(full.source(), "tokens");
    let gone = Instant::now() - Duration::from_millis(1);
    let late = reg.identify_until(&chat_request(messages.clone()), &ns(), Some(gone));
    assert_eq!(
        (late.fallback, late.source()),
        (Some(Fallback::Deadline), "bytes")
    );

    // The deadline passes between the first segment and the rest.
    let t = reg.tokenizer("m").unwrap();
    let rendered = t.tokenize_chat(&messages).unwrap();
    let text_rendered = {
        let cfg = template::TokenizerConfigFile::default();
        let source = std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap();
        template::ChatTemplate::new(source, &cfg, template::RenderLimits::default())
            .unwrap()
            .render(&messages)
            .unwrap()
    };
    let partial = t
        .tokenize_inner_for_test(&text_rendered, true, Some(gone), &[])
        .unwrap();
    assert!(partial.deadline_cut && partial.truncated);
    assert!(!partial.ids.is_empty() && partial.ids.len() < rendered.ids.len());
    assert_eq!(
        partial.ids[..],
        rendered.ids[..partial.ids.len()],
        "a prefix of the exact ids"
    );
    let estimate = partial.total_tokens as f64 / rendered.total_tokens as f64;
    assert!(
        (0.6..1.6).contains(&estimate),
        "total estimated: {estimate}"
    );

    let completion = request::parse(
        ApiKind::Completions,
        br#"{"model": "m", "prompt": "hello"}"#,
    )
    .unwrap();
    let late = reg.identify_until(&completion, &ns(), Some(gone));
    assert_eq!(late.fallback, Some(Fallback::Deadline));
    let token_ids = request::parse(
        ApiKind::Completions,
        br#"{"model": "m", "prompt": [1, 2, 3]}"#,
    )
    .unwrap();
    assert_eq!(
        reg.identify_until(&token_ids, &ns(), Some(gone)).source(),
        "tokens",
        "token ids cost nothing"
    );
}

#[test]
fn sources_are_labelled() {
    let reg = registry_with(None, |c| {
        c.max_prefix_tokens = 32;
    });
    let long = reg.identify(
        &chat_request(vec![text("user", "word ".repeat(500))]),
        &ns(),
    );
    assert_eq!(long.source(), "tokens-capped");
    let none = reg.identify(
        &chat_request(vec![text("user", "hi")]),
        &Namespace::new("other", None, None),
    );
    assert_eq!(
        (none.source(), none.fallback),
        ("bytes", Some(Fallback::NoTokenizer))
    );
}
