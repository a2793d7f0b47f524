//! Prompt tokens as the simulated engine sees them, behind a trait so a real tokenizer
//! ([`crate::hf_tokenizer::HfTokenizer`]: Hugging Face files and chat templates) can be plugged
//! in.
//!
//! The fallback, [`WordPieceTokenizer`], is deterministic across processes: text is split into
//! words (with their leading-space flag), punctuation and newlines; words are cut into pieces of
//! at most [`MAX_PIECE_CHARS`] characters; each piece maps to `256 + xxh3(piece) % (vocab -
//! 256)`. Chat requests are rendered with a fixed ChatML-like template, messages concatenated in
//! order, so a shared system prompt is a shared token prefix; media parts become runs of
//! placeholder tokens carrying the media hash (as vLLM's multimodal placeholders).

use std::fmt;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::request::{ContentPart, PromptRef, RenderOptions, SimRequest};

/// A run of multimodal placeholder tokens in a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmSpan {
    /// Index of the first placeholder token.
    pub offset: u32,
    /// Placeholder tokens.
    pub len: u32,
    /// Content hash of the media item (it becomes an extra key of every block it overlaps).
    pub hash: u64,
}

/// One prompt's tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptTokens {
    /// Token ids, chat template applied.
    pub ids: Vec<u32>,
    /// Multimodal placeholder runs, in order.
    pub mm: Vec<MmSpan>,
}

/// Why a prompt could not be tokenized (a 400 to the client).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// A request with several prompts was given where one was expected.
    #[error("expected one prompt, got a batch")]
    Batch,
    /// The tokenizer (or its chat template) rejected the prompt; the message quotes no prompt
    /// text.
    #[error("{0}")]
    Rejected(String),
}

/// Turns one prompt into the token ids the engine schedules and hashes.
pub trait PromptTokenizer: Send + Sync + fmt::Debug {
    /// The prompt's tokens: a chat is rendered with the chat template first; `options` carries
    /// the request's rendering flags (generation prompt, special tokens, template kwargs).
    fn tokens(
        &self,
        prompt: PromptRef<'_>,
        options: &RenderOptions,
    ) -> Result<PromptTokens, TokenizeError>;

    /// The tokens of a request that holds exactly one prompt (a batch is
    /// [`TokenizeError::Batch`]).
    fn request_tokens(&self, req: &SimRequest) -> Result<PromptTokens, TokenizeError> {
        match req.prompts()[..] {
            [one] => self.tokens(one, &req.render),
            _ => Err(TokenizeError::Batch),
        }
    }

    /// Token id of the `index`-th generated token (the simulator's filler text). Matching the
    /// tokenization of the filler text lets a multi-turn conversation that sends an answer back
    /// hit the blocks holding it.
    fn output_token(&self, index: u32) -> u32 {
        WordPieceTokenizer::default().output_token(index)
    }
}

/// Words of the deterministic filler text; generated token `i` is word `i % 8`.
/// Every word is one fallback piece, so an answer sent back re-tokenizes to the generated ids.
pub const FILLER_WORDS: [&str; 8] = [
    "lorem", "ipsum", "dolor", "sit", "amet", "elit", "sed", "do",
];

/// The text of generated token `index`: its filler word followed by a space.
pub fn filler_piece(index: u32) -> &'static str {
    const PIECES: [&str; 8] = [
        "lorem ", "ipsum ", "dolor ", "sit ", "amet ", "elit ", "sed ", "do ",
    ];
    PIECES[index as usize % PIECES.len()]
}

/// Longest word piece of the fallback, in characters (English BPE averages ~4 bytes a token).
pub const MAX_PIECE_CHARS: usize = 5;
/// Placeholder tokens per image/audio/video item in the fallback.
pub const MM_PLACEHOLDER_TOKENS: u32 = 64;

const IM_START: u32 = 1;
const IM_END: u32 = 2;
const MM_PLACEHOLDER: u32 = 3;
const FIRST_PIECE_ID: u32 = 256;
const PIECE_SEED: u64 = 0x6b76_7369_6d5f_7770; // "kvsim_wp"

/// The deterministic fallback tokenizer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WordPieceTokenizer {
    /// Vocabulary size; ids are below it. Default 32000.
    pub vocab_size: u32,
}

impl Default for WordPieceTokenizer {
    fn default() -> Self {
        Self { vocab_size: 32_000 }
    }
}

impl WordPieceTokenizer {
    fn piece_id(&self, leading_space: bool, piece: &str) -> u32 {
        let seed = PIECE_SEED ^ u64::from(leading_space);
        let span = u64::from(self.vocab_size.saturating_sub(FIRST_PIECE_ID).max(1));
        FIRST_PIECE_ID + (xxh3_64_with_seed(piece.as_bytes(), seed) % span) as u32
    }

    /// Appends the tokens of `text` to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let mut space = false;
        let mut chars = text.char_indices().peekable();
        while let Some((start, c)) = chars.next() {
            if c == '\n' {
                out.push(self.piece_id(false, "\n"));
                space = false;
            } else if c.is_whitespace() {
                space = true;
            } else if c.is_alphanumeric() {
                let mut end = start + c.len_utf8();
                while let Some(&(i, n)) = chars.peek() {
                    if !n.is_alphanumeric() {
                        break;
                    }
                    end = i + n.len_utf8();
                    chars.next();
                }
                let mut rest = &text[start..end];
                let mut first = true;
                while !rest.is_empty() {
                    let cut = rest
                        .char_indices()
                        .nth(MAX_PIECE_CHARS)
                        .map_or(rest.len(), |(i, _)| i);
                    out.push(self.piece_id(space && first, &rest[..cut]));
                    rest = &rest[cut..];
                    first = false;
                }
                space = false;
            } else {
                let end = start + c.len_utf8();
                out.push(self.piece_id(space, &text[start..end]));
                space = false;
            }
        }
    }

    /// The tokens of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        self.encode_into(text, &mut out);
        out
    }
}

