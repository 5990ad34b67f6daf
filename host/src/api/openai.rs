//! OpenAI-compatible request parsing and response shapes.
//!
//! 1. A body is parsed as a JSON object, then each known parameter is taken
//!    out and typed on its own, so a type error names its parameter.
//! 2. Parameters a client commonly sends with a harmless value
//!    (`logprobs: false`, `user`, ...) are accepted and ignored; the same
//!    parameters with a value this server cannot honour get a 400 naming them;
//!    anything else is an unknown parameter (400), as OpenAI answers.
//! 3. Responses and stream chunks are built here, in OpenAI's exact shape.

use super::error::ApiError;
use super::tools::{self, CallsOut, CallsWriter, ToolChoice};
use crate::engine::chat::{Message, Tool, ToolCall, MESSAGES_MAX};
use crate::engine::request::TokenLogprob;
use crate::engine::request::{FinishReason, Usage};
use crate::engine::sampling::{
    SamplingParams, LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX, PENALTY_LIMIT, REPETITION_PENALTY_MAX,
    STOP_TOKEN_IDS_MAX, TOP_LOGPROBS_MAX,
};
use crate::engine::schema::Schema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::Arc;

use crate::engine::stop::{STOPS_MAX, STOP_BYTES_MAX};
/// Longest `cache_salt` accepted, in bytes.
pub const CACHE_SALT_BYTES_MAX: usize = 256;
/// Largest `top_k` accepted.
pub const TOP_K_LIMIT: u64 = 1 << 16;
/// Generated tokens when the client names no `max_tokens` (or fewer, if the
/// context has less room left).
pub const MAX_TOKENS_DEFAULT: u32 = 1024;
/// Most choices (`n`) one request may ask for: each is a sequence of its
/// own, queued and run under the tenant's limits like a request.
pub const CHOICES_MAX: u32 = 16;
/// Most sequences one completions request may make: its prompts (a batch)
/// times `n`.
pub const SEQUENCES_MAX: u32 = 64;

/// Parameters shared by both endpoints.
#[derive(Clone, Debug)]
pub struct Common {
    /// The model the client named.
    pub model: String,
    /// `max_completion_tokens` or `max_tokens`, when given (clamped to u32).
    pub max_tokens: Option<u32>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Stream as SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Separates this request's prefix cache from the tenant's requests with
    /// another salt (or none): one tenant's users need not share a cache.
    pub cache_salt: Option<String>,
    /// Choices to generate (`n`), 1 to [`CHOICES_MAX`]: choice `i` samples
    /// with seed `seed + i`, as vLLM seeds them.
    pub n: u32,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// Shared parameters.
    pub common: Common,
    /// The conversation.
    pub messages: Vec<Message>,
    /// The functions the model is shown (`tools`).
    pub tools: Vec<Tool>,
    /// How the output becomes tool calls (`tool_choice` required or named).
    pub calls: Option<CallsOut>,
}

/// A completion prompt.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug)]
pub struct CompletionRequest {
    /// Shared parameters.
    pub common: Common,
    /// The prompts: one, or a batch (1 to [`SEQUENCES_MAX`] / `n`), each
    /// answered by `n` choices of its own.
    pub prompts: Vec<Prompt>,
    /// Whether the answer's text (and its `logprobs`, when asked for)
    /// begins with the prompt's: an evaluation harness's way to score a
    /// text, with `max_tokens` 0 to generate nothing.
    pub echo: bool,
}

/// A JSON object whose parameters are taken out one by one.
struct Fields(Map<String, Value>);

fn type_error(param: &str, error: serde_json::Error) -> ApiError {
    ApiError::InvalidType {
        param: param.to_string(),
        message: error.to_string(),
    }
}

pub(super) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidValue {
        param: param.to_string(),
        message: message.into(),
    }
}

pub(super) fn unsupported(param: &str, reason: &str) -> ApiError {
    ApiError::Unsupported {
        param: param.to_string(),
        reason: reason.to_string(),
    }
}

impl Fields {
    fn parse(body: &[u8]) -> Result<Fields, ApiError> {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(map)) => Ok(Fields(map)),
            Ok(_) => Err(ApiError::InvalidJson(
                "the body must be a JSON object".into(),
            )),
            Err(e) => Err(ApiError::InvalidJson(e.to_string())),
        }
    }

    /// Takes `name`; absent and `null` are `None`.
    fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v)
                .map(Some)
                .map_err(|e| type_error(name, e)),
        }
    }

    /// Removes a parameter that is accepted only with a harmless value.
    fn allow_if(&mut self, name: &str, harmless: impl Fn(&Value) -> bool) -> Result<(), ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if harmless(&v) => Ok(()),
            Some(_) => Err(unsupported(name, "is not supported by this server")),
        }
    }

    fn ignore(&mut self, name: &str) {
        self.0.remove(name);
    }

    /// Errors on whatever is left.
    fn finish(self) -> Result<(), ApiError> {
        match self.0.into_iter().next() {
            None => Ok(()),
            Some((name, _)) => Err(ApiError::UnknownParam(name)),
        }
    }
}

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// Parameters both endpoints share, plus the ones both ignore or refuse.
/// A seed for a request that gave none: from the system's randomness, or
/// (should that ever fail) the clock's nanoseconds.
fn fresh_seed() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    })
}

fn common(f: &mut Fields) -> Result<Common, ApiError> {
    let model: String = f
        .take("model")?
        .ok_or_else(|| ApiError::MissingParam("model".into()))?;
    let max_completion: Option<u64> = f.take("max_completion_tokens")?;
    let max_tokens: Option<u64> = f.take("max_tokens")?;
    // Huge values stay huge (u32::MAX) so admission answers context_length_exceeded.
    let max_tokens = max_completion
        .or(max_tokens)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    let temperature: f32 = f.take("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", "must be between 0 and 2"));
    }
    let top_p: f32 = f.take("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", "must be greater than 0 and at most 1"));
    }
    let top_k: u64 = f.take("top_k")?.unwrap_or(0);
    if top_k > TOP_K_LIMIT {
        return Err(invalid("top_k", format!("must be at most {TOP_K_LIMIT}")));
    }
    let seed = match f.take::<serde_json::Number>("seed")? {
        // A fresh seed per request, as OpenAI, vLLM and llama.cpp draw one: a
        // retry at a temperature above 0 is another sample, not a repeat.
        None => fresh_seed(),
        Some(n) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i as u64))
            .ok_or_else(|| invalid("seed", "must be an integer"))?,
    };
    let stop = match f.take::<Value>("stop")? {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(v) => serde_json::from_value::<Vec<String>>(v).map_err(|e| type_error("stop", e))?,
    };
    if stop.len() > STOPS_MAX {
        return Err(invalid(
            "stop",
            format!("at most {STOPS_MAX} stop sequences"),
        ));
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > STOP_BYTES_MAX)
    {
        return Err(invalid(
            "stop",
            format!("each stop sequence must have 1 to {STOP_BYTES_MAX} bytes"),
        ));
    }
    let stream: bool = f.take("stream")?.unwrap_or(false);
    let include_usage = match f.take::<Map<String, Value>>("stream_options")? {
        None => false,
        Some(options) => {
            let mut options = Fields(options);
            let include: Option<bool> = options.take("include_usage").map_err(|e| match e {
                ApiError::InvalidType { message, .. } => ApiError::InvalidType {
                    param: "stream_options.include_usage".into(),
                    message,
                },
                other => other,
            })?;
            options.ignore("include_obfuscation");
            options.finish().map_err(|e| match e {
                ApiError::UnknownParam(p) => ApiError::UnknownParam(format!("stream_options.{p}")),
                other => other,
            })?;
            include.unwrap_or(false)
        }
    };
    let cache_salt: Option<String> = f.take("cache_salt")?;
    if cache_salt
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.len() > CACHE_SALT_BYTES_MAX)
    {
        return Err(invalid(
            "cache_salt",
            format!("must have 1 to {CACHE_SALT_BYTES_MAX} bytes"),
        ));
    }
    let presence_penalty = penalty(f, "presence_penalty")?;
    let frequency_penalty = penalty(f, "frequency_penalty")?;
    let logit_bias = logit_bias(f)?;
    // vLLM's and llama.cpp's, beyond OpenAI's.
    let min_p: f32 = f.take("min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(invalid("min_p", "must be between 0 and 1"));
    }
    let repetition_penalty: f32 = f.take("repetition_penalty")?.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= REPETITION_PENALTY_MAX) {
        return Err(invalid(
            "repetition_penalty",
            format!("must be greater than 0 and at most {REPETITION_PENALTY_MAX}"),
        ));
    }
    let ignore_eos: bool = f.take("ignore_eos")?.unwrap_or(false);
    let mut stop_token_ids: Vec<u32> = f.take("stop_token_ids")?.unwrap_or_default();
    if stop_token_ids.len() > STOP_TOKEN_IDS_MAX {
        return Err(invalid(
            "stop_token_ids",
            format!("at most {STOP_TOKEN_IDS_MAX} token ids"),
        ));
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let min_tokens: u64 = f.take("min_tokens")?.unwrap_or(0);
    if max_tokens.is_some_and(|max| min_tokens > u64::from(max)) {
        return Err(invalid("min_tokens", "must be at most max_tokens"));
    }
    let min_tokens = u32::try_from(min_tokens).unwrap_or(u32::MAX);
    let n: u64 = f.take("n")?.unwrap_or(1);
    if !(1..=u64::from(CHOICES_MAX)).contains(&n) {
        return Err(invalid("n", format!("must be between 1 and {CHOICES_MAX}")));
    }
    for ignored in [
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
    ] {
        f.ignore(ignored);
    }
    Ok(Common {
        model,
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k: top_k as usize,
            top_p,
            seed,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            // Each endpoint's own parameters.
            logprobs: None,
            json: None,
            min_p,
            repetition_penalty,
            ignore_eos,
            stop_token_ids,
            min_tokens,
            prompt_logprobs: None,
        },
        stop,
        stream,
        include_usage,
        cache_salt,
        n: n as u32,
    })
}

