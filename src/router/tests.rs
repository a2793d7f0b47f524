use super::*;
use crate::request::{self, ApiKind};

const CONFIG: &str = r#"
routing: {fallback_endpoints: 1}
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
    )
}

fn chat(model: &str) -> Vec<u8> {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello there"}}]}}"#)
        .into_bytes()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn routes_only_to_endpoints_serving_the_model() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    for _ in 0..10 {
        let d = r.decide(&req, None).unwrap();
        assert!([addr(8001), addr(8002)].contains(&d.primary().address));
        assert_eq!(d.endpoints.len(), 2, "pick + 1 fallback");
        assert_eq!(
            d.destination,
            format!("{},{}", d.endpoints[0].address, d.endpoints[1].address)
        );
        assert_eq!(d.candidates.len(), 2);
    }
}

#[test]
fn adapter_names_route_to_endpoints_that_serve_the_adapter() {
    let r = router(CONFIG);
    let body = chat("lora-x");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let d = r.decide(&req, None).unwrap();
    assert_eq!(d.primary().address, addr(8002));
    assert_eq!(d.endpoints.len(), 1, "only one endpoint serves it");
}

#[test]
fn unknown_model_is_an_error_naming_it() {
    let r = router(CONFIG);
    let body = chat("nope");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let err = r.decide(&req, None).unwrap_err();
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
    for _ in 0..5 {
        let d = r.decide(&req, Some(&[addr(8002), addr(8003)])).unwrap();
        assert_eq!(d.primary().address, addr(8002));
        assert_eq!(d.endpoints.len(), 1);
    }
    let err = r.decide(&req, Some(&[addr(8003)])).unwrap_err();
    assert!(matches!(err, RouteError::NoEndpoint { .. }), "{err:?}");
}

#[test]
fn requests_without_a_model_go_to_any_endpoint() {
    let r = router(CONFIG);
    let req = request::parse(ApiKind::Other, b"").unwrap();
    let picks: std::collections::HashSet<SocketAddr> = (0..6)
        .map(|_| r.decide(&req, None).unwrap().primary().address)
        .collect();
    assert_eq!(picks.len(), 3, "spread over every endpoint: {picks:?}");
}

#[test]
fn decisions_count_in_flight_until_dropped_and_balance_load() {
    let r = router(CONFIG);
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let held: Vec<Decision> = (0..4).map(|_| r.decide(&req, None).unwrap()).collect();
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
    assert!(held.iter().all(|d| d.prompt_tokens > 0));
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
    let held = r.decide(&req, None).unwrap();
    let held_addr = held.primary().address;
    let mut next = Config::parse_and_validate(CONFIG, "test").unwrap();
    next.policy.name = crate::config::PolicyName::RoundRobin;
    next.pools[0].endpoints.push(crate::config::EndpointConfig {
        address: "127.0.0.1:8009".into(),
        ..Default::default()
    });
    let change = r.apply(next);
    assert_eq!(change.added, vec![addr(8009)]);
    let d = r.decide(&req, None).unwrap();
    assert_eq!(d.policy, "round-robin");
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
        assert_eq!(r.decide(&req, None).unwrap().primary().address, addr(8002));
    }
    let yaml = yaml.replace(
        "      - address: 127.0.0.1:8002\n",
        "      - address: 127.0.0.1:8002\n        drain: true\n",
    );
    r.apply(Config::parse_and_validate(&yaml, "test").unwrap());
    let err = r.decide(&req, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "No endpoint is available for model `m`: every endpoint serving it is draining."
    );
}
