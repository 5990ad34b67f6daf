//! The CPU backend: a batched forward pass over paged KV for every family the
//! blueprint describes ([`crate::model`]).
//!
//! One step concatenates every sequence's new tokens into one activation
//! matrix, so each weight matrix is streamed once per step whatever the batch
//! (prefill chunks and decode tokens mixed). Per layer:
//!
//! 1. `xn = rmsnorm(x) * attn_norm`, quantized once for Q, K and V.
//! 2. `q, k, v = xn·Wq, xn·Wk, xn·Wv` (plus biases where the family has them;
//!    each q and k head RMS-normalised where it says so); RoPE on q and k at
//!    each token's position, in the family's pairing and with the layer's
//!    base (local layers may have their own).
//! 3. k and v are written into the sequence's pages (ownership asserted by the pool).
//! 4. Attention per (sequence, kv head, token chunk) reads K/V only through the
//!    sequence's page table (ownership asserted again), causal to each
//!    position, and within the layer's window where it is local; scores
//!    soft-capped where the family says so.
//! 5. `x += attn·Wo`; `x += (act(xn·Wg) * xn·Wu)·Wd` with `xn = rmsnorm(x) *
//!    ffn_norm` (each of the two added terms RMS-normalised first where the
//!    family has post-norms).
//!
//! Embeddings are scaled where the family says so (gemma). Logits are
//! computed only for the last token of sequences that ask, soft-capped where
//! the family says so.
//! Matrix products split output rows across the thread pool; attention splits
//! (sequence, kv head, token chunk) tasks. Scratch is sized once, at creation,
//! for `step_tokens_max` tokens and `step_seqs_max` sequences.

use super::{vector, Backend, Logits, SeqStep, StepError, StepLimits};
use crate::kv::{KvType, KvValue, PageTable, Pool, StepView};
use crate::model::{Activation, Matrix, Model, ModelConfig, RopeStyle};
use crate::quant::{self, ActivationFormat, Isa, QuantizedActivations};
use crate::threads::Threads;
use half::f16;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Prefill queries per attention task: a span's K and V are widened once per
/// block and stay in cache for its queries; short enough to balance a prefill
/// chunk across threads (a 512-token chunk is 16 blocks per KV head). 32
/// prefilled 4,096 tokens ~3 % faster than 16; 64 no faster than 32.
const QUERY_BLOCK_TOKENS: usize = 32;
/// Positions per attention span (rounded to whole pages): the unit of the
/// attention reduction, and of a decode token's split across threads. 128
/// positions of one KV head are 16 KiB of f16 K: L1-sized.
const SPAN_POSITIONS: usize = 128;
/// Runs of consecutive spans per thread when a decode token's pages are
/// split among threads: more than one, so a descheduled thread's share is
/// split among the others. Against one span per task (decode at depth 8128,
/// rounds alternated in one process) within noise, 0-7 % faster: kept for
/// the longer runs of memory per thread and the fewer task claims.
const DECODE_RUNS_PER_THREAD: usize = 4;
/// Output rows per matrix-product task are rounded to this (the kernels' tile,
/// and the 16-row groups of repacked matrices).
const MATMUL_ROWS_ALIGN: usize = 16;
/// Row chunks per thread in a matrix product: more than one, so that when a
/// thread is descheduled (a loaded machine) the others take over its share.
const MATMUL_TASKS_PER_THREAD: usize = 4;
/// Fewest values of `gate` split across the pool: below it a region costs
/// more than the activation (a decode token of SmolLM2 has 1,536).
const GATED_SPLIT_MIN: usize = 16 * 1024;
/// Why a page's slab is of the pool's value type.
const ONE_TYPE_PER_POOL: &str = "every page of a pool holds one value type";
/// Why activation quantization cannot fail: every matrix's input width is its
/// row length, which the GGUF reader checked is a whole number of blocks.
const WIDTHS_CHECKED: &str = "matrix input widths are whole blocks (checked at load)";

/// Sizing of a CPU backend.
#[derive(Clone, Debug)]
pub struct CpuOptions {
    /// Compute threads (the calling thread included).
    pub threads_count: usize,
    /// Most tokens in one step (prefill chunk budget plus decode tokens).
    pub step_tokens_max: usize,
    /// Most sequences in one step.
    pub step_seqs_max: usize,
    /// Kernel instruction set; `None` picks the best this CPU has.
    pub isa: Option<Isa>,
}

/// The per-step working memory, allocated once.
struct Scratch {
    // All activation buffers are [token][width], tokens of all sequences concatenated.
    x: Vec<f32>,     // [tokens][d] residual stream
    xn: Vec<f32>,    // [tokens][d] normalised input of a block
    q: Vec<f32>,     // [tokens][q_len]
    k: Vec<f32>,     // [tokens][kv_len]
    v: Vec<f32>,     // [tokens][kv_len]
    attn: Vec<f32>,  // [tokens][q_len] attention output before Wo
    gate: Vec<f32>,  // [tokens][ffn]
    up: Vec<f32>,    // [tokens][ffn]
    delta: Vec<f32>, // [tokens][d] output of Wo or Wd, added to x
    rope: Vec<f32>,  // [global, local][tokens][rope_dim / 2][cos, sin]
    xq: QuantizedActivations,
    out_norm: Vec<f32>, // [rows][d] the rows that want logits
    logits: Vec<f32>,   // [rows][vocab]: one a sequence, grown for a prompt's log probabilities
    /// Decode tokens' attention partials: `[decode][head][span][m, l, o[head_dim]]`;
    /// grows to the largest step's need.
    partials: Vec<f32>,
    /// Per worker: matrix-product output before it is scattered, and attention scores.
    workers: Vec<Mutex<WorkerScratch>>,
}

#[derive(Default)]
struct WorkerScratch {
    rows_out: Vec<f32>, // [tokens][rows in task]
    scores: Vec<f32>,   // [query heads of a task][span positions]
    tiles: Vec<Tile>,   // one per KV head of a task
    part: Vec<f32>,     // [KV heads of a task][group][m, l, o[head_dim]]: one span's partials
    state: Vec<f32>,    // [query block][group][m, l, o[head_dim]]: folded so far
}

