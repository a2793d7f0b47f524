//! The time-to-first-token cost model behind `predicted-ttft`.
//!
//! For a request on candidate endpoint `e`:
//!
//! ```text
//! ttft(e) = base_ms
//!         + queue_wait(e)                       work ahead of it on e
//!         + uncached_tokens(e) / prefill_speed(e) its own prefill, minus what e has cached
//! queue_wait(e) = prefill tokens in flight on e / prefill_speed(e)
//!                 (less how long the first of them has run, with `prefill_progress`)
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
//!
//! # Prefixes in slower tiers
//!
//! An engine with an offload tier (vLLM's `OffloadingConnector`, LMCache) keeps blocks that
//! left GPU memory in CPU memory, on disk or in a remote store, and its KV events say where
//! (`medium`). A request whose prefix is there is served by loading those blocks back: the
//! engine looks up the GPU first, then the tier for the blocks after the GPU hit, and loads
//! every consecutive tier hit (vLLM's scheduler asks the connector for
//! `get_num_new_matched_tokens` and falls back to recomputing only when a load fails or times
//! out); it does not weigh the load against recomputing. So on a candidate the tier tokens
//! cost their load time, and the choice between loading and recomputing is the router's: send
//! the request to the holder (load) or elsewhere (recompute, at that candidate's speed):
//!
//! ```text
//! ttft(e) = base_ms + queue_wait(e) + compute_tokens(e) / prefill_speed(e) + load_ms(e)
//! compute_tokens(e) = prompt - tokens held on e in any tier
//! load_ms(e) = sum over tiers t holding part of the prefix on e only:
//!              latency_ms(t) + tokens(t) * kv_bytes_per_token / bandwidth(t)
//! ```
//!
//! A flat weight per medium (`kv_events.medium_weights`, cpu 0.8: a CPU token costs a fifth
//! of its recompute) cannot be right on both sides of a fleet. Llama-3.1-8B's KV is 128 KiB a
//! token; at 20 GB/s (PCIe 4.0 x16 in practice) a token loads in 6.6 us, at 3 GB/s (NVMe)
//! in 44 us, at 1 GB/s (a remote store on a loaded 10 GbE link) in 131 us. Recomputing costs
//! 330 us a token on an L4 (~3k tokens/s), 100 us on an A100, 32 us on an H100. So a 6,000-token
//! prefix on NVMe saves an L4 1.7 s (0.26 s to load against 2 s to recompute) and costs an H100
//! 70 ms more than recomputing it (0.26 s against 0.19 s); a remote store at 1 GB/s loses to
//! recomputing even on an A100 (0.52 s against 0.40 s for 4,000 tokens), which the weight
//! (`other` 0.5) would still count as half cached. The tests below are these cases.
//!
//! The load moves bytes over the host link while the GPU computes other requests' steps
//! (vLLM's loads are asynchronous DMA: the request waits, the batch does not), so it delays
//! only this request: the externality and eviction terms charge the compute only.

use super::{CandidateView, RequestView};
use crate::config::{OffloadPricing, PredictedTtftConfig};

/// One candidate's predicted time to first token, with its parts (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Waiting for work already on the endpoint (the learned residual included).
    pub queue_ms: f64,
    /// Prefilling this request's uncached tokens.
    pub prefill_ms: f64,
    /// Loading the prefix tokens held only in slower tiers back into GPU memory (0 under
    /// `medium-weights` pricing).
    pub load_ms: f64,
    /// The learned residual included in `queue_ms`.
    pub residual_ms: f64,
    /// The total, `base_ms + queue_ms + prefill_ms + load_ms`.
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
    /// How prefix tokens held only in slower tiers are priced.
    pub offload_pricing: OffloadPricing,
}

