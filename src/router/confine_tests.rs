use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use crate::config::Config;
use crate::request::{self, ApiKind};
use crate::router::{RouteContext, RouteError, Router};
use crate::telemetry::Metrics;

/// Three pools serving `m`: one open to all, one per tenant; a second model on a confined pool.
const POOLS: &str = r#"
routing: {fallback_endpoints: 5}
policy: {name: least-loaded}
tenancy: {header: x-tenant-id}
pools:
  - name: shared
    models: [m]
    endpoints: [{address: 127.0.0.1:8001}]
  - name: acme-dedicated
    models: [m, acme-model]
    tenants: [acme]
    endpoints: [{address: 127.0.0.1:8002}, {address: 127.0.0.1:8003}]
  - name: globex-dedicated
    models: [m]
    tenants: [globex, globex-staging]
    endpoints: [{address: 127.0.0.1:8004}]
"#;

/// Endpoints labelled by pool and per endpoint; objectives requiring labels.
const LABELS: &str = r#"
routing: {fallback_endpoints: 5}
policy: {name: least-loaded}
flow_control:
  objectives:
    - {name: h100, required_labels: {hardware: h100}}
    - {name: h100-rev-b, priority: 1, required_labels: {hardware: h100, revision: b}}
    - {name: a100, required_labels: {hardware: a100}}
    - {name: a100-or-any, required_labels: {hardware: a100}, unmatched: any}
    - {name: plain, priority: 2}
pools:
  - name: gpu
    models: [m]
    labels: {hardware: h100, revision: a}
    endpoints:
      - address: 127.0.0.1:8001
      - address: 127.0.0.1:8002
        labels: {revision: b}
  - name: small
    models: [m]
    labels: {hardware: l4}
    endpoints:
      - address: 127.0.0.1:8003
        labels: {hardware: l4-24gb}
"#;

const SECRET: &str = "Zq7xCONFINExSECRET";

fn router(yaml: &str) -> Router {
    Router::new(
        Config::parse_and_validate(yaml, "test").unwrap(),
        Arc::new(Metrics::new()),
        Path::new("."),
    )
    .unwrap()
}

fn chat(model: &str) -> Vec<u8> {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": SECRET}]})
        .to_string()
        .into_bytes()
}

fn ports(list: &[u16]) -> BTreeSet<SocketAddr> {
    list.iter()
        .map(|&p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect()
}

/// Every endpoint a plan for `model` under `ctx` would send to (pick and fallbacks), or its
/// error.
fn reachable(
    r: &Router,
    model: &str,
    ctx: RouteContext<'_>,
) -> Result<BTreeSet<SocketAddr>, RouteError> {
    let body = chat(model);
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let plan = r.plan(&r.snapshot(), &req, ctx)?;
    let candidates: BTreeSet<SocketAddr> = plan.candidates.iter().map(|c| c.address).collect();
    let listed: BTreeSet<SocketAddr> = plan.endpoints.iter().map(|e| e.address).collect();
    assert_eq!(candidates, listed, "fallbacks come from the candidates");
    Ok(listed)
}

fn tenant(t: &str) -> RouteContext<'_> {
    RouteContext {
        tenant: Some(t),
        ..RouteContext::default()
    }
}

fn objective(o: &str) -> RouteContext<'_> {
    RouteContext {
        objective: Some(o),
        ..RouteContext::default()
    }
}

