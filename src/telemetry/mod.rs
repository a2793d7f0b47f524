//! Logging set-up and the router's Prometheus metrics.
//!
//! Metric handles are registered once; the hot path only increments them. Labels are endpoint
//! addresses, policy names and status codes: never prompt text.

mod cache;
mod gie;
mod series;
mod sharing;
mod signals;

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use cache::CacheMetrics;
pub use gie::{GieMetrics, GieOutcome};
use series::EndpointSeries;
pub use sharing::{DropReason, SharingMetrics};
pub use signals::SignalMetrics;

use crate::config::LogFormat;
use crate::discovery::EndpointSet;
use crate::index::IdCounts;

/// Labels of a routing decision.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// Policy name.
    pub policy: String,
    /// Picked endpoint, `ip:port`.
    pub endpoint: String,
}

/// Labels carrying an HTTP status code.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// HTTP status code.
    pub code: u16,
}

/// Labels of an upstream response.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    /// Endpoint that served it, `ip:port`.
    pub endpoint: String,
    /// Status class: `2xx`, `4xx`, `5xx`, ...
    pub class: String,
}

/// Labels of one endpoint.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// `ip:port`.
    pub endpoint: String,
    /// Its pool.
    pub pool: String,
}

/// Labels of an outcome.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`.
    pub result: String,
}

/// Labels of a stream's end.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamEndLabels {
    /// `complete` (response ended), `immediate` (we answered), `cancelled` (Envoy or the client
    /// went away first), `unrouted` (no decision was needed).
    pub outcome: String,
}

/// Labels of the endpoint-id gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdStateLabels {
    /// `in_use`, `quarantined` or `free`.
    pub state: String,
}

/// Every metric the router exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    decision_seconds: Histogram,
    immediate_responses: Family<CodeLabels, Counter>,
    upstream_responses: Family<ResponseLabels, Counter>,
    streams_active: Gauge,
    stream_ends: Family<StreamEndLabels, Counter>,
    protocol_anomalies: Counter,
    config_reloads: Family<ResultLabels, Counter>,
    endpoint_in_flight: Family<EndpointLabels, Gauge>,
    endpoint_prefill_tokens: Family<EndpointLabels, Gauge>,
    endpoint_ids: Family<IdStateLabels, Gauge>,
    endpoint_ids_reclaimed: Counter,
    /// [`crate::budget`]'s totals, read at scrape time: buffered bodies, after-decision work.
    held_bytes: [Gauge; 2],
    /// Seconds long bodies' streams were held back by `routing.heavy_body_bytes_per_s`.
    heavy_body_held_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Long bodies refused (503) for waiting past `routing.heavy_body_max_wait_ms`.
    heavy_body_refused: Counter,
    /// Scrapes, engine load, staleness, health, ejections, learned speeds.
    pub signals: SignalMetrics,
    /// Matched-token share and cache source of routed decisions.
    pub cache: CacheMetrics,
    /// The same facts under the Gateway API Inference Extension's names (own registry).
    pub gie: GieMetrics,
    /// Decisions shared with peer instances (`sharing`).
    pub sharing: SharingMetrics,
    /// Counter series naming an endpoint, removed once it leaves the endpoint set.
    endpoint_series: EndpointSeries<Tracked>,
    scrape_lock: Mutex<()>,
}

