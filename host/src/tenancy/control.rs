//! The control plane's writes: tenants, keys, quotas and plugins change here
//! and nowhere else, while the server runs.
//!
//! Every change holds one lock (one write at a time) and runs in this order:
//!
//! 1. **Validate** names, numbers and existence (400, 404, 409) before anything else.
//! 2. **Contract**: the tenant set the change would make is checked against the
//!    capacity contract (I2) and the pool's reservations (I8); a violation is a
//!    409 with the table of limits, and nothing is written anywhere.
//! 3. **Engine**: tenant and quota changes are applied between two steps. The
//!    pool may refuse a partition it cannot grant right now (other tenants'
//!    bursts hold the pages a larger reservation needs): 409, nothing written.
//! 4. **Store**: the records and the audit record commit together and are
//!    flushed to disk; only then does the caller get its 2xx. If the commit
//!    fails, the engine change is undone.
//! 5. **Registry**: the new directory is published; the next request sees it.
//!
//! A crash between 3 and 4 loses an engine change that was never acknowledged:
//! the next start builds the engine from the store, so the two agree again.
//! Deleting a tenant unpublishes it first (its keys stop working at once), then
//! ends its requests in the engine (`tenant_removed`), then commits.

use super::{
    canary, hex, key_digest, valid_name, Directory, ModelAccess, Quota, Registry, Tenant, TenantId,
    KEY_BYTES_MAX,
};
use crate::capacity::{Capacity, CapacityViolation, MemoryViolation};
use crate::catalog::{self, Catalog, LoadError, Served, Source};
use crate::clock::now_ms;
use crate::config::{Config, ModelSpec, MODELS_MAX};
use crate::engine::request::FinishReason;
use crate::engine::scheduler::FinishSink;
use crate::engine::service::{ChangeError, TenantChange};
use crate::policy::PolicyRuntime;
use crate::store::records::{
    AnnouncedModel, AuditRecord, KeyRecord, KeySource, ModelRecord, PluginLimitsRequest,
    PluginRecord, ServerRecord, TenantRecord, UsageRecord,
};
use crate::store::usage::{minute_of, UsageBook};
use crate::store::{Batch, Fence, Store, StoreError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;

mod plugins;

pub use plugins::{PluginView, UploadOptions};

/// Most tenants a deployment may have.
pub const TENANTS_MAX: usize = crate::config::TENANTS_MAX;
/// Most live keys per tenant.
pub const KEYS_PER_TENANT_MAX: usize = 32;
/// Most key records per tenant, revoked ones included: past it, issuing a key
/// forgets the oldest revoked ones (never one from the environment, which a
/// restart would otherwise bring back).
pub const KEY_RECORDS_PER_TENANT_MAX: usize = 128;
/// Most plugins per tenant.
pub const PLUGINS_PER_TENANT_MAX: usize = 16;
/// Largest plugin component, in bytes.
pub const PLUGIN_BYTES_MAX: usize = 16 << 20;
/// Longest plugin name.
pub const PLUGIN_NAME_BYTES_MAX: usize = 64;
/// Widest usage window one query may ask for: 31 days of minutes.
pub const USAGE_MINUTES_MAX: u64 = 31 * 24 * 60;
/// Random bytes in a generated key (hex-encoded: twice as many characters).
pub const SECRET_BYTES: usize = 24;
/// Characters of a key shown to tell keys apart.
pub const KEY_PREFIX_CHARS: usize = 12;

/// Why a change was refused or failed. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No such object (for a tenant's own routes, also: another tenant's).
    #[error("{what} {name:?} does not exist")]
    NotFound {
        /// "tenant", "key", "plugin", "model".
        what: &'static str,
        /// What was asked for.
        name: String,
    },
    /// The name is taken.
    #[error("{what} {name:?} exists already")]
    Exists {
        /// "tenant", "plugin".
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A value outside its bounds.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The change would break a model's capacity contract (I2, I8).
    #[error(transparent)]
    Capacity(#[from] CapacityViolation),
    /// The catalog would not fit `engine.memory_max`.
    #[error(transparent)]
    Memory(#[from] MemoryViolation),
    /// A model's file could not be loaded.
    #[error(transparent)]
    Load(LoadError),
    /// The KV pool cannot apply the change now.
    #[error("the KV pool cannot apply this now: {0}")]
    Pool(String),
    /// A count limit.
    #[error("at most {max} {what}")]
    TooMany {
        /// What is counted.
        what: &'static str,
        /// The limit.
        max: usize,
    },
    /// The store failed (the cause is logged; the client sees a 500).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The engine is not running.
    #[error("the engine is not running")]
    Engine,
    /// A name kept for someone else (a tenant plugin may not take an
    /// operator plugin's name).
    #[error(
        "{what} name {name:?} is reserved for the operator's plugin of that name; choose another"
    )]
    Reserved {
        /// "plugin".
        what: &'static str,
        /// The name.
        name: String,
    },
    /// Too many of these for now.
    #[error("too many {what} for now; retry after {retry_after_secs} s")]
    RateLimited {
        /// What is limited.
        what: &'static str,
        /// When to retry.
        retry_after_secs: u32,
    },
    /// Over a quota of bytes.
    #[error("{what} would take {needed} bytes, over this tenant's quota of {max}; delete or shrink a plugin first")]
    Quota {
        /// What is counted.
        what: &'static str,
        /// What the change would need in all.
        needed: u64,
        /// The quota.
        max: u64,
    },
    /// The server cannot do this now (try again shortly).
    #[error("{0}")]
    Busy(String),
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ControlError {
    ControlError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// A tenant as a caller names it: the admin by name, a tenant itself by id
/// (its key authenticated an id; a name may belong to a newer tenant by now).
#[derive(Clone, Copy, Debug)]
pub enum TenantRef<'a> {
    /// By name.
    Name(&'a str),
    /// By id.
    Id(TenantId),
}

impl TenantRef<'_> {
    fn matches(&self, tenant: &TenantRecord) -> bool {
        match self {
            TenantRef::Name(name) => tenant.name == *name,
            TenantRef::Id(id) => tenant.id == id.0,
        }
    }

    fn not_found(&self) -> ControlError {
        ControlError::NotFound {
            what: "tenant",
            name: match self {
                TenantRef::Name(name) => (*name).to_string(),
                TenantRef::Id(id) => format!("#{}", id.0),
            },
        }
    }
}

/// Who asks for a change (the audit log's `actor`).
#[derive(Clone, Debug)]
pub enum Actor {
    /// The operator, with the admin token.
    Admin,
    /// A tenant, with its own key, on its own objects.
    Tenant(String),
    /// The server itself (start-up).
    System,
}

impl Actor {
    fn label(&self) -> String {
        match self {
            Actor::Admin => "admin".into(),
            Actor::Tenant(name) => format!("tenant:{name}"),
            Actor::System => "system".into(),
        }
    }
}

/// A tenant's canary strings for the runtime canary guard (see
/// [`canary`]): harmless unique markers the operator plants in its prompts;
/// the guard blocks any other tenant's response that carries one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Canaries {
    /// The strings: at most 32, each 8-256 bytes, no repeats (`[]` for none).
    pub canaries: Vec<String>,
}

/// A tenant as the admin API shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct TenantView {
    /// Its id (never reused).
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Its limits.
    pub quota: Quota,
    /// The models it may use: `["*"]` for every model, else their ids.
    #[schema(value_type = Vec<String>)]
    pub models: ModelAccess,
    /// The inference objective the gateway sets on its requests, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// Created, Unix milliseconds.
    pub created_ms: u64,
    /// Last changed, Unix milliseconds.
    pub updated_ms: u64,
}

