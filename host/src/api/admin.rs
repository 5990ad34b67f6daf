//! The admin REST API, under `/admin/v1/` on the admin listener.
//!
//! 1. **Authentication** is one layer (`require_admin`) over every route but
//!    the OpenAPI document: the admin token, compared as a SHA-256 digest in
//!    constant time; anything else is a 401 before a handler runs.
//! 2. **Handlers** parse, call the control plane ([`Control`]), and answer JSON.
//!    Every error goes through [`ApiError`] (OpenAI's error shape); a change the
//!    capacity contract cannot hold is a 409 that carries the table of limits.
//! 3. **Bodies** are bounded ([`ADMIN_BODY_BYTES_MAX`] for JSON,
//!    [`PLUGIN_BYTES_MAX`] for a component) and read like inference bodies and JSON with unknown fields is
//!    refused, so a typo is never silently a default.
//! 4. **The OpenAPI 3.1 document** (`/admin/v1/openapi.json`) is generated from
//!    these handlers' annotations and types ([`AdminApi`]). It leaves out the
//!    one test-build route, `POST /admin/v1/models/{model}/fault/panic`
//!    (feature `fault-injection`), which production builds do not have.

use super::error::{capacity_limits, ApiError, CapacityLimit, ErrorResponse};
use super::{read_body, App};
use crate::catalog::{Served, Source};
use crate::clock::now_ms;
use crate::config::ModelSpec;
use crate::store::records::AuditRecord;
use crate::tenancy::control::{
    Actor, Canaries, Control, IssuedKey, KeyView, ModelRemoved, ModelView, PluginView, TenantPatch,
    TenantRef, TenantView, UploadOptions, UsageView, PLUGIN_BYTES_MAX, USAGE_MINUTES_MAX,
};
use crate::tenancy::{ModelAccess, Quota, TenantId};
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use axum::middleware::{self, Next};
use axum::routing::{delete, get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use utoipa::OpenApi;

/// Largest JSON body an admin or self-service route reads.
pub const ADMIN_BODY_BYTES_MAX: usize = 64 << 10;
/// Most audit records one page returns.
pub const AUDIT_PAGE_MAX: usize = 1000;
/// Usage window when none is given: the last hour.
pub const USAGE_WINDOW_DEFAULT_MS: u64 = 3600 * 1000;

/// The admin routes (state: the [`App`]).
pub fn router(app: Arc<App>) -> Router<Arc<App>> {
    let protected = Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route(
            "/admin/v1/tenants/{tenant}",
            get(get_tenant).patch(update_tenant).delete(delete_tenant),
        )
        .route(
            "/admin/v1/tenants/{tenant}/keys",
            get(list_keys).post(issue_key),
        )
        .route("/admin/v1/tenants/{tenant}/keys/{key}", delete(revoke_key))
        .route(
            "/admin/v1/tenants/{tenant}/canaries",
            get(get_canaries).put(set_canaries),
        )
        .route("/admin/v1/tenants/{tenant}/plugins", get(list_plugins))
        .route(
            "/admin/v1/tenants/{tenant}/plugins/{plugin}",
            get(get_plugin).put(upload_plugin).delete(delete_plugin),
        )
        .route(
            "/admin/v1/tenants/{tenant}/plugins/{plugin}/enable",
            post(enable_plugin),
        )
        .route(
            "/admin/v1/tenants/{tenant}/plugins/{plugin}/disable",
            post(disable_plugin),
        )
        .route("/admin/v1/models", get(list_models).post(add_model))
        .route(
            "/admin/v1/models/{model}",
            get(get_model).delete(remove_model),
        )
        .route("/admin/v1/models/{model}/pool", get(model_pool))
        .route("/admin/v1/partitions", get(partitions))
        .route("/admin/v1/capacity", get(capacity))
        .route("/admin/v1/usage", get(usage))
        .route("/admin/v1/stats", get(stats))
        .route("/admin/v1/audit", get(audit_log));
    // Test builds only: a panic planted in a model's engine.
    #[cfg(feature = "fault-injection")]
    let protected = protected
        .route("/admin/v1/models/{model}/fault/panic", post(fault_panic))
        .route(
            "/admin/v1/tenants/{tenant}/fault/plugin-stall",
            post(fault_plugin_stall),
        );
    // Every route above needs the admin token (`route_layer` covers only
    // the routes added before it).
    let protected = protected.route_layer(middleware::from_fn_with_state(app, require_admin));
    Router::new()
        .route("/admin/v1/openapi.json", get(openapi))
        .merge(protected)
}

/// The admin token, or a 401 before any handler runs.
async fn require_admin(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response<Body> {
    if app.is_admin(request.headers()) {
        next.run(request).await
    } else {
        ApiError::AdminUnauthenticated.into_response(app.request_id(), None)
    }
}

/// A tenant the admin names (by name; ids appear in responses).
fn name(tenant: &str) -> TenantRef<'_> {
    TenantRef::Name(tenant)
}

/// A JSON response.
pub fn reply<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    // Views are plain structs of strings, numbers and maps.
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// An answer, or its error rendered with a fresh request id.
pub fn respond(app: &App, answer: Result<Response<Body>, ApiError>) -> Response<Body> {
    answer.unwrap_or_else(|error| error.into_response(app.request_id(), None))
}

/// A JSON body of type `T` (unknown fields refused by `T`'s own serde rules).
pub async fn json_body<T: DeserializeOwned>(
    body: Body,
    headers: &HeaderMap,
) -> Result<T, ApiError> {
    let bytes = read_body(body, headers, ADMIN_BODY_BYTES_MAX as u64).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

/// A query string of type `T`.
pub fn query<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    query.map(|Query(q)| q).map_err(|e| ApiError::InvalidValue {
        param: "query".into(),
        message: e.body_text(),
    })
}

/// A list.
#[derive(Serialize, utoipa::ToSchema)]
pub struct List<T> {
    /// The items.
    pub data: Vec<T>,
}

/// A new tenant: its name and limits (defaults as in the policy file).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// 1-64 of `[A-Za-z0-9_-]`, starting with a letter; unique among live tenants.
    pub name: String,
    /// Share of the engine under contention (default 1).
    #[serde(default = "one")]
    pub weight: u32,
    /// KV pages only this tenant may use.
    pub pages_reserved: u32,
    /// The most KV pages it may hold.
    pub pages_max: u32,
    /// Most requests waiting for pages (default 64).
    #[serde(default = "queue_depth_default")]
    pub queue_depth_max: u32,
    /// Most sequences running at once (default 16).
    #[serde(default = "running_default")]
    pub running_max: u32,
    /// Most requests before admission at once (default 8).
    #[serde(default = "pending_default")]
    pub pending_max: u32,
    /// Whether its repeated prompt prefixes are cached, for it alone (default true).
    #[serde(default = "yes")]
    pub prefix_cache: bool,
    /// The models it may use: `["*"]` (the default) for every model, else ids
    /// of models in the catalog.
    #[serde(default)]
    #[schema(value_type = Vec<String>)]
    pub models: ModelAccess,
    /// The inference objective (an InferenceObjective's name) the gateway's
    /// external authorization sets on its requests; none by default.
    #[serde(default)]
    pub objective: Option<String>,
}

fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn queue_depth_default() -> u32 {
    64
}
fn running_default() -> u32 {
    16
}
fn pending_default() -> u32 {
    8
}

impl CreateTenant {
    fn quota(&self) -> Quota {
        Quota {
            weight: self.weight,
            pages_reserved: self.pages_reserved,
            pages_max: self.pages_max,
            queue_depth_max: self.queue_depth_max,
            running_max: self.running_max,
            pending_max: self.pending_max,
            prefix_cache: self.prefix_cache,
        }
    }
}

/// What deleting a tenant did.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Deleted {
    /// The tenant's name.
    pub deleted: String,
    /// Its requests that were queued or running, ended with `tenant_removed`.
    pub requests_ended: u32,
}

/// A tenant's live partition and queues in one model's engine.
#[derive(Serialize, utoipa::ToSchema)]
pub struct PartitionView {
    /// The model.
    pub model: String,
    /// The tenant.
    pub tenant: String,
    /// Its id.
    pub tenant_id: u32,
    /// Pages only it may use.
    pub pages_reserved: u32,
    /// The most pages it may hold.
    pub pages_max: u32,
    /// Pages leased to its sequences.
    pub pages_owned: u32,
    /// Pages booked for its sequences, not yet leased.
    pub pages_booked: u32,
    /// Pages it released that wait to be scrubbed.
    pub pages_released: u32,
    /// Pages it could book now.
    pub pages_available: u32,
    /// Pages of its prefix cache (in use by its sequences, or kept within its
    /// reservation for its next requests).
    pub pages_cached: u32,
    /// Its requests waiting.
    pub queued: u32,
    /// Its sequences running.
    pub running: u32,
}

/// One model's capacity contract with the live tenant set.
#[derive(Serialize, utoipa::ToSchema)]
pub struct CapacityView {
    /// The model.
    pub model: String,
    /// Tokens promised to clients (prompt and completion).
    pub promised_tokens: u64,
    /// Whether every stage holds them.
    pub ok: bool,
    /// Tokens per prefill step (chunked: any prompt length).
    pub prefill_chunk_tokens: u64,
    /// Every stage and what it holds.
    pub limits: Vec<CapacityLimit>,
}

/// One tenant's pages in a [`PoolAuditView`].
#[derive(Serialize, utoipa::ToSchema)]
pub struct TenantPagesView {
    /// The tenant's name; null when the registry no longer has it (a tenant
    /// being removed, whose pages still count).
    pub tenant: Option<String>,
    /// Its id.
    pub tenant_id: u32,
    /// Pages leased to its sequences.
    pub pages_owned: u32,
    /// Pages it released that wait to be scrubbed.
    pub pages_released: u32,
    /// Pages booked for its sequences, not yet leased.
    pub pages_booked: u32,
    /// Pages of its prefix cache.
    pub pages_shared: u32,
}

/// A model's KV pool, audited on its engine thread between two steps: is it
/// back at its baseline, and was every released page scrubbed?
#[derive(Serialize, utoipa::ToSchema)]
pub struct PoolAuditView {
    /// The model.
    pub model: String,
    /// The pool's id; a new one after the engine is rebuilt (a panic).
    pub pool_id: u32,
    /// Requests queued plus running.
    pub in_flight: u32,
    /// Pages in the pool.
    pub pages_count: u32,
    /// Pages on the free list.
    pub pages_free: u32,
    /// Pages leased to sequences.
    pub pages_owned: u32,
    /// Pages released and not yet scrubbed.
    pub pages_released: u32,
    /// Prefix-cache pages.
    pub pages_shared: u32,
    /// Pages booked, not yet leased.
    pub pages_booked: u32,
    /// Free pages whose values were scanned (every free page).
    pub free_pages_checked: u32,
    /// Of those, pages not all zeros (a missed scrub); must be 0.
    pub free_pages_dirty: u32,
    /// Pages scrubbed since this engine started.
    pub pages_scrubbed_total: u64,
    /// `ok`, or the first broken invariant of the pool, the page tables or
    /// the prefix cache.
    pub invariants: String,
    /// Nothing in flight, leased, booked or waiting for scrub, no dirty free
    /// page, invariants ok, and every page free or in a prefix cache.
    pub at_baseline: bool,
    /// Per tenant, in id order.
    pub tenants: Vec<TenantPagesView>,
}

