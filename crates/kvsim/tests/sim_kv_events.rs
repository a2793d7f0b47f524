//! KV events over real ZMQ sockets (loopback), decoded with a generic msgpack decoder (`rmpv`),
//! not with the simulator's encoder: the documented vLLM 0.32 shape, sequence numbers, hash
//! chaining, bind and connect modes, cache drops and restarts. Real time with a large
//! `time_scale`; every wait has a deadline.

use kvsim::inproc as sim_support;

use std::time::Duration;

use bytes::Bytes;
use kvsim::block_hash::{BlockHasher, HashKeys};
use kvsim::KvEventsConfig;
use rmpv::Value as Mp;
use sim_support::*;
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const DEADLINE: Duration = Duration::from_secs(10);

/// Keys of a BlockStored map, in the order of vLLM 0.32's capture.
const STORED_KEYS: [&str; 11] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];

/// One decoded multipart message.
#[derive(Debug)]
struct Message {
    topic: Bytes,
    seq: u64,
    events: Vec<Vec<(String, Mp)>>,
}

impl Message {
    fn of_type<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Vec<(String, Mp)>> + 'a {
        self.events
            .iter()
            .filter(move |e| field(e, "type").as_str() == Some(kind))
    }
}

fn field<'a>(event: &'a [(String, Mp)], key: &str) -> &'a Mp {
    &event
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key} in {event:?}"))
        .1
}

fn u64s(v: &Mp) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("uint"))
        .collect()
}

fn decode(frames: Vec<Bytes>) -> Message {
    assert_eq!(frames.len(), 3, "multipart [topic, seq, payload]");
    let seq_bytes: [u8; 8] = frames[1].as_ref().try_into().expect("8-byte sequence");
    let payload = rmpv::decode::read_value(&mut &frames[2][..]).expect("msgpack");
    let batch = payload.as_array().expect("batch is an array");
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]");
    assert!(
        batch[0].as_f64().is_some_and(|ts| ts > 1.6e9),
        "ts is float unix seconds"
    );
    assert_eq!(batch[2].as_u64(), Some(0), "data_parallel_rank");
    let events = batch[1]
        .as_array()
        .expect("events array")
        .iter()
        .map(|e| {
            e.as_map()
                .expect("events are maps (vLLM 0.32)")
                .iter()
                .map(|(k, v)| (k.as_str().expect("string keys").to_string(), v.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    Message {
        topic: frames[0].clone(),
        seq: u64::from_be_bytes(seq_bytes),
        events,
    }
}

async fn recv(sub: &mut SubSocket, within: Duration) -> Option<Message> {
    match timeout(within, sub.recv()).await {
        Ok(Ok(msg)) => Some(decode(msg.into_vec())),
        _ => None,
    }
}

/// A SUB socket connected to `endpoint`, subscribed to everything.
async fn subscriber(endpoint: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    sub
}

/// Sends distinct requests until the subscriber receives something (PUB/SUB drops messages
/// sent before the subscription is registered); returns that first message.
async fn first_message(app: &axum::Router, sub: &mut SubSocket, seed: u32) -> Message {
    let start = tokio::time::Instant::now();
    let mut n = 0;
    while start.elapsed() < DEADLINE {
        call(
            app,
            "POST",
            "/v1/completions",
            Some(&tokens_body(&ids(seed + n, 40), 1)),
        )
        .await;
        n += 1;
        if let Some(msg) = recv(sub, Duration::from_millis(200)).await {
            return msg;
        }
    }
    panic!("no KV event within {DEADLINE:?}");
}

fn events_config(endpoint: &str, topic: &str) -> kvsim::ReplicaConfig {
    let mut cfg = config("r1");
    cfg.time_scale = 100.0;
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: endpoint.into(),
        topic: topic.into(),
        // Tests listen on loopback only.
        bind: true,
        ..KvEventsConfig::default()
    });
    cfg
}

/// Asks a replay socket for everything from `start` on, as vLLM's subscribers do; returns the
/// batches (sequence, decoded) before the end marker.
async fn replay(endpoint: &str, start: u64) -> Vec<Message> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.expect("connect");
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    dealer.send(request).await.expect("send");
    let mut out = Vec::new();
    loop {
        let frames = timeout(DEADLINE, dealer.recv())
            .await
            .expect("replay answer within the deadline")
            .expect("recv")
            .into_vec();
        // vLLM 0.32's layout: [empty, topic, seq, payload]; the end marker's topic is empty.
        assert_eq!(frames.len(), 4, "[empty, topic, seq, payload]");
        assert!(frames[0].is_empty(), "empty delimiter");
        if frames[2][..] == (-1i64).to_be_bytes() {
            assert!(frames[1].is_empty(), "the end marker has no topic");
            assert!(frames[3].is_empty(), "the end marker has no payload");
            return out;
        }
        assert_eq!(&frames[1][..], b"kv", "batches carry the publisher's topic");
        out.push(decode(vec![
            frames[1].clone(),
            frames[2].clone(),
            frames[3].clone(),
        ]));
    }
}

