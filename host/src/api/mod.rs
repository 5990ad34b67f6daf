//! The HTTP surface (DESIGN.md §3, §6): the inference routes a tenant calls
//! with its API key, and the admin routes an operator calls with the admin token.
//!
//! A request's path through `infer`:
//!
//! 1. **Authenticate** the bearer key → tenant (401 otherwise), and take one of
//!    the tenant's `pending_max` permits (429 `too_many_pending` otherwise): work
//!    before admission — reading, parsing, tokenizing, submitting — is bounded
//!    per tenant, so one tenant cannot take the CPU or the engine's inbox from
//!    another before its queue limits apply.
//! 2. **Read** the body under `server.body_bytes_max` (413) and a read deadline.
//! 3. **Parse** and validate the OpenAI parameters ([`openai`]) in the
//!    tenant's turn on the request [`lane`](crate::lane) (a body's JSON and its schemas'
//!    patterns are CPU work a tenant causes, tens of milliseconds at their
//!    bounds); resolve the model
//!    in the catalog among those the tenant may use (404 `model_not_found` for
//!    one it may not use, exactly as for one that does not exist); refuse a
//!    prompt whose byte count alone proves it too long (400
//!    `context_length_exceeded`, before any tokenization work).
//! 4. **Tokenize** (the model's chat template for chat) in the tenant's turn on
//!    the request [`lane`](crate::lane), stopping once the prompt cannot fit: a lone
//!    prompt in the same job as its parsing, where step 3's checks pass (one
//!    turn of the lane, not two); a batch of completion prompts, each in its
//!    own turn, every one checked before any is submitted.
//! 5. **Route**: when the tenant has policy plugins and may use more than one
//!    model, the chain may pick another of those models (`route`); the prompt
//!    is then tokenized again for it.
//! 6. **Admit** statically (I1) against the serving model's contract — a 400
//!    `context_length_exceeded` here touches no page, queue or plugin state —
//!    then through the policy chain (`admit`).
//! 7. **Submit** to the model's engine thread, each of its `n` choices (of
//!    each prompt of a batch) a sequence of its own, all queued together or
//!    none: queued, or 429
//!    (`Retry-After`) / 503. The permit of step 1 is held until the engine answers, so an
//!    engine's inbox holds at most `pending_max` submissions of any one tenant.
//! 8. **Answer**: one JSON body, or an SSE stream whose body owns the event
//!    receiver, so a client disconnect cancels the request.
//!
//! Every error goes through [`error::ApiError::into_response`].

pub mod admin;
pub mod console;
pub mod error;
pub mod gateway;
pub mod guard;
pub mod ids;
pub mod openai;
pub mod stream;
pub mod tenant;
pub mod tokens;
pub mod tools;

use crate::catalog::Served;
use crate::clock::now_ms;
use crate::engine::chat::ChatError;
use crate::engine::placement::Placement;
use crate::engine::request::{Event, NewRequest, RequestId};
use crate::policy::{plugin_headers, AdmitInput, PolicyRuntime, Route, Verdict};
use crate::telemetry;
use crate::tenancy::control::{self, Control};
use crate::tenancy::{Tenant, TenantId};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use bulkhead_kernels::tokenizer::{DecodeOptions, EncodeOptions, TokenizerError};
use bytes::Bytes;
use error::ApiError;
use guard::OutputGuard;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use ids::RequestIds;
use metrics_exporter_prometheus::PrometheusHandle;
use openai::{ChatRequest, Common, CompletionRequest, Endpoint, Prompt, ResponseMeta};
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use stream::{collect, usage_of_choices, ChoicesSse, LogprobsOut, SseBody, Tracker};
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument;

/// How long a client may take to send its body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes beyond `server.body_bytes_max` read and dropped before a 413
/// (larger bodies are answered at once; the client may see a reset).
pub const BODY_DISCARD_BYTES_MAX: u64 = 8 << 20;

/// A request refused before its body was read (401, 429 `too_many_pending`)
/// has a body of at most this many bytes read and dropped, so its client —
/// likely still sending — gets the answer rather than a reset connection.
pub const REFUSED_BODY_DRAIN_BYTES_MAX: u64 = 64 << 10;
/// How long such a body may take to arrive; a slower one is left unread.
pub const REFUSED_BODY_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The serving plane's own parts (the models are in the control plane's
/// catalog: [`Control::catalog`]).
pub struct Serving {
    /// Where prompts are tokenized and plugins run, tenants in turn.
    pub lane: crate::lane::Lane,
    /// `server.body_bytes_max`.
    pub body_bytes_max: u64,
    /// `server.request_timeout_ms`.
    pub request_timeout: Duration,
    /// `server.canary_guard`.
    pub canary_guard: bool,
    /// Role `prefill`: no inference for clients (421 `prefill_only`).
    pub prefill_only: bool,
}

/// Everything the handlers share, by plane.
pub struct App {
    /// Serving: the lane and the limits of a request.
    pub serving: Serving,
    /// The control plane: tenants, keys, quotas, plugins, usage, audit.
    pub control: Arc<Control>,
    /// The policy plugins.
    pub policy: Arc<PolicyRuntime>,
    /// The Prometheus recorder.
    pub metrics: PrometheusHandle,
    /// Set once a shutdown began: new requests get 503, `/readyz` fails.
    pub shutting_down: AtomicBool,
    /// Request ids (a keyed permutation: unique, and their gaps say nothing).
    pub ids: RequestIds,
}

impl App {
    fn request_id(&self) -> RequestId {
        self.ids.next()
    }

    fn tenant(&self, headers: &HeaderMap) -> Option<Arc<Tenant>> {
        self.control.registry().authenticate(bearer(headers)?)
    }

    /// Model `id`, if it is in the catalog and `tenant` may use it: a model
    /// it may not use is exactly as absent as one that does not exist.
    fn served(&self, tenant: &Tenant, id: &str) -> Option<Arc<Served>> {
        if !tenant.models.allows(id) {
            return None;
        }
        self.control.catalog().snapshot().get(id).cloned()
    }

