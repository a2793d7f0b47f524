//! What the queue needs to know about a request, taken from its headers (priority, flow) and
//! body (model), without parsing the prompt.

use crate::config::FlowControlConfig;

/// The Inference Extension's older name of the objective header, read after the configured one.
const OBJECTIVE_ALIAS: &str = "x-gateway-inference-objective";

/// Longest flow id kept (longer ones are cut), in characters: flow ids become metric labels.
const MAX_FLOW_CHARS: usize = 64;

/// The flow of a request that names none.
const DEFAULT_FLOW: &str = "default";

/// A request's place in the queues, read from its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    /// Its objective's priority (`flow_control.default_priority` without a known objective).
    pub priority: i32,
    /// Its flow: the trusted tenant, else the fairness id, else `default`.
    pub flow: String,
    /// Its objective's TTFT target, in ms (its deadline under `edf` ordering), if it has one.
    pub ttft_target_ms: Option<u64>,
    /// Its objective, when the config lists it (`flow_control.objectives[].name`; an unknown
    /// value is dropped, so this is never client text the config does not name).
    pub objective: Option<String>,
}

impl Default for Labels {
    fn default() -> Self {
        Labels {
            priority: 0,
            flow: DEFAULT_FLOW.to_string(),
            ttft_target_ms: None,
            objective: None,
        }
    }
}

impl Labels {
    /// Labels under `config` for a request whose header `name` has value `header(name)`;
    /// `tenant` is the trusted tenancy header's value, if any. The tenant wins over the
    /// client-settable fairness id, so a tenant cannot split itself into many flows.
    pub fn from_headers<'h>(
        config: &FlowControlConfig,
        tenant: Option<&str>,
        header: impl Fn(&str) -> Option<&'h str>,
    ) -> Labels {
        let objective = header(&config.objective_header).or_else(|| header(OBJECTIVE_ALIAS));
        let flow = tenant
            .filter(|t| !t.is_empty())
            .or_else(|| header(&config.fairness_header).filter(|f| !f.is_empty()))
            .unwrap_or(DEFAULT_FLOW);
        let known = config.objective(objective);
        Labels {
            priority: known.map_or(config.default_priority, |o| o.priority),
            flow: flow.chars().take(MAX_FLOW_CHARS).collect(),
            ttft_target_ms: known.and_then(|o| o.ttft_target_ms),
            objective: known.map(|o| o.name.clone()),
        }
    }
}

/// The body's `model` field, without reading the rest of the body into values (the prompt is
/// skipped, never copied). `None` for a body that is not a JSON object with a string `model`:
/// routing answers that request's error.
pub fn sniff_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct ModelOnly<'a> {
        #[serde(borrow)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<ModelOnly<'_>>(body)
        .ok()?
        .model
        .map(|m| m.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> FlowControlConfig {
        serde_norway::from_str(
            "objectives: [{name: critical, priority: 1}, {name: sheddable, priority: -1}]",
        )
        .unwrap()
    }

    #[test]
    fn priority_and_flow_come_from_headers_with_the_tenant_first() {
        let c = config();
        type Headers<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Headers, Option<&str>, i32, &str); 6] = [
            (&[], None, 0, "default"),
            (
                &[("x-llm-d-inference-objective", "critical")],
                None,
                1,
                "default",
            ),
            (
                &[("x-gateway-inference-objective", "sheddable")],
                None,
                -1,
                "default",
            ),
            (
                &[("x-llm-d-inference-objective", "unknown")],
                None,
                0,
                "default",
            ),
            (
                &[("x-llm-d-inference-fairness-id", "team-a")],
                None,
                0,
                "team-a",
            ),
            (
                &[("x-llm-d-inference-fairness-id", "team-a")],
                Some("tenant-1"),
                0,
                "tenant-1",
            ),
        ];
        for (headers, tenant, priority, flow) in cases {
            let labels = Labels::from_headers(&c, tenant, |name| {
                headers.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
            });
            assert_eq!(labels.priority, priority, "{headers:?}");
            assert_eq!(labels.flow, flow, "{headers:?}");
        }
        let with_target: FlowControlConfig = serde_norway::from_str(
            "objectives: [{name: critical, priority: 1, ttft_target_ms: 300}, {name: sheddable, priority: -1}]",
        )
        .unwrap();
        for (objective, target) in [("critical", Some(300)), ("sheddable", None), ("x", None)] {
            let labels = Labels::from_headers(&with_target, None, |name| {
                (name == "x-llm-d-inference-objective").then_some(objective)
            });
            assert_eq!(labels.ttft_target_ms, target, "{objective}");
        }
        let long = "x".repeat(500);
        let labels = Labels::from_headers(&c, Some(&long), |_| None);
        assert_eq!(labels.flow.len(), MAX_FLOW_CHARS);
    }

    #[test]
    fn the_model_is_read_without_the_prompt() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"there\""}],"model":"m\u00e9"}"#;
        assert_eq!(sniff_model(body).as_deref(), Some("mé"));
        assert_eq!(sniff_model(br#"{"prompt":"x"}"#), None);
        assert_eq!(sniff_model(b"not json"), None);
        assert_eq!(sniff_model(br#"{"model":5}"#), None);
    }
}