impl From<&PredictedTtftConfig> for CostModel {
    fn from(c: &PredictedTtftConfig) -> Self {
        CostModel {
            base_ms: c.base_ms,
            running_request_ms: c.running_request_ms,
            waiting_request_ms: c.waiting_request_ms,
            externality_weight: c.externality_weight,
            eviction_weight: c.eviction_weight,
            offload_pricing: c.offload_pricing,
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
        let done_ms = c.load.prefill_head_elapsed_us as f64 / 1e3;
        (self.prefill_ms(c.load.in_flight_prefill_tokens, c) - done_ms).max(0.0)
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

    /// Prompt tokens `c` must compute for `request`: under `load-time` pricing those it holds
    /// in no tier; under `medium-weights` those its weighted match leaves.
    pub fn compute_tokens(&self, request: &RequestView, c: &CandidateView) -> u64 {
        match self.offload_pricing {
            OffloadPricing::LoadTime => request
                .prompt_tokens
                .saturating_sub(c.held_tokens.max(c.matched_tokens)),
            OffloadPricing::MediumWeights => c.uncached_tokens(request),
        }
    }

    /// Time `c` takes to load the prefix tokens it holds only in slower tiers, ms (0 under
    /// `medium-weights` pricing, which discounts them instead).
    pub fn load_ms(&self, c: &CandidateView) -> f64 {
        match self.offload_pricing {
            OffloadPricing::LoadTime => c.offloaded.iter().map(|t| t.load_ms()).sum(),
            OffloadPricing::MediumWeights => 0.0,
        }
    }

    /// The predicted TTFT of `request` on `c`.
    pub fn predict(&self, request: &RequestView, c: &CandidateView) -> Prediction {
        let queue_ms = self.queue_ms(c);
        let prefill_ms = self.prefill_ms(self.compute_tokens(request, c), c);
        let load_ms = self.load_ms(c);
        let ttft_ms = self.base_ms + queue_ms + prefill_ms + load_ms;
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
            load_ms,
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
            offload_pricing: OffloadPricing::LoadTime,
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
            offload_pricing: OffloadPricing::LoadTime,
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
            offload_pricing: OffloadPricing::LoadTime,
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
            offload_pricing: OffloadPricing::LoadTime,
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

    #[test]
    fn the_head_prompts_progress_shortens_the_wait_it_is_given() {
        let model = pricing(OffloadPricing::LoadTime);
        // Two endpoints each prefilling one 2000-token prompt at 10k tokens/s (200 ms); one has
        // run it for 150 ms. Without the progress (0, as the view carries it by default) they
        // look alike; with it the one nearly done waits 50 ms.
        let mut fresh = cached(1, 1, 2000, 0);
        fresh.load.in_flight_prefilling = 1;
        let mut along = cached(2, 1, 2000, 0);
        along.load.in_flight_prefilling = 1;
        assert_eq!(model.queue_ms(&fresh), model.queue_ms(&along));
        along.load.prefill_head_elapsed_us = 150_000;
        assert_eq!(
            (model.queue_ms(&fresh), model.queue_ms(&along)),
            (200.0, 50.0)
        );
        let p = model.predict(&request(2000), &along);
        assert_eq!((p.queue_ms, p.ttft_ms), (50.0, 250.0));
        // A head that ran past its prediction leaves no negative wait.
        along.load.prefill_head_elapsed_us = 900_000;
        assert_eq!(model.queue_ms(&along), 0.0);
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
            offload_pricing: OffloadPricing::LoadTime,
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
            offload_pricing: OffloadPricing::LoadTime,
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

    /// Llama-3.1-8B's KV per token, bytes.
    const KV: f64 = 131_072.0;

    fn tier(tokens: u64, gb_per_s: f64, latency_ms: f64) -> crate::policy::TierHold {
        crate::policy::TierHold {
            tokens,
            bytes_per_token: KV,
            bytes_per_s: gb_per_s * 1e9,
            latency_ms,
        }
    }

    /// A candidate prefilling `speed` tokens/s that holds `cpu` prefix tokens only in CPU
    /// memory and `other` only on slower media, at those bandwidths (GB/s), with matched
    /// tokens weighted as `kv_events.medium_weights`' defaults (0.8, 0.5) would count them.
    fn offloaded(port: u16, speed: f64, cpu: (u64, f64), other: (u64, f64)) -> CandidateView {
        let mut c = crate::policy::testing::held(port, 0, 0, cpu.0 + other.0);
        c.matched_tokens = (cpu.0 as f64 * 0.8 + other.0 as f64 * 0.5) as u64;
        c.offloaded = [tier(cpu.0, cpu.1, 1.0), tier(other.0, other.1, 5.0)];
        c.prefill_tokens_per_s = speed;
        c
    }

    fn cold(port: u16, speed: f64) -> CandidateView {
        let mut c = cached(port, 0, 0, 0);
        c.prefill_tokens_per_s = speed;
        c
    }

    fn pricing(offload_pricing: OffloadPricing) -> CostModel {
        CostModel {
            base_ms: 0.0,
            running_request_ms: 0.0,
            waiting_request_ms: 0.0,
            externality_weight: 0.0,
            eviction_weight: 0.0,
            offload_pricing,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 0.1
    }

    /// An 8,000-token prompt whose first 6,000 tokens sit on one replica's NVMe (3 GB/s: 44 us
    /// a token, 262 ms + 5 ms), beside an idle replica that holds nothing. On L4-class GPUs
    /// (3,000 tokens/s) loading saves 1.7 s; on H100-class ones (40,000 tokens/s) recomputing
    /// everything elsewhere (200 ms) beats loading (267 ms + 50 ms for the rest). A flat
    /// weight (0.5 for a slow medium) sends it to the holder on both.
    #[test]
    fn a_prefix_on_disk_beats_recomputing_on_a_slow_gpu_but_not_on_a_fast_one() {
        let model = pricing(OffloadPricing::LoadTime);
        let flat = pricing(OffloadPricing::MediumWeights);
        let prompt = request(8000);
        for (speed, holder_ms, cold_ms, holder_wins) in [
            (3_000.0, 5.0 + 262.1 + 666.7, 2666.7, true),
            (40_000.0, 5.0 + 262.1 + 50.0, 200.0, false),
        ] {
            let holder = offloaded(1, speed, (0, 20.0), (6000, 3.0));
            let other = cold(2, speed);
            let (h, c) = (
                model.predict(&prompt, &holder),
                model.predict(&prompt, &other),
            );
            assert!(close(h.load_ms, 267.1), "{h:?}");
            assert!(
                close(h.ttft_ms, holder_ms) && close(c.ttft_ms, cold_ms),
                "{h:?} {c:?}"
            );
            assert_eq!(h.ttft_ms < c.ttft_ms, holder_wins, "at {speed} tokens/s");
            // The weight counts 3,000 of the 6,000 tokens as cached and charges no transfer.
            let (fh, fc) = (
                flat.predict(&prompt, &holder),
                flat.predict(&prompt, &other),
            );
            assert_eq!(fh.load_ms, 0.0);
            assert!(
                fh.ttft_ms < fc.ttft_ms,
                "the flat weight picks the holder at {speed}"
            );
        }
    }

    /// 4,000 prefix tokens of a 4,100-token prompt on an A100-class replica (10,000 tokens/s):
    /// from CPU memory at 20 GB/s they load in 27 ms, from a remote store at 1 GB/s in 529 ms,
    /// longer than recomputing the whole prompt on an idle replica (410 ms).
    #[test]
    fn a_slow_remote_tier_loses_to_recomputing() {
        let model = pricing(OffloadPricing::LoadTime);
        let prompt = request(4100);
        let other = cold(3, 10_000.0);
        let in_cpu = offloaded(1, 10_000.0, (4000, 20.0), (0, 1.0));
        let remote = offloaded(2, 10_000.0, (0, 20.0), (4000, 1.0));
        let [c, r, o] = [&in_cpu, &remote, &other].map(|x| model.predict(&prompt, x));
        assert!(close(c.ttft_ms, 1.0 + 26.2 + 10.0), "{c:?}");
        assert!(close(r.ttft_ms, 5.0 + 524.3 + 10.0), "{r:?}");
        assert!(close(o.ttft_ms, 410.0));
        assert!(c.ttft_ms < o.ttft_ms && o.ttft_ms < r.ttft_ms);
        // Both tiers at once: the prefix's part in each loads at that tier's speed.
        let both = offloaded(4, 10_000.0, (2000, 20.0), (2000, 1.0));
        let b = model.predict(&prompt, &both);
        assert!(close(b.load_ms, 1.0 + 13.1 + 5.0 + 262.1), "{b:?}");
        assert_eq!(model.compute_tokens(&prompt, &both), 100);
    }

    /// The load delays only the request itself (the GPU computes other requests meanwhile):
    /// with four requests queued, the holder's cost adds the delay of its 100-token prefill
    /// behind it, not of its 262 ms of loading; the cold replica's adds its whole prefill.
    #[test]
    fn loading_charges_no_one_queued_behind() {
        let mut model = pricing(OffloadPricing::LoadTime);
        model.externality_weight = 1.0;
        let prompt = request(4100);
        let mut holder = offloaded(1, 10_000.0, (0, 20.0), (4000, 2.0));
        holder.load.in_flight_prefilling = 4;
        let mut other = cold(2, 10_000.0);
        other.load.in_flight_prefilling = 4;
        let (h, c) = (
            model.predict(&prompt, &holder),
            model.predict(&prompt, &other),
        );
        assert!(close(h.load_ms, 5.0 + 262.1));
        assert!(close(h.externality_ms, 10.0 * 4.0), "{h:?}");
        assert!(close(c.externality_ms, 410.0 * 4.0), "{c:?}");
        assert!(h.cost_ms < c.cost_ms);
    }
}
