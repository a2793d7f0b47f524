//! The admin HTTP server: liveness, readiness, Prometheus metrics and JSON views of the router's
//! tables. Nothing here exposes prompt text.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router as HttpRouter};
use serde_json::json;

use crate::router::Router;

/// Shared state of the admin handlers.
#[derive(Debug, Clone)]
pub struct Admin {
    router: Arc<Router>,
    ready: Arc<AtomicBool>,
}

impl Admin {
    /// Admin over `router`; `/readyz` answers 200 once `ready` is set.
    pub fn new(router: Arc<Router>, ready: Arc<AtomicBool>) -> Admin {
        Admin { router, ready }
    }

    /// The HTTP routes.
    pub fn routes(self) -> HttpRouter {
        HttpRouter::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .route("/debug/endpoints", get(endpoints))
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
    let text = admin.router.metrics().render(&admin.router.endpoints());
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
    let set = admin.router.endpoints();
    let config = admin.router.config();
    let endpoints: Vec<_> = set
        .all()
        .iter()
        .map(|ep| {
            json!({
                "address": ep.address_str.as_ref(),
                "pool": ep.pool.as_ref(),
                "models": ep.models,
                "adapters": ep.adapters,
                "weight": ep.weight,
                "max_in_flight": ep.max_in_flight,
                "draining": ep.draining,
                "load": ep.load.snapshot(),
            })
        })
        .collect();
    Json(json!({
        "version": set.version,
        "policy": config.policy.name.as_str(),
        "endpoints": endpoints,
    }))
}

/// Serves the admin routes on `listener` until `shutdown` resolves.
pub async fn serve(
    admin: Admin,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, admin.routes())
        .with_graceful_shutdown(shutdown)
        .await
}
