//! Decision sharing between kvrouter instances over Redis pub/sub (`sharing` in the config).
//!
//! Several instances behind one gateway each record predicted ownership from their own
//! decisions only; without KV events a prefix one instance sent to replica A is unknown to the
//! others, which send its next turn anywhere (kvbench measured 30% and 52% of decisions that a
//! peer's would have changed, at 2 and 4 instances). So each instance publishes, per decision,
//! what a peer needs to record the same prediction: the pick's address, the model and the
//! prompt's chained block hashes (no text), and when. Each instance subscribes to the same
//! channel and applies its peers' decisions through the router's [`PeerSink`], exactly as its
//! own (the same TTL, shortened by the message's age; the same cut to whole engine blocks and
//! the short TTL on endpoints whose KV events are trusted); it skips its own messages.
//!
//! # Never on the request path
//!
//! A decision only offers its message to a bounded queue ([`Outbox::offer`]: a `try_send`, no
//! await, no lock); a full queue drops the message and counts it. One publisher task drains the
//! queue in batches (one pipelined round trip per batch) with a timeout; while Redis is away it
//! drops what comes (counted) and reconnects with capped exponential backoff, so an outage or a
//! slow Redis costs peers their view of this instance's decisions, never a request its latency.
//! Lost messages are not replayed: a prediction is worth little after its TTL anyway.
//!
//! # Parts
//!
//! - [`wire`]: the message's bytes.
//! - `pubsub`: the publisher and subscriber tasks, their reconnection and backoff.

mod pubsub;
pub mod wire;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

use crate::config::SharingConfig;
use crate::telemetry::{DropReason, SharingMetrics};

/// One routing decision as the peers learn it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDecision {
    /// The publishing instance (random per process), so an instance skips its own messages.
    pub origin: u64,
    /// When it was decided, wall-clock milliseconds since the Unix epoch.
    pub sent_unix_ms: u64,
    /// The picked endpoint.
    pub endpoint: SocketAddr,
    /// The requested model (for logs; the namespace is already in the hashes).
    pub model: String,
    /// The prompt's chained block hashes, in order.
    pub hashes: Vec<u64>,
}

/// What applying a peer's decision came to (the `outcome` label of
/// `kvrouter_sharing_received_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerOutcome {
    /// Recorded as a prediction.
    Applied,
    /// Older than the prediction TTL it would get: nothing left to predict.
    Stale,
    /// The endpoint is not in this instance's endpoint set (yet).
    UnknownEndpoint,
}

impl PeerOutcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerOutcome::Applied => "applied",
            PeerOutcome::Stale => "stale",
            PeerOutcome::UnknownEndpoint => "unknown_endpoint",
        }
    }
}

/// Where peers' decisions go: the router records them as its own predictions.
pub trait PeerSink: Send + Sync + 'static {
    /// Records that a peer routed a prompt with `hashes` to `endpoint` `age` ago.
    fn apply(&self, endpoint: SocketAddr, hashes: &[u64], age: Duration) -> PeerOutcome;
}

/// The decision path's side: offers each decision to the publisher's bounded queue.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::Sender<SharedDecision>,
    origin: u64,
    metrics: SharingMetrics,
}

impl Outbox {
    /// Queues the decision that sent `hashes` of a `model` prompt to `endpoint`, or drops it
    /// (counted) if the queue is full. Never waits.
    pub fn offer(&self, endpoint: SocketAddr, model: &str, hashes: &[u64]) {
        let d = SharedDecision {
            origin: self.origin,
            sent_unix_ms: unix_ms(),
            endpoint,
            model: model.to_string(),
            hashes: hashes.to_vec(),
        };
        if self.tx.try_send(d).is_err() {
            self.metrics.dropped(DropReason::QueueFull, 1);
        }
    }
}

/// Wall-clock milliseconds since the Unix epoch (0 before it).
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How old a message sent at `sent_unix_ms` is now; clocks a little ahead of ours read as new.
pub(crate) fn age_of(sent_unix_ms: u64) -> Duration {
    Duration::from_millis(unix_ms().saturating_sub(sent_unix_ms))
}

/// Starts sharing as `config` says (nothing when it is off): the publisher and subscriber
/// tasks on the current runtime. Returns the outbox the router offers its decisions to.
pub fn start(
    config: &SharingConfig,
    peers: std::sync::Arc<dyn PeerSink>,
    metrics: SharingMetrics,
) -> Result<Option<Outbox>, SharingError> {
    let Some(url) = &config.redis else {
        return Ok(None);
    };
    let client =
        ::redis::Client::open(url.as_str()).map_err(|e| SharingError::Url(e.to_string()))?;
    let origin = rand::random::<u64>();
    let (tx, rx) = mpsc::channel(config.queue_capacity);
    let settings = pubsub::Settings {
        channel: config.channel.clone(),
        timeout: Duration::from_millis(config.timeout_ms),
        reconnect_max: Duration::from_millis(config.reconnect_max_ms),
        idle_ping: pubsub::IDLE_PING,
    };
    tokio::spawn(pubsub::publish(
        client.clone(),
        settings.clone(),
        rx,
        metrics.clone(),
    ));
    tokio::spawn(pubsub::subscribe(
        client,
        settings,
        origin,
        peers,
        metrics.clone(),
    ));
    tracing::info!(channel = %config.channel, origin = format!("{origin:016x}"), "sharing decisions over Redis");
    Ok(Some(Outbox {
        tx,
        origin,
        metrics,
    }))
}

