//! Tool calls (OpenAI's `tools` and `tool_choice`): the functions a request
//! offers, the conversation's earlier calls and their results, and an answer
//! that calls.
//!
//! The model is shown the tools by its own chat template (where it has a
//! place for them: Qwen, Llama 3.1+, Mistral, ...), each text of them
//! tokenized as a tenant's text, never as the template's special tokens
//! (`engine/chat.rs`). What it may answer depends on `tool_choice`:
//!
//! - `"none"` (and no tools): text, as without tools.
//! - a named function (`{"type": "function", "function": {"name": ...}}`):
//!   the output is that function's arguments, an instance of its
//!   `parameters` schema, enforced token by token as a `json_schema` is
//!   (`engine/schema.rs`).
//! - `"required"`: the output is a JSON array of one or more calls (at most
//!   one with `parallel_tool_calls: false`), each `{"name": N, "arguments":
//!   A}` with `A` an instance of `N`'s parameters. The calls are told apart
//!   by their name, written first: the recognizer reads one call object
//!   whatever the number of tools, and goes on as that tool's once its name
//!   is written (`Node::Tagged` in `engine/schema.rs`).
//! - `"auto"` (the default once tools are given): the model answers as it
//!   likes, and its calls are read out of its text in the markup its
//!   template teaches: Hermes' `<tool_call>{"name": ..., "arguments":
//!   {...}}</tool_call>` blocks (Qwen 2.5 and 3), or an answer that is
//!   nothing but `{"name": ..., "parameters": {...}}` objects (Llama 3.1 and
//!   3.2, after an optional `<|python_tag|>`, several joined by `;`). For a
//!   template that teaches neither (SmolLM2's shows no tools; Mistral's
//!   `[TOOL_CALLS]` is a control token the output leaves out) `auto` is
//!   refused (400) with what to use instead. What is not a call of an
//!   offered tool with an object of arguments stays text.
//!
//! A required or named answer is `message.tool_calls` (`content` null) with
//! `finish_reason: "tool_calls"`; streamed, each call's id and name come in
//! one chunk and its arguments in the chunks that follow, as they are
//! generated ([`CallsWriter`]). An `auto` answer is its text outside the
//! calls as `content`, and its calls, each whole once its block closes (a
//! bare answer's at the end: until then it may still turn out to be text);
//! `finish_reason` is `tool_calls` where it called.

use super::error::ApiError;
use super::openai::{invalid, unsupported};
use crate::engine::chat::Tool;
use crate::engine::pattern::AUTOMATA_BYTES_MAX;
use crate::engine::schema::Schema;
use serde_json::{json, Map, Value};

/// Most tools one request may offer (OpenAI's limit).
pub const TOOLS_MAX: usize = 128;

/// What a request lets the model do with its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text.
    None,
    /// Call tools or answer in text.
    Auto,
    /// Call one or more tools.
    Required,
    /// Call this function.
    Named(String),
}

/// How an answer's output becomes tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallsOut {
    /// The output is this function's arguments.
    Named(String),
    /// The output is a JSON array of `{"name", "arguments"}`.
    Listed,
    /// The output is text, with calls of these tools in Hermes' markup
    /// (`auto`, before the model is known: any markup).
    Tagged(Vec<String>),
    /// The output is text, or calls of these tools as bare JSON objects
    /// (Llama's `{"name": ..., "parameters": {...}}`, several joined by `;`).
    Bare(Vec<String>),
}

/// What Llama writes before a call to its built-in tools, and at times
/// before any call.
const PYTHON_TAG: &str = "<|python_tag|>";

/// Hermes' markup around a call.
const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// `tools`: at most [`TOOLS_MAX`] functions, each named as OpenAI requires
/// (1 to 64 letters, digits, `_` or `-`), named once, with an object schema
/// for parameters where one is given.
pub fn tools_of(value: Value) -> Result<Vec<Tool>, ApiError> {
    const PARAM: &str = "tools";
    let Value::Array(items) = value else {
        return Err(invalid(PARAM, "must be an array of tools"));
    };
    if items.len() > TOOLS_MAX {
        return Err(invalid(PARAM, format!("at most {TOOLS_MAX} tools")));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let param = format!("{PARAM}[{i}]");
        let Value::Object(mut item) = item else {
            return Err(invalid(&param, "must be an object"));
        };
        if item.get("type").and_then(Value::as_str) != Some("function") {
            return Err(unsupported(
                &format!("{param}.type"),
                "must be \"function\" (the only kind of tool this server offers)",
            ));
        }
        let Some(Value::Object(mut function)) = item.remove("function") else {
            return Err(invalid(&format!("{param}.function"), "must be an object"));
        };
        let param = format!("{param}.function");
        let name = match function.remove("name") {
            Some(Value::String(name)) if is_name(&name) => name,
            _ => {
                return Err(invalid(
                    &format!("{param}.name"),
                    "must be 1 to 64 letters, digits, '_' or '-'",
                ))
            }
        };
        if tools.iter().any(|t| t.name == name) {
            return Err(invalid(
                &format!("{param}.name"),
                format!("{name:?} names two tools"),
            ));
        }
        let description = match function.remove("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d),
            Some(_) => return Err(invalid(&format!("{param}.description"), "must be a string")),
        };
        let parameters = match function.remove("parameters") {
            None | Some(Value::Null) => None,
            Some(p) if p.get("type").and_then(Value::as_str) == Some("object") => Some(p),
            Some(_) => {
                return Err(invalid(
                    &format!("{param}.parameters"),
                    "must be a JSON Schema of \"type\": \"object\"",
                ))
            }
        };
        match function.remove("strict") {
            None | Some(Value::Null | Value::Bool(_)) => {}
            Some(_) => return Err(invalid(&format!("{param}.strict"), "must be a boolean")),
        }
        if let Some(key) = function.keys().next() {
            return Err(ApiError::UnknownParam(format!("{param}.{key}")));
        }
        tools.push(Tool {
            name,
            description,
            parameters,
        });
    }
    Ok(tools)
}

