//! kvrouter: a cache-aware request router for LLM inference, attached to Envoy as an external
//! processor (ext_proc). Envoy does the proxying; kvrouter only decides where each request goes.
//!
//! # Layout
//!
//! - [`config`]: the YAML schema, defaults, validation with field paths, hot reload.
//! - [`request`]: OpenAI body parsing (completions, chat, embeddings) with typed errors.
//! - [`prefix`]: prompt length and chained block hashes (tokenizers, chat templates, token
//!   cache); raw text never leaves it.
//! - [`index`]: which endpoints hold which prefix blocks (predictions and engine events), with
//!   per-endpoint capacity and LRU eviction.
//! - [`events`]: engines' KV events (vLLM's ZMQ publisher) decoded, re-hashed into the index,
//!   and per endpoint how far they can be trusted.
//! - [`discovery`]: the endpoint set, published as immutable snapshots; static, DNS and pluggable
//!   sources.
//! - [`load`]: per-endpoint load: in-flight accounting with RAII guards, scraped engine metrics,
//!   learned prefill speed and TTFT residual.
//! - [`health`]: active probes, scrape-failure and circuit-breaker ejection, and the background
//!   monitor that scrapes and probes every endpoint.
//! - [`policy`]: filters, scorers, pickers and named policies over plain candidate views.
//! - [`router`]: the decision pipeline, shared by the gRPC server, the admin API and the CLI.
//! - [`extproc`]: the Envoy ext_proc stream state machine and Envoy message building.
//! - [`envoyconf`]: renders the Envoy configs that attach kvrouter, and the EDS file it keeps.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/debug/*`.
//! - [`telemetry`]: logging and Prometheus metrics.
//! - [`cli`] / [`serve`]: the `kvrouter` binary's commands.

#![warn(missing_docs)]

pub mod admin;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod envoyconf;
pub mod events;
pub mod extproc;
pub mod health;
pub mod index;
pub mod load;
pub mod monitor;
pub mod policy;
pub mod prefix;
pub mod request;
pub mod router;
pub mod serve;
pub mod telemetry;