impl PromptTokenizer for WordPieceTokenizer {
    fn tokens(
        &self,
        prompt: PromptRef<'_>,
        _options: &RenderOptions,
    ) -> Result<PromptTokens, TokenizeError> {
        let mut out = PromptTokens::default();
        match prompt {
            PromptRef::Text(text) => self.encode_into(text, &mut out.ids),
            PromptRef::Tokens(ids) => out.ids.extend_from_slice(ids),
            PromptRef::Chat(messages) => {
                for message in messages {
                    out.ids.push(IM_START);
                    self.encode_into(&message.role, &mut out.ids);
                    out.ids.push(self.piece_id(false, "\n"));
                    for part in &message.content {
                        match part {
                            ContentPart::Text(text) => self.encode_into(text, &mut out.ids),
                            ContentPart::Media(media) => {
                                out.mm.push(MmSpan {
                                    offset: out.ids.len() as u32,
                                    len: MM_PLACEHOLDER_TOKENS,
                                    hash: media.hash,
                                });
                                out.ids.extend(std::iter::repeat_n(
                                    MM_PLACEHOLDER,
                                    MM_PLACEHOLDER_TOKENS as usize,
                                ));
                            }
                        }
                    }
                    out.ids.push(IM_END);
                    out.ids.push(self.piece_id(false, "\n"));
                }
                out.ids.push(IM_START);
                self.encode_into("assistant", &mut out.ids);
                out.ids.push(self.piece_id(false, "\n"));
            }
        }
        Ok(out)
    }

    fn output_token(&self, index: u32) -> u32 {
        let word = FILLER_WORDS[index as usize % FILLER_WORDS.len()];
        // "lorem ipsum dolor": the first word has no leading space, the others do.
        self.piece_id(index > 0, word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, ApiKind};

    fn chat(body: &str) -> PromptTokens {
        let req = parse(ApiKind::ChatCompletions, body.as_bytes()).unwrap();
        WordPieceTokenizer::default().request_tokens(&req).unwrap()
    }

    #[test]
    fn splitting_table() {
        let t = WordPieceTokenizer::default();
        let cases: [(&str, usize); 7] = [
            ("", 0),
            ("hello", 1),
            ("hello world", 2),
            ("logistics", 2),       // "logis" + "tics"
            ("a, b.", 4),           // a , b .
            ("  spaced   out ", 3), // "space" "d" " out"
            ("line\nnext", 3),
        ];
        for (text, n) in cases {
            assert_eq!(t.encode(text).len(), n, "{text:?}");
        }
        assert_ne!(
            t.encode("world"),
            t.encode(" world"),
            "leading space is part of a piece"
        );
        assert_eq!(
            t.encode("héllo wörld").len(),
            2,
            "multi-byte characters are one char each"
        );
    }

    #[test]
    fn ids_are_stable_and_in_vocab() {
        let t = WordPieceTokenizer::default();
        let ids = t.encode("The quick brown fox, jumps!");
        assert!(ids.iter().all(|&id| (FIRST_PIECE_ID..32_000).contains(&id)));
        // Fixed values: a change here changes every simulated block hash; do it deliberately.
        assert_eq!(t.encode("hello"), vec![19581]);
        assert_eq!(
            t.encode(" The quick brown fox"),
            vec![11171, 18519, 8425, 26907]
        );
        assert_eq!(t.piece_id(false, "hello"), t.encode("hello")[0]);
    }

    #[test]
    fn shared_system_prompt_is_a_shared_prefix() {
        let a = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"You are helpful and kind."},{"role":"user","content":"Where is order 1?"}]}"#,
        );
        let b = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"You are helpful and kind."},{"role":"user","content":"Totally different"}]}"#,
        );
        let common = a.ids.iter().zip(&b.ids).take_while(|(x, y)| x == y).count();
        let system_len = 1 + 1 + 1 + 6 + 2; // im_start system \n  You are helpful and kind .  im_end \n
        assert!(common >= system_len, "common prefix {common}");
        assert_ne!(a.ids, b.ids);
    }

    #[test]
    fn images_become_placeholder_runs_with_their_hash() {
        let p = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"http://x/cat.png"}}]}]}"#,
        );
        assert_eq!(p.mm.len(), 1);
        let span = p.mm[0];
        assert_eq!(span.len, MM_PLACEHOLDER_TOKENS);
        assert!(
            p.ids[span.offset as usize..(span.offset + span.len) as usize]
                .iter()
                .all(|&id| id == MM_PLACEHOLDER)
        );
    }

    #[test]
    fn an_answer_sent_back_tokenizes_like_the_generated_tokens() {
        let t = WordPieceTokenizer::default();
        let text: String = (0..20).map(filler_piece).collect();
        let generated: Vec<u32> = (0..20).map(|i| t.output_token(i)).collect();
        assert_eq!(t.encode(&text), generated);
    }

    #[test]
    fn batches_and_token_prompts() {
        let t = WordPieceTokenizer::default();
        let req = parse(ApiKind::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(t.request_tokens(&req).unwrap().ids, vec![1, 2, 3]);
        let req = parse(ApiKind::Completions, br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(t.request_tokens(&req), Err(TokenizeError::Batch));
    }
}
