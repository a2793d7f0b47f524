//! Semantic checks that serde cannot express, each reported with the path of the bad field.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;

use super::Config;

/// Longest Unix socket path the kernel takes (`sun_path` is 108 bytes with its terminating NUL).
const MAX_UNIX_SOCKET_PATH_BYTES: usize = 107;

/// One invalid value: where it is and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the field, e.g. `pools[0].endpoints[2].address`.
    pub path: String,
    /// What is wrong, e.g. `"10.0.0.1" is not an ip:port`.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The problems found so far (shared with the section files' own checks).
#[derive(Default)]
pub(super) struct Errors(Vec<ConfigError>);

impl Errors {
    pub(super) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }
}

/// True when `name` is a valid lowercase HTTP/2 header field name (RFC 9110 token, no uppercase).
pub(super) fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

fn positive_finite(errors: &mut Errors, path: &str, value: f64) {
    if !(value.is_finite() && value > 0.0) {
        errors.push(path, format!("must be a finite number > 0 (got {value})"));
    }
}

impl Config {
    /// Returns every invalid value; empty means the config is usable.
    pub fn validate(&self) -> Vec<ConfigError> {
        let mut errors = Errors::default();

        if self.server.max_grpc_message_bytes < 64 * 1024 {
            errors.push(
                "server.max_grpc_message_bytes",
                "must be at least 65536 (Envoy sends body chunks of up to 64 KiB)",
            );
        }
        if self.server.grpc_listen == self.server.admin_listen
            && self.server.grpc_listen.port() != 0
        {
            errors.push("server.admin_listen", "must differ from server.grpc_listen");
        }

        if let Some(path) = &self.server.grpc_unix_socket {
            let len = path.as_os_str().len();
            if len == 0 {
                errors.push("server.grpc_unix_socket", "must not be empty");
            } else if len > MAX_UNIX_SOCKET_PATH_BYTES {
                // A relative path is checked as written (binding checks the joined one).
                errors.push(
                    "server.grpc_unix_socket",
                    format!(
                        "is {len} bytes; a Unix socket path takes at most {MAX_UNIX_SOCKET_PATH_BYTES}"
                    ),
                );
            }
        }
        if let Some(health) = self.server.health_listen {
            if health.port() != 0
                && (health == self.server.grpc_listen || health == self.server.admin_listen)
            {
                errors.push(
                    "server.health_listen",
                    "must differ from server.grpc_listen and server.admin_listen",
                );
            }
        }
        if let Some(tls) = &self.server.tls {
            for (field, path) in [("cert_path", &tls.cert_path), ("key_path", &tls.key_path)] {
                if path.as_os_str().is_empty() {
                    errors.push(format!("server.tls.{field}"), "is required");
                }
            }
        }
        if self.server.max_request_duration_s == 0 {
            errors.push("server.max_request_duration_s", "must be > 0");
        }
        if self
            .envoy
            .eds_path
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty() || p.file_name().is_none())
        {
            errors.push("envoy.eds_path", "must name a file");
        }

        let header = &self.routing.destination_header;
        if !is_header_name(header) {
            errors.push(
                "routing.destination_header",
                format!("{header:?} is not a lowercase HTTP header name"),
            );
        }
        if self.routing.max_body_bytes == 0 {
            errors.push("routing.max_body_bytes", "must be > 0");
        }
        if self.routing.max_messages == 0 {
            errors.push("routing.max_messages", "must be > 0");
        }
        if self.routing.max_content_parts == 0 {
            errors.push("routing.max_content_parts", "must be > 0");
        }
        if self.routing.max_buffered_body_bytes < self.routing.max_body_bytes {
            errors.push(
                "routing.max_buffered_body_bytes",
                "must be >= routing.max_body_bytes (one largest body must fit)",
            );
        }

