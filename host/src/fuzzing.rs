//! Bodies of the fuzz targets for the host's parsers of outside bytes
//! (issue 21, item 9): OpenAI request bodies, admin and self-service bodies
//! and query strings, plugin uploads, the policy file and store records.
//!
//! Each `pub fn` takes arbitrary bytes and must return normally for every
//! input: a panic is a bug. They live in the library so that
//!
//! 1. each `fuzz/fuzz_targets/<target>.rs` is a three-line libFuzzer wrapper;
//! 2. `host/tests/fuzz_corpora.rs` replays every committed corpus and
//!    regression input through the same functions in `cargo test`.
//!
//! Every target parses exactly as the server does (the same functions, or
//! `serde_json` and axum's `Query` on the same types as the handlers), and
//! then checks the negative space where it is cheap: a parsed request obeys
//! every documented limit and parses again, written back, to the same thing;
//! a registered canary is caught in another tenant's text and never in its
//! own; a compiled plugin's sealed form opens, and a tampered one does not; a
//! decoded store record written back decodes to the same record.

use crate::api::admin::{AuditQuery, CreateTenant, RemoveQuery, UsageQuery};
use crate::api::openai::{
    ChatRequest, Common, CompletionRequest, DetokenizeRequest, Prompt, TokenizeInput,
    TokenizeRequest, CACHE_SALT_BYTES_MAX, CHOICES_MAX, TOP_K_LIMIT,
};
use crate::api::tools::CallsOut;
use crate::config::{Config, ModelSpec, PluginsConfig};
use crate::engine::chat::MESSAGES_MAX;
use crate::engine::json::Json;
use crate::engine::sampling::{
    LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX, PENALTY_LIMIT, REPETITION_PENALTY_MAX, STOP_TOKEN_IDS_MAX,
    TOP_LOGPROBS_MAX,
};
use crate::engine::schema::{Schema, Source};
use crate::engine::stop::{STOPS_MAX, STOP_BYTES_MAX};
use crate::policy::{CallLimits, PolicyRuntime};
use crate::store::records::{
    AuditRecord, KeyRecord, KeySource, Meta, ModelRecord, PluginLimitsRequest, PluginRecord,
    PluginStateRecord, TenantRecord, UsageRecord,
};
use crate::store::{Batch, Entry, Expect, Storage, Store, StoreError, Write};
use crate::tenancy::canary::{self, CanaryGuard, Hit};
use crate::tenancy::control::{Canaries, TenantPatch, UploadOptions};
use crate::tenancy::{valid_name, ModelAccess, Quota, TenantId};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, OnceLock};

pub use bulkhead_kernels::fuzzing::{replay, replays_cleanly, write_seeds};

// ---------------------------------------------------------------------------
// OpenAI bodies.

/// Parses arbitrary bytes as both OpenAI bodies (`/v1/chat/completions` and
/// `/v1/completions`); a body either parses obeys every limit and parses again,
/// written back, to the same request. Then as `/tokenize` and `/detokenize`
/// bodies, which must not panic, and whose conversation obeys the chat's limits.
pub fn openai(data: &[u8]) {
    if let Ok(TokenizeRequest {
        input: TokenizeInput::Messages(messages, _),
        ..
    }) = TokenizeRequest::parse(data)
    {
        assert!(!messages.is_empty() && messages.len() <= MESSAGES_MAX);
    }
    let _ = DetokenizeRequest::parse(data);
    if let Ok(chat) = ChatRequest::parse(data) {
        check_common(&chat.common);
        check_recognizer(&chat.common, data);
        assert!(!chat.messages.is_empty() && chat.messages.len() <= MESSAGES_MAX);
        let mut calls = 0;
        for message in &chat.messages {
            assert!(
                ["system", "user", "assistant", "tool"].contains(&message.role.as_str()),
                "{message:?}"
            );
            assert!(message.tool_calls.is_empty() || message.role == "assistant");
            // A tool message answers a call made before it.
            assert_eq!(message.answers.is_some(), message.role == "tool");
            assert!(message.answers.is_none_or(|k| k < calls), "{message:?}");
            calls += message.tool_calls.len();
        }
        assert!(chat.tools.len() <= crate::api::tools::TOOLS_MAX);
        let mut body = common_body(&chat.common);
        let mut k = 0;
        body["messages"] = chat
            .messages
            .iter()
            .map(|m| {
                let mut message = json!({"role": m.role, "content": m.content});
                if !m.tool_calls.is_empty() {
                    let calls: Vec<Value> = m
                        .tool_calls
                        .iter()
                        .map(|call| {
                            k += 1;
                            json!({"id": format!("c{}", k - 1), "type": "function",
                                   "function": {"name": call.name,
                                                "arguments": Value::Object(call.arguments.clone()).to_string()}})
                        })
                        .collect();
                    message["tool_calls"] = calls.into();
                }
                if let Some(answers) = m.answers {
                    message["tool_call_id"] = format!("c{answers}").into();
                }
                message
            })
            .collect();
        if !chat.tools.is_empty() {
            body["tools"] = chat
                .tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {"name": t.name,
                           "description": t.description, "parameters": t.parameters}})
                })
                .collect();
        }
        match &chat.calls {
            None if !chat.tools.is_empty() => {
                body["tool_choice"] = json!("none");
                constrain(&mut body, &chat.common);
            }
            None => constrain(&mut body, &chat.common),
            Some(CallsOut::Tagged(names) | CallsOut::Bare(names)) => {
                assert_eq!(names.len(), chat.tools.len());
                body["tool_choice"] = json!("auto");
                constrain(&mut body, &chat.common);
            }
            Some(CallsOut::Named(name)) => {
                body["tool_choice"] = json!({"type": "function", "function": {"name": name}});
            }
            Some(CallsOut::Listed) => {
                body["tool_choice"] = json!("required");
                // One call only where the list's schema says so.
                let one = matches!(
                    chat.common.sampling.json.as_deref().map(Schema::source),
                    Some(Source::Document(d)) if d.get("maxItems").is_some()
                );
                body["parallel_tool_calls"] = json!(!one);
            }
        }
        if let Some(top) = chat.common.sampling.logprobs {
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(top);
        }
        let again = ChatRequest::parse(body.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("{body} (from {chat:?}) does not parse again: {e:?}"));
        assert_eq!(format!("{chat:?}"), format!("{again:?}"));
    }
    if let Ok(completion) = CompletionRequest::parse(data) {
        check_common(&completion.common);
        check_recognizer(&completion.common, data);
        let mut body = common_body(&completion.common);
        constrain(&mut body, &completion.common);
        if let Some(top) = completion.common.sampling.logprobs {
            body["logprobs"] = json!(top);
        }
        if completion.echo {
            body["echo"] = json!(true);
        }
        let prompts: Vec<Value> = completion
            .prompts
            .iter()
            .map(|prompt| match prompt {
                Prompt::Text(text) => json!(text),
                Prompt::Tokens(ids) => json!(ids),
            })
            .collect();
        body["prompt"] = match <[Value; 1]>::try_from(prompts) {
            Ok([prompt]) => prompt,
            Err(batch) => json!(batch),
        };
        let again = CompletionRequest::parse(body.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("{body} (from {completion:?}) does not parse again: {e:?}"));
        assert_eq!(format!("{completion:?}"), format!("{again:?}"));
    }
}

