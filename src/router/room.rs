//! The flow controller's view of the tables: how much room a model's candidates have now, from
//! the same live signals the policy reads (the router's in-flight prefill tokens and requests,
//! the engine's scraped waiting queue and KV usage when fresh).

use std::sync::Arc;
use std::time::Duration;

use super::state::StateCell;
use super::tables::Tables;
use crate::config::{EngineKind, RoomConfig};
use crate::discovery::Endpoint;
use crate::flow::{Room, RoomSource};
use crate::health::Admission;

/// [`RoomSource`] over the router's tables and the config in force.
pub(crate) struct TablesRoom {
    pub(crate) tables: Arc<Tables>,
    pub(crate) state: Arc<StateCell>,
}

impl RoomSource for TablesRoom {
    fn room(&self, model: &str, limits: &RoomConfig) -> Room {
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
        let staleness = Duration::from_millis(config.load.scrape.staleness_ms);
        let mut room = Room::default();
        for ep in ids.iter().map(|&i| &set.all()[i]) {
            if ep.draining || ep.health.admission(now, &config.health) == Admission::No {
                continue;
            }
            room.candidates += 1;
            let scraped = config.load.scrape.enabled && ep.engine != EngineKind::Other;
            let (tokens, requests) = free(ep, limits, scraped, now, staleness);
            room.free_prefill_tokens += tokens;
            room.free_requests += requests;
        }
        room
    }
}

/// Prompt tokens and requests `ep` can still take: none once any signal is at its threshold.
fn free(
    ep: &Endpoint,
    limits: &RoomConfig,
    scraped: bool,
    now: tokio::time::Instant,
    staleness: Duration,
) -> (u64, u64) {
    let load = ep.load.snapshot();
    if ep
        .max_in_flight
        .is_some_and(|max| load.in_flight_requests >= u64::from(max))
    {
        return (0, 0);
    }
    let signal = ep.load.engine.signal(now, staleness);
    let engine = signal.fresh().filter(|_| scraped);
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
