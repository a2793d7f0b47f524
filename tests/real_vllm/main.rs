//! kvrouter and real Envoy in front of two real vLLM 0.32 CPU replicas (SmolLM2-135M), with KV
//! events and metrics: the checks of issue 14 against the engine itself rather than kvsim.
//!
//! Not part of `make test` (vLLM takes 7 GB on disk and each replica one to three minutes to
//! start): `make test-vllm` installs it (`scripts/setup-vllm.sh`) and runs this test with
//! `KVROUTER_VLLM` (the `vllm` executable) and `KVROUTER_VLLM_MODEL` (the model dir) set.
//! Processes' logs stay in `.run/real-vllm/`. See docs/real-vllm.md.
//!
//! One stack serves every check (starting vLLM dominates the cost); each check runs as its own
//! task, so one failing check does not hide the others' results, and the test fails at the end
//! listing every failed check by name.

mod checks;
mod engine;
mod faults;
mod fleet;
mod kvsim;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use fleet::Fleet;

/// A check's name and its summary or failure.
struct Outcome {
    name: &'static str,
    result: Result<String, String>,
    seconds: f64,
}

/// Runs `check` as a task: a panic becomes a failed outcome with the panic's message.
async fn run<F>(name: &'static str, check: F) -> Outcome
where
    F: Future<Output = String> + Send + 'static,
{
    println!("== {name}");
    let started = Instant::now();
    let result = tokio::spawn(check)
        .await
        .map_err(|e| match e.try_into_panic() {
            Ok(p) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".to_string()),
            Err(e) => e.to_string(),
        });
    let seconds = started.elapsed().as_secs_f64();
    match &result {
        Ok(s) => println!("   ok ({seconds:.1} s): {s}"),
        Err(e) => println!("   FAILED ({seconds:.1} s): {e}"),
    }
    Outcome {
        name,
        result,
        seconds,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real vLLM (5-8 minutes and 7 GB to install the first time): run `make test-vllm`"]
async fn kvrouter_and_envoy_in_front_of_two_real_vllm_replicas() {
    let started = Instant::now();
    let dir = testkit::repo().join(".run/real-vllm");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("run dir");
    let f = Arc::new(Fleet::start(&dir).await);
    println!(
        "stack up in {:.0} s: X {} and Y {} (vLLM), kvrouter admin {}, Envoy {}",
        started.elapsed().as_secs_f64(),
        f.addrs[0],
        f.addrs[1],
        f.router.admin,
        f.envoy.addr
    );
    let mut outcomes = Vec::new();
    // First, on fresh engines whose events have not yet told kvrouter their block size.
    let g = f.clone();
    outcomes.push(
        run("short_prompts_never_distrust (fresh engines)", async move {
            checks::short_prompts_never_distrust(&g, "fresh engines").await
        })
        .await,
    );
    let g = f.clone();
    outcomes.push(
        run("repeats_go_to_the_holder", async move {
            checks::repeats_go_to_the_holder(&g).await
        })
        .await,
    );
    let g = f.clone();
    outcomes.push(
        run("bypassed_prefix_found_through_events", async move {
            checks::bypassed_prefix_found_through_events(&g).await
        })
        .await,
    );
    let g = f.clone();
    outcomes.push(
        run("a_late_router_learns_from_the_replay_socket", async move {
            checks::a_late_router_learns_from_the_replay_socket(&g).await
        })
        .await,
    );
    outcomes.push(
        run(
            "a_killed_replica_costs_no_request",
            faults::a_killed_replica_costs_no_request(f.clone()),
        )
        .await,
    );
    // Y restarts (a minute or two) while X serves the kvsim comparison.
    let (g, h) = (f.clone(), f.clone());
    let (restart, sim) = tokio::join!(
        run(
            "a_restarted_replica_is_distrusted_then_trusted",
            async move { faults::a_restarted_replica_is_distrusted_then_trusted(&g).await }
        ),
        run("kvsim_reports_the_engines_cached_tokens", async move {
            kvsim::kvsim_reports_the_engines_cached_tokens(&h).await
        }),
    );
    outcomes.push(restart);
    outcomes.push(sim);
    let g = f.clone();
    outcomes.push(
        run("short_prompts_never_distrust (after events)", async move {
            checks::short_prompts_never_distrust(&g, "after events").await
        })
        .await,
    );

    println!(
        "\nreal vLLM checks, {:.0} s in all:",
        started.elapsed().as_secs_f64()
    );
    for o in &outcomes {
        let verdict = if o.result.is_ok() { "ok    " } else { "FAILED" };
        println!("  {verdict} {:<48} {:>5.1} s", o.name, o.seconds);
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err().map(|e| format!("{}: {e}", o.name)))
        .collect();
    assert_eq!(outcomes.len(), 8);
    assert!(
        failed.is_empty(),
        "{} of {} checks failed:\n{}",
        failed.len(),
        outcomes.len(),
        failed.join("\n")
    );
}
