//! Static admission (I1, I2): the capacity contract applied to one request
//! before anything shared is touched. [`Admission::admit`] is the only way to
//! make an [`Admitted`], and only an `Admitted` can be queued and booked; a
//! refusal is a terminal [`Rejection`].

use super::handoff::ExportTo;
use super::request::{NewRequest, Rejection, RequestId};
use crate::tenancy::TenantId;
use bulkhead_kernels::kv::PoolId;

/// A request that passed static admission (I1). Only [`Admission::admit`]
/// makes one, and only an `Admitted` can be queued and booked.
pub struct Admitted {
    pub(super) request: NewRequest,
    pub(super) pages_needed: u32,
    /// Its place in its tenant's queue: higher runs first (FIFO among equals).
    pub(super) priority: u8,
    page_tokens: u32,
    /// The pool whose page geometry `pages_needed` counts in: only that pool's
    /// scheduler takes it.
    pub(super) pool: PoolId,
    /// A prefill job for a decode peer: its prompt's KV goes there, nothing
    /// is generated (see [`super::handoff`]).
    pub(super) export: Option<ExportTo>,
    /// Another choice of the same request (its first), whose prompt this one
    /// shares: it starts once that one's prompt is in KV, to find its pages
    /// in the prefix cache rather than compute them again.
    pub(super) after: Option<RequestId>,
}

/// The priority of a request nothing lowered.
pub const PRIORITY_DEFAULT: u8 = 128;

impl Admitted {
    /// Pages its worst case needs.
    pub fn pages_needed(&self) -> u32 {
        self.pages_needed
    }

    /// Its most generated tokens.
    pub fn max_tokens(&self) -> u32 {
        self.request.max_tokens
    }

    /// Its prompt tokens.
    pub fn prompt_tokens(&self) -> u32 {
        u32::try_from(self.request.prompt.len()).unwrap_or(u32::MAX)
    }

    /// Its priority.
    pub fn priority(&self) -> u8 {
        self.priority
    }

    /// Tightens the request (a policy plugin's adjustments): a lower
    /// `max_tokens` (at least 1) and a lower priority apply; anything higher
    /// is ignored, so an adjustment can never need more than was admitted.
    pub fn tighten(&mut self, max_tokens: Option<u32>, priority: Option<u8>) {
        if let Some(max) = max_tokens.filter(|&m| m >= 1 && m < self.request.max_tokens) {
            self.request.max_tokens = max;
            let total = u64::from(self.prompt_tokens()) + u64::from(max);
            // Smaller than the admitted total, which fit a u32 page count.
            self.pages_needed = total.div_ceil(u64::from(self.page_tokens)) as u32;
        }
        if let Some(p) = priority.filter(|&p| p < self.priority) {
            self.priority = p;
        }
    }

    /// Its id.
    pub fn id(&self) -> RequestId {
        self.request.id
    }

    /// Its tenant.
    pub fn tenant(&self) -> TenantId {
        self.request.tenant
    }
}

/// The static admission check of one model: the capacity contract applied to
/// one request. Made by the model's scheduler ([`super::scheduler::Scheduler::admission`]),
/// so it carries that scheduler's pool: a request admitted for one model can
/// never be queued (and counted in pages) by another.
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    /// The promised context (I2 guarantees every stage holds it).
    pub(super) context_tokens: u32,
    /// Tokens per KV page.
    pub(super) page_tokens: u32,
    /// The pool it admits for.
    pub(super) pool: PoolId,
}

impl Admission {
    /// The promised context.
    pub fn context_tokens(&self) -> u32 {
        self.context_tokens
    }

    /// The most prompt tokens a request asking for `max_tokens` can have (when
    /// not given, at least one token is generated): tokenization stops past it.
    pub fn prompt_tokens_max(&self, max_tokens: Option<u32>) -> u64 {
        let max_tokens = max_tokens.unwrap_or(1).max(1);
        u64::from(self.context_tokens).saturating_sub(u64::from(max_tokens))
    }

    /// Refuses a prompt known to be at least `prompt_tokens_min` tokens when
    /// that alone cannot fit with `max_tokens`.
    pub fn check_size(
        &self,
        prompt_tokens_min: u64,
        max_tokens: Option<u32>,
    ) -> Result<(), Rejection> {
        if prompt_tokens_min > self.prompt_tokens_max(max_tokens) {
            return Err(self.too_long(prompt_tokens_min, max_tokens));
        }
        Ok(())
    }

    /// The refusal of a prompt of at least `prompt_tokens_min` tokens.
    pub fn too_long(&self, prompt_tokens_min: u64, max_tokens: Option<u32>) -> Rejection {
        Rejection::PromptTooLong {
            prompt_tokens_min,
            max_tokens: max_tokens.unwrap_or(1).max(1),
            context_tokens: self.context_tokens,
        }
    }

    /// Checks a prompt of `prompt_tokens` with `max_tokens` against the
    /// contract, as [`Admission::admit`] does, holding nothing: what a
    /// request must pass before anything shared (a plugin's `route` and its
    /// state) sees it (I1). `max_tokens` may be 0 only where the request
    /// `scores` its prompt (asks for its log probabilities: they are the
    /// answer).
    pub fn check(
        &self,
        prompt_tokens: usize,
        max_tokens: u32,
        scores: bool,
    ) -> Result<(), Rejection> {
        let prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        if prompt_tokens == 0 {
            return Err(Rejection::EmptyPrompt);
        }
        if max_tokens == 0 && !scores {
            return Err(Rejection::ZeroMaxTokens);
        }
        let total = u64::from(prompt_tokens) + u64::from(max_tokens);
        if total > u64::from(self.context_tokens) {
            return Err(Rejection::ContextLengthExceeded {
                prompt_tokens,
                max_tokens,
                context_tokens: self.context_tokens,
            });
        }
        Ok(())
    }

    /// Checks `request` against the contract; touches nothing shared.
    pub fn admit(&self, request: NewRequest) -> Result<Admitted, Rejection> {
        self.check(
            request.prompt.len(),
            request.max_tokens,
            request.sampling.prompt_logprobs.is_some(),
        )?;
        let prompt_tokens = u32::try_from(request.prompt.len()).unwrap_or(u32::MAX);
        let total = u64::from(prompt_tokens) + u64::from(request.max_tokens);
        // total <= context_tokens <= u32::MAX, so this fits.
        let pages_needed = total.div_ceil(u64::from(self.page_tokens)) as u32;
        Ok(Admitted {
            request,
            pages_needed,
            priority: PRIORITY_DEFAULT,
            page_tokens: self.page_tokens,
            pool: self.pool,
            export: None,
            after: None,
        })
    }

    /// Checks a prefill job of a decode peer: the same contract as the
    /// request it is for (its prompt, its `max_tokens`), so the refusal is
    /// the one the client would get from a single process; it books only
    /// the prompt's pages, generates nothing, and hands its KV to `export`.
    pub fn admit_prefill(
        &self,
        request: NewRequest,
        export: ExportTo,
    ) -> Result<Admitted, Rejection> {
        self.check(
            request.prompt.len(),
            request.max_tokens,
            request.sampling.prompt_logprobs.is_some(),
        )?;
        // prompt < context_tokens <= u32::MAX, so this fits.
        let pages_needed =
            (request.prompt.len() as u64).div_ceil(u64::from(self.page_tokens)) as u32;
        Ok(Admitted {
            request,
            pages_needed,
            priority: PRIORITY_DEFAULT,
            page_tokens: self.page_tokens,
            pool: self.pool,
            export: Some(export),
            after: None,
        })
    }
}
