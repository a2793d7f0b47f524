//! The user-facing breakdown of a decision: per candidate what it holds, how loaded it is, what
//! the policy predicted and scored, and the pick. Counts and hashes only, never prompt text.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::Plan;

/// One candidate's line in an explanation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateRow {
    /// `ip:port`.
    pub endpoint: String,
    /// Position in the policy's ranking (0 = the pick).
    pub rank: usize,
    /// Prompt tokens believed cached there.
    pub matched_tokens: u64,
    /// Of those, confirmed by the engine's KV events.
    pub confirmed_tokens: u64,
    /// Router in-flight requests there.
    pub in_flight_requests: u64,
    /// Uncached prompt tokens of in-flight requests there not yet prefilled.
    pub in_flight_prefill_tokens: u64,
    /// Prefill speed assumed, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Where that speed comes from: `learned`, `configured` or `default`.
    #[serde(default)]
    pub prefill_speed_source: String,
    /// The engine's scraped load: `fresh`, `stale` (ignored), `missing` or `not-scraped`.
    #[serde(default)]
    pub engine_signal: String,
    /// Age of the last engine sample, ms.
    #[serde(default)]
    pub engine_age_ms: Option<u64>,
    /// Requests waiting in the engine's queue (fresh signal only).
    #[serde(default)]
    pub engine_waiting_requests: Option<u64>,
    /// Requests in the engine's running batch (fresh signal only).
    #[serde(default)]
    pub engine_running_requests: Option<u64>,
    /// The engine's KV-cache usage, 0..1 (fresh signal only).
    #[serde(default)]
    pub engine_kv_cache_usage: Option<f64>,
    /// The learned TTFT residual added to its prediction, ms.
    #[serde(default)]
    pub ttft_residual_ms: f64,
    /// Admitted as a half-open breaker's trial request.
    #[serde(default)]
    pub trial: bool,
    /// Where its cache entries come from: `events`, `events+predictions` or `predictions`.
    #[serde(default)]
    pub cache_source: String,
    /// Why events are not the whole truth there, if they are not (`gap`, `silent`...).
    #[serde(default)]
    pub cache_reason: Option<String>,
    /// Predicted time to first token, ms (policies that predict it).
    pub predicted_ttft_ms: Option<f64>,
    /// The policy's score (higher is better); `None` if a filter excluded it.
    pub score: Option<f64>,
    /// Prompt tokens held there in any tier (GPU or offloaded), each counted in full.
    #[serde(default)]
    pub held_tokens: u64,
    /// Of those, held only in CPU memory (the engine's KV events say so).
    #[serde(default)]
    pub cpu_tokens: u64,
    /// Of those, held only on slower media (disk, a remote store).
    #[serde(default)]
    pub slower_tier_tokens: u64,
    /// Time the engine takes to load the offloaded ones back (`pools[].kv_tiers`), ms.
    #[serde(default)]
    pub tier_load_ms: f64,
    /// The CPU tier's load bandwidth used, GB/s.
    #[serde(default)]
    pub cpu_tier_gb_per_s: f64,
    /// Where it comes from: `learned` (the engine's transfer counters) or `configured`.
    #[serde(default)]
    pub cpu_tier_bandwidth_source: String,
}

/// Why a request goes where it goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    /// The requested model.
    pub model: String,
    /// The LoRA adapter, if the model named one.
    pub adapter: Option<String>,
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Whether the length and hashes come from the model's tokenizer (else a byte estimate).
    pub exact: bool,
    /// Why the byte estimate was used, if it was.
    pub fallback: Option<String>,
    /// Prefix blocks hashed.
    pub prefix_blocks: usize,
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// The policy.
    pub policy: String,
    /// The picked endpoint.
    pub pick: String,
    /// Fallbacks handed to the gateway, in order.
    pub fallbacks: Vec<String>,
    /// Every candidate, in ranking order.
    pub candidates: Vec<CandidateRow>,
    /// Whether some candidate's engine signal was stale or missing, so the policy used the
    /// router's own in-flight counts for it.
    #[serde(default)]
    pub stale_signals: bool,
    /// Endpoints serving the model left out as unhealthy (they may still end the fallback list).
    #[serde(default)]
    pub unhealthy: Vec<String>,
}

/// The ranking's order with every place in rank order. A decision ranks only its pick and
/// fallbacks unless it will be explained; if the decision log or feed was turned on while it
/// decided, the others are listed by score, best first (then by index).
fn full_order(plan: &Plan) -> Cow<'_, [usize]> {
    let order = &plan.ranking.order;
    let head = plan.request.places().min(order.len());
    if head == order.len() {
        return Cow::Borrowed(order);
    }
    let score = |i: usize| plan.ranking.scores[i].unwrap_or(f64::NEG_INFINITY);
    let mut full = order.clone();
    full[head..].sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    Cow::Owned(full)
}

