//! Policy plugins: tenants' and operators' admission and routing decisions,
//! WebAssembly components run in a sandbox on every request (I1, I10).
//!
//! 1. **Compile and validate** ([`PolicyRuntime::compile`]) at upload: not
//!    WebAssembly, a core module, the wrong world or version, an import the
//!    host does not offer — each refused with a message before anything is
//!    stored. The compiled form is kept sealed ([`artifact`]) so a restart does
//!    not compile again.
//! 2. **Install** a compiled plugin in its tenant's chain (ordered by `order`,
//!    then name); uploading a new version swaps it in for the next request,
//!    while requests already past admission finish with the version they
//!    started with (each holds its chain).
//! 3. **Admit** ([`PolicyRuntime::admit`]): operator plugins first, then the
//!    tenant's, each in a fresh instance from a pre-instantiated template (the
//!    pooling allocator; linear memory is zeroed between uses; no instance is
//!    ever reused, across tenants or after a trap). The first reject wins;
//!    adjustments can only tighten. Every call has four limits — an epoch
//!    deadline and a wall-clock bound checked in every host call, fuel, and
//!    memory/table/instance caps — plus caps on host calls and handles. A
//!    fault fails the request closed (503 `policy_unavailable`) and counts
//!    against the plugin; [`PluginsConfig::faults_max`] faults within the
//!    window disable it (through the control plane: audited).
//! 4. **Complete**: when an admitted request ends — any way, streamed or not —
//!    its budget bookings are reconciled and each plugin of its chain gets
//!    `on-complete` with the real counts, on the completion lane: tenants in
//!    turn, at most `plugins.complete_queue_max` ended requests queued per
//!    tenant (past it, a tenant's `on-complete` calls are dropped and counted),
//!    so one tenant's slow `on-complete` delays nobody else's.
//!
//! A tenant's own plugins share one time budget per request
//! (`plugins.request_budget_ms`), for `route` and `admit` together and again
//! for `on-complete`: each call's deadline is its own or what is left of the
//! budget, whichever comes first. Route and admit chains run in the tenant's
//! turn on the request lane, never on the engine thread or the async
//! runtime's workers, and every call itself runs on a plugin worker
//! ([`calls`]) that its caller waits for with a bound: a call stuck in a host
//! function past its deadline is abandoned, counted as a fault, and its
//! worker replaced.

pub mod artifact;
pub mod budget;
pub mod calls;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod host;
pub mod shape;
pub mod state;

use crate::clock::now_ms;
use crate::config::{Config, OnTrip, PluginsConfig};
use crate::engine::admission::PRIORITY_DEFAULT;
use crate::engine::request::{FinishReason, RequestId, Usage};
use crate::engine::service::EngineHandle;
use crate::lane::{Cancel, Lane};
use crate::store::records::{PluginLimitsRequest, PluginRecord};
use crate::store::{Store, StoreError};
use crate::tenancy::TenantId;
use artifact::Sealer;
use budget::Budgets;
use calls::{CallLost, Calls};
use host::bindings::bulkhead::policy::types::{
    Adjustments, Completion, Decision, Endpoint, Header, Outcome, RequestView,
};
use host::bindings::OperatorPolicyPre;
use host::{Call, CallState, HostTrap, Services};
use state::PluginState;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Engine, Store as WasmStore, StoreLimitsBuilder};

/// How often the epoch ticks (the unit of the epoch deadline).
pub const EPOCH_TICK: Duration = Duration::from_millis(1);
/// Less of a request's time budget than this left, and its tenant's next
/// plugin is not called: the epoch could not give it even one whole tick.
pub const BUDGET_CALL_MIN: Duration = Duration::from_millis(2);
/// Most headers passed to a plugin.
pub const HEADERS_MAX: usize = 64;
/// Longest header value passed, in bytes (longer ones are left out).
pub const HEADER_BYTES_MAX: usize = 1024;
/// Headers never passed to a plugin.
pub const CREDENTIAL_HEADERS: [&str; 4] = [
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-api-key",
];
/// Longest reject code accepted from a plugin.
pub const REJECT_CODE_BYTES_MAX: usize = 64;
/// Longest reject message accepted (longer ones are cut).
pub const REJECT_MESSAGE_BYTES_MAX: usize = 256;
/// Longest `Retry-After` a plugin may ask for, in seconds.
pub const RETRY_AFTER_SECS_MAX: u32 = 3600;

/// The limits of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLimits {
    /// Wall clock, instantiation included.
    pub deadline: Duration,
    /// Fuel.
    pub fuel: u64,
    /// Linear memory, bytes.
    pub memory_bytes: u64,
    /// Host calls.
    pub host_calls: u32,
    /// Resource handles.
    pub handles: u32,
}

impl CallLimits {
    /// The deployment's limits (defaults and maximums).
    pub fn of(config: &PluginsConfig) -> CallLimits {
        CallLimits {
            deadline: Duration::from_millis(config.deadline_ms),
            fuel: config.fuel,
            memory_bytes: config.memory_bytes,
            host_calls: config.host_calls_max,
            handles: config.handles_max,
        }
    }

    /// These limits lowered to what a plugin asked for; more than these is an
    /// error naming the field.
    pub fn lowered(&self, asked: &PluginLimitsRequest) -> Result<CallLimits, String> {
        let pick = |field: &str, asked: Option<u64>, max: u64| match asked {
            None => Ok(max),
            Some(0) => Err(format!("{field} must be at least 1")),
            Some(v) if v > max => Err(format!("{field} is at most {max} in this deployment")),
            Some(v) => Ok(v),
        };
        Ok(CallLimits {
            deadline: Duration::from_millis(pick(
                "deadline_ms",
                asked.deadline_ms,
                self.deadline.as_millis() as u64,
            )?),
            fuel: pick("fuel", asked.fuel, self.fuel)?,
            memory_bytes: pick("memory_bytes", asked.memory_bytes, self.memory_bytes)?,
            ..*self
        })
    }
}

/// Why a component was refused at upload (400, with the message).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPlugin(pub String);

