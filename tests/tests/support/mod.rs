//! A `bulkhead serve` child process on loopback ports it picks itself
//! (`--listen 127.0.0.1:0`; the bound addresses are read from its stderr), a
//! small policy in a temporary folder, and a plain HTTP client.

#![allow(dead_code)]

pub mod etcd;
pub mod h2;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Tenant keys the tests hand the server through `key_env`.
pub const KEY_ALPHA: &str = "test-key-alpha-0123456789abcdef";
pub const KEY_BETA: &str = "test-key-beta-0123456789abcdef";
pub const KEY_GAMMA: &str = "test-key-gamma-0123456789abcdef";
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";
/// The model id in the test policy.
pub const MODEL_ID: &str = "smollm2-test";
/// The id tests give the Q8_0 model, when they serve it too.
pub const Q8_ID: &str = "smollm2-test-q8";
/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A test binary runs its tests two at a time on CI's 2 cores, and a test's
/// clients and server share them with the other test's: a flood in one test
/// is CPU taken from another's victim, which no server can give back, and a
/// plugin's deadline of milliseconds can pass while the other test computes
/// (stop 51's CI failed such a test so). A test that floods, or whose bounds
/// are such deadlines, holds [`alone`]; one that times a victim holds
/// [`beside`] (with other such tests, which mostly wait on deadlines).
static TURNS: RwLock<()> = RwLock::new(());

/// The binary to this test alone, while the guard lives (see [`TURNS`]).
pub fn alone() -> RwLockWriteGuard<'static, ()> {
    TURNS.write().unwrap_or_else(PoisonError::into_inner)
}

/// This test beside any other but one that runs [`alone`].
pub fn beside() -> RwLockReadGuard<'static, ()> {
    TURNS.read().unwrap_or_else(PoisonError::into_inner)
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The binary `cargo build -p bulkhead` produced.
pub fn bulkhead_exe() -> PathBuf {
    let exe = std::env::var_os("BULKHEAD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let test_exe = std::env::current_exe().expect("test executable path");
            test_exe
                .parent()
                .and_then(|deps| deps.parent())
                .expect("target dir")
                .join("bulkhead")
        });
    assert!(
        exe.exists(),
        "{} is missing: run `cargo build -p bulkhead` first",
        exe.display()
    );
    exe
}

/// The real model, or `None` (and a "skipped:" line) when it is absent.
pub fn smollm2() -> Option<PathBuf> {
    let path = repo_root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "BULKHEAD_REQUIRE_MODEL is set but the model is missing: run scripts/setup.sh"
    );
    eprintln!(
        "skipped: {} is missing; run scripts/setup.sh",
        path.display()
    );
    None
}

/// The Q8_0 model `scripts/models.sh` derives from the default one, or `None`
/// (and a "skipped:" line) when it is absent.
pub fn smollm2_q8() -> Option<PathBuf> {
    let path = repo_root().join(".cache/models/SmolLM2-135M-Instruct.Q8_0.gguf");
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "BULKHEAD_REQUIRE_MODEL is set but {} is missing: run scripts/models.sh",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing; run scripts/models.sh",
        path.display()
    );
    None
}

/// A `[[models]]` entry (or an admin API body, as JSON) serving `path` as `id`
/// with the test policy's geometry.
pub fn model_toml(id: &str, path: &std::path::Path, pool_pages: u32) -> String {
    format!(
        "[[models]]\nid = \"{id}\"\npath = \"{}\"\ncontext_tokens = 1024\nthreads = 1\n\
         page_tokens = 16\npool_pages = {pool_pages}\nseq_pages_max = 64\n\
         step_tokens_max = 256\nstep_seqs_max = 8\n",
        path.display()
    )
}

