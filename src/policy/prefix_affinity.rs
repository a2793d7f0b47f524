//! `prefix-affinity`: the longest cached prefix wins; ties (including "nothing cached
//! anywhere") go to the least loaded. Load is otherwise ignored, so a hot prefix piles onto the
//! replica that holds it: the naive baseline the cost-aware policies are measured against.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::PolicyConfig;

/// Longest match first.
#[derive(Debug)]
pub struct PrefixAffinity {
    tokens_per_request: f64,
    rotation: AtomicUsize,
}

impl PrefixAffinity {
    /// The policy with `config`'s tie-break load figure.
    pub fn new(config: &PolicyConfig) -> PrefixAffinity {
        PrefixAffinity {
            tokens_per_request: config.least_loaded.tokens_per_request,
            rotation: AtomicUsize::new(0),
        }
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix-affinity"
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let all: Vec<usize> = (0..n).collect();
        let matched = |i: usize| candidates[i].matched_tokens as f64;
        let load = |i: usize| candidates[i].weighted_load(self.tokens_per_request);
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        Ranking {
            order: order_by(
                &all,
                |i| -matched(i),
                0.0,
                load,
                rotation,
                n,
                request.places(),
            ),
            scores: (0..n).map(|i| Some(matched(i))).collect(),
            predicted_ttft_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{assert_permutation, cached, request};

    #[test]
    fn longest_match_wins_whatever_the_load() {
        let p = PrefixAffinity::new(&PolicyConfig::default());
        let r = p.rank(
            &request(1000),
            &[
                cached(1, 0, 0, 100),
                cached(2, 50, 90_000, 900),
                cached(3, 1, 0, 500),
            ],
        );
        assert_eq!(r.order, vec![1, 2, 0]);
        assert_permutation(&r, 3);
    }

    #[test]
    fn ties_go_to_the_least_loaded() {
        let p = PrefixAffinity::new(&PolicyConfig::default());
        let r = p.rank(
            &request(1000),
            &[cached(1, 3, 0, 0), cached(2, 1, 0, 0), cached(3, 2, 0, 0)],
        );
        assert_eq!(r.order, vec![1, 2, 0]);
    }
}
