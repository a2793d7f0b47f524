//! Workloads: a plan's traffic shape turned into a concrete, seeded request trace. Every policy
//! is run on the identical trace (same text, same arrival times, same follow-up structure).
//!
//! One file per shape; this file holds the trace types and what they share (arrivals, Zipf).

mod flow_mix;
mod hot_prefix;
mod multi_tenant;
mod multi_turn;
pub mod replay;
mod shared_prefix;
mod unique;

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::plan::{OutputLen, Plan, ReplicaGroup, Shape, WorkloadSpec};
use super::vocab::Vocab;
use super::BenchError;
use kvsim::PromptTokenizer;

/// When a request is sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Start {
    /// At this simulated time after the run's start, in ms.
    At(f64),
    /// `think_ms` (simulated) after request `prev` ended (a conversation's next turn).
    After {
        /// The previous turn's id.
        prev: usize,
        /// Think time, simulated ms.
        think_ms: f64,
    },
}

/// A chat message of a trace request.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text (shared between requests where prompts share it).
    pub content: Arc<str>,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Index in the trace.
    pub id: usize,
    /// When it is sent.
    pub start: Start,
    /// The chat messages.
    pub messages: Vec<Message>,
    /// `max_tokens` (the simulator generates exactly this many).
    pub max_tokens: u32,
    /// The tenant (sent in the workload's tenant header), if any.
    pub tenant: Option<String>,
    /// vLLM's `cache_salt`, if any.
    pub cache_salt: Option<String>,
    /// Prefix group, conversation or tenant number, for analysis.
    pub group: usize,
    /// Sent straight to a replica, bypassing Envoy and the router.
    pub bypass: bool,
    /// The objective (sent in the trace's `objective_header`), if any.
    pub objective: Option<String>,
}

impl TraceRequest {
    /// The OpenAI chat-completions body (streaming, usage included).
    pub fn body(&self, model: &str) -> serde_json::Value {
        let messages: Vec<_> = self
            .messages
            .iter()
            .map(|m| json!({"role": m.role, "content": &*m.content}))
            .collect();
        let mut body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(salt) = &self.cache_salt {
            body["cache_salt"] = json!(salt);
        }
        body
    }
}

/// A workload's concrete requests.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The workload's name.
    pub workload: String,
    /// Mean arrival rate, requests per simulated second.
    pub rate: f64,
    /// The requests, in id order.
    pub requests: Vec<TraceRequest>,
    /// Header carrying `TraceRequest::tenant`, if the workload has tenants.
    pub tenant_header: Option<String>,
    /// Header carrying `TraceRequest::objective` (the Inference Extension's objective header),
    /// if the workload names objectives.
    pub objective_header: Option<String>,
    /// Facts about the generated trace for the report (e.g. how groups were sized).
    pub notes: Vec<String>,
    /// The seed it was generated from.
    pub seed: u64,
    /// Trace replay: per request, the input tokens the trace says it shares with earlier
    /// requests (checked against the engine's own block hashes).
    pub expected_shared_tokens: Option<Vec<usize>>,
}

/// What a workload generator needs.
pub struct GenContext<'a> {
    /// Prompt text source.
    pub vocab: &'a Vocab,
    /// The engine's tokenizer (to size prefixes in the engine's tokens).
    pub engine: &'a dyn PromptTokenizer,
    /// Tokens the fleet's KV caches hold in total.
    pub fleet_kv_tokens: u64,
    /// Seeded generator for prompt text and choices (the same for every rate of a sweep).
    pub rng: StdRng,
    /// The model name.
    pub model: &'a str,
    /// Output lengths.
    pub outputs: OutputSampler,
    /// The seed of this trace (trace replay derives its block texts from it).
    pub seed: u64,
}

