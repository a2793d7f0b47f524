//! Registry-level tests: the fixture's SmolLM2 tokenizer (always present) and real tokenizers of
//! other model families, fetched by `make tokenizers` (a test that needs them fails, naming how
//! to get them, rather than passing without them).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;
use crate::config::ModelConfig;
use crate::request::{self, ApiKind, ChatMessage, ContentPart, ParsedRequest};

/// The shared fixture directory: `../shared/...` from the repository root, or from any ancestor
/// (a git worktree may sit deeper than the main checkout).
pub(crate) fn fixture_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    root.ancestors()
        .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
        .find(|p| p.join("tokenizer.json").is_file())
        .expect("shared/fixtures/vllm-0.32-cpu-smollm2 beside the repository")
}

/// `<dir>/<model>`, where `<dir>` is `$KVROUTER_TOKENIZERS_DIR` if set, else
/// `.cache/tokenizers` (where `make tokenizers` puts them). Panics, naming both, when the
/// model's `tokenizer.json` is not there: a test that needs it must not pass without it.
pub(crate) fn fetched(model: &str) -> PathBuf {
    let base = std::env::var_os("KVROUTER_TOKENIZERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/tokenizers"));
    let dir = base.join(model);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} is missing: run `make tokenizers`, or point KVROUTER_TOKENIZERS_DIR at a directory \
         holding {model}/tokenizer.json",
        dir.join("tokenizer.json").display()
    );
    dir
}

fn model_config(name: &str, dir: &Path) -> ModelConfig {
    ModelConfig {
        name: name.into(),
        tokenizer: Some(dir.display().to_string()),
        ..ModelConfig::default()
    }
}

fn registry_for(name: &str, dir: &Path, tweak: impl FnOnce(&mut ModelConfig)) -> TokenizerRegistry {
    let mut config = model_config(name, dir);
    tweak(&mut config);
    TokenizerRegistry::from_config(&[config], Path::new("/")).expect("tokenizer loads")
}

fn fixture_registry() -> TokenizerRegistry {
    registry_for("smollm2", &fixture_dir(), |_| {})
}

fn msg<'a>(role: &'a str, text: impl Into<Cow<'a, str>>) -> ChatMessage<'a> {
    ChatMessage {
        role: Cow::Borrowed(role),
        content: vec![ContentPart::Text(text.into())],
        extra: None,
    }
}

fn chat(body: &str) -> ParsedRequest<'_> {
    request::parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap()
}

#[test]
fn fixture_tokenizer_loads_with_template_and_verified_segments() {
    let reg = fixture_registry();
    let t = reg.tokenizer("smollm2").unwrap();
    assert!(t.has_chat_template());
    assert!(t.uses_segment_cache(), "SmolLM2 splits at <|im_start|>");
    assert_eq!(reg.block_size_tokens("smollm2"), 16);
    assert_eq!(reg.block_size_tokens("unknown"), 16);
}

#[test]
fn system_prompt_is_tokenized_once_and_cached_ids_equal_whole_text_ids() {
    let reg = fixture_registry();
    let t = reg.tokenizer("smollm2").unwrap();
    let system = "You route parcels. ".repeat(200);
    let first = [
        msg("system", system.as_str()),
        msg("user", "Where is order 1?"),
    ];
    let second = [
        msg("system", system.as_str()),
        msg("user", "Where is order 2?"),
    ];
    let a = t.tokenize_chat(&first).unwrap();
    let (segments, cached) = t.cache_stats();
    assert!(
        segments >= 3 && cached > 800,
        "{segments} segments, {cached} tokens"
    );
    let b = t.tokenize_chat(&second).unwrap();
    let (segments_after, _) = t.cache_stats();
    // Only the new user segment was added; the system segment was a hit.
    assert_eq!(segments_after, segments + 1);
    for (messages, ids) in [(&first, &a), (&second, &b)] {
        let whole = t.tokenize(&render(t, messages), false, false).unwrap();
        assert_eq!(ids.ids, whole.ids);
        assert_eq!(ids.total_tokens, whole.total_tokens);
    }
    assert!(a.ids.len() > 800 && !a.truncated);
}

