//! The control plane's plugin writes: upload, enable and disable, delete, and
//! loading every tenant's plugins at start, each through the one write path
//! (check → store → apply → audit).
//!
//! Every plugin has one owner: its record (tenant, name, and an id the host
//! gives it), which alone owns its code files (`store::code`), its state and
//! its budgets. An upload is checked and compiled before the write lock is
//! taken — its shape first (functions, code, locals, data), then compiling,
//! one at a time and within `plugins.compile_timeout_ms`, at most
//! `plugins.uploads_per_minute` per tenant — so one tenant's uploads never
//! hold another's writes; the tenant's code (components and compiled forms)
//! is at most `plugins.tenant_code_bytes_max`.
//!
//! On a store shared by many servers (etcd) the component is kept in the
//! store itself, in the commit of the record naming it, so a plugin written
//! through one server is the same plugin, with the same code, on every
//! server: each follows the change ([`Control::reload_plugins`]) and compiles
//! the component for itself. A compiled form is this server's alone (sealed
//! under its own secret) and stays in its own folder.

use super::*;
use crate::policy::{tenant_identity, CompileError};
use crate::store::code::{CodeKind, CodeOwner};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

/// How a plugin is uploaded: its place in the chain and the limits it asks
/// for (query parameters of the upload).
#[derive(Clone, Copy, Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UploadOptions {
    /// Its place in the tenant's chain (lower runs first; default: after the
    /// others, or where its previous version was).
    pub order: Option<u32>,
    /// A lower wall-clock bound per call, milliseconds.
    pub deadline_ms: Option<u64>,
    /// Less fuel per call.
    pub fuel: Option<u64>,
    /// Less linear memory, bytes.
    pub memory_bytes: Option<u64>,
}

impl UploadOptions {
    fn limits(&self) -> PluginLimitsRequest {
        PluginLimitsRequest {
            deadline_ms: self.deadline_ms,
            fuel: self.fuel,
            memory_bytes: self.memory_bytes,
        }
    }
}

/// A plugin's metadata.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct PluginView {
    /// Its place in the chain (lower runs first).
    pub order: u32,
    /// Its name.
    pub name: String,
    /// Uploads so far under this name.
    pub version: u32,
    /// SHA-256 of the component, hex.
    pub sha256: String,
    /// The component's size.
    pub size_bytes: u64,
    /// Whether it runs in the tenant's policy chain.
    pub enabled: bool,
    /// Last uploaded, Unix milliseconds.
    pub uploaded_ms: u64,
    /// Why it is enabled but fails closed (503 `policy_unavailable`), if it
    /// does: its code could not be loaded. Upload it again, or disable or
    /// delete it.
    pub unloadable: Option<String>,
    /// Its faults (fuel, deadline, memory, trap...) on this tenant's requests
    /// within the fault window (`plugins.fault_window_ms`) on this server;
    /// at `plugins.faults_max` it is disabled, and the audit log says so.
    pub faults_recent: u32,
    /// The latest of those faults' kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_fault: Option<String>,
}

impl From<&PluginRecord> for PluginView {
    fn from(p: &PluginRecord) -> PluginView {
        PluginView {
            order: p.order,
            name: p.name.clone(),
            version: p.version,
            sha256: p.sha256.clone(),
            size_bytes: p.size_bytes,
            enabled: p.enabled,
            uploaded_ms: p.uploaded_ms,
            unloadable: None,
            faults_recent: 0,
            last_fault: None,
        }
    }
}

/// Uploads per tenant: a bucket of `per_minute` that refills over a minute.
#[derive(Default)]
pub struct UploadRate {
    buckets: Mutex<HashMap<u32, (f64, Instant)>>,
}

