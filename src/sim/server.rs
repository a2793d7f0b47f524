//! The replica's HTTP server.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};

use super::{ReplicaConfig, REPLICA_HEADER};
use crate::prefix::estimate_tokens;
use crate::request::{self, ApiKind};

/// A running replica's shared state.
#[derive(Debug)]
pub struct Replica {
    config: ReplicaConfig,
    running: AtomicU64,
    prompt_tokens_total: AtomicU64,
    generation_tokens_total: AtomicU64,
    requests_total: AtomicU64,
}

impl Replica {
    /// A replica with `config`.
    pub fn new(config: ReplicaConfig) -> Arc<Replica> {
        Arc::new(Replica {
            config,
            running: AtomicU64::new(0),
            prompt_tokens_total: AtomicU64::new(0),
            generation_tokens_total: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
        })
    }

    /// The HTTP routes.
    pub fn routes(self: Arc<Self>) -> Router {
        let name = HeaderValue::from_str(&self.config.name)
            .unwrap_or_else(|_| HeaderValue::from_static("replica"));
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/metrics", get(metrics))
            // vLLM accepts large prompts; axum's default 2 MiB body limit would not.
            .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
            .layer(axum::middleware::map_response(move |mut res: Response| {
                let name = name.clone();
                async move {
                    res.headers_mut().insert(REPLICA_HEADER, name);
                    res
                }
            }))
            .with_state(self)
    }
}

/// Binds `config.listen` and serves until the process ends. Returns the bound address through
/// `on_bound` before serving.
pub async fn run(
    config: ReplicaConfig,
) -> std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let addr = listener.local_addr()?;
    let app = Replica::new(config).routes();
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("replica server failed: {e}");
        }
    });
    Ok((addr, task))
}

fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": "BadRequestError", "param": null, "code": status.as_u16()}})),
    )
        .into_response()
}

async fn completions(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    generate(r, ApiKind::Completions, body).await
}

async fn chat(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    generate(r, ApiKind::ChatCompletions, body).await
}

async fn models(State(r): State<Arc<Replica>>) -> Json<Value> {
    let data: Vec<Value> = r
        .config
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "owned_by": "kvsim", "root": m}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn metrics(State(r): State<Arc<Replica>>) -> Response {
    let model = r.config.models.first().cloned().unwrap_or_default();
    let labels = format!("engine=\"0\",model_name=\"{model}\"");
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{labels}}} {running}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{labels}}} 0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{labels}}} 0.0\n\
         # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
         # TYPE vllm:prompt_tokens_total counter\n\
         vllm:prompt_tokens_total{{{labels}}} {prompt}\n\
         # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE vllm:generation_tokens_total counter\n\
         vllm:generation_tokens_total{{{labels}}} {generation}\n\
         # HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{labels},finished_reason=\"length\"}} {requests}\n",
        running = r.running.load(Ordering::Relaxed),
        prompt = r.prompt_tokens_total.load(Ordering::Relaxed),
        generation = r.generation_tokens_total.load(Ordering::Relaxed),
        requests = r.requests_total.load(Ordering::Relaxed),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Decrements the running gauge when the request's response ends (or is dropped).
struct Running(Arc<Replica>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn generate(r: Arc<Replica>, api: ApiKind, body: Bytes) -> Response {
    let (model, stream, max_tokens, prompt_tokens) = match request::parse(api, &body) {
        Ok(req) => (
            req.model.into_owned(),
            req.stream,
            req.max_tokens,
            estimate_tokens(req.prompt.text_bytes()),
        ),
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    if !r.config.models.contains(&model) {
        return error(
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        );
    }
    let output_tokens = max_tokens
        .unwrap_or(u64::from(r.config.default_max_tokens))
        .max(1);
    r.running.fetch_add(1, Ordering::Relaxed);
    r.requests_total.fetch_add(1, Ordering::Relaxed);
    r.prompt_tokens_total
        .fetch_add(prompt_tokens, Ordering::Relaxed);
    let running = Running(Arc::clone(&r));
    let ttft = Duration::from_secs_f64(
        (r.config.ttft_base_ms + r.config.prefill_ms_per_token * prompt_tokens as f64) / 1e3,
    );
    let itl = Duration::from_secs_f64(r.config.inter_token_ms / 1e3);
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let id = format!(
        "cmpl-{}-{}",
        r.config.name,
        r.requests_total.load(Ordering::Relaxed)
    );
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    });
    let chat = api == ApiKind::ChatCompletions;
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };

    if !stream {
        tokio::time::sleep(ttft + itl * (output_tokens.saturating_sub(1) as u32)).await;
        r.generation_tokens_total
            .fetch_add(output_tokens, Ordering::Relaxed);
        let text = filler(0, output_tokens);
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        drop(running);
        return Json(json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage}))
            .into_response();
    }

    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let events = async_stream(move |tx| async move {
        let _running = running;
        tokio::time::sleep(ttft).await;
        for i in 0..output_tokens {
            if i > 0 {
                tokio::time::sleep(itl).await;
            }
            let piece = filler(i, 1);
            let finish = (i + 1 == output_tokens).then_some("length");
            let choice = if chat {
                let mut delta = json!({"content": piece});
                if i == 0 {
                    delta["role"] = json!("assistant");
                }
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": piece, "finish_reason": finish})
            };
            let event = json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice]});
            if tx.send(format!("data: {event}\n\n")).await.is_err() {
                return; // client went away
            }
            r.generation_tokens_total.fetch_add(1, Ordering::Relaxed);
        }
        let event = json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [], "usage": usage});
        let _ = tx.send(format!("data: {event}\n\n")).await;
        let _ = tx.send("data: [DONE]\n\n".to_string()).await;
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(events)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A body fed by a producer task through a channel.
fn async_stream<F, Fut>(producer: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<String>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<String>(16);
    tokio::spawn(producer(tx));
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
        .map(|s| Ok::<_, Infallible>(Bytes::from(s)));
    Body::from_stream(stream)
}

use tokio_stream::StreamExt as _;

/// Deterministic filler text: `count` words starting at word `start`.
fn filler(start: u64, count: u64) -> String {
    const WORDS: [&str; 8] = [
        "lorem",
        "ipsum",
        "dolor",
        "sit",
        "amet",
        "consectetur",
        "adipiscing",
        "elit",
    ];
    (start..start + count)
        .map(|i| WORDS[(i % WORDS.len() as u64) as usize])
        .collect::<Vec<_>>()
        .join(" ")
        + " "
}
