use std::path::Path;

use super::*;
use crate::config::{PolicyName, ResolvedEndpoint};
use crate::discovery::EndpointSet;
use crate::request::{self, ApiKind};

const CONFIG: &str = r#"
routing: {fallback_endpoints: 1}
policy: {name: least-loaded}
pools:
  - name: a
    models: [m]
    endpoints:
      - address: 127.0.0.1:8001
      - address: 127.0.0.1:8002
        adapters: [lora-x]
  - name: b
    models: [other]
    endpoints:
      - address: 127.0.0.1:8003
"#;

fn router(yaml: &str) -> Router {
    Router::new(
        Config::parse_and_validate(yaml, "test").unwrap(),
        Arc::new(Metrics::new()),
        Path::new("."),
    )
    .unwrap()
}

fn chat(model: &str) -> Vec<u8> {
    chat_with(model, "hello there")
}

/// A streamed chat (as clients stream: its first byte is its first token).
fn chat_with(model: &str, text: &str) -> Vec<u8> {
    serde_json::json!({"model": model, "stream": true, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

const NONE: RouteContext<'static> = RouteContext {
    subset: None,
    tenant: None,
    request_id: "",
    objective: None,
};

/// Decides `req` under the snapshot in force, as a request arriving now would.
fn decide_now(
    r: &Router,
    req: &ParsedRequest<'_>,
    ctx: RouteContext<'_>,
) -> Result<Decision, RouteError> {
    r.decide(&r.snapshot(), req, ctx)
}

/// Plans `req` under the snapshot in force.
fn plan_now(
    r: &Router,
    req: &ParsedRequest<'_>,
    ctx: RouteContext<'_>,
) -> Result<Plan, RouteError> {
    r.plan(&r.snapshot(), req, ctx)
}

fn endpoints(r: &Router) -> Arc<EndpointSet> {
    r.tables.registry.snapshot()
}

fn config(r: &Router) -> Arc<Config> {
    Arc::clone(&r.snapshot().config)
}

/// One request per endpoint and interval is marked for the observer; the others take their
/// first byte at the predicted time, which frees the prefill they queued but not the request.
#[test]
fn one_request_per_interval_is_watched_and_the_rest_free_their_prefill_when_due() {
    let r = router(&CONFIG.replace(
        "routing: {fallback_endpoints: 1}",
        "routing: {fallback_endpoints: 1, observe_interval_ms: 3600000}",
    ));
    let body = chat_with("m", &"a question of some length ".repeat(20));
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let only = [addr(8001)];
    let ctx = RouteContext {
        subset: Some(&only),
        ..NONE
    };
    let mut held: Vec<Decision> = (0..3).map(|_| decide_now(&r, &req, ctx).unwrap()).collect();
    let watched: Vec<bool> = held.iter().map(|d| d.ticket.watched()).collect();
    assert_eq!(watched, [true, false, false], "one per interval");
    for d in &held {
        assert!(
            d.ticket.first_byte_due() > d.ticket.decided_at(),
            "a positive TTFT"
        );
    }
    let ep = endpoints(&r).get(&addr(8001)).cloned().unwrap();
    let before = ep.load.snapshot();
    assert_eq!(before.in_flight_prefilling, 3);
    let uncached = held[1].plan.uncached_tokens();
    assert!(uncached > 0);
    held[1].ticket.on_first_byte_due();
    held[1].ticket.on_first_byte_due(); // idempotent
    let after = ep.load.snapshot();
    assert_eq!(after.in_flight_prefilling, 2);
    assert_eq!(
        after.in_flight_prefill_tokens,
        before.in_flight_prefill_tokens - uncached
    );
    assert_eq!(after.in_flight_requests, 3, "still running: decoding");
    drop(held);
    assert_eq!(ep.load.snapshot().in_flight_requests, 0);

    // A failure counted there: every request is watched until a good response, so the next
    // outcomes decide the breaker as quickly as before.
    r.tables
        .record_outcome(&ep, false, false, &config(&r).health);
    assert!((0..3).all(|_| decide_now(&r, &req, ctx).unwrap().ticket.watched()));
    r.tables
        .record_outcome(&ep, true, false, &config(&r).health);
    assert!(!decide_now(&r, &req, ctx).unwrap().ticket.watched());

    // Another endpoint has an interval of its own; 0 watches every request.
    let other = [addr(8002)];
    let d = decide_now(
        &r,
        &req,
        RouteContext {
            subset: Some(&other),
            ..NONE
        },
    )
    .unwrap();
    assert!(d.ticket.watched());
    let every = router(&CONFIG.replace(
        "routing: {fallback_endpoints: 1}",
        "routing: {fallback_endpoints: 1, observe_interval_ms: 0}",
    ));
    assert!((0..3).all(|_| decide_now(&every, &req, ctx).unwrap().ticket.watched()));
    // Flow control's room needs real first bytes: every request is watched.
    let flow = router(&CONFIG.replace(
        "routing: {fallback_endpoints: 1}",
        "routing: {fallback_endpoints: 1, observe_interval_ms: 3600000}\nflow_control: {enabled: true}",
    ));
    assert!((0..3).all(|_| decide_now(&flow, &req, ctx).unwrap().ticket.watched()));
}

#[test]
fn routes_only_to_endpoints_serving_the_model() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    for _ in 0..10 {
        let d = decide_now(&r, &req, NONE).unwrap();
        assert!([addr(8001), addr(8002)].contains(&d.primary().address));
        let eps = &d.plan.endpoints;
        assert_eq!(eps.len(), 2, "pick + 1 fallback");
        assert_eq!(
            d.destination,
            format!("{},{}", eps[0].address, eps[1].address)
        );
        assert_eq!(d.plan.candidates.len(), 2);
    }
}

#[test]
fn adapter_names_route_to_endpoints_that_serve_the_adapter() {
    let r = router(CONFIG);
    let body = chat("lora-x");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let d = decide_now(&r, &req, NONE).unwrap();
    assert_eq!(d.primary().address, addr(8002));
    assert_eq!(d.plan.endpoints.len(), 1, "only one endpoint serves it");
    assert_eq!(d.plan.adapter.as_deref(), Some("lora-x"));
}

#[test]
fn unknown_model_is_an_error_naming_it() {
    let r = router(CONFIG);
    let body = chat("nope");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let err = decide_now(&r, &req, NONE).unwrap_err();
    assert_eq!(
        err,
        RouteError::UnknownModel {
            model: "nope".into()
        }
    );
    assert_eq!(err.to_string(), "The model `nope` does not exist.");
}

#[test]
fn unknown_model_names_never_become_metric_labels() {
    let metrics = Arc::new(Metrics::new());
    let r = Router::new(
        Config::parse_and_validate(CONFIG, "test").unwrap(),
        Arc::clone(&metrics),
        Path::new("."),
    )
    .unwrap();
    for name in [
        "please summarise Zq7xSECRET for me",
        "Zq7xSECRET-1",
        "Zq7xSECRET-2",
        "m",
    ] {
        let body = chat(name);
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let _ = decide_now(&r, &req, NONE);
    }
    let text = metrics.render(&EndpointSet::default());
    assert!(
        !text.contains("Zq7xSECRET"),
        "a client's model name is a label"
    );
    assert!(
        text.contains(r#"inference_objective_request_total{model_name="(unknown)",target_model_name="(unknown)"} 3"#),
        "the three unknown names share one series"
    );
    assert!(text
        .contains(r#"inference_objective_request_total{model_name="m",target_model_name="m"} 1"#));
}

#[test]
fn subset_hint_restricts_and_can_exclude_everything() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let hint = [addr(8002), addr(8003)];
    for _ in 0..5 {
        let ctx = RouteContext {
            subset: Some(&hint),
            ..NONE
        };
        let d = decide_now(&r, &req, ctx).unwrap();
        assert_eq!(d.primary().address, addr(8002));
        assert_eq!(d.plan.endpoints.len(), 1);
    }
    let only_other = [addr(8003)];
    let ctx = RouteContext {
        subset: Some(&only_other),
        ..NONE
    };
    let err = decide_now(&r, &req, ctx).unwrap_err();
    assert!(matches!(err, RouteError::NoEndpoint { .. }), "{err:?}");
}

#[test]
fn requests_without_a_model_go_to_any_endpoint() {
    let r = router(CONFIG);
    let req = request::parse(ApiKind::Other, b"").unwrap();
    let picks: std::collections::HashSet<SocketAddr> = (0..6)
        .map(|_| decide_now(&r, &req, NONE).unwrap().primary().address)
        .collect();
    assert_eq!(picks.len(), 3, "spread over every endpoint: {picks:?}");
}

#[test]
fn decisions_count_in_flight_until_dropped_and_balance_load() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let held: Vec<Decision> = (0..4)
        .map(|_| decide_now(&r, &req, NONE).unwrap())
        .collect();
    let set = endpoints(&r);
    let loads: Vec<u64> = [8001, 8002]
        .iter()
        .map(|&p| {
            set.get(&addr(p))
                .unwrap()
                .load
                .snapshot()
                .in_flight_requests
        })
        .collect();
    assert_eq!(loads, vec![2, 2], "least-loaded spreads held requests");
    assert!(held.iter().all(|d| d.prompt_tokens() > 0));
    drop(held);
    for p in [8001, 8002] {
        assert_eq!(
            set.get(&addr(p))
                .unwrap()
                .load
                .snapshot()
                .in_flight_requests,
            0
        );
    }
}

#[test]
fn reload_swaps_endpoints_and_policy_but_keeps_in_flight_accounting() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let held = decide_now(&r, &req, NONE).unwrap();
    let held_addr = held.primary().address;
    let mut next = Config::parse_and_validate(CONFIG, "test").unwrap();
    next.policy.name = PolicyName::RoundRobin;
    next.pools[0].endpoints.push(crate::config::EndpointConfig {
        address: "127.0.0.1:8009".into(),
        ..Default::default()
    });
    let change = r.apply(next).unwrap();
    assert_eq!(change.added, vec![addr(8009)]);
    let d = decide_now(&r, &req, NONE).unwrap();
    assert_eq!(d.policy(), "round-robin");
    drop(d);
    let set = endpoints(&r);
    assert_eq!(
        set.get(&held_addr)
            .unwrap()
            .load
            .snapshot()
            .in_flight_requests,
        1
    );
    drop(held);
    assert_eq!(
        set.get(&held_addr)
            .unwrap()
            .load
            .snapshot()
            .in_flight_requests,
        0
    );
}

#[test]
fn draining_endpoints_get_no_new_requests_and_all_draining_is_503() {
    let yaml = CONFIG.replace(
        "      - address: 127.0.0.1:8001\n",
        "      - address: 127.0.0.1:8001\n        drain: true\n",
    );
    let r = router(&yaml);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    for _ in 0..4 {
        assert_eq!(
            decide_now(&r, &req, NONE).unwrap().primary().address,
            addr(8002)
        );
    }
    let yaml = yaml.replace(
        "      - address: 127.0.0.1:8002\n",
        "      - address: 127.0.0.1:8002\n        drain: true\n",
    );
    r.apply(Config::parse_and_validate(&yaml, "test").unwrap())
        .unwrap();
    let err = decide_now(&r, &req, NONE).unwrap_err();
    assert_eq!(
        err.to_string(),
        "No endpoint is available for model `m`: every endpoint serving it is draining."
    );
}

/// A config with the real SmolLM2 tokenizer from the shared fixture.
fn tokenized(policy: &str, extra: &str) -> Router {
    let fixture = crate::prefix::tests::fixture_dir();
    router(&format!(
        "policy: {{name: {policy}}}\n{extra}\nmodels: [{{name: m, tokenizer: \"{}\"}}]\npools: [{{name: a, models: [m], adapters: [lora-x], endpoints: [{{address: '127.0.0.1:8001'}}, {{address: '127.0.0.1:8002'}}, {{address: '127.0.0.1:8003'}}]}}]",
        fixture.display()
    ))
}

fn system_prompt() -> String {
    "You are a careful assistant for a logistics company. ".repeat(40)
}

fn chat_sys(model: &str, question: &str) -> Vec<u8> {
    serde_json::json!({"model": model, "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": question}]})
    .to_string()
    .into_bytes()
}

