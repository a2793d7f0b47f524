//! Decision latency of normal traffic while worst-case bodies are in flight (issue 12's
//! must-show: normal decisions' p99 stays within 2x of unloaded).
//!
//! Starts the real `kvrouter` binary (this build's, beside the bench executable) on loopback with
//! the SmolLM2 tokenizer and chat template of the shared vLLM capture, and talks ext_proc gRPC to
//! it as Envoy does in BUFFERED mode: request headers, then the whole body in one message. The
//! decision latency of a request is the time from sending its body to receiving the reply that
//! carries the destination (what Envoy's ext_proc filter waits for).
//!
//! Three arms, alternated in rounds (the order rotates every round, so drift hits all):
//! - `unloaded`: normal requests only, open loop at `--rate` per second;
//! - `flooded`: the same normal requests while `--flood` clients each keep one worst-case body
//!   in flight, back to back (listed below);
//! - `flooded-one-lane`: the same flood against a second router configured with
//!   `routing.heavy_body_bytes` above every body, so all decisions share the light lane's permits
//!   at normal priority (the behaviour before the heavy lane existed), idle while the others are
//!   measured;
//! - `flooded-unpaced`: the same flood against a third router configured with
//!   `routing.heavy_body_bytes_per_s: 0`, so long bodies are read off the connection at full
//!   speed (the behaviour before the pace existed), idle while the others are measured.
//!
//! The worst-case bodies: 9,999 messages with a text and an image part (the most the default
//!   limits admit: two renders of a 10k-message conversation), 9,999 text messages (the longest
//!   template loop), one ~31 MiB message (near `routing.max_body_bytes`), and 60k image messages
//!   (over `routing.max_messages`: parsed up to the limit, then 413).
//!
//! Normal requests are small chats: a shared ~200-token system prompt and a unique question. The
//! flood uses its own gRPC connection and its own client threads, so what is measured is the
//! router's scheduling of decisions, not HTTP/2 head-of-line blocking or a busy executor in this
//! client (the flood's encoding still competes for the same cores, as Envoy's buffering would).
//!
//! Reported: per round and arm the normal decisions' p50 and p99; over the rounds the median
//! and a 95% bootstrap CI of each, and of the per-round ratios flooded p99 / unloaded p99.
//!
//! `--victim`: tenants in the trusted tenant header, the flood's `flood`, and in every arm one
//! more client of tenant `victim` sending the 9,999-text-message body (0.5 MiB: a heavy-lane
//! body) back to back; its decisions' p50 and p90 are reported per arm too (how long another
//! tenant's long body waits behind a flood in the heavy lane). Run it against another build
//! with `KVROUTER_BIN=path`.
//!
//! `cargo bench --bench flood` (options after `--`: `--rounds 5 --seconds 12 --rate 40
//! --flood 8 --flood-nice 0`, `--only 31MiB-message,...` for some of the bodies only,
//! `--pace N` for the measured router's `routing.heavy_body_bytes_per_s`;
//! `--flood-nice 19` runs the flood's client threads at the lowest nice value, `--flood-idle`
//! in the idle scheduling class, so that only the router's own handling of the flood competes
//! with normal requests). Under `cargo test` (no `--bench`) it runs one short round as a smoke
//! check.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProtocolConfiguration,
};
use rand::{Rng, SeedableRng};
use tokio::runtime::Handle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

mod support;
use support::{chat_body, prose};

/// The model the normal and hostile bodies name (the router tokenizes it with SmolLM2).
const MODEL: &str = "smollm2";
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// The trusted tenant header under `--victim`.
const TENANT_HEADER: &str = "x-tenant-id";

struct Options {
    rounds: usize,
    seconds: f64,
    rate: f64,
    flood: usize,
    /// Nice value of the flood's client threads (0: as the rest of this process).
    flood_nice: i32,
    /// Run the flood's client threads in Linux's idle scheduling class (`--flood-idle`): they
    /// then get only CPU nothing else wants, as clients on other hosts would cost this one
    /// nothing. What is left competing with normal requests is the router's own handling of
    /// the flood (and the kernel's loopback traffic).
    flood_idle: bool,
    /// `--only NAME[,NAME]`: flood with these of the hostile bodies only (to tell which costs
    /// what); all of them when unset.
    only: Option<Vec<String>>,
    /// `--victim`: the flood and a victim client of two tenants (see the module docs).
    victim: bool,
    /// `--pace BYTES_PER_S`: the measured router's `routing.heavy_body_bytes_per_s` (its
    /// default when unset).
    pace: Option<u64>,
}

