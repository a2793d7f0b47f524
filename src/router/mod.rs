//! The decision pipeline as one function: request -> candidates -> prefix identity -> index and
//! load snapshot -> policy -> pick + record. Used alike by the ext_proc server, the admin API and
//! the CLI; holds no Envoy types.
//!
//! # Parts
//!
//! - `tables`: the live state decisions read and commit to (endpoint set, ownership index, KV-event
//!   streams, decision log, arrival meter, metrics), built together by [`Router::new`].
//! - [`RouterState`] (`state`): what a config reload replaces (config, policy, tokenizers, tenant
//!   salts), as one immutable snapshot.
//! - `plan`: [`Plan`], the decision as a function of (snapshot, tables, request, context), with
//!   no side effects: `explain` runs exactly this.
//! - `confine`: the endpoints a request may use at all (its tenant's pools, its objective's
//!   required labels), before health and load.
//! - `ticket`: committing a plan ([`Decision`]) and the [`Ticket`] a routed request carries until
//!   its response ends: the in-flight guard, the trial slot, the TTFT to learn from, the pick
//!   and its fallbacks. Response facts go in; health, load and learned speed are updated here.
//! - `handles`: the narrow things the parts around the router get instead of the router: a
//!   read-only endpoint view, the config as a `watch`, the monitor's sinks, the discovery sink,
//!   the admin's read-only view ([`Handles`]).
//! - `explain`, `log`, `arrivals`: the user-facing breakdown, the recent decisions, the
//!   per-model arrival rate.
//!
//! # One request
//!
//! ```text
//! let state = router.snapshot();                         // the request's only config load
//! let decision = router.decide(&state, &request, ctx)?;  // plan + commit
//! // Envoy gets decision.destination; decision.ticket waits for the response:
//! ticket.on_response_headers(facts);                     // breaker, retries, load moved
//! ticket.on_first_byte(at);                              // prefill done, speed learned
//! drop(ticket);                                          // in-flight released, exactly once
//! ```

mod arrivals;
mod confine;
mod explain;
mod feed;
mod handles;
mod log;
mod plan;
mod recall;
mod room;
mod state;
mod tables;
mod ticket;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

pub use explain::{CandidateRow, Explanation};
pub use feed::{DecisionFeed, DecisionRecord, DecisionWatch};
pub use handles::{AdminView, Handles};
pub use log::DecisionLog;
pub use plan::{CandidateSignals, Plan};
pub use state::RouterState;
pub use ticket::{Decision, ResponseFacts, RestOfPrompt, Ticket};

use crate::config::Config;
use crate::discovery::SetChange;
use crate::events::EventsError;
use crate::flow::FlowController;
use crate::prefix::PrefixError;
use crate::request::ParsedRequest;
use crate::telemetry::Metrics;
use state::StateCell;
use tables::Tables;

/// What the gateway tells us besides the body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteContext<'a> {
    /// The gateway's subset hint: the only endpoints we may pick.
    pub subset: Option<&'a [SocketAddr]>,
    /// The tenant, from the trusted tenancy header.
    pub tenant: Option<&'a str>,
    /// The request id (`x-request-id`), under which the decision log keeps the explanation;
    /// empty for none.
    pub request_id: &'a str,
    /// The request's objective (the objective header's value), whose `required_labels` narrow
    /// the candidates; an objective the config does not list requires nothing.
    pub objective: Option<&'a str>,
}

/// Routes requests over the current endpoint set: the tables and the snapshot in force.
#[derive(Debug)]
pub struct Router {
    tables: Arc<Tables>,
    state: Arc<StateCell>,
    flow: Arc<FlowController>,
}

/// Why no endpoint could be picked. Each maps to one client-facing HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No endpoint serves the requested model or adapter (404).
    #[error(
        "The model `{}` does not exist.",
        crate::request::model_for_display(model)
    )]
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
    /// Endpoints serve the model, but none in a pool the request's tenant may use
    /// (`pools[].tenants`) (403).
    #[error("This tenant may not use any endpoint serving model `{model}`.")]
    TenantNotAllowed {
        /// The requested name (one that endpoints serve).
        model: String,
    },
    /// Endpoints serve the model, but none carries the labels the request's objective requires
    /// (`flow_control.objectives[].required_labels`) (503).
    #[error(
        "No endpoint serving model `{model}` has the labels objective `{objective}` requires."
    )]
    NoLabeledEndpoint {
        /// The requested name (one that endpoints serve).
        model: String,
        /// The objective's configured name.
        objective: String,
    },
}

/// Why a config could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A tokenizer named by the config could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] PrefixError),
    /// The tenancy settings could not be applied (the `cache_salt` key file).
    #[error(transparent)]
    Tenancy(#[from] crate::prefix::TenancyError),
}

