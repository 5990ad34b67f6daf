//! What the store keeps: one struct per record kind, each written inside a
//! [`Versioned`] envelope. A change to any of these shapes bumps
//! [`FORMAT_VERSION`] (and needs a migration); nothing reads a record of a
//! version it does not know.
//!
//! No record holds a secret (keys are SHA-256 digests) or any prompt or
//! completion text.
//!
//! This module imports nothing of the host's: the shapes the records carry
//! (a tenant's [`Quota`] and [`ModelAccess`], a model's [`ModelSpec`]) are
//! defined here, and the config and tenancy modules re-export them, so the
//! store and any backend of it sit below both.

use bulkhead_kernels::kv::KvType;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// A tenant's identity inside the process and in the store; also its KV
/// owner tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u32);

/// The format of every record this build writes.
///
/// - 1: tenants, keys, plugins, usage, audit.
/// - 2: adds `TenantRecord::models` (absent in format 1: every model) and
///   [`ModelRecord`].
/// - 3: adds `PluginRecord::id` (0 in older records until
///   `Store::migrate_plugins` gives them one); plugin code moves out of the
///   database into its owners' files, and plugin state is keyed by identity.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest format this build reads (every change since is additive, with a
/// default for what older records lack).
pub const FORMAT_VERSION_READ_MIN: u32 = 1;

/// The envelope of every stored value.
#[derive(Serialize, Deserialize)]
pub struct Versioned<T> {
    /// The record's format version.
    pub v: u32,
    /// The record.
    pub record: T,
}

/// The store's own record: written once, when the store is first seeded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// When the store was seeded, Unix milliseconds.
    pub created_ms: u64,
    /// The policy file that seeded it.
    pub seeded_from: String,
}

/// A tenant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantRecord {
    /// Its id: handed out once, never reused for another tenant.
    pub id: u32,
    /// Its name (unique among live tenants; a deleted tenant's name may be
    /// taken again, by a tenant with a new id).
    pub name: String,
    /// Its limits.
    pub quota: Quota,
    /// The models it may use (format 1 records have none: every model).
    #[serde(default)]
    pub models: ModelAccess,
    /// Its canary strings for the runtime canary guard (see
    /// [`crate::tenancy::canary`]); absent when none, so records without
    /// canaries are as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub canaries: Vec<String>,
    /// The Gateway API Inference Extension objective its requests carry
    /// (`x-llm-d-inference-objective`, set by the gateway's external
    /// authorization, never by a client); absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// Created, Unix milliseconds.
    pub created_ms: u64,
    /// Last changed, Unix milliseconds.
    pub updated_ms: u64,
}

/// A model added through the admin API (the policy's models are never stored:
/// the policy file is their source of truth at every start).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRecord {
    /// What was added (its path absolute).
    pub spec: ModelSpec,
    /// Added, Unix milliseconds.
    pub added_ms: u64,
}

/// Where a key came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KeySource {
    /// Issued through the admin API or the tenant's self-service.
    Issued,
    /// The policy's `keys_sha256`, when the store was seeded.
    Policy,
    /// The environment variable the policy names in `key_env`.
    Env {
        /// The variable.
        var: String,
    },
    /// Generated at first start for a tenant without any key.
    Generated,
}

/// An API key: its digest, never the secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    /// Its id (random, `key_…`): what the key routes name.
    pub id: String,
    /// Its tenant.
    pub tenant: u32,
    /// SHA-256 of the secret, hex.
    pub sha256: String,
    /// The secret's first characters, to tell keys apart (never enough to use).
    pub prefix: String,
    /// Where it came from.
    pub source: KeySource,
    /// Created, Unix milliseconds.
    pub created_ms: u64,
    /// Revoked, Unix milliseconds; a revoked key never authenticates again.
    pub revoked_ms: Option<u64>,
}

