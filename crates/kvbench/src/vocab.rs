//! Prompt text drawn from a real tokenizer's vocabulary, with an exact token count under that
//! tokenizer: whole-word vocabulary entries are sampled with a seeded generator, joined into
//! sentences, and the text is re-tokenized and trimmed or extended until it has the target
//! number of tokens.

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::Rng;
use tokenizers::Tokenizer;

use super::BenchError;

/// A text generator over one tokenizer's word vocabulary.
pub struct Vocab {
    tokenizer: Tokenizer,
    words: Vec<String>,
    /// Where the tokenizer was loaded from.
    pub source: PathBuf,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("source", &self.source)
            .field("words", &self.words.len())
            .finish()
    }
}

/// Shortest and longest vocabulary word used, in characters.
const WORD_CHARS: std::ops::RangeInclusive<usize> = 3..=10;
/// Words per sentence (a period follows).
const SENTENCE_WORDS: usize = 11;

/// Finds a tokenizer directory: `name` as a path if it holds `tokenizer.json`, else
/// `<tokenizers_dir>/<name>`.
pub fn resolve(name: &str, tokenizers_dir: &Path) -> Result<PathBuf, BenchError> {
    let direct = PathBuf::from(name);
    for dir in [direct, tokenizers_dir.join(name)] {
        if dir.join("tokenizer.json").is_file() {
            return Ok(dir);
        }
    }
    Err(BenchError::Tokenizer(format!(
        "no tokenizer.json for {name:?} (looked in {name} and {}); run `make tokenizers` or pass \
         --tokenizers DIR / KVROUTER_TOKENIZERS_DIR",
        tokenizers_dir.join(name).display()
    )))
}

impl Vocab {
    /// Loads `dir/tokenizer.json` and collects its whole-word entries (a leading-space marker
    /// `Ġ` or `▁` followed by 3-10 lowercase ASCII letters).
    pub fn load(dir: &Path) -> Result<Vocab, BenchError> {
        let path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&path)
            .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", path.display())))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| BenchError::Tokenizer(e.to_string()))?
            .with_padding(None);
        let mut entries: Vec<(u32, String)> = tokenizer
            .get_vocab(false)
            .into_iter()
            .filter_map(|(token, id)| {
                let word = token
                    .strip_prefix('Ġ')
                    .or_else(|| token.strip_prefix('▁'))?;
                (WORD_CHARS.contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase()))
                    .then(|| (id, word.to_string()))
            })
            .collect();
        // HashMap order is random: sort so a seed always yields the same text.
        entries.sort_unstable();
        let words: Vec<String> = entries.into_iter().map(|(_, w)| w).collect();
        if words.len() < 100 {
            return Err(BenchError::Tokenizer(format!(
                "{}: only {} whole-word entries; not a usable vocabulary",
                path.display(),
                words.len()
            )));
        }
        Ok(Vocab {
            tokenizer,
            words,
            source: dir.to_path_buf(),
        })
    }

    /// Words that are exactly one token with their leading space (`" word"`), at most
    /// `limit`, in vocabulary order. Texts made of these and periods (`"."`, also one token)
    /// have a known token count without tokenizing, and a block of them tokenizes the same
    /// whatever precedes it: every piece is its own pre-token (a space-led word, or
    /// punctuation), so byte-pair merges never cross a piece boundary.
    pub fn single_token_words(&self, limit: usize) -> Result<Vec<String>, BenchError> {
        let mut out = Vec::new();
        for w in &self.words {
            if out.len() >= limit {
                break;
            }
            let piece = format!(" {w}");
            if self.count_tokens(&piece)? == 1 {
                out.push(piece);
            }
        }
        if self.count_tokens(".")? != 1 || out.len() < 100 {
            return Err(BenchError::Tokenizer(format!(
                "{}: too few single-token words ({}) for trace text",
                self.source.display(),
                out.len()
            )));
        }
        Ok(out)
    }

    /// Whole-word vocabulary entries available.
    pub fn word_count(&self) -> usize {
        self.words.len()
    }

    /// Tokens of `text` under this tokenizer (no special tokens).
    pub fn count_tokens(&self, text: &str) -> Result<usize, BenchError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().len())
            .map_err(|e| BenchError::Tokenizer(e.to_string()))
    }

    /// Token ids of `text` under this tokenizer (no special tokens).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, BenchError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| BenchError::Tokenizer(e.to_string()))
    }

    /// Text of exactly `tokens` tokens (or as close as whole words allow: within 1 from 5
    /// tokens up; shorter texts still carry a capital and a period), in sentences.
    pub fn text(&self, rng: &mut StdRng, tokens: usize) -> Result<String, BenchError> {
        if tokens == 0 {
            return Ok(String::new());
        }
        let pick = |rng: &mut StdRng| self.words[rng.random_range(0..self.words.len())].as_str();
        // Each word is about one token and each period another: start from that estimate, then
        // correct by the measured difference (a few re-tokenizations, not one per word).
        let periods = tokens / (SENTENCE_WORDS + 1);
        let mut words: Vec<&str> = (0..(tokens - periods).max(1)).map(|_| pick(rng)).collect();
        let mut best = (usize::MAX, String::new());
        for _ in 0..12 {
            let text = join(&words);
            let n = self.count_tokens(&text)?;
            if n.abs_diff(tokens) < best.0 {
                best = (n.abs_diff(tokens), text);
            }
            if n == tokens {
                break;
            }
            if n < tokens {
                let more = (tokens - n).div_ceil(2).max(1);
                words.extend((0..more).map(|_| pick(rng)));
            } else {
                let fewer = (n - tokens).div_ceil(2).max(1).min(words.len() - 1);
                if fewer == 0 {
                    break;
                }
                words.truncate(words.len() - fewer);
            }
        }
        Ok(best.1)
    }
}

