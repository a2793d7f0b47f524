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
//! - `media`: where each media message's content starts in the rendered prompt.
//!
//! Multimodal content: each media part's content hash joins the extra keys of the block in
//! which its message's content starts (located in one extra render, see `media`), so the blocks
//! before it stay shared and every block from there on depends on the media. The engine expands
//! media into placeholder tokens we cannot reproduce, so media prompts match only our own
//! predictions, never the engine's KV events.
//!
//! **Bounded work per request** (issue 12). The body's shape is limited while parsing
//! (`crate::request::RequestLimits`); here, every template render is bounded by fuel and an
//! output size ([`template::RenderLimits`], per model), tokenizing by `max_prefix_tokens`, and
//! the whole by an optional deadline ([`TokenizerRegistry::identify_until`]). Running out of any
//! of them is never an error: the request gets a cheaper identity (the byte estimate, or the
//! exact prefix tokenized so far) and [`PrefixIdentity::source`] says which.

mod byte_bpe;
mod bytes;
mod cache;
pub mod hash;
mod media;
pub mod registry;
pub mod template;
pub mod tenant;
pub mod tokenizer;

pub use hash::{BlockHasher, ChainState, Namespace};
pub use registry::{DeferredPrefix, TokenizerRegistry};
pub use tenant::{TenancyError, TenantSalts};
pub use tokenizer::{ModelTokenizer, PromptTokens, CHUNK_BYTES};

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
    /// True when the prompt was longer than `max_prefix_tokens` allows tokenizing (or the
    /// deadline stopped tokenizing): `tokens` includes an estimate of the rest.
    pub truncated: bool,
    /// True when the deadline stopped tokenizing early: the hashes cover the prefix tokenized
    /// so far (a prefix of the full identity's hashes).
    pub deadline_cut: bool,
    /// Why the byte estimate was used, when it was.
    pub fallback: Option<Fallback>,
    /// Set when the new text after the prefix was left for after the decision
    /// (`models[].defer_tokenizing_after`): the hashes cover the cached prefix, `tokens`
    /// estimates the rest, and [`DeferredPrefix::finish`] gives the whole prompt's hashes.
    pub deferred: Option<DeferredPrefix>,
}

impl PrefixIdentity {
    /// Tokens covered by the block hashes (`blocks * block_size_tokens`).
    pub fn hashed_tokens(&self) -> u64 {
        self.block_hashes.len() as u64 * u64::from(self.block_size_tokens)
    }

    /// Which identity this is, for decision records and metrics: `tokens` (the whole prompt
    /// tokenized, or request token ids), `tokens-capped` (the first `max_prefix_tokens`
    /// tokenized, the rest estimated), `tokens-partial` (the deadline stopped tokenizing: the
    /// prefix so far), `tokens-deferred` (the prefix tokenized before new text; the rest is
    /// tokenized after the decision) or `bytes` (the byte estimate; [`Self::fallback`] says why).
    pub fn source(&self) -> &'static str {
        PREFIX_SOURCES[self.source_index()]
    }

    /// [`Self::source`] as its index in [`PREFIX_SOURCES`] (a metric's handle, no lookup).
    pub fn source_index(&self) -> usize {
        match (self.fallback, self.deadline_cut, self.truncated) {
            (Some(_), _, _) => 4,
            (None, true, _) => 2,
            _ if self.deferred.is_some() => 3,
            (None, false, true) => 1,
            (None, false, false) => 0,
        }
    }
}

/// Every [`PrefixIdentity::source`], in [`PrefixIdentity::source_index`] order.
pub const PREFIX_SOURCES: [&str; 5] = [
    "tokens",
    "tokens-capped",
    "tokens-partial",
    "tokens-deferred",
    "bytes",
];

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
    /// Rendering the chat ran out of the model's `template_fuel` or went over its
    /// `max_rendered_prompt_bytes` (a valid but huge or pathological conversation).
    WorkBudget,
    /// The request's deadline had passed before its prompt was rendered (e.g. it waited long
    /// for a tokenizing slot), or before the extra render that places its media.
    Deadline,
    /// Media parts whose position in the rendered prompt could not be found (the template
    /// treats the content specially); the byte chunks keep them in place.
    MediaLayout,
}

impl Fallback {
    /// A short label for metrics and decision logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoTokenizer => "no-tokenizer",
            Fallback::NoChatTemplate => "no-chat-template",
            Fallback::TemplateError => "template-error",
            Fallback::TokenizerError => "tokenizer-error",
            Fallback::WorkBudget => "work-budget",
            Fallback::Deadline => "deadline",
            Fallback::MediaLayout => "media-layout",
        }
    }
}

impl From<PrefixError> for Fallback {
    fn from(e: PrefixError) -> Fallback {
        match e {
            PrefixError::NoChatTemplate => Fallback::NoChatTemplate,
            PrefixError::Template(_) => Fallback::TemplateError,
            PrefixError::Tokenize(_) | PrefixError::Load { .. } => Fallback::TokenizerError,
            PrefixError::Budget(_) => Fallback::WorkBudget,
            PrefixError::Deadline => Fallback::Deadline,
            PrefixError::MediaLayout => Fallback::MediaLayout,
        }
    }
}

/// Errors of this module. Messages carry paths, counts and template/tokenizer diagnostics, never
/// prompt text (a template's own `raise_exception` message may quote what the template put in
/// it, e.g. a role: these messages are not shown to clients; requests see only the
/// [`Fallback`] label).
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
    /// A render limit ran out: `template fuel` or `rendered prompt size`.
    #[error("the chat template ran out of its {0} limit")]
    Budget(&'static str),
    /// The deadline passed before the work started.
    #[error("the prefix identity deadline passed")]
    Deadline,
    /// The media positions in the rendered prompt could not be found.
    #[error("the media positions in the rendered prompt could not be found")]
    MediaLayout,
}

#[cfg(test)]
mod budget_tests;
#[cfg(test)]
mod byte_bpe_tests;
#[cfg(test)]
mod chunk_tests;
#[cfg(test)]
mod defer_tests;
#[cfg(test)]
pub(crate) mod tests;
