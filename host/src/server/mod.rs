//! `bulkhead serve`: start-up, listeners and graceful shutdown.
//!
//! 1. **Load** the policy, the model and its tokenizer; print the capacity
//!    table to stderr and refuse to start on a violation (I2).
//! 2. **Keys**: tenant keys from the policy (`keys_sha256`, `key_env`); a tenant
//!    without any gets a random demo key, printed once to stderr. The admin
//!    token is `BULKHEAD_ADMIN_TOKEN`, or random and printed once.
//! 3. **Engine**: one KV pool with a partition per tenant, the CPU backend and
//!    the scheduler on their own thread ([`EngineService`]).
//! 4. **Listen**: inference and admin listeners (HTTP/1.1 and HTTP/2, optional
//!    TLS), each with its connection limits ([`accept`]: caps in all and per
//!    peer, handshake and idle deadlines); each bound address is printed to
//!    stderr as `listening: <name> <url>`.
//! 5. **Shut down** on SIGINT/SIGTERM: stop accepting, mark not ready, let
//!    in-flight requests finish until `server.drain_timeout_ms`, then stop the
//!    engine (whatever is left ends with reason `shutdown`).

mod accept;

use crate::api::lane::Lane;
use crate::api::{self, App};
use crate::config::{Capacity, CapacityViolation, Config, ConfigError, TlsConfig};
use crate::engine::admission::Admission;
use crate::engine::build::{self, EngineSpec};
use crate::engine::chat::ChatTemplate;
use crate::engine::scheduler::TenantLimits;
use crate::engine::service::EngineService;
use crate::telemetry;
use crate::tenancy::{TenancyError, Tenants};
use accept::{Accept, ConnectionLimits};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::Tokenizer;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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
/// Random bytes in a generated key or token (hex-encoded: twice as many characters).
const SECRET_BYTES: usize = 24;

/// Command-line overrides of the policy.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// The policy file.
    pub config: PathBuf,
    /// Overrides `server.listen`.
    pub listen: Option<SocketAddr>,
    /// Overrides `server.admin_listen`.
    pub admin_listen: Option<SocketAddr>,
    /// Overrides `model.path` (relative to the working directory).
    pub model: Option<PathBuf>,
}

