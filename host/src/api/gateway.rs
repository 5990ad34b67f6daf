//! External authorization for a gateway in front of Bulkhead pods: Envoy's
//! `ext_authz` HTTP service protocol, under `/ext-authz/` on the inference
//! listener.
//!
//! The Gateway API Inference Extension's endpoint picker (llm-d's router)
//! schedules fairly by `x-llm-d-inference-fairness-id` and reads
//! `x-llm-d-inference-objective`; both are request headers, so a client can
//! send any value. Configured as the gateway's `ext_authz` service (path
//! prefix `/ext-authz`, `Authorization` among the allowed headers), Bulkhead
//! checks the request's API key and answers:
//!
//! - `200` with `x-llm-d-inference-fairness-id: <the tenant's id>` (the stable
//!   registry id, never its name) and, when the tenant's record names one,
//!   `x-llm-d-inference-objective: <its objective>`, for the gateway to set
//!   upstream (list them in `allowed_upstream_headers`: Envoy then replaces a
//!   client's copy), and `x-envoy-auth-headers-to-remove` naming every other
//!   header the picker would take from the client (the objective when the
//!   tenant has none, the older `x-gateway-*` names, a preset destination or
//!   prefill pod), so the picker's fairness and priorities see real tenants;
//! - `401`, OpenAI-shaped, for a missing, unknown or revoked key.
//!
//! Pods authenticate every request themselves whatever the gateway did, and
//! never read the fairness or objective headers: a request that reaches a
//! pod directly gains nothing by sending them. A decode pod reads
//! `x-prefiller-host-port` (the picker sets it after this check) only to
//! choose among its own configured prefill peers (`transfer::Peers`); a value
//! naming anything else is ignored and counted, never connected to.

use super::error::ApiError;
use super::{bearer, drain_refused, App};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Response, StatusCode};
use axum::routing::any;
use axum::Router;
use std::sync::Arc;

/// The prefix the gateway puts before the original request's path.
pub const PATH_PREFIX: &str = "/ext-authz";

/// The header the picker's fairness reads: set to the tenant's id.
pub const FAIRNESS_ID: &str = "x-llm-d-inference-fairness-id";

/// The prefill pod the picker chose for a decode pod (llm-d's P/D routing).
pub const PREFILLER_HOST_PORT: &str = "x-prefiller-host-port";

/// The header the picker's priorities read: the tenant's objective, if any.
pub const OBJECTIVE: &str = "x-llm-d-inference-objective";

/// Headers the picker or the gateway would take from a client, removed from
/// the upstream request (the objective only when the tenant has none: set,
/// it replaces the client's).
pub const CLIENT_SET_HEADERS: [&str; 5] = [
    OBJECTIVE,
    "x-gateway-inference-fairness-id",
    "x-gateway-inference-objective",
    "x-gateway-destination-endpoint",
    PREFILLER_HOST_PORT,
];

/// The `ext_authz` routes: any method, the prefix alone or any path below.
pub fn router() -> Router<Arc<App>> {
    Router::new()
        .route(PATH_PREFIX, any(check))
        .route(&format!("{PATH_PREFIX}/{{*path}}"), any(check))
}

async fn check(State(app): State<Arc<App>>, request: Request) -> Response<Body> {
    let tenant = bearer(request.headers()).and_then(|key| app.control.registry().authenticate(key));
    let (parts, body) = request.into_parts();
    // A gateway may be configured to send the body along: it is not read.
    drain_refused(body, &parts.headers).await;
    let Some(tenant) = tenant else {
        return ApiError::Unauthenticated.into_response(app.request_id(), None);
    };
    if app.control.refusing() {
        return ApiError::StoreUnavailable("[store] offline = \"refuse\"".into())
            .into_response(app.request_id(), Some(&tenant.name));
    }
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(FAIRNESS_ID, HeaderValue::from(tenant.id.0));
    // Checked a Kubernetes object name when stored: a header value.
    let objective = tenant
        .objective
        .as_deref()
        .and_then(|o| HeaderValue::from_str(o).ok());
    let set_objective = objective.is_some();
    if let Some(objective) = objective {
        headers.insert(OBJECTIVE, objective);
    }
    let remove = CLIENT_SET_HEADERS
        .iter()
        .filter(|&&name| !(set_objective && name == OBJECTIVE))
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    headers.insert(
        "x-envoy-auth-headers-to-remove",
        HeaderValue::from_str(&remove).expect("header names are header values"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_removed_headers_are_lowercase_names_and_never_the_one_set() {
        for name in CLIENT_SET_HEADERS {
            assert!(axum::http::HeaderName::from_static(name).as_str() == name);
        }
        assert!(!CLIENT_SET_HEADERS.contains(&FAIRNESS_ID));
    }
}
