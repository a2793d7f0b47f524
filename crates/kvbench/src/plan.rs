//! The benchmark plan: which fleet, which workloads, which policies, which scenario events.
//! One YAML file (or a built-in preset, `quick` / `full`) describes a whole benchmark, so
//! re-running the report is one command.
//!
//! Times in a plan are **simulated**: rates are requests per simulated second and `at_s` is
//! simulated seconds after the run's first arrival. The replicas run `time_scale` times faster
//! than real time; the bench converts.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::BenchError;

/// The `quick` preset (`make bench`): a few workloads, minutes.
pub const QUICK: &str = include_str!("plans/quick.yaml");
/// The `full` preset (`make bench-full`): every workload and scenario.
pub const FULL: &str = include_str!("plans/full.yaml");
/// A tiny plan for tests: seconds.
pub const SMOKE: &str = include_str!("plans/smoke.yaml");
/// A small plan that checks the machinery: five seeds on three workloads (about an hour).
pub const VALIDATE: &str = include_str!("plans/validate.yaml");
/// 1, 2 and 4 router instances, decision sharing on and off, on multi-turn traffic.
pub const ROUTERS: &str = include_str!("plans/routers.yaml");
/// The Mooncake conversation trace replayed (`kvbench replay` starts from it).
pub const REPLAY: &str = include_str!("plans/replay.yaml");
/// Flow control on against off under 2x overload (two objectives, two tenants, one flooding).
pub const FLOW: &str = include_str!("plans/flow.yaml");
/// A CPU offload tier: load-time pricing against the flat per-medium weight and the peers.
pub const OFFLOAD: &str = include_str!("plans/offload.yaml");

/// The text of a built-in plan.
pub fn preset(name: &str) -> Option<&'static str> {
    match name {
        "quick" => Some(QUICK),
        "full" => Some(FULL),
        "smoke" => Some(SMOKE),
        "validate" => Some(VALIDATE),
        "replay" => Some(REPLAY),
        "flow" => Some(FLOW),
        "routers" => Some(ROUTERS),
        "offload" => Some(OFFLOAD),
        _ => None,
    }
}

/// A whole benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Plan {
    /// A name for the report. Default `bench`.
    pub name: String,
    /// Base of the seeds of every random choice (arrivals, prompt text, prefix picks, policy
    /// order). The seeds a run uses come from it and `seed_set` (see [`Plan::seed_list`]).
    /// Must be below 2^32. Default 42.
    pub seed: u64,
    /// Seeds per (workload, rate, policy) cell: each seed is its own trace, and every policy
    /// runs on it. Verdicts need at least 5. Default 1.
    pub seeds: usize,
    /// Which seeds: `tuning` (while tuning a policy) or `report` (the committed report); the two
    /// ranges are disjoint, so a report never rests on the traces a policy was tuned on.
    /// Default `report`.
    pub seed_set: SeedSet,
    /// Order of the policies within a seed: `shuffled` (seeded, so slow drifts of the machine
    /// hit every policy alike) or `fixed` (the plan's order). Default `shuffled`.
    pub policy_order: PolicyOrder,
    /// Bootstrap resamples behind every confidence interval. Default 1000.
    pub bootstrap_resamples: usize,
    /// Divide every time constant of the router's config (scrape interval, staleness, TTLs,
    /// probe intervals, half-lives; `*_ms` fields) by the time scale and multiply its speeds
    /// (`*_per_s`), so the router lives in simulated time as the replicas do. Default true.
    pub scale_router_time: bool,
    /// kvrouter instances behind the one Envoy (its ext_proc cluster has one endpoint per
    /// instance), each with its own config and KV-event subscriptions. Default 1.
    pub routers: usize,
    /// How Envoy spreads ext_proc streams over several routers. Default `round_robin`.
    pub router_lb: RouterLb,
    /// Model name sent in requests and served by the replicas. Default `demo-model`.
    pub model: String,
    /// Tokenizer whose vocabulary prompt text is drawn from: a directory name under the
    /// tokenizers directory (`qwen3`, `llama3`, ...) or a path to a directory holding
    /// `tokenizer.json`. Default `qwen3`.
    pub tokenizer: String,
    /// Also configure kvrouter with this tokenizer for `model` (as a deployment would). Default
    /// true.
    pub router_tokenizer: bool,
    /// Give the replicas the same tokenizer files (kvsim's `tokenizer`), so engine token ids
    /// match the router's, as in a real deployment: KV events then name blocks the router can
    /// re-hash to its own. Default true; false: kvsim's word-piece fallback.
    pub replica_tokenizer: bool,
    /// Simulated time runs this many times faster than real time on every replica. Default 5.
    pub time_scale: f64,
    /// The TTFT objective for goodput, in simulated ms. Default 1000.
    pub slo_ttft_ms: f64,
    /// How often replica and router metrics are scraped, in real ms. Default 200.
    pub scrape_interval_ms: u64,
    /// Most requests in flight from the load generator; an arrival beyond it waits (and the
    /// wait is recorded). Default 512.
    pub max_concurrency: usize,
    /// How long a run may take to drain after its last arrival, in real seconds; requests still
    /// open then are cancelled and counted as errors. Default 120.
    pub drain_timeout_s: u64,
    /// The default fleet of every workload.
    pub fleet: Vec<ReplicaGroup>,
    /// The policies compared, each run on every workload's identical trace.
    pub policies: Vec<PolicySpec>,
    /// The workloads.
    pub workloads: Vec<WorkloadSpec>,
    /// Router overhead measurement; omitted: not measured.
    pub overhead: Option<OverheadSpec>,
    /// Which runs the summary compares ("must show").
    pub analysis: AnalysisSpec,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            name: "bench".into(),
            seed: 42,
            seeds: 1,
            seed_set: SeedSet::Report,
            policy_order: PolicyOrder::Shuffled,
            bootstrap_resamples: 1000,
            scale_router_time: true,
            routers: 1,
            router_lb: RouterLb::RoundRobin,
            model: "demo-model".into(),
            tokenizer: "qwen3".into(),
            router_tokenizer: true,
            replica_tokenizer: true,
            time_scale: 5.0,
            slo_ttft_ms: 1000.0,
            scrape_interval_ms: 200,
            max_concurrency: 512,
            drain_timeout_s: 120,
            fleet: vec![ReplicaGroup::default()],
            policies: Vec::new(),
            workloads: Vec::new(),
            overhead: None,
            analysis: AnalysisSpec::default(),
        }
    }
}

