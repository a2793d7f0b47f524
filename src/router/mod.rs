//! The decision pipeline as one function: request -> candidates -> prefix identity -> index and
//! load snapshot -> policy -> pick + record. Used alike by the ext_proc server, the admin API and
//! the CLI; holds no Envoy types.
//!
//! [`Router::plan`] computes a decision without side effects (for `explain`);
//! [`Router::decide`] also commits it: the in-flight guard on the pick, the prediction that the
//! pick now holds the prompt's prefix blocks, and the metrics.

mod arrivals;
mod explain;
mod log;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

pub use explain::{CandidateRow, Explanation};
pub use log::DecisionLog;

use crate::config::{Config, EngineKind, ResolvedEndpoint};
use crate::discovery::{Endpoint, EndpointSet, EndpointSink, ModelMatch, Registry, SetChange};
use crate::events::{weighted_blocks, KvEvents, SourceState};
use crate::health::{Admission, Change, TrialPermit};
use crate::index::{EndpointInterner, IndexOptions, OwnershipIndex, PrefixMatch, TokioClock};
use crate::load::{InflightGuard, LoadSnapshot, TtftContext};
use crate::policy::cost::CostModel;
use crate::policy::{self, CandidateView, EngineLoad, Policy, Ranking, RequestView, RouterLoad};
use crate::prefix::{Namespace, PrefixError, PrefixIdentity, TenantSalts, TokenizerRegistry};
use crate::request::ParsedRequest;
use crate::telemetry::Metrics;

/// The parts of the router rebuilt on every config reload.
#[derive(Debug)]
pub struct RouterState {
    /// The config in force.
    pub config: Arc<Config>,
    /// The policy it names.
    pub policy: Arc<dyn Policy>,
    /// Tokenizers per model.
    pub tokenizers: Arc<TokenizerRegistry>,
    /// Tenant -> namespace salt.
    pub tenants: TenantSalts,
}

/// What the gateway tells us besides the body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteContext<'a> {
    /// The gateway's subset hint: the only endpoints we may pick.
    pub subset: Option<&'a [SocketAddr]>,
    /// The tenant, from the trusted tenancy header.
    pub tenant: Option<&'a str>,
}

/// Routes requests over the current endpoint set.
#[derive(Debug)]
pub struct Router {
    registry: Registry,
    state: ArcSwap<RouterState>,
    index: Arc<OwnershipIndex>,
    /// The engines' KV events, once `serve` has started their subscriptions.
    events: std::sync::OnceLock<KvEvents>,
    metrics: Arc<Metrics>,
    base_dir: PathBuf,
    decisions: DecisionLog,
    /// Requests routed per second, per model.
    arrivals: arrivals::ArrivalRates,
}

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
}

impl Plan {
    /// The picked endpoint.
    pub fn primary(&self) -> &Arc<Endpoint> {
        &self.endpoints[0]
    }

    /// Uncached prompt tokens on the pick: the prefill work it was given.
    pub fn uncached_tokens(&self) -> u64 {
        let pick = &self.candidates[self.ranking.pick()];
        self.prefix.tokens.saturating_sub(pick.matched_tokens)
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

/// Where a request should go, and its share of the chosen endpoint's load.
#[derive(Debug)]
pub struct Decision {
    /// What was decided.
    pub plan: Plan,
    /// The destination value: `ip:port` of each endpoint, comma-separated, pick first.
    pub destination: String,
    /// Counts the request against the pick until dropped.
    pub guard: InflightGuard,
    /// What the cost model expected of the pick, to learn from its first byte.
    pub ttft: TtftContext,
    /// The pick's half-open trial slot, if it was admitted as a trial.
    pub trial: Option<TrialPermit>,
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

/// Why no endpoint could be picked. Each maps to one client-facing HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No endpoint serves the requested model or adapter (404).
    #[error("The model `{model}` does not exist.")]
    UnknownModel {
        /// The requested name.
        model: String,
    },
    /// Endpoints serve the model but none can take the request now (503).
    #[error("No endpoint is available for model `{model}`: {reason}.")]
    NoEndpoint {
        /// The requested name (empty for requests without a model).
        model: String,
        /// Why, e.g. "the gateway's subset hint excludes every endpoint serving it".
        reason: &'static str,
    },
}

/// Why a config could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A tokenizer named by the config could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] PrefixError),
}

impl Router {
    /// A router over `config`'s endpoints; relative tokenizer paths resolve against `base_dir`
    /// (the config file's directory).
    pub fn new(
        config: Config,
        metrics: Arc<Metrics>,
        base_dir: &Path,
    ) -> Result<Router, ApplyError> {
        let tokenizers = TokenizerRegistry::from_config(&config.models, base_dir)?;
        let registry = Registry::new(&config.resolved_endpoints());
        let index = Arc::new(OwnershipIndex::new(
            IndexOptions::from(&config.cache_index),
            Arc::new(TokioClock::new()),
        ));
        let router = Router {
            registry,
            state: ArcSwap::from_pointee(RouterState {
                policy: policy::build(&config.policy),
                tenants: TenantSalts::from_config(&config.tenancy),
                tokenizers: Arc::new(tokenizers),
                config: Arc::new(config),
            }),
            index,
            events: std::sync::OnceLock::new(),
            metrics,
            base_dir: base_dir.to_path_buf(),
            decisions: DecisionLog::default(),
            arrivals: arrivals::ArrivalRates::default(),
        };
        router.apply_capacities();
        router
            .decisions
            .set_capacity(router.config().debug.record_decisions);
        router.metrics.signals.configure(&router.config());
        Ok(router)
    }

