//! Chained block hashes, structured as vLLM's `hash_block_tokens`: a full block's hash covers
//! (parent hash, the block's token ids, extra keys), so equal hashes mean equal prefixes.
//!
//! Extra keys follow vLLM's `generate_block_hash_extra_keys`, in its order: the LoRA name (every
//! block), the hashes of multimodal items overlapping the block, and `cache_salt` (first block
//! only). The hash function is xxh3-64 with a fixed seed instead of vLLM's SHA-256 with a
//! per-process random `NONE_HASH`: the simulator wants hashes equal across runs. Hashes are
//! u64, which is also what vLLM publishes in KV events when it converts hashes to ints.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::tokenize::MmSpan;

/// What a request adds to every block hash besides tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct HashKeys<'a> {
    /// LoRA adapter name (vLLM: `lora_request.lora_name`).
    pub lora_name: Option<&'a str>,
    /// vLLM's `cache_salt` request field.
    pub cache_salt: Option<&'a str>,
    /// Multimodal placeholder runs of the prompt.
    pub mm: &'a [MmSpan],
}

/// One extra key of one block, as KV events report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A LoRA name.
    Lora(Box<str>),
    /// A multimodal item's hash.
    Mm(u64),
    /// The request's cache salt.
    Salt(Box<str>),
}

/// Hashes blocks with a seed fixed at construction.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    seed: u64,
    none_hash: u64,
    block_size: u32,
    scratch: Vec<u8>,
}

