//! Requests routed but not yet finished, by pick id: the hand-off between the stream that picked
//! an endpoint and the stream that watches its response.
//!
//! With Envoy's recommended set-up two ext_proc filters see each request. The picker's stream
//! lives exactly as long as the HTTP request (Envoy closes it when the request ends), so its end
//! is the response's end. A second filter in observability mode (which never holds up the
//! response) reports the response's status, served endpoint and first body byte on a stream of
//! its own, which kvrouter closes as soon as it has seen the first byte: the rest of the body
//! (every token of a stream) never crosses to the router.
//!
//! The picker parks its request's ticket here under a pick id it also writes into `kvrouter`
//! dynamic metadata. The observer applies what it reads to the parked ticket in place
//! ([`InflightTable::update`]). The ticket is released by whichever of the two is done last:
//! - the picker's stream ends ([`InflightTable::picker_ended`]): released at once if the observer
//!   is done (or no observer is in use), else kept for the observer for at most a grace period
//!   (on a short response the picker's end can overtake the observer's messages);
//! - the observer is done ([`InflightTable::observer_done`]: first byte seen, response ended, or
//!   its stream gone): released if the picker has ended, else it waits for the picker.
//!
//! Not every request is watched: kvrouter asks the observer for a sample of them (see
//! `routing.observe_interval_ms`), since the observer's stream per request costs Envoy about as
//! much as the picker's. An unwatched entry is released when its picker's stream ends, and its
//! first byte is taken to come at the time the decision predicted ([`InflightTable::schedule`],
//! [`InflightTable::take_due`]): a clock task hands each due id back to the router.
//!
//! The sweeper releases tickets whose grace ran out and anything older than the request time
//! limit, so no count can leak. The table does not look inside what it parks: it only keeps,
//! lends, hands over and drops (dropping happens outside its locks: a ticket's drop does
//! accounting of its own).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

const SHARDS: usize = 16;

/// How long a ticket whose picker stream ended waits for the observer's report.
pub const OBSERVER_GRACE: Duration = Duration::from_secs(1);

/// How long after the last observer report we still expect observers to come.
const OBSERVER_RECENT: Duration = Duration::from_secs(120);

#[derive(Debug)]
struct Parked<T> {
    value: T,
    parked_at: Instant,
    /// When the picker's stream ended, if it has.
    picker_ended_at: Option<Instant>,
    /// The observer has seen what it watches for (or its stream is gone).
    observed: bool,
    /// The request was marked for the observer (else no observer stream comes for it).
    watched: bool,
}

/// The hand-off table of parked `T`s (the router's tickets), by pick id.
#[derive(Debug)]
pub struct InflightTable<T> {
    shards: [Mutex<HashMap<u64, Parked<T>>>; SHARDS],
    next_id: AtomicU64,
    /// Milliseconds since `epoch` when an observer stream last reported (0: never).
    observer_seen_ms: AtomicU64,
    epoch: Instant,
    /// Unwatched entries' predicted first bytes, earliest first.
    due: Mutex<BinaryHeap<Reverse<(Instant, u64)>>>,
    /// Woken when an entry is scheduled before every other (the clock sleeps until the
    /// earliest).
    earlier: tokio::sync::Notify,
}

impl<T> Default for InflightTable<T> {
    fn default() -> Self {
        // Start ids from the clock so a restarted router does not reuse a predecessor's ids.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        InflightTable {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            next_id: AtomicU64::new(seed),
            observer_seen_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            due: Mutex::new(BinaryHeap::new()),
            earlier: tokio::sync::Notify::new(),
        }
    }
}

impl<T> InflightTable<T> {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Parked<T>>> {
        &self.shards[(id as usize) % SHARDS]
    }

    /// A new unique pick id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Parks `value` under `id`; `watched`: an observer stream is to report on it.
    pub fn insert(&self, id: u64, value: T, watched: bool) {
        let parked = Parked {
            value,
            parked_at: Instant::now(),
            picker_ended_at: None,
            observed: false,
            watched,
        };
        self.shard(id).lock().insert(id, parked);
    }

    /// Schedules `id`'s predicted first byte at `at` (no observer will report the real one in
    /// time: an unwatched request, or a non-streamed one, whose first byte comes after its whole
    /// answer); [`Self::take_due`] returns it from then on.
    pub fn schedule(&self, id: u64, at: Instant) {
        let mut due = self.due.lock();
        let earliest = due.peek().is_none_or(|Reverse((first, _))| at < *first);
        due.push(Reverse((at, id)));
        drop(due);
        if earliest {
            self.earlier.notify_one();
        }
    }

