//! Metric names, the Prometheus recorder, and tracing set-up (invariant I9).
//!
//! 1. Every metric is named here. Labels are tenant names (validated
//!    `[A-Za-z0-9_-]`), model ids (validated `[A-Za-z0-9._:-]`, bounded by the
//!    catalog's `MODELS_MAX`) and fixed reason codes; never a client value,
//!    never prompt or completion text.
//! 2. Logs are JSON lines on stderr with the request id and tenant. Dependency
//!    crates (hyper, h2, rustls) are capped at `info` whatever `RUST_LOG` says,
//!    because their trace output can carry raw protocol bytes.
//! 3. Engine gauges (queue depth, KV pages by model, tenant and state, scrubs)
//!    are set from each model's engine thread's latest snapshot when `/metrics`
//!    is scraped.

use crate::engine::stats::{SchedulerStats, TenantCounts};
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::BTreeMap;
use std::time::Duration;

/// The tenant label of requests that never authenticated.
pub const TENANT_UNKNOWN: &str = "none";

/// Requests that finished, by model, tenant and finish reason (`cancelled`:
/// the client went away first).
pub const REQUESTS_TOTAL: &str = "bulkhead_requests_total";
/// Requests whose client left before they were submitted to an engine (while
/// being read, tokenized or decided on by plugins), by tenant.
pub const REQUESTS_ABANDONED_TOTAL: &str = "bulkhead_requests_abandoned_total";
/// Requests refused with an error, by tenant and error code.
pub const REJECTIONS_TOTAL: &str = "bulkhead_rejections_total";
/// Prompt tokens of the requests an engine ended, by model and tenant (those
/// whose client left first too: the usage store's count).
pub const PROMPT_TOKENS_TOTAL: &str = "bulkhead_prompt_tokens_total";
/// Generated tokens of the requests an engine ended, by model and tenant.
pub const GENERATED_TOKENS_TOTAL: &str = "bulkhead_generated_tokens_total";
/// Seconds from arrival to the first generated text, by model and tenant.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "bulkhead_time_to_first_token_seconds";
/// Seconds between successive pieces of generated text, by model and tenant.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "bulkhead_inter_token_latency_seconds";
/// Requests waiting in a tenant's queue of a model.
pub const QUEUE_DEPTH: &str = "bulkhead_queue_depth";
/// Running sequences of a tenant in a model.
pub const RUNNING: &str = "bulkhead_running_sequences";
/// Requests that ever entered a tenant's queue of a model.
pub const ENQUEUED_TOTAL: &str = "bulkhead_enqueued_total";
/// KV pages of a tenant in a model's pool by state (owned, released, booked,
/// available, cached: its prefix cache, in use or idle).
pub const KV_PAGES: &str = "bulkhead_kv_pages";
/// KV pages ever acquired for a tenant in a model's pool.
pub const KV_PAGES_ACQUIRED_TOTAL: &str = "bulkhead_kv_pages_acquired_total";
/// Prompt tokens of a tenant's requests found in its prefix cache of a model.
pub const PREFIX_CACHED_TOKENS_TOTAL: &str = "bulkhead_prefix_cached_tokens_total";
/// A tenant's sequences preempted in a model to give loaned pages or slots back.
pub const PREEMPTED_TOTAL: &str = "bulkhead_preempted_total";
/// Time spent sampling a tenant's tokens in a model, in microseconds, summed
/// over the threads that sampled them: what its sampling options (JSON mode,
/// logprobs, biases) add to every tenant's steps.
pub const SAMPLING_MICROSECONDS_TOTAL: &str = "bulkhead_sampling_microseconds_total";
/// Steps a model's engine ran.
pub const ENGINE_STEPS_TOTAL: &str = "bulkhead_engine_steps_total";
/// Tokens those steps carried (prompt chunks and decoded tokens).
pub const ENGINE_STEP_TOKENS_TOTAL: &str = "bulkhead_engine_step_tokens_total";
/// Their time by phase (`forward`: the backend's pass; `sampling`: picking
/// every row's token, wall time), in microseconds.
pub const ENGINE_STEP_MICROSECONDS_TOTAL: &str = "bulkhead_engine_step_microseconds_total";
/// A model's KV pages by state (total, free).
pub const KV_POOL_PAGES: &str = "bulkhead_kv_pool_pages";
/// KV pages a model's pool scrubbed since it was loaded.
pub const KV_PAGES_SCRUBBED_TOTAL: &str = "bulkhead_kv_pages_scrubbed_total";

