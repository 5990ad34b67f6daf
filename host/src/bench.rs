//! `bulkhead bench engine`: prefill and decode throughput of the engine itself,
//! with no HTTP in the way. Figures go to BENCHMARKS.md; they are measured, never
//! asserted by tests.
//!
//! 1. Prefill: one sequence, a `prefill_tokens` prompt (up to the model's
//!    context) in steps of `chunk` tokens, as the server would; best of `repeats`.
//! 2. Decode at batch B: B sequences, each prefilled with a `decode_context`
//!    prompt (the depth), then one untimed step (a warm-up, as llama-bench
//!    does), then `decode_tokens` timed steps of B tokens each from the depth
//!    on; aggregate tokens per second.
//!
//! It prints the KV bytes per position of the pool it measured (`--kv-type`).

use crate::config::KvStorage;
use crate::engine::build::{self, EngineSpec};
use crate::engine::generate::{PAGE_TOKENS, PREFILL_CHUNK_TOKENS};
use anyhow::{ensure, Result};
use bulkhead_kernels::backend::cpu::CpuBackend;
use bulkhead_kernels::backend::{Backend, SeqStep};
use bulkhead_kernels::kv::{OwnerTag, PageTable, PartitionConfig, Pool, PoolOptions, SeqId};
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
    /// Prompt length of the prefill measurement (up to the model's context).
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Prefill chunk: most prompt tokens in one step (the server's
    /// `step_tokens_max`).
    #[arg(long, default_value_t = PREFILL_CHUNK_TOKENS as usize)]
    pub chunk: usize,
    /// Prompt length of each sequence before decode is measured: the depth.
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
    /// How the KV pool stores values.
    #[arg(long, value_enum, default_value_t = KvStorage::F16)]
    pub kv_type: KvStorage,
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
    let context = model.config.context_len;
    ensure!(
        (1..=context).contains(&args.prefill_tokens),
        "--prefill-tokens is 1..={context} (the model's context)"
    );
    ensure!(args.decode_tokens >= 1, "--decode-tokens is at least 1");
    ensure!(
        args.decode_context + args.decode_tokens <= context,
        "--decode-context plus --decode-tokens is at most {context} (the model's context)"
    );
    ensure!(
        (1..=PREFILL_CHUNK_MAX).contains(&args.chunk),
        "--chunk is 1..={PREFILL_CHUNK_MAX}"
    );
    let batch_max = args.batches.iter().copied().max().unwrap_or(1);
    ensure!(
        (1..=BENCH_BATCH_MAX).contains(&batch_max),
        "batch sizes are 1..={BENCH_BATCH_MAX}"
    );
    let spec = EngineSpec {
        pool_pages: 0, // each measurement sizes its own pool
        page_tokens: PAGE_TOKENS,
        kv_type: args.kv_type.into(),
        threads: args.threads,
        step_tokens_max: args.chunk.max(batch_max) as u32,
        step_seqs_max: batch_max as u32,
        pool_options: PoolOptions::default(),
        placement: crate::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    };
    let mut engine = Engine::new(model, tokenizer, spec);
    let layout = engine.pool(1)?.layout().to_owned();
    println!(
        "bench engine: backend {}, threads {}, kv {} ({} bytes per position), model {}",
        engine.backend.name(),
        args.threads,
        args.kv_type.name(),
        layout.position_bytes(),
        args.model.display()
    );
    let prefill = prefill(&mut engine, args)?;
    println!(
        "prefill {} tokens (chunks of {}): {:.1} tok/s",
        args.prefill_tokens, args.chunk, prefill
    );
    let mut batch1 = None;
    for &batch in &args.batches {
        let rate = decode(&mut engine, args, batch)?;
        let base = *batch1.get_or_insert(rate);
        println!(
            "decode batch {batch:>3} at depth {}: {rate:.1} tok/s aggregate ({:.2}x batch 1)",
            args.decode_context,
            rate / base
        );
    }
    Ok(())
}

/// Largest `--chunk`: a step's scratch grows with it.
const PREFILL_CHUNK_MAX: usize = 8192;

