//! The flow controller's view of the tables: how much room a model's candidates have now, from
//! the same live signals the policy reads (the router's in-flight prefill tokens and requests,
//! the engine's scraped waiting queue and KV usage when fresh) and, under the predicted room,
//! the `predicted-ttft` cost model's queue wait on each (see `crate::flow::predicted`).

use std::sync::Arc;

use super::plan::{engine_view, load_view};
use super::state::StateCell;
use super::tables::Tables;
use crate::config::{Config, RoomConfig, RoomMode};
use crate::discovery::Endpoint;
use crate::flow::{Ask, EndpointWait, Room, RoomSource};
use crate::health::Admission;
use crate::policy::cost::CostModel;

/// [`RoomSource`] over the router's tables and the config in force.
pub(crate) struct TablesRoom {
    pub(crate) tables: Arc<Tables>,
    pub(crate) state: Arc<StateCell>,
}

impl RoomSource for TablesRoom {
    fn room(&self, model: &str, limits: &RoomConfig, ask: &Ask) -> Room {
        let state = self.state.load();
        let config = &state.config;
        let set = self.tables.registry.snapshot();
        let ids: Vec<usize> = if model.is_empty() {
            (0..set.all().len()).collect()
        } else {
            match set.serving(model) {
                Some((_, ids)) => ids.to_vec(),
                None => return Room::default(),
            }
        };
        let now = tokio::time::Instant::now();
        let cost = CostModel::from(&config.policy.predicted_ttft);
        let mut room = Room::default();
        for ep in ids.iter().map(|&i| &set.all()[i]) {
            if ep.draining || ep.health.admission(now, &config.health) == Admission::No {
                continue;
            }
            room.candidates += 1;
            let (tokens, mut requests) = free(ep, limits, config, now);
            if limits.mode == RoomMode::Predicted && requests > 0 {
                let slots = wait_of(ep, config, &cost, ask, now).slots(
                    limits.max_ttft_factor,
                    ask.ttft_target_ms,
                    limits.dispatch_lead_ms as f64,
                );
                requests = requests.min(slots);
            }
            if requests > 0 {
                room.free_prefill_tokens += tokens;
                room.free_requests += requests;
                room.open += 1;
            } else if ep.load.snapshot().in_flight_prefilling > 0 {
                room.open += 1;
            }
        }
        room
    }
}

/// `ep`'s predicted wait for a request with nothing cached there, in the cost model's terms.
/// Its typical request: the average prompt routed there, or `ask`'s own before any was. The
/// prefill left there: the prompts without a first byte at the learned speed, less how long the
/// head has been prefilling.
fn wait_of(
    ep: &Endpoint,
    config: &Config,
    cost: &CostModel,
    ask: &Ask,
    now: tokio::time::Instant,
) -> EndpointWait {
    let view = load_view(ep, config, now);
    let load = ep.load.snapshot();
    let typical = if load.requests_total == 0 {
        ask.tokens
    } else {
        load.typical_prefill_tokens
    };
    let in_prefill_ms = cost.prefill_ms(view.load.in_flight_prefill_tokens, &view);
    EndpointWait {
        queue_ms: cost.queue_ms(&view),
        prefilling: view.load.in_flight_prefilling,
        prefill_left_ms: (in_prefill_ms - ep.load.prefill_head_elapsed_ms()).max(0.0),
        typical_prefill_ms: cost.prefill_ms(typical, &view),
        base_ms: cost.base_ms,
    }
}

/// Prompt tokens and requests `ep` can still take under the thresholds: none once any signal
/// is at its threshold.
fn free(
    ep: &Endpoint,
    limits: &RoomConfig,
    config: &Config,
    now: tokio::time::Instant,
) -> (u64, u64) {
    let load = ep.load.snapshot();
    if ep
        .max_in_flight
        .is_some_and(|max| load.in_flight_requests >= u64::from(max))
    {
        return (0, 0);
    }
    let engine = engine_view(ep, config, crate::load::Stamp::of(now)).load;
    // Without a fresh engine sample the router's own count of requests without a first byte
    // stands in for the engine's queue.
    let waiting = engine.map_or(load.in_flight_prefilling, |s| s.waiting_requests);
    if waiting >= limits.max_waiting_requests
        || engine.is_some_and(|s| s.kv_cache_usage >= limits.max_kv_cache_usage)
    {
        return (0, 0);
    }
    let tokens = limits
        .max_prefill_tokens
        .saturating_sub(load.in_flight_prefill_tokens);
    (tokens, limits.max_waiting_requests - waiting)
}

#[cfg(test)]
#[path = "room_tests.rs"]
mod tests;
