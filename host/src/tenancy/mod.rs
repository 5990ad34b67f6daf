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

use crate::store::records::{KeyRecord, TenantRecord};
// A tenant's limits and model access are what the store records, so they
// are defined with the records (below this module and the config).
pub use crate::store::records::{
    valid_name, ModelAccess, Quota, QuotaError, TenantId, ACCESS_IDS_MAX, EVERY_MODEL,
    NAME_BYTES_MAX, PENDING_LIMIT, QUEUE_DEPTH_LIMIT, RUNNING_LIMIT, WEIGHT_MAX,
};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

/// Shortest key accepted from the environment: 128 bits of hex, or more.
pub const KEY_BYTES_MIN: usize = 16;
/// Longest key accepted in a request header.
pub const KEY_BYTES_MAX: usize = 256;

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
    /// Its inference objective for the gateway's endpoint picker, if any.
    pub objective: Option<String>,
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
                    objective: record.objective.clone(),
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
            objective: None,
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
