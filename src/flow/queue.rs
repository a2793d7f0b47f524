//! One model's queue as plain data: priority bands, flows within a band ordered by a virtual
//! token counter, and within a flow by each entry's order key, then arrival: FCFS when every key
//! is 0, earliest deadline first when the key is the deadline (the controller sets it per band,
//! see `flow_control.ordering`). No clocks, no locks, no channels: the controller holds it under
//! its lock and decides when to pop.
//!
//! Fairness is a virtual token counter (AIBrix's VTC, Sheng et al. 2024): each flow in a band
//! counts the prompt tokens dispatched for it, and the active flow with the smallest count goes
//! next. A flow that becomes active starts at the smallest count among the active flows (or the
//! band's last dispatched count when none is), so idling earns no credit and a flooding flow
//! cannot starve a trickling one: over any busy period their dispatched tokens differ by at most
//! one request's tokens. Empty flows are dropped at once, which is what that lift amounts to, so
//! memory is bounded by the queued entries.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// One queued request.
#[derive(Debug)]
pub(crate) struct Entry<T> {
    /// Unique, increasing with arrival: FCFS order (among equal order keys) and the handle to
    /// remove it by.
    pub id: u64,
    /// Served in ascending order within its flow, before `id`: 0 for FCFS, the deadline (ms on
    /// the controller's clock) for EDF.
    pub order_key: u64,
    /// Its priority band.
    pub priority: i32,
    /// Its flow (tenant or fairness id).
    pub flow: Arc<str>,
    /// Estimated prompt tokens: what the flow is charged when it is dispatched.
    pub tokens: u64,
    /// Body bytes (the queue's byte bound).
    pub bytes: u64,
    /// What the controller keeps with it (the waiter's channel and arrival time).
    pub payload: T,
}

#[derive(Debug)]
struct FlowQueue<T> {
    /// By (order key, id): the first is served next.
    entries: BTreeMap<(u64, u64), Entry<T>>,
    /// Tokens dispatched for this flow, in the band's virtual time.
    counter: u64,
}

#[derive(Debug)]
struct Band<T> {
    flows: HashMap<Arc<str>, FlowQueue<T>>,
    /// The counter of the flow dispatched last: where a flow starts when no other is active.
    vtime: u64,
}

impl<T> Band<T> {
    /// The flow to serve next: smallest counter, then the most urgent (or oldest) head.
    fn next_flow(&self) -> Option<&Arc<str>> {
        self.flows
            .iter()
            .min_by_key(|(_, f)| {
                let head = f.entries.keys().next().copied();
                (f.counter, head.unwrap_or((u64::MAX, u64::MAX)))
            })
            .map(|(name, _)| name)
    }
}

/// A model's queue. Sizes are kept as running totals so the bounds check is O(1).
#[derive(Debug)]
pub(crate) struct ModelQueue<T> {
    bands: BTreeMap<i32, Band<T>>,
    len: usize,
    bytes: u64,
}

impl<T> Default for ModelQueue<T> {
    fn default() -> Self {
        Self {
            bands: BTreeMap::new(),
            len: 0,
            bytes: 0,
        }
    }
}

/// Queued requests of one (priority, flow), for metrics and `/debug/flow`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FlowDepth {
    /// The priority band.
    pub priority: i32,
    /// The flow.
    pub flow: String,
    /// Requests queued.
    pub requests: usize,
    /// Their body bytes.
    pub bytes: u64,
    /// Tokens dispatched for this flow in its band's virtual time (fairness state).
    pub virtual_tokens: u64,
}

impl<T> ModelQueue<T> {
    /// Requests queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Body bytes queued.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `entry` to its flow, in its place by (order key, id).
    pub(crate) fn push(&mut self, entry: Entry<T>) {
        self.len += 1;
        self.bytes += entry.bytes;
        let band = self.bands.entry(entry.priority).or_insert_with(|| Band {
            flows: HashMap::new(),
            vtime: 0,
        });
        let start = band
            .flows
            .values()
            .map(|f| f.counter)
            .min()
            .unwrap_or(band.vtime);
        band.flows
            .entry(Arc::clone(&entry.flow))
            .or_insert_with(|| FlowQueue {
                entries: BTreeMap::new(),
                counter: start,
            })
            .entries
            .insert((entry.order_key, entry.id), entry);
    }

    /// The entry that would be dispatched next: the highest band, its fairest flow, its head.
    pub(crate) fn peek(&self) -> Option<&Entry<T>> {
        let band = self.bands.values().next_back()?;
        band.flows[band.next_flow()?].entries.values().next()
    }

