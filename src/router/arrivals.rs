//! Requests routed per second, per model: an exponentially decaying event rate
//! ([`crate::load::decay::Rate`]). The cost model uses it to estimate how many requests will
//! arrive at an endpoint while a prefill there runs (and so wait behind it).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::load::decay::Rate;

/// Time constant of the decay: the rate follows a change in traffic within a few of these.
const TAU: Duration = Duration::from_secs(5);

/// Per-model decision rates. Models are those of the config (an unknown model never gets a
/// decision), so the map stays small.
#[derive(Debug, Default)]
pub struct ArrivalRates {
    rates: Mutex<HashMap<String, Rate>>,
}

impl ArrivalRates {
    /// Counts one routed request for `model` at `now`.
    pub fn record(&self, model: &str, now: Instant) {
        let mut rates = self.rates.lock();
        match rates.get_mut(model) {
            Some(r) => r.record(now),
            None => {
                let mut r = Rate::new(TAU);
                r.record(now);
                rates.insert(model.to_string(), r);
            }
        }
    }

    /// Requests per second routed for `model` lately (0 if none).
    pub fn per_s(&self, model: &str, now: Instant) -> f64 {
        self.rates.lock().get(model).map_or(0.0, |r| r.per_s(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn follows_a_steady_rate_and_decays_when_traffic_stops() {
        let rates = ArrivalRates::default();
        let t0 = Instant::now();
        assert_eq!(rates.per_s("m", t0), 0.0);
        // 20 requests per second for 60 s.
        let mut t = t0;
        for _ in 0..1200 {
            t += Duration::from_millis(50);
            rates.record("m", t);
        }
        let r = rates.per_s("m", t);
        assert!((r - 20.0).abs() < 1.0, "{r}");
        assert_eq!(rates.per_s("other", t), 0.0, "per model");
        // Five time constants of silence: under 1% left.
        let r = rates.per_s("m", t + Duration::from_secs(25));
        assert!(r < 0.2, "{r}");
        // Traffic rises to 100/s: the rate follows within a few time constants.
        let mut t = t + Duration::from_secs(25);
        for _ in 0..2000 {
            t += Duration::from_millis(10);
            rates.record("m", t);
        }
        let r = rates.per_s("m", t);
        assert!((r - 100.0).abs() < 5.0, "{r}");
    }
}
