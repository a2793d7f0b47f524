//! Check 6 of issue 14: kvsim against the real engine, request by request.

use crate::checks::{CHAT, COMPLETIONS};
use crate::fleet::{chat, completion_ids, long_system, post_direct, Fleet};

/// One request of the kvsim comparison.
struct Step {
    label: String,
    path: &'static str,
    body: String,
}

/// The request sequence for the kvsim comparison: shared chat prefixes, an identical repeat,
/// a multi-turn continuation, token-id prompts at and around block boundaries, short prompts;
/// then enough distinct 1900-token prompts to overflow the engine's `blocks` KV blocks, and
/// the oldest, a middle and the newest of them again (what eviction left).
fn sequence(blocks: u32) -> Vec<Step> {
    let system = long_system("kvsim");
    let half = format!(
        "[kvsim] {}",
        "You are the support assistant of a freight company; always quote the tracking number. "
            .repeat(20)
    ) + "Answer in French.";
    let ids: Vec<u32> = (0..700).map(|i| 20_000 + (i * 7) % 9_000).collect();
    let chat_step = |label: &str, body: String| Step {
        label: label.to_string(),
        path: CHAT,
        body,
    };
    let ids_step = |label: &str, n: usize| Step {
        label: label.to_string(),
        path: COMPLETIONS,
        body: completion_ids(&ids[..n], 4),
    };
    let multi_turn = serde_json::json!({
        "model": crate::engine::MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Where is parcel 1?"},
            {"role": "assistant", "content": "Parcel 1 is in Lyon, tracking number FR-0001."},
            {"role": "user", "content": "And parcel 2?"},
        ],
    })
    .to_string();
    let mut steps = vec![
        chat_step("chat, new prefix", chat(&system, "Where is parcel 1?", 4)),
        chat_step("chat, same system", chat(&system, "Where is parcel 2?", 4)),
        chat_step(
            "chat, identical to the first",
            chat(&system, "Where is parcel 1?", 4),
        ),
        chat_step("chat, second turn of the first", multi_turn),
        chat_step(
            "chat, half the system shared",
            chat(&half, "Where is parcel 1?", 4),
        ),
        ids_step("ids, 256 new", 256),
        ids_step("ids, same 256", 256),
        ids_step("ids, 257", 257),
        ids_step("ids, 255", 255),
        ids_step("ids, 600", 600),
        ids_step("ids, same 600", 600),
        chat_step("chat, short", chat("Be terse.", "Hi.", 4)),
        chat_step("chat, same short", chat("Be terse.", "Hi.", 4)),
    ];
    // Each fill holds 15 blocks while it runs (1900 + 4 tokens), 14 whole ones after.
    let fills = blocks as usize / 14 + 2;
    let fill = |k: usize| -> Vec<u32> {
        (0..1900)
            .map(|i| 10_000 + ((k * 7919 + i * 31) % 30_000) as u32)
            .collect()
    };
    for k in 0..fills {
        steps.push(Step {
            label: format!("eviction: fill {k} (1900 ids)"),
            path: COMPLETIONS,
            body: completion_ids(&fill(k), 4),
        });
    }
    for k in [0, 1, fills / 2, fills - 1] {
        steps.push(Step {
            label: format!("eviction: fill {k} again"),
            path: COMPLETIONS,
            body: completion_ids(&fill(k), 4),
        });
    }
    steps
}

/// Check 6 of issue 14: kvsim, given the same request sequence as a real replica (X), reports the
/// same cached tokens, request by request.
pub async fn kvsim_reports_the_engines_cached_tokens(f: &Fleet) -> String {
    let x = f.addrs[0];
    let e = f.endpoint(x).await;
    let block = e["engine"]["block_size_tokens"]
        .as_u64()
        .expect("block size");
    let capacity = e["engine"]["capacity_tokens"].as_u64().expect("capacity");
    assert_eq!(block, 128);
    let blocks = (capacity / block) as u32;
    let sim = f.start_kvsim(blocks);
    let steps = sequence(blocks);
    let mut rows = Vec::new();
    let mut differ = Vec::new();
    for s in &steps {
        let real = f.direct(x, s.path, &s.body).await;
        let fake = post_direct(&f.client, sim.addr, s.path, &s.body).await;
        assert_eq!(real.status, 200, "vLLM, {}: {}", s.label, real.body);
        assert_eq!(fake.status, 200, "kvsim, {}: {}", s.label, fake.body);
        let same = real.cached_tokens == fake.cached_tokens;
        let line = format!(
            "{:<32} prompt {:>4} / {:>4}  cached {:>4} / {:>4}{}",
            s.label,
            real.prompt_tokens,
            fake.prompt_tokens,
            real.cached_tokens,
            fake.cached_tokens,
            if same { "" } else { "  DIFFERENT" }
        );
        println!("  {line}");
        if !same || real.prompt_tokens != fake.prompt_tokens {
            differ.push(line.clone());
        }
        rows.push(line);
    }
    assert_eq!(rows.len(), steps.len());
    assert!(
        differ.is_empty(),
        "kvsim and vLLM differ on {} of {} requests (vLLM / kvsim):\n{}",
        differ.len(),
        rows.len(),
        differ.join("\n")
    );
    format!(
        "{} requests to X and to kvsim ({blocks} blocks of {block} tokens, same tokenizer and \
         chat template): prompt and cached tokens equal on every one",
        rows.len()
    )
}
