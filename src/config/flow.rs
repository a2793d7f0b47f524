//! The `flow_control` section: the router's admission queue (see `crate::flow`).

use serde::{Deserialize, Serialize};

use super::validate::{is_header_name, Errors};

/// Holding requests in the router while every candidate is saturated: per-model bounded queues,
/// priority bands from the objective header, token-weighted fairness between flows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlConfig {
    /// Queue requests in the router when no candidate has room. Default false: without it a
    /// request goes to the least bad endpoint at once and waits in that engine's queue.
    pub enabled: bool,
    /// Requests queued per model, over all priorities and flows, before more are refused (or a
    /// lower-priority one is displaced). Must be > 0. Default 1000.
    pub max_queue_requests: usize,
    /// Request body bytes queued per model before more are refused (or displaced). Must be > 0.
    /// Default 256 MiB.
    pub max_queue_bytes: u64,
    /// Longest a request waits in the queue, in ms; then it is answered 429 (sheddable) or 503.
    /// Envoy's ext_proc `message_timeout` must exceed it (`kvrouter envoy-config` sizes it).
    /// Must be > 0. Default 5000.
    pub max_wait_ms: u64,
    /// How often queued requests are re-checked against the candidates' load, in ms (arrivals
    /// and dispatches also trigger a check). 1..=1000. Default 5.
    pub dispatch_interval_ms: u64,
    /// Seconds in the `retry-after` header of a 429 or 503 from the queue. Default 1.
    pub retry_after_s: u32,
    /// When a candidate endpoint has room.
    pub room: RoomConfig,
    /// Request header naming the objective (looked up in `objectives`). Also read:
    /// `x-gateway-inference-objective` (the Inference Extension's older name).
    /// Default `x-llm-d-inference-objective`.
    pub objective_header: String,
    /// Objectives and their priorities. Default: none (every request has `default_priority`).
    pub objectives: Vec<ObjectiveConfig>,
    /// Priority of a request without a (known) objective. Default 0.
    pub default_priority: i32,
    /// Request header naming the request's flow for fairness, when the trusted tenancy header
    /// (`tenancy.header`) is not configured or absent. Default `x-llm-d-inference-fairness-id`.
    pub fairness_header: String,
    /// Order of a flow's requests within a priority band (the flow itself is chosen by
    /// fairness): `fcfs` (arrival) or `edf` (earliest deadline: arrival plus the objective's
    /// `ttft_target_ms`; requests without a target after those with one, in arrival order).
    /// Applies to requests that arrive after it is set. Default `fcfs`.
    pub ordering: QueueOrdering,
    /// Per-band exceptions to `ordering`. Default none.
    pub bands: Vec<BandConfig>,
}

/// Order within a flow of a priority band.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueOrdering {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Earliest deadline first (deadline: arrival plus the objective's `ttft_target_ms`).
    Edf,
}

/// The ordering of one priority band.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandConfig {
    /// The band's priority (an objective's `priority`, or `default_priority`). Required, unique.
    pub priority: i32,
    /// Its ordering. Default `fcfs`.
    pub ordering: QueueOrdering,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queue_requests: 1000,
            max_queue_bytes: 256 << 20,
            max_wait_ms: 5000,
            dispatch_interval_ms: 5,
            retry_after_s: 1,
            room: RoomConfig::default(),
            objective_header: "x-llm-d-inference-objective".to_string(),
            objectives: Vec::new(),
            default_priority: 0,
            fairness_header: "x-llm-d-inference-fairness-id".to_string(),
            ordering: QueueOrdering::Fcfs,
            bands: Vec::new(),
        }
    }
}

