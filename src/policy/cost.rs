//! The time-to-first-token cost model behind `predicted-ttft`.
//!
//! For a request on candidate endpoint `e`:
//!
//! ```text
//! ttft(e) = base_ms
//!         + queue_wait(e)                       work ahead of it on e
//!         + uncached_tokens(e) / prefill_speed(e) its own prefill, minus what e has cached
//! queue_wait(e) = prefill tokens in flight on e / prefill_speed(e)
//!               + running_request_ms * requests running on e
//!               + waiting_request_ms * hidden requests waiting in e's engine queue
//!               + ttft_residual(e)                 learned: how much slower than predicted e is
//! ```
//!
//! "Prefill tokens in flight" are the uncached prompt tokens of requests routed to `e` that have
//! not produced a first token yet: the prefill work the engine must finish first (FCFS).
//! Requests already decoding slow each engine step a little (`running_request_ms` each).
//! "Hidden" waiting requests are those in the engine's scraped queue beyond the ones the router
//! routed there and still awaits a first byte of (traffic that bypassed the router); each costs
//! `waiting_request_ms`. Speeds are per endpoint (configured or learned), so unequal GPUs are
//! compared fairly. The design's worked example is the test below.
//!
//! The policy ranks by a cost, not by the prediction alone:
//!
//! ```text
//! cost(e) = ttft(e) + externality_weight * prefill_ms(e) * delayed(e)
//!                   + eviction_weight * prefill_ms(e)
//! delayed(e) = queue_len(e) + arrivals_per_s(e) * prefill_ms(e) / 1000
//! ```
//!
//! Minimising each request's own TTFT is greedy: the replica holding a prefix usually has some
//! work in hand, a cold replica looks as fast or a little faster, the request goes there and
//! its whole prompt is recomputed. That recomputation delays every request that waits behind
//! it; the fleet spends its capacity recomputing prefixes (and its KV on duplicates) and under
//! load the queues run away (the benchmark's shared-prefix workload shows it). The second term
//! charges that delay: the request's own prefill time times the requests expected to wait
//! behind it, those queued there now (in a steady state, the queue an arrival finds is the
//! queue that builds behind it) plus those that arrive there while it prefills (the model's
//! recent request rate spread over its candidates). An idle fleet has neither, so the cost is
//! the prediction; a busy one keeps prefixes where they are cached unless the holder's queue
//! outweighs the recomputation everyone else would pay for.
//!
//! The third term prices what a cold prefill does to the cache. A warm engine's KV cache is full
//! and evicts least recently used blocks, so each uncached token computed on `e` pushes out a
//! cached one; with probability `eviction_weight` a later request would have hit it and now
//! recomputes it. On an idle fleet neither queue term sees a copy of a prefix on a cold replica
//! as costly (its TTFT ties with the holder's, the tie goes to the lighter one), yet on small
//! caches each copy evicts other groups' prefixes: the recorded decisions of issue 13 show the
//! hit-rate gap to `prefix-affinity` coming from such copies and the misses they caused later.

use super::{CandidateView, RequestView};
use crate::config::PredictedTtftConfig;

/// One candidate's predicted time to first token, with its parts (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Waiting for work already on the endpoint (the learned residual included).
    pub queue_ms: f64,
    /// Prefilling this request's uncached tokens.
    pub prefill_ms: f64,
    /// The learned residual included in `queue_ms`.
    pub residual_ms: f64,
    /// The total, `base_ms + queue_ms + prefill_ms`.
    pub ttft_ms: f64,
    /// The delay this request's prefill imposes on the requests expected to wait behind it,
    /// weighted (`externality_weight * prefill_ms * delayed requests`).
    pub externality_ms: f64,
    /// The recompute of the cached tokens this request's prefill evicts, weighted
    /// (`eviction_weight * prefill_ms`).
    pub eviction_ms: f64,
    /// What the policy minimises: `ttft_ms + externality_ms + eviction_ms`.
    pub cost_ms: f64,
}

