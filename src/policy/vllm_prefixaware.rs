//! `vllm-prefix-aware`: the vLLM production stack router's `prefixaware` routing logic
//! (`PrefixAwareRouter` over its `HashTrie`), as its users run it.
//!
//! What it does there: every routed prompt is inserted into a trie of chunk hashes under the
//! endpoint it went to, and never evicted ("we assume that there is no eviction of prefix
//! cache"). A request walks the trie along its own chunks, keeping the set of available
//! endpoints on every node it passes, and stops where that set would become empty; it then goes
//! to one endpoint of the set **at random**, with no load term at all (an unmatched prompt is
//! therefore a uniformly random pick). Only with `--prefix-min-match-length` > 0 does a short
//! match fall back to the lowest-QPS endpoint (here `min_match_tokens`, default 0 as there).
//!
//! What differs here: the trie is over the router's block hashes instead of 128-character
//! chunks of the concatenated message contents ([`super::approx_tree`]: no prompt text is
//! kept, and matches differ by at most a block); an endpoint is registered in the trie when the
//! router commits to it (at ranking time, as the original does at selection time, so an
//! `explain` call counts as a routing too); and a safety bound the original lacks
//! (`max_blocks`, default 4 Mi blocks) clears the trie when it is reached, so a long-running
//! router cannot grow without limit. The fallbacks handed to Envoy after the pick are the other
//! candidates, least loaded first.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use rand::Rng;

use super::approx_tree::ApproxTree;
use super::vllm_qps::QpsMeter;
use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::{PolicyConfig, VllmPrefixAwareConfig};

/// The production stack's prefix-aware router.
#[derive(Debug)]
pub struct VllmPrefixAware {
    config: VllmPrefixAwareConfig,
    tokens_per_request: f64,
    state: Mutex<State>,
    rotation: AtomicUsize,
    origin: Instant,
}

#[derive(Debug, Default)]
struct State {
    trie: ApproxTree,
    qps: QpsMeter,
}

impl State {
    /// Inserts a prompt sent to `address` into the trie, clearing the trie first when it would
    /// pass `max_blocks` (the production stack's safety bound).
    fn learn(
        &mut self,
        address: SocketAddr,
        blocks: &[u64],
        block_size_tokens: u32,
        now_ms: u64,
        max_blocks: usize,
    ) {
        if self.trie.len() + blocks.len() > max_blocks {
            self.trie.clear();
        }
        self.trie
            .insert_for(address, blocks, block_size_tokens, now_ms);
    }
}

impl VllmPrefixAware {
    /// Milliseconds from the policy's creation to `now` (the trie's recency stamps).
    fn ms_since_origin(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_millis() as u64
    }

    /// The policy with `config.vllm_prefixaware`, an empty trie.
    pub fn new(config: &PolicyConfig) -> VllmPrefixAware {
        VllmPrefixAware {
            config: config.vllm_prefixaware.clone(),
            tokens_per_request: config.least_loaded.tokens_per_request,
            state: Mutex::new(State::default()),
            rotation: AtomicUsize::new(0),
            origin: Instant::now(),
        }
    }

    /// [`Policy::rank`] at `now`, picking among matches with `pick_random(n)` (a number in
    /// `0..n`).
    pub fn rank_at(
        &self,
        now: Instant,
        request: &RequestView,
        candidates: &[CandidateView],
        pick_random: impl FnOnce(usize) -> usize,
    ) -> Ranking {
        let n = candidates.len();
        let now_ms = self.ms_since_origin(now);
        let blocks = &request.prefix_blocks[..];
        let block_tokens = u64::from(request.block_size_tokens.max(1));
        let mut state = self.state.lock();
        // The available endpoints on each node passed; stop where none would remain.
        let ids: Vec<Option<u16>> = candidates
            .iter()
            .map(|c| state.trie.known(&c.address))
            .collect();
        let mut matched: Vec<usize> = (0..n).collect();
        let mut matched_blocks = 0usize;
        for node in state.trie.walk(blocks) {
            let next: Vec<usize> = matched
                .iter()
                .copied()
                .filter(|&i| ids[i].is_some_and(|t| node.contains(t)))
                .collect();
            if next.is_empty() {
                break;
            }
            matched = next;
            matched_blocks += 1;
        }
        let matched_tokens = (matched_blocks as u64 * block_tokens).min(request.prompt_tokens);
        let pick = if matched_tokens < self.config.min_match_tokens {
            state.qps.lowest(now, candidates)
        } else {
            matched[pick_random(matched.len())]
        };
        state.learn(
            candidates[pick].address,
            blocks,
            request.block_size_tokens,
            now_ms,
            self.config.max_blocks,
        );
        state.qps.record(now, candidates[pick].address);
        drop(state);

        let load = |i: usize| candidates[i].weighted_load(self.tokens_per_request);
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let rest: Vec<usize> = (0..n).filter(|&i| i != pick).collect();
        let mut order = vec![pick];
        order.extend(order_by(
            &rest,
            load,
            0.0,
            |_| 0.0,
            rotation,
            n,
            request.places() - 1,
        ));
        let score = |i: usize| {
            if matched_blocks > 0 && matched.contains(&i) {
                matched_tokens as f64 / request.prompt_tokens.max(1) as f64
            } else {
                0.0
            }
        };
        Ranking {
            order,
            scores: (0..n).map(|i| Some(score(i))).collect(),
            predicted_ttft_ms: None,
        }
    }
}