/// Why an upload was not compiled.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// It is not a plugin this host runs, or over a limit (400).
    #[error("{0}")]
    Invalid(String),
    /// Another upload's compilation held the compiler for the whole timeout
    /// (503: retry).
    #[error("the plugin compiler is busy")]
    Busy,
}

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Wasmtime's engine or linker.
    #[error("plugin runtime: {0}")]
    Runtime(String),
    /// An operator plugin from the policy file.
    #[error("operator plugin {name} ({path}): {message}")]
    Operator {
        /// Its name.
        name: String,
        /// Its file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How a call failed: the request fails closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// Out of fuel.
    Fuel,
    /// The epoch deadline or the wall clock.
    Deadline,
    /// Memory, tables or instances over their caps.
    Memory,
    /// Host calls or handles over their caps, or a bad handle.
    HostLimit,
    /// Any other trap (unreachable, a panic, a bad instantiation).
    Trap,
    /// Still running past its deadline, inside a host call: abandoned, its
    /// worker replaced.
    Abandoned,
    /// The tenant's plugins used up the request's time budget before this
    /// one was called (not counted against it).
    Budget,
    /// Its code could not be loaded (at start, or when enabled): it fails
    /// closed until it is uploaded again, disabled or deleted.
    Unloadable,
    /// An operator plugin tripped for this tenant (its own faults, in the
    /// window) and set to fail closed while tripped.
    Tripped,
    /// No worker could take the call in time, or the tenant already has the
    /// most abandoned calls stuck (not counted against the plugin).
    Unavailable,
}

impl FaultKind {
    /// The metric and audit label.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Fuel => "fuel",
            FaultKind::Deadline => "deadline",
            FaultKind::Memory => "memory",
            FaultKind::HostLimit => "host_limit",
            FaultKind::Trap => "trap",
            FaultKind::Abandoned => "abandoned",
            FaultKind::Budget => "budget",
            FaultKind::Unloadable => "unloadable",
            FaultKind::Tripped => "tripped",
            FaultKind::Unavailable => "unavailable",
        }
    }

    /// Whether the fault is the plugin's own (and counts toward disabling it).
    fn counts(self) -> bool {
        !matches!(
            self,
            FaultKind::Budget | FaultKind::Unavailable | FaultKind::Unloadable | FaultKind::Tripped
        )
    }

    fn of(error: &wasmtime::Error) -> FaultKind {
        if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
            return match trap {
                wasmtime::Trap::OutOfFuel => FaultKind::Fuel,
                wasmtime::Trap::Interrupt => FaultKind::Deadline,
                wasmtime::Trap::AllocationTooLarge => FaultKind::Memory,
                _ => FaultKind::Trap,
            };
        }
        match error.downcast_ref::<HostTrap>() {
            Some(HostTrap::Deadline) => FaultKind::Deadline,
            Some(_) => FaultKind::HostLimit,
            None if format!("{error:#}").contains("grow") => FaultKind::Memory,
            None => FaultKind::Trap,
        }
    }
}

/// A plugin's refusal, cleaned up for the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginRejection {
    /// The plugin.
    pub plugin: String,
    /// 400, 403 or 429.
    pub status: u16,
    /// `[a-z0-9_]`, at most 64.
    pub code: String,
    /// At most 256 bytes, no control characters.
    pub message: String,
    /// Seconds, for a 429.
    pub retry_after_secs: Option<u32>,
}

/// What the chain decided.
#[derive(Debug)]
pub enum Verdict {
    /// Admitted, maybe tightened.
    Admit {
        /// A lower limit on generated tokens.
        max_tokens: Option<u32>,
        /// A lower priority.
        priority: Option<u8>,
    },
    /// Refused by a plugin.
    Reject(PluginRejection),
    /// A plugin failed: the request fails closed.
    Fault {
        /// The plugin.
        plugin: String,
        /// How.
        kind: FaultKind,
    },
    /// The request's caller left before the chain ended: the rest was not
    /// asked, and its bookings are given back.
    Cancelled,
}

/// A request as the chain sees it.
#[derive(Clone)]
pub struct AdmitInput {
    /// Its id.
    pub request: RequestId,
    /// Its tenant.
    pub tenant: TenantId,
    /// The tenant's name.
    pub tenant_name: String,
    /// The model asked for.
    pub model: String,
    /// Chat or completions.
    pub chat: bool,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Streamed.
    pub stream: bool,
    /// Its headers, credentials already removed ([`plugin_headers`]).
    pub headers: Vec<(String, String)>,
    /// The prompt text, only when operator plugins may read it.
    pub prompt_text: Option<Arc<str>>,
    /// The engine of the model it will run on (the kv-pool interface reports
    /// the tenant's partition there).
    pub engine: EngineHandle,
    /// What is left of the time its tenant's own plugins may take
    /// ([`PolicyRuntime::time_budget`]), shared by `route` and `admit`.
    pub budget: TimeBudget,
}

/// What is left of the time a tenant's own plugins may take together for one
/// request (`plugins.request_budget_ms`). Operator plugins have their own
/// deadlines and do not spend it.
#[derive(Clone, Debug)]
pub struct TimeBudget(Arc<Mutex<Duration>>);

impl TimeBudget {
    /// A budget of `total`.
    pub fn new(total: Duration) -> TimeBudget {
        TimeBudget(Arc::new(Mutex::new(total)))
    }

    fn left(&self) -> Duration {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spend(&self, spent: Duration) {
        let mut left = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *left = left.saturating_sub(spent);
    }
}

/// What the route chain decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// A plugin picked this candidate.
    To {
        /// The model.
        model: String,
        /// The plugin that picked it.
        plugin: String,
    },
    /// No plugin picked one: the client's model stands.
    Unchanged,
    /// A plugin failed: the request is refused (503 `policy_unavailable`).
    Fault {
        /// The plugin.
        plugin: String,
        /// How it failed.
        kind: FaultKind,
    },
}

/// What a plugin sees of `input`.
fn view_of(input: &AdmitInput) -> RequestView {
    RequestView {
        request_id: input.request.0,
        tenant: input.tenant_name.clone(),
        model: input.model.clone(),
        endpoint: if input.chat {
            Endpoint::ChatCompletions
        } else {
            Endpoint::Completions
        },
        prompt_tokens: input.prompt_tokens,
        max_tokens: input.max_tokens,
        stream: input.stream,
        priority: PRIORITY_DEFAULT,
        headers: input
            .headers
            .iter()
            .map(|(name, value)| Header {
                name: name.clone(),
                value: value.clone(),
            })
            .collect(),
    }
}

/// Who a plugin call is for.
struct CallFor {
    request: RequestId,
    tenant: TenantId,
    prompt_text: Option<Arc<str>>,
    engine: Option<EngineHandle>,
    /// The request's budget, for a tenant plugin's call.
    budget: Option<TimeBudget>,
}

