//! Endpoint health: whether an endpoint may be picked, from three independent views.
//!
//! - the **active probe** (`GET /health`, [`probe`]): down after `failure_threshold` consecutive
//!   failures, up after `success_threshold` consecutive successes;
//! - the **scrape** (`GET /metrics` every 50 ms, [`crate::load::scrape`]): the same thresholds
//!   over failed scrapes (connection refused, timeout, 5xx), so a dead replica is out within a few
//!   scrape intervals even with no traffic;
//! - the **circuit breaker** ([`breaker`]), fed by request outcomes the response observer sees: a
//!   5xx from the replica, or the request served by another endpoint than the pick (Envoy retried
//!   it after a connect failure, reset or 503).
//!
//! An endpoint is routable when the probe and the scrape say up and the breaker admits; a
//! half-open breaker admits a bounded trickle of real requests ([`TrialPermit`]). Unroutable
//! endpoints are never picked; the router may still append them after the healthy ones in the
//! fallback list, as a last resort Envoy only reaches if every healthy choice failed.
//!
//! [`crate::monitor`] runs the probe and scrape loops of every endpoint; the router feeds request
//! outcomes to the breaker. Nothing here blocks the request path: the common case (all up,
//! breaker closed) is one atomic load.

pub mod breaker;
pub mod detector;
pub mod probe;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;

pub use breaker::{Admission, BreakerState, Transition};

use crate::config::HealthConfig;
use breaker::Breaker;
use detector::Detector;

/// Which view changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The active probe.
    Probe,
    /// The metrics scrape.
    Scrape,
    /// The circuit breaker (request outcomes).
    Breaker,
}

impl Cause {
    /// `probe`, `scrape` or `breaker`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Probe => "probe",
            Cause::Scrape => "scrape",
            Cause::Breaker => "breaker",
        }
    }
}

/// A change of one view of an endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The view.
    pub cause: Cause,
    /// The state before: `up`/`down`, or a breaker state.
    pub from: &'static str,
    /// The state after.
    pub to: &'static str,
}

impl Change {
    /// Whether this change took the endpoint out of rotation.
    pub fn is_ejection(&self) -> bool {
        matches!(self.to, "down" | "open")
    }

    fn detector(cause: Cause, up: bool) -> Change {
        let (from, to) = if up { ("down", "up") } else { ("up", "down") };
        Change { cause, from, to }
    }

    fn breaker(t: Transition) -> Change {
        Change {
            cause: Cause::Breaker,
            from: t.from.as_str(),
            to: t.to.as_str(),
        }
    }
}

/// A copy of an endpoint's health, for explanations, metrics and the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HealthSnapshot {
    /// The active probe's view.
    pub probe_up: bool,
    /// The scrape's view.
    pub scrape_up: bool,
    /// The breaker's state.
    pub breaker: BreakerState,
    /// Whether a new request may be sent now.
    pub routable: bool,
}

#[derive(Debug, Default)]
struct Inner {
    probe: Detector,
    scrape: Detector,
    breaker: Breaker,
}

impl Inner {
    fn all_clear(&self) -> bool {
        self.probe.is_up() && self.scrape.is_up() && self.breaker.is_closed()
    }
}

/// Live health of one endpoint. Shared by every endpoint-set snapshot that contains the endpoint.
#[derive(Debug)]
pub struct EndpointHealth {
    inner: Mutex<Inner>,
    /// Everything up and the breaker closed: the lock-free fast path of [`Self::admission`].
    clear: AtomicBool,
    /// Clear, and no failed request counted since the last good one: nothing to watch for.
    clean: AtomicBool,
}

impl Default for EndpointHealth {
    fn default() -> Self {
        EndpointHealth {
            inner: Mutex::new(Inner::default()),
            clear: AtomicBool::new(true),
            clean: AtomicBool::new(true),
        }
    }
}

/// One of the half-open breaker's trickle of requests; returns its slot when dropped.
#[derive(Debug)]
pub struct TrialPermit {
    health: Arc<EndpointHealth>,
}

impl Drop for TrialPermit {
    fn drop(&mut self) {
        self.health.inner.lock().breaker.end_trial();
    }
}

/// Whether a response status counts against the replica: 500, 502, 503, 504. A 4xx is the
/// client's fault, a 429 is back-pressure, 501/505 are unsupported features; none of those
/// mean the replica is broken.
pub fn is_failure_status(status: u16) -> bool {
    matches!(status, 500 | 502 | 503 | 504)
}

impl EndpointHealth {
    /// Whether every view is up and no failed request was counted since the last good one
    /// (lock-free). While it is not, each response counts: the router watches every request
    /// there (`routing.observe_interval_ms`).
    pub fn is_clean(&self) -> bool {
        self.clean.load(Ordering::Relaxed)
    }