/// A plugin's metadata (its component is in files of its own, `store::code`,
/// or on a shared store in the store, committed with this record).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginRecord {
    /// Its id: never reused, the same across its versions, a new one after
    /// a delete; what its budgets, state and code files are keyed by (a name
    /// is the tenant's to choose, an id is not).
    #[serde(default)]
    pub id: u64,
    /// Its tenant.
    pub tenant: u32,
    /// Its name, unique per tenant.
    pub name: String,
    /// Uploads so far under this name (1 for the first).
    pub version: u32,
    /// SHA-256 of the component, hex.
    pub sha256: String,
    /// The component's size.
    pub size_bytes: u64,
    /// Whether it runs in the tenant's policy chain.
    pub enabled: bool,
    /// Last uploaded, Unix milliseconds.
    pub uploaded_ms: u64,
    /// Its place in the tenant's chain (lower runs first; ties by name).
    #[serde(default)]
    pub order: u32,
    /// Limits it asked for, below the deployment's (None: the deployment's).
    #[serde(default)]
    pub limits: PluginLimitsRequest,
}

/// Limits a plugin asks for: each at most the deployment's maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginLimitsRequest {
    /// Wall-clock bound of a call, milliseconds.
    pub deadline_ms: Option<u64>,
    /// Fuel of a call.
    pub fuel: Option<u64>,
    /// Linear memory, bytes.
    pub memory_bytes: Option<u64>,
}

/// One entry of a plugin's own key-value state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginStateRecord {
    /// The value, hex.
    pub value_hex: String,
    /// When it expires, Unix milliseconds.
    pub expires_ms: Option<u64>,
}

/// One minute of a tenant's usage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageRecord {
    /// Requests that finished (any reason).
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their generated tokens.
    pub completion_tokens: u64,
    /// Requests by finish reason, or by the error code that refused them.
    pub outcomes: BTreeMap<String, u64>,
}

impl UsageRecord {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &UsageRecord) {
        self.requests += other.requests;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        for (outcome, count) in &other.outcomes {
            *self.outcomes.entry(outcome.clone()).or_default() += count;
        }
    }
}

/// One audited event: an admin action, a self-service action or a refused
/// request. Ids, codes and sizes only — never request text, never a secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AuditRecord {
    /// Its place in the log (set at commit).
    pub seq: u64,
    /// When, Unix milliseconds.
    pub at_ms: u64,
    /// Who: `admin`, or `tenant:<name>` for self-service, or `system`.
    pub actor: String,
    /// What: `tenant.create`, `key.revoke`, `request.rejected`, ...
    pub action: String,
    /// On what: a tenant name, a key id, a request id.
    pub target: String,
    /// Content-free details: codes, counts, sizes.
    #[schema(value_type = Object)]
    pub detail: BTreeMap<String, serde_json::Value>,
}

// ------------------------------------------------------ a tenant's limits

/// Longest tenant name.
pub const NAME_BYTES_MAX: usize = 64;
/// Highest fair-share weight.
pub const WEIGHT_MAX: u32 = 1000;
/// Most queued requests per tenant.
pub const QUEUE_DEPTH_LIMIT: u32 = 1 << 16;
/// Most requests of one tenant before admission at once.
pub const PENDING_LIMIT: u32 = 1024;
/// Most running sequences per tenant.
pub const RUNNING_LIMIT: u32 = 1 << 16;

/// A tenant's limits: its share of the engine, its KV partition and its
/// queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Share of the engine under contention, relative to other tenants (1..=1000).
    pub weight: u32,
    /// KV pages only this tenant may use.
    pub pages_reserved: u32,
    /// The most KV pages it may hold at once (at least `pages_reserved`).
    pub pages_max: u32,
    /// Most requests waiting for pages.
    pub queue_depth_max: u32,
    /// Most sequences running at once.
    pub running_max: u32,
    /// Most requests being read, tokenized and submitted at once (before admission).
    pub pending_max: u32,
    /// Whether full prompt pages are kept for its later requests (its own
    /// prefix cache; never shared with another tenant). Default true.
    #[serde(default = "prefix_cache_default")]
    pub prefix_cache: bool,
}

