//! Tenant self-service, under `/v1/tenant/` on the inference listener, with
//! the tenant's own API key.
//!
//! Every route acts on the caller's tenant and nothing else: the tenant is
//! taken from the key (`require_tenant`), never from the path or the body,
//! so no route can name another tenant. Objects are named by ids that are
//! random (keys) or by names scoped to the tenant (plugins); asking for
//! another tenant's object — by guessing its id, say — answers exactly what
//! asking for one that does not exist answers (404), so a tenant learns
//! nothing about what others have.

use super::admin::{self, no_content, query, reply, respond, List};
use super::error::ApiError;
use super::{bearer, drain_refused, App};
use crate::tenancy::control::{Actor, TenantRef, UploadOptions};
use crate::tenancy::Tenant;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, Response, StatusCode};
use axum::middleware::{self, Next};
use axum::routing::{delete, get, post};
use axum::{Extension, Router};
use serde::Deserialize;
use std::sync::Arc;

/// The self-service routes (state: the [`App`]).
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    Router::new()
        .route("/v1/tenant", get(me))
        .route("/v1/tenant/usage", get(usage))
        .route("/v1/tenant/canaries", get(canaries))
        .route("/v1/tenant/keys", get(list_keys).post(issue_key))
        .route("/v1/tenant/keys/{key}", delete(revoke_key))
        .route("/v1/tenant/plugins", get(list_plugins))
        .route(
            "/v1/tenant/plugins/{plugin}",
            get(get_plugin).put(upload_plugin).delete(delete_plugin),
        )
        .route("/v1/tenant/plugins/{plugin}/enable", post(enable_plugin))
        .route("/v1/tenant/plugins/{plugin}/disable", post(disable_plugin))
        .route_layer(middleware::from_fn_with_state(app, require_tenant))
}

/// The caller's tenant, from its key, or a 401 before any handler runs. A
/// self-service call holds one of the tenant's `pending_max` permits while it
/// runs, as an inference request does before admission: a tenant's uploads and
/// key changes count against its own limit, not everyone's memory.
async fn require_tenant(
    State(app): State<Arc<App>>,
    mut request: Request,
    next: Next,
) -> Response<Body> {
    let tenant = bearer(request.headers()).and_then(|key| app.control.registry().authenticate(key));
    let Some(tenant) = tenant else {
        let (parts, body) = request.into_parts();
        drain_refused(body, &parts.headers).await;
        return ApiError::Unauthenticated.into_response(app.request_id(), None);
    };
    let Ok(_permit) = Arc::clone(&tenant.pending).try_acquire_owned() else {
        let (parts, body) = request.into_parts();
        drain_refused(body, &parts.headers).await;
        return ApiError::TooManyPending.into_response(app.request_id(), Some(&tenant.name));
    };
    request.extensions_mut().insert(tenant);
    // Self-service answers are whole JSON bodies: the permit covers the work.
    next.run(request).await
}

type Caller = Extension<Arc<Tenant>>;

fn actor(tenant: &Tenant) -> Actor {
    Actor::Tenant(tenant.name.clone())
}

/// The caller's own tenant, by id: a name could be a newer tenant's by now.
fn own(tenant: &Tenant) -> TenantRef<'static> {
    TenantRef::Id(tenant.id)
}

/// The caller's tenant and its limits.
async fn me(State(app): State<Arc<App>>, Extension(tenant): Caller) -> Response<Body> {
    let answer = app.control.tenant(own(&tenant));
    respond(
        &app,
        answer
            .map(|t| reply(StatusCode::OK, &t))
            .map_err(Into::into),
    )
}

/// The caller's own canaries (reading them is free; registering them is
/// the operator's: a canary blocks other tenants' answers that carry it, so a
/// tenant that could register "Sure, here is" would block everyone else).
async fn canaries(State(app): State<Arc<App>>, Extension(tenant): Caller) -> Response<Body> {
    let answer = app.control.canaries(own(&tenant));
    respond(
        &app,
        answer
            .map(|c| reply(StatusCode::OK, &admin::CanariesView::of(&app, c)))
            .map_err(Into::into),
    )
}