/// The gauges a Gateway API Inference Extension endpoint picker (llm-d's
/// router) scrapes from a vLLM server, under vLLM's own names and meanings,
/// one series per model (`model_name`, the model id), so the picker's
/// defaults work without an `engineConfigs` entry: requests waiting in any
/// tenant's queue of the model (preempted ones included)...
pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
/// ... sequences running in it ...
pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
/// ... the fraction (0 to 1, despite the name) of its pool's pages in use:
/// neither on the free list nor kept by a prefix cache alone (leased, held
/// by a sequence's table, awaiting their scrub) ...
pub const VLLM_KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// ... and its pool's shape, as labels of a gauge that is 1:
/// `block_size` (tokens a page holds) and `num_gpu_blocks` (pages).
pub const VLLM_CACHE_CONFIG: &str = "vllm:cache_config_info";

/// Connections a listener closed itself, by listener and reason
/// (`peer_limit`, `handshake_timeout`, `idle_timeout`).
pub const CONNECTIONS_CLOSED_TOTAL: &str = "bulkhead_connections_closed_total";

/// Panics of a model's engine (each ends its requests in flight), by model.
pub const ENGINE_FAULTS_TOTAL: &str = "bulkhead_engine_faults_total";
/// Restarts of a model's engine after a panic, by model.
pub const ENGINE_RESTARTS_TOTAL: &str = "bulkhead_engine_restarts_total";
/// Responses the canary guard blocked, by reading tenant and canary owner.
pub const CANARY_HITS_TOTAL: &str = "bulkhead_canary_hits_total";
/// Plugin calls, by outcome (`ok`, `fuel`, `deadline`, `memory`, `host_limit`,
/// `trap`, `abandoned`, `budget`, `unavailable`).
pub const PLUGIN_CALLS_TOTAL: &str = "bulkhead_plugin_calls_total";
/// Plugin calls abandoned past their deadline whose worker is still stuck.
pub const PLUGIN_WORKERS_STUCK: &str = "bulkhead_plugin_workers_stuck";
/// Ended requests whose `on-complete` calls were dropped because the tenant's
/// completion queue was full, by tenant.
pub const PLUGIN_COMPLETIONS_DROPPED_TOTAL: &str = "bulkhead_plugin_completions_dropped_total";
/// Plugins disabled after repeated faults.
pub const PLUGINS_DISABLED_TOTAL: &str = "bulkhead_plugins_disabled_total";

/// Histogram buckets for latencies, in seconds.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Crates whose logs are capped at `info` (see the module doc).
const DEPENDENCY_LOG_CAPS: &[&str] = &[
    "hyper=info",
    "hyper_util=info",
    "h2=info",
    "rustls=info",
    "tokio_rustls=info",
];

/// Installs the global Prometheus recorder (no listener of its own: the
/// admin listener renders it at `/metrics`).
pub fn install_metrics() -> Result<PrometheusHandle, BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS_SECONDS)?
        .install_recorder()
}

/// Log lines to stderr, as `format` says; `RUST_LOG` filters (default `info`).
/// How log lines look on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// One line a person reads: time, level, message, then `field=value`s.
    Text,
    /// One JSON object a line, for collectors.
    Json,
}

impl LogFormat {
    /// Text on a terminal, JSON otherwise (a pipe, a file, a collector).
    pub fn for_stderr() -> LogFormat {
        use std::io::IsTerminal;
        if std::io::stderr().is_terminal() {
            LogFormat::Text
        } else {
            LogFormat::Json
        }
    }
}

pub fn init_tracing(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    for cap in DEPENDENCY_LOG_CAPS {
        if let Ok(directive) = cap.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            // Colours only where a terminal shows them.
            builder
                .with_ansi(std::io::stderr().is_terminal())
                .try_init()
        }
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

/// Replaces the standard panic hook, which prints a panic's message, with one
/// that logs where it happened and nothing it says: a message can quote
/// whatever value failed a check (an `expect` on a parse, a `{:?}` of a
/// request's text), and a log never holds prompt or completion text. The
/// record is an error event in the current span, so a panic while serving a
/// request (its handler, or its job on the tokenization lane, which runs in
/// the request's span) carries that request's id. `RUST_BACKTRACE=1` adds the
/// backtrace (symbols and lines only).
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            tracing::error!(thread, location, %backtrace, "panicked (message withheld: it may quote request text)");
        } else {
            tracing::error!(
                thread,
                location,
                "panicked (message withheld: it may quote request text)"
            );
        }
    }));
}

