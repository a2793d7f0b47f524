//! The approximate prefix tree that some peers keep of their own routing decisions
//! (`vllm-prefix-aware`, `sglang-cache-aware`): which endpoint was sent which prompt prefix,
//! with no knowledge of what the engines actually hold or can hold.
//!
//! The peers build theirs over the request text (128-character chunks in the vLLM production
//! stack's hash trie, single characters in SGLang's radix tree). Ours is over the request's
//! chained block hashes (the router's `block_size_tokens`-token blocks), so no prompt text is
//! kept: a node is one block, identified by its chained hash, which stands for the whole
//! prefix up to it. Matching the longest run of a prompt's blocks is therefore the same walk as
//! descending a trie, at block granularity instead of the peers' character granularity (a
//! match can differ by at most one block).
//!
//! Each node lists its endpoints ("tenants" in SGLang) with the time each last used it; each
//! endpoint's size is the tokens of the nodes it is on. Eviction ([`ApproxTree::evict_to`])
//! removes an endpoint's least recently used nodes, deepest first among equals (a path is
//! stamped as a whole on insert, so this removes leaves before their parents, as SGLang's
//! leaf-LRU does), until the endpoint's size fits. Memory: about 40 bytes per node plus 16 per
//! endpoint on it.

use std::collections::HashMap;
use std::net::SocketAddr;

use ahash::AHashMap;

/// An endpoint's number inside one tree.
pub type Tenant = u16;

#[derive(Debug, Clone)]
struct Node {
    /// Position of the block in its prompt (0-based).
    depth: u32,
    /// Endpoints on this node and the time each last used it (ms since the tree's origin).
    tenants: Vec<(Tenant, u64)>,
}

/// Block-hash prefix tree with per-endpoint membership, sizes and LRU stamps.
#[derive(Debug, Default)]
pub struct ApproxTree {
    nodes: AHashMap<u64, Node>,
    ids: HashMap<SocketAddr, Tenant>,
    addresses: Vec<SocketAddr>,
    size_tokens: Vec<u64>,
}

impl ApproxTree {
    /// The endpoint's number, registering it (with size 0) if new. `None` past 65,535
    /// endpoints.
    pub fn tenant(&mut self, address: SocketAddr) -> Option<Tenant> {
        if let Some(&t) = self.ids.get(&address) {
            return Some(t);
        }
        let t = Tenant::try_from(self.addresses.len()).ok()?;
        self.ids.insert(address, t);
        self.addresses.push(address);
        self.size_tokens.push(0);
        Some(t)
    }

    /// The endpoint's number, if it was ever registered.
    pub fn known(&self, address: &SocketAddr) -> Option<Tenant> {
        self.ids.get(address).copied()
    }

    /// The address of `tenant`.
    pub fn address(&self, tenant: Tenant) -> SocketAddr {
        self.addresses[tenant as usize]
    }

    /// Tokens held by `tenant` in the tree.
    pub fn size_tokens(&self, tenant: Tenant) -> u64 {
        self.size_tokens[tenant as usize]
    }

    /// Every registered endpoint with its size, in registration order.
    pub fn sizes(&self) -> impl Iterator<Item = (Tenant, u64)> + '_ {
        self.size_tokens
            .iter()
            .enumerate()
            .map(|(t, &s)| (t as Tenant, s))
    }

    /// Nodes in the tree.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the tree holds no node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The tenants of each block of `blocks` that is in the tree, from block 0 until the first
    /// one that is not (any tenant counts).
    pub fn walk<'a>(&'a self, blocks: &'a [u64]) -> impl Iterator<Item = TenantsOf<'a>> + 'a {
        blocks
            .iter()
            .map_while(move |h| self.nodes.get(h).map(|n| TenantsOf(&n.tenants)))
    }

    /// [`Self::insert`] under `address` (registered if new), `block_size_tokens` a block: how a
    /// policy's tree learns where a prompt went.
    pub fn insert_for(
        &mut self,
        address: SocketAddr,
        blocks: &[u64],
        block_size_tokens: u32,
        now_ms: u64,
    ) {
        if let Some(t) = self.tenant(address) {
            self.insert(blocks, t, u64::from(block_size_tokens.max(1)), now_ms);
        }
    }

    /// Puts `tenant` on every block of `blocks` (creating missing nodes) and stamps them
    /// `now_ms`. `block_tokens` is what a node adds to a tenant's size.
    pub fn insert(&mut self, blocks: &[u64], tenant: Tenant, block_tokens: u64, now_ms: u64) {
        for (depth, &h) in blocks.iter().enumerate() {
            let node = self.nodes.entry(h).or_insert_with(|| Node {
                depth: depth as u32,
                tenants: Vec::new(),
            });
            match node.tenants.iter_mut().find(|(t, _)| *t == tenant) {
                Some((_, at)) => *at = now_ms,
                None => {
                    node.tenants.push((tenant, now_ms));
                    self.size_tokens[tenant as usize] += block_tokens;
                }
            }
        }
    }

    /// Stamps `tenant`'s use of the first `n` blocks of `blocks` (where it is on them).
    pub fn touch(&mut self, blocks: &[u64], n: usize, tenant: Tenant, now_ms: u64) {
        for h in blocks.iter().take(n) {
            if let Some(node) = self.nodes.get_mut(h) {
                if let Some((_, at)) = node.tenants.iter_mut().find(|(t, _)| *t == tenant) {
                    *at = now_ms;
                }
            }
        }
    }

    /// Removes each tenant's least recently used nodes (deepest first among equal stamps)
    /// until its size is at most `max_tokens`; nodes left without tenants are dropped.
    pub fn evict_to(&mut self, max_tokens: u64, block_tokens: u64) {
        for tenant in 0..self.addresses.len() {
            if self.size_tokens[tenant] <= max_tokens {
                continue;
            }
            let tenant = tenant as Tenant;
            let mut mine: Vec<(u64, std::cmp::Reverse<u32>, u64)> = self
                .nodes
                .iter()
                .filter_map(|(&h, n)| {
                    let (_, at) = n.tenants.iter().find(|(t, _)| *t == tenant)?;
                    Some((*at, std::cmp::Reverse(n.depth), h))
                })
                .collect();
            mine.sort_unstable();
            for (_, _, h) in mine {
                if self.size_tokens[tenant as usize] <= max_tokens {
                    break;
                }
                let Some(node) = self.nodes.get_mut(&h) else {
                    continue;
                };
                node.tenants.retain(|(t, _)| *t != tenant);
                if node.tenants.is_empty() {
                    self.nodes.remove(&h);
                }
                self.size_tokens[tenant as usize] -= block_tokens;
            }
        }
    }

    /// Forgets every node (endpoints stay registered, with size 0).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.size_tokens.iter_mut().for_each(|s| *s = 0);
    }
}

