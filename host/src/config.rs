//! The deployment policy (`policies/*.toml`) as typed configuration, and the
//! capacity contract (invariant I2).
//!
//! 1. [`Config::load`] parses a file; every limit has a named default and a
//!    bound, and an unknown key is an error (a typo must not silently fall back
//!    to a default).
//! 2. [`Capacity::check`] compares the context window promised to clients with
//!    every stage that must hold it: the model's context, the per-sequence page
//!    limit, each tenant's hard maximum, and the pool. A violation refuses to
//!    start (or to apply an admin change) and names the limit.
//! 3. [`Capacity::table`] renders the same numbers for `bulkhead check` and the
//!    server's start-up log.

use crate::tenancy::{valid_name, Quota};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
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

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
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
    /// The model served.
    pub model: ModelConfig,
    /// KV pool and batching.
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
    /// Threads that tokenize prompts, taking tenants in turn (their CPU is
    /// the engine's too on a CPU host).
    pub tokenize_threads: u32,
    /// Deadline of one request, from arrival to its last token.
    pub request_timeout_ms: u64,
    /// How long a shutdown waits for in-flight requests.
    pub drain_timeout_ms: u64,
    /// TLS for both listeners, when present.
    pub tls: Option<TlsConfig>,
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
            tokenize_threads: (default_threads() / 2).max(1),
            request_timeout_ms: 300_000,
            drain_timeout_ms: 10_000,
            tls: None,
        }
    }
}

/// The control-plane store.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Its folder (relative to the policy file's folder).
    pub path: PathBuf,
    /// How often usage counters and refusal records are written: what a
    /// crash can lose.
    pub usage_flush_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: PathBuf::from("bulkhead-state"),
            usage_flush_ms: 1000,
        }
    }
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
            operator_prompt_text: false,
            operator: Vec::new(),
        }
    }
}

/// One operator plugin: a component file, run for every tenant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorPlugin {
    /// Its name (logs, metrics, audit).
    pub name: String,
    /// The component (relative to the policy file's folder).
    pub path: PathBuf,
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

/// The model served.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The id clients name in requests and `GET /v1/models` lists.
    pub id: String,
    /// The GGUF file (relative to the policy file's folder).
    pub path: PathBuf,
    /// The context window promised to clients (prompt + completion tokens).
    pub context_tokens: u32,
    /// Compute threads.
    #[serde(default = "default_threads")]
    pub threads: u32,
}

fn default_threads() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

/// KV pool and batching.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Token positions per KV page.
    pub page_tokens: u32,
    /// Pages in the pool (allocated once, at start-up).
    pub pool_pages: u32,
    /// Most pages one sequence may hold.
    pub seq_pages_max: u32,
    /// Most tokens in one step: the prefill chunk budget plus decode tokens.
    pub step_tokens_max: u32,
    /// Most sequences in one step.
    pub step_seqs_max: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page_tokens: 16,
            pool_pages: 1024,
            seq_pages_max: 512,
            step_tokens_max: 512,
            step_seqs_max: 32,
        }
    }
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
    /// SHA-256 digests (hex) of the tenant's API keys.
    #[serde(default)]
    pub keys_sha256: Vec<String>,
    /// An environment variable whose value, when set, is one more API key.
    #[serde(default)]
    pub key_env: Option<String>,
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
        }
    }
}

