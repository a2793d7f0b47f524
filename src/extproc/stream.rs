//! One ext_proc stream as a typed sequence of phases.
//!
//! A stream is either a *picker* (it starts with request headers) or an *observer* (it starts
//! with response headers: Envoy's second, observability-mode filter). A picker may also see the
//! response itself when Envoy is configured with a single filter.
//!
//! ```text
//! picker:   Start --headers--> RequestBody --body end / trailers--> Picked --(response)--> Responding --end--> Finished
//!             \--(no body)--------------------------------------> Picked
//! observer: Start --response headers--> Responding --end--> Finished
//! any phase --immediate response--> Finished
//! ```
//!
//! The body modes differ only in when the routing decision is written back:
//! - `FULL_DUPLEX_STREAMED`: Envoy streams body chunks while it waits for the headers response,
//!   and picks the upstream host right after it. The headers response is held until the body has
//!   ended, then sent with the destination, followed by every chunk echoed back in order.
//! - `BUFFERED`: the headers get an immediate CONTINUE; the whole body arrives in one message and
//!   the reply to it carries the destination.
//! - `STREAMED` / `NONE` / `GRPC`: the host is picked before the body is seen, so the request is
//!   not routed here (CONTINUE everywhere); Envoy's fallback serves it. Logged once.
//!
//! A request's routing reads one [`RouterState`] snapshot, taken when its first message arrives:
//! the tenant header, the body limit, the decision, the destination header and the retry-after
//! of a rejection all come from it.
//!
//! A routed request's [`Ticket`] is parked in the [`InflightTable`] under a pick id that is also
//! written to `kvrouter` dynamic metadata; whichever stream sees the response claims it. This
//! module only reads facts off Envoy's messages (status, served endpoint, attempts, first
//! byte) and hands them to the ticket, which applies them on the router's side; dropping the
//! ticket (response end, stream gone) releases the endpoint's load exactly once.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};

use super::budget;
use super::envoy::{self, Slot};
use super::inflight::InflightTable;
use super::observe::ResponseObserver;
use super::reject::Rejection;
use super::salt;
use crate::otel::{DecisionSpan, RemoteParent};
use crate::request::{self, ApiKind};
use crate::router::{Decision, ResponseFacts, RouteContext, Router, RouterState, Ticket};
use crate::telemetry::Metrics;

/// How a stream ended, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A picker stream routed its request and ended (the response is observed elsewhere).
    Routed,
    /// A response was seen to its end.
    Complete,
    /// We answered with an immediate response.
    Immediate,
    /// The request was not routed by us (a body mode without a body to route on, or an internal
    /// fault); Envoy's fallback served it.
    Unrouted,
    /// The stream ended before it was done (client gone, Envoy reset, upstream failure).
    Cancelled,
}

impl Outcome {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::Complete => "complete",
            Outcome::Immediate => "immediate",
            Outcome::Unrouted => "unrouted",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// A request whose body is still arriving.
struct Pending {
    /// The snapshot this request is routed under.
    state: Arc<RouterState>,
    api: ApiKind,
    subset: Option<Vec<SocketAddr>>,
    tenant: Option<String>,
    request_id: String,
    body: Vec<u8>,
    /// `body`'s share of the process-wide buffered-body budget.
    held: budget::HeldBody,
    /// End offset of each received chunk, to echo chunks back with their original boundaries.
    chunk_ends: Vec<usize>,
    /// The gateway's trace context, kept only while tracing is on.
    trace: Option<RemoteParent>,
}

/// A response being watched; owns the request's ticket if it was routed by us.
struct Responding {
    ticket: Option<Ticket>,
    observer: ResponseObserver,
}

enum Phase {
    Start,
    RequestBody(Pending),
    /// Routed (`id` names the parked record) or passed through unrouted (`None`).
    Picked {
        id: Option<u64>,
    },
    Responding(Responding),
    Finished,
}

/// The state of one ext_proc stream.
pub struct Stream {
    router: Arc<Router>,
    table: Arc<InflightTable<Ticket>>,
    metrics: Arc<Metrics>,
    phase: Phase,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    /// Envoy's observability mode: it ignores replies, so none are sent.
    observe_only: bool,
    request_id: String,
    outcome: Outcome,
}

static WARNED_UNROUTABLE_MODE: AtomicBool = AtomicBool::new(false);

/// Bounds concurrent decisions on the blocking pool (tokenizing, huge bodies) to twice the
/// cores.
fn slow_decisions() -> &'static tokio::sync::Semaphore {
    static PERMITS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    PERMITS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        tokio::sync::Semaphore::new(cores * 2)
    })
}