/// A compiled plugin.
pub struct Plugin {
    /// Its name.
    pub name: Arc<str>,
    /// What its budgets, state and faults are keyed by ([`tenant_identity`],
    /// [`operator_identity`]): never a name a tenant chooses.
    pub identity: Arc<str>,
    /// Its tenant; None for an operator plugin.
    pub tenant: Option<TenantId>,
    /// Its version (uploads under its name).
    pub version: u32,
    /// Its place in the chain.
    pub order: u32,
    /// None when its code could not be loaded: every call fails closed.
    pre: Option<OperatorPolicyPre<CallState>>,
    /// Why its code could not be loaded.
    pub unloadable: Option<String>,
    limits: CallLimits,
    /// What an operator plugin does for a tenant it tripped for.
    on_trip: OnTrip,
    /// A tenant plugin past `faults_max`, reported to the control plane.
    tripped: AtomicBool,
}

/// The identity of a tenant's plugin: its id, which the tenant cannot choose.
pub fn tenant_identity(id: u64) -> String {
    format!("#{id}")
}

/// The identity of an operator plugin: its name in the policy file.
pub fn operator_identity(name: &str) -> String {
    format!("@{name}")
}

/// A plugin past `faults_max` faults in the window for a tenant: a tenant's
/// own plugin is to be disabled; an operator plugin trips for that tenant
/// alone (failing closed or skipped, as `on_trip` says) until the window
/// has passed.
#[derive(Clone, Debug)]
pub struct Trip {
    /// The tenant whose requests it faulted on.
    pub tenant: TenantId,
    /// Its name.
    pub plugin: String,
    /// Faults in the window.
    pub faults: u32,
    /// For an operator plugin: what it does meanwhile, and until when (Unix
    /// milliseconds). None for a tenant's plugin.
    pub operator: Option<(OnTrip, u64)>,
}

/// A request past the chain, until it ends.
struct Inflight {
    tenant: TenantId,
    tenant_name: String,
    chain: Vec<Arc<Plugin>>,
    arrived: Instant,
    engine: EngineHandle,
}

/// An ended request, for the completion thread.
struct Ended {
    request: RequestId,
    outcome: Outcome,
    usage: Usage,
}

/// A plugin's identity as it runs on one tenant's requests.
type PluginOnTenant = (TenantId, Arc<str>);

/// The plugin host.
pub struct PolicyRuntime {
    engine: Engine,
    tenant_linker: Linker<CallState>,
    operator_linker: Linker<CallState>,
    services: Arc<Services>,
    limits: CallLimits,
    faults_max: u32,
    fault_window: Duration,
    /// Faults in the window, by (calling tenant, plugin identity): kept apart
    /// from the plugin, so enabling or re-installing it resets nothing, and
    /// an operator plugin's faults on one tenant's requests count for that
    /// tenant alone.
    faults: Mutex<HashMap<PluginOnTenant, VecDeque<(Instant, FaultKind)>>>,
    /// Operator plugins tripped for a tenant, until when.
    operator_trips: Mutex<HashMap<PluginOnTenant, Instant>>,
    operator_prompt_text: bool,
    operator: Vec<Arc<Plugin>>,
    tenants: RwLock<HashMap<TenantId, Vec<Arc<Plugin>>>>,
    inflight: Mutex<HashMap<RequestId, Inflight>>,
    sealer: Sealer,
    trips: Mutex<Option<mpsc::Sender<Trip>>>,
    /// Where every call runs (its caller waits with a bound).
    calls: Calls,
    /// Where `on-complete` calls run: tenants in turn, bounded per tenant.
    completions: Lane,
    /// `plugins.request_budget_ms`.
    request_budget: Duration,
    /// This runtime, for the completion lane's jobs.
    me: OnceLock<Weak<PolicyRuntime>>,
    /// Whether an upload is being compiled: one at a time, and a compile
    /// abandoned at its timeout holds this until it really ends.
    compiling: Arc<(Mutex<bool>, std::sync::Condvar)>,
    /// `plugins.compile_timeout_ms`.
    compile_timeout: Duration,
    ticker_stop: Arc<AtomicBool>,
}

/// Wasmtime's engine for plugins: component model, fuel, epochs, pooling.
fn engine(config: &PluginsConfig) -> wasmtime::Result<Engine> {
    let mut pooling = wasmtime::PoolingAllocationConfig::default();
    let slots = config.instances_max;
    pooling
        .total_component_instances(slots)
        .total_core_instances(slots.saturating_mul(4))
        .total_memories(slots.saturating_mul(2))
        .total_tables(slots.saturating_mul(4))
        .max_memory_size(config.memory_bytes as usize)
        .max_memories_per_component(2)
        .max_core_instances_per_component(16)
        .max_tables_per_component(8)
        .table_elements(20_000)
        // Every linear memory goes back to zeros when its slot is freed: the
        // first MiB by memset (no page faults when the slot is reused, which
        // dominated a plugin call's cost), the rest by madvise.
        .linear_memory_keep_resident(1 << 20)
        .table_keep_resident(64 << 10);
    let mut wasm = wasmtime::Config::new();
    wasm.wasm_component_model(true)
        .consume_fuel(true)
        .epoch_interruption(true)
        .max_wasm_stack(512 << 10)
        .memory_reservation(config.memory_bytes.next_power_of_two().max(64 << 10))
        .memory_guard_size(64 << 10)
        .allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pooling));
    Engine::new(&wasm)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// What a failed compilation says about the component.
fn describe_compile(error: &wasmtime::Error) -> String {
    let text = format!("{error:#}");
    if text.contains("core module") || text.contains("component") {
        format!("not a WebAssembly component for wasm32-wasip2: {text}")
    } else {
        format!("not a valid WebAssembly component: {text}")
    }
}

fn clean_code(code: &str) -> String {
    let ok = !code.is_empty()
        && code.len() <= REJECT_CODE_BYTES_MAX
        && code
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        code.to_string()
    } else {
        "policy_rejected".into()
    }
}

/// Whether `c` is a format character a client's terminal or page would act
/// on without showing: bidirectional overrides and isolates, zero-width
/// characters, the byte-order mark.
fn is_invisible_format(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{061C}' | '\u{180E}'
        | '\u{200B}'..='\u{200F}'
        | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}'
        | '\u{2066}'..='\u{206F}'
        | '\u{FEFF}'
        | '\u{FFF9}'..='\u{FFFB}')
}

fn clean_message(message: &str) -> String {
    let mut out = String::new();
    for c in message
        .chars()
        .filter(|&c| !c.is_control() && !is_invisible_format(c))
    {
        if out.len() + c.len_utf8() > REJECT_MESSAGE_BYTES_MAX {
            break;
        }
        out.push(c);
    }
    out
}

/// The headers a plugin may see: lower-case names, no credentials, UTF-8
/// values of at most [`HEADER_BYTES_MAX`], at most [`HEADERS_MAX`].
pub fn plugin_headers(headers: &axum::http::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !CREDENTIAL_HEADERS.contains(&name.as_str()))
        .filter_map(|(name, value)| {
            let value = value.to_str().ok()?;
            (value.len() <= HEADER_BYTES_MAX)
                .then(|| (name.as_str().to_string(), value.to_string()))
        })
        .take(HEADERS_MAX)
        .collect()
}

