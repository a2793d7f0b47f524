//! Time-decayed quantities: one decay law for every average and rate the router keeps.
//!
//! A value decays as `value × exp(−elapsed / time_constant)` ([`Decay`]); a half-life `h` is
//! the time constant `h / ln 2`. Two quantities are built on it:
//!
//! - [`Ewma`]: a moving average of samples (`value ← value + w × (sample − value)` with
//!   `w = max(alpha, 1 / n)` for the n-th sample: the first `1 / alpha` samples are averaged
//!   evenly, so an early value is their mean rather than mostly the first sample) that can
//!   also fade toward zero between samples (the learned TTFT residual: an endpoint that
//!   stopped getting traffic because it looked slow is tried again). With [`Decay::NEVER`] it
//!   is a plain per-sample EWMA (the learned prefill speed's work and time, averaged apart).
//! - [`Rate`]: events per second, each event adding `1 / time_constant` to a value that decays:
//!   a steady `r` events/s converges to `r`, and a change shows within a few time constants.
//!
//! Times are [`std::time::Instant`]s (tokio's convert with `into_std`, paused time included). A
//! time earlier than the last update decays nothing and never moves the clock back.

use std::time::{Duration, Instant};

/// How fast a value fades with time: it is multiplied by `exp(−elapsed / time_constant)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decay {
    /// Seconds; infinite for [`Decay::NEVER`].
    time_constant_s: f64,
}

impl Decay {
    /// No decay at all: a per-sample average only.
    pub const NEVER: Decay = Decay {
        time_constant_s: f64::INFINITY,
    };

    /// Fades to `1/e` after `tau` (a zero `tau` is taken as 1 ms).
    pub fn time_constant(tau: Duration) -> Decay {
        Decay {
            time_constant_s: tau.as_secs_f64().max(1e-3),
        }
    }

    /// Halves every `half_life` (a zero half-life is taken as 1 ms).
    pub fn half_life(half_life: Duration) -> Decay {
        Decay {
            time_constant_s: half_life.as_secs_f64().max(1e-3) / std::f64::consts::LN_2,
        }
    }

    /// The time constant in seconds (infinite for [`Decay::NEVER`]).
    pub fn time_constant_s(self) -> f64 {
        self.time_constant_s
    }

    /// What is left of 1 after `elapsed`: in `(0, 1]`.
    pub fn factor(self, elapsed: Duration) -> f64 {
        (-elapsed.as_secs_f64() / self.time_constant_s).exp()
    }
}

/// A value and when it was last brought up to date; the part both quantities share.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Decaying {
    value: f64,
    at: Option<Instant>,
}

impl Decaying {
    fn at(&self, now: Instant, decay: Decay) -> f64 {
        match self.at {
            Some(at) => self.value * decay.factor(now.saturating_duration_since(at)),
            None => self.value,
        }
    }

    /// Decays the value to `now`, then replaces it by `f(value)`.
    fn update(&mut self, now: Instant, decay: Decay, f: impl FnOnce(f64) -> f64) {
        self.value = f(self.at(now, decay));
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
    }
}

/// A moving average of samples that knows how many it has seen and may fade with time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ewma {
    value: Decaying,
    samples: u64,
}

impl Ewma {
    /// Adds a sample with weight `alpha` (0 < alpha <= 1), without time decay; the n-th sample
    /// weighs at least `1 / n` (the first is taken as is, the first `1 / alpha` are averaged
    /// evenly). Non-finite samples are ignored.
    pub fn add(&mut self, sample: f64, alpha: f64) {
        if !sample.is_finite() {
            return;
        }
        self.samples += 1;
        let weight = alpha.max(1.0 / self.samples as f64);
        let v = &mut self.value.value;
        *v += weight * (sample - *v);
    }

    /// Decays the average to `now`, then adds a sample as [`Self::add`] does.
    pub fn add_at(&mut self, sample: f64, alpha: f64, now: Instant, decay: Decay) {
        if !sample.is_finite() {
            return;
        }
        self.value.update(now, decay, |v| v);
        self.add(sample, alpha);
    }

    /// The average without time decay (0 before any sample).
    pub fn value(&self) -> f64 {
        self.value.value
    }

    /// The average decayed to `now` (0 before any sample).
    pub fn value_at(&self, now: Instant, decay: Decay) -> f64 {
        self.value.at(now, decay)
    }

    /// Samples added so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// When the average was last brought up to date in time ([`Self::add_at`]); None if never.
    pub fn updated_at(&self) -> Option<Instant> {
        self.value.at
    }

    /// The average once at least `min_samples` samples were added.
    pub fn trusted(&self, min_samples: u32) -> Option<f64> {
        self.trusted_at(min_samples, None)
    }

    /// The average decayed to `now` (when given, with `decay`) once at least `min_samples`
    /// samples were added.
    pub fn trusted_at(&self, min_samples: u32, now: Option<(Instant, Decay)>) -> Option<f64> {
        (self.samples >= u64::from(min_samples.max(1))).then(|| match now {
            Some((now, decay)) => self.value_at(now, decay),
            None => self.value(),
        })
    }
}

/// Events per second, decaying: each event adds `1 / time_constant`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    value: Decaying,
    decay: Decay,
}

