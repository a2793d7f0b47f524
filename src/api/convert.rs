//! Explanations and endpoint views to and from their `kvrouter.v1` messages: the same fields as
//! the HTTP admin's JSON.

use std::collections::HashMap;
use std::time::Duration;

use super::pb;
use crate::router::{AdminView, CandidateRow, DecisionRecord, Explanation};

/// An explanation as its message.
pub fn explanation_to_pb(e: &Explanation) -> pb::Explanation {
    pb::Explanation {
        model: e.model.clone(),
        adapter: e.adapter.clone(),
        prompt_tokens: e.prompt_tokens,
        exact: e.exact,
        fallback: e.fallback.clone(),
        prefix_blocks: e.prefix_blocks as u64,
        block_size_tokens: e.block_size_tokens,
        policy: e.policy.clone(),
        pick: e.pick.clone(),
        fallbacks: e.fallbacks.clone(),
        candidates: e.candidates.iter().map(candidate_to_pb).collect(),
        stale_signals: e.stale_signals,
        unhealthy: e.unhealthy.clone(),
    }
}

fn candidate_to_pb(c: &CandidateRow) -> pb::CandidateRow {
    pb::CandidateRow {
        endpoint: c.endpoint.clone(),
        rank: c.rank as u64,
        matched_tokens: c.matched_tokens,
        confirmed_tokens: c.confirmed_tokens,
        in_flight_requests: c.in_flight_requests,
        in_flight_prefill_tokens: c.in_flight_prefill_tokens,
        prefill_tokens_per_s: c.prefill_tokens_per_s,
        prefill_speed_source: c.prefill_speed_source.clone(),
        engine_signal: c.engine_signal.clone(),
        engine_age_ms: c.engine_age_ms,
        engine_waiting_requests: c.engine_waiting_requests,
        engine_running_requests: c.engine_running_requests,
        engine_kv_cache_usage: c.engine_kv_cache_usage,
        ttft_residual_ms: c.ttft_residual_ms,
        trial: c.trial,
        cache_source: c.cache_source.clone(),
        cache_reason: c.cache_reason.clone(),
        predicted_ttft_ms: c.predicted_ttft_ms,
        score: c.score,
        held_tokens: c.held_tokens,
        cpu_tokens: c.cpu_tokens,
        slower_tier_tokens: c.slower_tier_tokens,
        tier_load_ms: c.tier_load_ms,
        cpu_tier_gb_per_s: c.cpu_tier_gb_per_s,
        cpu_tier_bandwidth_source: c.cpu_tier_bandwidth_source.clone(),
    }
}

/// An explanation from its message (the CLI prints it as the HTTP admin's JSON and table).
pub fn explanation_from_pb(e: pb::Explanation) -> Explanation {
    Explanation {
        model: e.model,
        adapter: e.adapter,
        prompt_tokens: e.prompt_tokens,
        exact: e.exact,
        fallback: e.fallback,
        prefix_blocks: e.prefix_blocks as usize,
        block_size_tokens: e.block_size_tokens,
        policy: e.policy,
        pick: e.pick,
        fallbacks: e.fallbacks,
        candidates: e
            .candidates
            .into_iter()
            .map(|c| CandidateRow {
                endpoint: c.endpoint,
                rank: c.rank as usize,
                matched_tokens: c.matched_tokens,
                confirmed_tokens: c.confirmed_tokens,
                in_flight_requests: c.in_flight_requests,
                in_flight_prefill_tokens: c.in_flight_prefill_tokens,
                prefill_tokens_per_s: c.prefill_tokens_per_s,
                prefill_speed_source: c.prefill_speed_source,
                engine_signal: c.engine_signal,
                engine_age_ms: c.engine_age_ms,
                engine_waiting_requests: c.engine_waiting_requests,
                engine_running_requests: c.engine_running_requests,
                engine_kv_cache_usage: c.engine_kv_cache_usage,
                ttft_residual_ms: c.ttft_residual_ms,
                trial: c.trial,
                cache_source: c.cache_source,
                cache_reason: c.cache_reason,
                predicted_ttft_ms: c.predicted_ttft_ms,
                score: c.score,
                held_tokens: c.held_tokens,
                cpu_tokens: c.cpu_tokens,
                slower_tier_tokens: c.slower_tier_tokens,
                tier_load_ms: c.tier_load_ms,
                cpu_tier_gb_per_s: c.cpu_tier_gb_per_s,
                cpu_tier_bandwidth_source: c.cpu_tier_bandwidth_source,
            })
            .collect(),
        stale_signals: e.stale_signals,
        unhealthy: e.unhealthy,
    }
}

/// A decision record as its message; `dropped_before` records were lost just before it.
pub(super) fn record_to_pb(r: &DecisionRecord, dropped_before: u64) -> pb::DecisionRecord {
    let (outcome, reason, explanation) = match &r.outcome {
        Ok(e) => ("routed", String::new(), Some(explanation_to_pb(e))),
        Err(e @ crate::router::RouteError::UnknownModel { .. }) => {
            ("unknown_model", e.to_string(), None)
        }
        Err(e @ crate::router::RouteError::NoEndpoint { .. }) => {
            ("no_endpoint", e.to_string(), None)
        }
        Err(e @ crate::router::RouteError::TenantNotAllowed { .. }) => {
            ("tenant_not_allowed", e.to_string(), None)
        }
        Err(e @ crate::router::RouteError::NoLabeledEndpoint { .. }) => {
            ("no_labeled_endpoint", e.to_string(), None)
        }
    };
    pb::DecisionRecord {
        request_id: r.request_id.clone(),
        unix_time_ms: r.unix_time_ms,
        outcome: outcome.into(),
        model: r.model.clone(),
        decision_us: r.took.as_secs_f64() * 1e6,
        reason,
        dropped_before,
        explanation,
    }
}