/// The cost model's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed time per request, ms.
    pub base_ms: f64,
    /// Slow-down per request running on the endpoint, ms.
    pub running_request_ms: f64,
    /// Wait per hidden request queued in the engine (scraped, when fresh), ms.
    pub waiting_request_ms: f64,
    /// Weight of the delay imposed on the requests queued behind (0: greedy TTFT).
    pub externality_weight: f64,
    /// Weight of the cached tokens a prefill evicts (0: unpriced).
    pub eviction_weight: f64,
}

impl From<&PredictedTtftConfig> for CostModel {
    fn from(c: &PredictedTtftConfig) -> Self {
        CostModel {
            base_ms: c.base_ms,
            running_request_ms: c.running_request_ms,
            waiting_request_ms: c.waiting_request_ms,
            externality_weight: c.externality_weight,
            eviction_weight: c.eviction_weight,
        }
    }
}

impl CostModel {
    /// Requests running on `c`: the engine's count when fresh, else the router's in-flight
    /// requests.
    fn running(c: &CandidateView) -> f64 {
        c.engine
            .map_or(c.load.in_flight_requests, |e| e.running_requests) as f64
    }

    /// Time to prefill `tokens` on `c`, ms.
    pub fn prefill_ms(&self, tokens: u64, c: &CandidateView) -> f64 {
        tokens as f64 / c.prefill_tokens_per_s.max(1e-9) * 1e3
    }

    /// The costs that do not depend on prefill speed: the base and the slow-down of running
    /// requests, ms. (What a first-byte time is corrected by before it becomes a speed sample.)
    pub fn fixed_ms(&self, c: &CandidateView) -> f64 {
        self.base_ms + self.running_request_ms * Self::running(c)
    }

    /// Requests in the engine's queue that the router does not know of (scraped, when fresh).
    fn hidden_waiting(c: &CandidateView) -> f64 {
        c.engine.map_or(0, |e| {
            e.waiting_requests
                .saturating_sub(c.load.in_flight_prefilling)
        }) as f64
    }

    /// Requests waiting for prefill on `c`: the router's own not-yet-answered requests, or the
    /// engine's queue when it is longer (and fresh).
    pub fn queue_len(c: &CandidateView) -> f64 {
        let engine = c.engine.map_or(0, |e| e.waiting_requests);
        c.load.in_flight_prefilling.max(engine) as f64
    }

    /// Time the work already on `c` takes before this request's prefill starts, ms.
    pub fn queue_ms(&self, c: &CandidateView) -> f64 {
        self.prefill_ms(c.load.in_flight_prefill_tokens, c)
            + self.running_request_ms * Self::running(c)
            + self.waiting_request_ms * Self::hidden_waiting(c)
            + Self::residual(c)
    }

    fn residual(c: &CandidateView) -> f64 {
        if c.ttft_residual_ms.is_finite() {
            c.ttft_residual_ms.max(0.0)
        } else {
            0.0
        }
    }

