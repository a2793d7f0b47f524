//! The predicted room (`flow_control.room.mode: predicted`): how many requests an endpoint can
//! take now so that a request dispatched there waits, before its own prefill starts, no longer
//! than a budget tied to what the endpoint's typical request takes when it is idle.
//!
//! Why a budget in time and not thresholds in tokens or requests: a static room fits one fleet.
//! The flow bench (docs/flow-control.md) needed `max_prefill_tokens: 2100, max_waiting_requests:
//! 1` on its A100-class replicas with 2000-token prompts; the defaults (16384 tokens, 8 waiting)
//! let 8 prompts queue in each engine, where priority cannot reach, and critical TTFT p90 was
//! 7.75x its unloaded value. A wait measured in the endpoint's own time (the cost model's queue
//! wait: prefill tokens in flight over the learned speed, plus the running requests' slow-down
//! and the learned TTFT residual) and budgeted as a fraction of its typical request's idle TTFT
//! means the same on a slow GPU or a fast one, with short prompts or long ones. What is learned
//! (speed, residual, the typical prompt) is the feedback: an engine slower than predicted shows
//! a residual, the wait grows, and fewer requests fit.
//!
//! An endpoint with no request in prefill always has room for one: the queue never holds work
//! while an engine's prefill is idle, whatever the prediction says (a residual too high, a
//! budget too small for the prompts), so predicted room cannot starve a model. With a dispatch
//! lead, an endpoint whose one prompt in prefill is predicted to finish within the lead counts
//! as idle: the next prompt travels while the last one finishes, instead of after its first
//! byte came back to the router.

/// One endpoint as the predicted room sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointWait {
    /// Predicted wait before a new request's prefill starts there, ms (the cost model's
    /// `queue_ms`).
    pub queue_ms: f64,
    /// Requests routed there that have not produced a first byte yet.
    pub prefilling: u64,
    /// Predicted prefill left of the prompts routed there without a first byte, ms: their
    /// prefill at the learned speed less how long the head has been prefilling (never below 0).
    pub prefill_left_ms: f64,
    /// Prefill of the endpoint's typical request there, ms.
    pub typical_prefill_ms: f64,
    /// Fixed cost of every request (the cost model's `base_ms`), ms.
    pub base_ms: f64,
}

/// Most requests one endpoint is said to take at once: a bound for a budget far above a tiny
/// typical prefill (the queue re-checks after each dispatch anyway).
const MAX_SLOTS: u64 = 1024;

impl EndpointWait {
    /// How long a request may wait there, ms: with a TTFT target, the target less the typical
    /// request's idle TTFT; without, `max_ttft_factor - 1` times that idle TTFT.
    pub fn budget_ms(&self, max_ttft_factor: f64, ttft_target_ms: Option<u64>) -> f64 {
        let idle_ms = self.base_ms + self.typical_prefill_ms;
        match ttft_target_ms {
            Some(target) => target as f64 - idle_ms,
            None => (max_ttft_factor - 1.0) * idle_ms,
        }
    }

