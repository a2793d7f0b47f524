//! End-to-end load on a `kvsim` fleet process: open-loop streaming chat requests at a fixed
//! rate, round-robin over the replicas, reporting the completion rate, client-side TTFT and the
//! simulator's CPU use (from /proc), so a benchmark knows the simulator is not its bottleneck.
//! Not a criterion benchmark: it measures a process under load, not a function.
//!
//! `cargo bench --bench sim_load` (env: `SIM_LOAD_RPS` default 300, `SIM_LOAD_SECS` 10,
//! `SIM_LOAD_REPLICAS` 8, `SIM_LOAD_MAX_TOKENS` 64, `SIM_LOAD_TIME_SCALE` 1).

use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};

fn env(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// utime + stime of `pid`, in seconds (Linux).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(") ").next().unwrap_or("").split(' ').collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` / `--list`: nothing to run as a test
    }
    let rps = env("SIM_LOAD_RPS", 300.0);
    let secs = env("SIM_LOAD_SECS", 10.0);
    let replicas = env("SIM_LOAD_REPLICAS", 8.0) as usize;
    let max_tokens = env("SIM_LOAD_MAX_TOKENS", 64.0) as u32;
    let time_scale = env("SIM_LOAD_TIME_SCALE", 1.0);

    let dir = tempfile::tempdir().expect("tempdir");
    let fleet = dir.path().join("fleet.yaml");
    let mut yaml = String::from("replicas:\n");
    for i in 0..replicas {
        let profile = if i % 2 == 0 {
            "h100-llama3-8b"
        } else {
            "a100-llama3-8b"
        };
        yaml.push_str(&format!(
            "  - {{name: r{i}, models: [llama], profile: {profile}, time_scale: {time_scale}, kv_events: {{endpoint: \"tcp://127.0.0.1:0\", bind: true}}}}\n"
        ));
    }
    std::fs::write(&fleet, yaml).expect("write fleet");
    let mut child = tokio::process::Command::new(testkit::kvsim_bin())
        .arg("--fleet")
        .arg(&fleet)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kvsim starts");
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut addrs = Vec::new();
    while addrs.len() < replicas {
        let line = lines
            .next_line()
            .await
            .expect("read")
            .expect("listening line");
        let v: serde_json::Value = serde_json::from_str(&line).expect("json");
        addrs.push(v["addr"].as_str().expect("addr").to_string());
    }

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("client");
    let systems: Vec<String> = (0..16)
        .map(|s| format!("You are assistant number {s} of a logistics company. ").repeat(60))
        .collect();
    let total = (rps * secs) as usize;
    let interval = Duration::from_secs_f64(1.0 / rps);
    let cpu_start = cpu_seconds(pid);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        tokio::time::sleep_until((start + interval * i as u32).into()).await;
        let url = format!("http://{}/v1/chat/completions", addrs[i % addrs.len()]);
        let body = serde_json::json!({"model": "llama", "stream": true, "max_tokens": max_tokens, "messages": [
            {"role": "system", "content": systems[i % systems.len()]},
            {"role": "user", "content": format!("Where is order {i}?")}]});
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let resp = client.post(url).json(&body).send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let mut stream = resp.bytes_stream();
            let mut ttft = None;
            let mut done = false;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.ok()?;
                ttft.get_or_insert_with(|| sent.elapsed());
                done |= chunk.windows(6).any(|w| w == b"[DONE]");
            }
            done.then(|| ttft.map(|t| t.as_secs_f64() * 1e3)).flatten()
        }));
    }
    let sent_s = start.elapsed().as_secs_f64();
    let mut ttfts: Vec<f64> = Vec::with_capacity(total);
    let mut failed = 0;
    for t in tasks {
        match t.await.ok().flatten() {
            Some(ms) => ttfts.push(ms),
            None => failed += 1,
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    let cpu_s = cpu_seconds(pid) - cpu_start;
    ttfts.sort_by(f64::total_cmp);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "sim_load: {replicas} replicas, {total} requests offered at {rps} req/s over {sent_s:.1} s, \
         {max_tokens} output tokens each (SSE), time_scale {time_scale}"
    );
    let _ = writeln!(
        out,
        "  completed {} ({failed} failed) in {wall_s:.1} s = {:.0} req/s, {:.0} SSE chunks/s",
        ttfts.len(),
        ttfts.len() as f64 / wall_s,
        ttfts.len() as f64 * f64::from(max_tokens) / wall_s
    );
    let _ = writeln!(
        out,
        "  client TTFT ms: p50 {:.1}, p90 {:.1}, p99 {:.1}",
        percentile(&ttfts, 0.5),
        percentile(&ttfts, 0.9),
        percentile(&ttfts, 0.99)
    );
    let _ = writeln!(
        out,
        "  kvsim CPU: {cpu_s:.2} s over {wall_s:.1} s = {:.0}% of one core (machine: {} cores)",
        100.0 * cpu_s / wall_s,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = child.start_kill();
}
