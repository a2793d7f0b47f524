//! The tokenizer registry: one [`ModelTokenizer`] per configured model, and
//! [`TokenizerRegistry::identify`], which turns a parsed request into its [`PrefixIdentity`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::bytes::byte_block_hashes;
use super::hash::{BlockHasher, Namespace};
use super::template::RenderLimits;
use super::tokenizer::{DeferredText, ModelTokenizer, PromptTokens, TokenizerFiles};
use super::{estimate_tokens, Fallback, PrefixError, PrefixIdentity};
use crate::config::ModelConfig;
use crate::request::{ParsedRequest, Prompt, PromptInput};

/// Block size for models without a config entry, in tokens.
pub const DEFAULT_BLOCK_SIZE_TOKENS: u32 = 16;
/// `max_prefix_tokens` for models without a config entry.
pub const DEFAULT_MAX_PREFIX_TOKENS: u32 = 32_768;

#[derive(Debug)]
struct ModelEntry {
    config: ModelConfig,
    tokenizer: Option<ModelTokenizer>,
}

/// Tokenizers and block settings per model, built from config. Cheap to share (`Arc` it);
/// every method takes `&self` and is safe to call concurrently.
#[derive(Debug, Default)]
pub struct TokenizerRegistry {
    models: HashMap<String, Arc<ModelEntry>>,
    base_dir: PathBuf,
}

impl TokenizerRegistry {
    /// A registry with no models: every model uses the byte estimate and default block size.
    pub fn empty() -> TokenizerRegistry {
        TokenizerRegistry::default()
    }

    /// Loads every configured model's tokenizer. Relative paths resolve against `base_dir` (the
    /// config file's directory). Errors name the config field (`models[2].tokenizer`).
    pub fn from_config(
        models: &[ModelConfig],
        base_dir: &Path,
    ) -> Result<TokenizerRegistry, PrefixError> {
        TokenizerRegistry::empty().rebuild(models, base_dir)
    }

    /// A registry for a reloaded config, reusing the loaded tokenizers (and warm token caches) of
    /// models whose settings did not change.
    pub fn rebuild(
        &self,
        models: &[ModelConfig],
        base_dir: &Path,
    ) -> Result<TokenizerRegistry, PrefixError> {
        let mut out = HashMap::new();
        for (i, config) in models.iter().enumerate() {
            let reuse = self
                .models
                .get(&config.name)
                .filter(|e| e.config == *config && self.base_dir == base_dir);
            let entry = match reuse {
                Some(e) => Arc::clone(e),
                None => Arc::new(load_model(config, base_dir, &format!("models[{i}]"))?),
            };
            out.insert(config.name.clone(), entry);
        }
        Ok(TokenizerRegistry {
            models: out,
            base_dir: base_dir.to_path_buf(),
        })
    }

    /// The tokenizer of `model`, if one is configured.
    pub fn tokenizer(&self, model: &str) -> Option<&ModelTokenizer> {
        self.models.get(model)?.tokenizer.as_ref()
    }

    /// Tokens per block for `model` (default 16).
    pub fn block_size_tokens(&self, model: &str) -> u32 {
        self.models
            .get(model)
            .map_or(DEFAULT_BLOCK_SIZE_TOKENS, |e| {
                e.config.block_size_tokens.max(1)
            })
    }

    /// Most prompt tokens hashed for `model` (default 32768).
    pub fn max_prefix_tokens(&self, model: &str) -> u32 {
        self.models
            .get(model)
            .map_or(DEFAULT_MAX_PREFIX_TOKENS, |e| e.config.max_prefix_tokens)
    }

    /// The block hasher for `ns` (its model's block size), e.g. to re-hash an engine's
    /// `BlockStored` token ids in the request's namespace.
    pub fn hasher(&self, ns: &Namespace) -> BlockHasher {
        BlockHasher::new(ns, self.block_size_tokens(ns.model()))
    }

    /// The prompt's length and block hashes in `ns` (whose model selects the tokenizer).
    ///
    /// Never fails: without a tokenizer, or when the chat cannot be rendered or tokenized, the
    /// byte estimate is used and `fallback` says why. Batch prompts (`prompt: [..]`) hash their
    /// first element and count all (later elements by estimate, token lists exactly).
    pub fn identify(&self, request: &ParsedRequest<'_>, ns: &Namespace) -> PrefixIdentity {
        self.identify_until(request, ns, None)
    }

