//! How far an endpoint's KV events can be believed, published for lock-free reads.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Why an endpoint's events are not the whole truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Subscribed, but not connected and no message yet.
    Connecting,
    /// The first batch seen was not the publisher's first (sequence > 0): the engine held
    /// blocks before we subscribed, and nothing tells us which.
    Joined,
    /// Batches were lost (a sequence gap): stored and removed blocks were missed.
    Gap,
    /// The publisher restarted (its sequence went back) and its first batches were missed, or
    /// something outside the event stream reported a restart.
    Restart,
    /// The router sent the endpoint work that should have stored blocks and no event came
    /// within `kv_events.silence_timeout_ms`.
    Silent,
    /// The connection to the publisher dropped.
    Disconnected,
    /// More engine blocks were tracked than `kv_events.max_engine_blocks`: the table was reset.
    Overflow,
    /// A message could not be decoded (so its events were lost).
    Malformed,
}

impl Reason {
    /// A short label for metrics, logs and decision records.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Connecting => "connecting",
            Reason::Joined => "joined",
            Reason::Gap => "gap",
            Reason::Restart => "restart",
            Reason::Silent => "silent",
            Reason::Disconnected => "disconnected",
            Reason::Overflow => "overflow",
            Reason::Malformed => "malformed",
        }
    }

    const ALL: [Reason; 8] = [
        Reason::Connecting,
        Reason::Joined,
        Reason::Gap,
        Reason::Restart,
        Reason::Silent,
        Reason::Disconnected,
        Reason::Overflow,
        Reason::Malformed,
    ];
}

/// Which source of cache ownership an endpoint's entries come from right now; what a routing
/// decision records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceState {
    /// No KV-event subscription is configured: predictions only (full prediction TTL).
    Absent,
    /// Events flow in sequence since a point where the engine's cache was empty (its publisher's
    /// sequence 0, or an `AllBlocksCleared`): confirmed blocks are exactly the engine's cache,
    /// and predictions only bridge the lag until events confirm them (short TTL).
    Trusted,
    /// Events flow and are applied, but some were missed (`reason`): confirmed blocks are true
    /// yet incomplete, so predictions keep the full TTL alongside them.
    Partial(Reason),
    /// Events are not flowing (`reason`): confirmed entries are withdrawn and only predictions
    /// (full TTL) count until the next batch arrives.
    Distrusted(Reason),
}

impl SourceState {
    /// `trusted`, `partial`, `distrusted` or `absent`.
    pub fn label(self) -> &'static str {
        match self {
            SourceState::Absent => "absent",
            SourceState::Trusted => "trusted",
            SourceState::Partial(_) => "partial",
            SourceState::Distrusted(_) => "distrusted",
        }
    }

    /// The reason, for `Partial` and `Distrusted`.
    pub fn reason(self) -> Option<Reason> {
        match self {
            SourceState::Partial(r) | SourceState::Distrusted(r) => Some(r),
            _ => None,
        }
    }

    /// What a routing decision's cache match rests on: `events` (trusted), `events+predictions`
    /// (partial), or `predictions` (distrusted, absent).
    pub fn source(self) -> &'static str {
        match self {
            SourceState::Trusted => "events",
            SourceState::Partial(_) => "events+predictions",
            SourceState::Distrusted(_) | SourceState::Absent => "predictions",
        }
    }

    fn pack(self) -> u32 {
        let reason = |r: Reason| Reason::ALL.iter().position(|&x| x == r).unwrap_or(0) as u32;
        match self {
            SourceState::Absent => 0,
            SourceState::Trusted => 1,
            SourceState::Partial(r) => 2 | reason(r) << 8,
            SourceState::Distrusted(r) => 3 | reason(r) << 8,
        }
    }

    fn unpack(v: u32) -> SourceState {
        let reason = Reason::ALL[((v >> 8) as usize).min(Reason::ALL.len() - 1)];
        match v & 0xff {
            1 => SourceState::Trusted,
            2 => SourceState::Partial(reason),
            3 => SourceState::Distrusted(reason),
            _ => SourceState::Absent,
        }
    }
}

/// An endpoint's published state and the timestamps silence detection needs, readable without
/// a lock (the request path reads it per candidate).
#[derive(Debug)]
pub(crate) struct Published {
    state: AtomicU32,
    /// When `state` last changed (ms on the events clock).
    since_ms: AtomicU64,
    /// When the router first sent work that should store new blocks and no message has arrived
    /// since (ms; 0 = no such work outstanding).
    pub(crate) expect_since_ms: AtomicU64,
    /// When the last message arrived (ms; 0 = never).
    pub(crate) last_message_ms: AtomicU64,
    /// The engine's block size in tokens, from its last `BlockStored` (0 = not seen yet).
    pub(crate) engine_block_size: AtomicU32,
}

impl Published {
    pub(crate) fn new(state: SourceState, now_ms: u64) -> Published {
        Published {
            state: AtomicU32::new(state.pack()),
            since_ms: AtomicU64::new(now_ms),
            expect_since_ms: AtomicU64::new(0),
            last_message_ms: AtomicU64::new(0),
            engine_block_size: AtomicU32::new(0),
        }
    }

    pub(crate) fn get(&self) -> SourceState {
        SourceState::unpack(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn since_ms(&self) -> u64 {
        self.since_ms.load(Ordering::Relaxed)
    }

    /// Publishes `state`; returns the previous one.
    pub(crate) fn set(&self, state: SourceState, now_ms: u64) -> SourceState {
        let old = SourceState::unpack(self.state.swap(state.pack(), Ordering::AcqRel));
        if old != state {
            self.since_ms.store(now_ms, Ordering::Relaxed);
        }
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_through_the_atomic() {
        let mut states = vec![SourceState::Absent, SourceState::Trusted];
        for r in Reason::ALL {
            states.push(SourceState::Partial(r));
            states.push(SourceState::Distrusted(r));
        }
        let p = Published::new(SourceState::Absent, 5);
        for s in states {
            p.set(s, 9);
            assert_eq!(p.get(), s);
            assert_eq!(SourceState::unpack(s.pack()), s);
        }
        assert_eq!(p.since_ms(), 9);
        assert_eq!(
            SourceState::Partial(Reason::Gap).source(),
            "events+predictions"
        );
        assert_eq!(
            SourceState::Distrusted(Reason::Silent).reason(),
            Some(Reason::Silent)
        );
        assert_eq!(SourceState::Trusted.label(), "trusted");
    }
}
