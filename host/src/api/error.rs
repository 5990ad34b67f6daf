//! Every error the HTTP surface can answer, and the one place that maps it to a
//! status code and OpenAI's error shape `{"error":{"message","type","param","code"}}`.
//!
//! 1. Handlers return [`ApiError`]; nothing else builds an error response.
//! 2. [`ApiError::into_response`] picks the status, writes the body, counts the
//!    rejection (`bulkhead_rejections_total{tenant, reason}`) and logs it with
//!    the request id and tenant.
//! 3. A 4xx says what was wrong. A 5xx says only "internal error"; its cause
//!    goes to the log (never to the client). Neither the log line nor the metric
//!    carries the message of a 4xx, which may quote the client's input.

use crate::capacity::{
    human_bytes, Capacity, CapacityViolation, MemoryViolation, RESERVATIONS_STAGE, SLOTS_STAGE,
};
use crate::catalog::LoadError;
use crate::engine::request::{Rejection, RequestId};
use crate::engine::service::{EngineUnavailable, SubmitError};
use crate::policy::{FaultKind, PluginRejection};
use crate::store::StoreError;
use crate::telemetry;
use crate::tenancy::control::ControlError;
use axum::body::Body;
use axum::http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

/// Seconds a client is told to wait after a 429 (`Retry-After`).
pub const RETRY_AFTER_SECS: u32 = 1;

/// Where a parameter error points (`param`).
pub type Param = String;

