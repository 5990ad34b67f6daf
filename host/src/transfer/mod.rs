//! Prefill/decode disaggregation's link: roles, peers, the listener of a
//! prefill process and the job dispatcher of a decode process.
//!
//! - `--role both` (the default) runs everything in one process and none of
//!   this: no listener, no fingerprint, nothing on a request's path.
//! - `--role prefill --transfer-listen ADDR` serves prefill jobs to decode
//!   peers that prove the shared secret (`BULKHEAD_TRANSFER_SECRET`), and no
//!   inference to clients.
//! - `--role decode --prefill-peer ADDR` (repeatable) serves clients as
//!   `both` does — authentication, admission, plugins — but gets each
//!   prompt's KV from a peer, verified by the page book before the first
//!   decode step ([`bulkhead_kernels::kv::transfer`], I5).
//!
//! An address is `HOST:PORT` (TCP) or `unix:PATH` (a Unix socket). The same
//! protocol ([`link`]) runs over both, and over an in-memory pipe in tests.

pub mod link;
pub mod tls;
pub mod wire;

use crate::engine::handoff::{PrefillRequest, Transferred};
use crate::engine::request::RequestId;
use crate::engine::service::EngineHandle;
use link::{Secret, Timeouts};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use wire::{Job, Pairing};

/// A process's part in disaggregation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode here (no transfer).
    #[default]
    Both,
    /// Prefill jobs for decode peers only.
    Prefill,
    /// Clients' requests, with prompts' KV from prefill peers.
    Decode,
}

impl Role {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "unknown role {other:?}: one of both, prefill, decode"
            )),
        }
    }
}

/// Where a peer listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAddr {
    /// `HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

impl std::str::FromStr for PeerAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<PeerAddr, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(PeerAddr::Unix(PathBuf::from(path)));
        }
        match s.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(PeerAddr::Tcp(s.to_string()))
            }
            _ => Err(format!(
                "peer address {s:?} is neither HOST:PORT nor unix:PATH"
            )),
        }
    }
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerAddr::Tcp(addr) => f.write_str(addr),
            PeerAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A byte stream to a peer.
pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// Connects to `addr` within `timeouts.connect`.
pub async fn connect(
    addr: &PeerAddr,
    timeouts: Timeouts,
    tls: Option<&tls::ClientTls>,
) -> std::io::Result<Box<dyn Stream>> {
    let connecting = async {
        let (stream, host): (Box<dyn Stream>, _) = match addr {
            PeerAddr::Tcp(addr) => {
                let stream = tokio::net::TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                (Box::new(stream), Some(tls::host_of(addr)))
            }
            PeerAddr::Unix(path) => (Box::new(tokio::net::UnixStream::connect(path).await?), None),
        };
        match tls {
            Some(tls) => tls.connect(host, stream).await,
            None => Ok(stream),
        }
    };
    tokio::time::timeout(timeouts.connect, connecting)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
}

/// How a decode process reaches its prefill peers.
pub struct Peers {
    /// Their addresses, tried in turn.
    pub addrs: Vec<PeerAddr>,
    /// The shared secret.
    pub secret: Secret,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Mutual TLS, when the policy names certificates.
    pub tls: Option<tls::ClientTls>,
    next: AtomicUsize,
}

impl Peers {
    /// Peers at `addrs`.
    pub fn new(
        addrs: Vec<PeerAddr>,
        secret: Secret,
        timeouts: Timeouts,
        tls: Option<tls::ClientTls>,
    ) -> Peers {
        Peers {
            addrs,
            secret,
            timeouts,
            tls,
            next: AtomicUsize::new(0),
        }
    }

    /// The next peer in turn.
    fn pick(&self) -> Option<&PeerAddr> {
        if self.addrs.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.addrs.len();
        Some(&self.addrs[i])
    }
}

/// How a job's stream is opened: a peer's socket, or (tests) anything else.
/// The argument is the peer a gateway chose for the job, unchecked.
pub type Connector = Arc<
    dyn Fn(
            Option<String>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Box<dyn Stream>>> + Send>,
        > + Send
        + Sync,
>;

/// The longest `x-prefiller-host-port` value looked at.
pub const PEER_ADDR_BYTES_MAX: usize = 256;

/// What became of a gateway's choice of prefill peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hint {
    /// It names one of this process's peers: that one is asked.
    Taken,
    /// Not `HOST:PORT`.
    Unparsable,
    /// A well-formed address that is none of this process's peers (nor an
    /// address one of their names resolves to): ignored, never connected to.
    NotAPeer,
}

