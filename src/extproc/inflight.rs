//! Requests routed but not yet finished, by pick id: the hand-off between the stream that picked
//! an endpoint and the stream that sees the response.
//!
//! With Envoy's recommended set-up the picker filter's stream ends with the request, and a second
//! ext_proc filter in observability mode (which never holds up the response) reports the
//! response on a stream of its own. The picker parks its request's ticket here under a pick id
//! it also writes into `kvrouter` dynamic metadata; the observer stream receives that metadata
//! and takes the ticket. When the response ends, or the observer stream goes away (client
//! gone), the ticket drops, and with it whatever it holds. If no observer ever claims it
//! (observer filter not configured, or lost), the picker drops it at its own stream end, and a
//! sweep drops anything older than the request time limit, so no count can leak.
//!
//! The table does not look inside what it parks: it only keeps, hands over and drops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

const SHARDS: usize = 16;

/// The hand-off table of parked `T`s (the router's tickets), by pick id.
#[derive(Debug)]
pub struct InflightTable<T> {
    shards: [Mutex<HashMap<u64, (T, Instant)>>; SHARDS],
    next_id: AtomicU64,
    /// Milliseconds since `epoch` when an observer stream last claimed an entry (0: never).
    observer_seen_ms: AtomicU64,
    epoch: Instant,
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
        }
    }
}

/// How long after the last observer claim we still expect observers to come.
const OBSERVER_RECENT: Duration = Duration::from_secs(120);

impl<T> InflightTable<T> {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, (T, Instant)>> {
        &self.shards[(id as usize) % SHARDS]
    }

    /// A new unique pick id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Parks `parked` under `id`.
    pub fn insert(&self, id: u64, parked: T) {
        self.shard(id).lock().insert(id, (parked, Instant::now()));
    }

    /// Removes and returns the entry for `id`.
    pub fn take(&self, id: u64) -> Option<T> {
        self.shard(id).lock().remove(&id).map(|(t, _)| t)
    }

    /// Like [`Self::take`], from an observer stream: also records that observers are active
    /// (even when the entry is gone, e.g. released by a picker that did not know yet).
    pub fn claim(&self, id: u64) -> Option<T> {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.observer_seen_ms.store(ms.max(1), Ordering::Relaxed);
        self.take(id)
    }

    /// Whether an observer stream has claimed an entry recently, i.e. whether a picker stream
    /// that ends before the response should leave its entry for an observer.
    pub fn observers_active(&self) -> bool {
        let seen = self.observer_seen_ms.load(Ordering::Relaxed);
        seen != 0
            && (self.epoch.elapsed().as_millis() as u64).saturating_sub(seen)
                <= OBSERVER_RECENT.as_millis() as u64
    }

    /// Drops entries parked longer than `max_age`; returns how many.
    pub fn sweep(&self, max_age: Duration) -> usize {
        let now = Instant::now();
        let mut released = 0;
        for shard in &self.shards {
            // Dropped after the lock is released: dropping a ticket does accounting of its own.
            let expired: Vec<T> = {
                let mut map = shard.lock();
                let ids: Vec<u64> = map
                    .iter()
                    .filter(|(_, (_, parked))| now.duration_since(*parked) >= max_age)
                    .map(|(&id, _)| id)
                    .collect();
                ids.iter()
                    .filter_map(|id| map.remove(id))
                    .map(|(t, _)| t)
                    .collect()
            };
            released += expired.len();
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
    fn handoff_take_claim_and_sweep() {
        let live = Arc::new(());
        let in_flight = || Arc::strong_count(&live) - 1;
        let table = InflightTable::default();
        let (a, b) = (table.next_id(), table.next_id());
        assert_ne!(a, b);
        table.insert(a, parked(&live));
        table.insert(b, parked(&live));
        assert_eq!(in_flight(), 2);
        assert!(!table.observers_active());
        let claimed = table.claim(a).expect("parked");
        assert!(table.observers_active());
        assert!(table.claim(a).is_none(), "claimed once");
        drop(claimed);
        assert_eq!(in_flight(), 1);
        assert_eq!(table.sweep(Duration::from_secs(60)), 0);
        assert_eq!(table.sweep(Duration::ZERO), 1);
        assert_eq!(in_flight(), 0);
        assert!(table.is_empty());
    }
}
