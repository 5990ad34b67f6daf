//! The control plane's state at start-up: which wins, the policy file or the
//! store, and where keys and the admin token come from.
//!
//! 1. **An empty store is seeded** from the policy file: its tenants (ids in
//!    name order, from 1) and their `keys_sha256`. From then on the store is
//!    the source of truth for tenants, keys and quotas; editing `[tenants]` in
//!    the policy changes nothing in a seeded store (use the admin API).
//! 2. **Environment keys**, every start: a tenant of the store named in the
//!    policy with a `key_env` variable that is set gets that key (its digest,
//!    source `env`) unless the store knows it already. A key revoked in the
//!    store stays revoked, whatever the environment says (a warning is logged).
//! 3. **Generated keys**: a tenant of the policy that never had a key (no key
//!    record at all, live or revoked) gets one, stored as a digest and shown
//!    once to the terminal (stdout), never to the log stream. A tenant whose
//!    keys were all revoked gets none: revoking is the operator's word.
//! 4. **The admin token**: `BULKHEAD_ADMIN_TOKEN` (at least 32 bytes) when
//!    set — a token unlike the stored one *rotates* it (the old digest is
//!    replaced, audited `admin_token.rotate`), so unsetting the variable later
//!    does not bring the old token back — else the stored digest, else a new
//!    token, generated, stored and shown once. It must differ from every
//!    tenant key. `bulkhead reset-admin-token` replaces a lost one offline
//!    ([`reset_admin_token`]).
//!
//! Start-up is in two steps so that a start that fails writes no secret it
//! did not show: [`plan`] checks every variable and decides every secret
//! without writing anything; the server then binds its listeners and loads
//! its models and plugins, and only then [`Plan::commit`]s (one batch) and
//! prints what it generated.

use super::control::{audit, key_record, new_key, random_hex, Actor, SECRET_BYTES};
use super::{hex, key_digest, parse_digest, KEY_BYTES_MIN};
use crate::clock::now_ms;
use crate::config::Config;
use crate::store::records::{AuditRecord, KeyRecord, KeySource, Meta, TenantRecord};
use crate::store::{Batch, Fence, Store, StoreError};

/// Shortest admin token accepted.
pub const ADMIN_TOKEN_BYTES_MIN: usize = 32;
/// The variable holding the admin token.
pub const ADMIN_TOKEN_ENV: &str = "BULKHEAD_ADMIN_TOKEN";

/// Why the state could not be prepared: the server does not start.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A key from the environment is too short to be a secret.
    #[error("{var} holds a key of {len} bytes; keys must have at least {KEY_BYTES_MIN}")]
    WeakKey {
        /// The variable.
        var: String,
        /// Its length.
        len: usize,
    },
    /// A key from the environment belongs to another tenant.
    #[error("{var} holds a key of tenant {owner}, not of tenant {tenant}")]
    SharedKey {
        /// The variable.
        var: String,
        /// The tenant the policy gives it to.
        tenant: String,
        /// The tenant it belongs to.
        owner: String,
    },
    /// The admin token is unusable.
    #[error("{ADMIN_TOKEN_ENV}: {0}")]
    AdminToken(String),
}

/// What start-up decided, not yet written ([`plan`]).
pub struct Plan {
    /// SHA-256 of the admin token.
    pub admin_token_sha256: [u8; 32],
    /// Key records to add (environment and generated keys).
    keys: Vec<KeyRecord>,
    /// The admin token's digest to store, when it changes.
    admin_token: Option<String>,
    /// The audit records of all that.
    audit: Vec<AuditRecord>,
    /// Secrets generated, one line each, for the terminal (never the log).
    shown: Vec<String>,
    /// The control-plane fence, read before the plan read anything: on a
    /// shared store, a plan another server's change made stale is refused.
    fence: Fence,
}

impl Plan {
    /// The store's keys as they will be once this plan is committed.
    pub fn keys_after(&self, mut stored: Vec<KeyRecord>) -> Vec<KeyRecord> {
        stored.extend(self.keys.iter().cloned());
        stored
    }

    /// Writes the plan in one batch, and only then returns the lines to show.
    pub fn commit(self, store: &Store) -> Result<Vec<String>, SeedError> {
        if self.keys.is_empty() && self.admin_token.is_none() && self.audit.is_empty() {
            return Ok(self.shown);
        }
        let mut batch = Batch::default();
        batch.fenced(&self.fence);
        for key in &self.keys {
            batch.put_key(key);
        }
        if let Some(digest) = &self.admin_token {
            batch.put_admin_token(digest);
        }
        for record in self.audit {
            batch.audit(record);
        }
        store.commit(batch)?;
        Ok(self.shown)
    }
}

