//! Helpers shared by the benches that time decisions one by one or build prompts (each bench
//! is its own crate and includes this with `mod support;`; not every bench uses every helper).
#![allow(dead_code)]

/// Whether the bench runs as a measurement (`cargo bench`) rather than the smoke run
/// `cargo test --all-targets` makes of it.
pub fn measuring() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// The value after `name` on the command line, else `default`.
pub fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The upper median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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

/// Deterministic prose of `words` words, different per `seed`.
pub fn prose(seed: usize, words: usize) -> String {
    let mut out = String::new();
    for i in 0..words {
        let w = WORDS[(i * 7 + seed * 13 + i / 5) % WORDS.len()];
        out.push_str(w);
        out.push(if i % 12 == 11 { '.' } else { ' ' });
    }
    out
}

/// A chat body for `model` of `n` messages, each the JSON object `message(i)`.
pub fn chat_body(model: &str, n: usize, message: impl Fn(usize) -> String) -> Vec<u8> {
    let messages: Vec<String> = (0..n).map(message).collect();
    format!(
        r#"{{"model":"{model}","max_tokens":1,"messages":[{}]}}"#,
        messages.join(",")
    )
    .into_bytes()
}
