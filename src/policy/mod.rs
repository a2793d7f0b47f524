//! Routing policies: contracts here, implementations in the files beside.
//!
//! A policy sees plain data only ([`RequestView`], [`CandidateView`] with its [`RouterLoad`] and
//! [`EngineLoad`] numbers): no tables, no locks, no I/O, and no import of the modules that keep
//! the tables (`load`, `index`, `discovery`), so it is deterministic given its inputs (plus its
//! own tie-break state) and trivially testable. A policy returns a full [`Ranking`]: the first entry is the pick, the next ones are
//! the fallbacks handed to Envoy.
//!
//! Policies are either written directly ([`round_robin`]) or composed GIE-style from
//! [`Filter`]s, weighted [`Scorer`]s and a [`Picker`] ([`composed`]).

pub mod approx_tree;
pub mod cache_load_score;
pub mod composed;
pub mod cost;
pub mod filters;
pub mod pickers;
pub mod predicted_ttft;
pub mod prefix_affinity;
pub mod round_robin;
pub mod scorers;
pub mod sglang;
pub mod sglang_index;
pub mod vllm_kvaware;
pub mod vllm_prefixaware;
pub mod vllm_qps;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::config::{PolicyConfig, PolicyName};

/// What a policy knows about the request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestView {
    /// Prompt length in tokens (exact or estimated).
    pub prompt_tokens: u64,
    /// Requested output length, if given.
    pub max_tokens: Option<u64>,
    /// Requests routed per second for this model lately, divided by the candidates: how many
    /// arrive at an endpoint per second (0 when unknown).
    pub arrivals_per_endpoint_s: f64,
    /// The prompt's chained block hashes, in order; filled only for policies that keep their own
    /// prefix tree ([`Policy::wants_prefix_blocks`]), empty otherwise.
    pub prefix_blocks: Arc<[u64]>,
    /// Tokens per block of `prefix_blocks` (0 when they are not filled).
    pub block_size_tokens: u32,
    /// How many of the best candidates the caller reads in rank order (the pick and its
    /// fallbacks); [`Ranking::order`] may list the others after them in any order. 0: all of
    /// them (explanations show every candidate's rank).
    pub ranked: usize,
}

impl RequestView {
    /// The places of [`Ranking::order`] that must be in rank order ([`Self::ranked`], or all).
    pub fn places(&self) -> usize {
        match self.ranked {
            0 => usize::MAX,
            k => k,
        }
    }
}

/// The engine's own view of its load, scraped from its metrics; present only while fresh.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests queued in the engine, not yet scheduled (`num_requests_waiting`).
    pub waiting_requests: u64,
    /// Requests in the engine's running batch (`num_requests_running`).
    pub running_requests: u64,
    /// KV-cache usage, 0..1 (`kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
}

/// The router's own count of what it sent a candidate and has not seen finish: known without
/// any engine signal, and current to the last decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterLoad {
    /// Requests routed there whose response has not ended.
    pub in_flight_requests: u64,
    /// Uncached prompt tokens of those requests not yet prefilled (no first byte yet).
    pub in_flight_prefill_tokens: u64,
    /// Of those requests, the ones without a first byte yet (still queued or prefilling).
    pub in_flight_prefilling: u64,
    /// How long the prompt at the head of those has been prefilling, us (the router takes them
    /// as prefilled one after another); 0 unless `policy.predicted_ttft.prefill_progress` is on.
    pub prefill_head_elapsed_us: u64,
}

/// Prompt-prefix tokens a candidate holds only in one tier slower than GPU memory (its KV
/// events say where), with what loading them back into GPU memory costs there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierHold {
    /// Tokens of the prompt's prefix held there only in this tier (part of `held_tokens`).
    pub tokens: u64,
    /// KV bytes per token of the request's model.
    pub bytes_per_token: f64,
    /// The tier's load bandwidth, bytes per second (> 0).
    pub bytes_per_s: f64,
    /// Fixed time a load from the tier adds, ms.
    pub latency_ms: f64,
}