impl GenContext<'_> {
    /// Text of `tokens` tokens.
    pub fn text(&mut self, tokens: usize) -> Result<Arc<str>, BenchError> {
        Ok(self.vocab.text(&mut self.rng, tokens)?.into())
    }

    /// Engine tokens of a chat made of `messages` (generation prompt included).
    pub fn engine_tokens(&self, messages: &[Message]) -> Result<usize, BenchError> {
        let probe = TraceRequest {
            id: 0,
            start: Start::At(0.0),
            messages: messages.to_vec(),
            max_tokens: 1,
            tenant: None,
            cache_salt: None,
            group: 0,
            bypass: false,
            objective: None,
        };
        Ok(engine_ids(self.engine, &probe, self.model)?.len())
    }

    /// The next request's output length.
    pub fn output(&mut self) -> u32 {
        self.outputs.sample()
    }
}

/// Output lengths from a workload's [`OutputLen`], on their own seeded stream (so prompt text
/// does not depend on them).
#[derive(Debug)]
pub struct OutputSampler {
    spec: OutputLen,
    rng: StdRng,
}

impl OutputSampler {
    /// A sampler of `spec` seeded with `seed`.
    pub fn new(spec: OutputLen, seed: u64) -> OutputSampler {
        OutputSampler {
            spec,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The next length.
    pub fn sample(&mut self) -> u32 {
        match &self.spec {
            OutputLen::Fixed(n) => *n,
            OutputLen::LogNormal(d) => {
                // Box-Muller: one standard normal from two uniforms.
                let u1: f64 = self.rng.random_range(f64::EPSILON..1.0);
                let u2: f64 = self.rng.random_range(0.0..1.0);
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                let v = (d.median * (d.sigma * z).exp()).round();
                (v.clamp(f64::from(d.min), f64::from(d.max))) as u32
            }
        }
    }
}

/// The engine's token ids for a trace request's prompt.
pub fn engine_ids(
    engine: &dyn PromptTokenizer,
    req: &TraceRequest,
    model: &str,
) -> Result<Vec<u32>, BenchError> {
    let body =
        serde_json::to_vec(&req.body(model)).map_err(|e| BenchError::Trace(e.to_string()))?;
    let parsed = kvsim::request::parse(kvsim::request::ApiKind::ChatCompletions, &body)
        .map_err(|e| BenchError::Trace(e.to_string()))?;
    engine
        .request_tokens(&parsed)
        .map(|t| t.ids)
        .map_err(|e| BenchError::Trace(e.to_string()))
}

/// Tokens the KV caches of `fleet` hold in total.
pub fn fleet_kv_tokens(fleet: &[ReplicaGroup]) -> u64 {
    fleet
        .iter()
        .map(|g| {
            let blocks = g.num_gpu_blocks.unwrap_or_else(|| {
                kvsim::profile::StepProfile::builtin(&g.profile).map_or(0, |p| p.num_gpu_blocks)
            });
            g.count as u64 * u64::from(blocks.saturating_sub(1)) * u64::from(g.block_size)
        })
        .sum()
}

/// A stable 64-bit hash of a name (seeds per workload).
pub fn name_seed(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// Builds the trace of `workload` at `rate` from `seed`.
pub fn generate(
    plan: &Plan,
    workload: &WorkloadSpec,
    rate: f64,
    seed: u64,
    vocab: &Vocab,
    engine: &dyn PromptTokenizer,
) -> Result<Trace, BenchError> {
    let base = seed ^ name_seed(&workload.name);
    let mut cx = GenContext {
        vocab,
        engine,
        fleet_kv_tokens: fleet_kv_tokens(plan.fleet_of(workload)),
        rng: StdRng::seed_from_u64(base),
        model: &plan.model,
        outputs: OutputSampler::new(workload.output_tokens.clone(), base ^ 0x6f75_7470_7574),
        seed,
    };
    // Arrival times depend on the rate; text and choices do not.
    let mut arrivals = Arrivals::new(rate, base ^ rate.to_bits().rotate_left(17));
    let mut trace = match &workload.shape {
        Shape::SharedPrefix(s) => shared_prefix::generate(s, workload, &mut cx, &mut arrivals)?,
        Shape::MultiTurn(s) => multi_turn::generate(s, workload, &mut cx, &mut arrivals)?,
        Shape::Unique(s) => unique::generate(s, workload, &mut cx, &mut arrivals)?,
        Shape::HotPrefix(s) => hot_prefix::generate(s, workload, &mut cx, &mut arrivals)?,
        Shape::MultiTenant(s) => multi_tenant::generate(s, workload, &mut cx, &mut arrivals)?,
        Shape::Trace(s) => replay::generate(s, workload, &mut cx)?,
        Shape::FlowMix(s) => flow_mix::generate(s, workload, &mut cx, &mut arrivals)?,
    };
    trace.workload = workload.name.clone();
    if !matches!(workload.shape, Shape::Trace(_)) {
        trace.rate = rate;
    }
    trace.seed = seed;
    if workload.bypass_fraction > 0.0 {
        let mut rng = StdRng::seed_from_u64(base ^ 0x6279_7061_7373);
        let mut n = 0;
        for r in &mut trace.requests {
            r.bypass = rng.random_range(0.0..1.0) < workload.bypass_fraction;
            n += usize::from(r.bypass);
        }
        trace.notes.push(format!(
            "{n} of {} requests ({:.0}%) sent straight to a replica, bypassing the router",
            trace.requests.len(),
            100.0 * n as f64 / trace.requests.len().max(1) as f64
        ));
    }
    if !matches!(workload.output_tokens, OutputLen::Fixed(_)) {
        let outs: Vec<f64> = trace
            .requests
            .iter()
            .map(|r| f64::from(r.max_tokens))
            .collect();
        trace.notes.push(format!(
            "{}: mean {:.0}, p50 {:.0}, p90 {:.0}",
            workload.output_tokens.describe(),
            crate::stats::mean(&outs).unwrap_or(0.0),
            crate::stats::percentile(&outs, 0.5).unwrap_or(0.0),
            crate::stats::percentile(&outs, 0.9).unwrap_or(0.0)
        ));
    }
    Ok(trace)
}

/// A seeded Poisson process: exponential inter-arrival times.
#[derive(Debug)]
pub struct Arrivals {
    rng: StdRng,
    mean_gap_ms: f64,
    now_ms: f64,
    first: bool,
}

impl Arrivals {
    /// Arrivals at `rate` per simulated second.
    pub fn new(rate: f64, seed: u64) -> Arrivals {
        Arrivals {
            rng: StdRng::seed_from_u64(seed),
            mean_gap_ms: 1000.0 / rate,
            now_ms: 0.0,
            first: true,
        }
    }

    /// The next arrival time, simulated ms (the first is 0).
    pub fn next_ms(&mut self) -> f64 {
        if self.first {
            self.first = false;
            return 0.0;
        }
        self.now_ms += self.exponential(self.mean_gap_ms);
        self.now_ms
    }

    /// An exponential sample with mean `mean`.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        let u: f64 = self.rng.random_range(f64::EPSILON..1.0);
        -u.ln() * mean
    }
}

/// Zipf over ranks `0..n` with exponent `s` (rank 0 most likely).
#[derive(Debug, Clone)]
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    /// A sampler over `n` ranks (n >= 1).
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut total = 0.0;
        let cumulative = (1..=n.max(1))
            .map(|k| {
                total += 1.0 / (k as f64).powf(s);
                total
            })
            .collect();
        Zipf { cumulative }
    }

