//! The simulator's Hugging Face tokenizer: `tokenizer.json` through the `tokenizers` crate,
//! the chat template through minijinja, wired as vLLM 0.32 wires transformers. Written apart
//! from the router's tokenizer on purpose: the tests compare both with a real vLLM capture, so
//! a tokenization bug in either shows up instead of being shared.
//!
//! - Chat: the conversation is rendered ([`ChatTemplate`]) and the text encoded with
//!   `add_special_tokens` false (vLLM's default for chat: the template writes BOS itself).
//! - Completions: the text is encoded with `add_special_tokens` true by default, so the
//!   tokenizer's post-processor adds BOS where the model's files say. As transformers v5 does,
//!   a `tokenizer_config.json` that sets `add_bos_token` / `add_eos_token` (or a tokenizer
//!   without a post-processor) gets a post-processor built from those flags.
//! - Token-id prompts are used as given, after a vocabulary check (vLLM refuses ids out of it).
//! - Text encoded without special tokens (every chat) goes piece by piece, cut at added tokens,
//!   long pieces from a cache (a shared system prompt is encoded once), when a check at load
//!   shows the pieces tokenize like the whole for this tokenizer; otherwise whole.
//! - Media: each item becomes [`MM_PLACEHOLDER_TOKENS`] placeholder tokens (the unknown token's
//!   id) where the template put it, keyed by the item's hash; the text on each side is encoded
//!   on its own, as around a real model's special placeholder token.

mod config;
mod content_format;
mod python;
mod segments;
mod template;

use std::path::{Path, PathBuf};

use tokenizers::processors::template::TemplateProcessing;
use tokenizers::Tokenizer;

use segments::Segmenter;

pub use config::TokenizerConfig;
pub use content_format::ContentFormat;
pub use template::{ChatTemplate, Rendered};

use super::config::TokenizerPaths;
use super::request::{ChatMessage, ContentPart, Media, PromptRef, RenderOptions};
use super::tokenize::{
    MmSpan, PromptTokenizer, PromptTokens, TokenizeError, FILLER_WORDS, MM_PLACEHOLDER_TOKENS,
};

/// Why tokenizer files could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file was read but is not what it should be.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Marks around a media item's index in rendered text (Unicode private-use characters, which
/// no template writes).
const MEDIA_OPEN: char = '\u{F8F0}';
const MEDIA_CLOSE: char = '\u{F8F1}';

