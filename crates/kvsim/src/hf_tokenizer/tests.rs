//! The tokenizer's mechanics on the vLLM capture's SmolLM2 files (the comparison with vLLM's
//! own token ids is `tests/vllm_capture.rs`).

use std::io::Write as _;

use serde_json::json;

use super::*;
use crate::capture;
use crate::request::{parse, ApiKind, SimRequest};

/// The capture's tokenizer, loaded once for all tests (a debug build takes a second per load).
fn smollm2() -> &'static HfTokenizer {
    static TOKENIZER: std::sync::OnceLock<HfTokenizer> = std::sync::OnceLock::new();
    TOKENIZER.get_or_init(|| {
        HfTokenizer::load(&TokenizerPaths::from_path(&capture::dir())).expect("fixture loads")
    })
}

fn chat(body: serde_json::Value) -> SimRequest {
    parse(ApiKind::ChatCompletions, body.to_string().as_bytes()).unwrap()
}

fn completion(body: serde_json::Value) -> SimRequest {
    parse(ApiKind::Completions, body.to_string().as_bytes()).unwrap()
}

/// SmolLM2's `<|im_start|>`, its BOS token.
const IM_START: u32 = 1;

#[test]
fn chat_renders_the_template_and_adds_no_special_tokens() {
    let t = smollm2();
    let req = chat(json!({"messages": [{"role": "user", "content": "Hi"}]}));
    let ids = t.request_tokens(&req).unwrap().ids;
    // The template adds SmolLM2's default system prompt, then the turn and the generation
    // prompt; BOS is the template's `<|im_start|>`, written once.
    let expected = t
        .encode(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    assert_eq!(ids, expected);
    assert_eq!(ids.iter().filter(|&&id| id == IM_START).count(), 3);
    // add_special_tokens asks the tokenizer for its own on top (none for this tokenizer).
    let mut req = req;
    req.render.add_special_tokens = true;
    assert_eq!(t.request_tokens(&req).unwrap().ids, expected);
    req.render.add_generation_prompt = false;
    let without = t.request_tokens(&req).unwrap().ids;
    let header = t.encode("<|im_start|>assistant\n", false).unwrap();
    assert!(expected.ends_with(&header));
    assert_eq!(without[..], expected[..expected.len() - header.len()]);
}

#[test]
fn completions_add_bos_as_the_config_says() {
    let dir = capture::dir();
    let mut config = tempfile::NamedTempFile::new().unwrap();
    write!(
        config,
        r#"{{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true}}"#
    )
    .unwrap();
    let with_bos = HfTokenizer::load(&TokenizerPaths {
        tokenizer_json: dir.join("tokenizer.json"),
        tokenizer_config: Some(config.path().to_path_buf()),
        chat_template: Some(dir.join("chat_template.jinja")),
    })
    .unwrap();
    let plain = smollm2();
    let req = completion(json!({"prompt": "Hello world"}));
    let text_ids = plain.request_tokens(&req).unwrap().ids;
    assert_ne!(text_ids[0], IM_START, "the fixture's tokenizer adds no BOS");
    assert_eq!(
        with_bos.request_tokens(&req).unwrap().ids,
        [&[IM_START][..], &text_ids].concat(),
        "add_bos_token rebuilds the post-processor (transformers v5)"
    );
    let mut no_special = req.clone();
    no_special.render.add_special_tokens = false;
    assert_eq!(with_bos.request_tokens(&no_special).unwrap().ids, text_ids);
    // Chat never gets a second BOS by default.
    let c = chat(json!({"messages": [{"role": "system", "content": "S"}]}));
    assert_eq!(
        with_bos.request_tokens(&c).unwrap().ids,
        plain.request_tokens(&c).unwrap().ids
    );
}

#[test]
fn token_prompts_are_checked_against_the_vocabulary() {
    let t = smollm2();
    let ok = completion(json!({"prompt": [1, 2, 49_151]}));
    assert_eq!(t.request_tokens(&ok).unwrap().ids, vec![1, 2, 49_151]);
    let bad = completion(json!({"prompt": [1, 60_000]}));
    let err = t.request_tokens(&bad).unwrap_err().to_string();
    assert!(err.contains("60000") && err.contains("vocabulary"), "{err}");
}

#[test]
fn media_become_placeholder_runs_before_the_text() {
    let t = smollm2();
    let with_image = |url: &str| {
        chat(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]}))
    };
    let cat = t.request_tokens(&with_image("http://x/cat.png")).unwrap();
    assert_eq!(cat.mm.len(), 1);
    let span = cat.mm[0];
    assert_eq!(span.len, MM_PLACEHOLDER_TOKENS);
    // vLLM's string content: the placeholder, a newline, then the text.
    let head = t
        .encode(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n",
            false,
        )
        .unwrap();
    let tail = t
        .encode("\nWhat is this?<|im_end|>\n<|im_start|>assistant\n", false)
        .unwrap();
    assert_eq!(span.offset as usize, head.len());
    assert_eq!(cat.ids[..head.len()], head[..]);
    assert_eq!(
        cat.ids[head.len() + MM_PLACEHOLDER_TOKENS as usize..],
        tail[..]
    );
    // Another image: the same tokens, another key; the same image again: the same key.
    let dog = t.request_tokens(&with_image("http://x/dog.png")).unwrap();
    assert_eq!(dog.ids, cat.ids);
    assert_ne!(dog.mm[0].hash, span.hash);
    assert_eq!(
        t.request_tokens(&with_image("http://x/cat.png")).unwrap(),
        cat
    );
}