impl Options {
    fn from_args() -> Options {
        let args: Vec<String> = std::env::args().collect();
        let bench = args.iter().any(|a| a == "--bench");
        let value = |name: &str| -> Option<f64> {
            let i = args.iter().position(|a| a == name)?;
            args.get(i + 1)?.parse().ok()
        };
        let mut o = if bench {
            Options {
                rounds: 5,
                seconds: 12.0,
                rate: 40.0,
                flood: 8,
                flood_nice: 0,
                flood_idle: false,
                only: None,
                victim: false,
                pace: None,
            }
        } else {
            Options {
                rounds: 1,
                seconds: 1.0,
                rate: 20.0,
                flood: 2,
                flood_nice: 0,
                flood_idle: false,
                only: None,
                victim: false,
                pace: None,
            }
        };
        o.victim = args.iter().any(|a| a == "--victim");
        o.pace = value("--pace").map(|v| v as u64);
        o.rounds = value("--rounds").map_or(o.rounds, |v| v as usize);
        o.seconds = value("--seconds").unwrap_or(o.seconds);
        o.rate = value("--rate").unwrap_or(o.rate);
        o.flood = value("--flood").map_or(o.flood, |v| v as usize);
        o.flood_nice = value("--flood-nice").map_or(o.flood_nice, |v| v as i32);
        o.flood_idle |= args.iter().any(|a| a == "--flood-idle");
        o.only = args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .map(|v| v.split(',').map(str::to_string).collect());
        o
    }
}

/// Endpoints that are never contacted: decisions only, no probes, no scrapes; `routing` YAML.
fn router_yaml(routing: &str, tenants: bool) -> String {
    let tokenizer = testkit::shared_fixture().display().to_string();
    let tenancy = if tenants {
        format!("tenancy: {{header: {TENANT_HEADER}}}\n")
    } else {
        String::new()
    };
    format!(
        "server: {{reload_interval_ms: 0}}\n\
         {tenancy}\
         routing: {routing}\n\
         health: {{probe: {{enabled: false}}, eject_on_scrape_failures: false, breaker: {{enabled: false}}}}\n\
         load: {{scrape: {{enabled: false}}}}\n\
         models: [{{name: {MODEL}, tokenizer: \"{tokenizer}\"}}]\n\
         pools:\n  - name: bench\n    models: [{MODEL}]\n    engine: other\n    endpoints:\n\
         {}",
        (1..=4)
            .map(|i| format!("      - address: 127.0.0.1:{}\n", 40000 + i))
            .collect::<String>()
    )
}

/// A normal request: a shared system prompt and a unique question.
fn normal_body(i: usize) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL,
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": format!("You are a logistics assistant. {}", prose(0, 150))},
            {"role": "user", "content": format!("Question {i}: {}", prose(i, 25))},
        ]
    })
    .to_string()
    .into_bytes()
}

/// The worst-case bodies the flood cycles through, with a name each.
fn hostile_bodies(scale: usize) -> Vec<(&'static str, bytes::Bytes)> {
    let image = |i: usize| {
        format!(
            r#"{{"role":"user","content":[{{"type":"text","text":"look {i}"}},{{"type":"image_url","image_url":{{"url":"https://x/{i}.png"}}}}]}}"#
        )
    };
    let near_limit = {
        let text = prose(3, (31 << 20) / 8 / scale);
        serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})
            .to_string()
            .into_bytes()
    };
    vec![
        (
            "9999-image-messages",
            chat_body(MODEL, 9_999 / scale, image).into(),
        ),
        (
            "9999-text-messages",
            chat_body(MODEL, 9_999 / scale, |i| {
                format!(r#"{{"role":"user","content":"{}"}}"#, prose(i, 3))
            })
            .into(),
        ),
        ("31MiB-message", near_limit.into()),
        (
            "60k-image-messages-413",
            chat_body(MODEL, 60_000 / scale, image).into(),
        ),
    ]
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

/// How a decision ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Routed,
    /// Envoy was told to answer the client itself (413, 503...).
    Immediate(u32),
    /// The stream failed or the reply was something else.
    Broken,
}