#[test]
fn a_tenant_is_routed_only_to_the_pools_it_may_use() {
    let r = router(POOLS);
    let cases: [(RouteContext<'_>, &[u16]); 5] = [
        (tenant("acme"), &[8001, 8002, 8003]),
        (tenant("globex"), &[8001, 8004]),
        (tenant("globex-staging"), &[8001, 8004]),
        (tenant("initech"), &[8001]),
        (RouteContext::default(), &[8001]),
    ];
    for (ctx, want) in cases {
        assert_eq!(
            reachable(&r, "m", ctx).unwrap(),
            ports(want),
            "{:?}",
            ctx.tenant
        );
    }
    assert_eq!(
        reachable(&r, "acme-model", tenant("acme")).unwrap(),
        ports(&[8002, 8003])
    );
}

#[test]
fn a_tenant_with_no_pool_for_the_model_gets_a_403_without_the_prompt() {
    let r = router(POOLS);
    for ctx in [tenant("globex"), tenant("initech"), RouteContext::default()] {
        let err = reachable(&r, "acme-model", ctx).unwrap_err();
        assert_eq!(
            err,
            RouteError::TenantNotAllowed {
                model: "acme-model".into()
            }
        );
        let message = err.to_string();
        assert!(
            !message.contains(SECRET) && !message.contains("initech"),
            "{message}"
        );
    }
    // An unknown model stays a 404, whatever the tenant.
    assert!(matches!(
        reachable(&r, "nope", tenant("acme")),
        Err(RouteError::UnknownModel { .. })
    ));
}

#[test]
fn a_reload_that_confines_a_pool_applies_to_the_next_request() {
    let r = router(POOLS);
    assert_eq!(
        reachable(&r, "m", tenant("initech")).unwrap(),
        ports(&[8001])
    );
    let opened = POOLS.replace("tenants: [globex, globex-staging]", "tenants: [initech]");
    r.apply(Config::parse_and_validate(&opened, "test").unwrap())
        .unwrap();
    assert_eq!(
        reachable(&r, "m", tenant("initech")).unwrap(),
        ports(&[8001, 8004])
    );
    assert_eq!(
        reachable(&r, "m", tenant("globex")).unwrap(),
        ports(&[8001])
    );
}

#[test]
fn an_objective_narrows_candidates_to_endpoints_with_its_labels() {
    let r = router(LABELS);
    let cases: [(RouteContext<'_>, &[u16]); 5] = [
        (objective("h100"), &[8001, 8002]),
        (objective("h100-rev-b"), &[8002]),
        (objective("a100-or-any"), &[8001, 8002, 8003]),
        (objective("plain"), &[8001, 8002, 8003]),
        (RouteContext::default(), &[8001, 8002, 8003]),
    ];
    for (ctx, want) in cases {
        assert_eq!(
            reachable(&r, "m", ctx).unwrap(),
            ports(want),
            "{:?}",
            ctx.objective
        );
    }
}

#[test]
fn an_objective_whose_labels_no_endpoint_has_is_refused_by_default() {
    let r = router(LABELS);
    let err = reachable(&r, "m", objective("a100")).unwrap_err();
    assert_eq!(
        err,
        RouteError::NoLabeledEndpoint {
            model: "m".into(),
            objective: "a100".into()
        }
    );
    assert!(!err.to_string().contains(SECRET));
}

#[test]
fn only_configured_objectives_reach_routing() {
    let config = Config::parse_and_validate(LABELS, "test").unwrap();
    let header = |value: &'static str| {
        move |name: &str| (name == "x-llm-d-inference-objective").then_some(value)
    };
    let known = crate::flow::Labels::from_headers(&config.flow_control, None, header("h100"));
    assert_eq!(known.objective.as_deref(), Some("h100"));
    let unknown = crate::flow::Labels::from_headers(&config.flow_control, None, header("made-up"));
    assert_eq!(unknown.objective, None);
    assert_eq!(unknown.priority, config.flow_control.default_priority);
}

#[test]
fn pool_tenants_and_labels_are_validated_with_their_paths() {
    let endpoint = "endpoints: [{address: '127.0.0.1:1'}]";
    let cases = [
        (
            format!("pools: [{{name: a, models: [m], tenants: [acme], {endpoint}}}]"),
            "pools[0].tenants: needs tenancy.header",
        ),
        (
            format!(
                "tenancy: {{header: x-t}}\npools: [{{name: a, models: [m], tenants: [acme, acme], {endpoint}}}]"
            ),
            "pools[0].tenants[1]: \"acme\" is listed twice",
        ),
        (
            format!(
                "tenancy: {{header: x-t}}\npools: [{{name: a, models: [m], tenants: [''], {endpoint}}}]"
            ),
            "pools[0].tenants[0]: must not be empty",
        ),
        (
            format!("pools: [{{name: a, models: [m], labels: {{'': x}}, {endpoint}}}]"),
            "pools[0].labels: a label name must not be empty",
        ),
        (
            format!(
                "flow_control: {{objectives: [{{name: o, required_labels: {{' ': x}}}}]}}\npools: [{{name: a, models: [m], {endpoint}}}]"
            ),
            "flow_control.objectives[0].required_labels: a label name must not be empty",
        ),
    ];
    for (yaml, want) in cases {
        let err = Config::parse_and_validate(&yaml, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{yaml}\n{err}");
    }
    // Unknown fields are errors, as everywhere.
    for yaml in [
        format!("pools: [{{name: a, models: [m], tenant: [acme], {endpoint}}}]"),
        "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1', label: {a: b}}]}]"
            .to_string(),
        format!("flow_control: {{objectives: [{{name: o, requires: {{a: b}}}}]}}\npools: [{{name: a, models: [m], {endpoint}}}]"),
        format!("flow_control: {{objectives: [{{name: o, unmatched: maybe}}]}}\npools: [{{name: a, models: [m], {endpoint}}}]"),
    ] {
        assert!(Config::parse_and_validate(&yaml, "test").is_err(), "{yaml}");
    }
}

#[test]
fn a_request_read_across_a_reload_reaches_no_pool_its_snapshot_does_not_know() {
    // The request's snapshot is taken at its headers; a reload that adds a confined pool
    // before its body is decided publishes the new endpoints first. Its old rules cannot say
    // whom the new pool admits, so it admits nobody from that snapshot.
    let before = POOLS.replace(
        "  - name: acme-dedicated\n    models: [m, acme-model]\n    tenants: [acme]\n    endpoints: [{address: 127.0.0.1:8002}, {address: 127.0.0.1:8003}]\n",
        "",
    );
    assert!(!before.contains("acme-dedicated"), "the pool was cut out");
    let r = router(&before);
    let old = r.snapshot();
    r.apply(Config::parse_and_validate(POOLS, "test").unwrap())
        .unwrap();
    let body = chat("m");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    let listed = |ctx| -> Result<BTreeSet<SocketAddr>, RouteError> {
        let plan = r.plan(&old, &req, ctx)?;
        Ok(plan.endpoints.iter().map(|e| e.address).collect())
    };
    assert_eq!(listed(tenant("initech")).unwrap(), ports(&[8001]));
    assert_eq!(listed(tenant("acme")).unwrap(), ports(&[8001]));
    let body = chat("acme-model");
    let req = request::parse(ApiKind::ChatCompletions, &body).unwrap();
    match r.plan(&old, &req, tenant("initech")) {
        Err(RouteError::NoEndpoint { .. }) => {}
        other => panic!("{:?}", other.map(|p| p.endpoints.len())),
    }
    // Under the new snapshot the rules apply as configured.
    let new = r.snapshot();
    assert!(matches!(
        r.plan(&new, &req, tenant("initech")),
        Err(RouteError::TenantNotAllowed { .. })
    ));
}
