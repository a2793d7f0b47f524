//! The hub's request-path queries under paused time: silence detection, prediction TTLs and
//! truncation, reload. Messages are fed with [`KvEvents::ingest`]; the one socket is bound on
//! loopback port 0 and never used.

use std::time::Duration;

use super::*;
use crate::index::{IndexOptions, TokioClock};
use crate::prefix::{BlockHasher, Namespace};
use kvsim::kv_events::{encode_batch, KvEvent};

const CONFIG: &str = r#"
kv_events: {silence_timeout_ms: 1000, trusted_prediction_ttl_ms: 2000}
cache_index: {prediction_ttl_ms: 60000}
pools:
  - name: a
    models: [m]
    kv_events: {bind: "tcp://127.0.0.1:0"}
    endpoints:
      - address: 127.0.0.1:9001
"#;

struct Fixture {
    events: KvEvents,
    index: Arc<OwnershipIndex>,
    ep: EndpointId,
    seq: u64,
}

impl Fixture {
    async fn new(yaml: &str) -> Fixture {
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
        let ep = interner.lease("127.0.0.1:9001".parse().unwrap()).id();
        Fixture {
            events,
            index,
            ep,
            seq: 0,
        }
    }

    /// Publishes one batch storing `tokens` as engine blocks of `engine_bs` (a fresh chain).
    fn store(&mut self, tokens: &[u32], engine_bs: u32) {
        let n = tokens.len() / engine_bs as usize;
        let event = KvEvent::BlockStored {
            block_hashes: (0..n as u64).map(|i| self.seq << 32 | i).collect(),
            parent_block_hash: None,
            token_ids: tokens[..n * engine_bs as usize].to_vec(),
            block_size: engine_bs,
            lora_id: None,
            lora_name: None,
            extra_keys: vec![None; n],
        };
        let frames = [
            Vec::new(),
            self.seq.to_be_bytes().to_vec(),
            encode_batch(0.0, &[event], 0),
        ];
        assert!(self.events.ingest(self.ep, &frames));
        self.seq += 1;
    }

    /// Publishes one batch that only clears the cache: a fresh, trusted view whose engine block
    /// size no event has told yet.
    fn clear(&mut self) {
        let frames = [
            Vec::new(),
            self.seq.to_be_bytes().to_vec(),
            encode_batch(0.0, &[KvEvent::AllBlocksCleared], 0),
        ];
        assert!(self.events.ingest(self.ep, &frames));
        self.seq += 1;
    }

    fn held(&self, hashes: &[u64]) -> crate::index::PrefixMatch {
        self.index.lookup(hashes, &[self.ep])[0]
    }
}

fn ours(tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(&Namespace::new("m", None, None), 16).hash_tokens(tokens, usize::MAX)
}

/// Lets the silence checker run at the current (paused) time.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn silence_after_routed_work_withdraws_and_the_next_batch_restores() {
    let mut f = Fixture::new(CONFIG).await;
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Distrusted(Reason::Connecting)
    );
    let a: Vec<u32> = (0..64).collect();
    f.store(&a, 16);
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    assert_eq!(f.held(&ours(&a)).confirmed_blocks, 4);

    // Idle for a long time: not suspicious.
    tokio::time::advance(Duration::from_secs(30)).await;
    settle().await;
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);

    // A fully cached request stores nothing new: still not suspicious.
    f.events
        .record_routed(f.ep, &ours(&a), 4, None, Duration::ZERO)
        .unwrap();
    tokio::time::advance(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);

    // A request that should store blocks, and nothing comes.
    let b: Vec<u32> = (100..164).collect();
    f.events
        .record_routed(f.ep, &ours(&b), 0, None, Duration::ZERO)
        .unwrap();
    tokio::time::advance(Duration::from_millis(900)).await;
    settle().await;
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Distrusted(Reason::Silent),
        "read as silent at once"
    );
    tokio::time::advance(Duration::from_millis(300)).await;
    settle().await;
    let m = f.held(&ours(&a));
    assert_eq!(
        (m.blocks, m.confirmed_blocks),
        (0, 0),
        "confirmed blocks withdrawn"
    );
    assert_eq!(f.held(&ours(&b)).blocks, 4, "the prediction stays");
    assert_eq!(f.events.status()[0].counters.withdrawals, 1);

    // The late batch arrives in sequence: nothing was lost, everything is back.
    f.store(&b, 16);
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    assert_eq!(f.held(&ours(&a)).confirmed_blocks, 4);
    assert_eq!(f.held(&ours(&b)).confirmed_blocks, 4);
}