    /// Whether a new request may be sent at `now`.
    pub fn admission(&self, now: Instant, cfg: &HealthConfig) -> Admission {
        if self.clear.load(Ordering::Relaxed) {
            return Admission::Yes;
        }
        let inner = self.inner.lock();
        if !inner.probe.is_up() || !inner.scrape.is_up() {
            return Admission::No;
        }
        inner.breaker.admission(now, &cfg.breaker)
    }

    /// Takes a half-open trial slot for a request being committed to this endpoint.
    pub fn begin_trial(
        self: &Arc<Self>,
        now: Instant,
        cfg: &HealthConfig,
    ) -> (Option<TrialPermit>, Option<Change>) {
        let mut inner = self.inner.lock();
        let (ok, t) = inner.breaker.begin_trial(now, &cfg.breaker);
        let permit = ok.then(|| TrialPermit {
            health: Arc::clone(self),
        });
        (permit, t.map(Change::breaker))
    }

    /// Records a routed request's outcome (`ok`: served without a failure status); `trial`: it
    /// held one of the half-open breaker's trial slots. While the breaker is half-open only
    /// trials count: a request that went without a slot (a decision racing the one that took
    /// it) or was sent before the breaker opened must not close it early (any success counted
    /// toward `success_threshold`) nor reopen it on stale news.
    pub fn record_request(
        &self,
        ok: bool,
        trial: bool,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<Change> {
        self.update(|inner| {
            if !trial && inner.breaker.state(now) == BreakerState::HalfOpen {
                return None;
            }
            let t = if ok {
                inner.breaker.on_success(now, &cfg.breaker)
            } else {
                inner.breaker.on_failure(now, &cfg.breaker)
            };
            t.map(Change::breaker)
        })
    }

    /// Records an active probe's result.
    pub fn record_probe(&self, ok: bool, cfg: &HealthConfig) -> Option<Change> {
        let (f, s) = (cfg.probe.failure_threshold, cfg.probe.success_threshold);
        self.update(|inner| {
            inner
                .probe
                .record(ok, f, s)
                .map(|up| Change::detector(Cause::Probe, up))
        })
    }

    /// Records a scrape's reachability (with the probe's thresholds).
    pub fn record_scrape(&self, ok: bool, cfg: &HealthConfig) -> Option<Change> {
        let (f, s) = (cfg.probe.failure_threshold, cfg.probe.success_threshold);
        self.update(|inner| {
            inner
                .scrape
                .record(ok, f, s)
                .map(|up| Change::detector(Cause::Scrape, up))
        })
    }

    /// Forgets a view that was turned off in config, so it cannot keep the endpoint out.
    pub fn reset(&self, cause: Cause) -> Option<Change> {
        self.update(|inner| match cause {
            Cause::Probe => inner
                .probe
                .reset()
                .map(|up| Change::detector(Cause::Probe, up)),
            Cause::Scrape => inner
                .scrape
                .reset()
                .map(|up| Change::detector(Cause::Scrape, up)),
            Cause::Breaker => {
                let from = inner.breaker.state(Instant::now());
                inner.breaker.reset();
                (from != BreakerState::Closed).then_some(Change {
                    cause: Cause::Breaker,
                    from: from.as_str(),
                    to: BreakerState::Closed.as_str(),
                })
            }
        })
    }

    /// The health as of `now`.
    pub fn snapshot(&self, now: Instant, cfg: &HealthConfig) -> HealthSnapshot {
        let routable = self.admission(now, cfg) != Admission::No;
        let inner = self.inner.lock();
        HealthSnapshot {
            probe_up: inner.probe.is_up(),
            scrape_up: inner.scrape.is_up(),
            breaker: inner.breaker.state(now),
            routable,
        }
    }

    fn update(&self, f: impl FnOnce(&mut Inner) -> Option<Change>) -> Option<Change> {
        let mut inner = self.inner.lock();
        let change = f(&mut inner);
        let clear = inner.all_clear();
        self.clear.store(clear, Ordering::Relaxed);
        self.clean
            .store(clear && inner.breaker.is_clean(), Ordering::Relaxed);
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_failed_request_puts_an_endpoint_in_doubt_until_a_good_one() {
        let cfg = HealthConfig::default();
        let h = EndpointHealth::default();
        assert!(h.is_clean());
        h.record_request(false, false, Instant::now(), &cfg);
        assert!(!h.is_clean(), "a failure counted, the breaker still closed");
        assert_eq!(h.admission(Instant::now(), &cfg), Admission::Yes);
        h.record_request(true, false, Instant::now(), &cfg);
        assert!(h.is_clean());
        h.record_probe(false, &cfg);
        h.record_probe(false, &cfg);
        h.record_probe(false, &cfg);
        assert!(!h.is_clean(), "ejected by its probes");
    }

    #[tokio::test(start_paused = true)]
    async fn health_flips_after_n_failures_from_any_view_and_recovers() {
        let cfg = HealthConfig::default(); // thresholds 3 down / 2 up, breaker 3 / 5 s
        let h = Arc::new(EndpointHealth::default());
        let now = Instant::now;
        assert_eq!(h.admission(now(), &cfg), Admission::Yes);

        assert_eq!(h.record_probe(false, &cfg), None);
        assert_eq!(h.record_probe(false, &cfg), None);
        let c = h.record_probe(false, &cfg).expect("third failure ejects");
        assert_eq!(
            (c.cause, c.to, c.is_ejection()),
            (Cause::Probe, "down", true)
        );
        assert_eq!(h.admission(now(), &cfg), Admission::No);
        assert!(!h.snapshot(now(), &cfg).routable);
        h.record_probe(true, &cfg);
        let c = h.record_probe(true, &cfg).expect("second success restores");
        assert_eq!((c.to, c.is_ejection()), ("up", false));
        assert_eq!(h.admission(now(), &cfg), Admission::Yes);

        for _ in 0..3 {
            h.record_scrape(false, &cfg);
        }
        assert_eq!(h.admission(now(), &cfg), Admission::No, "scrapes failing");
        assert_eq!(
            h.reset(Cause::Scrape).map(|c| c.to),
            Some("up"),
            "scraping turned off"
        );
        assert_eq!(h.admission(now(), &cfg), Admission::Yes);
    }

    #[tokio::test(start_paused = true)]
    async fn breaker_trickle_is_bounded_by_permits_and_recovers() {
        let cfg = HealthConfig::default();
        let h = Arc::new(EndpointHealth::default());
        let now = Instant::now;
        for _ in 0..2 {
            assert_eq!(h.record_request(false, false, now(), &cfg), None);
        }
        let c = h.record_request(false, false, now(), &cfg).expect("opens");
        assert_eq!((c.cause, c.to), (Cause::Breaker, "open"));
        assert_eq!(h.admission(now(), &cfg), Admission::No);
        tokio::time::advance(Duration::from_millis(cfg.breaker.open_ms)).await;
        assert_eq!(h.admission(now(), &cfg), Admission::Trial);
        let (permit, change) = h.begin_trial(now(), &cfg);
        let permit = permit.expect("a slot");
        assert_eq!(change.map(|c| c.to), Some("half-open"));
        assert_eq!(h.admission(now(), &cfg), Admission::No, "slot taken");
        assert!(h.begin_trial(now(), &cfg).0.is_none());
        drop(permit); // e.g. the client went away: the slot comes back, nothing learned
        assert_eq!(h.admission(now(), &cfg), Admission::Trial);
        for _ in 0..2 {
            let (permit, _) = h.begin_trial(now(), &cfg);
            let permit = permit.expect("slot");
            h.record_request(true, true, now(), &cfg);
            drop(permit);
        }
        assert_eq!(h.admission(now(), &cfg), Admission::Yes);
        assert_eq!(h.snapshot(now(), &cfg).breaker, BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn while_half_open_only_trials_outcomes_count() {
        let cfg = HealthConfig::default();
        let h = Arc::new(EndpointHealth::default());
        let now = Instant::now;
        for _ in 0..cfg.breaker.failure_threshold {
            h.record_request(false, false, now(), &cfg);
        }
        tokio::time::advance(Duration::from_millis(cfg.breaker.open_ms)).await;
        let half_open = || h.snapshot(now(), &cfg).breaker == BreakerState::HalfOpen;
        assert!(half_open());
        // Requests without a slot (a racing decision, one sent before it opened): neither
        // their successes close it nor a late failure reopens it.
        for _ in 0..cfg.breaker.success_threshold + 1 {
            assert_eq!(h.record_request(true, false, now(), &cfg), None);
        }
        assert_eq!(h.record_request(false, false, now(), &cfg), None);
        assert!(half_open(), "decided by trials only");
        // The trials decide.
        for _ in 0..cfg.breaker.success_threshold {
            let (permit, _) = h.begin_trial(now(), &cfg);
            let permit = permit.expect("a slot");
            h.record_request(true, true, now(), &cfg);
            drop(permit);
        }
        assert_eq!(h.snapshot(now(), &cfg).breaker, BreakerState::Closed);
    }

    #[test]
    fn failure_statuses() {
        for (status, failure) in [
            (200, false),
            (400, false),
            (404, false),
            (429, false),
            (500, true),
            (501, false),
            (502, true),
            (503, true),
            (504, true),
        ] {
            assert_eq!(is_failure_status(status), failure, "{status}");
        }
    }
}
