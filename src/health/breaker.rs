//! The per-endpoint circuit breaker, fed by the outcomes of real requests.
//!
//! ```text
//! closed --failure_threshold consecutive failures--> open (open_ms)
//! open --open time passed--> half-open: at most half_open_requests requests at once
//! half-open --success_threshold consecutive successes--> closed
//! half-open --a failure--> open (twice the previous open time, at most max_open_ms)
//! ```
//!
//! Outcomes of requests that were already running when the breaker opened are ignored while it
//! is open, so a long generation finishing does not close it early. Time is
//! `tokio::time::Instant`, so tests drive it with paused time.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::BreakerConfig;

/// Where a breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BreakerState {
    /// Routable.
    Closed,
    /// Ejected until its open time has passed.
    Open,
    /// A bounded trickle of requests tests the endpoint.
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half-open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

/// Whether a breaker lets a new request through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Yes, freely.
    Yes,
    /// Yes, as one of the half-open trickle (take a permit when committing).
    Trial,
    /// No.
    No,
}

/// A state change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: BreakerState,
    /// After.
    pub to: BreakerState,
}

/// One endpoint's breaker.
#[derive(Debug)]
pub struct Breaker {
    state: BreakerState,
    open_until: Instant,
    /// Consecutive failures while closed.
    failures: u32,
    /// Consecutive successes while half-open.
    successes: u32,
    /// Re-openings from half-open since it last closed (for the backoff).
    reopenings: u32,
    /// Trial requests in flight while half-open.
    trials: u32,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: BreakerState::Closed,
            open_until: Instant::now(),
            failures: 0,
            successes: 0,
            reopenings: 0,
            trials: 0,
        }
    }
}

impl Breaker {
    /// The state at `now` (an open breaker whose time has passed reads as half-open).
    pub fn state(&self, now: Instant) -> BreakerState {
        match self.state {
            BreakerState::Open if now >= self.open_until => BreakerState::HalfOpen,
            s => s,
        }
    }

    /// Whether a request may be sent at `now`.
    pub fn admission(&self, now: Instant, cfg: &BreakerConfig) -> Admission {
        if !cfg.enabled {
            return Admission::Yes;
        }
        match self.state(now) {
            BreakerState::Closed => Admission::Yes,
            BreakerState::Open => Admission::No,
            BreakerState::HalfOpen if self.trials < cfg.half_open_requests => Admission::Trial,
            BreakerState::HalfOpen => Admission::No,
        }
    }

    /// Takes a half-open trial slot, if one is free at `now`; also reports the lazy open ->
    /// half-open transition.
    pub fn begin_trial(&mut self, now: Instant, cfg: &BreakerConfig) -> (bool, Option<Transition>) {
        let transition = self.settle(now);
        let ok = self.state == BreakerState::HalfOpen && self.trials < cfg.half_open_requests;
        if ok {
            self.trials += 1;
        }
        (ok, transition)
    }

    /// Returns a trial slot.
    pub fn end_trial(&mut self) {
        self.trials = self.trials.saturating_sub(1);
    }

    /// Records a successful request.
    pub fn on_success(&mut self, now: Instant, cfg: &BreakerConfig) -> Option<Transition> {
        let lazy = self.settle(now);
        match self.state {
            BreakerState::Closed => {
                self.failures = 0;
                lazy
            }
            BreakerState::Open => lazy,
            BreakerState::HalfOpen => {
                self.successes += 1;
                if self.successes >= cfg.success_threshold.max(1) {
                    self.close();
                    Some(Transition {
                        from: BreakerState::HalfOpen,
                        to: BreakerState::Closed,
                    })
                } else {
                    lazy
                }
            }
        }
    }

    /// Records a failed request.
    pub fn on_failure(&mut self, now: Instant, cfg: &BreakerConfig) -> Option<Transition> {
        if !cfg.enabled {
            return None;
        }
        let lazy = self.settle(now);
        match self.state {
            BreakerState::Closed => {
                self.failures += 1;
                if self.failures >= cfg.failure_threshold.max(1) {
                    self.open(now, Duration::from_millis(cfg.open_ms));
                    Some(Transition {
                        from: BreakerState::Closed,
                        to: BreakerState::Open,
                    })
                } else {
                    None
                }
            }
            BreakerState::Open => lazy,
            BreakerState::HalfOpen => {
                self.reopenings = self.reopenings.saturating_add(1);
                let backoff = cfg
                    .open_ms
                    .saturating_mul(1u64 << self.reopenings.min(20))
                    .min(cfg.max_open_ms.max(cfg.open_ms));
                self.open(now, Duration::from_millis(backoff));
                Some(Transition {
                    from: BreakerState::HalfOpen,
                    to: BreakerState::Open,
                })
            }
        }
    }