#[test]
fn repeated_system_prompt_goes_where_it_is_cached() {
    let r = tokenized("predicted-ttft", "");
    let first_body = chat_sys("m", "Where is parcel 1?");
    let first = request::parse(ApiKind::ChatCompletions, &first_body).unwrap();
    let d = decide_now(&r, &first, NONE).unwrap();
    assert!(d.plan.prefix.exact, "tokenized with the real tokenizer");
    assert!(d.plan.prefix.tokens > 400);
    let holder = d.primary().address;
    drop(d);
    for i in 2..6 {
        let body = chat_sys("m", &format!("Where is parcel {i}?"));
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let d = decide_now(&r, &req, NONE).unwrap();
        assert_eq!(
            d.primary().address,
            holder,
            "request {i} follows the cached prefix"
        );
        let pick = &d.plan.candidates[d.plan.ranking.pick()];
        assert!(
            pick.matched_tokens >= 400,
            "system prompt matched: {}",
            pick.matched_tokens
        );
        let others: Vec<u64> = d
            .plan
            .candidates
            .iter()
            .filter(|c| c.address != holder)
            .map(|c| c.matched_tokens)
            .collect();
        assert!(others.iter().all(|&m| m == 0), "{others:?}");
    }
}

/// A decision made before the new turn was tokenized predicts only the prefix on its pick;
/// finishing the rest predicts the whole prompt there, which the conversation's next turn
/// finds (with predictions only, nothing else would tell the router).
#[test]
fn finishing_a_deferred_prompt_predicts_its_new_turn_on_the_pick() {
    let r = tokenized("predicted-ttft", "");
    let turn = |messages: serde_json::Value| {
        serde_json::json!({"model": "m", "messages": messages})
            .to_string()
            .into_bytes()
    };
    let question = "Where is parcel 7, and which depots has it passed through so far? ".repeat(4);
    let first_body = turn(serde_json::json!([
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": question}]));
    let first = request::parse(ApiKind::ChatCompletions, &first_body).unwrap();
    let mut d = decide_now(&r, &first, NONE).unwrap();
    assert_eq!(d.plan.prefix.source(), "tokens-deferred");
    let rest = d
        .rest
        .take()
        .expect("the question is left for after the decision");
    let pick = d.primary().address;
    drop(d);

    let second_body = turn(serde_json::json!([
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "It is in Lyon."},
        {"role": "user", "content": "Thanks. When will it arrive?"}]));
    let second = request::parse(ApiKind::ChatCompletions, &second_body).unwrap();
    let matched_on_pick = |r: &Router| {
        let plan = plan_now(r, &second, NONE).unwrap();
        let i = plan
            .candidates
            .iter()
            .position(|c| c.address == pick)
            .unwrap();
        plan.candidates[i].matched_tokens
    };
    let before = matched_on_pick(&r);
    rest.finish();
    let after = matched_on_pick(&r);
    assert!(
        before >= 400,
        "the system prompt was predicted at the decision: {before}"
    );
    assert!(
        after >= before + 48,
        "the first question's blocks are predicted too: {before} -> {after}"
    );
}

/// The index ages a routed prompt's blocks as its engine does: a prompt still queued there
/// pushes no prefix out of the index (its engine has stored nothing of it yet); once it is
/// prefilled, the least recently used blocks past the capacity go, but never those of a
/// request still running there (the engine cannot evict them); when a request ends, its
/// blocks are the most recent.
#[test]
fn the_index_evicts_a_prompt_only_once_it_is_prefilled_and_its_request_ended() {
    let r = tokenized("predicted-ttft", "");
    let only = [addr(8001)];
    let ctx = RouteContext {
        subset: Some(&only),
        ..NONE
    };
    let body = |opening: &str| {
        serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": format!("{opening} {}", system_prompt())},
            {"role": "user", "content": "Where is parcel 1?"}]})
        .to_string()
        .into_bytes()
    };
    let (a_body, b_body) = (body("Alpha."), body("Bravo."));
    let a_req = request::parse(ApiKind::ChatCompletions, &a_body).unwrap();
    let b_req = request::parse(ApiKind::ChatCompletions, &b_body).unwrap();
    let mut a = decide_now(&r, &a_req, ctx).unwrap();
    let id = a.primary().id;
    let held = |hashes: &[u64]| r.tables.index.lookup(hashes, &[id])[0].blocks as usize;
    let stats = || r.tables.index.stats().endpoints[id as usize];
    let a_hashes = a.plan.prefix.block_hashes.clone();
    let n = a_hashes.len();
    assert!(n > 20, "{n} blocks");
    // Room for A and 5 blocks more; A is prefilled and runs: all of it is pinned.
    r.tables.index.set_capacity(id, n + 5).unwrap();
    a.ticket.on_first_byte(Instant::now());
    assert_eq!(held(&a_hashes), n);
    assert_eq!(stats().pinned_blocks, n);
    drop(a);
    assert_eq!(stats().pinned_blocks, 0, "A ended");
    // B is routed there and queued: all of both is held.
    let mut b = decide_now(&r, &b_req, ctx).unwrap();
    let b_hashes = b.plan.prefix.block_hashes.clone();
    assert_eq!(b.plan.candidates[0].matched_tokens, 0, "nothing shared");
    assert!(b_hashes.len() > 10);
    assert_eq!((held(&a_hashes), held(&b_hashes)), (n, b_hashes.len()));
    // B is prefilled: it takes the room of A's least recently used blocks (its tail).
    b.ticket.on_first_byte(Instant::now());
    assert_eq!(held(&b_hashes), b_hashes.len());
    assert_eq!(held(&a_hashes), n + 5 - b_hashes.len());
    // A again, queued while B runs: its evicted tail is predicted again and pending; dropped
    // before its first byte (it ended), it settles, and what goes is A's own tail again: B's
    // blocks are pinned while B runs (its engine could not evict them).
    let c = decide_now(&r, &a_req, ctx).unwrap();
    assert_eq!((held(&a_hashes), held(&b_hashes)), (n, b_hashes.len()));
    drop(c);
    assert_eq!(
        (held(&a_hashes), held(&b_hashes)),
        (n + 5 - b_hashes.len(), b_hashes.len())
    );
    // B ends: its blocks become the most recent, and the next prompt pushes out A's first.
    drop(b);
    assert_eq!((stats().pending_blocks, stats().pinned_blocks), (0, 0));
    let d = decide_now(&r, &a_req, ctx).unwrap();
    drop(d);
    assert_eq!((held(&a_hashes), held(&b_hashes)), (n, 5));
}