/// A counter series of [`Metrics`] that names an endpoint.
#[derive(Debug)]
enum Tracked {
    Decision(DecisionLabels),
    Upstream(ResponseLabels),
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `kvrouter_` prefix.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvrouter");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "decisions",
            "Routing decisions by policy and picked endpoint",
            decisions.clone(),
        );
        // 1 us .. ~1 s in powers of two: a decision is expected in the tens of microseconds,
        // but a long prompt tokenized on busy cores takes up to `routing.prefix_budget_ms`
        // (100 ms) and more; with a top bucket at 33 ms every such decision read as 33 ms.
        let decision_seconds = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(1e-6, 2.0, 21),
        );
        registry.register(
            "decision_duration_seconds",
            "Time to pick an endpoint, from parsed request to ranked endpoints",
            decision_seconds.clone(),
        );
        let immediate_responses = Family::<CodeLabels, Counter>::default();
        registry.register(
            "immediate_responses",
            "Requests answered by the router itself, by HTTP status code",
            immediate_responses.clone(),
        );
        let upstream_responses = Family::<ResponseLabels, Counter>::default();
        registry.register(
            "upstream_responses",
            "Responses from replicas seen on the response path, by endpoint and status class",
            upstream_responses.clone(),
        );
        let streams_active = Gauge::default();
        registry.register(
            "streams_active",
            "ext_proc streams currently open",
            streams_active.clone(),
        );
        let stream_ends = Family::<StreamEndLabels, Counter>::default();
        registry.register(
            "streams_ended",
            "ext_proc streams that ended, by outcome",
            stream_ends.clone(),
        );
        let protocol_anomalies = Counter::default();
        registry.register(
            "protocol_anomalies",
            "ext_proc messages that did not fit the stream's phase (answered with CONTINUE)",
            protocol_anomalies.clone(),
        );
        let config_reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "config_reloads",
            "Config file reloads by result",
            config_reloads.clone(),
        );
        let endpoint_in_flight = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "endpoint_in_flight_requests",
            "Requests routed to the endpoint whose response has not ended",
            endpoint_in_flight.clone(),
        );
        let endpoint_prefill_tokens = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "endpoint_in_flight_prefill_tokens",
            "Estimated prompt tokens routed to the endpoint that have not produced a first byte",
            endpoint_prefill_tokens.clone(),
        );
        let endpoint_ids = Family::<IdStateLabels, Gauge>::default();
        registry.register(
            "endpoint_ids",
            "Endpoint ids interned from addresses, by state: in_use (a live endpoint or KV-event stream holds it), quarantined (its endpoint left; reclaimed after a grace period), free (to be reused)",
            endpoint_ids.clone(),
        );
        let endpoint_ids_reclaimed = Counter::default();
        registry.register(
            "endpoint_ids_reclaimed",
            "Endpoint ids freed for reuse after their endpoint left for good",
            endpoint_ids_reclaimed.clone(),
        );
        let held_bytes = [Gauge::default(), Gauge::default()];
        registry.register(
            "buffered_body_bytes",
            "Request body bytes held by all streams while they arrive and are decided on \
             (bounded by routing.max_buffered_body_bytes; past it, 503 with retry-after)",
            held_bytes[0].clone(),
        );
        registry.register(
            "after_decision_held_bytes",
            "Rendered prompt bytes held by tokenizing queued after decisions (bounded at 256 MiB; \
             past it, kvrouter_deferred_tokenizings_total{result=\"dropped\"})",
            held_bytes[1].clone(),
        );
        let heavy_body_held_seconds = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "heavy_body_held_seconds",
            "Time streams of bodies longer than routing.heavy_body_bytes were held back from \
             reading by routing.heavy_body_bytes_per_s (summed over streams), seconds",
            heavy_body_held_seconds.clone(),
        );
        let heavy_body_refused = Counter::default();
        registry.register(
            "heavy_body_refused",
            "Bodies longer than routing.heavy_body_bytes answered 503 because their turn to be \
             read at routing.heavy_body_bytes_per_s would come past \
             routing.heavy_body_max_wait_ms",
            heavy_body_refused.clone(),
        );
        let signals = SignalMetrics::register(&mut registry);
        let cache = CacheMetrics::register(&mut registry);
        let sharing = SharingMetrics::register(&mut registry);
        Metrics {
            signals,
            cache,
            sharing,
            gie: GieMetrics::new(),
            registry,
            decisions,
            decision_seconds,
            immediate_responses,
            upstream_responses,
            streams_active,
            stream_ends,
            protocol_anomalies,
            config_reloads,
            endpoint_in_flight,
            endpoint_prefill_tokens,
            endpoint_ids,
            endpoint_ids_reclaimed,
            held_bytes,
            heavy_body_held_seconds,
            heavy_body_refused,
            endpoint_series: EndpointSeries::default(),
            scrape_lock: Mutex::new(()),
        }
    }

    /// Counts a decision and its latency.
    pub fn record_decision(&self, policy: &str, endpoint: &str, took: Duration) {
        let labels = DecisionLabels {
            policy: policy.to_string(),
            endpoint: endpoint.to_string(),
        };
        if self.decisions.get(&labels).is_none() {
            self.endpoint_series
                .note(endpoint, Tracked::Decision(labels.clone()));
        }
        self.decisions.get_or_create(&labels).inc();
        self.decision_seconds.observe(took.as_secs_f64());
    }

    /// Counts a response the router produced itself.
    pub fn record_immediate(&self, code: u16) {
        self.immediate_responses
            .get_or_create(&CodeLabels { code })
            .inc();
    }

    /// Counts a replica's response status.
    pub fn record_upstream_status(&self, endpoint: &str, status: u16) {
        let class = match status {
            100..=599 => format!("{}xx", status / 100),
            _ => "other".to_string(),
        };
        let labels = ResponseLabels {
            endpoint: endpoint.to_string(),
            class,
        };
        if self.upstream_responses.get(&labels).is_none() {
            self.endpoint_series
                .note(endpoint, Tracked::Upstream(labels.clone()));
        }
        self.upstream_responses.get_or_create(&labels).inc();
    }

    /// The counter of time long bodies were held back by their read rate.
    pub fn heavy_body_held_seconds(&self) -> Counter<f64, std::sync::atomic::AtomicU64> {
        self.heavy_body_held_seconds.clone()
    }

    /// The counter of long bodies refused for their read rate.
    pub fn heavy_body_refused(&self) -> Counter {
        self.heavy_body_refused.clone()
    }

    /// A stream opened; the returned value closes it (with its outcome) when dropped.
    pub fn stream_opened(&self) {
        self.streams_active.inc();
    }

    /// A stream ended with `outcome`.
    pub fn stream_closed(&self, outcome: &'static str) {
        self.streams_active.dec();
        self.stream_ends
            .get_or_create(&StreamEndLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts an out-of-phase ext_proc message.
    pub fn record_anomaly(&self) {
        self.protocol_anomalies.inc();
    }

    /// Counts a config reload attempt.
    pub fn record_reload(&self, ok: bool) {
        self.config_reloads
            .get_or_create(&ResultLabels {
                result: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }

    /// Sets the endpoint-id gauge to `counts` (read at scrape time: ids become quarantined
    /// whenever their last holder lets go).
    pub fn record_endpoint_ids(&self, counts: IdCounts) {
        for (state, n) in [
            ("in_use", counts.in_use),
            ("quarantined", counts.quarantined),
            ("free", counts.free),
        ] {
            self.endpoint_ids
                .get_or_create(&IdStateLabels {
                    state: state.to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Counts `n` endpoint ids freed for reuse.
    pub fn record_endpoint_ids_reclaimed(&self, n: usize) {
        self.endpoint_ids_reclaimed.inc_by(n as u64);
    }

    /// Renders every metric in the Prometheus text format, with per-endpoint gauges read from
    /// `endpoints` at this moment.
    pub fn render(&self, endpoints: &EndpointSet) -> String {
        let _one_scrape_at_a_time = self.scrape_lock.lock();
        let live: HashSet<&str> = endpoints.all().iter().map(|ep| &*ep.address_str).collect();
        for gone in self.endpoint_series.prune(&live) {
            match gone {
                Tracked::Decision(l) => self.decisions.remove(&l),
                Tracked::Upstream(l) => self.upstream_responses.remove(&l),
            };
        }
        self.signals.forget_gone(&live);
        self.endpoint_in_flight.clear();
        self.endpoint_prefill_tokens.clear();
        self.signals.refresh(endpoints);
        for ep in endpoints.all() {
            let labels = EndpointLabels {
                endpoint: ep.address_str.to_string(),
                pool: ep.pool.to_string(),
            };
            let load = ep.load.snapshot();
            self.endpoint_in_flight
                .get_or_create(&labels)
                .set(load.in_flight_requests as i64);
            self.endpoint_prefill_tokens
                .get_or_create(&labels)
                .set(load.in_flight_prefill_tokens as i64);
        }
        for (gauge, budget) in self.held_bytes.iter().zip([
            &crate::budget::BUFFERED_BODIES,
            &crate::budget::AFTER_DECISION,
        ]) {
            gauge.set(i64::try_from(budget.used()).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        self.gie.render(endpoints, &mut out);
        out
    }
}

/// The KV-event streams' state and counters in the Prometheus text format (rendered from their
/// status at scrape time, so removed endpoints disappear).
pub fn kv_events_text(statuses: &[crate::events::EndpointEventsStatus]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP kvrouter_kv_events_state Source of an endpoint's cache entries: 1 for its current state (trusted, partial, distrusted, absent).\n# TYPE kvrouter_kv_events_state gauge"
    );
    for s in statuses {
        let _ = writeln!(
            out,
            "kvrouter_kv_events_state{{endpoint=\"{}\",state=\"{}\",reason=\"{}\"}} 1",
            s.address,
            s.state.label(),
            s.state.reason().map_or("", |r| r.as_str())
        );
    }
    type Counter = fn(&crate::events::StreamCounters) -> u64;
    let counters: [(&str, &str, Counter); 7] = [
        ("messages", "KV-event messages received", |c| c.messages),
        ("events", "KV events applied", |c| c.events),
        (
            "blocks_mapped",
            "Engine blocks stored and mapped to the router's blocks",
            |c| c.blocks_mapped,
        ),
        ("blocks_removed", "Engine block copies removed", |c| {
            c.blocks_removed
        }),
        ("gaps", "Sequence gaps (events lost)", |c| c.gaps),
        ("restarts", "Publisher restarts seen", |c| c.restarts),
        ("malformed", "Undecodable messages", |c| c.malformed),
    ];
    for (name, help, get) in counters {
        let _ = writeln!(
            out,
            "# HELP kvrouter_kv_events_{name}_total {help}.\n# TYPE kvrouter_kv_events_{name}_total counter"
        );
        for s in statuses {
            let _ = writeln!(
                out,
                "kvrouter_kv_events_{name}_total{{endpoint=\"{}\"}} {}",
                s.address,
                get(&s.counters)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP kvrouter_kv_events_engine_blocks Engine blocks tracked per endpoint.\n# TYPE kvrouter_kv_events_engine_blocks gauge"
    );
    for s in statuses {
        let _ = writeln!(
            out,
            "kvrouter_kv_events_engine_blocks{{endpoint=\"{}\"}} {}",
            s.address, s.engine_blocks
        );
    }
    out
}

/// Installs the global `tracing` subscriber (level from `RUST_LOG`, default `info`).
/// Calling it twice is harmless.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolvedEndpoint;
    use crate::discovery::Registry as Endpoints;

    #[test]
    fn renders_prometheus_text_with_live_endpoint_gauges() {
        let m = Metrics::new();
        m.record_decision("least-loaded", "127.0.0.1:1", Duration::from_micros(20));
        // A decision past the prefix budget lands in a finite bucket, not only in +Inf.
        m.record_decision("least-loaded", "127.0.0.1:1", Duration::from_millis(120));
        m.record_immediate(404);
        m.record_upstream_status("127.0.0.1:1", 503);
        let endpoints = Endpoints::new(&[ResolvedEndpoint::new(
            "127.0.0.1:1".parse().unwrap(),
            "p",
            &["m"],
        )]);
        let set = endpoints.snapshot();
        let guard = set.all()[0].load.begin(7);
        m.record_endpoint_ids(endpoints.interner().counts());
        m.record_endpoint_ids_reclaimed(2);
        let text = m.render(&set);
        for needle in [
            "kvrouter_decisions_total{policy=\"least-loaded\",endpoint=\"127.0.0.1:1\"} 2",
            "kvrouter_immediate_responses_total{code=\"404\"} 1",
            "kvrouter_upstream_responses_total{endpoint=\"127.0.0.1:1\",class=\"5xx\"} 1",
            "kvrouter_endpoint_in_flight_requests{endpoint=\"127.0.0.1:1\",pool=\"p\"} 1",
            "kvrouter_endpoint_in_flight_prefill_tokens{endpoint=\"127.0.0.1:1\",pool=\"p\"} 7",
            "kvrouter_decision_duration_seconds_count 2",
            "kvrouter_decision_duration_seconds_bucket{le=\"0.065536\"} 1",
            "kvrouter_decision_duration_seconds_bucket{le=\"0.131072\"} 2",
            "kvrouter_endpoint_ids{state=\"in_use\"} 1",
            "kvrouter_endpoint_ids{state=\"quarantined\"} 0",
            "kvrouter_endpoint_ids_reclaimed_total 2",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        drop(guard);
        let text = m.render(&set);
        assert!(text.contains(
            "kvrouter_endpoint_in_flight_requests{endpoint=\"127.0.0.1:1\",pool=\"p\"} 0"
        ));
    }
}
