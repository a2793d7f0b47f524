//! One scrape of one endpoint's metrics: an HTTP GET with a deadline, parsed into an
//! [`EngineSample`]. The loop that repeats it lives in [`crate::monitor`].

use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use super::engine::EngineSample;
use super::exposition::{self, ExpositionError, MetricNames};

/// Why a scrape gave no sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrapeError {
    /// The connection failed or broke (refused, reset).
    #[error("cannot reach the endpoint: {0}")]
    Transport(String),
    /// No complete answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The endpoint answered with a non-2xx status.
    #[error("status {0}")]
    Status(u16),
    /// The body is not what the pool's `engine` exposes.
    #[error(transparent)]
    Exposition(#[from] ExpositionError),
}

impl ScrapeError {
    /// A short label for metrics: `connect`, `timeout`, `status`, `parse`.
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Transport(_) => "connect",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Status(_) => "status",
            ScrapeError::Exposition(_) => "parse",
        }
    }

    /// Whether the error says the endpoint is down (counts against its health), rather than
    /// that it exposes something unexpected (a 404, the wrong metric names).
    pub fn endpoint_down(&self) -> bool {
        match self {
            ScrapeError::Transport(_) | ScrapeError::Timeout(_) => true,
            ScrapeError::Status(s) => *s >= 500,
            ScrapeError::Exposition(_) => false,
        }
    }
}

/// Scrapes `http://{addr}{path}` once, within `timeout` (connect, headers and body).
pub async fn scrape(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    names: &MetricNames,
    timeout: Duration,
) -> Result<EngineSample, ScrapeError> {
    let fetch = async {
        let resp = client
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .map_err(|e| ScrapeError::Transport(without_url(e)))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ScrapeError::Status(status.as_u16()));
        }
        resp.text()
            .await
            .map_err(|e| ScrapeError::Transport(without_url(e)))
    };
    let text = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))??;
    Ok(exposition::parse(names, &text, Instant::now())?)
}

/// A reqwest error's message without the URL (it is logged next to the endpoint anyway).
pub(crate) fn without_url(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineKind;
    use axum::routing::get;

    async fn serve(app: axum::Router) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    #[tokio::test]
    async fn scrapes_and_classifies_failures() {
        let names = MetricNames::of(EngineKind::Vllm).unwrap();
        let app = axum::Router::new()
            .route(
                "/metrics",
                get(|| async {
                    "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.3\n"
                }),
            )
            .route("/wrong", get(|| async { "sglang:num_queue_reqs 1\n" }))
            .route(
                "/broken",
                get(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "down") }),
            )
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    ""
                }),
            );
        let addr = serve(app).await;
        let client = reqwest::Client::new();
        let t = Duration::from_secs(5);
        let s = scrape(&client, addr, "/metrics", &names, t).await.unwrap();
        assert_eq!((s.waiting_requests, s.running_requests), (2, 1));

        let e = scrape(&client, addr, "/wrong", &names, t)
            .await
            .unwrap_err();
        assert_eq!((e.kind(), e.endpoint_down()), ("parse", false));
        let e = scrape(&client, addr, "/nope", &names, t).await.unwrap_err();
        assert_eq!((e, false), (ScrapeError::Status(404), false));
        let e = scrape(&client, addr, "/broken", &names, t)
            .await
            .unwrap_err();
        assert_eq!((e.kind(), e.endpoint_down()), ("status", true));
        let e = scrape(&client, addr, "/slow", &names, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!((e.kind(), e.endpoint_down()), ("timeout", true));

        // Nothing listens on a port we just released.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let e = scrape(&client, closed, "/metrics", &names, t)
            .await
            .unwrap_err();
        assert_eq!((e.kind(), e.endpoint_down()), ("connect", true));
    }
}
