//! The deployment policy (`policies/*.toml`) as typed configuration.
//!
//! 1. [`Config::load`] parses a file; every limit has a named default and a
//!    bound, and an unknown key is an error (a typo must not silently fall back
//!    to a default).
//! 2. The catalog: each `[[models]]` entry is a [`ModelSpec`] — the id clients
//!    send, its GGUF file, the context it promises, its own KV pool and page
//!    geometry. These are the catalog's *policy* models, loaded at every start;
//!    models added through the admin API live in the store (see
//!    [`crate::catalog`]).
//! 3. The capacity contract and the memory budget these numbers must keep are
//!    checked in [`crate::capacity`].

// A model's spec is what the store records for an admin-added model, so it
// is defined with the records (below this module and the tenancy types).
use crate::store::records::{default_threads, valid_name, ModelAccess, Quota};
pub use crate::store::records::{valid_model_id, KvStorage, ModelSpec, MODEL_ID_BYTES_MAX};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Largest accepted request body, in bytes, whatever the file says.
pub const BODY_BYTES_LIMIT: u64 = 64 << 20;
/// Most tenants one deployment may define.
pub const TENANTS_MAX: usize = 1024;
/// Most pages a pool may have (the KV crate has its own bound too).
pub const POOL_PAGES_LIMIT: u32 = 1 << 22;
/// Longest timeout a policy may set, in milliseconds (a day).
pub const TIMEOUT_MS_LIMIT: u64 = 24 * 3600 * 1000;
/// Most models one catalog may hold (policy and admin-added together).
pub const MODELS_MAX: usize = 16;
/// Most compute threads one model may have.
pub const MODEL_THREADS_MAX: u32 = 256;

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {cause}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        cause: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A value is outside its bounds.
    #[error("{field}: {reason}")]
    Invalid {
        /// The offending field, e.g. `tenants.alpha.pages_max`.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The whole deployment policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listeners and request limits.
    #[serde(default)]
    pub server: ServerConfig,
    /// The catalog's policy models, in order.
    #[serde(default)]
    pub models: Vec<ModelSpec>,
    /// What all models share: the memory budget.
    #[serde(default)]
    pub engine: EngineConfig,
    /// The control-plane store.
    #[serde(default)]
    pub store: StoreConfig,
    /// Policy plugins: limits of every call, and the operator's own plugins.
    #[serde(default)]
    pub plugins: PluginsConfig,
    /// Tenants by name: the seed of an empty store (after that, the store is
    /// the source of truth for tenants, keys and quotas).
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Where the file was read from (relative paths in it resolve against its folder).
    #[serde(skip)]
    pub source: PathBuf,
}

/// Listeners and request limits.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Inference listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin_listen: SocketAddr,
    /// Largest request body accepted.
    pub body_bytes_max: u64,
    /// Most concurrent connections per listener.
    pub connections_max: u32,
    /// Most concurrent connections per listener from one peer (an IPv4 address,
    /// or an IPv6 /64 prefix): one client cannot take every slot.
    pub connections_per_peer_max: u32,
    /// From accept to the first request's headers (the TLS handshake and
    /// protocol detection included), and for each later request's headers.
    pub handshake_timeout_ms: u64,
    /// How long a connection may stay open with no request in flight.
    pub idle_timeout_ms: u64,
    /// How long a response may wait for its client to take the bytes it was
    /// handed (a zero flow-control window, a socket nobody reads) before the
    /// connection closes; each byte the client does take earns it
    /// 1/`send_rate_min_bytes_per_s` seconds more.
    pub send_stall_timeout_ms: u64,
    /// How often each busy model logs its one-line summary (0: never).
    pub summary_interval_ms: u64,
    /// The slowest a client may take a response on average, after the stall
    /// allowance (bytes per second).
    pub send_rate_min_bytes_per_s: u64,
    /// Most concurrent HTTP/2 streams (requests) on one connection.
    pub h2_streams_max: u32,
    /// Largest HTTP/2 header list a client may send, in bytes.
    pub h2_header_list_bytes_max: u32,
    /// HTTP/2 streams a client may reset before the server has taken them
    /// (the "rapid reset" flood); past it, the connection closes.
    pub h2_pending_resets_max: u32,
    /// HTTP/2 streams the server may reset for a client's protocol errors
    /// on one connection; past it, the connection closes.
    pub h2_local_resets_max: u32,
    /// Threads that tokenize prompts, taking tenants in turn (their CPU is
    /// the engine's too on a CPU host).
    pub tokenize_threads: u32,
    /// Deadline of one request, from arrival to its last token.
    pub request_timeout_ms: u64,
    /// How long a shutdown waits for in-flight requests.
    pub drain_timeout_ms: u64,
    /// The runtime canary guard: scan every response for other tenants'
    /// registered canaries and block it on a hit (see README, *Security*).
    pub canary_guard: bool,
    /// TLS for both listeners, when present.
    pub tls: Option<TlsConfig>,
    /// This process's part in prefill/decode disaggregation (`both`,
    /// `prefill`, `decode`; see `crate::transfer`).
    pub role: crate::transfer::Role,
    /// Role `prefill`: where decode peers connect (`HOST:PORT` or `unix:PATH`).
    pub transfer_listen: Option<String>,
    /// Role `decode`: the prefill peers, tried in turn.
    pub prefill_peers: Vec<String>,
    /// Deadline of each transfer frame (and of the handshake's), once due.
    pub transfer_frame_timeout_ms: u64,
    /// Mutual TLS on the transfer link, when present.
    pub transfer_tls: Option<TransferTlsConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            body_bytes_max: 1 << 20,
            connections_max: 1024,
            connections_per_peer_max: 256,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            send_stall_timeout_ms: 15_000,
            summary_interval_ms: 10_000,
            send_rate_min_bytes_per_s: 1024,
            h2_streams_max: 64,
            h2_header_list_bytes_max: 32 << 10,
            h2_pending_resets_max: 20,
            h2_local_resets_max: 256,
            tokenize_threads: (default_threads() / 2).max(1),
            request_timeout_ms: 300_000,
            drain_timeout_ms: 10_000,
            canary_guard: false,
            tls: None,
            role: crate::transfer::Role::Both,
            transfer_listen: None,
            prefill_peers: Vec::new(),
            transfer_frame_timeout_ms: 10_000,
            transfer_tls: None,
        }
    }
}

