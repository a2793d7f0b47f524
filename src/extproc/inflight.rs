//! Requests routed but not yet finished, by pick id: the hand-off between the stream that picked
//! an endpoint and the stream that sees the response.
//!
//! With Envoy's recommended set-up the picker filter's stream ends with the request, and a second
//! ext_proc filter in observability mode (which never holds up the response) reports the
//! response on a stream of its own. The picker leaves its in-flight guard here under a pick id it
//! also writes into `kvrouter` dynamic metadata; the observer stream receives that metadata and
//! takes the guard. When the response ends, or the observer stream goes away (client gone), the
//! guard drops. If no observer ever claims it (observer filter not configured, or lost), the
//! picker releases at its own stream end, and a sweep releases anything older than the request
//! time limit, so no count can leak.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::discovery::Endpoint;
use crate::health::TrialPermit;
use crate::load::{InflightGuard, TtftContext};

const SHARDS: usize = 16;

/// A routed request whose response has not ended.
#[derive(Debug)]
pub struct Tracked {
    /// Its share of the endpoint's load.
    pub guard: InflightGuard,
    /// The endpoint it was sent to (updated if a retry moved it).
    pub endpoint: Arc<Endpoint>,
    /// Uncached prompt tokens the decision gave the endpoint to prefill.
    pub prompt_tokens: u64,
    /// When the decision was made.
    pub decided_at: Instant,
    /// The destination list as sent to Envoy: the pick, then the fallbacks in order.
    pub destinations: Vec<Arc<Endpoint>>,
    /// What the cost model expected of the pick, to learn from its first byte; cleared if a
    /// retry moved the request.
    pub ttft: Option<TtftContext>,
    /// The pick's half-open trial slot, returned once its outcome is known.
    pub trial: Option<TrialPermit>,
}

/// The hand-off table.
#[derive(Debug)]
pub struct InflightTable {
    shards: [Mutex<HashMap<u64, (Tracked, Instant)>>; SHARDS],
    next_id: AtomicU64,
    /// Milliseconds since `epoch` when an observer stream last claimed an entry (0: never).
    observer_seen_ms: AtomicU64,
    epoch: Instant,
}

impl Default for InflightTable {
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

impl InflightTable {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, (Tracked, Instant)>> {
        &self.shards[(id as usize) % SHARDS]
    }

    /// A new unique pick id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Parks `tracked` under `id`.
    pub fn insert(&self, id: u64, tracked: Tracked) {
        self.shard(id).lock().insert(id, (tracked, Instant::now()));
    }

    /// Removes and returns the entry for `id`.
    pub fn take(&self, id: u64) -> Option<Tracked> {
        self.shard(id).lock().remove(&id).map(|(t, _)| t)
    }

    /// Like [`Self::take`], from an observer stream: also records that observers are active
    /// (even when the entry is gone, e.g. released by a picker that did not know yet).
    pub fn claim(&self, id: u64) -> Option<Tracked> {
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

    /// Releases entries parked longer than `max_age`; returns how many.
    pub fn sweep(&self, max_age: Duration) -> usize {
        let now = Instant::now();
        let mut released = 0;
        for shard in &self.shards {
            let mut map = shard.lock();
            let before = map.len();
            map.retain(|_, (_, parked)| now.duration_since(*parked) < max_age);
            released += before - map.len();
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
    use crate::config::ResolvedEndpoint;
    use crate::discovery::Registry;

    fn tracked(reg: &Registry) -> Tracked {
        let ep = Arc::clone(&reg.snapshot().all()[0]);
        Tracked {
            guard: ep.load.begin(5),
            destinations: vec![Arc::clone(&ep)],
            endpoint: ep,
            prompt_tokens: 5,
            decided_at: Instant::now(),
            ttft: None,
            trial: None,
        }
    }

    fn registry() -> Registry {
        Registry::new(&[ResolvedEndpoint::new(
            "127.0.0.1:1".parse().unwrap(),
            "p",
            &["m"],
        )])
    }

    #[test]
    fn handoff_take_claim_and_sweep() {
        let reg = registry();
        let load = || reg.snapshot().all()[0].load.snapshot().in_flight_requests;
        let table = InflightTable::default();
        let (a, b) = (table.next_id(), table.next_id());
        assert_ne!(a, b);
        table.insert(a, tracked(&reg));
        table.insert(b, tracked(&reg));
        assert_eq!(load(), 2);
        assert!(!table.observers_active());
        let claimed = table.claim(a).expect("parked");
        assert!(table.observers_active());
        assert!(table.claim(a).is_none(), "claimed once");
        drop(claimed);
        assert_eq!(load(), 1);
        assert_eq!(table.sweep(Duration::from_secs(60)), 0);
        assert_eq!(table.sweep(Duration::ZERO), 1);
        assert_eq!(load(), 0);
        assert!(table.is_empty());
    }
}
