//! Per-endpoint load: the router's own in-flight counts, the engine's scraped view, and the
//! speed learned from observed first-byte times.
//!
//! - This file: requests and prompt tokens in flight. Counters are atomics read without locks by
//!   the policy. They are only changed through an [`InflightGuard`], whose `Drop` releases what it
//!   took, so an error path, a client disconnect or an Envoy cancel can never leak a count.
//! - [`engine`]: the last scraped engine sample and its freshness.
//! - [`exposition`]: parsing vLLM's / SGLang's Prometheus text into an engine sample.
//! - [`scrape`]: the scrape loop of one endpoint.
//! - [`learned`]: prefill speed and TTFT residual learned per endpoint.
//! - [`seqlock`]: the few words decisions read for every candidate, without a lock (the engine
//!   sample's brief, what was learned).
//! - [`decay`]: the one time-decay law behind every average and rate (learned values, the
//!   router's arrival rates).

pub mod decay;
pub mod engine;
pub mod exposition;
pub mod learned;
pub mod scrape;
pub mod seqlock;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub use engine::{EngineSample, EngineSignal, EngineState, LoraInfo, SampleBrief, Stamp};
pub use learned::{ForDecision, Learned, LearnedSnapshot, TtftContext};

/// Live load state of one endpoint. Shared by every endpoint-set snapshot that contains the
/// endpoint, so a config reload never resets it.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    in_flight_requests: AtomicU64,
    in_flight_prefill_tokens: AtomicU64,
    in_flight_prefilling: AtomicU64,
    requests_total: AtomicU64,
    /// Moving average of the prompt tokens routed here to prefill (1/8 weight to the newest;
    /// 0 until the first).
    typical_prefill_tokens: AtomicU64,
    /// The engine's own load, as last scraped.
    pub engine: EngineState,
    /// Speed and TTFT residual learned from responses.
    pub learned: Learned,
    /// When a request here was last marked for the observer, ns since [`epoch`] (0: never).
    watched_at_ns: AtomicU64,
    /// When the prompt at the head of the router's prefill queue here began prefilling: the
    /// last time the count of prompts without a first byte rose from zero or a first byte left
    /// others behind it (prompts taken as prefilled one after another). On tokio's clock, so a
    /// test with a paused clock moves it; a lock, not an atomic, because that clock's instants
    /// have no fixed origin to count from.
    prefill_head_since: parking_lot::Mutex<Option<tokio::time::Instant>>,
}

/// The process's reference instant for the load counters' timestamps.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// A consistent-enough copy of an endpoint's load. Each field is read atomically; the pair may be
/// a few nanoseconds apart, which a policy tolerates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadSnapshot {
    /// Requests routed here whose response has not ended.
    pub in_flight_requests: u64,
    /// Estimated prompt tokens of in-flight requests that have not produced a first byte yet
    /// (still queued or prefilling).
    pub in_flight_prefill_tokens: u64,
    /// In-flight requests that have not produced a first byte yet (still queued or
    /// prefilling): the router's view of the endpoint's prefill queue.
    pub in_flight_prefilling: u64,
    /// Requests ever routed here.
    pub requests_total: u64,
    /// Moving average of the prompt tokens each routed request gave the endpoint to prefill
    /// (uncached), weighing the newest 1/8; 0 before the first. What flow control's predicted
    /// room takes as the endpoint's typical request.
    pub typical_prefill_tokens: u64,
}

impl EndpointLoad {
    /// Reads the counters.
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            in_flight_requests: self.in_flight_requests.load(Ordering::Relaxed),
            in_flight_prefill_tokens: self.in_flight_prefill_tokens.load(Ordering::Relaxed),
            in_flight_prefilling: self.in_flight_prefilling.load(Ordering::Relaxed),
            requests_total: self.requests_total.load(Ordering::Relaxed),
            typical_prefill_tokens: self.typical_prefill_tokens.load(Ordering::Relaxed),
        }
    }

    /// Whether a request decided at `now` is the one to watch to its first byte: the first
    /// since `interval` passed since the last one watched here (always with a zero
    /// interval). Two racing callers cannot both win the same interval.
    pub fn claim_watch(&self, now: Instant, interval: Duration) -> bool {
        if interval.is_zero() {
            return true;
        }
        let now_ns = (now.saturating_duration_since(epoch()).as_nanos() as u64).max(1);
        let last = self.watched_at_ns.load(Ordering::Relaxed);
        if last != 0 && now_ns.saturating_sub(last) < interval.as_nanos() as u64 {
            return false;
        }
        self.watched_at_ns
            .compare_exchange(last, now_ns, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// How long the prompt at the head of the router's prefill queue here has been prefilling,
    /// ms, taking prompts as prefilled one after another (the head began when the queue last
    /// rose from empty or a first byte came with others waiting); 0 with none waiting. Read on
    /// tokio's clock, as the stamps are.
    pub fn prefill_head_elapsed_ms(&self) -> f64 {
        if self.in_flight_prefilling.load(Ordering::Relaxed) == 0 {
            return 0.0;
        }
        (*self.prefill_head_since.lock()).map_or(0.0, |since| {
            tokio::time::Instant::now()
                .saturating_duration_since(since)
                .as_secs_f64()
                * 1e3
        })
    }

    /// Counts a request of `prompt_tokens` as in flight until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>, prompt_tokens: u64) -> InflightGuard {
        self.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight_prefill_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        if self.in_flight_prefilling.fetch_add(1, Ordering::Relaxed) == 0 {
            // Nothing was ahead: this prompt's prefill starts now.
            *self.prefill_head_since.lock() = Some(tokio::time::Instant::now());
        }
        let first = self.requests_total.fetch_add(1, Ordering::Relaxed) == 0;
        // Integer EWMA; two racing updates may lose one sample, which an average tolerates.
        let _ =
            self.typical_prefill_tokens
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    Some(if first {
                        prompt_tokens
                    } else {
                        (old * 7 + prompt_tokens) / 8
                    })
                });
        InflightGuard {
            load: Arc::clone(self),
            prefill_tokens: prompt_tokens,
            prefilling: true,
        }
    }
}