    /// Removes and returns the next entry, charging its flow its tokens.
    pub(crate) fn pop(&mut self) -> Option<Entry<T>> {
        let (&priority, band) = self.bands.iter_mut().next_back()?;
        let name = Arc::clone(band.next_flow()?);
        let flow = band.flows.get_mut(&name)?;
        let (_, entry) = flow.entries.pop_first()?;
        band.vtime = flow.counter;
        flow.counter += entry.tokens.max(1);
        self.forget_if_empty(priority, &name);
        self.len -= 1;
        self.bytes -= entry.bytes;
        Some(entry)
    }

    /// Removes the entry `id` of (`priority`, `flow`), if it is still queued.
    pub(crate) fn remove(&mut self, priority: i32, flow: &str, id: u64) -> Option<Entry<T>> {
        let entries = &mut self.bands.get_mut(&priority)?.flows.get_mut(flow)?.entries;
        let key = *entries.iter().find(|(_, e)| e.id == id)?.0;
        let entry = entries.remove(&key)?;
        self.forget_if_empty(priority, flow);
        self.len -= 1;
        self.bytes -= entry.bytes;
        Some(entry)
    }

    /// Removes the newest entry of the lowest band below `priority`: the one to turn away so a
    /// more important request fits.
    pub(crate) fn evict_below(&mut self, priority: i32) -> Option<Entry<T>> {
        let (&band_priority, band) = self.bands.iter().next()?;
        if band_priority >= priority {
            return None;
        }
        // The newest by arrival, whatever the band's order (a scan: only a full queue asks).
        let (flow, id) = band
            .flows
            .iter()
            .filter_map(|(name, f)| {
                let newest = f.entries.values().map(|e| e.id).max()?;
                Some((Arc::clone(name), newest))
            })
            .max_by_key(|(_, id)| *id)?;
        self.remove(band_priority, &flow, id)
    }

    /// Depth per (priority, flow), highest priority first.
    pub(crate) fn depths(&self) -> Vec<FlowDepth> {
        let mut out = Vec::new();
        for (&priority, band) in self.bands.iter().rev() {
            let mut flows: Vec<_> = band.flows.iter().collect();
            flows.sort_by(|a, b| a.0.cmp(b.0));
            for (name, f) in flows {
                out.push(FlowDepth {
                    priority,
                    flow: name.to_string(),
                    requests: f.entries.len(),
                    bytes: f.entries.values().map(|e| e.bytes).sum(),
                    virtual_tokens: f.counter,
                });
            }
        }
        out
    }