fn default_weight() -> u32 {
    1
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
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
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

    /// The model file, resolved against the policy file's folder.
    pub fn model_path(&self) -> PathBuf {
        self.resolve(&self.model.path)
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
            ("server.request_timeout_ms", s.request_timeout_ms),
            ("server.drain_timeout_ms", s.drain_timeout_ms),
            ("server.tokenize_threads", u64::from(s.tokenize_threads)),
            ("store.usage_flush_ms", self.store.usage_flush_ms),
            ("model.context_tokens", u64::from(self.model.context_tokens)),
            ("model.threads", u64::from(self.model.threads)),
            ("engine.page_tokens", u64::from(self.engine.page_tokens)),
            ("engine.pool_pages", u64::from(self.engine.pool_pages)),
            ("engine.seq_pages_max", u64::from(self.engine.seq_pages_max)),
            (
                "engine.step_tokens_max",
                u64::from(self.engine.step_tokens_max),
            ),
            ("engine.step_seqs_max", u64::from(self.engine.step_seqs_max)),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if s.tokenize_threads as usize > crate::api::lane::LANE_THREADS_MAX {
            return Err(invalid(
                "server.tokenize_threads",
                format!("at most {}", crate::api::lane::LANE_THREADS_MAX),
            ));
        }
        if s.connections_per_peer_max > s.connections_max {
            return Err(invalid(
                "server.connections_per_peer_max",
                "must be at most server.connections_max",
            ));
        }
        for (field, value) in [
            ("server.handshake_timeout_ms", s.handshake_timeout_ms),
            ("server.idle_timeout_ms", s.idle_timeout_ms),
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
        if self.engine.pool_pages > POOL_PAGES_LIMIT {
            return Err(invalid(
                "engine.pool_pages",
                format!("at most {POOL_PAGES_LIMIT}"),
            ));
        }
        if self.engine.step_tokens_max < self.engine.step_seqs_max {
            return Err(invalid(
                "engine.step_tokens_max",
                "must be at least engine.step_seqs_max, so every sequence in a step can decode",
            ));
        }
        if self.model.id.is_empty() {
            return Err(invalid("model.id", "must not be empty"));
        }
        self.validate_tenants()
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
        let mut reserved_total = 0u64;
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
            for (i, digest) in t.keys_sha256.iter().enumerate() {
                let hex = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit());
                if !hex {
                    return Err(invalid(
                        field(&format!("keys_sha256[{i}]")),
                        "must be 64 hex digits",
                    ));
                }
            }
            reserved_total += u64::from(t.pages_reserved);
        }
        if reserved_total > u64::from(self.engine.pool_pages) {
            return Err(invalid(
                "tenants.*.pages_reserved",
                format!(
                    "reservations add up to {reserved_total} pages; the pool has {}",
                    self.engine.pool_pages
                ),
            ));
        }
        Ok(())
    }
}

/// The stage of the capacity table that reports reservations above the pool
/// (I8): a row only when they are, holding no tokens.
pub const RESERVATIONS_STAGE: &str = "reservations";

/// One row of the capacity table: a stage and how many tokens it can hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The stage, as printed ("model context", "tenant alpha maximum", ...).
    pub stage: String,
    /// The config field that sets it.
    pub field: String,
    /// Tokens it holds for one sequence.
    pub tokens: u64,
}

/// The capacity contract of a deployment.
#[derive(Clone, Debug)]
pub struct Capacity {
    /// Tokens promised to clients (prompt + completion).
    pub promised_tokens: u64,
    /// Every stage that must hold a promised window.
    pub limits: Vec<Limit>,
    /// Tokens per step, for the table (chunked prefill takes any prompt length).
    pub step_tokens_max: u64,
}

/// A promise that some stage cannot keep.
#[derive(Debug, thiserror::Error)]
#[error("capacity contract violated: the promised context of {promised} tokens exceeds {stage} ({tokens} tokens, set by {field})\n{table}")]
pub struct CapacityViolation {
    /// Tokens promised.
    pub promised: u64,
    /// The stage that cannot hold them.
    pub stage: String,
    /// The field that sets that stage.
    pub field: String,
    /// What that stage holds.
    pub tokens: u64,
    /// The whole table.
    pub table: String,
    /// The whole contract.
    pub capacity: Box<Capacity>,
}

impl Capacity {
    /// The contract of `config` for a model whose own context is
    /// `model_context_tokens`, with the policy file's tenants.
    pub fn new(config: &Config, model_context_tokens: u64) -> Capacity {
        let tenants: Vec<(String, Quota)> = config
            .tenants
            .iter()
            .map(|(name, t)| (name.clone(), t.quota()))
            .collect();
        Capacity::with_tenants(config, model_context_tokens, &tenants)
    }