    /// The ids of the models `tenant` may use, in catalog order.
    fn candidates(&self, tenant: &Tenant) -> Vec<String> {
        self.control
            .catalog()
            .snapshot()
            .all()
            .filter(|m| tenant.models.allows(&m.spec.id))
            .map(|m| m.spec.id.clone())
            .collect()
    }

    fn is_admin(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|token| {
            let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            self.control.is_admin_token(&digest)
        })
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
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .merge(tenant::router(Arc::clone(&app)))
        .merge(gateway::router())
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(app)
}

/// The admin listener's routes: `/healthz`, `/readyz` and `/metrics` are open
/// (probes and scrapers; content-free by I9), as are the OpenAPI document and
/// the operator console's static files ([`console`]); everything under
/// `/admin/v1/` needs the admin token ([`admin`]).
pub fn admin_router(app: Arc<App>) -> Router {
    admin::router(Arc::clone(&app))
        .merge(console::router())
        .route("/healthz", get(healthz))
        .route("/readyz", get(admin_readyz))
        .route("/metrics", get(metrics))
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
    liveness(bulkhead_kernels::backend::cuda::lost())
}

/// Alive, unless the process's GPU context was lost (one of CUDA's sticky
/// errors: `lost` says which): then nothing more runs on the GPU until the
/// process restarts, and a failing liveness probe is how an orchestrator
/// learns to restart it.
fn liveness(lost: Option<&str>) -> Response<Body> {
    match lost {
        None => json(StatusCode::OK, &serde_json::json!({"status": "ok"})),
        Some(why) => json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"status": "gpu lost", "error": why}),
        ),
    }
}

/// Ready: not shutting down, the process's GPU context not lost, and every
/// model of the catalog accepting. The inference listener says only that
/// (its callers are tenants, who must not learn the catalog); the admin
/// listener lists every model.
fn readiness(app: &App) -> (bool, serde_json::Map<String, serde_json::Value>) {
    let gpu_lost = bulkhead_kernels::backend::cuda::lost().is_some();
    let mut models = serde_json::Map::new();
    let mut ready =
        !app.shutting_down.load(Ordering::SeqCst) && !app.control.refusing() && !gpu_lost;
    for model in app.control.catalog().snapshot().all() {
        // Role decode: a model is ready once a prefill peer pairs for it.
        let paired = model
            .transfer
            .as_ref()
            .is_none_or(|t| !t.decode || t.link.paired.load(Ordering::Relaxed));
        let state = model_state(
            model.engine.is_accepting() && paired,
            matches!(model.placement, Placement::Cuda(_)),
            gpu_lost,
        );
        ready &= state == "ready";
        models.insert(model.spec.id.clone(), state.into());
    }
    (ready, models)
}

/// A model's word in the admin `/readyz`. A model on the GPU is not ready
/// from the moment the process's context is lost, whether or not its own
/// engine has stepped since (an idle one learns it at its next step); the
/// whole process is then not ready (and not alive, `/healthz`), so that no
/// new request comes to it before the orchestrator restarts it.
fn model_state(accepting: bool, on_gpu: bool, gpu_lost: bool) -> &'static str {
    match (accepting, on_gpu && gpu_lost) {
        (_, true) => "not ready (gpu lost)",
        (true, false) => "ready",
        (false, false) => "not ready",
    }
}

/// The store's state as `/readyz` shows it: `away` while a shared store
/// cannot be reached (ready or not as `[store] offline` says).
fn store_state(app: &App) -> &'static str {
    if app.control.store_connected() {
        "connected"
    } else if app.control.refusing() {
        "away (refusing requests)"
    } else {
        "away (serving with the last state seen)"
    }
}

async fn readyz(State(app): State<Arc<App>>) -> Response<Body> {
    let (ready, _) = readiness(&app);
    let store = store_state(&app);
    if ready {
        json(
            StatusCode::OK,
            &serde_json::json!({"status": "ready", "store": store}),
        )
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"status": "not ready", "store": store}),
        )
    }
}

async fn admin_readyz(State(app): State<Arc<App>>) -> Response<Body> {
    let (ready, models) = readiness(&app);
    let (status, word) = if ready {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    };
    // Where each model computes: "cpu", or "cuda (NVIDIA H200, sm_90)".
    let backends: serde_json::Map<String, serde_json::Value> = app
        .control
        .catalog()
        .snapshot()
        .all()
        .map(|m| (m.spec.id.clone(), m.backend.clone().into()))
        .collect();
    json(
        status,
        &serde_json::json!({"status": word, "models": models, "backends": backends, "store": store_state(&app)}),
    )
}

