//! KV in a CPU offload tier, end to end: kvsim replicas with a CPU tier publish vLLM's events
//! (medium `CPU`) over real ZMQ, kvrouter prices the prefix a replica holds only there by its
//! load time, and a request routed through real Envoy goes to that replica while loading beats
//! recomputing (and away from it when the pool's tier is configured too slow to).

use std::time::Duration;

use testkit::*;

fn system_prompt() -> String {
    "You are the dispatcher of a river ferry line; always give the pier and the departure time. "
        .repeat(12)
}

fn body(system: &str, question: &str) -> String {
    serde_json::json!({
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string()
}

fn usage_cached(reply: &Reply) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_offloaded_to_cpu_draws_its_request_while_loading_beats_recomputing() {
    let tokenizer = shared_fixture().display().to_string();
    let extra = format!(
        "policy: {{name: predicted-ttft}}\nmodels: [{{name: {MODEL}, tokenizer: \"{tokenizer}\"}}]"
    );
    // GPUs of 63 blocks (1,008 tokens: about two of these prompts), CPU tiers of 1,000 blocks
    // at 20 GB/s: the router's default for `kv_tiers.cpu`.
    let stack = Stack::start(StackOptions {
        replicas: 2,
        router_extra: &extra,
        replica_flags: &[
            "--tokenizer",
            &tokenizer,
            "--num-gpu-blocks",
            "64",
            "--cpu-offload-blocks",
            "1000",
        ],
        kv_events: true,
        ..StackOptions::default()
    })
    .await;
    let (r1, r1_addr) = (&stack.replicas[1].name, stack.replicas[1].addr);
    let r0_addr = stack.replicas[0].addr;
    let system = system_prompt();
    // r1 computes the prefix (traffic that bypassed the router), then three other long
    // prompts push it off r1's GPU; its CPU tier keeps it.
    let filler = |i: usize| format!("Ticket {i} of the night shift was closed. ").repeat(50);
    for (i, s) in [system.clone(), filler(1), filler(2), filler(3)]
        .iter()
        .enumerate()
    {
        let r = post(
            &stack.client,
            r1_addr,
            "/v1/chat/completions",
            body(s, &format!("warm {i}")),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }

    // The router learns from r1's events that the prefix is on CPU only.
    let probe = body(&system, "which pier?");
    let e = eventually(
        "r1's events to place the prefix in its CPU tier",
        Duration::from_secs(10),
        || async {
            let e = stack.explain(&probe).await;
            let row = candidate_row(&e, r1_addr);
            (row["cpu_tokens"].as_u64() >= Some(200)
                && row["held_tokens"] == row["cpu_tokens"]
                && row["cache_source"] == "events")
                .then_some(e)
        },
    )
    .await;
    let row = candidate_row(&e, r1_addr);
    let (cpu_tokens, load_ms) = (
        row["cpu_tokens"].as_u64().unwrap(),
        row["tier_load_ms"].as_f64().unwrap(),
    );
    // 128 KiB a token at 20 GB/s, plus 1 ms: far below recomputing at 10,000 tokens/s.
    let expected = 1.0 + cpu_tokens as f64 * 131_072.0 / 20e9 * 1e3;
    assert!(
        (load_ms - expected).abs() < 0.01,
        "{load_ms} vs {expected}: {e}"
    );
    assert_eq!(
        e["pick"],
        r1_addr.to_string(),
        "loading beats recomputing: {e}"
    );
    assert_eq!(candidate_row(&e, r0_addr)["held_tokens"], 0, "{e}");

    // A tier as slow as 0.02 GB/s (6.5 ms a token) loses to recomputing on the empty replica.
    stack
        .reconfigure_pool(&extra, "kv_tiers: {cpu: {bandwidth_gb_per_s: 0.02}}")
        .await;
    let e = stack.explain(&probe).await;
    assert!(
        candidate_row(&e, r1_addr)["tier_load_ms"].as_f64() > Some(1000.0),
        "{e}"
    );
    assert_eq!(
        e["pick"],
        r0_addr.to_string(),
        "recomputing beats a slow load: {e}"
    );

    // Back to the tier's real speed: routed through Envoy, the request goes to r1, which
    // loads the prefix from CPU instead of prefilling it.
    stack.reconfigure_pool(&extra, "").await;
    let routed = stack.post("/v1/chat/completions", probe.clone()).await;
    assert_eq!(routed.status, 200, "{}", routed.body);
    assert_eq!(routed.replica.as_deref(), Some(r1.as_str()));
    assert!(usage_cached(&routed) >= cpu_tokens, "{}", routed.body);
    let sim = Metrics::fetch(&stack.client, &format!("http://{r1_addr}/metrics"))
        .await
        .unwrap();
    assert!(
        sim.sum_where(
            "vllm:kv_offload_total_bytes_total",
            "transfer_type",
            "CPU_to_GPU"
        ) >= cpu_tokens as f64 * 131_072.0,
        "r1 loaded the prefix from its CPU tier"
    );
    assert_in_flight_drains(stack.router.admin).await;
}
