//! `bulkhead bench http`: a load generator for any OpenAI-compatible server
//! (this one, or llama.cpp's `llama-server` for comparison). Figures go to
//! BENCHMARKS.md; they are measured, never asserted by tests.
//!
//! At each concurrency level C, C clients each send streaming
//! `POST /v1/completions` requests back to back (a ~100-token prompt, 64
//! tokens, temperature 0) until the level's request count is done; per
//! request it records the time to the first streamed text and to the end.
//! Reported: aggregate generated tokens per second (the usage chunk's
//! `completion_tokens`, or the streamed text chunks where a server sends no
//! usage, over wall time), time-to-first-token p50/p99, latency p50/p99, failures, and the
//! server's resident memory before and after the level when `--pid` is given.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::time::{Duration, Instant};

/// Most clients at one level.
pub const CONCURRENCY_MAX: usize = 1024;

/// Arguments of `bulkhead bench http`.
#[derive(clap::Args, Clone, Debug)]
pub struct HttpBenchArgs {
    /// Base URL of the server (plain http), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: String,
    /// API key (sent as a bearer token).
    #[arg(long, default_value = "")]
    pub key: String,
    /// Model id to request.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,32")]
    pub concurrency: Vec<usize>,
    /// Requests per level (at least the concurrency).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Repeats of the ~12-token sentence that makes the prompt (8 → ~100 tokens).
    #[arg(long, default_value_t = 8)]
    pub prompt_sentences: usize,
    /// Server process id, to report its resident memory.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Extra JSON fields merged into each request (e.g. '{"ignore_eos":true}').
    #[arg(long)]
    pub extra: Option<String>,
    /// Extra request headers, `NAME:VALUE` (repeatable; e.g. what a plugin reads).
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// Start every prompt with its request's number, so no two requests share a
    /// prefix (a server's prompt cache cannot skip their prefill).
    #[arg(long, conflicts_with = "shared_prefix")]
    pub distinct_prompts: bool,
    /// End every prompt with its request's number: all requests share the
    /// prompt's sentences as a prefix (a system prompt), and differ after it.
    #[arg(long)]
    pub shared_prefix: bool,
    /// The first request's number (prompts are numbered from it): runs
    /// against one server that must not share prompts start apart.
    #[arg(long, default_value_t = 0)]
    pub first_request: usize,
}

const SENTENCE: &str = "The quick brown fox jumps over the lazy dog near the river. ";

#[derive(Clone)]
struct Sample {
    /// When the first text arrived; `None` for a completion with no text
    /// (its first token ended it: a success, with nothing to time).
    ttft: Option<Duration>,
    latency: Duration,
    chunks: u64,
    /// From the usage chunk, when the server sends one.
    completion_tokens: Option<u64>,
    /// From the usage chunk, when the server sends one.
    prompt_tokens: Option<u64>,
    /// Prompt tokens the server took from its cache, when it says
    /// (`usage.prompt_tokens_details.cached_tokens`, or llama-server's
    /// `timings.cache_n`).
    cached_tokens: Option<u64>,
    /// When each chunk of text arrived (for rates within a window).
    text_at: Vec<Instant>,
}

/// Runs the load generator and prints one line per level.
pub fn run(args: &HttpBenchArgs) -> Result<()> {
    let authority = authority(&args.url)?;
    let mut body = request_body(&args.model, args.max_tokens, args.extra.as_deref())?;
    body["prompt"] = SENTENCE.repeat(args.prompt_sentences).into();
    let mut sent = args.first_request;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "bench http: {} model {}, {} prompt sentences{}, max_tokens {}, {} requests per level",
        args.url,
        args.model,
        args.prompt_sentences,
        if args.distinct_prompts {
            " (distinct)"
        } else if args.shared_prefix {
            " (shared prefix, distinct ends)"
        } else {
            ""
        },
        args.max_tokens,
        args.requests
    );
    for &concurrency in &args.concurrency {
        if concurrency == 0 || concurrency > CONCURRENCY_MAX {
            bail!("concurrency levels are 1..={CONCURRENCY_MAX}");
        }
        let rss_before = args.pid.and_then(rss_kib);
        let requests = args.requests.max(concurrency);
        let bodies = (sent..sent + requests)
            .map(|n| {
                let mut body = body.clone();
                if args.distinct_prompts {
                    body["prompt"] =
                        format!("Request {n}: {}", SENTENCE.repeat(args.prompt_sentences)).into();
                } else if args.shared_prefix {
                    body["prompt"] = format!(
                        "{}Request {n}: tell me what happened next.",
                        SENTENCE.repeat(args.prompt_sentences)
                    )
                    .into();
                }
                serde_json::to_vec(&body).map(Bytes::from)
            })
            .collect::<Result<Vec<Bytes>, _>>()?;
        sent += requests;
        let started = Instant::now();
        let headers: Vec<(String, String)> = args
            .headers
            .iter()
            .map(|h| {
                h.split_once(':')
                    .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
                    .context("--header is NAME:VALUE")
            })
            .collect::<Result<_>>()?;
        let results =
            runtime.block_on(level(&authority, &args.key, &headers, &bodies, concurrency));
        let wall = started.elapsed().as_secs_f64();
        report(
            concurrency,
            &results,
            wall,
            rss_before,
            args.pid.and_then(rss_kib),
        );
    }
    Ok(())
}

