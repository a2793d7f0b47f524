//! The simulated engine core: requests, the KV-cache manager and the step's bookkeeping, as
//! vLLM v1's `EngineCore` + `KVCacheManager` do them. No I/O and no clock of its own: the
//! driver ([`super::driver`]) calls [`Engine::schedule`], sleeps the profile's step time, then
//! calls [`Engine::finish_step`]. Scheduling itself is in [`super::scheduler`].

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ahash::AHashMap;
use tokio::time::Instant;

use super::block_hash::{BlockHasher, HashKeys};
use super::block_pool::{BlockId, BlockPool};
use super::kv_events::KvEvent;
use super::metrics::{add, SimMetrics};
use super::offload::{CpuTier, OffloadConfig};
use super::profile::StepWork;
use super::tokenize::{MmSpan, PromptTokenizer, PromptTokens};

/// Engine sizes and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per block.
    pub block_size: u32,
    /// KV blocks, the null block included.
    pub num_gpu_blocks: u32,
    /// Most running requests.
    pub max_num_seqs: u32,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output.
    pub max_model_len: u32,
    /// Seed of the hash chain.
    pub hash_seed: u64,
    /// Record KV events.
    pub record_events: bool,
    /// Publish the LoRA names of running/waiting requests after every step (only worth it
    /// when the replica serves adapters).
    pub track_loras: bool,
    /// The CPU offload tier, if any ([`super::offload`]).
    pub offload: Option<OffloadConfig>,
}

/// Identifies a request inside one engine.
pub type ReqId = u64;

/// Token usage of a finished request (the OpenAI `usage` object).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: u32,
    /// Times the request was preempted.
    pub preemptions: u32,
}

/// What the engine tells a request's client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Generated token number `index` (from 0); its text is `filler_piece(index)`.
    Token {
        /// Position in the output.
        index: u32,
    },
    /// The request finished normally, after its last token.
    Finished(Usage),
    /// The request was dropped by the engine (reset, restart, shutdown).
    Aborted(&'static str),
}

/// Receives a request's outputs. `deliver` returns false when the client is gone, which aborts
/// the request (as vLLM aborts on client disconnect).
pub trait OutputSink: Send {
    /// Hands one output over.
    fn deliver(&mut self, output: Output) -> bool;

    /// True when the client is known to be gone (checked before a waiting request is
    /// scheduled). Default false.
    fn is_closed(&self) -> bool {
        false
    }
}

/// A LoRA adapter a request runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// Adapter name (an extra key of every block hash).
    pub name: Arc<str>,
    /// vLLM's `lora_int_id` (1-based).
    pub id: u32,
}

/// A request as submitted.
#[derive(Debug)]
pub struct NewRequest<S> {
    /// Prompt tokens.
    pub prompt: PromptTokens,
    /// Tokens to generate (≥ 1).
    pub max_tokens: u32,
    /// LoRA adapter, if any.
    pub lora: Option<Lora>,
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<Box<str>>,
    /// Where outputs go.
    pub sink: S,
    /// Arrival time (TTFT and queue time are measured from it).
    pub arrival: Instant,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The prompt has no tokens.
    #[error("the prompt must not be empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// Prompt plus output exceed `max_model_len`.
    #[error("This model's maximum context length is {max_model_len} tokens. However, you requested {total} tokens ({prompt} in the messages, {output} in the completion). Please reduce the length of the messages or completion.")]
    TooLong {
        /// The limit.
        max_model_len: u32,
        /// Prompt + output.
        total: u64,
        /// Prompt tokens.
        prompt: usize,
        /// Output tokens.
        output: u32,
    },
}