/// Seeds an empty store from the policy (module doc, 1). Tenants and policy
/// digests only: no secret is generated here.
/// On a shared store, two servers may find it empty at once: one seeds it,
/// the other's seed is refused by the fence and it goes on with the store
/// as seeded.
pub fn seed_if_empty(config: &Config, store: &Store) -> Result<(), SeedError> {
    let fence = store.fence()?;
    if store.meta()?.is_none() {
        match seed(config, store, &fence) {
            Err(SeedError::Store(StoreError::Conflict)) if store.meta()?.is_some() => {
                tracing::info!(path = store.path(), "another server seeded the store first");
            }
            other => other?,
        }
    }
    Ok(())
}

/// Decides the environment keys, generated keys and the admin token (module
/// doc, 2-4) and checks them, writing nothing. `env` reads environment
/// variables.
pub fn plan(
    config: &Config,
    store: &Store,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Plan, SeedError> {
    let mut plan = Plan {
        fence: store.fence()?,
        admin_token_sha256: [0; 32],
        keys: Vec::new(),
        admin_token: None,
        audit: Vec::new(),
        shown: Vec::new(),
    };
    env_keys(config, store, &env, &mut plan)?;
    generated_keys(config, store, &mut plan)?;
    admin_token(store, &env, &mut plan)?;
    Ok(plan)
}

/// The records the policy's tenants become when they seed a store: ids from
/// 1, in name order.
pub fn policy_tenants(config: &Config) -> Vec<TenantRecord> {
    let now = now_ms();
    config
        .tenants
        .iter()
        .zip(1..)
        .map(|((name, tenant), id)| TenantRecord {
            id,
            name: name.clone(),
            quota: tenant.quota(),
            models: tenant.models.clone(),
            canaries: Vec::new(),
            objective: tenant.objective.clone(),
            created_ms: now,
            updated_ms: now,
        })
        .collect()
}

/// First start: the policy's tenants and stored key digests.
fn seed(config: &Config, store: &Store, fence: &Fence) -> Result<(), SeedError> {
    let mut batch = Batch::default();
    batch.fenced(fence);
    let now = now_ms();
    let records = policy_tenants(config);
    for (record, tenant) in records.iter().zip(config.tenants.values()) {
        batch.put_tenant(record);
        for digest in &tenant.keys_sha256 {
            let mut key = key_record(record.id, "", KeySource::Policy)?;
            key.sha256 = digest.to_ascii_lowercase();
            key.prefix = String::new();
            batch.put_key(&key);
        }
    }
    // At most TENANTS_MAX (1024) tenants: the count fits a u32.
    let id = records.len() as u32 + 1;
    batch.put_tenant_id_next(id);
    batch.put_meta(&Meta {
        created_ms: now,
        seeded_from: config.source.display().to_string(),
    });
    let mut record = audit(
        &Actor::System,
        "store.seed",
        &config.source.display().to_string(),
    );
    record
        .detail
        .insert("tenants".into(), (id as u64 - 1).into());
    batch.audit(record);
    store.commit(batch)?;
    tracing::info!(
        path = store.path(),
        tenants = id - 1,
        "store seeded from the policy"
    );
    Ok(())
}

fn env_keys(
    config: &Config,
    store: &Store,
    env: &impl Fn(&str) -> Option<String>,
    plan: &mut Plan,
) -> Result<(), SeedError> {
    let tenants = store.tenants()?;
    let mut keys = store.keys()?;
    for (name, policy) in &config.tenants {
        let (Some(var), Some(tenant)) = (
            policy.key_env.as_ref(),
            tenants.iter().find(|t| &t.name == name),
        ) else {
            continue;
        };
        let Some(secret) = env(var) else { continue };
        if secret.len() < KEY_BYTES_MIN {
            return Err(SeedError::WeakKey {
                var: var.clone(),
                len: secret.len(),
            });
        }
        let digest = hex(&key_digest(&secret));
        match keys.iter().find(|k| k.sha256 == digest) {
            Some(known) if known.tenant != tenant.id => {
                let owner = tenants
                    .iter()
                    .find(|t| t.id == known.tenant)
                    .map_or_else(|| format!("#{}", known.tenant), |t| t.name.clone());
                return Err(SeedError::SharedKey {
                    var: var.clone(),
                    tenant: name.clone(),
                    owner,
                });
            }
            Some(known) if known.revoked_ms.is_some() => {
                tracing::warn!(tenant = %name, var = %var, key_id = %known.id, "the key in this variable was revoked; it stays revoked");
            }
            Some(_) => {}
            None => {
                let key = key_record(tenant.id, &secret, KeySource::Env { var: var.clone() })?;
                let mut record = audit(&Actor::System, "key.env", name);
                record.detail.insert("key_id".into(), key.id.clone().into());
                record.detail.insert("var".into(), var.clone().into());
                plan.keys.push(key.clone());
                plan.audit.push(record);
                keys.push(key);
            }
        }
    }
    Ok(())
}

fn generated_keys(config: &Config, store: &Store, plan: &mut Plan) -> Result<(), SeedError> {
    let keys = plan.keys_after(store.keys()?);
    for tenant in store.tenants()? {
        let never_had_one = !keys.iter().any(|k| k.tenant == tenant.id);
        if !never_had_one || !config.tenants.contains_key(&tenant.name) {
            continue;
        }
        let (key, secret) = new_key(&tenant, KeySource::Generated)?;
        let mut record = audit(&Actor::System, "key.generate", &tenant.name);
        record.detail.insert("key_id".into(), key.id.clone().into());
        plan.keys.push(key);
        plan.audit.push(record);
        plan.shown.push(format!(
            "key for tenant {} (generated; shown once, stored as a digest): {secret}",
            tenant.name
        ));
    }
    Ok(())
}

fn admin_token(
    store: &Store,
    env: &impl Fn(&str) -> Option<String>,
    plan: &mut Plan,
) -> Result<(), SeedError> {
    let stored = store.admin_token()?.as_deref().and_then(parse_digest);
    let digest = match env(ADMIN_TOKEN_ENV).filter(|t| !t.is_empty()) {
        Some(token) => {
            if token.len() < ADMIN_TOKEN_BYTES_MIN {
                return Err(SeedError::AdminToken(format!(
                    "the token has {} bytes; it needs at least {ADMIN_TOKEN_BYTES_MIN} (e.g. $(openssl rand -hex 24))",
                    token.len()
                )));
            }
            let digest = key_digest(&token);
            if stored != Some(digest) {
                // A rotation: the old token stops working, for good.
                let kind = if stored.is_some() {
                    "admin_token.rotate"
                } else {
                    "admin_token.env"
                };
                let mut record = audit(&Actor::System, kind, "admin");
                record
                    .detail
                    .insert("source".into(), ADMIN_TOKEN_ENV.into());
                plan.admin_token = Some(hex(&digest));
                plan.audit.push(record);
            }
            digest
        }
        None => match stored {
            Some(stored) => stored,
            None => {
                let token = format!("bk-admin-{}", random_hex(SECRET_BYTES)?);
                plan.admin_token = Some(hex(&key_digest(&token)));
                plan.audit
                    .push(audit(&Actor::System, "admin_token.generate", "admin"));
                plan.shown.push(format!(
                    "admin token (generated; shown once, stored as a digest; set {ADMIN_TOKEN_ENV} to rotate it): {token}"
                ));
                key_digest(&token)
            }
        },
    };
    let hex_digest = hex(&digest);
    if plan
        .keys_after(store.keys()?)
        .iter()
        .any(|k| k.sha256 == hex_digest)
    {
        return Err(SeedError::AdminToken(
            "the admin token is also a tenant's API key; they must differ".into(),
        ));
    }
    plan.admin_token_sha256 = digest;
    Ok(())
}

/// Replaces the admin token of a store no server holds with a new one,
/// generated, stored as a digest (the old one stops working) and audited
/// (`admin_token.reset`); the token is returned to be shown once.
pub fn reset_admin_token(store: &Store) -> Result<String, SeedError> {
    if store.meta()?.is_none() {
        return Err(SeedError::AdminToken(
            "this store was never seeded: start the server once first".into(),
        ));
    }
    let token = format!("bk-admin-{}", random_hex(SECRET_BYTES)?);
    let mut batch = Batch::default();
    // Fenced: the servers sharing a store see the change and take it.
    batch.fenced(&store.fence()?);
    let mut record = audit(&Actor::System, "admin_token.reset", "admin");
    record
        .detail
        .insert("by".into(), "bulkhead reset-admin-token".into());
    batch
        .put_admin_token(&hex(&key_digest(&token)))
        .audit(record);
    store.commit(batch)?;
    Ok(token)
}