/// Sets on `body` the constraint a parsed request's schema came from.
fn constrain(body: &mut Value, common: &Common) {
    let Some(schema) = common.sampling.json.as_deref() else {
        return;
    };
    match schema.source() {
        Source::Object => body["response_format"] = json!({"type": "json_object"}),
        Source::Document(document) => {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "s", "schema": document}})
        }
        Source::Choice(choices) => body["structured_outputs"] = json!({ "choice": choices }),
        Source::Regex(regex) => body["structured_outputs"] = json!({ "regex": regex }),
    }
}

/// A parsed schema's recognizer (JSON mode's included), fed the body's own
/// bytes in pieces: what `accepts` answers, `push` does, and nothing panics.
fn check_recognizer(common: &Common, data: &[u8]) {
    let Some(schema) = &common.sampling.json else {
        return;
    };
    let mut recognizer = Json::new(Arc::clone(schema));
    for piece in data.chunks(3) {
        let accepted = recognizer.accepts(piece);
        assert_eq!(accepted, recognizer.push(piece), "{piece:?}");
    }
}

/// The documented bounds of the shared parameters.
fn check_common(common: &Common) {
    let s = &common.sampling;
    assert!((0.0..=2.0).contains(&s.temperature), "{common:?}");
    assert!(s.top_p > 0.0 && s.top_p <= 1.0, "{common:?}");
    assert!(s.top_k as u64 <= TOP_K_LIMIT, "{common:?}");
    assert!((0.0..=1.0).contains(&s.min_p), "{common:?}");
    assert!(
        s.repetition_penalty > 0.0 && s.repetition_penalty <= REPETITION_PENALTY_MAX,
        "{common:?}"
    );
    for penalty in [s.presence_penalty, s.frequency_penalty] {
        assert!(penalty.abs() <= PENALTY_LIMIT, "{common:?}");
    }
    assert!(s.logit_bias.len() <= LOGIT_BIAS_MAX, "{common:?}");
    assert!(
        s.logprobs.is_none_or(|top| top <= TOP_LOGPROBS_MAX),
        "{common:?}"
    );
    assert!(
        s.logit_bias.windows(2).all(|w| w[0].0 < w[1].0),
        "ids sorted, each once: {common:?}"
    );
    assert!(
        s.logit_bias
            .iter()
            .all(|&(_, bias)| bias.abs() <= LOGIT_BIAS_LIMIT),
        "{common:?}"
    );
    assert!(s.stop_token_ids.len() <= STOP_TOKEN_IDS_MAX, "{common:?}");
    assert!(
        s.stop_token_ids.windows(2).all(|w| w[0] < w[1]),
        "ids sorted, each once: {common:?}"
    );
    assert!(
        common.max_tokens.is_none_or(|max| s.min_tokens <= max),
        "{common:?}"
    );
    assert!(!(s.json.is_some() && s.min_tokens > 0), "{common:?}");
    assert!((1..=CHOICES_MAX).contains(&common.n), "{common:?}");
    assert!(common.stop.len() <= STOPS_MAX, "{common:?}");
    assert!(
        common
            .stop
            .iter()
            .all(|stop| !stop.is_empty() && stop.len() <= STOP_BYTES_MAX),
        "{common:?}"
    );
    assert!(
        common
            .cache_salt
            .as_ref()
            .is_none_or(|salt| !salt.is_empty() && salt.len() <= CACHE_SALT_BYTES_MAX),
        "{common:?}"
    );
}