impl TierHold {
    /// The tier's KV as an engine (vLLM's `OffloadingConnector`, LMCache) loads it back: the
    /// bytes over the bandwidth plus the latency, ms; 0 when nothing is held there.
    pub fn load_ms(&self) -> f64 {
        if self.tokens == 0 {
            return 0.0;
        }
        self.latency_ms
            + self.tokens as f64 * self.bytes_per_token / self.bytes_per_s.max(1e-9) * 1e3
    }
}

/// What a policy knows about one candidate endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateView {
    /// The endpoint.
    pub address: SocketAddr,
    /// Relative capacity (> 0).
    pub weight: f64,
    /// The router's own in-flight counts for it.
    pub load: RouterLoad,
    /// Concurrency limit, if configured.
    pub max_in_flight: Option<u32>,
    /// Tokens of this request's prompt prefix believed cached there.
    pub matched_tokens: u64,
    /// Of `matched_tokens`, those the engine's KV events confirmed (the rest are predictions).
    pub confirmed_tokens: u64,
    /// Tokens of the prompt prefix held there in any tier (GPU or offloaded), each counted in
    /// full: what a cache lookup that ignores the tier (LMCache's) would report.
    pub held_tokens: u64,
    /// Of `held_tokens`, those held only in CPU memory (`[0]`) and only on slower media
    /// (`[1]`: disk, a remote store), with their load costs. Zero without KV events.
    pub offloaded: [TierHold; 2],
    /// The endpoint's prefill speed (configured or learned), prompt tokens per second, > 0.
    pub prefill_tokens_per_s: f64,
    /// The engine's scraped load, when fresh (`None` when stale, missing or not scraped: the
    /// policy then relies on the router's own in-flight counts).
    pub engine: Option<EngineLoad>,
    /// How much slower than predicted this endpoint's first tokens have recently been (learned,
    /// decaying, >= 0), ms; added to its predicted queue wait. 0 when nothing was learned.
    pub ttft_residual_ms: f64,
    /// Tokens of the prompt's prefix the router last sent here (this is the prefix's home),
    /// whether or not the engine still holds them; 0 on every other candidate, and when
    /// nothing is remembered or the policy does not ask ([`Policy::wants_homes`]).
    pub recalled_tokens: u64,
}

impl CandidateView {
    /// Tokens of the prompt not cached there (what its prefill must compute).
    pub fn uncached_tokens(&self, request: &RequestView) -> u64 {
        request.prompt_tokens.saturating_sub(self.matched_tokens)
    }

    /// Fraction of the prompt cached there, 0..1.
    pub fn matched_fraction(&self, request: &RequestView) -> f64 {
        if request.prompt_tokens == 0 {
            0.0
        } else {
            (self.matched_tokens as f64 / request.prompt_tokens as f64).min(1.0)
        }
    }

    /// In-flight requests plus prefill tokens expressed in requests (`tokens_per_request`
    /// tokens weigh as one request), divided by weight.
    pub fn weighted_load(&self, tokens_per_request: f64) -> f64 {
        (self.load.in_flight_requests as f64
            + self.load.in_flight_prefill_tokens as f64 / tokens_per_request)
            / self.weight
    }
}

/// A policy's answer: candidates ranked best first, with the score behind each.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    /// Indices into the candidate slice, best first; every candidate appears exactly once. Only
    /// the first [`RequestView::places`] are in rank order.
    pub order: Vec<usize>,
    /// Per candidate (same indexing as the input): its score, where higher is better, or `None`
    /// if a filter excluded it (it then ranks after every eligible candidate).
    pub scores: Vec<Option<f64>>,
    /// Per candidate, the predicted time to first token in ms, for policies that predict it.
    pub predicted_ttft_ms: Option<Vec<f64>>,
}

impl Ranking {
    /// The picked candidate's index.
    pub fn pick(&self) -> usize {
        self.order[0]
    }
}

