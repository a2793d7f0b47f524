//! A policy assembled GIE-style: filters, then weighted scorers, then a picker.
//!
//! Filters degrade instead of failing: when they would exclude every candidate, all are kept
//! (routing to a saturated endpoint beats refusing a request). Excluded candidates still rank,
//! after the eligible ones, so they can serve as fallbacks.

use super::filters::Saturation;
use super::pickers::{MaxScore, TieBreak};
use super::scorers::{KvCacheScorer, LoadScorer, PrefixScorer, QueueScorer};
use super::{CandidateView, Filter, Picker, Policy, Ranking, RequestView, Scorer};
use crate::config::{PolicyConfig, ScorerName, TieBreakName};

/// Filters -> weighted scorers -> picker.
#[derive(Debug)]
pub struct Composed {
    name: &'static str,
    filters: Vec<Box<dyn Filter>>,
    scorers: Vec<(Box<dyn Scorer>, f64)>,
    picker: Box<dyn Picker>,
}

impl Composed {
    /// Assembles a policy. Scorer weights must be >= 0 with a positive sum (config validation
    /// guarantees it).
    pub fn new(
        name: &'static str,
        filters: Vec<Box<dyn Filter>>,
        scorers: Vec<(Box<dyn Scorer>, f64)>,
        picker: Box<dyn Picker>,
    ) -> Self {
        Self {
            name,
            filters,
            scorers,
            picker,
        }
    }
}

/// `least-loaded`: the saturation filter, the in-flight load scorer, max-score with rotating
/// tie-break.
pub fn least_loaded(config: &PolicyConfig) -> Composed {
    Composed::new(
        "least-loaded",
        vec![Box::new(Saturation::from(&config.saturation))],
        vec![(
            Box::new(LoadScorer {
                tokens_per_request: config.least_loaded.tokens_per_request,
            }),
            1.0,
        )],
        Box::new(MaxScore::new(TieBreak::Rotate)),
    )
}

/// `weighted-scorers`: the saturation filter, the configured scorers with their weights, and
/// the max-score picker with the configured tie-break.
pub fn weighted_scorers(config: &PolicyConfig) -> Composed {
    let c = &config.weighted_scorers;
    let scorers = c
        .scorers
        .iter()
        .map(|s| {
            let scorer: Box<dyn Scorer> = match s.name {
                ScorerName::Prefix => Box::new(PrefixScorer),
                ScorerName::Queue => Box::new(QueueScorer),
                ScorerName::KvCache => Box::new(KvCacheScorer),
                ScorerName::Load => Box::new(LoadScorer {
                    tokens_per_request: config.least_loaded.tokens_per_request,
                }),
            };
            (scorer, s.weight)
        })
        .collect();
    let tie = match c.tie_break {
        TieBreakName::Rotate => TieBreak::Rotate,
        TieBreakName::Random => TieBreak::Random,
    };
    Composed::new(
        "weighted-scorers",
        vec![Box::new(Saturation::from(&config.saturation))],
        scorers,
        Box::new(MaxScore::new(tie)),
    )
}

impl Policy for Composed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let eligible = super::eligible_or_all(n, |i| {
            self.filters.iter().all(|f| f.keep(request, &candidates[i]))
        });

        let mut total = vec![0.0; n];
        let mut scratch = vec![0.0; n];
        let weight_sum: f64 = self.scorers.iter().map(|(_, w)| w).sum();
        for (scorer, weight) in &self.scorers {
            scorer.score(request, candidates, &mut scratch);
            for (t, s) in total.iter_mut().zip(&scratch) {
                *t += weight * s.clamp(0.0, 1.0);
            }
        }
        if weight_sum > 0.0 {
            total.iter_mut().for_each(|t| *t /= weight_sum);
        }

        let mut order = self.picker.order(&total, &eligible.kept);
        let mut excluded = eligible.excluded;
        excluded.sort_by(|&a, &b| total[b].total_cmp(&total[a]));
        order.extend(excluded);

        let scores = (0..n)
            .map(|i| eligible.mask[i].then_some(total[i]))
            .collect();
        Ranking {
            order,
            scores,
            predicted_ttft_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{assert_permutation, candidate};
    use proptest::prelude::*;

    fn ll() -> Composed {
        least_loaded(&PolicyConfig::default())
    }

    #[test]
    fn weighted_scorers_combine_prefix_and_queue() {
        use crate::policy::testing::{cached, request};
        let mut config = PolicyConfig::default();
        config.weighted_scorers.tie_break = TieBreakName::Rotate;
        let p = weighted_scorers(&config);
        // Default weights: prefix 3, queue 2, kv-cache 2 (neutral without scrapes).
        // A: all cached, 4 queued -> 3*1 + 2*0; B: nothing cached, idle -> 3*0 + 2*1.
        let r = p.rank(&request(100), &[cached(1, 4, 0, 100), cached(2, 0, 0, 0)]);
        assert_eq!(r.pick(), 0);
        let s = r.scores;
        assert!((s[0].unwrap() - (3.0 + 1.0) / 7.0).abs() < 1e-12, "{s:?}");
        assert!((s[1].unwrap() - (2.0 + 1.0) / 7.0).abs() < 1e-12, "{s:?}");
        config.weighted_scorers.scorers[0].weight = 1.0;
        let p = weighted_scorers(&config);
        let r = p.rank(&request(100), &[cached(1, 4, 0, 100), cached(2, 0, 0, 0)]);
        assert_eq!(r.pick(), 1, "queue outweighs prefix at weight 1");
    }

    #[test]
    fn least_loaded_prefers_fewer_requests_then_fewer_tokens() {
        let p = ll();
        // Loads with 2048 tokens per request: 3, 1 + 2048/2048 = 2, and 1.
        let cands = [
            candidate(1, 3, 0),
            candidate(2, 1, 2048),
            candidate(3, 1, 0),
        ];
        let r = p.rank(&RequestView::default(), &cands);
        assert_eq!(r.order, vec![2, 1, 0]);
        assert_permutation(&r, 3);
    }

    #[test]
    fn saturated_endpoints_rank_last_unless_all_are() {
        let p = ll();
        let mut full = candidate(1, 2, 0);
        full.max_in_flight = Some(2);
        let busy = candidate(2, 9, 0);
        let r = p.rank(&RequestView::default(), &[full.clone(), busy.clone()]);
        assert_eq!(r.order, vec![1, 0]);
        assert_eq!(r.scores[0], None);
        let mut busy_full = busy;
        busy_full.max_in_flight = Some(9);
        let r = p.rank(&RequestView::default(), &[full, busy_full]);
        assert_eq!(r.pick(), 0, "all saturated: keep all, least loaded wins");
    }

    #[test]
    fn idle_fleet_spreads() {
        let p = ll();
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0), candidate(3, 0, 0)];
        let mut picks: Vec<usize> = (0..3)
            .map(|_| p.rank(&RequestView::default(), &cands).pick())
            .collect();
        picks.sort_unstable();
        assert_eq!(picks, vec![0, 1, 2]);
    }

    proptest! {
        /// The picker always returns every candidate exactly once, the pick first.
        #[test]
        fn ranking_is_a_permutation(loads in proptest::collection::vec((0u64..50, 0u64..10_000, proptest::option::of(1u32..50)), 1..40)) {
            let cands: Vec<_> = loads.iter().enumerate().map(|(i, &(r, t, lim))| {
                let mut c = candidate(i as u16 + 1, r, t);
                c.max_in_flight = lim;
                c
            }).collect();
            let r = ll().rank(&RequestView::default(), &cands);
            assert_permutation(&r, cands.len());
        }
    }
}
