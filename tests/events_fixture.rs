//! The real vLLM 0.32 capture (`shared/fixtures/vllm-0.32-cpu-smollm2/`) through the KV-event
//! path: every message decodes to the blocks and token counts vLLM sent, and, applied in order,
//! the index holds exactly the prefixes the engine held after each message, as the router hashes
//! the recorded requests (chat template, real tokenizer, 16-token blocks over vLLM's 128).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvrouter::config::Config;
use kvrouter::events::wire::{decode_message, Event};
use kvrouter::events::{KvEvents, SourceState};
use kvrouter::index::{Clock, EndpointInterner, IndexOptions, ManualClock, Medium, OwnershipIndex};
use kvrouter::prefix::{Namespace, TokenizerRegistry};
use kvrouter::request::{self, ApiKind};

fn fixture_dir() -> PathBuf {
    testkit::shared_fixture()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Every captured message's frames, in order.
fn messages(dir: &Path) -> Vec<Vec<Vec<u8>>> {
    std::fs::read_to_string(dir.join("kv-events.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            v["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| hex(f.as_str().unwrap()))
                .collect()
        })
        .collect()
}

/// One line per event: `S<blocks>/<tokens>`, `R<blocks>` or `C`.
fn summary(frames: &[Vec<u8>]) -> Vec<String> {
    let m = decode_message(frames).unwrap();
    m.batch
        .events
        .iter()
        .map(|e| match e {
            Event::Stored(s) => {
                assert_eq!(s.block_size, 128);
                assert_eq!(s.medium, Medium::Gpu);
                assert_eq!(s.group_idx, Some(0));
                assert_eq!((s.lora_id, s.lora_name.as_deref()), (None, None));
                assert_eq!(
                    s.extra_keys.as_ref().map(Vec::len),
                    Some(s.block_hashes.len())
                );
                assert!(s.extra_keys.iter().flatten().all(Option::is_none));
                assert_eq!(s.token_ids.len(), s.block_hashes.len() * 128);
                format!("S{}/{}", s.block_hashes.len(), s.token_ids.len())
            }
            Event::Removed(r) => {
                assert_eq!(r.medium, Medium::Gpu);
                format!("R{}", r.block_hashes.len())
            }
            Event::Cleared { medium: None } => "C".to_string(),
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

#[test]
fn the_real_capture_decodes_to_the_expected_blocks_and_token_counts() {
    let msgs = messages(&fixture_dir());
    let expected: [&[&str]; 9] = [
        &["S3/384"],
        &["S5/640"],
        &["S5/640"],
        &["S5/640"],
        &["R1", "S5/640"],
        &["R1", "R1", "R1", "R1", "R1", "S5/640"],
        &["R1", "R1", "R1", "R1", "R1", "S5/640"],
        &["R1", "R1", "R1", "S3/384"],
        &["C", "S3/384"],
    ];
    assert_eq!(msgs.len(), expected.len());
    for (i, (frames, want)) in msgs.iter().zip(expected).enumerate() {
        let m = decode_message(frames).unwrap();
        assert_eq!(m.seq, i as u64, "consecutive sequence numbers from 0");
        assert_eq!(m.topic, b"", "vLLM's default topic");
        assert_eq!(m.batch.dp_rank, Some(0));
        assert!(m.batch.ts_s > 1.7e9, "unix seconds");
        assert_eq!(summary(frames), want, "message {i}");
    }
    // The first stored chain is the shared 384-token system prompt, which the last two store
    // again under the same engine hashes.
    let hashes = |i: usize| match &decode_message(&msgs[i]).unwrap().batch.events[..] {
        [.., Event::Stored(s)] => s.block_hashes.clone(),
        _ => unreachable!(),
    };
    assert_eq!(hashes(0), hashes(7));
    assert_eq!(hashes(0), hashes(8));
    assert_eq!(hashes(0)[2], 8263073329575226639);
}

#[tokio::test]
async fn applied_in_order_the_index_holds_what_the_engine_held() {
    let dir = fixture_dir();
    let config = Config::parse_and_validate(
        &format!(
            r#"
models:
  - name: smollm2
    tokenizer: {}
pools:
  - name: cpu
    models: [smollm2]
    kv_events: {{bind: "tcp://127.0.0.1:0"}}
    endpoints:
      - address: 127.0.0.1:8000
"#,
            dir.display()
        ),
        "test",
    )
    .unwrap();
    let registry = TokenizerRegistry::from_config(&config.models, Path::new("/")).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1));
    let index = Arc::new(OwnershipIndex::new(
        IndexOptions::from(&config.cache_index),
        Arc::clone(&clock),
    ));
    let interner = Arc::new(EndpointInterner::new());
    let events = KvEvents::start(
        &config,
        &registry,
        Arc::clone(&index),
        Arc::clone(&interner),
        clock,
    )
    .await
    .unwrap();
    let ep = interner.lease("127.0.0.1:8000".parse().unwrap()).id();

    // The recorded requests, hashed as the router does.
    let requests: Vec<Vec<u64>> = std::fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let body = record.get("request")?;
            let api = if body.get("messages").is_some() {
                ApiKind::ChatCompletions
            } else {
                ApiKind::Completions
            };
            let bytes = serde_json::to_vec(body).unwrap();
            let parsed = request::parse(api, &bytes).unwrap();
            let identity = registry.identify(&parsed, &Namespace::new("smollm2", None, None));
            assert!(identity.exact);
            Some(identity.block_hashes)
        })
        .collect();
    assert_eq!(requests.len(), 10);
    let (chat, doc0, doc5) = (&requests[0], &requests[2], &requests[7]);
    assert_eq!((chat.len(), doc0.len()), (26, 44), "421 and 704 tokens");

    // Blocks of ours confirmed for (chat, document 0, document 5) after each message: the
    // engine stores whole 128-token blocks (8 of ours), evicts tail-first, resets at 8.
    let expected: [(u32, u32, u32); 9] = [
        (24, 0, 0),
        (24, 40, 0),
        (24, 40, 0),
        (24, 40, 0),
        (16, 40, 0),
        (0, 16, 0),
        (0, 0, 40),
        (24, 0, 40),
        (24, 0, 0),
    ];
    let msgs = messages(&dir);
    assert_eq!(msgs.len(), expected.len(), "one state per captured message");
    for (i, (frames, want)) in msgs.iter().zip(expected).enumerate() {
        assert!(events.ingest(ep, frames));
        let held = |r: &[u64]| {
            let m = index.lookup(r, &[ep])[0];
            assert_eq!(m.blocks, m.confirmed_blocks, "no predictions here");
            m.blocks
        };
        assert_eq!(
            (held(chat), held(doc0), held(doc5)),
            want,
            "after message {i}"
        );
        assert_eq!(events.source_state(ep), SourceState::Trusted, "after {i}");
    }
    let status = &events.status()[0];
    assert_eq!(status.engine_block_size_tokens, 128);
    let c = status.counters;
    assert_eq!((c.messages, c.gaps, c.malformed, c.clears), (9, 0, 0, 1));
    assert_eq!((c.blocks_mapped, c.blocks_unmapped), (39, 0));
    assert_eq!((c.blocks_removed, c.unknown_removed), (14, 0));
    // After the reset only the re-stored system prompt is left: 3 engine blocks, 24 of ours.
    assert_eq!(status.engine_blocks, 3);
    assert_eq!(index.stats().entries, 24);
}