/// A routing policy. `rank` is called with at least one candidate.
pub trait Policy: Send + Sync + fmt::Debug {
    /// The name used in config and metrics.
    fn name(&self) -> &'static str;
    /// Whether the policy needs [`RequestView::prefix_blocks`] (it keeps its own prefix tree);
    /// default false, so other policies do not pay for the copy.
    fn wants_prefix_blocks(&self) -> bool {
        false
    }
    /// Whether the policy reads [`CandidateView::recalled_tokens`] (it prices a prefix's
    /// home); default false, so the router neither looks homes up nor records them.
    fn wants_homes(&self) -> bool {
        false
    }
    /// Ranks `candidates` (non-empty) for `request`.
    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking;
    /// A request ranked on a prefix of its prompt (new text deferred, or the prefix budget
    /// cut tokenizing short) was sent to `endpoint`, and the rest is now tokenized: `blocks`
    /// are the whole prompt's block hashes. A policy keeping its own prefix tree inserts them
    /// as it would have at the decision, had it seen the whole prompt (its peer's router
    /// matches the whole text). Default: nothing.
    fn record_rest(&self, endpoint: SocketAddr, blocks: &[u64], block_size_tokens: u32) {
        let _ = (endpoint, blocks, block_size_tokens);
    }
}

/// Excludes candidates that must not be picked while any other is available.
pub trait Filter: Send + Sync + fmt::Debug {
    /// A name for explanations.
    fn name(&self) -> &'static str;
    /// Whether `candidate` stays eligible.
    fn keep(&self, request: &RequestView, candidate: &CandidateView) -> bool;
}

/// Scores every candidate in `[0, 1]`, higher is better.
pub trait Scorer: Send + Sync + fmt::Debug {
    /// A name for explanations.
    fn name(&self) -> &'static str;
    /// Writes one score per candidate into `out` (same length as `candidates`).
    fn score(&self, request: &RequestView, candidates: &[CandidateView], out: &mut [f64]);
}

/// Orders eligible candidates by their combined score.
pub trait Picker: Send + Sync + fmt::Debug {
    /// A name for explanations.
    fn name(&self) -> &'static str;
    /// Returns `eligible` (non-empty, indices into `scores`) best first.
    fn order(&self, scores: &[f64], eligible: &[usize]) -> Vec<usize>;
}

/// Builds the policy a config names.
pub fn build(config: &PolicyConfig) -> Arc<dyn Policy> {
    match config.name {
        PolicyName::RoundRobin => Arc::new(round_robin::RoundRobin::default()),
        PolicyName::LeastLoaded => Arc::new(composed::least_loaded(config)),
        PolicyName::PrefixAffinity => Arc::new(prefix_affinity::PrefixAffinity::new(config)),
        PolicyName::CacheLoadScore => Arc::new(cache_load_score::CacheLoadScore::new(config)),
        PolicyName::SglangCacheAware => Arc::new(sglang::SglangCacheAware::new(config)),
        PolicyName::SglangCacheAwareIndex => {
            Arc::new(sglang_index::SglangCacheAwareIndex::new(config))
        }
        PolicyName::VllmPrefixAware => Arc::new(vllm_prefixaware::VllmPrefixAware::new(config)),
        PolicyName::VllmKvAware => Arc::new(vllm_kvaware::VllmKvAware::new(config)),
        PolicyName::PredictedTtft => Arc::new(predicted_ttft::PredictedTtft::new(config)),
        PolicyName::WeightedScorers => Arc::new(composed::weighted_scorers(config)),
    }
}