#[test]
fn a_hot_prefix_spills_to_other_endpoints_under_load() {
    let r = tokenized("predicted-ttft", "");
    let mut held = Vec::new();
    let mut per_endpoint = std::collections::HashMap::new();
    for i in 0..30 {
        let body = chat_sys("m", &format!("Question {i}"));
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let d = decide_now(&r, &req, NONE).unwrap();
        *per_endpoint.entry(d.primary().address).or_insert(0) += 1;
        held.push(d); // none finishes: the holder's queue grows
    }
    assert_eq!(
        per_endpoint.len(),
        3,
        "spilled to every endpoint: {per_endpoint:?}"
    );
    let max = *per_endpoint.values().max().unwrap();
    assert!(
        max < 25,
        "no endpoint takes almost everything: {per_endpoint:?}"
    );
}

#[test]
fn prefix_affinity_melts_where_predicted_ttft_spills() {
    let r = tokenized("prefix-affinity", "");
    let mut held = Vec::new();
    let mut picks = std::collections::HashSet::new();
    for i in 0..20 {
        let body = chat_sys("m", &format!("Question {i}"));
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let d = decide_now(&r, &req, NONE).unwrap();
        picks.insert(d.primary().address);
        held.push(d);
    }
    assert_eq!(picks.len(), 1, "the naive baseline piles onto the holder");
}