    /// The config in force.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.state.load().config)
    }

    /// The current endpoint set.
    pub fn endpoints(&self) -> Arc<EndpointSet> {
        self.registry.snapshot()
    }

    /// The ownership index.
    pub fn index(&self) -> &Arc<OwnershipIndex> {
        &self.index
    }

    /// The address <-> index id mapping.
    pub fn interner(&self) -> &Arc<EndpointInterner> {
        self.registry.interner()
    }

    /// Hands the router the engines' KV-event subscriptions (started by `serve` over this
    /// router's index and interner). From then on decisions record which source each
    /// candidate's cache entries come from, weigh matches by medium, and predict with the TTL
    /// the endpoint's event state calls for. Only the first call takes effect.
    pub fn attach_events(&self, events: KvEvents) {
        let _ = self.events.set(events);
    }

    /// The KV-event subscriptions, if attached.
    pub fn events(&self) -> Option<&KvEvents> {
        self.events.get()
    }

    /// The tokenizer registry in force.
    pub fn tokenizers(&self) -> Arc<TokenizerRegistry> {
        Arc::clone(&self.state.load().tokenizers)
    }

    /// The header naming the tenant, if tenancy is configured.
    pub fn tenant_header(&self) -> Option<String> {
        self.state.load().tenants.header().map(str::to_string)
    }

    /// Recently recorded decisions (when `debug.record_decisions` > 0).
    pub fn decision_log(&self) -> &DecisionLog {
        &self.decisions
    }

    /// Notified with the endpoint set's version after every change.
    pub fn subscribe_endpoints(&self) -> tokio::sync::watch::Receiver<u64> {
        self.registry.subscribe()
    }

    /// The metrics handles.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether deciding `body_len` bytes may take long enough (tokenizing) that it belongs on
    /// the blocking pool rather than an async worker.
    pub fn decides_slowly(&self, body_len: usize) -> bool {
        body_len > 256 * 1024
            || self
                .state
                .load()
                .config
                .models
                .iter()
                .any(|m| m.tokenizer.is_some())
    }

    /// Applies a reloaded config: publishes the new endpoint set (in-flight requests keep their
    /// accounting), drops removed endpoints' cache entries, reloads changed tokenizers and swaps
    /// the policy if its config changed. On error nothing changes. Server listen addresses cannot
    /// change at runtime; the caller warns about that.
    pub fn apply(&self, config: Config) -> Result<SetChange, ApplyError> {
        let old = self.state.load_full();
        let tokenizers = if old.config.models == config.models {
            Arc::clone(&old.tokenizers)
        } else {
            Arc::new(old.tokenizers.rebuild(&config.models, &self.base_dir)?)
        };
        let change = self.registry.publish(&config.resolved_endpoints());
        self.forget_removed(&change);
        let policy = if old.config.policy == config.policy {
            Arc::clone(&old.policy)
        } else {
            policy::build(&config.policy)
        };
        self.state.store(Arc::new(RouterState {
            tenants: TenantSalts::from_config(&config.tenancy),
            config: Arc::new(config),
            policy,
            tokenizers,
        }));
        self.apply_capacities();
        self.decisions
            .set_capacity(self.config().debug.record_decisions);
        self.metrics.signals.configure(&self.config());
        Ok(change)
    }

    /// Drops removed endpoints' cache entries (whatever source removed them).
    fn forget_removed(&self, change: &SetChange) {
        for addr in &change.removed {
            if let Some(id) = self.registry.interner().get(addr) {
                self.index.clear_endpoint(id);
            }
        }
    }

    /// Sets each endpoint's index capacity from its KV capacity: configured, else what its
    /// engine reports (`vllm:cache_config_info`), in blocks of its (first) model's block size.
    fn apply_capacities(&self) {
        for ep in self.registry.snapshot().all() {
            self.apply_capacity(ep);
        }
    }

