//! Endpoint ids: small dense integers interned from addresses, so index entries stay small, and
//! reused once nothing can attribute state to the endpoint that had them.
//!
//! # Lifecycle of an id
//!
//! - **In use**: [`EndpointInterner::lease`] maps an address to an id and hands out an
//!   [`IdLease`]. Whatever may write state under the id holds a clone: each endpoint-set
//!   snapshot's `Endpoint` (and so every plan, ticket, scrape and health probe holding that
//!   endpoint), and each KV-event stream. While one lives, the id is its address's.
//! - **Quarantined**: the last lease was dropped. The address stays mapped: if it comes back
//!   now it gets the same id (it is the same endpoint; whatever was written for it since it
//!   left is its own).
//! - **Free**: [`EndpointInterner::reclaim`] frees an id that has been quarantined at least the
//!   grace period: it has the caller retire the id's state (the ownership index's entries and
//!   recency list), unmaps the address and puts the id on the free list. The lowest free id is
//!   given out first, so the ids in use stay dense: churning N addresses with at most K of them
//!   alive at a time uses about K plus the quarantined ids, not N.
//!
//! Why a freed id carries nothing of its old endpoint: every writer of id-keyed state writes
//! while it holds a lease, so once none is left no new write can come; the retirement then
//! drops what was written, and a write that looked up the index's state just before the
//! retirement adds nothing ([`super::OwnershipIndex::retire_endpoint`]). Reclaiming and leasing
//! take the same lock, so an address coming back cannot revive an id while it is being freed.
//! The grace period is a margin for a copy of the bare id outliving its lease; none is known.
//! Per-endpoint state keyed by the endpoint's own objects (load, health, in-flight guards,
//! breaker trials) is never keyed by id, so it cannot be mis-attributed either.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;

use super::EndpointId;

/// A claim on an endpoint id: while any clone lives, the id stays mapped to its address and is
/// never given to another (see the module docs). Cheap to hold (`Arc`).
#[derive(Debug, PartialEq, Eq)]
pub struct IdLease {
    id: EndpointId,
    address: SocketAddr,
}

impl IdLease {
    /// The id.
    pub fn id(&self) -> EndpointId {
        self.id
    }

    /// The address it is mapped to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

/// How the interned ids stand, for metrics: `in_use + quarantined + free` is the length of
/// every table indexed by id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdCounts {
    /// Ids with a live lease.
    pub in_use: usize,
    /// Ids no lease holds, still mapped to their address until reclaimed.
    pub quarantined: usize,
    /// Ids below the highest one in use, free to be given out.
    pub free: usize,
}

/// Maps endpoint addresses to dense ids (0, 1, 2...) and back, and reuses the ids of endpoints
/// gone for good (see the module docs).
#[derive(Debug, Default)]
pub struct EndpointInterner {
    inner: RwLock<Interned>,
}

#[derive(Debug, Default)]
struct Interned {
    ids: HashMap<SocketAddr, EndpointId>,
    /// By id.
    slots: Vec<Slot>,
    /// Free ids below `slots.len()`, lowest given out first.
    free: BTreeSet<EndpointId>,
}

#[derive(Debug, Default)]
struct Slot {
    /// `None` while free.
    address: Option<SocketAddr>,
    /// The live lease, if any.
    lease: Weak<IdLease>,
    /// When [`EndpointInterner::reclaim`] first saw the id unheld (cleared when leased again).
    unheld_since_ms: Option<u64>,
}

impl EndpointInterner {
    /// An empty interner.
    pub fn new() -> EndpointInterner {
        EndpointInterner::default()
    }

    /// A lease on the id of `address`: its current one (also while quarantined), else the
    /// lowest free id, else the next new one.
    pub fn lease(&self, address: SocketAddr) -> Arc<IdLease> {
        {
            let inner = self.inner.read();
            if let Some(&id) = inner.ids.get(&address) {
                if let Some(lease) = inner.slots[id as usize].lease.upgrade() {
                    return lease;
                }
            }
        }
        let mut inner = self.inner.write();
        let inner = &mut *inner;
        let id = match inner.ids.get(&address) {
            Some(&id) => id,
            None => {
                let id = match inner.free.pop_first() {
                    Some(id) => id,
                    None => {
                        inner.slots.push(Slot::default());
                        (inner.slots.len() - 1) as EndpointId
                    }
                };
                inner.ids.insert(address, id);
                id
            }
        };
        let slot = &mut inner.slots[id as usize];
        if let Some(lease) = slot.lease.upgrade() {
            return lease;
        }
        let lease = Arc::new(IdLease { id, address });
        *slot = Slot {
            address: Some(address),
            lease: Arc::downgrade(&lease),
            unheld_since_ms: None,
        };
        lease
    }

    /// The id of `address`, if mapped (in use or quarantined).
    pub fn get(&self, address: &SocketAddr) -> Option<EndpointId> {
        self.inner.read().ids.get(address).copied()
    }

    /// The address of `id`, if mapped.
    pub fn address(&self, id: EndpointId) -> Option<SocketAddr> {
        self.inner
            .read()
            .slots
            .get(id as usize)
            .and_then(|s| s.address)
    }

