//! kvrouter as an InferencePool's endpoint picker, end to end: started with the reference
//! picker's flags (`--pool-name`, `--pool-namespace`, `--kubeconfig`) and the picker config of
//! `deploy/overlays/inferencepool`, it finds the pool's pods through a kubeconfig pointing at
//! RECORDED API responses (`kube_api`; no kube-apiserver can run here), answers the gRPC health
//! service on the ext_proc port and on the health port (NOT_SERVING until the pool is listed,
//! then SERVING, for `""` and `inference-extension`), subscribes to each pod's KV events from
//! the pool's template, and routes a request through real Envoy (FULL_DUPLEX_STREAMED, as
//! InferencePool gateways drive a picker) to a kvsim replica "pod" on a loopback address.

mod kube_api;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use kube_api::{key, list, ApiServer, Reply};
use kvrouter::envoyconf::{BodyMode, ClusterStyle};
use testkit::*;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const PODS: &str = "/api/v1/namespaces/llm/pods";
const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools";

/// Starts kvsim on `ip`:`port` (0: any), publishing KV events bound on `ip`:`kv_port`.
fn pod_replica(
    dir: &std::path::Path,
    name: &str,
    ip: &str,
    port: u16,
    kv_port: u16,
) -> (Proc, SocketAddr, u16) {
    let mut cmd = Command::new(kvsim_bin());
    cmd.args([
        "--name",
        name,
        "--model",
        "qwen3-8b",
        "--listen",
        &format!("{ip}:{port}"),
    ])
    .args([
        "--kv-events",
        &format!("tcp://{ip}:{kv_port}"),
        "--kv-events-bind",
    ]);
    let (proc, lines) = Proc::spawn(name, cmd, dir, 1).unwrap_or_else(|e| panic!("{e}"));
    let addr: SocketAddr = lines[0]["addr"].as_str().unwrap().parse().unwrap();
    let kv = lines[0]["kv_events"].as_str().unwrap();
    let kv_port = kv.rsplit_once(':').unwrap().1.parse().unwrap();
    (proc, addr, kv_port)
}