fn outcome_of(reason: FinishReason) -> Outcome {
    match reason {
        FinishReason::Stop => Outcome::Stop,
        FinishReason::Length => Outcome::Length,
        FinishReason::Cancelled => Outcome::Cancelled,
        FinishReason::Timeout => Outcome::Timeout,
        FinishReason::Error
        | FinishReason::EngineFault
        | FinishReason::TransferFailed
        | FinishReason::PrefillRefused(_)
        | FinishReason::Exported => Outcome::Error,
        FinishReason::Shutdown => Outcome::Shutdown,
        FinishReason::TenantRemoved => Outcome::TenantRemoved,
        // The contract (0.1.0) has no outcome of its own for this: the engine
        // serving the request stopped, as at a shutdown.
        FinishReason::ModelRemoved => Outcome::Shutdown,
    }
}

impl PolicyRuntime {
    /// The runtime for `config`, with the operator's plugins compiled from
    /// their files; `store_dir` keeps the sealing secret.
    pub fn new(
        config: &Config,
        store: Arc<Store>,
        store_dir: &std::path::Path,
    ) -> Result<Arc<PolicyRuntime>, PolicyError> {
        let runtime_error = |e: wasmtime::Error| PolicyError::Runtime(format!("{e:#}"));
        let plugins = &config.plugins;
        let engine = engine(plugins).map_err(runtime_error)?;
        let sealer = Sealer::open(store_dir, &engine)
            .map_err(|e| PolicyError::Runtime(format!("{}: {e}", artifact::SECRET_FILE)))?;
        let mut runtime = PolicyRuntime {
            tenant_linker: host::linker(&engine, false).map_err(runtime_error)?,
            operator_linker: host::linker(&engine, true).map_err(runtime_error)?,
            engine,
            services: Arc::new(Services {
                budgets: Budgets::default(),
                state: PluginState::new(store),
            }),
            limits: CallLimits::of(plugins),
            faults_max: plugins.faults_max,
            fault_window: Duration::from_millis(plugins.fault_window_ms),
            faults: Mutex::new(HashMap::new()),
            operator_trips: Mutex::new(HashMap::new()),
            operator_prompt_text: plugins.operator_prompt_text,
            operator: Vec::new(),
            tenants: RwLock::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            sealer,
            trips: Mutex::new(None),
            calls: Calls::new(plugins.instances_max as usize),
            completions: Lane::new(
                "bulkhead-plugin-complete",
                "completion",
                plugins.complete_threads as usize,
                plugins.complete_queue_max as usize,
            )
            .map_err(|e| PolicyError::Runtime(format!("the completion lane: {e}")))?,
            request_budget: Duration::from_millis(plugins.request_budget_ms),
            me: OnceLock::new(),
            compiling: Arc::new((Mutex::new(false), std::sync::Condvar::new())),
            compile_timeout: Duration::from_millis(plugins.compile_timeout_ms),
            ticker_stop: Arc::new(AtomicBool::new(false)),
        };
        for (order, operator) in plugins.operator.iter().enumerate() {
            let path = config.resolve(&operator.path);
            let error = |message: String| PolicyError::Operator {
                name: operator.name.clone(),
                path: path.display().to_string(),
                message,
            };
            let bytes = std::fs::read(&path).map_err(|e| error(e.to_string()))?;
            let component = runtime.compile(&bytes, true).map_err(|e| error(e.0))?;
            let mut plugin = runtime
                .plugin(
                    Some(&component),
                    &operator.name,
                    &operator_identity(&operator.name),
                    None,
                    1,
                    order as u32,
                    runtime.limits,
                )
                .map_err(|e| error(e.0))?;
            plugin.on_trip = operator.on_trip;
            runtime.operator.push(Arc::new(plugin));
        }
        let runtime = Arc::new(runtime);
        let _ = runtime.me.set(Arc::downgrade(&runtime));
        runtime.start_ticker();
        Ok(runtime)
    }

    /// A fresh time budget for one request's tenant plugins.
    pub fn time_budget(&self) -> TimeBudget {
        TimeBudget::new(self.request_budget)
    }

    /// Plugin calls abandoned and still stuck in a host call.
    pub fn calls_stuck(&self) -> u32 {
        self.calls.stuck()
    }

    /// The deployment's call limits.
    pub fn limits(&self) -> CallLimits {
        self.limits
    }

    /// Where repeated faults are reported (the control plane disables the plugin).
    pub fn on_trip(&self, trips: mpsc::Sender<Trip>) {
        *self.trips.lock().unwrap_or_else(|p| p.into_inner()) = Some(trips);
    }

    /// Whether the request path should capture prompt text for operator plugins.
    pub fn wants_prompt_text(&self) -> bool {
        self.operator_prompt_text && !self.operator.is_empty()
    }

    /// Whether `tenant` has any plugin to run (operator plugins included).
    pub fn has_chain(&self, tenant: TenantId) -> bool {
        !self.operator.is_empty()
            || self
                .tenants
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(&tenant)
                .is_some_and(|c| !c.is_empty())
    }

