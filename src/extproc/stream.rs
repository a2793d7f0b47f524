//! One ext_proc stream as a typed sequence of phases.
//!
//! A stream is either a *picker* (it starts with the request's headers or, when Envoy skips
//! them, with its body) or an *observer* (it starts with the response: Envoy's second,
//! observability-mode filter). A picker may also see the response itself when Envoy is
//! configured with a single filter.
//!
//! ```text
//! picker:   Start --headers--> RequestBody --body end / trailers--> Picked --(own response)--> Responding --end--> Finished
//!             \--(body first: headers skipped)--> RequestBody
//!             \--(no body)--------------------------------------> Picked
//! observer: Start --response headers or first chunk--> Responding --first byte / end--> Finished
//! any phase --immediate response--> Finished
//! ```
//!
//! The body modes differ only in when the routing decision is written back:
//! - `BUFFERED` (default): the headers get an immediate CONTINUE; the whole body arrives in one
//!   message and the reply to it carries the destination. (An Envoy configured to skip the
//!   headers sends the path, request id and tenant header as request attributes with the body.)
//! - `FULL_DUPLEX_STREAMED`: Envoy streams body chunks while it waits for the headers response,
//!   and picks the upstream host right after it. The headers response is held until the body has
//!   ended, then sent with the destination, followed by every chunk echoed back in order.
//! - `STREAMED` with `send_body_without_waiting_for_header_response` (Envoy says so in the first
//!   message's `protocol_config`): as full duplex, the headers response is held until the body
//!   has ended and carries the destination; then one reply per body message, in order, each a
//!   CONTINUE (Envoy keeps the chunks itself, so nothing is echoed), or the chunk's salted bytes.
//!   One round trip per request, like full duplex, and Envoy still fails open.
//! - `STREAMED` (Envoy waiting for the headers response) / `NONE` / `GRPC`: the host is picked
//!   before the body is seen, so the request is not routed here (CONTINUE everywhere); Envoy's
//!   fallback serves it. Logged once.
//!
//! A request's routing reads one [`RouterState`] snapshot, taken when its first message arrives:
//! the tenant header, the body limit, the decision, the destination header and the retry-after
//! of a rejection all come from it.
//!
//! A routed request's [`Ticket`] is parked in the [`InflightTable`] under a pick id that is also
//! written to `kvrouter` dynamic metadata. The observer stream applies what it reads (status,
//! served endpoint, attempts, first byte) to the parked ticket and is done at the first body
//! byte: the stream is closed from our side then, so Envoy sends none of the rest of the body.
//! The picker stream ends with the HTTP request, which is the response's end; whichever of the
//! two finishes last drops the ticket, releasing the endpoint's load exactly once (see
//! [`InflightTable`]). This module only reads facts off Envoy's messages; the ticket applies them
//! on the router's side.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};

use super::envoy::{self, Slot};
use super::inflight::InflightTable;
use super::lanes;
use super::reject::Rejection;
use super::salt;
use crate::budget;
use crate::flow;
use crate::otel::{DecisionSpan, RemoteParent};
use crate::request::{self, ApiKind};
use crate::router::{Decision, ResponseFacts, RouteContext, Router, RouterState, Ticket};
use crate::telemetry::Metrics;

/// How a stream ended, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A picker stream routed its request and ended (the response is observed elsewhere).
    Routed,
    /// A response was seen as far as it is watched: to its first body byte on an observer
    /// stream, to its end on a picker that sees its own response.
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
    /// Its place in the admission queue (priority, flow).
    flow: flow::Labels,
    /// The body as Envoy sent it: each chunk moved out of its message, kept with its original
    /// boundaries to echo in full-duplex mode.
    chunks: Vec<Vec<u8>>,
    /// Total bytes in `chunks`.
    len: usize,
    /// The `content-length` the request headers declared, if any.
    declared_len: Option<usize>,
    /// When its last message (headers or a body chunk) came.
    last_message_at: tokio::time::Instant,
    /// The body's share of the process-wide buffered-body budget.
    held: budget::Held,
    /// The gateway's trace context, kept only while tracing is on.
    trace: Option<RemoteParent>,
}