/// `response_format`: JSON mode (`json_object`: any object) or structured
/// output (`json_schema`: `{name, schema, strict, description}`, the schema
/// compiled here, so a schema the engine could not enforce is a 400 before
/// anything is queued; enforced whether or not `strict` says so).
fn response_format(f: &mut Fields) -> Result<Option<Schema>, ApiError> {
    let Some(format) = f.take::<Value>("response_format")? else {
        return Ok(None);
    };
    let schema = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Schema::object(),
        Some("json_schema") => {
            let spec = format
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    invalid(
                        "response_format",
                        "json_schema must be an object with a name and a schema",
                    )
                })?;
            if let Some(key) = spec
                .keys()
                .find(|k| !["name", "schema", "strict", "description"].contains(&k.as_str()))
            {
                return Err(invalid(
                    "response_format",
                    format!("json_schema has an unknown field {key:?}"),
                ));
            }
            let name = spec.get("name").and_then(Value::as_str).unwrap_or("");
            let named = (1..=64).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !named {
                return Err(invalid(
                    "response_format",
                    "json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                ));
            }
            if spec
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(invalid(
                    "response_format",
                    "json_schema.strict must be a boolean",
                ));
            }
            let document = spec
                .get("schema")
                .ok_or_else(|| invalid("response_format", "json_schema.schema is required"))?;
            compile("response_format", "json_schema.schema", document)?
        }
        _ => {
            return Err(invalid(
                "response_format",
                "type must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    };
    Ok(Some(schema))
}

/// The output's constraint: `response_format` (OpenAI's), or vLLM's
/// `structured_outputs` (`json`: a schema, `choice`: one of these texts,
/// `regex`: a text it matches whole, `json_object: true`; the
/// `guided_json`, `guided_choice` and `guided_regex` fields that vLLM took
/// before 0.12 mean the same), at most one of them. Each ends the
/// output once its value is complete, which `min_tokens` would forbid: the
/// two together are refused.
fn constraint(f: &mut Fields, sampling: &SamplingParams) -> Result<Option<Arc<Schema>>, ApiError> {
    let mut found: Vec<(&str, Schema)> = Vec::new();
    if let Some(schema) = response_format(f)? {
        found.push(("response_format", schema));
    }
    if let Some(outputs) = f.take::<Map<String, Value>>("structured_outputs")? {
        const PARAM: &str = "structured_outputs";
        for (key, value) in &outputs {
            if value.is_null() || value == &Value::Bool(false) {
                continue;
            }
            let schema = match key.as_str() {
                "json" => json_of(PARAM, value)?,
                "choice" => choice_of(PARAM, value)?,
                "regex" => regex_of(PARAM, value)?,
                "json_object" if value == &Value::Bool(true) => Schema::object(),
                _ => {
                    return Err(unsupported(
                        PARAM,
                        &format!(
                            "{key:?} is not supported by this server (json, choice, regex and json_object are)"
                        ),
                    ))
                }
            };
            found.push((PARAM, schema));
        }
    }
    if let Some(value) = f.take::<Value>("guided_json")? {
        found.push(("guided_json", json_of("guided_json", &value)?));
    }
    if let Some(value) = f.take::<Value>("guided_choice")? {
        found.push(("guided_choice", choice_of("guided_choice", &value)?));
    }
    if let Some(value) = f.take::<Value>("guided_regex")? {
        found.push(("guided_regex", regex_of("guided_regex", &value)?));
    }
    let schema = match found.len() {
        0 => return Ok(None),
        1 => found.pop().expect("one").1,
        _ => {
            return Err(invalid(
                found[1].0,
                "only one constraint on the output may be given (response_format, or one of structured_outputs' json, choice, regex and json_object)",
            ))
        }
    };
    if sampling.min_tokens > 0 {
        return Err(unsupported(
            "min_tokens",
            "cannot be combined with a constrained output (JSON mode, a schema, a choice or a regex ends the output when its value is complete)",
        ));
    }
    Ok(Some(Arc::new(schema)))
}

/// A schema document, compiled; `what` names it in the error.
fn compile(param: &str, what: &str, document: &Value) -> Result<Schema, ApiError> {
    Schema::compile(document).map_err(|e| invalid(param, format!("{what}: {e}")))
}

/// vLLM's `json`: a schema, as an object or as its JSON text.
fn json_of(param: &str, value: &Value) -> Result<Schema, ApiError> {
    match value {
        Value::String(text) => {
            let document: Value = serde_json::from_str(text)
                .map_err(|_| invalid(param, "a schema given as a string must be JSON"))?;
            compile(param, "the schema", &document)
        }
        document => compile(param, "the schema", document),
    }
}

/// vLLM's `choice`: texts.
fn choice_of(param: &str, value: &Value) -> Result<Schema, ApiError> {
    let choices: Vec<String> = serde_json::from_value(value.clone())
        .map_err(|_| invalid(param, "choice must be an array of strings"))?;
    Schema::choice(&choices).map_err(|e| invalid(param, e.message))
}

/// vLLM's `regex`: a regular expression the output matches whole.
fn regex_of(param: &str, value: &Value) -> Result<Schema, ApiError> {
    let regex = value
        .as_str()
        .ok_or_else(|| invalid(param, "regex must be a string"))?;
    Schema::regex(regex).map_err(|e| invalid(param, format!("regex: {}", e.message)))
}

/// A count of alternatives, 0 to [`TOP_LOGPROBS_MAX`].
fn top_logprobs(value: Option<u64>, name: &str) -> Result<Option<u8>, ApiError> {
    match value {
        Some(n) if n > u64::from(TOP_LOGPROBS_MAX) => Err(invalid(
            name,
            format!("must be between 0 and {TOP_LOGPROBS_MAX}"),
        )),
        other => Ok(other.map(|n| n as u8)),
    }
}

/// `presence_penalty` or `frequency_penalty`: -2 to 2, 0 when absent.
fn penalty(f: &mut Fields, name: &str) -> Result<f32, ApiError> {
    let value: f32 = f.take(name)?.unwrap_or(0.0);
    if !(-PENALTY_LIMIT..=PENALTY_LIMIT).contains(&value) {
        return Err(invalid(
            name,
            format!("must be between -{PENALTY_LIMIT} and {PENALTY_LIMIT}"),
        ));
    }
    Ok(value)
}

/// `logit_bias`: token ids (as the object's keys, decimal) to biases of -100
/// to 100, sorted by id. Whether each id is in the model's vocabulary is
/// checked once the model is known.
fn logit_bias(f: &mut Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = f.take::<Map<String, Value>>("logit_bias")? else {
        return Ok(Vec::new());
    };
    if map.len() > LOGIT_BIAS_MAX {
        return Err(invalid(
            "logit_bias",
            format!("at most {LOGIT_BIAS_MAX} tokens"),
        ));
    }
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        // Decimal digits only: "+1", " 1" or "01" name no token id.
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|id| id.to_string() == key)
            .ok_or_else(|| {
                invalid(
                    "logit_bias",
                    "each key must be a token id (a decimal integer)",
                )
            })?;
        let bias = value
            .as_f64()
            .filter(|b| (-f64::from(LOGIT_BIAS_LIMIT)..=f64::from(LOGIT_BIAS_LIMIT)).contains(b))
            .ok_or_else(|| {
                invalid(
                    "logit_bias",
                    format!("each bias must be a number between -{LOGIT_BIAS_LIMIT} and {LOGIT_BIAS_LIMIT}"),
                )
            })?;
        biases.push((id, bias as f32));
    }
    biases.sort_unstable_by_key(|&(id, _)| id);
    Ok(biases)
}

