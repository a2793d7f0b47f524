//! [`KvEvents`]: the endpoints' event streams, their sockets, silence detection, and the
//! per-endpoint queries the request path makes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::apply::{self, StreamCounters};
use super::blocks::Rehash;
use super::endpoint::{EndpointEvents, Shared};
use super::gate::GateLimits;
use super::state::{Reason, SourceState};
use super::subscriber::{self, Routes};
use super::EventsError;
use crate::config::{Config, KvEventsAttach, MediumWeights};
use crate::index::{Clock, EndpointId, EndpointInterner, IndexError, OwnershipIndex};
use crate::prefix::TokenizerRegistry;

/// Settings from the top-level `kv_events` and `cache_index` sections.
#[derive(Debug, Clone, PartialEq)]
struct Settings {
    trusted_ttl: Duration,
    silence_timeout_ms: u64,
    max_engine_blocks: usize,
    max_namespaces: usize,
    weights: MediumWeights,
}

impl Settings {
    fn of(config: &Config) -> Settings {
        let k = &config.kv_events;
        Settings {
            trusted_ttl: Duration::from_millis(k.trusted_prediction_ttl_ms),
            silence_timeout_ms: k.silence_timeout_ms,
            max_engine_blocks: usize::try_from(k.max_engine_blocks).unwrap_or(usize::MAX),
            max_namespaces: k.max_namespaces as usize,
            weights: k.medium_weights,
        }
    }
}

/// A running socket.
#[derive(Debug)]
struct RunningSocket {
    routes: Arc<ArcSwap<Routes>>,
    task: tokio::task::JoinHandle<()>,
    /// The subscription filter a connecting socket was started with.
    topic: String,
    /// The replay socket a connecting socket was started with.
    replay: Option<String>,
    /// The resolved address of a bound socket.
    bound: Option<String>,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    interner: Arc<EndpointInterner>,
    settings: ArcSwap<Settings>,
    by_id: ArcSwap<Vec<Option<Arc<EndpointEvents>>>>,
    sockets: tokio::sync::Mutex<HashMap<KvEventsAttach, RunningSocket>>,
    checker: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, s) in self.sockets.get_mut().drain() {
            s.task.abort();
        }
        if let Some(c) = self.checker.get_mut().take() {
            c.abort();
        }
    }
}

/// The engines' KV-event streams feeding the ownership index: one per endpoint with a
/// subscription (`pools[].kv_events`), each with its trust state.
///
/// Built with no subscription by [`KvEvents::new`], together with the index it feeds; its
/// sockets are started (and later reconciled) by [`KvEvents::reload`] inside a tokio runtime.
/// Cheap to clone (shared). Dropping the last clone stops every socket.
#[derive(Debug, Clone)]
pub struct KvEvents {
    inner: Arc<Inner>,
}

/// One endpoint's stream, for `/debug` and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointEventsStatus {
    /// The endpoint.
    pub address: SocketAddr,
    /// Its id in the index.
    pub id: EndpointId,
    /// Where its events come from.
    pub attach: KvEventsAttach,
    /// The topic its publisher sends.
    pub topic: String,
    /// Its state now.
    pub state: SourceState,
    /// Since when (ms on the events clock).
    pub since_ms: u64,
    /// Stream counters.
    pub counters: StreamCounters,
    /// Engine blocks tracked.
    pub engine_blocks: usize,
    /// Heap bytes of the engine-block table (approximate).
    pub table_bytes: usize,
    /// The engine's block size in tokens (0 = no `BlockStored` seen yet).
    pub engine_block_size_tokens: u32,
}

/// Endpoints' event sources as of one moment ([`KvEvents::source_states`]).
pub struct SourceStates<'a> {
    by_id: Arc<Vec<Option<Arc<EndpointEvents>>>>,
    timeout_ms: u64,
    clock: &'a dyn Clock,
    /// The clock, read the first time an endpoint's silence is checked.
    now_ms: std::cell::OnceCell<u64>,
}

impl SourceStates<'_> {
    /// Which source `ep`'s cache entries come from (see [`KvEvents::source_state`]).
    pub fn get(&self, ep: EndpointId) -> SourceState {
        let Some(Some(e)) = self.by_id.get(ep as usize) else {
            return SourceState::Absent;
        };
        match e.published.get() {
            SourceState::Trusted | SourceState::Partial(_)
                if e.overdue(
                    *self.now_ms.get_or_init(|| self.clock.now_ms()),
                    self.timeout_ms,
                )
                .is_some() =>
            {
                SourceState::Distrusted(Reason::Silent)
            }
            s => s,
        }
    }
}