/// The shared parameters as a client would send them.
fn common_body(common: &Common) -> Value {
    let mut body = json!({
        "model": common.model,
        "temperature": common.sampling.temperature,
        "top_p": common.sampling.top_p,
        "top_k": common.sampling.top_k,
        "seed": common.sampling.seed,
        "min_p": common.sampling.min_p,
        "repetition_penalty": common.sampling.repetition_penalty,
        "ignore_eos": common.sampling.ignore_eos,
        "stop_token_ids": common.sampling.stop_token_ids,
        "min_tokens": common.sampling.min_tokens,
        "presence_penalty": common.sampling.presence_penalty,
        "frequency_penalty": common.sampling.frequency_penalty,
        "logit_bias": common
            .sampling
            .logit_bias
            .iter()
            .map(|(id, bias)| (id.to_string(), json!(bias)))
            .collect::<serde_json::Map<_, _>>(),
        "stop": common.stop,
        "n": common.n,
        "stream": common.stream,
        "stream_options": {"include_usage": common.include_usage},
    });
    if let Some(max_tokens) = common.max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    if let Some(salt) = &common.cache_salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

// ---------------------------------------------------------------------------
// Admin and self-service bodies and query strings.

/// What the first byte of an admin input chooses: the JSON body (decoded with
/// `serde_json::from_slice`, as `admin::json_body` does) or the query string
/// (decoded by axum's `Query`, as the handlers' extractors do) of one route.
const ADMIN_KINDS: u8 = 9;

/// Parses the rest of the input as the body or query the first byte picks
/// (see `ADMIN_KINDS`), then checks what the handler would do with it.
pub fn admin(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    match kind % ADMIN_KINDS {
        0 => {
            if let Some(new) = json_body::<CreateTenant>(rest) {
                check_create_tenant(&new);
            }
        }
        1 => {
            if let Some(patch) = json_body::<TenantPatch>(rest) {
                check_access(patch.models.as_ref());
            }
        }
        2 => {
            if let Some(canaries) = json_body::<Canaries>(rest) {
                check_canaries(&canaries.canaries);
            }
        }
        3 => {
            if let Some(spec) = json_body::<ModelSpec>(rest) {
                check_model_spec(&spec);
            }
        }
        4 => {
            if let Some(q) = query::<UsageQuery>(rest) {
                if let Ok((from, to)) = q.window() {
                    assert!(from < to, "a window is ordered");
                }
            }
        }
        5 => {
            let _ = query::<AuditQuery>(rest);
        }
        6 => {
            let _ = query::<RemoveQuery>(rest);
        }
        7 => {
            if let Some(options) = query::<UploadOptions>(rest) {
                check_upload_options(&options);
            }
        }
        _ => {
            let _ = query::<crate::api::tenant::UsageQuery>(rest);
        }
    }
}

/// `T` from a JSON body, as the admin handlers read one.
fn json_body<T: DeserializeOwned>(body: &[u8]) -> Option<T> {
    serde_json::from_slice(body).ok()
}

/// `T` from a query string, as axum's `Query` extractor reads one.
fn query<T: DeserializeOwned>(text: &[u8]) -> Option<T> {
    let text = std::str::from_utf8(text).ok()?;
    let uri: axum::http::Uri = format!("/admin/v1/x?{text}").parse().ok()?;
    axum::extract::Query::<T>::try_from_uri(&uri)
        .ok()
        .map(|axum::extract::Query(q)| q)
}

fn check_create_tenant(new: &CreateTenant) {
    let _ = valid_name(&new.name);
    let quota = Quota {
        weight: new.weight,
        pages_reserved: new.pages_reserved,
        pages_max: new.pages_max,
        queue_depth_max: new.queue_depth_max,
        running_max: new.running_max,
        pending_max: new.pending_max,
        prefix_cache: new.prefix_cache,
    };
    let _ = quota.validate();
    check_access(Some(&new.models));
}

/// An access list read from JSON is what it says: written back and read
/// again it is the same list, and `*` alone means every model.
fn check_access(access: Option<&ModelAccess>) {
    let Some(access) = access else {
        return;
    };
    let again: ModelAccess =
        serde_json::from_value(json!(access)).expect("an access list written back reads again");
    assert_eq!(&again, access);
    match access {
        ModelAccess::All => assert!(access.allows("any-model")),
        ModelAccess::Only(ids) => assert_eq!(access.ids().count(), ids.len()),
    }
}

/// A valid canary list, registered for one tenant, is caught in another
/// tenant's text however the text is cut into pieces, and never in the
/// tenant's own.
fn check_canaries(canaries: &[String]) {
    if canary::validate(canaries).is_err() || canaries.is_empty() {
        return;
    }
    let owner = tenant_record(1, canaries.to_vec());
    let guard = Arc::new(CanaryGuard::build(&[owner]).expect("a valid canary list builds a guard"));
    let canary = &canaries[canaries.len() - 1];
    let text = format!("Sure. {canary} is the answer.");
    // Cut the text inside the canary, on a character boundary.
    let mut cut = 6 + canary.len() / 2;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let pieces = [&text[..cut], &text[cut..]];
    let scan = |reader: u32| -> Result<String, Hit> {
        let mut scanner = guard.scanner(TenantId(reader));
        let mut sent = String::new();
        for piece in pieces {
            sent.push_str(&scanner.push(piece)?);
        }
        sent.push_str(&scanner.finish()?);
        Ok(sent)
    };
    assert_eq!(
        scan(2),
        Err(Hit { owner: TenantId(1) }),
        "{canary:?} was let through"
    );
    assert_eq!(
        scan(1).as_deref(),
        Ok(text.as_str()),
        "the owner's own text changed"
    );
}

fn tenant_record(id: u32, canaries: Vec<String>) -> TenantRecord {
    template(json!({
        "id": id, "name": format!("t{id}"),
        "quota": {
            "weight": 1, "pages_reserved": 1, "pages_max": 1, "queue_depth_max": 1,
            "running_max": 1, "pending_max": 1, "prefix_cache": true,
        },
        "canaries": canaries, "created_ms": 0, "updated_ms": 0,
    }))
}

/// A model body validates without panicking, and written back it reads as
/// the same spec (what the store keeps of an added model).
fn check_model_spec(spec: &ModelSpec) {
    let _ = spec.validate(|field| field.to_string());
    let again: ModelSpec =
        serde_json::from_value(json!(spec)).expect("a spec written back reads again");
    assert_eq!(&again, spec);
}

/// Limits a plugin asks for at upload are never more than the deployment's.
fn check_upload_options(options: &UploadOptions) {
    let deployment = CallLimits::of(&PluginsConfig::default());
    let asked = PluginLimitsRequest {
        deadline_ms: options.deadline_ms,
        fuel: options.fuel,
        memory_bytes: options.memory_bytes,
    };
    if let Ok(lowered) = deployment.lowered(&asked) {
        assert!(lowered.deadline <= deployment.deadline, "{lowered:?}");
        assert!(lowered.fuel <= deployment.fuel, "{lowered:?}");
        assert!(
            lowered.memory_bytes <= deployment.memory_bytes,
            "{lowered:?}"
        );
        assert!(lowered.deadline.as_millis() > 0 && lowered.fuel > 0 && lowered.memory_bytes > 0);
    }
}

// ---------------------------------------------------------------------------
// Plugin uploads.

/// The plugin runtime an upload compiles with: the default `[plugins]`
/// configuration over an in-memory store, built once per process.
fn policy_runtime() -> &'static PolicyRuntime {
    static RUNTIME: OnceLock<Arc<PolicyRuntime>> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let config = Config::parse("").expect("the default policy is valid");
        let store = Store::with_storage(Box::<MemoryStorage>::default(), "memory".into())
            .expect("an empty store opens");
        // The sealing secret is read into memory when the runtime is built;
        // its file is not needed afterwards.
        let dir = std::env::temp_dir().join(format!("bulkhead-fuzz-upload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary folder");
        let runtime =
            PolicyRuntime::new(&config, Arc::new(store), &dir).expect("the plugin runtime starts");
        let _ = std::fs::remove_dir_all(&dir);
        runtime
    })
}

