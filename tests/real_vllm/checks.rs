//! The routing checks of issue 14 against the real engine (short prompts, repeats, a bypassed
//! prefix) and what every check shares. Each check returns a one-line summary with its numbers,
//! or panics with what went wrong; `faults` holds the kill and restart checks, `kvsim` the
//! comparison with the simulator.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use testkit::eventually;

use crate::fleet::{chat, long_system, Answer, Fleet, SILENCE_TIMEOUT_MS};

pub const CHAT: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";

/// Tokens of `long_system` that any two prompts opening with it share in whole engine blocks.
pub const SHARED_PREFIX_TOKENS: u64 = 512;

/// How long KV events may take to reach kvrouter and show in its tables.
pub const EVENTS_LAG: Duration = Duration::from_secs(30);

/// The replica Envoy says served `a`.
pub fn upstream(f: &Fleet, a: &Answer) -> SocketAddr {
    let up = a.upstream.as_deref().expect("x-kvrouter-upstream header");
    let addr: SocketAddr = up.parse().unwrap_or_else(|_| panic!("upstream {up:?}"));
    assert!(f.addrs.contains(&addr), "upstream {addr} is not a replica");
    addr
}

/// "X" or "Y".
pub fn name(f: &Fleet, addr: SocketAddr) -> &str {
    if addr == f.addrs[0] {
        "X"
    } else {
        "Y"
    }
}

/// Check 4 of issue 14: Traffic of short prompts (under one 128-token engine block: the engine
/// stores no block and publishes no event) never distrusts a healthy engine's events. Pairs of
/// concurrent chats for three silence timeouts, both replicas served; after every pair, no
/// endpoint's KV-event state may have turned `distrusted` (one distrusted before the traffic is
/// noted, not blamed on it), and kvrouter may log no silence.
pub async fn short_prompts_never_distrust(f: &Fleet, phase: &str) -> String {
    let mut before = Vec::new();
    for addr in f.addrs {
        let e = eventually(
            "the engine block size from the scrape",
            Duration::from_secs(30),
            || async move {
                let e = f.endpoint(addr).await;
                (e["engine"]["block_size_tokens"] == 128).then_some(e)
            },
        )
        .await;
        println!(
            "  {phase}: {} before: kv events {}({}), engine block {} tokens (scraped), {} from events",
            name(f, addr),
            e["kv_events"]["state"],
            e["kv_events"]["reason"],
            e["engine"]["block_size_tokens"],
            e["kv_events"]["engine_block_size_tokens"],
        );
        before.push(f.events_state(addr).await);
    }
    let silent_before = f.router_log_count("silent while expected");
    let window = Duration::from_millis(3 * SILENCE_TIMEOUT_MS);
    let started = Instant::now();
    let mut served: BTreeMap<&str, u32> = BTreeMap::new();
    let mut prompt_tokens = (u64::MAX, 0);
    let mut distrusted: Vec<String> = Vec::new();
    let mut sent = 0u32;
    while sent < 20 || started.elapsed() < window {
        let bodies = [sent, sent + 1].map(|i| {
            chat(
                "You are a terse assistant of a freight company.",
                &format!("Question {i}: what is {i} plus {i}?"),
                2,
            )
        });
        let (a, b) = tokio::join!(
            f.via_envoy(CHAT, &bodies[0], None),
            f.via_envoy(CHAT, &bodies[1], None)
        );
        sent += 2;
        for a in [a, b] {
            assert_eq!(a.status, 200, "{}", a.body);
            assert!(
                (16..128).contains(&a.prompt_tokens),
                "a short chat is at least one of kvrouter's 16-token blocks and under one engine block: {} tokens",
                a.prompt_tokens
            );
            assert_eq!(a.cached_tokens, 0, "no whole block, nothing cached");
            prompt_tokens = (
                prompt_tokens.0.min(a.prompt_tokens),
                prompt_tokens.1.max(a.prompt_tokens),
            );
            *served.entry(name(f, upstream(f, &a))).or_default() += 1;
        }
        for (addr, was) in f.addrs.iter().zip(&before) {
            let (state, reason) = f.events_state(*addr).await;
            if state == "distrusted" && (was.0 != "distrusted" || reason == "silent") {
                distrusted.push(format!(
                    "{} {state}({reason}) after {sent} chats, {:.1} s",
                    name(f, *addr),
                    started.elapsed().as_secs_f64()
                ));
            }
        }
    }
    let silent_logged = f.router_log_count("silent while expected") - silent_before;
    let already: Vec<String> = f
        .addrs
        .iter()
        .zip(&before)
        .filter(|(_, (s, _))| s == "distrusted")
        .map(|(a, (s, r))| format!(" ({} was {s}({r}) before)", name(f, *a)))
        .collect();
    let summary = format!(
        "{phase}{}: {sent} short chats ({}-{} prompt tokens, 0 cached) over {:.1} s (silence timeout {} s), served {served:?}",
        already.concat(),
        prompt_tokens.0,
        prompt_tokens.1,
        started.elapsed().as_secs_f64(),
        SILENCE_TIMEOUT_MS / 1000,
    );
    assert_eq!(
        served.len(),
        2,
        "both replicas must see short chats: {summary}"
    );
    assert!(
        distrusted.is_empty() && silent_logged == 0,
        "{summary}; healthy engines distrusted: {} observations (first: {:?}, last: {:?}), \
         {silent_logged} 'kv events: silent while expected' log lines. The silence detector \
         expected an event for prompts shorter than one engine block (it ignores the scraped \
         block size until a BlockStored arrives)",
        distrusted.len(),
        distrusted.first(),
        distrusted.last(),
    );
    format!("{summary}; no endpoint distrusted, no silence logged")
}

