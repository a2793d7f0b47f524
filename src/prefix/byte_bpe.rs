//! Token ids of a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, DeepSeek's) without
//! building the HF tokenizer's [`tokenizers::Encoding`].
//!
//! The HF tokenizer keeps, for every piece of text, a `NormalizedString` with an alignment per
//! byte, and for every token a `String` and offsets; on long prompts the allocator is about half
//! of its time and the cost grows faster than the text (a 4,000-word prompt takes ~2.3 us a word,
//! a 250-word one ~1.2 us). The router needs the ids only. This path does the same steps on
//! borrowed slices: split at added tokens (leftmost-longest, unnormalized ones on the raw text,
//! normalized ones after the normalizer), normalize the rest with the tokenizer's own
//! normalizer (skipped for ASCII under NFC, which leaves ASCII as it is), split with the
//! pre-tokenizer's regexes (onig, as the HF tokenizer's `onig` feature compiles them), map bytes
//! to the byte-level alphabet, and take each word's ids from a word cache, asking the
//! tokenizer's own BPE model on a miss. Merges, `ignore_merges` and the vocabulary stay the
//! HF model's.
//!
//! Only tokenizers whose pipeline has exactly that shape get it ([`ByteLevelBpe::new`]); the
//! caller checks it against the HF tokenizer on probe texts at load and drops it on any
//! difference.

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::{RwLock, RwLockReadGuard};
use tokenizers::models::ModelWrapper;
use tokenizers::{Model, NormalizedString, Normalizer, Tokenizer};

/// The GPT-2 pre-tokenizer regex that a `ByteLevel` pre-tokenizer with `use_regex: true` applies
/// (the HF tokenizer's built-in pattern; it is not in `tokenizer.json`).
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Words held by the word cache before it starts over (a word and its ids are ~60 bytes: a few
/// MB at most).
const WORD_CACHE_ENTRIES: usize = 65_536;

/// Words looked up between two chances for a waiting writer to update the cache
/// ([`RwLockReadGuard::bump`]): a long prompt holds the read lock for ~50 us at a time at most.
const WORDS_PER_BUMP: usize = 256;

/// Words longer than this are not cached (a run of spaces or a base64 blob seldom repeats).
const WORD_CACHE_MAX_BYTES: usize = 64;

/// How a piece between added tokens is normalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Normalize {
    /// No normalizer (or an empty sequence).
    No,
    /// The tokenizer's normalizer; ASCII text is left alone when `ascii_unchanged` (NFC).
    Model { ascii_unchanged: bool },
}

/// A set of added tokens matched leftmost-longest, with each pattern's id.
struct AddedSet {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl AddedSet {
    fn new(tokens: Vec<(String, u32)>) -> Option<AddedSet> {
        if tokens.is_empty() {
            return None;
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(content, _)| content.as_str()))
            .ok()?;
        Some(AddedSet {
            automaton,
            ids: tokens.into_iter().map(|(_, id)| id).collect(),
        })
    }
}

/// The ids-only encoder of one byte-level BPE tokenizer (see the module doc).
pub struct ByteLevelBpe {
    raw_added: Option<AddedSet>,
    normalized_added: Option<AddedSet>,
    normalize: Normalize,
    /// The pre-tokenizer's splits, applied in order, each to the pieces of the one before
    /// (every one isolates its matches and keeps the text between them).
    splits: Vec<onig::Regex>,
    /// Byte -> its character in the byte-level alphabet.
    alphabet: [char; 256],
    /// Word (before the byte-level mapping) -> its ids.
    words: RwLock<WordMap>,
}

impl std::fmt::Debug for ByteLevelBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelBpe")
            .field("splits", &self.splits.len())
            .field("normalize", &self.normalize)
            .field("cached_words", &self.words.read().len())
            .finish()
    }
}