async fn metrics(State(app): State<Arc<App>>) -> Response<Body> {
    let directory = app.control.registry().snapshot();
    let catalog = app.control.catalog().snapshot();
    let models: Vec<_> = catalog
        .all()
        .map(|m| (m.spec.id.clone(), m.engine.stats()))
        .collect();
    telemetry::publish_engine_stats(&models, |id| {
        directory.tenant(TenantId(id)).map(|t| t.name.clone())
    });
    app.metrics.run_upkeep();
    let mut response = Response::new(Body::from(app.metrics.render()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    response
}

async fn not_found(State(app): State<Arc<App>>) -> Response<Body> {
    ApiError::NotFound.into_response(app.request_id(), None)
}

/// A model as OpenAI lists it, with vLLM's `max_model_len` (the context it
/// promises: prompt plus generated tokens), which clients read to size
/// their prompts.
fn model_object(model: &Served) -> serde_json::Value {
    serde_json::json!({
        "id": model.spec.id, "object": "model", "created": model.created, "owned_by": "bulkhead",
        "max_model_len": model.admission.context_tokens(),
    })
}

/// The models the tenant may use (only those: the catalog is not anyone's to
/// browse).
async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response<Body> {
    let Some(tenant) = app.tenant(&headers) else {
        return ApiError::Unauthenticated.into_response(app.request_id(), None);
    };
    let catalog = app.control.catalog().snapshot();
    let data: Vec<_> = catalog
        .all()
        .filter(|m| tenant.models.allows(&m.spec.id))
        .map(|m| model_object(m))
        .collect();
    json(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": data}),
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
    match app.served(&tenant, &model) {
        Some(served) => json(StatusCode::OK, &model_object(&served)),
        None => ApiError::ModelNotFound(model).into_response(id, Some(&tenant.name)),
    }
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
        _ if app.serving.prefill_only => {
            drain_refused(body, &headers).await;
            ApiError::PrefillOnly.into_response(id, None)
        }
        _ if app.control.refusing() => {
            drain_refused(body, &headers).await;
            ApiError::StoreUnavailable("[store] offline = \"refuse\"".into())
                .into_response(id, None)
        }
        None => {
            drain_refused(body, &headers).await;
            ApiError::Unauthenticated.into_response(id, None)
        }
        Some(tenant) => {
            let result = match Arc::clone(&tenant.pending).try_acquire_owned() {
                Err(_) => {
                    drain_refused(body, &headers).await;
                    Err(ApiError::TooManyPending)
                }
                Ok(pending) => {
                    let span =
                        tracing::info_span!("request", request_id = id.0, tenant = %tenant.name);
                    let mut unsent = Abandonment {
                        app: &app,
                        tenant: &tenant,
                        id,
                        armed: true,
                    };
                    let result = run(
                        &app,
                        &tenant,
                        Arc::new(pending),
                        id,
                        arrived,
                        &headers,
                        body,
                        endpoint,
                        &mut unsent,
                    )
                    .instrument(span)
                    .await;
                    unsent.armed = false;
                    result
                }
            };
            result.unwrap_or_else(|error| {
                refused(&app, &tenant, id, &error);
                error.into_response(id, Some(&tenant.name))
            })
        }
    };
    if let Ok(value) = HeaderValue::from_str(&id.0.to_string()) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// A request of an authenticated tenant on its way to the engine: dropped
/// armed — its client left before the request was submitted or answered —
/// it is counted (`bulkhead_requests_abandoned_total`) and recorded in usage
/// as `cancelled`. Whatever work it left queued goes with it (the lane
/// withdraws it); what is running holds the request's permit until it ends.
struct Abandonment<'a> {
    app: &'a App,
    tenant: &'a Tenant,
    id: RequestId,
    armed: bool,
}

impl Drop for Abandonment<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        telemetry::count_abandoned(&self.tenant.name);
        self.app
            .control
            .usage_book()
            .record(self.tenant.id, now_ms(), "cancelled", 0, 0);
        tracing::info!(request_id = self.id.0, tenant = %self.tenant.name, "client left before the request was submitted");
    }
}

