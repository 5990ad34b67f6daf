//! The HTTP surface (DESIGN.md §3, §6): the inference routes a tenant calls
//! with its API key, and the admin routes an operator calls with the admin token.
//!
//! A request's path through [`infer`]:
//!
//! 1. **Authenticate** the bearer key → tenant (401 otherwise).
//! 2. **Read** the body under `server.body_bytes_max` (413) and a read deadline.
//! 3. **Parse** and validate the OpenAI parameters ([`openai`]); resolve the model (404).
//! 4. **Tokenize** (the model's chat template for chat) on a blocking thread.
//! 5. **Admit** statically (I1): `prompt + max_tokens` against the contract —
//!    a 400 `context_length_exceeded` here touches no page, queue or plugin state.
//! 6. **Submit** to the engine thread: queued, or 429 (`Retry-After`) / 503.
//! 7. **Answer**: one JSON body, or an SSE stream whose body owns the event
//!    receiver, so a client disconnect cancels the request.
//!
//! Every error goes through [`error::ApiError::into_response`].

pub mod error;
pub mod openai;
pub mod stream;

use crate::engine::chat::{ChatError, ChatTemplate};
use crate::engine::scheduler::{Admission, Event, NewRequest, RequestId};
use crate::engine::service::EngineHandle;
use crate::telemetry;
use crate::tenancy::{Tenant, Tenants};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};
use bytes::Bytes;
use error::ApiError;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use metrics_exporter_prometheus::PrometheusHandle;
use openai::{ChatRequest, Common, CompletionRequest, Endpoint, Prompt, ResponseMeta};
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use stream::{finish_error, SseBody, Tracker};
use subtle::ConstantTimeEq;
use tracing::Instrument;

/// How long a client may take to send its body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes beyond `server.body_bytes_max` read and dropped before a 413
/// (larger bodies are answered at once; the client may see a reset).
pub const BODY_DISCARD_BYTES_MAX: u64 = 8 << 20;

/// Everything the handlers share.
pub struct App {
    /// Tenants and their key digests.
    pub tenants: Tenants,
    /// The engine thread.
    pub engine: EngineHandle,
    /// The static admission check (the promised context).
    pub admission: Admission,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// The served model's id.
    pub model_id: String,
    /// Unix seconds at start-up (the model's `created`).
    pub created: u64,
    /// `server.body_bytes_max`.
    pub body_bytes_max: u64,
    /// `server.request_timeout_ms`.
    pub request_timeout: Duration,
    /// SHA-256 of the admin token.
    pub admin_token_sha256: [u8; 32],
    /// The capacity table as JSON (`GET /v1/capacity`).
    pub capacity: serde_json::Value,
    /// The Prometheus recorder.
    pub metrics: PrometheusHandle,
    /// Set once a shutdown began: new requests get 503, `/readyz` fails.
    pub shutting_down: AtomicBool,
    /// Request ids are unique within the process.
    pub next_request_id: AtomicU64,
    /// Random per process, so response ids differ across restarts.
    pub id_nonce: u64,
}

impl App {
    fn request_id(&self) -> RequestId {
        RequestId(self.next_request_id.fetch_add(1, Ordering::Relaxed))
    }

    fn tenant(&self, headers: &HeaderMap) -> Option<&Tenant> {
        self.tenants.authenticate(bearer(headers)?)
    }

    fn is_admin(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|token| {
            let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            bool::from(digest.ct_eq(&self.admin_token_sha256))
        })
    }

    fn tenant_names(&self) -> Vec<String> {
        self.tenants.all().iter().map(|t| t.name.clone()).collect()
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The inference listener's routes (plus `/healthz`, `/readyz`).
pub fn inference_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(app)
}