/// Compiles arbitrary bytes as an uploaded plugin, with the checks an upload
/// runs before it stores anything (`PolicyRuntime::compile`: the shape check,
/// the compilation, the world's imports and exports; an upload runs the same
/// through `compile_bounded`, which adds a thread and a timeout, and a slow
/// input is libFuzzer's `-timeout` finding here). For the tenant world, and
/// for the operator world when the tenant world refuses them. What compiles
/// must seal; its sealed form must open again for its own source without a
/// second compilation, never for another source, and never with one byte
/// changed (it is compiled again from the source instead).
pub fn upload(data: &[u8]) {
    let runtime = policy_runtime();
    let Ok(component) = runtime.compile(data, false) else {
        let _ = runtime.compile(data, true);
        return;
    };
    let sealed = runtime
        .seal(&component, data)
        .expect("a compiled component seals");
    let (_, resealed) = runtime
        .load(Some(&sealed), data)
        .expect("a component that compiled loads");
    assert!(
        resealed.is_none(),
        "an intact sealed form was compiled again"
    );
    // Another source: the sealed form does not open, and the empty source
    // does not compile.
    assert!(
        runtime.load(Some(&sealed), &[]).is_err(),
        "a sealed form opened for another source"
    );
    let mut tampered = sealed;
    let at =
        (tampered.len() / 2 + usize::from(data.first().copied().unwrap_or(0))) % tampered.len();
    tampered[at] ^= 0x01;
    let (_, resealed) = runtime
        .load(Some(&tampered), data)
        .expect("a component that compiled loads from its source");
    assert!(
        resealed.is_some(),
        "a sealed form with byte {at} changed was opened"
    );
}

// ---------------------------------------------------------------------------
// The policy file.

/// Parses arbitrary bytes as a policy file; a policy that parses passes each
/// of its parts' own checks (what the admin API and the store check again).
pub fn policy_toml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::parse(text) else {
        return;
    };
    for spec in config.model_specs() {
        spec.validate(|field| field.to_string())
            .unwrap_or_else(|e| panic!("a policy's model fails the admin API's checks: {e}"));
        check_model_spec(&spec);
    }
    for (name, tenant) in &config.tenants {
        assert!(valid_name(name), "tenant name {name:?} accepted");
        tenant
            .quota()
            .validate()
            .unwrap_or_else(|e| panic!("tenant {name:?}: {e:?}"));
        check_access(Some(&tenant.models));
    }
    let _ = CallLimits::of(&config.plugins);
    let _ = format!("{config:?}");
}

// ---------------------------------------------------------------------------
// Store records.

/// Ordered keys in memory: the store's storage trait, for the fuzzer. Its
/// clones share their entries, so a caller can write through a [`Store`] and
/// then corrupt what it wrote behind the store's back.
#[derive(Clone, Default)]
pub struct MemoryStorage {
    entries: Arc<Mutex<BTreeMap<Vec<u8>, Vec<u8>>>>,
}

impl MemoryStorage {
    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<u8>, Vec<u8>>> {
        // A panic while holding the lock is the fuzzer's finding; the map
        // itself is never left half-written.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Storage for MemoryStorage {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.entries().get(key).cloned())
    }

    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        Ok(self
            .entries()
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .filter(|(key, _)| after.is_none_or(|after| key.as_slice() > after))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        Ok(self
            .entries()
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .last()
            .map(|(k, v)| (k.clone(), v.clone())))
    }

    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError> {
        let mut entries = self.entries();
        if expect
            .iter()
            .any(|e| entries.get(&e.key) != e.value.as_ref())
        {
            return Err(StoreError::Conflict);
        }
        for write in writes {
            match write {
                Write::Put { key, value } => {
                    entries.insert(key, value);
                }
                Write::Delete { key } => {
                    entries.remove(&key);
                }
            }
        }
        Ok(())
    }
}

/// The record kinds of `store/records.rs`, each with where the store keeps
/// one and how it reads it back.
const RECORD_KINDS: u8 = 10;

/// Decodes arbitrary bytes as the stored value of the record kind the first
/// byte picks (`RECORD_KINDS`), through the store's own read path; a
/// record that decodes, written back by the store, decodes to itself.
///
/// The key each kind lives under is learnt by writing a template record
/// through the store (the key layout is private to the store); the fuzzed
/// bytes then replace its value behind the store's back.
pub fn store_records(data: &[u8]) {
    let Some((&kind, value)) = data.split_first() else {
        return;
    };
    match kind % RECORD_KINDS {
        0 => round_trip(value, meta_template(), Batch::put_meta, |s| s.meta()),
        1 => round_trip(
            value,
            7u32,
            |b, next| b.put_tenant_id_next(*next),
            |s| s.tenant_id_next().map(Some),
        ),
        2 => round_trip(
            value,
            "ab".repeat(32),
            |b, digest| b.put_admin_token(digest),
            |s| s.admin_token(),
        ),
        3 => round_trip(
            value,
            tenant_record(3, Vec::new()),
            Batch::put_tenant,
            |s| s.tenants().map(|t| t.into_iter().next()),
        ),
        4 => round_trip(value, model_template(), Batch::put_model, |s| {
            s.models().map(|m| m.into_iter().next())
        }),
        5 => round_trip(value, key_template(), Batch::put_key, |s| {
            s.keys().map(|k| k.into_iter().next())
        }),
        6 => round_trip(value, plugin_template(), Batch::put_plugin, |s| {
            s.plugins(4).map(|p| p.into_iter().next())
        }),
        7 => round_trip(
            value,
            PluginStateRecord {
                value_hex: "00".into(),
                expires_ms: None,
            },
            |b, r| b.put_plugin_state(4, "p", "k", r),
            |s| s.plugin_state(4, "p", "k"),
        ),
        8 => usage_round_trip(value),
        _ => audit_round_trip(value),
    }
}

