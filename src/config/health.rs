//! The `health` section: active probes, ejection on failed scrapes, and the per-endpoint circuit
//! breaker fed by request outcomes.

use serde::{Deserialize, Serialize};

use super::validate::Errors;

/// When an endpoint is taken out of rotation and when it comes back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Active probes of each endpoint's health path.
    pub probe: ProbeConfig,
    /// Consecutive failed metric scrapes (connection refused, timeout) eject an endpoint like
    /// failed probes do, with the probe's thresholds; scrapes run every 50 ms, so a dead replica
    /// is out within a few hundred ms even when it receives no traffic. Default true.
    pub eject_on_scrape_failures: bool,
    /// The circuit breaker fed by request outcomes (5xx, connect failures, resets).
    pub breaker: BreakerConfig,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            probe: ProbeConfig::default(),
            eject_on_scrape_failures: true,
            breaker: BreakerConfig::default(),
        }
    }
}

/// Active health probes (`GET <path>`; any 2xx is healthy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProbeConfig {
    /// Probe at all. Default true.
    pub enabled: bool,
    /// The health path on each endpoint's address. Default `/health` (vLLM and SGLang).
    pub path: String,
    /// Time between two probes of one endpoint, in ms (jittered by ±10%). Default 1000.
    pub interval_ms: u64,
    /// A probe not answered within this many ms fails. Default 1000.
    pub timeout_ms: u64,
    /// Consecutive failures that mark an endpoint unhealthy. Default 3.
    pub failure_threshold: u32,
    /// Consecutive successes that mark an unhealthy endpoint healthy again. Default 2.
    pub success_threshold: u32,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: "/health".to_string(),
            interval_ms: 1000,
            timeout_ms: 1000,
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

/// The per-endpoint circuit breaker: closed (routable) -> open (ejected) after consecutive failed
/// requests -> half-open (a bounded trickle of real requests) after the open time -> closed after
/// consecutive successes, or open again (for twice as long, up to the maximum) on a failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Use the breaker at all. Default true.
    pub enabled: bool,
    /// Consecutive failed requests (5xx from the replica, or Envoy had to retry it elsewhere:
    /// connect failure, reset, 503) that open the breaker. A slow response is not a failure.
    /// Default 3.
    pub failure_threshold: u32,
    /// How long the breaker stays open the first time, in ms. Default 5000.
    pub open_ms: u64,
    /// Each re-opening from half-open doubles the open time, up to this, in ms. Default 60000.
    pub max_open_ms: u64,
    /// Requests let through at once while half-open. Default 1.
    pub half_open_requests: u32,
    /// Consecutive successful requests that close a half-open breaker. Default 2.
    pub success_threshold: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            failure_threshold: 3,
            open_ms: 5000,
            max_open_ms: 60_000,
            half_open_requests: 1,
            success_threshold: 2,
        }
    }
}

impl HealthConfig {
    pub(super) fn validate(&self, errors: &mut Errors) {
        let p = &self.probe;
        if !p.path.starts_with('/') {
            errors.push(
                "health.probe.path",
                format!("{:?} must start with /", p.path),
            );
        }
        for (field, value) in [
            ("interval_ms", p.interval_ms),
            ("timeout_ms", p.timeout_ms),
            ("failure_threshold", u64::from(p.failure_threshold)),
            ("success_threshold", u64::from(p.success_threshold)),
        ] {
            if value == 0 {
                errors.push(format!("health.probe.{field}"), "must be > 0");
            }
        }
        let b = &self.breaker;
        for (field, value) in [
            ("failure_threshold", u64::from(b.failure_threshold)),
            ("open_ms", b.open_ms),
            ("half_open_requests", u64::from(b.half_open_requests)),
            ("success_threshold", u64::from(b.success_threshold)),
        ] {
            if value == 0 {
                errors.push(format!("health.breaker.{field}"), "must be > 0");
            }
        }
        if b.max_open_ms < b.open_ms {
            errors.push("health.breaker.max_open_ms", "must be >= open_ms");
        }
    }
}
