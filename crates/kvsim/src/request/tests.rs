use serde_json::json;

use super::*;

fn chat(body: serde_json::Value) -> Result<SimRequest, RequestError> {
    parse(ApiKind::ChatCompletions, body.to_string().as_bytes())
}

fn completion(body: serde_json::Value) -> Result<SimRequest, RequestError> {
    parse(ApiKind::Completions, body.to_string().as_bytes())
}

fn media_of(req: &SimRequest) -> Vec<Media> {
    let Prompt::Chat(messages) = &req.prompt else {
        panic!("not a chat")
    };
    messages
        .iter()
        .flat_map(|m| &m.content)
        .filter_map(|p| match p {
            ContentPart::Media(m) => Some(*m),
            ContentPart::Text(_) => None,
        })
        .collect()
}

#[test]
fn completion_prompts_in_every_shape() {
    let cases: [(serde_json::Value, Prompt, usize); 4] = [
        (json!("hi"), Prompt::Text("hi".into()), 1),
        (
            json!(["a", "b"]),
            Prompt::Texts(vec!["a".into(), "b".into()]),
            2,
        ),
        (json!([1, 2, 3]), Prompt::Tokens(vec![1, 2, 3]), 1),
        (
            json!([[1], [2, 3]]),
            Prompt::TokenLists(vec![vec![1], vec![2, 3]]),
            2,
        ),
    ];
    for (prompt, expected, choices) in cases {
        let req = completion(json!({"model": "m", "prompt": prompt})).unwrap();
        assert_eq!(req.prompt, expected);
        assert_eq!(req.prompts().len(), choices);
    }
    let batch = completion(json!({"prompt": [[1], [2, 3]]})).unwrap();
    assert_eq!(
        batch.prompts(),
        vec![PromptRef::Tokens(&[1]), PromptRef::Tokens(&[2, 3])]
    );
}

#[test]
fn defaults_follow_vllm() {
    let c = completion(json!({"prompt": "x"})).unwrap();
    assert_eq!(c.model, None, "model is optional: the first served model");
    assert!(!c.stream);
    assert_eq!(c.max_tokens, None);
    assert!(
        c.render.add_special_tokens,
        "completions add BOS by default"
    );
    let ch = chat(json!({"model": "", "messages": []})).unwrap();
    assert_eq!(ch.model, None, "an empty model name is the default model");
    assert!(!ch.render.add_special_tokens, "chat templates write BOS");
    assert!(ch.render.add_generation_prompt);
    assert!(ch.render.chat_template_kwargs.is_empty());
}

#[test]
fn fields_are_read_with_vllm_precedence() {
    let req = chat(json!({
        "model": "sql-lora", "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 9, "max_completion_tokens": 4, "stream": true,
        "stream_options": {"include_usage": false}, "cache_salt": "tenant-a",
        "add_generation_prompt": false, "chat_template_kwargs": {"enable_thinking": false},
        "temperature": 0, "unknown_field": {"ignored": true}
    }))
    .unwrap();
    assert_eq!(req.model.as_deref(), Some("sql-lora"));
    assert_eq!(req.max_tokens, Some(4), "max_completion_tokens first");
    assert!(req.stream);
    assert_eq!(req.include_usage, Some(false));
    assert_eq!(req.cache_salt.as_deref(), Some("tenant-a"));
    assert!(!req.render.add_generation_prompt);
    assert_eq!(
        req.render.chat_template_kwargs.get("enable_thinking"),
        Some(&json!(false))
    );
    // Python's `or`: a 0 max_completion_tokens falls through to max_tokens.
    let req = chat(json!({"messages": [], "max_completion_tokens": 0, "max_tokens": 7})).unwrap();
    assert_eq!(req.max_tokens, Some(7));
    // Completions have no max_completion_tokens.
    let req = completion(json!({"prompt": "x", "max_completion_tokens": 3})).unwrap();
    assert_eq!(req.max_tokens, None);
}

