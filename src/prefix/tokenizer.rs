//! One model's tokenizer: renders chats, tokenizes with a per-segment cache, caps the work.
//!
//! **Segments.** A HF tokenizer first splits its input at added tokens (`<|im_start|>`...) and
//! tokenizes each piece between them independently, so a rendered prompt cut just before such a
//! token gives, piece by piece, exactly the ids of the whole. Each segment (an added token and
//! the text up to the next one) is cached by a hash of its text and whether it starts the prompt;
//! a system prompt shared by many requests is tokenized once. Cut points are only added tokens
//! that the tokenizer matches unnormalized and without stripping neighbouring whitespace; at load
//! a probe conversation is tokenized both ways and, if they differ, the model falls back to
//! whole-text tokenizing.
//!
//! **Cap.** At most `max_prefix_tokens` tokens are hashed. Text past a byte budget
//! (`MAX_BYTES_PER_TOKEN` bytes per remaining token) is not tokenized: its tokens are estimated
//! from the bytes-per-token ratio of what was, so a 16 MiB body costs bounded work. When the cut
//! falls inside a segment, the last `CUT_MARGIN_TOKENS` ids before it are dropped (a cut word may
//! tokenize differently from the whole).
//!
//! **Deadline.** A caller may give a deadline ([`ModelTokenizer::tokenize_chat_until`]): past it
//! before rendering (or before the media layout's render), nothing more is done
//! ([`PrefixError::Deadline`]: the caller uses the byte identity); past it between two segments, tokenizing stops there and the rest is estimated as
//! for the cap, so the request keeps the exact prefix tokenized so far (a prefix of what it would
//! have had: its leading block hashes still match) and [`PromptTokens::deadline_cut`] says so.
//!
//! **Media.** The token offset of each media message is found from one extra render (see
//! `super::media`), and converted from a byte offset while tokenizing: linear in the
//! conversation, however many images it has.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Tokenizer;

use super::byte_bpe::ByteLevelBpe;
use super::cache::{SegmentCache, SegmentKey};
use super::media::{self, MediaAt};
use super::template::{ChatTemplate, RenderLimits, TokenizerConfigFile};
use super::{estimate_tokens, PrefixError};
use crate::request::{ChatMessage, ChatOptions, ContentPart};

/// Bytes of text tokenized per token still wanted under the cap. Text averages 3-5 bytes per
/// token, so this almost always yields the full `max_prefix_tokens`.
pub const MAX_BYTES_PER_TOKEN: usize = 8;

/// Tokens dropped before a cut made inside a segment.
pub const CUT_MARGIN_TOKENS: usize = 64;

/// Bytes (at least) of a long segment between two chunk cuts. A long message (a pasted
/// document, a whole conversation sent as one message) is tokenized and cached in chunks of
/// about this size, cut only where the tokenizer's pre-tokenizer splits anyway: a request that
/// repeats its start (the next turn, the same document with a new question) takes all but the
/// last chunk from the cache, and the deadline can stop tokenizing between two chunks instead
/// of only between messages. ~1,000 tokens: an encode of a few ms at most.
pub const CHUNK_BYTES: usize = 4096;

/// A prompt's token ids (up to the cap) and its whole length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    /// Token ids of the prompt's start, exactly as the engine computes them; at most
    /// `max_prefix_tokens`.
    pub ids: Vec<u32>,
    /// Tokens in the whole prompt: exact when nothing was cut, else `ids` plus an estimate.
    pub total_tokens: u64,
    /// True when part of the prompt was estimated instead of tokenized.
    pub truncated: bool,
    /// True when the deadline stopped tokenizing early (then `truncated` is true too).
    pub deadline_cut: bool,
    /// Media content hashes with the token offset where the content of the message that carries
    /// them starts.
    pub media: Vec<(u64, u64)>,
    /// Set when tokenizing stopped at the first segment not in the token cache because enough of
    /// the prompt was (see [`ModelTokenizer::tokenize_chat_deferring`]): the rendered prompt, to
    /// tokenize whole after the decision. `ids` are then the exact cached prefix.
    pub deferred: Option<DeferredText>,
}

/// A rendered chat whose tokenizing stopped at `from` (a segment start, in bytes): what the
/// rest of the work needs.
#[derive(Clone, PartialEq, Eq)]
pub struct DeferredText {
    text: String,
    from: usize,
}

impl DeferredText {
    /// Bytes of rendered text not tokenized yet.
    pub fn untokenized_bytes(&self) -> usize {
        self.text.len() - self.from
    }

    /// Bytes of rendered text held (all of it).
    pub fn held_bytes(&self) -> usize {
        self.text.len()
    }
}

impl std::fmt::Debug for DeferredText {
    // Never the text.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredText")
            .field("bytes", &self.text.len())
            .field("from", &self.from)
            .finish()
    }
}

/// What bounds one tokenizing besides the cap.
#[derive(Debug, Clone, Copy, Default)]
struct Limits {
    /// Past it, stop at the next segment boundary.
    deadline: Option<Instant>,
    /// Stop at the first uncached segment once this fraction of the text is tokenized.
    defer: Option<f64>,
}