impl From<&TenantRecord> for TenantView {
    fn from(t: &TenantRecord) -> TenantView {
        TenantView {
            id: t.id,
            name: t.name.clone(),
            quota: t.quota,
            models: t.models.clone(),
            objective: t.objective.clone(),
            created_ms: t.created_ms,
            updated_ms: t.updated_ms,
        }
    }
}

/// A change to some of a tenant's limits and model access; absent fields keep
/// their value.
#[derive(Clone, Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantPatch {
    /// Share of the engine under contention (1..=1000).
    pub weight: Option<u32>,
    /// KV pages only this tenant may use.
    pub pages_reserved: Option<u32>,
    /// The most KV pages it may hold.
    pub pages_max: Option<u32>,
    /// Most requests waiting for pages.
    pub queue_depth_max: Option<u32>,
    /// Most sequences running at once.
    pub running_max: Option<u32>,
    /// Most requests before admission at once.
    pub pending_max: Option<u32>,
    /// Whether its repeated prompt prefixes are cached.
    pub prefix_cache: Option<bool>,
    /// The models it may use: `["*"]` for every model, else ids of models in
    /// the catalog.
    #[schema(value_type = Option<Vec<String>>)]
    pub models: Option<ModelAccess>,
    /// The inference objective the gateway sets on its requests (an
    /// InferenceObjective's name); `""` clears it.
    pub objective: Option<String>,
}

/// Checks an objective from the API: None and `""` mean none.
fn objective_of(objective: Option<&str>) -> Result<Option<String>, ControlError> {
    match objective {
        None | Some("") => Ok(None),
        Some(name) if crate::config::valid_objective(name) => Ok(Some(name.to_string())),
        Some(_) => Err(invalid(
            "objective",
            "a Kubernetes object name: 1-253 of [a-z0-9.-], starting and ending with a letter or digit",
        )),
    }
}

impl TenantPatch {
    fn apply(&self, q: Quota) -> Quota {
        Quota {
            weight: self.weight.unwrap_or(q.weight),
            pages_reserved: self.pages_reserved.unwrap_or(q.pages_reserved),
            pages_max: self.pages_max.unwrap_or(q.pages_max),
            queue_depth_max: self.queue_depth_max.unwrap_or(q.queue_depth_max),
            running_max: self.running_max.unwrap_or(q.running_max),
            pending_max: self.pending_max.unwrap_or(q.pending_max),
            prefix_cache: self.prefix_cache.unwrap_or(q.prefix_cache),
        }
    }
}

/// An API key as the API shows it: never the secret, never its digest.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct KeyView {
    /// Its id (what the revoke route names).
    pub id: String,
    /// The secret's first characters, to tell keys apart.
    pub prefix: String,
    /// Where it came from: `issued`, `policy`, `env`, `generated`.
    pub source: String,
    /// Created, Unix milliseconds.
    pub created_ms: u64,
    /// Revoked, Unix milliseconds (absent while it works).
    pub revoked_ms: Option<u64>,
}

impl From<&KeyRecord> for KeyView {
    fn from(k: &KeyRecord) -> KeyView {
        let source = match &k.source {
            KeySource::Issued => "issued",
            KeySource::Policy => "policy",
            KeySource::Env { .. } => "env",
            KeySource::Generated => "generated",
        };
        KeyView {
            id: k.id.clone(),
            prefix: k.prefix.clone(),
            source: source.into(),
            created_ms: k.created_ms,
            revoked_ms: k.revoked_ms,
        }
    }
}

/// A key just issued: the only time its secret is shown.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct IssuedKey {
    /// The key.
    pub key: KeyView,
    /// The secret to send as `Authorization: Bearer ...`. Shown once; only its
    /// SHA-256 is kept.
    pub secret: String,
}

/// A tenant's usage over a window.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct UsageView {
    /// The tenant's id.
    pub tenant_id: u32,
    /// The window's start (inclusive), Unix milliseconds, on a minute.
    pub from_ms: u64,
    /// The window's end (exclusive), Unix milliseconds, on a minute.
    pub to_ms: u64,
    /// The whole window's counts.
    pub total: UsageCounts,
    /// Minute by minute (minutes without requests are left out).
    pub minutes: Vec<UsageMinute>,
}

/// Request and token counts.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct UsageCounts {
    /// Requests that ended (served or refused).
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their generated tokens.
    pub completion_tokens: u64,
    /// Requests by finish reason or refusal code.
    pub outcomes: BTreeMap<String, u64>,
}

impl From<&UsageRecord> for UsageCounts {
    fn from(u: &UsageRecord) -> UsageCounts {
        UsageCounts {
            requests: u.requests,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            outcomes: u.outcomes.clone(),
        }
    }
}

/// One minute of usage.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct UsageMinute {
    /// The minute's start, Unix milliseconds.
    pub at_ms: u64,
    /// Its counts.
    #[serde(flatten)]
    pub counts: UsageCounts,
}

/// A random hex string of `bytes` random bytes.
pub fn random_hex(bytes: usize) -> Result<String, StoreError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| StoreError::Io(format!("randomness: {e}")))?;
    Ok(hex(&buf))
}

/// A new key for `tenant`: its record (digest only) and its secret.
pub fn new_key(
    tenant: &TenantRecord,
    source: KeySource,
) -> Result<(KeyRecord, String), StoreError> {
    let secret = format!("bk-{}-{}", tenant.name, random_hex(SECRET_BYTES)?);
    let record = key_record(tenant.id, &secret, source)?;
    Ok((record, secret))
}

/// The record of `secret`, a key of tenant `tenant`.
pub fn key_record(tenant: u32, secret: &str, source: KeySource) -> Result<KeyRecord, StoreError> {
    Ok(KeyRecord {
        id: format!("key_{}", random_hex(8)?),
        tenant,
        sha256: hex(&key_digest(secret)),
        prefix: secret.chars().take(KEY_PREFIX_CHARS).collect(),
        source,
        created_ms: now_ms(),
        revoked_ms: None,
    })
}

/// An audit record of `actor` doing `action` on `target`.
pub fn audit(actor: &Actor, action: &str, target: &str) -> AuditRecord {
    AuditRecord {
        seq: 0,
        at_ms: now_ms(),
        actor: actor.label(),
        action: action.into(),
        target: target.into(),
        detail: BTreeMap::new(),
    }
}

