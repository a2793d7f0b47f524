//! The simulator's real tokenizer: the router's own [`ModelTokenizer`] (Hugging Face
//! `tokenizer.json` + chat template), so a replica computes exactly the token ids, and hence the
//! prefix blocks, that the router predicts — as a real vLLM with the same tokenizer would.

use std::sync::Arc;

use super::config::TokenizerPaths;
use super::replica::TokenizerLoader;
use super::tokenize::{MmSpan, PromptTokenizer, PromptTokens, TokenizeError, FILLER_WORDS};
use kvrouter::prefix::tokenizer::TokenizerFiles;
use kvrouter::prefix::ModelTokenizer;
use kvrouter::request::{ParsedRequest, Prompt, PromptInput};

/// Prompts longer than this are cut (the engine's `max_model_len` rejects them long before).
const MAX_PROMPT_TOKENS: usize = 1 << 26;

/// A [`PromptTokenizer`] over a loaded Hugging Face tokenizer.
#[derive(Debug)]
pub struct HfTokenizer {
    model: ModelTokenizer,
    /// Token id of each filler word, so generated text re-tokenizes to what was generated.
    filler_ids: Vec<u32>,
}

impl HfTokenizer {
    /// Loads the files.
    pub fn load(paths: &TokenizerPaths) -> Result<HfTokenizer, String> {
        let files = TokenizerFiles {
            tokenizer_json: Some(&paths.tokenizer_json),
            tokenizer_config: paths.tokenizer_config.as_deref(),
            chat_template: paths.chat_template.as_deref(),
        };
        let model = ModelTokenizer::load(&files, MAX_PROMPT_TOKENS, 1 << 20, "tokenizer")
            .map_err(|e| e.to_string())?;
        // Each filler word's first token with a leading space (how it appears mid-text).
        let filler_ids = FILLER_WORDS
            .iter()
            .map(|word| {
                model
                    .tokenize(&format!(" {word}"), false, false)
                    .ok()
                    .and_then(|t| t.ids.first().copied())
                    .unwrap_or(0)
            })
            .collect();
        Ok(HfTokenizer { model, filler_ids })
    }
}

impl PromptTokenizer for HfTokenizer {
    fn tokens(&self, req: &ParsedRequest<'_>) -> Result<PromptTokens, TokenizeError> {
        let rejected = |e: kvrouter::prefix::PrefixError| TokenizeError::Rejected(e.to_string());
        let tokens = match &req.prompt {
            Prompt::Chat(messages) => self.model.tokenize_chat(messages).map_err(rejected)?,
            Prompt::Input(PromptInput::Text(text)) => {
                self.model.tokenize_text(text).map_err(rejected)?
            }
            Prompt::Input(PromptInput::Tokens(ids)) => {
                return Ok(PromptTokens {
                    ids: ids.clone(),
                    mm: Vec::new(),
                })
            }
            Prompt::Input(_) => return Err(TokenizeError::Batch),
            Prompt::None => return Err(TokenizeError::NoPrompt),
        };
        // A media item keys the block where its message starts, as the router hashes it.
        let mm = tokens
            .media
            .iter()
            .map(|&(offset, hash)| MmSpan {
                offset: offset as u32,
                len: 1,
                hash,
            })
            .collect();
        Ok(PromptTokens {
            ids: tokens.ids,
            mm,
        })
    }

    fn output_token(&self, index: u32) -> u32 {
        self.filler_ids[(index % 8) as usize]
    }
}

/// A [`TokenizerLoader`] that loads Hugging Face tokenizers.
pub fn hf_tokenizer_loader() -> TokenizerLoader {
    Arc::new(|paths: &TokenizerPaths| {
        HfTokenizer::load(paths).map(|t| Arc::new(t) as Arc<dyn PromptTokenizer>)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter::request::{self, ApiKind};
    use std::path::PathBuf;

    fn fixture_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .map(|a| a.join("shared/fixtures/vllm-0.32-cpu-smollm2"))
            .find(|p| p.join("tokenizer.json").is_file())
            .expect("the shared vLLM fixture (../shared/fixtures) is missing")
    }

    /// The simulator's ids for a chat are the router's: the same directory of tokenizer files
    /// loaded by `kvsim --tokenizer DIR` and by the router's `models[].tokenizer: DIR`.
    #[test]
    fn chat_tokens_equal_the_routers() {
        let sim = HfTokenizer::load(&TokenizerPaths::from_path(&fixture_dir())).unwrap();
        let config = kvrouter::config::ModelConfig {
            name: "m".into(),
            tokenizer: Some(fixture_dir().display().to_string()),
            ..Default::default()
        };
        let registry =
            kvrouter::prefix::TokenizerRegistry::from_config(&[config], std::path::Path::new("."))
                .unwrap();
        let router = registry.tokenizer("m").unwrap();
        let body = br#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Where is my parcel?"}]}"#;
        let req = request::parse(ApiKind::ChatCompletions, body).unwrap();
        let Prompt::Chat(messages) = &req.prompt else {
            unreachable!()
        };
        let ids = sim.tokens(&req).unwrap().ids;
        assert_eq!(ids, router.tokenize_chat(messages).unwrap().ids);
        assert!(ids.len() > 10);
        // Distinct filler words map to distinct ids.
        let mut fillers: Vec<u32> = (0..8).map(|i| sim.output_token(i)).collect();
        fillers.sort_unstable();
        fillers.dedup();
        assert_eq!(fillers.len(), 8);
    }
}