impl ChatRequest {
    /// Parses and validates a chat body.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        let mut f = Fields::parse(body)?;
        let messages: Vec<Value> = f
            .take("messages")?
            .ok_or_else(|| ApiError::MissingParam("messages".into()))?;
        let mut common = common(&mut f)?;
        let logprobs: bool = f.take("logprobs")?.unwrap_or(false);
        let top = top_logprobs(f.take("top_logprobs")?, "top_logprobs")?;
        common.sampling.logprobs = match (logprobs, top) {
            (true, top) => Some(top.unwrap_or(0)),
            (false, Some(top)) if top > 0 => {
                return Err(invalid("top_logprobs", "needs \"logprobs\": true"))
            }
            (false, _) => None,
        };
        let tools = match f.take::<Value>("tools")? {
            Some(value) => tools::tools_of(value)?,
            None => Vec::new(),
        };
        let choice = tools::tool_choice_of(f.take("tool_choice")?, &tools)?;
        let parallel: bool = f.take("parallel_tool_calls")?.unwrap_or(true);
        f.allow_if("functions", is_empty)?;
        f.allow_if("function_call", |v| v == "none")?;
        common.sampling.json = constraint(&mut f, &common.sampling)?;
        let calls = match tools::constraint_of(&choice, &tools, parallel)? {
            Some(_) if common.sampling.json.is_some() => {
                return Err(invalid(
                    "tool_choice",
                    "cannot be combined with another constraint on the output (response_format, structured_outputs, ...)",
                ))
            }
            Some(_) if common.sampling.min_tokens > 0 => {
                return Err(unsupported(
                    "min_tokens",
                    "cannot be combined with tool_choice required or a named function (the calls end the output)",
                ))
            }
            Some((schema, out)) => {
                common.sampling.json = Some(Arc::new(schema));
                Some(out)
            }
            // Read out of the text, where the model's template has a markup
            // for calls (checked once the model is known).
            None if choice == ToolChoice::Auto => Some(CallsOut::Tagged(
                tools.iter().map(|t| t.name.clone()).collect(),
            )),
            None => None,
        };
        f.allow_if("modalities", |v| v == &serde_json::json!(["text"]))?;
        f.finish()?;
        let messages = messages_of(messages)?;
        Ok(ChatRequest {
            common,
            messages,
            tools,
            calls,
        })
    }
}

/// `messages`: 1 to [`MESSAGES_MAX`] of them, each checked.
fn messages_of(messages: Vec<Value>) -> Result<Vec<Message>, ApiError> {
    if messages.is_empty() {
        return Err(invalid("messages", "must contain at least one message"));
    }
    if messages.len() > MESSAGES_MAX {
        return Err(invalid(
            "messages",
            format!("at most {MESSAGES_MAX} messages"),
        ));
    }
    let mut calls = HashMap::new();
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m, &mut calls))
        .collect()
}

/// `POST /tokenize`, in vLLM's shape: what a completion's prompt or a chat's
/// conversation is, in a model's tokens.
#[derive(Clone, Debug)]
pub struct TokenizeRequest {
    /// The model whose tokenizer (and chat template) to use.
    pub model: String,
    /// What to tokenize.
    pub input: TokenizeInput,
}

/// What [`TokenizeRequest`] tokenizes.
#[derive(Clone, Debug)]
pub enum TokenizeInput {
    /// A text, as `/v1/completions` tokenizes its prompt; without the
    /// model's beginning-of-sequence token when `add_special_tokens` is false.
    Prompt {
        /// The text.
        text: String,
        /// Whether the model's BOS token (where it adds one) comes first.
        add_special_tokens: bool,
    },
    /// A conversation, rendered by the model's chat template with the
    /// assistant's turn opened, as `/v1/chat/completions` renders it (the
    /// tools shown too).
    Messages(Vec<Message>, Vec<Tool>),
}

impl TokenizeRequest {
    /// Parses a `/tokenize` body: `model`, and `prompt` or `messages`.
    pub fn parse(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
        let mut f = Fields::parse(body)?;
        let model: String = f
            .take("model")?
            .ok_or_else(|| ApiError::MissingParam("model".into()))?;
        let prompt: Option<String> = f.take("prompt")?;
        let messages: Option<Vec<Value>> = f.take("messages")?;
        let tools = match f.take::<Value>("tools")? {
            Some(value) => tools::tools_of(value)?,
            None => Vec::new(),
        };
        let add_special_tokens: Option<bool> = f.take("add_special_tokens")?;
        f.allow_if("add_generation_prompt", |v| v == &Value::Bool(true))?;
        f.allow_if("return_token_strs", |v| v == &Value::Bool(false))?;
        let input = match (prompt, messages) {
            (Some(_), None) if !tools.is_empty() => {
                return Err(invalid("tools", "go with messages, not with a prompt"))
            }
            (Some(text), None) => TokenizeInput::Prompt {
                text,
                add_special_tokens: add_special_tokens.unwrap_or(true),
            },
            (None, Some(messages)) => {
                // The template writes the special tokens it wants.
                if add_special_tokens == Some(true) {
                    return Err(unsupported(
                        "add_special_tokens",
                        "with messages is not supported (the chat template places its own)",
                    ));
                }
                TokenizeInput::Messages(messages_of(messages)?, tools)
            }
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "messages",
                    "give either prompt or messages, not both",
                ))
            }
            (None, None) => return Err(ApiError::MissingParam("prompt".into())),
        };
        f.finish()?;
        Ok(TokenizeRequest { model, input })
    }
}

/// `POST /detokenize`, in vLLM's shape: a model's token ids back to text.
#[derive(Clone, Debug)]
pub struct DetokenizeRequest {
    /// The model whose vocabulary the ids are of.
    pub model: String,
    /// The ids (checked against the vocabulary once the model is known).
    pub tokens: Vec<u32>,
}

impl DetokenizeRequest {
    /// Parses a `/detokenize` body: `model` and `tokens`.
    pub fn parse(body: &[u8]) -> Result<DetokenizeRequest, ApiError> {
        let mut f = Fields::parse(body)?;
        let model: String = f
            .take("model")?
            .ok_or_else(|| ApiError::MissingParam("model".into()))?;
        let tokens: Vec<u32> = f
            .take("tokens")?
            .ok_or_else(|| ApiError::MissingParam("tokens".into()))?;
        f.finish()?;
        Ok(DetokenizeRequest { model, tokens })
    }
}

/// Longest id of a tool call a conversation may give.
const CALL_ID_BYTES_MAX: usize = 256;