impl Hint {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Hint::Taken => "taken",
            Hint::Unparsable => "unparsable",
            Hint::NotAPeer => "not_a_peer",
        }
    }
}

impl Peers {
    /// The configured peer `hint` names, and where to connect: the peer
    /// itself when the hint is its own address; an address the peer's name
    /// resolves to when the hint is that address, or (llm-d's picker names a
    /// prefill pod by its IP and serving port, not its transfer port) that
    /// address's IP with another port. Still verified under the peer's own
    /// name with TLS. Anything else is no peer of ours.
    async fn resolve_hint(&self, hint: &str) -> (Hint, Option<(PeerAddr, String)>) {
        let Ok(socket) = hint.parse::<std::net::SocketAddr>() else {
            if let Some(peer) = self.addrs.iter().find(|a| a.to_string() == hint) {
                return (Hint::Taken, Some((peer.clone(), hint.to_string())));
            }
            return match hint.parse::<PeerAddr>() {
                Ok(_) => (Hint::NotAPeer, None),
                Err(_) => (Hint::Unparsable, None),
            };
        };
        let mut same_ip = None;
        for peer in &self.addrs {
            let PeerAddr::Tcp(name) = peer else { continue };
            let resolved =
                tokio::time::timeout(self.timeouts.connect, tokio::net::lookup_host(name)).await;
            let Ok(Ok(addrs)) = resolved else { continue };
            for addr in addrs {
                if addr == socket {
                    return (Hint::Taken, Some((peer.clone(), addr.to_string())));
                }
                if addr.ip() == socket.ip() && same_ip.is_none() {
                    same_ip = Some((peer.clone(), addr.to_string()));
                }
            }
        }
        match same_ip {
            Some(chosen) => (Hint::Taken, Some(chosen)),
            None => (Hint::NotAPeer, None),
        }
    }
}

/// A connector to `peers`: the one a gateway chose when it is one of them,
/// else the next in turn.
pub fn peer_connector(peers: Arc<Peers>) -> Connector {
    Arc::new(move |hint: Option<String>| {
        let peers = Arc::clone(&peers);
        Box::pin(async move {
            if let Some(hint) = hint {
                let (outcome, chosen) = peers.resolve_hint(&hint).await;
                metrics::counter!("bulkhead_prefiller_hints_total", "result" => outcome.as_str())
                    .increment(1);
                if let Some((peer, socket)) = chosen {
                    let addr = match &peer {
                        PeerAddr::Tcp(name) if *name != socket => {
                            return connect_as(
                                &socket,
                                tls::host_of(name),
                                peers.timeouts,
                                peers.tls.as_ref(),
                            )
                            .await;
                        }
                        _ => peer,
                    };
                    return connect(&addr, peers.timeouts, peers.tls.as_ref()).await;
                }
                tracing::warn!(
                    result = outcome.as_str(),
                    "x-prefiller-host-port names none of this process's prefill peers; ignored"
                );
            }
            let Some(addr) = peers.pick().cloned() else {
                return Err(std::io::Error::other("no prefill peer"));
            };
            connect(&addr, peers.timeouts, peers.tls.as_ref()).await
        })
    })
}

/// Connects to the socket address `socket` of a peer whose certificate must
/// carry `host` (its configured name).
async fn connect_as(
    socket: &str,
    host: &str,
    timeouts: Timeouts,
    tls: Option<&tls::ClientTls>,
) -> std::io::Result<Box<dyn Stream>> {
    let connecting = async {
        let stream = tokio::net::TcpStream::connect(socket).await?;
        stream.set_nodelay(true)?;
        let stream: Box<dyn Stream> = Box::new(stream);
        match tls {
            Some(tls) => tls.connect(Some(host), stream).await,
            None => Ok(stream),
        }
    };
    tokio::time::timeout(timeouts.connect, connecting)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
}

