//! Prefix identity costs: tokenizing a 4k-token chat cold vs with its system prompt in the token
//! cache, rendering, hashing. Uses the fixture's SmolLM2 tokenizer (always present).
//!
//! The `hostile` group times issue 12's worst-case bodies (parse + identify): ~32 MiB of 500k
//! tiny image-part messages and ~7 MiB of 60k messages with an image each, refused by the
//! default limits, identified with the limits lifted, and within a 100 ms budget; plus 10k image
//! messages (the default limit). Under `cargo test` (no `--bench` argument) the bodies are 100
//! times smaller so the suite stays fast.
//!
//! `cargo bench --bench prefix` (`-- hostile` for that group only)

use std::borrow::Cow;
use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter::config::ModelConfig;
use kvrouter::prefix::{BlockHasher, Namespace, TokenizerRegistry};
use kvrouter::request::{
    self, ApiKind, ChatMessage, ContentPart, ParsedRequest, Prompt, RequestLimits,
};

mod support;
use support::{chat_body, prose};

fn registry(cache_tokens: u64) -> TokenizerRegistry {
    registry_chunked(cache_tokens, ModelConfig::default().chunk_bytes)
}

fn registry_chunked(cache_tokens: u64, chunk_bytes: u64) -> TokenizerRegistry {
    TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "smollm2".into(),
            tokenizer: Some(testkit::shared_fixture().display().to_string()),
            token_cache_tokens: cache_tokens,
            chunk_bytes,
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .unwrap()
}

