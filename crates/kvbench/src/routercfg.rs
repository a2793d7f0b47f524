//! The kvrouter config of one run: the fleet as one pool, the policy under test by its exact
//! `policy.name`, the tenancy header and tokenizer when the workload needs them, then the
//! policy's own YAML merged over it (maps key by key; anything else replaces).

use std::net::SocketAddr;
use std::path::Path;

use serde_norway::{Mapping, Value};

use super::plan::PolicySpec;

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
    /// Where kvrouter writes the EDS file for Envoy.
    pub eds_path: &'a Path,
    /// The endpoints.
    pub endpoints: &'a [EndpointInfo],
}

/// The config YAML.
pub fn render(policy: &PolicySpec, inputs: &RouterInputs<'_>) -> String {
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
    serde_norway::to_string(&root).unwrap_or_default()
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
            eds_path: eds,
            endpoints: eps,
        }
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
