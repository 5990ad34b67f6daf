//! Chat templates: the model's own `tokenizer.chat_template`, rendered with
//! minijinja, tokenized so that the template's special tokens are single tokens
//! and the users' content can never smuggle one in.
//!
//! 1. Render the template with each message's content replaced by a sentinel
//!    (private-use characters that no template alters).
//! 2. Split the rendered text on the sentinels.
//! 3. Tokenize template text with special-token parsing on, and each message's
//!    content with it off, and concatenate.

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer, TokenizerError};

/// Most messages in one conversation.
pub const MESSAGES_MAX: usize = 1024;

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
    /// The rendered template lost or reordered a message.
    #[error("the chat template did not place every message's content exactly once, in order")]
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

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template as found in GGUF metadata).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = minijinja::Environment::new();
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

    /// Renders `messages` with each content replaced by its sentinel.
    fn render_with_sentinels(&self, messages: &[Message]) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| minijinja::context! { role => m.role.clone(), content => sentinel(i) })
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
        let rendered = self.render_with_sentinels(messages)?;
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
        for (i, message) in messages.iter().enumerate() {
            let marker = sentinel(i);
            let at = rest.find(&marker).ok_or(ChatError::ContentNotPlaced)?;
            tokenizer.encode_into_until(
                &rest[..at],
                template_text,
                tokens_max,
                &mut ids,
                stopped,
            )?;
            tokenizer.encode_into_until(
                &message.content,
                user_text,
                tokens_max,
                &mut ids,
                stopped,
            )?;
            rest = &rest[at + marker.len()..];
        }
        if rest.contains('\u{E000}') {
            return Err(ChatError::ContentNotPlaced);
        }
        tokenizer.encode_into_until(rest, template_text, tokens_max, &mut ids, stopped)?;
        Ok(ids)
    }
}
