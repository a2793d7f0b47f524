//! Chained block hashes over token ids, seeded by a namespace.
//!
//! `hash(block i) = xxh3_64(seed = BLOCK_HASH_SEED, parent_le64 ‖ token_ids_le32 ‖ extra_keys_le64)`
//! where `parent` is the previous block's hash, and block 0's parent is the chain root: a hash
//! of the [`Namespace`] (model, adapter, tenant salt, `cache_salt`) and the block size. Every
//! constant is fixed, so hashes are the same in every router process and across restarts. Only
//! full blocks are hashed, as in vLLM.
//!
//! Two namespaces never share a root, so (up to 64-bit collisions) no block of one matches a block
//! of another. Tenants that a config lets share a cache get the same salt, hence the same root.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of every block hash. Changing it invalidates every hash (a new "hash version").
pub const BLOCK_HASH_SEED: u64 = 0x6b76_726f_7574_6572; // "kvrouter"

/// Seed of the namespace hash.
const NAMESPACE_SEED: u64 = 0x6e61_6d65_7370_6163; // "namespac"

/// Domain tag mixed into chain roots of byte-estimate chains, so a model that gains a tokenizer
/// never matches its old byte-chunk blocks.
const BYTE_CHAIN_TAG: u64 = 0x6279_7465_2d63_6875; // "byte-chu"

/// Where a prompt's blocks live: blocks of different namespaces never match.
///
/// Built by the router per request from the resolved base model, the LoRA adapter (if any), the
/// tenant's salt (see [`super::TenantSalts`]) and vLLM's `cache_salt` body field (if any).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    model: String,
    adapter: Option<String>,
    salt: Option<String>,
    cache_salt: Option<String>,
    hash: u64,
}

impl Namespace {
    /// The namespace of `model` (the served base model name), `adapter` (LoRA name, if the
    /// request names one) and `salt` (the tenant's salt; `None` = the shared namespace).
    pub fn new(model: &str, adapter: Option<&str>, salt: Option<&str>) -> Namespace {
        let mut ns = Namespace {
            model: model.to_owned(),
            adapter: adapter.map(str::to_owned),
            salt: salt.map(str::to_owned),
            cache_salt: None,
            hash: 0,
        };
        ns.hash = ns.compute_hash();
        ns
    }

    /// The same namespace further separated by a request's `cache_salt` (vLLM's per-request
    /// cache isolation; the engine mixes it into block 0, so a different salt never hits).
    pub fn with_cache_salt(mut self, cache_salt: Option<&str>) -> Namespace {
        self.cache_salt = cache_salt.map(str::to_owned);
        self.hash = self.compute_hash();
        self
    }