struct Engine {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    backend: CpuBackend,
    spec: EngineSpec,
}

const OWNER: OwnerTag = OwnerTag(0);

impl Engine {
    fn new(model: Arc<Model>, tokenizer: Tokenizer, spec: EngineSpec) -> Engine {
        Engine {
            backend: build::backend(&model, &spec),
            model,
            tokenizer: Arc::new(tokenizer),
            spec,
        }
    }

    /// A pool of `pages` pages, all of them one owner's.
    fn pool(&self, pages: u32) -> Result<Pool> {
        let spec = EngineSpec {
            pool_pages: pages,
            ..self.spec.clone()
        };
        let mut pool = build::pool(&self.model, &spec)?;
        pool.add_partition(PartitionConfig {
            owner: OWNER,
            pages_reserved: pages,
            pages_max: pages,
        })?;
        Ok(pool)
    }
}

/// A page table of `pages` pages for sequence `seq`.
fn table(pool: &mut Pool, seq: u64, pages: u32) -> Result<PageTable> {
    let mut reservation = pool.reserve(OWNER, pages)?;
    let mut table = pool.page_table(&reservation, SeqId(seq));
    for _ in 0..pages {
        pool.acquire(&mut reservation, &mut table)?;
    }
    pool.release_reservation(reservation);
    Ok(table)
}

/// Feeds `ids` into `seq` from position 0 in steps of `chunk` tokens; logits
/// for the last one only.
fn feed(
    engine: &mut Engine,
    pool: &mut Pool,
    seq: &PageTable,
    ids: &[u32],
    chunk: usize,
) -> Result<()> {
    let mut pos = 0;
    for piece in ids.chunks(chunk) {
        let step = SeqStep {
            logits: usize::from(pos + piece.len() == ids.len()),
            ..SeqStep::new(seq, pos, piece)
        };
        engine.backend.step(&[step], pool)?;
        pos += piece.len();
    }
    Ok(())
}

fn prefill(engine: &mut Engine, args: &EngineBenchArgs) -> Result<f64> {
    let ids = prompt(&engine.tokenizer, args.prefill_tokens)?;
    let pages = ids.len().div_ceil(PAGE_TOKENS as usize) as u32;
    let mut best = 0.0f64;
    for _ in 0..args.repeats.max(1) {
        let mut pool = engine.pool(pages)?;
        let mut seq = table(&mut pool, 0, pages)?;
        let started = Instant::now();
        feed(engine, &mut pool, &seq, &ids, args.chunk)?;
        best = best.max(ids.len() as f64 / started.elapsed().as_secs_f64());
        pool.release(&mut seq);
    }
    Ok(best)
}

fn decode(engine: &mut Engine, args: &EngineBenchArgs, batch: usize) -> Result<f64> {
    let context = prompt(&engine.tokenizer, args.decode_context.max(1))?;
    let tokens_per_seq = context.len() + args.decode_tokens;
    let pages_per_seq = tokens_per_seq.div_ceil(PAGE_TOKENS as usize) as u32;
    let mut best = 0.0f64;
    for _ in 0..args.repeats.max(1) {
        let mut pool = engine.pool(pages_per_seq * batch as u32)?;
        let mut seqs = (0..batch)
            .map(|i| table(&mut pool, i as u64, pages_per_seq))
            .collect::<Result<Vec<_>>>()?;
        for seq in &seqs {
            feed(engine, &mut pool, seq, &context, args.chunk)?;
        }
        // Decode feeds back a fixed token: sampling is not what is measured.
        let token = [context[0]];
        // One untimed decode step first, as llama-bench warms up with one
        // generated token: the first decode step after a prefill pays for
        // what a prefill does not touch (the decode path's scratch and code).
        // The timed steps then rewrite its position, so the depth stays N.
        let warm: Vec<SeqStep> = seqs
            .iter()
            .map(|table| SeqStep::new(table, context.len(), &token))
            .collect();
        engine.backend.step(&warm, &mut pool)?;
        let started = Instant::now();
        for i in 0..args.decode_tokens {
            let steps: Vec<SeqStep> = seqs
                .iter()
                .map(|table| SeqStep::new(table, context.len() + i, &token))
                .collect();
            engine.backend.step(&steps, &mut pool)?;
        }
        let secs = started.elapsed().as_secs_f64();
        best = best.max((batch * args.decode_tokens) as f64 / secs);
        for seq in &mut seqs {
            pool.release(seq);
        }
    }
    Ok(best)
}