/// One request through ext_proc as Envoy sends it in BUFFERED mode; returns how it ended and
/// the decision latency (body sent -> reply received).
async fn decide(
    client: &ExternalProcessorClient<Channel>,
    id: &str,
    tenant: Option<&str>,
    body: bytes::Bytes,
) -> (Ended, Duration) {
    let mut client = client.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let first = ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::None as i32,
            ..Default::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: headers(
                &[
                    (":path", "/v1/chat/completions"),
                    (":method", "POST"),
                    ("content-type", "application/json"),
                    ("x-request-id", id),
                ]
                .into_iter()
                .chain(tenant.map(|t| (TENANT_HEADER, t)))
                .collect::<Vec<_>>(),
            ),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    };
    if tx.send(first).await.is_err() {
        return (Ended::Broken, Duration::ZERO);
    }
    let Ok(response) = client.process(ReceiverStream::new(rx)).await else {
        return (Ended::Broken, Duration::ZERO);
    };
    let mut replies = response.into_inner();
    match replies.message().await {
        Ok(Some(r)) if matches!(r.response, Some(Response::RequestHeaders(_))) => {}
        Ok(Some(r)) => {
            if let Some(Response::ImmediateResponse(i)) = r.response {
                let status = i.status.map_or(0, |s| s.code as u32);
                return (Ended::Immediate(status), Duration::ZERO);
            }
            return (Ended::Broken, Duration::ZERO);
        }
        _ => return (Ended::Broken, Duration::ZERO),
    }
    let started = Instant::now();
    let msg = ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    if tx.send(msg).await.is_err() {
        return (Ended::Broken, Duration::ZERO);
    }
    let ended = match replies.message().await {
        Ok(Some(r)) => match r.response {
            Some(Response::RequestBody(_)) => Ended::Routed,
            Some(Response::ImmediateResponse(i)) => {
                Ended::Immediate(i.status.map_or(0, |s| s.code as u32))
            }
            _ => Ended::Broken,
        },
        _ => Ended::Broken,
    };
    (ended, started.elapsed())
}

async fn connect(addr: std::net::SocketAddr) -> ExternalProcessorClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to kvrouter's ext_proc port");
    ExternalProcessorClient::new(channel)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// What one arm of one round measured.
