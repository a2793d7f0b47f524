//! Tokenizing rendered chats piece by piece, with the long pieces cached, so a system prompt
//! shared by many requests is encoded once per replica instead of once per request (a 4k-token
//! chat costs ~10 ms to encode whole in a release build; a benchmark's replicas see thousands).
//!
//! A Hugging Face tokenizer cuts its input at added tokens (`<|im_start|>`...) before anything
//! else and encodes the text between them independently, so the text cut just before such a
//! token gives, piece by piece, the ids of the whole. That holds for tokens matched on the raw
//! text that do not strip their neighbours' whitespace; and not for every model (a pre-tokenizer
//! that treats the input's first piece apart, as SentencePiece's `prepend_scheme: first` does,
//! breaks it), so [`Segmenter::verified`] compares both ways on probe texts at load and the
//! tokenizer encodes whole when they differ.
//!
//! The cache keys a piece by its xxh3 and whether it starts the text; it holds at most
//! [`CACHE_TOKENS`] ids and is emptied when full (a benchmark's few shared prompts refill it at
//! once; no LRU bookkeeping per request).

use std::collections::HashMap;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64;

/// Pieces shorter than this (bytes) are encoded every time: cheap, and not worth a lookup.
const MIN_CACHED_BYTES: usize = 512;
/// Most token ids the cache holds.
pub const CACHE_TOKENS: usize = 1 << 20;

/// Cuts text at added tokens and caches the long pieces' ids.
pub struct Segmenter {
    /// Every added token matched on raw text, leftmost-longest as the tokenizer matches them.
    tokens: AhoCorasick,
    /// Per automaton pattern: may a piece start there?
    cut_at: Vec<bool>,
    /// The tokens pieces may start with (for probes).
    cut_tokens: Vec<String>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    pieces: HashMap<(u64, bool), Arc<[u32]>>,
    tokens: usize,
}

impl Segmenter {
    /// A segmenter for `tokenizer`, `None` when it has no added token to cut at.
    pub fn new(tokenizer: &Tokenizer) -> Option<Segmenter> {
        let mut added: Vec<_> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| !t.normalized && !t.content.is_empty())
            .collect();
        added.sort_by(|a, b| a.content.cmp(&b.content));
        let cut_at: Vec<bool> = added
            .iter()
            .map(|t| !(t.lstrip || t.rstrip || t.single_word))
            .collect();
        let cut_tokens: Vec<String> = added
            .iter()
            .zip(&cut_at)
            .filter(|(_, &cut)| cut)
            .map(|(t, _)| t.content.clone())
            .collect();
        if cut_tokens.is_empty() {
            return None;
        }
        let tokens = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|t| t.content.as_str()))
            .ok()?;
        Some(Segmenter {
            tokens,
            cut_at,
            cut_tokens,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// Byte offsets where pieces start (0 first).
    fn starts(&self, text: &str) -> Vec<usize> {
        let mut starts = vec![0];
        starts.extend(
            self.tokens
                .find_iter(text)
                .filter(|m| self.cut_at[m.pattern().as_usize()] && m.start() > 0)
                .map(|m| m.start()),
        );
        starts
    }

    /// The ids of `text` without special tokens, piece by piece, long pieces from the cache.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, tokenizers::Error> {
        let starts = self.starts(text);
        let mut ids = Vec::with_capacity(text.len() / 3);
        for (i, &start) in starts.iter().enumerate() {
            let end = starts.get(i + 1).copied().unwrap_or(text.len());
            let piece = &text[start..end];
            if piece.len() < MIN_CACHED_BYTES {
                ids.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
                continue;
            }
            let key = (xxh3_64(piece.as_bytes()), start == 0);
            let hit = self.cache.lock().pieces.get(&key).cloned();
            let piece_ids = match hit {
                Some(cached) => cached,
                None => {
                    let fresh: Arc<[u32]> = tokenizer.encode_fast(piece, false)?.get_ids().into();
                    let mut cache = self.cache.lock();
                    if cache.tokens + fresh.len() > CACHE_TOKENS {
                        *cache = Cache::default();
                    }
                    cache.tokens += fresh.len();
                    cache.pieces.insert(key, Arc::clone(&fresh));
                    fresh
                }
            };
            ids.extend_from_slice(&piece_ids);
        }
        Ok(ids)
    }

    /// Raw texts that put cut tokens next to the whitespace, digits and punctuation that
    /// pre-tokenizers treat specially.
    pub fn raw_probes(&self) -> Vec<String> {
        self.cut_tokens
            .iter()
            .take(3)
            .map(|t| {
                format!(" Start{t} after\n\n{t}\tTab 42{t}42 {t}\n{t}  two spaces, é 東京 😀{t}")
            })
            .collect()
    }

    /// True when every probe encodes to the same ids whole and piece by piece (and at least
    /// one probe was cut).
    pub fn verified(&self, tokenizer: &Tokenizer, probes: &[String]) -> bool {
        let cut = probes.iter().any(|p| self.starts(p).len() > 1);
        cut && probes.iter().all(|text| {
            let whole = tokenizer.encode_fast(text.as_str(), false);
            let starts = self.starts(text);
            let mut pieces = Vec::new();
            for (i, &start) in starts.iter().enumerate() {
                let end = starts.get(i + 1).copied().unwrap_or(text.len());
                match tokenizer.encode_fast(&text[start..end], false) {
                    Ok(e) => pieces.extend_from_slice(e.get_ids()),
                    Err(_) => return false,
                }
            }
            whole.is_ok_and(|w| w.get_ids() == pieces)
        })
    }

    /// Pieces and token ids held.
    pub fn cached(&self) -> (usize, usize) {
        let cache = self.cache.lock();
        (cache.pieces.len(), cache.tokens)
    }
}
