//! One generation through the same scheduler that serves HTTP: the path
//! behind `bulkhead generate`, which operators use to check a model before
//! serving it. A single tenant owns the whole pool, sized for this request.

use super::build::{self, BuildError, EngineSpec};
use super::request::{Event, FinishReason, NewRequest, Rejection, RequestId, Usage};
use super::sampling::SamplingParams;
use super::scheduler::TenantLimits;
use crate::tenancy::TenantId;
use bulkhead_kernels::backend::Backend;
use bulkhead_kernels::kv::{KvType, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens per KV page.
pub const PAGE_TOKENS: u32 = 16;
/// Most prompt tokens one prefill step carries.
pub const PREFILL_CHUNK_TOKENS: u32 = 512;
/// Deadline of a command-line generation.
const GENERATE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Why a generation could not run.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// Static admission refused the request.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The engine could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The engine ended the request with an error (see the log).
    #[error("the engine failed the request")]
    Engine,
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Compute threads.
    pub threads: usize,
}

/// What happened.
#[derive(Clone, Debug)]
pub struct GenerateReport {
    /// Token counts.
    pub usage: Usage,
    /// Why it ended.
    pub finish: FinishReason,
    /// Seconds until the first generated token (prefill).
    pub prefill_secs: f64,
    /// Seconds after that (decode).
    pub decode_secs: f64,
    /// The backend's name.
    pub backend: String,
}

/// Generates a completion of `prompt`, calling `on_text` with each piece of text.
pub fn generate(
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    prompt: Vec<u32>,
    options: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateReport, GenerateError> {
    let tenant = TenantId(0);
    let context_tokens = model.config.context_len as u32;
    // One tenant owns the whole pool, sized for this request (and never for
    // more than the context: admission refuses anything larger).
    let total =
        (prompt.len() as u64 + u64::from(options.max_tokens)).min(u64::from(context_tokens));
    // At most the context's pages, which fit a u32.
    let pages = (total.div_ceil(u64::from(PAGE_TOKENS)) as u32).max(1);
    let spec = EngineSpec {
        pool_pages: pages,
        page_tokens: PAGE_TOKENS,
        kv_type: KvType::default(),
        threads: options.threads,
        step_tokens_max: PREFILL_CHUNK_TOKENS,
        step_seqs_max: 1,
        pool_options: PoolOptions::default(),
        placement: crate::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    };
    let tenants = vec![TenantLimits {
        id: tenant,
        name: "cli".into(),
        weight: 1,
        queue_depth_max: 1,
        running_max: 1,
        pages_reserved: pages,
        pages_max: pages,
        prefix_cache: false,
    }];
    let mut scheduler = build::scheduler(&model, &tokenizer, &spec, tenants)?;
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let started = Instant::now();
    let request = NewRequest {
        id: RequestId(1),
        tenant,
        prompt,
        max_tokens: options.max_tokens,
        sampling: options.sampling.clone(),
        stop: Vec::new(),
        deadline: started + GENERATE_TIMEOUT,
        events,
        cache_salt: None,
        prefill_hint: None,
    };
    let admitted = scheduler.admission(context_tokens).admit(request)?;
    let backend_name = scheduler.backend().name();
    scheduler.enqueue(admitted)?;
    let mut first_token_at = None;
    loop {
        let report = scheduler.tick(Instant::now());
        if first_token_at.is_none() && scheduler.tokens_generated() > 0 {
            first_token_at = Some(started.elapsed());
        }
        while let Ok(event) = rx.try_recv() {
            match event {
                Event::Text(text) => on_text(&text),
                Event::Logprob(_) | Event::PromptLogprob(_) => {}
                Event::Finished { reason, usage } => {
                    let total = started.elapsed();
                    let prefill = first_token_at.unwrap_or(total);
                    if reason == FinishReason::Error {
                        return Err(GenerateError::Engine);
                    }
                    return Ok(GenerateReport {
                        usage,
                        finish: reason,
                        prefill_secs: prefill.as_secs_f64(),
                        decode_secs: (total - prefill).as_secs_f64(),
                        backend: backend_name,
                    });
                }
            }
        }
        assert!(
            report.tokens > 0 || scheduler.in_flight() > 0,
            "a lone request always makes progress"
        );
    }
}