        positive_finite(
            &mut errors,
            "policy.least_loaded.tokens_per_request",
            self.policy.least_loaded.tokens_per_request,
        );
        let t = &self.policy.predicted_ttft;
        positive_finite(
            &mut errors,
            "policy.predicted_ttft.default_prefill_tokens_per_s",
            t.default_prefill_tokens_per_s,
        );
        for (field, value) in [
            ("base_ms", t.base_ms),
            ("running_request_ms", t.running_request_ms),
            ("waiting_request_ms", t.waiting_request_ms),
            ("externality_weight", t.externality_weight),
            ("eviction_weight", t.eviction_weight),
            ("recall_weight", t.recall_weight),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                errors.push(
                    format!("policy.predicted_ttft.{field}"),
                    format!("must be a finite number >= 0 (got {value})"),
                );
            }
        }
        if !(0.0..1.0).contains(&t.tie_tolerance) {
            errors.push(
                "policy.predicted_ttft.tie_tolerance",
                format!("must be in [0, 1) (got {})", t.tie_tolerance),
            );
        }

        if self.policy.sglang_cache_aware.eviction_interval_ms == 0 {
            errors.push(
                "policy.sglang_cache_aware.eviction_interval_ms",
                "must be > 0",
            );
        }
        let kv = &self.policy.vllm_kvaware;
        if kv.qps_window_ms == 0 {
            errors.push("policy.vllm_kvaware.qps_window_ms", "must be > 0");
        }
        if kv.chunk_tokens == 0 {
            errors.push("policy.vllm_kvaware.chunk_tokens", "must be > 0");
        }
        if self.policy.vllm_prefixaware.max_blocks == 0 {
            errors.push("policy.vllm_prefixaware.max_blocks", "must be > 0");
        }

        self.validate_models(&mut errors);
        self.validate_kv_tiers(&mut errors);
        self.validate_tenancy(&mut errors);
        if self.cache_index.default_capacity_blocks == 0 {
            errors.push("cache_index.default_capacity_blocks", "must be > 0");
        }
        if self.cache_index.prediction_ttl_ms == 0 {
            errors.push("cache_index.prediction_ttl_ms", "must be > 0");
        }
        if self.cache_index.max_engine_capacity_tokens == 0 {
            errors.push("cache_index.max_engine_capacity_tokens", "must be > 0");
        }
        self.validate_pools(&mut errors);
        self.load.validate(&mut errors);
        self.health.validate(&mut errors);
        self.flow_control.validate(&mut errors);
        errors.0.extend(self.validate_kv_events());
        self.tracing.validate(&mut errors);
        self.admin.validate(&mut errors);
        self.sharing.validate(&mut errors);
        errors.0
    }

    fn validate_models(&self, errors: &mut Errors) {
        let mut model_names = HashSet::new();
        for (i, model) in self.models.iter().enumerate() {
            let at = format!("models[{i}]");
            if model.name.trim().is_empty() {
                errors.push(format!("{at}.name"), "is required");
            } else if !model_names.insert(model.name.as_str()) {
                errors.push(
                    format!("{at}.name"),
                    format!("{:?} is listed twice", model.name),
                );
            }
            if !(1..=4096).contains(&model.block_size_tokens) {
                errors.push(
                    format!("{at}.block_size_tokens"),
                    format!("must be in 1..=4096 (got {})", model.block_size_tokens),
                );
            } else if model.max_prefix_tokens < model.block_size_tokens {
                errors.push(
                    format!("{at}.max_prefix_tokens"),
                    format!(
                        "must be at least block_size_tokens ({}) (got {})",
                        model.block_size_tokens, model.max_prefix_tokens
                    ),
                );
            }
            if model.template_fuel == 0 {
                errors.push(format!("{at}.template_fuel"), "must be > 0");
            }
            if model.max_rendered_prompt_bytes == 0 {
                errors.push(format!("{at}.max_rendered_prompt_bytes"), "must be > 0");
            }
            if !(0.0..=1.0).contains(&model.defer_tokenizing_after) {
                errors.push(
                    format!("{at}.defer_tokenizing_after"),
                    "must be between 0 and 1",
                );
            }
            for (field, value) in [
                ("tokenizer", &model.tokenizer),
                ("tokenizer_config", &model.tokenizer_config),
                ("chat_template", &model.chat_template),
            ] {
                if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                    errors.push(format!("{at}.{field}"), "must not be empty when set");
                }
            }
            if model.tokenizer.is_none()
                && (model.tokenizer_config.is_some() || model.chat_template.is_some())
            {
                errors.push(
                    format!("{at}.tokenizer"),
                    "is required when tokenizer_config or chat_template is set",
                );
            }
        }
    }

    fn validate_tenancy(&self, errors: &mut Errors) {
        if let Some(header) = &self.tenancy.header {
            if !is_header_name(header) {
                errors.push(
                    "tenancy.header",
                    format!("{header:?} is not a lowercase HTTP header name"),
                );
            }
        }
        let mut group_names = HashSet::new();
        let mut grouped: std::collections::HashMap<&str, usize> = Default::default();
        for (g, group) in self.tenancy.share_groups.iter().enumerate() {
            let at = format!("tenancy.share_groups[{g}]");
            if group.name.trim().is_empty() {
                errors.push(format!("{at}.name"), "is required");
            } else if !group_names.insert(group.name.as_str()) {
                errors.push(
                    format!("{at}.name"),
                    format!("{:?} is used by another group", group.name),
                );
            }
            if group.tenants.is_empty() {
                errors.push(format!("{at}.tenants"), "must list at least one tenant");
            }
            for (t, tenant) in group.tenants.iter().enumerate() {
                if tenant.is_empty() {
                    errors.push(format!("{at}.tenants[{t}]"), "must not be empty");
                } else if let Some(first) = grouped.insert(tenant.as_str(), g) {
                    errors.push(
                        format!("{at}.tenants[{t}]"),
                        format!(
                            "{tenant:?} is already in tenancy.share_groups[{first}]; a tenant \
                             may be in one group"
                        ),
                    );
                }
            }
        }
        if self.tenancy.header.is_none() && !self.tenancy.share_groups.is_empty() {
            errors.push(
                "tenancy.share_groups",
                "has no effect without tenancy.header (no request has a tenant)",
            );
        }
    }

    fn validate_pools(&self, errors: &mut Errors) {
        let mut pool_names = HashSet::new();
        let mut addresses: HashSet<SocketAddr> = HashSet::new();
        let mut total = 0usize;
        for (p, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{p}]");
            if pool.name.trim().is_empty() {
                errors.push(format!("{at}.name"), "is required");
            } else if !pool_names.insert(pool.name.as_str()) {
                errors.push(
                    format!("{at}.name"),
                    format!("{:?} is used by another pool", pool.name),
                );
            }
            model_list(errors, &format!("{at}.models"), &pool.models);
            model_list(errors, &format!("{at}.adapters"), &pool.adapters);
            if !pool.tenants.is_empty() && self.tenancy.header.is_none() {
                errors.push(
                    format!("{at}.tenants"),
                    "needs tenancy.header: without a trusted tenant no request could use the pool",
                );
            }
            let mut tenants = HashSet::new();
            for (t, tenant) in pool.tenants.iter().enumerate() {
                if tenant.trim().is_empty() {
                    errors.push(format!("{at}.tenants[{t}]"), "must not be empty");
                } else if !tenants.insert(tenant.as_str()) {
                    errors.push(
                        format!("{at}.tenants[{t}]"),
                        format!("{tenant:?} is listed twice"),
                    );
                }
            }
            check_labels(errors, &format!("{at}.labels"), &pool.labels);
            if let Some(dns) = &pool.dns {
                total += 1;
                if !pool.endpoints.is_empty() {
                    errors.push(
                        format!("{at}.dns"),
                        "a pool lists endpoints or discovers them from dns, not both",
                    );
                }
                if dns.name.trim().is_empty() {
                    errors.push(format!("{at}.dns.name"), "is required");
                }
                if dns.port == 0 {
                    errors.push(format!("{at}.dns.port"), "is required (not 0)");
                }
                if dns.refresh_ms < 100 {
                    errors.push(format!("{at}.dns.refresh_ms"), "must be >= 100");
                }
                if !(1..=4096).contains(&dns.max_addresses) {
                    errors.push(
                        format!("{at}.dns.max_addresses"),
                        format!("must be in 1..=4096 (got {})", dns.max_addresses),
                    );
                }
                if pool.models.is_empty() {
                    errors.push(
                        format!("{at}.models"),
                        "a dns pool must list the models its endpoints serve",
                    );
                }
            }
            if let Some(k8s) = &pool.kubernetes {
                total += 1;
                if !pool.endpoints.is_empty() || pool.dns.is_some() {
                    errors.push(
                        format!("{at}.kubernetes"),
                        "a pool lists endpoints, or discovers them from dns or kubernetes: one",
                    );
                }
                if pool.models.is_empty() {
                    errors.push(
                        format!("{at}.models"),
                        "a kubernetes pool must list the models its endpoints serve",
                    );
                }
                k8s.check(&format!("{at}.kubernetes"), |p, m| errors.push(p, m));
            }
            for (e, ep) in pool.endpoints.iter().enumerate() {
                total += 1;
                let at = format!("{at}.endpoints[{e}]");
                match ep.address.parse::<SocketAddr>() {
                    Ok(addr) if addr.port() == 0 => {
                        errors.push(format!("{at}.address"), "port must not be 0");
                    }
                    Ok(addr) if addr.ip().is_unspecified() => errors.push(
                        format!("{at}.address"),
                        format!("{addr} is a wildcard address; give the replica's own IP"),
                    ),
                    Ok(addr) => {
                        if !addresses.insert(addr) {
                            errors.push(
                                format!("{at}.address"),
                                format!("{addr} is listed more than once"),
                            );
                        }
                    }
                    Err(_) if ep.address.is_empty() => {
                        errors.push(format!("{at}.address"), "is required");
                    }
                    Err(_) => errors.push(
                        format!("{at}.address"),
                        format!(
                            "{:?} is not an ip:port (IPv6 as [::1]:8000; Envoy's ORIGINAL_DST \
                             cluster needs an IP, not a host name)",
                            ep.address
                        ),
                    ),
                }
                if ep.models.is_empty() && pool.models.is_empty() {
                    errors.push(
                        format!("{at}.models"),
                        "no models: list them on the endpoint or on its pool",
                    );
                }
                model_list(errors, &format!("{at}.models"), &ep.models);
                model_list(errors, &format!("{at}.adapters"), &ep.adapters);
                check_labels(errors, &format!("{at}.labels"), &ep.labels);
                positive_finite(errors, &format!("{at}.weight"), ep.weight);
                if ep.max_in_flight == Some(0) {
                    errors.push(format!("{at}.max_in_flight"), "must be > 0 when set");
                }
            }
        }
        if total == 0 {
            errors.push("pools", "no endpoints configured");
        }
    }
}

