//! Chat templates: the model's own `tokenizer.chat_template`, rendered with
//! minijinja, tokenized so that the template's special tokens are single tokens
//! and the users' content can never smuggle one in.
//!
//! The template is rendered as HuggingFace's `apply_chat_template` renders it
//! (Jinja2 with `trim_blocks` and `lstrip_blocks`, loop controls, Python's
//! string methods, `raise_exception`, `tojson`); `tests/chat_templates.rs`
//! holds the real templates of each family to Jinja2's own output.
//!
//! 1. Render the template with each message's content replaced by a sentinel
//!    (private-use characters that no template alters), and again with the
//!    contents themselves: the text the model was trained on.
//! 2. Find what the template made of each content: verbatim, or trimmed (as
//!    Llama 3's and Gemma's templates do) — whichever, put in place of the
//!    sentinels, gives exactly the second rendering. A template that does
//!    anything else with a content is refused for that conversation, never
//!    tokenized as something other than what it renders.
//! 3. Split the sentinel rendering on the sentinels; tokenize template text
//!    with special-token parsing on, and each placed content with it off, and
//!    concatenate.
//!
//! Rendering is bounded: [`RENDER_FUEL`] instructions per conversation, so a
//! model file's template that loops cannot stall a request.

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer, TokenizerError};

/// Most messages in one conversation.
pub const MESSAGES_MAX: usize = 1024;

/// Most template instructions one rendering may run (minijinja's fuel): a real
/// template takes a few hundred per message.
pub const RENDER_FUEL: u64 = 4_000_000;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// "system", "user", "assistant".
    pub role: String,
    /// The text.
    pub content: String,
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
         verbatim or trimmed"
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
}

const TEMPLATE_NAME: &str = "chat";

fn sentinel(index: usize) -> String {
    format!("\u{E000}bulkhead-content-{index}\u{E001}")
}

/// Whether `with_sentinels`, each sentinel in order replaced by its `placed`
/// content, is exactly `text`: one pass over both (no copies), so a long
/// conversation costs its length, not its length times its messages.
fn fills(with_sentinels: &str, placed: &[&str], text: &str) -> bool {
    let (mut rest, mut cursor) = (with_sentinels, text);
    for (i, content) in placed.iter().enumerate() {
        let marker = sentinel(i);
        let Some(at) = rest.find(&marker) else {
            return false;
        };
        let Some(after) = cursor
            .strip_prefix(&rest[..at])
            .and_then(|c| c.strip_prefix(content))
        else {
            return false;
        };
        (rest, cursor) = (&rest[at + marker.len()..], after);
    }
    cursor == rest
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
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
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

    /// Renders `messages`, each content given by `content(index, message)`.
    fn render_with(
        &self,
        messages: &[Message],
        content: &dyn Fn(usize, &Message) -> String,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| minijinja::context! { role => m.role.clone(), content => content(i, m) })
            .collect();
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| ChatError::Template(e.to_string()))
    }

    /// The conversation as the template renders it, ready for the
    /// assistant's reply: the text `tokens` tokenizes (for tests, and for
    /// operators checking a model's template).
    pub fn render(&self, messages: &[Message]) -> Result<String, ChatError> {
        self.render_with(messages, &|_, m| m.content.clone())
    }

    /// The sentinel rendering, and each content as the template placed it
    /// (module doc, step 2).
    fn placed<'m>(&self, messages: &'m [Message]) -> Result<(String, Vec<&'m str>), ChatError> {
        let with_sentinels = self.render_with(messages, &|i, _| sentinel(i))?;
        let text = self.render(messages)?;
        let verbatim: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
        let trimmed: Vec<&str> = messages.iter().map(|m| m.content.trim()).collect();
        for placed in [verbatim, trimmed] {
            if fills(&with_sentinels, &placed, &text) {
                return Ok((with_sentinels, placed));
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
        self.tokens_max(tokenizer, messages, usize::MAX, &|| false)
    }

    /// [`ChatTemplate::tokens`], stopping with `TokenizerError::TooManyTokens`
    /// once the conversation has more than `tokens_max` tokens, and with
    /// `TokenizerError::Stopped` once `stopped` says so.
    pub fn tokens_max(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tokens_max: usize,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Vec<u32>, ChatError> {
        if messages.len() > MESSAGES_MAX {
            return Err(ChatError::TooManyMessages(messages.len()));
        }
        let (rendered, placed) = self.placed(messages)?;
        let template_text = EncodeOptions {
            add_bos: false,
            parse_special: true,
        };
        let user_text = EncodeOptions {
            add_bos: false,
            parse_special: false,
        };
        let mut ids = Vec::new();
        let mut rest = rendered.as_str();
        for (i, content) in placed.iter().enumerate() {
            let marker = sentinel(i);
            let at = rest.find(&marker).ok_or(ChatError::ContentNotPlaced)?;
            tokenizer.encode_into_until(
                &rest[..at],
                template_text,
                tokens_max,
                &mut ids,
                stopped,
            )?;
            tokenizer.encode_into_until(content, user_text, tokens_max, &mut ids, stopped)?;
            rest = &rest[at + marker.len()..];
        }
        if rest.contains('\u{E000}') {
            return Err(ChatError::ContentNotPlaced);
        }
        tokenizer.encode_into_until(rest, template_text, tokens_max, &mut ids, stopped)?;
        Ok(ids)
    }
}