fn render(_t: &ModelTokenizer, messages: &[ChatMessage<'_>]) -> String {
    template_of(&fixture_dir()).render(messages).unwrap()
}

#[test]
fn identify_chat_and_completions_exactly_and_namespaces_separate() {
    let reg = fixture_registry();
    let ns = Namespace::new("smollm2", None, None);
    let body = r#"{"model": "smollm2", "messages": [{"role": "user", "content": "hello there, how are you doing today? I hope well."}]}"#;
    let id = reg.identify(&chat(body), &ns);
    assert!(id.exact && id.fallback.is_none() && !id.truncated);
    assert_eq!(id.block_hashes.len() as u64, id.tokens / 16);
    let other = reg.identify(&chat(body), &Namespace::new("smollm2", None, Some("t")));
    assert_eq!(other.tokens, id.tokens);
    assert!(other
        .block_hashes
        .iter()
        .all(|h| !id.block_hashes.contains(h)));

    let completion = request::parse(
        ApiKind::Completions,
        br#"{"model": "smollm2", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}"#,
    )
    .unwrap();
    let id = reg.identify(&completion, &ns);
    assert_eq!((id.tokens, id.block_hashes.len(), id.exact), (17, 1, true));
    assert_eq!(
        id.block_hashes[0],
        reg.hasher(&ns)
            .hash_tokens(&(1..=16).collect::<Vec<_>>(), 9)[0]
    );
}

#[test]
fn byte_estimate_fallbacks_say_why() {
    let reg = fixture_registry();
    let body = r#"{"model": "m", "messages": [{"role": "user", "content": "0123456789012345678901234567890123456789012345678901234567890123456789"}]}"#;
    let cases: &[(&str, Fallback)] = &[("no-such-model", Fallback::NoTokenizer)];
    for (model, why) in cases {
        let id = reg.identify(&chat(body), &Namespace::new(model, None, None));
        assert!(!id.exact);
        assert_eq!(id.fallback, Some(*why));
        assert_eq!(id.tokens, estimate_tokens(4 + 70));
        assert_eq!(id.block_hashes.len(), 1, "74 bytes: one 64-byte chunk");
    }
    // A model with a tokenizer but no chat template: completions exact, chat estimated.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let reg = registry_for("bare", dir.path(), |_| {});
    let id = reg.identify(&chat(body), &Namespace::new("bare", None, None));
    assert_eq!(id.fallback, Some(Fallback::NoChatTemplate));
    let completion = request::parse(
        ApiKind::Completions,
        br#"{"model": "bare", "prompt": "hello world"}"#,
    )
    .unwrap();
    let id = reg.identify(&completion, &Namespace::new("bare", None, None));
    assert!(id.exact);
    assert_eq!(id.tokens, 2);
}

#[test]
fn template_errors_fall_back_instead_of_failing() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'] }}",
    )
    .unwrap();
    let reg = registry_for("strict", dir.path(), |_| {});
    let ns = Namespace::new("strict", None, None);
    let ok = reg.identify(
        &chat(r#"{"model": "strict", "messages": [{"role": "user", "content": "hi"}]}"#),
        &ns,
    );
    assert!(ok.exact);
    let bad = reg.identify(
        &chat(r#"{"model": "strict", "messages": [{"role": "system", "content": "hi"}]}"#),
        &ns,
    );
    assert_eq!(bad.fallback, Some(Fallback::TemplateError));
    let t = reg.tokenizer("strict").unwrap();
    let err = t
        .tokenize_chat(&[msg("system", "secret prompt text")])
        .unwrap_err();
    assert!(err.to_string().contains("first must be user"), "{err}");
    assert!(!err.to_string().contains("secret prompt text"), "{err}");
}

#[test]
fn load_errors_name_the_config_field() {
    let missing = ModelConfig {
        name: "m".into(),
        tokenizer: Some("/nonexistent/tokenizer.json".into()),
        ..ModelConfig::default()
    };
    let ok = ModelConfig {
        name: "ok".into(),
        ..ModelConfig::default()
    };
    let err = TokenizerRegistry::from_config(&[ok, missing], Path::new("/")).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("models[1].tokenizer: cannot load /nonexistent"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
    let err = TokenizerRegistry::from_config(&[model_config("m", dir.path())], Path::new("/"))
        .unwrap_err();
    assert!(err.to_string().contains("not a tokenizer.json"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let err = TokenizerRegistry::from_config(&[model_config("m", empty.path())], Path::new("/"))
        .unwrap_err();
    assert!(err.to_string().contains("no tokenizer.json"), "{err}");
}

#[test]
fn rebuild_reuses_unchanged_models() {
    let reg = fixture_registry();
    let t = reg.tokenizer("smollm2").unwrap();
    t.tokenize_chat(&[msg("user", "warm the cache")]).unwrap();
    let config = model_config("smollm2", &fixture_dir());
    let same = reg
        .rebuild(std::slice::from_ref(&config), Path::new("/"))
        .unwrap();
    assert!(
        std::ptr::eq(same.tokenizer("smollm2").unwrap(), t),
        "same loaded tokenizer"
    );
    let changed = ModelConfig {
        block_size_tokens: 32,
        ..config
    };
    let other = reg.rebuild(&[changed], Path::new("/")).unwrap();
    assert!(!std::ptr::eq(other.tokenizer("smollm2").unwrap(), t));
    assert_eq!(other.block_size_tokens("smollm2"), 32);
}

#[test]
fn long_prompts_are_capped_and_the_rest_estimated() {
    let reg = registry_for("smollm2", &fixture_dir(), |c| c.max_prefix_tokens = 256);
    let t = reg.tokenizer("smollm2").unwrap();
    let long = "The parcel left the depot at dawn and reached the harbor by noon. ".repeat(400);
    let full = registry_for("smollm2", &fixture_dir(), |c| c.max_prefix_tokens = 1 << 20);
    let exact = full
        .tokenizer("smollm2")
        .unwrap()
        .tokenize_text(&long)
        .unwrap();
    let capped = t.tokenize_text(&long).unwrap();
    assert!(capped.truncated && !exact.truncated);
    assert!(capped.ids.len() <= 256 && capped.ids.len() >= 256 - CUT_MARGIN_TOKENS_FOR_TEST);
    assert_eq!(
        capped.ids[..],
        exact.ids[..capped.ids.len()],
        "kept ids are exact"
    );
    let error = capped.total_tokens.abs_diff(exact.total_tokens) as f64 / exact.total_tokens as f64;
    assert!(
        error < 0.05,
        "estimate {} vs {}",
        capped.total_tokens,
        exact.total_tokens
    );
    // Chat through the segment path: same bound.
    let chat_ids = t
        .tokenize_chat(&[msg("system", long.as_str()), msg("user", "hi")])
        .unwrap();
    assert!(chat_ids.truncated && chat_ids.ids.len() <= 256);
    let ns = Namespace::new("smollm2", None, None);
    let body = format!(r#"{{"model": "smollm2", "prompt": "{long}"}}"#);
    let parsed = request::parse(ApiKind::Completions, body.as_bytes()).unwrap();
    let id = reg.identify(&parsed, &ns);
    assert!(id.truncated && id.block_hashes.len() <= 256 / 16);
}

const CUT_MARGIN_TOKENS_FOR_TEST: usize = tokenizer::CUT_MARGIN_TOKENS;

#[test]
fn media_changes_blocks_from_its_message_on() {
    let reg = fixture_registry();
    let ns = Namespace::new("smollm2", None, None);
    let system = "Describe images carefully. ".repeat(30);
    let body = |url: &str| {
        format!(
            r#"{{"model": "smollm2", "messages": [{{"role": "system", "content": "{system}"}}, {{"role": "user", "content": [{{"type": "text", "text": "what is this?"}}, {{"type": "image_url", "image_url": {{"url": "{url}"}}}}]}}, {{"role": "assistant", "content": "{system}"}}]}}"#
        )
    };
    let (b1, b2) = (body("https://x/1.png"), body("https://x/2.png"));
    let (a, b) = (reg.identify(&chat(&b1), &ns), reg.identify(&chat(&b2), &ns));
    assert_eq!(a.tokens, b.tokens);
    let shared = a
        .block_hashes
        .iter()
        .zip(&b.block_hashes)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(shared >= 5, "system prompt blocks shared ({shared})");
    assert!(
        shared < a.block_hashes.len(),
        "blocks from the image on differ"
    );
}

/// The segment-cached path gives exactly the whole-text ids for `messages`. Returns false,
/// having checked nothing, when the template refuses the conversation (random ones may break
/// its rules, e.g. alternating roles): callers decide whether that may happen.
#[must_use]
fn check_segments_equal_whole(
    t: &ModelTokenizer,
    messages: &[ChatMessage<'_>],
    template_src: &template::ChatTemplate,
) -> bool {
    let Ok(text) = template_src.render(messages) else {
        return false;
    };
    let whole = t.tokenize(&text, false, false).unwrap();
    let segmented = t.tokenize(&text, false, true).unwrap();
    assert_eq!(whole, segmented);
    true
}

fn template_of(dir: &Path) -> template::ChatTemplate {
    let cfg = template::TokenizerConfigFile::read(&dir.join("tokenizer_config.json"), "t").unwrap();
    let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(s) => s,
        Err(_) => cfg.chat_template.clone().unwrap(),
    };
    template::ChatTemplate::new(source, &cfg, template::RenderLimits::default()).unwrap()
}

fn arb_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just(" ".to_string()),
            Just("\n".to_string()),
            Just("  ".to_string()),
            Just("<|im_start|>".to_string()),
            Just("<|im_end|>".to_string()),
            "[a-zA-Z]{1,8}",
            "[0-9]{1,5}",
            "[.,;!?'\"()]",
            "[éü東京😀]",
        ],
        0..30,
    )
    .prop_map(|v| v.concat())
}

fn arb_conversation() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec(
        (
            prop_oneof![Just("system"), Just("user"), Just("assistant")].prop_map(str::to_string),
            arb_text(),
        ),
        1..5,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn fixture_segments_equal_whole_text(conv in arb_conversation()) {
        let reg = fixture_registry_cached();
        let t = reg.tokenizer("smollm2").unwrap();
        let messages: Vec<_> = conv.iter().map(|(r, c)| msg(r, c.as_str())).collect();
        // A conversation the template refuses is not a case (not a pass).
        prop_assume!(check_segments_equal_whole(t, &messages, &template_of(&fixture_dir())));
    }
}

fn fixture_registry_cached() -> &'static TokenizerRegistry {
    static REG: std::sync::OnceLock<TokenizerRegistry> = std::sync::OnceLock::new();
    REG.get_or_init(fixture_registry)
}

/// Real tokenizers of other families (`make tokenizers`; fails without them): their templates
/// render and tokenize to exactly the ids HF's Python stack gives (`tests/data/
/// hf-reference-ids.json`, from `scripts/hf-reference-ids.py`), and the segment-cached path
/// equals whole-text tokenizing.
#[test]
fn real_tokenizers_match_hf_reference_ids() {
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/data/hf-reference-ids.json")).unwrap();
    let conversations: Vec<Vec<(String, String)>> =
        serde_json::from_value(reference["conversations"].clone()).unwrap();
    assert!(!conversations.is_empty());
    for model in ["qwen3", "llama3", "deepseek_v3", "gemma3"] {
        let dir = fetched(model);
        let reg = registry_for(model, &dir, |_| {});
        let t = reg.tokenizer(model).unwrap();
        assert!(t.has_chat_template(), "{model}");
        let expected: Vec<Vec<u32>> =
            serde_json::from_value(reference["ids"][model].clone()).unwrap();
        let template = template_of(&dir);
        assert_eq!(
            expected.len(),
            conversations.len(),
            "{model}: reference ids"
        );
        for (conv, want) in conversations.iter().zip(&expected) {
            let messages: Vec<_> = conv.iter().map(|(r, c)| msg(r, c.as_str())).collect();
            let ids = t
                .tokenize_chat(&messages)
                .unwrap_or_else(|e| panic!("{model}: {e}"));
            assert_eq!(&ids.ids, want, "{model}: {conv:?}");
            assert!(
                check_segments_equal_whole(t, &messages, &template),
                "{model}: the template renders the reference conversation"
            );
        }
        eprintln!(
            "{model}: segment cache {}",
            if t.uses_segment_cache() { "on" } else { "off" }
        );
    }
}

/// Chat requests with tools, tool calls and results, documents, template kwargs, a developer
/// message, reasoning and no generation prompt render to exactly the text Hugging Face's
/// `apply_chat_template` gives after vLLM 0.32's message preparation
/// (`tests/data/hf-reference-tools.json`, from `scripts/hf-reference-tools.py`): the request
/// parsed as routing parses it, rendered with its options.
#[test]
fn real_templates_render_tools_like_hf() {
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/data/hf-reference-tools.json")).unwrap();
    let requests = reference["requests"].as_array().unwrap();
    assert!(requests.len() >= 12, "reference requests");
    // The probe prints every variable and message field (with Qwen3's special tokens), so
    // what the real templates leave out is compared too.
    let probe = |dir: &Path| {
        let cfg = template::TokenizerConfigFile::read(&dir.join("tokenizer_config.json"), "t");
        let source = reference["probe_template"].as_str().unwrap().to_string();
        template::ChatTemplate::new(source, &cfg.unwrap(), template::RenderLimits::default())
            .unwrap()
    };
    for model in ["qwen3", "llama3", "deepseek_v3", "probe"] {
        let template = match model {
            "probe" => probe(&fetched("qwen3")),
            _ => template_of(&fetched(model)),
        };
        let rendered = reference["rendered"][model].as_array().unwrap();
        assert_eq!(rendered.len(), requests.len(), "{model}");
        for (request, want) in requests.iter().zip(rendered) {
            let mut body = request.clone();
            body["model"] = "m".into();
            let body = serde_json::to_vec(&body).unwrap();
            let parsed = crate::request::parse(crate::request::ApiKind::ChatCompletions, &body)
                .unwrap_or_else(|e| panic!("{model}: {e}"));
            let request::Prompt::Chat(messages) = &parsed.prompt else {
                panic!("not chat")
            };
            let got = template.render_request(messages, &parsed.chat);
            match want.as_str() {
                Some(want) => assert_eq!(
                    got.as_deref().map_err(|e| e.to_string()),
                    Ok(want),
                    "{model}: {request}"
                ),
                None => assert!(got.is_err(), "{model}: HF refused {request}"),
            }
        }
    }
}
