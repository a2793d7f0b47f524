//! `predicted-ttft` (the default): the candidate with the lowest predicted time to first token
//! plus the delay its prefill imposes on the requests queued behind it ([`super::cost`]),
//! endpoints at their `max_in_flight` (and, if asked, those the engine signals call saturated)
//! filtered out unless all are, near-ties broken towards the lighter
//! endpoint. The score is minus that cost; the predictions are reported as they are. With
//! `recall_weight` (off by default), candidates other than the prefix's home pay for the part of
//! the prefix the home lost ([`PredictedTtft::away_from_home_ms`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::cost::CostModel;
use super::filters::Saturation;
use super::{eligible_or_all, order_by, CandidateView, Filter, Policy, Ranking, RequestView};
use crate::config::PolicyConfig;

/// Minimum predicted TTFT.
#[derive(Debug)]
pub struct PredictedTtft {
    model: CostModel,
    saturation: Saturation,
    tie_tolerance: f64,
    tokens_per_request: f64,
    recall_weight: f64,
    rotation: AtomicUsize,
}

impl PredictedTtft {
    /// The policy with `config`'s parameters.
    pub fn new(config: &PolicyConfig) -> PredictedTtft {
        PredictedTtft {
            model: CostModel::from(&config.predicted_ttft),
            saturation: if config.predicted_ttft.engine_saturation {
                Saturation::from(&config.saturation)
            } else {
                Saturation::limits_only()
            },
            tie_tolerance: config.predicted_ttft.tie_tolerance,
            tokens_per_request: config.least_loaded.tokens_per_request,
            recall_weight: config.predicted_ttft.recall_weight,
            rotation: AtomicUsize::new(0),
        }
    }
}

/// Prompt tokens `c` holds, by the engine's word or the index's.
fn held(c: &CandidateView) -> u64 {
    c.held_tokens.max(c.matched_tokens)
}

impl PredictedTtft {
    /// The prefix's home among `candidates` ([`CandidateView::recalled_tokens`]: where the
    /// router last sent the prefix) when homes are priced and it has lost part of the prefix
    /// since (the engine evicted it): its index and the tokens lost. None while the home holds
    /// all it was sent: then nobody is charged.
    fn home_loss(&self, candidates: &[CandidateView]) -> Option<(usize, u64)> {
        if !self.wants_homes() {
            return None;
        }
        let h = candidates.iter().position(|c| c.recalled_tokens > 0)?;
        let home = &candidates[h];
        let lost = home.recalled_tokens.saturating_sub(held(home));
        (lost > 0).then_some((h, lost))
    }

    /// What sending the request to `c` rather than to the prefix's `home`, which lost `lost`
    /// tokens of it, costs, ms: `recall_weight` times the prefill of those lost tokens that `c`
    /// does not hold either. Recomputed on the home, the group keeps one copy; recomputed
    /// elsewhere, it gets a second home, and a group moved at each eviction leaves partial
    /// copies all over the fleet. Nothing is charged to a candidate that holds the prefix itself.
    fn away_from_home_ms(&self, home: &CandidateView, lost: u64, c: &CandidateView) -> f64 {
        let missing = home.recalled_tokens.saturating_sub(held(c)).min(lost);
        self.recall_weight * self.model.prefill_ms(missing, c)
    }
}