/// The two disjoint seed ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeedSet {
    /// `seed + i`: for tuning.
    Tuning,
    /// `seed + 2^32 + i`: for the report.
    Report,
}

/// Order of the policies within a seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyOrder {
    /// A seeded shuffle per seed and cell.
    Shuffled,
    /// The plan's order.
    Fixed,
}

/// Envoy's balancing of ext_proc streams over several routers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterLb {
    /// `ROUND_ROBIN`.
    RoundRobin,
    /// `LEAST_REQUEST`.
    LeastRequest,
}

/// Offset of the `report` seeds above the `tuning` ones.
pub const REPORT_SEED_OFFSET: u64 = 1 << 32;

/// `count` replicas with the same settings (named `r0`, `r1`, ... across groups).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaGroup {
    /// How many. Default 4.
    pub count: usize,
    /// Simulator step-time profile. Default `l4-llama3-8b`.
    pub profile: String,
    /// Tokens per KV block. Default 16.
    pub block_size: u32,
    /// KV blocks per replica. Default: the profile's.
    pub num_gpu_blocks: Option<u32>,
    /// Most running requests. Default: the profile's.
    pub max_num_seqs: Option<u32>,
    /// Token budget per step. Default: the profile's.
    pub max_num_batched_tokens: Option<u32>,
    /// A CPU offload tier of this many blocks per replica (kvsim's `--cpu-offload-blocks`:
    /// vLLM's `OffloadingConnector`). Default none.
    pub cpu_offload_blocks: Option<u32>,
    /// The CPU tier's load bandwidth, GB/s of simulated time. Default: kvsim's (20).
    pub cpu_offload_gb_per_s: Option<f64>,
}

impl Default for ReplicaGroup {
    fn default() -> Self {
        ReplicaGroup {
            count: 4,
            profile: "l4-llama3-8b".into(),
            block_size: 16,
            num_gpu_blocks: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            cpu_offload_blocks: None,
            cpu_offload_gb_per_s: None,
        }
    }
}

/// One policy under test: the exact `policy.name` of kvrouter's config plus optional extra
/// router configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicySpec {
    /// Label in the report (unique). Default: `policy`.
    pub label: String,
    /// kvrouter's `policy.name`. Required.
    pub policy: String,
    /// Extra router YAML (a mapping) merged over the generated config, e.g. policy parameters
    /// or `cache_index` settings. Maps merge key by key; anything else replaces.
    pub router_yaml: Option<serde_norway::Value>,
    /// YAML merged into the generated pool (e.g. a `kv_events` section).
    pub pool_yaml: Option<serde_norway::Value>,
    /// YAML merged into every generated endpoint. Strings may use `{name}`, `{address}` and
    /// `{kv_events}` (the replica's ZMQ endpoint, when it publishes).
    pub endpoint_yaml: Option<serde_norway::Value>,
    /// Replicas publish KV events (ZMQ, loopback, an ephemeral port). Default false.
    pub kv_events: bool,
    /// kvrouter instances behind Envoy for this policy's runs. Default: the plan's `routers`.
    /// So 1, 2 and 4 instances run side by side on the same traces.
    pub routers: Option<usize>,
    /// The instances share their decisions through a Redis started for each run (kvrouter's
    /// `sharing.redis`; `redis-server` from `$KVROUTER_REDIS` or `PATH`). Default false.
    pub sharing: bool,
    /// A kvrouter binary for this policy's runs instead of the one built here: two builds
    /// compared side by side in one run (a change A/B'd against the commit before it).
    pub router_bin: Option<std::path::PathBuf>,
}

impl PolicySpec {
    /// kvrouter instances for this policy's runs under `plan`.
    pub fn routers(&self, plan: &Plan) -> usize {
        self.routers.unwrap_or(plan.routers)
    }

    /// The label, or the policy name when no label is given.
    pub fn label(&self) -> &str {
        if self.label.is_empty() {
            &self.policy
        } else {
            &self.label
        }
    }
}

