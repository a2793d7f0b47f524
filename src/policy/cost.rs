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
//! ```
//!
//! "Prefill tokens in flight" are the uncached prompt tokens of requests routed to `e` that have
//! not produced a first token yet: the prefill work the engine must finish first (FCFS).
//! Requests already decoding slow each engine step a little (`running_request_ms` each). Speeds
//! are per endpoint, so unequal GPUs are compared fairly. The design's worked example is the
//! test below.

use super::{CandidateView, RequestView};
use crate::config::PredictedTtftConfig;

/// One candidate's predicted time to first token, with its parts (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Waiting for work already on the endpoint.
    pub queue_ms: f64,
    /// Prefilling this request's uncached tokens.
    pub prefill_ms: f64,
    /// The total, `base_ms + queue_ms + prefill_ms`.
    pub ttft_ms: f64,
}

/// The cost model's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed time per request, ms.
    pub base_ms: f64,
    /// Slow-down per request running on the endpoint, ms.
    pub running_request_ms: f64,
}

impl From<&PredictedTtftConfig> for CostModel {
    fn from(c: &PredictedTtftConfig) -> Self {
        CostModel {
            base_ms: c.base_ms,
            running_request_ms: c.running_request_ms,
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

    /// Time the work already on `c` takes before this request's prefill starts, ms.
    pub fn queue_ms(&self, c: &CandidateView) -> f64 {
        self.prefill_ms(c.load.in_flight_prefill_tokens, c)
            + self.running_request_ms * Self::running(c)
    }

    /// The predicted TTFT of `request` on `c`.
    pub fn predict(&self, request: &RequestView, c: &CandidateView) -> Prediction {
        let queue_ms = self.queue_ms(c);
        let prefill_ms = self.prefill_ms(c.uncached_tokens(request), c);
        Prediction {
            queue_ms,
            prefill_ms,
            ttft_ms: self.base_ms + queue_ms + prefill_ms,
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
    }
}