/// When an endpoint has room. Every threshold below applies in both modes (an endpoint over any
/// of them has none); `mode` says whether the predicted wait applies too. The model's queue
/// dispatches while the room left over all its healthy candidates exceeds what was admitted but
/// not yet routed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoomConfig {
    /// `predicted`: an endpoint also has room only while the time a request would wait there
    /// before its own prefill (the `predicted-ttft` cost model's queue wait: prefill tokens in
    /// flight over the endpoint's learned speed, the running requests' slow-down and the
    /// learned TTFT residual) is within a budget, in requests of the endpoint's typical
    /// prompt; an endpoint with no prompt in prefill always has room for one. `static`: the
    /// thresholds alone. Default `predicted`.
    pub mode: RoomMode,
    /// Under `predicted`: the budget for a request without a `ttft_target_ms` is its predicted
    /// TTFT at most this many times what a typical prompt of the endpoint takes there idle
    /// (`base_ms` plus its prefill), so the wait may be `max_ttft_factor - 1` of it. With a
    /// target, the budget is the target less that idle TTFT. Must be >= 1. Default 1.5.
    pub max_ttft_factor: f64,
    /// Under `predicted`: an endpoint whose one prompt in prefill is predicted to be done within
    /// this many ms (its prefill at the learned speed less how long it has run) takes the next
    /// request now, as an idle one does, so the next prompt reaches the engine about when its
    /// prefill frees instead of a first byte's trip back and a dispatch later. At most one
    /// request goes ahead this way. 0: only an idle endpoint. Default 0.
    pub dispatch_lead_ms: u64,
    /// Prompt tokens routed to one endpoint that have not produced a first byte yet (the
    /// router's own count: queued or prefilling there). Must be > 0. Default 16384.
    pub max_prefill_tokens: u64,
    /// Requests waiting in the engine's own queue (`vllm:num_requests_waiting`, when fresh;
    /// else the router's count of requests without a first byte). Default 8.
    pub max_waiting_requests: u64,
    /// The engine's KV-cache usage, 0..=1 (`vllm:kv_cache_usage_perc`, when fresh). Default 0.95.
    pub max_kv_cache_usage: f64,
}

/// How an endpoint's room is judged (`flow_control.room.mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoomMode {
    /// The thresholds and the predicted wait against its budget.
    #[default]
    Predicted,
    /// The thresholds alone.
    Static,
}

impl Default for RoomConfig {
    fn default() -> Self {
        Self {
            mode: RoomMode::Predicted,
            max_ttft_factor: 1.5,
            dispatch_lead_ms: 0,
            max_prefill_tokens: 16_384,
            max_waiting_requests: 8,
            max_kv_cache_usage: 0.95,
        }
    }
}

/// A named objective (the Inference Extension's InferenceObjective).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObjectiveConfig {
    /// The objective header's value. Required, unique.
    pub name: String,
    /// Higher is served first; negative means sheddable (429 rather than 503 when refused).
    /// Default 0.
    pub priority: i32,
    /// The time to first token this objective aims at, in ms: with `edf` ordering, a queued
    /// request's deadline is its arrival plus this. Must be > 0 if set. Default none (no
    /// deadline: served after the requests that have one).
    pub ttft_target_ms: Option<u64>,
    /// Endpoint labels a request of this objective needs (e.g. `hardware: h100`): only
    /// endpoints carrying every one of them with that value are its candidates. Applies whether
    /// or not flow control is enabled. Default: none.
    pub required_labels: std::collections::BTreeMap<String, String>,
    /// When no endpoint serving the model carries `required_labels`: `reject` answers 503
    /// (`No endpoint ... has the labels objective ... requires`), `any` routes over every
    /// endpoint serving the model as if no label were required. Default `reject`.
    pub unmatched: UnmatchedLabels,
    /// Requests of room that requests of lower priority leave free for this objective while
    /// the model's queue holds requests (trunk reservation): a queued request of a lower band
    /// is dispatched only while the candidates have more room than this (summed over the
    /// objectives above it), so a request of this objective finds an engine with its prefill
    /// free instead of waiting for one. Not held while nothing waits (a request arriving to an
    /// empty queue takes any room), nor for a model where no request of this objective came
    /// in the last minute, and never more than the open candidates less one (lower bands
    /// always keep one engine). The price: lower bands' throughput while the fleet is
    /// saturated. Default 0 (none).
    pub reserve_requests: u64,
}