/// One workload: a traffic shape, its load, its fleet and its scenario events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Name (unique), used in the report and to select workloads on the command line.
    pub name: String,
    /// What the traffic looks like.
    pub shape: Shape,
    /// Mean arrival rate, requests per simulated second (Poisson). Default 4.
    pub rate: f64,
    /// A load sweep: run the workload once per rate (overrides `rate`). Default none.
    pub rates: Vec<f64>,
    /// Requests in the trace (multi-turn: follow-up turns included). Default: the shape's
    /// natural count.
    pub requests: Option<usize>,
    /// Output tokens per request (`max_tokens`; the simulator generates exactly this many): a
    /// number, or a log-normal distribution `{median, sigma, min, max}`. Default 32.
    pub output_tokens: OutputLen,
    /// Arrivals in the first `warmup_s` simulated seconds are sent but left out of the
    /// statistics (the steady-state window starts after them). Default 0.
    pub warmup_s: f64,
    /// Share of requests sent straight to a replica (round-robin over the fleet), bypassing
    /// Envoy and the router: only KV events tell the router what they cached. 0..1. Default 0.
    pub bypass_fraction: f64,
    /// The fleet for this workload. Default: the plan's.
    pub fleet: Option<Vec<ReplicaGroup>>,
    /// Scenario events at simulated times.
    pub events: Vec<EventSpec>,
    /// This workload's time scale (e.g. lower for a high request rate the machine must drive
    /// in real time). Default: the plan's.
    pub time_scale: Option<f64>,
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            name: String::new(),
            shape: Shape::Unique(UniqueSpec::default()),
            rate: 4.0,
            rates: Vec::new(),
            requests: None,
            output_tokens: OutputLen::Fixed(32),
            warmup_s: 0.0,
            bypass_fraction: 0.0,
            fleet: None,
            events: Vec::new(),
            time_scale: None,
        }
    }
}

impl WorkloadSpec {
    /// The rates this workload runs at.
    pub fn run_rates(&self) -> Vec<f64> {
        if self.rates.is_empty() {
            vec![self.rate]
        } else {
            self.rates.clone()
        }
    }
}

/// Output length of a workload's requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OutputLen {
    /// Every request generates this many tokens.
    Fixed(u32),
    /// Log-normal lengths, clamped to `min..=max`.
    LogNormal(OutputDist),
}

/// A log-normal output length: `median * exp(sigma * z)`, z standard normal, clamped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputDist {
    /// Median tokens.
    pub median: f64,
    /// Spread (standard deviation of the log). Default 0.7.
    #[serde(default = "default_sigma")]
    pub sigma: f64,
    /// Fewest tokens. Default 1.
    #[serde(default = "default_min_tokens")]
    pub min: u32,
    /// Most tokens. Default 2048.
    #[serde(default = "default_max_tokens")]
    pub max: u32,
}

fn default_sigma() -> f64 {
    0.7
}
fn default_min_tokens() -> u32 {
    1
}
fn default_max_tokens() -> u32 {
    2048
}

impl OutputLen {
    /// The mean length (fixed, or the clamped distribution's, estimated).
    pub fn describe(&self) -> String {
        match self {
            OutputLen::Fixed(n) => format!("{n} output tokens"),
            OutputLen::LogNormal(d) => format!(
                "output tokens log-normal (median {}, sigma {}, {}..={})",
                d.median, d.sigma, d.min, d.max
            ),
        }
    }
}

/// The traffic shapes (token counts are under the plan's tokenizer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Shape {
    /// G groups with an S-token system prompt, U users per group asking Q-token questions
    /// (llm-d's shared-prefix benchmark).
    SharedPrefix(SharedPrefixSpec),
    /// Conversations that grow turn by turn, users returning after think time.
    MultiTurn(MultiTurnSpec),
    /// No sharing: every prompt is new text.
    Unique(UniqueSpec),
    /// Zipf over prefixes, one dominating.
    HotPrefix(HotPrefixSpec),
    /// The same system prompt under different tenants (must not share KV).
    MultiTenant(MultiTenantSpec),
    /// A request trace in the Mooncake format, replayed.
    Trace(TraceSpec),
    /// Unique prompts from several tenants at different rates, each request with an objective
    /// (priority) header: the flow-control scenario.
    FlowMix(FlowMixSpec),
}

impl Shape {
    /// The kind's name as written in plans.
    pub fn kind(&self) -> &'static str {
        match self {
            Shape::SharedPrefix(_) => "shared_prefix",
            Shape::MultiTurn(_) => "multi_turn",
            Shape::Unique(_) => "unique",
            Shape::HotPrefix(_) => "hot_prefix",
            Shape::MultiTenant(_) => "multi_tenant",
            Shape::Trace(_) => "trace",
            Shape::FlowMix(_) => "flow_mix",
        }
    }
}

/// Parameters of `shared_prefix`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SharedPrefixSpec {
    /// Groups; default: as many as fill `kv_occupancy` of the fleet's KV with system prompts.
    pub groups: Option<usize>,
    /// Fraction of the fleet's KV capacity the groups' system prompts occupy (counted in the
    /// engine's tokens) when `groups` is not given. Default 0.73.
    pub kv_occupancy: f64,
    /// System prompt tokens. Default 1500.
    pub system_tokens: usize,
    /// Users per group (each asks one question per round). Default 8.
    pub users_per_group: usize,
    /// Question tokens. Default 150.
    pub question_tokens: usize,
}

impl Default for SharedPrefixSpec {
    fn default() -> Self {
        SharedPrefixSpec {
            groups: None,
            kv_occupancy: 0.73,
            system_tokens: 1500,
            users_per_group: 8,
            question_tokens: 150,
        }
    }
}

