//! The control plane's plugin writes: upload, enable and disable, delete, and
//! loading every tenant's plugins at start, each through the one write path
//! (check → store → apply → audit).

use super::*;

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
        }
    }
}

impl Control {
    /// A tenant's plugins.
    pub fn plugins(&self, tenant: TenantRef<'_>) -> Result<Vec<PluginView>, ControlError> {
        let record = self.tenant_record(tenant)?;
        Ok(blocking(|| self.store.plugins(record.id))?
            .iter()
            .map(PluginView::from)
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
    /// limits, or asks for more than the deployment's limits.
    pub async fn upload_plugin(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
        bytes: &[u8],
        options: UploadOptions,
    ) -> Result<PluginView, ControlError> {
        let _write = self.writes.lock().await;
        if !valid_name(name) || name.len() > PLUGIN_NAME_BYTES_MAX {
            return Err(invalid(
                "name",
                "1-64 of [A-Za-z0-9_-], starting with a letter",
            ));
        }
        check_component(bytes)?;
        self.policy
            .limits()
            .lowered(&options.limits())
            .map_err(|reason| invalid("limits", reason))?;
        let record = self.tenant_record(tenant)?;
        let existing = blocking(|| self.store.plugins(record.id))?;
        let previous = existing.iter().find(|p| p.name == name);
        if previous.is_none() && existing.len() >= PLUGINS_PER_TENANT_MAX {
            return Err(ControlError::TooMany {
                what: "plugins per tenant",
                max: PLUGINS_PER_TENANT_MAX,
            });
        }
        // Compile and check the world before anything is written.
        let component =
            blocking(|| self.policy.compile(bytes, false)).map_err(|e| invalid("body", e.0))?;
        let sealed = self
            .policy
            .seal(&component)
            .map_err(|e| ControlError::Store(StoreError::Io(format!("sealing a plugin: {e}"))))?;
        let sha256 = hex(&Sha256::digest(bytes));
        let plugin = PluginRecord {
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
        let mut batch = Batch::default();
        batch
            .put_plugin_wasm(&sha256, bytes)
            .put_plugin_compiled(&sha256, sealed)
            .put_plugin(&plugin);
        if let Some(old) = previous.filter(|p| p.sha256 != sha256) {
            batch
                .delete_plugin_wasm(&old.sha256)
                .delete_plugin_compiled(&old.sha256);
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
        self.commit_or_undo(batch, &[]).await?;
        self.policy
            .install(&plugin, &component)
            .map_err(|e| invalid("limits", e.0))?;
        Ok(PluginView::from(&plugin))
    }

    /// Installs every enabled plugin of every tenant (start-up): from its
    /// sealed compiled form when this host sealed it, else compiled again
    /// (and the new form stored). A plugin that no longer loads is disabled,
    /// audited, and the server starts without it.
    pub fn load_plugins(&self) -> Result<(), ControlError> {
        for tenant in self.store.tenants()? {
            for mut plugin in self.store.plugins(tenant.id)? {
                if !plugin.enabled {
                    continue;
                }
                let wasm = self.store.plugin_wasm(&plugin.sha256)?.unwrap_or_default();
                let sealed = self.store.plugin_compiled(&plugin.sha256)?;
                let loaded =
                    self.policy
                        .load(sealed.as_deref(), &wasm)
                        .and_then(|(component, resealed)| {
                            self.policy.install(&plugin, &component)?;
                            Ok(resealed)
                        });
                let mut batch = Batch::default();
                match loaded {
                    Ok(None) => {
                        tracing::info!(tenant = %tenant.name, plugin = %plugin.name, compiled = false, "plugin loaded");
                        continue;
                    }
                    Ok(Some(resealed)) => {
                        tracing::info!(tenant = %tenant.name, plugin = %plugin.name, compiled = true, "plugin loaded");
                        batch.put_plugin_compiled(&plugin.sha256, resealed);
                    }
                    Err(error) => {
                        tracing::error!(tenant = %tenant.name, plugin = %plugin.name, %error, "plugin does not load; disabled");
                        plugin.enabled = false;
                        batch.put_plugin(&plugin).audit(with_detail(
                            audit(&Actor::System, "plugin.disable", &tenant.name),
                            [
                                ("plugin", plugin.name.clone().into()),
                                ("reason", "load".into()),
                            ],
                        ));
                    }
                }
                self.store.commit(batch)?;
            }
        }
        Ok(())
    }

    /// Enables or disables a plugin; the next request follows.
    pub async fn set_plugin_enabled(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
        enabled: bool,
    ) -> Result<PluginView, ControlError> {
        let _write = self.writes.lock().await;
        let (owner, mut plugin) = self.plugin_record(tenant, name)?;
        plugin.enabled = enabled;
        let component = if enabled {
            let wasm = blocking(|| self.store.plugin_wasm(&plugin.sha256))?.unwrap_or_default();
            let sealed = blocking(|| self.store.plugin_compiled(&plugin.sha256))?;
            let (component, _) = blocking(|| self.policy.load(sealed.as_deref(), &wasm))
                .map_err(|e| invalid("plugin", e.0))?;
            Some(component)
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
        }
        let mut batch = Batch::default();
        batch
            .put_plugin(&plugin)
            .audit(with_detail(audit(actor, action, &owner), detail));
        self.commit_or_undo(batch, &[]).await?;
        match component {
            Some(component) => self
                .policy
                .install(&plugin, &component)
                .map_err(|e| invalid("plugin", e.0))?,
            None => self.policy.remove(TenantId(plugin.tenant), name),
        }
        Ok(PluginView::from(&plugin))
    }

    /// Deletes a plugin and its bytes.
    pub async fn delete_plugin(
        &self,
        actor: &Actor,
        tenant: TenantRef<'_>,
        name: &str,
    ) -> Result<(), ControlError> {
        let _write = self.writes.lock().await;
        let (owner, plugin) = self.plugin_record(tenant, name)?;
        let mut batch = Batch::default();
        batch
            .delete_plugin(plugin.tenant, name)
            .delete_plugin_wasm(&plugin.sha256)
            .delete_plugin_compiled(&plugin.sha256);
        blocking(|| {
            self.policy
                .state()
                .forget(&mut batch, TenantId(plugin.tenant), name)
        })?;
        batch.audit(with_detail(
            audit(actor, "plugin.delete", &owner),
            [("plugin", name.into())],
        ));
        self.commit_or_undo(batch, &[]).await?;
        self.policy.forget(TenantId(plugin.tenant), Some(name));
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
