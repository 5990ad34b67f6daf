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
//! 3. **Generated keys**: a tenant with no live key gets one, stored as a digest
//!    and shown once to the terminal (stdout), never to the log stream.
//! 4. **The admin token**: `BULKHEAD_ADMIN_TOKEN` (at least 32 bytes), or the
//!    token generated at an earlier start (its digest is stored), or a new one,
//!    generated, stored and shown once. It must differ from every tenant key.

use super::control::{audit, key_record, new_key, now_ms, random_hex, Actor, SECRET_BYTES};
use super::{hex, key_digest, parse_digest, KEY_BYTES_MIN};
use crate::config::Config;
use crate::store::records::{KeySource, Meta, TenantRecord};
use crate::store::{Batch, Store, StoreError};

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

/// What start-up decided.
pub struct Prepared {
    /// SHA-256 of the admin token.
    pub admin_token_sha256: [u8; 32],
    /// Secrets generated now, one line each, for the terminal (never the log).
    pub shown: Vec<String>,
}

/// Seeds an empty store, adds environment and generated keys, settles the
/// admin token (module doc). `env` reads environment variables.
pub fn prepare(
    config: &Config,
    store: &Store,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Prepared, SeedError> {
    if store.meta()?.is_none() {
        seed(config, store)?;
    }
    let mut shown = Vec::new();
    env_keys(config, store, &env)?;
    generated_keys(store, &mut shown)?;
    let admin_token_sha256 = admin_token(store, &env, &mut shown)?;
    Ok(Prepared {
        admin_token_sha256,
        shown,
    })
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
            created_ms: now,
            updated_ms: now,
        })
        .collect()
}

/// First start: the policy's tenants and stored key digests.
fn seed(config: &Config, store: &Store) -> Result<(), SeedError> {
    let mut batch = Batch::default();
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
) -> Result<(), SeedError> {
    let tenants = store.tenants()?;
    let mut keys = store.keys()?;
    let mut batch = Batch::default();
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
                batch.put_key(&key).audit(record);
                keys.push(key);
            }
        }
    }
    Ok(store.commit(batch)?)
}

fn generated_keys(store: &Store, shown: &mut Vec<String>) -> Result<(), SeedError> {
    let keys = store.keys()?;
    let mut batch = Batch::default();
    for tenant in store.tenants()? {
        let has_live = keys
            .iter()
            .any(|k| k.tenant == tenant.id && k.revoked_ms.is_none());
        if has_live {
            continue;
        }
        let (key, secret) = new_key(&tenant, KeySource::Generated)?;
        let mut record = audit(&Actor::System, "key.generate", &tenant.name);
        record.detail.insert("key_id".into(), key.id.clone().into());
        batch.put_key(&key).audit(record);
        shown.push(format!(
            "key for tenant {} (generated; shown once, stored as a digest): {secret}",
            tenant.name
        ));
    }
    Ok(store.commit(batch)?)
}

fn admin_token(
    store: &Store,
    env: &impl Fn(&str) -> Option<String>,
    shown: &mut Vec<String>,
) -> Result<[u8; 32], SeedError> {
    let digest = match env(ADMIN_TOKEN_ENV).filter(|t| !t.is_empty()) {
        Some(token) => {
            if token.len() < ADMIN_TOKEN_BYTES_MIN {
                return Err(SeedError::AdminToken(format!(
                    "the token has {} bytes; it needs at least {ADMIN_TOKEN_BYTES_MIN}",
                    token.len()
                )));
            }
            key_digest(&token)
        }
        None => match store.admin_token()?.as_deref().and_then(parse_digest) {
            Some(stored) => stored,
            None => {
                let token = format!("bk-admin-{}", random_hex(SECRET_BYTES)?);
                let mut batch = Batch::default();
                batch
                    .put_admin_token(&hex(&key_digest(&token)))
                    .audit(audit(&Actor::System, "admin_token.generate", "admin"));
                store.commit(batch)?;
                shown.push(format!(
                    "admin token (generated; shown once, stored as a digest; set {ADMIN_TOKEN_ENV} to replace it): {token}"
                ));
                key_digest(&token)
            }
        },
    };
    let hex_digest = hex(&digest);
    if store.keys()?.iter().any(|k| k.sha256 == hex_digest) {
        return Err(SeedError::AdminToken(
            "the admin token is also a tenant's API key; they must differ".into(),
        ));
    }
    Ok(digest)
}
