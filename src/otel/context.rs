//! The W3C trace context a request arrives with (`traceparent`, `tracestate`), parsed by
//! OpenTelemetry's own propagator, kept with the request until its decision.

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The gateway's span a decision's span continues.
#[derive(Debug, Clone)]
pub struct RemoteParent(pub(super) opentelemetry::Context);

struct TwoHeaders<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

impl Extractor for TwoHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(self.traceparent),
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

impl RemoteParent {
    /// Reads the trace context from a request's headers (`header` looks one up by lowercase
    /// name). `None` when tracing is off (nothing is read or kept), or when there is no valid
    /// `traceparent` (the decision's span then starts a trace of its own).
    pub fn capture<'h>(header: impl Fn(&str) -> Option<&'h str>) -> Option<RemoteParent> {
        if !super::enabled() {
            return None;
        }
        RemoteParent::parse(header("traceparent")?, header("tracestate"))
    }

    /// Parses a `traceparent` and an optional `tracestate`; `None` if the former is invalid.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<RemoteParent> {
        let cx = TraceContextPropagator::new().extract(&TwoHeaders {
            traceparent,
            tracestate,
        });
        cx.span()
            .span_context()
            .is_valid()
            .then_some(RemoteParent(cx))
    }

    /// The parent's trace id, as 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        self.0.span().span_context().trace_id().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_traceparents_parse_and_invalid_ones_do_not() {
        let p = RemoteParent::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("vendor=x"),
        )
        .expect("valid");
        assert_eq!(p.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let sc = p.0.span().span_context().clone();
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_state().header(), "vendor=x");
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "not a traceparent",
        ] {
            assert!(RemoteParent::parse(bad, None).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn nothing_is_captured_while_tracing_is_off() {
        // Tests run with the pipeline off (the flag is only set by installing it).
        let header = |_: &str| Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        if !crate::otel::enabled() {
            assert!(RemoteParent::capture(header).is_none());
        }
    }
}
