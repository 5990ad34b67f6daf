//! `bulkhead serve`: start-up, listeners and graceful shutdown.
//!
//! 1. **Policy and state**: load the policy; open the control-plane store; seed
//!    it from the policy when it is empty, add environment keys, generate what
//!    is missing (keys, the admin token), shown once on stdout, never in the log
//!    ([`seed`]).
//! 2. **Check the catalog** — the policy's `[[models]]`, then the models added
//!    through the admin API — from the files' headers, before anything is
//!    allocated: every model's capacity contract with the tenants that may use
//!    it (I2), and all weights and KV pools against `engine.memory_max`. The
//!    tables go to stderr; a violation refuses to start, naming the model and
//!    the limit.
//! 3. **Engines**: each model gets its own KV pool with a partition per tenant
//!    that may use it, its backend and its scheduler on its own thread
//!    ([`catalog::load`]); the control plane ([`Control`]) keeps every engine in
//!    step with the store, and loads and unloads models.
//! 4. **Listen**: inference and admin listeners (HTTP/1.1 and HTTP/2, optional
//!    TLS), each with its connection limits (`accept`: caps in all and per
//!    peer, handshake and idle deadlines); each bound address is printed to
//!    stderr as `listening: <name> <url>`.
//! 5. **Shut down** on SIGINT/SIGTERM: stop accepting, mark not ready, let
//!    in-flight requests finish until `server.drain_timeout_ms`, then stop the
//!    engine (whatever is left ends with reason `shutdown`).

mod accept;

use crate::api::ids::RequestIds;
use crate::api::{self, App, Serving};
use crate::capacity::{Capacity, CapacityViolation, MemoryBudget, MemoryViolation};
use crate::catalog::{self, Catalog, LoadError, Source};
use crate::clock::now_ms;
use crate::config::{Config, ConfigError, ModelSpec, TlsConfig, MODELS_MAX};
use crate::engine::request::{FinishReason, RequestId, Usage};
use crate::engine::scheduler::{EngineFault, FinishSink};
use crate::lane::Lane;
use crate::policy::{PolicyError, PolicyRuntime, Trip};
use crate::store::records::TenantRecord;
use crate::store::usage::UsageBook;
use crate::store::{Store, StoreError};
use crate::telemetry;
use crate::tenancy::control::{self, Actor, Control, ControlError, Parts, TenantRef};
use crate::tenancy::seed::{self, SeedError};
use crate::tenancy::{Directory, Registry, TenantId};
use accept::{Accept, ConnectionLimits};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

/// Most async worker threads (model compute has its own threads).
pub const HTTP_WORKER_THREADS_MAX: usize = 4;
/// After the engine stopped, how long streams get to send their final error event.
pub const FINAL_EVENTS_FLUSH: Duration = Duration::from_millis(200);
/// How long the runtime waits for its remaining tasks at exit.
pub const RUNTIME_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);

/// Command-line overrides of the policy.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// The policy file.
    pub config: PathBuf,
    /// A policy already read (`serve --model`, [`crate::single`]): used
    /// instead of reading `config`.
    pub policy: Option<Config>,
    /// Overrides `server.listen`.
    pub listen: Option<SocketAddr>,
    /// Overrides `server.admin_listen`.
    pub admin_listen: Option<SocketAddr>,
    /// Overrides `store.path` (relative to the working directory).
    pub store: Option<PathBuf>,
    /// The log's format (default: text on a terminal, JSON otherwise).
    pub log_format: Option<telemetry::LogFormat>,
    /// Overrides `server.role`.
    pub role: Option<crate::transfer::Role>,
    /// Overrides `server.transfer_listen`.
    pub transfer_listen: Option<String>,
    /// Replaces `server.prefill_peers` when not empty.
    pub prefill_peers: Vec<String>,
    /// Overrides `engine.backend` (models that name their own keep it).
    pub backend: Option<crate::engine::placement::BackendChoice>,
    /// Sets `[engine.cuda] graphs = false`.
    pub enforce_eager: bool,
    /// Sets `[engine.cuda] tensor_cores = false`.
    pub no_tensor_cores: bool,
    /// Sets `[engine.cuda] dependent_launches = false`.
    pub no_dependent_launches: bool,
}