    /// The contract of `config`'s model and engine with `tenants` (the live
    /// set, or the set an admin change would make).
    pub fn with_tenants(
        config: &Config,
        model_context_tokens: u64,
        tenants: &[(String, Quota)],
    ) -> Capacity {
        let page_tokens = u64::from(config.engine.page_tokens);
        let pool_pages = u64::from(config.engine.pool_pages);
        let mut limits = vec![
            Limit {
                stage: "model context".into(),
                field: "the model file (context_length)".into(),
                tokens: model_context_tokens,
            },
            Limit {
                stage: "per-sequence page limit".into(),
                field: "engine.seq_pages_max".into(),
                tokens: u64::from(config.engine.seq_pages_max) * page_tokens,
            },
            Limit {
                stage: "KV pool".into(),
                field: "engine.pool_pages".into(),
                tokens: pool_pages * page_tokens,
            },
        ];
        let reserved_total: u64 = tenants
            .iter()
            .map(|(_, q)| u64::from(q.pages_reserved))
            .sum();
        if reserved_total > pool_pages {
            // I8: no tenant's reservation may be another's burst.
            limits.push(Limit {
                stage: RESERVATIONS_STAGE.into(),
                field: format!(
                    "tenants' pages_reserved add up to {reserved_total} pages; engine.pool_pages is {pool_pages}"
                ),
                tokens: 0,
            });
        }
        for (name, quota) in tenants {
            // A tenant can never take pages other tenants have reserved (I8).
            let others_reserved = reserved_total - u64::from(quota.pages_reserved);
            let reachable = pool_pages.saturating_sub(others_reserved);
            let (pages, field) = if u64::from(quota.pages_max) <= reachable {
                (
                    u64::from(quota.pages_max),
                    format!("tenants.{name}.pages_max"),
                )
            } else {
                (
                    reachable,
                    "engine.pool_pages minus other tenants' pages_reserved".to_string(),
                )
            };
            limits.push(Limit {
                stage: format!("tenant {name} maximum"),
                field,
                tokens: pages * page_tokens,
            });
        }
        Capacity {
            promised_tokens: u64::from(config.model.context_tokens),
            limits,
            step_tokens_max: u64::from(config.engine.step_tokens_max),
        }
    }

    /// Ok when every stage holds the promised window; otherwise the first stage
    /// that does not, with the whole table.
    pub fn check(&self) -> Result<(), CapacityViolation> {
        match self.limits.iter().find(|l| l.tokens < self.promised_tokens) {
            None => Ok(()),
            Some(l) => Err(CapacityViolation {
                promised: self.promised_tokens,
                stage: l.stage.clone(),
                field: l.field.clone(),
                tokens: l.tokens,
                table: self.table(),
                capacity: Box::new(self.clone()),
            }),
        }
    }