/// Knobs of the test policy.
#[derive(Clone, Debug)]
pub struct Policy {
    pub context_tokens: u32,
    pub seq_pages_max: u32,
    pub body_bytes_max: u32,
    pub drain_timeout_ms: u32,
    pub rust_log: &'static str,
    /// Certificate and key PEM files: both listeners speak TLS.
    pub tls: Option<(PathBuf, PathBuf)>,
    pub connections_max: u32,
    pub connections_per_peer_max: u32,
    pub handshake_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    /// Tenant beta's `pending_max`.
    pub beta_pending_max: u32,
    /// `store.path` (default: a folder next to the policy file).
    pub store_path: Option<PathBuf>,
    /// Tenant alpha's `pending_max`.
    pub alpha_pending_max: u32,
    /// A `[plugins]` section (TOML), when not the defaults.
    pub plugins_toml: String,
    /// Tenant beta's `models` (TOML list), when not every model.
    pub beta_models: Option<String>,
    /// More TOML at the end: more `[[models]]`, an `[engine]` section.
    pub extra_toml: String,
    /// Tenant alpha's and beta's (pages_reserved, pages_max).
    pub alpha_pages: (u32, u32),
    pub beta_pages: (u32, u32),
    /// `server.canary_guard`.
    pub canary_guard: bool,
    /// `server.request_timeout_ms`.
    pub request_timeout_ms: u64,
    /// More `[server]` fields (TOML lines).
    pub server_toml: String,
    /// More `[store]` fields (TOML lines).
    pub store_toml: String,
    /// The model's compute threads: 1, as tests run two at a time on a
    /// 2-core CI machine; a binary with one test may take both cores.
    pub threads: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            context_tokens: 1024,
            seq_pages_max: 64,
            body_bytes_max: 32768,
            drain_timeout_ms: 60_000,
            rust_log: "info",
            tls: None,
            connections_max: 64,
            connections_per_peer_max: 64,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            beta_pending_max: 8,
            store_path: None,
            alpha_pending_max: 8,
            plugins_toml: String::new(),
            beta_models: None,
            extra_toml: String::new(),
            alpha_pages: (64, 96),
            beta_pages: (64, 96),
            canary_guard: false,
            request_timeout_ms: 120_000,
            server_toml: String::new(),
            store_toml: String::new(),
            threads: 1,
        }
    }
}

impl Policy {
    fn toml(&self, model: &std::path::Path) -> String {
        let tls = match &self.tls {
            Some((cert, key)) => format!(
                "[server.tls]\ncert_pem = \"{}\"\nkey_pem = \"{}\"\n",
                cert.display(),
                key.display()
            ),
            None => String::new(),
        };
        let store = match &self.store_path {
            Some(path) => format!(
                "[store]\npath = \"{}\"\n{}",
                path.display(),
                self.store_toml
            ),
            None if self.store_toml.is_empty() => String::new(),
            None => format!("[store]\n{}", self.store_toml),
        };
        format!(
            r#"
[server]
body_bytes_max = {body}
connections_max = {connections_max}
connections_per_peer_max = {per_peer}
handshake_timeout_ms = {handshake}
idle_timeout_ms = {idle}
request_timeout_ms = {request_timeout}
drain_timeout_ms = {drain}
canary_guard = {canary_guard}
{server_extra}
{tls}
{store}
{plugins}
[[models]]
id = "{MODEL_ID}"
path = "{model}"
context_tokens = {context}
threads = {threads}
page_tokens = 16
pool_pages = 224
seq_pages_max = {seq_pages}
step_tokens_max = 256
step_seqs_max = 8

[tenants.alpha]
pages_reserved = {alpha_reserved}
pages_max = {alpha_max}
pending_max = {alpha_pending}
key_env = "BULKHEAD_KEY_ALPHA"

[tenants.beta]
pages_reserved = {beta_reserved}
pages_max = {beta_max}
pending_max = {beta_pending}
key_env = "BULKHEAD_KEY_BETA"
{beta_models}

# One running, one queued: the third concurrent request gets 429.
[tenants.gamma]
pages_reserved = 64
pages_max = 96
queue_depth_max = 1
running_max = 1
key_env = "BULKHEAD_KEY_GAMMA"

{extra}
"#,
            body = self.body_bytes_max,
            drain = self.drain_timeout_ms,
            model = model.display(),
            context = self.context_tokens,
            seq_pages = self.seq_pages_max,
            connections_max = self.connections_max,
            per_peer = self.connections_per_peer_max,
            handshake = self.handshake_timeout_ms,
            idle = self.idle_timeout_ms,
            beta_pending = self.beta_pending_max,
            alpha_pending = self.alpha_pending_max,
            plugins = self.plugins_toml,
            beta_models = match &self.beta_models {
                Some(list) => format!("models = {list}"),
                None => String::new(),
            },
            extra = self.extra_toml,
            alpha_reserved = self.alpha_pages.0,
            alpha_max = self.alpha_pages.1,
            beta_reserved = self.beta_pages.0,
            beta_max = self.beta_pages.1,
            canary_guard = self.canary_guard,
            request_timeout = self.request_timeout_ms,
            server_extra = self.server_toml,
            threads = self.threads,
        )
    }
}

/// A running server; killed when dropped (its folder, with the policy and the
/// store, is removed then too, unless another `Server` started in it later).
pub struct Server {
    child: Child,
    pub inference: String,
    pub admin: String,
    lines: Arc<Mutex<Vec<String>>>,
    stdout: Arc<Mutex<Vec<String>>>,
    pub dir: PathBuf,
    owns_dir: bool,
    agent: ureq::Agent,
}