    /// The predicted TTFT of `request` on `c`.
    pub fn predict(&self, request: &RequestView, c: &CandidateView) -> Prediction {
        let queue_ms = self.queue_ms(c);
        let prefill_ms = self.prefill_ms(c.uncached_tokens(request), c);
        let ttft_ms = self.base_ms + queue_ms + prefill_ms;
        let arrivals = if request.arrivals_per_endpoint_s.is_finite() {
            request.arrivals_per_endpoint_s.max(0.0) * prefill_ms / 1e3
        } else {
            0.0
        };
        let externality_ms = self.externality_weight * prefill_ms * (Self::queue_len(c) + arrivals);
        let eviction_ms = self.eviction_weight * prefill_ms;
        Prediction {
            queue_ms,
            prefill_ms,
            residual_ms: Self::residual(c),
            ttft_ms,
            externality_ms,
            eviction_ms,
            cost_ms: ttft_ms + externality_ms + eviction_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{cached, request};

    /// The worked example of `../shared/DESIGN.md`: a 4,000-token prompt; A holds 3,000 of its
    /// prefix tokens and has 220 ms of queue, B holds nothing and has 20 ms; uncached prefill of
    /// 4,000 tokens costs 400 ms (10,000 tokens/s).
    #[test]
    fn design_worked_example() {
        let model = CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 0.0,
            externality_weight: 0.0,
            eviction_weight: 0.0,
        };
        let prompt = request(4000);
        // 220 ms of queue at 10 tokens/ms is 2,200 prefill tokens ahead; 20 ms is 200.
        let a = cached(1, 3, 2200, 3000);
        let b = cached(2, 1, 200, 0);
        let (pa, pb) = (model.predict(&prompt, &a), model.predict(&prompt, &b));
        assert_eq!(
            (pa.queue_ms, pa.prefill_ms, pa.ttft_ms),
            (220.0, 100.0, 320.0)
        );
        assert_eq!(
            (pb.queue_ms, pb.prefill_ms, pb.ttft_ms),
            (20.0, 400.0, 420.0)
        );
        assert!(pa.ttft_ms < pb.ttft_ms, "route to A");

        // A's queue grows to 400 ms: A = 500 ms and B wins.
        let a_busier = cached(1, 3, 4000, 3000);
        let pa = model.predict(&prompt, &a_busier);
        assert_eq!(pa.ttft_ms, 500.0);
        assert!(pb.ttft_ms < pa.ttft_ms, "route to B");
    }

    #[test]
    fn unequal_gpus_are_compared_by_their_own_speed() {
        let model = CostModel {
            base_ms: 5.0,
            running_request_ms: 1.0,
            waiting_request_ms: 100.0,
            externality_weight: 0.0,
            eviction_weight: 0.0,
        };
        let mut fast = cached(1, 2, 0, 0);
        fast.prefill_tokens_per_s = 30_000.0;
        let slow = cached(2, 2, 0, 0);
        let p = request(3000);
        assert_eq!(model.predict(&p, &fast).ttft_ms, 5.0 + 2.0 + 100.0);
        assert_eq!(model.predict(&p, &slow).ttft_ms, 5.0 + 2.0 + 300.0);
        // The engine's running count replaces ours when fresh.
        let mut scraped = slow.clone();
        scraped.engine = Some(crate::policy::EngineLoad {
            running_requests: 10,
            ..Default::default()
        });
        assert_eq!(model.predict(&p, &scraped).queue_ms, 10.0);
        assert_eq!(model.fixed_ms(&scraped), 15.0);
    }

    #[test]
    fn a_hidden_engine_queue_and_the_learned_residual_make_a_holder_look_as_slow_as_it_is() {
        let model = CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 100.0,
            externality_weight: 0.0,
            eviction_weight: 0.0,
        };
        let prompt = request(4000);
        // The holder saves 300 ms of prefill, but its engine queues 4 requests for batch slots
        // that the router's token count (0 here) does not show.
        let mut holder = cached(1, 0, 0, 3000);
        let cold = cached(2, 0, 0, 0);
        assert!(model.predict(&prompt, &holder).ttft_ms < model.predict(&prompt, &cold).ttft_ms);
        holder.engine = Some(crate::policy::EngineLoad {
            waiting_requests: 4,
            ..Default::default()
        });
        let p = model.predict(&prompt, &holder);
        assert_eq!((p.queue_ms, p.ttft_ms), (400.0, 500.0));
        assert!(
            p.ttft_ms > model.predict(&prompt, &cold).ttft_ms,
            "route to the cold one"
        );
        // Stale signals: no queue term; the learned residual still counts, never negatively.
        holder.engine = None;
        holder.ttft_residual_ms = 350.0;
        let p = model.predict(&prompt, &holder);
        assert_eq!(
            (p.queue_ms, p.residual_ms, p.ttft_ms),
            (350.0, 350.0, 450.0)
        );
        holder.ttft_residual_ms = -80.0;
        assert_eq!(model.predict(&prompt, &holder).ttft_ms, 100.0);
    }

