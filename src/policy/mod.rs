//! Routing policies: contracts here, implementations in the files beside.
//!
//! A policy sees plain data only ([`RequestView`], [`CandidateView`]): no tables, no locks, no
//! I/O, so it is deterministic given its inputs (plus its own tie-break state) and trivially
//! testable. A policy returns a full [`Ranking`]: the first entry is the pick, the next ones are
//! the fallbacks handed to Envoy.
//!
//! Policies are either written directly ([`round_robin`]) or composed GIE-style from
//! [`Filter`]s, weighted [`Scorer`]s and a [`Picker`] ([`composed`]).

pub mod composed;
pub mod filters;
pub mod pickers;
pub mod round_robin;
pub mod scorers;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::config::{PolicyConfig, PolicyName};
use crate::load::LoadSnapshot;

/// What a policy knows about the request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestView {
    /// Prompt length in tokens (exact or estimated).
    pub prompt_tokens: u64,
    /// Requested output length, if given.
    pub max_tokens: Option<u64>,
}

/// What a policy knows about one candidate endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateView {
    /// The endpoint.
    pub address: SocketAddr,
    /// Relative capacity (> 0).
    pub weight: f64,
    /// The router's own in-flight counts for it.
    pub load: LoadSnapshot,
    /// Concurrency limit, if configured.
    pub max_in_flight: Option<u32>,
    /// Tokens of this request's prompt prefix believed cached there.
    pub matched_tokens: u64,
}

impl CandidateView {
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
    /// Indices into the candidate slice, best first; every candidate appears exactly once.
    pub order: Vec<usize>,
    /// Per candidate (same indexing as the input): its score, where higher is better, or `None`
    /// if a filter excluded it (it then ranks after every eligible candidate).
    pub scores: Vec<Option<f64>>,
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
    /// Ranks `candidates` (non-empty) for `request`.
    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking;
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
        PolicyName::LeastLoaded => Arc::new(composed::least_loaded(&config.least_loaded)),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Candidate fixtures shared by the policy tests.
    use super::*;

    /// A candidate on port `port` with `requests` in flight and `tokens` waiting for prefill.
    pub fn candidate(port: u16, requests: u64, tokens: u64) -> CandidateView {
        CandidateView {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            weight: 1.0,
            load: LoadSnapshot {
                in_flight_requests: requests,
                in_flight_prefill_tokens: tokens,
                requests_total: 0,
            },
            max_in_flight: None,
            matched_tokens: 0,
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
