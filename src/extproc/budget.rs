//! The process-wide budget of buffered request-body bytes.
//!
//! Each stream may hold up to `routing.max_body_bytes` while its body arrives and is decided on,
//! and nothing bounds how many streams Envoy opens: without a shared budget, a few hundred
//! clients sending 32 MiB bodies slowly would hold gigabytes. Every stream's bytes are counted
//! in one atomic; a chunk that would take the total past `routing.max_buffered_body_bytes` is
//! refused (the caller answers 503 with `retry-after`) before it is copied.
//!
//! The count is released by [`HeldBody`]'s `Drop`, so a stream that ends any way (decided,
//! rejected, cancelled by the client, reset by Envoy) gives its bytes back exactly once.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Body bytes held by every stream of this process.
static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

/// One stream's share of the budget; returns it when dropped.
#[derive(Debug)]
pub struct HeldBody {
    /// The process's counter (tests use their own).
    counter: &'static AtomicUsize,
    bytes: usize,
}

impl Default for HeldBody {
    fn default() -> Self {
        HeldBody {
            counter: &HELD_BYTES,
            bytes: 0,
        }
    }
}

impl HeldBody {
    /// Takes `more` bytes if the total stays within `limit_bytes`; false (nothing taken) if not.
    pub fn grow(&mut self, more: usize, limit_bytes: usize) -> bool {
        let taken = self
            .counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(more).filter(|&total| total <= limit_bytes)
            });
        if taken.is_ok() {
            self.bytes += more;
        }
        taken.is_ok()
    }

    /// Moves up to `bytes` of `from`'s share into this one (no change to the total); returns
    /// how many moved. A long message is charged on arrival, before it waits for its lane; the
    /// body it decodes to then takes over that charge instead of being counted twice.
    pub fn take_from(&mut self, from: &mut HeldBody, bytes: usize) -> usize {
        debug_assert!(std::ptr::eq(self.counter, from.counter));
        let moved = bytes.min(from.bytes);
        from.bytes -= moved;
        self.bytes += moved;
        moved
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_within_the_limit_and_gives_back_on_drop() {
        // A counter of its own: the process's is shared with every other test's streams.
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let held = || HeldBody {
            counter: &COUNTER,
            bytes: 0,
        };
        let (mut a, mut b) = (held(), held());
        assert!(a.grow(600, 1000));
        assert!(!b.grow(600, 1000), "past the budget: refused");
        assert_eq!(b.bytes, 0, "a refusal takes nothing");
        assert!(b.grow(400, 1000), "the rest still fits");
        drop(a);
        assert!(b.grow(600, 1000), "a's share came back");
        assert_eq!(b.bytes, 1000);
        assert!(!b.grow(usize::MAX, usize::MAX), "no overflow");
        drop(b);
        assert_eq!(COUNTER.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_prepaid_charge_moves_without_counting_twice() {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let held = || HeldBody {
            counter: &COUNTER,
            bytes: 0,
        };
        let (mut prepaid, mut body) = (held(), held());
        assert!(prepaid.grow(700, 1000));
        assert_eq!(body.take_from(&mut prepaid, 500), 500);
        assert_eq!(COUNTER.load(Ordering::Relaxed), 700, "moved, not added");
        assert_eq!(
            body.take_from(&mut prepaid, 500),
            200,
            "only what was prepaid"
        );
        assert_eq!((body.bytes, prepaid.bytes), (700, 0));
        drop(prepaid);
        assert_eq!(
            COUNTER.load(Ordering::Relaxed),
            700,
            "the body still holds it"
        );
        drop(body);
        assert_eq!(COUNTER.load(Ordering::Relaxed), 0);
    }
}
