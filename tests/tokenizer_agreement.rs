//! Two independent implementations of vLLM's prompt tokenization must agree: the router's
//! (`kvrouter::request` + `kvrouter::prefix`) and the simulator's (`kvsim::request` +
//! `kvsim::hf_tokenizer`). Each is checked against the real vLLM capture in its own crate
//! (`tests/prefix_fixture.rs`, `crates/kvsim/tests/vllm_capture.rs`); this test covers what the
//! capture does not: the capture's SmolLM2 tokenizer on other prompts, and the real tokenizers
//! of three model families whose templates and files differ most: Qwen3 (a long template with
//! Python string methods), Gemma 3 (content as parts), DeepSeek-V3 (BOS from the config).
//! `make tokenizers` fetches them into `.cache/tokenizers` (or `$KVROUTER_TOKENIZERS_DIR`);
//! without them this test fails. A disagreement means one of the two renders or tokenizes
//! unlike vLLM.

use std::path::{Path, PathBuf};

use kvrouter::config::ModelConfig;
use kvrouter::prefix::TokenizerRegistry;
use kvrouter::request::{self as router_request, ApiKind as RouterApi, Prompt as RouterPrompt};
use kvsim::request::{self as sim_request, ApiKind as SimApi};
use kvsim::{HfTokenizer, PromptTokenizer, TokenizerPaths};
use serde_json::{json, Value};

/// A known disagreement, pinned so that fixing it makes this test fail (then delete the entry):
/// DeepSeek-V3's `tokenizer_config.json` sets `add_bos_token: true` while its `tokenizer.json`
/// post-processor adds no BOS. transformers (v4's LlamaTokenizerFast and v5's
/// TokenizersBackend alike) rebuilds the post-processor from that flag, so vLLM starts a
/// completion prompt with BOS (id 0); the router encodes with the file's post-processor only.
const ROUTER_MISSES_CONFIG_BOS: &[(&str, u32)] = &[("deepseek_v3", 0)];

/// Requests beyond the plain conversations (index among them) that a family's template
/// refuses, in both implementations: Gemma 3's has no `tool` role.
const REFUSED: &[(&str, usize)] = &[("gemma3", 0)];

fn fetched_dir(model: &str) -> PathBuf {
    let base = std::env::var_os("KVROUTER_TOKENIZERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/tokenizers"));
    let dir = base.join(model);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} is missing: run `make tokenizers` (or set KVROUTER_TOKENIZERS_DIR)",
        dir.join("tokenizer.json").display()
    );
    dir
}

/// Chat request bodies: every conversation of [`conversations`], then requests with what vLLM
/// hands the template beside the messages (tools, tool calls and results, a developer message,
/// template kwargs, reasoning).
fn chats() -> Vec<Value> {
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Current weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let mut bodies: Vec<Value> = conversations()
        .into_iter()
        .map(|messages| json!({"model": "m", "messages": messages}))
        .collect();
    bodies.push(
        json!({"model": "m", "tools": [weather.clone()], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "18 C"},
        {"role": "user", "content": "Thanks."}]}),
    );
    bodies.push(json!({"model": "m", "messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello", "name": "ann"}]}));
    bodies.push(
        json!({"model": "m", "chat_template_kwargs": {"enable_thinking": false},
        "reasoning_effort": "low", "messages": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning": "thought"},
        {"role": "user", "content": "Q2"}]}),
    );
    bodies
}

/// Conversations that exercise the templates: system prompts, multi-turn, whitespace, digits,
/// non-ASCII, text parts, an assistant turn with reasoning.
fn conversations() -> Vec<Value> {
    let system =
        "You are a careful assistant for a logistics company.  Answer in 3 words; cite [1].";
    vec![
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Where is order 17?"}]),
        json!([{"role": "user", "content": "  Hello,   world!\tNaïve café — 東京 123456 😀\n"}]),
        json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": " Fine, thanks.  "},
            {"role": "user", "content": "\n\nAnd now?"},
        ]),
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]},
        ]),
        // Long enough for kvsim's segment cache: asked twice, the second answer is cached.
        json!([{"role": "system", "content": system.repeat(12)}, {"role": "user", "content": "Where is order 18?"}]),
        json!([{"role": "system", "content": system.repeat(12)}, {"role": "user", "content": "And order 19?"}]),
        json!([
            {"role": "user", "content": "Think first."},
            {"role": "assistant", "content": "<think>\nsome thoughts\n</think>\n\nThe answer."},
            {"role": "user", "content": "Again?"},
        ]),
    ]
}

fn completions() -> Vec<&'static str> {
    vec![
        "Document 0: stone gamma cloud alpha beta truck",
        " leading space and\n\nnewlines  \t end ",
    ]
}

struct Pair {
    router: TokenizerRegistry,
    sim: HfTokenizer,
}