/// Accounts a refused request of an authenticated tenant: its usage (by error
/// code) and an audit record with the code and sizes — never its text.
fn refused(app: &App, tenant: &Tenant, id: RequestId, error: &ApiError) {
    let now = now_ms();
    let book = app.control.usage_book();
    book.record(tenant.id, now, error.code(), 0, 0);
    let mut record = control::audit(
        &control::Actor::Tenant(tenant.name.clone()),
        "request.refused",
        &id.0.to_string(),
    );
    record.at_ms = now;
    record
        .detail
        .insert("status".into(), error.status().as_u16().into());
    record.detail.insert("code".into(), error.code().into());
    for (field, value) in error.sizes() {
        record.detail.insert(field.into(), value.into());
    }
    book.refused(tenant.id, &tenant.name, error.code(), record);
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Reads and drops the body of a refused request when it is small and prompt
/// (see [`REFUSED_BODY_DRAIN_BYTES_MAX`]); holds no tenant's permit.
async fn drain_refused(body: Body, headers: &HeaderMap) {
    if content_length(headers).is_some_and(|len| len > REFUSED_BODY_DRAIN_BYTES_MAX) {
        return;
    }
    // At most REFUSED_BODY_DRAIN_BYTES_MAX (64 KiB) is buffered.
    let limited = Limited::new(body, REFUSED_BODY_DRAIN_BYTES_MAX as usize);
    let _ = tokio::time::timeout(REFUSED_BODY_DRAIN_TIMEOUT, limited.collect()).await;
}

async fn read_body(body: Body, headers: &HeaderMap, limit: u64) -> Result<Bytes, ApiError> {
    if let Some(len) = content_length(headers).filter(|&len| len > limit) {
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
#[derive(Clone)]
enum Source {
    Chat(
        Vec<crate::engine::chat::Message>,
        Vec<crate::engine::chat::Tool>,
    ),
    Completion(Prompt),
}

impl Source {
    /// The prompt's text (chat contents joined by newlines, then each
    /// earlier call's and each tool's JSON); None for token ids.
    fn text(&self) -> Option<Arc<str>> {
        match self {
            Source::Chat(messages, tools) => {
                let mut texts: Vec<String> = messages.iter().map(|m| m.content.clone()).collect();
                for call in messages.iter().flat_map(|m| &m.tool_calls) {
                    let arguments = serde_json::Value::Object(call.arguments.clone());
                    texts.push(format!("{} {arguments}", call.name));
                }
                for tool in tools {
                    let parameters = tool.parameters.clone().unwrap_or_default();
                    let description = tool.description.as_deref().unwrap_or("");
                    texts.push(format!("{} {description} {parameters}", tool.name));
                }
                Some(texts.join("\n").into())
            }
            Source::Completion(Prompt::Text(text)) => Some(text.as_str().into()),
            Source::Completion(Prompt::Tokens(_)) => None,
        }
    }

    /// The fewest tokens the prompt can be, known without tokenizing: its text's
    /// bytes over the most bytes one token covers (the chat template only adds
    /// tokens), or the count of token ids.
    fn tokens_min(&self, text_bytes_per_token_max: u64) -> u64 {
        let text_bytes: u64 = match self {
            Source::Chat(messages, _) => messages.iter().map(|m| m.content.len() as u64).sum(),
            Source::Completion(Prompt::Text(text)) => text.len() as u64,
            Source::Completion(Prompt::Tokens(ids)) => return ids.len() as u64,
        };
        text_bytes.div_ceil(text_bytes_per_token_max)
    }
}

/// `auto` tool calls are read in the markup `model`'s template teaches:
/// refused where it teaches none this server reads.
fn calls_for(
    model: &Served,
    calls: Option<tools::CallsOut>,
) -> Result<Option<tools::CallsOut>, ApiError> {
    use crate::engine::chat::CallMarkup;
    use tools::CallsOut::{Bare, Tagged};
    let (Some(Tagged(names)) | Some(Bare(names))) = calls else {
        return Ok(calls);
    };
    match model.template.as_ref().and_then(|t| t.call_markup()) {
        Some(CallMarkup::Hermes) => Ok(Some(Tagged(names))),
        Some(CallMarkup::BareJson) => Ok(Some(Bare(names))),
        None => Err(tools::auto_refused()),
    }
}

/// `logit_bias` and `stop_token_ids` name tokens of the model's vocabulary only.
fn check_token_ids(model: &Served, common: &Common) -> Result<(), ApiError> {
    let vocab = model.tokenizer.vocab_len();
    let sampling = &common.sampling;
    // Both sorted by id: the last is the largest.
    for (param, largest) in [
        ("logit_bias", sampling.logit_bias.last().map(|&(id, _)| id)),
        ("stop_token_ids", sampling.stop_token_ids.last().copied()),
    ] {
        if largest.is_some_and(|id| id as usize >= vocab) {
            return Err(ApiError::InvalidValue {
                param: param.into(),
                message: format!("token ids must be below {vocab}"),
            });
        }
    }
    Ok(())
}

/// The prompt's tokens; `Ok(None)` when it has more than `tokens_max` (the
/// tokenizer stopped there).
///
/// Tokenizing stops once `cancel` is set (its client left); the error then
/// goes to nobody.
fn tokenize(
    model: &Served,
    source: &Source,
    tokens_max: u64,
    cancel: &crate::lane::Cancel,
) -> Result<Option<Vec<u32>>, ApiError> {
    let tokens_max = usize::try_from(tokens_max).unwrap_or(usize::MAX);
    let stopped = || cancel.is_cancelled();
    let too_many = |e: &TokenizerError| matches!(e, TokenizerError::TooManyTokens { .. });
    match source {
        Source::Chat(messages, tools) => {
            let template = model
                .template
                .as_ref()
                .ok_or_else(|| ApiError::Unsupported {
                    param: "messages".into(),
                    reason: "cannot be used: the model has no chat template; use /v1/completions"
                        .into(),
                })?;
            match template.tokens_max(&model.tokenizer, messages, tools, tokens_max, &stopped) {
                Ok(ids) => Ok(Some(ids)),
                Err(ChatError::Tokenizer(e)) if too_many(&e) => Ok(None),
                Err(e) => Err(match e {
                    // Rendered with sentinels in place of content: the message
                    // holds template text only.
                    ChatError::Template(message) => ApiError::InvalidValue {
                        param: "messages".into(),
                        message: format!("the chat template refused the conversation: {message}"),
                    },
                    other => ApiError::Internal(format!("chat tokenization: {other}")),
                }),
            }
        }
        Source::Completion(Prompt::Text(text)) => {
            let options = EncodeOptions {
                add_bos: model.tokenizer.add_bos(),
                parse_special: false,
            };
            let mut ids = Vec::new();
            match model
                .tokenizer
                .encode_into_until(text, options, tokens_max, &mut ids, &stopped)
            {
                Ok(()) => Ok(Some(ids)),
                Err(e) if too_many(&e) => Ok(None),
                Err(e) => Err(ApiError::Internal(format!("tokenization: {e}"))),
            }
        }
        Source::Completion(Prompt::Tokens(ids)) => {
            let vocab = model.tokenizer.vocab_len();
            if ids.iter().any(|&id| id as usize >= vocab) {
                return Err(ApiError::InvalidValue {
                    param: "prompt".into(),
                    message: format!("token ids must be below {vocab}"),
                });
            }
            Ok(Some(ids.clone()))
        }
    }
}

/// The refusal of prompt `index` of a request; one of a batch says which.
fn rejected_at(
    endpoint: Endpoint,
    batch: bool,
    index: usize,
) -> impl Fn(crate::engine::request::Rejection) -> ApiError {
    move |rejection| ApiError::Rejected {
        rejection,
        prompt_param: endpoint.prompt_param(),
        batch_index: batch.then_some(index),
    }
}

/// The refusals made before any tokenization work, with nothing spent: a
/// token id past the vocabulary, a prompt too long by its size alone, a batch
/// or several choices for a tenant with plugins, more sequences than the
/// tenant's queue. `run` makes them, and a request's parsing job tokenizes
/// its lone prompt only where they pass (see [`early_tokens`]).
fn refuse_before_tokens(
    app: &App,
    tenant: &Tenant,
    model: &Served,
    common: &Common,
    sources: &[Source],
    endpoint: Endpoint,
) -> Result<(), ApiError> {
    check_token_ids(model, common)?;
    let batch = sources.len() > 1;
    for (index, source) in sources.iter().enumerate() {
        let tokens_min = source.tokens_min(model.text_bytes_per_token_max);
        model
            .admission
            .check_size(tokens_min, common.max_tokens)
            .map_err(rejected_at(endpoint, batch, index))?;
    }
    let has_chain = app.policy.has_chain(tenant.id);
    // A plugin sees one sequence's sizes and usage per request (the WIT
    // contract has no count of choices or prompts): its budgets would see a
    // fraction.
    if batch && has_chain {
        return Err(ApiError::Unsupported {
            param: "prompt".into(),
            reason: "a batch of several prompts is not supported for a tenant with policy plugins (they see one sequence per request)".into(),
        });
    }
    if common.n > 1 && has_chain {
        return Err(ApiError::Unsupported {
            param: "n".into(),
            reason: "above 1 is not supported for a tenant with policy plugins (they see one sequence per request)".into(),
        });
    }
    // The request's sequences are queued together or not at all: more than
    // the tenant's whole queue would be a 429 however long its client waited.
    let sequences = sources.len() as u64 * u64::from(common.n);
    let queue_depth_max = u64::from(tenant.quota.queue_depth_max);
    if sequences > queue_depth_max {
        let param = if batch { "prompt" } else { "n" };
        return Err(ApiError::InvalidValue {
            param: param.into(),
            message: format!(
                "this request makes {sequences} sequences ({} prompts, n = {}), and they are queued together; this tenant's queue holds {queue_depth_max}",
                sources.len(),
                common.n
            ),
        });
    }
    Ok(())
}

/// Steps 2–7 of the module doc; `pending` is the tenant's permit of step 1,
/// shared with the lane jobs the request queues (so it is held until they
/// are gone, even when the request is dropped first).
#[allow(clippy::too_many_arguments)]
async fn run(
    app: &Arc<App>,
    tenant: &Arc<Tenant>,
    pending: Arc<OwnedSemaphorePermit>,
    id: RequestId,
    arrived: Instant,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
    unsent: &mut Abandonment<'_>,
) -> Result<Response<Body>, ApiError> {
    if app.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::Unavailable);
    }
    let bytes = read_body(body, headers, app.serving.body_bytes_max).await?;
    let ((common, mut sources, calls, echo), mut early) =
        parse_on_lane(app, tenant, &pending, bytes, endpoint)
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
    let Some(mut model) = app.served(tenant, &common.model) else {
        return Err(ApiError::ModelNotFound(common.model));
    };
    let mut calls = calls_for(&model, calls)?;
    refuse_before_tokens(app, tenant, &model, &common, &sources, endpoint)?;
    let has_chain = app.policy.has_chain(tenant.id);
    let batch = sources.len() > 1;
    let rejected = |rejection| ApiError::Rejected {
        rejection,
        prompt_param: endpoint.prompt_param(),
        batch_index: None,
    };
    // Operator plugins may read the text, when the deployment says so (a
    // tenant with plugins sends one prompt).
    let prompt_text = app
        .policy
        .wants_prompt_text()
        .then(|| sources[0].text())
        .flatten();
    let candidates = if has_chain {
        app.candidates(tenant)
    } else {
        Vec::new()
    };
    // Kept for a second tokenization only if the chain may route elsewhere
    // (a tenant with plugins sends one prompt).
    let routable = (candidates.len() > 1).then(|| sources[0].clone());
    // An echoed prompt's text as the client sent it (token ids are decoded
    // once the model is known).
    let echo_texts: Option<Vec<Option<String>>> = echo.then(|| {
        sources
            .iter()
            .map(|source| match source {
                Source::Completion(Prompt::Text(text)) => Some(text.clone()),
                _ => None,
            })
            .collect()
    });
    // Each prompt in the tenant's turn, and each held to the static contract
    // before any plugin sees the request (I1): a request admission would
    // refuse never reaches `route` or a plugin's state.
    let mut prompts = Vec::with_capacity(sources.len());
    for (index, source) in sources.drain(..).enumerate() {
        let prompt = match early.take() {
            // Tokenized with the parsing, for this very model.
            Some(early) if Arc::ptr_eq(&early.model, &model) => {
                fitting(&model, early.tokens?, common.max_tokens)
            }
            _ => tokenize_on_lane(app, tenant, &model, source, common.max_tokens, &pending).await?,
        }
        .map_err(rejected_at(endpoint, batch, index))?;
        model
            .admission
            .check(
                prompt.len(),
                max_tokens_of(&model, &common, &prompt),
                common.sampling.prompt_logprobs.is_some(),
            )
            .map_err(rejected_at(endpoint, batch, index))?;
        prompts.push(prompt);
    }
    drop(sources);
    let mut input = AdmitInput {
        request: id,
        tenant: tenant.id,
        tenant_name: tenant.name.clone(),
        model: common.model.clone(),
        chat: endpoint == Endpoint::Chat,
        prompt_tokens: prompt_tokens_of(&prompts[0]),
        max_tokens: max_tokens_of(&model, &common, &prompts[0]),
        stream: common.stream,
        headers: plugin_headers(headers),
        prompt_text,
        engine: model.engine.clone(),
        budget: app.policy.time_budget(),
    };
    // Whatever the chain books or admits reaches the engine or is refused: if
    // this future ends first (an error, a refusal, the client gone), the guard
    // gives the bookings back and tells the plugins.
    let mut chain_guard = Unsubmitted {
        policy: &app.policy,
        request: id,
        prompt_tokens: input.prompt_tokens,
        armed: has_chain,
    };
    if let Some(source) = routable {
        match run_route(app, tenant.id, &input, candidates, &pending).await? {
            Route::Unchanged => {}
            Route::Fault { plugin, kind } => {
                return Err(ApiError::PolicyUnavailable { plugin, kind })
            }
            Route::To { model: to, plugin } if to != model.spec.id => {
                // Routed elsewhere: the access check, the size check and the
                // prompt's tokens are the new model's.
                let Some(routed) = app.served(tenant, &to) else {
                    return Err(ApiError::ModelNotFound(to));
                };
                check_token_ids(&routed, &common)?;
                calls = calls_for(&routed, calls)?;
                tracing::info!(request_id = id.0, tenant = %tenant.name, plugin = %plugin, from = %model.spec.id, to = %routed.spec.id, "routed");
                routed
                    .admission
                    .check_size(
                        source.tokens_min(routed.text_bytes_per_token_max),
                        common.max_tokens,
                    )
                    .map_err(rejected)?;
                let prompt =
                    tokenize_on_lane(app, tenant, &routed, source, common.max_tokens, &pending)
                        .await?
                        .map_err(rejected)?;
                model = routed;
                input.model = model.spec.id.clone();
                input.prompt_tokens = prompt_tokens_of(&prompt);
                input.max_tokens = max_tokens_of(&model, &common, &prompt);
                prompts = vec![prompt];
                input.engine = model.engine.clone();
                chain_guard.prompt_tokens = input.prompt_tokens;
            }
            Route::To { .. } => {}
        }
    }
    let prompt_tokens: u32 = prompts.iter().map(|p| prompt_tokens_of(p)).sum();
    // What each prompt's echoing answers begin with: the prompt's text, and
    // its first token (which has no log probability).
    let echoes: Vec<Option<(String, Vec<u8>)>> = match echo_texts {
        None => vec![None; prompts.len()],
        Some(texts) => texts
            .into_iter()
            .zip(&prompts)
            .map(|(text, prompt)| Some(echo_of(&model, text, prompt)))
            .collect(),
    };
    // Each choice of each prompt is a sequence of its own, with its own id
    // (the first is the request's) and seed: `seed + i` for a prompt's
    // choice `i`, as vLLM seeds them. Choice `i` of prompt `p` is the
    // answer's choice `p * n + i`, as OpenAI and vLLM number them.
    let mut outputs = Vec::with_capacity(prompts.len() * common.n as usize);
    let mut groups = Vec::with_capacity(prompts.len());
    for (prompt, echo) in prompts.into_iter().zip(echoes) {
        let max_tokens = max_tokens_of(&model, &common, &prompt);
        let mut choices = Vec::with_capacity(common.n as usize);
        for index in 0..common.n {
            let (events, receiver) = tokio::sync::mpsc::unbounded_channel::<Event>();
            let choice_id = if outputs.is_empty() {
                id
            } else {
                app.request_id()
            };
            let mut sampling = common.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(u64::from(index));
            let request = NewRequest {
                id: choice_id,
                tenant: tenant.id,
                prompt: prompt.clone(),
                max_tokens,
                sampling,
                stop: common.stop.clone(),
                deadline: arrived + app.serving.request_timeout,
                events,
                cache_salt: common.cache_salt.clone(),
                // Only a decode process asks a peer; the link checks the name.
                prefill_hint: match &model.transfer {
                    Some(t) if t.decode => headers
                        .get(crate::api::gateway::PREFILLER_HOST_PORT)
                        .and_then(|v| v.to_str().ok())
                        .filter(|v| v.len() <= crate::transfer::PEER_ADDR_BYTES_MAX)
                        .map(str::to_string),
                    _ => None,
                },
            };
            choices.push(model.admission.admit(request).map_err(rejected)?);
            outputs.push((choice_id, receiver, echo.clone()));
        }
        groups.push(choices);
    }
    if has_chain {
        match run_chain(app, tenant.id, input, prompt_tokens, &pending).await? {
            Verdict::Admit {
                max_tokens,
                priority,
            } => groups[0][0].tighten(max_tokens, priority),
            Verdict::Reject(rejection) => return Err(ApiError::PolicyRejected(rejection)),
            Verdict::Fault { plugin, kind } => {
                return Err(ApiError::PolicyUnavailable { plugin, kind })
            }
            Verdict::Cancelled => {
                return Err(ApiError::Internal(
                    "the policy chain saw its request cancelled".into(),
                ))
            }
        }
    }
    let pages: u32 = groups.iter().flatten().map(|c| c.pages_needed()).sum();
    let first = &groups[0][0];
    tracing::info!(
        request_id = id.0,
        tenant = %tenant.name,
        model = %model.spec.id,
        prompt_tokens,
        max_tokens = first.max_tokens(),
        priority = first.priority(),
        stream = common.stream,
        pages,
        prompts = groups.len(),
        choices = common.n,
        "admitted"
    );
    if outputs.len() > 1 {
        // Each sequence logs, audits and reports under its own id: the
        // request's for the first, these for the others (in the answer's
        // order of choices).
        let ids: Vec<u64> = outputs[1..]
            .iter()
            .map(|(choice_id, _, _)| choice_id.0)
            .collect();
        tracing::info!(request_id = id.0, choice_ids = ?ids, "choices");
    }
    // All sequences are queued or none (the tenant's queue has room for
    // all); on an error the guard tells the plugins it was refused.
    model.engine.submit_all(groups).await?;
    chain_guard.armed = false;
    // The engine's from here: a client that leaves now cancels it there.
    unsent.armed = false;
    // Queued: the tenant's queue limits govern it from here.
    drop(pending);
    let meta = ResponseMeta {
        // The same number as the log's request_id, x-request-id and the
        // audit log's target: one id to search for everywhere.
        id: format!("{}{}", endpoint.id_prefix(), id.0),
        created: unix_now(),
        model: model.spec.id.clone(),
        endpoint,
        calls,
    };
    // Each choice's events are watched, guarded and reported on their own.
    let single = outputs.len() == 1;
    let outputs = outputs.into_iter().map(|(choice_id, receiver, echo)| {
        let (echo, echo_first) = echo.unzip();
        let logprobs = common.sampling.logprobs.map(|_| {
            let out = LogprobsOut::new(endpoint, OutputGuard::new(app, tenant, choice_id));
            match echo_first {
                Some(first) => out.echoing(first),
                None => out,
            }
        });
        let tracker = Tracker::new(choice_id, &tenant.name, &model.spec.id, arrived);
        let guard = OutputGuard::new(app, tenant, choice_id);
        (receiver, tracker, guard, logprobs, echo)
    });
    if common.stream {
        let body = if single {
            let (receiver, tracker, guard, logprobs, echo) =
                outputs.into_iter().next().expect("one choice");
            let body = SseBody::new(
                receiver,
                meta,
                common.include_usage,
                tracker,
                guard,
                logprobs,
            );
            Body::new(body.echoing(echo))
        } else {
            let streams = outputs
                .enumerate()
                .map(|(index, (receiver, tracker, guard, logprobs, echo))| {
                    SseBody::one_of(
                        index as u32,
                        receiver,
                        meta.clone(),
                        common.include_usage,
                        tracker,
                        guard,
                        logprobs,
                    )
                    .echoing(echo)
                })
                .collect();
            Body::new(ChoicesSse::new(
                streams,
                common.n as usize,
                meta,
                common.include_usage,
            ))
        };
        let mut response = Response::new(body);
        let h = response.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(response);
    }
    let meta_ref = &meta;
    let collecting = outputs
        .enumerate()
        .map(
            |(index, (receiver, tracker, guard, logprobs, echo))| async move {
                collect(
                    index as u32,
                    receiver,
                    meta_ref,
                    tracker,
                    guard,
                    logprobs,
                    echo.as_deref(),
                )
                .await
            },
        )
        .collect();
    let (choices, usages): (Vec<_>, Vec<_>) = all_of(collecting).await?.into_iter().unzip();
    let response = meta.response(choices, usage_of_choices(&usages, common.n as usize));
    Ok(json(StatusCode::OK, &response))
}

/// Runs `futures` at once (each choice's collection watches its events as
/// they come); the first error ends them all, dropping the others (their
/// receivers with them: their sequences are cancelled).
async fn all_of<T, F>(futures: Vec<F>) -> Result<Vec<T>, ApiError>
where
    F: std::future::Future<Output = Result<T, ApiError>>,
{
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (future, done) in futures.iter_mut().zip(done.iter_mut()) {
            if done.is_some() {
                continue;
            }
            match future.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(value)) => *done = Some(value),
                std::task::Poll::Ready(Err(error)) => return std::task::Poll::Ready(Err(error)),
                std::task::Poll::Pending => {}
            }
        }
        if done.iter().all(Option::is_some) {
            std::task::Poll::Ready(Ok(()))
        } else {
            std::task::Poll::Pending
        }
    })
    .await?;
    Ok(done.into_iter().flatten().collect())
}