impl ByteLevelBpe {
    /// The encoder for `tokenizer`, when its pipeline (read back from the loaded tokenizer, not
    /// from the file again) is one this path reproduces: a BPE model without dropout; no normalizer, NFC, or another
    /// normalizer that runs as the HF tokenizer's own; a pre-tokenizer that is `ByteLevel`
    /// (without `add_prefix_space`) or a sequence of isolating, non-inverted regex `Split`s ending
    /// in one; added tokens that strip no whitespace and need no word boundary. `None`
    /// otherwise (SentencePiece-style tokenizers such as Gemma's take the HF path).
    pub fn new(tokenizer: &Tokenizer) -> Option<ByteLevelBpe> {
        match tokenizer.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none() => {}
            _ => return None,
        }
        // The normalizer and pre-tokenizer as their `tokenizer.json` entries: small, unlike
        // the model's vocabulary.
        let normalize = match tokenizer.get_normalizer() {
            None => Normalize::No,
            Some(n) => {
                let n = serde_json::to_value(n).ok()?;
                if n["type"] == "Sequence" && n["normalizers"].as_array()?.is_empty() {
                    Normalize::No
                } else {
                    Normalize::Model {
                        ascii_unchanged: n["type"] == "NFC",
                    }
                }
            }
        };
        let pre_tokenizer = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
        let splits = pre_tokenizer_splits(&pre_tokenizer)?
            .iter()
            .map(|pattern| onig::Regex::new(pattern).ok())
            .collect::<Option<Vec<_>>>()?;

        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            if token.content.is_empty() {
                continue;
            }
            if token.normalized && normalize != Normalize::No {
                let mut n = NormalizedString::from(token.content.as_str());
                tokenizer.get_normalizer()?.normalize(&mut n).ok()?;
                normalized.push((n.get().to_string(), id));
            } else if token.normalized {
                normalized.push((token.content, id));
            } else {
                raw.push((token.content, id));
            }
        }
        // The same order for the same file: the automaton breaks no ties by order
        // (leftmost-longest), but a stable build is easier to reason about.
        raw.sort();
        normalized.sort();
        Some(ByteLevelBpe {
            raw_added: AddedSet::new(raw),
            normalized_added: AddedSet::new(normalized),
            normalize,
            splits,
            alphabet: byte_alphabet(),
            words: RwLock::new(HashMap::default()),
        })
    }

    /// Appends to `ids` the ids of `text` as `tokenizer.encode_fast(text, false)` gives them
    /// (`tokenizer` is the one this encoder was built for).
    pub fn encode_into(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        ids.reserve(text.len() / 3 + 1);
        let mut run = Run {
            encoder: self,
            model: tokenizer.get_model(),
            words: self.words.read(),
            since_bump: 0,
            ids,
            fresh: Vec::new(),
            mapped: String::new(),
        };
        self.each_piece(&self.raw_added, text, &mut |piece| match piece {
            Piece::Added(id) => {
                run.ids.push(id);
                Ok(())
            }
            Piece::Text(text) => self.normalized_piece(tokenizer, text, &mut run),
        })?;
        let Run { fresh, words, .. } = run;
        drop(words);
        if !fresh.is_empty() {
            // Waits for other encodes' current stretch of words at most (they bump).
            let mut words = self.words.write();
            if words.len() + fresh.len() > WORD_CACHE_ENTRIES {
                words.clear();
            }
            words.extend(fresh);
        }
        Ok(())
    }

    /// Words in the cache.
    #[cfg(test)]
    pub(crate) fn cached_words(&self) -> usize {
        self.words.read().len()
    }

    /// `text` (between two unnormalized added tokens), normalized, split at normalized added
    /// tokens, each piece pre-tokenized and its words encoded.
    fn normalized_piece(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        run: &mut Run<'_>,
    ) -> Result<(), String> {
        let normalized;
        let text = match self.normalize {
            Normalize::Model {
                ascii_unchanged: true,
            } if text.is_ascii() => text,
            Normalize::Model { .. } => {
                let mut n = NormalizedString::from(text);
                tokenizer
                    .get_normalizer()
                    .ok_or("the tokenizer lost its normalizer")?
                    .normalize(&mut n)
                    .map_err(|e| e.to_string())?;
                normalized = n.get().to_string();
                normalized.as_str()
            }
            Normalize::No => text,
        };
        self.each_piece(&self.normalized_added, text, &mut |piece| match piece {
            Piece::Added(id) => {
                run.ids.push(id);
                Ok(())
            }
            Piece::Text(text) => self.split(0, text, &mut |word| run.word(word)),
        })
    }

    /// Calls `f` on the pieces of `text` in order: each match of `set` and the text between.
    fn each_piece<'t>(
        &self,
        set: &Option<AddedSet>,
        text: &'t str,
        f: &mut dyn FnMut(Piece<'t>) -> Result<(), String>,
    ) -> Result<(), String> {
        let Some(set) = set else {
            return if text.is_empty() {
                Ok(())
            } else {
                f(Piece::Text(text))
            };
        };
        let mut at = 0;
        for m in set.automaton.find_iter(text) {
            if m.start() > at {
                f(Piece::Text(&text[at..m.start()]))?;
            }
            f(Piece::Added(set.ids[m.pattern().as_usize()]))?;
            at = m.end();
        }
        if at < text.len() {
            f(Piece::Text(&text[at..]))?;
        }
        Ok(())
    }

    /// Pre-tokenizes `text` from split `level` on, calling `f` on every non-empty word in order.
    fn split(
        &self,
        level: usize,
        text: &str,
        f: &mut dyn FnMut(&str) -> Result<(), String>,
    ) -> Result<(), String> {
        if text.is_empty() {
            return Ok(());
        }
        let Some(regex) = self.splits.get(level) else {
            return f(text);
        };
        let mut at = 0;
        for (start, end) in regex.find_iter(text) {
            if start > at {
                self.split(level + 1, &text[at..start], f)?;
            }
            self.split(level + 1, &text[start..end], f)?;
            at = end;
        }
        if at < text.len() {
            self.split(level + 1, &text[at..], f)?;
        }
        Ok(())
    }
}

