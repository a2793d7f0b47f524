//! Decision sharing between router instances (`sharing`): what this instance published, what
//! it received from its peers and what it did with it, and what it dropped rather than wait.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// `outcome`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// `role`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabels {
    role: &'static str,
}

/// The sharing metrics (registered under `kvrouter_sharing_`). Cheap to clone: the handles
/// share their values.
#[derive(Debug, Clone, Default)]
pub struct SharingMetrics {
    published: Counter,
    dropped: Family<ReasonLabels, Counter>,
    received: Family<OutcomeLabels, Counter>,
    connected: Family<RoleLabels, Gauge>,
}

/// Why a decision was not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The publish queue was full (Redis slow or away for longer than the queue lasts).
    QueueFull,
    /// No connection to Redis, and the next attempt is not due yet.
    RedisDown,
    /// The publish failed or timed out.
    PublishFailed,
}

impl DropReason {
    fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::RedisDown => "redis_down",
            DropReason::PublishFailed => "publish_failed",
        }
    }
}

impl SharingMetrics {
    /// Registers the sharing metrics in `registry`.
    pub fn register(registry: &mut Registry) -> SharingMetrics {
        let m = SharingMetrics::default();
        let sub = registry.sub_registry_with_prefix("sharing");
        sub.register(
            "published",
            "Decisions published to the peers' channel",
            m.published.clone(),
        );
        sub.register(
            "dropped",
            "Decisions not published, by reason (queue_full, redis_down, publish_failed)",
            m.dropped.clone(),
        );
        sub.register(
            "received",
            "Messages received on the channel, by outcome (applied, own, stale, unknown_endpoint, malformed)",
            m.received.clone(),
        );
        sub.register(
            "connected",
            "1 while the publisher's or the subscriber's Redis connection is up",
            m.connected.clone(),
        );
        m
    }

    /// `n` decisions were published.
    pub fn published(&self, n: u64) {
        self.published.inc_by(n);
    }

    /// `n` decisions were dropped for `reason`.
    pub fn dropped(&self, reason: DropReason, n: u64) {
        self.dropped
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc_by(n);
    }

    /// A message was received and ended in `outcome`.
    pub fn received(&self, outcome: &'static str) {
        self.received
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// The `role` (`publisher`, `subscriber`) connection went up or down.
    pub fn set_connected(&self, role: &'static str, up: bool) {
        self.connected
            .get_or_create(&RoleLabels { role })
            .set(i64::from(up));
    }
}
