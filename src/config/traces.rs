//! The `tracing` section: OpenTelemetry traces of routing decisions, exported over OTLP/gRPC.
//!
//! ```yaml
//! tracing:
//!   enabled: true
//!   otlp_endpoint: http://otel-collector.observability:4317
//!   sampling_ratio: 0.1      # of requests that arrive without a sampled parent
//! ```
//!
//! Read once at start-up (the exporter and the global subscriber are installed then): a change
//! takes a restart.

use serde::{Deserialize, Serialize};

use super::validate::Errors;

/// OpenTelemetry traces: one span per routing decision, a child of the gateway's span when the
/// request carries a W3C `traceparent`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    /// Create and export decision spans. Default false: no span is created, no header is kept,
    /// nothing is exported.
    pub enabled: bool,
    /// The OTLP/gRPC collector, `http://host:port`. Default `http://127.0.0.1:4317`.
    pub otlp_endpoint: String,
    /// Fraction of traces to sample, in [0, 1], for requests without a parent (and, when
    /// `parent_based` is false, for every request; the trace id decides, so every service that
    /// samples by ratio keeps the same traces). Default 1.0.
    pub sampling_ratio: f64,
    /// Follow the parent's sampled flag when the request carries a `traceparent`: the gateway
    /// decides, and the router's span joins every trace it keeps. Default true.
    pub parent_based: bool,
    /// The `service.name` of the exported spans. Default `kvrouter`.
    pub service_name: String,
    /// How often finished spans are sent to the collector, in milliseconds. Default 5000.
    pub export_interval_ms: u64,
    /// Longest one export may take before it is abandoned (spans dropped), in milliseconds.
    /// Default 10000.
    pub export_timeout_ms: u64,
    /// Most finished spans waiting to be exported; past this, new spans are dropped (never
    /// waited for). Default 8192.
    pub max_queue_spans: usize,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            otlp_endpoint: "http://127.0.0.1:4317".into(),
            sampling_ratio: 1.0,
            parent_based: true,
            service_name: "kvrouter".into(),
            export_interval_ms: 5000,
            export_timeout_ms: 10_000,
            max_queue_spans: 8192,
        }
    }
}

impl TracingConfig {
    pub(super) fn validate(&self, errors: &mut Errors) {
        if !(self.sampling_ratio.is_finite() && (0.0..=1.0).contains(&self.sampling_ratio)) {
            errors.push(
                "tracing.sampling_ratio",
                format!("must be in [0, 1] (got {})", self.sampling_ratio),
            );
        }
        let endpoint = self.otlp_endpoint.as_str();
        let rest = endpoint
            .strip_prefix("http://")
            .or_else(|| endpoint.strip_prefix("https://"));
        match rest {
            None => errors.push(
                "tracing.otlp_endpoint",
                format!("{endpoint:?} must be an http:// or https:// URL"),
            ),
            Some(rest) => {
                let authority = rest.split('/').next().unwrap_or("");
                let port_ok = authority
                    .rsplit_once(':')
                    .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
                if !port_ok {
                    errors.push(
                        "tracing.otlp_endpoint",
                        format!("{endpoint:?} must name a host and port (OTLP/gRPC: 4317)"),
                    );
                }
            }
        }
        if self.service_name.trim().is_empty() {
            errors.push("tracing.service_name", "must not be empty");
        }
        if self.export_interval_ms == 0 {
            errors.push("tracing.export_interval_ms", "must be > 0");
        }
        if self.export_timeout_ms == 0 {
            errors.push("tracing.export_timeout_ms", "must be > 0");
        }
        if self.max_queue_spans == 0 {
            errors.push("tracing.max_queue_spans", "must be > 0");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn errors_of(yaml: &str) -> Vec<String> {
        let config = Config::from_yaml(&format!(
            "{yaml}\npools: [{{name: p, models: [m], endpoints: [{{address: '127.0.0.1:1'}}]}}]"
        ))
        .expect("parses");
        config.validate().iter().map(|e| e.to_string()).collect()
    }

    #[test]
    fn off_by_default_and_a_valid_section_passes() {
        let d = Config::default().tracing;
        assert!(!d.enabled);
        assert_eq!(d.sampling_ratio, 1.0);
        assert!(errors_of("tracing: {enabled: true, otlp_endpoint: 'http://collector:4317', sampling_ratio: 0.25}").is_empty());
    }

    #[test]
    fn bad_values_are_reported_with_their_paths() {
        let cases = [
            (
                "tracing: {sampling_ratio: 1.5}",
                "tracing.sampling_ratio: must be in [0, 1] (got 1.5)",
            ),
            (
                "tracing: {sampling_ratio: -0.1}",
                "tracing.sampling_ratio: must be in [0, 1]",
            ),
            (
                "tracing: {otlp_endpoint: 'collector:4317'}",
                "tracing.otlp_endpoint: \"collector:4317\" must be an http:// or https:// URL",
            ),
            (
                "tracing: {otlp_endpoint: 'http://collector'}",
                "tracing.otlp_endpoint: \"http://collector\" must name a host and port",
            ),
            (
                "tracing: {service_name: ' '}",
                "tracing.service_name: must not be empty",
            ),
            (
                "tracing: {export_timeout_ms: 0}",
                "tracing.export_timeout_ms: must be > 0",
            ),
            (
                "tracing: {export_interval_ms: 0}",
                "tracing.export_interval_ms: must be > 0",
            ),
            (
                "tracing: {max_queue_spans: 0}",
                "tracing.max_queue_spans: must be > 0",
            ),
        ];
        for (yaml, expected) in cases {
            let errors = errors_of(yaml);
            assert!(
                errors.iter().any(|e| e.starts_with(expected)),
                "{yaml}: expected {expected:?} in {errors:?}"
            );
        }
        assert!(
            Config::from_yaml("tracing: {sample: 1}").is_err(),
            "unknown fields are errors"
        );
    }
}
