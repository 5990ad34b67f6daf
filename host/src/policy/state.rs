//! A plugin's own key-value state (WIT `state`), kept in the control-plane
//! store under (tenant, plugin): no plugin reads another's, no tenant another
//! tenant's. Keys are at most [`STATE_KEY_BYTES_MAX`] bytes, values at most
//! [`STATE_VALUE_BYTES_MAX`], at most [`STATE_KEYS_MAX`] live keys per plugin;
//! an expired entry reads as absent and is removed when room is needed. Every
//! write is durable (a store commit) before the plugin's call goes on.

use crate::store::records::PluginStateRecord;
use crate::store::{Batch, Store, StoreError};
use crate::tenancy::{hex, TenantId};
use std::sync::Arc;

/// Longest state key, in bytes.
pub const STATE_KEY_BYTES_MAX: usize = 128;
/// Largest state value, in bytes.
pub const STATE_VALUE_BYTES_MAX: usize = 4096;
/// Most live keys per plugin of a tenant.
pub const STATE_KEYS_MAX: usize = 1024;

/// Why a write was refused (WIT `state.state-error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateError {
    /// A key or value over its limit.
    TooLarge,
    /// The plugin has the most keys it may have.
    TooManyKeys,
    /// The store failed (logged).
    Unavailable,
}

/// Plugins' state over the store.
pub struct PluginState {
    store: Arc<Store>,
    /// Entries stored (live or expired) per (tenant, plugin identity), counted
    /// from the store once and kept since: a new key costs one lookup and one
    /// commit, not a scan of every entry (2 -> 10 ms at 1,020 keys). Each
    /// plugin's count has a lock of its own, held from the check to the
    /// commit, so two new keys at once cannot both take the last place.
    counts: std::sync::Mutex<std::collections::HashMap<(TenantId, String), KeyCount>>,
}

/// One plugin's stored key count, `None` until counted from the store.
type KeyCount = Arc<std::sync::Mutex<Option<usize>>>;

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn live(record: &PluginStateRecord, now_ms: u64) -> bool {
    record.expires_ms.is_none_or(|at| at > now_ms)
}

impl PluginState {
    /// State kept in `store`.
    pub fn new(store: Arc<Store>) -> PluginState {
        PluginState {
            store,
            counts: Default::default(),
        }
    }

    fn count_of(&self, tenant: TenantId, plugin: &str) -> Arc<std::sync::Mutex<Option<usize>>> {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(counts.entry((tenant, plugin.to_string())).or_default())
    }

    /// The value of `key`, unless absent or expired.
    pub fn get(
        &self,
        tenant: TenantId,
        plugin: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        if key.is_empty() || key.len() > STATE_KEY_BYTES_MAX {
            return Ok(None);
        }
        Ok(self
            .store
            .plugin_state(tenant.0, plugin, key)?
            .filter(|r| live(r, now_ms))
            .and_then(|r| unhex(&r.value_hex)))
    }

    /// Sets `key` to `value`, expiring `ttl_ms` from `now_ms` when given.
    pub fn set(
        &self,
        tenant: TenantId,
        plugin: &str,
        key: &str,
        value: &[u8],
        ttl_ms: Option<u32>,
        now_ms: u64,
    ) -> Result<(), StateError> {
        if key.is_empty() || key.len() > STATE_KEY_BYTES_MAX || value.len() > STATE_VALUE_BYTES_MAX
        {
            return Err(StateError::TooLarge);
        }
        let unavailable = |error: StoreError| {
            tracing::warn!(%error, plugin, "plugin state");
            StateError::Unavailable
        };
        let count = self.count_of(tenant, plugin);
        let mut count = count.lock().unwrap_or_else(|p| p.into_inner());
        let mut batch = Batch::default();
        let stored = self
            .store
            .plugin_state(tenant.0, plugin, key)
            .map_err(unavailable)?;
        let mut stored_count = match *count {
            Some(n) => n,
            None => self
                .store
                .plugin_state_entries(tenant.0, plugin, STATE_KEYS_MAX * 2)
                .map_err(unavailable)?
                .len(),
        };
        let adds = stored.is_none();
        if stored.as_ref().is_none_or(|r| !live(r, now_ms)) && stored_count >= STATE_KEYS_MAX {
            // Full by count: drop the expired entries, and count what is live.
            let entries = self
                .store
                .plugin_state_entries(tenant.0, plugin, STATE_KEYS_MAX * 2)
                .map_err(unavailable)?;
            let mut kept = entries.len();
            for (other, record) in &entries {
                if !live(record, now_ms) && other != key {
                    batch.delete_plugin_state(tenant.0, plugin, other);
                    kept -= 1;
                }
            }
            let live_others = kept - usize::from(!adds);
            if live_others >= STATE_KEYS_MAX {
                *count = Some(entries.len());
                return Err(StateError::TooManyKeys);
            }
            stored_count = kept;
        }
        let record = PluginStateRecord {
            value_hex: hex(value),
            expires_ms: ttl_ms.map(|ttl| now_ms + u64::from(ttl)),
        };
        batch.put_plugin_state(tenant.0, plugin, key, &record);
        self.store.commit(batch).map_err(unavailable)?;
        *count = Some(stored_count + usize::from(adds));
        Ok(())
    }

