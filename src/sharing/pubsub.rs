//! The publisher and subscriber tasks: one Redis connection each, reconnected with capped
//! exponential backoff; every Redis call under a timeout.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

use super::{age_of, wire, PeerSink, SharedDecision};
use crate::telemetry::{DropReason, SharingMetrics};

/// Most decisions sent in one pipelined round trip.
const BATCH: usize = 64;
/// The first pause before reconnecting.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) channel: String,
    pub(super) timeout: Duration,
    pub(super) reconnect_max: Duration,
    /// The subscriber pings Redis after this long without a message (and reconnects when the
    /// answer takes longer than `timeout`): a subscription only reads, so a connection that
    /// died without a FIN (a partition, a crashed node) is never noticed otherwise.
    pub(super) idle_ping: Duration,
}

/// [`Settings::idle_ping`] of the running service.
pub(super) const IDLE_PING: Duration = Duration::from_secs(5);

/// Capped exponential backoff.
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Backoff {
        Backoff {
            next: FIRST_BACKOFF,
            max,
        }
    }
    fn reset(&mut self) {
        self.next = FIRST_BACKOFF;
    }
    fn next(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        now
    }
}

/// Drains `rx` into PUBLISH commands until every [`super::Outbox`] is gone. While there is no
/// connection and the next attempt is not due, what comes is dropped (counted), so the queue
/// keeps moving and holds only fresh decisions when Redis is back.
pub(super) async fn publish(
    client: redis::Client,
    s: Settings,
    mut rx: mpsc::Receiver<SharedDecision>,
    metrics: SharingMetrics,
) {
    let mut conn: Option<redis::aio::MultiplexedConnection> = None;
    let mut backoff = Backoff::new(s.reconnect_max);
    let mut retry_at = Instant::now();
    let mut batch = Vec::with_capacity(BATCH);
    let mut warned = false;
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        let n = batch.len() as u64;
        if conn.is_none() {
            if Instant::now() < retry_at {
                metrics.dropped(DropReason::RedisDown, n);
                batch.clear();
                continue;
            }
            match timeout(s.timeout, client.get_multiplexed_async_connection()).await {
                Ok(Ok(c)) => {
                    tracing::info!("sharing: publisher connected to Redis");
                    metrics.set_connected("publisher", true);
                    conn = Some(c);
                    backoff.reset();
                    warned = false;
                }
                failed => {
                    if !warned {
                        tracing::warn!(error = %describe(failed), "sharing: cannot reach Redis; dropping decisions until it answers");
                        warned = true;
                    }
                    retry_at = Instant::now() + backoff.next();
                    metrics.dropped(DropReason::RedisDown, n);
                    batch.clear();
                    continue;
                }
            }
        }
        let mut pipe = redis::pipe();
        for d in batch.drain(..) {
            pipe.cmd("PUBLISH")
                .arg(&s.channel)
                .arg(wire::encode(&d))
                .ignore();
        }
        let c = conn.as_mut().expect("connected above");
        match timeout(s.timeout, pipe.query_async::<()>(c)).await {
            Ok(Ok(())) => metrics.published(n),
            failed => {
                tracing::warn!(error = %describe(failed), "sharing: publish failed; reconnecting");
                metrics.dropped(DropReason::PublishFailed, n);
                metrics.set_connected("publisher", false);
                conn = None;
                retry_at = Instant::now() + backoff.next();
            }
        }
    }
}

/// Subscribes to the channel and applies every peer's decision, reconnecting (with backoff)
/// whenever the connection drops. Runs for the life of the process.
pub(super) async fn subscribe(
    client: redis::Client,
    s: Settings,
    origin: u64,
    peers: Arc<dyn PeerSink>,
    metrics: SharingMetrics,
) {
    let mut backoff = Backoff::new(s.reconnect_max);
    let mut warned = false;
    loop {
        let connected = async {
            let mut pubsub = timeout(s.timeout, client.get_async_pubsub())
                .await
                .map_err(|_| "timed out".to_string())?
                .map_err(|e| e.to_string())?;
            timeout(s.timeout, pubsub.subscribe(&s.channel))
                .await
                .map_err(|_| "timed out".to_string())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(pubsub)
        }
        .await;
        match connected {
            Ok(pubsub) => {
                tracing::info!(channel = %s.channel, "sharing: subscribed");
                metrics.set_connected("subscriber", true);
                backoff.reset();
                warned = false;
                let (mut sink, mut messages) = pubsub.split();
                loop {
                    let msg = match timeout(s.idle_ping, messages.next()).await {
                        Ok(Some(msg)) => msg,
                        Ok(None) => break,
                        // Quiet for a while: is the connection still there?
                        Err(_) => match timeout(s.timeout, sink.ping::<redis::Value>()).await {
                            Ok(Ok(_)) => continue,
                            failed => {
                                tracing::warn!(error = %describe(failed), "sharing: Redis did not answer a ping on the subscription");
                                break;
                            }
                        },
                    };
                    let outcome = match wire::decode(msg.get_payload_bytes()) {
                        Err(_) => "malformed",
                        Ok(d) if d.origin == origin => "own",
                        Ok(d) => peers
                            .apply(d.endpoint, &d.hashes, age_of(d.sent_unix_ms))
                            .as_str(),
                    };
                    metrics.received(outcome);
                }
                metrics.set_connected("subscriber", false);
                tracing::warn!("sharing: subscription to Redis lost; reconnecting");
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(error = %e, "sharing: cannot subscribe on Redis; retrying");
                    warned = true;
                }
            }
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

fn describe<T>(r: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>) -> String {
    match r {
        Err(_) => "timed out".into(),
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(_)) => "ok".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(500));
        let seen: Vec<u128> = (0..5).map(|_| b.next().as_millis()).collect();
        assert_eq!(seen, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next(), FIRST_BACKOFF);
    }
}