#[tokio::test(start_paused = true)]
async fn silence_is_seen_when_the_request_came_in_the_ms_of_the_last_batch() {
    let mut f = Fixture::new(CONFIG).await;
    let a: Vec<u32> = (0..64).collect();
    f.store(&a, 16);
    // No time passes: the request that should store blocks is recorded in the batch's ms.
    let b: Vec<u32> = (100..164).collect();
    f.events
        .record_routed(f.ep, &ours(&b), 0, None, Duration::ZERO)
        .unwrap();
    tokio::time::advance(Duration::from_millis(1100)).await;
    settle().await;
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Distrusted(Reason::Silent)
    );
}

#[tokio::test(start_paused = true)]
async fn the_engine_block_size_comes_from_real_blocks_not_offload_placeholders() {
    let f = Fixture::new(CONFIG).await;
    let stored = KvEvent::BlockStored {
        block_hashes: vec![1],
        parent_block_hash: None,
        token_ids: (0..16).collect(),
        block_size: 16,
        lora_id: None,
        lora_name: None,
        extra_keys: vec![None],
    };
    let frames = [
        Vec::new(),
        0u64.to_be_bytes().to_vec(),
        encode_batch(0.0, &[stored, KvEvent::offload_placeholder(vec![1])], 0),
    ];
    assert!(f.events.ingest(f.ep, &frames));
    assert_eq!(f.events.status()[0].engine_block_size_tokens, 16);
}

/// Short prompts on a fresh engine (no batch yet): the engine stores nothing for a prompt under
/// one of its blocks, so only a prompt of at least one whole engine block (its size from the
/// metrics until an event says) may start the silence clock; while the size is unknown, none.
#[tokio::test(start_paused = true)]
async fn silence_waits_for_a_whole_engine_block_of_the_reported_size() {
    let mut f = Fixture::new(CONFIG).await;
    f.clear();
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    assert_eq!(f.events.status()[0].engine_block_size_tokens, 0);
    let short: Vec<u32> = (0..40).collect(); // 2 blocks of ours, under one 128-token block
    for _ in 0..5 {
        f.events
            .record_routed(f.ep, &ours(&short), 0, Some(128), Duration::ZERO)
            .unwrap();
        tokio::time::advance(Duration::from_millis(600)).await;
        settle().await;
    }
    let long: Vec<u32> = (1000..1300).collect(); // 2 whole engine blocks
    f.events
        .record_routed(f.ep, &ours(&long), 0, None, Duration::ZERO)
        .unwrap();
    tokio::time::advance(Duration::from_secs(3)).await;
    settle().await;
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Trusted,
        "no engine block expected: nothing to be silent about"
    );
    assert_eq!(f.events.status()[0].counters.withdrawals, 0);

    f.events
        .record_routed(f.ep, &ours(&long), 0, Some(128), Duration::ZERO)
        .unwrap();
    tokio::time::advance(Duration::from_millis(1100)).await;
    settle().await;
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Distrusted(Reason::Silent),
        "two whole engine blocks were due"
    );
}

#[tokio::test(start_paused = true)]
async fn predictions_last_short_while_trusted_and_stop_at_whole_engine_blocks() {
    let mut f = Fixture::new(CONFIG).await;
    // Before any batch (distrusted): the full TTL, all blocks.
    let p: Vec<u32> = (500..580).collect(); // 5 blocks of ours
    f.events
        .record_routed(f.ep, &ours(&p), 0, None, Duration::ZERO)
        .unwrap();
    assert_eq!(f.events.prediction_ttl(f.ep), Duration::from_secs(60));
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_eq!(f.held(&ours(&p)).blocks, 5);

    // Trusted, engine blocks of 32 tokens: 2 whole engine blocks = 4 of ours, 2 s.
    f.store(&(0..64).collect::<Vec<u32>>(), 32);
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    assert_eq!(f.events.prediction_ttl(f.ep), Duration::from_secs(2));
    let q: Vec<u32> = (700..780).collect();
    f.events
        .record_routed(f.ep, &ours(&q), 0, None, Duration::ZERO)
        .unwrap();
    assert_eq!(
        f.held(&ours(&q)).blocks,
        4,
        "the engine caches no partial block"
    );
    tokio::time::advance(Duration::from_millis(2001)).await;
    assert_eq!(f.held(&ours(&q)).blocks, 0, "expired unconfirmed");
    let status = &f.events.status()[0];
    assert_eq!(status.engine_block_size_tokens, 32);
    assert_eq!(status.engine_blocks, 2);
    assert!(status.table_bytes > 0);

    // An endpoint without a stream: the index's own TTL, untouched.
    let other = 77;
    assert_eq!(f.events.source_state(other), SourceState::Absent);
    f.events
        .record_routed(other, &ours(&q), 0, None, Duration::ZERO)
        .unwrap();
    assert_eq!(f.index.lookup(&ours(&q), &[other])[0].blocks, 5);
    assert!(!f.events.ingest(other, &[b"", b"", b""]));
}