/// What a request whose objective requires labels no endpoint has gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnmatchedLabels {
    /// 503: no endpoint has the labels.
    #[default]
    Reject,
    /// Route over every endpoint serving the model.
    Any,
}

impl FlowControlConfig {
    /// The configured objective named `objective`, if any.
    pub fn objective(&self, objective: Option<&str>) -> Option<&ObjectiveConfig> {
        objective.and_then(|name| self.objectives.iter().find(|o| o.name == name))
    }

    /// The priority of a request naming `objective` (none, or an unknown name: the default).
    pub fn priority_of(&self, objective: Option<&str>) -> i32 {
        self.objective(objective)
            .map_or(self.default_priority, |o| o.priority)
    }

    /// Requests of room a request of `priority` leaves free: the `reserve_requests` of every
    /// objective above it whose priority is `active` (its requests are coming).
    pub fn reserve_below(&self, priority: i32, active: impl Fn(i32) -> bool) -> u64 {
        self.objectives
            .iter()
            .filter(|o| o.priority > priority && o.reserve_requests > 0 && active(o.priority))
            .map(|o| o.reserve_requests)
            .fold(0, u64::saturating_add)
    }

    /// The ordering of the band of `priority`.
    pub fn ordering_of(&self, priority: i32) -> QueueOrdering {
        self.bands
            .iter()
            .find(|b| b.priority == priority)
            .map_or(self.ordering, |b| b.ordering)
    }

