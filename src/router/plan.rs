//! The decision itself, without side effects: request -> candidates -> prefix identity -> index
//! and load snapshot -> policy -> ranked endpoints ([`Plan`]).
//!
//! [`plan`] is a function of its inputs only: the request's [`RouterState`] snapshot, read
//! views of the [`Tables`] (the endpoint set, index lookups, event-stream trust, arrival rate)
//! and the request with its context. It writes nothing, so `explain` runs exactly what routing
//! runs; committing the result is [`super::ticket`]'s job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::explain::Explanation;
use super::state::RouterState;
use super::tables::Tables;
use super::{RouteContext, RouteError};
use crate::config::{Config, EngineKind, KvTiersConfig};
use crate::discovery::{Endpoint, ModelMatch};
use crate::events::{weighted_blocks, SourceState};
use crate::health::Admission;
use crate::index::PrefixMatch;
use crate::load::{EngineSignal, Stamp};
use crate::policy::{CandidateView, EngineLoad, Ranking, RequestView, RouterLoad, TierHold};
use crate::prefix::{Namespace, PrefixIdentity};
use crate::request::{ApiKind, ParsedRequest};

/// Where a candidate's inputs came from, one per candidate of a [`Plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateSignals {
    /// The engine's scraped load: `fresh`, `stale` (older than `load.scrape.staleness_ms`:
    /// ignored), `missing` (never scraped successfully) or `not-scraped` (scraping off, or an
    /// `engine: other` pool).
    pub engine: &'static str,
    /// Age of the last engine sample, ms, if there is one.
    pub engine_age_ms: Option<u64>,
    /// The prefill speed's origin: `learned`, `configured` or `default`.
    pub prefill_speed: &'static str,
    /// Admitted as one of a half-open breaker's trial requests.
    pub trial: bool,
    /// Where the candidate's cache entries come from: `events` (the engine's KV events, in
    /// sequence), `events+predictions` (events flow but some were missed), or `predictions`
    /// (no events configured, or not flowing).
    pub cache_source: &'static str,
    /// Why events are not the whole truth there (`gap`, `restart`, `silent`...), if they are not.
    pub cache_reason: Option<&'static str>,
    /// The CPU tier's load bandwidth's origin: `learned` (the engine's transfer counters) or
    /// `configured` (`pools[].kv_tiers.cpu`).
    pub cpu_tier_bandwidth: &'static str,
}

impl CandidateSignals {
    /// Whether the engine signal was expected but not fresh, so the policy fell back to the
    /// router's own counts for this candidate.
    pub fn degraded(&self) -> bool {
        matches!(self.engine, "stale" | "missing")
    }
}

/// A decision computed but not committed: everything a policy saw and said.
#[derive(Debug)]
pub struct Plan {
    /// Ranked endpoints: the pick, then up to `routing.fallback_endpoints` fallbacks (healthy
    /// ones first; unhealthy ones only fill the list's tail as a last resort).
    pub endpoints: Vec<Arc<Endpoint>>,
    /// The policy that decided.
    pub policy: &'static str,
    /// The prompt's identity (length, block hashes).
    pub prefix: PrefixIdentity,
    /// What the policy saw, one entry per candidate.
    pub candidates: Vec<CandidateView>,
    /// The policy's ranking of `candidates`.
    pub ranking: Ranking,
    /// The requested model, and the adapter if the model named one.
    pub model: String,
    /// The LoRA adapter, if `model` named one.
    pub adapter: Option<String>,
    /// Per candidate (same indexing as `candidates`): where its inputs came from.
    pub signals: Vec<CandidateSignals>,
    /// Endpoints serving the model that were left out because they are unhealthy.
    pub unhealthy: Vec<Arc<Endpoint>>,
    /// The request as the policy saw it.
    pub request: RequestView,
    /// Per candidate, what the index matched (blocks, confirmed, offloaded).
    pub matches: Vec<PrefixMatch>,
    /// Prompt tokens the pick must compute ([`Self::uncached_tokens`]).
    uncached_tokens: u64,
    /// Whether the response's first byte comes with its first token (a streamed answer, or an
    /// embedding: no decode), so it times the prefill. A non-streamed answer's first byte
    /// comes after the whole generation.
    pub first_byte_is_ttft: bool,
}

