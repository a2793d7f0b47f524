//! What the router learns about each endpoint from the first-byte times it observes: its real
//! prefill speed, and how far its TTFT stays above what the cost model predicts.
//!
//! # The estimator
//!
//! When the router routes a request to endpoint `e`, it knows the prefill work ahead of the
//! request's first token there: `work = queued + uncached`, the uncached prompt tokens of requests
//! it routed to `e` that have not produced a first byte yet, plus this request's own uncached
//! tokens. The cost model charges `fixed` ms on top (its base cost and the slow-down per request
//! running on `e`). When the first byte comes back after `ttft` ms, one speed sample is
//!
//! ```text
//! speed = work / (ttft - fixed)        tokens per second
//! ```
//!
//! A sample only means "prefill speed" when prefill dominated the wait, so it is taken only when:
//! the request was served by the endpoint it was routed to (no retry), `work` is at least
//! `min_sample_tokens` (small requests measure fixed costs: HTTP, scheduling, one decode step),
//! `ttft > fixed`, the engine's scraped queue was empty at decision time (a request that
//! waited for a batch slot behind long decodes measured the decodes, not the prefill), and
//! the request loaded none of its prefix from a slower tier (its first byte waited for the
//! transfer and then for the engine's next step to notice it: on the offload benchmark at
//! 20 GB/s, such samples, a few hundred computed tokens over a step's wait, dragged three
//! identical A100-class replicas' learned speeds to 9.4k-14.8k tokens/s where the same traffic
//! priced with the flat weight learned 26k-31k, and the slow-looking replicas were avoided). A
//! sample's time is clamped so that its speed lies in `[min_prefill_tokens_per_s,
//! max_prefill_tokens_per_s]`; the learned speed is the ratio of the moving averages (EWMA,
//! `alpha`) of work and time, `avg(work) / avg(ttft - fixed)`, and replaces the configured one
//! after `min_samples` samples. Small requests still understate the speed somewhat (their fixed
//! costs are in the denominator); that bias is the same on every endpoint of the same hardware,
//! so it does not skew the choice between them.
//!
//! A ratio of averages, not an average of ratios: one TTFT includes up to one engine step of
//! waiting for the step in progress to end (~0.2 s on an A100 with a 2k-token chunk), so one
//! sample's speed is off by up to ~2x either way, and the average of such ratios is biased
//! upwards (Jensen) and noisy. On four identical simulated A100s (kvbench, unique 2000-token
//! prompts at 10 req/s, 2026-12-03) the average of ratios learned speeds up to 50% apart
//! between the four, and the cost model sent more work to the replicas that looked faster.
//! Averaging work and time apart weights each sample by how long it measured, where that jitter
//! is smallest relative to the wait.
//!
//! The **TTFT residual** is `ttft - predicted`, over every served request, where `predicted` is
//! the cost model's prediction without the residual itself. It captures what the router cannot
//! see: requests queued for batch slots (`max_num_seqs` reached), traffic that bypasses the
//! router, a slow host. Its EWMA is added to the endpoint's predictions, clamped to
//! `0..=max_residual_ms`. Without new samples it decays (halving every `residual_half_life_ms`),
//! so an endpoint that stopped getting traffic because it looked slow is tried again.
//!
//! The **CPU tier's load bandwidth** comes from the engine itself: vLLM's offloading connector
//! counts the bytes it moved and the time the transfers took (`kv_offload_total_bytes`,
//! `kv_offload_total_time`, `CPU_to_GPU`). Between two scrapes, one sample is
//! `Δbytes / Δseconds`, taken when at least [`MIN_LOAD_SAMPLE_BYTES`] moved; samples are
//! averaged (EWMA, `alpha`) and replace the pool's `kv_tiers.cpu.bandwidth_gb_per_s` after
//! `min_samples`.

use parking_lot::Mutex;
use tokio::time::Instant;

use super::decay::{Decay, Ewma};
use super::engine::Stamp;
use super::seqlock::SeqWords;
use crate::config::LearningConfig;