struct ArmResult {
    latencies_ms: Vec<f64>,
    /// The victim tenant's heavy decisions (`--victim`), sorted.
    victim_ms: Vec<f64>,
    /// The victim's requests that were not routed (refused, broken).
    victim_not_routed: usize,
    not_routed: usize,
    hostile_done: u64,
    hostile_statuses: Vec<(Ended, u64)>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// A router under test with its two connections (normal traffic, flood).
struct Target {
    normal: ExternalProcessorClient<Channel>,
    flood: ExternalProcessorClient<Channel>,
    _router: testkit::Router,
}

async fn start_target(
    dir: &Path,
    name: &str,
    routing: &str,
    tenants: bool,
    flood: &Handle,
) -> Target {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kvrouter.yaml");
    std::fs::write(&config, router_yaml(routing, tenants)).unwrap();
    let router = testkit::Router::start(&testkit::kvrouter_bin(), &dir, &config, "warn")
        .unwrap_or_else(|e| panic!("{e}"));
    router.wait_ready().await.unwrap();
    let normal = connect(router.grpc).await;
    // Warm up: tokenizer loaded, system prompt in the token cache.
    for i in 0..20 {
        let (ended, _) = decide(&normal, &format!("warm-{i}"), None, normal_body(i).into()).await;
        assert_eq!(ended, Ended::Routed, "a normal request was not routed");
    }
    Target {
        // The flood's connection lives on the flood's runtime (see `main`).
        flood: flood.spawn(connect(router.grpc)).await.unwrap(),
        normal,
        _router: router,
    }
}

async fn run_arm(
    target: &Target,
    flood_rt: &Handle,
    hostile: &Arc<Vec<(&'static str, bytes::Bytes)>>,
    o: &Options,
    flooded: bool,
    next_id: &AtomicU64,
    victim_body: Option<bytes::Bytes>,
) -> ArmResult {
    let stop = Arc::new(AtomicBool::new(false));
    let flood_tenant = o.victim.then_some("flood");
    // The victim's long bodies, back to back on the flood's connection and threads.
    let victim = victim_body.map(|body| {
        let (client, stop) = (target.flood.clone(), Arc::clone(&stop));
        flood_rt.spawn(async move {
            let (mut took, mut refused) = (Vec::new(), 0);
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                let id = format!("victim-{k}");
                match decide(&client, &id, Some("victim"), body.clone()).await {
                    (Ended::Routed, t) => took.push(t.as_secs_f64() * 1e3),
                    _ => refused += 1,
                }
            }
            (took, refused)
        })
    });
    let mut flooders = Vec::new();
    if flooded {
        for f in 0..o.flood {
            let (client, hostile, stop) =
                (target.flood.clone(), Arc::clone(hostile), Arc::clone(&stop));
            flooders.push(flood_rt.spawn(async move {
                let mut seen: Vec<(Ended, u64)> = Vec::new();
                let mut k = f;
                while !stop.load(Ordering::Relaxed) {
                    let (_, body) = &hostile[k % hostile.len()];
                    k += 1;
                    let id = format!("hostile-{f}-{k}");
                    let (ended, _) = decide(&client, &id, flood_tenant, body.clone()).await;
                    match seen.iter_mut().find(|(e, _)| *e == ended) {
                        Some((_, n)) => *n += 1,
                        None => seen.push((ended, 1)),
                    }
                }
                seen
            }));
        }
        // Let the flood fill the router before the first normal request.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total = (o.seconds * o.rate).round() as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut normals = Vec::with_capacity(total);
    for _ in 0..total {
        tick.tick().await;
        let i = next_id.fetch_add(1, Ordering::Relaxed) as usize;
        let client = target.normal.clone();
        normals.push(tokio::spawn(async move {
            decide(&client, &format!("normal-{i}"), None, normal_body(i).into()).await
        }));
    }
    let mut latencies_ms = Vec::with_capacity(total);
    let mut not_routed = 0;
    for n in normals {
        let (ended, took) = n.await.unwrap();
        if ended == Ended::Routed {
            latencies_ms.push(took.as_secs_f64() * 1e3);
        } else {
            not_routed += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut hostile_statuses: Vec<(Ended, u64)> = Vec::new();
    for f in flooders {
        for (e, n) in f.await.unwrap() {
            match hostile_statuses.iter_mut().find(|(x, _)| *x == e) {
                Some((_, m)) => *m += n,
                None => hostile_statuses.push((e, n)),
            }
        }
    }
    latencies_ms.sort_by(f64::total_cmp);
    let (mut victim_ms, victim_not_routed) = match victim {
        Some(v) => v.await.unwrap(),
        None => (Vec::new(), 0),
    };
    victim_ms.sort_by(f64::total_cmp);
    ArmResult {
        victim_ms,
        victim_not_routed,
        hostile_done: hostile_statuses.iter().map(|(_, n)| n).sum(),
        latencies_ms,
        not_routed,
        hostile_statuses,
    }
}

/// The median of `values` and a 95% percentile-bootstrap CI of it.
fn median_ci(values: &[f64]) -> (f64, f64, f64) {
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let mut boots: Vec<f64> = (0..10_000)
        .map(|_| {
            let mut s: Vec<f64> = (0..values.len())
                .map(|_| values[rng.random_range(0..values.len())])
                .collect();
            median(&mut s)
        })
        .collect();
    boots.sort_by(f64::total_cmp);
    (
        median(&mut values.to_vec()),
        percentile(&boots, 0.025),
        percentile(&boots, 0.975),
    )
}

fn main() {
    let o = Options::from_args();
    let scale = if support::measuring() { 1 } else { 100 };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The flood runs on threads of its own, so encoding a 30 MiB body in this process never
    // holds up a normal request's send or receive here: the latencies are the router's.
    // `--flood-nice 19` lowers them, so the flood's client-side CPU (which stands for other
    // hosts) does not compete with this process's normal requests or with the router.
    let (nice, idle) = (o.flood_nice, o.flood_idle);
    let flood_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("flood")
        .on_thread_start(move || {
            if idle {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: pid 0 is the calling thread; `param` is valid for the call.
                let ok = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0;
                assert!(ok, "--flood-idle: SCHED_IDLE refused");
            } else if nice != 0 {
                // SAFETY: setpriority on the calling thread's own id (Linux: nice is per thread).
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, nice);
                }
            }
        })
        .enable_all()
        .build()
        .unwrap();
    let flood = flood_runtime.handle().clone();
    runtime.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let targets = [
            start_target(
                dir.path(),
                "default",
                &o.pace
                    .map_or("{}".into(), |p| format!("{{heavy_body_bytes_per_s: {p}}}")),
                o.victim,
                &flood,
            )
            .await,
            start_target(
                dir.path(),
                "one-lane",
                "{heavy_body_bytes: 1099511627776}",
                o.victim,
                &flood,
            )
            .await,
            start_target(
                dir.path(),
                "unpaced",
                "{heavy_body_bytes_per_s: 0}",
                o.victim,
                &flood,
            )
            .await,
        ];
        let all = hostile_bodies(scale);
        // The victim's body, whether or not `--only` floods with it.
        let victim_body = o.victim.then(|| {
            let (_, body) = all
                .iter()
                .find(|(n, _)| *n == "9999-text-messages")
                .expect("the text-message body");
            body.clone()
        });
        let hostile: Vec<_> = all
            .into_iter()
            .filter(|(name, _)| o.only.as_ref().is_none_or(|only| only.iter().any(|n| n == name)))
            .collect();
        assert!(!hostile.is_empty(), "--only named no body");
        let hostile = Arc::new(hostile);
        for (name, body) in hostile.iter() {
            println!("hostile body {name}: {:.1} MiB", body.len() as f64 / 1048576.0);
        }
        println!(
            "{} rounds x 4 arms of {} s; normal requests at {}/s; {} flood clients ({})",
            o.rounds,
            o.seconds,
            o.rate,
            o.flood,
            if o.flood_idle {
                "SCHED_IDLE".to_string()
            } else {
                format!("nice {}", o.flood_nice)
            }
        );
        let next_id = AtomicU64::new(0);
        // (name, target, flooded)
        let arms = [
            ("unloaded", 0, false),
            ("flooded", 0, true),
            ("flooded-one-lane", 1, true),
            ("flooded-unpaced", 2, true),
        ];
        let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); arms.len()];
        let mut victim_rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); arms.len()];
        for round in 0..o.rounds {
            for k in 0..arms.len() {
                let arm = (round + k) % arms.len();
                let (name, target, flooded) = arms[arm];
                let r = run_arm(
                    &targets[target],
                    &flood,
                    &hostile,
                    &o,
                    flooded,
                    &next_id,
                    victim_body.clone(),
                )
                .await;
                let (p50, p99) = (
                    percentile(&r.latencies_ms, 0.5),
                    percentile(&r.latencies_ms, 0.99),
                );
                println!(
                    "round {round} {name:>16}: n={} p50 {p50:.2} ms p99 {p99:.2} ms max {:.2} ms \
                     (not routed {}; hostile bodies decided {} {:?})",
                    r.latencies_ms.len(),
                    r.latencies_ms.last().copied().unwrap_or(f64::NAN),
                    r.not_routed,
                    r.hostile_done,
                    r.hostile_statuses,
                );
                assert_eq!(r.not_routed, 0, "normal requests must all be routed");
                rows[arm].push((p50, p99));
                if o.victim {
                    let v = (
                        percentile(&r.victim_ms, 0.5),
                        percentile(&r.victim_ms, 0.9),
                    );
                    println!(
                        "round {round} {name:>16}: victim's long bodies n={} p50 {:.1} ms p90 {:.1} ms \
                         (not routed {})",
                        r.victim_ms.len(),
                        v.0,
                        v.1,
                        r.victim_not_routed
                    );
                    victim_rows[arm].push(v);
                }
            }
        }
        println!("\nover {} rounds: median [95% bootstrap CI]", o.rounds);
        for (arm, (name, _, _)) in arms.iter().enumerate() {
            let p50: Vec<f64> = rows[arm].iter().map(|r| r.0).collect();
            let p99: Vec<f64> = rows[arm].iter().map(|r| r.1).collect();
            let (m50, l50, h50) = median_ci(&p50);
            let (m99, l99, h99) = median_ci(&p99);
            println!(
                "{name:>16}: p50 {m50:.2} ms [{l50:.2}, {h50:.2}]  p99 {m99:.2} ms [{l99:.2}, {h99:.2}]"
            );
        }
        if o.victim {
            for (arm, (name, _, _)) in arms.iter().enumerate() {
                let (m50, l50, h50) =
                    median_ci(&victim_rows[arm].iter().map(|r| r.0).collect::<Vec<_>>());
                let (m90, l90, h90) =
                    median_ci(&victim_rows[arm].iter().map(|r| r.1).collect::<Vec<_>>());
                println!(
                    "{name:>16}: victim's long bodies p50 {m50:.1} ms [{l50:.1}, {h50:.1}]  \
                     p90 {m90:.1} ms [{l90:.1}, {h90:.1}]"
                );
            }
        }
        for arm in 1..arms.len() {
            let ratios: Vec<f64> = rows[arm]
                .iter()
                .zip(&rows[0])
                .map(|(f, u)| f.1 / u.1)
                .collect();
            let (m, l, h) = median_ci(&ratios);
            println!(
                "p99 {} / unloaded (per round): {m:.2}x [{l:.2}, {h:.2}]",
                arms[arm].0
            );
        }
        let paced: Vec<f64> = rows[1]
            .iter()
            .zip(&rows[3])
            .map(|(p, u)| p.1 / u.1)
            .collect();
        let (m, l, h) = median_ci(&paced);
        println!("p99 flooded / flooded-unpaced (per round): {m:.2}x [{l:.2}, {h:.2}]");
    });
}
