//! A replica's HTTP face: the OpenAI routes of [`crate::server`] and the `/admin/` routes of
//! [`crate::admin`] over one [`Replica`], every response tagged with [`REPLICA_HEADER`]; and the
//! listener that serves them on the replica's own port.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::HeaderValue;
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use tokio::sync::oneshot;

use super::config::ReplicaConfig;
use super::replica::{Replica, SimError};
use super::{admin, server, REPLICA_HEADER};

/// Largest request body accepted, in bytes (64 MiB): vLLM has no body limit, and axum's 2 MiB
/// default would refuse long-context prompts.
const MAX_BODY_BYTES: usize = 64 << 20;

/// The replica's routes, every response carrying [`REPLICA_HEADER`].
pub fn routes(replica: &Arc<Replica>) -> Router {
    let name = HeaderValue::from_str(replica.name())
        .unwrap_or_else(|_| HeaderValue::from_static("replica"));
    Router::new()
        .route("/v1/completions", post(server::completions))
        .route("/v1/chat/completions", post(server::chat))
        .route("/v1/models", get(server::models))
        .route("/health", get(server::health))
        .route("/metrics", get(server::metrics))
        .merge(admin::routes())
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(move |mut res: Response| {
            let name = name.clone();
            async move {
                res.headers_mut().insert(REPLICA_HEADER, name);
                res
            }
        }))
        .with_state(Arc::clone(replica))
}

/// A replica serving HTTP on its own port.
#[derive(Debug)]
pub struct RunningReplica {
    /// The replica.
    pub replica: Arc<Replica>,
    /// The bound HTTP address.
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningReplica {
    /// The JSON line `kvsim` prints once the replica listens.
    pub fn listening_line(&self) -> String {
        // Written by hand to keep the documented key order (serde_json sorts keys).
        let quote = |s: &str| serde_json::Value::from(s).to_string();
        let mut line = format!(
            "{{\"event\":\"listening\",\"name\":{},\"addr\":{}",
            quote(self.replica.name()),
            quote(&self.addr.to_string())
        );
        if let Some(kv) = self.replica.kv_events_endpoint() {
            line.push_str(&format!(",\"kv_events\":{}", quote(kv)));
        }
        if let Some(replay) = self.replica.kv_events_replay() {
            line.push_str(&format!(",\"kv_events_replay\":{}", quote(replay)));
        }
        line.push('}');
        line
    }

    /// Stops accepting connections, lets open responses finish, and waits for the server.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// Starts a replica and serves it on `config.listen` (peer addresses are passed to handlers so
/// admin endpoints can refuse non-loopback callers).
pub async fn serve(config: ReplicaConfig) -> Result<RunningReplica, SimError> {
    let listen = config.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| SimError::Listen {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| SimError::Listen {
        addr: listen,
        source,
    })?;
    // SSE writes many small chunks: without TCP_NODELAY, Nagle's algorithm and the client's
    // delayed ACK hold a token back for ~40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    });
    let replica = Replica::start(config).await?;
    let app = routes(&replica).into_make_service_with_connect_info::<SocketAddr>();
    let (shutdown, stop) = oneshot::channel::<()>();
    let name = replica.name().to_string();
    let task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stop.await;
        });
        if let Err(e) = serve.await {
            tracing::error!(replica = %name, "replica server failed: {e}");
        }
    });
    Ok(RunningReplica {
        replica,
        addr,
        shutdown: Some(shutdown),
        task,
    })
}