pub fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("bulkhead-{tag}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// How to start a server: a policy, a folder, and environment changes.
pub struct Launch<'a> {
    pub model: &'a std::path::Path,
    pub policy: &'a Policy,
    /// The folder holding policy.toml and the store (a new one when None).
    pub dir: Option<PathBuf>,
    /// Environment variables to set (value Some) or remove (None).
    pub env: Vec<(&'static str, Option<String>)>,
    /// The inference listener's address (default 127.0.0.1:0).
    pub listen: Option<String>,
    /// More arguments of `serve`.
    pub args: Vec<String>,
}

impl<'a> Launch<'a> {
    pub fn new(model: &'a std::path::Path, policy: &'a Policy) -> Launch<'a> {
        Launch {
            model,
            policy,
            dir: None,
            env: Vec::new(),
            listen: None,
            args: Vec::new(),
        }
    }

    pub fn arg(mut self, arg: &str) -> Launch<'a> {
        self.args.push(arg.to_string());
        self
    }

    pub fn listen(mut self, addr: &str) -> Launch<'a> {
        self.listen = Some(addr.to_string());
        self
    }

    pub fn env(mut self, var: &'static str, value: Option<&str>) -> Launch<'a> {
        self.env.push((var, value.map(str::to_string)));
        self
    }

    pub fn dir(mut self, dir: &std::path::Path) -> Launch<'a> {
        self.dir = Some(dir.to_path_buf());
        self
    }
}

fn collect_lines(
    reader: impl Read + Send + 'static,
    sink: Arc<Mutex<Vec<String>>>,
    listening: Option<mpsc::Sender<String>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if let (Some(tx), Some(rest)) = (&listening, line.strip_prefix("listening: ")) {
                let _ = tx.send(rest.to_string());
            }
            sink.lock().unwrap().push(line);
        }
    });
}

/// Starts `bulkhead serve` with `policy`; the exit status and stderr when it
/// refused to start.
pub fn try_start(model: &std::path::Path, policy: &Policy) -> Result<Server, (ExitStatus, String)> {
    try_launch(Launch::new(model, policy))
}

/// Starts `bulkhead serve` as `launch` says.
pub fn try_launch(launch: Launch) -> Result<Server, (ExitStatus, String)> {
    let owns_dir = launch.dir.is_none();
    let dir = launch.dir.unwrap_or_else(|| temp_dir("serve"));
    let config = dir.join("policy.toml");
    std::fs::write(&config, launch.policy.toml(launch.model)).unwrap();
    let mut command = Command::new(bulkhead_exe());
    command
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .args([
            "--listen",
            launch.listen.as_deref().unwrap_or("127.0.0.1:0"),
        ])
        .args(["--admin-listen", "127.0.0.1:0"])
        .args(&launch.args)
        .env("BULKHEAD_KEY_ALPHA", KEY_ALPHA)
        .env("BULKHEAD_KEY_BETA", KEY_BETA)
        .env("BULKHEAD_KEY_GAMMA", KEY_GAMMA)
        .env("BULKHEAD_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("RUST_LOG", launch.policy.rust_log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (var, value) in &launch.env {
        match value {
            Some(value) => command.env(var, value),
            None => command.env_remove(var),
        };
    }
    let mut child = command.spawn().expect("the binary starts");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    collect_lines(child.stderr.take().unwrap(), Arc::clone(&lines), Some(tx));
    collect_lines(child.stdout.take().unwrap(), Arc::clone(&stdout), None);
    let mut inference = None;
    let mut admin = None;
    let deadline = Instant::now() + START_TIMEOUT;
    while inference.is_none() || admin.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let (name, url) = line.split_once(' ').unwrap();
                match name {
                    "inference" => inference = Some(url.to_string()),
                    "admin" => admin = Some(url.to_string()),
                    other => panic!("unknown listener {other}"),
                }
            }
            Err(_) => {
                // Exited (refused to start) or hung.
                let status = match child.try_wait().unwrap() {
                    Some(status) => status,
                    None => {
                        let _ = child.kill();
                        child.wait().unwrap()
                    }
                };
                std::thread::sleep(Duration::from_millis(100));
                let text = lines.lock().unwrap().join("\n");
                if owns_dir {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                return Err((status, text));
            }
        }
    }
    Ok(Server {
        child,
        inference: inference.unwrap(),
        admin: admin.unwrap(),
        lines,
        stdout,
        dir,
        owns_dir,
        agent: ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(300))
            .build(),
    })
}