/// Parameters of `multi_turn`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTurnSpec {
    /// Conversations. Default 40.
    pub conversations: usize,
    /// Turns per conversation. Default 5.
    pub turns: usize,
    /// System prompt shared by every conversation, in tokens (0: none). Default 300.
    pub system_tokens: usize,
    /// User message tokens per turn. Default 200.
    pub user_tokens: usize,
    /// Mean think time between a turn's answer and the next question, simulated seconds
    /// (exponential). Default 5.
    pub think_s: f64,
}

impl Default for MultiTurnSpec {
    fn default() -> Self {
        MultiTurnSpec {
            conversations: 40,
            turns: 5,
            system_tokens: 300,
            user_tokens: 200,
            think_s: 5.0,
        }
    }
}

/// Parameters of `unique`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UniqueSpec {
    /// Prompt tokens. Default 1000.
    pub prompt_tokens: usize,
}

impl Default for UniqueSpec {
    fn default() -> Self {
        UniqueSpec {
            prompt_tokens: 1000,
        }
    }
}

/// Parameters of `hot_prefix`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HotPrefixSpec {
    /// Distinct prefixes. Default 16.
    pub prefixes: usize,
    /// Zipf exponent over prefix ranks (rank 1 is the hot one). Default 1.5.
    pub zipf_s: f64,
    /// Prefix tokens. Default 1500.
    pub prefix_tokens: usize,
    /// Question tokens. Default 150.
    pub question_tokens: usize,
}

impl Default for HotPrefixSpec {
    fn default() -> Self {
        HotPrefixSpec {
            prefixes: 16,
            zipf_s: 1.5,
            prefix_tokens: 1500,
            question_tokens: 150,
        }
    }
}

/// Parameters of `multi_tenant`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTenantSpec {
    /// Tenants. Default 4.
    pub tenants: usize,
    /// The system prompt every tenant uses, in tokens. Default 1500.
    pub system_tokens: usize,
    /// Question tokens. Default 150.
    pub question_tokens: usize,
    /// Header naming the tenant; kvrouter's `tenancy.header` is set to it. Default
    /// `x-tenant-id`.
    pub tenant_header: String,
    /// Send vLLM's `cache_salt` (one per tenant) so engines isolate tenants. `false` is the
    /// negative control: cross-tenant hits must then appear. Default true.
    pub cache_salt: bool,
}

impl Default for MultiTenantSpec {
    fn default() -> Self {
        MultiTenantSpec {
            tenants: 4,
            system_tokens: 1500,
            question_tokens: 150,
            tenant_header: "x-tenant-id".into(),
            cache_salt: true,
        }
    }
}

/// Parameters of `flow_mix`: unique prompts of `prompt_tokens` from `tenants` (each its share
/// of the arrivals, named in `tenant_header`: kvrouter's trusted tenant, the flow its fairness
/// is kept between), each request with an objective drawn from `objectives` (independently of
/// its tenant) and sent in `objective_header`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowMixSpec {
    /// Prompt tokens of every request. Default 1000.
    pub prompt_tokens: usize,
    /// Tenants and their shares of the arrivals. Default `flood` 4, `steady` 1.
    pub tenants: Vec<Share>,
    /// Objectives and their shares of the arrivals. Default `critical` 1, `sheddable` 3.
    pub objectives: Vec<Share>,
    /// Header naming the tenant (kvrouter's `tenancy.header` is set to it). Default
    /// `x-tenant-id`.
    pub tenant_header: String,
    /// Header naming the objective. Default `x-llm-d-inference-objective`.
    pub objective_header: String,
}

impl Default for FlowMixSpec {
    fn default() -> Self {
        FlowMixSpec {
            prompt_tokens: 1000,
            tenants: vec![Share::new("flood", 4.0), Share::new("steady", 1.0)],
            objectives: vec![Share::new("critical", 1.0), Share::new("sheddable", 3.0)],
            tenant_header: "x-tenant-id".into(),
            objective_header: "x-llm-d-inference-objective".into(),
        }
    }
}

/// A name with a relative weight (its share is `weight` over the sum of the weights).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Share {
    /// The name sent in the header.
    pub name: String,
    /// Relative weight, > 0.
    pub weight: f64,
}

impl Share {
    /// `name` with `weight`.
    pub fn new(name: &str, weight: f64) -> Share {
        Share {
            name: name.into(),
            weight,
        }
    }
}

/// Parameters of `trace`: a Mooncake-format JSONL file (`timestamp` ms, `input_length`,
/// `output_length`, `hash_ids` of 512-token blocks). Each hash id becomes the same block of text
/// wherever it appears.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceSpec {
    /// The file. A relative path is looked up from the working directory, then as
    /// `shared/traces/<path>` in its ancestors. Required.
    pub path: String,
    /// Start of the replayed window, seconds of trace time. Default 0.
    pub start_s: f64,
    /// Length of the window, seconds of trace time. Default 600.
    pub duration_s: f64,
    /// Trace time runs this many times faster (arrival gaps divided by it). Default 1.
    pub speedup: f64,
    /// Tokens per `hash_ids` block. Default 512.
    pub block_tokens: usize,
    /// Most requests taken from the window. Default: all.
    pub max_requests: Option<usize>,
    /// Inputs longer than this are cut to it (their later blocks dropped). Default 65536.
    pub max_input_tokens: usize,
    /// The engines' context length: an input is also cut so that it, its output and
    /// [`TEMPLATE_TOKENS`] of chat template fit in it (an engine answers 400 to a request
    /// that does not fit, which would count as a failure of every policy alike). Default:
    /// none (only `max_input_tokens` applies).
    pub max_context_tokens: Option<usize>,
}

