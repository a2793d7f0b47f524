//! kvsim against a real vLLM: the requests of the vLLM 0.32 capture
//! (`shared/fixtures/vllm-0.32-cpu-smollm2`), parsed, rendered and tokenized by kvsim's own code
//! with the capture's tokenizer files, give exactly the token ids vLLM stored in its KV blocks
//! and the prompt lengths it reported; replayed through a replica configured like that vLLM
//! (block size 128, 24 blocks), they give vLLM's cache hits and its KV-event stream, token for
//! token. The capture ships beside the repository: without it these tests fail.

use std::time::Duration;

use kvsim::capture::{self, Event, Step};
use kvsim::inproc::{call, config, start};
use kvsim::request::{parse, ApiKind};
use kvsim::{HfTokenizer, KvEventsConfig, PromptTokenizer, TokenizerPaths};
use serde_json::json;
use tokio::time::timeout;
use zeromq::{Socket, SocketRecv, SubSocket};

const DEADLINE: Duration = Duration::from_secs(20);

fn api(chat: bool) -> ApiKind {
    if chat {
        ApiKind::ChatCompletions
    } else {
        ApiKind::Completions
    }
}

#[test]
fn every_capture_prompt_tokenizes_to_the_ids_vllm_stored() {
    let tokenizer = HfTokenizer::load(&TokenizerPaths::from_path(&capture::dir()))
        .expect("the capture's tokenizer loads");
    let events = capture::events();
    let block_size = events
        .iter()
        .find_map(|e| match e {
            Event::Stored { block_size, .. } => Some(*block_size),
            _ => None,
        })
        .expect("BlockStored events");
    assert_eq!(block_size, 128, "vLLM's CPU block size in the capture");
    let stored = capture::stored_prefixes(&events);

    let requests = capture::requests();
    assert_eq!(requests.len(), 10, "4 chats and 6 completions");
    assert_eq!(requests.iter().filter(|r| r.chat).count(), 4);
    for (i, r) in requests.iter().enumerate() {
        let body = r.body.to_string();
        let req = parse(api(r.chat), body.as_bytes()).expect("kvsim parses vLLM's requests");
        let ids = tokenizer.request_tokens(&req).expect("tokenizes").ids;
        assert_eq!(
            ids.len() as u64,
            r.prompt_tokens,
            "request {i}: prompt length as vLLM counted it"
        );
        // vLLM stored every full block of this prompt (for it or an earlier request with the
        // same prefix); their token ids are ours, exactly.
        let full = ids.len() / block_size * block_size;
        assert!(full > 0);
        assert!(
            stored.iter().any(|p| p[..] == ids[..full]),
            "request {i}: no BlockStored chain equals kvsim's first {full} tokens"
        );
    }
}

/// Receives one KV-event message within `within`.
async fn recv(sub: &mut SubSocket, within: Duration) -> Option<Vec<Event>> {
    match timeout(within, sub.recv()).await {
        Ok(Ok(msg)) => {
            let frames = msg.into_vec();
            assert_eq!(frames.len(), 3, "[topic, seq, payload]");
            Some(capture::decode_payload(&frames[2]))
        }
        _ => None,
    }
}

/// Events with consecutive removals merged into one (vLLM batches them per step, kvsim per
/// block; the order of stores, removals and clears is what both must share), hashes dropped
/// (each engine hashes its own way).
#[derive(Debug, PartialEq, Eq)]
enum Shape {
    Stored { blocks: usize, token_ids: Vec<u32> },
    Removed(usize),
    Cleared,
}

fn shapes(events: &[Event]) -> Vec<Shape> {
    let mut out: Vec<Shape> = Vec::new();
    for e in events {
        match e {
            Event::Stored {
                block_hashes,
                parent,
                token_ids,
                ..
            } => {
                assert_eq!(*parent, None, "every capture prompt starts a chain");
                out.push(Shape::Stored {
                    blocks: block_hashes.len(),
                    token_ids: token_ids.clone(),
                });
            }
            Event::Removed { block_hashes } => match out.last_mut() {
                Some(Shape::Removed(n)) => *n += block_hashes.len(),
                _ => out.push(Shape::Removed(block_hashes.len())),
            },
            Event::Cleared => out.push(Shape::Cleared),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_capture_gives_vllms_hits_and_kv_events() {
    // The subscriber binds (loopback) and the replica's PUB socket connects, as in the capture.
    let mut sub = SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.expect("bind SUB");
    sub.subscribe("").await.expect("subscribe");
    let mut cfg = config("vllm-like");
    cfg.models = vec!["smollm2".into()];
    cfg.block_size = 128;
    cfg.num_gpu_blocks = Some(24);
    cfg.max_model_len = Some(2048);
    cfg.time_scale = 1000.0;
    cfg.tokenizer = Some(TokenizerPaths::from_path(&capture::dir()));
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: bound.to_string(),
        topic: String::new(),
        bind: false,
        ..KvEventsConfig::default()
    });
    let (_replica, app) = start(cfg).await;

    // PUB/SUB drops what is sent before the subscription arrives: warm up until an event
    // flows, then start cold (`/admin/reset` empties the cache with an AllBlocksCleared).
    let start = tokio::time::Instant::now();
    let mut seed = 0u32;
    loop {
        assert!(
            start.elapsed() < DEADLINE,
            "no KV event within {DEADLINE:?}"
        );
        let prompt: Vec<u32> = (0..300).map(|i| 1000 + seed * 300 + i).collect();
        let (status, _, body) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": prompt, "max_tokens": 1})),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        seed += 1;
        if recv(&mut sub, Duration::from_millis(200)).await.is_some() {
            break;
        }
    }
    let (status, _, _) = call(&app, "POST", "/admin/reset", None).await;
    assert_eq!(status, 200);

    let steps = capture::steps();
    assert_eq!(steps.len(), 11, "10 requests and a prefix-cache reset");
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Request(r) => {
                let (status, _, body) = call(&app, "POST", r.path(), Some(&r.body)).await;
                assert_eq!(status, 200, "step {i}: {body}");
                let usage = &body["usage"];
                assert_eq!(usage["prompt_tokens"], r.prompt_tokens, "step {i}");
                assert_eq!(
                    usage["prompt_tokens_details"]["cached_tokens"], r.cached_tokens,
                    "step {i}: cache hit as vLLM's"
                );
            }
            Step::ResetPrefixCache => {
                let (status, _, _) = call(&app, "POST", "/admin/drop-cache", None).await;
                assert_eq!(status, 200);
            }
        }
    }

    let expected = shapes(&capture::events());
    assert_eq!(
        expected
            .iter()
            .filter(|s| matches!(s, Shape::Stored { .. }))
            .count(),
        9,
        "the capture stores 9 chains"
    );
    // kvsim's events after the reset's AllBlocksCleared.
    let mut got: Vec<Event> = Vec::new();
    let mut after_reset: Option<usize> = None;
    while after_reset.is_none_or(|from| shapes(&got[from..]).len() < expected.len()) {
        let batch = recv(&mut sub, DEADLINE)
            .await
            .expect("kvsim publishes the replay's events");
        got.extend(batch);
        if after_reset.is_none() {
            after_reset = got.iter().position(|e| *e == Event::Cleared).map(|i| i + 1);
        }
    }
    let replay = shapes(&got[after_reset.expect("reset seen")..]);
    assert_eq!(replay.len(), expected.len());
    for (i, (ours, vllm)) in replay.iter().zip(&expected).enumerate() {
        assert_eq!(ours, vllm, "event {i} differs from vLLM's");
    }
}
