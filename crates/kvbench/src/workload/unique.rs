//! `unique`: every prompt is new text (no sharing beyond the chat template's header). The case
//! where a cache-aware policy has nothing to gain and may lose to least-loaded.

use super::{user, Arrivals, GenContext, Start, Trace, TraceRequest};
use crate::plan::{UniqueSpec, WorkloadSpec};
use crate::BenchError;

/// Requests when the workload names no count.
const DEFAULT_REQUESTS: usize = 300;

pub(super) fn generate(
    s: &UniqueSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let total = w.requests.unwrap_or(DEFAULT_REQUESTS);
    let mut requests = Vec::with_capacity(total);
    for id in 0..total {
        requests.push(TraceRequest {
            id,
            start: Start::At(arrivals.next_ms()),
            messages: vec![user(cx.text(s.prompt_tokens)?)],
            max_tokens: cx.output(),
            tenant: None,
            cache_salt: None,
            group: id,
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
            "{total} unique prompts of {} tokens",
            s.prompt_tokens
        )],
    })
}
