//! Prefix identity costs: tokenizing a 4k-token chat cold vs with its system prompt in the token
//! cache, rendering, hashing. Uses the fixture's SmolLM2 tokenizer (always present).
//!
//! `cargo bench --bench prefix`

use std::borrow::Cow;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter::config::ModelConfig;
use kvrouter::prefix::{BlockHasher, Namespace, TokenizerRegistry};
use kvrouter::request::{ApiKind, ChatMessage, ContentPart, ParsedRequest, Prompt};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
        .find(|p| p.join("tokenizer.json").is_file())
        .expect("shared/fixtures/vllm-0.32-cpu-smollm2 beside the repository")
}

fn registry(cache_tokens: u64) -> TokenizerRegistry {
    TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "smollm2".into(),
            tokenizer: Some(fixture_dir().display().to_string()),
            token_cache_tokens: cache_tokens,
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .unwrap()
}

const WORDS: &[&str] = &[
    "parcel",
    "depot",
    "harbor",
    "truck",
    "route",
    "invoice",
    "customer",
    "delivery",
    "window",
    "priority",
    "express",
    "warehouse",
    "pallet",
    "customs",
    "tracking",
    "signature",
];

/// Deterministic prose of about `words` words.
fn prose(seed: usize, words: usize) -> String {
    let mut out = String::new();
    for i in 0..words {
        let w = WORDS[(i * 7 + seed * 13 + i / 5) % WORDS.len()];
        out.push_str(w);
        out.push(if i % 12 == 11 { '.' } else { ' ' });
    }
    out
}

fn message(role: &'static str, text: String) -> ChatMessage<'static> {
    ChatMessage {
        role: Cow::Borrowed(role),
        content: vec![ContentPart::Text(Cow::Owned(text))],
    }
}

fn bench_prefix(c: &mut Criterion) {
    let system = prose(0, 2_850);
    // A different user turn every iteration, so only the system prompt can come from the cache.
    // Criterion calls each bench closure several times, so the counter lives outside them.
    let counter = std::cell::Cell::new(0usize);
    let next = || {
        counter.set(counter.get() + 1);
        counter.get()
    };
    let user = |i: usize| format!("Request {i}: {}", prose(i + 1, 480));
    let warm = registry(1 << 20);
    let cold = registry(0);
    let t_warm = warm.tokenizer("smollm2").unwrap();
    let t_cold = cold.tokenizer("smollm2").unwrap();
    let sample = [message("system", system.clone()), message("user", user(0))];
    let tokens = t_cold.tokenize_chat(&sample).unwrap().total_tokens;
    println!("4k chat: {tokens} tokens (system prompt + 500-word user turn)");

    let mut g = c.benchmark_group("tokenize_4k_chat");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    g.bench_function("cold", |b| {
        b.iter(|| {
            let i = next();
            let m = [message("system", system.clone()), message("user", user(i))];
            black_box(t_cold.tokenize_chat(&m).unwrap().ids.len())
        })
    });
    t_warm.tokenize_chat(&sample).unwrap();
    g.bench_function("cached_system_prompt", |b| {
        b.iter(|| {
            let i = next();
            let m = [message("system", system.clone()), message("user", user(i))];
            black_box(t_warm.tokenize_chat(&m).unwrap().ids.len())
        })
    });
    g.bench_function("fully_cached", |b| {
        b.iter(|| black_box(t_warm.tokenize_chat(&sample).unwrap().ids.len()))
    });
    g.bench_function("identify_cached_system_prompt", |b| {
        let ns = Namespace::new("smollm2", None, None);
        b.iter(|| {
            let i = next();
            let request = ParsedRequest {
                api: ApiKind::ChatCompletions,
                model: Cow::Borrowed("smollm2"),
                stream: false,
                max_tokens: None,
                cache_salt: None,
                prompt: Prompt::Chat(vec![
                    message("system", system.clone()),
                    message("user", user(i)),
                ]),
            };
            black_box(warm.identify(&request, &ns).block_hashes.len())
        })
    });
    g.finish();

    let mut g = c.benchmark_group("tokenize_4k_chat_parts");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("encode_rendered_text_whole", |b| {
        let text = format!("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", user(0));
        b.iter(|| black_box(t_cold.tokenize_text(black_box(&text)).unwrap().ids.len()))
    });
    for words in [250usize, 500, 1000, 2000, 4000] {
        let text = prose(3, words);
        g.bench_function(format!("encode_prose_{words}_words"), |b| {
            b.iter(|| black_box(t_cold.tokenize_text(black_box(&text)).unwrap().ids.len()))
        });
    }
    g.finish();

    let ids = t_cold.tokenize_chat(&sample).unwrap().ids;
    let hasher = BlockHasher::new(&Namespace::new("smollm2", None, None), 16);
    let mut g = c.benchmark_group("hash");
    g.sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("block_hashes_4k_tokens_bs16", |b| {
        b.iter(|| black_box(hasher.hash_tokens(black_box(&ids), usize::MAX)))
    });
    g.finish();
}

criterion_group!(benches, bench_prefix);
criterion_main!(benches);
