//! The decision pipeline as one function: request -> candidates -> prefix -> load snapshot ->
//! policy -> pick + record. Used alike by the ext_proc server, the admin API and the CLI; holds no
//! Envoy types.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::discovery::{Endpoint, EndpointSet, Registry, SetChange};
use crate::load::InflightGuard;
use crate::policy::{self, CandidateView, Policy, Ranking, RequestView};
use crate::prefix;
use crate::request::ParsedRequest;
use crate::telemetry::Metrics;

/// The parts of the router rebuilt on every config reload.
#[derive(Debug)]
pub struct RouterState {
    /// The config in force.
    pub config: Arc<Config>,
    /// The policy it names.
    pub policy: Arc<dyn Policy>,
}

/// Routes requests over the current endpoint set.
#[derive(Debug)]
pub struct Router {
    registry: Registry,
    state: ArcSwap<RouterState>,
    metrics: Arc<Metrics>,
}

/// Where a request should go, and its share of the chosen endpoint's load.
#[derive(Debug)]
pub struct Decision {
    /// Ranked endpoints: the pick, then up to `routing.fallback_endpoints` fallbacks.
    pub endpoints: Vec<Arc<Endpoint>>,
    /// The destination value: `ip:port` of each, comma-separated, pick first.
    pub destination: String,
    /// Counts the request against the pick until dropped.
    pub guard: InflightGuard,
    /// The policy that decided.
    pub policy: &'static str,
    /// Prompt tokens the decision assumed (exact or estimated).
    pub prompt_tokens: u64,
    /// What the policy saw, for explanations: one entry per candidate.
    pub candidates: Vec<CandidateView>,
    /// The policy's ranking of `candidates`.
    pub ranking: Ranking,
}

impl Decision {
    /// The picked endpoint.
    pub fn primary(&self) -> &Arc<Endpoint> {
        &self.endpoints[0]
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

impl Router {
    /// A router over `config`'s endpoints.
    pub fn new(config: Config, metrics: Arc<Metrics>) -> Router {
        let registry = Registry::new(&config.resolved_endpoints());
        let policy = policy::build(&config.policy);
        Router {
            registry,
            state: ArcSwap::from_pointee(RouterState {
                config: Arc::new(config),
                policy,
            }),
            metrics,
        }
    }

    /// The config in force.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.state.load().config)
    }

    /// The current endpoint set.
    pub fn endpoints(&self) -> Arc<EndpointSet> {
        self.registry.snapshot()
    }

    /// Notified with the endpoint set's version after every change.
    pub fn subscribe_endpoints(&self) -> tokio::sync::watch::Receiver<u64> {
        self.registry.subscribe()
    }

    /// The metrics handles.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Applies a reloaded config: publishes the new endpoint set (in-flight requests keep their
    /// accounting) and swaps the policy if its config changed. Server listen addresses cannot
    /// change at runtime; the caller warns about that.
    pub fn apply(&self, config: Config) -> SetChange {
        let old = self.state.load_full();
        let change = self.registry.publish(&config.resolved_endpoints());
        let policy = if old.config.policy == config.policy {
            Arc::clone(&old.policy)
        } else {
            policy::build(&config.policy)
        };
        self.state.store(Arc::new(RouterState {
            config: Arc::new(config),
            policy,
        }));
        change
    }

    /// Picks endpoints for `request`, restricted to `subset` when the gateway sent a subset hint.
    pub fn decide(
        &self,
        request: &ParsedRequest<'_>,
        subset: Option<&[SocketAddr]>,
    ) -> Result<Decision, RouteError> {
        let started = Instant::now();
        let state = self.state.load();
        let set = self.registry.snapshot();
        let model = request.model.as_ref();

        let serving: Vec<usize> = if model.is_empty() {
            (0..set.all().len()).collect()
        } else {
            match set.serving(model) {
                Some((_, ids)) => ids.to_vec(),
                None => {
                    return Err(RouteError::UnknownModel {
                        model: model.to_string(),
                    })
                }
            }
        };
        let in_subset: Vec<&Arc<Endpoint>> = serving
            .iter()
            .map(|&i| &set.all()[i])
            .filter(|ep| subset.is_none_or(|s| s.contains(&ep.address)))
            .collect();
        let eligible: Vec<&Arc<Endpoint>> = in_subset
            .iter()
            .copied()
            .filter(|ep| !ep.draining)
            .collect();
        if eligible.is_empty() {
            return Err(RouteError::NoEndpoint {
                model: model.to_string(),
                reason: if in_subset.is_empty() && subset.is_some() {
                    "the gateway's subset hint excludes every endpoint serving it"
                } else if in_subset.is_empty() {
                    "no endpoints are configured"
                } else {
                    "every endpoint serving it is draining"
                },
            });
        }

        let prompt_tokens = prefix::estimate_tokens(request.prompt.text_bytes());
        let view = RequestView {
            prompt_tokens,
            max_tokens: request.max_tokens,
        };
        let candidates: Vec<CandidateView> = eligible
            .iter()
            .map(|ep| CandidateView {
                address: ep.address,
                weight: ep.weight,
                load: ep.load.snapshot(),
                max_in_flight: ep.max_in_flight,
                matched_tokens: 0,
            })
            .collect();
        let ranking = state.policy.rank(&view, &candidates);

        let keep = 1 + state.config.routing.fallback_endpoints;
        let endpoints: Vec<Arc<Endpoint>> = ranking
            .order
            .iter()
            .take(keep)
            .map(|&i| Arc::clone(eligible[i]))
            .collect();
        let destination = endpoints
            .iter()
            .map(|ep| ep.address_str.as_ref())
            .collect::<Vec<_>>()
            .join(",");
        let guard = endpoints[0].load.begin(prompt_tokens);
        let policy = state.policy.name();
        self.metrics
            .record_decision(policy, &endpoints[0].address_str, started.elapsed());
        Ok(Decision {
            endpoints,
            destination,
            guard,
            policy,
            prompt_tokens,
            candidates,
            ranking,
        })
    }
}

#[cfg(test)]
mod tests;