#[tokio::test(start_paused = true)]
async fn reload_withdraws_removed_streams_and_restarts_changed_ones() {
    let mut f = Fixture::new(CONFIG).await;
    let a: Vec<u32> = (0..32).collect();
    f.store(&a, 16);
    let bound = f.events.bound_endpoints().await;
    assert_eq!(bound.len(), 1);
    assert!(bound[0].1.starts_with("tcp://127.0.0.1:"), "{bound:?}");

    // Same config: the stream and its state are kept.
    let same = Config::parse_and_validate(CONFIG, "t").unwrap();
    f.events
        .reload(&same, &TokenizerRegistry::empty())
        .await
        .unwrap();
    assert_eq!(f.events.source_state(f.ep), SourceState::Trusted);
    assert_eq!(f.held(&ours(&a)).confirmed_blocks, 2);

    // A different model: hashes would mean something else, so a fresh stream.
    let changed = CONFIG.replace("models: [m]", "models: [m2]");
    let changed = Config::parse_and_validate(&changed, "t").unwrap();
    f.events
        .reload(&changed, &TokenizerRegistry::empty())
        .await
        .unwrap();
    assert_eq!(
        f.events.source_state(f.ep),
        SourceState::Distrusted(Reason::Connecting)
    );
    assert_eq!(f.held(&ours(&a)).blocks, 0);

    // No subscription any more: absent, and no socket left.
    let none = CONFIG.replace("    kv_events: {bind: \"tcp://127.0.0.1:0\"}\n", "");
    let none = Config::parse_and_validate(&none, "t").unwrap();
    f.events
        .reload(&none, &TokenizerRegistry::empty())
        .await
        .unwrap();
    assert_eq!(f.events.source_state(f.ep), SourceState::Absent);
    assert!(f.events.bound_endpoints().await.is_empty());
    assert!(f.events.status().is_empty());
}

#[tokio::test]
async fn a_port_taken_by_another_socket_is_a_bind_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let yaml = CONFIG.replace("tcp://127.0.0.1:0", &format!("tcp://127.0.0.1:{port}"));
    let config = Config::parse_and_validate(&yaml, "test").unwrap();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::default(),
        Arc::clone(&clock),
    ));
    let err = KvEvents::start(
        &config,
        &TokenizerRegistry::empty(),
        index,
        Arc::new(EndpointInterner::new()),
        clock,
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("kv events: cannot bind tcp://127.0.0.1:"),
        "{err}"
    );
}

/// A request expected to wait before its prefill keeps its predictions on a trusted endpoint
/// that much longer (the engine's events come only with the prefill), at most as long as an
/// untrusted endpoint's.
#[tokio::test(start_paused = true)]
async fn predictions_of_a_queued_request_last_until_its_expected_prefill() {
    let mut f = Fixture::new(CONFIG).await;
    f.store(&(0..64).collect::<Vec<u32>>(), 16);
    assert_eq!(f.events.prediction_ttl(f.ep), Duration::from_secs(2));
    let queued: Vec<u32> = (700..764).collect();
    let other: Vec<u32> = (800..864).collect();
    let long: Vec<u32> = (900..964).collect();
    f.events
        .record_routed(f.ep, &ours(&queued), 0, None, Duration::from_secs(5))
        .unwrap();
    f.events
        .record_routed(f.ep, &ours(&other), 0, None, Duration::ZERO)
        .unwrap();
    f.events
        .record_routed(f.ep, &ours(&long), 0, None, Duration::from_secs(600))
        .unwrap();
    tokio::time::advance(Duration::from_millis(2001)).await;
    assert_eq!(f.held(&ours(&other)).blocks, 0, "no wait: the trusted TTL");
    assert_eq!(f.held(&ours(&queued)).blocks, 4);
    tokio::time::advance(Duration::from_millis(5000)).await;
    assert_eq!(
        f.held(&ours(&queued)).blocks,
        0,
        "2 s after the expected prefill"
    );
    assert_eq!(f.held(&ours(&long)).blocks, 4);
    tokio::time::advance(Duration::from_millis(53_000)).await;
    assert_eq!(
        f.held(&ours(&long)).blocks,
        0,
        "never past the index's 60 s"
    );
}
