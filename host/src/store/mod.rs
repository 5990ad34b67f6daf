//! The control-plane store: tenants, API keys (digests only), quotas, plugins,
//! usage counters and the audit log, on disk.
//!
//! 1. **Storage** ([`Storage`]) is a small trait over ordered byte keys: get,
//!    scan, and an atomic batch that is durable when `commit` returns. sled
//!    implements it ([`sled_storage`]); a replicated store can replace it
//!    without touching anything above.
//! 2. **Records** ([`records`]) are JSON, each wrapped with its format version
//!    (`{"v": 1, "record": {...}}`). A record of another version is an error
//!    naming the key, never a guess.
//! 3. **[`Store`]** is the typed layer the control plane uses: every change is
//!    a [`Batch`] of record writes plus the audit records that describe it,
//!    committed together, so a change and its audit entry land or vanish as one.
//!
//! Key layout (ids big-endian, so scans come back in id and time order):
//!
//! ```text
//!   meta/format                      format version and creation time
//!   meta/tenant_id_next              the next tenant id (ids are never reused)
//!   meta/admin_token                 SHA-256 of a generated admin token
//!   meta/plugin_id_next              the next plugin id (ids are never reused)
//!   meta/control                     counts control-plane changes (the fence, see below)
//!   meta/audit_next                  the next audit sequence number (shared storage only)
//!   servers/<name>                   a live server's catalog (shared storage only, under a lease)
//!   tenant/<id u32>                  TenantRecord
//!   tenant_name/<name>               <id u32>: one live tenant per name
//!   model/<id>                       ModelRecord: a model added through the admin API
//!   key/<key id>                     KeyRecord (tenant, SHA-256, revoked?)
//!   plugin/<tenant u32>/<name>       PluginRecord (metadata; its code is in files, see [`code`])
//!   pstate/<tenant u32>/<plugin>/<k> PluginStateRecord: a plugin's own key-value state,
//!                                    <plugin> its identity: #<id> (a tenant's), @<name> (the operator's)
//!   usage/<tenant u32>/<minute u64>  UsageRecord: one minute's counters
//!   audit/<seq u64>                  AuditRecord
//!   audit_refused/<tenant u32>/<seq> (empty): the refusal records of a tenant, oldest first
//! ```
//!
//! The audit log is bounded three ways: every record by age
//! ([`Store::purge_audit_before`], hourly), the whole log by count
//! (`store.audit_records_max`, oldest first), and each tenant's refusal
//! records by count (`store.audit_refusals_per_tenant_max`, its oldest
//! refusals first), so one tenant's refused requests can push out only its
//! own refusals, never anyone's security events or admin changes.
//!
//! **Many servers on one store** (etcd, [`etcd_storage`]): every change of
//! the control plane (tenants, keys, models, plugins, the admin token) is
//! *fenced*: it reads `meta/control` before it reads what it is based on
//! ([`Store::fence`]) and commits only if `meta/control` still holds that
//! value, bumping it ([`Batch::fenced`]). A change based on a stale read is
//! refused ([`StoreError::Conflict`]), never lost; the other servers watch
//! `meta/control` and reload what changed. Audit sequence numbers come from
//! `meta/audit_next` inside the same commit, so they stay unique across
//! servers.
//!
//! Format 2 kept plugin code here too, keyed by its digest alone
//! (`plugin_wasm/<sha256>`, `plugin_compiled/<sha256>`), shared by every
//! tenant that uploaded the same bytes; [`Store::migrate_plugins`] moves it
//! to its owners' files.

pub mod code;
pub mod etcd_storage;
pub mod records;
pub mod sled_storage;
pub mod usage;

use code::{CodeKind, CodeOwner, PluginCode};
use records::{
    AuditRecord, KeyRecord, Meta, ModelRecord, PluginRecord, PluginStateRecord, TenantRecord,
    UsageRecord, Versioned, FORMAT_VERSION, FORMAT_VERSION_READ_MIN,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;
use std::sync::Mutex;

/// Most audit records kept by default; the oldest go first.
pub const AUDIT_RECORDS_MAX: u64 = 1_000_000;
/// Most refusal records kept per tenant by default; its oldest go first.
pub const AUDIT_REFUSALS_PER_TENANT_MAX: u64 = 10_000;
/// The actions of refusal records (capped per tenant).
pub const REFUSAL_ACTIONS: [&str; 2] = ["request.refused", "request.refused_summary"];
/// Most records one scan returns.
pub const SCAN_RECORDS_MAX: usize = 10_000;

/// Why the store could not do something. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be opened (the message names the path and cause).
    #[error("cannot open the store at {path}: {cause}")]
    Open {
        /// The store's folder.
        path: String,
        /// What went wrong.
        cause: String,
    },
    /// Reading or writing failed.
    #[error("store i/o: {0}")]
    Io(String),
    /// A record of a format this build does not read.
    #[error("store record {key} has format version {version}; this build reads versions {FORMAT_VERSION_READ_MIN} to {FORMAT_VERSION}")]
    Version {
        /// The record's key.
        key: String,
        /// Its version.
        version: u32,
    },
    /// A record that does not parse.
    #[error("store record {key} is unreadable: {cause}")]
    Corrupt {
        /// The record's key.
        key: String,
        /// The parser's message.
        cause: String,
    },
    /// What the change was based on changed meanwhile (another server wrote
    /// the shared store): read again and retry.
    #[error("the store changed meanwhile (another server wrote it); read it again and retry")]
    Conflict,
    /// A shared store that cannot be reached now (the message names it).
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
}

/// One write of an atomic batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    /// Sets `key` to `value`.
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// Removes `key` (nothing if absent).
    Delete {
        /// The key.
        key: Vec<u8>,
    },
}