    /// The base model name: it selects the tokenizer and block size.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The LoRA adapter, if any.
    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }

    /// A stable 64-bit hash of every field (the chain root is derived from it).
    pub fn hash(&self) -> u64 {
        self.hash
    }

    fn compute_hash(&self) -> u64 {
        // Length-prefixed fields with presence tags: ("ab", "c") never equals ("a", "bc") and
        // `None` never equals `Some("")`.
        let mut h = Xxh3::with_seed(NAMESPACE_SEED);
        let mut field = |tag: u8, value: Option<&str>| match value {
            None => h.update(&[tag, 0]),
            Some(v) => {
                h.update(&[tag, 1]);
                h.update(&(v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
        };
        field(b'm', Some(&self.model));
        field(b'a', self.adapter.as_deref());
        field(b's', self.salt.as_deref());
        field(b'c', self.cache_salt.as_deref());
        h.digest()
    }
}

/// Hashes token-id blocks of one size in one namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size_tokens: u32,
    root: u64,
}

impl BlockHasher {
    /// A hasher for `block_size_tokens`-token blocks (must be > 0; 0 is treated as 1) in `ns`.
    pub fn new(ns: &Namespace, block_size_tokens: u32) -> BlockHasher {
        let block_size_tokens = block_size_tokens.max(1);
        let root = hash_pair(ns.hash(), block_size_tokens as u64);
        BlockHasher {
            block_size_tokens,
            root,
        }
    }

    /// A hasher for the byte-estimate fallback chain of `ns` (see [`super::bytes`]).
    pub(crate) fn for_byte_chunks(ns: &Namespace, block_size_tokens: u32) -> BlockHasher {
        let mut hasher = BlockHasher::new(ns, block_size_tokens);
        hasher.root = hash_pair(hasher.root, BYTE_CHAIN_TAG);
        hasher
    }

    /// Tokens per block.
    pub fn block_size_tokens(&self) -> u32 {
        self.block_size_tokens
    }

    /// The chain root: the parent of block 0.
    pub fn root(&self) -> u64 {
        self.root
    }

    /// The hash of one block given its parent's hash (or [`Self::root`]) and extra keys (media
    /// content hashes). `tokens` is normally exactly one block; any length is hashed as given.
    pub fn hash_block(&self, parent: u64, tokens: &[u32], extra_keys: &[u64]) -> u64 {
        let mut buf = [0u8; 8 + 4 * 64];
        let needed = 8 + 4 * tokens.len() + 8 * extra_keys.len();
        if needed <= buf.len() {
            let mut at = 8;
            buf[..8].copy_from_slice(&parent.to_le_bytes());
            for t in tokens {
                buf[at..at + 4].copy_from_slice(&t.to_le_bytes());
                at += 4;
            }
            for k in extra_keys {
                buf[at..at + 8].copy_from_slice(&k.to_le_bytes());
                at += 8;
            }
            return xxh3_64_with_seed(&buf[..at], BLOCK_HASH_SEED);
        }
        // Large blocks: same byte stream, streamed (the one-shot and streaming xxh3 agree).
        let mut h = Xxh3::with_seed(BLOCK_HASH_SEED);
        h.update(&parent.to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        for k in extra_keys {
            h.update(&k.to_le_bytes());
        }
        h.digest()
    }

    /// Hashes of every full block of `tokens` (block `i` covers tokens `i*B..(i+1)*B`), at most
    /// `max_blocks`. `extra_keys(i)` gives block `i`'s extra keys (empty for text).
    pub fn hash_tokens(&self, tokens: &[u32], max_blocks: usize) -> Vec<u64> {
        self.hash_tokens_with(tokens, max_blocks, |_| &[])
    }

    /// As [`Self::hash_tokens`], with per-block extra keys.
    pub fn hash_tokens_with<'k>(
        &self,
        tokens: &[u32],
        max_blocks: usize,
        extra_keys: impl Fn(usize) -> &'k [u64],
    ) -> Vec<u64> {
        let bs = self.block_size_tokens as usize;
        let n = (tokens.len() / bs).min(max_blocks);
        let mut out = Vec::with_capacity(n);
        let mut parent = self.root;
        for (i, block) in tokens.chunks_exact(bs).take(n).enumerate() {
            parent = self.hash_block(parent, block, extra_keys(i));
            out.push(parent);
        }
        out
    }

    /// Continues a chain with more tokens: hashes every block completed by `state.pending`
    /// followed by `tokens`, appends the hashes to `out`, and leaves the incomplete tail in
    /// `state.pending`.
    ///
    /// This is how an engine's `BlockStored` token ids are re-hashed when the engine's block
    /// size differs from ours (vLLM on CPU uses 128, we default to 16): keep the [`ChainState`]
    /// reached at the end of each engine block (keyed by the engine's block hash), and continue
    /// from the parent's state for the next engine block. Extra keys are not known for engine
    /// blocks, so media blocks re-hashed from events never match router-computed media blocks.
    pub fn extend(&self, state: &mut ChainState, tokens: &[u32], out: &mut Vec<u64>) {
        let bs = self.block_size_tokens as usize;
        let mut tokens = tokens;
        if !state.pending.is_empty() {
            let take = (bs - state.pending.len()).min(tokens.len());
            state.pending.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if state.pending.len() < bs {
                return;
            }
            state.parent = self.hash_block(state.parent, &state.pending, &[]);
            state.blocks += 1;
            out.push(state.parent);
            state.pending.clear();
        }
        let mut chunks = tokens.chunks_exact(bs);
        for block in &mut chunks {
            state.parent = self.hash_block(state.parent, block, &[]);
            state.blocks += 1;
            out.push(state.parent);
        }
        state.pending.extend_from_slice(chunks.remainder());
    }

    /// The state at the start of a chain (no blocks yet).
    pub fn start(&self) -> ChainState {
        ChainState {
            parent: self.root,
            pending: Vec::new(),
            blocks: 0,
        }
    }
}

/// Where a partly hashed token sequence stands: enough context to continue the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainState {
    /// Hash of the last full block (the chain root before any).
    pub parent: u64,
    /// Tokens after the last full block (fewer than the block size).
    pub pending: Vec<u32>,
    /// Full blocks hashed so far.
    pub blocks: u64,
}

