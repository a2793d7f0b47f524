//! The kvrouter config of one run: the fleet as one pool, the policy under test by its exact
//! `policy.name`, the tenancy header and tokenizer when the workload needs them, then the
//! policy's own YAML merged over it (maps key by key; anything else replaces).
//!
//! **Time.** The replicas run `time_scale` times faster than real time, the router in real time.
//! Left alone, every time constant of the router would be `time_scale` times too long in the
//! simulated world: scraped queues `time_scale` times staler, TTLs and half-lives as long, and
//! a policy that lives on scraped signals herds. So, unless the plan says otherwise, every
//! duration of the router's config (a field named `*_ms`) is divided by the time scale and
//! every speed (`*_per_s`) multiplied by it, defaults included: the router then lives in
//! simulated time. Values a plan writes are simulated too, and scaled alike. Durations about
//! the machine rather than the engines stay real ([`REAL_TIME_FIELDS`]: timeouts, the config
//! reload poll); kvrouter's lower limits are kept ([`FLOORS_MS`]) and reported.

use std::net::SocketAddr;
use std::path::Path;

use serde_norway::{Mapping, Value};

use super::plan::PolicySpec;

/// Duration fields about the machine (network timeouts, file polling), not the engines: never
/// scaled.
pub const REAL_TIME_FIELDS: &[&str] = &[
    "timeout_ms",
    "reload_interval_ms",
    "refresh_ms",
    "reconnect_max_ms",
    "max_request_duration_s",
    "retry_after_s",
];

/// kvrouter's lower limits on scaled durations (its config validation), by field path.
pub const FLOORS_MS: &[(&str, f64)] = &[("load.scrape.interval_ms", 10.0)];

/// One router setting changed by time scaling.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScaledField {
    /// Field path, e.g. `load.scrape.interval_ms`.
    pub path: String,
    /// The value in simulated units (the plan's or kvrouter's default).
    pub simulated: f64,
    /// The value written (real units).
    pub written: f64,
    /// It hit one of kvrouter's lower limits, so the router runs slower than simulated time
    /// there.
    pub floored: bool,
}

/// One endpoint of the generated pool.
#[derive(Debug, Clone)]
pub struct EndpointInfo {
    /// Replica name (`r0`...).
    pub name: String,
    /// HTTP address.
    pub address: SocketAddr,
    /// ZMQ endpoint of its KV events, if it publishes.
    pub kv_events: Option<String>,
}

/// Inputs of [`render`].
#[derive(Debug, Clone)]
pub struct RouterInputs<'a> {
    /// The model served.
    pub model: &'a str,
    /// Tokenizer directory for the model, if the router gets one.
    pub tokenizer: Option<&'a Path>,
    /// The tenancy header, if the workload has tenants.
    pub tenant_header: Option<&'a str>,
    /// kvrouter writes each tenant's `cache_salt` into its requests
    /// (`tenancy.inject_cache_salt`). `false` only for the unsalted negative control, whose
    /// point is that engines do share blocks between tenants.
    pub inject_cache_salt: bool,
    /// Where kvrouter writes the EDS file for Envoy.
    pub eds_path: &'a Path,
    /// The endpoints.
    pub endpoints: &'a [EndpointInfo],
    /// Divide durations by this and multiply speeds by it (1: unchanged). See the module docs.
    pub time_scale: f64,
    /// Keep the last N decisions (`debug.record_decisions`), if set.
    pub record_decisions: Option<usize>,
}

/// The config YAML.
pub fn render(policy: &PolicySpec, inputs: &RouterInputs<'_>) -> String {
    render_scaled(policy, inputs).0
}

