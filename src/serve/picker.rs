//! The reference endpoint picker's flags (`--pool-name`, `--pool-namespace`, `--grpc-port`,
//! `--grpc-health-port`, `--metrics-port`, ...), so kvrouter replaces it in an InferencePool
//! deployment without other changes. Each maps onto kvrouter's config; the config file still
//! says what the pool serves (its models) and how to route.
//!
//! | flag | config |
//! | --- | --- |
//! | `--pool-name N` | the pool named `N` gets `kubernetes.inference_pool: N` |
//! | `--pool-namespace NS` | its `kubernetes.namespace: NS` |
//! | `--pool-group G` | must be `inference.networking.k8s.io` (v1) |
//! | `--kubeconfig F` | its `kubernetes.kubeconfig: F` |
//! | `--grpc-port P` | `server.grpc_listen: 0.0.0.0:P` |
//! | `--grpc-health-port P` | `server.health_listen: 0.0.0.0:P` |
//! | `--metrics-port P` | `server.admin_listen: 0.0.0.0:P` (`/metrics`, `/healthz`, `/readyz`) |
//! | `--cert-path DIR` | `server.tls: {cert_path: DIR/tls.crt, key_path: DIR/tls.key}` |
//! | `--secure-serving[=B]` | `true` needs `--cert-path` (no self-signed certificate is made); `false` serves plaintext |
//!
//! The port flags listen on every IPv4 interface, as the reference picker does (`:PORT`).

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::{Config, ConfigError, KubernetesConfig, ServerTlsConfig};

/// The InferencePool API group kvrouter reads (version v1).
pub const POOL_GROUP: &str = "inference.networking.k8s.io";

/// The reference endpoint picker's flags.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct PickerFlags {
    /// The InferencePool this kvrouter picks endpoints for: the config's pool of that name takes
    /// its endpoints from the InferencePool's selector and targetPorts.
    #[arg(long)]
    pub pool_name: Option<String>,
    /// The InferencePool's namespace. Default: the pod's own (its service account's).
    #[arg(long, requires = "pool_name")]
    pub pool_namespace: Option<String>,
    /// The InferencePool's API group; only `inference.networking.k8s.io` (v1).
    #[arg(long, requires = "pool_name")]
    pub pool_group: Option<String>,
    /// A kubeconfig to reach the API server with. Default: the pod's service account, else
    /// `$KUBECONFIG`, else `~/.kube/config`.
    #[arg(long, requires = "pool_name")]
    pub kubeconfig: Option<PathBuf>,
    /// Serve ext_proc on this port, every interface (as `--grpc-listen 0.0.0.0:PORT`).
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// Serve the gRPC health service alone on this port, every interface.
    #[arg(long)]
    pub grpc_health_port: Option<u16>,
    /// Serve the admin server (`/metrics`, `/healthz`, `/readyz`) on this port, every interface
    /// (as `--admin-listen 0.0.0.0:PORT`).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// TLS on the ext_proc port: `true` needs `--cert-path`; `false` (kvrouter's default)
    /// serves plaintext HTTP/2.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: Option<bool>,
    /// A directory holding `tls.crt` and `tls.key` (PEM) for TLS on the ext_proc port (a
    /// `kubernetes.io/tls` Secret mounted there).
    #[arg(long)]
    pub cert_path: Option<PathBuf>,
}

fn every_interface(port: u16) -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], port))
}

fn error(flag: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: flag.to_string(),
        message: message.into(),
    }
}

impl PickerFlags {
    /// Applies the flags to `config`; returns what is wrong with them (with the flag as the
    /// path). The result still needs [`Config::validate`].
    pub fn apply(&self, config: &mut Config) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        if let Some(port) = self.grpc_port {
            config.server.grpc_listen = every_interface(port);
        }
        if let Some(port) = self.grpc_health_port {
            config.server.health_listen = Some(every_interface(port));
        }
        if let Some(port) = self.metrics_port {
            config.server.admin_listen = every_interface(port);
        }
        if let Some(dir) = &self.cert_path {
            config.server.tls = Some(ServerTlsConfig {
                cert_path: dir.join("tls.crt"),
                key_path: dir.join("tls.key"),
            });
        }
        match (self.secure_serving, &self.cert_path) {
            (Some(true), None) if config.server.tls.is_none() => errors.push(error(
                "--secure-serving",
                "kvrouter makes no self-signed certificate: give --cert-path DIR (tls.crt, \
                 tls.key) or server.tls, or serve plaintext (--secure-serving=false)",
            )),
            (Some(false), Some(_)) => errors.push(error(
                "--cert-path",
                "conflicts with --secure-serving=false",
            )),
            (Some(false), None) => config.server.tls = None,
            _ => {}
        }
        if let Some(group) = &self.pool_group {
            if group != POOL_GROUP {
                errors.push(error(
                    "--pool-group",
                    format!("{group:?}: only {POOL_GROUP} (InferencePool v1) is supported"),
                ));
            }
        }
        let Some(name) = &self.pool_name else {
            return errors;
        };
        let Some(pool) = config.pools.iter_mut().find(|p| &p.name == name) else {
            let names: Vec<&str> = config.pools.iter().map(|p| p.name.as_str()).collect();
            errors.push(error(
                "--pool-name",
                format!(
                    "the config has no pool named {name:?} (pools: [{}]); add one with the models \
                     the InferencePool serves, e.g. pools: [{{name: {name}, models: [...]}}]",
                    names.join(", ")
                ),
            ));
            return errors;
        };
        if !pool.endpoints.is_empty() || pool.dns.is_some() {
            errors.push(error(
                "--pool-name",
                format!(
                    "pool {name:?} lists endpoints or dns; the InferencePool provides them: \
                     remove those"
                ),
            ));
        }
        let k8s = pool
            .kubernetes
            .get_or_insert_with(KubernetesConfig::default);
        if k8s.label_selector.is_some() || k8s.inference_pool.as_ref().is_some_and(|p| p != name) {
            errors.push(error(
                "--pool-name",
                format!(
                    "pool {name:?} already names its pods (kubernetes); remove that or the flag"
                ),
            ));
        }
        k8s.inference_pool = Some(name.clone());
        if let Some(ns) = &self.pool_namespace {
            k8s.namespace = Some(ns.clone());
        }
        if let Some(path) = &self.kubeconfig {
            k8s.kubeconfig = Some(path.clone());
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        flags: PickerFlags,
    }