/// Combines two 64-bit values into one, stably.
fn hash_pair(a: u64, b: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&a.to_le_bytes());
    buf[8..].copy_from_slice(&b.to_le_bytes());
    xxh3_64_with_seed(&buf, NAMESPACE_SEED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hasher(model: &str, bs: u32) -> BlockHasher {
        BlockHasher::new(&Namespace::new(model, None, None), bs)
    }

    #[test]
    fn hashes_are_stable_across_processes() {
        // Pinned values: a change here breaks hash compatibility between router versions (and
        // any shared index); bump deliberately.
        let h = hasher("m", 4);
        let hashes = h.hash_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 9], usize::MAX);
        assert_eq!(hashes.len(), 2, "only full blocks are hashed");
        let again = hasher("m", 4).hash_tokens(&[1, 2, 3, 4, 5, 6, 7, 8], usize::MAX);
        assert_eq!(hashes, again);
        assert_eq!(hashes, [0xd3d5_998c_69ce_3883, 0x1c95_27e8_1454_df22]);
        assert_eq!(
            Namespace::new("m", None, None).hash(),
            0xf365_2591_fe38_a6c7
        );
        assert_eq!(
            Namespace::new("m", None, None).hash(),
            Namespace::new("m", None, None).hash()
        );
    }

    #[test]
    fn namespace_fields_are_unambiguous() {
        let cases = [
            Namespace::new("ab", Some("c"), None),
            Namespace::new("a", Some("bc"), None),
            Namespace::new("abc", None, None),
            Namespace::new("abc", Some(""), None),
            Namespace::new("abc", None, Some("")),
            Namespace::new("abc", None, None).with_cache_salt(Some("")),
            Namespace::new("abc", None, Some("t1")),
            Namespace::new("abc", None, Some("t2")),
            Namespace::new("abc", None, Some("t1")).with_cache_salt(Some("x")),
        ];
        for (i, a) in cases.iter().enumerate() {
            for b in &cases[i + 1..] {
                assert_ne!(a.hash(), b.hash(), "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn block_size_separates_chains_and_large_blocks_stream_identically() {
        let ns = Namespace::new("m", None, None);
        assert_ne!(
            BlockHasher::new(&ns, 16).root(),
            BlockHasher::new(&ns, 32).root()
        );
        assert_ne!(
            BlockHasher::new(&ns, 16).root(),
            BlockHasher::for_byte_chunks(&ns, 16).root()
        );
        // The stack-buffer and streaming paths hash the same bytes.
        let h = BlockHasher::new(&ns, 128);
        let tokens: Vec<u32> = (0..128).collect();
        let mut xs = Xxh3::with_seed(BLOCK_HASH_SEED);
        xs.update(&7u64.to_le_bytes());
        for t in &tokens {
            xs.update(&t.to_le_bytes());
        }
        assert_eq!(h.hash_block(7, &tokens, &[]), xs.digest());
        let small: Vec<u32> = (0..16).collect();
        let mut buf = 7u64.to_le_bytes().to_vec();
        for t in &small {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            h.hash_block(7, &small, &[]),
            xxh3_64_with_seed(&buf, BLOCK_HASH_SEED)
        );
    }

    #[test]
    fn extra_keys_change_the_block_and_everything_after() {
        let h = hasher("m", 2);
        let tokens = [1, 2, 3, 4, 5, 6];
        let plain = h.hash_tokens(&tokens, usize::MAX);
        let media = [42u64];
        let with = h.hash_tokens_with(
            &tokens,
            usize::MAX,
            |i| {
                if i == 1 {
                    &media[..]
                } else {
                    &[]
                }
            },
        );
        assert_eq!(plain[0], with[0]);
        assert_ne!(plain[1], with[1]);
        assert_ne!(plain[2], with[2]);
    }

    proptest! {
        #[test]
        fn shared_prefix_gives_shared_leading_hashes(
            prefix in prop::collection::vec(any::<u32>(), 0..200),
            a in prop::collection::vec(any::<u32>(), 0..100),
            b in prop::collection::vec(any::<u32>(), 0..100),
            bs in 1u32..40,
        ) {
            let h = hasher("m", bs);
            let ta: Vec<u32> = prefix.iter().chain(&a).copied().collect();
            let tb: Vec<u32> = prefix.iter().chain(&b).copied().collect();
            let (ha, hb) = (h.hash_tokens(&ta, usize::MAX), h.hash_tokens(&tb, usize::MAX));
            let shared = prefix.len() / bs as usize;
            prop_assert_eq!(&ha[..shared], &hb[..shared]);
        }

        #[test]
        fn one_token_change_in_block_k_changes_every_hash_from_k(
            tokens in prop::collection::vec(any::<u32>(), 1..400),
            pick in any::<prop::sample::Index>(),
            delta in 1u32..,
            bs in 1u32..40,
        ) {
            let h = hasher("m", bs);
            let at = pick.index(tokens.len());
            let mut changed = tokens.clone();
            changed[at] = changed[at].wrapping_add(delta);
            let (a, b) = (h.hash_tokens(&tokens, usize::MAX), h.hash_tokens(&changed, usize::MAX));
            let k = at / bs as usize;
            prop_assert_eq!(&a[..k.min(a.len())], &b[..k.min(b.len())]);
            for i in k..a.len() {
                prop_assert_ne!(a[i], b[i], "block {} of {}", i, a.len());
            }
        }

        #[test]
        fn two_namespaces_never_collide(
            tokens in prop::collection::vec(any::<u32>(), 16..300),
            m1 in "[a-z]{1,6}", m2 in "[a-z]{1,6}",
            s1 in proptest::option::of("[a-z]{1,4}"), s2 in proptest::option::of("[a-z]{1,4}"),
            a1 in proptest::option::of("[a-z]{1,4}"), a2 in proptest::option::of("[a-z]{1,4}"),
        ) {
            let n1 = Namespace::new(&m1, a1.as_deref(), s1.as_deref());
            let n2 = Namespace::new(&m2, a2.as_deref(), s2.as_deref());
            prop_assume!(n1 != n2);
            let h1 = BlockHasher::new(&n1, 16).hash_tokens(&tokens, usize::MAX);
            let h2 = BlockHasher::new(&n2, 16).hash_tokens(&tokens, usize::MAX);
            for x in &h1 {
                prop_assert!(!h2.contains(x));
            }
        }

        #[test]
        fn extend_in_engine_sized_pieces_equals_hashing_the_whole_sequence(
            tokens in prop::collection::vec(any::<u32>(), 0..600),
            engine_bs in 1usize..200,
            bs in 1u32..40,
        ) {
            let h = hasher("m", bs);
            let whole = h.hash_tokens(&tokens, usize::MAX);
            let mut state = h.start();
            let mut pieces = Vec::new();
            for piece in tokens.chunks(engine_bs) {
                // Each engine block continues from the state its parent left (cloned, as a
                // map from engine hash to state would hand it back).
                let mut next = state.clone();
                h.extend(&mut next, piece, &mut pieces);
                state = next;
            }
            prop_assert_eq!(whole, pieces);
            prop_assert_eq!(state.blocks as usize, tokens.len() / bs as usize);
            prop_assert_eq!(state.pending.len(), tokens.len() % bs as usize);
        }
    }
}
