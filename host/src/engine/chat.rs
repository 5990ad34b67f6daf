//! Chat templates: the model's own `tokenizer.chat_template`, rendered with
//! minijinja, tokenized so that the template's special tokens are single tokens
//! and the users' content can never smuggle one in.
//!
//! The template is rendered as HuggingFace's `apply_chat_template` renders it
//! (Jinja2 with `trim_blocks` and `lstrip_blocks`, loop controls, Python's
//! string methods, `raise_exception`, `tojson`); `tests/chat_templates.rs`
//! holds the real templates of each family to Jinja2's own output.
//!
//! 1. Render the template with every text of the request replaced by a
//!    sentinel (private-use characters that no template alters), and again
//!    with the texts themselves: the text the model was trained on. The texts
//!    are each message's content and, with tools, every string of the tools
//!    and of the assistant's earlier tool calls (names, descriptions, and each
//!    key and string of a parameter schema or of arguments): everything a
//!    tenant wrote. An empty text stays empty (nothing to place).
//! 2. Find what the template made of each text: verbatim, or as the inside of
//!    a JSON string (where `tojson` wrote it: a sentinel carries a `"`, which
//!    JSON writes `\"`, so each place says which), and each content verbatim
//!    or trimmed (as Llama 3's and Gemma's templates do) — whichever, put in
//!    place of the sentinels, gives exactly the second rendering. Each content
//!    must be placed exactly once, in order; a tool's texts any number of
//!    times. A template that does anything else with a text is refused for
//!    that conversation, never tokenized as something other than what it
//!    renders.
//! 3. Split the sentinel rendering on the sentinels; tokenize template text
//!    with special-token parsing on, and each placed text with it off, and
//!    concatenate.
//!
//! Tool calls carry ids the template may write (Mistral's must be nine
//! letters or digits): the server's own, the call's place in the
//! conversation written as nine digits, never a tenant's text.
//!
//! Rendering is bounded: [`RENDER_FUEL`] instructions per conversation, so a
//! model file's template that loops cannot stall a request.

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer, TokenizerError};
use serde_json::{Map, Value};
use std::borrow::Cow;

/// Most messages in one conversation.
pub const MESSAGES_MAX: usize = 1024;

/// Most template instructions one rendering may run (minijinja's fuel): a real
/// template takes a few hundred per message.
pub const RENDER_FUEL: u64 = 4_000_000;

/// One chat message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// "system", "user", "assistant", "tool".
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant message's calls of the request's tools.
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's answer to: which call of the conversation (counted
    /// over all its assistant messages' calls, from 0).
    pub answers: Option<usize>,
}

/// A call of a tool, in an assistant message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments.
    pub arguments: Map<String, Value>,
}

/// A function the model may call, as the template shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its parameters' JSON Schema.
    pub parameters: Option<Value>,
}

/// Why a conversation could not be turned into tokens.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The model has no usable template.
    #[error("chat template: {0}")]
    Template(String),
    /// More messages than [`MESSAGES_MAX`].
    #[error("{0} messages; at most {MESSAGES_MAX} are accepted")]
    TooManyMessages(usize),
    /// The rendered template lost, reordered or rewrote a message.
    #[error(
        "the chat template did not place every message's content exactly once, in order, \
         verbatim or trimmed, and every text of the tools verbatim or as JSON"
    )]
    ContentNotPlaced,
    /// Tokenization failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// How it teaches the model to write a call, where it shows tools.
    markup: Option<CallMarkup>,
}

/// How a template teaches the model to write a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallMarkup {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in
    /// the text (Qwen 2.5 and 3, Hermes).
    Hermes,
    /// The whole answer a JSON object `{"name": ..., "parameters": {...}}`
    /// (Llama 3.1 and 3.2).
    BareJson,
}

const TEMPLATE_NAME: &str = "chat";

