//! One step's plan, as vLLM v1's `Scheduler.schedule` (FCFS policy) makes it:
//!
//! 1. Running requests in order get their remaining tokens (a prefill chunk or one decode
//!    token), within the step's token budget. When KV blocks run out, the newest running
//!    request is preempted (blocks freed, recomputed from scratch later, put back at the head of
//!    the waiting queue) until the allocation fits or the request preempted itself.
//! 2. Only if nothing was preempted: waiting requests in FCFS order are admitted while fewer than
//!    `max_num_seqs` run and budget remains. Each looks up its longest cached prefix (whole
//!    blocks, at most `num_tokens - 1` tokens), is given `min(uncached, budget)` tokens (chunked
//!    prefill), and stops the loop if its blocks do not fit (head-of-line blocking).
//!    `num_cached_tokens` is decided at first scheduling.
//!
//! Blocks are hashed and become findable when allocated, before the step computes them, and
//! `BlockStored` is queued then (as vLLM).

use std::sync::Arc;

use tokio::time::Instant;

use super::block_hash::BlockHasher;
use super::block_pool::{BlockId, BlockPool};
#[cfg(test)]
use super::engine::AdmitError;
use super::engine::{Engine, Loading, OutputSink, ReqId, Request, Scheduled, StepPlan};
use super::kv_events::KvEvent;
use super::metrics::{add, SimMetrics};
use super::offload::CpuTier;
use super::profile::StepWork;

impl<S: OutputSink> Engine<S> {
    /// Plans the next step into `plan` (cleared first). Applies preemptions and allocations.
    pub fn schedule(&mut self, plan: &mut StepPlan, now: Instant) {
        plan.items.clear();
        plan.preempted = 0;
        let mut budget = self.cfg.max_num_batched_tokens;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let r = &self.reqs[&id];
            let new_tokens = (r.tokens.len() as u32 - r.num_computed).min(budget);
            if new_tokens == 0 {
                i += 1;
                continue;
            }
            let mut scheduled = true;
            while !self.allocate_slots(id, new_tokens, 0, false) {
                let Some(victim) = self.running.pop() else {
                    scheduled = false;
                    break;
                };
                self.preempt(victim);
                plan.preempted += 1;
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            plan.items.push(self.item(id, new_tokens));
            budget -= new_tokens;
            i += 1;
        }

        if plan.preempted == 0 {
            let mut i = 0;
            while i < self.waiting.len() {
                let id = self.waiting[i];
                if budget == 0 || self.running.len() as u32 >= self.cfg.max_num_seqs {
                    break;
                }
                if self.reqs[&id].sink.is_closed() {
                    self.abort(id);
                    continue;
                }
                // A request loading from the CPU tier waits without holding up the queue
                // (vLLM's WAITING_FOR_REMOTE_KVS).
                match self.reqs[&id].loading.as_ref().map(|l| l.ready_at) {
                    Some(ready_at) if ready_at > now => {
                        i += 1;
                        continue;
                    }
                    Some(_) => self.finish_load(id),
                    None => {}
                }
                let hit_tokens = if self.reqs[&id].prefetched {
                    self.reqs[&id].num_computed
                } else {
                    let gpu = self.lookup(id);
                    match self.start_load(id, now) {
                        LoadStart::Started => {
                            i += 1;
                            continue;
                        }
                        // Its blocks do not fit: head-of-line blocking, as for any admission.
                        LoadStart::NoRoom => break,
                        LoadStart::Nothing => gpu,
                    }
                };
                let prefetched = self.reqs[&id].prefetched;
                let num_tokens = self.reqs[&id].tokens.len() as u32;
                let new_tokens = (num_tokens - hit_tokens).min(budget);
                let fits = if prefetched {
                    self.allocate_slots(id, new_tokens, 0, false)
                } else {
                    self.allocate_slots(id, new_tokens, hit_tokens, true)
                };
                if !fits {
                    break;
                }
                self.waiting.remove(i);
                self.running.push(id);
                let r = self.reqs.get_mut(&id).expect("waiting request exists");
                r.num_computed = hit_tokens;
                r.prefetched = false;
                if r.num_cached_tokens.is_none() {
                    r.num_cached_tokens = Some(hit_tokens);
                    add(&self.metrics.prompt_tokens, u64::from(r.num_prompt));
                    add(&self.metrics.prompt_tokens_cached, u64::from(hit_tokens));
                    self.metrics
                        .queue_time
                        .observe(now.saturating_duration_since(r.arrival));
                }
                plan.items.push(self.item(id, new_tokens));
                budget -= new_tokens;
            }
        }
        self.publish_gauges();
    }