fn message(role: &'static str, text: String) -> ChatMessage<'static> {
    ChatMessage {
        role: Cow::Borrowed(role),
        content: vec![ContentPart::Text(Cow::Owned(text))],
        extra: None,
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
                chat: Default::default(),
            };
            black_box(warm.identify(&request, &ns).block_hashes.len())
        })
    });
    // As routing identifies it (`defer_tokenizing_after` 0.5, the default): the new user turn
    // after the cached system prompt is left for after the decision.
    g.bench_function("identify_for_routing_cached_system_prompt", |b| {
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
                chat: Default::default(),
            };
            let id = warm.identify_for_routing(&request, &ns, None);
            assert!(id.deferred.is_some());
            black_box(id.block_hashes.len())
        })
    });
    g.finish();

    // How the cached case scales with the new text: the same cached system prompt, a new user
    // turn of 20 to 480 words (the first group's turn is the 480-word one).
    let mut g = c.benchmark_group("tokenize_cached_system_prompt_by_new_turn");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for words in [20usize, 60, 120, 240, 480] {
        let turn = |i: usize| format!("Request {i}: {}", prose(i + 1, words));
        g.bench_function(format!("{words}_words"), |b| {
            b.iter(|| {
                let i = next();
                let m = [message("system", system.clone()), message("user", turn(i))];
                black_box(t_warm.tokenize_chat(&m).unwrap().ids.len())
            })
        });
        // The same, deferring the new turn as routing does (`defer_tokenizing_after` 0.5).
        g.bench_function(format!("{words}_words_deferred"), |b| {
            b.iter(|| {
                let i = next();
                let m = [message("system", system.clone()), message("user", turn(i))];
                let tokens = t_warm
                    .tokenize_chat_deferring(&m, &Default::default(), None, Some(0.5))
                    .unwrap();
                assert!(tokens.deferred.is_some());
                black_box(tokens.ids.len())
            })
        });
    }
    g.finish();

    // Text of words never seen before (random letters): every word misses the ids-only path's
    // word cache and goes to the BPE model; against the HF tokenizer's own full encode of the
    // same text (what the router ran before the ids-only path).
    let mut g = c.benchmark_group("tokenize_unseen_words_500");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let hf = tokenizers::Tokenizer::from_file(testkit::shared_fixture().join("tokenizer.json"))
        .expect("the fixture's tokenizer.json");
    g.bench_function("hf_full_encode", |b| {
        b.iter_batched(
            || unseen_words(next(), 500),
            |text| black_box(hf.encode_fast(text.as_str(), true).unwrap().get_ids().len()),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("router", |b| {
        b.iter_batched(
            || unseen_words(next(), 500),
            |text| black_box(t_cold.tokenize_text(&text).unwrap().ids.len()),
            criterion::BatchSize::SmallInput,
        )
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

    // A conversation sent as one message (a trace replayed as single-message chats, a pasted
    // document with a new question): ~12k tokens seen before, then 200 new words. In chunks
    // (`models[].chunk_bytes`, the default) the repeated start comes from the token cache;
    // unchunked the whole message is one segment, tokenized again.
    let earlier = prose(5, 9_000);
    let next_turn = |i: usize| format!("{earlier} Turn {i}: {}", prose(i + 1, 200));
    let mut g = c.benchmark_group("tokenize_one_long_message");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (name, chunk_bytes) in [
        ("chunked", ModelConfig::default().chunk_bytes),
        ("unchunked", 0),
    ] {
        let reg = registry_chunked(1 << 22, chunk_bytes);
        let t = reg.tokenizer("smollm2").unwrap();
        let first = t
            .tokenize_chat(&[message("user", earlier.clone())])
            .unwrap();
        if chunk_bytes == ModelConfig::default().chunk_bytes {
            println!(
                "one long message: {} tokens before the new turn",
                first.total_tokens
            );
        }
        g.bench_function(format!("next_turn_{name}"), |b| {
            b.iter(|| {
                let m = [message("user", next_turn(next()))];
                black_box(t.tokenize_chat(&m).unwrap().ids.len())
            })
        });
        g.bench_function(format!("next_turn_{name}_deferred"), |b| {
            b.iter(|| {
                let m = [message("user", next_turn(next()))];
                black_box(
                    t.tokenize_chat_deferring(&m, &Default::default(), None, Some(0.5))
                        .unwrap()
                        .ids
                        .len(),
                )
            })
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

fn bench_hostile(c: &mut Criterion) {
    // Full size under `cargo bench`, 1/100 under `cargo test` (which runs each bench once).
    let scale = if support::measuring() { 1 } else { 100 };
    let tiny = chat_body("smollm2", 500_000 / scale, |i| {
        format!(
            r#"{{"role":"user","content":[{{"type":"image_url","image_url":"u{}"}}]}}"#,
            i % 10
        )
    });
    let image = |i: usize| {
        format!(
            r#"{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"https://x/{i}.png"}}}}]}}"#
        )
    };
    let images_60k = chat_body("smollm2", 60_000 / scale, image);
    let images_10k = chat_body("smollm2", 10_000 / scale, image);
    println!(
        "bodies: {:.1} MiB (500k tiny image parts), {:.1} MiB (60k image messages), {:.1} MiB (10k)",
        tiny.len() as f64 / 1048576.0,
        images_60k.len() as f64 / 1048576.0,
        images_10k.len() as f64 / 1048576.0
    );
    let reg = registry(1 << 20);
    let ns = Namespace::new("smollm2", None, None);
    let lifted = RequestLimits {
        max_messages: 1 << 20,
        max_content_parts: 1 << 21,
    };
    let api = ApiKind::ChatCompletions;
    // The default limits (scaled with the bodies under `cargo test`).
    let defaults = RequestLimits {
        max_messages: RequestLimits::default().max_messages / scale,
        max_content_parts: RequestLimits::default().max_content_parts / scale,
    };

    let mut g = c.benchmark_group("hostile");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for (name, body) in [
        ("500k_tiny_image_parts", &tiny),
        ("60k_image_messages", &images_60k),
    ] {
        assert_eq!(
            request::parse_with(api, body, defaults)
                .unwrap_err()
                .http_status(),
            413,
            "over the default limit"
        );
        g.bench_function(format!("parse_{name}_default_limits_413"), |b| {
            b.iter(|| black_box(request::parse_with(api, black_box(body), defaults).is_err()))
        });
    }
    g.bench_function("parse_identify_10k_image_messages", |b| {
        b.iter(|| {
            let parsed = request::parse_with(api, &images_10k, defaults).unwrap();
            black_box(reg.identify(&parsed, &ns).block_hashes.len())
        })
    });
    for (name, body) in [
        ("500k_tiny_image_parts", &tiny),
        ("60k_image_messages", &images_60k),
    ] {
        let parsed = request::parse_with(api, body, lifted).unwrap();
        let id = reg.identify(&parsed, &ns);
        println!(
            "{name}, limits lifted: source {} ({:?})",
            id.source(),
            id.fallback
        );
        g.bench_function(format!("parse_identify_{name}_limits_lifted"), |b| {
            b.iter(|| {
                let parsed = request::parse_with(api, body, lifted).unwrap();
                black_box(reg.identify(&parsed, &ns).block_hashes.len())
            })
        });
        g.bench_function(
            format!("parse_identify_{name}_limits_lifted_budget_100ms"),
            |b| {
                b.iter(|| {
                    let deadline = Instant::now() + Duration::from_millis(100);
                    let parsed = request::parse_with(api, body, lifted).unwrap();
                    black_box(
                        reg.identify_until(&parsed, &ns, Some(deadline))
                            .block_hashes
                            .len(),
                    )
                })
            },
        );
    }
    g.finish();
}

/// `words` words of 3-9 random lowercase letters, different for every `seed`.
fn unseen_words(seed: usize, words: usize) -> String {
    let mut x = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = String::with_capacity(words * 7);
    for _ in 0..words {
        for _ in 0..3 + next() % 7 {
            out.push((b'a' + (next() % 26) as u8) as char);
        }
        out.push(' ');
    }
    out
}

criterion_group!(benches, bench_prefix, bench_hostile);
criterion_main!(benches);
