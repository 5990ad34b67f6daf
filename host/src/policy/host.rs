//! The host side of `wit/policy.wit`: the state of one plugin call, and what
//! each import does with it.
//!
//! Every import is counted against the call's host-call budget and checks the
//! call's wall-clock deadline first, so a plugin that loops over host calls
//! (which cost no fuel) is stopped as surely as one that loops in WebAssembly
//! (stopped by fuel and the epoch deadline). Imports return
//! `Result<Result<T, GuestError>>`: the outer error traps (a broken limit, a
//! bad handle), the inner one is the plugin's to handle.
//!
//! The linker holds exactly the interfaces `wit/policy.wit` names and nothing
//! else: no WASI at all, so no clock to sleep on, no pollable to block on, no
//! random bytes to ask for, no stream to write. A component that imports
//! anything more is refused at upload ([`check_imports`]).

use super::budget::{BudgetError as HostBudgetError, Budgets, Unit as HostUnit};
use super::state::{PluginState, StateError as HostStateError};
use crate::clock::now_ms;
use crate::engine::request::RequestId;
use crate::engine::service::EngineHandle;
use crate::tenancy::TenantId;
use std::sync::Arc;
use std::time::Instant;
use wasmtime::component::{Linker, Resource, ResourceTable};
use wasmtime::{StoreContextMut, StoreLimits};

/// Generated bindings of the operator world (a superset of the tenant world:
/// the same exports, one more import).
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "operator-policy",
        imports: { default: trappable },
        with: { "bulkhead:policy/kv-pool.partition": super::PartitionHandle },
    });
}

use bindings::bulkhead::policy::budget::{BudgetError, Unit};
use bindings::bulkhead::policy::host::{Level, LimitsLeft};
use bindings::bulkhead::policy::kv_pool::PartitionStats;
use bindings::bulkhead::policy::state::StateError;

/// Longest plugin log line, in bytes (longer ones are cut).
pub const LOG_LINE_BYTES_MAX: usize = 256;
/// Most log lines per call.
pub const LOG_LINES_MAX: u32 = 16;

/// The package and version every import and the export must name exactly.
pub const PACKAGE: &str = "bulkhead:policy";
/// The contract's version.
pub const VERSION: &str = "0.1.0";
/// The interfaces a tenant plugin may import (`wit/policy.wit`'s
/// `tenant-policy` world).
pub const TENANT_IMPORTS: [&str; 5] = ["types", "kv-pool", "budget", "state", "host"];
/// What an operator plugin may import besides (`operator-policy`).
pub const OPERATOR_IMPORTS: [&str; 1] = ["operator"];
/// The interface every plugin exports.
pub const EXPORT: &str = "policy";

/// A handle to the calling tenant's own partition: it carries nothing, so it
/// can name nothing else; the host answers for the tenant of the call.
pub struct PartitionHandle;

/// What the host offers every call.
pub struct Services {
    /// Plugins' token buckets.
    pub budgets: Budgets,
    /// Plugins' key-value state.
    pub state: PluginState,
}

/// One call's identity and limits.
pub struct Call {
    /// The request.
    pub request: RequestId,
    /// The tenant the request (and, for a tenant plugin, the plugin) belongs to.
    pub tenant: TenantId,
    /// The plugin's name (logs).
    pub plugin: Arc<str>,
    /// The plugin's identity, which its budgets and state are keyed by:
    /// `#<id>` for a tenant's plugin, `@<name>` for the operator's; never
    /// a name a tenant chooses.
    pub identity: Arc<str>,
    /// When the call must have ended.
    pub deadline: Instant,
    /// Host calls left.
    pub host_calls_left: u32,
    /// Resource handles left.
    pub handles_left: u32,
    /// Log lines left.
    pub log_lines_left: u32,
    /// The linear memory cap, for `remaining`.
    pub memory_max: u64,
    /// The prompt text, for an operator plugin when the deployment allows it.
    pub prompt_text: Option<Arc<str>>,
    /// The engine of the request's model, for the tenant's partition there.
    pub engine: Option<EngineHandle>,
    /// Shared host services.
    pub services: Arc<Services>,
}

/// Why a call trapped on the host's side.
#[derive(Debug, thiserror::Error)]
pub enum HostTrap {
    /// The deadline passed during host calls.
    #[error("the call's deadline passed")]
    Deadline,
    /// Too many host calls.
    #[error("the call made more host calls than it may")]
    HostCalls,
    /// Too many handles.
    #[error("the call holds more handles than it may")]
    Handles,
    /// A handle that is not the call's.
    #[error("a handle the host did not give")]
    BadHandle,
}

impl Call {
    /// Counts a host call; traps past the budget or the deadline.
    fn enter(&mut self) -> wasmtime::Result<()> {
        #[cfg(feature = "fault-injection")]
        super::fault::stall(self.tenant);
        if Instant::now() >= self.deadline {
            return Err(HostTrap::Deadline.into());
        }
        self.host_calls_left = self
            .host_calls_left
            .checked_sub(1)
            .ok_or(HostTrap::HostCalls)?;
        Ok(())
    }
}