    /// Requests it can take now: those that, each adding a typical prefill to the wait, still
    /// start within the budget; at least one when nothing is in prefill there, or when its one
    /// prompt in prefill is predicted done within `lead_ms`.
    pub fn slots(&self, max_ttft_factor: f64, ttft_target_ms: Option<u64>, lead_ms: f64) -> u64 {
        let budget = self.budget_ms(max_ttft_factor, ttft_target_ms);
        let fit = if self.queue_ms.is_finite() && self.queue_ms <= budget {
            let each = self.typical_prefill_ms.max(1e-3);
            // Finite and >= 0 here; `as` saturates.
            (((budget - self.queue_ms) / each).floor() as u64).saturating_add(1)
        } else {
            0
        };
        let soon_idle = self.prefilling == 1 && lead_ms > 0.0 && self.prefill_left_ms <= lead_ms;
        let idle = u64::from(self.prefilling == 0 || soon_idle);
        fit.max(idle).min(MAX_SLOTS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(queue_ms: f64, prefilling: u64) -> EndpointWait {
        EndpointWait {
            queue_ms,
            prefilling,
            prefill_left_ms: queue_ms,
            typical_prefill_ms: 200.0,
            base_ms: 0.0,
        }
    }

    #[test]
    fn slots_follow_the_wait_against_the_budget() {
        // (queue ms, prefilling, factor, target) -> slots. A typical prefill of 200 ms.
        let cases = [
            // Idle apart from the running requests' 20 ms: under 1.5x (budget 100 ms) one fits.
            (20.0, 0, 1.5, None, 1),
            // One typical prompt ahead (200 ms plus 20): over the budget, none.
            (220.0, 1, 1.5, None, 0),
            // Half a prompt ahead: 100 ms is within 100 ms, one more.
            (100.0, 1, 1.5, None, 1),
            // A looser factor: 3x budgets 400 ms; with 20 ms ahead, 20 + 200k <= 400 for k = 0, 1.
            (20.0, 0, 3.0, None, 2),
            (220.0, 1, 3.0, None, 1),
            (420.0, 2, 3.0, None, 0),
            // A 1000 ms target budgets 800 ms: from 20 ms, four prompts start within it.
            (20.0, 0, 1.5, Some(1000), 4),
            (620.0, 3, 1.5, Some(1000), 1),
            // A target below the idle TTFT: only an idle endpoint takes one.
            (0.0, 0, 1.5, Some(100), 1),
            (0.0, 1, 1.5, Some(100), 0),
            // A huge learned residual: still one when nothing is in prefill (never starved).
            (5000.0, 0, 1.5, None, 1),
            (f64::INFINITY, 0, 1.5, None, 1),
            (f64::NAN, 1, 1.5, None, 0),
        ];
        for (queue_ms, prefilling, factor, target, want) in cases {
            let got = wait(queue_ms, prefilling).slots(factor, target, 0.0);
            assert_eq!(
                got, want,
                "queue {queue_ms} prefilling {prefilling} x{factor} {target:?}"
            );
        }
    }

    #[test]
    fn the_budget_scales_with_the_endpoints_own_time() {
        // The same state in the time of a GPU four times slower: the same slots.
        let fast = EndpointWait {
            queue_ms: 50.0,
            prefilling: 1,
            prefill_left_ms: 50.0,
            typical_prefill_ms: 100.0,
            base_ms: 10.0,
        };
        let slow = EndpointWait {
            queue_ms: 200.0,
            prefilling: 1,
            prefill_left_ms: 200.0,
            typical_prefill_ms: 400.0,
            base_ms: 40.0,
        };
        assert_eq!(fast.budget_ms(1.5, None), 55.0);
        assert_eq!(slow.budget_ms(1.5, None), 220.0);
        assert_eq!(fast.slots(1.5, None, 0.0), 1);
        assert_eq!(slow.slots(1.5, None, 0.0), 1);
        // A tiny typical prefill does not overflow: the count is bounded.
        let tiny = EndpointWait {
            typical_prefill_ms: 0.0,
            ..fast
        };
        assert_eq!(tiny.slots(1.5, Some(10_000), 0.0), MAX_SLOTS);
    }

    #[test]
    fn a_prompt_about_to_finish_lets_one_more_go_ahead() {
        // One 200 ms prompt in prefill, its wait (220 ms with the running requests) over the
        // 100 ms budget: no slot by the budget.
        let head = |left: f64, prefilling: u64| EndpointWait {
            queue_ms: 220.0,
            prefilling,
            prefill_left_ms: left,
            typical_prefill_ms: 200.0,
            base_ms: 0.0,
        };
        // (prefill left, prefilling, lead) -> slots.
        let cases = [
            // Without a lead only an idle endpoint takes one, however close the head is.
            (0.0, 1, 0.0, 0),
            (5.0, 1, 0.0, 0),
            // Within the lead: one, as if idle.
            (30.0, 1, 40.0, 1),
            (40.0, 1, 40.0, 1),
            (0.0, 1, 40.0, 1),
            // Further out than the lead: none yet.
            (41.0, 1, 40.0, 0),
            (200.0, 1, 40.0, 0),
            // One already went ahead (two without a first byte): no third, even when the
            // prediction says both are done (an engine slower than learned).
            (0.0, 2, 40.0, 0),
            // A NaN prediction is never "soon".
            (f64::NAN, 1, 40.0, 0),
        ];
        for (left, prefilling, lead, want) in cases {
            assert_eq!(
                head(left, prefilling).slots(1.5, None, lead),
                want,
                "left {left} prefilling {prefilling} lead {lead}"
            );
        }
        // The lead never takes a slot the budget gives: a looser factor still counts its own.
        assert_eq!(head(300.0, 1).slots(3.0, None, 40.0), 1);
    }
}
