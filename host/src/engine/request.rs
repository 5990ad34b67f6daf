//! The vocabulary of a request between the API layer and the engine: its id,
//! what it asks for, the events it receives, how it ends, and the terminal
//! refusals static admission can give it.

use super::handoff::PrefillRefusal;
use super::sampling::SamplingParams;
use crate::tenancy::TenantId;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request's identity, unique within the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The client went away.
    Cancelled,
    /// The request's deadline passed.
    Timeout,
    /// The engine failed the step (logged with the request id).
    Error,
    /// The server shut down before the request could finish.
    Shutdown,
    /// The operator removed the request's tenant.
    TenantRemoved,
    /// The operator removed the request's model (it was not done by the end
    /// of the unload's drain).
    ModelRemoved,
    /// The engine panicked while the request was in flight; its pool was
    /// dropped and the engine restarts (see [`super::service`]).
    EngineFault,
    /// Decode role: the prompt's KV transfer failed — cut off, timed out,
    /// out of protocol, or refused by the page book's check (I5).
    TransferFailed,
    /// Decode role: the prefill peer refused the job (as a single process
    /// would have refused the request).
    PrefillRefused(PrefillRefusal),
    /// Prefill role: the prompt's KV reached the decode peer and its verdict
    /// is in; the pages are released.
    Exported,
}

impl FinishReason {
    /// The label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Timeout => "timeout",
            FinishReason::Error => "error",
            FinishReason::Shutdown => "shutdown",
            FinishReason::TenantRemoved => "tenant_removed",
            FinishReason::ModelRemoved => "model_removed",
            FinishReason::EngineFault => "engine_fault",
            FinishReason::TransferFailed => "transfer_failed",
            FinishReason::PrefillRefused(_) => "prefill_refused",
            FinishReason::Exported => "exported",
        }
    }
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens whose KV came from the tenant's prefix cache.
    pub cached_tokens: u32,
}

/// A generated token's log probabilities, its alternatives', and their bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's bytes (a piece of a character, for some tokens).
    pub bytes: Vec<u8>,
    /// Its log probability.
    pub logprob: f32,
    /// The likeliest tokens' bytes and log probabilities, most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

/// What the scheduler tells a request's client side.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token's log probabilities (when the request asked for
    /// them), sent before its text: every generated token but an
    /// end-of-generation one has one, including the token that completed a
    /// stop sequence (whose text is cut there).
    Logprob(TokenLogprob),
    /// A prompt token's log probability after the tokens before it (when
    /// the request asked for them): one for each prompt token from the
    /// second on, in order, all before any generated token's event.
    PromptLogprob(TokenLogprob),
    /// New text (whole UTF-8; text that may begin a stop sequence is held back).
    Text(String),
    /// The request ended; nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
}

/// A request as the API layer hands it over, before admission.
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Its tenant (authenticated).
    pub tenant: TenantId,
    /// Prompt tokens (chat template already applied).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// When the request must have finished.
    pub deadline: Instant,
    /// Where its events go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// Mixed into its prefix-cache keys: requests of one tenant share cached
    /// pages only when their salts are equal (none is a salt too).
    pub cache_salt: Option<String>,
    /// Decode role: the prefill peer a gateway's endpoint picker chose
    /// (`x-prefiller-host-port`), as sent; the link takes it only when it
    /// names one of this process's own peers.
    pub prefill_hint: Option<String>,
}

/// [`Rejection::PromptTooLong`]'s message: where `max_tokens` alone fills
/// the context, that (the prompt's bound is then all a client would see:
/// "at least 1 tokens").
fn prompt_too_long(prompt_tokens_min: u64, max_tokens: u32, context_tokens: u32) -> String {
    let context = format!("this model's maximum context length is {context_tokens} tokens");
    if max_tokens >= context_tokens {
        return format!("{context}; max_tokens ({max_tokens}) leaves no room for the prompt");
    }
    format!(
        "{context}; the prompt is at least {prompt_tokens_min} tokens, plus {max_tokens} \
         completion tokens"
    )
}

/// A terminal refusal: it holds no page, queue slot or plugin state, and
/// nothing can turn it back into a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus completion exceed the promised context.
    #[error(
        "this model's maximum context length is {context_tokens} tokens; the request needs {prompt_tokens} prompt \
         + {max_tokens} completion tokens"
    )]
    ContextLengthExceeded {
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Requested completion tokens.
        max_tokens: u32,
        /// The promised context.
        context_tokens: u32,
    },
    /// The prompt cannot fit, and was refused before it was tokenized in full:
    /// by its byte count (its tokens are at least its bytes over the most bytes
    /// a token covers), or when tokenizing passed the context's budget.
    #[error("{}", prompt_too_long(*prompt_tokens_min, *max_tokens, *context_tokens))]
    PromptTooLong {
        /// The fewest tokens the prompt can be.
        prompt_tokens_min: u64,
        /// Requested completion tokens (1 when not given).
        max_tokens: u32,
        /// The promised context.
        context_tokens: u32,
    },
    /// `max_tokens` is zero (and the prompt's log probabilities were not
    /// asked for).
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// The tenant's queue is full.
    #[error("too many requests queued for this tenant")]
    QueueFull,
    /// The tenant was removed while the request was on its way in.
    #[error("this tenant has been removed")]
    TenantRemoved,
    /// Admitted for another model's pool (a bug: refused, never counted in the
    /// wrong page geometry).
    #[error("the request was admitted for another model's engine")]
    ForeignPool,
}

#[cfg(test)]
mod tests {
    use super::Rejection;

    #[test]
    fn a_prompt_refused_unread_is_told_its_bound_or_that_max_tokens_fills_the_context() {
        let refusal = |prompt_tokens_min, max_tokens| Rejection::PromptTooLong {
            prompt_tokens_min,
            max_tokens,
            context_tokens: 8192,
        };
        assert_eq!(
            refusal(1, 100_000).to_string(),
            "this model's maximum context length is 8192 tokens; max_tokens (100000) leaves no \
             room for the prompt"
        );
        assert_eq!(
            refusal(1, 8192).to_string(),
            "this model's maximum context length is 8192 tokens; max_tokens (8192) leaves no \
             room for the prompt"
        );
        assert_eq!(
            refusal(9000, 16).to_string(),
            "this model's maximum context length is 8192 tokens; the prompt is at least 9000 \
             tokens, plus 16 completion tokens"
        );
    }
}