/// What the router predicted for a request when it decided, kept until its first byte.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftContext {
    /// Prefill tokens queued on the endpoint ahead of the request plus its own uncached tokens.
    pub work_tokens: u64,
    /// How long the first of the prompts ahead had been prefilling at the decision, ms (0 with
    /// none ahead): the sample spans from its start to this request's first byte, the time in
    /// which all of `work_tokens` was prefilled. Without it a request sent when the one ahead
    /// was nearly done counts that whole prompt as done in its own wait, and the speed learned
    /// comes out too fast.
    pub ahead_elapsed_ms: f64,
    /// Fixed costs the cost model added (base and per running request), ms.
    pub fixed_ms: f64,
    /// The cost model's prediction without the learned residual, ms.
    pub predicted_ms: f64,
    /// The engine's scraped waiting requests at decision time, if fresh.
    pub engine_waiting: Option<u64>,
    /// Part of the prefix was to be loaded from a slower tier (no speed sample then).
    pub tier_load: bool,
}

/// The samples one observation produced.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    /// The prefill-speed sample, tokens per second (after clamping), if one was taken.
    pub speed_tokens_per_s: Option<f64>,
    /// The TTFT residual sample, ms, if one was taken.
    pub residual_ms: Option<f64>,
}

/// A copy of what was learned, for explanations and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LearnedSnapshot {
    /// The learned prefill speed, once trusted.
    pub prefill_tokens_per_s: Option<f64>,
    /// Speed samples so far.
    pub speed_samples: u64,
    /// The residual added to predictions now (decayed, clamped; 0 until trusted), ms.
    pub ttft_residual_ms: f64,
    /// Residual samples so far.
    pub residual_samples: u64,
    /// The CPU tier's learned load bandwidth, GB/s, once trusted.
    pub cpu_load_gb_per_s: Option<f64>,
}

#[derive(Debug, Default)]
struct State {
    /// Prefill work of the speed samples, tokens (averaged).
    speed_work: Ewma,
    /// Prefill time of the speed samples, seconds (averaged, clamped per sample).
    speed_secs: Ewma,
    /// Fades between samples (`residual_half_life_ms`).
    residual: Ewma,
    /// CPU tier load bandwidth, bytes per second.
    cpu_load: Ewma,
}

/// What [`State`] holds, as plain numbers: what the getters read under the lock, and what a
/// decision reads without it, published to a [`SeqWords`] on every change.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Learnt {
    speed_work: f64,
    speed_secs: f64,
    speed_samples: u64,
    residual: f64,
    residual_samples: u64,
    /// When the residual was last decayed to; None before its first sample.
    residual_at: Option<Stamp>,
    cpu_load: f64,
    cpu_load_samples: u64,
}

/// `residual_at`'s word when there is none (a stamp 292 years before the process began).
const NO_STAMP: u64 = i64::MIN as u64;

impl Learnt {
    fn of(s: &State) -> Learnt {
        Learnt {
            speed_work: s.speed_work.value(),
            speed_secs: s.speed_secs.value(),
            speed_samples: s.speed_secs.samples(),
            residual: s.residual.value(),
            residual_samples: s.residual.samples(),
            residual_at: s
                .residual
                .updated_at()
                .map(|at| Stamp::of(Instant::from_std(at))),
            cpu_load: s.cpu_load.value(),
            cpu_load_samples: s.cpu_load.samples(),
        }
    }

    fn words(&self) -> [u64; 8] {
        [
            self.speed_work.to_bits(),
            self.speed_secs.to_bits(),
            self.speed_samples,
            self.residual.to_bits(),
            self.residual_samples,
            self.residual_at.map_or(NO_STAMP, |at| at.raw() as u64),
            self.cpu_load.to_bits(),
            self.cpu_load_samples,
        ]
    }

    fn from_words(w: [u64; 8]) -> Learnt {
        Learnt {
            speed_work: f64::from_bits(w[0]),
            speed_secs: f64::from_bits(w[1]),
            speed_samples: w[2],
            residual: f64::from_bits(w[3]),
            residual_samples: w[4],
            residual_at: (w[5] != NO_STAMP).then(|| Stamp::from_raw(w[5] as i64)),
            cpu_load: f64::from_bits(w[6]),
            cpu_load_samples: w[7],
        }
    }

    /// The learned prefill speed (ratio of the averages), once `min_samples` were taken.
    fn speed(&self, cfg: &LearningConfig) -> Option<f64> {
        let secs = trusted(self.speed_secs, self.speed_samples, cfg)?;
        (secs > 0.0).then(|| {
            (self.speed_work / secs)
                .clamp(cfg.min_prefill_tokens_per_s, cfg.max_prefill_tokens_per_s)
        })
    }