    /// [`Self::identify`] within a deadline: if it has passed before the prompt is rendered,
    /// the byte estimate (`fallback` = [`Fallback::Deadline`]); if it passes while tokenizing,
    /// the exact prefix tokenized so far (`deadline_cut`). Either way the call returns at about
    /// the deadline plus one segment's tokenizing, never an error. The result's
    /// [`PrefixIdentity::source`] says which identity it is.
    pub fn identify_until(
        &self,
        request: &ParsedRequest<'_>,
        ns: &Namespace,
        deadline: Option<Instant>,
    ) -> PrefixIdentity {
        self.identify_inner(request, ns, deadline, false)
    }

    /// [`Self::identify_until`] as routing uses it: a chat may be identified by the prefix
    /// tokenized once the model's `defer_tokenizing_after` fraction of it is, and the rest of
    /// the work handed back in [`PrefixIdentity::deferred`] (see
    /// [`ModelTokenizer::tokenize_chat_deferring`]).
    pub fn identify_for_routing(
        &self,
        request: &ParsedRequest<'_>,
        ns: &Namespace,
        deadline: Option<Instant>,
    ) -> PrefixIdentity {
        self.identify_inner(request, ns, deadline, true)
    }

    fn identify_inner(
        &self,
        request: &ParsedRequest<'_>,
        ns: &Namespace,
        deadline: Option<Instant>,
        may_defer: bool,
    ) -> PrefixIdentity {
        let hasher = self.hasher(ns);
        let bs = hasher.block_size_tokens();
        let max_blocks = (self.max_prefix_tokens(ns.model()) / bs) as usize;
        let entry = self.models.get(ns.model());
        let tokenizer = entry.and_then(|e| e.tokenizer.as_ref());
        let defer = entry
            .map(|e| e.config.defer_tokenizing_after)
            .filter(|_| may_defer);

        let exact = |ids: &[u32], tokens: u64, truncated: bool| PrefixIdentity {
            tokens,
            block_hashes: hasher.hash_tokens(ids, max_blocks),
            block_size_tokens: bs,
            exact: true,
            truncated,
            deadline_cut: false,
            fallback: None,
            deferred: None,
        };
        let tokenized = match (&request.prompt, tokenizer) {
            (Prompt::None, _) => return exact(&[], 0, false),
            (Prompt::Input(PromptInput::Tokens(ids)), _) => {
                return exact(ids, ids.len() as u64, false)
            }
            (Prompt::Input(PromptInput::TokenLists(lists)), _) => {
                let first = lists.first().map_or(&[][..], |l| l.as_slice());
                let total = lists.iter().map(|l| l.len() as u64).sum();
                return exact(first, total, false);
            }
            (_, None) => Err(Fallback::NoTokenizer),
            (Prompt::Chat(messages), Some(t)) => t
                .tokenize_chat_deferring(messages, &request.chat, deadline, defer)
                .map_err(Fallback::from),
            (Prompt::Input(PromptInput::Text(text)), Some(t)) => t
                .tokenize_text_until(text, deadline)
                .map_err(Fallback::from),
            (Prompt::Input(PromptInput::Texts(texts)), Some(t)) => {
                let first = texts.first().map_or("", |t| t.as_ref());
                let rest: usize = texts.iter().skip(1).map(|t| t.len()).sum();
                t.tokenize_text_until(first, deadline)
                    .map(|mut p| {
                        p.total_tokens += estimate_tokens(rest);
                        p
                    })
                    .map_err(Fallback::from)
            }
        };
        match tokenized {
            Ok(mut p) => {
                let deferred = p.deferred.take().and_then(|text| {
                    Some(DeferredPrefix(Arc::new(DeferredWork {
                        entry: Arc::clone(entry?),
                        text,
                        hasher,
                        max_blocks,
                    })))
                });
                let mut identity = identity_from_tokens(p, &hasher, max_blocks);
                identity.deferred = deferred;
                identity
            }
            Err(reason) => {
                let tools = request.chat.tools.as_ref().map(|t| t.to_string());
                let tools_bytes = tools.as_ref().map_or(0, String::len);
                PrefixIdentity {
                    tokens: estimate_tokens(request.prompt.text_bytes() + tools_bytes),
                    block_hashes: byte_block_hashes(
                        &request.prompt,
                        tools.as_deref(),
                        &BlockHasher::for_byte_chunks(ns, bs),
                        max_blocks,
                    ),
                    block_size_tokens: bs,
                    exact: false,
                    truncated: false,
                    deadline_cut: false,
                    fallback: Some(reason),
                    deferred: None,
                }
            }
        }
    }
}

/// The rest of a deferred identity's work: tokenizing the new text and hashing the whole
/// prompt. Cheap to clone; never shows the text.
#[derive(Clone)]
pub struct DeferredPrefix(Arc<DeferredWork>);

struct DeferredWork {
    entry: Arc<ModelEntry>,
    text: DeferredText,
    hasher: BlockHasher,
    max_blocks: usize,
}