impl Rate {
    /// No events yet, decaying with time constant `tau`.
    pub fn new(tau: Duration) -> Rate {
        Rate {
            value: Decaying::default(),
            decay: Decay::time_constant(tau),
        }
    }

    /// Counts one event at `now`.
    pub fn record(&mut self, now: Instant) {
        let weight = 1.0 / self.decay.time_constant_s();
        self.value.update(now, self.decay, |v| v + weight);
    }

    /// Events per second as of `now` (0 before any event).
    pub fn per_s(&self, now: Instant) -> f64 {
        self.value.at(now, self.decay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn half_life_and_time_constant_are_one_law() {
        let h = Decay::half_life(Duration::from_secs(5));
        assert!((h.factor(Duration::from_secs(5)) - 0.5).abs() < 1e-12);
        assert!((h.factor(Duration::from_secs(10)) - 0.25).abs() < 1e-12);
        let tau = Decay::time_constant(Duration::from_secs(2));
        assert!((tau.factor(Duration::from_secs(2)) - (-1.0f64).exp()).abs() < 1e-12);
        assert_eq!(tau.factor(Duration::ZERO), 1.0);
        assert_eq!(Decay::NEVER.factor(Duration::from_secs(1 << 30)), 1.0);
        // The same decay written both ways.
        let as_tau = Decay::time_constant(Duration::from_secs_f64(5.0 / std::f64::consts::LN_2));
        let t = Duration::from_millis(3_700);
        assert!((as_tau.factor(t) - h.factor(t)).abs() < 1e-9);
        assert!(Decay::half_life(Duration::ZERO).factor(Duration::from_secs(1)) < 1e-100);
    }

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

    #[test]
    fn the_first_samples_are_averaged_evenly_until_alpha_takes_over() {
        let mut e = Ewma::default();
        for s in [100.0, 200.0, 300.0] {
            e.add(s, 0.05);
        }
        assert!(
            (e.value() - 200.0).abs() < 1e-9,
            "their mean: {}",
            e.value()
        );
        // Past 1 / alpha samples, a new one weighs alpha.
        let mut e = Ewma::default();
        for _ in 0..20 {
            e.add(100.0, 0.05);
        }
        e.add(300.0, 0.05);
        assert!((e.value() - 110.0).abs() < 1e-9, "{}", e.value());
    }

    #[test]
    fn an_average_fades_between_samples_and_resumes_from_what_is_left() {
        let decay = Decay::half_life(Duration::from_secs(1));
        let t0 = Instant::now();
        let mut e = Ewma::default();
        assert_eq!(e.value_at(t0, decay), 0.0);
        e.add_at(80.0, 0.5, t0, decay);
        let t1 = t0 + Duration::from_secs(2);
        assert!(
            (e.value_at(t1, decay) - 20.0).abs() < 1e-9,
            "two half-lives"
        );
        assert_eq!(e.trusted_at(2, Some((t1, decay))), None);
        // The next sample averages with the decayed value, not the stale one.
        e.add_at(60.0, 0.5, t1, decay);
        assert!((e.value_at(t1, decay) - 40.0).abs() < 1e-9);
        assert!((e.trusted_at(2, Some((t1, decay))).unwrap() - 40.0).abs() < 1e-9);
        // A time before the last update decays nothing and keeps the clock.
        assert!((e.value_at(t0, decay) - 40.0).abs() < 1e-9);
        e.add_at(40.0, 0.5, t0, decay);
        assert!((e.value_at(t1 + Duration::from_secs(1), decay) - 20.0).abs() < 1e-9);
    }

    #[test]
    fn a_rate_follows_a_steady_rate_and_decays_when_events_stop() {
        let mut r = Rate::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(r.per_s(t0), 0.0);
        let mut t = t0;
        for _ in 0..1200 {
            t += Duration::from_millis(50);
            r.record(t);
        }
        assert!((r.per_s(t) - 20.0).abs() < 1.0, "{}", r.per_s(t));
        let later = r.per_s(t + Duration::from_secs(5));
        assert!((later / r.per_s(t) - (-1.0f64).exp()).abs() < 1e-9);
        // An event stamped before the last one counts without moving the clock back.
        let before = r.per_s(t);
        r.record(t - Duration::from_secs(1));
        assert!((r.per_s(t) - before - 0.2).abs() < 1e-9);
    }

    proptest! {
        /// Without decay the average stays within the range of the samples.
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

        /// Decay only ever shrinks a non-negative value, and more time shrinks it more.
        #[test]
        fn decay_is_monotonic(v in 0.0f64..1e6, a_ms in 0u64..100_000, b_ms in 0u64..100_000, h_ms in 1u64..100_000) {
            let decay = Decay::half_life(Duration::from_millis(h_ms));
            let t0 = Instant::now();
            let mut e = Ewma::default();
            e.add_at(v, 1.0, t0, decay);
            let (a, b) = (a_ms.min(b_ms), a_ms.max(b_ms));
            let va = e.value_at(t0 + Duration::from_millis(a), decay);
            let vb = e.value_at(t0 + Duration::from_millis(b), decay);
            prop_assert!(va <= v + 1e-9 && vb <= va + 1e-9);
        }
    }
}