/// What stands for text `index` in the sentinel rendering: its `"` tells
/// whether the template wrote it as it is or inside a JSON string.
fn sentinel(index: usize) -> String {
    format!("\u{E000}bulkhead-{index}\"\u{E001}")
}

/// A tenant's text of the conversation, and whether it is a message's content.
#[derive(Clone, Copy)]
struct Piece<'m> {
    text: &'m str,
    content: bool,
}

/// Where the sentinel rendering holds a sentinel.
struct Place {
    start: usize,
    end: usize,
    piece: usize,
    /// Written inside a JSON string (escaped).
    json: bool,
}

/// Every sentinel of `rendered`, in order; `None` when one was cut or altered.
fn places(rendered: &str) -> Option<Vec<Place>> {
    let mut places = Vec::new();
    let mut from = 0;
    while let Some(at) = rendered[from..].find('\u{E000}') {
        let start = from + at;
        let rest = rendered[start + '\u{E000}'.len_utf8()..].strip_prefix("bulkhead-")?;
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let piece: usize = rest[..digits].parse().ok()?;
        let rest = &rest[digits..];
        let (json, rest) = match rest.strip_prefix("\\\"") {
            Some(rest) => (true, rest),
            None => (false, rest.strip_prefix('"')?),
        };
        let rest = rest.strip_prefix('\u{E001}')?;
        let end = rendered.len() - rest.len();
        places.push(Place {
            start,
            end,
            piece,
            json,
        });
        from = end;
    }
    Some(places)
}

/// Where text was placed, how: the tenant's text as it stands in the
/// rendering (the contents trimmed when `trimmed`).
fn placed<'m>(piece: Piece<'m>, json: bool, trimmed: bool) -> Cow<'m, str> {
    let text = if trimmed && piece.content {
        piece.text.trim()
    } else {
        piece.text
    };
    if json {
        let quoted = serde_json::to_string(text).unwrap_or_default();
        let inside = quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or("");
        Cow::Owned(inside.to_string())
    } else {
        Cow::Borrowed(text)
    }
}

/// Whether `with_sentinels`, each sentinel replaced by its text as placed,
/// is exactly `text`: one pass over both, so a long conversation costs its
/// length, not its length times its messages.
fn fills(
    with_sentinels: &str,
    places: &[Place],
    pieces: &[Piece],
    trimmed: bool,
    text: &str,
) -> bool {
    let (mut cursor, mut last) = (text, 0);
    for place in places {
        let Some(after) = cursor
            .strip_prefix(&with_sentinels[last..place.start])
            .and_then(|c| c.strip_prefix(&*placed(pieces[place.piece], place.json, trimmed)))
        else {
            return false;
        };
        (cursor, last) = (after, place.end);
    }
    cursor == &with_sentinels[last..]
}

/// A conversation's texts become sentinels (`pieces` collects them), or stay
/// as they are (`pieces` is `None`).
struct Marker<'p, 'm> {
    pieces: Option<&'p mut Vec<Piece<'m>>>,
}

impl<'m> Marker<'_, 'm> {
    fn text(&mut self, text: &'m str, content: bool) -> String {
        match &mut self.pieces {
            Some(pieces) if !text.is_empty() => {
                pieces.push(Piece { text, content });
                sentinel(pieces.len() - 1)
            }
            _ => text.to_string(),
        }
    }

    /// A JSON value with each key and string marked.
    fn value(&mut self, value: &'m Value) -> Value {
        match value {
            Value::String(s) => Value::String(self.text(s, false)),
            Value::Array(items) => Value::Array(items.iter().map(|v| self.value(v)).collect()),
            Value::Object(map) => Value::Object(self.map(map)),
            other => other.clone(),
        }
    }

    fn map(&mut self, map: &'m Map<String, Value>) -> Map<String, Value> {
        map.iter()
            .map(|(k, v)| (self.text(k, false), self.value(v)))
            .collect()
    }
}

