//! Prefix caching as a client sees it: cached tokens in `usage`, faster first tokens, and
//! recomputation after eviction. Simulated time on a paused clock.

use kvsim::inproc as sim_support;

use kvsim::profile::StepProfile;
use serde_json::json;
use sim_support::*;

#[tokio::test(start_paused = true)]
async fn a_repeated_long_prefix_is_served_from_cache_and_is_faster() {
    let (_replica, app) = start(config("r1")).await;
    let prefix = ids(1, 3000);
    let first = stream(
        &app,
        "/v1/completions",
        tokens_body(&[prefix.clone(), ids(2, 100)].concat(), 4),
    )
    .await;
    let second = stream(
        &app,
        "/v1/completions",
        tokens_body(&[prefix.clone(), ids(3, 100)].concat(), 4),
    )
    .await;
    assert_eq!(first.cached_tokens(), 0);
    // 3000 prefix tokens = 187 full blocks of 16 = 2992 tokens.
    assert_eq!(second.cached_tokens(), 2992);
    assert!(
        second.ttft < first.ttft,
        "{:?} vs {:?}",
        second.ttft,
        first.ttft
    );
    // And exactly what the profile predicts for each.
    let h100 = StepProfile::builtin("h100-llama3-8b").unwrap();
    let expect_cold = h100.prefill_ms(0, 3100, 8192);
    let expect_warm = h100.prefill_ms(2992, 108, 8192);
    assert_close_ms(first.ttft, expect_cold);
    assert_close_ms(second.ttft, expect_warm);
    assert!(first.done && second.done);
}

#[tokio::test(start_paused = true)]
async fn chat_requests_sharing_a_system_prompt_share_cached_blocks() {
    let (_replica, app) = start(config("r1")).await;
    let system = "You are a careful assistant for a logistics company. ".repeat(40);
    let body = |q: &str| {
        json!({"model": "m", "max_tokens": 3, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let first = stream(&app, "/v1/chat/completions", body("Where is order 1?")).await;
    let second = stream(&app, "/v1/chat/completions", body("Where is order 2?")).await;
    assert_eq!(first.cached_tokens(), 0);
    let prompt = second.usage()["prompt_tokens"].as_u64().unwrap();
    let cached = second.cached_tokens();
    assert!(
        cached > 0 && cached % 16 == 0 && cached < prompt,
        "cached {cached} of {prompt}"
    );
    assert!(second.ttft < first.ttft);
    // The stream is chat-shaped: a role chunk first, then content deltas.
    assert_eq!(first.chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first.chunks[0]["object"], "chat.completion.chunk");
}

#[tokio::test(start_paused = true)]
async fn a_prefix_evicted_under_memory_pressure_is_recomputed() {
    // 80 blocks of 16 tokens: 1264 usable tokens.
    let mut cfg = config("r1");
    cfg.num_gpu_blocks = Some(80);
    let (_replica, app) = start(cfg).await;
    let prompt = ids(7, 600);
    let cold = stream(&app, "/v1/completions", tokens_body(&prompt, 2)).await;
    let warm = stream(&app, "/v1/completions", tokens_body(&prompt, 2)).await;
    assert_eq!(warm.cached_tokens(), 592);
    // Three other 600-token prompts need the space: the first prompt's blocks are evicted.
    for seed in 10..13 {
        let other = stream(&app, "/v1/completions", tokens_body(&ids(seed, 600), 2)).await;
        assert_eq!(other.cached_tokens(), 0);
    }
    let again = stream(&app, "/v1/completions", tokens_body(&prompt, 2)).await;
    assert_eq!(again.cached_tokens(), 0, "evicted, so recomputed");
    assert_eq!(
        again.ttft, cold.ttft,
        "a full recompute costs what the first prefill did"
    );
    assert!(warm.ttft < again.ttft);
}

#[tokio::test(start_paused = true)]
async fn the_same_prompt_on_an_adapter_or_with_a_salt_does_not_hit() {
    let mut cfg = config("r1");
    cfg.adapters = vec!["sql".into()];
    let (_replica, app) = start(cfg).await;
    let prompt = ids(9, 200);
    stream(&app, "/v1/completions", tokens_body(&prompt, 1)).await;
    let mut lora = tokens_body(&prompt, 1);
    lora["model"] = json!("sql");
    assert_eq!(
        stream(&app, "/v1/completions", lora.clone())
            .await
            .cached_tokens(),
        0
    );
    assert_eq!(
        stream(&app, "/v1/completions", lora).await.cached_tokens(),
        192
    );
    let mut salted = tokens_body(&prompt, 1);
    salted["cache_salt"] = json!("tenant-a");
    assert_eq!(
        stream(&app, "/v1/completions", salted)
            .await
            .cached_tokens(),
        0
    );
    assert_eq!(
        stream(&app, "/v1/completions", tokens_body(&prompt, 1))
            .await
            .cached_tokens(),
        192
    );
}