/// Counts a panic of `model`'s engine.
pub fn count_engine_fault(model: &str, requests_ended: u32) {
    counter!(ENGINE_FAULTS_TOTAL, "model" => model.to_string()).increment(1);
    crate::live::recent().alarm(
        "engine_fault",
        model,
        format!("the engine panicked; {requests_ended} requests in flight ended"),
    );
}

/// Counts a restart of `model`'s engine after a panic.
pub fn count_engine_restart(model: &str) {
    counter!(ENGINE_RESTARTS_TOTAL, "model" => model.to_string()).increment(1);
}

/// Counts a response the canary guard blocked: `tenant` would have read a
/// canary of `owner`.
pub fn count_canary_hit(tenant: &str, owner: &str) {
    crate::live::recent().alarm(
        "canary",
        tenant,
        format!("a response to {tenant} carried a canary of {owner}; blocked"),
    );
    counter!(CANARY_HITS_TOTAL, "tenant" => tenant.to_string(), "owner" => owner.to_string())
        .increment(1);
}

/// Counts a refused request.
pub fn count_rejection(tenant: &str, code: &'static str) {
    counter!(REJECTIONS_TOTAL, "tenant" => tenant.to_string(), "reason" => code).increment(1);
}

/// Counts a connection the listener closed itself.
pub fn count_connection_closed(listener: &'static str, reason: &'static str) {
    counter!(CONNECTIONS_CLOSED_TOTAL, "listener" => listener, "reason" => reason).increment(1);
}

/// Counts a plugin call by outcome.
pub fn count_plugin_call(outcome: &'static str) {
    counter!(PLUGIN_CALLS_TOTAL, "outcome" => outcome).increment(1);
}

/// Sets how many abandoned plugin calls are still stuck.
pub fn set_plugin_workers_stuck(stuck: u32) {
    gauge!(PLUGIN_WORKERS_STUCK).set(f64::from(stuck));
}

/// Counts an ended request whose `on-complete` calls were dropped.
pub fn count_plugin_completion_dropped(tenant: &str) {
    counter!(PLUGIN_COMPLETIONS_DROPPED_TOTAL, "tenant" => tenant.to_string()).increment(1);
}

/// Counts a plugin disabled after repeated faults.
pub fn count_plugin_disabled() {
    counter!(PLUGINS_DISABLED_TOTAL).increment(1);
}

/// Counts a finished request, as its client heard of it (its tokens are
/// counted by the engine: [`count_tokens`]).
pub fn count_finished(model: &str, tenant: &str, reason: &'static str) {
    crate::live::recent().finished(model, crate::clock::now_ms());
    let (model, tenant) = (model.to_string(), tenant.to_string());
    counter!(REQUESTS_TOTAL, "model" => model, "tenant" => tenant, "reason" => reason).increment(1);
}

/// Counts a request whose client went away before its end (reason
/// `cancelled`; the engine counts its tokens when it ends it).
pub fn count_cancelled(model: &str, tenant: &str) {
    count_finished(model, tenant, "cancelled");
}

/// Counts the tokens of a request the engine ended, whatever the reason and
/// whether or not its client was still there to hear it: the tokens the
/// usage store counts for the same end.
pub fn count_tokens(model: &str, tenant: &str, prompt: u32, generated: u32) {
    crate::live::recent().tokens(model, crate::clock::now_ms(), prompt, generated);
    let (model, tenant) = (model.to_string(), tenant.to_string());
    counter!(PROMPT_TOKENS_TOTAL, "model" => model.clone(), "tenant" => tenant.clone())
        .increment(u64::from(prompt));
    counter!(GENERATED_TOKENS_TOTAL, "model" => model, "tenant" => tenant)
        .increment(u64::from(generated));
}

/// Counts a request whose client left before it reached an engine.
pub fn count_abandoned(tenant: &str) {
    counter!(REQUESTS_ABANDONED_TOTAL, "tenant" => tenant.to_string()).increment(1);
}

/// Records time to first token.
pub fn observe_first_token(model: &str, tenant: &str, elapsed: Duration) {
    crate::live::recent().first_token(model, crate::clock::now_ms(), elapsed);
    histogram!(TIME_TO_FIRST_TOKEN_SECONDS, "model" => model.to_string(), "tenant" => tenant.to_string())
        .record(elapsed.as_secs_f64());
}