impl KvEvents {
    /// The event streams over `index`, with no subscription yet: every endpoint reads as
    /// [`SourceState::Absent`] and [`Self::record_routed`] predicts as the index alone would.
    /// Built with the tables it feeds (no runtime needed); [`Self::reload`] starts the
    /// subscriptions `config` asks for, now and on every config change.
    pub fn new(
        config: &Config,
        index: Arc<OwnershipIndex>,
        interner: Arc<EndpointInterner>,
        clock: Arc<dyn Clock>,
    ) -> KvEvents {
        KvEvents {
            inner: Arc::new(Inner {
                shared: Arc::new(Shared {
                    index,
                    clock,
                    unrouted: AtomicU64::new(0),
                    refused: AtomicU64::new(0),
                    gate: ArcSwap::from_pointee(GateLimits::of(config)),
                }),
                interner,
                settings: ArcSwap::from_pointee(Settings::of(config)),
                by_id: ArcSwap::from_pointee(Vec::new()),
                sockets: tokio::sync::Mutex::new(HashMap::new()),
                checker: Mutex::new(None),
            }),
        }
    }

    /// [`Self::new`] then [`Self::reload`]: resolves every endpoint's subscription from
    /// `config`, binds the bound sockets, starts the connecting ones and the silence checker.
    /// Blocks are hashed with `registry`'s block size for each endpoint's model. A socket that
    /// cannot bind is an error, after every other socket was started (its endpoints stay
    /// `Distrusted(Connecting)`).
    pub async fn start(
        config: &Config,
        registry: &TokenizerRegistry,
        index: Arc<OwnershipIndex>,
        interner: Arc<EndpointInterner>,
        clock: Arc<dyn Clock>,
    ) -> Result<KvEvents, EventsError> {
        let events = KvEvents::new(config, index, interner, clock);
        events.reload(config, registry).await.map(|()| events)
    }

    /// Applies a new config: endpoints whose subscription, model or block size changed get a
    /// fresh stream (their confirmed blocks withdrawn), removed ones are withdrawn and become
    /// `Absent`, sockets are started, re-routed or stopped; the silence checker starts with the
    /// first subscription. Bind errors as in [`Self::start`]. Call within a tokio runtime.
    pub async fn reload(
        &self,
        config: &Config,
        registry: &TokenizerRegistry,
    ) -> Result<(), EventsError> {
        self.reload_with(config, &[], registry).await
    }