type WordMap = HashMap<Box<str>, Box<[u32]>, ahash::RandomState>;

/// A piece of text between added tokens, or an added token's id.
enum Piece<'t> {
    Text(&'t str),
    Added(u32),
}

/// One encode's state.
struct Run<'e> {
    encoder: &'e ByteLevelBpe,
    model: &'e ModelWrapper,
    /// The word cache, read-locked for the run (bumped every [`WORDS_PER_BUMP`] words).
    words: RwLockReadGuard<'e, WordMap>,
    since_bump: usize,
    ids: &'e mut Vec<u32>,
    /// Words encoded by the model in this run, for the cache.
    fresh: Vec<(Box<str>, Box<[u32]>)>,
    /// Scratch: a word in the byte-level alphabet.
    mapped: String,
}

impl Run<'_> {
    fn word(&mut self, word: &str) -> Result<(), String> {
        self.since_bump += 1;
        if self.since_bump == WORDS_PER_BUMP {
            self.since_bump = 0;
            RwLockReadGuard::bump(&mut self.words);
        }
        if let Some(ids) = self.words.get(word) {
            self.ids.extend_from_slice(ids);
            return Ok(());
        }
        self.mapped.clear();
        self.mapped
            .extend(word.bytes().map(|b| self.encoder.alphabet[b as usize]));
        let tokens = self
            .model
            .tokenize(&self.mapped)
            .map_err(|e| e.to_string())?;
        let start = self.ids.len();
        self.ids.extend(tokens.iter().map(|t| t.id));
        if word.len() <= WORD_CACHE_MAX_BYTES && self.fresh.len() < WORD_CACHE_ENTRIES {
            self.fresh.push((word.into(), self.ids[start..].into()));
        }
        Ok(())
    }
}

/// The regexes `pre_tokenizer` splits with, in order, when it is a byte-level one this path
/// reproduces.
fn pre_tokenizer_splits(pre_tokenizer: &serde_json::Value) -> Option<Vec<String>> {
    let byte_level = |p: &serde_json::Value| -> Option<Vec<String>> {
        if p["add_prefix_space"].as_bool().unwrap_or(true) {
            return None;
        }
        Some(if p["use_regex"].as_bool().unwrap_or(true) {
            vec![GPT2_SPLIT.to_string()]
        } else {
            Vec::new()
        })
    };
    match pre_tokenizer["type"].as_str()? {
        "ByteLevel" => byte_level(pre_tokenizer),
        "Sequence" => {
            let steps = pre_tokenizer["pretokenizers"].as_array()?;
            let (last, splits) = steps.split_last()?;
            if last["type"] != "ByteLevel" {
                return None;
            }
            let mut out = Vec::with_capacity(steps.len());
            for s in splits {
                let isolated = s["type"] == "Split"
                    && s["behavior"] == "Isolated"
                    && !s["invert"].as_bool().unwrap_or(false);
                if !isolated {
                    return None;
                }
                out.push(s["pattern"]["Regex"].as_str()?.to_string());
            }
            out.extend(byte_level(last)?);
            Some(out)
        }
        _ => None,
    }
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others
/// for the characters from U+0100 on, in byte order.
fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("below the surrogates");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[0], 'Ā');
        assert_eq!(a[0xad], 'Ń');
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn only_byte_level_pipelines_are_taken() {
        let seq = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        assert_eq!(pre_tokenizer_splits(&seq), Some(vec!["\\p{N}".to_string()]));
        let gpt2 =
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
        assert_eq!(
            pre_tokenizer_splits(&gpt2),
            Some(vec![GPT2_SPLIT.to_string()])
        );
        let prefix_space = serde_json::json!({"type": "ByteLevel", "add_prefix_space": true});
        assert_eq!(pre_tokenizer_splits(&prefix_space), None);
        let merged = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": " "}, "behavior": "MergedWithPrevious", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        assert_eq!(pre_tokenizer_splits(&merged), None);
        let metaspace = serde_json::json!({"type": "Metaspace", "replacement": "▁"});
        assert_eq!(pre_tokenizer_splits(&metaspace), None);
    }
}
