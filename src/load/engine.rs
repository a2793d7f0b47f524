//! The engine's own view of its load, as last scraped from its metrics, and whether that view is
//! still fresh enough to trust.
//!
//! The scraper stores a whole [`EngineSample`] at once (one atomic pointer swap), so a reader
//! never sees the queue of one scrape with the KV usage of another. Timestamps are
//! `tokio::time::Instant`s, so staleness follows paused time in tests.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::time::Instant;

/// LoRA adapters the engine reports (`vllm:lora_requests_info`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoraInfo {
    /// Adapters loaded at most at once (`max_lora`).
    pub max_loras: u32,
    /// Adapters of running requests.
    pub running: Vec<String>,
    /// Adapters of waiting requests.
    pub waiting: Vec<String>,
}

/// One scrape's worth of engine load.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineSample {
    /// Requests queued in the engine, not yet scheduled (summed over its engines).
    pub waiting_requests: u64,
    /// Requests in the engine's running batch (summed over its engines).
    pub running_requests: u64,
    /// KV-cache usage, 0..1 (the highest of its engines).
    pub kv_cache_usage: f64,
    /// KV-cache capacity in tokens, if the engine reports it (vLLM: `block_size ×
    /// num_gpu_blocks` of `cache_config_info`; SGLang: `max_total_num_tokens`).
    pub capacity_tokens: Option<u64>,
    /// The engine's own block size in tokens, if reported.
    pub block_size_tokens: Option<u32>,
    /// LoRA adapters, if reported.
    pub lora: Option<LoraInfo>,
    /// Size of the engine's CPU offload tier in bytes, if reported (vLLM's
    /// `kv_offloading_size` label of `cache_config_info`, GiB).
    pub cpu_offload_bytes: Option<u64>,
    /// Bytes loaded from the CPU tier into GPU memory and the seconds those loads took, ever
    /// (vLLM's `kv_offload_total_bytes` / `_time`, `CPU_to_GPU`), if reported.
    pub cpu_loaded: Option<(f64, f64)>,
    /// When the scrape completed.
    #[serde(skip)]
    pub scraped_at: Instant,
}

/// How trustworthy an endpoint's engine signals are right now.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineSignal {
    /// Scraped within the staleness threshold.
    Fresh(Arc<EngineSample>),
    /// Last scraped longer ago than the threshold.
    Stale {
        /// How long ago.
        age: Duration,
    },
    /// Never scraped successfully (scraping off, not yet scraped, or failing since start).
    Missing,
}

impl EngineSignal {
    /// `fresh`, `stale` or `missing` for a sample scraped at `scraped_at` (None: never), as of
    /// `now`, without building the signal.
    pub fn state_of(
        scraped_at: Option<Instant>,
        now: Instant,
        staleness: Duration,
    ) -> &'static str {
        match scraped_at {
            None => "missing",
            Some(at) if fresh_at(at, now, staleness) => "fresh",
            Some(_) => "stale",
        }
    }

    /// The fresh sample, if any.
    pub fn fresh(&self) -> Option<&EngineSample> {
        match self {
            EngineSignal::Fresh(s) => Some(s),
            _ => None,
        }
    }

    /// `fresh`, `stale` or `missing`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EngineSignal::Fresh(_) => "fresh",
            EngineSignal::Stale { .. } => "stale",
            EngineSignal::Missing => "missing",
        }
    }
}

/// The last engine sample of one endpoint.
#[derive(Debug, Default)]
pub struct EngineState {
    last: ArcSwapOption<EngineSample>,
}

impl EngineState {
    /// Replaces the sample; returns the previous one.
    pub fn store(&self, sample: EngineSample) -> Option<Arc<EngineSample>> {
        self.last.swap(Some(Arc::new(sample)))
    }

    /// The last sample, however old.
    pub fn last(&self) -> Option<Arc<EngineSample>> {
        self.last.load_full()
    }

    /// The last sample, borrowed without touching its reference count (a decision reads every
    /// candidate's; hold the guard briefly).
    pub fn peek(&self) -> arc_swap::Guard<Option<Arc<EngineSample>>> {
        self.last.load()
    }

    /// The signal as of `now`: fresh if scraped at most `staleness` ago.
    pub fn signal(&self, now: Instant, staleness: Duration) -> EngineSignal {
        EngineSignal::of(self.last(), now, staleness)
    }
}

impl EngineSignal {
    /// The signal of sample `last` (from [`EngineState::last`]) as of `now`: fresh if scraped
    /// at most `staleness` ago.
    pub fn of(last: Option<Arc<EngineSample>>, now: Instant, staleness: Duration) -> EngineSignal {
        match last {
            None => EngineSignal::Missing,
            Some(s) if fresh_at(s.scraped_at, now, staleness) => EngineSignal::Fresh(s),
            Some(s) => EngineSignal::Stale {
                age: now.saturating_duration_since(s.scraped_at),
            },
        }
    }
}

/// Whether a sample scraped at `at` is fresh at `now`: at most `staleness` old.
fn fresh_at(at: Instant, now: Instant, staleness: Duration) -> bool {
    now.saturating_duration_since(at) <= staleness
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(waiting: u64, at: Instant) -> EngineSample {
        EngineSample {
            waiting_requests: waiting,
            running_requests: 1,
            kv_cache_usage: 0.5,
            capacity_tokens: None,
            block_size_tokens: None,
            lora: None,
            cpu_offload_bytes: None,
            cpu_loaded: None,
            scraped_at: at,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_sample_is_trusted_until_the_staleness_threshold() {
        let state = EngineState::default();
        let threshold = Duration::from_millis(2000);
        assert_eq!(
            state.signal(Instant::now(), threshold),
            EngineSignal::Missing
        );
        state.store(sample(3, Instant::now()));
        tokio::time::advance(Duration::from_millis(2000)).await;
        let signal = state.signal(Instant::now(), threshold);
        assert_eq!(signal.fresh().map(|s| s.waiting_requests), Some(3));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            state.signal(Instant::now(), threshold),
            EngineSignal::Stale {
                age: Duration::from_millis(2001)
            }
        );
        // The decision's borrowed read says the same as the signal, at every point.
        let at = Some(Instant::now() - Duration::from_millis(2001));
        assert_eq!(
            EngineSignal::state_of(at, Instant::now(), threshold),
            "stale"
        );
        let at = state.peek().as_deref().map(|s| s.scraped_at);
        assert_eq!(
            EngineSignal::state_of(at, Instant::now(), threshold),
            state.signal(Instant::now(), threshold).as_str()
        );
        assert_eq!(
            EngineSignal::state_of(None, Instant::now(), threshold),
            "missing"
        );
        // A new scrape makes it fresh again.
        state.store(sample(7, Instant::now()));
        let at = state.peek().as_deref().map(|s| s.scraped_at);
        assert_eq!(
            EngineSignal::state_of(at, Instant::now(), threshold),
            "fresh"
        );
        assert_eq!(
            state
                .signal(Instant::now(), threshold)
                .fresh()
                .map(|s| s.waiting_requests),
            Some(7)
        );
    }
}