#[tokio::test]
async fn replay_socket_serves_the_buffered_batches_from_the_asked_sequence() {
    let mut cfg = events_config("tcp://127.0.0.1:0", "kv");
    if let Some(kv) = cfg.kv_events.as_mut() {
        kv.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        kv.buffer_steps = 3;
    }
    let (replica, app) = start(cfg).await;
    let endpoint = replica
        .kv_events_replay()
        .expect("a replay socket")
        .to_string();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    // Nobody subscribes: the batches are only in the buffer. Five distinct 32-token prompts,
    // each storing blocks in its own step.
    for n in 0..5 {
        call(
            &app,
            "POST",
            "/v1/completions",
            Some(&tokens_body(&ids(900 + n, 32), 1)),
        )
        .await;
    }
    let all = replay(&endpoint, 0).await;
    let seqs: Vec<u64> = all.iter().map(|m| m.seq).collect();
    assert_eq!(seqs.len(), 3, "buffer_steps bounds the buffer: {seqs:?}");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert!(seqs[0] > 0, "the oldest batches were forgotten: {seqs:?}");
    assert!(all.iter().any(|m| m.of_type("BlockStored").count() > 0));
    let tail = replay(&endpoint, seqs[2]).await;
    assert_eq!(
        tail.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![seqs[2]]
    );
    // A restarted engine remembers nothing.
    call(&app, "POST", "/admin/restart", None).await;
    assert!(replay(&endpoint, 0).await.is_empty());
}

#[tokio::test]
async fn bound_publisher_sends_vllm_shaped_events_whose_hashes_chain() {
    let (replica, app) = start(events_config("tcp://127.0.0.1:0", "kv@r1")).await;
    let endpoint = replica
        .kv_events_endpoint()
        .expect("publishing")
        .to_string();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    let mut sub = subscriber(&endpoint).await;
    let first = first_message(&app, &mut sub, 100).await;
    assert_eq!(first.topic, Bytes::from_static(b"kv@r1"));

    // A 64-token prompt (4 blocks), then one that extends it by 2 blocks.
    let base = ids(7, 64);
    call(
        &app,
        "POST",
        "/v1/completions",
        Some(&tokens_body(&base, 1)),
    )
    .await;
    let (status, _, body) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(&tokens_body(&[base.clone(), ids(8, 32)].concat(), 1)),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 64);

    let mut messages = vec![first];
    while messages
        .iter()
        .flat_map(|m| m.of_type("BlockStored"))
        .count()
        < 3
    {
        messages.push(
            recv(&mut sub, DEADLINE)
                .await
                .expect("events for both requests"),
        );
    }
    for pair in messages.windows(2) {
        assert_eq!(pair[1].seq, pair[0].seq + 1, "consecutive sequence numbers");
    }
    let stored: Vec<&Vec<(String, Mp)>> = messages
        .iter()
        .flat_map(|m| m.of_type("BlockStored"))
        .collect();
    let [.., base_event, extension] = stored[..] else {
        panic!("two BlockStored events")
    };
    for event in [base_event, extension] {
        let keys: Vec<&str> = event.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, STORED_KEYS);
        assert_eq!(field(event, "block_size").as_u64(), Some(16));
        assert_eq!(field(event, "medium").as_str(), Some("GPU"));
        assert_eq!(field(event, "group_idx").as_u64(), Some(0));
        assert_eq!(
            field(event, "kv_cache_spec_kind").as_str(),
            Some("full_attention")
        );
        assert!(field(event, "lora_id").is_nil() && field(event, "lora_name").is_nil());
        let hashes = u64s(field(event, "block_hashes"));
        let tokens = u64s(field(event, "token_ids"));
        assert_eq!(
            tokens.len(),
            hashes.len() * 16,
            "token_ids cover exactly the new blocks"
        );
        assert_eq!(
            field(event, "extra_keys").as_array().unwrap().len(),
            hashes.len()
        );
        // Each hash is (parent, block tokens) chained: recompute from the event alone.
        let mut hasher = BlockHasher::new(16, 0);
        let mut parent = field(event, "parent_block_hash").as_u64();
        for (k, hash) in hashes.iter().enumerate() {
            let block: Vec<u32> = tokens[k * 16..(k + 1) * 16]
                .iter()
                .map(|&t| t as u32)
                .collect();
            assert_eq!(
                hasher.hash_block(parent, &block, 0, &HashKeys::default()),
                *hash
            );
            parent = Some(*hash);
        }
    }
    let base_hashes = u64s(field(base_event, "block_hashes"));
    assert_eq!(base_hashes.len(), 4);
    assert!(field(base_event, "parent_block_hash").is_nil());
    assert_eq!(
        u64s(field(base_event, "token_ids")),
        base.iter().map(|&t| u64::from(t)).collect::<Vec<_>>()
    );
    assert_eq!(
        field(extension, "parent_block_hash").as_u64(),
        base_hashes.last().copied(),
        "the extension chains onto the prefix"
    );
    assert_eq!(u64s(field(extension, "block_hashes")).len(), 2);
}