/// Starts a server as `launch` says, or panics with its stderr.
pub fn launch(launch: Launch) -> Server {
    match try_launch(launch) {
        Ok(server) => server,
        Err((status, stderr)) => panic!("server did not start ({status}):\n{stderr}"),
    }
}

/// Starts a server or panics with its stderr.
pub fn start(model: &std::path::Path, policy: &Policy) -> Server {
    match try_start(model, policy) {
        Ok(server) => server,
        Err((status, stderr)) => panic!("server did not start ({status}):\n{stderr}"),
    }
}

/// A response: status, headers we care about, body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    pub content_type: Option<String>,
    pub request_id: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// `error.param` and `error.code` of an error reply.
    pub fn error(&self) -> (serde_json::Value, serde_json::Value) {
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].is_string(), "OpenAI error shape: {v}");
        assert!(e["type"].is_string(), "OpenAI error shape: {v}");
        (e["param"].clone(), e["code"].clone())
    }
}

fn reply(result: Result<ureq::Response, ureq::Error>) -> Reply {
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("transport error: {e}"),
    };
    Reply {
        status: response.status(),
        retry_after: response.header("retry-after").map(str::to_string),
        content_type: response.header("content-type").map(str::to_string),
        request_id: response.header("x-request-id").map(str::to_string),
        body: response.into_string().unwrap(),
    }
}

impl Server {
    pub fn post(&self, path: &str, key: Option<&str>, body: &[u8]) -> Reply {
        let mut request = self
            .agent
            .post(&format!("{}{path}", self.inference))
            .set("content-type", "application/json");
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        reply(request.send_bytes(body))
    }

    pub fn post_json(&self, path: &str, key: Option<&str>, body: &serde_json::Value) -> Reply {
        self.post(path, key, body.to_string().as_bytes())
    }

    pub fn get(&self, base: &str, path: &str, key: Option<&str>) -> Reply {
        let mut request = self.agent.get(&format!("{base}{path}"));
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        reply(request.call())
    }

    /// Starts a streamed request; the reader yields the SSE body.
    pub fn stream(&self, path: &str, key: &str, body: &serde_json::Value) -> (u16, SseReader) {
        let result = self
            .agent
            .post(&format!("{}{path}", self.inference))
            .set("authorization", &format!("Bearer {key}"))
            .send_string(&body.to_string());
        let response = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("transport error: {e}"),
        };
        let status = response.status();
        (status, SseReader::new(Box::new(response.into_reader())))
    }

    /// `/metrics` from the admin listener.
    pub fn metrics(&self) -> String {
        let r = self.get(&self.admin, "/metrics", None);
        assert_eq!(r.status, 200);
        r.body
    }

    /// The value of the sample `name{labels}` (labels exactly as rendered), or 0.
    pub fn metric(&self, name_and_labels: &str) -> f64 {
        metric_value(&self.metrics(), name_and_labels)
    }

    /// Every stderr line so far (the log stream).
    pub fn stderr_lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Whether a stderr line containing `needle` appears within 5 s.
    pub fn logged(&self, needle: &str) -> bool {
        eventually(Duration::from_secs(5), || {
            self.stderr_lines().iter().any(|l| l.contains(needle))
        })
    }

    /// Every stdout line so far (secrets generated at start-up).
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Kills the process at once (SIGKILL: no drain, no flush) and keeps its
    /// folder for the next server; returns the folder.
    pub fn kill(mut self) -> PathBuf {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.owns_dir = false;
        self.dir.clone()
    }

    /// An admin call: method, path, optional JSON body, with the admin token.
    pub fn admin_call(&self, method: &str, path: &str, body: Option<&serde_json::Value>) -> Reply {
        self.call(&self.admin, method, path, Some(ADMIN_TOKEN), body)
    }

    /// A call with `key` on the listener at `base`.
    pub fn call(
        &self,
        base: &str,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&serde_json::Value>,
    ) -> Reply {
        let mut request = self.agent.request(method, &format!("{base}{path}"));
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        reply(match body {
            Some(body) => request
                .set("content-type", "application/json")
                .send_string(&body.to_string()),
            None => request.call(),
        })
    }

    /// A call with a raw body and content type.
    pub fn call_raw(
        &self,
        base: &str,
        method: &str,
        path: &str,
        key: Option<&str>,
        content_type: &str,
        body: &[u8],
    ) -> Reply {
        let mut request = self
            .agent
            .request(method, &format!("{base}{path}"))
            .set("content-type", content_type);
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        reply(request.send_bytes(body))
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time the server has used so far, user and system.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        // Fields after the command's closing parenthesis; utime and stime
        // are the 14th and 15th of the line.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // SAFETY: sysconf reads a constant of the system.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Duration::from_millis(ticks * 1000 / per_second)
    }

    /// The server's resident memory, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
            * 1024
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill(2) with a child pid we own; no memory is shared.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// Waits for the process to exit, at most `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return status;
            }
            assert!(Instant::now() < deadline, "the server did not exit in time");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Finds `name_and_labels` at the start of a line of Prometheus text.