/// The endpoint set as `GetEndpoints` answers it (the fields of `GET /debug/endpoints`).
pub(super) fn endpoints_to_pb(view: &AdminView) -> pb::GetEndpointsResponse {
    let set = view.endpoints();
    let state = view.snapshot();
    let config = &state.config;
    let now = tokio::time::Instant::now();
    let staleness = Duration::from_millis(config.load.scrape.staleness_ms);
    let events: HashMap<_, _> = view.kv_events().into_iter().map(|s| (s.id, s)).collect();
    let endpoints = set
        .all()
        .iter()
        .map(|ep| {
            let engine = ep.load.engine.last();
            let load = ep.load.snapshot();
            let learned = ep.load.learned.snapshot(&config.load.learning, now);
            let health = ep.health.snapshot(now, &config.health);
            pb::EndpointStatus {
                address: ep.address_str.to_string(),
                pool: ep.pool.to_string(),
                source: ep.source.to_string(),
                engine_kind: ep.engine.as_str().into(),
                models: ep.models.clone(),
                adapters: ep.adapters.clone(),
                weight: ep.weight,
                max_in_flight: ep.max_in_flight.map_or(0, u64::from),
                draining: ep.draining,
                load: Some(pb::Load {
                    in_flight_requests: load.in_flight_requests,
                    in_flight_prefill_tokens: load.in_flight_prefill_tokens,
                    in_flight_prefilling: load.in_flight_prefilling,
                    requests_total: load.requests_total,
                }),
                engine_signal: ep.load.engine.signal(now, staleness).as_str().into(),
                engine: engine.as_deref().map(|s| pb::EngineSample {
                    waiting_requests: s.waiting_requests,
                    running_requests: s.running_requests,
                    kv_cache_usage: s.kv_cache_usage,
                    capacity_tokens: s.capacity_tokens,
                    block_size_tokens: s.block_size_tokens,
                }),
                engine_age_ms: engine
                    .map(|s| now.saturating_duration_since(s.scraped_at).as_millis() as u64),
                learned: Some(pb::Learned {
                    prefill_tokens_per_s: learned.prefill_tokens_per_s,
                    speed_samples: learned.speed_samples,
                    ttft_residual_ms: learned.ttft_residual_ms,
                    residual_samples: learned.residual_samples,
                }),
                health: Some(pb::Health {
                    probe_up: health.probe_up,
                    scrape_up: health.scrape_up,
                    breaker: health.breaker.as_str().into(),
                    routable: health.routable,
                }),
                kv_events: events.get(&ep.id).map(|s| pb::KvEventStream {
                    state: s.state.label().into(),
                    source: s.state.source().into(),
                    reason: s.state.reason().map(|r| r.as_str().to_string()),
                    attach: s.attach.kind().into(),
                    topic: s.topic.clone(),
                    messages: s.counters.messages,
                    events: s.counters.events,
                    gaps: s.counters.gaps,
                    restarts: s.counters.restarts,
                    engine_blocks: s.engine_blocks as u64,
                    engine_block_size_tokens: s.engine_block_size_tokens,
                }),
            }
        })
        .collect();
    pb::GetEndpointsResponse {
        version: set.version,
        policy: config.policy.name.as_str().into(),
        endpoints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explanation_survives_the_round_trip() {
        let e = Explanation {
            model: "m".into(),
            adapter: Some("a".into()),
            prompt_tokens: 40,
            exact: false,
            fallback: Some("no-tokenizer".into()),
            prefix_blocks: 2,
            block_size_tokens: 16,
            policy: "predicted-ttft".into(),
            pick: "127.0.0.1:1".into(),
            fallbacks: vec!["127.0.0.1:2".into()],
            candidates: vec![CandidateRow {
                endpoint: "127.0.0.1:1".into(),
                rank: 0,
                matched_tokens: 32,
                confirmed_tokens: 16,
                in_flight_requests: 1,
                in_flight_prefill_tokens: 8,
                prefill_tokens_per_s: 1000.0,
                prefill_speed_source: "default".into(),
                engine_signal: "fresh".into(),
                engine_age_ms: Some(5),
                engine_waiting_requests: Some(0),
                engine_running_requests: Some(1),
                engine_kv_cache_usage: Some(0.5),
                ttft_residual_ms: 0.0,
                trial: false,
                cache_source: "events".into(),
                cache_reason: None,
                predicted_ttft_ms: Some(12.5),
                score: None,
                held_tokens: 48,
                cpu_tokens: 16,
                slower_tier_tokens: 0,
                tier_load_ms: 1.25,
                cpu_tier_gb_per_s: 20.0,
                cpu_tier_bandwidth_source: "configured".into(),
            }],
            stale_signals: true,
            unhealthy: vec!["127.0.0.1:3".into()],
        };
        assert_eq!(explanation_from_pb(explanation_to_pb(&e)), e);
    }
}