/// Check 1 of issue 14: Repeats of a prefix go to the replica that holds it (whose events confirm
/// it) and are served from its cache.
pub async fn repeats_go_to_the_holder(f: &Fleet) -> String {
    let system = long_system("repeats");
    let first = f
        .via_envoy(CHAT, &chat(&system, "Where is parcel 0?", 4), None)
        .await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.cached_tokens, 0, "a new prefix");
    assert!(
        first.prompt_tokens > SHARED_PREFIX_TOKENS + 64,
        "{}",
        first.prompt_tokens
    );
    let holder = upstream(f, &first);
    let probe = chat(&system, "Where is parcel 1?", 4);
    let e = eventually(
        "the holder's events to confirm the prefix",
        EVENTS_LAG,
        || async {
            let e = f.explain(&probe).await;
            let row = Fleet::row(&e, holder);
            (row["confirmed_tokens"].as_u64() >= Some(SHARED_PREFIX_TOKENS)
                && row["cache_source"] == "events")
                .then_some(e)
        },
    )
    .await;
    assert_eq!(e["pick"], holder.to_string(), "{e}");
    let confirmed = Fleet::row(&e, holder)["confirmed_tokens"].clone();
    let mut cached = Vec::new();
    for i in 1..=6 {
        let body = chat(&system, &format!("Where is parcel {i}?"), 4);
        let a = f.via_envoy(CHAT, &body, None).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(upstream(f, &a), holder, "repeat {i} left the holder");
        assert!(
            a.cached_tokens >= SHARED_PREFIX_TOKENS && a.cached_tokens % 128 == 0,
            "repeat {i}: {} cached tokens",
            a.cached_tokens
        );
        cached.push(a.cached_tokens);
    }
    assert_eq!(cached.len(), 6);
    format!(
        "first request ({} prompt tokens) went to {}, whose events then confirmed {confirmed} \
         tokens (cache source events); 6/6 repeats went to {} with cached_tokens {cached:?}",
        first.prompt_tokens,
        name(f, holder),
        name(f, holder),
    )
}

