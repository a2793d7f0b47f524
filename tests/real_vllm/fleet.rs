//! Two real vLLM replicas, kvrouter (subscribed to their KV events, scraping their metrics) and
//! real Envoy in front, plus the client-side helpers the checks share. Every use of the shared
//! harness (`testkit`) is in this file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use testkit::{candidate_row, eventually, start_envoy, start_router, Envoy, Router};

use crate::engine::{free_ports, Setup, Vllm, MODEL};

/// `kv_events.silence_timeout_ms` of the router under test: short, so that a wrongly armed
/// silence clock shows within seconds (the default is 10 s).
pub const SILENCE_TIMEOUT_MS: u64 = 2000;

/// The stack. `replicas[0]` (X) stays up throughout; `replicas[1]` (Y) is bypassed, killed and
/// restarted by the checks.
pub struct Fleet {
    pub dir: PathBuf,
    pub setup: Setup,
    pub replicas: [Vllm; 2],
    pub addrs: [SocketAddr; 2],
    pub router: Router,
    pub envoy: Envoy,
    pub client: reqwest::Client,
}

/// A response as the checks see it.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// Where Envoy sent it (after retries), when it went through Envoy.
    pub upstream: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub body: String,
}

impl Fleet {
    /// Starts both vLLM replicas (in parallel, each on its own core), then kvrouter and Envoy.
    pub async fn start(dir: &Path) -> Fleet {
        let setup = Setup::from_env();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("client");
        let ports = free_ports(6);
        let r0 = Vllm::start(&setup, dir, "vllm-x", 0, ports[0], ports[1], ports[4]);
        let r1 = Vllm::start(&setup, dir, "vllm-y", 1, ports[2], ports[3], ports[5]);
        let (t0, t1) = tokio::join!(r0.wait_ready(&client), r1.wait_ready(&client));
        println!(
            "vLLM ready: {} in {:.0} s, {} in {:.0} s",
            r0.name,
            t0.as_secs_f64(),
            r1.name,
            t1.as_secs_f64()
        );
        let addrs = [r0.addr, r1.addr];
        let router = start_router(dir, &router_yaml(dir, &setup, &[&r0, &r1], false));
        let envoy_yaml = testkit::envoy_yaml(
            &router,
            dir,
            kvrouter::envoyconf::ClusterStyle::OverrideHost,
            kvrouter::envoyconf::BodyMode::Buffered,
            None,
        );
        let envoy = start_envoy(dir, &envoy_yaml).await;
        envoy
            .wait_for_hosts(&addrs)
            .await
            .expect("Envoy sees both replicas");
        Fleet {
            dir: dir.to_path_buf(),
            setup,
            replicas: [r0, r1],
            addrs,
            router,
            envoy,
            client,
        }
    }

    /// POSTs a chat or completion body through Envoy (with an `x-request-id` when given).
    pub async fn via_envoy(&self, path: &str, body: &str, request_id: Option<&str>) -> Answer {
        let mut req = self
            .client
            .post(format!("http://{}{path}", self.envoy.addr))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(id) = request_id {
            req = req.header("x-request-id", id);
        }
        answer(req.send().await.expect("request through envoy")).await
    }

    /// POSTs straight to a replica, bypassing Envoy and kvrouter.
    pub async fn direct(&self, addr: SocketAddr, path: &str, body: &str) -> Answer {
        post_direct(&self.client, addr, path, body).await
    }

    /// kvrouter's live explanation for `body` (routes nothing).
    pub async fn explain(&self, body: &str) -> serde_json::Value {
        get_json(
            self.client
                .post(format!("http://{}/debug/explain", self.router.admin))
                .body(body.to_string()),
        )
        .await
    }

    /// kvrouter's recorded decision for a request id.
    pub async fn decision(&self, request_id: &str) -> serde_json::Value {
        get_json(self.client.get(format!(
            "http://{}/debug/decisions/{request_id}",
            self.router.admin
        )))
        .await
    }

    /// kvrouter's row for `addr` in `/debug/endpoints`.
    pub async fn endpoint(&self, addr: SocketAddr) -> serde_json::Value {
        self.endpoint_at(self.router.admin, addr).await
    }

    /// The row for `addr` in `/debug/endpoints` of the kvrouter whose admin server is `admin`.
    pub async fn endpoint_at(&self, admin: SocketAddr, addr: SocketAddr) -> serde_json::Value {
        let table = get_json(self.client.get(format!("http://{admin}/debug/endpoints"))).await;
        table["endpoints"]
            .as_array()
            .expect("endpoints")
            .iter()
            .find(|e| e["address"] == addr.to_string())
            .cloned()
            .unwrap_or_else(|| panic!("no endpoint {addr} in {table}"))
    }

    /// A second kvrouter (its own directory, config and EDS file) subscribed to X only, with X's
    /// replay socket when `replay`: a router that starts after X cached prefixes.
    pub fn start_late_router(&self, replay: bool) -> Router {
        let dir = self.dir.join(if replay { "late-replay" } else { "late" });
        std::fs::create_dir_all(&dir).expect("late router dir");
        let yaml = router_yaml(&dir, &self.setup, &[&self.replicas[0]], replay);
        start_router(&dir, &yaml)
    }

