//! `trace`: a request trace in the Mooncake format replayed as chat requests. Each line is
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}` with
//! one id per `block_tokens` (512) tokens of input, the last block possibly partial; equal ids
//! at the same position are the same prefix.
//!
//! Each hash id becomes the same block of text wherever it appears: `block_tokens` pieces drawn
//! from the seed and the id alone, each piece one token (a space-led whole word, or a period),
//! so a block tokenizes to the same tokens whatever precedes it and the engine's chained block
//! hashes see exactly the trace's sharing (the suite checks this on the engine's tokens). A
//! request is one user message made of its blocks; the last block is cut to the input length.
//! Arrivals keep the trace's timestamps inside the window, divided by `speedup`; output lengths
//! are the trace's.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{user, GenContext, Start, Trace, TraceRequest};
use crate::plan::{TraceSpec, WorkloadSpec, TEMPLATE_TOKENS};
use crate::BenchError;

/// Words per sentence in block text (a period follows).
const SENTENCE_WORDS: usize = 12;
/// Single-token words drawn from.
const WORDS: usize = 4000;

/// One line of a Mooncake-format trace.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceLine {
    /// Arrival, ms from the trace's start.
    pub timestamp: f64,
    /// Input tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: u32,
    /// One id per block of input.
    pub hash_ids: Vec<u64>,
}

/// Finds a trace file: `path` itself, else `shared/traces/<path>` (or `<path>` under a
/// `shared/` directory) in the working directory's ancestors.
pub fn resolve(path: &str) -> Result<PathBuf, BenchError> {
    let direct = PathBuf::from(path);
    if direct.is_file() {
        return Ok(direct);
    }
    let cwd = std::env::current_dir().map_err(|e| BenchError::Trace(e.to_string()))?;
    for dir in cwd.ancestors() {
        for candidate in [
            dir.join("shared/traces").join(path),
            dir.join("shared").join(path),
        ] {
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(BenchError::Trace(format!(
        "trace file {path:?} not found (looked at it and at shared/traces/{path} above {})",
        cwd.display()
    )))
}

/// Reads the lines of `path` whose timestamp is in `[start_ms, end_ms)`, in file order.
pub fn read_window(path: &Path, start_ms: f64, end_ms: f64) -> Result<Vec<TraceLine>, BenchError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| BenchError::Trace(format!("{}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: TraceLine = serde_json::from_str(line)
            .map_err(|e| BenchError::Trace(format!("{} line {}: {e}", path.display(), i + 1)))?;
        if l.timestamp >= start_ms && l.timestamp < end_ms {
            out.push(l);
        }
    }
    Ok(out)
}

/// The text of the first `tokens` tokens of block `id` (one token per piece).
fn block_text(words: &[String], seed: u64, id: u64, tokens: usize) -> String {
    let mut rng = StdRng::seed_from_u64(xxh3_64_with_seed(&id.to_le_bytes(), seed));
    let mut out = String::with_capacity(tokens * 8);
    for i in 0..tokens {
        if i % (SENTENCE_WORDS + 1) == SENTENCE_WORDS {
            out.push('.');
        } else {
            out.push_str(&words[rng.random_range(0..words.len())]);
        }
    }
    out
}

/// Per request (in order), the input tokens the trace says an earlier request of the window
/// shared as a prefix: whole blocks whose id chain was seen before, capped at the input.
pub fn trace_shared_tokens(lines: &[TraceLine], block_tokens: usize) -> Vec<usize> {
    let mut seen = ahash::AHashSet::new();
    lines
        .iter()
        .map(|l| {
            let mut chain = 0u64;
            let mut shared = 0;
            let mut matching = true;
            for (i, id) in l.hash_ids.iter().enumerate() {
                chain = xxh3_64_with_seed(&id.to_le_bytes(), chain);
                if matching && seen.contains(&chain) {
                    shared = ((i + 1) * block_tokens).min(l.input_length);
                } else {
                    matching = false;
                }
                seen.insert(chain);
            }
            shared
        })
        .collect()
}

/// The longest input a request with `output` tokens to generate may keep: `max_input_tokens`,
/// and room for the output and the template under `max_context_tokens`.
fn input_limit(s: &TraceSpec, output: usize) -> usize {
    let context = s.max_context_tokens.map_or(usize::MAX, |c| {
        c.saturating_sub(output.max(1) + TEMPLATE_TOKENS).max(1)
    });
    s.max_input_tokens.min(context)
}

pub(super) fn generate(
    s: &TraceSpec,
    _w: &WorkloadSpec,
    cx: &mut GenContext<'_>,
) -> Result<Trace, BenchError> {
    let path = resolve(&s.path)?;
    let start_ms = s.start_s * 1000.0;
    let mut lines = read_window(&path, start_ms, start_ms + s.duration_s * 1000.0)?;
    if let Some(n) = s.max_requests {
        lines.truncate(n);
    }
    if lines.is_empty() {
        return Err(BenchError::Trace(format!(
            "{}: no request in the window {}..{} s",
            path.display(),
            s.start_s,
            s.start_s + s.duration_s
        )));
    }
    // Cut over-long inputs to whole blocks (their tails are dropped from the trace's view too).
    for l in &mut lines {
        let most = input_limit(s, l.output_length as usize);
        if l.input_length > most {
            l.input_length = most;
            l.hash_ids.truncate(most.div_ceil(s.block_tokens));
        }
    }
    let words = cx.vocab.single_token_words(WORDS)?;
    let text_seed = cx.seed ^ 0x7472_6163_6520;
    let mut requests = Vec::with_capacity(lines.len());
    for (id, l) in lines.iter().enumerate() {
        let mut content = String::with_capacity(l.input_length * 8);
        let mut left = l.input_length;
        for h in &l.hash_ids {
            let n = left.min(s.block_tokens);
            if n == 0 {
                break;
            }
            content.push_str(&block_text(&words, text_seed, *h, n));
            left -= n;
        }
        requests.push(TraceRequest {
            id,
            start: Start::At((l.timestamp - start_ms).max(0.0) / s.speedup),
            messages: vec![user(Arc::from(content))],
            max_tokens: l.output_length.max(1),
            tenant: None,
            cache_salt: None,
            group: l.hash_ids.first().copied().unwrap_or(0) as usize,
            bypass: false,
            objective: None,
        });
    }
    let shared = trace_shared_tokens(&lines, s.block_tokens);
    let input: usize = lines.iter().map(|l| l.input_length).sum();
    let n = lines.len();
    let span_s = (lines.last().map_or(0.0, |l| l.timestamp) - lines[0].timestamp).max(1.0)
        / 1000.0
        / s.speedup;
    let rate = n as f64 / span_s;
    Ok(Trace {
        workload: String::new(),
        rate: (rate * 100.0).round() / 100.0,
        requests,
        tenant_header: None,
        objective_header: None,
        seed: 0,
        notes: vec![format!(
            "{} ({}): {n} requests from trace time {}..{} s, {}x faster ({:.2} req/s); mean input \
             {:.0} tokens, mean output {:.0}; the trace shares {:.1}% of input tokens with earlier \
             requests of the window",
            path.file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into()),
            s.block_tokens,
            s.start_s,
            s.start_s + s.duration_s,
            s.speedup,
            rate,
            input as f64 / n as f64,
            lines
                .iter()
                .map(|l| f64::from(l.output_length))
                .sum::<f64>()
                / n as f64,
            100.0 * shared.iter().sum::<usize>() as f64 / input.max(1) as f64
        )],
        expected_shared_tokens: Some(shared),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::tests::fixture_vocab;

    #[test]
    fn blocks_tokenize_alike_whatever_precedes_them() {
        let v = fixture_vocab();
        let words = v.single_token_words(2000).unwrap();
        let a = block_text(&words, 1, 10, 512);
        let b = block_text(&words, 1, 11, 512);
        assert_eq!(v.count_tokens(&a).unwrap(), 512);
        assert_eq!(
            block_text(&words, 1, 10, 512),
            a,
            "the same id, the same text"
        );
        assert_ne!(a, b);
        for (text, expected) in [
            (format!("{a}{b}"), 1024),
            (format!("{b}{a}"), 1024),
            (format!("{a}{}", block_text(&words, 1, 12, 37)), 549),
        ] {
            assert_eq!(v.count_tokens(&text).unwrap(), expected);
        }
        // The tokens of a block are the same after any other block.
        let ids = |t: &str| v.token_ids(t).unwrap();
        let ab = ids(&format!("{a}{b}"));
        let cb = ids(&format!("{}{b}", block_text(&words, 1, 99, 300)));
        assert_eq!(ab[512..], cb[300..]);
    }

    #[test]
    fn trace_sharing_is_by_prefix_chain() {
        let line = |ids: &[u64], len: usize| TraceLine {
            timestamp: 0.0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let lines = vec![
            line(&[1, 2, 3], 1200),
            line(&[1, 2, 4], 1100),
            line(&[5, 2, 3], 1500),
            line(&[1, 2, 3], 1030),
        ];
        assert_eq!(trace_shared_tokens(&lines, 512), vec![0, 1024, 0, 1030]);
    }

    #[test]
    fn inputs_leave_room_for_their_output_in_the_context() {
        let mut s = TraceSpec {
            max_input_tokens: 32_768,
            ..TraceSpec::default()
        };
        assert_eq!(
            input_limit(&s, 500),
            32_768,
            "no context length: the input cap alone"
        );
        s.max_context_tokens = Some(32_768);
        assert_eq!(input_limit(&s, 500), 32_768 - 500 - TEMPLATE_TOKENS);
        assert_eq!(input_limit(&s, 0), 32_768 - 1 - TEMPLATE_TOKENS);
        s.max_input_tokens = 8_000;
        assert_eq!(input_limit(&s, 500), 8_000, "the lower of the two");
        s.max_context_tokens = Some(100);
        assert_eq!(
            input_limit(&s, 5_000),
            1,
            "an output longer than the context keeps a token"
        );
    }
}

/// The committed plans' Mooncake window under the real tokenizers: run by hand with
/// `cargo test -p kvbench --lib mooncake_window -- --ignored` (needs `make tokenizers` and
/// `shared/traces`); it fails, never skips, when they are missing.
#[cfg(test)]
mod mooncake {
    use crate::plan::{Plan, Shape};
    use crate::suite::engine_tokenizer;
    use crate::vocab::{self, Vocab};
    use crate::workload::generate;

    #[test]
    #[ignore = "minutes: tokenizes the whole window (run by hand)"]
    fn mooncake_window_reproduces_the_traces_sharing() {
        let plan = Plan::load("replay").unwrap();
        let dir = std::env::var("KVROUTER_TOKENIZERS_DIR").expect("KVROUTER_TOKENIZERS_DIR");
        let tok = vocab::resolve(&plan.tokenizer, std::path::Path::new(&dir)).unwrap();
        let v = Vocab::load(&tok).unwrap();
        let engine = engine_tokenizer(Some(&tok)).unwrap();
        let w = &plan.workloads[0];
        assert!(matches!(w.shape, Shape::Trace(_)));
        let t = generate(&plan, w, w.rate, 1, &v, engine.as_ref()).unwrap();
        let views = crate::oracle::engine_views(&t, engine.as_ref(), &plan.model, 16).unwrap();
        let expected = t.expected_shared_tokens.clone().unwrap();
        let engine_shared = crate::oracle::engine_shared_tokens(&views, 16);
        assert!(!expected.is_empty(), "the window holds no request");
        assert_eq!(expected.len(), engine_shared.len());
        let agree = expected
            .iter()
            .zip(&engine_shared)
            .filter(|(a, b)| a.abs_diff(**b) <= 32)
            .count();
        eprintln!(
            "{} requests at {} req/s; agree {agree}; trace shared {}, engine shared {}; {:?}",
            t.requests.len(),
            t.rate,
            expected.iter().sum::<usize>(),
            engine_shared.iter().sum::<usize>(),
            t.notes
        );
        assert_eq!(agree, expected.len());
    }
}