impl Pending {
    /// The lane its slow work takes (`super::lanes`): by the body's size, turns by its tenant.
    fn lane(&self) -> lanes::Lane {
        lanes::lane_for(
            self.len,
            self.state.config.routing.heavy_body_bytes,
            self.tenant.as_deref(),
        )
    }

    /// The whole body: borrowed when it came in one chunk (BUFFERED always), else joined.
    fn body(&self) -> Cow<'_, [u8]> {
        match self.chunks.as_slice() {
            [] => Cow::Borrowed(&[]),
            [one] => Cow::Borrowed(one),
            many => Cow::Owned(many.concat()),
        }
    }

    /// Tenancy: puts the tenant's `cache_salt` into the body (chunk boundaries kept). True when
    /// the body changed.
    fn salt(&mut self) -> Result<bool, Rejection> {
        if self.chunks.is_empty()
            || self
                .state
                .tenants
                .cache_salt(self.tenant.as_deref(), None)
                .is_none()
        {
            // Nothing to put in: the body is not copied.
            return Ok(false);
        }
        let mut body = self.body().into_owned();
        let mut ends: Vec<usize> = self
            .chunks
            .iter()
            .scan(0, |end, c| {
                *end += c.len();
                Some(*end)
            })
            .collect();
        if !salt::salt_request(
            &self.state.tenants,
            self.tenant.as_deref(),
            &mut body,
            &mut ends,
        )? {
            return Ok(false);
        }
        let mut start = 0;
        self.chunks = ends
            .iter()
            .map(|&end| {
                let chunk = body[start..end].to_vec();
                start = end;
                chunk
            })
            .collect();
        self.len = body.len();
        Ok(true)
    }
}

/// Whose ticket a response being watched reports to.
enum Claim {
    /// Nobody's: not routed by us, or the pick id is unknown.
    None,
    /// The picker's own ticket (single-filter set-up), held until the response ends (boxed: a
    /// ticket is at least 224 bytes, clippy counts, the other claims 8).
    Owned(Box<Ticket>),
    /// A ticket parked by the picker stream, reported to in place.
    Parked(u64),
}

/// A response being watched.
struct Responding {
    claim: Claim,
    first_byte_at: Option<Instant>,
}

// One per ext_proc stream, held in its `Stream` and never in a collection: boxing the pending
// request would cost an allocation per request to save a few moves of ~240 bytes.
#[allow(clippy::large_enum_variant)]
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
    /// Envoy sends a STREAMED body without waiting for the headers response
    /// (`send_body_without_waiting_for_header_response`).
    early_body: bool,
    response_mode: BodySendMode,
    /// Envoy's observability mode: it ignores replies, so none are sent.
    observe_only: bool,
    request_id: String,
    outcome: Outcome,
    /// A long message's bytes, charged to the body budget when it came off the wire (before it
    /// waited for the heavy lane to decode it): its body takes the charge over, the rest is
    /// given back once the message is handled.
    prepaid: budget::Held,
    /// Where the stream's trusted tenant goes for the share of the long-body read rate its
    /// body's frames take (`super::divert::Pace`).
    pace_flow: Option<super::divert::PaceFlow>,
}

static WARNED_UNROUTABLE_MODE: AtomicBool = AtomicBool::new(false);