/// A usage window.
#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// A live tenant's name (or give `tenant_id`).
    pub tenant: Option<String>,
    /// A tenant's id, also of a deleted one.
    pub tenant_id: Option<u32>,
    /// Start, Unix milliseconds (default: an hour before the end; with no
    /// `to_ms`, a start further back than 31 days starts 31 days ago).
    pub from_ms: Option<u64>,
    /// End, Unix milliseconds, exclusive (default: the end of this minute).
    pub to_ms: Option<u64>,
}

impl UsageQuery {
    /// The window, defaults applied, or a 400 naming the parameter at fault.
    /// A window is at most [`USAGE_MINUTES_MAX`] minutes (what the store
    /// keeps): `from_ms=0` alone asks for everything kept.
    pub fn window(&self) -> Result<(u64, u64), ApiError> {
        let wrong = |param: &str, message: String| ApiError::InvalidValue {
            param: param.into(),
            message,
        };
        let widest = USAGE_MINUTES_MAX * 60_000;
        let now = now_ms();
        match (self.from_ms, self.to_ms) {
            (None, to) => {
                let to = to.unwrap_or(now + 60_000);
                let from = to.saturating_sub(USAGE_WINDOW_DEFAULT_MS);
                if to / 60_000 <= from / 60_000 {
                    return Err(wrong(
                        "to_ms",
                        "must be at least a minute after the Unix epoch".into(),
                    ));
                }
                Ok((from, to))
            }
            (Some(from), None) => {
                let to = now + 60_000;
                if to / 60_000 <= from / 60_000 {
                    return Err(wrong(
                        "from_ms",
                        "is after this minute (give a start in the past)".into(),
                    ));
                }
                Ok((from.max(to.saturating_sub(widest)), to))
            }
            (Some(from), Some(to)) => {
                if to / 60_000 <= from / 60_000 {
                    return Err(wrong(
                        "to_ms",
                        "must be at least a minute after from_ms".into(),
                    ));
                }
                if to / 60_000 - from / 60_000 > USAGE_MINUTES_MAX {
                    return Err(wrong(
                        "from_ms",
                        format!("is more than {USAGE_MINUTES_MAX} minutes (31 days, what is kept) before to_ms; leave out to_ms for the latest 31 days"),
                    ));
                }
                Ok((from, to))
            }
        }
    }
}

/// A page of the audit log.
#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Records after this sequence number, oldest first (default 0: from the
    /// oldest kept).
    pub after: Option<u64>,
    /// Instead of `after`: records before this sequence number, newest first
    /// (a number past the last, such as 18446744073709551615, for the newest).
    pub before: Option<u64>,
    /// Most records (default 100, at most 1000).
    pub limit: Option<usize>,
    /// Only records about this tenant: its name as the target, or the tenant
    /// itself as the actor (`tenant:<name>`).
    pub tenant: Option<String>,
    /// Only records whose action starts with this (`plugin.` for every
    /// plugin event, `key.revoke` for one kind).
    pub action: Option<String>,
    /// Only records at or after this time, Unix milliseconds.
    pub from_ms: Option<u64>,
    /// Only records before this time, Unix milliseconds.
    pub to_ms: Option<u64>,
}

impl AuditQuery {
    /// Whether any filter is given.
    fn filtered(&self) -> bool {
        self.tenant.is_some()
            || self.action.is_some()
            || self.from_ms.is_some()
            || self.to_ms.is_some()
    }

    /// Whether `record` passes the filters.
    fn matches(&self, record: &AuditRecord) -> bool {
        let tenant = self.tenant.as_deref().is_none_or(|name| {
            record.target == name
                || record
                    .actor
                    .strip_prefix("tenant:")
                    .is_some_and(|actor| actor == name)
        });
        let action = self
            .action
            .as_deref()
            .is_none_or(|prefix| record.action.starts_with(prefix));
        let from = self.from_ms.is_none_or(|from| record.at_ms >= from);
        let to = self.to_ms.is_none_or(|to| record.at_ms < to);
        tenant && action && from && to
    }
}

/// Most records one filtered audit page looks at before it answers with
/// what it found (its cursor then continues where the scan stopped).
pub const AUDIT_SCAN_MAX: usize = 20 * AUDIT_PAGE_MAX;

/// A page of audit records.
#[derive(Serialize, utoipa::ToSchema)]
pub struct AuditPage {
    /// The records: oldest first, or newest first when asked with `before`.
    pub data: Vec<AuditRecord>,
    /// The `after` of the next (newer) page: the newest record's number.
    pub next_after: u64,
    /// With `before`: the `before` of the next (older) page. A filtered page
    /// may hold fewer than `limit` records with older ones still to come:
    /// page on until one comes back empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_before: Option<u64>,
}

/// A WebAssembly component's bytes.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)]
pub struct WasmComponent(Vec<u8>);

#[utoipa::path(get, path = "/admin/v1/tenants", tag = "tenants",
    responses((status = 200, body = List<TenantView>), (status = 401, body = ErrorResponse)))]
