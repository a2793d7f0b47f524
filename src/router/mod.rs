//! The decision pipeline as one function: request -> candidates -> prefix identity -> index and
//! load snapshot -> policy -> pick + record. Used alike by the ext_proc server, the admin API and
//! the CLI; holds no Envoy types.
//!
//! [`Router::plan`] computes a decision without side effects (for `explain`);
//! [`Router::decide`] also commits it: the in-flight guard on the pick, the prediction that the
//! pick now holds the prompt's prefix blocks, and the metrics.

mod explain;
mod log;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;

pub use explain::{CandidateRow, Explanation};
pub use log::DecisionLog;

use crate::config::Config;
use crate::discovery::{Endpoint, EndpointSet, ModelMatch, Registry, SetChange};
use crate::index::{IndexOptions, OwnershipIndex, TokioClock};
use crate::load::InflightGuard;
use crate::policy::{self, CandidateView, Policy, Ranking, RequestView};
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
    index: OwnershipIndex,
    metrics: Arc<Metrics>,
    base_dir: PathBuf,
    decisions: DecisionLog,
}

/// A decision computed but not committed: everything a policy saw and said.
#[derive(Debug)]
pub struct Plan {
    /// Ranked endpoints: the pick, then up to `routing.fallback_endpoints` fallbacks.
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
        let index = OwnershipIndex::new(
            IndexOptions::from(&config.cache_index),
            Arc::new(TokioClock::new()),
        );
        let router = Router {
            registry,
            state: ArcSwap::from_pointee(RouterState {
                policy: policy::build(&config.policy),
                tenants: TenantSalts::from_config(&config.tenancy),
                tokenizers: Arc::new(tokenizers),
                config: Arc::new(config),
            }),
            index,
            metrics,
            base_dir: base_dir.to_path_buf(),
            decisions: DecisionLog::default(),
        };
        router.apply_capacities();
        router
            .decisions
            .set_capacity(router.config().debug.record_decisions);
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
    pub fn index(&self) -> &OwnershipIndex {
        &self.index
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
        for addr in &change.removed {
            if let Some(id) = self.registry.interner().get(addr) {
                self.index.clear_endpoint(id);
            }
        }
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
        Ok(change)
    }

    /// Sets each endpoint's index capacity from its configured KV capacity, in blocks of its
    /// (first) model's block size.
    fn apply_capacities(&self) {
        let state = self.state.load();
        for ep in self.registry.snapshot().all() {
            let Some(tokens) = ep.cache_capacity_tokens else {
                continue;
            };
            let model = ep.models.first().map(String::as_str).unwrap_or("");
            let block = u64::from(state.tokenizers.block_size_tokens(model).max(1));
            let _ = self
                .index
                .set_capacity(ep.id, usize::try_from(tokens / block).unwrap_or(usize::MAX));
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
        let eligible: Vec<&Arc<Endpoint>> = in_subset
            .iter()
            .copied()
            .filter(|ep| !ep.draining)
            .collect();
        if eligible.is_empty() {
            return Err(RouteError::NoEndpoint {
                model: requested.to_string(),
                reason: if in_subset.is_empty() && ctx.subset.is_some() {
                    "the gateway's subset hint excludes every endpoint serving it"
                } else if in_subset.is_empty() {
                    "no endpoints are configured"
                } else {
                    "every endpoint serving it is draining"
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
        let default_speed = state
            .config
            .policy
            .predicted_ttft
            .default_prefill_tokens_per_s;
        let candidates: Vec<CandidateView> = eligible
            .iter()
            .zip(&matches)
            .map(|(ep, m)| CandidateView {
                address: ep.address,
                weight: ep.weight,
                load: ep.load.snapshot(),
                max_in_flight: ep.max_in_flight,
                matched_tokens: (u64::from(m.blocks) * block).min(prefix.tokens),
                confirmed_tokens: (u64::from(m.confirmed_blocks) * block).min(prefix.tokens),
                prefill_tokens_per_s: ep.prefill_tokens_per_s.unwrap_or(default_speed),
                engine: None,
            })
            .collect();
        let view = RequestView {
            prompt_tokens: prefix.tokens,
            max_tokens: request.max_tokens,
        };
        let ranking = state.policy.rank(&view, &candidates);
        let keep = 1 + state.config.routing.fallback_endpoints;
        let endpoints = ranking
            .order
            .iter()
            .take(keep)
            .map(|&i| Arc::clone(eligible[i]))
            .collect();
        Ok(Plan {
            endpoints,
            policy: state.policy.name(),
            prefix,
            candidates,
            ranking,
            model: requested.to_string(),
            adapter,
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
        let guard = primary.load.begin(plan.uncached_tokens());
        if !plan.prefix.block_hashes.is_empty() {
            // Only fails for an endpoint id beyond 2^24; the decision stands either way.
            let _ = self
                .index
                .insert_predicted(primary.id, &plan.prefix.block_hashes);
        }
        let destination = plan
            .endpoints
            .iter()
            .map(|ep| ep.address_str.as_ref())
            .collect::<Vec<_>>()
            .join(",");
        self.metrics
            .record_decision(plan.policy, &primary.address_str, started.elapsed());
        Ok(Decision {
            plan,
            destination,
            guard,
        })
    }
}

#[cfg(test)]
mod tests;
