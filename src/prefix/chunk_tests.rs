//! Long messages in chunks: a message of tens of kilobytes (a document, a whole conversation
//! sent as one message) is cut at word boundaries the tokenizer splits at anyway, so its ids
//! equal the whole text's, a repeat of its start comes from the token cache, and the deadline
//! can stop between two chunks.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::tests::{fetched, fixture_dir};
use super::tokenizer::{ModelTokenizer, TokenizerFiles, CHUNK_BYTES};
use crate::request::{ChatMessage, ContentPart};

fn load(dir: &Path, cache_tokens: usize) -> ModelTokenizer {
    let template = dir.join("chat_template.jinja");
    let files = TokenizerFiles {
        tokenizer_json: Some(&dir.join("tokenizer.json")),
        tokenizer_config: Some(&dir.join("tokenizer_config.json")),
        chat_template: template.is_file().then_some(template.as_path()),
    };
    ModelTokenizer::load(&files, 1 << 20, cache_tokens, "t").expect("tokenizer loads")
}

fn user(text: &str) -> Vec<ChatMessage<'_>> {
    vec![ChatMessage {
        role: Cow::Borrowed("user"),
        content: vec![ContentPart::Text(Cow::Borrowed(text))],
        extra: None,
    }]
}

/// ~`bytes` of prose with what a word splitter could trip on: contractions, capitals, digits,
/// punctuation, non-ASCII words, newlines and double spaces.
fn prose(seed: u64, bytes: usize) -> String {
    const WORDS: [&str; 24] = [
        "the", "router", "It's", "we'll", "KV", "cache", "Zürich", "naïve", "42", "1999", "block,",
        "hash.", "(prefix)", "東京", "don't", "A", "x", "GPU", "tokens;", "Envoy", "i", "Q:",
        "end!", "😀",
    ];
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (state >> 33) as usize;
        out.push_str(WORDS[r % WORDS.len()]);
        out.push_str(match r / WORDS.len() % 23 {
            0 => "\n",
            1 => "  ",
            2 => "\n\n",
            _ => " ",
        });
    }
    out
}

fn real_models() -> Vec<(&'static str, PathBuf)> {
    let mut out = vec![("smollm2", fixture_dir())];
    for model in ["qwen3", "llama3", "deepseek_v3", "gemma3"] {
        out.push((model, fetched(model)));
    }
    out
}

/// Every tokenizer here passes the load-time check (the byte-level BPE ones split words apart
/// before merging; Gemma 3's SentencePiece-style BPE has no merge across a space), and on long
/// prose cut every ~64 bytes gives the whole text's ids.
#[test]
fn real_tokenizers_are_chunked_and_chunks_tokenize_as_the_whole() {
    for (model, dir) in real_models() {
        let mut t = load(&dir, 1 << 20);
        assert!(t.uses_chunks(), "{model}: chunks verified");
        t.set_chunk_bytes(64);
        for seed in 0..4 {
            let text = prose(seed, 12_000);
            let messages = user(&text);
            let chunked = t.tokenize_chat(&messages).unwrap();
            let whole = t.tokenize_chat_whole_for_test(&messages).unwrap();
            assert!(chunked.ids.len() > 2_000, "{model}: {}", chunked.ids.len());
            assert_eq!(chunked.ids, whole.ids, "{model} seed {seed}");
            assert_eq!(chunked.total_tokens, whole.total_tokens);
        }
        // The cut rule made many cuts: the cache holds chunks, not one segment per message.
        let (entries, _) = t.cache_stats();
        assert!(entries > 100, "{model}: {entries} cache entries");
    }
}

/// The next turn of a conversation sent as one growing message: all of the first turn but its
/// last chunk comes from the cache, and the ids are the whole text's.
#[test]
fn a_repeated_start_of_one_long_message_comes_from_the_cache() {
    let t = load(&fixture_dir(), 1 << 20);
    assert!(t.uses_chunks());
    let first = prose(7, 40_000);
    let second = format!("{first} And a new question about the answer above?");
    let a = t.tokenize_chat(&user(&first)).unwrap();
    let (entries_a, tokens_a) = t.cache_stats();
    assert!(
        entries_a >= 40_000 / CHUNK_BYTES,
        "{entries_a} chunks for 40 kB"
    );
    let b = t.tokenize_chat(&user(&second)).unwrap();
    let (_, tokens_b) = t.cache_stats();
    // New in the cache: the second's last chunk (up to ~2 chunks of tokens) and its template
    // tail, not another copy of the first.
    let added = tokens_b - tokens_a;
    assert!(
        added < a.ids.len() / 4,
        "{added} tokens added for a {}-token repeat",
        a.ids.len()
    );
    assert_eq!(
        b.ids,
        t.tokenize_chat_whole_for_test(&user(&second)).unwrap().ids
    );
    assert_eq!(b.ids[..a.ids.len() - 16], a.ids[..a.ids.len() - 16]);
}

