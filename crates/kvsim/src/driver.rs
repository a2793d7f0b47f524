//! The engine loop: one tokio task per replica that plans a step, sleeps the profile's step
//! time (divided by `time_scale`, on `tokio::time` so tests can pause the clock), applies the
//! step and publishes its KV events. Requests and admin commands arrive on one channel and are
//! taken between steps, as vLLM's engine core takes them between iterations.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{sleep_until, Instant};

use super::engine::{Engine, NewRequest, Output, OutputSink, StepPlan};
use super::metrics::SimMetrics;
use super::profile::{scaled, StepProfile};
use super::publisher::PublisherMsg;

/// Outputs for one HTTP request: `(choice index, output)` pairs on an unbounded channel (a
/// batched completion shares one channel between its prompts).
#[derive(Debug)]
pub struct ClientSink {
    /// Which choice of the response this engine request is.
    pub choice: u32,
    /// The HTTP handler's receiver end.
    pub tx: mpsc::UnboundedSender<(u32, Output)>,
}

impl OutputSink for ClientSink {
    fn deliver(&mut self, output: Output) -> bool {
        self.tx.send((self.choice, output)).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Fault and maintenance commands for the engine (see the admin endpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminCommand {
    /// Stop stepping for this long (`None`: until `Resume`). Requests queue meanwhile.
    Stall(Option<Duration>),
    /// End a stall.
    Resume,
    /// Forget the prefix cache (`AllBlocksCleared`).
    DropCache,
    /// Cold state: abort requests, empty cache (`AllBlocksCleared`), zero counters.
    Reset,
    /// Simulated process restart: abort requests, empty cache without an event, zero
    /// counters, KV-event sequence back to 0 on a reopened socket.
    Restart,
    /// Just report the state.
    State,
}

/// The engine's state after an admin command.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EngineState {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Free KV blocks (cached-but-unused ones included).
    pub free_blocks: u32,
    /// KV blocks, null block included.
    pub num_gpu_blocks: u32,
    /// Distinct block hashes findable in the prefix cache.
    pub cached_blocks: usize,
    /// KV usage in [0, 1].
    pub kv_cache_usage: f64,
    /// True while stalled.
    pub stalled: bool,
    /// Blocks in the CPU offload tier (0 without one).
    pub offloaded_blocks: usize,
}

/// What reaches the engine task.
#[derive(Debug)]
pub enum Command {
    /// A new request.
    Submit(Box<NewRequest<ClientSink>>),
    /// An admin command, answered with the state after it.
    Admin(AdminCommand, oneshot::Sender<EngineState>),
}

/// How far the engine may fall behind its exact clock before it stops catching up.
const MAX_LAG: Duration = Duration::from_millis(20);

/// Runs `engine` until every sender of `rx` is gone.
pub async fn run(
    mut engine: Engine<ClientSink>,
    profile: StepProfile,
    time_scale: f64,
    mut rx: mpsc::UnboundedReceiver<Command>,
    publisher: Option<mpsc::UnboundedSender<PublisherMsg>>,
    metrics: Arc<SimMetrics>,
) {
    let mut plan = StepPlan::default();
    // Exact end of the previous step while steps run back to back. tokio timers fire on
    // millisecond ticks, so each step starts at the previous step's exact end rather than at
    // the (rounded-up) wake-up: rounding never accumulates over a request's steps.
    let mut clock: Option<Instant> = None;
    let mut loop_state = LoopState {
        stall: None,
        publisher,
        metrics,
    };
    loop {
        loop {
            match rx.try_recv() {
                Ok(cmd) => loop_state.handle(&mut engine, cmd),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    engine.abort_all("shutdown");
                    return;
                }
            }
        }
        if loop_state.stall.is_some() || !engine.has_work() {
            clock = None;
            let stall_end = loop_state.stall.flatten();
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(cmd) => loop_state.handle(&mut engine, cmd),
                    None => {
                        engine.abort_all("shutdown");
                        return;
                    }
                },
                _ = sleep_until(stall_end.unwrap_or_else(Instant::now)), if stall_end.is_some() => {
                    loop_state.stall = None;
                }
            }
            continue;
        }

