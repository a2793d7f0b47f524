//! What the world outside a request learns from its decision, besides its ticket: a live feed
//! of decision records for watchers (`kvrouter.v1.Admin/WatchDecisions`) and the Gateway API
//! Inference Extension's request metrics.
//!
//! The feed is a bounded broadcast. While nobody watches, a decision costs one atomic load here
//! and no record is built; with watchers, each decision builds one record (its explanation)
//! shared by all of them, and a watcher that falls behind loses the oldest records instead of
//! slowing decisions (it is told how many). Records hold counts and names, never prompt text.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::broadcast;

use super::explain::Explanation;
use super::tables::Tables;
use super::{Decision, RouteError};
use crate::telemetry::GieOutcome;

/// Records kept for a watcher that has not read them yet.
const FEED_CAPACITY: usize = 1024;

/// One decision as watchers see it.
#[derive(Debug, Clone)]
pub struct DecisionRecord {
    /// The request id (`x-request-id`), empty if none.
    pub request_id: String,
    /// When it was decided, ms since the Unix epoch.
    pub unix_time_ms: u64,
    /// The requested model.
    pub model: String,
    /// Time to decide (parsed request to committed pick).
    pub took: Duration,
    /// The breakdown of a routed request, or why routing rejected it.
    pub outcome: Result<Explanation, RouteError>,
}

/// The broadcast of decision records.
#[derive(Debug)]
pub struct DecisionFeed {
    tx: broadcast::Sender<Arc<DecisionRecord>>,
    watchers: Arc<AtomicUsize>,
}

impl Default for DecisionFeed {
    fn default() -> Self {
        DecisionFeed {
            tx: broadcast::Sender::new(FEED_CAPACITY),
            watchers: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl DecisionFeed {
    /// Whether anyone watches (one relaxed load: asked by every decision).
    pub fn watched(&self) -> bool {
        self.watchers.load(Ordering::Relaxed) > 0
    }

    /// Sends `record` to every watcher, never waiting.
    pub fn publish(&self, record: DecisionRecord) {
        let _ = self.tx.send(Arc::new(record));
    }

    /// A new watcher: every record published from now on, until it is dropped.
    pub fn watch(&self) -> DecisionWatch {
        self.watchers.fetch_add(1, Ordering::Relaxed);
        DecisionWatch {
            rx: self.tx.subscribe(),
            watchers: Arc::clone(&self.watchers),
        }
    }
}

/// One watcher's end of the feed.
#[derive(Debug)]
pub struct DecisionWatch {
    rx: broadcast::Receiver<Arc<DecisionRecord>>,
    watchers: Arc<AtomicUsize>,
}

impl DecisionWatch {
    /// The next record, with how many this watcher lost just before it for falling behind;
    /// `None` once the feed is gone.
    pub async fn next(&mut self) -> Option<(Arc<DecisionRecord>, u64)> {
        let mut dropped = 0;
        loop {
            match self.rx.recv().await {
                Ok(record) => return Some((record, dropped)),
                Err(broadcast::error::RecvError::Lagged(n)) => dropped += n,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

impl Drop for DecisionWatch {
    fn drop(&mut self) {
        self.watchers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The `model_name` of requests for a model no endpoint serves.
pub(crate) const UNKNOWN_MODEL_LABEL: &str = "(unknown)";

/// Tells the GIE metrics and the feed's watchers about one decision on `model` started at
/// `started`.
pub(super) fn observe(
    tables: &Tables,
    decided: &Result<Decision, RouteError>,
    model: &str,
    request_id: &str,
    started: Instant,
) {
    let took = started.elapsed();
    let outcome = match decided {
        Ok(d) => GieOutcome::Routed {
            prompt_tokens: d.prompt_tokens(),
        },
        Err(RouteError::UnknownModel { .. }) => GieOutcome::Rejected {
            error_code: "BadRequest",
        },
        // The tenant is authenticated but not allowed there: the request, not the fleet.
        Err(RouteError::TenantNotAllowed { .. }) => GieOutcome::Rejected {
            error_code: "BadRequest",
        },
        Err(RouteError::NoEndpoint { .. } | RouteError::NoLabeledEndpoint { .. }) => {
            GieOutcome::Rejected {
                error_code: "ServiceUnavailable",
            }
        }
    };
    // A model name nobody serves is whatever the client wrote (a pasted prompt, a random string
    // per request): it never becomes a label (no prompt text in metrics, no unbounded series)
    // and reaches watchers only when it looks like a model name.
    let unknown = matches!(decided, Err(RouteError::UnknownModel { .. }));
    let label = if unknown { UNKNOWN_MODEL_LABEL } else { model };
    tables.metrics.gie.record(label, took, outcome);
    if tables.feed.watched() {
        let unix_time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        tables.feed.publish(DecisionRecord {
            request_id: request_id.to_string(),
            unix_time_ms,
            model: if unknown {
                crate::request::model_for_display(model).into_owned()
            } else {
                model.to_string()
            },
            took,
            outcome: match decided {
                Ok(d) => Ok(d.plan.explain()),
                Err(e) => Err(e.clone()),
            },
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> DecisionRecord {
        DecisionRecord {
            request_id: id.into(),
            unix_time_ms: 1,
            model: "m".into(),
            took: Duration::from_micros(3),
            outcome: Err(RouteError::UnknownModel { model: "m".into() }),
        }
    }

    #[tokio::test]
    async fn watchers_are_counted_and_a_laggard_is_told_what_it_lost() {
        let feed = DecisionFeed::default();
        assert!(!feed.watched());
        let mut watch = feed.watch();
        assert!(feed.watched());
        for i in 0..FEED_CAPACITY + 5 {
            feed.publish(record(&i.to_string()));
        }
        let (first, dropped) = watch.next().await.expect("a record");
        assert_eq!(dropped, 5);
        assert_eq!(first.request_id, "5", "the oldest records went first");
        drop(watch);
        assert!(!feed.watched(), "a dropped watcher no longer counts");
    }
}