async fn list_tenants(State(app): State<Arc<App>>) -> Response<Body> {
    respond(
        &app,
        (|| {
            Ok(reply(
                StatusCode::OK,
                &List {
                    data: app.control.tenants()?,
                },
            ))
        })(),
    )
}

#[utoipa::path(post, path = "/admin/v1/tenants", tag = "tenants", request_body = CreateTenant,
    responses((status = 201, body = TenantView), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 409, body = ErrorResponse),
        (status = 413, body = ErrorResponse)))]
async fn create_tenant(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    let answer = async {
        let new: CreateTenant = json_body(body, &headers).await?;
        let view = app
            .control
            .create_tenant(
                &Actor::Admin,
                &new.name,
                new.quota(),
                new.models.clone(),
                new.objective.as_deref(),
            )
            .await?;
        Ok(reply(StatusCode::CREATED, &view))
    };
    respond(&app, answer.await)
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = TenantView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn get_tenant(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    respond(
        &app,
        app.control
            .tenant(name(&tenant))
            .map(|v| reply(StatusCode::OK, &v))
            .map_err(Into::into),
    )
}

#[utoipa::path(patch, path = "/admin/v1/tenants/{tenant}", tag = "tenants", request_body = TenantPatch,
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = TenantView), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
        (status = 409, body = ErrorResponse)))]
async fn update_tenant(
    State(app): State<Arc<App>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    let answer = async {
        let patch: TenantPatch = json_body(body, &headers).await?;
        let view = app
            .control
            .update_tenant(&Actor::Admin, name(&tenant), patch)
            .await?;
        Ok(reply(StatusCode::OK, &view))
    };
    respond(&app, answer.await)
}

#[utoipa::path(delete, path = "/admin/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = Deleted), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn delete_tenant(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    let answer = async {
        let requests_ended = app
            .control
            .delete_tenant(&Actor::Admin, name(&tenant))
            .await?;
        Ok(reply(
            StatusCode::OK,
            &Deleted {
                deleted: tenant.clone(),
                requests_ended,
            },
        ))
    };
    respond(&app, answer.await)
}

/// A tenant's canaries, and whether anything scans for them.
#[derive(Serialize, utoipa::ToSchema)]
pub struct CanariesView {
    /// The strings.
    pub canaries: Vec<String>,
    /// Whether the runtime canary guard is on (`server.canary_guard`).
    pub guard: bool,
    /// Said when the guard is off: registered canaries are kept, but no
    /// response is scanned for them until it is turned on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl CanariesView {
    pub fn of(app: &App, canaries: Canaries) -> CanariesView {
        let guard = app.serving.canary_guard;
        CanariesView {
            canaries: canaries.canaries,
            guard,
            note: (!guard).then(|| {
                "the canary guard is off (server.canary_guard = false): nothing scans responses for these until it is turned on".into()
            }),
        }
    }
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/canaries", tag = "tenants",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = CanariesView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn get_canaries(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    respond(
        &app,
        app.control
            .canaries(name(&tenant))
            .map(|v| reply(StatusCode::OK, &CanariesView::of(&app, v)))
            .map_err(Into::into),
    )
}

#[utoipa::path(put, path = "/admin/v1/tenants/{tenant}/canaries", tag = "tenants", request_body = Canaries,
    description = "Replaces the tenant's canaries. With `server.canary_guard` on, every other tenant's response carrying one is blocked (500 `output_blocked`), counted and audited; with it off, the answer's `note` says nothing scans for them.",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = CanariesView), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
async fn set_canaries(
    State(app): State<Arc<App>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    let answer = async {
        let canaries: Canaries = json_body(body, &headers).await?;
        let view = app
            .control
            .set_canaries(&Actor::Admin, name(&tenant), canaries)
            .await?;
        Ok(reply(StatusCode::OK, &CanariesView::of(&app, view)))
    };
    respond(&app, answer.await)
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/keys", tag = "keys",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = List<KeyView>), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn list_keys(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    respond(
        &app,
        (|| {
            Ok(reply(
                StatusCode::OK,
                &List {
                    data: app.control.keys(name(&tenant))?,
                },
            ))
        })(),
    )
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/keys", tag = "keys",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 201, body = IssuedKey, description = "The secret is shown here, once"),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
        (status = 409, body = ErrorResponse)))]
async fn issue_key(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    let answer = async {
        let issued = app.control.issue_key(&Actor::Admin, name(&tenant)).await?;
        Ok(reply(StatusCode::CREATED, &issued))
    };
    respond(&app, answer.await)
}