/// The control-plane store.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Where the control plane's records live: `sled` (a folder on this
    /// machine, the default) or `etcd` (shared by many servers).
    pub backend: StoreBackend,
    /// The etcd cluster, for `backend = "etcd"`.
    pub etcd: crate::store::etcd_storage::EtcdOptions,
    /// What inference does while a shared store is away: `serve-known`
    /// (the default: the last state seen) or `refuse` (503).
    pub offline: OfflineMode,
    /// Its folder (relative to the policy file's folder): the sled database,
    /// and on every backend this server's plugin code.
    pub path: PathBuf,
    /// How often usage counters and refusal records are written: what a
    /// crash can lose.
    pub usage_flush_ms: u64,
    /// How long audit records are kept, in days.
    pub audit_retention_days: u64,
    /// Most audit records kept in all; the oldest go first.
    pub audit_records_max: u64,
    /// Most refusal records kept per tenant; its oldest go first (never
    /// anyone's security events or admin changes).
    pub audit_refusals_per_tenant_max: u64,
    /// Refusals listed one record each per tenant per flush interval; past
    /// it they are counted by code in one summary record.
    pub audit_refusals_listed_per_interval: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: StoreBackend::Sled,
            etcd: Default::default(),
            offline: OfflineMode::ServeKnown,
            path: PathBuf::from("bulkhead-state"),
            usage_flush_ms: 1000,
            audit_retention_days: 90,
            audit_records_max: crate::store::AUDIT_RECORDS_MAX,
            audit_refusals_per_tenant_max: crate::store::AUDIT_REFUSALS_PER_TENANT_MAX,
            audit_refusals_listed_per_interval: crate::store::usage::REFUSALS_LISTED_PER_INTERVAL,
        }
    }
}

/// The store's backend (`[store] backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// sled, in `[store] path`: one server.
    #[default]
    Sled,
    /// etcd v3 (`[store.etcd]`): many servers on one control plane.
    Etcd,
}

/// What inference does while a shared store is away (`[store] offline`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OfflineMode {
    /// Serve with the tenants and keys last seen: a key revoked elsewhere
    /// meanwhile keeps working here until the store is back.
    #[default]
    ServeKnown,
    /// Refuse new requests (503 `store_unavailable`) until the store is back.
    Refuse,
}