    fn forget_if_empty(&mut self, priority: i32, flow: &str) {
        let Some(band) = self.bands.get_mut(&priority) else {
            return;
        };
        if band.flows.get(flow).is_some_and(|f| f.entries.is_empty()) {
            band.flows.remove(flow);
        }
        if band.flows.is_empty() {
            self.bands.remove(&priority);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, priority: i32, flow: &str, tokens: u64) -> Entry<()> {
        Entry {
            id,
            order_key: 0,
            priority,
            flow: Arc::from(flow),
            tokens,
            bytes: tokens * 4,
            payload: (),
        }
    }

    fn drain(q: &mut ModelQueue<()>) -> Vec<u64> {
        std::iter::from_fn(|| q.pop().map(|e| e.id)).collect()
    }

    #[test]
    fn higher_bands_first_and_fcfs_within_a_flow() {
        let mut q = ModelQueue::default();
        for (id, priority) in [(1, 0), (2, -1), (3, 1), (4, 0), (5, 1), (6, -1)] {
            q.push(entry(id, priority, "a", 10));
        }
        assert_eq!((q.len(), q.bytes()), (6, 240));
        assert_eq!(q.peek().map(|e| e.id), Some(3));
        assert_eq!(drain(&mut q), vec![3, 5, 1, 4, 2, 6]);
        assert!(q.is_empty());
        assert_eq!((q.len(), q.bytes()), (0, 0));
    }

    #[test]
    fn a_flooding_flow_gets_its_token_share_not_more() {
        // Flow "flood" queues 100 requests of 100 tokens before "quiet" queues 10 of 100: the
        // quiet flow must not wait behind the flood.
        let mut q = ModelQueue::default();
        let mut id = 0;
        for _ in 0..100 {
            id += 1;
            q.push(entry(id, 0, "flood", 100));
        }
        for _ in 0..10 {
            id += 1;
            q.push(entry(id, 0, "quiet", 100));
        }
        let first_20: Vec<bool> = (0..20)
            .map(|_| q.pop().unwrap().flow.as_ref() == "quiet")
            .collect();
        assert_eq!(first_20.len(), 20);
        assert_eq!(first_20.iter().filter(|&&quiet| quiet).count(), 10);
        assert_eq!(q.len(), 90);
    }

    #[test]
    fn fairness_is_weighted_by_tokens_not_requests() {
        // "big" asks 1000 tokens per request, "small" 100: per 1000 tokens, about one big
        // request and ten small ones.
        let mut q = ModelQueue::default();
        let mut id = 0;
        for _ in 0..20 {
            id += 1;
            q.push(entry(id, 0, "big", 1000));
            for _ in 0..10 {
                id += 1;
                q.push(entry(id, 0, "small", 100));
            }
        }
        let mut tokens: HashMap<String, u64> = HashMap::new();
        for _ in 0..55 {
            let e = q.pop().unwrap();
            *tokens.entry(e.flow.to_string()).or_default() += e.tokens;
        }
        let (big, small) = (tokens["big"], tokens["small"]);
        assert!(big.abs_diff(small) <= 1000, "big {big} small {small}");
    }

    #[test]
    fn a_returning_flow_gets_no_credit_for_idling() {
        let mut q = ModelQueue::default();
        for id in 1..=6 {
            q.push(entry(id, 0, "a", 100));
        }
        let first: Vec<u64> = (0..4).map(|_| q.pop().unwrap().id).collect();
        assert_eq!(first, vec![1, 2, 3, 4]);
        // "b" was idle while "a" used 400 tokens; it starts level with "a", not 400 ahead.
        q.push(entry(7, 0, "b", 100));
        q.push(entry(8, 0, "b", 100));
        q.push(entry(9, 0, "b", 100));
        assert_eq!(drain(&mut q), vec![5, 7, 6, 8, 9]);
    }

    /// Entries of one flow and band with the order keys `keys` (ids in arrival order).
    fn keyed(keys: &[u64]) -> ModelQueue<()> {
        let mut q = ModelQueue::default();
        for (i, &order_key) in keys.iter().enumerate() {
            q.push(Entry {
                order_key,
                ..entry(i as u64 + 1, 0, "a", 10)
            });
        }
        q
    }

    #[test]
    fn fcfs_serves_by_arrival_and_edf_by_deadline() {
        // Arrivals 1, 2, 3. FCFS (every key 0) serves them as they came.
        assert_eq!(drain(&mut keyed(&[0, 0, 0])), vec![1, 2, 3]);
        // EDF: the key is the deadline. Request 2 arrived later with the earliest deadline
        // (a tighter TTFT target); it goes first, then 3, then 1.
        assert_eq!(drain(&mut keyed(&[9_000, 1_500, 2_000])), vec![2, 3, 1]);
        // Equal deadlines (and requests without a target: key u64::MAX) stay in arrival order.
        assert_eq!(
            drain(&mut keyed(&[u64::MAX, 700, u64::MAX, 700])),
            vec![2, 4, 1, 3]
        );
    }

    #[test]
    fn edf_removal_and_eviction_follow_ids_not_deadlines() {
        let mut q = keyed(&[100, 50, 75]);
        // Evicting takes the newest arrival (3), not the latest deadline (1).
        assert_eq!(q.evict_below(1).map(|e| e.id), Some(3));
        assert_eq!(q.remove(0, "a", 1).map(|e| e.id), Some(1));
        assert_eq!(drain(&mut q), vec![2]);
        assert_eq!((q.len(), q.bytes()), (0, 0));
    }

    #[test]
    fn remove_and_evict_keep_totals() {
        let mut q = ModelQueue::default();
        q.push(entry(1, 1, "a", 10));
        q.push(entry(2, -1, "a", 10));
        q.push(entry(3, -1, "b", 10));
        q.push(entry(4, 0, "b", 10));
        assert_eq!(q.remove(1, "a", 1).map(|e| e.id), Some(1));
        assert!(q.remove(1, "a", 1).is_none(), "removed once");
        assert!(q.remove(0, "b", 99).is_none(), "unknown id");
        // The lowest band's newest entry goes first; nothing at or above the asker's priority.
        assert_eq!(q.evict_below(1).map(|e| e.id), Some(3));
        assert_eq!(q.evict_below(1).map(|e| e.id), Some(2));
        assert!(q.evict_below(0).is_none());
        assert_eq!((q.len(), q.bytes()), (1, 40));
        let depths = q.depths();
        assert_eq!(depths.len(), 1);
        assert_eq!((depths[0].priority, depths[0].requests), (0, 1));
    }
}
