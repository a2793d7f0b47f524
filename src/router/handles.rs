//! The narrow handles the parts around the router get instead of the router itself.
//!
//! | consumer | gets | can |
//! | --- | --- | --- |
//! | monitor | [`EndpointSource`], config `watch`, [`HealthSink`], [`CapacitySink`] | read the endpoint set and config; report health changes, scrapes, engine capacities |
//! | discovery sources | [`EndpointSink`] | publish their endpoints (removed ones lose their cache entries) |
//! | EDS writer | [`EndpointSource`], config `watch` | read |
//! | admin API | [`AdminView`] | read the tables; explain a request without committing it; watch decisions |
//! | gRPC event ingestion | [`PushSink`] | apply pushed KV-event batches to endpoints configured for pushes |
//! | decision sharing | [`PeerSink`] | record a peer instance's decision as a prediction |
//!
//! None of them can route a request or reach the tables' internals.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::explain::Explanation;
use super::feed::DecisionWatch;
use super::log::DecisionLog;
use super::state::{RouterState, StateCell};
use super::tables::Tables;
use super::{plan, RouteContext, RouteError};
use crate::config::{Config, ResolvedEndpoint};
use crate::discovery::{Endpoint, EndpointSet, EndpointSink, SetChange};
use crate::events::{EndpointEventsStatus, PushSink};
use crate::flow::{FlowController, ModelStatus};
use crate::health::Change;
use crate::monitor::{CapacitySink, EndpointSource, HealthSink};
use crate::request::ParsedRequest;
use crate::sharing::{PeerOutcome, PeerSink};

/// One handle per consumer, handed out once by `serve`.
pub struct Handles {
    /// The endpoint set and its changes, read-only (monitor, EDS writer).
    pub endpoints: Arc<dyn EndpointSource>,
    /// The config in force, following reloads (monitor, EDS writer, discovery set-up).
    pub config: watch::Receiver<Arc<Config>>,
    /// Where the monitor reports health changes and scrapes.
    pub health: Arc<dyn HealthSink>,
    /// Where the monitor reports engine KV capacities.
    pub capacity: Arc<dyn CapacitySink>,
    /// Where discovery sources publish endpoints.
    pub discovery: Arc<dyn EndpointSink>,
    /// The admin API's read-only view.
    pub admin: AdminView,
    /// Where engines that push their KV events over gRPC deliver them.
    pub kv_push: PushSink,
    /// Where peer instances' decisions are recorded (`sharing`).
    pub peers: Arc<dyn PeerSink>,
}

impl Handles {
    pub(super) fn new(
        tables: &Arc<Tables>,
        state: &Arc<StateCell>,
        flow: &Arc<FlowController>,
    ) -> Handles {
        let sinks = Arc::new(Sinks {
            tables: Arc::clone(tables),
            state: Arc::clone(state),
        });
        Handles {
            endpoints: Arc::clone(&tables.registry) as Arc<dyn EndpointSource>,
            config: state.watch_config(),
            health: Arc::clone(&sinks) as Arc<dyn HealthSink>,
            capacity: Arc::clone(&sinks) as Arc<dyn CapacitySink>,
            discovery: Arc::clone(&sinks) as Arc<dyn EndpointSink>,
            admin: AdminView {
                tables: Arc::clone(tables),
                state: Arc::clone(state),
                flow: Arc::clone(flow),
            },
            kv_push: tables.events.push_sink(),
            peers: Arc::clone(&sinks) as Arc<dyn PeerSink>,
        }
    }
}

/// Writes what background tasks find into the tables; each task sees one trait of it.
struct Sinks {
    tables: Arc<Tables>,
    state: Arc<StateCell>,
}

impl HealthSink for Sinks {
    fn health_changed(&self, ep: &Endpoint, change: Change) {
        self.tables.report_health(ep, change);
    }

    fn scraped(&self, ep: &Endpoint, took: Duration, error: Option<&'static str>) {
        self.tables.metrics.signals.record_scrape(ep, took, error);
    }
}

impl CapacitySink for Sinks {
    /// Sizes `ep`'s index entries to what its engine reports (GPU and CPU tier), where the
    /// config does not set them.
    fn engine_capacity_changed(&self, ep: &Endpoint) {
        self.tables.apply_capacity(ep, &self.state.load());
    }
}

impl PeerSink for Sinks {
    fn apply(&self, endpoint: std::net::SocketAddr, hashes: &[u64], age: Duration) -> PeerOutcome {
        self.tables
            .apply_peer_decision(&self.state.load(), endpoint, hashes, age)
    }
}

/// Discovery sources publish through the router's tables, so an endpoint removed by any source
/// has its cache entries dropped, and a new one gets its index capacity.
impl EndpointSink for Sinks {
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange {
        let change = self.tables.registry.publish_source(source, endpoints);
        self.tables.forget_removed(&change);
        self.tables.apply_capacities(&self.state.load());
        change
    }

    fn remove(&self, source: &str) -> SetChange {
        let change = self.tables.registry.remove_source(source);
        self.tables.forget_removed(&change);
        change
    }
}

/// The admin API's view: the tables, read-only, and `explain` through the decision pipeline
/// without committing anything.
#[derive(Debug, Clone)]
pub struct AdminView {
    tables: Arc<Tables>,
    state: Arc<StateCell>,
    flow: Arc<FlowController>,
}

impl AdminView {
    /// The snapshot in force (its config, policy and tokenizers).
    pub fn snapshot(&self) -> Arc<RouterState> {
        self.state.load()
    }

    /// The current endpoint set.
    pub fn endpoints(&self) -> Arc<EndpointSet> {
        self.tables.registry.snapshot()
    }

    /// Every KV-event stream's state and counters, in endpoint id order.
    pub fn kv_events(&self) -> Vec<EndpointEventsStatus> {
        self.tables.events.status()
    }

    /// Every metric in the Prometheus text format, the KV-event streams' included.
    pub fn metrics_text(&self) -> String {
        let metrics = &self.tables.metrics;
        metrics.record_endpoint_ids(self.tables.registry.interner().counts());
        let mut text = metrics.render(&self.endpoints());
        let events = self.kv_events();
        if !events.is_empty() {
            text.push_str(&crate::telemetry::kv_events_text(&events));
        }
        if self.flow.enabled() {
            text.push_str(&self.flow.metrics_text());
        }
        text
    }

    /// Every model's admission queue now (`flow_control`).
    pub fn flow(&self) -> Vec<ModelStatus> {
        self.flow.status()
    }

    /// Every decision from now on, until the watch is dropped (see [`DecisionWatch`]).
    pub fn watch_decisions(&self) -> DecisionWatch {
        self.tables.feed.watch()
    }

    /// Recently recorded decisions (when `debug.record_decisions` > 0).
    pub fn decisions(&self) -> &DecisionLog {
        &self.tables.decisions
    }

    /// Where `request` would go now, and why: the same pipeline as routing, committing nothing.
    pub fn explain(
        &self,
        request: &ParsedRequest<'_>,
        ctx: RouteContext<'_>,
    ) -> Result<Explanation, RouteError> {
        plan::plan(&self.state.load(), &self.tables, request, ctx, true).map(|p| p.explain())
    }
}
