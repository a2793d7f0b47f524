//! What a replica spends per request before the engine sees it: parsing the body and turning
//! the prompt into token ids with a real Hugging Face tokenizer (the vLLM capture's SmolLM2,
//! always present), for a chat whose ~4k-token system prompt is in the segment cache (the
//! steady state of a shared-prefix workload) and for a completion of the same text (encoded
//! whole: its special tokens come from the post-processor). A benchmark plan gives replicas
//! real tokenizers, so this cost is on every request of it.
//!
//! Measured here (2 shared cores, release): chat_4k 10.8 ms before the segment cache, 75 us
//! with it; completion_4k ~12 ms.
//!
//! `cargo bench -p kvsim --bench sim_tokenize`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvsim::request::{parse, ApiKind};
use kvsim::{capture, HfTokenizer, PromptTokenizer, TokenizerPaths};
use serde_json::json;

fn bench(c: &mut Criterion) {
    let tokenizer = HfTokenizer::load(&TokenizerPaths::from_path(&capture::dir()))
        .expect("the capture's tokenizer loads");
    let system = "You are a careful assistant for a logistics company; answer with tracking \
                  details, cite the carrier and never guess a delivery date. "
        .repeat(160);
    let chat = json!({"model": "m", "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Where is parcel 1234567?"},
    ]})
    .to_string();
    let completion = json!({"model": "m", "max_tokens": 16, "prompt": system}).to_string();
    let mut group = c.benchmark_group("sim_tokenize");
    for (name, api, body) in [
        ("chat_4k", ApiKind::ChatCompletions, &chat),
        ("completion_4k", ApiKind::Completions, &completion),
    ] {
        let req = parse(api, body.as_bytes()).expect("parses");
        let tokens = tokenizer.request_tokens(&req).expect("tokenizes").ids.len();
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let req = parse(api, body.as_bytes()).expect("parses");
                tokenizer.request_tokens(&req).expect("tokenizes").ids.len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