/// Why the server could not start (or stopped with an error).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The policy file.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A model's capacity contract (the message names the model and the limit).
    #[error(transparent)]
    Capacity(#[from] CapacityViolation),
    /// The catalog does not fit `engine.memory_max` (the message names the model).
    #[error(transparent)]
    Memory(#[from] MemoryViolation),
    /// A model could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The catalog itself (an id defined twice, too many models).
    #[error("catalog: {0}")]
    Catalog(String),
    /// The control-plane store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Keys and the admin token.
    #[error(transparent)]
    Seed(#[from] SeedError),
    /// The plugin runtime or an operator plugin.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// Loading the stored plugins.
    #[error("plugins: {0}")]
    Plugins(Box<ControlError>),
    /// TLS set-up.
    #[error("tls: {0}")]
    Tls(String),
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {cause}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        cause: std::io::Error,
    },
    /// Metrics set-up.
    #[error("metrics: {0}")]
    Metrics(String),
    /// Disaggregation set-up (the secret, the transfer listener).
    #[error("transfer: {0}")]
    Transfer(String),
    /// Threads, the runtime, signals, randomness.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<ControlError> for ServeError {
    fn from(error: ControlError) -> ServeError {
        ServeError::Plugins(Box::new(error))
    }
}

/// The store of `config`'s backend.
pub fn open_store(config: &Config) -> Result<Store, crate::store::StoreError> {
    match config.store.backend {
        crate::config::StoreBackend::Sled => Store::open(&config.store_path()),
        crate::config::StoreBackend::Etcd => {
            Store::open_etcd(&config.store.etcd, &config.store_path())
        }
    }
}

/// Runs the server until SIGINT/SIGTERM and a drain.
pub fn serve(options: ServeOptions) -> Result<(), ServeError> {
    telemetry::init_tracing(
        options
            .log_format
            .unwrap_or_else(telemetry::LogFormat::for_stderr),
    );
    telemetry::install_panic_hook();
    let policy = match options.policy.clone() {
        Some(policy) => policy,
        None => Config::load(&options.config)?,
    };
    let config = Arc::new(options.apply(policy)?);
    let role = config.server.role;
    let transfer_secret = match role {
        crate::transfer::Role::Both => None,
        _ => Some(crate::transfer::secret_from_env().map_err(ServeError::Transfer)?),
    };
    let store = Arc::new(
        open_store(&config)?
            .with_audit_max(config.store.audit_records_max)
            .with_refusals_per_tenant_max(config.store.audit_refusals_per_tenant_max),
    );
    let seeded = store.meta()?.is_some();
    let specs = catalog_of(&config, &store)?;
    let inspected = specs
        .iter()
        .map(|(spec, _)| catalog::inspect(spec, config.engine.backend))
        .collect::<Result<Vec<_>, _>>()?;
    if !seeded {
        // A policy that breaks the contract must not seed the store first:
        // fixing the file would not fix a seeded store.
        let tenants: Vec<TenantRecord> = seed::policy_tenants(&config);
        for ((spec, _), file) in specs.iter().zip(&inspected) {
            let quotas = catalog::quotas_for(spec, &tenants);
            Capacity::of_model(spec, file.file_context_tokens, &quotas).check()?;
        }
    }
    // Every check comes before any secret is written (seed module doc): a
    // start that fails leaves no key it did not show.
    seed::seed_if_empty(&config, &store)?;
    let plan = seed::plan(&config, &store, |var| std::env::var(var).ok())?;
    let (tenants, keys) = (store.tenants()?, plan.keys_after(store.keys()?));
    for ((spec, _), file) in specs.iter().zip(&inspected) {
        let quotas = catalog::quotas_for(spec, &tenants);
        let capacity = Capacity::of_model(spec, file.file_context_tokens, &quotas);
        eprint!("{}", capacity.table());
        capacity.check()?;
    }
    let memory = MemoryBudget {
        max_bytes: config.engine.memory_max,
        device_max_bytes: crate::engine::placement::device_memory_max(
            config.engine.device_memory_max,
        ),
        models: inspected.iter().map(|i| i.memory.clone()).collect(),
    };
    eprint!("{}", memory.table());
    memory.check()?;
    let tls = match &config.server.tls {
        Some(tls) => Some(tls_acceptor(tls, &config)?),
        None => None,
    };
    let bound = bind_listeners(&config)?;
    let transfer_listener = match &config.server.transfer_listen {
        Some(addr) => {
            let parsed: crate::transfer::PeerAddr = addr.parse().map_err(ServeError::Transfer)?;
            Some(crate::transfer::bind(&parsed).map_err(|e| {
                ServeError::Transfer(format!("cannot listen for decode peers on {addr}: {e}"))
            })?)
        }
        None => None,
    };
    let registry = Arc::new(Registry::new(Directory::build(&tenants, &keys, None)));
    let usage = Arc::new(UsageBook::new(
        config.store.audit_refusals_listed_per_interval,
    ));
    let finishes = Arc::new(Finishes {
        usage: Arc::clone(&usage),
        policy: OnceLock::new(),
    });
    let catalog = Arc::new(Catalog::default());
    for (spec, source) in specs {
        let sink = Arc::clone(&finishes) as Arc<dyn FinishSink>;
        let loaded = match catalog::load(
            spec,
            source,
            &tenants,
            sink,
            config.server.role,
            &config.engine,
            None,
        ) {
            Ok(loaded) => loaded,
            Err(error) => {
                stop_engines(&catalog, FinishReason::Shutdown);
                return Err(error.into());
            }
        };
        catalog.insert(loaded);
    }
    let metrics = telemetry::install_metrics().map_err(|e| ServeError::Metrics(e.to_string()))?;
    let policy = PolicyRuntime::new(&config, Arc::clone(&store), &config.store_path())?;
    let _ = finishes.policy.set(Arc::clone(&policy));
    let control = Arc::new(Control::new(Parts {
        store: Arc::clone(&store),
        registry,
        catalog: Arc::clone(&catalog),
        policy: Arc::clone(&policy),
        usage: Arc::clone(&usage),
        config: Arc::clone(&config),
        finishes: Arc::clone(&finishes) as Arc<dyn FinishSink>,
        tenants: tenants.clone(),
        admin_token_sha256: plan.admin_token_sha256,
    }));
    control.load_plugins()?;
    // Everything that could refuse the start has run: the secrets are
    // written, then shown, to the terminal that started the server, not to
    // the log stream (stderr).
    for line in plan.commit(&store)? {
        println!("{line}");
    }
    let app = Arc::new(App {
        serving: Serving {
            lane: Lane::new(
                "bulkhead-lane",
                "request",
                config.server.tokenize_threads as usize,
                crate::tenancy::PENDING_LIMIT as usize,
            )?,
            body_bytes_max: config.server.body_bytes_max,
            request_timeout: Duration::from_millis(config.server.request_timeout_ms),
            canary_guard: config.server.canary_guard,
            prefill_only: config.server.role == crate::transfer::Role::Prefill,
        },
        policy: Arc::clone(&policy),
        control: Arc::clone(&control),
        metrics,
        shutting_down: AtomicBool::new(false),
        ids: RequestIds::random()?,
    });
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(HTTP_WORKER_THREADS_MAX);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("bulkhead-http")
        .enable_all()
        .build()?;
    if let Some(secret) = transfer_secret {
        start_transfer(&config, &catalog, &runtime, secret, transfer_listener)?;
    }
    let drain = Duration::from_millis(config.server.drain_timeout_ms);
    let flush_every = Duration::from_millis(config.store.usage_flush_ms);
    // A shared store: follow the other servers' changes.
    let follower = runtime.spawn(Arc::clone(&control).follow());
    let flusher = runtime.spawn(flush_usage(
        Arc::clone(&usage),
        Arc::clone(&store),
        flush_every,
        Duration::from_secs(config.store.audit_retention_days * 86_400),
    ));
    let summaries = match config.server.summary_interval_ms {
        0 => None,
        ms => Some(runtime.spawn(log_summaries(
            Arc::clone(&catalog),
            Duration::from_millis(ms),
        ))),
    };
    let (trips, tripped) = std::sync::mpsc::channel();
    policy.on_trip(trips);
    runtime.spawn_blocking(move || disable_tripped(&control, tripped));
    let result = runtime.block_on(run_listeners(&config, Arc::clone(&app), drain, bound, tls));
    // Whatever did not finish within the drain ends now (reason `shutdown`).
    stop_engines(&catalog, FinishReason::Shutdown);
    // Streams still open (past the drain deadline) get their error event out.
    runtime.block_on(async { tokio::time::sleep(FINAL_EVENTS_FLUSH).await });
    flusher.abort();
    follower.abort();
    if let Some(summaries) = summaries {
        summaries.abort();
    }
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
    flush_once(&usage, &store);
    tracing::info!("stopped");
    result
}

/// Role `decode`: every model's job dispatcher and pairing probe; role
/// `prefill`: the listener for decode peers.
fn start_transfer(
    config: &Config,
    catalog: &Arc<Catalog>,
    runtime: &tokio::runtime::Runtime,
    secret: crate::transfer::link::Secret,
    listener: Option<crate::transfer::Listener>,
) -> Result<(), ServeError> {
    use crate::transfer::{self, Role};
    let timeouts = transfer::link::Timeouts {
        connect: Duration::from_secs(2),
        frame: Duration::from_millis(config.server.transfer_frame_timeout_ms),
    };
    match config.server.role {
        Role::Both => {}
        Role::Decode => {
            let addrs = config
                .server
                .prefill_peers
                .iter()
                .map(|a| a.parse())
                .collect::<Result<Vec<_>, _>>()
                .map_err(ServeError::Transfer)?;
            let tls = match &config.server.transfer_tls {
                Some(tls) => Some(
                    transfer::tls::ClientTls::load(tls, |p| config.resolve(p))
                        .map_err(ServeError::Transfer)?,
                ),
                None => None,
            };
            let peers = Arc::new(transfer::Peers::new(addrs, secret.clone(), timeouts, tls));
            transfer::set_decode(transfer::DecodeSetup {
                connector: transfer::peer_connector(peers),
                secret,
                timeouts,
            });
            let _runtime = runtime.enter();
            for model in catalog.snapshot().all() {
                transfer::start_model(model);
            }
            tracing::info!(peers = ?config.server.prefill_peers, "role decode: prompts' KV from prefill peers");
        }
        Role::Prefill => {
            let listener = listener.expect("role prefill binds its transfer listener");
            let tls = match &config.server.transfer_tls {
                Some(tls) => Some(
                    transfer::tls::ServerTls::load(tls, |p| config.resolve(p))
                        .map_err(ServeError::Transfer)?,
                ),
                None => None,
            };
            let models = Arc::new(transfer::CatalogModels {
                catalog: Arc::clone(catalog),
                ids: Arc::new(RequestIds::random()?),
            });
            let _runtime = runtime.enter();
            runtime.spawn(async move {
                if let Err(error) =
                    transfer::serve_peers(listener, secret, timeouts, tls, models).await
                {
                    tracing::error!(%error, "the transfer listener stopped");
                }
            });
            tracing::info!(listen = ?config.server.transfer_listen, "role prefill: serving decode peers");
        }
    }
    Ok(())
}

/// The catalog a start loads: the policy's models (paths resolved), then the
/// models added through the admin API, in id order. An id in both is an
/// error: one of them has to go.
pub fn catalog_of(config: &Config, store: &Store) -> Result<Vec<(ModelSpec, Source)>, ServeError> {
    let mut specs: Vec<(ModelSpec, Source)> = config
        .model_specs()
        .into_iter()
        .map(|spec| (spec, Source::Policy))
        .collect();
    for record in store.models()? {
        if specs.iter().any(|(s, _)| s.id == record.spec.id) {
            return Err(ServeError::Catalog(format!(
                "model {:?} is in the policy and was also added through the admin API; remove it from one (DELETE /admin/v1/models/{}, or the policy's [[models]])",
                record.spec.id, record.spec.id
            )));
        }
        specs.push((record.spec, Source::Admin));
    }
    if specs.len() > MODELS_MAX {
        return Err(ServeError::Catalog(format!(
            "{} models; at most {MODELS_MAX}",
            specs.len()
        )));
    }
    Ok(specs)
}

/// Ends every model's requests with `reason` and joins its engine.
fn stop_engines(catalog: &Catalog, reason: FinishReason) {
    for (_, service) in catalog.take_all() {
        service.shutdown(Duration::ZERO, reason);
    }
}

impl ServeOptions {
    /// The policy with the command line's overrides.
    fn apply(&self, mut config: Config) -> Result<Config, ServeError> {
        if let Some(addr) = self.listen {
            config.server.listen = addr;
        }
        if let Some(addr) = self.admin_listen {
            config.server.admin_listen = addr;
        }
        if let Some(path) = &self.store {
            config.store.path = std::path::absolute(path)?;
        }
        if let Some(role) = self.role {
            config.server.role = role;
        }
        if let Some(addr) = &self.transfer_listen {
            config.server.transfer_listen = Some(addr.clone());
        }
        if !self.prefill_peers.is_empty() {
            config.server.prefill_peers = self.prefill_peers.clone();
        }
        if let Some(backend) = self.backend {
            config.engine.backend = backend;
        }
        if self.enforce_eager {
            config.engine.cuda.graphs = false;
        }
        if self.no_tensor_cores {
            config.engine.cuda.tensor_cores = false;
        }
        if self.no_dependent_launches {
            config.engine.cuda.dependent_launches = false;
        }
        config.validate_role()?;
        Ok(config)
    }
}

/// How long usage minutes are kept (the widest window a usage query takes).
pub const USAGE_RETENTION_MINUTES: u64 = control::USAGE_MINUTES_MAX;
/// How often usage past retention is deleted.
const USAGE_PURGE_EVERY: Duration = Duration::from_secs(3600);

/// Every request's end goes to usage accounting and to the plugins that
/// admitted it (budgets reconciled, `on-complete`).
struct Finishes {
    usage: Arc<UsageBook>,
    policy: OnceLock<Arc<PolicyRuntime>>,
}

impl FinishSink for Finishes {
    fn finished(&self, request: RequestId, tenant: TenantId, reason: FinishReason, usage: Usage) {
        self.usage.finished(request, tenant, reason, usage);
        if let Some(policy) = self.policy.get() {
            policy.finished(request, reason, usage);
        }
    }

    fn engine_fault(&self, fault: &EngineFault<'_>) {
        let mut record = control::audit(&Actor::System, "engine.fault", fault.model);
        let detail = &mut record.detail;
        detail.insert("requests_ended".into(), fault.requests_ended.into());
        detail.insert("in_a_row".into(), fault.in_a_row.into());
        let restart_in_ms = fault.restart_in.map(|d| d.as_millis() as u64);
        detail.insert("restart_in_ms".into(), restart_in_ms.into());
        self.usage.security(record);
    }
}

/// Disables, through the control plane (stored and audited), each plugin the
/// runtime reports for repeated faults; ends when the runtime goes.
fn disable_tripped(control: &Control, tripped: std::sync::mpsc::Receiver<Trip>) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    for trip in tripped {
        if trip.operator.is_some() {
            if let Err(error) = control.record_operator_trip(&trip) {
                tracing::warn!(plugin = %trip.plugin, %error, "auditing an operator plugin's trip");
            }
            continue;
        }
        let result = handle.block_on(control.set_plugin_enabled(
            &Actor::System,
            TenantRef::Id(trip.tenant),
            &trip.plugin,
            false,
        ));
        if let Err(error) = result {
            tracing::warn!(plugin = %trip.plugin, %error, "disabling a faulty plugin");
        }
    }
}

