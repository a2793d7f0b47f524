//! Excludes endpoints at their configured concurrency limit (`max_in_flight`).

use crate::policy::{CandidateView, Filter, RequestView};

/// Keeps a candidate while its in-flight requests are below its `max_in_flight`.
#[derive(Debug, Default)]
pub struct Saturation;

impl Filter for Saturation {
    fn name(&self) -> &'static str {
        "saturation"
    }

    fn keep(&self, _request: &RequestView, c: &CandidateView) -> bool {
        c.max_in_flight
            .is_none_or(|limit| c.load.in_flight_requests < u64::from(limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;

    #[test]
    fn keeps_below_limit_only() {
        let mut c = candidate(1, 3, 0);
        assert!(Saturation.keep(&RequestView::default(), &c));
        c.max_in_flight = Some(4);
        assert!(Saturation.keep(&RequestView::default(), &c));
        c.max_in_flight = Some(3);
        assert!(!Saturation.keep(&RequestView::default(), &c));
    }
}