/// Orders `eligible` by `key` ascending; keys within `tolerance` (relative to the smallest key,
/// plus a tiny absolute slack) of each other count as equal and are ordered by `tie` ascending,
/// then by a rotating offset so repeated ties spread over the candidates.
///
/// Only the first `top` places are put in that order (at least one); the others follow, each
/// once, in no particular order. A decision hands the gateway its pick and a few fallbacks, so
/// ordering hundreds of candidates fully is work nobody reads; `usize::MAX` orders them all.
pub(crate) fn order_by(
    eligible: &[usize],
    key: impl Fn(usize) -> f64,
    tolerance: f64,
    tie: impl Fn(usize) -> f64,
    rotation: usize,
    n: usize,
    top: usize,
) -> Vec<usize> {
    // Each key computed once and packed with its position into one integer whose order is
    // (key by `total_cmp`, position): the stable sort by key, as integer comparisons, without
    // calling `key` twice per comparison (256 candidates made ~2,000 calls).
    let mut keyed: Vec<u128> = eligible
        .iter()
        .enumerate()
        .map(|(p, &i)| u128::from(ordered(key(i))) << 64 | p as u128)
        .collect();
    let top = top.max(1);
    // With fewer places wanted than candidates, only the `top` smallest keys are sorted; the
    // group reaching past them is completed below from the unsorted rest.
    let partial = top < keyed.len();
    if partial {
        smallest_first(&mut keyed, top);
    } else {
        keyed.sort_unstable();
    }
    let sorted = if partial { top } else { keyed.len() };
    let key_at = |k: u128| unordered((k >> 64) as u64);
    let index_at = |k: u128| eligible[k as u64 as usize];
    let n = n.max(1);
    let r = rotation % n;
    // `(i + n - r) % n` without a division per element (i < n).
    let rotated = |i: usize| {
        let i = if i < n { i } else { i % n };
        let x = i + n - r;
        if x >= n {
            x - n
        } else {
            x
        }
    };
    // Group runs of near-equal keys, then sort each group by the tie-breakers.
    let mut out = Vec::with_capacity(keyed.len());
    let mut group: Vec<u128> = Vec::new();
    let mut start = 0;
    while start < sorted {
        let base = key_at(keyed[start]);
        let slack = base.abs() * tolerance + 1e-9;
        let within = |k: u128| key_at(k) - base <= slack;
        let mut end = start + 1;
        while end < sorted && within(keyed[end]) {
            end += 1;
        }
        // The group holding the last wanted place: its other members are the unsorted keys
        // the walk would take next, i.e. those before the first (in key order) out of its
        // slack (not simply all within it: from an infinite base, a later key may be within
        // where an earlier one is not), moved up to it.
        let last = partial && end == sorted;
        if last {
            let stop = keyed[sorted..]
                .iter()
                .filter(|&&k| !within(k))
                .min()
                .copied();
            for j in sorted..keyed.len() {
                if stop.is_none_or(|s| keyed[j] < s) {
                    keyed.swap(end, j);
                    end += 1;
                }
            }
        }
        if end - start == 1 {
            out.push(index_at(keyed[start]));
        } else {
            // (tie, rotated) orders distinct candidates totally, as the stable sort did; the
            // index rides in the low bits.
            group.clear();
            group.extend(keyed[start..end].iter().map(|&k| {
                let i = index_at(k);
                u128::from(ordered(tie(i))) << 64 | (rotated(i) as u128) << 32 | i as u128
            }));
            let wanted = top - start;
            if last && wanted < group.len() {
                group.select_nth_unstable(wanted - 1);
                group[..wanted].sort_unstable();
            } else {
                sort_rotated(&mut group);
            }
            out.extend(group.iter().map(|&g| g as u32 as usize));
        }
        start = end;
    }
    out.extend(keyed[start..].iter().map(|&k| index_at(k)));
    out
}

/// Moves the `top` (>= 1) smallest of `v` (distinct values) to its front, sorted; the rest
/// follow in no particular order. A decision wants a pick and a few fallbacks: for those an
/// insertion pass (one compare per value, mostly) beats a selection (a third of ordering
/// 256 candidates).
fn smallest_first(v: &mut [u128], top: usize) {
    if top > 8 {
        v.select_nth_unstable(top - 1);
        v[..top].sort_unstable();
        return;
    }
    v[..top].sort_unstable();
    for j in top..v.len() {
        if v[j] < v[top - 1] {
            v.swap(j, top - 1);
            let mut i = top - 1;
            while i > 0 && v[i] < v[i - 1] {
                v.swap(i, i - 1);
                i -= 1;
            }
        }
    }
}