#[utoipa::path(delete, path = "/admin/v1/tenants/{tenant}/keys/{key}", tag = "keys",
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("key" = String, Path, description = "The key's id")),
    responses((status = 200, body = KeyView, description = "The key, revoked"),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
async fn revoke_key(
    State(app): State<Arc<App>>,
    Path((tenant, key)): Path<(String, String)>,
) -> Response<Body> {
    let answer = async {
        let view = app
            .control
            .revoke_key(&Actor::Admin, name(&tenant), &key)
            .await?;
        Ok(reply(StatusCode::OK, &view))
    };
    respond(&app, answer.await)
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/plugins", tag = "plugins",
    params(("tenant" = String, Path, description = "The tenant's name")),
    responses((status = 200, body = List<PluginView>), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn list_plugins(State(app): State<Arc<App>>, Path(tenant): Path<String>) -> Response<Body> {
    respond(
        &app,
        (|| {
            Ok(reply(
                StatusCode::OK,
                &List {
                    data: app.control.plugins(name(&tenant))?,
                },
            ))
        })(),
    )
}

#[utoipa::path(get, path = "/admin/v1/tenants/{tenant}/plugins/{plugin}", tag = "plugins",
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("plugin" = String, Path, description = "The plugin's name")),
    responses((status = 200, body = PluginView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn get_plugin(
    State(app): State<Arc<App>>,
    Path((tenant, plugin)): Path<(String, String)>,
) -> Response<Body> {
    respond(
        &app,
        app.control
            .plugin(name(&tenant), &plugin)
            .map(|v| reply(StatusCode::OK, &v))
            .map_err(Into::into),
    )
}

#[utoipa::path(put, path = "/admin/v1/tenants/{tenant}/plugins/{plugin}", tag = "plugins",
    request_body(content = WasmComponent, content_type = "application/wasm"),
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("plugin" = String, Path, description = "The plugin's name"), UploadOptions),
    responses((status = 200, body = PluginView, description = "Stored (a new version if the name existed)"),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse),
        (status = 413, body = ErrorResponse)))]
async fn upload_plugin(
    State(app): State<Arc<App>>,
    Path((tenant, plugin)): Path<(String, String)>,
    options: Result<Query<UploadOptions>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    let answer = upload(
        &app.control,
        &Actor::Admin,
        name(&tenant),
        &plugin,
        options,
        &headers,
        body,
    );
    respond(&app, answer.await)
}

/// Reads a component body and stores it (admin and self-service alike). The
/// body is read before the query is judged, so a refused upload still gets
/// its answer rather than a reset connection.
pub async fn upload(
    control: &Control,
    actor: &Actor,
    tenant: TenantRef<'_>,
    plugin: &str,
    options: Result<Query<UploadOptions>, QueryRejection>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response<Body>, ApiError> {
    let bytes = read_body(body, headers, PLUGIN_BYTES_MAX as u64).await?;
    let options = query(options)?;
    let view = control
        .upload_plugin(actor, tenant, plugin, &bytes, options)
        .await?;
    Ok(reply(StatusCode::OK, &view))
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/plugins/{plugin}/enable", tag = "plugins",
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("plugin" = String, Path, description = "The plugin's name")),
    responses((status = 200, body = PluginView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn enable_plugin(
    State(app): State<Arc<App>>,
    Path((tenant, plugin)): Path<(String, String)>,
) -> Response<Body> {
    let answer = app
        .control
        .set_plugin_enabled(&Actor::Admin, name(&tenant), &plugin, true)
        .await;
    respond(
        &app,
        answer
            .map(|v| reply(StatusCode::OK, &v))
            .map_err(Into::into),
    )
}

#[utoipa::path(post, path = "/admin/v1/tenants/{tenant}/plugins/{plugin}/disable", tag = "plugins",
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("plugin" = String, Path, description = "The plugin's name")),
    responses((status = 200, body = PluginView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn disable_plugin(
    State(app): State<Arc<App>>,
    Path((tenant, plugin)): Path<(String, String)>,
) -> Response<Body> {
    let answer = app
        .control
        .set_plugin_enabled(&Actor::Admin, name(&tenant), &plugin, false)
        .await;
    respond(
        &app,
        answer
            .map(|v| reply(StatusCode::OK, &v))
            .map_err(Into::into),
    )
}

#[utoipa::path(delete, path = "/admin/v1/tenants/{tenant}/plugins/{plugin}", tag = "plugins",
    params(("tenant" = String, Path, description = "The tenant's name"),
        ("plugin" = String, Path, description = "The plugin's name")),
    responses((status = 204, description = "Deleted"), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn delete_plugin(
    State(app): State<Arc<App>>,
    Path((tenant, plugin)): Path<(String, String)>,
) -> Response<Body> {
    let answer = app
        .control
        .delete_plugin(&Actor::Admin, name(&tenant), &plugin)
        .await;
    respond(&app, answer.map(|()| no_content()).map_err(Into::into))
}

/// An empty 204.
pub fn no_content() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::NO_CONTENT;
    response
}

#[utoipa::path(get, path = "/admin/v1/partitions", tag = "capacity",
    responses((status = 200, body = List<PartitionView>), (status = 401, body = ErrorResponse)))]
async fn partitions(State(app): State<Arc<App>>) -> Response<Body> {
    let directory = app.control.registry().snapshot();
    let mut data = Vec::new();
    for model in app.control.catalog().snapshot().all() {
        let stats = model.engine.stats();
        data.extend(stats.tenants.iter().filter_map(|t| {
            let tenant = directory.tenant(TenantId(t.id))?;
            Some(PartitionView {
                model: model.spec.id.clone(),
                tenant: tenant.name.clone(),
                tenant_id: t.id,
                pages_reserved: t.pages_reserved,
                pages_max: t.pages_max,
                pages_owned: t.pages_owned,
                pages_booked: t.pages_booked,
                pages_released: t.pages_released,
                pages_available: t.pages_available,
                pages_cached: t.pages_shared,
                queued: t.queued,
                running: t.running,
            })
        }));
    }
    reply(StatusCode::OK, &List { data })
}

#[utoipa::path(get, path = "/admin/v1/capacity", tag = "capacity",
    responses((status = 200, body = List<CapacityView>), (status = 401, body = ErrorResponse)))]
