//! A vLLM-compatible replica simulator for tests, demos and benchmarks (the `kvsim` binary).
//! Every routing claim of the project is measured on it, so it behaves like vLLM (v1 engine,
//! reference 0.32) where routing cares, and this page says where it does not.
//!
//! # Engine model
//!
//! - [`block_pool`]: paged KV cache with vLLM's free-block queue (null block, LRU free queue,
//!   freed chains tail-first, unhashed blocks reused first, eviction on reuse).
//! - [`block_hash`]: chained block hashes over (parent, token ids, extra keys: LoRA name,
//!   multimodal hashes, `cache_salt` on the first block). Only full blocks are cached.
//! - [`engine`] / [`scheduler`]: continuous batching with `max_num_seqs`,
//!   `max_num_batched_tokens`, chunked prefill, FCFS waiting queue, prefix-cache lookup capped at
//!   `num_tokens - 1` in whole blocks, recompute preemption of the newest running request, no
//!   admissions in a step that preempted, `num_cached_tokens` fixed at first scheduling.
//! - [`profile`]: step time = fixed + max(weight floor, tokens × per-token) + prefill attention
//!   over (new × context) + decode KV reads; named profiles with their sources.
//! - [`driver`]: the engine loop on `tokio::time` (tests pause the clock; `time_scale` divides
//!   every duration).
//! - [`tokenize`]: the [`PromptTokenizer`] trait and its deterministic word-piece fallback.
//!
//! # Interfaces
//!
//! - HTTP ([`server`]): `POST /v1/completions`, `POST /v1/chat/completions` (SSE when `stream`,
//!   always ending with a usage chunk and `data: [DONE]`), `GET /v1/models` (models, then
//!   adapters with `parent`), `GET /health`, `GET /metrics` ([`metrics`]: vLLM names, labels
//!   `engine` and `model_name`, vLLM buckets). `usage.prompt_tokens_details.cached_tokens` is
//!   the engine's `num_cached_tokens`. Errors are vLLM's JSON shape: 400 bad body / too long,
//!   404 unknown model. Every response carries [`REPLICA_HEADER`].
//! - KV events ([`kv_events`], [`publisher`]): ZMQ PUB, vLLM 0.32's wire format (msgpack maps with `type`), one
//!   batch per step, binding for wildcard endpoints and connecting otherwise.
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
//! - Fleets ([`fleet`], [`config`]): several replicas in one process from a YAML file, each on
//!   its own port, with its own profile and model list.
//!
//! # Where the simulator deviates from vLLM
//!
//! - Timing is a cost model, not measurement: no CUDA graphs padding, no sampling or detokenize
//!   cost, no async scheduling overlap, no speculative decoding; HTTP overhead is real but tiny.
//! - Hashes are xxh3-64 with a configurable fixed seed (vLLM: SHA-256 of pickled tuples with a
//!   random `NONE_HASH` unless `PYTHONHASHSEED`); events carry them as u64 like vLLM's
//!   int-hash mode. Only one KV cache group (full attention); `group_idx` is always 0.
//! - Multimodal items only enter hashes as their content hash (no `mm` offsets); the fallback
//!   tokenizer gives each item 64 placeholder tokens.
//! - Generated text is filler; every request generates exactly its length (no EOS, no stop
//!   strings); `n`, `best_of`, logprobs, beam search and `prompt_logprobs` are ignored. A
//!   batched completions prompt (`prompt: [..]`) becomes one engine request per prompt.
//! - A disconnected client's request is dropped when it reaches the head of the waiting queue
//!   or delivers its next token (vLLM aborts at once), so a running prefill chunk completes.
//! - `POST /admin/drop-cache` works while requests run (vLLM's `reset_prefix_cache` refuses);
//!   its `AllBlocksCleared` is published at once instead of with the next step.
//! - No KV-event replay socket, no data parallelism (`data_parallel_rank` is 0), no CPU offload
//!   tier (`medium` is always `GPU`), no priority scheduling, no LoRA slot limit.
//! - Metrics: a subset of vLLM's (the ones routers read); TTFT/e2e are measured in real time, so
//!   under `time_scale` they shrink with it. `request_success_total{finished_reason="abort"}`
//!   counts aborted requests.

pub mod admin;
pub mod block_hash;
pub mod block_pool;
pub mod config;
pub mod driver;
pub mod engine;
pub mod fleet;
pub mod hf_tokenizer;
pub mod inproc;
pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod profile;
pub mod publisher;
pub mod replica;
pub mod scheduler;
pub mod server;
pub mod tokenize;

pub use config::{FleetConfig, KvEventsConfig, OutputLength, ReplicaConfig, TokenizerPaths};
pub use fleet::Fleet;
pub use hf_tokenizer::hf_tokenizer_loader;
pub use replica::{no_tokenizer_files, serve, Replica, RunningReplica, SimError, TokenizerLoader};
pub use tokenize::{PromptTokenizer, PromptTokens, WordPieceTokenizer};

/// Response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-kvsim-replica";