/// One decode-side model's transfer state, for readiness and metrics.
#[derive(Default)]
pub struct DecodeLink {
    /// Whether the last pairing with a peer held (false until one has).
    pub paired: AtomicBool,
}

/// What a decode-role model's jobs need: how to reach a peer, what to pair
/// as, where the verdict is made, where to count.
#[derive(Clone)]
pub struct JobContext {
    /// Opens a job's stream.
    pub connector: Connector,
    /// The shared secret.
    pub secret: Secret,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// What the model pairs as.
    pub pairing: Arc<Pairing>,
    /// The model's engine (the page book's verdict).
    pub engine: EngineHandle,
    /// Its readiness.
    pub state: Arc<DecodeLink>,
    /// Its id (metrics).
    pub model: String,
}

/// Runs a decode-role model's prefill jobs: each on a fresh connection,
/// delivered to the engine, the page book's verdict sent back. Ends when
/// the scheduler's sender is gone.
pub async fn dispatch(mut jobs: mpsc::UnboundedReceiver<PrefillRequest>, context: JobContext) {
    while let Some(request) = jobs.recv().await {
        tokio::spawn(run_job(request, context.clone()));
    }
}

async fn run_job(request: PrefillRequest, context: JobContext) {
    let JobContext {
        connector,
        secret,
        timeouts,
        pairing,
        engine,
        state,
        model,
    } = context;
    let started = Instant::now();
    let PrefillRequest {
        identity,
        tokens,
        max_tokens,
        deadline,
        prefill_hint,
        mut abandoned,
    } = request;
    let job = Job {
        request: identity.request,
        job: identity.job,
        owner: identity.owner.0,
        max_tokens,
        tokens,
    };
    let tenant = identity.owner.0.to_string();
    let fetching = async {
        match connector(prefill_hint).await {
            Ok(stream) => link::fetch(stream, &secret, timeouts, &pairing, job).await,
            Err(error) => {
                tracing::warn!(request_id = identity.request, %error, "no prefill peer reachable");
                link::Fetched {
                    result: Transferred::Failed("connect"),
                    link: None,
                    times: link::FetchTimes::default(),
                }
            }
        }
    };
    let left = tokio::time::Instant::from_std(deadline);
    let fetched = tokio::select! {
        fetched = fetching => fetched,
        // The sequence stopped waiting (client gone, preempted, tenant
        // removed): drop the connection; the peer releases its pages.
        _ = &mut abandoned => {
            metrics::counter!("bulkhead_transfers_total", "model" => model, "tenant_id" => tenant, "result" => "abandoned").increment(1);
            return;
        }
        _ = tokio::time::sleep_until(left) => link::Fetched {
            result: Transferred::Failed("deadline"),
            link: None,
            times: link::FetchTimes::default(),
        },
    };
    let link::Fetched {
        result,
        link,
        times,
    } = fetched;
    match &result {
        // No peer there, or none that pairs: not ready until a probe pairs.
        Transferred::Failed("pairing" | "connect") => state.paired.store(false, Ordering::Relaxed),
        Transferred::Received(_) | Transferred::Refused(_) => {
            state.paired.store(true, Ordering::Relaxed)
        }
        Transferred::Failed(_) => {}
    }
    let (label, bytes) = match &result {
        Transferred::Received(r) => (
            None,
            r.pages.iter().map(|p| p.bytes().len() as u64).sum::<u64>(),
        ),
        Transferred::Refused(refusal) => (Some(refusal.code()), 0),
        Transferred::Failed(reason) => (Some(*reason), 0),
    };
    // The page book's check on the engine thread (the scheduler logs its
    // own time as `transfer verified`), with the wait for the engine's turn.
    let judging = Instant::now();
    let verdict = engine
        .transferred(RequestId(identity.request), identity.job, result)
        .await;
    let judged = judging.elapsed();
    if let Some(mut link) = link {
        if label.is_none() {
            if let Err(error) = link::send_verdict(&mut link, verdict).await {
                tracing::warn!(request_id = identity.request, %error, "verdict not delivered");
            }
        }
    }
    drop(abandoned);
    let result = match (label, verdict) {
        (Some(reason), _) => reason,
        (None, Ok(())) => "ok",
        (None, Err(reason)) => reason,
    };
    let seconds = started.elapsed().as_secs_f64();
    metrics::counter!("bulkhead_transfers_total", "model" => model.clone(), "tenant_id" => tenant.clone(), "result" => result).increment(1);
    if result == "ok" {
        metrics::counter!("bulkhead_transfer_bytes_total", "model" => model.clone(), "tenant_id" => tenant.clone()).increment(bytes);
        metrics::histogram!("bulkhead_transfer_seconds", "model" => model).record(seconds);
    }
    tracing::info!(
        request_id = identity.request,
        tenant_id = identity.owner.0,
        tokens = identity.tokens,
        bytes,
        result,
        ms = (seconds * 1000.0) as u64,
        wire_us = times.wire.as_micros() as u64,
        hash_us = times.hashing.as_micros() as u64,
        verdict_us = judged.as_micros() as u64,
        "transfer received"
    );
}