/// One KV head's K and V over one span, widened to f32: `[positions][head_dim]` each.
#[derive(Default)]
struct Tile {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Where each token of the step comes from.
#[derive(Clone, Copy)]
struct TokenSlot {
    /// Index of the sequence in the step.
    seq_index: usize,
    /// Absolute position in the sequence.
    pos: usize,
}

/// The CPU backend.
pub struct CpuBackend {
    model: Arc<Model>,
    threads: Arc<Threads>,
    isa: Isa,
    options: CpuOptions,
    scratch: Scratch,
}

/// A pointer that tasks may share to write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
impl SharedOut {
    /// The pointer; a method so that closures capture the whole (Sync) wrapper.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: used only to write index sets that are disjoint across tasks; the
// region ends (Threads::run returns) before the owner reads the buffer.
unsafe impl Sync for SharedOut {}
// SAFETY: as above.
unsafe impl Send for SharedOut {}

impl CpuBackend {
    /// A backend for `model`, with all scratch allocated now.
    pub fn new(model: Arc<Model>, options: CpuOptions) -> CpuBackend {
        let c = &model.config;
        let tokens = options.step_tokens_max.max(1);
        let seqs = options.step_seqs_max.max(1);
        let threads = Arc::new(Threads::new(options.threads_count));
        let workers = (0..threads.threads_count())
            .map(|_| {
                let part_len = c.kv_group() * (c.head_dim + 2);
                Mutex::new(WorkerScratch {
                    rows_out: Vec::new(),
                    scores: vec![0.0; c.heads_count * SPAN_POSITIONS],
                    tiles: (0..c.kv_heads_count)
                        .map(|_| Tile {
                            k: vec![0.0; SPAN_POSITIONS * c.head_dim],
                            v: vec![0.0; SPAN_POSITIONS * c.head_dim],
                        })
                        .collect(),
                    part: vec![0.0; part_len],
                    state: vec![0.0; QUERY_BLOCK_TOKENS * part_len],
                })
            })
            .collect();
        let scratch = Scratch {
            x: vec![0.0; tokens * c.embedding_len],
            xn: vec![0.0; tokens * c.embedding_len],
            q: vec![0.0; tokens * c.q_len()],
            k: vec![0.0; tokens * c.kv_len()],
            v: vec![0.0; tokens * c.kv_len()],
            attn: vec![0.0; tokens * c.q_len()],
            gate: vec![0.0; tokens * c.ffn_len],
            up: vec![0.0; tokens * c.ffn_len],
            delta: vec![0.0; tokens * c.embedding_len],
            rope: vec![0.0; 2 * tokens * c.rope_dim],
            xq: QuantizedActivations::new(),
            out_norm: vec![0.0; seqs * c.embedding_len],
            logits: vec![0.0; seqs * c.vocab_len],
            partials: Vec::new(),
            workers,
        };
        let isa = options.isa.unwrap_or_else(Isa::detect);
        if isa == Isa::Avx512 {
            // At load, not at the first request: the matrices in their
            // 16-row layouts (once per model; a rebuilt backend reuses them).
            model.repacked(threads.threads_count());
        }
        CpuBackend {
            isa,
            model,
            threads,
            options: CpuOptions {
                step_tokens_max: tokens,
                step_seqs_max: seqs,
                ..options
            },
            scratch,
        }
    }

    /// The model this backend runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The kernel instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    fn validate(
        &self,
        steps: &[SeqStep<'_>],
        page_tokens: usize,
        pool: &Pool,
    ) -> Result<usize, StepError> {
        if !pool.is_host() {
            return Err(StepError::DeviceStorage);
        }
        super::validate_step(
            &self.model.config,
            &self.options_limits(),
            steps,
            page_tokens,
            pool,
        )
    }

    fn options_limits(&self) -> StepLimits {
        StepLimits {
            step_tokens_max: self.options.step_tokens_max,
            step_seqs_max: self.options.step_seqs_max,
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}", self.isa.name())
    }

    fn step_tokens_max(&self) -> usize {
        self.options.step_tokens_max
    }

    fn step_logits_max(&self) -> usize {
        self.options_limits().step_logits_max()
    }

    fn threads(&self) -> Option<Arc<Threads>> {
        Some(Arc::clone(&self.threads))
    }

