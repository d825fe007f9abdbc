//! The HTTP layer: OpenAI-compatible routes on axum, answers and SSE streams built from
//! the scheduler's events, errors as OpenAI error objects.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use veloxquant_llm::Tokenizer;

use crate::api::{ChatRequest, CompletionRequest, Params, PromptInput, Validated};
use crate::chat::ChatTemplate;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::{Command, Event, Finish, GenRequest, Usage};
use crate::slots::SlotAction;

pub struct AppState {
    pub tx: UnboundedSender<Command>,
    pub tok: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub model_id: String,
    pub n_ctx: usize,
    pub metrics: Arc<Metrics>,
    /// SHA-256 of the API key: compared in constant time, and of equal length whatever
    /// the client sends.
    pub api_key: Option<[u8; 32]>,
    pub max_queue: usize,
    pub max_slots: usize,
    pub default_max_tokens: usize,
    pub seeds: AtomicU64,
}

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/slots/{id}", post(slots))
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

pub fn key_digest(key: &str) -> [u8; 32] {
    digest(key)
}

fn authorize(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(want) = &s.api_key else { return Ok(()) };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(digest(given).ct_eq(want)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|r| ApiError::with_status(r.status(), r.body_text()))?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

fn check_model(s: &AppState, p: &Params) -> Result<(), ApiError> {
    match &p.model {
        Some(m) if m != &s.model_id => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(s): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    Metrics::inc(&s.metrics.requests_total);
    let r = (|| {
        authorize(&s, &headers)?;
        let req: CompletionRequest = parse(body)?;
        check_model(&s, &req.params)?;
        let v = req.params.validate(s.max_slots, s.seeds.fetch_add(1, Relaxed))?;
        let ids = match req.prompt {
            PromptInput::Text(t) => s.tok.encode(&t),
            PromptInput::Texts(v) if v.len() == 1 => s.tok.encode(&v[0]),
            PromptInput::Texts(_) => return Err(ApiError::invalid_param("prompt", "exactly one prompt is supported")),
            PromptInput::Tokens(t) => match t.iter().find(|&&id| id as usize >= s.tok.n_vocab()) {
                Some(id) => return Err(ApiError::invalid_param("prompt", format!("token id {id} is out of range"))),
                None => Ok(t),
            },
        }
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((ids, v))
    })();
    respond(s, r, Kind::Completion).await
}

async fn chat(State(s): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    Metrics::inc(&s.metrics.requests_total);
    let r = (|| {
        authorize(&s, &headers)?;
        let req: ChatRequest = parse(body)?;
        check_model(&s, &req.params)?;
        let v = req.params.validate(s.max_slots, s.seeds.fetch_add(1, Relaxed))?;
        let text = s.template.render(&req.messages()?).map_err(ApiError::bad_request)?;
        let ids = s.template.encode(&s.tok, &text).map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((ids, v))
    })();
    respond(s, r, Kind::Chat).await
}

async fn respond(s: Arc<AppState>, r: Result<(Vec<u32>, Validated), ApiError>, kind: Kind) -> Response {
    match r.and_then(|(ids, v)| submit(&s, ids, &v, kind).map(|rx| (rx, v))) {
        Err(e) => {
            Metrics::inc(&s.metrics.requests_failed_total);
            e.into_response()
        }
        Ok((rx, v)) if v.stream => stream_response(s, rx, kind, v.include_usage).into_response(),
        Ok((rx, _)) => whole_response(s, rx, kind).await,
    }
}

/// Queues a generation; errors that need no model work are answered here.
fn submit(s: &AppState, prompt: Vec<u32>, v: &Validated, kind: Kind) -> Result<UnboundedReceiver<Event>, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    if prompt.len() >= s.n_ctx {
        return Err(ApiError::context_length(format!(
            "the prompt has {} tokens; this model's context is {} (prompt plus at least one generated token)",
            prompt.len(),
            s.n_ctx
        )));
    }
    let room = s.n_ctx - prompt.len();
    let default = if kind == Kind::Chat { s.default_max_tokens } else { 16 };
    let max_tokens = v.max_tokens.unwrap_or(default).min(room);
    if s.metrics.queue_length.fetch_add(1, Relaxed) >= s.max_queue as u64 {
        s.metrics.queue_length.fetch_sub(1, Relaxed);
        Metrics::inc(&s.metrics.requests_rejected_total);
        return Err(ApiError::busy("the request queue is full; retry later"));
    }
    let (tx, rx) = unbounded_channel();
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: v.sampling,
        stop: v.stop.clone(),
        slot: v.slot,
        events: tx,
        received: Instant::now(),
    };
    if s.tx.send(Command::Generate(req)).is_err() {
        s.metrics.queue_length.fetch_sub(1, Relaxed);
        return Err(ApiError::busy("the server is shutting down"));
    }
    Ok(rx)
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn ids(kind: Kind) -> (&'static str, &'static str, &'static str) {
    match kind {
        Kind::Completion => ("cmpl", "text_completion", "text_completion"),
        Kind::Chat => ("chatcmpl", "chat.completion", "chat.completion.chunk"),
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

async fn whole_response(s: Arc<AppState>, mut rx: UnboundedReceiver<Event>, kind: Kind) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Error(e) => return e.into_response(),
            Event::Done { finish, usage, ids: token_ids } => {
                let (prefix, object, _) = ids(kind);
                let choice = match kind {
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": token_ids})
                    }
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish, "token_ids": token_ids})
                    }
                };
                let body = json!({
                    "id": format!("{prefix}-{}", NEXT_ID.fetch_add(1, Relaxed)),
                    "object": object, "created": unix_now(), "model": s.model_id,
                    "choices": [choice], "usage": usage_json(&usage),
                });
                return Json(body).into_response();
            }
        }
    }
    ApiError::internal("the scheduler stopped before the request finished").into_response()
}