/// `host:port` of a plain-http `url`.
fn authority(url: &str) -> Result<String> {
    Ok(url
        .strip_prefix("http://")
        .context("--url must start with http://")?
        .trim_end_matches('/')
        .to_string())
}

/// A streamed completion request for `model` (its prompt set by the caller),
/// with `extra` (a JSON object) merged in.
fn request_body(model: &str, max_tokens: u32, extra: Option<&str>) -> Result<serde_json::Value> {
    let mut body = serde_json::json!({
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(extra) = extra {
        let extra: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(extra).context("--extra is not a JSON object")?;
        body.as_object_mut()
            .expect("built as an object")
            .extend(extra);
    }
    Ok(body)
}

async fn level(
    authority: &str,
    key: &str,
    headers: &[(String, String)],
    bodies: &[Bytes],
    concurrency: usize,
) -> Vec<Result<Sample>> {
    let mut clients = Vec::new();
    for client in 0..concurrency {
        // Client i sends requests i, i + C, i + 2C, ...
        let mine: Vec<Bytes> = bodies
            .iter()
            .skip(client)
            .step_by(concurrency)
            .cloned()
            .collect();
        let (authority, key) = (authority.to_string(), key.to_string());
        let headers = headers.to_vec();
        clients.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(mine.len());
            for body in mine {
                out.push(one_request(&authority, &key, &headers, body).await);
            }
            out
        }));
    }
    let mut results = Vec::new();
    for client in clients {
        match client.await {
            Ok(samples) => results.extend(samples),
            Err(e) => results.push(Err(anyhow::anyhow!("client task failed: {e}"))),
        }
    }
    results
}

async fn one_request(
    authority: &str,
    key: &str,
    headers: &[(String, String)],
    body: Bytes,
) -> Result<Sample> {
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(authority).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let mut request = hyper::Request::post("/v1/completions")
        .header("host", authority)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"));
    for (name, value) in headers {
        request = request.header(name.as_str(), value.as_str());
    }
    let request = request.body(Full::new(body))?;
    let mut response = sender.send_request(request).await?;
    if !response.status().is_success() {
        bail!("status {}", response.status());
    }
    let mut ttft = None;
    let mut chunks = 0u64;
    let mut completion_tokens = None;
    let mut prompt_tokens = None;
    let mut cached_tokens = None;
    let mut text_at = Vec::new();
    let mut finished = false;
    let mut pending = Vec::new();
    while let Some(frame) = response.body_mut().frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let Some(value) = event_json(&event) else {
                continue;
            };
            if value["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                chunks += 1;
                text_at.push(Instant::now());
                ttft.get_or_insert_with(|| started.elapsed());
            }
            finished |= value["choices"][0]["finish_reason"].is_string();
            completion_tokens = completion_tokens.or(value["usage"]["completion_tokens"].as_u64());
            prompt_tokens = prompt_tokens.or(value["usage"]["prompt_tokens"].as_u64());
            cached_tokens = cached_tokens
                .or(value["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64())
                .or(value["timings"]["cache_n"].as_u64());
        }
    }
    if ttft.is_none() && !finished {
        bail!("the stream ended with neither text nor a finish_reason");
    }
    Ok(Sample {
        ttft,
        latency: started.elapsed(),
        chunks,
        completion_tokens,
        prompt_tokens,
        cached_tokens,
        text_at,
    })
}

/// The JSON payload of one SSE event (`None` for `[DONE]` and non-JSON).
fn event_json(event: &[u8]) -> Option<serde_json::Value> {
    let json = std::str::from_utf8(event)
        .ok()?
        .trim()
        .strip_prefix("data: ")?;
    serde_json::from_str(json).ok()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64()
}