    /// Removes `key`.
    pub fn delete(&self, tenant: TenantId, plugin: &str, key: &str) -> Result<(), StoreError> {
        if key.is_empty() || key.len() > STATE_KEY_BYTES_MAX {
            return Ok(());
        }
        let count = self.count_of(tenant, plugin);
        let mut count = count.lock().unwrap_or_else(|p| p.into_inner());
        let existed = self.store.plugin_state(tenant.0, plugin, key)?.is_some();
        let mut batch = Batch::default();
        batch.delete_plugin_state(tenant.0, plugin, key);
        self.store.commit(batch)?;
        if existed {
            *count = count.map(|n| n.saturating_sub(1));
        }
        Ok(())
    }

    /// Adds the removal of all of a plugin's state to `batch` (plugin deleted).
    pub fn forget(
        &self,
        batch: &mut Batch,
        tenant: TenantId,
        plugin: &str,
    ) -> Result<(), StoreError> {
        for (key, _) in self
            .store
            .plugin_state_entries(tenant.0, plugin, STATE_KEYS_MAX * 2)?
        {
            batch.delete_plugin_state(tenant.0, plugin, &key);
        }
        // Counted again from the store when next used.
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(tenant, plugin.to_string()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> (PluginState, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "bulkhead-pstate-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        (PluginState::new(Arc::new(Store::open(&dir).unwrap())), dir)
    }

    #[test]
    fn state_is_per_tenant_and_plugin_bounded_and_expires() {
        let (s, dir) = state();
        let (a, b) = (TenantId(1), TenantId(2));
        s.set(a, "p", "k", b"one", None, 0).unwrap();
        s.set(a, "q", "k", b"two", None, 0).unwrap();
        assert_eq!(s.get(a, "p", "k", 0).unwrap().as_deref(), Some(&b"one"[..]));
        assert_eq!(s.get(a, "q", "k", 0).unwrap().as_deref(), Some(&b"two"[..]));
        assert_eq!(
            s.get(b, "p", "k", 0).unwrap(),
            None,
            "another tenant's plugin"
        );
        s.set(a, "p", "t", b"x", Some(100), 1000).unwrap();
        assert!(s.get(a, "p", "t", 1099).unwrap().is_some());
        assert!(s.get(a, "p", "t", 1100).unwrap().is_none(), "expired");
        assert_eq!(s.set(a, "p", "", b"x", None, 0), Err(StateError::TooLarge));
        let big = vec![0u8; STATE_VALUE_BYTES_MAX + 1];
        assert_eq!(s.set(a, "p", "k", &big, None, 0), Err(StateError::TooLarge));
        s.delete(a, "p", "k").unwrap();
        assert_eq!(s.get(a, "p", "k", 0).unwrap(), None);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_plugin_cannot_hold_more_than_its_keys_but_expired_ones_make_room() {
        let (s, dir) = state();
        let t = TenantId(1);
        for i in 0..STATE_KEYS_MAX {
            let ttl = (i == 0).then_some(10);
            s.set(t, "p", &format!("k{i}"), b"v", ttl, 0).unwrap();
        }
        assert_eq!(
            s.set(t, "p", "one-more", b"v", None, 5),
            Err(StateError::TooManyKeys)
        );
        // Overwriting a key needs no room; k0 expiring makes room.
        s.set(t, "p", "k5", b"w", None, 5).unwrap();
        s.set(t, "p", "one-more", b"v", None, 20).unwrap();
        assert_eq!(
            s.set(t, "p", "two-more", b"v", None, 20),
            Err(StateError::TooManyKeys)
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