/// An error answered to a client.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No or an unknown API key.
    #[error("Incorrect or missing API key. Send `Authorization: Bearer KEY`.")]
    Unauthenticated,
    /// No or a wrong admin token.
    #[error("Incorrect or missing admin token. Send `Authorization: Bearer TOKEN`.")]
    AdminUnauthenticated,
    /// The body is larger than `server.body_bytes_max`.
    #[error("The request body exceeds {limit} bytes.")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
    /// The body did not arrive in time.
    #[error("The request body did not arrive within {secs} seconds.")]
    BodyTimeout {
        /// The limit.
        secs: u64,
    },
    /// The body could not be read.
    #[error("The request body could not be read.")]
    BodyRead,
    /// The body is not JSON (or not a JSON object).
    #[error("We could not parse the JSON body of your request: {0}")]
    InvalidJson(String),
    /// A parameter has the wrong type.
    #[error("Invalid type for '{param}': {message}")]
    InvalidType {
        /// The parameter.
        param: Param,
        /// What is wrong.
        message: String,
    },
    /// A parameter has a value outside its range.
    #[error("Invalid value for '{param}': {message}")]
    InvalidValue {
        /// The parameter.
        param: Param,
        /// What is wrong.
        message: String,
    },
    /// A required parameter is absent.
    #[error("Missing required parameter: '{0}'.")]
    MissingParam(Param),
    /// A parameter this server does not support (with this value).
    #[error("Unsupported parameter: '{param}' {reason}.")]
    Unsupported {
        /// The parameter.
        param: Param,
        /// Why (e.g. "is not supported by this server").
        reason: String,
    },
    /// A parameter nobody knows.
    #[error("Unrecognized request argument supplied: {0}")]
    UnknownParam(Param),
    /// The model is not served here.
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),
    /// Static admission refused the request.
    #[error("{}{rejection}", in_batch(*.batch_index))]
    Rejected {
        /// Why.
        rejection: Rejection,
        /// The parameter holding the prompt ("messages" or "prompt").
        prompt_param: &'static str,
        /// Which prompt of a batch it was refused for (from 0).
        batch_index: Option<usize>,
    },
    /// The tenant already has `pending_max` requests being read, tokenized or
    /// submitted.
    #[error(
        "Too many requests of this tenant are being read and prepared at once; retry shortly."
    )]
    TooManyPending,
    /// The engine is shutting down or stopped.
    #[error("The server is not accepting requests right now.")]
    Unavailable,
    /// The engine ended the request at its deadline.
    #[error("The request did not finish within its deadline.")]
    Timeout,
    /// The server shut down before the request finished.
    #[error("The server shut down before the request finished.")]
    Shutdown,
    /// The operator removed the tenant while the request was in flight.
    #[error("This tenant has been removed; the request was ended.")]
    TenantRemoved,
    /// The operator removed the model while the request was in flight, and it
    /// did not finish within the unload's drain.
    #[error("The model was removed from this server; the request was ended.")]
    ModelRemoved,
    /// The engine failed (panicked) while the request was in flight; it is
    /// restarted, so a retry may succeed.
    #[error("The engine failed while serving this request and is being restarted; retry shortly.")]
    EngineFault,
    /// Decode role: the prompt's KV from the prefill peer failed its check,
    /// was cut off or timed out; nothing was generated from it.
    #[error("The prompt's KV transfer from the prefill server failed its checks or did not complete; nothing was generated. Retry; if it persists, the operator should look at the transfer log lines with this request id.")]
    TransferFailed,
    /// Decode role: the prefill peer refused the job.
    #[error("{}", prefill_refusal_message(*.0))]
    PrefillRefused(crate::engine::handoff::PrefillRefusal),
    /// The runtime canary guard found another tenant's canary in the
    /// response's text; nothing of it was sent.
    #[error("The response was withheld by the server's output guard.")]
    OutputBlocked,
    /// No such route.
    #[error("Unknown request URL.")]
    NotFound,
    /// Role `prefill`: this process serves decode peers only.
    #[error("This server computes prompts for decode servers only; send requests to a decode (or a `both`) server.")]
    PrefillOnly,
    /// A control-plane object that does not exist (or is another tenant's).
    #[error("{what} {name:?} does not exist.")]
    ObjectNotFound {
        /// "tenant", "key", "plugin".
        what: &'static str,
        /// What was asked for.
        name: String,
    },
    /// A name that is taken.
    #[error("{what} {name:?} exists already.")]
    Exists {
        /// "tenant", "plugin".
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A change the capacity contract (I2) or the reservations (I8) cannot hold.
    #[error("{0}")]
    Capacity(CapacityViolation),
    /// A model the memory budget (`engine.memory_max`, or
    /// `engine.device_memory_max` for a GPU) cannot hold.
    #[error("The catalog would exceed the memory budget: model {} needs {} bytes ({}); with the models before it that is {} bytes ({}), above {} ({} bytes, {}). Nothing was changed; it fits with a smaller pool_pages, or with models removed.", .0.model, .0.needed, human_bytes(.0.needed), .0.total, human_bytes(.0.total), .0.budget.setting(), .0.max_bytes, human_bytes(.0.max_bytes))]
    Memory(MemoryViolation),
    /// A model file that cannot be served (missing, unreadable, hostile, or
    /// not a model this engine runs).
    #[error("The model could not be loaded: {0}")]
    ModelLoad(String),
    /// A change the KV pool cannot apply now.
    #[error("The KV pool cannot apply this change now: {0}")]
    PoolConflict(String),
    /// A policy plugin refused the request (its status, code and message).
    #[error("{}", .0.message)]
    PolicyRejected(PluginRejection),
    /// A policy plugin failed (trap, deadline, fuel, memory): fail closed.
    #[error("A policy plugin of this tenant could not decide; the request was not run.")]
    PolicyUnavailable {
        /// The plugin (logged, not sent).
        plugin: String,
        /// How it failed.
        kind: FaultKind,
    },
    /// A count limit reached.
    #[error("At most {max} {what}.")]
    TooMany {
        /// What is counted.
        what: &'static str,
        /// The limit.
        max: usize,
    },
    /// A name kept for someone else.
    #[error("The {what} name {name:?} is reserved for the operator's plugin of that name; choose another.")]
    NameReserved {
        /// "plugin".
        what: &'static str,
        /// The name.
        name: String,
    },
    /// Too many of some write for now (`Retry-After`).
    #[error("Too many {what} for now; retry after {retry_after_secs} s.")]
    RateLimited {
        /// What is limited.
        what: &'static str,
        /// When to retry.
        retry_after_secs: u32,
    },
    /// Over a quota of bytes.
    #[error("The {what} would take {needed} bytes, over this tenant's quota of {max}; delete or shrink a plugin first.")]
    QuotaExceeded {
        /// What is counted.
        what: &'static str,
        /// What the change would need in all.
        needed: u64,
        /// The quota.
        max: u64,
    },
    /// The server cannot do this now; retry shortly (the message is the
    /// server's own).
    #[error("{0}")]
    ServerBusy(String),
    /// Another server changed the shared store since this change read it.
    #[error("Another server changed the control plane while this change was made; nothing was changed. Read the object again and retry.")]
    StoreConflict,
    /// The shared store cannot be reached; nothing was changed.
    #[error("The control-plane store cannot be reached now; nothing was changed. Retry once it is back (/readyz says when).")]
    StoreUnavailable(String),
    /// A server-side failure; the cause is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

impl From<ControlError> for ApiError {
    fn from(error: ControlError) -> ApiError {
        match error {
            ControlError::NotFound { what, name } => ApiError::ObjectNotFound { what, name },
            ControlError::Exists { what, name } => ApiError::Exists { what, name },
            ControlError::Invalid { field, reason } => ApiError::InvalidValue {
                param: field,
                message: reason,
            },
            ControlError::Capacity(violation) => ApiError::Capacity(violation),
            ControlError::Memory(violation) => ApiError::Memory(violation),
            ControlError::Load(error) => match error {
                LoadError::Thread { .. } => ApiError::Internal(error.to_string()),
                LoadError::Capacity(violation) => ApiError::Capacity(violation),
                other => ApiError::ModelLoad(other.to_string()),
            },
            ControlError::Pool(message) => ApiError::PoolConflict(message),
            ControlError::TooMany { what, max } => ApiError::TooMany { what, max },
            ControlError::Store(StoreError::Conflict) => ApiError::StoreConflict,
            ControlError::Store(StoreError::Unavailable(cause)) => {
                ApiError::StoreUnavailable(cause)
            }
            ControlError::Store(error) => ApiError::Internal(format!("store: {error}")),
            ControlError::Engine => ApiError::Unavailable,
            ControlError::Reserved { what, name } => ApiError::NameReserved { what, name },
            ControlError::RateLimited {
                what,
                retry_after_secs,
            } => ApiError::RateLimited {
                what,
                retry_after_secs,
            },
            ControlError::Quota { what, needed, max } => {
                ApiError::QuotaExceeded { what, needed, max }
            }
            ControlError::Busy(message) => ApiError::ServerBusy(message),
        }
    }
}

impl From<EngineUnavailable> for ApiError {
    fn from(_: EngineUnavailable) -> ApiError {
        ApiError::Unavailable
    }
}

/// What a refusal's message begins with for a prompt of a batch.
fn in_batch(index: Option<usize>) -> String {
    index.map_or_else(String::new, |i| {
        format!("the prompt at index {i} of the batch: ")
    })
}

impl From<SubmitError> for ApiError {
    fn from(error: SubmitError) -> ApiError {
        match error {
            SubmitError::Rejected(rejection) => ApiError::Rejected {
                rejection,
                prompt_param: "",
                batch_index: None,
            },
            SubmitError::Unavailable => ApiError::Unavailable,
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

/// The `error` object as OpenAI sends it (also used in SSE error events).
#[derive(Serialize)]
pub struct ErrorObject<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
    /// For a capacity conflict: the table of limits the change would break.
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<Vec<CapacityLimit>>,
}

/// The error body, for the OpenAPI document.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorResponse {
    /// The error.
    error: ErrorDetail,
}

/// The error object, for the OpenAPI document.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorDetail {
    /// What was wrong (a 5xx says only "internal error").
    message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, ...).
    #[schema(rename = "type")]
    kind: String,
    /// The parameter at fault, if one is.
    param: Option<String>,
    /// A fixed code (`tenant_not_found`, `capacity_contract_violated`, ...).
    code: Option<String>,
    /// For a capacity conflict: the limits the change would break.
    #[schema(nullable = false)]
    limits: Option<Vec<CapacityLimit>>,
}