#[test]
fn tenants_never_share_prefixes_unless_grouped() {
    let r = tokenized(
        "prefix-affinity",
        "tenancy: {header: x-tenant, share_groups: [{name: acme, tenants: [acme-a, acme-b]}]}",
    );
    let body = chat_sys("m", "q");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let tenant = |t: &'static str| RouteContext {
        tenant: Some(t),
        ..NONE
    };
    let d = decide_now(&r, &req, tenant("acme-a")).unwrap();
    drop(d);
    let matched = |ctx| {
        let d = plan_now(&r, &req, ctx).unwrap();
        d.candidates.iter().map(|c| c.matched_tokens).max().unwrap()
    };
    assert!(matched(tenant("acme-b")) > 0, "same share group");
    assert_eq!(matched(tenant("globex")), 0, "another tenant");
    assert_eq!(matched(NONE), 0, "no tenant");
    // vLLM's cache_salt separates too.
    let salted = serde_json::json!({"model": "m", "cache_salt": "s1", "messages": [
        {"role": "system", "content": system_prompt()}, {"role": "user", "content": "q"}]})
    .to_string();
    let salted = request::parse(ApiKind::ChatCompletions, salted.as_bytes()).unwrap();
    let d = plan_now(&r, &salted, tenant("acme-a")).unwrap();
    assert_eq!(
        d.candidates.iter().map(|c| c.matched_tokens).max().unwrap(),
        0
    );
}

#[test]
fn adapters_do_not_share_the_base_models_prefixes() {
    let r = tokenized("prefix-affinity", "");
    let base = chat_sys("m", "q");
    let base = request::parse(ApiKind::ChatCompletions, &base).unwrap();
    drop(decide_now(&r, &base, NONE).unwrap());
    let lora = chat_sys("lora-x", "q");
    let lora = request::parse(ApiKind::ChatCompletions, &lora).unwrap();
    let p = plan_now(&r, &lora, NONE).unwrap();
    assert!(
        p.prefix.exact,
        "the adapter uses its base model's tokenizer"
    );
    assert_eq!(
        p.candidates.iter().map(|c| c.matched_tokens).max().unwrap(),
        0
    );
}

/// A group's prefix evicted from its home: with homes priced (`recall_weight`) its next
/// request goes home and is recomputed there, though the home is the busier (a request
/// decoding); without, it goes to a lighter replica and the group gets a second home. The
/// default prices homes.
#[test]
fn an_evicted_prefix_goes_back_to_its_home_when_homes_are_priced() {
    for (weight, goes_home) in [(Some(0.0), false), (Some(1.0), true), (None, true)] {
        let policy = match weight {
            Some(w) => format!("predicted-ttft, predicted_ttft: {{recall_weight: {w}}}"),
            None => "predicted-ttft".to_owned(),
        };
        let r = tokenized(&policy, "");
        let first = chat_sys("m", "Where is parcel 1?");
        let req = request::parse(ApiKind::ChatCompletions, &first).unwrap();
        let home = decide_now(&r, &req, NONE).unwrap().primary().clone();
        // The engine evicts the prefix; the home gets some other work.
        r.tables.index.clear_endpoint(home.id);
        let other = chat_with("m", "unrelated");
        let only = [home.address];
        let mut busy = decide_now(
            &r,
            &request::parse(ApiKind::ChatCompletions, &other).unwrap(),
            RouteContext {
                subset: Some(&only),
                ..NONE
            },
        )
        .unwrap();
        // Past its first byte: decoding, nothing queued (the home is busier, not slower).
        busy.ticket.on_first_byte_due();
        let next = chat_sys("m", "Where is parcel 2?");
        let req = request::parse(ApiKind::ChatCompletions, &next).unwrap();
        let d = decide_now(&r, &req, NONE).unwrap();
        assert!(
            d.plan.candidates.iter().all(|c| c.matched_tokens == 0),
            "held nowhere"
        );
        let recalled: Vec<u64> = d
            .plan
            .candidates
            .iter()
            .map(|c| c.recalled_tokens)
            .collect();
        let at_home = recalled[d
            .plan
            .candidates
            .iter()
            .position(|c| c.address == home.address)
            .unwrap()];
        if goes_home {
            assert!(at_home >= 400, "the system prompt's home: {recalled:?}");
            assert_eq!(recalled.iter().filter(|&&t| t > 0).count(), 1);
        } else {
            assert!(
                recalled.iter().all(|&t| t == 0),
                "not looked up: {recalled:?}"
            );
        }
        assert_eq!(
            d.primary().address == home.address,
            goes_home,
            "weight {weight:?}: {:?}",
            d.plan.ranking.scores
        );
        drop(busy);
    }
}

#[test]
fn removing_an_endpoint_drops_its_cache_entries() {
    let r = tokenized("prefix-affinity", "");
    let body = chat_sys("m", "q");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let holder = decide_now(&r, &req, NONE).unwrap().primary().clone();
    assert!(r.tables.index.stats().entries > 0);
    let mut config = (*config(&r)).clone();
    config.pools[0]
        .endpoints
        .retain(|e| e.address != holder.address.to_string());
    r.apply(config.clone()).unwrap();
    // Put it back: it must not remember anything.
    config.pools[0]
        .endpoints
        .push(crate::config::EndpointConfig {
            address: holder.address.to_string(),
            ..Default::default()
        });
    r.apply(config).unwrap();
    let p = plan_now(&r, &req, NONE).unwrap();
    assert_eq!(
        p.candidates.iter().map(|c| c.matched_tokens).max().unwrap(),
        0
    );
}

