//! Committing a [`Plan`], and the [`Ticket`] a routed request carries until its response ends.
//!
//! The ticket owns everything the request holds on the router's side: its share of the served
//! endpoint's load (an RAII guard), the half-open breaker's trial slot if it took one, what the
//! cost model expected of its first byte, the pick and the destination list sent to Envoy, and
//! the config of the [`RouterState`] snapshot it was decided under (only the config: a ticket
//! does not keep a replaced policy or tokenizer alive). The ext_proc side only reads facts off
//! Envoy's messages ([`ResponseFacts`], the first byte's instant) and hands them over; the
//! ticket judges them (passive health, retries, learned speed) against that config.
//! Dropping it, however the request ends, releases what it holds exactly once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::plan::Plan;
use super::state::RouterState;
use super::tables::Tables;
use crate::config::Config;
use crate::discovery::Endpoint;
use crate::health::{is_failure_status, TrialPermit};
use crate::index::PendingBlocks;
use crate::load::{InflightGuard, TtftContext};
use crate::prefix::DeferredPrefix;

/// A committed decision: what was decided, the destination header value, and the request's
/// ticket.
#[derive(Debug)]
pub struct Decision {
    /// What was decided.
    pub plan: Plan,
    /// The destination value: `ip:port` of each endpoint, comma-separated, pick first.
    pub destination: String,
    /// The request's claim on the pick, to hand the response's facts to.
    pub ticket: Ticket,
    /// The prompt's new text, when it was left for after the decision: run
    /// [`RestOfPrompt::finish`] once the reply is on its way.
    pub rest: Option<RestOfPrompt>,
}

/// What is left of a decision made on a prompt's prefix before its new text
/// (`models[].defer_tokenizing_after`): tokenizing the new text, and predicting that the
/// pick now holds the whole prompt rather than only that prefix. Dropped unfinished, the next
/// request of the conversation finds only the prefix predicted there (and tokenizes the text).
pub struct RestOfPrompt {
    prefix: DeferredPrefix,
    tables: Arc<Tables>,
    endpoint: Arc<Endpoint>,
    kv_events: bool,
    confirmed_blocks: u32,
    /// Remember the pick as the prompt's home ([`super::recall::Recall`]).
    recall: bool,
    model: String,
    /// The policy that decided (its own prefix tree, if any, gets the whole prompt too).
    policy: Arc<dyn crate::policy::Policy>,
    block_size_tokens: u32,
}

impl std::fmt::Debug for RestOfPrompt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestOfPrompt")
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint.address_str)
            .finish()
    }
}

impl RestOfPrompt {
    /// Bytes this holds until finished (the rendered prompt).
    pub fn held_bytes(&self) -> usize {
        self.prefix.held_bytes()
    }

    /// Not finished (no room to queue it): counted; the prefix the decision used stays
    /// predicted on the pick.
    pub fn drop_unfinished(self) {
        self.tables.metrics.cache.record_deferred_dropped();
    }

    /// Tokenizes the rest (into the token cache) and records the whole prompt's blocks on the
    /// pick as the decision would have. Takes as long as tokenizing the new text: run it off
    /// the request's path.
    pub fn finish(self) {
        let Some(hashes) = self.prefix.finish() else {
            self.tables.metrics.cache.record_deferred(false);
            return;
        };
        self.tables.metrics.cache.record_deferred(true);
        // On its way already: the new text's blocks count at once (the claim drops here).
        drop(record_blocks(
            &self.tables,
            self.kv_events,
            &self.endpoint,
            &self.model,
            &hashes,
            self.confirmed_blocks,
            std::time::Duration::ZERO,
        ));
        if self.recall {
            self.tables.recall.record(&hashes, self.endpoint.id);
        }
        self.policy
            .record_rest(self.endpoint.address, &hashes, self.block_size_tokens);
    }
}

impl Decision {
    /// The picked endpoint.
    pub fn primary(&self) -> &Arc<Endpoint> {
        self.plan.primary()
    }

    /// The policy that decided.
    pub fn policy(&self) -> &'static str {
        self.plan.policy
    }

    /// Prompt tokens (exact or estimated).
    pub fn prompt_tokens(&self) -> u64 {
        self.plan.prefix.tokens
    }
}

/// What a response's headers say about how it was served, as Envoy reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResponseFacts {
    /// The HTTP status, if the headers carried a valid one.
    pub status: Option<u16>,
    /// The endpoint that served it (`x-gateway-destination-endpoint-served`), if reported.
    pub served: Option<SocketAddr>,
    /// Upstream attempts Envoy made (`upstream.request_attempt_count`), if reported.
    pub attempts: Option<u64>,
}