    /// The residual at `now`, decayed and clamped; 0 when off or not trusted yet.
    fn residual_ms(&self, cfg: &LearningConfig, now: Stamp) -> f64 {
        if !cfg.ttft_residual {
            return 0.0;
        }
        trusted(self.residual, self.residual_samples, cfg)
            .map(|v| match self.residual_at {
                Some(at) => v * residual_decay(cfg).factor(now.since(at)),
                None => v,
            })
            .map_or(0.0, |v| v.clamp(0.0, cfg.max_residual_ms))
    }

    fn cpu_load(&self, cfg: &LearningConfig) -> Option<f64> {
        trusted(self.cpu_load, self.cpu_load_samples, cfg)
    }
}

/// `value` once `samples` reach `min_samples` (at least 1).
fn trusted(value: f64, samples: u64, cfg: &LearningConfig) -> Option<f64> {
    (samples >= u64::from(cfg.min_samples.max(1))).then_some(value)
}

/// A CPU-tier bandwidth sample needs at least this many bytes loaded between two scrapes
/// (1 MiB: a few blocks; smaller transfers measure setup time, not bandwidth).
pub const MIN_LOAD_SAMPLE_BYTES: f64 = 1_048_576.0;

/// What was learned, as a decision reads it ([`Learned::for_decision`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ForDecision {
    /// Trusted prefill speed, tokens per second; `None` until `min_samples` were taken.
    pub prefill_tokens_per_s: Option<f64>,
    /// TTFT residual, ms (0 when off or not trusted yet).
    pub ttft_residual_ms: f64,
    /// Trusted CPU tier load bandwidth, bytes per second; `None` until trusted.
    pub cpu_load_bytes_per_s: Option<f64>,
}

/// One endpoint's learned speed and residual. Updated once per response, read per decision.
#[derive(Debug, Default)]
pub struct Learned {
    /// Serialises the writers (one per response) and the getters (admin, metrics).
    state: Mutex<State>,
    /// [`Learnt`] of `state` after its last change, for decisions to read without the lock.
    brief: SeqWords<8>,
}

fn residual_decay(cfg: &LearningConfig) -> Decay {
    Decay::half_life(std::time::Duration::from_millis(cfg.residual_half_life_ms))
}

impl Learned {
    /// Learns from a first byte `ttft_ms` after the decision described by `ctx`.
    pub fn observe(
        &self,
        ctx: &TtftContext,
        ttft_ms: f64,
        cfg: &LearningConfig,
        now: Instant,
    ) -> Observed {
        if !cfg.enabled || !ttft_ms.is_finite() || ttft_ms < 0.0 {
            return Observed::default();
        }
        let mut out = Observed::default();
        let ahead_ms = if ctx.ahead_elapsed_ms.is_finite() {
            ctx.ahead_elapsed_ms.max(0.0)
        } else {
            0.0
        };
        let prefill_ms = ttft_ms + ahead_ms - ctx.fixed_ms;
        let queued_for_slot = ctx.engine_waiting.is_some_and(|w| w > 0);
        let mut speed_sample = None;
        if ctx.work_tokens >= cfg.min_sample_tokens.max(1)
            && prefill_ms > 0.0
            && !queued_for_slot
            && !ctx.tier_load
        {
            // The time clamped so that the sample's speed stays within the configured bounds.
            let work = ctx.work_tokens as f64;
            let secs = (prefill_ms / 1e3).clamp(
                work / cfg.max_prefill_tokens_per_s,
                work / cfg.min_prefill_tokens_per_s,
            );
            speed_sample = Some((work, secs));
            out.speed_tokens_per_s = Some(work / secs);
        }
        if cfg.ttft_residual && ctx.predicted_ms.is_finite() {
            out.residual_ms = Some(ttft_ms - ctx.predicted_ms);
        }
        let mut s = self.state.lock();
        if let Some((work, secs)) = speed_sample {
            s.speed_work.add(work, cfg.alpha);
            s.speed_secs.add(secs, cfg.alpha);
        }
        if let Some(residual) = out.residual_ms {
            s.residual
                .add_at(residual, cfg.alpha, now.into_std(), residual_decay(cfg));
        }
        self.brief.write(Learnt::of(&s).words());
        out
    }

    /// What the lock guards, now.
    fn learnt(&self) -> Learnt {
        Learnt::of(&self.state.lock())
    }

    /// The learned prefill speed, once `min_samples` samples were taken (and learning is on).
    pub fn prefill_tokens_per_s(&self, cfg: &LearningConfig) -> Option<f64> {
        if !cfg.enabled {
            return None;
        }
        self.learnt().speed(cfg)
    }