    pub(super) fn validate(&self, errors: &mut Errors) {
        let p = "flow_control";
        if self.max_queue_requests == 0 {
            errors.push(format!("{p}.max_queue_requests"), "must be > 0");
        }
        if self.max_queue_bytes == 0 {
            errors.push(format!("{p}.max_queue_bytes"), "must be > 0");
        }
        if self.max_wait_ms == 0 {
            errors.push(format!("{p}.max_wait_ms"), "must be > 0");
        }
        if !(1..=1000).contains(&self.dispatch_interval_ms) {
            errors.push(format!("{p}.dispatch_interval_ms"), "must be in 1..=1000");
        }
        for (field, name) in [
            ("objective_header", &self.objective_header),
            ("fairness_header", &self.fairness_header),
        ] {
            if !is_header_name(name) {
                errors.push(
                    format!("{p}.{field}"),
                    format!("{name:?} is not a lowercase HTTP header name"),
                );
            }
        }
        if self.room.max_prefill_tokens == 0 {
            errors.push(format!("{p}.room.max_prefill_tokens"), "must be > 0");
        }
        let factor = self.room.max_ttft_factor;
        if !(factor.is_finite() && factor >= 1.0) {
            errors.push(
                format!("{p}.room.max_ttft_factor"),
                format!("must be finite and >= 1 (got {factor})"),
            );
        }
        let kv = self.room.max_kv_cache_usage;
        if !(kv > 0.0 && kv <= 1.0) {
            errors.push(
                format!("{p}.room.max_kv_cache_usage"),
                format!("must be in (0, 1] (got {kv})"),
            );
        }
        let mut bands = std::collections::HashSet::new();
        for (i, b) in self.bands.iter().enumerate() {
            if !bands.insert(b.priority) {
                errors.push(
                    format!("{p}.bands[{i}].priority"),
                    format!("{} is listed twice", b.priority),
                );
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, o) in self.objectives.iter().enumerate() {
            if o.ttft_target_ms == Some(0) {
                errors.push(format!("{p}.objectives[{i}].ttft_target_ms"), "must be > 0");
            }
            if o.name.is_empty() {
                errors.push(format!("{p}.objectives[{i}].name"), "is required");
            } else if !seen.insert(o.name.as_str()) {
                errors.push(
                    format!("{p}.objectives[{i}].name"),
                    format!("{:?} is listed twice", o.name),
                );
            }
            for key in o.required_labels.keys() {
                if key.trim().is_empty() {
                    errors.push(
                        format!("{p}.objectives[{i}].required_labels"),
                        "a label name must not be empty",
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, QueueOrdering, RoomMode};

    fn errors(yaml: &str) -> Vec<String> {
        let base = "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]\n";
        let config: Config = serde_norway::from_str(&format!("{base}{yaml}")).unwrap();
        config.validate().iter().map(|e| e.to_string()).collect()
    }

    #[test]
    fn bad_values_are_reported_with_their_paths() {
        let cases = [
            (
                "flow_control: {max_queue_requests: 0}",
                "flow_control.max_queue_requests: must be > 0",
            ),
            (
                "flow_control: {max_wait_ms: 0}",
                "flow_control.max_wait_ms: must be > 0",
            ),
            (
                "flow_control: {dispatch_interval_ms: 0}",
                "flow_control.dispatch_interval_ms: must be in 1..=1000",
            ),
            (
                "flow_control: {room: {max_kv_cache_usage: 1.5}}",
                "flow_control.room.max_kv_cache_usage: must be in (0, 1] (got 1.5)",
            ),
            (
                "flow_control: {room: {max_ttft_factor: 0.9}}",
                "flow_control.room.max_ttft_factor: must be finite and >= 1 (got 0.9)",
            ),
            (
                "flow_control: {objective_header: 'X Y'}",
                "flow_control.objective_header: \"X Y\" is not a lowercase HTTP header name",
            ),
            (
                "flow_control: {objectives: [{name: a}, {name: a}]}",
                "flow_control.objectives[1].name: \"a\" is listed twice",
            ),
            (
                "flow_control: {objectives: [{name: a, ttft_target_ms: 0}]}",
                "flow_control.objectives[0].ttft_target_ms: must be > 0",
            ),
            (
                "flow_control: {bands: [{priority: 1, ordering: edf}, {priority: 1}]}",
                "flow_control.bands[1].priority: 1 is listed twice",
            ),
        ];
        for (yaml, want) in cases {
            assert_eq!(errors(yaml), vec![want.to_string()], "{yaml}");
        }
        assert!(errors(
            "flow_control: {enabled: true, objectives: [{name: critical, priority: 1}]}"
        )
        .is_empty());
    }

    #[test]
    fn objectives_map_to_priorities() {
        let config: Config = serde_norway::from_str(
            "flow_control: {default_priority: 0, objectives: [{name: critical, priority: 1}, {name: sheddable, priority: -1}]}",
        )
        .unwrap();
        let f = &config.flow_control;
        assert_eq!(f.priority_of(Some("critical")), 1);
        assert_eq!(f.priority_of(Some("sheddable")), -1);
        assert_eq!(f.priority_of(Some("other")), 0);
        assert_eq!(f.priority_of(None), 0);
    }

    #[test]
    fn ordering_is_fcfs_unless_a_band_says_edf() {
        let config: Config = serde_norway::from_str(
            "flow_control: {objectives: [{name: critical, priority: 1, ttft_target_ms: 500}], bands: [{priority: 1, ordering: edf}]}",
        )
        .unwrap();
        let f = &config.flow_control;
        assert_eq!(f.ordering_of(1), QueueOrdering::Edf);
        assert_eq!(f.ordering_of(0), QueueOrdering::Fcfs);
        assert_eq!(
            f.objective(Some("critical")).and_then(|o| o.ttft_target_ms),
            Some(500)
        );
        let all: Config = serde_norway::from_str("flow_control: {ordering: edf}").unwrap();
        assert_eq!(all.flow_control.ordering_of(-7), QueueOrdering::Edf);
        assert!(serde_norway::from_str::<Config>("flow_control: {ordering: lifo}").is_err());
        let room: Config = serde_norway::from_str("flow_control: {room: {mode: static}}").unwrap();
        assert_eq!(room.flow_control.room.mode, RoomMode::Static);
        assert!(serde_norway::from_str::<Config>("flow_control: {room: {mode: auto}}").is_err());
    }
}
