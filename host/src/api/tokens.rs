//! `POST /tokenize` and `POST /detokenize`, as vLLM serves them: a tenant
//! counts a prompt's tokens before sending it, or reads ids back as text,
//! with the tokenizer and chat template the completion endpoints use.
//!
//! Both authenticate as inference does and take one of the tenant's
//! `pending_max` permits while they work; a model the tenant may not use is a
//! 404 exactly as for one that does not exist. Tokenizing runs in the
//! tenant's turn on the lane (a tenant's long prompts wait behind its own
//! work, not another's) and stops once the prompt could not fit the model: a
//! prompt `/tokenize` counts is one a completion of one token accepts, and a
//! longer one is the same 400 `context_length_exceeded`. Neither is
//! inference: no usage or audit record, and, as everywhere, no text in logs.

use super::error::ApiError;
use super::openai::{DetokenizeRequest, Prompt, TokenizeInput, TokenizeRequest};
use super::{drain_refused, json, read_body, tokenize_on_lane, App, Source};
use crate::tenancy::Tenant;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode};
use bulkhead_kernels::tokenizer::DecodeOptions;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;

/// `POST /tokenize`: `{"count", "max_model_len", "tokens"}`.
pub(super) async fn tokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    serve(
        app,
        headers,
        body,
        |app, tenant, pending, bytes| async move {
            let request = TokenizeRequest::parse(&bytes)?;
            drop(bytes);
            let model = app
                .served(&tenant, &request.model)
                .ok_or_else(|| ApiError::ModelNotFound(request.model.clone()))?;
            let (source, without_bos, param) = match request.input {
                TokenizeInput::Prompt {
                    text,
                    add_special_tokens,
                } => (
                    Source::Completion(Prompt::Text(text)),
                    !add_special_tokens,
                    "prompt",
                ),
                TokenizeInput::Messages(messages, tools) => {
                    (Source::Chat(messages, tools), false, "messages")
                }
            };
            let rejected = |rejection| ApiError::Rejected {
                rejection,
                prompt_param: param,
                batch_index: None,
            };
            model
                .admission
                .check_size(source.tokens_min(model.text_bytes_per_token_max), None)
                .map_err(rejected)?;
            let mut tokens = tokenize_on_lane(&app, &tenant, &model, source, None, &pending)
                .await?
                .map_err(rejected)?;
            // A prompt is encoded with the model's BOS first where it adds one.
            if without_bos
                && model.tokenizer.add_bos()
                && tokens.first() == model.tokenizer.bos().as_ref()
            {
                tokens.remove(0);
            }
            Ok(serde_json::json!({
                "count": tokens.len(),
                "max_model_len": model.admission.context_tokens(),
                "tokens": tokens,
            }))
        },
    )
    .await
}

/// `POST /detokenize`: `{"prompt"}`, special tokens' text included.
pub(super) async fn detokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    serve(
        app,
        headers,
        body,
        |app, tenant, _pending, bytes| async move {
            let request = DetokenizeRequest::parse(&bytes)?;
            drop(bytes);
            let model = app
                .served(&tenant, &request.model)
                .ok_or_else(|| ApiError::ModelNotFound(request.model.clone()))?;
            let vocab = model.tokenizer.vocab_len();
            let context = model.admission.context_tokens();
            if request.tokens.len() > context as usize {
                return Err(ApiError::InvalidValue {
                    param: "tokens".into(),
                    message: format!("at most {context} token ids (the model's context)"),
                });
            }
            if request.tokens.iter().any(|&id| id as usize >= vocab) {
                return Err(ApiError::InvalidValue {
                    param: "tokens".into(),
                    message: format!("token ids must be below {vocab}"),
                });
            }
            // At most a context of ids, each a table lookup: no lane needed.
            let prompt = model
                .tokenizer
                .decode(&request.tokens, DecodeOptions::default())
                .map_err(|e| ApiError::Internal(format!("detokenization: {e}")))?;
            Ok(serde_json::json!({ "prompt": prompt }))
        },
    )
    .await
}

/// Authenticates, takes a permit, reads the body and answers what `handle`
/// makes of it (an error in OpenAI's shape), with the request's id.
async fn serve<F, Fut>(app: Arc<App>, headers: HeaderMap, body: Body, handle: F) -> Response<Body>
where
    F: FnOnce(Arc<App>, Arc<Tenant>, Arc<OwnedSemaphorePermit>, bytes::Bytes) -> Fut,
    Fut: std::future::Future<Output = Result<serde_json::Value, ApiError>>,
{
    let id = app.request_id();
    let mut response = match app.tenant(&headers) {
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
                Ok(_) if app.shutting_down.load(Ordering::SeqCst) => Err(ApiError::Unavailable),
                Ok(pending) => match read_body(body, &headers, app.serving.body_bytes_max).await {
                    Ok(bytes) => {
                        handle(
                            Arc::clone(&app),
                            Arc::clone(&tenant),
                            Arc::new(pending),
                            bytes,
                        )
                        .await
                    }
                    Err(error) => Err(error),
                },
            };
            match result {
                Ok(value) => json(StatusCode::OK, &value),
                Err(error) => error.into_response(id, Some(&tenant.name)),
            }
        }
    };
    if let Ok(value) = HeaderValue::from_str(&id.0.to_string()) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}
