//! The controller against a fake room source whose free tokens the test sets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::flow::{Ask, Room};

/// Room the test controls: `free` prompt tokens over one candidate, any number of requests.
struct FakeRoom(Arc<AtomicU64>);

impl RoomSource for FakeRoom {
    fn room(&self, _model: &str, _limits: &crate::config::RoomConfig, _ask: &Ask) -> Room {
        Room {
            candidates: 1,
            open: 1,
            free_prefill_tokens: self.0.load(Ordering::Relaxed),
            free_requests: u64::MAX,
        }
    }
}

/// Room for `0` more requests (tokens unbounded) over `1` candidates, all open, or no
/// candidate at all when `1` is 0; `2` of them open instead, if set.
struct FakeSlots(Arc<AtomicU64>, usize, Option<usize>);

impl RoomSource for FakeSlots {
    fn room(&self, _model: &str, _limits: &crate::config::RoomConfig, _ask: &Ask) -> Room {
        Room {
            candidates: self.1,
            open: self.2.unwrap_or(self.1),
            free_prefill_tokens: u64::MAX,
            free_requests: self.0.load(Ordering::Relaxed),
        }
    }
}

fn controller(yaml: &str) -> (Arc<FlowController>, Arc<AtomicU64>) {
    let mut config: FlowControlConfig = serde_norway::from_str(yaml).unwrap();
    config.enabled = true;
    let free = Arc::new(AtomicU64::new(0));
    let c = FlowController::new(Box::new(FakeRoom(Arc::clone(&free))), &config);
    (Arc::new(c), free)
}

fn labels(priority: i32, flow: &str) -> Labels {
    Labels {
        priority,
        flow: flow.into(),
        ttft_target_ms: None,
        objective: None,
    }
}

/// Starts `admit` as a task; returns its handle.
fn spawn_admit(
    c: &Arc<FlowController>,
    l: Labels,
    bytes: usize,
) -> tokio::task::JoinHandle<Result<Permit, Shed>> {
    let c = Arc::clone(c);
    tokio::spawn(async move { c.admit("m", &l, bytes).await })
}

/// Lets spawned tasks run until `cond` holds (the paused clock advances only when all are idle).
async fn until(mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("condition not reached");
}

fn queued(c: &FlowController) -> usize {
    c.status().iter().map(|s| s.requests).sum()
}

#[tokio::test(start_paused = true)]
async fn off_and_with_room_admission_is_immediate() {
    let (c, free) = controller("{}");
    free.store(1000, Ordering::Relaxed);
    let permit = c.admit("m", &labels(0, "a"), 400).await.unwrap();
    assert_eq!(permit.waited, Duration::ZERO);
    assert_eq!(c.status()[0].reserved_tokens, 100);
    drop(permit);
    assert_eq!(c.status()[0].reserved_tokens, 0);

    let off = FlowController::new(
        Box::new(FakeRoom(Arc::new(AtomicU64::new(0)))),
        &FlowControlConfig::default(),
    );
    let off = Arc::new(off);
    assert!(off.admit("m", &labels(-1, "a"), 10).await.is_ok());
    assert!(off.status().is_empty());
}

#[tokio::test(start_paused = true)]
async fn waiters_are_dispatched_by_priority_then_fairness_as_room_appears() {
    let (c, free) = controller("{max_wait_ms: 60000}");
    // Queue order of arrival: flood x3 (prio 0), quiet x1 (prio 0), critical x1 (prio 1).
    let mut tasks = Vec::new();
    for (i, (priority, flow)) in [
        (0, "flood"),
        (0, "flood"),
        (0, "flood"),
        (0, "quiet"),
        (1, "vip"),
    ]
    .into_iter()
    .enumerate()
    {
        tasks.push((i, spawn_admit(&c, labels(priority, flow), 400)));
        let n = i + 1;
        until(|| queued(&c) == n).await;
    }
    // vip first (higher band), then from equal counters quiet (fewer queued tokens), then the
    // flood.
    assert_eq!(dispatch_order(&free, &c, tasks).await, vec![4, 3, 0, 1, 2]);
}

type Waiters = Vec<(usize, tokio::task::JoinHandle<Result<Permit, Shed>>)>;