/// One routed request's claim on the router, from its decision until its response ends.
#[derive(Debug)]
pub struct Ticket {
    tables: Arc<Tables>,
    /// The config the request was decided under; its response is judged by the same.
    config: Arc<Config>,
    /// The endpoint the request counts against: the pick, or the one that served it.
    endpoint: Arc<Endpoint>,
    /// The destination list as sent to Envoy: the pick, then the fallbacks in order.
    destinations: Vec<Arc<Endpoint>>,
    /// Its share of `endpoint`'s load.
    guard: InflightGuard,
    /// Uncached prompt tokens the decision gave the endpoint to prefill.
    uncached_tokens: u64,
    decided_at: Instant,
    /// What the cost model expected of the pick, to learn from its first byte; cleared once
    /// used, or when the pick did not serve it or failed.
    pub(super) ttft: Option<TtftContext>,
    /// The pick's half-open trial slot, returned once its outcome is known.
    pub(super) trial: Option<TrialPermit>,
    /// Marked for Envoy's observer (`routing.observe_interval_ms`): its response's facts and
    /// first byte will be reported. Otherwise nothing will, and its first byte is taken to
    /// come at `first_byte_due`.
    watched: bool,
    /// When the cost model expected the pick's first byte.
    first_byte_due: Instant,
    /// The response's first byte times the prefill ([`super::plan::Plan::first_byte_is_ttft`]):
    /// otherwise nothing is learned from it, and the prefill is taken as done at
    /// `first_byte_due` even when the request is watched.
    first_byte_is_ttft: bool,
    /// The prompt's blocks new to the pick (without KV events): held beyond its index capacity
    /// until the prefill is done (the first byte, or when it was due), and all of them pinned
    /// there until the request ends (the ticket's drop).
    pending: Option<PendingBlocks>,
}

impl Ticket {
    /// The endpoint the request counts against (`ip:port`): the pick, or the endpoint that
    /// served it if Envoy retried elsewhere.
    pub fn endpoint(&self) -> &str {
        &self.endpoint.address_str
    }

    /// When the decision was committed.
    pub fn decided_at(&self) -> Instant {
        self.decided_at
    }

    /// Whether the request is to be watched by Envoy's observer filter (the reply marks it);
    /// an unwatched one gets no response facts and no first byte reported.
    pub fn watched(&self) -> bool {
        self.watched
    }

    /// When the decision expected the first byte (decision time plus the pick's predicted
    /// TTFT): for a request whose first byte will not be reported in time
    /// ([`Self::first_byte_predicted`]), when to call [`Self::on_first_byte_due`].
    pub fn first_byte_due(&self) -> Instant {
        self.first_byte_due
    }

    /// Whether the prefill is taken as done at [`Self::first_byte_due`]: the request is not
    /// watched, or its first byte comes only after the whole generation (not streamed).
    pub fn first_byte_predicted(&self) -> bool {
        !self.watched || !self.first_byte_is_ttft
    }

    /// An unwatched request's predicted first byte came: its prefill is taken as done (the
    /// endpoint's queue shrinks as it would have), without learning anything from the
    /// prediction itself. Idempotent; a no-op after a real first byte.
    pub fn on_first_byte_due(&mut self) {
        self.prefill_done();
    }

    /// The prompt is prefilled: the endpoint's prefill queue shrinks, the prompt's blocks count
    /// against the pick's index capacity, and a request queued for room may go (a no-op
    /// without flow control). Idempotent.
    fn prefill_done(&mut self) {
        self.guard.prefill_done();
        if let Some(p) = &mut self.pending {
            p.prefilled();
        }
        self.tables.room_freed.notify_one();
    }

