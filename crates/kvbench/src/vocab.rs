//! Prompt text drawn from a real tokenizer's vocabulary, with an exact token count under that
//! tokenizer: whole-word vocabulary entries are sampled with a seeded generator, joined into
//! sentences, and the word list is trimmed or extended until the text has the target number of
//! tokens.
//!
//! Counting is the cost. The search counts its candidate text up to 12 times, and tokenizing a
//! 6000-token text each time made the quick plan's shared-prefix trace (75 x 6000-token system
//! prompts, 750 x 1200-token questions) take over 16 minutes per seed on a loaded 2-core
//! machine. Under a tokenizer whose pre-tokenizer splits space-led words and punctuation apart
//! (GPT-2 style byte-level BPE: Qwen, Llama 3, SmolLM), a text's token count is the sum of its
//! pieces' counts, so the search counts with a per-word table (each word's three forms counted
//! once per process) and tokenizes only the final text, to check it. When the check fails (a
//! tokenizer whose merges cross words), the search is redone from the same generator state with
//! real counts, the original slow path: either way the result is the same text, with the count
//! the real tokenizer gives.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::Rng;
use tokenizers::Tokenizer;

use super::BenchError;

/// A text generator over one tokenizer's word vocabulary.
pub struct Vocab {
    tokenizer: Tokenizer,
    words: Vec<String>,
    /// Per word, its token counts as `" word"`, `" Word"` and `"Word"` (see [`Form`]), counted
    /// on first use.
    forms: Vec<OnceLock<[u32; 3]>>,
    /// Tokens of `"."` alone.
    period_tokens: usize,
    /// Where the tokenizer was loaded from.
    pub source: PathBuf,
}

/// How a word appears in a text made by [`join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `" word"`: inside a sentence.
    Spaced = 0,
    /// `" Word"`: starting a sentence after the first.
    SpacedCapital = 1,
    /// `"Word"`: starting the text.
    Capital = 2,
}

/// How [`Vocab::text`] produced its last text (for tests and the generation note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// Counted with the per-word table; the final text checked by one tokenization.
    Table,
    /// The table's count was wrong for this tokenizer: searched again with real counts.
    Tokenizer,
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
        let forms = (0..words.len()).map(|_| OnceLock::new()).collect();
        let mut vocab = Vocab {
            tokenizer,
            words,
            forms,
            period_tokens: 0,
            source: dir.to_path_buf(),
        };
        vocab.period_tokens = vocab.count_tokens(".")?;
        Ok(vocab)
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
        Ok(self.text_counted(rng, tokens)?.0)
    }

    /// [`Vocab::text`], and how it was counted.
    pub fn text_counted(
        &self,
        rng: &mut StdRng,
        tokens: usize,
    ) -> Result<(String, Counting), BenchError> {
        self.text_with(rng, tokens, |words| self.table_count(words))
    }

    /// The search with `predict` as the counter; its result checked against the tokenizer, and
    /// the search redone with the tokenizer's counts (from the same generator state) when the
    /// prediction was wrong. Both paths give the same text whenever the prediction is right.
    fn text_with(
        &self,
        rng: &mut StdRng,
        tokens: usize,
        predict: impl Fn(&[usize]) -> Result<usize, BenchError>,
    ) -> Result<(String, Counting), BenchError> {
        if tokens == 0 {
            return Ok((String::new(), Counting::Table));
        }
        let start = rng.clone();
        let (words, predicted) = self.search(rng, tokens, predict)?;
        let text = join(&self.strs(&words));
        if self.count_tokens(&text)? == predicted {
            return Ok((text, Counting::Table));
        }
        *rng = start;
        let (words, _) = self.search(rng, tokens, |w| self.count_tokens(&join(&self.strs(w))))?;
        Ok((join(&self.strs(&words)), Counting::Tokenizer))
    }

    /// The word list (indices into the vocabulary) whose text comes closest to `tokens` as
    /// `count` counts it, and that count. Each word is about one token and each period another:
    /// start from that estimate, then correct by the measured difference (a few counts, not
    /// one per word).
    fn search(
        &self,
        rng: &mut StdRng,
        tokens: usize,
        count: impl Fn(&[usize]) -> Result<usize, BenchError>,
    ) -> Result<(Vec<usize>, usize), BenchError> {
        let pick = |rng: &mut StdRng| rng.random_range(0..self.words.len());
        let periods = tokens / (SENTENCE_WORDS + 1);
        let mut words: Vec<usize> = (0..(tokens - periods).max(1)).map(|_| pick(rng)).collect();
        let mut best = (usize::MAX, Vec::new(), 0);
        for _ in 0..12 {
            let n = count(&words)?;
            if n.abs_diff(tokens) < best.0 {
                best = (n.abs_diff(tokens), words.clone(), n);
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
        Ok((best.1, best.2))
    }

    fn strs(&self, words: &[usize]) -> Vec<&str> {
        words.iter().map(|&i| self.words[i].as_str()).collect()
    }

    /// The token count of `join(words)` if counts add up piece by piece: each word in its
    /// form, plus a period per sentence.
    fn table_count(&self, words: &[usize]) -> Result<usize, BenchError> {
        let mut n = self.period_tokens * words.len().div_ceil(SENTENCE_WORDS);
        for (i, &w) in words.iter().enumerate() {
            let form = match (i, i % SENTENCE_WORDS) {
                (0, _) => Form::Capital,
                (_, 0) => Form::SpacedCapital,
                _ => Form::Spaced,
            };
            n += self.form_tokens(w, form)?;
        }
        Ok(n)
    }

    /// Tokens of word `w` written in `form` (counted once per process).
    fn form_tokens(&self, w: usize, form: Form) -> Result<usize, BenchError> {
        if let Some(counts) = self.forms[w].get() {
            return Ok(counts[form as usize] as usize);
        }
        let word = &self.words[w];
        let capital = capitalise(word);
        let counts = [
            self.count_tokens(&format!(" {word}"))? as u32,
            self.count_tokens(&format!(" {capital}"))? as u32,
            self.count_tokens(&capital)? as u32,
        ];
        Ok(self.forms[w].get_or_init(|| counts)[form as usize] as usize)
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
            out.push_str(&capitalise(w));
        } else {
            out.push_str(w);
        }
        if i % SENTENCE_WORDS == SENTENCE_WORDS - 1 || i + 1 == words.len() {
            out.push('.');
        }
    }
    out
}

