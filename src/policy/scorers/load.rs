//! Scores candidates by the router's own in-flight load (requests plus prefill tokens, per unit
//! of weight): the least loaded scores 1.

use crate::policy::{CandidateView, RequestView, Scorer};

use super::lower_is_better;

/// In-flight load scorer.
#[derive(Debug)]
pub struct LoadScorer {
    /// Prefill tokens that weigh as much as one in-flight request.
    pub tokens_per_request: f64,
}

impl Scorer for LoadScorer {
    fn name(&self) -> &'static str {
        "load"
    }

    fn score(&self, _request: &RequestView, candidates: &[CandidateView], out: &mut [f64]) {
        let loads: Vec<f64> = candidates
            .iter()
            .map(|c| c.weighted_load(self.tokens_per_request))
            .collect();
        lower_is_better(&loads, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;

    #[test]
    fn tokens_and_weight_count() {
        let s = LoadScorer {
            tokens_per_request: 100.0,
        };
        let mut heavy_weight = candidate(3, 2, 0);
        heavy_weight.weight = 4.0;
        let cands = [candidate(1, 1, 0), candidate(2, 1, 300), heavy_weight];
        let mut out = [0.0; 3];
        s.score(&RequestView::default(), &cands, &mut out);
        // loads: 1, 4, 0.5
        assert!(out[2] > out[0] && out[0] > out[1], "{out:?}");
        assert_eq!(out[2], 1.0);
        assert_eq!(out[1], 0.0);
    }
}