/// OpenAI's rule for function names.
pub fn is_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tool_choice` (absent: `auto` with tools, `none` without).
pub fn tool_choice_of(value: Option<Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    const PARAM: &str = "tool_choice";
    let choice = match value {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(invalid(
                    PARAM,
                    "must be \"none\", \"auto\", \"required\" or a named function",
                ))
            }
        },
        Some(value) => {
            let name = value
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| value.get("type").and_then(Value::as_str) == Some("function"));
            let Some(name) = name else {
                return Err(invalid(
                    PARAM,
                    "a named function is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            };
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    PARAM,
                    format!("names {name:?}, which is not among the request's tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    };
    match choice {
        ToolChoice::Required | ToolChoice::Auto if tools.is_empty() => {
            Err(invalid(PARAM, "needs at least one tool in tools"))
        }
        choice => Ok(choice),
    }
}

/// Why `auto` is refused for a model whose template does not read calls.
pub fn auto_refused() -> ApiError {
    unsupported(
        "tool_choice",
        "\"auto\" (the default when tools are given) is not supported for this model: its chat \
         template writes no tool calls in a markup this server reads (Hermes' <tool_call>); give \
         \"required\" or a named function, or \"none\"",
    )
}

/// The constraint on the output, and how it becomes calls, for `choice`
/// (`auto`: none, and no constraint: see [`CallsOut::Tagged`]).
pub fn constraint_of(
    choice: &ToolChoice,
    tools: &[Tool],
    parallel: bool,
) -> Result<Option<(Schema, CallsOut)>, ApiError> {
    // The tools' patterns (compiled alone, then together) share one
    // budget of automata: a request's tools cost at most twice a schema's.
    let mut budget = AUTOMATA_BYTES_MAX;
    let mut compile = |document: &Value, param: &str| {
        Schema::compile_within(document, &mut budget)
            .map_err(|e| invalid(param, format!("the parameters: {e}")))
    };
    match choice {
        ToolChoice::None | ToolChoice::Auto => Ok(None),
        ToolChoice::Named(name) => {
            let (i, tool) = tools
                .iter()
                .enumerate()
                .find(|(_, t)| &t.name == name)
                .expect("tool_choice_of checked the name");
            let schema = compile(
                &parameters_of(tool),
                &format!("tools[{i}].function.parameters"),
            )?;
            Ok(Some((schema, CallsOut::Named(name.clone()))))
        }
        ToolChoice::Required => {
            // Each tool's parameters under $defs, their own references moved there.
            let mut defs = Map::new();
            let mut alternatives = Vec::with_capacity(tools.len());
            for (i, tool) in tools.iter().enumerate() {
                // Alone first: an error names the tool and where in its parameters.
                compile(
                    &parameters_of(tool),
                    &format!("tools[{i}].function.parameters"),
                )?;
                let at = format!("#/$defs/t{i}");
                defs.insert(format!("t{i}"), rebased(&parameters_of(tool), &at));
                alternatives.push(json!({
                    "type": "object",
                    "properties": {"name": {"const": tool.name}, "arguments": {"$ref": at}},
                    "required": ["name", "arguments"],
                }));
            }
            let mut document = json!({
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": alternatives},
                "$defs": defs,
            });
            if !parallel {
                document["maxItems"] = 1.into();
            }
            // (Together they may pass a bound each passes alone: the nodes'.)
            let schema = Schema::compile_together(&document)
                .map_err(|e| invalid("tools", format!("the tools' parameters together: {e}")))?;
            Ok(Some((schema, CallsOut::Listed)))
        }
    }
}

/// A tool's parameters, `{}` of an object where none are given.
fn parameters_of(tool: &Tool) -> Value {
    tool.parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
}

/// `schema` with its references into itself (`#...`) made references into
/// the document it is placed at `at` in. Values that are data, not schemas
/// (`const`, `enum`, `default`, `examples`), are left as they are.
fn rebased(schema: &Value, at: &str) -> Value {
    match schema {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("$ref", Value::String(r)) if r.starts_with('#') => {
                            Value::String(format!("{at}{}", &r[1..]))
                        }
                        ("const" | "enum" | "default" | "examples", v) => v.clone(),
                        (_, v) => rebased(v, at),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|v| rebased(v, at)).collect()),
        other => other.clone(),
    }
}

