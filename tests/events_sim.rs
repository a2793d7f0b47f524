//! KV events from simulated vLLM replicas over real ZMQ sockets (loopback) into the ownership
//! index: after a request the index holds exactly the engine's stored full blocks; eviction
//! pressure removes them; a restart leaves no stale hit; traffic that bypassed the router is
//! matched on the replica that holds it; publishers sharing one bound socket are told apart by
//! topic.
//!
//! Prompts are token ids (`"prompt": [..]`), so the simulator and the router see the same
//! tokens without sharing a tokenizer; the router side hashes them with `identify()` as the
//! request path does. Real time with `time_scale` 100; every wait polls with a deadline.

use kvsim::inproc as sim_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrouter::config::Config;
use kvrouter::events::{KvEvents, Reason, SourceState};
use kvrouter::index::{
    Clock, EndpointId, EndpointInterner, IndexOptions, OwnershipIndex, PrefixMatch, TokioClock,
};
use kvrouter::prefix::{Namespace, TokenizerRegistry};
use kvrouter::request::{self, ApiKind};
use kvsim::driver::AdminCommand;
use kvsim::{KvEventsConfig, Replica, ReplicaConfig};
use serde_json::Value;
use sim_support::{call, config, ids, start, tokens_body};

const DEADLINE: Duration = Duration::from_secs(15);

/// One simulated replica and the address the router knows it by.
struct Sim {
    replica: Arc<Replica>,
    app: axum::Router,
    address: SocketAddr,
}

/// Replicas publishing KV events and a router-side hub subscribed to them.
struct Fleet {
    sims: Vec<Sim>,
    events: KvEvents,
    index: Arc<OwnershipIndex>,
    ids: Vec<EndpointId>,
}

fn replica_config(
    name: &str,
    block_size: u32,
    num_gpu_blocks: Option<u32>,
    kv: KvEventsConfig,
) -> ReplicaConfig {
    let mut cfg = config(name);
    cfg.time_scale = 100.0;
    cfg.block_size = block_size;
    cfg.num_gpu_blocks = num_gpu_blocks;
    cfg.kv_events = Some(kv);
    cfg
}

async fn hub(yaml: &str) -> (KvEvents, Arc<OwnershipIndex>, Arc<EndpointInterner>) {
    let config = Config::parse_and_validate(yaml, "test").unwrap();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::from(&config.cache_index),
        Arc::clone(&clock),
    ));
    let interner = Arc::new(EndpointInterner::new());
    let events = KvEvents::start(
        &config,
        &TokenizerRegistry::empty(),
        Arc::clone(&index),
        Arc::clone(&interner),
        clock,
    )
    .await
    .unwrap();
    (events, index, interner)
}

/// `n` replicas that bind their publishers; the hub connects to each.
async fn connect_fleet(n: usize, block_size: u32, num_gpu_blocks: Option<u32>) -> Fleet {
    let mut sims = Vec::new();
    let mut endpoints = String::new();
    for i in 0..n {
        let kv = KvEventsConfig {
            endpoint: testkit::KV_EVENTS_BIND.into(),
            topic: String::new(),
            bind: true,
            ..KvEventsConfig::default()
        };
        let (replica, app) = start(replica_config(
            &format!("r{i}"),
            block_size,
            num_gpu_blocks,
            kv,
        ))
        .await;
        let address: SocketAddr = format!("127.0.0.1:{}", 18_000 + i).parse().unwrap();
        endpoints.push_str(&format!(
            "      - address: {address}\n        kv_events: {{connect: \"{}\"}}\n",
            replica.kv_events_endpoint().unwrap()
        ));
        sims.push(Sim {
            replica,
            app,
            address,
        });
    }
    let yaml = format!("pools:\n  - name: p\n    models: [m]\n    endpoints:\n{endpoints}");
    let (events, index, interner) = hub(&yaml).await;
    let ids = sims
        .iter()
        .map(|s| interner.lease(s.address).id())
        .collect();
    let fleet = Fleet {
        sims,
        events,
        index,
        ids,
    };
    for i in 0..n {
        fleet.sync(i).await;
    }
    fleet
}

/// Polls `cond` until it holds or [`DEADLINE`] passes (the harness's poll).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    testkit::eventually(what, DEADLINE, || std::future::ready(cond().then_some(()))).await
}

/// The router's block hashes for a token-id completion (what `identify()` gives the request
/// path, in the shared namespace of model `m`).
fn router_hashes(prompt: &[u32]) -> Vec<u64> {
    let body = serde_json::to_vec(&tokens_body(prompt, 1)).unwrap();
    let parsed = request::parse(ApiKind::Completions, &body).unwrap();
    TokenizerRegistry::empty()
        .identify(&parsed, &Namespace::new("m", None, None))
        .block_hashes
}