/// The request id as logged: at most 64 characters of what the client or Envoy sent.
fn request_id(id: Option<&str>) -> String {
    id.map(|id| id.chars().take(64).collect())
        .unwrap_or_default()
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
            early_body: false,
            response_mode: BodySendMode::None,
            observe_only: false,
            request_id: String::new(),
            outcome: Outcome::Cancelled,
            prepaid: budget::BUFFERED_BODIES.empty(),
            pace_flow: None,
        }
    }

    /// Tells `flow` the stream's trusted tenant once its headers name one.
    pub(super) fn with_pace_flow(mut self, flow: Option<super::divert::PaceFlow>) -> Stream {
        self.pace_flow = flow;
        self
    }

    /// Charges a long message of `bytes` to the process-wide body budget before it is decoded
    /// (decoding may wait for the heavy lane, and the message is held meanwhile). Err: the
    /// replies refusing the request (503 + `retry-after`), and the message should be dropped
    /// undecoded. Only a request still taking its body is charged or refused; a long message in
    /// any other phase (a response body a picker watches) is not held and passes.
    pub fn prepay(&mut self, bytes: usize) -> Result<(), Vec<ProcessingResponse>> {
        if !matches!(self.phase, Phase::RequestBody(_) | Phase::Start) {
            return Ok(());
        }
        let state = self.state_in_force();
        let routing = &state.config.routing;
        if self.prepaid.grow(bytes, routing.max_buffered_body_bytes) {
            return Ok(());
        }
        Err(self.reject(Rejection::bodies_busy(), routing.retry_after_s))
    }

    /// Refuses the request whose long body waited too long for its turn to be read (503 with
    /// `retry-after`), instead of letting Envoy's message timeout fail it open.
    pub fn refuse_held_body(&mut self) -> Vec<ProcessingResponse> {
        let retry_after_s = self.state_in_force().config.routing.retry_after_s;
        self.reject(Rejection::long_bodies_busy(), retry_after_s)
    }

    /// The request is read: the stream's later long messages (the response's) are read as any
    /// other ([`super::divert::PaceFlow::request_read`]).
    fn request_read(&self) {
        if let Some(flow) = &self.pace_flow {
            flow.request_read();
        }
    }

    /// The snapshot the request's body is handled under: the one its headers took, else the
    /// one in force now.
    fn state_in_force(&self) -> Arc<RouterState> {
        match &self.phase {
            Phase::RequestBody(p) => Arc::clone(&p.state),
            _ => self.router.snapshot(),
        }
    }

    /// The request's trusted tenant, once its headers came.
    pub fn tenant(&self) -> Option<&str> {
        match &self.phase {
            Phase::RequestBody(p) => p.tenant.as_deref(),
            _ => None,
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
    /// Envoy's stream at once (and tells an observability-mode filter to send nothing more).
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Handles one message from Envoy; returns the replies to send, in order.
    pub async fn on_message(&mut self, mut msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode =
                BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::Buffered);
            self.early_body = pc.send_body_without_waiting_for_header_response;
            self.response_mode =
                BodySendMode::try_from(pc.response_body_mode).unwrap_or(BodySendMode::None);
        }
        self.observe_only |= msg.observability_mode;
        let Some(request) = msg.request.take() else {
            self.metrics.record_anomaly();
            return Vec::new();
        };
        if matches!(
            request,
            Request::ResponseHeaders(_) | Request::ResponseBody(_) | Request::ResponseTrailers(_)
        ) {
            self.request_read();
        }
        let replies = match request {
            Request::RequestHeaders(h) => self.on_request_headers(h, &msg).await,
            Request::RequestBody(b) => self.on_request_body(b, &msg).await,
            Request::RequestTrailers(_) => self.on_request_trailers().await,
            Request::ResponseHeaders(h) => vec![self.on_response_headers(h, &msg)],
            Request::ResponseBody(b) => vec![self.on_response_body(b, &msg)],
            Request::ResponseTrailers(_) => {
                self.finish(Outcome::Complete);
                vec![envoy::continue_(Slot::ResponseTrailers)]
            }
        };
        // What a long message's body did not take over (its framing) is given back now.
        self.prepaid = budget::BUFFERED_BODIES.empty();
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
        self.request_id = request_id(envoy::header_str(headers, "x-request-id"));
        let path = envoy::header_str(headers, ":path").unwrap_or("");
        let state = self.router.snapshot();
        let tenant = state
            .tenants
            .header()
            .and_then(|name| envoy::header_str(headers, name).map(str::to_string));
        if let (Some(pace), Some(tenant)) = (&self.pace_flow, &tenant) {
            pace.set(tenant);
        }
        let flow =
            flow::Labels::from_headers(&state.config.flow_control, tenant.as_deref(), |name| {
                envoy::header_str(headers, name)
            });
        let pending = Pending {
            state,
            api: ApiKind::from_path(path),
            subset: envoy::subset_hint(msg.metadata_context.as_ref()),
            tenant,
            flow,
            chunks: Vec::new(),
            len: 0,
            declared_len: envoy::header_str(headers, "content-length").and_then(|v| v.parse().ok()),
            last_message_at: tokio::time::Instant::now(),
            held: budget::BUFFERED_BODIES.empty(),
            trace: RemoteParent::capture(|name| envoy::header_str(headers, name)),
        };
        if h.end_of_stream {
            // No body (GET /v1/models, /health): any endpoint serving anything will do.
            return self.decide(pending, Slot::RequestHeaders, false).await;
        }
        if self.holds_headers() {
            self.phase = Phase::RequestBody(pending);
            return Vec::new(); // held until the body has ended
        }
        match self.request_mode {
            BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                self.phase = Phase::RequestBody(pending);
                vec![envoy::continue_(Slot::RequestHeaders)]
            }
            BodySendMode::FullDuplexStreamed
            | BodySendMode::Streamed
            | BodySendMode::None
            | BodySendMode::Grpc => {
                if !WARNED_UNROUTABLE_MODE.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        mode = ?self.request_mode,
                        "Envoy sends request bodies in a mode that picks the host before the \
                         body is seen; requests are left to Envoy's fallback. Use \
                         BUFFERED, FULL_DUPLEX_STREAMED, or STREAMED with \
                         send_body_without_waiting_for_header_response."
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
        // The headers' reply waits for the body's end (full duplex, early STREAMED).
        let holds = self.holds_headers();
        let early = self.early_streamed();
        if matches!(self.phase, Phase::Start) && !holds {
            // Envoy skips the headers (`request_header_mode: SKIP`, one round trip less): the
            // path, request id, tenant, flow and trace headers come as request attributes with
            // the body. Not a mode the shipped configs use: Envoy 1.40 picks the upstream host
            // before this message is answered (docs/envoy.md, "What the hop costs").
            let attributes = &msg.attributes;
            let path = envoy::attribute_str(attributes, "request.path").unwrap_or("");
            self.request_id = request_id(envoy::attribute_str(attributes, "request.id"));
            let state = self.router.snapshot();
            let tenant = state
                .tenants
                .header()
                .and_then(|name| envoy::header_attribute(attributes, name))
                .map(str::to_string);
            self.phase = Phase::RequestBody(Pending {
                flow: flow::Labels::from_headers(
                    &state.config.flow_control,
                    tenant.as_deref(),
                    |name| envoy::header_attribute(attributes, name),
                ),
                state,
                api: ApiKind::from_path(path),
                subset: envoy::subset_hint(msg.metadata_context.as_ref()),
                tenant,
                chunks: Vec::new(),
                len: 0,
                declared_len: None,
                last_message_at: tokio::time::Instant::now(),
                held: budget::BUFFERED_BODIES.empty(),
                trace: RemoteParent::capture(|name| envoy::header_attribute(attributes, name)),
            });
        }
        let pending = match &mut self.phase {
            Phase::RequestBody(p) => p,
            Phase::Picked { id: None } => {
                // Unrouted: chunks pass through.
                return vec![if full_duplex {
                    envoy::streamed_request_body(b.body, b.end_of_stream)
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
        if pending.len + b.body.len() > limit {
            DecisionSpan::start(pending.trace.as_ref(), &self.request_id).rejected(413);
            return self.reject(Rejection::too_large(limit), retry_after);
        }
        // A long message was charged when it arrived: its body takes that charge over.
        let prepaid = pending.held.take_from(&mut self.prepaid, b.body.len());
        if !pending
            .held
            .grow(b.body.len() - prepaid, routing.max_buffered_body_bytes)
        {
            return self.reject(Rejection::bodies_busy(), retry_after);
        }
        pending.len += b.body.len();
        if !b.body.is_empty() || holds {
            // Held: every message is answered after the decision, one reply each.
            pending.chunks.push(b.body);
        }
        // BUFFERED sends the whole body in one message, without end of stream only when
        // trailers follow it (over Envoy's buffer limit Envoy answers 413 itself): it is whole.
        // Early STREAMED holds trailers until every body message is answered, so a body that
        // trailers follow ends when it reaches the content-length its headers declared (without
        // one, Envoy's message timeout ends the wait: docs/envoy.md).
        let whole = b.end_of_stream
            || self.request_mode == BodySendMode::Buffered
            || (early && pending.declared_len == Some(pending.len));
        if whole {
            let Phase::RequestBody(p) = std::mem::replace(&mut self.phase, Phase::Start) else {
                unreachable!("matched above")
            };
            let slot = if holds {
                Slot::RequestHeaders
            } else {
                Slot::RequestBody
            };
            return self.decide(p, slot, false).await;
        }
        if holds {
            Vec::new()
        } else {
            // BUFFERED_PARTIAL hit Envoy's buffer limit: the body is cut and cannot be parsed
            // (or trailers follow it, which this mode does not tell apart).
            self.reject(Rejection::too_large(limit), retry_after)
        }
    }

    async fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        if self.holds_headers() && matches!(self.phase, Phase::RequestBody(_)) {
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
        mut pending: Pending,
        slot: Slot,
        trailers: bool,
    ) -> Vec<ProcessingResponse> {
        self.request_read();
        // Flow control: wait here (cancellable: the stream dropping this future leaves the
        // queue) until a candidate has room; the permit is held until the decision commits.
        let admission = self.router.admission();
        let _permit = if admission.enabled() {
            // Read before the wait: a full-duplex body's joined copy is not held while queued.
            let admitted = admission.admit_request(&pending.flow, &pending.body());
            match admitted.await {
                Ok(permit) => Some(permit),
                Err(shed) => return self.reject(Rejection::from(shed), shed.retry_after_s),
            }
        } else {
            None
        };
        let retry_after = pending.state.config.routing.retry_after_s;
        // Early STREAMED answers each body message after the routing reply; counted before the
        // chunks may be freed.
        let messages = pending.chunks.len();
        let span = DecisionSpan::start(pending.trace.as_ref(), &self.request_id);
        let (mut pending, result) = if pending.state.decides_slowly(pending.len) {
            // Off the async workers, in the lane its size calls for (`super::lanes`): worst-case
            // bodies queue apart from, and run at a lower CPU priority than, everyone else's.
            let lane = pending.lane();
            let router = Arc::clone(&self.router);
            let request_id = self.request_id.clone();
            let abandoned = Abandoned::default();
            let gone = Arc::clone(&abandoned.0);
            let echoes = self.echoes(slot);
            let joined = lanes::run(lane, move || {
                // Envoy may have given up on the request while it queued for its lane (client
                // gone, message timeout): then the stream's future was dropped, and tokenizing
                // would only take a core from live requests.
                if gone.load(Ordering::Relaxed) {
                    tracing::debug!(request_id = %request_id, "abandoned before deciding");
                    return (pending, Ok(None));
                }
                let result = decide_and_salt(&router, &mut pending, &request_id);
                // A body that goes back neither echoed nor salted is freed here, in its lane:
                // unmapping a big one costs an async worker as much as touching it did.
                if !echoes && !matches!(result, Ok(Some((_, true)))) {
                    drop(std::mem::take(&mut pending.chunks));
                }
                (pending, result)
            })
            .await;
            drop(abandoned);
            match joined {
                Some(pair) => pair,
                // The runtime is shutting down; the body went with the task.
                None => return self.reject(Rejection::internal(), retry_after),
            }
        } else {
            let result = decide_and_salt(&self.router, &mut pending, &self.request_id);
            (pending, result)
        };

        let answers_body = slot == Slot::RequestHeaders && self.holds_headers();
        let salted_body = matches!(result, Ok(Some((_, true))));
        let mut out = Vec::with_capacity(if answers_body { messages + 2 } else { 1 });
        match result {
            Ok(Some((decision, salted))) => {
                span.routed(&decision);
                let id = self.table.next_id();
                let header = &pending.state.config.routing.destination_header;
                let mut reply = envoy::route(slot, header, &decision.destination, id);
                let watched = decision.ticket.watched();
                if watched {
                    envoy::watch(&mut reply);
                }
                // The streamed modes: Envoy took the content-length off when the headers came
                // (and skips setting one), so the salted chunks go upstream chunk-encoded.
                if salted && slot == Slot::RequestBody {
                    // BUFFERED: nothing is echoed afterwards, the body moves into the reply
                    // (one chunk, always, in BUFFERED: moved, not copied).
                    let mut chunks = std::mem::take(&mut pending.chunks);
                    let body = match chunks.len() {
                        1 => chunks.pop().unwrap_or_default(),
                        _ => chunks.concat(),
                    };
                    envoy::body_changed(&mut reply, body);
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
                if let Some(rest) = decision.rest {
                    // The text after the prefix the decision used (new text after a cached
                    // prefix, or what the prefix budget left): tokenized and predicted on the
                    // pick once the reply is on its way, in the lane the body's size calls for.
                    let lane = pending.lane();
                    match budget::AFTER_DECISION.hold(rest.held_bytes(), budget::AFTER_DECISION_MAX)
                    {
                        Some(held) => {
                            tokio::spawn(lanes::run(lane, move || {
                                rest.finish();
                                drop(held);
                            }));
                        }
                        None => rest.drop_unfinished(),
                    }
                }
                if decision.ticket.first_byte_predicted() {
                    // No observer will report its first byte (or only after the whole
                    // generation, not streamed): take it at the predicted time.
                    self.table.schedule(id, decision.ticket.first_byte_due());
                }
                self.table.insert(id, decision.ticket, watched);
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
        if answers_body {
            if self.request_mode == BodySendMode::FullDuplexStreamed {
                // The chunks go back as they came, moved rather than copied.
                let last = pending.chunks.len().saturating_sub(1);
                for (i, chunk) in pending.chunks.into_iter().enumerate() {
                    out.push(envoy::streamed_request_body(chunk, i == last && !trailers));
                }
            } else if salted_body {
                // Early STREAMED: each message's reply replaces its chunk with the salted bytes
                // (the salt keeps the chunk boundaries, so there is one per message).
                out.extend(
                    pending
                        .chunks
                        .into_iter()
                        .map(envoy::replaced_request_chunk),
                );
            } else {
                // Early STREAMED: Envoy holds the chunks; each message is let through as it is.
                out.extend((0..messages).map(|_| envoy::continue_(Slot::RequestBody)));
            }
            if trailers {
                out.push(envoy::continue_(Slot::RequestTrailers));
            }
        }
        out
    }

    /// Whether the routing reply in `slot` is followed by the body echoed back (full duplex).
    fn echoes(&self, slot: Slot) -> bool {
        slot == Slot::RequestHeaders && self.request_mode == BodySendMode::FullDuplexStreamed
    }

    /// Early STREAMED: when a body that has not ended stops being waited for (its last message
    /// plus `routing.streamed_body_pause_ms`), so that the caller can call
    /// [`Self::release_paused_body`] before Envoy's message timeout gives up on the router and
    /// forwards only the part of the body it holds. `None` in every other case.
    /// While the long-body pace holds a message back, the wait is the router's, not the
    /// client's: no deadline then (the pace refuses the request itself past
    /// `routing.heavy_body_max_wait_ms`).
    pub fn pause_deadline(&self) -> Option<tokio::time::Instant> {
        let Phase::RequestBody(p) = &self.phase else {
            return None;
        };
        let pause_ms = p.state.config.routing.streamed_body_pause_ms;
        if !self.early_streamed()
            || pause_ms == 0
            || self.pace_flow.as_ref().is_some_and(|f| f.is_holding())
        {
            return None;
        }
        Some(p.last_message_at + std::time::Duration::from_millis(pause_ms))
    }

    /// A message came off the wire (before any decoding): a paused body's clock restarts, as
    /// Envoy's message timer did when it sent it.
    pub fn message_arrived(&mut self) {
        if !self.early_streamed() {
            return; // no pause is timed: no clock read per message
        }
        if let Phase::RequestBody(p) = &mut self.phase {
            p.last_message_at = tokio::time::Instant::now();
        }
    }

    /// Lets a paused early-STREAMED request go unrouted: the held headers' reply and a reply
    /// per body message so far, all CONTINUE; the rest of the body then passes as it comes.
    /// With tenancy configured it is refused with 408 instead: unrouted, it would go unsalted
    /// and unconfined (the reason the rendered picker fails closed with tenancy).
    pub fn release_paused_body(&mut self) -> Vec<ProcessingResponse> {
        let Phase::RequestBody(p) = std::mem::replace(&mut self.phase, Phase::Start) else {
            return Vec::new();
        };
        let tenancy = p.state.tenants.header().is_some();
        tracing::debug!(
            request_id = %self.request_id,
            received_bytes = p.len,
            tenancy,
            "request body paused past routing.streamed_body_pause_ms; not routed"
        );
        if tenancy {
            let retry_after = p.state.config.routing.retry_after_s;
            return self.reject(Rejection::body_paused(), retry_after);
        }
        self.phase = Phase::Picked { id: None };
        // The rest of the body passes through: not paced, refused or diverted any more.
        self.request_read();
        std::iter::once(envoy::continue_(Slot::RequestHeaders))
            .chain(p.chunks.iter().map(|_| envoy::continue_(Slot::RequestBody)))
            .collect()
    }

    /// Whether the request headers' reply waits for the body's end: Envoy sends the body
    /// without waiting for it (full duplex, or STREAMED with
    /// `send_body_without_waiting_for_header_response`), and picks the host when it comes.
    fn holds_headers(&self) -> bool {
        self.request_mode == BodySendMode::FullDuplexStreamed || self.early_streamed()
    }

    /// STREAMED with `send_body_without_waiting_for_header_response`.
    fn early_streamed(&self) -> bool {
        self.request_mode == BodySendMode::Streamed && self.early_body
    }

    fn on_response_headers(
        &mut self,
        h: HttpHeaders,
        msg: &ProcessingRequest,
    ) -> ProcessingResponse {
        let headers = h.headers.as_ref();
        let status = envoy::header_str(headers, ":status").and_then(|s| s.parse().ok());
        let facts = ResponseFacts {
            status,
            served: envoy::served_endpoint(msg.metadata_context.as_ref(), &h.attributes)
                .or_else(|| envoy::served_endpoint(None, &msg.attributes)),
            attempts: envoy::attempt_count(&h.attributes)
                .or_else(|| envoy::attempt_count(&msg.attributes)),
        };
        if self.begin_response(facts, msg) && h.end_of_stream {
            self.finish(Outcome::Complete);
        }
        envoy::continue_(Slot::ResponseHeaders)
    }

    /// Starts watching a response whose headers say `facts`: claims the ticket (the picker's
    /// own, or the parked one the metadata names) and hands it the facts. False if the message
    /// did not fit the stream's phase.
    fn begin_response(&mut self, facts: ResponseFacts, msg: &ProcessingRequest) -> bool {
        let claim = match std::mem::replace(&mut self.phase, Phase::Finished) {
            // The picker sees the response too (single-filter set-up).
            Phase::Picked { id } => match id.and_then(|id| self.table.take(id)) {
                Some(ticket) => Claim::Owned(Box::new(ticket)),
                None => Claim::None,
            },
            // An observer stream: report to the ticket the picker parked.
            Phase::Start => match envoy::pick_id(msg.metadata_context.as_ref()) {
                Some(id) => Claim::Parked(id),
                None => Claim::None,
            },
            // A local reply from Envoy before we routed (e.g. its own 413): nothing to watch.
            Phase::RequestBody(_) => {
                self.outcome = Outcome::Cancelled;
                return false;
            }
            other => {
                self.phase = other;
                self.metrics.record_anomaly();
                return false;
            }
        };
        // Hand the facts to the ticket and count the status against the endpoint it now
        // counts against; without a ticket, against the endpoint Envoy reports.
        let metrics = &self.metrics;
        let report = |t: &mut Ticket| {
            t.on_response_headers(facts);
            if let Some(code) = facts.status {
                metrics.record_upstream_status(t.endpoint(), code);
            }
        };
        let mut claim = claim;
        let reported = match &mut claim {
            Claim::Owned(t) => {
                report(t);
                true
            }
            Claim::Parked(id) => self.table.update(*id, report).is_some(),
            Claim::None => false,
        };
        if let (false, Some(code), Some(addr)) = (reported, facts.status, facts.served) {
            self.metrics.record_upstream_status(&addr.to_string(), code);
        }
        self.phase = Phase::Responding(Responding {
            claim,
            first_byte_at: None,
        });
        true
    }

    fn on_response_body(&mut self, b: HttpBody, msg: &ProcessingRequest) -> ProcessingResponse {
        if matches!(self.phase, Phase::Start) {
            // An observer whose filter skips the response headers: the status and the served
            // endpoint come as response attributes with the first chunk.
            let attributes = &msg.attributes;
            let facts = ResponseFacts {
                status: envoy::attribute_u64(attributes, "response.code")
                    .and_then(|c| u16::try_from(c).ok()),
                served: envoy::served_endpoint(msg.metadata_context.as_ref(), attributes),
                attempts: envoy::attempt_count(attributes),
            };
            self.begin_response(facts, msg);
        }
        let (len, end_of_stream) = (b.body.len(), b.end_of_stream);
        let reply = if self.response_mode == BodySendMode::FullDuplexStreamed {
            envoy::streamed_response_body(b.body, end_of_stream)
        } else {
            envoy::continue_(Slot::ResponseBody)
        };
        match &mut self.phase {
            Phase::Responding(r) => {
                if r.first_byte_at.is_none() && len > 0 {
                    let now = Instant::now();
                    r.first_byte_at = Some(now);
                    match &mut r.claim {
                        Claim::Owned(t) => t.on_first_byte(now),
                        Claim::Parked(id) => {
                            self.table.update(*id, |t| t.on_first_byte(now));
                        }
                        Claim::None => {}
                    }
                }
                // An observer has what it watches for at the first byte; a picker watching its
                // own response holds the ticket until the end.
                let observer_done =
                    r.first_byte_at.is_some() && !matches!(r.claim, Claim::Owned(_));
                if end_of_stream || observer_done {
                    self.finish(Outcome::Complete);
                }
            }
            Phase::Finished => {}
            _ => self.metrics.record_anomaly(),
        }
        reply
    }

    /// Answers `rejection` (503s and 429s with `retry-after: retry_after_s`) and ends the stream.
    fn reject(&mut self, rejection: Rejection, retry_after_s: u32) -> Vec<ProcessingResponse> {
        self.metrics.record_immediate(rejection.status);
        tracing::debug!(
            request_id = %self.request_id,
            status = rejection.status,
            reason = %rejection.message,
            "rejected"
        );
        // A response being watched is released, not dropped with its claim.
        self.finish(Outcome::Immediate);
        vec![rejection.into_response(retry_after_s)]
    }

    /// Stops watching the response: an observer reports it is done (the ticket drops if the
    /// picker's stream has ended too), a picker watching its own response drops its ticket.
    fn finish(&mut self, outcome: Outcome) {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        self.outcome = outcome;
        if let Phase::Responding(r) = phase {
            self.release(r);
        }
    }

    fn release(&self, r: Responding) {
        let ticket = match r.claim {
            Claim::Owned(t) => Some(*t),
            Claim::Parked(id) => self.table.observer_done(id),
            Claim::None => None,
        };
        if let Some(t) = &ticket {
            tracing::debug!(
                request_id = %self.request_id,
                endpoint = t.endpoint(),
                ttft_ms = r.first_byte_at.map(|f| f.saturating_duration_since(t.decided_at()).as_secs_f64() * 1e3),
                "response complete"
            );
        }
        // `ticket` drops here, outside the table's locks.
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.phase, Phase::Finished) {
            // The picker's stream ends with the HTTP request: the response is over. The ticket
            // drops now unless an observer still has to report to it.
            Phase::Picked { id: Some(id) } => drop(self.table.picker_ended(id)),
            // Gone mid-response (client away, Envoy reset): done watching.
            Phase::Responding(r) => self.release(r),
            _ => {}
        }
    }
}

/// Set when the future deciding a request is dropped before the blocking decision returns: the
/// stream is gone (Envoy reset it: client gone, message timeout), so the decision is not wanted.
#[derive(Default)]
struct Abandoned(Arc<AtomicBool>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Decides, then (routed) puts the tenant's `cache_salt` into the body the engine receives:
/// both in the caller's thread, so a big body is copied in its lane, not on an async worker.
/// `Some((decision, whether the body changed))`; `None` as for [`decide_guarded`].
fn decide_and_salt(
    router: &Router,
    pending: &mut Pending,
    request_id: &str,
) -> Result<Option<(Decision, bool)>, Rejection> {
    let Some(decision) = decide_guarded(router, pending, request_id)? else {
        return Ok(None);
    };
    let salted = pending.salt()?;
    Ok(Some((decision, salted)))
}

/// Parses and decides; `Ok(None)` if the router itself failed (a bug), so the caller can fall
/// back instead of losing the request.
fn decide_guarded(
    router: &Router,
    pending: &Pending,
    request_id: &str,
) -> Result<Option<Decision>, Rejection> {
    let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let body = pending.body();
        let parsed = request::parse_with(
            pending.api,
            &body,
            pending.state.config.routing.request_limits(),
        )?;
        let ctx = RouteContext {
            subset: pending.subset.as_deref(),
            tenant: pending.tenant.as_deref(),
            request_id,
            objective: pending.flow.objective.as_deref(),
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