pub(super) struct Request<S> {
    pub(super) tokens: Vec<u32>,
    pub(super) num_prompt: u32,
    pub(super) max_output: u32,
    pub(super) num_output: u32,
    pub(super) num_computed: u32,
    pub(super) hashes: Vec<u64>,
    pub(super) blocks: Vec<BlockId>,
    pub(super) num_cached_blocks: u32,
    pub(super) num_cached_tokens: Option<u32>,
    pub(super) num_preemptions: u32,
    pub(super) lora: Option<Lora>,
    pub(super) cache_salt: Option<Box<str>>,
    pub(super) mm: Vec<MmSpan>,
    pub(super) arrival: Instant,
    pub(super) finished: bool,
    pub(super) sink: S,
    /// Blocks (from the first) already offered to the CPU tier.
    pub(super) num_offloaded: u32,
    /// A load from the CPU tier in progress: the request waits in the queue for it.
    pub(super) loading: Option<Loading>,
    /// Its prefix was loaded from the CPU tier: `num_computed` tokens are in its blocks and
    /// it skips the prefix lookup when admitted.
    pub(super) prefetched: bool,
}

/// A request's load from the CPU tier.
#[derive(Debug, Clone)]
pub(super) struct Loading {
    /// When the blocks are in GPU memory.
    pub(super) ready_at: Instant,
    /// Index of the first loaded block (the GPU hit's length).
    pub(super) first: u32,
    /// The loaded blocks' hashes (pinned in the tier).
    pub(super) hashes: Vec<u64>,
}

impl<S> Request<S> {
    pub(super) fn keys(&self) -> HashKeys<'_> {
        HashKeys {
            lora_name: self.lora.as_ref().map(|l| &*l.name),
            cache_salt: self.cache_salt.as_deref(),
            mm: &self.mm,
        }
    }
}

/// Unpins a leaving request's blocks in the CPU tier, if it was loading them.
fn release_load<S>(offload: &mut Option<CpuTier>, r: &mut Request<S>) {
    if let (Some(load), Some(tier)) = (r.loading.take(), offload.as_mut()) {
        tier.end_load(&load.hashes);
    }
}

/// One request's share of a planned step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// The request.
    pub id: ReqId,
    /// Tokens it computes this step.
    pub new_tokens: u32,
    /// What the cost model charges for it.
    pub work: StepWork,
}

/// What one step does; reused across steps to avoid allocation.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Scheduled requests, running ones first.
    pub items: Vec<Scheduled>,
    /// Requests preempted while planning.
    pub preempted: u32,
}

/// A simulated vLLM engine (scheduler + KV cache manager) for one replica.
pub struct Engine<S> {
    pub(super) cfg: EngineConfig,
    pub(super) pool: BlockPool,
    pub(super) hasher: BlockHasher,
    pub(super) reqs: AHashMap<ReqId, Request<S>>,
    pub(super) waiting: VecDeque<ReqId>,
    pub(super) running: Vec<ReqId>,
    pub(super) hits: Vec<BlockId>,
    /// The CPU offload tier, if configured.
    pub(super) offload: Option<CpuTier>,
    next_id: ReqId,
    tokenizer: Arc<dyn PromptTokenizer>,
    pub(super) metrics: Arc<SimMetrics>,
}

