//! Which counter series name which endpoint, so they go when the endpoint goes.
//!
//! Per-endpoint gauges are rebuilt from the endpoint set at every scrape, but counters and
//! histograms (decisions, upstream statuses, scrape latencies and errors, health changes) are
//! created on first use and were kept forever: under DNS or Kubernetes churn every address a
//! pool ever had stayed in `/metrics`, an unbounded set of series. Each family records here the
//! label sets it creates, keyed by endpoint, and at each scrape the series of endpoints no
//! longer in the set are removed (whatever source removed them; a straggling response that
//! re-creates a series after the removal is swept by the next scrape).
//!
//! The hot path pays one read-locked `get` on the family (which `get_or_create` takes
//! anyway); the tracker's own lock is taken only when a label set is new.

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;

/// Label sets of type `T` created per endpoint address.
#[derive(Debug)]
pub struct EndpointSeries<T> {
    by_endpoint: Mutex<HashMap<String, Vec<T>>>,
}

impl<T> Default for EndpointSeries<T> {
    fn default() -> Self {
        EndpointSeries {
            by_endpoint: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> EndpointSeries<T> {
    /// Notes that `series` (a label set naming `endpoint`) was just created. Call only when the
    /// family did not contain it: a duplicate is harmless (removing twice), a miss is a leak.
    pub fn note(&self, endpoint: &str, series: T) {
        self.by_endpoint
            .lock()
            .entry(endpoint.to_string())
            .or_default()
            .push(series);
    }

    /// Takes the label sets of every endpoint not in `live`, for the caller to remove.
    pub fn prune(&self, live: &HashSet<&str>) -> Vec<T> {
        let mut gone = Vec::new();
        self.by_endpoint.lock().retain(|endpoint, series| {
            let keep = live.contains(endpoint.as_str());
            if !keep {
                gone.append(series);
            }
            keep
        });
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prunes_only_endpoints_that_left() {
        let s = EndpointSeries::<(&str, u8)>::default();
        s.note("a:1", ("a:1", 1));
        s.note("a:1", ("a:1", 2));
        s.note("b:1", ("b:1", 1));
        let live: HashSet<&str> = ["b:1"].into_iter().collect();
        let mut gone = s.prune(&live);
        gone.sort();
        assert_eq!(gone, vec![("a:1", 1), ("a:1", 2)]);
        assert!(s.prune(&live).is_empty(), "taken once");
        assert_eq!(s.prune(&HashSet::new()), vec![("b:1", 1)]);
    }
}