/// Why sharing could not start.
#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    /// The Redis URL does not parse.
    #[error("sharing.redis: {0}")]
    Url(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = SharingMetrics::register(&mut registry);
        let (tx, mut rx) = mpsc::channel(2);
        let outbox = Outbox {
            tx,
            origin: 7,
            metrics,
        };
        let ep: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        for _ in 0..5 {
            outbox.offer(ep, "m", &[1, 2, 3]);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("sharing_dropped_total{reason=\"queue_full\"} 3"),
            "{text}"
        );
        let first = rx.recv().await.unwrap();
        assert_eq!((first.origin, first.endpoint), (7, ep));
        assert_eq!(first.hashes, [1, 2, 3]);
    }

    /// Copies `from` into `into` until either ends; once `stall` passes `n` (the connection's
    /// number), it holds both open and forwards nothing more.
    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut into: tokio::net::tcp::OwnedWriteHalf,
        n: u64,
        stall: Arc<AtomicU64>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = [0u8; 4096];
        loop {
            let Ok(k) = from.read(&mut buf).await else {
                return;
            };
            if k == 0 {
                return;
            }
            if n < stall.load(Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
            if into.write_all(&buf[..k]).await.is_err() {
                return;
            }
        }
    }

    /// A TCP proxy to `to` on 127.0.0.1, and its stall mark: connections numbered below the
    /// mark stop forwarding but stay open (a partition: no FIN, no RST); the count of
    /// connections accepted so far.
    async fn stalling_proxy(to: SocketAddr) -> (SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let (stall, accepted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (stall_c, accepted_c) = (Arc::clone(&stall), Arc::clone(&accepted));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = accepted_c.fetch_add(1, Ordering::Relaxed);
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, n, Arc::clone(&stall_c)));
                tokio::spawn(pipe(sr, cw, n, Arc::clone(&stall_c)));
            }
        });
        (at, stall, accepted)
    }

    struct Count(Arc<AtomicU64>);

    impl PeerSink for Count {
        fn apply(&self, _: SocketAddr, _: &[u64], _: Duration) -> PeerOutcome {
            self.0.fetch_add(1, Ordering::Relaxed);
            PeerOutcome::Applied
        }
    }

    /// Publishes `payload` straight to Redis until the subscriber has applied `at_least`.
    async fn heard_after(
        direct: &mut ::redis::aio::MultiplexedConnection,
        payload: &[u8],
        applied: &AtomicU64,
        at_least: u64,
    ) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while applied.load(Ordering::Relaxed) < at_least {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no message heard (at least {at_least})"
            );
            let _: Result<i64, _> = ::redis::cmd("PUBLISH")
                .arg("kvrouter-test")
                .arg(payload)
                .query_async(direct)
                .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn a_subscription_gone_silent_without_a_fin_is_noticed_and_renewed() {
        let dir = tempfile::tempdir().unwrap();
        let redis = testkit::Redis::start(dir.path()).unwrap();
        let (proxy, stall, accepted) = stalling_proxy(redis.addr).await;
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = SharingMetrics::register(&mut registry);
        let applied = Arc::new(AtomicU64::new(0));
        let settings = pubsub::Settings {
            channel: "kvrouter-test".into(),
            timeout: Duration::from_millis(300),
            reconnect_max: Duration::from_millis(300),
            idle_ping: Duration::from_millis(300),
        };
        let subscriber = tokio::spawn(pubsub::subscribe(
            ::redis::Client::open(format!("redis://{proxy}")).unwrap(),
            settings,
            1,
            Arc::new(Count(Arc::clone(&applied))),
            metrics,
        ));
        // Published straight to Redis, by a peer (another origin).
        let mut direct = ::redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let payload = wire::encode(&SharedDecision {
            origin: 2,
            sent_unix_ms: 0,
            endpoint: "10.0.0.1:8000".parse().unwrap(),
            model: "m".into(),
            hashes: vec![1, 2, 3],
        });
        heard_after(&mut direct, &payload, &applied, 1).await;
        // The subscription's connection goes silent, open.
        stall.store(accepted.load(Ordering::Relaxed), Ordering::Relaxed);
        let before = applied.load(Ordering::Relaxed);
        heard_after(&mut direct, &payload, &applied, before + 1).await;
        assert!(accepted.load(Ordering::Relaxed) >= 2, "a new subscription");
        subscriber.abort();
    }
}