fn meta_template() -> Meta {
    template(json!({"created_ms": 1, "seeded_from": "policy.toml"}))
}

fn model_template() -> ModelRecord {
    template(json!({
        "spec": {"id": "m", "path": "/m.gguf", "context_tokens": 64},
        "added_ms": 1,
    }))
}

fn key_template() -> KeyRecord {
    template(json!({
        "id": "key_1", "tenant": 3, "sha256": "ab".repeat(32), "prefix": "bk-t3-ab",
        "source": "issued", "created_ms": 1, "revoked_ms": null,
    }))
}

fn plugin_template() -> PluginRecord {
    template(json!({
        "tenant": 4, "name": "p", "version": 1, "sha256": "ab".repeat(32),
        "size_bytes": 1, "enabled": true, "uploaded_ms": 1,
    }))
}

/// A record from its JSON, so that fields added later with a default need
/// no change here.
fn template<T: DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("a template record")
}

/// A store over shared memory, with `template` written by `put` and the
/// value of every key that write created replaced by `value`.
fn corrupted_store<T>(
    value: &[u8],
    template: &T,
    put: impl for<'b> Fn(&'b mut Batch, &T) -> &'b mut Batch,
) -> Option<Store> {
    let storage = MemoryStorage::default();
    let store = Store::with_storage(Box::new(storage.clone()), "memory".into()).ok()?;
    let mut batch = Batch::default();
    put(&mut batch, template);
    store.commit(batch).expect("memory commits");
    let keys: Vec<Vec<u8>> = storage.entries().keys().cloned().collect();
    {
        let mut entries = storage.entries();
        for key in keys {
            entries.insert(key, value.to_vec());
        }
    }
    // The store reads its cursors and its format record when it opens:
    // opening again is what a restart over these bytes does.
    Store::with_storage(Box::new(storage), "memory".into()).ok()
}

/// `value` under `template`'s keys, read back with `get`; what decodes is
/// written back by `put` into a fresh store and must read back the same.
fn round_trip<T: PartialEq + Debug>(
    value: &[u8],
    template: T,
    put: impl for<'b> Fn(&'b mut Batch, &T) -> &'b mut Batch,
    get: impl Fn(&Store) -> Result<Option<T>, StoreError>,
) {
    let Some(store) = corrupted_store(value, &template, &put) else {
        return;
    };
    let Ok(Some(record)) = get(&store) else {
        return;
    };
    let fresh = Store::with_storage(Box::<MemoryStorage>::default(), "memory".into())
        .expect("an empty store opens");
    let mut batch = Batch::default();
    put(&mut batch, &record);
    fresh.commit(batch).expect("memory commits");
    let again = get(&fresh).expect("a record the store wrote reads back");
    assert_eq!(
        again.as_ref(),
        Some(&record),
        "a decoded record did not survive a rewrite"
    );
}

/// A usage minute decodes, and the store's next flush adds to it (what
/// `UsageBook::flush` does with the record it reads back).
fn usage_round_trip(value: &[u8]) {
    let template = UsageRecord::default();
    fn put<'b>(batch: &'b mut Batch, record: &UsageRecord) -> &'b mut Batch {
        batch.put_usage(4, 9, record)
    }
    let Some(store) = corrupted_store(value, &template, put) else {
        return;
    };
    let Ok(minutes) = store.usage(4, 0, u64::MAX) else {
        return;
    };
    let Some((minute, mut record)) = minutes.into_iter().next() else {
        return;
    };
    assert_eq!(minute, 9);
    let fresh = Store::with_storage(Box::<MemoryStorage>::default(), "memory".into())
        .expect("an empty store opens");
    let mut batch = Batch::default();
    batch.put_usage(4, 9, &record);
    fresh.commit(batch).expect("memory commits");
    assert_eq!(fresh.usage_minute(4, 9).expect("reads back"), record);
    let delta = UsageRecord {
        requests: 1,
        prompt_tokens: 1,
        completion_tokens: 1,
        outcomes: BTreeMap::from([("stop".to_string(), 1)]),
    };
    record.add(&delta);
}

/// An audit record decodes; written back it is the same but for the
/// sequence number the commit gives it.
fn audit_round_trip(value: &[u8]) {
    let template = AuditRecord {
        seq: 0,
        at_ms: 1,
        actor: "admin".into(),
        action: "tenant.create".into(),
        target: "t".into(),
        detail: BTreeMap::new(),
    };
    fn put<'b>(batch: &'b mut Batch, record: &AuditRecord) -> &'b mut Batch {
        batch.audit(record.clone())
    }
    let Some(store) = corrupted_store(value, &template, put) else {
        return;
    };
    let Ok(records) = store.audit(0, 10) else {
        return;
    };
    let Some(record) = records.into_iter().next() else {
        return;
    };
    let fresh = Store::with_storage(Box::<MemoryStorage>::default(), "memory".into())
        .expect("an empty store opens");
    let mut batch = Batch::default();
    batch.audit(record.clone());
    fresh.commit(batch).expect("memory commits");
    let again = fresh.audit(0, 10).expect("reads back");
    assert_eq!(again.len(), 1);
    assert_eq!(
        AuditRecord {
            seq: record.seq,
            ..again[0].clone()
        },
        record
    );
}