/// Records the gap between two pieces of text.
pub fn observe_inter_token(model: &str, tenant: &str, gap: Duration) {
    histogram!(INTER_TOKEN_LATENCY_SECONDS, "model" => model.to_string(), "tenant" => tenant.to_string())
        .record(gap.as_secs_f64());
}

/// What the last scrape published gauges for.
struct Published {
    /// (model, tenant) pairs.
    pairs: Vec<(String, String)>,
    /// Each (model, tenant id)'s counts as last published: a counter moves
    /// by what they grew since, so a tenant deleted and created again under
    /// its name (a new id, counts from zero) adds to the name's counters.
    counts: BTreeMap<(String, u32), TenantCounts>,
    /// Models.
    models: Vec<String>,
    /// Each model's pool shape as `vllm:cache_config_info` labelled it.
    configs: Vec<(String, u32, u32)>,
}

/// What the last scrape published: a (model, tenant) pair or a model that is
/// gone has its gauges set to zero once, not left at their last values.
static PUBLISHED: std::sync::Mutex<Published> = std::sync::Mutex::new(Published {
    pairs: Vec::new(),
    counts: BTreeMap::new(),
    models: Vec::new(),
    configs: Vec::new(),
});

/// The per-tenant gauges of one model.
fn set_tenant_gauges(model: &str, tenant: &str, queued: u32, running: u32, pages: [u32; 5]) {
    let labels = |extra: Option<&'static str>| {
        let mut l = vec![
            metrics::Label::new("model", model.to_string()),
            metrics::Label::new("tenant", tenant.to_string()),
        ];
        if let Some(state) = extra {
            l.push(metrics::Label::new("state", state));
        }
        l
    };
    gauge!(QUEUE_DEPTH, labels(None)).set(f64::from(queued));
    gauge!(RUNNING, labels(None)).set(f64::from(running));
    for (state, count) in ["owned", "released", "booked", "available", "cached"]
        .into_iter()
        .zip(pages)
    {
        gauge!(KV_PAGES, labels(Some(state))).set(f64::from(count));
    }
}

/// The endpoint picker's gauges of `model` (see [`VLLM_WAITING`]) from its
/// snapshot, or zeroed for a model that is gone (its pool's shape is zeroed
/// by [`publish_engine_stats`], which knows the labels it had).
fn set_picker_gauges(model: &str, stats: Option<&SchedulerStats>) {
    let zero = SchedulerStats::default();
    let s = stats.unwrap_or(&zero);
    let waiting: u32 = s.tenants.iter().map(|t| t.queued).sum();
    let running: u32 = s.tenants.iter().map(|t| t.running).sum();
    // Idle prefix-cache pages are free to vLLM (its freed blocks keep
    // their hashes on the free queue until reused), and to a tenant that
    // needs pages (evicted on demand): counted in use, a pod with a warm
    // cache would read as full to the picker while idle.
    let in_use = s
        .pages_count
        .saturating_sub(s.pages_free + s.pages_cached_idle);
    let usage = if s.pages_count == 0 {
        0.0
    } else {
        f64::from(in_use) / f64::from(s.pages_count)
    };
    let name = || metrics::Label::new("model_name", model.to_string());
    gauge!(VLLM_WAITING, vec![name()]).set(f64::from(waiting));
    gauge!(VLLM_RUNNING, vec![name()]).set(f64::from(running));
    gauge!(VLLM_KV_USAGE, vec![name()]).set(usage);
    if let Some(stats) = stats {
        set_cache_config(model, stats.page_tokens, stats.pages_count, 1.0);
    }
}

fn set_cache_config(model: &str, page_tokens: u32, pages: u32, value: f64) {
    gauge!(
        VLLM_CACHE_CONFIG,
        vec![
            metrics::Label::new("model_name", model.to_string()),
            metrics::Label::new("block_size", page_tokens.to_string()),
            metrics::Label::new("num_gpu_blocks", pages.to_string()),
        ]
    )
    .set(value);
}