    /// The residual to add to predictions at `now`, ms: decayed, clamped to
    /// `0..=max_residual_ms`, and 0 until `min_samples` samples were taken.
    pub fn ttft_residual_ms(&self, cfg: &LearningConfig, now: Instant) -> f64 {
        if !cfg.enabled {
            return 0.0;
        }
        self.learnt().residual_ms(cfg, Stamp::of(now))
    }

    /// What a decision asks of every candidate (hundreds of them at 256 endpoints), without a
    /// lock: [`Self::prefill_tokens_per_s`], [`Self::ttft_residual_ms`] and
    /// [`Self::cpu_load_bytes_per_s`].
    pub fn for_decision(&self, cfg: &LearningConfig, now: Instant) -> ForDecision {
        self.for_decision_at(cfg, Stamp::of(now))
    }

    /// [`Self::for_decision`] as of a [`Stamp`] taken once for many reads. Reads the copy the
    /// last change published, where a lock per candidate was two locked read-modify-writes.
    pub fn for_decision_at(&self, cfg: &LearningConfig, now: Stamp) -> ForDecision {
        if !cfg.enabled {
            return ForDecision::default();
        }
        let Some(words) = self.brief.read() else {
            return ForDecision::default();
        };
        let learnt = Learnt::from_words(words);
        ForDecision {
            prefill_tokens_per_s: learnt.speed(cfg),
            ttft_residual_ms: learnt.residual_ms(cfg, now),
            cpu_load_bytes_per_s: learnt.cpu_load(cfg),
        }
    }

    /// Learns the CPU tier's bandwidth from `bytes` loaded in `seconds` of transfers since the
    /// previous scrape; returns the sample taken, bytes per second.
    pub fn observe_cpu_load(&self, bytes: f64, seconds: f64, cfg: &LearningConfig) -> Option<f64> {
        let measurable = bytes >= MIN_LOAD_SAMPLE_BYTES && seconds > 0.0;
        if !cfg.enabled || !measurable {
            return None;
        }
        let sample = bytes / seconds;
        if !sample.is_finite() {
            return None;
        }
        let mut s = self.state.lock();
        s.cpu_load.add(sample, cfg.alpha);
        self.brief.write(Learnt::of(&s).words());
        Some(sample)
    }

    /// The CPU tier's learned load bandwidth, bytes per second, once `min_samples` were taken.
    pub fn cpu_load_bytes_per_s(&self, cfg: &LearningConfig) -> Option<f64> {
        if !cfg.enabled {
            return None;
        }
        self.learnt().cpu_load(cfg)
    }

