//! One endpoint's event stream as the sockets and the hub see it: its published state and its
//! applier behind a lock, and what every socket task shares.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::apply::Applier;
use super::blocks::Rehash;
use super::gate::GateLimits;
use super::state::{Published, Reason};
use crate::config::ResolvedKvEvents;
use crate::index::{Clock, EndpointId, IdLease, OwnershipIndex};

/// What every socket task shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) index: Arc<OwnershipIndex>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) unrouted: AtomicU64,
    /// Publisher connections the gates closed (IP not allowed, too many, or over the limits).
    pub(crate) refused: AtomicU64,
    /// The gates' settings, replaced on reload.
    pub(crate) gate: ArcSwap<GateLimits>,
}

impl Shared {
    pub(crate) fn count_unrouted(&self) {
        self.unrouted.fetch_add(1, Ordering::Relaxed);
    }

    #[cfg(test)]
    pub(crate) fn for_tests() -> Arc<Shared> {
        Arc::new(Shared {
            index: Arc::new(OwnershipIndex::new(
                Default::default(),
                Arc::new(crate::index::ManualClock::new(1)),
            )),
            clock: Arc::new(crate::index::ManualClock::new(1)),
            unrouted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            gate: ArcSwap::from_pointee(GateLimits {
                max_message_bytes: crate::config::KvEventsConfig::default().max_message_bytes,
                ..GateLimits::default()
            }),
        })
    }
}

/// One endpoint's event stream.
#[derive(Debug)]
pub(crate) struct EndpointEvents {
    /// Its endpoint's id, held while the stream (or a socket task routing to it) lives, so the
    /// index entries it writes cannot land on another endpoint.
    lease: Arc<IdLease>,
    pub(crate) spec: ResolvedKvEvents,
    pub(crate) rehash: Rehash,
    pub(crate) max_engine_blocks: usize,
    pub(crate) published: Published,
    pub(crate) applier: Mutex<Applier>,
}

impl EndpointEvents {
    pub(crate) fn new(
        lease: Arc<IdLease>,
        spec: ResolvedKvEvents,
        rehash: Rehash,
        max_engine_blocks: usize,
        now_ms: u64,
    ) -> EndpointEvents {
        let applier = Applier::new(
            lease.id(),
            rehash.clone(),
            max_engine_blocks,
            spec.group_idx,
        );
        EndpointEvents {
            lease,
            published: Published::new(applier.state(), now_ms),
            applier: Mutex::new(applier),
            spec,
            rehash,
            max_engine_blocks,
        }
    }

    #[cfg(test)]
    pub(crate) fn for_tests(shared: &Shared, port: u16) -> Arc<EndpointEvents> {
        let spec = ResolvedKvEvents {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            model: "m".into(),
            attach: crate::config::KvEventsAttach::Connect(format!("tcp://127.0.0.1:{port}")),
            topic: String::new(),
            group_idx: 0,
            replay: None,
        };
        let rehash = Rehash {
            model: "m".into(),
            block_size_tokens: 16,
            max_namespaces: 16,
        };
        Arc::new(EndpointEvents::new(
            crate::index::EndpointInterner::new().lease(spec.address),
            spec,
            rehash,
            1 << 20,
            shared.clock.now_ms(),
        ))
    }

    /// The endpoint's id.
    pub(crate) fn id(&self) -> EndpointId {
        self.lease.id()
    }

    /// The endpoint's HTTP address.
    pub(crate) fn address(&self) -> SocketAddr {
        self.spec.address
    }

    pub(crate) fn publish(&self, applier: &Applier, shared: &Shared) {
        self.published.set(applier.state(), shared.clock.now_ms());
    }

    /// The socket connected.
    pub(crate) fn connected(&self, shared: &Shared) {
        let mut applier = self.applier.lock();
        applier.connected();
        self.publish(&applier, shared);
    }

    /// Events stopped reaching us.
    pub(crate) fn link_lost(&self, reason: Reason, shared: &Shared) {
        let mut applier = self.applier.lock();
        applier.link_lost(reason, &shared.index);
        self.publish(&applier, shared);
    }

    /// True when the router has been waiting for this endpoint's events longer than `timeout`.
    pub(crate) fn overdue(&self, now_ms: u64, timeout_ms: u64) -> Option<u64> {
        let since = self.published.expect_since_ms.load(Ordering::Acquire);
        if since == 0 || timeout_ms == 0 || now_ms < since.saturating_add(timeout_ms) {
            return None;
        }
        // A message in the same ms as the expectation began came before it (a later one resets
        // the expectation): `<=`, or a request recorded in the ms of the last message would
        // turn silence detection off for good.
        (self.published.last_message_ms.load(Ordering::Acquire) <= since).then_some(since)
    }
}
