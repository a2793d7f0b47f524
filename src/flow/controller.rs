//! [`FlowController`]: the per-model queues under one lock, admission, waiting with its
//! cancellation guard, dispatch, and the [`Permit`] whose `Drop` releases its reservation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use super::metrics::FlowMetrics;
use super::queue::{Entry, FlowDepth, ModelQueue, Removal};
use super::{Ask, Labels, Room, RoomSource, Shed, ShedReason};
use crate::config::{FlowControlConfig, QueueOrdering};

/// A waiter's side of the queue: where its permit (or refusal) is sent, when it arrived, and when
/// it must have left (`max_wait_ms` after arriving, under the config it arrived with).
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Result<Permit, Shed>>,
    since: Instant,
    deadline: Instant,
    /// Its objective's TTFT target (the predicted room's budget).
    ttft_target_ms: Option<u64>,
}

/// Room promised to permits handed out and not yet dropped (decided but maybe not committed).
#[derive(Debug, Default)]
struct Reserved {
    /// Their estimated prompt tokens.
    tokens: AtomicU64,
    /// Their number.
    requests: AtomicU64,
}

impl Reserved {
    fn is_empty(&self) -> bool {
        self.requests.load(Ordering::Relaxed) == 0
    }
}

#[derive(Debug, Default)]
struct ModelState {
    queue: ModelQueue<Waiter>,
    reserved: Arc<Reserved>,
    /// When a request of each priority last arrived for this model: an objective's reserve is
    /// held only while its requests come ([`RESERVE_MEMORY`]). One entry per priority band.
    seen: HashMap<i32, Instant>,
}

/// How long after a request of an objective last arrived for a model its reserve is still held
/// there: a model (or a spell) without requests of that objective leaves its room to the others.
const RESERVE_MEMORY: Duration = Duration::from_secs(60);

impl ModelState {
    /// Requests of room a queued request of `priority` leaves to the objectives above it.
    fn reserve_below(&self, config: &FlowControlConfig, priority: i32, now: Instant) -> u64 {
        config.reserve_below(priority, |p| {
            self.seen
                .get(&p)
                .is_some_and(|&at| now.saturating_duration_since(at) <= RESERVE_MEMORY)
        })
    }
}

/// Admission for every model: holds requests while their candidates have no room.
pub struct FlowController {
    models: Mutex<HashMap<String, ModelState>>,
    /// The zero of EDF deadlines (order keys are ms since it).
    epoch: Instant,
    room: Box<dyn RoomSource>,
    config: ArcSwap<FlowControlConfig>,
    next_id: AtomicU64,
    /// Woken when a permit is released or load falls: the dispatcher re-checks the queues.
    wake: Arc<Notify>,
    dispatcher: AtomicBool,
    metrics: FlowMetrics,
}

impl std::fmt::Debug for FlowController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowController").finish_non_exhaustive()
    }
}

/// One model's queue, for `/debug/flow`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelStatus {
    /// The model.
    pub model: String,
    /// Requests queued.
    pub requests: usize,
    /// Body bytes queued.
    pub bytes: u64,
    /// Estimated tokens admitted and not yet routed.
    pub reserved_tokens: u64,
    /// Requests admitted and not yet routed.
    pub reserved_requests: u64,
    /// Per (priority, flow), highest priority first.
    pub flows: Vec<FlowDepth>,
}

/// Leave to route one request. Holds its estimated tokens as reserved room until dropped: drop
/// it once the routing decision is committed (its load is then counted on the pick).
#[derive(Debug)]
#[must_use = "the reservation is released when the permit is dropped"]
pub struct Permit {
    reserved: Option<(Arc<Reserved>, u64)>,
    wake: Option<Arc<Notify>>,
    /// How long the request waited in the queue.
    pub waited: Duration,
}