/// Where the listed output's reading is, within one call object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    Key,
    Value,
}

/// Turns a constrained output, as it is generated, into tool calls: the
/// `tool_calls` entries of stream deltas ([`CallsWriter::push`]), and the
/// calls so far ([`CallsWriter::calls`]).
#[derive(Clone, Debug)]
pub struct CallsWriter {
    out: CallsOut,
    /// Each call's id begins with this.
    id_prefix: String,
    /// `(name, arguments)` of each call begun.
    calls: Vec<(String, String)>,
    /// Tagged: text not yet given out (a possible beginning of a block, or
    /// a block not yet closed), and whether it is inside a block. Bare: the
    /// output so far while it may be calls, and whether it is text.
    held: String,
    inside: bool,
    text: bool,
    // The listed output's reading: containers open, inside a string (and
    // after a backslash in it), the key being read or last read at a call's
    // level, where at that level, whether the bytes are a call's arguments.
    depth: u32,
    in_string: bool,
    escape: bool,
    key: Vec<u8>,
    at: At,
    name: Option<Vec<u8>>,
    in_arguments: bool,
}

impl CallsWriter {
    /// A writer for one choice; its calls' ids are `{id_prefix}{k}`.
    pub fn new(out: CallsOut, id_prefix: String) -> CallsWriter {
        CallsWriter {
            out,
            id_prefix,
            calls: Vec::new(),
            held: String::new(),
            inside: false,
            text: false,
            depth: 0,
            in_string: false,
            escape: false,
            key: Vec::new(),
            at: At::Key,
            name: None,
            in_arguments: false,
        }
    }

    /// What `text` (the output's next piece) adds: text to give out as
    /// content (tagged only), and `tool_calls` entries: a call's first entry
    /// has its index, id, type and name, the others the arguments' next
    /// text.
    pub fn push(&mut self, text: &str) -> Pushed {
        let mut entries = Vec::new();
        let mut content = String::new();
        if let CallsOut::Tagged(_) = self.out {
            self.held.push_str(text);
            // (The names lent out of `out` while the blocks are read.)
            let out = std::mem::replace(&mut self.out, CallsOut::Listed);
            if let CallsOut::Tagged(names) = &out {
                self.read_tagged(names, &mut content, &mut entries);
            }
            self.out = out;
            return Pushed { content, entries };
        }
        match &self.out {
            // (Read above.)
            CallsOut::Tagged(_) => {}
            CallsOut::Bare(_) if self.text => content.push_str(text),
            CallsOut::Bare(_) => {
                self.held.push_str(text);
                // Calls begin with '{' (after the tag, if any): anything
                // else is text from its first byte.
                let start = self.held.trim_start();
                let may_call = match start.strip_prefix(PYTHON_TAG) {
                    Some(after) => {
                        let after = after.trim_start();
                        after.is_empty() || after.starts_with('{')
                    }
                    None => PYTHON_TAG.starts_with(start) || start.starts_with('{'),
                };
                if !may_call {
                    self.text = true;
                    content = std::mem::take(&mut self.held);
                }
            }
            CallsOut::Named(name) => {
                if self.calls.is_empty() {
                    self.calls.push((name.clone(), String::new()));
                    entries.push(self.header(0));
                }
                if !text.is_empty() {
                    self.append(text, &mut entries);
                }
            }
            CallsOut::Listed => {
                let mut start: Option<usize> = None;
                for (i, b) in text.bytes().enumerate() {
                    let (argument, named) = self.step(b);
                    if argument && start.is_none() {
                        start = Some(i);
                    }
                    if !argument {
                        if let Some(s) = start.take() {
                            self.append(&text[s..i], &mut entries);
                        }
                    }
                    if let Some(name) = named {
                        self.calls.push((name, String::new()));
                        entries.push(self.header(self.calls.len() - 1));
                    }
                }
                if let Some(s) = start {
                    self.append(&text[s..], &mut entries);
                }
            }
        }
        Pushed { content, entries }
    }