impl Fleet {
    fn held(&self, i: usize, prompt: &[u32]) -> PrefixMatch {
        self.index.lookup(&router_hashes(prompt), &[self.ids[i]])[0]
    }

    /// Blocks of ours the index holds confirmed for replica `i`.
    fn confirmed(&self, i: usize) -> usize {
        self.index
            .stats()
            .endpoints
            .iter()
            .find(|e| e.endpoint == self.ids[i])
            .map_or(0, |e| e.confirmed_blocks)
    }

    fn messages(&self, i: usize) -> u64 {
        self.events
            .status()
            .iter()
            .find(|s| s.id == self.ids[i])
            .map_or(0, |s| s.counters.messages)
    }

    fn state(&self, i: usize) -> SourceState {
        self.events.source_state(self.ids[i])
    }

    /// PUB/SUB drops what is published before the subscription reaches the publisher, so drop
    /// the (empty) cache until a clear gets through: from then on the view is complete.
    async fn sync(&self, i: usize) {
        let start = tokio::time::Instant::now();
        while self.state(i) != SourceState::Trusted {
            assert!(
                start.elapsed() < DEADLINE,
                "replica {i}'s events never arrived"
            );
            self.sims[i].replica.admin(AdminCommand::DropCache).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn engine_cached_blocks(&self, i: usize) -> usize {
        self.sims[i]
            .replica
            .admin(AdminCommand::State)
            .await
            .unwrap()
            .cached_blocks
    }

    /// Sends a completion straight to replica `i` (the router is not involved); returns its
    /// `cached_tokens`.
    async fn send(&self, i: usize, prompt: &[u32]) -> u64 {
        let (status, _, body) = call(
            &self.sims[i].app,
            "POST",
            "/v1/completions",
            Some(&tokens_body(prompt, 1)),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        cached_tokens(&body)
    }

    /// Waits until the index's confirmed blocks for replica `i` equal the engine's cached
    /// blocks (in our blocks: `ratio` of ours per engine block) and returns them.
    async fn settled(&self, i: usize, ratio: usize) -> usize {
        let start = tokio::time::Instant::now();
        loop {
            let engine = self.engine_cached_blocks(i).await * ratio;
            if self.confirmed(i) == engine {
                return engine;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "index holds {} confirmed blocks for replica {i}, engine {engine}",
                self.confirmed(i)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[tokio::test]
async fn after_a_request_the_index_holds_exactly_the_engines_full_blocks() {
    // Engine blocks equal to ours (16), and twice ours (32, re-chunked).
    for engine_bs in [16u32, 32] {
        let f = connect_fleet(1, engine_bs, None).await;
        let prompt = ids(1, 100); // 6 blocks of 16; 3 of 32
        f.send(0, &prompt).await;
        let ratio = (engine_bs / 16) as usize;
        eventually("the stored blocks", || f.confirmed(0) > 0).await;
        let held = f.settled(0, ratio).await;
        assert_eq!(held, 6, "engine block size {engine_bs}");
        let m = f.held(0, &prompt);
        assert_eq!(
            (m.blocks, m.confirmed_blocks),
            (6, 6),
            "engine block size {engine_bs}"
        );
        assert_eq!(f.state(0), SourceState::Trusted);
        // A second prompt sharing 64 tokens: the engine stores only the whole engine blocks it
        // lacked (124 tokens: 7 blocks of 16, or 3 of 32 = 6 of ours).
        let longer: Vec<u32> = prompt[..64].iter().copied().chain(ids(2, 60)).collect();
        assert_eq!(
            f.send(0, &longer).await,
            64,
            "the engine hit the shared prefix"
        );
        let whole = 124 / engine_bs * engine_bs / 16;
        eventually("the extension", || f.held(0, &longer).blocks == whole).await;
        assert_eq!(f.settled(0, ratio).await, 6 + whole as usize - 4);
    }
}

#[tokio::test]
async fn under_eviction_pressure_removed_blocks_leave_the_index() {
    // 24 usable blocks of 16 tokens; six prompts of 5 blocks each need 30.
    let f = connect_fleet(1, 16, Some(25)).await;
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| ids(100 + i, 80)).collect();
    for p in &prompts {
        f.send(0, p).await;
    }
    eventually("evictions", || {
        f.events.status()[0].counters.blocks_removed > 0
    })
    .await;
    // The last step's events come as vLLM's do, after its forward pass (and so after the
    // answer): wait for them, since the counts before and after them are both 24.
    eventually("the newest prompt's blocks", || {
        f.held(0, &prompts[5]).blocks == 5
    })
    .await;
    let held = f.settled(0, 1).await;
    assert!(held <= 24, "{held}");
    let per_prompt: Vec<u32> = prompts.iter().map(|p| f.held(0, p).blocks).collect();
    assert_eq!(
        per_prompt.iter().sum::<u32>() as usize,
        held,
        "{per_prompt:?}"
    );
    assert!(
        per_prompt[0] < 5,
        "the oldest prompt was evicted: {per_prompt:?}"
    );
    assert_eq!(per_prompt[5], 5, "the newest is whole: {per_prompt:?}");
    // The engine agrees: resending the oldest hits exactly what the index says it holds
    // (capped at 64: vLLM recomputes at least the last token, in whole blocks).
    let expected = u64::from(per_prompt[0]) * 16;
    assert_eq!(f.send(0, &prompts[0]).await, expected.min(64));
}

#[tokio::test]
async fn after_a_restart_no_stale_hit_is_reported() {
    let f = connect_fleet(1, 16, None).await;
    let prompt = ids(7, 80);
    f.send(0, &prompt).await;
    eventually("the stored blocks", || f.held(0, &prompt).blocks == 5).await;
    // The router also predicted the prompt when it routed it.
    f.events
        .record_routed(f.ids[0], &router_hashes(&prompt), 0, None, Duration::ZERO)
        .unwrap();

    let (status, _, _) = call(&f.sims[0].app, "POST", "/admin/restart", None).await;
    assert_eq!(status, 200);
    eventually("the restart to be noticed", || {
        f.state(0) != SourceState::Trusted
    })
    .await;
    assert_eq!(f.state(0), SourceState::Distrusted(Reason::Disconnected));
    assert_eq!(f.held(0, &prompt), PrefixMatch::default(), "no stale hit");
    assert_eq!(f.engine_cached_blocks(0).await, 0);

    // The restarted publisher numbers from 0 again: a fresh start, trusted, exact.
    let before = f.messages(0);
    let mut n = 0;
    while f.messages(0) == before {
        // Its first batches may go out before our reconnection lands; keep sending.
        assert!(n < 200, "no event after the restart");
        f.send(0, &ids(1000 + n, 40)).await;
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Sequence 0 if we reconnected before its first batch, else a partial view.
    eventually("events after the restart", || {
        matches!(
            f.state(0),
            SourceState::Trusted | SourceState::Partial(Reason::Disconnected)
        )
    })
    .await;
    assert_eq!(f.held(0, &prompt).blocks, 0, "still no stale hit");
    if f.state(0) == SourceState::Trusted {
        f.settled(0, 1).await;
    }
}

/// A router that starts after the engine cached a prefix: with the engine's replay socket in
/// its config it learns the prefix at once (complete view: the buffer starts at sequence 0);
/// without, it only knows what is published after it connected.
#[tokio::test]
async fn a_late_router_learns_earlier_prefixes_from_the_replay_socket_and_not_without_it() {
    let kv = KvEventsConfig {
        endpoint: testkit::KV_EVENTS_BIND.into(),
        bind: true,
        replay_endpoint: Some(testkit::KV_EVENTS_BIND.into()),
        ..KvEventsConfig::default()
    };
    let (replica, app) = start(replica_config("r0", 16, None, kv)).await;
    let send = |prompt: Vec<u32>| {
        let app = app.clone();
        async move {
            let (status, _, body) = call(
                &app,
                "POST",
                "/v1/completions",
                Some(&tokens_body(&prompt, 1)),
            )
            .await;
            assert_eq!(status, 200, "{body}");
        }
    };
    // Cached before any router listens: 6 blocks.
    let early = ids(77, 96);
    send(early.clone()).await;
    let publisher = replica.kv_events_endpoint().unwrap();
    let replay = replica.kv_events_replay().expect("a replay socket");
    let yaml = |replay_line: &str| {
        format!(
            "pools:\n  - name: p\n    models: [m]\n    endpoints:\n      - address: 127.0.0.1:18300\n        kv_events: {{connect: \"{publisher}\"{replay_line}}}\n"
        )
    };
    let (with, with_index, with_ids) = hub(&yaml(&format!(", replay: \"{replay}\""))).await;
    let (without, without_index, without_ids) = hub(&yaml("")).await;
    let address: SocketAddr = "127.0.0.1:18300".parse().unwrap();
    let (with_id, without_id) = (
        with_ids.lease(address).id(),
        without_ids.lease(address).id(),
    );
    let early_hashes = router_hashes(&early);
    eventually("the replayed prefix", || {
        with_index.lookup(&early_hashes, &[with_id])[0].confirmed_blocks == 6
    })
    .await;
    assert_eq!(
        with.source_state(with_id),
        SourceState::Trusted,
        "a buffer from sequence 0 is a complete view"
    );
    // Both see what is published from now on (sent until the late subscriber got one).
    let mut n = 0;
    let mut later = ids(78, 32);
    while without_index.lookup(&router_hashes(&later), &[without_id])[0].confirmed_blocks != 2 {
        assert!(n < 200, "the subscriber without replay never got a batch");
        later = ids(78 + n, 32);
        send(later.clone()).await;
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually(
        "the later prefix, through the live socket after the replay",
        || with_index.lookup(&router_hashes(&later), &[with_id])[0].confirmed_blocks == 2,
    )
    .await;
    assert_eq!(
        without_index.lookup(&early_hashes, &[without_id])[0],
        PrefixMatch::default(),
        "without replay the earlier prefix stays unknown"
    );
    assert_ne!(without.source_state(without_id), SourceState::Trusted);
    assert_eq!(
        with_index.lookup(&early_hashes, &[with_id])[0].confirmed_blocks,
        6,
        "the live messages after the replay did not undo it"
    );
}

#[tokio::test]
async fn a_prefix_is_matched_where_it_lives_even_when_the_router_never_routed_it() {
    let f = connect_fleet(2, 16, None).await;
    // Replica 1 is filled by traffic that bypassed the router.
    let system = ids(42, 96);
    f.send(1, &system).await;
    let request: Vec<u32> = system.iter().copied().chain(ids(43, 30)).collect();
    let hashes = router_hashes(&request);
    eventually("the bypass traffic's blocks", || {
        f.index.lookup(&hashes, &f.ids)[1].blocks == 6
    })
    .await;
    let matches = f.index.lookup(&hashes, &f.ids);
    assert_eq!(matches[0], PrefixMatch::default());
    assert_eq!(
        matches[1],
        PrefixMatch {
            blocks: 6,
            confirmed_blocks: 6,
            offloaded_blocks: 0,
            cpu_blocks: 0,
        }
    );
    // Routed by the longest match, the request lands where its prefix is.
    let pick = (0..2).max_by_key(|&i| matches[i].blocks).unwrap();
    assert_eq!(pick, 1);
    f.events
        .record_routed(
            f.ids[pick],
            &hashes,
            matches[pick].confirmed_blocks,
            None,
            Duration::ZERO,
        )
        .unwrap();
    assert_eq!(f.send(pick, &request).await, 96);
}

#[tokio::test]
async fn publishers_sharing_a_bound_socket_are_told_apart_by_topic() {
    let yaml = r#"
pools:
  - name: p
    models: [m]
    kv_events: {bind: "tcp://127.0.0.1:0", topic: "kv@{address}"}
    endpoints:
      - address: 127.0.0.1:18100
      - address: 127.0.0.1:18101
"#;
    let (events, index, interner) = hub(yaml).await;
    let bound = events.bound_endpoints().await;
    let endpoint = bound[0].1.clone();
    let mut sims = Vec::new();
    for i in 0..2u16 {
        let address: SocketAddr = format!("127.0.0.1:{}", 18_100 + i).parse().unwrap();
        let kv = KvEventsConfig {
            endpoint: endpoint.clone(),
            topic: format!("kv@{address}@m"),
            bind: false,
            ..KvEventsConfig::default()
        };
        let (replica, app) = start(replica_config(&format!("r{i}"), 16, None, kv)).await;
        sims.push(Sim {
            replica,
            app,
            address,
        });
    }
    let f = Fleet {
        ids: sims
            .iter()
            .map(|s| interner.lease(s.address).id())
            .collect(),
        sims,
        events,
        index,
    };
    for i in 0..2 {
        f.sync(i).await;
    }
    let a = ids(200, 48);
    let b = ids(300, 64);
    f.send(0, &a).await;
    f.send(1, &b).await;
    eventually("both replicas' blocks", || {
        f.held(0, &a).blocks == 3 && f.held(1, &b).blocks == 4
    })
    .await;
    assert_eq!(f.held(1, &a).blocks, 0);
    assert_eq!(f.held(0, &b).blocks, 0);
    assert_eq!(f.events.unrouted_messages(), 0);
    assert_eq!(f.settled(0, 1).await, 3);
    assert_eq!(f.settled(1, 1).await, 4);
}