/// The config YAML and the fields time scaling changed.
pub fn render_scaled(policy: &PolicySpec, inputs: &RouterInputs<'_>) -> (String, Vec<ScaledField>) {
    let mut root = Mapping::new();
    root.insert(
        "server".into(),
        yaml("{reload_interval_ms: 100, log_format: text}"),
    );
    let mut envoy = Mapping::new();
    envoy.insert(
        "eds_path".into(),
        Value::String(inputs.eds_path.display().to_string()),
    );
    root.insert("envoy".into(), Value::Mapping(envoy));
    if let Some(n) = inputs.record_decisions {
        let mut debug = Mapping::new();
        debug.insert("record_decisions".into(), Value::from(n as u64));
        root.insert("debug".into(), Value::Mapping(debug));
    }
    let mut policy_map = Mapping::new();
    policy_map.insert("name".into(), Value::String(policy.policy.clone()));
    root.insert("policy".into(), Value::Mapping(policy_map));
    if let Some(dir) = inputs.tokenizer {
        let mut m = Mapping::new();
        m.insert("name".into(), Value::String(inputs.model.into()));
        m.insert("tokenizer".into(), Value::String(dir.display().to_string()));
        root.insert("models".into(), Value::Sequence(vec![Value::Mapping(m)]));
    }
    if let Some(h) = inputs.tenant_header {
        let mut m = Mapping::new();
        m.insert("header".into(), Value::String(h.to_ascii_lowercase()));
        if !inputs.inject_cache_salt {
            m.insert("inject_cache_salt".into(), Value::Bool(false));
        }
        root.insert("tenancy".into(), Value::Mapping(m));
    }
    let endpoints: Vec<Value> = inputs
        .endpoints
        .iter()
        .map(|e| {
            let mut m = Mapping::new();
            m.insert("address".into(), Value::String(e.address.to_string()));
            let mut v = Value::Mapping(m);
            if let Some(extra) = &policy.endpoint_yaml {
                let mut extra = extra.clone();
                substitute(&mut extra, e);
                merge(&mut v, extra);
            }
            v
        })
        .collect();
    let mut pool = Mapping::new();
    pool.insert("name".into(), "bench".into());
    pool.insert(
        "models".into(),
        Value::Sequence(vec![Value::String(inputs.model.into())]),
    );
    pool.insert("endpoints".into(), Value::Sequence(endpoints));
    let mut pool = Value::Mapping(pool);
    if let Some(extra) = &policy.pool_yaml {
        merge(&mut pool, extra.clone());
    }
    root.insert("pools".into(), Value::Sequence(vec![pool]));
    let mut root = Value::Mapping(root);
    if let Some(extra) = &policy.router_yaml {
        merge(&mut root, extra.clone());
    }
    let mut scaled = Vec::new();
    if inputs.time_scale.is_finite() && inputs.time_scale > 0.0 && inputs.time_scale != 1.0 {
        // kvrouter's defaults of every time field, under what the run sets.
        let mut timed = serde_norway::to_value(kvrouter::config::Config::default())
            .map(|d| time_fields(&d).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        if timed.is_mapping() {
            merge(&mut timed, root);
            root = timed;
        }
        scale_tree(&mut root, "", inputs.time_scale, &mut scaled);
    }
    (serde_norway::to_string(&root).unwrap_or_default(), scaled)
}

fn is_duration(key: &str) -> bool {
    key.ends_with("_ms") && !REAL_TIME_FIELDS.contains(&key)
}

fn is_speed(key: &str) -> bool {
    key.ends_with("_per_s")
}

/// The sub-tree of `v` holding only its time fields (durations and speeds), or `None`. A
/// zero is left out: scaling keeps it zero (usually "off"), so writing it would change nothing
/// but would make the config unreadable to a build older than the field (a plan's
/// `router_bin` A/B against the build before).
fn time_fields(v: &Value) -> Option<Value> {
    let Value::Mapping(m) = v else { return None };
    let mut out = Mapping::new();
    for (k, v) in m {
        let key = k.as_str().unwrap_or("");
        let keep = match v {
            Value::Number(n) if n.as_f64() == Some(0.0) => None,
            Value::Number(_) if is_duration(key) || is_speed(key) => Some(v.clone()),
            Value::Mapping(_) => time_fields(v),
            _ => None,
        };
        if let Some(v) = keep {
            out.insert(k.clone(), v);
        }
    }
    (!out.is_empty()).then_some(Value::Mapping(out))
}

/// Scales every duration and speed under `v` (sequences included, e.g. endpoints).
fn scale_tree(v: &mut Value, path: &str, scale: f64, out: &mut Vec<ScaledField>) {
    match v {
        Value::Mapping(m) => {
            for (k, v) in m.iter_mut() {
                let key = k.as_str().unwrap_or("").to_string();
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                if let Value::Number(n) = v {
                    let Some(x) = n.as_f64() else { continue };
                    let integer = n.is_u64() || n.is_i64();
                    let (mut y, floor) = if is_duration(&key) {
                        let floor = FLOORS_MS.iter().find(|f| f.0 == at).map(|f| f.1);
                        (x / scale, floor)
                    } else if is_speed(&key) {
                        (x * scale, None)
                    } else {
                        continue;
                    };
                    let mut floored = false;
                    if let Some(f) = floor.filter(|&f| y < f) {
                        y = f;
                        floored = true;
                    }
                    *v = if integer {
                        // Zero often means "off": keep it; otherwise at least 1.
                        let r = if x == 0.0 {
                            0
                        } else {
                            (y.round() as u64).max(1)
                        };
                        y = r as f64;
                        Value::from(r)
                    } else {
                        Value::from(y)
                    };
                    out.push(ScaledField {
                        path: at,
                        simulated: x,
                        written: y,
                        floored,
                    });
                } else {
                    scale_tree(v, &at, scale, out);
                }
            }
        }
        Value::Sequence(s) => {
            for (i, v) in s.iter_mut().enumerate() {
                scale_tree(v, &format!("{path}[{i}]"), scale, out);
            }
        }
        _ => {}
    }
}

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).unwrap_or(Value::Null)
}

