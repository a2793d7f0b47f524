//! Batches pushed over gRPC (`kvrouter.v1.KvEvents/PushKvEvents`) for endpoints configured with
//! `kv_events: {push: true}`: the same applier, sequence rules and trust states as a ZMQ
//! message, without a socket.

use std::net::SocketAddr;

use super::super::apply;
use super::super::state::Reason;
use super::super::wire::{Batch, Message};
use super::KvEvents;
use crate::config::KvEventsAttach;

/// Why a pushed batch was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// The router routes to no such endpoint.
    #[error("{0} is not an endpoint of this router")]
    UnknownEndpoint(SocketAddr),
    /// The endpoint's events come from a ZMQ socket, or it has none configured.
    #[error("{0} does not take pushed KV events (set kv_events: {{push: true}} on its pool or on the endpoint)")]
    NotPushed(SocketAddr),
}

/// Where pushed batches go: the endpoints' KV-event streams, by address. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PushSink {
    events: KvEvents,
}

impl KvEvents {
    /// The sink for pushed batches.
    pub fn push_sink(&self) -> PushSink {
        PushSink {
            events: self.clone(),
        }
    }
}

impl PushSink {
    /// Applies `batch`, the publisher's batch number `seq`, to the stream of the endpoint at
    /// `address`, exactly as a ZMQ message with that sequence and payload would be.
    pub fn apply(&self, address: SocketAddr, seq: u64, batch: Batch) -> Result<(), PushError> {
        let e = self.pushed(address)?;
        let shared = &self.events.inner.shared;
        let now = shared.clock.now_ms();
        let message = Message {
            topic: b"",
            seq,
            batch,
        };
        let mut applier = e.applier.lock();
        apply::apply_and_publish(&mut applier, &e.published, Ok(message), &shared.index, now);
        Ok(())
    }

    /// The pushing client went away without closing its stream: as a dropped ZMQ connection,
    /// the endpoint's entries are withdrawn until its next batch says what was lost.
    pub fn link_lost(&self, address: SocketAddr) {
        if let Ok(e) = self.pushed(address) {
            e.link_lost(Reason::Disconnected, &self.events.inner.shared);
        }
    }

    fn pushed(
        &self,
        address: SocketAddr,
    ) -> Result<std::sync::Arc<super::EndpointEvents>, PushError> {
        let id = self
            .events
            .inner
            .interner
            .get(&address)
            .ok_or(PushError::UnknownEndpoint(address))?;
        match self.events.endpoint(id) {
            // The address is checked again: its id may have been reclaimed and given to
            // another endpoint since it was looked up.
            Some(e) if e.address() == address && e.spec.attach == KvEventsAttach::Push => Ok(e),
            Some(_) | None => Err(PushError::NotPushed(address)),
        }
    }
}
