//! One sequence, start to finish, on the CPU backend: the path behind
//! `bulkhead generate`. It follows the same lifecycle the scheduler will:
//! admit (capacity check) → reserve → acquire → prefill → decode → finish
//! (release and scrub), with every exit going through [`Sequence::finish`].

use super::sampling::{Sampler, SamplingParams};
use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::backend::{Backend, SeqStep, StepError};
use bulkhead_kernels::kv::{
    OwnerTag, PageTable, PartitionConfig, Pool, PoolGeometry, PoolOptions, SeqId,
};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::{DecodeOptions, Tokenizer};
use std::sync::Arc;
use std::time::Instant;

/// Tokens per KV page.
pub const PAGE_TOKENS: u32 = 16;
/// Most prompt tokens one prefill step carries.
pub const PREFILL_CHUNK_TOKENS: usize = 512;

/// The only tenant of a single-sequence run.
const OWNER: OwnerTag = OwnerTag(0);

/// Why a generation stopped early or never started.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus requested tokens exceed the model's context.
    #[error(
        "prompt ({prompt}) + max_tokens ({max_tokens}) exceeds the context length {context_len}"
    )]
    ContextLengthExceeded {
        /// Prompt tokens.
        prompt: usize,
        /// Requested completion tokens.
        max_tokens: usize,
        /// The model's context.
        context_len: usize,
    },
    /// The KV pool could not be built or booked.
    #[error("kv pool: {0}")]
    Pool(String),
    /// The backend refused a step.
    #[error(transparent)]
    Step(#[from] StepError),
    /// Detokenization failed.
    #[error(transparent)]
    Tokenizer(#[from] bulkhead_kernels::tokenizer::TokenizerError),
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-generation token.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
}

/// What happened.
#[derive(Clone, Debug)]
pub struct GenerateReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (the end-of-generation token excluded).
    pub generated: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Seconds spent in prefill (up to the first token's logits).
    pub prefill_secs: f64,
    /// Seconds spent in decode steps.
    pub decode_secs: f64,
}

/// A loaded model with its tokenizer and a CPU backend.
pub struct Engine {
    /// The weights.
    pub model: Arc<Model>,
    /// The tokenizer from the same file.
    pub tokenizer: Tokenizer,
    /// The compute backend.
    pub backend: CpuBackend,
}

impl Engine {
    /// Builds an engine for `model` with `threads_count` compute threads, sized
    /// for steps of up to `step_seqs_max` sequences.
    pub fn new(
        model: Arc<Model>,
        tokenizer: Tokenizer,
        threads_count: usize,
        step_seqs_max: usize,
    ) -> Engine {
        let backend = CpuBackend::new(
            Arc::clone(&model),
            CpuOptions {
                threads_count,
                step_tokens_max: PREFILL_CHUNK_TOKENS.max(step_seqs_max),
                step_seqs_max,
                isa: None,
            },
        );
        Engine {
            model,
            tokenizer,
            backend,
        }
    }

    /// A pool holding `pages_count` pages, all reserved for one tenant.
    pub fn single_tenant_pool(&self, pages_count: u32) -> Result<Pool, GenerateError> {
        let c = &self.model.config;
        let geometry = PoolGeometry {
            pages_count,
            page_tokens: PAGE_TOKENS,
            layers: c.layers_count as u32,
            kv_heads: c.kv_heads_count as u32,
            head_dim: c.head_dim as u32,
        };
        let partitions = [PartitionConfig {
            owner: OWNER,
            pages_reserved: pages_count,
            pages_max: pages_count,
        }];
        Pool::new(geometry, &partitions, PoolOptions::default())
            .map_err(|e| GenerateError::Pool(e.to_string()))
    }

    /// Generates a completion of `prompt`, calling `on_text` with each piece of
    /// text as soon as it is whole UTF-8.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerateReport, GenerateError> {
        let context_len = self.model.config.context_len;
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        if prompt.len() + options.max_tokens > context_len {
            return Err(GenerateError::ContextLengthExceeded {
                prompt: prompt.len(),
                max_tokens: options.max_tokens,
                context_len,
            });
        }
        let tokens_max = prompt.len() + options.max_tokens;
        let pages = tokens_max.div_ceil(PAGE_TOKENS as usize) as u32;
        let mut pool = self.single_tenant_pool(pages)?;
        let mut seq = Sequence::admit(&mut pool, SeqId(0), pages)?;
        let result = self.run(&mut pool, &mut seq, prompt, options, &mut on_text);
        seq.finish(&mut pool);
        result
    }

    fn run(
        &mut self,
        pool: &mut Pool,
        seq: &mut Sequence,
        prompt: &[u32],
        options: &GenerateOptions,
        on_text: &mut impl FnMut(&str),
    ) -> Result<GenerateReport, GenerateError> {
        let mut sampler = Sampler::new(options.sampling.clone());
        let mut detok = self
            .tokenizer
            .detokenizer(DecodeOptions { skip_special: true });
        let started = Instant::now();
        let mut pos = 0;
        let mut next = 0;
        for chunk in prompt.chunks(PREFILL_CHUNK_TOKENS) {
            let last = pos + chunk.len() == prompt.len();
            let step = SeqStep {
                pages: &seq.table,
                pos_start: pos,
                tokens: chunk,
                wants_logits: last,
            };
            let logits = self.backend.step(&[step], pool)?;
            if last {
                next = sampler.sample(logits.row(0));
            }
            pos += chunk.len();
        }
        let prefill_secs = started.elapsed().as_secs_f64();
        let decode_started = Instant::now();
        let mut generated = Vec::new();
        let finish = loop {
            if self.tokenizer.is_eog(next) {
                break FinishReason::Stop;
            }
            generated.push(next);
            on_text(&detok.push(next)?);
            if generated.len() == options.max_tokens {
                break FinishReason::Length;
            }
            let step = SeqStep {
                pages: &seq.table,
                pos_start: pos,
                tokens: std::slice::from_ref(&next),
                wants_logits: true,
            };
            let logits = self.backend.step(&[step], pool)?;
            next = sampler.sample(logits.row(0));
            pos += 1;
        };
        on_text(&detok.finish());
        Ok(GenerateReport {
            prompt_tokens: prompt.len(),
            generated,
            finish,
            prefill_secs,
            decode_secs: decode_started.elapsed().as_secs_f64(),
        })
    }
}

/// A sequence's hold on the pool: its page table. Pages go back only through
/// [`Sequence::finish`].
pub struct Sequence {
    /// The pages, in position order.
    pub table: PageTable,
}

impl Sequence {
    /// Reserves and acquires `pages` pages for a new sequence `seq`.
    pub fn admit(pool: &mut Pool, seq: SeqId, pages: u32) -> Result<Sequence, GenerateError> {
        let mut reservation = pool
            .reserve(OWNER, pages)
            .map_err(|e| GenerateError::Pool(e.to_string()))?;
        let mut table = pool.page_table(&reservation, seq);
        for _ in 0..pages {
            pool.acquire(&mut reservation, &mut table)
                .expect("a reservation of `pages` pages acquires `pages` pages");
        }
        pool.release_reservation(reservation);
        Ok(Sequence { table })
    }

    /// Releases every page and scrubs them.
    pub fn finish(&mut self, pool: &mut Pool) {
        pool.release(&mut self.table);
        pool.scrub_released();
    }
}