impl Policy for VllmPrefixAware {
    fn name(&self) -> &'static str {
        "vllm-prefix-aware"
    }

    fn wants_prefix_blocks(&self) -> bool {
        true
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        self.rank_at(Instant::now(), request, candidates, |n| {
            rand::rng().random_range(0..n)
        })
    }

    fn record_rest(&self, endpoint: SocketAddr, blocks: &[u64], block_size_tokens: u32) {
        let now_ms = self.ms_since_origin(Instant::now());
        self.state.lock().learn(
            endpoint,
            blocks,
            block_size_tokens,
            now_ms,
            self.config.max_blocks,
        );
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

    #[test]
    fn an_unmatched_prompt_goes_anywhere_at_random_and_its_prefix_then_follows_it() {
        let p = VllmPrefixAware::new(&PolicyConfig::default());
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0), candidate(3, 9, 0)];
        let now = Instant::now();
        // Nothing known: every candidate is a match of length 0; the random draw decides, even
        // for the busiest one (no load term).
        let r = p.rank_at(now, &prompt(&[1, 2, 3]), &cands, |n| {
            assert_eq!(n, 3);
            2
        });
        assert_eq!(r.pick(), 2);
        assert_permutation(&r, 3);
        // The same prefix: only candidate 2 is on the path.
        let r = p.rank_at(now, &prompt(&[1, 2, 7]), &cands, |n| {
            assert_eq!(n, 1);
            0
        });
        assert_eq!(r.pick(), 2);
        assert_eq!(r.scores[2], Some(32.0 / 48.0));
    }

    /// The rest of a prompt decided on its first block joins the trie under its pick: the next
    /// request sharing it walks to that endpoint alone.
    #[test]
    fn the_rest_of_a_prompt_joins_the_trie_under_its_pick() {
        let p = VllmPrefixAware::new(&PolicyConfig::default());
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        let now = Instant::now();
        p.rank_at(now, &prompt(&[1]), &cands, |_| 1);
        {
            // Endpoint 0 was sent block 1 too.
            let mut state = p.state.lock();
            let t = state.trie.tenant(cands[0].address).unwrap();
            state.trie.insert(&[1], t, 16, 0);
        }
        // Both hold block 1; the rest [2, 3] of endpoint 1's prompt follows it there only.
        p.record_rest(cands[1].address, &[1, 2, 3], 16);
        let r = p.rank_at(now, &prompt(&[1, 2, 3, 4]), &cands, |n| {
            assert_eq!(n, 1, "only endpoint 1 holds blocks 2-3");
            0
        });
        assert_eq!((r.pick(), r.scores[1]), (1, Some(48.0 / 64.0)));
    }

    #[test]
    fn the_walk_keeps_the_endpoints_present_at_every_node() {
        let p = VllmPrefixAware::new(&PolicyConfig::default());
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0), candidate(3, 0, 0)];
        let now = Instant::now();
        p.rank_at(now, &prompt(&[1, 2, 3]), &cands, |n| {
            assert_eq!(n, 3, "nothing known: all match");
            0
        });
        {
            // Endpoint 1 was sent [1, 2] too.
            let mut state = p.state.lock();
            let t = state.trie.tenant(cands[1].address).unwrap();
            state.trie.insert(&[1, 2], t, 16, 0);
        }
        // Blocks 1-2 are on endpoints 0 and 1: a random one of the two.
        let r = p.rank_at(now, &prompt(&[1, 2, 9]), &cands, |n| {
            assert_eq!(n, 2);
            1
        });
        assert_eq!(r.pick(), 1);
        // Block 3 only on endpoint 0: the walk narrows to it.
        let r = p.rank_at(now, &prompt(&[1, 2, 3, 4]), &cands, |n| {
            assert_eq!(n, 1, "only endpoint 0 holds all three known blocks");
            0
        });
        assert_eq!(r.pick(), 0);
        assert_eq!(r.scores[0], Some(48.0 / 64.0));
        // Endpoint 0 not available: the walk stops where the available set would empty.
        let r = p.rank_at(now, &prompt(&[1, 2, 3]), &cands[1..], |n| {
            assert_eq!(n, 1, "only endpoint 1 among the available holds 1-2");
            0
        });
        assert_eq!(r.pick(), 0);
        assert_eq!(r.scores[0], Some(32.0 / 48.0));
        assert_permutation(&r, 2);
    }

    #[test]
    fn a_minimum_match_falls_back_to_the_lowest_qps() {
        let mut config = PolicyConfig::default();
        config.vllm_prefixaware.min_match_tokens = 32;
        let p = VllmPrefixAware::new(&config);
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        let now = Instant::now();
        // Never-routed endpoints first, in order: 0, then 1, then the lower rate.
        let picks: Vec<usize> = (0..3)
            .map(|k| {
                p.rank_at(now, &prompt(&[100 + k]), &cands, |_| unreachable!())
                    .pick()
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 0]);
    }

    #[test]
    fn the_safety_bound_clears_the_trie() {
        let mut config = PolicyConfig::default();
        config.vllm_prefixaware.max_blocks = 4;
        let p = VllmPrefixAware::new(&config);
        let cands = [candidate(1, 0, 0), candidate(2, 0, 0)];
        let now = Instant::now();
        p.rank_at(now, &prompt(&[1, 2, 3]), &cands, |_| 1);
        p.rank_at(now, &prompt(&[4, 5, 6]), &cands, |_| 1);
        assert_eq!(p.state.lock().trie.len(), 3, "cleared, then the new prompt");
    }
}