/// [`PromptTokens`] before the deferred text is attached: where tokenizing stopped, if it was
/// deferred.
struct Tokenized {
    ids: Vec<u32>,
    total_tokens: u64,
    truncated: bool,
    deadline_cut: bool,
    media: Vec<(u64, u64)>,
    deferred_from: Option<usize>,
}

impl From<Tokenized> for PromptTokens {
    fn from(t: Tokenized) -> PromptTokens {
        PromptTokens {
            ids: t.ids,
            total_tokens: t.total_tokens,
            truncated: t.truncated,
            deadline_cut: t.deadline_cut,
            media: t.media,
            deferred: None,
        }
    }
}

/// A loaded tokenizer with its chat template and segment cache.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// Finds every unnormalized added token, as the tokenizer's own splitter does.
    added: Option<AhoCorasick>,
    /// Per automaton pattern: may a segment start there?
    cut_here: Vec<bool>,
    segments_verified: bool,
    /// Long segments are cut in chunks at word boundaries (the load-time check passed).
    chunks_verified: bool,
    /// Least bytes between two chunk cuts ([`CHUNK_BYTES`]; tests set less).
    chunk_bytes: usize,
    cache: SegmentCache,
    max_prefix_tokens: usize,
    /// The ids-only path of a byte-level BPE tokenizer, when it has that shape and agreed with
    /// the HF tokenizer on the probe texts at load.
    fast: Option<ByteLevelBpe>,
    /// The ids the post-processor puts before and after a text's own (BOS...), when the
    /// ids-only path is on and the probe texts showed it does nothing else: completion prompts
    /// (special tokens added) take the ids-only path too.
    special_wrap: Option<(Vec<u32>, Vec<u32>)>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("has_template", &self.template.is_some())
            .field("segments_verified", &self.segments_verified)
            .field("chunks_verified", &self.chunks_verified)
            .field("cache", &self.cache)
            .field("max_prefix_tokens", &self.max_prefix_tokens)
            .field("fast", &self.fast)
            .finish()
    }
}

/// Where a model's tokenizer files are.
#[derive(Debug, Clone, Default)]
pub struct TokenizerFiles<'a> {
    /// `tokenizer.json`.
    pub tokenizer_json: Option<&'a Path>,
    /// `tokenizer_config.json` (special tokens, and the chat template unless given apart).
    pub tokenizer_config: Option<&'a Path>,
    /// A `.jinja` chat template, overriding the one in `tokenizer_config.json`.
    pub chat_template: Option<&'a Path>,
}

impl ModelTokenizer {
    /// Loads a tokenizer with the default [`RenderLimits`]. `field` is the config path named in
    /// errors (`models[0]`).
    pub fn load(
        files: &TokenizerFiles<'_>,
        max_prefix_tokens: usize,
        cache_tokens: usize,
        field: &str,
    ) -> Result<ModelTokenizer, PrefixError> {
        Self::load_with_limits(
            files,
            max_prefix_tokens,
            cache_tokens,
            RenderLimits::default(),
            field,
        )
    }

    /// Loads a tokenizer whose chat-template renders are bounded by `render`.
    pub fn load_with_limits(
        files: &TokenizerFiles<'_>,
        max_prefix_tokens: usize,
        cache_tokens: usize,
        render: RenderLimits,
        field: &str,
    ) -> Result<ModelTokenizer, PrefixError> {
        let json_path = files.tokenizer_json.ok_or_else(|| PrefixError::Load {
            field: format!("{field}.tokenizer"),
            path: String::new(),
            message: "no tokenizer.json given".into(),
        })?;
        let bytes = std::fs::read(json_path).map_err(|e| PrefixError::Load {
            field: format!("{field}.tokenizer"),
            path: json_path.display().to_string(),
            message: e.to_string(),
        })?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| PrefixError::Load {
            field: format!("{field}.tokenizer"),
            path: json_path.display().to_string(),
            message: format!("not a tokenizer.json: {e}"),
        })?;
        // A tokenizer.json may carry truncation/padding settings; the engine tokenizes prompts
        // without them.
        tokenizer
            .with_truncation(None)
            .map_err(|e| PrefixError::Load {
                field: format!("{field}.tokenizer"),
                path: json_path.display().to_string(),
                message: e.to_string(),
            })?
            .with_padding(None);

        let config = match files.tokenizer_config {
            Some(p) => TokenizerConfigFile::read(p, &format!("{field}.tokenizer_config"))?,
            None => TokenizerConfigFile::default(),
        };
        let source = match files.chat_template {
            Some(p) => Some(super::template::read_template(
                p,
                &format!("{field}.chat_template"),
            )?),
            None => config.chat_template.clone(),
        };
        let template = source
            .map(|s| {
                ChatTemplate::new(s, &config, render).map_err(|e| PrefixError::Load {
                    field: format!("{field}.chat_template"),
                    path: files
                        .chat_template
                        .or(files.tokenizer_config)
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    message: format!("the chat template does not compile: {e}"),
                })
            })
            .transpose()?;

