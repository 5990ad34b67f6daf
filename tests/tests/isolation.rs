//! The isolation suite (DESIGN.md §1, issue 11): the real binary, the real
//! model, three or more tenants, every prompt carrying unique canaries (one
//! in the system prompt, one in the user's text). Every failure path the
//! server has is driven through the HTTP surface while another tenant is
//! served, and for every response on every path:
//!
//! - no other tenant's canary appears in it (a *leak*);
//! - it is the documented answer for that path, never a 200 for a failed one
//!   (a stream has said 200 before it fails: its last event is the error; the
//!   interrupted paths send a whole request beside each stream for that);
//! - afterwards the model's pool is back at baseline — nothing owned, booked
//!   or dirty, every free page's bytes zero, the page book's invariants hold —
//!   as `GET /admin/v1/models/{model}/pool` reports it (an operator route, not
//!   a test hook).
//!
//! At the end no canary (anyone's) may appear in the server's log lines, its
//! metrics or its audit log.
//!
//! The engine-fault path needs the `fault-injection` build of the binary
//! (`scripts/test.sh` builds it; release builds have no way to make the engine
//! panic); without it that path reports "skipped".
//!
//! `BULKHEAD_ISOLATION_SCALE=N` multiplies every path's trials (default 1, what
//! CI runs); `scripts/isolation_report.sh` runs a long one and prints the table
//! the README's security section quotes.

mod support;
#[path = "support/transfer_proxy.rs"]
mod transfer_proxy;

use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::*;
use transfer_proxy::{Fault, TransferProxy};

/// Canaries are this many lowercase hex digits.
const CANARY_LEN: usize = 12;
/// How long a trial may take to bring its pool back to baseline.
const BASELINE_TIMEOUT: Duration = Duration::from_secs(30);
/// The suite's context (the test policy's `context_tokens`).
const CONTEXT_TOKENS: u64 = 1024;

/// One path's line of the report.
#[derive(Default, Clone)]
struct Row {
    trials: u32,
    responses: u64,
    leaks: u64,
    /// Responses that echoed their own tenant's canary: the detector sees
    /// what the model repeats (a leak would look the same).
    echoes: u64,
    baseline_ok: u32,
    /// Wall time of its trials (a server's start counts to the first).
    seconds: f64,
}

#[derive(Default)]
struct Book {
    /// Canary → the tenant it was issued to.
    canaries: HashMap<String, String>,
    rows: Vec<(&'static str, Row)>,
    /// Everything that went wrong, in order: leaks, undocumented answers,
    /// pools not at baseline.
    failures: Vec<String>,
    skipped: Vec<String>,
    /// Log lines, metric pages and audit events scanned for canaries.
    records: u64,
    /// The end of the latest trial.
    mark: Option<Instant>,
}

/// The suite's shared state: issued canaries, the report, the failures.
struct Suite {
    model: std::path::PathBuf,
    scale: u32,
    book: Mutex<Book>,
    next: AtomicU64,
    seed: u64,
    agent: ureq::Agent,
}

/// What a response turned out to be.
#[derive(Debug, Default)]
struct Answer {
    status: u16,
    /// `error.code` of an error body or a stream's error event.
    code: Option<String>,
    /// The stream's or body's `finish_reason`.
    finish: Option<String>,
    /// The generated text (a stream's pieces joined).
    text: String,
    usage: Value,
    /// Stream events read.
    events: u32,
}

impl Suite {
    fn new(model: std::path::PathBuf) -> Suite {
        let scale = std::env::var("BULKHEAD_ISOLATION_SCALE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1u32)
            .max(1);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            ^ u64::from(std::process::id()) << 32;
        Suite {
            model,
            scale,
            book: Mutex::new(Book::default()),
            next: AtomicU64::new(0),
            seed,
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(300))
                .build(),
        }
    }

    /// A fresh canary issued to `tenant`.
    fn canary(&self, tenant: &str) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // SplitMix64 of seed + n: unique per suite, different per run.
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let canary = format!("{:012x}", z & 0xffff_ffff_ffff);
        self.book
            .lock()
            .unwrap()
            .canaries
            .insert(canary.clone(), tenant.to_string());
        canary
    }

    /// The issued canaries in `text`, with their tenants.
    fn found(&self, text: &str) -> Vec<(String, String)> {
        let book = self.book.lock().unwrap();
        let bytes = text.as_bytes();
        let mut hits = Vec::new();
        let mut start = 0;
        while start < bytes.len() {
            if !is_hex(bytes[start]) {
                start += 1;
                continue;
            }
            let end = (start..bytes.len())
                .find(|&i| !is_hex(bytes[i]))
                .unwrap_or(bytes.len());
            if end - start >= CANARY_LEN {
                for at in start..=end - CANARY_LEN {
                    let window = &text[at..at + CANARY_LEN];
                    if let Some(owner) = book.canaries.get(window) {
                        hits.push((window.to_string(), owner.clone()));
                    }
                }
            }
            start = end;
        }
        hits
    }

    /// Counts one response of `tenant` on `path`: a leak for every other
    /// tenant's canary in `text`.
    fn check(&self, path: &'static str, tenant: &str, text: &str) {
        let hits = self.found(text);
        let mut book = self.book.lock().unwrap();
        let row = book.row(path);
        row.responses += 1;
        let mut leaks = Vec::new();
        for (canary, owner) in hits {
            if owner == tenant {
                row.echoes += 1;
            } else {
                row.leaks += 1;
                leaks.push(format!(
                    "{path}: a response to {tenant} holds {owner}'s canary {canary}"
                ));
            }
        }
        book.failures.extend(leaks);
    }

    fn fail(&self, message: String) {
        eprintln!("FAILURE: {message}");
        self.book.lock().unwrap().failures.push(message);
    }

    /// Checks `answer` (tenant's, on `path`) for leaks and that it is `expected`:
    /// a status and, for errors, the code (for a stream: 200 and the code of
    /// its error event).
    fn expect(
        &self,
        path: &'static str,
        tenant: &str,
        answer: &Answer,
        expected: (u16, Option<&str>),
    ) {
        self.check(path, tenant, &answer.text);
        let got = (answer.status, answer.code.as_deref());
        if got != expected {
            self.fail(format!(
                "{path}: {tenant} got {got:?}, documented {expected:?} (finish {:?})",
                answer.finish
            ));
        }
        if answer.status == 200 && answer.code.is_none() {
            match answer.finish.as_deref() {
                Some("stop" | "length" | "tool_calls") => {}
                other => self.fail(format!("{path}: {tenant} 200 without a finish: {other:?}")),
            }
        }
    }

    /// Whether the path `name` runs: `BULKHEAD_ISOLATION_ONLY=a,b` runs only
    /// the paths whose names contain `a` or `b` (to rerun one that failed).
    fn runs(&self, name: &str) -> bool {
        match std::env::var("BULKHEAD_ISOLATION_ONLY") {
            Ok(only) => only.split(',').any(|part| name.contains(part.trim())),
            Err(_) => true,
        }
    }

    /// A path's trials: `base` at scale 1 (CI), `per_scale` more for each
    /// step of scale (the long run weights cheap paths up, slow ones down).
    fn trials(&self, base: u32, per_scale: f64) -> u32 {
        base + (f64::from(self.scale - 1) * per_scale).round() as u32
    }

    fn trial_done(&self, path: &'static str, at_baseline: bool) {
        let mut book = self.book.lock().unwrap();
        let now = Instant::now();
        let since = book.mark.replace(now).unwrap_or(now);
        let row = book.row(path);
        row.trials += 1;
        row.baseline_ok += u32::from(at_baseline);
        row.seconds += (now - since).as_secs_f64();
    }

    fn skip(&self, path: &'static str, why: &str) {
        eprintln!("skipped: {path}: {why}");
        let mut book = self.book.lock().unwrap();
        book.row(path);
        book.skipped.push(format!("{path}: {why}"));
    }