    fn apply_capacity(&self, ep: &Endpoint) {
        let scraped = || ep.load.engine.last().and_then(|s| s.capacity_tokens);
        let Some(tokens) = ep.cache_capacity_tokens.or_else(scraped) else {
            return;
        };
        let model = ep.models.first().map(String::as_str).unwrap_or("");
        let block = u64::from(self.tokenizers().block_size_tokens(model).max(1));
        let _ = self
            .index
            .set_capacity(ep.id, usize::try_from(tokens / block).unwrap_or(usize::MAX));
    }

    /// The engine of `ep` reported a (new) KV capacity: size its index entries to it, unless
    /// the config sets the capacity.
    pub fn apply_engine_capacity(&self, ep: &Endpoint) {
        if ep.cache_capacity_tokens.is_none() {
            self.apply_capacity(ep);
        }
    }

    /// Counts and logs a change of `ep`'s health.
    pub fn report_health(&self, ep: &Endpoint, change: Change) {
        self.metrics.signals.record_health_change(ep, change);
        if change.is_ejection() {
            tracing::warn!(endpoint = %ep.address_str, cause = change.cause.as_str(), from = change.from, to = change.to, "endpoint ejected");
        } else {
            tracing::info!(endpoint = %ep.address_str, cause = change.cause.as_str(), from = change.from, to = change.to, "endpoint health changed");
        }
    }

    /// Records the outcome of a request served by `ep` (`ok`: no failure status, and not
    /// retried elsewhere) into its circuit breaker.
    pub fn record_outcome(&self, ep: &Endpoint, ok: bool) {
        let config = self.config();
        if let Some(change) =
            ep.health
                .record_request(ok, tokio::time::Instant::now(), &config.health)
        {
            self.report_health(ep, change);
        }
    }