async fn capacity(State(app): State<Arc<App>>) -> Response<Body> {
    let answer = app.control.capacity().map(|capacities| {
        let data: Vec<CapacityView> = capacities
            .iter()
            .map(|capacity| CapacityView {
                model: capacity.model.clone(),
                promised_tokens: capacity.promised_tokens,
                ok: capacity.check().is_ok(),
                prefill_chunk_tokens: capacity.step_tokens_max,
                limits: capacity_limits(capacity),
            })
            .collect();
        reply(StatusCode::OK, &List { data })
    });
    respond(&app, answer.map_err(Into::into))
}

/// One model's live state, for the operator console's overview.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ModelStatsView {
    /// The model.
    pub model: String,
    /// Whether its engine accepts requests.
    pub ready: bool,
    /// Panics of its engine since it was loaded (each ended the requests in
    /// flight with `engine_fault`).
    pub engine_panics: u64,
    /// Engines rebuilt after a panic since it was loaded.
    pub engine_restarts: u64,
    /// Pages in its KV pool.
    pub pages_count: u32,
    /// Clean pages on the free list.
    pub pages_free: u32,
    /// Token positions a page holds.
    pub page_tokens: u32,
    /// Requests waiting, every tenant.
    pub queued: u32,
    /// Sequences running, every tenant.
    pub running: u32,
    /// Tokens generated since this engine started.
    pub tokens_generated_total: u64,
    /// The last ten minutes in five-second buckets, oldest first; buckets
    /// without events are left out.
    pub recent: Vec<crate::live::Point>,
}

/// Every model's live state.
#[derive(Serialize, utoipa::ToSchema)]
pub struct StatsView {
    /// When this was read, Unix milliseconds.
    pub now_ms: u64,
    /// The width of a bucket of `recent`, milliseconds.
    pub bucket_ms: u64,
    /// Per model, in id order.
    pub models: Vec<ModelStatsView>,
    /// The latest isolation alarms on this server, newest first (at most
    /// 100 of each kind, so a flood of one kind hides no other; the audit
    /// log keeps every one).
    pub alarms: Vec<crate::live::Alarm>,
    /// Alarms raised since this server started.
    pub alarms_total: u64,
}

/// Live state: each model's readiness, engine faults, pool and queues, and
/// its requests, tokens and times to first token over the last ten minutes
/// (kept in memory: a restarted server starts them empty). Cheap: no engine
/// is stopped to answer (unlike the pool audit).
#[utoipa::path(get, path = "/admin/v1/stats", tag = "capacity",
    responses((status = 200, body = StatsView), (status = 401, body = ErrorResponse)))]
async fn stats(State(app): State<Arc<App>>) -> Response<Body> {
    let now = now_ms();
    let recent = crate::live::recent();
    let models = app
        .control
        .catalog()
        .snapshot()
        .all()
        .map(|model| {
            let stats = model.engine.stats();
            let (engine_panics, engine_restarts) = model.engine.faults();
            ModelStatsView {
                model: model.spec.id.clone(),
                ready: model.engine.is_accepting(),
                engine_panics,
                engine_restarts,
                pages_count: stats.pages_count,
                pages_free: stats.pages_free,
                page_tokens: stats.page_tokens,
                queued: stats.tenants.iter().map(|t| t.queued).sum(),
                running: stats.tenants.iter().map(|t| t.running).sum(),
                tokens_generated_total: stats.tokens_generated_total,
                recent: recent.window(&model.spec.id, now),
            }
        })
        .collect();
    let (alarms, alarms_total) = recent.alarms();
    reply(
        StatusCode::OK,
        &StatsView {
            now_ms: now,
            bucket_ms: crate::live::BUCKET_MS,
            models,
            alarms,
            alarms_total,
        },
    )
}

#[utoipa::path(get, path = "/admin/v1/models", tag = "models",
    responses((status = 200, body = List<ModelView>), (status = 401, body = ErrorResponse)))]
async fn list_models(State(app): State<Arc<App>>) -> Response<Body> {
    reply(
        StatusCode::OK,
        &List {
            data: app.control.models(),
        },
    )
}

#[utoipa::path(post, path = "/admin/v1/models", tag = "models", request_body = ModelSpec,
    responses((status = 201, body = ModelView, description = "Loaded and serving"),
        (status = 400, body = ErrorResponse, description = "A bad value, or a file that cannot be served"),
        (status = 401, body = ErrorResponse),
        (status = 409, body = ErrorResponse, description = "The id is taken, or the memory budget or a capacity contract would break"),
        (status = 413, body = ErrorResponse)))]
async fn add_model(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response<Body> {
    let answer = async {
        let spec: ModelSpec = json_body(body, &headers).await?;
        let view = app.control.add_model(&Actor::Admin, spec).await?;
        Ok(reply(StatusCode::CREATED, &view))
    };
    respond(&app, answer.await)
}

#[utoipa::path(get, path = "/admin/v1/models/{model}", tag = "models",
    params(("model" = String, Path, description = "The model's id")),
    responses((status = 200, body = ModelView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn get_model(State(app): State<Arc<App>>, Path(model): Path<String>) -> Response<Body> {
    respond(
        &app,
        app.control
            .model(&model)
            .map(|v| reply(StatusCode::OK, &v))
            .map_err(Into::into),
    )
}

/// The model `id` in the catalog now, or a 404.
fn served(app: &App, id: &str) -> Result<Arc<Served>, ApiError> {
    app.control
        .catalog()
        .snapshot()
        .get(id)
        .cloned()
        .ok_or_else(|| ApiError::ObjectNotFound {
            what: "model",
            name: id.into(),
        })
}

/// Audits a model's KV pool.
///
/// Computed on the model's engine thread between two steps: the pool's
/// counts, a scan of every free page's bytes for anything not zero, and
/// every invariant check. The scan stalls that model's engine for one pass
/// over the free pages (roughly pages × page bytes at memory speed), so this
/// is for operators and tests, not for a scrape loop.
#[utoipa::path(get, path = "/admin/v1/models/{model}/pool", tag = "models",
    params(("model" = String, Path, description = "The model's id")),
    responses((status = 200, body = PoolAuditView), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse),
        (status = 503, body = ErrorResponse, description = "The engine is down (restarting after a fault, or stopped)")))]