    /// Closes at once (the breaker was turned off).
    pub fn reset(&mut self) {
        self.close();
        self.reopenings = 0;
    }

    /// Whether it is closed with no failure counted since the last success.
    pub fn is_clean(&self) -> bool {
        self.state == BreakerState::Closed && self.failures == 0
    }

    /// Whether it is closed (no timer involved: only failures open it).
    pub fn is_closed(&self) -> bool {
        self.state == BreakerState::Closed
    }

    /// When an open breaker turns half-open.
    pub fn open_until(&self) -> Option<Instant> {
        (self.state == BreakerState::Open).then_some(self.open_until)
    }

    fn settle(&mut self, now: Instant) -> Option<Transition> {
        if self.state == BreakerState::Open && now >= self.open_until {
            self.state = BreakerState::HalfOpen;
            self.successes = 0;
            return Some(Transition {
                from: BreakerState::Open,
                to: BreakerState::HalfOpen,
            });
        }
        None
    }

    fn open(&mut self, now: Instant, duration: Duration) {
        self.state = BreakerState::Open;
        self.open_until = now + duration;
        self.failures = 0;
        self.successes = 0;
    }

    fn close(&mut self) {
        self.state = BreakerState::Closed;
        self.failures = 0;
        self.successes = 0;
        self.reopenings = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            failure_threshold: 3,
            open_ms: 1000,
            max_open_ms: 3000,
            half_open_requests: 1,
            success_threshold: 2,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_recovers_through_half_open() {
        let c = cfg();
        let mut b = Breaker::default();
        let now = Instant::now;
        assert_eq!(b.on_failure(now(), &c), None);
        assert_eq!(b.on_success(now(), &c), None, "a success resets the count");
        assert_eq!(b.on_failure(now(), &c), None);
        assert_eq!(b.on_failure(now(), &c), None);
        let t = b.on_failure(now(), &c).expect("opens");
        assert_eq!(t.to, BreakerState::Open);
        assert_eq!(b.admission(now(), &c), Admission::No);
        // A request that started before the breaker opened finishes well: still open.
        assert_eq!(b.on_success(now(), &c), None);
        assert_eq!(b.state(now()), BreakerState::Open);

        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(b.admission(now(), &c), Admission::No);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.admission(now(), &c), Admission::Trial);
        let (ok, t) = b.begin_trial(now(), &c);
        assert!(ok);
        assert_eq!(t.map(|t| t.to), Some(BreakerState::HalfOpen));
        assert_eq!(b.admission(now(), &c), Admission::No, "one trial at a time");
        assert!(!b.begin_trial(now(), &c).0);
        assert_eq!(b.on_success(now(), &c), None, "one of two successes");
        b.end_trial();
        assert!(b.begin_trial(now(), &c).0);
        let t = b.on_success(now(), &c).expect("closes");
        b.end_trial();
        assert_eq!(
            (t.from, t.to),
            (BreakerState::HalfOpen, BreakerState::Closed)
        );
        assert_eq!(b.admission(now(), &c), Admission::Yes);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_trial_reopens_for_longer_up_to_the_maximum() {
        let c = cfg();
        let mut b = Breaker::default();
        let now = Instant::now;
        for _ in 0..3 {
            b.on_failure(now(), &c);
        }
        let mut expected_open = vec![2000u64, 3000, 3000];
        for open_ms in expected_open.drain(..) {
            let until = b.open_until().expect("open");
            tokio::time::advance(until - now()).await;
            assert!(b.begin_trial(now(), &c).0);
            let t = b.on_failure(now(), &c).expect("reopens");
            b.end_trial();
            assert_eq!((t.from, t.to), (BreakerState::HalfOpen, BreakerState::Open));
            assert_eq!(b.open_until(), Some(now() + Duration::from_millis(open_ms)));
        }
        // Recovery resets the backoff.
        tokio::time::advance(Duration::from_millis(3000)).await;
        for _ in 0..2 {
            assert!(b.begin_trial(now(), &c).0);
            b.on_success(now(), &c);
            b.end_trial();
        }
        assert_eq!(b.state(now()), BreakerState::Closed);
        for _ in 0..3 {
            b.on_failure(now(), &c);
        }
        assert_eq!(b.open_until(), Some(now() + Duration::from_millis(1000)));
    }

    #[tokio::test(start_paused = true)]
    async fn disabled_breaker_admits_everything() {
        let c = BreakerConfig {
            enabled: false,
            ..cfg()
        };
        let mut b = Breaker::default();
        for _ in 0..10 {
            assert_eq!(b.on_failure(Instant::now(), &c), None);
        }
        assert_eq!(b.admission(Instant::now(), &c), Admission::Yes);
    }
}
