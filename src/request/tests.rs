use super::*;
use proptest::prelude::*;

fn chat(body: &str) -> Result<ParsedRequest<'_>, RequestError> {
    parse(ApiKind::ChatCompletions, body.as_bytes())
}

#[test]
fn paths_are_classified() {
    let cases = [
        ("/v1/completions", ApiKind::Completions),
        ("/v1/chat/completions", ApiKind::ChatCompletions),
        ("/v1/chat/completions?x=1", ApiKind::ChatCompletions),
        ("/v1/embeddings/", ApiKind::Embeddings),
        ("/v1/models", ApiKind::Other),
        ("/health", ApiKind::Other),
        ("", ApiKind::Other),
    ];
    for (path, kind) in cases {
        assert_eq!(ApiKind::from_path(path), kind, "{path}");
    }
}

#[test]
fn chat_with_string_and_part_content() {
    let body = r#"{"model":"m","stream":true,"max_completion_tokens":7,"max_tokens":9,
        "tools":[{"type":"function","function":{"name":"f"}}],
        "messages":[{"role":"system","content":"be brief"},
                    {"role":"user","content":[{"type":"text","text":"hi"},
                        {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]},
                    {"role":"assistant","content":null,"tool_calls":[]}]}"#;
    let req = chat(body).unwrap();
    assert_eq!(req.model, "m");
    assert!(req.stream);
    assert_eq!(req.max_tokens, Some(7), "max_completion_tokens wins");
    let Prompt::Chat(messages) = &req.prompt else {
        panic!("not chat")
    };
    assert_eq!(messages.len(), 3);
    assert_eq!(
        messages[0].content,
        vec![ContentPart::Text("be brief".into())]
    );
    assert_eq!(messages[1].content.len(), 2);
    assert!(matches!(messages[1].content[1], ContentPart::Image(_)));
    assert!(messages[2].content.is_empty());
    // Borrowed from the body: no copy of the prompt text.
    assert!(matches!(
        &messages[0].content[0],
        ContentPart::Text(Cow::Borrowed(_))
    ));
    assert_eq!(
        req.prompt.text_bytes(),
        "system".len() + 8 + "user".len() + 2 + "assistant".len()
    );
}

#[test]
fn different_images_hash_differently() {
    let a = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}"#).unwrap();
    let b = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":"b"}]}]}"#).unwrap();
    assert_ne!(a.prompt, b.prompt);
}