    /// Ticks the engine's epoch every [`EPOCH_TICK`] until the runtime drops.
    fn start_ticker(self: &Arc<Self>) {
        let engine = self.engine.clone();
        let stop = Arc::clone(&self.ticker_stop);
        let _ = std::thread::Builder::new()
            .name("bulkhead-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            });
    }

    /// [`PolicyRuntime::compile`] for an upload: its shape checked first
    /// ([`shape::check`]), then compiled on a thread of its own, one upload at
    /// a time, within `plugins.compile_timeout_ms` (a compile past it is
    /// refused; its thread ends on its own, holding the compiler until then).
    pub fn compile_bounded(&self, bytes: &[u8], operator: bool) -> Result<Component, CompileError> {
        shape::check(bytes).map_err(CompileError::Invalid)?;
        let started = Instant::now();
        {
            let (busy, freed) = &*self.compiling;
            let guard = busy.lock().unwrap_or_else(|p| p.into_inner());
            let (mut guard, waited) = freed
                .wait_timeout_while(guard, self.compile_timeout, |busy| *busy)
                .unwrap_or_else(|p| p.into_inner());
            if waited.timed_out() && *guard {
                return Err(CompileError::Busy);
            }
            *guard = true;
        }
        let (done, compiled) = mpsc::channel();
        let (engine, bytes, compiling) = (
            self.engine.clone(),
            bytes.to_vec(),
            Arc::clone(&self.compiling),
        );
        let spawned = std::thread::Builder::new()
            .name("bulkhead-compile".into())
            .spawn(move || {
                let component = Component::new(&engine, &bytes);
                let (busy, freed) = &*compiling;
                *busy.lock().unwrap_or_else(|p| p.into_inner()) = false;
                freed.notify_one();
                let _ = done.send(component);
            });
        if let Err(error) = spawned {
            let (busy, freed) = &*self.compiling;
            *busy.lock().unwrap_or_else(|p| p.into_inner()) = false;
            freed.notify_one();
            return Err(CompileError::Invalid(format!(
                "could not start compiling: {error}"
            )));
        }
        let left = self.compile_timeout.saturating_sub(started.elapsed());
        let component = match compiled.recv_timeout(left) {
            Ok(compiled) => compiled.map_err(|e| CompileError::Invalid(describe_compile(&e)))?,
            Err(_) => {
                return Err(CompileError::Invalid(format!(
                    "it took longer than {} ms to compile",
                    self.compile_timeout.as_millis()
                )))
            }
        };
        host::check_imports(&self.engine, &component, operator).map_err(CompileError::Invalid)?;
        self.pre(&component, operator)
            .map_err(|e| CompileError::Invalid(e.0))?;
        Ok(component)
    }

    /// Compiles and validates a component for the tenant world (or the
    /// operator world): refused with a message when it is not one.
    pub fn compile(&self, bytes: &[u8], operator: bool) -> Result<Component, InvalidPlugin> {
        shape::check(bytes).map_err(InvalidPlugin)?;
        let component =
            Component::new(&self.engine, bytes).map_err(|e| InvalidPlugin(describe_compile(&e)))?;
        host::check_imports(&self.engine, &component, operator).map_err(InvalidPlugin)?;
        self.pre(&component, operator)?;
        Ok(component)
    }

    fn pre(
        &self,
        component: &Component,
        operator: bool,
    ) -> Result<OperatorPolicyPre<CallState>, InvalidPlugin> {
        let linker = if operator {
            &self.operator_linker
        } else {
            &self.tenant_linker
        };
        let pre = linker.instantiate_pre(component).map_err(|e| {
            InvalidPlugin(format!(
                "it imports what the host does not offer (the {} world of bulkhead:policy@0.1.0): {e:#}",
                if operator { "operator-policy" } else { "tenant-policy" }
            ))
        })?;
        OperatorPolicyPre::new(pre).map_err(|e| {
            InvalidPlugin(format!(
                "it does not export bulkhead:policy/policy@0.1.0 (admit, route, on-complete): {e:#}"
            ))
        })
    }

    /// A plugin of `component` (None: its code could not be loaded, and
    /// every call fails closed).
    #[allow(clippy::too_many_arguments)]
    fn plugin(
        &self,
        component: Option<&Component>,
        name: &str,
        identity: &str,
        tenant: Option<TenantId>,
        version: u32,
        order: u32,
        limits: CallLimits,
    ) -> Result<Plugin, InvalidPlugin> {
        Ok(Plugin {
            name: Arc::from(name),
            identity: Arc::from(identity),
            tenant,
            version,
            order,
            pre: component
                .map(|c| self.pre(c, tenant.is_none()))
                .transpose()?,
            unloadable: None,
            limits,
            on_trip: OnTrip::default(),
            tripped: AtomicBool::new(false),
        })
    }

    /// Instantiates `component` once under the limits `asked` for, calling
    /// nothing: an upload that asks for less memory (or fuel, or time) than
    /// its own instance needs is refused at upload, naming the limit, rather
    /// than faulting on every call.
    pub fn check_instantiates(
        &self,
        component: &Component,
        asked: &PluginLimitsRequest,
        tenant: TenantId,
    ) -> Result<(), String> {
        let limits = self.limits.lowered(asked)?;
        let plugin = Arc::new(
            self.plugin(Some(component), "upload", "#0", Some(tenant), 0, 0, limits)
                .map_err(|e| e.0)?,
        );
        let call_for = CallFor {
            request: RequestId(0),
            tenant,
            prompt_text: None,
            engine: None,
            budget: None,
        };
        let deadline = Instant::now() + limits.deadline;
        let job = self.call_job(&plugin, call_for, deadline, |_, _| Ok(()));
        match self.calls.run(tenant, deadline, job) {
            Ok(Ok(())) => Ok(()),
            Ok(Err((FaultKind::Memory, _))) => Err(format!(
                "its instance needs more linear memory than the {} bytes it asked for (memory_bytes)",
                limits.memory_bytes
            )),
            Ok(Err((FaultKind::Fuel, _))) => Err(format!(
                "instantiating it takes more than the {} fuel it asked for",
                limits.fuel
            )),
            Ok(Err((FaultKind::Deadline, _))) => Err(format!(
                "instantiating it takes longer than the {} ms it asked for",
                limits.deadline.as_millis()
            )),
            Ok(Err((_, error))) => Err(format!("it does not instantiate: {error}")),
            Err(lost) => Err(format!("it could not be instantiated to check it: {lost:?}")),
        }
    }

    /// The sealed compiled form of `component`, compiled from `wasm`, to keep
    /// in the store (it opens only for those bytes).
    pub fn seal(&self, component: &Component, wasm: &[u8]) -> Result<Vec<u8>, String> {
        self.sealer
            .seal(component, &sha256(wasm))
            .map_err(|e| format!("{e:#}"))
    }

    /// The component of `record`: from its sealed compiled form when this
    /// host sealed it, else compiled from `wasm` (and the new sealed form
    /// returned, to store).
    pub fn load(
        &self,
        sealed: Option<&[u8]>,
        wasm: &[u8],
    ) -> Result<(Component, Option<Vec<u8>>), InvalidPlugin> {
        let source = sha256(wasm);
        if let Some(component) =
            sealed.and_then(|s| self.sealer.open_sealed(&self.engine, s, &source))
        {
            // Sealed by an older host, it may predate today's import rules.
            host::check_imports(&self.engine, &component, false).map_err(InvalidPlugin)?;
            return Ok((component, None));
        }
        let component = self.compile(wasm, false)?;
        let sealed = self.seal(&component, wasm).ok();
        Ok((component, sealed))
    }

    /// Puts `record`'s plugin in its tenant's chain (replacing one of the same
    /// name), or takes it out when disabled.
    pub fn install(
        &self,
        record: &PluginRecord,
        component: &Component,
    ) -> Result<(), InvalidPlugin> {
        self.install_as(record, Ok(component))
    }

    /// Puts `record`'s plugin in its tenant's chain although its code could
    /// not be loaded (`why`): every call fails closed (503
    /// `policy_unavailable`) until it is uploaded again, disabled or deleted.
    /// A plugin the tenant enabled never silently stops applying.
    pub fn install_unloadable(&self, record: &PluginRecord, why: &str) {
        // The limits were valid when stored; a failure here leaves the
        // plugin out of the chain, which the caller logs.
        if let Err(error) = self.install_as(record, Err(why)) {
            tracing::error!(plugin = %record.name, %error, "an unloadable plugin could not be installed");
        }
    }

    fn install_as(
        &self,
        record: &PluginRecord,
        component: Result<&Component, &str>,
    ) -> Result<(), InvalidPlugin> {
        let tenant = TenantId(record.tenant);
        if !record.enabled {
            self.remove(tenant, &record.name);
            return Ok(());
        }
        // The new version is built before the old one goes, and swapped in
        // under one lock: no request ever finds the chain without it.
        let built = self
            .limits
            .lowered(&record.limits)
            .map_err(InvalidPlugin)
            .and_then(|limits| {
                self.plugin(
                    component.ok(),
                    &record.name,
                    &tenant_identity(record.id),
                    Some(tenant),
                    record.version,
                    record.order,
                    limits,
                )
            });
        let mut plugin = match built {
            Ok(plugin) => plugin,
            Err(error) => {
                self.remove(tenant, &record.name);
                return Err(error);
            }
        };
        plugin.unloadable = component.err().map(str::to_string);
        let plugin = Arc::new(plugin);
        let mut tenants = self.tenants.write().unwrap_or_else(|p| p.into_inner());
        let chain = tenants.entry(tenant).or_default();
        chain.retain(|p| *p.name != *record.name);
        chain.push(plugin);
        chain.sort_by(|a, b| a.order.cmp(&b.order).then_with(|| a.name.cmp(&b.name)));
        Ok(())
    }

    /// Takes a plugin out of its tenant's chain (requests already past
    /// admission keep theirs).
    pub fn remove(&self, tenant: TenantId, name: &str) {
        let mut tenants = self.tenants.write().unwrap_or_else(|p| p.into_inner());
        if let Some(chain) = tenants.get_mut(&tenant) {
            chain.retain(|p| &*p.name != name);
        }
    }

    /// Forgets everything of a deleted plugin (`name`, `identity`), or all
    /// of a deleted tenant's (None).
    pub fn forget(&self, tenant: TenantId, plugin: Option<(&str, &str)>) {
        match plugin {
            Some((name, _)) => self.remove(tenant, name),
            None => {
                self.tenants
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&tenant);
            }
        }
        let identity = plugin.map(|(_, identity)| identity);
        self.services.budgets.forget(tenant, identity);
        let forgotten =
            |(t, i): &(TenantId, Arc<str>)| *t == tenant && identity.is_none_or(|id| &**i == id);
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| !forgotten(k));
        self.operator_trips
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| !forgotten(k));
    }

    /// The names of the operator's plugins (reserved: no tenant plugin may
    /// take one).
    pub fn operator_names(&self) -> Vec<String> {
        self.operator.iter().map(|p| p.name.to_string()).collect()
    }

    /// Why `tenant`'s plugin `name` is in its chain but fails closed (its
    /// code could not be loaded), if it is.
    /// Faults of `tenant`'s plugin `id` on its requests within the fault
    /// window now, and the latest one's kind (`fuel`, `deadline`, `trap`...).
    pub fn recent_faults(&self, tenant: TenantId, id: u64) -> (u32, Option<&'static str>) {
        let key: PluginOnTenant = (tenant, Arc::from(tenant_identity(id)));
        let ledger = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let Some(faults) = ledger.get(&key) else {
            return (0, None);
        };
        let now = Instant::now();
        let recent = faults
            .iter()
            .filter(|&&(at, _)| now.duration_since(at) <= self.fault_window);
        let (count, last) = recent.fold((0, None), |(n, _), &(_, kind)| (n + 1, Some(kind)));
        (count, last.map(FaultKind::as_str))
    }

    pub fn unloadable(&self, tenant: TenantId, name: &str) -> Option<String> {
        self.tenants
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&tenant)?
            .iter()
            .find(|p| &*p.name == name)?
            .unloadable
            .clone()
    }

    /// The plugin state store (the control plane deletes a plugin's state).
    pub fn state(&self) -> &PluginState {
        &self.services.state
    }

    /// Runs the chain for a request (blocking: call it on the lane). Every
    /// plugin that admits holds its bookings until the request ends; a
    /// reject, a fault, or the request's caller gone (`cancel`, checked
    /// between calls) gives them back at once.
    pub fn admit(&self, input: AdmitInput, cancel: &Cancel) -> Verdict {
        let chain = self.chain_of(input.tenant);
        if chain.is_empty() {
            return Verdict::Admit {
                max_tokens: None,
                priority: None,
            };
        }
        let mut view = view_of(&input);
        let (mut max_tokens, mut priority) = (None, None);
        for plugin in &chain {
            if cancel.is_cancelled() {
                self.services.budgets.release(input.request, Instant::now());
                return Verdict::Cancelled;
            }
            let asked = view.clone();
            let decision = self.call(plugin, self.call_for(plugin, &input), move |p, store| {
                p.bulkhead_policy_policy().call_admit(store, &asked)
            });
            match decision {
                Err(kind) => {
                    self.services.budgets.release(input.request, Instant::now());
                    return Verdict::Fault {
                        plugin: plugin.name.to_string(),
                        kind,
                    };
                }
                Ok(Decision::Reject(r)) => {
                    self.services.budgets.release(input.request, Instant::now());
                    return Verdict::Reject(PluginRejection {
                        plugin: plugin.name.to_string(),
                        status: if matches!(r.status, 400 | 403 | 429) {
                            r.status
                        } else {
                            403
                        },
                        code: clean_code(&r.code),
                        message: clean_message(&r.message),
                        retry_after_secs: r
                            .retry_after_ms
                            .map(|ms| ms.div_ceil(1000).clamp(1, RETRY_AFTER_SECS_MAX)),
                    });
                }
                Ok(Decision::Admit(Adjustments {
                    max_tokens: m,
                    priority: p,
                })) => {
                    if let Some(m) = m.filter(|&m| m >= 1 && m < view.max_tokens) {
                        view.max_tokens = m;
                        max_tokens = Some(m);
                    }
                    if let Some(p) = p.filter(|&p| p < view.priority) {
                        view.priority = p;
                        priority = Some(p);
                    }
                }
            }
        }
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                input.request,
                Inflight {
                    tenant: input.tenant,
                    tenant_name: input.tenant_name,
                    chain,
                    arrived: Instant::now(),
                    engine: input.engine,
                },
            );
        Verdict::Admit {
            max_tokens,
            priority,
        }
    }

    /// Asks the chain which of `candidates` (the models the tenant may use,
    /// more than one) should serve the request: operator plugins first, then
    /// the tenant's; the first that names a candidate decides. A plugin that
    /// names anything else is ignored (logged); one that faults fails the
    /// request closed, as in [`PolicyRuntime::admit`]. With the request's
    /// caller gone (`cancel`), the rest of the chain is not asked.
    pub fn route(&self, input: &AdmitInput, candidates: &[String], cancel: &Cancel) -> Route {
        let chain = self.chain_of(input.tenant);
        let view = Arc::new(view_of(input));
        let candidates: Arc<[String]> = candidates.into();
        for plugin in &chain {
            if cancel.is_cancelled() {
                return Route::Unchanged;
            }
            let (asked, offered) = (Arc::clone(&view), Arc::clone(&candidates));
            let picked = self.call(plugin, self.call_for(plugin, input), move |p, store| {
                p.bulkhead_policy_policy()
                    .call_route(store, &asked, &offered)
            });
            match picked {
                Err(kind) => {
                    return Route::Fault {
                        plugin: plugin.name.to_string(),
                        kind,
                    }
                }
                Ok(None) => {}
                Ok(Some(model)) if candidates.contains(&model) => {
                    return Route::To {
                        model,
                        plugin: plugin.name.to_string(),
                    }
                }
                Ok(Some(_)) => {
                    tracing::warn!(
                        request_id = input.request.0,
                        tenant = %input.tenant_name,
                        plugin = %plugin.name,
                        "route named a model that is not a candidate; ignored"
                    );
                }
            }
        }
        Route::Unchanged
    }

    /// Who `plugin`'s call for `input` is for: the prompt text only for an
    /// operator plugin (and only when captured), the request's time budget
    /// only for a tenant plugin.
    fn call_for(&self, plugin: &Plugin, input: &AdmitInput) -> CallFor {
        let operator = plugin.tenant.is_none();
        CallFor {
            request: input.request,
            tenant: input.tenant,
            prompt_text: operator.then(|| input.prompt_text.clone()).flatten(),
            engine: Some(input.engine.clone()),
            budget: (!operator).then(|| input.budget.clone()),
        }
    }

    /// The plugins that run for `tenant`'s requests: the operator's (but
    /// one tripped for this tenant with `on_trip = "skip"`), then its own
    /// enabled ones, in order.
    fn chain_of(&self, tenant: TenantId) -> Vec<Arc<Plugin>> {
        let tenants = self.tenants.read().unwrap_or_else(|p| p.into_inner());
        self.operator
            .iter()
            .filter(|p| p.on_trip != OnTrip::Skip || !self.tripped_for(p, tenant))
            .chain(
                tenants
                    .get(&tenant)
                    .into_iter()
                    .flatten()
                    .filter(|p| !p.tripped.load(Ordering::Relaxed)),
            )
            .cloned()
            .collect()
    }

    /// Whether operator plugin `plugin` is tripped for `tenant` now.
    fn tripped_for(&self, plugin: &Plugin, tenant: TenantId) -> bool {
        let key = (tenant, Arc::clone(&plugin.identity));
        let mut trips = self
            .operator_trips
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match trips.get(&key) {
            Some(&until) if until > Instant::now() => true,
            Some(_) => {
                // The window passed: it runs again for this tenant.
                trips.remove(&key);
                false
            }
            None => false,
        }
    }

    /// The request the chain admitted was refused afterwards (a full queue,
    /// the engine gone, its client gone): its bookings come back, its plugins
    /// hear `refused`.
    pub fn refused(&self, request: RequestId, prompt_tokens: u32) {
        self.services.budgets.release(request, Instant::now());
        self.send_ended(Ended {
            request,
            outcome: Outcome::Refused,
            usage: Usage {
                prompt_tokens,
                ..Usage::default()
            },
        });
    }

    /// A request ended in the engine (any reason): bookings are reconciled
    /// with its real tokens and its plugins hear how it went. Cheap: called
    /// on the engine thread.
    pub fn finished(&self, request: RequestId, reason: FinishReason, usage: Usage) {
        let tokens = u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens);
        self.services
            .budgets
            .reconcile(request, tokens, Instant::now());
        self.send_ended(Ended {
            request,
            outcome: outcome_of(reason),
            usage,
        });
    }

    /// Queues `on-complete` for an ended request the chain admitted, in its
    /// tenant's turn on the completion lane; past the tenant's queue cap it is
    /// dropped (counted), and nobody else waits for it.
    fn send_ended(&self, ended: Ended) {
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        let Some(known) = inflight.remove(&ended.request) else {
            return;
        };
        drop(inflight);
        let Some(me) = self.me.get().cloned() else {
            return;
        };
        let (tenant, tenant_name, request) =
            (known.tenant, known.tenant_name.clone(), ended.request);
        let queued = self.completions.spawn(tenant, move || {
            if let Some(runtime) = me.upgrade() {
                runtime.complete(ended, known);
            }
        });
        if queued.is_err() {
            crate::telemetry::count_plugin_completion_dropped(&tenant_name);
            tracing::warn!(request_id = request.0, tenant = %tenant_name, "on-complete dropped: the tenant's completion queue is full");
        }
    }

    /// `on-complete` for every plugin of an ended request's chain; the
    /// tenant's own plugins share one time budget.
    fn complete(&self, ended: Ended, inflight: Inflight) {
        let completion = Completion {
            request_id: ended.request.0,
            outcome: ended.outcome,
            prompt_tokens: ended.usage.prompt_tokens,
            completion_tokens: ended.usage.completion_tokens,
            elapsed_ms: inflight
                .arrived
                .elapsed()
                .as_millis()
                .min(u128::from(u32::MAX)) as u32,
        };
        let budget = self.time_budget();
        for plugin in &inflight.chain {
            let call_for = CallFor {
                request: ended.request,
                tenant: inflight.tenant,
                prompt_text: None,
                engine: Some(inflight.engine.clone()),
                budget: plugin.tenant.is_some().then(|| budget.clone()),
            };
            let result = self.call(plugin, call_for, move |p, store| {
                p.bulkhead_policy_policy()
                    .call_on_complete(store, completion)
            });
            if let Err(kind) = result {
                tracing::warn!(
                    request_id = ended.request.0,
                    tenant = %inflight.tenant_name,
                    plugin = %plugin.name,
                    fault = kind.as_str(),
                    "on-complete failed"
                );
            }
        }
    }

    /// One call in a fresh instance, with every limit set, on a plugin worker
    /// this thread waits for with a bound ([`calls`]); a fault is counted
    /// against the plugin.
    fn call<R: Send + 'static>(
        &self,
        plugin: &Arc<Plugin>,
        call_for: CallFor,
        f: impl FnOnce(
                &host::bindings::OperatorPolicy,
                &mut WasmStore<CallState>,
            ) -> wasmtime::Result<R>
            + Send
            + 'static,
    ) -> Result<R, FaultKind> {
        let started = Instant::now();
        let (request, tenant) = (call_for.request, call_for.tenant);
        let budget = call_for.budget.clone();
        let (time, spent) = match &budget {
            Some(budget) => {
                let left = budget.left();
                (plugin.limits.deadline.min(left), left < BUDGET_CALL_MIN)
            }
            None => (plugin.limits.deadline, false),
        };
        let result = if plugin.pre.is_none() {
            Err((
                FaultKind::Unloadable,
                format!(
                    "its code could not be loaded: {}",
                    plugin.unloadable.as_deref().unwrap_or("unknown")
                ),
            ))
        } else if plugin.tenant.is_none() && self.tripped_for(plugin, tenant) {
            Err((
                FaultKind::Tripped,
                "tripped for this tenant by its own faults".into(),
            ))
        } else if spent {
            Err((
                FaultKind::Budget,
                "the request's plugin time budget is spent".into(),
            ))
        } else {
            let job = self.call_job(plugin, call_for, started + time, f);
            match self.calls.run(tenant, started + time, job) {
                Ok(result) => result,
                Err(CallLost::Abandoned) => Err((
                    FaultKind::Abandoned,
                    "still running past its deadline (in a host call); abandoned".into(),
                )),
                Err(CallLost::TenantStuck) => Err((
                    FaultKind::Unavailable,
                    "the tenant has the most abandoned plugin calls still stuck".into(),
                )),
                Err(CallLost::NoWorker) => Err((
                    FaultKind::Unavailable,
                    "no plugin worker took the call before its deadline".into(),
                )),
                Err(CallLost::Panicked) => Err((FaultKind::Trap, "the host panicked".into())),
            }
        };
        if let Some(budget) = &budget {
            budget.spend(started.elapsed());
        }
        let outcome = match &result {
            Ok(_) => "ok",
            Err((kind, _)) => kind.as_str(),
        };
        crate::telemetry::count_plugin_call(outcome);
        result.map_err(|(kind, error)| {
            tracing::warn!(request_id = request.0, plugin = %plugin.name, fault = kind.as_str(), error = %error, "plugin call failed");
            if kind.counts() {
                self.fault(plugin, tenant, kind);
            }
            kind
        })
    }

    /// The work of one call, for a plugin worker: a store with every limit,
    /// a fresh instance, the export.
    fn call_job<R: Send + 'static>(
        &self,
        plugin: &Arc<Plugin>,
        call_for: CallFor,
        deadline: Instant,
        f: impl FnOnce(
                &host::bindings::OperatorPolicy,
                &mut WasmStore<CallState>,
            ) -> wasmtime::Result<R>
            + Send
            + 'static,
    ) -> impl FnOnce() -> Result<R, (FaultKind, String)> + Send + 'static {
        let (engine, services, plugin) = (
            self.engine.clone(),
            Arc::clone(&self.services),
            Arc::clone(plugin),
        );
        move || {
            let Some(pre) = &plugin.pre else {
                return Err((FaultKind::Unloadable, "no code".into()));
            };
            let limits = plugin.limits;
            let state = CallState {
                table: ResourceTable::new(),
                limits: StoreLimitsBuilder::new()
                    .memory_size(limits.memory_bytes as usize)
                    .instances(16)
                    .tables(8)
                    .memories(2)
                    .trap_on_grow_failure(true)
                    .build(),
                call: Call {
                    request: call_for.request,
                    tenant: call_for.tenant,
                    plugin: Arc::clone(&plugin.name),
                    identity: Arc::clone(&plugin.identity),
                    deadline,
                    host_calls_left: limits.host_calls,
                    handles_left: limits.handles,
                    log_lines_left: host::LOG_LINES_MAX,
                    memory_max: limits.memory_bytes,
                    prompt_text: call_for.prompt_text,
                    engine: call_for.engine,
                    services,
                },
            };
            let mut store = WasmStore::new(&engine, state);
            store.limiter(|s| &mut s.limits);
            let left = deadline.saturating_duration_since(Instant::now());
            let ticks = (left.as_millis() as u64 / EPOCH_TICK.as_millis() as u64).max(1);
            store.set_epoch_deadline(ticks);
            store.epoch_deadline_trap();
            store
                .set_fuel(limits.fuel)
                .and_then(|()| pre.instantiate(&mut store))
                .and_then(|instance| f(&instance, &mut store))
                .map_err(|error| (FaultKind::of(&error), format!("{error:#}")))
        }
    }

    /// Counts a fault of `plugin` on `tenant`'s request; past `faults_max`
    /// in the window, a tenant's plugin is reported to be disabled, and an
    /// operator plugin trips for that tenant alone.
    fn fault(&self, plugin: &Arc<Plugin>, tenant: TenantId, kind: FaultKind) {
        let now = Instant::now();
        let key = (tenant, Arc::clone(&plugin.identity));
        let count = {
            let mut ledger = self.faults.lock().unwrap_or_else(|p| p.into_inner());
            let faults = ledger.entry(key.clone()).or_default();
            faults.push_back((now, kind));
            while faults
                .front()
                .is_some_and(|&(at, _)| now.duration_since(at) > self.fault_window)
            {
                faults.pop_front();
            }
            let count = faults.len() as u32;
            if count >= self.faults_max && plugin.tenant.is_none() {
                // A trip starts the count afresh for when it ends.
                ledger.remove(&key);
            }
            count
        };
        if count < self.faults_max {
            return;
        }
        let operator = match plugin.tenant {
            Some(_) => {
                if plugin.tripped.swap(true, Ordering::SeqCst) {
                    return;
                }
                None
            }
            None => {
                let until = now + self.fault_window;
                self.operator_trips
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key, until);
                let until_ms = now_ms() + self.fault_window.as_millis() as u64;
                Some((plugin.on_trip, until_ms))
            }
        };
        crate::telemetry::count_plugin_disabled();
        tracing::warn!(plugin = %plugin.name, tenant = tenant.0, faults = count, last = kind.as_str(), operator = operator.is_some(), "plugin tripped after repeated faults");
        if let Some(tx) = &*self.trips.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = tx.send(Trip {
                tenant,
                plugin: plugin.name.to_string(),
                faults: count,
                operator,
            });
        }
    }
}

impl Drop for PolicyRuntime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}
