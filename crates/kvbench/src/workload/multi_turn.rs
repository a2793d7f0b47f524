//! `multi_turn`: conversations that grow turn by turn. Conversations start as a Poisson process
//! (at `rate / turns`, so the request rate averages `rate`); each later turn is sent a think time
//! after the previous turn's answer ended, carrying the whole conversation so far. The
//! assistant's answers are the simulator's deterministic filler text, so the trace is fixed in
//! advance and identical for every policy.

use std::sync::Arc;

use super::{system, user, Arrivals, GenContext, Message, Start, Trace, TraceRequest};
use crate::plan::{MultiTurnSpec, WorkloadSpec};
use crate::BenchError;

pub(super) fn generate(
    s: &MultiTurnSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let shared = if s.system_tokens > 0 {
        Some(cx.text(s.system_tokens)?)
    } else {
        None
    };
    let turns = s.turns;
    let conversations = match w.requests {
        Some(n) => n.div_ceil(turns),
        None => s.conversations,
    };
    // Conversation starts at rate/turns: stretch the Poisson gaps by `turns`.
    let mut starts: Vec<f64> = (0..conversations)
        .map(|_| arrivals.next_ms() * turns as f64)
        .collect();
    starts.sort_by(f64::total_cmp);
    let mut requests: Vec<TraceRequest> = Vec::new();
    for (c, start_ms) in starts.into_iter().enumerate() {
        let mut history: Vec<Message> = shared.iter().map(system).collect();
        let mut prev: Option<usize> = None;
        for _ in 0..turns {
            history.push(user(cx.text(s.user_tokens)?));
            let id = requests.len();
            let max_tokens = cx.output();
            let start = match prev {
                None => Start::At(start_ms),
                Some(p) => Start::After {
                    prev: p,
                    think_ms: arrivals.exponential(s.think_s * 1000.0),
                },
            };
            requests.push(TraceRequest {
                id,
                start,
                messages: history.clone(),
                max_tokens,
                tenant: None,
                cache_salt: None,
                group: c,
                bypass: false,
                objective: None,
            });
            // The simulator's deterministic answer of this length: the next turn resends it.
            history.push(Message {
                role: "assistant",
                content: Arc::from(kvsim::openai::filler_text(max_tokens)),
            });
            prev = Some(id);
        }
    }
    if let Some(n) = w.requests {
        requests.truncate(n);
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
            "{conversations} conversations x {turns} turns; {} user tokens a turn, mean think {} s",
            s.user_tokens, s.think_s
        )],
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::*;
    use crate::workload::tests::{trace_of, workload};
    use crate::workload::Start;

    #[test]
    fn turns_extend_the_conversation_and_wait_for_the_previous_one() {
        let w = workload(
            Shape::MultiTurn(MultiTurnSpec {
                conversations: 3,
                turns: 3,
                system_tokens: 20,
                user_tokens: 10,
                think_s: 1.0,
            }),
            9,
        );
        let t = trace_of(&w, vec![ReplicaGroup::default()]);
        assert_eq!(t.requests.len(), 9);
        for r in &t.requests {
            if let Start::After { prev, think_ms } = r.start {
                let p = &t.requests[prev];
                assert_eq!(p.group, r.group);
                assert!(think_ms >= 0.0);
                assert_eq!(&r.messages[..p.messages.len()], &p.messages[..]);
                assert_eq!(r.messages.len(), p.messages.len() + 2, "answer + question");
                assert_eq!(r.messages[p.messages.len()].role, "assistant");
            }
        }
        let firsts = t
            .requests
            .iter()
            .filter(|r| matches!(r.start, Start::At(_)))
            .count();
        assert_eq!(firsts, 3);
    }
}