/// A deadline that passes while a single long message is tokenized stops it at a chunk
/// boundary: the ids are an exact prefix, not all or nothing. As routing calls it, the rest is
/// kept as deferred text: finished after the decision, it gives the whole prompt's ids, so the
/// pick is predicted to hold all of it.
#[test]
fn a_deadline_stops_between_chunks_and_leaves_the_rest_for_after_the_decision() {
    let t = load(&fixture_dir(), 1 << 20);
    let text = prose(5, 30_000);
    let messages = user(&text);
    let whole = t.tokenize_chat_whole_for_test(&messages).unwrap();
    let rendered = t.render_for_test(&messages).unwrap();
    let gone = Instant::now() - Duration::from_millis(1);
    // Deferral by fraction off (1.0): only the deadline leaves text for later.
    let partial = t
        .tokenize_rendered_deferring_for_test(&rendered, Some(gone), 1.0)
        .unwrap();
    assert!(partial.deadline_cut);
    assert!(partial.ids.len() * 3 < whole.ids.len());
    let rest = partial.deferred.as_ref().expect("the rest is kept");
    assert!(rest.untokenized_bytes() > 20_000);
    let finished = t.tokenize_deferred(rest).unwrap();
    assert_eq!(finished.ids, whole.ids);
    assert!(!finished.truncated);
    // Without deferral (explain, tests) the same exact prefix, nothing kept. The first piece
    // (the template's head and the first chunk) is always tokenized.
    let plain = t
        .tokenize_inner_for_test(&rendered, true, Some(gone), &[])
        .unwrap();
    assert!(plain.deadline_cut && plain.truncated && plain.deferred.is_none());
    assert_eq!(plain.ids, partial.ids);
    assert!(!plain.ids.is_empty());
    assert_eq!(plain.ids[..], whole.ids[..plain.ids.len()]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// Cut at every possible chunk boundary, any text of words, digits, punctuation and
    /// whitespace tokenizes as the whole.
    #[test]
    fn every_chunk_cut_keeps_the_whole_texts_ids(
        words in prop::collection::vec(
            prop_oneof![
                "[a-zA-Z]{1,6}",
                "[0-9]{1,4}",
                "[.,;!?'\"()]{1,2}",
                "[éü東😀]{1,2}",
                Just("\n".to_string()),
                Just("  ".to_string()),
            ],
            1..80,
        ),
        seps in prop::collection::vec(prop_oneof![Just(" "), Just(""), Just("\n")], 80),
    ) {
        let t = chunked_fixture();
        let text: String = words
            .iter()
            .zip(&seps)
            .flat_map(|(w, s)| [w.as_str(), *s])
            .collect();
        let messages = user(&text);
        let chunked = t.tokenize_chat(&messages).unwrap();
        let whole = t.tokenize_chat_whole_for_test(&messages).unwrap();
        prop_assert_eq!(chunked.ids, whole.ids);
    }
}

fn chunked_fixture() -> &'static ModelTokenizer {
    static T: std::sync::OnceLock<ModelTokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = load(&fixture_dir(), 0);
        t.set_chunk_bytes(1);
        t
    })
}

/// `models[].chunk_bytes` reaches the tokenizer: 0 turns chunks off (one segment per message
/// again), a size cuts a long message about that often, and a size past any message (even the
/// largest the config type allows) never cuts.
#[test]
fn chunk_bytes_comes_from_the_model_config() {
    let registry = |chunk_bytes: u64| {
        super::TokenizerRegistry::from_config(
            &[crate::config::ModelConfig {
                name: "m".into(),
                tokenizer: Some(fixture_dir().display().to_string()),
                chunk_bytes,
                ..crate::config::ModelConfig::default()
            }],
            Path::new("/"),
        )
        .unwrap()
    };
    let text = prose(11, 20_000);
    let mut entries = Vec::new();
    for chunk_bytes in [0, 4096, 1024, u64::MAX] {
        let reg = registry(chunk_bytes);
        let t = reg.tokenizer("m").unwrap();
        assert_eq!(t.uses_chunks(), chunk_bytes > 0);
        t.tokenize_chat(&user(&text)).unwrap();
        entries.push(t.cache_stats().0);
    }
    // The template's segments with the message as one of them; then ~5 and ~20 chunks of it.
    let base = entries[0];
    assert!(base <= 4, "{entries:?}");
    assert!((base + 3..=base + 5).contains(&entries[1]), "{entries:?}");
    assert!((base + 17..=base + 21).contains(&entries[2]), "{entries:?}");
    assert_eq!(entries[3], base, "{entries:?}");
}