/// One message: `role` and `content` (a string, or text parts joined); an
/// assistant's `tool_calls`, each added to `calls` (its id to its place in
/// the conversation); a tool's `tool_call_id`, which must be in `calls`.
fn message(
    index: usize,
    value: Value,
    calls: &mut HashMap<String, usize>,
) -> Result<Message, ApiError> {
    let param = |field: &str| format!("messages[{index}].{field}");
    let Value::Object(map) = value else {
        return Err(ApiError::InvalidType {
            param: format!("messages[{index}]"),
            message: "each message must be an object".into(),
        });
    };
    let mut f = Fields(map);
    let role: String = f
        .take("role")
        .map_err(|_| invalid(&param("role"), "must be a string"))?
        .ok_or_else(|| ApiError::MissingParam(param("role")))?;
    let role = match role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        "function" => {
            return Err(unsupported(
                &param("role"),
                "(the legacy function messages) is not supported by this server; use tool",
            ))
        }
        _ => {
            return Err(invalid(
                &param("role"),
                "must be one of system, developer, user, assistant, tool",
            ))
        }
    };
    let tool_calls = match f.take::<Vec<Value>>("tool_calls")? {
        Some(list) if role == "assistant" => list
            .into_iter()
            .enumerate()
            .map(|(k, call)| tool_call(&param(&format!("tool_calls[{k}]")), call, calls))
            .collect::<Result<Vec<_>, _>>()?,
        Some(list) if list.is_empty() => Vec::new(),
        Some(_) => {
            return Err(invalid(
                &param("tool_calls"),
                "only an assistant message has tool calls",
            ))
        }
        None => Vec::new(),
    };
    let answers = match f.take::<String>("tool_call_id")? {
        Some(id) if role == "tool" => Some(calls.get(&id).copied().ok_or_else(|| {
            invalid(
                &param("tool_call_id"),
                "answers no tool call of an earlier assistant message",
            )
        })?),
        Some(_) => {
            return Err(invalid(
                &param("tool_call_id"),
                "only a tool message answers a tool call",
            ))
        }
        None if role == "tool" => return Err(ApiError::MissingParam(param("tool_call_id"))),
        None => None,
    };
    let content = match f.take::<Value>("content")? {
        None if role == "assistant" => String::new(),
        None => return Err(ApiError::MissingParam(param("content"))),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => text_parts(&param("content"), parts)?,
        Some(_) => {
            return Err(ApiError::InvalidType {
                param: param("content"),
                message: "must be a string or an array of text parts".into(),
            })
        }
    };
    f.allow_if("function_call", |_| false)
        .map_err(|_| unsupported(&param("function_call"), "is not supported by this server"))?;
    for ignored in ["name", "refusal", "annotations", "audio"] {
        f.ignore(ignored);
    }
    f.finish().map_err(|e| match e {
        ApiError::UnknownParam(p) => ApiError::UnknownParam(format!("messages[{index}].{p}")),
        other => other,
    })?;
    Ok(Message {
        role: role.to_string(),
        content,
        tool_calls,
        answers,
    })
}

/// One call of an assistant message: `{"id", "type": "function",
/// "function": {"name", "arguments"}}`, its arguments a JSON object's text.
fn tool_call(
    param: &str,
    value: Value,
    calls: &mut HashMap<String, usize>,
) -> Result<ToolCall, ApiError> {
    let id = value.get("id").and_then(Value::as_str).unwrap_or("");
    if id.is_empty() || id.len() > CALL_ID_BYTES_MAX {
        return Err(invalid(
            &format!("{param}.id"),
            format!("must be a string of 1 to {CALL_ID_BYTES_MAX} bytes"),
        ));
    }
    if value.get("type").is_some_and(|t| t != "function") {
        return Err(invalid(&format!("{param}.type"), "must be \"function\""));
    }
    let function = value.get("function");
    let name = function
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .filter(|n| tools::is_name(n))
        .ok_or_else(|| {
            invalid(
                &format!("{param}.function.name"),
                "must be 1 to 64 letters, digits, '_' or '-'",
            )
        })?;
    let arguments = function
        .and_then(|f| f.get("arguments"))
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Map<String, Value>>(a).ok())
        .ok_or_else(|| {
            invalid(
                &format!("{param}.function.arguments"),
                "must be the text of a JSON object",
            )
        })?;
    let place = calls.len();
    if calls.insert(id.to_string(), place).is_some() {
        return Err(invalid(&format!("{param}.id"), "names two tool calls"));
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

fn text_parts(param: &str, parts: Vec<Value>) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(text))) => texts.push(text.clone()),
            (Some("text"), _) => {
                return Err(ApiError::InvalidType {
                    param: param.to_string(),
                    message: "a text part needs a string `text`".into(),
                })
            }
            _ => {
                return Err(unsupported(
                    param,
                    "parts other than text are not supported",
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

impl CompletionRequest {
    /// Parses and validates a completions body.
    pub fn parse(body: &[u8]) -> Result<CompletionRequest, ApiError> {
        let mut f = Fields::parse(body)?;
        let prompts = match f.take::<Value>("prompt")? {
            None => return Err(ApiError::MissingParam("prompt".into())),
            Some(Value::String(s)) => vec![Prompt::Text(s)],
            Some(Value::Array(items)) => prompt_array(items)?,
            Some(_) => {
                return Err(ApiError::InvalidType {
                    param: "prompt".into(),
                    message: "must be a string, an array of token ids, or a batch: an array of strings or of arrays of token ids"
                        .into(),
                })
            }
        };
        let mut common = common(&mut f)?;
        let sequences = prompts.len() as u64 * u64::from(common.n);
        if sequences > u64::from(SEQUENCES_MAX) {
            let param = if prompts.len() > 1 { "prompt" } else { "n" };
            return Err(invalid(
                param,
                format!(
                    "{} prompts with n = {} make {sequences} sequences; a request makes at most {SEQUENCES_MAX}",
                    prompts.len(),
                    common.n
                ),
            ));
        }
        // The legacy shape: how many alternatives, 0 for the chosen token's only.
        common.sampling.logprobs = top_logprobs(f.take("logprobs")?, "logprobs")?;
        // (Not OpenAI's on this endpoint; vLLM's, and as useful here.)
        common.sampling.json = constraint(&mut f, &common.sampling)?;
        f.allow_if("top_logprobs", is_zero)?;
        let echo = f.take::<bool>("echo")?.unwrap_or(false);
        if echo {
            // The prompt's log probabilities, as many alternatives as the
            // generated tokens'. With nothing to generate they are the
            // answer (none shown without `logprobs`, but the prompt is
            // computed as a request with a token to generate would be).
            common.sampling.prompt_logprobs = match common.sampling.logprobs {
                Some(top) => Some(top),
                None => (common.max_tokens == Some(0)).then_some(0),
            };
        }
        f.allow_if("best_of", |v| v.as_u64() == Some(1))?;
        f.allow_if("suffix", |v| v == "")?;
        f.finish()?;
        Ok(CompletionRequest {
            common,
            prompts,
            echo,
        })
    }
}

fn prompt_array(items: Vec<Value>) -> Result<Vec<Prompt>, ApiError> {
    let ids = |items: Vec<Value>| {
        serde_json::from_value::<Vec<u32>>(Value::Array(items))
            .map(Prompt::Tokens)
            .map_err(|e| type_error("prompt", e))
    };
    if items.iter().all(Value::is_number) {
        return Ok(vec![ids(items)?]);
    }
    // A batch: strings, or arrays of token ids (what an evaluation harness
    // sends), not both.
    let strings = items.first().is_some_and(Value::is_string);
    let mut batch = Vec::with_capacity(items.len());
    for item in items {
        batch.push(match item {
            Value::String(text) if strings => Prompt::Text(text),
            Value::Array(items) if !strings && items.iter().all(Value::is_number) => ids(items)?,
            _ => {
                return Err(ApiError::InvalidType {
                    param: "prompt".into(),
                    message: "a batch is an array of strings or an array of arrays of token ids"
                        .into(),
                })
            }
        });
    }
    if batch.len() > SEQUENCES_MAX as usize {
        return Err(invalid(
            "prompt",
            format!("a batch holds at most {SEQUENCES_MAX} prompts"),
        ));
    }
    Ok(batch)
}

/// `usage` as OpenAI reports it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct UsageBody {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// What the prompt's tokens cost.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details` as OpenAI reports it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the tenant's own prefix cache.
    pub cached_tokens: u32,
}

impl From<Usage> for UsageBody {
    fn from(u: Usage) -> UsageBody {
        UsageBody {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// OpenAI's `finish_reason` for a successful finish.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Which endpoint a response belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Endpoint {
    /// The id prefix of its responses.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
        }
    }

    /// The parameter that holds the prompt.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        }
    }
}

/// A token's text as OpenAI reports it: its bytes as UTF-8, a piece of a
/// character replaced (the exact bytes go alongside, in `bytes`).
fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The `logprobs` of a choice for `entries`: OpenAI's chat shape
/// (`content`), or the legacy completions shape, whose `text_offset` counts
/// characters of the completion from `offset` on (advanced past them).
/// `first`: an echoed prompt's first token, which has no log probability
/// (`null`, legacy shape only), ahead of the entries.
pub fn logprobs_value(
    endpoint: Endpoint,
    first: Option<&[u8]>,
    entries: &[TokenLogprob],
    offset: &mut usize,
) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let entry = |bytes: &[u8], logprob: f32| serde_json::json!({"token": token_text(bytes), "logprob": logprob, "bytes": bytes});
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut value = entry(&e.bytes, e.logprob);
                    value["top_logprobs"] = e
                        .top
                        .iter()
                        .map(|(bytes, logprob)| entry(bytes, *logprob))
                        .collect();
                    value
                })
                .collect();
            serde_json::json!({"content": content, "refusal": null})
        }
        Endpoint::Completions => {
            let mut tokens = Vec::new();
            let mut token_logprobs: Vec<Value> = Vec::new();
            let mut top_logprobs = Vec::new();
            let mut text_offset = Vec::new();
            if let Some(bytes) = first {
                let text = token_text(bytes);
                text_offset.push(*offset);
                *offset += text.chars().count();
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
                tokens.push(text);
            }
            for e in entries {
                let text = token_text(&e.bytes);
                text_offset.push(*offset);
                *offset += text.chars().count();
                token_logprobs.push(e.logprob.into());
                // The chosen token and the likeliest ones, by text.
                let mut top = Map::new();
                top.insert(text.clone(), e.logprob.into());
                for (bytes, logprob) in &e.top {
                    top.insert(token_text(bytes), (*logprob).into());
                }
                top_logprobs.push(Value::Object(top));
                tokens.push(text);
            }
            serde_json::json!({
                "tokens": tokens,
                "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs,
                "text_offset": text_offset,
            })
        }
    }
}