/// A call's store data.
pub struct CallState {
    /// Resources: the partition handles.
    pub table: ResourceTable,
    /// Memory, table and instance caps.
    pub limits: StoreLimits,
    /// The call.
    pub call: Call,
}

impl bindings::bulkhead::policy::types::Host for CallState {}

impl bindings::bulkhead::policy::kv_pool::Host for CallState {}

impl bindings::bulkhead::policy::kv_pool::HostPartition for CallState {
    fn mine(&mut self) -> wasmtime::Result<Resource<PartitionHandle>> {
        self.call.enter()?;
        self.call.handles_left = self
            .call
            .handles_left
            .checked_sub(1)
            .ok_or(HostTrap::Handles)?;
        Ok(self.table.push(PartitionHandle)?)
    }

    fn stats(&mut self, handle: Resource<PartitionHandle>) -> wasmtime::Result<PartitionStats> {
        self.call.enter()?;
        self.table.get(&handle).map_err(|_| HostTrap::BadHandle)?;
        // The tenant's partition in the pool of the request's model; all
        // zeros when it has none there (or the model was just unloaded).
        let mine = self
            .call
            .engine
            .as_ref()
            .and_then(|engine| {
                let stats = engine.stats();
                stats
                    .tenants
                    .iter()
                    .find(|t| t.id == self.call.tenant.0)
                    .copied()
            })
            .unwrap_or_default();
        Ok(PartitionStats {
            pages_reserved: mine.pages_reserved,
            pages_max: mine.pages_max,
            pages_in_use: mine.pages_owned + mine.pages_booked + mine.pages_released,
            // Its reservation's free pages only: what it could book counting
            // the shared burst region would change with other tenants' use.
            pages_available: mine
                .pages_reserved
                .saturating_sub(mine.pages_owned + mine.pages_booked + mine.pages_released),
            queued: mine.queued,
            running: mine.running,
        })
    }

    fn drop(&mut self, handle: Resource<PartitionHandle>) -> wasmtime::Result<()> {
        self.table.delete(handle).map_err(|_| HostTrap::BadHandle)?;
        self.call.handles_left += 1;
        Ok(())
    }
}

impl bindings::bulkhead::policy::budget::Host for CallState {
    fn reserve(
        &mut self,
        key: String,
        limit: u64,
        window_ms: u32,
        unit: Unit,
        amount: u64,
    ) -> wasmtime::Result<Result<u64, BudgetError>> {
        self.call.enter()?;
        let unit = match unit {
            Unit::Requests => HostUnit::Requests,
            Unit::Tokens => HostUnit::Tokens,
        };
        let c = &self.call;
        Ok(c.services
            .budgets
            .reserve(
                c.request,
                c.tenant,
                &c.identity,
                &key,
                limit,
                window_ms,
                unit,
                amount,
                Instant::now(),
            )
            .map_err(budget_error))
    }

    fn available(
        &mut self,
        key: String,
        limit: u64,
        window_ms: u32,
    ) -> wasmtime::Result<Result<u64, BudgetError>> {
        self.call.enter()?;
        let c = &self.call;
        Ok(c.services
            .budgets
            .available(
                c.tenant,
                &c.identity,
                &key,
                limit,
                window_ms,
                Instant::now(),
            )
            .map_err(budget_error))
    }
}

fn budget_error(error: HostBudgetError) -> BudgetError {
    match error {
        HostBudgetError::Exhausted(ms) => BudgetError::Exhausted(ms),
        HostBudgetError::TooManyKeys => BudgetError::TooManyKeys,
        HostBudgetError::Invalid(message) => BudgetError::Invalid(message),
    }
}

impl bindings::bulkhead::policy::state::Host for CallState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<Vec<u8>>> {
        self.call.enter()?;
        let c = &self.call;
        match c.services.state.get(c.tenant, &c.identity, &key, now_ms()) {
            Ok(value) => Ok(value),
            Err(error) => {
                tracing::warn!(%error, plugin = %c.plugin, "plugin state read");
                Ok(None)
            }
        }
    }

    fn set(
        &mut self,
        key: String,
        value: Vec<u8>,
        ttl_ms: Option<u32>,
    ) -> wasmtime::Result<Result<(), StateError>> {
        self.call.enter()?;
        let c = &self.call;
        Ok(c.services
            .state
            .set(c.tenant, &c.identity, &key, &value, ttl_ms, now_ms())
            .map_err(|e| match e {
                HostStateError::TooLarge => StateError::TooLarge,
                HostStateError::TooManyKeys => StateError::TooManyKeys,
                HostStateError::Unavailable => StateError::Unavailable,
            }))
    }

    fn delete(&mut self, key: String) -> wasmtime::Result<()> {
        self.call.enter()?;
        let c = &self.call;
        if let Err(error) = c.services.state.delete(c.tenant, &c.identity, &key) {
            tracing::warn!(%error, plugin = %c.plugin, "plugin state delete");
        }
        Ok(())
    }
}

