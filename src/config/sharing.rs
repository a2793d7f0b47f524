//! The `sharing` section: several kvrouter instances learning each other's routing decisions.
//!
//! ```yaml
//! sharing:
//!   redis: "redis://10.0.0.9:6379"   # off when absent
//!   channel: kvrouter.decisions      # every instance of one fleet publishes and subscribes here
//! ```
//!
//! Each instance publishes, per decision, the pick and the prompt's chained block hashes (never
//! text) on a Redis pub/sub channel, and applies its peers' messages as predictions exactly like
//! its own. Read at start-up (a change takes a restart). See docs/several-routers.md.

use serde::{Deserialize, Serialize};

use super::validate::Errors;

/// Decision sharing between router instances (off by default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SharingConfig {
    /// The Redis server carrying the decisions: `redis://host:port[/db]` (plain TCP; username
    /// and password in the URL if the server wants them). Default: none, sharing off.
    pub redis: Option<String>,
    /// The pub/sub channel every instance of one fleet publishes to and subscribes to; fleets
    /// that must not share use different channels. Default `kvrouter.decisions`.
    pub channel: String,
    /// Decisions waiting to be published; a decision that finds the queue full is dropped and
    /// counted (`kvrouter_sharing_dropped_total{reason="queue_full"}`), never waited for.
    /// Default 4096.
    pub queue_capacity: usize,
    /// Longest a connect or a publish to Redis may take before it counts as failed, in ms
    /// (real time). Default 500.
    pub timeout_ms: u64,
    /// Longest pause between reconnection attempts, in ms (real time); attempts start 100 ms
    /// apart and double up to it. Default 5000.
    pub reconnect_max_ms: u64,
}

impl Default for SharingConfig {
    fn default() -> Self {
        SharingConfig {
            redis: None,
            channel: "kvrouter.decisions".into(),
            queue_capacity: 4096,
            timeout_ms: 500,
            reconnect_max_ms: 5000,
        }
    }
}

impl SharingConfig {
    /// Whether decisions are shared (`redis` set).
    pub fn enabled(&self) -> bool {
        self.redis.is_some()
    }

    pub(super) fn validate(&self, errors: &mut Errors) {
        if let Some(url) = &self.redis {
            match url.split_once("://") {
                Some(("redis", rest)) if !rest.is_empty() && !rest.starts_with('/') => {}
                Some(("rediss", _)) => errors.push(
                    "sharing.redis",
                    "TLS (rediss://) is not supported; use redis:// on a private network",
                ),
                _ => errors.push(
                    "sharing.redis",
                    format!("must be a redis://host:port URL (got {url:?})"),
                ),
            }
        }
        if self.channel.is_empty() {
            errors.push("sharing.channel", "must not be empty");
        }
        if self.queue_capacity == 0 {
            errors.push("sharing.queue_capacity", "must be > 0");
        }
        if self.timeout_ms == 0 {
            errors.push("sharing.timeout_ms", "must be > 0");
        }
        if self.reconnect_max_ms < 100 {
            errors.push("sharing.reconnect_max_ms", "must be >= 100");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const POOL: &str = "pools: [{name: p, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]";

    fn errors(sharing: &str) -> Vec<String> {
        Config::from_yaml(&format!("sharing: {sharing}\n{POOL}"))
            .unwrap()
            .validate()
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn off_by_default() {
        let c = Config::default().sharing;
        assert!(!c.enabled());
        assert_eq!(c.channel, "kvrouter.decisions");
    }

    #[test]
    fn bad_values_are_named() {
        for (yaml, expected) in [
            (
                "{redis: 'http://x:1'}",
                "sharing.redis: must be a redis://host:port URL (got \"http://x:1\")",
            ),
            (
                "{redis: 'rediss://x:1'}",
                "sharing.redis: TLS (rediss://) is not supported; use redis:// on a private network",
            ),
            ("{channel: ''}", "sharing.channel: must not be empty"),
            ("{queue_capacity: 0}", "sharing.queue_capacity: must be > 0"),
            ("{timeout_ms: 0}", "sharing.timeout_ms: must be > 0"),
            ("{reconnect_max_ms: 10}", "sharing.reconnect_max_ms: must be >= 100"),
        ] {
            let errors = errors(yaml);
            assert!(errors.contains(&expected.to_string()), "{yaml}: {errors:?}");
        }
        assert!(errors("{redis: 'redis://127.0.0.1:6379'}").is_empty());
    }

    #[test]
    fn unknown_fields_are_errors() {
        let err = Config::from_yaml(&format!("sharing: {{redis_url: 'redis://x:1'}}\n{POOL}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("redis_url"), "{err}");
    }
}
