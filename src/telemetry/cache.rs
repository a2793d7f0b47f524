//! How much of each routed prompt the pick already held, and where that knowledge came from:
//! the counters behind a dashboard's matched-token share (`rate(matched) / rate(prompt)`) and
//! its cache-source breakdown.
//!
//! Counters rather than a histogram of the share: a share of rates weights long prompts by
//! their length, which is what prefill time follows, and two counters cost two increments.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::prefix::PREFIX_SOURCES;

/// `policy`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

/// `cache_source`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    cache_source: String,
}

/// `result`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// `prefix_source`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PrefixSourceLabels {
    prefix_source: &'static str,
}

/// The cache metrics of routed decisions (registered under `kvrouter_`).
#[derive(Debug)]
pub struct CacheMetrics {
    prompt_tokens: Family<PolicyLabels, Counter>,
    matched_tokens: Family<PolicyLabels, Counter>,
    by_source: Family<SourceLabels, Counter>,
    /// Deferred tokenizings finished / failed / dropped (the handles, registered once).
    deferred: [Counter; 3],
    /// Decisions per prefix identity, in [`PREFIX_SOURCES`] order (the handles).
    by_prefix_source: [Counter; 5],
}

impl CacheMetrics {
    /// Registers the cache metrics in `registry`.
    pub fn register(registry: &mut Registry) -> CacheMetrics {
        let deferred = Family::<ResultLabels, Counter>::default();
        let by_prefix_source = Family::<PrefixSourceLabels, Counter>::default();
        let m = CacheMetrics {
            prompt_tokens: Family::default(),
            matched_tokens: Family::default(),
            by_source: Family::default(),
            deferred: ["finished", "failed", "dropped"]
                .map(|result| deferred.get_or_create(&ResultLabels { result }).clone()),
            by_prefix_source: PREFIX_SOURCES.map(|prefix_source| {
                by_prefix_source
                    .get_or_create(&PrefixSourceLabels { prefix_source })
                    .clone()
            }),
        };
        registry.register(
            "decisions_by_prefix_source",
            "Routed decisions by the prompt identity they were made on: tokens (whole prompt), \
             tokens-capped (max_prefix_tokens reached), tokens-partial (routing.prefix_budget_ms \
             stopped tokenizing), tokens-deferred (new text left for after the decision), \
             bytes (byte estimate: no tokenizer or template, a failure, or the budget passed \
             before rendering)",
            by_prefix_source,
        );
        registry.register(
            "deferred_tokenizings",
            "Prompts decided on a prefix (the cached one before new text, \
             models[].defer_tokenizing_after, or what routing.prefix_budget_ms allowed) whose \
             rest was tokenized after the decision, by result",
            deferred,
        );
        registry.register(
            "decision_prompt_tokens",
            "Prompt tokens of routed requests (the tokenizer's count, else the estimate), by policy",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "decision_matched_tokens",
            "Prompt tokens the picked endpoint was believed to hold already at the decision, by policy",
            m.matched_tokens.clone(),
        );
        registry.register(
            "decisions_by_cache_source",
            "Routed decisions by where the pick's cache view came from (events, events+predictions, predictions)",
            m.by_source.clone(),
        );
        m
    }

    /// Counts a routed decision under `policy`: a prompt of `prompt_tokens` of which the pick
    /// held `matched_tokens`, known from `cache_source`.
    pub fn record(
        &self,
        policy: &str,
        cache_source: &str,
        prompt_tokens: u64,
        matched_tokens: u64,
    ) {
        let labels = PolicyLabels {
            policy: policy.to_string(),
        };
        self.prompt_tokens
            .get_or_create(&labels)
            .inc_by(prompt_tokens);
        self.matched_tokens
            .get_or_create(&labels)
            .inc_by(matched_tokens.min(prompt_tokens));
        self.by_source
            .get_or_create(&SourceLabels {
                cache_source: cache_source.to_string(),
            })
            .inc();
    }

    /// Counts a decision made on the prompt identity of index `source`
    /// ([`crate::prefix::PrefixIdentity::source_index`]).
    pub fn record_prefix_source(&self, source: usize) {
        if let Some(c) = self.by_prefix_source.get(source) {
            c.inc();
        }
    }

    /// Counts a deferred tokenizing that finished (`true`) or whose text the tokenizer refused.
    pub fn record_deferred(&self, finished: bool) {
        self.deferred[usize::from(!finished)].inc();
    }

    /// Counts a deferred tokenizing dropped unstarted: the work queued after decisions held
    /// its most bytes.
    pub fn record_deferred_dropped(&self) {
        self.deferred[2].inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_and_sources_render_by_label() {
        let mut registry = Registry::with_prefix("kvrouter");
        let m = CacheMetrics::register(&mut registry);
        m.record("predicted-ttft", "events", 100, 64);
        m.record("predicted-ttft", "predictions", 50, 80);
        m.record_deferred(true);
        m.record_prefix_source(2);
        m.record_prefix_source(2);
        m.record_prefix_source(4);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        for line in [
            "kvrouter_decision_prompt_tokens_total{policy=\"predicted-ttft\"} 150",
            "kvrouter_decision_matched_tokens_total{policy=\"predicted-ttft\"} 114",
            "kvrouter_decisions_by_cache_source_total{cache_source=\"events\"} 1",
            "kvrouter_decisions_by_cache_source_total{cache_source=\"predictions\"} 1",
            "kvrouter_deferred_tokenizings_total{result=\"finished\"} 1",
            "kvrouter_deferred_tokenizings_total{result=\"failed\"} 0",
            "kvrouter_deferred_tokenizings_total{result=\"dropped\"} 0",
            "kvrouter_decisions_by_prefix_source_total{prefix_source=\"tokens-partial\"} 2",
            "kvrouter_decisions_by_prefix_source_total{prefix_source=\"bytes\"} 1",
            "kvrouter_decisions_by_prefix_source_total{prefix_source=\"tokens\"} 0",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