impl Plan {
    /// The picked endpoint.
    pub fn primary(&self) -> &Arc<Endpoint> {
        &self.endpoints[0]
    }

    /// Uncached prompt tokens on the pick: the prefill work it was given, as the cost model
    /// counts it (tokens loaded from a slower tier are not computed under `load-time`
    /// pricing).
    pub fn uncached_tokens(&self) -> u64 {
        self.uncached_tokens
    }

    /// The user-facing breakdown (no prompt text).
    pub fn explain(&self) -> Explanation {
        Explanation::from_plan(self)
    }

    /// Whether some candidate's engine signal was stale or missing, so the policy decided on
    /// the router's own in-flight counts for it.
    pub fn stale_signals(&self) -> bool {
        self.signals.iter().any(CandidateSignals::degraded)
    }
}

/// The policy's view of the router's own counts on `ep`; the head's prefill progress only with
/// `progress` (reading it takes a lock).
fn router_load(ep: &Endpoint, progress: bool) -> RouterLoad {
    let s = ep.load.snapshot();
    let prefill_head_elapsed_us = if progress {
        // Finite and >= 0; `as` saturates.
        (ep.load.prefill_head_elapsed_ms() * 1e3) as u64
    } else {
        0
    };
    RouterLoad {
        in_flight_requests: s.in_flight_requests,
        in_flight_prefill_tokens: s.in_flight_prefill_tokens,
        in_flight_prefilling: s.in_flight_prefilling,
        prefill_head_elapsed_us,
    }
}

/// `ep`'s engine as a decision sees it at `now`.
pub(super) struct EngineView {
    /// Whether its engine is scraped under the config.
    pub(super) scraped: bool,
    /// Its signal: `fresh`, `stale` or `missing` ([`EngineSignal::state_of`]).
    pub(super) signal: &'static str,
    /// Its load, when the signal is fresh.
    pub(super) load: Option<EngineLoad>,
    /// Ms since its last sample, if there is one.
    pub(super) age_ms: Option<u64>,
}

/// `ep`'s engine under `config` at `now` (a decision takes its [`Stamp`] once), from one read
/// of its last sample's brief (this runs for every candidate of every decision: nothing shared
/// is written).
pub(super) fn engine_view(ep: &Endpoint, config: &Config, now: Stamp) -> EngineView {
    let scrape = &config.load.scrape;
    let scraped = scrape.enabled && ep.engine != EngineKind::Other;
    let last = ep.load.engine.brief_at(now);
    let age = last.map(|s| s.age);
    let signal = EngineSignal::state_of(age, Duration::from_millis(scrape.staleness_ms));
    let load = last
        .filter(|_| scraped && signal == "fresh")
        .map(|s| EngineLoad {
            waiting_requests: s.waiting_requests,
            running_requests: s.running_requests,
            kv_cache_usage: s.kv_cache_usage,
        });
    EngineView {
        scraped,
        signal,
        load,
        // Whole ms in u64 arithmetic (`as_millis` divides a u128).
        age_ms: age.map(|a| a.as_secs() * 1000 + u64::from(a.subsec_millis())),
    }
}

/// `ep`'s prefill speed (tokens per second) and where it comes from: `learned` once trusted,
/// else configured for the endpoint, else the policy's default.
pub(super) fn prefill_speed(
    ep: &Endpoint,
    config: &Config,
    learned: Option<f64>,
) -> (f64, &'static str) {
    match learned {
        Some(v) => (v, "learned"),
        None => match ep.prefill_tokens_per_s {
            Some(v) => (v, "configured"),
            None => (
                config.policy.predicted_ttft.default_prefill_tokens_per_s,
                "default",
            ),
        },
    }
}

