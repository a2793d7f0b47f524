//! `hot_prefix`: prefixes drawn from a Zipf distribution, so one dominates; meant to run at high
//! load, where pure prefix affinity piles the hot prefix's traffic onto one replica.

use super::{system, user, Arrivals, GenContext, Start, Trace, TraceRequest, Zipf};
use crate::plan::{HotPrefixSpec, WorkloadSpec};
use crate::BenchError;

/// Requests when the workload names no count.
const DEFAULT_REQUESTS: usize = 300;

pub(super) fn generate(
    s: &HotPrefixSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let prefixes = (0..s.prefixes)
        .map(|_| cx.text(s.prefix_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let zipf = Zipf::new(s.prefixes, s.zipf_s);
    let total = w.requests.unwrap_or(DEFAULT_REQUESTS);
    let mut requests = Vec::with_capacity(total);
    for id in 0..total {
        let rank = zipf.sample(&mut cx.rng);
        requests.push(TraceRequest {
            id,
            start: Start::At(arrivals.next_ms()),
            messages: vec![system(&prefixes[rank]), user(cx.text(s.question_tokens)?)],
            max_tokens: cx.output(),
            tenant: None,
            cache_salt: None,
            group: rank,
            bypass: false,
            objective: None,
        });
    }
    let hot = requests.iter().filter(|r| r.group == 0).count();
    Ok(Trace {
        workload: String::new(),
        rate: 0.0,
        requests,
        tenant_header: None,
        objective_header: None,
        seed: 0,
        expected_shared_tokens: None,
        notes: vec![format!(
            "{} prefixes, Zipf s={}; the hot prefix has {hot} of {total} requests ({:.0}%)",
            s.prefixes,
            s.zipf_s,
            100.0 * hot as f64 / total.max(1) as f64
        )],
    })
}
