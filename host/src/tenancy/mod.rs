//! Tenants and their API keys.
//!
//! 1. A tenant is known by its configured name and an opaque [`TenantId`]; the
//!    engine and the KV pool see only the id (as an owner tag).
//! 2. Keys are stored as SHA-256 digests of high-entropy secrets, never in
//!    clear. A presented key is hashed and compared with every stored digest in
//!    constant time, so neither timing nor an early exit tells which digest (or
//!    which byte) came close.
//! 3. A key may come from an environment variable named in the policy (a test
//!    harness or a demo brings its own); otherwise operators store digests.

use crate::config::Config;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

/// Shortest key accepted from the environment: 128 bits of hex, or more.
pub const KEY_BYTES_MIN: usize = 16;
/// Longest key accepted in a request header.
pub const KEY_BYTES_MAX: usize = 256;

/// A tenant's identity inside the process; also its KV owner tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u32);

/// Why the tenant registry could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    /// A key from the environment is too short to be a secret.
    #[error("{var} holds a key of {len} bytes; keys must have at least {KEY_BYTES_MIN}")]
    WeakKey {
        /// The variable.
        var: String,
        /// Its length.
        len: usize,
    },
    /// Two tenants share a key.
    #[error("tenants {first} and {second} share an API key")]
    SharedKey {
        /// One tenant.
        first: String,
        /// The other.
        second: String,
    },
}

/// One tenant as the host sees it.
#[derive(Clone, Debug)]
pub struct Tenant {
    /// Its id.
    pub id: TenantId,
    /// Its configured name (never a secret; used in logs and metrics).
    pub name: String,
    /// Its requests before admission (`pending_max` permits): a request holds
    /// one from authentication until the engine has queued or refused it.
    pub pending: Arc<Semaphore>,
}

/// All tenants and their key digests.
pub struct Tenants {
    tenants: Vec<Tenant>,
    /// (digest, index into `tenants`).
    digests: Vec<([u8; 32], usize)>,
}

/// The SHA-256 digest of a key.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn parse_hex(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        // Validated as 64 hex digits by `Config::validate`.
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("validated hex");
    }
    out
}

impl Tenants {
    /// Builds the registry from `config`, reading `key_env` variables through `env`.
    pub fn new(
        config: &Config,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Tenants, TenancyError> {
        let mut tenants = Vec::new();
        let mut digests: Vec<([u8; 32], usize)> = Vec::new();
        for (index, (name, t)) in config.tenants.iter().enumerate() {
            tenants.push(Tenant {
                id: TenantId(index as u32),
                name: name.clone(),
                pending: Arc::new(Semaphore::new(t.pending_max as usize)),
            });
            let mut own: Vec<[u8; 32]> = t.keys_sha256.iter().map(|h| parse_hex(h)).collect();
            if let Some(var) = &t.key_env {
                if let Some(key) = env(var) {
                    if key.len() < KEY_BYTES_MIN {
                        return Err(TenancyError::WeakKey {
                            var: var.clone(),
                            len: key.len(),
                        });
                    }
                    own.push(key_digest(&key));
                }
            }
            for digest in own {
                if let Some(&(_, other)) = digests.iter().find(|(d, _)| *d == digest) {
                    return Err(TenancyError::SharedKey {
                        first: tenants[other].name.clone(),
                        second: name.clone(),
                    });
                }
                digests.push((digest, index));
            }
        }
        Ok(Tenants { tenants, digests })
    }

    /// The tenant whose key this is, comparing with every digest in constant time.
    pub fn authenticate(&self, key: &str) -> Option<&Tenant> {
        if key.is_empty() || key.len() > KEY_BYTES_MAX {
            return None;
        }
        let presented = key_digest(key);
        let mut found: Option<usize> = None;
        for (digest, index) in &self.digests {
            // No early exit: every digest is compared.
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(*index);
            }
        }
        found.map(|i| &self.tenants[i])
    }

    /// Every tenant, in id order.
    pub fn all(&self) -> &[Tenant] {
        &self.tenants
    }

    /// Adds `key` for `tenant` (a demo key generated at start-up). Refused if
    /// the key is too short or already belongs to a tenant.
    pub fn add_key(&mut self, tenant: TenantId, key: &str) -> Result<(), TenancyError> {
        let index = tenant.0 as usize;
        assert!(
            index < self.tenants.len(),
            "tenant ids come from this registry"
        );
        if key.len() < KEY_BYTES_MIN {
            return Err(TenancyError::WeakKey {
                var: format!("the key for {}", self.tenants[index].name),
                len: key.len(),
            });
        }
        let digest = key_digest(key);
        if let Some(&(_, other)) = self.digests.iter().find(|(d, _)| *d == digest) {
            return Err(TenancyError::SharedKey {
                first: self.tenants[other].name.clone(),
                second: self.tenants[index].name.clone(),
            });
        }
        self.digests.push((digest, index));
        Ok(())
    }

    /// Tenants without any key (their names), for a start-up warning.
    pub fn without_keys(&self) -> Vec<&str> {
        self.tenants
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.digests.iter().any(|(_, j)| j == i))
            .map(|(_, t)| t.name.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra_alpha: &str) -> Config {
        Config::parse(&format!(
            r#"
[model]
id = "m"
path = "m.gguf"
context_tokens = 64
[tenants.alpha]
pages_reserved = 4
pages_max = 8
key_env = "KEY_A"
{extra_alpha}
[tenants.beta]
pages_reserved = 4
pages_max = 8
key_env = "KEY_B"
"#
        ))
        .unwrap()
    }

    fn env(a: &'static str, b: &'static str) -> impl Fn(&str) -> Option<String> {
        move |var| match var {
            "KEY_A" => Some(a.to_string()),
            "KEY_B" => Some(b.to_string()),
            _ => None,
        }
    }

    #[test]
    fn authenticates_env_and_stored_keys_and_refuses_others() {
        let stored = "stored-key-for-alpha-0123456789";
        let digest: String = key_digest(stored)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let tenants = Tenants::new(
            &config(&format!("keys_sha256 = [\"{digest}\"]")),
            env("alpha-secret-0123456789", "beta-secret-0123456789"),
        )
        .unwrap();
        assert_eq!(
            tenants
                .authenticate("alpha-secret-0123456789")
                .unwrap()
                .name,
            "alpha"
        );
        assert_eq!(tenants.authenticate(stored).unwrap().name, "alpha");
        assert_eq!(
            tenants.authenticate("beta-secret-0123456789").unwrap().name,
            "beta"
        );
        for wrong in [
            "",
            "alpha-secret-012345678",
            "alpha-secret-0123456789 ",
            &"x".repeat(KEY_BYTES_MAX + 1),
        ] {
            assert!(tenants.authenticate(wrong).is_none(), "{wrong:?}");
        }
    }

    #[test]
    fn refuses_weak_and_shared_keys() {
        assert!(matches!(
            Tenants::new(&config(""), env("short", "beta-secret-0123456789")),
            Err(TenancyError::WeakKey { .. })
        ));
        assert!(matches!(
            Tenants::new(
                &config(""),
                env("same-secret-0123456789", "same-secret-0123456789")
            ),
            Err(TenancyError::SharedKey { .. })
        ));
    }

    #[test]
    fn reports_tenants_without_keys() {
        let tenants = Tenants::new(&config(""), |_| None).unwrap();
        assert_eq!(tenants.without_keys(), vec!["alpha", "beta"]);
    }
}
