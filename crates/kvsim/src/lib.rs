//! A vLLM-compatible replica simulator for tests, demos and benchmarks (the `kvsim` binary).
//! Every routing claim of the project is measured on it, so it behaves like vLLM (v1 engine,
//! reference 0.32) where routing cares, and this page says where it does not.
//!
//! It shares no code with the router (`kvrouter` is not a dependency): it parses requests,
//! renders chat templates and tokenizes with its own code, so a router bug in any of these shows
//! up as a disagreement instead of being mirrored. Tests check it against a real vLLM 0.32
//! capture (`tests/vllm_capture.rs`).
//!
//! # Layout
//!
//! Dependencies point one way: the binary and fleets over the HTTP layer, the HTTP layer (and
//! its handlers) over the replica state, the replica over the engine and the tokenizers, the
//! engine over the block pool and hashes. Nothing below calls back up: the replica owns its
//! fault state and knows no route; the handlers only read and command it.
//!
//! - `main.rs` (the `kvsim` binary), [`logging`]: flags or a fleet file, log setup.
//! - [`fleet`], [`config`]: several replicas in one process from a YAML file (each on its own
//!   port, with its own profile and model list); the schema, validated with field paths
//!   ([`config::FieldError`]).
//! - [`http`]: a replica's routes and listener, built from [`server`] (the OpenAI API) and
//!   [`admin`] (fault injection and maintenance), both handlers over a [`Replica`].
//! - [`request`]: OpenAI request bodies as vLLM's server reads them, with vLLM's 400s;
//!   [`openai`]: response bodies, SSE chunks and error bodies.
//! - [`replica`]: one replica's state (engine task handle, tokenizer, metrics, [`faults`]).
//! - [`tokenize`]: the [`PromptTokenizer`] trait and its deterministic word-piece fallback;
//!   [`hf_tokenizer`]: Hugging Face `tokenizer.json` + chat template, rendered and encoded as
//!   vLLM does.
//! - [`driver`]: the engine loop on `tokio::time` (tests pause the clock; `time_scale` divides
//!   every duration); [`publisher`], [`kv_events`]: ZMQ PUB of vLLM's KV-event wire format;
//!   [`metrics`]: vLLM's Prometheus names.
//! - [`engine`] / [`scheduler`]: continuous batching with `max_num_seqs`,
//!   `max_num_batched_tokens`, chunked prefill, FCFS waiting queue, prefix-cache lookup capped at
//!   `num_tokens - 1` in whole blocks, recompute preemption of the newest running request, no
//!   admissions in a step that preempted, `num_cached_tokens` fixed at first scheduling.
//! - [`offload`]: the CPU offload tier (write-through, LRU, loads over the host link, events
//!   with medium `CPU`), as vLLM's `OffloadingConnector`.
//! - [`block_pool`]: paged KV cache with vLLM's free-block queue (null block, LRU free queue,
//!   freed chains tail-first, unhashed blocks reused first, eviction on reuse).
//! - [`block_hash`]: chained block hashes over (parent, token ids, extra keys: LoRA name,
//!   multimodal hashes, `cache_salt` on the first block). Only full blocks are cached.
//! - [`profile`]: step time = fixed + max(weight floor, tokens × per-token) + prefill attention
//!   over (new × context) + decode KV reads; named profiles with their sources.
//! - [`inproc`]: drives a replica's routes without sockets, for tests and benchmarks;
//!   [`capture`]: the real vLLM capture's requests, usage and KV events, read for tests.
//!
//! # Interfaces
//!
//! - HTTP ([`server`]): `POST /v1/completions`, `POST /v1/chat/completions` (SSE when `stream`,
//!   ending with a usage chunk unless `stream_options.include_usage` is false, then `data:
//!   [DONE]`), `GET /v1/models` (models, then adapters with `parent`), `GET /health`, `GET
//!   /metrics` ([`metrics`]: vLLM names, labels `engine` and `model_name`, vLLM buckets).
//!   `usage.prompt_tokens_details.cached_tokens` is the engine's `num_cached_tokens`. Errors are
//!   vLLM's JSON shape: 400 bad body / too long, 404 unknown model. Every response carries
//!   [`REPLICA_HEADER`].
//! - KV events ([`kv_events`], [`publisher`]): ZMQ PUB, vLLM 0.32's wire format (msgpack maps
//!   with `type`), one batch per step, published when the step ends (as vLLM publishes in
//!   `update_from_output`, after the forward pass: a prompt's blocks a step after their
//!   allocation; until 2026-12-06 at the step's start), binding for wildcard endpoints and
//!   connecting otherwise.
//! - Admin ([`admin`], loopback peers only, else 403; durations are real time):
//!   - `GET /admin/state`: engine state (running, waiting, free/cached blocks, usage, stall).
//!   - `POST /admin/fail` `{"status":500,"count":N,"duration_ms":M,"message":"…"}`: answer
//!     generation requests with that error (all fields optional; default every request until
//!     cleared); `DELETE /admin/fail` clears it.
//!   - `POST /admin/stall` `{"duration_ms":M}`: the engine stops stepping (requests queue, HTTP
//!     still answers) for M ms or until `POST /admin/resume`.
//!   - `POST /admin/drop-cache`: forget every cached block and publish `AllBlocksCleared` at once
//!     (running requests keep their blocks, unfindable).
//!   - `POST /admin/reset`: cold state for benchmarks: aborts in-flight requests, empties the
//!     cache (`AllBlocksCleared`), **resets** all counters and histograms, clears faults. The
//!     KV-event sequence continues.
//!   - `POST /admin/restart` `{"down_ms":M}`: a simulated process restart: aborts in-flight
//!     requests, empties the cache *without* an event, resets counters, reopens the ZMQ socket
//!     with the sequence back at 0, and answers 503 to all non-admin routes for M ms.
//!
//! # Where the simulator deviates from vLLM
//!
//! - Timing is a cost model, not measurement: no CUDA graphs padding, no sampling or detokenize
//!   cost, no async scheduling overlap, no speculative decoding; HTTP overhead is real but tiny.
//! - Hashes are xxh3-64 with a configurable fixed seed (vLLM: SHA-256 of pickled tuples with a
//!   random `NONE_HASH` unless `PYTHONHASHSEED`); events carry them as u64 like vLLM's
//!   int-hash mode. Only one KV cache group (full attention); `group_idx` is always 0.
//! - Multimodal items only enter hashes as their content hash (xxh3 of the part's `uuid`, else
//!   of its URL or inline data; vLLM hashes the decoded media); each item is 64 placeholder
//!   tokens. With a Hugging Face tokenizer they sit where vLLM puts them for string-content
//!   templates (before the message's text); templates that loop over content parts see an item
//!   as a text part holding a placeholder (vLLM passes `{"type": "image"}` and lets the model's
//!   processor expand the template's own marker). `file` parts are accepted (vLLM refuses them).
//! - Chat templates: no `tools`, `documents` or `continue_final_message`; Jinja maps built in
//!   a template and JSON objects inside messages (`tool_calls`) iterate and `tojson` in sorted
//!   key order (Python keeps insertion order); booleans print as `true`/`false` (Python:
//!   `True`); `strftime_now` is UTC.
//! - Requests: sampling parameters, `suffix`, `echo` and `prompt_embeds` are ignored; `stream_options.continuous_usage_stats` is not honoured; a stream ends with a
//!   usage chunk unless `include_usage` is false (vLLM: only when true).
//! - Generated text is filler; every request generates exactly its length (no EOS, no stop
//!   strings); `n`, `best_of`, logprobs, beam search and `prompt_logprobs` are ignored. A
//!   batched completions prompt (`prompt: [..]`) becomes one engine request per prompt.
//! - A disconnected client's request is dropped when it reaches the head of the waiting queue
//!   or delivers its next token (vLLM aborts at once), so a running prefill chunk completes.
//! - `POST /admin/drop-cache` works while requests run (vLLM's `reset_prefix_cache` refuses);
//!   its `AllBlocksCleared` is published at once instead of with the next step.
//! - The KV-event replay socket (`replay_endpoint`, `--kv-events-replay`) serves the buffer as
//!   vLLM's does, but a simulated restart keeps the socket bound (only the buffer empties).
//! - No data parallelism (`data_parallel_rank` is 0), no priority scheduling, no LoRA slot
//!   limit. The CPU offload tier (`cpu_offload`, [`offload`]) is vLLM's `OffloadingConnector`
//!   with one GPU block per tier block and instant stores; no disk or remote tier.
//! - Metrics: a subset of vLLM's (the ones routers read); TTFT/e2e are measured in real time, so
//!   under `time_scale` they shrink with it. `request_success_total{finished_reason="abort"}`
//!   counts aborted requests.

pub mod admin;
pub mod block_hash;
pub mod block_pool;
pub mod capture;
pub mod config;
pub mod driver;
pub mod engine;
pub mod faults;
pub mod fleet;
pub mod hf_tokenizer;
pub mod http;
pub mod inproc;
pub mod kv_events;
pub mod logging;
pub mod metrics;
pub mod offload;
#[cfg(test)]
mod offload_tests;
pub mod openai;
pub mod profile;
pub mod publisher;
pub mod replay;
pub mod replica;
pub mod request;
pub mod scheduler;
pub mod server;
pub mod tokenize;

pub use config::{
    CpuOffloadConfig, FleetConfig, KvEventsConfig, OutputLength, ReplicaConfig, TokenizerPaths,
};
pub use fleet::Fleet;
pub use hf_tokenizer::HfTokenizer;
pub use http::{routes, serve, RunningReplica};
pub use replica::{Replica, SimError};
pub use tokenize::{PromptTokenizer, PromptTokens, WordPieceTokenizer};

/// Response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-kvsim-replica";