/// Gives room for one request (100 tokens) at a time until every waiter has its permit; returns
/// their indices in dispatch order.
async fn dispatch_order(free: &AtomicU64, c: &FlowController, mut tasks: Waiters) -> Vec<usize> {
    let n = tasks.len();
    dispatch_some(free, c, &mut tasks, n).await
}

/// [`dispatch_order`] for the first `n` permits; the other waiters stay in `tasks`.
async fn dispatch_some(
    free: &AtomicU64,
    c: &FlowController,
    tasks: &mut Waiters,
    n: usize,
) -> Vec<usize> {
    let mut order = Vec::new();
    while order.len() < n {
        free.store(100, Ordering::Relaxed);
        c.pump_all();
        let mut done = None;
        for (k, (i, t)) in tasks.iter().enumerate() {
            if t.is_finished() {
                done = Some((k, *i));
            }
        }
        let Some((k, i)) = done else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let (_, task) = tasks.remove(k);
        let permit = task.await.unwrap().unwrap();
        free.store(0, Ordering::Relaxed);
        drop(permit);
        order.push(i);
    }
    order
}

/// Queues, in this order and one flow of one band: a batch request (10 s TTFT target), an
/// interactive one (500 ms), one without an objective, another interactive one; returns the
/// dispatch order.
async fn order_under(yaml: &str) -> Vec<usize> {
    let (c, free) = controller(yaml);
    let target = |ms: Option<u64>| Labels {
        ttft_target_ms: ms,
        ..labels(0, "a")
    };
    let mut tasks = Vec::new();
    for (i, ms) in [Some(10_000), Some(500), None, Some(500)]
        .into_iter()
        .enumerate()
    {
        tasks.push((i, spawn_admit(&c, target(ms), 400)));
        until(|| queued(&c) == i + 1).await;
        // Arrivals 10 ms apart: the later interactive request has the later deadline.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dispatch_order(&free, &c, tasks).await
}

#[tokio::test(start_paused = true)]
async fn edf_serves_the_earliest_deadline_first_and_fcfs_does_not() {
    let base = "max_wait_ms: 60000";
    // FCFS (the default): arrival order, whatever the targets.
    assert_eq!(order_under(&format!("{{{base}}}")).await, vec![0, 1, 2, 3]);
    // EDF for the band: both interactive requests (deadlines 510 and 530 ms) before the batch
    // one (10 s), and the request without a target last.
    let edf = format!("{{{base}, bands: [{{priority: 0, ordering: edf}}]}}");
    assert_eq!(order_under(&edf).await, vec![1, 3, 0, 2]);
    // EDF on another band only: this band stays FCFS.
    let other = format!("{{{base}, bands: [{{priority: 1, ordering: edf}}]}}");
    assert_eq!(order_under(&other).await, vec![0, 1, 2, 3]);
}

#[tokio::test(start_paused = true)]
async fn past_the_bounds_sheddable_get_429_and_others_503() {
    let (c, _free) = controller("{max_queue_requests: 2, max_wait_ms: 60000, retry_after_s: 3}");
    let s1 = spawn_admit(&c, labels(-1, "a"), 40);
    until(|| queued(&c) == 1).await;
    let n1 = spawn_admit(&c, labels(0, "a"), 40);
    until(|| queued(&c) == 2).await;
    // Full: another sheddable one is refused at once.
    let refused = c.admit("m", &labels(-1, "b"), 40).await.unwrap_err();
    assert_eq!(
        (refused.reason, refused.status()),
        (ShedReason::QueueFull, 429)
    );
    assert_eq!(refused.retry_after_s, 3);
    // A critical one displaces the queued sheddable one.
    let c1 = spawn_admit(&c, labels(1, "a"), 40);
    let displaced = s1.await.unwrap().unwrap_err();
    assert_eq!(
        (displaced.reason, displaced.status()),
        (ShedReason::Displaced, 429)
    );
    until(|| queued(&c) == 2).await;
    // Full of non-sheddable work: a normal request is refused with 503.
    let refused = c.admit("m", &labels(0, "b"), 40).await.unwrap_err();
    assert_eq!(
        (refused.reason, refused.status()),
        (ShedReason::QueueFull, 503)
    );
    assert!(!n1.is_finished() && !c1.is_finished());
    assert!(c.metrics_text().contains("outcome=\"displaced\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn byte_bound_is_enforced() {
    let (c, _free) = controller("{max_queue_bytes: 100, max_wait_ms: 60000}");
    let _a = spawn_admit(&c, labels(0, "a"), 80);
    until(|| queued(&c) == 1).await;
    let refused = c.admit("m", &labels(0, "a"), 40).await.unwrap_err();
    assert_eq!(refused.reason, ShedReason::QueueFull);
    assert_eq!(c.status()[0].bytes, 80);
}

#[tokio::test(start_paused = true)]
async fn nothing_waits_past_max_wait() {
    let (c, _free) = controller("{max_wait_ms: 250}");
    let started = tokio::time::Instant::now();
    let shed = c.admit("m", &labels(0, "a"), 40).await.unwrap_err();
    assert_eq!((shed.reason, shed.status()), (ShedReason::Expired, 503));
    assert_eq!(started.elapsed(), Duration::from_millis(250));
    assert_eq!(queued(&c), 0);
    let shed = c.admit("m", &labels(-1, "a"), 40).await.unwrap_err();
    assert_eq!((shed.reason, shed.status()), (ShedReason::Expired, 429));
    assert!(c.metrics_text().contains("outcome=\"expired\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_timer_has_not_run_is_not_dispatched_past_its_bound() {
    let (c, free) = controller("{max_wait_ms: 250}");
    // The waiter is polled once (it queues) and then not again, as on a runtime too busy to
    // run its task when its timer is due.
    let labels = labels(-1, "a");
    let mut waiter = Box::pin(c.admit("m", &labels, 400));
    assert!(futures::poll!(waiter.as_mut()).is_pending());
    assert_eq!(queued(&c), 1);
    tokio::time::advance(Duration::from_millis(300)).await;
    // Room appears after the deadline, before the waiter runs: the dispatcher must refuse it,
    // not hand it a permit after 300 ms in a queue bounded at 250.
    free.store(1000, Ordering::Relaxed);
    c.pump_all();
    assert_eq!(queued(&c), 0);
    let shed = waiter.await.unwrap_err();
    assert_eq!((shed.reason, shed.status()), (ShedReason::Expired, 429));
    assert!(c.metrics_text().contains("outcome=\"expired\"} 1"));
    assert!(!c.metrics_text().contains("outcome=\"admitted\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_leaves_the_queue_at_once() {
    let (c, free) = controller("{max_wait_ms: 60000}");
    let t = spawn_admit(&c, labels(0, "a"), 40);
    until(|| queued(&c) == 1).await;
    t.abort();
    assert!(t.await.unwrap_err().is_cancelled());
    assert_eq!(queued(&c), 0);
    assert!(c.metrics_text().contains("outcome=\"cancelled\"} 1"));
    // Room now: nothing is reserved for the gone waiter.
    free.store(1000, Ordering::Relaxed);
    c.pump_all();
    assert!(
        c.status().is_empty(),
        "idle model forgotten: {:?}",
        c.status()
    );
}

#[tokio::test(start_paused = true)]
async fn reservations_hold_room_until_the_decision_is_committed() {
    let (c, free) = controller("{max_wait_ms: 60000}");
    free.store(150, Ordering::Relaxed);
    let first = c.admit("m", &labels(0, "a"), 400).await.unwrap(); // 100 tokens
    let second = c.admit("m", &labels(0, "a"), 400).await.unwrap(); // 100 < 150 left
    let third = spawn_admit(&c, labels(0, "a"), 400);
    until(|| queued(&c) == 1).await;
    assert_eq!(c.status()[0].reserved_tokens, 200);
    drop(first);
    // The dispatcher is woken by the release; 100 reserved < 150 free.
    let third = third.await.unwrap().unwrap();
    assert!(third.waited > Duration::ZERO);
    drop((second, third));
    assert_eq!(c.status()[0].reserved_tokens, 0);
}

#[tokio::test(start_paused = true)]
async fn request_slots_are_reserved_like_tokens_and_no_candidate_means_no_hold() {
    let mut config = FlowControlConfig {
        enabled: true,
        max_wait_ms: 60_000,
        ..FlowControlConfig::default()
    };
    let slots = Arc::new(AtomicU64::new(2));
    let c = Arc::new(FlowController::new(
        Box::new(FakeSlots(Arc::clone(&slots), 1, None)),
        &config,
    ));
    let a = c.admit("m", &labels(0, "a"), 40).await.unwrap();
    let b = c.admit("m", &labels(0, "a"), 40).await.unwrap();
    let third = spawn_admit(&c, labels(0, "a"), 40);
    until(|| queued(&c) == 1).await;
    assert_eq!(c.status()[0].reserved_requests, 2);
    drop(a);
    let third = third.await.unwrap().unwrap();
    drop((b, third));
    assert_eq!(c.status()[0].reserved_requests, 0);

    // An unknown model (no candidate): routing answers it at once, the queue holds nothing.
    config.max_queue_requests = 1;
    let none = Arc::new(FlowController::new(
        Box::new(FakeSlots(Arc::new(AtomicU64::new(0)), 0, None)),
        &config,
    ));
    for _ in 0..3 {
        assert!(none.admit("nope", &labels(-1, "a"), 40).await.is_ok());
    }
}

#[tokio::test(start_paused = true)]
async fn model_names_no_candidate_serves_leave_no_state_or_series() {
    // Any string a client sends as `model`: none may grow the controller's map, `/debug/flow`
    // or `/metrics`.
    let config = FlowControlConfig {
        enabled: true,
        ..FlowControlConfig::default()
    };
    let none = Arc::new(FlowController::new(
        Box::new(FakeSlots(Arc::new(AtomicU64::new(0)), 0, None)),
        &config,
    ));
    for i in 0..200 {
        let permit = none
            .admit(&format!("made-up-{i}"), &labels(0, "a"), 40)
            .await;
        assert!(permit.is_ok(), "routing answers it");
    }
    assert_eq!(none.status().len(), 0, "no model kept");
    assert!(!none.metrics_text().contains("made-up"), "no series");
}

#[tokio::test(start_paused = true)]
async fn a_newcomer_that_cannot_fit_displaces_nobody() {
    let (c, _free) = controller("{max_queue_bytes: 100, max_wait_ms: 60000}");
    let sheddable = spawn_admit(&c, labels(-1, "a"), 30);
    until(|| queued(&c) == 1).await;
    let _normal = spawn_admit(&c, labels(0, "b"), 60);
    until(|| queued(&c) == 2).await;
    // 60 + 50 > 100 even with the sheddable one gone, and flow b is the newcomer's own.
    let refused = c.admit("m", &labels(0, "b"), 50).await.unwrap_err();
    assert_eq!(refused.reason, ShedReason::QueueFull);
    // Longer than the bound itself: nothing could ever make room.
    let refused = c.admit("m", &labels(1, "c"), 101).await.unwrap_err();
    assert_eq!(refused.reason, ShedReason::QueueFull);
    tokio::task::yield_now().await;
    assert!(!sheddable.is_finished(), "displaced for nothing");
    assert_eq!(queued(&c), 2);
    // Where displacing does make room, it still happens.
    let _critical = spawn_admit(&c, labels(1, "c"), 40);
    let shed = sheddable.await.unwrap().unwrap_err();
    assert_eq!(shed.reason, ShedReason::Displaced);
    until(|| queued(&c) == 2).await;
}

type Tally = HashMap<&'static str, usize>;

/// 10 rounds of 600 ms in one band, room for one request (100 tokens) 250 ms into each; the
/// rest expire at 500 ms. "flood" asks 3 requests every round, "light" 1 in the rounds
/// `light_in` says. Returns the requests admitted and expired per flow.
async fn starved_rounds(light_in: fn(u64) -> bool) -> (Tally, Tally) {
    let (c, free) = controller("{max_wait_ms: 500}");
    let (mut admitted, mut expired) = (Tally::new(), Tally::new());
    for round in 0..10 {
        let mut tasks = Vec::new();
        for flow in ["flood", "flood", "flood", "light"] {
            if flow == "light" && !light_in(round) {
                continue;
            }
            tasks.push((flow, spawn_admit(&c, labels(0, flow), 400)));
            let n = tasks.len();
            until(|| queued(&c) == n).await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        free.store(100, Ordering::Relaxed);
        c.pump_all();
        until(|| tasks.iter().any(|(_, t)| t.is_finished())).await;
        free.store(0, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(350)).await;
        for (flow, task) in tasks {
            match task.await.unwrap() {
                Ok(_permit) => *admitted.entry(flow).or_default() += 1,
                Err(shed) => {
                    assert_eq!((shed.reason, shed.status()), (ShedReason::Expired, 503));
                    *expired.entry(flow).or_default() += 1;
                }
            }
        }
    }
    (admitted, expired)
}

#[tokio::test(start_paused = true)]
async fn a_light_flow_is_not_expired_while_a_flood_of_its_band_is_served() {
    // The light flow asks every other round, under its fair half of the slots: it gets every
    // request it asks, none expires, and the flood gets the rest.
    let (admitted, expired) = starved_rounds(|round| round % 2 == 1).await;
    assert_eq!(admitted.get("light"), Some(&5), "light got all it asked");
    assert_eq!(expired.get("light"), None, "no light request expired");
    assert_eq!(admitted.get("flood"), Some(&5), "the flood got the rest");
    assert_eq!(expired.get("flood"), Some(&25));
    // Both ask every round: the slots alternate (max-min fair: half each), whatever wins a tie.
    let (admitted, _) = starved_rounds(|_| true).await;
    assert_eq!(
        (admitted.get("flood"), admitted.get("light")),
        (Some(&5), Some(&5))
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_displaces_the_flood_not_the_light_newcomer() {
    let (c, _free) = controller("{max_queue_requests: 3, max_wait_ms: 60000}");
    let mut flood = Vec::new();
    for n in 1..=3 {
        flood.push(spawn_admit(&c, labels(-1, "flood"), 400));
        until(|| queued(&c) == n).await;
    }
    // Full, nothing in a lower band: the flood (300 tokens queued) is over its share against
    // a light newcomer, so the flood's last-served request makes room.
    let light = spawn_admit(&c, labels(-1, "light"), 400);
    let shed = flood.pop().unwrap().await.unwrap().unwrap_err();
    assert_eq!(
        (shed.reason, shed.status(), shed.retry_after_s),
        (ShedReason::Displaced, 429, 1)
    );
    until(|| queued(&c) == 3).await;
    // Another flood request finds the light flow under its share: it is refused itself.
    let refused = c.admit("m", &labels(-1, "flood"), 400).await.unwrap_err();
    assert_eq!(refused.reason, ShedReason::QueueFull);
    assert!(!light.is_finished() && flood.iter().all(|t| !t.is_finished()));
}

/// A band starved until every waiter expired (or, with `cancel`, light's clients left), then
/// the flood served twice before light comes back with two requests; returns the order of the
/// last four (0, 1: the flood's; 2, 3: light's).
async fn after_expiry(cancel: bool) -> Vec<usize> {
    let (c, free) = controller("{max_wait_ms: 500}");
    let mut tasks = Vec::new();
    for flow in ["light", "flood", "light", "flood", "flood"] {
        tasks.push(spawn_admit(&c, labels(0, flow), 400));
        let n = tasks.len();
        until(|| queued(&c) == n).await;
    }
    if cancel {
        for t in [&tasks[0], &tasks[2]] {
            t.abort();
        }
        until(|| queued(&c) == 3).await;
    }
    // No room for 500 ms: the rest expire.
    for t in tasks {
        if let Ok(answer) = t.await {
            assert_eq!(answer.unwrap_err().reason, ShedReason::Expired);
        }
    }
    let mut flood: Waiters = Vec::new();
    for i in 0..4 {
        flood.push((i, spawn_admit(&c, labels(0, "flood"), 400)));
        until(|| queued(&c) == i + 1).await;
    }
    assert_eq!(dispatch_some(&free, &c, &mut flood, 2).await, vec![0, 1]);
    let mut rest: Waiters = flood.into_iter().map(|(i, t)| (i - 2, t)).collect();
    for i in 2..4 {
        rest.push((i, spawn_admit(&c, labels(0, "light"), 400)));
        until(|| queued(&c) == i + 1).await;
    }
    dispatch_order(&free, &c, rest).await
}

#[tokio::test(start_paused = true)]
async fn a_flow_whose_waiters_expired_is_served_first_when_it_returns() {
    // Expired: light is owed the flood's two slots and gets them first.
    assert_eq!(after_expiry(false).await, vec![2, 3, 0, 1]);
    // Its clients left instead: nothing owed, light comes back level and the slots alternate.
    assert_eq!(after_expiry(true).await, vec![0, 2, 1, 3]);
}

#[tokio::test(start_paused = true)]
async fn while_requests_wait_lower_bands_leave_a_higher_objectives_reserve_free() {
    let config: FlowControlConfig = serde_norway::from_str(
        "{enabled: true, max_wait_ms: 600000, objectives: [\
         {name: critical, priority: 1, reserve_requests: 1}, \
         {name: sheddable, priority: -1}]}",
    )
    .unwrap();
    assert_eq!(config.reserve_below(-1, |_| true), 1);
    assert_eq!(config.reserve_below(0, |_| true), 1);
    assert_eq!(config.reserve_below(1, |_| true), 0);
    assert_eq!(config.reserve_below(-1, |p| p != 1), 0);
    // Two candidates, room for two requests.
    let slots = Arc::new(AtomicU64::new(2));
    let c = Arc::new(FlowController::new(
        Box::new(FakeSlots(Arc::clone(&slots), 2, None)),
        &config,
    ));
    // No critical request has come for the model: nothing is held for it.
    let first = c.admit("m", &labels(-1, "a"), 40).await.unwrap();
    let second = c.admit("m", &labels(-1, "a"), 40).await.unwrap();
    let third = spawn_admit(&c, labels(-1, "a"), 40);
    until(|| queued(&c) == 1).await;
    drop(first);
    let third = third.await.unwrap().unwrap();
    drop((second, third));
    // A critical request comes: from now on its reserve is held while requests wait.
    drop(c.admit("m", &labels(1, "c"), 40).await.unwrap());
    // Nothing waits: both go at once.
    let first = c.admit("m", &labels(-1, "a"), 40).await.unwrap();
    let second = c.admit("m", &labels(-1, "a"), 40).await.unwrap();
    assert_eq!(second.waited, Duration::ZERO);
    let third = spawn_admit(&c, labels(-1, "a"), 40);
    let unmarked = spawn_admit(&c, labels(0, "b"), 40);
    until(|| queued(&c) == 2).await;
    // Room for one again, but requests wait: it is the reserve's, nobody below takes it...
    drop(first);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(queued(&c), 2);
    // ...a critical one takes it at once, past them.
    let critical = c.admit("m", &labels(1, "c"), 40).await.unwrap();
    assert_eq!(queued(&c), 2);
    drop(critical);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(queued(&c), 2);
    // A minute without a critical request: the reserve is let go, the higher band first.
    let unmarked = unmarked.await.unwrap().unwrap();
    assert!(unmarked.waited > Duration::from_secs(60));
    assert_eq!(queued(&c), 1);
    drop((unmarked, second));
    drop(third.await.unwrap().unwrap());

    // One candidate, or two of which one is closed (its KV cache full): the reserve would take
    // the only engine from every lower band; it is not held.
    for (candidates, open) in [(1, None), (2, Some(1))] {
        let alone = Arc::new(FlowController::new(
            Box::new(FakeSlots(Arc::new(AtomicU64::new(1)), candidates, open)),
            &config,
        ));
        drop(alone.admit("m", &labels(1, "c"), 40).await.unwrap());
        let held = alone.admit("m", &labels(-1, "a"), 40).await.unwrap();
        let next = spawn_admit(&alone, labels(-1, "a"), 40);
        until(|| queued(&alone) == 1).await;
        drop(held);
        let next = next.await.unwrap().unwrap();
        assert!(next.waited < Duration::from_secs(1));
    }
}
