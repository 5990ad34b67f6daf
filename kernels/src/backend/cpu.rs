//! The CPU backend: a batched Llama forward pass over paged KV.
//!
//! One step concatenates every sequence's new tokens into one activation
//! matrix, so each weight matrix is streamed once per step whatever the batch
//! (prefill chunks and decode tokens mixed). Per layer:
//!
//! 1. `xn = rmsnorm(x) * attn_norm`, quantized once for Q, K and V.
//! 2. `q, k, v = xn·Wq, xn·Wk, xn·Wv`; RoPE on q and k at each token's position.
//! 3. k and v are written into the sequence's pages (ownership asserted by the pool).
//! 4. Attention per (sequence, kv head, token chunk) reads K/V only through the
//!    sequence's page table (ownership asserted again), causal to each position.
//! 5. `x += attn·Wo`; `x += (silu(xn·Wg) * xn·Wu)·Wd` with `xn = rmsnorm(x) * ffn_norm`.
//!
//! Logits are computed only for the last token of sequences that ask.
//! Matrix products split output rows across the thread pool; attention splits
//! (sequence, kv head, token chunk) tasks. Scratch is sized once, at creation,
//! for `step_tokens_max` tokens and `step_seqs_max` sequences.

use super::{vector, Backend, Logits, SeqStep, StepError};
use crate::kv::{PageTable, Pool};
use crate::model::{Matrix, Model};
use crate::quant::{self, Isa, QuantizedActivations};
use crate::threads::Threads;
use std::sync::{Arc, Mutex};

/// Tokens per attention task: long enough to amortise the page walk, short
/// enough to balance a prefill chunk across threads.
const ATTENTION_TOKENS_PER_TASK: usize = 16;
/// Output rows per matrix-product task are rounded to this (the kernels' tile).
const MATMUL_ROWS_ALIGN: usize = 16;
/// Row chunks per thread in a matrix product: more than one, so that when a
/// thread is descheduled (a loaded machine) the others take over its share.
const MATMUL_TASKS_PER_THREAD: usize = 4;
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
    q: Vec<f32>,     // [tokens][d]
    k: Vec<f32>,     // [tokens][kv_len]
    v: Vec<f32>,     // [tokens][kv_len]
    attn: Vec<f32>,  // [tokens][d] attention output before Wo
    gate: Vec<f32>,  // [tokens][ffn]
    up: Vec<f32>,    // [tokens][ffn]
    delta: Vec<f32>, // [tokens][d] output of Wo or Wd, added to x
    rope: Vec<f32>,  // [tokens][rope_dim / 2][cos, sin]
    xq: QuantizedActivations,
    out_norm: Vec<f32>, // [seqs][d] last rows of the sequences that want logits
    logits: Vec<f32>,   // [seqs][vocab]
    /// Per worker: matrix-product output before it is scattered, and attention scores.
    workers: Vec<Mutex<WorkerScratch>>,
}

