//! Time for prediction expiry, injected so tests control it.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonic millisecond clock.
pub trait Clock: Send + Sync + Debug {
    /// Milliseconds since an arbitrary fixed origin; never decreases.
    fn now_ms(&self) -> u64;
}

/// Tokio's clock: follows paused and advanced time in `#[tokio::test(start_paused = true)]`
/// tests (with tokio's `test-util`), the monotonic system clock otherwise.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose origin is now.
    pub fn new() -> TokioClock {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        tokio::time::Instant::now()
            .saturating_duration_since(self.origin)
            .as_millis() as u64
    }
}

/// A clock that moves only when told to (for tests and simulations).
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A clock at `now_ms`.
    pub fn new(now_ms: u64) -> ManualClock {
        ManualClock {
            now_ms: AtomicU64::new(now_ms),
        }
    }

    /// Moves the clock forward by `ms`.
    pub fn advance_ms(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_when_told() {
        let c = ManualClock::new(5);
        assert_eq!(c.now_ms(), 5);
        c.advance_ms(10);
        assert_eq!(c.now_ms(), 15);
    }

    #[test]
    fn tokio_clock_is_monotonic() {
        let c = TokioClock::new();
        let a = c.now_ms();
        assert!(c.now_ms() >= a);
    }
}