#[test]
fn explanations_show_the_breakdown_but_never_the_prompt() {
    let r = tokenized("predicted-ttft", "debug: {record_decisions: 2}");
    let body = chat_sys("m", "The secret word is xylophone-42.");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let d = decide_now(&r, &req, NONE).unwrap();
    let e = d.plan.explain();
    assert_eq!(e.candidates.len(), 3);
    assert_eq!(e.pick, d.primary().address_str.to_string());
    assert!(e.candidates.iter().all(|c| c.predicted_ttft_ms.is_some()));
    let text = e.to_text();
    let json = serde_json::to_string(&e).unwrap();
    for shown in [&text, &json] {
        assert!(!shown.contains("xylophone"), "prompt text leaked: {shown}");
        assert!(!shown.contains("logistics"), "prompt text leaked: {shown}");
        assert!(shown.contains("127.0.0.1:8001"));
    }
    assert!(
        text.contains("predicted-ttft") && text.contains("pick "),
        "{text}"
    );
    // The decision log keeps the last two by request id.
    let log = &r.tables.decisions;
    for id in ["a", "b", "c"] {
        log.record(id, e.clone());
    }
    assert_eq!(log.ids(), vec!["b", "c"]);
    assert!(log.get("a").is_none() && log.get("c").is_some());
}

mod signals {
    //! Health, scraped engine signals, staleness and learned speeds in the decision.
    use super::*;
    use crate::discovery::Endpoint;
    use crate::health::BreakerState;
    use crate::load::{EngineSample, TtftContext};
    use std::time::Duration;
    use tokio::time::Instant;

    const THREE: &str = r#"
routing: {fallback_endpoints: 2}
policy: {name: least-loaded}
pools:
  - name: a
    models: [m]
    endpoints:
      - address: 127.0.0.1:8001
      - address: 127.0.0.1:8002
      - address: 127.0.0.1:8003
"#;

    fn sample(waiting: u64, capacity: Option<u64>) -> EngineSample {
        EngineSample {
            waiting_requests: waiting,
            running_requests: 2,
            kv_cache_usage: 0.3,
            capacity_tokens: capacity,
            block_size_tokens: Some(16),
            lora: None,
            cpu_offload_bytes: None,
            cpu_loaded: None,
            scraped_at: Instant::now(),
        }
    }