/// Model (or adapter) names a pool or endpoint serves: none empty, none twice.
fn model_list(errors: &mut Errors, path: &str, names: &[String]) {
    for (m, name) in names.iter().enumerate() {
        if name.trim().is_empty() {
            errors.push(format!("{path}[{m}]"), "must not be empty");
        } else if names[..m].contains(name) {
            errors.push(format!("{path}[{m}]"), format!("{name:?} is listed twice"));
        }
    }
}

/// Label names and values are free text but not empty names.
fn check_labels(
    errors: &mut Errors,
    at: &str,
    labels: &std::collections::BTreeMap<String, String>,
) {
    if labels.keys().any(|k| k.trim().is_empty()) {
        errors.push(at, "a label name must not be empty");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
models:
  - name: m1
    tokenizer: tokenizers/m1
    block_size_tokens: 32
tenancy:
  header: x-tenant-id
  share_groups:
    - name: acme
      tenants: [acme-prod, acme-staging]
pools:
  - name: a
    models: [m1]
    endpoints:
      - address: 127.0.0.1:8001
      - address: "[::1]:8002"
        models: [m2]
        adapters: [lora-x]
        weight: 2
"#;

    fn errors_of(yaml: &str) -> Vec<String> {
        Config::from_yaml(yaml)
            .expect("parses")
            .validate()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn a_unix_socket_path_must_fit_the_kernels_limit() {
        let with = |path: &str| format!("server:\n  grpc_unix_socket: \"{path}\"\n{GOOD}");
        assert!(errors_of(&with("/run/kvrouter/grpc.sock")).is_empty());
        let long = format!("/run/{}", "k".repeat(102));
        assert!(errors_of(&with(&long)).is_empty(), "107 bytes fit");
        let longer = format!("{long}k");
        let errors = errors_of(&with(&longer));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("server.grpc_unix_socket"), "{errors:?}");
        assert!(errors[0].contains("108 bytes"), "{errors:?}");
        assert_eq!(errors_of(&with("")).len(), 1);
    }

    #[test]
    fn the_long_body_burst_makes_room_for_the_largest_body_within_the_wait() {
        let mib = 1u64 << 20;
        let routing = |rate: Option<u64>, wait_ms: u64| super::super::RoutingConfig {
            heavy_body_bytes_per_s: rate,
            heavy_body_max_wait_ms: wait_ms,
            ..Default::default()
        };
        // 32 MiB bodies (and 64 KiB of envelope) at 16 MiB/s within 1 s: 16 MiB of burst.
        let r = routing(Some(16 * mib), 1000);
        assert_eq!(r.heavy_burst(), 16 * mib + (64 << 10));
        assert_eq!(
            r.heavy_burst() + r.heavy_rate() * r.heavy_body_max_wait_ms / 1000,
            r.max_body_bytes as u64 + (64 << 10)
        );
        // Fast enough alone: the 4 MiB floor.
        assert_eq!(routing(Some(64 * mib), 1000).heavy_burst(), 4 * mib);
        // No rate or no bound: nothing to make room for.
        assert_eq!(routing(Some(0), 1000).heavy_burst(), 4 * mib);
        assert_eq!(routing(Some(mib), 0).heavy_burst(), 4 * mib);
        // A slow rate: nearly all of the body is the burst.
        assert_eq!(
            routing(Some(mib), 2000).heavy_burst(),
            30 * mib + (64 << 10)
        );
    }

    #[test]
    fn hardening_limits_have_defaults_and_engine_capacity_is_clamped() {
        let config = Config::from_yaml(GOOD).unwrap();
        let limits = config.routing.request_limits();
        assert_eq!(
            (limits.max_messages, limits.max_content_parts),
            (10_000, 20_000)
        );
        assert_eq!(config.routing.prefix_budget_ms, 100);
        assert_eq!(config.load.scrape.max_body_bytes, 4 << 20);
        let c = &config.cache_index;
        assert_eq!(c.clamp_engine_capacity(1000), 1000);
        assert_eq!(c.clamp_engine_capacity(u64::MAX), 8 << 20);
        let start = std::time::Instant::now();
        assert_eq!(
            config.routing.prefix_deadline(start),
            Some(start + std::time::Duration::from_millis(100))
        );
        let off = Config::from_yaml("routing: {prefix_budget_ms: 0}").unwrap();
        assert_eq!(off.routing.prefix_deadline(start), None);
        let m = &config.models[0];
        assert_eq!(
            (m.template_fuel, m.max_rendered_prompt_bytes),
            (10_000_000, 64 << 20)
        );
    }

    #[test]
    fn good_config_is_valid_and_resolves_pool_defaults() {
        let config = Config::from_yaml(GOOD).unwrap();
        assert_eq!(config.validate(), vec![]);
        let eps = config.resolved_endpoints();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].models, vec!["m1"]);
        assert_eq!(eps[1].models, vec!["m2"]);
        assert_eq!(eps[1].adapters, vec!["lora-x"]);
        assert_eq!(eps[1].weight, 2.0);
        assert_eq!(eps[1].address.to_string(), "[::1]:8002");
        assert_eq!(config.models[0].block_size_tokens, 32);
        assert_eq!(config.models[0].max_prefix_tokens, 32_768, "default");
        assert_eq!(config.tenancy.share_groups[0].tenants.len(), 2);
        assert_eq!(config.cache_index.prediction_ttl_ms, 120_000, "default");
    }

    #[test]
    fn bad_values_are_reported_with_their_paths() {
        let cases: &[(&str, &str)] = &[
            (
                "pools: [{name: a, models: [m], endpoints: [{address: 'localhost:80'}]}]",
                "pools[0].endpoints[0].address: \"localhost:80\" is not an ip:port",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:0'}]}]",
                "pools[0].endpoints[0].address: port must not be 0",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '0.0.0.0:80'}]}]",
                "pools[0].endpoints[0].address: 0.0.0.0:80 is a wildcard address",
            ),
            (
                "pools: [{name: a, endpoints: [{address: '127.0.0.1:1'}]}]",
                "pools[0].endpoints[0].models: no models",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1', weight: 0}]}]",
                "pools[0].endpoints[0].weight: must be a finite number > 0 (got 0)",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}, {address: '127.0.0.1:1'}]}]",
                "pools[0].endpoints[1].address: 127.0.0.1:1 is listed more than once",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}, {name: a, models: [m], endpoints: [{address: '127.0.0.1:2'}]}]",
                "pools[1].name: \"a\" is used by another pool",
            ),
            ("pools: []", "pools: no endpoints configured"),
            (
                "routing: {destination_header: 'X-Bad Header'}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "routing.destination_header: \"X-Bad Header\" is not a lowercase HTTP header name",
            ),
            (
                "policy: {least_loaded: {tokens_per_request: -1}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "policy.least_loaded.tokens_per_request: must be a finite number > 0",
            ),
            (
                "policy: {predicted_ttft: {externality_weight: -0.5}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "policy.predicted_ttft.externality_weight: must be a finite number >= 0 (got -0.5)",
            ),
            (
                "policy: {predicted_ttft: {tie_tolerance: 1}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "policy.predicted_ttft.tie_tolerance: must be in [0, 1) (got 1)",
            ),
            (
                "policy: {vllm_kvaware: {qps_window_ms: 1, chunk_tokens: 0}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "policy.vllm_kvaware.chunk_tokens: must be > 0",
            ),
            (
                "policy: {sglang_cache_aware: {eviction_interval_ms: 0}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "policy.sglang_cache_aware.eviction_interval_ms: must be > 0",
            ),
            (
                "models: [{name: m}, {name: m}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[1].name: \"m\" is listed twice",
            ),
            (
                "pools: [{name: a, models: [m, m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "pools[0].models[1]: \"m\" is listed twice",
            ),
            (
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1', adapters: [x, y, x]}]}]",
                "pools[0].endpoints[0].adapters[2]: \"x\" is listed twice",
            ),
            (
                "models: [{name: m, block_size_tokens: 0}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].block_size_tokens: must be in 1..=4096 (got 0)",
            ),
            (
                "models: [{name: m, block_size_tokens: 32, max_prefix_tokens: 16}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].max_prefix_tokens: must be at least block_size_tokens (32) (got 16)",
            ),
            (
                "models: [{name: m, chat_template: t.jinja}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].tokenizer: is required when tokenizer_config or chat_template is set",
            ),
            (
                "models: [{name: m, tokenizer: ' '}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].tokenizer: must not be empty when set",
            ),
            (
                "tenancy: {header: X-Tenant}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "tenancy.header: \"X-Tenant\" is not a lowercase HTTP header name",
            ),
            (
                "tenancy: {header: x-tenant, share_groups: [{name: g, tenants: [a, b]}, {name: h, tenants: [b]}]}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "tenancy.share_groups[1].tenants[0]: \"b\" is already in tenancy.share_groups[0]",
            ),
            (
                "tenancy: {header: x-tenant, share_groups: [{name: g, tenants: [a]}, {name: g, tenants: []}]}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "tenancy.share_groups[1].name: \"g\" is used by another group",
            ),
            (
                "tenancy: {header: x-tenant, share_groups: [{name: g}]}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "tenancy.share_groups[0].tenants: must list at least one tenant",
            ),
            (
                "tenancy: {share_groups: [{name: g, tenants: [a]}]}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "tenancy.share_groups: has no effect without tenancy.header",
            ),
            (
                "cache_index: {default_capacity_blocks: 0, prediction_ttl_ms: 0}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "cache_index.default_capacity_blocks: must be > 0",
            ),
            (
                "cache_index: {prediction_ttl_ms: 0}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "cache_index.prediction_ttl_ms: must be > 0",
            ),
            (
                "pools: [{name: a, models: [m], dns: {name: svc, port: 0, refresh_ms: 10}}]",
                "pools[0].dns.port: is required",
            ),
            (
                "pools: [{name: a, models: [m], dns: {name: svc, port: 80, refresh_ms: 10}}]",
                "pools[0].dns.refresh_ms: must be >= 100",
            ),
            (
                "pools: [{name: a, models: [m], dns: {name: '', port: 80}}]",
                "pools[0].dns.name: is required",
            ),
            (
                "pools: [{name: a, dns: {name: svc, port: 80}}]",
                "pools[0].models: a dns pool must list the models",
            ),
            (
                "pools: [{name: a, models: [m], dns: {name: svc, port: 80}, endpoints: [{address: '127.0.0.1:1'}]}]",
                "pools[0].dns: a pool lists endpoints or discovers them from dns, not both",
            ),
            (
                "load: {scrape: {interval_ms: 5}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.scrape.interval_ms: must be >= 10",
            ),
            (
                "load: {scrape: {jitter: 0.9}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.scrape.jitter: must be in 0..=0.5",
            ),
            (
                "load: {scrape: {path: metrics}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.scrape.path: \"metrics\" must start with /",
            ),
            (
                "load: {learning: {alpha: 0}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.learning.alpha: must be in (0, 1]",
            ),
            (
                "load: {learning: {min_prefill_tokens_per_s: 500, max_prefill_tokens_per_s: 100}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.learning.max_prefill_tokens_per_s: must be finite and >= min",
            ),
            (
                "routing: {max_messages: 0}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "routing.max_messages: must be > 0",
            ),
            (
                "routing: {max_content_parts: 0}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "routing.max_content_parts: must be > 0",
            ),
            (
                "models: [{name: m, template_fuel: 0}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].template_fuel: must be > 0",
            ),
            (
                "models: [{name: m, max_rendered_prompt_bytes: 0}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].max_rendered_prompt_bytes: must be > 0",
            ),
            (
                "models: [{name: m, defer_tokenizing_after: 1.5}]\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "models[0].defer_tokenizing_after: must be between 0 and 1",
            ),
            (
                "cache_index: {max_engine_capacity_tokens: 0}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "cache_index.max_engine_capacity_tokens: must be > 0",
            ),
            (
                "pools: [{name: a, models: [m], dns: {name: svc, port: 80, max_addresses: 0}}]",
                "pools[0].dns.max_addresses: must be in 1..=4096 (got 0)",
            ),
            (
                "load: {scrape: {max_body_bytes: 100}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "load.scrape.max_body_bytes: must be at least 65536",
            ),
            (
                "health: {probe: {failure_threshold: 0}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "health.probe.failure_threshold: must be > 0",
            ),
            (
                "health: {breaker: {open_ms: 1000, max_open_ms: 10}}\npools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "health.breaker.max_open_ms: must be >= open_ms",
            ),
        ];
        for (yaml, expected) in cases {
            let errors = errors_of(yaml);
            assert!(
                errors.iter().any(|e| e.starts_with(expected)),
                "for {yaml}\nexpected an error starting with {expected:?}\ngot {errors:#?}"
            );
        }
    }

    #[test]
    fn dns_pool_counts_as_endpoints_and_signal_sections_have_defaults() {
        let config = Config::from_yaml(
            "pools: [{name: a, models: [m], engine: sglang, dns: {name: vllm.svc, port: 8000}}]",
        )
        .unwrap();
        assert_eq!(config.validate(), vec![]);
        let dns = config.pools[0].dns.as_ref().unwrap();
        assert_eq!(dns.refresh_ms, 5000, "default");
        assert_eq!(config.pools[0].engine, crate::config::EngineKind::Sglang);
        assert!(
            config.resolved_endpoints().is_empty(),
            "dns endpoints come later"
        );
        assert_eq!(config.load.scrape.interval_ms, 50);
        assert_eq!(config.load.scrape.staleness_ms, 2000);
        assert_eq!(config.health.breaker.failure_threshold, 3);
        assert_eq!(config.health.probe.path, "/health");
    }

    #[test]
    fn unknown_fields_and_bad_types_are_parse_errors_naming_the_field() {
        let err = Config::from_yaml("pools: [{name: a, endpoints: [{adress: x}]}]").unwrap_err();
        assert!(err.contains("unknown field `adress`"), "{err}");
        assert!(err.contains("pools[0].endpoints[0]"), "{err}");
        let err = Config::from_yaml("policy: {name: fastest}").unwrap_err();
        assert!(err.contains("unknown variant `fastest`"), "{err}");
        assert!(err.contains("least-loaded"), "{err}");
    }

    #[test]
    fn header_names() {
        assert!(is_header_name("x-gateway-destination-endpoint"));
        assert!(!is_header_name(""));
        assert!(!is_header_name("X-Upper"));
        assert!(!is_header_name(":authority"));
        assert!(!is_header_name("a b"));
    }
}