/// Tokens a replayed request's chat template adds to its input, kept free under
/// [`TraceSpec::max_context_tokens`] (the Qwen3 and Llama 3 templates add 5-30 to one user
/// message).
pub const TEMPLATE_TOKENS: usize = 64;

impl Default for TraceSpec {
    fn default() -> Self {
        TraceSpec {
            path: String::new(),
            start_s: 0.0,
            duration_s: 600.0,
            speedup: 1.0,
            block_tokens: 512,
            max_requests: None,
            max_input_tokens: 65_536,
            max_context_tokens: None,
        }
    }
}

/// A scenario event at a simulated time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventSpec {
    /// Simulated seconds after the run's first arrival.
    pub at_s: f64,
    /// What happens.
    pub action: Action,
    /// The replica, by index in the fleet (`r<index>`); for `add`, ignored.
    #[serde(default)]
    pub replica: usize,
    /// `fail` / `stall`: for how long, simulated seconds. Default 5.
    #[serde(default = "default_event_duration_s")]
    pub duration_s: f64,
    /// `add`: the new replica's settings (count ignored). Default: the fleet's first group.
    #[serde(default)]
    pub group: Option<ReplicaGroup>,
}

fn default_event_duration_s() -> f64 {
    5.0
}

/// Scenario actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// SIGKILL the replica's process (connections reset, in-flight requests lost).
    Kill,
    /// Start a killed replica again on the same port, with a cold cache.
    Restart,
    /// Start a new replica and add it to the router's config (hot reload).
    Add,
    /// The replica answers HTTP 500 to generation requests for `duration_s`.
    Fail,
    /// The replica's engine stops stepping for `duration_s` (requests queue).
    Stall,
}

/// Router overhead: one light workload direct, through Envoy alone, through Envoy + kvrouter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverheadSpec {
    /// Requests per path. Default 2000.
    pub requests: usize,
    /// Concurrent closed-loop clients. Default 4.
    pub concurrency: usize,
    /// The replicas' time scale (large: a near-zero-latency backend). Default 1000.
    pub time_scale: f64,
    /// kvrouter's policy during the measurement. Default `least-loaded`.
    pub policy: String,
}

impl Default for OverheadSpec {
    fn default() -> Self {
        OverheadSpec {
            requests: 2000,
            concurrency: 4,
            time_scale: 1000.0,
            policy: "least-loaded".into(),
        }
    }
}

/// Which runs the "must show" summary compares. Missing runs are reported as not run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnalysisSpec {
    /// The policy label under study. Default `predicted-ttft`.
    pub subject: String,
    /// The load-aware baseline label. Default `least-loaded`.
    pub baseline: String,
    /// Labels of the other cache-aware policies.
    pub cache_aware: Vec<String>,
    /// Labels of the prefix-affinity-like policy whose queue is expected to run away.
    pub affinity: String,
    /// Workload names per question (empty: not asked).
    pub shared_prefix: String,
    /// Unique-prompt workload.
    pub unique: String,
    /// Hot-prefix workload.
    pub hot_prefix: String,
    /// Multi-tenant workload.
    pub multi_tenant: String,
    /// Kill/restart workload.
    pub kill_restart: String,
    /// The peers the subject's verdicts are against. Empty (default): every policy whose
    /// kvrouter `policy.name` differs from the subject's.
    pub peers: Vec<String>,
    /// The cell at about 50% load, where the subject's mean TTFT is held to 1.3x the fluid
    /// lower bound. Default none.
    pub half_load: Option<CellRef>,
    /// The trace-replay workload set beside Dynamo's published KV-router A/B. Default none.
    pub replay: String,
    /// The policy the replay is compared with, as Dynamo's A/B does. Default `round-robin`.
    pub replay_baseline: String,
    /// A peer *melts* in a cell when its TTFT p90 (median over seeds) is at least this many
    /// times the best policy's. Default 10.
    pub melt_factor: f64,
    /// The flow-control comparison (on against off under overload). Default none.
    pub flow: Option<FlowAnalysisSpec>,
}

/// What the flow-control comparison looks at: two policy labels (the same routing policy with
/// `flow_control` on and off), a `flow_mix` workload under overload and the same traffic
/// unloaded (for the critical objective's unloaded TTFT).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowAnalysisSpec {
    /// Policy labels with flow control on, each compared with `off`. Default `[flow-on]`.
    pub on: Vec<String>,
    /// Policy label with flow control off. Default `flow-off`.
    pub off: String,
    /// The overloaded workload. Default `overload`.
    pub overload: String,
    /// The same traffic at light load. Default `unloaded`.
    pub unloaded: String,
    /// The high-priority objective. Default `critical`.
    pub critical: String,
    /// The sheddable objective. Default `sheddable`.
    pub sheddable: String,
    /// The flooding tenant. Default `flood`.
    pub flooding_tenant: String,
    /// Goal: critical TTFT p90 under overload at most this many times its unloaded value.
    /// Default 2.
    pub critical_ttft_factor: f64,
}

