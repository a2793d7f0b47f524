//! An up/down flag that flips only after consecutive results agree: the active probe's and the
//! scrape's view of an endpoint.

/// Up until `failure_threshold` consecutive failures; down until `success_threshold` consecutive
/// successes. Starts up: a new endpoint takes traffic until proven otherwise (a request that
/// finds it dead is retried on the next endpoint by Envoy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detector {
    up: bool,
    successes: u32,
    failures: u32,
}

impl Default for Detector {
    fn default() -> Self {
        Detector {
            up: true,
            successes: 0,
            failures: 0,
        }
    }
}

impl Detector {
    /// Whether the endpoint counts as up.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Records one result; returns the new state if it flipped.
    pub fn record(
        &mut self,
        ok: bool,
        failure_threshold: u32,
        success_threshold: u32,
    ) -> Option<bool> {
        if ok {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if !self.up && self.successes >= success_threshold.max(1) {
                self.up = true;
                return Some(true);
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.up && self.failures >= failure_threshold.max(1) {
                self.up = false;
                return Some(false);
            }
        }
        None
    }

    /// Back to up with no history (the check was turned off); returns `Some(true)` if it was down.
    pub fn reset(&mut self) -> Option<bool> {
        let was_up = self.up;
        *self = Detector::default();
        (!was_up).then_some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_only_after_consecutive_results() {
        // (results, expected flips after each)
        let cases: &[(&[bool], &[Option<bool>])] = &[
            (&[false, false, false], &[None, None, Some(false)]),
            (&[false, true, false, false], &[None, None, None, None]),
            (
                &[false, false, false, true, false, true, true],
                &[None, None, Some(false), None, None, None, Some(true)],
            ),
        ];
        for (results, flips) in cases {
            let mut d = Detector::default();
            let got: Vec<Option<bool>> = results.iter().map(|&ok| d.record(ok, 3, 2)).collect();
            assert_eq!(&got, flips, "{results:?}");
        }
        let mut d = Detector::default();
        for _ in 0..3 {
            d.record(false, 3, 2);
        }
        assert!(!d.is_up());
        assert_eq!(d.reset(), Some(true));
        assert!(d.is_up());
        assert_eq!(d.reset(), None);
    }
}