/// A request's parameters, its prompts' sources, its tool calls' form and
/// whether it echoes.
type Parsed = (Common, Vec<Source>, Option<tools::CallsOut>, bool);

/// A lone prompt's tokens, taken in its request's parsing job (see
/// [`parse_on_lane`]), and the model they are for.
struct Early {
    model: Arc<Served>,
    tokens: Result<Option<Vec<u32>>, ApiError>,
}

/// Parses `bytes` as `endpoint`'s request in the tenant's turn on the lane
/// (holding the request's permit until the job is done, as tokenizing does).
///
/// A request of one prompt is also tokenized in the same job, where the
/// checks `run` makes before tokenizing pass: one turn of the lane for both,
/// so a request waits behind a flooding tenant for one job of it where it
/// waited for two. (A tenant's `route` and `admit` are jobs of their own; a
/// prompt routed to another model is tokenized again, for that model.)
async fn parse_on_lane(
    app: &Arc<App>,
    tenant: &Arc<Tenant>,
    pending: &Arc<OwnedSemaphorePermit>,
    bytes: Bytes,
    endpoint: Endpoint,
) -> Result<Result<(Parsed, Option<Early>), ApiError>, crate::lane::LaneStopped> {
    let pending = Arc::clone(pending);
    let (app_here, tenant_here) = (Arc::clone(app), Arc::clone(tenant));
    app.serving
        .lane
        .run(tenant.id, move |cancel| {
            let _pending = pending;
            let parsed: Parsed = match endpoint {
                Endpoint::Chat => {
                    let r = ChatRequest::parse(&bytes)?;
                    let sources = vec![Source::Chat(r.messages, r.tools)];
                    (r.common, sources, r.calls, false)
                }
                Endpoint::Completions => {
                    let r = CompletionRequest::parse(&bytes)?;
                    let sources = r.prompts.into_iter().map(Source::Completion).collect();
                    (r.common, sources, None, r.echo)
                }
            };
            let early = early_tokens(&app_here, &tenant_here, &parsed, endpoint, cancel);
            Ok((parsed, early))
        })
        .await
}