/// Arguments of `bulkhead bench sampling`.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingBenchArgs {
    /// GGUF model file (its logits and vocabulary are sampled).
    #[arg(long)]
    pub model: PathBuf,
    /// Compute threads (for the logits and the reference decode step).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Tokens sampled per configuration.
    #[arg(long, default_value_t = 400)]
    pub samples: usize,
}

/// Per-token cost of each sampling option on the model's own logits (rows of
/// a greedy continuation of the benchmark text), beside one decode step at
/// batch 1 and 8 for scale: sampling runs on the engine's thread, once per
/// sequence per step, so what it costs every sequence of a step waits for.
/// The last rows are a hostile request's: JSON mode with `logit_bias` +100 on
/// the most tokens the API allows, each one JSON never takes, so that every
/// draw is refused until the constraint's fallback runs.
pub fn sampling(model: Arc<Model>, tokenizer: Tokenizer, args: &SamplingBenchArgs) -> Result<()> {
    use crate::engine::json::Json;
    use crate::engine::sampling::{sample_rows, Sampler, SamplingParams, LOGIT_BIAS_MAX};
    use crate::engine::schema::Schema;
    use bulkhead_kernels::backend::Logits;
    use bulkhead_kernels::tokenizer::TokenType;
    ensure!(args.samples >= 1, "--samples is at least 1");
    const ROWS: usize = 32;
    let spec = EngineSpec {
        pool_pages: 0,
        page_tokens: PAGE_TOKENS,
        kv_type: KvStorage::F16.into(),
        threads: args.threads,
        step_tokens_max: PREFILL_CHUNK_TOKENS,
        step_seqs_max: 8,
        pool_options: PoolOptions::default(),
        placement: crate::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    };
    let mut engine = Engine::new(model, tokenizer, spec);
    // The logits: the benchmark text, then a greedy continuation.
    let context = prompt(&engine.tokenizer, 64)?;
    let pages = (context.len() + ROWS + 16).div_ceil(PAGE_TOKENS as usize) as u32;
    let mut pool = engine.pool(pages * 8)?;
    let seqs = (0..8)
        .map(|i| table(&mut pool, i, pages))
        .collect::<Result<Vec<_>>>()?;
    for seq in &seqs {
        feed(
            &mut engine,
            &mut pool,
            seq,
            &context[..context.len() - 1],
            PREFILL_CHUNK_TOKENS as usize,
        )?;
    }
    let mut rows: Vec<Vec<f32>> = Vec::with_capacity(ROWS);
    let mut token = context[context.len() - 1];
    for i in 0..ROWS {
        let tokens = [token];
        let step = SeqStep::new(&seqs[0], context.len() - 1 + i, &tokens);
        let logits = engine.backend.step(&[step], &mut pool)?;
        let row = logits.row(0).to_vec();
        token = crate::engine::sampling::argmax(&row);
        rows.push(row);
    }
    // The scale: a decode step of 1 and of 8 sequences at this depth.
    let depth = context.len() - 1 + ROWS;
    let mut step_ms = Vec::new();
    for batch in [1usize, 8] {
        let mut best = f64::INFINITY;
        for _ in 0..8 {
            let steps: Vec<SeqStep> = seqs[..batch]
                .iter()
                .map(|table| SeqStep::new(table, depth, std::slice::from_ref(&token)))
                .collect();
            let started = Instant::now();
            engine.backend.step(&steps, &mut pool)?;
            best = best.min(started.elapsed().as_secs_f64() * 1e3);
        }
        step_ms.push(best);
    }
    let vocab = rows[0].len();
    println!(
        "bench sampling: model {}, vocabulary {vocab}, {} samples per option; a decode step takes {:.2} ms at batch 1, {:.2} ms at batch 8 (best of 8)",
        args.model.display(),
        args.samples,
        step_ms[0],
        step_ms[1]
    );
    let tokenizer = Arc::clone(&engine.tokenizer);
    // The hostile's bias: tokens no JSON state here takes.
    let states: Vec<Json> = [
        "",
        "{",
        "{\"a\": \"x",
        "{\"a\": 1",
        "{\"a\": [",
        "{\"a\": true",
    ]
    .iter()
    .map(|prefix| {
        let mut json = Json::new(std::sync::Arc::new(Schema::object()));
        assert!(json.push(prefix.as_bytes()));
        json
    })
    .collect();
    let never_json: Vec<(u32, f32)> = (0..vocab as u32)
        .filter(|&id| {
            matches!(tokenizer.token_type(id), Ok(TokenType::Normal))
                && tokenizer.token_to_piece_bytes(id).is_ok_and(|bytes| {
                    !bytes.is_empty() && states.iter().all(|s| !s.accepts(bytes))
                })
        })
        .take(LOGIT_BIAS_MAX)
        .map(|id| (id, 100.0))
        .collect();
    let sampled = |temperature: f32| SamplingParams {
        temperature,
        seed: 1,
        ..SamplingParams::default()
    };
    // What the OpenAI client sends for a pydantic model (structured output).
    let cat_document = serde_json::json!({
            "$defs": {"Owner": {"properties": {"name": {"type": "string", "maxLength": 12}},
                                "required": ["name"], "type": "object"}},
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer"},
                "color": {"enum": ["black", "white", "orange", "grey"], "type": "string"},
                "toys": {"items": {"type": "string"}, "maxItems": 3, "type": "array"},
                "owner": {"anyOf": [{"$ref": "#/$defs/Owner"}, {"type": "null"}]}
            },
            "required": ["name", "age", "color", "toys", "owner"], "type": "object"
    });
    let cat = Arc::new(Schema::compile(&cat_document).expect("the benchmark's schema compiles"));
    // The same model with string patterns (pydantic's `pattern`: a
    // microchip's code and an e-mail address) and a format (a `datetime`).
    let patterned_document = {
        let mut document = cat_document.clone();
        document["properties"]["chip"] =
            serde_json::json!({"type": "string", "pattern": "^[A-Z]{2}-\\d{4}$"});
        document["properties"]["email"] = serde_json::json!(
            {"type": "string", "pattern": "^[\\w.+-]+@[\\w-]+\\.[a-z]{2,}$", "maxLength": 40}
        );
        document["properties"]["seen"] =
            serde_json::json!({"type": "string", "format": "date-time"});
        document
    };
    let patterned =
        Arc::new(Schema::compile(&patterned_document).expect("the benchmark's schema compiles"));
    // Patterns are compiled as their request is read: what the model's cost,
    // and the most a schema's may (automata up to the bound, all together:
    // many patterns of 2^10-state DFAs, or one that would need 2^17 states).
    let many_dfas = serde_json::json!({"type": "object", "properties":
        (0..64).map(|i| (format!("p{i}"), serde_json::json!(
            {"type": "string", "pattern": "(a|b)*a(a|b){9}$"}
        ))).collect::<serde_json::Map<_, _>>()});
    let one_dfa = serde_json::json!({"type": "string", "pattern": "(a|b)*a(a|b){16}$"});
    // `tool_choice: "required"` over a request's most tools: the calls'
    // schema, each told apart by its name (one reading however many), and
    // over two of them.
    let tools = |n: usize| -> Vec<crate::engine::chat::Tool> {
        (0..n)
            .map(|i| crate::engine::chat::Tool {
                name: format!("get_weather_{i}"),
                description: None,
                parameters: Some(serde_json::json!({"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": false})),
            })
            .collect()
    };
    use crate::api::tools::{constraint_of, ToolChoice, TOOLS_MAX};
    let calls_of = |n: usize| {
        constraint_of(&ToolChoice::Required, &tools(n), true)
            .ok()
            .flatten()
            .map(|(schema, _)| Arc::new(schema))
    };
    let started = Instant::now();
    let calls_most = calls_of(TOOLS_MAX);
    println!(
        "compiling {:<55} {:>8.2} ms ({})",
        format!("the calls of {TOOLS_MAX} tools (tool_choice required)"),
        started.elapsed().as_secs_f64() * 1e3,
        if calls_most.is_some() {
            "compiled"
        } else {
            "refused"
        }
    );
    let calls_most = calls_most.expect("the benchmark's tools compile");
    let calls_two = calls_of(2).expect("the benchmark's tools compile");
    // pydantic's HttpUrl: a uri of at most 2,083 characters (the table of a
    // uri of any length, each place's shortest way to an end holding it).
    let http_url = serde_json::json!(
        {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}
    );
    for (name, document) in [
        (
            "a pydantic model with 2 patterns and a date-time",
            &patterned_document,
        ),
        ("pydantic's HttpUrl (maxLength 2,083)", &http_url),
        ("hostile: 64 patterns of 2^10-state DFAs", &many_dfas),
        ("hostile: a pattern of a 2^17-state DFA", &one_dfa),
    ] {
        let started = Instant::now();
        let compiled = Schema::compile(document);
        println!(
            "compiling {name:<55} {:>8.2} ms ({})",
            started.elapsed().as_secs_f64() * 1e3,
            match compiled {
                Ok(_) => "compiled".to_string(),
                Err(e) => format!("refused: {}", e.message),
            }
        );
    }
    // A hostile schema: sixteen alternatives alike all the way (arrays of
    // integers told apart only by maxItems), so that every token is read
    // sixteen ways.
    let alike = Arc::new(
        Schema::compile(&serde_json::json!({
            "anyOf": (0..16).map(|k| serde_json::json!(
                {"type": "array", "items": {"type": "integer"}, "maxItems": 1000 + k}
            )).collect::<Vec<_>>()
        }))
        .expect("the benchmark's schema compiles"),
    );
    // A hostile schema: the most enum bytes a schema may hold, in values
    // that all begin with the same 200 bytes.
    let long_enum = Arc::new(
        Schema::compile(&serde_json::json!({
            "enum": (0..250).map(|i| format!("{}{i:03}", "x".repeat(200))).collect::<Vec<_>>()
        }))
        .expect("the benchmark's schema compiles"),
    );
    let options: Vec<(&str, SamplingParams)> = vec![
        ("greedy", sampled(0.0)),
        ("temperature 1", sampled(1.0)),
        (
            "temperature 0.7, top_p 0.9",
            SamplingParams {
                top_p: 0.9,
                ..sampled(0.7)
            },
        ),
        (
            "temperature 0.8, top_k 40",
            SamplingParams {
                top_k: 40,
                ..sampled(0.8)
            },
        ),
        (
            "temperature 1, min_p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..sampled(1.0)
            },
        ),
        (
            "greedy, logprobs 5",
            SamplingParams {
                logprobs: Some(5),
                ..sampled(0.0)
            },
        ),
        (
            "temperature 1, logprobs 20",
            SamplingParams {
                logprobs: Some(20),
                ..sampled(1.0)
            },
        ),
        (
            "temperature 1, penalties, repetition 1.2, 1,024 biases",
            SamplingParams {
                presence_penalty: 0.5,
                frequency_penalty: 0.5,
                repetition_penalty: 1.2,
                logit_bias: (0..LOGIT_BIAS_MAX as u32)
                    .map(|i| (i * 7 % vocab as u32, 1.0))
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into_iter()
                    .collect(),
                ..sampled(1.0)
            },
        ),
        (
            "JSON mode, greedy",
            SamplingParams {
                json: Some(Arc::new(Schema::object())),
                ..sampled(0.0)
            },
        ),
        (
            "JSON mode, temperature 1",
            SamplingParams {
                json: Some(Arc::new(Schema::object())),
                ..sampled(1.0)
            },
        ),
        (
            "JSON schema (a pydantic model), greedy",
            SamplingParams {
                json: Some(Arc::clone(&cat)),
                ..sampled(0.0)
            },
        ),
        (
            "JSON schema (a pydantic model), temperature 1",
            SamplingParams {
                json: Some(Arc::clone(&cat)),
                ..sampled(1.0)
            },
        ),
        (
            "JSON schema, 2 patterns, a date-time (pydantic), temperature 1",
            SamplingParams {
                json: Some(Arc::clone(&patterned)),
                ..sampled(1.0)
            },
        ),
        (
            "tool_choice required, 2 tools, temperature 1",
            SamplingParams {
                json: Some(calls_two),
                ..sampled(1.0)
            },
        ),
        (
            "tool_choice required, 128 tools, temperature 1",
            SamplingParams {
                json: Some(calls_most),
                ..sampled(1.0)
            },
        ),
        (
            "hostile: 250 enum values sharing 200 bytes, temperature 1",
            SamplingParams {
                json: Some(Arc::clone(&long_enum)),
                logit_bias: never_json.clone(),
                ..sampled(1.0)
            },
        ),
        (
            "hostile: 16 alike alternatives read side by side, temperature 1",
            SamplingParams {
                json: Some(Arc::clone(&alike)),
                ..sampled(1.0)
            },
        ),
        (
            "hostile: JSON mode, greedy, 1,024 refused tokens at +100",
            SamplingParams {
                json: Some(Arc::new(Schema::object())),
                logit_bias: never_json.clone(),
                ..sampled(0.0)
            },
        ),
        (
            "hostile: JSON mode, temperature 1, 1,024 refused tokens at +100",
            SamplingParams {
                json: Some(Arc::new(Schema::object())),
                logit_bias: never_json,
                ..sampled(1.0)
            },
        ),
    ];
    for (name, params) in &options {
        let mut sampler = Sampler::for_request(params.clone(), &tokenizer, &context);
        let (mut total, mut worst) = (0.0f64, 0.0f64);
        for i in 0..args.samples {
            let row = &rows[i % rows.len()];
            let started = Instant::now();
            let token = sampler.sample(row);
            std::hint::black_box(sampler.logprobs(row, token));
            let secs = started.elapsed().as_secs_f64();
            total += secs;
            worst = worst.max(secs);
            if tokenizer.is_eog(token) {
                // A complete JSON value ends its request: the next is a new one.
                sampler = Sampler::for_request(params.clone(), &tokenizer, &context);
            }
        }
        let mean_us = total / args.samples as f64 * 1e6;
        println!(
            "{name:<64} mean {mean_us:>8.1} µs  max {:>8.1} µs  (mean {:>5.1} % of a batch-1 step)",
            worst * 1e6,
            mean_us / 1e3 / step_ms[0] * 100.0
        );
    }
    // A step's 8 rows, each its own sequence's sampler (its own seed), as
    // the scheduler samples them: on the step's thread alone, and on the
    // engine's threads.
    let threads = engine.backend.threads();
    let batch: Vec<f32> = rows[..8].concat();
    let logits = Logits {
        values: &batch,
        vocab_len: vocab,
        picks: &[],
        scored: &[],
    };
    let rounds = args.samples.div_ceil(8);
    const BATCHED: [&str; 3] = [
        "temperature 1",
        "JSON mode, temperature 1",
        "hostile: JSON mode, temperature 1, 1,024 refused tokens at +100",
    ];
    for (name, params) in options.iter().filter(|(name, _)| BATCHED.contains(name)) {
        let mut per_step = Vec::new();
        for pool in [None, threads.as_deref()] {
            let fresh = |seq: u64| {
                let params = SamplingParams {
                    seed: seq,
                    ..params.clone()
                };
                Sampler::for_request(params, &tokenizer, &context)
            };
            let mut samplers: Vec<Sampler> = (0..8).map(fresh).collect();
            let started = Instant::now();
            for _ in 0..rounds {
                let sampled = sample_rows(
                    pool,
                    samplers
                        .iter_mut()
                        .enumerate()
                        .map(|(row, s)| (s, row))
                        .collect(),
                    &logits,
                );
                for (seq, sampled) in sampled.into_iter().enumerate() {
                    if tokenizer.is_eog(sampled.token) {
                        samplers[seq] = fresh(seq as u64);
                    }
                }
            }
            per_step.push(started.elapsed().as_secs_f64() / rounds as f64 * 1e3);
        }
        println!(
            "8 rows of {name:<64} {:>6.2} ms a step on one thread, {:>6.2} ms on the engine's {} ({:.1}x)",
            per_step[0],
            per_step[1],
            threads.as_ref().map_or(1, |t| t.threads_count()),
            per_step[0] / per_step[1]
        );
    }
    // What a step of 128 sequences asking a GPU for their tokens spends
    // on their adjustment lists, each a 3,000-token prompt's under a
    // repetition and a frequency penalty: kept token by token, and made
    // whole every step (as before 2026-12-07).
    let prompt: Vec<u32> = (0..3000u32).map(|i| i * 16 % vocab as u32).collect();
    let penalized = SamplingParams {
        repetition_penalty: 1.1,
        frequency_penalty: 0.2,
        ..sampled(1.0)
    };
    let mut per_step = Vec::new();
    for whole in [false, true] {
        let mut samplers: Vec<Sampler> = (0..128)
            .map(|_| Sampler::for_request(penalized.clone(), &tokenizer, &prompt))
            .collect();
        let steps = args.samples.clamp(1, 100);
        let started = Instant::now();
        for step in 0..steps {
            for (seq, sampler) in samplers.iter_mut().enumerate() {
                if whole {
                    sampler.forget_adjustments();
                }
                std::hint::black_box(sampler.pick());
                std::hint::black_box(sampler.adjustments().len());
                sampler.take_pick(((step * 7919 + seq * 104_729) % vocab) as u32);
            }
        }
        per_step.push(started.elapsed().as_secs_f64() / steps as f64 * 1e3);
    }
    println!(
        "128 picks' adjustments of a 3,000-token prompt {:>6.2} ms a step kept token by token, {:>6.2} ms made whole ({:.1}x)",
        per_step[0],
        per_step[1],
        per_step[1] / per_step[0]
    );
    Ok(())
}