    /// Frees the ids no lease has held since a call at least `grace_ms` before `now_ms` (ms on
    /// the caller's clock): `retire` is called for each with this interner's lock held (it
    /// must not lease), then the id is unmapped and put on the free list. Returns how many
    /// were freed. Ids first seen unheld are stamped with `now_ms`; ids leased again are
    /// unstamped, so each needs a quiet `grace_ms` between two calls.
    pub fn reclaim(&self, now_ms: u64, grace_ms: u64, mut retire: impl FnMut(EndpointId)) -> usize {
        let mut inner = self.inner.write();
        let Interned { ids, slots, free } = &mut *inner;
        let mut freed = 0;
        for (id, slot) in slots.iter_mut().enumerate() {
            let Some(address) = slot.address else {
                continue;
            };
            if slot.lease.strong_count() > 0 {
                slot.unheld_since_ms = None;
                continue;
            }
            let since = *slot.unheld_since_ms.get_or_insert(now_ms);
            if now_ms.saturating_sub(since) < grace_ms {
                continue;
            }
            let id = id as EndpointId;
            retire(id);
            ids.remove(&address);
            *slot = Slot::default();
            free.insert(id);
            freed += 1;
        }
        // Free ids at the top need no slot: the tables indexed by id stay as short as the
        // highest id in use.
        while slots.last().is_some_and(|s| s.address.is_none()) {
            slots.pop();
            free.remove(&(slots.len() as EndpointId));
        }
        freed
    }

    /// How the ids stand now.
    pub fn counts(&self) -> IdCounts {
        let inner = self.inner.read();
        let in_use = inner
            .slots
            .iter()
            .filter(|s| s.lease.strong_count() > 0)
            .count();
        IdCounts {
            in_use,
            quarantined: inner.ids.len() - in_use,
            free: inner.free.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn ids_are_dense_stable_and_reversible() {
        let i = EndpointInterner::new();
        let b: SocketAddr = "[::1]:8002".parse().unwrap();
        assert_eq!(i.get(&a(8001)), None);
        let first = i.lease(a(8001));
        assert_eq!(first.id(), 0);
        assert_eq!(i.lease(b).id(), 1);
        let again = i.lease(a(8001));
        assert!(
            Arc::ptr_eq(&first, &again),
            "one lease per id while it lives"
        );
        assert_eq!(i.get(&b), Some(1));
        assert_eq!(i.address(1), Some(b));
        assert_eq!(i.address(2), None);
    }

    #[test]
    fn an_id_is_freed_only_after_its_leases_are_gone_for_the_grace_period() {
        let i = EndpointInterner::new();
        let lease = i.lease(a(1));
        let _other = i.lease(a(2));
        let mut retired = Vec::new();
        let reclaim =
            |now, retired: &mut Vec<EndpointId>| i.reclaim(now, 100, |id| retired.push(id));
        assert_eq!(reclaim(0, &mut retired), 0);
        assert_eq!(
            reclaim(1_000, &mut retired),
            0,
            "held: no grace period runs"
        );
        let copy = Arc::clone(&lease);
        drop(lease);
        assert_eq!(reclaim(2_000, &mut retired), 0, "a clone still holds it");
        drop(copy);
        let counts = i.counts();
        assert_eq!((counts.in_use, counts.quarantined), (1, 1));
        assert_eq!(reclaim(3_000, &mut retired), 0, "first seen unheld");
        assert_eq!(reclaim(3_099, &mut retired), 0, "within the grace period");
        assert_eq!(i.get(&a(1)), Some(0), "mapped while quarantined");
        assert_eq!(reclaim(3_100, &mut retired), 1);
        assert_eq!(retired, [0]);
        assert_eq!((i.get(&a(1)), i.address(0)), (None, None));
        let counts = i.counts();
        assert_eq!((counts.in_use, counts.quarantined, counts.free), (1, 0, 1));
        // The next new address takes the freed id; the old one, coming back, a fresh one.
        assert_eq!(i.lease(a(3)).id(), 0);
        assert_eq!(i.lease(a(1)).id(), 2);
    }

    #[test]
    fn an_address_back_while_quarantined_keeps_its_id_and_restarts_the_quarantine() {
        let i = EndpointInterner::new();
        drop(i.lease(a(1)));
        assert_eq!(i.reclaim(0, 100, |_| panic!("not yet")), 0);
        let back = i.lease(a(1));
        assert_eq!(back.id(), 0, "the same endpoint: the same id");
        assert_eq!(i.reclaim(500, 100, |_| panic!("held again")), 0);
        drop(back);
        assert_eq!(i.reclaim(600, 100, |_| panic!("stamped anew")), 0);
        assert_eq!(i.reclaim(700, 100, |_| ()), 1);
    }

    #[test]
    fn churn_reuses_the_lowest_ids_and_trims_the_top() {
        let i = EndpointInterner::new();
        let mut alive: Vec<Arc<IdLease>> = Vec::new();
        let mut highest = 0;
        // 10,000 addresses, at most 4 alive at a time, reclaimed with no grace.
        for n in 0..10_000u16 {
            alive.push(i.lease(a(n)));
            if alive.len() > 4 {
                alive.remove(0);
            }
            i.reclaim(u64::from(n), 0, |_| ());
            highest = highest.max(alive.iter().map(|l| l.id()).max().unwrap());
        }
        assert!(highest < 5, "highest id {highest}");
        let ids: BTreeSet<EndpointId> = alive.iter().map(|l| l.id()).collect();
        assert_eq!(ids.len(), 4, "distinct while alive");
        drop(alive);
        i.reclaim(20_000, 0, |_| ());
        assert_eq!(
            i.counts(),
            IdCounts::default(),
            "nothing left, no free tail"
        );
        assert_eq!(i.lease(a(1)).id(), 0);
    }
}