/// A [`PromptTokenizer`] over a model's Hugging Face tokenizer files.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// Piece-by-piece encoding with a cache, when verified for this tokenizer.
    segments: Option<Segmenter>,
    /// Ids below this exist (added tokens included).
    vocab_size: usize,
    /// Id of a media placeholder token.
    placeholder_id: u32,
    /// Token id of each filler word after a space, so an answer sent back re-tokenizes to the
    /// generated ids as far as the tokenizer allows.
    filler_ids: [u32; 8],
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`, and `tokenizer_config.json` and `chat_template.jinja` when given
    /// (a separate template file wins over the config's, as in transformers v5).
    pub fn load(paths: &TokenizerPaths) -> Result<HfTokenizer, LoadError> {
        let json_path = &paths.tokenizer_json;
        let mut tokenizer = Tokenizer::from_bytes(read(json_path)?)
            .map_err(|e| invalid(json_path, format!("not a tokenizer.json: {e}")))?;
        // Prompts are tokenized whole: no truncation or padding a tokenizer.json may carry.
        tokenizer
            .with_truncation(None)
            .map_err(|e| invalid(json_path, e.to_string()))?
            .with_padding(None);
        let config = match &paths.tokenizer_config {
            Some(path) => {
                let text = String::from_utf8_lossy(&read(path)?).into_owned();
                TokenizerConfig::parse(&text).map_err(|m| invalid(path, m))?
            }
            None => TokenizerConfig::default(),
        };
        rebuild_post_processor(&mut tokenizer, &config);
        let template = match &paths.chat_template {
            Some(path) => Some((String::from_utf8_lossy(&read(path)?).into_owned(), path)),
            None => config
                .chat_template
                .clone()
                .zip(paths.tokenizer_config.as_ref()),
        };
        let template = template
            .map(|(source, path)| {
                ChatTemplate::new(&source, &config)
                    .map_err(|e| invalid(path, format!("the chat template does not compile: {e}")))
            })
            .transpose()?;
        let placeholder_id = config
            .special("unk_token")
            .and_then(|t| tokenizer.token_to_id(t))
            .unwrap_or(0);
        let mut filler_ids = [0; 8];
        for (id, word) in filler_ids.iter_mut().zip(FILLER_WORDS) {
            *id = tokenizer
                .encode_fast(format!(" {word}"), false)
                .ok()
                .and_then(|e| e.get_ids().first().copied())
                .unwrap_or(0);
        }
        let segments = Segmenter::new(&tokenizer).filter(|s| {
            let mut probes = s.raw_probes();
            probes.extend(template.as_ref().and_then(probe_chat));
            s.verified(&tokenizer, &probes)
        });
        Ok(HfTokenizer {
            vocab_size: tokenizer.get_vocab_size(true),
            tokenizer,
            template,
            segments,
            placeholder_id,
            filler_ids,
        })
    }

    /// Pieces and token ids in the segment cache; `None` when this tokenizer encodes whole
    /// (its pieces did not tokenize like the whole at load).
    pub fn segment_cache(&self) -> Option<(usize, usize)> {
        self.segments.as_ref().map(Segmenter::cached)
    }

    /// The chat template, when the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The ids of `text`; without special tokens, piece by piece through the cache when the
    /// tokenizer allows (the post-processor that adds special tokens applies to the whole).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let ids = match &self.segments {
            Some(segments) if !add_special_tokens => segments.encode(&self.tokenizer, text),
            _ => self
                .tokenizer
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec()),
        };
        ids.map_err(|e| TokenizeError::Rejected(format!("the tokenizer failed: {e}")))
    }

    fn chat(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions,
    ) -> Result<PromptTokens, TokenizeError> {
        let template = self.template.as_ref().ok_or_else(|| {
            TokenizeError::Rejected(
                "the model's tokenizer has no chat template, so chat requests cannot be served"
                    .into(),
            )
        })?;
        let rendered = template
            .render(messages, options, |k| {
                format!("{MEDIA_OPEN}{k}{MEDIA_CLOSE}")
            })
            .map_err(|e| TokenizeError::Rejected(format!("chat template: {e}")))?;
        if rendered.media.is_empty() {
            return Ok(PromptTokens {
                ids: self.encode(&rendered.text, options.add_special_tokens)?,
                mm: Vec::new(),
            });
        }
        self.encode_with_media(&rendered.text, &rendered.media, options.add_special_tokens)
    }

    /// Encodes text holding media marks: the text between marks piece by piece, each mark as a
    /// run of placeholder tokens. Special tokens, when asked for, go with the first piece.
    fn encode_with_media(
        &self,
        text: &str,
        media: &[Media],
        add_special_tokens: bool,
    ) -> Result<PromptTokens, TokenizeError> {
        let mut out = PromptTokens::default();
        let mut used = vec![false; media.len()];
        let mut piece_start = 0;
        let mut search = 0;
        while let Some(open) = text[search..].find(MEDIA_OPEN).map(|i| search + i) {
            let digits_start = open + MEDIA_OPEN.len_utf8();
            let mark = text[digits_start..]
                .find(MEDIA_CLOSE)
                .and_then(|len| {
                    let k: usize = text[digits_start..digits_start + len].parse().ok()?;
                    Some((k, digits_start + len + MEDIA_CLOSE.len_utf8()))
                })
                .filter(|&(k, _)| k < media.len() && !used[k]);
            let Some((k, end)) = mark else {
                search = digits_start;
                continue;
            };
            used[k] = true;
            let first = piece_start == 0 && out.ids.is_empty();
            out.ids
                .extend(self.encode(&text[piece_start..open], add_special_tokens && first)?);
            out.mm.push(MmSpan {
                offset: out.ids.len() as u32,
                len: MM_PLACEHOLDER_TOKENS,
                hash: media[k].hash,
            });
            out.ids.extend(std::iter::repeat_n(
                self.placeholder_id,
                MM_PLACEHOLDER_TOKENS as usize,
            ));
            piece_start = end;
            search = end;
        }
        let first = out.ids.is_empty();
        out.ids
            .extend(self.encode(&text[piece_start..], add_special_tokens && first)?);
        Ok(out)
    }
}

impl PromptTokenizer for HfTokenizer {
    fn tokens(
        &self,
        prompt: PromptRef<'_>,
        options: &RenderOptions,
    ) -> Result<PromptTokens, TokenizeError> {
        match prompt {
            PromptRef::Text(text) => Ok(PromptTokens {
                ids: self.encode(text, options.add_special_tokens)?,
                mm: Vec::new(),
            }),
            PromptRef::Tokens(ids) => {
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
                    return Err(TokenizeError::Rejected(format!(
                        "token id {bad} is out of vocabulary (size {})",
                        self.vocab_size
                    )));
                }
                Ok(PromptTokens {
                    ids: ids.to_vec(),
                    mm: Vec::new(),
                })
            }
            PromptRef::Chat(messages) => self.chat(messages, options),
        }
    }

    fn output_token(&self, index: u32) -> u32 {
        self.filler_ids[index as usize % self.filler_ids.len()]
    }
}

/// A conversation rendered by `template` with whitespace, digits and non-ASCII text at message
/// edges, for the segment check; `None` if the template refuses it.
fn probe_chat(template: &ChatTemplate) -> Option<String> {
    let message = |role: &str, text: &str| ChatMessage {
        role: role.into(),
        content: vec![ContentPart::Text(text.into())],
        name: None,
        tool_call_id: None,
        tool_calls: None,
        reasoning: None,
    };
    let conversation = [
        message("system", "\n Be brief;  cite sources [2].\t"),
        message("user", "  Où est le colis n° 12345? 東京 😀 \n\n"),
        message("assistant", "It left   at 09:30.\n"),
        message("user", " Thanks!!  "),
    ];
    let options = RenderOptions::default();
    template
        .render(&conversation, &options, |k| k.to_string())
        .ok()
        .map(|r| r.text)
}

/// transformers v5: when `tokenizer_config.json` sets `add_bos_token` or `add_eos_token` (or
/// the tokenizer has no post-processor), the post-processor becomes
/// `[bos] $A [eos]` per those flags; a flag whose token is unknown is dropped.
fn rebuild_post_processor(tokenizer: &mut Tokenizer, config: &TokenizerConfig) {
    let explicit = config.add_bos_token.is_some() || config.add_eos_token.is_some();
    if !explicit && tokenizer.get_post_processor().is_some() {
        return;
    }
    let special = |flag: Option<bool>, name: &str| {
        let token = config.special(name)?;
        let id = tokenizer.token_to_id(token)?;
        (flag == Some(true) && !token.contains([' ', ':'])).then(|| (token.to_string(), id))
    };
    let bos = special(config.add_bos_token, "bos_token");
    let eos = special(config.add_eos_token, "eos_token");
    let sequence = |seq: &str, type_id: u8| {
        let mut pieces = Vec::new();
        if let Some((t, _)) = &bos {
            pieces.push(format!("{t}:{type_id}"));
        }
        pieces.push(format!("${seq}:{type_id}"));
        if let Some((t, _)) = &eos {
            pieces.push(format!("{t}:{type_id}"));
        }
        pieces
    };
    let pair = [sequence("A", 0), sequence("B", 1)].concat();
    let specials: Vec<(String, u32)> = bos.iter().chain(eos.iter()).cloned().collect();
    let mut builder = TemplateProcessing::builder();
    let built = builder
        .try_single(sequence("A", 0))
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| e.to_string())
        .and_then(|b| {
            b.special_tokens(specials)
                .build()
                .map_err(|e| e.to_string())
        });
    match built {
        Ok(processor) => {
            tokenizer.with_post_processor(Some(processor));
        }
        Err(e) => tracing::warn!("kvsim: cannot rebuild the tokenizer's post-processor: {e}"),
    }
}

#[cfg(test)]
mod tests;