/// The policy's view of `ep`'s load at `now`, for a request with nothing cached there, as the
/// flow controller's room judges it: the prompt in prefill counted in full whatever
/// `prefill_progress` says (the room sees the head's progress only through its own
/// `dispatch_lead_ms`).
pub(super) fn load_view(
    ep: &Endpoint,
    config: &Config,
    now: tokio::time::Instant,
) -> CandidateView {
    let learned = ep.load.learned.for_decision(&config.load.learning, now);
    CandidateView {
        address: ep.address,
        weight: ep.weight,
        load: router_load(ep, false),
        max_in_flight: ep.max_in_flight,
        matched_tokens: 0,
        confirmed_tokens: 0,
        held_tokens: 0,
        offloaded: Default::default(),
        prefill_tokens_per_s: prefill_speed(ep, config, learned.prefill_tokens_per_s).0,
        engine: engine_view(ep, config, Stamp::of(now)).load,
        ttft_residual_ms: learned.ttft_residual_ms,
        recalled_tokens: 0,
    }
}

/// `m`'s blocks held only in CPU memory and only on slower media, in tokens (whole blocks of
/// `block` tokens, within the `prompt`'s held prefix), with the tiers' load costs: the CPU
/// tier at its `learned` bandwidth (bytes per second) when there is one.
fn offloaded(
    m: &PrefixMatch,
    block: u64,
    prompt: u64,
    tiers: &KvTiersConfig,
    learned: Option<f64>,
    bytes_per_token: f64,
) -> [TierHold; 2] {
    let held = (u64::from(m.blocks) * block).min(prompt);
    let offloaded = (u64::from(m.offloaded_blocks) * block).min(held);
    let cpu = (u64::from(m.cpu_blocks) * block).min(offloaded);
    let hold = |tokens: u64, tier: &crate::config::KvTierConfig, bytes_per_s: f64| TierHold {
        tokens,
        bytes_per_token,
        bytes_per_s,
        latency_ms: tier.latency_ms,
    };
    [
        hold(cpu, &tiers.cpu, learned.unwrap_or(tiers.cpu.bytes_per_s())),
        hold(offloaded - cpu, &tiers.other, tiers.other.bytes_per_s()),
    ]
}

