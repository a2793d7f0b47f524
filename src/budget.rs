//! The process-wide byte budgets: memory held on behalf of requests, bounded across all of them.
//!
//! - [`BUFFERED_BODIES`]: request bodies held while they arrive and are decided on. Each stream
//!   may hold up to `routing.max_body_bytes`, and nothing bounds how many streams Envoy opens:
//!   without a shared budget, a few hundred clients sending 32 MiB bodies slowly would hold
//!   gigabytes. A chunk that would take the total past `routing.max_buffered_body_bytes` is
//!   refused (the caller answers 503 with `retry-after`) before it is copied.
//! - [`AFTER_DECISION`]: rendered prompts whose rest is tokenized after the decision. Such work
//!   outlives its request, so nothing else bounds it: a flood of long bodies cut by the prefix
//!   budget would otherwise queue a rendered copy of each behind the heavy lane. Past
//!   [`AFTER_DECISION_MAX`] the rest is dropped (its prefix stays predicted).
//!
//! [`cores`] is the CPU side: how many cores this process may use, read once.
//!
//! A share is a [`Held`], released by its `Drop`, so a request that ends any way (decided,
//! rejected, cancelled by the client, reset by Envoy) gives its bytes back exactly once. Both
//! totals are exported as gauges (`kvrouter_buffered_body_bytes`,
//! `kvrouter_after_decision_held_bytes`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Cores this process may use (affinity and cgroup quota; 2 if unknown), read once: the
/// standard library reads the cgroup files on every call (~33 us and 21 system calls here),
/// too much for anything a request asks.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

/// Most bytes of rendered prompts that work queued after decisions may hold at once.
pub const AFTER_DECISION_MAX: usize = 256 << 20;

/// Request body bytes held by every stream of this process.
pub static BUFFERED_BODIES: ByteBudget = ByteBudget::new();

/// Rendered prompt bytes held by work queued after decisions.
pub static AFTER_DECISION: ByteBudget = ByteBudget::new();

/// A count of bytes held, shared by every holder of one kind.
#[derive(Debug)]
pub struct ByteBudget {
    used: AtomicUsize,
}

/// One holder's share of a [`ByteBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Held {
    budget: &'static ByteBudget,
    bytes: usize,
}

impl ByteBudget {
    /// An empty budget.
    pub const fn new() -> ByteBudget {
        ByteBudget {
            used: AtomicUsize::new(0),
        }
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// A share of nothing, to grow later.
    pub fn empty(&'static self) -> Held {
        Held {
            budget: self,
            bytes: 0,
        }
    }

    /// A share of `bytes` if the total stays within `limit`.
    pub fn hold(&'static self, bytes: usize, limit: usize) -> Option<Held> {
        let mut held = self.empty();
        held.grow(bytes, limit).then_some(held)
    }
}

impl Default for ByteBudget {
    fn default() -> Self {
        Self::new()
    }
}

impl Held {
    /// Takes `more` bytes if the total stays within `limit`; false (nothing taken) if not.
    pub fn grow(&mut self, more: usize, limit: usize) -> bool {
        let taken = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|&total| total <= limit)
            })
            .is_ok();
        if taken {
            self.bytes += more;
        }
        taken
    }

    /// Moves up to `bytes` of `from`'s share into this one (no change to the total); returns
    /// how many moved. A long message is charged on arrival, before it waits for its lane; the
    /// body it decodes to then takes over that charge instead of being counted twice.
    pub fn take_from(&mut self, from: &mut Held, bytes: usize) -> usize {
        debug_assert!(std::ptr::eq(self.budget, from.budget));
        let moved = bytes.min(from.bytes);
        from.bytes -= moved;
        self.bytes += moved;
        moved
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_within_the_limit_and_gives_back_on_drop() {
        // A budget of its own: the process's are shared with every other test's streams.
        static BUDGET: ByteBudget = ByteBudget::new();
        let (mut a, mut b) = (BUDGET.empty(), BUDGET.empty());
        assert!(a.grow(600, 1000));
        assert!(!b.grow(600, 1000), "past the budget: refused");
        assert_eq!(b.bytes, 0, "a refusal takes nothing");
        assert!(b.grow(400, 1000), "the rest still fits");
        assert!(BUDGET.hold(1, 1000).is_none(), "full");
        drop(a);
        assert_eq!(BUDGET.used(), 400);
        assert!(b.grow(600, 1000), "a's share came back");
        assert_eq!(b.bytes, 1000);
        assert!(!b.grow(usize::MAX, usize::MAX), "no overflow");
        drop(b);
        assert_eq!(BUDGET.used(), 0);
        let c = BUDGET.hold(1000, 1000).expect("fits exactly");
        assert!(BUDGET.hold(usize::MAX, usize::MAX).is_none(), "no overflow");
        drop(c);
        assert_eq!(BUDGET.used(), 0);
    }

    #[test]
    fn a_prepaid_charge_moves_without_counting_twice() {
        static BUDGET: ByteBudget = ByteBudget::new();
        let (mut prepaid, mut body) = (BUDGET.empty(), BUDGET.empty());
        assert!(prepaid.grow(700, 1000));
        assert_eq!(body.take_from(&mut prepaid, 500), 500);
        assert_eq!(BUDGET.used(), 700, "moved, not added");
        assert_eq!(
            body.take_from(&mut prepaid, 500),
            200,
            "only what was prepaid"
        );
        assert_eq!((body.bytes, prepaid.bytes), (700, 0));
        drop(prepaid);
        assert_eq!(BUDGET.used(), 700, "the body still holds it");
        drop(body);
        assert_eq!(BUDGET.used(), 0);
    }
}
