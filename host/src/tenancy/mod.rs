//! Tenants as the request path sees them: stable ids, limits, and the API
//! keys that authenticate them.
//!
//! 1. **Identity.** A tenant is a [`TenantId`] the control plane hands out once
//!    (a counter in the store, never reused for another tenant, not even one
//!    that takes a deleted tenant's name) and a name. The engine and the KV
//!    pool see only the id, as an owner tag.
//! 2. **Keys** are SHA-256 digests of high-entropy secrets, never kept in
//!    clear. A presented key is hashed and compared with every live digest in
//!    constant time, so neither timing nor an early exit tells which digest (or
//!    which byte) came close.
//! 3. **The registry** ([`Registry`]) holds an immutable [`Directory`] —
//!    tenants and live key digests — that the control plane replaces whole after
//!    each committed change. A request reads one snapshot, so it sees a change
//!    entirely or not at all: a new key works on the next request, a revoked
//!    one fails on the next request.

pub mod canary;
pub mod control;
pub mod seed;

use crate::config::valid_model_id;
use crate::store::records::{KeyRecord, TenantRecord};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

/// Shortest key accepted from the environment: 128 bits of hex, or more.
pub const KEY_BYTES_MIN: usize = 16;
/// Longest key accepted in a request header.
pub const KEY_BYTES_MAX: usize = 256;
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

/// A tenant's identity inside the process and in the store; also its KV
/// owner tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u32);

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

/// One tenant as the request path sees it.
#[derive(Debug)]
pub struct Tenant {
    /// Its id.
    pub id: TenantId,
    /// Its name (never a secret; used in logs and metrics).
    pub name: String,
    /// Its limits.
    pub quota: Quota,
    /// The models it may use.
    pub models: ModelAccess,
    /// Its requests before admission (`pending_max` permits): a request holds
    /// one from authentication until the engine has queued or refused it.
    pub pending: Arc<Semaphore>,
}

/// The SHA-256 digest of a key.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The 32 bytes of a 64-digit hex digest, or None.
pub fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Tenants and live key digests at one moment.
#[derive(Default, Debug)]
pub struct Directory {
    tenants: BTreeMap<TenantId, Arc<Tenant>>,
    by_name: BTreeMap<String, TenantId>,
    /// Digests of live (unrevoked) keys and their tenants.
    keys: Vec<([u8; 32], TenantId)>,
    /// Every tenant's canaries, when any tenant has some.
    canaries: Option<Arc<canary::CanaryGuard>>,
}

impl Directory {
    /// The directory of `tenants` and the live ones of `keys`. A tenant whose
    /// `pending_max` did not change keeps its permits from `previous`, so the
    /// requests in flight stay counted.
    pub fn build(
        tenants: &[TenantRecord],
        keys: &[KeyRecord],
        previous: Option<&Directory>,
    ) -> Directory {
        let mut directory = Directory::default();
        for record in tenants {
            let id = TenantId(record.id);
            let kept = previous
                .and_then(|p| p.tenants.get(&id))
                .filter(|t| t.quota.pending_max == record.quota.pending_max);
            let pending = kept.map_or_else(
                || Arc::new(Semaphore::new(record.quota.pending_max as usize)),
                |t| Arc::clone(&t.pending),
            );
            directory.by_name.insert(record.name.clone(), id);
            directory.tenants.insert(
                id,
                Arc::new(Tenant {
                    id,
                    name: record.name.clone(),
                    quota: record.quota,
                    models: record.models.clone(),
                    pending,
                }),
            );
        }
        directory.canaries = canary::CanaryGuard::build(tenants).map(Arc::new);
        for key in keys {
            let tenant = TenantId(key.tenant);
            let live = key.revoked_ms.is_none() && directory.tenants.contains_key(&tenant);
            if let (true, Some(digest)) = (live, parse_digest(&key.sha256)) {
                directory.keys.push((digest, tenant));
            }
        }
        directory
    }

    /// The tenant whose key this is, comparing with every digest in constant time.
    pub fn authenticate(&self, key: &str) -> Option<&Arc<Tenant>> {
        if key.is_empty() || key.len() > KEY_BYTES_MAX {
            return None;
        }
        let presented = key_digest(key);
        let mut found: Option<TenantId> = None;
        for (digest, tenant) in &self.keys {
            // No early exit: every digest is compared.
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(*tenant);
            }
        }
        self.tenants.get(&found?)
    }

    /// Every tenant's canaries, compiled; `None` when no tenant has any.
    pub fn canaries(&self) -> Option<&Arc<canary::CanaryGuard>> {
        self.canaries.as_ref()
    }

    /// A tenant by id.
    pub fn tenant(&self, id: TenantId) -> Option<&Arc<Tenant>> {
        self.tenants.get(&id)
    }

    /// A tenant by name.
    pub fn by_name(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.tenants.get(self.by_name.get(name)?)
    }

    /// Every tenant, in id order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.tenants.values()
    }

    /// Tenants.
    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    /// Whether there is no tenant.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }
}

/// The live directory, replaced whole on every committed change.
#[derive(Default)]
pub struct Registry {
    current: RwLock<Arc<Directory>>,
}

impl Registry {
    /// A registry serving `directory`.
    pub fn new(directory: Directory) -> Registry {
        Registry {
            current: RwLock::new(Arc::new(directory)),
        }
    }