impl Default for FlowAnalysisSpec {
    fn default() -> Self {
        FlowAnalysisSpec {
            on: vec!["flow-on".into()],
            off: "flow-off".into(),
            overload: "overload".into(),
            unloaded: "unloaded".into(),
            critical: "critical".into(),
            sheddable: "sheddable".into(),
            flooding_tenant: "flood".into(),
            critical_ttft_factor: 2.0,
        }
    }
}

/// One workload at one rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellRef {
    /// Workload name.
    pub workload: String,
    /// Rate, requests per simulated second.
    pub rate: f64,
}

impl Default for AnalysisSpec {
    fn default() -> Self {
        AnalysisSpec {
            subject: "predicted-ttft".into(),
            baseline: "least-loaded".into(),
            cache_aware: vec![
                "prefix-affinity".into(),
                "cache-load-score".into(),
                "sglang-cache-aware".into(),
                "vllm-prefix-aware".into(),
                "vllm-kv-aware".into(),
                "weighted-scorers".into(),
            ],
            affinity: "prefix-affinity".into(),
            shared_prefix: String::new(),
            unique: String::new(),
            hot_prefix: String::new(),
            multi_tenant: String::new(),
            kill_restart: String::new(),
            peers: Vec::new(),
            half_load: None,
            replay: String::new(),
            replay_baseline: "round-robin".into(),
            melt_factor: 10.0,
            flow: None,
        }
    }
}

impl Plan {
    /// A preset by name (`quick`, `full`, `smoke`) or a YAML file path.
    pub fn load(name_or_path: &str) -> Result<Plan, BenchError> {
        let (text, origin) = match preset(name_or_path) {
            Some(text) => (text.to_string(), name_or_path.to_string()),
            None => {
                let path = name_or_path;
                (
                    std::fs::read_to_string(path).map_err(|e| BenchError::Plan {
                        origin: path.into(),
                        message: format!("cannot read: {e}"),
                    })?,
                    path.to_string(),
                )
            }
        };
        Plan::parse(&text, &origin)
    }

    /// Parses and validates plan YAML; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Plan, BenchError> {
        let de = serde_norway::Deserializer::from_str(text);
        let plan: Plan = serde_path_to_error::deserialize(de).map_err(|e| BenchError::Plan {
            origin: origin.into(),
            message: format!("{}: {}", e.path(), e.inner()),
        })?;
        let errors = plan.validate();
        if errors.is_empty() {
            Ok(plan)
        } else {
            Err(BenchError::Plan {
                origin: origin.into(),
                message: errors.join("; "),
            })
        }
    }

    /// Every invalid value, with its field path; empty when the plan can run.
    pub fn validate(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            errors.push(format!("time_scale must be > 0 (got {})", self.time_scale));
        }
        if self.max_concurrency == 0 {
            errors.push("max_concurrency must be > 0".into());
        }
        if self.seed >= REPORT_SEED_OFFSET {
            errors.push(format!("seed must be below 2^32 (got {})", self.seed));
        }
        if self.seeds == 0 || self.seeds > 1000 {
            errors.push(format!("seeds must be in 1..=1000 (got {})", self.seeds));
        }
        if self.bootstrap_resamples < 100 {
            errors.push("bootstrap_resamples must be >= 100".into());
        }
        if self.routers == 0 || self.routers > 16 {
            errors.push(format!("routers must be in 1..=16 (got {})", self.routers));
        }
        if self.scrape_interval_ms == 0 {
            errors.push("scrape_interval_ms must be > 0".into());
        }
        check_fleet(&self.fleet, "fleet", &mut errors);
        let mut labels = HashSet::new();
        for (i, p) in self.policies.iter().enumerate() {
            if p.policy.trim().is_empty() {
                errors.push(format!("policies[{i}].policy must be set"));
            }
            if p.routers.is_some_and(|n| n == 0 || n > 16) {
                errors.push(format!(
                    "policies[{i}].routers must be in 1..=16 (got {})",
                    p.routers.unwrap_or(0)
                ));
            }
            if let Some(bin) = p.router_bin.as_ref().filter(|b| !b.is_file()) {
                errors.push(format!(
                    "policies[{i}].router_bin {} is not a file",
                    bin.display()
                ));
            }
            if !labels.insert(p.label().to_string()) {
                errors.push(format!("policies[{i}].label {:?} is not unique", p.label()));
            }
            for (field, v) in [
                ("router_yaml", &p.router_yaml),
                ("pool_yaml", &p.pool_yaml),
                ("endpoint_yaml", &p.endpoint_yaml),
            ] {
                if v.as_ref().is_some_and(|v| !v.is_mapping()) {
                    errors.push(format!("policies[{i}].{field} must be a mapping"));
                }
            }
        }
        if self.policies.is_empty() {
            errors.push("policies must list at least one policy".into());
        }
        let mut names = HashSet::new();
        for (i, w) in self.workloads.iter().enumerate() {
            let at = format!("workloads[{i}]");
            if w.name.trim().is_empty() {
                errors.push(format!("{at}.name must be set"));
            } else if !names.insert(w.name.as_str()) {
                errors.push(format!("{at}.name {:?} is not unique", w.name));
            }
            for r in w.run_rates() {
                if !(r.is_finite() && r > 0.0) {
                    errors.push(format!("{at}.rate must be > 0 (got {r})"));
                }
            }
            match &w.output_tokens {
                OutputLen::Fixed(0) => errors.push(format!("{at}.output_tokens must be > 0")),
                OutputLen::Fixed(_) => {}
                OutputLen::LogNormal(d) => {
                    if !(d.median.is_finite() && d.median >= 1.0) {
                        errors.push(format!("{at}.output_tokens.median must be >= 1"));
                    }
                    if !(d.sigma.is_finite() && d.sigma >= 0.0) {
                        errors.push(format!("{at}.output_tokens.sigma must be >= 0"));
                    }
                    if d.min == 0 || d.min > d.max {
                        errors.push(format!("{at}.output_tokens: need 1 <= min <= max"));
                    }
                }
            }
            if !(w.warmup_s.is_finite() && w.warmup_s >= 0.0) {
                errors.push(format!("{at}.warmup_s must be >= 0"));
            }
            if !(0.0..1.0).contains(&w.bypass_fraction) {
                errors.push(format!("{at}.bypass_fraction must be in [0, 1)"));
            }
            if w.time_scale.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
                errors.push(format!("{at}.time_scale must be > 0"));
            }
            if w.requests == Some(0) {
                errors.push(format!("{at}.requests must be > 0"));
            }
            if let Some(f) = &w.fleet {
                check_fleet(f, &format!("{at}.fleet"), &mut errors);
            }
            let fleet_size: usize = w
                .fleet
                .as_ref()
                .unwrap_or(&self.fleet)
                .iter()
                .map(|g| g.count)
                .sum();
            for (j, e) in w.events.iter().enumerate() {
                if !(e.at_s.is_finite() && e.at_s >= 0.0) {
                    errors.push(format!("{at}.events[{j}].at_s must be >= 0"));
                }
                if e.action != Action::Add && e.replica >= fleet_size {
                    errors.push(format!(
                        "{at}.events[{j}].replica {} is not in the fleet of {fleet_size}",
                        e.replica
                    ));
                }
            }
            errors.extend(check_shape(&w.shape, &at));
        }
        if self.workloads.is_empty() {
            errors.push("workloads must list at least one workload".into());
        }
        errors
    }

    /// The seeds of every cell, in run order (see `seed` and `seed_set`).
    pub fn seed_list(&self) -> Vec<u64> {
        let base = match self.seed_set {
            SeedSet::Tuning => self.seed,
            SeedSet::Report => self.seed + REPORT_SEED_OFFSET,
        };
        (0..self.seeds.max(1) as u64).map(|i| base + i).collect()
    }

    /// The peers of `subject` (see [`AnalysisSpec::peers`]).
    pub fn peers(&self) -> Vec<String> {
        let a = &self.analysis;
        if !a.peers.is_empty() {
            return a.peers.clone();
        }
        let subject = self.policies.iter().find(|p| p.label() == a.subject);
        self.policies
            .iter()
            .filter(|p| p.label() != a.subject)
            .filter(|p| subject.is_none_or(|s| s.policy != p.policy))
            .map(|p| p.label().to_string())
            .collect()
    }

    /// The time scale of `workload`.
    pub fn time_scale_of(&self, workload: &WorkloadSpec) -> f64 {
        workload.time_scale.unwrap_or(self.time_scale)
    }

    /// The fleet of `workload`.
    pub fn fleet_of<'a>(&'a self, workload: &'a WorkloadSpec) -> &'a [ReplicaGroup] {
        workload.fleet.as_deref().unwrap_or(&self.fleet)
    }
}