impl UploadRate {
    /// Takes one upload of `tenant`'s, or says in how many seconds one is back.
    fn take(&self, tenant: u32, per_minute: u32, now: Instant) -> Result<(), u32> {
        let per_minute = f64::from(per_minute.max(1));
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (left, at) = buckets.entry(tenant).or_insert((per_minute, now));
        let refilled = now.duration_since(*at).as_secs_f64() * per_minute / 60.0;
        *left = (*left + refilled).min(per_minute);
        *at = now;
        if *left >= 1.0 {
            *left -= 1.0;
            return Ok(());
        }
        Err(((1.0 - *left) * 60.0 / per_minute).ceil().max(1.0) as u32)
    }
}

/// Bytes a plugin upload's commit holds besides the component (its record,
/// audit record and fence), on a store that bounds a commit's size.
const UPLOAD_COMMIT_OTHER_BYTES: usize = 8 << 10;

/// The owner of `plugin`'s current code files.
pub(super) fn owner_of(plugin: &PluginRecord) -> CodeOwner {
    CodeOwner {
        tenant: plugin.tenant,
        plugin: plugin.id,
        version: plugin.version,
    }
}

fn compile_error(error: CompileError) -> ControlError {
    match error {
        CompileError::Invalid(reason) => invalid("body", reason),
        CompileError::Busy => {
            ControlError::Busy("the plugin compiler is busy; retry in a few seconds".into())
        }
    }
}

impl Control {
    /// A tenant's plugins.
    pub fn plugins(&self, tenant: TenantRef<'_>) -> Result<Vec<PluginView>, ControlError> {
        let record = self.tenant_record(tenant)?;
        Ok(blocking(|| self.store.plugins(record.id))?
            .iter()
            .map(|p| {
                let mut view = PluginView::from(p);
                view.unloadable = self.policy.unloadable(TenantId(p.tenant), &p.name);
                let (faults, last) = self.policy.recent_faults(TenantId(p.tenant), p.id);
                view.faults_recent = faults;
                view.last_fault = last.map(str::to_string);
                view
            })
            .collect())
    }

