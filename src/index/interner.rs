//! Endpoint ids: small integers interned from addresses, so index entries stay small.

use std::collections::HashMap;
use std::net::SocketAddr;

use parking_lot::RwLock;

use super::EndpointId;

/// Maps endpoint addresses to dense ids (0, 1, 2...) and back. An id is never reused, so an
/// entry can never be attributed to a different endpoint; a removed endpoint's id stays mapped
/// (a few bytes) and is reused if the address comes back.
#[derive(Debug, Default)]
pub struct EndpointInterner {
    inner: RwLock<Interned>,
}

#[derive(Debug, Default)]
struct Interned {
    ids: HashMap<SocketAddr, EndpointId>,
    addresses: Vec<SocketAddr>,
}

impl EndpointInterner {
    /// An empty interner.
    pub fn new() -> EndpointInterner {
        EndpointInterner::default()
    }

    /// The id of `address`, assigning the next one on first sight.
    pub fn intern(&self, address: SocketAddr) -> EndpointId {
        if let Some(&id) = self.inner.read().ids.get(&address) {
            return id;
        }
        let mut inner = self.inner.write();
        if let Some(&id) = inner.ids.get(&address) {
            return id;
        }
        let id = inner.addresses.len() as EndpointId;
        inner.addresses.push(address);
        inner.ids.insert(address, id);
        id
    }

    /// The id of `address`, if it was interned.
    pub fn get(&self, address: &SocketAddr) -> Option<EndpointId> {
        self.inner.read().ids.get(address).copied()
    }

    /// The address of `id`, if assigned.
    pub fn address(&self, id: EndpointId) -> Option<SocketAddr> {
        self.inner.read().addresses.get(id as usize).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_dense_stable_and_reversible() {
        let i = EndpointInterner::new();
        let a: SocketAddr = "127.0.0.1:8001".parse().unwrap();
        let b: SocketAddr = "[::1]:8002".parse().unwrap();
        assert_eq!(i.get(&a), None);
        assert_eq!(i.intern(a), 0);
        assert_eq!(i.intern(b), 1);
        assert_eq!(i.intern(a), 0);
        assert_eq!(i.get(&b), Some(1));
        assert_eq!(i.address(1), Some(b));
        assert_eq!(i.address(2), None);
    }
}
