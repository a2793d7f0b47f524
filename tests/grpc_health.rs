//! The gRPC health service (`grpc.health.v1.Health`) of a started kvrouter, asked by a real gRPC
//! client: every answered name on the ext_proc port and on the health port, NOT_SERVING
//! announced to a watcher when kvrouter shuts down, and the ext_proc port over TLS
//! (`--cert-path`, as the reference picker's Secret layout).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use testkit::*;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn request(service: &str) -> HealthCheckRequest {
    HealthCheckRequest {
        service: service.to_string(),
    }
}

/// Starts kvrouter over one static endpoint with `extra` args; returns it with its health port.
fn start(dir: &Path, extra: &[&str]) -> (Router, Option<SocketAddr>) {
    let config = dir.join("kvrouter.yaml");
    std::fs::write(
        &config,
        "pools: [{name: p, models: [m], endpoints: [{address: '127.0.0.1:9'}]}]\n",
    )
    .unwrap();
    let mut cmd = Command::new(kvrouter_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(extra);
    let (proc, lines) = Proc::spawn("kvrouter", cmd, dir, 1).unwrap_or_else(|e| panic!("{e}"));
    let addr = |k: &str| lines[0][k].as_str().map(|a| a.parse().unwrap());
    let router = Router {
        grpc: addr("grpc").unwrap(),
        admin: addr("admin").unwrap(),
        grpc_unix: None,
        config,
        proc,
    };
    (router, addr("health"))
}

async fn client(addr: SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    HealthClient::new(channel)
}

async fn status(client: &mut HealthClient<Channel>, service: &str) -> ServingStatus {
    let resp = client
        .check(request(service))
        .await
        .unwrap_or_else(|e| panic!("check {service:?}: {e}"));
    ServingStatus::try_from(resp.into_inner().status).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_name_is_served_on_both_ports_and_shutdown_announces_not_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (router, health) = start(dir.path(), &["--health-listen", "127.0.0.1:0"]);
    let health = health.expect("the health port in the listening line");
    router.wait_ready().await.unwrap();
    for port in [router.grpc, health] {
        let mut c = client(port).await;
        for name in kvrouter::serve::health::SERVICE_NAMES {
            let s = eventually("SERVING", STARTUP, || {
                let mut c = c.clone();
                async move { (status(&mut c, name).await == ServingStatus::Serving).then_some(()) }
            });
            s.await;
        }
        let unknown = c.check(request("no-such-service")).await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{port}");
    }
    assert_eq!(kvrouter::serve::health::SERVICE_NAMES.len(), 3);

    // A watcher on the health port sees NOT_SERVING when kvrouter is told to stop.
    let mut watch = client(health)
        .await
        .watch(request("inference-extension"))
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(
        ServingStatus::try_from(first.status),
        Ok(ServingStatus::Serving)
    );
    let pid = router.proc.pid().expect("running").to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let next = watch
        .message()
        .await
        .expect("a status before the stream ends");
    let next = next.expect("NOT_SERVING, not the end of the stream");
    assert_eq!(
        ServingStatus::try_from(next.status),
        Ok(ServingStatus::NotServing)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ext_proc_port_serves_tls_with_a_cert_path() {
    let dir = tempfile::tempdir().unwrap();
    let certs = repo().join("tests/data/tls");
    let (router, health) = start(
        dir.path(),
        &["--secure-serving", "--cert-path", certs.to_str().unwrap()],
    );
    assert_eq!(health, None, "no health port unless asked");
    router.wait_ready().await.unwrap();
    let ca = std::fs::read(certs.join("ca.crt")).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://{}", router.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("a TLS connection");
    let mut c = HealthClient::new(channel);
    assert_eq!(
        status(&mut c, "inference-extension").await,
        ServingStatus::Serving
    );
    // A plaintext client gets no answer from the TLS port.
    let plain = Channel::from_shared(format!("http://{}", router.grpc))
        .unwrap()
        .connect()
        .await;
    let refused = match plain {
        Err(_) => true,
        Ok(ch) => HealthClient::new(ch).check(request("")).await.is_err(),
    };
    assert!(refused, "plaintext must not be answered on the TLS port");
}