    /// One plugin of a tenant.
    pub fn plugin(&self, tenant: TenantRef<'_>, name: &str) -> Result<PluginView, ControlError> {
        self.plugins(tenant)?
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| ControlError::NotFound {
                what: "plugin",
                name: name.into(),
            })
    }

    /// Stores a plugin component for `tenant` under `name` (a new version when
    /// the name exists) and swaps it into the tenant's chain for the next
    /// request. It is refused, with nothing written and the old version left
    /// serving, when it is not a component of the tenant world within the
    /// limits, asks for more than the deployment's limits, takes an operator
    /// plugin's name, or would put the tenant over its upload rate or its
    /// code quota.
    pub async fn upload_plugin(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
        bytes: &[u8],
        options: UploadOptions,
    ) -> Result<PluginView, ControlError> {
        if !valid_name(name) || name.len() > PLUGIN_NAME_BYTES_MAX {
            return Err(invalid(
                "name",
                "1-64 of [A-Za-z0-9_-], starting with a letter",
            ));
        }
        if self.policy.operator_names().iter().any(|n| n == name) {
            return Err(ControlError::Reserved {
                what: "plugin",
                name: name.into(),
            });
        }
        check_component(bytes)?;
        let shared = self.store.shared();
        let room = self
            .store
            .commit_bytes_max()
            .saturating_sub(UPLOAD_COMMIT_OTHER_BYTES);
        if shared && bytes.len() > room {
            return Err(invalid(
                "body",
                format!(
                    "a component is at most {room} bytes on this cluster: it is stored in one etcd request with its record (etcd's --max-request-bytes, [store.etcd] request_bytes_max)"
                ),
            ));
        }
        self.policy
            .limits()
            .lowered(&options.limits())
            .map_err(|reason| invalid("limits", reason))?;
        let tenant_id = self.tenant_record(tenant)?.id;
        let plugins = &self.config.plugins;
        self.uploads
            .take(tenant_id, plugins.uploads_per_minute, Instant::now())
            .map_err(|retry_after_secs| ControlError::RateLimited {
                what: "plugin uploads",
                retry_after_secs,
            })?;
        // Checked and compiled before the write lock: nobody else's writes
        // wait for this one's compiler.
        let component =
            blocking(|| self.policy.compile_bounded(bytes, false)).map_err(compile_error)?;
        blocking(|| {
            self.policy
                .check_instantiates(&component, &options.limits(), TenantId(tenant_id))
        })
        .map_err(|reason| invalid("limits", reason))?;
        let sealed = self
            .policy
            .seal(&component, bytes)
            .map_err(|e| ControlError::Store(StoreError::Io(format!("sealing a plugin: {e}"))))?;
        let write = self.begin_write().await?;
        let record = self.tenant_record(tenant)?;
        let existing = blocking(|| self.store.plugins(record.id))?;
        let previous = existing.iter().find(|p| p.name == name);
        if previous.is_none() && existing.len() >= PLUGINS_PER_TENANT_MAX {
            return Err(ControlError::TooMany {
                what: "plugins per tenant",
                max: PLUGINS_PER_TENANT_MAX,
            });
        }
        let code = self.store.code()?;
        // What the tenant's other plugins take: their components and
        // compiled forms (on a shared store, the components are in the store
        // and the compiled forms in each server's folder).
        let mut others = blocking(|| code.bytes_of(record.id, previous.map(|p| p.id)))?;
        if shared {
            others += existing
                .iter()
                .filter(|p| Some(p.id) != previous.map(|p| p.id))
                .map(|p| p.size_bytes)
                .sum::<u64>();
        }
        let needed = others + bytes.len() as u64 + sealed.len() as u64;
        if needed > plugins.tenant_code_bytes_max {
            return Err(ControlError::Quota {
                what: "plugin code (components and their compiled forms)",
                needed,
                max: plugins.tenant_code_bytes_max,
            });
        }
        let id = match previous {
            Some(p) => p.id,
            None => blocking(|| self.store.plugin_id_next())?,
        };
        let sha256 = hex(&Sha256::digest(bytes));
        let plugin = PluginRecord {
            id,
            tenant: record.id,
            name: name.into(),
            version: previous.map_or(1, |p| p.version + 1),
            sha256: sha256.clone(),
            size_bytes: bytes.len() as u64,
            enabled: previous.is_none_or(|p| p.enabled),
            uploaded_ms: now_ms(),
            order: options
                .order
                .unwrap_or_else(|| previous.map_or(existing.len() as u32, |p| p.order)),
            limits: options.limits(),
        };
        // The new version's files first, then the record naming them, then
        // the old version's files go: a crash between leaves only files no
        // record names, which the next start reclaims.
        let owner = owner_of(&plugin);
        let written = blocking(|| {
            if !shared {
                code.put(owner, CodeKind::Wasm, bytes)?;
            }
            code.put(owner, CodeKind::Sealed, &sealed)
        });
        let mut batch = write.batch();
        batch.put_plugin(&plugin);
        if shared {
            batch.put_plugin_code(owner, bytes);
            if let Some(old) = previous {
                batch.delete_plugin_code(owner_of(old));
            }
        }
        if previous.is_none() {
            batch.put_plugin_id_next(id + 1);
        }
        batch.audit(with_detail(
            audit(actor, "plugin.upload", &record.name),
            [
                ("plugin", name.into()),
                ("version", plugin.version.into()),
                ("size_bytes", plugin.size_bytes.into()),
                ("sha256", sha256.into()),
            ],
        ));
        if let Err(error) = written.map_err(ControlError::from) {
            let _ = blocking(|| code.delete(owner));
            return Err(error);
        }
        if let Err(error) = self.commit_or_undo(batch, &[]).await {
            let _ = blocking(|| code.delete(owner));
            return Err(error);
        }
        if let Some(old) = previous {
            if let Err(error) = blocking(|| code.delete(owner_of(old))) {
                tracing::warn!(plugin = %name, %error, "an old version's code stays until the next start");
            }
        }
        self.set_plugin_applied(&plugin);
        self.policy
            .install(&plugin, &component)
            .map_err(|e| invalid("limits", e.0))?;
        Ok(PluginView::from(&plugin))
    }

    /// The component of `plugin`, from its own files: the sealed compiled
    /// form when this host sealed it, else compiled again (and the new sealed
    /// form stored), and whether it was compiled. Why not, when it cannot be
    /// loaded.
    fn load_code(
        &self,
        plugin: &PluginRecord,
    ) -> Result<(wasmtime::component::Component, bool), String> {
        let code = self.store.code().map_err(|e| e.to_string())?;
        let owner = owner_of(plugin);
        let wasm = if self.store.shared() {
            self.store.plugin_code(owner)
        } else {
            code.get(owner, CodeKind::Wasm)
        };
        let wasm = wasm
            .map_err(|e| e.to_string())?
            .ok_or("its component is missing from the store")?;
        if hex(&Sha256::digest(&wasm)) != plugin.sha256 {
            return Err("its stored component does not match its digest".into());
        }
        let sealed = code
            .get(owner, CodeKind::Sealed)
            .map_err(|e| e.to_string())?;
        let (component, resealed) = self
            .policy
            .load(sealed.as_deref(), &wasm)
            .map_err(|e| e.0)?;
        let compiled = resealed.is_some();
        if let Some(resealed) = resealed {
            if let Err(error) = code.put(owner, CodeKind::Sealed, &resealed) {
                tracing::warn!(plugin = %plugin.name, %error, "could not store a compiled plugin");
            }
        }
        Ok((component, compiled))
    }

    /// Installs every enabled plugin of every tenant (start-up), after moving
    /// a format-2 store's plugins to their owners ([`Store::migrate_plugins`]).
    /// A plugin that no longer loads fails closed for its tenant (503
    /// `policy_unavailable`, and `plugin.unavailable` audited), never open:
    /// its tenant enabled it. Then every code file no record names is
    /// deleted.
    pub fn load_plugins(&self) -> Result<(), ControlError> {
        let migrated = self.store.migrate_plugins(&self.policy.operator_names())?;
        if migrated > 0 {
            tracing::info!(
                plugins = migrated,
                "plugins moved to format 3 (their own code files)"
            );
        }
        let mut live = HashSet::new();
        for tenant in self.store.tenants()? {
            for plugin in self.store.plugins(tenant.id)? {
                live.insert(owner_of(&plugin));
                self.install_stored(&tenant.name, &plugin)?;
            }
        }
        let (files, bytes) = self.store.code()?.reclaim(&live)?;
        if files > 0 {
            tracing::info!(files, bytes, "plugin code no record names was deleted");
        }
        Ok(())
    }

    /// Puts a stored plugin in its tenant's chain as its record says (out of
    /// it when disabled). One whose code does not load fails closed and is
    /// audited (`plugin.unavailable`, with this server's name).
    fn install_stored(&self, tenant: &str, plugin: &PluginRecord) -> Result<(), ControlError> {
        self.set_plugin_applied(plugin);
        if !plugin.enabled {
            self.policy.remove(TenantId(plugin.tenant), &plugin.name);
            return Ok(());
        }
        let loaded = blocking(|| self.load_code(plugin)).and_then(|(component, compiled)| {
            self.policy
                .install(plugin, &component)
                .map(|()| compiled)
                .map_err(|e| e.0)
        });
        match loaded {
            Ok(compiled) => {
                tracing::info!(%tenant, plugin = %plugin.name, version = plugin.version, compiled, "plugin loaded");
            }
            Err(why) => {
                tracing::error!(%tenant, plugin = %plugin.name, error = %why, "plugin does not load; it fails closed");
                self.policy.install_unloadable(plugin, &why);
                let mut batch = Batch::default();
                batch.audit(with_detail(
                    audit(&Actor::System, "plugin.unavailable", tenant),
                    [
                        ("plugin", plugin.name.clone().into()),
                        ("reason", why.into()),
                        ("server", self.server_name.clone().into()),
                    ],
                ));
                blocking(|| self.store.commit(batch))?;
            }
        }
        Ok(())
    }

    /// Brings this server's plugins in step with the store's records of
    /// `tenants` after another server changed them: each changed plugin is
    /// loaded (its component from the store, compiled here unless this
    /// server's sealed form of it is in its folder) and swapped in, each
    /// disabled one taken out, and each deleted one forgotten with its
    /// budgets. A plugin whose code does not load fails closed, as at start.
    /// How many plugins changed here.
    pub(super) fn reload_plugins(&self, tenants: &[TenantRecord]) -> Result<u32, ControlError> {
        // One scan, not one per tenant: this runs at every change.
        let names: HashMap<u32, &str> = tenants.iter().map(|t| (t.id, t.name.as_str())).collect();
        let stored: Vec<(String, PluginRecord)> = blocking(|| self.store.all_plugins())?
            .into_iter()
            .filter_map(|p| Some((names.get(&p.tenant)?.to_string(), p)))
            .collect();
        let before = self
            .plugins_applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut changed = 0;
        for (tenant, plugin) in &stored {
            let old = before.get(&(plugin.tenant, plugin.name.clone()));
            if old == Some(plugin) {
                continue;
            }
            if let Some(old) = old.filter(|old| old.id != plugin.id) {
                // Deleted and uploaded again: a new plugin, nothing of the old.
                self.forget_plugin(old);
            }
            self.install_stored(tenant, plugin)?;
            changed += 1;
        }
        let kept: HashSet<(u32, &str)> = stored
            .iter()
            .map(|(_, p)| (p.tenant, p.name.as_str()))
            .collect();
        for old in before.values() {
            let present = kept.contains(&(old.tenant, old.name.as_str()));
            let tenant_present = names.contains_key(&old.tenant);
            if !present && tenant_present {
                self.forget_plugin(old);
                changed += 1;
            }
        }
        Ok(changed)
    }

    /// Forgets a deleted plugin (through this server or another): out of
    /// the chain, its budgets and faults gone, its files here deleted.
    fn forget_plugin(&self, plugin: &PluginRecord) {
        self.plugins_applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(plugin.tenant, plugin.name.clone()));
        self.policy.forget(
            TenantId(plugin.tenant),
            Some((&plugin.name, &tenant_identity(plugin.id))),
        );
        if let Err(error) = blocking(|| self.store.code().and_then(|c| c.delete(owner_of(plugin))))
        {
            tracing::warn!(plugin = %plugin.name, %error, "a deleted plugin's code files stay until the next start");
        }
    }

    /// Notes `plugin` as this server has it now.
    fn set_plugin_applied(&self, plugin: &PluginRecord) {
        self.plugins_applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((plugin.tenant, plugin.name.clone()), plugin.clone());
    }

    /// Forgets what this server had of a deleted tenant's plugins.
    pub(super) fn forget_plugins_applied(&self, tenant: u32) {
        self.plugins_applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(t, _), _| *t != tenant);
    }

    /// Enables or disables a plugin; the next request follows. Enabling one
    /// whose code does not load is refused (400), and changes nothing.
    pub async fn set_plugin_enabled(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
        enabled: bool,
    ) -> Result<PluginView, ControlError> {
        let write = self.begin_write().await?;
        let (owner, mut plugin) = self.plugin_record(tenant, name)?;
        plugin.enabled = enabled;
        let component = if enabled {
            Some(
                blocking(|| self.load_code(&plugin))
                    .map_err(|why| invalid("plugin", why))?
                    .0,
            )
        } else {
            None
        };
        let action = if enabled {
            "plugin.enable"
        } else {
            "plugin.disable"
        };
        let mut detail = vec![("plugin", name.into())];
        if matches!(actor, Actor::System) {
            detail.push(("reason", "faults".into()));
            crate::live::recent().alarm(
                "plugin_disabled",
                &owner,
                format!("plugin {name} disabled after repeated faults"),
            );
        }
        let mut batch = write.batch();
        batch
            .put_plugin(&plugin)
            .audit(with_detail(audit(actor, action, &owner), detail));
        self.commit_or_undo(batch, &[]).await?;
        self.set_plugin_applied(&plugin);
        match component {
            Some(component) => self
                .policy
                .install(&plugin, &component)
                .map_err(|e| invalid("plugin", e.0))?,
            None => self.policy.remove(TenantId(plugin.tenant), name),
        }
        Ok(PluginView::from(&plugin))
    }

    /// Deletes a plugin, its code and its state.
    pub async fn delete_plugin(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
    ) -> Result<(), ControlError> {
        let write = self.begin_write().await?;
        let (owner, plugin) = self.plugin_record(tenant, name)?;
        let identity = tenant_identity(plugin.id);
        let mut batch = write.batch();
        batch.delete_plugin(plugin.tenant, name);
        if self.store.shared() {
            batch.delete_plugin_code(owner_of(&plugin));
        }
        blocking(|| {
            self.policy
                .state()
                .forget(&mut batch, TenantId(plugin.tenant), &identity)
        })?;
        batch.audit(with_detail(
            audit(actor, "plugin.delete", &owner),
            [("plugin", name.into())],
        ));
        self.commit_or_undo(batch, &[]).await?;
        self.forget_plugin(&plugin);
        Ok(())
    }

    /// Records that an operator plugin tripped for a tenant (audited; it
    /// fails closed or is skipped for that tenant until `until_ms`).
    pub fn record_operator_trip(&self, trip: &crate::policy::Trip) -> Result<(), ControlError> {
        let Some((on_trip, until_ms)) = trip.operator else {
            return Ok(());
        };
        let tenant = self.tenant_record(TenantRef::Id(trip.tenant))?;
        crate::live::recent().alarm(
            "plugin_tripped",
            &tenant.name,
            format!(
                "operator plugin {} tripped after {} faults; {} until {until_ms}",
                trip.plugin,
                trip.faults,
                on_trip.as_str()
            ),
        );
        let mut batch = Batch::default();
        batch.audit(with_detail(
            audit(&Actor::System, "plugin.trip", &tenant.name),
            [
                ("plugin", trip.plugin.clone().into()),
                ("faults", trip.faults.into()),
                ("on_trip", on_trip.as_str().into()),
                ("until_ms", until_ms.into()),
            ],
        ));
        blocking(|| self.store.commit(batch))?;
        Ok(())
    }

    /// The tenant's name and its plugin `name`.
    fn plugin_record(
        &self,
        tenant: TenantRef<'_>,
        name: &str,
    ) -> Result<(String, PluginRecord), ControlError> {
        let record = self.tenant_record(tenant)?;
        let plugin = blocking(|| self.store.plugins(record.id))?
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| ControlError::NotFound {
                what: "plugin",
                name: name.into(),
            })?;
        Ok((record.name, plugin))
    }
}

/// The first bytes of a WebAssembly component (a core module has version 1,
/// layer 0 instead).
const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

/// Refuses what is not a component within the size limit.
fn check_component(bytes: &[u8]) -> Result<(), ControlError> {
    if bytes.is_empty() {
        return Err(invalid("body", "the component is empty"));
    }
    if bytes.len() > PLUGIN_BYTES_MAX {
        return Err(invalid(
            "body",
            format!("a component is at most {PLUGIN_BYTES_MAX} bytes"),
        ));
    }
    if !bytes.starts_with(&COMPONENT_PREAMBLE[..4]) {
        return Err(invalid("body", "not WebAssembly (no \\0asm header)"));
    }
    if bytes.len() < 8 || bytes[4..8] != COMPONENT_PREAMBLE[4..8] {
        return Err(invalid(
            "body",
            "a core WebAssembly module, not a component (build for wasm32-wasip2)",
        ));
    }
    Ok(())
}