/// Check 2 of issue 14: A prefix sent straight to Y (bypassing the router) is found through Y's KV
/// events: the explanation and the recorded decision show the matched tokens with cache source
/// `events`, the next request with that prefix goes to Y, and Y serves it from cache.
pub async fn bypassed_prefix_found_through_events(f: &Fleet) -> String {
    let (x, y) = (f.addrs[0], f.addrs[1]);
    let system = long_system("bypass");
    let direct = f
        .direct(y, CHAT, &chat(&system, "A question sent straight to Y.", 4))
        .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    let probe = chat(&system, "A question through the router.", 4);
    let learned = Instant::now();
    let e = eventually("Y's events to show the prefix", EVENTS_LAG, || async {
        let e = f.explain(&probe).await;
        (Fleet::row(&e, y)["confirmed_tokens"].as_u64() >= Some(SHARED_PREFIX_TOKENS)).then_some(e)
    })
    .await;
    let learned_ms = learned.elapsed().as_millis();
    assert_eq!(Fleet::row(&e, y)["cache_source"], "events", "{e}");
    assert_eq!(
        Fleet::row(&e, x)["matched_tokens"],
        0,
        "X never saw it: {e}"
    );
    assert_eq!(e["pick"], y.to_string(), "{e}");
    let id = "real-vllm-bypass";
    let routed = f.via_envoy(CHAT, &probe, Some(id)).await;
    assert_eq!(routed.status, 200, "{}", routed.body);
    assert_eq!(upstream(f, &routed), y);
    assert!(
        routed.cached_tokens >= SHARED_PREFIX_TOKENS,
        "Y served it from cache: {}",
        routed.cached_tokens
    );
    let d = f.decision(id).await;
    assert_eq!(d["pick"], y.to_string(), "{d}");
    let row = Fleet::row(&d, y);
    assert_eq!(row["cache_source"], "events", "{d}");
    assert!(
        row["matched_tokens"].as_u64() >= Some(SHARED_PREFIX_TOKENS),
        "{d}"
    );
    assert!(
        row["confirmed_tokens"].as_u64() >= Some(SHARED_PREFIX_TOKENS),
        "{d}"
    );
    format!(
        "{} prompt tokens sent straight to Y; within {learned_ms} ms /debug/explain showed {} \
         confirmed tokens on Y (X: 0); the routed request's decision: pick Y, matched {} \
         tokens, confirmed {}, cache source {}; Y reported cached_tokens {}",
        direct.prompt_tokens,
        Fleet::row(&e, y)["confirmed_tokens"],
        row["matched_tokens"],
        row["confirmed_tokens"],
        row["cache_source"],
        routed.cached_tokens,
    )
}

/// Warm start (issue 14): a kvrouter started after X cached prefixes learns X's blocks from its
/// replay socket (vLLM's `replay_endpoint`) within seconds, with a complete view; one started
/// at the same moment without it knows none of them (no traffic meanwhile).
pub async fn a_late_router_learns_from_the_replay_socket(f: &Fleet) -> String {
    let x = f.addrs[0];
    let blocks = |e: &serde_json::Value| e["kv_events"]["engine_blocks"].as_u64().unwrap_or(0);
    let held = blocks(&f.endpoint(x).await);
    assert!(
        held > 0,
        "the router under test tracks no engine blocks of X: the earlier checks should have filled it"
    );
    let started = Instant::now();
    let late = f.start_late_router(true);
    let plain = f.start_late_router(false);
    let seen = eventually(
        "the late router's view of X, from the replay socket",
        EVENTS_LAG,
        || async {
            let n = blocks(&f.endpoint_at(late.admin, x).await);
            (n >= held).then_some(n)
        },
    )
    .await;
    let took = started.elapsed();
    let with = f.endpoint_at(late.admin, x).await;
    let without = f.endpoint_at(plain.admin, x).await;
    assert_eq!(
        seen, held,
        "the replay gave exactly the blocks the running router tracks"
    );
    assert_eq!(
        with["kv_events"]["state"], "trusted",
        "a replay from sequence 0 is a complete view: {with}"
    );
    assert_eq!(
        blocks(&without),
        0,
        "without the replay socket nothing stored before it started is known: {without}"
    );
    format!(
        "late router with replay knew X's {seen} engine blocks (trusted) {:.1} s after its start; \
         the one without replay knew 0 (state {})",
        took.as_secs_f64(),
        without["kv_events"]["state"]
    )
}
