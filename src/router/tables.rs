//! [`Tables`]: the live state every decision reads and commits to, built together in one
//! constructor: the endpoint set (with the address <-> id interner), the ownership index, the
//! KV-event streams that feed it, the decision log, the arrival meter and the metrics handles.
//!
//! Nothing here is attached later: the KV-event streams exist from the start with no
//! subscription (every endpoint reads as predictions-only) and take their sockets when the
//! config is applied ([`crate::events::KvEvents::reload`]). A reload replaces the
//! [`RouterState`] snapshot, never the tables: load counters, health, cache entries and parked
//! requests carry over.

use std::sync::Arc;

use super::arrivals::ArrivalRates;
use super::feed::DecisionFeed;
use super::log::DecisionLog;
use super::recall::Recall;
use super::state::RouterState;
use crate::config::{Config, HealthConfig};
use crate::discovery::{Endpoint, Registry, SetChange};
use crate::events::KvEvents;
use crate::health::Change;
use crate::index::{Clock, IndexOptions, OwnershipIndex, TokioClock};
use crate::telemetry::Metrics;

/// How long an endpoint's id stays quarantined after the last holder of the endpoint let go
/// (no set, plan, ticket, scrape or KV-event stream holds it), before another address may get
/// it. Holding is what makes reuse safe; this is a margin on top (see
/// [`crate::index::EndpointInterner`]). Under churn, the ids taken are about the endpoints
/// alive plus those that left within this time.
pub(crate) const ID_REUSE_GRACE_MS: u64 = 10_000;

/// The router's tables. Shared (`Arc`) by the pipeline, the tickets of routed requests and the
/// narrow handles given to the background tasks and the admin API.
#[derive(Debug)]
pub(crate) struct Tables {
    /// The endpoint set, per discovery source.
    pub(crate) registry: Arc<Registry>,
    /// Which endpoint holds which prefix blocks.
    pub(crate) index: Arc<OwnershipIndex>,
    /// The engines' KV-event streams feeding `index`.
    pub(crate) events: KvEvents,
    /// Recent decisions' explanations (`debug.record_decisions`).
    pub(crate) decisions: DecisionLog,
    /// Live decision records for watchers (`kvrouter.v1.Admin/WatchDecisions`).
    pub(crate) feed: DecisionFeed,
    /// Requests routed per second, per model.
    pub(crate) arrivals: ArrivalRates,
    /// Where each prefix was last routed (`policy.predicted_ttft.recall_weight`).
    pub(crate) recall: Recall,
    /// The metrics handles.
    pub(crate) metrics: Arc<Metrics>,
    /// Where committed decisions are offered to the peer instances (`sharing`); set once at
    /// start-up when sharing is on.
    pub(crate) sharing: std::sync::OnceLock<crate::sharing::Outbox>,
    /// Notified when a routed request's first byte frees prefill room on its endpoint: the
    /// flow controller's dispatcher re-checks its queues then, not only on its next tick.
    pub(crate) room_freed: Arc<tokio::sync::Notify>,
    /// The index's clock, which also times the quarantine of reclaimed endpoint ids.
    clock: Arc<dyn Clock>,
}

impl Tables {
    /// Empty tables over `config`'s endpoints (one clock for the index and its event streams).
    pub(crate) fn new(config: &Config, metrics: Arc<Metrics>) -> Tables {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let registry = Arc::new(Registry::new(&config.resolved_endpoints()));
        let index = Arc::new(OwnershipIndex::new(
            IndexOptions::from(&config.cache_index),
            Arc::clone(&clock),
        ));
        let events = KvEvents::new(
            config,
            Arc::clone(&index),
            Arc::clone(registry.interner()),
            Arc::clone(&clock),
        );
        Tables {
            registry,
            index,
            events,
            decisions: DecisionLog::default(),
            feed: DecisionFeed::default(),
            arrivals: ArrivalRates::default(),
            recall: Recall::default(),
            metrics,
            sharing: std::sync::OnceLock::new(),
            room_freed: Arc::new(tokio::sync::Notify::new()),
            clock,
        }
    }

    /// Settles the tables' config-derived settings on `state`: index capacities, the decision
    /// log's size, the signal metrics' thresholds.
    pub(crate) fn configure(&self, state: &RouterState) {
        self.apply_capacities(state);
        self.decisions
            .set_capacity(state.config.debug.record_decisions);
        self.metrics.signals.configure(&state.config);
        self.metrics.gie.configure(&state.config);
    }

    /// Drops removed endpoints' cache entries (whatever source removed them) and reclaims the
    /// ids of endpoints gone for good ([`Self::reclaim_ids`]).
    pub(crate) fn forget_removed(&self, change: &SetChange) {
        for addr in &change.removed {
            if let Some(id) = self.registry.interner().get(addr) {
                self.index.clear_endpoint(id);
            }
        }
        self.reclaim_ids();
    }