/// One request's share of an endpoint's load. Dropping it releases the share exactly once.
#[derive(Debug)]
pub struct InflightGuard {
    load: Arc<EndpointLoad>,
    /// Prompt tokens still counted as waiting for prefill (0 after [`Self::prefill_done`]).
    prefill_tokens: u64,
    /// Still counted in `in_flight_prefilling`.
    prefilling: bool,
}

impl InflightGuard {
    /// The first response byte arrived: the prompt is prefilled, only decode remains.
    /// Idempotent.
    pub fn prefill_done(&mut self) {
        if std::mem::take(&mut self.prefilling)
            && self
                .load
                .in_flight_prefilling
                .fetch_sub(1, Ordering::Relaxed)
                > 1
        {
            // Others were waiting behind this one: the next prompt's prefill starts now.
            *self.load.prefill_head_since.lock() = Some(tokio::time::Instant::now());
        }
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens > 0 {
            self.load
                .in_flight_prefill_tokens
                .fetch_sub(tokens, Ordering::Relaxed);
        }
    }

    /// Whether this guard counts against `load`.
    pub fn is_for(&self, load: &Arc<EndpointLoad>) -> bool {
        Arc::ptr_eq(&self.load, load)
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.prefill_done();
        self.load.in_flight_requests.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_watched_request_per_interval() {
        let load = EndpointLoad::default();
        let t0 = epoch() + Duration::from_secs(1);
        let ms = Duration::from_millis;
        let interval = ms(20);
        assert!(load.claim_watch(t0, interval), "the first is watched");
        assert!(!load.claim_watch(t0 + ms(5), interval));
        assert!(!load.claim_watch(t0 + ms(19), interval));
        assert!(load.claim_watch(t0 + ms(20), interval), "a new interval");
        assert!(!load.claim_watch(t0 + ms(21), interval));
        // An earlier instant than the last claim (a decision timed before a racing one) is
        // not a new interval either.
        assert!(!load.claim_watch(t0 + ms(10), interval));
        assert!(
            load.claim_watch(t0 + ms(21), Duration::ZERO),
            "0: every request"
        );
    }

    #[test]
    fn guard_releases_exactly_once() {
        let load = Arc::new(EndpointLoad::default());
        let mut a = load.begin(100);
        let b = load.begin(50);
        assert_eq!(
            load.snapshot(),
            LoadSnapshot {
                in_flight_requests: 2,
                in_flight_prefill_tokens: 150,
                in_flight_prefilling: 2,
                requests_total: 2,
                // The first request sets the average, the second weighs 1/8.
                typical_prefill_tokens: (100 * 7 + 50) / 8,
            }
        );
        a.prefill_done();
        a.prefill_done();
        assert_eq!(load.snapshot().in_flight_prefill_tokens, 50);
        assert_eq!(load.snapshot().in_flight_prefilling, 1);
        assert_eq!(load.snapshot().in_flight_requests, 2);
        drop(a);
        drop(b);
        let s = load.snapshot();
        assert_eq!((s.in_flight_requests, s.in_flight_prefill_tokens), (0, 0));
        assert_eq!(s.requests_total, 2);
    }

    #[test]
    fn guards_across_threads_balance() {
        let load = Arc::new(EndpointLoad::default());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for i in 0..1000 {
                        let mut g = load.begin(i);
                        if i % 2 == 0 {
                            g.prefill_done();
                        }
                    }
                });
            }
        });
        let s = load.snapshot();
        assert_eq!((s.in_flight_requests, s.in_flight_prefill_tokens), (0, 0));
        assert_eq!(s.in_flight_prefilling, 0);
        assert_eq!(s.requests_total, 4000);
    }
}
