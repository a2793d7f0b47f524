//! `round-robin`: each request goes to the next candidate in turn. Ignores load and cache; the
//! baseline every other policy is compared with.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{CandidateView, Policy, Ranking, RequestView};

/// Rotates through the candidates; fallbacks are the ones after the pick.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn rank(&self, _request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        Ranking {
            order: (0..n).map(|i| (start + i) % n).collect(),
            scores: vec![Some(0.0); n],
            predicted_ttft_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{assert_permutation, candidate};

    #[test]
    fn rotates_and_ignores_load() {
        let rr = RoundRobin::default();
        let cands = [candidate(1, 100, 0), candidate(2, 0, 0), candidate(3, 0, 0)];
        let picks: Vec<usize> = (0..6)
            .map(|_| {
                let r = rr.rank(&RequestView::default(), &cands);
                assert_permutation(&r, 3);
                r.pick()
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let r = rr.rank(&RequestView::default(), &cands);
        assert_eq!(r.order, vec![0, 1, 2]);
    }
}
