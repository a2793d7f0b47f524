//! `flow_mix`: unique prompts from several tenants at different rates (one may flood), each
//! request with an objective (a priority) drawn independently of its tenant: the traffic flow
//! control is judged on. Unique prompts keep the cache out of it, so the fleet's capacity is
//! its prefill and decode speed alone.

use rand::rngs::StdRng;
use rand::Rng;

use super::{user, Arrivals, GenContext, Start, Trace, TraceRequest};
use crate::plan::{FlowMixSpec, Share, WorkloadSpec};
use crate::BenchError;

/// Requests when the workload names no count.
const DEFAULT_REQUESTS: usize = 300;

pub(super) fn generate(
    s: &FlowMixSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let total = w.requests.unwrap_or(DEFAULT_REQUESTS);
    let mut requests = Vec::with_capacity(total);
    for id in 0..total {
        let tenant = pick(&s.tenants, &mut cx.rng);
        let objective = pick(&s.objectives, &mut cx.rng);
        requests.push(TraceRequest {
            id,
            start: Start::At(arrivals.next_ms()),
            messages: vec![user(cx.text(s.prompt_tokens)?)],
            max_tokens: cx.output(),
            tenant: Some(s.tenants[tenant].name.clone()),
            cache_salt: None,
            group: tenant,
            bypass: false,
            objective: Some(s.objectives[objective].name.clone()),
        });
    }
    let share = |xs: &[Share]| {
        let sum: f64 = xs.iter().map(|x| x.weight).sum();
        xs.iter()
            .map(|x| format!("{} {:.0}%", x.name, 100.0 * x.weight / sum))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok(Trace {
        workload: String::new(),
        rate: 0.0,
        requests,
        tenant_header: Some(s.tenant_header.clone()),
        objective_header: Some(s.objective_header.clone()),
        seed: 0,
        expected_shared_tokens: None,
        notes: vec![format!(
            "{total} unique prompts of {} tokens; tenants {}; objectives {}",
            s.prompt_tokens,
            share(&s.tenants),
            share(&s.objectives)
        )],
    })
}

/// An index of `shares` drawn by weight.
fn pick(shares: &[Share], rng: &mut StdRng) -> usize {
    let sum: f64 = shares.iter().map(|x| x.weight).sum();
    let mut x = rng.random_range(0.0..sum);
    for (i, s) in shares.iter().enumerate() {
        if x < s.weight {
            return i;
        }
        x -= s.weight;
    }
    shares.len() - 1
}

#[cfg(test)]
mod tests {
    use crate::plan::{FlowMixSpec, ReplicaGroup, Shape};
    use crate::workload::tests::{trace_of, workload};

    #[test]
    fn tenants_and_objectives_follow_their_weights() {
        let w = workload(
            Shape::FlowMix(FlowMixSpec {
                prompt_tokens: 20,
                ..FlowMixSpec::default()
            }),
            1000,
        );
        let t = trace_of(&w, vec![ReplicaGroup::default()]);
        let count = |f: &dyn Fn(&crate::workload::TraceRequest) -> bool| {
            t.requests.iter().filter(|r| f(r)).count() as f64 / 1000.0
        };
        let flood = count(&|r| r.tenant.as_deref() == Some("flood"));
        let critical = count(&|r| r.objective.as_deref() == Some("critical"));
        assert!((flood - 0.8).abs() < 0.05, "{flood}");
        assert!((critical - 0.25).abs() < 0.05, "{critical}");
        assert_eq!(t.tenant_header.as_deref(), Some("x-tenant-id"));
        assert_eq!(
            t.objective_header.as_deref(),
            Some("x-llm-d-inference-objective")
        );
        assert!(t.requests.iter().all(|r| r.group < 2));
    }
}