#[tokio::test]
async fn connecting_publisher_reaches_a_bound_subscriber_and_restarts_its_sequence() {
    let mut sub = SubSocket::new();
    let bound = sub
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind")
        .to_string();
    sub.subscribe("").await.expect("subscribe");
    // vLLM's rule: a concrete address without a forced bind connects.
    let mut cfg = events_config(&bound, "");
    cfg.kv_events.as_mut().unwrap().bind = false;
    let (replica, app) = start(cfg).await;
    assert_eq!(replica.kv_events_endpoint(), Some(bound.as_str()));
    let first = first_message(&app, &mut sub, 200).await;
    assert_eq!(first.topic, Bytes::new());
    call(
        &app,
        "POST",
        "/v1/completions",
        Some(&tokens_body(&ids(300, 40), 1)),
    )
    .await;
    let second = recv(&mut sub, DEADLINE).await.expect("a second batch");
    assert_eq!(second.seq, first.seq + 1);

    // Dropping the cache publishes AllBlocksCleared at once.
    call(&app, "POST", "/admin/drop-cache", None).await;
    let cleared = recv(&mut sub, DEADLINE).await.expect("a clear batch");
    assert_eq!(cleared.seq, second.seq + 1);
    let kinds: Vec<_> = cleared
        .events
        .iter()
        .map(|e| field(e, "type").as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds, vec!["AllBlocksCleared"]);
    assert_eq!(
        cleared.events[0].len(),
        1,
        "AllBlocksCleared has only its type"
    );

    // A restart reopens the socket and numbers from 0 again.
    call(&app, "POST", "/admin/restart", None).await;
    let after = first_message(&app, &mut sub, 400).await;
    assert!(
        after.seq < cleared.seq,
        "sequence restarted: {} then {}",
        cleared.seq,
        after.seq
    );
    assert!(
        after.of_type("AllBlocksCleared").next().is_none(),
        "a restart sends no clear event"
    );
}

#[tokio::test]
async fn lora_requests_carry_the_adapter_in_events() {
    let mut cfg = events_config("tcp://127.0.0.1:0", "");
    cfg.adapters = vec!["sql".into(), "chat".into()];
    let (replica, app) = start(cfg).await;
    let mut sub = subscriber(replica.kv_events_endpoint().unwrap()).await;
    first_message(&app, &mut sub, 500).await;
    let mut body = tokens_body(&ids(9, 32), 1);
    body["model"] = "chat".into();
    call(&app, "POST", "/v1/completions", Some(&body)).await;
    let msg = recv(&mut sub, DEADLINE).await.expect("event");
    let stored = msg.of_type("BlockStored").next().expect("BlockStored");
    assert_eq!(field(stored, "lora_name").as_str(), Some("chat"));
    assert_eq!(field(stored, "lora_id").as_u64(), Some(2));
    let extra = field(stored, "extra_keys").as_array().unwrap();
    assert_eq!(extra.len(), 2);
    assert_eq!(extra[0].as_array().unwrap()[0].as_str(), Some("chat"));
}

