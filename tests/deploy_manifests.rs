//! The files in `deploy/` that kvrouter's own code defines: the sidecar overlay's Envoy bootstrap
//! is what `kvrouter envoy-config` renders and real Envoy 1.40 accepts it; the EDS seed its init
//! container writes is what kvrouter writes for an empty endpoint set; the configs parse with
//! kvrouter's schema and agree with the ports and paths of the manifests. (`make deploy-check`
//! validates the rendered Kubernetes objects themselves.)

use testkit as common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kvrouter::config::Config;
use kvrouter::envoyconf::{eds_json, render, EnvoyOptions, ExtprocAddress, Replicas};

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
        extproc: "unix:/run/kvrouter/grpc.sock".parse().unwrap(),
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
    let socket = config
        .server
        .grpc_unix_socket
        .clone()
        .expect("a Unix socket");
    assert_eq!(
        envoy.extproc,
        ExtprocAddress::Unix(socket.clone()),
        "Envoy calls kvrouter here"
    );
    assert_eq!(
        socket.parent(),
        Some(Path::new(EDS_DIR)),
        "on the volume both containers mount"
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

/// The picker container's args and probes from `overlays/inferencepool/picker.yaml`, with the
/// `$(NAMESPACE)` the kubelet substitutes set to the overlay's namespace.
fn picker_container() -> serde_norway::Value {
    let patch: serde_norway::Value =
        serde_norway::from_str(&read("overlays/inferencepool/picker.yaml")).unwrap();
    patch["spec"]["template"]["spec"]["containers"][0].clone()
}

fn picker_args() -> Vec<String> {
    picker_container()["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .map(|a| {
            a.as_str()
                .expect("string arg")
                .replace("$(NAMESPACE)", "llm")
        })
        .collect()
}

#[test]
fn inferencepool_picker_args_make_the_config_valid_and_match_the_manifests() {
    let text = read("overlays/inferencepool/kvrouter.yaml");
    // Without the flags the pool has no endpoint source; --pool-name gives it one.
    let bare: Vec<String> = Config::from_yaml(&text)
        .expect("parses with kvrouter's schema")
        .validate()
        .iter()
        .map(|e| e.to_string())
        .collect();
    assert_eq!(bare, vec!["pools: no endpoints configured"]);

    let args = picker_args();
    assert_eq!(
        args[..3],
        ["serve", "--config", "/etc/kvrouter/kvrouter.yaml"]
    );
    let flags = &args[3..];
    // `kvrouter check-config` applies the same flags as `serve` and accepts the result.
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("kvrouter.yaml");
    // The tokenizer is baked into the image; here the model routes on the byte estimate.
    std::fs::write(
        &config_path,
        text.replace("    tokenizer: /var/lib/kvrouter/tokenizers/qwen3\n", ""),
    )
    .unwrap();
    let out = Command::new(kvrouter_bin())
        .arg("check-config")
        .arg(&config_path)
        .args(flags)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check-config {flags:?}: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("pool qwen3-8b: the pods of InferencePool qwen3-8b in namespace llm"),
        "{stdout}"
    );

    // The mapped config, as serve sees it.
    let mut picker = kvrouter::serve::picker::PickerFlags::default();
    let mut it = flags.iter();
    while let Some(flag) = it.next() {
        let value = it.next().expect("every picker flag takes a value here");
        match flag.as_str() {
            "--pool-name" => picker.pool_name = Some(value.clone()),
            "--pool-namespace" => picker.pool_namespace = Some(value.clone()),
            "--grpc-port" => picker.grpc_port = Some(value.parse().unwrap()),
            "--grpc-health-port" => picker.grpc_health_port = Some(value.parse().unwrap()),
            "--metrics-port" => picker.metrics_port = Some(value.parse().unwrap()),
            other => panic!("unexpected flag {other}"),
        }
    }
    let config = Config::parse_adjust_validate(&text, "kvrouter.yaml", |c| picker.apply(c))
        .expect("valid with the picker's flags");
    let k8s = config.pools[0]
        .kubernetes
        .clone()
        .expect("an InferencePool pool");
    assert_eq!(
        (k8s.inference_pool.as_deref(), k8s.namespace.as_deref()),
        (Some("qwen3-8b"), Some("llm"))
    );
    let at = |port: u16| -> SocketAddr { SocketAddr::from(([0, 0, 0, 0], port)) };
    assert_eq!(config.server.grpc_listen, at(9002));
    assert_eq!(config.server.health_listen, Some(at(9003)));
    assert_eq!(config.server.admin_listen, at(9090));

    // The pool's picker port, the Service and the probes agree with those ports and the health
    // service's name.
    let pool: serde_norway::Value =
        serde_norway::from_str(&read("overlays/inferencepool/inferencepool.yaml")).unwrap();
    assert_eq!(
        pool["metadata"]["name"].as_str(),
        k8s.inference_pool.as_deref()
    );
    assert_eq!(
        pool["spec"]["endpointPickerRef"]["port"]["number"].as_u64(),
        Some(9002)
    );
    let container = picker_container();
    assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(9003));
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let grpc = &container[probe]["grpc"];
        assert_eq!(grpc["port"].as_u64(), Some(9003), "{probe}");
        let service = grpc["service"].as_str().unwrap();
        if probe == "livenessProbe" {
            // Not the readiness names: they are NOT_SERVING until the pool is listed.
            assert_eq!(service, kvrouter::serve::health::LIVENESS, "{probe}");
        } else {
            assert!(
                kvrouter::serve::health::SERVICE_NAMES.contains(&service),
                "{probe} asks for {service:?}"
            );
        }
    }
}

