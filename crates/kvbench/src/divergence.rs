//! Several routers behind one Envoy each see only their own decisions (and, with KV events,
//! the engines' caches). This measures how much that costs in decisions: the share of one
//! instance's decisions that a peer instance's recent decisions would plausibly have changed.
//!
//! A decision of request `r` on instance `A` (pick `p`, believed matched tokens `m(e)` per
//! candidate, all from `A`'s recorded explanation) counts as **changed** when some request `q`
//! decided by another instance in the `window_ms` (simulated) before `r` was sent went to an
//! endpoint `e != p`, shares with `r` a prompt prefix `s` (whole engine blocks, from the
//! bench's own tokenization) longer than `m(p)` by at least a block, and `A` believed `e` held
//! less than `s - block`: `A` did not know of a longer cached prefix elsewhere that the peer had
//! just put there. It is an estimate of the information a shared view would add, not a replay
//! of the policy: a load-aware policy might still have kept `p`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::client::RequestRecord;
use super::oracle::EngineView;

/// The measure for one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Divergence {
    /// Router instances.
    pub routers: usize,
    /// Decisions matched to trace requests, per instance.
    pub per_router: Vec<usize>,
    /// Recorded decisions that could not be matched to a trace request.
    pub unmatched: usize,
    /// Matched decisions a peer's recent decisions would have changed.
    pub changed: usize,
    /// `changed` over all matched decisions.
    pub share: f64,
    /// The look-back window, simulated ms.
    pub window_ms: f64,
}

/// One recorded decision, reduced.
#[derive(Debug, Clone)]
pub struct Decision {
    /// The instance that made it.
    pub router: usize,
    /// Trace request id.
    pub id: usize,
    /// Picked endpoint (`ip:port`).
    pub pick: String,
    /// Believed matched prompt tokens per candidate endpoint.
    pub matched: HashMap<String, u64>,
}

/// Reduces an explanation (`/debug/decisions/{id}` JSON) of request id `rid`; `None` when it
/// is not `<prefix><trace id>`.
pub fn parse(router: usize, rid: &str, prefix: &str, e: &serde_json::Value) -> Option<Decision> {
    let id = rid.strip_prefix(prefix)?.parse().ok()?;
    let pick = e["pick"].as_str()?.to_string();
    let matched = e["candidates"]
        .as_array()?
        .iter()
        .filter_map(|c| {
            Some((
                c["endpoint"].as_str()?.to_string(),
                c["matched_tokens"].as_u64()?,
            ))
        })
        .collect();
    Some(Decision {
        router,
        id,
        pick,
        matched,
    })
}

fn shared_tokens(a: &EngineView, b: &EngineView, bs: usize) -> u64 {
    let blocks = |v: &EngineView| (v.prompt_tokens / bs).min(v.blocks.len());
    let n = a.blocks[..blocks(a)]
        .iter()
        .zip(&b.blocks[..blocks(b)])
        .take_while(|(x, y)| x == y)
        .count();
    (n * bs) as u64
}

/// Computes the measure over `decisions` of `routers` instances.
pub fn measure(
    routers: usize,
    decisions: &[Decision],
    unmatched: usize,
    records: &[RequestRecord],
    views: &[EngineView],
    block_size: u32,
    window_ms: f64,
) -> Divergence {
    let bs = block_size.max(1) as usize;
    let sent: HashMap<usize, f64> = records.iter().map(|r| (r.id, r.sent_ms)).collect();
    let mut per_router = vec![0; routers];
    let mut changed = 0;
    let mut total = 0;
    for d in decisions {
        let (Some(&t), Some(v)) = (sent.get(&d.id), views.get(d.id)) else {
            continue;
        };
        total += 1;
        if let Some(n) = per_router.get_mut(d.router) {
            *n += 1;
        }
        let held = |e: &str| d.matched.get(e).copied().unwrap_or(0);
        let mine = held(&d.pick);
        let hit = decisions.iter().any(|q| {
            if q.router == d.router || q.pick == d.pick || q.id == d.id {
                return false;
            }
            let (Some(&tq), Some(vq)) = (sent.get(&q.id), views.get(q.id)) else {
                return false;
            };
            if !(tq < t && t - tq <= window_ms) {
                return false;
            }
            let s = shared_tokens(v, vq, bs);
            s >= mine + bs as u64 && held(&q.pick) + (bs as u64) < s
        });
        changed += usize::from(hit);
    }
    Divergence {
        routers,
        per_router,
        unmatched,
        changed,
        share: changed as f64 / total.max(1) as f64,
        window_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(blocks: &[u64]) -> EngineView {
        EngineView {
            prompt_tokens: blocks.len() * 16 + 1,
            blocks: blocks.to_vec(),
        }
    }

    fn rec(id: usize, sent: f64) -> RequestRecord {
        RequestRecord {
            id,
            group: 0,
            tenant: None,
            scheduled_ms: sent,
            sent_ms: sent,
            headers_ms: None,
            first_token_ms: Some(sent + 1.0),
            end_ms: sent + 2.0,
            status: 200,
            error: None,
            replica: None,
            prompt_tokens: None,
            cached_tokens: None,
            completion_tokens: None,
            bypassed: false,
            objective: None,
            retry_after: None,
        }
    }

    fn dec(router: usize, id: usize, pick: &str, matched: &[(&str, u64)]) -> Decision {
        Decision {
            router,
            id,
            pick: pick.into(),
            matched: matched.iter().map(|(e, m)| (e.to_string(), *m)).collect(),
        }
    }

    #[test]
    fn a_peer_that_just_cached_a_longer_prefix_elsewhere_changes_a_decision() {
        let views = vec![view(&[1, 2, 3, 4]), view(&[1, 2, 3, 9]), view(&[7, 8])];
        let records = vec![rec(0, 0.0), rec(1, 100.0), rec(2, 200.0)];
        let e = serde_json::json!({"pick": "a:1", "candidates": [
            {"endpoint": "a:1", "matched_tokens": 0}, {"endpoint": "b:1", "matched_tokens": 0}]});
        let parsed = parse(1, "kvb-0-1", "kvb-0-", &e).unwrap();
        assert_eq!((parsed.id, parsed.pick.as_str()), (1, "a:1"));
        assert!(parse(1, "other", "kvb-0-", &e).is_none());
        let decisions = vec![
            // Router 0 sent request 0 to b.
            dec(0, 0, "b:1", &[("a:1", 0), ("b:1", 0)]),
            // Router 1, not knowing, sent request 1 (sharing 3 blocks) to a.
            dec(1, 1, "a:1", &[("a:1", 0), ("b:1", 0)]),
            // Request 2 shares nothing.
            dec(1, 2, "a:1", &[("a:1", 0), ("b:1", 0)]),
        ];
        let d = measure(2, &decisions, 0, &records, &views, 16, 1000.0);
        assert_eq!((d.changed, d.per_router.clone()), (1, vec![1, 2]), "{d:?}");
        // Had router 1 known (b believed to hold the prefix), nothing changes.
        let mut knew = decisions.clone();
        knew[1] = dec(1, 1, "b:1", &[("a:1", 0), ("b:1", 48)]);
        assert_eq!(
            measure(2, &knew, 0, &records, &views, 16, 1000.0).changed,
            0
        );
        // Outside the window it does not count.
        assert_eq!(
            measure(2, &decisions, 0, &records, &views, 16, 50.0).changed,
            0
        );
    }
}
