//! One scrape of one endpoint's metrics: an HTTP GET with a deadline, parsed into an
//! [`EngineSample`]. The loop that repeats it lives in [`crate::monitor`].
//!
//! What an endpoint sends back is bounded: the body is read chunk by chunk up to
//! `load.scrape.max_body_bytes` (a declared `content-length` over it fails before reading), and
//! a redirect is an error, never followed: [`client`] builds a client that does not follow
//! them, and a response from another URL than the one asked (a client that did follow) is
//! refused too. A scrape is a GET to an address from the config or from DNS; following a
//! `Location` would let whoever answers there make the router fetch any URL.

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
    /// The body is longer than `load.scrape.max_body_bytes`.
    #[error("the metrics body exceeds {0} bytes")]
    TooLarge(usize),
    /// The endpoint answered with a redirect (never followed).
    #[error("the endpoint answered with a redirect, which is not followed")]
    Redirect,
}

impl ScrapeError {
    /// A short label for metrics: `connect`, `timeout`, `status`, `parse`, `too-large`,
    /// `redirect`.
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Transport(_) => "connect",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Status(_) => "status",
            ScrapeError::Exposition(_) => "parse",
            ScrapeError::TooLarge(_) => "too-large",
            ScrapeError::Redirect => "redirect",
        }
    }

    /// Whether the error says the endpoint is down (counts against its health), rather than
    /// that it exposes something unexpected (a 404, the wrong metric names).
    pub fn endpoint_down(&self) -> bool {
        match self {
            ScrapeError::Transport(_) | ScrapeError::Timeout(_) => true,
            ScrapeError::Status(s) => *s >= 500,
            ScrapeError::Exposition(_) | ScrapeError::TooLarge(_) | ScrapeError::Redirect => false,
        }
    }
}

/// Default of `load.scrape.max_body_bytes`: 4 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// The HTTP client for scrapes and probes: keeps connections to the endpoints alive, and never
/// follows a redirect.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(2)
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .build()
        .unwrap_or_default()
}

/// Scrapes `http://{addr}{path}` once, within `timeout` (connect, headers and body), reading
/// at most [`DEFAULT_MAX_BODY_BYTES`].
pub async fn scrape(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    names: &MetricNames,
    timeout: Duration,
) -> Result<EngineSample, ScrapeError> {
    scrape_capped(client, addr, path, names, timeout, DEFAULT_MAX_BODY_BYTES).await
}

/// [`scrape`] reading at most `max_body_bytes` of body (`load.scrape.max_body_bytes`).
pub async fn scrape_capped(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    names: &MetricNames,
    timeout: Duration,
    max_body_bytes: usize,
) -> Result<EngineSample, ScrapeError> {
    let url = reqwest::Url::parse(&format!("http://{addr}{path}"))
        .map_err(|e| ScrapeError::Transport(format!("bad metrics URL: {e}")))?;
    let fetch = async {
        let resp = client
            .get(url.clone())
            .send()
            .await
            .map_err(|e| ScrapeError::Transport(without_url(e)))?;
        let status = resp.status();
        if status.is_redirection() || *resp.url() != url {
            return Err(ScrapeError::Redirect);
        }
        if !status.is_success() {
            return Err(ScrapeError::Status(status.as_u16()));
        }
        read_capped(resp, max_body_bytes).await
    };
    let body = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))??;
    let text = String::from_utf8_lossy(&body);
    Ok(exposition::parse(names, &text, Instant::now())?)
}

/// The body of `resp`, failing as soon as it is known to exceed `max_bytes`: from its
/// `content-length`, or when the chunks read so far pass it.
async fn read_capped(
    mut resp: reqwest::Response,
    max_bytes: usize,
) -> Result<Vec<u8>, ScrapeError> {
    if resp.content_length().is_some_and(|n| n > max_bytes as u64) {
        return Err(ScrapeError::TooLarge(max_bytes));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ScrapeError::Transport(without_url(e)))?
    {
        if body.len() + chunk.len() > max_bytes {
            return Err(ScrapeError::TooLarge(max_bytes));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
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
    /// A body over the cap fails the scrape whether its length is declared or streamed.
    #[tokio::test]
    async fn bodies_over_the_cap_are_not_read() {
        use axum::body::Body;
        let names = MetricNames::of(EngineKind::Vllm).unwrap();
        let exposition = "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.3\n";
        let padded = format!("{exposition}{}", "# padding\n".repeat(10_000));
        let padded2 = padded.clone();
        let app = axum::Router::new()
            .route("/small", get(move || async move { exposition }))
            .route("/declared", get(move || async move { padded }))
            .route(
                "/streamed",
                get(move || async move {
                    let chunks = padded2
                        .into_bytes()
                        .chunks(1000)
                        .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(c)))
                        .collect::<Vec<_>>();
                    Body::from_stream(futures::stream::iter(chunks))
                }),
            );
        let addr = serve(app).await;
        let c = client();
        let t = Duration::from_secs(5);
        let ok = scrape_capped(&c, addr, "/small", &names, t, 1000)
            .await
            .unwrap();
        assert_eq!(ok.waiting_requests, 2);
        for path in ["/declared", "/streamed"] {
            let e = scrape_capped(&c, addr, path, &names, t, 65_536)
                .await
                .unwrap_err();
            assert_eq!(e, ScrapeError::TooLarge(65_536), "{path}");
            assert_eq!((e.kind(), e.endpoint_down()), ("too-large", false));
        }
        // Under the cap, the same body parses.
        let s = scrape_capped(&c, addr, "/streamed", &names, t, 1 << 20)
            .await
            .unwrap();
        assert_eq!(s.running_requests, 1);
    }

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

        // Redirects are refused, whether the client follows them (the default) or not.
        let app = axum::Router::new()
            .route(
                "/moved",
                get(|| async { axum::response::Redirect::temporary("/metrics") }),
            )
            .route(
                "/metrics",
                get(|| async { "vllm:num_requests_waiting 2\n" }),
            );
        let moved = serve(app).await;
        for c in [super::client(), reqwest::Client::new()] {
            let e = scrape(&c, moved, "/moved", &names, t).await.unwrap_err();
            assert_eq!((e.kind(), e.endpoint_down()), ("redirect", false));
        }

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