/// The health status of `service` at `addr`, asked by a real gRPC client.
async fn health(addr: SocketAddr, service: &str) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let mut client = HealthClient::new(channel);
    let resp = client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("check {service:?} at {addr}: {e}"))
        .into_inner();
    ServingStatus::try_from(resp.status).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picker_started_with_the_reference_flags_finds_the_pool_and_routes_through_envoy() {
    let dir = tempfile::tempdir().unwrap();
    // Two "pods" on their own loopback addresses, serving and publishing on the same ports, as
    // pods of one Deployment do.
    let (_a, a, kv_port) = pod_replica(dir.path(), "pod-a", "127.0.0.2", 0, 0);
    let (_b, b, _) = pod_replica(dir.path(), "pod-b", "127.0.0.3", a.port(), kv_port);
    assert_eq!(b.port(), a.port());

    // The recorded pool (its target port set to the pods' port) and pods; the pool list is
    // answered only at stage 1, so the picker is seen starting first.
    let server = ApiServer::start().await;
    let by_name = "fieldSelector=metadata.name%3Dqwen3-8b";
    let pool_list =
        kube_api::recording("e2e-pool-list.json").replace("__PORT__", &a.port().to_string());
    server.script(
        key("list", POOLS, by_name),
        vec![Reply::Later {
            stage: 1,
            reply: Box::new(Reply::Json {
                status: 200,
                body: pool_list,
            }),
        }],
    );
    server.script(
        key("list", PODS, "labelSelector=app%3Dqwen3-8b"),
        vec![list("e2e-pods-list.json")],
    );

    // The overlay's picker config, with the pods' KV-event port and test-friendly reloads.
    let overlay =
        std::fs::read_to_string(repo().join("deploy/overlays/inferencepool/kvrouter.yaml"))
            .unwrap();
    let config_text = overlay
        .replace("tcp://{ip}:5557", &format!("tcp://{{ip}}:{kv_port}"))
        .replace("    tokenizer: /var/lib/kvrouter/tokenizers/qwen3\n", "")
        .replace("log_format: json", "log_format: text");
    assert!(
        config_text.contains(&format!("tcp://{{ip}}:{kv_port}")),
        "the overlay's template"
    );
    let config = dir.path().join("kvrouter.yaml");
    std::fs::write(&config, &config_text).unwrap();
    let kubeconfig = server.kubeconfig(dir.path());
    let mut cmd = Command::new(kvrouter_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .args([
            "--pool-name",
            "qwen3-8b",
            "--pool-namespace",
            "llm",
            "--kubeconfig",
        ])
        .arg(&kubeconfig)
        // Loopback ephemeral ports instead of --grpc-port/--grpc-health-port/--metrics-port,
        // which listen on every interface (their mapping has its own test).
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--health-listen", "127.0.0.1:0"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", router::TEST_LOG_FILTER);
    let (proc, lines) =
        Proc::spawn("kvrouter", cmd, dir.path(), 1).unwrap_or_else(|e| panic!("{e}"));
    let addr = |k: &str| -> SocketAddr {
        lines[0][k]
            .as_str()
            .unwrap_or_else(|| panic!("{k} in {}", lines[0]))
            .parse()
            .unwrap()
    };
    let (grpc, admin, health_port) = (addr("grpc"), addr("admin"), addr("health"));

    // Starting: the pool is not listed yet.
    for port in [grpc, health_port] {
        for service in ["", "inference-extension"] {
            assert_eq!(
                health(port, service).await,
                ServingStatus::NotServing,
                "{port} {service:?} while starting"
            );
        }
        // The liveness probe's name: alive while unready.
        assert_eq!(
            health(port, kvrouter::serve::health::LIVENESS).await,
            ServingStatus::Serving,
            "{port} liveness while starting"
        );
    }
    let client = reqwest::Client::new();
    let readyz = client
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(readyz.status(), 503, "not ready before the pool is listed");

    // The pool and its pods are listed: ready, on both ports, for both names.
    server.stage(1);
    eventually(
        "SERVING on the health port",
        Duration::from_secs(20),
        || async {
            (health(health_port, "inference-extension").await == ServingStatus::Serving)
                .then_some(())
        },
    )
    .await;
    for port in [grpc, health_port] {
        for service in ["", "inference-extension"] {
            assert_eq!(
                health(port, service).await,
                ServingStatus::Serving,
                "{port} {service:?}"
            );
        }
    }
    let readyz = client
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(readyz.status(), 200);

    // Both pods are endpoints of the pool, from the Kubernetes source, each subscribed to its
    // own KV events (tcp://{ip}:PORT).
    let table: serde_json::Value = client
        .get(format!("http://{admin}/debug/endpoints"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let eps = table["endpoints"].as_array().unwrap();
    assert_eq!(eps.len(), 2, "{table}");
    for (ep, want) in eps.iter().zip([a, b]) {
        assert_eq!(ep["address"], want.to_string());
        assert_eq!(ep["source"], "kubernetes:qwen3-8b");
        assert_eq!(ep["draining"], false);
    }

    // A request through real Envoy in FULL_DUPLEX_STREAMED mode reaches one of the pods.
    let router = Router {
        grpc,
        admin,
        grpc_unix: None,
        config: config.clone(),
        proc,
    };
    let options = envoy_options(
        &router,
        dir.path(),
        ClusterStyle::OverrideHost,
        BodyMode::FullDuplex,
        Some(vec![a, b]),
    );
    let envoy = start_envoy(dir.path(), &kvrouter::envoyconf::render(&options)).await;
    envoy.wait_for_hosts(&[a, b]).await.unwrap();
    let prompt = "Summarise the shipping policy for international parcels. ".repeat(40);
    let reply = post(
        &reqwest::Client::new(),
        envoy.addr,
        "/v1/chat/completions",
        chat_body("qwen3-8b", &prompt, false, 4),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    wait_for_decisions(admin, 1).await;
    // The pod that served it published its blocks, and the picker received them.
    eventually(
        "the serving pod's KV events",
        Duration::from_secs(20),
        || async {
            let table: serde_json::Value = client
                .get(format!("http://{admin}/debug/endpoints"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let events: u64 = table["endpoints"]
                .as_array()?
                .iter()
                .filter_map(|e| e["kv_events"]["events"].as_u64())
                .sum();
            (events > 0).then_some(())
        },
    )
    .await;
    drop(envoy);
    drop(router);
}