pub fn metric_value(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            let rest = line.strip_prefix(name_and_labels)?;
            rest.strip_prefix(' ')?.trim().parse::<f64>().ok()
        })
        .unwrap_or(0.0)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.owns_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The events of an SSE body.
pub struct SseReader {
    reader: BufReader<Box<dyn Read + Send + Sync>>,
}

impl SseReader {
    /// Reads the SSE body `reader`.
    pub fn new(reader: Box<dyn Read + Send + Sync>) -> SseReader {
        SseReader {
            reader: BufReader::new(reader),
        }
    }

    /// The next `data:` payload, or `None` at the end of the body.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return Some(data.to_string());
            }
            assert!(line.trim().is_empty(), "unexpected SSE line {line:?}");
        }
    }

    /// Every remaining payload.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

/// A chat body.
pub fn chat_body(content: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// Polls `check` every 50 ms until it holds, at most `timeout`.
pub fn eventually(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    check()
}

/// Makes room for new tenants: gamma gives up its reservation.
pub fn free_gamma_reservation(server: &Server) {
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/gamma",
        Some(&serde_json::json!({"pages_reserved": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A plugin component that `scripts/plugins.sh` builds (`rate_limit`,
/// `probe`, ...), or `None` (and a "skipped:" line) when it is absent.
pub fn plugin_wasm(name: &str) -> Option<PathBuf> {
    let path = repo_root().join(format!("plugins/target/wasm32-wasip2/release/{name}.wasm"));
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "BULKHEAD_REQUIRE_MODEL is set but {} is missing: run scripts/plugins.sh",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing; run scripts/plugins.sh",
        path.display()
    );
    None
}

// Plugins: uploads through the admin API, and small completions with headers.

/// A plugin component's bytes (see [`plugin_wasm`]).
pub fn wasm(name: &str) -> Option<Vec<u8>> {
    plugin_wasm(name).map(|p| std::fs::read(p).unwrap())
}

/// Uploads `bytes` as `tenant`'s plugin `name` through the admin API.
pub fn upload(server: &Server, tenant: &str, name: &str, bytes: &[u8], query: &str) -> Reply {
    server.call_raw(
        &server.admin,
        "PUT",
        &format!("/admin/v1/tenants/{tenant}/plugins/{name}{query}"),
        Some(ADMIN_TOKEN),
        "application/wasm",
        bytes,
    )
}

pub fn uploaded(server: &Server, tenant: &str, name: &str, bytes: &[u8]) {
    let r = upload(server, tenant, name, bytes, "");
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The request lane's jobs so far for the tenant of `key`
/// (`bulkhead_lane_jobs_total`; its id from `GET /v1/tenant`).
pub fn request_lane_jobs(server: &Server, key: &str) -> f64 {
    let me = server
        .call(&server.inference, "GET", "/v1/tenant", Some(key), None)
        .json();
    let id = me["id"].as_u64().expect("the tenant's id");
    server.metric(&format!(
        r#"bulkhead_lane_jobs_total{{lane="request",tenant_id="{id}"}}"#
    ))
}

/// A small completion by `key` with extra headers.
pub fn ask(server: &Server, key: &str, headers: &[(&str, &str)], max_tokens: u32) -> Reply {
    ask_prompt(server, key, headers, "Hello there", max_tokens)
}

pub fn ask_prompt(
    server: &Server,
    key: &str,
    headers: &[(&str, &str)],
    prompt: &str,
    max_tokens: u32,
) -> Reply {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build();
    let mut request = agent
        .post(&format!("{}/v1/completions", server.inference))
        .set("authorization", &format!("Bearer {key}"))
        .set("content-type", "application/json");
    for (name, value) in headers {
        request = request.set(name, value);
    }
    let body = serde_json::json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let response = match request.send_string(&body.to_string()) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("transport error: {e}"),
    };
    Reply {
        status: response.status(),
        retry_after: response.header("retry-after").map(str::to_string),
        content_type: response.header("content-type").map(str::to_string),
        request_id: response.header("x-request-id").map(str::to_string),
        body: response.into_string().unwrap(),
    }
}

pub fn code(r: &Reply) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("").to_string()
}

pub fn message(r: &Reply) -> String {
    r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string()
}
