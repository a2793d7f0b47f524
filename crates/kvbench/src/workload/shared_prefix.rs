//! `shared_prefix`: llm-d's shared-prefix benchmark shape. G groups, each with an S-token system
//! prompt; U users per group each ask Q-token questions. Unless G is given, it is chosen so the
//! groups' system prompts fill `kv_occupancy` (default 73 %) of the fleet's KV, counted in the
//! engine's own tokens: a policy that copies every prefix to every replica must then evict.

use rand::seq::SliceRandom;

use super::{system, user, Arrivals, GenContext, Start, Trace, TraceRequest};
use crate::plan::{SharedPrefixSpec, WorkloadSpec};
use crate::BenchError;

pub(super) fn generate(
    s: &SharedPrefixSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let mut prompts = Vec::new();
    let mut prefix_tokens = 0u64;
    let target = (cx.fleet_kv_tokens as f64 * s.kv_occupancy) as u64;
    loop {
        let enough = match s.groups {
            Some(g) => prompts.len() >= g,
            None => !prompts.is_empty() && prefix_tokens >= target,
        };
        if enough || prompts.len() >= 10_000 {
            break;
        }
        let text = cx.text(s.system_tokens)?;
        prefix_tokens += cx.engine_tokens(&[system(&text)])? as u64;
        prompts.push(text);
    }
    let groups = prompts.len();
    // One question per user per round, rounds repeated until `requests`, shuffled per round.
    let per_round = groups * s.users_per_group;
    let total = w.requests.unwrap_or(per_round);
    let mut order: Vec<(usize, usize)> = Vec::with_capacity(total);
    while order.len() < total {
        let mut round: Vec<(usize, usize)> = (0..groups)
            .flat_map(|g| (0..s.users_per_group).map(move |u| (g, u)))
            .collect();
        round.shuffle(&mut cx.rng);
        order.extend(round);
    }
    order.truncate(total);
    let mut requests = Vec::with_capacity(total);
    for (id, (g, _user)) in order.into_iter().enumerate() {
        requests.push(TraceRequest {
            id,
            start: Start::At(arrivals.next_ms()),
            messages: vec![system(&prompts[g]), user(cx.text(s.question_tokens)?)],
            max_tokens: cx.output(),
            tenant: None,
            cache_salt: None,
            group: g,
            bypass: false,
            objective: None,
        });
    }
    Ok(Trace {
        workload: String::new(),
        rate: 0.0,
        requests,
        tenant_header: None,
        objective_header: None,
        seed: 0,
        expected_shared_tokens: None,
        notes: vec![format!(
            "{groups} groups x {} users; system prompts: {prefix_tokens} engine tokens = {:.0}% of the \
             fleet's {} KV tokens",
            s.users_per_group,
            100.0 * prefix_tokens as f64 / cx.fleet_kv_tokens.max(1) as f64,
            cx.fleet_kv_tokens
        )],
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::*;
    use crate::workload::tests::{trace_of, workload};

    #[test]
    fn groups_fill_the_asked_share_of_kv() {
        let fleet = vec![ReplicaGroup {
            count: 2,
            num_gpu_blocks: Some(101),
            ..ReplicaGroup::default()
        }];
        // 2 x 100 blocks x 16 = 3200 KV tokens; 73% = 2336 tokens of ~100-token prompts.
        let w = workload(
            Shape::SharedPrefix(SharedPrefixSpec {
                system_tokens: 80,
                question_tokens: 10,
                users_per_group: 2,
                ..SharedPrefixSpec::default()
            }),
            60,
        );
        let t = trace_of(&w, fleet);
        let groups = t.requests.iter().map(|r| r.group).max().unwrap() + 1;
        assert!(
            (15..=35).contains(&groups),
            "{groups} groups; {:?}",
            t.notes
        );
        assert_eq!(t.requests.len(), 60);
        for r in &t.requests {
            let same = t
                .requests
                .iter()
                .find(|o| o.group == r.group && o.id != r.id);
            if let Some(o) = same {
                assert_eq!(
                    o.messages[0], r.messages[0],
                    "a group shares its system prompt"
                );
                assert_ne!(o.messages[1], r.messages[1], "questions differ");
            }
        }
    }
}