fn check_fleet(fleet: &[ReplicaGroup], at: &str, errors: &mut Vec<String>) {
    if fleet.iter().map(|g| g.count).sum::<usize>() == 0 {
        errors.push(format!("{at} must have at least one replica"));
    }
    for (i, g) in fleet.iter().enumerate() {
        if kvsim::profile::StepProfile::builtin(&g.profile).is_none() {
            errors.push(format!(
                "{at}[{i}].profile: unknown profile {:?} (known: {})",
                g.profile,
                kvsim::profile::StepProfile::builtin_names().join(", ")
            ));
        }
        if g.block_size == 0 {
            errors.push(format!("{at}[{i}].block_size must be > 0"));
        }
        if g.cpu_offload_blocks == Some(0) {
            errors.push(format!("{at}[{i}].cpu_offload_blocks must be > 0"));
        }
        if let Some(bw) = g.cpu_offload_gb_per_s {
            if !(bw.is_finite() && bw > 0.0) {
                errors.push(format!(
                    "{at}[{i}].cpu_offload_gb_per_s must be a finite number > 0 (got {bw})"
                ));
            }
            if g.cpu_offload_blocks.is_none() {
                errors.push(format!(
                    "{at}[{i}].cpu_offload_gb_per_s needs cpu_offload_blocks"
                ));
            }
        }
    }
    let sizes: HashSet<u32> = fleet.iter().map(|g| g.block_size).collect();
    if sizes.len() > 1 {
        errors.push(format!("{at}: every replica must use the same block_size"));
    }
}