/// Every `every`, one line per model that had work since the last (as vLLM
/// prints): requests running and waiting, tokens generated per second, KV
/// pages in use. Idle models stay quiet.
async fn log_summaries(catalog: Arc<Catalog>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut generated: std::collections::HashMap<String, (u64, tokio::time::Instant)> =
        std::collections::HashMap::new();
    loop {
        ticks.tick().await;
        let now = tokio::time::Instant::now();
        for model in catalog.snapshot().all() {
            let stats = model.engine.stats();
            let running: u32 = stats.tenants.iter().map(|t| t.running).sum();
            let waiting: u32 = stats.tenants.iter().map(|t| t.queued).sum();
            let (before, at) = generated
                .insert(model.spec.id.clone(), (stats.tokens_generated_total, now))
                .unwrap_or((stats.tokens_generated_total, now));
            let tokens = stats.tokens_generated_total.saturating_sub(before);
            if running == 0 && waiting == 0 && tokens == 0 {
                continue;
            }
            let secs = now.duration_since(at).as_secs_f64().max(1e-3);
            let used = stats.pages_count.saturating_sub(stats.pages_free);
            tracing::info!(
                model = %model.spec.id,
                running,
                waiting,
                generation_tokens_per_s = %format!("{:.1}", tokens as f64 / secs),
                kv_pages_used = used,
                kv_pages = stats.pages_count,
                kv_used_pct = %format!("{:.1}", 100.0 * f64::from(used) / f64::from(stats.pages_count.max(1))),
                "engine"
            );
        }
    }
}

