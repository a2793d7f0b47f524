//! The engine's own view of its load, as last scraped from its metrics, and whether that view is
//! still fresh enough to trust.
//!
//! The scraper stores a whole [`EngineSample`] at once (one atomic pointer swap), so a reader
//! never sees the queue of one scrape with the KV usage of another. Beside it sits the sample's
//! [`SampleBrief`], the four numbers every decision reads of every candidate, behind a sequence
//! lock ([`SeqWords`]): a reader writes nothing shared, where borrowing the `Arc` cost a
//! thread-local debt slot and a locked compare-and-swap per candidate. Its time is a [`Stamp`]
//! (nanoseconds from a process-wide origin), so a candidate's age is one subtraction from the
//! decision's stamp. Timestamps are `tokio::time::Instant`s, so staleness follows paused time in
//! tests.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::time::Instant;

use super::seqlock::SeqWords;

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
    /// `fresh`, `stale` or `missing` for a sample `age` old (None: never scraped), without
    /// building the signal.
    pub fn state_of(age: Option<Duration>, staleness: Duration) -> &'static str {
        match age {
            None => "missing",
            Some(age) if age <= staleness => "fresh",
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

/// What a decision reads of an endpoint's last sample, as of some instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleBrief {
    /// [`EngineSample::waiting_requests`].
    pub waiting_requests: u64,
    /// [`EngineSample::running_requests`].
    pub running_requests: u64,
    /// [`EngineSample::kv_cache_usage`].
    pub kv_cache_usage: f64,
    /// Time since [`EngineSample::scraped_at`] (zero for a sample from the future).
    pub age: Duration,
}

/// The words of a [`SampleBrief`]: waiting, running, KV usage's bits, `scraped_at`'s [`Stamp`].
type Brief = SeqWords<4>;

/// The brief's words for `s`.
fn brief_words(s: &EngineSample) -> [u64; 4] {
    [
        s.waiting_requests,
        s.running_requests,
        s.kv_cache_usage.to_bits(),
        Stamp::of(s.scraped_at).0 as u64,
    ]
}

/// The brief of `words` as of `now`.
fn brief_of([waiting, running, kv_usage_bits, at]: [u64; 4], now: Stamp) -> SampleBrief {
    SampleBrief {
        waiting_requests: waiting,
        running_requests: running,
        kv_cache_usage: f64::from_bits(kv_usage_bits),
        age: now.since(Stamp(at as i64)),
    }
}

/// An instant as signed nanoseconds from a fixed origin of the process (saturating at ±292
/// years): what [`EngineState::brief_at`] takes, so a decision converts its `now` once and
/// reads every candidate's age with one subtraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(i64);

impl Stamp {
    /// `at` as a stamp.
    pub fn of(at: Instant) -> Stamp {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        let origin = *ORIGIN.get_or_init(Instant::now);
        Stamp(if at >= origin {
            i64::try_from(at.duration_since(origin).as_nanos()).unwrap_or(i64::MAX)
        } else {
            i64::try_from(origin.duration_since(at).as_nanos()).map_or(i64::MIN, |n| -n)
        })
    }

    /// The nanoseconds from the origin (for storing in a word).
    pub fn raw(self) -> i64 {
        self.0
    }

    /// The stamp of [`Self::raw`]'s value.
    pub fn from_raw(ns: i64) -> Stamp {
        Stamp(ns)
    }

    /// Time from `earlier` to this stamp, zero if `earlier` is later: an integer subtraction.
    pub fn since(self, earlier: Stamp) -> Duration {
        Duration::from_nanos(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

/// The last engine sample of one endpoint.
#[derive(Debug, Default)]
pub struct EngineState {
    last: ArcSwapOption<EngineSample>,
    brief: Brief,
    /// Serialises stores, so the sample and its brief are replaced together.
    writer: parking_lot::Mutex<()>,
}

impl EngineState {
    /// Replaces the sample; returns the previous one.
    pub fn store(&self, sample: EngineSample) -> Option<Arc<EngineSample>> {
        let _writer = self.writer.lock();
        self.brief.write(brief_words(&sample));
        self.last.swap(Some(Arc::new(sample)))
    }

    /// The last sample, however old.
    pub fn last(&self) -> Option<Arc<EngineSample>> {
        self.last.load_full()
    }

    /// The brief of the last sample as of `now`, however old: what a decision reads of every
    /// candidate, without touching the sample's reference count or writing anything shared.
    pub fn brief(&self, now: Instant) -> Option<SampleBrief> {
        self.brief_at(Stamp::of(now))
    }

    /// [`EngineState::brief`] as of a [`Stamp`] taken once for many reads.
    pub fn brief_at(&self, now: Stamp) -> Option<SampleBrief> {
        self.brief.read().map(|words| brief_of(words, now))
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
        // The decision's brief says the same as the signal, at every point.
        let age = Some(Duration::from_millis(2001));
        assert_eq!(EngineSignal::state_of(age, threshold), "stale");
        let age = state.brief(Instant::now()).map(|s| s.age);
        assert_eq!(age, Some(Duration::from_millis(2001)));
        assert_eq!(
            EngineSignal::state_of(age, threshold),
            state.signal(Instant::now(), threshold).as_str()
        );
        assert_eq!(EngineSignal::state_of(None, threshold), "missing");
        // A new scrape makes it fresh again.
        state.store(sample(7, Instant::now()));
        let age = state.brief(Instant::now()).map(|s| s.age);
        assert_eq!(EngineSignal::state_of(age, threshold), "fresh");
        assert_eq!(
            state
                .signal(Instant::now(), threshold)
                .fresh()
                .map(|s| s.waiting_requests),
            Some(7)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_brief_is_the_last_sample_even_one_older_than_the_first() {
        let state = EngineState::default();
        assert_eq!(state.brief(Instant::now()), None);
        let first = Instant::now();
        state.store(sample(3, first));
        tokio::time::advance(Duration::from_millis(10)).await;
        let later = Instant::now();
        state.store(EngineSample {
            kv_cache_usage: 0.25,
            running_requests: 9,
            ..sample(4, later)
        });
        tokio::time::advance(Duration::from_millis(5)).await;
        let brief = state.brief(Instant::now()).expect("stored");
        assert_eq!(
            brief,
            SampleBrief {
                waiting_requests: 4,
                running_requests: 9,
                kv_cache_usage: 0.25,
                age: Duration::from_millis(5),
            }
        );
        // A scrape that completed before the first one stored (out of order) keeps its time.
        let earlier = first - Duration::from_millis(7);
        state.store(sample(5, earlier));
        let brief = state.brief(Instant::now()).expect("stored");
        assert_eq!(
            (brief.waiting_requests, brief.age),
            (5, Duration::from_millis(22))
        );
        assert_eq!(state.last().map(|s| s.scraped_at), Some(earlier));
        // Seen from before its scrape (a clock read before the store), a sample is 0 old.
        assert_eq!(state.brief(earlier).map(|b| b.age), Some(Duration::ZERO));
        assert_eq!(
            state.brief(first - Duration::from_millis(9)).map(|b| b.age),
            Some(Duration::ZERO)
        );
    }
}
