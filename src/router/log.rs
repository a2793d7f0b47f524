//! A bounded log of recent decisions' explanations, keyed by request id, for the admin API's
//! debug mode (`debug.record_decisions`). Off (capacity 0) by default: building an explanation
//! costs allocations on the hot path.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::Explanation;

/// Recent explanations by request id, oldest evicted first.
#[derive(Debug, Default)]
pub struct DecisionLog {
    inner: Mutex<Inner>,
    /// `capacity > 0`, readable without the lock: every decision asks.
    on: AtomicBool,
}

#[derive(Debug, Default)]
struct Inner {
    capacity: usize,
    order: VecDeque<String>,
    by_id: HashMap<String, Explanation>,
}

impl DecisionLog {
    /// Keep at most `capacity` explanations (0 turns recording off and empties the log).
    pub fn set_capacity(&self, capacity: usize) {
        let mut inner = self.inner.lock();
        inner.capacity = capacity;
        self.on.store(capacity > 0, Ordering::Relaxed);
        while inner.order.len() > capacity {
            if let Some(old) = inner.order.pop_front() {
                inner.by_id.remove(&old);
            }
        }
    }

    /// Whether recording is on.
    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Records `explanation` under `request_id` (ignored when off or the id is empty). The id
    /// comes from the client (through Envoy's `x-request-id`), so two requests may carry the
    /// same one: a later one is kept under `id#2`, `id#3`, ... and never replaces or mixes with
    /// the first.
    pub fn record(&self, request_id: &str, explanation: Explanation) {
        let mut inner = self.inner.lock();
        if inner.capacity == 0 || request_id.is_empty() {
            return;
        }
        let mut key = request_id.to_string();
        // At most `capacity` entries exist, so a free suffix is found within capacity + 1 tries.
        let mut n = 1;
        while inner.by_id.contains_key(&key) {
            n += 1;
            key = format!("{request_id}#{n}");
        }
        inner.by_id.insert(key.clone(), explanation);
        inner.order.push_back(key);
        while inner.order.len() > inner.capacity {
            if let Some(old) = inner.order.pop_front() {
                inner.by_id.remove(&old);
            }
        }
    }

    /// The explanation recorded for `request_id`.
    pub fn get(&self, request_id: &str) -> Option<Explanation> {
        self.inner.lock().by_id.get(request_id).cloned()
    }

    /// Recorded request ids, oldest first.
    pub fn ids(&self) -> Vec<String> {
        self.inner.lock().order.iter().cloned().collect()
    }
}