fn load(dir: &Path) -> Pair {
    let router = TokenizerRegistry::from_config(
        &[ModelConfig {
            name: "m".into(),
            tokenizer: Some(dir.display().to_string()),
            ..ModelConfig::default()
        }],
        Path::new("/"),
    )
    .expect("the router loads the tokenizer");
    let sim = HfTokenizer::load(&TokenizerPaths::from_path(dir)).expect("kvsim loads it");
    Pair { router, sim }
}

impl Pair {
    /// The router's ids, or its error (a template that refuses the conversation).
    fn router_ids(&self, api: RouterApi, body: &[u8]) -> Result<Vec<u32>, String> {
        let tokenizer = self.router.tokenizer("m").expect("router tokenizer");
        let parsed = router_request::parse(api, body).expect("the router parses");
        let tokens = match &parsed.prompt {
            RouterPrompt::Chat(messages) => {
                tokenizer.tokenize_chat_deferring(messages, &parsed.chat, None, None)
            }
            RouterPrompt::Input(router_request::PromptInput::Text(t)) => tokenizer.tokenize_text(t),
            other => panic!("unexpected prompt {other:?}"),
        }
        .map_err(|e| e.to_string())?;
        assert!(!tokens.truncated);
        Ok(tokens.ids)
    }

    /// kvsim's ids, or its error.
    fn sim_ids(&self, api: SimApi, body: &[u8]) -> Result<Vec<u32>, String> {
        let parsed = sim_request::parse(api, body).expect("kvsim parses");
        self.sim
            .request_tokens(&parsed)
            .map(|t| t.ids)
            .map_err(|e| e.to_string())
    }

    /// Compares every chat and completion; returns how many prompts agreed.
    fn compare(&self, family: &str) -> usize {
        let mut compared = 0;
        let plain = conversations().len();
        let mut refused = 0;
        for (i, body) in chats().into_iter().enumerate() {
            let body = body.to_string();
            let router = self.router_ids(RouterApi::ChatCompletions, body.as_bytes());
            let sim = self.sim_ids(SimApi::ChatCompletions, body.as_bytes());
            match (router, sim) {
                (Ok(router), Ok(sim)) => {
                    assert!(!sim.is_empty());
                    assert_eq!(router, sim, "{family}: chat {i} differs");
                }
                // A template may refuse a conversation (Gemma 3 has no tool role): both must,
                // and only where known.
                (Err(_), Err(_)) if i >= plain && REFUSED.contains(&(family, i - plain)) => {
                    refused += 1;
                }
                (router, sim) => panic!("{family}: chat {i}: router {router:?}, kvsim {sim:?}"),
            }
            compared += 1;
        }
        let missing_bos = ROUTER_MISSES_CONFIG_BOS
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, bos)| *bos);
        for (i, prompt) in completions().into_iter().enumerate() {
            let body = json!({"model": "m", "prompt": prompt}).to_string();
            let router = self
                .router_ids(RouterApi::Completions, body.as_bytes())
                .expect("the router tokenizes");
            let sim = self
                .sim_ids(SimApi::Completions, body.as_bytes())
                .expect("kvsim tokenizes");
            match missing_bos {
                Some(bos) => assert_eq!(
                    sim,
                    [&[bos][..], &router].concat(),
                    "{family}: completion {i}: the router's known BOS gap changed"
                ),
                None => assert_eq!(router, sim, "{family}: completion {i} differs"),
            }
            compared += 1;
        }
        let expected = REFUSED.iter().filter(|(f, _)| *f == family).count();
        assert_eq!(refused, expected, "{family}: refusals");
        // The long system prompt went through kvsim's segment cache (so the cached path is
        // what agreed with the router).
        let cached = self.sim.segment_cache().map(|(pieces, _)| pieces);
        assert!(cached >= Some(1), "{family}: kvsim's segment cache unused");
        compared
    }
}

#[test]
fn router_and_kvsim_tokenize_the_capture_model_alike() {
    let pair = load(&kvsim::capture::dir());
    assert_eq!(pair.compare("smollm2"), 12);
}

// One test per family, so they load in parallel (a debug build takes seconds per tokenizer).

#[test]
fn router_and_kvsim_tokenize_qwen3_alike() {
    assert_eq!(load(&fetched_dir("qwen3")).compare("qwen3"), 12);
}

#[test]
fn router_and_kvsim_tokenize_gemma3_alike() {
    // Gemma 3's template loops over content parts: the "openai" content format.
    let pair = load(&fetched_dir("gemma3"));
    let format = pair.sim.chat_template().map(|t| t.content_format());
    assert_eq!(format, Some(kvsim::hf_tokenizer::ContentFormat::OpenAi));
    assert_eq!(pair.compare("gemma3"), 12);
}

#[test]
fn router_and_kvsim_tokenize_deepseek_v3_alike_but_for_the_completion_bos() {
    assert_eq!(load(&fetched_dir("deepseek_v3")).compare("deepseek_v3"), 12);
}