#[derive(Default)]
struct WorkerScratch {
    rows_out: Vec<f32>, // [tokens][rows in task]
    scores: Vec<f32>,   // [context]
    acc: Vec<f32>,      // [head_dim]
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
    threads: Threads,
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
        let threads = Threads::new(options.threads_count);
        let workers = (0..threads.threads_count())
            .map(|_| {
                Mutex::new(WorkerScratch {
                    rows_out: Vec::new(),
                    scores: vec![0.0; c.context_len * c.kv_group()],
                    acc: vec![0.0; c.head_dim * c.kv_group()],
                })
            })
            .collect();
        let scratch = Scratch {
            x: vec![0.0; tokens * c.embedding_len],
            xn: vec![0.0; tokens * c.embedding_len],
            q: vec![0.0; tokens * c.embedding_len],
            k: vec![0.0; tokens * c.kv_len()],
            v: vec![0.0; tokens * c.kv_len()],
            attn: vec![0.0; tokens * c.embedding_len],
            gate: vec![0.0; tokens * c.ffn_len],
            up: vec![0.0; tokens * c.ffn_len],
            delta: vec![0.0; tokens * c.embedding_len],
            rope: vec![0.0; tokens * c.rope_dim],
            xq: QuantizedActivations::new(),
            out_norm: vec![0.0; seqs * c.embedding_len],
            logits: vec![0.0; seqs * c.vocab_len],
            workers,
        };
        CpuBackend {
            isa: options.isa.unwrap_or_else(Isa::detect),
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
        let c = &self.model.config;
        if steps.len() > self.options.step_seqs_max {
            return Err(StepError::TooManySequences {
                seqs: steps.len(),
                seqs_max: self.options.step_seqs_max,
            });
        }
        let mut tokens = 0usize;
        for (index, step) in steps.iter().enumerate() {
            if step.tokens.is_empty() {
                return Err(StepError::EmptySequence { index });
            }
            if let Some(&token) = step.tokens.iter().find(|&&t| t as usize >= c.vocab_len) {
                return Err(StepError::TokenOutOfRange {
                    token,
                    vocab_len: c.vocab_len,
                });
            }
            let end = step.pos_start.saturating_add(step.tokens.len());
            if end > c.context_len {
                return Err(StepError::PositionOutOfRange {
                    end,
                    capacity: c.context_len,
                    limit: "model context",
                });
            }
            let capacity = step.pages.pages_count() * page_tokens;
            if end > capacity {
                return Err(StepError::PositionOutOfRange {
                    end,
                    capacity,
                    limit: "page table",
                });
            }
            // Every page the step touches must be a live lease, and every page
            // it writes its own, not shared; the pool stays borrowed for the
            // whole step, so this holds until it ends.
            let first_written = step.pos_start / page_tokens;
            for page in 0..end.div_ceil(page_tokens) {
                let lease = step.pages.lease(page).expect("page count checked above");
                let writable = pool
                    .is_writable(lease)
                    .map_err(|_| StepError::StaleHandle { index })?;
                if page >= first_written && !writable {
                    return Err(StepError::SharedPage { index, page });
                }
            }
            tokens += step.tokens.len();
        }
        if tokens > self.options.step_tokens_max {
            return Err(StepError::TooManyTokens {
                tokens,
                tokens_max: self.options.step_tokens_max,
            });
        }
        Ok(tokens)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}", self.isa.name())
    }

    fn step_tokens_max(&self) -> usize {
        self.options.step_tokens_max
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
        let d = self.model.config.embedding_len;
        for (t, &token) in steps.iter().flat_map(|s| s.tokens).enumerate() {
            self.model
                .embed(token, &mut self.scratch.x[t * d..(t + 1) * d]);
        }
        self.fill_rope(&slots);
        for layer in 0..self.model.config.layers_count {
            self.attention_block(layer, steps, &slots, pool);
            self.ffn_block(layer, tokens);
        }
        let wanted = self.output_logits(steps);
        let vocab_len = self.model.config.vocab_len;
        Ok(Logits {
            values: &self.scratch.logits[..wanted * vocab_len],
            vocab_len,
        })
    }
}

impl CpuBackend {
    /// `rope[t][i] = (cos, sin)(pos_t * base^(-2i / rope_dim))`.
    fn fill_rope(&mut self, slots: &[TokenSlot]) {
        let c = &self.model.config;
        let pairs = c.rope_dim / 2;
        for (t, slot) in slots.iter().enumerate() {
            for i in 0..pairs {
                let freq = c.rope_base.powf(-((2 * i) as f32) / c.rope_dim as f32);
                let theta = slot.pos as f32 * freq;
                let (sin, cos) = theta.sin_cos();
                self.scratch.rope[(t * pairs + i) * 2] = cos;
                self.scratch.rope[(t * pairs + i) * 2 + 1] = sin;
            }
        }
    }

