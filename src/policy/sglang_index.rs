//! `sglang-cache-aware-index`: SGLang's gateway thresholds over kvrouter's own index, a variant
//! for comparison, **not** what SGLang runs (that is [`super::sglang`]). Load is the router's
//! in-flight requests. If the fleet is imbalanced — `max - min > balance_abs_threshold` and
//! `max > min * balance_rel_threshold` — the least loaded endpoint gets the request. Otherwise
//! the endpoint with the longest cached prefix does, if that prefix covers more than
//! `cache_threshold` of the prompt; if not, the least loaded (SGLang: the smallest tree). The
//! match comes from the capacity-aware ownership index (event-fed when KV events are on), where
//! SGLang matches characters in an approximate tree of its own decisions.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::{PolicyConfig, SglangConfig};

/// SGLang's cache-aware thresholds over the ownership index.
#[derive(Debug)]
pub struct SglangCacheAwareIndex {
    config: SglangConfig,
    rotation: AtomicUsize,
}

impl SglangCacheAwareIndex {
    /// The policy with `config.sglang_cache_aware`.
    pub fn new(config: &PolicyConfig) -> SglangCacheAwareIndex {
        SglangCacheAwareIndex {
            config: config.sglang_cache_aware.clone(),
            rotation: AtomicUsize::new(0),
        }
    }

    /// Whether the loads count as imbalanced.
    pub fn imbalanced(&self, loads: &[u64]) -> bool {
        let max = loads.iter().copied().max().unwrap_or(0);
        let min = loads.iter().copied().min().unwrap_or(0);
        max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold
    }
}

impl Policy for SglangCacheAwareIndex {
    fn name(&self) -> &'static str {
        "sglang-cache-aware-index"
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let loads: Vec<u64> = candidates
            .iter()
            .map(|c| c.load.in_flight_requests)
            .collect();
        let all: Vec<usize> = (0..n).collect();
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let load = |i: usize| loads[i] as f64;
        let places = request.places();
        let by_load = order_by(&all, load, 0.0, |_| 0.0, rotation, n, places);
        let best_match = candidates
            .iter()
            .map(|c| c.matched_fraction(request))
            .fold(0.0, f64::max);
        let order = if self.imbalanced(&loads) || best_match <= self.config.cache_threshold {
            by_load
        } else {
            let matched = |i: usize| -(candidates[i].matched_tokens as f64);
            order_by(&all, matched, 0.0, load, rotation, n, places)
        };
        Ranking {
            order,
            scores: candidates
                .iter()
                .map(|c| Some(c.matched_fraction(request)))
                .collect(),
            predicted_ttft_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{cached, request};

    fn policy() -> SglangCacheAwareIndex {
        SglangCacheAwareIndex::new(&PolicyConfig::default())
    }

    #[test]
    fn imbalance_needs_both_thresholds() {
        let p = policy();
        assert!(!p.imbalanced(&[0, 64]), "abs not exceeded");
        assert!(p.imbalanced(&[0, 65]));
        assert!(!p.imbalanced(&[200, 280]), "rel not exceeded (280 < 300)");
        assert!(p.imbalanced(&[100, 165]));
    }

    #[test]
    fn balanced_fleet_follows_a_good_match_else_load() {
        let p = policy();
        let r = p.rank(&request(100), &[cached(1, 1, 0, 0), cached(2, 5, 0, 40)]);
        assert_eq!(r.pick(), 1, "40% > 30% threshold");
        let r = p.rank(&request(100), &[cached(1, 1, 0, 0), cached(2, 5, 0, 30)]);
        assert_eq!(r.pick(), 0, "30% is not above the threshold: least loaded");
    }

    #[test]
    fn imbalanced_fleet_goes_to_the_least_loaded_despite_the_cache() {
        let p = policy();
        let r = p.rank(&request(100), &[cached(1, 2, 0, 0), cached(2, 100, 0, 100)]);
        assert_eq!(r.pick(), 0);
    }
}
