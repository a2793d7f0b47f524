//! `sglang-cache-aware`: SGLang's router `cache_aware` policy (sgl-router; CLI defaults
//! `--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5
//! --eviction-interval-secs 120 --max-tree-size 2^26`), as its users run it.
//!
//! What it does there: load is the router's own count of requests in flight per worker. If the
//! fleet is imbalanced (`max - min > balance_abs_threshold` and `max > min *
//! balance_rel_threshold`) the least loaded worker gets the request. Otherwise the request's
//! text is matched in an approximate radix tree of what the router sent where (its own
//! decisions, no engine signal): the longest matched prefix, and one worker on the deepest
//! matched node (the first in the node's map, an arbitrary but fixed order). If the match
//! covers more than `cache_threshold` of the text, that worker gets it; otherwise the worker
//! with the **smallest tree** (fewest characters sent to it and not yet evicted: "most cache
//! capacity"). Either way the text is then inserted under the chosen worker. Every
//! `eviction_interval_secs`, each worker whose tree exceeds `max_tree_size` loses its least
//! recently used leaves until it fits. The tree knows nothing of what engines hold or can hold.
//! A matched worker that is not available sends the request to the first available one.
//!
//! What differs here: the tree is over the router's block hashes, sizes are in tokens
//! (`max_tree_tokens`, default 2^24 = SGLang's 2^26 characters at ~4 characters per token), and
//! the match rate is matched tokens over prompt tokens ([`super::approx_tree`]; no prompt text is
//! kept); eviction runs when a decision finds the interval elapsed rather than on a timer
//! thread; one tree serves every model (SGLang keeps one per model; the hashes of different
//! models never collide, but tree sizes add up across models). An endpoint joins the tree when
//! the router ranks it first (an `explain` call counts as a routing). The fallbacks handed to
//! Envoy after the pick are the others, least loaded first.
//!
//! `sglang-cache-aware-index` ([`super::sglang_index`]) keeps SGLang's thresholds but reads
//! kvrouter's capacity-aware index instead of an approximate tree.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::approx_tree::{ApproxTree, Tenant};
use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::{PolicyConfig, SglangConfig};

/// SGLang's cache-aware policy with its own approximate tree.
#[derive(Debug)]
pub struct SglangCacheAware {
    config: SglangConfig,
    state: Mutex<State>,
    rotation: AtomicUsize,
    origin: Instant,
    /// Seed of the fixed, arbitrary order in which a node's workers (and equally small trees)
    /// are considered, as SGLang's hash maps iterate.
    order_seed: u64,
}

#[derive(Debug)]
struct State {
    tree: ApproxTree,
    last_eviction: Instant,
}

impl SglangCacheAware {
    /// The policy with `config.sglang_cache_aware`, an empty tree.
    pub fn new(config: &PolicyConfig) -> SglangCacheAware {
        Self::with_seed(config, rand::random())
    }

    /// As [`Self::new`], with the seed of the arbitrary worker order fixed.
    pub fn with_seed(config: &PolicyConfig, order_seed: u64) -> SglangCacheAware {
        let now = Instant::now();
        SglangCacheAware {
            config: config.sglang_cache_aware.clone(),
            state: Mutex::new(State {
                tree: ApproxTree::default(),
                last_eviction: now,
            }),
            rotation: AtomicUsize::new(0),
            origin: now,
            order_seed,
        }
    }

    /// Whether the loads count as imbalanced.
    pub fn imbalanced(&self, loads: &[u64]) -> bool {
        let max = loads.iter().copied().max().unwrap_or(0);
        let min = loads.iter().copied().min().unwrap_or(0);
        max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold
    }