/// `w` with its first letter in upper case.
fn capitalise(w: &str) -> String {
    let mut chars = w.chars();
    match chars.next() {
        Some(c) => c.to_ascii_uppercase().to_string() + chars.as_str(),
        None => String::new(),
    }
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

    /// The original search: the tokenizer counts every candidate text.
    fn slow_text(v: &Vocab, rng: &mut StdRng, tokens: usize) -> String {
        let (text, counting) = v
            .text_with(rng, tokens, |w| v.count_tokens(&join(&v.strs(w))))
            .unwrap();
        assert_eq!(counting, Counting::Table, "real counts always check out");
        text
    }

    #[test]
    fn the_word_table_gives_the_tokenizers_text_and_count() {
        let v = fixture_vocab();
        for (seed, tokens) in [
            (1, 5),
            (2, 11),
            (3, 12),
            (4, 13),
            (5, 300),
            (6, 1200),
            (7, 6000),
        ] {
            let mut fast_rng = StdRng::seed_from_u64(seed);
            let (fast, counting) = v.text_counted(&mut fast_rng, tokens).unwrap();
            assert_eq!(counting, Counting::Table, "a GPT-2 style tokenizer adds up");
            let mut slow_rng = StdRng::seed_from_u64(seed);
            assert_eq!(
                fast,
                slow_text(&v, &mut slow_rng, tokens),
                "{tokens} tokens"
            );
            // The generator ends in the same state: later texts of a trace are unchanged too.
            assert_eq!(fast_rng, slow_rng);
            let n = v.count_tokens(&fast).unwrap();
            assert!(n.abs_diff(tokens) <= 1, "{tokens} -> {n}");
        }
    }

    #[test]
    fn a_wrong_table_falls_back_to_real_counts() {
        let v = fixture_vocab();
        for tokens in [40, 700] {
            let mut rng = StdRng::seed_from_u64(9);
            // A tokenizer whose merges crossed words would make the table overcount like this.
            let (text, counting) = v
                .text_with(&mut rng, tokens, |w| Ok(v.table_count(w)? + 3))
                .unwrap();
            assert_eq!(counting, Counting::Tokenizer);
            let mut slow_rng = StdRng::seed_from_u64(9);
            assert_eq!(text, slow_text(&v, &mut slow_rng, tokens));
            assert_eq!(rng, slow_rng);
            assert!(v.count_tokens(&text).unwrap().abs_diff(tokens) <= 1);
        }
    }

    #[test]
    fn missing_tokenizer_is_a_clear_error() {
        let err = resolve("no-such-model", Path::new("/nonexistent")).unwrap_err();
        assert!(err.to_string().contains("make tokenizers"), "{err}");
    }
}
