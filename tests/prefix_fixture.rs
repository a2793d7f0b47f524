//! Tokens match the engine: the requests of the real vLLM capture in
//! `shared/fixtures/vllm-0.32-cpu-smollm2/`, parsed, rendered and tokenized by the router, give
//! exactly the token ids vLLM reported in its BlockStored KV events (and the prompt lengths it
//! reported in `usage`). This test never skips: the fixture ships beside the repository.

use std::path::Path;

use kvrouter::config::ModelConfig;
use kvrouter::prefix::{Namespace, TokenizerRegistry};
use kvrouter::request::{self, ApiKind, Prompt};
// The capture's reader (files, msgpack events); the tokenization under test is the router's.
use kvsim::capture::{self, Event};

fn registry() -> TokenizerRegistry {
    TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "smollm2".into(),
            tokenizer: Some(capture::dir().display().to_string()),
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .unwrap()
}

#[test]
fn router_tokens_equal_vllm_block_stored_token_ids() {
    let registry = registry();
    let tokenizer = registry.tokenizer("smollm2").unwrap();
    assert!(tokenizer.uses_segment_cache());
    let events = capture::events();
    let block_size = events
        .iter()
        .find_map(|e| match e {
            Event::Stored { block_size, .. } => Some(*block_size),
            _ => None,
        })
        .expect("BlockStored events");
    assert_eq!(block_size, 128, "vLLM CPU block size in the capture");
    // Every full-block prefix the engine stored, as token sequences from the chain root.
    let stored_chains = capture::stored_prefixes(&events);

    let requests = capture::requests();
    let (mut chats, mut completions) = (0, 0);
    for r in &requests {
        let body = serde_json::to_vec(&r.body).unwrap();
        let api = if r.chat {
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
        let usage = r.prompt_tokens;
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
    let events = capture::events();
    let Some(Event::Stored {
        parent,
        token_ids,
        block_size,
        ..
    }) = events.first()
    else {
        panic!("the capture starts with a BlockStored event")
    };
    let registry = registry();
    let ns = Namespace::new("smollm2", None, None);
    let hasher = registry.hasher(&ns);
    assert!(parent.is_none());
    let mut state = hasher.start();
    let mut ours = Vec::new();
    for block in token_ids.chunks(*block_size) {
        hasher.extend(&mut state, block, &mut ours);
    }
    let direct = hasher.hash_tokens(token_ids, usize::MAX);
    assert_eq!(ours, direct);
    assert_eq!(ours.len(), token_ids.len() / 16);
}
