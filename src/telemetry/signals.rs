//! Metrics of the live signals: scrapes, engine load as scraped, staleness, health and breaker
//! state, ejections, and what was learned per endpoint.
//!
//! Per-endpoint gauges are recomputed from the endpoint set at every render (so removed
//! endpoints disappear); counters and histograms are updated where the events happen, and the
//! series of an endpoint are removed at the first render after it left the set.

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::series::EndpointSeries;
use super::EndpointLabels;
use crate::config::{Config, HealthConfig, LearningConfig};
use crate::discovery::{Endpoint, EndpointSet};
use crate::health::{BreakerState, Change};

/// Labels of a failed scrape.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScrapeErrorLabels {
    /// `ip:port`.
    pub endpoint: String,
    /// `connect`, `timeout`, `status` or `parse`.
    pub kind: String,
}

/// Labels of a health change.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthChangeLabels {
    /// `ip:port`.
    pub endpoint: String,
    /// `probe`, `scrape` or `breaker`.
    pub cause: String,
    /// The new state: `up`, `down`, `closed`, `open`, `half-open`.
    pub to: String,
}

/// Labels of an ejection.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EjectionLabels {
    /// `ip:port`.
    pub endpoint: String,
    /// `probe`, `scrape` or `breaker`.
    pub cause: String,
}

/// Labels naming a policy.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    /// Policy name.
    pub policy: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// The signal metrics (registered under `kvrouter_`).
#[derive(Debug)]
pub struct SignalMetrics {
    scrape_seconds: Family<EndpointLabels, Histogram>,
    scrape_errors: Family<ScrapeErrorLabels, Counter>,
    signal_age: Family<EndpointLabels, FloatGauge>,
    engine_waiting: Family<EndpointLabels, Gauge>,
    engine_running: Family<EndpointLabels, Gauge>,
    engine_kv_usage: Family<EndpointLabels, FloatGauge>,
    healthy: Family<EndpointLabels, Gauge>,
    breaker_state: Family<EndpointLabels, Gauge>,
    health_changes: Family<HealthChangeLabels, Counter>,
    ejections: Family<EjectionLabels, Counter>,
    learned_speed: Family<EndpointLabels, FloatGauge>,
    ttft_residual: Family<EndpointLabels, FloatGauge>,
    stale_decisions: Family<PolicyLabels, Counter>,
    config: Mutex<(HealthConfig, LearningConfig)>,
    /// Series naming an endpoint, removed once it leaves the endpoint set.
    endpoint_series: EndpointSeries<Tracked>,
}

/// A series of [`SignalMetrics`] that is not rebuilt per scrape and names an endpoint.
#[derive(Debug)]
enum Tracked {
    Scrape(EndpointLabels),
    ScrapeError(ScrapeErrorLabels),
    Health(HealthChangeLabels),
    Ejection(EjectionLabels),
}

fn labels(ep: &Endpoint) -> EndpointLabels {
    EndpointLabels {
        endpoint: ep.address_str.to_string(),
        pool: ep.pool.to_string(),
    }
}

impl SignalMetrics {
    /// Registers the signal metrics in `registry`.
    pub fn register(registry: &mut Registry) -> SignalMetrics {
        let m = SignalMetrics {
            scrape_seconds: Family::new_with_constructor(|| {
                // 0.5 ms .. ~1 s: a healthy scrape takes a millisecond or two.
                Histogram::new(exponential_buckets(0.0005, 2.0, 12))
            }),
            scrape_errors: Family::default(),
            signal_age: Family::default(),
            engine_waiting: Family::default(),
            engine_running: Family::default(),
            engine_kv_usage: Family::default(),
            healthy: Family::default(),
            breaker_state: Family::default(),
            health_changes: Family::default(),
            ejections: Family::default(),
            learned_speed: Family::default(),
            ttft_residual: Family::default(),
            stale_decisions: Family::default(),
            config: Mutex::new(Default::default()),
            endpoint_series: EndpointSeries::default(),
        };
        registry.register(
            "scrape_duration_seconds",
            "Time to scrape and parse an endpoint's engine metrics",
            m.scrape_seconds.clone(),
        );
        registry.register(
            "scrape_errors",
            "Failed engine-metric scrapes, by endpoint and kind (connect, timeout, status, parse, too-large, redirect)",
            m.scrape_errors.clone(),
        );
        registry.register(
            "endpoint_engine_signal_age_seconds",
            "Age of the endpoint's last scraped engine sample (older than load.scrape.staleness_ms is ignored)",
            m.signal_age.clone(),
        );
        registry.register(
            "endpoint_engine_waiting_requests",
            "Requests waiting in the endpoint's engine queue, as last scraped",
            m.engine_waiting.clone(),
        );
        registry.register(
            "endpoint_engine_running_requests",
            "Requests in the endpoint's running batch, as last scraped",
            m.engine_running.clone(),
        );
        registry.register(
            "endpoint_engine_kv_cache_usage",
            "The endpoint's KV-cache usage (0..1), as last scraped",
            m.engine_kv_usage.clone(),
        );
        registry.register(
            "endpoint_healthy",
            "1 if the endpoint may be picked (probe and scrape up, breaker not open), else 0",
            m.healthy.clone(),
        );
        registry.register(
            "endpoint_breaker_state",
            "The endpoint's circuit breaker: 0 closed, 1 half-open, 2 open",
            m.breaker_state.clone(),
        );
        registry.register(
            "health_changes",
            "Changes of an endpoint's health views (probe, scrape, breaker), by new state",
            m.health_changes.clone(),
        );
        registry.register(
            "ejections",
            "Times an endpoint was taken out of rotation, by cause",
            m.ejections.clone(),
        );
        registry.register(
            "endpoint_learned_prefill_tokens_per_second",
            "Prefill speed learned from observed first-byte times (once trusted)",
            m.learned_speed.clone(),
        );
        registry.register(
            "endpoint_ttft_residual_seconds",
            "Learned excess of observed over predicted TTFT added to the endpoint's predictions",
            m.ttft_residual.clone(),
        );
        registry.register(
            "decisions_on_stale_signals",
            "Decisions where some candidate's engine signals were stale or missing, so the policy used the router's own counts for it",
            m.stale_decisions.clone(),
        );
        m
    }