// ---------------------------------------------------------------------------
// Seeds.

/// Seeds of the OpenAI corpus: real bodies of both endpoints.
pub fn openai_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let bodies = [
        (
            "seed-chat-minimal.json",
            r#"{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"Name three primary colors."}],"max_tokens":32,"temperature":0}"#,
        ),
        (
            "seed-chat-stream.json",
            r#"{"model":"smollm2-135m-instruct","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi!"},{"type":"text","text":"Again"}]},{"role":"assistant","content":null}],"stream":true,"stream_options":{"include_usage":true},"top_p":0.9,"top_k":40,"seed":-3,"stop":["\n","END"],"cache_salt":"user-17","n":1,"logprobs":false,"user":"u","tools":[],"response_format":{"type":"text"}}"#,
        ),
        (
            "seed-completion-text.json",
            r#"{"model":"smollm2-135m-instruct","prompt":"Once upon a time","max_tokens":16,"stop":"."}"#,
        ),
        (
            "seed-completion-tokens.json",
            r#"{"model":"m","prompt":[1,2,3,49151],"max_completion_tokens":4294967296,"echo":false,"best_of":1,"suffix":"","logprobs":0}"#,
        ),
        (
            "seed-completion-echo.json",
            r#"{"model":"m","prompt":[[504,3575,282,4649,314,7042]],"temperature":0,"max_tokens":0,"logprobs":1,"seed":1234,"echo":true}"#,
        ),
        (
            "seed-completion-array.json",
            r#"{"model":"m","prompt":["one prompt"],"temperature":2,"presence_penalty":0,"frequency_penalty":0.0,"logit_bias":{}}"#,
        ),
        (
            "seed-chat-json-schema.json",
            r##"{"model":"m","messages":[{"role":"user","content":"A cat?"}],"response_format":{"type":"json_schema","json_schema":{"name":"Cat","strict":true,"schema":{"$defs":{"Owner":{"properties":{"name":{"type":"string","maxLength":12}},"required":["name"],"type":"object","additionalProperties":false}},"properties":{"name":{"type":"string","minLength":1,"maxLength":20},"age":{"type":"integer"},"color":{"enum":["black","white",12,null]},"toys":{"items":{"type":"string"},"maxItems":3,"type":"array"},"owner":{"anyOf":[{"$ref":"#/$defs/Owner"},{"type":"null"}]},"tags":{"type":"object","additionalProperties":{"type":["number","boolean"]}},"any":{}},"required":["name","age","color"],"title":"Cat","type":"object"}}}}"##,
        ),
        (
            "seed-chat-choice.json",
            r#"{"model":"m","messages":[{"role":"user","content":"Sentiment?"}],"structured_outputs":{"choice":["positive","negative","pos"]}}"#,
        ),
        (
            "seed-completion-guided-json.json",
            r#"{"model":"m","prompt":"x","guided_json":"{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"maxItems\":2}"}"#,
        ),
        (
            "seed-completion-json-object.json",
            r#"{"model":"m","prompt":"{"a": [1, "x", {"b": null}]}","response_format":{"type":"json_object"}}"#,
        ),
        (
            "seed-chat-tools-required.json",
            r##"{"model":"m","messages":[{"role":"user","content":"Weather in Oslo?"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\",\"n\":[1,{}]}"}}]},{"role":"tool","tool_call_id":"call_1","content":"rain"}],"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather <|im_end|>","parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":24},"unit":{"enum":["c","f"]},"at":{"$ref":"#/$defs/P"}},"required":["city"],"$defs":{"P":{"type":"object","properties":{"x":{"type":"integer"}}}}},"strict":true}},{"type":"function","function":{"name":"now"}}],"tool_choice":"required","parallel_tool_calls":false}"##,
        ),
        (
            "seed-chat-tools-named.json",
            r#"{"model":"m","messages":[{"role":"user","content":"Time?"}],"tools":[{"type":"function","function":{"name":"now","parameters":{"type":"object","properties":{"zone":{"type":"string"}}}}}],"tool_choice":{"type":"function","function":{"name":"now"}}}"#,
        ),
        (
            "seed-completion-vllm.json",
            r#"{"model":"m","prompt":"Hi","max_tokens":8,"top_k":5,"min_p":0.1,"repetition_penalty":1.2,"ignore_eos":false,"stop_token_ids":[2,0,2],"min_tokens":3}"#,
        ),
        (
            "seed-chat-discriminated.json",
            r##"{"model":"m","messages":[{"role":"user","content":"A pet?"}],"response_format":{"type":"json_schema","json_schema":{"name":"Owner","strict":true,"schema":{"$defs":{"Cat":{"properties":{"pet_type":{"const":"cat","type":"string"},"meows":{"type":"integer"}},"required":["pet_type","meows"],"type":"object","additionalProperties":false},"Dog":{"properties":{"pet_type":{"const":"dog","type":"string"},"barks":{"type":"number"}},"required":["pet_type","barks"],"type":"object","additionalProperties":false}},"properties":{"pet":{"discriminator":{"mapping":{"cat":"#/$defs/Cat","dog":"#/$defs/Dog"},"propertyName":"pet_type"},"oneOf":[{"$ref":"#/$defs/Cat"},{"$ref":"#/$defs/Dog"}]},"v":{"anyOf":[{"type":"object","properties":{"v":{"const":1}},"required":["v"]},{"type":"object","properties":{"v":{"const":12},"w":{}},"required":["v"]}]}},"required":["pet"],"type":"object"}}}}"##,
        ),
        (
            "seed-chat-decimal.json",
            r##"{"model":"m","messages":[{"role":"user","content":"A price?"}],"response_format":{"type":"json_schema","json_schema":{"name":"Price","schema":{"$defs":{"S":{"type":"string","pattern":"^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$"}},"properties":{"price":{"anyOf":[{"type":"number"},{"$ref":"#/$defs/S"}]},"amount":{"anyOf":[{"type":"number"},{"pattern":"^(?!^[-+.]*$)[+-]?0*(?:\\d{0,4}|(?=[\\d.]{1,7}0*$)\\d{0,4}\\.\\d{0,2}0*$)","type":"string"}]}},"required":["price","amount"],"type":"object","additionalProperties":false}}}}"##,
        ),
    ];
    let mut seeds: Vec<(&str, Vec<u8>)> = bodies
        .into_iter()
        .map(|(name, body)| (name, body.as_bytes().to_vec()))
        .collect();
    // More tools than could be read side by side, `required`: the calls
    // told apart by their names, some of which begin alike.
    let tools: Vec<Value> = (0..24)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("f{i}"), "parameters":
                {"type": "object", "properties": {format!("p{i}"): {"type": "integer"}},
                 "required": [format!("p{i}")]}}})
        })
        .collect();
    let many = json!({"model": "m", "messages": [{"role": "user", "content": "Call."}],
                      "tools": tools, "tool_choice": "required"});
    seeds.push(("seed-chat-tools-many.json", many.to_string().into_bytes()));
    seeds
}