/// Sorts `v` (distinct values), in one pass if it is a sorted run rotated: a group of equal
/// tie-breakers in index order comes so, the rotating offset being the only break.
fn sort_rotated(v: &mut [u128]) {
    let Some(m) = (1..v.len()).find(|&i| v[i] < v[i - 1]) else {
        return;
    };
    if v[m..].windows(2).all(|w| w[0] < w[1]) && v[v.len() - 1] < v[0] {
        v.rotate_left(m);
    } else {
        v.sort_unstable();
    }
}

/// `x`'s bits as an integer that orders as `f64::total_cmp` does.
fn ordered(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

/// The inverse of [`ordered`].
fn unordered(b: u64) -> f64 {
    f64::from_bits(if b >> 63 == 1 { b & !(1 << 63) } else { !b })
}

/// Candidates split by a filter: those that pass `keep`, or all of them if none does (never
/// refuse for saturation), and the rest; `mask[i]` says whether candidate `i` was kept. Linear:
/// a fleet of hundreds of candidates must not pay a search per candidate.
pub(crate) struct Eligible {
    pub kept: Vec<usize>,
    pub excluded: Vec<usize>,
    pub mask: Vec<bool>,
}

/// Splits `0..n` by `keep` (see [`Eligible`]).
pub(crate) fn eligible_or_all(n: usize, keep: impl Fn(usize) -> bool) -> Eligible {
    // One pass; the mask and the kept list sized for all (a partition grew both lists by
    // doubling); the excluded ones are few, if any.
    let (mut mask, mut kept, mut excluded) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new());
    for i in 0..n {
        let k = keep(i);
        mask.push(k);
        if k {
            kept.push(i);
        } else {
            excluded.push(i);
        }
    }
    if kept.is_empty() {
        mask.iter_mut().for_each(|m| *m = true);
        std::mem::swap(&mut kept, &mut excluded);
    }
    Eligible {
        kept,
        excluded,
        mask,
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Candidate fixtures shared by the policy tests.
    use super::*;

    /// A candidate on port `port` with `requests` in flight and `tokens` waiting for prefill,
    /// nothing cached, prefilling 10k tokens/s.
    pub fn candidate(port: u16, requests: u64, tokens: u64) -> CandidateView {
        CandidateView {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            weight: 1.0,
            load: RouterLoad {
                in_flight_requests: requests,
                in_flight_prefill_tokens: tokens,
                in_flight_prefilling: 0,
                prefill_head_elapsed_us: 0,
            },
            max_in_flight: None,
            matched_tokens: 0,
            confirmed_tokens: 0,
            held_tokens: 0,
            offloaded: [TierHold::default(); 2],
            prefill_tokens_per_s: 10_000.0,
            engine: None,
            ttft_residual_ms: 0.0,
            recalled_tokens: 0,
        }
    }

    /// `candidate` with `matched` prompt tokens cached.
    pub fn cached(port: u16, requests: u64, tokens: u64, matched: u64) -> CandidateView {
        CandidateView {
            matched_tokens: matched,
            ..candidate(port, requests, tokens)
        }
    }

    /// `candidate` with `held` prompt tokens held in some tier (and as many matched).
    pub fn held(port: u16, requests: u64, tokens: u64, held: u64) -> CandidateView {
        CandidateView {
            held_tokens: held,
            ..cached(port, requests, tokens, held)
        }
    }

    /// A request of `prompt` tokens.
    pub fn request(prompt: u64) -> RequestView {
        RequestView {
            prompt_tokens: prompt,
            max_tokens: None,
            arrivals_per_endpoint_s: 0.0,
            prefix_blocks: Arc::from(Vec::new()),
            block_size_tokens: 0,
            ranked: 0,
        }
    }

    /// Checks the ranking invariant: a permutation of all candidates.
    pub fn assert_permutation(ranking: &Ranking, n: usize) {
        let mut seen = ranking.order.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{ranking:?}");
        assert_eq!(ranking.scores.len(), n);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The name a config parses, the name metrics use and the built policy's own name agree for
    /// every policy (a policy whose config spelling differs from its label cannot be selected
    /// by the name the docs give).
    #[test]
    fn every_policy_answers_to_its_config_name() {
        assert_eq!(PolicyName::ALL.len(), 10);
        for name in PolicyName::ALL {
            let parsed: PolicyName = serde_norway::from_str(name.as_str()).unwrap();
            assert_eq!(parsed, name);
            let config = PolicyConfig {
                name,
                ..PolicyConfig::default()
            };
            assert_eq!(build(&config).name(), name.as_str());
        }
    }

    /// `order_by` as it was written first (a stable sort calling `key` and `tie` in every
    /// comparison): the faster one must order exactly as it did.
    fn order_by_reference(
        eligible: &[usize],
        key: impl Fn(usize) -> f64,
        tolerance: f64,
        tie: impl Fn(usize) -> f64,
        rotation: usize,
        n: usize,
    ) -> Vec<usize> {
        let mut order = eligible.to_vec();
        order.sort_by(|&a, &b| key(a).total_cmp(&key(b)));
        let mut out = Vec::with_capacity(order.len());
        let mut start = 0;
        while start < order.len() {
            let base = key(order[start]);
            let slack = base.abs() * tolerance + 1e-9;
            let mut end = start + 1;
            while end < order.len() && key(order[end]) - base <= slack {
                end += 1;
            }
            let n = n.max(1);
            let rotated = |i: usize| (i + n - rotation % n) % n;
            let mut group = order[start..end].to_vec();
            group.sort_by(|&a, &b| tie(a).total_cmp(&tie(b)).then(rotated(a).cmp(&rotated(b))));
            out.extend(group);
            start = end;
        }
        out
    }

    proptest! {
        /// Keys and tie-breakers from small sets (so that ties and near-ties abound, NaN and
        /// infinities included), any eligible subset in any order, any rotation.
        #[test]
        fn order_by_orders_as_the_reference(
            keys in prop::collection::vec(prop_oneof![
                (0u8..4).prop_map(|k| f64::from(k) * 10.0),
                (0u8..4).prop_map(|k| f64::from(k) * 10.0 + 0.05),
                Just(f64::NAN),
                Just(f64::INFINITY),
                Just(f64::NEG_INFINITY),
                Just(-0.0),
            ], 1..120),
            ties in prop::collection::vec(0u8..3, 120),
            pick in prop::collection::vec(any::<bool>(), 120),
            reverse in any::<bool>(),
            tolerance in prop_oneof![Just(0.0), Just(0.02)],
            rotation in 0usize..100,
            top in prop_oneof![Just(usize::MAX), 0usize..10, 0usize..130],
        ) {
            let n = keys.len();
            let mut eligible: Vec<usize> = (0..n).filter(|&i| pick[i]).collect();
            if reverse {
                eligible.reverse();
            }
            let key = |i: usize| keys[i];
            let tie = |i: usize| f64::from(ties[i]);
            let got = order_by(&eligible, key, tolerance, tie, rotation, n, top);
            let want = order_by_reference(&eligible, key, tolerance, tie, rotation, n);
            // The first `top` places (at least one) as the full order has them...
            let head = top.max(1).min(want.len());
            prop_assert_eq!(&got[..head.min(got.len())], &want[..head]);
            // ...and every candidate once.
            let mut all = got.clone();
            all.sort_unstable();
            let mut expected = eligible.clone();
            expected.sort_unstable();
            prop_assert_eq!(all, expected);
        }
    }
}
