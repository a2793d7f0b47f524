//! What the engine's tokens allow, computed from the trace with the engine's own tokenizer:
//!
//! - **Lower bound**: each request pays only the prefill of the tokens no earlier request (on
//!   any replica) could have cached, with no queueing: an infinite shared cache and an idle
//!   replica of the fastest profile. Its TTFT is that prefill's step time (whole KV blocks,
//!   vLLM's `num_tokens - 1` hit cap, chunked by the profile's token budget).
//! - **Fluid bound**: a perfect router still cannot prefill faster than the whole fleet. Pool
//!   the fleet into one server `K` times as fast as the fastest replica (`K` = the replicas'
//!   summed speeds relative to it) and run it preemptive shortest-remaining-first on the
//!   bound's prefill times: no schedule on `K` separate replicas has a smaller mean completion
//!   time, and no request finishes faster than its own prefill on one idle replica, so the
//!   larger of the two means bounds every router's mean TTFT from below. It counts the
//!   queueing that capacity forces, which the per-request bound does not.
//! - **Cross-tenant hits**: a request's reported `cached_tokens` beyond the longest block
//!   prefix it shares with any *same-tenant* request that reached the *same replica* before
//!   its first token. Such tokens can only have come from another tenant's blocks. The bound
//!   ignores eviction and restarts, which only lower legitimate hits, so it never flags a
//!   legitimate hit.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::client::RequestRecord;
use super::workload::{engine_ids, Start, Trace};
use super::BenchError;
use kvsim::profile::StepProfile;
use kvsim::PromptTokenizer;

/// One request's engine view.
#[derive(Debug, Clone)]
pub struct EngineView {
    /// Prompt tokens (chat template applied), as the engine counts them.
    pub prompt_tokens: usize,
    /// Chained hashes of the full blocks of prompt + generated tokens (salted like vLLM).
    pub blocks: Vec<u64>,
}

/// The engine view of every request of `trace`, by id.
pub fn engine_views(
    trace: &Trace,
    engine: &dyn PromptTokenizer,
    model: &str,
    block_size: u32,
) -> Result<Vec<EngineView>, BenchError> {
    let bs = block_size.max(1) as usize;
    trace
        .requests
        .iter()
        .map(|r| {
            let mut ids = engine_ids(engine, r, model)?;
            let prompt_tokens = ids.len();
            // The last generated token has no KV yet.
            ids.extend((0..r.max_tokens.saturating_sub(1)).map(|i| engine.output_token(i)));
            let mut parent = r
                .cache_salt
                .as_deref()
                .map_or(0, |s| xxh3_64_with_seed(s.as_bytes(), 1));
            let blocks = ids
                .chunks_exact(bs)
                .map(|chunk| {
                    let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
                    parent = xxh3_64_with_seed(&bytes, parent);
                    parent
                })
                .collect();
            Ok(EngineView {
                prompt_tokens,
                blocks,
            })
        })
        .collect()
}

/// Per request (by id, in id order), the prompt tokens in whole engine blocks that an earlier
/// request (lower id) had as a prefix: the sharing the engine's chained hashes see.
pub fn engine_shared_tokens(views: &[EngineView], block_size: u32) -> Vec<usize> {
    let bs = block_size.max(1) as usize;
    let mut seen = ahash::AHashSet::new();
    views
        .iter()
        .map(|v| {
            let prompt_blocks = &v.blocks[..(v.prompt_tokens / bs).min(v.blocks.len())];
            let n = prompt_blocks
                .iter()
                .take_while(|h| seen.contains(*h))
                .count();
            seen.extend(prompt_blocks.iter().copied());
            n * bs
        })
        .collect()
}

/// Prompt tokens a request may find cached when `matched_blocks` of its blocks are: whole
/// blocks, capped at `prompt_tokens - 1` (vLLM always computes the last prompt token).
pub fn hit_tokens(matched_blocks: usize, prompt_tokens: usize, block_size: usize) -> usize {
    let cap = prompt_tokens.saturating_sub(1) / block_size * block_size;
    (matched_blocks * block_size).min(cap)
}

