//! One active health probe: `GET <path>` with a deadline; any 2xx is healthy.

use std::net::SocketAddr;
use std::time::Duration;

use crate::load::scrape::without_url;

/// Why a probe failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The connection failed or broke.
    #[error("cannot reach the endpoint: {0}")]
    Transport(String),
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A non-2xx status.
    #[error("status {0}")]
    Status(u16),
}

/// Probes `http://{addr}{path}` once, within `timeout`.
pub async fn probe(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(), ProbeError> {
    let fetch = async {
        let resp = client
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .map_err(|e| ProbeError::Transport(without_url(e)))?;
        let status = resp.status();
        // Read the (small) body so the connection can be reused.
        let _ = resp.bytes().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(ProbeError::Status(status.as_u16()))
        }
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;

    #[tokio::test]
    async fn probe_results() {
        let app = axum::Router::new()
            .route("/health", get(|| async { "" }))
            .route(
                "/sick",
                get(|| async { (http::StatusCode::INTERNAL_SERVER_ERROR, "engine dead") }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        let t = Duration::from_secs(5);
        assert_eq!(probe(&client, addr, "/health", t).await, Ok(()));
        assert_eq!(
            probe(&client, addr, "/sick", t).await,
            Err(ProbeError::Status(500))
        );
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(matches!(
            probe(&client, closed, "/health", t).await,
            Err(ProbeError::Transport(_))
        ));
    }
}