impl<S: OutputSink> Engine<S> {
    /// An idle engine with an empty cache.
    pub fn new(
        cfg: EngineConfig,
        tokenizer: Arc<dyn PromptTokenizer>,
        metrics: Arc<SimMetrics>,
    ) -> Engine<S> {
        Engine {
            pool: BlockPool::new(cfg.num_gpu_blocks, cfg.record_events),
            hasher: BlockHasher::new(cfg.block_size, cfg.hash_seed),
            reqs: AHashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            hits: Vec::new(),
            offload: cfg.offload.map(CpuTier::new),
            next_id: 0,
            tokenizer,
            metrics,
            cfg,
        }
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Checks a request against the engine's limits without submitting it.
    pub fn check(cfg: &EngineConfig, prompt_len: usize, max_tokens: u32) -> Result<(), AdmitError> {
        if prompt_len == 0 {
            return Err(AdmitError::EmptyPrompt);
        }
        if max_tokens == 0 {
            return Err(AdmitError::NoOutput);
        }
        let total = prompt_len as u64 + u64::from(max_tokens);
        if total > u64::from(cfg.max_model_len) {
            return Err(AdmitError::TooLong {
                max_model_len: cfg.max_model_len,
                total,
                prompt: prompt_len,
                output: max_tokens,
            });
        }
        Ok(())
    }

    /// Queues a request (FCFS) and returns its id.
    pub fn add(&mut self, req: NewRequest<S>) -> Result<ReqId, (AdmitError, S)> {
        if let Err(e) = Self::check(&self.cfg, req.prompt.ids.len(), req.max_tokens) {
            return Err((e, req.sink));
        }
        let id = self.next_id;
        self.next_id += 1;
        let num_prompt = req.prompt.ids.len() as u32;
        let mut tokens = req.prompt.ids;
        tokens.reserve(req.max_tokens as usize);
        let mut r = Request {
            tokens,
            num_prompt,
            max_output: req.max_tokens,
            num_output: 0,
            num_computed: 0,
            hashes: Vec::new(),
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_cached_tokens: None,
            num_preemptions: 0,
            lora: req.lora,
            cache_salt: req.cache_salt,
            mm: req.prompt.mm,
            arrival: req.arrival,
            finished: false,
            sink: req.sink,
            num_offloaded: 0,
            loading: None,
            prefetched: false,
        };
        let mut hashes = Vec::with_capacity(r.tokens.len() / self.cfg.block_size as usize + 1);
        self.hasher.extend_hashes(&r.tokens, &r.keys(), &mut hashes);
        r.hashes = hashes;
        self.reqs.insert(id, r);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// True when a step has anything to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Requests running / waiting.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Takes the KV events queued since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// The prompt hashes of a request (for tests).
    pub fn request_hashes(&self, id: ReqId) -> Option<&[u64]> {
        self.reqs.get(&id).map(|r| &r.hashes[..])
    }

    /// Names of LoRA adapters of running and of waiting requests, comma-separated.
    pub fn lora_names(&self) -> (String, String) {
        let names = |ids: &mut dyn Iterator<Item = &ReqId>| {
            let mut v: Vec<&str> = ids
                .filter_map(|id| self.reqs.get(id)?.lora.as_ref().map(|l| &*l.name))
                .collect();
            v.sort_unstable();
            v.dedup();
            v.join(",")
        };
        (
            names(&mut self.running.iter()),
            names(&mut self.waiting.iter()),
        )
    }

    /// Applies a finished step: advances computed tokens, emits one token for every request
    /// whose tokens are all computed, finishes requests at their length.
    pub fn finish_step(&mut self, plan: &StepPlan, now: Instant) {
        let mut any_done = false;
        for item in &plan.items {
            let Some(r) = self.reqs.get_mut(&item.id) else {
                continue;
            };
            r.num_computed += item.new_tokens;
            if let Some(tier) = &mut self.offload {
                super::scheduler::offload_computed(
                    tier,
                    &mut self.pool,
                    &self.hasher,
                    r,
                    &self.metrics,
                );
            }
            if r.num_computed as usize != r.tokens.len() {
                continue; // a prefill chunk that is not the last
            }
            let index = r.num_output;
            r.tokens.push(self.tokenizer.output_token(index));
            r.num_output += 1;
            let mut hashes = std::mem::take(&mut r.hashes);
            self.hasher.extend_hashes(&r.tokens, &r.keys(), &mut hashes);
            r.hashes = hashes;
            add(&self.metrics.generation_tokens, 1);
            if index == 0 {
                self.metrics
                    .ttft
                    .observe(now.saturating_duration_since(r.arrival));
            }
            let alive = r.sink.deliver(Output::Token { index });
            if r.num_output == r.max_output {
                let usage = Usage {
                    prompt_tokens: r.num_prompt,
                    completion_tokens: r.num_output,
                    cached_tokens: r.num_cached_tokens.unwrap_or(0),
                    preemptions: r.num_preemptions,
                };
                r.sink.deliver(Output::Finished(usage));
                self.metrics
                    .e2e
                    .observe(now.saturating_duration_since(r.arrival));
                add(&self.metrics.finished_length, 1);
                r.finished = true;
                any_done = true;
            } else if !alive {
                add(&self.metrics.finished_abort, 1);
                r.finished = true;
                any_done = true;
            }
        }
        if any_done {
            let reqs = &self.reqs;
            self.running.retain(|id| !reqs[id].finished);
            let done: Vec<ReqId> = plan
                .items
                .iter()
                .map(|i| i.id)
                .filter(|id| self.reqs.get(id).is_some_and(|r| r.finished))
                .collect();
            for id in done {
                if let Some(r) = self.reqs.remove(&id) {
                    self.pool.free(r.blocks.iter().rev().copied());
                }
            }
        }
        self.publish_gauges();
    }

    /// Empties the GPU prefix cache only (tests of the CPU tier).
    #[cfg(test)]
    pub(crate) fn clear_gpu_for_test(&mut self) {
        self.pool.clear_cache();
    }

    /// The CPU tier (read-only), if configured.
    pub fn offload(&self) -> Option<&CpuTier> {
        self.offload.as_ref()
    }

    /// When the next load from the CPU tier ends, if one is in progress.
    pub fn next_load_ready(&self) -> Option<Instant> {
        self.waiting
            .iter()
            .filter_map(|id| self.reqs.get(id)?.loading.as_ref().map(|l| l.ready_at))
            .min()
    }

    /// Drops a request wherever it is (client gone). No output is delivered.
    pub fn abort(&mut self, id: ReqId) {
        if let Some(mut r) = self.reqs.remove(&id) {
            release_load(&mut self.offload, &mut r);
            self.pool.free(r.blocks.iter().rev().copied());
            self.running.retain(|&x| x != id);
            self.waiting.retain(|&x| x != id);
            add(&self.metrics.finished_abort, 1);
        }
        self.publish_gauges();
    }

    /// Aborts every request, telling each client `reason`.
    pub fn abort_all(&mut self, reason: &'static str) {
        for id in self.running.drain(..).chain(self.waiting.drain(..)) {
            if let Some(mut r) = self.reqs.remove(&id) {
                release_load(&mut self.offload, &mut r);
                r.sink.deliver(Output::Aborted(reason));
                self.pool.free(r.blocks.iter().rev().copied());
                add(&self.metrics.finished_abort, 1);
            }
        }
        self.publish_gauges();
    }

    /// Forgets every cached block (running requests keep theirs, unfindable) and queues
    /// `AllBlocksCleared`.
    pub fn clear_cache(&mut self) {
        // Blocks a running request already cached stay unfindable (nothing re-hashes them);
        // its later blocks are cached as they fill. The CPU tier goes too (vLLM resets the
        // connector's cache with the prefix cache).
        self.pool.clear_cache();
        if let Some(tier) = &mut self.offload {
            tier.clear();
        }
    }

    /// Back to a cold engine: aborts everything and starts over with an empty pool. With
    /// `announce`, queues `AllBlocksCleared` (a reset); without, subscribers see nothing (a
    /// restarted process just starts a new sequence).
    pub fn reset(&mut self, reason: &'static str, announce: bool) {
        self.abort_all(reason);
        self.pool = BlockPool::new(self.cfg.num_gpu_blocks, self.cfg.record_events);
        self.offload = self.cfg.offload.map(CpuTier::new);
        if announce {
            self.pool.push_event(KvEvent::AllBlocksCleared);
        }
        self.publish_gauges();
    }

    pub(super) fn publish_gauges(&self) {
        let m = &self.metrics;
        m.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        m.waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        m.kv_usage_bits
            .store(self.pool.usage().to_bits(), Ordering::Relaxed);
        if self.cfg.track_loras {
            *m.lora_names.lock() = self.lora_names();
        }
    }
}
