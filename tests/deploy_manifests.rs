//! The files in `deploy/` that kvrouter's own code defines: the sidecar overlay's Envoy bootstrap
//! is what `kvrouter envoy-config` renders and real Envoy 1.40 accepts it; the EDS seed its init
//! container writes is what kvrouter writes for an empty endpoint set; the configs parse with
//! kvrouter's schema and agree with the ports and paths of the manifests. (`make deploy-check`
//! validates the rendered Kubernetes objects themselves.)

use testkit as common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

use common::*;
use kvrouter::config::Config;
use kvrouter::envoyconf::{eds_json, render, EnvoyOptions, Replicas};

/// Where the sidecar's kvrouter writes the EDS file Envoy reads (a shared in-memory volume).
const EDS_DIR: &str = "/run/kvrouter";

fn deploy(path: &str) -> PathBuf {
    repo().join("deploy").join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("deploy/{path}: {e}"))
}

/// The options the committed bootstrap was rendered with (see the overlay's kustomization.yaml):
/// clients reach Envoy on every interface, its admin and kvrouter stay on loopback.
fn sidecar_options() -> EnvoyOptions {
    EnvoyOptions {
        listen: "0.0.0.0:8080".parse().unwrap(),
        admin: "127.0.0.1:9901".parse().unwrap(),
        extproc: "127.0.0.1:9002".parse().unwrap(),
        replicas: Replicas::EdsFile(format!("{EDS_DIR}/eds.json").into()),
        ..EnvoyOptions::default()
    }
}

#[test]
fn sidecar_envoy_bootstrap_matches_the_generator() {
    assert!(
        read("overlays/sidecar/envoy.yaml") == render(&sidecar_options()),
        "deploy/overlays/sidecar/envoy.yaml is out of date: regenerate it with the command in \
         deploy/overlays/sidecar/kustomization.yaml"
    );
}

#[test]
fn sidecar_envoy_bootstrap_validates() {
    // Envoy checks that the EDS directory exists: validate a copy that points at a temporary one.
    let dir = tempfile::tempdir().unwrap();
    let eds_dir = dir.path().join("eds");
    std::fs::create_dir(&eds_dir).unwrap();
    std::fs::write(eds_dir.join("eds.json"), eds_json(0, &[])).unwrap();
    let bootstrap = read("overlays/sidecar/envoy.yaml");
    assert!(
        bootstrap.contains(EDS_DIR),
        "the bootstrap reads EDS from {EDS_DIR}"
    );
    let relocated = bootstrap.replace(EDS_DIR, eds_dir.to_str().unwrap());
    let file = dir.path().join("envoy.yaml");
    std::fs::write(&file, relocated).unwrap();
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&file)
        .output()
        .expect("run envoy");
    assert!(
        out.status.success(),
        "Envoy rejects the sidecar bootstrap:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sidecar_eds_seed_is_what_kvrouter_writes_for_no_endpoints() {
    let gateway = read("overlays/sidecar/gateway.yaml");
    let seed = eds_json(0, &[]);
    assert!(
        gateway.contains(&format!("'{seed}'")),
        "the seed-eds init container must write {seed} (kvrouter's own empty EDS file)"
    );
    assert!(gateway.contains(&format!("{EDS_DIR}/eds.json")));
}

#[test]
fn sidecar_config_is_valid_and_matches_the_bootstrap() {
    let config = Config::load(&deploy("overlays/sidecar/kvrouter.yaml"))
        .unwrap_or_else(|e| panic!("deploy/overlays/sidecar/kvrouter.yaml: {e}"));
    let envoy = sidecar_options();
    assert_eq!(
        config.server.grpc_listen, envoy.extproc,
        "Envoy calls kvrouter here"
    );
    let admin: SocketAddr = "0.0.0.0:9090".parse().unwrap();
    assert_eq!(
        config.server.admin_listen, admin,
        "the probes use the `admin` port"
    );
    assert_eq!(
        Replicas::EdsFile(config.envoy.eds_path.clone().expect("eds_path")),
        envoy.replicas,
        "kvrouter writes the EDS file Envoy reads"
    );
    assert_eq!(config.pools.len(), 1);
    let dns = config.pools[0]
        .dns
        .as_ref()
        .expect("the sidecar finds replicas by DNS");
    assert_eq!(
        (dns.name.as_str(), dns.port),
        ("qwen3-8b", 8000),
        "the examples' headless Service"
    );
}

#[test]
fn inferencepool_config_lacks_only_the_pool_discovery() {
    // The picker's endpoints come from the InferencePool named by --pool-name; until kvrouter's
    // config can say so, the only complaint allowed is the pool's missing endpoint source.
    let text = read("overlays/inferencepool/kvrouter.yaml");
    let config = Config::from_yaml(&text).expect("parses with kvrouter's schema");
    let admin: SocketAddr = "0.0.0.0:9090".parse().unwrap();
    let grpc: SocketAddr = "0.0.0.0:9002".parse().unwrap();
    assert_eq!(
        config.server.grpc_listen, grpc,
        "the gateway dials the Service"
    );
    assert_eq!(config.server.admin_listen, admin);
    assert!(config.envoy.eds_path.is_none());
    // Today that is `pools: no endpoints configured`; once a pool can come from an InferencePool
    // the list empties (or names the new field's absence under pools[0]).
    let errors: Vec<String> = config.validate().iter().map(|e| e.to_string()).collect();
    assert!(
        errors
            .iter()
            .all(|e| e == "pools: no endpoints configured" || e.starts_with("pools[0]")),
        "config errors beyond the pool's endpoint source: {errors:?}"
    );
}