/// Policy plugins (`[plugins]`). Each limit is both the default of every
/// plugin call and its maximum: a plugin may ask for less at upload, never more.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    /// Wall-clock bound of one call, instantiation included (milliseconds).
    pub deadline_ms: u64,
    /// Fuel of one call (roughly, WebAssembly instructions).
    pub fuel: u64,
    /// Linear memory of one call's instance, in bytes.
    pub memory_bytes: u64,
    /// Host functions one call may call.
    pub host_calls_max: u32,
    /// Resource handles one call may hold.
    pub handles_max: u32,
    /// Faults (traps, deadlines, fuel, memory) that disable a plugin...
    pub faults_max: u32,
    /// ... within this window (milliseconds).
    pub fault_window_ms: u64,
    /// Plugin calls that may run at once (the instance pool's size).
    pub instances_max: u32,
    /// The time a tenant's own plugins may take together for one request
    /// (milliseconds): once for `route` and `admit` together, once for
    /// `on-complete`. Each call's deadline is its own or what is left of
    /// this, whichever comes first.
    pub request_budget_ms: u64,
    /// Threads that run `on-complete` calls, tenants in turn.
    pub complete_threads: u32,
    /// Ended requests whose `on-complete` calls may wait per tenant; past
    /// it, they are dropped (counted in
    /// `bulkhead_plugin_completions_dropped_total`).
    pub complete_queue_max: u32,
    /// Plugin uploads a tenant may make per minute (each is compiled).
    pub uploads_per_minute: u32,
    /// How long compiling one upload may take (milliseconds); uploads
    /// compile one at a time.
    pub compile_timeout_ms: u64,
    /// Bytes of plugin code a tenant may keep: its components and their
    /// compiled forms together.
    pub tenant_code_bytes_max: u64,
    /// Whether operator plugins may read the prompt text (`operator.prompt-text`).
    pub operator_prompt_text: bool,
    /// The operator's plugins, run before every tenant's own, in this order.
    pub operator: Vec<OperatorPlugin>,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        PluginsConfig {
            deadline_ms: 20,
            fuel: 20_000_000,
            memory_bytes: 16 << 20,
            host_calls_max: 1000,
            handles_max: 16,
            faults_max: 5,
            fault_window_ms: 60_000,
            instances_max: 64,
            request_budget_ms: 50,
            complete_threads: 2,
            complete_queue_max: 256,
            uploads_per_minute: 20,
            compile_timeout_ms: 10_000,
            tenant_code_bytes_max: 64 << 20,
            operator_prompt_text: false,
            operator: Vec::new(),
        }
    }
}

/// One operator plugin: a component file, run for every tenant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorPlugin {
    /// Its name (logs, metrics, audit); reserved: no tenant plugin may take it.
    pub name: String,
    /// The component (relative to the policy file's folder).
    pub path: PathBuf,
    /// What it does for a tenant whose requests made it fault `faults_max`
    /// times in the window, until the window has passed.
    #[serde(default)]
    pub on_trip: OnTrip,
}

/// What a tripped operator plugin does for the tenant it tripped for (every
/// other tenant's requests still run it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTrip {
    /// That tenant's requests fail closed (503 `policy_unavailable`): a
    /// tenant cannot switch a policy off by making it fault.
    #[default]
    FailClosed,
    /// That tenant's requests run without it (for a plugin that only
    /// observes).
    Skip,
}

impl OnTrip {
    /// The audit label.
    pub fn as_str(self) -> &'static str {
        match self {
            OnTrip::FailClosed => "fail_closed",
            OnTrip::Skip => "skip",
        }
    }
}

/// Highest `plugins.deadline_ms`.
pub const PLUGIN_DEADLINE_MS_LIMIT: u64 = 10_000;
/// Highest `plugins.memory_bytes`.
pub const PLUGIN_MEMORY_BYTES_LIMIT: u64 = 1 << 30;
/// Highest `plugins.instances_max`.
pub const PLUGIN_INSTANCES_LIMIT: u32 = 4096;
/// Most operator plugins.
pub const OPERATOR_PLUGINS_MAX: usize = 16;

/// PEM files for rustls.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain.
    pub cert_pem: PathBuf,
    /// Private key.
    pub key_pem: PathBuf,
}

/// Mutual TLS on the transfer link: this process's certificate and key,
/// and the CA every peer's certificate must chain to (see
/// `crate::transfer::tls`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferTlsConfig {
    /// This process's certificate chain.
    pub cert_pem: PathBuf,
    /// Its private key.
    pub key_pem: PathBuf,
    /// The CA certificates a peer's certificate must chain to.
    pub ca_pem: PathBuf,
    /// Decode side: the name a prefill peer's certificate must carry
    /// (default: each peer address's host; a `unix:` peer needs it).
    #[serde(default)]
    pub server_name: Option<String>,
}

