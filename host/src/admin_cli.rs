//! `bulkhead admin …`: the everyday admin tasks as commands that call the
//! admin API (HTTP or HTTPS) and print its answer: as tables and lines, or
//! as the JSON itself with `--json`.
//!
//! The token comes from `--token` or `BULKHEAD_ADMIN_TOKEN`; the server from
//! `--url` or `BULKHEAD_ADMIN_URL` (default `http://127.0.0.1:8081`). A secret
//! the server generates (`key issue`) is printed here, to the terminal that
//! asked for it, and nowhere else. A refused call prints the server's error
//! message to stderr and exits with status 1.

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long one admin call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest answer read.
const ANSWER_BYTES_MAX: usize = 64 << 20;

/// `bulkhead admin` arguments.
#[derive(Args, Debug)]
pub struct AdminArgs {
    /// The admin listener (default: $BULKHEAD_ADMIN_URL, or http://127.0.0.1:8081).
    #[arg(long)]
    url: Option<String>,
    /// The admin token (default: $BULKHEAD_ADMIN_TOKEN).
    #[arg(long)]
    token: Option<String>,
    /// A PEM certificate to trust for HTTPS (e.g. a self-signed server certificate).
    #[arg(long)]
    cacert: Option<PathBuf>,
    /// Print the API's JSON answer as it came (default: tables and lines).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Subcommand, Debug)]
enum AdminCommand {
    /// Tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// A tenant's limits.
    #[command(subcommand)]
    Quota(QuotaCommand),
    /// API keys.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// The catalog: load and unload models without a restart.
    #[command(subcommand)]
    Model(ModelCommand),
    /// A tenant's canaries (the runtime canary guard, README "Security").
    #[command(subcommand)]
    Canary(CanaryCommand),
    /// Each model's capacity contract with the live tenant set.
    Capacity,
    /// Every tenant's live KV partition and queues, per model.
    Partitions,
    /// A tenant's usage over the last minutes.
    Usage {
        /// The tenant.
        tenant: String,
        /// How many minutes back (default 60).
        #[arg(long, default_value_t = 60)]
        minutes: u64,
    },
    /// The audit log, newest first (or, with --after, oldest first from there).
    Audit {
        /// Records after this sequence number, oldest first.
        #[arg(long)]
        after: Option<u64>,
        /// Records before this sequence number, newest first.
        #[arg(long, conflicts_with = "after")]
        before: Option<u64>,
        /// Most records.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Only records about this tenant (its name as the target, or the
        /// tenant itself as the actor).
        #[arg(long)]
        tenant: Option<String>,
        /// Only records whose action starts with this (`plugin.`, `key.revoke`).
        #[arg(long)]
        action: Option<String>,
        /// Only records of the last N minutes.
        #[arg(long)]
        minutes: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
enum TenantCommand {
    /// Every tenant.
    List,
    /// One tenant.
    Get {
        /// Its name.
        name: String,
    },
    /// Creates a tenant (then issue it a key with `key issue`).
    Create {
        /// Its name.
        name: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    /// Deletes a tenant: its keys stop working, its requests end.
    Delete {
        /// Its name.
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum QuotaCommand {
    /// Changes some of a tenant's limits.
    Set {
        /// The tenant.
        tenant: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
}

#[derive(Args, Debug)]
struct QuotaArgs {
    /// Share of the engine under contention.
    #[arg(long)]
    weight: Option<u32>,
    /// KV pages only this tenant may use.
    #[arg(long)]
    pages_reserved: Option<u32>,
    /// The most KV pages it may hold.
    #[arg(long)]
    pages_max: Option<u32>,
    /// Most requests waiting for pages.
    #[arg(long)]
    queue_depth_max: Option<u32>,
    /// Most sequences running at once.
    #[arg(long)]
    running_max: Option<u32>,
    /// Most requests before admission at once.
    #[arg(long)]
    pending_max: Option<u32>,
    /// The models it may use: comma-separated ids, `*` for every model, `""` for none.
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    /// Whether its repeated prompt prefixes are cached (for it alone).
    #[arg(long)]
    prefix_cache: Option<bool>,
}

impl QuotaArgs {
    fn json(&self) -> Value {
        let mut out = serde_json::Map::new();
        for (field, value) in [
            ("weight", self.weight),
            ("pages_reserved", self.pages_reserved),
            ("pages_max", self.pages_max),
            ("queue_depth_max", self.queue_depth_max),
            ("running_max", self.running_max),
            ("pending_max", self.pending_max),
        ] {
            if let Some(value) = value {
                out.insert(field.into(), value.into());
            }
        }
        if let Some(on) = self.prefix_cache {
            out.insert("prefix_cache".into(), on.into());
        }
        if let Some(models) = &self.models {
            // `--models ""` is the empty list: no model.
            let ids: Vec<&String> = models.iter().filter(|m| !m.is_empty()).collect();
            out.insert("models".into(), json!(ids));
        }
        Value::Object(out)
    }
}

#[derive(Subcommand, Debug)]
enum KeyCommand {
    /// Issues a key; its secret is printed once, here.
    Issue {
        /// The tenant.
        tenant: String,
    },
    /// A tenant's keys (never their secrets).
    List {
        /// The tenant.
        tenant: String,
    },
    /// Revokes a key; it fails from the next request on.
    Revoke {
        /// The tenant.
        tenant: String,
        /// The key's id (`key_…`).
        key: String,
    },
}

#[derive(Subcommand, Debug)]
enum CanaryCommand {
    /// A tenant's canaries, and whether the guard scans for them.
    List {
        /// The tenant.
        tenant: String,
    },
    /// Replaces a tenant's canaries (none given: clears them).
    Set {
        /// The tenant.
        tenant: String,
        /// The strings: at most 32, each 8-256 bytes (16+ random characters,
        /// which no tenant can guess).
        canaries: Vec<String>,
    },
}

#[derive(Subcommand, Debug)]
enum PluginCommand {
    /// Uploads a component (a new version if the name exists).
    Upload {
        /// The tenant.
        tenant: String,
        /// The plugin's name.
        name: String,
        /// The `.wasm` component.
        file: PathBuf,
    },
    /// A tenant's plugins.
    List {
        /// The tenant.
        tenant: String,
    },
    /// Enables a plugin.
    Enable {
        /// The tenant.
        tenant: String,
        /// The plugin.
        name: String,
    },
    /// Disables a plugin.
    Disable {
        /// The tenant.
        tenant: String,
        /// The plugin.
        name: String,
    },
    /// Deletes a plugin.
    Delete {
        /// The tenant.
        tenant: String,
        /// The plugin.
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Every model: its source, memory and readiness.
    List,
    /// Loads a GGUF file as a new model; it serves at once and at every start
    /// until removed.
    Add {
        /// The id clients send as `model`.
        id: String,
        /// The GGUF file (a path on the server; made absolute here).
        file: PathBuf,
        /// The context promised to clients.
        #[arg(long)]
        context_tokens: u32,
        /// Pages in its KV pool.
        #[arg(long)]
        pool_pages: Option<u32>,
        /// Most pages one sequence may hold.
        #[arg(long)]
        seq_pages_max: Option<u32>,
        /// Token positions per page.
        #[arg(long)]
        page_tokens: Option<u32>,
        /// Compute threads.
        #[arg(long)]
        threads: Option<u32>,
        /// Most tokens in one step.
        #[arg(long)]
        step_tokens_max: Option<u32>,
        /// Most sequences in one step.
        #[arg(long)]
        step_seqs_max: Option<u32>,
    },
    /// Audits a model's KV pool: back at its baseline, every free page zero,
    /// every invariant holding (stalls its engine for one pass over the free
    /// pages: not for a scrape loop).
    Pool {
        /// Its id.
        id: String,
    },
    /// Unloads a model: new requests get 404, those in flight get the drain.
    Remove {
        /// Its id.
        id: String,
        /// Milliseconds its requests in flight may run on (default: the
        /// server's drain_timeout_ms).
        #[arg(long)]
        drain_ms: Option<u64>,
    },
}

/// One call: method, path, body.
struct Call {
    method: Method,
    path: String,
    body: Option<(Bytes, &'static str)>,
}

impl Call {
    fn get(path: String) -> Call {
        Call {
            method: Method::GET,
            path,
            body: None,
        }
    }

    fn with(method: Method, path: String, body: Option<Value>) -> Call {
        Call {
            method,
            path,
            body: body.map(|b| (Bytes::from(b.to_string()), "application/json")),
        }
    }
}

/// Percent-encodes a path segment (names are validated server-side; this
/// keeps a typo from becoming another path).
fn segment(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn call_of(command: &AdminCommand) -> Result<Call> {
    let tenants = "/admin/v1/tenants";
    Ok(match command {
        AdminCommand::Tenant(TenantCommand::List) => Call::get(tenants.into()),
        AdminCommand::Tenant(TenantCommand::Get { name }) => {
            Call::get(format!("{tenants}/{}", segment(name)))
        }
        AdminCommand::Tenant(TenantCommand::Create { name, quota }) => {
            let mut body = quota.json();
            body["name"] = json!(name);
            Call::with(Method::POST, tenants.into(), Some(body))
        }
        AdminCommand::Tenant(TenantCommand::Delete { name }) => {
            Call::with(Method::DELETE, format!("{tenants}/{}", segment(name)), None)
        }
        AdminCommand::Quota(QuotaCommand::Set { tenant, quota }) => Call::with(
            Method::PATCH,
            format!("{tenants}/{}", segment(tenant)),
            Some(quota.json()),
        ),
        AdminCommand::Key(KeyCommand::Issue { tenant }) => Call::with(
            Method::POST,
            format!("{tenants}/{}/keys", segment(tenant)),
            None,
        ),
        AdminCommand::Key(KeyCommand::List { tenant }) => {
            Call::get(format!("{tenants}/{}/keys", segment(tenant)))
        }
        AdminCommand::Key(KeyCommand::Revoke { tenant, key }) => Call::with(
            Method::DELETE,
            format!("{tenants}/{}/keys/{}", segment(tenant), segment(key)),
            None,
        ),
        AdminCommand::Plugin(PluginCommand::Upload { tenant, name, file }) => {
            let bytes =
                std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            Call {
                method: Method::PUT,
                path: format!("{tenants}/{}/plugins/{}", segment(tenant), segment(name)),
                body: Some((Bytes::from(bytes), "application/wasm")),
            }
        }
        AdminCommand::Plugin(PluginCommand::List { tenant }) => {
            Call::get(format!("{tenants}/{}/plugins", segment(tenant)))
        }
        AdminCommand::Plugin(PluginCommand::Enable { tenant, name }) => Call::with(
            Method::POST,
            format!(
                "{tenants}/{}/plugins/{}/enable",
                segment(tenant),
                segment(name)
            ),
            None,
        ),
        AdminCommand::Plugin(PluginCommand::Disable { tenant, name }) => Call::with(
            Method::POST,
            format!(
                "{tenants}/{}/plugins/{}/disable",
                segment(tenant),
                segment(name)
            ),
            None,
        ),
        AdminCommand::Plugin(PluginCommand::Delete { tenant, name }) => Call::with(
            Method::DELETE,
            format!("{tenants}/{}/plugins/{}", segment(tenant), segment(name)),
            None,
        ),
        AdminCommand::Model(ModelCommand::List) => Call::get("/admin/v1/models".into()),
        AdminCommand::Model(ModelCommand::Add {
            id,
            file,
            context_tokens,
            pool_pages,
            seq_pages_max,
            page_tokens,
            threads,
            step_tokens_max,
            step_seqs_max,
        }) => {
            let path = std::path::absolute(file).with_context(|| format!("{}", file.display()))?;
            let mut body = json!({"id": id, "path": path, "context_tokens": context_tokens});
            for (field, value) in [
                ("pool_pages", pool_pages),
                ("seq_pages_max", seq_pages_max),
                ("page_tokens", page_tokens),
                ("threads", threads),
                ("step_tokens_max", step_tokens_max),
                ("step_seqs_max", step_seqs_max),
            ] {
                if let Some(value) = value {
                    body[field] = json!(value);
                }
            }
            Call::with(Method::POST, "/admin/v1/models".into(), Some(body))
        }
        AdminCommand::Model(ModelCommand::Pool { id }) => {
            Call::get(format!("/admin/v1/models/{}/pool", segment(id)))
        }
        AdminCommand::Model(ModelCommand::Remove { id, drain_ms }) => {
            let query = drain_ms.map_or_else(String::new, |ms| format!("?drain_ms={ms}"));
            Call::with(
                Method::DELETE,
                format!("/admin/v1/models/{}{query}", segment(id)),
                None,
            )
        }
        AdminCommand::Canary(CanaryCommand::List { tenant }) => {
            Call::get(format!("{tenants}/{}/canaries", segment(tenant)))
        }
        AdminCommand::Canary(CanaryCommand::Set { tenant, canaries }) => Call::with(
            Method::PUT,
            format!("{tenants}/{}/canaries", segment(tenant)),
            Some(json!({ "canaries": canaries })),
        ),
        AdminCommand::Capacity => Call::get("/admin/v1/capacity".into()),
        AdminCommand::Partitions => Call::get("/admin/v1/partitions".into()),
        AdminCommand::Usage { tenant, minutes } => {
            let now = crate::clock::now_ms();
            let from = now.saturating_sub(minutes.saturating_mul(60_000));
            Call::get(format!(
                "/admin/v1/usage?tenant={}&from_ms={from}&to_ms={}",
                segment(tenant),
                now + 60_000
            ))
        }
        AdminCommand::Audit {
            after,
            before,
            limit,
            tenant,
            action,
            minutes,
        } => {
            let mut query = match after {
                Some(after) => format!("after={after}&limit={limit}"),
                None => format!("before={}&limit={limit}", before.unwrap_or(u64::MAX)),
            };
            if let Some(tenant) = tenant {
                query += &format!("&tenant={}", segment(tenant));
            }
            if let Some(action) = action {
                query += &format!("&action={}", segment(action));
            }
            if let Some(minutes) = minutes {
                let from = crate::clock::now_ms().saturating_sub(minutes.saturating_mul(60_000));
                query += &format!("&from_ms={from}");
            }
            Call::get(format!("/admin/v1/audit?{query}"))
        }
    })
}

/// Runs `bulkhead admin …`.
pub fn run(args: AdminArgs) -> Result<()> {
    let url = args
        .url
        .clone()
        .or_else(|| std::env::var("BULKHEAD_ADMIN_URL").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8081".into());
    let token = args
        .token
        .clone()
        .or_else(|| std::env::var("BULKHEAD_ADMIN_TOKEN").ok())
        .filter(|t| !t.is_empty())
        .context("no admin token: pass --token or set BULKHEAD_ADMIN_TOKEN")?;
    let call = call_of(&args.command)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (status, body) = runtime.block_on(async {
        tokio::time::timeout(
            CALL_TIMEOUT,
            send(&url, &token, args.cacert.as_deref(), call),
        )
        .await
        .map_err(|_| anyhow!("no answer from {url} within {}s", CALL_TIMEOUT.as_secs()))?
    })?;
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !(200..300).contains(&status) {
        let message = value["error"]["message"].as_str().map_or_else(
            || String::from_utf8_lossy(&body).into_owned(),
            str::to_string,
        );
        if let Some(limits) = value["error"]["limits"].as_array() {
            for l in limits {
                eprintln!(
                    "  {:<32} {:>10}  {:<5} {}",
                    l["stage"].as_str().unwrap_or(""),
                    l["tokens"],
                    if l["holds"] == true { "ok" } else { "NO" },
                    l["field"].as_str().unwrap_or("")
                );
            }
        }
        bail!("{status}: {message}");
    }
    if body.is_empty() {
        return Ok(());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", render(&value));
    }
    Ok(())
}

/// An answer for a person: an object as `field: value` lines (nested
/// objects as `a.b`), a list of objects as a table with a header, nested
/// lists under their field's name. `--json` prints the answer itself.
pub fn render(value: &Value) -> String {
    let mut out = String::new();
    // A list answer (`{"data": [...], ...}`): the table, then the rest.
    if let Some(Value::Array(data)) = value.get("data") {
        match rows_of(&value["data"]) {
            Some(rows) => table(&mut out, rows, ""),
            None if data.is_empty() => out.push_str("(none)\n"),
            None => out.push_str(&format!("{}\n", text_of(&value["data"]))),
        }
        let mut rest = value.clone();
        if let Some(fields) = rest.as_object_mut() {
            fields.remove("data");
        }
        render_into(&mut out, &rest, "");
        return out;
    }
    render_into(&mut out, value, "");
    out
}

fn render_into(out: &mut String, value: &Value, indent: &str) {
    match value {
        Value::Object(fields) => {
            let mut scalars = Vec::new();
            flatten(&mut scalars, "", value);
            for (name, text) in &scalars {
                out.push_str(&format!("{indent}{name}: {text}\n"));
            }
            for (name, nested) in fields {
                if let Some(rows) = rows_of(nested) {
                    out.push_str(&format!("{indent}{name}:\n"));
                    table(out, rows, &format!("{indent}  "));
                }
            }
        }
        Value::Array(_) => match rows_of(value) {
            Some(rows) => table(out, rows, indent),
            None => out.push_str(&format!("{indent}{}\n", text_of(value))),
        },
        other => out.push_str(&format!("{indent}{}\n", text_of(other))),
    }
}

/// A list whose items are all objects (and not empty).
fn rows_of(value: &Value) -> Option<&Vec<Value>> {
    match value {
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
            Some(items)
        }
        _ => None,
    }
}

/// Every field of `value` that is not a list of objects, nested objects
/// as `a.b`.
fn flatten(out: &mut Vec<(String, String)>, prefix: &str, value: &Value) {
    let Value::Object(fields) = value else {
        return;
    };
    for (name, field) in fields {
        let name = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match field {
            Value::Object(inner) if !inner.is_empty() => flatten(out, &name, field),
            _ if rows_of(field).is_some() => {}
            _ => out.push((name, text_of(field))),
        }
    }
}

fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Object(fields) if fields.is_empty() => "-".into(),
        Value::Array(items) => items.iter().map(text_of).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Rows as a table: one column per field any row has, in first-seen order;
/// rows that hold lists of objects print as blocks instead.
fn table(out: &mut String, rows: &[Value], indent: &str) {
    if rows.iter().any(|r| {
        r.as_object()
            .is_some_and(|o| o.values().any(|v| rows_of(v).is_some()))
    }) {
        for (i, row) in rows.iter().enumerate() {
            if i > 0 {
                out.push('\n');
            }
            render_into(out, row, indent);
        }
        return;
    }
    let cells: Vec<Vec<(String, String)>> = rows
        .iter()
        .map(|row| {
            let mut cells = Vec::new();
            flatten(&mut cells, "", row);
            cells
        })
        .collect();
    let mut columns: Vec<String> = Vec::new();
    for row in &cells {
        for (name, _) in row {
            if !columns.contains(name) {
                columns.push(name.clone());
            }
        }
    }
    // Identity first (what a reader scans a table by), the rest as they came.
    const FIRST: [&str; 8] = [
        "seq", "id", "name", "model", "stage", "action", "actor", "target",
    ];
    columns.sort_by_key(|c| FIRST.iter().position(|f| f == c).unwrap_or(FIRST.len()));
    let text = |row: &[(String, String)], column: &str| {
        row.iter()
            .find(|(name, _)| name == column)
            .map_or_else(|| "-".to_string(), |(_, text)| text.clone())
    };
    let widths: Vec<usize> = columns
        .iter()
        .map(|c| {
            cells
                .iter()
                .map(|row| text(row, c).chars().count())
                .fold(c.chars().count(), usize::max)
        })
        .collect();
    let line = |values: Vec<String>| {
        let padded: Vec<String> = values
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        format!("{indent}{}\n", padded.join("  ").trim_end())
    };
    out.push_str(&line(columns.iter().map(|c| c.to_uppercase()).collect()));
    for row in &cells {
        out.push_str(&line(columns.iter().map(|c| text(row, c)).collect()));
    }
}

/// Sends one call over HTTP/1.1, with TLS for `https://`.
async fn send(
    url: &str,
    token: &str,
    cacert: Option<&std::path::Path>,
    call: Call,
) -> Result<(u16, Bytes)> {
    let uri: hyper::Uri = url.parse().with_context(|| format!("--url {url}"))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => bail!("--url {url}: use http:// or https://"),
    };
    let host = uri.host().context("--url has no host")?.to_string();
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let stream = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .with_context(|| format!("connecting to {host}:{port}"))?;
    let (method, path, body) = (call.method, call.path, call.body);
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", format!("{host}:{port}"))
        .header("authorization", format!("Bearer {token}"));
    let payload = match body {
        Some((bytes, content_type)) => {
            request = request.header("content-type", content_type);
            bytes
        }
        None => Bytes::new(),
    };
    let request = request.body(Full::new(payload))?;
    if https {
        let connector = tls_connector(cacert)?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| anyhow!("--url host {host}: {e}"))?;
        let stream = connector.connect(name, stream).await?;
        exchange(TokioIo::new(stream), request).await
    } else {
        exchange(TokioIo::new(stream), request).await
    }
}

async fn exchange<I>(io: I, request: Request<Full<Bytes>>) -> Result<(u16, Bytes)>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let body = http_body_util::Limited::new(response.into_body(), ANSWER_BYTES_MAX)
        .collect()
        .await
        .map_err(|e| anyhow!("reading the answer: {e}"))?
        .to_bytes();
    Ok((status, body))
}

fn tls_connector(cacert: Option<&std::path::Path>) -> Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    let path =
        cacert.context("an https:// --url needs --cacert (the server's certificate or its CA)")?;
    for cert in CertificateDer::pem_file_iter(path)
        .with_context(|| format!("--cacert {}", path.display()))?
    {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Arguments of `bulkhead bench admin`.
#[derive(Args, Clone, Debug)]
pub struct AdminBenchArgs {
    /// The admin listener (default: $BULKHEAD_ADMIN_URL, or http://127.0.0.1:8081).
    #[arg(long)]
    url: Option<String>,
    /// The admin token (default: $BULKHEAD_ADMIN_TOKEN).
    #[arg(long)]
    token: Option<String>,
    /// The tenant whose weight the writes toggle (its quota changes in the
    /// store, the engine and the audit log: a full admin write).
    #[arg(long, default_value = "beta")]
    tenant: String,
    /// Writes to send.
    #[arg(long, default_value_t = 200)]
    writes: u32,
    /// Writes per second (0: back to back).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
}

/// `bulkhead bench admin`: admin write latency (each write flushed to disk
/// before its answer), p50/p99 over `--writes` writes.
pub fn bench(args: &AdminBenchArgs) -> Result<()> {
    let url = args
        .url
        .clone()
        .or_else(|| std::env::var("BULKHEAD_ADMIN_URL").ok())
        .unwrap_or_else(|| "http://127.0.0.1:8081".into());
    let token = args
        .token
        .clone()
        .or_else(|| std::env::var("BULKHEAD_ADMIN_TOKEN").ok())
        .context("no admin token: pass --token or set BULKHEAD_ADMIN_TOKEN")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let started = std::time::Instant::now();
    let mut latencies = Vec::with_capacity(args.writes as usize);
    let mut failures = 0u32;
    for n in 0..args.writes {
        if let Some(interval) = interval {
            let due = started + interval * n;
            std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
        }
        let call = Call::with(
            Method::PATCH,
            format!("/admin/v1/tenants/{}", segment(&args.tenant)),
            Some(json!({"weight": 1 + n % 2})),
        );
        let sent = std::time::Instant::now();
        match runtime.block_on(send(&url, &token, None, call)) {
            Ok((200, _)) => latencies.push(sent.elapsed()),
            Ok((status, body)) => {
                failures += 1;
                if failures == 1 {
                    eprintln!("write {n}: {status} {}", String::from_utf8_lossy(&body));
                }
            }
            Err(error) => {
                failures += 1;
                if failures == 1 {
                    eprintln!("write {n}: {error:#}");
                }
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    latencies.sort();
    let at = |p: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * p).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    println!(
        "bench admin: {} writes in {wall:.1} s ({:.1}/s), latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {failures} failed",
        latencies.len(),
        latencies.len() as f64 / wall,
        at(0.5),
        at(0.99),
        at(1.0),
    );
    Ok(())
}
