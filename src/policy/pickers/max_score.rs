//! Highest score first; equal scores broken by rotation or at random, so an idle fleet is spread
//! evenly instead of piling onto the first endpoint.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::policy::Picker;

/// How equal scores are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieBreak {
    /// A rotating offset: deterministic, even spread.
    Rotate,
    /// Uniformly at random (GIE's max-score picker).
    Random,
}

/// Orders by descending score with a tie-break.
#[derive(Debug)]
pub struct MaxScore {
    tie: TieBreak,
    next: AtomicUsize,
}

impl MaxScore {
    /// A picker with the given tie-break.
    pub fn new(tie: TieBreak) -> Self {
        Self {
            tie,
            next: AtomicUsize::new(0),
        }
    }
}

/// Scores closer than this are equal (absorbs float noise from weighted sums).
const EPSILON: f64 = 1e-9;

impl Picker for MaxScore {
    fn name(&self) -> &'static str {
        "max-score"
    }

    fn order(&self, scores: &[f64], eligible: &[usize]) -> Vec<usize> {
        let n = scores.len().max(1);
        let offset = match self.tie {
            TieBreak::Rotate => self.next.fetch_add(1, Ordering::Relaxed) % n,
            TieBreak::Random => rand::rng().random_range(0..n),
        };
        let mut order = eligible.to_vec();
        // Quantise so near-equal scores compare equal, then rotate ties by `offset`.
        let key = |i: usize| {
            let q = (scores[i] / EPSILON).round();
            (std::cmp::Reverse(q as i64), (i + n - offset) % n)
        };
        order.sort_by_key(|&i| key(i));
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_and_ties_rotate() {
        let p = MaxScore::new(TieBreak::Rotate);
        assert_eq!(p.order(&[0.2, 0.9, 0.5], &[0, 1, 2]), vec![1, 2, 0]);
        let firsts: Vec<usize> = (0..4)
            .map(|_| p.order(&[1.0, 1.0, 0.0, 1.0], &[0, 1, 3])[0])
            .collect();
        let mut distinct = firsts.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct, vec![0, 1, 3], "ties spread: {firsts:?}");
    }

    #[test]
    fn random_ties_only_pick_among_the_best() {
        let p = MaxScore::new(TieBreak::Random);
        for _ in 0..50 {
            let o = p.order(&[1.0, 0.1, 1.0], &[0, 1, 2]);
            assert_ne!(o[0], 1);
            assert_eq!(o[2], 1);
        }
    }
}
