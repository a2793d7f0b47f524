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
fn text_parts_of_every_kind_vllm_reads_are_text_and_empty_ones_are_skipped() {
    // vLLM's TEXT_PART_TYPES; a part without its text is skipped there, not refused.
    let body = r#"{"model":"m","messages":[{"role":"assistant","content":[
        {"type":"output_text","text":"a"},{"type":"refusal","refusal":"b"},
        {"type":"thinking","thinking":"c"},{"type":"input_text","text":"d"},
        {"type":"text"},{"type":"refusal","refusal":null},{"type":"thinking"}]}]}"#;
    let req = chat(body).unwrap();
    let Prompt::Chat(messages) = &req.prompt else {
        panic!("not chat")
    };
    let texts: Vec<&str> = messages[0]
        .content
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => t.as_ref(),
            other => panic!("not text: {other:?}"),
        })
        .collect();
    assert_eq!(texts, ["a", "b", "c", "d"]);
}

#[test]
fn chat_template_options_and_message_fields_are_kept_as_sent() {
    let body = r#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}],
        "documents":null,"chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":false,
        "reasoning_effort":"low",
        "messages":[{"role":"user","content":"hi","name":"ann"},
                    {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}],"reasoning":"r"},
                    {"role":"tool","content":"ok","tool_call_id":"1"},
                    {"role":"assistant","content":"plain","tool_calls":null},
                    {"role":"assistant","content":"a","reasoning_content":"old"},
                    {"role":"assistant","content":"a","reasoning":"new","reasoning_content":"old"}]}"#;
    let req = chat(body).unwrap();
    let tools = req.chat.tools.as_ref().expect("tools");
    // Key order as sent (templates print tools with tojson).
    let params: Vec<&String> = tools[0]["function"]["parameters"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(params, ["z", "a"]);
    assert_eq!(req.chat.documents, None, "null is absent");
    assert_eq!(
        req.chat.template_kwargs.as_ref().unwrap()["enable_thinking"],
        false
    );
    assert_eq!(req.chat.add_generation_prompt, Some(false));
    assert_eq!(req.chat.reasoning_effort.as_deref(), Some("low"));
    let Prompt::Chat(messages) = &req.prompt else {
        panic!("not chat")
    };
    assert_eq!(messages.len(), 6);
    assert_eq!(
        messages[0].extra.as_ref().unwrap().name.as_deref(),
        Some("ann")
    );
    let call = messages[1].extra.as_ref().unwrap();
    assert!(call.tool_calls.as_ref().unwrap().is_array());
    assert_eq!(call.reasoning.as_deref(), Some("r"));
    assert_eq!(
        messages[2].extra.as_ref().unwrap().tool_call_id.as_deref(),
        Some("1")
    );
    assert!(messages[3].extra.is_none(), "null tool_calls is no field");
    // The deprecated name, as vLLM renames it; `reasoning` wins when both are there.
    let reasoning = |i: usize| messages[i].extra.as_ref().unwrap().reasoning.as_deref();
    assert_eq!(reasoning(4), Some("old"));
    assert_eq!(reasoning(5), Some("new"));
    // Taken leniently: another shape is left out, a repeated key keeps its last value, and
    // booleans are read as pydantic reads them.
    let lenient = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"tools":"no","documents":{},
            "chat_template_kwargs":[1],"reasoning_effort":5,"add_generation_prompt":"off",
            "add_generation_prompt":"no"}"#,
    )
    .unwrap();
    assert_eq!(
        lenient.chat,
        ChatOptions {
            add_generation_prompt: Some(false),
            ..ChatOptions::default()
        }
    );
    let again = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"tools":[1],"tools":[2],"add_generation_prompt":0}"#,
    )
    .unwrap();
    assert_eq!(again.chat.tools, Some(serde_json::json!([2])));
    assert_eq!(again.chat.add_generation_prompt, Some(false));
    // Completions ignore chat-only fields.
    let completion = parse(
        ApiKind::Completions,
        br#"{"model":"m","prompt":"p","tools":"not an array"}"#,
    )
    .unwrap();
    assert_eq!(completion.chat, ChatOptions::default());
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
            "invalid field `model`: expected a string, got a number",
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
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"hologram"}]}]}"#,
            "invalid field `messages[0].content[0]`: unsupported content part type (expected text",
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
            "invalid field `prompt[0]`: expected a token id (an integer in 0..=4294967295), got a negative number",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":[5000000000]}"#,
            "got an out-of-range number",
        ),
        (
            Completions,
            r#"{"model":"m","prompt":{}}"#,
            "invalid field `prompt`: expected a string, an array of strings, an array of token ids, or an array of arrays of token ids, got an object",
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

/// A marker standing for prompt text; lowercase too, so a key made of it would pass as a field
/// name if the path kept client keys.
const MARKER: &str = "zq_secret_marker";

/// Every error a body can produce names fields and types, never the body's text: bodies of every
/// malformed shape carry the marker, and neither the message nor the param may contain it.
#[test]
fn errors_never_carry_input_text() {
    use ApiKind::*;
    let m = MARKER;
    let mut cases: Vec<(ApiKind, Vec<u8>)> = [
        (ChatCompletions, format!(r#"{{"model":"x","messages":"{m}"}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","stream":"{m}","messages":[]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_tokens":"{m}","messages":[]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_completion_tokens":["{m}"]}}"#)),
        (ChatCompletions, format!(r#"{{"model":{{"{m}":"{m}"}},"messages":[]}}"#)),
        (ChatCompletions, format!(r#"{{"model":["{m}"]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","cache_salt":["{m}"],"messages":[]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":["{m}"]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"{m}","content":5}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":["{m}"]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"content":"{m}"}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":{{"{m}":"{m}"}}}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"{m}"}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":["{m}"]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"text","text":["{m}"]}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"input_audio","{m}":"{m}"}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":["{m}"]}}}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"{m}":"{m}"}}}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":5,"{m}":1}}]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":"{m}"}}],"{m}":[1,}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":"{m}"}}]}} {m}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":"{m}\q"}}]}}"#)),
        (ChatCompletions, format!("{{\"model\":\"x\",\"messages\":[{{\"role\":\"user\",\"content\":\"{m}\u{1}\"}}]}}")),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":"{m}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_tokens":1e999,"messages":[{{"role":"user","content":"{m}"}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_tokens":123456789012345678901234567890,"messages":["{m}"]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_tokens":-5,"messages":[{{"role":"user","content":"{m}"}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","max_tokens":2.5,"messages":[{{"role":"user","content":"{m}"}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"{m}","model":"{m}"}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","role":"{m}"}}]}}"#)),
        (ChatCompletions, format!(r#"{{"{m}":{}"{m}"{}}}"#, "[".repeat(200), "]".repeat(200))),
        (ChatCompletions, format!(r#""{m}""#)),
        (ChatCompletions, format!(r#"["{m}"]"#)),
        (ChatCompletions, m.to_string()),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{}]}}"#, vec![format!(r#"{{"role":"user","content":"{m}"}}"#); DEFAULT_MAX_MESSAGES + 1].join(","))),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"tool","tool_call_id":["{m}"]}}]}}"#)),
        (ChatCompletions, format!(r#"{{"model":"x","messages":[{{"role":"user","content":"a","name":{{"{m}":1}}}}]}}"#)),
        (Completions, format!(r#"{{"model":"x","prompt":{{"{m}":1}}}}"#)),
        (Completions, format!(r#"{{"model":"x","prompt":["a","{m}",3]}}"#)),
        (Completions, format!(r#"{{"model":"x","prompt":[1,"{m}"]}}"#)),
        (Completions, format!(r#"{{"model":"x","prompt":[[1],["{m}"]]}}"#)),
        (Completions, format!(r#"{{"model":"x","prompt":true,"{m}":"{m}"}}"#)),
        (Embeddings, format!(r#"{{"model":"x","input":[{{"{m}":"{m}"}}]}}"#)),
    ]
    .into_iter()
    .map(|(api, body)| (api, body.into_bytes()))
    .collect();
    // Invalid UTF-8 inside a string, and right after the marker.
    let mut bad_utf8 =
        format!(r#"{{"model":"x","messages":[{{"role":"user","content":"{m}"#).into_bytes();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, b'"', b'}', b']', b'}']);
    cases.push((ChatCompletions, bad_utf8));
    let mut bad_key = br#"{"model":"x",""#.to_vec();
    bad_key.extend_from_slice(m.as_bytes());
    bad_key.extend_from_slice(&[0xc3, b'"', b':', b'1', b'}']);
    cases.push((ChatCompletions, bad_key));

    for (api, body) in &cases {
        let err = parse(*api, body).expect_err("malformed");
        let shown = format!("{err} {:?}", err.param());
        assert!(
            !shown.contains(MARKER) && !shown.contains("secret"),
            "{}\n  leaked: {shown}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
    }
    assert_eq!(cases.len(), 45);
}

#[test]
fn limits_reject_oversized_conversations_with_413() {
    let body = |messages: usize, parts: usize| {
        let part = r#"{"type":"text","text":"a"}"#;
        let content = vec![part; parts].join(",");
        let message = format!(r#"{{"role":"user","content":[{content}]}}"#);
        format!(
            r#"{{"model":"m","messages":[{}]}}"#,
            vec![message; messages].join(",")
        )
    };
    let limits = RequestLimits {
        max_messages: 3,
        max_content_parts: 7,
    };
    let ok = |m, p| {
        parse_with(ApiKind::ChatCompletions, body(m, p).as_bytes(), limits)
            .map(drop)
            .map_err(|e| e.clone())
    };
    assert!(ok(3, 2).is_ok(), "at the limits");
    let err = ok(4, 1).unwrap_err();
    assert_eq!(
        err,
        RequestError::TooLarge {
            field: "messages",
            limit: 3
        }
    );
    assert_eq!((err.http_status(), err.param()), (413, Some("messages")));
    assert_eq!(
        err.to_string(),
        "request has more than 3 messages, the router's limit"
    );
    let err = ok(2, 4).unwrap_err();
    assert_eq!(
        err,
        RequestError::TooLarge {
            field: "content parts",
            limit: 7
        }
    );
    // A string content is one part.
    let strings =
        r#"{"model":"m","messages":[{"role":"a","content":"x"},{"role":"b","content":"y"}]}"#;
    let one_part = RequestLimits {
        max_messages: 9,
        max_content_parts: 1,
    };
    assert!(parse_with(ApiKind::ChatCompletions, strings.as_bytes(), one_part).is_err());
    // Limits bind chat messages only; other APIs do not parse `messages` at all.
    assert!(parse_with(
        ApiKind::Completions,
        body(9, 9)
            .replace("\"messages\"", "\"prompt\":\"p\",\"messages\"")
            .as_bytes(),
        limits
    )
    .is_ok());
    assert_eq!(chat("{\"model\":\"m\"}").unwrap_err().http_status(), 400);
}

#[test]
fn batch_prompts_count_their_elements_as_content_parts() {
    // `"",` or `[],` is 3 bytes of body and ~24 held: a 32 MiB batch would take ~10x the body.
    let limits = RequestLimits {
        max_messages: 10,
        max_content_parts: 1000,
    };
    for (api, field, element) in [
        (ApiKind::Completions, "prompt", "[]"),
        (ApiKind::Completions, "prompt", "\"\""),
        (ApiKind::Embeddings, "input", "[1]"),
        (ApiKind::Embeddings, "input", "\"x\""),
    ] {
        let batch = |n: usize| {
            let elements = vec![element; n].join(",");
            format!(r#"{{"model":"m","{field}":[{elements}]}}"#)
        };
        assert!(
            parse_with(api, batch(1000).as_bytes(), limits).is_ok(),
            "{field} {element}: at the limit"
        );
        assert_eq!(
            parse_with(api, batch(1001).as_bytes(), limits).unwrap_err(),
            RequestError::TooLarge {
                field: "content parts",
                limit: 1000
            },
            "{field} {element}"
        );
    }
    // Token ids of one prompt are not elements of a batch: 4 bytes held for 2 or more.
    let ids = vec!["1"; 5000].join(",");
    let one = format!(r#"{{"model":"m","prompt":[{ids}]}}"#);
    assert!(parse_with(ApiKind::Completions, one.as_bytes(), limits).is_ok());
}

#[test]
fn a_field_given_twice_is_refused_even_when_the_first_is_null() {
    // The engine reads the last of duplicate keys (Python's json); a router reading the first
    // would decide on, and salt, a different request than the engine serves.
    for body in [
        r#"{"model":"m","cache_salt":null,"cache_salt":"chosen","messages":[]}"#,
        r#"{"model":"m","cache_salt":"a","cache_salt":"b","messages":[]}"#,
        r#"{"model":null,"model":"m","messages":[]}"#,
        r#"{"model":"m","stream":null,"stream":true,"messages":[]}"#,
        r#"{"model":"m","max_tokens":null,"max_tokens":5,"messages":[]}"#,
        r#"{"model":"m","messages":null,"messages":[{"role":"user","content":"x"}]}"#,
    ] {
        match chat(body) {
            Err(RequestError::Invalid { message, .. }) => {
                assert!(message.contains("duplicate"), "{body}: {message}")
            }
            other => panic!("{body}: {other:?}"),
        }
    }
    // Once each, `null` included, is fine.
    let req = chat(r#"{"model":"m","cache_salt":null,"messages":[{"role":"user","content":"x"}]}"#)
        .unwrap();
    assert_eq!(req.cache_salt, None);
}