impl Permit {
    /// A permit that reserves nothing (flow control off).
    pub fn unlimited() -> Permit {
        Permit {
            reserved: None,
            wake: None,
            waited: Duration::ZERO,
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some((reserved, tokens)) = self.reserved.take() {
            reserved.tokens.fetch_sub(tokens, Ordering::Relaxed);
            reserved.requests.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(wake) = &self.wake {
            wake.notify_one();
        }
    }
}

/// Removes a waiter's entry if its future is dropped before an answer (the RAII half of
/// cancellation).
struct Waiting<'a> {
    controller: &'a FlowController,
    model: &'a str,
    labels: &'a Labels,
    id: u64,
    armed: bool,
}

impl Waiting<'_> {
    /// Takes the entry out if it is still queued (`why` it leaves); true if it was.
    fn withdraw(&mut self, why: Removal) -> bool {
        self.armed = false;
        let mut models = self.controller.models.lock();
        models
            .get_mut(self.model)
            .and_then(|s| {
                s.queue
                    .remove(self.labels.priority, &self.labels.flow, self.id, why)
            })
            .is_some()
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.armed && self.withdraw(Removal::Cancelled) {
            self.controller
                .metrics
                .outcome(self.model, self.labels.priority, "cancelled");
        }
    }
}

impl FlowController {
    /// [`Self::admit`] for a request whose body is `body`: its model read from the body (only
    /// when flow control is on), its estimated tokens from the body's size. Bodyless requests
    /// pass at once. The body is read here, before the wait, and the future does not hold it:
    /// a full-duplex body's joined copy is freed, not kept uncounted while the request queues.
    pub fn admit_request<'a>(
        self: &'a Arc<Self>,
        labels: &'a Labels,
        body: &[u8],
    ) -> impl std::future::Future<Output = Result<Permit, Shed>> + 'a {
        // A bodyless request (`GET /v1/models`, a health check) asks no engine for anything.
        let ask = (!body.is_empty() && self.enabled())
            .then(|| (super::sniff_model(body).unwrap_or_default(), body.len()));
        async move {
            match ask {
                None => Ok(Permit::unlimited()),
                Some((model, len)) => self.admit(&model, labels, len).await,
            }
        }
    }

    /// A controller reading room from `room`, configured by `config`.
    pub fn new(room: Box<dyn RoomSource>, config: &FlowControlConfig) -> FlowController {
        Self::with_wake(room, config, Arc::new(Notify::new()))
    }

    /// [`Self::new`], its dispatcher also woken by `wake` (notified when load falls outside
    /// the controller's sight: a routed request's first byte).
    pub fn with_wake(
        room: Box<dyn RoomSource>,
        config: &FlowControlConfig,
        wake: Arc<Notify>,
    ) -> FlowController {
        FlowController {
            models: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            room,
            config: ArcSwap::from_pointee(config.clone()),
            next_id: AtomicU64::new(1),
            wake,
            dispatcher: AtomicBool::new(false),
            metrics: FlowMetrics::default(),
        }
    }

    /// Applies a reloaded config (bounds apply to arrivals from now on; queued requests keep
    /// their deadline).
    pub fn configure(&self, config: &FlowControlConfig) {
        self.config.store(Arc::new(config.clone()));
        self.wake.notify_one();
    }

    /// Whether requests go through the queue at all.
    pub fn enabled(&self) -> bool {
        self.config.load().enabled
    }

    /// Waits until a request for `model` (body of `body_bytes`, place `labels`) may be routed.
    /// Immediate when flow control is off, or the queue is empty and a candidate has room.
    /// Dropping the returned future leaves the queue at once.
    pub async fn admit(
        self: &Arc<Self>,
        model: &str,
        labels: &Labels,
        body_bytes: usize,
    ) -> Result<Permit, Shed> {
        let config = self.config.load_full();
        if !config.enabled {
            return Ok(Permit::unlimited());
        }
        let shed = |reason| Shed {
            reason,
            priority: labels.priority,
            retry_after_s: config.retry_after_s,
        };
        let bytes = body_bytes as u64;
        // Prompt tokens by the router's byte estimate (4 bytes a token): good enough to weigh
        // flows and reserve room, and known before the prompt is tokenized.
        let tokens = (bytes / 4).max(1);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let since = Instant::now();
        let (tx, mut rx) = oneshot::channel();
        let mut displaced = Vec::new();
        {
            let mut models = self.models.lock();
            let ask = Ask {
                tokens,
                ttft_target_ms: labels.ttft_target_ms,
            };
            // A model no candidate serves (whatever name a client sends) gets no state and no
            // series of its own, and is not queued: routing answers it at once (404 or 503).
            let mut room = None;
            if !models.contains_key(model) {
                let now = self.room.room(model, &config.room, &ask);
                if now.candidates == 0 {
                    return Ok(Permit::unlimited());
                }
                room = Some(now);
            }
            let state = models.entry(model.to_string()).or_default();
            state.seen.insert(labels.priority, since);
            if state.queue.is_empty() {
                // Higher bands' reserve is held only while requests wait (the fleet is
                // saturated): with none waiting, a newcomer takes any room there is, so a
                // reserve costs nothing at low load.
                if let Some(permit) = self.try_reserve(model, state, &config, ask, 0, since, room) {
                    drop(models);
                    self.metrics
                        .admitted(model, labels.priority, &labels.flow, Duration::ZERO);
                    return Ok(permit);
                }
            }
            let fits_in = |len: usize, queued: u64| {
                len < config.max_queue_requests && queued + bytes <= config.max_queue_bytes
            };
            // Displace only if that makes room: a newcomer refused anyway (one longer than the
            // byte bound, or with too little below it to displace) turns nobody away.
            if !fits_in(state.queue.len(), state.queue.bytes())
                && state
                    .queue
                    .can_make_room(labels.priority, &labels.flow, tokens, fits_in)
            {
                while !fits_in(state.queue.len(), state.queue.bytes()) {
                    // A lower band's newest first; else, within the newcomer's band, the
                    // request of a flow over its share that the fair order would serve last.
                    let victim = state.queue.evict_below(labels.priority).or_else(|| {
                        state
                            .queue
                            .evict_over_share(labels.priority, &labels.flow, tokens)
                    });
                    match victim {
                        Some(victim) => displaced.push(victim),
                        None => break,
                    }
                }
            }
            let fits = fits_in(state.queue.len(), state.queue.bytes());
            if fits {
                state.queue.push(Entry {
                    id,
                    order_key: self.order_key(&config, labels, since),
                    priority: labels.priority,
                    flow: Arc::from(labels.flow.as_str()),
                    tokens,
                    bytes,
                    payload: Waiter {
                        tx,
                        since,
                        deadline: since + Duration::from_millis(config.max_wait_ms),
                        ttft_target_ms: labels.ttft_target_ms,
                    },
                });
                self.pump(model, state, &config);
            }
            drop(models);
            for victim in displaced {
                self.metrics.outcome(model, victim.priority, "displaced");
                let _ = victim.payload.tx.send(Err(Shed {
                    reason: ShedReason::Displaced,
                    priority: victim.priority,
                    retry_after_s: config.retry_after_s,
                }));
            }
            if !fits {
                self.metrics.outcome(model, labels.priority, "full");
                return Err(shed(ShedReason::QueueFull));
            }
        }
        self.start_dispatcher(&config);

        let mut waiting = Waiting {
            controller: self,
            model,
            labels,
            id,
            armed: true,
        };
        let deadline = since + Duration::from_millis(config.max_wait_ms);
        match tokio::time::timeout_at(deadline, &mut rx).await {
            Ok(Ok(answer)) => {
                waiting.armed = false;
                answer
            }
            Ok(Err(_)) => {
                waiting.armed = false;
                Err(shed(ShedReason::Closed))
            }
            Err(_) => {
                if waiting.withdraw(Removal::Lost) {
                    self.metrics.outcome(model, labels.priority, "expired");
                    return Err(shed(ShedReason::Expired));
                }
                // Dispatched (or displaced) as the deadline passed: the answer is in the
                // channel.
                rx.try_recv().unwrap_or(Err(shed(ShedReason::Closed)))
            }
        }
    }

    /// Where a request arriving at `since` goes within its flow: 0 under FCFS (arrival order),
    /// its deadline under EDF (ms since `epoch`; without a TTFT target, after every deadline).
    fn order_key(&self, config: &FlowControlConfig, labels: &Labels, since: Instant) -> u64 {
        match config.ordering_of(labels.priority) {
            QueueOrdering::Fcfs => 0,
            QueueOrdering::Edf => labels.ttft_target_ms.map_or(u64::MAX, |target| {
                let arrived = since.saturating_duration_since(self.epoch).as_millis();
                u64::try_from(arrived)
                    .unwrap_or(u64::MAX)
                    .saturating_add(target)
            }),
        }
    }

    /// A permit for `ask` if `model`'s candidates have room beyond what is reserved and the
    /// `reserve` higher bands are owed (or there are no candidates: routing answers the request
    /// then); `room`, if the caller just read it.
    #[allow(clippy::too_many_arguments)]
    fn try_reserve(
        &self,
        model: &str,
        state: &ModelState,
        config: &FlowControlConfig,
        ask: Ask,
        reserve: u64,
        since: Instant,
        room: Option<Room>,
    ) -> Option<Permit> {
        let tokens = ask.tokens;
        let room = room.unwrap_or_else(|| self.room.room(model, &config.room, &ask));
        let reserved = &state.reserved;
        // Higher bands' reserve never takes the last open candidate from this one (an engine
        // closed by its KV cache or in-flight limit is no engine to keep free).
        let reserve = reserve.min((room.open as u64).saturating_sub(1));
        if room.candidates > 0
            && (room.free_prefill_tokens <= reserved.tokens.load(Ordering::Relaxed)
                || room.free_requests
                    <= reserved
                        .requests
                        .load(Ordering::Relaxed)
                        .saturating_add(reserve))
        {
            return None;
        }
        reserved.tokens.fetch_add(tokens, Ordering::Relaxed);
        reserved.requests.fetch_add(1, Ordering::Relaxed);
        Some(Permit {
            reserved: Some((Arc::clone(&state.reserved), tokens)),
            wake: Some(Arc::clone(&self.wake)),
            waited: since.elapsed(),
        })
    }

    /// Dispatches `model`'s queue while there is room. Called with the lock held.
    fn pump(&self, model: &str, state: &mut ModelState, config: &FlowControlConfig) {
        while let Some(head) = state.queue.peek() {
            if head.payload.deadline <= Instant::now() {
                // Its own timer is due but its task has not run yet (a busy runtime): turn it
                // away here, never dispatch a request that waited past its bound.
                let (priority, flow, id) = (head.priority, Arc::clone(&head.flow), head.id);
                if let Some(entry) = state.queue.remove(priority, &flow, id, Removal::Lost) {
                    self.metrics.outcome(model, priority, "expired");
                    let _ = entry.payload.tx.send(Err(Shed {
                        reason: ShedReason::Expired,
                        priority,
                        retry_after_s: config.retry_after_s,
                    }));
                }
                continue;
            }
            let ask = Ask {
                tokens: head.tokens,
                ttft_target_ms: head.payload.ttft_target_ms,
            };
            let reserve = state.reserve_below(config, head.priority, Instant::now());
            let Some(permit) =
                self.try_reserve(model, state, config, ask, reserve, head.payload.since, None)
            else {
                return;
            };
            let Some(entry) = state.queue.pop() else {
                return;
            };
            let (priority, flow, waited) = (entry.priority, entry.flow, permit.waited);
            // A waiter gone in between drops the permit with the channel: reservation released.
            if entry.payload.tx.send(Ok(permit)).is_ok() {
                self.metrics.admitted(model, priority, &flow, waited);
            }
        }
    }

    /// Dispatches every model's queue while there is room; forgets idle models (nothing queued,
    /// reserved or remembered).
    pub fn pump_all(&self) {
        let config = self.config.load_full();
        let mut models = self.models.lock();
        models.retain(|model, state| {
            self.pump(model, state, &config);
            !state.queue.is_idle() || !state.reserved.is_empty()
        });
    }

    /// Starts the dispatcher task once (it ends when the controller is dropped).
    fn start_dispatcher(self: &Arc<Self>, config: &FlowControlConfig) {
        if self.dispatcher.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<FlowController> = Arc::downgrade(self);
        let wake = Arc::clone(&self.wake);
        let mut interval_ms = config.dispatch_interval_ms;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(interval_ms)) => {}
                }
                let Some(controller) = weak.upgrade() else {
                    return;
                };
                controller.pump_all();
                interval_ms = controller.config.load().dispatch_interval_ms;
            }
        });
    }

    /// Every model's queue now.
    pub fn status(&self) -> Vec<ModelStatus> {
        let models = self.models.lock();
        let mut out: Vec<ModelStatus> = models
            .iter()
            .map(|(model, s)| ModelStatus {
                model: model.clone(),
                requests: s.queue.len(),
                bytes: s.queue.bytes(),
                reserved_tokens: s.reserved.tokens.load(Ordering::Relaxed),
                reserved_requests: s.reserved.requests.load(Ordering::Relaxed),
                flows: s.queue.depths(),
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// The flow metrics in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        let depths: Vec<(String, Vec<FlowDepth>)> = self
            .status()
            .into_iter()
            .map(|s| (s.model, s.flows))
            .collect();
        self.metrics.render(&depths)
    }
}

#[cfg(test)]
#[path = "controller_tests.rs"]
mod tests;
