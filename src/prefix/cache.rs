//! The per-message token cache: token ids of rendered prompt segments, keyed by a hash of the
//! segment text and its position context, bounded by the total number of cached tokens.
//!
//! A shared system prompt is tokenized once and then served from here. The cache is sharded so
//! concurrent requests rarely wait on each other; a lookup holds a shard lock only to clone an
//! `Arc`. Tokenizing happens outside any lock (two requests missing the same segment at once
//! both tokenize it; the second insert wins, harmlessly).

use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;
use xxhash_rust::xxh3::Xxh3;

const SHARDS: usize = 8;

/// Identifies one segment: 128-bit hash of (position context, text) plus the text length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SegmentKey {
    hash: u128,
    len: usize,
}

impl SegmentKey {
    /// The key of `text` at position context `context` (e.g. "first segment of the prompt").
    pub(crate) fn new(context: u8, text: &str) -> SegmentKey {
        let mut h = Xxh3::new();
        h.update(&[context]);
        h.update(text.as_bytes());
        SegmentKey {
            hash: h.digest128(),
            len: text.len(),
        }
    }
}

struct Shard {
    lru: LruCache<SegmentKey, Arc<[u32]>>,
    tokens: usize,
}

/// A bounded LRU of segment token ids.
pub(crate) struct SegmentCache {
    shards: Vec<Mutex<Shard>>,
    max_tokens_per_shard: usize,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("cached_tokens", &self.cached_tokens())
            .field("max_tokens", &(self.max_tokens_per_shard * SHARDS))
            .finish()
    }
}

impl SegmentCache {
    /// A cache holding at most `max_tokens` token ids in total (0 disables caching).
    pub(crate) fn new(max_tokens: usize) -> SegmentCache {
        SegmentCache {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        lru: LruCache::unbounded(),
                        tokens: 0,
                    })
                })
                .collect(),
            max_tokens_per_shard: max_tokens / SHARDS,
        }
    }

    fn shard(&self, key: &SegmentKey) -> &Mutex<Shard> {
        &self.shards[(key.hash as usize) % SHARDS]
    }

    /// The cached ids of `key`, marking it recently used.
    pub(crate) fn get(&self, key: &SegmentKey) -> Option<Arc<[u32]>> {
        self.shard(key).lock().lru.get(key).cloned()
    }

    /// Caches `ids` under `key`, evicting least recently used segments past the bound. A segment
    /// larger than a shard's whole budget is not cached.
    pub(crate) fn insert(&self, key: SegmentKey, ids: Arc<[u32]>) {
        if ids.len() > self.max_tokens_per_shard {
            return;
        }
        let mut shard = self.shard(&key).lock();
        shard.tokens += ids.len();
        if let Some(old) = shard.lru.put(key, ids) {
            shard.tokens -= old.len();
        }
        while shard.tokens > self.max_tokens_per_shard {
            match shard.lru.pop_lru() {
                Some((_, evicted)) => shard.tokens -= evicted.len(),
                None => break,
            }
        }
    }

    /// Token ids held, over all shards.
    pub(crate) fn cached_tokens(&self) -> usize {
        self.shards.iter().map(|s| s.lock().tokens).sum()
    }

    /// Segments held, over all shards.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().lru.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Arc<[u32]> {
        (0..n as u32).collect::<Vec<_>>().into()
    }

    #[test]
    fn keys_separate_text_and_context() {
        assert_eq!(SegmentKey::new(0, "abc"), SegmentKey::new(0, "abc"));
        assert_ne!(SegmentKey::new(0, "abc"), SegmentKey::new(1, "abc"));
        assert_ne!(SegmentKey::new(0, "abc"), SegmentKey::new(0, "abd"));
    }

    #[test]
    fn bounded_by_tokens_and_evicts_least_recently_used() {
        let cache = SegmentCache::new(SHARDS * 100);
        // Find three keys in one shard so the per-shard bound is what we exercise.
        let mut keys = Vec::new();
        for i in 0.. {
            let k = SegmentKey::new(0, &format!("segment {i}"));
            if (k.hash as usize) % SHARDS == 0 {
                keys.push(k);
                if keys.len() == 3 {
                    break;
                }
            }
        }
        cache.insert(keys[0], ids(40));
        cache.insert(keys[1], ids(40));
        assert!(cache.get(&keys[0]).is_some()); // keys[1] is now least recently used
        cache.insert(keys[2], ids(40));
        assert!(cache.get(&keys[1]).is_none());
        assert_eq!(cache.get(&keys[0]).unwrap().len(), 40);
        assert_eq!(cache.get(&keys[2]).unwrap().len(), 40);
        assert_eq!(cache.cached_tokens(), 80);
        assert_eq!(cache.len(), 2);
        // Too large for a shard: not cached at all.
        let big = SegmentKey::new(0, "big");
        cache.insert(big, ids(101));
        assert!(cache.get(&big).is_none());
        // Disabled cache holds nothing.
        let off = SegmentCache::new(0);
        off.insert(keys[0], ids(1));
        assert_eq!(off.cached_tokens(), 0);
    }
}