    /// Frees the ids of endpoints nothing has held for [`ID_REUSE_GRACE_MS`], retiring their
    /// index state (entries, recency list, capacity), so new addresses reuse them and the
    /// tables indexed by id stay as small as the endpoints alive. Run after every change of
    /// the endpoint set and of the KV-event streams: the ids the next endpoints need are freed
    /// by then, and a quiet set needs none.
    pub(crate) fn reclaim_ids(&self) {
        let freed =
            self.registry
                .interner()
                .reclaim(self.clock.now_ms(), ID_REUSE_GRACE_MS, |id| {
                    self.index.retire_endpoint(id)
                });
        if freed > 0 {
            self.metrics.record_endpoint_ids_reclaimed(freed);
            tracing::debug!(freed, "endpoint ids of departed endpoints reclaimed");
        }
    }

    /// Sets each endpoint's index capacity from its KV capacity: configured, else what its
    /// engine reports (`vllm:cache_config_info`), plus its pool's slower tiers'
    /// (`kv_tiers.*.capacity_tokens`, else the CPU tier's reported `kv_offloading_size`), in
    /// blocks of its (first) model's block size.
    pub(crate) fn apply_capacities(&self, state: &RouterState) {
        for ep in self.registry.snapshot().all() {
            self.apply_capacity(ep, state);
        }
    }

    /// [`Self::apply_capacities`] for one endpoint. An engine's own report is clamped to
    /// `cache_index.max_engine_capacity_tokens`: whoever answers at a scraped address must not
    /// size the index (about 80 bytes a block); a configured capacity is the operator's word.
    pub(crate) fn apply_capacity(&self, ep: &Endpoint, state: &RouterState) {
        let scraped = || {
            ep.load
                .engine
                .last()
                .and_then(|s| s.capacity_tokens)
                .map(|t| state.config.cache_index.clamp_engine_capacity(t))
        };
        let Some(gpu) = ep.cache_capacity_tokens.or_else(scraped) else {
            return;
        };
        let model = ep.models.first().map(String::as_str).unwrap_or("");
        // Blocks offloaded to slower tiers stay findable there: remember them too. The CPU
        // tier's size is the config's, else the engine's report (`kv_offloading_size`).
        let tiers = state.kv_tiers(&ep.pool);
        let cpu = match tiers.cpu.capacity_tokens {
            0 => ep
                .load
                .engine
                .last()
                .and_then(|s| s.cpu_offload_bytes)
                .map_or(0, |bytes| {
                    let tokens = bytes / state.kv_bytes_per_token(model).max(1);
                    state.config.cache_index.clamp_engine_capacity(tokens)
                }),
            configured => configured,
        };
        let tokens = gpu
            .saturating_add(cpu)
            .saturating_add(tiers.other.capacity_tokens);
        let block = u64::from(state.tokenizers.block_size_tokens(model).max(1));
        let _ = self
            .index
            .set_capacity(ep.id, usize::try_from(tokens / block).unwrap_or(usize::MAX));
    }

    /// Records a peer instance's decision: `endpoint` was sent a prompt with `hashes` `age`
    /// ago. The same prediction our own decision would have recorded (the same TTL, less the
    /// message's age; on endpoints with KV events, cut to whole engine blocks with the trusted
    /// TTL), except that it does not start the KV-event silence clock: silence is judged on
    /// the work this instance sent.
    pub(crate) fn apply_peer_decision(
        &self,
        state: &RouterState,
        endpoint: std::net::SocketAddr,
        hashes: &[u64],
        age: std::time::Duration,
    ) -> crate::sharing::PeerOutcome {
        use crate::sharing::PeerOutcome;
        let set = self.registry.snapshot();
        let Some(ep) = set.get(&endpoint) else {
            return PeerOutcome::UnknownEndpoint;
        };
        if hashes.is_empty() {
            return PeerOutcome::Applied;
        }
        let ttl = if state.kv_events() {
            self.events.prediction_ttl(ep.id)
        } else {
            self.index.options().prediction_ttl
        };
        if age >= ttl {
            return PeerOutcome::Stale;
        }
        let _ = if state.kv_events() {
            let reported = ep.load.engine.last().and_then(|s| s.block_size_tokens);
            let all = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
            self.events
                .record_routed_aged(ep.id, hashes, all, reported, age)
        } else {
            self.index.insert_predicted_for(ep.id, hashes, ttl - age)
        };
        PeerOutcome::Applied
    }

    /// Counts and logs a change of `ep`'s health.
    pub(crate) fn report_health(&self, ep: &Endpoint, change: Change) {
        self.metrics.signals.record_health_change(ep, change);
        if change.is_ejection() {
            tracing::warn!(endpoint = %ep.address_str, cause = change.cause.as_str(), from = change.from, to = change.to, "endpoint ejected");
        } else {
            tracing::info!(endpoint = %ep.address_str, cause = change.cause.as_str(), from = change.from, to = change.to, "endpoint health changed");
        }
    }

    /// Records the outcome of a request served by `ep` (`ok`: no failure status, and not
    /// retried elsewhere) into its circuit breaker, judged by `health`.
    pub(crate) fn record_outcome(
        &self,
        ep: &Endpoint,
        ok: bool,
        trial: bool,
        health: &HealthConfig,
    ) {
        if let Some(change) =
            ep.health
                .record_request(ok, trial, tokio::time::Instant::now(), health)
        {
            self.report_health(ep, change);
        }
    }
}

#[cfg(test)]
#[path = "reclaim_tests.rs"]
mod reclaim_tests;