    /// A request: `stream` reads the SSE body to its end, or stops after
    /// `events_max` events (dropping the connection: a cancel).
    fn send(
        &self,
        server: &Server,
        key: &str,
        headers: &[(&str, &str)],
        path: &str,
        body: &Value,
        events_max: Option<u32>,
    ) -> Answer {
        let mut request = self
            .agent
            .post(&format!("{}{path}", server.inference))
            .set("authorization", &format!("Bearer {key}"))
            .set("content-type", "application/json");
        for (name, value) in headers {
            request = request.set(name, value);
        }
        let response = match request.send_string(&body.to_string()) {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("transport error: {e}"),
        };
        let mut answer = Answer {
            status: response.status(),
            ..Answer::default()
        };
        if events_max == Some(0) {
            // Only the headers: the connection goes now.
            return answer;
        }
        let streamed = response
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream"));
        if !streamed {
            let text = response.into_string().unwrap_or_default();
            let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            answer.code = value["error"]["code"].as_str().map(str::to_string);
            let choice = &value["choices"][0];
            answer.finish = choice["finish_reason"].as_str().map(str::to_string);
            answer.usage = value["usage"].clone();
            // The whole body: an error message must not carry a canary either.
            answer.text = text;
            return answer;
        }
        let mut sse = sse_reader(response);
        while let Some(data) = sse.next_data() {
            answer.events += 1;
            if data == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
            if let Some(code) = chunk["error"]["code"].as_str() {
                answer.code = Some(code.to_string());
                // The error event's own text is checked too.
                answer.text.push('\n');
                answer.text.push_str(&data);
            }
            let choice = &chunk["choices"][0];
            let piece = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .unwrap_or("");
            answer.text.push_str(piece);
            // Log probabilities' tokens and alternatives (an echoed prompt's
            // come first), as they come.
            let logprobs = &choice["logprobs"];
            for token in logprobs["tokens"].as_array().into_iter().flatten() {
                answer.text.push_str(token.as_str().unwrap_or(""));
            }
            for top in logprobs["top_logprobs"].as_array().into_iter().flatten() {
                for alternative in top.as_object().into_iter().flat_map(|o| o.keys()) {
                    answer.text.push('\n');
                    answer.text.push_str(alternative);
                }
            }
            // A tool call's name and arguments, as they come.
            for call in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                for field in ["name", "arguments"] {
                    answer
                        .text
                        .push_str(call["function"][field].as_str().unwrap_or(""));
                }
            }
            if let Some(finish) = choice["finish_reason"].as_str() {
                answer.finish = Some(finish.to_string());
            }
            if !chunk["usage"].is_null() {
                answer.usage = chunk["usage"].clone();
            }
            if events_max.is_some_and(|max| answer.events >= max) {
                break;
            }
        }
        answer
    }

    /// Polls the pool route until `model`'s pool is at baseline; false (and a
    /// failure naming the last report) if it is not within the timeout.
    fn baseline(&self, path: &'static str, server: &Server, model: &str) -> bool {
        let mut last = Value::Null;
        let ok = eventually(BASELINE_TIMEOUT, || {
            let r = server.admin_call("GET", &format!("/admin/v1/models/{model}/pool"), None);
            if r.status != 200 {
                last = json!({"status": r.status, "body": r.body});
                return false;
            }
            last = r.json();
            last["at_baseline"] == true
        });
        if !ok {
            self.fail(format!("{path}: {model}'s pool not at baseline: {last}"));
        }
        ok
    }

    /// After a server's paths: no canary of anyone in its log, metrics or
    /// audit log.
    fn scan_records(&self, server: &Server) {
        let mut records = server.stderr_lines();
        records.extend(server.stdout_lines());
        records.push(server.metrics());
        let mut after = 0u64;
        loop {
            let page = server
                .admin_call(
                    "GET",
                    &format!("/admin/v1/audit?after={after}&limit=1000"),
                    None,
                )
                .json();
            let events = page["data"].as_array().cloned().unwrap_or_default();
            records.extend(events.iter().map(Value::to_string));
            match page["next_after"].as_u64() {
                Some(next) if !events.is_empty() && next > after => after = next,
                _ => break,
            }
        }
        for record in &records {
            for (canary, owner) in self.found(record) {
                self.fail(format!(
                    "{owner}'s canary {canary} is in a server record: {record}"
                ));
            }
        }
        self.book.lock().unwrap().records += records.len() as u64;
    }

    /// The report: one line per path.
    fn table(&self) -> String {
        let book = self.book.lock().unwrap();
        let mut out = String::from(
            "| path | trials | responses checked | leaks | own canary echoed | pools at baseline | seconds |\n\
             |---|---|---|---|---|---|---|\n",
        );
        let mut total = Row::default();
        for (path, row) in &book.rows {
            out.push_str(&format!(
                "| {path} | {} | {} | {} | {} | {}/{} | {:.0} |\n",
                row.trials,
                row.responses,
                row.leaks,
                row.echoes,
                row.baseline_ok,
                row.trials,
                row.seconds
            ));
            total.seconds += row.seconds;
            total.trials += row.trials;
            total.responses += row.responses;
            total.leaks += row.leaks;
            total.echoes += row.echoes;
            total.baseline_ok += row.baseline_ok;
        }
        out.push_str(&format!(
            "| **all paths** | {} | {} | {} | {} | {}/{} | {:.0} |\n",
            total.trials,
            total.responses,
            total.leaks,
            total.echoes,
            total.baseline_ok,
            total.trials,
            total.seconds
        ));
        out.push_str(&format!(
            "\nLog lines, metric pages and audit events scanned for canaries: {}; \
             canaries found there: {}.\n",
            book.records,
            book.failures
                .iter()
                .filter(|f| f.contains("server record"))
                .count()
        ));
        for skipped in &book.skipped {
            out.push_str(&format!("Skipped: {skipped}\n"));
        }
        out
    }
}

impl Book {
    fn row(&mut self, path: &'static str) -> &mut Row {
        let at = match self.rows.iter().position(|(p, _)| *p == path) {
            Some(at) => at,
            None => {
                self.rows.push((path, Row::default()));
                self.rows.len() - 1
            }
        };
        &mut self.rows[at].1
    }
}

fn is_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

fn sse_reader(response: ureq::Response) -> SseReader {
    SseReader::new(response.into_reader())
}

/// The tenants of the test policy and their keys.
const TENANTS: [(&str, &str); 3] = [
    ("alpha", KEY_ALPHA),
    ("beta", KEY_BETA),
    ("gamma", KEY_GAMMA),
];

fn key_of(tenant: &str) -> &'static str {
    TENANTS.iter().find(|(t, _)| *t == tenant).unwrap().1
}

/// A chat request carrying two fresh canaries of `tenant`: the account code
/// in the system prompt, the ticket in the user's text.
fn chat(suite: &Suite, tenant: &str, model: &str, max_tokens: u32, pad: usize) -> Value {
    let (account, ticket) = (suite.canary(tenant), suite.canary(tenant));
    chat_with(model, max_tokens, "", &account, &ticket, pad)
}

/// A chat request: `preamble` and the `account` canary in the system prompt,
/// the `ticket` canary and `pad` words (one token each) in the user's text.
fn chat_with(
    model: &str,
    max_tokens: u32,
    preamble: &str,
    account: &str,
    ticket: &str,
    pad: usize,
) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": format!("{preamble}You serve account {account}. The account code is {account}.")},
            {"role": "user", "content": format!("My ticket is {ticket}. Repeat my ticket and the account code.{}", " hello".repeat(pad))},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// A completion that goes on counting (it runs to `max_tokens`): `numbers`