/// The lone prompt's tokens of a parsed request, unless `run` would refuse
/// it before tokenizing (no such model for the tenant, or any refusal of
/// [`refuse_before_tokens`]): those refusals are `run`'s to make, with
/// nothing spent.
fn early_tokens(
    app: &App,
    tenant: &Tenant,
    (common, sources, _, _): &Parsed,
    endpoint: Endpoint,
    cancel: &crate::lane::Cancel,
) -> Option<Early> {
    let [source] = sources.as_slice() else {
        return None;
    };
    let model = app.served(tenant, &common.model)?;
    refuse_before_tokens(app, tenant, &model, common, sources, endpoint).ok()?;
    let tokens_max = model.admission.prompt_tokens_max(common.max_tokens);
    let tokens = tokenize(&model, source, tokens_max, cancel);
    Some(Early { model, tokens })
}

/// The prompt's tokens, or the refusal of a prompt the tokenizer stopped at
/// `model`'s most prompt tokens with `max_tokens`.
fn fitting(
    model: &Served,
    tokens: Option<Vec<u32>>,
    max_tokens: Option<u32>,
) -> Result<Vec<u32>, crate::engine::request::Rejection> {
    let tokens_max = model.admission.prompt_tokens_max(max_tokens);
    tokens.ok_or_else(|| model.admission.too_long(tokens_max + 1, max_tokens))
}