    fn eject(r: &Router, port: u16) {
        let ep = endpoints(r).get(&addr(port)).cloned().unwrap();
        let cfg = config(r);
        for _ in 0..cfg.health.probe.failure_threshold {
            ep.health.record_probe(false, &cfg.health);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn unhealthy_endpoints_are_never_picked_only_trail_the_fallbacks_and_all_down_is_503() {
        let r = router(THREE);
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        eject(&r, 8002);
        for _ in 0..6 {
            let d = decide_now(&r, &req, NONE).unwrap();
            assert_ne!(d.primary().address, addr(8002));
            let eps: Vec<SocketAddr> = d.plan.endpoints.iter().map(|e| e.address).collect();
            assert_eq!(eps.len(), 3);
            assert_eq!(eps[2], addr(8002), "last resort, after the healthy ones");
            assert_eq!(d.plan.candidates.len(), 2);
            assert_eq!(d.plan.explain().unhealthy, vec!["127.0.0.1:8002"]);
        }
        eject(&r, 8001);
        eject(&r, 8003);
        let err = decide_now(&r, &req, NONE).unwrap_err();
        assert_eq!(
            err.to_string(),
            "No endpoint is available for model `m`: every endpoint serving it is unhealthy."
        );
        // One comes back: traffic resumes.
        let ep = endpoints(&r).get(&addr(8003)).cloned().unwrap();
        let cfg = config(&r);
        for _ in 0..cfg.health.probe.success_threshold {
            ep.health.record_probe(true, &cfg.health);
        }
        assert_eq!(
            decide_now(&r, &req, NONE).unwrap().primary().address,
            addr(8003)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_half_open_endpoint_takes_one_trial_request_at_a_time() {
        let r = router(&format!("{THREE}\nhealth: {{breaker: {{open_ms: 1000}}}}"));
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let ep = endpoints(&r).get(&addr(8001)).cloned().unwrap();
        for _ in 0..3 {
            r.tables
                .record_outcome(&ep, false, false, &config(&r).health);
        }
        let picks = |n: usize| -> Vec<Decision> {
            (0..n)
                .map(|_| decide_now(&r, &req, NONE).unwrap())
                .collect()
        };
        assert!(
            picks(4).iter().all(|d| d.primary().address != addr(8001)),
            "open"
        );
        tokio::time::advance(Duration::from_millis(1000)).await;
        // Least-loaded: the idle half-open endpoint is the best pick, but only once at a time.
        let held = picks(4);
        let trials: Vec<&Decision> = held
            .iter()
            .filter(|d| d.primary().address == addr(8001))
            .collect();
        assert_eq!(trials.len(), 1);
        assert!(trials[0].ticket.trial.is_some());
        assert!(trials[0].plan.explain().candidates.iter().any(|c| c.trial));
        drop(held);
        // Two good trials close it.
        let only = [addr(8001)];
        let ctx = RouteContext {
            subset: Some(&only),
            ..NONE
        };
        for _ in 0..2 {
            let d = decide_now(&r, &req, ctx).unwrap();
            assert!(d.ticket.trial.is_some());
            // The second comes within the first's watch interval: watched for being a trial.
            assert!(
                d.ticket.watched(),
                "its outcome closes or reopens the breaker"
            );
            r.tables.record_outcome(&ep, true, true, &config(&r).health);
        }
        let held = picks(6);
        assert_eq!(
            held.iter()
                .filter(|d| d.primary().address == addr(8001))
                .count(),
            2,
            "closed: its fair share"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn fresh_engine_signals_reach_the_policy_and_stale_ones_are_recorded_as_such() {
        let r = router(&format!(
            "{THREE}\nload: {{scrape: {{staleness_ms: 2000}}}}"
        ));
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let set = endpoints(&r);
        for p in [8001, 8002, 8003] {
            set.get(&addr(p))
                .unwrap()
                .load
                .engine
                .store(sample(u64::from(p - 8000), None));
        }
        let plan = plan_now(&r, &req, NONE).unwrap();
        assert!(!plan.stale_signals());
        let e = plan.explain();
        assert!(!e.stale_signals);
        for c in &plan.candidates {
            let w = c.engine.expect("fresh").waiting_requests;
            assert_eq!(w, u64::from(c.address.port() - 8000));
        }
        assert!(e
            .candidates
            .iter()
            .all(|c| c.engine_signal == "fresh" && c.engine_waiting_requests.is_some()));

        tokio::time::advance(Duration::from_millis(2500)).await;
        set.get(&addr(8001))
            .unwrap()
            .load
            .engine
            .store(sample(0, None));
        let d = decide_now(&r, &req, NONE).unwrap();
        assert!(d.plan.stale_signals());
        let e = d.plan.explain();
        let row = |port: u16| {
            e.candidates
                .iter()
                .find(|c| c.endpoint == addr(port).to_string())
                .unwrap()
        };
        assert_eq!(row(8001).engine_signal, "fresh");
        assert_eq!(
            (
                row(8002).engine_signal.as_str(),
                row(8002).engine_waiting_requests
            ),
            ("stale", None)
        );
        assert_eq!(row(8002).engine_age_ms, Some(2500));
        assert!(e.to_text().contains("stale engine signals"));
        let text = r.tables.metrics.render(&endpoints(&r));
        assert!(
            text.contains("kvrouter_decisions_on_stale_signals_total{policy=\"least-loaded\"} 1"),
            "{text}"
        );

        // Scraping off: nothing is expected, nothing is degraded.
        let r = router(&format!("{THREE}\nload: {{scrape: {{enabled: false}}}}"));
        let plan = plan_now(&r, &req, NONE).unwrap();
        assert!(!plan.stale_signals());
        assert!(plan.signals.iter().all(|s| s.engine == "not-scraped"));
        assert!(plan.candidates.iter().all(|c| c.engine.is_none()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_learned_speed_replaces_the_configured_one_after_enough_samples() {
        let yaml = THREE
            .replace("least-loaded", "predicted-ttft")
            .replace(
                "    models: [m]\n",
                "    models: [m]\n    prefill_tokens_per_s: 20000\n",
            )
            .replace(
                "policy:",
                "load: {learning: {ttft_residual: true}}\npolicy:",
            );
        let r = router(&yaml);
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let ep = endpoints(&r).get(&addr(8002)).cloned().unwrap();
        let cfg = config(&r);
        let ctx = TtftContext {
            work_tokens: 4000,
            ahead_elapsed_ms: 0.0,
            fixed_ms: 0.0,
            predicted_ms: 200.0,
            engine_waiting: None,
            tier_load: false,
        };
        for i in 0..cfg.load.learning.min_samples {
            let plan = plan_now(&r, &req, NONE).unwrap();
            let i_ep = plan
                .candidates
                .iter()
                .position(|c| c.address == addr(8002))
                .unwrap();
            assert_eq!(plan.signals[i_ep].prefill_speed, "configured", "sample {i}");
            // This replica is four times slower than configured: 4000 tokens in 800 ms.
            ep.load
                .learned
                .observe(&ctx, 800.0, &cfg.load.learning, Instant::now());
        }
        let plan = plan_now(&r, &req, NONE).unwrap();
        let c = plan
            .candidates
            .iter()
            .find(|c| c.address == addr(8002))
            .unwrap();
        assert_eq!(c.prefill_tokens_per_s, 5000.0);
        assert!(c.ttft_residual_ms > 500.0, "{}", c.ttft_residual_ms);
        let row = plan
            .explain()
            .candidates
            .into_iter()
            .find(|c| c.endpoint == "127.0.0.1:8002")
            .unwrap();
        assert_eq!(row.prefill_speed_source, "learned");
        assert_ne!(
            plan.primary().address,
            addr(8002),
            "the slow replica is not picked"
        );
        // The decision hands the observer what it needs to learn from the first byte.
        let d = decide_now(&r, &req, NONE).unwrap();
        let ttft = d.ticket.ttft.as_ref().expect("a prediction to learn from");
        assert!(ttft.predicted_ms > 0.0);
        assert_eq!(ttft.work_tokens, d.plan.uncached_tokens());
        assert_eq!(ttft.ahead_elapsed_ms, 0.0, "nothing was ahead of it");
        // A request decided 150 ms after the one ahead of it began prefilling there learns
        // over the span from that start: the whole of the prompt ahead was prefilled in it.
        // (The third replica gets a long prompt at the same instant, so either is behind one.)
        let pick = d.primary().address;
        let set = endpoints(&r);
        let _third = set.get(&addr(8003)).unwrap().load.begin(3000);
        tokio::time::advance(std::time::Duration::from_millis(150)).await;
        let behind = decide_now(&r, &req, NONE).unwrap();
        let ctx = behind.ticket.ttft.as_ref().unwrap();
        assert_eq!(ctx.ahead_elapsed_ms, 150.0);
        let ahead = if behind.primary().address == pick {
            d.plan.uncached_tokens()
        } else {
            3000
        };
        assert_eq!(ctx.work_tokens, ahead + behind.plan.uncached_tokens());
        assert_eq!(
            set.get(&behind.primary().address)
                .unwrap()
                .load
                .prefill_head_elapsed_ms(),
            150.0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_streamed_answers_first_byte_teaches_and_only_a_2xx_one() {
        // A non-streamed answer's first byte comes after its whole generation, and an error
        // body (a 400 for a prompt over the context) at once: neither times the prefill.
        let r = router(&format!(
            "{THREE}\nload: {{learning: {{ttft_residual: true}}}}\nflow_control: {{enabled: true}}"
        ));
        let cfg = config(&r);
        let samples = |ep: &Endpoint| {
            let s = ep
                .load
                .learned
                .snapshot(&cfg.load.learning, tokio::time::Instant::now());
            (s.speed_samples, s.residual_samples)
        };
        let plain =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                .to_string();
        let plain = request::parse(ApiKind::ChatCompletions, plain.as_bytes()).unwrap();
        let streamed = chat("m");
        let streamed = request::parse(ApiKind::ChatCompletions, &streamed).unwrap();
        let ok = |d: &Decision| ResponseFacts {
            status: Some(200),
            served: Some(d.primary().address),
            attempts: Some(1),
        };

        // Not streamed: watched (flow control on), yet its prefill is taken as done when due,
        // and its first byte teaches nothing.
        let mut d = decide_now(&r, &plain, NONE).unwrap();
        assert!(d.ticket.watched());
        assert!(d.ticket.first_byte_predicted());
        let pick = Arc::clone(d.primary());
        let before = samples(&pick);
        d.ticket.on_response_headers(ok(&d));
        d.ticket.on_first_byte_due();
        assert_eq!(
            pick.load.snapshot().in_flight_prefilling,
            0,
            "taken as prefilled"
        );
        tokio::time::advance(std::time::Duration::from_secs(8)).await;
        d.ticket.on_first_byte(std::time::Instant::now());
        assert_eq!(
            samples(&pick),
            before,
            "nothing learned from the whole answer"
        );
        drop(d);

        // Streamed, answered 400 at once: nothing learned either.
        let mut d = decide_now(&r, &streamed, NONE).unwrap();
        assert!(!d.ticket.first_byte_predicted(), "its observer reports it");
        let pick = Arc::clone(d.primary());
        let before = samples(&pick);
        d.ticket.on_response_headers(ResponseFacts {
            status: Some(400),
            ..ok(&d)
        });
        d.ticket.on_first_byte(std::time::Instant::now());
        assert_eq!(samples(&pick), before, "an error body is no prefill");
        drop(d);

        // Streamed and answered: learned from.
        let mut d = decide_now(&r, &streamed, NONE).unwrap();
        let pick = Arc::clone(d.primary());
        let before = samples(&pick);
        d.ticket.on_response_headers(ok(&d));
        tokio::time::advance(std::time::Duration::from_millis(200)).await;
        d.ticket.on_first_byte(std::time::Instant::now());
        // (A prompt this short teaches the residual; its speed only when prefill dominates.)
        assert_eq!(samples(&pick).1, before.1 + 1, "learned from");
    }

    #[tokio::test(start_paused = true)]
    async fn the_ticket_applies_response_facts_to_health_load_and_learning() {
        let r = router(&format!(
            "{THREE}\nload: {{learning: {{ttft_residual: true}}}}"
        ));
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let cfg = config(&r);
        let samples = |ep: &Endpoint| {
            ep.load
                .learned
                .snapshot(&cfg.load.learning, tokio::time::Instant::now())
                .residual_samples
        };
        let in_flight = |ep: &Endpoint| ep.load.snapshot().in_flight_requests;
        // One request held on each of the others: least-loaded picks 8001 every round.
        let set = endpoints(&r);
        let _held: Vec<_> = [8002, 8003]
            .iter()
            .map(|&p| set.get(&addr(p)).unwrap().load.begin(0))
            .collect();
        for round in 0..cfg.health.breaker.failure_threshold {
            let Decision { plan, ticket, .. } = decide_now(&r, &req, NONE).unwrap();
            let mut ticket = ticket;
            let (pick, fallback) = (
                Arc::clone(&plan.endpoints[0]),
                Arc::clone(&plan.endpoints[1]),
            );
            assert_eq!(pick.address, addr(8001));
            assert_eq!((in_flight(&pick), in_flight(&fallback)), (1, 1));
            // Envoy tried the pick, then served the request from the first fallback.
            ticket.on_response_headers(ResponseFacts {
                status: Some(200),
                served: Some(fallback.address),
                attempts: Some(2),
            });
            assert_eq!(ticket.endpoint(), &*fallback.address_str, "round {round}");
            assert_eq!(
                (in_flight(&pick), in_flight(&fallback)),
                (0, 2),
                "load moved"
            );
            assert!(ticket.ttft.is_none() && ticket.trial.is_none());
            let before = samples(&fallback);
            ticket.on_first_byte(std::time::Instant::now());
            assert_eq!(fallback.load.snapshot().in_flight_prefill_tokens, 0);
            assert_eq!(samples(&fallback), before, "the prediction was the pick's");
            drop(ticket);
            assert_eq!(
                in_flight(&fallback),
                1,
                "released once, where it was counted"
            );
            let state = pick
                .health
                .snapshot(tokio::time::Instant::now(), &cfg.health);
            let opened = round + 1 == cfg.health.breaker.failure_threshold;
            assert_eq!(state.breaker == BreakerState::Open, opened, "round {round}");
        }
        // The pick serves its own request: its first byte teaches it.
        let Decision { plan, ticket, .. } = decide_now(&r, &req, NONE).unwrap();
        let mut ticket = ticket;
        let pick = Arc::clone(plan.primary());
        assert_ne!(pick.address, addr(8001), "open");
        let before = samples(&pick);
        ticket.on_response_headers(ResponseFacts {
            status: Some(200),
            served: Some(pick.address),
            attempts: Some(1),
        });
        ticket.on_first_byte(std::time::Instant::now());
        assert_eq!(samples(&pick), before + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_response_is_judged_by_the_config_its_request_was_routed_under() {
        let strict = format!("{THREE}\nhealth: {{breaker: {{failure_threshold: 1}}}}");
        let r = router(&strict);
        let body = chat("m");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let mut held = decide_now(&r, &req, NONE).unwrap();
        let pick = Arc::clone(held.primary());
        // Reloaded while the request runs: the breaker now tolerates five failures.
        r.apply(Config::parse_and_validate(&strict.replace("1}}", "5}}"), "t").unwrap())
            .unwrap();
        assert_eq!(config(&r).health.breaker.failure_threshold, 5);
        held.ticket.on_response_headers(ResponseFacts {
            status: Some(503),
            served: None,
            attempts: None,
        });
        let now = tokio::time::Instant::now();
        assert_eq!(
            pick.health.snapshot(now, &config(&r).health).breaker,
            BreakerState::Open,
            "one failure opens it, as the request's own config says"
        );
    }

    #[test]
    fn any_source_removing_an_endpoint_drops_its_cache_entries() {
        let r = tokenized("prefix-affinity", "");
        let discovered = ResolvedEndpoint::new(addr(9001), "a", &["m"]);
        let sink = r.handles().discovery;
        let change = sink.publish("dns:x", vec![discovered]);
        assert_eq!(change.added, vec![addr(9001)]);
        let body = chat_sys("m", "q");
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let subset = [addr(9001)];
        let ctx = RouteContext {
            subset: Some(&subset),
            ..NONE
        };
        drop(decide_now(&r, &req, ctx).unwrap());
        let id = endpoints(&r).get(&addr(9001)).unwrap().id;
        let held = |r: &Router| {
            r.tables
                .index
                .stats()
                .endpoints
                .iter()
                .find(|e| e.endpoint == id)
                .map_or(0, |e| e.blocks)
        };
        assert!(held(&r) > 0);
        let change = sink.remove("dns:x");
        assert_eq!(change.removed, vec![addr(9001)]);
        assert_eq!(held(&r), 0);
    }

    #[test]
    fn the_engines_reported_capacity_sizes_the_index_unless_configured() {
        let r = router(THREE);
        let set = endpoints(&r);
        let ep = set.get(&addr(8001)).unwrap();
        ep.load.engine.store(sample(0, Some(16 * 1000)));
        r.handles().capacity.engine_capacity_changed(ep);
        let capacity = |r: &Router, id| {
            r.tables
                .index
                .stats()
                .endpoints
                .iter()
                .find(|e| e.endpoint == id)
                .map(|e| e.capacity_blocks)
        };
        assert_eq!(
            capacity(&r, ep.id),
            Some(1000),
            "16,000 tokens in 16-token blocks"
        );
        let configured = THREE.replace(
            "      - address: 127.0.0.1:8001\n",
            "      - address: 127.0.0.1:8001\n        cache_capacity_tokens: 3200\n",
        );
        r.apply(Config::parse_and_validate(&configured, "t").unwrap())
            .unwrap();
        let ep = endpoints(&r).get(&addr(8001)).cloned().unwrap();
        r.handles().capacity.engine_capacity_changed(&ep);
        assert_eq!(capacity(&r, ep.id), Some(200), "the config wins");

        // An engine reporting absurd capacity is held to `max_engine_capacity_tokens`.
        let ep3 = endpoints(&r).get(&addr(8003)).cloned().unwrap();
        ep3.load.engine.store(sample(0, Some(u64::MAX)));
        r.handles().capacity.engine_capacity_changed(&ep3);
        let max_tokens = config(&r).cache_index.max_engine_capacity_tokens;
        assert_eq!(capacity(&r, ep3.id), Some((max_tokens / 16) as usize));
    }
}

/// A peer instance's decision (`sharing`) is recorded as our own would be: a prediction on the
/// named endpoint that lasts the prediction TTL less the message's age; a message as old as the
/// TTL, or naming an endpoint this instance does not have, records nothing.
#[tokio::test(start_paused = true)]
async fn a_peer_decision_is_a_prediction_for_what_is_left_of_its_ttl() {
    use crate::sharing::PeerOutcome;
    use std::time::Duration;
    let r = router(&format!(
        "{CONFIG}\ncache_index: {{prediction_ttl_ms: 10000}}"
    ));
    let peers = r.handles().peers;
    let id = endpoints(&r).get(&addr(8001)).unwrap().id;
    let blocks = |hashes: &[u64]| r.tables.index.lookup(hashes, &[id])[0].blocks;

    let fresh = [11u64, 12, 13];
    assert_eq!(
        peers.apply(addr(8001), &fresh, Duration::ZERO),
        PeerOutcome::Applied
    );
    let aged = [21u64, 22];
    assert_eq!(
        peers.apply(addr(8001), &aged, Duration::from_secs(6)),
        PeerOutcome::Applied
    );
    assert_eq!((blocks(&fresh), blocks(&aged)), (3, 2));
    // 4 s later the aged one (6 s old when it came) has expired; the fresh one holds until 10 s.
    tokio::time::advance(Duration::from_millis(4_100)).await;
    assert_eq!((blocks(&fresh), blocks(&aged)), (3, 0));
    tokio::time::advance(Duration::from_secs(6)).await;
    assert_eq!(blocks(&fresh), 0);

    let old = [31u64];
    assert_eq!(
        peers.apply(addr(8001), &old, Duration::from_secs(10)),
        PeerOutcome::Stale
    );
    assert_eq!(blocks(&old), 0);
    assert_eq!(
        peers.apply(addr(9999), &old, Duration::ZERO),
        PeerOutcome::UnknownEndpoint
    );
}

/// A decision puts only its pick and fallbacks in rank order (ordering hundreds of candidates
/// is work nobody reads); explaining it still lists every candidate once, the ranked ones
/// first, the others by score; with the decision log on, every candidate is ranked.
#[test]
fn a_decision_ranks_its_pick_and_fallbacks_and_an_explanation_every_candidate() {
    let list: String = (1..=6)
        .map(|p| format!("{{address: '127.0.0.1:{}'}}, ", 8000 + p))
        .collect();
    let yaml = |extra: &str| {
        format!(
            "routing: {{fallback_endpoints: 1}}\npolicy: {{name: predicted-ttft}}\n{extra}\npools: [{{name: a, models: [m], endpoints: [{list}]}}]"
        )
    };
    let r = router(&yaml(""));
    // Tickets held on some endpoints, so the candidates' costs differ.
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let held: Vec<Decision> = (0..4)
        .map(|_| decide_now(&r, &req, NONE).unwrap())
        .collect();
    let d = decide_now(&r, &req, NONE).unwrap();
    assert_eq!(d.plan.request.ranked, 2, "the pick and one fallback");
    assert_eq!(d.plan.endpoints.len(), 2);
    let e = d.plan.explain();
    let shown: Vec<&str> = e.candidates.iter().map(|c| c.endpoint.as_str()).collect();
    let mut sorted = shown.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 6, "every candidate once: {shown:?}");
    assert_eq!(e.pick, d.primary().address_str.to_string());
    assert_eq!(shown[0], e.pick);
    assert_eq!(vec![shown[1].to_string()], e.fallbacks);
    let tail: Vec<f64> = e.candidates[2..].iter().map(|c| c.score.unwrap()).collect();
    assert!(tail.windows(2).all(|w| w[0] >= w[1]), "{tail:?}");
    assert!(e.candidates.iter().enumerate().all(|(i, c)| c.rank == i));
    drop(held);

    let logged = router(&yaml("debug: {record_decisions: 2}"));
    let d = decide_now(&logged, &req, NONE).unwrap();
    assert_eq!(
        d.plan.request.ranked, 0,
        "explained: every candidate ranked"
    );
    assert_eq!(d.plan.ranking.order.len(), 6);
    // And an explanation asked for ranks every candidate too.
    let p = plan_now(&r, &req, NONE).unwrap();
    assert_eq!(p.request.ranked, 0);
}