    /// What the end of the output gives out: tagged, the text held (a
    /// block never closed, or what began like one, is text); bare, the calls
    /// the whole output is, or else its text.
    pub fn finish(&mut self) -> Pushed {
        let held = std::mem::take(&mut self.held);
        let mut pushed = Pushed::default();
        match &self.out {
            CallsOut::Bare(names) if !held.is_empty() => match bare_calls(&held, names) {
                Some(calls) => {
                    for call in calls {
                        self.calls.push(call);
                        let k = self.calls.len() - 1;
                        let mut header = self.header(k);
                        header["function"]["arguments"] = self.calls[k].1.clone().into();
                        pushed.entries.push(header);
                    }
                }
                None => pushed.content = held,
            },
            _ if std::mem::take(&mut self.inside) => pushed.content = format!("{OPEN}{held}"),
            _ => pushed.content = held,
        }
        pushed
    }

    /// Whether any call was made.
    pub fn called(&self) -> bool {
        !self.calls.is_empty()
    }

    /// Gives out what `held` lets go of: text before a block, and each
    /// block once closed (a call, or text again where it is not one).
    fn read_tagged(&mut self, names: &[String], content: &mut String, entries: &mut Vec<Value>) {
        loop {
            if !self.inside {
                if let Some(at) = self.held.find(OPEN) {
                    content.push_str(&self.held[..at]);
                    self.held.drain(..at + OPEN.len());
                    self.inside = true;
                    continue;
                }
                // Keep what may be the beginning of a block.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&n| self.held.ends_with(&OPEN[..n]))
                    .unwrap_or(0);
                let upto = self.held.len() - keep;
                content.push_str(&self.held[..upto]);
                self.held.drain(..upto);
                return;
            }
            let Some(at) = self.held.find(CLOSE) else {
                return;
            };
            let block: String = self.held.drain(..at + CLOSE.len()).collect();
            let block = &block[..at];
            self.inside = false;
            match call_of(block, names) {
                Some((name, arguments)) => {
                    self.calls.push((name, arguments));
                    let k = self.calls.len() - 1;
                    let mut header = self.header(k);
                    header["function"]["arguments"] = self.calls[k].1.clone().into();
                    entries.push(header);
                }
                None => {
                    content.push_str(OPEN);
                    content.push_str(block);
                    content.push_str(CLOSE);
                }
            }
        }
    }

    /// The calls so far: `(id, name, arguments)`.
    pub fn calls(&self) -> Vec<(String, String, String)> {
        self.calls
            .iter()
            .enumerate()
            .map(|(k, (name, arguments))| {
                (
                    format!("{}{k}", self.id_prefix),
                    name.clone(),
                    arguments.clone(),
                )
            })
            .collect()
    }

    fn header(&self, k: usize) -> Value {
        json!({
            "index": k,
            "id": format!("{}{k}", self.id_prefix),
            "type": "function",
            "function": {"name": self.calls[k].0, "arguments": ""},
        })
    }

    /// Adds `text` to the last call's arguments: to its entry in `entries`
    /// where it has one (one entry a call a chunk, as OpenAI sends).
    fn append(&mut self, text: &str, entries: &mut Vec<Value>) {
        // (The schema puts each call's name before its arguments.)
        let Some(k) = self.calls.len().checked_sub(1) else {
            return;
        };
        self.calls[k].1.push_str(text);
        match entries.last_mut() {
            Some(entry) if entry["index"] == k => {
                let arguments = &mut entry["function"]["arguments"];
                *arguments = format!("{}{text}", arguments.as_str().unwrap_or("")).into();
            }
            _ => entries.push(json!({"index": k, "function": {"arguments": text}})),
        }
    }

    /// Reads one byte of the listed output: whether it is part of a call's
    /// arguments, and the call's name once it is read.
    fn step(&mut self, b: u8) -> (bool, Option<String>) {
        let argument = self.in_arguments;
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.depth == 2 && !self.in_arguments {
                    if let Some(name) = self.name.take() {
                        return (false, Some(String::from_utf8_lossy(&name).into_owned()));
                    }
                }
                return (argument, None);
            }
            if self.depth == 2 && !self.in_arguments {
                match (self.at, &mut self.name) {
                    (At::Key, _) => self.key.push(b),
                    (At::Value, Some(name)) => name.push(b),
                    _ => {}
                }
            }
            return (argument, None);
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 2 && !self.in_arguments {
                    match self.at {
                        At::Key => self.key.clear(),
                        At::Value if self.key == b"name" => self.name = Some(Vec::new()),
                        At::Value => {}
                    }
                }
            }
            b'{' | b'[' => {
                if self.depth == 2 && self.at == At::Value && self.key == b"arguments" {
                    self.in_arguments = true;
                }
                self.depth += 1;
                if self.depth == 2 {
                    self.at = At::Key;
                }
                return (self.in_arguments, None);
            }
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.in_arguments && self.depth == 2 {
                    self.in_arguments = false;
                }
            }
            b':' if self.depth == 2 && !self.in_arguments => self.at = At::Value,
            b',' if self.depth == 2 && !self.in_arguments => self.at = At::Key,
            _ => {}
        }
        (argument, None)
    }
}

