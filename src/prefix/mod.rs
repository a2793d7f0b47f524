//! Prefix identity: a prompt's length in tokens and its chained block hashes in a namespace.
//!
//! Raw prompt text enters this module and never leaves it: callers get counts and hashes (and,
//! for tests and KV-event re-hashing, token ids). Nothing here logs or does network I/O; files are
//! read only when a registry is built from config.
//!
//! - [`registry`]: [`TokenizerRegistry`], one tokenizer per configured model, and
//!   [`TokenizerRegistry::identify`] (request + namespace -> [`PrefixIdentity`]).
//! - [`tokenizer`]: chat rendering + tokenizing with the per-segment token cache and the
//!   `max_prefix_tokens` cap.
//! - [`template`]: HF-compatible chat-template rendering (minijinja).
//! - [`hash`]: [`Namespace`], [`BlockHasher`] (chained xxh3 block hashes; re-chunking of an
//!   engine's blocks).
//! - [`tenant`]: tenant salts and share groups.
//! - `bytes`: the byte-estimate fallback (no tokenizer): `ceil(bytes / 4)` tokens and hashes over
//!   chunks of `4 * block_size` bytes.
//!
//! Multimodal content: each media part's content hash joins the extra keys of the block in
//! which its message starts (located by tokenizing the conversation before that message), so
//! the blocks before it stay shared and every block from there on depends on the media. The
//! engine expands media into placeholder tokens we cannot reproduce, so media prompts match only
//! our own predictions, never the engine's KV events.

mod bytes;
mod cache;
pub mod hash;
pub mod registry;
pub mod template;
pub mod tenant;
pub mod tokenizer;

pub use hash::{BlockHasher, ChainState, Namespace};
pub use registry::TokenizerRegistry;
pub use tenant::{TenancyError, TenantSalts};
pub use tokenizer::{ModelTokenizer, PromptTokens};

/// Bytes of text per token assumed when a model has no tokenizer configured. Byte-pair
/// tokenizers average 3.5-4.5 bytes per token on English text; 4 errs towards fewer tokens.
pub const BYTES_PER_TOKEN_ESTIMATE: usize = 4;

/// The byte-estimate fallback: `ceil(bytes / 4)` tokens.
pub fn estimate_tokens(text_bytes: usize) -> u64 {
    text_bytes.div_ceil(BYTES_PER_TOKEN_ESTIMATE) as u64
}

/// What the router knows of a prompt's prefix: its length and its block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixIdentity {
    /// Prompt length in tokens: exact from the tokenizer, or estimated (see `exact`,
    /// `truncated`).
    pub tokens: u64,
    /// Chained hashes of the prompt's full blocks, in order, at most
    /// `max_prefix_tokens / block_size_tokens` of them.
    pub block_hashes: Vec<u64>,
    /// Tokens per block (the model's `block_size_tokens`, default 16).
    pub block_size_tokens: u32,
    /// True when tokens and hashes come from the model's tokenizer (or the request's token ids);
    /// false for the byte estimate, whose hashes are over byte chunks.
    pub exact: bool,
    /// True when the prompt was longer than `max_prefix_tokens` allows tokenizing: `tokens`
    /// includes an estimate of the rest.
    pub truncated: bool,
    /// Why the byte estimate was used, when it was.
    pub fallback: Option<Fallback>,
}

impl PrefixIdentity {
    /// Tokens covered by the block hashes (`blocks * block_size_tokens`).
    pub fn hashed_tokens(&self) -> u64 {
        self.block_hashes.len() as u64 * u64::from(self.block_size_tokens)
    }
}

/// Why a prompt's identity is a byte estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The model has no tokenizer configured.
    NoTokenizer,
    /// A chat request for a model whose tokenizer has no chat template.
    NoChatTemplate,
    /// The chat template failed on this request (e.g. it raised on the role order).
    TemplateError,
    /// The tokenizer failed on the text.
    TokenizerError,
}

impl Fallback {
    /// A short label for metrics and decision logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoTokenizer => "no-tokenizer",
            Fallback::NoChatTemplate => "no-chat-template",
            Fallback::TemplateError => "template-error",
            Fallback::TokenizerError => "tokenizer-error",
        }
    }
}

impl From<PrefixError> for Fallback {
    fn from(e: PrefixError) -> Fallback {
        match e {
            PrefixError::NoChatTemplate => Fallback::NoChatTemplate,
            PrefixError::Template(_) => Fallback::TemplateError,
            PrefixError::Tokenize(_) | PrefixError::Load { .. } => Fallback::TokenizerError,
        }
    }
}

/// Errors of this module. Messages carry paths, counts and template/tokenizer diagnostics, never
/// prompt text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    /// A tokenizer file could not be loaded (`field` is the config path, e.g.
    /// `models[0].tokenizer`).
    #[error("{field}: cannot load {path}: {message}")]
    Load {
        /// The config field naming the file.
        field: String,
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A chat request for a model without a chat template.
    #[error("the model's tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template failed to render (its own message, e.g. from `raise_exception`).
    #[error("chat template error: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenize(String),
}

#[cfg(test)]
pub(crate) mod tests;