    /// Starts loading from the CPU tier the blocks after `self.hits` (the GPU hit) that the
    /// tier holds, when there are any: their GPU blocks are allocated (the hit's touched) but
    /// not cached until the load ends.
    fn start_load(&mut self, id: ReqId, now: Instant) -> LoadStart {
        let bs = self.cfg.block_size;
        let Engine {
            reqs,
            pool,
            hits,
            offload,
            metrics,
            ..
        } = self;
        let Some(tier) = offload.as_mut() else {
            return LoadStart::Nothing;
        };
        let r = reqs.get_mut(&id).expect("waiting request exists");
        let num_tokens = r.tokens.len() as u32;
        let max_blocks = ((num_tokens - 1) / bs) as usize;
        let first = hits.len();
        if first >= max_blocks.min(r.hashes.len()) {
            return LoadStart::Nothing;
        }
        let wanted = &r.hashes[first..max_blocks.min(r.hashes.len())];
        let n = tier.lookup(wanted);
        if r.num_preemptions == 0 {
            add(
                &metrics.external_prefix_cache_queries,
                u64::from(num_tokens - first as u32 * bs),
            );
            add(
                &metrics.external_prefix_cache_hits,
                n as u64 * u64::from(bs),
            );
        }
        if n == 0 {
            return LoadStart::Nothing;
        }
        let evictable = hits.iter().filter(|&&b| pool.ref_cnt(b) == 0).count() as u32;
        if n as u32 + evictable > pool.num_free() {
            return LoadStart::NoRoom;
        }
        for &b in hits.iter() {
            pool.touch(b);
            r.blocks.push(b);
        }
        r.num_cached_blocks = first as u32;
        let allocated = pool.allocate(n as u32, &mut r.blocks);
        debug_assert!(allocated);
        let hashes = wanted[..n].to_vec();
        let ready_at = tier.begin_load(&hashes, now);
        let c = tier.config();
        add(&metrics.offload_load_bytes, n as u64 * c.block_bytes);
        add(
            &metrics.offload_load_ns,
            (c.latency + c.block_load * n as u32).as_nanos() as u64,
        );
        r.loading = Some(Loading {
            ready_at,
            first: first as u32,
            hashes,
        });
        LoadStart::Started
    }

    /// A load from the CPU tier ended: its blocks are cached on the GPU (`BlockStored`) and
    /// the request counts them computed.
    fn finish_load(&mut self, id: ReqId) {
        let bs = self.cfg.block_size;
        let Engine {
            reqs,
            pool,
            hasher,
            offload,
            ..
        } = self;
        let r = reqs.get_mut(&id).expect("waiting request exists");
        let Some(load) = r.loading.take() else {
            return;
        };
        if let Some(tier) = offload.as_mut() {
            tier.end_load(&load.hashes);
        }
        let end = load.first as usize + load.hashes.len();
        cache_blocks(pool, hasher, r, load.first as usize, end);
        r.num_computed = end as u32 * bs;
        r.prefetched = true;
    }

    fn item(&self, id: ReqId, new_tokens: u32) -> Scheduled {
        let r = &self.reqs[&id];
        let decode =
            new_tokens == 1 && r.num_output > 0 && r.num_computed + 1 == r.tokens.len() as u32;
        let work = if decode {
            StepWork::Decode {
                context_tokens: r.num_computed,
            }
        } else {
            StepWork::Prefill {
                new_tokens,
                context_tokens: r.num_computed,
            }
        };
        Scheduled {
            id,
            new_tokens,
            work,
        }
    }