/// The environment variable that holds the link's shared secret.
pub const SECRET_ENV: &str = "BULKHEAD_TRANSFER_SECRET";

/// The shared secret from [`SECRET_ENV`].
pub fn secret_from_env() -> Result<Secret, String> {
    match std::env::var(SECRET_ENV) {
        Ok(value) => Secret::new(value.as_bytes()).map_err(|e| format!("{SECRET_ENV}: {e}")),
        Err(_) => Err(format!(
            "{SECRET_ENV} is not set: a prefill and a decode process prove the same secret to each other (at least {} bytes, e.g. `openssl rand -hex 32`)",
            link::SECRET_BYTES_MIN
        )),
    }
}

/// How a decode process's models reach their peers (set once at start).
pub struct DecodeSetup {
    /// Opens a job's stream.
    pub connector: Connector,
    /// The shared secret.
    pub secret: Secret,
    /// Deadlines.
    pub timeouts: Timeouts,
}

static DECODE: std::sync::OnceLock<DecodeSetup> = std::sync::OnceLock::new();

/// Sets the decode process's link (once; later calls are ignored).
pub fn set_decode(setup: DecodeSetup) {
    let _ = DECODE.set(setup);
}

/// Starts a decode-role model's dispatcher and pairing probe (a loaded
/// model's, at start or when added through the admin API), inside a tokio
/// runtime. Nothing for other roles.
pub fn start_model(served: &crate::catalog::Served) {
    let (Some(transfer), Some(setup)) = (&served.transfer, DECODE.get()) else {
        return;
    };
    let Some(jobs) = transfer
        .jobs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    else {
        return;
    };
    tokio::spawn(probe_loop(
        Arc::clone(&setup.connector),
        setup.secret.clone(),
        setup.timeouts,
        Arc::clone(&transfer.pairing),
        Arc::clone(&transfer.link),
    ));
    tokio::spawn(dispatch(
        jobs,
        JobContext {
            connector: Arc::clone(&setup.connector),
            secret: setup.secret.clone(),
            timeouts: setup.timeouts,
            pairing: Arc::clone(&transfer.pairing),
            engine: served.engine.clone(),
            state: Arc::clone(&transfer.link),
            model: served.spec.id.clone(),
        },
    ));
}

