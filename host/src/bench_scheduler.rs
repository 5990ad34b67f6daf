//! `bulkhead bench scheduler`: what a step costs the host beside the model.
//!
//! On a GPU a decode step of 128 sequences of a 135M model is a few
//! milliseconds of device time (the CUDA issue's target, 40 % of an H200's
//! bandwidth, is about 0.9 ms at depth 512), so the scheduler's own work
//! for the step (planning it, its page tables, its adjustments, the tokens
//! it picked turned into text and sent, stop strings) must be well under
//! that. Here the real scheduler runs over a backend that computes nothing:
//! each sampled row comes back as a token id, as the CUDA backend gives a
//! greedy or drawn row, so a step's time is the host's alone.
//!
//! For each batch B: B requests of `prompt_tokens` (prefilled in one step,
//! untimed), then every step in which all B decode one token is timed, for
//! `max_tokens` tokens each. It prints each batch's median and 90th
//! percentile step, and the median a token.

use crate::engine::admission::Admission;
use crate::engine::build::{self, EngineSpec};
use crate::engine::generate::{PAGE_TOKENS, PREFILL_CHUNK_TOKENS};
use crate::engine::request::{Event, NewRequest, RequestId};
use crate::engine::sampling::SamplingParams;
use crate::engine::scheduler::{BatchLimits, Scheduler, TenantLimits};
use crate::tenancy::TenantId;
use anyhow::{ensure, Context, Result};
use bulkhead_kernels::backend::{Backend, Logits, SeqStep, StepError};
use bulkhead_kernels::kv::{Pool, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

/// Arguments of `bulkhead bench scheduler`.
#[derive(clap::Args, Clone, Debug)]
pub struct SchedulerBenchArgs {
    /// GGUF model file (its tokenizer and page shape; no weight is read).
    #[arg(long)]
    pub model: PathBuf,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub batches: Vec<usize>,
    /// Prompt tokens of each request.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens each request generates (the decode steps timed).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
}

/// A backend that computes nothing: a sampled row is given as `token`
/// (never a stop), every other row asked for as zeros.
struct Idle {
    token: u32,
    vocab: usize,
    tokens_max: usize,
    logits_max: usize,
    values: Vec<f32>,
    picks: Vec<(u32, u32)>,
}

impl Backend for Idle {
    fn name(&self) -> String {
        "idle".into()
    }

    fn step_tokens_max(&self) -> usize {
        self.tokens_max
    }

    fn step_logits_max(&self) -> usize {
        self.logits_max
    }

    fn step(&mut self, steps: &[SeqStep<'_>], _pool: &mut Pool) -> Result<Logits<'_>, StepError> {
        self.values.clear();
        self.picks.clear();
        let mut row = 0u32;
        for step in steps {
            for r in 0..step.logits {
                if r + 1 == step.logits && step.pick.is_token() {
                    self.picks.push((row, self.token));
                } else {
                    self.values.resize(self.values.len() + self.vocab, 0.0);
                }
                row += 1;
            }
        }
        Ok(Logits {
            values: &self.values,
            vocab_len: self.vocab,
            picks: &self.picks,
            scored: &[],
        })
    }
}

/// The step times of one batch, sorted.
fn decode_steps(
    model: &Model,
    tokenizer: &Arc<Tokenizer>,
    prompt: &[u32],
    token: u32,
    batch: usize,
    max_tokens: u32,
) -> Result<Vec<Duration>> {
    let positions = (prompt.len() + max_tokens as usize) * batch;
    let pages = positions.div_ceil(PAGE_TOKENS as usize) as u32 + batch as u32;
    let spec = EngineSpec {
        pool_pages: pages,
        page_tokens: PAGE_TOKENS,
        kv_type: crate::config::KvStorage::F16.into(),
        threads: 1,
        // Every prompt in the first step, so that all B decode together
        // from the second on (in chunks of the server's 512, the first
        // requests would be done before the last prompt began).
        step_tokens_max: (prompt.len() * batch).max(PREFILL_CHUNK_TOKENS as usize) as u32,
        step_seqs_max: batch as u32,
        pool_options: PoolOptions::default(),
        placement: crate::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    };
    let pool = build::pool(model, &spec)?;
    let backend = Idle {
        token,
        vocab: model.config.vocab_len,
        tokens_max: spec.step_tokens_max as usize,
        logits_max: spec.step_tokens_max as usize,
        values: Vec::new(),
        picks: Vec::new(),
    };
    let tenant = TenantLimits {
        id: TenantId(0),
        name: "bench".into(),
        weight: 1,
        queue_depth_max: batch as u32,
        running_max: batch as u32,
        pages_reserved: pages,
        pages_max: pages,
        prefix_cache: false,
    };
    let limits = BatchLimits {
        step_tokens_max: spec.step_tokens_max,
        step_seqs_max: spec.step_seqs_max,
    };
    let mut scheduler = Scheduler::new(backend, pool, Arc::clone(tokenizer), limits, vec![tenant])?;
    let admission: Admission = scheduler.admission(model.config.context_len as u32);
    // Open channels: a closed one cancels its request.
    let mut receivers: Vec<UnboundedReceiver<Event>> = Vec::new();
    for id in 0..batch {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let request = NewRequest {
            id: RequestId(id as u64),
            tenant: TenantId(0),
            prompt: prompt.to_vec(),
            max_tokens,
            sampling: SamplingParams::default(),
            stop: vec!["never in this text".into()],
            deadline: Instant::now() + Duration::from_secs(3600),
            events,
            cache_salt: None,
            prefill_hint: None,
        };
        let admitted = admission
            .admit(request)
            .map_err(|r| anyhow::anyhow!("{r:?}"))?;
        scheduler
            .enqueue(admitted)
            .map_err(|r| anyhow::anyhow!("{r:?}"))?;
        receivers.push(rx);
    }
    let mut steps = Vec::new();
    while scheduler.in_flight() > 0 {
        let started = Instant::now();
        let tick = scheduler.tick(started);
        let took = started.elapsed();
        // A step of every sequence's next token alone.
        if tick.seqs as usize == batch && tick.tokens as usize == batch {
            steps.push(took);
        }
        for rx in &mut receivers {
            while rx.try_recv().is_ok() {}
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Runs `bulkhead bench scheduler`.
pub fn run(model: Arc<Model>, tokenizer: Tokenizer, args: &SchedulerBenchArgs) -> Result<()> {
    ensure!(args.max_tokens >= 2, "--max-tokens is at least 2");
    ensure!(
        args.batches.iter().all(|&b| (1..=1024).contains(&b)),
        "--batches are 1 to 1024"
    );
    let tokenizer = Arc::new(tokenizer);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(args.prompt_tokens);
    let mut prompt = tokenizer.encode(&text, EncodeOptions::default())?;
    prompt.truncate(args.prompt_tokens);
    ensure!(!prompt.is_empty(), "--prompt-tokens is at least 1");
    // A token of plain text, as every generated one.
    let token = *tokenizer
        .encode(" the", EncodeOptions::default())?
        .last()
        .context("the tokenizer gives \" the\" no token")?;
    println!(
        "bench scheduler: the host's part of a decode step (a backend that computes nothing), \
         {} prompt tokens, {} generated a request",
        prompt.len(),
        args.max_tokens
    );
    for &batch in &args.batches {
        let steps = decode_steps(&model, &tokenizer, &prompt, token, batch, args.max_tokens)?;
        ensure!(
            !steps.is_empty(),
            "batch {batch}: no step decoded every sequence"
        );
        let at = |q: f64| steps[((steps.len() - 1) as f64 * q).round() as usize];
        let median = at(0.5);
        println!(
            "batch {batch:>4}: {:>8.1} us a step (median of {}), p90 {:>8.1} us, {:>6.2} us a token",
            median.as_secs_f64() * 1e6,
            steps.len(),
            at(0.9).as_secs_f64() * 1e6,
            median.as_secs_f64() * 1e6 / batch as f64
        );
    }
    Ok(())
}
