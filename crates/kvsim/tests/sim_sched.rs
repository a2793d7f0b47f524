//! Scheduling as `/metrics` shows it: queues under a burst, preemption under KV pressure.
//! Simulated time on a paused clock.

use kvsim::inproc as sim_support;

use std::time::Duration;

use serde_json::Value;
use sim_support::*;

const LABELS: &str = "{engine=\"0\",model_name=\"m\"}";

#[tokio::test(start_paused = true)]
async fn queue_metrics_rise_under_a_burst_and_return_to_zero() {
    let mut cfg = config("r1");
    cfg.max_num_seqs = Some(4);
    let (_replica, app) = start(cfg).await;
    let burst: Vec<_> = (0..20)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                call(
                    &app,
                    "POST",
                    "/v1/completions",
                    Some(&tokens_body(&ids(i, 300), 20)),
                )
                .await
            })
        })
        .collect();
    // Let the burst arrive and a few steps run.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let busy = metrics(&app).await;
    assert_eq!(
        metric(&busy, &format!("vllm:num_requests_running{LABELS}")),
        4.0
    );
    assert_eq!(
        metric(&busy, &format!("vllm:num_requests_waiting{LABELS}")),
        16.0
    );
    assert!(metric(&busy, &format!("vllm:kv_cache_usage_perc{LABELS}")) > 0.0);
    for task in burst {
        let (status, _, body) = task.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(body["usage"]["completion_tokens"], 20);
    }
    let idle = metrics(&app).await;
    assert_eq!(
        metric(&idle, &format!("vllm:num_requests_running{LABELS}")),
        0.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:num_requests_waiting{LABELS}")),
        0.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:kv_cache_usage_perc{LABELS}")),
        0.0
    );
    assert_eq!(
        metric(
            &idle,
            "vllm:request_success_total{engine=\"0\",model_name=\"m\",finished_reason=\"length\"}"
        ),
        20.0
    );
    assert_eq!(
        metric(
            &idle,
            &format!("vllm:time_to_first_token_seconds_count{LABELS}")
        ),
        20.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:prompt_tokens_total{LABELS}")),
        20.0 * 300.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:generation_tokens_total{LABELS}")),
        20.0 * 20.0
    );
}

#[tokio::test(start_paused = true)]
async fn oversubscribed_kv_cache_preempts_and_every_request_completes() {
    // 40 blocks of 16 tokens; 8 requests that each grow to 64 + 200 tokens (17 blocks).
    let mut cfg = config("r1");
    cfg.num_gpu_blocks = Some(40);
    let (_replica, app) = start(cfg).await;
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                call(
                    &app,
                    "POST",
                    "/v1/completions",
                    Some(&tokens_body(&ids(50 + i, 64), 200)),
                )
                .await
            })
        })
        .collect();
    for task in tasks {
        let (status, _, body) = task.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 200);
        let text = body["choices"][0]["text"].as_str().unwrap();
        assert_eq!(text.split_whitespace().count(), 200);
    }
    let text = metrics(&app).await;
    assert!(metric(&text, &format!("vllm:num_preemptions_total{LABELS}")) > 0.0);
    assert_eq!(
        metric(&text, &format!("vllm:num_requests_running{LABELS}")),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn batched_prompts_become_choices_with_summed_usage() {
    let (_replica, app) = start(config("r1")).await;
    let body = serde_json::json!({"model": "m", "prompt": ["one two three", "four five"], "max_tokens": 3});
    let (status, _, json) = call(&app, "POST", "/v1/completions", Some(&body)).await;
    assert_eq!(status, 200);
    let choices = json["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(json["usage"]["completion_tokens"], 6);
    assert_eq!(json["usage"]["prompt_tokens"], 5);
    let streamed = stream(&app, "/v1/completions", body).await;
    let finished: Vec<&Value> = streamed
        .chunks
        .iter()
        .filter(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|ch| ch["finish_reason"] == "length")
        })
        .collect();
    assert_eq!(finished.len(), 2, "each choice ends with a finish_reason");
    assert_eq!(streamed.usage()["completion_tokens"], 6);
    assert!(streamed.done);
}

#[tokio::test(start_paused = true)]
async fn requests_without_max_tokens_follow_the_configured_distribution() {
    let mut cfg = config("r1");
    cfg.output_length = kvsim::OutputLength::Uniform {
        min: 3,
        max: 9,
        seed: 1,
    };
    let (_replica, app) = start(cfg).await;
    let mut lengths = Vec::new();
    for i in 0..20 {
        let body = serde_json::json!({"model": "m", "prompt": format!("prompt number {i}")});
        let (status, _, json) = call(&app, "POST", "/v1/completions", Some(&body)).await;
        assert_eq!(status, 200);
        assert_eq!(json["choices"][0]["finish_reason"], "stop");
        lengths.push(json["usage"]["completion_tokens"].as_u64().unwrap());
    }
    assert!(lengths.iter().all(|&n| (3..=9).contains(&n)), "{lengths:?}");
    assert!(lengths.iter().any(|&n| n != lengths[0]), "{lengths:?}");
}