fn chunk(s: &AppState, kind: Kind, id: &str, piece: Option<&str>, finish: Option<Finish>, role: bool) -> Value {
    let (_, _, object) = ids(kind);
    let choice = match kind {
        Kind::Completion => json!({"index": 0, "text": piece.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(p) = piece {
                delta.insert("content".into(), json!(p));
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
    };
    json!({"id": id, "object": object, "created": unix_now(), "model": s.model_id, "choices": [choice]})
}

enum Phase {
    Start,
    Running,
    Over,
}

fn stream_response(
    s: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    kind: Kind,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (prefix, _, _) = ids(kind);
    let id = format!("{prefix}-{}", NEXT_ID.fetch_add(1, Relaxed));
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let st = stream::unfold((rx, Phase::Start, Vec::<SseEvent>::new()), move |(mut rx, phase, mut pending)| {
        let (s, id) = (s.clone(), id.clone());
        async move {
            if let Some(ev) = pending.pop() {
                return Some((Ok(ev), (rx, phase, pending)));
            }
            match phase {
                Phase::Over => None,
                Phase::Start if kind == Kind::Chat => {
                    Some((Ok(data(chunk(&s, kind, &id, Some(""), None, true))), (rx, Phase::Running, pending)))
                }
                Phase::Start | Phase::Running => match rx.recv().await {
                    Some(Event::Text(t)) => {
                        Some((Ok(data(chunk(&s, kind, &id, Some(&t), None, false))), (rx, Phase::Running, pending)))
                    }
                    Some(Event::Done { finish, usage, .. }) => {
                        let mut last = chunk(&s, kind, &id, None, Some(finish), false);
                        last["usage"] = usage_json(&usage);
                        // Sent in reverse (pending is a stack): [DONE] last.
                        pending.push(SseEvent::default().data("[DONE]"));
                        if include_usage {
                            let mut u = chunk(&s, kind, &id, None, None, false);
                            u["choices"] = json!([]);
                            u["usage"] = usage_json(&usage);
                            pending.push(data(u));
                        }
                        Some((Ok(data(last)), (rx, Phase::Over, pending)))
                    }
                    Some(Event::Error(e)) => Some((Ok(data(e.body())), (rx, Phase::Over, pending))),
                    None => None,
                },
            }
        }
    });
    // Comments every second: a client that went away is noticed (the write fails) even
    // while its request waits or prefills, and its pages are freed.
    Sse::new(st).keep_alive(KeepAlive::new().interval(Duration::from_secs(1)))
}

async fn models(State(s): St, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [
        {"id": s.model_id, "object": "model", "created": 0, "owned_by": "veloxquant", "max_model_len": s.n_ctx}
    ]}))
    .into_response()
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(s): St, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

#[derive(serde::Deserialize)]
struct SlotQuery {
    action: Option<String>,
}

#[derive(serde::Deserialize)]
struct SlotBody {
    filename: Option<String>,
}

async fn slots(
    State(s): St,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<SlotQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        authorize(&s, &headers)?;
        let id: usize = id
            .parse()
            .ok()
            .filter(|&i| i < s.max_slots)
            .ok_or_else(|| ApiError::invalid_param("id_slot", format!("slot id must be in 0..{}", s.max_slots)))?;
        let action = q.map_err(|e| ApiError::bad_request(e.body_text()))?.0.action.unwrap_or_default();
        let name = move || -> Result<String, ApiError> {
            let b: SlotBody = match body {
                Ok(b) if b.is_empty() => SlotBody { filename: None },
                other => parse(other)?,
            };
            b.filename.ok_or_else(|| ApiError::invalid_param("filename", "filename is required"))
        };
        let action = match action.as_str() {
            "save" => SlotAction::Save(name()?),
            "restore" => SlotAction::Restore(name()?),
            "erase" => SlotAction::Erase,
            other => {
                return Err(ApiError::invalid_param("action", format!("action {other:?}: save, restore or erase")))
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        s.tx.send(Command::Slot { id, action, reply: tx }).map_err(|_| ApiError::busy("shutting down"))?;
        rx.await.map_err(|_| ApiError::busy("shutting down"))?
    }
    .await;
    match r {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}
