//! An exponentially weighted moving average that knows how many samples it has seen.

/// `value ← value + alpha × (sample − value)`; the first sample is taken as is.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ewma {
    value: f64,
    samples: u64,
}

impl Ewma {
    /// Adds a sample with weight `alpha` (0 < alpha <= 1). Non-finite samples are ignored.
    pub fn add(&mut self, sample: f64, alpha: f64) {
        if !sample.is_finite() {
            return;
        }
        if self.samples == 0 {
            self.value = sample;
        } else {
            self.value += alpha * (sample - self.value);
        }
        self.samples += 1;
    }

    /// Replaces the average (e.g. decayed in time), keeping the sample count.
    pub fn set_value(&mut self, value: f64) {
        if value.is_finite() {
            self.value = value;
        }
    }

    /// The average (0 before any sample).
    pub fn value(&self) -> f64 {
        self.value
    }

    /// Samples added so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The average once at least `min_samples` samples were added.
    pub fn trusted(&self, min_samples: u32) -> Option<f64> {
        (self.samples >= u64::from(min_samples.max(1))).then_some(self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn converges_to_a_constant_and_is_trusted_after_min_samples() {
        let mut e = Ewma::default();
        e.add(100.0, 0.2);
        assert_eq!(e.value(), 100.0, "first sample taken as is");
        assert_eq!(e.trusted(3), None);
        for _ in 0..40 {
            e.add(200.0, 0.2);
        }
        assert!((e.value() - 200.0).abs() < 0.1, "{}", e.value());
        assert_eq!(e.samples(), 41);
        assert!(e.trusted(3).is_some());
        e.add(f64::NAN, 0.2);
        assert_eq!(e.samples(), 41, "NaN ignored");
    }

    proptest! {
        /// The average stays within the range of the samples.
        #[test]
        fn stays_within_the_samples(samples in proptest::collection::vec(0.0f64..1e6, 1..50), alpha in 0.01f64..1.0) {
            let mut e = Ewma::default();
            for &s in &samples {
                e.add(s, alpha);
            }
            let lo = samples.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(e.value() >= lo - 1e-6 && e.value() <= hi + 1e-6);
        }
    }
}
