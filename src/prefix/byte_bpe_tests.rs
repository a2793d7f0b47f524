//! The ids-only byte-level path against the HF tokenizer it stands in for: the fixture's SmolLM2
//! and the fetched Qwen 3, Llama 3 and DeepSeek V3 tokenizers (`make tokenizers`; a missing one
//! fails the test), on generated text mixing scripts, digits, whitespace, contractions, emoji,
//! unnormalized forms and the tokenizer's own added tokens.

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;

use super::tests::{fetched, fixture_dir};
use super::tokenizer::{ModelTokenizer, TokenizerFiles};

fn load(dir: &Path) -> ModelTokenizer {
    let json = dir.join("tokenizer.json");
    let config = dir.join("tokenizer_config.json");
    ModelTokenizer::load(
        &TokenizerFiles {
            tokenizer_json: Some(&json),
            tokenizer_config: config.is_file().then_some(config.as_path()),
            chat_template: None,
        },
        1 << 20,
        0,
        "models[0]",
    )
    .expect("tokenizer loads")
}

/// The byte-level tokenizers, loaded once for all cases.
fn byte_level() -> &'static [(&'static str, ModelTokenizer)] {
    static ALL: OnceLock<Vec<(&'static str, ModelTokenizer)>> = OnceLock::new();
    ALL.get_or_init(|| {
        vec![
            ("smollm2", load(&fixture_dir())),
            ("qwen3", load(&fetched("qwen3"))),
            ("llama3", load(&fetched("llama3"))),
            ("deepseek_v3", load(&fetched("deepseek_v3"))),
        ]
    })
}

#[test]
fn byte_level_tokenizers_take_the_ids_only_path_and_others_do_not() {
    for (name, t) in byte_level() {
        assert!(t.uses_fast_path(), "{name} should pass the load-time check");
        // Llama 3 and DeepSeek put BOS before a completion prompt, SmolLM2 and Qwen add nothing:
        // both are a wrap.
        assert!(
            t.wraps_specials(),
            "{name}'s post-processor only adds around the text"
        );
    }
    // The check at load can refuse: Qwen 3's encoder (its added tokens, its split) does not give
    // Llama 3's ids.
    let (llama, qwen) = (&byte_level()[2].1, &byte_level()[1].1);
    let foreign = ModelTokenizer::fast_encoder_of(qwen).expect("qwen3 is byte-level");
    assert!(!llama.verify_fast(&foreign, Path::new("qwen3 for llama3")));
    let own = ModelTokenizer::fast_encoder_of(llama).expect("llama3 is byte-level");
    assert!(llama.verify_fast(&own, Path::new("llama3")));
    // Gemma 3: SentencePiece-style (a space-replacing normalizer, byte fallback), not byte-level.
    assert!(!load(&fetched("gemma3")).uses_fast_path());
}

/// Pieces that text is made of here: every class the pre-tokenizers' regexes tell apart.
const PIECES: &[&str] = &[
    "the",
    " the",
    "The",
    " THE",
    "a",
    " cat",
    "sat",
    "'s",
    "'S",
    "'ll",
    "'Re",
    "n't",
    " don't",
    "1",
    "12",
    "123",
    "1234",
    " 56789",
    "3.14",
    "-",
    "--",
    "...",
    "!!",
    "?",
    ",",
    ".",
    ";",
    "(",
    ")",
    "[",
    "{",
    "}",
    "<",
    ">",
    "/",
    "\\",
    "_",
    "#",
    "@",
    "$",
    "%",
    "^",
    "&",
    "*",
    "=",
    "+",
    "|",
    "~",
    "`",
    "\"",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\u{a0}",
    "\u{2003}",
    "é",
    "e\u{301}",
    "a\u{308}",
    "Å",
    "A\u{30a}",
    "ﬁ",
    "ｆ",
    "①",
    "½",
    "٣",
    "ไทย",
    "한국어",
    "日本語",
    "のテキスト",
    "中文",
    "кириллица",
    "Ελλάδα",
    "العربية",
    "עברית",
    "हिन्दी",
    "😀",
    "👩\u{200d}👩\u{200d}👧",
    "🇫🇷",
    "✈\u{fe0f}",
    "\u{0}",
    "\u{7}",
    "\u{1b}",
    "\u{fffd}",
    "\u{10ffff}",
    "x86",
    "H100",
    "a1b2",
    "CamelCase",
    "snake_case",
    "https://example.com/a?b=c",
];

/// A text of `picks` pieces, some of them the tokenizer's added tokens (`added`).
fn text_of(picks: &[(bool, usize)], added: &[String]) -> String {
    picks
        .iter()
        .map(|&(special, i)| {
            if special && !added.is_empty() {
                added[i % added.len()].as_str()
            } else {
                PIECES[i % PIECES.len()]
            }
        })
        .collect()
}

fn added_tokens(t: &ModelTokenizer) -> Vec<String> {
    let mut added = t.added_token_contents();
    added.sort();
    added
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ids_only_path_gives_the_tokenizers_ids(
        picks in proptest::collection::vec((proptest::bool::weighted(0.05), 0usize..10_000), 0..120)
    ) {
        for (name, t) in byte_level() {
            let text = text_of(&picks, &added_tokens(t));
            let (hf, fast) = t.encode_both_ways(&text, false);
            prop_assert_eq!(Some(&hf), fast.as_ref(), "{} on {:?}", name, text);
            let (hf, fast) = t.encode_both_ways(&text, true);
            prop_assert_eq!(Some(&hf), fast.as_ref(), "{} with special tokens on {:?}", name, text);
        }
    }
}

#[test]
fn long_text_twice_gives_the_same_ids_from_the_word_cache() {
    // ~40 kB of prose-like text: every word encoded by the model the first time, most from the
    // word cache the second.
    let mut text = String::new();
    let mut x = 7u64;
    while text.len() < 40_000 {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        text.push_str(PIECES[(x >> 33) as usize % PIECES.len()]);
        if x % 3 == 0 {
            text.push(' ');
        }
    }
    for (name, t) in byte_level() {
        let (hf, first) = t.encode_both_ways(&text, false);
        let (_, second) = t.encode_both_ways(&text, false);
        assert!(hf.len() > 5_000, "{name}: {} ids", hf.len());
        assert_eq!(Some(&hf), first.as_ref(), "{name}, first pass");
        assert_eq!(Some(&hf), second.as_ref(), "{name}, from the cache");
    }
}

#[test]
fn concurrent_encodes_agree_and_fill_the_word_cache() {
    // A fresh tokenizer, four threads encoding different texts at once: every
    // result is the HF tokenizer's, and the words they met are cached afterwards although the
    // threads were reading the cache all along.
    let t = load(&fetched("qwen3"));
    // The load-time check's probe texts are cached already.
    let before = t.cached_words();
    let texts: Vec<String> = (0..4u64)
        .map(|k| {
            let mut x = k + 1;
            let mut text = String::new();
            while text.len() < 20_000 {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                text.push_str(PIECES[(x >> 33) as usize % PIECES.len()]);
                text.push(' ');
            }
            text
        })
        .collect();
    std::thread::scope(|s| {
        for text in &texts {
            let t = &t;
            s.spawn(move || {
                for _ in 0..3 {
                    let (hf, fast) = t.encode_both_ways(text, false);
                    assert_eq!(Some(hf), fast);
                }
            });
        }
    });
    assert!(
        t.cached_words() >= before + 50,
        "{before} words cached after loading, {} after four threads' encodes",
        t.cached_words()
    );
}