    /// What was learned, as of `now`.
    pub fn snapshot(&self, cfg: &LearningConfig, now: Instant) -> LearnedSnapshot {
        let (speed_samples, residual_samples) = {
            let s = self.state.lock();
            (s.speed_secs.samples(), s.residual.samples())
        };
        LearnedSnapshot {
            prefill_tokens_per_s: self.prefill_tokens_per_s(cfg),
            speed_samples,
            ttft_residual_ms: self.ttft_residual_ms(cfg, now),
            residual_samples,
            cpu_load_gb_per_s: self.cpu_load_bytes_per_s(cfg).map(|b| b / 1e9),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ctx(work_tokens: u64, predicted_ms: f64) -> TtftContext {
        TtftContext {
            work_tokens,
            ahead_elapsed_ms: 0.0,
            fixed_ms: 5.0,
            predicted_ms,
            engine_waiting: Some(0),
            tier_load: false,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_speed_converges_to_the_endpoints_real_speed() {
        let cfg = LearningConfig::default();
        let learned = Learned::default();
        // A replica prefilling 4,000 tokens/s with 5 ms of fixed cost, configured as 10,000.
        let real = 4000.0;
        for i in 0..60u64 {
            let work = 500 + (i % 5) * 700;
            let ttft = 5.0 + work as f64 / real * 1e3;
            if i < u64::from(cfg.min_samples) - 1 {
                learned.observe(&ctx(work, ttft), ttft, &cfg, Instant::now());
                assert_eq!(learned.prefill_tokens_per_s(&cfg), None, "not trusted yet");
                continue;
            }
            learned.observe(&ctx(work, ttft), ttft, &cfg, Instant::now());
        }
        let speed = learned.prefill_tokens_per_s(&cfg).expect("trusted");
        assert!((speed - real).abs() < 1.0, "{speed}");
    }

    /// Each first byte also waits for the engine step in progress: a 2,000-token prefill of
    /// 200 ms shows as 100 to 300 ms. An average of the samples' speeds (20k and 6.7k
    /// alternately) learns 12.6k-14.2k tokens/s (the code before 2026-12-03 ended this test at
    /// 12,593); the ratio of the averages learns the 10k.
    #[tokio::test(start_paused = true)]
    async fn step_jitter_does_not_inflate_the_learned_speed() {
        let cfg = LearningConfig::default();
        let learned = Learned::default();
        for i in 0..200u64 {
            let ttft = 5.0 + if i % 2 == 0 { 100.0 } else { 300.0 };
            learned.observe(&ctx(2000, ttft), ttft, &cfg, Instant::now());
        }
        let speed = learned.prefill_tokens_per_s(&cfg).expect("trusted");
        assert!((speed - 10_000.0).abs() < 1_000.0, "{speed}");
    }

    /// A request sent while the prompt ahead of it was part done: 2,000 tokens ahead of which
    /// 150 ms of 200 were done, its own 2,000 after, so its first byte comes 250 ms after the
    /// decision. Counting the whole prompt ahead in those 250 ms learns 16k tokens/s; the
    /// sample from the head's start (400 ms for 4,000 tokens) learns the 10k.
    #[tokio::test(start_paused = true)]
    async fn a_sample_spans_from_the_start_of_the_prompt_ahead() {
        let cfg = LearningConfig::default();
        let (with, without) = (Learned::default(), Learned::default());
        for _ in 0..20 {
            let sent_late = TtftContext {
                ahead_elapsed_ms: 150.0,
                ..ctx(4000, f64::NAN)
            };
            with.observe(&sent_late, 5.0 + 250.0, &cfg, Instant::now());
            without.observe(&ctx(4000, f64::NAN), 5.0 + 250.0, &cfg, Instant::now());
        }
        let speed = |l: &Learned| l.prefill_tokens_per_s(&cfg).expect("trusted");
        assert!((speed(&with) - 10_000.0).abs() < 1.0, "{}", speed(&with));
        assert!(
            (speed(&without) - 16_000.0).abs() < 1.0,
            "{}",
            speed(&without)
        );
        // Nonsense elapsed times count as none.
        for bad in [f64::NAN, -50.0, f64::NEG_INFINITY] {
            let odd = Learned::default();
            for _ in 0..20 {
                let c = TtftContext {
                    ahead_elapsed_ms: bad,
                    ..ctx(4000, f64::NAN)
                };
                odd.observe(&c, 5.0 + 250.0, &cfg, Instant::now());
            }
            assert!(
                (speed(&odd) - 16_000.0).abs() < 1.0,
                "{bad}: {}",
                speed(&odd)
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn samples_that_did_not_measure_prefill_are_skipped_and_outliers_clamped() {
        let cfg = LearningConfig::default();
        let learned = Learned::default();
        let now = Instant::now();
        let small = learned.observe(&ctx(100, 0.0), 50.0, &cfg, now);
        assert_eq!(small.speed_tokens_per_s, None, "below min_sample_tokens");
        let queued = TtftContext {
            engine_waiting: Some(3),
            ..ctx(2000, 0.0)
        };
        assert_eq!(
            learned
                .observe(&queued, 900.0, &cfg, now)
                .speed_tokens_per_s,
            None,
            "waited for a batch slot"
        );
        let loaded = TtftContext {
            tier_load: true,
            ..ctx(2000, 0.0)
        };
        assert_eq!(
            learned
                .observe(&loaded, 900.0, &cfg, now)
                .speed_tokens_per_s,
            None,
            "waited for a transfer from a slower tier"
        );
        assert_eq!(
            learned
                .observe(&ctx(2000, 0.0), 4.0, &cfg, now)
                .speed_tokens_per_s,
            None,
            "faster than the fixed cost: no prefill time to divide by"
        );
        let fast = learned.observe(&ctx(2000, 0.0), 5.001, &cfg, now);
        assert_eq!(fast.speed_tokens_per_s, Some(cfg.max_prefill_tokens_per_s));
        let slow = learned.observe(&ctx(2000, 0.0), 1e9, &cfg, now);
        assert_eq!(slow.speed_tokens_per_s, Some(cfg.min_prefill_tokens_per_s));
        let off = LearningConfig {
            enabled: false,
            ..cfg
        };
        assert_eq!(
            learned.observe(&ctx(2000, 0.0), 100.0, &off, now),
            Observed::default()
        );
        assert_eq!(learned.prefill_tokens_per_s(&off), None);
    }

    #[test]
    fn cpu_tier_bandwidth_is_learned_from_the_engines_transfer_counters() {
        let cfg = LearningConfig::default();
        let learned = Learned::default();
        // 20 MB in 1 ms of transfers: 20 GB/s; trusted after min_samples.
        for i in 0..cfg.min_samples {
            assert_eq!(learned.cpu_load_bytes_per_s(&cfg), None, "sample {i}");
            assert_eq!(learned.observe_cpu_load(20e6, 1e-3, &cfg), Some(20e9));
        }
        assert_eq!(learned.cpu_load_bytes_per_s(&cfg), Some(20e9));
        // Too little moved, no time, nonsense: no sample.
        for (bytes, s) in [(1000.0, 1e-6), (20e6, 0.0), (f64::NAN, 1.0), (20e6, -1.0)] {
            assert_eq!(
                learned.observe_cpu_load(bytes, s, &cfg),
                None,
                "{bytes} {s}"
            );
        }
        let off = LearningConfig {
            enabled: false,
            ..cfg
        };
        assert_eq!(learned.cpu_load_bytes_per_s(&off), None);
    }

    /// A decision's read without the lock (the published copy) says what the three getters
    /// read under it, in every configuration, after every kind of sample.
    #[tokio::test(start_paused = true)]
    async fn for_decision_reads_what_the_getters_read() {
        let on = LearningConfig {
            ttft_residual: true,
            ..LearningConfig::default()
        };
        let learned = Learned::default();
        let agree = |cfg: &LearningConfig| {
            let now = Instant::now();
            let d = learned.for_decision(cfg, now);
            assert_eq!(
                d,
                ForDecision {
                    prefill_tokens_per_s: learned.prefill_tokens_per_s(cfg),
                    ttft_residual_ms: learned.ttft_residual_ms(cfg, now),
                    cpu_load_bytes_per_s: learned.cpu_load_bytes_per_s(cfg),
                }
            );
            d
        };
        assert_eq!(agree(&on), ForDecision::default(), "nothing learned yet");
        for _ in 0..on.min_samples {
            learned.observe(&ctx(2000, 100.0), 400.0, &on, Instant::now());
            learned.observe_cpu_load(20e6, 1e-3, &on);
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let d = agree(&on);
        assert!(d.prefill_tokens_per_s.is_some() && d.cpu_load_bytes_per_s.is_some());
        assert!(d.ttft_residual_ms > 0.0, "{d:?}");
        let no_residual = LearningConfig {
            ttft_residual: false,
            ..on.clone()
        };
        assert_eq!(agree(&no_residual).ttft_residual_ms, 0.0);
        let off = LearningConfig {
            enabled: false,
            ..on
        };
        assert_eq!(agree(&off), ForDecision::default());
    }

    #[tokio::test(start_paused = true)]
    async fn residual_converges_then_decays_without_samples() {
        let cfg = LearningConfig {
            ttft_residual: true,
            ..LearningConfig::default()
        };
        let learned = Learned::default();
        // Predicted 100 ms, observed 400 ms: 300 ms the router cannot see.
        for _ in 0..40 {
            learned.observe(&ctx(10, 100.0), 400.0, &cfg, Instant::now());
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let r = learned.ttft_residual_ms(&cfg, Instant::now());
        // Slightly below: the average also decays in the 10 ms between samples.
        assert!((r - 300.0).abs() < 5.0, "{r}");
        tokio::time::advance(Duration::from_millis(cfg.residual_half_life_ms)).await;
        let half = learned.ttft_residual_ms(&cfg, Instant::now());
        assert!(
            (half - r / 2.0).abs() < 2.0,
            "halved after a half-life: {half}"
        );
        // Faster than predicted never subtracts.
        let quick = Learned::default();
        for _ in 0..10 {
            quick.observe(&ctx(10, 100.0), 20.0, &cfg, Instant::now());
        }
        assert_eq!(quick.ttft_residual_ms(&cfg, Instant::now()), 0.0);
        // Clamped.
        let huge = Learned::default();
        for _ in 0..10 {
            huge.observe(&ctx(10, 0.0), 1e7, &cfg, Instant::now());
        }
        assert_eq!(
            huge.ttft_residual_ms(&cfg, Instant::now()),
            cfg.max_residual_ms
        );
        let snap = learned.snapshot(&cfg, Instant::now());
        assert_eq!(snap.residual_samples, 40);
        assert_eq!(snap.speed_samples, 0, "10-token samples measure no speed");
    }
}