/// The lower bound of a trace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LowerBound {
    /// Per request (by id): the bound's TTFT, simulated ms.
    pub ttft_ms: Vec<f64>,
    /// Per request: prompt tokens no earlier request could have cached.
    pub novel_tokens: Vec<usize>,
    /// The profile the bound assumes (the fleet's fastest).
    pub profile: String,
    /// The fluid bound on the mean TTFT, simulated ms (see the module docs).
    #[serde(default)]
    pub fluid_mean_ms: f64,
    /// The fleet's speed in units of its fastest replica.
    #[serde(default)]
    pub fleet_speed: f64,
    /// Prefill utilisation a perfect router would see: the bound's prefill work over the
    /// fleet's prefill capacity during the arrival window.
    #[serde(default)]
    pub prefill_utilisation: f64,
}

/// Mean completion time (from arrival) of jobs `(arrival_ms, work_ms)` on one preemptive
/// shortest-remaining-work-first server of speed `speed`.
pub fn srpt_mean_ms(jobs: &[(f64, f64)], speed: f64) -> f64 {
    if jobs.is_empty() || speed <= 0.0 {
        return 0.0;
    }
    let mut order: Vec<(f64, f64)> = jobs.to_vec();
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Remaining work (ms at speed 1) and arrival, smallest remaining first.
    let mut queue: Vec<(f64, f64)> = Vec::new();
    let mut now = order[0].0;
    let mut total = 0.0;
    let mut next = 0;
    while next < order.len() || !queue.is_empty() {
        if queue.is_empty() {
            now = now.max(order[next].0);
        }
        while next < order.len() && order[next].0 <= now {
            queue.push((order[next].1, order[next].0));
            next += 1;
        }
        // The job with the least remaining work runs until it ends or the next arrival.
        let (i, _) = queue
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
            .expect("queue is not empty");
        let finish = now + queue[i].0 / speed;
        let arrival = order.get(next).map_or(f64::INFINITY, |j| j.0);
        if finish <= arrival {
            now = finish;
            total += now - queue[i].1;
            queue.swap_remove(i);
        } else {
            queue[i].0 -= (arrival - now) * speed;
            now = arrival;
        }
    }
    total / jobs.len() as f64
}

/// Computes the lower bound of `trace` on `profile` with prefill chunks of `chunk_tokens`, for
/// a fleet `fleet_speed` times as fast as one replica of `profile`.
pub fn lower_bound(
    trace: &Trace,
    views: &[EngineView],
    block_size: u32,
    profile: &StepProfile,
    chunk_tokens: u32,
    fleet_speed: f64,
) -> LowerBound {
    let bs = block_size.max(1) as usize;
    // Arrival order: timed requests at their time, later turns after their previous turn plus
    // think time (service time is unknown here and ignored).
    let mut at = vec![0.0; trace.requests.len()];
    for r in &trace.requests {
        at[r.id] = match r.start {
            Start::At(ms) => ms,
            Start::After { prev, think_ms } => at.get(prev).copied().unwrap_or(0.0) + think_ms,
        };
    }
    let mut order: Vec<usize> = (0..trace.requests.len()).collect();
    order.sort_by(|&a, &b| at[a].total_cmp(&at[b]).then(a.cmp(&b)));
    let mut seen = ahash::AHashSet::new();
    let mut out = LowerBound {
        ttft_ms: vec![0.0; views.len()],
        novel_tokens: vec![0; views.len()],
        profile: profile.name.to_string(),
        fluid_mean_ms: 0.0,
        fleet_speed,
        prefill_utilisation: 0.0,
    };
    for id in order {
        let v = &views[id];
        let matched = v.blocks.iter().take_while(|h| seen.contains(*h)).count();
        let cached = hit_tokens(matched, v.prompt_tokens, bs);
        let novel = v.prompt_tokens - cached;
        out.novel_tokens[id] = novel;
        out.ttft_ms[id] = profile.prefill_ms(cached as u32, novel as u32, chunk_tokens);
        seen.extend(v.blocks.iter().copied());
    }
    let jobs: Vec<(f64, f64)> = (0..views.len()).map(|i| (at[i], out.ttft_ms[i])).collect();
    let idle_mean = out.ttft_ms.iter().sum::<f64>() / views.len().max(1) as f64;
    out.fluid_mean_ms = srpt_mean_ms(&jobs, fleet_speed).max(idle_mean);
    let span =
        at.iter().copied().fold(0.0, f64::max) - at.iter().copied().fold(f64::INFINITY, f64::min);
    if span > 0.0 && fleet_speed > 0.0 {
        out.prefill_utilisation = out.ttft_ms.iter().sum::<f64>() / (fleet_speed * span);
    }
    out
}