/// The prompt's tokens for `model`, tokenized in the tenant's turn on the
/// lane; `Ok(Err(_))` when it cannot fit `model`'s context with `max_tokens`
/// (tokenizing stopped there).
async fn tokenize_on_lane(
    app: &Arc<App>,
    tenant: &Tenant,
    model: &Arc<Served>,
    source: Source,
    max_tokens: Option<u32>,
    pending: &Arc<OwnedSemaphorePermit>,
) -> Result<Result<Vec<u32>, crate::engine::request::Rejection>, ApiError> {
    let tokens_max = model.admission.prompt_tokens_max(max_tokens);
    let worker = Arc::clone(model);
    let pending = Arc::clone(pending);
    let prompt = app
        .serving
        .lane
        .run(tenant.id, move |cancel| {
            let _pending = pending;
            tokenize(&worker, &source, tokens_max, cancel)
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(fitting(model, prompt, max_tokens))
}

/// What an echoing answer begins with: the prompt's text (as the client
/// sent it, or its token ids decoded), and its first token's bytes (which
/// has no log probability).
fn echo_of(model: &Served, text: Option<String>, prompt: &[u32]) -> (String, Vec<u8>) {
    let text = text.unwrap_or_else(|| {
        let options = DecodeOptions { skip_special: true };
        model.tokenizer.decode(prompt, options).unwrap_or_default()
    });
    let first = prompt.first().map_or_else(Vec::new, |&id| {
        model
            .tokenizer
            .token_to_piece_bytes(id)
            .map_or_else(|_| Vec::new(), <[u8]>::to_vec)
    });
    (text, first)
}

fn prompt_tokens_of(prompt: &[u32]) -> u32 {
    u32::try_from(prompt.len()).unwrap_or(u32::MAX)
}

/// The request's `max_tokens`, or when not given, what the model's context
/// leaves (at most [`openai::MAX_TOKENS_DEFAULT`]).
fn max_tokens_of(model: &Served, common: &Common, prompt: &[u32]) -> u32 {
    common.max_tokens.unwrap_or_else(|| {
        model
            .admission
            .context_tokens()
            .saturating_sub(prompt_tokens_of(prompt))
            .clamp(1, openai::MAX_TOKENS_DEFAULT)
    })
}

/// Runs the route chain in the tenant's turn on the lane. If the request is
/// dropped meanwhile, a queued job is withdrawn (nothing was asked); a running
/// one stops asking at its next plugin, and whatever it booked is given back
/// once it ends. The request's permit is held until then.
async fn run_route(
    app: &Arc<App>,
    tenant: TenantId,
    input: &AdmitInput,
    candidates: Vec<String>,
    pending: &Arc<OwnedSemaphorePermit>,
) -> Result<Route, ApiError> {
    let (request, prompt_tokens) = (input.request, input.prompt_tokens);
    let input = input.clone();
    let (policy, refuse, pending) = (
        Arc::clone(&app.policy),
        Arc::clone(&app.policy),
        Arc::clone(pending),
    );
    app.serving
        .lane
        .run_or(
            tenant,
            move |cancel| policy.route(&input, &candidates, cancel),
            move |_| {
                refuse.refused(request, prompt_tokens);
                drop(pending);
            },
        )
        .await
        .map_err(|stopped| ApiError::Internal(stopped.to_string()))
}

/// A request the policy chain may have booked budgets for (in `route` or
/// `admit`) that has not reached the engine yet: dropped armed, it is refused,
/// so its bookings come back and, if the chain admitted it, its plugins hear
/// `refused`.
struct Unsubmitted<'a> {
    policy: &'a PolicyRuntime,
    request: RequestId,
    prompt_tokens: u32,
    armed: bool,
}

impl Drop for Unsubmitted<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.policy.refused(self.request, self.prompt_tokens);
        }
    }
}