fn prefix_cache_default() -> bool {
    true
}

/// A quota field outside its bounds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct QuotaError {
    /// The field.
    pub field: &'static str,
    /// What is wrong.
    pub reason: String,
}

impl Quota {
    /// Checks every field against its bounds (the pool and the capacity
    /// contract are checked elsewhere, against the whole tenant set).
    pub fn validate(&self) -> Result<(), QuotaError> {
        let error = |field, reason: String| Err(QuotaError { field, reason });
        if !(1..=WEIGHT_MAX).contains(&self.weight) {
            return error("weight", format!("must be 1..={WEIGHT_MAX}"));
        }
        if self.pages_max == 0 || self.pages_max < self.pages_reserved {
            return error(
                "pages_max",
                "must be at least 1 and at least pages_reserved".into(),
            );
        }
        if !(1..=QUEUE_DEPTH_LIMIT).contains(&self.queue_depth_max) {
            return error(
                "queue_depth_max",
                format!("must be 1..={QUEUE_DEPTH_LIMIT}"),
            );
        }
        if !(1..=RUNNING_LIMIT).contains(&self.running_max) {
            return error("running_max", format!("must be 1..={RUNNING_LIMIT}"));
        }
        if !(1..=PENDING_LIMIT).contains(&self.pending_max) {
            return error("pending_max", format!("must be 1..={PENDING_LIMIT}"));
        }
        Ok(())
    }
}

/// Most model ids one tenant's access list may name.
pub const ACCESS_IDS_MAX: usize = 64;
/// The access list entry that means every model.
pub const EVERY_MODEL: &str = "*";

/// The models a tenant may use. Written as a list: `["*"]` (the default) for
/// every model in the catalog, now and later; otherwise the ids it may use
/// (`[]`: none). An id of a model not in the catalog grants nothing until a
/// model of that id is added.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<String>", into = "Vec<String>")]
pub enum ModelAccess {
    /// Every model.
    #[default]
    All,
    /// These models only.
    Only(BTreeSet<String>),
}

impl ModelAccess {
    /// Whether the tenant may use model `id`.
    pub fn allows(&self, id: &str) -> bool {
        match self {
            ModelAccess::All => true,
            ModelAccess::Only(ids) => ids.contains(id),
        }
    }

    /// The ids listed (none for every model).
    pub fn ids(&self) -> impl Iterator<Item = &String> {
        match self {
            ModelAccess::All => None,
            ModelAccess::Only(ids) => Some(ids.iter()),
        }
        .into_iter()
        .flatten()
    }
}

impl TryFrom<Vec<String>> for ModelAccess {
    type Error = String;

    fn try_from(list: Vec<String>) -> Result<ModelAccess, String> {
        if list.iter().any(|id| id == EVERY_MODEL) {
            return match list.len() {
                1 => Ok(ModelAccess::All),
                _ => Err(format!(
                    "models: {EVERY_MODEL:?} (every model) must be alone"
                )),
            };
        }
        if list.len() > ACCESS_IDS_MAX {
            return Err(format!("models: at most {ACCESS_IDS_MAX} ids"));
        }
        if let Some(bad) = list.iter().find(|id| !valid_model_id(id)) {
            return Err(format!("models: {bad:?} is not a model id"));
        }
        Ok(ModelAccess::Only(list.into_iter().collect()))
    }
}

impl From<ModelAccess> for Vec<String> {
    fn from(access: ModelAccess) -> Vec<String> {
        match access {
            ModelAccess::All => vec![EVERY_MODEL.to_string()],
            ModelAccess::Only(ids) => ids.into_iter().collect(),
        }
    }
}