impl Write {
    /// Bytes of its key and value.
    pub fn bytes(&self) -> usize {
        match self {
            Write::Put { key, value } => key.len() + value.len(),
            Write::Delete { key } => key.len(),
        }
    }
}

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// Ordered byte keys and values: what the store needs from a storage engine.
pub trait Storage: Send + Sync {
    /// The value of `key`.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Up to `limit` entries whose keys start with `prefix` and sort after
    /// `after` (all of them when None), in key order.
    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError>;
    /// The entry with the greatest key starting with `prefix`.
    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError>;
    /// Applies every write atomically if every key of `expect` holds what it
    /// says (None: absent); [`StoreError::Conflict`] and nothing written
    /// otherwise. Durable (on disk, or on a quorum of a shared store's
    /// members) when it returns Ok.
    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError>;
    /// Applies every write atomically and durably.
    fn commit(&self, writes: Vec<Write>) -> Result<(), StoreError> {
        self.commit_if(&[], writes)
    }
    /// Most writes one commit may hold.
    fn writes_max(&self) -> usize {
        usize::MAX
    }
    /// Most bytes (keys and values) one commit may hold.
    fn commit_bytes_max(&self) -> usize {
        usize::MAX
    }
    /// Whether other processes write this storage too: then audit sequence
    /// numbers are handed out by the storage, not by this process.
    fn shared(&self) -> bool {
        false
    }
    /// For a shared storage, what other processes did: a receiver that
    /// changes whenever `key` may have changed, or the connection to the
    /// storage was lost or regained. None where only this process writes.
    fn watch(&self, _key: &[u8]) -> Option<tokio::sync::watch::Receiver<Watched>> {
        None
    }
    /// On a shared storage, keeps `key` holding the latest value sent on
    /// `value` for as long as this process lives and answers (an etcd
    /// lease): gone soon after it stops. Nothing where only this process
    /// reads.
    fn announce(&self, _key: &[u8], _value: tokio::sync::watch::Receiver<Vec<u8>>) {}
}

/// What a conditional commit expects a key to hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The key.
    pub key: Vec<u8>,
    /// Its value; None: absent.
    pub value: Option<Vec<u8>>,
}

/// The state of a shared storage's watch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Watched {
    /// Counts the times the watched key may have changed (reconnects included).
    pub changes: u64,
    /// Whether the storage answers now.
    pub connected: bool,
}

/// Key of `prefix` followed by big-endian `id`.
fn key_u32(prefix: &str, id: u32) -> Vec<u8> {
    [prefix.as_bytes(), &id.to_be_bytes()].concat()
}

/// The key of a tenant record.
fn tenant_key(id: u32) -> Vec<u8> {
    key_u32("tenant/", id)
}

fn tenant_name_key(name: &str) -> Vec<u8> {
    format!("tenant_name/{name}").into_bytes()
}

fn model_key(id: &str) -> Vec<u8> {
    format!("model/{id}").into_bytes()
}

fn key_record_key(key_id: &str) -> Vec<u8> {
    format!("key/{key_id}").into_bytes()
}

fn plugin_prefix(tenant: u32) -> Vec<u8> {
    [key_u32("plugin/", tenant).as_slice(), b"/"].concat()
}

fn plugin_key(tenant: u32, name: &str) -> Vec<u8> {
    [plugin_prefix(tenant).as_slice(), name.as_bytes()].concat()
}

/// On a shared store, each plugin version's component, committed with the
/// record that names it ([`Batch::put_plugin_code`]).
const CODE_PREFIX: &[u8] = b"code/";

fn code_key(owner: CodeOwner) -> Vec<u8> {
    [CODE_PREFIX, owner.stem().as_bytes()].concat()
}

/// Format 2's plugin code, keyed by digest (read only to migrate it).
const LEGACY_WASM_PREFIX: &[u8] = b"plugin_wasm/";
const LEGACY_COMPILED_PREFIX: &[u8] = b"plugin_compiled/";

fn plugin_state_prefix(tenant: u32, plugin: &str) -> Vec<u8> {
    [
        key_u32("pstate/", tenant).as_slice(),
        b"/",
        plugin.as_bytes(),
        b"/",
    ]
    .concat()
}

fn plugin_state_key(tenant: u32, plugin: &str, key: &str) -> Vec<u8> {
    [
        plugin_state_prefix(tenant, plugin).as_slice(),
        key.as_bytes(),
    ]
    .concat()
}

fn usage_prefix(tenant: u32) -> Vec<u8> {
    [key_u32("usage/", tenant).as_slice(), b"/"].concat()
}

fn usage_key(tenant: u32, minute: u64) -> Vec<u8> {
    [usage_prefix(tenant).as_slice(), &minute.to_be_bytes()].concat()
}

const AUDIT_PREFIX: &[u8] = b"audit/";

fn audit_key(seq: u64) -> Vec<u8> {
    [AUDIT_PREFIX, &seq.to_be_bytes()].concat()
}

fn audit_refused_prefix(tenant: u32) -> Vec<u8> {
    [key_u32("audit_refused/", tenant).as_slice(), b"/"].concat()
}

/// The tenant a refusal record counts against (`detail.tenant_id`), if it is one.
fn refusal_tenant(record: &AuditRecord) -> Option<u32> {
    if !REFUSAL_ACTIONS.contains(&record.action.as_str()) {
        return None;
    }
    record
        .detail
        .get("tenant_id")
        .and_then(serde_json::Value::as_u64)
        .and_then(|id| u32::try_from(id).ok())
}

const META_FORMAT: &[u8] = b"meta/format";
const META_TENANT_ID_NEXT: &[u8] = b"meta/tenant_id_next";
const META_ADMIN_TOKEN: &[u8] = b"meta/admin_token";
const META_PLUGIN_ID_NEXT: &[u8] = b"meta/plugin_id_next";
/// The control-plane fence: bumped by every control change.
pub const META_CONTROL: &[u8] = b"meta/control";
const META_AUDIT_NEXT: &[u8] = b"meta/audit_next";
/// Live servers' announcements (shared storage only, under leases).
const SERVERS_PREFIX: &str = "servers/";
/// Times a commit on shared storage retries when only the audit sequence
/// moved under it (another server's audit records).
const AUDIT_RETRIES: u32 = 32;