/// Merges `over` into `base`: mappings key by key, recursively; anything else replaces.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

fn substitute(v: &mut Value, e: &EndpointInfo) {
    match v {
        Value::String(s) => {
            *s = s
                .replace("{name}", &e.name)
                .replace("{address}", &e.address.to_string())
                .replace("{kv_events}", e.kv_events.as_deref().unwrap_or(""));
        }
        Value::Mapping(m) => m.iter_mut().for_each(|(_, v)| substitute(v, e)),
        Value::Sequence(s) => s.iter_mut().for_each(|v| substitute(v, e)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter::config::Config;

    fn inputs<'a>(eps: &'a [EndpointInfo], eds: &'a Path) -> RouterInputs<'a> {
        RouterInputs {
            model: "demo-model",
            tokenizer: None,
            tenant_header: Some("X-Tenant-Id"),
            inject_cache_salt: true,
            eds_path: eds,
            endpoints: eps,
            time_scale: 1.0,
            record_decisions: None,
        }
    }

    #[test]
    fn time_constants_follow_the_simulated_clock() {
        let eps = vec![EndpointInfo {
            name: "r0".into(),
            address: "127.0.0.1:8001".parse().unwrap(),
            kv_events: None,
        }];
        let policy = PolicySpec {
            policy: "predicted-ttft".into(),
            // A value the plan sets is simulated too.
            router_yaml: Some(yaml("{cache_index: {prediction_ttl_ms: 60000}}")),
            endpoint_yaml: Some(yaml("{prefill_tokens_per_s: 3000}")),
            ..PolicySpec::default()
        };
        let base = Config::default();
        let mut i = inputs(&eps, Path::new("/e"));
        i.time_scale = 5.0;
        i.record_decisions = Some(100);
        let (text, fields) = render_scaled(&policy, &i);
        let c = Config::parse_and_validate(&text, "g").unwrap();
        assert_eq!(c.load.scrape.interval_ms, base.load.scrape.interval_ms / 5);
        assert_eq!(
            c.load.scrape.staleness_ms,
            base.load.scrape.staleness_ms / 5
        );
        assert_eq!(c.cache_index.prediction_ttl_ms, 12_000);
        assert_eq!(
            c.kv_events.trusted_prediction_ttl_ms,
            base.kv_events.trusted_prediction_ttl_ms / 5
        );
        assert_eq!(
            c.health.probe.interval_ms,
            base.health.probe.interval_ms / 5
        );
        assert_eq!(
            c.health.probe.timeout_ms, base.health.probe.timeout_ms,
            "machine time"
        );
        assert_eq!(c.server.reload_interval_ms, 100, "machine time");
        let p = &c.policy.predicted_ttft;
        let b = &base.policy.predicted_ttft;
        assert_eq!(p.waiting_request_ms, b.waiting_request_ms / 5.0);
        assert_eq!(
            p.default_prefill_tokens_per_s,
            b.default_prefill_tokens_per_s * 5.0
        );
        assert_eq!(c.pools[0].endpoints[0].prefill_tokens_per_s, Some(15_000.0));
        assert_eq!(c.debug.record_decisions, 100);
        assert!(fields.iter().any(|f| f.path == "load.scrape.staleness_ms"));
        // Zero defaults stay zero and are not written (a build older than such a field can
        // still read the config); zeros a plan sets are kept.
        assert_eq!(base.flow_control.room.dispatch_lead_ms, 0);
        assert!(!text.contains("dispatch_lead_ms"), "{text}");
        assert!(!text.contains("base_ms"), "{text}");
        let zero = PolicySpec {
            router_yaml: Some(yaml("{policy: {predicted_ttft: {base_ms: 0}}}")),
            ..policy.clone()
        };
        let (text, _) = render_scaled(&zero, &i);
        assert!(text.contains("base_ms: 0"), "{text}");
        // At a scale that would go below kvrouter's floor, the floor holds and says so.
        i.time_scale = 20.0;
        let (text, fields) = render_scaled(&policy, &i);
        let c = Config::parse_and_validate(&text, "g").unwrap();
        assert_eq!(c.load.scrape.interval_ms, 10);
        let f = fields
            .iter()
            .find(|f| f.path == "load.scrape.interval_ms")
            .unwrap();
        assert!(f.floored, "{f:?}");
        // Scale 1 writes only what the run sets.
        i.time_scale = 1.0;
        let (text, fields) = render_scaled(&policy, &i);
        assert!(fields.is_empty());
        assert!(!text.contains("staleness_ms"), "{text}");
    }

    #[test]
    fn renders_a_valid_config_with_merged_extras() {
        let eps = vec![EndpointInfo {
            name: "r0".into(),
            address: "127.0.0.1:8001".parse().unwrap(),
            kv_events: Some("tcp://127.0.0.1:5557".into()),
        }];
        let policy = PolicySpec {
            policy: "round-robin".into(),
            router_yaml: Some(yaml("{routing: {fallback_endpoints: 1}}")),
            endpoint_yaml: Some(yaml("{weight: 2}")),
            ..PolicySpec::default()
        };
        let text = render(&policy, &inputs(&eps, Path::new("/tmp/eds.json")));
        let config = Config::parse_and_validate(&text, "generated").unwrap();
        assert_eq!(config.policy.name.as_str(), "round-robin");
        assert_eq!(config.routing.fallback_endpoints, 1);
        assert_eq!(config.routing.max_body_bytes, 32 << 20, "defaults kept");
        assert_eq!(config.pools[0].endpoints[0].weight, 2.0);
        assert_eq!(config.tenancy.header.as_deref(), Some("x-tenant-id"));
    }

    #[test]
    fn placeholders_and_unknown_policies() {
        let eps = vec![EndpointInfo {
            name: "r3".into(),
            address: "127.0.0.1:8004".parse().unwrap(),
            kv_events: Some("tcp://127.0.0.1:5560".into()),
        }];
        let policy = PolicySpec {
            policy: "no-such-policy".into(),
            endpoint_yaml: Some(yaml("{kv: {at: '{kv_events}', who: '{name}@{address}'}}")),
            ..PolicySpec::default()
        };
        let text = render(&policy, &inputs(&eps, Path::new("/e")));
        assert!(text.contains("at: tcp://127.0.0.1:5560"), "{text}");
        assert!(text.contains("who: r3@127.0.0.1:8004"), "{text}");
        assert!(Config::parse_and_validate(&text, "g").is_err());
    }
}
