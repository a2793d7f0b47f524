//! The vLLM production stack router's QPS fallback (`_qps_routing`): the endpoint that has
//! been sent the fewest requests in the last `window` (its `--request-stats-window`, default
//! 60 s); an endpoint never sent anything comes first (the first such in candidate order);
//! ties go to the first in candidate order. The router counts every request it routes, so this
//! meter is fed by every decision of the policy that owns it.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::CandidateView;

/// The production stack's sliding-window QPS in-memory: decision times per endpoint.
#[derive(Debug)]
pub struct QpsMeter {
    window: Duration,
    sent: HashMap<SocketAddr, VecDeque<Instant>>,
}

impl Default for QpsMeter {
    fn default() -> Self {
        QpsMeter::new(Duration::from_secs(60))
    }
}

impl QpsMeter {
    /// A meter over `window`.
    pub fn new(window: Duration) -> QpsMeter {
        QpsMeter {
            window,
            sent: HashMap::new(),
        }
    }

    /// Counts a request sent to `address` at `now`.
    pub fn record(&mut self, now: Instant, address: SocketAddr) {
        let q = self.sent.entry(address).or_default();
        q.push_back(now);
        Self::expire(q, now, self.window);
    }

    fn expire(q: &mut VecDeque<Instant>, now: Instant, window: Duration) {
        while q
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) > window)
        {
            q.pop_front();
        }
    }

    /// Requests per second sent to `address` over the window, `None` if never sent any.
    pub fn qps(&mut self, now: Instant, address: &SocketAddr) -> Option<f64> {
        let q = self.sent.get_mut(address)?;
        Self::expire(q, now, self.window);
        Some(q.len() as f64 / self.window.as_secs_f64().max(1e-9))
    }

    /// The index of the candidate the production stack's QPS routing picks.
    pub fn lowest(&mut self, now: Instant, candidates: &[CandidateView]) -> usize {
        let mut best = (f64::INFINITY, 0);
        for (i, c) in candidates.iter().enumerate() {
            match self.qps(now, &c.address) {
                None => return i,
                Some(q) if q < best.0 => best = (q, i),
                Some(_) => {}
            }
        }
        best.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;

    #[test]
    fn never_sent_first_then_the_lowest_rate_in_the_window() {
        let mut m = QpsMeter::new(Duration::from_secs(60));
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0), candidate(3, 0, 0)];
        let t0 = Instant::now();
        assert_eq!(m.lowest(t0, &cands), 0);
        m.record(t0, cands[0].address);
        m.record(t0, cands[0].address);
        assert_eq!(m.lowest(t0, &cands), 1, "never sent anything");
        m.record(t0, cands[1].address);
        m.record(t0, cands[2].address);
        assert_eq!(m.lowest(t0, &cands), 1, "ties: the first");
        assert_eq!(m.qps(t0, &cands[0].address), Some(2.0 / 60.0));
        // 61 s later the first two requests have left the window; an empty window still
        // counts as "sent before" (rate 0), and 0 < 1/60.
        let later = t0 + Duration::from_secs(61);
        m.record(later, cands[1].address);
        m.record(later, cands[2].address);
        assert_eq!(m.qps(later, &cands[0].address), Some(0.0));
        assert_eq!(m.lowest(later, &cands), 0);
    }
}