/// Runs the policy chain in the tenant's turn on the lane. If the request is
/// dropped meanwhile (its client left), a queued job is withdrawn; a running
/// chain stops at its next plugin, and an admit nobody waits for any more is
/// refused at once. The request's permit is held until then.
async fn run_chain(
    app: &Arc<App>,
    tenant: TenantId,
    input: AdmitInput,
    prompt_tokens: u32,
    pending: &Arc<OwnedSemaphorePermit>,
) -> Result<Verdict, ApiError> {
    let request = input.request;
    let (policy, refuse, pending) = (
        Arc::clone(&app.policy),
        Arc::clone(&app.policy),
        Arc::clone(pending),
    );
    app.serving
        .lane
        .run_or(
            tenant,
            move |cancel| policy.admit(input, cancel),
            move |verdict| {
                if let Verdict::Admit { .. } = verdict {
                    refuse.refused(request, prompt_tokens);
                }
                drop(pending);
            },
        )
        .await
        .map_err(|stopped| ApiError::Internal(stopped.to_string()))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(response: Response<Body>) -> serde_json::Value {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn liveness_fails_once_the_gpu_context_is_lost() {
        let alive = liveness(None);
        assert_eq!(alive.status(), StatusCode::OK);
        assert_eq!(body_of(alive).await, serde_json::json!({"status": "ok"}));
        let why = "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access";
        let lost = liveness(Some(why));
        assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body_of(lost).await,
            serde_json::json!({"status": "gpu lost", "error": why})
        );
        // Nothing in this process reached a GPU: the route answers alive.
        assert_eq!(healthz().await.status(), StatusCode::OK);
    }

    #[test]
    fn a_lost_gpu_context_leaves_its_models_not_ready_at_once() {
        assert_eq!(model_state(true, false, false), "ready");
        assert_eq!(model_state(true, true, false), "ready");
        assert_eq!(model_state(false, true, false), "not ready");
        // An idle model on the GPU, its engine still accepting: not ready.
        assert_eq!(model_state(true, true, true), "not ready (gpu lost)");
        assert_eq!(model_state(false, true, true), "not ready (gpu lost)");
        // A model on the CPU keeps its own word (the process is not ready).
        assert_eq!(model_state(true, false, true), "ready");
        assert_eq!(model_state(false, false, true), "not ready");
    }
}
