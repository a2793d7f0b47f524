//! `vllm-kv-aware`: the vLLM production stack router's `kvaware` routing logic
//! (`KvawareRouter`), as its users run it.
//!
//! What it does there: it tokenizes the prompt and asks the LMCache controller which instance
//! holds it (`LookupMsg`). The controller walks the prompt's 256-token chunks while they are
//! stored anywhere in the LMCache cluster and answers instances with the end of their matched
//! run; the router takes the first instance of the answer and its matched tokens. If an
//! instance matched and at most `kv_aware_threshold` (default 2000) prompt tokens are left
//! unmatched (`matched >= prompt - threshold`), the request goes there, whatever its load;
//! otherwise to the endpoint with the lowest request rate over the last 60 s (an endpoint never
//! sent anything first), or by a session hash ring when a session key is configured (not
//! reproduced). There is no other load term.
//!
//! What differs here: LMCache's lookup is replaced by kvrouter's ownership index. The match is
//! the candidate's held prefix in every tier the index knows (GPU, CPU offload and slower, as
//! the KV events report them; predictions from past decisions without events), where LMCache
//! knows the chunks its own backends (CPU, disk, remote) store. The controller answers the
//! instance that *first stored* the prompt's first chunk, which the index does not record; here
//! the candidate with the longest match wins (ties: the first). Matches are cut to whole
//! `chunk_tokens` (256) chunks unless they cover the whole prompt, as LMCache's are.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::vllm_qps::QpsMeter;
use super::{order_by, CandidateView, Policy, Ranking, RequestView};
use crate::config::{PolicyConfig, VllmKvAwareConfig};

/// The production stack's KV-aware router.
#[derive(Debug)]
pub struct VllmKvAware {
    config: VllmKvAwareConfig,
    tokens_per_request: f64,
    qps: Mutex<QpsMeter>,
    rotation: AtomicUsize,
}

impl VllmKvAware {
    /// The policy with `config.vllm_kvaware`.
    pub fn new(config: &PolicyConfig) -> VllmKvAware {
        let c = config.vllm_kvaware.clone();
        VllmKvAware {
            qps: Mutex::new(QpsMeter::new(Duration::from_millis(c.qps_window_ms))),
            config: c,
            tokens_per_request: config.least_loaded.tokens_per_request,
            rotation: AtomicUsize::new(0),
        }
    }

    /// The tokens LMCache would report for `c`: its held prefix in whole chunks, or all of it
    /// when it covers the prompt.
    pub fn lmcache_matched(&self, request: &RequestView, c: &CandidateView) -> u64 {
        let held = c.held_tokens.min(request.prompt_tokens);
        let chunk = self.config.chunk_tokens.max(1);
        if held >= request.prompt_tokens {
            held
        } else {
            held / chunk * chunk
        }
    }

    /// [`Policy::rank`] at `now`.
    pub fn rank_at(
        &self,
        now: Instant,
        request: &RequestView,
        candidates: &[CandidateView],
    ) -> Ranking {
        let n = candidates.len();
        let matched: Vec<u64> = candidates
            .iter()
            .map(|c| self.lmcache_matched(request, c))
            .collect();
        let best = (0..n).fold(0, |b, i| if matched[i] > matched[b] { i } else { b });
        let unmatched_allowed = request
            .prompt_tokens
            .saturating_sub(self.config.threshold_tokens);
        let mut qps = self.qps.lock();
        let pick = if matched[best] > 0 && matched[best] >= unmatched_allowed {
            best
        } else {
            qps.lowest(now, candidates)
        };
        qps.record(now, candidates[pick].address);
        drop(qps);

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
        Ranking {
            order,
            scores: matched
                .iter()
                .map(|&m| Some(m as f64 / request.prompt_tokens.max(1) as f64))
                .collect(),
            predicted_ttft_ms: None,
        }
    }
}

impl Policy for VllmKvAware {
    fn name(&self) -> &'static str {
        "vllm-kv-aware"
    }

    fn rank(&self, request: &RequestView, candidates: &[CandidateView]) -> Ranking {
        self.rank_at(Instant::now(), request, candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{assert_permutation, held, request};

    #[test]
    fn the_holder_wins_whatever_its_load_when_little_is_left_to_compute() {
        let p = VllmKvAware::new(&PolicyConfig::default());
        let now = Instant::now();
        // 3,000 tokens, 1,024 held on a busy endpoint: 1,976 left <= 2,000.
        let cands = [held(1, 0, 0, 0), held(2, 40, 90_000, 1030)];
        let r = p.rank_at(now, &request(3000), &cands);
        assert_eq!(r.pick(), 1);
        assert_eq!(
            r.scores[1],
            Some(1024.0 / 3000.0),
            "cut to 256-token chunks"
        );
        assert_permutation(&r, 2);
        // 1,000 held of 3,100: 2,100 left > 2,000: the lowest rate. Port 2 was sent one
        // request above; port 1 never anything, so it comes first whatever it holds.
        let cands = [held(1, 0, 0, 1000), held(2, 0, 0, 0)];
        let r = p.rank_at(now, &request(3100), &cands);
        assert_eq!(r.pick(), 0, "never sent anything");
        // One each in the window: a tie goes to the first; then port 1 has two, port 2 one.
        assert_eq!(p.rank_at(now, &request(3100), &cands).pick(), 0);
        assert_eq!(p.rank_at(now, &request(3100), &cands).pick(), 1);
    }

    #[test]
    fn short_prompts_follow_any_whole_chunk() {
        let p = VllmKvAware::new(&PolicyConfig::default());
        let now = Instant::now();
        // A 600-token prompt: any match of one chunk routes there (600 - 2000 < 0).
        let cands = [held(1, 0, 0, 255), held(2, 9, 0, 256)];
        assert_eq!(p.rank_at(now, &request(600), &cands).pick(), 1);
        // Less than a chunk held anywhere: no LMCache hit, QPS routing.
        let cands = [held(1, 0, 0, 255), held(2, 9, 0, 0)];
        assert_eq!(p.rank_at(now, &request(600), &cands).pick(), 0);
        // A whole prompt held counts even below a chunk.
        let cands = [held(1, 0, 0, 0), held(2, 9, 0, 100)];
        assert_eq!(p.rank_at(now, &request(100), &cands).pick(), 1);
    }
}