/// Why the server could not start (or stopped with an error).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The policy file.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The capacity contract (the message names the limit).
    #[error(transparent)]
    Capacity(#[from] CapacityViolation),
    /// Tenant keys.
    #[error(transparent)]
    Tenancy(#[from] TenancyError),
    /// The model file.
    #[error("model {path}: {message}")]
    Model {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The KV pool.
    #[error("kv pool: {0}")]
    Pool(String),
    /// TLS set-up.
    #[error("tls: {0}")]
    Tls(String),
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// Metrics set-up.
    #[error("metrics: {0}")]
    Metrics(String),
    /// Threads, the runtime, signals, randomness.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn secret() -> Result<String, ServeError> {
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes)
        .map_err(|e| ServeError::Io(std::io::Error::other(format!("randomness: {e}"))))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Runs the server until SIGINT/SIGTERM and a drain.
pub fn serve(options: ServeOptions) -> Result<(), ServeError> {
    telemetry::init_tracing();
    let mut config = Config::load(&options.config)?;
    if let Some(addr) = options.listen {
        config.server.listen = addr;
    }
    if let Some(addr) = options.admin_listen {
        config.server.admin_listen = addr;
    }
    if let Some(path) = options.model {
        config.model.path = std::path::absolute(&path)?;
    }
    let model_path = config.model_path();
    let model_error = |message: String| ServeError::Model {
        path: model_path.display().to_string(),
        message,
    };
    let model = Arc::new(Model::open(&model_path).map_err(|e| model_error(e.to_string()))?);
    let tokenizer =
        Arc::new(Tokenizer::from_gguf(&model.gguf).map_err(|e| model_error(e.to_string()))?);
    let capacity = Capacity::new(&config, model.config.context_len as u64);
    eprint!("{}", capacity.table());
    capacity.check()?;
    let tenants = tenants_with_keys(&config)?;
    let admin_token = match std::env::var("BULKHEAD_ADMIN_TOKEN") {
        Ok(token) if !token.is_empty() => token,
        _ => {
            let token = format!("bk-admin-{}", secret()?);
            eprintln!("admin token (generated; set BULKHEAD_ADMIN_TOKEN to choose one): {token}");
            token
        }
    };
    let template = chat_template(&model, &tokenizer);
    let service = start_engine(&config, &model, &tokenizer, &tenants)?;
    let metrics = telemetry::install_metrics().map_err(|e| ServeError::Metrics(e.to_string()))?;
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce)
        .map_err(|e| ServeError::Io(std::io::Error::other(format!("randomness: {e}"))))?;
    let app = Arc::new(App {
        tenants,
        engine: service.handle(),
        admission: Admission {
            context_tokens: config.model.context_tokens,
            page_tokens: config.engine.page_tokens,
        },
        text_bytes_per_token_max: tokenizer.text_bytes_per_token_max() as u64,
        lane: Lane::new(config.server.tokenize_threads as usize)?,
        tokenizer,
        template,
        model_id: config.model.id.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        body_bytes_max: config.server.body_bytes_max,
        request_timeout: Duration::from_millis(config.server.request_timeout_ms),
        admin_token_sha256: Sha256::digest(admin_token.as_bytes()).into(),
        capacity: capacity_json(&capacity),
        metrics,
        shutting_down: AtomicBool::new(false),
        next_request_id: AtomicU64::new(1),
        id_nonce: u64::from_le_bytes(nonce),
    });
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(HTTP_WORKER_THREADS_MAX);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("bulkhead-http")
        .enable_all()
        .build()?;
    let drain = Duration::from_millis(config.server.drain_timeout_ms);
    let result = runtime.block_on(run_listeners(&config, Arc::clone(&app), drain));
    // Whatever did not finish within the drain ends now (reason `shutdown`).
    service.shutdown(Duration::ZERO);
    // Streams still open (past the drain deadline) get their error event out.
    runtime.block_on(async { tokio::time::sleep(FINAL_EVENTS_FLUSH).await });
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
    tracing::info!("stopped");
    result
}

/// Tenants from the policy; a tenant without any key gets a printed demo key.
fn tenants_with_keys(config: &Config) -> Result<Tenants, ServeError> {
    let mut tenants = Tenants::new(config, |var| std::env::var(var).ok())?;
    let keyless: Vec<String> = tenants
        .without_keys()
        .into_iter()
        .map(str::to_string)
        .collect();
    for name in keyless {
        let Some(tenant) = tenants.all().iter().find(|t| t.name == name).cloned() else {
            continue;
        };
        let key = format!("bk-{name}-{}", secret()?);
        tenants.add_key(tenant.id, &key)?;
        eprintln!("demo key for tenant {name} (generated; valid until restart): {key}");
    }
    Ok(tenants)
}

fn chat_template(model: &Model, tokenizer: &Tokenizer) -> Option<ChatTemplate> {
    match ChatTemplate::from_model(&model.gguf, tokenizer) {
        Ok(template) => template,
        Err(error) => {
            tracing::warn!(%error, "the model's chat template does not compile; chat is disabled");
            None
        }
    }
}

fn start_engine(
    config: &Config,
    model: &Arc<Model>,
    tokenizer: &Arc<Tokenizer>,
    tenants: &Tenants,
) -> Result<EngineService, ServeError> {
    let limits = tenants
        .all()
        .iter()
        .map(|tenant| {
            let t = &config.tenants[&tenant.name];
            TenantLimits {
                id: tenant.id,
                name: tenant.name.clone(),
                weight: t.weight,
                queue_depth_max: t.queue_depth_max,
                running_max: t.running_max,
                pages_reserved: t.pages_reserved,
                pages_max: t.pages_max,
            }
        })
        .collect();
    let spec = EngineSpec::from_config(config);
    let scheduler = build::scheduler(model, tokenizer, &spec, limits)
        .map_err(|e| ServeError::Pool(e.to_string()))?;
    Ok(EngineService::start(scheduler)?)
}

fn capacity_json(capacity: &Capacity) -> serde_json::Value {
    let limits: Vec<serde_json::Value> = capacity
        .limits
        .iter()
        .map(|l| {
            serde_json::json!({
                "stage": l.stage, "field": l.field, "tokens": l.tokens,
                "holds": l.tokens >= capacity.promised_tokens,
            })
        })
        .collect();
    serde_json::json!({
        "promised_tokens": capacity.promised_tokens,
        "limits": limits,
        "prefill_chunk_tokens": capacity.step_tokens_max,
        "ok": capacity.check().is_ok(),
    })
}

fn tls_acceptor(tls: &TlsConfig, base: &std::path::Path) -> Result<TlsAcceptor, ServeError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let resolve = |p: &PathBuf| match base.parent() {
        Some(dir) if p.is_relative() => dir.join(p),
        _ => p.clone(),
    };
    let (cert_path, key_path) = (resolve(&tls.cert_pem), resolve(&tls.key_pem));
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
async fn run_listeners(config: &Config, app: Arc<App>, drain: Duration) -> Result<(), ServeError> {
    let signals = Signals::install()?;
    let tls = match &config.server.tls {
        Some(tls) => Some(tls_acceptor(tls, &config.source)?),
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut listeners = Vec::new();
    for (name, addr, router) in [
        (
            "inference",
            config.server.listen,
            api::inference_router(Arc::clone(&app)),
        ),
        (
            "admin",
            config.server.admin_listen,
            api::admin_router(Arc::clone(&app)),
        ),
    ] {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
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