/// Cross-tenant cache hits found in one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CrossTenant {
    /// Requests with a tenant and a reported cache hit that were checked.
    pub checked: usize,
    /// Requests whose hit exceeded what their own tenant could have provided.
    pub requests: usize,
    /// Cached tokens beyond that bound, summed.
    pub tokens: u64,
}

/// Finds cross-tenant hits in `records` (see the module docs).
pub fn cross_tenant_hits(
    records: &[RequestRecord],
    views: &[EngineView],
    block_size: u32,
) -> CrossTenant {
    let bs = block_size.max(1) as usize;
    let mut out = CrossTenant::default();
    for r in records {
        let (Some(tenant), Some(cached), Some(replica), Some(first)) =
            (&r.tenant, r.cached_tokens, &r.replica, r.first_token_ms)
        else {
            continue;
        };
        if cached == 0 || r.id >= views.len() {
            continue;
        }
        out.checked += 1;
        let mine = &views[r.id];
        let best = records
            .iter()
            .filter(|q| {
                q.id != r.id
                    && q.tenant.as_ref() == Some(tenant)
                    && q.replica.as_ref() == Some(replica)
                    && q.sent_ms < first
                    && q.id < views.len()
            })
            .map(|q| {
                mine.blocks
                    .iter()
                    .zip(&views[q.id].blocks)
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap_or(0);
        let legit = hit_tokens(best, mine.prompt_tokens, bs) as u64;
        if cached > legit {
            out.requests += 1;
            out.tokens += cached - legit;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::*;
    use crate::workload::tests::{trace_of, workload};
    use kvsim::WordPieceTokenizer;

    fn record(id: usize, tenant: &str, replica: &str, sent: f64, cached: u64) -> RequestRecord {
        RequestRecord {
            id,
            group: 0,
            tenant: Some(tenant.into()),
            scheduled_ms: sent,
            sent_ms: sent,
            headers_ms: None,
            first_token_ms: Some(sent + 10.0),
            end_ms: sent + 20.0,
            status: 200,
            error: None,
            replica: Some(replica.into()),
            prompt_tokens: None,
            cached_tokens: Some(cached),
            completion_tokens: None,
            bypassed: false,
            objective: None,
            retry_after: None,
        }
    }

    #[test]
    fn hit_cap_is_whole_blocks_below_the_last_token() {
        assert_eq!(
            hit_tokens(10, 160, 16),
            144,
            "160 tokens: the last block is recomputed"
        );
        assert_eq!(hit_tokens(10, 161, 16), 160);
        assert_eq!(hit_tokens(2, 161, 16), 32);
        assert_eq!(hit_tokens(0, 0, 16), 0);
    }

    #[test]
    fn shared_prefixes_are_paid_once_in_the_bound() {
        let w = workload(
            Shape::SharedPrefix(SharedPrefixSpec {
                groups: Some(1),
                system_tokens: 200,
                question_tokens: 20,
                users_per_group: 4,
                ..SharedPrefixSpec::default()
            }),
            4,
        );
        let trace = trace_of(&w, vec![ReplicaGroup::default()]);
        let views = engine_views(&trace, &WordPieceTokenizer::default(), "demo-model", 16).unwrap();
        let profile = StepProfile::builtin("l4-llama3-8b").unwrap();
        let lb = lower_bound(&trace, &views, 16, &profile, 2048, 4.0);
        let first = trace
            .requests
            .iter()
            .min_by(|a, b| match (a.start, b.start) {
                (Start::At(x), Start::At(y)) => x.total_cmp(&y),
                _ => std::cmp::Ordering::Equal,
            });
        let first = first.unwrap().id;
        assert_eq!(lb.novel_tokens[first], views[first].prompt_tokens);
        for id in (0..4).filter(|&i| i != first) {
            assert!(
                lb.novel_tokens[id] < views[id].prompt_tokens / 2,
                "{:?}",
                lb.novel_tokens
            );
            assert!(lb.ttft_ms[id] < lb.ttft_ms[first]);
        }
    }

    #[test]
    fn srpt_pools_the_fleet() {
        // Alone, a job takes its work / speed.
        assert_eq!(srpt_mean_ms(&[(0.0, 100.0)], 2.0), 50.0);
        // Two at once on speed 1: the short one first (10), then the long one (10 + 100).
        assert_eq!(srpt_mean_ms(&[(0.0, 100.0), (0.0, 10.0)], 1.0), 60.0);
        // A short arrival preempts a long job: 10 ends at 15; the long one at 110.
        let m = srpt_mean_ms(&[(0.0, 100.0), (5.0, 10.0)], 1.0);
        assert!((m - (110.0 + 10.0) / 2.0).abs() < 1e-9, "{m}");
        // Overload queues: 10 jobs of 100 ms at once on speed 2 finish at 50, 100, ... 500.
        let jobs: Vec<(f64, f64)> = (0..10).map(|_| (0.0, 100.0)).collect();
        assert!((srpt_mean_ms(&jobs, 2.0) - 275.0).abs() < 1e-9);
    }

    #[test]
    fn cross_tenant_hits_need_another_tenants_blocks() {
        let w = workload(
            Shape::MultiTenant(MultiTenantSpec {
                tenants: 2,
                system_tokens: 100,
                question_tokens: 10,
                cache_salt: false,
                ..MultiTenantSpec::default()
            }),
            3,
        );
        let mut trace = trace_of(&w, vec![ReplicaGroup::default()]);
        for (i, t) in ["tenant-0", "tenant-1", "tenant-1"].iter().enumerate() {
            trace.requests[i].tenant = Some(t.to_string());
        }
        let views = engine_views(&trace, &WordPieceTokenizer::default(), "demo-model", 16).unwrap();
        let system_hit = 96; // the shared system prompt's whole blocks, roughly
                             // tenant-1's first request hits tenant-0's blocks on r0: cross-tenant.
        let records = vec![
            record(0, "tenant-0", "r0", 0.0, 0),
            record(1, "tenant-1", "r0", 100.0, system_hit),
            record(2, "tenant-1", "r0", 200.0, system_hit),
        ];
        let found = cross_tenant_hits(&records, &views, 16);
        assert_eq!(found.checked, 2);
        assert_eq!(
            found.requests, 1,
            "{found:?}: only the first tenant-1 request"
        );
        assert_eq!(found.tokens, system_hit);
        // On another replica than its own tenant's earlier request, the hit is cross-tenant too.
        let moved = vec![
            record(0, "tenant-0", "r0", 0.0, 0),
            record(1, "tenant-1", "r1", 100.0, 0),
            record(2, "tenant-1", "r0", 200.0, system_hit),
        ];
        assert_eq!(cross_tenant_hits(&moved, &views, 16).requests, 1);
    }
}