    /// [`Self::reload`] with the subscriptions of discovered endpoints (DNS, Kubernetes) besides
    /// the config's own ([`Config::discovered_kv_event_subscriptions`]).
    pub async fn reload_with(
        &self,
        config: &Config,
        discovered: &[crate::config::ResolvedKvEvents],
        registry: &TokenizerRegistry,
    ) -> Result<(), EventsError> {
        let inner = &self.inner;
        let shared = &inner.shared;
        let settings = Settings::of(config);
        inner.settings.store(Arc::new(settings.clone()));
        shared.gate.store(Arc::new(GateLimits::of(config)));
        let now = shared.clock.now_ms();
        let old = inner.by_id.load_full();
        let mut by_id: Vec<Option<Arc<EndpointEvents>>> = Vec::new();
        let mut by_socket: HashMap<KvEventsAttach, Vec<Arc<EndpointEvents>>> = HashMap::new();
        for spec in config
            .kv_event_subscriptions()
            .into_iter()
            .chain(discovered.iter().cloned())
        {
            let lease = inner.interner.lease(spec.address);
            let id = lease.id();
            let rehash = Rehash {
                model: spec.model.as_str().into(),
                block_size_tokens: registry.block_size_tokens(&spec.model),
                max_namespaces: settings.max_namespaces,
            };
            let reuse = old.get(id as usize).and_then(Option::as_ref).filter(|e| {
                e.spec == spec
                    && e.rehash == rehash
                    && e.max_engine_blocks == settings.max_engine_blocks
            });
            let ep = match reuse {
                Some(e) => Arc::clone(e),
                None => Arc::new(EndpointEvents::new(
                    lease,
                    spec.clone(),
                    rehash,
                    settings.max_engine_blocks,
                    now,
                )),
            };
            if by_id.len() <= id as usize {
                by_id.resize(id as usize + 1, None);
            }
            by_id[id as usize] = Some(Arc::clone(&ep));
            // Pushed streams have no socket: their batches come through `push::PushSink`.
            if spec.attach != KvEventsAttach::Push {
                by_socket.entry(spec.attach.clone()).or_default().push(ep);
            }
        }
        // Streams replaced or gone: what they confirmed may go stale unseen.
        for old_ep in old.iter().flatten() {
            let kept = by_id
                .get(old_ep.id() as usize)
                .and_then(Option::as_ref)
                .is_some_and(|e| Arc::ptr_eq(e, old_ep));
            if !kept {
                old_ep.applier.lock().retire(&shared.index);
            }
        }
        let any_stream = by_id.iter().any(Option::is_some);
        inner.by_id.store(Arc::new(by_id));
        if any_stream {
            let mut checker = inner.checker.lock();
            if checker.is_none() {
                *checker = Some(tokio::spawn(check_silence(Arc::downgrade(&self.inner))));
            }
        }

        let mut sockets = inner.sockets.lock().await;
        sockets.retain(|attach, s| {
            let keep = by_socket.contains_key(attach);
            if !keep {
                s.task.abort();
            }
            keep
        });
        let mut first_error = None;
        for (attach, eps) in by_socket {
            let topic = eps[0].spec.topic.clone();
            let replay = eps[0].spec.replay.clone();
            let routes = Routes {
                endpoints: eps
                    .iter()
                    .map(|e| (e.spec.topic.as_bytes().into(), Arc::clone(e)))
                    .collect(),
                bound: matches!(attach, KvEventsAttach::Bind(_)),
            };
            if let Some(running) = sockets.get(&attach) {
                let same_filter = matches!(attach, KvEventsAttach::Bind(_))
                    || (running.topic == topic && running.replay == replay);
                if same_filter && !running.task.is_finished() {
                    running.routes.store(Arc::new(routes));
                    continue;
                }
                running.task.abort();
            }
            let routes = Arc::new(ArcSwap::from_pointee(routes));
            let started = match &attach {
                KvEventsAttach::Connect(endpoint) => Ok((
                    tokio::spawn(subscriber::run_connect(
                        endpoint.clone(),
                        topic.clone(),
                        replay.clone(),
                        Arc::clone(&routes),
                        Arc::clone(shared),
                    )),
                    None,
                )),
                KvEventsAttach::Push => continue,
                KvEventsAttach::Bind(endpoint) => {
                    subscriber::start_bind(endpoint, Arc::clone(&routes), Arc::clone(shared))
                        .await
                        .map(|(task, bound)| (task, Some(bound)))
                        .map_err(|e| EventsError::Bind {
                            endpoint: endpoint.clone(),
                            message: e.to_string(),
                        })
                }
            };
            match started {
                Ok((task, bound)) => {
                    sockets.insert(
                        attach,
                        RunningSocket {
                            routes,
                            task,
                            topic,
                            replay,
                            bound,
                        },
                    );
                }
                Err(e) => {
                    tracing::error!("kv events: {e}");
                    sockets.remove(&attach);
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn endpoint(&self, ep: EndpointId) -> Option<Arc<EndpointEvents>> {
        self.inner.by_id.load().get(ep as usize)?.clone()
    }

    /// Which source `ep`'s cache entries come from right now: lock-free, a few atomic loads.
    /// An endpoint whose expected events are overdue reads as `Distrusted(Silent)` at once,
    /// before the checker withdraws its blocks.
    pub fn source_state(&self, ep: EndpointId) -> SourceState {
        self.source_states().get(ep)
    }

    /// [`Self::source_state`] of many endpoints as of one moment (a decision asks it of every
    /// candidate): the endpoint table and the settings are loaded once, the clock read at most
    /// once, and no endpoint's reference count is touched. Per candidate, those were three
    /// locked read-modify-writes or more.
    pub fn source_states(&self) -> SourceStates<'_> {
        SourceStates {
            by_id: self.inner.by_id.load_full(),
            timeout_ms: self.inner.settings.load().silence_timeout_ms,
            clock: &*self.inner.shared.clock,
            now_ms: std::cell::OnceCell::new(),
        }
    }

    /// How long a prediction on `ep` should last: `kv_events.trusted_prediction_ttl_ms` when
    /// its events are trusted, the index's prediction TTL otherwise.
    pub fn prediction_ttl(&self, ep: EndpointId) -> Duration {
        match self.source_state(ep) {
            SourceState::Trusted => self.inner.settings.load().trusted_ttl,
            _ => self.inner.shared.index.options().prediction_ttl,
        }
    }

    /// The match weights per medium (`kv_events.medium_weights`).
    pub fn medium_weights(&self) -> MediumWeights {
        self.inner.settings.load().weights
    }

    /// Records that the router sent a request whose prefix blocks (ours, in order) are `hashes`
    /// to `ep`, where the index showed `confirmed_blocks` of them confirmed: inserts the
    /// predictions with [`Self::prediction_ttl`], cut to whole engine blocks once the engine's
    /// block size is known (the engine caches nothing of a partial block), and, when the engine
    /// should store new blocks for it, starts the silence clock. Use instead of
    /// [`OwnershipIndex::insert_predicted`].
    ///
    /// The engine's block size comes from its events (`BlockStored`'s `block_size`) or, before
    /// any, from `reported_block_size` (its metrics: vLLM's `cache_config_info`). While neither
    /// is known the silence clock does not start: a prompt shorter than one engine block (128
    /// tokens on vLLM's CPU build) stores nothing and publishes nothing, and counting on an
    /// event for it distrusted healthy engines under short chats.
    ///
    /// `wait` is how long the request is expected to wait before the engine prefills it (the
    /// decision's predicted time to first token): its predictions last that much longer, at
    /// most as long as untrusted ones. The engine stores a prompt's blocks, and its events
    /// confirm them, only when it prefills it; under load that is behind a queue longer than
    /// `kv_events.trusted_prediction_ttl_ms`, and a prediction timed from the decision was gone
    /// before the events came (the eviction bench's event-fed arm sent 26 of 282 groups
    /// returning within 15 s to another replica; without events, 1).
    pub fn record_routed(
        &self,
        ep: EndpointId,
        hashes: &[u64],
        confirmed_blocks: u32,
        reported_block_size: Option<u32>,
        wait: Duration,
    ) -> Result<(), IndexError> {
        self.record(
            ep,
            hashes,
            confirmed_blocks,
            reported_block_size,
            wait,
            Duration::ZERO,
        )
    }

    /// [`Self::record_routed`] for a decision made `age` ago (a peer instance's, learned over
    /// `sharing`, which does not carry the decision's wait): its predictions expire when they
    /// would have had it been ours without a wait. Nothing is recorded once `age` reaches the
    /// TTL.
    pub fn record_routed_aged(
        &self,
        ep: EndpointId,
        hashes: &[u64],
        confirmed_blocks: u32,
        reported_block_size: Option<u32>,
        age: Duration,
    ) -> Result<(), IndexError> {
        self.record(
            ep,
            hashes,
            confirmed_blocks,
            reported_block_size,
            Duration::ZERO,
            age,
        )
    }

    /// The predictions of a decision made `age` ago whose prefill was `wait` away then.
    fn record(
        &self,
        ep: EndpointId,
        hashes: &[u64],
        confirmed_blocks: u32,
        reported_block_size: Option<u32>,
        wait: Duration,
        age: Duration,
    ) -> Result<(), IndexError> {
        let index = &self.inner.shared.index;
        let Some(e) = self.endpoint(ep) else {
            let ttl = index.options().prediction_ttl;
            return match ttl.checked_sub(age) {
                Some(left) if !left.is_zero() => index.insert_predicted_for(ep, hashes, left),
                _ => Ok(()),
            };
        };
        let ours = u64::from(e.rehash.block_size_tokens.max(1));
        let engine = match e.published.engine_block_size.load(Ordering::Relaxed) {
            0 => u64::from(reported_block_size.unwrap_or(0)),
            known => u64::from(known),
        };
        let whole = |blocks: usize| match engine {
            0 => blocks,
            e => ((blocks as u64 * ours / e * e) / ours) as usize,
        };
        let keep = whole(hashes.len()).min(hashes.len());
        let base = self.prediction_ttl(ep);
        let longest = base.max(index.options().prediction_ttl);
        let Some(ttl) = base
            .saturating_add(wait)
            .min(longest)
            .checked_sub(age)
            .filter(|t| !t.is_zero())
        else {
            return Ok(());
        };
        index.insert_predicted_for(ep, &hashes[..keep], ttl)?;
        if engine > 0 && keep > whole(confirmed_blocks as usize) {
            let now = self.inner.shared.clock.now_ms().max(1);
            let _ = e.published.expect_since_ms.compare_exchange(
                0,
                now,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        Ok(())
    }

    /// Something outside the event stream (a health check, the metrics scraper seeing a new
    /// process start time) saw `ep`'s engine restart: its entries go now rather than when its
    /// publisher's next batch arrives.
    pub fn mark_restarted(&self, ep: EndpointId) {
        if let Some(e) = self.endpoint(ep) {
            let shared = &self.inner.shared;
            let mut applier = e.applier.lock();
            applier.restarted(&shared.index);
            e.publish(&applier, shared);
        }
    }

    /// Applies one message (its frames as received: topic, sequence, payload) to `ep`'s stream,
    /// as if its socket had received it: for engines that push events by other means, and for
    /// benchmarks. False when `ep` has no stream.
    pub fn ingest<F: AsRef<[u8]>>(&self, ep: EndpointId, frames: &[F]) -> bool {
        let Some(e) = self.endpoint(ep) else {
            return false;
        };
        let decoded = apply::decode(frames);
        let shared = &self.inner.shared;
        let now = shared.clock.now_ms();
        let mut applier = e.applier.lock();
        apply::apply_and_publish(&mut applier, &e.published, decoded, &shared.index, now);
        true
    }

    /// Every endpoint's stream, in id order.
    pub fn status(&self) -> Vec<EndpointEventsStatus> {
        let by_id = self.inner.by_id.load();
        by_id
            .iter()
            .flatten()
            .map(|e| {
                let applier = e.applier.lock();
                let (engine_blocks, table_bytes) = applier.table_size();
                EndpointEventsStatus {
                    address: e.spec.address,
                    id: e.id(),
                    attach: e.spec.attach.clone(),
                    topic: e.spec.topic.clone(),
                    state: self.source_state(e.id()),
                    since_ms: e.published.since_ms(),
                    counters: applier.counters,
                    engine_blocks,
                    table_bytes,
                    engine_block_size_tokens: e.published.engine_block_size.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Messages whose topic matched no endpoint of their bound socket.
    pub fn unrouted_messages(&self) -> u64 {
        self.inner.shared.unrouted.load(Ordering::Relaxed)
    }

    /// Publisher connections refused by the bound sockets' gates: from an IP that is not an
    /// endpoint's nor in `kv_events.allowed_publishers`, too many from one IP, or announcing a
    /// message over `kv_events.max_message_bytes`.
    pub fn refused_publishers(&self) -> u64 {
        self.inner.shared.refused.load(Ordering::Relaxed)
    }

    /// The resolved address of each bound socket (`tcp://0.0.0.0:0` becomes its real port), as
    /// (configured, bound).
    pub async fn bound_endpoints(&self) -> Vec<(String, String)> {
        let sockets = self.inner.sockets.lock().await;
        let mut out: Vec<(String, String)> = sockets
            .iter()
            .filter_map(|(attach, s)| match (attach, &s.bound) {
                (KvEventsAttach::Bind(c), Some(b)) => Some((c.clone(), b.clone())),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }
}

/// Withdraws the confirmed blocks of endpoints whose expected events are overdue, until the
/// events stop being expected or the hub is dropped.
async fn check_silence(inner: Weak<Inner>) {
    loop {
        let tick = {
            let Some(inner) = inner.upgrade() else { return };
            let timeout = inner.settings.load().silence_timeout_ms;
            let now = inner.shared.clock.now_ms();
            for e in inner.by_id.load().iter().flatten() {
                if let Some(since) = e.overdue(now, timeout) {
                    tracing::warn!(endpoint = %e.address(), "kv events: silent while expected; withdrawing its confirmed blocks");
                    e.link_lost(Reason::Silent, &inner.shared);
                    let _ = e.published.expect_since_ms.compare_exchange(
                        since,
                        0,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                }
            }
            match timeout {
                0 => Duration::from_secs(1),
                t => Duration::from_millis((t / 4).clamp(50, 1000)),
            }
        };
        tokio::time::sleep(tick).await;
    }
}

mod push;
#[cfg(test)]
mod tests;

pub use push::{PushError, PushSink};