impl ModelSpec {
    /// Checks every field against its bounds; `field(name)` names a field in
    /// the error (`models[0].pool_pages`, `pool_pages`).
    pub fn validate(&self, field: impl Fn(&str) -> String) -> Result<(), ConfigError> {
        if !valid_model_id(&self.id) {
            return Err(invalid(
                field("id"),
                "1-128 of [A-Za-z0-9._:-], starting with a letter or digit",
            ));
        }
        if self.path.as_os_str().is_empty() {
            return Err(invalid(field("path"), "must not be empty"));
        }
        for (name, value) in [
            ("context_tokens", self.context_tokens),
            ("threads", self.threads),
            ("page_tokens", self.page_tokens),
            ("pool_pages", self.pool_pages),
            ("seq_pages_max", self.seq_pages_max),
            ("step_tokens_max", self.step_tokens_max),
            ("step_seqs_max", self.step_seqs_max),
        ] {
            if value == 0 {
                return Err(invalid(field(name), "must be at least 1"));
            }
        }
        if self.threads > MODEL_THREADS_MAX {
            return Err(invalid(
                field("threads"),
                format!("at most {MODEL_THREADS_MAX}"),
            ));
        }
        if self.pool_pages > POOL_PAGES_LIMIT {
            return Err(invalid(
                field("pool_pages"),
                format!("at most {POOL_PAGES_LIMIT}"),
            ));
        }
        if self.step_tokens_max < self.step_seqs_max {
            return Err(invalid(
                field("step_tokens_max"),
                "must be at least step_seqs_max, so every sequence in a step can decode",
            ));
        }
        Ok(())
    }
}

/// What all models share.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// The memory every CPU model's weights and KV pool may take together, in
    /// bytes or with a unit (`"6 GiB"`); unset, nothing is checked (the sum is
    /// still printed). Start-up, `bulkhead check` and adding a model refuse a
    /// catalog above it.
    #[serde(deserialize_with = "bytes_with_unit")]
    pub memory_max: Option<u64>,
    /// The device memory every CUDA model's weights and KV pool may take
    /// together (default: 90 % of the GPU's, the rest left to the CUDA
    /// context, the kernels' scratch and captured graphs).
    #[serde(deserialize_with = "bytes_with_unit")]
    pub device_memory_max: Option<u64>,
    /// Where models compute unless their own `backend` says: `auto` (the
    /// default: CUDA where a driver, a device and NVRTC are present), `cpu`
    /// or `cuda`. `--backend` overrides it.
    pub backend: crate::engine::placement::BackendChoice,
    /// How CUDA models run (`[engine.cuda]`: `graphs`, `tensor_cores`).
    pub cuda: crate::engine::placement::CudaSwitches,
}

/// A byte count: an integer, or a string of a number and a unit (`B`, `KiB`,
/// `MiB`, `GiB`, `TiB`).
fn bytes_with_unit<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Bytes(u64),
        Text(String),
    }
    let text = match Raw::deserialize(d)? {
        Raw::Bytes(n) => return Ok(Some(n)),
        Raw::Text(text) => text,
    };
    parse_bytes(&text).map(Some).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "{text:?} is not a byte count such as 6442450944 or \"6 GiB\""
        ))
    })
}

/// `"6 GiB"` → 6442450944; None for anything else (or an overflow).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        _ => return None,
    };
    number.checked_mul(1u64 << shift)
}

/// One tenant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Share of the engine under contention, relative to other tenants.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Pages only this tenant may use.
    pub pages_reserved: u32,
    /// Hard maximum of pages this tenant may hold.
    pub pages_max: u32,
    /// Most requests waiting for pages.
    #[serde(default = "default_queue_depth")]
    pub queue_depth_max: u32,
    /// Most sequences running at once.
    #[serde(default = "default_running")]
    pub running_max: u32,
    /// Most of its requests being read, parsed, tokenized and submitted at once
    /// (work before admission, which its queue does not count yet).
    #[serde(default = "default_pending")]
    pub pending_max: u32,
    /// Whether its repeated prompt prefixes are cached (for it alone).
    #[serde(default = "default_prefix_cache")]
    pub prefix_cache: bool,
    /// SHA-256 digests (hex) of the tenant's API keys.
    #[serde(default)]
    pub keys_sha256: Vec<String>,
    /// An environment variable whose value, when set, is one more API key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// The models it may use: `["*"]` (the default) for every model, or ids of
    /// the policy's `[[models]]`.
    #[serde(default)]
    pub models: ModelAccess,
    /// The Gateway API Inference Extension objective (an InferenceObjective's
    /// name) the gateway sets on its requests, if any.
    #[serde(default)]
    pub objective: Option<String>,
}