async fn model_pool(State(app): State<Arc<App>>, Path(model): Path<String>) -> Response<Body> {
    let answer = async {
        let audit = served(&app, &model)?.engine.audit().await?;
        if !audit.free_pages_dirty.is_empty() {
            // An isolation failure: the next sequence on that page would read
            // another's KV. Which pages, for whoever debugs it.
            let first: Vec<u32> = audit.free_pages_dirty.iter().take(8).map(|p| p.0).collect();
            tracing::error!(
                model = %model,
                pages_dirty = audit.free_pages_dirty.len(),
                first = ?first,
                "pool audit: free pages not scrubbed"
            );
        }
        let directory = app.control.registry().snapshot();
        let tenants = audit
            .tenants
            .iter()
            .map(|t| TenantPagesView {
                tenant: directory.tenant(TenantId(t.id)).map(|r| r.name.clone()),
                tenant_id: t.id,
                pages_owned: t.pages_owned,
                pages_released: t.pages_released,
                pages_booked: t.pages_booked,
                pages_shared: t.pages_shared,
            })
            .collect();
        let view = PoolAuditView {
            model,
            pool_id: audit.pool_id.0,
            in_flight: audit.in_flight,
            pages_count: audit.pages_count,
            pages_free: audit.pages_free,
            pages_owned: audit.pages_owned,
            pages_released: audit.pages_released,
            pages_shared: audit.pages_shared,
            pages_booked: audit.pages_booked,
            free_pages_checked: audit.free_pages_checked,
            // At most the pool's pages.
            free_pages_dirty: audit.free_pages_dirty.len() as u32,
            pages_scrubbed_total: audit.pages_scrubbed_total,
            invariants: audit
                .invariants
                .clone()
                .err()
                .unwrap_or_else(|| "ok".into()),
            at_baseline: audit.at_baseline(),
            tenants,
        };
        Ok(reply(StatusCode::OK, &view))
    };
    respond(&app, answer.await)
}

/// Makes a model's engine thread panic between two steps, with whatever is
/// in flight (202 `{"model": ID}` once the command is sent; 404 for an
/// unknown model, 503 when the engine is down or restarting).
///
/// The supervisor then does what it does for any panic: ends the requests in
/// flight with `engine_fault`, drops the pool, rebuilds after its backoff.
/// It exists so the isolation suite can exercise that path through the real
/// binary; it is compiled only with feature `fault-injection` (the test
/// build), so a production build has no such back door, and it is not in the
/// OpenAPI document, which describes production builds.
#[cfg(feature = "fault-injection")]
async fn fault_panic(State(app): State<Arc<App>>, Path(model): Path<String>) -> Response<Body> {
    let answer = (|| {
        served(&app, &model)?.engine.inject_panic()?;
        tracing::warn!(model = %model, "fault injection: the engine will panic");
        Ok(reply(
            StatusCode::ACCEPTED,
            &serde_json::json!({ "model": model }),
        ))
    })();
    respond(&app, answer)
}

/// `POST /admin/v1/tenants/{tenant}/fault/plugin-stall` `{"ms": N}` (test
/// builds only): every host call of a plugin running for `tenant`'s requests
/// blocks for the next N ms (0 ends it), as a host function stuck on a
/// stalled disk would. 202 `{"tenant", "ms"}`; 404 for an unknown tenant.
#[cfg(feature = "fault-injection")]
async fn fault_plugin_stall(
    State(app): State<Arc<App>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response<Body> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stall {
        ms: u64,
    }
    let answer = async {
        let stall: Stall = json_body(body, &headers).await?;
        let id = app.control.tenant(name(&tenant))?.id;
        crate::policy::fault::stall_host_calls(
            crate::tenancy::TenantId(id),
            std::time::Duration::from_millis(stall.ms),
        );
        tracing::warn!(tenant = %tenant, ms = stall.ms, "fault injection: plugin host calls stall");
        Ok(reply(
            StatusCode::ACCEPTED,
            &serde_json::json!({ "tenant": tenant, "ms": stall.ms }),
        ))
    }
    .await;
    respond(&app, answer)
}

/// How a model is unloaded.
#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// How long its requests in flight may run on, milliseconds (default:
    /// `server.drain_timeout_ms`); then they end with `model_removed`.
    pub drain_ms: Option<u64>,
}

#[utoipa::path(delete, path = "/admin/v1/models/{model}", tag = "models",
    params(("model" = String, Path, description = "The model's id"), RemoveQuery),
    responses((status = 200, body = ModelRemoved, description = "Unloaded: its memory is freed"),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
        (status = 404, body = ErrorResponse)))]