    /// The table of limits, one stage a line.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<32} {:>10}  {:<6} set by",
            "stage", "tokens", "holds"
        );
        let _ = writeln!(
            out,
            "{:<32} {:>10}  {:<6} model.context_tokens",
            "promised context", self.promised_tokens, "-"
        );
        for l in &self.limits {
            let holds = if l.tokens >= self.promised_tokens {
                "ok"
            } else {
                "NO"
            };
            let _ = writeln!(
                out,
                "{:<32} {:>10}  {:<6} {}",
                l.stage, l.tokens, holds, l.field
            );
        }
        let _ = writeln!(
            out,
            "{:<32} {:>10}  {:<6} engine.step_tokens_max (chunked: any prompt length)",
            "prefill chunk budget", self.step_tokens_max, "ok"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[model]
id = "m"
path = "m.gguf"
context_tokens = 4096

[engine]
page_tokens = 16
pool_pages = 1024
seq_pages_max = 256
step_tokens_max = 512
step_seqs_max = 32

[tenants.alpha]
pages_reserved = 256
pages_max = 512

[tenants.beta]
pages_reserved = 256
pages_max = 512
"#;

    fn with(replace: &str, by: &str) -> Config {
        assert!(BASE.contains(replace), "{replace}");
        Config::parse(&BASE.replace(replace, by)).expect("valid policy")
    }

    fn violation(config: &Config, model_context: u64) -> CapacityViolation {
        Capacity::new(config, model_context)
            .check()
            .expect_err("a violation")
    }

    #[test]
    fn the_base_policy_keeps_its_promise() {
        let config = Config::parse(BASE).unwrap();
        let capacity = Capacity::new(&config, 8192);
        capacity.check().unwrap();
        let table = capacity.table();
        for stage in [
            "promised context",
            "model context",
            "per-sequence page limit",
            "KV pool",
            "tenant alpha maximum",
            "tenant beta maximum",
            "prefill chunk budget",
        ] {
            assert!(table.contains(stage), "{stage} missing from\n{table}");
        }
        assert!(!table.contains("NO"));
    }

    #[test]
    fn refuses_a_promise_beyond_the_model_context() {
        let v = violation(&Config::parse(BASE).unwrap(), 2048);
        assert_eq!(v.stage, "model context");
        assert!(v.to_string().contains("4096") && v.to_string().contains("NO"));
    }

    #[test]
    fn refuses_a_promise_beyond_the_per_sequence_page_limit() {
        let v = violation(&with("seq_pages_max = 256", "seq_pages_max = 255"), 8192);
        assert_eq!(
            (v.stage.as_str(), v.field.as_str()),
            ("per-sequence page limit", "engine.seq_pages_max")
        );
    }

    #[test]
    fn refuses_a_promise_beyond_a_tenants_maximum() {
        let config = with(
            "pages_reserved = 256\npages_max = 512\n\n[tenants.beta]",
            "pages_reserved = 0\npages_max = 255\n\n[tenants.beta]",
        );
        let v = violation(&config, 8192);
        assert_eq!(
            (v.stage.as_str(), v.field.as_str()),
            ("tenant alpha maximum", "tenants.alpha.pages_max")
        );
    }

    #[test]
    fn refuses_a_promise_other_tenants_reservations_make_unreachable() {
        // beta reserves 800 of 1024 pages: alpha can never hold more than 224.
        let text = BASE
            .replace(
                "[tenants.alpha]\npages_reserved = 256",
                "[tenants.alpha]\npages_reserved = 200",
            )
            .replace(
                "[tenants.beta]\npages_reserved = 256\npages_max = 512",
                "[tenants.beta]\npages_reserved = 800\npages_max = 1024",
            );
        let v = violation(&Config::parse(&text).unwrap(), 8192);
        assert_eq!(v.stage, "tenant alpha maximum");
        assert!(
            v.field.contains("other tenants' pages_reserved"),
            "{}",
            v.field
        );
    }

    #[test]
    fn refuses_a_promise_beyond_the_pool() {
        let text = BASE
            .replace("context_tokens = 4096", "context_tokens = 9700")
            .replace("pool_pages = 1024", "pool_pages = 600")
            .replace("seq_pages_max = 256", "seq_pages_max = 1000")
            .replace(
                "pages_reserved = 256\npages_max = 512",
                "pages_reserved = 0\npages_max = 1000",
            );
        let v = violation(&Config::parse(&text).unwrap(), 16384);
        assert_eq!(
            (v.stage.as_str(), v.field.as_str()),
            ("KV pool", "engine.pool_pages")
        );
    }

    #[test]
    fn refuses_bad_values_and_unknown_keys() {
        let bad = [
            (
                BASE.replace("pool_pages = 1024", "pool_pages = 0"),
                "engine.pool_pages",
            ),
            (
                BASE.replace("step_tokens_max = 512", "step_tokens_max = 8"),
                "engine.step_tokens_max",
            ),
            (
                BASE.replace(
                    "pages_max = 512\n\n[tenants.beta]",
                    "pages_max = 100\n\n[tenants.beta]",
                ),
                "tenants.alpha.pages_max",
            ),
            (
                BASE.replace("pool_pages = 1024", "pool_pages = 500"),
                "pages_reserved",
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
                    "[tenants.alpha]",
                    "[tenants.alpha]\nkeys_sha256 = [\"abc\"]",
                ),
                "keys_sha256[0]",
            ),
        ];
        for (text, needle) in bad {
            let err = Config::parse(&text).expect_err(needle).to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn the_demo_policy_parses_and_resolves_the_model_path() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/demo.toml");
        let config = Config::load(&path).unwrap();
        assert!(config.tenants.contains_key("alpha") && config.tenants.contains_key("beta"));
        assert!(config
            .model_path()
            .ends_with(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        Capacity::new(&config, 8192).check().unwrap();
    }
}