/// Writes usage counters every `every`, and deletes those past retention every
/// hour, until aborted.
async fn flush_usage(
    usage: Arc<UsageBook>,
    store: Arc<Store>,
    every: Duration,
    audit_retention: Duration,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut purged_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = usage.flush_asked() => {}
        }
        let purge = purged_at.is_none_or(|at| at.elapsed() >= USAGE_PURGE_EVERY);
        if purge {
            purged_at = Some(tokio::time::Instant::now());
        }
        let (usage, store) = (Arc::clone(&usage), Arc::clone(&store));
        let _ = tokio::task::spawn_blocking(move || {
            flush_once(&usage, &store);
            if purge {
                let cutoff = (now_ms() / 60_000).saturating_sub(USAGE_RETENTION_MINUTES);
                match store.purge_usage_before(cutoff) {
                    Ok(0) => {}
                    Ok(purged) => tracing::info!(purged, "usage minutes past retention deleted"),
                    Err(error) => tracing::warn!(%error, "usage retention"),
                }
                let cutoff_ms = now_ms().saturating_sub(audit_retention.as_millis() as u64);
                match store.purge_audit_before(cutoff_ms) {
                    Ok(0) => {}
                    Ok(purged) => tracing::info!(purged, "audit records past retention deleted"),
                    Err(error) => tracing::warn!(%error, "audit retention"),
                }
            }
        })
        .await;
    }
}