    /// Probability of rank `k`.
    pub fn probability(&self, k: usize) -> f64 {
        let total = *self.cumulative.last().unwrap_or(&1.0);
        let below = if k == 0 { 0.0 } else { self.cumulative[k - 1] };
        (self.cumulative[k] - below) / total
    }

    /// A rank.
    pub fn sample(&self, rng: &mut StdRng) -> usize {
        let total = *self.cumulative.last().unwrap_or(&1.0);
        let x = rng.random_range(0.0..total);
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.cumulative.len() - 1)
    }
}

fn system(content: &Arc<str>) -> Message {
    Message {
        role: "system",
        content: Arc::clone(content),
    }
}

fn user(content: Arc<str>) -> Message {
    Message {
        role: "user",
        content,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::plan::*;
    use kvsim::WordPieceTokenizer;

    pub(crate) fn vocab() -> Vocab {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
            .find(|p| p.join("tokenizer.json").is_file())
            .expect("shared fixture tokenizer");
        Vocab::load(&dir).unwrap()
    }

    pub(crate) fn workload(shape: Shape, requests: usize) -> WorkloadSpec {
        WorkloadSpec {
            name: "w".into(),
            shape,
            rate: 10.0,
            requests: Some(requests),
            ..WorkloadSpec::default()
        }
    }

    pub(crate) fn trace_of(w: &WorkloadSpec, fleet: Vec<ReplicaGroup>) -> Trace {
        let plan = Plan {
            fleet,
            ..Plan::default()
        };
        generate(
            &plan,
            w,
            w.rate,
            plan.seed,
            &vocab(),
            &WordPieceTokenizer::default(),
        )
        .unwrap()
    }

    #[test]
    fn poisson_mean_gap_and_zipf_shape() {
        let mut a = Arrivals::new(10.0, 7);
        let times: Vec<f64> = (0..5001).map(|_| a.next_ms()).collect();
        assert_eq!(times[0], 0.0);
        let mean_gap = times[5000] / 5000.0;
        assert!((mean_gap - 100.0).abs() < 5.0, "{mean_gap}");
        assert!(times.windows(2).all(|w| w[1] >= w[0]));

        let z = Zipf::new(10, 1.5);
        let sum: f64 = (0..10).map(|k| z.probability(k)).sum();
        assert!((sum - 1.0).abs() < 1e-9);
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = [0usize; 10];
        for _ in 0..20_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        let share0 = counts[0] as f64 / 20_000.0;
        assert!((share0 - z.probability(0)).abs() < 0.02, "{share0}");
        assert!(counts.windows(2).take(3).all(|w| w[0] > w[1]), "{counts:?}");
    }

    #[test]
    fn output_lengths_follow_the_distribution() {
        let spec = OutputLen::LogNormal(crate::plan::OutputDist {
            median: 300.0,
            sigma: 0.7,
            min: 16,
            max: 1024,
        });
        let mut s = OutputSampler::new(spec, 3);
        let v: Vec<f64> = (0..4000).map(|_| f64::from(s.sample())).collect();
        let p50 = crate::stats::percentile(&v, 0.5).unwrap();
        assert!((270.0..330.0).contains(&p50), "{p50}");
        assert!(v.iter().all(|&x| (16.0..=1024.0).contains(&x)));
        assert!(crate::stats::percentile(&v, 0.95).unwrap() > 600.0);
        assert_eq!(OutputSampler::new(OutputLen::Fixed(7), 1).sample(), 7);
    }

    #[test]
    fn traces_are_identical_for_a_seed_and_text_is_rate_independent() {
        let w = workload(Shape::Unique(UniqueSpec { prompt_tokens: 40 }), 20);
        let a = trace_of(&w, vec![ReplicaGroup::default()]);
        let b = trace_of(&w, vec![ReplicaGroup::default()]);
        assert_eq!(a.requests.len(), 20);
        assert_eq!(a.requests, b.requests);
        let faster = WorkloadSpec {
            rate: 40.0,
            ..w.clone()
        };
        let c = trace_of(&faster, vec![ReplicaGroup::default()]);
        assert_eq!(c.requests.len(), a.requests.len());
        for (x, y) in a.requests.iter().zip(&c.requests).skip(1) {
            assert_eq!(x.messages, y.messages);
            assert_ne!(x.start, y.start, "arrivals scale with the rate");
        }
    }
}
