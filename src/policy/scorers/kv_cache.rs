//! Scores free KV cache, `1 - usage` (GIE's KV-cache utilisation scorer). Candidates without a
//! fresh scrape score 0.5, so missing data neither attracts nor repels.

use crate::policy::{CandidateView, RequestView, Scorer};

/// Free KV fraction.
#[derive(Debug, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn name(&self) -> &'static str {
        "kv-cache"
    }

    fn score(&self, _request: &RequestView, candidates: &[CandidateView], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(candidates) {
            *o = c
                .engine
                .map_or(0.5, |e| (1.0 - e.kv_cache_usage).clamp(0.0, 1.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;
    use crate::policy::EngineLoad;

    #[test]
    fn free_fraction_or_neutral() {
        let mut out = [0.0; 2];
        let mut a = candidate(1, 0, 0);
        a.engine = Some(EngineLoad {
            kv_cache_usage: 0.25,
            ..Default::default()
        });
        KvCacheScorer.score(&RequestView::default(), &[a, candidate(2, 0, 0)], &mut out);
        assert_eq!(out, [0.75, 0.5]);
    }
}