fn with_detail(
    mut record: AuditRecord,
    detail: impl IntoIterator<Item = (&'static str, serde_json::Value)>,
) -> AuditRecord {
    record
        .detail
        .extend(detail.into_iter().map(|(k, v)| (k.to_string(), v)));
    record
}

/// One tenant change in one model's engine, and the change that undoes it.
struct EngineChange {
    model: Arc<Served>,
    change: TenantChange,
    undo: TenantChange,
}

/// The engine changes that take tenant `old` (None: absent) to `new` (None:
/// removed) in every model of `models`: a partition added where it gains
/// access, updated where it keeps it, removed where it loses it.
fn tenant_changes<'a>(
    models: impl IntoIterator<Item = &'a Arc<Served>>,
    old: Option<&TenantRecord>,
    new: Option<&TenantRecord>,
) -> Vec<EngineChange> {
    let mut changes = Vec::new();
    for model in models {
        let spec = &model.spec;
        let had = old.filter(|t| t.models.allows(&spec.id));
        let has = new.filter(|t| t.models.allows(&spec.id));
        let (change, undo) = match (had, has) {
            (None, Some(new)) => (
                TenantChange::Add(catalog::tenant_limits(new, spec)),
                TenantChange::Remove(TenantId(new.id)),
            ),
            (Some(old), Some(new)) => (
                TenantChange::Update(catalog::tenant_limits(new, spec)),
                TenantChange::Update(catalog::tenant_limits(old, spec)),
            ),
            (Some(old), None) => (
                TenantChange::Remove(TenantId(old.id)),
                TenantChange::Add(catalog::tenant_limits(old, spec)),
            ),
            (None, None) => continue,
        };
        changes.push(EngineChange {
            model: Arc::clone(model),
            change,
            undo,
        });
    }
    changes
}

/// A model as the admin API shows it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModelView {
    /// What was loaded (its path resolved).
    pub spec: ModelSpec,
    /// `policy` (the policy file's) or `admin` (added through this API).
    pub source: Source,
    /// The context its file holds.
    pub file_context_tokens: u64,
    /// Bytes of its weights.
    pub weights_bytes: u64,
    /// Bytes of its KV pool.
    pub kv_bytes: u64,
    /// Whether its engine accepts requests.
    pub ready: bool,
    /// Loaded, Unix seconds.
    pub created: u64,
}

impl From<&Served> for ModelView {
    fn from(m: &Served) -> ModelView {
        ModelView {
            spec: m.spec.clone(),
            source: m.source,
            file_context_tokens: m.file_context_tokens,
            weights_bytes: m.memory.weights_bytes,
            kv_bytes: m.memory.kv_bytes,
            ready: m.engine.is_accepting(),
            created: m.created,
        }
    }
}

/// What unloading a model did.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModelRemoved {
    /// The model's id.
    pub removed: String,
    /// Requests still in flight at the drain deadline, ended with `model_removed`.
    pub requests_ended: u32,
    /// How long the drain took, milliseconds.
    pub drain_ms: u64,
}

/// The control plane: the store, the registry it feeds, and the catalog whose
/// engines it keeps in step.
pub struct Control {
    store: Arc<Store>,
    registry: Arc<Registry>,
    catalog: Arc<Catalog>,
    policy: Arc<PolicyRuntime>,
    usage: Arc<UsageBook>,
    config: Arc<Config>,
    finishes: Arc<dyn FinishSink>,
    writes: tokio::sync::Mutex<()>,
    /// The tenants as the engines and the registry have them, by id: what a
    /// reload after another server's change compares the store with.
    applied: std::sync::Mutex<BTreeMap<u32, TenantRecord>>,
    /// Whether a shared store answers (always true for one on this machine).
    store_connected: std::sync::atomic::AtomicBool,
    /// This server's name among the servers of a shared store.
    server_name: String,
    /// SHA-256 of the admin token (on a shared store, the one any server
    /// last stored: a rotation through one applies on all).
    admin_token: std::sync::RwLock<[u8; 32]>,
    /// Its announcement's next value (set once it announces).
    announcement: std::sync::OnceLock<tokio::sync::watch::Sender<Vec<u8>>>,
    /// Plugin uploads per tenant (`plugins.uploads_per_minute`).
    uploads: plugins::UploadRate,
    /// Every tenant plugin's record as this server installed it, by tenant
    /// and name: what a reload compares the store with.
    plugins_applied: std::sync::Mutex<std::collections::HashMap<(u32, String), PluginRecord>>,
    /// Admin-added models another server stored that this one could not
    /// load, by id, with the record's time: not tried again until the record
    /// changes.
    models_refused: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

/// A change in progress: the write lock, and the control-plane fence read
/// before anything the change is based on.
struct Writing<'a> {
    _lock: tokio::sync::MutexGuard<'a, ()>,
    fence: Fence,
}

impl Writing<'_> {
    /// A batch that commits only if no other change landed since the fence
    /// was read (on a store shared with other servers).
    fn batch(&self) -> Batch {
        let mut batch = Batch::default();
        batch.fenced(&self.fence);
        batch
    }
}

/// What a reload changed on this server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Tenants new here.
    pub added: u32,
    /// Tenants whose record changed.
    pub updated: u32,
    /// Tenants gone.
    pub removed: u32,
    /// Tenant changes an engine refused (kept as they were; logged).
    pub refused: u32,
    /// Plugins loaded, swapped, taken out or forgotten.
    pub plugins: u32,
    /// Admin-added models loaded here or removed (drained) here.
    pub models: u32,
}

/// This server's name among the servers of a shared store:
/// `BULKHEAD_SERVER_NAME` (in Kubernetes, the pod's name), or the host name
/// and process id.
fn server_name() -> String {
    if let Some(name) = std::env::var("BULKHEAD_SERVER_NAME")
        .ok()
        .filter(|n| valid_server_name(n))
    {
        return name;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| valid_server_name(h))
        .unwrap_or_else(|| "server".into());
    format!("{host}-{}", std::process::id())
}

