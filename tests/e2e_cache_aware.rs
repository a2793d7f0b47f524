//! Cache-aware routing end to end: real Envoy, kvrouter and simulated replicas that tokenize with
//! the same real tokenizer as the router, so the replicas' reported `cached_tokens` confirm the
//! router's prefix predictions.

use std::collections::HashMap;
use std::time::Duration;

use testkit::*;

fn fixture() -> String {
    shared_fixture().display().to_string()
}

fn system_prompt() -> String {
    "You are a careful assistant for a logistics company; answer with tracking details. ".repeat(30)
}

fn body(question: &str, max_tokens: u32, stream: bool) -> String {
    let mut body = serde_json::json!({
        "model": MODEL, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "system", "content": system_prompt()}, {"role": "user", "content": question}],
    });
    // vLLM (and kvsim) refuse stream_options on a request that does not stream.
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body.to_string()
}

fn cached_tokens(reply: &Reply) -> u64 {
    let usage = if reply.body.starts_with('{') {
        serde_json::from_str::<serde_json::Value>(&reply.body).unwrap()["usage"].clone()
    } else {
        let events = sse_events(&reply.body);
        serde_json::from_str::<serde_json::Value>(&events[events.len() - 2]).unwrap()["usage"]
            .clone()
    };
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

async fn stack(policy: &str) -> Stack {
    stack_with(policy, "").await
}

async fn stack_with(policy: &str, extra: &str) -> Stack {
    let extra = format!(
        "policy: {{name: {policy}}}\nmodels: [{{name: {MODEL}, tokenizer: \"{}\"}}]\n{extra}",
        fixture()
    );
    let tokenizer = fixture();
    Stack::start(StackOptions {
        replicas: 3,
        router_extra: &extra,
        replica_flags: &["--tokenizer", &tokenizer],
        ..StackOptions::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_system_prompt_lands_on_the_replica_that_holds_it() {
    let stack = stack("predicted-ttft").await;
    let first = stack
        .post("/v1/chat/completions", body("Where is parcel 1?", 4, false))
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(cached_tokens(&first), 0, "cold");
    let holder = first.replica.clone().unwrap();
    for i in 2..8 {
        let r = stack
            .post(
                "/v1/chat/completions",
                body(&format!("Where is parcel {i}?"), 4, i % 2 == 0),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.replica.as_deref(),
            Some(holder.as_str()),
            "request {i} follows its prefix"
        );
        // The replica confirms the hit: the whole system prompt, in full blocks.
        let cached = cached_tokens(&r);
        assert!(
            cached >= 300,
            "request {i}: replica reported {cached} cached tokens"
        );
    }
    assert_in_flight_drains(stack.router.admin).await;
}

/// With a concurrency limit per replica (`max_in_flight`, a capacity hint), a burst of long
/// requests sharing one prefix fills the holder and spills to the others instead of queueing
/// behind it. (Live queue signals scraped from the replicas do the same without a hint.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_under_load_spills_to_other_replicas() {
    let stack = stack_with("predicted-ttft", "").await;
    let addrs: Vec<_> = stack.replicas.iter().map(|r| r.addr).collect();
    let limited = router_config(stack.dir.path(), &addrs, "").replace(
        "      - address:",
        "      - max_in_flight: 4\n        address:",
    );
    let limited = limited.replace(
        "pools:",
        &format!("policy: {{name: predicted-ttft}}\nmodels: [{{name: {MODEL}, tokenizer: \"{}\"}}]\npools:", fixture()),
    );
    stack.reload(&limited).await;
    // Warm one replica with the prefix.
    let warm = stack
        .post("/v1/chat/completions", body("warm up", 1, false))
        .await;
    assert_eq!(warm.status, 200);
    // Then a burst of long generations sharing it, all in flight together.
    let mut tasks = Vec::new();
    for i in 0..12 {
        let client = stack.client.clone();
        let addr = stack.envoy.addr;
        tasks.push(tokio::spawn(async move {
            post(
                &client,
                addr,
                "/v1/chat/completions",
                body(&format!("burst {i}"), 200, true),
            )
            .await
        }));
        // Let each decision see the previous ones in flight.
        wait_for_decisions(stack.router.admin, i + 2).await;
    }
    let mut per_replica: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        *per_replica.entry(r.replica.unwrap()).or_default() += 1;
    }
    assert!(
        per_replica.len() >= 3,
        "the hot prefix spilled: {per_replica:?}"
    );
    assert!(*per_replica.values().max().unwrap() <= 5, "{per_replica:?}");
    assert_in_flight_drains(stack.router.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_via_the_admin_api_shows_the_holder_without_the_prompt() {
    let stack = stack("predicted-ttft").await;
    let r = stack
        .post("/v1/chat/completions", body("Where is parcel 9?", 2, false))
        .await;
    let holder = r.upstream.clone().unwrap();
    // The client has its answer before the observer stream releases the holder's in-flight
    // count; explain against the settled tables, not a holder that still looks busy.
    assert_in_flight_drains(stack.router.admin).await;
    let req = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(req.path(), body("Where is parcel 10?", 2, false)).unwrap();
    let out = std::process::Command::new(kvrouter_bin())
        .args([
            "explain",
            "--admin",
            &format!("http://{}", stack.router.admin),
            "--body",
        ])
        .arg(req.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("pick {holder}")), "{text}");
    assert!(
        text.contains("predicted-ttft") && text.contains("tokenizer"),
        "{text}"
    );
    assert!(
        !text.contains("logistics") && !text.contains("parcel"),
        "no prompt text: {text}"
    );
    // The holder shows its matched tokens, in the table's `matched` column.
    let header: Vec<&str> = text
        .lines()
        .find(|l| l.starts_with("rank "))
        .expect("table header")
        .split_whitespace()
        .collect();
    let column = header
        .iter()
        .position(|c| *c == "matched")
        .expect("matched column");
    let line = text
        .lines()
        .find(|l| l.contains(&holder) && l.starts_with('0'))
        .expect("holder row");
    let matched: u64 = line
        .split_whitespace()
        .nth(column)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no matched tokens in {line}"));
    assert!(matched >= 300, "{line}");
}

/// A conversation's second turn, routed on the prefix its first turn left: the first turn was
/// decided before its question was tokenized (`defer_tokenizing_after`, on by default), and the
/// question's blocks reached the pick's predictions only after the reply. The second turn's
/// decision credits the pick with the system prompt AND that question, and the replica confirms
/// the hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_first_turn_still_predicts_its_question_for_the_next_turn() {
    let stack = stack("predicted-ttft").await;
    let question = "Where is parcel 77 now, which depots has it passed through, and when did it \
                    leave the last one? Please list every scan with its time and place.";
    let first = serde_json::json!({
        "model": MODEL, "max_tokens": 8,
        "messages": [{"role": "system", "content": system_prompt()},
                     {"role": "user", "content": question}],
    });
    let r1 = stack.post("/v1/chat/completions", first.to_string()).await;
    assert_eq!(r1.status, 200, "{}", r1.body);
    let answer = serde_json::from_str::<serde_json::Value>(&r1.body).unwrap()["choices"][0]
        ["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let admin = stack.router.admin;
    eventually(
        "the first turn's new text tokenized",
        Duration::from_secs(10),
        || async move {
            let m = router_metrics(admin).await;
            (m.sum_where("kvrouter_deferred_tokenizings_total", "result", "finished") >= 1.0)
                .then_some(())
        },
    )
    .await;
    let system_only = {
        // What the system prompt alone holds in full blocks, as the second turn will count it.
        let probe = serde_json::json!({
            "model": MODEL, "max_tokens": 1,
            "messages": [{"role": "system", "content": system_prompt()}],
        });
        let r = stack.post("/v1/chat/completions", probe.to_string()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.replica, r1.replica, "the system prompt's holder");
        assert_in_flight_drains(admin).await;
        cached_tokens(&r)
    };

    let matched_before = metric_sum(admin, "kvrouter_decision_matched_tokens_total").await;
    let second = serde_json::json!({
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "system", "content": system_prompt()},
                     {"role": "user", "content": question},
                     {"role": "assistant", "content": answer},
                     {"role": "user", "content": "Thanks. When will it arrive?"}],
    });
    let r2 = stack.post("/v1/chat/completions", second.to_string()).await;
    assert_eq!(r2.status, 200, "{}", r2.body);
    assert_eq!(
        r2.replica, r1.replica,
        "the conversation stays where its prefix is"
    );
    let matched =
        metric_sum(admin, "kvrouter_decision_matched_tokens_total").await - matched_before;
    assert!(
        matched >= (system_only + 32) as f64,
        "the pick was credited with the first question too: {matched} matched, the system \
         prompt alone is {system_only}"
    );
    assert!(
        cached_tokens(&r2) >= system_only + 32,
        "the replica confirms the hit"
    );
    assert_in_flight_drains(admin).await;
}