    /// Longest cached prefix of a waiting request, into `self.hits`; returns its tokens.
    fn lookup(&mut self, id: ReqId) -> u32 {
        let bs = self.cfg.block_size;
        let r = &self.reqs[&id];
        let num_tokens = r.tokens.len() as u32;
        let max_blocks = ((num_tokens - 1) / bs) as usize;
        self.hits.clear();
        for &hash in r.hashes.iter().take(max_blocks) {
            match self.pool.lookup(hash) {
                Some(block) => self.hits.push(block),
                None => break,
            }
        }
        let hit_tokens = self.hits.len() as u32 * bs;
        if r.num_preemptions == 0 {
            add(&self.metrics.prefix_cache_queries, u64::from(num_tokens));
            add(&self.metrics.prefix_cache_hits, u64::from(hit_tokens));
        }
        hit_tokens
    }

    /// vLLM's `allocate_slots`: room for `new_tokens` more after `hit_tokens` of cached prefix
    /// (the blocks in `self.hits` when `with_hits`). All or nothing.
    fn allocate_slots(
        &mut self,
        id: ReqId,
        new_tokens: u32,
        hit_tokens: u32,
        with_hits: bool,
    ) -> bool {
        let bs = self.cfg.block_size;
        let Engine {
            reqs,
            pool,
            hits,
            hasher,
            ..
        } = self;
        let hits: &[BlockId] = if with_hits { hits } else { &[] };
        let r = reqs.get_mut(&id).expect("scheduled request exists");
        let total = r.num_computed + hit_tokens + new_tokens;
        let required = total.div_ceil(bs);
        let held = (r.blocks.len() + hits.len()) as u32;
        let new_blocks = required.saturating_sub(held);
        let evictable = hits.iter().filter(|&&b| pool.ref_cnt(b) == 0).count() as u32;
        if new_blocks + evictable > pool.num_free() {
            return false;
        }
        for &b in hits {
            pool.touch(b);
            r.blocks.push(b);
        }
        if with_hits {
            r.num_cached_blocks = r.num_cached_blocks.max(hits.len() as u32);
        }
        let allocated = pool.allocate(new_blocks, &mut r.blocks);
        debug_assert!(allocated);

        // Cache the blocks this step fills, as far as their hashes are known.
        let full = ((total.min(r.tokens.len() as u32) / bs) as usize).min(r.hashes.len());
        let start = r.num_cached_blocks as usize;
        cache_blocks(pool, hasher, r, start, full);
        true
    }

    /// Recompute-preemption: free the blocks (tail first), forget progress, back to the head of
    /// the waiting queue.
    fn preempt(&mut self, id: ReqId) {
        let r = self.reqs.get_mut(&id).expect("preempted request exists");
        self.pool.free(r.blocks.iter().rev().copied());
        r.blocks.clear();
        r.num_computed = 0;
        r.num_cached_blocks = 0;
        r.prefetched = false;
        r.num_preemptions += 1;
        add(&self.metrics.preemptions, 1);
        self.waiting.push_front(id);
    }
}

/// What [`Engine::start_load`] did.
enum LoadStart {
    /// The CPU tier holds nothing after the GPU hit (or there is no tier).
    Nothing,
    /// A load began; the request waits for it.
    Started,
    /// The tier holds some, but their GPU blocks do not fit now.
    NoRoom,
}

/// Makes blocks `start..full` of `r` findable on the GPU and queues their `BlockStored`.
fn cache_blocks<S>(
    pool: &mut BlockPool,
    hasher: &BlockHasher,
    r: &mut Request<S>,
    start: usize,
    full: usize,
) {
    if full <= start {
        return;
    }
    let bs = hasher.block_size();
    for k in start..full {
        pool.cache(r.blocks[k], r.hashes[k]);
    }
    r.num_cached_blocks = full as u32;
    if pool.records_events() {
        pool.push_event(stored_event(hasher, r, start, full, bs));
    }
}