fn check_shape(shape: &Shape, at: &str) -> Vec<String> {
    let mut errors = Vec::new();
    let mut positive = |field: &str, v: usize| {
        if v == 0 {
            errors.push(format!("{at}.shape.{field} must be > 0"));
        }
    };
    match shape {
        Shape::SharedPrefix(s) => {
            positive("system_tokens", s.system_tokens);
            positive("users_per_group", s.users_per_group);
            positive("question_tokens", s.question_tokens);
            if let Some(g) = s.groups {
                positive("groups", g);
            }
            if !(s.kv_occupancy > 0.0 && s.kv_occupancy <= 10.0) {
                errors.push(format!("{at}.shape.kv_occupancy must be in (0, 10]"));
            }
        }
        Shape::MultiTurn(s) => {
            positive("conversations", s.conversations);
            positive("turns", s.turns);
            positive("user_tokens", s.user_tokens);
            if !(s.think_s.is_finite() && s.think_s >= 0.0) {
                errors.push(format!("{at}.shape.think_s must be >= 0"));
            }
        }
        Shape::Unique(s) => positive("prompt_tokens", s.prompt_tokens),
        Shape::HotPrefix(s) => {
            positive("prefixes", s.prefixes);
            positive("prefix_tokens", s.prefix_tokens);
            positive("question_tokens", s.question_tokens);
            if !(s.zipf_s.is_finite() && s.zipf_s >= 0.0) {
                errors.push(format!("{at}.shape.zipf_s must be >= 0"));
            }
        }
        Shape::Trace(s) => {
            positive("block_tokens", s.block_tokens);
            positive("max_input_tokens", s.max_input_tokens);
            if let Some(c) = s.max_context_tokens {
                if c <= TEMPLATE_TOKENS + 1 {
                    errors.push(format!(
                        "{at}.shape.max_context_tokens must exceed {} (the template's share and \
                         one output token)",
                        TEMPLATE_TOKENS + 1
                    ));
                }
            }
            if s.path.trim().is_empty() {
                errors.push(format!("{at}.shape.path must name a trace file"));
            }
            if !(s.speedup.is_finite() && s.speedup > 0.0) {
                errors.push(format!("{at}.shape.speedup must be > 0"));
            }
            if !(s.duration_s.is_finite() && s.duration_s > 0.0 && s.start_s >= 0.0) {
                errors.push(format!("{at}.shape: need start_s >= 0 and duration_s > 0"));
            }
        }
        Shape::FlowMix(s) => {
            positive("prompt_tokens", s.prompt_tokens);
            for (field, shares) in [("tenants", &s.tenants), ("objectives", &s.objectives)] {
                if shares.is_empty() {
                    errors.push(format!("{at}.shape.{field} must list at least one"));
                }
                for (i, x) in shares.iter().enumerate() {
                    if x.name.is_empty() || !(x.weight.is_finite() && x.weight > 0.0) {
                        errors.push(format!(
                            "{at}.shape.{field}[{i}]: need a name and a weight > 0"
                        ));
                    }
                }
            }
            for (field, h) in [
                ("tenant_header", &s.tenant_header),
                ("objective_header", &s.objective_header),
            ] {
                if h.is_empty() || http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                    errors.push(format!("{at}.shape.{field} must be a header name"));
                }
            }
        }
        Shape::MultiTenant(s) => {
            positive("tenants", s.tenants);
            positive("system_tokens", s.system_tokens);
            positive("question_tokens", s.question_tokens);
            if s.tenant_header.is_empty()
                || http::HeaderName::from_bytes(s.tenant_header.as_bytes()).is_err()
            {
                errors.push(format!("{at}.shape.tenant_header must be a header name"));
            }
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse() {
        for name in [
            "quick", "full", "smoke", "validate", "replay", "flow", "routers", "offload",
        ] {
            let plan = Plan::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!plan.workloads.is_empty(), "{name}");
        }
    }

    #[test]
    fn invalid_plans_name_the_field() {
        let base =
            "policies: [{policy: round-robin}]\nworkloads: [{name: w, shape: {kind: unique}}]\n";
        let cases = [
            ("policies: []\nworkloads: [{name: w}]", "policies must list"),
            (
                "policies: [{policy: a}, {policy: a}]\nworkloads: [{name: w}]",
                "policies[1].label",
            ),
            (
                "policies: [{policy: a}]\nworkloads: [{name: w, rate: 0}]",
                "workloads[0].rate",
            ),
            (
                "policies: [{policy: a}]\nworkloads: [{name: w, shape: {kind: unique, prompt_tokens: 0}}]",
                "workloads[0].shape.prompt_tokens",
            ),
            (
                "policies: [{policy: a}]\nworkloads: [{name: w, shape: {kind: nope}}]",
                "unknown variant",
            ),
            (
                "policies: [{policy: a}]\nworkloads: [{name: w, events: [{at_s: 1, action: kill, replica: 9}]}]",
                "events[0].replica 9",
            ),
            (
                "fleet: [{profile: tpu}]\npolicies: [{policy: a}]\nworkloads: [{name: w}]",
                "fleet[0].profile",
            ),
            (
                "fleet: [{cpu_offload_gb_per_s: 0}]\npolicies: [{policy: a}]\nworkloads: [{name: w}]",
                "fleet[0].cpu_offload_gb_per_s must be a finite number > 0 (got 0)",
            ),
            (
                "policies: [{policy: a, router_bin: /nonexistent/kvrouter}]\nworkloads: [{name: w}]",
                "policies[0].router_bin /nonexistent/kvrouter is not a file",
            ),
            (
                "policies: [{policy: a, router_yaml: [1]}]\nworkloads: [{name: w}]",
                "router_yaml must be a mapping",
            ),
            ("bogus: 1", "unknown field `bogus`"),
        ];
        for (yaml, expected) in cases {
            let err = Plan::parse(yaml, "p").unwrap_err().to_string();
            assert!(err.contains(expected), "{yaml}: {err}");
        }
        Plan::parse(base, "p").unwrap();
    }
}