    fn step(&mut self, steps: &[SeqStep<'_>], pool: &mut Pool) -> Result<Logits<'_>, StepError> {
        let page_tokens = pool.layout().geometry().page_tokens as usize;
        let tokens = self.validate(steps, page_tokens, pool)?;
        let slots: Vec<TokenSlot> = steps
            .iter()
            .enumerate()
            .flat_map(|(seq_index, s)| {
                (0..s.tokens.len()).map(move |i| TokenSlot {
                    seq_index,
                    pos: s.pos_start + i,
                })
            })
            .collect();
        let (d, scale) = (
            self.model.config.embedding_len,
            self.model.config.embedding_scale,
        );
        for (t, &token) in steps.iter().flat_map(|s| s.tokens).enumerate() {
            let row = &mut self.scratch.x[t * d..(t + 1) * d];
            self.model.embed(token, row);
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        self.fill_rope(&slots);
        // Every page lease of the step, checked once for all its layers.
        let tables: Vec<&PageTable> = steps.iter().map(|s| s.pages).collect();
        let mut view = pool
            .step_view(&tables)
            .expect("validated: every lease of the step is live");
        for layer in 0..self.model.config.layers_count {
            self.attention_block(layer, steps, &slots, &mut view);
            self.ffn_block(layer, tokens);
        }
        let wanted = self.output_logits(steps);
        let vocab_len = self.model.config.vocab_len;
        // Every row in full: a row wanted for its token (a greedy or drawn
        // one) is picked from it by the sampler, on this same host.
        Ok(Logits {
            values: &self.scratch.logits[..wanted * vocab_len],
            vocab_len,
            picks: &[],
            scored: &[],
        })
    }
}

impl CpuBackend {
    /// `rope[t][i] = (cos, sin)(pos_t * base^(-2i / rope_dim) * scale / factor_i)`:
    /// the global layers' table, then the local layers' (their own base and
    /// scale) where the model has local layers.
    fn fill_rope(&mut self, slots: &[TokenSlot]) {
        let c = &self.model.config;
        let pairs = c.rope_dim / 2;
        let table_len = slots.len() * c.rope_dim;
        let local = c.sliding_window.as_ref();
        let tables = [
            Some((c.rope_base, c.rope_freq_scale)),
            local.map(|w| (w.rope_base, w.rope_freq_scale)),
        ];
        let buffers = self.scratch.rope[..2 * table_len].chunks_exact_mut(table_len);
        for ((base, scale), table) in tables
            .into_iter()
            .zip(buffers)
            .filter_map(|(t, b)| Some((t?, b)))
        {
            for (t, slot) in slots.iter().enumerate() {
                for i in 0..pairs {
                    let mut freq = base.powf(-((2 * i) as f32) / c.rope_dim as f32);
                    freq *= scale;
                    if let Some(factors) = &c.rope_freq_factors {
                        freq /= factors[i];
                    }
                    let theta = slot.pos as f32 * freq;
                    let (sin, cos) = theta.sin_cos();
                    table[(t * pairs + i) * 2] = cos;
                    table[(t * pairs + i) * 2 + 1] = sin;
                }
            }
        }
    }

    /// The layer's window, if it is local.
    fn window(&self, layer: usize) -> Option<usize> {
        let window = self.model.config.sliding_window.as_ref()?;
        window.of_layer(layer)
    }

    fn attention_block(
        &mut self,
        layer: usize,
        steps: &[SeqStep<'_>],
        slots: &[TokenSlot],
        view: &mut StepView<'_>,
    ) {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        let w = &model.layers[layer];
        let tokens = slots.len();
        let (d, q_len, kv_len) = (c.embedding_len, c.q_len(), c.kv_len());
        let s = &mut self.scratch;
        rmsnorm_rows(
            &s.x[..tokens * d],
            &w.attn_norm,
            c.rms_eps,
            &mut s.xn[..tokens * d],
        );
        s.xq.quantize(w.wq.ty(), &s.xn[..tokens * d], tokens, d)
            .expect(WIDTHS_CHECKED);
        // Wq, Wk and Wv take the same activations in every file we know (a
        // K-quant file's fall-backs mix Q5_0 and Q8_0, both Q8_1's): then one
        // pass of the pool for the three. Quantize again only if they differ.
        if same_activations(&w.wq, &w.wk) && same_activations(&w.wq, &w.wv) {
            self.matmuls(&[(&w.wq, Buf::Q), (&w.wk, Buf::K), (&w.wv, Buf::V)], tokens);
        } else {
            self.matmuls(&[(&w.wq, Buf::Q)], tokens);
            for (matrix, dst) in [(&w.wk, Buf::K), (&w.wv, Buf::V)] {
                let s = &mut self.scratch;
                s.xq.quantize(matrix.ty(), &s.xn[..tokens * d], tokens, d)
                    .expect(WIDTHS_CHECKED);
                self.matmuls(&[(matrix, dst)], tokens);
            }
        }
        let s = &mut self.scratch;
        let (q, k) = (&mut s.q[..tokens * q_len], &mut s.k[..tokens * kv_len]);
        if let Some([bq, bk, bv]) = &w.qkv_bias {
            add_rows(q, bq);
            add_rows(k, bk);
            add_rows(&mut s.v[..tokens * kv_len], bv);
        }
        if let Some([gq, gk]) = &w.qk_norm {
            rmsnorm_in_place(q, gq, c.rms_eps);
            rmsnorm_in_place(k, gk, c.rms_eps);
        }
        let table_len = tokens * c.rope_dim;
        let local = c.sliding_window.as_ref().is_some_and(|w| w.local[layer]);
        let rope = &s.rope[local as usize * table_len..][..table_len];
        apply_rope(q, rope, c.heads_count, c);
        apply_rope(k, rope, c.kv_heads_count, c);
        self.write_kv(layer, slots, view);
        self.attention(layer, steps, slots, view);
        let s = &mut self.scratch;
        s.xq.quantize(w.wo.ty(), &s.attn[..tokens * q_len], tokens, q_len)
            .expect(WIDTHS_CHECKED);
        self.matmuls(&[(&w.wo, Buf::Delta)], tokens);
        let s = &mut self.scratch;
        if let Some(gain) = &w.attn_post_norm {
            rmsnorm_in_place(&mut s.delta[..tokens * d], gain, c.rms_eps);
        }
        add_into(&mut s.x[..tokens * d], &s.delta[..tokens * d]);
    }

    fn ffn_block(&mut self, layer: usize, tokens: usize) {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        let w = &model.layers[layer];
        let (d, ffn) = (c.embedding_len, c.ffn_len);
        let s = &mut self.scratch;
        rmsnorm_rows(
            &s.x[..tokens * d],
            &w.ffn_norm,
            c.rms_eps,
            &mut s.xn[..tokens * d],
        );
        s.xq.quantize(w.w_gate.ty(), &s.xn[..tokens * d], tokens, d)
            .expect(WIDTHS_CHECKED);
        if same_activations(&w.w_gate, &w.w_up) {
            self.matmuls(&[(&w.w_gate, Buf::Gate), (&w.w_up, Buf::Up)], tokens);
        } else {
            self.matmuls(&[(&w.w_gate, Buf::Gate)], tokens);
            let s = &mut self.scratch;
            s.xq.quantize(w.w_up.ty(), &s.xn[..tokens * d], tokens, d)
                .expect(WIDTHS_CHECKED);
            self.matmuls(&[(&w.w_up, Buf::Up)], tokens);
        }
        self.gated(tokens * ffn, c.activation);
        let s = &mut self.scratch;
        s.xq.quantize(w.w_down.ty(), &s.gate[..tokens * ffn], tokens, ffn)
            .expect(WIDTHS_CHECKED);
        self.matmuls(&[(&w.w_down, Buf::Delta)], tokens);
        let s = &mut self.scratch;
        if let Some(gain) = &w.ffn_post_norm {
            rmsnorm_in_place(&mut s.delta[..tokens * d], gain, c.rms_eps);
        }
        add_into(&mut s.x[..tokens * d], &s.delta[..tokens * d]);
    }

    /// `gate = act(gate) * up`, split across the pool when it is worth a
    /// region (below GATED_SPLIT_MIN values the calling thread does it alone).
    fn gated(&mut self, len: usize, activation: Activation) {
        let s = &mut self.scratch;
        let chunks = if len < GATED_SPLIT_MIN {
            1
        } else {
            self.threads.threads_count()
        };
        let chunk_len = len.div_ceil(chunks);
        let gate = SharedOut(s.gate.as_mut_ptr());
        let up = &s.up[..len];
        let isa = self.isa;
        let run = |i: usize, _| {
            let start = (i * chunk_len).min(len);
            let end = ((i + 1) * chunk_len).min(len);
            // SAFETY: tasks own disjoint ranges [start, end) of `gate`.
            let gate =
                unsafe { std::slice::from_raw_parts_mut(gate.ptr().add(start), end - start) };
            match activation {
                Activation::Silu => vector::swiglu(isa, gate, &up[start..end]),
                Activation::GeluTanh => vector::geglu(isa, gate, &up[start..end]),
            }
        };
        match chunks {
            1 => run(0, 0),
            _ => self.threads.run(chunks, &run),
        }
    }

    /// Writes this layer's new K and V rows into each sequence's pages.
    fn write_kv(&mut self, layer: usize, slots: &[TokenSlot], view: &mut StepView<'_>) {
        let kv_len = self.model.config.kv_len();
        let page_tokens = view.layout().geometry().page_tokens as usize;
        for (t, slot) in slots.iter().enumerate() {
            let row = t * kv_len..(t + 1) * kv_len;
            // Validated: the position is within the table, and the page its own.
            view.write_kv(
                slot.seq_index,
                slot.pos / page_tokens,
                layer as u32,
                (slot.pos % page_tokens) as u32,
                &self.scratch.k[row.clone()],
                &self.scratch.v[row],
            );
        }
    }

    /// Attention of every token of the step (see [`attention`](self) below for
    /// the reduction and why it is the same for a prefill chunk and a decode token).
    fn attention(
        &mut self,
        layer: usize,
        steps: &[SeqStep<'_>],
        slots: &[TokenSlot],
        view: &StepView<'_>,
    ) {
        let c = &self.model.config;
        let page_tokens = view.layout().geometry().page_tokens as usize;
        let ctx = AttentionContext {
            layer: layer as u32,
            isa: self.isa,
            heads_count: c.heads_count,
            head_dim: c.head_dim,
            kv_group: c.kv_group(),
            kv_len: c.kv_len(),
            page_tokens,
            span_positions: span_pages(page_tokens) * page_tokens,
            scale: c.attention_scale,
            softcap: c.attention_softcap,
            window: self.window(layer),
        };
        // Decode tokens (a sequence with one new token) split their positions
        // by span across tasks; prefill chunks split their queries in blocks.
        let threads_count = self.threads.threads_count();
        let mut tasks: Vec<AttentionTask> = Vec::new();
        let mut merges: Vec<(usize, usize)> = Vec::new(); // (decode index, kv head)
        let mut decodes = 0usize;
        let mut spans_max = 1usize;
        let mut t0 = 0;
        for (seq_index, step) in steps.iter().enumerate() {
            let t_end = t0 + step.tokens.len();
            if step.tokens.len() == 1 {
                let span_range = ctx.spans(slots[t0].pos);
                let spans = span_range.len();
                spans_max = spans_max.max(spans);
                // A task reads whole pages (every KV head) where there are
                // spans enough to keep the threads busy: the pages are read
                // front to back, at twice the rate of one head's rows. Short
                // contexts split by head instead.
                // Such a task takes a run of consecutive spans, a few runs
                // per thread: a thread then reads long runs of memory (where
                // the sequence's pages are in order), which the hardware's
                // prefetch follows, and a descheduled thread's share is
                // still split among the others.
                let (heads_per_task, spans_per_task) = if spans >= 2 * threads_count {
                    let runs = threads_count * DECODE_RUNS_PER_THREAD;
                    (c.kv_heads_count, spans.div_ceil(runs))
                } else {
                    (1, 1)
                };
                for first in (0..c.kv_heads_count).step_by(heads_per_task) {
                    let kv_heads = first..(first + heads_per_task).min(c.kv_heads_count);
                    for span in span_range.clone().step_by(spans_per_task) {
                        tasks.push(AttentionTask::Span {
                            seq_index,
                            t: t0,
                            decode: decodes,
                            kv_heads: kv_heads.clone(),
                            spans: span..(span + spans_per_task).min(span_range.end),
                        });
                    }
                }
                if spans > 1 {
                    merges.extend((0..c.kv_heads_count).map(|kv_head| (decodes, kv_head)));
                }
                decodes += 1;
            } else {
                for kv_head in 0..c.kv_heads_count {
                    let mut a = t0;
                    while a < t_end {
                        let b = (a + QUERY_BLOCK_TOKENS).min(t_end);
                        tasks.push(AttentionTask::Block {
                            seq_index,
                            kv_head,
                            t0: a,
                            t1: b,
                        });
                        a = b;
                    }
                }
            }
            t0 = t_end;
        }
        let part_len = ctx.head_dim + 2;
        let s = &mut self.scratch;
        // [decode][head][span][m, l, o[head_dim]]
        let partials_len = decodes * ctx.heads_count * spans_max * part_len;
        if s.partials.len() < partials_len {
            s.partials.resize(partials_len, 0.0);
        }
        let q = &s.q;
        let out = SharedOut(s.attn.as_mut_ptr());
        let partials = SharedOut(s.partials.as_mut_ptr());
        let workers = &s.workers;
        self.threads.run(tasks.len(), &|i, worker| {
            let mut scratch = workers[worker].lock().unwrap_or_else(|e| e.into_inner());
            match tasks[i].clone() {
                AttentionTask::Span {
                    seq_index,
                    t,
                    decode,
                    kv_heads,
                    spans,
                } => {
                    let pos = slots[t].pos;
                    let own_spans = ctx.spans(pos);
                    let WorkerScratch {
                        scores,
                        tiles,
                        part,
                        ..
                    } = &mut *scratch;
                    let stride = ctx.kv_group * part_len;
                    part.resize(kv_heads.len() * stride, 0.0);
                    for span in spans {
                        let first = span * ctx.span_positions;
                        let end = (pos + 1).min(first + ctx.span_positions);
                        // Tile rows this token sees: all but those before its window.
                        let rows = ctx.first_pos(pos).max(first) - first..end - first;
                        if vector::paged(ctx.isa, ctx.head_dim) && rows.start == 0 {
                            ctx.paged_partials(
                                view,
                                seq_index,
                                kv_heads.clone(),
                                span,
                                end,
                                q,
                                t,
                                scores,
                                part,
                            );
                        } else {
                            let tiles = &mut tiles[..kv_heads.len()];
                            ctx.load_tiles(view, seq_index, kv_heads.clone(), span, end, tiles);
                            let heads = part.chunks_exact_mut(stride).zip(tiles.iter());
                            for ((part, tile), kv_head) in heads.zip(kv_heads.clone()) {
                                let rows = rows.clone();
                                ctx.tile_partial(tile, rows, kv_head, q, t, scores, part);
                            }
                        }
                        for (kv_head, part) in kv_heads.clone().zip(part.chunks_exact(stride)) {
                            if own_spans.len() == 1 {
                                ctx.write_out(part, t, kv_head, out);
                                continue;
                            }
                            // Partials are stored by the span's index among the token's own.
                            let index = span - own_spans.start;
                            for g in 0..ctx.kv_group {
                                let h = kv_head * ctx.kv_group + g;
                                let at =
                                    ((decode * ctx.heads_count + h) * spans_max + index) * part_len;
                                // SAFETY: (decode, head, span) belongs to this task only,
                                // and `partials` holds every index below partials_len.
                                let dst = unsafe {
                                    std::slice::from_raw_parts_mut(partials.ptr().add(at), part_len)
                                };
                                dst.copy_from_slice(&part[g * part_len..(g + 1) * part_len]);
                            }
                        }
                    }
                }
                AttentionTask::Block {
                    seq_index,
                    kv_head,
                    t0,
                    t1,
                } => ctx.block(
                    view,
                    seq_index,
                    kv_head,
                    slots,
                    q,
                    t0,
                    t1,
                    out,
                    &mut scratch,
                ),
            }
        });
        if merges.is_empty() {
            return;
        }
        // Decode tokens split over several spans: fold their partials in span
        // order, exactly as a prefill block folds them as it goes.
        let decode_tokens: Vec<usize> = {
            let mut t0 = 0;
            let mut tokens = Vec::with_capacity(decodes);
            for step in steps {
                if step.tokens.len() == 1 {
                    tokens.push(t0);
                }
                t0 += step.tokens.len();
            }
            tokens
        };
        let s = &self.scratch;
        let (partials, workers) = (&s.partials, &s.workers);
        self.threads.run(merges.len(), &|i, worker| {
            let (decode, kv_head) = merges[i];
            let t = decode_tokens[decode];
            let spans = ctx.spans(slots[t].pos).len();
            let mut scratch = workers[worker].lock().unwrap_or_else(|e| e.into_inner());
            let mut state = std::mem::take(&mut scratch.state);
            state.resize(ctx.kv_group * part_len, 0.0);
            for g in 0..ctx.kv_group {
                let h = kv_head * ctx.kv_group + g;
                let at =
                    |span: usize| ((decode * ctx.heads_count + h) * spans_max + span) * part_len;
                let state = &mut state[g * part_len..(g + 1) * part_len];
                state.copy_from_slice(&partials[at(0)..at(0) + part_len]);
                for span in 1..spans {
                    merge_partial(state, &partials[at(span)..at(span) + part_len]);
                }
            }
            ctx.write_out(&state, t, kv_head, out);
            scratch.state = state;
        });
    }

    /// Computes logits for the last [`SeqStep::logits`] tokens of each
    /// sequence. The rows past one a sequence (a prompt's log
    /// probabilities) grow the scratch when first asked for, not before.
    fn output_logits(&mut self, steps: &[SeqStep<'_>]) -> usize {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        let d = c.embedding_len;
        let s = &mut self.scratch;
        let mut wanted = 0;
        let mut t_end = 0;
        for step in steps {
            t_end += step.tokens.len();
            // xn is free after the last block: gather the rows there (a row
            // is a token's, so there are at most as many as tokens).
            let first = t_end - step.logits;
            s.xn[wanted * d..(wanted + step.logits) * d]
                .copy_from_slice(&s.x[first * d..t_end * d]);
            wanted += step.logits;
        }
        if wanted == 0 {
            return 0;
        }
        if s.logits.len() < wanted * c.vocab_len {
            s.out_norm.resize(wanted * d, 0.0);
            s.logits.resize(wanted * c.vocab_len, 0.0);
        }
        rmsnorm_rows(
            &s.xn[..wanted * d],
            &model.output_norm,
            c.rms_eps,
            &mut s.out_norm[..wanted * d],
        );
        s.xq.quantize(model.output.ty(), &s.out_norm[..wanted * d], wanted, d)
            .expect(WIDTHS_CHECKED);
        self.matmuls(&[(&model.output, Buf::Logits)], wanted);
        if let Some(cap) = c.final_softcap {
            let logits = &mut self.scratch.logits[..wanted * c.vocab_len];
            vector::softcap(self.isa, logits, cap);
        }
        wanted
    }

    /// `dst[t][r] = W[r] · xq[t]` for each (matrix, destination) of
    /// `products`, which share the quantized input `xq`: their output rows are
    /// cut into tasks together, so the pool meets once for all of them, not
    /// once per matrix (a decode step is dozens of small products, and each
    /// meeting waits for the slowest thread). A row's value does not depend on
    /// the task it lands in.
    fn matmuls(&mut self, products: &[(&Matrix, Buf)], tokens: usize) {
        let model = Arc::clone(&self.model);
        let s = &mut self.scratch;
        let outs: Vec<SharedOut> = products
            .iter()
            .map(|&(_, dst)| SharedOut(dst.select(s).as_mut_ptr()))
            .collect();
        // Each matrix cut as if it ran alone (so the tasks stay even), all
        // tasks in one run.
        let tasks_wanted = self.threads.threads_count() * MATMUL_TASKS_PER_THREAD;
        let mut tasks: Vec<(usize, Range<usize>)> = Vec::new(); // (product, rows)
        for (i, (matrix, _)) in products.iter().enumerate() {
            let chunk = matrix
                .rows
                .div_ceil(tasks_wanted)
                .next_multiple_of(MATMUL_ROWS_ALIGN);
            let mut start = 0;
            while start < matrix.rows {
                let end = (start + chunk).min(matrix.rows);
                tasks.push((i, start..end));
                start = end;
            }
        }
        let isa = self.isa;
        let xq = &s.xq;
        let workers = &s.workers;
        let model = &model;
        // Repacked matrices run by the 16-row kernels where they run (task
        // rows are cut at multiples of MATMUL_ROWS_ALIGN = 16, and such a
        // matrix has a whole number of groups).
        let threads = self.threads.threads_count();
        let repacked = (isa == Isa::Avx512).then(|| model.repacked(threads));
        let product = |matrix: &Matrix, rows: Range<usize>, dst: &mut [f32]| {
            if let Some(packed) = repacked.and_then(|r| r.get(matrix)) {
                let (ty, k) = (matrix.ty(), matrix.cols);
                quant::repack::matmul_repacked(ty, packed, k, rows, xq, dst);
                return;
            }
            quant::matmul(
                isa,
                matrix.ty(),
                model.bytes(matrix),
                matrix.cols,
                rows,
                xq,
                dst,
            );
        };
        self.threads.run(tasks.len(), &|i, worker| {
            let (product_index, ref rows_range) = tasks[i];
            let matrix = products[product_index].0;
            let (start, end) = (rows_range.start, rows_range.end);
            let rows = matrix.rows;
            let out = outs[product_index];
            let n = end - start;
            if tokens == 1 {
                // SAFETY: tasks own disjoint row ranges of the single output row.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(start), n) };
                product(matrix, start..end, dst);
                return;
            }
            let mut scratch = workers[worker].lock().unwrap_or_else(|e| e.into_inner());
            let buf = &mut scratch.rows_out;
            buf.resize(tokens * n, 0.0);
            product(matrix, start..end, &mut buf[..tokens * n]);
            for t in 0..tokens {
                // SAFETY: rows start..end of every token row belong to this task only.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out.ptr().add(t * rows + start), n) };
                dst.copy_from_slice(&buf[t * n..(t + 1) * n]);
            }
        });
    }
}

/// Whether two matrices multiply the same quantized activations (then one
/// quantization and one region of the pool serve both).
fn same_activations(a: &Matrix, b: &Matrix) -> bool {
    ActivationFormat::for_weights(a.ty()) == ActivationFormat::for_weights(b.ty())
}

/// Destination of a matrix product.
#[derive(Clone, Copy)]
enum Buf {
    Q,
    K,
    V,
    Gate,
    Up,
    Delta,
    Logits,
}

impl Buf {
    fn select(self, s: &mut Scratch) -> &mut [f32] {
        match self {
            Buf::Q => &mut s.q,
            Buf::K => &mut s.k,
            Buf::V => &mut s.v,
            Buf::Gate => &mut s.gate,
            Buf::Up => &mut s.up,
            Buf::Delta => &mut s.delta,
            Buf::Logits => &mut s.logits,
        }
    }
}

/// One attention task.
#[derive(Clone)]
enum AttentionTask {
    /// Consecutive spans of a decode token's positions, for the query heads
    /// of KV heads `kv_heads`: one partial per span and head.
    Span {
        seq_index: usize,
        /// The token's row in the step.
        t: usize,
        /// Its index among the step's decode tokens.
        decode: usize,
        kv_heads: Range<usize>,
        spans: Range<usize>,
    },
    /// Every span of a block of prefill queries `t0..t1` (step rows), for the
    /// query heads of one KV head.
    Block {
        seq_index: usize,
        kv_head: usize,
        t0: usize,
        t1: usize,
    },
}

/// Pages per attention span: `SPAN_POSITIONS` rounded to whole pages, at
/// least one.
fn span_pages(page_tokens: usize) -> usize {
    (SPAN_POSITIONS / page_tokens).max(1)
}

/// What every attention task needs to know about the layer.
///
/// # The reduction
///
/// A token at position `pos` attends to positions `first..=pos` (`first` is 0,
/// or where its window starts in a local layer), cut into spans of
/// `span_positions` (whole pages; the first span the token sees may start
/// inside at `first`). For each span and query head, one partial: the span's
/// scores `s_j = scale · q·k_j` (soft-capped, `cap · tanh(s_j / cap)`, where
/// the family says so), `m = max s_j`, `p_j = e^(s_j - m)`, `l = Σ p_j`, `o =
/// Σ p_j v_j`. Partials fold left to right, the token's first span first:
/// `m' = max(m_a, m_b)`, `l' = l_a e^(m_a - m') + l_b e^(m_b - m')`, the same
/// for `o`; the output is `o / l`.
///
/// That order is fixed by the position alone, never by the batch, the chunk
/// or the thread: a prefill block computes span partials query by query and
/// folds them as it goes; a decode token's spans are separate tasks (so one
/// long sequence uses every core), stored, and folded afterwards in the same
/// order by the same function. So a token's attention output has the same bits
/// whether it came in a prompt chunk, alone, or in any batch: what the prefix
/// cache and preemption's recompute rely on.
///
/// A prefill block walks spans in the outer loop and its queries in the inner
/// one, so a span's K and V are read from memory once per block of
/// `QUERY_BLOCK_TOKENS` queries (widened into a tile) and stay in cache for
/// the rest. A decode token reads each span once: with AVX-512 in place from
/// the pages ([`AttentionContext::paged_partials`], the same kernels as the
/// tile), elsewhere through the tile.
struct AttentionContext {
    layer: u32,
    isa: Isa,
    heads_count: usize,
    head_dim: usize,
    kv_group: usize,
    kv_len: usize,
    page_tokens: usize,
    span_positions: usize,
    /// Multiplies `q·k`.
    scale: f32,
    /// Scores become `cap · tanh(score / cap)`.
    softcap: Option<f32>,
    /// A local layer's window: positions a token sees, itself included.
    window: Option<usize>,
}

impl AttentionContext {
    /// The first position a token at `pos` attends to: 0, or the start of its
    /// window in a local layer.
    fn first_pos(&self, pos: usize) -> usize {
        match self.window {
            Some(window) => (pos + 1).saturating_sub(window),
            None => 0,
        }
    }

    /// The spans a token at `pos` attends over: from the one holding its
    /// first position to the one holding `pos`. Its partials fold in this
    /// order, the first one starting the fold.
    fn spans(&self, pos: usize) -> Range<usize> {
        self.first_pos(pos) / self.span_positions..(pos + 1).div_ceil(self.span_positions)
    }

    /// Loads K and V of each of `kv_heads` at positions `span *
    /// span_positions..end` into its tile (`tiles[i]` for `kv_heads.start +
    /// i`), as f32 rows of `head_dim` (exact: f16 widens without rounding).
    /// Page by page, every head of a page before the next page, so that
    /// several heads read memory front to back. The one place attention
    /// reads pages.
    fn load_tiles(
        &self,
        view: &StepView<'_>,
        table: usize,
        kv_heads: Range<usize>,
        span: usize,
        end: usize,
        tiles: &mut [Tile],
    ) {
        let hd = self.head_dim;
        let first = span * self.span_positions;
        let len = (end - first) * hd;
        for tile in tiles.iter_mut() {
            if tile.k.len() < len {
                tile.k.resize(len, 0.0);
                tile.v.resize(len, 0.0);
            }
        }
        for page in first / self.page_tokens..end.div_ceil(self.page_tokens) {
            let (k, v) = view.page(table, page, self.layer);
            let at = page * self.page_tokens;
            let used = (end - at).min(self.page_tokens);
            let rows = (at - first) * hd..(at - first + used) * hd;
            for (kv_head, tile) in kv_heads.clone().zip(tiles.iter_mut()) {
                let offset = kv_head * hd;
                vector::widen_rows(
                    self.isa,
                    k,
                    self.kv_len,
                    offset,
                    hd,
                    &mut tile.k[rows.clone()],
                );
                vector::widen_rows(
                    self.isa,
                    v,
                    self.kv_len,
                    offset,
                    hd,
                    &mut tile.v[rows.clone()],
                );
            }
        }
    }

    /// The partials over rows `rows` of `tile` for the query heads of
    /// `kv_head` of token `t`: `part` is `[group][m, l, o[head_dim]]`.
    #[allow(clippy::too_many_arguments)]
    fn tile_partial(
        &self,
        tile: &Tile,
        rows: Range<usize>,
        kv_head: usize,
        q: &[f32],
        t: usize,
        scores: &mut Vec<f32>,
        part: &mut [f32],
    ) {
        let (hd, d, group) = (
            self.head_dim,
            self.heads_count * self.head_dim,
            self.kv_group,
        );
        let positions = rows.len();
        if scores.len() < group * positions {
            scores.resize(group * positions, 0.0);
        }
        let tile_rows = rows.start * hd..rows.end * hd;
        let (k, v) = (&tile.k[tile_rows.clone()], &tile.v[tile_rows]);
        let scores = &mut scores[..group * positions];
        // The group's query heads are consecutive: one K (and V) pass for all.
        let first = t * d + kv_head * group * hd;
        let q_rows = &q[first..first + group * hd];
        vector::dot_rows_group_f32(self.isa, q_rows, group, k, hd, 0, self.scale, scores);
        self.shift_scores(scores, positions, part);
        vector::axpy_rows_group_f32(
            self.isa,
            scores,
            group,
            v,
            hd,
            0,
            hd,
            &mut part[2..],
            hd + 2,
        );
    }

    /// The middle of a partial: each group row of `scores` (`[group][positions]`)
    /// is soft-capped where the layer says so, then becomes `e^(s - m)`, and
    /// its `m`, `l` go to `part` with `o` zeroed.
    fn shift_scores(&self, scores: &mut [f32], positions: usize, part: &mut [f32]) {
        if let Some(cap) = self.softcap {
            vector::softcap(self.isa, scores, cap);
        }
        let part_len = self.head_dim + 2;
        for (scores, part) in scores
            .chunks_exact_mut(positions)
            .zip(part.chunks_exact_mut(part_len))
        {
            let (m, l) = vector::exp_shift(self.isa, scores);
            part[0] = m;
            part[1] = l;
            part[2..].fill(0.0);
        }
    }

    /// [`Self::load_tiles`] and [`Self::tile_partial`] for token `t` over
    /// span `span` (positions up to `end`) and each of `kv_heads`, without the
    /// tile: K and V are read in place from the span's pages, fetched once for
    /// every head (needs [`vector::paged`]). The same arithmetic on the same
    /// values (f16 widens exactly), so the same bits as the tile path: a decode
    /// token reads its pages once, and still matches its prefill. `parts` is
    /// `[kv_heads][group][m, l, o[head_dim]]`.
    #[allow(clippy::too_many_arguments)]
    fn paged_partials(
        &self,
        view: &StepView<'_>,
        table: usize,
        kv_heads: Range<usize>,
        span: usize,
        end: usize,
        q: &[f32],
        t: usize,
        scores: &mut Vec<f32>,
        parts: &mut [f32],
    ) {
        match view.layout().geometry().kv_type {
            KvType::F16 => self
                .paged_partials_typed::<f16>(view, table, kv_heads, span, end, q, t, scores, parts),
            KvType::F32 => self
                .paged_partials_typed::<f32>(view, table, kv_heads, span, end, q, t, scores, parts),
        }
    }

    /// [`Self::paged_partials`] for pages of `T`.
    #[allow(clippy::too_many_arguments)]
    fn paged_partials_typed<T: KvValue>(
        &self,
        view: &StepView<'_>,
        table: usize,
        kv_heads: Range<usize>,
        span: usize,
        end: usize,
        q: &[f32],
        t: usize,
        scores: &mut Vec<f32>,
        parts: &mut [f32],
    ) {
        let (hd, d, group) = (
            self.head_dim,
            self.heads_count * self.head_dim,
            self.kv_group,
        );
        let first = span * self.span_positions;
        let first_page = first / self.page_tokens;
        let pages = end.div_ceil(self.page_tokens) - first_page;
        let mut ks: [&[T]; SPAN_POSITIONS] = [&[]; SPAN_POSITIONS];
        let mut vs: [&[T]; SPAN_POSITIONS] = [&[]; SPAN_POSITIONS];
        for (i, (k, v)) in ks.iter_mut().zip(vs.iter_mut()).take(pages).enumerate() {
            let (k_slab, v_slab) = view.page(table, first_page + i, self.layer);
            *k = T::values(k_slab).expect(ONE_TYPE_PER_POOL);
            *v = T::values(v_slab).expect(ONE_TYPE_PER_POOL);
        }
        // Every head of the task in one pass over the pages: query heads,
        // scores and partials of consecutive KV heads are consecutive.
        let (positions, sets) = (end - first, kv_heads.len() * group);
        if scores.len() < sets * positions {
            scores.resize(sets * positions, 0.0);
        }
        let scores = &mut scores[..sets * positions];
        let part_len = hd + 2;
        let parts = &mut parts[..sets * part_len];
        let rows = |pages| vector::HeadRows {
            pages,
            page_rows: self.page_tokens,
            stride: self.kv_len,
            offset: kv_heads.start * hd,
        };
        let first_q = t * d + kv_heads.start * group * hd;
        let q_rows = &q[first_q..first_q + sets * hd];
        let heads = kv_heads.len();
        let k = rows(&ks[..pages]);
        vector::dot_rows_paged(self.isa, q_rows, group, heads, k, self.scale, scores);
        self.shift_scores(scores, positions, parts);
        let v = rows(&vs[..pages]);
        vector::axpy_rows_paged(
            self.isa,
            scores,
            group,
            heads,
            v,
            hd,
            &mut parts[2..],
            part_len,
        );
    }

    /// Attention of prefill queries `t0..t1` (consecutive positions of one
    /// sequence) for the query heads of `kv_head`: spans outside, loaded once
    /// into a tile; queries inside, each query's partials folded in span order.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        view: &StepView<'_>,
        table: usize,
        kv_head: usize,
        slots: &[TokenSlot],
        q: &[f32],
        t0: usize,
        t1: usize,
        out: SharedOut,
        scratch: &mut WorkerScratch,
    ) {
        let part_len = self.head_dim + 2;
        let stride = self.kv_group * part_len;
        let WorkerScratch {
            scores,
            part,
            state,
            tiles,
            ..
        } = scratch;
        let tile = &mut tiles[0];
        part.resize(stride, 0.0);
        state.resize((t1 - t0) * stride, 0.0);
        let last = slots[t1 - 1].pos;
        for span in self.spans(slots[t0].pos).start..self.spans(last).end {
            let first = span * self.span_positions;
            let span_end = first + self.span_positions;
            let end = (last + 1).min(span_end);
            self.load_tiles(
                view,
                table,
                kv_head..kv_head + 1,
                span,
                end,
                std::slice::from_mut(tile),
            );
            for t in t0..t1 {
                let pos = slots[t].pos;
                let own_spans = self.spans(pos);
                if !own_spans.contains(&span) {
                    continue;
                }
                let rows = self.first_pos(pos).max(first) - first..(pos + 1).min(span_end) - first;
                let state = &mut state[(t - t0) * stride..(t - t0 + 1) * stride];
                if span == own_spans.start {
                    self.tile_partial(tile, rows, kv_head, q, t, scores, state);
                    continue;
                }
                self.tile_partial(tile, rows, kv_head, q, t, scores, part);
                for g in 0..self.kv_group {
                    let at = g * part_len..(g + 1) * part_len;
                    merge_partial(&mut state[at.clone()], &part[at]);
                }
            }
        }
        for t in t0..t1 {
            self.write_out(
                &state[(t - t0) * stride..(t - t0 + 1) * stride],
                t,
                kv_head,
                out,
            );
        }
    }

    /// Writes `o / l` of each folded partial in `state` (`[group][m, l,
    /// o[head_dim]]`) as token `t`'s attention output for the heads of `kv_head`.
    fn write_out(&self, state: &[f32], t: usize, kv_head: usize, out: SharedOut) {
        let (hd, d, group) = (
            self.head_dim,
            self.heads_count * self.head_dim,
            self.kv_group,
        );
        let first_head = kv_head * group;
        // SAFETY: token t's heads first_head..first_head + group belong to exactly
        // one task (the one that folds this token's partials for this KV head).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(out.ptr().add(t * d + first_head * hd), group * hd)
        };
        for g in 0..group {
            let part = &state[g * (hd + 2)..(g + 1) * (hd + 2)];
            let inv = 1.0 / part[1];
            for (o, &x) in dst[g * hd..(g + 1) * hd].iter_mut().zip(&part[2..]) {
                *o = x * inv;
            }
        }
    }
}

/// Folds partial `part` (`[m, l, o[..]]`) into `state`, the partial of the
/// spans before it (see [`AttentionContext`]).
fn merge_partial(state: &mut [f32], part: &[f32]) {
    let m = state[0].max(part[0]);
    let a = vector::exp(state[0] - m);
    let b = vector::exp(part[0] - m);
    state[0] = m;
    state[1] = state[1] * a + part[1] * b;
    for (s, &p) in state[2..].iter_mut().zip(&part[2..]) {
        *s = *s * a + p * b;
    }
}

/// `out[t] = x[t] / rms(x[t]) * gain` for each row of width `gain.len()`.
fn rmsnorm_rows(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    let d = gain.len();
    for (row, out_row) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for ((o, &v), &g) in out_row.iter_mut().zip(row).zip(gain) {
            *o = v * inv * g;
        }
    }
}

/// `x[t] += bias` for each row of width `bias.len()`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_into(row, bias);
    }
}

/// RMS-normalises each row of width `gain.len()` (one head) in place.
fn rmsnorm_in_place(x: &mut [f32], gain: &[f32], eps: f32) {
    let width = gain.len();
    for row in x.chunks_exact_mut(width) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(gain) {
            *v = *v * inv * g;
        }
    }
}

/// Rotates the first `rope_dim` dims of each `head_dim` head of each token's
/// row by the token's angles: pairs `(2i, 2i+1)` ([`RopeStyle::Adjacent`], the
/// GGUF llama layout, whose Q/K weights are permuted for it) or `(i, i +
/// rope_dim / 2)` ([`RopeStyle::Halves`]).
fn apply_rope(x: &mut [f32], rope: &[f32], heads: usize, c: &ModelConfig) {
    let (style, head_dim) = (c.rope_style, c.head_dim);
    let pairs = c.rope_dim / 2;
    let width = heads * head_dim;
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let table = &rope[t * pairs * 2..(t + 1) * pairs * 2];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..pairs {
                let (cos, sin) = (table[2 * i], table[2 * i + 1]);
                let (ia, ib) = match style {
                    RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + pairs),
                };
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * cos - b * sin;
                head[ib] = a * sin + b * cos;
            }
        }
    }
}