#[tokio::test]
async fn bound_publisher_rebinds_its_port_after_a_restart() {
    let (replica, app) = start(events_config("tcp://127.0.0.1:0", "")).await;
    let endpoint = replica.kv_events_endpoint().unwrap().to_string();
    let mut sub = subscriber(&endpoint).await;
    let before = first_message(&app, &mut sub, 600).await;
    call(
        &app,
        "POST",
        "/v1/completions",
        Some(&tokens_body(&ids(700, 40), 1)),
    )
    .await;
    let later = recv(&mut sub, DEADLINE).await.expect("a second batch");
    assert_eq!(later.seq, before.seq + 1);
    call(&app, "POST", "/admin/restart", None).await;
    // Same endpoint: the subscriber reconnects by itself.
    // (Batches published before it is back are lost; without a restart the next would be
    // later + 1 or more.)
    let after = first_message(&app, &mut sub, 800).await;
    assert!(
        after.seq <= later.seq,
        "sequence restarted: {} then {}",
        later.seq,
        after.seq
    );
    assert_eq!(replica.kv_events_endpoint(), Some(endpoint.as_str()));
}

/// The CPU offload tier over real ZMQ, as vLLM's offloading connector sends it: each computed
/// block reaches the tier (`BlockStored`, medium `CPU`, a placeholder of hashes only), the GPU
/// evicts it (`BlockRemoved`, `GPU`) while the tier keeps it, a repeat loads it back (cached,
/// and `BlockStored` on the GPU again), and the full tier evicts its oldest (`BlockRemoved`,
/// `CPU`).
#[tokio::test]
async fn the_cpu_tier_reports_its_blocks_with_medium_cpu() {
    let mut cfg = events_config("tcp://127.0.0.1:0", "");
    cfg.num_gpu_blocks = Some(9); // 8 usable: 128 tokens
    cfg.cpu_offload = Some(kvsim::CpuOffloadConfig {
        num_blocks: 12,
        ..kvsim::CpuOffloadConfig::default()
    });
    let (replica, app) = start(cfg).await;
    let mut sub = subscriber(replica.kv_events_endpoint().expect("publishing")).await;
    let mut messages = vec![first_message(&app, &mut sub, 300).await];
    // A: 4 blocks; B fills the GPU and pushes A out; A again.
    let a = ids(31, 65);
    for prompt in [a.clone(), ids(32, 113), a.clone()] {
        let (status, _, body) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(&tokens_body(&prompt, 1)),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        if prompt == a && messages.len() > 1 {
            assert_eq!(
                body["usage"]["prompt_tokens_details"]["cached_tokens"], 64,
                "loaded from the CPU tier"
            );
        }
        messages.push(recv(&mut sub, DEADLINE).await.expect("a batch"));
    }
    // A's four blocks, as the engine hashes them.
    let mut hasher = BlockHasher::new(16, 0);
    let a_hashes: Vec<u64> = (0..4)
        .scan(None, |parent, k| {
            let h = hasher.hash_block(*parent, &a[k * 16..(k + 1) * 16], 0, &HashKeys::default());
            *parent = Some(h);
            Some(h)
        })
        .collect();
    // Hashes of the events of one kind in one medium, over every message read.
    let on = |messages: &[Message], kind: &str, medium: &str| -> Vec<u64> {
        messages
            .iter()
            .flat_map(|m| m.events.iter())
            .filter(|e| field(e, "type").as_str() == Some(kind))
            .filter(|e| field(e, "medium").as_str() == Some(medium))
            .flat_map(|e| u64s(field(e, "block_hashes")))
            .collect()
    };
    // A step's events come after its answer, in batches of their own: read until everything
    // checked below has arrived (bounded by DEADLINE), not until a quiet spell.
    let arrived = |messages: &[Message]| {
        let gpu_stored = on(messages, "BlockStored", "GPU");
        !on(messages, "BlockRemoved", "CPU").is_empty()
            && a_hashes.iter().all(|h| {
                on(messages, "BlockStored", "CPU").contains(h)
                    && on(messages, "BlockRemoved", "GPU").contains(h)
                    && gpu_stored.iter().filter(|&x| x == h).count() >= 2
            })
    };
    let until = tokio::time::Instant::now() + DEADLINE;
    while !arrived(&messages) {
        match recv(
            &mut sub,
            until.saturating_duration_since(tokio::time::Instant::now()),
        )
        .await
        {
            Some(m) => messages.push(m),
            None => break,
        }
    }
    let events: Vec<&Vec<(String, Mp)>> = messages.iter().flat_map(|m| m.events.iter()).collect();
    let placeholders: Vec<_> = events
        .iter()
        .filter(|e| field(e, "medium").as_str() == Some("CPU"))
        .filter(|e| field(e, "type").as_str() == Some("BlockStored"))
        .collect();
    assert!(!placeholders.is_empty());
    for e in &placeholders {
        assert_eq!(field(e, "block_size").as_u64(), Some(0));
        assert!(field(e, "token_ids").as_array().unwrap().is_empty());
        assert!(field(e, "parent_block_hash").is_nil());
    }
    let gpu_stored = on(&messages, "BlockStored", "GPU");
    let cpu_stored = on(&messages, "BlockStored", "CPU");
    let gpu_removed = on(&messages, "BlockRemoved", "GPU");
    let cpu_removed = on(&messages, "BlockRemoved", "CPU");
    // A's four blocks are in the tier, left the GPU, and came back to it.
    for h in &a_hashes {
        assert!(cpu_stored.contains(h), "stored to the tier");
        assert!(gpu_removed.contains(h), "evicted from the GPU");
        assert_eq!(
            gpu_stored.iter().filter(|&x| x == h).count(),
            2,
            "computed once, loaded back once"
        );
    }
    // 4 + 7 + first_message's blocks passed 12: the tier evicted its oldest.
    assert!(!cpu_removed.is_empty(), "{cpu_removed:?}");
    assert!(cpu_removed.iter().all(|h| cpu_stored.contains(h)));
}

