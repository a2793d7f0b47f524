//! Excludes endpoints that are saturated: at their configured concurrency limit
//! (`max_in_flight`), or, while the engine's scraped load is fresh, with a long queue or a
//! nearly full KV cache (the GIE saturation detector's signals).

use crate::config::SaturationConfig;
use crate::policy::{CandidateView, Filter, RequestView};

/// Keeps a candidate while it has room.
#[derive(Debug, Clone)]
pub struct Saturation {
    /// Saturated at this many requests waiting in the engine.
    pub max_waiting_requests: u64,
    /// Saturated at this KV-cache usage, 0..1.
    pub max_kv_cache_usage: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation::from(&SaturationConfig::default())
    }
}

impl Saturation {
    /// Only the configured `max_in_flight` limits; engine signals never saturate.
    pub fn limits_only() -> Saturation {
        Saturation {
            max_waiting_requests: u64::MAX,
            max_kv_cache_usage: f64::INFINITY,
        }
    }
}

impl From<&SaturationConfig> for Saturation {
    fn from(c: &SaturationConfig) -> Self {
        Saturation {
            max_waiting_requests: c.max_waiting_requests,
            max_kv_cache_usage: c.max_kv_cache_usage,
        }
    }
}

impl Filter for Saturation {
    fn name(&self) -> &'static str {
        "saturation"
    }

    fn keep(&self, _request: &RequestView, c: &CandidateView) -> bool {
        let below_limit = c
            .max_in_flight
            .is_none_or(|limit| c.load.in_flight_requests < u64::from(limit));
        let engine_ok = c.engine.is_none_or(|e| {
            e.waiting_requests < self.max_waiting_requests
                && e.kv_cache_usage < self.max_kv_cache_usage
        });
        below_limit && engine_ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::candidate;
    use crate::policy::EngineLoad;

    #[test]
    fn limits_and_fresh_engine_signals() {
        let f = Saturation::default();
        let r = RequestView::default();
        let mut c = candidate(1, 3, 0);
        assert!(f.keep(&r, &c));
        c.max_in_flight = Some(4);
        assert!(f.keep(&r, &c));
        c.max_in_flight = Some(3);
        assert!(!f.keep(&r, &c));
        let mut c = candidate(1, 3, 0);
        let engine = |waiting, kv| {
            Some(EngineLoad {
                waiting_requests: waiting,
                running_requests: 0,
                kv_cache_usage: kv,
            })
        };
        c.engine = engine(4, 0.79);
        assert!(f.keep(&r, &c));
        c.engine = engine(5, 0.1);
        assert!(!f.keep(&r, &c), "queue at the limit");
        c.engine = engine(0, 0.8);
        assert!(!f.keep(&r, &c), "KV at the limit");
        let limits = Saturation::limits_only();
        c.engine = engine(1000, 1.0);
        assert!(limits.keep(&r, &c), "engine signals ignored");
        c.max_in_flight = Some(3);
        assert!(!limits.keep(&r, &c), "the configured limit still applies");
    }
}