const KEY_LORA: u8 = 1;
const KEY_MM: u8 = 2;
const KEY_SALT: u8 = 3;

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens, chain seeded by `seed`.
    pub fn new(block_size: u32, seed: u64) -> BlockHasher {
        BlockHasher {
            seed,
            none_hash: xxh3_64_with_seed(b"kvsim NONE_HASH", seed),
            block_size,
            scratch: Vec::with_capacity(block_size as usize * 4 + 64),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The hash of the block holding tokens `[start, start + block_size)` of a request whose
    /// previous block hashed to `parent` (`None` for the first block).
    pub fn hash_block(
        &mut self,
        parent: Option<u64>,
        tokens: &[u32],
        start: u32,
        keys: &HashKeys<'_>,
    ) -> u64 {
        let buf = &mut self.scratch;
        buf.clear();
        buf.extend_from_slice(&parent.unwrap_or(self.none_hash).to_le_bytes());
        buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        for_each_key(keys, start, self.block_size, |key| match key {
            KeyRef::Lora(name) => push_str(buf, KEY_LORA, name),
            KeyRef::Mm(hash) => {
                buf.push(KEY_MM);
                buf.extend_from_slice(&hash.to_le_bytes());
            }
            KeyRef::Salt(salt) => push_str(buf, KEY_SALT, salt),
        });
        xxh3_64_with_seed(buf, self.seed)
    }

    /// Appends the hashes of every full block of `tokens` from block `hashes.len()` on.
    pub fn extend_hashes(&mut self, tokens: &[u32], keys: &HashKeys<'_>, hashes: &mut Vec<u64>) {
        let bs = self.block_size as usize;
        while (hashes.len() + 1) * bs <= tokens.len() {
            let i = hashes.len();
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            let h = self.hash_block(parent, &tokens[i * bs..(i + 1) * bs], (i * bs) as u32, keys);
            hashes.push(h);
        }
    }

    /// The extra keys of the block starting at token `start`, `None` when it has none (as vLLM).
    pub fn extra_keys(&self, keys: &HashKeys<'_>, start: u32) -> Option<Vec<ExtraKey>> {
        let mut out = Vec::new();
        for_each_key(keys, start, self.block_size, |key| {
            out.push(match key {
                KeyRef::Lora(name) => ExtraKey::Lora(name.into()),
                KeyRef::Mm(hash) => ExtraKey::Mm(hash),
                KeyRef::Salt(salt) => ExtraKey::Salt(salt.into()),
            })
        });
        (!out.is_empty()).then_some(out)
    }
}

enum KeyRef<'a> {
    Lora(&'a str),
    Mm(u64),
    Salt(&'a str),
}

fn for_each_key<'a>(
    keys: &HashKeys<'a>,
    start: u32,
    block_size: u32,
    mut f: impl FnMut(KeyRef<'a>),
) {
    if let Some(name) = keys.lora_name {
        f(KeyRef::Lora(name));
    }
    let end = start + block_size;
    for span in keys.mm {
        if span.offset < end && span.offset + span.len > start {
            f(KeyRef::Mm(span.hash));
        }
    }
    if let (Some(salt), 0) = (keys.cache_salt, start) {
        f(KeyRef::Salt(salt));
    }
}

fn push_str(buf: &mut Vec<u8>, tag: u8, s: &str) {
    buf.push(tag);
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hashes(tokens: &[u32], keys: HashKeys<'_>) -> Vec<u64> {
        let mut out = Vec::new();
        BlockHasher::new(4, 0).extend_hashes(tokens, &keys, &mut out);
        out
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(hashes(&[1, 2, 3], HashKeys::default()).len(), 0);
        assert_eq!(hashes(&[1, 2, 3, 4], HashKeys::default()).len(), 1);
        assert_eq!(hashes(&[1; 11], HashKeys::default()).len(), 2);
    }

    #[test]
    fn chain_and_keys_separate_prefixes() {
        let base = hashes(&[1, 2, 3, 4, 5, 6, 7, 8], HashKeys::default());
        // Same second block after a different first block: different hash (chained).
        let other = hashes(&[9, 2, 3, 4, 5, 6, 7, 8], HashKeys::default());
        assert_ne!(base[1], other[1]);
        let lora = hashes(
            &[1, 2, 3, 4, 5, 6, 7, 8],
            HashKeys {
                lora_name: Some("a"),
                ..Default::default()
            },
        );
        assert_ne!(base[0], lora[0]);
        assert_ne!(base[1], lora[1]);
        let salted = hashes(
            &[1, 2, 3, 4, 5, 6, 7, 8],
            HashKeys {
                cache_salt: Some("s"),
                ..Default::default()
            },
        );
        assert_ne!(base[0], salted[0]);
        let mm = [MmSpan {
            offset: 5,
            len: 2,
            hash: 7,
        }];
        let with_mm = hashes(
            &[1, 2, 3, 4, 5, 6, 7, 8],
            HashKeys {
                mm: &mm,
                ..Default::default()
            },
        );
        assert_eq!(base[0], with_mm[0], "the image is only in the second block");
        assert_ne!(base[1], with_mm[1]);
    }

    #[test]
    fn extra_keys_follow_vllm_order_and_salt_only_on_the_first_block() {
        let mm = [MmSpan {
            offset: 2,
            len: 4,
            hash: 9,
        }];
        let keys = HashKeys {
            lora_name: Some("l"),
            cache_salt: Some("s"),
            mm: &mm,
        };
        let h = BlockHasher::new(4, 0);
        assert_eq!(
            h.extra_keys(&keys, 0),
            Some(vec![
                ExtraKey::Lora("l".into()),
                ExtraKey::Mm(9),
                ExtraKey::Salt("s".into())
            ])
        );
        assert_eq!(
            h.extra_keys(&keys, 4),
            Some(vec![ExtraKey::Lora("l".into()), ExtraKey::Mm(9)])
        );
        assert_eq!(h.extra_keys(&HashKeys::default(), 0), None);
    }

    #[test]
    fn the_seed_changes_every_hash() {
        let mut a = BlockHasher::new(4, 0);
        let mut b = BlockHasher::new(4, 1);
        let keys = HashKeys::default();
        assert_ne!(
            a.hash_block(None, &[1, 2, 3, 4], 0, &keys),
            b.hash_block(None, &[1, 2, 3, 4], 0, &keys)
        );
    }

    proptest! {
        #[test]
        fn shared_prefix_shares_leading_hashes(prefix in proptest::collection::vec(0u32..50, 0..40),
                                               a in proptest::collection::vec(0u32..50, 0..20),
                                               b in proptest::collection::vec(0u32..50, 0..20)) {
            let ta: Vec<u32> = prefix.iter().chain(&a).copied().collect();
            let tb: Vec<u32> = prefix.iter().chain(&b).copied().collect();
            let ha = hashes(&ta, HashKeys::default());
            let hb = hashes(&tb, HashKeys::default());
            let full = prefix.len() / 4;
            prop_assert_eq!(&ha[..full], &hb[..full]);
            // Incremental hashing gives the same chain as hashing all at once.
            let mut inc = Vec::new();
            let mut h = BlockHasher::new(4, 0);
            for n in 0..=ta.len() {
                h.extend_hashes(&ta[..n], &HashKeys::default(), &mut inc);
            }
            prop_assert_eq!(inc, ha);
        }
    }
}