    fn flags(args: &[&str]) -> PickerFlags {
        Cli::try_parse_from(std::iter::once("kvrouter").chain(args.iter().copied()))
            .unwrap()
            .flags
    }

    const PICKER: &str = "pools: [{name: qwen3-8b, models: [qwen3-8b], engine: vllm, \
                          kv_events: {connect: \"tcp://{ip}:5557\"}}]";

    #[test]
    fn the_reference_flags_give_the_equivalent_config() {
        let mut config = Config::from_yaml(PICKER).unwrap();
        let f = flags(&[
            "--pool-name",
            "qwen3-8b",
            "--pool-namespace",
            "llm",
            "--grpc-port",
            "9002",
            "--grpc-health-port",
            "9003",
            "--metrics-port",
            "9090",
        ]);
        assert_eq!(f.apply(&mut config), vec![]);
        let equivalent = Config::from_yaml(
            "server: {grpc_listen: 0.0.0.0:9002, health_listen: 0.0.0.0:9003, admin_listen: 0.0.0.0:9090}\n\
             pools: [{name: qwen3-8b, models: [qwen3-8b], engine: vllm, \
             kv_events: {connect: \"tcp://{ip}:5557\"}, \
             kubernetes: {inference_pool: qwen3-8b, namespace: llm}}]",
        )
        .unwrap();
        assert_eq!(config, equivalent);
        assert_eq!(config.validate(), vec![]);
    }

    #[test]
    fn without_the_flags_the_picker_config_has_no_endpoints() {
        let config = Config::from_yaml(PICKER).unwrap();
        let errors: Vec<String> = config.validate().iter().map(ToString::to_string).collect();
        assert_eq!(errors, vec!["pools: no endpoints configured"]);
    }

    #[test]
    fn flag_problems_name_the_flag() {
        let cases: &[(&[&str], &str, &str)] = &[
            (
                &["--pool-name", "other"],
                PICKER,
                "--pool-name: the config has no pool named \"other\" (pools: [qwen3-8b])",
            ),
            (
                &["--pool-name", "a"],
                "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]",
                "--pool-name: pool \"a\" lists endpoints or dns",
            ),
            (
                &["--pool-name", "qwen3-8b", "--pool-group", "x.io"],
                PICKER,
                "--pool-group: \"x.io\": only",
            ),
            (
                &["--secure-serving"],
                PICKER,
                "--secure-serving: kvrouter makes no self-signed certificate",
            ),
        ];
        for (args, yaml, want) in cases {
            let mut config = Config::from_yaml(yaml).unwrap();
            let errors: Vec<String> = flags(args)
                .apply(&mut config)
                .iter()
                .map(ToString::to_string)
                .collect();
            assert!(
                errors.iter().any(|e| e.starts_with(want)),
                "{args:?}: {errors:?}"
            );
        }
    }

    #[test]
    fn cert_path_turns_on_tls_with_the_secret_layout() {
        let mut config = Config::from_yaml(PICKER).unwrap();
        let f = flags(&["--secure-serving", "--cert-path", "/etc/kvrouter/tls"]);
        assert_eq!(f.apply(&mut config), vec![]);
        let tls = config.server.tls.unwrap();
        assert_eq!(tls.cert_path, PathBuf::from("/etc/kvrouter/tls/tls.crt"));
        assert_eq!(tls.key_path, PathBuf::from("/etc/kvrouter/tls/tls.key"));
        assert!(
            Cli::try_parse_from(["kvrouter", "--pool-namespace", "llm"]).is_err(),
            "needs --pool-name"
        );
    }
}