fn add_into(x: &mut [f32], delta: &[f32]) {
    x.iter_mut().zip(delta).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    //! The attention kernels against a plain f64 softmax over the same (stored)
    //! values, on random pages: partial last pages, page and span boundaries
    //! inside a prefill chunk, every query-head grouping, both value types and
    //! every instruction set; and a token's output is the same bits whether it
    //! is a decode token (its spans split across tasks) or one query of a
    //! prefill block (its spans folded as it goes).

    use super::*;
    use crate::gguf::Gguf;
    use crate::kv::{KvType, OwnerTag, PageTable, PartitionConfig, SeqId};
    use crate::rng::SplitMix64;

    fn uniform(rng: &mut SplitMix64) -> f32 {
        rng.next_f64() as f32
    }
    use crate::testing::{tiny_llama, TinySpec};

    const OWNER: OwnerTag = OwnerTag(1);

    struct Case {
        heads: u32,
        kv_heads: u32,
        page_tokens: u32,
        kv_type: KvType,
    }

    /// `len` positions of random K and V in layer 0 of a fresh table.
    fn filled(model: &Model, case: &Case, len: usize, rng: &mut SplitMix64) -> (Pool, PageTable) {
        let pages = (len as u32).div_ceil(case.page_tokens);
        let geometry = model
            .config
            .pool_geometry(pages, case.page_tokens, case.kv_type);
        let partition = PartitionConfig {
            owner: OWNER,
            pages_reserved: pages,
            pages_max: pages,
        };
        let mut pool = Pool::new(geometry, &[partition], Default::default()).unwrap();
        let mut reservation = pool.reserve(OWNER, pages).unwrap();
        let mut table = pool.page_table(&reservation, SeqId(1));
        for _ in 0..pages {
            pool.acquire(&mut reservation, &mut table).unwrap();
        }
        pool.release_reservation(reservation);
        let kv_len = model.config.kv_len();
        let pt = case.page_tokens as usize;
        for pos in 0..len {
            let k: Vec<f32> = (0..kv_len).map(|_| uniform(rng) * 4.0 - 2.0).collect();
            let v: Vec<f32> = (0..kv_len).map(|_| uniform(rng) * 2.0 - 1.0).collect();
            let lease = table.lease(pos / pt).unwrap();
            pool.write_kv(lease, 0, (pos % pt) as u32, &k, &v).unwrap();
        }
        (pool, table)
    }

    /// `softmax(q·K / sqrt(hd)) · V` in f64 over positions `0..=pos` (the
    /// window's, where layer 0 is local; scores soft-capped where the model
    /// says so), for head `h`.
    fn reference(
        model: &Model,
        pool: &Pool,
        table: &PageTable,
        q: &[f32],
        h: usize,
        pos: usize,
    ) -> Vec<f64> {
        let c = &model.config;
        let (hd, kv_len) = (c.head_dim, c.kv_len());
        let offset = (h / c.kv_group()) * hd;
        let pt = pool.layout().geometry().page_tokens as usize;
        let row = |slab: usize, p: usize| {
            let (k, v) = pool.page_kv(table.lease(p / pt).unwrap(), 0).unwrap();
            let values = [k, v][slab].to_f32_vec();
            let at = (p % pt) * kv_len + offset;
            values[at..at + hd].to_vec()
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let first = match c.sliding_window.as_ref().and_then(|w| w.of_layer(0)) {
            Some(window) => (pos + 1).saturating_sub(window),
            None => 0,
        };
        let scores: Vec<f64> = (first..=pos)
            .map(|p| {
                let k = row(0, p);
                let s = q
                    .iter()
                    .zip(&k)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>()
                    * scale;
                match c.attention_softcap {
                    Some(cap) => f64::from(cap) * (s / f64::from(cap)).tanh(),
                    None => s,
                }
            })
            .collect();
        let max = scores.iter().copied().fold(f64::MIN, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut out = vec![0.0f64; hd];
        for (p, w) in (first..).zip(&weights) {
            for (o, &x) in out.iter_mut().zip(&row(1, p)) {
                *o += w / total * f64::from(x);
            }
        }
        out
    }

    #[test]
    fn attention_matches_an_f64_softmax_and_is_the_same_bits_in_prefill_and_decode() {
        // (heads, KV heads, page tokens, value type, embedding width, local
        // window and score cap: a gemma2 model, whose layer 0 is local)
        let cases = [
            (4, 4, 3, KvType::F16, 64, None), // group 1; spans of 126 positions (42 pages)
            (4, 2, 16, KvType::F16, 64, None), // group 2; spans of 128 (8 pages)
            (4, 1, 16, KvType::F32, 64, None), // group 4
            (4, 1, 5, KvType::F32, 64, None),
            (3, 1, 16, KvType::F16, 96, None), // group 3, as SmolLM2; head width 32
            (2, 1, 7, KvType::F16, 128, None), // group 2, head width 64
            // Windows that start inside a span, over several spans or one or two.
            (4, 2, 16, KvType::F16, 64, Some((300, 1.5))),
            (4, 1, 5, KvType::F32, 64, Some((100, 0.5))),
        ];
        // Positions 0..1200 (context 1280): spans end at 126/128, 252/256 and
        // so on. With two threads a decode token of 4 spans or more (from
        // position 378/384) reads whole pages per task; fewer, one KV head.
        // From 9 spans (position 1008/1024) a task takes a run of 2 spans.
        let (len, chunk_start) = (1200usize, 1140usize);
        for (heads, kv_heads, page_tokens, kv_type, embedding_len, local) in cases {
            let case = Case {
                heads,
                kv_heads,
                page_tokens,
                kv_type,
            };
            let spec = TinySpec {
                heads: case.heads,
                kv_heads: case.kv_heads,
                embedding_len,
                context_len: 1280,
                ..match local {
                    Some((window, cap)) => TinySpec {
                        architecture: crate::model::Architecture::Gemma2,
                        sliding_window: Some((window, 2)),
                        softcaps: (Some(cap), None),
                        ..TinySpec::default()
                    },
                    None => TinySpec::default(),
                }
            };
            let gguf = Gguf::from_bytes(tiny_llama(&spec)).unwrap();
            let model = Arc::new(Model::load(Arc::new(gguf)).unwrap());
            let c = model.config.clone();
            let d = c.embedding_len;
            let mut rng = SplitMix64(u64::from(page_tokens) * 7 + u64::from(kv_heads));
            let (mut pool, table) = filled(&model, &case, len, &mut rng);
            for isa in Isa::available() {
                let mut backend = CpuBackend::new(
                    Arc::clone(&model),
                    CpuOptions {
                        threads_count: 2,
                        step_tokens_max: 128,
                        step_seqs_max: 8,
                        isa: Some(isa),
                    },
                );
                // Step 1: one prefill chunk at chunk_start..len, and the same
                // sequence's positions as decode tokens beside it.
                let chunk = len - chunk_start;
                let decodes = [
                    0usize, 1, 125, 126, 127, 128, 251, 256, 377, 378, 383, 384, 512, 599, 1007,
                    1008, 1023, 1024, 1140, 1151, 1199,
                ];
                let tokens = vec![0u32; chunk];
                let one = [0u32];
                let mut steps = vec![SeqStep {
                    logits: 0,
                    ..SeqStep::new(&table, chunk_start, &tokens)
                }];
                let mut slots: Vec<TokenSlot> = (chunk_start..len)
                    .map(|pos| TokenSlot { seq_index: 0, pos })
                    .collect();
                for &pos in &decodes {
                    slots.push(TokenSlot {
                        seq_index: steps.len(),
                        pos,
                    });
                    steps.push(SeqStep {
                        logits: 0,
                        ..SeqStep::new(&table, pos, &one)
                    });
                }
                let mut q: Vec<f32> = (0..slots.len() * d)
                    .map(|_| uniform(&mut rng) * 2.0 - 1.0)
                    .collect();
                // A decode token's query is the prefill token's at the same position.
                for (i, &pos) in decodes.iter().enumerate() {
                    if pos >= chunk_start {
                        let from = (pos - chunk_start) * d;
                        q.copy_within(from..from + d, (chunk + i) * d);
                    }
                }
                backend.scratch.q[..q.len()].copy_from_slice(&q);
                let tables: Vec<&PageTable> = steps.iter().map(|s| s.pages).collect();
                let view = pool.step_view(&tables).unwrap();
                backend.attention(0, &steps, &slots, &view);
                drop(view);
                let attn = backend.scratch.attn.clone();
                let mut worst = 0.0f64;
                for (t, slot) in slots.iter().enumerate() {
                    for h in 0..c.heads_count {
                        let at = t * d + h * c.head_dim;
                        let q_row = &backend.scratch.q[at..at + c.head_dim];
                        let want = reference(&model, &pool, &table, q_row, h, slot.pos);
                        for (&got, want) in attn[at..at + c.head_dim].iter().zip(&want) {
                            worst = worst.max((f64::from(got) - want).abs());
                        }
                    }
                }
                assert!(
                    worst < 1e-6,
                    "{isa:?} {kv_type:?} pt {page_tokens} group {}: off by {worst}",
                    c.kv_group()
                );
                for (i, &pos) in decodes.iter().enumerate() {
                    if pos >= chunk_start {
                        let (a, b) = ((pos - chunk_start) * d, (chunk + i) * d);
                        assert_eq!(
                            attn[a..a + d],
                            attn[b..b + d],
                            "{isa:?}: position {pos} as decode differs from prefill"
                        );
                    }
                }
            }
        }
    }
}