/// `bulkhead bench digest`.
#[derive(clap::Args, Debug)]
pub struct DigestBenchArgs {
    /// Transfers of an 8k-token prompt's pages to hash, per measurement.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Page digests of a transfer-sized run of pages: XXH3 (the page book's),
/// XXH64 and FNV-1a (the ones it replaced) and a plain copy of the same bytes (what
/// any transfer does at least once), with SmolLM2-135M's page geometry
/// (30 layers, 3 KV heads of 64, 16 tokens, f16: 360 KiB a page) and an
/// 8k-token prompt (512 pages, 180 MiB).
pub fn digest(args: &DigestBenchArgs) -> Result<()> {
    use bulkhead_kernels::kv::{digest_page, fnv1a64, page_digest, KvType, PoolGeometry, Xxh64};
    let layout = PoolGeometry {
        pages_count: 1,
        page_tokens: 16,
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        kv_type: KvType::F16,
    }
    .layout()?;
    const PAGES: usize = 512;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let pages: Vec<Vec<half::f16>> = (0..PAGES)
        .map(|_| {
            (0..layout.page_values())
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    half::f16::from_bits(state as u16 & 0x7bff)
                })
                .collect()
        })
        .collect();
    let bytes: Vec<Vec<u8>> = pages
        .iter()
        .map(|p| p.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect())
        .collect();
    let total = (bytes[0].len() * PAGES) as f64;
    let time = |f: &mut dyn FnMut() -> u64| {
        let mut best = f64::INFINITY;
        let mut sink = 0u64;
        for _ in 0..args.rounds.max(1) {
            let started = Instant::now();
            sink ^= f();
            best = best.min(started.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink);
        best
    };
    // The digest a transfer computes (on its wire bytes), and the same from
    // a pool's values; XXH64 of the same bytes, the digest before it.
    let xxh3 = time(&mut || {
        bytes
            .iter()
            .map(|b| page_digest(16, b))
            .fold(0, |a, d| a ^ d)
    });
    let stored = time(&mut || {
        pages
            .iter()
            .map(|p| digest_page(&layout, p, 16))
            .fold(0, |a, d| a ^ d)
    });
    let xxh64 = time(&mut || {
        bytes.iter().fold(0, |a, b| {
            let mut hasher = Xxh64::new();
            hasher.write(b);
            a ^ hasher.finish()
        })
    });
    let fnv = time(&mut || bytes.iter().map(|b| fnv1a64(b)).fold(0, |a, d| a ^ d));
    let mut copy_to = vec![0u8; bytes[0].len()];
    let copy = time(&mut || {
        bytes.iter().fold(0, |a, b| {
            copy_to.copy_from_slice(std::hint::black_box(b));
            a ^ u64::from(copy_to[7])
        })
    });
    // The same bytes through a loopback TCP socket, page by page, until the
    // receiver acknowledges the last page: the least a transfer between two
    // processes on one machine costs; and again with the receiver hashing
    // each page as it arrives (what a verifying receiver does at least).
    let loopback = |hash: bool| -> Result<f64> {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let (page_bytes, rounds) = (bytes[0].len(), args.rounds.max(1));
        let reader = std::thread::spawn(move || -> std::io::Result<u64> {
            let (mut socket, _) = listener.accept()?;
            let mut page = vec![0u8; page_bytes];
            let mut sink = 0u64;
            for _ in 0..rounds {
                for _ in 0..PAGES {
                    socket.read_exact(&mut page)?;
                    if hash {
                        sink ^= page_digest(16, &page);
                    }
                }
                socket.write_all(b"k")?;
            }
            Ok(sink)
        });
        let mut socket = std::net::TcpStream::connect(addr)?;
        socket.set_nodelay(true)?;
        let mut best = f64::INFINITY;
        let mut ack = [0u8; 1];
        for _ in 0..rounds {
            let started = Instant::now();
            for page in &bytes {
                socket.write_all(page)?;
            }
            socket.read_exact(&mut ack)?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        let sink = reader
            .join()
            .map_err(|_| anyhow::anyhow!("the reader panicked"))??;
        std::hint::black_box(sink);
        Ok(best)
    };
    // Alternated, best of each, so neither gains from going second.
    let (mut tcp, mut tcp_hashed) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..2 {
        tcp = tcp.min(loopback(false)?);
        tcp_hashed = tcp_hashed.min(loopback(true)?);
    }
    println!(
        "{PAGES} pages of {} KiB ({:.0} MiB, an 8k-token prompt), best of {}:",
        bytes[0].len() / 1024,
        total / f64::from(1 << 20),
        args.rounds.max(1)
    );
    for (name, secs) in [
        ("xxh3 page_digest", xxh3),
        ("  from pool values", stored),
        ("xxh64", xxh64),
        ("fnv1a64", fnv),
        ("copy", copy),
        ("loopback transfer", tcp),
        ("  receiver hashing", tcp_hashed),
    ] {
        println!(
            "  {name:<18} {:>8.1} ms  {:>6.2} GB/s",
            secs * 1e3,
            total / secs / 1e9
        );
    }
    println!(
        "  hashing once, alone, against the loopback transfer: xxh3 {:.0} %, xxh64 {:.0} %, fnv1a64 {:.0} %",
        100.0 * xxh3 / tcp,
        100.0 * xxh64 / tcp,
        100.0 * fnv / tcp
    );
    println!(
        "  the transfer's time with the receiver hashing each page as it arrives: {:+.0} %",
        100.0 * (tcp_hashed - tcp) / tcp
    );
    Ok(())
}