    /// The response's headers arrived: records the outcome in the serving endpoint's breaker
    /// (a 5xx is a strong signal against it, anything else says it works), counts the
    /// endpoints Envoy tried before the one that served as failed, and moves the load there.
    pub fn on_response_headers(&mut self, facts: ResponseFacts) {
        let health = &self.config.health;
        if let Some(addr) = facts.served.filter(|&a| a != self.endpoint.address) {
            // Another endpoint served it. override_host walks the list in order, skipping
            // addresses not (yet) in Envoy's cluster, and retries the next one after a connect
            // failure, reset or 503: the endpoints before the served one failed, as many of
            // them as Envoy made extra attempts (all of them if it did not say). Passive health
            // signals for each.
            let before = self
                .destinations
                .iter()
                .position(|e| e.address == addr)
                .unwrap_or(1);
            let failed = facts
                .attempts
                .map_or(before, |a| (a.saturating_sub(1) as usize).min(before));
            tracing::debug!(
                pick = %self.endpoint.address_str,
                served = %addr,
                attempts = facts.attempts,
                failed,
                "served by another endpoint than the pick"
            );
            // The pick (the first) failed on its own trial slot if it had one: that reopens
            // a half-open breaker; the fallbacks had none.
            let pick_trial = self.trial.is_some();
            for (i, failed) in self.destinations[..failed].iter().enumerate() {
                self.tables
                    .record_outcome(failed, false, i == 0 && pick_trial, health);
            }
            // Nothing learned about the pick's speed or its trial from another's response.
            self.trial = None;
            self.ttft = None;
            // Move the load to the endpoint that serves it.
            let actual = match self.destinations.iter().find(|e| e.address == addr) {
                Some(ep) => Some(Arc::clone(ep)),
                None => self.tables.registry.snapshot().get(&addr).cloned(),
            };
            if let Some(actual) = actual {
                self.guard = actual.load.begin(self.uncached_tokens);
                self.endpoint = actual;
            }
            // The pick neither prefills nor runs it: its blocks count there as they are, and
            // are not held by this request.
            if let Some(p) = &mut self.pending {
                p.release();
            }
        }
        if let Some(code) = facts.status {
            // Envoy's own 503 after exhausted retries lands on the last endpoint it tried.
            let ok = !is_failure_status(code);
            let trial = self.trial.take().is_some();
            self.tables
                .record_outcome(&self.endpoint, ok, trial, health);
            // Only an answer prefilled the prompt: an error body (a 400 for a prompt over the
            // context, a 429) comes at once and would teach a speed of millions of tokens a
            // second, weighted by the largest prompts.
            if !(200..300).contains(&code) {
                self.ttft = None;
            }
        }
    }

    /// The response's first body byte went by at `at`: the prompt is prefilled, and the pick's
    /// time to first token teaches its learned speed and residual.
    pub fn on_first_byte(&mut self, at: Instant) {
        self.prefill_done();
        if let Some(ctx) = self.ttft.take() {
            let ttft_ms = at.saturating_duration_since(self.decided_at).as_secs_f64() * 1e3;
            self.endpoint.load.learned.observe(
                &ctx,
                ttft_ms,
                &self.config.load.learning,
                tokio::time::Instant::now(),
            );
        }
    }
}

