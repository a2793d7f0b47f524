//! The replica's OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (SSE and
//! JSON), `/v1/models`, `/health`, `/metrics`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::driver::{ClientSink, Command};
use super::engine::{Engine, NewRequest, Output, Usage};
use super::faults::Refusal;
use super::openai::{add_usage, error, ResponseMeta};
use super::replica::Replica;
use super::request::{self, ApiKind};
use super::tokenize::PromptTokens;

pub(super) async fn completions(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    generate(r, ApiKind::Completions, body).await
}

pub(super) async fn chat(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    generate(r, ApiKind::ChatCompletions, body).await
}

fn refused(refusal: Refusal) -> Response {
    error(refusal.status, refusal.message, None)
}

/// A 503 while the replica is restarting.
fn down_response(r: &Replica) -> Option<Response> {
    r.faults.lock().down().map(refused)
}

pub(super) async fn health(State(r): State<Arc<Replica>>) -> Response {
    match down_response(&r) {
        Some(resp) => resp,
        None => StatusCode::OK.into_response(),
    }
}

pub(super) async fn models(State(r): State<Arc<Replica>>) -> Response {
    if let Some(resp) = down_response(&r) {
        return resp;
    }
    let max_model_len = r.engine_cfg.max_model_len;
    let created = r.started_unix_s;
    let base = &r.config.models[0];
    let mut data: Vec<Value> = r
        .config
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": created, "owned_by": "vllm", "root": m, "parent": null, "max_model_len": max_model_len}))
        .collect();
    data.extend(r.config.adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": created, "owned_by": "vllm", "root": a, "parent": base, "max_model_len": max_model_len})
    }));
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn metrics(State(r): State<Arc<Replica>>) -> Response {
    if let Some(resp) = down_response(&r) {
        return resp;
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        r.metrics.render(&r.info),
    )
        .into_response()
}

async fn generate(r: Arc<Replica>, api: ApiKind, body: Bytes) -> Response {
    let refusal = r.faults.lock().refuse_generation();
    if let Some(refusal) = refusal {
        return refused(refusal);
    }
    let req = match request::parse(api, &body) {
        Ok(req) => req,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string(), e.param()),
    };
    // No model named: the first served model, as vLLM.
    let model = req
        .model
        .clone()
        .unwrap_or_else(|| r.config.models[0].clone());
    let lora = if r.config.models.contains(&model) {
        None
    } else if let Some(lora) = r.loras.get(&model) {
        Some(lora.clone())
    } else {
        return error(
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
            Some("model"),
        );
    };
    let number = r.request_count.fetch_add(1, Ordering::Relaxed);
    let mut prompts: Vec<(PromptTokens, u32)> = Vec::new();
    for one in req.prompts() {
        let tokens = match r.tokenizer.tokens(one, &req.render) {
            Ok(t) => t,
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string(), None),
        };
        let max_tokens = match req.max_tokens {
            Some(n) => n,
            None => {
                let room = (r.engine_cfg.max_model_len as usize).saturating_sub(tokens.ids.len());
                r.default_output_tokens(number).min(room as u32).max(1)
            }
        };
        if let Err(e) = Engine::<ClientSink>::check(&r.engine_cfg, tokens.ids.len(), max_tokens) {
            let param = matches!(e, super::engine::AdmitError::NoOutput).then_some("max_tokens");
            return error(StatusCode::BAD_REQUEST, e.to_string(), param);
        }
        prompts.push((tokens, max_tokens));
    }
    // A request that names its length stops there ("length"); otherwise the simulated model
    // stops on its own ("stop").
    let finish = if req.max_tokens.is_some() {
        "length"
    } else {
        "stop"
    };
    let maxes: Vec<u32> = prompts.iter().map(|(_, m)| *m).collect();
    let cache_salt: Option<Box<str>> = req.cache_salt.as_deref().map(Into::into);
    // vLLM sends the usage chunk only when asked; kvsim sends it unless told not to (its own
    // tests and the router's accounting read it).
    let stream = req.stream.then_some(req.include_usage != Some(false));
    let chat = api == ApiKind::ChatCompletions;
    let meta = ResponseMeta {
        id: format!(
            "{}-{}-{number}",
            if chat { "chatcmpl" } else { "cmpl" },
            r.config.name
        ),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model,
        chat,
    };
    drop(req);

    let (tx, rx) = mpsc::unbounded_channel();
    let arrival = Instant::now();
    for (choice, (prompt, max_tokens)) in prompts.into_iter().enumerate() {
        let submit = Command::Submit(Box::new(NewRequest {
            prompt,
            max_tokens,
            lora: lora.clone(),
            cache_salt: cache_salt.clone(),
            sink: ClientSink {
                choice: choice as u32,
                tx: tx.clone(),
            },
            arrival,
        }));
        if r.tx.send(submit).is_err() {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is not running",
                None,
            );
        }
    }
    drop(tx);

    match stream {
        Some(include_usage) => stream_response(rx, meta, maxes, finish, include_usage),
        None => full_response(rx, meta, maxes, finish).await,
    }
}