    /// The current directory.
    pub fn snapshot(&self) -> Arc<Directory> {
        // A poisoned lock means a panic while swapping an Arc: the value is
        // still a whole directory.
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Replaces the directory.
    pub fn replace(&self, directory: Directory) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(directory);
    }

    /// The tenant whose key this is (see [`Directory::authenticate`]).
    pub fn authenticate(&self, key: &str) -> Option<Arc<Tenant>> {
        self.snapshot().authenticate(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::records::KeySource;

    fn quota() -> Quota {
        Quota {
            weight: 1,
            pages_reserved: 4,
            pages_max: 8,
            queue_depth_max: 4,
            running_max: 2,
            pending_max: 2,
            prefix_cache: true,
        }
    }

    fn tenant(id: u32, name: &str) -> TenantRecord {
        TenantRecord {
            id,
            name: name.into(),
            quota: quota(),
            models: ModelAccess::All,
            canaries: Vec::new(),
            created_ms: 0,
            updated_ms: 0,
        }
    }

    fn key(id: &str, tenant: u32, secret: &str, revoked: bool) -> KeyRecord {
        KeyRecord {
            id: id.into(),
            tenant,
            sha256: hex(&key_digest(secret)),
            prefix: secret[..4].into(),
            source: KeySource::Issued,
            created_ms: 0,
            revoked_ms: revoked.then_some(1),
        }
    }

    #[test]
    fn authenticates_live_keys_only() {
        let tenants = [tenant(3, "alpha"), tenant(9, "beta")];
        let keys = [
            key("key_a", 3, "alpha-secret-0123456789", false),
            key("key_b", 9, "beta-secret-0123456789", false),
            key("key_c", 3, "alpha-revoked-0123456789", true),
            key("key_d", 4, "orphan-secret-0123456789", false),
        ];
        let d = Directory::build(&tenants, &keys, None);
        assert_eq!(
            d.authenticate("alpha-secret-0123456789").unwrap().id,
            TenantId(3)
        );
        assert_eq!(
            d.authenticate("beta-secret-0123456789").unwrap().name,
            "beta"
        );
        for wrong in [
            "",
            "alpha-revoked-0123456789",
            "orphan-secret-0123456789",
            "alpha-secret-012345678",
            &"x".repeat(KEY_BYTES_MAX + 1),
        ] {
            assert!(d.authenticate(wrong).is_none(), "{wrong:?}");
        }
        assert_eq!(d.by_name("beta").unwrap().id, TenantId(9));
        assert!(d.by_name("gamma").is_none());
    }

    #[test]
    fn a_rebuilt_directory_keeps_permits_in_use_unless_pending_max_changed() {
        let mut tenants = vec![tenant(1, "alpha"), tenant(2, "beta")];
        let first = Directory::build(&tenants, &[], None);
        let held = Arc::clone(&first.tenant(TenantId(1)).unwrap().pending)
            .try_acquire_owned()
            .unwrap();
        tenants[1].quota.pending_max = 5;
        let second = Directory::build(&tenants, &[], Some(&first));
        assert_eq!(
            second
                .tenant(TenantId(1))
                .unwrap()
                .pending
                .available_permits(),
            1,
            "the permit in use is still counted"
        );
        assert_eq!(
            second
                .tenant(TenantId(2))
                .unwrap()
                .pending
                .available_permits(),
            5
        );
        drop(held);
    }

    #[test]
    fn access_lists_are_every_model_or_valid_ids() {
        let parse = |json: &str| serde_json::from_str::<ModelAccess>(json);
        assert_eq!(parse(r#"["*"]"#).unwrap(), ModelAccess::All);
        let only = parse(r#"["b", "a", "a"]"#).unwrap();
        assert!(only.allows("a") && only.allows("b") && !only.allows("c"));
        assert_eq!(serde_json::to_string(&only).unwrap(), r#"["a","b"]"#);
        assert_eq!(
            serde_json::to_string(&ModelAccess::All).unwrap(),
            r#"["*"]"#
        );
        let none = parse("[]").unwrap();
        assert!(!none.allows("a"));
        for bad in [r#"["*", "a"]"#, r#"["a/b"]"#, r#"[""]"#, r#""*""#] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_letters_digits_dash_underscore_starting_with_a_letter() {
        for good in ["alpha", "a", "Tenant_2", "x-y"] {
            assert!(valid_name(good), "{good}");
        }
        let long = "a".repeat(NAME_BYTES_MAX + 1);
        for bad in ["", "1abc", "-a", "a/b", "a b", "a\u{7}", "../x", "é", &long] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn quotas_are_bounded() {
        quota().validate().unwrap();
        for (bad, field) in [
            (
                Quota {
                    weight: 0,
                    ..quota()
                },
                "weight",
            ),
            (
                Quota {
                    pages_max: 3,
                    ..quota()
                },
                "pages_max",
            ),
            (
                Quota {
                    queue_depth_max: 0,
                    ..quota()
                },
                "queue_depth_max",
            ),
            (
                Quota {
                    running_max: 0,
                    ..quota()
                },
                "running_max",
            ),
            (
                Quota {
                    pending_max: PENDING_LIMIT + 1,
                    prefix_cache: true,
                    ..quota()
                },
                "pending_max",
            ),
        ] {
            assert_eq!(bad.validate().unwrap_err().field, field);
        }
    }
}