/// The id the template is given for call `index` of a conversation.
fn call_id(index: usize) -> String {
    format!("{index:09}")
}

/// `tojson` as transformers defines it for chat templates: Python's
/// `json.dumps` (`", "` and `": "` between items, non-ASCII kept), with
/// its `indent`, `separators`, `sort_keys` and `ensure_ascii`. Not HTML-safe
/// (minijinja's own escapes `<`, `>`, `&` and `'`): the model saw Python's.
fn tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let value = serde_json::to_value(value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ))
        }
        None => {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_string(), ": ".to_string())
        }
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&value, 0, &mut out);
    Ok(out)
}

struct JsonStyle {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn write(&self, value: &Value, level: usize, out: &mut String) {
        match value {
            Value::String(s) => self.string(s, out),
            Value::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.between(i, level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Value::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    self.between(i, level + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(v, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }

    fn between(&self, i: usize, level: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        self.newline(level, out);
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', indent * level));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template as found in GGUF metadata).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = minijinja::Environment::new();
        // Jinja2 as transformers configures it for chat templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            markup: if !source.contains("tools") {
                None
            } else if source.contains("<tool_call>") {
                Some(CallMarkup::Hermes)
            } else if source.contains(r#"{"name": function name, "parameters": "#) {
                Some(CallMarkup::BareJson)
            } else {
                None
            },
        })
    }

    /// How the template teaches the model to write a call (so that a call
    /// can be read out of its free text), where it shows tools at all.
    pub fn call_markup(&self) -> Option<CallMarkup> {
        self.markup
    }