fn printable(key: &[u8]) -> String {
    key.iter()
        .map(|&b| {
            if b.is_ascii_graphic() {
                (b as char).to_string()
            } else {
                format!("\\x{b:02x}")
            }
        })
        .collect()
}

/// A record in its version envelope, as the store writes it.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    // Records are plain structs of strings, numbers and maps: serializing
    // them cannot fail.
    serde_json::to_vec(&Versioned {
        v: FORMAT_VERSION,
        record,
    })
    .expect("records serialize")
}

fn decode<T: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, StoreError> {
    let probe: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
            key: printable(key),
            cause: e.to_string(),
        })?;
    let version = probe.get("v").and_then(serde_json::Value::as_u64);
    let readable = u64::from(FORMAT_VERSION_READ_MIN)..=u64::from(FORMAT_VERSION);
    if !version.is_some_and(|v| readable.contains(&v)) {
        return Err(StoreError::Version {
            key: printable(key),
            version: version.map_or(0, |v| v.min(u64::from(u32::MAX)) as u32),
        });
    }
    let versioned: Versioned<T> =
        serde_json::from_value(probe).map_err(|e| StoreError::Corrupt {
            key: printable(key),
            cause: e.to_string(),
        })?;
    Ok(versioned.record)
}

/// A change to commit: record writes and the audit records describing them.
#[derive(Default)]
#[must_use = "a batch does nothing until committed"]
pub struct Batch {
    writes: Vec<Write>,
    audit: Vec<AuditRecord>,
    /// What the change was based on ([`Batch::fenced`]).
    expect: Vec<Expect>,
}

/// The control-plane fence as a change read it ([`Store::fence`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    seen: Option<Vec<u8>>,
    count: u64,
}

impl Fence {
    /// Control changes committed so far (as read).
    pub fn count(&self) -> u64 {
        self.count
    }
}

impl Batch {
    /// Commits only if no control change landed since `fence` was read, and
    /// counts this one.
    pub fn fenced(&mut self, fence: &Fence) -> &mut Self {
        self.expect.push(Expect {
            key: META_CONTROL.to_vec(),
            value: fence.seen.clone(),
        });
        self.put(META_CONTROL.to_vec(), &(fence.count + 1))
    }

    fn put<T: Serialize>(&mut self, key: Vec<u8>, record: &T) -> &mut Self {
        self.writes.push(Write::Put {
            key,
            value: encode(record),
        });
        self
    }

    fn delete(&mut self, key: Vec<u8>) -> &mut Self {
        self.writes.push(Write::Delete { key });
        self
    }

    /// Creates or replaces a tenant (and claims its name).
    pub fn put_tenant(&mut self, tenant: &TenantRecord) -> &mut Self {
        self.put(tenant_name_key(&tenant.name), &tenant.id);
        self.put(tenant_key(tenant.id), tenant)
    }

    /// Removes a tenant and frees its name (its keys and plugins are the
    /// caller's to remove in the same batch).
    pub fn delete_tenant(&mut self, tenant: &TenantRecord) -> &mut Self {
        self.delete(tenant_name_key(&tenant.name));
        self.delete(tenant_key(tenant.id))
    }

    /// Creates or replaces an admin-added model.
    pub fn put_model(&mut self, model: &ModelRecord) -> &mut Self {
        self.put(model_key(&model.spec.id), model)
    }

    /// Removes an admin-added model.
    pub fn delete_model(&mut self, id: &str) -> &mut Self {
        self.delete(model_key(id))
    }

    /// Sets the next tenant id.
    pub fn put_tenant_id_next(&mut self, next: u32) -> &mut Self {
        self.put(META_TENANT_ID_NEXT.to_vec(), &next)
    }

    /// Creates or replaces a key record.
    pub fn put_key(&mut self, key: &KeyRecord) -> &mut Self {
        self.put(key_record_key(&key.id), key)
    }

    /// Removes a key record.
    pub fn delete_key(&mut self, key_id: &str) -> &mut Self {
        self.delete(key_record_key(key_id))
    }

    /// Creates or replaces a plugin's metadata.
    pub fn put_plugin(&mut self, plugin: &PluginRecord) -> &mut Self {
        self.put(plugin_key(plugin.tenant, &plugin.name), plugin)
    }

    /// Removes a plugin's metadata.
    pub fn delete_plugin(&mut self, tenant: u32, name: &str) -> &mut Self {
        self.delete(plugin_key(tenant, name))
    }

    /// Stores a plugin version's component in the store itself: a shared
    /// store's servers each load it from there, and it lands in the same
    /// commit as the record naming it (a local store keeps it in files,
    /// [`code`]).
    pub fn put_plugin_code(&mut self, owner: CodeOwner, wasm: &[u8]) -> &mut Self {
        self.writes.push(Write::Put {
            key: code_key(owner),
            value: wasm.to_vec(),
        });
        self
    }

    /// Removes a plugin version's component from the store.
    pub fn delete_plugin_code(&mut self, owner: CodeOwner) -> &mut Self {
        self.delete(code_key(owner))
    }

    /// Sets the next plugin id.
    pub fn put_plugin_id_next(&mut self, next: u64) -> &mut Self {
        self.put(META_PLUGIN_ID_NEXT.to_vec(), &next)
    }

    /// Removes format 2's copy of the code with digest `sha256_hex`.
    fn delete_legacy_code(&mut self, sha256_hex: &str) -> &mut Self {
        self.delete([LEGACY_WASM_PREFIX, sha256_hex.as_bytes()].concat())
            .delete([LEGACY_COMPILED_PREFIX, sha256_hex.as_bytes()].concat())
    }

