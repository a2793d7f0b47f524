//! OpenTelemetry traces of routing decisions.
//!
//! One span per decision (`kvrouter.decision`), a child of the gateway's span when the request
//! carries a W3C `traceparent` (Envoy forwards the client's request headers to ext_proc), with
//! the decision's facts as attributes and rejections as span events; exported over OTLP/gRPC.
//!
//! - `context`: the `traceparent` / `tracestate` headers, kept with a pending request.
//! - `span`: [`DecisionSpan`], opened around a decision and filled from its outcome.
//! - `export`: the global `tracing` subscriber (logs, plus the OpenTelemetry layer and the OTLP
//!   pipeline when `tracing.enabled`), and flushing at shutdown.
//!
//! # Cost when off
//!
//! Tracing is off unless `tracing.enabled` installed the pipeline at start-up ([`enabled`], one
//! relaxed atomic load). Off, no header is copied, no `tracing` span is created and nothing is
//! allocated: [`DecisionSpan::start`] returns an empty value and its methods return at once.
//! On, the `tracing` span exists only for the OpenTelemetry layer (the log layer ignores its
//! target), and unsampled spans are never exported.
//!
//! # What a span holds
//!
//! Counts, names and addresses: policy, model, candidates, the pick and its fallbacks, prompt
//! and matched tokens, predicted TTFT, cache source, staleness, outcome, the request id. Never
//! prompt text, and no tenant: a tenant id is the user's data, and a hash of a guessable id
//! reveals it.

mod context;
mod export;
mod span;

use std::sync::atomic::{AtomicBool, Ordering};

pub use context::RemoteParent;
pub use export::{init_subscriber, layer, OtelError, OtelGuard};
pub use span::{reason_class, DecisionSpan, SPAN_NAME, TARGET};

static ON: AtomicBool = AtomicBool::new(false);

/// Whether decision spans are being created (the pipeline is installed).
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Turns span creation on or off. [`init_subscriber`] turns it on when it installs the
/// pipeline; benchmarks and tests that install their own layer use this.
pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::Relaxed);
}