#[test]
fn bad_bodies_name_the_field_and_never_quote_the_prompt() {
    let secret = "TOP-SECRET prompt text";
    let cases: Vec<(ApiKind, String, Option<&str>, &str)> = vec![
        (ApiKind::Completions, "{".into(), None, "not valid JSON"),
        (ApiKind::Completions, format!("{:?}", secret), None, "JSON object"),
        (ApiKind::Completions, "{}".into(), Some("prompt"), "missing"),
        (ApiKind::ChatCompletions, "{}".into(), Some("messages"), "missing"),
        (
            ApiKind::Completions,
            json!({"prompt": 5}).to_string(),
            Some("prompt"),
            "got an integer",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": []}).to_string(),
            Some("prompt"),
            "empty",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": ["a", 1]}).to_string(),
            Some("prompt"),
            "all strings",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": [1, -2]}).to_string(),
            Some("prompt[1]"),
            "token id",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": [[1], [secret]]}).to_string(),
            Some("prompt[1][0]"),
            "got a string",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "stream": secret}).to_string(),
            Some("stream"),
            "expected a boolean",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "max_tokens": 0}).to_string(),
            Some("max_tokens"),
            "at least 1",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "max_tokens": 1.5}).to_string(),
            Some("max_tokens"),
            "integer",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "stream_options": {"include_usage": true}}).to_string(),
            Some("stream_options"),
            "stream=True",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})
                .to_string(),
            Some("stream_options.include_usage"),
            "boolean",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "cache_salt": ""}).to_string(),
            Some("cache_salt"),
            "non-empty",
        ),
        (
            ApiKind::Completions,
            json!({"prompt": "x", "model": 3}).to_string(),
            Some("model"),
            "string",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": {"role": "user"}}).to_string(),
            Some("messages"),
            "array",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"content": secret}]}).to_string(),
            Some("messages[0].role"),
            "role",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"role": "user", "content": 7}]}).to_string(),
            Some("messages[0].content"),
            "content parts",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"role": "user", "content": [{"type": "hologram", "text": secret}]}]})
                .to_string(),
            Some("messages[0].content[0].type"),
            "unsupported",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"role": "user", "content": [{"text": secret}]}]}).to_string(),
            Some("messages[0].content[0].type"),
            "needs a `type`",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
                .to_string(),
            Some("messages[0].content[0].image_url"),
            "URL",
        ),
        (
            ApiKind::ChatCompletions,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
                .to_string(),
            Some("messages[0].content[0].text"),
            "string",
        ),
    ];
    for (api, body, param, needle) in cases {
        let err = parse(api, body.as_bytes()).expect_err(&body);
        assert_eq!(err.param(), param, "{body}: {err}");
        let text = err.to_string();
        assert!(text.contains(needle), "{body}: {text:?} lacks {needle:?}");
        assert!(!text.contains("SECRET"), "{text}");
    }
}

#[test]
fn content_parts_as_vllm_reads_them() {
    let req = chat(json!({"messages": [
        {"role": "system", "content": null},
        {"role": "user", "content": [
            "bare",
            {"type": "text", "text": "a"},
            {"type": "text", "text": null},
            {"type": "input_text", "text": "b"},
            {"type": "refusal", "refusal": "c"},
            {"type": "image_url", "image_url": {"url": "http://x/cat.png", "detail": "auto"}},
        ]},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ], "reasoning_content": "hmm"},
        {"role": "tool", "content": "42", "tool_call_id": "1", "name": "f"},
    ]}))
    .unwrap();
    let Prompt::Chat(m) = &req.prompt else {
        panic!()
    };
    assert_eq!(m.len(), 4);
    assert!(m[0].content.is_empty(), "null content has no parts");
    let texts: Vec<&str> = m[1]
        .content
        .iter()
        .filter_map(|p| match p {
            ContentPart::Text(t) => Some(t.as_str()),
            ContentPart::Media(_) => None,
        })
        .collect();
    assert_eq!(
        texts,
        ["bare", "a", "b", "c"],
        "a null text part is skipped"
    );
    assert_eq!(m[1].content.len(), 5);
    let calls = m[2].tool_calls.as_ref().unwrap();
    assert_eq!(calls[0]["function"]["arguments"], json!({"x": 1}));
    assert_eq!(calls[1]["function"]["arguments"], json!({}));
    assert_eq!(m[2].reasoning.as_deref(), Some("hmm"));
    assert_eq!(m[3].tool_call_id.as_deref(), Some("1"));
    assert_eq!(m[3].name.as_deref(), Some("f"));
}

#[test]
fn media_identity_is_its_content_or_its_uuid() {
    let one = |part: serde_json::Value| -> Media {
        let req = chat(json!({"messages": [{"role": "user", "content": [part]}]})).unwrap();
        let media = media_of(&req);
        assert_eq!(media.len(), 1);
        media[0]
    };
    let cat = one(json!({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}));
    assert_eq!(cat.modality, Modality::Image);
    // The same image, however it is spelled, is the same item.
    assert_eq!(one(json!({"image_url": "http://x/cat.png"})), cat);
    assert_eq!(
        one(json!({"type": "input_image", "image_url": "http://x/cat.png"})),
        cat
    );
    let dog = one(json!({"type": "image_url", "image_url": {"url": "http://x/dog.png"}}));
    assert_ne!(dog.hash, cat.hash);
    // A uuid names the item, whatever its URL.
    let a =
        one(json!({"type": "image_url", "image_url": {"url": "http://x/cat.png"}, "uuid": "u1"}));
    let b =
        one(json!({"type": "image_url", "image_url": {"url": "http://x/dog.png"}, "uuid": "u1"}));
    assert_eq!(a, b);
    assert_ne!(a, cat);
    // Other modalities.
    let audio =
        one(json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}));
    assert_eq!(audio.modality, Modality::Audio);
    let video = one(json!({"type": "video_url", "video_url": {"url": "http://x/cat.png"}}));
    assert_eq!(video.modality, Modality::Video);
    assert_ne!(video.hash, cat.hash, "the modality is part of the identity");
    let file = one(json!({"type": "file", "file": {"file_id": "file-1"}}));
    assert_eq!(file.modality, Modality::File);
}
