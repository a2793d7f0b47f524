//! `multi_tenant`: every tenant sends the same system prompt. Tenants are named in a header
//! (kvrouter's `tenancy.header`) and, unless disabled as a negative control, each carries its own
//! vLLM `cache_salt`, so engines must never let one tenant hit another's blocks.

use rand::Rng;

use super::{system, user, Arrivals, GenContext, Start, Trace, TraceRequest};
use crate::plan::{MultiTenantSpec, WorkloadSpec};
use crate::BenchError;

/// Requests when the workload names no count.
const DEFAULT_REQUESTS: usize = 240;

pub(super) fn generate(
    s: &MultiTenantSpec,
    w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
    arrivals: &mut Arrivals,
) -> Result<Trace, BenchError> {
    let prompt = cx.text(s.system_tokens)?;
    let total = w.requests.unwrap_or(DEFAULT_REQUESTS);
    let mut requests = Vec::with_capacity(total);
    for id in 0..total {
        let tenant = cx.rng.random_range(0..s.tenants);
        requests.push(TraceRequest {
            id,
            start: Start::At(arrivals.next_ms()),
            messages: vec![system(&prompt), user(cx.text(s.question_tokens)?)],
            max_tokens: cx.output(),
            tenant: Some(format!("tenant-{tenant}")),
            cache_salt: s.cache_salt.then(|| format!("salt-tenant-{tenant}")),
            group: tenant,
            bypass: false,
            objective: None,
        });
    }
    Ok(Trace {
        workload: String::new(),
        rate: 0.0,
        requests,
        tenant_header: Some(s.tenant_header.clone()),
        objective_header: None,
        seed: 0,
        expected_shared_tokens: None,
        notes: vec![format!(
            "{} tenants share one {}-token system prompt; cache_salt {}",
            s.tenants,
            s.system_tokens,
            if s.cache_salt {
                "per tenant"
            } else {
                "OFF (negative control)"
            }
        )],
    })
}