/// Seeds of the admin corpus: a kind byte (see `ADMIN_KINDS`), then a body
/// or query string from the README's examples.
pub fn admin_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let inputs: [(&str, u8, &str); 10] = [
        (
            "seed-create-tenant.json",
            0,
            r#"{"name":"gamma","weight":2,"pages_reserved":64,"pages_max":256,"models":["smollm2-135m-instruct"],"prefix_cache":false}"#,
        ),
        (
            "seed-patch-tenant.json",
            1,
            r#"{"pages_max":512,"models":["*"],"pending_max":4}"#,
        ),
        (
            "seed-canaries.json",
            2,
            r#"{"canaries":["zebra-alpha-7f3e","ünïcode-canary-42"]}"#,
        ),
        (
            "seed-add-model.json",
            3,
            r#"{"id":"tiny","path":"/models/tiny.gguf","context_tokens":2048,"threads":2,"pool_pages":256,"kv_type":"f32"}"#,
        ),
        (
            "seed-usage-query",
            4,
            "tenant=alpha&from_ms=0&to_ms=1700000000000",
        ),
        ("seed-audit-query", 5, "after=10&limit=100"),
        ("seed-remove-query", 6, "drain_ms=5000"),
        (
            "seed-upload-query",
            7,
            "order=2&deadline_ms=20&fuel=1000000&memory_bytes=1048576",
        ),
        ("seed-tenant-usage-query", 8, "from_ms=1&to_ms=2"),
        ("seed-usage-by-id", 4, "tenant_id=3"),
    ];
    inputs
        .into_iter()
        .map(|(name, kind, text)| (name, [&[kind][..], text.as_bytes()].concat()))
        .collect()
}

/// Seeds of the policy corpus: the demo policy and a small one with every
/// section.
pub fn policy_toml_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let demo = include_str!("../../policies/demo.toml");
    let small = r#"
[server]
listen = "0.0.0.0:9000"
canary_guard = true
[store]
path = "state"
[engine]
memory_max = "1 GiB"
[[models]]
id = "m"
path = "m.gguf"
context_tokens = 512
kv_type = "f32"
[plugins]
deadline_ms = 20
[tenants.a]
pages_reserved = 4
pages_max = 8
models = ["m"]
keys_sha256 = ["abababababababababababababababababababababababababababababababab"]
[tenants.b]
weight = 3
pages_reserved = 0
pages_max = 4
key_env = "KEY_B"
"#;
    vec![
        ("seed-demo.toml", demo.as_bytes().to_vec()),
        ("seed-small.toml", small.as_bytes().to_vec()),
    ]
}

/// Seeds of the store corpus: a kind byte (see `RECORD_KINDS`) and the
/// value the store itself writes for a record of that kind.
pub fn store_records_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut seeds = Vec::new();
    let mut seed = |name: &'static str, kind: u8, write: &dyn Fn(&mut Batch)| {
        let storage = MemoryStorage::default();
        let store = Store::with_storage(Box::new(storage.clone()), "memory".into())
            .expect("an empty store opens");
        let mut batch = Batch::default();
        write(&mut batch);
        store.commit(batch).expect("memory commits");
        let value = storage
            .entries()
            .values()
            .next()
            .cloned()
            .expect("one record written");
        seeds.push((name, [&[kind][..], &value].concat()));
    };
    seed("seed-meta", 0, &|b| {
        b.put_meta(&meta_template());
    });
    seed("seed-tenant-id-next", 1, &|b| {
        b.put_tenant_id_next(7);
    });
    seed("seed-admin-token", 2, &|b| {
        b.put_admin_token(&"ab".repeat(32));
    });
    let mut tenant = tenant_record(3, vec!["zebra-alpha-7f3e".into()]);
    tenant.models = ModelAccess::Only(["m".to_string()].into());
    seed("seed-tenant", 3, &|b| {
        b.put_tenant(&tenant);
    });
    seed("seed-model", 4, &|b| {
        b.put_model(&model_template());
    });
    let mut key = key_template();
    key.source = KeySource::Env { var: "KEY".into() };
    key.revoked_ms = Some(5);
    seed("seed-key", 5, &|b| {
        b.put_key(&key);
    });
    seed("seed-plugin", 6, &|b| {
        b.put_plugin(&plugin_template());
    });
    seed("seed-plugin-state", 7, &|b| {
        b.put_plugin_state(
            4,
            "p",
            "k",
            &PluginStateRecord {
                value_hex: "00ff".into(),
                expires_ms: Some(9),
            },
        );
    });
    let usage = UsageRecord {
        requests: 2,
        prompt_tokens: 30,
        completion_tokens: 12,
        outcomes: BTreeMap::from([("stop".to_string(), 1), ("queue_full".to_string(), 1)]),
    };
    seed("seed-usage", 8, &|b| {
        b.put_usage(4, 9, &usage);
    });
    seed("seed-audit", 9, &|b| {
        b.audit(AuditRecord {
            seq: 0,
            at_ms: 1,
            actor: "tenant:alpha".into(),
            action: "key.issue".into(),
            target: "key_1".into(),
            detail: BTreeMap::from([("prompt_tokens".to_string(), json!(5))]),
        });
    });
    seeds
}

