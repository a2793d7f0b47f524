//! The admin HTTP server: liveness, readiness, Prometheus metrics and JSON views of the router's
//! tables, through the router's read-only [`AdminView`]. Nothing here exposes prompt text.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router as HttpRouter};
use serde_json::json;

use crate::router::{AdminView, RouteContext};

/// Why explaining as a tenant was refused (no admin token configured).
pub const TENANT_EXPLAIN_REFUSED: &str = "explaining as a tenant needs admin.auth_token_file \
     (without a token it would tell anyone how much of another tenant's prefix each replica holds)";

/// Shared state of the admin handlers.
#[derive(Debug, Clone)]
pub struct Admin {
    view: AdminView,
    ready: Arc<AtomicBool>,
    tenant_explain: bool,
}

impl Admin {
    /// Admin over the router's `view`; `/readyz` answers 200 once `ready` is set.
    pub fn new(view: AdminView, ready: Arc<AtomicBool>) -> Admin {
        Admin {
            view,
            ready,
            tenant_explain: false,
        }
    }

    /// Whether `/debug/explain?tenant=...` answers. It tells how much of another tenant's
    /// prefix each replica holds, so it is off unless the admin routes require a token
    /// (`admin.auth_token_file`). Default false.
    pub fn with_tenant_explain(mut self, allowed: bool) -> Admin {
        self.tenant_explain = allowed;
        self
    }

    /// The HTTP routes.
    pub fn routes(self) -> HttpRouter {
        HttpRouter::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .route("/debug/endpoints", get(endpoints))
            .route("/debug/flow", get(flow))
            .route("/debug/explain", axum::routing::post(explain))
            .route("/debug/decisions", get(decisions))
            .route("/debug/decisions/{id}", get(decision))
            .with_state(self)
    }
}

async fn readyz(State(admin): State<Admin>) -> Response {
    if admin.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(admin): State<Admin>) -> Response {
    let text = admin.view.metrics_text();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn endpoints(State(admin): State<Admin>) -> Json<serde_json::Value> {
    let set = admin.view.endpoints();
    let state = admin.view.snapshot();
    let config = &state.config;
    let now = tokio::time::Instant::now();
    let staleness = std::time::Duration::from_millis(config.load.scrape.staleness_ms);
    let events: std::collections::HashMap<_, _> = admin
        .view
        .kv_events()
        .into_iter()
        .map(|s| (s.id, s))
        .collect();
    let endpoints: Vec<_> = set
        .all()
        .iter()
        .map(|ep| {
            let engine = ep.load.engine.last();
            let kv_events = events.get(&ep.id).map(|s| {
                json!({
                    "state": s.state.label(),
                    "attach": s.attach.kind(),
                    "source": s.state.source(),
                    "reason": s.state.reason().map(|r| r.as_str()),
                    "topic": s.topic,
                    "messages": s.counters.messages,
                    "events": s.counters.events,
                    "gaps": s.counters.gaps,
                    "restarts": s.counters.restarts,
                    "engine_blocks": s.engine_blocks,
                    "engine_block_size_tokens": s.engine_block_size_tokens,
                })
            });
            json!({
                "address": ep.address_str.as_ref(),
                "pool": ep.pool.as_ref(),
                "source": ep.source.as_ref(),
                "engine_kind": ep.engine.as_str(),
                "models": ep.models,
                "adapters": ep.adapters,
                "weight": ep.weight,
                "max_in_flight": ep.max_in_flight,
                "draining": ep.draining,
                "load": ep.load.snapshot(),
                "engine": engine.as_deref(),
                "engine_signal": ep.load.engine.signal(now, staleness).as_str(),
                "engine_age_ms": engine.map(|s| now.saturating_duration_since(s.scraped_at).as_millis() as u64),
                "learned": ep.load.learned.snapshot(&config.load.learning, now),
                "health": ep.health.snapshot(now, &config.health),
                "kv_events": kv_events,
            })
        })
        .collect();
    Json(json!({
        "version": set.version,
        "policy": config.policy.name.as_str(),
        "endpoints": endpoints,
        "flow_control": flow_json(&admin),
    }))
}

/// The admission queues: per model, requests and bytes queued, tokens admitted but not yet
/// routed, and per (priority, flow) depth and fairness counter.
async fn flow(State(admin): State<Admin>) -> Json<serde_json::Value> {
    Json(flow_json(&admin))
}

fn flow_json(admin: &Admin) -> serde_json::Value {
    let state = admin.view.snapshot();
    let f = &state.config.flow_control;
    json!({
        "enabled": f.enabled,
        "max_queue_requests": f.max_queue_requests,
        "max_queue_bytes": f.max_queue_bytes,
        "max_wait_ms": f.max_wait_ms,
        "models": admin.view.flow(),
    })
}

/// Query of `POST /debug/explain`.
#[derive(Debug, serde::Deserialize)]
struct ExplainQuery {
    /// The request path the body is for. Default `/v1/chat/completions`.
    path: Option<String>,
    /// The tenant, as the tenancy header would carry it.
    tenant: Option<String>,
}

/// Runs the decision pipeline on the posted request body against the live tables, without
/// routing anything, and returns the breakdown.
async fn explain(
    State(admin): State<Admin>,
    Query(q): Query<ExplainQuery>,
    body: Bytes,
) -> Response {
    if q.tenant.is_some() && !admin.tenant_explain {
        let message = TENANT_EXPLAIN_REFUSED;
        return (StatusCode::FORBIDDEN, Json(json!({"error": message}))).into_response();
    }
    let view = admin.view.clone();
    let result = tokio::task::spawn_blocking(move || {
        let path = q.path.as_deref().unwrap_or("/v1/chat/completions");
        let api = crate::request::ApiKind::from_path(path);
        let parsed = crate::request::parse(api, &body)
            .map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
        let ctx = RouteContext {
            tenant: q.tenant.as_deref(),
            ..RouteContext::default()
        };
        view.explain(&parsed, ctx)
            .map_err(|e| (StatusCode::NOT_FOUND, e.to_string()))
    })
    .await;
    match result {
        Ok(Ok(explanation)) => Json(explanation).into_response(),
        Ok(Err((status, message))) => (status, Json(json!({"error": message}))).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn decisions(State(admin): State<Admin>) -> Json<serde_json::Value> {
    let log = admin.view.decisions();
    Json(json!({"recording": log.enabled(), "request_ids": log.ids()}))
}

async fn decision(State(admin): State<Admin>, Path(id): Path<String>) -> Response {
    match admin.view.decisions().get(&id) {
        Some(e) => Json(e).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("no decision recorded for request id {id:?} (debug.record_decisions keeps the most recent ones)")})),
        )
            .into_response(),
    }
}