        let now = Instant::now();
        let start = match clock {
            // Far behind (an overloaded machine): drop the backlog instead of bursting.
            Some(end) if now.saturating_duration_since(end) < MAX_LAG => end,
            _ => now,
        };
        engine.schedule(&mut plan, start);
        // KV events go out when the step ends, the schedule's (blocks allocated, evicted) and
        // the step's in one batch, as vLLM publishes them in `update_from_output`, after the
        // forward pass: a subscriber learns of a prompt's blocks a step after they were
        // allocated. (Until 2026-12-06 they went out at the step's start, which spared an
        // event-fed router the lag it has against vLLM.) A plan without a step flushes now.
        if plan.items.is_empty() {
            loop_state.flush(&mut engine);
            if plan.preempted == 0 {
                clock = None;
                match engine.next_load_ready() {
                    // Only loads from the CPU tier in progress: the GPU idles until one ends.
                    Some(ready) => tokio::select! {
                        cmd = rx.recv() => match cmd {
                            Some(cmd) => loop_state.handle(&mut engine, cmd),
                            None => {
                                engine.abort_all("shutdown");
                                return;
                            }
                        },
                        _ = sleep_until(ready) => {}
                    },
                    None => {
                        // Nothing fits and nothing runs: cannot happen for admitted requests;
                        // wait for a command rather than spin.
                        tracing::warn!("engine: nothing schedulable; waiting for a command");
                        match rx.recv().await {
                            Some(cmd) => loop_state.handle(&mut engine, cmd),
                            None => return,
                        }
                    }
                }
            }
            continue;
        }
        let step_ms = profile.step_ms(plan.items.iter().map(|i| i.work));
        let end = start + scaled(step_ms, time_scale);
        sleep_until(end).await;
        engine.finish_step(&plan, end);
        clock = Some(end);
        loop_state.flush(&mut engine);
    }
}

struct LoopState {
    /// `Some(None)`: stalled until resumed; `Some(Some(t))`: until `t`.
    stall: Option<Option<Instant>>,
    publisher: Option<mpsc::UnboundedSender<PublisherMsg>>,
    metrics: Arc<SimMetrics>,
}

impl LoopState {
    fn handle(&mut self, engine: &mut Engine<ClientSink>, cmd: Command) {
        match cmd {
            Command::Submit(req) => {
                if let Err((e, mut sink)) = engine.add(*req) {
                    // The HTTP layer checks limits first; this only guards against races.
                    tracing::debug!("engine: rejected a request: {e}");
                    sink.deliver(Output::Aborted("rejected"));
                }
            }
            Command::Admin(admin, reply) => {
                match admin {
                    AdminCommand::Stall(duration) => {
                        self.stall = Some(duration.map(|d| Instant::now() + d));
                    }
                    AdminCommand::Resume => self.stall = None,
                    AdminCommand::DropCache => engine.clear_cache(),
                    AdminCommand::Reset => {
                        self.stall = None;
                        engine.reset("reset", true);
                        self.metrics.reset();
                    }
                    AdminCommand::Restart => {
                        self.stall = None;
                        engine.reset("restart", false);
                        self.metrics.reset();
                        if let Some(p) = &self.publisher {
                            let _ = p.send(PublisherMsg::Restart);
                        }
                    }
                    AdminCommand::State => {}
                }
                self.flush(engine);
                let (running, waiting) = engine.queue_lengths();
                let pool = engine.pool();
                let _ = reply.send(EngineState {
                    running,
                    waiting,
                    free_blocks: pool.num_free(),
                    num_gpu_blocks: pool.num_blocks(),
                    cached_blocks: pool.num_cached_hashes(),
                    kv_cache_usage: pool.usage(),
                    stalled: self.stall.is_some(),
                    offloaded_blocks: engine.offload().map_or(0, |t| t.len()),
                });
            }
        }
    }

    /// Publishes the events queued so far as one batch.
    fn flush(&mut self, engine: &mut Engine<ClientSink>) {
        let events = engine.take_events();
        if events.is_empty() {
            return;
        }
        if let Some(p) = &self.publisher {
            let _ = p.send(PublisherMsg::Batch(events));
        }
    }
}
