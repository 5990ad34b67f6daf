//! The prefix cache: full prompt pages kept per tenant, so a tenant's repeated
//! prefix (a system prompt, a document it asks several questions about) is not
//! computed twice (invariant I7).
//!
//! - **Per tenant by construction.** Each tenant has its own map; a key is a hash
//!   chained over the page's token ids and its parent's key, rooted in the tenant's
//!   id and the pool's id, with keys drawn at random when the engine starts
//!   (`RandomState`). So a key never matches across tenants, and nothing outside
//!   the engine ever sees one. A request may add a salt (`cache_salt`): then it
//!   shares pages only with its tenant's requests of the same salt, so a tenant
//!   can keep its own users apart too. A match is confirmed by comparing the page's tokens
//!   and its parent's key, so a hash collision cannot serve another prefix's page.
//! - **Only full, final pages.** A page is shared once every position in it holds
//!   a prompt token's K and V; the pool makes it read-only (`Owned → Shared`), and
//!   the backend refuses any step that would write it.
//! - **Charged to its tenant.** A shared page counts in its tenant's partition like
//!   any other (`pages_shared`); it can never take another tenant's reserved pages.
//!   While no sequence holds it ("idle") the scheduler keeps it only within the
//!   tenant's own reservation, and evicts it, least recently used first, when the
//!   tenant needs the pages itself: one tenant's pressure never evicts another's
//!   cache. Eviction releases the page, and the pool scrubs it like any other.
//!
//! ```text
//!  key(0) = H(seed, H(seed, tenant, pool, salt), tokens[0..P])
//!  key(i) = H(seed, key(i-1),     tokens[iP..(i+1)P])
//! ```

use crate::tenancy::TenantId;
use bulkhead_kernels::kv::{KvError, OwnerTag, PageHandle, PageState, Pool, PoolId};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

/// One cached page.
struct Entry {
    handle: PageHandle,
    /// The key of the page before it (`None` for a prompt's first page).
    parent: Option<u64>,
    /// The page's tokens, to confirm a match.
    tokens: Box<[u32]>,
    /// Its index in the prompt: deeper pages of a chain are evicted first.
    depth: u32,
    /// The cache clock when it was last matched or added.
    last_used: u64,
}

/// Every tenant's cached pages in one pool.
pub(super) struct PrefixCache {
    keys: RandomState,
    pool: PoolId,
    page_tokens: usize,
    tenants: HashMap<TenantId, HashMap<u64, Entry>>,
    clock: u64,
}

impl PrefixCache {
    /// An empty cache for `pool`, whose pages hold `page_tokens` tokens.
    pub(super) fn new(pool: PoolId, page_tokens: u32) -> PrefixCache {
        PrefixCache {
            keys: RandomState::new(),
            pool,
            page_tokens: page_tokens as usize,
            tenants: HashMap::new(),
            clock: 0,
        }
    }

    /// The chained keys of the full pages of `tenant`'s `prompt`, under the
    /// request's cache `salt`.
    pub(super) fn chain(&self, tenant: TenantId, salt: Option<&str>, prompt: &[u32]) -> Vec<u64> {
        let mut parent = self.keys.hash_one((tenant.0, self.pool.0, salt));
        prompt
            .chunks_exact(self.page_tokens)
            .map(|page| {
                parent = self.keys.hash_one((parent, page));
                parent
            })
            .collect()
    }

    /// The longest cached prefix of `prompt` (keys `chain`), at most `pages_max`
    /// pages: their handles, in order. Marks them used.
    pub(super) fn lookup(
        &mut self,
        tenant: TenantId,
        chain: &[u64],
        prompt: &[u32],
        pages_max: usize,
    ) -> Vec<PageHandle> {
        self.clock += 1;
        let Some(entries) = self.tenants.get_mut(&tenant) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        let mut parent = None;
        for (i, &key) in chain.iter().enumerate().take(pages_max) {
            let page = &prompt[i * self.page_tokens..(i + 1) * self.page_tokens];
            match entries.get_mut(&key) {
                Some(e) if e.parent == parent && *e.tokens == *page => {
                    e.last_used = self.clock;
                    found.push(e.handle);
                }
                _ => break,
            }
            parent = Some(key);
        }
        found
    }

    /// Whether `tenant` has a page under `key`.
    pub(super) fn contains(&self, tenant: TenantId, key: u64) -> bool {
        self.tenants
            .get(&tenant)
            .is_some_and(|entries| entries.contains_key(&key))
    }

    /// Adds page `index` of a prompt (keys `chain`, the page's `tokens`), shared
    /// as `handle`. The caller checked that the key is new.
    pub(super) fn insert(
        &mut self,
        tenant: TenantId,
        chain: &[u64],
        index: usize,
        tokens: &[u32],
        handle: PageHandle,
    ) {
        self.clock += 1;
        let entry = Entry {
            handle,
            parent: index.checked_sub(1).map(|p| chain[p]),
            tokens: tokens.into(),
            depth: index as u32,
            last_used: self.clock,
        };
        let old = self
            .tenants
            .entry(tenant)
            .or_default()
            .insert(chain[index], entry);
        assert!(old.is_none(), "a cached key is shared once");
    }

    /// Checks that every cached page is a current shared page of its own
    /// tenant, in this pool. Returns the first mismatch, described.
    pub(super) fn check(&self, pool: &Pool) -> Result<(), String> {
        for (&tenant, entries) in &self.tenants {
            for entry in entries.values() {
                let handle = entry.handle;
                let meta = pool
                    .page_meta(handle.page)
                    .ok_or_else(|| format!("cached page {handle:?} is not in the pool"))?;
                let ours = matches!(meta.state, PageState::Shared { owner, .. } if owner == OwnerTag(tenant.0));
                if !ours || meta.generation != handle.generation || handle.pool != self.pool {
                    return Err(format!(
                        "tenant {tenant:?} caches {handle:?}, which is {meta:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Pages `tenant` has cached (idle or in use).
    pub(super) fn pages(&self, tenant: TenantId) -> usize {
        self.tenants.get(&tenant).map_or(0, HashMap::len)
    }

    /// Evicts up to `count` of `tenant`'s idle pages (no sequence holds them),
    /// none of `keep`, least recently used first, deepest first among equals:
    /// each goes back to the pool as released (dirty, scrubbed before reuse).
    /// Never touches another tenant's pages. Returns how many it evicted.
    pub(super) fn evict_idle(
        &mut self,
        pool: &mut Pool,
        tenant: TenantId,
        count: usize,
        keep: &[PageHandle],
    ) -> usize {
        let Some(entries) = self.tenants.get_mut(&tenant) else {
            return 0;
        };
        let mut order: Vec<(u64, std::cmp::Reverse<u32>, u64)> = entries
            .iter()
            .map(|(&key, e)| (e.last_used, std::cmp::Reverse(e.depth), key))
            .collect();
        order.sort_unstable();
        let mut evicted = 0;
        for (_, _, key) in order {
            if evicted == count {
                break;
            }
            let handle = entries[&key].handle;
            if keep.contains(&handle) {
                continue;
            }
            match pool.evict(OwnerTag(tenant.0), handle) {
                Ok(()) => {
                    entries.remove(&key);
                    evicted += 1;
                }
                Err(KvError::InUse { .. }) => {}
                Err(error) => {
                    // Only the cache evicts shared pages, and it holds each once.
                    panic!("cached page of tenant {tenant:?} not evictable: {error}");
                }
            }
        }
        if entries.is_empty() {
            self.tenants.remove(&tenant);
        }
        evicted
    }
}