/// Commits `plan`, decided under `state` at `started`: takes the pick's trial slot if it is a
/// trial, counts the request in flight there, predicts the pick now holds the prompt's prefix,
/// counts the decision, and logs its explanation under `request_id` when recording is on.
pub(super) fn commit(
    tables: &Arc<Tables>,
    state: &RouterState,
    plan: Plan,
    started: Instant,
    request_id: &str,
) -> Decision {
    let primary = Arc::clone(plan.primary());
    let pick = plan.ranking.pick();
    let trial = if plan.signals[pick].trial {
        let (permit, change) = primary
            .health
            .begin_trial(tokio::time::Instant::now(), &state.config.health);
        if let Some(change) = change {
            tables.report_health(&primary, change);
        }
        // A concurrent decision may have taken the last slot since the plan: the request
        // still goes (one over the trickle bound), it is not worth failing.
        permit
    } else {
        None
    };
    let uncached_tokens = plan.uncached_tokens();
    let decided_at = Instant::now();
    // Watched by the observer: every trial (its outcome closes or reopens the breaker), every
    // request while the pick is in doubt (a failure counted: the next ones decide whether it
    // opens) or while flow control holds work for real first bytes, else one per interval per
    // endpoint (under the interval's rate, every request).
    let watched = trial.is_some()
        || !primary.health.is_clean()
        || state.config.flow_control.enabled
        || primary.load.claim_watch(
            decided_at,
            std::time::Duration::from_millis(state.config.routing.observe_interval_ms),
        );
    let (ttft, predicted_ttft_ms) = {
        let c = &plan.candidates[pick];
        let p = state.cost.predict(&plan.request, c);
        // Only with work ahead in the snapshot the sample counts (a request racing in since
        // adds time the sample's work would not include).
        let ahead_elapsed_ms = if c.load.in_flight_prefilling > 0 {
            primary.load.prefill_head_elapsed_ms()
        } else {
            0.0
        };
        let ctx = TtftContext {
            work_tokens: c.load.in_flight_prefill_tokens + uncached_tokens,
            ahead_elapsed_ms,
            // The load from a slower tier is not prefill: keep it out of the speed sample.
            fixed_ms: state.cost.fixed_ms(c) + p.load_ms,
            predicted_ms: p.ttft_ms - p.residual_ms,
            engine_waiting: c.engine.map(|e| e.waiting_requests),
            tier_load: p.load_ms > 0.0,
        };
        (ctx, p.ttft_ms)
    };
    tables.arrivals.record(&plan.model, decided_at);
    let guard = primary.load.begin(uncached_tokens);
    let confirmed_blocks = plan.matches[pick].confirmed_blocks;
    let first_byte = first_byte_in(predicted_ttft_ms);
    let recall = state.policy.wants_homes();
    let pending = record_blocks(
        tables,
        state.kv_events(),
        &primary,
        &plan.model,
        &plan.prefix.block_hashes,
        confirmed_blocks,
        first_byte,
    );
    if recall {
        tables.recall.record(&plan.prefix.block_hashes, primary.id);
    }
    let rest = plan.prefix.deferred.clone().map(|prefix| RestOfPrompt {
        prefix,
        tables: Arc::clone(tables),
        endpoint: Arc::clone(&primary),
        kv_events: state.kv_events(),
        confirmed_blocks,
        recall,
        model: plan.model.clone(),
        policy: Arc::clone(&state.policy),
        block_size_tokens: plan.prefix.block_size_tokens,
    });
    let mut destination = String::with_capacity(plan.endpoints.len() * 22);
    for ep in &plan.endpoints {
        if !destination.is_empty() {
            destination.push(',');
        }
        destination.push_str(&ep.address_str);
    }
    tables
        .metrics
        .record_decision(plan.policy, &primary.address_str, started.elapsed());
    tables.metrics.cache.record(
        plan.policy,
        plan.signals[pick].cache_source,
        plan.prefix.tokens,
        plan.candidates[pick].matched_tokens,
    );
    tables
        .metrics
        .cache
        .record_prefix_source(plan.prefix.source_index());
    if plan.stale_signals() {
        tables.metrics.signals.record_stale_decision(plan.policy);
    }
    if !request_id.is_empty() && tables.decisions.enabled() {
        tables.decisions.record(request_id, plan.explain());
    }
    let ticket = Ticket {
        tables: Arc::clone(tables),
        config: Arc::clone(&state.config),
        endpoint: primary,
        destinations: plan.endpoints.clone(),
        guard,
        uncached_tokens,
        decided_at,
        ttft: plan.first_byte_is_ttft.then_some(ttft),
        trial,
        watched,
        first_byte_due: decided_at + first_byte,
        first_byte_is_ttft: plan.first_byte_is_ttft,
        pending,
    };
    Decision {
        plan,
        destination,
        ticket,
        rest,
    }
}

/// How long after the decision an unwatched request's first byte is taken to come: the
/// predicted TTFT, within [0, 1 h] (a prediction is finite and positive, but a request's end
/// releases its prefill anyway).
fn first_byte_in(predicted_ttft_ms: f64) -> std::time::Duration {
    if predicted_ttft_ms.is_finite() && predicted_ttft_ms > 0.0 {
        std::time::Duration::from_secs_f64(predicted_ttft_ms.min(3.6e6) / 1e3)
    } else {
        std::time::Duration::ZERO
    }
}

/// Predicts that `primary` now holds `hashes` (the prompt's blocks), and offers the decision to
/// peer instances. Without KV events, returns the blocks new there, pending until the prefill
/// is done ([`PendingBlocks`]: dropped at once, they count at once); with events, the engine's
/// own say when it stores and evicts them, and the predictions last `wait` (until the predicted
/// first byte) longer.
fn record_blocks(
    tables: &Tables,
    kv_events: bool,
    primary: &Endpoint,
    model: &str,
    hashes: &[u64],
    confirmed_blocks: u32,
    wait: std::time::Duration,
) -> Option<PendingBlocks> {
    if hashes.is_empty() {
        return None;
    }
    if let Some(outbox) = tables.sharing.get() {
        outbox.offer(primary.address, model, hashes);
    }
    // Only fails for an endpoint id beyond 2^24; the decision stands either way.
    if kv_events {
        // Short-lived while the engine's events will confirm them, cut to whole engine
        // blocks, and starting the silence clock.
        let reported = primary.load.engine.last().and_then(|s| s.block_size_tokens);
        let _ = tables
            .events
            .record_routed(primary.id, hashes, confirmed_blocks, reported, wait);
        None
    } else {
        tables.index.insert_routed(primary.id, hashes).ok()
    }
}