impl Stream {
    /// A new stream routed by `router`, parking tickets in `table`, counting in `metrics`.
    pub fn new(
        router: Arc<Router>,
        table: Arc<InflightTable<Ticket>>,
        metrics: Arc<Metrics>,
    ) -> Stream {
        Stream {
            router,
            table,
            metrics,
            phase: Phase::Start,
            // Until Envoy says otherwise (protocol_config on the first message), assume the
            // mode that works with every message order.
            request_mode: BodySendMode::Buffered,
            response_mode: BodySendMode::None,
            observe_only: false,
            request_id: String::new(),
            outcome: Outcome::Cancelled,
        }
    }

    /// How the stream ended (or would end if it ended now).
    pub fn outcome(&self) -> Outcome {
        match self.phase {
            Phase::Finished => self.outcome,
            Phase::Picked { id: Some(_) } => Outcome::Routed,
            Phase::Picked { id: None } => Outcome::Unrouted,
            _ => Outcome::Cancelled,
        }
    }

    /// True once nothing more is expected: the stream can be closed from our side, which frees
    /// Envoy's stream at once (an observability-mode stream would otherwise linger for Envoy's
    /// `deferred_close_timeout`).
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Handles one message from Envoy; returns the replies to send, in order.
    pub async fn on_message(&mut self, mut msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode =
                BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::Buffered);
            self.response_mode =
                BodySendMode::try_from(pc.response_body_mode).unwrap_or(BodySendMode::None);
        }
        self.observe_only |= msg.observability_mode;
        let Some(request) = msg.request.take() else {
            self.metrics.record_anomaly();
            return Vec::new();
        };
        let replies = match request {
            Request::RequestHeaders(h) => self.on_request_headers(h, &msg).await,
            Request::RequestBody(b) => self.on_request_body(b, &msg).await,
            Request::RequestTrailers(_) => self.on_request_trailers().await,
            Request::ResponseHeaders(h) => vec![self.on_response_headers(h, &msg)],
            Request::ResponseBody(b) => vec![self.on_response_body(b)],
            Request::ResponseTrailers(_) => {
                self.finish(Outcome::Complete);
                vec![envoy::continue_(Slot::ResponseTrailers)]
            }
        };
        if self.observe_only {
            Vec::new()
        } else {
            replies
        }
    }

    async fn on_request_headers(
        &mut self,
        h: HttpHeaders,
        msg: &ProcessingRequest,
    ) -> Vec<ProcessingResponse> {
        if !matches!(self.phase, Phase::Start) {
            self.metrics.record_anomaly();
            return vec![envoy::continue_(Slot::RequestHeaders)];
        }
        let headers = h.headers.as_ref();
        self.request_id = envoy::header_str(headers, "x-request-id")
            .map(|id| id.chars().take(64).collect())
            .unwrap_or_default();
        let path = envoy::header_str(headers, ":path").unwrap_or("");
        let state = self.router.snapshot();
        let tenant = state
            .tenants
            .header()
            .and_then(|name| envoy::header_str(headers, name).map(str::to_string));
        let pending = Pending {
            state,
            api: ApiKind::from_path(path),
            subset: envoy::subset_hint(msg.metadata_context.as_ref()),
            tenant,
            request_id: self.request_id.clone(),
            body: Vec::new(),
            held: Default::default(),
            chunk_ends: Vec::new(),
            trace: RemoteParent::capture(|name| envoy::header_str(headers, name)),
        };
        if h.end_of_stream {
            // No body (GET /v1/models, /health): any endpoint serving anything will do.
            return self.decide(pending, Slot::RequestHeaders, false).await;
        }
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => {
                self.phase = Phase::RequestBody(pending);
                Vec::new() // held until the body has ended
            }
            BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                self.phase = Phase::RequestBody(pending);
                vec![envoy::continue_(Slot::RequestHeaders)]
            }
            BodySendMode::Streamed | BodySendMode::None | BodySendMode::Grpc => {
                if !WARNED_UNROUTABLE_MODE.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        mode = ?self.request_mode,
                        "Envoy sends request bodies in a mode that picks the host before the \
                         body is seen; requests are left to Envoy's fallback. Use \
                         FULL_DUPLEX_STREAMED or BUFFERED."
                    );
                }
                self.phase = Phase::Picked { id: None };
                vec![envoy::continue_(Slot::RequestHeaders)]
            }
        }
    }

    async fn on_request_body(
        &mut self,
        b: HttpBody,
        msg: &ProcessingRequest,
    ) -> Vec<ProcessingResponse> {
        let full_duplex = self.request_mode == BodySendMode::FullDuplexStreamed;
        if matches!(self.phase, Phase::Start) && !full_duplex {
            // Envoy skips the headers (`request_header_mode: SKIP`, one round trip less): the
            // path and request id come as request attributes with the body.
            let path = envoy::attribute_str(&msg.attributes, "request.path").unwrap_or("");
            self.request_id = envoy::attribute_str(&msg.attributes, "request.id")
                .map(|id| id.chars().take(64).collect())
                .unwrap_or_default();
            self.phase = Phase::RequestBody(Pending {
                state: self.router.snapshot(),
                api: ApiKind::from_path(path),
                subset: envoy::subset_hint(msg.metadata_context.as_ref()),
                tenant: None,
                request_id: self.request_id.clone(),
                body: Vec::new(),
                held: Default::default(),
                chunk_ends: Vec::new(),
                trace: None,
            });
        }
        let pending = match &mut self.phase {
            Phase::RequestBody(p) => p,
            Phase::Picked { id: None } => {
                // Unrouted: chunks pass through.
                return vec![if full_duplex {
                    envoy::streamed_request_body(&b.body, b.end_of_stream)
                } else {
                    envoy::continue_(Slot::RequestBody)
                }];
            }
            _ => {
                self.metrics.record_anomaly();
                return vec![envoy::continue_(Slot::RequestBody)];
            }
        };
        let routing = &pending.state.config.routing;
        let (limit, retry_after) = (routing.max_body_bytes, routing.retry_after_s);
        if pending.body.len() + b.body.len() > limit {
            DecisionSpan::start(pending.trace.as_ref(), &pending.request_id).rejected(413);
            return self.reject(Rejection::too_large(limit), retry_after);
        }
        if !pending
            .held
            .grow(b.body.len(), routing.max_buffered_body_bytes)
        {
            return self.reject(Rejection::bodies_busy(), retry_after);
        }
        pending.body.extend_from_slice(&b.body);
        pending.chunk_ends.push(pending.body.len());
        if b.end_of_stream {
            let Phase::RequestBody(p) = std::mem::replace(&mut self.phase, Phase::Start) else {
                unreachable!("matched above")
            };
            let slot = if full_duplex {
                Slot::RequestHeaders
            } else {
                Slot::RequestBody
            };
            return self.decide(p, slot, false).await;
        }
        if full_duplex {
            Vec::new()
        } else {
            // BUFFERED_PARTIAL hit Envoy's buffer limit: the body is cut and cannot be parsed.
            self.reject(Rejection::too_large(limit), retry_after)
        }
    }

    async fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        if self.request_mode == BodySendMode::FullDuplexStreamed
            && matches!(self.phase, Phase::RequestBody(_))
        {
            let Phase::RequestBody(p) = std::mem::replace(&mut self.phase, Phase::Start) else {
                unreachable!("matched above")
            };
            return self.decide(p, Slot::RequestHeaders, true).await;
        }
        vec![envoy::continue_(Slot::RequestTrailers)]
    }

    /// Parses the finished body, picks endpoints and builds the replies: the routing mutation in
    /// `slot`, then (full duplex) the echoed body and trailers response.
    async fn decide(
        &mut self,
        pending: Pending,
        slot: Slot,
        trailers: bool,
    ) -> Vec<ProcessingResponse> {
        let router = Arc::clone(&self.router);
        let retry_after = pending.state.config.routing.retry_after_s;
        let span = DecisionSpan::start(pending.trace.as_ref(), &pending.request_id);
        let (mut pending, result) = if pending.state.decides_slowly(pending.body.len()) {
            // At most a few tokenizations at once, so a burst queues here (asynchronously)
            // instead of starting a blocking thread per request and starving the cores.
            let _permit = slow_decisions().acquire().await;
            let joined = tokio::task::spawn_blocking(move || {
                let result = decide_guarded(&router, &pending);
                (pending, result)
            })
            .await;
            match joined {
                Ok(pair) => pair,
                // The runtime is shutting down; the body went with the task.
                Err(_) => return self.reject(Rejection::internal(), retry_after),
            }
        } else {
            let result = decide_guarded(&router, &pending);
            (pending, result)
        };

        let mut out = Vec::with_capacity(pending.chunk_ends.len() + 2);
        match result {
            Ok(Some(decision)) => {
                span.routed(&decision);
                let id = self.table.next_id();
                let header = &pending.state.config.routing.destination_header;
                let mut reply = envoy::route(slot, header, &decision.destination, id);
                // Tenancy: the tenant's cache_salt goes into the body the engine receives.
                let p = &mut pending;
                match salt::salt_request(
                    &p.state.tenants,
                    p.tenant.as_deref(),
                    &mut p.body,
                    &mut p.chunk_ends,
                ) {
                    Ok(false) => {}
                    Ok(true) => {
                        // BUFFERED: nothing is echoed afterwards, the body moves into the reply.
                        let len = p.body.len();
                        let buffered =
                            (slot == Slot::RequestBody).then(|| std::mem::take(&mut p.body));
                        envoy::body_changed(&mut reply, len, buffered);
                    }
                    Err(rejection) => {
                        span.rejected(rejection.status);
                        return self.reject(rejection, retry_after);
                    }
                }
                out.push(reply);
                tracing::debug!(
                    request_id = %self.request_id,
                    pick = id,
                    api = pending.api.as_str(),
                    endpoint = %decision.primary().address_str,
                    policy = decision.policy(),
                    prompt_tokens = decision.prompt_tokens(),
                    uncached_tokens = decision.plan.uncached_tokens(),
                    "routed"
                );
                self.table.insert(id, decision.ticket);
                self.phase = Phase::Picked { id: Some(id) };
            }
            Ok(None) => {
                span.unrouted();
                // Internal fault: degrade to Envoy's fallback rather than fail the request.
                out.push(envoy::continue_(slot));
                self.phase = Phase::Picked { id: None };
            }
            Err(rejection) => {
                span.rejected(rejection.status);
                return self.reject(rejection, retry_after);
            }
        }
        if slot == Slot::RequestHeaders && self.request_mode == BodySendMode::FullDuplexStreamed {
            let mut start = 0;
            let last = pending.chunk_ends.len().saturating_sub(1);
            for (i, &end) in pending.chunk_ends.iter().enumerate() {
                let eos = i == last && !trailers;
                out.push(envoy::streamed_request_body(&pending.body[start..end], eos));
                start = end;
            }
            if trailers {
                out.push(envoy::continue_(Slot::RequestTrailers));
            }
        }
        out
    }

    fn on_response_headers(
        &mut self,
        h: HttpHeaders,
        msg: &ProcessingRequest,
    ) -> ProcessingResponse {
        let ticket = match std::mem::replace(&mut self.phase, Phase::Finished) {
            // The picker sees the response too (single-filter set-up).
            Phase::Picked { id } => id.and_then(|id| self.table.take(id)),
            // An observer stream: claim the ticket the picker parked.
            Phase::Start => {
                envoy::pick_id(msg.metadata_context.as_ref()).and_then(|id| self.table.claim(id))
            }
            // A local reply from Envoy before we routed (e.g. its own 413): nothing to watch.
            Phase::RequestBody(_) => {
                self.outcome = Outcome::Cancelled;
                return envoy::continue_(Slot::ResponseHeaders);
            }
            other => {
                self.phase = other;
                self.metrics.record_anomaly();
                return envoy::continue_(Slot::ResponseHeaders);
            }
        };
        let mut r = Responding {
            ticket,
            observer: ResponseObserver::default(),
        };
        let headers = h.headers.as_ref();
        let status = envoy::header_str(headers, ":status").and_then(|s| s.parse().ok());
        r.observer
            .on_headers(status, envoy::header_str(headers, "content-type"));
        let facts = ResponseFacts {
            status,
            served: envoy::served_endpoint(msg.metadata_context.as_ref(), &h.attributes)
                .or_else(|| envoy::served_endpoint(None, &msg.attributes)),
            attempts: envoy::attempt_count(&h.attributes)
                .or_else(|| envoy::attempt_count(&msg.attributes)),
        };
        if let Some(t) = &mut r.ticket {
            t.on_response_headers(facts);
        }
        if let Some(code) = status {
            match (&r.ticket, facts.served) {
                (Some(t), _) => self.metrics.record_upstream_status(t.endpoint(), code),
                (None, Some(addr)) => self.metrics.record_upstream_status(&addr.to_string(), code),
                (None, None) => {}
            }
        }
        self.phase = Phase::Responding(r);
        if h.end_of_stream {
            self.finish(Outcome::Complete);
        }
        envoy::continue_(Slot::ResponseHeaders)
    }

    fn on_response_body(&mut self, b: HttpBody) -> ProcessingResponse {
        let reply = if self.response_mode == BodySendMode::FullDuplexStreamed {
            envoy::streamed_response_body(&b.body, b.end_of_stream)
        } else {
            envoy::continue_(Slot::ResponseBody)
        };
        match &mut self.phase {
            Phase::Responding(r) => {
                let now = Instant::now();
                if r.observer.on_body(&b.body, now) {
                    if let Some(t) = &mut r.ticket {
                        t.on_first_byte(now);
                    }
                }
                if b.end_of_stream {
                    self.finish(Outcome::Complete);
                }
            }
            Phase::Finished => {}
            _ => self.metrics.record_anomaly(),
        }
        reply
    }

    /// Answers `rejection` (503s with `retry-after: retry_after_s`) and ends the stream.
    fn reject(&mut self, rejection: Rejection, retry_after_s: u32) -> Vec<ProcessingResponse> {
        self.metrics.record_immediate(rejection.status);
        tracing::debug!(
            request_id = %self.request_id,
            status = rejection.status,
            reason = %rejection.message,
            "rejected"
        );
        self.phase = Phase::Finished;
        self.outcome = Outcome::Immediate;
        vec![rejection.into_response(retry_after_s)]
    }

    /// Ends the response: drops the ticket (releasing what it holds) and logs the request's
    /// figures.
    fn finish(&mut self, outcome: Outcome) {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        self.outcome = outcome;
        if let Phase::Responding(r) = phase {
            let o = &r.observer;
            let usage = o.usage();
            let decided_at = r.ticket.as_ref().map(Ticket::decided_at);
            tracing::debug!(
                request_id = %self.request_id,
                endpoint = r.ticket.as_ref().map(Ticket::endpoint).unwrap_or("-"),
                status = o.status.unwrap_or(0),
                ttft_ms = decided_at.zip(o.first_byte_at).map(|(d, f)| f.duration_since(d).as_secs_f64() * 1e3),
                body_bytes = o.body_bytes,
                prompt_tokens = usage.map(|u| u.prompt_tokens),
                completion_tokens = usage.map(|u| u.completion_tokens),
                cached_tokens = usage.and_then(|u| u.cached_tokens),
                "response complete"
            );
            // `r` (and the ticket in it) drops here.
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // A picker whose stream ends before the response: leave the ticket for the observer
        // stream if observers are in use, else release it now (nothing else would).
        if let Phase::Picked { id: Some(id) } = self.phase {
            if !self.table.observers_active() {
                drop(self.table.take(id));
            }
        }
    }
}

/// Parses and decides; `Ok(None)` if the router itself failed (a bug), so the caller can fall
/// back instead of losing the request.
fn decide_guarded(router: &Router, pending: &Pending) -> Result<Option<Decision>, Rejection> {
    let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let parsed = request::parse(pending.api, &pending.body)?;
        let ctx = RouteContext {
            subset: pending.subset.as_deref(),
            tenant: pending.tenant.as_deref(),
            request_id: &pending.request_id,
        };
        router
            .decide(&pending.state, &parsed, ctx)
            .map_err(Rejection::from)
    }));
    match attempt {
        Ok(result) => result.map(Some),
        Err(_) => {
            tracing::error!("routing panicked; request passed to Envoy's fallback");
            Ok(None)
        }
    }
}