/// The endpoints on one node.
#[derive(Debug, Clone, Copy)]
pub struct TenantsOf<'a>(&'a [(Tenant, u64)]);

impl TenantsOf<'_> {
    /// The endpoints, in the order they joined the node.
    pub fn iter(&self) -> impl Iterator<Item = Tenant> + '_ {
        self.0.iter().map(|(t, _)| *t)
    }

    /// Whether `tenant` is on the node.
    pub fn contains(&self, tenant: Tenant) -> bool {
        self.0.iter().any(|(t, _)| *t == tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn walk_follows_the_longest_run_of_known_blocks() {
        let mut t = ApproxTree::default();
        let a = t.tenant(addr(1)).unwrap();
        let b = t.tenant(addr(2)).unwrap();
        t.insert(&[1, 2, 3], a, 16, 0);
        t.insert(&[1, 2, 9], b, 16, 0);
        let run: Vec<Vec<Tenant>> = t.walk(&[1, 2, 3, 4]).map(|n| n.iter().collect()).collect();
        assert_eq!(run, vec![vec![a, b], vec![a, b], vec![a]]);
        assert_eq!(
            t.walk(&[7, 1]).count(),
            0,
            "stops at the first unknown block"
        );
        assert_eq!((t.size_tokens(a), t.size_tokens(b)), (48, 48));
        t.insert(&[1, 2, 3], a, 16, 5);
        assert_eq!(t.size_tokens(a), 48, "re-inserting only restamps");
    }

    #[test]
    fn eviction_takes_the_oldest_and_deepest_first_down_to_the_bound() {
        let mut t = ApproxTree::default();
        let a = t.tenant(addr(1)).unwrap();
        let b = t.tenant(addr(2)).unwrap();
        t.insert(&[1, 2, 3], a, 16, 10); // old path
        t.insert(&[1, 5], a, 16, 20); // newer; restamps block 1
        t.insert(&[1, 2], b, 16, 10);
        assert_eq!((t.size_tokens(a), t.size_tokens(b)), (64, 32));
        t.evict_to(32, 16);
        // a loses 3 then 2 (stamped 10, deepest first); keeps 1 and 5 (stamped 20).
        assert_eq!((t.size_tokens(a), t.size_tokens(b)), (32, 32));
        let run: Vec<Vec<Tenant>> = t.walk(&[1, 2, 3]).map(|n| n.iter().collect()).collect();
        assert_eq!(
            run,
            vec![vec![a, b], vec![b]],
            "b untouched: within the bound"
        );
        assert_eq!(t.walk(&[1, 5]).count(), 2);
        t.evict_to(0, 16);
        assert!(t.is_empty());
        assert_eq!((t.size_tokens(a), t.size_tokens(b)), (0, 0));
    }

    #[test]
    fn touch_protects_a_path_from_eviction() {
        let mut t = ApproxTree::default();
        let a = t.tenant(addr(1)).unwrap();
        t.insert(&[1, 2], a, 16, 0);
        t.insert(&[7, 8], a, 16, 5);
        t.touch(&[1, 2], 2, a, 9);
        t.evict_to(32, 16);
        assert_eq!(t.walk(&[1, 2]).count(), 2);
        assert_eq!(t.walk(&[7]).count(), 0);
    }
}