    /// Computes where `request` would go, without committing anything.
    pub fn plan(
        &self,
        request: &ParsedRequest<'_>,
        ctx: RouteContext<'_>,
    ) -> Result<Plan, RouteError> {
        let state = self.state.load();
        let set = self.registry.snapshot();
        let requested = request.model.as_ref();

        let (kind, serving): (ModelMatch, Vec<usize>) = if requested.is_empty() {
            (ModelMatch::Base, (0..set.all().len()).collect())
        } else {
            match set.serving(requested) {
                Some((kind, ids)) => (kind, ids.to_vec()),
                None => {
                    return Err(RouteError::UnknownModel {
                        model: requested.to_string(),
                    })
                }
            }
        };
        let in_subset: Vec<&Arc<Endpoint>> = serving
            .iter()
            .map(|&i| &set.all()[i])
            .filter(|ep| ctx.subset.is_none_or(|s| s.contains(&ep.address)))
            .collect();
        let now = tokio::time::Instant::now();
        let health = &state.config.health;
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
        let salt = state.tenants.salt(ctx.tenant);
        let ns = Namespace::new(&base_model, adapter.as_deref(), salt.as_deref())
            .with_cache_salt(request.cache_salt.as_deref());
        let prefix = state.tokenizers.identify(request, &ns);

        let ids: Vec<_> = eligible.iter().map(|ep| ep.id).collect();
        let matches = self.index.lookup(&prefix.block_hashes, &ids);
        let block = u64::from(prefix.block_size_tokens);
        let events = self.events.get();
        let weights = events.map(KvEvents::medium_weights).unwrap_or_default();
        let config = &state.config;
        let default_speed = config.policy.predicted_ttft.default_prefill_tokens_per_s;
        let learning = &config.load.learning;
        let scrape = &config.load.scrape;
        let staleness = Duration::from_millis(scrape.staleness_ms);
        let mut signals = Vec::with_capacity(eligible.len());
        let candidates: Vec<CandidateView> = eligible
            .iter()
            .zip(&matches)
            .zip(&trial)
            .map(|((ep, m), &trial)| {
                let scraped = scrape.enabled && ep.engine != EngineKind::Other;
                let engine_signal = ep.load.engine.signal(now, staleness);
                let engine = engine_signal
                    .fresh()
                    .filter(|_| scraped)
                    .map(|s| EngineLoad {
                        waiting_requests: s.waiting_requests,
                        running_requests: s.running_requests,
                        kv_cache_usage: s.kv_cache_usage,
                    });
                let (speed, speed_source) = match ep.load.learned.prefill_tokens_per_s(learning) {
                    Some(v) => (v, "learned"),
                    None => match ep.prefill_tokens_per_s {
                        Some(v) => (v, "configured"),
                        None => (default_speed, "default"),
                    },
                };
                signals.push(CandidateSignals {
                    engine: if scraped {
                        engine_signal.as_str()
                    } else {
                        "not-scraped"
                    },
                    engine_age_ms: ep
                        .load
                        .engine
                        .last()
                        .map(|s| now.saturating_duration_since(s.scraped_at).as_millis() as u64),
                    prefill_speed: speed_source,
                    trial,
                    cache_source: events
                        .map_or(SourceState::Absent, |e| e.source_state(ep.id))
                        .source(),
                    cache_reason: events
                        .and_then(|e| e.source_state(ep.id).reason())
                        .map(|r| r.as_str()),
                });
                CandidateView {
                    address: ep.address,
                    weight: ep.weight,
                    load: router_load(ep.load.snapshot()),
                    max_in_flight: ep.max_in_flight,
                    // Blocks the engine holds only offloaded (CPU) count partly: they must be
                    // copied back before use.
                    matched_tokens: ((weighted_blocks(m, &weights) * block as f64) as u64)
                        .min(prefix.tokens),
                    confirmed_tokens: (u64::from(m.confirmed_blocks) * block).min(prefix.tokens),
                    prefill_tokens_per_s: speed,
                    engine,
                    ttft_residual_ms: ep.load.learned.ttft_residual_ms(learning, now),
                }
            })
            .collect();
        let view = RequestView {
            prompt_tokens: prefix.tokens,
            max_tokens: request.max_tokens,
            arrivals_per_endpoint_s: self.arrivals.per_s(requested, Instant::now())
                / candidates.len().max(1) as f64,
        };
        let ranking = state.policy.rank(&view, &candidates);
        let keep = 1 + config.routing.fallback_endpoints;
        let endpoints = ranking
            .order
            .iter()
            .map(|&i| Arc::clone(eligible[i]))
            .chain(unhealthy.iter().cloned())
            .take(keep)
            .collect();
        Ok(Plan {
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

    /// Picks endpoints for `request` and commits the decision: counts it in flight on the pick
    /// and predicts the pick now holds its prefix.
    pub fn decide(
        &self,
        request: &ParsedRequest<'_>,
        ctx: RouteContext<'_>,
    ) -> Result<Decision, RouteError> {
        let started = Instant::now();
        let plan = self.plan(request, ctx)?;
        let primary = Arc::clone(plan.primary());
        let pick = plan.ranking.pick();
        let config = self.config();
        let trial = if plan.signals[pick].trial {
            let (permit, change) = primary
                .health
                .begin_trial(tokio::time::Instant::now(), &config.health);
            if let Some(change) = change {
                self.report_health(&primary, change);
            }
            // A concurrent decision may have taken the last slot since the plan: the request
            // still goes (one over the trickle bound), it is not worth failing.
            permit
        } else {
            None
        };
        let ttft = {
            let c = &plan.candidates[pick];
            let model = CostModel::from(&config.policy.predicted_ttft);
            let p = model.predict(&plan.request, c);
            TtftContext {
                work_tokens: c.load.in_flight_prefill_tokens + plan.uncached_tokens(),
                fixed_ms: model.fixed_ms(c),
                predicted_ms: p.ttft_ms - p.residual_ms,
                engine_waiting: c.engine.map(|e| e.waiting_requests),
            }
        };
        self.arrivals.record(request.model.as_ref(), Instant::now());
        let guard = primary.load.begin(plan.uncached_tokens());
        if !plan.prefix.block_hashes.is_empty() {
            // Only fails for an endpoint id beyond 2^24; the decision stands either way.
            let hashes = &plan.prefix.block_hashes;
            let _ = match self.events.get() {
                // Short-lived while the engine's events will confirm them, cut to whole engine
                // blocks, and starting the silence clock.
                Some(events) => {
                    events.record_routed(primary.id, hashes, plan.matches[pick].confirmed_blocks)
                }
                None => self.index.insert_predicted(primary.id, hashes),
            };
        }
        let destination = plan
            .endpoints
            .iter()
            .map(|ep| ep.address_str.as_ref())
            .collect::<Vec<_>>()
            .join(",");
        self.metrics
            .record_decision(plan.policy, &primary.address_str, started.elapsed());
        if plan.stale_signals() {
            self.metrics.signals.record_stale_decision(plan.policy);
        }
        Ok(Decision {
            plan,
            destination,
            guard,
            ttft,
            trial,
        })
    }
}

/// The policy's view of the router's own counts.
fn router_load(s: LoadSnapshot) -> RouterLoad {
    RouterLoad {
        in_flight_requests: s.in_flight_requests,
        in_flight_prefill_tokens: s.in_flight_prefill_tokens,
        in_flight_prefilling: s.in_flight_prefilling,
    }
}

/// Discovery sources publish through the router, so an endpoint removed by any source has its
/// cache entries dropped, and a new one gets its index capacity.
impl EndpointSink for Router {
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange {
        let change = self.registry.publish_source(source, endpoints);
        self.forget_removed(&change);
        self.apply_capacities();
        change
    }

    fn remove(&self, source: &str) -> SetChange {
        let change = self.registry.remove_source(source);
        self.forget_removed(&change);
        change
    }
}

#[cfg(test)]
mod tests;