/// What [`CallsWriter::push`] gives out.
#[derive(Debug, Default)]
pub struct Pushed {
    /// Text (a tagged answer's, outside its calls).
    pub content: String,
    /// `tool_calls` entries.
    pub entries: Vec<Value>,
}

/// A Hermes block's call: `{"name": N, "arguments": {...}}` with `N` among
/// `names` (arguments absent: `{}`); its arguments as JSON text.
fn call_of(block: &str, names: &[String]) -> Option<(String, String)> {
    match serde_json::from_str::<Value>(block.trim()) {
        Ok(Value::Object(call)) => call_in(call, names, "arguments"),
        _ => None,
    }
}

/// A call object: its name among `names`, its arguments under `key` an
/// object (absent: `{}`), nothing else.
fn call_in(mut call: Map<String, Value>, names: &[String], key: &str) -> Option<(String, String)> {
    let Some(Value::String(name)) = call.remove("name") else {
        return None;
    };
    if !names.contains(&name) {
        return None;
    }
    let arguments = match call.remove(key) {
        None => Value::Object(Map::new()),
        Some(arguments @ Value::Object(_)) => arguments,
        Some(_) => return None,
    };
    call.is_empty().then(|| (name, arguments.to_string()))
}

/// A bare answer's calls: after an optional `<|python_tag|>`, one or more
/// objects `{"name", "parameters"}` (or `"arguments"`), joined by `;`; the
/// whole answer, or none of it.
fn bare_calls(text: &str, names: &[String]) -> Option<Vec<(String, String)>> {
    let text = text.trim_start();
    let mut rest = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let Some(Ok(Value::Object(call))) = values.next() else {
            return None;
        };
        let key = if call.contains_key("parameters") {
            "parameters"
        } else {
            "arguments"
        };
        calls.push(call_in(call, names, key)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Value) -> Tool {
        Tool {
            name: name.into(),
            description: None,
            parameters: Some(parameters),
        }
    }

    fn weather() -> Value {
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    }

    #[test]
    fn tools_are_read_and_refused_with_the_field_named() {
        let tools = tools_of(json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
             "parameters": weather(), "strict": true}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .unwrap();
        assert_eq!(tools.len(), 2);
        assert_eq!(tools[0].description.as_deref(), Some("Weather."));
        assert_eq!(tools[1].parameters, None);
        let refused = |value: Value| match tools_of(value).unwrap_err() {
            ApiError::InvalidValue { param, .. }
            | ApiError::Unsupported { param, .. }
            | ApiError::UnknownParam(param) => param,
            other => panic!("{other:?}"),
        };
        let f = |function: Value| json!([{"type": "function", "function": function}]);
        assert_eq!(refused(json!({})), "tools");
        assert_eq!(
            refused(json!([{"type": "code_interpreter"}])),
            "tools[0].type"
        );
        assert_eq!(refused(f(json!({"name": "a b"}))), "tools[0].function.name");
        assert_eq!(
            refused(f(json!({"name": "x".repeat(65)}))),
            "tools[0].function.name"
        );
        assert_eq!(
            refused(f(json!({"name": "f", "parameters": {"type": "string"}}))),
            "tools[0].function.parameters"
        );
        assert_eq!(
            refused(f(json!({"name": "f", "returns": {}}))),
            "tools[0].function.returns"
        );
        assert_eq!(
            refused(json!([{"type": "function", "function": {"name": "f"}},
                           {"type": "function", "function": {"name": "f"}}])),
            "tools[1].function.name"
        );
        let many: Vec<Value> = (0..=TOOLS_MAX)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        assert_eq!(refused(Value::Array(many)), "tools");
    }

    #[test]
    fn tool_choice_defaults_and_refusals() {
        let tools = vec![tool("get_weather", weather())];
        assert_eq!(tool_choice_of(None, &[]).unwrap(), ToolChoice::None);
        assert_eq!(
            tool_choice_of(Some(json!("none")), &tools).unwrap(),
            ToolChoice::None
        );
        assert_eq!(
            tool_choice_of(Some(json!("required")), &tools).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            tool_choice_of(
                Some(json!({"type": "function", "function": {"name": "get_weather"}})),
                &tools
            )
            .unwrap(),
            ToolChoice::Named("get_weather".into())
        );
        // auto, by default or by name (refused later where the model's
        // template reads no calls).
        for choice in [None, Some(json!("auto"))] {
            assert_eq!(tool_choice_of(choice, &tools).unwrap(), ToolChoice::Auto);
        }
        for bad in [
            json!("sometimes"),
            json!({"type": "function", "function": {"name": "other"}}),
            json!({"function": {"name": "get_weather"}}),
        ] {
            assert!(tool_choice_of(Some(bad), &tools).is_err());
        }
        assert!(tool_choice_of(Some(json!("required")), &[]).is_err());
        let many: Vec<Tool> = (0..TOOLS_MAX)
            .map(|i| tool(&format!("f{i}"), weather()))
            .collect();
        assert!(tool_choice_of(Some(json!("required")), &many).is_ok());
    }

    #[test]
    fn required_reaches_every_one_of_the_most_tools_with_its_own_arguments() {
        // As many tools as a request may offer, each of its own parameters;
        // names that begin alike ("f1", "f12", "f120").
        let tools: Vec<Tool> = (0..TOOLS_MAX)
            .map(|i| {
                let parameters = json!({"type": "object",
                    "properties": {format!("p{i}"): {"type": "integer", "minimum": i}},
                    "required": [format!("p{i}")], "additionalProperties": false});
                tool(&format!("f{i}"), parameters)
            })
            .collect();
        let (schema, _) = constraint_of(&ToolChoice::Required, &tools, true)
            .unwrap()
            .unwrap();
        for i in [0, 1, 12, 16, 17, 120, TOOLS_MAX - 1] {
            let call = |name: usize, p: usize, v: usize| {
                format!(r#"{{"name":"f{name}","arguments":{{"p{p}":{v}}}}}"#)
            };
            assert!(takes(&schema, &format!("[{}]", call(i, i, i))), "f{i}");
            assert!(takes(
                &schema,
                &format!("[{},{}]", call(i, i, i + 1), call(0, 0, 0))
            ));
            // Another tool's arguments, and its own below its minimum.
            let other = (i + 1) % TOOLS_MAX;
            let wrong = call(i, other, i.max(other));
            assert!(!takes(&schema, &format!("[{wrong}]")), "{wrong}");
            if let Some(below) = i.checked_sub(1) {
                assert!(!takes(&schema, &format!("[{}]", call(i, i, below))), "f{i}");
            }
        }
        assert!(!takes(
            &schema,
            r#"[{"name":"f128","arguments":{"p128":200}}]"#
        ));
        // Together they may hold more nodes than one schema (128 tools of
        // eight properties: 1,400 nodes), up to TOGETHER times as many.
        let wide = |properties: usize| -> Vec<Tool> {
            let parameters = json!({"type": "object", "properties":
                (0..properties).map(|k| (format!("q{k}"), json!({"type": "integer"})))
                    .collect::<Map<_, _>>()});
            (0..TOOLS_MAX)
                .map(|i| tool(&format!("f{i}"), parameters.clone()))
                .collect()
        };
        assert!(constraint_of(&ToolChoice::Required, &wide(8), true).is_ok());
        match constraint_of(&ToolChoice::Required, &wide(40), true).unwrap_err() {
            ApiError::InvalidValue { param, message } => {
                assert_eq!(param, "tools");
                assert!(
                    message.contains("together") && message.contains("4096"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// Whether `schema` takes `text` whole.
    fn takes(schema: &Schema, text: &str) -> bool {
        let mut json = crate::engine::json::Json::new(std::sync::Arc::new(schema.clone()));
        json.push(text.as_bytes()) && json.is_done()
    }

    #[test]
    fn a_requests_tools_share_one_budget_of_pattern_automata() {
        // Each tool's patterns fit the budget alone; sixteen tools' do not.
        let costly = json!({"type": "object", "properties":
            (0..2).map(|i| (format!("p{i}"), json!({"type": "string", "pattern": "(a|b)*a(a|b){8}$"})))
                .collect::<Map<_, _>>()});
        assert!(Schema::compile(&costly).is_ok());
        let tools: Vec<Tool> = (0..16)
            .map(|i| tool(&format!("t{i}"), costly.clone()))
            .collect();
        match constraint_of(&ToolChoice::Required, &tools, true).unwrap_err() {
            ApiError::InvalidValue { param, message } => {
                assert!(param.starts_with("tools[") && param != "tools[0].function.parameters");
                assert!(message.contains("in all"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // A few such tools pass, alone and together.
        assert!(constraint_of(&ToolChoice::Required, &tools[..2], true).is_ok());
    }

    #[test]
    fn required_calls_are_a_list_of_named_arguments_each_of_its_tools_schema() {
        // A tool whose parameters refer into themselves (pydantic's $defs).
        let point = json!({
            "type": "object",
            "properties": {"at": {"$ref": "#/$defs/P"}},
            "required": ["at"],
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}},
        });
        let tools = vec![tool("get_weather", weather()), tool("go", point)];
        let (schema, out) = constraint_of(&ToolChoice::Required, &tools, true)
            .unwrap()
            .unwrap();
        assert_eq!(out, CallsOut::Listed);
        assert!(takes(
            &schema,
            r#"[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"go","arguments":{"at":{"x":3}}}]"#
        ));
        for wrong in [
            r#"[]"#,
            r#"[{"name":"get_weather","arguments":{"at":{"x":3}}}]"#,
            r#"[{"name":"go","arguments":{"at":{"x":"3"}}}]"#,
            r#"[{"name":"other","arguments":{}}]"#,
            r#"[{"arguments":{"city":"Oslo"},"name":"get_weather"}]"#,
        ] {
            assert!(!takes(&schema, wrong), "{wrong}");
        }
        // Not parallel: one call.
        let (one, _) = constraint_of(&ToolChoice::Required, &tools, false)
            .unwrap()
            .unwrap();
        let call = r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#;
        assert!(takes(&one, &format!("[{call}]")));
        assert!(!takes(&one, &format!("[{call},{call}]")));
        // A named function: its arguments alone.
        let (named, out) = constraint_of(&ToolChoice::Named("go".into()), &tools, true)
            .unwrap()
            .unwrap();
        assert_eq!(out, CallsOut::Named("go".into()));
        assert!(takes(&named, r#"{"at":{"x":1}}"#));
        // A keyword the recognizer would not enforce names the tool.
        let loose = vec![
            tool("a", weather()),
            tool(
                "b",
                json!({"type": "object", "properties": {"n": {"type": "string", "pattern": "^(?!a)"}}}),
            ),
        ];
        match constraint_of(&ToolChoice::Required, &loose, true).unwrap_err() {
            ApiError::InvalidValue { param, message } => {
                assert_eq!(param, "tools[1].function.parameters");
                assert!(message.contains("pattern"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_listed_output_streams_each_calls_name_then_its_arguments_however_it_is_cut() {
        let output = r#"[{"name":"get_weather","arguments":{"city":"O\"slo}","n":[1,{"a":2}]}}, {"name" : "go", "arguments" : {}}]"#;
        let whole = {
            let mut w = CallsWriter::new(CallsOut::Listed, "call_".into());
            w.push(output);
            w.calls()
        };
        assert_eq!(
            whole,
            vec![
                (
                    "call_0".to_string(),
                    "get_weather".to_string(),
                    r#"{"city":"O\"slo}","n":[1,{"a":2}]}"#.to_string()
                ),
                ("call_1".to_string(), "go".to_string(), "{}".to_string()),
            ]
        );
        // Cut at every byte, in pieces of every size: the same calls, and
        // the deltas' arguments put together are each call's.
        for size in 1..12 {
            let mut w = CallsWriter::new(CallsOut::Listed, "call_".into());
            let mut streamed: Vec<(String, String)> = Vec::new();
            let bytes = output.as_bytes();
            for piece in bytes.chunks(size) {
                let entries = w.push(std::str::from_utf8(piece).unwrap()).entries;
                let indices: Vec<u64> = entries
                    .iter()
                    .map(|e| e["index"].as_u64().unwrap())
                    .collect();
                assert!(
                    indices.windows(2).all(|w| w[0] < w[1]),
                    "one entry a call: {entries:?}"
                );
                for entry in entries {
                    let k = entry["index"].as_u64().unwrap() as usize;
                    if let Some(name) = entry["function"]["name"].as_str() {
                        assert_eq!(k, streamed.len());
                        assert_eq!(entry["id"], format!("call_{k}"));
                        streamed.push((name.into(), String::new()));
                    }
                    streamed[k]
                        .1
                        .push_str(entry["function"]["arguments"].as_str().unwrap());
                }
            }
            let calls: Vec<(String, String)> = whole
                .iter()
                .map(|(_, n, a)| (n.clone(), a.clone()))
                .collect();
            assert_eq!(streamed, calls, "pieces of {size}");
        }
    }

    #[test]
    fn a_named_output_is_the_arguments_from_the_first_piece() {
        let mut w = CallsWriter::new(CallsOut::Named("go".into()), "call_".into());
        let first = w.push("{\"at\"").entries;
        assert_eq!(first.len(), 1, "one entry a call");
        assert_eq!(first[0]["function"]["name"], "go");
        assert_eq!(first[0]["function"]["arguments"], "{\"at\"");
        assert_eq!(w.push(":1}").entries.len(), 1);
        assert_eq!(
            w.calls(),
            vec![("call_0".into(), "go".into(), "{\"at\":1}".into())]
        );
    }

    /// A tagged answer pushed in pieces of `size`: its content, and its
    /// calls' `(name, arguments)` put together from the entries.
    fn tagged(output: &str, size: usize) -> (String, Vec<(String, String)>, bool) {
        let names = vec!["get_weather".to_string(), "now".to_string()];
        let mut w = CallsWriter::new(CallsOut::Tagged(names), "call_".into());
        let (mut content, mut calls) = (String::new(), Vec::new());
        let chars: Vec<char> = output.chars().collect();
        for piece in chars.chunks(size) {
            let pushed = w.push(&piece.iter().collect::<String>());
            content.push_str(&pushed.content);
            for entry in pushed.entries {
                assert_eq!(entry["index"], calls.len(), "{entry}");
                assert!(entry["id"].as_str().unwrap().starts_with("call_"));
                calls.push((
                    entry["function"]["name"].as_str().unwrap().to_string(),
                    entry["function"]["arguments"].as_str().unwrap().to_string(),
                ));
            }
        }
        let last = w.finish();
        assert!(last.entries.is_empty());
        content.push_str(&last.content);
        (content, calls, w.called())
    }

    #[test]
    fn hermes_blocks_are_read_out_of_text_however_it_is_cut() {
        let output = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich <\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\"}\n</tool_call>";
        for size in [1, 2, 3, 5, 11, 400] {
            let (content, calls, called) = tagged(output, size);
            assert_eq!(content, "Let me check.\n\n", "pieces of {size}");
            assert_eq!(
                calls,
                vec![
                    ("get_weather".into(), r#"{"city":"Zürich <"}"#.into()),
                    ("now".into(), "{}".into())
                ],
                "pieces of {size}"
            );
            assert!(called);
        }
        // Text that only looks like a call stays text: a tool not offered,
        // arguments that are not an object, a block never closed, a '<'.
        for text in [
            "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": {}, \"x\": 1}</tool_call>",
            "<tool_call>not json</tool_call> and on",
            "a <tool_call>{\"name\": \"now\"}",
            "1 < 2 and <tool_ca",
        ] {
            for size in [1, 4, 100] {
                assert_eq!(
                    tagged(text, size),
                    (text.to_string(), vec![], false),
                    "{text}"
                );
            }
        }
    }

    /// A bare answer pushed in pieces of `size`: what was given out as
    /// content before the end, at the end, and the calls.
    fn bare(output: &str, size: usize) -> (String, String, Vec<(String, String)>) {
        let names = vec!["get_weather".to_string(), "now".to_string()];
        let mut w = CallsWriter::new(CallsOut::Bare(names), "call_".into());
        let mut early = String::new();
        let chars: Vec<char> = output.chars().collect();
        for piece in chars.chunks(size) {
            let pushed = w.push(&piece.iter().collect::<String>());
            assert!(pushed.entries.is_empty(), "calls come at the end");
            early.push_str(&pushed.content);
        }
        let last = w.finish();
        let calls = last
            .entries
            .iter()
            .map(|e| {
                (
                    e["function"]["name"].as_str().unwrap().to_string(),
                    e["function"]["arguments"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(w.called(), !last.entries.is_empty());
        (early, last.content, calls)
    }

    #[test]
    fn a_bare_answer_is_all_calls_or_all_text() {
        let one = r#" {"name": "get_weather", "parameters": {"city": "Oslo"}}"#;
        let two = r#"<|python_tag|>{"name": "now", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "X;Y"}}"#;
        for size in [1, 3, 7, 500] {
            assert_eq!(
                bare(one, size),
                (
                    String::new(),
                    String::new(),
                    vec![("get_weather".into(), r#"{"city":"Oslo"}"#.into())]
                )
            );
            assert_eq!(
                bare(two, size).2,
                vec![
                    ("now".to_string(), "{}".to_string()),
                    ("get_weather".to_string(), r#"{"city":"X;Y"}"#.to_string())
                ]
            );
            // Text is given out as it comes, from its first byte.
            let (early, late, calls) = bare("Hello {there}", size);
            assert_eq!(
                (early + &late, calls.len()),
                ("Hello {there}".to_string(), 0)
            );
            // What only looked like calls is text, given out at the end.
            for text in [
                r#"{"name": "rm", "parameters": {}}"#,
                r#"{"a": 1}"#,
                r#"{"name": "now"} and then"#,
                r#"{"name": "now", "parameters": [1]}"#,
                "<|python_tag|>print(1)",
                "<|pyth",
            ] {
                let (early, late, calls) = bare(text, size);
                assert_eq!(early + &late, text, "{text}");
                assert!(calls.is_empty(), "{text}");
            }
        }
    }

    #[test]
    fn rebasing_moves_references_and_leaves_data_alone() {
        let schema = json!({"$ref": "#/$defs/A", "const": {"$ref": "#/x"},
                            "properties": {"$ref": {"$ref": "#"}}});
        assert_eq!(
            rebased(&schema, "#/$defs/t3"),
            json!({"$ref": "#/$defs/t3/$defs/A", "const": {"$ref": "#/x"},
                   "properties": {"$ref": {"$ref": "#/$defs/t3"}}})
        );
    }
}