    /// The template stored in a model file (`tokenizer.chat_template`), with the
    /// tokenizer's BOS/EOS spellings; `Ok(None)` when the file has none.
    pub fn from_model(
        gguf: &Gguf,
        tokenizer: &Tokenizer,
    ) -> Result<Option<ChatTemplate>, ChatError> {
        let Ok(source) = gguf.str("tokenizer.chat_template") else {
            return Ok(None);
        };
        let piece = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id).ok())
                .unwrap_or_default()
        };
        ChatTemplate::new(source, piece(tokenizer.bos()), piece(tokenizer.eos())).map(Some)
    }

    /// Renders the conversation with its texts as `marker` makes them.
    fn render_with<'m>(
        &self,
        messages: &'m [Message],
        tools: &'m [Tool],
        mut marker: Marker<'_, 'm>,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let mut calls = 0;
        let mut rendered: Vec<Value> = Vec::with_capacity(messages.len());
        for m in messages {
            let mut message = Map::new();
            message.insert("role".into(), m.role.clone().into());
            message.insert("content".into(), marker.text(&m.content, true).into());
            if !m.tool_calls.is_empty() {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .map(|call| {
                        calls += 1;
                        serde_json::json!({
                            "id": call_id(calls - 1),
                            "type": "function",
                            "function": {
                                "name": marker.text(&call.name, false),
                                "arguments": marker.map(&call.arguments),
                            },
                        })
                    })
                    .collect();
                message.insert("tool_calls".into(), calls.into());
            }
            if let Some(answers) = m.answers {
                message.insert("tool_call_id".into(), call_id(answers).into());
            }
            rendered.push(Value::Object(message));
        }
        let tools: Vec<Value> = tools
            .iter()
            .map(|tool| {
                let mut function = Map::new();
                function.insert("name".into(), marker.text(&tool.name, false).into());
                if let Some(description) = &tool.description {
                    function.insert("description".into(), marker.text(description, false).into());
                }
                if let Some(parameters) = &tool.parameters {
                    function.insert("parameters".into(), marker.value(parameters));
                }
                serde_json::json!({"type": "function", "function": function})
            })
            .collect();
        let messages = minijinja::Value::from_serialize(&rendered);
        let bos_token = self.bos_token.clone();
        let eos_token = self.eos_token.clone();
        let result = if tools.is_empty() {
            template.render(minijinja::context! {
                messages, add_generation_prompt => true, bos_token, eos_token,
            })
        } else {
            let tools = minijinja::Value::from_serialize(&tools);
            template.render(minijinja::context! {
                messages, tools, add_generation_prompt => true, bos_token, eos_token,
            })
        };
        result.map_err(|e| ChatError::Template(e.to_string()))
    }

    /// The conversation as the template renders it, ready for the
    /// assistant's reply: the text `tokens` tokenizes (for tests, and for
    /// operators checking a model's template).
    pub fn render(&self, messages: &[Message]) -> Result<String, ChatError> {
        self.render_tools(messages, &[])
    }

    /// [`ChatTemplate::render`], the model offered `tools`.
    pub fn render_tools(&self, messages: &[Message], tools: &[Tool]) -> Result<String, ChatError> {
        self.render_with(messages, tools, Marker { pieces: None })
    }

    /// The sentinel rendering, its sentinels' places, the texts they stand
    /// for, and whether contents were trimmed (module doc, step 2).
    fn placed<'m>(
        &self,
        messages: &'m [Message],
        tools: &'m [Tool],
    ) -> Result<(String, Vec<Place>, Vec<Piece<'m>>, bool), ChatError> {
        let mut pieces = Vec::new();
        let with_sentinels = self.render_with(
            messages,
            tools,
            Marker {
                pieces: Some(&mut pieces),
            },
        )?;
        let places = places(&with_sentinels)
            .filter(|places| places.iter().all(|p| p.piece < pieces.len()))
            .ok_or(ChatError::ContentNotPlaced)?;
        // Each content exactly once, in order.
        let contents = pieces.iter().enumerate().filter(|(_, p)| p.content);
        let placed_contents = places.iter().filter(|p| pieces[p.piece].content);
        if !contents
            .map(|(i, _)| i)
            .eq(placed_contents.map(|p| p.piece))
        {
            return Err(ChatError::ContentNotPlaced);
        }
        let text = self.render_tools(messages, tools)?;
        for trimmed in [false, true] {
            if fills(&with_sentinels, &places, &pieces, trimmed, &text) {
                return Ok((with_sentinels, places, pieces, trimmed));
            }
        }
        Err(ChatError::ContentNotPlaced)
    }

    /// Renders and tokenizes a conversation, ready for the assistant's reply.
    pub fn tokens(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
    ) -> Result<Vec<u32>, ChatError> {
        self.tokens_max(tokenizer, messages, &[], usize::MAX, &|| false)
    }

    /// [`ChatTemplate::tokens`] with `tools` offered, stopping with
    /// `TokenizerError::TooManyTokens` once the conversation has more than
    /// `tokens_max` tokens, and with `TokenizerError::Stopped` once `stopped`
    /// says so.
    pub fn tokens_max(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tools: &[Tool],
        tokens_max: usize,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Vec<u32>, ChatError> {
        if messages.len() > MESSAGES_MAX {
            return Err(ChatError::TooManyMessages(messages.len()));
        }
        let (rendered, places, pieces, trimmed) = self.placed(messages, tools)?;
        let template_text = EncodeOptions {
            add_bos: false,
            parse_special: true,
        };
        let tenant_text = EncodeOptions {
            add_bos: false,
            parse_special: false,
        };
        let mut ids = Vec::new();
        let mut last = 0;
        for place in &places {
            tokenizer.encode_into_until(
                &rendered[last..place.start],
                template_text,
                tokens_max,
                &mut ids,
                stopped,
            )?;
            let text = placed(pieces[place.piece], place.json, trimmed);
            tokenizer.encode_into_until(&text, tenant_text, tokens_max, &mut ids, stopped)?;
            last = place.end;
        }
        tokenizer.encode_into_until(
            &rendered[last..],
            template_text,
            tokens_max,
            &mut ids,
            stopped,
        )?;
        Ok(ids)
    }
}