fn report(
    concurrency: usize,
    results: &[Result<Sample>],
    wall: f64,
    rss_before: Option<u64>,
    rss_after: Option<u64>,
) {
    let samples: Vec<&Sample> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    let mut ttft: Vec<Duration> = samples.iter().filter_map(|s| s.ttft).collect();
    let mut latency: Vec<Duration> = samples.iter().map(|s| s.latency).collect();
    ttft.sort();
    latency.sort();
    // A chunk is not always a token (a server may hold text back, as the
    // canary guard does): the usage count where there is one.
    let tokens: u64 = samples.iter().map(|s| s.tokens()).sum();
    let prompt = samples
        .iter()
        .find_map(|s| s.prompt_tokens)
        .map_or(String::new(), |p| format!(", prompt {p} tokens"));
    let per_request = tokens as f64 / samples.len().max(1) as f64;
    // Time to first token split by whether the server found the prompt (or
    // part of it) in its cache, when it says.
    let split = |hit: bool| {
        let mut t: Vec<Duration> = samples
            .iter()
            .filter(|s| s.cached_tokens.is_some_and(|c| (c > 0) == hit))
            .filter_map(|s| s.ttft)
            .collect();
        t.sort();
        (t.len(), percentile(&t, 0.5))
    };
    let cache = if samples.iter().any(|s| s.cached_tokens.is_some()) {
        let ((hits, hit_p50), (misses, miss_p50)) = (split(true), split(false));
        let cached: u64 = samples.iter().filter_map(|s| s.cached_tokens).sum();
        let prompt: u64 = samples.iter().filter_map(|s| s.prompt_tokens).sum();
        format!(
            ", cache: {hits} hits ttft p50 {hit_p50:.3}s, {misses} misses ttft p50 {miss_p50:.3}s, {:.0} % of prompt tokens cached",
            100.0 * cached as f64 / prompt.max(1) as f64
        )
    } else {
        String::new()
    };
    let rss = match (rss_before, rss_after) {
        (Some(a), Some(b)) => format!(", rss {} -> {} MiB", a / 1024, b / 1024),
        _ => String::new(),
    };
    println!(
        "concurrency {concurrency:>3}: {:>6.1} tok/s aggregate, ttft p50 {:.3}s p99 {:.3}s, latency p50 {:.3}s p99 {:.3}s, {} ok ({per_request:.1} tokens each{prompt}), {} failed{rss}{cache}",
        tokens as f64 / wall,
        percentile(&ttft, 0.5),
        percentile(&ttft, 0.99),
        percentile(&latency, 0.5),
        percentile(&latency, 0.99),
        samples.len(),
        failures.len(),
    );
    if let Some(first) = failures.first() {
        println!("  first failure: {first}");
    }
}

/// Resident memory of process `pid`, in KiB (Linux).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Arguments of `bulkhead bench noisy`.
#[derive(clap::Args, Clone, Debug)]
pub struct NoisyBenchArgs {
    /// Base URL of the server (plain http), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: String,
    /// Tenant alpha's API key (empty for a server without keys).
    #[arg(long, default_value = "")]
    pub alpha_key: String,
    /// Tenant beta's API key.
    #[arg(long, default_value = "")]
    pub beta_key: String,
    /// Model id to request.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Alpha's clients in the first two phases.
    #[arg(long, default_value_t = 1)]
    pub alpha_concurrency: usize,
    /// Beta's load in the flood phase, as a multiple of alpha's clients.
    #[arg(long, default_value_t = 8)]
    pub flood: usize,
    /// Each tenant's clients in the saturated phase.
    #[arg(long, default_value_t = 8)]
    pub saturate: usize,
    /// Alpha's and beta's scheduling weights (for their weighted shares).
    #[arg(long, value_delimiter = ':', default_value = "1:1")]
    pub weights: Vec<u32>,
    /// Length of each phase, in seconds (clients start no request after it).
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// The first seconds of each phase are load only: requests sent in them
    /// are not counted (every client starting at once is no steady state).
    #[arg(long, default_value_t = 4)]
    pub warmup: u64,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Repeats of the ~12-token sentence that makes the prompt.
    #[arg(long, default_value_t = 8)]
    pub prompt_sentences: usize,
    /// Extra JSON fields merged into each request (e.g. '{"cache_prompt":false}').
    #[arg(long)]
    pub extra: Option<String>,
}

/// One tenant's clients in a phase: its key, how many, and its prompts' tag.
struct Group<'a> {
    name: &'static str,
    key: &'a str,
    concurrency: usize,
}