/// Whether `name` may name a tenant: 1–64 of `[A-Za-z0-9_-]`, starting with a
/// letter (so it cannot be mistaken for an id, a path or a flag).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_BYTES_MAX
        && name.as_bytes()[0].is_ascii_alphabetic()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

// ---------------------------------------------------------------- models

/// Longest model id.
pub const MODEL_ID_BYTES_MAX: usize = 128;

/// One model of the catalog: what clients call it, its file, its promise, and
/// its own engine (KV pool, page geometry, batching, threads). The same shape
/// is a `[[models]]` entry of the policy, the body of `POST /admin/v1/models`,
/// and the store's record of an admin-added model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The id clients send as `model` (1-128 of `[A-Za-z0-9._:-]`, starting
    /// with a letter or digit).
    pub id: String,
    /// The GGUF file (in a policy, relative to the policy file's folder; through
    /// the admin API, an absolute path on the server).
    #[schema(value_type = String)]
    pub path: PathBuf,
    /// The context window promised to clients (prompt + completion tokens).
    pub context_tokens: u32,
    /// Compute threads (default: every core).
    #[serde(default = "default_threads")]
    pub threads: u32,
    /// Token positions per KV page (default 16).
    #[serde(default = "default_page_tokens")]
    pub page_tokens: u32,
    /// Pages in its KV pool, allocated whole at load (default 1024).
    #[serde(default = "default_pool_pages")]
    pub pool_pages: u32,
    /// Most pages one sequence may hold (default 512).
    #[serde(default = "default_seq_pages_max")]
    pub seq_pages_max: u32,
    /// Most tokens in one step: the prefill chunk budget plus decode tokens
    /// (default 256: prefill throughput is within a few percent of 512's,
    /// and every running sequence waits half as long for its next token while
    /// a prompt is prefilled; BENCHMARKS.md, "Long contexts").
    #[serde(default = "default_step_tokens_max")]
    pub step_tokens_max: u32,
    /// Most sequences in one step (default 32).
    #[serde(default = "default_step_seqs_max")]
    pub step_seqs_max: u32,
    /// How its KV pool stores each value: `f16` (the default: half the memory
    /// and half the bytes attention reads) or `f32` (the reference).
    #[serde(default)]
    pub kv_type: KvStorage,
    /// Where it computes: `auto`, `cpu` or `cuda` (default: the server's
    /// `--backend`, else `[engine] backend`, else `auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<crate::engine::placement::BackendChoice>,
}

/// How a KV pool stores each value.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum KvStorage {
    /// IEEE half precision (2 bytes).
    #[default]
    F16,
    /// IEEE single precision (4 bytes).
    F32,
}

impl KvStorage {
    /// "f16" or "f32".
    pub fn name(self) -> &'static str {
        KvType::from(self).name()
    }
}

impl From<KvStorage> for KvType {
    fn from(storage: KvStorage) -> KvType {
        match storage {
            KvStorage::F16 => KvType::F16,
            KvStorage::F32 => KvType::F32,
        }
    }
}

pub(crate) fn default_threads() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}
fn default_page_tokens() -> u32 {
    16
}
fn default_pool_pages() -> u32 {
    1024
}
fn default_seq_pages_max() -> u32 {
    512
}
fn default_step_tokens_max() -> u32 {
    256
}
fn default_step_seqs_max() -> u32 {
    32
}

/// Whether `id` may name a model: 1-128 of `[A-Za-z0-9._:-]`, starting with a
/// letter or digit (it is a URL path segment and a metric label).
pub fn valid_model_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MODEL_ID_BYTES_MAX
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// What a live server announces on a shared store (`servers/<name>`): its
/// catalog, so a change made through any server is checked against every
/// server's capacity contract.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRecord {
    /// The models it serves.
    pub models: Vec<AnnouncedModel>,
}

/// One model of a [`ServerRecord`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnnouncedModel {
    /// Its policy.
    pub spec: ModelSpec,
    /// The context its file holds.
    pub file_context_tokens: u64,
}