async fn full_response(
    mut rx: mpsc::UnboundedReceiver<(u32, Output)>,
    meta: ResponseMeta,
    maxes: Vec<u32>,
    finish: &'static str,
) -> Response {
    let mut left = maxes.len();
    let mut usage = Usage::default();
    while left > 0 {
        match rx.recv().await {
            Some((_, Output::Token { .. })) => {}
            Some((_, Output::Finished(u))) => {
                add_usage(&mut usage, &u);
                left -= 1;
            }
            Some((_, Output::Aborted(reason))) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("request aborted by the engine ({reason})"),
                    None,
                )
            }
            None => {
                return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped", None);
            }
        }
    }
    let choices: Vec<(u32, &'static str)> = maxes.iter().map(|&m| (m, finish)).collect();
    Json(meta.full_response(&choices, &usage)).into_response()
}

struct SseState {
    rx: mpsc::UnboundedReceiver<(u32, Output)>,
    meta: ResponseMeta,
    prefix: String,
    maxes: Vec<u32>,
    finish: &'static str,
    left: usize,
    usage: Usage,
    include_usage: bool,
    ended: bool,
}

fn stream_response(
    rx: mpsc::UnboundedReceiver<(u32, Output)>,
    meta: ResponseMeta,
    maxes: Vec<u32>,
    finish: &'static str,
    include_usage: bool,
) -> Response {
    let state = SseState {
        rx,
        prefix: meta.chunk_prefix(),
        meta,
        left: maxes.len(),
        maxes,
        finish,
        usage: Usage::default(),
        include_usage,
        ended: false,
    };
    let stream = futures::stream::unfold(state, |mut s| async move {
        if s.ended {
            return None;
        }
        loop {
            let chunk = match s.rx.recv().await? {
                (choice, Output::Token { index }) => {
                    let last = s
                        .maxes
                        .get(choice as usize)
                        .is_some_and(|&m| index + 1 == m);
                    let token =
                        s.meta
                            .token_chunk(&s.prefix, choice, index, last.then_some(s.finish));
                    if s.meta.chat && index == 0 {
                        let mut out = s.meta.role_chunk(&s.prefix, choice);
                        out.push_str(&token);
                        out
                    } else {
                        token
                    }
                }
                (_, Output::Finished(u)) => {
                    add_usage(&mut s.usage, &u);
                    s.left -= 1;
                    if s.left > 0 {
                        continue;
                    }
                    s.ended = true;
                    if s.include_usage {
                        s.meta.usage_and_done(&s.usage)
                    } else {
                        ResponseMeta::done().to_string()
                    }
                }
                (_, Output::Aborted(reason)) => {
                    s.ended = true;
                    ResponseMeta::stream_error(&format!("request aborted by the engine ({reason})"))
                }
            };
            return Some((Ok::<_, Infallible>(Bytes::from(chunk)), s));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