/// The `BlockStored` payload of blocks `start..full` of `r`.
fn stored_event<S>(
    hasher: &BlockHasher,
    r: &Request<S>,
    start: usize,
    full: usize,
    bs: u32,
) -> KvEvent {
    let keys = r.keys();
    KvEvent::BlockStored {
        block_hashes: r.hashes[start..full].to_vec(),
        parent_block_hash: start.checked_sub(1).map(|p| r.hashes[p]),
        token_ids: r.tokens[start * bs as usize..full * bs as usize].to_vec(),
        block_size: bs,
        lora_id: r.lora.as_ref().map(|l| l.id),
        lora_name: r.lora.as_ref().map(|l| Arc::clone(&l.name)),
        extra_keys: (start..full)
            .map(|k| hasher.extra_keys(&keys, k as u32 * bs))
            .collect(),
    }
}

/// Write-through to the CPU tier: offers it the blocks `r` has computed in full since the
/// last call, queuing `BlockRemoved` (medium CPU) for what it evicts and `BlockStored` for
/// what it newly holds.
pub(super) fn offload_computed<S>(
    tier: &mut CpuTier,
    pool: &mut BlockPool,
    hasher: &BlockHasher,
    r: &mut Request<S>,
    metrics: &SimMetrics,
) {
    let bs = hasher.block_size();
    let full = ((r.num_computed / bs) as usize).min(r.hashes.len());
    let from = r.num_offloaded as usize;
    if full <= from {
        return;
    }
    r.num_offloaded = full as u32;
    let done = tier.store(&r.hashes[from..full]);
    let c = *tier.config();
    let n = done.stored.len() as u64;
    add(&metrics.offload_store_bytes, n * c.block_bytes);
    add(
        &metrics.offload_store_ns,
        (c.block_load * n as u32).as_nanos() as u64,
    );
    if !pool.records_events() {
        return;
    }
    if !done.evicted.is_empty() {
        pool.push_event(KvEvent::OffloadRemoved {
            block_hashes: done.evicted,
        });
    }
    if done.stored.is_empty() {
        return;
    }
    if c.self_describing {
        // One self-contained event per block (its own parent), as vLLM's tracker sends them.
        for &h in &done.stored {
            if let Some(k) = r.hashes[from..full].iter().position(|&x| x == h) {
                let k = from + k;
                pool.push_event(KvEvent::Offloaded(Box::new(stored_event(
                    hasher,
                    r,
                    k,
                    k + 1,
                    bs,
                ))));
            }
        }
    } else {
        pool.push_event(KvEvent::offload_placeholder(done.stored));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use parking_lot::Mutex;

    use super::*;
    use crate::engine::{EngineConfig, Lora, NewRequest, Output, Usage};
    use crate::metrics::SimMetrics;
    use crate::tokenize::{PromptTokens, WordPieceTokenizer};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<Output>>>);

    impl OutputSink for Sink {
        fn deliver(&mut self, output: Output) -> bool {
            self.0.lock().push(output);
            true
        }
    }

    impl Sink {
        fn usage(&self) -> Option<Usage> {
            self.0.lock().iter().find_map(|o| match o {
                Output::Finished(u) => Some(*u),
                _ => None,
            })
        }
        fn tokens(&self) -> usize {
            self.0
                .lock()
                .iter()
                .filter(|o| matches!(o, Output::Token { .. }))
                .count()
        }
    }

    fn config(
        block_size: u32,
        num_gpu_blocks: u32,
        max_num_seqs: u32,
        budget: u32,
    ) -> EngineConfig {
        EngineConfig {
            block_size,
            num_gpu_blocks,
            max_num_seqs,
            max_num_batched_tokens: budget,
            max_model_len: (num_gpu_blocks - 1) * block_size,
            hash_seed: 0,
            record_events: true,
            track_loras: false,
            offload: None,
        }
    }

    fn engine(cfg: EngineConfig) -> Engine<Sink> {
        Engine::new(
            cfg,
            Arc::new(WordPieceTokenizer::default()),
            Arc::new(SimMetrics::default()),
        )
    }

    fn submit(
        e: &mut Engine<Sink>,
        ids: Vec<u32>,
        max_tokens: u32,
        lora: Option<Lora>,
    ) -> (ReqId, Sink) {
        let sink = Sink::default();
        let id = e
            .add(NewRequest {
                prompt: PromptTokens {
                    ids,
                    mm: Vec::new(),
                },
                max_tokens,
                lora,
                cache_salt: None,
                sink: sink.clone(),
                arrival: Instant::now(),
            })
            .map_err(|(err, _)| err)
            .unwrap();
        (id, sink)
    }

    /// Runs steps until idle; returns the plans' (step index, items) and the event batches.
    fn run(e: &mut Engine<Sink>) -> (Vec<StepPlan>, Vec<Vec<KvEvent>>) {
        let mut plans = Vec::new();
        let mut batches = Vec::new();
        for _ in 0..10_000 {
            if !e.has_work() {
                break;
            }
            let mut plan = StepPlan::default();
            e.schedule(&mut plan, Instant::now());
            let events = e.take_events();
            if !events.is_empty() {
                batches.push(events);
            }
            e.finish_step(&plan, Instant::now());
            plans.push(plan);
        }
        assert!(!e.has_work(), "engine did not drain");
        (plans, batches)
    }

    /// Deterministic distinct token ids.
    fn ids(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| 1000 + (seed.wrapping_mul(7919) + i * 31) % 30_000)
            .collect()
    }

    #[test]
    fn replays_the_vllm_capture_eviction_order() {
        // fixtures/vllm-0.32-cpu-smollm2: block size 128, 24 blocks; chats of 421 tokens sharing
        // a 384-token prefix (max_tokens 4), six 704-token documents (max_tokens 2), a third
        // chat, a prefix-cache reset, a fourth chat; each request ran alone.
        let mut e = engine(config(128, 24, 256, 2048));
        let prefix = ids(1, 384);
        let chat = |n: u32| [prefix.clone(), ids(100 + n, 37)].concat();
        let mut labels: HashMap<u64, String> = HashMap::new();
        let mut label_sequence = Vec::new();
        let mut cached = Vec::new();
        let mut steps = |e: &mut Engine<Sink>,
                         tokens: Vec<u32>,
                         max: u32,
                         name: &str,
                         labels: &mut HashMap<u64, String>| {
            let (id, sink) = submit(e, tokens, max, None);
            for (k, h) in e.request_hashes(id).unwrap().iter().enumerate() {
                labels.entry(*h).or_insert(format!("{name}{k}"));
            }
            let (_, batches) = run(e);
            for batch in batches {
                let mut line = Vec::new();
                for ev in batch {
                    line.push(match ev {
                        KvEvent::BlockStored { block_hashes, .. } => format!(
                            "+{}",
                            block_hashes
                                .iter()
                                .map(|h| labels[h].clone())
                                .collect::<Vec<_>>()
                                .join(",")
                        ),
                        KvEvent::BlockRemoved { block_hashes } => {
                            format!("-{}", labels[&block_hashes[0]])
                        }
                        KvEvent::AllBlocksCleared => "clear".into(),
                        KvEvent::Offloaded(_) | KvEvent::OffloadRemoved { .. } => {
                            unreachable!("no offload tier in this test")
                        }
                    });
                }
                label_sequence.push(line.join(" "));
            }
            cached.push(sink.usage().unwrap().cached_tokens);
        };
        steps(&mut e, chat(1), 4, "c", &mut labels);
        steps(&mut e, chat(2), 4, "c", &mut labels);
        for d in 0..6 {
            steps(&mut e, ids(10 + d, 704), 2, &format!("d{d}."), &mut labels);
        }
        steps(&mut e, chat(3), 4, "c", &mut labels);
        e.clear_cache();
        steps(&mut e, chat(4), 4, "c", &mut labels);
        // The capture, hashes replaced by (request, block index) labels.
        assert_eq!(
            label_sequence,
            vec![
                "+c0,c1,c2",
                "+d0.0,d0.1,d0.2,d0.3,d0.4",
                "+d1.0,d1.1,d1.2,d1.3,d1.4",
                "+d2.0,d2.1,d2.2,d2.3,d2.4",
                "-c2 +d3.0,d3.1,d3.2,d3.3,d3.4",
                "-c1 -c0 -d0.4 -d0.3 -d0.2 +d4.0,d4.1,d4.2,d4.3,d4.4",
                "-d0.1 -d0.0 -d1.4 -d1.3 -d1.2 +d5.0,d5.1,d5.2,d5.3,d5.4",
                "-d1.1 -d1.0 -d2.4 +c0,c1,c2",
                "clear +c0,c1,c2",
            ]
        );
        assert_eq!(cached, vec![0, 384, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            e.metrics
                .prefix_cache_hits
                .load(std::sync::atomic::Ordering::Relaxed),
            384
        );
        assert_eq!(
            e.metrics
                .prefix_cache_queries
                .load(std::sync::atomic::Ordering::Relaxed),
            4 * 421 + 6 * 704
        );
    }

    #[test]
    fn hits_are_whole_blocks_capped_below_the_prompt_length() {
        // (prompt tokens, expected cached tokens on a repeat), block size 16.
        for (len, expected) in [(15, 0), (16, 0), (17, 16), (32, 16), (33, 32), (40, 32)] {
            let mut e = engine(config(16, 64, 8, 512));
            let (_, first) = submit(&mut e, ids(3, len), 1, None);
            run(&mut e);
            let (_, second) = submit(&mut e, ids(3, len), 1, None);
            run(&mut e);
            assert_eq!(first.usage().unwrap().cached_tokens, 0);
            assert_eq!(
                second.usage().unwrap().cached_tokens,
                expected,
                "prompt of {len}"
            );
        }
    }

    #[test]
    fn chunked_prefill_splits_a_long_prompt_over_steps() {
        let mut e = engine(config(16, 64, 8, 32));
        let (_, sink) = submit(&mut e, ids(4, 100), 2, None);
        let (plans, _) = run(&mut e);
        let works: Vec<StepWork> = plans.iter().map(|p| p.items[0].work).collect();
        assert_eq!(
            works,
            vec![
                StepWork::Prefill {
                    new_tokens: 32,
                    context_tokens: 0
                },
                StepWork::Prefill {
                    new_tokens: 32,
                    context_tokens: 32
                },
                StepWork::Prefill {
                    new_tokens: 32,
                    context_tokens: 64
                },
                StepWork::Prefill {
                    new_tokens: 4,
                    context_tokens: 96
                },
                StepWork::Decode {
                    context_tokens: 100
                },
            ]
        );
        assert_eq!(sink.tokens(), 2);
    }

    #[test]
    fn decode_fills_blocks_that_are_cached_and_chained() {
        let mut e = engine(config(4, 16, 8, 64));
        let (id, _) = submit(&mut e, ids(5, 6), 7, None);
        let prompt_hash = e.request_hashes(id).unwrap()[0];
        let (_, batches) = run(&mut e);
        let stored: Vec<(Option<u64>, usize)> = batches
            .iter()
            .flatten()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored {
                    parent_block_hash,
                    block_hashes,
                    ..
                } => Some((*parent_block_hash, block_hashes.len())),
                _ => None,
            })
            .collect();
        // Prompt block 0 at prefill; block 1 (tokens 4..8) once decode computed token 7; block
        // 2 (8..12) when token 11 is computed. The 13th token (last output) is never computed.
        assert_eq!(stored.len(), 3);
        assert_eq!(stored[0], (None, 1));
        assert_eq!(stored[1].0, Some(prompt_hash));
    }

    #[test]
    fn oversubscribed_kv_preempts_the_newest_and_everything_still_finishes() {
        // 9 usable blocks of 4 tokens; four requests that each grow to 4 blocks.
        let mut e = engine(config(4, 10, 8, 64));
        let sinks: Vec<Sink> = (0..4)
            .map(|i| submit(&mut e, ids(20 + i, 6), 10, None).1)
            .collect();
        let mut preempted = 0;
        let mut preempting_steps = 0;
        while e.has_work() {
            let running_before = e.running.clone();
            let mut plan = StepPlan::default();
            e.schedule(&mut plan, Instant::now());
            if plan.preempted > 0 {
                preempting_steps += 1;
                assert!(
                    plan.items.iter().all(|i| running_before.contains(&i.id)),
                    "a step that preempted admitted a waiting request"
                );
            }
            preempted += plan.preempted;
            e.finish_step(&plan, Instant::now());
        }
        assert!(preempting_steps > 0);
        assert_eq!(
            e.metrics
                .preemptions
                .load(std::sync::atomic::Ordering::Relaxed),
            u64::from(preempted)
        );
        for s in &sinks {
            assert_eq!(s.tokens(), 10, "every request gets all its tokens");
        }
        assert!(sinks.iter().any(|s| s.usage().unwrap().preemptions > 0));
        assert_eq!(
            sinks[0].usage().unwrap().preemptions,
            0,
            "the oldest is never the victim"
        );
        assert_eq!(e.pool().num_free(), 9, "all blocks back");
    }

    #[test]
    fn max_num_seqs_and_budget_bound_every_step() {
        let mut e = engine(config(16, 200, 3, 40));
        for i in 0..10 {
            submit(&mut e, ids(40 + i, 30), 5, None);
        }
        let (plans, _) = run(&mut e);
        for p in &plans {
            assert!(p.items.len() <= 3);
            assert!(p.items.iter().map(|i| i.new_tokens).sum::<u32>() <= 40);
        }
    }

    #[test]
    fn lora_and_base_model_never_share_blocks() {
        let mut e = engine(config(16, 64, 8, 512));
        let lora = Lora {
            name: "sql".into(),
            id: 1,
        };
        submit(&mut e, ids(6, 40), 1, None);
        run(&mut e);
        let (_, with_lora) = submit(&mut e, ids(6, 40), 1, Some(lora.clone()));
        run(&mut e);
        let (_, again) = submit(&mut e, ids(6, 40), 1, Some(lora));
        let (_, batches) = run(&mut e);
        assert_eq!(with_lora.usage().unwrap().cached_tokens, 0);
        assert_eq!(again.usage().unwrap().cached_tokens, 32);
        assert!(batches.is_empty(), "a full hit stores nothing new");
    }

    #[test]
    fn a_gone_waiting_client_is_dropped_before_scheduling() {
        struct Closed;
        impl OutputSink for Closed {
            fn deliver(&mut self, _: Output) -> bool {
                false
            }
            fn is_closed(&self) -> bool {
                true
            }
        }
        let mut e: Engine<Closed> = Engine::new(
            config(16, 64, 8, 512),
            Arc::new(WordPieceTokenizer::default()),
            Arc::new(SimMetrics::default()),
        );
        e.add(NewRequest {
            prompt: PromptTokens {
                ids: ids(7, 20),
                mm: Vec::new(),
            },
            max_tokens: 3,
            lora: None,
            cache_salt: None,
            sink: Closed,
            arrival: Instant::now(),
        })
        .map_err(|(err, _)| err)
        .unwrap();
        let mut plan = StepPlan::default();
        e.schedule(&mut plan, Instant::now());
        assert!(plan.items.is_empty());
        assert!(!e.has_work());
    }

    #[test]
    fn admission_limits() {
        let cfg = config(16, 10, 8, 512); // max_model_len 144
        assert_eq!(
            Engine::<Sink>::check(&cfg, 0, 1),
            Err(AdmitError::EmptyPrompt)
        );
        assert_eq!(
            Engine::<Sink>::check(&cfg, 10, 0),
            Err(AdmitError::NoOutput)
        );
        assert!(matches!(
            Engine::<Sink>::check(&cfg, 140, 5),
            Err(AdmitError::TooLong { total: 145, .. })
        ));
        assert_eq!(Engine::<Sink>::check(&cfg, 139, 5), Ok(()));
    }
}
