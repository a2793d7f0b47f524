//! The `load` section: scraping the engines' own load metrics, and learning each endpoint's real
//! speed from its responses.

use serde::{Deserialize, Serialize};

use super::validate::Errors;

/// Live load signals beyond the router's own in-flight counts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// Scraping each endpoint's Prometheus `/metrics` (queue, running batch, KV usage, cache
    /// size).
    pub scrape: ScrapeConfig,
    /// Learning each endpoint's prefill speed and TTFT error from observed first-byte times.
    pub learning: LearningConfig,
}

/// How engine metrics are scraped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrapeConfig {
    /// Scrape at all. Default true. Pools whose `engine` is `other` are never scraped.
    pub enabled: bool,
    /// Time between two scrapes of one endpoint, in ms. Default 50 (the llm-d endpoint picker's
    /// refresh interval). Must be >= 10.
    pub interval_ms: u64,
    /// Each wait is `interval_ms × (1 + u)` with `u` uniform in `[-jitter, +jitter]`, so the
    /// scrapes of many endpoints do not stay in lock-step. 0..=0.5. Default 0.1.
    pub jitter: f64,
    /// A scrape not answered within this many ms counts as failed. Default 1000.
    pub timeout_ms: u64,
    /// At most this many scrapes in flight at once, over all endpoints. Default 32.
    pub max_concurrent: usize,
    /// A scraped value older than this many ms is not trusted: policies see no engine load for
    /// the endpoint and fall back to the router's own in-flight counts, and the decision records
    /// it. Default 2000 (the llm-d endpoint picker's staleness threshold).
    pub staleness_ms: u64,
    /// The metrics path on each endpoint's address. Default `/metrics`.
    pub path: String,
    /// Largest metrics body read, in bytes; a longer one fails the scrape (kind `too-large`)
    /// after reading at most this much. Redirects are never followed. At least 65536.
    /// Default 4194304 (4 MiB; a real vLLM exposition is about 53 KB).
    pub max_body_bytes: usize,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_ms: 50,
            jitter: 0.1,
            timeout_ms: 1000,
            max_concurrent: 32,
            staleness_ms: 2000,
            path: "/metrics".to_string(),
            max_body_bytes: 4 << 20,
        }
    }
}

/// How each endpoint's speed is learned from what the router observes (see `load::learned`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LearningConfig {
    /// Learn at all. Default true.
    pub enabled: bool,
    /// EWMA weight of a new sample, 0 < alpha <= 1. Default 0.2.
    pub alpha: f64,
    /// Samples needed before a learned value replaces the configured one. Default 5.
    pub min_samples: u32,
    /// A first-byte time yields a prefill-speed sample only if the prefill work it measured
    /// (tokens queued ahead plus its own uncached tokens) is at least this many tokens; smaller
    /// requests are dominated by fixed costs. Default 256.
    pub min_sample_tokens: u64,
    /// Learned prefill speeds are clamped to at least this, tokens per second. Default 100.
    pub min_prefill_tokens_per_s: f64,
    /// ... and at most this, tokens per second. Default 1000000.
    pub max_prefill_tokens_per_s: f64,
    /// Also learn each endpoint's TTFT residual (observed minus predicted, e.g. queueing the
    /// router cannot see) and add it to its predictions. Default false: on the benchmark's
    /// shared-prefix workload at high load the residual grew fastest on the replicas holding
    /// the busiest prefixes and pushed their traffic to cold replicas (TTFT p50 0.8-1.3 s with
    /// it, 0.4 s without); the scraped queue already prices what the router cannot see.
    pub ttft_residual: bool,
    /// Without new samples the residual halves every this many ms, so an endpoint that stopped
    /// receiving traffic because it looked slow is tried again. Default 5000.
    pub residual_half_life_ms: u64,
    /// The residual added to a prediction is clamped to `0..=max_residual_ms`. Default 10000.
    pub max_residual_ms: f64,
}

impl Default for LearningConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            alpha: 0.2,
            min_samples: 5,
            min_sample_tokens: 256,
            min_prefill_tokens_per_s: 100.0,
            max_prefill_tokens_per_s: 1_000_000.0,
            ttft_residual: false,
            residual_half_life_ms: 5000,
            max_residual_ms: 10_000.0,
        }
    }
}

impl LoadConfig {
    pub(super) fn validate(&self, errors: &mut Errors) {
        let s = &self.scrape;
        if s.interval_ms < 10 {
            errors.push("load.scrape.interval_ms", "must be >= 10");
        }
        if !(0.0..=0.5).contains(&s.jitter) {
            errors.push(
                "load.scrape.jitter",
                format!("must be in 0..=0.5 (got {})", s.jitter),
            );
        }
        if s.timeout_ms == 0 {
            errors.push("load.scrape.timeout_ms", "must be > 0");
        }
        if s.max_concurrent == 0 {
            errors.push("load.scrape.max_concurrent", "must be > 0");
        }
        if s.staleness_ms == 0 {
            errors.push("load.scrape.staleness_ms", "must be > 0");
        }
        if s.max_body_bytes < 65_536 {
            errors.push(
                "load.scrape.max_body_bytes",
                format!("must be at least 65536 (got {})", s.max_body_bytes),
            );
        }
        if !s.path.starts_with('/') {
            errors.push(
                "load.scrape.path",
                format!("{:?} must start with /", s.path),
            );
        }
        let l = &self.learning;
        if !(l.alpha > 0.0 && l.alpha <= 1.0) {
            errors.push(
                "load.learning.alpha",
                format!("must be in (0, 1] (got {})", l.alpha),
            );
        }
        if !(l.min_prefill_tokens_per_s.is_finite() && l.min_prefill_tokens_per_s > 0.0) {
            errors.push(
                "load.learning.min_prefill_tokens_per_s",
                "must be a finite number > 0",
            );
        }
        if !(l.max_prefill_tokens_per_s.is_finite()
            && l.max_prefill_tokens_per_s >= l.min_prefill_tokens_per_s)
        {
            errors.push(
                "load.learning.max_prefill_tokens_per_s",
                "must be finite and >= min_prefill_tokens_per_s",
            );
        }
        if l.residual_half_life_ms == 0 {
            errors.push("load.learning.residual_half_life_ms", "must be > 0");
        }
        if !(l.max_residual_ms.is_finite() && l.max_residual_ms >= 0.0) {
            errors.push(
                "load.learning.max_residual_ms",
                "must be a finite number >= 0",
            );
        }
    }
}
