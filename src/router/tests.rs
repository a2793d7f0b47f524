use super::*;
use crate::config::PolicyName;
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

fn chat_with(model: &str, text: &str) -> Vec<u8> {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

const NONE: RouteContext<'static> = RouteContext {
    subset: None,
    tenant: None,
};

#[test]
fn routes_only_to_endpoints_serving_the_model() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    for _ in 0..10 {
        let d = r.decide(&req, NONE).unwrap();
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
    let d = r.decide(&req, NONE).unwrap();
    assert_eq!(d.primary().address, addr(8002));
    assert_eq!(d.plan.endpoints.len(), 1, "only one endpoint serves it");
    assert_eq!(d.plan.adapter.as_deref(), Some("lora-x"));
}

#[test]
fn unknown_model_is_an_error_naming_it() {
    let r = router(CONFIG);
    let body = chat("nope");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let err = r.decide(&req, NONE).unwrap_err();
    assert_eq!(
        err,
        RouteError::UnknownModel {
            model: "nope".into()
        }
    );
    assert_eq!(err.to_string(), "The model `nope` does not exist.");
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
            tenant: None,
        };
        let d = r.decide(&req, ctx).unwrap();
        assert_eq!(d.primary().address, addr(8002));
        assert_eq!(d.plan.endpoints.len(), 1);
    }
    let only_other = [addr(8003)];
    let ctx = RouteContext {
        subset: Some(&only_other),
        tenant: None,
    };
    let err = r.decide(&req, ctx).unwrap_err();
    assert!(matches!(err, RouteError::NoEndpoint { .. }), "{err:?}");
}

#[test]
fn requests_without_a_model_go_to_any_endpoint() {
    let r = router(CONFIG);
    let req = request::parse(ApiKind::Other, b"").unwrap();
    let picks: std::collections::HashSet<SocketAddr> = (0..6)
        .map(|_| r.decide(&req, NONE).unwrap().primary().address)
        .collect();
    assert_eq!(picks.len(), 3, "spread over every endpoint: {picks:?}");
}

#[test]
fn decisions_count_in_flight_until_dropped_and_balance_load() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let held: Vec<Decision> = (0..4).map(|_| r.decide(&req, NONE).unwrap()).collect();
    let set = r.endpoints();
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
    let held = r.decide(&req, NONE).unwrap();
    let held_addr = held.primary().address;
    let mut next = Config::parse_and_validate(CONFIG, "test").unwrap();
    next.policy.name = PolicyName::RoundRobin;
    next.pools[0].endpoints.push(crate::config::EndpointConfig {
        address: "127.0.0.1:8009".into(),
        ..Default::default()
    });
    let change = r.apply(next).unwrap();
    assert_eq!(change.added, vec![addr(8009)]);
    let d = r.decide(&req, NONE).unwrap();
    assert_eq!(d.policy(), "round-robin");
    drop(d);
    let set = r.endpoints();
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
        assert_eq!(r.decide(&req, NONE).unwrap().primary().address, addr(8002));
    }
    let yaml = yaml.replace(
        "      - address: 127.0.0.1:8002\n",
        "      - address: 127.0.0.1:8002\n        drain: true\n",
    );
    r.apply(Config::parse_and_validate(&yaml, "test").unwrap())
        .unwrap();
    let err = r.decide(&req, NONE).unwrap_err();
    assert_eq!(
        err.to_string(),
        "No endpoint is available for model `m`: every endpoint serving it is draining."
    );
}

/// A config with the real SmolLM2 tokenizer from the shared fixture.
fn tokenized(policy: &str, extra: &str) -> Router {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/vllm-0.32-cpu-smollm2")
        .canonicalize()
        .expect("the shared fixture");
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
    let d = r.decide(&first, NONE).unwrap();
    assert!(d.plan.prefix.exact, "tokenized with the real tokenizer");
    assert!(d.plan.prefix.tokens > 400);
    let holder = d.primary().address;
    drop(d);
    for i in 2..6 {
        let body = chat_sys("m", &format!("Where is parcel {i}?"));
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let d = r.decide(&req, NONE).unwrap();
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

#[test]
fn a_hot_prefix_spills_to_other_endpoints_under_load() {
    let r = tokenized("predicted-ttft", "");
    let mut held = Vec::new();
    let mut per_endpoint = std::collections::HashMap::new();
    for i in 0..30 {
        let body = chat_sys("m", &format!("Question {i}"));
        let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
        let d = r.decide(&req, NONE).unwrap();
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
        let d = r.decide(&req, NONE).unwrap();
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
        subset: None,
        tenant: Some(t),
    };
    let d = r.decide(&req, tenant("acme-a")).unwrap();
    drop(d);
    let matched = |ctx| {
        let d = r.plan(&req, ctx).unwrap();
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
    let d = r.plan(&salted, tenant("acme-a")).unwrap();
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
    drop(r.decide(&base, NONE).unwrap());
    let lora = chat_sys("lora-x", "q");
    let lora = request::parse(ApiKind::ChatCompletions, &lora).unwrap();
    let p = r.plan(&lora, NONE).unwrap();
    assert!(
        p.prefix.exact,
        "the adapter uses its base model's tokenizer"
    );
    assert_eq!(
        p.candidates.iter().map(|c| c.matched_tokens).max().unwrap(),
        0
    );
}

#[test]
fn removing_an_endpoint_drops_its_cache_entries() {
    let r = tokenized("prefix-affinity", "");
    let body = chat_sys("m", "q");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let holder = r.decide(&req, NONE).unwrap().primary().clone();
    assert!(r.index().stats().entries > 0);
    let mut config = (*r.config()).clone();
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
    let p = r.plan(&req, NONE).unwrap();
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
    let d = r.decide(&req, NONE).unwrap();
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
    let log = r.decision_log();
    for id in ["a", "b", "c"] {
        log.record(id, e.clone());
    }
    assert_eq!(log.ids(), vec!["b", "c"]);
    assert!(log.get("a").is_none() && log.get("c").is_some());
}