impl Explanation {
    /// The explanation of `plan`.
    pub fn from_plan(plan: &Plan) -> Explanation {
        let ttft = plan.ranking.predicted_ttft_ms.as_ref();
        let candidates = full_order(plan)
            .iter()
            .enumerate()
            .map(|(rank, &i)| {
                let c = &plan.candidates[i];
                let signals = &plan.signals[i];
                CandidateRow {
                    endpoint: c.address.to_string(),
                    rank,
                    matched_tokens: c.matched_tokens,
                    confirmed_tokens: c.confirmed_tokens,
                    in_flight_requests: c.load.in_flight_requests,
                    in_flight_prefill_tokens: c.load.in_flight_prefill_tokens,
                    prefill_tokens_per_s: c.prefill_tokens_per_s,
                    prefill_speed_source: signals.prefill_speed.to_string(),
                    engine_signal: signals.engine.to_string(),
                    engine_age_ms: signals.engine_age_ms,
                    engine_waiting_requests: c.engine.map(|e| e.waiting_requests),
                    engine_running_requests: c.engine.map(|e| e.running_requests),
                    engine_kv_cache_usage: c.engine.map(|e| e.kv_cache_usage),
                    ttft_residual_ms: c.ttft_residual_ms,
                    trial: signals.trial,
                    cache_source: signals.cache_source.to_string(),
                    cache_reason: signals.cache_reason.map(str::to_string),
                    predicted_ttft_ms: ttft.map(|t| t[i]),
                    score: plan.ranking.scores[i],
                    held_tokens: c.held_tokens,
                    cpu_tokens: c.offloaded[0].tokens,
                    slower_tier_tokens: c.offloaded[1].tokens,
                    tier_load_ms: c.offloaded.iter().map(|t| t.load_ms()).sum(),
                    cpu_tier_gb_per_s: c.offloaded[0].bytes_per_s / 1e9,
                    cpu_tier_bandwidth_source: signals.cpu_tier_bandwidth.to_string(),
                }
            })
            .collect();
        Explanation {
            model: plan.model.clone(),
            adapter: plan.adapter.clone(),
            prompt_tokens: plan.prefix.tokens,
            exact: plan.prefix.exact,
            fallback: plan.prefix.fallback.map(|f| f.as_str().to_string()),
            prefix_blocks: plan.prefix.block_hashes.len(),
            block_size_tokens: plan.prefix.block_size_tokens,
            policy: plan.policy.to_string(),
            pick: plan.primary().address_str.to_string(),
            fallbacks: plan.endpoints[1..]
                .iter()
                .map(|e| e.address_str.to_string())
                .collect(),
            candidates,
            stale_signals: plan.stale_signals(),
            unhealthy: plan
                .unhealthy
                .iter()
                .map(|e| e.address_str.to_string())
                .collect(),
        }
    }

    /// A plain-text table for terminals.
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "model {}{}: {} prompt tokens ({}), {} prefix blocks of {} tokens",
            self.model,
            self.adapter
                .as_deref()
                .map(|a| format!(" (adapter {a})"))
                .unwrap_or_default(),
            self.prompt_tokens,
            match (self.exact, self.fallback.as_deref()) {
                (true, _) => "tokenizer".to_string(),
                (false, Some(why)) => format!("byte estimate: {why}"),
                (false, None) => "byte estimate".to_string(),
            },
            self.prefix_blocks,
            self.block_size_tokens,
        );
        let _ = writeln!(out, "policy {}", self.policy);
        let _ = writeln!(
            out,
            "{:<4} {:<22} {:>8} {:>9} {:>9} {:>12} {:>16} {:>18} {:>12} {:>10}  cache",
            "rank",
            "endpoint",
            "matched",
            "confirmed",
            "in-flight",
            "prefill-tok",
            "engine",
            "tok/s",
            "ttft-ms",
            "score",
        );
        for c in &self.candidates {
            let engine = match (c.engine_waiting_requests, c.engine_running_requests) {
                (Some(w), Some(r)) => format!("w{w} r{r}"),
                _ => c.engine_signal.clone(),
            };
            let speed = format!(
                "{:.0} {}",
                c.prefill_tokens_per_s,
                c.prefill_speed_source.get(..4).unwrap_or("")
            );
            let cache = match &c.cache_reason {
                Some(why) => format!("{} ({why})", c.cache_source),
                None => c.cache_source.clone(),
            };
            let _ = writeln!(
                out,
                "{:<4} {:<22} {:>8} {:>9} {:>9} {:>12} {:>16} {:>18} {:>12} {:>10}  {}",
                c.rank,
                c.endpoint,
                c.matched_tokens,
                c.confirmed_tokens,
                c.in_flight_requests,
                c.in_flight_prefill_tokens,
                engine,
                speed,
                c.predicted_ttft_ms
                    .map(|t| format!("{t:.1}"))
                    .unwrap_or_else(|| "-".into()),
                c.score
                    .map(|s| format!("{s:.4}"))
                    .unwrap_or_else(|| "filtered".into()),
                cache,
            );
        }
        let _ = writeln!(out, "pick {}", self.pick);
        if !self.fallbacks.is_empty() {
            let _ = writeln!(out, "fallbacks {}", self.fallbacks.join(", "));
        }
        if self.stale_signals {
            let _ = writeln!(
                out,
                "stale engine signals: the policy used the router's own counts where marked"
            );
        }
        if !self.unhealthy.is_empty() {
            let _ = writeln!(out, "unhealthy (not picked) {}", self.unhealthy.join(", "));
        }
        out
    }
}