    /// Sets an entry of a plugin's own state.
    pub fn put_plugin_state(
        &mut self,
        tenant: u32,
        plugin: &str,
        key: &str,
        record: &PluginStateRecord,
    ) -> &mut Self {
        self.put(plugin_state_key(tenant, plugin, key), record)
    }

    /// Removes an entry of a plugin's own state.
    pub fn delete_plugin_state(&mut self, tenant: u32, plugin: &str, key: &str) -> &mut Self {
        self.delete(plugin_state_key(tenant, plugin, key))
    }

    /// Sets one minute's usage counters of a tenant.
    pub fn put_usage(&mut self, tenant: u32, minute: u64, usage: &UsageRecord) -> &mut Self {
        self.put(usage_key(tenant, minute), usage)
    }

    /// Records the store's format (first start).
    pub fn put_meta(&mut self, meta: &Meta) -> &mut Self {
        self.put(META_FORMAT.to_vec(), meta)
    }

    /// Sets the digest of a generated admin token.
    pub fn put_admin_token(&mut self, sha256_hex: &str) -> &mut Self {
        self.put(META_ADMIN_TOKEN.to_vec(), &sha256_hex)
    }

    /// Appends an audit record (its sequence number is set at commit).
    pub fn audit(&mut self, record: AuditRecord) -> &mut Self {
        self.audit.push(record);
        self
    }

    /// Whether nothing would be written.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.audit.is_empty()
    }
}

/// The typed store.
pub struct Store {
    storage: Box<dyn Storage>,
    path: String,
    /// Plugin code, beside the database (none for a store over storage
    /// with no folder).
    code: Option<PluginCode>,
    /// Most audit records kept ([`AUDIT_RECORDS_MAX`] unless changed).
    audit_max: u64,
    /// Most refusal records kept per tenant.
    refusals_per_tenant_max: u64,
    /// Serializes commits, so audit sequence numbers follow commit order.
    audit: Mutex<AuditCursor>,
}

struct AuditCursor {
    /// The next sequence number.
    next: u64,
    /// The oldest kept.
    oldest: u64,
    /// Refusal records kept, by tenant (counted from the index when first needed).
    refusals: std::collections::HashMap<u32, u64>,
}