    #[test]
    fn only_engine_queue_the_router_does_not_know_of_costs_waiting_request_ms() {
        let model = CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 100.0,
            externality_weight: 1.0,
            eviction_weight: 0.0,
        };
        // The router awaits first bytes of 3 requests (600 tokens) there; the engine queues 5.
        let mut c = cached(1, 3, 600, 0);
        c.load.in_flight_prefilling = 3;
        c.engine = Some(crate::policy::EngineLoad {
            waiting_requests: 5,
            ..Default::default()
        });
        let p = model.predict(&request(1000), &c);
        // 60 ms of known prefill + 2 hidden requests; the request's own 100 ms of prefill
        // delays the 5 queued.
        assert_eq!((p.queue_ms, p.prefill_ms, p.ttft_ms), (260.0, 100.0, 360.0));
        assert_eq!((p.externality_ms, p.cost_ms), (500.0, 860.0));
        // The router knows of more than the engine queues (some are prefilling): none hidden.
        c.load.in_flight_prefilling = 7;
        let p = model.predict(&request(1000), &c);
        assert_eq!((p.queue_ms, p.externality_ms), (60.0, 700.0));
    }

    /// Requests that arrive while a prefill runs wait behind it too: at 10 requests per second
    /// per endpoint, a 400 ms cold prefill delays 4 of them, a 100 ms one 1.
    #[test]
    fn arrivals_during_the_prefill_count_as_delayed() {
        let model = CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 0.0,
            externality_weight: 1.0,
            eviction_weight: 0.0,
        };
        let mut prompt = request(4000);
        let holder = cached(1, 0, 0, 3000);
        let cold = cached(2, 0, 0, 0);
        assert_eq!(
            model.predict(&prompt, &cold).cost_ms,
            400.0,
            "no traffic: the prediction"
        );
        prompt.arrivals_per_endpoint_s = 10.0;
        let (h, c) = (
            model.predict(&prompt, &holder),
            model.predict(&prompt, &cold),
        );
        assert_eq!((h.externality_ms, h.cost_ms), (100.0, 200.0));
        assert_eq!((c.externality_ms, c.cost_ms), (1600.0, 2000.0));
        prompt.arrivals_per_endpoint_s = f64::NAN;
        assert_eq!(
            model.predict(&prompt, &cold).cost_ms,
            400.0,
            "ignored when not a number"
        );
    }

    /// An idle fleet: a follower of a prefix that is still prefilling on its holder predicts the
    /// same TTFT there (wait for the leader, then its own question) as cold anywhere else; only
    /// the eviction term says the copy costs other prefixes their cached blocks.
    #[test]
    fn a_copy_on_a_cold_replica_pays_for_what_it_evicts() {
        let mut model = CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 0.0,
            externality_weight: 1.0,
            eviction_weight: 0.0,
        };
        let prompt = request(1800);
        // The holder is prefilling the leader's 1,650 tokens; the follower adds 150.
        let mut holder = cached(1, 1, 1650, 1650);
        holder.load.in_flight_prefilling = 1;
        let cold = cached(2, 0, 0, 0);
        let (h, c) = (
            model.predict(&prompt, &holder),
            model.predict(&prompt, &cold),
        );
        assert_eq!((h.ttft_ms, c.ttft_ms), (180.0, 180.0), "a tie");
        // The leader counts as delayed by the follower (the queue ahead stands in for the one
        // behind), so without the eviction term the copy wins.
        assert_eq!((h.cost_ms, c.cost_ms), (195.0, 180.0));
        model.eviction_weight = 0.5;
        let (h, c) = (
            model.predict(&prompt, &holder),
            model.predict(&prompt, &cold),
        );
        assert_eq!((h.eviction_ms, c.eviction_ms), (7.5, 90.0));
        assert_eq!(
            (h.ttft_ms, c.ttft_ms),
            (180.0, 180.0),
            "predictions unchanged"
        );
        assert_eq!(
            (h.cost_ms, c.cost_ms),
            (202.5, 270.0),
            "keep the prefix where it is"
        );
    }
}