impl DeferredPrefix {
    /// The whole prompt's block hashes (those of the decision's identity, then the rest's), as
    /// [`TokenizerRegistry::identify`] would have given them; the new text's token ids go into
    /// the model's token cache on the way. `None` if the tokenizer fails on the text.
    pub fn finish(&self) -> Option<Vec<u64>> {
        let w = &self.0;
        let tokenizer = w.entry.tokenizer.as_ref()?;
        let tokens = tokenizer.tokenize_deferred(&w.text).ok()?;
        Some(w.hasher.hash_tokens(&tokens.ids, w.max_blocks))
    }

    /// Bytes held until [`Self::finish`] (the whole rendered prompt).
    pub fn held_bytes(&self) -> usize {
        self.0.text.held_bytes()
    }

    /// Bytes of rendered prompt left for [`Self::finish`].
    pub fn untokenized_bytes(&self) -> usize {
        self.0.text.untokenized_bytes()
    }
}

impl PartialEq for DeferredPrefix {
    fn eq(&self, other: &Self) -> bool {
        self.0.text == other.0.text
    }
}

impl Eq for DeferredPrefix {}

impl std::fmt::Debug for DeferredPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredPrefix")
            .field("text", &self.0.text)
            .finish()
    }
}

fn identity_from_tokens(
    p: PromptTokens,
    hasher: &BlockHasher,
    max_blocks: usize,
) -> PrefixIdentity {
    let bs = hasher.block_size_tokens();
    let block_hashes = if p.media.is_empty() {
        hasher.hash_tokens(&p.ids, max_blocks)
    } else {
        // Each media hash joins the extra keys of the block where its message starts, so
        // blocks before it stay shared and every block from it on depends on the media.
        let mut extras: HashMap<usize, Vec<u64>> = HashMap::new();
        for (offset, h) in &p.media {
            extras
                .entry((offset / bs as u64) as usize)
                .or_default()
                .push(*h);
        }
        hasher.hash_tokens_with(&p.ids, max_blocks, |i| {
            extras.get(&i).map_or(&[][..], |v| v.as_slice())
        })
    };
    PrefixIdentity {
        tokens: p.total_tokens,
        block_hashes,
        block_size_tokens: bs,
        exact: true,
        truncated: p.truncated,
        deadline_cut: p.deadline_cut,
        fallback: None,
        deferred: None,
    }
}

fn load_model(config: &ModelConfig, base_dir: &Path, at: &str) -> Result<ModelEntry, PrefixError> {
    let Some(tokenizer) = &config.tokenizer else {
        return Ok(ModelEntry {
            config: config.clone(),
            tokenizer: None,
        });
    };
    let resolve = |p: &str| base_dir.join(p);
    let root = resolve(tokenizer);
    let in_dir = |name: &str| {
        let p = root.join(name);
        p.is_file().then_some(p)
    };
    let (json, mut tok_config, mut template) = if root.is_dir() {
        let json = root.join("tokenizer.json");
        if !json.is_file() {
            return Err(PrefixError::Load {
                field: format!("{at}.tokenizer"),
                path: root.display().to_string(),
                message: "the directory has no tokenizer.json".into(),
            });
        }
        (
            json,
            in_dir("tokenizer_config.json"),
            in_dir("chat_template.jinja"),
        )
    } else {
        (root.clone(), None, None)
    };
    if let Some(p) = &config.tokenizer_config {
        tok_config = Some(resolve(p));
    }
    if let Some(p) = &config.chat_template {
        template = Some(resolve(p));
    }
    let files = TokenizerFiles {
        tokenizer_json: Some(&json),
        tokenizer_config: tok_config.as_deref(),
        chat_template: template.as_deref(),
    };
    let mut tokenizer = ModelTokenizer::load_with_limits(
        &files,
        config.max_prefix_tokens as usize,
        usize::try_from(config.token_cache_tokens).unwrap_or(usize::MAX),
        RenderLimits {
            fuel: Some(config.template_fuel),
            max_output_bytes: usize::try_from(config.max_rendered_prompt_bytes)
                .unwrap_or(usize::MAX),
        },
        at,
    )?;
    tokenizer.set_chunk_bytes(usize::try_from(config.chunk_bytes).unwrap_or(usize::MAX));
    tracing::info!(
        model = %config.name,
        chat_template = tokenizer.has_chat_template(),
        segment_cache = tokenizer.uses_segment_cache(),
        long_message_chunks = tokenizer.uses_chunks(),
        ids_only_path = tokenizer.uses_fast_path(),
        "tokenizer loaded"
    );
    Ok(ModelEntry {
        config: config.clone(),
        tokenizer: Some(tokenizer),
    })
}
