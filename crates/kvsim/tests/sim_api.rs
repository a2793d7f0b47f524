//! The OpenAI surface as vLLM answers it: the default model, vLLM's 400 body for bad requests
//! (naming the field, never quoting the prompt), and the stream's usage chunk.

use kvsim::inproc::{call, config, start};
use serde_json::{json, Value};

#[tokio::test(start_paused = true)]
async fn a_request_without_a_model_goes_to_the_first_served_model() {
    let mut cfg = config("r1");
    cfg.models = vec!["first".into(), "second".into()];
    let (_replica, app) = start(cfg).await;
    let (status, _, body) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "hello", "max_tokens": 2})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "first");
    let (status, _, body) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&json!({"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "second");
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

#[tokio::test(start_paused = true)]
async fn bad_bodies_get_vllms_400_naming_the_field() {
    let (_replica, app) = start(config("r1")).await;
    let secret = "SECRET-PROMPT";
    let cases: [(&str, Value, Option<&str>); 5] = [
        ("/v1/completions", json!({"model": "m"}), Some("prompt")),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": secret, "max_tokens": -1}),
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": secret, "stream_options": {"include_usage": true}}),
            Some("stream_options"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "x", "text": secret}]}]}),
            Some("messages[0].content[0].type"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": secret}),
            Some("messages"),
        ),
    ];
    for (path, body, param) in cases {
        let (status, _, reply) = call(&app, "POST", path, Some(&body)).await;
        assert_eq!(status, 400, "{body}: {reply}");
        let error = &reply["error"];
        assert_eq!(error["type"], "BadRequestError");
        assert_eq!(error["code"], 400);
        assert_eq!(error["param"].as_str(), param, "{reply}");
        let message = error["message"].as_str().expect("a message");
        assert!(!message.contains(secret), "{message}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_stream_ends_with_usage_unless_the_client_declines_it() {
    let (_replica, app) = start(config("r1")).await;
    let body = |options: Value| {
        let mut b = json!({"model": "m", "prompt": "hello there", "max_tokens": 2, "stream": true});
        if !options.is_null() {
            b["stream_options"] = options;
        }
        b
    };
    for (options, usage) in [
        (Value::Null, true),
        (json!({"include_usage": true}), true),
        (json!({"include_usage": false}), false),
    ] {
        let (status, _, text) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(&body(options.clone())),
        )
        .await;
        assert_eq!(status, 200);
        let text = text.as_str().expect("an SSE body");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert_eq!(text.contains("\"usage\""), usage, "{options}: {text}");
    }
}