/// `bulkhead bench noisy`: the noisy-neighbour benchmark. Three phases of
/// `--seconds` each on distinct prompts (no cache can help), counting the
/// requests that ended within the phase: alpha alone;
/// alpha at the same load while beta floods at `--flood` times it; both
/// saturated with `--saturate` clients each. Prints each tenant's rate and
/// times to first token per phase, alpha's p99 under the flood over alone,
/// and each tenant's share of the saturated phase's tokens against its
/// weighted share.
pub fn noisy(args: &NoisyBenchArgs) -> Result<()> {
    let authority = authority(&args.url)?;
    let [alpha_weight, beta_weight] = args.weights[..] else {
        bail!("--weights is ALPHA:BETA");
    };
    let body = request_body(&args.model, args.max_tokens, args.extra.as_deref())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let alpha = |concurrency| Group {
        name: "alpha",
        key: &args.alpha_key,
        concurrency,
    };
    let beta = |concurrency| Group {
        name: "beta",
        key: &args.beta_key,
        concurrency,
    };
    let phase = |title: &str, groups: Vec<Group>| -> Vec<(f64, Vec<Sample>)> {
        println!("{title}");
        let counted_from = Instant::now() + Duration::from_secs(args.warmup);
        let deadline = Instant::now() + Duration::from_secs(args.seconds);
        let outcomes = runtime.block_on(async {
            let mut tasks = Vec::new();
            for group in &groups {
                for client in 0..group.concurrency {
                    let (authority, key) = (authority.clone(), group.key.to_string());
                    let (mut body, name) = (body.clone(), group.name);
                    let sentences = args.prompt_sentences;
                    tasks.push(tokio::spawn(async move {
                        let mut out = Vec::new();
                        let mut n = 0;
                        while Instant::now() < deadline {
                            body["prompt"] = format!(
                                "Tenant {name}, client {client}, request {n}: {}",
                                SENTENCE.repeat(sentences)
                            )
                            .into();
                            let bytes = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
                            let sent = Instant::now();
                            let result = one_request(&authority, &key, &[], bytes).await;
                            if result.is_err() {
                                // A refusal or a dead server: no busy loop.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            out.push((result, sent, Instant::now()));
                            n += 1;
                        }
                        out
                    }));
                }
            }
            let mut all = Vec::new();
            for task in tasks {
                all.push(task.await.unwrap_or_default());
            }
            all
        });
        let mut at = 0;
        let mut rows = Vec::new();
        for group in &groups {
            let clients = &outcomes[at..at + group.concurrency];
            at += group.concurrency;
            // Latencies: requests sent after the warm-up. Rates: text that
            // arrived between the warm-up and the phase's end (a chunk is a
            // token, as both servers stream), whatever request it belongs to;
            // the tail after it runs on an engine the other group may have
            // left.
            let results: Vec<&(Result<Sample>, Instant, Instant)> = clients
                .iter()
                .flatten()
                .filter(|(_, sent, _)| *sent >= counted_from)
                .collect();
            let window = counted_from..deadline;
            let tokens = clients
                .iter()
                .flatten()
                .filter_map(|(r, _, _)| r.as_ref().ok())
                .flat_map(|s| &s.text_at)
                .filter(|at| window.contains(at))
                .count();
            let wall = args.seconds.saturating_sub(args.warmup).max(1) as f64;
            print!("  {:<5} {:>3} clients: ", group.name, group.concurrency);
            let samples: Vec<Sample> = results
                .iter()
                .filter_map(|(r, _, _)| r.as_ref().ok().cloned())
                .collect();
            let failed = results.len() - samples.len();
            let mut ttft: Vec<Duration> = samples.iter().filter_map(|s| s.ttft).collect();
            ttft.sort();
            println!(
                "{:>6.1} tok/s, ttft p50 {:.3}s p99 {:.3}s, {} ok, {} failed",
                tokens as f64 / wall,
                percentile(&ttft, 0.5),
                percentile(&ttft, 0.99),
                samples.len(),
                failed
            );
            rows.push((tokens as f64 / wall, samples));
        }
        rows
    };
    let p99 = |samples: &[Sample]| {
        let mut ttft: Vec<Duration> = samples.iter().filter_map(|s| s.ttft).collect();
        ttft.sort();
        percentile(&ttft, 0.99)
    };
    let a = args.alpha_concurrency.max(1);
    let alone = phase("alpha alone", vec![alpha(a)]);
    let flood = phase(
        &format!("alpha while beta floods at {}x", args.flood),
        vec![alpha(a), beta(a * args.flood)],
    );
    let saturated = phase(
        "both saturated",
        vec![alpha(args.saturate), beta(args.saturate)],
    );
    let (alone_p99, flood_p99) = (p99(&alone[0].1), p99(&flood[0].1));
    println!(
        "alpha ttft p99: alone {alone_p99:.3}s, under the flood {flood_p99:.3}s ({:.2}x)",
        flood_p99 / alone_p99
    );
    let total = saturated[0].0 + saturated[1].0;
    let weights = f64::from(alpha_weight + beta_weight);
    for (i, (name, weight)) in [("alpha", alpha_weight), ("beta", beta_weight)]
        .into_iter()
        .enumerate()
    {
        println!(
            "{name} share while saturated: {:.1} % of {total:.1} tok/s (weighted share {:.1} %)",
            100.0 * saturated[i].0 / total,
            100.0 * f64::from(weight) / weights
        );
    }
    Ok(())
}

impl Sample {
    /// Generated tokens: the usage count where the server sent one.
    fn tokens(&self) -> u64 {
        self.completion_tokens.unwrap_or(self.chunks)
    }
}