    /// Ids whose predicted first byte is due by `now`, in order; removed from the schedule.
    pub fn take_due(&self, now: Instant) -> Vec<u64> {
        let mut due = self.due.lock();
        let mut ids = Vec::new();
        while let Some(Reverse((at, id))) = due.peek().copied() {
            if at > now {
                break;
            }
            due.pop();
            ids.push(id);
        }
        ids
    }

    /// When the next scheduled first byte is due, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.due.lock().peek().map(|Reverse((at, _))| *at)
    }

    /// Resolves when an entry was scheduled before every other one (or at once if that
    /// happened since the last call).
    pub async fn scheduled_earlier(&self) {
        self.earlier.notified().await
    }

    /// Runs `f` on the entry for `id` in place, for the router's own clock (not an observer);
    /// `None` if it is gone. `f` runs under a shard lock: keep it short.
    pub fn with<R>(&self, id: u64, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.shard(id).lock().get_mut(&id).map(|p| f(&mut p.value))
    }

    /// Removes and returns the entry for `id`, whoever else still expects it (a picker that
    /// watches its own response takes its ticket back).
    pub fn take(&self, id: u64) -> Option<T> {
        self.shard(id).lock().remove(&id).map(|p| p.value)
    }

    /// Runs `f` on the entry for `id` in place, from an observer stream (also recording that
    /// observers are in use); `None` if it is gone. `f` runs under a shard lock: keep it short.
    pub fn update<R>(&self, id: u64, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.saw_observer();
        self.shard(id).lock().get_mut(&id).map(|p| f(&mut p.value))
    }

    /// The observer of `id` is done: returns the entry for the caller to drop if the picker's
    /// stream has ended too.
    pub fn observer_done(&self, id: u64) -> Option<T> {
        self.saw_observer();
        let mut shard = self.shard(id).lock();
        let parked = shard.get_mut(&id)?;
        if parked.picker_ended_at.is_some() {
            return shard.remove(&id).map(|p| p.value);
        }
        parked.observed = true;
        None
    }

    /// The picker's stream of `id` ended (the HTTP request is over): returns the entry for the
    /// caller to drop if the observer is done, none is in use or none was asked for; otherwise
    /// it waits for the observer for at most [`OBSERVER_GRACE`].
    pub fn picker_ended(&self, id: u64) -> Option<T> {
        let observers = self.observers_active();
        let mut shard = self.shard(id).lock();
        let parked = shard.get_mut(&id)?;
        if parked.observed || !observers || !parked.watched {
            return shard.remove(&id).map(|p| p.value);
        }
        parked.picker_ended_at = Some(Instant::now());
        None
    }

    fn saw_observer(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        // Relaxed and racy on purpose: any recent value will do.
        if self.observer_seen_ms.load(Ordering::Relaxed) != ms.max(1) {
            self.observer_seen_ms.store(ms.max(1), Ordering::Relaxed);
        }
    }

    /// Whether an observer stream has reported recently, i.e. whether a picker stream that
    /// ends first should leave its entry for an observer.
    pub fn observers_active(&self) -> bool {
        let seen = self.observer_seen_ms.load(Ordering::Relaxed);
        seen != 0
            && (self.epoch.elapsed().as_millis() as u64).saturating_sub(seen)
                <= OBSERVER_RECENT.as_millis() as u64
    }

    /// Drops entries parked longer than `max_age`, and those whose picker ended more than
    /// `grace` ago without an observer report; returns how many.
    pub fn sweep(&self, max_age: Duration, grace: Duration) -> usize {
        let now = Instant::now();
        let expired = |p: &Parked<T>| {
            now.duration_since(p.parked_at) >= max_age
                || p.picker_ended_at
                    .is_some_and(|at| now.duration_since(at) >= grace)
        };
        let mut released = 0;
        for shard in &self.shards {
            // Dropped after the lock is released: dropping a ticket does accounting of its own.
            let gone: Vec<T> = {
                let mut map = shard.lock();
                if !map.values().any(expired) {
                    continue;
                }
                let ids: Vec<u64> = map
                    .iter()
                    .filter(|(_, p)| expired(p))
                    .map(|(&id, _)| id)
                    .collect();
                ids.iter()
                    .filter_map(|id| map.remove(id))
                    .map(|p| p.value)
                    .collect()
            };
            released += gone.len();
        }
        released
    }

    /// Entries currently parked.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether nothing is parked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Counts live parked values through the strong count of a shared `Arc`.
    fn parked(live: &Arc<()>) -> Arc<()> {
        Arc::clone(live)
    }

    #[test]
    fn the_last_of_picker_and_observer_releases() {
        let live = Arc::new(());
        let in_flight = || Arc::strong_count(&live) - 1;
        let table = InflightTable::default();
        let (a, b) = (table.next_id(), table.next_id());
        assert_ne!(a, b);
        table.insert(a, parked(&live), true);
        table.insert(b, parked(&live), true);
        assert_eq!(in_flight(), 2);
        // No observer seen yet: the picker's end releases at once.
        assert!(!table.observers_active());
        drop(table.picker_ended(a));
        assert_eq!(in_flight(), 1);
        // Observer first (a long response): it reports, then the picker's end releases.
        assert_eq!(table.update(b, |_| 7), Some(7));
        assert!(table.observers_active());
        assert!(table.observer_done(b).is_none(), "the request still runs");
        assert_eq!(in_flight(), 1);
        drop(table.picker_ended(b));
        assert_eq!(in_flight(), 0);
        // Picker first (a short response overtaken by the picker's end): the observer releases.
        let c = table.next_id();
        table.insert(c, parked(&live), true);
        assert!(table.picker_ended(c).is_none(), "waits for the observer");
        assert_eq!(
            table.update(c, |_| ()),
            Some(()),
            "still there to report on"
        );
        drop(table.observer_done(c));
        assert_eq!(in_flight(), 0);
        assert!(table.is_empty());
    }

    #[test]
    fn an_unwatched_entry_goes_with_its_picker_even_while_observers_are_in_use() {
        let live = Arc::new(());
        let in_flight = || Arc::strong_count(&live) - 1;
        let table = InflightTable::default();
        table.update(0, |_| ()); // observers in use
        let (watched, unwatched) = (table.next_id(), table.next_id());
        table.insert(watched, parked(&live), true);
        table.insert(unwatched, parked(&live), false);
        assert!(
            table.picker_ended(watched).is_none(),
            "waits for its observer"
        );
        drop(table.picker_ended(unwatched));
        assert_eq!(
            in_flight(),
            1,
            "no observer was asked for: released at once"
        );
        drop(table.observer_done(watched));
        assert_eq!(in_flight(), 0);
    }

    #[test]
    fn predicted_first_bytes_come_due_in_time_order() {
        let table: InflightTable<()> = InflightTable::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        table.schedule(3, t0 + ms(30));
        table.schedule(1, t0 + ms(10));
        table.schedule(2, t0 + ms(20));
        assert_eq!(table.next_due(), Some(t0 + ms(10)));
        assert!(table.take_due(t0).is_empty(), "nothing due yet");
        assert_eq!(table.take_due(t0 + ms(20)), vec![1, 2]);
        assert_eq!(table.next_due(), Some(t0 + ms(30)));
        assert_eq!(table.take_due(t0 + ms(60)), vec![3]);
        assert_eq!(table.next_due(), None);
        // Due for an id no longer parked: nothing to apply.
        assert_eq!(table.with(3, |_| ()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn scheduling_the_earliest_wakes_the_clock() {
        let table: InflightTable<()> = InflightTable::default();
        let t0 = Instant::now();
        table.schedule(1, t0 + Duration::from_secs(10));
        // The wake-up is kept for the next wait (Notify's permit), so no race with the clock.
        tokio::time::timeout(Duration::from_secs(5), table.scheduled_earlier())
            .await
            .expect("the first entry is the earliest");
        table.schedule(2, t0 + Duration::from_secs(20));
        assert!(
            tokio::time::timeout(Duration::from_millis(20), table.scheduled_earlier())
                .await
                .is_err(),
            "a later entry does not wake it"
        );
    }

    #[test]
    fn sweep_releases_after_the_grace_or_the_age_limit() {
        let live = Arc::new(());
        let in_flight = || Arc::strong_count(&live) - 1;
        let table = InflightTable::default();
        table.update(0, |_| ()); // observers in use
        let (a, b) = (table.next_id(), table.next_id());
        table.insert(a, parked(&live), true);
        table.insert(b, parked(&live), true);
        assert!(table.picker_ended(a).is_none());
        let hour = Duration::from_secs(3600);
        assert_eq!(table.sweep(hour, hour), 0);
        assert_eq!(table.sweep(hour, Duration::ZERO), 1, "the grace ran out");
        assert_eq!(in_flight(), 1);
        assert_eq!(table.sweep(Duration::ZERO, hour), 1, "too old");
        assert_eq!(in_flight(), 0);
        assert!(table.take(b).is_none());
    }
}