impl Store {
    /// Opens (or creates) the sled store in `dir`.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let storage = sled_storage::SledStorage::open(dir)?;
        let mut store = Store::with_storage(Box::new(storage), dir.display().to_string())?;
        store.code = Some(PluginCode::open(dir)?);
        Ok(store)
    }

    /// Opens the shared store on etcd; plugin code stays in `dir`, this
    /// server's own folder.
    pub fn open_etcd(options: &etcd_storage::EtcdOptions, dir: &Path) -> Result<Store, StoreError> {
        let storage = etcd_storage::EtcdStorage::connect(options)?;
        let where_ = format!("etcd {}", options.endpoints.join(","));
        let mut store = Store::with_storage(Box::new(storage), where_)?;
        store.code = Some(PluginCode::open(dir)?);
        Ok(store)
    }

    /// A store over any storage engine.
    pub fn with_storage(storage: Box<dyn Storage>, path: String) -> Result<Store, StoreError> {
        let next = match storage.last(AUDIT_PREFIX)? {
            Some((key, _)) => seq_of(&key)? + 1,
            None => 1,
        };
        let oldest = match storage.scan(AUDIT_PREFIX, None, 1)?.first() {
            Some((key, _)) => seq_of(key)?,
            None => next,
        };
        let store = Store {
            storage,
            path,
            code: None,
            audit_max: AUDIT_RECORDS_MAX,
            refusals_per_tenant_max: AUDIT_REFUSALS_PER_TENANT_MAX,
            audit: Mutex::new(AuditCursor {
                next,
                oldest,
                refusals: std::collections::HashMap::new(),
            }),
        };
        // A store of another format fails here, before anything reads it.
        store.meta()?;
        Ok(store)
    }

    /// Keeps at most `audit_max` audit records (at least one).
    pub fn with_audit_max(mut self, audit_max: u64) -> Store {
        self.audit_max = audit_max.max(1);
        self
    }

    /// Keeps at most `max` refusal records per tenant (at least one).
    pub fn with_refusals_per_tenant_max(mut self, max: u64) -> Store {
        self.refusals_per_tenant_max = max.max(1);
        self
    }

    /// Deletes every audit record older than `cutoff_ms` (the log is in
    /// time order: it stops at the first newer one); how many.
    pub fn purge_audit_before(&self, cutoff_ms: u64) -> Result<u64, StoreError> {
        let mut cursor = self.audit.lock().unwrap_or_else(|p| p.into_inner());
        let mut purged = 0;
        // Each old record takes up to two deletes (its refusal index too).
        let page_max = (self.storage.writes_max() / 2).clamp(1, 1000);
        loop {
            let page = self.scan::<AuditRecord>(AUDIT_PREFIX, None, page_max)?;
            let old: Vec<&AuditRecord> = page
                .iter()
                .map(|(_, r)| r)
                .take_while(|r| r.at_ms < cutoff_ms)
                .collect();
            if old.is_empty() {
                return Ok(purged);
            }
            let mut writes = Vec::new();
            for record in &old {
                writes.push(Write::Delete {
                    key: audit_key(record.seq),
                });
                if let Some(tenant) = refusal_tenant(record) {
                    writes.push(Write::Delete {
                        key: [
                            audit_refused_prefix(tenant),
                            record.seq.to_be_bytes().to_vec(),
                        ]
                        .concat(),
                    });
                    if let Some(count) = cursor.refusals.get_mut(&tenant) {
                        *count = count.saturating_sub(1);
                    }
                }
            }
            let last = old.last().map_or(cursor.oldest, |r| r.seq);
            let done = old.len() < page.len();
            purged += old.len() as u64;
            self.storage.commit(writes)?;
            cursor.oldest = cursor.oldest.max(last + 1);
            if done {
                return Ok(purged);
            }
        }
    }

    /// Writes that keep `tenant`'s refusal records within their cap once
    /// `adding` more are committed: the index entries and records of its
    /// oldest.
    fn trim_refusals(
        &self,
        cursor: &mut AuditCursor,
        tenant: u32,
        adding: u64,
    ) -> Result<Vec<Write>, StoreError> {
        let prefix = audit_refused_prefix(tenant);
        let count = match cursor.refusals.get(&tenant) {
            Some(&count) => count,
            None => self.keys_after(&prefix)?.len() as u64,
        };
        let over = (count + adding).saturating_sub(self.refusals_per_tenant_max);
        let mut writes = Vec::new();
        if over > 0 {
            for (key, _) in self.storage.scan(&prefix, None, over as usize)? {
                let seq = u64_suffix(&key)?;
                writes.push(Write::Delete { key });
                writes.push(Write::Delete {
                    key: audit_key(seq),
                });
            }
        }
        let trimmed = writes.len() as u64 / 2;
        cursor.refusals.insert(tenant, count + adding - trimmed);
        Ok(writes)
    }

    /// Where the store lives (for messages).
    pub fn path(&self) -> &str {
        &self.path
    }

    fn get<T: DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StoreError> {
        match self.storage.get(key)? {
            Some(bytes) => decode(key, &bytes).map(Some),
            None => Ok(None),
        }
    }

    fn scan<T: DeserializeOwned>(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, T)>, StoreError> {
        self.storage
            .scan(prefix, after, limit)?
            .into_iter()
            .map(|(key, bytes)| decode(&key, &bytes).map(|record| (key, record)))
            .collect()
    }

    /// The format record; None in a store nothing was written to yet.
    pub fn meta(&self) -> Result<Option<Meta>, StoreError> {
        self.get(META_FORMAT)
    }

    /// The control-plane fence now: read it before what a change is based
    /// on, and commit the change [`Batch::fenced`] with it.
    pub fn fence(&self) -> Result<Fence, StoreError> {
        let seen = self.storage.get(META_CONTROL)?;
        let count = match &seen {
            Some(bytes) => decode(META_CONTROL, bytes)?,
            None => 0,
        };
        Ok(Fence { seen, count })
    }

    /// How many records (usage minutes or audit records) one commit may
    /// carry within the storage's transaction limit: each may take up to
    /// four writes (a record, its refusal index, two trims), plus the audit
    /// counter.
    pub fn records_per_commit(&self) -> usize {
        (self.storage.writes_max().saturating_sub(1) / 4).clamp(1, 1 << 20)
    }

    /// Whether other servers share this store.
    pub fn shared(&self) -> bool {
        self.storage.shared()
    }

    /// For a shared store, a receiver that changes when another server may
    /// have changed the control plane (or the store was lost or regained).
    pub fn watch_control(&self) -> Option<tokio::sync::watch::Receiver<Watched>> {
        self.storage.watch(META_CONTROL)
    }

    /// Keeps this server's announcement (`servers/<name>`) holding the
    /// latest value of `value` while it lives ([`Storage::announce`]).
    pub fn announce_server(&self, name: &str, value: tokio::sync::watch::Receiver<Vec<u8>>) {
        self.storage
            .announce(format!("{SERVERS_PREFIX}{name}").as_bytes(), value);
    }

    /// The announcements of the live servers sharing this store (none for a
    /// store only this server uses), by name; one that does not parse is
    /// skipped with a log line naming its key.
    pub fn servers<T: DeserializeOwned>(&self) -> Result<Vec<(String, T)>, StoreError> {
        let prefix = SERVERS_PREFIX.as_bytes();
        let mut out = Vec::new();
        for (key, value) in self.storage.scan(prefix, None, SCAN_RECORDS_MAX)? {
            let name = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
            match decode(&key, &value) {
                Ok(record) => out.push((name, record)),
                Err(error) => {
                    tracing::warn!(%error, "a server's announcement is unreadable; skipped")
                }
            }
        }
        Ok(out)
    }

    /// The next tenant id to hand out.
    pub fn tenant_id_next(&self) -> Result<u32, StoreError> {
        Ok(self.get(META_TENANT_ID_NEXT)?.unwrap_or(1))
    }

    /// The digest of a generated admin token, if one was generated.
    pub fn admin_token(&self) -> Result<Option<String>, StoreError> {
        self.get(META_ADMIN_TOKEN)
    }

    /// Every record under `prefix`, page by page: never cut at a page's
    /// size (a key record missed at start would let a revoked environment
    /// key come back). Each record must be its key's (`key_of` is where
    /// the store writes it): one under another's key — a tenant's plugin
    /// record naming another tenant, found by fuzzing (`fuzz/regressions/
    /// store_records/`) — is refused as corrupt, never read as whichever
    /// of the two a caller happens to look at.
    fn scan_all<T: DeserializeOwned>(
        &self,
        prefix: &[u8],
        key_of: fn(&T) -> Vec<u8>,
    ) -> Result<Vec<T>, StoreError> {
        let mut out = Vec::new();
        self.scan_each(prefix, key_of, |_, record| {
            out.push(record?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Like [`Store::scan_all`], but a record that is unreadable or not its
    /// key's (another writer's, or damaged) is skipped with a log line naming
    /// its key, and its key is returned beside the records: for following a
    /// shared store, where one bad entry must not stop every other change.
    fn scan_all_skipping<T: DeserializeOwned>(
        &self,
        prefix: &[u8],
        key_of: fn(&T) -> Vec<u8>,
    ) -> Result<(Vec<T>, Vec<Vec<u8>>), StoreError> {
        let (mut out, mut skipped) = (Vec::new(), Vec::new());
        self.scan_each(prefix, key_of, |key, record| {
            match record {
                Ok(record) => out.push(record),
                Err(error) => {
                    tracing::error!(%error, "a store record is refused and skipped");
                    metrics::counter!("bulkhead_store_records_skipped_total").increment(1);
                    skipped.push(key);
                }
            }
            Ok(())
        })?;
        Ok((out, skipped))
    }

    /// Hands `visit` every entry under `prefix`, page by page, as its key and
    /// its record, or the error naming the key when it is unreadable or not
    /// its key's (`key_of`); an error `visit` returns ends the scan.
    fn scan_each<T: DeserializeOwned>(
        &self,
        prefix: &[u8],
        key_of: fn(&T) -> Vec<u8>,
        mut visit: impl FnMut(Vec<u8>, Result<T, StoreError>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = self
                .storage
                .scan(prefix, after.as_deref(), SCAN_RECORDS_MAX)?;
            let Some((last, _)) = page.last() else {
                return Ok(());
            };
            after = Some(last.clone());
            for (key, value) in page {
                let record = decode::<T>(&key, &value).and_then(|record| {
                    let own = key_of(&record);
                    match own == key {
                        true => Ok(record),
                        false => Err(StoreError::Corrupt {
                            key: printable(&key),
                            cause: format!("the record is {}'s", printable(&own)),
                        }),
                    }
                });
                visit(key, record)?;
            }
        }
    }

    /// Every readable tenant, and the ids of those whose records are not
    /// (skipped, logged): what a server following a shared store applies.
    pub fn tenants_skipping(&self) -> Result<(Vec<TenantRecord>, Vec<u32>), StoreError> {
        let (tenants, skipped) =
            self.scan_all_skipping(b"tenant/", |t: &TenantRecord| tenant_key(t.id))?;
        let ids = skipped
            .iter()
            .filter_map(|key| <[u8; 4]>::try_from(key.strip_prefix(b"tenant/")?).ok())
            .map(u32::from_be_bytes)
            .collect();
        Ok((tenants, ids))
    }

    /// Every readable key record; unreadable ones are skipped and logged
    /// (a key whose record cannot be read does not authenticate).
    pub fn keys_skipping(&self) -> Result<Vec<KeyRecord>, StoreError> {
        Ok(self
            .scan_all_skipping(b"key/", |k: &KeyRecord| key_record_key(&k.id))?
            .0)
    }

    /// Every tenant, in id order.
    pub fn tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        self.scan_all(b"tenant/", |t: &TenantRecord| tenant_key(t.id))
    }

    /// Every admin-added model, in id order.
    pub fn models(&self) -> Result<Vec<ModelRecord>, StoreError> {
        self.scan_all(b"model/", |m: &ModelRecord| model_key(&m.spec.id))
    }

    /// Every key record (revoked ones too), however many.
    pub fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.scan_all(b"key/", |k: &KeyRecord| key_record_key(&k.id))
    }

    /// A tenant's plugins, by name.
    pub fn plugins(&self, tenant: u32) -> Result<Vec<PluginRecord>, StoreError> {
        self.scan_all(&plugin_prefix(tenant), |p: &PluginRecord| {
            plugin_key(p.tenant, &p.name)
        })
    }

    /// Every tenant's plugins, by tenant and name, in one scan.
    pub fn all_plugins(&self) -> Result<Vec<PluginRecord>, StoreError> {
        self.scan_all(b"plugin/", |p: &PluginRecord| plugin_key(p.tenant, &p.name))
    }

    /// The next plugin id to hand out.
    pub fn plugin_id_next(&self) -> Result<u64, StoreError> {
        Ok(self.get(META_PLUGIN_ID_NEXT)?.unwrap_or(1))
    }

    /// A plugin version's component kept in the store
    /// ([`Batch::put_plugin_code`]).
    pub fn plugin_code(&self, owner: CodeOwner) -> Result<Option<Vec<u8>>, StoreError> {
        self.storage.get(&code_key(owner))
    }

    /// Most bytes one commit may hold (keys and values).
    pub fn commit_bytes_max(&self) -> usize {
        self.storage.commit_bytes_max()
    }

    /// The plugin code folder.
    pub fn code(&self) -> Result<&PluginCode, StoreError> {
        self.code.as_ref().ok_or_else(|| {
            StoreError::Io(format!(
                "the store at {} has no folder for plugin code",
                self.path
            ))
        })
    }

    /// Moves format 2's plugins to format 3 (a no-op on a store already
    /// there): every plugin record without an id gets one; its code, kept
    /// by digest and shared by whoever uploaded the same bytes, gets files
    /// of its owner's ([`code`]); its state moves from its name to its
    /// identity, and state kept under an operator plugin's name (in
    /// `operator_names`) to that plugin's. Then the shared copies go. A
    /// record whose code is gone keeps its id and no files: it fails closed
    /// at load. One commit: all of it or nothing.
    pub fn migrate_plugins(&self, operator_names: &[String]) -> Result<u32, StoreError> {
        let mut batch = Batch::default();
        let mut next = self.plugin_id_next()?;
        let mut migrated = 0;
        for tenant in self.tenants()? {
            let mut moved_names = Vec::new();
            for mut plugin in self.plugins(tenant.id)? {
                if plugin.id != 0 {
                    continue;
                }
                plugin.id = next;
                next += 1;
                migrated += 1;
                let owner = CodeOwner {
                    tenant: tenant.id,
                    plugin: plugin.id,
                    version: plugin.version,
                };
                let digest = plugin.sha256.as_bytes();
                for (prefix, kind) in [
                    (LEGACY_WASM_PREFIX, CodeKind::Wasm),
                    (LEGACY_COMPILED_PREFIX, CodeKind::Sealed),
                ] {
                    if let Some(bytes) = self.storage.get(&[prefix, digest].concat())? {
                        self.code()?.put(owner, kind, &bytes)?;
                    }
                }
                self.move_state(
                    &mut batch,
                    tenant.id,
                    &plugin.name,
                    &format!("#{}", plugin.id),
                )?;
                moved_names.push(plugin.name.clone());
                batch.put_plugin(&plugin);
            }
            for name in operator_names.iter().filter(|n| !moved_names.contains(n)) {
                self.move_state(&mut batch, tenant.id, name, &format!("@{name}"))?;
            }
        }
        for prefix in [LEGACY_WASM_PREFIX, LEGACY_COMPILED_PREFIX] {
            for digest in self.keys_after(prefix)? {
                batch.delete_legacy_code(&digest);
            }
        }
        if batch.is_empty() {
            return Ok(0);
        }
        batch.put_plugin_id_next(next);
        self.commit(batch)?;
        Ok(migrated)
    }

    /// Moves every state entry of (`tenant`, `from`) to (`tenant`, `to`).
    fn move_state(
        &self,
        batch: &mut Batch,
        tenant: u32,
        from: &str,
        to: &str,
    ) -> Result<(), StoreError> {
        let prefix = plugin_state_prefix(tenant, from);
        let mut after: Option<Vec<u8>> = None;
        loop {
            let entries = self
                .storage
                .scan(&prefix, after.as_deref(), SCAN_RECORDS_MAX)?;
            let Some((last, _)) = entries.last() else {
                return Ok(());
            };
            after = Some(last.clone());
            for (key, value) in entries {
                let record: PluginStateRecord = decode(&key, &value)?;
                let k = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
                batch.delete(key);
                batch.put_plugin_state(tenant, to, &k, &record);
            }
        }
    }

    /// The rest of every key under `prefix`, all of them (scanned page by page).
    fn keys_after(&self, prefix: &[u8]) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let entries = self
                .storage
                .scan(prefix, after.as_deref(), SCAN_RECORDS_MAX)?;
            let Some((last, _)) = entries.last() else {
                return Ok(out);
            };
            after = Some(last.clone());
            out.extend(
                entries
                    .iter()
                    .map(|(key, _)| String::from_utf8_lossy(&key[prefix.len()..]).into_owned()),
            );
        }
    }

    /// An entry of a plugin's own state.
    pub fn plugin_state(
        &self,
        tenant: u32,
        plugin: &str,
        key: &str,
    ) -> Result<Option<PluginStateRecord>, StoreError> {
        self.get(&plugin_state_key(tenant, plugin, key))
    }

    /// Up to `limit` entries of a plugin's own state, by key.
    pub fn plugin_state_entries(
        &self,
        tenant: u32,
        plugin: &str,
        limit: usize,
    ) -> Result<Vec<(String, PluginStateRecord)>, StoreError> {
        let prefix = plugin_state_prefix(tenant, plugin);
        Ok(self
            .scan::<PluginStateRecord>(&prefix, None, limit)?
            .into_iter()
            .map(|(key, record)| {
                (
                    String::from_utf8_lossy(&key[prefix.len()..]).into_owned(),
                    record,
                )
            })
            .collect())
    }

    /// A tenant's usage, minute by minute, for minutes in `from..to`.
    pub fn usage(
        &self,
        tenant: u32,
        from_minute: u64,
        to_minute: u64,
    ) -> Result<Vec<(u64, UsageRecord)>, StoreError> {
        let prefix = usage_prefix(tenant);
        let after = from_minute
            .checked_sub(1)
            .map(|before| usage_key(tenant, before));
        let mut out = Vec::new();
        let mut cursor = after;
        loop {
            let page = self.scan::<UsageRecord>(&prefix, cursor.as_deref(), 1024)?;
            let Some((last_key, _)) = page.last() else {
                break;
            };
            cursor = Some(last_key.clone());
            for (key, record) in page {
                let minute = u64_suffix(&key)?;
                if minute >= to_minute {
                    return Ok(out);
                }
                out.push((minute, record));
            }
        }
        Ok(out)
    }

    /// Adds `delta` to one minute's usage counters of a tenant, in `batch`:
    /// its commit is refused ([`StoreError::Conflict`]) if another server
    /// changed that minute meanwhile, so neither server's counts are lost.
    pub fn add_usage(
        &self,
        batch: &mut Batch,
        tenant: u32,
        minute: u64,
        delta: &UsageRecord,
    ) -> Result<(), StoreError> {
        let key = usage_key(tenant, minute);
        let seen = self.storage.get(&key)?;
        let mut total: UsageRecord = match &seen {
            Some(bytes) => decode(&key, bytes)?,
            None => UsageRecord::default(),
        };
        total.add(delta);
        batch.expect.push(Expect {
            key: key.clone(),
            value: seen,
        });
        batch.put(key, &total);
        Ok(())
    }

    /// One minute's usage counters of a tenant (for read-modify-write).
    pub fn usage_minute(&self, tenant: u32, minute: u64) -> Result<UsageRecord, StoreError> {
        Ok(self.get(&usage_key(tenant, minute))?.unwrap_or_default())
    }

    /// Deletes every tenant's usage minutes before `minute` (retention);
    /// returns how many went. Ids are never reused, so every id below the next
    /// one is looked at, deleted tenants' included.
    pub fn purge_usage_before(&self, minute: u64) -> Result<u64, StoreError> {
        let mut purged = 0;
        let page_max = self.storage.writes_max().clamp(1, 1024);
        for tenant in 0..self.tenant_id_next()? {
            let prefix = usage_prefix(tenant);
            loop {
                let page = self.storage.scan(&prefix, None, page_max)?;
                let old: Vec<Write> = page
                    .iter()
                    .take_while(|(key, _)| u64_suffix(key).is_ok_and(|m| m < minute))
                    .map(|(key, _)| Write::Delete { key: key.clone() })
                    .collect();
                if old.is_empty() {
                    break;
                }
                let done = old.len() < page.len() || page.len() < page_max;
                purged += old.len() as u64;
                self.storage.commit(old)?;
                if done {
                    break;
                }
            }
        }
        Ok(purged)
    }

    /// Up to `limit` audit records after sequence number `after`, oldest first.
    pub fn audit(&self, after: u64, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        let after = audit_key(after);
        Ok(self
            .scan(AUDIT_PREFIX, Some(&after), limit.min(SCAN_RECORDS_MAX))?
            .into_iter()
            .map(|(_, record)| record)
            .collect())
    }

    /// Up to `limit` audit records numbered below `before`, newest first (the
    /// log's last page first, as an operator reads it). Windows below
    /// `before` widen until they hold `limit` records or reach the oldest:
    /// records dropped by the caps leave gaps.
    pub fn audit_before(&self, before: u64, limit: usize) -> Result<Vec<AuditRecord>, StoreError> {
        // On a shared store the other servers' records may be newer than
        // any this one wrote.
        let next = match self.storage.shared() {
            true => self.shared_audit_next()?.0,
            false => self.audit.lock().unwrap_or_else(|p| p.into_inner()).next,
        };
        let end = before.min(next);
        let limit = limit.min(SCAN_RECORDS_MAX);
        let mut window = limit as u64 + 1;
        loop {
            let start = end.saturating_sub(window);
            let mut found: Vec<AuditRecord> = self
                .scan(AUDIT_PREFIX, Some(&audit_key(start)), window as usize)?
                .into_iter()
                .map(|(_, record): (_, AuditRecord)| record)
                .filter(|r| r.seq < end)
                .collect();
            let widest = window as usize >= SCAN_RECORDS_MAX;
            if found.len() >= limit || start == 0 || widest {
                found.reverse();
                found.truncate(limit);
                return Ok(found);
            }
            window = (window * 4).min(SCAN_RECORDS_MAX as u64);
        }
    }

    /// Commits `batch` atomically and durably; its audit records get their
    /// sequence numbers here, in commit order. The oldest audit records past
    /// the cap ([`AUDIT_RECORDS_MAX`]), and a tenant's oldest refusal records
    /// past its cap, go in the same batch. A fenced batch whose fence moved
    /// is refused with [`StoreError::Conflict`]; on shared storage, one whose
    /// audit numbers were taken by another server meanwhile is numbered again.
    pub fn commit(&self, batch: Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut cursor = self.audit.lock().unwrap_or_else(|p| p.into_inner());
        let Batch {
            writes: base,
            audit,
            expect,
        } = batch;
        let shared = self.storage.shared() && !audit.is_empty();
        let mut attempt = 0;
        loop {
            let (first, seen) = if shared {
                self.shared_audit_next()?
            } else {
                (cursor.next, None)
            };
            let mut writes = base.clone();
            let mut expected = expect.clone();
            let mut next = first;
            let mut refusals: std::collections::BTreeMap<u32, u64> = Default::default();
            for record in &audit {
                let mut record = record.clone();
                record.seq = next;
                if let Some(tenant) = refusal_tenant(&record) {
                    writes.push(Write::Put {
                        key: [audit_refused_prefix(tenant), next.to_be_bytes().to_vec()].concat(),
                        value: Vec::new(),
                    });
                    *refusals.entry(tenant).or_default() += 1;
                }
                writes.push(Write::Put {
                    key: audit_key(next),
                    value: encode(&record),
                });
                next += 1;
            }
            if shared {
                expected.push(Expect {
                    key: META_AUDIT_NEXT.to_vec(),
                    value: seen,
                });
                writes.push(Write::Put {
                    key: META_AUDIT_NEXT.to_vec(),
                    value: encode(&next),
                });
            }
            let before = cursor.refusals.clone();
            for (&tenant, &adding) in &refusals {
                match self.trim_refusals(&mut cursor, tenant, adding) {
                    Ok(trims) => writes.extend(trims),
                    Err(error) => {
                        cursor.refusals = before;
                        return Err(error);
                    }
                }
            }
            // On shared storage the other servers trim too: a few deletes a
            // commit keep every commit small.
            let room = self.storage.writes_max().saturating_sub(writes.len()) as u64;
            let mut deletes_left = if shared { room.min(64) } else { u64::MAX };
            let mut oldest = cursor.oldest;
            while next - oldest > self.audit_max && deletes_left > 0 {
                writes.push(Write::Delete {
                    key: audit_key(oldest),
                });
                oldest += 1;
                deletes_left -= 1;
            }
            match self.storage.commit_if(&expected, writes) {
                Ok(()) => {
                    cursor.next = next;
                    cursor.oldest = oldest;
                    return Ok(());
                }
                Err(StoreError::Conflict)
                    if shared && attempt < AUDIT_RETRIES && self.holds(&expect)? =>
                {
                    cursor.refusals = before;
                    attempt += 1;
                }
                Err(error) => {
                    cursor.refusals = before;
                    return Err(error);
                }
            }
        }
    }

    /// The next audit sequence number of a shared store and the counter's
    /// value as read (None: never written: after the last record).
    fn shared_audit_next(&self) -> Result<(u64, Option<Vec<u8>>), StoreError> {
        match self.storage.get(META_AUDIT_NEXT)? {
            Some(bytes) => Ok((decode(META_AUDIT_NEXT, &bytes)?, Some(bytes))),
            None => {
                let next = match self.storage.last(AUDIT_PREFIX)? {
                    Some((key, _)) => seq_of(&key)? + 1,
                    None => 1,
                };
                Ok((next, None))
            }
        }
    }

    /// Whether every key of `expect` still holds what it says.
    fn holds(&self, expect: &[Expect]) -> Result<bool, StoreError> {
        for e in expect {
            if self.storage.get(&e.key)? != e.value {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

fn u64_suffix(key: &[u8]) -> Result<u64, StoreError> {
    let tail: [u8; 8] = key
        .len()
        .checked_sub(8)
        .and_then(|at| key[at..].try_into().ok())
        .ok_or_else(|| StoreError::Corrupt {
            key: printable(key),
            cause: "the key does not end in a 64-bit number".into(),
        })?;
    Ok(u64::from_be_bytes(tail))
}

fn seq_of(key: &[u8]) -> Result<u64, StoreError> {
    u64_suffix(key)
}

#[cfg(test)]
mod tests;