impl Router {
    /// A router over `config`'s endpoints, its tables empty (no load, nothing cached, no KV-event
    /// subscription until [`Self::sync_events`]); relative tokenizer paths resolve against
    /// `base_dir` (the config file's directory).
    pub fn new(
        config: Config,
        metrics: Arc<Metrics>,
        base_dir: &Path,
    ) -> Result<Router, ApplyError> {
        let tables = Arc::new(Tables::new(&config, metrics));
        let state = state::RouterState::build(config, base_dir, None)?;
        tables.configure(&state);
        let flow_config = state.config.flow_control.clone();
        let state = Arc::new(StateCell::new(state, base_dir));
        let room = room::TablesRoom {
            tables: Arc::clone(&tables),
            state: Arc::clone(&state),
        };
        Ok(Router {
            flow: Arc::new(FlowController::with_wake(
                Box::new(room),
                &flow_config,
                Arc::clone(&tables.room_freed),
            )),
            tables,
            state,
        })
    }

    /// The snapshot in force. Take it once when a request's routing starts and pass it to
    /// every step of that request (lock-free: an atomic load and a reference count).
    pub fn snapshot(&self) -> Arc<RouterState> {
        self.state.load()
    }

    /// The admission queue a request passes before [`Self::decide`] (a no-op unless
    /// `flow_control.enabled`).
    pub fn admission(&self) -> &Arc<FlowController> {
        &self.flow
    }

    /// Computes where `request` would go under `state`, without committing anything.
    pub fn plan(
        &self,
        state: &RouterState,
        request: &ParsedRequest<'_>,
        ctx: RouteContext<'_>,
    ) -> Result<Plan, RouteError> {
        plan::plan(state, &self.tables, request, ctx, true)
    }

    /// Picks endpoints for `request` under `state` and commits the decision: counts it in
    /// flight on the pick and predicts the pick now holds its prefix. The returned ticket holds
    /// the request's accounting until dropped.
    pub fn decide(
        &self,
        state: &RouterState,
        request: &ParsedRequest<'_>,
        ctx: RouteContext<'_>,
    ) -> Result<Decision, RouteError> {
        let started = Instant::now();
        let decided = plan::plan(state, &self.tables, request, ctx, false)
            .map(|plan| ticket::commit(&self.tables, state, plan, started, ctx.request_id));
        feed::observe(
            &self.tables,
            &decided,
            request.model.as_ref(),
            ctx.request_id,
            started,
        );
        decided
    }

    /// Applies a reloaded config: publishes the new endpoint set (in-flight requests keep their
    /// accounting), drops removed endpoints' cache entries, reloads changed tokenizers and swaps
    /// the policy if its config changed; requests already routing keep the snapshot they took.
    /// On error nothing changes. KV-event subscriptions follow with [`Self::sync_events`].
    /// Server listen addresses cannot change at runtime; the caller warns about that.
    pub fn apply(&self, config: Config) -> Result<SetChange, ApplyError> {
        let next = self.state.next(config)?;
        let change = self
            .tables
            .registry
            .publish(&next.config.resolved_endpoints());
        self.tables.forget_removed(&change);
        let next = self.state.store(next);
        self.tables.configure(&next);
        self.flow.configure(&next.config.flow_control);
        Ok(change)
    }

    /// Brings the KV-event subscriptions in line with the config in force: starts, re-routes
    /// or stops sockets. A socket that cannot bind is an error; the others run regardless.
    /// Discovered endpoints (DNS, Kubernetes) subscribe through their pool's `kv_events`
    /// template: call this again when the endpoint set changes.
    pub async fn sync_events(&self) -> Result<(), EventsError> {
        let state = self.state.load();
        let set = self.tables.registry.snapshot();
        let discovered: Vec<(std::net::SocketAddr, &str)> = set
            .all()
            .iter()
            .filter(|e| &*e.source != crate::discovery::STATIC_SOURCE)
            .map(|e| (e.address, &*e.pool))
            .collect();
        let own = state.config.kv_event_subscriptions();
        let discovered = state
            .config
            .discovered_kv_event_subscriptions(&discovered, &own);
        let result = self
            .tables
            .events
            .reload_with(&state.config, &discovered, &state.tokenizers)
            .await;
        // Streams of departed endpoints are gone now, and with them their hold on the ids.
        self.tables.reclaim_ids();
        result
    }

    /// Offers every decision committed from now on to `outbox` (decision sharing with peer
    /// instances). Set once; a second call is ignored.
    pub fn share_decisions(&self, outbox: crate::sharing::Outbox) {
        let _ = self.tables.sharing.set(outbox);
    }

    /// The narrow handles for the parts around the router (monitor, discovery, EDS writer,
    /// admin API), each reading or writing only what it needs.
    pub fn handles(&self) -> Handles {
        Handles::new(&self.tables, &self.state, &self.flow)
    }
}

#[cfg(test)]
mod tests;
