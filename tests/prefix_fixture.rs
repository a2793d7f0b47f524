//! Tokens match the engine: the requests of the real vLLM capture in
//! `shared/fixtures/vllm-0.32-cpu-smollm2/`, parsed, rendered and tokenized by the router, give
//! exactly the token ids vLLM reported in its BlockStored KV events (and the prompt lengths it
//! reported in `usage`). This test never skips: the fixture ships beside the repository.

use std::path::{Path, PathBuf};

use kvrouter::config::ModelConfig;
use kvrouter::prefix::{Namespace, TokenizerRegistry};
use kvrouter::request::{self, ApiKind, Prompt};
use rmpv::Value;

fn fixture_dir() -> PathBuf {
    testkit::shared_fixture()
}

struct Stored {
    block_hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    block_size: usize,
}

fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Every BlockStored event of the capture, in order.
fn stored_events(dir: &Path) -> Vec<Stored> {
    let text = std::fs::read_to_string(dir.join("kv-events.jsonl")).unwrap();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let msg: serde_json::Value = serde_json::from_str(line).unwrap();
        let payload = hex(msg["frames_hex"][2].as_str().unwrap());
        let batch = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
        let events = batch.as_array().unwrap()[1].as_array().unwrap();
        for ev in events {
            if field(ev, "type").and_then(Value::as_str) != Some("BlockStored") {
                continue;
            }
            let ids = |v: &Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect()
            };
            out.push(Stored {
                block_hashes: ids(field(ev, "block_hashes").unwrap()),
                parent: field(ev, "parent_block_hash").and_then(Value::as_u64),
                token_ids: ids(field(ev, "token_ids").unwrap())
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
                block_size: field(ev, "block_size").unwrap().as_u64().unwrap() as usize,
            });
        }
    }
    out
}

/// The token ids of the engine block chain ending in `last`, root first.
fn chain(events: &[Stored], last: u64) -> Vec<u32> {
    let mut blocks: Vec<&[u32]> = Vec::new();
    let mut at = Some(last);
    while let Some(h) = at {
        let ev = events
            .iter()
            .find(|e| e.block_hashes.contains(&h))
            .expect("parent in the capture");
        let i = ev.block_hashes.iter().position(|&x| x == h).unwrap();
        blocks.push(&ev.token_ids[i * ev.block_size..(i + 1) * ev.block_size]);
        at = if i == 0 {
            ev.parent
        } else {
            Some(ev.block_hashes[i - 1])
        };
    }
    blocks.into_iter().rev().flatten().copied().collect()
}

#[test]
fn router_tokens_equal_vllm_block_stored_token_ids() {
    let dir = fixture_dir();
    let registry = TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "smollm2".into(),
            tokenizer: Some(dir.display().to_string()),
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .unwrap();
    let tokenizer = registry.tokenizer("smollm2").unwrap();
    assert!(tokenizer.uses_segment_cache());
    let events = stored_events(&dir);
    assert!(!events.is_empty());
    let block_size = events[0].block_size;
    assert_eq!(block_size, 128, "vLLM CPU block size in the capture");
    // Every full-block prefix the engine stored, as token sequences from the chain root.
    let stored_chains: Vec<Vec<u32>> = events
        .iter()
        .map(|e| chain(&events, *e.block_hashes.last().unwrap()))
        .collect();

    let requests = std::fs::read_to_string(dir.join("requests.jsonl")).unwrap();
    let (mut chats, mut completions) = (0, 0);
    for line in requests.lines().filter(|l| !l.trim().is_empty()) {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(body) = record.get("request") else {
            continue;
        };
        let body = serde_json::to_vec(body).unwrap();
        let api = if record["request"].get("messages").is_some() {
            chats += 1;
            ApiKind::ChatCompletions
        } else {
            completions += 1;
            ApiKind::Completions
        };
        let parsed = request::parse(api, &body).unwrap();
        let ids = match &parsed.prompt {
            Prompt::Chat(messages) => tokenizer.tokenize_chat(messages).unwrap(),
            Prompt::Input(request::PromptInput::Text(t)) => tokenizer.tokenize_text(t).unwrap(),
            other => panic!("unexpected prompt {other:?}"),
        };
        let usage = record["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(ids.total_tokens, usage, "prompt length as vLLM counted it");
        assert_eq!(ids.ids.len() as u64, usage);
        assert!(!ids.truncated);

        // The engine stored (now or for an earlier request with the same prefix) every full
        // block of this prompt; their token ids must be ours, exactly.
        let full = ids.ids.len() / block_size * block_size;
        assert!(full > 0);
        let engine = stored_chains
            .iter()
            .find(|c| c.len() == full && c[..] == ids.ids[..full])
            .map(|c| c.len());
        assert_eq!(
            engine,
            Some(full),
            "no BlockStored chain equals our first {full} tokens ({api:?})"
        );

        // And identify() hashes those tokens in 16-token blocks.
        let identity = registry.identify(&parsed, &Namespace::new("smollm2", None, None));
        assert!(identity.exact);
        assert_eq!(identity.tokens, usage);
        assert_eq!(identity.block_hashes.len(), ids.ids.len() / 16);
    }
    assert_eq!((chats, completions), (4, 6));
}

#[test]
fn engine_blocks_rehash_to_our_block_hashes() {
    // Re-chunking the engine's 128-token BlockStored blocks into our 16-token blocks gives the
    // same hashes identify() computed for the request (the KV-event path will rely on this).
    let dir = fixture_dir();
    let events = stored_events(&dir);
    let registry = TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "smollm2".into(),
            tokenizer: Some(dir.display().to_string()),
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .unwrap();
    let ns = Namespace::new("smollm2", None, None);
    let hasher = registry.hasher(&ns);
    let first = &events[0];
    assert!(first.parent.is_none());
    let mut state = hasher.start();
    let mut ours = Vec::new();
    for block in first.token_ids.chunks(first.block_size) {
        hasher.extend(&mut state, block, &mut ours);
    }
    let direct = hasher.hash_tokens(&first.token_ids, usize::MAX);
    assert_eq!(ours, direct);
    assert_eq!(ours.len(), first.token_ids.len() / 16);
}
