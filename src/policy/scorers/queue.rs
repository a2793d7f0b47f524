//! Scores queue length, min-max normalised (GIE's queue scorer): the engine's waiting requests
//! while its scraped load is fresh, else the router's in-flight requests.

use super::lower_is_better;
use crate::policy::{CandidateView, RequestView, Scorer};

/// Shortest queue scores 1.
#[derive(Debug, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn score(&self, _request: &RequestView, candidates: &[CandidateView], out: &mut [f64]) {
        let all_fresh = candidates.iter().all(|c| c.engine.is_some());
        let queue: Vec<f64> = candidates
            .iter()
            .map(|c| match (all_fresh, c.engine) {
                (true, Some(e)) => e.waiting_requests as f64,
                _ => c.load.in_flight_requests as f64 / c.weight,
            })
            .collect();
        lower_is_better(&queue, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;
    use crate::policy::EngineLoad;

    #[test]
    fn engine_queue_when_all_fresh_else_router_counts() {
        let mut out = [0.0; 2];
        let mut a = candidate(1, 0, 0);
        let mut b = candidate(2, 4, 0);
        QueueScorer.score(&RequestView::default(), &[a.clone(), b.clone()], &mut out);
        assert_eq!(out, [1.0, 0.0]);
        a.engine = Some(EngineLoad {
            waiting_requests: 6,
            ..Default::default()
        });
        b.engine = Some(EngineLoad {
            waiting_requests: 2,
            ..Default::default()
        });
        QueueScorer.score(&RequestView::default(), &[a, b], &mut out);
        assert_eq!(out, [0.0, 1.0]);
    }
}