/// Sets the engine gauges from each model's snapshot; `name_of(id)` is tenant
/// `id`'s name (None for a tenant removed since the snapshot).
pub fn publish_engine_stats(
    models: &[(String, SchedulerStats)],
    name_of: impl Fn(u32) -> Option<String>,
) {
    let mut last = PUBLISHED.lock().unwrap_or_else(|p| p.into_inner());
    let mut pairs = Vec::new();
    let mut counts = BTreeMap::new();
    for (model, stats) in models {
        for t in &stats.tenants {
            let Some(name) = name_of(t.id) else {
                continue;
            };
            let key = (model.clone(), t.id);
            let was = last.counts.get(&key).copied().unwrap_or_default();
            counts.insert(key, t.counts);
            // An engine's counts only grow (a rebuilt or reloaded engine
            // goes on from its predecessor's); counts below the last are a
            // partition begun again (the tenant's access to the model taken
            // and given back since), counted from zero.
            let grew = |now: u64, then: u64| if now >= then { now - then } else { now };
            let (now, was) = (&t.counts, &was);
            let pages = [
                t.pages_owned,
                t.pages_released,
                t.pages_booked,
                t.pages_available,
                t.pages_shared,
            ];
            set_tenant_gauges(model, &name, t.queued, t.running, pages);
            counter!(ENQUEUED_TOTAL, "model" => model.clone(), "tenant" => name.clone())
                .increment(grew(now.enqueued_total, was.enqueued_total));
            counter!(KV_PAGES_ACQUIRED_TOTAL, "model" => model.clone(), "tenant" => name.clone())
                .increment(grew(now.pages_acquired_total, was.pages_acquired_total));
            counter!(PREFIX_CACHED_TOKENS_TOTAL, "model" => model.clone(), "tenant" => name.clone())
                .increment(grew(now.cached_tokens_total, was.cached_tokens_total));
            counter!(PREEMPTED_TOTAL, "model" => model.clone(), "tenant" => name.clone())
                .increment(grew(now.preempted_total, was.preempted_total));
            counter!(SAMPLING_MICROSECONDS_TOTAL, "model" => model.clone(), "tenant" => name.clone())
                .increment(grew(
                    now.sampling_nanos_total / 1_000,
                    was.sampling_nanos_total / 1_000,
                ));
            pairs.push((model.clone(), name));
        }
        set_picker_gauges(model, Some(stats));
        gauge!(KV_POOL_PAGES, "model" => model.clone(), "state" => "total")
            .set(f64::from(stats.pages_count));
        gauge!(KV_POOL_PAGES, "model" => model.clone(), "state" => "free")
            .set(f64::from(stats.pages_free));
        counter!(KV_PAGES_SCRUBBED_TOTAL, "model" => model.clone())
            .absolute(stats.pages_scrubbed_total);
        let steps = &stats.steps;
        counter!(ENGINE_STEPS_TOTAL, "model" => model.clone()).absolute(steps.steps_total);
        counter!(ENGINE_STEP_TOKENS_TOTAL, "model" => model.clone()).absolute(steps.tokens_total);
        for (phase, nanos) in [
            ("forward", steps.forward_nanos_total),
            ("sampling", steps.sampling_nanos_total),
        ] {
            counter!(ENGINE_STEP_MICROSECONDS_TOTAL, "model" => model.clone(), "phase" => phase)
                .absolute(nanos / 1_000);
        }
    }
    let ids: Vec<String> = models.iter().map(|(m, _)| m.clone()).collect();
    let configs: Vec<(String, u32, u32)> = models
        .iter()
        .map(|(m, s)| (m.clone(), s.page_tokens, s.pages_count))
        .collect();
    for (model, tenant) in last.pairs.iter().filter(|p| !pairs.contains(p)) {
        set_tenant_gauges(model, tenant, 0, 0, [0; 5]);
    }
    for gone in last.models.iter().filter(|m| !ids.contains(m)) {
        for state in ["total", "free"] {
            gauge!(KV_POOL_PAGES, "model" => gone.clone(), "state" => state).set(0.0);
        }
        set_picker_gauges(gone, None);
    }
    // A model gone, or loaded again with another pool: its old shape is
    // no longer what is served.
    for (model, page_tokens, pages) in last.configs.iter().filter(|c| !configs.contains(c)) {
        set_cache_config(model, *page_tokens, *pages, 0.0);
    }
    // A model gone keeps its tenants' counts (loaded again, its engine goes
    // on from them); a tenant gone from a model that is here is forgotten.
    let kept = std::mem::take(&mut last.counts)
        .into_iter()
        .filter(|((model, _), _)| !ids.contains(model));
    counts.extend(kept);
    *last = Published {
        pairs,
        counts,
        models: ids,
        configs,
    };
}