/// Whether `name` can be an objective: a Kubernetes object name (1-253 of
/// `[a-z0-9.-]`, starting and ending with a letter or digit).
pub fn valid_objective(name: &str) -> bool {
    let ends = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    (1..=253).contains(&name.len())
        && ends(name.as_bytes().first())
        && ends(name.as_bytes().last())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

impl TenantConfig {
    /// Its limits.
    pub fn quota(&self) -> Quota {
        Quota {
            weight: self.weight,
            pages_reserved: self.pages_reserved,
            pages_max: self.pages_max,
            queue_depth_max: self.queue_depth_max,
            running_max: self.running_max,
            pending_max: self.pending_max,
            prefix_cache: self.prefix_cache,
        }
    }
}

fn default_weight() -> u32 {
    1
}
fn default_prefix_cache() -> bool {
    true
}
fn default_queue_depth() -> u32 {
    64
}
fn default_running() -> u32 {
    16
}
fn default_pending() -> u32 {
    8
}

impl Config {
    /// Reads and validates a policy file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.display().to_string(),
            cause,
        })?;
        let mut config = Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })?;
        config.source = path.to_path_buf();
        Ok(config)
    }

    /// Parses and validates policy text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<policy>".into(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The policy's models, their paths resolved against its folder.
    pub fn model_specs(&self) -> Vec<ModelSpec> {
        self.models
            .iter()
            .map(|m| ModelSpec {
                path: self.resolve(&m.path),
                ..m.clone()
            })
            .collect()
    }

    /// The store's folder, resolved against the policy file's folder.
    pub fn store_path(&self) -> PathBuf {
        self.resolve(&self.store.path)
    }

    /// `path`, relative to the policy file's folder when it is relative.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        match self.source.parent() {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.body_bytes_max == 0 || s.body_bytes_max > BODY_BYTES_LIMIT {
            return Err(invalid(
                "server.body_bytes_max",
                format!("must be 1..={BODY_BYTES_LIMIT}"),
            ));
        }
        for (field, value) in [
            ("server.connections_max", u64::from(s.connections_max)),
            (
                "server.connections_per_peer_max",
                u64::from(s.connections_per_peer_max),
            ),
            ("server.handshake_timeout_ms", s.handshake_timeout_ms),
            ("server.idle_timeout_ms", s.idle_timeout_ms),
            ("server.send_stall_timeout_ms", s.send_stall_timeout_ms),
            (
                "server.send_rate_min_bytes_per_s",
                s.send_rate_min_bytes_per_s,
            ),
            ("server.request_timeout_ms", s.request_timeout_ms),
            ("server.drain_timeout_ms", s.drain_timeout_ms),
            ("server.tokenize_threads", u64::from(s.tokenize_threads)),
            ("store.usage_flush_ms", self.store.usage_flush_ms),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if s.tokenize_threads as usize > crate::lane::LANE_THREADS_MAX {
            return Err(invalid(
                "server.tokenize_threads",
                format!("at most {}", crate::lane::LANE_THREADS_MAX),
            ));
        }
        for (field, value, max) in [
            ("server.h2_streams_max", s.h2_streams_max, 1024),
            (
                "server.h2_header_list_bytes_max",
                s.h2_header_list_bytes_max,
                1 << 20,
            ),
            (
                "server.h2_pending_resets_max",
                s.h2_pending_resets_max,
                1024,
            ),
            ("server.h2_local_resets_max", s.h2_local_resets_max, 1 << 16),
        ] {
            if value == 0 || value > max {
                return Err(invalid(field, format!("must be 1..={max}")));
            }
        }
        let st = &self.store;
        for (field, value, max) in [
            (
                "store.audit_retention_days",
                st.audit_retention_days,
                36_500,
            ),
            ("store.audit_records_max", st.audit_records_max, 1 << 32),
            (
                "store.audit_refusals_per_tenant_max",
                st.audit_refusals_per_tenant_max,
                1 << 32,
            ),
            (
                "store.audit_refusals_listed_per_interval",
                u64::from(st.audit_refusals_listed_per_interval),
                1 << 16,
            ),
        ] {
            if value == 0 || value > max {
                return Err(invalid(field, format!("must be 1..={max}")));
            }
        }
        self.validate_role()?;
        if s.connections_per_peer_max > s.connections_max {
            return Err(invalid(
                "server.connections_per_peer_max",
                "must be at most server.connections_max",
            ));
        }
        for (field, value) in [
            ("server.handshake_timeout_ms", s.handshake_timeout_ms),
            ("server.idle_timeout_ms", s.idle_timeout_ms),
            ("server.send_stall_timeout_ms", s.send_stall_timeout_ms),
            ("server.summary_interval_ms", s.summary_interval_ms),
            ("server.request_timeout_ms", s.request_timeout_ms),
            ("server.drain_timeout_ms", s.drain_timeout_ms),
            ("store.usage_flush_ms", self.store.usage_flush_ms),
        ] {
            if value > TIMEOUT_MS_LIMIT {
                return Err(invalid(
                    field,
                    format!("at most {TIMEOUT_MS_LIMIT} (a day)"),
                ));
            }
        }
        self.validate_plugins()?;
        self.validate_models()?;
        self.validate_tenants()
    }

    /// A prefill process needs a transfer listener and no peers, a decode
    /// process peers and no listener, `both` neither.
    pub fn validate_role(&self) -> Result<(), ConfigError> {
        use crate::transfer::{PeerAddr, Role};
        let s = &self.server;
        if let Some(addr) = &s.transfer_listen {
            addr.parse::<PeerAddr>()
                .map_err(|e| invalid("server.transfer_listen", e))?;
        }
        for addr in &s.prefill_peers {
            addr.parse::<PeerAddr>()
                .map_err(|e| invalid("server.prefill_peers", e))?;
        }
        match (s.role, &s.transfer_listen, s.prefill_peers.is_empty()) {
            (Role::Prefill, None, _) => Err(invalid(
                "server.transfer_listen",
                "role prefill needs an address for decode peers (--transfer-listen ADDR)",
            )),
            (Role::Prefill, _, false) => Err(invalid(
                "server.prefill_peers",
                "only a decode process has prefill peers",
            )),
            (Role::Decode, _, true) => Err(invalid(
                "server.prefill_peers",
                "role decode needs at least one prefill peer (--prefill-peer ADDR)",
            )),
            (Role::Decode | Role::Both, Some(_), _) => Err(invalid(
                "server.transfer_listen",
                "only a prefill process listens for decode peers",
            )),
            (Role::Both, None, false) => Err(invalid(
                "server.prefill_peers",
                "only a decode process has prefill peers (set server.role = \"decode\")",
            )),
            (Role::Decode, _, _)
                if s.transfer_tls
                    .as_ref()
                    .is_some_and(|t| t.server_name.is_none())
                    && s.prefill_peers.iter().any(|p| p.starts_with("unix:")) =>
            {
                Err(invalid(
                    "server.transfer_tls.server_name",
                    "a unix: prefill peer has no host name: name the one its certificate carries",
                ))
            }
            _ if s.transfer_frame_timeout_ms == 0
                || s.transfer_frame_timeout_ms > TIMEOUT_MS_LIMIT =>
            {
                Err(invalid(
                    "server.transfer_frame_timeout_ms",
                    format!("must be 1..={TIMEOUT_MS_LIMIT}"),
                ))
            }
            _ => Ok(()),
        }
    }

    fn validate_models(&self) -> Result<(), ConfigError> {
        if self.models.len() > MODELS_MAX {
            return Err(invalid("models", format!("at most {MODELS_MAX} models")));
        }
        for (i, model) in self.models.iter().enumerate() {
            model.validate(|f| format!("models[{i}].{f}"))?;
            if self.models[..i].iter().any(|m| m.id == model.id) {
                return Err(invalid(
                    format!("models[{i}].id"),
                    format!("{:?} is defined twice", model.id),
                ));
            }
        }
        Ok(())
    }

    fn validate_plugins(&self) -> Result<(), ConfigError> {
        let p = &self.plugins;
        for (field, value, max) in [
            (
                "plugins.deadline_ms",
                p.deadline_ms,
                PLUGIN_DEADLINE_MS_LIMIT,
            ),
            ("plugins.fuel", p.fuel, u64::MAX),
            (
                "plugins.memory_bytes",
                p.memory_bytes,
                PLUGIN_MEMORY_BYTES_LIMIT,
            ),
            (
                "plugins.host_calls_max",
                u64::from(p.host_calls_max),
                1 << 20,
            ),
            ("plugins.handles_max", u64::from(p.handles_max), 1024),
            ("plugins.faults_max", u64::from(p.faults_max), 1 << 20),
            (
                "plugins.fault_window_ms",
                p.fault_window_ms,
                TIMEOUT_MS_LIMIT,
            ),
            (
                "plugins.instances_max",
                u64::from(p.instances_max),
                u64::from(PLUGIN_INSTANCES_LIMIT),
            ),
            (
                "plugins.request_budget_ms",
                p.request_budget_ms,
                PLUGIN_DEADLINE_MS_LIMIT,
            ),
            (
                "plugins.complete_threads",
                u64::from(p.complete_threads),
                crate::lane::LANE_THREADS_MAX as u64,
            ),
            (
                "plugins.complete_queue_max",
                u64::from(p.complete_queue_max),
                1 << 16,
            ),
            (
                "plugins.uploads_per_minute",
                u64::from(p.uploads_per_minute),
                1 << 16,
            ),
            (
                "plugins.compile_timeout_ms",
                p.compile_timeout_ms,
                TIMEOUT_MS_LIMIT,
            ),
            (
                "plugins.tenant_code_bytes_max",
                p.tenant_code_bytes_max,
                1 << 40,
            ),
        ] {
            if value == 0 || value > max {
                return Err(invalid(field, format!("must be 1..={max}")));
            }
        }
        if p.operator.len() > OPERATOR_PLUGINS_MAX {
            return Err(invalid(
                "plugins.operator",
                format!("at most {OPERATOR_PLUGINS_MAX} operator plugins"),
            ));
        }
        for (i, plugin) in p.operator.iter().enumerate() {
            if !valid_name(&plugin.name)
                || p.operator[..i]
                    .iter()
                    .any(|other| other.name == plugin.name)
            {
                return Err(invalid(
                    format!("plugins.operator[{i}].name"),
                    "unique names of 1-64 of [A-Za-z0-9_-], starting with a letter",
                ));
            }
        }
        Ok(())
    }

    fn validate_tenants(&self) -> Result<(), ConfigError> {
        if self.tenants.len() > TENANTS_MAX {
            return Err(invalid(
                "tenants",
                format!("define at most {TENANTS_MAX} tenants"),
            ));
        }
        for (name, t) in &self.tenants {
            let field = |f: &str| format!("tenants.{name}.{f}");
            if !valid_name(name) {
                return Err(invalid(
                    format!("tenants.{name}"),
                    "names are 1-64 of [A-Za-z0-9_-], starting with a letter",
                ));
            }
            t.quota()
                .validate()
                .map_err(|e| invalid(field(e.field), e.reason))?;
            if let Some(objective) = t.objective.as_deref().filter(|o| !valid_objective(o)) {
                return Err(invalid(
                    field("objective"),
                    format!("{objective:?} is not a Kubernetes object name (1-253 of [a-z0-9.-], starting and ending with a letter or digit)"),
                ));
            }
            for (i, digest) in t.keys_sha256.iter().enumerate() {
                let hex = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit());
                if !hex {
                    return Err(invalid(
                        field(&format!("keys_sha256[{i}]")),
                        "must be 64 hex digits",
                    ));
                }
            }
            if let Some(unknown) = t
                .models
                .ids()
                .find(|id| !self.models.iter().any(|m| &m.id == *id))
            {
                return Err(invalid(
                    field("models"),
                    format!("{unknown:?} is not one of the policy's [[models]]"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[engine]
memory_max = "2 GiB"

[[models]]
id = "m"
path = "m.gguf"
context_tokens = 4096
page_tokens = 16
pool_pages = 1024
seq_pages_max = 256
step_tokens_max = 512
step_seqs_max = 32

[[models]]
id = "m-q8"
path = "/models/m-q8.gguf"
context_tokens = 2048

[tenants.alpha]
pages_reserved = 256
pages_max = 512

[tenants.beta]
pages_reserved = 256
pages_max = 512
models = ["m"]
"#;

    #[test]
    fn the_base_policy_parses_with_defaults_filled_in() {
        let mut config = Config::parse(BASE).unwrap();
        config.source = PathBuf::from("/etc/bulkhead/policy.toml");
        assert_eq!(config.engine.memory_max, Some(2 << 30));
        let specs = config.model_specs();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].path, PathBuf::from("/etc/bulkhead/m.gguf"));
        assert_eq!(specs[1].path, PathBuf::from("/models/m-q8.gguf"));
        let q8 = &specs[1];
        assert_eq!(
            (
                q8.page_tokens,
                q8.pool_pages,
                q8.seq_pages_max,
                q8.step_tokens_max,
                q8.step_seqs_max
            ),
            (16, 1024, 512, 256, 32)
        );
        assert_eq!(
            q8.kv_type,
            KvStorage::F16,
            "f16 KV unless the policy says f32"
        );
        let f32_kv = Config::parse(&BASE.replace(
            "context_tokens = 4096",
            "context_tokens = 4096\nkv_type = \"f32\"",
        ))
        .unwrap();
        assert_eq!(f32_kv.models[0].kv_type, KvStorage::F32);
        assert!(config.tenants["alpha"].models.allows("m-q8"));
        assert!(config.tenants["beta"].models.allows("m"));
        assert!(!config.tenants["beta"].models.allows("m-q8"));
    }

    #[test]
    fn the_cuda_switches_are_on_unless_the_policy_turns_one_off() {
        use crate::engine::placement::CudaSwitches;
        let on = CudaSwitches {
            graphs: true,
            tensor_cores: true,
            dependent_launches: true,
        };
        assert_eq!(Config::parse(BASE).unwrap().engine.cuda, on);
        let with = |table: &str| {
            Config::parse(&BASE.replace(
                "memory_max = \"2 GiB\"\n",
                &format!("memory_max = \"2 GiB\"\n\n[engine.cuda]\n{table}\n"),
            ))
        };
        let eager = with("graphs = false").unwrap().engine.cuda;
        assert_eq!(
            eager,
            CudaSwitches {
                graphs: false,
                ..on
            }
        );
        let warps = with("tensor_cores = false").unwrap().engine.cuda;
        assert_eq!(
            warps,
            CudaSwitches {
                tensor_cores: false,
                ..on
            }
        );
        let chained = with("dependent_launches = false").unwrap().engine.cuda;
        assert_eq!(
            chained,
            CudaSwitches {
                dependent_launches: false,
                ..on
            }
        );
        for (bad, needle) in [
            ("enforce_eager = true", "enforce_eager"),
            ("graphs = 0", "graphs"),
        ] {
            let err = with(bad).expect_err(bad).to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn byte_counts_take_units() {
        assert_eq!(parse_bytes("6 GiB"), Some(6 << 30));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("100"), Some(100));
        for bad in ["", "GiB", "6 GB", "-1 GiB", "1.5 GiB", "99999999999 TiB"] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn refuses_bad_values_and_unknown_keys() {
        let bad = [
            (
                BASE.replace("pool_pages = 1024", "pool_pages = 0"),
                "models[0].pool_pages",
            ),
            (
                BASE.replace("step_tokens_max = 512", "step_tokens_max = 8"),
                "models[0].step_tokens_max",
            ),
            (BASE.replace("id = \"m-q8\"", "id = \"m\""), "models[1].id"),
            (
                BASE.replace("id = \"m-q8\"", "id = \"m/q8\""),
                "models[1].id",
            ),
            (
                BASE.replace("models = [\"m\"]", "models = [\"m-q4\"]"),
                "tenants.beta.models",
            ),
            (
                BASE.replace("models = [\"m\"]", "models = [\"*\", \"m\"]"),
                "models",
            ),
            (
                BASE.replace("memory_max = \"2 GiB\"", "memory_max = \"2 GB\""),
                "memory_max",
            ),
            (
                BASE.replace(
                    "pages_max = 512\n\n[tenants.beta]",
                    "pages_max = 100\n\n[tenants.beta]",
                ),
                "tenants.alpha.pages_max",
            ),
            (
                BASE.replace("[tenants.beta]", "[tenants.\"be ta\"]"),
                "tenants.be ta",
            ),
            (
                BASE.replace(
                    "context_tokens = 4096",
                    "context_tokens = 4096\ncontext_tokenz = 1",
                ),
                "context_tokenz",
            ),
            (
                BASE.replace("context_tokens = 4096", "context_tokens = \"big\""),
                "context_tokens",
            ),
            (
                BASE.replace(
                    "context_tokens = 4096",
                    "context_tokens = 4096\nkv_type = \"q8\"",
                ),
                "kv_type",
            ),
            (
                BASE.replace(
                    "[tenants.alpha]",
                    "[tenants.alpha]\nkeys_sha256 = [\"abc\"]",
                ),
                "keys_sha256[0]",
            ),
            (
                BASE.replace("[[models]]\nid = \"m\"", "[model]\nid = \"m\""),
                "model",
            ),
        ];
        for (text, needle) in bad {
            let err = Config::parse(&text).expect_err(needle).to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn the_demo_policy_parses_and_resolves_the_model_paths() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/demo.toml");
        let config = Config::load(&path).unwrap();
        assert!(config.tenants.contains_key("alpha") && config.tenants.contains_key("beta"));
        let specs = config.model_specs();
        assert!(specs[0]
            .path
            .ends_with(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert!(specs[1]
            .path
            .ends_with(".cache/models/SmolLM2-135M-Instruct.Q8_0.gguf"));
        let beta = &config.tenants["beta"].models;
        assert!(beta.allows(&specs[0].id) && !beta.allows(&specs[1].id));
    }
}
