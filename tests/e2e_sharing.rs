//! Decision sharing between router instances, end to end: a real `redis-server` on an ephemeral
//! loopback port, two kvrouter instances (A and B), each behind its own real Envoy so the test
//! decides which instance routes which request, and four kvsim replicas without KV events (so
//! an instance knows only predictions: its own decisions and, with sharing, its peer's).
//!
//! `redis-server` must be installed (`make redis`, which `make test` runs): a missing binary
//! fails these tests, it does not skip them.

use std::net::SocketAddr;
use std::time::Duration;

use kvrouter::envoyconf::{BodyMode, ClusterStyle};
use testkit::*;

const PREFIXES: usize = 4;

fn fixture() -> String {
    shared_fixture().display().to_string()
}

/// A long system prompt of its own per conversation `i`, and a question.
fn body(i: usize, question: &str, max_tokens: u32, stream: bool) -> String {
    let system =
        format!("Conversation {i}: you are the assistant of depot number {i}; ").repeat(40);
    serde_json::json!({
        "model": MODEL, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    .to_string()
}

/// One router instance and the Envoy in front of it.
struct Front {
    dir: tempfile::TempDir,
    router: Router,
    envoy: Envoy,
    client: reqwest::Client,
}

impl Front {
    /// An instance over `replicas` (each taking one request at a time, so concurrent requests
    /// spread), sharing through `redis` when given.
    async fn start(replicas: &[SocketAddr], redis: Option<&Redis>) -> Front {
        let dir = tempfile::tempdir().unwrap();
        let sharing = redis
            .map(|r| format!("sharing: {{redis: \"{}\"}}\n", r.url()))
            .unwrap_or_default();
        let extra = format!(
            "policy: {{name: predicted-ttft}}\nmodels: [{{name: {MODEL}, tokenizer: \"{}\"}}]\n{sharing}",
            fixture()
        );
        let yaml = router_config(dir.path(), replicas, &extra).replace(
            "      - address:",
            "      - max_in_flight: 1\n        address:",
        );
        let router = start_router(dir.path(), &yaml);
        router.wait_ready().await.unwrap();
        let envoy = start_envoy(
            dir.path(),
            &envoy_yaml(
                &router,
                dir.path(),
                ClusterStyle::OverrideHost,
                BodyMode::Buffered,
                None,
            ),
        )
        .await;
        envoy.wait_for_hosts(replicas).await.unwrap();
        Front {
            dir,
            router,
            envoy,
            client: reqwest::Client::new(),
        }
    }

    async fn chat(&self, body: String) -> Reply {
        post(&self.client, self.envoy.addr, "/v1/chat/completions", body).await
    }

    async fn explain(&self, body: &str) -> serde_json::Value {
        self.client
            .post(format!("http://{}/debug/explain", self.router.admin))
            .body(body.to_string())
            .send()
            .await
            .expect("explain")
            .json()
            .await
            .expect("explain json")
    }

    async fn metric(&self, name: &str, key: &str, value: &str) -> f64 {
        router_metrics(self.router.admin)
            .await
            .sum_where(name, key, value)
    }
}

fn replica_addr(reply: &Reply, replicas: &[Replica]) -> SocketAddr {
    let name = reply.replica.as_deref().expect("x-kvsim-replica");
    replicas
        .iter()
        .find(|r| r.name == name)
        .map(|r| r.addr)
        .unwrap_or_else(|| panic!("unknown replica {name}"))
}

fn cached_tokens(reply: &Reply) -> u64 {
    serde_json::from_str::<serde_json::Value>(&reply.body).unwrap()["usage"]
        ["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

fn replicas(dir: &std::path::Path) -> Vec<Replica> {
    let tokenizer = fixture();
    (0..4)
        .map(|i| {
            start_replica(
                dir,
                ReplicaSpec::new(format!("r{i}")).flag("tokenizer", &tokenizer),
            )
        })
        .collect()
}

/// A routes the first turn of [`PREFIXES`] conversations at once (they spread, one per
/// replica); returns where each went.
async fn first_turns(a: &Front, replicas: &[Replica]) -> Vec<SocketAddr> {
    let mut tasks = Vec::new();
    for i in 0..PREFIXES {
        let client = a.client.clone();
        let addr = a.envoy.addr;
        tasks.push(tokio::spawn(async move {
            post(
                &client,
                addr,
                "/v1/chat/completions",
                body(i, "first question", 24, false),
            )
            .await
        }));
    }
    let mut picks = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        picks.push(replica_addr(&r, replicas));
    }
    picks
}

/// B routes each conversation's second turn, one after the other (nothing in flight); returns
/// where each went and the cached tokens its replica reported.
async fn second_turns(b: &Front, replicas: &[Replica]) -> Vec<(SocketAddr, u64)> {
    let mut out = Vec::new();
    for i in 0..PREFIXES {
        let r = b.chat(body(i, "second question", 4, false)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        out.push((replica_addr(&r, replicas), cached_tokens(&r)));
    }
    out
}

/// Two instances sharing through `redis`, both subscribed before anything is published
/// (pub/sub keeps no history).
async fn subscribed_pair(addrs: &[SocketAddr], redis: &Redis) -> (Front, Front) {
    let a = Front::start(addrs, Some(redis)).await;
    let b = Front::start(addrs, Some(redis)).await;
    for f in [&a, &b] {
        eventually("subscribed to Redis", Duration::from_secs(20), || async {
            (f.metric("kvrouter_sharing_connected", "role", "subscriber")
                .await
                >= 1.0)
                .then_some(())
        })
        .await;
    }
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_routed_by_one_instance_is_followed_by_its_peer_through_redis() {
    let dir = tempfile::tempdir().unwrap();
    let redis = Redis::start(dir.path()).unwrap();
    let replicas = replicas(dir.path());
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let (a, b) = subscribed_pair(&addrs, &redis).await;

    let picks = first_turns(&a, &replicas).await;
    eventually(
        "B to apply A's decisions",
        Duration::from_secs(20),
        || async {
            let applied = b
                .metric("kvrouter_sharing_received_total", "outcome", "applied")
                .await;
            (applied >= PREFIXES as f64).then_some(())
        },
    )
    .await;
    // A skips its own messages, and B's view now holds each prefix where A sent it.
    assert!(
        a.metric("kvrouter_sharing_received_total", "outcome", "own")
            .await
            >= PREFIXES as f64
    );
    for (i, pick) in picks.iter().enumerate() {
        let e = b.explain(&body(i, "second question", 4, false)).await;
        let matched = candidate_row(&e, *pick)["matched_tokens"].as_u64().unwrap();
        assert!(
            matched >= 300,
            "conversation {i}: B matched {matched} tokens on {pick}: {e}"
        );
    }

    let seconds = second_turns(&b, &replicas).await;
    for (i, ((went, cached), pick)) in seconds.iter().zip(&picks).enumerate() {
        assert_eq!(went, pick, "conversation {i}: B follows A's pick");
        assert!(
            *cached >= 300,
            "conversation {i}: the replica served {cached} cached tokens"
        );
    }
    assert_in_flight_drains(a.router.admin).await;
    assert_in_flight_drains(b.router.admin).await;
    let _ = (&a.dir, &b.dir);
}

/// The negative control: the same traffic without sharing. B has no idea where A sent the
/// prefixes: it matches none of them anywhere, and its second turns are served cold unless
/// they land where A's went by chance. (Where B sends them is down to its tie rule over idle
/// replicas, which spreads them in order as A's concurrent first turns were spread in arrival
/// order: the two coincide often enough that "B did not follow A every time" was a flaky
/// claim; one in six full runs here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sharing_the_peer_does_not_know_where_a_prefix_went() {
    let dir = tempfile::tempdir().unwrap();
    let replicas = replicas(dir.path());
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let a = Front::start(&addrs, None).await;
    let b = Front::start(&addrs, None).await;

    let picks = first_turns(&a, &replicas).await;
    let mut distinct = picks.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= 2,
        "A's concurrent first turns spread over the replicas: {picks:?}"
    );
    for i in 0..PREFIXES {
        let e = b.explain(&body(i, "second question", 4, false)).await;
        for addr in &addrs {
            let matched = candidate_row(&e, *addr)["matched_tokens"].as_u64().unwrap();
            assert_eq!(
                matched, 0,
                "conversation {i}: B believes {addr} holds it: {e}"
            );
        }
    }
    let seconds = second_turns(&b, &replicas).await;
    for (i, ((went, cached), pick)) in seconds.iter().zip(&picks).enumerate() {
        if went != pick {
            assert!(
                *cached < 300,
                "conversation {i}: served {cached} cached tokens on {went}, where A never sent it"
            );
        }
    }
    let _ = (&a.dir, &b.dir);
}

/// Redis paused (a slow Redis: connections hang) and then killed (an outage): every request
/// is still routed by the router and served; the decisions that could not be published are
/// dropped and counted, not queued behind Redis; once Redis is back, B learns A's decisions
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_dead_redis_costs_no_request_and_sharing_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let mut redis = Redis::start(dir.path()).unwrap();
    let replicas = replicas(dir.path());
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let (a, b) = subscribed_pair(&addrs, &redis).await;

    let decisions = |f: &Front| {
        let admin = f.router.admin;
        async move { metric_sum(admin, "kvrouter_decisions_total").await }
    };
    let burst = |from: &Front, tag: &'static str| {
        let client = from.client.clone();
        let addr = from.envoy.addr;
        async move {
            let mut tasks = Vec::new();
            for i in 0..10 {
                let client = client.clone();
                tasks.push(tokio::spawn(async move {
                    post(
                        &client,
                        addr,
                        "/v1/chat/completions",
                        body(100 + i, tag, 2, i % 2 == 0),
                    )
                    .await
                }));
            }
            for t in tasks {
                let r = t.await.unwrap();
                assert_eq!(r.status, 200, "{tag}: {}", r.body);
            }
        }
    };

    for (phase, act) in [("paused", "pause"), ("killed", "kill")] {
        match act {
            "pause" => redis.pause(),
            _ => redis.kill(),
        }
        let before = (decisions(&a).await, decisions(&b).await);
        burst(&a, phase).await;
        burst(&b, phase).await;
        // Every request was decided by its router (not passed through by Envoy).
        assert_eq!(
            decisions(&a).await - before.0,
            10.0,
            "{phase}: A decided each"
        );
        assert_eq!(
            decisions(&b).await - before.1,
            10.0,
            "{phase}: B decided each"
        );
        if act == "pause" {
            redis.resume();
        }
    }
    // While paused or down, what could not be published was dropped and counted.
    let dropped = router_metrics(a.router.admin)
        .await
        .sum("kvrouter_sharing_dropped_total");
    assert!(dropped > 0.0, "A dropped nothing while Redis was away");

    redis.restart().unwrap();
    let applied_before = b
        .metric("kvrouter_sharing_received_total", "outcome", "applied")
        .await;
    // A reconnects on its next decision after its backoff; keep routing through A until B
    // hears of one.
    let mut n = 0;
    eventually(
        "B to learn A's decisions after Redis came back",
        Duration::from_secs(30),
        || {
            n += 1;
            let body = body(200 + n, "after the outage", 1, false);
            let a = &a;
            let b = &b;
            async move {
                let r = a.chat(body).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let applied = b
                    .metric("kvrouter_sharing_received_total", "outcome", "applied")
                    .await;
                (applied > applied_before).then_some(())
            }
        },
    )
    .await;
    assert_in_flight_drains(a.router.admin).await;
    assert_in_flight_drains(b.router.admin).await;
}