impl Policy for PredictedTtft {
    fn name(&self) -> &'static str {
        "predicted-ttft"
    }

    fn wants_homes(&self) -> bool {
        self.recall_weight > 0.0
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        let n = candidates.len();
        let (mut ttft, mut cost) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let home = self.home_loss(candidates);
        for (i, c) in candidates.iter().enumerate() {
            let p = self.model.predict(request, c);
            let away = match home {
                Some((h, lost)) if h != i => self.away_from_home_ms(&candidates[h], lost, c),
                _ => 0.0,
            };
            ttft.push(p.ttft_ms);
            cost.push(p.cost_ms + away);
        }
        let eligible = eligible_or_all(n, |i| self.saturation.keep(request, &candidates[i]));
        let load = |i: usize| candidates[i].weighted_load(self.tokens_per_request);
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let places = request.places();
        let mut order = order_by(
            &eligible.kept,
            |i| cost[i],
            self.tie_tolerance,
            load,
            rotation,
            n,
            places,
        );
        order.extend(order_by(
            &eligible.excluded,
            |i| cost[i],
            self.tie_tolerance,
            load,
            rotation,
            n,
            places.saturating_sub(eligible.kept.len()),
        ));
        Ranking {
            order,
            scores: (0..n)
                .map(|i| eligible.mask[i].then_some(-cost[i]))
                .collect(),
            predicted_ttft_ms: Some(ttft),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{assert_permutation, cached, request};
    use proptest::prelude::*;

    fn policy() -> PredictedTtft {
        let mut config = PolicyConfig::default();
        config.predicted_ttft.running_request_ms = 0.0;
        PredictedTtft::new(&config)
    }

    #[test]
    fn picks_the_cache_holder_until_its_queue_outweighs_the_saving() {
        let p = policy();
        let prompt = request(4000);
        let r = p.rank(&prompt, &[cached(1, 3, 2200, 3000), cached(2, 1, 200, 0)]);
        assert_eq!(r.pick(), 0);
        assert_eq!(r.predicted_ttft_ms.as_ref().unwrap(), &vec![320.0, 420.0]);
        let r = p.rank(&prompt, &[cached(1, 3, 4000, 3000), cached(2, 1, 200, 0)]);
        assert_eq!(r.pick(), 1);
        assert_eq!(r.order, vec![1, 0], "the other is the fallback");
    }

    /// A busy fleet: greedy TTFT would recompute the prefix on a cold replica that is a little
    /// less busy; the cost charges that recomputation to the requests queued behind it and keeps
    /// the request on the holder, until the holder's queue outweighs it.
    #[test]
    fn under_load_the_holder_keeps_its_prefix_until_its_queue_outweighs_the_recompute() {
        let with_queue = |port, prefilling, tokens, matched| {
            let mut c = cached(port, prefilling, tokens, matched);
            c.load.in_flight_prefilling = prefilling;
            c
        };
        let prompt = request(4000);
        let holder = with_queue(1, 4, 3500, 3000); // TTFT 350 + 100 = 450 ms
        let cold = with_queue(2, 2, 200, 0); // TTFT 20 + 400 = 420 ms
        let mut greedy_config = PolicyConfig::default();
        greedy_config.predicted_ttft.running_request_ms = 0.0;
        greedy_config.predicted_ttft.externality_weight = 0.0;
        let greedy = PredictedTtft::new(&greedy_config);
        let cands = [holder.clone(), cold.clone()];
        assert_eq!(greedy.rank(&prompt, &cands).pick(), 1, "greedy recomputes");
        let r = policy().rank(&prompt, &cands);
        assert_eq!(r.pick(), 0, "{r:?}");
        // The predictions are reported unchanged; the scores are minus the costs:
        // holder 450 + 100 * 4, cold 420 + 400 * 2.
        assert_eq!(r.predicted_ttft_ms.as_ref().unwrap(), &vec![450.0, 420.0]);
        assert_eq!(r.scores, vec![Some(-850.0), Some(-1220.0)]);
        // The holder's queue grows to 12 requests (1,200 ms): 1,300 + 1,200 > 1,220.
        let swamped = with_queue(1, 12, 12_000, 3000);
        assert_eq!(policy().rank(&prompt, &[swamped, cold]).pick(), 1);
    }

    /// The home lost the prefix: with `recall_weight` the others are charged its recompute
    /// (not the candidate that holds it itself), so the request goes home unless the home's
    /// queue outweighs it.
    #[test]
    fn an_evicted_prefix_goes_home_unless_another_holds_it_or_home_is_swamped() {
        let mut config = PolicyConfig::default();
        config.predicted_ttft.running_request_ms = 0.0;
        config.predicted_ttft.recall_weight = 1.0;
        let p = PredictedTtft::new(&config);
        let prompt = request(4000);
        let mut home = cached(1, 1, 500, 0); // 50 ms of queue, nothing held any more
        home.recalled_tokens = 3000;
        let cold = cached(2, 0, 0, 0);
        let r = p.rank(&prompt, &[home.clone(), cold.clone()]);
        assert_eq!(r.pick(), 0, "{r:?}");
        // The cold one pays its own 400 ms plus the 300 ms of the home's lost 3,000 tokens.
        assert_eq!(r.scores[1], Some(-700.0));
        config.predicted_ttft.recall_weight = 0.0;
        let unpriced = PredictedTtft::new(&config);
        assert_eq!(
            unpriced.rank(&prompt, &[home.clone(), cold.clone()]).pick(),
            1,
            "unpriced"
        );
        // Another candidate holds the prefix: nothing to charge it, it wins on its hit.
        let holder = cached(3, 0, 0, 3000);
        let r = p.rank(&prompt, &[home.clone(), cold.clone(), holder]);
        assert_eq!(r.pick(), 2);
        assert_eq!(r.scores[2], Some(-100.0));
        // The home kept 1,000 of its 3,000: only the 2,000 lost are charged (200 ms).
        home.matched_tokens = 1000;
        home.held_tokens = 1000;
        let r = p.rank(&prompt, &[home.clone(), cold.clone()]);
        assert_eq!(r.scores[1], Some(-600.0));
        // A swamped home (1 s of queue) loses.
        let mut swamped = cached(1, 10, 10_000, 0);
        swamped.recalled_tokens = 3000;
        assert_eq!(p.rank(&prompt, &[swamped, cold]).pick(), 1);
    }

    #[test]
    fn near_ties_go_to_the_lighter_endpoint() {
        let p = policy();
        // Same prediction (nothing queued, nothing cached), different in-flight requests.
        let busy = cached(1, 5, 0, 0);
        let idle = cached(2, 0, 0, 0);
        for _ in 0..4 {
            assert_eq!(
                p.rank(&request(100), &[busy.clone(), idle.clone()]).pick(),
                1
            );
        }
    }

    #[test]
    fn saturated_endpoints_are_avoided_unless_all_are() {
        let p = policy();
        let mut holder = cached(1, 4, 0, 4000);
        holder.max_in_flight = Some(4);
        let cold = cached(2, 0, 0, 0);
        let r = p.rank(&request(4000), &[holder.clone(), cold.clone()]);
        assert_eq!(r.order, vec![1, 0]);
        assert_eq!(r.scores[0], None);
        let mut cold_full = cold;
        cold_full.max_in_flight = Some(0);
        let r = p.rank(&request(4000), &[holder, cold_full]);
        assert_eq!(r.pick(), 0, "all saturated: the best prediction wins");
    }

    proptest! {
        /// Always a full ranking; the pick has the lowest cost among eligible candidates (within
        /// the tie tolerance), and the cost is never below the prediction.
        #[test]
        fn pick_is_a_best_prediction(cands in proptest::collection::vec((0u64..20, 0u64..50_000, 0u64..8000, 1_000f64..50_000.0), 1..20), prompt in 1u64..8000) {
            let cands: Vec<CandidateView> = cands.iter().enumerate().map(|(i, &(r, t, m, s))| {
                let mut c = cached(i as u16 + 1, r, t, m.min(prompt));
                c.load.in_flight_prefilling = r / 2;
                c.prefill_tokens_per_s = s;
                c
            }).collect();
            let p = policy();
            let r = p.rank(&request(prompt), &cands);
            assert_permutation(&r, cands.len());
            let ttft = r.predicted_ttft_ms.clone().unwrap();
            let cost: Vec<f64> = r.scores.iter().map(|s| -s.unwrap()).collect();
            let best = cost.iter().copied().fold(f64::INFINITY, f64::min);
            prop_assert!(cost[r.pick()] <= best * (1.0 + 0.02) + 1e-6);
            prop_assert!(cost.iter().zip(&ttft).all(|(c, t)| c >= t));
        }
    }
}