impl bindings::bulkhead::policy::operator::Host for CallState {
    fn prompt_text(&mut self) -> wasmtime::Result<Option<String>> {
        self.call.enter()?;
        Ok(self.call.prompt_text.as_deref().map(str::to_string))
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The `host` interface, defined by hand: `remaining` reads the store's fuel,
/// which the generated traits cannot reach.
fn add_host_interface(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    let mut host = linker.instance("bulkhead:policy/host@0.1.0")?;
    host.func_wrap(
        "now-ms",
        |mut store: StoreContextMut<'_, CallState>, (): ()| {
            store.data_mut().call.enter()?;
            Ok((now_ms(),))
        },
    )?;
    host.func_wrap(
        "log",
        |mut store: StoreContextMut<'_, CallState>, (level, message): (Level, String)| {
            let call = &mut store.data_mut().call;
            call.enter()?;
            if call.log_lines_left == 0 {
                return Ok(());
            }
            call.log_lines_left -= 1;
            // Its own field: a JSON reader that keeps the last of two
            // `message` keys would show the plugin's text as the event.
            let plugin_message = cut(&message, LOG_LINE_BYTES_MAX);
            let (request_id, plugin) = (call.request.0, &*call.plugin);
            match level {
                Level::Debug => tracing::debug!(request_id, plugin, plugin_message, "plugin log"),
                Level::Info => tracing::info!(request_id, plugin, plugin_message, "plugin log"),
                Level::Warn => tracing::warn!(request_id, plugin, plugin_message, "plugin log"),
                Level::Error => tracing::error!(request_id, plugin, plugin_message, "plugin log"),
            }
            Ok(())
        },
    )?;
    host.func_wrap(
        "remaining",
        |mut store: StoreContextMut<'_, CallState>, (): ()| {
            store.data_mut().call.enter()?;
            let fuel = store.get_fuel().unwrap_or(0);
            let call = &store.data().call;
            let left = LimitsLeft {
                time_ms: call
                    .deadline
                    .saturating_duration_since(Instant::now())
                    .as_millis()
                    .min(u128::from(u32::MAX)) as u32,
                fuel,
                memory_bytes: call.memory_max,
                host_calls: call.host_calls_left,
            };
            Ok((left,))
        },
    )?;
    Ok(())
}

/// A linker for tenant plugins (`operator`: false) or operator plugins:
/// the interfaces of their world, nothing else.
pub fn linker(engine: &wasmtime::Engine, operator: bool) -> wasmtime::Result<Linker<CallState>> {
    use bindings::bulkhead::policy::{budget, kv_pool, operator as op, state, types};
    use wasmtime::component::HasSelf;
    let mut linker = Linker::new(engine);
    types::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
    kv_pool::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
    budget::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
    state::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
    add_host_interface(&mut linker)?;
    if operator {
        op::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
    }
    Ok(linker)
}

/// The full name of interface `name` of the contract (`bulkhead:policy/name@0.1.0`).
pub fn interface(name: &str) -> String {
    format!("{PACKAGE}/{name}@{VERSION}")
}

/// Refuses a component that imports anything its world does not name, with
/// the import's name, or that does not export `bulkhead:policy/policy@0.1.0`
/// under exactly that name (another version of the contract is refused, not
/// matched by semver).
pub fn check_imports(
    engine: &wasmtime::Engine,
    component: &wasmtime::component::Component,
    operator: bool,
) -> Result<(), String> {
    let ty = component.component_type();
    let allowed: Vec<String> = TENANT_IMPORTS
        .iter()
        .chain(if operator { &OPERATOR_IMPORTS[..] } else { &[] })
        .map(|name| interface(name))
        .collect();
    let world = if operator {
        "operator-policy"
    } else {
        "tenant-policy"
    };
    for (name, _) in ty.imports(engine) {
        if !allowed.iter().any(|a| a == name) {
            let hint = if name.starts_with("wasi:") {
                " (the host offers no WASI: a Rust plugin must be #![no_std], see docs/plugins.md)"
            } else {
                ""
            };
            return Err(format!(
                "it imports {name}, which the {world} world of {PACKAGE}@{VERSION} does not name; \
                 a plugin may import only {}{hint}",
                allowed.join(", ")
            ));
        }
    }
    let export = interface(EXPORT);
    if !ty.exports(engine).any(|(name, _)| name == export) {
        let found: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
        return Err(format!(
            "it does not export {export} (admit, route, on-complete); it exports: {}",
            if found.is_empty() {
                "nothing".to_string()
            } else {
                found.join(", ")
            }
        ));
    }
    Ok(())
}