#[tokio::test]
async fn a_prompts_blocks_are_published_when_its_prefill_step_ends_not_when_it_starts() {
    // vLLM publishes a step's events in `update_from_output`, after the forward pass. In real
    // time (scale 1) a 2,000-token prompt's prefill step is some hundreds of ms on the default
    // profile: its BlockStored cannot arrive before half of it has passed (a slow machine only
    // makes it later). Published at the step's start, it came within a few ms.
    let mut cfg = events_config("tcp://127.0.0.1:0", "");
    cfg.time_scale = 1.0;
    let step_ms = kvsim::profile::StepProfile::builtin(&cfg.profile)
        .expect("profile")
        .step_ms([kvsim::profile::StepWork::Prefill {
            new_tokens: 2000,
            context_tokens: 0,
        }]);
    assert!(step_ms > 50.0, "a step long enough to tell: {step_ms} ms");
    let (replica, app) = start(cfg).await;
    let mut sub = subscriber(replica.kv_events_endpoint().unwrap()).await;
    first_message(&app, &mut sub, 900).await;
    let prompt = ids(901, 2000);
    let sent = tokio::time::Instant::now();
    let app2 = app.clone();
    let body = tokens_body(&prompt, 1);
    let request = tokio::spawn(async move {
        call(&app2, "POST", "/v1/completions", Some(&body)).await;
    });
    // The batch storing the prompt's first block (the warm-up's batches, which may still
    // arrive, store other tokens).
    let first_block: Vec<u64> = prompt[..16].iter().map(|&t| u64::from(t)).collect();
    let until = tokio::time::Instant::now() + DEADLINE;
    let after_ms = loop {
        let msg = recv(
            &mut sub,
            until.saturating_duration_since(tokio::time::Instant::now()),
        )
        .await
        .expect("the prompt's blocks");
        let at = sent.elapsed().as_secs_f64() * 1e3;
        if msg
            .of_type("BlockStored")
            .any(|e| u64s(field(e, "token_ids")).starts_with(&first_block))
        {
            break at;
        }
    };
    assert!(
        after_ms >= step_ms / 2.0,
        "published {after_ms:.0} ms after the request, its prefill step is {step_ms:.0} ms"
    );
    request.await.unwrap();
}