/// Computes where `request` would go under `state`, reading `tables`, committing nothing.
/// `explained`: the plan will be explained, so every candidate is ranked; otherwise only the
/// pick and its fallbacks are put in order (unless the decision log or feed will explain it).
pub(crate) fn plan(
    state: &RouterState,
    tables: &Tables,
    request: &ParsedRequest<'_>,
    ctx: RouteContext<'_>,
    explained: bool,
) -> Result<Plan, RouteError> {
    let config = &state.config;
    let set = tables.registry.snapshot();
    let requested = request.model.as_ref();

    let all = set.all();
    let in_subset_of = |ep: &&Arc<Endpoint>| ctx.subset.is_none_or(|s| s.contains(&ep.address));
    let (kind, in_subset): (ModelMatch, Vec<&Arc<Endpoint>>) = if requested.is_empty() {
        let mut in_subset = Vec::with_capacity(all.len());
        in_subset.extend(all.iter().filter(in_subset_of));
        (ModelMatch::Base, in_subset)
    } else {
        match set.serving(requested) {
            Some((kind, ids)) => {
                let mut in_subset = Vec::with_capacity(ids.len());
                in_subset.extend(ids.iter().map(|&i| &all[i]).filter(in_subset_of));
                (kind, in_subset)
            }
            None => {
                return Err(RouteError::UnknownModel {
                    model: requested.to_string(),
                })
            }
        }
    };
    let in_subset = super::confine::confine(state, in_subset, requested, ctx)?;
    let now = tokio::time::Instant::now();
    let stamp = Stamp::of(now);
    let health = &config.health;
    let mut eligible: Vec<&Arc<Endpoint>> = Vec::with_capacity(in_subset.len());
    let mut trial: Vec<bool> = Vec::with_capacity(in_subset.len());
    let mut unhealthy: Vec<Arc<Endpoint>> = Vec::new();
    let mut draining = 0usize;
    for &ep in &in_subset {
        if ep.draining {
            draining += 1;
            continue;
        }
        match ep.health.admission(now, health) {
            Admission::Yes => {
                eligible.push(ep);
                trial.push(false);
            }
            Admission::Trial => {
                eligible.push(ep);
                trial.push(true);
            }
            Admission::No => unhealthy.push(Arc::clone(ep)),
        }
    }
    if eligible.is_empty() {
        return Err(RouteError::NoEndpoint {
            model: requested.to_string(),
            reason: if in_subset.is_empty() && ctx.subset.is_some() {
                "the gateway's subset hint excludes every endpoint serving it"
            } else if in_subset.is_empty() {
                "no endpoints are configured"
            } else if unhealthy.is_empty() {
                "every endpoint serving it is draining"
            } else if draining == 0 {
                "every endpoint serving it is unhealthy"
            } else {
                "every endpoint serving it is unhealthy or draining"
            },
        });
    }

    // The namespace: the base model's tokenizer and block size, the adapter, the tenant.
    let (base_model, adapter) = match kind {
        ModelMatch::Base => (requested.to_string(), None),
        // An adapter runs on its endpoint's (first) base model.
        ModelMatch::Adapter => (
            eligible[0].models.first().cloned().unwrap_or_default(),
            Some(requested.to_string()),
        ),
    };
    // With the tenant's salt written into the request, the engine keys the request's blocks by
    // exactly that `cache_salt`; hashing in the same namespace is what lets its KV events
    // confirm our predictions. Without injection the tenant salt separates our index only.
    let injected = state
        .tenants
        .cache_salt(ctx.tenant, request.cache_salt.as_deref());
    let ns = match &injected {
        Some(cache_salt) => {
            Namespace::new(&base_model, adapter.as_deref(), None).with_cache_salt(Some(cache_salt))
        }
        None => Namespace::new(
            &base_model,
            adapter.as_deref(),
            state.tenants.salt(ctx.tenant).as_deref(),
        )
        .with_cache_salt(request.cache_salt.as_deref()),
    };
    // Bounded: past `routing.prefix_budget_ms` the request gets a cheaper identity rather than
    // holding a tokenizing slot that other requests' decisions wait for.
    let deadline = config.routing.prefix_deadline(Instant::now());
    let prefix = state
        .tokenizers
        .identify_for_routing(request, &ns, deadline);

    let ids: Vec<_> = eligible.iter().map(|ep| ep.id).collect();
    let matches = tables.index.lookup(&prefix.block_hashes, &ids);
    let block = u64::from(prefix.block_size_tokens);
    // Without subscriptions every endpoint's entries are predictions: nothing to ask.
    let events = state.kv_events().then_some(&tables.events);
    let weights = &config.kv_events.medium_weights;
    let kv_bytes_per_token = state.kv_bytes_per_token(&base_model) as f64;
    let learning = &config.load.learning;
    let mut signals = Vec::with_capacity(eligible.len());
    let mut candidates = Vec::with_capacity(eligible.len());
    // Candidates come pool by pool: the tiers are looked up once per run of one pool (a hash
    // and a copy per candidate were a tenth of a decision at 256 endpoints).
    let mut pool_tiers: Option<(&Arc<str>, KvTiersConfig)> = None;
    let sources = events.map(|events| events.source_states());
    for ((ep, m), &trial) in eligible.iter().zip(&matches).zip(&trial) {
        // One read of the engine sample's brief and one of what was learned, neither taking a
        // lock: this runs for every candidate.
        let engine = engine_view(ep, config, stamp);
        let learned = ep.load.learned.for_decision_at(learning, stamp);
        let (speed, speed_source) = prefill_speed(ep, config, learned.prefill_tokens_per_s);
        let (cache_source, cache_reason) = match &sources {
            Some(sources) => {
                let state = sources.get(ep.id);
                (state.source(), state.reason().map(|r| r.as_str()))
            }
            None => (SourceState::Absent.source(), None),
        };
        let cpu_learned = learned.cpu_load_bytes_per_s;
        let tiers = match pool_tiers {
            Some((pool, tiers)) if ep.in_pool(pool) => tiers,
            _ => pool_tiers.insert((&ep.pool, state.kv_tiers(&ep.pool))).1,
        };
        signals.push(CandidateSignals {
            engine: if engine.scraped {
                engine.signal
            } else {
                "not-scraped"
            },
            engine_age_ms: engine.age_ms,
            prefill_speed: speed_source,
            trial,
            cache_source,
            cache_reason,
            cpu_tier_bandwidth: if cpu_learned.is_some() {
                "learned"
            } else {
                "configured"
            },
        });
        candidates.push(CandidateView {
            address: ep.address,
            weight: ep.weight,
            load: router_load(ep, config.policy.predicted_ttft.prefill_progress),
            max_in_flight: ep.max_in_flight,
            // Blocks the engine holds only offloaded (CPU) count partly: they must be copied
            // back before use.
            matched_tokens: ((weighted_blocks(m, weights) * block as f64) as u64)
                .min(prefix.tokens),
            confirmed_tokens: (u64::from(m.confirmed_blocks) * block).min(prefix.tokens),
            held_tokens: (u64::from(m.blocks) * block).min(prefix.tokens),
            offloaded: offloaded(
                m,
                block,
                prefix.tokens,
                &tiers,
                cpu_learned,
                kv_bytes_per_token,
            ),
            prefill_tokens_per_s: speed,
            engine: engine.load,
            ttft_residual_ms: learned.ttft_residual_ms,
            recalled_tokens: 0,
        });
    }
    // The prefix's home, when the policy prices it: the candidate it was last routed to.
    if state.policy.wants_homes() {
        if let Some((home, blocks)) = tables.recall.recall(&prefix.block_hashes) {
            if let Some(i) = eligible.iter().position(|ep| ep.id == home) {
                candidates[i].recalled_tokens = (blocks as u64 * block).min(prefix.tokens);
            }
        }
    }
    let keep = 1 + config.routing.fallback_endpoints;
    let view = RequestView {
        prompt_tokens: prefix.tokens,
        max_tokens: request.max_tokens,
        arrivals_per_endpoint_s: tables.arrivals.per_s(requested, Instant::now())
            / candidates.len().max(1) as f64,
        prefix_blocks: if state.policy.wants_prefix_blocks() {
            Arc::from(prefix.block_hashes.as_slice())
        } else {
            Arc::from(Vec::new())
        },
        block_size_tokens: prefix.block_size_tokens,
        ranked: if explained || tables.decisions.enabled() || tables.feed.watched() {
            0
        } else {
            keep
        },
    };
    let ranking = state.policy.rank(&view, &candidates);
    let endpoints = ranking
        .order
        .iter()
        .map(|&i| Arc::clone(eligible[i]))
        .chain(unhealthy.iter().cloned())
        .take(keep)
        .collect();
    let uncached_tokens = state
        .cost
        .compute_tokens(&view, &candidates[ranking.pick()]);
    Ok(Plan {
        uncached_tokens,
        first_byte_is_ttft: request.stream || request.api == ApiKind::Embeddings,
        endpoints,
        policy: state.policy.name(),
        prefix,
        candidates,
        ranking,
        model: requested.to_string(),
        adapter,
        signals,
        unhealthy,
        request: view,
        matches,
    })
}
