//! Step-time profiles as a client observes them: a prefill takes exactly the profile's time
//! (to the timer's millisecond), `time_scale` divides it, and slower GPUs are slower.
//! Simulated time on a paused clock; no wall-clock sleeps.

use kvsim::inproc as sim_support;

use kvsim::profile::StepProfile;
use sim_support::*;

async fn ttft(profile: &str, time_scale: f64, prompt: &[u32]) -> std::time::Duration {
    let mut cfg = config("r1");
    cfg.profile = profile.into();
    cfg.time_scale = time_scale;
    let (_replica, app) = start(cfg).await;
    stream(&app, "/v1/completions", tokens_body(prompt, 2))
        .await
        .ttft
}

#[tokio::test(start_paused = true)]
async fn prefill_of_n_tokens_takes_the_profiles_time() {
    let names = StepProfile::builtin_names();
    assert!(names.len() >= 4, "{names:?}");
    for name in names {
        let profile = StepProfile::builtin(name).unwrap();
        for n in [1usize, 100, 2048, 5000] {
            let expected = profile.prefill_ms(0, n as u32, profile.max_num_batched_tokens);
            assert_close_ms(ttft(name, 1.0, &ids(1, n)).await, expected);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn time_scale_divides_simulated_time() {
    let profile = StepProfile::builtin("a100-llama3-8b").unwrap();
    let expected = profile.prefill_ms(0, 4096, profile.max_num_batched_tokens);
    assert_close_ms(ttft("a100-llama3-8b", 1.0, &ids(2, 4096)).await, expected);
    assert_close_ms(
        ttft("a100-llama3-8b", 10.0, &ids(2, 4096)).await,
        expected / 10.0,
    );
}

#[tokio::test(start_paused = true)]
async fn the_design_example_cold_versus_cached_prefix() {
    // DESIGN.md: a 4,000-token prompt with 3,000 tokens cached. Here 4096 tokens, 3072 cached.
    for name in ["h100-llama3-8b", "a100-llama3-8b"] {
        let mut cfg = config("r1");
        cfg.profile = name.into();
        let (_replica, app) = start(cfg).await;
        let prefix = ids(3, 3072);
        // Warm the prefix, then send the 4k prompt that extends it; and a cold 4k prompt.
        stream(&app, "/v1/completions", tokens_body(&prefix, 1)).await;
        let warm = stream(
            &app,
            "/v1/completions",
            tokens_body(&[prefix, ids(4, 1024)].concat(), 1),
        )
        .await;
        let cold = stream(&app, "/v1/completions", tokens_body(&ids(5, 4096), 1)).await;
        assert_eq!(warm.cached_tokens(), 3072);
        let profile = StepProfile::builtin(name).unwrap();
        assert_close_ms(
            cold.ttft,
            profile.prefill_ms(0, 4096, profile.max_num_batched_tokens),
        );
        assert_close_ms(
            warm.ttft,
            profile.prefill_ms(3072, 1024, profile.max_num_batched_tokens),
        );
        assert!(
            cold.ttft.as_secs_f64() > 3.0 * warm.ttft.as_secs_f64(),
            "{name}: {:?} vs {:?}",
            cold.ttft,
            warm.ttft
        );
    }
}

#[tokio::test(start_paused = true)]
async fn decode_steps_follow_the_weight_read_floor() {
    // One request alone: after the first token, each of the 9 more tokens is one decode step
    // of fixed + weight read + KV read over its context.
    let profile = StepProfile::builtin("h100-llama3-8b").unwrap();
    let mut cfg = config("r1");
    cfg.profile = profile.name.into();
    let (_replica, app) = start(cfg).await;
    let out = stream(&app, "/v1/completions", tokens_body(&ids(6, 100), 10)).await;
    let decode_ms: f64 = (100..109)
        .map(|ctx| {
            profile.step_ms([kvsim::profile::StepWork::Decode {
                context_tokens: ctx,
            }])
        })
        .sum();
    assert_close_ms(out.e2e - out.ttft, decode_ms);
}