    fn attention_block(
        &mut self,
        layer: usize,
        steps: &[SeqStep<'_>],
        slots: &[TokenSlot],
        pool: &mut Pool,
    ) {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        let w = &model.layers[layer];
        let tokens = slots.len();
        let (d, kv_len) = (c.embedding_len, c.kv_len());
        let s = &mut self.scratch;
        rmsnorm_rows(
            &s.x[..tokens * d],
            &w.attn_norm,
            c.rms_eps,
            &mut s.xn[..tokens * d],
        );
        s.xq.quantize(w.wq.ty(), &s.xn[..tokens * d], tokens, d)
            .expect(WIDTHS_CHECKED);
        self.matmul(&w.wq, tokens, Buf::Q);
        // Wq, Wk and Wv share the input type in every file we know; quantize again
        // only if they differ.
        if w.wk.ty() != w.wq.ty() {
            let s = &mut self.scratch;
            s.xq.quantize(w.wk.ty(), &s.xn[..tokens * d], tokens, d)
                .expect(WIDTHS_CHECKED);
        }
        self.matmul(&w.wk, tokens, Buf::K);
        if w.wv.ty() != w.wk.ty() {
            let s = &mut self.scratch;
            s.xq.quantize(w.wv.ty(), &s.xn[..tokens * d], tokens, d)
                .expect(WIDTHS_CHECKED);
        }
        self.matmul(&w.wv, tokens, Buf::V);
        let s = &mut self.scratch;
        apply_rope(
            &mut s.q[..tokens * d],
            &s.rope,
            c.heads_count,
            c.head_dim,
            c.rope_dim,
        );
        apply_rope(
            &mut s.k[..tokens * kv_len],
            &s.rope,
            c.kv_heads_count,
            c.head_dim,
            c.rope_dim,
        );
        self.write_kv(layer, steps, slots, pool);
        self.attention(layer, steps, slots, pool);
        let s = &mut self.scratch;
        s.xq.quantize(w.wo.ty(), &s.attn[..tokens * d], tokens, d)
            .expect(WIDTHS_CHECKED);
        self.matmul(&w.wo, tokens, Buf::Delta);
        let s = &mut self.scratch;
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
        self.matmul(&w.w_gate, tokens, Buf::Gate);
        if w.w_up.ty() != w.w_gate.ty() {
            let s = &mut self.scratch;
            s.xq.quantize(w.w_up.ty(), &s.xn[..tokens * d], tokens, d)
                .expect(WIDTHS_CHECKED);
        }
        self.matmul(&w.w_up, tokens, Buf::Up);
        self.swiglu(tokens * ffn);
        let s = &mut self.scratch;
        s.xq.quantize(w.w_down.ty(), &s.gate[..tokens * ffn], tokens, ffn)
            .expect(WIDTHS_CHECKED);
        self.matmul(&w.w_down, tokens, Buf::Delta);
        let s = &mut self.scratch;
        add_into(&mut s.x[..tokens * d], &s.delta[..tokens * d]);
    }

    /// `gate = silu(gate) * up`, split across the pool.
    fn swiglu(&mut self, len: usize) {
        let s = &mut self.scratch;
        let chunks = self.threads.threads_count();
        let chunk_len = len.div_ceil(chunks);
        let gate = SharedOut(s.gate.as_mut_ptr());
        let up = &s.up[..len];
        let isa = self.isa;
        self.threads.run(chunks, &|i, _| {
            let start = (i * chunk_len).min(len);
            let end = ((i + 1) * chunk_len).min(len);
            // SAFETY: tasks own disjoint ranges [start, end) of `gate`.
            let gate =
                unsafe { std::slice::from_raw_parts_mut(gate.ptr().add(start), end - start) };
            vector::swiglu(isa, gate, &up[start..end]);
        });
    }

    /// Writes this layer's new K and V rows into each sequence's pages.
    fn write_kv(
        &mut self,
        layer: usize,
        steps: &[SeqStep<'_>],
        slots: &[TokenSlot],
        pool: &mut Pool,
    ) {
        let kv_len = self.model.config.kv_len();
        let page_tokens = pool.layout().geometry().page_tokens as usize;
        for (t, slot) in slots.iter().enumerate() {
            let table = steps[slot.seq_index].pages;
            let lease = table
                .lease(slot.pos / page_tokens)
                .expect("validated: position within the table");
            let row = t * kv_len..(t + 1) * kv_len;
            let slot_in_page = (slot.pos % page_tokens) as u32;
            pool.write_kv(
                lease,
                layer as u32,
                slot_in_page,
                &self.scratch.k[row.clone()],
                &self.scratch.v[row],
            )
            .expect("validated: every lease of the step is live");
        }
    }

    fn attention(&mut self, layer: usize, steps: &[SeqStep<'_>], slots: &[TokenSlot], pool: &Pool) {
        let c = &self.model.config;
        // Tasks: (sequence, kv head, chunk of that sequence's tokens).
        let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new(); // (seq, kv_head, t0, t1)
        let mut t0 = 0;
        for (seq_index, step) in steps.iter().enumerate() {
            let t_end = t0 + step.tokens.len();
            for kv_head in 0..c.kv_heads_count {
                let mut a = t0;
                while a < t_end {
                    let b = (a + ATTENTION_TOKENS_PER_TASK).min(t_end);
                    tasks.push((seq_index, kv_head, a, b));
                    a = b;
                }
            }
            t0 = t_end;
        }
        let ctx = AttentionContext {
            layer: layer as u32,
            isa: self.isa,
            heads_count: c.heads_count,
            head_dim: c.head_dim,
            kv_group: c.kv_group(),
            kv_len: c.kv_len(),
            page_tokens: pool.layout().geometry().page_tokens as usize,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let s = &mut self.scratch;
        let q = &s.q;
        let out = SharedOut(s.attn.as_mut_ptr());
        let workers = &s.workers;
        self.threads.run(tasks.len(), &|i, worker| {
            let (seq_index, kv_head, a, b) = tasks[i];
            let table = steps[seq_index].pages;
            let mut scratch = workers[worker].lock().unwrap_or_else(|e| e.into_inner());
            for (t, slot) in slots.iter().enumerate().take(b).skip(a) {
                ctx.token(pool, table, kv_head, slot.pos, q, t, out, &mut scratch);
            }
        });
    }

    /// Computes logits for the last token of each sequence that wants them.
    fn output_logits(&mut self, steps: &[SeqStep<'_>]) -> usize {
        let model = Arc::clone(&self.model);
        let c = &model.config;
        let d = c.embedding_len;
        let s = &mut self.scratch;
        let mut wanted = 0;
        let mut t_end = 0;
        for step in steps {
            t_end += step.tokens.len();
            if step.wants_logits {
                let last = t_end - 1;
                // xn is free after the last block: gather the rows there.
                s.xn[wanted * d..(wanted + 1) * d].copy_from_slice(&s.x[last * d..(last + 1) * d]);
                wanted += 1;
            }
        }
        if wanted == 0 {
            return 0;
        }
        rmsnorm_rows(
            &s.xn[..wanted * d],
            &model.output_norm,
            c.rms_eps,
            &mut s.out_norm[..wanted * d],
        );
        s.xq.quantize(model.output.ty(), &s.out_norm[..wanted * d], wanted, d)
            .expect(WIDTHS_CHECKED);
        self.matmul(&model.output, wanted, Buf::Logits);
        wanted
    }

    /// `dst[t][r] = W[r] · xq[t]`, output rows split across the pool.
    fn matmul(&mut self, matrix: &Matrix, tokens: usize, dst: Buf) {
        let model = Arc::clone(&self.model);
        let w = model.bytes(matrix);
        let rows = matrix.rows;
        let s = &mut self.scratch;
        let out = SharedOut(dst.select(s).as_mut_ptr());
        let tasks = self.threads.threads_count() * MATMUL_TASKS_PER_THREAD;
        let chunk = rows.div_ceil(tasks).next_multiple_of(MATMUL_ROWS_ALIGN);
        let tasks = rows.div_ceil(chunk);
        let (isa, ty, cols) = (self.isa, matrix.ty(), matrix.cols);
        let xq = &s.xq;
        let workers = &s.workers;
        self.threads.run(tasks, &|i, worker| {
            let start = (i * chunk).min(rows);
            let end = ((i + 1) * chunk).min(rows);
            if start == end {
                return;
            }
            let n = end - start;
            if tokens == 1 {
                // SAFETY: tasks own disjoint row ranges of the single output row.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(start), n) };
                quant::matmul(isa, ty, w, cols, start..end, xq, dst);
                return;
            }
            let mut scratch = workers[worker].lock().unwrap_or_else(|e| e.into_inner());
            let buf = &mut scratch.rows_out;
            buf.resize(tokens * n, 0.0);
            quant::matmul(isa, ty, w, cols, start..end, xq, &mut buf[..tokens * n]);
            for t in 0..tokens {
                // SAFETY: rows start..end of every token row belong to this task only.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out.ptr().add(t * rows + start), n) };
                dst.copy_from_slice(&buf[t * n..(t + 1) * n]);
            }
        });
    }
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

/// What every attention task needs to know about the layer.
struct AttentionContext {
    layer: u32,
    isa: Isa,
    heads_count: usize,
    head_dim: usize,
    kv_group: usize,
    kv_len: usize,
    page_tokens: usize,
    scale: f32,
}

impl AttentionContext {
    /// Attention of token `t` (at `pos`) for the query heads of `kv_head`, over
    /// positions `0..=pos` of its sequence, read page by page through its table.
    #[allow(clippy::too_many_arguments)]
    fn token(
        &self,
        pool: &Pool,
        table: &PageTable,
        kv_head: usize,
        pos: usize,
        q: &[f32],
        t: usize,
        out: SharedOut,
        scratch: &mut WorkerScratch,
    ) {
        let (hd, d, group) = (
            self.head_dim,
            self.heads_count * self.head_dim,
            self.kv_group,
        );
        let positions = pos + 1;
        let pages = positions.div_ceil(self.page_tokens);
        let kv_offset = kv_head * hd;
        let first_head = kv_head * group;
        // [group][context]: one score row per query head sharing this KV head.
        let context = scratch.scores.len() / group;
        let (scores, acc) = (&mut scratch.scores, &mut scratch.acc);
        // Each page is looked up (and its lease checked) once for the whole group.
        for page in 0..pages {
            let (k, _) = self.page(pool, table, page);
            let first = page * self.page_tokens;
            let used = (positions - first).min(self.page_tokens);
            for g in 0..group {
                let h = first_head + g;
                let q_row = &q[t * d + h * hd..t * d + (h + 1) * hd];
                let row = &mut scores[g * context + first..g * context + first + used];
                vector::dot_rows(self.isa, q_row, k, self.kv_len, kv_offset, self.scale, row);
            }
        }
        for g in 0..group {
            vector::softmax(self.isa, &mut scores[g * context..g * context + positions]);
        }
        acc[..group * hd].fill(0.0);
        for page in 0..pages {
            let (_, v) = self.page(pool, table, page);
            let first = page * self.page_tokens;
            let used = (positions - first).min(self.page_tokens);
            for g in 0..group {
                let p = &scores[g * context + first..g * context + first + used];
                let acc = &mut acc[g * hd..(g + 1) * hd];
                vector::axpy_rows(self.isa, p, v, self.kv_len, kv_offset, acc);
            }
        }
        // SAFETY: token t's heads first_head..first_head + group belong to exactly
        // one task (the one for this token's KV head).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(out.ptr().add(t * d + first_head * hd), group * hd)
        };
        dst.copy_from_slice(&acc[..group * hd]);
    }

    /// K and V (`[page_tokens][kv_len]` each) of this layer in the table's
    /// `index`-th page; the pool asserts the lease's owner and generation.
    fn page<'p>(&self, pool: &'p Pool, table: &PageTable, index: usize) -> (&'p [f32], &'p [f32]) {
        let lease = table
            .lease(index)
            .expect("validated: position within the table");
        pool.page_kv(lease, self.layer)
            .expect("validated: every lease of the step is live")
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

/// Rotates adjacent pairs `(x[2i], x[2i+1])` of the first `rope_dim` dims of each
/// head (the GGUF llama layout, whose Q/K weights are permuted for it).
fn apply_rope(x: &mut [f32], rope: &[f32], heads: usize, head_dim: usize, rope_dim: usize) {
    let width = heads * head_dim;
    let pairs = rope_dim / 2;
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let table = &rope[t * pairs * 2..(t + 1) * pairs * 2];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..pairs {
                let (cos, sin) = (table[2 * i], table[2 * i + 1]);
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos - b * sin;
                head[2 * i + 1] = a * sin + b * cos;
            }
        }
    }
}

fn add_into(x: &mut [f32], delta: &[f32]) {
    x.iter_mut().zip(delta).for_each(|(a, b)| *a += b);
}
