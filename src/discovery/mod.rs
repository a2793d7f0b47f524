//! The endpoint set: which replicas exist, what they serve, and their live state, published as an
//! immutable snapshot.
//!
//! Readers load the current [`EndpointSet`] with one atomic pointer read and never wait. A new set
//! is built off to the side and swapped in; endpoints present in both keep their live state
//! ([`EndpointLoad`], [`EndpointHealth`]), so a reload never resets load counters and in-flight
//! requests to a removed endpoint still release their share when they finish.
//!
//! Endpoints come from **sources**, each publishing its own list into a slot of the [`Registry`]:
//! the static config (`static`), one DNS source per DNS pool ([`dns`]), one Kubernetes source
//! per Kubernetes pool ([`kubernetes`]), and any other implementation of [`Discovery`]. The
//! published set is the union of the slots. [`Runner`] keeps one task per configured source;
//! [`Published`] tells which sources have published their first list.

pub mod dns;
pub mod kubernetes;
mod source;
mod synced;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use source::{Discovery, EndpointSink, Runner};
pub use synced::Published;

use crate::config::{EngineKind, ResolvedEndpoint};
use crate::health::EndpointHealth;
use crate::index::{EndpointId, EndpointInterner, IdLease};
use crate::load::EndpointLoad;

/// The source key of the config file's endpoint lists.
pub const STATIC_SOURCE: &str = "static";

/// One replica, as known to the router.
#[derive(Debug)]
pub struct Endpoint {
    /// Where Envoy sends its requests.
    pub address: SocketAddr,
    /// Its small id in the ownership index: the address's while this endpoint, or any later
    /// snapshot's for the same address, lives (see [`IdLease`]).
    pub id: EndpointId,
    /// Keeps `id` this address's for as long as this snapshot entry is held (by a set, a plan,
    /// a ticket, a scrape): only then may the id go to another address.
    pub id_lease: Arc<IdLease>,
    /// `address` formatted once, as written in the destination header.
    pub address_str: Arc<str>,
    /// The pool it was configured in; one `Arc` per name within an [`EndpointSet`].
    pub pool: Arc<str>,
    /// Served model names.
    pub models: Vec<String>,
    /// Served LoRA adapter names.
    pub adapters: Vec<String>,
    /// Relative capacity (> 0).
    pub weight: f64,
    /// Concurrency limit from config, if any.
    pub max_in_flight: Option<u32>,
    /// Out of rotation for new requests (config `drain`).
    pub draining: bool,
    /// Configured prefill speed, tokens per second.
    pub prefill_tokens_per_s: Option<f64>,
    /// Configured KV-cache capacity, tokens.
    pub cache_capacity_tokens: Option<u64>,
    /// The serving engine (which metric names are scraped).
    pub engine: EngineKind,
    /// The source that published it (`static`, `dns:<pool>`, ...).
    pub source: Arc<str>,
    /// Its labels (pool, endpoint or pod labels), which objectives' `required_labels` select on.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Live load state, carried across snapshots.
    pub load: Arc<EndpointLoad>,
    /// Live health state, carried across snapshots.
    pub health: Arc<EndpointHealth>,
}

impl Endpoint {
    /// Whether it is in `pool`: by pointer first (a set's endpoints share their pool's name,
    /// so a decision walking candidates pool by pool compares no strings), else by name.
    pub fn in_pool(&self, pool: &Arc<str>) -> bool {
        Arc::ptr_eq(&self.pool, pool) || *self.pool == **pool
    }
}

/// An immutable snapshot of all endpoints, indexed by what requests ask for.
#[derive(Debug, Default)]
pub struct EndpointSet {
    endpoints: Vec<Arc<Endpoint>>,
    by_model: HashMap<String, Vec<usize>>,
    by_adapter: HashMap<String, Vec<usize>>,
    by_address: HashMap<SocketAddr, usize>,
    /// Increases with every published set.
    pub version: u64,
}

/// What a request's `model` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelMatch {
    /// A base model.
    Base,
    /// A LoRA adapter.
    Adapter,
}

impl EndpointSet {
    /// All endpoints, in config order.
    pub fn all(&self) -> &[Arc<Endpoint>] {
        &self.endpoints
    }

