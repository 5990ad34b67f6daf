//! `bulkhead bench engine`: prefill and decode throughput of the engine itself,
//! with no HTTP in the way. Figures go to BENCHMARKS.md; they are measured, never
//! asserted by tests.
//!
//! 1. Prefill: one sequence, a `prefill_tokens` prompt in one step; best of `repeats`.
//! 2. Decode at batch B: B sequences, each prefilled with a short prompt, then
//!    `decode_tokens` steps of B tokens each; aggregate tokens per second.

use crate::engine::generate::{Engine, PAGE_TOKENS, PREFILL_CHUNK_TOKENS};
use anyhow::{ensure, Context, Result};
use bulkhead_kernels::backend::{Backend, SeqStep};
use bulkhead_kernels::kv::{PageTable, SeqId};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Largest batch the benchmark accepts.
pub const BENCH_BATCH_MAX: usize = 256;

/// Arguments of `bulkhead bench engine`.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineBenchArgs {
    /// GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Compute threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Prompt length of each sequence before decode is measured.
    #[arg(long, default_value_t = 16)]
    pub decode_context: usize,
    /// Decode steps measured.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Batch sizes for decode, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Repeats of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog. Bulkhead keeps every tenant's \
    KV cache in its own partition, scrubs released pages, and verifies transfers. ";

fn prompt(tokenizer: &Tokenizer, len: usize) -> Result<Vec<u32>> {
    let unit = tokenizer.encode(TEXT, EncodeOptions::default())?;
    ensure!(!unit.is_empty(), "the benchmark text tokenizes to nothing");
    Ok(unit.iter().copied().cycle().take(len).collect())
}

/// Runs the engine benchmark and prints one line per figure.
pub fn engine(model: Arc<Model>, tokenizer: Tokenizer, args: &EngineBenchArgs) -> Result<()> {
    ensure!(
        args.prefill_tokens <= PREFILL_CHUNK_TOKENS,
        "--prefill-tokens is at most {PREFILL_CHUNK_TOKENS}"
    );
    let batch_max = args.batches.iter().copied().max().unwrap_or(1);
    ensure!(
        (1..=BENCH_BATCH_MAX).contains(&batch_max),
        "batch sizes are 1..={BENCH_BATCH_MAX}"
    );
    let mut engine = Engine::new(model, tokenizer, args.threads, batch_max);
    println!(
        "bench engine: backend {}, threads {}, model {}",
        engine.backend.name(),
        args.threads,
        args.model.display()
    );
    let prefill = prefill(&mut engine, args)?;
    println!(
        "prefill {} tokens: {:.1} tok/s",
        args.prefill_tokens, prefill
    );
    let mut batch1 = None;
    for &batch in &args.batches {
        let rate = decode(&mut engine, args, batch)?;
        let base = *batch1.get_or_insert(rate);
        println!(
            "decode batch {batch:>3}: {rate:.1} tok/s aggregate ({:.2}x batch 1)",
            rate / base
        );
    }
    Ok(())
}

fn prefill(engine: &mut Engine, args: &EngineBenchArgs) -> Result<f64> {
    let ids = prompt(&engine.tokenizer, args.prefill_tokens)?;
    let pages = ids.len().div_ceil(PAGE_TOKENS as usize) as u32;
    let mut best = 0.0f64;
    for _ in 0..args.repeats.max(1) {
        let mut pool = engine.single_tenant_pool(pages)?;
        let mut seq = crate::engine::generate::Sequence::admit(&mut pool, SeqId(0), pages)?;
        let started = Instant::now();
        let step = SeqStep {
            pages: &seq.table,
            pos_start: 0,
            tokens: &ids,
            wants_logits: true,
        };
        engine.backend.step(&[step], &mut pool)?;
        best = best.max(ids.len() as f64 / started.elapsed().as_secs_f64());
        seq.finish(&mut pool);
    }
    Ok(best)
}

fn decode(engine: &mut Engine, args: &EngineBenchArgs, batch: usize) -> Result<f64> {
    let context = prompt(&engine.tokenizer, args.decode_context.max(1))?;
    let tokens_per_seq = context.len() + args.decode_tokens;
    let pages_per_seq = tokens_per_seq.div_ceil(PAGE_TOKENS as usize) as u32;
    let mut best = 0.0f64;
    for _ in 0..args.repeats.max(1) {
        let mut pool = engine.single_tenant_pool(pages_per_seq * batch as u32)?;
        let mut seqs = (0..batch)
            .map(|i| {
                crate::engine::generate::Sequence::admit(&mut pool, SeqId(i as u64), pages_per_seq)
            })
            .collect::<Result<Vec<_>, _>>()
            .context("admitting the benchmark's sequences")?;
        for seq in &seqs {
            let step = SeqStep {
                pages: &seq.table,
                pos_start: 0,
                tokens: &context,
                wants_logits: false,
            };
            engine.backend.step(&[step], &mut pool)?;
        }
        let tables: Vec<&PageTable> = seqs.iter().map(|s| &s.table).collect();
        // Decode feeds back a fixed token: sampling is not what is measured.
        let token = [context[0]];
        let started = Instant::now();
        for i in 0..args.decode_tokens {
            let steps: Vec<SeqStep> = tables
                .iter()
                .map(|table| SeqStep {
                    pages: table,
                    pos_start: context.len() + i,
                    tokens: &token,
                    wants_logits: true,
                })
                .collect();
            engine.backend.step(&steps, &mut pool)?;
        }
        let secs = started.elapsed().as_secs_f64();
        best = best.max((batch * args.decode_tokens) as f64 / secs);
        for seq in &mut seqs {
            seq.finish(&mut pool);
        }
    }
    Ok(best)
}