    /// Keeps the config sections the gauges are computed with.
    pub fn configure(&self, config: &Config) {
        *self.config.lock() = (config.health.clone(), config.load.learning.clone());
    }

    /// Counts one scrape of `ep` that took `took`, failed with `error` (a kind) if it did.
    pub fn record_scrape(&self, ep: &Endpoint, took: Duration, error: Option<&'static str>) {
        let l = labels(ep);
        if self.scrape_seconds.get(&l).is_none() {
            self.endpoint_series
                .note(&ep.address_str, Tracked::Scrape(l.clone()));
        }
        self.scrape_seconds
            .get_or_create(&l)
            .observe(took.as_secs_f64());
        if let Some(kind) = error {
            let l = ScrapeErrorLabels {
                endpoint: ep.address_str.to_string(),
                kind: kind.to_string(),
            };
            if self.scrape_errors.get(&l).is_none() {
                self.endpoint_series
                    .note(&ep.address_str, Tracked::ScrapeError(l.clone()));
            }
            self.scrape_errors.get_or_create(&l).inc();
        }
    }

    /// Counts a change of `ep`'s health.
    pub fn record_health_change(&self, ep: &Endpoint, change: Change) {
        let l = HealthChangeLabels {
            endpoint: ep.address_str.to_string(),
            cause: change.cause.as_str().to_string(),
            to: change.to.to_string(),
        };
        if self.health_changes.get(&l).is_none() {
            self.endpoint_series
                .note(&ep.address_str, Tracked::Health(l.clone()));
        }
        self.health_changes.get_or_create(&l).inc();
        if change.is_ejection() {
            let l = EjectionLabels {
                endpoint: ep.address_str.to_string(),
                cause: change.cause.as_str().to_string(),
            };
            if self.ejections.get(&l).is_none() {
                self.endpoint_series
                    .note(&ep.address_str, Tracked::Ejection(l.clone()));
            }
            self.ejections.get_or_create(&l).inc();
        }
    }

    /// Counts a decision made on stale signals.
    pub fn record_stale_decision(&self, policy: &str) {
        self.stale_decisions
            .get_or_create(&PolicyLabels {
                policy: policy.to_string(),
            })
            .inc();
    }

    /// Removes the series of endpoints not in `live` (addresses of the current set).
    pub(super) fn forget_gone(&self, live: &HashSet<&str>) {
        for gone in self.endpoint_series.prune(live) {
            match gone {
                Tracked::Scrape(l) => self.scrape_seconds.remove(&l),
                Tracked::ScrapeError(l) => self.scrape_errors.remove(&l),
                Tracked::Health(l) => self.health_changes.remove(&l),
                Tracked::Ejection(l) => self.ejections.remove(&l),
            };
        }
    }

    /// Recomputes the per-endpoint gauges from `endpoints`.
    pub(super) fn refresh(&self, endpoints: &EndpointSet) {
        let (health, learning) = self.config.lock().clone();
        let now = tokio::time::Instant::now();
        for family in [
            &self.signal_age,
            &self.engine_kv_usage,
            &self.learned_speed,
            &self.ttft_residual,
        ] {
            family.clear();
        }
        for family in [
            &self.engine_waiting,
            &self.engine_running,
            &self.healthy,
            &self.breaker_state,
        ] {
            family.clear();
        }
        for ep in endpoints.all() {
            let l = labels(ep);
            if let Some(s) = ep.load.engine.last() {
                self.signal_age
                    .get_or_create(&l)
                    .set(now.saturating_duration_since(s.scraped_at).as_secs_f64());
                self.engine_waiting
                    .get_or_create(&l)
                    .set(s.waiting_requests as i64);
                self.engine_running
                    .get_or_create(&l)
                    .set(s.running_requests as i64);
                self.engine_kv_usage.get_or_create(&l).set(s.kv_cache_usage);
            }
            let h = ep.health.snapshot(now, &health);
            self.healthy.get_or_create(&l).set(i64::from(h.routable));
            self.breaker_state.get_or_create(&l).set(match h.breaker {
                BreakerState::Closed => 0,
                BreakerState::HalfOpen => 1,
                BreakerState::Open => 2,
            });
            let learned = ep.load.learned.snapshot(&learning, now);
            if let Some(speed) = learned.prefill_tokens_per_s {
                self.learned_speed.get_or_create(&l).set(speed);
            }
            self.ttft_residual
                .get_or_create(&l)
                .set(learned.ttft_residual_ms / 1e3);
        }
    }
}