/// What every response and chunk repeats.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    /// `chatcmpl-…` / `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model id.
    pub model: String,
    /// The endpoint.
    pub endpoint: Endpoint,
    /// How a chat's output becomes tool calls, where it does.
    pub calls: Option<CallsOut>,
}

impl ResponseMeta {
    /// The `finish_reason` of a successful finish: `tool_calls` where the
    /// output is calls and ended whole, or (calls read out of text) where
    /// its choice's `calls` made one.
    pub fn finish_of(&self, reason: FinishReason, calls: Option<&CallsWriter>) -> &'static str {
        match (&self.calls, reason) {
            (Some(CallsOut::Named(_) | CallsOut::Listed), FinishReason::Stop) => "tool_calls",
            (Some(_), FinishReason::Stop) if calls.is_some_and(CallsWriter::called) => "tool_calls",
            _ => finish_reason(reason),
        }
    }

    /// The writer of choice `index`'s tool calls, where its output is calls.
    pub fn calls_writer(&self, index: u32) -> Option<CallsWriter> {
        let number = self
            .id
            .strip_prefix(self.endpoint.id_prefix())
            .unwrap_or(&self.id);
        self.calls
            .clone()
            .map(|out| CallsWriter::new(out, format!("call_{number}_{index}_")))
    }

    /// One choice of a whole (non-streamed) response.
    pub fn choice(&self, index: u32, text: String, reason: FinishReason) -> Value {
        match self.endpoint {
            Endpoint::Chat if self.calls.is_some() => {
                let mut writer = self.calls_writer(index).expect("calls");
                let mut content = writer.push(&text).content;
                content.push_str(&writer.finish().content);
                // Text around the calls (tagged only): trimmed where it
                // called, none where that leaves nothing.
                let content = match (&self.calls, writer.called()) {
                    (Some(CallsOut::Tagged(_) | CallsOut::Bare(_)), false) => Some(content),
                    _ => Some(content.trim().to_string()).filter(|c| !c.is_empty()),
                };
                let calls: Vec<Value> = writer
                    .calls()
                    .into_iter()
                    .map(|(id, name, arguments)| {
                        serde_json::json!({"id": id, "type": "function",
                                           "function": {"name": name, "arguments": arguments}})
                    })
                    .collect();
                let mut message = serde_json::json!({"role": "assistant", "content": content,
                                                     "refusal": null});
                if !calls.is_empty()
                    || !matches!(self.calls, Some(CallsOut::Tagged(_) | CallsOut::Bare(_)))
                {
                    message["tool_calls"] = calls.into();
                }
                serde_json::json!({
                    "index": index,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": self.finish_of(reason, Some(&writer)),
                })
            }
            Endpoint::Chat => serde_json::json!({
                "index": index,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": null,
                "finish_reason": self.finish_of(reason, None),
            }),
            Endpoint::Completions => serde_json::json!({
                "index": index,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
        }
    }

    /// A whole (non-streamed) response of `choices` (in index order).
    pub fn response(&self, choices: Vec<Value>, usage: Usage) -> Value {
        serde_json::json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completions => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": UsageBody::from(usage),
        })
    }

    /// A stream chunk of choice `index` with tool calls' `entries`
    /// ([`CallsWriter::push`]).
    pub fn calls_chunk(&self, index: u32, entries: Vec<Value>, usage_null: bool) -> Value {
        let mut chunk = self.chunk(index, false, None, None, usage_null);
        chunk["choices"][0]["delta"] = serde_json::json!({ "tool_calls": entries });
        chunk
    }

    /// One stream chunk of choice `index`: `role` only in the first, `text`
    /// in the middle ones, `reason` in the last; `usage_null` adds `"usage":
    /// null` (as OpenAI does when the client asked for usage).
    pub fn chunk(
        &self,
        index: u32,
        role: bool,
        text: Option<&str>,
        reason: Option<FinishReason>,
        usage_null: bool,
    ) -> Value {
        let finish = reason.map(|r| self.finish_of(r, None));
        let mut chunk = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                    // A required or named answer is calls alone: no content,
                    // as the whole answer has none.
                    let content = match self.calls {
                        Some(CallsOut::Named(_) | CallsOut::Listed) => Value::Null,
                        _ => "".into(),
                    };
                    delta.insert("content".into(), content);
                }
                if let Some(text) = text {
                    delta.insert("content".into(), text.into());
                }
                serde_json::json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Endpoint::Completions => serde_json::json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
        };
        if usage_null {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The usage chunk that ends a stream when the client asked for usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        serde_json::json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completions => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": UsageBody::from(usage),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::schema::Source;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(body.as_bytes())
    }

    fn param_of(e: ApiError) -> String {
        match e {
            ApiError::InvalidType { param, .. }
            | ApiError::InvalidValue { param, .. }
            | ApiError::Unsupported { param, .. }
            | ApiError::UnknownParam(param)
            | ApiError::MissingParam(param) => param,
            other => panic!("no param: {other:?}"),
        }
    }

    #[test]
    fn parses_a_full_chat_request_and_ignores_harmless_fields() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
            "max_tokens":5,"temperature":0,"top_p":0.5,"top_k":3,"seed":-1,"stop":"x",
            "stream":true,"stream_options":{"include_usage":true},"n":1,"logprobs":false,
            "user":"u","presence_penalty":0,"response_format":{"type":"text"}}"#,
        )
        .unwrap();
        assert_eq!(r.messages[1].content, "a\nb");
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.sampling.top_k, 3);
        assert_eq!(r.common.sampling.seed, u64::MAX);
        assert_eq!(r.common.stop, vec!["x"]);
        assert!(r.common.stream && r.common.include_usage);
        assert_eq!(r.common.cache_salt, None);
        let salted = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"user-42"}"#,
        )
        .unwrap();
        assert_eq!(salted.common.cache_salt.as_deref(), Some("user-42"));
        // vLLM's stop_token_ids (sorted, each once) and min_tokens.
        let ended = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],
            "stop_token_ids":[7,2,7],"min_tokens":4,"max_tokens":4}"#,
        )
        .unwrap();
        assert_eq!(ended.common.sampling.stop_token_ids, vec![2, 7]);
        assert_eq!(ended.common.sampling.min_tokens, 4);
        assert_eq!(r.common.sampling.stop_token_ids, Vec::<u32>::new());
        assert_eq!(r.common.sampling.min_tokens, 0);
    }

    #[test]
    fn tools_and_a_conversation_that_called_them() {
        let tools = r#""tools":[{"type":"function","function":{"name":"get_weather",
            "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;
        let conversation = r#""messages":[{"role":"user","content":"Oslo?"},
            {"role":"assistant","content":null,"tool_calls":[
              {"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}},
              {"id":"call_b","type":"function","function":{"name":"get_weather","arguments":"{}"}}]},
            {"role":"tool","tool_call_id":"call_b","content":"rain"},
            {"role":"tool","tool_call_id":"call_a","content":"sun"}]"#;
        let r = chat(&format!(
            r#"{{"model":"m",{conversation},{tools},"tool_choice":"required"}}"#
        ))
        .unwrap();
        assert_eq!(r.calls, Some(CallsOut::Listed));
        assert!(r.common.sampling.json.is_some());
        assert_eq!(r.tools[0].name, "get_weather");
        assert_eq!(r.messages[1].tool_calls.len(), 2);
        assert_eq!(r.messages[1].tool_calls[0].arguments["city"], "Oslo");
        assert_eq!(r.messages[1].content, "");
        // Ids become places: call_b is the second call.
        assert_eq!(
            (r.messages[2].answers, r.messages[3].answers),
            (Some(1), Some(0))
        );
        let named = chat(&format!(
            r#"{{"model":"m",{conversation},{tools},"tool_choice":{{"type":"function","function":{{"name":"get_weather"}}}}}}"#
        ))
        .unwrap();
        assert_eq!(named.calls, Some(CallsOut::Named("get_weather".into())));
        // "none": text, the tools still shown.
        let none = chat(&format!(
            r#"{{"model":"m",{conversation},{tools},"tool_choice":"none"}}"#
        ))
        .unwrap();
        assert_eq!((none.calls, none.tools.len()), (None, 1));
        assert!(none.common.sampling.json.is_none());
        // "auto", by default: read out of the text (where the model's
        // template has a markup for calls: checked once it is known).
        let auto = chat(&format!(r#"{{"model":"m",{conversation},{tools}}}"#)).unwrap();
        assert_eq!(
            auto.calls,
            Some(CallsOut::Tagged(vec!["get_weather".into()]))
        );
        assert!(auto.common.sampling.json.is_none());

        let message = |m: &str| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}},{m}]}}"#)
        };
        for (body, param) in [
            (
                message(r#"{"role":"tool","tool_call_id":"nope","content":"x"}"#),
                "messages[1].tool_call_id",
            ),
            (
                message(r#"{"role":"tool","content":"x"}"#),
                "messages[1].tool_call_id",
            ),
            (
                message(r#"{"role":"user","content":"x","tool_call_id":"a"}"#),
                "messages[1].tool_call_id",
            ),
            (
                message(r#"{"role":"user","content":"x","tool_calls":[{"id":"a"}]}"#),
                "messages[1].tool_calls",
            ),
            (
                message(
                    r#"{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"[1]"}}]}"#,
                ),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                message(
                    r#"{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{"}}]}"#,
                ),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                message(
                    r#"{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f g","arguments":"{}"}}]}"#,
                ),
                "messages[1].tool_calls[0].function.name",
            ),
            (
                message(
                    r#"{"role":"assistant","tool_calls":[{"id":"","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
                ),
                "messages[1].tool_calls[0].id",
            ),
            (
                message(
                    r#"{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}},
                                                          {"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
                ),
                "messages[1].tool_calls[1].id",
            ),
            (
                message(r#"{"role":"function","name":"f","content":"x"}"#),
                "messages[1].role",
            ),
            (
                format!(
                    r#"{{"model":"m",{conversation},{tools},"tool_choice":"required","response_format":{{"type":"json_object"}}}}"#
                ),
                "tool_choice",
            ),
            (
                format!(
                    r#"{{"model":"m",{conversation},{tools},"tool_choice":"required","min_tokens":2}}"#
                ),
                "min_tokens",
            ),
            (
                format!(
                    r#"{{"model":"m",{conversation},{tools},"tool_choice":{{"type":"function","function":{{"name":"other"}}}}}}"#
                ),
                "tool_choice",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"auto"}"#
                    .to_string(),
                "tool_choice",
            ),
        ] {
            assert_eq!(param_of(chat(&body).unwrap_err()), param, "{body}");
        }
    }

    #[test]
    fn names_the_parameter_it_refuses() {
        let base = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        for (extra, param) in [
            (r#""n":0"#, "n"),
            (r#""n":17"#, "n"),
            (r#""n":1.5"#, "n"),
            (r#""tools":[{"type":"function"}]"#, "tools[0].function"),
            (r#""tool_choice":"auto""#, "tool_choice"),
            (r#""logprobs":"yes""#, "logprobs"),
            (r#""top_logprobs":2"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
            (r#""logprobs":true,"top_logprobs":-1"#, "top_logprobs"),
            (
                r#""response_format":{"type":"json_schema","json_schema":{}}"#,
                "response_format",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"a b","schema":{}}}"#,
                "response_format",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"a"}}"#,
                "response_format",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"array","uniqueItems":true}}}"#,
                "response_format",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{},"extra":1}}"#,
                "response_format",
            ),
            (
                r#""min_tokens":1,"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{}}}"#,
                "min_tokens",
            ),
            (r#""response_format":{"type":"yaml"}"#, "response_format"),
            (r#""response_format":"json""#, "response_format"),
            (r#""logit_bias":{"a":2}"#, "logit_bias"),
            (r#""logit_bias":{"01":2}"#, "logit_bias"),
            (r#""logit_bias":{"-1":2}"#, "logit_bias"),
            (r#""logit_bias":{"4294967296":2}"#, "logit_bias"),
            (r#""logit_bias":{"1":100.5}"#, "logit_bias"),
            (r#""logit_bias":{"1":"2"}"#, "logit_bias"),
            (r#""logit_bias":[1]"#, "logit_bias"),
            (r#""presence_penalty":2.5"#, "presence_penalty"),
            (r#""min_p":1.5"#, "min_p"),
            (r#""repetition_penalty":0"#, "repetition_penalty"),
            (r#""repetition_penalty":2.5"#, "repetition_penalty"),
            (r#""ignore_eos":1"#, "ignore_eos"),
            (r#""stop_token_ids":[-1]"#, "stop_token_ids"),
            (r#""stop_token_ids":"2""#, "stop_token_ids"),
            (r#""stop_token_ids":[4294967296]"#, "stop_token_ids"),
            (r#""min_tokens":-1"#, "min_tokens"),
            (r#""min_tokens":5,"max_tokens":4"#, "min_tokens"),
            (
                r#""min_tokens":1,"response_format":{"type":"json_object"}"#,
                "min_tokens",
            ),
            (r#""frequency_penalty":-3"#, "frequency_penalty"),
            (r#""frequency_penalty":"1""#, "frequency_penalty"),
            (r#""max_tokens":"ten""#, "max_tokens"),
            (r#""max_tokens":-1"#, "max_tokens"),
            (r#""temperature":3"#, "temperature"),
            (r#""top_p":0"#, "top_p"),
            (r#""stop":["a","b","c","d","e"]"#, "stop"),
            (r#""cache_salt":"""#, "cache_salt"),
            (r#""cache_salt":7"#, "cache_salt"),
            (r#""stream":"yes""#, "stream"),
            (r#""bogus":1"#, "bogus"),
            (r#""stream_options":{"x":1}"#, "stream_options.x"),
        ] {
            let e = chat(&format!("{{{base},{extra}}}")).unwrap_err();
            assert_eq!(param_of(e), param, "{extra}");
        }
        let ids: Vec<u32> = (0..65).collect();
        let e = chat(&format!(r#"{{{base},"stop_token_ids":{ids:?}}}"#)).unwrap_err();
        assert_eq!(param_of(e), "stop_token_ids");
        let e = chat(r#"{"model":"m","messages":[{"role":"user"}]}"#).unwrap_err();
        assert_eq!(param_of(e), "messages[0].content");
        let e = chat(r#"{"messages":[]}"#).unwrap_err();
        assert_eq!(param_of(e), "model");
    }

    #[test]
    fn tokenize_bodies_take_a_prompt_or_messages_and_detokenize_bodies_ids() {
        let t = TokenizeRequest::parse(br#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert!(matches!(
            t.input,
            TokenizeInput::Prompt { ref text, add_special_tokens: true } if text == "hi"
        ));
        let t = TokenizeRequest::parse(
            br#"{"model":"m","prompt":"hi","add_special_tokens":false,"return_token_strs":false}"#,
        )
        .unwrap();
        assert!(matches!(
            t.input,
            TokenizeInput::Prompt {
                add_special_tokens: false,
                ..
            }
        ));
        let t = TokenizeRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true}"#,
        )
        .unwrap();
        assert!(matches!(t.input, TokenizeInput::Messages(ref m, _) if m.len() == 1));
        for (body, param) in [
            (r#"{"prompt":"hi"}"#, "model"),
            (r#"{"model":"m"}"#, "prompt"),
            (r#"{"model":"m","prompt":"hi","messages":[]}"#, "messages"),
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (r#"{"model":"m","prompt":["hi"]}"#, "prompt"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_special_tokens":true}"#,
                "add_special_tokens",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#,
                "add_generation_prompt",
            ),
            (
                r#"{"model":"m","prompt":"hi","return_token_strs":true}"#,
                "return_token_strs",
            ),
            (
                r#"{"model":"m","prompt":"hi","max_tokens":1}"#,
                "max_tokens",
            ),
        ] {
            let e = TokenizeRequest::parse(body.as_bytes()).unwrap_err();
            assert_eq!(param_of(e), param, "{body}");
        }
        let d = DetokenizeRequest::parse(br#"{"model":"m","tokens":[1,2]}"#).unwrap();
        assert_eq!((d.model.as_str(), d.tokens), ("m", vec![1, 2]));
        for (body, param) in [
            (r#"{"model":"m"}"#, "tokens"),
            (r#"{"model":"m","tokens":[-1]}"#, "tokens"),
            (r#"{"model":"m","tokens":"1"}"#, "tokens"),
            (r#"{"tokens":[1]}"#, "model"),
            (r#"{"model":"m","tokens":[1],"x":1}"#, "x"),
        ] {
            let e = DetokenizeRequest::parse(body.as_bytes()).unwrap_err();
            assert_eq!(param_of(e), param, "{body}");
        }
    }

    #[test]
    fn takes_penalties_and_logit_bias_sorted_by_token_id() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],
            "presence_penalty":-2,"frequency_penalty":1.5,
            "logit_bias":{"50256":-100,"7":100,"12":0.5}}"#,
        )
        .unwrap();
        let s = &r.common.sampling;
        assert_eq!((s.presence_penalty, s.frequency_penalty), (-2.0, 1.5));
        assert_eq!(s.logit_bias, [(7, 100.0), (12, 0.5), (50256, -100.0)]);
        let many: Vec<String> = (0..=LOGIT_BIAS_MAX).map(|i| format!("\"{i}\":1")).collect();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"logit_bias":{{{}}}}}"#,
            many.join(",")
        );
        assert_eq!(param_of(chat(&body).unwrap_err()), "logit_bias");
        // Absent, null and empty are no bias and no penalty.
        for extra in ["", r#","logit_bias":null"#, r#","logit_bias":{}"#] {
            let body =
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            let s = chat(&body).unwrap().common.sampling;
            assert!(
                s.logit_bias.is_empty() && s.presence_penalty == 0.0 && s.frequency_penalty == 0.0
            );
        }
    }

    #[test]
    fn logprobs_as_each_endpoint_asks_for_them() {
        let base = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        let logprobs = |extra: &str| {
            chat(&format!("{{{base}{extra}}}"))
                .unwrap()
                .common
                .sampling
                .logprobs
        };
        assert_eq!(logprobs(""), None);
        assert_eq!(logprobs(r#","logprobs":false,"top_logprobs":0"#), None);
        assert_eq!(logprobs(r#","logprobs":true"#), Some(0));
        assert_eq!(logprobs(r#","logprobs":true,"top_logprobs":20"#), Some(20));
        let json = |extra: &str| {
            chat(&format!("{{{base}{extra}}}"))
                .unwrap()
                .common
                .sampling
                .json
        };
        assert!(json("").is_none() && json(r#","response_format":{"type":"text"}"#).is_none());
        assert_eq!(
            json(r#","response_format":{"type":"json_object"}"#).as_deref(),
            Some(&Schema::object())
        );
        let schema = json(
            r#","response_format":{"type":"json_schema","json_schema":{"name":"point","strict":true,"schema":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]}}}"#,
        )
        .unwrap();
        let point = serde_json::json!({"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]});
        assert_eq!(schema.source(), &Source::Document(point.clone()));
        // vLLM's forms: structured_outputs (json as an object or as text,
        // choice, json_object) and the guided_* fields before it.
        for extra in [
            format!(r#","structured_outputs":{{"json":{point}}}"#),
            format!(
                r#","structured_outputs":{{"json":{:?}}}"#,
                point.to_string()
            ),
            format!(r#","guided_json":{point}"#),
        ] {
            assert_eq!(
                json(&extra).unwrap().source(),
                &Source::Document(point.clone()),
                "{extra}"
            );
        }
        let choice = Source::Choice(vec!["yes".into(), "no".into()]);
        assert_eq!(
            json(r#","structured_outputs":{"choice":["yes","no"],"regex":null}"#)
                .unwrap()
                .source(),
            &choice
        );
        assert_eq!(
            json(r#","guided_choice":["yes","no"]"#).unwrap().source(),
            &choice
        );
        assert_eq!(
            json(r#","structured_outputs":{"json_object":true}"#).as_deref(),
            Some(&Schema::object())
        );
        // One constraint at most; what vLLM has and this server has not is named.
        for (extra, param) in [
            (
                r#","response_format":{"type":"json_object"},"guided_choice":["a"]"#,
                "guided_choice",
            ),
            (
                r#","structured_outputs":{"choice":["a"],"json":{}}"#,
                "structured_outputs",
            ),
            (
                r#","structured_outputs":{"grammar":"root ::= x"}"#,
                "structured_outputs",
            ),
            (
                r#","structured_outputs":{"choice":[]}"#,
                "structured_outputs",
            ),
            (
                r#","structured_outputs":{"choice":["a",""]}"#,
                "structured_outputs",
            ),
            (
                r#","structured_outputs":{"choice":"a"}"#,
                "structured_outputs",
            ),
            (
                r#","structured_outputs":{"json":"{"}"#,
                "structured_outputs",
            ),
            (r#","structured_outputs":"json""#, "structured_outputs"),
            (
                r#","guided_json":{"type":"string","pattern":"(?=a)"}"#,
                "guided_json",
            ),
            (r#","guided_regex":"(a""#, "guided_regex"),
            (r#","guided_regex":7"#, "guided_regex"),
            (
                r#","structured_outputs":{"regex":"[^\\x00-\\x7f]"}"#,
                "structured_outputs",
            ),
            (r#","min_tokens":2,"guided_choice":["a"]"#, "min_tokens"),
        ] {
            let refused = chat(&format!("{{{base}{extra}}}")).unwrap_err();
            assert_eq!(param_of(refused), param, "{extra}");
        }
        let completion = |extra: &str| {
            CompletionRequest::parse(format!(r#"{{"model":"m","prompt":"hi"{extra}}}"#).as_bytes())
                .map(|r| r.common.sampling.logprobs)
        };
        assert_eq!(completion("").unwrap(), None);
        assert_eq!(completion(r#","logprobs":0"#).unwrap(), Some(0));
        assert_eq!(completion(r#","logprobs":5"#).unwrap(), Some(5));
        assert_eq!(
            param_of(completion(r#","logprobs":21"#).unwrap_err()),
            "logprobs"
        );
        assert_eq!(
            param_of(completion(r#","logprobs":true"#).unwrap_err()),
            "logprobs"
        );
        let json = |extra: &str| {
            CompletionRequest::parse(format!(r#"{{"model":"m","prompt":"hi"{extra}}}"#).as_bytes())
                .map(|r| r.common.sampling.json)
        };
        assert!(json(r#","response_format":{"type":"json_object"}"#)
            .unwrap()
            .is_some());
        assert!(json("").unwrap().is_none());
    }

    #[test]
    fn logprobs_have_openais_chat_and_legacy_shapes() {
        let entries = [
            TokenLogprob {
                bytes: b"Hi".to_vec(),
                logprob: -0.5,
                top: vec![(b"Hi".to_vec(), -0.5), (b" Hello".to_vec(), -1.0)],
            },
            // Half of "é" (0xC3 0xA9): the text replaces it, the bytes keep it.
            TokenLogprob {
                bytes: vec![0xC3],
                logprob: -2.0,
                top: vec![],
            },
        ];
        let mut offset = 0;
        let chat = logprobs_value(Endpoint::Chat, None, &entries, &mut offset);
        assert_eq!(chat["refusal"], Value::Null);
        let content = chat["content"].as_array().unwrap();
        assert_eq!(content[0]["token"], "Hi");
        assert_eq!(content[0]["logprob"], -0.5);
        assert_eq!(content[0]["bytes"], serde_json::json!([72, 105]));
        assert_eq!(content[0]["top_logprobs"][1]["token"], " Hello");
        assert_eq!(content[0]["top_logprobs"][1]["logprob"], -1.0);
        assert_eq!(content[1]["token"], "\u{FFFD}");
        assert_eq!(content[1]["bytes"], serde_json::json!([0xC3]));
        assert_eq!(content[1]["top_logprobs"], serde_json::json!([]));
        let mut offset = 7;
        let legacy = logprobs_value(Endpoint::Completions, None, &entries, &mut offset);
        assert_eq!(legacy["tokens"], serde_json::json!(["Hi", "\u{FFFD}"]));
        assert_eq!(legacy["token_logprobs"], serde_json::json!([-0.5, -2.0]));
        assert_eq!(
            legacy["top_logprobs"][0],
            serde_json::json!({"Hi": -0.5, " Hello": -1.0})
        );
        assert_eq!(
            legacy["top_logprobs"][1],
            serde_json::json!({"\u{FFFD}": -2.0})
        );
        assert_eq!(legacy["text_offset"], serde_json::json!([7, 9]));
        assert_eq!(offset, 10);
        // An echoed prompt's first token: shown, with no log probability.
        let mut offset = 0;
        let echoed = logprobs_value(Endpoint::Completions, Some(b"The"), &entries, &mut offset);
        assert_eq!(
            echoed["tokens"],
            serde_json::json!(["The", "Hi", "\u{FFFD}"])
        );
        assert_eq!(
            echoed["token_logprobs"],
            serde_json::json!([null, -0.5, -2.0])
        );
        assert_eq!(echoed["top_logprobs"][0], serde_json::Value::Null);
        assert_eq!(echoed["text_offset"], serde_json::json!([0, 3, 5]));
    }

    #[test]
    fn refuses_bodies_that_are_not_json_objects() {
        for body in ["", "[]", "{", "\"x\"", "{\"model\":\"\u{FFFD}"] {
            assert!(
                matches!(chat(body), Err(ApiError::InvalidJson(_))),
                "{body}"
            );
        }
        assert!(matches!(
            ChatRequest::parse(b"{\"model\":\"\xff\"}"),
            Err(ApiError::InvalidJson(_))
        ));
    }

    #[test]
    fn huge_max_tokens_stays_huge_for_admission() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":99999999999}"#,
        )
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(u32::MAX));
    }

    #[test]
    fn completion_prompts_as_text_one_string_tokens_or_a_batch() {
        let p = |body: &str| CompletionRequest::parse(body.as_bytes()).map(|r| r.prompts);
        let one = |body: &str| match p(body) {
            Ok(mut prompts) if prompts.len() == 1 => prompts.pop().unwrap(),
            other => panic!("{body}: {other:?}"),
        };
        assert!(matches!(one(r#"{"model":"m","prompt":"hi"}"#), Prompt::Text(t) if t == "hi"));
        assert!(matches!(one(r#"{"model":"m","prompt":["hi"]}"#), Prompt::Text(t) if t == "hi"));
        assert!(matches!(one(r#"{"model":"m","prompt":[1,2]}"#), Prompt::Tokens(t) if t == [1, 2]));
        // A batch of one token-id prompt, as lm-evaluation-harness sends it.
        assert!(
            matches!(one(r#"{"model":"m","prompt":[[1,2]]}"#), Prompt::Tokens(t) if t == [1, 2])
        );
        // Batches, in order.
        let batch = p(r#"{"model":"m","prompt":["a","b",""]}"#).unwrap();
        let texts: Vec<_> = batch
            .iter()
            .map(|p| match p {
                Prompt::Text(t) => t.as_str(),
                Prompt::Tokens(_) => panic!("{p:?}"),
            })
            .collect();
        assert_eq!(texts, ["a", "b", ""]);
        let batch = p(r#"{"model":"m","prompt":[[1,2],[3],[]]}"#).unwrap();
        let ids: Vec<_> = batch
            .iter()
            .map(|p| match p {
                Prompt::Tokens(t) => t.clone(),
                Prompt::Text(_) => panic!("{p:?}"),
            })
            .collect();
        assert_eq!(ids, [vec![1, 2], vec![3], vec![]]);
        // Sizes: 64 prompts, or 16 prompts with n 4; one more is refused,
        // naming what grew.
        let texts = |k: usize| serde_json::to_string(&vec!["a"; k]).unwrap();
        let body = |k: usize, n: u32| format!(r#"{{"model":"m","prompt":{},"n":{n}}}"#, texts(k));
        assert_eq!(p(&body(64, 1)).unwrap().len(), 64);
        assert_eq!(p(&body(16, 4)).unwrap().len(), 16);
        assert_eq!(param_of(p(&body(65, 1)).unwrap_err()), "prompt");
        assert_eq!(param_of(p(&body(17, 4)).unwrap_err()), "prompt");
        // Mixed or malformed batches.
        for batch in [
            r#"["a",[1]]"#,
            r#"[[1],"a"]"#,
            r#"[[1,"a"]]"#,
            r#"[{"a":1}]"#,
            r#"[[[1]]]"#,
            r#"[1,"a"]"#,
            "[[-1]]",
            r#"["a",null]"#,
        ] {
            let body = format!(r#"{{"model":"m","prompt":{batch}}}"#);
            match p(&body) {
                Err(e) => assert_eq!(param_of(e), "prompt", "{batch}"),
                Ok(prompts) => panic!("{batch} parsed as {prompts:?}"),
            }
        }
    }

    #[test]
    fn echo_asks_for_the_prompts_log_probabilities_as_many_as_the_outputs() {
        let p = |body: &str| CompletionRequest::parse(body.as_bytes()).unwrap();
        let r = p(r#"{"model":"m","prompt":"a"}"#);
        assert!(!r.echo);
        assert_eq!(r.common.sampling.prompt_logprobs, None);
        let r = p(r#"{"model":"m","prompt":"a","echo":false,"logprobs":2}"#);
        assert_eq!(r.common.sampling.prompt_logprobs, None);
        let r = p(r#"{"model":"m","prompt":"a","echo":true}"#);
        assert!(r.echo);
        assert_eq!(r.common.sampling.prompt_logprobs, None);
        let r = p(r#"{"model":"m","prompt":"a","echo":true,"logprobs":3,"max_tokens":0}"#);
        assert_eq!(r.common.sampling.prompt_logprobs, Some(3));
        assert_eq!(r.common.sampling.logprobs, Some(3));
        assert_eq!(r.common.max_tokens, Some(0));
        let r = p(r#"{"model":"m","prompt":[[1,2]],"echo":true,"logprobs":0,"max_tokens":1}"#);
        assert_eq!(r.common.sampling.prompt_logprobs, Some(0));
        // Nothing to generate and no logprobs: scored all the same (the
        // prompt is the answer), none shown.
        let r = p(r#"{"model":"m","prompt":"a","echo":true,"max_tokens":0}"#);
        assert_eq!(r.common.sampling.prompt_logprobs, Some(0));
        assert_eq!(r.common.sampling.logprobs, None);
        let e = CompletionRequest::parse(br#"{"model":"m","prompt":"a","echo":"yes"}"#);
        assert_eq!(param_of(e.unwrap_err()), "echo");
    }

    #[test]
    fn chunks_have_openai_shape() {
        let meta = ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            calls: None,
            endpoint: Endpoint::Chat,
        };
        let first = meta.chunk(0, true, None, None, false);
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["index"], 0);
        let second = meta.chunk(2, false, Some("x"), None, false);
        assert_eq!(second["choices"][0]["index"], 2);
        assert_eq!(second["choices"][0]["delta"]["content"], "x");
        assert_eq!(first["object"], "chat.completion.chunk");
        let last = meta.chunk(0, false, None, Some(FinishReason::Length), true);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["usage"].is_null() && last.get("usage").is_some());
        let usage = meta.usage_chunk(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            cached_tokens: 2,
        });
        assert_eq!(usage["usage"]["total_tokens"], 7);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(usage["choices"], serde_json::json!([]));
    }
}
