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

    /// Records `explanation` under `request_id` (ignored when off or the id is empty).
    pub fn record(&self, request_id: &str, explanation: Explanation) {
        let mut inner = self.inner.lock();
        if inner.capacity == 0 || request_id.is_empty() {
            return;
        }
        if inner
            .by_id
            .insert(request_id.to_string(), explanation)
            .is_none()
        {
            inner.order.push_back(request_id.to_string());
        }
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