// ---------------------------------------------------------------------------
// Transfer frames (issue 23): what a prefill peer sends a decode process.

/// Decodes arbitrary bytes as a stream of transfer frames; each message
/// decoded encodes back to the same message; and the stream's header, pages
/// and trailer, taken as a transfer into a small pool, are imported or
/// refused, never a panic, with the pool back at its baseline afterwards.
/// The first byte's low bit makes the header's page shape and owner this
/// pool's (so the later checks are reached, not only the first).
pub fn transfer_frames(data: &[u8]) {
    use crate::transfer::wire::{decode_stream, Message};
    use bulkhead_kernels::kv::{OwnerTag, Received, ReceivedPage, SeqId};
    let Some((&flags, stream)) = data.split_first() else {
        return;
    };
    let Ok(messages) = decode_stream(stream) else {
        return;
    };
    for message in &messages {
        let bytes = message.encode();
        assert_eq!(
            Message::decode(bytes[4], &bytes[5..]).as_ref(),
            Ok(message),
            "{} encodes back",
            message.name()
        );
    }
    let mut header = None;
    let mut pages = Vec::new();
    let mut digest = None;
    for message in messages {
        match message {
            Message::Header(h) => header = Some(h),
            Message::Page {
                index,
                digest,
                bytes,
            } => pages.push((index, digest, bytes)),
            Message::Trailer(d) => digest = Some(d),
            _ => {}
        }
    }
    let (Some(mut header), Some(digest)) = (header, digest) else {
        return;
    };
    let owner = OwnerTag(1);
    let mut pool = transfer_pool();
    if flags & 1 == 1 {
        header.shape = pool.page_shape();
        header.identity.owner = owner;
    }
    let mut expect = header.identity;
    expect.owner = owner;
    let reserve = pool.page_shape().pages_for(expect.tokens).clamp(1, 8);
    let mut reservation = pool.reserve(owner, reserve).expect("within the partition");
    let mut table = pool.page_table(&reservation, SeqId(1));
    for _ in 0..reserve {
        pool.acquire(&mut reservation, &mut table).expect("booked");
    }
    pool.release_reservation(reservation);
    let import = pool.begin_import(table, expect);
    // Hashed as the link hashes them, for the header as it now stands.
    let pages = pages
        .into_iter()
        .map(|(index, digest, bytes)| ReceivedPage::arrived(&header, index, digest, bytes))
        .collect();
    let received = Received {
        header,
        pages,
        digest,
    };
    let mut table = match pool.import(import, &received) {
        Ok(table) => table,
        Err(refused) => refused.table,
    };
    pool.release(&mut table);
    pool.scrub_released();
    pool.check_invariants()
        .expect("the pool is back at its baseline");
    assert_eq!(pool.stats().pages_free, 16);
}

/// The transfer targets' pool: 16 pages of 4 tokens, one owner (1),
/// poisoned and paranoid.
fn transfer_pool() -> bulkhead_kernels::kv::Pool {
    use bulkhead_kernels::kv::{OwnerTag, PartitionConfig, Pool, PoolGeometry, PoolOptions};
    let geometry = PoolGeometry {
        pages_count: 16,
        page_tokens: 4,
        layers: 2,
        kv_heads: 1,
        head_dim: 4,
        kv_type: bulkhead_kernels::kv::KvType::F16,
    };
    let partition = PartitionConfig {
        owner: OwnerTag(1),
        pages_reserved: 8,
        pages_max: 16,
    };
    let options = PoolOptions {
        poison_released: true,
        paranoid: true,
    };
    Pool::new(geometry, &[partition], options).expect("a valid pool")
}

/// Seed streams for [`transfer_frames`]: a real sender's transfer into the
/// target's pool shape (imports), and the same with a byte flipped.
pub fn transfer_frames_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::transfer::wire::Message;
    use bulkhead_kernels::kv::{
        page_digest, tokens_digest, transfer_digest, OwnerTag, SeqId, TransferIdentity,
    };
    let mut pool = transfer_pool();
    let mut reservation = pool.reserve(OwnerTag(1), 2).expect("fits");
    let mut table = pool.page_table(&reservation, SeqId(9));
    for _ in 0..2 {
        pool.acquire(&mut reservation, &mut table).expect("booked");
    }
    pool.release_reservation(reservation);
    for t in 0..6u32 {
        let lease = table.lease((t / 4) as usize).expect("page");
        let k: Vec<f32> = (0..4).map(|i| (t * 4 + i) as f32 / 8.0).collect();
        for layer in 0..2 {
            pool.write_kv(lease, layer, t % 4, &k, &k).expect("owned");
        }
    }
    let tokens: Vec<u32> = (40..46).collect();
    let identity = TransferIdentity {
        request: 5,
        job: 6,
        owner: OwnerTag(1),
        model: 7,
        tokens: 6,
        tokens_digest: tokens_digest(&tokens),
    };
    let export = pool.export(&table, identity).expect("leased");
    let mut stream = vec![1u8];
    stream.extend(Message::Header(export.header).encode());
    let mut digests = Vec::new();
    for (i, bytes) in export.pages.iter().enumerate() {
        let digest = page_digest(export.tokens_in_page(i as u32), bytes);
        digests.push(digest);
        stream.extend(
            Message::Page {
                index: i as u32,
                digest,
                bytes: bytes.clone(),
            }
            .encode(),
        );
    }
    stream.extend(Message::Trailer(transfer_digest(&export.header, digests.into_iter())).encode());
    let mut flipped = stream.clone();
    let at = flipped.len() - 20;
    flipped[at] ^= 0x40;
    vec![
        ("seed-transfer", stream),
        ("seed-transfer-flipped", flipped),
    ]
}