/// numbers after two canaries; about six tokens a number.
fn counting(suite: &Suite, tenant: &str, model: &str, numbers: u32, max_tokens: u32) -> Value {
    let (account, ticket) = (suite.canary(tenant), suite.canary(tenant));
    let list: Vec<String> = (1000..1000 + numbers).map(|n| n.to_string()).collect();
    json!({
        "model": model,
        "prompt": format!("Account {account}, ticket {ticket}. Count with me: {},", list.join(", ")),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    })
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const OK: (u16, Option<&str>) = (200, None);

/// A completion that invites the model to repeat `tenant`'s two canaries (it
/// mostly does): a copying model is what would show stale KV of another
/// tenant, and the echoes show the detector sees what the model copies.
fn echo(suite: &Suite, tenant: &str, model: &str, max_tokens: u32) -> Value {
    let (account, ticket) = (suite.canary(tenant), suite.canary(tenant));
    let line = format!("Account {account}, ticket {ticket}.");
    json!({
        "model": model,
        "prompt": format!("{line}\n{line}\n{line}\nAccount"),
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// A short request by `tenant` that must succeed, checked under `path`: a
/// streamed chat, or a completion that echoes.
fn served(suite: &Suite, server: &Server, path: &'static str, tenant: &str, stream: bool) {
    let answer = if stream {
        let mut body = chat(suite, tenant, MODEL_ID, 16, 0);
        body["stream"] = json!(true);
        suite.send(server, key_of(tenant), &[], CHAT, &body, None)
    } else {
        let body = echo(suite, tenant, MODEL_ID, 16);
        suite.send(server, key_of(tenant), &[], COMPLETIONS, &body, None)
    };
    suite.expect(path, tenant, &answer, OK);
}

// ---------------------------------------------------------------- the paths

fn success(suite: &Suite, server: &Server) {
    const PATH: &str = "success";
    for trial in 0..suite.trials(4, 1.0) {
        std::thread::scope(|s| {
            for (i, (tenant, _)) in TENANTS.iter().enumerate() {
                // Gamma runs one at a time: one request; the others eight.
                let n = if *tenant == "gamma" { 1 } else { 8 };
                for j in 0..n {
                    let stream = (trial + i as u32 + j).is_multiple_of(2);
                    s.spawn(move || served(suite, server, PATH, tenant, stream));
                }
            }
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn prefix_cache(suite: &Suite, server: &Server) {
    const PATH: &str = "prefix-cache hits";
    for trial in 0..suite.trials(2, 1.0) {
        // The same long preamble for every tenant: a cache shared across
        // tenants would give beta's first request cached tokens.
        let preamble = format!(
            "Session {trial}-{}. You are a careful assistant for a bank. Answer briefly, \
             politely and in plain English. Never guess; say when you do not know. ",
            suite.canary("nobody")
        );
        let accounts: Vec<String> = ["alpha", "beta"].iter().map(|t| suite.canary(t)).collect();
        for round in 0..2 {
            for (i, tenant) in ["alpha", "beta"].into_iter().enumerate() {
                let ticket = suite.canary(tenant);
                let body = chat_with(MODEL_ID, 8, &preamble, &accounts[i], &ticket, 0);
                let answer = suite.send(server, key_of(tenant), &[], CHAT, &body, None);
                suite.expect(PATH, tenant, &answer, OK);
                let cached = answer.usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                if round == 0 && cached > 0 {
                    suite.fail(format!("{PATH}: {tenant}'s first request had {cached} cached tokens: another tenant's cache"));
                }
                if round == 1 && cached == 0 {
                    suite.fail(format!("{PATH}: {tenant}'s second request hit no cache"));
                }
            }
        }
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn oversized(suite: &Suite, server: &Server) {
    const PATH: &str = "oversized (limit-1, limit, limit+1, far)";
    const MAX_TOKENS: u32 = 8;
    let limit = CONTEXT_TOKENS - u64::from(MAX_TOKENS);
    for trial in 0..suite.trials(1, 0.25) {
        let tenant = ["alpha", "beta"][trial as usize % 2];
        let key = key_of(tenant);
        // Canaries tokenize variably: this trial's requests share one pair,
        // so the padding that reaches a length is measured, not guessed.
        let (account, ticket) = (suite.canary(tenant), suite.canary(tenant));
        let measure = |pad: usize| {
            let body = chat_with(MODEL_ID, 1, "", &account, &ticket, pad);
            let answer = suite.send(server, key, &[], CHAT, &body, None);
            suite.expect(PATH, tenant, &answer, OK);
            answer.usage["prompt_tokens"].as_u64().unwrap_or(0)
        };
        let bare = measure(0);
        assert_eq!(measure(10), bare + 10, "each padding word is one token");
        for (delta, expected) in [
            (-1i64, OK),
            (0, OK),
            (1, (400, Some("context_length_exceeded"))),
            // About 5× the context, within the body limit (else 413).
            (3_000, (400, Some("context_length_exceeded"))),
        ] {
            let target = limit as i64 + delta;
            let pad = (target - bare as i64) as usize;
            let body = chat_with(MODEL_ID, MAX_TOKENS, "", &account, &ticket, pad);
            let answer = suite.send(server, key, &[], CHAT, &body, None);
            let prompt = answer.usage["prompt_tokens"].as_u64();
            if answer.status == 200 && prompt != Some(target as u64) {
                suite.fail(format!(
                    "{PATH}: aimed at {target} prompt tokens, usage says {prompt:?}"
                ));
            }
            suite.expect(PATH, tenant, &answer, expected);
        }
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// The incident's path: prompts that cannot fit, refused while another
/// tenant decodes. A refusal touches no page and says nothing of anyone
/// else's; the decoding stream is untouched.
fn oversized_refused(suite: &Suite, server: &Server) {
    const PATH: &str = "oversized, refused while another decodes";
    for trial in 0..suite.trials(2, 12.0) {
        let (decoding, refused) = [("alpha", "beta"), ("beta", "alpha")][trial as usize % 2];
        std::thread::scope(|s| {
            s.spawn(|| {
                let body = counting(suite, decoding, MODEL_ID, 20, 60);
                let answer = stream(suite, server, key_of(decoding), &body, At::Text, || {});
                suite.expect(PATH, decoding, &answer, OK);
            });
            for round in 0..30 {
                let body = match round % 3 {
                    // Longer than the context by itself.
                    0 => chat(suite, refused, MODEL_ID, 8, 1100),
                    // Far beyond (refused by its byte count alone).
                    1 => chat(suite, refused, MODEL_ID, 8, 3500),
                    // A short prompt that asks for more than the context.
                    _ => chat(suite, refused, MODEL_ID, 100_000, 0),
                };
                let answer = suite.send(server, key_of(refused), &[], CHAT, &body, None);
                suite.expect(
                    PATH,
                    refused,
                    &answer,
                    (400, Some("context_length_exceeded")),
                );
            }
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn cancel_prefill(suite: &Suite, server: &Server) {
    // ~800 prompt tokens: seconds of prefill; the connection goes as soon as
    // the stream's headers arrive.
    let leave = Leave {
        leaver: "alpha",
        numbers: 130,
        max_tokens: 60,
        events: 0,
    };
    for _ in 0..suite.trials(2, 0.5) {
        cancel(suite, server, "cancel during prefill", &leave, "beta");
    }
}

fn cancel_decode(suite: &Suite, server: &Server) {
    // A short prompt and a long answer: generating when it goes.
    let leave = Leave {
        leaver: "beta",
        numbers: 20,
        max_tokens: 400,
        events: 4,
    };
    for _ in 0..suite.trials(2, 1.0) {
        cancel(suite, server, "cancel during decode", &leave, "alpha");
    }
}

/// A client that leaves: after `events` stream events of a counting prompt.
struct Leave {
    leaver: &'static str,
    numbers: u32,
    max_tokens: u32,
    events: u32,
}

/// One trial of a client leaving mid-request while `stayer` is served: the
/// server sees it go (counted as `cancelled`) and the pool comes back.
fn cancel(suite: &Suite, server: &Server, path: &'static str, leave: &Leave, stayer: &str) {
    let cancelled = format!(
        r#"bulkhead_requests_total{{model="{MODEL_ID}",tenant="{}",reason="cancelled"}}"#,
        leave.leaver
    );
    let before = server.metric(&cancelled);
    std::thread::scope(|s| {
        s.spawn(|| served(suite, server, path, stayer, leave.events == 0));
        let body = counting(
            suite,
            leave.leaver,
            MODEL_ID,
            leave.numbers,
            leave.max_tokens,
        );
        let key = key_of(leave.leaver);
        let answer = suite.send(server, key, &[], COMPLETIONS, &body, Some(leave.events));
        let gone = Instant::now();
        suite.check(path, leave.leaver, &answer.text);
        let generating = leave.events == 0 || !answer.text.is_empty();
        if answer.status != 200 || answer.code.is_some() || !generating {
            suite.fail(format!("{path}: the stream did not run: {answer:?}"));
        }
        if !eventually(Duration::from_secs(20), || {
            server.metric(&cancelled) > before
        }) {
            suite.fail(format!(
                "{path}: the server never saw {} leave",
                leave.leaver
            ));
        }
        eprintln!(
            "{path}: the cancel was counted {:?} after the client left",
            gone.elapsed()
        );
    });
    suite.trial_done(path, suite.baseline(path, server, MODEL_ID));
}

fn queue_full(suite: &Suite, server: &Server) {
    const PATH: &str = "queue full";
    for _ in 0..suite.trials(2, 0.25) {
        // Gamma: one running, one queued; the third is refused while another
        // tenant is served.
        std::thread::scope(|s| {
            let (signal, heard) = std::sync::mpsc::channel::<()>();
            for at in [At::Text, At::Headers] {
                let signal = signal.clone();
                s.spawn(move || {
                    let body = counting(suite, "gamma", MODEL_ID, 20, 120);
                    let answer = stream(suite, server, KEY_GAMMA, &body, at, || {
                        let _ = signal.send(());
                    });
                    suite.expect(PATH, "gamma", &answer, OK);
                });
                // The first generates before the second is sent: queued.
                let _ = heard.recv_timeout(Duration::from_secs(60));
            }
            let body = chat(suite, "gamma", MODEL_ID, 4, 0);
            let answer = suite.send(server, KEY_GAMMA, &[], CHAT, &body, None);
            suite.expect(PATH, "gamma", &answer, (429, Some("queue_full")));
            served(suite, server, PATH, "beta", false);
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// A request of several choices (`n`), and a batch of prompts, each choice
/// of each prompt a sequence of its own: whole (the body holds every
/// choice, each checked for others' canaries), and streamed by a client
/// that leaves after a few events (every sequence ends), while another
/// tenant is served.
fn choices(suite: &Suite, server: &Server) {
    const PATH: &str = "several choices (n = 4) and prompts (a batch), whole and left mid-stream";
    let cancelled = format!(
        r#"bulkhead_requests_total{{model="{MODEL_ID}",tenant="beta",reason="cancelled"}}"#
    );
    for _ in 0..suite.trials(2, 0.5) {
        let before = server.metric(&cancelled);
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "gamma", true));
            let mut body = echo(suite, "beta", MODEL_ID, 16);
            body["n"] = json!(4);
            body["temperature"] = json!(1);
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            // Three prompts, each with canaries of its own.
            let prompts: Vec<Value> = (0..3)
                .map(|_| echo(suite, "beta", MODEL_ID, 16)["prompt"].clone())
                .collect();
            body["prompt"] = json!(prompts);
            body["n"] = json!(1);
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            // Streamed: two prompts, two choices each.
            let mut body = counting(suite, "beta", MODEL_ID, 20, 300);
            let other = counting(suite, "beta", MODEL_ID, 20, 300);
            body["prompt"] = json!([body["prompt"].clone(), other["prompt"].clone()]);
            body["n"] = json!(2);
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, Some(8));
            suite.check(PATH, "beta", &answer.text);
            if answer.status != 200 || answer.code.is_some() || answer.text.is_empty() {
                suite.fail(format!("{PATH}: the stream did not run: {answer:?}"));
            }
            // Each choice's sequence is cancelled, not run to its end.
            if !eventually(Duration::from_secs(20), || {
                server.metric(&cancelled) >= before + 4.0
            }) {
                suite.fail(format!(
                    "{PATH}: the server never saw the four sequences go"
                ));
            }
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// Structured output: a schema whose strings invite the model to copy the
/// canaries (the answer is checked for others'), a choice among texts that
/// hold the tenant's own, and a schema's stream left after a few events
/// (its sequence ends), while another tenant is served. The constraint
/// picks among tokens; it must not change whose KV they are drawn from.
fn structured(suite: &Suite, server: &Server) {
    const PATH: &str = "structured output (a schema, a choice), whole and left mid-stream";
    let schema = json!({"type": "json_schema", "json_schema": {"name": "ticket", "schema": {
        "type": "object", "required": ["account", "ticket"],
        "properties": {"account": {"type": "string", "maxLength": 40},
                       "ticket": {"type": "string", "maxLength": 40}}}}});
    for _ in 0..suite.trials(2, 0.5) {
        let before = server.metric(&beta_cancelled());
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "gamma", true));
            let mut body = echo(suite, "beta", MODEL_ID, 48);
            body["response_format"] = schema.clone();
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            let mut body = echo(suite, "beta", MODEL_ID, 24);
            body["structured_outputs"] =
                json!({"choice": [suite.canary("beta"), suite.canary("beta"), "none"]});
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            // (At least 200 numbers: it cannot end before the client leaves.)
            let mut body = counting(suite, "beta", MODEL_ID, 20, 300);
            body["structured_outputs"] = json!({"json": {"type": "array", "minItems": 200,
                                                          "items": {"type": "integer"}}});
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, Some(6));
            left(suite, server, PATH, &answer, before);
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// Tool calls: tools whose descriptions hold the tenant's canaries and whose
/// parameters invite copying them (the calls are checked for others'), a
/// conversation whose earlier call and its result hold them, and a named
/// call's arguments streamed and left after a few events (its sequence
/// ends), while another tenant is served. The tools' texts are tokenized as
/// the tenant's text; the calls are sampled under a schema as any output is.
fn tools(suite: &Suite, server: &Server) {
    const PATH: &str = "tool calls (required, named, a result), whole and left mid-stream";
    for _ in 0..suite.trials(2, 0.5) {
        let before = server.metric(&beta_cancelled());
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "gamma", true));
            let (account, ticket) = (suite.canary("beta"), suite.canary("beta"));
            let tools = json!([
                {"type": "function", "function": {"name": "open_ticket",
                    "description": format!("Opens ticket {ticket} for account {account}."),
                    "parameters": {"type": "object", "required": ["account", "ticket"],
                        "properties": {"account": {"type": "string", "maxLength": 40},
                                       "ticket": {"type": "string", "maxLength": 40}}}}},
                {"type": "function", "function": {"name": "count",
                    "parameters": {"type": "object", "required": ["numbers"],
                        "properties": {"numbers": {"type": "array", "minItems": 200,
                                                   "items": {"type": "integer"}}}}}}
            ]);
            let mut body = chat(suite, "beta", MODEL_ID, 48, 0);
            body["tools"] = tools.clone();
            body["tool_choice"] = json!("required");
            body["parallel_tool_calls"] = json!(false);
            let answer = suite.send(server, KEY_BETA, &[], CHAT, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            // An earlier call and its result, then a named call.
            let arguments = json!({"account": account, "ticket": ticket}).to_string();
            body["messages"].as_array_mut().unwrap().extend([
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                    "type": "function",
                    "function": {"name": "open_ticket", "arguments": arguments}}]}),
                json!({"role": "tool", "tool_call_id": "c1",
                       "content": format!("Ticket {ticket} is open for {account}.")}),
            ]);
            body["tool_choice"] = json!({"type": "function", "function": {"name": "open_ticket"}});
            let answer = suite.send(server, KEY_BETA, &[], CHAT, &body, None);
            suite.expect(PATH, "beta", &answer, OK);
            // (At least 200 numbers: it cannot end before the client leaves.)
            body["tool_choice"] = json!({"type": "function", "function": {"name": "count"}});
            body["max_tokens"] = json!(600);
            body["stream"] = json!(true);
            let answer = suite.send(server, KEY_BETA, &[], CHAT, &body, Some(6));
            left(suite, server, PATH, &answer, before);
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// Beta's requests the server counted cancelled.
fn beta_cancelled() -> String {
    format!(r#"bulkhead_requests_total{{model="{MODEL_ID}",tenant="beta",reason="cancelled"}}"#)
}

/// Beta's stream that the client left after a few events: it ran, what it
/// sent is checked for others' canaries, and the server saw it go (beta's
/// cancelled requests past `before`).
/// A prompt scored (`echo` with its tokens' log probabilities): with
/// nothing generated, twice (the second finds the first's pages in the
/// tenant's cache and must compute them all the same), and streamed with a
/// long generation left after a few events (its sequence ends), while
/// another tenant is served. Every position's logits are read back: the
/// answers carry this tenant's text (its own canaries, by construction) and
/// nothing of anyone else's, tokens and alternatives included.
fn scored(suite: &Suite, server: &Server) {
    const PATH: &str = "scored prompt (echo, logprobs), whole and left mid-stream";
    for _ in 0..suite.trials(2, 0.5) {
        let before = server.metric(&beta_cancelled());
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "gamma", true));
            let mut body = echo(suite, "beta", MODEL_ID, 0);
            body["echo"] = json!(true);
            body["logprobs"] = json!(5);
            for _ in 0..2 {
                let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, None);
                suite.expect(PATH, "beta", &answer, OK);
            }
            let mut body = counting(suite, "beta", MODEL_ID, 20, 300);
            body["echo"] = json!(true);
            body["logprobs"] = json!(2);
            let answer = suite.send(server, KEY_BETA, &[], COMPLETIONS, &body, Some(6));
            left(suite, server, PATH, &answer, before);
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn left(suite: &Suite, server: &Server, path: &'static str, answer: &Answer, before: f64) {
    suite.check(path, "beta", &answer.text);
    if answer.status != 200 || answer.code.is_some() {
        suite.fail(format!("{path}: the stream did not run: {answer:?}"));
    }
    if !eventually(Duration::from_secs(20), || {
        server.metric(&beta_cancelled()) > before
    }) {
        suite.fail(format!("{path}: the server never saw the stream go"));
    }
}

fn preemption(suite: &Suite, server: &Server) {
    const PATH: &str = "preemption";
    let preempted = r#"bulkhead_preempted_total{model="smollm2-test",tenant="beta"}"#;
    for _ in 0..suite.trials(1, 0.05) {
        let before = server.metric(preempted);
        std::thread::scope(|s| {
            // Beta borrows most of the burst region: six streams of ~22 pages
            // (~245 prompt tokens + 100).
            let (talking, started) = std::sync::mpsc::channel::<()>();
            for _ in 0..6 {
                let talking = talking.clone();
                s.spawn(move || {
                    let body = counting(suite, "beta", MODEL_ID, 40, 100);
                    let answer = stream(suite, server, KEY_BETA, &body, At::Text, || {
                        let _ = talking.send(());
                    });
                    suite.expect(PATH, "beta", &answer, OK);
                });
            }
            for _ in 0..5 {
                let _ = started.recv_timeout(Duration::from_secs(120));
            }
            // Alpha: ~720 prompt tokens + 100, within its contract: it takes
            // back pages beta borrowed.
            let mut body = counting(suite, "alpha", MODEL_ID, 120, 100);
            body["stream"] = json!(false);
            let answer = suite.send(server, KEY_ALPHA, &[], COMPLETIONS, &body, None);
            suite.expect(PATH, "alpha", &answer, OK);
        });
        if server.metric(preempted) <= before {
            suite.fail(format!(
                "{PATH}: beta was not preempted (the path did not run)"
            ));
        }
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn plugin_faults(suite: &Suite, server: &Server) {
    for (path, mode, base, per_scale) in [
        ("plugin trap", "trap", 4, 8.0),
        ("plugin timeout", "loop", 4, 4.0),
    ] {
        for _ in 0..suite.trials(base, per_scale) {
            std::thread::scope(|s| {
                s.spawn(|| served(suite, server, path, "beta", false));
                for _ in 0..4 {
                    let body = chat(suite, "alpha", MODEL_ID, 8, 0);
                    let answer =
                        suite.send(server, KEY_ALPHA, &[("x-probe", mode)], CHAT, &body, None);
                    suite.expect(path, "alpha", &answer, (503, Some("policy_unavailable")));
                }
            });
            suite.trial_done(path, suite.baseline(path, server, MODEL_ID));
        }
    }
}

/// A plugin call stuck inside a host function (the test build stalls
/// alpha's host calls): abandoned at its deadline, its request 503, beta
/// served meanwhile; the stuck workers return when the stall ends.
fn plugin_stuck(suite: &Suite, server: &Server) {
    const PATH: &str = "plugin stuck in a host call";
    for _ in 0..suite.trials(2, 2.0) {
        let r = server.admin_call(
            "POST",
            "/admin/v1/tenants/alpha/fault/plugin-stall",
            Some(&json!({ "ms": 1500 })),
        );
        assert_eq!(r.status, 202, "{}", r.body);
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "beta", false));
            for _ in 0..2 {
                let body = chat(suite, "alpha", MODEL_ID, 8, 0);
                let answer = suite.send(
                    server,
                    KEY_ALPHA,
                    &[("x-probe", "clock")],
                    CHAT,
                    &body,
                    None,
                );
                suite.expect(PATH, "alpha", &answer, (503, Some("policy_unavailable")));
            }
        });
        let stuck = "bulkhead_plugin_workers_stuck";
        if !eventually(Duration::from_secs(10), || server.metric(stuck) == 0.0) {
            suite.fail(format!("{PATH}: stuck plugin workers did not return"));
        }
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// Alpha's streams to HTTP/2 clients that never open their window (their
/// responses start and cannot be sent): closed at the send deadline, their
/// requests cancelled, beta served meanwhile.
fn window_held(suite: &Suite, server: &Server) {
    const PATH: &str = "client holding its window";
    for _ in 0..suite.trials(2, 2.0) {
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "beta", true));
            let held: Vec<std::net::TcpStream> = (0..2)
                .map(|_| {
                    let mut body = chat(suite, "alpha", MODEL_ID, 64, 0);
                    body["stream"] = json!(true);
                    held_stream(server, &body)
                })
                .collect();
            for mut stream in held {
                stream
                    .set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let mut closed = false;
                while let Some((kind, _, id, payload)) = h2::read_frame(&mut stream) {
                    if kind == h2::DATA && id == 1 && !payload.is_empty() {
                        suite.fail(format!("{PATH}: data past a zero window"));
                    }
                    closed |= kind == h2::GOAWAY;
                }
                if !closed {
                    suite.fail(format!("{PATH}: a held connection was not closed"));
                }
            }
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// A streamed chat of alpha's over HTTP/2 with a zero stream window, once its
/// response has started.
fn held_stream(server: &Server, body: &Value) -> std::net::TcpStream {
    let addr = server.inference.trim_start_matches("http://").to_string();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    use std::io::Write as _;
    stream
        .write_all(&h2::open(&[(h2::INITIAL_WINDOW_SIZE, 0)]))
        .unwrap();
    stream
        .write_all(&h2::post(
            1,
            CHAT,
            KEY_ALPHA,
            &[],
            body.to_string().as_bytes(),
        ))
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    while let Some((kind, flags, id, _)) = h2::read_frame(&mut stream) {
        if kind == h2::SETTINGS && flags & h2::ACK == 0 {
            h2::ack_settings(&mut stream).unwrap();
        }
        if kind == h2::HEADERS && id == 1 {
            break;
        }
    }
    stream
}

/// Alpha's requests cancelled (RST_STREAM) while they wait behind its
/// spinning plugin on the lane: withdrawn, counted, nothing left running;
/// beta served meanwhile.
fn abandoned(suite: &Suite, server: &Server) {
    const PATH: &str = "abandoned before submission";
    let counted = r#"bulkhead_requests_abandoned_total{tenant="alpha"}"#;
    for _ in 0..suite.trials(2, 2.0) {
        let before = server.metric(counted);
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "beta", false));
            // Two requests whose plugin spins to its deadline hold the lane.
            let spinners: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let body = chat(suite, "alpha", MODEL_ID, 8, 0);
                        suite.send(server, KEY_ALPHA, &[("x-probe", "loop")], CHAT, &body, None)
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(5));
            let addr = server.inference.trim_start_matches("http://").to_string();
            for _ in 0..6 {
                let body = chat(suite, "alpha", MODEL_ID, 8, 0);
                let mut stream = std::net::TcpStream::connect(&addr).unwrap();
                use std::io::Write as _;
                let request = [
                    h2::open(&[]),
                    h2::post(1, CHAT, KEY_ALPHA, &[], body.to_string().as_bytes()),
                ]
                .concat();
                stream.write_all(&request).unwrap();
                std::thread::sleep(Duration::from_millis(15));
                let _ =
                    stream.write_all(&h2::frame(h2::RST_STREAM, 0, 1, &h2::CANCEL.to_be_bytes()));
            }
            for spinner in spinners {
                let answer = spinner.join().unwrap();
                suite.expect(PATH, "alpha", &answer, (503, Some("policy_unavailable")));
            }
        });
        if !eventually(Duration::from_secs(5), || server.metric(counted) > before) {
            suite.fail(format!(
                "{PATH}: no request was abandoned (the path did not run)"
            ));
        }
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn tenant_deleted(suite: &Suite, server: &Server) {
    const PATH: &str = "tenant deleted mid-request";
    for trial in 0..suite.trials(2, 0.5) {
        let name = format!("ephemeral{trial}");
        let create = json!({"name": name, "pages_reserved": 16, "pages_max": 64,
                            "queue_depth_max": 4, "running_max": 4});
        let r = server.admin_call("POST", "/admin/v1/tenants", Some(&create));
        assert_eq!(r.status, 201, "{}", r.body);
        let r = server.admin_call("POST", &format!("/admin/v1/tenants/{name}/keys"), None);
        assert_eq!(r.status, 201, "{}", r.body);
        let key = r.json()["secret"].as_str().unwrap().to_string();
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "beta", true));
            interrupted(
                suite,
                server,
                PATH,
                MODEL_ID,
                &[(&name, &key)],
                || {
                    let r = server.admin_call("DELETE", &format!("/admin/v1/tenants/{name}"), None);
                    assert_eq!(r.status, 200, "{}", r.body);
                },
                (403, "tenant_removed"),
            );
        });
        // Its key is dead.
        let body = chat(suite, &name, MODEL_ID, 4, 0);
        let answer = suite.send(server, &key, &[], CHAT, &body, None);
        suite.expect(PATH, &name, &answer, (401, Some("invalid_api_key")));
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

fn model_unloaded(suite: &Suite, server: &Server) {
    const PATH: &str = "model unloaded mid-request";
    for trial in 0..suite.trials(1, 0.2) {
        let id = format!("victim{trial}");
        let add = json!({"id": id, "path": suite.model, "context_tokens": 1024, "threads": 1,
                         "page_tokens": 16, "pool_pages": 224, "seq_pages_max": 64,
                         "step_tokens_max": 256, "step_seqs_max": 8});
        let r = server.admin_call("POST", "/admin/v1/models", Some(&add));
        assert_eq!(r.status, 201, "{}", r.body);
        std::thread::scope(|s| {
            s.spawn(|| served(suite, server, PATH, "gamma", true));
            interrupted(
                suite,
                server,
                PATH,
                &id,
                &[("alpha", KEY_ALPHA), ("beta", KEY_BETA)],
                || {
                    let unload = format!("/admin/v1/models/{id}?drain_ms=0");
                    let r = server.admin_call("DELETE", &unload, None);
                    assert_eq!(r.status, 200, "{}", r.body);
                },
                (503, "model_removed"),
            );
        });
        let body = chat(suite, "alpha", &id, 4, 0);
        let answer = suite.send(server, KEY_ALPHA, &[], CHAT, &body, None);
        suite.expect(PATH, "alpha", &answer, (404, Some("model_not_found")));
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// A streamed and a whole request of each of `tenants` (name, key) on
/// `model`, long enough to be in flight when `act` runs (once every stream
/// has generated): each must end with `error` — a whole request with its
/// status and code, a stream (already 200) with that code as its last event.
/// (~430 tokens each, 27 pages: all four of two tenants fit the burst region
/// at once; a request waiting for pages could finish before `act`.)
fn interrupted(
    suite: &Suite,
    server: &Server,
    path: &'static str,
    model: &str,
    tenants: &[(&str, &str)],
    act: impl FnOnce(),
    error: (u16, &str),
) {
    std::thread::scope(|s| {
        let (talking, started) = std::sync::mpsc::channel::<()>();
        let mut requests = Vec::new();
        for &(tenant, key) in tenants {
            let talking = talking.clone();
            requests.push(s.spawn(move || {
                let body = counting(suite, tenant, model, 20, 300);
                let answer = stream(suite, server, key, &body, At::Text, || {
                    let _ = talking.send(());
                });
                (tenant, answer, (200, error.1))
            }));
            requests.push(s.spawn(move || {
                let mut body = counting(suite, tenant, model, 20, 300);
                body["stream"] = json!(false);
                let answer = suite.send(server, key, &[], COMPLETIONS, &body, None);
                (tenant, answer, error)
            }));
        }
        for _ in tenants {
            let _ = started.recv_timeout(Duration::from_secs(60));
        }
        // The whole requests were sent with the streams: a step has run since.
        act();
        for request in requests {
            let (tenant, answer, (status, code)) = request.join().unwrap();
            suite.expect(path, tenant, &answer, (status, Some(code)));
        }
    });
}

/// When [`stream`] signals.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    /// Once the response's headers arrived (the request is queued or running).
    Headers,
    /// At the first generated text.
    Text,
}

/// Streams the completion `body` to its end, calling `signal` once, `at`.
fn stream(
    suite: &Suite,
    server: &Server,
    key: &str,
    body: &Value,
    at: At,
    signal: impl Fn(),
) -> Answer {
    let response = match suite
        .agent
        .post(&format!("{}{COMPLETIONS}", server.inference))
        .set("authorization", &format!("Bearer {key}"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
    {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("transport error: {e}"),
    };
    let mut answer = Answer {
        status: response.status(),
        ..Answer::default()
    };
    if at == At::Headers {
        signal();
    }
    if answer.status != 200 {
        answer.text = response.into_string().unwrap_or_default();
        let value: Value = serde_json::from_str(&answer.text).unwrap_or(Value::Null);
        answer.code = value["error"]["code"].as_str().map(str::to_string);
        return answer;
    }
    let mut sse = sse_reader(response);
    while let Some(data) = sse.next_data() {
        answer.events += 1;
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
        let piece = chunk["choices"][0]["text"].as_str().unwrap_or("");
        if at == At::Text && answer.text.is_empty() && !piece.is_empty() {
            signal();
        }
        answer.text.push_str(piece);
        if let Some(code) = chunk["error"]["code"].as_str() {
            answer.code = Some(code.to_string());
            answer.text.push('\n');
            answer.text.push_str(&data);
        }
        if let Some(finish) = chunk["choices"][0]["finish_reason"].as_str() {
            answer.finish = Some(finish.to_string());
        }
    }
    answer
}

fn deadline(suite: &Suite, server: &Server) {
    const PATH: &str = "deadline expiry";
    for _ in 0..suite.trials(2, 1.0) {
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut body = counting(suite, "alpha", MODEL_ID, 20, 600);
                body["stream"] = json!(false);
                let answer = suite.send(server, KEY_ALPHA, &[], COMPLETIONS, &body, None);
                suite.expect(PATH, "alpha", &answer, (504, Some("request_timeout")));
            });
            let body = counting(suite, "beta", MODEL_ID, 20, 600);
            let answer = stream(suite, server, KEY_BETA, &body, At::Headers, || {});
            suite.expect(PATH, "beta", &answer, (200, Some("request_timeout")));
        });
        suite.trial_done(PATH, suite.baseline(PATH, server, MODEL_ID));
    }
}

/// The engine panics (the fault-injection build's route) with both tenants'
/// streams in flight; both end with `engine_fault`, the engine comes back and
/// serves. A supervised engine stays down after 5 faults in a row: a fresh
/// server every 3 trials.
fn engine_fault(suite: &Suite, policy: &Policy) {
    const PATH: &str = "engine panic and restart";
    let trials = suite.trials(1, 0.2);
    let mut trial = 0;
    while trial < trials {
        let server = start(&suite.model, policy);
        for _ in 0..3.min(trials - trial) {
            trial += 1;
            let panic_route = format!("/admin/v1/models/{MODEL_ID}/fault/panic");
            // A POST-only route answers GET with 405; a build without fault
            // injection has no such route (404).
            if server.admin_call("GET", &panic_route, None).status == 404 {
                suite.skip(
                    PATH,
                    "this binary has no fault injection (build it with --features fault-injection)",
                );
                return;
            }
            interrupted(
                suite,
                &server,
                PATH,
                MODEL_ID,
                &[("alpha", KEY_ALPHA), ("beta", KEY_BETA)],
                || {
                    let r = server.admin_call("POST", &panic_route, None);
                    assert_eq!(r.status, 202, "{}", r.body);
                },
                (500, "engine_fault"),
            );
            let ready = eventually(Duration::from_secs(30), || {
                server.get(&server.inference, "/readyz", None).status == 200
            });
            if !ready {
                suite.fail(format!("{PATH}: not ready again after the restart"));
            }
            served(suite, &server, PATH, "alpha", false);
            served(suite, &server, PATH, "beta", true);
            suite.trial_done(PATH, suite.baseline(PATH, &server, MODEL_ID));
        }
        suite.scan_records(&server);
    }
}

// ------------------------------------------------- the transfer paths (I5)

/// The secret both processes of the transfer paths prove.
const TRANSFER_SECRET: &str = "isolation-transfer-secret-0123456789abcdef";
/// How long the decode side waits for a transfer's next page.
const TRANSFER_FRAME_TIMEOUT_MS: u64 = 1000;

/// A prefill and a decode process of the suite's policy (each its own sled
/// store, seeded alike): the decode side's peer is a man in the middle
/// ([`TransferProxy`]) in front of the prefill side's transfer listener,
/// which injects each fault into one transfer of one tenant.
struct Split<'a> {
    model: &'a std::path::Path,
    /// The decode side's policy: the suite's, with a short frame deadline.
    policy: Policy,
    /// The prefill side's: the suite's (its wait for the verdict is the
    /// default frame deadline, longer than a test's act on a held transfer).
    prefill_policy: Policy,
    prefill: Option<Server>,
    decode: Option<Server>,
    proxy: TransferProxy,
    /// The prefill side's transfer port (kept across its restarts).
    port: u16,
    /// Tenant name → stable id (the same on both sides).
    ids: HashMap<String, u32>,
    /// Folders of killed processes, removed at the end.
    dirs: Vec<std::path::PathBuf>,
}

impl<'a> Split<'a> {
    fn start(model: &'a std::path::Path, policy: &Policy) -> Split<'a> {
        let prefill_policy = policy.clone();
        let policy = Policy {
            server_toml: format!(
                "{}transfer_frame_timeout_ms = {TRANSFER_FRAME_TIMEOUT_MS}\n",
                policy.server_toml
            ),
            ..policy.clone()
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let proxy = TransferProxy::start(&format!("127.0.0.1:{port}"));
        let mut split = Split {
            model,
            policy,
            prefill_policy,
            prefill: None,
            decode: None,
            proxy,
            port,
            ids: HashMap::new(),
            dirs: Vec::new(),
        };
        split.prefill = Some(split.launch_prefill(None));
        split.decode = Some(split.launch_decode(None));
        split.wait_ready("start");
        let r = split
            .decode()
            .admin_call("GET", "/admin/v1/partitions", None);
        for row in r.json()["data"].as_array().unwrap() {
            split.ids.insert(
                row["tenant"].as_str().unwrap().to_string(),
                row["tenant_id"].as_u64().unwrap() as u32,
            );
        }
        split
    }

    fn launch_prefill(&self, dir: Option<&std::path::Path>) -> Server {
        let mut l = Launch::new(self.model, &self.prefill_policy)
            .arg("--role")
            .arg("prefill")
            .arg("--transfer-listen")
            .arg(&format!("127.0.0.1:{}", self.port))
            .env("BULKHEAD_TRANSFER_SECRET", Some(TRANSFER_SECRET));
        if let Some(dir) = dir {
            l = l.dir(dir);
        }
        launch(l)
    }

    fn launch_decode(&self, dir: Option<&std::path::Path>) -> Server {
        let mut l = Launch::new(self.model, &self.policy)
            .arg("--role")
            .arg("decode")
            .arg("--prefill-peer")
            .arg(&self.proxy.addr)
            .env("BULKHEAD_TRANSFER_SECRET", Some(TRANSFER_SECRET));
        if let Some(dir) = dir {
            l = l.dir(dir);
        }
        launch(l)
    }

    fn prefill(&self) -> &Server {
        self.prefill.as_ref().unwrap()
    }

    fn decode(&self) -> &Server {
        self.decode.as_ref().unwrap()
    }

    fn id(&self, tenant: &str) -> u32 {
        self.ids[tenant]
    }

    /// Waits for the decode side to pair (its `/readyz`).
    fn wait_ready(&self, what: &str) {
        let ready = eventually(Duration::from_secs(30), || {
            self.decode()
                .get(&self.decode().inference, "/readyz", None)
                .status
                == 200
        });
        assert!(ready, "the decode side did not pair ({what})");
    }

    /// Both pools at baseline (both processes' pool audit routes).
    fn baseline(&self, suite: &Suite, path: &'static str) -> bool {
        // Not `&&`: both are checked (and named in the failure) every time.
        suite.baseline(path, self.decode(), MODEL_ID)
            & suite.baseline(path, self.prefill(), MODEL_ID)
    }

    fn scan_records(&self, suite: &Suite) {
        suite.scan_records(self.decode());
        suite.scan_records(self.prefill());
    }
}

impl Drop for Split<'_> {
    fn drop(&mut self) {
        self.decode = None;
        self.prefill = None;
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Both tenants served through the link, streamed and whole, at once.
fn transfer_success(suite: &Suite, split: &Split) {
    const PATH: &str = "transfer: success (two processes)";
    for trial in 0..suite.trials(2, 1.0) {
        std::thread::scope(|s| {
            for tenant in ["alpha", "beta"] {
                for j in 0..3 {
                    let stream = (trial + j).is_multiple_of(2);
                    s.spawn(move || served(suite, split.decode(), PATH, tenant, stream));
                }
            }
        });
        suite.trial_done(PATH, split.baseline(suite, PATH));
    }
}

/// One of alpha's transfers changed by `fault` while beta is served: alpha
/// gets `expected`, beta its answer, nobody another's canary, both pools
/// back at baseline.
fn transfer_fault(
    suite: &Suite,
    split: &Split,
    path: &'static str,
    fault: Fault,
    expected: (u16, Option<&str>),
) {
    // Beta first: the transfer a replay sends is another tenant's.
    served(suite, split.decode(), path, "beta", false);
    split.proxy.arm(split.id("alpha"), fault.clone());
    std::thread::scope(|s| {
        s.spawn(|| served(suite, split.decode(), path, "beta", true));
        // ~70 prompt tokens: five pages, so every page a fault names exists.
        let body = chat(suite, "alpha", MODEL_ID, 16, 20);
        let answer = suite.send(split.decode(), KEY_ALPHA, &[], CHAT, &body, None);
        suite.expect(path, "alpha", &answer, expected);
    });
    if !split.proxy.fired() {
        split.proxy.disarm();
        suite.fail(format!(
            "{path}: {fault:?} was never applied (no transfer of alpha's)"
        ));
    }
    suite.trial_done(path, split.baseline(suite, path));
}

fn transfer_corrupted(suite: &Suite, split: &Split) {
    const PATH: &str = "transfer: corrupted, rearranged, replayed, the placeholder";
    let faults = [
        Fault::Corrupt(1),
        Fault::WrongDigest(0),
        Fault::Drop(1),
        Fault::Duplicate(0),
        Fault::Reorder,
        Fault::Truncate(2),
        Fault::Placeholder,
        Fault::Replay,
    ];
    for round in 0..suite.trials(1, 0.5) {
        for fault in &faults {
            // At scale 1 each fault once; later rounds rotate which page.
            let fault = match (fault, round) {
                (Fault::Corrupt(n), r) => Fault::Corrupt((n + r) % 4),
                (f, _) => f.clone(),
            };
            transfer_fault(suite, split, PATH, fault, (502, Some("kv_transfer_failed")));
        }
    }
}

fn transfer_cut(suite: &Suite, split: &Split) {
    const PATH: &str = "transfer: cut off at each step, or late";
    let late = Duration::from_millis(3 * TRANSFER_FRAME_TIMEOUT_MS);
    for _ in 0..suite.trials(1, 0.5) {
        for fault in [
            Fault::Kill(0),
            Fault::Kill(1),
            Fault::Kill(3),
            Fault::Delay(late),
        ] {
            transfer_fault(suite, split, PATH, fault, (502, Some("kv_transfer_failed")));
        }
    }
}

/// A stream of `tenant`'s whose transfer the man in the middle holds: it
/// returns once the transfer is mid-way (the decode side's pages reserved
/// in its import, the prefill side's exported and held), with the response
/// (already 200: its headers went at admission).
/// (`pad` words make the prompt longer: 850 is ~900 tokens, 57 pages, 20 MiB
/// of KV — more than loopback's socket buffers hold, so a prefill process
/// killed while held has not written the whole transfer.)
fn held_transfer(
    suite: &Suite,
    split: &Split,
    path: &str,
    tenant: &str,
    pad: usize,
) -> ureq::Response {
    split
        .proxy
        .arm(split.id(tenant), Fault::Hold(Duration::from_secs(60)));
    let mut body = chat(suite, tenant, MODEL_ID, 16, pad);
    body["stream"] = json!(true);
    let response = suite
        .agent
        .post(&format!("{}{CHAT}", split.decode().inference))
        .set("authorization", &format!("Bearer {}", key_of(tenant)))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        split.proxy.wait_holding(Duration::from_secs(60)),
        "{path}: the transfer was never held"
    );
    response
}

/// A stream's error code (its last error event) and everything it said.
fn stream_end(response: ureq::Response) -> (Option<String>, String) {
    let mut sse = sse_reader(response);
    let (mut code, mut text) = (None, String::new());
    while let Some(data) = sse.next_data() {
        let chunk: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
        if let Some(c) = chunk["error"]["code"].as_str() {
            code = Some(c.to_string());
        }
        text.push_str(&data);
    }
    (code, text)
}

/// After a held transfer's end: the man in the middle holds nothing (the
/// link was closed, or the hold released).
fn hold_over(suite: &Suite, split: &Split, path: &str) {
    split.proxy.release();
    if !eventually(Duration::from_secs(30), || !split.proxy.holding()) {
        suite.fail(format!("{path}: the held link never closed"));
    }
}

/// The client leaves mid-transfer: the decode side sees it go, drops the
/// link, and both sides release.
fn transfer_client_leaves(suite: &Suite, split: &Split) {
    const PATH: &str = "transfer: client leaves mid-transfer";
    let cancelled = format!(
        r#"bulkhead_requests_total{{model="{MODEL_ID}",tenant="alpha",reason="cancelled"}}"#
    );
    for _ in 0..suite.trials(1, 0.5) {
        let before = split.decode().metric(&cancelled);
        std::thread::scope(|s| {
            s.spawn(|| served(suite, split.decode(), PATH, "beta", true));
            drop(held_transfer(suite, split, PATH, "alpha", 20));
        });
        if !eventually(Duration::from_secs(20), || {
            split.decode().metric(&cancelled) > before
        }) {
            suite.fail(format!("{PATH}: the decode side never saw alpha leave"));
        }
        hold_over(suite, split, PATH);
        suite.trial_done(PATH, split.baseline(suite, PATH));
    }
}

/// Gamma deleted (on both sides, as an operator of two sled stores does)
/// mid-transfer: its stream ends `tenant_removed`, both sides release. The
/// last transfer path: gamma is gone after it.
fn transfer_tenant_deleted(suite: &Suite, split: &Split) {
    const PATH: &str = "transfer: tenant deleted mid-transfer";
    std::thread::scope(|s| {
        s.spawn(|| served(suite, split.decode(), PATH, "beta", true));
        let response = held_transfer(suite, split, PATH, "gamma", 20);
        let reader = s.spawn(move || stream_end(response));
        for server in [split.decode(), split.prefill()] {
            let r = server.admin_call("DELETE", "/admin/v1/tenants/gamma", None);
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let (code, text) = reader.join().unwrap();
        suite.check(PATH, "gamma", &text);
        if code.as_deref() != Some("tenant_removed") {
            suite.fail(format!(
                "{PATH}: gamma's stream ended with {code:?}, documented tenant_removed"
            ));
        }
    });
    hold_over(suite, split, PATH);
    suite.trial_done(PATH, split.baseline(suite, PATH));
}

/// The prefill process killed mid-transfer: the request fails with
/// `kv_transfer_failed`, the decode side keeps no partial page; a new
/// prefill process on the same port pairs again and serves.
fn transfer_prefill_restart(suite: &Suite, split: &mut Split) {
    const PATH: &str = "transfer: prefill process killed mid-transfer, restarted";
    for _ in 0..suite.trials(1, 0.25) {
        let response = held_transfer(suite, split, PATH, "alpha", 850);
        let dir = split.prefill.take().unwrap().kill();
        // What the dead process had written still arrives; then the end.
        split.proxy.release();
        let (code, text) = stream_end(response);
        suite.check(PATH, "alpha", &text);
        if code.as_deref() != Some("kv_transfer_failed") {
            suite.fail(format!(
                "{PATH}: alpha's stream ended with {code:?}, documented kv_transfer_failed"
            ));
        }
        let baseline = suite.baseline(PATH, split.decode(), MODEL_ID);
        split.prefill = Some(split.launch_prefill(Some(&dir)));
        split.dirs.push(dir);
        split.wait_ready("after the prefill process's restart");
        served(suite, split.decode(), PATH, "alpha", false);
        served(suite, split.decode(), PATH, "beta", true);
        suite.trial_done(PATH, baseline & split.baseline(suite, PATH));
    }
}

/// The decode process killed mid-transfer: the prefill side sees the link
/// close and releases its exported pages; a new decode process on the same
/// store pairs again and serves.
fn transfer_decode_restart(suite: &Suite, split: &mut Split) {
    const PATH: &str = "transfer: decode process killed mid-transfer, restarted";
    for _ in 0..suite.trials(1, 0.25) {
        let response = held_transfer(suite, split, PATH, "alpha", 20);
        let decode = split.decode.take().unwrap();
        suite.scan_records(&decode);
        let dir = decode.kill();
        drop(response);
        let baseline = suite.baseline(PATH, split.prefill(), MODEL_ID);
        hold_over(suite, split, PATH);
        split.decode = Some(split.launch_decode(Some(&dir)));
        split.dirs.push(dir);
        split.wait_ready("after the decode process's restart");
        served(suite, split.decode(), PATH, "alpha", true);
        served(suite, split.decode(), PATH, "beta", false);
        suite.trial_done(PATH, baseline & split.baseline(suite, PATH));
    }
}

// ------------------------------------------------- two servers on one etcd

/// The paths across two servers on one etcd (for `BULKHEAD_ISOLATION_ONLY`).
const CLUSTER_PATHS: [&str; 2] = ["cluster_success", "cluster_tenant_deleted"];

/// Success on both servers at once: each answer its own tenant's, both
/// pools at baseline after every trial.
fn cluster_success(suite: &Suite, a: &Server, b: &Server) {
    const PATH: &str = "success on two servers";
    for _ in 0..suite.trials(2, 0.5) {
        std::thread::scope(|s| {
            for (server, stream) in [(a, true), (b, false)] {
                for (tenant, _) in TENANTS.iter() {
                    let n = if *tenant == "gamma" { 1 } else { 4 };
                    for _ in 0..n {
                        s.spawn(move || served(suite, server, PATH, tenant, stream));
                    }
                }
            }
        });
        let at_baseline = suite.baseline(PATH, a, MODEL_ID) & suite.baseline(PATH, b, MODEL_ID);
        suite.trial_done(PATH, at_baseline);
    }
}

/// A tenant created through A and served on B, deleted through A while its
/// requests run on B: B ends them (`tenant_removed`), its key is dead on
/// both, and B's pool is back at baseline.
fn cluster_tenant_deleted(suite: &Suite, a: &Server, b: &Server) {
    const PATH: &str = "tenant deleted through another server";
    for trial in 0..suite.trials(2, 0.5) {
        let name = format!("remote{trial}");
        let create = json!({"name": name, "pages_reserved": 16, "pages_max": 64,
                            "queue_depth_max": 4, "running_max": 4});
        let r = a.admin_call("POST", "/admin/v1/tenants", Some(&create));
        assert_eq!(r.status, 201, "{}", r.body);
        let r = a.admin_call("POST", &format!("/admin/v1/tenants/{name}/keys"), None);
        assert_eq!(r.status, 201, "{}", r.body);
        let key = r.json()["secret"].as_str().unwrap().to_string();
        let live = eventually(Duration::from_secs(5), || {
            b.get(&b.inference, "/v1/tenant", Some(&key)).status == 200
        });
        assert!(live, "the tenant reached B");
        std::thread::scope(|s| {
            s.spawn(|| served(suite, b, PATH, "beta", true));
            interrupted(
                suite,
                b,
                PATH,
                MODEL_ID,
                &[(&name, &key)],
                || {
                    let r = a.admin_call("DELETE", &format!("/admin/v1/tenants/{name}"), None);
                    assert_eq!(r.status, 200, "{}", r.body);
                },
                (403, "tenant_removed"),
            );
        });
        for server in [a, b] {
            let body = chat(suite, &name, MODEL_ID, 4, 0);
            let answer = suite.send(server, &key, &[], CHAT, &body, None);
            suite.expect(PATH, &name, &answer, (401, Some("invalid_api_key")));
        }
        let at_baseline = suite.baseline(PATH, a, MODEL_ID) & suite.baseline(PATH, b, MODEL_ID);
        suite.trial_done(PATH, at_baseline);
    }
}

/// Two servers of `policy` on a fresh etcd; skipped (said) without etcd.
fn cluster_paths(suite: &Suite, model: &std::path::Path, policy: &Policy) {
    let Some(etcd) = support::etcd::Etcd::start("isolation") else {
        eprintln!("skipped: the isolation suite's two-server paths: etcd is not installed");
        return;
    };
    let policy = Policy {
        store_toml: etcd.store_toml("isolation/"),
        ..policy.clone()
    };
    let a = start(model, &policy);
    let b = start(model, &policy);
    if suite.runs("cluster_success") {
        cluster_success(suite, &a, &b);
    }
    if suite.runs("cluster_tenant_deleted") {
        cluster_tenant_deleted(suite, &a, &b);
    }
    suite.scan_records(&a);
    suite.scan_records(&b);
}

/// The transfer paths' names (for `BULKHEAD_ISOLATION_ONLY`).
const TRANSFER_PATHS: [&str; 7] = [
    "transfer_success",
    "transfer_corrupted",
    "transfer_cut",
    "transfer_client_leaves",
    "transfer_prefill_restart",
    "transfer_decode_restart",
    "transfer_tenant_deleted",
];

/// Every transfer path, on one pair of processes.
fn transfer_paths(suite: &Suite, model: &std::path::Path, policy: &Policy) {
    let mut split = Split::start(model, policy);
    type Path = fn(&Suite, &Split);
    let paths: [(&str, Path); 4] = [
        ("transfer_success", transfer_success),
        ("transfer_corrupted", transfer_corrupted),
        ("transfer_cut", transfer_cut),
        ("transfer_client_leaves", transfer_client_leaves),
    ];
    for (name, path) in paths {
        if suite.runs(name) {
            path(suite, &split);
        }
    }
    if suite.runs("transfer_prefill_restart") {
        transfer_prefill_restart(suite, &mut split);
    }
    if suite.runs("transfer_decode_restart") {
        transfer_decode_restart(suite, &mut split);
    }
    if suite.runs("transfer_tenant_deleted") {
        transfer_tenant_deleted(suite, &split);
    }
    split.scan_records(suite);
}

#[test]
fn no_tenant_sees_another_tenants_data_on_any_path() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = plugin_wasm("probe") else {
        return;
    };
    let suite = Suite::new(model.clone());
    let policy = Policy {
        // Small reservations, room to borrow: preemption can happen.
        alpha_pages: (16, 96),
        beta_pages: (16, 192),
        alpha_pending_max: 32,
        beta_pending_max: 32,
        // Plugin faults never disable the plugin; a spinning plugin is
        // stopped by its 50 ms deadline, not its fuel.
        plugins_toml: "[plugins]\nfaults_max = 1000000\nfuel = 1000000000000\ndeadline_ms = 50\n"
            .into(),
        // A held response is closed after a second without progress.
        server_toml: "send_stall_timeout_ms = 1000\n".into(),
        // The suite is its binary's only test: both of CI's cores.
        threads: 2,
        ..Policy::default()
    };
    let started = Instant::now();
    suite.book.lock().unwrap().mark = Some(started);
    {
        let server = start(&model, &policy);
        let r = server.call_raw(
            &server.admin,
            "PUT",
            "/admin/v1/tenants/alpha/plugins/probe",
            Some(ADMIN_TOKEN),
            "application/wasm",
            &std::fs::read(&probe).unwrap(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        type Path = fn(&Suite, &Server);
        let paths: [(&str, Path); 18] = [
            ("success", success),
            ("prefix_cache", prefix_cache),
            ("oversized", oversized),
            ("oversized_refused", oversized_refused),
            ("cancel_prefill", cancel_prefill),
            ("cancel_decode", cancel_decode),
            ("choices", choices),
            ("structured", structured),
            ("tools", tools),
            ("scored", scored),
            ("queue_full", queue_full),
            ("preemption", preemption),
            ("plugin_faults", plugin_faults),
            ("plugin_stuck", plugin_stuck),
            ("window_held", window_held),
            ("abandoned", abandoned),
            ("tenant_deleted", tenant_deleted),
            ("model_unloaded", model_unloaded),
        ];
        for (name, path) in paths {
            if suite.runs(name) {
                path(&suite, &server);
            }
        }
        suite.scan_records(&server);
    }
    let short = Policy {
        request_timeout_ms: 500,
        ..policy.clone()
    };
    if suite.runs("deadline") {
        let server = start(&model, &short);
        deadline(&suite, &server);
        suite.scan_records(&server);
    }
    if suite.runs("engine_fault") {
        engine_fault(&suite, &policy);
    }
    if TRANSFER_PATHS.iter().any(|name| suite.runs(name)) {
        transfer_paths(&suite, &model, &policy);
    }
    if CLUSTER_PATHS.iter().any(|name| suite.runs(name)) {
        cluster_paths(&suite, &model, &policy);
    }

    let table = suite.table();
    println!(
        "\nIsolation suite, scale {} ({:.0} s):\n\n{table}",
        suite.scale,
        started.elapsed().as_secs_f64()
    );
    if let Ok(path) = std::env::var("BULKHEAD_ISOLATION_REPORT") {
        std::fs::write(&path, &table).unwrap();
    }
    let book = suite.book.lock().unwrap();
    assert!(
        book.failures.is_empty(),
        "{} failures:\n{}\n\n{table}",
        book.failures.len(),
        book.failures.join("\n")
    );
    let echoes: u64 = book.rows.iter().map(|(_, r)| r.echoes).sum();
    // The detector is alive: the model repeats its own tenant's canaries.
    assert!(
        echoes > 0 || !suite.runs("success"),
        "no response echoed its own canary:\n{table}"
    );
}