#[test]
fn a_chat_needs_a_template() {
    let t = HfTokenizer::load(&TokenizerPaths {
        tokenizer_json: capture::dir().join("tokenizer.json"),
        tokenizer_config: None,
        chat_template: None,
    })
    .unwrap();
    assert!(t.chat_template().is_none());
    let err = t
        .request_tokens(&chat(
            json!({"messages": [{"role": "user", "content": "x"}]}),
        ))
        .unwrap_err();
    assert!(err.to_string().contains("no chat template"), "{err}");
}

#[test]
fn load_errors_name_the_file() {
    let missing = HfTokenizer::load(&TokenizerPaths::from_path(std::path::Path::new(
        "/nonexistent/tokenizer.json",
    )))
    .unwrap_err();
    assert!(
        missing.to_string().contains("/nonexistent/tokenizer.json"),
        "{missing}"
    );
    let mut bad = tempfile::NamedTempFile::new().unwrap();
    write!(bad, "{{\"not\": \"a tokenizer\"}}").unwrap();
    let err = HfTokenizer::load(&TokenizerPaths::from_path(bad.path())).unwrap_err();
    assert!(err.to_string().contains("not a tokenizer.json"), "{err}");
}

#[test]
fn filler_words_have_distinct_ids() {
    let t = smollm2();
    let mut ids: Vec<u32> = (0..8).map(|i| t.output_token(i)).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 8);
}

#[test]
fn the_segment_cache_gives_the_ids_of_the_whole_text() {
    let t = smollm2();
    assert!(
        t.segment_cache().is_some(),
        "SmolLM2's pieces tokenize like the whole"
    );
    let system = "You are a careful assistant for a logistics company. ".repeat(40);
    let req = chat(json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Where is order 1?"},
    ]}));
    let template = t.chat_template().unwrap();
    let rendered = template.render(
        match &req.prompt {
            crate::request::Prompt::Chat(m) => m,
            _ => unreachable!(),
        },
        &req.render,
        |k| k.to_string(),
    );
    let whole: Vec<u32> = t
        .tokenizer
        .encode_fast(rendered.unwrap().text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let first = t.request_tokens(&req).unwrap().ids;
    let (pieces, tokens) = t.segment_cache().unwrap();
    assert!(pieces >= 1 && tokens > 300, "the system prompt was cached");
    assert_eq!(first, whole);
    assert_eq!(t.request_tokens(&req).unwrap().ids, whole, "from the cache");
}

proptest::proptest! {
    /// Any mix of added tokens, whitespace, digits and non-ASCII text encodes piece by piece
    /// exactly as whole (pieces long enough to be cached included).
    #[test]
    fn pieces_encode_like_the_whole(parts in proptest::collection::vec(
        proptest::sample::select(vec![
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "  ", "\n", "\n\n", "\t",
            "user", "Hello", " world", "42", "7.5", "é", "東京", "😀", ",", "!?",
        ]),
        0..60,
    ), long in 0usize..3) {
        let t = smollm2();
        let mut text: String = parts.concat();
        // Long pieces take the cached path.
        text.push_str(&" filler text".repeat(long * 60));
        text.push_str("<|im_end|>");
        let whole = t.tokenizer.encode_fast(text.as_str(), false).unwrap().get_ids().to_vec();
        proptest::prop_assert_eq!(t.encode(&text, false).unwrap(), whole.clone());
        proptest::prop_assert_eq!(t.encode(&text, false).unwrap(), whole);
    }
}