    /// The arbitrary but fixed rank of `tenant` among equals.
    fn arbitrary(&self, tree: &ApproxTree, tenant: Tenant) -> u64 {
        let a = tree.address(tenant);
        let mut x = self.order_seed ^ u64::from(a.port()) << 32;
        if let std::net::IpAddr::V4(ip) = a.ip() {
            x ^= u64::from(u32::from(ip));
        }
        // splitmix64: a fixed permutation of the workers for this seed.
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// Milliseconds from the policy's creation to `now` (the tree's recency stamps).
    fn ms_since_origin(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_millis() as u64
    }

    /// [`Policy::rank`] at `now`.
    pub fn rank_at(
        &self,
        now: Instant,
        request: &RequestView,
        candidates: &[CandidateView],
    ) -> Ranking {
        let n = candidates.len();
        let blocks = &request.prefix_blocks[..];
        let block_tokens = u64::from(request.block_size_tokens.max(1));
        let now_ms = self.ms_since_origin(now);
        let loads: Vec<u64> = candidates
            .iter()
            .map(|c| c.load.in_flight_requests)
            .collect();
        let by_load = |i: usize| (loads[i], i);
        let least_loaded = (0..n).min_by_key(|&i| by_load(i)).unwrap_or(0);

        let mut state = self.state.lock();
        if now.saturating_duration_since(state.last_eviction)
            >= Duration::from_millis(self.config.eviction_interval_ms)
        {
            state
                .tree
                .evict_to(self.config.max_tree_tokens, block_tokens);
            state.last_eviction = now;
        }
        // Every candidate is a worker of the tree (SGLang registers each with an empty text).
        let tenants: Vec<Option<Tenant>> = candidates
            .iter()
            .map(|c| state.tree.tenant(c.address))
            .collect();
        let position = |t: Tenant| tenants.iter().position(|&x| x == Some(t));

        let mut matched_blocks = 0usize;
        let mut deepest: Option<Tenant> = None;
        let mut match_rate = 0.0;
        let (pick, insert) = if self.imbalanced(&loads) {
            (least_loaded, true)
        } else {
            for node in state.tree.walk(blocks) {
                matched_blocks += 1;
                deepest = node.iter().min_by_key(|&t| self.arbitrary(&state.tree, t));
            }
            let matched_tokens = (matched_blocks as u64 * block_tokens).min(request.prompt_tokens);
            match_rate = if request.prompt_tokens == 0 {
                0.0
            } else {
                matched_tokens as f64 / request.prompt_tokens as f64
            };
            // A miss goes to the smallest tree among this decision's workers (fixed order on
            // ties). The tree is shared by every model and keeps every address it saw;
            // SGLang's is per model and drops a removed worker, so another model's endpoint or
            // a departed one must not be "smallest" (the request went to the first candidate,
            // inserted nowhere, for good).
            let smallest = |t: Tenant| (state.tree.size_tokens(t), self.arbitrary(&state.tree, t));
            let chosen = if match_rate > self.config.cache_threshold {
                deepest
            } else {
                tenants
                    .iter()
                    .flatten()
                    .copied()
                    .min_by_key(|&t| smallest(t))
            };
            match chosen.and_then(position) {
                Some(i) => (i, true),
                // Not available: SGLang sends the request to the first healthy worker and
                // inserts nothing.
                None => (0, false),
            }
        };
        if insert {
            if let Some(t) = tenants[pick] {
                state.tree.insert(blocks, t, block_tokens, now_ms);
            }
        }
        drop(state);

        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let rest: Vec<usize> = (0..n).filter(|&i| i != pick).collect();
        let mut order = vec![pick];
        order.extend(order_by(
            &rest,
            |i| loads[i] as f64,
            0.0,
            |_| 0.0,
            rotation,
            n,
            request.places() - 1,
        ));
        Ranking {
            order,
            scores: (0..n)
                .map(|i| Some(if i == pick { match_rate } else { 0.0 }))
                .collect(),
            predicted_ttft_ms: None,
        }
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang-cache-aware"
    }

    fn wants_prefix_blocks(&self) -> bool {
        true
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        self.rank_at(Instant::now(), request, candidates)
    }

    fn record_rest(&self, endpoint: SocketAddr, blocks: &[u64], block_size_tokens: u32) {
        let now_ms = self.ms_since_origin(Instant::now());
        self.state
            .lock()
            .tree
            .insert_for(endpoint, blocks, block_size_tokens, now_ms);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::policy::testing::{assert_permutation, candidate, request};

    fn prompt(blocks: &[u64]) -> RequestView {
        RequestView {
            prefix_blocks: Arc::from(blocks),
            block_size_tokens: 16,
            ranked: 0,
            ..request(blocks.len() as u64 * 16)
        }
    }

    fn policy() -> SglangCacheAware {
        SglangCacheAware::with_seed(&PolicyConfig::default(), 7)
    }

    #[test]
    fn imbalance_needs_both_thresholds() {
        let p = policy();
        assert!(!p.imbalanced(&[0, 64]), "abs not exceeded");
        assert!(p.imbalanced(&[0, 65]));
        assert!(!p.imbalanced(&[200, 280]), "rel not exceeded (280 < 300)");
        assert!(p.imbalanced(&[100, 165]));
    }

    #[test]
    fn a_miss_goes_to_the_smallest_tree_not_the_least_loaded() {
        let p = policy();
        let now = Instant::now();
        let cands = [candidate(1, 0, 0), candidate(2, 30, 0)];
        // Both trees empty: the fixed order decides; the first prompt lands somewhere.
        let first = p.rank_at(now, &prompt(&[1, 2, 3, 4]), &cands).pick();
        // A different prompt: the other tree is smaller (0 tokens), load notwithstanding.
        let second = p.rank_at(now, &prompt(&[5, 6]), &cands).pick();
        assert_ne!(first, second);
        // Another: endpoint `second` has 32 tokens, `first` 64: `second` again.
        assert_eq!(p.rank_at(now, &prompt(&[7]), &cands).pick(), second);
    }

    #[test]
    fn a_miss_goes_to_the_smallest_tree_of_this_decisions_workers() {
        // The tree is shared by every model and remembers every address: another model's
        // endpoint (or a departed one) with a smaller tree must not take the miss away.
        let p = policy();
        let now = Instant::now();
        p.rank_at(now, &prompt(&[100]), &[candidate(3, 0, 0)]); // elsewhere: 16 tokens
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        p.rank_at(now, &prompt(&[1, 2, 3, 4]), &cands); // one tree at 64
        let small = p.rank_at(now, &prompt(&[5, 6]), &cands).pick(); // the other at 32
        let first = p.rank_at(now, &prompt(&[7]), &cands);
        assert_eq!(first.pick(), small, "the smaller of its own workers");
        // And the prompt went into that tree: the same prompt now matches.
        let again = p.rank_at(now, &prompt(&[7]), &cands);
        assert_eq!(again.pick(), small);
        assert_eq!(again.scores[again.pick()], Some(1.0), "{again:?}");
    }

    #[test]
    fn a_match_above_the_threshold_follows_the_tree_whatever_the_engine_holds() {
        let p = policy();
        let now = Instant::now();
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        let home = p.rank_at(now, &prompt(&[1, 2, 3, 4]), &cands).pick();
        // 3 of 4 blocks (75% > 30%): the same worker, even though the candidate view says
        // nothing is cached there (the tree ignores the index).
        let r = p.rank_at(now, &prompt(&[1, 2, 3, 9]), &cands);
        assert_eq!(r.pick(), home);
        assert_eq!(r.scores[home], Some(0.75));
        assert_permutation(&r, 2);
        // 1 of 4 (25%): a miss, the smallest tree (the other one).
        assert_ne!(p.rank_at(now, &prompt(&[1, 7, 8, 9]), &cands).pick(), home);
    }

    /// A request decided on its prompt's first block (the rest deferred or cut by the budget)
    /// has its whole prompt inserted once the rest is tokenized: the next turn, sharing all of
    /// it, matches above the threshold and follows it, as SGLang's text tree would.
    #[test]
    fn the_rest_of_a_prompt_joins_the_tree_under_its_pick() {
        let p = policy();
        let now = Instant::now();
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        let whole = [1, 2, 3, 4, 5, 6, 7, 8];
        let home = p.rank_at(now, &prompt(&whole[..1]), &cands).pick();
        let next_turn = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        // Without the rest: 1 of 10 blocks (10%) is a miss, the smallest tree (the other one).
        let before = SglangCacheAware::with_seed(&PolicyConfig::default(), 7);
        let first = before.rank_at(now, &prompt(&whole[..1]), &cands).pick();
        assert_eq!(first, home);
        assert_ne!(
            before.rank_at(now, &prompt(&next_turn), &cands).pick(),
            home
        );
        // With it: 8 of 10 (80%), the same worker.
        p.record_rest(cands[home].address, &whole, 16);
        let r = p.rank_at(now, &prompt(&next_turn), &cands);
        assert_eq!((r.pick(), r.scores[home]), (home, Some(0.8)));
    }

    #[test]
    fn imbalanced_fleet_goes_to_the_least_loaded_and_still_learns() {
        let p = policy();
        let now = Instant::now();
        let cands = [candidate(1, 2, 0), candidate(2, 100, 0)];
        assert_eq!(p.rank_at(now, &prompt(&[1, 2]), &cands).pick(), 0);
        let balanced = [candidate(1, 5, 0), candidate(2, 5, 0)];
        assert_eq!(p.rank_at(now, &prompt(&[1, 2, 3]), &balanced).pick(), 0);
    }

    #[test]
    fn periodic_eviction_forgets_the_least_recently_used_beyond_the_bound() {
        let mut config = PolicyConfig::default();
        config.sglang_cache_aware.max_tree_tokens = 32;
        config.sglang_cache_aware.eviction_interval_ms = 10_000;
        let p = SglangCacheAware::with_seed(&config, 7);
        let t0 = Instant::now();
        let one = [candidate(1, 0, 0)];
        p.rank_at(t0, &prompt(&[1, 2, 3, 4]), &one);
        assert_eq!(p.state.lock().tree.size_tokens(0), 64, "no eviction yet");
        p.rank_at(t0 + Duration::from_secs(11), &prompt(&[9]), &one);
        // Evicted to 32 tokens first (blocks 3, 4), then block 9 inserted.
        assert_eq!(p.state.lock().tree.size_tokens(0), 48);
        assert_eq!(p.state.lock().tree.walk(&[1, 2, 3]).count(), 2);
    }
}
