//! The `kvsim` binary as a user runs it: a YAML fleet, the listening lines, the HTTP API on
//! each replica's own port, config errors naming the field, clean exit on SIGTERM and SIGINT.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::timeout;

const DEADLINE: Duration = Duration::from_secs(20);

fn kvsim() -> Command {
    let mut cmd = Command::new(testkit::kvsim_bin());
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Reads `n` listening lines from the child's stdout.
async fn listening(child: &mut Child, n: usize) -> Vec<Value> {
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut out = Vec::new();
    while out.len() < n {
        let line = timeout(DEADLINE, lines.next_line())
            .await
            .expect("listening line in time")
            .expect("read")
            .expect("a line before EOF");
        let v: Value = serde_json::from_str(&line).expect("stdout lines are JSON");
        assert_eq!(v["event"], "listening");
        out.push(v);
    }
    out
}

fn signal(child: &Child, name: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

async fn exits_cleanly(mut child: Child) {
    let status = timeout(DEADLINE, child.wait())
        .await
        .expect("exits in time")
        .expect("wait");
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test]
async fn a_fleet_file_starts_replicas_each_on_its_own_port() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    std::fs::write(
        &path,
        r#"
replicas:
  - name: r1
    models: [llama]
    adapters: [sql-lora]
    profile: h100-llama3-8b
    time_scale: 50
    kv_events: {endpoint: "tcp://127.0.0.1:0", bind: true}
  - name: r2
    listen: 127.0.0.1:0
    models: [llama]
    profile: a100-llama3-8b
    num_gpu_blocks: 2000
    max_num_seqs: 16
    time_scale: 50
"#,
    )
    .unwrap();
    let mut child = kvsim()
        .arg("--fleet")
        .arg(&path)
        .spawn()
        .expect("kvsim starts");
    let lines = listening(&mut child, 2).await;
    assert_eq!(lines[0]["name"], "r1");
    assert!(lines[0]["kv_events"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    assert_eq!(lines[1]["name"], "r2");
    assert!(lines[1].get("kv_events").is_none());
    assert_ne!(lines[0]["addr"], lines[1]["addr"]);

    let http = reqwest::Client::new();
    let base = |i: usize| format!("http://{}", lines[i]["addr"].as_str().unwrap());
    let models = http
        .get(format!("{}/v1/models", base(0)))
        .send()
        .await
        .unwrap();
    assert_eq!(models.headers()["x-kvsim-replica"], "r1");
    let models: Value = models.json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["llama", "sql-lora"]);
    assert_eq!(models["data"][1]["parent"], "llama");

    let resp = http
        .post(format!("{}/v1/chat/completions", base(1)))
        .json(
            &serde_json::json!({"model": "llama", "stream": true, "max_tokens": 5,
            "messages": [{"role": "user", "content": "hello there"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-kvsim-replica"], "r2");
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"usage\""));

    let missing = http
        .post(format!("{}/v1/completions", base(1)))
        .json(&serde_json::json!({"model": "nope", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let missing: Value = missing.json().await.unwrap();
    assert_eq!(
        missing["error"]["message"],
        "The model `nope` does not exist."
    );
    let bad = http
        .post(format!("{}/v1/completions", base(1)))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // Admin over real loopback TCP: the peer address reaches the handler.
    let state = http
        .get(format!("{}/admin/state", base(0)))
        .send()
        .await
        .unwrap();
    assert_eq!(state.status(), 200);
    let metrics = http
        .get(format!("{}/metrics", base(1)))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("vllm:cache_config_info{block_size=\"16\""));
    assert!(metrics.contains("num_gpu_blocks=\"2000\""));

    signal(&child, "TERM");
    exits_cleanly(child).await;
}

#[tokio::test]
async fn single_replica_flags_and_sigint() {
    let mut child = kvsim()
        .args([
            "--name",
            "solo",
            "--model",
            "a",
            "--model",
            "b",
            "--profile",
            "l4-llama3-8b",
            "--time-scale",
            "100",
        ])
        .spawn()
        .expect("kvsim starts");
    let lines = listening(&mut child, 1).await;
    assert_eq!(lines[0]["name"], "solo");
    let health = reqwest::get(format!(
        "http://{}/health",
        lines[0]["addr"].as_str().unwrap()
    ))
    .await
    .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.headers()["x-kvsim-replica"], "solo");
    signal(&child, "INT");
    exits_cleanly(child).await;
}

#[tokio::test]
async fn an_unknown_field_is_an_error_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, "replicas:\n  - name: r1\n    blocksize: 16\n").unwrap();
    let mut child = kvsim()
        .arg("--fleet")
        .arg(&path)
        .spawn()
        .expect("kvsim starts");
    let status = timeout(DEADLINE, child.wait())
        .await
        .expect("exits")
        .expect("wait");
    assert!(!status.success());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert!(stderr.contains("unknown field `blocksize`"), "{stderr}");
    assert!(stderr.contains("replicas[0]"), "{stderr}");
}

#[test]
fn the_local_stack_fleet_file_is_valid() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/fleet.yaml");
    let fleet = kvsim::FleetConfig::load(&path).expect("valid fleet file");
    assert_eq!(fleet.replicas.len(), 4);
    let profiles: std::collections::BTreeSet<&str> =
        fleet.replicas.iter().map(|r| r.profile.as_str()).collect();
    assert!(profiles.len() >= 2, "a heterogeneous fleet");
}