/// A container of the sidecar overlay's Deployment patch.
fn gateway_container(name: &str) -> serde_norway::Value {
    let gateway: serde_norway::Value =
        serde_norway::from_str(&read("overlays/sidecar/gateway.yaml")).unwrap();
    gateway["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {name} container"))
        .clone()
}

fn strings(v: &serde_norway::Value) -> Vec<String> {
    v.as_sequence()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn sidecar_prestop_drains_envoy_and_a_request_in_flight_finishes() {
    // The manifest: Envoy drains at once when asked and exits after --drain-time-s; its own
    // preStop outlasts that; kvrouter's preStop is the script that asks.
    let envoy_args = strings(&gateway_container("envoy")["args"]);
    let flag = |name: &str| {
        let i = envoy_args.iter().position(|a| a == name).unwrap();
        envoy_args[i + 1].clone()
    };
    let drain_s: u64 = flag("--drain-time-s").parse().unwrap();
    assert_eq!(flag("--drain-strategy"), "immediate");
    let envoy_pre_stop = gateway_container("envoy")["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap();
    assert!(
        envoy_pre_stop > drain_s,
        "SIGTERM only after Envoy's own exit"
    );
    let script = strings(&gateway_container("kvrouter")["lifecycle"]["preStop"]["exec"]["command"]);

    // A replica that answers 1.5 s after a request arrives.
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = upstream.accept().await {
            let arrived_tx = arrived_tx.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = arrived_tx.send(());
                tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
                let _ = conn
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });

    // Envoy in front of it, with the manifest's drain strategy and a short drain time.
    let dir = tempfile::tempdir().unwrap();
    let yaml = render(&EnvoyOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin: "127.0.0.1:0".parse().unwrap(),
        replicas: Replicas::Static(vec![upstream_addr]),
        attach: false,
        ..EnvoyOptions::default()
    });
    let test_drain_s = 3u64;
    let drain = test_drain_s.to_string();
    let strategy = flag("--drain-strategy");
    let mut envoy = Envoy::start_with_args(
        &envoy_bin(),
        dir.path(),
        &yaml,
        &["--drain-time-s", &drain, "--drain-strategy", &strategy],
    )
    .await
    .unwrap();
    let (admin, listen) = (envoy.admin, envoy.addr);
    let client = reqwest::Client::new();

    let in_flight = tokio::spawn({
        let client = client.clone();
        async move {
            let r = client.get(format!("http://{listen}/")).send().await?;
            Ok::<_, reqwest::Error>((r.status().as_u16(), r.text().await?))
        }
    });
    tokio::time::timeout(STARTUP, arrived.recv())
        .await
        .expect("the request reached the replica");

    // The pod is terminating: kvrouter's preStop runs (without its wait).
    let status = tokio::process::Command::new(&script[0])
        .args(&script[1..])
        .env("ENVOY_ADMIN", admin.to_string())
        .env("DRAIN_WAIT_S", "0")
        .status()
        .await
        .unwrap();
    assert!(status.success(), "the preStop script failed: {status}");
    let asked = std::time::Instant::now();

    // Draining: a new request is still served, told to close its connection.
    let during = client
        .get(format!("http://{listen}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(during.status().as_u16(), 200);
    assert_eq!(
        during
            .headers()
            .get("connection")
            .map(|v| v.to_str().unwrap()),
        Some("close"),
        "clients are told to go elsewhere"
    );
    let (code, body) = in_flight.await.unwrap().expect("the request in flight");
    assert_eq!(
        (code, body.as_str()),
        (200, "ok"),
        "it finished through the drain"
    );
    // Once the drain time is over Envoy takes no new connection (the kubelet stops it after its
    // own preStop).
    let closed = poll_until(
        "Envoy's listener to stop after the drain time",
        std::time::Duration::from_secs(test_drain_s + 15),
        || {
            let refused = std::net::TcpStream::connect(listen).is_err();
            async move { refused.then_some(()) }
        },
    )
    .await;
    assert!(
        closed.is_ok(),
        "still accepting {:?} after the drain request",
        asked.elapsed()
    );
    assert!(
        asked.elapsed() >= std::time::Duration::from_secs(test_drain_s - 1),
        "stopped before its drain time ({:?})",
        asked.elapsed()
    );
    assert!(envoy.proc.alive(), "still running until stopped");
}
