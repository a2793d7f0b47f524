//! Which endpoints serving a model a request may use at all, before health and load: tenants
//! confined to pools (`pools[].tenants`) and endpoint labels an objective requires
//! (`flow_control.objectives[].required_labels`).
//!
//! Both narrow the list a plan starts from, so the healthy candidates and the unhealthy
//! endpoints that fill a plan's fallback tail come from the narrowed list alike: a confined
//! request is never sent outside it, not even as a last resort.

use std::sync::Arc;

use super::state::RouterState;
use super::{RouteContext, RouteError};
use crate::config::UnmatchedLabels;
use crate::discovery::Endpoint;

/// The endpoints of `serving` that `ctx`'s request may use at all, before health: those of pools
/// its tenant may use (`pools[].tenants`), then those carrying every label its objective
/// requires. Unhealthy endpoints that fill a plan's fallback tail come from this list too, so a
/// confined request never leaves it.
pub(super) fn confine<'e>(
    state: &RouterState,
    serving: Vec<&'e Arc<Endpoint>>,
    model: &str,
    ctx: RouteContext<'_>,
) -> Result<Vec<&'e Arc<Endpoint>>, RouteError> {
    let before = serving.len();
    // Endpoints come grouped by pool, a pool's endpoints share its name ([`Endpoint::in_pool`])
    // and a pool has few names: one map lookup per run of one pool, not per endpoint (the
    // lookup hashed the pool's name for each of 256 candidates: 12% of a decision,
    // `benches/decision.rs`), and the list is left as it is when every run is admitted (the
    // common case: a pointer compare per endpoint). Runs refused are cut out in place.
    let mut admitted = serving;
    let (mut known, mut kept, mut start) = (false, 0, 0);
    while start < admitted.len() {
        let first: &'e Arc<Endpoint> = admitted[start];
        let pool = &first.pool;
        let end = start
            + admitted[start..]
                .iter()
                .position(|ep| !ep.in_pool(pool))
                .unwrap_or(admitted.len() - start);
        let admits = state.pool_admits(pool, ctx.tenant);
        known |= admits || state.knows_pool(pool);
        if admits {
            if kept != start {
                admitted.copy_within(start..end, kept);
            }
            kept += end - start;
        }
        start = end;
    }
    admitted.truncate(kept);
    if admitted.is_empty() && before > 0 {
        if !known {
            // Only pools a reload added since the request's snapshot: a retry decides under
            // the new config.
            return Err(RouteError::NoEndpoint {
                model: model.to_string(),
                reason: "the endpoints serving it changed while the request was read",
            });
        }
        return Err(RouteError::TenantNotAllowed {
            model: model.to_string(),
        });
    }
    let Some(objective) = state
        .config
        .flow_control
        .objective(ctx.objective)
        .filter(|o| !o.required_labels.is_empty())
    else {
        return Ok(admitted);
    };
    let labeled: Vec<&Arc<Endpoint>> = admitted
        .iter()
        .copied()
        .filter(|ep| {
            objective
                .required_labels
                .iter()
                .all(|(k, v)| ep.labels.get(k) == Some(v))
        })
        .collect();
    if !labeled.is_empty() || admitted.is_empty() {
        return Ok(labeled);
    }
    match objective.unmatched {
        UnmatchedLabels::Any => Ok(admitted),
        UnmatchedLabels::Reject => Err(RouteError::NoLabeledEndpoint {
            model: model.to_string(),
            objective: objective.name.clone(),
        }),
    }
}

#[cfg(test)]
#[path = "confine_tests.rs"]
mod tests;
