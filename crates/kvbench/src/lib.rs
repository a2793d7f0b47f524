//! The benchmark tool behind the `kvbench` binary: generates seeded workloads from real
//! tokenizers' vocabularies, drives them open loop through Envoy + kvrouter against a fleet of
//! simulated replicas, once per routing policy on the identical trace, and writes a JSON +
//! Markdown + SVG report. See `docs/bench.md`.
//!
//! # Layout
//!
//! - [`plan`]: the YAML plan (fleet, workloads, policies, scenario events, analysis) and the
//!   built-in presets `quick`, `full`, `smoke`.
//! - [`vocab`]: prompt text from a tokenizer's vocabulary with exact token counts.
//! - [`workload`]: one generator per traffic shape, producing a [`workload::Trace`].
//! - [`routercfg`]: the kvrouter config of a run (policy by name, merged extra YAML).
//! - processes (kvsim, kvrouter, Envoy on loopback, killed on drop) come from the workspace's
//!   one harness, the `testkit` crate.
//! - [`client`] / [`runner`]: the streaming client and the open-loop load generator.
//! - [`scrape`]: replica and router metrics while a run goes.
//! - [`scenario`]: kill, restart, add, fail and stall events during a run.
//! - [`oracle`]: the lower bound and the cross-tenant hit check, from engine tokens.
//! - [`results`]: what a run produced, as plain data ([`results::RunResult`]).
//! - [`stats`] / [`analysis`]: a run's numbers, and the single-run comparisons (hot-prefix
//!   queues, cross-tenant hits, kill/restart).
//! - [`verdict`]: every cell over its seeds, medians with paired bootstrap intervals, and the
//!   subject's verdict against its best peer; [`goals`]: the plan's goals, met or not.
//! - [`flow`]: flow control on against off under overload (priorities, a flooding tenant).
//! - [`divergence`]: with several routers, how often a peer's decisions would have changed one.
//! - [`overhead`]: router overhead (direct, Envoy alone, Envoy + kvrouter).
//! - [`null_extproc`]: a null endpoint picker, the floor under any ext_proc service's hop cost
//!   (`kvbench null-extproc`, run by `scripts/overhead.sh`).
//! - [`suite`]: runs a plan seed by seed, the policies of a seed in shuffled order, each on
//!   fresh processes.
//! - [`report`]: JSON, Markdown, SVG and PNG output.
//!
//! Dependencies point one way: `suite` -> `report` -> `goals` / `verdict` / `analysis` ->
//! `results`.
//!
//! Times are simulated unless a field says real: the replicas run `time_scale` times faster
//! than real time and every client-side measurement is multiplied back. Router and Envoy
//! overhead is real time, so it is inflated by the same factor in simulated figures.

pub mod analysis;
pub mod client;
pub mod divergence;
pub mod flow;
pub mod goals;
pub mod null_extproc;
pub mod oracle;
pub mod overhead;
pub mod plan;
pub mod report;
pub mod results;
pub mod routercfg;
pub mod runner;
pub mod scenario;
pub mod scrape;
pub mod stats;
pub mod suite;
pub mod verdict;
pub mod vocab;
pub mod workload;

pub use plan::Plan;
pub use report::Report;
pub use suite::{run_plan, SuiteOptions};

/// Why the bench (or one part of it) could not go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BenchError {
    /// The plan is invalid.
    #[error("plan {origin}: {message}")]
    Plan {
        /// Preset name or file.
        origin: String,
        /// Every problem, with field paths.
        message: String,
    },
    /// The prompt tokenizer could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A trace could not be built.
    #[error("trace: {0}")]
    Trace(String),
    /// kvrouter rejected the run's config (e.g. an unknown policy name).
    #[error("kvrouter rejected the config: {0}")]
    Config(String),
    /// A process did not start or misbehaved.
    #[error("process: {0}")]
    Process(String),
    /// Reading or writing output.
    #[error("io: {0}")]
    Io(String),
}

impl From<testkit::HarnessError> for BenchError {
    fn from(e: testkit::HarnessError) -> BenchError {
        match e {
            testkit::HarnessError::ConfigRejected { message } => BenchError::Config(message),
            other => BenchError::Process(other.to_string()),
        }
    }
}