    /// Indices (into [`Self::all`]) of endpoints serving `model`, as a base model first, else as
    /// an adapter; `None` when nothing serves it.
    pub fn serving(&self, model: &str) -> Option<(ModelMatch, &[usize])> {
        if let Some(ids) = self.by_model.get(model) {
            return Some((ModelMatch::Base, ids));
        }
        self.by_adapter
            .get(model)
            .map(|ids| (ModelMatch::Adapter, ids.as_slice()))
    }

    /// The endpoint at `address`, if present.
    pub fn get(&self, address: &SocketAddr) -> Option<&Arc<Endpoint>> {
        self.by_address.get(address).map(|&i| &self.endpoints[i])
    }

    /// Every model name served (base models and adapters), sorted.
    pub fn model_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .by_model
            .keys()
            .chain(self.by_adapter.keys())
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    fn build(
        slots: &BTreeMap<String, Vec<ResolvedEndpoint>>,
        previous: &EndpointSet,
        version: u64,
        interner: &EndpointInterner,
    ) -> EndpointSet {
        let mut set = EndpointSet {
            version,
            ..EndpointSet::default()
        };
        // The static config first, then the other sources in key order; an address published by
        // two sources is taken from the first.
        let ordered = slots
            .get_key_value(STATIC_SOURCE)
            .into_iter()
            .chain(slots.iter().filter(|(k, _)| k.as_str() != STATIC_SOURCE));
        // One `Arc<str>` per pool name, shared by its endpoints ([`Endpoint::in_pool`]):
        // separate copies made a string compare per candidate of a decision.
        let mut pools: HashMap<&str, Arc<str>> = HashMap::new();
        for (source, specs) in ordered {
            let source: Arc<str> = source.as_str().into();
            for spec in specs {
                if set.by_address.contains_key(&spec.address) {
                    continue;
                }
                let pool = Arc::clone(
                    pools
                        .entry(spec.pool.as_str())
                        .or_insert_with(|| spec.pool.as_str().into()),
                );
                set.push(spec, pool, &source, previous, interner);
            }
        }
        set
    }

    fn push(
        &mut self,
        spec: &ResolvedEndpoint,
        pool: Arc<str>,
        source: &Arc<str>,
        previous: &EndpointSet,
        interner: &EndpointInterner,
    ) {
        let set = self;
        {
            let old = previous.get(&spec.address);
            let load = old.map(|ep| Arc::clone(&ep.load)).unwrap_or_default();
            let health = old.map(|ep| Arc::clone(&ep.health)).unwrap_or_default();
            let i = set.endpoints.len();
            let id_lease = interner.lease(spec.address);
            set.endpoints.push(Arc::new(Endpoint {
                address: spec.address,
                id: id_lease.id(),
                id_lease,
                address_str: spec.address.to_string().into(),
                pool,
                models: spec.models.clone(),
                adapters: spec.adapters.clone(),
                weight: spec.weight,
                max_in_flight: spec.max_in_flight,
                draining: spec.drain,
                prefill_tokens_per_s: spec.prefill_tokens_per_s,
                cache_capacity_tokens: spec.cache_capacity_tokens,
                engine: spec.engine,
                source: Arc::clone(source),
                labels: spec.labels.clone(),
                load,
                health,
            }));
            set.by_address.insert(spec.address, i);
            // Once per endpoint, however often it lists a name: a repeat would make it two
            // candidates (fallbacks repeating the pick, a double share of round-robin).
            for m in &spec.models {
                let ids = set.by_model.entry(m.clone()).or_default();
                if ids.last() != Some(&i) {
                    ids.push(i);
                }
            }
            for a in &spec.adapters {
                let ids = set.by_adapter.entry(a.clone()).or_default();
                if ids.last() != Some(&i) {
                    ids.push(i);
                }
            }
        }
    }
}

/// What changed between two published sets.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SetChange {
    /// Addresses new in this set.
    pub added: Vec<SocketAddr>,
    /// Addresses no longer present (their cache entries should be dropped).
    pub removed: Vec<SocketAddr>,
}

