//! Fault injection and maintenance endpoints, under `/admin/` on the replica's own port.
//! Only loopback peers may call them (others get 403). Durations are real (tokio) time, not
//! divided by `time_scale`. Every endpoint answers with the engine state after the command.
//! The fault state itself is the replica's ([`crate::faults`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;

use super::driver::AdminCommand;
use super::faults::Faults;
use super::openai::error;
use super::replica::Replica;

/// `POST /admin/fail` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FailBody {
    /// Status of the failed responses. Default 500.
    #[serde(default = "default_fail_status")]
    status: u16,
    /// Fail only the next `count` requests. Default: all.
    #[serde(default)]
    count: Option<u64>,
    /// Fail only for this long. Default: until cleared.
    #[serde(default)]
    duration_ms: Option<u64>,
    /// Error message. Default "injected failure".
    #[serde(default)]
    message: Option<String>,
}

fn default_fail_status() -> u16 {
    500
}

impl Default for FailBody {
    fn default() -> Self {
        FailBody {
            status: default_fail_status(),
            count: None,
            duration_ms: None,
            message: None,
        }
    }
}

/// `POST /admin/stall` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StallBody {
    /// Stall this long. Default: until `POST /admin/resume`.
    #[serde(default)]
    duration_ms: Option<u64>,
}

/// `POST /admin/restart` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RestartBody {
    /// Answer 503 to everything but `/admin/` for this long, as a restarting process would
    /// refuse connections. Default 0.
    #[serde(default)]
    down_ms: u64,
}

/// The `/admin/` routes.
pub(crate) fn routes() -> Router<Arc<Replica>> {
    Router::new()
        .route("/admin/state", get(state))
        .route("/admin/fail", post(fail).delete(clear_fail))
        .route("/admin/stall", post(stall))
        .route("/admin/resume", post(resume))
        .route("/admin/drop-cache", post(drop_cache))
        .route("/admin/reset", post(reset))
        .route("/admin/restart", post(restart))
}

/// The caller's address, when the server was started with connect info (never fails: a missing
/// address is treated as not loopback).
struct Peer(Option<SocketAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Peer(
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|ConnectInfo(addr)| *addr),
        ))
    }
}

fn refuse(peer: &Peer) -> Option<Response> {
    match peer.0 {
        Some(addr) if addr.ip().is_loopback() => None,
        _ => Some(error(
            StatusCode::FORBIDDEN,
            "admin endpoints only answer loopback callers",
            None,
        )),
    }
}

/// The JSON body, or its default when the body is empty.
fn body<T: DeserializeOwned + Default>(bytes: &Bytes) -> Result<T, String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

async fn command(r: &Replica, cmd: AdminCommand) -> Response {
    let Some(state) = r.admin(cmd).await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is not running",
            None,
        );
    };
    let failing = r
        .faults
        .lock()
        .failing()
        .map(|(status, remaining)| json!({"status": status, "remaining": remaining}));
    Json(json!({"replica": r.name(), "engine": state, "failing": failing})).into_response()
}

async fn state(State(r): State<Arc<Replica>>, peer: Peer) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    command(&r, AdminCommand::State).await
}

async fn fail(State(r): State<Arc<Replica>>, peer: Peer, bytes: Bytes) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    let parsed: FailBody = match body(&bytes) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, None),
    };
    let status = match StatusCode::from_u16(parsed.status) {
        Ok(s) if s.is_client_error() || s.is_server_error() => s,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("status must be a 4xx or 5xx code (got {})", parsed.status),
                Some("status"),
            )
        }
    };
    r.faults.lock().fail(
        status,
        parsed.count,
        parsed.duration_ms.map(Duration::from_millis),
        parsed.message.unwrap_or_else(|| "injected failure".into()),
    );
    command(&r, AdminCommand::State).await
}

async fn clear_fail(State(r): State<Arc<Replica>>, peer: Peer) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    r.faults.lock().clear_fail();
    command(&r, AdminCommand::State).await
}

async fn stall(State(r): State<Arc<Replica>>, peer: Peer, bytes: Bytes) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    let parsed: StallBody = match body(&bytes) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, None),
    };
    command(
        &r,
        AdminCommand::Stall(parsed.duration_ms.map(Duration::from_millis)),
    )
    .await
}

async fn resume(State(r): State<Arc<Replica>>, peer: Peer) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    command(&r, AdminCommand::Resume).await
}

async fn drop_cache(State(r): State<Arc<Replica>>, peer: Peer) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    command(&r, AdminCommand::DropCache).await
}

async fn reset(State(r): State<Arc<Replica>>, peer: Peer) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    *r.faults.lock() = Faults::default();
    command(&r, AdminCommand::Reset).await
}

async fn restart(State(r): State<Arc<Replica>>, peer: Peer, bytes: Bytes) -> Response {
    if let Some(resp) = refuse(&peer) {
        return resp;
    }
    let parsed: RestartBody = match body(&bytes) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e, None),
    };
    r.faults
        .lock()
        .restart(Duration::from_millis(parsed.down_ms));
    command(&r, AdminCommand::Restart).await
}