fn flush_once(usage: &UsageBook, store: &Store) {
    match usage.flush(store) {
        Ok(0) => {}
        Ok(summarized) => {
            tracing::info!(
                summarized,
                "refusals past the listed ones per tenant were counted in summary records"
            );
        }
        Err(error) => {
            tracing::error!(%error, "usage counters could not be written; kept for the next try")
        }
    }
}

fn tls_acceptor(tls: &TlsConfig, config: &Config) -> Result<TlsAcceptor, ServeError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (cert_path, key_path) = (config.resolve(&tls.cert_pem), config.resolve(&tls.key_pem));
    let certs = CertificateDer::pem_file_iter(&cert_path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| ServeError::Tls(format!("{}: {e}", cert_path.display())))?;
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .map_err(|e| ServeError::Tls(format!("{}: {e}", key_path.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// Binds both listeners, serves until a signal, then drains.
/// Binds both listeners (before any secret is written: a port in use stops
/// the start with nothing generated).
fn bind_listeners(
    config: &Config,
) -> Result<Vec<(&'static str, std::net::TcpListener)>, ServeError> {
    [
        ("inference", config.server.listen),
        ("admin", config.server.admin_listen),
    ]
    .into_iter()
    .map(|(name, addr)| {
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|cause| ServeError::Bind { addr, cause })?;
        Ok((name, listener))
    })
    .collect()
}

async fn run_listeners(
    config: &Config,
    app: Arc<App>,
    drain: Duration,
    bound: Vec<(&'static str, std::net::TcpListener)>,
    tls: Option<TlsAcceptor>,
) -> Result<(), ServeError> {
    let signals = Signals::install()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut listeners = Vec::new();
    for (name, listener) in bound {
        let router = match name {
            "inference" => api::inference_router(Arc::clone(&app)),
            _ => api::admin_router(Arc::clone(&app)),
        };
        let listener = TcpListener::from_std(listener)?;
        let bound = listener.local_addr()?;
        eprintln!("listening: {name} {scheme}://{bound}");
        tracing::info!(listener = name, addr = %bound, "listening");
        listeners.push((name, listener, router));
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let s = &config.server;
    let limits = ConnectionLimits {
        connections_max: s.connections_max,
        per_peer_max: s.connections_per_peer_max,
        handshake: Duration::from_millis(s.handshake_timeout_ms),
        idle: Duration::from_millis(s.idle_timeout_ms),
        send_stall: Duration::from_millis(s.send_stall_timeout_ms),
        send_rate_min_bytes_per_s: s.send_rate_min_bytes_per_s,
        h2_streams_max: s.h2_streams_max,
        h2_header_list_bytes_max: s.h2_header_list_bytes_max,
        h2_pending_resets_max: s.h2_pending_resets_max,
        h2_local_resets_max: s.h2_local_resets_max,
    };
    let mut tasks = Vec::new();
    for (name, listener, router) in listeners {
        let accept = Accept {
            name,
            listener,
            router,
            tls: tls.clone(),
            limits,
        };
        tasks.push(tokio::spawn(accept.run(stop_rx.clone(), drain)));
    }
    signals.wait().await;
    tracing::info!(
        drain_ms = drain.as_millis() as u64,
        "shutting down: draining in-flight requests"
    );
    app.shutting_down.store(true, Ordering::SeqCst);
    let _ = stop_tx.send(true);
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}

/// SIGTERM and SIGINT, caught from before the first connection is accepted
/// (a signal arriving earlier would kill the process mid-response).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, ServeError> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!(signal = "SIGTERM", "signal received"),
            _ = self.int.recv() => tracing::info!(signal = "SIGINT", "signal received"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::placement::CudaSwitches;

    #[test]
    fn the_command_lines_cuda_flags_turn_the_policys_switches_off() {
        let on = CudaSwitches {
            graphs: true,
            tensor_cores: true,
            dependent_launches: true,
        };
        let demo = || Config::parse(include_str!("../../../policies/demo.toml")).unwrap();
        let apply = |options: ServeOptions| options.apply(demo()).unwrap().engine.cuda;
        assert_eq!(apply(ServeOptions::default()), on);
        let eager = ServeOptions {
            enforce_eager: true,
            ..ServeOptions::default()
        };
        assert_eq!(
            apply(eager),
            CudaSwitches {
                graphs: false,
                ..on
            }
        );
        let warps = ServeOptions {
            no_tensor_cores: true,
            ..ServeOptions::default()
        };
        assert_eq!(
            apply(warps),
            CudaSwitches {
                tensor_cores: false,
                ..on
            }
        );
        let chained = ServeOptions {
            no_dependent_launches: true,
            ..ServeOptions::default()
        };
        assert_eq!(
            apply(chained),
            CudaSwitches {
                dependent_launches: false,
                ..on
            }
        );
        // A flag turns a switch off; leaving it out keeps the policy's word.
        let mut policy = demo();
        policy.engine.cuda.graphs = false;
        let kept = ServeOptions::default().apply(policy).unwrap().engine.cuda;
        assert!(!kept.graphs && kept.tensor_cores);
    }
}
