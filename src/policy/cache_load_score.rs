//! `cache-load-score`: the vLLM production-stack router's score,
//! `matched / prompt - beta * (load - mean) / max(1, mean)`, highest first. Load is the
//! router's in-flight requests (per unit of weight); `mean` is over the candidates.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::PolicyConfig;

/// Cache fraction minus normalised load excess.
#[derive(Debug)]
pub struct CacheLoadScore {
    beta: f64,
    rotation: AtomicUsize,
}

impl CacheLoadScore {
    /// The policy with `config.cache_load_score.beta`.
    pub fn new(config: &PolicyConfig) -> CacheLoadScore {
        CacheLoadScore {
            beta: config.cache_load_score.beta,
            rotation: AtomicUsize::new(0),
        }
    }

    /// Each candidate's score.
    pub fn scores(&self, request: &RequestView, candidates: &[CandidateView]) -> Vec<f64> {
        let load: Vec<f64> = candidates
            .iter()
            .map(|c| c.load.in_flight_requests as f64 / c.weight)
            .collect();
        let mean = load.iter().sum::<f64>() / load.len().max(1) as f64;
        candidates
            .iter()
            .zip(&load)
            .map(|(c, l)| c.matched_fraction(request) - self.beta * (l - mean) / mean.max(1.0))
            .collect()
    }
}

impl Policy for CacheLoadScore {
    fn name(&self) -> &'static str {
        "cache-load-score"
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let scores = self.scores(request, candidates);
        let all: Vec<usize> = (0..n).collect();
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        Ranking {
            order: order_by(
                &all,
                |i| -scores[i],
                0.0,
                |_| 0.0,
                rotation,
                n,
                request.places(),
            ),
            scores: scores.into_iter().map(Some).collect(),
            predicted_ttft_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{cached, request};

    #[test]
    fn score_formula() {
        let p = CacheLoadScore::new(&PolicyConfig::default());
        // loads 1 and 3 (mean 2); matched fractions 0.5 and 1.0.
        let s = p.scores(&request(100), &[cached(1, 1, 0, 50), cached(2, 3, 0, 100)]);
        assert_eq!(s, vec![0.5 + 0.5, 1.0 - 0.5]);
    }

    #[test]
    fn cache_wins_when_balanced_and_load_wins_when_not() {
        let p = CacheLoadScore::new(&PolicyConfig::default());
        let r = p.rank(&request(100), &[cached(1, 2, 0, 0), cached(2, 2, 0, 90)]);
        assert_eq!(r.pick(), 1);
        let r = p.rank(&request(100), &[cached(1, 0, 0, 0), cached(2, 8, 0, 90)]);
        assert_eq!(r.pick(), 0);
    }
}