/// The caller's usage window (crate-visible for the query fuzz target,
/// `crate::fuzzing::admin`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UsageQuery {
    from_ms: Option<u64>,
    to_ms: Option<u64>,
}

async fn usage(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    q: Result<Query<UsageQuery>, QueryRejection>,
) -> Response<Body> {
    let answer = (|| {
        let q = query(q)?;
        let window = admin::UsageQuery {
            tenant: None,
            tenant_id: None,
            from_ms: q.from_ms,
            to_ms: q.to_ms,
        };
        let (from, to) = window.window()?;
        let view = app.control.usage(own(&tenant), from, to)?;
        Ok(reply(StatusCode::OK, &view))
    })();
    respond(&app, answer)
}

async fn list_keys(State(app): State<Arc<App>>, Extension(tenant): Caller) -> Response<Body> {
    respond(
        &app,
        (|| {
            Ok(reply(
                StatusCode::OK,
                &List {
                    data: app.control.keys(own(&tenant))?,
                },
            ))
        })(),
    )
}

async fn issue_key(State(app): State<Arc<App>>, Extension(tenant): Caller) -> Response<Body> {
    let answer = app.control.issue_key(&actor(&tenant), own(&tenant)).await;
    respond(
        &app,
        answer
            .map(|k| reply(StatusCode::CREATED, &k))
            .map_err(Into::into),
    )
}

async fn revoke_key(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(key): Path<String>,
) -> Response<Body> {
    let answer = app
        .control
        .revoke_key(&actor(&tenant), own(&tenant), &key)
        .await;
    respond(
        &app,
        answer
            .map(|k| reply(StatusCode::OK, &k))
            .map_err(Into::into),
    )
}

async fn list_plugins(State(app): State<Arc<App>>, Extension(tenant): Caller) -> Response<Body> {
    respond(
        &app,
        (|| {
            Ok(reply(
                StatusCode::OK,
                &List {
                    data: app.control.plugins(own(&tenant))?,
                },
            ))
        })(),
    )
}

async fn get_plugin(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(plugin): Path<String>,
) -> Response<Body> {
    let answer = app.control.plugin(own(&tenant), &plugin);
    respond(
        &app,
        answer
            .map(|p| reply(StatusCode::OK, &p))
            .map_err(Into::into),
    )
}

async fn upload_plugin(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(plugin): Path<String>,
    options: Result<Query<UploadOptions>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    let actor = actor(&tenant);
    let answer = admin::upload(
        &app.control,
        &actor,
        own(&tenant),
        &plugin,
        options,
        &headers,
        body,
    );
    respond(&app, answer.await)
}

async fn set_enabled(app: &App, tenant: &Tenant, plugin: &str, enabled: bool) -> Response<Body> {
    let answer = app
        .control
        .set_plugin_enabled(&actor(tenant), own(tenant), plugin, enabled)
        .await;
    respond(
        app,
        answer
            .map(|p| reply(StatusCode::OK, &p))
            .map_err(Into::into),
    )
}

async fn enable_plugin(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(plugin): Path<String>,
) -> Response<Body> {
    set_enabled(&app, &tenant, &plugin, true).await
}

async fn disable_plugin(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(plugin): Path<String>,
) -> Response<Body> {
    set_enabled(&app, &tenant, &plugin, false).await
}

async fn delete_plugin(
    State(app): State<Arc<App>>,
    Extension(tenant): Caller,
    Path(plugin): Path<String>,
) -> Response<Body> {
    let answer = app
        .control
        .delete_plugin(&actor(&tenant), own(&tenant), &plugin)
        .await;
    respond(&app, answer.map(|()| no_content()).map_err(Into::into))
}