async fn remove_model(
    State(app): State<Arc<App>>,
    Path(model): Path<String>,
    q: Result<Query<RemoveQuery>, QueryRejection>,
) -> Response<Body> {
    let answer = async {
        let q = query(q)?;
        let drain_ms = q.drain_ms.unwrap_or(app.control.drain_default_ms());
        if drain_ms > crate::config::TIMEOUT_MS_LIMIT {
            return Err(ApiError::InvalidValue {
                param: "drain_ms".into(),
                message: format!("at most {}", crate::config::TIMEOUT_MS_LIMIT),
            });
        }
        let removed = app
            .control
            .remove_model(
                &Actor::Admin,
                &model,
                std::time::Duration::from_millis(drain_ms),
            )
            .await?;
        crate::live::recent().forget(&model);
        Ok(reply(StatusCode::OK, &removed))
    };
    respond(&app, answer.await)
}

#[utoipa::path(get, path = "/admin/v1/usage", tag = "usage", params(UsageQuery),
    responses((status = 200, body = UsageView), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
async fn usage(
    State(app): State<Arc<App>>,
    q: Result<Query<UsageQuery>, QueryRejection>,
) -> Response<Body> {
    let answer = (|| {
        let q = query(q)?;
        let (from, to) = q.window()?;
        let view = match (&q.tenant, q.tenant_id) {
            (Some(tenant), None) => app.control.usage(name(tenant), from, to)?,
            (None, Some(id)) => app.control.usage_of(id, from, to)?,
            _ => {
                return Err(ApiError::InvalidValue {
                    param: "tenant".into(),
                    message: "give exactly one of tenant and tenant_id".into(),
                })
            }
        };
        Ok(reply(StatusCode::OK, &view))
    })();
    respond(&app, answer)
}

#[utoipa::path(get, path = "/admin/v1/audit", tag = "audit", params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = 400, body = ErrorResponse),
        (status = 401, body = ErrorResponse)))]
async fn audit_log(
    State(app): State<Arc<App>>,
    q: Result<Query<AuditQuery>, QueryRejection>,
) -> Response<Body> {
    let answer = (|| {
        let q = query(q)?;
        let after = q.after.unwrap_or(0);
        let limit = q.limit.unwrap_or(100);
        if !(1..=AUDIT_PAGE_MAX).contains(&limit) {
            return Err(ApiError::InvalidValue {
                param: "limit".into(),
                message: format!("must be 1..={AUDIT_PAGE_MAX}"),
            });
        }
        let newest_first = match q.before {
            Some(_) if q.after.is_some() => {
                return Err(ApiError::InvalidValue {
                    param: "before".into(),
                    message: "give after (oldest first) or before (newest first), not both".into(),
                })
            }
            Some(_) => true,
            None => false,
        };
        // Unfiltered, one store read of `limit`; filtered, reads of whole
        // pages until `limit` records match or AUDIT_SCAN_MAX were looked at.
        let chunk = if q.filtered() { AUDIT_PAGE_MAX } else { limit };
        let mut data = Vec::new();
        let mut cursor = if newest_first {
            q.before.unwrap_or(u64::MAX)
        } else {
            after
        };
        let (mut scanned, mut newest) = (0, None);
        'scan: loop {
            let page = if newest_first {
                app.control.audit_log_before(cursor, chunk)?
            } else {
                app.control.audit_log(cursor, chunk)?
            };
            let last_page = page.len() < chunk;
            for record in page {
                scanned += 1;
                cursor = record.seq;
                newest = newest.max(Some(record.seq));
                if q.matches(&record) {
                    data.push(record);
                    if data.len() == limit {
                        break 'scan;
                    }
                }
            }
            if last_page || scanned >= AUDIT_SCAN_MAX {
                break;
            }
        }
        let page = if newest_first {
            AuditPage {
                next_after: newest.unwrap_or(0),
                next_before: (scanned > 0).then_some(cursor),
                data,
            }
        } else {
            AuditPage {
                next_after: cursor,
                next_before: None,
                data,
            }
        };
        Ok(reply(StatusCode::OK, &page))
    })();
    respond(&app, answer)
}

async fn openapi() -> Response<Body> {
    let mut response = Response::new(Body::from(
        AdminApi::openapi().to_json().unwrap_or_default(),
    ));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Adds the admin token as a bearer security scheme, required everywhere.
struct AdminToken;

impl utoipa::Modify for AdminToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        openapi.security = Some(vec![SecurityRequirement::new(
            "admin_token",
            Vec::<String>::new(),
        )]);
    }
}

/// The admin API's OpenAPI 3.1 document.
#[derive(OpenApi)]
#[openapi(
    info(title = "Bulkhead admin API", description = "Tenants, keys, quotas, plugins, models, capacity, usage and the audit log of a Bulkhead server. Every route needs `Authorization: Bearer <admin token>`."),
    paths(list_tenants, create_tenant, get_tenant, update_tenant, delete_tenant, get_canaries,
        set_canaries, list_keys,
        issue_key, revoke_key, list_plugins, get_plugin, upload_plugin, enable_plugin,
        disable_plugin, delete_plugin, list_models, add_model, get_model, remove_model,
        model_pool, partitions, capacity, stats, usage, audit_log),
    components(schemas(ErrorResponse, TenantView, KeyView, IssuedKey, PluginView, UsageView,
        AuditRecord, CapacityView, PartitionView, StatsView, ModelStatsView, crate::live::Point, crate::live::Alarm, PoolAuditView, TenantPagesView, Deleted, AuditPage, CreateTenant, TenantPatch,
        Quota, WasmComponent, ModelSpec, ModelView, ModelRemoved, Source, Canaries, CanariesView)),
    modifiers(&AdminToken)
)]
pub struct AdminApi;