#[test]
fn completion_prompt_shapes() {
    let cases: &[(&str, PromptInput<'_>)] = &[
        (r#""hello""#, PromptInput::Text("hello".into())),
        (
            r#"["a","b"]"#,
            PromptInput::Texts(vec!["a".into(), "b".into()]),
        ),
        ("[1,2,3]", PromptInput::Tokens(vec![1, 2, 3])),
        (
            "[[1],[2,3]]",
            PromptInput::TokenLists(vec![vec![1], vec![2, 3]]),
        ),
        (r#""esc\"aped""#, PromptInput::Text("esc\"aped".into())),
    ];
    for (prompt, expected) in cases {
        let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
        let req = parse(ApiKind::Completions, body.as_bytes()).unwrap();
        assert_eq!(req.prompt, Prompt::Input(expected.clone()), "{prompt}");
    }
    let req = parse(ApiKind::Embeddings, br#"{"model":"e","input":"x"}"#).unwrap();
    assert_eq!(req.prompt, Prompt::Input(PromptInput::Text("x".into())));
}

#[test]
fn bad_bodies_name_the_problem() {
    use ApiKind::*;
    let cases: &[(ApiKind, &str, &str)] = &[
        (ChatCompletions, "{", "request body is not valid JSON"),
        (ChatCompletions, "{} x", "request body is not valid JSON"),
        (ChatCompletions, "[1]", "request body must be a JSON object"),
        (
            ChatCompletions,
            "\"s\"",
            "request body must be a JSON object",
        ),
        (
            ChatCompletions,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            "missing required field `model`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m"}"#,
            "missing required field `messages`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[]}"#,
            "invalid field `messages`: must contain at least one message",
        ),
        (
            ChatCompletions,
            r#"{"model":3,"messages":[]}"#,
            "invalid field `model`: invalid type: integer `3`, expected a string",
        ),
        (
            ChatCompletions,
            r#"{"model":" ","messages":[{"role":"user"}]}"#,
            "invalid field `model`: must not be empty",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","stream":"yes","messages":[]}"#,
            "invalid field `stream`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","max_tokens":-1,"messages":[]}"#,
            "invalid field `max_tokens`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
            "invalid field `messages[0]`: missing field `role`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            "invalid field `messages[0].content`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
            "missing `text`",
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"hologram"}]}]}"#,
            "unsupported content part type \"hologram\"",
        ),
        (
            Completions,
            r#"{"model":"m"}"#,
            "missing required field `prompt`",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":[]}"#,
            "invalid field `prompt`: must not be an empty array",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":["a",1]}"#,
            "invalid field `prompt`: array elements must all be",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":[-1]}"#,
            "token id -1 is out of range",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":[5000000000]}"#,
            "token id 5000000000 is out of range",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":{}}"#,
            "invalid field `prompt`: invalid type: map",
        ),
        (
            Embeddings,
            r#"{"model":"m"}"#,
            "missing required field `input`",
        ),
    ];
    for (api, body, expected) in cases {
        let err = parse(*api, body.as_bytes()).unwrap_err().to_string();
        assert!(
            err.contains(expected),
            "{body}\n  got: {err}\n  wanted: {expected}"
        );
    }
}

#[test]
fn error_param_names_the_field() {
    let err = chat(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#).unwrap_err();
    assert_eq!(err.param(), Some("messages[0].content"));
    assert_eq!(
        chat(r#"{"model":"m"}"#).unwrap_err().param(),
        Some("messages")
    );
    assert_eq!(chat("{").unwrap_err().param(), None);
}

#[test]
fn other_paths_route_by_model_when_present() {
    let req = parse(ApiKind::Other, br#"{"model":"m","anything":1}"#).unwrap();
    assert_eq!(req.model, "m");
    assert_eq!(req.prompt, Prompt::None);
    let req = parse(ApiKind::Other, b"not json").unwrap();
    assert_eq!(req.model, "");
    let req = parse(ApiKind::Other, b"").unwrap();
    assert_eq!(req.model, "");
}

#[test]
fn cache_salt_is_read() {
    let req =
        chat(r#"{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"x"}]}"#)
            .unwrap();
    assert_eq!(req.cache_salt.as_deref(), Some("tenant-a"));
}

const VALID: &str = r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"q\u00e9"},{"type":"image_url","image_url":{"url":"u"}}]}],"max_tokens":5}"#;

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    /// Random bytes never panic, for every API.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for api in [ApiKind::Completions, ApiKind::ChatCompletions, ApiKind::Embeddings, ApiKind::Other] {
            let _ = parse(api, &bytes);
        }
    }

    /// Every truncation of a valid body is either an error or (for a prefix that happens to be
    /// complete) a success; never a panic.
    #[test]
    fn truncated_bodies_never_panic(cut in 0usize..VALID.len()) {
        let r = parse(ApiKind::ChatCompletions, &VALID.as_bytes()[..cut]);
        prop_assert!(r.is_err());
    }

    /// Single-byte corruption of a valid body never panics.
    #[test]
    fn corrupted_bodies_never_panic(at in 0usize..VALID.len(), byte in any::<u8>()) {
        let mut body = VALID.as_bytes().to_vec();
        body[at] = byte;
        let _ = parse(ApiKind::ChatCompletions, &body);
    }
}

#[test]
fn valid_sample_parses() {
    assert!(chat(VALID).is_ok());
}
