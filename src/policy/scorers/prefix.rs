//! Scores the fraction of the prompt cached on each candidate (GIE's prefix-cache scorer).

use crate::policy::{CandidateView, RequestView, Scorer};

/// Matched fraction, 0..1.
#[derive(Debug, Default)]
pub struct PrefixScorer;

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn score(&self, request: &RequestView, candidates: &[CandidateView], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(candidates) {
            *o = c.matched_fraction(request);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{cached, request};

    #[test]
    fn fraction_of_the_prompt() {
        let mut out = [0.0; 2];
        PrefixScorer.score(
            &request(200),
            &[cached(1, 0, 0, 50), cached(2, 0, 0, 400)],
            &mut out,
        );
        assert_eq!(out, [0.25, 1.0]);
    }
}