        let (added, cut_here) = added_token_automaton(&tokenizer);
        let fast = ByteLevelBpe::new(&tokenizer);
        let mut model = ModelTokenizer {
            tokenizer,
            template,
            added,
            cut_here,
            segments_verified: false,
            chunks_verified: false,
            chunk_bytes: CHUNK_BYTES,
            cache: SegmentCache::new(cache_tokens),
            max_prefix_tokens: max_prefix_tokens.max(1),
            fast: None,
            special_wrap: None,
        };
        model.fast = fast.filter(|f| model.verify_fast(f, json_path));
        model.special_wrap = model.fast.as_ref().and_then(|_| model.find_special_wrap());
        model.segments_verified = model.verify_segments();
        model.chunks_verified = model.segments_verified && model.verify_chunks();
        Ok(model)
    }

    /// True when the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// True when prompts are tokenized segment by segment with the cache (the load-time check
    /// passed); false means whole-text tokenizing.
    pub fn uses_segment_cache(&self) -> bool {
        self.segments_verified
    }

    /// True when long segments are also cut in chunks of about [`CHUNK_BYTES`] (the load-time
    /// check passed: the tokenizer splits words apart before merging, as byte-level BPE
    /// tokenizers such as Llama 3's and Qwen's do).
    pub fn uses_chunks(&self) -> bool {
        self.chunk_size().is_some()
    }

    /// The least bytes between two chunk cuts, when long segments are cut at all.
    fn chunk_size(&self) -> Option<usize> {
        Some(self.chunk_bytes).filter(|&b| b > 0 && self.chunks_verified)
    }

    /// Cuts long segments every `bytes` or so instead of every [`CHUNK_BYTES`]
    /// (`models[].chunk_bytes`); 0 never cuts inside a segment.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = bytes;
    }

    /// The most tokens hashed per prompt.
    pub fn max_prefix_tokens(&self) -> usize {
        self.max_prefix_tokens
    }

    /// Segments and token ids held by the cache.
    pub fn cache_stats(&self) -> (usize, usize) {
        (self.cache.len(), self.cache.cached_tokens())
    }

    /// Renders `messages` with the chat template (generation prompt on) and tokenizes the result
    /// without adding special tokens, as vLLM does for chat requests.
    pub fn tokenize_chat(&self, messages: &[ChatMessage<'_>]) -> Result<PromptTokens, PrefixError> {
        self.tokenize_chat_until(messages, None)
    }

    /// [`Self::tokenize_chat`] within a deadline (see the module doc). Errors: no template, the
    /// template failed or ran out of its render limits ([`PrefixError::Budget`]), the deadline
    /// had passed before rendering, or the media layout could not be found
    /// ([`PrefixError::MediaLayout`]).
    pub fn tokenize_chat_until(
        &self,
        messages: &[ChatMessage<'_>],
        deadline: Option<Instant>,
    ) -> Result<PromptTokens, PrefixError> {
        self.tokenize_chat_deferring(messages, &ChatOptions::default(), deadline, None)
    }

    /// [`Self::tokenize_chat_until`] that may leave the new text for later: with
    /// `defer_after` = `Some(f)`, once `f` of the rendered prompt's bytes is tokenized (from
    /// the cache or just now), tokenizing stops at the next segment the token cache does not
    /// hold. The ids are then an exact prefix (their block hashes a prefix of the whole's),
    /// the rest of the count is estimated at the tokenized part's bytes per token, and
    /// [`PromptTokens::deferred`] carries the rendered prompt for [`Self::tokenize_deferred`].
    /// Not with media (their token offsets come from tokenizing) or without the segment cache.
    ///
    /// Why: the text a router has never seen (a new user turn, the previous answer) is what
    /// costs (~2 us a word here), and it can only match an engine's cache if the prefix before
    /// it does. A candidate holding the new text too (a retry, another router's request) is
    /// under-credited by at most its length: the cost of deciding without waiting for it.
    ///
    /// `options` are the request's template inputs beside the messages (tools, documents,
    /// template kwargs, generation prompt), rendered as vLLM renders them.
    pub fn tokenize_chat_deferring(
        &self,
        messages: &[ChatMessage<'_>],
        options: &ChatOptions,
        deadline: Option<Instant>,
        defer_after: Option<f64>,
    ) -> Result<PromptTokens, PrefixError> {
        let template = self.template.as_ref().ok_or(PrefixError::NoChatTemplate)?;
        if past(deadline) {
            return Err(PrefixError::Deadline);
        }
        let text = template
            .render_request(messages, options)
            .map_err(template_error)?;
        let media = if messages.iter().any(ChatMessage::has_media) {
            // The media layout costs a second render: not past the deadline.
            if past(deadline) {
                return Err(PrefixError::Deadline);
            }
            media::locate(template, messages, options, &text)
                .map_err(template_error)?
                .ok_or(PrefixError::MediaLayout)?
        } else {
            Vec::new()
        };
        let limits = Limits {
            deadline,
            defer: defer_after,
        };
        self.tokenize_rendered(text, limits, &media)
    }

    /// Tokenizes a rendered chat (`text`), with the text left for later attached when
    /// tokenizing stopped early for `limits.defer` (not with media or without segments).
    fn tokenize_rendered(
        &self,
        text: String,
        limits: Limits,
        media: &[MediaAt],
    ) -> Result<PromptTokens, PrefixError> {
        let limits = Limits {
            defer: limits
                .defer
                .filter(|_| media.is_empty() && self.segments_verified),
            ..limits
        };
        let tokenized = self.tokenize_inner(&text, false, self.segments_verified, limits, media)?;
        let from = tokenized.deferred_from;
        let mut tokens = PromptTokens::from(tokenized);
        tokens.deferred = from.map(|from| DeferredText { text, from });
        Ok(tokens)
    }

    /// The whole prompt of a deferred tokenizing (through the token cache, which it fills for
    /// the requests that follow): what [`Self::tokenize_chat_until`] would have given.
    pub fn tokenize_deferred(&self, deferred: &DeferredText) -> Result<PromptTokens, PrefixError> {
        self.tokenize_inner(&deferred.text, false, true, Limits::default(), &[])
            .map(Into::into)
    }

    /// Tokenizes a completion prompt, adding special tokens (BOS...) as vLLM does by default.
    pub fn tokenize_text(&self, text: &str) -> Result<PromptTokens, PrefixError> {
        self.tokenize_inner(text, true, false, Limits::default(), &[])
            .map(Into::into)
    }

    /// [`Self::tokenize_text`] within a deadline: past it before tokenizing,
    /// [`PrefixError::Deadline`] (the text is one piece, tokenized at once, at most
    /// `max_prefix_tokens * MAX_BYTES_PER_TOKEN` bytes of it).
    pub fn tokenize_text_until(
        &self,
        text: &str,
        deadline: Option<Instant>,
    ) -> Result<PromptTokens, PrefixError> {
        if past(deadline) {
            return Err(PrefixError::Deadline);
        }
        self.tokenize_text(text)
    }

    /// Tokenizes `text`, through the segment cache when `segmented` (only without special tokens:
    /// a post-processor applies to the whole). Only tests call it: the request path goes through
    /// the budgeted entry points above.
    #[cfg(test)]
    pub(crate) fn tokenize(
        &self,
        text: &str,
        add_special_tokens: bool,
        segmented: bool,
    ) -> Result<PromptTokens, PrefixError> {
        self.tokenize_inner(text, add_special_tokens, segmented, Limits::default(), &[])
            .map(Into::into)
    }

    /// Tokenizes `text`; `media` (byte offsets into `text`, any order) come back as token
    /// offsets. Media past the tokenized part are left out: their blocks are not hashed.
    fn tokenize_inner(
        &self,
        text: &str,
        add_special_tokens: bool,
        segmented: bool,
        limits: Limits,
        media: &[MediaAt],
    ) -> Result<Tokenized, PrefixError> {
        let Limits { deadline, defer } = limits;
        let cap = self.max_prefix_tokens;
        let mut ids: Vec<u32> = Vec::new();
        let mut consumed = 0usize; // bytes of `text` tokenized
        let mut cut = false;
        let mut deadline_cut = false;
        let mut deferred_from = None;
        let mut media_tokens: Vec<(u64, u64)> = Vec::with_capacity(media.len());
        let mut pending: Vec<MediaAt> = media.to_vec();
        pending.sort_unstable_by_key(|&(at, _)| std::cmp::Reverse(at));
        if segmented && !add_special_tokens {
            for (start, end) in self.pieces(text, self.chunk_size()) {
                if ids.len() >= cap {
                    break;
                }
                if start > 0 && past(deadline) {
                    // At a segment or chunk boundary: the ids so far are exact, no margin to
                    // drop. When the caller defers, the rest is left for after the decision as
                    // deferred text is (not with media: their offsets come from here).
                    deadline_cut = true;
                    if defer.is_some() && media.is_empty() {
                        deferred_from = Some(start);
                    }
                    break;
                }
                let segment = &text[start..end];
                let budget = (cap - ids.len()) * MAX_BYTES_PER_TOKEN;
                if segment.len() > budget {
                    let piece = &segment[..floor_char_boundary(segment, budget)];
                    self.media_in(
                        &mut pending,
                        start,
                        start + piece.len(),
                        piece,
                        ids.len(),
                        &mut media_tokens,
                    )?;
                    ids.extend(self.encode(piece, false)?);
                    consumed += piece.len();
                    cut = true;
                    break;
                }
                self.media_in(
                    &mut pending,
                    start,
                    end,
                    segment,
                    ids.len(),
                    &mut media_tokens,
                )?;
                let key = SegmentKey::new(u8::from(start == 0), segment);
                match self.cache.get(&key) {
                    Some(hit) => ids.extend_from_slice(&hit),
                    None if defer
                        .is_some_and(|f| start > 0 && start as f64 >= f * text.len() as f64) =>
                    {
                        // Enough is known: the new text is left for after the decision.
                        deferred_from = Some(start);
                        break;
                    }
                    None => {
                        let fresh: Arc<[u32]> = self.encode(segment, false)?.into();
                        self.cache.insert(key, Arc::clone(&fresh));
                        ids.extend_from_slice(&fresh);
                    }
                }
                consumed = end;
            }
        } else {
            let budget = cap * MAX_BYTES_PER_TOKEN;
            let piece = &text[..floor_char_boundary(text, budget)];
            if pending.is_empty() {
                ids = self.encode(piece, add_special_tokens)?;
            } else {
                // One pass with byte offsets maps every media position to a token index: the
                // tokens that end at or before it.
                let encoding = self
                    .tokenizer
                    .encode(piece, add_special_tokens)
                    .map_err(|e| PrefixError::Tokenize(e.to_string()))?;
                let offsets = encoding.get_offsets();
                while let Some(&(at, h)) = pending.last() {
                    if at >= piece.len() {
                        break;
                    }
                    pending.pop();
                    let index = offsets.partition_point(|&(_, end)| end <= at);
                    media_tokens.push((index as u64, h));
                }
                ids = encoding.get_ids().to_vec();
            }
            consumed = piece.len();
            cut = piece.len() < text.len();
        }
        let remainder = text.len() - consumed;
        let tokenized = ids.len() as u64;
        if cut {
            ids.truncate(ids.len().saturating_sub(CUT_MARGIN_TOKENS));
        }
        let estimated = match (remainder, consumed) {
            (0, _) => 0,
            (r, 0) => estimate_tokens(r),
            // Same bytes-per-token ratio as the tokenized part.
            (r, c) => (r as u64 * tokenized).div_ceil(c as u64),
        };
        ids.truncate(cap);
        Ok(Tokenized {
            ids,
            total_tokens: tokenized + estimated,
            truncated: remainder > 0,
            deadline_cut: deadline_cut && remainder > 0,
            media: media_tokens,
            deferred_from,
        })
    }

    /// Renders `messages` with the chat template (tests).
    #[cfg(test)]
    pub(crate) fn render_for_test(
        &self,
        messages: &[ChatMessage<'_>],
    ) -> Result<String, PrefixError> {
        let template = self.template.as_ref().ok_or(PrefixError::NoChatTemplate)?;
        template.render(messages).map_err(template_error)
    }

    /// Renders and tokenizes `messages` as one text, without segments, chunks or the cache:
    /// the reference the cached paths must equal (tests).
    #[cfg(test)]
    pub(crate) fn tokenize_chat_whole_for_test(
        &self,
        messages: &[ChatMessage<'_>],
    ) -> Result<PromptTokens, PrefixError> {
        let text = self.render_for_test(messages)?;
        self.tokenize_inner(&text, false, false, Limits::default(), &[])
            .map(Into::into)
    }

    /// Tokenizes an already rendered chat as routing does (`defer` the fraction of
    /// `models[].defer_tokenizing_after`), the deferred text attached (tests).
    #[cfg(test)]
    pub(crate) fn tokenize_rendered_deferring_for_test(
        &self,
        text: &str,
        deadline: Option<Instant>,
        defer: f64,
    ) -> Result<PromptTokens, PrefixError> {
        let limits = Limits {
            deadline,
            defer: Some(defer),
        };
        self.tokenize_rendered(text.to_string(), limits, &[])
    }

    /// Tokenizes an already rendered chat (tests).
    #[cfg(test)]
    pub(crate) fn tokenize_inner_for_test(
        &self,
        text: &str,
        segmented: bool,
        deadline: Option<Instant>,
        media: &[MediaAt],
    ) -> Result<PromptTokens, PrefixError> {
        let limits = Limits {
            deadline,
            defer: None,
        };
        self.tokenize_inner(text, false, segmented, limits, media)
            .map(Into::into)
    }

    /// Moves the media of `pending` (sorted by descending offset) that fall in the segment
    /// `[start, end)` to `out` as token offsets: the tokens before the segment plus those of the
    /// segment's text up to the media's position (usually just the message header, cached).
    fn media_in(
        &self,
        pending: &mut Vec<MediaAt>,
        start: usize,
        end: usize,
        segment: &str,
        tokens_before: usize,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), PrefixError> {
        let here = pending
            .iter()
            .rev()
            .take_while(|&&(at, _)| at < end)
            .count();
        if here > 1 {
            // Several media in one segment (a template with no cut between messages): one
            // pass with byte offsets maps them all, as the unsegmented path does. Encoding each
            // one's head alone was quadratic in the media per segment, and filled the cache
            // with heads no other request shares.
            let encoding = self
                .tokenizer
                .encode(segment, false)
                .map_err(|e| PrefixError::Tokenize(e.to_string()))?;
            let offsets = encoding.get_offsets();
            for _ in 0..here {
                let Some((at, h)) = pending.pop() else { break };
                let within = at.saturating_sub(start);
                let index = offsets.partition_point(|&(_, e)| e <= within);
                out.push(((tokens_before + index) as u64, h));
            }
            return Ok(());
        }
        while let Some(&(at, h)) = pending.last() {
            if at >= end {
                break;
            }
            pending.pop();
            let within = at.saturating_sub(start);
            let head = &segment[..floor_char_boundary(segment, within)];
            let head_tokens = if head.is_empty() {
                0
            } else {
                // Context 2: a segment's head, never confused with a whole segment.
                let key = SegmentKey::new(2 + u8::from(start == 0), head);
                self.cached_encode(key, head)?.len()
            };
            out.push(((tokens_before + head_tokens) as u64, h));
        }
        Ok(())
    }

    /// The ids of `segment`, from the cache or freshly encoded (and cached).
    fn cached_encode(&self, key: SegmentKey, segment: &str) -> Result<Arc<[u32]>, PrefixError> {
        Ok(match self.cache.get(&key) {
            Some(hit) => hit,
            None => {
                let fresh: Arc<[u32]> = self.encode(segment, false)?.into();
                self.cache.insert(key, Arc::clone(&fresh));
                fresh
            }
        })
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PrefixError> {
        self.fast_encode(text, add_special_tokens)
            .unwrap_or_else(|| self.hf_encode(text, add_special_tokens))
    }

    /// The ids of `text` from the ids-only path, when it serves this call: the path is on and,
    /// with special tokens, the post-processor's wrap is known.
    fn fast_encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Option<Result<Vec<u32>, PrefixError>> {
        let fast = self.fast.as_ref()?;
        let (before, after): (&[u32], &[u32]) = match (add_special_tokens, &self.special_wrap) {
            (false, _) => (&[], &[]),
            (true, Some((before, after))) => (before, after),
            (true, None) => return None,
        };
        let mut ids = before.to_vec();
        Some(
            fast.encode_into(&self.tokenizer, text, &mut ids)
                .map(|()| {
                    ids.extend_from_slice(after);
                    ids
                })
                .map_err(PrefixError::Tokenize),
        )
    }

    /// The ids of `text` from the HF tokenizer itself.
    fn hf_encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PrefixError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| PrefixError::Tokenize(e.to_string()))
    }

    /// Byte ranges of the segments of `text`: each starts at a cut-point added token (the first
    /// may start at 0 without one) and runs to the next.
    fn segments<'t>(&'t self, text: &'t str) -> impl Iterator<Item = (usize, usize)> + 't {
        let mut starts: Vec<usize> = vec![0];
        if let Some(ac) = &self.added {
            starts.extend(
                ac.find_iter(text)
                    .filter(|m| self.cut_here[m.pattern().as_usize()] && m.start() > 0)
                    .map(|m| m.start()),
            );
        }
        let ends: Vec<usize> = starts.iter().skip(1).copied().chain([text.len()]).collect();
        starts.into_iter().zip(ends).filter(|(s, e)| e > s)
    }

    /// The segments of `text` ([`Self::segments`]), each long one cut in chunks of at least
    /// `chunk_bytes` at [`chunk_cut`]s (`None`: not cut).
    fn pieces<'t>(
        &'t self,
        text: &'t str,
        chunk_bytes: Option<usize>,
    ) -> impl Iterator<Item = (usize, usize)> + 't {
        self.segments(text).flat_map(move |(start, end)| {
            // From `at`: a chunk up to the next cut, else the segment's tail, then nothing.
            let mut at = Some(start);
            std::iter::from_fn(move || {
                let from = at?;
                let cut = chunk_bytes
                    .and_then(|b| chunk_cut(text.as_bytes(), from.saturating_add(b), end));
                at = cut;
                Some((from, cut.unwrap_or(end)))
            })
        })
    }

    /// Tokenizes the probe texts whole and cut at every chunk cut; true when they agree (and
    /// there were cuts to try).
    fn verify_chunks(&self) -> bool {
        let mut probes = probe_texts(self.template.as_ref());
        probes.push(CHUNK_PROBE.to_string());
        let mut cuts = 0;
        let agree = probes.iter().all(|text| {
            let pieces: Vec<_> = self.pieces(text, Some(1)).collect();
            cuts += pieces.len() - self.segments(text).count();
            let mut by_chunks = Vec::new();
            for (s, e) in pieces {
                match self.encode(&text[s..e], false) {
                    Ok(ids) => by_chunks.extend(ids),
                    Err(_) => return false,
                }
            }
            self.encode(text, false).is_ok_and(|w| w == by_chunks)
        });
        agree && cuts > 0
    }

    /// True when `fast` gives the HF tokenizer's ids for every probe text (see [`FAST_PROBE`]):
    /// a tokenizer whose pipeline looks byte-level but behaves otherwise keeps the HF path.
    pub(super) fn verify_fast(&self, fast: &ByteLevelBpe, path: &Path) -> bool {
        let mut probes = self.fast_probes();
        // Every added token, between text and beside one another.
        let mut added = self.added_token_contents();
        added.sort();
        probes.extend(
            added
                .chunks(64)
                .map(|c| format!("x{} y{}z ", c.join(" a"), c.join(""))),
        );
        let agree = probes.iter().all(|text| {
            let mut ids = Vec::new();
            let fast = fast
                .encode_into(&self.tokenizer, text, &mut ids)
                .map(|()| ids);
            matches!((self.hf_encode(text, false), fast), (Ok(hf), Ok(fast)) if hf == fast)
        });
        if !agree {
            tracing::warn!(
                tokenizer = %path.display(),
                "the ids-only byte-level path disagrees with the tokenizer on a probe text: \
                 this model tokenizes through the HF tokenizer's full path (slower on long prompts)"
            );
        }
        agree
    }

    /// What the post-processor adds around a text's ids when special tokens are added, if that
    /// is all it does on every probe text (`None`: completion prompts take the HF path).
    fn find_special_wrap(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
        for text in self.fast_probes() {
            let own = self.hf_encode(&text, false).ok()?;
            let all = self.hf_encode(&text, true).ok()?;
            let extra = all.len().checked_sub(own.len())?;
            let k = (0..=extra).find(|&k| all[k..k + own.len()] == own[..])?;
            let wrap = (all[..k].to_vec(), all[k + own.len()..].to_vec());
            if *found.get_or_insert_with(|| wrap.clone()) != wrap {
                return None;
            }
        }
        found
    }

    /// The texts the ids-only path is checked on at load: the segment probes, the chunk probe
    /// and [`FAST_PROBE`].
    fn fast_probes(&self) -> Vec<String> {
        let mut probes = probe_texts(self.template.as_ref());
        probes.push(CHUNK_PROBE.to_string());
        probes.push(FAST_PROBE.to_string());
        probes
    }

    /// The contents of the tokenizer's added tokens.
    pub(crate) fn added_token_contents(&self) -> Vec<String> {
        self.tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect()
    }

    /// `text`'s ids from the HF tokenizer and, when this model has it, from the ids-only path.
    #[cfg(test)]
    pub(crate) fn encode_both_ways(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> (Vec<u32>, Option<Vec<u32>>) {
        (
            self.hf_encode(text, add_special_tokens)
                .expect("the HF tokenizer encodes"),
            self.fast_encode(text, add_special_tokens)
                .map(|r| r.expect("the fast path encodes")),
        )
    }

    /// Words in the ids-only path's word cache (0 without the path).
    #[cfg(test)]
    pub(crate) fn cached_words(&self) -> usize {
        self.fast.as_ref().map_or(0, ByteLevelBpe::cached_words)
    }

    /// True when completion prompts (special tokens added) take the ids-only path too.
    #[cfg(test)]
    pub(crate) fn wraps_specials(&self) -> bool {
        self.special_wrap.is_some()
    }

    /// The ids-only encoder built for `other`'s tokenizer file, to check against this model.
    #[cfg(test)]
    pub(crate) fn fast_encoder_of(other: &ModelTokenizer) -> Option<ByteLevelBpe> {
        ByteLevelBpe::new(&other.tokenizer)
    }

    /// True when prompts are tokenized by the ids-only byte-level path (see
    /// `super::byte_bpe`).
    pub fn uses_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Tokenizes a probe conversation whole and by segments; true when they agree.
    fn verify_segments(&self) -> bool {
        if self.added.is_none() || !self.cut_here.iter().any(|&c| c) {
            return false;
        }
        let probes = probe_texts(self.template.as_ref());
        probes.iter().all(|text| {
            let whole = self.encode(text, false);
            let mut by_segments = Vec::new();
            for (s, e) in self.segments(text) {
                match self.encode(&text[s..e], false) {
                    Ok(ids) => by_segments.extend(ids),
                    Err(_) => return false,
                }
            }
            whole.is_ok_and(|w| w == by_segments)
        })
    }
}

fn template_error(e: minijinja::Error) -> PrefixError {
    match e.kind() {
        minijinja::ErrorKind::OutOfFuel => PrefixError::Budget("template fuel"),
        // Only the capped output writer fails a write.
        minijinja::ErrorKind::WriteFailure => PrefixError::Budget("rendered prompt size"),
        // The template's own message (e.g. from raise_exception) quotes template text, not
        // content.
        _ => PrefixError::Template(e.to_string()),
    }
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// An automaton over the tokenizer's unnormalized added tokens, leftmost-longest like its own
/// splitter, and which of them are safe cut points (no whitespace stripping, not word-bound).
fn added_token_automaton(tokenizer: &Tokenizer) -> (Option<AhoCorasick>, Vec<bool>) {
    let mut tokens: Vec<_> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .filter(|t| !t.normalized && !t.content.is_empty())
        .collect();
    tokens.sort_by(|a, b| a.content.cmp(&b.content));
    let cut_here = tokens
        .iter()
        .map(|t| !t.lstrip && !t.rstrip && !t.single_word)
        .collect();
    let ac = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|t| t.content.as_str()))
        .ok()
        .filter(|_| !tokens.is_empty());
    (ac, cut_here)
}

/// Texts that exercise segment boundaries: a rendered conversation (when there is a template)
/// and raw text with tricky whitespace, digits, punctuation and non-ASCII.
fn probe_texts(template: Option<&ChatTemplate>) -> Vec<String> {
    use std::borrow::Cow;
    let text = |s: &'static str| vec![ContentPart::Text(Cow::Borrowed(s))];
    let conversation = [
        ChatMessage {
            role: Cow::Borrowed("system"),
            content: text("  You are terse.\n\n Answer in 3 words; cite [1]. "),
            extra: None,
        },
        ChatMessage {
            role: Cow::Borrowed("user"),
            content: text("Hello,   world!\tNaïve café — 東京 123456 😀\n"),
            extra: None,
        },
        ChatMessage {
            role: Cow::Borrowed("assistant"),
            content: text(" Fine, thanks.  "),
            extra: None,
        },
        ChatMessage {
            role: Cow::Borrowed("user"),
            content: text("\n\nAnd now?"),
            extra: None,
        },
    ];
    let mut out = Vec::new();
    if let Some(t) = template {
        if let Ok(rendered) = t.render(&conversation) {
            out.push(rendered);
        }
    }
    out.push(" leading space and\n\nnewlines  \t end ".to_string());
    out
}

/// Text with many chunk cuts in the contexts that could tell a tokenizer's word splitting apart
/// from a cut: contractions, capitals, digits, punctuation, non-ASCII letters next to a cut.
const CHUNK_PROBE: &str = "It's a test of the cut rule: we'll see if Words split here. \
    Numbers 12 and 345 sit beside words, x86 word5 H100 a1b2 x y z, CamelCase Words, don't stop now! \
    Café au lait, naïve résumé and Zürich are words too; the end came (at last) here \
    and a b c d e f g h i j k l m n o p q r s t u v w x y z then THE END is near";

/// Text for the load-time check of the ids-only path: scripts, digits, punctuation runs,
/// contractions in both cases, whitespace runs before words and at the end, control and
/// combining characters, emoji with joiners, bytes that are not printable Latin-1.
const FAST_PROBE: &str = "I'm HERE, you'RE there; they'll've gone.  Don't\tSTOP!!!\r\n\r\n  \
    Numbers: 1234567 3.14159 -42 1e9 ٣٤٥ ௧௨ Ⅻ ½. Code: fn main() { let x_1 = a->b[0] >= 2; } \
    // comment /* c */ #include <stdio.h> $PATH ~/x.rs @user #tag 100% 50/50 <<<>>> ... --- === \
    Ελληνικά кириллица العربية עברית हिन्दी ไทย 한국어 日本語のテキスト 中文文本 \
    café naïve Zürich e\u{301} a\u{308} Å Å ﬁ ① ｆｕｌｌ \u{0}\u{7}\u{1b}[0m \u{a0}nbsp\u{2003}em \
    😀 👩‍👩‍👧 🇫🇷 ✈️ \u{fffd} \u{10ffff}   \n\n\n   trailing   ";

/// The first chunk cut of `text[..end]` at or after `from`: a position `p` with an ASCII letter
/// or digit before it, then a single space and an ASCII letter (`...word5| word...`). The
/// byte-level BPE pre-tokenizers (GPT-2's, Llama 3's, Qwen's) end a word or number at `p` and
/// start the next match at its space, so the two sides tokenize as they do within the whole;
/// whether a tokenizer does is checked at load ([`ModelTokenizer::uses_chunks`]).
fn chunk_cut(text: &[u8], from: usize, end: usize) -> Option<usize> {
    let from = from.max(1);
    if end < 2 || from > end - 2 {
        return None;
    }
    (from..end - 1).find(|&p| {
        text[p] == b' ' && text[p - 1].is_ascii_alphanumeric() && text[p + 1].is_ascii_alphabetic()
    })
}

/// The largest char boundary of `s` at or below `at`.
fn floor_char_boundary(s: &str, at: usize) -> usize {
    if at >= s.len() {
        return s.len();
    }
    let mut i = at;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_char_boundary_never_splits_a_char() {
        let s = "aé東";
        assert_eq!(floor_char_boundary(s, 0), 0);
        assert_eq!(floor_char_boundary(s, 1), 1);
        assert_eq!(floor_char_boundary(s, 2), 1);
        assert_eq!(floor_char_boundary(s, 3), 3);
        assert_eq!(floor_char_boundary(s, 5), 3);
        assert_eq!(floor_char_boundary(s, 6), 6);
        assert_eq!(floor_char_boundary(s, 99), 6);
    }
}