/// Pairs with a peer every second until one pairs, then every ten: the
/// model's readiness. Runs for the process's life (a removed model's probe
/// costs one connection per 10 s).
async fn probe_loop(
    connector: Connector,
    secret: Secret,
    timeouts: Timeouts,
    pairing: Arc<Pairing>,
    state: Arc<DecodeLink>,
) {
    let mut last: Option<String> = None;
    let mut probed = tokio::time::Instant::now();
    let mut first = true;
    loop {
        // Each second while unpaired (a failed job clears `paired` too),
        // each ten seconds while paired.
        if !first
            && state.paired.load(Ordering::Relaxed)
            && probed.elapsed() < std::time::Duration::from_secs(10)
        {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            continue;
        }
        first = false;
        probed = tokio::time::Instant::now();
        let result = match connector(None).await {
            Ok(stream) => link::probe(stream, &secret, timeouts, &pairing)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("connect: {e}")),
        };
        let paired = result.is_ok();
        state.paired.store(paired, Ordering::Relaxed);
        let now = result.err();
        if now != last {
            match &now {
                None => tracing::info!(model = %pairing.model, "paired with a prefill peer"),
                Some(error) => {
                    metrics::counter!("bulkhead_transfer_pairing_failures_total", "model" => pairing.model.clone()).increment(1);
                    tracing::warn!(model = %pairing.model, %error, "no prefill peer pairs; the model is not ready")
                }
            }
            last = now;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// A prefill process's models, from its catalog.
pub struct CatalogModels {
    /// The catalog.
    pub catalog: Arc<crate::catalog::Catalog>,
    /// Local request ids.
    pub ids: Arc<crate::api::ids::RequestIds>,
}

impl link::PrefillModels for CatalogModels {
    fn model(&self, id: &str) -> Option<link::PrefillModel> {
        let snapshot = self.catalog.snapshot();
        let served = snapshot.get(id)?;
        let transfer = served.transfer.as_ref()?;
        Some(link::PrefillModel {
            pairing: (*transfer.pairing).clone(),
            admission: served.admission,
            engine: served.engine.clone(),
        })
    }

    fn request_id(&self) -> RequestId {
        self.ids.next()
    }
}

/// Most decode peers' connections a prefill process serves at once.
pub const CONNECTIONS_MAX: usize = 256;

/// A bound transfer listener (bound before the models load, like the other
/// listeners).
pub enum Listener {
    /// TCP.
    Tcp(std::net::TcpListener),
    /// A Unix socket (its file is removed first if stale).
    Unix(std::os::unix::net::UnixListener),
}

/// Binds `addr` for decode peers.
pub fn bind(addr: &PeerAddr) -> std::io::Result<Listener> {
    match addr {
        PeerAddr::Tcp(addr) => {
            let listener = std::net::TcpListener::bind(addr)?;
            listener.set_nonblocking(true)?;
            Ok(Listener::Tcp(listener))
        }
        PeerAddr::Unix(path) => {
            if std::fs::symlink_metadata(path)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                std::fs::remove_file(path)?;
            }
            let listener = std::os::unix::net::UnixListener::bind(path)?;
            listener.set_nonblocking(true)?;
            Ok(Listener::Unix(listener))
        }
    }
}

/// Serves decode peers on `listener` until the runtime stops.
pub async fn serve_peers(
    listener: Listener,
    secret: Secret,
    timeouts: Timeouts,
    tls: Option<tls::ServerTls>,
    models: Arc<dyn link::PrefillModels>,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    enum Tokio {
        Tcp(tokio::net::TcpListener),
        Unix(tokio::net::UnixListener),
    }
    let listener = match listener {
        Listener::Tcp(l) => Tokio::Tcp(tokio::net::TcpListener::from_std(l)?),
        Listener::Unix(l) => Tokio::Unix(tokio::net::UnixListener::from_std(l)?),
    };
    loop {
        let stream: Box<dyn Stream> = match &listener {
            Tokio::Tcp(l) => match l.accept().await {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    Box::new(stream)
                }
                Err(error) => {
                    tracing::warn!(%error, "transfer accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            Tokio::Unix(l) => match l.accept().await {
                Ok((stream, _)) => Box::new(stream),
                Err(error) => {
                    tracing::warn!(%error, "transfer accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            metrics::counter!("bulkhead_transfer_connections_refused_total").increment(1);
            continue;
        };
        let (secret, models, tls) = (secret.clone(), Arc::clone(&models), tls.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let stream = match tls {
                None => stream,
                // The TLS handshake is due like a frame.
                Some(tls) => {
                    match tokio::time::timeout(timeouts.frame, tls.accept(stream)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => {
                            metrics::counter!("bulkhead_transfer_link_errors_total", "reason" => "tls").increment(1);
                            tracing::warn!(%error, "decode peer's TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            metrics::counter!("bulkhead_transfer_link_errors_total", "reason" => "tls").increment(1);
                            tracing::warn!("decode peer's TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            if let Err(error) = link::serve_prefill(stream, &secret, timeouts, &*models).await {
                metrics::counter!("bulkhead_transfer_link_errors_total", "reason" => error.reason()).increment(1);
                tracing::warn!(%error, "decode peer's connection ended");
            }
        });
    }
}

/// What `bulkhead check --role` prints for one model: the request's chain
/// through the processes (front, prefill, transfer, decode), each with what
/// it must hold and where that is checked.
pub struct Chain<'a> {
    /// This process's role.
    pub role: Role,
    /// The model's id.
    pub model: &'a str,
    /// The context the model promises (prompt and completion).
    pub context_tokens: u32,
    /// Its pool's page shape.
    pub shape: bulkhead_kernels::kv::PageShape,
    /// Its file's fingerprint.
    pub fingerprint: u64,
    /// The tenants that may use it (stable id, name): both sides must agree.
    pub tenants: Vec<(u32, String)>,
    /// Whether this process's capacity table holds the promise.
    pub holds: bool,
    /// The policy's server section (peers, listener, frame deadline).
    pub server: &'a crate::config::ServerConfig,
}

impl Chain<'_> {
    /// The chain as lines of text.
    pub fn text(&self) -> String {
        use crate::capacity::human_bytes;
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "chain of model {} as role {}",
            self.model,
            self.role.as_str()
        );
        if self.role == Role::Both {
            let _ = writeln!(
                out,
                "  one process: front, prefill and decode share one engine and one pool; nothing is transferred"
            );
            return out;
        }
        let holds = if self.holds { "ok" } else { "NO" };
        // A prompt may take the whole context but the one token it asks for;
        // all of it but its last token travels.
        let prompt = self.context_tokens.saturating_sub(1);
        let pages = self.shape.pages_for(prompt.saturating_sub(1));
        let page = self.shape.page_bytes(self.shape.page_tokens);
        let shape = format!(
            "{} tokens x {} layers x {} KV heads x {} ({:?}), {} a page",
            self.shape.page_tokens,
            self.shape.layers,
            self.shape.kv_heads,
            self.shape.head_dim,
            self.shape.kv_type,
            human_bytes(page)
        );
        let tenants = self
            .tenants
            .iter()
            .map(|(id, name)| format!("{name}={id}"))
            .collect::<Vec<_>>()
            .join(", ");
        let peers = match self.server.prefill_peers.is_empty() {
            true => "none named yet: --prefill-peer ADDR".to_string(),
            false => self.server.prefill_peers.join(", "),
        };
        let listen = self
            .server
            .transfer_listen
            .as_deref()
            .unwrap_or("none named yet: --transfer-listen ADDR");
        let (front, prefill, decode) = match self.role {
            Role::Decode => (
                format!(
                    "this process: authenticates the tenant, admits against the capacity table above ({holds}), runs plugins, tokenizes; a prompt of up to {prompt} tokens sends all but its last token to a peer"
                ),
                format!(
                    "a peer ({peers}) that pairs: the same file (fingerprint {:016x}), page shape, a context of at least {}, tenants {tenants}; its own table must hold that context (`check --role prefill` on its policy)",
                    self.fingerprint, self.context_tokens
                ),
                format!(
                    "this process: books the worst case's pages for the tenant before it asks, computes the last prompt token itself once the page book passes the import, then generates ({holds})"
                ),
            ),
            _ => (
                "a decode peer (this process answers clients 421 prefill_only)".to_string(),
                format!(
                    "this process, for decode peers at {listen}: computes a prompt of up to {prompt} tokens against the capacity table above ({holds}); refuses a job as one process would refuse the request"
                ),
                format!(
                    "a peer that pairs: the same file (fingerprint {:016x}), page shape, a context of at most {}, tenants {tenants}",
                    self.fingerprint, self.context_tokens
                ),
            ),
        };
        let transfer = format!(
            "pages of {shape}; at most {pages} pages = {} a prompt; the sender keeps its pages until the verdict; the receiver checks identity, token count against its own tokenization, order, lengths, each page's XXH3 digest and the whole transfer's digest before anything decodes; a frame is due within {} ms, the link proves BULKHEAD_TRANSFER_SECRET both ways",
            human_bytes(page * u64::from(pages)),
            self.server.transfer_frame_timeout_ms
        );
        for (stage, text) in [
            ("front", front),
            ("prefill", prefill),
            ("transfer", transfer),
            ("decode", decode),
        ] {
            let _ = writeln!(out, "  {stage:<9} {text}");
        }
        out
    }
}