/// 1-128 of `[A-Za-z0-9._-]`: a key segment and a log value, nothing else.
fn valid_server_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Runs `f` on the current thread, telling the runtime it blocks (store
/// commits wait for an fsync).
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// The parts the control plane works with.
pub struct Parts {
    /// The store, opened and prepared.
    pub store: Arc<Store>,
    /// The registry built from it.
    pub registry: Arc<Registry>,
    /// The catalog, loaded from the policy and the store.
    pub catalog: Arc<Catalog>,
    /// The plugin runtime.
    pub policy: Arc<PolicyRuntime>,
    /// Usage counters.
    pub usage: Arc<UsageBook>,
    /// The policy.
    pub config: Arc<Config>,
    /// Where the engines of models loaded later report each request's end.
    pub finishes: Arc<dyn FinishSink>,
    /// The tenants the engines and the registry were built with.
    pub tenants: Vec<TenantRecord>,
    /// SHA-256 of the admin token.
    pub admin_token_sha256: [u8; 32],
}

impl Control {
    /// The control plane over an opened, prepared store and the running
    /// engines built from it.
    pub fn new(parts: Parts) -> Control {
        Control {
            store: parts.store,
            registry: parts.registry,
            catalog: parts.catalog,
            policy: parts.policy,
            usage: parts.usage,
            config: parts.config,
            finishes: parts.finishes,
            writes: tokio::sync::Mutex::new(()),
            applied: std::sync::Mutex::new(parts.tenants.into_iter().map(|t| (t.id, t)).collect()),
            store_connected: std::sync::atomic::AtomicBool::new(true),
            server_name: server_name(),
            admin_token: std::sync::RwLock::new(parts.admin_token_sha256),
            announcement: std::sync::OnceLock::new(),
            uploads: plugins::UploadRate::default(),
            plugins_applied: Default::default(),
            models_refused: Default::default(),
        }
    }

    /// The registry requests authenticate against.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The catalog requests look models up in.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The usage counters requests add to.
    pub fn usage_book(&self) -> &Arc<UsageBook> {
        &self.usage
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Every model's capacity contract with `tenants`.
    fn capacities_of(&self, tenants: &[TenantRecord]) -> Vec<Capacity> {
        self.catalog
            .snapshot()
            .all()
            .map(|m| {
                Capacity::of_model(
                    &m.spec,
                    m.file_context_tokens,
                    &catalog::quotas_for(&m.spec, tenants),
                )
            })
            .collect()
    }

    /// Ok when every model's contract holds with `tenants`. A refusal of a
    /// change to tenant `subject` also says when that tenant, left out of the
    /// model's users, would let it hold.
    fn check_capacity(&self, tenants: &[TenantRecord], subject: &str) -> Result<(), ControlError> {
        for model in self.catalog.snapshot().all() {
            let capacity = Capacity::of_model(
                &model.spec,
                model.file_context_tokens,
                &catalog::quotas_for(&model.spec, tenants),
            );
            let Err(mut violation) = capacity.check() else {
                continue;
            };
            let others = tenants.iter().filter(|t| t.name != subject);
            let allowed = tenants
                .iter()
                .any(|t| t.name == subject && t.models.allows(&model.spec.id));
            let without = Capacity::of_model(
                &model.spec,
                model.file_context_tokens,
                &catalog::quotas_for(&model.spec, others),
            );
            if allowed && without.check().is_ok() {
                violation.fits_with.push(format!(
                    "tenant {subject}'s models not including {}",
                    model.spec.id
                ));
            }
            return Err(violation.into());
        }
        self.check_other_servers(tenants)
    }

    /// On a shared store, every other live server's contract with
    /// `tenants`: a violation names the server.
    fn check_other_servers(&self, tenants: &[TenantRecord]) -> Result<(), ControlError> {
        if !self.store.shared() {
            return Ok(());
        }
        for (name, server) in blocking(|| self.store.servers::<ServerRecord>())? {
            if name == self.server_name {
                continue;
            }
            for model in server.models {
                let capacity = Capacity::of_model(
                    &model.spec,
                    model.file_context_tokens,
                    &catalog::quotas_for(&model.spec, tenants),
                );
                if let Err(mut violation) = capacity.check() {
                    violation.model = format!("{} on server {name}", violation.model);
                    return Err(violation.into());
                }
            }
        }
        Ok(())
    }

    /// The contracts of the live tenant set, one per model.
    pub fn capacity(&self) -> Result<Vec<Capacity>, ControlError> {
        let tenants = blocking(|| self.store.tenants())?;
        Ok(self.capacities_of(&tenants))
    }

    /// Takes the write lock and reads the fence (first: before anything the
    /// change reads).
    async fn begin_write(&self) -> Result<Writing<'_>, ControlError> {
        let lock = self.writes.lock().await;
        let fence = blocking(|| self.store.fence())?;
        Ok(Writing { _lock: lock, fence })
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, TenantRecord>> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that the engines now hold tenant `id` as `record` (None: not at all).
    fn set_applied(&self, id: u32, record: Option<&TenantRecord>) {
        match record {
            Some(record) => self.applied().insert(id, record.clone()),
            None => self.applied().remove(&id),
        };
    }

    /// Publishes the tenants as the engines hold them and the store's keys:
    /// a tenant another server created is published once this server's
    /// engines have its partitions ([`Control::reload`]).
    fn publish(&self) -> Result<(), ControlError> {
        let keys = blocking(|| self.store.keys_skipping())?;
        let tenants: Vec<TenantRecord> = self.applied().values().cloned().collect();
        let previous = self.registry.snapshot();
        self.registry
            .replace(Directory::build(&tenants, &keys, Some(&previous)));
        Ok(())
    }

    /// Whether the store answers: false while a shared store is away (this
    /// server then serves with the last state it saw).
    pub fn store_connected(&self) -> bool {
        self.store_connected
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This server's catalog as it announces it.
    fn announcement_bytes(&self) -> Vec<u8> {
        let models = self
            .catalog
            .snapshot()
            .all()
            .map(|m| AnnouncedModel {
                spec: m.spec.clone(),
                file_context_tokens: m.file_context_tokens,
            })
            .collect();
        crate::store::encode(&ServerRecord { models })
    }

    /// Announces the catalog again (a model came or went).
    fn reannounce(&self) {
        if let Some(announcement) = self.announcement.get() {
            announcement.send_replace(self.announcement_bytes());
        }
    }

    /// Whether `digest` is the admin token's, compared in constant time.
    pub fn is_admin_token(&self, digest: &[u8; 32]) -> bool {
        let current = *self.admin_token.read().unwrap_or_else(|p| p.into_inner());
        bool::from(subtle::ConstantTimeEq::ct_eq(
            digest.as_slice(),
            current.as_slice(),
        ))
    }

    /// Whether new inference requests are refused now: the shared store is
    /// away and the policy says `[store] offline = "refuse"`.
    pub fn refusing(&self) -> bool {
        !self.store_connected() && self.config.store.offline == crate::config::OfflineMode::Refuse
    }

    /// Follows a shared store until the server stops: reloads whenever
    /// another server may have changed the control plane, and after every
    /// reconnect. Returns at once for a store only this server writes.
    pub async fn follow(self: Arc<Control>) {
        let Some(mut watched) = self.store.watch_control() else {
            return;
        };
        let (announce, announced) = tokio::sync::watch::channel(self.announcement_bytes());
        self.store.announce_server(&self.server_name, announced);
        let _ = self.announcement.set(announce);
        tracing::info!(server = %self.server_name, "following the shared store");
        loop {
            let state = *watched.borrow_and_update();
            self.store_connected
                .store(state.connected, std::sync::atomic::Ordering::Relaxed);
            metrics::gauge!("bulkhead_store_connected").set(if state.connected {
                1.0
            } else {
                0.0
            });
            if state.connected {
                let started = std::time::Instant::now();
                match self.reload().await {
                    Ok(done) if done != Reloaded::default() => {
                        let ms = started.elapsed().as_millis() as u64;
                        tracing::info!(
                            added = done.added,
                            updated = done.updated,
                            removed = done.removed,
                            refused = done.refused,
                            plugins = done.plugins,
                            models = done.models,
                            ms,
                            "control plane reloaded from the shared store"
                        );
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%error, "reloading from the shared store failed; serving with the last state seen");
                    }
                }
            } else {
                tracing::warn!("the shared store is away; serving with the last state seen");
            }
            if watched.changed().await.is_err() {
                return;
            }
        }
    }

    /// Brings this server in step with the store after another server
    /// changed it: the engines get each tenant change they have not seen
    /// (added and changed tenants first), then the registry publishes the
    /// tenants and keys, then gone tenants' requests end and their
    /// partitions go. Under the write lock: never between the steps of one
    /// of this server's own changes. A change an engine refuses (its pool
    /// cannot grant it) is logged and counted, and that tenant stays as it
    /// was here until the next reload.
    pub async fn reload(&self) -> Result<Reloaded, ControlError> {
        let _write = self.writes.lock().await;
        // A record another writer damaged is skipped (logged with its key),
        // and its tenant stays here as it was: never applied half, never
        // taken for deleted.
        let (stored, unreadable) = blocking(|| self.store.tenants_skipping())?;
        let before = self.applied().clone();
        let models: Vec<Arc<Served>> = self.catalog.snapshot().all().cloned().collect();
        let mut done = Reloaded::default();
        for record in &stored {
            let old = before.get(&record.id);
            if old == Some(record) {
                continue;
            }
            let changes = tenant_changes(&models, old, Some(record));
            match self.apply(&changes).await {
                Ok(_) => {
                    self.set_applied(record.id, Some(record));
                    match old {
                        Some(_) => done.updated += 1,
                        None => done.added += 1,
                    }
                }
                Err(error) => {
                    tracing::error!(tenant_id = record.id, %error, "a tenant change from the shared store was refused here; kept as it was");
                    metrics::counter!("bulkhead_store_reload_refused_total").increment(1);
                    done.refused += 1;
                }
            }
        }
        let gone: Vec<TenantRecord> = before
            .values()
            .filter(|t| !stored.iter().any(|s| s.id == t.id) && !unreadable.contains(&t.id))
            .cloned()
            .collect();
        for record in &gone {
            self.set_applied(record.id, None);
        }
        self.publish()?;
        // An admin token rotated or reset through another server.
        let token = blocking(|| self.store.admin_token())?;
        if let Some(digest) = token.as_deref().and_then(super::parse_digest) {
            let mut current = self.admin_token.write().unwrap_or_else(|p| p.into_inner());
            if *current != digest {
                *current = digest;
                tracing::warn!("the admin token was changed through another server; the old one no longer works here");
            }
        }
        for record in &gone {
            let changes = tenant_changes(&models, Some(record), None);
            if let Err(error) = self.apply(&changes).await {
                tracing::error!(tenant_id = record.id, %error, "ending a removed tenant's partitions");
            }
            self.policy.forget(TenantId(record.id), None);
            self.forget_plugins_applied(record.id);
            done.removed += 1;
        }
        done.plugins = self.reload_plugins(&stored)?;
        done.models = self.reload_models().await?;
        Ok(done)
    }

    /// Brings this server's admin-added models in step with the store after
    /// another server added or removed one: an added one is loaded here from
    /// its path (which must hold the same file on every server), with this
    /// server's tenants, under the same memory budget and capacity contract
    /// as an add through this server; a removed one drains here for the
    /// policy's `server.drain_timeout_ms`, then goes. One that does not load
    /// here is logged, counted and not tried again until its record changes.
    async fn reload_models(&self) -> Result<u32, ControlError> {
        let stored = blocking(|| self.store.models())?;
        let snapshot = self.catalog.snapshot();
        let mut changed = 0;
        for record in &stored {
            let id = &record.spec.id;
            if snapshot.get(id).is_some() {
                continue;
            }
            if self.config.models.iter().any(|m| &m.id == id) {
                continue; // this server's policy has its own model of that id
            }
            let refused = self
                .models_refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(id)
                .copied();
            if refused == Some(record.added_ms) {
                continue;
            }
            match self.load_stored_model(record).await {
                Ok(()) => {
                    tracing::info!(model = %id, "model added through another server loaded here");
                    changed += 1;
                }
                Err(error) => {
                    tracing::error!(model = %id, %error, "a model added through another server does not load here");
                    metrics::counter!("bulkhead_store_reload_refused_total").increment(1);
                    self.models_refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id.clone(), record.added_ms);
                }
            }
        }
        let gone: Vec<String> = snapshot
            .all()
            .filter(|m| m.source == Source::Admin)
            .filter(|m| !stored.iter().any(|r| r.spec.id == m.spec.id))
            .map(|m| m.spec.id.clone())
            .collect();
        drop(snapshot);
        for id in gone {
            let Some((served, service)) = self.catalog.take(&id) else {
                continue;
            };
            drop(served);
            let drain = std::time::Duration::from_millis(self.config.server.drain_timeout_ms);
            let ended =
                run_blocking(move || service.shutdown(drain, FinishReason::ModelRemoved)).await?;
            self.reannounce();
            tracing::info!(model = %id, requests_ended = ended, "model removed through another server; removed here");
            changed += 1;
        }
        self.models_refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, _| stored.iter().any(|r| &r.spec.id == id));
        Ok(changed)
    }

    /// Loads an admin-added model another server stored.
    async fn load_stored_model(&self, record: &ModelRecord) -> Result<(), ControlError> {
        let tenants: Vec<TenantRecord> = self.applied().values().cloned().collect();
        let loaded = self.load_admin_model(&record.spec, tenants).await?;
        self.serve_model(loaded);
        Ok(())
    }

    /// Loads an admin model's file with partitions for `tenants`, if it fits
    /// the memory budget and keeps the capacity contract (not served yet).
    async fn load_admin_model(
        &self,
        spec: &ModelSpec,
        tenants: Vec<TenantRecord>,
    ) -> Result<catalog::Loaded, ControlError> {
        let (probe, backend) = (spec.clone(), self.config.engine.backend);
        let inspected = run_blocking(move || catalog::inspect(&probe, backend))
            .await?
            .map_err(ControlError::Load)?;
        self.catalog
            .snapshot()
            .memory(&self.config.engine, Some(inspected.memory))
            .check()?;
        let (to_load, finishes) = (spec.clone(), Arc::clone(&self.finishes));
        let (role, engine) = (self.config.server.role, self.config.engine.clone());
        let carried = self.catalog.retired_totals(&spec.id);
        run_blocking(move || {
            let source = Source::Admin;
            catalog::load(to_load, source, &tenants, finishes, role, &engine, carried)
        })
        .await?
        .map_err(|e| match e {
            LoadError::Capacity(v) => ControlError::Capacity(v),
            other => ControlError::Load(other),
        })
    }

    /// Puts a loaded model in the catalog, announces it and starts its
    /// transfer side.
    fn serve_model(&self, loaded: catalog::Loaded) {
        let served = Arc::clone(&loaded.served);
        self.catalog.insert(loaded);
        self.reannounce();
        crate::transfer::start_model(&served);
    }

    fn tenant_record(&self, tenant: TenantRef<'_>) -> Result<TenantRecord, ControlError> {
        let tenants = blocking(|| self.store.tenants())?;
        tenants
            .into_iter()
            .find(|t| tenant.matches(t))
            .ok_or_else(|| tenant.not_found())
    }

    /// Refuses an access list naming a model the catalog does not hold (a
    /// typo would otherwise grant nothing, silently).
    fn check_access(&self, access: &ModelAccess) -> Result<(), ControlError> {
        let snapshot = self.catalog.snapshot();
        match access.ids().find(|id| snapshot.get(id).is_none()) {
            Some(unknown) => Err(invalid(
                "models",
                format!("{unknown:?} is not a model of the catalog"),
            )),
            None => Ok(()),
        }
    }

    /// Applies `changes` in order; if one is refused, undoes the ones applied
    /// (in reverse) and answers why. For removals, answers the requests ended.
    async fn apply(&self, changes: &[EngineChange]) -> Result<u32, ControlError> {
        let mut ended = 0;
        for (i, c) in changes.iter().enumerate() {
            match c.model.engine.change_tenant(c.change.clone()).await {
                Ok(n) => ended += n,
                Err(error) => {
                    self.undo(&changes[..i]).await;
                    return Err(match error {
                        ChangeError::Refused(refused) => {
                            ControlError::Pool(format!("model {}: {refused}", c.model.spec.id))
                        }
                        ChangeError::Unavailable => ControlError::Engine,
                    });
                }
            }
        }
        Ok(ended)
    }

    /// Undoes applied `changes`, last first.
    async fn undo(&self, changes: &[EngineChange]) {
        for c in changes.iter().rev() {
            if let Err(e) = c.model.engine.change_tenant(c.undo.clone()).await {
                tracing::error!(model = %c.model.spec.id, error = %e, "undoing an engine change");
            }
        }
    }

    /// Commits `batch`; on failure, undoes the applied `changes` first.
    async fn commit_or_undo(
        &self,
        batch: Batch,
        changes: &[EngineChange],
    ) -> Result<(), ControlError> {
        match blocking(|| self.store.commit(batch)) {
            Ok(()) => Ok(()),
            Err(error) => {
                self.undo(changes).await;
                Err(error.into())
            }
        }
    }

    /// Every tenant, in id order.
    pub fn tenants(&self) -> Result<Vec<TenantView>, ControlError> {
        Ok(blocking(|| self.store.tenants())?
            .iter()
            .map(TenantView::from)
            .collect())
    }

    /// One tenant.
    pub fn tenant(&self, tenant: TenantRef<'_>) -> Result<TenantView, ControlError> {
        Ok(TenantView::from(&self.tenant_record(tenant)?))
    }

    /// Creates a tenant with `quota`, allowed the models of `models` (no key
    /// yet: issue one next).
    pub async fn create_tenant(
        &self,
        actor: &Actor,
        name: &str,
        quota: Quota,
        models: ModelAccess,
        objective: Option<&str>,
    ) -> Result<TenantView, ControlError> {
        let write = self.begin_write().await?;
        if !valid_name(name) {
            return Err(invalid(
                "name",
                "1-64 of [A-Za-z0-9_-], starting with a letter",
            ));
        }
        quota.validate().map_err(|e| invalid(e.field, e.reason))?;
        self.check_access(&models)?;
        let objective = objective_of(objective)?;
        let mut tenants = blocking(|| self.store.tenants())?;
        if tenants.iter().any(|t| t.name == name) {
            return Err(ControlError::Exists {
                what: "tenant",
                name: name.into(),
            });
        }
        if tenants.len() >= TENANTS_MAX {
            return Err(ControlError::TooMany {
                what: "tenants",
                max: TENANTS_MAX,
            });
        }
        let id = blocking(|| self.store.tenant_id_next())?;
        let now = now_ms();
        let record = TenantRecord {
            id,
            name: name.into(),
            quota,
            models,
            canaries: Vec::new(),
            objective,
            created_ms: now,
            updated_ms: now,
        };
        tenants.push(record.clone());
        self.check_capacity(&tenants, name)?;
        let changes = tenant_changes(self.catalog.snapshot().all(), None, Some(&record));
        self.apply(&changes).await?;
        let mut batch = write.batch();
        batch
            .put_tenant(&record)
            .put_tenant_id_next(id + 1)
            .audit(with_detail(
                audit(actor, "tenant.create", name),
                [
                    ("tenant_id", id.into()),
                    ("quota", quota_json(&quota)),
                    ("models", access_json(&record.models)),
                ],
            ));
        self.commit_or_undo(batch, &changes).await?;
        self.set_applied(id, Some(&record));
        self.publish()?;
        Ok(TenantView::from(&record))
    }

    /// Changes some of a tenant's limits or models; the next admission follows
    /// them. A model it may no longer use ends its requests there
    /// (`tenant_removed`) and frees its partition.
    pub async fn update_tenant(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        patch: TenantPatch,
    ) -> Result<TenantView, ControlError> {
        let write = self.begin_write().await?;
        let mut tenants = blocking(|| self.store.tenants())?;
        let at = tenants
            .iter()
            .position(|t| tenant.matches(t))
            .ok_or_else(|| tenant.not_found())?;
        let old = tenants[at].clone();
        let name = old.name.clone();
        let quota = patch.apply(old.quota);
        quota.validate().map_err(|e| invalid(e.field, e.reason))?;
        if let Some(models) = &patch.models {
            self.check_access(models)?;
            tenants[at].models = models.clone();
        }
        if let Some(objective) = &patch.objective {
            tenants[at].objective = objective_of(Some(objective))?;
        }
        tenants[at].quota = quota;
        tenants[at].updated_ms = now_ms();
        let record = tenants[at].clone();
        self.check_capacity(&tenants, &name)?;
        let changes = tenant_changes(self.catalog.snapshot().all(), Some(&old), Some(&record));
        self.apply(&changes).await?;
        let mut batch = write.batch();
        batch.put_tenant(&record).audit(with_detail(
            audit(actor, "tenant.update", &name),
            [
                ("tenant_id", record.id.into()),
                ("before", quota_json(&old.quota)),
                ("after", quota_json(&quota)),
                ("models_before", access_json(&old.models)),
                ("models_after", access_json(&record.models)),
                ("objective_after", record.objective.clone().into()),
            ],
        ));
        self.commit_or_undo(batch, &changes).await?;
        self.set_applied(record.id, Some(&record));
        self.publish()?;
        Ok(TenantView::from(&record))
    }

    /// A tenant's canaries.
    pub fn canaries(&self, tenant: TenantRef<'_>) -> Result<Canaries, ControlError> {
        Ok(Canaries {
            canaries: self.tenant_record(tenant)?.canaries,
        })
    }

    /// Replaces a tenant's canaries; the guard scans for them from the next
    /// response on. Audited with their count, never the strings.
    pub async fn set_canaries(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        canaries: Canaries,
    ) -> Result<Canaries, ControlError> {
        canary::validate(&canaries.canaries).map_err(|reason| invalid("canaries", reason))?;
        let write = self.begin_write().await?;
        let mut record = self.tenant_record(tenant)?;
        record.canaries = canaries.canaries.clone();
        record.updated_ms = now_ms();
        let mut batch = write.batch();
        batch.put_tenant(&record).audit(with_detail(
            audit(actor, "tenant.canaries", &record.name),
            [
                ("tenant_id", record.id.into()),
                ("count", record.canaries.len().into()),
            ],
        ));
        blocking(|| self.store.commit(batch))?;
        self.set_applied(record.id, Some(&record));
        self.publish()?;
        Ok(canaries)
    }

    /// Deletes a tenant: its keys stop working at once, its queued and
    /// running requests end with `tenant_removed` in every model, its pages
    /// are scrubbed and its partitions freed, then its records go. Returns the
    /// requests ended.
    pub async fn delete_tenant(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
    ) -> Result<u32, ControlError> {
        let write = self.begin_write().await?;
        let record = self.tenant_record(tenant)?;
        let name = record.name.as_str();
        let (keys, plugins) =
            blocking(|| Ok::<_, StoreError>((self.store.keys()?, self.store.plugins(record.id)?)))?;
        // Unpublish first: no new request of this tenant gets past authentication.
        let before = self.registry.snapshot();
        let remaining: Vec<TenantRecord> = self
            .applied()
            .values()
            .filter(|t| t.id != record.id)
            .cloned()
            .collect();
        self.registry
            .replace(Directory::build(&remaining, &keys, Some(&before)));
        let changes = tenant_changes(self.catalog.snapshot().all(), Some(&record), None);
        let ended = match self.apply(&changes).await {
            Ok(ended) => ended,
            Err(error) => {
                self.publish()?;
                return Err(error);
            }
        };
        let mut batch = write.batch();
        batch.delete_tenant(&record);
        for key in keys.iter().filter(|k| k.tenant == record.id) {
            batch.delete_key(&key.id);
        }
        // Its plugins' state and the operator plugins' state for it; their
        // code files go after the commit.
        let identities: Vec<String> = plugins
            .iter()
            .map(|p| crate::policy::tenant_identity(p.id))
            .chain(
                self.policy
                    .operator_names()
                    .iter()
                    .map(|n| crate::policy::operator_identity(n)),
            )
            .collect();
        for plugin in &plugins {
            batch.delete_plugin(record.id, &plugin.name);
            if self.store.shared() {
                batch.delete_plugin_code(plugins::owner_of(plugin));
            }
        }
        for identity in &identities {
            blocking(|| {
                self.policy
                    .state()
                    .forget(&mut batch, TenantId(record.id), identity)
            })?;
        }
        batch.audit(with_detail(
            audit(actor, "tenant.delete", name),
            [
                ("tenant_id", record.id.into()),
                ("requests_ended", ended.into()),
            ],
        ));
        let committed = self.commit_or_undo(batch, &changes).await;
        if committed.is_ok() {
            self.set_applied(record.id, None);
        }
        self.publish()?;
        committed?;
        for plugin in &plugins {
            let owner = plugins::owner_of(plugin);
            if let Err(error) = blocking(|| self.store.code().and_then(|c| c.delete(owner))) {
                tracing::warn!(plugin = %plugin.name, %error, "a deleted tenant's plugin code stays until the next start");
            }
        }
        self.policy.forget(TenantId(record.id), None);
        self.forget_plugins_applied(record.id);
        Ok(ended)
    }

    /// How long an unload drains when the admin does not say: the policy's
    /// `server.drain_timeout_ms`.
    pub fn drain_default_ms(&self) -> u64 {
        self.config.server.drain_timeout_ms
    }

    /// Every model of the catalog, in catalog order.
    pub fn models(&self) -> Vec<ModelView> {
        self.catalog
            .snapshot()
            .all()
            .map(|m| ModelView::from(m.as_ref()))
            .collect()
    }

    /// One model.
    pub fn model(&self, id: &str) -> Result<ModelView, ControlError> {
        self.catalog
            .snapshot()
            .get(id)
            .map(|m| ModelView::from(m.as_ref()))
            .ok_or_else(|| ControlError::NotFound {
                what: "model",
                name: id.into(),
            })
    }

    /// Loads `spec` and adds it to the catalog, stored so later starts load it
    /// too. Checked before anything is allocated: its id is new, its file's
    /// header reads, the catalog with it fits `engine.memory_max`, and its
    /// capacity contract holds with the tenants that may use it.
    pub async fn add_model(
        &self,
        actor: &Actor,
        spec: ModelSpec,
    ) -> Result<ModelView, ControlError> {
        let write = self.begin_write().await?;
        spec.validate(|f| f.to_string()).map_err(|e| match e {
            crate::config::ConfigError::Invalid { field, reason } => invalid(field, reason),
            other => invalid("model", other.to_string()),
        })?;
        if !spec.path.is_absolute() {
            return Err(invalid("path", "must be an absolute path on the server"));
        }
        let snapshot = self.catalog.snapshot();
        // A policy model's id stays the policy's, loaded or not: the next
        // start would load both.
        if snapshot.get(&spec.id).is_some() || self.config.models.iter().any(|m| m.id == spec.id) {
            return Err(ControlError::Exists {
                what: "model",
                name: spec.id.clone(),
            });
        }
        if snapshot.len() >= MODELS_MAX {
            return Err(ControlError::TooMany {
                what: "models",
                max: MODELS_MAX,
            });
        }
        drop(snapshot);
        let tenants = blocking(|| self.store.tenants())?;
        let loaded = self.load_admin_model(&spec, tenants).await?;
        let record = ModelRecord {
            spec: spec.clone(),
            added_ms: now_ms(),
        };
        let mut batch = write.batch();
        batch.put_model(&record).audit(with_detail(
            audit(actor, "model.add", &spec.id),
            [
                ("path", spec.path.display().to_string().into()),
                ("context_tokens", spec.context_tokens.into()),
                ("pool_pages", spec.pool_pages.into()),
                ("weights_bytes", loaded.served.memory.weights_bytes.into()),
                ("kv_bytes", loaded.served.memory.kv_bytes.into()),
            ],
        ));
        if let Err(error) = blocking(|| self.store.commit(batch)) {
            let service = loaded.service;
            run_blocking(move || {
                service.shutdown(std::time::Duration::ZERO, FinishReason::ModelRemoved)
            })
            .await?;
            return Err(error.into());
        }
        let view = ModelView::from(loaded.served.as_ref());
        self.serve_model(loaded);
        tracing::info!(model = %spec.id, "model added");
        Ok(view)
    }

    /// Unloads model `id`: new requests no longer find it (404), its engine
    /// stops accepting, requests in flight run until `drain`, the rest end with
    /// `model_removed`; then its pool, engine and weights are freed. An admin
    /// model's record goes too; a policy model returns at the next start.
    pub async fn remove_model(
        &self,
        actor: &Actor,
        id: &str,
        drain: std::time::Duration,
    ) -> Result<ModelRemoved, ControlError> {
        let _write = self.writes.lock().await;
        let Some((served, service)) = self.catalog.take(id) else {
            return Err(ControlError::NotFound {
                what: "model",
                name: id.into(),
            });
        };
        let source = served.source;
        drop(served);
        let started = std::time::Instant::now();
        let ended =
            run_blocking(move || service.shutdown(drain, FinishReason::ModelRemoved)).await?;
        let drain_ms = started.elapsed().as_millis() as u64;
        self.reannounce();
        // Committed after the drain: a crash during it leaves the record, and
        // the model loads again at the next start (the removal was never
        // acknowledged).
        // Fenced now, not at the start: the drain may take long, and the
        // record's removal depends on nothing read before it.
        let mut batch = Batch::default();
        batch.fenced(&blocking(|| self.store.fence())?);
        if source == Source::Admin {
            batch.delete_model(id);
        }
        batch.audit(with_detail(
            audit(actor, "model.remove", id),
            [
                ("source", serde_json::to_value(source).unwrap_or_default()),
                ("drain_ms", drain_ms.into()),
                ("requests_ended", ended.into()),
            ],
        ));
        blocking(|| self.store.commit(batch))?;
        tracing::info!(model = %id, drain_ms, requests_ended = ended, "model removed");
        Ok(ModelRemoved {
            removed: id.into(),
            requests_ended: ended,
            drain_ms,
        })
    }

    /// A tenant's keys (revoked ones too), never their secrets.
    pub fn keys(&self, tenant: TenantRef<'_>) -> Result<Vec<KeyView>, ControlError> {
        let record = self.tenant_record(tenant)?;
        Ok(blocking(|| self.store.keys())?
            .iter()
            .filter(|k| k.tenant == record.id)
            .map(KeyView::from)
            .collect())
    }

    /// Issues a new key for `tenant`; it works from the next request on.
    pub async fn issue_key(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
    ) -> Result<IssuedKey, ControlError> {
        let write = self.begin_write().await?;
        let record = self.tenant_record(tenant)?;
        let keys = blocking(|| self.store.keys())?;
        let own: Vec<&KeyRecord> = keys.iter().filter(|k| k.tenant == record.id).collect();
        let live = own.iter().filter(|k| k.revoked_ms.is_none()).count();
        if live >= KEYS_PER_TENANT_MAX {
            return Err(ControlError::TooMany {
                what: "live keys per tenant",
                max: KEYS_PER_TENANT_MAX,
            });
        }
        let mut batch = write.batch();
        let mut forgettable: Vec<&&KeyRecord> = own
            .iter()
            .filter(|k| k.revoked_ms.is_some() && !matches!(k.source, KeySource::Env { .. }))
            .collect();
        forgettable.sort_by_key(|k| k.revoked_ms);
        let excess = (own.len() + 1).saturating_sub(KEY_RECORDS_PER_TENANT_MAX);
        if excess > forgettable.len() {
            return Err(ControlError::TooMany {
                what: "key records per tenant",
                max: KEY_RECORDS_PER_TENANT_MAX,
            });
        }
        for old in forgettable.iter().take(excess) {
            batch.delete_key(&old.id);
        }
        let (key, secret) = new_key(&record, KeySource::Issued)?;
        debug_assert!(secret.len() <= KEY_BYTES_MAX);
        batch.put_key(&key).audit(with_detail(
            audit(actor, "key.issue", &record.name),
            [("key_id", key.id.clone().into())],
        ));
        self.commit_or_undo(batch, &[]).await?;
        self.publish()?;
        Ok(IssuedKey {
            key: KeyView::from(&key),
            secret,
        })
    }

    /// Revokes one of `tenant`'s keys; it fails from the next request on. A
    /// key of another tenant is "not found", exactly like one that never was.
    pub async fn revoke_key(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        key_id: &str,
    ) -> Result<KeyView, ControlError> {
        let write = self.begin_write().await?;
        let record = self.tenant_record(tenant)?;
        let mut key = blocking(|| self.store.keys())?
            .into_iter()
            .find(|k| k.id == key_id && k.tenant == record.id)
            .ok_or_else(|| ControlError::NotFound {
                what: "key",
                name: key_id.into(),
            })?;
        if key.revoked_ms.is_none() {
            key.revoked_ms = Some(now_ms());
            let mut batch = write.batch();
            batch.put_key(&key).audit(with_detail(
                audit(actor, "key.revoke", &record.name),
                [("key_id", key.id.clone().into())],
            ));
            self.commit_or_undo(batch, &[]).await?;
            self.publish()?;
        }
        Ok(KeyView::from(&key))
    }

    /// A live tenant's usage over `[from_ms, to_ms)` (rounded down to minutes).
    pub fn usage(
        &self,
        tenant: TenantRef<'_>,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<UsageView, ControlError> {
        let record = self.tenant_record(tenant)?;
        self.usage_of(record.id, from_ms, to_ms)
    }

    /// Usage by tenant id: also for a deleted tenant (ids are never reused).
    pub fn usage_of(
        &self,
        tenant_id: u32,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<UsageView, ControlError> {
        let (from, to) = (minute_of(from_ms), minute_of(to_ms));
        if to <= from {
            return Err(invalid("to_ms", "must be at least a minute after from_ms"));
        }
        if to - from > USAGE_MINUTES_MAX {
            return Err(invalid(
                "to_ms",
                format!("a window is at most {USAGE_MINUTES_MAX} minutes"),
            ));
        }
        let minutes = blocking(|| self.store.usage(tenant_id, from, to))?;
        let mut total = UsageRecord::default();
        for (_, minute) in &minutes {
            total.add(minute);
        }
        Ok(UsageView {
            tenant_id,
            from_ms: from * 60_000,
            to_ms: to * 60_000,
            total: UsageCounts::from(&total),
            minutes: minutes
                .iter()
                .map(|(minute, record)| UsageMinute {
                    at_ms: minute * 60_000,
                    counts: UsageCounts::from(record),
                })
                .collect(),
        })
    }

    /// Up to `limit` audit records after sequence number `after`.
    pub fn audit_log(&self, after: u64, limit: usize) -> Result<Vec<AuditRecord>, ControlError> {
        Ok(blocking(|| self.store.audit(after, limit))?)
    }

    /// The audit log below `before`, newest first.
    pub fn audit_log_before(
        &self,
        before: u64,
        limit: usize,
    ) -> Result<Vec<AuditRecord>, ControlError> {
        Ok(blocking(|| self.store.audit_before(before, limit))?)
    }

    /// The tenant with this id right now, if any.
    pub fn live(&self, id: TenantId) -> Option<Arc<Tenant>> {
        self.registry.snapshot().tenant(id).cloned()
    }
}

fn quota_json(quota: &Quota) -> serde_json::Value {
    serde_json::to_value(quota).unwrap_or_default()
}

fn access_json(models: &ModelAccess) -> serde_json::Value {
    serde_json::to_value(models).unwrap_or_default()
}

/// Runs blocking work (a model load, an engine's drain) off the async workers.
async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ControlError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ControlError::Store(StoreError::Io(format!("a blocking task failed: {e}"))))
}
