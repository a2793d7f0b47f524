//! [`DecisionSpan`]: the span of one routing decision.

use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::RemoteParent;
use crate::router::Decision;

/// The `tracing` target of decision spans and their events: the OpenTelemetry layer takes this
/// target only, and the log layer leaves it out.
pub const TARGET: &str = "kvrouter::decision";

/// The exported span's name.
pub const SPAN_NAME: &str = "kvrouter.decision";

/// The span of one decision; empty (and free) when tracing is off. The span ends when this is
/// dropped.
#[derive(Debug, Default)]
pub struct DecisionSpan(Option<tracing::Span>);

/// A rejection's class, from its HTTP status, for span events and attributes.
pub fn reason_class(status: u16) -> &'static str {
    match status {
        400 => "invalid_request",
        401 | 403 => "unauthorized",
        404 => "unknown_model",
        413 => "too_large",
        429 => "shed",
        503 => "no_endpoint",
        500..=599 => "internal",
        _ => "other",
    }
}

impl DecisionSpan {
    /// Opens the span of the decision on request `request_id`, a child of `parent` (the
    /// gateway's span) when there is one. Does nothing while tracing is off.
    #[inline]
    pub fn start(parent: Option<&RemoteParent>, request_id: &str) -> DecisionSpan {
        if !super::enabled() {
            return DecisionSpan(None);
        }
        DecisionSpan::open(parent, request_id)
    }

    #[cold]
    fn open(parent: Option<&RemoteParent>, request_id: &str) -> DecisionSpan {
        let span = tracing::info_span!(
            target: TARGET,
            SPAN_NAME,
            otel.kind = "server",
            otel.status_code = Empty,
            kvrouter.request_id = request_id,
            kvrouter.outcome = Empty,
            kvrouter.policy = Empty,
            kvrouter.model = Empty,
            gen_ai.request.model = Empty,
            kvrouter.adapter = Empty,
            kvrouter.candidates = Empty,
            kvrouter.endpoint = Empty,
            kvrouter.fallbacks = Empty,
            kvrouter.prompt_tokens = Empty,
            kvrouter.prompt_tokens_exact = Empty,
            kvrouter.matched_tokens = Empty,
            kvrouter.confirmed_tokens = Empty,
            kvrouter.predicted_ttft_ms = Empty,
            kvrouter.cache_source = Empty,
            kvrouter.engine_signal = Empty,
            kvrouter.engine_age_ms = Empty,
            kvrouter.stale_signals = Empty,
            http.response.status_code = Empty,
        );
        if let Some(p) = parent {
            // Only fails when the span is already closed or disabled: it is neither, or the
            // layer is not installed and nothing is exported anyway.
            let _ = span.set_parent(p.0.clone());
        }
        DecisionSpan(Some(span))
    }

    /// Records a routed decision's facts.
    pub fn routed(&self, d: &Decision) {
        let Some(span) = &self.0 else { return };
        let plan = &d.plan;
        let pick = plan.ranking.pick();
        let c = &plan.candidates[pick];
        let signals = &plan.signals[pick];
        span.record("kvrouter.outcome", "routed");
        span.record("kvrouter.policy", plan.policy);
        span.record("kvrouter.model", plan.model.as_str());
        span.record("gen_ai.request.model", plan.model.as_str());
        if let Some(a) = &plan.adapter {
            span.record("kvrouter.adapter", a.as_str());
        }
        span.record("kvrouter.candidates", plan.candidates.len() as u64);
        span.record("kvrouter.endpoint", &*plan.primary().address_str);
        // The destination is the pick then its fallbacks, comma-separated.
        let fallbacks = d.destination.split_once(',').map_or("", |(_, rest)| rest);
        span.record("kvrouter.fallbacks", fallbacks);
        span.record("kvrouter.prompt_tokens", plan.prefix.tokens);
        span.record("kvrouter.prompt_tokens_exact", plan.prefix.exact);
        span.record("kvrouter.matched_tokens", c.matched_tokens);
        span.record("kvrouter.confirmed_tokens", c.confirmed_tokens);
        if let Some(ttft) = plan.ranking.predicted_ttft_ms.as_ref().map(|t| t[pick]) {
            span.record("kvrouter.predicted_ttft_ms", ttft);
        }
        span.record("kvrouter.cache_source", signals.cache_source);
        span.record("kvrouter.engine_signal", signals.engine);
        if let Some(age) = signals.engine_age_ms {
            span.record("kvrouter.engine_age_ms", age);
        }
        span.record("kvrouter.stale_signals", plan.stale_signals());
    }

    /// Records that the router answered the request itself with `status`: an event on the
    /// span (status, reason class); 5xx also mark the span as an error.
    pub fn rejected(&self, status: u16) {
        let Some(span) = &self.0 else { return };
        let class = reason_class(status);
        span.record("kvrouter.outcome", "rejected");
        span.record("http.response.status_code", u64::from(status));
        if status >= 500 {
            span.record("otel.status_code", "error");
        }
        span.in_scope(|| {
            tracing::event!(
                target: TARGET,
                tracing::Level::INFO,
                http.response.status_code = u64::from(status),
                kvrouter.reason = class,
                "rejected"
            )
        });
    }

    /// Records that the router failed internally and left the request to the gateway's
    /// fallback.
    pub fn unrouted(&self) {
        let Some(span) = &self.0 else { return };
        span.record("kvrouter.outcome", "unrouted");
        span.record("otel.status_code", "error");
        span.in_scope(|| tracing::event!(target: TARGET, tracing::Level::INFO, kvrouter.reason = "internal", "unrouted"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_means_no_span() {
        if !crate::otel::enabled() {
            let s = DecisionSpan::start(None, "id");
            assert!(s.0.is_none());
            s.rejected(404);
        }
        assert_eq!(reason_class(503), "no_endpoint");
        assert_eq!(reason_class(404), "unknown_model");
    }
}