    /// `state` and `reason` of `addr`'s KV-event stream, e.g. ("distrusted", "silent").
    pub async fn events_state(&self, addr: SocketAddr) -> (String, String) {
        let e = self.endpoint(addr).await;
        let s = &e["kv_events"];
        (
            s["state"].as_str().unwrap_or("?").to_string(),
            s["reason"].as_str().unwrap_or("").to_string(),
        )
    }

    /// Waits until `addr`'s KV-event state is `state`; returns its reason.
    pub async fn wait_events_state(
        &self,
        addr: SocketAddr,
        state: &str,
        within: Duration,
    ) -> String {
        eventually(
            &format!("{addr}'s kv events to be {state}"),
            within,
            || async move {
                let (s, reason) = self.events_state(addr).await;
                (s == state).then_some(reason)
            },
        )
        .await
    }

    /// The row of `addr` in an explanation.
    pub fn row(explain: &serde_json::Value, addr: SocketAddr) -> &serde_json::Value {
        candidate_row(explain, addr)
    }

    /// Lines of kvrouter's log containing `needle`.
    pub fn router_log_count(&self, needle: &str) -> usize {
        std::fs::read_to_string(self.dir.join("kvrouter.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// A kvsim replica serving the model with vLLM's CPU cache geometry (128-token blocks, as
    /// many blocks as the real replicas' 1 GiB holds) and the model dir's own tokenizer and
    /// chat template.
    pub fn start_kvsim(&self, num_gpu_blocks: u32) -> testkit::Replica {
        let blocks = num_gpu_blocks.to_string();
        let tokenizer = self.setup.model_dir.display().to_string();
        let mut spec = testkit::ReplicaSpec::new("kvsim")
            .flag("tokenizer", tokenizer)
            .flag("block-size", 128)
            .flag("num-gpu-blocks", blocks)
            .flag("max-model-len", 2048);
        spec.models = vec![MODEL.into()];
        testkit::start_replica(&self.dir, spec)
    }

    /// Envoy's counter `name` summed over clusters (`/stats`).
    pub async fn envoy_counter(&self, suffix: &str) -> u64 {
        let text = self
            .client
            .get(format!("http://{}/stats", self.envoy.admin))
            .send()
            .await
            .expect("envoy stats")
            .text()
            .await
            .expect("envoy stats text");
        text.lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| k.starts_with("cluster.") && k.ends_with(suffix))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }
}

/// kvrouter's config: the model's own tokenizer and chat template (the vLLM model dir), each
/// replica's publisher (and its replay socket when `replay`), decisions recorded for
/// `/debug/decisions`.
pub fn router_yaml(dir: &Path, setup: &Setup, replicas: &[&Vllm], replay: bool) -> String {
    let endpoints: String = replicas
        .iter()
        .map(|r| {
            let replay = if replay {
                format!(", replay: \"{}\"", r.events_replay())
            } else {
                String::new()
            };
            format!(
                "      - address: \"{}\"\n        kv_events: {{connect: \"{}\"{replay}}}\n",
                r.addr,
                r.events_connect()
            )
        })
        .collect();
    format!(
        "server: {{reload_interval_ms: 0}}\n\
         envoy: {{eds_path: {eds}}}\n\
         policy: {{name: predicted-ttft}}\n\
         kv_events: {{silence_timeout_ms: {SILENCE_TIMEOUT_MS}}}\n\
         debug: {{record_decisions: 512}}\n\
         models: [{{name: {MODEL}, tokenizer: \"{model}\"}}]\n\
         pools:\n  - name: vllm\n    models: [{MODEL}]\n    endpoints:\n{endpoints}",
        eds = dir.join("eds.json").display(),
        model = setup.model_dir.display(),
    )
}

/// POSTs `body` to `addr` and reads the answer.
pub async fn post_direct(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> Answer {
    let resp = client
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("request to {addr}: {e}"));
    answer(resp).await
}

async fn answer(resp: reqwest::Response) -> Answer {
    let status = resp.status().as_u16();
    let upstream = resp
        .headers()
        .get("x-kvrouter-upstream")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.text().await.expect("response body");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let usage = &v["usage"];
    Answer {
        status,
        upstream,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        body,
    }
}

async fn get_json(req: reqwest::RequestBuilder) -> serde_json::Value {
    req.send()
        .await
        .expect("admin request")
        .json()
        .await
        .expect("admin json")
}

/// A chat body: `system` then `user`, greedy, `max_tokens` out.
pub fn chat(system: &str, user: &str, max_tokens: u32) -> String {
    serde_json::json!({
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
    .to_string()
}

/// A completion body with a prompt of token ids.
pub fn completion_ids(ids: &[u32], max_tokens: u32) -> String {
    serde_json::json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "prompt": ids})
        .to_string()
}

/// A system prompt of about 650 tokens (five full 128-token engine blocks) that no other
/// check's prompt shares: `tag` opens it.
pub fn long_system(tag: &str) -> String {
    format!(
        "[{tag}] {}",
        "You are the support assistant of a freight company; always quote the tracking number. "
            .repeat(40)
    )
}
