//! Deciding before the new text is tokenized (`models[].defer_tokenizing_after`): what is
//! left out, and that finishing gives exactly the identity tokenizing inline would have.

use std::borrow::Cow;
use std::path::Path;

use super::tests::fixture_dir;
use super::*;
use crate::config::ModelConfig;
use crate::request::{ApiKind, ChatMessage, ContentPart, ParsedRequest, Prompt};

fn registry(tweak: impl FnOnce(&mut ModelConfig)) -> TokenizerRegistry {
    let mut config = ModelConfig {
        name: "m".into(),
        tokenizer: Some(fixture_dir().display().to_string()),
        ..ModelConfig::default()
    };
    tweak(&mut config);
    TokenizerRegistry::from_config(&[config], Path::new("/")).unwrap()
}

fn ns() -> Namespace {
    Namespace::new("m", None, None)
}

fn text(role: &str, s: impl Into<Cow<'static, str>>) -> ChatMessage<'static> {
    ChatMessage {
        role: Cow::Owned(role.to_string()),
        content: vec![ContentPart::Text(s.into())],
        extra: None,
    }
}

fn chat(messages: Vec<ChatMessage<'static>>) -> ParsedRequest<'static> {
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

fn system() -> ChatMessage<'static> {
    text(
        "system",
        "You answer questions about parcels and their routes. ".repeat(60),
    )
}

fn question(words: usize) -> ChatMessage<'static> {
    let q: Vec<String> = (0..words).map(|i| format!("word{}", i * 7 % 101)).collect();
    text("user", q.join(" "))
}

#[test]
fn a_new_turn_after_a_cached_prefix_waits_and_finishes_to_the_inline_identity() {
    let reg = registry(|_| {});
    // Cold: the system prompt is tokenized (and cached) now; its question is left for later.
    let first = reg.identify_for_routing(&chat(vec![system(), question(3)]), &ns(), None);
    first
        .deferred
        .expect("the question after the system prompt")
        .finish()
        .unwrap();

    let asked = chat(vec![system(), question(80)]);
    // What tokenizing inline gives, from a registry whose cache never saw this request.
    let inline = registry(|_| {}).identify(&asked, &ns());
    assert_eq!(inline.source(), "tokens");

    let routed = reg.identify_for_routing(&asked, &ns(), None);
    assert_eq!(routed.source(), "tokens-deferred");
    assert!(routed.exact && routed.truncated && !routed.deadline_cut);
    let n = routed.block_hashes.len();
    assert!(
        n > 0 && n < inline.block_hashes.len(),
        "{n} of {}",
        inline.block_hashes.len()
    );
    assert_eq!(
        routed.block_hashes[..],
        inline.block_hashes[..n],
        "a prefix of the whole"
    );
    // The new text is counted at the cached part's bytes per token.
    let (est, exact) = (routed.tokens as f64, inline.tokens as f64);
    assert!(
        (est - exact).abs() / exact < 0.25,
        "estimate {est} vs {exact}"
    );

    let rest = routed.deferred.expect("deferred");
    assert!(rest.untokenized_bytes() > 0);
    assert_eq!(rest.finish().unwrap(), inline.block_hashes);
    // Finishing filled the token cache: the same request is now identified whole, inline.
    let again = reg.identify_for_routing(&asked, &ns(), None);
    assert!(again.deferred.is_none());
    assert_eq!(again.block_hashes, inline.block_hashes);
    assert_eq!(again.tokens, inline.tokens);
}

#[test]
fn too_little_cached_the_setting_at_1_or_no_routing_tokenizes_inline() {
    let reg = registry(|_| {});
    reg.identify(&chat(vec![system(), question(3)]), &ns());
    // The new turn is longer than the system prompt: under half is tokenized before it. In
    // chunks (the default) the turn's own first chunks are tokenized until half the prompt is,
    // and the rest is deferred; as one segment (`chunk_bytes: 0`) it is tokenized inline.
    let long = chat(vec![system(), question(2000)]);
    assert_eq!(
        reg.identify_for_routing(&long, &ns(), None).source(),
        "tokens-deferred"
    );
    let unchunked = registry(|m| m.chunk_bytes = 0);
    unchunked.identify(&chat(vec![system(), question(3)]), &ns());
    assert_eq!(
        unchunked.identify_for_routing(&long, &ns(), None).source(),
        "tokens"
    );

    let off = registry(|m| m.defer_tokenizing_after = 1.0);
    off.identify(&chat(vec![system(), question(3)]), &ns());
    let short = chat(vec![system(), question(40)]);
    assert_eq!(
        off.identify_for_routing(&short, &ns(), None).source(),
        "tokens"
    );

    // `identify` (explain's and the tests' entry point) never defers.
    let reg = registry(|_| {});
    assert_eq!(reg.identify(&short, &ns()).source(), "tokens");
    let other = chat(vec![system(), question(41)]);
    assert_eq!(
        reg.identify_for_routing(&other, &ns(), None).source(),
        "tokens-deferred"
    );
}

#[test]
fn a_chat_with_media_is_never_deferred() {
    let reg = registry(|_| {});
    reg.identify(&chat(vec![system(), question(3)]), &ns());
    let mut with_image = question(40);
    with_image.content.push(ContentPart::Image(7));
    let id = reg.identify_for_routing(&chat(vec![system(), with_image]), &ns(), None);
    assert!(id.deferred.is_none());
    assert_eq!(id.source(), "tokens");
}
