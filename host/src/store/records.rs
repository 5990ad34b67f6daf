//! What the store keeps: one struct per record kind, each written inside a
//! [`Versioned`] envelope. A change to any of these shapes bumps
//! [`FORMAT_VERSION`] (and needs a migration); nothing reads a record of a
//! version it does not know.
//!
//! No record holds a secret (keys are SHA-256 digests) or any prompt or
//! completion text.

use crate::config::ModelSpec;
use crate::tenancy::{ModelAccess, Quota};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// A plugin's metadata (its bytes are stored under their digest).
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