/// Words as sentences: capitalised first word, a period every `SENTENCE_WORDS` words.
fn join(words: &[&str]) -> String {
    let mut out = String::with_capacity(words.len() * 8);
    for (i, w) in words.iter().enumerate() {
        let start = i % SENTENCE_WORDS == 0;
        if i > 0 {
            out.push(' ');
        }
        if start {
            let mut chars = w.chars();
            if let Some(c) = chars.next() {
                out.push(c.to_ascii_uppercase());
                out.push_str(chars.as_str());
            }
        } else {
            out.push_str(w);
        }
        if i % SENTENCE_WORDS == SENTENCE_WORDS - 1 || i + 1 == words.len() {
            out.push('.');
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::SeedableRng;

    pub(crate) fn fixture_vocab() -> Vocab {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
            .find(|p| p.join("tokenizer.json").is_file())
            .expect("shared fixture tokenizer");
        Vocab::load(&dir).unwrap()
    }

    #[test]
    fn texts_have_the_asked_token_count_and_are_seeded() {
        let v = fixture_vocab();
        assert!(v.word_count() > 1000, "{}", v.word_count());
        // Below a sentence's capital and period, counts are approximate.
        for (tokens, slack) in [(2, 2), (7, 1), (64, 1), (500, 1), (1500, 1)] {
            let mut rng = StdRng::seed_from_u64(tokens as u64);
            let text = v.text(&mut rng, tokens).unwrap();
            let n = v.count_tokens(&text).unwrap();
            assert!(n.abs_diff(tokens) <= slack, "{tokens} -> {n}");
            let mut again = StdRng::seed_from_u64(tokens as u64);
            assert_eq!(text, v.text(&mut again, tokens).unwrap());
        }
        let mut rng = StdRng::seed_from_u64(1);
        let a = v.text(&mut rng, 50).unwrap();
        let b = v.text(&mut rng, 50).unwrap();
        assert_ne!(a, b, "successive texts differ");
    }

    #[test]
    fn missing_tokenizer_is_a_clear_error() {
        let err = resolve("no-such-model", Path::new("/nonexistent")).unwrap_err();
        assert!(err.to_string().contains("make tokenizers"), "{err}");
    }
}
