//! Flow control: while every candidate of a model is saturated, requests wait in the router,
//! where they can be ordered, kept fair and shed, instead of in an engine's queue, where nothing
//! can reorder them or tell their client to back off.
//!
//! # Contract
//!
//! - A routed request first asks [`FlowController::admit`] for a [`Permit`], then decides with
//!   the routing policy (so the pick sees the cache and load of *dispatch* time), then drops the
//!   permit once its decision is committed (its load counted on the pick).
//! - A model's queue dispatches while its candidates' room ([`RoomSource`], thresholds in
//!   `flow_control.room` and, by default, the predicted wait against its budget: [`predicted`])
//!   exceeds the tokens and requests of permits handed out and not yet committed; with an
//!   empty queue and room, admission is immediate (one short lock, no wait).
//! - Order: the highest priority band first (priority from the objective header), within a band
//!   the flow (trusted tenant, else fairness id) with the fewest dispatched prompt tokens
//!   (virtual token counter, [`queue`]; at equal counters the one with fewer queued tokens),
//!   within a flow first come first served (or earliest deadline first).
//! - Bounds per model: requests, bytes and wait. A full queue turns away the newest request of
//!   its lowest band if that band is below the newcomer's, else the last-to-be-served request of
//!   a flow of the newcomer's band that is over its share against the newcomer's flow, else the
//!   newcomer. Turned away or expired: 429 if sheddable (priority < 0), 503 otherwise, both with
//!   `retry-after`.
//! - A waiter whose future is dropped (client gone, Envoy reset the stream) is removed from the
//!   queue by its guard's `Drop`; a permit handed to a waiter that is gone releases its
//!   reservation when the channel drops it. Nothing needs remembering by a caller.
//! - No lock is held across an await. A dispatcher task (started with the first queued request,
//!   ending with the controller) re-checks queues every `dispatch_interval_ms` and whenever a
//!   permit is released, since load falls without telling us (first bytes, response ends).
//!
//! # Files
//!
//! - [`queue`]: one model's queue as plain data (bands, flows, counters, bounds' totals).
//! - [`predicted`]: the predicted room's arithmetic (an endpoint's wait against its budget).
//! - `controller`: the queues under a lock, admission, waiting, dispatch, the permit.
//! - `metrics`: counters and wait times, rendered with the live depths.
//! - `request`: a request's priority and flow from its headers, its model from its body.

mod controller;
mod metrics;
pub mod predicted;
pub mod queue;
mod request;

pub use controller::{FlowController, ModelStatus, Permit};
pub use predicted::EndpointWait;
pub use queue::FlowDepth;
pub use request::{sniff_model, Labels};

use crate::config::RoomConfig;

/// What a model's candidates can take now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Room {
    /// Healthy, non-draining endpoints serving the model. With none, the queue does not hold
    /// requests: routing answers them (404 or 503) at once.
    pub candidates: usize,
    /// Candidates with room now or a prompt in prefill (whose room comes back when it is
    /// done): not closed by their KV-cache usage or in-flight limits alone. Higher bands'
    /// reserve never takes the last of these from a lower band.
    pub open: usize,
    /// Prompt tokens the candidates with room can still take before reaching
    /// `room.max_prefill_tokens` (0 for a candidate over any threshold), summed.
    pub free_prefill_tokens: u64,
    /// Requests the candidates with room can still take before their waiting queues reach
    /// `room.max_waiting_requests` (and, under the predicted room, before the wait passes its
    /// budget), summed.
    pub free_requests: u64,
}

/// The request the room is judged for: the one a queue would dispatch next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    /// Its estimated prompt tokens (from the body's size).
    pub tokens: u64,
    /// Its objective's TTFT target, ms, if it has one (the predicted room's budget).
    pub ttft_target_ms: Option<u64>,
}

/// Where the controller reads the candidates' room (the router's tables, or a fake in tests).
pub trait RoomSource: Send + Sync + 'static {
    /// The room `model`'s candidates have under `limits` for `ask`, now. Called under the
    /// controller's lock: it must be quick and must not call back into the controller.
    fn room(&self, model: &str, limits: &RoomConfig, ask: &Ask) -> Room;
}

/// Why a request was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShedReason {
    /// The model's queue was at its request or byte bound.
    #[error("the queue for this model is full")]
    QueueFull,
    /// A more important request took its place in a full queue.
    #[error("a more important request took its place in the queue")]
    Displaced,
    /// It waited `flow_control.max_wait_ms` without room.
    #[error("no endpoint had room within the queue's wait limit")]
    Expired,
    /// The controller went away (shutting down).
    #[error("the router is shutting down")]
    Closed,
}

impl ShedReason {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "full",
            ShedReason::Displaced => "displaced",
            ShedReason::Expired => "expired",
            ShedReason::Closed => "closed",
        }
    }
}

/// A request the queue turned away: its status and `retry-after` decided here, the Envoy reply
/// built by `extproc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("Request not admitted by the router's flow control: {reason}.")]
pub struct Shed {
    /// Why.
    pub reason: ShedReason,
    /// The request's priority (negative: sheddable).
    pub priority: i32,
    /// Seconds for the `retry-after` header (`flow_control.retry_after_s`).
    pub retry_after_s: u32,
}

impl Shed {
    /// 429 for sheddable requests (priority < 0), 503 for the others.
    pub fn status(&self) -> u16 {
        if self.priority < 0 {
            429
        } else {
            503
        }
    }
}
