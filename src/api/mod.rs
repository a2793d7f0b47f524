//! kvrouter's own gRPC API, `kvrouter.v1` (the `.proto` files are in `proto/`, compiled by the
//! build): the admin views as gRPC (`Admin`: `Explain`, `WatchDecisions`, `GetEndpoints`) and
//! KV-event ingestion for engines that push instead of publishing over ZMQ (`KvEvents`:
//! `PushKvEvents`).
//!
//! Served on the admin port (`server.admin_listen`) next to the HTTP routes: one listener
//! speaks HTTP/1.1 (`/metrics`, `/debug/*`) and HTTP/2 (gRPC) alike, so deployments open no new
//! port. Both services, and the HTTP `/debug/*` routes, sit behind the admin bearer token when
//! `admin.auth_token_file` is set ([`AdminAuth`]: a tonic interceptor answering
//! `UNAUTHENTICATED`, an HTTP layer answering 401); `/healthz`, `/readyz` and `/metrics` stay
//! open for probes and scrapers. Explaining as a tenant (`tenant` of `Explain`,
//! `/debug/explain?tenant=`) would tell anyone how much of another tenant's prefix each replica
//! holds, so it is refused unless a token is required.
//!
//! - `auth`: the token, loaded once, and the interceptor.
//! - `admin`: the `Admin` service over the router's [`AdminView`].
//! - `push`: the `KvEvents` service over the KV-event [`PushSink`], and the messages' mapping
//!   to the wire events the ZMQ path decodes.
//! - `convert`: explanations and endpoint views to and from their messages.
//! - [`client`]: the client side `kvrouter explain --admin` uses.

mod admin;
mod auth;
pub mod client;
mod convert;
mod push;

/// The messages and services generated from `proto/kvrouter/v1/*.proto`.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("kvrouter.v1");
}

pub use crate::admin::TENANT_EXPLAIN_REFUSED;
pub use auth::{AdminAuth, AuthError};
pub use convert::{explanation_from_pb, explanation_to_pb};

use crate::admin::Admin;
use crate::events::PushSink;
use crate::router::AdminView;

/// The gRPC services as routes of the admin HTTP server, behind `auth`; messages up to
/// `max_message_bytes` (an `Explain` body arrives as one).
pub fn routes(
    view: AdminView,
    kv_push: PushSink,
    auth: AdminAuth,
    max_message_bytes: usize,
) -> axum::Router {
    let tenant_explain = auth.required();
    let admin = pb::admin_server::AdminServer::new(admin::AdminService::new(view, tenant_explain))
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes);
    let push = pb::kv_events_server::KvEventsServer::new(push::PushService::new(kv_push))
        .max_decoding_message_size(max_message_bytes);
    tonic::service::Routes::new(tonic::service::interceptor::InterceptedService::new(
        admin,
        auth.clone(),
    ))
    .add_service(tonic::service::interceptor::InterceptedService::new(
        push, auth,
    ))
    .into_axum_router()
}

/// Serves the admin HTTP routes (`/debug/*` behind `auth`, explaining as a tenant only when a
/// token is required) and `api` (see [`routes`]) on `listener` until `shutdown` resolves.
pub async fn serve_admin(
    admin: Admin,
    api: axum::Router,
    auth: AdminAuth,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let http = admin.with_tenant_explain(auth.required()).routes();
    let app = http.merge(api).layer(axum::middleware::from_fn_with_state(
        auth,
        auth::guard_debug,
    ));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