/// The admin listener's routes. `/healthz`, `/readyz` and `/metrics` are open
/// (probes and scrapers; content-free by I9); everything else needs the token.
pub fn admin_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/capacity", get(capacity))
        .fallback(not_found)
        .with_state(app)
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(Body::from(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

async fn healthz() -> Response<Body> {
    json(StatusCode::OK, &serde_json::json!({"status": "ok"}))
}

async fn readyz(State(app): State<Arc<App>>) -> Response<Body> {
    if app.engine.is_accepting() && !app.shutting_down.load(Ordering::SeqCst) {
        json(StatusCode::OK, &serde_json::json!({"status": "ready"}))
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"status": "not ready"}),
        )
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response<Body> {
    telemetry::publish_engine_stats(&app.engine.stats(), &app.tenant_names());
    app.metrics.run_upkeep();
    let mut response = Response::new(Body::from(app.metrics.render()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    response
}

async fn capacity(State(app): State<Arc<App>>, headers: HeaderMap) -> Response<Body> {
    if !app.is_admin(&headers) {
        return ApiError::AdminUnauthenticated.into_response(app.request_id(), None);
    }
    json(StatusCode::OK, &app.capacity)
}

async fn not_found(State(app): State<Arc<App>>) -> Response<Body> {
    ApiError::NotFound.into_response(app.request_id(), None)
}

fn model_object(app: &App) -> serde_json::Value {
    serde_json::json!({
        "id": app.model_id, "object": "model", "created": app.created, "owned_by": "bulkhead",
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response<Body> {
    if app.tenant(&headers).is_none() {
        return ApiError::Unauthenticated.into_response(app.request_id(), None);
    }
    json(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": [model_object(&app)]}),
    )
}

async fn model(
    State(app): State<Arc<App>>,
    Path(model): Path<String>,
    headers: HeaderMap,
) -> Response<Body> {
    let id = app.request_id();
    let Some(tenant) = app.tenant(&headers) else {
        return ApiError::Unauthenticated.into_response(id, None);
    };
    if model != app.model_id {
        return ApiError::ModelNotFound(model).into_response(id, Some(&tenant.name));
    }
    json(StatusCode::OK, &model_object(&app))
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    infer(app, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    infer(app, headers, body, Endpoint::Completions).await
}

/// Authenticates, then runs the request in a span with its id and tenant.
async fn infer(
    app: Arc<App>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response<Body> {
    let arrived = Instant::now();
    let id = app.request_id();
    let mut response = match app.tenant(&headers) {
        None => ApiError::Unauthenticated.into_response(id, None),
        Some(tenant) => {
            let span = tracing::info_span!("request", request_id = id.0, tenant = %tenant.name);
            match run(&app, tenant, id, arrived, &headers, body, endpoint)
                .instrument(span)
                .await
            {
                Ok(response) => response,
                Err(error) => error.into_response(id, Some(&tenant.name)),
            }
        }
    };
    if let Ok(value) = HeaderValue::from_str(&id.0.to_string()) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

async fn read_body(body: Body, headers: &HeaderMap, limit: u64) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > limit) {
        if len <= limit.saturating_add(BODY_DISCARD_BYTES_MAX) {
            // Read and drop it, so the client (still sending) gets the 413
            // instead of a reset connection.
            let _ = tokio::time::timeout(BODY_READ_TIMEOUT, discard(body)).await;
        }
        return Err(ApiError::BodyTooLarge { limit });
    }
    // `limit` <= config::BODY_BYTES_LIMIT (64 MiB), so it fits a usize.
    let limited = Limited::new(body, limit as usize);
    match tokio::time::timeout(BODY_READ_TIMEOUT, limited.collect()).await {
        Err(_) => Err(ApiError::BodyTimeout {
            secs: BODY_READ_TIMEOUT.as_secs(),
        }),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::BodyTooLarge { limit })
        }
        Ok(Err(_)) => Err(ApiError::BodyRead),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

async fn discard(mut body: Body) {
    while let Some(Ok(_)) = body.frame().await {}
}

/// What the prompt is made of, before tokenization.
enum Source {
    Chat(Vec<crate::engine::chat::Message>),
    Completion(Prompt),
}

fn tokenize(app: &App, source: Source) -> Result<Vec<u32>, ApiError> {
    match source {
        Source::Chat(messages) => {
            let template = app.template.as_ref().ok_or_else(|| ApiError::Unsupported {
                param: "messages".into(),
                reason: "cannot be used: the model has no chat template; use /v1/completions"
                    .into(),
            })?;
            template
                .tokens(&app.tokenizer, &messages)
                .map_err(|e| match e {
                    // Rendered with sentinels in place of content: the message
                    // holds template text only.
                    ChatError::Template(message) => ApiError::InvalidValue {
                        param: "messages".into(),
                        message: format!("the chat template refused the conversation: {message}"),
                    },
                    other => ApiError::Internal(format!("chat tokenization: {other}")),
                })
        }
        Source::Completion(Prompt::Text(text)) => app
            .tokenizer
            .encode(
                &text,
                EncodeOptions {
                    add_bos: app.tokenizer.add_bos(),
                    parse_special: false,
                },
            )
            .map_err(|e| ApiError::Internal(format!("tokenization: {e}"))),
        Source::Completion(Prompt::Tokens(ids)) => {
            let vocab = app.tokenizer.vocab_len();
            if ids.iter().any(|&id| id as usize >= vocab) {
                return Err(ApiError::InvalidValue {
                    param: "prompt".into(),
                    message: format!("token ids must be below {vocab}"),
                });
            }
            Ok(ids)
        }
    }
}

/// Steps 2–7 of the module doc.
async fn run(
    app: &Arc<App>,
    tenant: &Tenant,
    id: RequestId,
    arrived: Instant,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response<Body>, ApiError> {
    if app.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::Unavailable);
    }
    let bytes = read_body(body, headers, app.body_bytes_max).await?;
    let (common, source): (Common, Source) = match endpoint {
        Endpoint::Chat => {
            let r = ChatRequest::parse(&bytes)?;
            (r.common, Source::Chat(r.messages))
        }
        Endpoint::Completions => {
            let r = CompletionRequest::parse(&bytes)?;
            (r.common, Source::Completion(r.prompt))
        }
    };
    drop(bytes);
    if common.model != app.model_id {
        return Err(ApiError::ModelNotFound(common.model));
    }
    let worker = Arc::clone(app);
    let prompt = tokio::task::spawn_blocking(move || tokenize(&worker, source))
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))??;
    let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    let context = app.admission.context_tokens;
    let max_tokens = common.max_tokens.unwrap_or_else(|| {
        context
            .saturating_sub(prompt_tokens)
            .clamp(1, openai::MAX_TOKENS_DEFAULT)
    });
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let request = NewRequest {
        id,
        tenant: tenant.id,
        prompt,
        max_tokens,
        sampling: common.sampling.clone(),
        stop: common.stop.clone(),
        deadline: arrived + app.request_timeout,
        events,
    };
    let admitted = app
        .admission
        .admit(request)
        .map_err(|rejection| ApiError::Rejected {
            rejection,
            prompt_param: endpoint.prompt_param(),
        })?;
    tracing::info!(
        request_id = id.0,
        tenant = %tenant.name,
        prompt_tokens,
        max_tokens,
        stream = common.stream,
        pages = admitted.pages_needed(),
        "admitted"
    );
    app.engine.submit(admitted).await?;
    let meta = ResponseMeta {
        id: format!(
            "{}{:08x}{:08x}",
            endpoint.id_prefix(),
            app.id_nonce as u32,
            id.0
        ),
        created: unix_now(),
        model: app.model_id.clone(),
        endpoint,
    };
    let tracker = Tracker::new(id, &tenant.name, arrived);
    if common.stream {
        let body = SseBody::new(receiver, meta, common.include_usage, tracker);
        let mut response = Response::new(Body::new(body));
        let h = response.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(response);
    }
    collect(receiver, meta, tracker).await
}

/// Waits for the whole completion (a dropped future drops the receiver,
/// which cancels the request).
async fn collect(
    mut receiver: tokio::sync::mpsc::UnboundedReceiver<Event>,
    meta: ResponseMeta,
    mut tracker: Tracker,
) -> Result<Response<Body>, ApiError> {
    let mut text = String::new();
    while let Some(event) = receiver.recv().await {
        tracker.observe(&event);
        match event {
            Event::Text(piece) => text.push_str(&piece),
            Event::Finished { reason, usage } => {
                if let Some(error) = finish_error(reason) {
                    return Err(error);
                }
                return Ok(json(StatusCode::OK, &meta.response(text, reason, usage)));
            }
        }
    }
    Err(ApiError::Internal(
        "the engine dropped a request without finishing it".into(),
    ))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
