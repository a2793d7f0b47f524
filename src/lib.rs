//! kvrouter: a cache-aware request router for LLM inference, attached to Envoy as an external
//! processor (ext_proc). Envoy does the proxying; kvrouter only decides where each request goes.
//!
//! # Layout
//!
//! Modules in dependency order: each uses only modules above it (no cycles).
//!
//! - [`budget`]: the process-wide byte budgets (buffered request bodies, work queued after
//!   decisions): one share per holder, given back when dropped.
//! - [`sched`]: scheduler hints for kvrouter's own threads (a short slice, nice 19 for the
//!   heavy lane).
//! - [`config`]: the YAML schema, defaults, validation with field paths, hot reload.
//! - [`request`]: OpenAI body parsing (completions, chat, embeddings) with typed errors.
//! - [`envoyconf`]: renders the Envoy configs that attach kvrouter, and the EDS file it keeps.
//! - [`prefix`]: prompt length and chained block hashes (tokenizers, chat templates, token
//!   cache); raw text never leaves it.
//! - [`index`]: which endpoints hold which prefix blocks (predictions and engine events), with
//!   per-endpoint capacity and LRU eviction. Knows nothing of load.
//! - [`load`]: per-endpoint load: in-flight accounting with RAII guards, scraped engine metrics,
//!   learned prefill speed and TTFT residual. Knows nothing of prefixes.
//! - [`health`]: per-endpoint health views (probe, scrape, circuit breaker) and the probe itself.
//! - [`discovery`]: the endpoint set, published as immutable snapshots; static, DNS and pluggable
//!   sources.
//! - [`events`]: engines' KV events (vLLM's ZMQ publisher) decoded, re-hashed into the index,
//!   and per endpoint how far they can be trusted.
//! - [`policy`]: filters, scorers, pickers and named policies over plain candidate views; imports
//!   no table module.
//! - [`flow`]: flow control: per-model admission queues (priority bands, token-fair flows,
//!   bounds, shedding) in front of the routing decision; reads room through a trait.
//! - [`telemetry`]: logging and Prometheus metrics.
//! - [`monitor`]: the scrape and probe loops of every endpoint, fed narrow views (endpoint set,
//!   config) and writing through narrow sinks; knows nothing of the router.
//! - [`sharing`]: decision sharing between router instances over Redis pub/sub: a bounded
//!   outbox the decision path offers to, publisher and subscriber tasks off the request path.
//! - [`router`]: the decision pipeline: the tables built together, one config snapshot per
//!   request, a pure `plan`, and the ticket a routed request carries until its response ends;
//!   narrow handles for everything around it. Shared by the gRPC server, the admin API and the
//!   CLI.
//! - [`otel`]: OpenTelemetry decision spans continuing the gateway's `traceparent`, and the
//!   global `tracing` subscriber (logs, plus the OTLP exporter when `tracing.enabled`).
//! - [`extproc`]: the Envoy ext_proc stream state machine and Envoy message building; it
//!   translates messages into decisions and response facts and scores nothing. Also the
//!   tenant's `cache_salt` written into bodies.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/debug/*`, through the router's read-only
//!   view.
//! - [`api`]: kvrouter's own gRPC API (`kvrouter.v1`: explain, decision stream, endpoints,
//!   pushed KV events) beside the admin routes, and the admin bearer token guarding both.
//! - [`serve`]: `kvrouter serve`: builds the router and wires each part to the handle it needs.
//! - [`cli`]: the `kvrouter` binary's commands.

#![warn(missing_docs)]

pub mod admin;
pub mod api;
pub mod budget;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod envoyconf;
pub mod events;
pub mod extproc;
pub mod flow;
pub mod health;
pub mod index;
pub mod load;
pub mod monitor;
pub mod otel;
pub mod policy;
pub mod prefix;
pub mod request;
pub mod router;
pub mod sched;
pub mod serve;
pub mod sharing;
pub mod telemetry;