/// One row of the capacity table.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct CapacityLimit {
    /// The stage ("model context", "tenant alpha maximum", ...).
    pub stage: String,
    /// The setting that sets it.
    pub field: String,
    /// Tokens of one sequence it holds.
    pub tokens: u64,
    /// Whether it holds the promised context.
    pub holds: bool,
}

/// The rows of `capacity`'s table.
pub fn capacity_limits(capacity: &Capacity) -> Vec<CapacityLimit> {
    capacity
        .limits
        .iter()
        .map(|l| CapacityLimit {
            stage: l.stage.clone(),
            field: l.field.clone(),
            tokens: l.tokens,
            holds: l.tokens >= capacity.promised_tokens,
        })
        .collect()
}

impl ApiError {
    /// Status, OpenAI `type`, `code`, and `param`.
    fn parts(&self) -> (StatusCode, &'static str, &'static str, Option<&str>) {
        use ApiError as E;
        const INVALID: &str = "invalid_request_error";
        match self {
            E::Unauthenticated | E::AdminUnauthenticated => {
                (StatusCode::UNAUTHORIZED, INVALID, "invalid_api_key", None)
            }
            E::BodyTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                "request_too_large",
                None,
            ),
            E::BodyTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, INVALID, "body_timeout", None),
            E::BodyRead => (StatusCode::BAD_REQUEST, INVALID, "body_unreadable", None),
            E::InvalidJson(_) => (StatusCode::BAD_REQUEST, INVALID, "invalid_json", None),
            E::InvalidType { param, .. } => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "invalid_type",
                Some(param),
            ),
            E::InvalidValue { param, .. } => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "invalid_value",
                Some(param),
            ),
            E::MissingParam(param) => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "missing_required_parameter",
                Some(param),
            ),
            E::Unsupported { param, .. } => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "unsupported_parameter",
                Some(param),
            ),
            E::UnknownParam(param) => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "unknown_parameter",
                Some(param),
            ),
            E::ModelNotFound(_) => (
                StatusCode::NOT_FOUND,
                INVALID,
                "model_not_found",
                Some("model"),
            ),
            E::Rejected {
                rejection,
                prompt_param,
                ..
            } => {
                let prompt = (!prompt_param.is_empty()).then_some(*prompt_param);
                match rejection {
                    Rejection::EmptyPrompt => {
                        (StatusCode::BAD_REQUEST, INVALID, "empty_prompt", prompt)
                    }
                    Rejection::ContextLengthExceeded { .. } | Rejection::PromptTooLong { .. } => (
                        StatusCode::BAD_REQUEST,
                        INVALID,
                        "context_length_exceeded",
                        prompt,
                    ),
                    Rejection::ZeroMaxTokens => (
                        StatusCode::BAD_REQUEST,
                        INVALID,
                        "invalid_value",
                        Some("max_tokens"),
                    ),
                    Rejection::TenantRemoved => (
                        StatusCode::FORBIDDEN,
                        "permission_error",
                        "tenant_removed",
                        None,
                    ),
                    Rejection::ForeignPool => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "internal_error",
                        None,
                    ),
                    Rejection::QueueFull => (
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limit_error",
                        "queue_full",
                        None,
                    ),
                }
            }
            E::TooManyPending => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "too_many_pending",
                None,
            ),
            E::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "engine_unavailable",
                None,
            ),
            E::Timeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                "request_timeout",
                None,
            ),
            E::Shutdown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "server_shutting_down",
                None,
            ),
            E::TenantRemoved => (
                StatusCode::FORBIDDEN,
                "permission_error",
                "tenant_removed",
                None,
            ),
            E::ModelRemoved => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "model_removed",
                None,
            ),
            E::EngineFault => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "engine_fault",
                None,
            ),
            E::TransferFailed => (
                StatusCode::BAD_GATEWAY,
                "server_error",
                "kv_transfer_failed",
                None,
            ),
            E::PrefillRefused(refusal) => {
                use crate::engine::handoff::PrefillRefusal as R;
                // The status and code a single process gives the same refusal.
                match refusal {
                    R::QueueFull => (
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limit_error",
                        "queue_full",
                        None,
                    ),
                    R::ContextLength => (
                        StatusCode::BAD_REQUEST,
                        INVALID,
                        "context_length_exceeded",
                        None,
                    ),
                    R::TenantUnknown => (
                        StatusCode::FORBIDDEN,
                        "permission_error",
                        "tenant_removed",
                        None,
                    ),
                    R::Unavailable => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "prefill_unavailable",
                        None,
                    ),
                }
            }
            E::OutputBlocked => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "output_blocked",
                None,
            ),
            E::NotFound => (StatusCode::NOT_FOUND, INVALID, "unknown_url", None),
            E::PrefillOnly => (
                StatusCode::MISDIRECTED_REQUEST,
                INVALID,
                "prefill_only",
                None,
            ),
            E::ObjectNotFound { what, .. } => {
                let code = match *what {
                    "tenant" => "tenant_not_found",
                    "key" => "key_not_found",
                    "plugin" => "plugin_not_found",
                    "model" => "model_not_found",
                    _ => "not_found",
                };
                (StatusCode::NOT_FOUND, INVALID, code, None)
            }
            E::Exists { .. } => (StatusCode::CONFLICT, INVALID, "already_exists", None),
            E::Capacity(_) => (
                StatusCode::CONFLICT,
                INVALID,
                "capacity_contract_violated",
                None,
            ),
            E::Memory(_) => (
                StatusCode::CONFLICT,
                INVALID,
                "memory_budget_exceeded",
                None,
            ),
            E::ModelLoad(_) => (
                StatusCode::BAD_REQUEST,
                INVALID,
                "model_unloadable",
                Some("path"),
            ),
            E::PoolConflict(_) => (StatusCode::CONFLICT, INVALID, "pool_conflict", None),
            E::TooMany { .. } => (StatusCode::CONFLICT, INVALID, "limit_reached", None),
            E::NameReserved { .. } => (StatusCode::CONFLICT, INVALID, "name_reserved", None),
            E::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limited",
                None,
            ),
            E::QuotaExceeded { .. } => (StatusCode::CONFLICT, INVALID, "quota_exceeded", None),
            E::ServerBusy(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "server_busy",
                None,
            ),
            E::PolicyRejected(r) => match r.status {
                400 => (StatusCode::BAD_REQUEST, INVALID, "policy_rejected", None),
                429 => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "policy_rejected",
                    None,
                ),
                _ => (
                    StatusCode::FORBIDDEN,
                    "permission_error",
                    "policy_rejected",
                    None,
                ),
            },
            E::PolicyUnavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "policy_unavailable",
                None,
            ),
            E::StoreConflict => (StatusCode::CONFLICT, INVALID, "conflict", None),
            E::StoreUnavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "store_unavailable",
                None,
            ),
            E::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                None,
            ),
        }
    }

    /// The sizes a refusal's audit record keeps (numbers only).
    pub fn sizes(&self) -> Vec<(&'static str, u64)> {
        match self {
            ApiError::BodyTooLarge { limit } => vec![("body_bytes_max", *limit)],
            ApiError::Rejected { rejection, .. } => match rejection {
                Rejection::ContextLengthExceeded {
                    prompt_tokens,
                    max_tokens,
                    context_tokens,
                } => vec![
                    ("prompt_tokens", u64::from(*prompt_tokens)),
                    ("max_tokens", u64::from(*max_tokens)),
                    ("context_tokens", u64::from(*context_tokens)),
                ],
                Rejection::PromptTooLong {
                    prompt_tokens_min,
                    max_tokens,
                    context_tokens,
                } => vec![
                    ("prompt_tokens_min", *prompt_tokens_min),
                    ("max_tokens", u64::from(*max_tokens)),
                    ("context_tokens", u64::from(*context_tokens)),
                ],
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// The reason label of metrics and logs (a fixed code, never client text).
    pub fn code(&self) -> &'static str {
        self.parts().2
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    /// The `error` object (for the JSON body and SSE error events).
    pub fn object(&self) -> ErrorObject<'_> {
        let (_, kind, code, param) = self.parts();
        let (message, limits) = match self {
            // The table goes as rows, not as text in the message.
            ApiError::Capacity(v) => {
                let what = if v.stage == RESERVATIONS_STAGE {
                    format!(
                        "The change would over-commit the KV pool of model {}: {}.",
                        v.model, v.field
                    )
                } else if v.stage == SLOTS_STAGE {
                    format!(
                        "The change would leave a tenant of model {} without a guaranteed sequence slot: {}.",
                        v.model, v.field
                    )
                } else {
                    format!(
                        "The change would break the capacity contract of model {}: the promised context of {} tokens exceeds {} ({} tokens, set by {}).",
                        v.model, v.promised, v.stage, v.tokens, v.field
                    )
                };
                let message = match v.remedy() {
                    Some(remedy) => format!("{what} Nothing was changed; {remedy}."),
                    None => format!("{what} Nothing was changed."),
                };
                (message, Some(capacity_limits(&v.capacity)))
            }
            // `Internal` displays as "internal error": its cause is never sent.
            _ => (self.to_string(), None),
        };
        // A plugin's own code (checked `[a-z0-9_]`, at most 64) reaches the
        // client; metrics and logs keep the fixed `policy_rejected`.
        let code = match self {
            ApiError::PolicyRejected(r) => r.code.as_str(),
            _ => code,
        };
        ErrorObject {
            message,
            kind,
            param,
            code: Some(code),
            limits,
        }
    }

    /// Logs and counts the error, then renders it. `tenant` is the
    /// authenticated tenant's name, when known.
    pub fn into_response(self, request_id: RequestId, tenant: Option<&str>) -> Response<Body> {
        self.record(request_id, tenant);
        let status = self.status();
        let body = serde_json::to_vec(&ErrorBody {
            error: self.object(),
        })
        // Serializing strings and options cannot fail.
        .unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if status == StatusCode::TOO_MANY_REQUESTS {
            let secs = match &self {
                ApiError::PolicyRejected(r) => r.retry_after_secs.unwrap_or(RETRY_AFTER_SECS),
                ApiError::RateLimited {
                    retry_after_secs, ..
                } => *retry_after_secs,
                _ => RETRY_AFTER_SECS,
            };
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }

    /// Counts and logs the error: the code and ids only (I9); a 5xx also logs
    /// its cause, which is server-side text, never client content.
    pub fn record(&self, request_id: RequestId, tenant: Option<&str>) {
        let code = self.code();
        let tenant = tenant.unwrap_or(telemetry::TENANT_UNKNOWN);
        telemetry::count_rejection(tenant, code);
        let status = self.status().as_u16();
        match self {
            ApiError::PolicyUnavailable { plugin, kind } => {
                tracing::warn!(request_id = request_id.0, tenant, status, code, plugin = %plugin, fault = kind.as_str(), "request failed");
            }
            ApiError::Internal(cause) => {
                tracing::error!(request_id = request_id.0, tenant, status, code, cause = %cause, "request failed");
            }
            ApiError::StoreUnavailable(cause) => {
                tracing::warn!(request_id = request_id.0, tenant, status, code, cause = %cause, "request failed");
            }
            _ if self.status().is_server_error() => {
                tracing::warn!(
                    request_id = request_id.0,
                    tenant,
                    status,
                    code,
                    "request failed"
                );
            }
            _ => {
                tracing::info!(
                    request_id = request_id.0,
                    tenant,
                    status,
                    code,
                    "request refused"
                );
            }
        }
    }
}

fn prefill_refusal_message(refusal: crate::engine::handoff::PrefillRefusal) -> &'static str {
    use crate::engine::handoff::PrefillRefusal as R;
    match refusal {
        R::QueueFull => "Too many requests of this tenant are queued; retry shortly.",
        R::ContextLength => "The prompt does not fit this model's context on the prefill server.",
        R::TenantUnknown => "The prefill server does not know this tenant; the request was ended.",
        R::Unavailable => "No prefill server could take the request right now; retry shortly.",
    }
}