/// Holds the current [`EndpointSet`] and publishes new ones.
#[derive(Debug)]
pub struct Registry {
    current: ArcSwap<EndpointSet>,
    /// Each source's latest list; the lock also serializes publishers.
    slots: parking_lot::Mutex<BTreeMap<String, Vec<ResolvedEndpoint>>>,
    versions: tokio::sync::watch::Sender<u64>,
    interner: Arc<EndpointInterner>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            current: ArcSwap::default(),
            slots: parking_lot::Mutex::new(BTreeMap::new()),
            versions: tokio::sync::watch::Sender::new(0),
            interner: Arc::new(EndpointInterner::new()),
        }
    }
}

impl Registry {
    /// A registry holding `specs`.
    pub fn new(specs: &[ResolvedEndpoint]) -> Registry {
        let registry = Registry::default();
        registry.publish(specs);
        registry
    }

    /// The current snapshot. Never blocks.
    pub fn snapshot(&self) -> Arc<EndpointSet> {
        self.current.load_full()
    }

    /// The address <-> index id mapping of the endpoints published (and of those gone whose
    /// ids are not reclaimed yet).
    pub fn interner(&self) -> &Arc<EndpointInterner> {
        &self.interner
    }

    /// Notified with the new version after every publish.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.versions.subscribe()
    }

    /// Replaces the static config's endpoints (see [`Self::publish_source`]).
    pub fn publish(&self, specs: &[ResolvedEndpoint]) -> SetChange {
        self.publish_source(STATIC_SOURCE, specs.to_vec())
    }

    /// Replaces `source`'s endpoints and publishes the new union, keeping the live state of
    /// endpoints that remain.
    pub fn publish_source(&self, source: &str, specs: Vec<ResolvedEndpoint>) -> SetChange {
        self.update(|slots| {
            slots.insert(source.to_string(), specs);
        })
    }

    /// Drops `source` and its endpoints (unless another source also publishes them).
    pub fn remove_source(&self, source: &str) -> SetChange {
        self.update(|slots| {
            slots.remove(source);
        })
    }

    /// The keys of the sources that have published.
    pub fn sources(&self) -> Vec<String> {
        self.slots.lock().keys().cloned().collect()
    }

    fn update(&self, edit: impl FnOnce(&mut BTreeMap<String, Vec<ResolvedEndpoint>>)) -> SetChange {
        // Publishers are serialized so two updates cannot interleave and lose state; readers are
        // never blocked by this lock.
        let mut slots = self.slots.lock();
        edit(&mut slots);
        let previous = self.current.load_full();
        let next = EndpointSet::build(&slots, &previous, previous.version + 1, &self.interner);
        let before: HashSet<SocketAddr> = previous.by_address.keys().copied().collect();
        let after: HashSet<SocketAddr> = next.by_address.keys().copied().collect();
        let mut change = SetChange {
            added: after.difference(&before).copied().collect(),
            removed: before.difference(&after).copied().collect(),
        };
        change.added.sort_unstable();
        change.removed.sort_unstable();
        let version = next.version;
        self.current.store(Arc::new(next));
        self.versions.send_replace(version);
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(port: u16, models: &[&str], adapters: &[&str]) -> ResolvedEndpoint {
        let mut e = ResolvedEndpoint::new(SocketAddr::from(([127, 0, 0, 1], port)), "p", models);
        e.adapters = adapters.iter().map(|s| s.to_string()).collect();
        e
    }

    #[test]
    fn lookup_by_model_and_adapter() {
        let reg = Registry::new(&[
            spec(1, &["a"], &["lora1"]),
            spec(2, &["a", "b"], &[]),
            spec(3, &["b"], &["lora1"]),
        ]);
        let set = reg.snapshot();
        assert_eq!(set.serving("a"), Some((ModelMatch::Base, &[0usize, 1][..])));
        assert_eq!(
            set.serving("lora1"),
            Some((ModelMatch::Adapter, &[0usize, 2][..]))
        );
        assert_eq!(set.serving("zzz"), None);
        assert_eq!(set.model_names(), vec!["a", "b", "lora1"]);
    }

    #[test]
    fn a_pools_endpoints_share_its_name_across_sources() {
        // A decision compares candidates' pools by pointer first (`router::confine`).
        let mut other = spec(3, &["a"], &[]);
        other.pool = "q".to_string();
        let reg = Registry::new(&[spec(1, &["a"], &[]), other]);
        reg.publish_source("dns:x", vec![spec(2, &["a"], &[])]);
        let set = reg.snapshot();
        let pool = |port| {
            Arc::clone(
                &set.get(&SocketAddr::from(([127, 0, 0, 1], port)))
                    .unwrap()
                    .pool,
            )
        };
        assert!(Arc::ptr_eq(&pool(1), &pool(2)), "one name for pool p");
        assert_eq!((&*pool(1), &*pool(3)), ("p", "q"));
        assert!(!Arc::ptr_eq(&pool(1), &pool(3)));
        // Membership by name too, for a pool name from elsewhere (another snapshot's).
        let ep = set.get(&SocketAddr::from(([127, 0, 0, 1], 1))).unwrap();
        assert!(ep.in_pool(&pool(2)) && ep.in_pool(&Arc::from("p")));
        assert!(!ep.in_pool(&pool(3)));
    }

    #[test]
    fn a_name_listed_twice_makes_one_candidate() {
        // Discovered endpoints are not validated like the config: a repeat must not make an
        // endpoint two candidates (a fallback repeating the pick).
        let reg = Registry::new(&[spec(1, &["a", "a"], &["x", "x"]), spec(2, &["a"], &[])]);
        let set = reg.snapshot();
        assert_eq!(set.serving("a"), Some((ModelMatch::Base, &[0usize, 1][..])));
        assert_eq!(set.serving("x"), Some((ModelMatch::Adapter, &[0usize][..])));
    }

    #[test]
    fn republish_keeps_live_state_and_reports_changes() {
        let reg = Registry::new(&[spec(1, &["a"], &[]), spec(2, &["a"], &[])]);
        let old = reg.snapshot();
        let guard = old.all()[1].load.begin(10);
        let change = reg.publish(&[spec(2, &["a"], &[]), spec(3, &["a"], &[])]);
        assert_eq!(change.added, vec![SocketAddr::from(([127, 0, 0, 1], 3))]);
        assert_eq!(change.removed, vec![SocketAddr::from(([127, 0, 0, 1], 1))]);
        let new = reg.snapshot();
        assert_eq!(new.version, old.version + 1);
        let ep2 = new.get(&SocketAddr::from(([127, 0, 0, 1], 2))).unwrap();
        assert_eq!(
            ep2.load.snapshot().in_flight_requests,
            1,
            "state carried over"
        );
        drop(guard);
        assert_eq!(ep2.load.snapshot().in_flight_requests, 0);
        // The old snapshot is still usable by a reader that holds it.
        assert_eq!(old.all().len(), 2);
    }

    #[test]
    fn sources_publish_into_their_own_slots() {
        let reg = Registry::new(&[spec(1, &["a"], &[])]);
        let a = |p| SocketAddr::from(([127, 0, 0, 1], p));
        let change = reg.publish_source("dns:x", vec![spec(2, &["a"], &[]), spec(1, &["b"], &[])]);
        assert_eq!(change.added, vec![a(2)]);
        let set = reg.snapshot();
        assert_eq!(set.all().len(), 2, "duplicate address taken once");
        assert_eq!(set.get(&a(1)).unwrap().models, vec!["a"], "static wins");
        assert_eq!(&*set.get(&a(2)).unwrap().source, "dns:x");
        let guard = set.get(&a(2)).unwrap().load.begin(1);
        // Republishing the static list leaves the DNS slot alone.
        let change = reg.publish(&[spec(3, &["a"], &[])]);
        assert_eq!((change.added, change.removed), (vec![a(3)], vec![]));
        let set = reg.snapshot();
        assert_eq!(
            set.get(&a(1)).unwrap().models,
            vec!["b"],
            "now from the dns source"
        );
        assert_eq!(
            reg.sources(),
            vec!["dns:x".to_string(), STATIC_SOURCE.to_string()]
        );
        let ep2 = reg.snapshot().get(&a(2)).cloned().unwrap();
        assert_eq!(ep2.load.snapshot().in_flight_requests, 1, "live state kept");
        let change = reg.remove_source("dns:x");
        assert_eq!(change.removed, vec![a(1), a(2)]);
        drop(guard);
        assert_eq!(
            ep2.load.snapshot().in_flight_requests,
            0,
            "in-flight request finished"
        );
    }
}
